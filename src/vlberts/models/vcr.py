"""VCR multiple choice on any architecture: one score per (context, choice) sequence, softmax over the 4.

Each question becomes 4 sequences, ``[CLS] context [SEP] choice [SEP]`` with the question's object
regions (`data.vcr_dataset`); the model scores each and the 4 scores are trained with softmax
cross-entropy (`vcr_loss`). Q->A and QA->R are separate models, trained and run the same way.

  visualbert   VisualBERT §4.2: a linear layer on the pooled [CLS] output (BERT's tanh pooler) gives the
               score; object-reference words are aligned to their regions, which take the average
               position embedding of those words (`VLInputs.image_text_alignment`, App. A).
  vlbert       VL-BERT §4.2.1: the same scorer on the pooled [CLS]; object references are their class
               names, and every word's visual feature embedding is the whole image's (§3.2). With the
               alignment (`--alignment=true`, `ALIGNING`), a word naming object k takes region k's instead,
               as the released VCR code does (`models.vlbert.text_visual_index`).
  vilbert      ViLBERT §4 (VCR): a linear layer on h_IMG * h_CLS (the encoder's pooled product, §2.2),
               dropout on the product as in its pre-training alignment head.
  lxmert       LXMERT reports no VCR: our choice, the same linear scorer on its pooled cross-modality
               output (the input of its matching and QA heads, §3.1.3).
  wvisualbert  W-VisualBERT reports no VCR: our choice, the linear scorer on the pooled [CLS], detector
               tags of the object regions in the input (§3.2).

The encoder is `VLEncoder` (checkpoint keys ``encoder.model.*``), the scorer ``scorer.*`` (new: BERT's init,
VL-BERT's Xavier-uniform with a zero bias, as its release starts the VCR classifier).

Object classification (VL-BERT §4.2.1: "During fine-tuning, we adopt two losses, the classification over the
correctness of the answers and the RoI classification with linguistic clues"): with `object_classes` > 0 an
``object_head`` (dense, activation, dropout, linear over the classes: the released `cnn_loss_reg`) reads each
region's final state and is trained to name its object's class (`vcr_object_loss`); its dense layer starts
from a VL-BERT pre-training model's RoI-classification transform (``region_head.dense``) when the initial
weights hold one, as the release copies `mvrc_head.transform` into it. It never changes a prediction.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from vlberts.data.vcr import NUM_CHOICES
from vlberts.data.vcr_dataset import IGNORE, JOIN, VCRBatch
from vlberts.errors import VlbertsError
from vlberts.models.blocks import activation, init_bert_weights
from vlberts.models.encoders import VLEncoder
from vlberts.models.vlbert import require_region_features


class ObjectClassHead(nn.Module):
    """Region state -> object class logits: dense, activation, dropout, linear (VL-BERT's `cnn_loss_reg`)."""

    def __init__(self, width: int, num_classes: int, act: str, dropout: float, initializer_range: float):
        super().__init__()
        self.dense = nn.Linear(width, width)
        self.act = activation(act)
        self.dropout = nn.Dropout(dropout)
        self.decoder = nn.Linear(width, num_classes)
        init_bert_weights(self, initializer_range)

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.dropout(self.act(self.dense(x))))


