"""Flickr30K Entities phrase grounding on any architecture: an extra attention block from phrases to regions.

VisualBERT App. B.4: "we introduce an additional self-attention block and use the average attention
weights from each head to predict the alignment between boxes and phrases. For a phrase to be grounded,
we take whichever box receives the most attention from the last sub-word of the phrase as the model
prediction." `PhraseRegionAttention` is that block: its queries are the encoder's final text states at
the phrases' last subwords, its keys the final region states; per head softmax(q k^T / sqrt(d)) over the
real regions, then the mean over the heads is the phrase's distribution over the regions. Only the
attention weights are used, so the block has no value/output projections (nothing would train them).
VisualBERT's released code differs from its text here: its `FlickrAttention` sets `num_attention_heads = 1`
(one head of width hidden/num_heads, so nothing is averaged). We follow the paper's words, the model's number
of heads averaged (where paper and code disagree the paper decides, as for every system here).

Every architecture reads it through `VLEncoder`: single-stream models (VisualBERT, VL-BERT,
W-VisualBERT) give their text and region states from the joint sequence (`VLOutput.text`, `.vision`);
two-stream models (LXMERT, ViLBERT) their final language and vision states (ViLBERT's vision stream has
its own width, so the keys project from it). Only VisualBERT reports this task; for the others this head
is our choice, the same for all.

Loss (VisualBERT's code trains the averaged attention against the matched regions with a KL divergence):
cross-entropy of the log of the head-averaged attention against the target distribution uniform over the
phrase's positive regions, averaged over phrases. This is KL(target || attention) up to a constant (the
target's entropy), so it has the same gradients. Phrases without a positive region are not trained on
(`data.flickr_entities_dataset`).

Checkpoint keys: the encoder ``encoder.model.*`` (`load_encoder_weights`), the block ``alignment.*``.
Letters: B batch, H heads, P phrases per caption, T text, R regions, D width.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from vlberts.data.batch import TagInputs, VLInputs
from vlberts.models.blocks import init_bert_weights
from vlberts.models.encoders import VLEncoder
from vlberts.models.vlbert import require_region_features


class PhraseRegionAttention(nn.Module):
    """Multi-head attention weights from phrase states (queries) to region states (keys), averaged over
    heads; `forward` returns their log (B, P, R), the dtype's lowest value on padding regions."""

    def __init__(self, text_size: int, vision_size: int, num_heads: int):
        super().__init__()
        if text_size % num_heads:
            raise ValueError(f"width {text_size} is not a multiple of {num_heads} heads")
        self.num_heads = num_heads
        self.head_dim = text_size // num_heads
        self.query = nn.Linear(text_size, text_size)
        self.key = nn.Linear(vision_size, text_size)

    def forward(self, phrases: Tensor, regions: Tensor, region_mask: Tensor) -> Tensor:
        """phrases (B, P, D), regions (B, R, Dv), region_mask (B, R) bool -> log mean-head attention (B, P, R)."""
        B, P, _ = phrases.shape
        R = regions.shape[1]
        H, d = self.num_heads, self.head_dim
        q = self.query(phrases).view(B, P, H, d).transpose(1, 2)  # (B, H, P, d)
        k = self.key(regions).view(B, R, H, d).transpose(1, 2)  # (B, H, R, d)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)  # (B, H, P, R)
        low = torch.finfo(scores.dtype).min
        scores = scores.masked_fill(~region_mask[:, None, None, :], low)
        log_attn = scores.float().log_softmax(dim=-1)  # (B, H, P, R) each head's distribution over regions
        # log of the mean over heads, stably: logsumexp over H minus log H
        log_mean = torch.logsumexp(log_attn, dim=1) - math.log(H)  # (B, P, R)
        return log_mean.masked_fill(~region_mask[:, None, :], torch.finfo(log_mean.dtype).min)


class FlickrEntitiesModel(nn.Module):
    """Any architecture's encoder (`VLEncoder`) + `PhraseRegionAttention`; `forward` gives, per phrase, the
    log of the head-averaged attention over the regions (B, P, R)."""

    head_prefixes = ("alignment.",)

    def __init__(self, cfg: Any):
        super().__init__()
        require_region_features(cfg, "Flickr30K Entities fine-tuning")
        self.cfg = cfg
        self.encoder = VLEncoder(cfg)
        self.alignment = PhraseRegionAttention(self.encoder.hidden_size, self.encoder.vision_size, cfg.num_heads)
        init_bert_weights(self.alignment, cfg.initializer_range)

    @property
    def reads_tags(self) -> bool:
        return self.encoder.reads_tags

    def forward(self, x: VLInputs, positions: Tensor, tags: TagInputs | None = None) -> Tensor:
        """x: captions and regions; positions (B, P) text index of each phrase's last subword (any valid
        index on padding phrases). Returns log attention (B, P, R); its argmax is the predicted region."""
        out = self.encoder(x, tags=tags)
        D = out.text.shape[-1]
        phrases = out.text.gather(1, positions[..., None].expand(-1, -1, D))  # (B, P, D)
        return self.alignment(phrases, out.vision, x.region_mask)  # (B, P, R)


def grounding_loss(log_attn: Tensor, targets: Tensor, phrase_mask: Tensor) -> Tensor:
    """Mean over the scored phrases of -sum_r t_r log a_r, with t uniform over the phrase's positive regions
    (`targets` 0/1, at least one 1 per scored phrase) and a the head-averaged attention.

    Equals KL(t || a) + H(t): the KL divergence VisualBERT trains with, up to a constant."""
    t = targets[phrase_mask].float()  # (N, R)
    if len(t) and bool((t.sum(-1) == 0).any()):
        raise ValueError("a scored phrase has no positive region (leave it out of phrase_mask)")
    t = t / t.sum(-1, keepdim=True)  # uniform over the positives
    la = log_attn[phrase_mask].float()  # (N, R)
    # 0 * log a on non-targets (padding regions hold the lowest float, so multiply only where t > 0)
    return -torch.where(t > 0, t * la, torch.zeros_like(la)).sum(-1).mean()
