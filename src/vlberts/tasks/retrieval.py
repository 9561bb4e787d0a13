"""Image-text retrieval metrics (Flickr30K): R@1/5/10, median and mean rank, both directions.

Protocol (formats-and-metrics.md §5; ViLBERT ``eval_retrieval.py``, Lu et al. 2019 §4): every test
caption is scored against every test image (Flickr30K test: 1000 images x 5000 captions), giving a
score matrix S of shape (C, I), captions x images, higher = better match.

Ranks are 0-based and defined as the number of *wrong* candidates that score at least as high as the
best *correct* one:

* text->image, caption c with gold image g(c):  rank(c) = #{i != g(c) : S[c, i] >= S[c, g(c)]}
* image->text, image i with gold captions G(i): rank(i) = #{c not in G(i) : S[c, i] >= max_{g in G(i)} S[g, i]}

Tie rule: a wrong candidate tied with the correct one counts as ranked above it (ties go against the
model). So a constant scorer gets the worst rank, not a perfect one, and the result does not depend on
a sort's tie-breaking (ViLBERT's ``argsort`` order is unspecified for ties). Without ties this is the
usual position of the first correct candidate in the descending order (VSE++ for image->text).

From the ranks r of N queries (ViLBERT's formulas):
  R@K   = 100 * #{r < K} / N
  medr  = floor(median(r)) + 1      (median of an even count averages the two middle ranks)
  meanr = mean(r) + 1
``rsum`` is the sum of the six recalls, the usual single number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

RECALL_AT = (1, 5, 10)


@dataclass(frozen=True)
class RankSummary:
    """Recall at 1/5/10 (percent), median and mean rank (1-based) for one direction."""

    r1: float
    r5: float
    r10: float
    medr: float
    meanr: float
    num_queries: int

    def to_dict(self) -> dict:
        return {"r1": self.r1, "r5": self.r5, "r10": self.r10, "medr": self.medr, "meanr": self.meanr,
                "num_queries": self.num_queries}


@dataclass(frozen=True)
class RetrievalScores:
    text_to_image: RankSummary  # caption queries, image candidates ("image retrieval")
    image_to_text: RankSummary  # image queries, caption candidates ("caption retrieval")

    @property
    def rsum(self) -> float:
        t, i = self.text_to_image, self.image_to_text
        return t.r1 + t.r5 + t.r10 + i.r1 + i.r5 + i.r10

    def to_dict(self) -> dict:
        return {"text_to_image": self.text_to_image.to_dict(), "image_to_text": self.image_to_text.to_dict(),
                "rsum": self.rsum}

    def summary(self) -> str:
        t, i = self.text_to_image, self.image_to_text
        return (f"text->image R@1/5/10 {t.r1:.2f}/{t.r5:.2f}/{t.r10:.2f} medr {t.medr:g}; "
                f"image->text R@1/5/10 {i.r1:.2f}/{i.r5:.2f}/{i.r10:.2f} medr {i.medr:g}")


def _check(scores: np.ndarray, caption_image: np.ndarray) -> None:
    if scores.ndim != 2:
        raise ValueError(f"scores must be a (captions, images) matrix, got shape {scores.shape}")
    if caption_image.shape != (scores.shape[0],):
        raise ValueError(f"caption_image must hold one image index per caption ({scores.shape[0]}), "
                         f"got shape {caption_image.shape}")
    if scores.shape[0] == 0 or scores.shape[1] == 0:
        raise ValueError("empty score matrix")
    if np.isnan(scores).any():
        raise ValueError("scores contain NaN")
    if caption_image.min() < 0 or caption_image.max() >= scores.shape[1]:
        raise ValueError(f"caption_image holds an image index outside 0..{scores.shape[1] - 1}")


def text_to_image_ranks(scores: Sequence | np.ndarray, caption_image: Sequence[int] | np.ndarray) -> np.ndarray:
    """0-based rank of each caption's gold image among all images (module docstring; ties against the model).

    scores: (C, I); caption_image: (C,) index of each caption's image. Returns (C,) int64.
    """
    s = np.asarray(scores, dtype=np.float64)  # (C, I)
    gt = np.asarray(caption_image, dtype=np.int64)  # (C,)
    _check(s, gt)
    gold = s[np.arange(len(gt)), gt]  # (C,)
    return (s >= gold[:, None]).sum(axis=1) - 1  # the gold image itself is >= itself


def image_to_text_ranks(scores: Sequence | np.ndarray, caption_image: Sequence[int] | np.ndarray) -> np.ndarray:
    """0-based rank of each image's best gold caption among all captions (module docstring).

    Every image must have at least one caption. Returns (I,) int64.
    """
    s = np.asarray(scores, dtype=np.float64)  # (C, I)
    gt = np.asarray(caption_image, dtype=np.int64)  # (C,)
    _check(s, gt)
    is_gold = np.zeros_like(s, dtype=bool)  # (C, I)
    is_gold[np.arange(len(gt)), gt] = True
    no_caption = np.flatnonzero(~is_gold.any(axis=0))
    if len(no_caption):
        raise ValueError(f"image {no_caption[0]} has no ground-truth caption ({len(no_caption)} such images)")
    best_gold = np.where(is_gold, s, -np.inf).max(axis=0)  # (I,)
    return ((s >= best_gold[None, :]) & ~is_gold).sum(axis=0)


def summarize_ranks(ranks: Sequence[int] | np.ndarray) -> RankSummary:
    """R@1/5/10 in percent, medr = floor(median) + 1, meanr = mean + 1, from 0-based ranks."""
    r = np.asarray(ranks, dtype=np.int64)
    if r.size == 0:
        raise ValueError("no ranks to summarise")
    recalls = [100.0 * float((r < k).sum()) / r.size for k in RECALL_AT]
    return RankSummary(r1=recalls[0], r5=recalls[1], r10=recalls[2],
                       medr=float(math.floor(float(np.median(r)))) + 1.0, meanr=float(r.mean()) + 1.0,
                       num_queries=int(r.size))


def score_retrieval(scores: Sequence | np.ndarray, caption_image: Sequence[int] | np.ndarray) -> RetrievalScores:
    """Both directions from a (captions, images) score matrix and each caption's gold image index."""
    return RetrievalScores(
        text_to_image=summarize_ranks(text_to_image_ranks(scores, caption_image)),
        image_to_text=summarize_ranks(image_to_text_ranks(scores, caption_image)),
    )


def caption_image_index(caption_image_ids: Sequence[str], image_ids: Sequence[str]) -> np.ndarray:
    """Map each caption's image id to its column in a score matrix whose columns are `image_ids`.

    For Flickr30K, 5 captions per image: ``caption_image_ids`` repeats each image id 5 times.
    """
    column = {img: j for j, img in enumerate(image_ids)}
    if len(column) != len(image_ids):
        raise ValueError("image_ids has duplicates")
    missing = [c for c in caption_image_ids if c not in column]
    if missing:
        raise ValueError(f"caption image id {missing[0]!r} is not among the scored images")
    return np.array([column[c] for c in caption_image_ids], dtype=np.int64)
