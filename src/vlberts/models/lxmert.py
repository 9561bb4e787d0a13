"""LXMERT (Tan & Bansal 2019, "LXMERT: Learning Cross-Modality Encoder Representations from Transformers").

Implemented, all from the shared exact-BERT blocks (`blocks.py`):
- §2.1 input embeddings: words h_i = LayerNorm(WordEmbed(w_i) + IdxEmbed(i)); objects, Eq. 1,
  v_j = (LayerNorm(W_F f_j + b_F) + LayerNorm(W_P p_j + b_P)) / 2 with p_j the 4-d box
  (x1, y1, x2, y2) divided by the image width/height, which is what `VLInputs.region_boxes` holds.
- §2.2 encoders: N_L language layers and N_R object-relationship layers (BERT layers: self-attention,
  feed-forward), then N_X cross-modality layers. Inside cross-modality layer k, the bi-directional
  cross-attention runs first, language->vision and vision->language, both reading layer k-1's outputs;
  then one self-attention per modality; then one feed-forward per modality; each sub-layer with a
  residual connection and LayerNorm.
- §2.3 outputs: the language and vision sequences of the last cross-modality layer, and the
  cross-modality output from the language [CLS].
- §3.1 pre-training heads: masked cross-modality LM, masked object prediction (RoI-feature regression
  and detected-label classification, object and attribute), cross-modality matching, image QA.
  The losses belong to the objectives; this module only produces the logits.

Where the released code (airsplay/lxmert, and Hugging Face's port of it, which we match weight for
weight) departs from the paper, we follow the code, so that released checkpoints give the same numbers:
- word embeddings also add BERT's segment (token-type) embedding, which the paper does not mention;
- the position, segment and word tables use `padding_idx=0`: row 0 of each starts at zero and gets no
  gradient, so position 0 ([CLS]) and segment 0 add nothing unless a checkpoint sets them (BERT's
  position and segment tables have no padding row);
- the object embedding is followed by dropout (not in Eq. 1);
- the two cross-attention directions share one set of weights (the paper describes two
  unidirectional sub-layers without saying whether they share);
- the cross-modality output is BERT's pooler, tanh(W h_[CLS] + b), not the raw [CLS] feature;
- the QA head is Linear(D, 2D), GeLU, LayerNorm, Linear(2D, A) (the paper does not specify it);
- LayerNorm epsilon is 1e-12 everywhere.
Hugging Face's cross-modality matching head follows LXMERT's label convention (index 1 = "the
sentence matches the image"), which is the reverse of BERT's next-sentence convention.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from vlberts.data.batch import TokenSelection, VLInputs, VQABatch, as_selection
from vlberts.models.blocks import (
    AnswerMLP,
    AttentionBlock,
    BertTextConfig,
    BlockConfig,
    Encoder,
    FeedForward,
    MLMHead,
    Pooler,
    PredictionHeadTransform,
    first_row,
    gather_rows,
    init_bert_weights,
    key_bias,
    selected_text,
)
from vlberts.models.outputs import AttentionMaps, LxmertPretrainOutput, VLOutput
from vlberts.models.spatial import SPATIAL_DIMS, spatial_encoding


@dataclass(frozen=True)
class LxmertConfig(BertTextConfig):
    """Architecture only; training switches live in the run config. Defaults are the paper's (§3.3).

    The depth is split over three encoders (`num_layers` is their sum), and there is no `pad_token_id`.
    """

    language_layers: int = 9  # N_L
    relation_layers: int = 5  # N_R, the object-relationship encoder
    cross_layers: int = 5  # N_X
    visual_dim: int = 2048  # width of the detector's RoI features f_j
    visual_pos_dim: int = 4  # p_j = (x1, y1, x2, y2) / (W, H, W, H); the only box encoding LXMERT uses
    # Pre-training heads (§3.1); 0 (or False) leaves a head out, as Hugging Face's task_* switches do.
    num_object_labels: int = 1600  # detected-label classification, object classes (VG 1600)
    num_attr_labels: int = 400  # detected-label classification, attribute classes (VG 400)
    feat_regression: bool = True  # RoI-feature regression (predicts the visual_dim-d feature)
    num_qa_labels: int = 9500  # image QA over the joint answer table

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.visual_pos_dim != SPATIAL_DIMS["4d"]:
            raise ValueError(f"visual_pos_dim must be 4 (normalised x1, y1, x2, y2), got {self.visual_pos_dim}")
        counts = ("language_layers", "relation_layers", "cross_layers",
                  "num_object_labels", "num_attr_labels", "num_qa_labels")
        for name in counts:
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.cross_layers < 1:
            raise ValueError("LXMERT needs at least one cross-modality layer (cross_layers >= 1)")

    @property
    def num_layers(self) -> int:
        """All stacked layers, N_L + N_R + N_X (19 in the paper); the per-encoder counts are the fields."""
        return self.language_layers + self.relation_layers + self.cross_layers

    def describe(self) -> str:
        return (f"{self.language_layers} language + {self.relation_layers} object-relationship + {self.cross_layers} "
                f"cross-modality layers x {self.num_heads} heads, width {self.hidden_size}, visual_dim {self.visual_dim}")


class LxmertTextEmbeddings(nn.Module):
    """§2.1 word-level sentence embeddings: LayerNorm(word + index (+ segment, as in the code))."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        D = cfg.hidden_size
        # padding_idx=0 on all three tables, as in the released code (see the module docstring).
        self.word_embeddings = nn.Embedding(cfg.vocab_size, D, padding_idx=0)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, D, padding_idx=0)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, D, padding_idx=0)
        self.LayerNorm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        """input_ids, token_type_ids (B, T) -> (B, T, D)."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        words = self.word_embeddings(input_ids)  # (B, T, D)
        h = words + self.position_embeddings(pos)[None] + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(h))


class LxmertObjectEmbeddings(nn.Module):
    """§2.1 Eq. 1: v_j = (LN(W_F f_j + b_F) + LN(W_P p_j + b_P)) / 2, then dropout (code, not paper).

    Each projection is normalised before the sum "so as to balance the energy of the two different
    types of features" (§2.1).
    """

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        D = cfg.hidden_size
        self.visn_fc = nn.Linear(cfg.visual_dim, D)
        self.visn_layer_norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.box_fc = nn.Linear(cfg.visual_pos_dim, D)
        self.box_layer_norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, feats: Tensor, boxes: Tensor) -> Tensor:
        """feats (B, R, F), boxes (B, R, 4) normalised xyxy -> (B, R, D)."""
        feats = feats.to(self.visn_fc.weight.dtype)  # in the model's dtype (a float64 array's, a .half() model)
        pos = spatial_encoding(boxes, "4d").to(feats.dtype)  # (B, R, 4)
        f = self.visn_layer_norm(self.visn_fc(feats))  # (B, R, D)
        p = self.box_layer_norm(self.box_fc(pos))  # (B, R, D)
        return self.dropout((f + p) / 2)


@dataclass
class CrossLayerMaps:
    """The four attention maps of one cross-modality layer."""

    text_to_vision: Tensor  # (B, H, T, R) language queries over regions (cross-attention)
    vision_to_text: Tensor  # (B, H, R, T) region queries over words (cross-attention)
    text_self: Tensor  # (B, H, T, T)
    vision_self: Tensor  # (B, H, R, R)


class CrossModalityLayer(nn.Module):
    """§2.2 cross-modality layer: bi-directional cross-attention, then self-attention, then FFN, per modality.

    `cross_attention` is one `AttentionBlock` used in both directions (shared weights, as in the released
    code). Both directions read the layer's inputs (layer k-1's outputs), never each other's results.
    """

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.cross_attention = AttentionBlock(cfg)
        self.lang_self_att = AttentionBlock(cfg)
        self.visn_self_att = AttentionBlock(cfg)
        self.lang_ffn = FeedForward(cfg)
        self.visn_ffn = FeedForward(cfg)

    def forward(
        self, lang: Tensor, lang_bias: Tensor | None, visn: Tensor, visn_bias: Tensor | None, need_weights: bool = False,
        rows: Tensor | None = None, need_vision: bool = True,
    ) -> tuple[Tensor, Tensor | None, CrossLayerMaps | None]:
        """lang (B, T, D), visn (B, R, D); biases (B, 1, 1, T) and (B, 1, 1, R) additive key masks (None: no
        key of that stream is padded).

        Returns the new lang (B, T, D), visn (B, R, D) and, if asked, the layer's attention maps. With `rows`
        (B, M) the layer runs as the last one for callers that read only some of its outputs (`_last`): the
        language states at those rows (B, M, D), and the vision states only if `need_vision` (else None).
        (One entry point, so that FSDP, which gathers a layer's weights in its forward, sees every call.)
        """
        if rows is not None:
            return (*self._last(lang, lang_bias, visn, visn_bias, rows, need_vision), None)
        l_hat, t2v = self.cross_attention(lang, visn_bias, ctx=visn, need_weights=need_weights)  # (B, T, D)
        v_hat, v2t = self.cross_attention(visn, lang_bias, ctx=lang, need_weights=need_weights)  # (B, R, D)
        l_til, tt = self.lang_self_att(l_hat, lang_bias, need_weights=need_weights)
        v_til, vv = self.visn_self_att(v_hat, visn_bias, need_weights=need_weights)
        maps = CrossLayerMaps(t2v, v2t, tt, vv) if need_weights else None
        return self.lang_ffn(l_til), self.visn_ffn(v_til), maps

    def _last(
        self, lang: Tensor, lang_bias: Tensor | None, visn: Tensor, visn_bias: Tensor | None, rows: Tensor,
        need_vision: bool,
    ) -> tuple[Tensor, Tensor | None]:
        """The layer as the last one, for callers that read only some of its outputs: the language states
        at `rows` (B, M) -> (B, M, D), over keys and values of every word (the cross-attention runs for
        every word, since the self-attention reads them all), and the vision states (B, R, D) only if
        `need_vision` (else None: no vision->language cross-attention, self-attention or FFN). The same
        values as `forward` at those rows."""
        l_hat, _ = self.cross_attention(lang, visn_bias, ctx=visn)  # (B, T, D)
        l_til, _ = self.lang_self_att(gather_rows(l_hat, rows), lang_bias, ctx=l_hat)  # (B, M, D)
        if not need_vision:
            return self.lang_ffn(l_til), None
        v_hat, _ = self.cross_attention(visn, lang_bias, ctx=lang)  # (B, R, D)
        v_til, _ = self.visn_self_att(v_hat, visn_bias)
        return self.lang_ffn(l_til), self.visn_ffn(v_til)


class LxmertModel(nn.Module):
    """The LXMERT encoder: embeddings, language / object-relationship / cross-modality encoders, pooler.

    Parameter names: `embeddings` (text), `object_embeddings`, `encoder.layer.N` (language encoder; BERT's
    names, so BERT checkpoints load as they are), `r_encoder.layer.N`, `x_layers.N`, `pooler`.
    """

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = LxmertTextEmbeddings(cfg)
        self.object_embeddings = LxmertObjectEmbeddings(cfg)
        self.encoder = Encoder(cfg.block, cfg.language_layers)
        self.r_encoder = Encoder(cfg.block, cfg.relation_layers)
        self.x_layers = nn.ModuleList([CrossModalityLayer(cfg.block) for _ in range(cfg.cross_layers)])
        self.pooler = Pooler(cfg.hidden_size)

    def forward(self, x: VLInputs, need_attn: bool = False) -> VLOutput:
        """Encode a batch. `x.region_type_ids` and `x.image_text_alignment` are VisualBERT inputs, unused here.

        Returns text (B, T, D), vision (B, R, D), pooled (B, D) and, with `need_attn`, `AttentionMaps`:
          text_self       N_L + N_X maps (B, H, T, T): the language encoder's layers, then the
                          self-attention of each cross-modality layer;
          vision_self     N_R + N_X maps (B, H, R, R): the object-relationship encoder's layers, then
                          the self-attention of each cross-modality layer;
          text_to_vision  N_X maps (B, H, T, R): each cross-modality layer's language->vision
                          cross-attention (what `text_to_region()` stacks to (N_X, B, H, T, R));
          vision_to_text  N_X maps (B, H, R, T): the vision->language direction (same weights).
        Hugging Face returns the first three groups only in part (no cross-layer self-attention, no
        vision->text); the maps it does return equal ours.
        """
        lang, lang_bias, visn, visn_bias = self._embed(x)
        lang, text_self = self.encoder(lang, lang_bias, need_weights=need_attn)
        visn, vision_self = self.r_encoder(visn, visn_bias, need_weights=need_attn)
        t2v, v2t = [], []
        for layer in self.x_layers:
            lang, visn, maps = layer(lang, lang_bias, visn, visn_bias, need_weights=need_attn)
            if maps is not None:
                t2v.append(maps.text_to_vision)
                v2t.append(maps.vision_to_text)
                text_self.append(maps.text_self)
                vision_self.append(maps.vision_self)

        attn = None
        if need_attn:
            attn = AttentionMaps(
                text_self=text_self,
                vision_self=vision_self,
                text_to_vision=t2v,
                vision_to_text=v2t,
                source="text_to_vision",
            )
        # §2.3: the cross-modality output is read off the language [CLS].
        return VLOutput(text=lang, vision=visn, pooled=self.pooler(lang[:, 0]), attentions=attn)

    def _embed(self, x: VLInputs) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        lang = self.embeddings(x.input_ids, x.token_type_ids)  # (B, T, D)
        visn = self.object_embeddings(x.region_feats, x.region_boxes)  # (B, R, D)
        lang_bias = key_bias(x.attention_mask, lang.dtype, x.text_complete)  # (B, 1, 1, T) or None
        visn_bias = key_bias(x.region_mask, visn.dtype, x.regions_complete)  # (B, 1, 1, R) or None
        return lang, lang_bias, visn, visn_bias

    def pooled(self, x: VLInputs) -> Tensor:
        """`forward(x).pooled` (B, D) alone: the last cross-modality layer computes the language [CLS] and
        no vision state (`hidden`)."""
        h, _ = self.hidden(x, first_row(x.input_ids), need_vision=False)  # (B, 1, D)
        return self.pooler(h[:, 0])

    def hidden(self, x: VLInputs, rows: Tensor, need_vision: bool = True) -> tuple[Tensor, Tensor | None]:
        """The final language states at `rows` (B, M) -> (B, M, D) and, if `need_vision`, every final vision
        state (B, R, D) (else None): the last cross-modality layer computes only those (`CrossModalityLayer._last`),
        for the heads that read [CLS] (pooled: matching, QA, every pooled task head) and the masked words. The
        same values as `forward` there."""
        lang, lang_bias, visn, visn_bias = self._embed(x)
        lang, _ = self.encoder(lang, lang_bias)
        visn, _ = self.r_encoder(visn, visn_bias)
        for layer in self.x_layers[:-1]:
            lang, visn, _ = layer(lang, lang_bias, visn, visn_bias)
        lang, visn, _ = self.x_layers[-1](lang, lang_bias, visn, visn_bias, rows=rows, need_vision=need_vision)
        return lang, visn


class LxmertObjectHeads(nn.Module):
    """§3.1.2 masked object prediction: a shared transform, then one decoder per target.

    `decoder_dict` keys: "obj" (object-label logits), "attr" (attribute-label logits), "feat" (regressed
    RoI feature). The released code predicts labels for every region (its loss weights them by the
    detector's confidence), so the heads run on all regions.
    """

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.transform = PredictionHeadTransform(cfg.hidden_size, cfg.hidden_act, cfg.layer_norm_eps)
        sizes = {
            "obj": cfg.num_object_labels,
            "attr": cfg.num_attr_labels,
            "feat": cfg.visual_dim if cfg.feat_regression else 0,
        }
        self.decoder_dict = nn.ModuleDict({k: nn.Linear(cfg.hidden_size, n) for k, n in sizes.items() if n})

    def forward(self, vision: Tensor) -> dict[str, Tensor]:
        """vision (B, R, D) -> {"obj": (B, R, n_obj), "attr": (B, R, n_attr), "feat": (B, R, F)} (those present)."""
        h = self.transform(vision)
        return {k: dec(h) for k, dec in self.decoder_dict.items()}


class LxmertAnswerHead(AnswerMLP):
    """§3.1.3 image QA head on the cross-modality output: Linear(D, 2D), GeLU, LayerNorm, Linear(2D, A)
    (`AnswerMLP`; forward: pooled (B, D) -> answer logits (B, A))."""

    def __init__(self, cfg: LxmertConfig, num_answers: int):
        super().__init__(cfg.hidden_size, num_answers, cfg.layer_norm_eps)


class LxmertForPreTraining(nn.Module):
    """LXMERT with its pre-training heads (§3.1), named as Hugging Face's `LxmertForPreTraining`:
    `cls.predictions` (MLM, decoder tied to the word embeddings), `cls.seq_relationship` (matching),
    `obj_predict_head` (object prediction; absent if all three targets are off), `answer_head` (QA;
    absent if `num_qa_labels == 0`)."""

    def __init__(self, cfg: LxmertConfig):
        super().__init__()
        self.cfg = cfg
        self.lxmert = LxmertModel(cfg)
        self.cls = nn.Module()
        self.cls.predictions = MLMHead(cfg.hidden_size, cfg.vocab_size, cfg.hidden_act, cfg.layer_norm_eps)
        self.cls.seq_relationship = nn.Linear(cfg.hidden_size, 2)
        has_obj = cfg.num_object_labels or cfg.num_attr_labels or cfg.feat_regression
        self.obj_predict_head = LxmertObjectHeads(cfg) if has_obj else None
        self.answer_head = LxmertAnswerHead(cfg, cfg.num_qa_labels) if cfg.num_qa_labels else None
        init_bert_weights(self, cfg.initializer_range)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.cls.predictions.decoder.weight = self.lxmert.embeddings.word_embeddings.weight

    def encode(self, x: VLInputs, need_attn: bool = False, maps_only: bool = False) -> VLOutput:
        """The encoder alone (no heads): what the analyses read. `maps_only` is accepted for one call
        across the architectures; a two-stream model computes every state anyway (`VLOutput`)."""
        return self.lxmert(x, need_attn)

    def forward(
        self, x: VLInputs, need_attn: bool = False, mlm_positions: Tensor | TokenSelection | None = None
    ) -> LxmertPretrainOutput:
        """All heads present in the model. With `mlm_positions` (B, T) bool (or its `TokenSelection`), the MLM
        head runs only there: logits (N, V) for the N selected tokens in row-major order; otherwise (B, T, V).

        Pre-training passes `mlm_positions`, and its heads read the language [CLS], the masked words and
        every region: the last cross-modality layer then computes only those language rows
        (`LxmertModel.hidden`), and `encoded` is None. With `need_attn` every row is computed."""
        if mlm_positions is None or need_attn:
            out = self.lxmert(x, need_attn)
            text, vision, pooled = selected_text(out.text, mlm_positions), out.vision, out.pooled
        else:
            sel = as_selection(mlm_positions)
            lang, vision = self.lxmert.hidden(x, sel.rows, need_vision=self.obj_predict_head is not None)
            text, pooled, out = lang[:, 1:][sel.example, sel.slot], self.lxmert.pooler(lang[:, 0]), None
        obj = self.obj_predict_head(vision) if self.obj_predict_head is not None else {}
        return LxmertPretrainOutput(
            mlm_logits=self.cls.predictions(text),
            match_logits=self.cls.seq_relationship(pooled),  # (B, 2), index 1 = matched (LXMERT)
            encoded=out,
            obj_logits=obj.get("obj"),
            attr_logits=obj.get("attr"),
            feat_pred=obj.get("feat"),
            qa_logits=self.answer_head(pooled) if self.answer_head is not None else None,
        )


class LxmertForVQA(nn.Module):
    """LXMERT fine-tuned on VQA (§4, released `src/tasks/vqa_model.py`): the question alone, `[CLS] question
    [SEP]`, and the cross-modality output (the pooled language [CLS], §2.3) through the answer head of
    §3.1.3 (`LxmertAnswerHead`: Linear(D, 2D), GeLU, LayerNorm, Linear(2D, A)). Fine-tuning starts the head
    from the pre-training QA head where that head's answers are named (config.json's `qa_answers`: LXMERT's
    `--loadLXMERTQA`, `recipes.finetune_qa.copy_qa_head`), else new. Class attributes: see `VisualBertForVQA`."""

    text_format: ClassVar[str] = "question"  # [CLS] question [SEP]
    encoder_name: ClassVar[str] = "lxmert"
    head: ClassVar[str] = "pooled"
    loss: ClassVar[str] = "bce"  # LXMERT `src/tasks/vqa.py`: BCE x answers
    reads_tags: ClassVar[bool] = False

    def __init__(self, cfg: LxmertConfig, num_answers: int):
        super().__init__()
        self.cfg = cfg
        self.lxmert = LxmertModel(cfg)
        self.classifier = LxmertAnswerHead(cfg, num_answers)
        init_bert_weights(self, cfg.initializer_range)

    def forward(self, x: VLInputs) -> Tensor:
        """Answer logits (B, A) from the cross-modality output: the pooled language [CLS], which the last
        cross-modality layer computes alone (`LxmertModel.hidden`, no vision states)."""
        return self.classifier(self.lxmert.pooled(x))  # (B, D)

    def answer_logits(self, batch: VQABatch) -> Tensor:
        """Answer logits (B, A) of a `VQABatch` laid out as `text_format`."""
        return self(batch.inputs)
