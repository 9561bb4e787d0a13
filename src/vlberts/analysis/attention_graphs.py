"""LXMERT-style attention graphs for every architecture (LXMERT App. E, Figures 3-5; issue 5, item 6).

LXMERT App. E reads three kinds of attention graph off the pre-trained model:
- E.1, language encoder (words -> words): some heads point to the next word, others to the previous
  word, like BERT's (Fig. 3);
- E.2, first layer of the object-relationship encoder (objects -> objects): the most attended pairs of
  objects, joined by lines on the image, recover a scene graph (Fig. 4);
- E.3, cross-modality encoder (objects -> words): the attention focuses on nouns and pronouns, and for
  singular nouns on the articles (Fig. 5).
The paper shows examples; here each claim is also measured over many captions:
- `PositionalAccumulator`: per layer and head, the mean attention from a token to the next and to the
  previous token, against the uniform baseline 1/T;
- `TagShareAccumulator`: per layer and head of the cross block, the share of a region's attention over
  the text that goes to each universal POS tag, against each tag's share of the tokens (what uniform
  attention would give), so "focus on nouns" is a ratio above 1, not an impression;
- `RelationAccumulator`: per layer and head of the region block, how often the most attended region of
  another object is an object related to it in the gold scene, against the chance of a uniform pick.

Which maps stand for the three encoders (`select_views`; the report names them):
- LXMERT: language encoder self-attention (its N_L layers), object-relationship encoder self-attention
  (its N_R layers), cross-modality encoder vision->language and language->vision maps (all N_X layers);
- ViLBERT: text stream self-attention (every text layer), visual stream self-attention (every visual
  layer, [IMG] dropped), the co-attention maps (each co-attention layer, both directions);
- single-stream models (VisualBERT, VL-BERT, W-VisualBERT, ViLBERT's single-stream baseline): the
  text->text, region->region, region->text and text->region blocks of the joint self-attention map of
  every layer. These blocks are slices, so their rows do not sum to one: the positional statistic and the
  word graphs renormalise each word's row over the words, the POS shares each region's row over the text
  (the object graphs and the relation statistic only rank a row's entries, so they need no renormalising).
  Layers before a late fusion layer (VisualBERT without early fusion) see no regions: their region
  blocks are zero, and such rows are left out of the shares and of the relation statistic.

Token positions are subwords, with [CLS] and [SEP] (as BERT analyses count them): "next" is read for
positions 0..T-2, "previous" for 1..T-1; a subword inherits its word's POS tag; [CLS] and [SEP] are
their own tags "[CLS]" and "[SEP]" (BERT's heads often park attention there).

Letters in shape comments: L layers, H heads, T text tokens, R regions, K tags.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Universal POS tags (UD v2) and the two special tokens, in report order.
UPOS_TAGS: tuple[str, ...] = ("NOUN", "PROPN", "PRON", "DET", "ADJ", "NUM", "VERB", "AUX", "ADP", "ADV", "CCONJ",
                              "SCONJ", "PART", "INTJ", "PUNCT", "SYM", "X")
SPECIAL_TAGS: tuple[str, ...] = ("[CLS]", "[SEP]")
TAGS: tuple[str, ...] = UPOS_TAGS + SPECIAL_TAGS

# What each view is called in the JSON and the figures.
VIEW_NAMES = {"language": "words -> words", "objects": "regions -> regions", "cross": "regions -> words",
              "cross_t2r": "words -> regions"}


@dataclass
class Views:
    """The maps standing for the three encoders, for one batch (module docstring).

    Each array is (L, B, H, ., .) for its own L and H (ViLBERT's streams differ in heads); `describe`
    names the maps per view in words; `object_layer` is the index in `objects` of the layer drawn as
    LXMERT's "first layer of the object-relationship encoder" (the first layer that sees the regions).
    """

    language: np.ndarray  # (L_l, B, H_l, T, T)
    objects: np.ndarray  # (L_o, B, H_o, R, R)
    cross: np.ndarray  # (L_x, B, H_x, R, T)
    cross_t2r: np.ndarray  # (L_x, B, H_x, T, R)
    describe: dict[str, str]
    object_layer: int = 0


def select_views(maps: Any, arch: str, cfg: Any) -> Views:
    """The views of one forward pass (`AttentionMaps`) for architecture `arch` with model config `cfg`."""
    def np_(t) -> np.ndarray:
        return t.float().cpu().numpy()

    t2t, r2r, r2t, t2r = (np_(maps.text_to_text()), np_(maps.region_to_region()), np_(maps.region_to_text()),
                          np_(maps.text_to_region()))
    if maps.joint:
        L = len(maps.joint)
        k = int(maps.fusion_layer)
        before = "layer 1 sees no regions (its" if k == 1 else f"layers 1-{k} see no regions (their"
        late = f"; {before} region blocks are zero)" if k else ""
        joint = f"joint self-attention maps of {L} layers"
        return Views(t2t, r2r, r2t, t2r, {
            "language": f"{joint}, text rows x text columns",
            "objects": f"{joint}, region rows x region columns{late}",
            "cross": f"{joint}, region rows x text columns{late}",
            "cross_t2r": f"{joint}, text rows x region columns{late}",
        }, object_layer=k)
    if arch == "lxmert":
        nl, nr, nx = cfg.language_layers, cfg.relation_layers, cfg.cross_layers
        return Views(t2t[:nl], r2r[:nr], r2t, t2r, {
            "language": f"language encoder self-attention ({nl} layers)",
            "objects": f"object-relationship encoder self-attention ({nr} layers)",
            "cross": f"cross-modality encoder vision->language attention ({nx} layers)",
            "cross_t2r": f"cross-modality encoder language->vision attention ({nx} layers)",
        })
    off = " ([IMG] dropped)" if maps.vision_offset else ""
    return Views(t2t, r2r, r2t, t2r, {
        "language": f"text stream self-attention ({t2t.shape[0]} layers)",
        "objects": f"visual stream self-attention ({r2r.shape[0]} layers){off}",
        "cross": f"co-attention vision->text maps ({r2t.shape[0]} co-attention layers){off}",
        "cross_t2r": f"co-attention text->vision maps ({t2r.shape[0]} co-attention layers){off}",
    })


# --------------------------------------------------------------------------- next / previous token


def row_normalise(attn: np.ndarray) -> np.ndarray:
    """Each row divided by its sum (rows of zeros stay zero): a block of a joint map read as the share of
    the row's attention within the block. Two-stream maps (rows summing to one) are unchanged."""
    total = attn.sum(-1, keepdims=True, dtype=np.float64)
    return np.where(total > 0, attn / np.where(total > 0, total, 1.0), 0.0)


def positional_sums(attn: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """attn (L, H, T, T) one caption's word->word maps -> (sum over queries of the share of the query's
    attention over the words that goes to the next token (L, H), the same for the previous token (L, H),
    number of queries T - 1 for each). Rows are renormalised over the words (`row_normalise`), so that a
    single-stream model's text block compares with the same uniform baseline 1/T as a language encoder."""
    L, H, T, _ = attn.shape
    if T < 2:
        return np.zeros((L, H)), np.zeros((L, H)), 0
    attn = row_normalise(attn)
    i = np.arange(T - 1)
    nxt = attn[:, :, i, i + 1].sum(-1, dtype=np.float64)  # queries 0..T-2 -> keys 1..T-1
    prv = attn[:, :, i + 1, i].sum(-1, dtype=np.float64)  # queries 1..T-1 -> keys 0..T-2
    return nxt, prv, T - 1


@dataclass
class PositionalAccumulator:
    """Mean attention to the next and to the previous token per layer and head, over captions (each
    query token weighs the same), and the uniform baseline: the mean of 1/T over the same queries."""

    next_sum: np.ndarray | None = None  # (L, H)
    prev_sum: np.ndarray | None = None  # (L, H)
    n: int = 0
    uniform_sum: float = 0.0

    def add(self, attn: np.ndarray) -> None:
        nxt, prv, n = positional_sums(attn)
        if self.next_sum is None:
            self.next_sum, self.prev_sum = np.zeros_like(nxt), np.zeros_like(prv)
        self.next_sum += nxt
        self.prev_sum += prv
        self.n += n
        self.uniform_sum += n / attn.shape[-1]

    def result(self) -> dict[str, Any]:
        if not self.n:
            raise ValueError("no caption with two tokens or more")
        nxt, prv = self.next_sum / self.n, self.prev_sum / self.n
        uniform = self.uniform_sum / self.n
        return {
            "queries": self.n,
            "uniform": uniform,
            "next": nxt.tolist(),
            "previous": prv.tolist(),
            "best_next": _best(nxt, uniform),
            "best_previous": _best(prv, uniform),
        }


def _best(a: np.ndarray, baseline: float, layer_offset: int = 0) -> dict[str, Any]:
    """The highest entry of a (L, H) grid (ties: lowest layer, then head), with its ratio to `baseline`;
    layers and heads 1-based, layer numbers shifted by `layer_offset`."""
    layer, head = np.unravel_index(int(np.argmax(a)), a.shape)
    v = float(a[layer, head])
    layer = layer + layer_offset
    return {"layer": int(layer) + 1, "head": int(head) + 1, "label": f"{layer + 1}-{head + 1}", "value": v,
            "ratio_to_baseline": v / baseline if baseline > 0 else None}


# --------------------------------------------------------------------------- POS shares


def token_tags(word_tokens: Sequence[Sequence[int]], word_tags: Sequence[str], T: int) -> list[str]:
    """The tag of each of T token positions: a subword inherits its word's tag; position 0 is [CLS] and
    T - 1 is [SEP]; a position of no word (cut caption) is "X"."""
    tags = ["X"] * T
    for positions, tag in zip(word_tokens, word_tags):
        for p in positions:
            tags[p] = tag if tag in UPOS_TAGS else "X"
    tags[0], tags[T - 1] = "[CLS]", "[SEP]"
    return tags


def tag_share_sums(attn: np.ndarray, tags: Sequence[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """attn (L, H, R, T) one caption's region->word maps, tags (T,) -> (sum over regions of the share of
    the region's text attention that goes to each tag (L, H, K), regions counted (L, H), uniform share of
    each tag (K,) = its count / T). A row with no attention on the text (a layer that does not see the
    regions) is left out of both sums and counts."""
    L, H, R, T = attn.shape
    onehot = np.zeros((T, len(TAGS)))
    onehot[np.arange(T), [TAGS.index(t) for t in tags]] = 1.0  # (T, K)
    total = attn.sum(-1, dtype=np.float64)  # (L, H, R)
    seen = total > 0
    shares = np.matmul(attn.astype(np.float64), onehot) / np.where(seen, total, 1.0)[..., None]  # (L, H, R, K)
    return (shares * seen[..., None]).sum(2), seen.sum(2), onehot.mean(0)


@dataclass
class TagShareAccumulator:
    """Mean share of a region's text attention per tag, per layer and head; the baseline is the tag's
    share of the tokens, averaged over the same region rows (what a head attending uniformly gets)."""

    share_sum: np.ndarray | None = None  # (L, H, K)
    rows: np.ndarray | None = None  # (L, H)
    uniform_sum: np.ndarray = field(default_factory=lambda: np.zeros(len(TAGS)))  # (K,)
    n_rows: int = 0
    captions: int = 0

    def add(self, attn: np.ndarray, tags: Sequence[str]) -> None:
        s, rows, uniform = tag_share_sums(attn, tags)
        if self.share_sum is None:
            self.share_sum, self.rows = np.zeros_like(s), np.zeros(rows.shape, dtype=np.int64)
        self.share_sum += s
        self.rows += rows
        self.uniform_sum += uniform * attn.shape[2]
        self.n_rows += attn.shape[2]
        self.captions += 1

    def result(self) -> dict[str, Any]:
        if not self.n_rows:
            raise ValueError("no region rows were added")
        with np.errstate(invalid="ignore", divide="ignore"):
            share = self.share_sum / self.rows[..., None]  # (L, H, K); NaN where no row saw the text
        uniform = self.uniform_sum / self.n_rows
        present = [k for k, _ in enumerate(TAGS) if uniform[k] > 0]
        out_tags = {}
        for k in present:
            grid = share[..., k]
            mean = float(np.nanmean(grid)) if np.isfinite(grid).any() else None
            best = _best(np.nan_to_num(grid, nan=-1.0), float(uniform[k]))
            out_tags[TAGS[k]] = {
                "token_share": float(uniform[k]),
                "mean_share": mean,  # over every head of every layer that sees the regions
                "ratio": mean / uniform[k] if mean is not None else None,
                "best_head": best,
                "per_head": [[None if not np.isfinite(v) else float(v) for v in row] for row in grid],
            }
        return {"captions": self.captions, "region_rows": self.n_rows, "tags": out_tags}


# --------------------------------------------------------------------------- object relations


def region_objects(region_boxes: np.ndarray, object_boxes: np.ndarray, threshold: float = 0.5) -> np.ndarray:
    """(R,) index of the gold object each region detects (best IoU >= threshold), -1 for none."""
    from vlberts.analysis.boxes import box_iou

    if len(object_boxes) == 0 or len(region_boxes) == 0:
        return np.full(len(region_boxes), -1, dtype=np.int64)
    iou = box_iou(np.asarray(region_boxes, dtype=np.float64), np.asarray(object_boxes, dtype=np.float64))  # (R, N)
    best = iou.argmax(1)
    return np.where(iou.max(1) >= threshold, best, -1)


def relation_hits(attn: np.ndarray, objects: np.ndarray, related: np.ndarray) -> tuple[np.ndarray, np.ndarray, float, int]:
    """attn (L, H, R, R) region->region maps, objects (R,) gold object per region (-1: none), related (N, N)
    bool gold relation between objects -> (hits (L, H): rows whose most attended other region detects an
    object related to the row's object, rows counted (L, H), chance: summed over rows, the share of the
    other regions that detect a related object, rows considered).

    The candidates of a row are the regions other than those detecting the row's own object (itself and
    its duplicates: detectors keep several boxes per object, and a self-loop is no edge of a scene graph),
    including regions that detect no object (a miss when picked). A row counts when its region detects an
    object and it has a candidate. A row whose attention on the candidates is all zero (a layer that does
    not see the regions) is not counted for that head.
    """
    L, H, R, _ = attn.shape
    hits = np.zeros((L, H), dtype=np.int64)
    rows = np.zeros((L, H), dtype=np.int64)
    chance, n = 0.0, 0
    rel = np.zeros((R, R), dtype=bool)  # region i's object related to region j's object
    ok = objects >= 0
    rel[np.ix_(ok, ok)] = related[np.ix_(objects[ok], objects[ok])]
    for i in np.flatnonzero(ok):
        cand = objects != objects[i]  # (R,): not the row's own object (so not the row itself)
        if not cand.any():
            continue
        a = np.where(cand, attn[:, :, i].astype(np.float64), -np.inf)  # (L, H, R)
        j = a.argmax(-1)  # (L, H)
        seen = np.take_along_axis(a, j[..., None], -1)[..., 0] > 0
        hits += rel[i, j] & seen
        rows += seen
        chance += rel[i, cand].mean()
        n += 1
    return hits, rows, chance, n


@dataclass
class RelationAccumulator:
    hits: np.ndarray | None = None  # (L, H)
    rows: np.ndarray | None = None  # (L, H)
    chance_sum: float = 0.0
    n: int = 0

    def add(self, attn: np.ndarray, objects: np.ndarray, related: np.ndarray) -> None:
        h, r, c, n = relation_hits(attn, objects, related)
        if self.hits is None:
            self.hits, self.rows = np.zeros_like(h), np.zeros_like(r)
        self.hits += h
        self.rows += r
        self.chance_sum += c
        self.n += n

    def result(self, object_layer: int = 0) -> dict[str, Any] | None:
        if not self.n or self.hits is None:
            return None
        with np.errstate(invalid="ignore", divide="ignore"):
            rate = self.hits / self.rows  # (L, H)
        chance = self.chance_sum / self.n
        first = rate[object_layer]
        return {
            "objects": self.n,
            "chance": chance,
            "per_head": [[None if not np.isfinite(v) else float(v) for v in row] for row in rate],
            "first_layer": object_layer + 1,
            "first_layer_per_head": [None if not np.isfinite(v) else float(v) for v in first],
            "first_layer_mean": float(np.nanmean(first)) if np.isfinite(first).any() else None,
            "first_layer_best": _best(np.nan_to_num(first, nan=-1.0)[None], chance, layer_offset=object_layer),
        }


def top_edges(attn: np.ndarray, k: int) -> list[tuple[int, int, float]]:
    """attn (R, R) region->region (e.g. a layer's mean over heads) -> the `k` strongest undirected edges
    (i, j, weight), i < j, weight = max(a[i, j], a[j, i]), self-loops excluded; strongest first (ties:
    lowest i, then j)."""
    a = np.asarray(attn, dtype=np.float64)
    R = a.shape[0]
    w = np.maximum(a, a.T)
    iu, ju = np.triu_indices(R, 1)
    order = sorted(range(len(iu)), key=lambda e: (-w[iu[e], ju[e]], iu[e], ju[e]))[: max(0, k)]
    return [(int(iu[e]), int(ju[e]), float(w[iu[e], ju[e]])) for e in order]
