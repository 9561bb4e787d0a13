"""Pre-training losses of VisualBERT (App. A.3): masked language modelling with the image and
sentence-image prediction, each a plain function of logits and labels."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from vlberts.text.masking import IGNORE_INDEX


def mlm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy over the masked tokens. logits (N, V) at the masked positions, labels (N,)."""
    if labels.numel() == 0:
        return logits.sum() * 0.0  # keeps the graph when a batch happens to have no masked token
    return F.cross_entropy(logits.float(), labels)


def match_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Sentence-image prediction: cross-entropy over {match, mismatch}. logits (B, 2), labels (B,)."""
    return F.cross_entropy(logits.float(), labels)


def masked_positions(labels: Tensor) -> Tensor:
    """(B, T) bool: where MLM labels are set."""
    return labels != IGNORE_INDEX


def mlm_accuracy(logits: Tensor, labels: Tensor) -> Tensor:
    if labels.numel() == 0:
        return torch.tensor(float("nan"))
    return (logits.argmax(-1) == labels).float().mean()
