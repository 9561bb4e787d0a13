"""RefCOCO+: per-region targets (binary or soft IoU) and accuracy of the top-scoring region.

Metric (SPEC §4; formats-and-metrics.md §5; Yu et al. 2016, ViLBERT §4, VL-BERT §4.2): an expression is
correct when the region the model scores highest overlaps the gold box with IoU >= 0.5; accuracy is the
percentage correct. The standard protocol states ">= 0.5"; the VL-BERT (``RefAccuracy``) and ViLBERT
code use a strict ``> 0.5``, available as ``strict=True`` (the two differ only at exactly 0.5).

IoU is computed on float xyxy pixel edges, area = (x2 - x1) * (y2 - y1) (COCO's convention for its
xywh boxes). ViLBERT adds one pixel to widths and heights (inclusive-pixel convention), which shifts
IoU slightly for small boxes; we do not.

Training targets (ViLBERT ``V-logit``): region i gets 1 if IoU(i, gold) >= 0.5 else 0 (binary), or, with
``soft=True``, IoU(i, gold) itself when >= 0.5 and 0 below (soft IoU targets).

`RefScores.upper_bound` is the percentage of expressions with at least one candidate region at
IoU >= threshold: no scorer can beat it on that candidate set (relevant for detected regions).

Predictions files (`write_predictions`, `read_predictions`, `evaluate_predictions`): RefCOCO+ has no
official results format; ours is a JSON list with one row per expression (section below).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vlberts.data.refcoco import Box, read_refcoco, xywh_to_xyxy
from vlberts.errors import VlbertsError
from vlberts.io import read_json, require_keys, write_json
from vlberts.tasks.predictions import choose, require_complete, unique_rows

IOU_THRESHOLD = 0.5


def box_iou(a: Box, b: Box) -> float:
    """IoU of two xyxy boxes; 0 when the union is empty (two degenerate boxes)."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _hit(iou: float, threshold: float, strict: bool) -> bool:
    return iou > threshold if strict else iou >= threshold


def region_targets(
    boxes: Sequence[Box], gold: Box, *, soft: bool = False, threshold: float = IOU_THRESHOLD
) -> list[float]:
    """Per-region targets against the gold box (xyxy): 1/0 at IoU >= threshold, or the IoU itself if `soft`."""
    out = []
    for box in boxes:
        iou = box_iou(box, gold)
        out.append((iou if soft else 1.0) if iou >= threshold else 0.0)
    return out


def top_region(scores: Sequence[float]) -> int:
    """Index of the highest-scoring region; ties go to the lowest index (``argmax``). NaN is an error."""
    return choose(scores)


@dataclass(frozen=True)
class RefScores:
    """Accuracy (percent) of the chosen regions, and the candidate sets' upper bound (percent)."""

    accuracy: float
    upper_bound: float
    num_expressions: int
    num_correct: int

    def to_dict(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "upper_bound": self.upper_bound,
            "num_expressions": self.num_expressions,
            "num_correct": self.num_correct,
        }

    def summary(self) -> str:
        return (f"RefCOCO+ accuracy {self.accuracy:.2f}% on {self.num_expressions} expressions "
                f"(upper bound {self.upper_bound:.2f}%)")


def score_regions(
    region_scores: Sequence[Sequence[float]],
    region_boxes: Sequence[Sequence[Box]],
    gold_boxes: Sequence[Box],
    *,
    threshold: float = IOU_THRESHOLD,
    strict: bool = False,
) -> RefScores:
    """Accuracy of the top-scoring region per expression; all boxes xyxy.

    `region_scores[e][i]` scores candidate `region_boxes[e][i]` for expression `e` with gold box
    `gold_boxes[e]`. Correct when IoU(top region, gold) >= `threshold` (> with `strict`).
    """
    if not gold_boxes:
        raise ValueError("no expressions to score")
    if not len(region_scores) == len(region_boxes) == len(gold_boxes):
        raise ValueError("region_scores, region_boxes and gold_boxes must have one entry per expression")
    correct = reachable = 0
    for e, (scores, boxes, gold) in enumerate(zip(region_scores, region_boxes, gold_boxes)):
        if len(scores) != len(boxes):
            raise ValueError(f"expression {e}: {len(scores)} scores for {len(boxes)} regions")
        ious = [box_iou(b, gold) for b in boxes]
        correct += _hit(ious[top_region(scores)], threshold, strict)
        reachable += any(_hit(iou, threshold, strict) for iou in ious)
    n = len(gold_boxes)
    return RefScores(accuracy=100.0 * correct / n, upper_bound=100.0 * reachable / n, num_expressions=n,
                     num_correct=correct)


# --------------------------------------------------------------------------- predictions files

