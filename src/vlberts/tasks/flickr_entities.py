"""Flickr30K Entities phrase grounding: positive regions, R@K, the upper bound, and the predictions file.

Metric (formats-and-metrics.md §5 "Flickr30K Entities"; VisualBERT ``compute_score_with_logits_flickr``,
BAN): every entity (phrase) whose chain has at least one gold box is scored; the model ranks the candidate
regions (the feature store's proposals) and

  R@K          = % of entities with a positive region among the K top-ranked ones (K = 1, 5, 10)
  upper bound  = % of entities with a positive region among all the candidates (no ranking can beat it)

The denominator is every entity with gold boxes, so an entity without any positive proposal always counts
as wrong (R@K <= upper bound).

Positive region (``iou_rule``):
  any    IoU >= 0.5 with ANY gold box of the phrase's chain (BAN / VisualBERT, ``get_match_index``): the
         default
  union  IoU >= 0.5 with the union box of the chain's gold boxes (Plummer et al. 2015's protocol for
         phrases with several boxes; for a one-box chain the two rules agree)

IoU is `tasks.refcoco.box_iou` on float xyxy pixel edges (the library's convention; the reader converts
the XML's 1-based inclusive pixels).

Ranking: regions by descending score; ties go to the lower index (``argmax``/stable sort), so the
highest-confidence baseline on a confidence-ordered store ranks exactly in store order.

Predictions files (`write_predictions`, `read_predictions`, `evaluate_predictions`): Flickr30K Entities
has no official results format (BAN and VisualBERT score in memory); ours is documented below.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vlberts.data.flickr_entities import Box, GroundedPhrase, read_flickr_entities, read_flickr_split
from vlberts.errors import VlbertsError
from vlberts.io import read_json, require_keys, write_json
from vlberts.tasks.predictions import require_complete, unique_rows
from vlberts.tasks.refcoco import box_iou

IOU_THRESHOLD = 0.5
IOU_RULES = ("any", "union")
KS = (1, 5, 10)
TOP_K = max(KS)  # boxes kept per phrase in a predictions file


def union_box(boxes: Sequence[Box]) -> Box:
    """The smallest xyxy box holding every box (Plummer et al.'s box for a multi-box phrase)."""
    if not boxes:
        raise ValueError("no boxes to unite")
    return (min(b[0] for b in boxes), min(b[1] for b in boxes), max(b[2] for b in boxes), max(b[3] for b in boxes))


def positive_regions(
    region_boxes: Sequence[Box], gold_boxes: Sequence[Box], rule: str = "any", threshold: float = IOU_THRESHOLD
) -> list[bool]:
    """Per region (xyxy), whether it is a positive for the phrase with these gold boxes (module docstring)."""
    if rule not in IOU_RULES:
        raise VlbertsError(f"unknown iou_rule {rule!r}; valid: {', '.join(IOU_RULES)}")
    if not gold_boxes:
        raise ValueError("a phrase without gold boxes has no positive regions (skip it before scoring)")
    golds = [union_box(gold_boxes)] if rule == "union" else list(gold_boxes)
    return [any(box_iou(r, g) >= threshold for g in golds) for r in region_boxes]


def rank_regions(scores: Sequence[float]) -> list[int]:
    """Region indices by descending score; ties keep the lower index first. NaN is an error."""
    for i, s in enumerate(scores):
        if math.isnan(s):
            raise ValueError(f"score {i} is NaN")
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


def hits_at_k(ranked_positive: Sequence[bool], ks: Sequence[int] = KS) -> dict[int, bool]:
    """K -> whether one of the first K ranked regions is positive."""
    return {k: any(ranked_positive[:k]) for k in ks}


@dataclass(frozen=True)
class GroundingScores:
    """R@K and the upper bound (percent) over `num_entities` entities with gold boxes."""

    recall: dict[int, float]  # K -> R@K in percent
    upper_bound: float | None  # None when the candidates are unknown (a predictions file without a store)
    num_entities: int

    def to_dict(self) -> dict:
        out: dict = {f"r@{k}": v for k, v in self.recall.items()}
        if self.upper_bound is not None:
            out["upper_bound"] = self.upper_bound
        out["num_entities"] = self.num_entities
        return out


def score_rankings(
    ranked_positive: Sequence[Sequence[bool] | None], reachable: Sequence[bool] | None = None, ks: Sequence[int] = KS
) -> GroundingScores:
    """R@K from each entity's ranked positive flags (None: the model gave no ranking, counted wrong), and the
    upper bound from `reachable` (per entity: any positive candidate at all), when given."""
    n = len(ranked_positive)
    if n == 0:
        raise ValueError("no entities to score")
    if reachable is not None and len(reachable) != n:
        raise ValueError("reachable must have one entry per entity")
    hits = {k: 0 for k in ks}
    for flags in ranked_positive:
        if flags is None:
            continue
        for k, hit in hits_at_k(flags, ks).items():
            hits[k] += hit
    upper = None if reachable is None else 100.0 * sum(map(bool, reachable)) / n
    return GroundingScores({k: 100.0 * h / n for k, h in hits.items()}, upper, n)


def score_regions(
    region_scores: Sequence[Sequence[float] | None],
    region_boxes: Sequence[Sequence[Box]],
    gold_boxes: Sequence[Sequence[Box]],
    rule: str = "any",
    ks: Sequence[int] = KS,
) -> GroundingScores:
    """R@K and the upper bound of per-entity region scores: entity e scores candidates `region_boxes[e]`
    (xyxy) with `region_scores[e]` (None: not scored, wrong) against its chain's `gold_boxes[e]`."""
    if not len(region_scores) == len(region_boxes) == len(gold_boxes):
        raise ValueError("region_scores, region_boxes and gold_boxes must have one entry per entity")
    ranked, reachable = [], []
    for e, (scores, boxes, gold) in enumerate(zip(region_scores, region_boxes, gold_boxes)):
        pos = positive_regions(boxes, gold, rule)
        reachable.append(any(pos))
        if scores is None:
            ranked.append(None)
            continue
        if len(scores) != len(boxes):
            raise ValueError(f"entity {e}: {len(scores)} scores for {len(boxes)} regions")
        ranked.append([pos[i] for i in rank_regions(scores)])
    return score_rankings(ranked, reachable, ks)


# --------------------------------------------------------------------------- predictions files

# Flickr30K Entities has no official results format; ours is one JSON list with a row per evaluated phrase:
#
#   {"image_id": "1234", "split": "test", "sentence": 0, "chain_id": 123401, "first_word_index": 0,
#    "phrase": "a red circle", "boxes": [[x, y, w, h], ...], "scores": [s1, s2, ...]}
#
# image_id is the Sentences/<id>.txt name; sentence the caption's 0-based line (blank lines not counted);
# first_word_index the phrase's first word in the caption (markup removed): (image_id, sentence,
# first_word_index) names the phrase, chain_id must be the one it has there. boxes are up to the top 10
# candidate regions, best first, in pixels (x, y = top-left edge), scores theirs (the head-averaged
# attention of the phrase's last subword). A phrase the model could not see (cut off by the text budget)
# has empty lists and counts as wrong. `evaluate_predictions` scores the boxes alone: a box is positive
# when IoU >= 0.5 with a gold box of the chain (or their union box, rule "union").
PREDICTION_KEYS = ("image_id", "split", "sentence", "chain_id", "first_word_index", "boxes", "scores")
PhraseKey = tuple[str, int, int]  # (image_id, sentence, first_word_index)


def phrase_key(row: dict) -> PhraseKey:
    return (str(row["image_id"]), int(row["sentence"]), int(row["first_word_index"]))


def _key_text(key: PhraseKey) -> str:
    return f"image {key[0]} sentence {key[1]} word {key[2]}"


def write_predictions(path: str | Path, rows: Iterable[dict]) -> int:
    """Write prediction rows (format above) atomically; a repeated (split, phrase) is an error. Returns the count."""
    rows = list(rows)
    unique_rows((((r["split"], *phrase_key(r)), r) for r in rows), path=path, label="phrase")
    write_json(path, rows, indent=None)
    return len(rows)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def read_predictions(path: str | Path, split: str) -> dict[PhraseKey, tuple[int, list[Box]]]:
    """The rows of `split`: phrase key -> (chain_id, ranked boxes as xyxy); malformed rows and repeats are
    one-line errors naming the row."""
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, list):
        raise VlbertsError("expected a JSON list of phrase rows {image_id, split, sentence, chain_id, "
                           "first_word_index, boxes, scores}", path=path)
    out: dict[PhraseKey, tuple[int, list[Box]]] = {}
    for i, rec in enumerate(data):
        where = f"predictions[{i}]"
        require_keys(rec, PREDICTION_KEYS, path=path, record=where)
        ints = [rec[k] for k in ("sentence", "chain_id", "first_word_index")]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints):
            raise VlbertsError(f"sentence, chain_id and first_word_index must be integers, got {ints!r}", path=path,
                               record=where)
        if rec["split"] != split:
            continue
        key = phrase_key(rec)
        boxes, scores = rec["boxes"], rec["scores"]
        if not isinstance(boxes, list) or not isinstance(scores, list) or len(boxes) != len(scores):
            raise VlbertsError("boxes and scores must be lists of the same length", path=path, record=_key_text(key))
        for box in boxes:
            if not isinstance(box, list) or len(box) != 4 or not all(map(_is_number, box)) or box[2] < 0 or box[3] < 0:
                raise VlbertsError(f"a box must be [x, y, w, h] with w, h >= 0, got {box!r}", path=path,
                                   record=_key_text(key))
        if not all(map(_is_number, scores)):
            raise VlbertsError("scores must be finite numbers", path=path, record=_key_text(key))
        if key in out:
            raise VlbertsError("duplicate prediction", path=path, record=_key_text(key))
        out[key] = (rec["chain_id"], [(float(x), float(y), float(x) + float(w), float(y) + float(h))
                                      for x, y, w, h in boxes])
    return out


