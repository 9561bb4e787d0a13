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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vlberts.data.refcoco import Box
from vlberts.tasks.predictions import choose

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
