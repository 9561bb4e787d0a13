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
class TagInputs:
    """Detector tags of a batch (W-VisualBERT §3.2), as subword tokens that each point at the region they
    came from. L tag subwords."""

    tag_ids: Tensor  # (B, L) long, WordPiece ids of the tag subwords
    tag_region: Tensor  # (B, L) long, index into the batch's regions (0..R-1) of each subword's box
    tag_mask: Tensor  # (B, L) bool, True for real tag subwords

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TagInputs:
        return _to(self, device, non_blocking)


@dataclass
class RegionTargets:
    """Masked-region modelling: which regions were masked and what the region losses compare against.
    C detector classes (background included, as `cls_prob` is stored)."""

    masked: Tensor  # (B, R) bool, regions selected for masking: the targets of the masked-region losses
    corrupted: Tensor  # (B, R) bool, selected regions whose input was replaced (zeroed, or VL-BERT's mask vector)
    feats: Tensor  # (B, R, D) float, the original (uncorrupted) features: RoI-feature regression target
    cls_prob: Tensor | None = None  # (B, R, C) float, the detector's class distribution (0 on padding)
    obj_id: Tensor | None = None  # (B, R) long, detected object label, -100 on padding
    obj_conf: Tensor | None = None  # (B, R) float, its confidence (0 on padding)
    attr_id: Tensor | None = None  # (B, R) long, detected attribute label, -100 on padding
    attr_conf: Tensor | None = None  # (B, R) float

    def to(self, device: torch.device | str, non_blocking: bool = False) -> RegionTargets:
        return _to(self, device, non_blocking)


# Where a pre-training example comes from (`PretrainBatch.kind`): an image with its text, a text-only sample
# (VL-BERT §3.3 <Text, ∅>), an image without text (H-VisualBERT's image-only set).
PAIR, TEXT_ONLY, IMAGE_ONLY = 0, 1, 2


@dataclass
class PretrainBatch:
    """Caption pre-training: MLM with the image + image-text matching (VisualBERT §A.3), and for the other
    architectures the region-side targets (`regions`) and detector tags (`tags`) their objectives read."""

    inputs: VLInputs
    mlm_labels: Tensor  # (B, T) long, -100 where not masked
    match_labels: Tensor  # (B,) long, BERT NSP convention: 0 = caption_b matches the image, 1 = random
    image_ids: Tensor  # (B,) long
    # (B,) bool, the text matches the image (any convention's labels derive from it: objectives.matching);
    # None only in batches built before this field existed.
    matched: Tensor | None = None
    regions: RegionTargets | None = None  # masked-region targets; None = regions never masked (VisualBERT)
    tags: TagInputs | None = None  # W-VisualBERT detector tags (inputs, after masking)
    tag_labels: Tensor | None = None  # (B, L) long, original tag subword where masked, -100 elsewhere
    qa_targets: Tensor | None = None  # (B,) long, LXMERT image-QA answer index, -1 = none (unmatched, caption)
    # (B,) long, where each example comes from (`data.text_corpus`): 0 an image with its text, 1 a text-only
    # sample (VL-BERT §3.3 <Text, ∅>: no regions), 2 an image-only sample (H-VisualBERT: no text).
    # None: every example is a pair. The image objectives skip kind 1, the pair objectives (matching) 1 and 2.
    kind: Tensor | None = None
    nsp_labels: Tensor | None = None  # (B,) long, next-sentence labels (0 = IsNext, 1 = NotNext), -1 = none

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PretrainBatch:
        return _to(self, device, non_blocking)


@dataclass
class VQABatch:
    """VQA: question + regions, soft answer scores as targets."""

    inputs: VLInputs
    targets: Tensor  # (B, A) float soft scores in [0, 1]
    question_ids: Tensor  # (B,) long
    # (B,) long, position of the [MASK] answer slot (VisualBERT App. A, VL-BERT §4.2.2); 0 ([CLS]) in the
    # `question` layout, whose models read pooled outputs and ignore it
    answer_pos: Tensor
    tags: TagInputs | None = None  # W-VisualBERT's detector tags of the regions (§3.2), for models that read them

    def to(self, device: torch.device | str, non_blocking: bool = False) -> VQABatch:
        return _to(self, device, non_blocking)
