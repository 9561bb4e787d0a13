"""Image-text matching and image QA objectives: ViLBERT multimodal alignment (§3.1), LXMERT
cross-modality matching and image QA (§3.1.3), with each code base's label convention.

Label conventions of the (B, 2) matching logits differ between the originals (reference §3.4, §3.3):
  visualbert: 0 = matches (BERT NSP: 0 = IsNext)      -- `data.batch.PretrainBatch.match_labels`
  vilbert:    0 = aligned, 1 = not aligned (`random_cap` label)
  lxmert:     1 = matched, 0 = replaced sentence
`match_labels` builds them from a bool "matched" vector, `flip_match_labels` converts between them.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch.nn.functional as F
from torch import Tensor

from vlberts.objectives.regions import masked_mean

Convention = Literal["visualbert", "vilbert", "lxmert"]
_MATCHED_INDEX = {"visualbert": 0, "vilbert": 0, "lxmert": 1}


def match_labels(matched: Tensor, convention: Convention) -> Tensor:
    """(B,) long labels for the (B, 2) matching head from matched (B,) bool, in `convention`."""
    idx = _MATCHED_INDEX[convention]
    m = matched.bool()
    return (m if idx == 1 else ~m).long()


def flip_match_labels(labels: Tensor) -> Tensor:
    """Convert (B,) labels between the 'index 0 = matched' and 'index 1 = matched' conventions."""
    return 1 - labels


def matching_loss(logits: Tensor, matched: Tensor, convention: Convention, rows: Tensor | None = None) -> Tensor:
    """Cross-entropy of the (B, 2) matching logits against matched (B,) bool, in the model's convention.
    rows (B,) bool: the mean over those rows only, 0 when there are none (a batch that mixes pairs with
    text-only or image-only samples, `recipe.pair_rows`; next-sentence pairs, `recipe.nsp_rows`)."""
    labels = match_labels(matched, convention).to(logits.device)
    if rows is None:
        return F.cross_entropy(logits.float(), labels)
    return masked_mean(F.cross_entropy(logits.float(), labels, reduction="none"), rows)


def alignment_features(h_img: Tensor, h_cls: Tensor) -> Tensor:
    """ViLBERT §3.1: the holistic representation is the element-wise product h_IMG * h_CLS, (B, D)."""
    return h_img * h_cls


def vilbert_alignment_loss(logits: Tensor, aligned: Tensor) -> Tensor:
    """ViLBERT multimodal alignment prediction: binary CE of the (B, 2) logits of a linear layer over
    `alignment_features`; the original's labels are 0 = aligned, 1 = not aligned."""
    return matching_loss(logits, aligned, "vilbert")


# --------------------------------------------------------------------------------------------------
# LXMERT image QA (§3.1.3)


def sample_qa_target(scores: np.ndarray, rng: np.random.Generator) -> int:
    """One answer index drawn with probability proportional to its soft score, (A,) -> int; -1 when no
    answer scores (LXMERT's pre-training target: lxmert_pretrain.py samples one label multinomially)."""
    s = np.asarray(scores, dtype=np.float64)
    total = s.sum()
    if total <= 0:
        return -1
    return int(rng.choice(len(s), p=s / total))


def qa_loss(logits: Tensor, targets: Tensor, has_answer: Tensor, matched: Tensor) -> Tensor:
    """Image QA loss on the pairs that are matched and have a question with an answer.

    logits (B, A). targets either (B,) long answer indices -> cross-entropy (LXMERT pre-training, target
    sampled by `sample_qa_target`), or (B, A) float soft scores -> BCE-with-logits times A (the fine-tuning
    convention of LXMERT/ViLBERT/VL-BERT). has_answer, matched (B,) bool. Averaged over the kept rows;
    zero (graph kept) when none. LXMERT §3.1.3: answers are predicted "when the image and the question
    are matched"; the code sets the label of mismatched pairs to -1 (ignored).
    """
    keep = has_answer.bool() & matched.bool()  # (B,)
    lg = logits.float()  # (B, A)
    if targets.dim() == 1:
        per_row = F.cross_entropy(lg, targets.long().clamp_min(0), reduction="none")  # (B,); -1 rows not kept
    else:
        per_row = F.binary_cross_entropy_with_logits(lg, targets.float(), reduction="none").sum(-1)  # (B,)
    return masked_mean(per_row, keep)


def qa_from_step(total_steps: int, last_fraction: float = 0.5) -> int:
    """First step of the QA phase when QA runs only for the last `last_fraction` of training
    (LXMERT §3.3: the last 10 of 20 epochs, i.e. 0.5)."""
    if not 0.0 <= last_fraction <= 1.0:
        raise ValueError(f"last_fraction must be in [0, 1], got {last_fraction}")
    return total_steps - int(round(total_steps * last_fraction))


def qa_active(step: int, from_step: int | None) -> bool:
    """Whether the QA loss is on at `step` (0-based); `from_step=None` means always."""
    return from_step is None or step >= from_step