class VCRModel(nn.Module):
    """`VLEncoder` + a linear scorer on its pooled output; `forward(batch)` gives (B, 4) choice logits;
    `with_objects(batch)` also the object-class logits of every region (module docstring)."""

    head_prefixes = ("scorer.", "object_head.")

    def __init__(self, cfg: Any, object_classes: int = 0):
        super().__init__()
        require_region_features(cfg, "VCR fine-tuning")
        self.cfg = cfg
        self.encoder = VLEncoder(cfg)
        self.arch = self.encoder.arch
        self.join = JOIN[self.arch]  # how multi-object references are written (data.vcr_dataset)
        self.uses_alignment = self.arch == "visualbert"  # VisualBERT §4.2 / App. A: word-region alignment
        width = getattr(cfg, "bi_hidden_size", cfg.hidden_size)  # ViLBERT's pooled product is bi_hidden_size wide
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.scorer = nn.Linear(width, 1)
        init_bert_weights(self.scorer, cfg.initializer_range)
        if self.arch == "vlbert":  # the release's VCR `final_mlp` linear: Xavier-uniform, bias 0 (its `init_weight`)
            nn.init.xavier_uniform_(self.scorer.weight)
            nn.init.zeros_(self.scorer.bias)
        self.object_head = None
        if object_classes:
            self.object_head = ObjectClassHead(self.encoder.vision_size, object_classes, cfg.hidden_act,
                                               cfg.hidden_dropout, cfg.initializer_range)

    @property
    def reads_tags(self) -> bool:
        return self.encoder.reads_tags

    def inputs(self, batch: VCRBatch) -> Any:
        """The batch's `VLInputs`, without the word-region alignment unless this model reads it."""
        x = batch.inputs
        if not self.uses_alignment and x.image_text_alignment is not None:
            x = type(x)(**{**x.__dict__, "image_text_alignment": None})
        return x

    def forward(self, batch: VCRBatch) -> Tensor:
        pooled = self.encoder.pooled(self.inputs(batch), tags=batch.tags)  # (B*4, D)
        return self.scorer(self.dropout(pooled)).view(-1, NUM_CHOICES)  # (B, 4)

    def with_objects(self, batch: VCRBatch) -> tuple[Tensor, Tensor]:
        """(B, 4) choice logits and (B*4, R, C) object-class logits of every region of every choice's
        sequence (the whole encoder runs: `forward`'s pooled-only shortcut skips the regions' last states)."""
        if self.object_head is None:
            raise ValueError("this VCR model has no object head (built with object_classes=0)")
        out = self.encoder(self.inputs(batch), tags=batch.tags)
        logits = self.scorer(self.dropout(out.pooled)).view(-1, NUM_CHOICES)  # (B, 4)
        return logits, self.object_head(out.vision)  # (B*4, R, C)


CHOICE_LOSSES = ("softmax", "sigmoid")
# The architectures that read the word-region alignment, and what they do with it: VisualBERT (§4.2, App. A,
# on by default) gives a region the position of the words naming it; VL-BERT (its released VCR code, off by
# default: §3.2 gives every word the whole image's) gives those words the region's visual feature embedding.
ALIGNING = {"visualbert": True, "vlbert": False}


def uses_alignment(setting: str | bool, arch: str) -> bool:
    """`--alignment` resolved for `arch`: auto -> `ALIGNING`'s default; true for an architecture that reads
    no alignment is an error (it would be ignored)."""
    value = str(setting).lower()
    if value not in ("auto", "true", "false"):
        raise VlbertsError(f"--alignment is auto, true or false, got {setting!r}")
    if value == "true" and arch not in ALIGNING:
        raise VlbertsError(f"--alignment=true: {arch} reads no word-region alignment (VisualBERT and VL-BERT do)")
    return ALIGNING.get(arch, False) if value == "auto" else value == "true"


def vcr_object_loss(object_logits: Tensor, object_labels: Tensor) -> Tensor:
    """Cross-entropy of each region's object class (VL-BERT §4.2.1), over every choice's sequence as the
    release computes it, averaged within each question and then over the questions (so that a batch split
    into micro-batches or ranks, weighted by questions, gives the same loss; the release averages over the
    batch's regions). object_logits (B*4, R, C), object_labels (B, R) with -100 for none -> a scalar."""
    labels = object_labels.repeat_interleave(NUM_CHOICES, dim=0)  # (B*4, R), question-major as the logits
    ce = F.cross_entropy(object_logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                         reduction="none").view(-1, NUM_CHOICES * labels.shape[1])  # (B, 4R)
    valid = (labels != IGNORE).view(-1, NUM_CHOICES * labels.shape[1]).float()  # (B, 4R)
    return ((ce * valid).sum(1) / valid.sum(1).clamp(min=1)).mean()


def vcr_loss(logits: Tensor, labels: Tensor, kind: str = "softmax") -> Tensor:
    """softmax: cross-entropy over each question's 4 choice scores (VisualBERT §4.2, VL-BERT §4.2.1, ViLBERT
    §4), mean over B. sigmoid: each choice's score a binary logit, 1 for the right choice and 0 for the three
    others, mean over the B x 4 (VL-BERT's released VCR configs, `CLASSIFIER_SIGMOID: true` with its positive
    weight 1). logits (B, 4), labels (B,) -> a scalar; the prediction is the top score either way."""
    if kind == "sigmoid":
        target = F.one_hot(labels, logits.shape[-1]).float()  # (B, 4)
        return F.binary_cross_entropy_with_logits(logits.float(), target)
    return F.cross_entropy(logits.float(), labels)
