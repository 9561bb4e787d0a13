"""Text-side pre-training objectives beyond VisualBERT's MLM: batch-source schedules for mixing a
text-only corpus in (VL-BERT §3.2) or alternating unpaired text-only / image-only batches (W-VisualBERT §3),
tag MLM (W-VisualBERT §3, detector tags), and BERT next-sentence prediction on text documents
(W-VisualBERT footnote 4).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Literal, Sequence, TypeVar

import numpy as np
import torch.nn.functional as F
from torch import Tensor

from vlberts.objectives.regions import masked_mean
from vlberts.text.masking import IGNORE_INDEX

Source = Literal["image", "text"]
S = TypeVar("S")

# Denominator bound when a float ratio is turned into p/q: the schedule is exact over every q steps.
MAX_PERIOD = 1000


def mix_schedule(step: int, ratio: float, seed: int = 0) -> Source:
    """Which corpus batch `step` (0-based) draws from: "text" for a share `ratio` of the steps, else "image".

    `ratio` is written as p/q (denominator <= MAX_PERIOD); every block of q consecutive steps starting
    at a multiple of q holds exactly p text steps, at positions chosen by a Generator seeded with
    (seed, block). Stateless, so a resumed run continues the same schedule. The papers give no schedule
    (VL-BERT §3.2 mixes BooksCorpus/Wikipedia into pre-training; its ratio is configurable here).
    """
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"ratio must be in [0, 1], got {ratio}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    fr = Fraction(ratio).limit_denominator(MAX_PERIOD)
    p, q = fr.numerator, fr.denominator
    block, pos = divmod(step, q)
    text_slots = np.random.default_rng([seed, block]).permutation(q)[:p]
    return "text" if pos in text_slots else "image"


def unpaired_schedule(step: int, seed: int = 0, text_ratio: float = 0.5) -> Source:
    """W-VisualBERT §3: "during every pre-training step, we randomly sample either a batch of text ...
    or a batch of images"; each batch comes from one source (CustomBatchSampler, reference §3.6)."""
    return mix_schedule(step, text_ratio, seed)


def tag_mlm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Tag reconstruction: cross-entropy of the shared MLM softmax at the masked tag subwords.

    logits (B, L, V) the MLM head at the tag positions, labels (B, L) from `mask_tags_jointly`
    (IGNORE_INDEX where not masked). Averaged over masked tag subwords; zero when none. W-VisualBERT §3:
    tags "are predicted just as masked subwords are predicted in text modeling"; the original
    (`use_bert_input_for_tags`) predicts them with the same MLM head and loss.
    """
    per_tag = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                              reduction="none").view(labels.shape)  # (B, L), 0 where not masked
    return masked_mean(per_tag, labels != IGNORE_INDEX)


# --------------------------------------------------------------------------------------------------
# BERT next-sentence prediction (Devlin et al. 2019 §3.1 Task #2), label 0 = IsNext, 1 = NotNext


IS_NEXT, NOT_NEXT = 0, 1


def nsp_pair(
    documents: Sequence[Sequence[S]], doc: int, sent: int, rng: np.random.Generator, random_prob: float = 0.5
) -> tuple[S, S, int]:
    """A next-sentence example (a, b, label) with a = documents[doc][sent].

    With probability 1 - `random_prob`, b is the next sentence (label IS_NEXT = 0); otherwise b is a random
    sentence of another document (NOT_NEXT = 1). As in BERT's create_pretraining_data, a sentence without a
    successor always gets a random b. One coin and one document/sentence draw are always taken.
    """
    d = documents[doc]
    coin = rng.random()
    other = int(rng.integers(0, max(len(documents) - 1, 1)))
    u = rng.random()
    if sent + 1 < len(d) and coin >= random_prob:
        return d[sent], d[sent + 1], IS_NEXT
    if len(documents) < 2:
        raise ValueError("a random next sentence needs at least two documents")
    other_doc = documents[other + 1 if other >= doc else other]  # uniform over the other documents
    return d[sent], other_doc[int(u * len(other_doc))], NOT_NEXT


def nsp_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy of the (B, 2) NSP logits against labels (B,) (0 = IsNext, 1 = NotNext)."""
    return F.cross_entropy(logits.float(), labels)
