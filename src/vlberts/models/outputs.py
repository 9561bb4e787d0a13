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
    # Single-stream models where the regions join late (VisualBERT without early fusion): the joint maps
    # of layers before this index are text-only, (B, H, T, T), with the text at positions 0..T-1.
    fusion_layer: int = 0
    # Two-stream models whose vision stream starts with elements that are not regions (ViLBERT's [IMG],
    # the whole-image element at position 0): the vision_self / text_to_vision / vision_to_text maps
    # cover those too, and `text_to_region` drops their columns so that column r is the caller's region r.
    vision_offset: int = 0

    @classmethod
    def of_joint(cls, maps: list[Tensor], T: int, first_region: int, R: int, device: torch.device,
                 fusion_layer: int = 0) -> "AttentionMaps":
        """A single-stream model's maps: the text at positions 0..T-1, its R regions from `first_region` on."""
        return cls(joint=maps, text_index=torch.arange(T, device=device),
                   region_index=torch.arange(first_region, first_region + R, device=device), source="joint",
                   fusion_layer=fusion_layer)

    def text_to_region(self) -> Tensor:
        """(L, B, H, T, R): the attention each text token pays to each region, per layer and head.

        For single-stream models this is a slice of the joint map, so the rows do not sum to one: the
        remainder went to other words. Use `text_to_region_mass` for that share.
        """
        if self.joint:
            t, r = self.text_index, self.region_index
            # A layer before `fusion_layer` has no region columns: the regions are not part of its
            # input, so its text pays them zero attention (and the grounding analysis reads such a head
            # as one that never looks at the image, not as one that picks region 0).
            return torch.stack([
                m[:, :, t][:, :, :, r] if i >= self.fusion_layer else m.new_zeros(*m.shape[:2], len(t), len(r))
                for i, m in enumerate(self.joint)
            ])
        if self.text_to_vision:
            return torch.stack(self.text_to_vision)[..., self.vision_offset :]
        raise ValueError("no text-to-region attention maps were recorded")

    # The other blocks, for the attention graphs (LXMERT App. E). Same conventions as `text_to_region`:
    # single-stream maps are slices of the joint map (rows do not sum to one), a layer before
    # `fusion_layer` gives zeros wherever the regions are involved, and `vision_offset` elements are dropped.

    def _joint_block(self, rows: Tensor, cols: Tensor, needs_regions: bool) -> Tensor:
        return torch.stack([
            m[:, :, rows][:, :, :, cols] if i >= self.fusion_layer or not needs_regions
            else m.new_zeros(*m.shape[:2], len(rows), len(cols))
            for i, m in enumerate(self.joint)
        ])

    def text_to_text(self) -> Tensor:
        """(L, B, H, T, T): word-to-word attention. Two-stream: every recorded text self-attention map
        in order (LXMERT: the language encoder's layers, then each cross-modality layer's)."""
        if self.joint:
            # Layers before `fusion_layer` are (B, H, T, T) with the text at 0..T-1 = text_index.
            return self._joint_block(self.text_index, self.text_index, needs_regions=False)
        if self.text_self:
            return torch.stack(self.text_self)
        raise ValueError("no text self-attention maps were recorded")

    def region_to_region(self) -> Tensor:
        """(L, B, H, R, R): region-to-region attention. Two-stream: every recorded vision self-attention
        map in order (LXMERT: the object-relationship encoder's layers, then each cross-modality layer's)."""
        if self.joint:
            return self._joint_block(self.region_index, self.region_index, needs_regions=True)
        if self.vision_self:
            off = self.vision_offset
            return torch.stack(self.vision_self)[..., off:, off:]
        raise ValueError("no vision self-attention maps were recorded")

    def region_to_text(self) -> Tensor:
        """(L, B, H, R, T): the attention each region pays to each text token (joint map's region rows x
        text columns; two-stream: the vision-to-text cross-attention)."""
        if self.joint:
            return self._joint_block(self.region_index, self.text_index, needs_regions=True)
        if self.vision_to_text:
            return torch.stack(self.vision_to_text)[..., self.vision_offset :, :]
        raise ValueError("no region-to-text attention maps were recorded")

    def describe(self) -> str:
        if self.joint and self.fusion_layer:
            return (f"joint self-attention maps of {len(self.joint)} layers, sliced text rows x region columns; "
                    f"layers 1-{self.fusion_layer} see no regions (zero attention to them)")
        if self.joint:
            return f"joint self-attention maps of {len(self.joint)} layers, sliced text rows x region columns"
        return f"text-to-vision cross-attention maps of {len(self.text_to_vision)} layers"


@dataclass
class VLOutput:
    """Hidden states of a vision-and-language encoder, split by modality.

    `encode(x, need_attn=True, maps_only=True)` asks for the attention maps alone: a single-stream model
    then skips the last layer's work after its attention probabilities (`Encoder.forward`) and returns
    `VLOutput.maps_only(maps)`, whose hidden states are None. Two-stream models (LXMERT, ViLBERT's two
    streams) compute everything and return their hidden states as usual.
    """

    text: Tensor  # (B, T, D) final hidden states at the text positions
    vision: Tensor  # (B, R, Dv) final hidden states at the region positions
    pooled: Tensor  # (B, P) pooled output read by the classification heads; P = D (ViLBERT: bi_hidden_size)
    attentions: AttentionMaps | None = None
    image: Tensor | None = None  # (B, Dv) final state of a whole-image element (ViLBERT's h_IMG), if any

    @classmethod
    def maps_only(cls, attentions: AttentionMaps | None) -> "VLOutput":
        return cls(text=None, vision=None, pooled=None, attentions=attentions)  # type: ignore[arg-type]


@dataclass
class PretrainOutput:
    mlm_logits: Tensor  # (B, T, V), or (N, V) at the N positions asked for
    match_logits: Tensor  # (B, 2)
    encoded: VLOutput | None  # None where the model computed only the rows its heads read


@dataclass
class LxmertPretrainOutput:
    """LXMERT's pre-training heads (§3.1); the first three fields are `PretrainOutput`'s.

    A head the model was built without gives None.
    """

    mlm_logits: Tensor  # (B, T, V), or (N, V) at the N positions asked for
    match_logits: Tensor  # (B, 2), index 1 = the sentence matches the image (LXMERT's convention)
    encoded: VLOutput
    obj_logits: Tensor | None = None  # (B, R, n_obj) detected-object label logits
    attr_logits: Tensor | None = None  # (B, R, n_attr) detected-attribute label logits
    feat_pred: Tensor | None = None  # (B, R, F) regressed RoI features
    qa_logits: Tensor | None = None  # (B, A) answer logits


@dataclass
class ViLBertPretrainOutput:
    """ViLBERT's pre-training heads (§2.2); the first three fields are `PretrainOutput`'s."""

    mlm_logits: Tensor  # (B, T, V), or (N, V) at the N positions asked for
    match_logits: Tensor  # (B, 2) alignment; index 0 = aligned, 1 = not aligned (the original's label)
    encoded: VLOutput
    region_logits: Tensor  # (B, R, C) masked-region class logits at the caller's regions ([IMG] excluded)


@dataclass
class VLBertPretrainOutput:
    """VL-BERT's pre-training heads (§3.3); the first three fields are `PretrainOutput`'s."""

    mlm_logits: Tensor  # (B, T, V), or (N, V) at the N positions asked for
    match_logits: Tensor | None  # (B, 2) only with `with_match_head` (off in the paper's recipe), else None
    encoded: VLOutput
    region_logits: Tensor  # (B, R, C) masked RoI classification logits at the caller's regions (whole image excluded)