@dataclass(frozen=True)
class GoldPhrase:
    """An entity to score: its phrase key, chain and gold boxes (xyxy)."""

    key: PhraseKey
    chain_id: int
    text: str
    gold_boxes: tuple[Box, ...]


def skip_reason(phrase: GroundedPhrase) -> str | None:
    """Why a phrase is not scored (BAN/VisualBERT: its chain has no box), or None when it has gold boxes:
    "notvisual" (chain 0), "scene" (a scene chain without boxes), "no box" (nobndbox, or absent from the XML)."""
    if phrase.chain_id == 0:
        return "notvisual"
    if not phrase.boxes:
        return "scene" if phrase.is_scene else "no box"
    return None


def gold_phrases(entities: str | Path, split: str, skipped: Counter | None = None) -> list[GoldPhrase]:
    """Every phrase of the split's images that has gold boxes, in file order; the others are counted in
    `skipped` by `skip_reason`. A malformed Sentences/Annotations file is an error naming it."""
    out = []
    for image_id in read_flickr_split(entities, split):
        image = read_flickr_entities(entities, image_id)
        for cap in image.captions:
            for gp in cap.phrases:
                reason = skip_reason(gp)
                if reason is not None:
                    if skipped is not None:
                        skipped[reason] += 1
                    continue
                p = gp.phrase
                out.append(GoldPhrase((image_id, cap.index, p.first_word_index), p.chain_id, p.text, gp.boxes))
    return out


