"""Image-text retrieval on any architecture: one alignment score per (caption, image) pair.

ViLBERT §4 (caption-based image retrieval, Flickr30K): the score of a pair is the alignment head on the
holistic representation h_IMG * h_CLS; fine-tuning trains it as a 4-way multiple choice (softmax
cross-entropy over the scores of a positive pair and three negatives, `four_way_loss`), and zero-shot
retrieval ranks with the pre-trained alignment head itself, without fine-tuning. Here every architecture
gets the same kind of scorer: a linear layer from its pooled output to one score.

  vilbert      pooled = pool(h_IMG) * pool(h_CLS) (the released poolers, §2.2), dropout on the product
               as its pre-training alignment head has, then the linear layer (ViLBERT §4).
  visualbert   BERT's tanh pooler on [CLS], the pre-training sentence-image head's input (App. A.3).
  lxmert       the cross-modality output (pooled language [CLS], §2.3), the input of its matching head.
  vlbert       BERT's pooler on [CLS]. VL-BERT pre-trains without a sentence-image task (§3.3 drops it),
               so its scorer starts new (unless the checkpoint has `with_match_head`).
  wvisualbert  the pooled [CLS], detector tags in the input (§3.2). W-VisualBERT never sees image-text
               pairs, so it has no matching head (only the paired S-/H- variants do).
VisualBERT, LXMERT and VL-BERT report no retrieval results. W-VisualBERT reports fine-tuned Flickr30K
R@1/5/10 (Table 1) but no zero-shot; it fine-tunes with UNITER's sampling, one positive and two negative
pairs (§4.1 "Flickr30K"), and does not give its head. We use ViLBERT's 4-way setting and this linear
scorer for every architecture (our choice), so that the architectures differ only in their encoder.
ViLBERT's evaluation caches the text stream before the first Co-TRM layer for speed (§4); we run every
pair through the whole encoder (the same scores, slower).

Initialisation from the pre-training matching head (our choice; the papers are silent). That head is a
2-way linear layer (W, b) over the same pooled vector, with its architecture's label convention
(`objectives.recipe.RECIPES[arch].match_convention`: index 0 = match for VisualBERT's NSP convention and
ViLBERT, 1 for LXMERT and W-VisualBERT). The scorer starts as its log-odds of "match":

    score(h) = (W[m] - W[1-m]) h + (b[m] - b[1-m]) = log p(match | h) - log p(no match | h)

a monotone function of the head's own match probability, so zero-shot ranking with the scorer is
ranking by the pre-trained head's P(match). (The match logit alone, W[m] h + b[m], would ignore the
"no match" logit, which also depends on h.) Zero-shot evaluation = this scorer without fine-tuning.

Text layouts (`TEXT_FORMATS`): ``caption`` is ``[CLS] caption [SEP]`` (one segment), the layout every
architecture but VisualBERT pre-trained its matching head on. VisualBERT's head was trained on
``[CLS] a [SEP] b [SEP]`` judging whether caption b belongs to the image (a always does, App. A.3);
with a single caption we leave a empty and put the caption where b was, ``[CLS] [SEP] caption [SEP]``
(``second_segment``), so the head reads the caption in the segment it judged in pre-training. Our choice.

The encoder is `VLEncoder` (checkpoint keys ``encoder.model.*``), the scorer ``scorer.*``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlberts.data.batch import TagInputs, VLInputs
from vlberts.models.blocks import init_bert_weights
from vlberts.models.encoders import VLEncoder
from vlberts.models.vlbert import require_region_features
from vlberts.objectives.recipe import RECIPES

# architecture -> its caption layout (module docstring)
TEXT_FORMATS = {"visualbert": "second_segment", "lxmert": "caption", "vilbert": "caption", "vlbert": "caption",
                "wvisualbert": "caption"}

# architecture -> name of its pre-training matching head inside `*ForPreTraining` (checkpoint keys NAME.weight/.bias)
MATCH_HEADS = {"visualbert": "cls.seq_relationship", "lxmert": "cls.seq_relationship",
               "vilbert": "cls.bi_seq_relationship", "vlbert": "cls.seq_relationship",
               "wvisualbert": "cls.seq_relationship"}

# why an architecture's checkpoint may lack the head (for the zero-shot error)
NO_MATCH_HEAD = {
    "vlbert": "VL-BERT pre-trains without the sentence-image relationship task (§3.3; with_match_head=false)",
    "wvisualbert": "W-VisualBERT pre-trains on unpaired data without image-text matching (only the S-/H- "
                   "variants have the head; match_head=false)",
}


class RetrievalModel(nn.Module):
    """Any architecture's encoder (`VLEncoder`) + a linear alignment scorer on its pooled output;
    `forward` gives one score per pair, (N,)."""

    head_prefixes = ("scorer.",)

    def __init__(self, cfg: Any):
        super().__init__()
        require_region_features(cfg, "retrieval")
        self.cfg = cfg
        self.encoder = VLEncoder(cfg)
        self.arch = self.encoder.arch
        self.text_format = TEXT_FORMATS[self.arch]
        width = getattr(cfg, "bi_hidden_size", cfg.hidden_size)  # ViLBERT's pooled product is bi_hidden_size wide
        # ViLBERT's alignment head has dropout on the product (its release); the others' heads read pooled directly.
        self.dropout = nn.Dropout(cfg.hidden_dropout if self.arch == "vilbert" else 0.0)
        self.scorer = nn.Linear(width, 1)
        init_bert_weights(self.scorer, cfg.initializer_range)

    @property
    def reads_tags(self) -> bool:
        return self.encoder.reads_tags

    def forward(self, x: VLInputs, tags: TagInputs | None = None) -> Tensor:
        pooled = self.encoder.pooled(x, tags=tags)  # (N, D)
        return self.scorer(self.dropout(pooled)).squeeze(-1)  # (N,)

    def init_from_match_head(self, weight: Tensor, bias: Tensor) -> None:
        """Start the scorer as the log-odds of "match" of a pre-training matching head (2, D), (2,)
        (module docstring), in this architecture's label convention."""
        m = 1 if RECIPES[self.arch].match_convention == "lxmert" else 0
        with torch.no_grad():
            self.scorer.weight.copy_((weight[m] - weight[1 - m])[None, :])
            self.scorer.bias.copy_((bias[m] - bias[1 - m]).reshape(1))


def match_head_weights(state_dict: dict[str, Tensor], arch: str) -> tuple[Tensor, Tensor] | None:
    """The pre-training matching head (weight (2, D), bias (2,)) of a checkpoint's state dict, or None."""
    name = MATCH_HEADS[arch]
    if f"{name}.weight" not in state_dict:
        return None
    return state_dict[f"{name}.weight"], state_dict[f"{name}.bias"]


def four_way_loss(scores: Tensor, group: int = 4) -> Tensor:
    """ViLBERT §4: softmax cross-entropy over each group's scores, the positive first.

    scores (G * group,), groups contiguous -> mean over the G groups."""
    logits = scores.float().view(-1, group)  # (G, 4)
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device))
