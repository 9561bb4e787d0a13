"""Typed batches: named fields, never positional tuples (DESIGN.md habit 5).

Letters in shape comments: B batch, T text length, R regions, D feature width, A answers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


def _to(obj, device: torch.device | str, non_blocking: bool = False):
    """Move every tensor field of a dataclass (recursively) to `device`."""
    changes = {}
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if isinstance(v, Tensor):
            changes[f.name] = v.to(device, non_blocking=non_blocking)
        elif dataclasses.is_dataclass(v):
            changes[f.name] = _to(v, device, non_blocking)
    return dataclasses.replace(obj, **changes)


@dataclass
class VLInputs:
    """What every architecture reads: a text sequence and a set of image regions.

    Boxes are (x1, y1, x2, y2) divided by the image width/height, so in [0, 1]; spatial encodings
    (4-d, 5-d, 6-d, sin/cos) are computed from them inside the model, never baked into files (SPEC §2).
    """

    input_ids: Tensor  # (B, T) long, WordPiece ids
    token_type_ids: Tensor  # (B, T) long, text segment (0 = first sentence, 1 = second)
    attention_mask: Tensor  # (B, T) bool, True for real tokens
    region_feats: Tensor  # (B, R, D) float
    region_boxes: Tensor  # (B, R, 4) float, normalised xyxy
    region_mask: Tensor  # (B, R) bool, True for real regions
    region_type_ids: Tensor | None = None  # (B, R) long; None = all 1 (VisualBERT visual segment)
    image_text_alignment: Tensor | None = None  # (B, R, K) long word positions, -1 = none (VCR)
    # (B, 3, H, W) float image pixels, normalised as the model's CNN expects; region_boxes are relative to
    # this H, W. Only end-to-end models (VL-BERT `end_to_end`) read it; None everywhere else.
    pixels: Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = False) -> VLInputs:
        return _to(self, device, non_blocking)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class PretrainBatch:
    """Caption pre-training (VisualBERT §A.3): MLM with the image + sentence-image prediction."""

    inputs: VLInputs
    mlm_labels: Tensor  # (B, T) long, -100 where not masked
    match_labels: Tensor  # (B,) long, BERT NSP convention: 0 = caption_b matches the image, 1 = random
    image_ids: Tensor  # (B,) long

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PretrainBatch:
        return _to(self, device, non_blocking)


@dataclass
class VQABatch:
    """VQA: question + regions, soft answer scores as targets."""

    inputs: VLInputs
    targets: Tensor  # (B, A) float soft scores in [0, 1]
    question_ids: Tensor  # (B,) long
    answer_pos: Tensor  # (B,) long, position of the [MASK] answer slot (VisualBERT App. A)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> VQABatch:
        return _to(self, device, non_blocking)
