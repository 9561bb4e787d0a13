"""NLVR2 task model for every architecture: a pre-trained encoder (`VLEncoder`) and a two-way classifier
over "the statement is true / false of the image pair" (SPEC §4).

Two ways to bring two images to an encoder built for one (`data.nlvr2_dataset` lays out the batches):

  pair   LXMERT §4.2, App. B: encode (img0, s) and (img1, s) separately and classify the concatenation of
         the two single-vector outputs, x = [x0; x1] (B, 2P), with z = LayerNorm(GeLU(W0 x + b0)) and a
         linear layer W1 z + b1. The paper writes the output as one sigmoid unit and the loss as BCE; the
         released code (`src/tasks/nlvr2_model.py`) uses Linear(2P, 2P)-GeLU-LayerNorm-Linear(2P, 2) with
         softmax cross-entropy, which we follow. The two are the same model: a softmax over two logits is
         the sigmoid of their difference.
  joint  VisualBERT App. B.3: both images' regions in one sequence after the statement, "features from
         different images [get] different segment embeddings" (region_type_ids 0 and 1), and a classifier
         on the pooled [CLS] output; the classifier (dropout + Linear(D, 2), cross-entropy) is the
         released one as ported to Hugging Face (`VisualBertForVisualReasoning`).

The single vector each architecture contributes (P its width) is its pooled output (`VLOutput.pooled`):
  lxmert       the pooled cross-modality output (LXMERT App. B, exactly as the paper);
  visualbert   the pooled [CLS] (pair encoding only when asked for; its paper encodes jointly);
  vilbert      pool(h_CLS) * pool(h_IMG), width bi_hidden_size: ViLBERT's paper has no NLVR2; its
               multi-task release (vilbert-multi-task, NLVR2 task) concatenates the two pairs' products and
               applies the same Linear-GeLU-LayerNorm-Linear classifier, which is what `pair` does;
  vlbert       the pooled [CLS]: VL-BERT's paper has no NLVR2, so we follow LXMERT (our choice);
  wvisualbert  the pooled [CLS], with each image's detector tags in its row: W-VisualBERT §4 "we follow
               LXMERT to pair the caption with each image, concatenate the [CLS] representation of the two
               pairs, and then build a classifier on top".

Default encoding (`DEFAULT_ENCODING`): joint for visualbert, pair for the others. Only VisualBERT's
embedding has a visual segment table (`visual_token_type_embeddings`) to tell the two images' regions
apart; LXMERT, ViLBERT and W-VisualBERT give regions no segment at all and VL-BERT gives every visual
element the one segment C, so a joint sequence would mix the two images indistinguishably. We do not
invent a new embedding for them: asking for `joint` with those architectures is an error.

State-dict names: the encoder is `encoder.model.` (`VLEncoder`, as in every task model; a fine-tuned
NLVR2 directory is read by `load_encoder_weights` like any other), the head `classifier.`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from vlberts.data.nlvr2_dataset import ENCODINGS, IGNORE_LABEL, NLVR2Batch
from vlberts.errors import VlbertsError
from vlberts.models.blocks import init_bert_weights
from vlberts.models.builders import arch_of
from vlberts.models.encoders import VLEncoder
from vlberts.models.vlbert import require_region_features

DEFAULT_ENCODING = {"visualbert": "joint", "lxmert": "pair", "vilbert": "pair", "vlbert": "pair", "wvisualbert": "pair"}
JOINT_ARCHS = ("visualbert",)  # architectures with a visual segment embedding (module docstring)


def resolve_encoding(cfg: Any, encoding: str = "auto") -> str:
    """`encoding`, or the architecture's default for "auto"; an error for a layout it cannot encode."""
    arch = arch_of(cfg)
    enc = DEFAULT_ENCODING[arch] if encoding == "auto" else encoding
    if enc not in ENCODINGS:
        raise VlbertsError(f"unknown NLVR2 encoding {encoding!r}; valid: auto, {', '.join(ENCODINGS)}")
    if enc == "joint" and arch not in JOINT_ARCHS:
        raise VlbertsError(f"{arch} has no visual segment embedding to tell two images' regions apart, so it "
                           "cannot encode both images in one sequence; use --encoding=pair (LXMERT-style)")
    if enc == "joint" and cfg.type_vocab_size < 2:
        raise VlbertsError(f"the joint encoding needs two visual segments, the config has type_vocab_size "
                           f"{cfg.type_vocab_size}")
    require_region_features(cfg, "NLVR2 fine-tuning")
    return enc


def pooled_size(cfg: Any) -> int:
    """Width of the architecture's `VLOutput.pooled` (ViLBERT's is its co-attention width)."""
    return getattr(cfg, "bi_hidden_size", cfg.hidden_size)


class PairClassifier(nn.Module):
    """LXMERT App. B: [x0; x1] (B, 2P) -> Linear(2P, 2P), GeLU, LayerNorm, Linear(2P, 2) (released
    `logit_fc`)."""

    def __init__(self, size: int, eps: float = 1e-12):
        super().__init__()
        self.logit_fc = nn.Sequential(
            nn.Linear(2 * size, 2 * size), nn.GELU(), nn.LayerNorm(2 * size, eps=eps), nn.Linear(2 * size, 2),
        )

    def forward(self, x: Tensor) -> Tensor:
        return self.logit_fc(x)  # (B, 2)


class JointClassifier(nn.Module):
    """VisualBERT App. B.3 (released head): dropout + Linear(D, 2) on the pooled output."""

    def __init__(self, size: int, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.linear = nn.Linear(size, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(self.dropout(x))  # (B, 2)


class NLVR2Model(nn.Module):
    """Encoder + NLVR2 classifier (module docstring). `forward(batch)` returns logits (B, 2) over
    (False, True): index 1 is "True"."""

    def __init__(self, cfg: Any, encoding: str = "auto"):
        super().__init__()
        self.cfg = cfg
        self.encoding = resolve_encoding(cfg, encoding)
        self.encoder = VLEncoder(cfg)
        self.arch = self.encoder.arch
        size = pooled_size(cfg)
        if self.encoding == "pair":
            self.classifier: nn.Module = PairClassifier(size, cfg.layer_norm_eps)
        else:
            self.classifier = JointClassifier(size, cfg.hidden_dropout)
        init_bert_weights(self.classifier, cfg.initializer_range)

    @property
    def reads_tags(self) -> bool:
        return self.encoder.reads_tags

    def forward(self, batch: NLVR2Batch) -> Tensor:
        B = batch.size
        pooled = self.encoder.pooled(batch.inputs, tags=batch.tags)  # (B', P): B' = 2B (pair) or B (joint)
        if self.encoding == "pair":
            if pooled.shape[0] != 2 * B:
                raise ValueError(f"pair encoding expects 2B = {2 * B} encoder rows, got {pooled.shape[0]}")
            pooled = pooled.reshape(B, 2 * pooled.shape[-1])  # (B, 2P): [x0; x1], rows 2i and 2i + 1
        return self.classifier(pooled)  # (B, 2)


def nlvr2_loss(logits: Tensor, labels: Tensor) -> Tensor:
    """Mean cross-entropy over the labelled examples (LXMERT's released NLVR2 loss; module docstring)."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_LABEL)


@torch.no_grad()
def predict_labels(model: NLVR2Model, batch: NLVR2Batch) -> list[bool]:
    """The predicted label of each example: True where the "True" logit is the larger."""
    return (model(batch).argmax(-1) == 1).tolist()
