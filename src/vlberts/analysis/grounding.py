"""Entity grounding by attention heads ("What Does BERT with Vision Look At?", §3.1, Figure 3).

Each attention head is read as a ready-made classifier: given an entity of the caption, it predicts the
image region its attention from the entity's token favours most. Per head we count how often that
region matches the gold annotation (IoU >= 0.5), compare with a baseline that always picks the most
confident detection, and flag the heads that actually look at the image (on average more than 20% of
the entity's attention goes to regions).

Pure computation: numbers in, numbers out. The driver runs a model and hands over, per caption, a
`GroundingInput`; a `GroundingAccumulator` consumes captions one at a time (memory and time per
caption independent of how many came before) and produces a `GroundingResult`.

Works for every architecture:
- single-stream models (VisualBERT, VL-BERT, W-VisualBERT): `attn` is the text-rows x region-columns
  slice of the joint self-attention map, so its rows sum to the share of attention that went to the
  image, not to 1; `region_mass` is that share;
- two-stream models (ViLBERT, LXMERT): `attn` is the text-to-vision cross-attention, rows sum to 1 over
  the regions; `region_mass` is 1 everywhere and every head counts as active;
- layers that do not see the regions (VisualBERT without early fusion, before its fusion layer): `attn`
  is zero, so their heads have zero region mass, are never active and never score a hit.

Letters in shape comments: L layers, H heads, T text tokens, R regions, E entities of a caption,
K gold boxes of an entity.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from vlberts.analysis.boxes import as_boxes, box_iou, union_box
from vlberts.config import from_dict as _options_from_dict
from vlberts.config import to_dict as _options_to_dict
from vlberts.io import nan_as_null

TokenChoice = Literal["last", "first", "head_mean", "mean"]
IouRule = Literal["any", "union"]

# Attention probabilities are computed in float32 (or bf16); a row may exceed 1 by rounding.
_MASS_TOL = 1e-3


@dataclass(frozen=True)
class GroundingOptions:
    """The choices §3.1 leaves open, each with a default and the reason for it.

    token: which text position stands for a (possibly multi-word, multi-subword) entity.
        "last" (default): the last subword of the phrase's last word. Flickr30K Entities phrases
            are short noun-phrase chunks ("a young man", "two white dogs"), whose head noun comes
            last in English, and it is what VisualBERT's own Flickr30K fine-tuning reads: "whichever
            box receives the most attention from the last sub-word of the phrase" (paper App. B.4;
            BAN `find_sublist` returns the last word).
        "first": the first subword of the first word (often a determiner: a weak choice, kept to
            show how much the choice matters).
        "head_mean": the mean of the attention rows of the last word's subwords, so that a head word
            split into pieces ("skate ##board") is read as one word.
        "mean": the mean of the attention rows of every subword of the phrase.
        The mean options average the rows before the argmax; the region mass is averaged the same
        way, so the active flag always describes the rows that made the prediction.
    iou_rule: when a prediction "agrees with the annotation" for an entity with several gold boxes
        (plural phrases: "two dogs").
        "any" (default): IoU >= threshold with any gold box of the entity, as BAN's
            `get_match_index`, which VisualBERT's Flickr30K code uses; the paper cites BAN (Kim et al.,
            2018) for the rule, so this is the closest reading.
        "union": IoU with the union box of the gold boxes, the original Flickr30K Entities protocol
            (Plummer et al., 2015).
        The two agree for single-box entities.
    iou_threshold: 0.5, compared with `>=` ("IoU >= 0.5", §3.1).
    active_threshold: 0.2 (§3.1 and its footnote). The quantity compared is, per head, the mean over
        entities (each entity weighs the same, whatever its number of subwords or gold boxes) of the
        share of the entity token's attention row that goes to image regions. The share is taken
        from the full row, before the restriction to regions (after it, it would always be 1).
    active_inclusive: False (default): active iff that mean is strictly more than the threshold,
        as §3.1 puts it ("paying on average more than 20%"). True: active iff it is at least the
        threshold, the arXiv version's footnote reading (heads with "< 20%" drawn light). The two
        differ only for a mean of exactly 0.2.
    Accuracy is computed for every head, active or not (§3.1 reports all 144).
    """

    token: TokenChoice = "last"
    iou_rule: IouRule = "any"
    iou_threshold: float = 0.5
    active_threshold: float = 0.2
    active_inclusive: bool = False

    def __post_init__(self) -> None:
        if self.token not in ("last", "first", "head_mean", "mean"):
            raise ValueError(f"token must be one of last, first, head_mean, mean; got {self.token!r}")
        if self.iou_rule not in ("any", "union"):
            raise ValueError(f"iou_rule must be 'any' or 'union'; got {self.iou_rule!r}")
        if not 0.0 < self.iou_threshold <= 1.0:
            raise ValueError(f"iou_threshold must be in (0, 1]; got {self.iou_threshold}")
        if not 0.0 <= self.active_threshold <= 1.0:
            raise ValueError(f"active_threshold must be in [0, 1]; got {self.active_threshold}")

    def to_dict(self) -> dict[str, Any]:
        return _options_to_dict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroundingOptions:
        """Strict: unknown keys and bad values are `VlbertsError`s (vlberts.config.from_dict)."""
        return _options_from_dict(cls, data, where="GroundingOptions")


@dataclass
class GroundingEntity:
    """One annotated entity (a Flickr30K Entities phrase with at least one gold box).

    word_tokens: the entity's positions on the text axis T of `GroundingInput.attn`, grouped by word,
        in order: "the skate ##board" at positions 4, 5, 6 is [[4], [5, 6]]. Positions are those of the
        arrays handed over (so they include the [CLS] offset if `attn` keeps [CLS] at position 0).
    gold_boxes: (K, 4) float xyxy pixels, K >= 1. Entities without a box (Flickr30K `nobndbox`,
        `scene`-only, `notvisual`) are not grounded and must be left out by the driver, as BAN and
        VisualBERT do.
    caption_id, chain_id, phrase, types: for reporting (and `EntityBreakdown`'s groups) only.
    """

    word_tokens: list[list[int]]
    gold_boxes: np.ndarray  # (K, 4)
    caption_id: str = ""
    chain_id: str = ""
    phrase: str = ""
    types: tuple[str, ...] = ()  # the Flickr30K Entities type(s) of its chain (people, clothing, ..., other)

    def __post_init__(self) -> None:
        where = f"entity {self.phrase!r} (caption {self.caption_id!r}, chain {self.chain_id!r})"
        words = [[int(p) for p in w] for w in self.word_tokens]
        if not words or any(len(w) == 0 for w in words):
            raise ValueError(f"{where}: word_tokens must be a non-empty list of non-empty lists")
        flat = [p for w in words for p in w]
        if len(set(flat)) != len(flat):
            raise ValueError(f"{where}: a token position appears twice in word_tokens {words}")
        self.word_tokens = words
        try:
            self.gold_boxes = as_boxes(self.gold_boxes, "gold_boxes")
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if self.gold_boxes.shape[0] == 0:
            raise ValueError(f"{where}: no gold box; leave ungrounded entities out")

    def positions(self, token: TokenChoice) -> list[int]:
        """The positions whose attention rows are averaged to represent the entity."""
        return token_positions(self.word_tokens, token)


def token_positions(word_tokens: Sequence[Sequence[int]], token: TokenChoice) -> list[int]:
    """The text positions whose attention rows stand for a run of words (`GroundingOptions.token`).

    `word_tokens` groups positions by word, in order. For an entity it is the phrase's words; the
    syntactic analysis (§3.1, "Syntactic Grounding") passes a single word, for which "last" and "first"
    are that word's last and first subword and "head_mean" and "mean" both average its subwords.
    """
    if token == "last":
        return [int(word_tokens[-1][-1])]
    if token == "first":
        return [int(word_tokens[0][0])]
    if token == "head_mean":
        return [int(p) for p in word_tokens[-1]]
    if token == "mean":
        return [int(p) for w in word_tokens for p in w]
    raise ValueError(f"unknown token choice {token!r}")


@dataclass
class GroundingInput:
    """What the driver hands over for one caption.

    attn: (L, H, T, R) float attention from each text token to each region, per layer and head.
        Single-stream: the region columns of the joint attention rows (rows sum to < 1).
        Two-stream: the text-to-vision cross-attention (rows sum to 1).
    region_boxes: (R, 4) float xyxy pixels, in the same frame as the gold boxes.
    region_conf: (R,) detection confidences (for the baseline), or None where there are none (a store without
        them, `--baseline=none`): the baseline is then not a number (NaN; "n/a" in the reports).
    entities: the caption's grounded entities (may be empty; the caption then adds nothing).
    region_mass: (L, H, T) share of each token's full attention row that goes to regions; None means
        `attn` summed over the valid regions, which is exactly that share for both kinds of map.
    region_valid: (R,) bool, False for padded regions; None means all valid. Invalid regions are never
        predicted, never the baseline, and never count toward the upper bound.
    maps: which of the model's attention maps `attn` comes from, in words (for the report).
    text_attn: (L', H, T, T) attention among the text tokens (`AttentionMaps.text_to_text`), when the
        driver was asked for it (`text_syntax.py` reads it); not used by the grounding itself.

    Arrays may be any float dtype (float32 as produced by the model is fine; bf16 must be cast first).
    Text padding needs nothing: padded token positions are simply never named by an entity.
    """

    attn: np.ndarray  # (L, H, T, R)
    region_boxes: np.ndarray  # (R, 4)
    region_conf: np.ndarray | None  # (R,)
    entities: list[GroundingEntity] = field(default_factory=list)
    region_mass: np.ndarray | None = None  # (L, H, T)
    region_valid: np.ndarray | None = None  # (R,) bool
    maps: str = ""  # which attention maps `attn` was read from, in words (`AttentionMaps.describe()`)
    text_attn: np.ndarray | None = None  # (L', H, T, T)

    def __post_init__(self) -> None:
        attn = np.asarray(self.attn)
        if attn.ndim != 4:
            raise ValueError(f"attn must have shape (L, H, T, R), got {attn.shape}")
        if not np.issubdtype(attn.dtype, np.floating):
            raise ValueError(f"attn must be a float array, got dtype {attn.dtype}")
        L, H, T, R = attn.shape
        if R == 0:
            raise ValueError("attn has no regions (R = 0)")
        if not np.isfinite(attn).all() or (attn < 0).any():
            raise ValueError("attn must hold finite, non-negative attention probabilities")
        self.attn = attn
        self.region_boxes = as_boxes(self.region_boxes, "region_boxes")
        if self.region_boxes.shape[0] != R:
            raise ValueError(f"region_boxes has {self.region_boxes.shape[0]} boxes but attn has R = {R}")
        if self.region_conf is not None:  # (None: no baseline)
            self.region_conf = np.asarray(self.region_conf, dtype=np.float64)
            if self.region_conf.shape != (R,) or not np.isfinite(self.region_conf).all():
                raise ValueError(f"region_conf must be finite with shape ({R},), got {self.region_conf.shape}")
        if self.region_valid is None:
            self.region_valid = np.ones(R, dtype=bool)
        else:
            valid = np.asarray(self.region_valid)
            # A bool mask, not region indices: np.array([0, 2]) would silently mean something else.
            if valid.dtype != np.bool_ or valid.shape != (R,):
                raise ValueError(
                    f"region_valid must be a bool array of shape ({R},), got {valid.dtype} {valid.shape}"
                )
            if not valid.any():
                raise ValueError("region_valid marks every region as padding")
            self.region_valid = valid
        if self.region_mass is None:
            self.region_mass = (attn * self.region_valid).sum(-1, dtype=np.float64)  # (L, H, T)
        else:
            mass = np.asarray(self.region_mass, dtype=np.float64)
            if mass.shape != (L, H, T):
                raise ValueError(f"region_mass must have shape (L, H, T) = {(L, H, T)}, got {mass.shape}")
            if not np.isfinite(mass).all() or (mass < 0).any() or (mass > 1 + _MASS_TOL).any():
                raise ValueError("region_mass must be a share of attention, in [0, 1]")
            self.region_mass = mass
        self.entities = list(self.entities)
        for ent in self.entities:
            bad = [p for w in ent.word_tokens for p in w if not 0 <= p < T]
            if bad:
                raise ValueError(f"entity {ent.phrase!r}: token positions {bad} outside the text axis (T = {T})")

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return self.attn.shape  # (L, H, T, R)


@dataclass
class CaptionScores:
    """Per-entity outcome for one caption; kept for qualitative views and per-entity breakdowns."""

    pred: np.ndarray  # (L, H, E) int, the region each head picks for each entity; -1: no attention to any region
    hit: np.ndarray  # (L, H, E) bool, pred agrees with the gold boxes
    mass: np.ndarray  # (L, H, E) float64, share of the entity's attention that went to regions
    baseline_pred: np.ndarray  # (E,) int, the most confident valid region
    baseline_hit: np.ndarray  # (E,) bool, or NaN floats without a baseline
    reachable: np.ndarray  # (E,) bool, some valid region agrees with the gold boxes (upper bound)
    correct: np.ndarray  # (E, R) bool, which regions count as correct for each entity


def token_weights(positions: Sequence[Sequence[int]], T: int) -> np.ndarray:
    """(Q, T) row weights: query q's attention row is sum_t w[q, t] * row t (a one-hot or a mean).

    `positions[q]` lists distinct text positions (`token_positions`); entities and single words alike.
    """
    w = np.zeros((len(positions), T), dtype=np.float64)
    for q, pos in enumerate(positions):
        w[q, list(pos)] = 1.0 / len(pos)  # positions are distinct, so plain assignment
    return w


def region_predictions(inp: GroundingInput, w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The region each head's attention favours from each query row, and the share that went to regions.

    w: (Q, T) row weights (`token_weights`). Returns pred (L, H, Q) int, -1 where the head gives no
    attention to any valid region; blind (L, H, Q) bool, those -1 cases; mass (L, H, Q) float64.
    Shared by entity grounding (queries = entities) and syntactic grounding (queries = words).
    """
    valid = inp.region_valid  # (R,)
    # One-hot rows reproduce the token's row exactly; mean rows average them (§3.1 reads one token).
    q_attn = np.matmul(w.astype(inp.attn.dtype), inp.attn)  # (Q, T) @ (L, H, T, R) -> (L, H, Q, R)
    # §3.1: "the image region that receives the most attention weight compared to other image
    # regions ... without considering other words": argmax over the region columns only.
    # Ties go to the lowest region index (np.argmax).
    # A head whose attention to every valid region is exactly zero picks nothing (pred -1, never a hit):
    # the layers before the fusion layer of VisualBERT without early fusion do not see the regions, and
    # their text-to-region maps are zeros (AttentionMaps.text_to_region), which np.argmax would otherwise
    # read as a choice of region 0.
    blind = ~(np.where(valid, q_attn, 0.0) > 0).any(axis=-1)  # (L, H, Q)
    if not valid.all():
        q_attn = np.where(valid, q_attn, -np.inf)
    pred = np.where(blind, -1, q_attn.argmax(axis=-1))  # (L, H, Q)
    mass = np.matmul(inp.region_mass, w.T)  # (L, H, T) @ (T, Q) -> (L, H, Q)
    return pred, blind, mass


def entity_correct_regions(inp: GroundingInput, options: GroundingOptions) -> np.ndarray:
    """(E, R) bool: which valid regions agree with each entity's gold boxes under the options' rule: IoU >=
    the threshold with any gold box ("any") or with their union box ("union"); every entity of the caption
    in one IoU computation."""
    E = len(inp.entities)
    if E == 0:
        return np.zeros((0, inp.shape[3]), dtype=bool)
    if options.iou_rule == "union":
        iou = box_iou(inp.region_boxes, np.stack([union_box(e.gold_boxes) for e in inp.entities]))  # (R, E)
    else:  # "any": each entity's best gold box; its boxes are a run of columns
        starts = np.cumsum([0] + [len(e.gold_boxes) for e in inp.entities[:-1]])  # (E,)
        iou = np.maximum.reduceat(box_iou(inp.region_boxes, np.concatenate([e.gold_boxes for e in inp.entities])),
                                  starts, axis=1)  # (R, sum K) -> (R, E)
    return (iou >= options.iou_threshold).T & inp.region_valid  # (E, R); a padded region is never correct


def most_confident_region(inp: GroundingInput) -> int | None:
    """The baseline's choice (§3.1): "always chooses the region with the highest detection confidence",
    among the valid regions; ties go to the lowest index. None without confidences (no baseline)."""
    if inp.region_conf is None:
        return None
    return int(np.where(inp.region_valid, inp.region_conf, -np.inf).argmax())


def baseline_hits(correct: np.ndarray, base: int | None) -> np.ndarray:
    """(Q,) whether the baseline's region is right for each query, from `correct` (Q, R); NaN for every query
    when there is no baseline (`most_confident_region` None), so that its accuracy comes out NaN, not 0."""
    return np.full(len(correct), np.nan) if base is None else correct[:, base].copy()


def score_caption(inp: GroundingInput, options: GroundingOptions = GroundingOptions()) -> CaptionScores:
    """Score every (layer, head, entity) of one caption at once; no Python loop over heads."""
    T = inp.shape[2]
    E = len(inp.entities)
    w = token_weights([ent.positions(options.token) for ent in inp.entities], T)  # (E, T)
    pred, blind, mass = region_predictions(inp, w)  # (L, H, E) each
    correct = entity_correct_regions(inp, options)  # (E, R)
    hit = correct[np.arange(E), pred] & ~blind  # (E, R)[(E,), (L, H, E)] -> (L, H, E)

    base = most_confident_region(inp)
    baseline_pred = np.full(E, -1 if base is None else base, dtype=np.int64)
    return CaptionScores(
        pred=pred,
        hit=hit,
        mass=mass,
        baseline_pred=baseline_pred,
        baseline_hit=baseline_hits(correct, base),
        reachable=correct.any(axis=1),
        correct=correct,
    )


@dataclass(frozen=True)
class HeadScore:
    """One head's numbers. `layer` and `head` are 0-based indices; `label` is the paper's 1-based
    "<layer>-<head>" (Table 2: "10-1" is the first head of the tenth layer)."""

    layer: int
    head: int
    accuracy: float  # fraction in [0, 1]
    region_mass: float  # mean share of the entities' attention that goes to regions
    active: bool

    @property
    def label(self) -> str:
        return f"{self.layer + 1}-{self.head + 1}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["label"] = self.label
        return d


@dataclass(frozen=True)
class GroundingResult:
    """Entity grounding over a data set: per-head accuracy and everything Figure 3 draws.

    Accuracies and masses are fractions in [0, 1] (the presentation layer prints percent). Layers and
    heads are 0-based indices in arrays and `HeadScore.layer/head`; labels are 1-based like the paper.
    Ties (best head, best per layer) go to the lowest layer, then the lowest head.
    """

    options: GroundingOptions
    n_entities: int
    n_captions: int
    accuracy: np.ndarray  # (L, H)
    mean_region_mass: np.ndarray  # (L, H)
    active: np.ndarray  # (L, H) bool
    baseline_accuracy: float
    upper_bound: float  # fraction of entities with at least one correct valid region

    @property
    def num_layers(self) -> int:
        return int(self.accuracy.shape[0])

    @property
    def num_heads(self) -> int:
        return int(self.accuracy.shape[1])

    def head(self, layer: int, head: int) -> HeadScore:
        return HeadScore(
            layer=int(layer),
            head=int(head),
            accuracy=float(self.accuracy[layer, head]),
            region_mass=float(self.mean_region_mass[layer, head]),
            active=bool(self.active[layer, head]),
        )

    @property
    def best_head(self) -> HeadScore:
        """The most accurate head of all ("the best of all heads", §3.1), active or not."""
        layer, head = np.unravel_index(int(np.argmax(self.accuracy)), self.accuracy.shape)
        return self.head(layer, head)

    @property
    def best_active_head(self) -> HeadScore | None:
        """The most accurate active head (Table 2's convention), or None when no head is active."""
        if not self.active.any():
            return None
        acc = np.where(self.active, self.accuracy, -np.inf)
        layer, head = np.unravel_index(int(np.argmax(acc)), acc.shape)
        return self.head(layer, head)

    @property
    def best_per_layer(self) -> list[HeadScore]:
        heads = self.accuracy.argmax(axis=1)  # (L,)
        return [self.head(layer, h) for layer, h in enumerate(heads)]

    @property
    def best_layer(self) -> int:
        """0-based index of the layer holding the best head."""
        return self.best_head.layer

    @property
    def layer_max(self) -> np.ndarray:
        return self.accuracy.max(axis=1)  # (L,)

    @property
    def layer_mean(self) -> np.ndarray:
        return self.accuracy.mean(axis=1)  # (L,)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (a baseline not computed, NaN, as None). Per-head arrays are nested lists [layer][head];
        derived fields are included."""
        best_active = self.best_active_head
        return nan_as_null({
            "options": self.options.to_dict(),
            "n_entities": self.n_entities,
            "n_captions": self.n_captions,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "accuracy": self.accuracy.tolist(),
            "mean_region_mass": self.mean_region_mass.tolist(),
            "active": self.active.tolist(),
            "baseline_accuracy": self.baseline_accuracy,
            "upper_bound": self.upper_bound,
            "best_head": self.best_head.to_dict(),
            "best_active_head": None if best_active is None else best_active.to_dict(),
            "best_layer_index": self.best_layer,
            "best_layer_number": self.best_layer + 1,
            "best_per_layer": [h.to_dict() for h in self.best_per_layer],
            "layer_max": self.layer_max.tolist(),
            "layer_mean": self.layer_mean.tolist(),
        })

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GroundingResult:
        """Inverse of `to_dict` (derived fields are recomputed, not read)."""
        return cls(
            options=GroundingOptions.from_dict(data["options"]),
            n_entities=int(data["n_entities"]),
            n_captions=int(data["n_captions"]),
            accuracy=np.asarray(data["accuracy"], dtype=np.float64),
            mean_region_mass=np.asarray(data["mean_region_mass"], dtype=np.float64),
            active=np.asarray(data["active"], dtype=bool),
            baseline_accuracy=float("nan") if data["baseline_accuracy"] is None else float(data["baseline_accuracy"]),
            upper_bound=float(data["upper_bound"]),
        )


def check_query_shapes(hit: np.ndarray, mass: np.ndarray, baseline_hit: np.ndarray, reachable: np.ndarray) -> None:
    """N scored queries: hit and mass (L, H, N), baseline_hit and reachable (N,)."""
    L, H, N = hit.shape
    if mass.shape != (L, H, N) or baseline_hit.shape != (N,) or reachable.shape != (N,):
        raise ValueError(f"inconsistent shapes: hit {hit.shape}, mass {mass.shape}, "
                         f"baseline_hit {baseline_hit.shape}, reachable {reachable.shape}")


class GroupSums:
    """Per-group sums of per-query arrays, added in bulk.

    `add(keys, *arrays)` takes N queries, each with a group key (any hashable) and its values in each array
    (shape (..., N), the same leading shape from call to call); `totals()` gives, per key in order of first
    appearance, each array summed over the key's queries. Queries wait in a buffer and are summed
    `flush_every` at a time with one matrix product per array against their one-hot group matrix: a
    grounding analysis splits ~100,000 queries into hundreds of groups (entities by type or last word, arc
    instances by relation and by query word), and numpy calls per query took ~7 s of a 5,000-caption run
    (profiled). Sums are float64; counts of 0/1 values are exact.
    """

    def __init__(self, flush_every: int = 4096):
        self.flush_every = flush_every
        self._sums: dict[Hashable, list[np.ndarray]] = {}
        self._keys: list[Hashable] = []
        self._parts: list[tuple[np.ndarray, ...]] = []

    def add(self, keys: Sequence[Hashable], *arrays: np.ndarray) -> None:
        if any(a.shape[-1] != len(keys) for a in arrays):
            raise ValueError(f"{len(keys)} keys for arrays of shapes {[a.shape for a in arrays]}")
        if not len(keys):
            return
        self._keys.extend(keys)
        self._parts.append(arrays)
        if len(self._keys) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self._keys:
            return
        index: dict[Hashable, int] = {}  # key -> column of this flush, in order of first appearance
        cols = np.array([index.setdefault(k, len(index)) for k in self._keys], dtype=np.int64)  # (N,)
        N, G = len(cols), len(index)
        onehot = np.zeros((N, G))
        onehot[np.arange(N), cols] = 1.0
        sums = []
        for f in range(len(self._parts[0])):
            a = np.concatenate([p[f] for p in self._parts], axis=-1)  # (..., N)
            sums.append((a.reshape(-1, N).astype(np.float64, copy=False) @ onehot).reshape(*a.shape[:-1], G))
        for key, g in index.items():
            got = [s[..., g] for s in sums]
            have = self._sums.get(key)
            self._sums[key] = got if have is None else [x + y for x, y in zip(have, got)]
        self._keys, self._parts = [], []

    def totals(self) -> dict[Hashable, list[np.ndarray]]:
        self.flush()
        return self._sums


class GroundingAccumulator:
    """Streaming entity grounding: `add` one caption at a time, `result` at any point.

    Keeps only counts and sums of shape (L, H), so thousands of captions cost nothing to hold; `merge`
    combines accumulators filled in parallel (shards, processes).
    """

    def __init__(self, options: GroundingOptions = GroundingOptions()):
        self.options = options
        self.n_entities = 0
        self.n_captions = 0
        self.hits: np.ndarray | None = None  # (L, H) int64
        self.mass_sum: np.ndarray | None = None  # (L, H) float64
        self.baseline_hits = 0.0  # NaN once a query without a baseline is added
        self.reachable = 0

    def _ensure_shape(self, L: int, H: int) -> None:
        if self.hits is None:
            self.hits = np.zeros((L, H), dtype=np.int64)
            self.mass_sum = np.zeros((L, H), dtype=np.float64)
        elif self.hits.shape != (L, H):
            raise ValueError(f"caption has (L, H) = {(L, H)} but earlier captions had {self.hits.shape}")

    def add(self, inp: GroundingInput) -> CaptionScores:
        """Score one caption, add it to the totals and return its per-entity scores."""
        L, H, _, _ = inp.shape
        self._ensure_shape(L, H)
        scores = score_caption(inp, self.options)
        self.add_scores(scores.hit, scores.mass, scores.baseline_hit, scores.reachable)
        return scores

    def add_scores(
        self, hit: np.ndarray, mass: np.ndarray, baseline_hit: np.ndarray, reachable: np.ndarray, *, captions: int = 1
    ) -> None:
        """Add N already scored queries from `captions` captions: hit (L, H, N) bool, mass (L, H, N),
        baseline_hit (N,) bool, reachable (N,) bool. `add` uses it for entities; the syntactic analysis
        for the (arc, direction) instances of one relation, each counted like an entity."""
        check_query_shapes(hit, mass, baseline_hit, reachable)
        self.add_totals(hit.sum(axis=-1), mass.sum(axis=-1), hit.shape[-1], float(baseline_hit.sum()),
                        int(reachable.sum()), captions)

    def add_totals(self, hits: np.ndarray, mass_sum: np.ndarray, n: int, baseline_hits: float, reachable: int,
                   captions: int) -> None:
        """Add the sums over n queries: hits (L, H) int, mass_sum (L, H) float (`GroupSums` adds groups so)."""
        self._ensure_shape(*hits.shape)
        self.n_captions += captions
        self.n_entities += n
        self.hits += hits
        self.mass_sum += mass_sum
        self.baseline_hits += baseline_hits
        self.reachable += reachable

    def merge(self, other: GroundingAccumulator) -> GroundingAccumulator:
        """Add `other`'s totals into this one (same options required); returns self."""
        if other.options != self.options:
            raise ValueError("cannot merge accumulators with different options")
        if other.hits is not None:
            self._ensure_shape(*other.hits.shape)
            self.hits += other.hits
            self.mass_sum += other.mass_sum
        self.n_captions += other.n_captions
        self.n_entities += other.n_entities
        self.baseline_hits += other.baseline_hits
        self.reachable += other.reachable
        return self

    def result(self) -> GroundingResult:
        if self.n_entities == 0 or self.hits is None:
            raise ValueError("no entities were scored; accuracy is undefined")
        n = self.n_entities
        mean_mass = self.mass_sum / n  # (L, H): mean over entities, each entity weighing the same
        thr = self.options.active_threshold
        active = mean_mass >= thr if self.options.active_inclusive else mean_mass > thr
        return GroundingResult(
            options=self.options,
            n_entities=n,
            n_captions=self.n_captions,
            accuracy=self.hits / n,
            mean_region_mass=mean_mass,
            active=active,
            baseline_accuracy=self.baseline_hits / n,
            upper_bound=self.reachable / n,
        )


def ground(inputs: Iterable[GroundingInput], options: GroundingOptions = GroundingOptions()) -> GroundingResult:
    """Entity grounding over an iterable of captions (streamed; the iterable may be a generator)."""
    acc = GroundingAccumulator(options)
    for inp in inputs:
        acc.add(inp)
    return acc.result()


# --------------------------------------------------------------------------- accuracy by kind of entity

BREAKDOWNS: dict[str, Callable[[GroundingEntity], str]] = {
    # Flickr30K Entities' phrase types (people, clothing, bodyparts, animals, vehicles, instruments, scene, other),
    # by which phrase-grounding results on it are usually broken down; several types are joined by "/".
    "type": lambda e: "/".join(e.types) or "(none)",
    # The word the default `--token=last` reads: "the man" and "the red shirt" end on their nouns, a phrase
    # ending on a generic noun ("the cyan triangle shape") puts that word in the query's place.
    "last_word": lambda e: (e.phrase.split() or ["(none)"])[-1].lower(),
}


@dataclass(frozen=True)
class BreakdownRow:
    """One group of queries (entities, or a syntactic relation's arc instances): how many, the baseline on
    them, the overall best head's accuracy on them, and the group's own best head (accuracies as fractions)."""

    group: str
    n: int  # queries in the group: entities, or arc instances of a syntactic relation
    baseline: float
    overall_head: str  # label of the best head over the whole (all entities, or the relation-direction)
    overall_head_accuracy: float
    best_head: str  # label of the best head on this group
    best_accuracy: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def breakdown_rows(groups: dict[Hashable, GroundingAccumulator], overall: GroundingResult) -> list[BreakdownRow]:
    """Every group, the most queries first (then by name), read against `overall`'s best head."""
    head = overall.best_head
    out = []
    for group, acc in groups.items():
        r = acc.result()
        out.append(BreakdownRow(str(group), r.n_entities, r.baseline_accuracy, head.label,
                                float(r.accuracy[head.layer, head.head]), r.best_head.label, r.best_head.accuracy))
    return sorted(out, key=lambda row: (-row.n, row.group))


class GroupedGrounding:
    """Grounding queries (entities, or syntactic arc instances) counted in groups: one `GroundingAccumulator`
    per group, so the groups' counts add up to the whole (queries, hits of every head, baseline hits).
    Queries are summed in bulk (`GroupSums`); `groups` and `rows` see every query added so far."""

    def __init__(self, options: GroundingOptions):
        self.options = options
        self._sums = GroupSums()

    def add(self, groups: Sequence[Hashable], hit: np.ndarray, mass: np.ndarray, baseline_hit: np.ndarray,
            reachable: np.ndarray, captions: np.ndarray | None = None) -> None:
        """N queries of group groups[n]: hit and mass (L, H, N), baseline_hit and reachable (N,); captions (N,):
        what each query adds to its group's caption count (default none: a breakdown counts queries)."""
        check_query_shapes(hit, mass, baseline_hit, reachable)
        N = len(groups)
        self._sums.add(groups, hit, mass, np.ones(N), baseline_hit, reachable,
                       np.zeros(N) if captions is None else captions)

    @property
    def groups(self) -> dict[Hashable, GroundingAccumulator]:
        """Per group, in order of first appearance, its accumulator."""
        out = {}
        for key, (hits, mass, n, base, reach, caps) in self._sums.totals().items():
            out[key] = GroundingAccumulator(self.options)
            n, reach, caps = (int(round(float(x))) for x in (n, reach, caps))
            base = float(base)  # NaN without a baseline
            out[key].add_totals(np.rint(hits).astype(np.int64), mass, n, round(base) if np.isfinite(base) else base,
                                reach, caps)
        return out

    def rows(self, overall: GroundingResult) -> list[BreakdownRow]:
        return breakdown_rows(self.groups, overall)


class EntityBreakdown(GroupedGrounding):
    """Entity grounding split into groups by a key of each entity (`BREAKDOWNS`), fed with the per-entity
    scores `GroundingAccumulator.add` returns."""

    def __init__(self, options: GroundingOptions, key: Callable[[GroundingEntity], str]):
        super().__init__(options)
        self.key = key

    def add_caption(self, inp: GroundingInput, scores: CaptionScores) -> None:
        self.add([self.key(ent) for ent in inp.entities], scores.hit, scores.mass, scores.baseline_hit, scores.reachable)
