"""Typed model outputs, including every attention map the analysis needs (SPEC §1, §5)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class AttentionMaps:
    """Attention probabilities of one forward pass, by kind.

    Single-stream models fill `joint`: one (B, H, S, S) map per layer over the whole sequence, with
    the text at positions `text_index` and the regions at `region_index`. Two-stream models fill the
    per-direction lists (each a list over the layers that compute that direction).
    """

    joint: list[Tensor] = field(default_factory=list)  # per layer (B, H, S, S)
    text_index: Tensor | None = None  # (T,) positions of the text tokens in the joint sequence
    region_index: Tensor | None = None  # (R,) positions of the regions in the joint sequence
    text_self: list[Tensor] = field(default_factory=list)  # per layer (B, H, T, T)
    vision_self: list[Tensor] = field(default_factory=list)  # per layer (B, H, R, R)
    text_to_vision: list[Tensor] = field(default_factory=list)  # per layer (B, H, T, R)
    vision_to_text: list[Tensor] = field(default_factory=list)  # per layer (B, H, R, T)
    source: str = "joint"  # which maps the text-to-region view below is taken from

    def text_to_region(self) -> Tensor:
        """(L, B, H, T, R): the attention each text token pays to each region, per layer and head.

        For single-stream models this is a slice of the joint map, so the rows do not sum to one: the
        remainder went to other words. Use `text_to_region_mass` for that share.
        """
        if self.joint:
            t, r = self.text_index, self.region_index
            return torch.stack([m[:, :, t][:, :, :, r] for m in self.joint])
        if self.text_to_vision:
            return torch.stack(self.text_to_vision)
        raise ValueError("no text-to-region attention maps were recorded")

    def describe(self) -> str:
        if self.joint:
            return f"joint self-attention maps of {len(self.joint)} layers, sliced text rows x region columns"
        return f"text-to-vision cross-attention maps of {len(self.text_to_vision)} layers"


@dataclass
class VLOutput:
    """Hidden states of a vision-and-language encoder, split by modality."""

    text: Tensor  # (B, T, D) final hidden states at the text positions
    vision: Tensor  # (B, R, Dv) final hidden states at the region positions
    pooled: Tensor  # (B, D) pooled output used by the classification heads
    attentions: AttentionMaps | None = None


@dataclass
class PretrainOutput:
    mlm_logits: Tensor  # (B, T, V), or (N, V) at the N positions asked for
    match_logits: Tensor  # (B, 2)
    encoded: VLOutput
