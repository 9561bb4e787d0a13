"""VisualBERT (Li et al. 2019; "What Does BERT with Vision Look At?", §2 and App. A.2).

One Transformer over the concatenation [text ; regions]. Text embeddings are BERT's. Each region's
embedding is the sum of (App. A.2)
  f_o  a projection of the detector's region feature,
  f_s  a visual segment embedding,
  f_p  a visual position embedding; when word-region alignments are given (VCR) it is the average of the
       aligned words' position embeddings plus the visual position embedding of index 0,
and one LayerNorm covers the whole concatenated sequence. Regions are never masked in pre-training.

`fusion_layer` > 0 gives the ablation "VisualBERT w/o Early Fusion" (App. B, App. C "C2"): the layers
before it run on the text alone, and the regions join at layer `fusion_layer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from vlberts.data.batch import TokenSelection, VLInputs, VQABatch, as_selection
from vlberts.models.blocks import (
    BertTextConfig,
    Encoder,
    MLMHead,
    Pooler,
    first_row,
    init_bert_weights,
    key_bias,
    selected_text,
)
from vlberts.models.outputs import AttentionMaps, PretrainOutput, VLOutput
from vlberts.models.spatial import SPATIAL_DIMS, spatial_encoding


@dataclass(frozen=True)
class VisualBertConfig(BertTextConfig):
    """Architecture only; training switches live in the run config."""

    num_layers: int = 12
    pad_token_id: int = 0
    visual_dim: int = 2048  # width of the detector's region features
    # VisualBERT's only use of box geometry: the Flickr30K setting concatenates 6-d
    # (x1/W, y1/H, x2/W, y2/H, w/W, h/H) to the feature, so the projection reads visual_dim + 6.
    visual_spatial: Literal["none", "6d"] = "none"
    # Copy the text segment/position tables into the visual ones at initialisation (original code).
    special_visual_initialize: bool = True
    # Index of the first encoder layer that sees the regions. 0 is VisualBERT: early fusion, the regions
    # join the text at the input of layer 0. k > 0 is the ablation "VisualBERT w/o Early Fusion" (App. B:
    # "image representations are not combined with the text in the initial Transformer layer but instead
    # at the very end with a new Transformer layer"; App. C, C2): layers 0..k-1 run on the text alone, and
    # at layer k the regions join as they left the embedding layer. The paper's variant is k =
    # num_layers - 1 with one layer added on top of BERT's (`visualbert_no_early_fusion`), as in the
    # original code's `bypass_transformer`, whose `additional_layer` is our layer k.
    fusion_layer: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.visual_spatial not in ("none", "6d"):
            raise ValueError(f"visual_spatial must be 'none' or '6d', got {self.visual_spatial!r}")
        if not 0 <= self.fusion_layer < self.num_layers:
            # At least one layer must see the regions, or the image would never reach the text.
            raise ValueError(
                f"fusion_layer must be in [0, num_layers - 1] = [0, {self.num_layers - 1}], got {self.fusion_layer}"
            )

    @property
    def projection_in(self) -> int:
        return self.visual_dim + SPATIAL_DIMS[self.visual_spatial]

    def describe(self) -> str:
        late = f", regions join at layer {self.fusion_layer + 1}" if self.fusion_layer else ""
        return (f"{self.num_layers} layers x {self.num_heads} heads, width {self.hidden_size}, "
                f"visual_dim {self.visual_dim}{late}")


class VisualBertEmbeddings(nn.Module):
    def __init__(self, cfg: VisualBertConfig):
        super().__init__()
        D = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, D, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, D)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, D)
        self.visual_token_type_embeddings = nn.Embedding(cfg.type_vocab_size, D)
        self.visual_position_embeddings = nn.Embedding(cfg.max_position_embeddings, D)
        self.visual_projection = nn.Linear(cfg.projection_in, D)
        self.LayerNorm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.spatial = cfg.visual_spatial

    def forward(self, x: VLInputs) -> Tensor:
        B, T = x.input_ids.shape
        pos = torch.arange(T, device=x.input_ids.device)
        text = (
            self.word_embeddings(x.input_ids)
            + self.token_type_embeddings(x.token_type_ids)
            + self.position_embeddings(pos)[None]
        )  # (B, T, D)

        feats = x.region_feats.to(self.visual_projection.weight.dtype)  # (B, R, F) in the model's dtype
        if self.spatial != "none":
            feats = torch.cat([feats, spatial_encoding(x.region_boxes, self.spatial).to(feats.dtype)], dim=-1)
        R = feats.shape[1]
        vtype = x.region_type_ids
        if vtype is None:
            vtype = torch.ones(B, R, dtype=torch.long, device=feats.device)
        zero_pos = self.visual_position_embeddings.weight[0]  # (D,)
        if x.image_text_alignment is not None:
            # App. A.2 / B.2: position = average of the aligned words' position embeddings.
            align = x.image_text_alignment  # (B, R, K)
            valid = (align >= 0).to(text.dtype)  # (B, R, K)
            word_pos = self.position_embeddings(align.clamp(min=0)) * valid[..., None]  # (B, R, K, D)
            vpos = word_pos.sum(2) / valid.sum(2).clamp(min=1)[..., None] + zero_pos
        else:
            vpos = zero_pos.expand(B, R, -1)
        vis = self.visual_projection(feats) + self.visual_token_type_embeddings(vtype) + vpos  # (B, R, D)
        return self.dropout(self.LayerNorm(torch.cat([text, vis], dim=1)))  # (B, T + R, D)


class VisualBertModel(nn.Module):
    """The VisualBERT encoder: embeddings, BERT layers, pooler."""

    def __init__(self, cfg: VisualBertConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = VisualBertEmbeddings(cfg)
        self.encoder = Encoder(cfg.block, cfg.num_layers)
        self.pooler = Pooler(cfg.hidden_size)

    def hidden(
        self, x: VLInputs, need_attn: bool = False, rows: Tensor | None = None, maps_only: bool = False
    ) -> tuple[Tensor | None, list[Tensor]]:
        """Final hidden states (B, S, D), S = T + R, and the attention maps if asked; with `rows`
        (B, M) only those positions' states, (B, M, D); with `maps_only` the maps alone and None
        (`Encoder.forward`)."""
        T = x.input_ids.shape[1]
        h = self.embeddings(x)  # (B, S, D)
        mask = torch.cat([x.attention_mask.bool(), x.region_mask.bool()], dim=1)  # (B, S)
        bias = key_bias(mask, h.dtype, x.text_complete and x.regions_complete)  # (B, 1, 1, S) or None
        k = self.cfg.fusion_layer
        if k == 0:
            return self.encoder(h, bias, need_weights=need_attn, rows=rows, maps_only=maps_only)
        # Without early fusion: the text alone through layers 0..k-1, then the regions' embeddings are
        # appended and layers k.. run on the whole sequence (original code: `bypass_transformer`).
        text, maps = h[:, :T], []
        text_bias = key_bias(x.attention_mask.bool(), h.dtype, x.text_complete)  # (B, 1, 1, T) or None
        for layer in self.encoder.layer[:k]:
            text, probs = layer(text, text_bias, need_attn)  # (B, T, D); probs (B, H, T, T)
            maps.append(probs)
        h = torch.cat([text, h[:, T:]], dim=1)  # (B, S, D)
        h, more = self.encoder(h, bias, need_weights=need_attn, rows=rows, start=k, maps_only=maps_only)
        return h, (maps + more if need_attn else [])

    def pooled(self, x: VLInputs) -> Tensor:
        """`forward(x).pooled` (B, D) alone: the last layer computes [CLS] alone (`Encoder.forward` rows)."""
        h, _ = self.hidden(x, rows=first_row(x.input_ids))  # (B, 1, D)
        return self.pooler(h[:, 0])

    def forward(self, x: VLInputs, need_attn: bool = False, maps_only: bool = False) -> VLOutput:
        """With `need_attn`, `attentions.joint` holds one map per layer: (B, H, S, S) for the layers that
        see the regions, (B, H, T, T) for the text-only layers before `cfg.fusion_layer`. `maps_only`
        (with `need_attn`): the same maps, for less work, and no hidden states (`VLOutput.maps_only`)."""
        T, R = x.input_ids.shape[1], x.region_mask.shape[1]
        h, maps = self.hidden(x, need_attn, maps_only=maps_only)
        attn = AttentionMaps.of_joint(maps, T, T, R, x.input_ids.device, self.cfg.fusion_layer) if need_attn else None
        if h is None:
            return VLOutput.maps_only(attn)
        return VLOutput(text=h[:, :T], vision=h[:, T:], pooled=self.pooler(h[:, 0]), attentions=attn)


class VisualBertForPreTraining(nn.Module):
    """VisualBERT with its two pre-training heads (App. A.3): MLM with the image, sentence-image match."""

    def __init__(self, cfg: VisualBertConfig):
        super().__init__()
        self.cfg = cfg
        self.bert = VisualBertModel(cfg)
        self.cls = nn.Module()
        self.cls.predictions = MLMHead(cfg.hidden_size, cfg.vocab_size, cfg.hidden_act, cfg.layer_norm_eps)
        self.cls.seq_relationship = nn.Linear(cfg.hidden_size, 2)
        init_bert_weights(self, cfg.initializer_range)
        if cfg.special_visual_initialize:
            emb = self.bert.embeddings
            with torch.no_grad():
                emb.visual_token_type_embeddings.weight.copy_(emb.token_type_embeddings.weight)
                emb.visual_position_embeddings.weight.copy_(emb.position_embeddings.weight)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def encode(self, x: VLInputs, need_attn: bool = False, maps_only: bool = False) -> VLOutput:
        """The encoder alone (no heads): what the analyses read."""
        return self.bert(x, need_attn, maps_only)

    def forward(
        self, x: VLInputs, need_attn: bool = False, mlm_positions: Tensor | TokenSelection | None = None
    ) -> PretrainOutput:
        """With `mlm_positions` (B, T) bool (or its `TokenSelection`), the MLM head runs only there:
        logits (N, V) for the N selected tokens in row-major order. Otherwise logits are (B, T, V).

        Pre-training passes `mlm_positions` and reads nothing else than the two heads, which read only
        [CLS] and the masked words: the last layer then computes just those rows (`Encoder.forward`,
        `TokenSelection.rows`), and `encoded` is None. With `need_attn` every row is computed."""
        if mlm_positions is None or need_attn:
            out = self.bert(x, need_attn)
            text = selected_text(out.text, mlm_positions)
            return PretrainOutput(self.cls.predictions(text), self.cls.seq_relationship(out.pooled), encoded=out)
        sel = as_selection(mlm_positions)
        h, _ = self.bert.hidden(x, rows=sel.rows)  # (B, 1 + n, D)
        return PretrainOutput(
            mlm_logits=self.cls.predictions(h[:, 1:][sel.example, sel.slot]),  # (N, V)
            match_logits=self.cls.seq_relationship(self.bert.pooler(h[:, 0])),  # (B, 2)
            encoded=None,
        )


class VisualBertForVQA(nn.Module):
    """VisualBERT's VQA model (App. B.1): the question is followed by a [MASK] token, and an answer
    classifier (dropout + linear, as in the original `training_head_type == "vqa"`) reads the [MASK]
    token's final hidden state.

    The class attributes tell the fine-tuning recipe how to feed it (shared by every `*ForVQA` model):
    `text_format` the question layout (`data.vqa_dataset.TEXT_FORMATS`), `encoder_name` the submodule
    whose weights come from the pre-training checkpoint, `head` a name of the answer head for config.json,
    `loss` the paper's VQA loss (`recipes.finetune_vqa.LOSSES`), `reads_tags` whether batches must carry
    detector tags."""

    text_format: ClassVar[str] = "mask"  # [CLS] question [MASK] [SEP]
    encoder_name: ClassVar[str] = "bert"
    head: ClassVar[str] = "mask"
    loss: ClassVar[str] = "kl"  # VisualBERT: KL-divergence to the soft scores (App. A, original code)
    reads_tags: ClassVar[bool] = False

    def __init__(self, cfg: VisualBertConfig, num_answers: int):
        super().__init__()
        self.cfg = cfg
        self.bert = VisualBertModel(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.classifier = nn.Linear(cfg.hidden_size, num_answers)
        init_bert_weights(self, cfg.initializer_range)

    def forward(self, x: VLInputs, answer_pos: Tensor) -> Tensor:
        """answer_pos (B,) index of the [MASK] slot in the text; returns answer logits (B, A). The head
        reads that slot alone, so the last layer computes it alone (`Encoder.forward` rows): the same
        logits, for about 1/num_layers less work."""
        slot, _ = self.bert.hidden(x, rows=answer_pos[:, None])  # (B, 1, D)
        return self.classifier(self.dropout(slot[:, 0]))

    def answer_logits(self, batch: VQABatch) -> Tensor:
        """Answer logits (B, A) of a `VQABatch` laid out as `text_format`."""
        return self(batch.inputs, batch.answer_pos)