# RefCOCO+ has no official results format (MAttNet, ViLBERT and VL-BERT score in memory); ours is one
# JSON list of ``{"sent_id", "ref_id", "split", "box": [x, y, w, h] pixels, "score"}``, one row per
# expression, scored by `evaluate_predictions` against the refs and their instances.
PREDICTION_KEYS = ("sent_id", "ref_id", "box")


def write_predictions(path: str | Path, rows: Iterable[dict]) -> int:
    """Write prediction rows (keys above) atomically; a repeated sent_id is an error. Returns the count."""
    rows = list(rows)
    unique_rows(((r["sent_id"], r) for r in rows), path=path, label="sent_id")
    write_json(path, rows, indent=None)
    return len(rows)


def read_predictions(path: str | Path) -> dict[int, tuple[int, Box, int | None]]:
    """sent_id -> (ref_id, predicted box xywh); malformed rows and repeated sent_ids are one-line errors."""
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, list):
        raise VlbertsError("expected a JSON list of {sent_id, ref_id, box: [x, y, w, h]} predictions", path=path)
    out: dict[int, tuple[int, Box]] = {}
    for i, rec in enumerate(data):
        where = f"predictions[{i}]"
        require_keys(rec, PREDICTION_KEYS, path=path, record=where)
        sid, rid, box = rec["sent_id"], rec["ref_id"], rec["box"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (sid, rid)):
            raise VlbertsError(f"sent_id and ref_id must be integers, got {sid!r}, {rid!r}", path=path, record=where)
        if (not isinstance(box, list) or len(box) != 4
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box)
                or box[2] < 0 or box[3] < 0):
            raise VlbertsError(f"box must be [x, y, w, h] with w, h >= 0, got {box!r}", path=path,
                               record=f"sent_id {sid}")
        if sid in out:
            raise VlbertsError("duplicate prediction", path=path, record=f"sent_id {sid}")
        image = rec.get("image_id")  # optional (vlberts writes it): checked against the expression's image
        if image is not None and (not isinstance(image, int) or isinstance(image, bool)):
            raise VlbertsError(f"image_id must be an integer, got {image!r}", path=path, record=f"sent_id {sid}")
        out[sid] = (rid, (float(box[0]), float(box[1]), float(box[2]), float(box[3])), image)
    return out


def evaluate_predictions(
    predictions_path: str | Path, refs_path: str | Path, instances_path: str | Path,
    splits: Sequence[str] | None = None, *, strict: bool = False,
) -> dict:
    """Accuracy (IoU(predicted box, gold box) >= 0.5; > with `strict`) per split of a predictions file.

    `splits` default: every split of ("val", "testA", "testB", "train") holding a predicted
    expression; every expression of a scored split needs a prediction, and a prediction must name an
    expression of the refs with its own ref_id. Returns ``{"splits": {split: {accuracy, num_expressions,
    num_correct}}, "accuracy": <first split's>}``."""
    data = read_refcoco(refs_path, instances_path)
    preds = read_predictions(predictions_path)
    by_sent = {s.sent_id: ref for ref in data.refs for s in ref.sentences}
    for sid, (rid, _, image) in preds.items():
        ref = by_sent.get(sid)
        if ref is None:
            raise VlbertsError("not an expression of the refs", path=predictions_path, record=f"sent_id {sid}")
        if ref.ref_id != rid:
            raise VlbertsError(f"ref_id {rid} but the expression belongs to ref {ref.ref_id}",
                               path=predictions_path, record=f"sent_id {sid}")
        if image is not None and image != ref.image_id:
            raise VlbertsError(f"image_id {image} but the expression is of image {ref.image_id}",
                               path=predictions_path, record=f"sent_id {sid}")
    if splits is None:
        splits = [s for s in ("val", "testA", "testB", "train")
                  if any(e.sent_id in preds for e in data.expressions(s))]
    if not splits:
        raise VlbertsError("no predictions to score", path=predictions_path)
    out: dict = {"splits": {}}
    for split in splits:
        exprs = data.expressions(split)
        if not exprs:
            raise VlbertsError(f"split {split!r} has no expressions", path=refs_path)
        require_complete(preds, [e.sent_id for e in exprs], path=predictions_path, label="sent_id")
        correct = sum(_hit(box_iou(xywh_to_xyxy(preds[e.sent_id][1]), e.gold_box_xyxy), IOU_THRESHOLD, strict)
                      for e in exprs)
        out["splits"][split] = {"accuracy": 100.0 * correct / len(exprs), "num_expressions": len(exprs),
                                "num_correct": correct}
    out["accuracy"] = out["splits"][splits[0]]["accuracy"]
    return out
