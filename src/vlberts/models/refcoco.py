"""RefCOCO+ referring-expression comprehension on any architecture: a score for every candidate region.

Every paper that reports RefCOCO+ scores each region from its final visual state and trains the scores
as independent binary decisions (SPEC §4; formats-and-metrics.md §5):

  vilbert      ViLBERT §4: "we pass the final representation h_vi for each image region i into a learned
               linear layer to predict a matching score"; IoU > 0.5 labels, binary cross-entropy. The
               released code applies dropout before the linear layer (`vision_logit`).
  vlbert       VL-BERT §4.2.3: "classification scores for all the input RoIs. For each RoI, a binary
               classification loss is applied". The paper does not give the classifier; the released
               ``final_mlp`` is the masked-RoI head's transform (Linear(D, D), GELU), dropout, Linear(D, 1),
               both linear layers started Xavier-uniform with zero biases and the transform then taken
               from the pre-training model's (`models.vlbert.start_from_roi_transform`), which
               `VLBertRegionScorer` and `finetune refcoco` follow.
  wvisualbert  W-VisualBERT §4.1 (RefCOCO+): "We follow ViLBERT ... the model is trained to classify if [each
               box proposal] matches the reference phrase or not": ViLBERT's linear scorer, with the
               detector tags in the input as in its other tasks.
  visualbert   VisualBERT and LXMERT do not report RefCOCO+; we put ViLBERT's linear scorer on their final
  lxmert       region states (LXMERT: the cross-modality encoder's vision output). Our choice.

The text is ``[CLS] expression [SEP]`` (VL-BERT Fig. 2c); the regions are the candidates
(`data.refcoco_dataset`). Padding regions get the lowest score, so they never win the argmax, and the
loss (`region_bce_loss`) leaves them out.

Loss normalisation: VL-BERT's code averages the BCE over the real regions of the batch, ViLBERT's sums
it over the regions of an expression and averages over expressions (its padding gets a -10000 logit and
target 0, so it adds nothing); the two differ by a constant factor of about R, which Adam's update
nearly ignores. We use VL-BERT's mean for every architecture.

The encoder is `VLEncoder` (checkpoint keys ``encoder.model.*``, which `load_encoder_weights` reads; the
scorer ``scorer.*``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlberts.data.batch import TagInputs, VLInputs
from vlberts.models.blocks import activation, init_bert_weights
from vlberts.models.encoders import VLEncoder
from vlberts.models.vlbert import require_region_features


class LinearRegionScorer(nn.Module):
    """ViLBERT §4: dropout, then a linear layer from a region's final state to one matching score."""

    def __init__(self, width: int, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.linear = nn.Linear(width, 1)

    def forward(self, vision: Tensor) -> Tensor:
        return self.linear(self.dropout(vision)).squeeze(-1)  # (B, R, Dv) -> (B, R)


class VLBertRegionScorer(nn.Module):
    """VL-BERT's released ``final_mlp``: Linear(D, D) and the activation (the masked-RoI head's transform,
    `VisualLinguisticBertMVRCHeadTransform`), dropout, Linear(D, 1); its `init_weight` starts both linear
    layers Xavier-uniform with zero biases."""

    def __init__(self, width: int, dropout: float, act: str):
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.act = activation(act)
        self.dropout = nn.Dropout(dropout)
        self.linear = nn.Linear(width, 1)
        for layer in (self.dense, self.linear):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, vision: Tensor) -> Tensor:
        h = self.act(self.dense(vision))  # (B, R, D)
        return self.linear(self.dropout(h)).squeeze(-1)  # (B, R)


# architecture -> its region scorer (module docstring)
SCORERS = {"visualbert": "linear", "lxmert": "linear", "vilbert": "linear", "vlbert": "vlbert_mlp",
           "wvisualbert": "linear"}


class RefCocoModel(nn.Module):
    """Any architecture's encoder (`VLEncoder`) + its region scorer; `forward` gives (B, R) logits."""

    head_prefixes = ("scorer.",)

    def __init__(self, cfg: Any):
        super().__init__()
        require_region_features(cfg, "RefCOCO+ fine-tuning")
        self.cfg = cfg
        self.encoder = VLEncoder(cfg)
        self.head = SCORERS[self.encoder.arch]
        width = self.encoder.vision_size
        dropout = getattr(cfg, "v_hidden_dropout", cfg.hidden_dropout)
        if self.head == "vlbert_mlp":
            self.scorer: nn.Module = VLBertRegionScorer(width, dropout, cfg.hidden_act)
        else:
            self.scorer = LinearRegionScorer(width, dropout)
            init_bert_weights(self.scorer, cfg.initializer_range)

    @property
    def reads_tags(self) -> bool:
        return self.encoder.reads_tags

    def forward(self, x: VLInputs, tags: TagInputs | None = None) -> Tensor:
        """Region logits (B, R); padding regions hold the dtype's lowest value (never the argmax)."""
        vision = self.encoder(x, tags=tags).vision  # (B, R, Dv): the final states of the caller's regions
        logits = self.scorer(vision)  # (B, R)
        return logits.masked_fill(~x.region_mask, torch.finfo(logits.dtype).min)


def region_bce_loss(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Binary cross-entropy of every real region's score against its target (binary or soft IoU), averaged
    over the real regions (VL-BERT's ``binary_cross_entropy_with_logits(logits[box_mask], label[box_mask])``)."""
    return F.binary_cross_entropy_with_logits(logits[mask].float(), targets[mask].float())