def evaluate_predictions(
    predictions_path: str | Path, entities: str | Path, split: str = "test", *, rule: str = "any",
    store=None, max_regions: int = 36,
) -> dict:
    """R@1/5/10 of a predictions file on one split of a Flickr30K Entities directory, from its boxes alone.

    Every entity with gold boxes of the split needs a row (rows of other splits are ignored), and every row
    of the split must name such an entity with its own chain id. With `store` (the feature store the
    candidates came from, its first `max_regions` regions per image) the upper bound and the
    highest-confidence baseline (regions ranked by the store's obj_conf) are added."""
    if rule not in IOU_RULES:
        raise VlbertsError(f"unknown iou_rule {rule!r}; valid: {', '.join(IOU_RULES)}")
    skipped: Counter = Counter()
    phrases = gold_phrases(entities, split, skipped)
    if not phrases:
        raise VlbertsError(f"split {split!r} has no phrases with gold boxes", path=Path(entities) / f"{split}.txt")
    preds = read_predictions(predictions_path, split)
    by_key = {p.key: p for p in phrases}
    for key, (chain, _) in preds.items():
        if key not in by_key:
            raise VlbertsError(f"not a phrase with gold boxes of split {split}", path=predictions_path,
                               record=_key_text(key))
        if by_key[key].chain_id != chain:
            raise VlbertsError(f"chain_id {chain} but the phrase belongs to chain {by_key[key].chain_id}",
                               path=predictions_path, record=_key_text(key))
    require_complete(preds, [p.key for p in phrases], path=predictions_path, label="phrase")
    ranked = [positive_regions(preds[p.key][1], p.gold_boxes, rule) for p in phrases]  # best box first
    out: dict = {"split": split, "iou_rule": rule, "skipped_phrases": dict(sorted(skipped.items()))}
    if store is None:
        out.update(score_rankings(ranked).to_dict())
        return out
    cands, conf = candidates(store, [p.key[0] for p in phrases], max_regions)
    golds = [p.gold_boxes for p in phrases]
    reachable = [any(positive_regions(b, g, rule)) for b, g in zip(cands, golds)]
    out.update(score_rankings(ranked, reachable).to_dict())
    if all(c is not None for c in conf):
        out["baseline"] = {f"r@{k}": v for k, v in score_regions(conf, cands, golds, rule).recall.items()}
    return out


def candidates(store, image_ids: Sequence[str], max_regions: int) -> tuple[list[list[Box]], list[list[float] | None]]:
    """Per entry, its image's candidate boxes (the store's first `max_regions`, xyxy pixels) and their
    detector confidences (obj_conf; None where the store has none). A missing image is an error."""
    cache: dict[str, tuple[list[Box], list[float] | None]] = {}
    boxes, conf = [], []
    for image_id in image_ids:
        if image_id not in cache:
            if image_id not in store:
                raise VlbertsError(f"image id {image_id} not in store", path=getattr(store, "path", None),
                                   record=image_id)
            rec = store.get(image_id)
            c = getattr(rec, "obj_conf", None)
            cache[image_id] = ([tuple(b) for b in rec.boxes[:max_regions].tolist()],
                               None if c is None else c[:max_regions].tolist())
        b, c = cache[image_id]
        boxes.append(b)
        conf.append(c)
    return boxes, conf
