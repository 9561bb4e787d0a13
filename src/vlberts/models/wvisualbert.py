"""W-VisualBERT (Li et al., "Unsupervised Vision-and-Language Pre-training Without Parallel Images and
Captions", NAACL 2021; `papers/weakly-supervised-visualbert.txt`) and its S-/H-/NT variants.

One Transformer (shared BERT layers, §3.2 "a single Transformer is used throughout two modalities") over

    [text ; regions ; tags]        text  w_1..n   (may be empty: image-only batches)
                                   regions r_1..m, tags d_1..l (both absent: text-only batches)

Embeddings (§3.1, §3.2, and the released code's `BertEmbeddingsWithVisualEmbedding`,
reference/formats-and-metrics.md §3.6):
  text   w_i = LN_text(word(w_i) + position(i) + segment(s_i))                     (BERT)
  region r_j = LN_visn(W_f f_j) + sp(b_j)                                         (LXMERT Eq. 1, no /2)
  tag    d_k = LN_tag(word(d_k)) + sp(b_{region(k)})                              (§3.2)
with sp(b) = LN_box(W_b b) the spatial embedding of the 4-d normalised box (x1, y1, x2, y2). The tag's
token table is the text's word table, and its spatial embedding is *the same module* as its region's
("the spatial coordinate embedding is the same as the coordinate embedding of the corresponding
region"): every subword of a multi-subword tag gets its region's box (footnote 5). Regions and tags
carry no position and no segment embedding (released code; the paper is silent).

Heads: the shared MLM head (decoder tied to the word table) predicts masked text subwords *and* masked
tag subwords (§3.2 "the prediction softmax layer is shared between the tag and text subwords");
LXMERT's visual heads on the regions (§3.1: feature regression + detected-label classification);
an image-text match head only in the paired variants (S-/H-VisualBERT, §3.1 "text-image match").

Variants (paper §4.1-4.4, Tables 1-3). The config holds architecture only; what differs besides it is
the pre-training data, which lives in the run config:
  W-VisualBERT      unpaired text batches and image batches, tags, no match head   `wvisualbert-base`
  W-VisualBERT_NT   the same without tags (regions only, pre-training and fine-tuning) `wvisualbert-nt`
  S-VisualBERT      *paired* caption-image data; same architecture + text-image match `wvisualbert-s`
  S-VisualBERT_NT   S without tags                                                   `wvisualbert-s-nt`
  H-VisualBERT      paired data + extra unpaired images (§4.3); S's architecture       `wvisualbert-h`

Choices where the paper is silent (documented, see also `describe()`):
- Order: the paper writes I = [r_1:m ; d_1:l], so we lay out [text ; regions ; tags]; the released code
  concatenates [text ; tags ; regions]. Since neither regions nor tags get a position embedding, the
  encoder is permutation-equivariant over the visual part and both orders give the same outputs
  (up to the permutation); only the index layout of the attention maps differs.
- Pooled output: BERT's pooler on the first element of the sequence, which is [CLS] whenever there is
  text; in an image-only batch (T = 0) it is the first region (the match head is not trained there).
- `AttentionMaps.region_index` covers the region positions only, not the tags, so `text_to_region()`
  is word-to-box attention as in the VisualBERT analysis; `WVisualBertOutput.tag_index` gives the tags'.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from vlberts.data.batch import TagInputs, TokenSelection, VLInputs, VQABatch  # TagInputs re-exported: the models' tag input type
from vlberts.models.blocks import (
    AnswerMLP,
    BertTextConfig,
    Encoder,
    MLMHead,
    Pooler,
    PredictionHeadTransform,
    first_row,
    init_bert_weights,
    key_bias,
    selected_text,
)
from vlberts.models.outputs import AttentionMaps, VLOutput


@dataclass(frozen=True)
class WVisualBertConfig(BertTextConfig):
    """Architecture only; training switches (masking ratios, data mixing) live in the run config."""

    num_layers: int = 12
    pad_token_id: int = 0
    visual_dim: int = 2048  # width of the detector's region features
    visual_pos_dim: int = 4  # (x1, y1, x2, y2) / (W, H, W, H), as LXMERT
    # Detector tags as extra visual tokens (§3.2). False is the paper's NT ablation (§4.4): the model
    # never sees tags, in pre-training or fine-tuning, and ignores any it is given.
    use_tags: bool = True
    # Image-text match head: the paired variants' objective (§3.1); W-VisualBERT sees no pairs.
    match_head: bool = False
    # BERT's next-sentence head on [CLS] for text documents (footnote 4: "we also adopt the next sentence
    # prediction task in BERT when long documents are available"). The paired variants' match head is the
    # same Linear(D, 2) on the pooled output and serves as it; this switch gives W-VisualBERT one.
    nsp_head: bool = False
    # LXMERT's visual heads (§3.1 "the two visual sub-tasks in LXMERT"); 0 / False leaves one out.
    num_object_labels: int = 1600
    num_attr_labels: int = 400
    feat_regression: bool = True
    variant: str = "W"  # the paper's name of the variant, for describe() only: W, S, H

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.visual_pos_dim != 4:
            raise ValueError(f"visual_pos_dim must be 4 (W-VisualBERT's 4-d boxes), got {self.visual_pos_dim}")
        if self.variant not in ("W", "S", "H"):
            raise ValueError(f"variant must be 'W', 'S' or 'H', got {self.variant!r}")

    @property
    def pair_head(self) -> bool:
        """Whether the model has the (B, 2) head on the pooled output (`cls.seq_relationship`)."""
        return self.match_head or self.nsp_head

    def describe(self) -> str:
        name = f"{self.variant}-VisualBERT" + ("" if self.use_tags else "_NT")
        data = {"W": "unpaired text/image batches", "S": "paired data", "H": "paired data + unpaired images"}
        tags = "[text ; regions ; tags]" if self.use_tags else "[text ; regions], no tags"
        match = ", image-text match head" if self.match_head else ""
        return (f"{name}: {self.num_layers} layers x {self.num_heads} heads, width {self.hidden_size}, "
                f"visual_dim {self.visual_dim}, {tags}{match}; pre-trains on {data[self.variant]}")


# ---------------------------------------------------------------------------------------------------
# Tag inputs


def tag_tokens(
    obj_ids: Sequence[int],
    class_subwords: Sequence[Sequence[int]],
    *,
    attr_ids: Sequence[int] | None = None,
    attr_subwords: Sequence[Sequence[int]] | None = None,
    use_attr: Sequence[bool] | None = None,
    max_tokens: int | None = None,
) -> tuple[list[int], list[int]]:
    """One image's tags as a subword sequence with a per-subword region index (§3.2, footnote 5).

    obj_ids (N,): the detector's object class per box (`RegionRecord.obj_id`); class_subwords[c]: the
    WordPiece ids of class c's name (the released code uses the first synonym of the vocabulary line).
    With `use_attr[j]` true, box j's tag is its attribute word instead (released code: drawn per box with
    p = 0.15 during pre-training; the caller draws, so this function stays pure).
    max_tokens: keep whole tags only, in box order, while they fit.

    Returns (ids, region) of equal length: region[k] = j means subword k came from box j and takes box
    j's spatial embedding.
    """
    if use_attr is not None and (attr_ids is None or attr_subwords is None):
        raise ValueError("use_attr needs attr_ids and attr_subwords")
    ids: list[int] = []
    region: list[int] = []
    for j, c in enumerate(obj_ids):
        words = attr_subwords[attr_ids[j]] if use_attr is not None and use_attr[j] else class_subwords[c]
        if not words:
            raise ValueError(f"box {j}: its tag has no subwords")
        if max_tokens is not None and len(ids) + len(words) > max_tokens:
            break
        ids.extend(int(w) for w in words)
        region.extend([j] * len(words))
    return ids, region


def image_tags(obj_ids: Sequence[Sequence[int]], class_subwords: Sequence[Sequence[int]], pad_id: int = 0) -> TagInputs:
    """The tags of a batch of images, unmasked, as fine-tuning and the analyses give them: obj_ids[b] is
    image b's detector class per box, for the boxes the batch holds (`RegionRecord.obj_id[:R_b]`)."""
    return collate_tags([tag_tokens(ids, class_subwords) for ids in obj_ids], pad_id)


def collate_tags(per_image: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int = 0) -> TagInputs:
    """Pad the (ids, region) pairs of `tag_tokens` into a batch; padding points at region 0, masked."""
    B = len(per_image)
    L = max((len(ids) for ids, _ in per_image), default=0)
    tag_ids = torch.full((B, L), pad_id, dtype=torch.long)
    tag_region = torch.zeros(B, L, dtype=torch.long)
    tag_mask = torch.zeros(B, L, dtype=torch.bool)
    for b, (ids, region) in enumerate(per_image):
        n = len(ids)
        tag_ids[b, :n] = torch.tensor(list(ids), dtype=torch.long)
        tag_region[b, :n] = torch.tensor(list(region), dtype=torch.long)
        tag_mask[b, :n] = True
    return TagInputs(tag_ids, tag_region, tag_mask)


# ---------------------------------------------------------------------------------------------------
# Model


@dataclass
class WVisualBertOutput(VLOutput):
    """`VLOutput` plus the final states of the tag subwords."""

    tags: Tensor | None = None  # (B, L, D); None when the model has no tags or was given none
    tag_index: Tensor | None = None  # (L,) positions of the tags in the joint sequence


@dataclass
class WVisualBertPretrainOutput:
    mlm_logits: Tensor  # (B, T, V), or (N, V) at the N text positions asked for
    # (B, 2) in the paired variants, else None; index 1 = the text matches the image (LXMERT's convention:
    # the released code is built on LXMERT's `task_matched`)
    match_logits: Tensor | None
    encoded: WVisualBertOutput
    tag_logits: Tensor | None = None  # (B, L, V), or (M, V) at the M tag positions asked for; same MLM head
    obj_logits: Tensor | None = None  # (B, R, n_obj) detected-object label logits
    attr_logits: Tensor | None = None  # (B, R, n_attr)
    feat_pred: Tensor | None = None  # (B, R, F) regressed region features


class SpatialEmbedding(nn.Module):
    """sp(b) = LN(W_b b): the 4-d box embedding shared by a region and its tags."""

    def __init__(self, cfg: WVisualBertConfig):
        super().__init__()
        self.box_fc = nn.Linear(cfg.visual_pos_dim, cfg.hidden_size)
        self.box_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, boxes: Tensor) -> Tensor:
        return self.box_layer_norm(self.box_fc(boxes))  # (..., D)


class WVisualBertEmbeddings(nn.Module):
    """Text, region and tag embeddings (module docstring). BERT's names for the text tables, so BERT
    checkpoints map onto them by name."""

    def __init__(self, cfg: WVisualBertConfig):
        super().__init__()
        D = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, D, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, D)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, D)
        self.LayerNorm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.visn_fc = nn.Linear(cfg.visual_dim, D)
        self.visn_layer_norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.spatial = SpatialEmbedding(cfg)
        self.tag_layer_norm = nn.LayerNorm(D, eps=cfg.layer_norm_eps) if cfg.use_tags else None
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def text(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)
        e = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(pos)[None]
            + self.token_type_embeddings(token_type_ids)
        )
        return self.LayerNorm(e)  # (B, T, D)

    def forward(self, x: VLInputs, tags: TagInputs | None) -> tuple[Tensor, int, int, int]:
        """Returns the embedded [text ; regions ; tags] (B, T + R + L, D) and T, R, L."""
        text = self.text(x.input_ids, x.token_type_ids)  # (B, T, D)
        sp = self.spatial(x.region_boxes.to(text.dtype))  # (B, R, D)
        regions = self.visn_layer_norm(self.visn_fc(x.region_feats.to(text.dtype))) + sp  # (B, R, D)
        parts = [text, regions]
        L = 0
        if tags is not None and self.tag_layer_norm is not None:
            # Each tag subword takes the spatial embedding of its region: gather sp along R.
            idx = tags.tag_region[..., None].expand(-1, -1, sp.shape[-1])  # (B, L, D)
            tag_sp = sp.gather(1, idx) if sp.shape[1] else sp.new_zeros(idx.shape)
            parts.append(self.tag_layer_norm(self.word_embeddings(tags.tag_ids)) + tag_sp)  # (B, L, D)
            L = tags.tag_ids.shape[1]
        return self.dropout(torch.cat(parts, dim=1)), text.shape[1], regions.shape[1], L


class WVisualBertModel(nn.Module):
    """Embeddings, BERT layers over [text ; regions ; tags], pooler."""

    def __init__(self, cfg: WVisualBertConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = WVisualBertEmbeddings(cfg)
        self.encoder = Encoder(cfg.block, cfg.num_layers)
        self.pooler = Pooler(cfg.hidden_size)

    def forward(
        self, x: VLInputs, tags: TagInputs | None = None, need_attn: bool = False, maps_only: bool = False
    ) -> WVisualBertOutput:
        """x: text (T may be 0) and regions (R may be 0); tags: None, or the tags of x's regions (ignored
        when `cfg.use_tags` is off). With `need_attn`, one (B, H, S, S) joint map per layer; `maps_only`:
        the maps alone, for less work (`VLOutput.maps_only`)."""
        h, maps, (T, R, L) = self.hidden(x, tags, need_attn, maps_only=maps_only)
        dev = x.input_ids.device
        attn = AttentionMaps.of_joint(maps, T, T, R, dev) if need_attn else None  # regions only: tags are not boxes
        if h is None:
            return WVisualBertOutput.maps_only(attn)
        return WVisualBertOutput(
            text=h[:, :T],
            vision=h[:, T : T + R],
            pooled=self.pooler(h[:, 0]),  # [CLS]; the first region in an image-only batch
            attentions=attn,
            tags=h[:, T + R :] if L else None,
            tag_index=torch.arange(T + R, T + R + L, device=dev) if L else None,
        )

    def pooled(self, x: VLInputs, tags: TagInputs | None = None) -> Tensor:
        """`forward(x, tags).pooled` (B, D) alone: the last layer computes [CLS] alone (`Encoder.forward` rows)."""
        h, _, _ = self.hidden(x, tags, rows=first_row(x.input_ids))  # (B, 1, D)
        return self.pooler(h[:, 0])

    def hidden(
        self, x: VLInputs, tags: TagInputs | None = None, need_attn: bool = False, rows: Tensor | None = None,
        maps_only: bool = False,
    ) -> tuple[Tensor | None, list[Tensor], tuple[int, int, int]]:
        """Final hidden states (B, S, D) of [text ; regions ; tags], S = T + R + L, the attention maps if
        asked, and (T, R, L); with `rows` (B, M) only those positions' states, (B, M, D); with `maps_only`
        the maps alone and None (`Encoder.forward`)."""
        h, T, R, L = self.embeddings(x, tags)  # (B, S, D)
        masks = [x.attention_mask.bool(), x.region_mask.bool()]
        if L:
            masks.append(tags.tag_mask.bool())
        complete = x.text_complete and x.regions_complete and not L  # tag subwords: padded to the longest
        bias = key_bias(torch.cat(masks, dim=1), h.dtype, complete)  # (B, 1, 1, S) or None
        h, maps = self.encoder(h, bias, need_weights=need_attn, rows=rows, maps_only=maps_only)
        return h, maps, (T, R, L)


class WVisualBertForPreTraining(nn.Module):
    """W-VisualBERT (or a variant) with its pre-training heads: `cls.predictions` (the shared MLM softmax
    for text and tags, tied to the word table), `obj_predict_head` (LXMERT's visual heads), and
    `cls.seq_relationship` (image-text match) in the paired variants only."""

    def __init__(self, cfg: WVisualBertConfig):
        super().__init__()
        self.cfg = cfg
        self.bert = WVisualBertModel(cfg)
        self.cls = nn.Module()
        self.cls.predictions = MLMHead(cfg.hidden_size, cfg.vocab_size, cfg.hidden_act, cfg.layer_norm_eps)
        self.cls.seq_relationship = nn.Linear(cfg.hidden_size, 2) if cfg.pair_head else None
        sizes = {"obj": cfg.num_object_labels, "attr": cfg.num_attr_labels,
                 "feat": cfg.visual_dim if cfg.feat_regression else 0}
        if any(sizes.values()):
            self.obj_predict_head = nn.Module()
            self.obj_predict_head.transform = PredictionHeadTransform(
                cfg.hidden_size, cfg.hidden_act, cfg.layer_norm_eps
            )
            self.obj_predict_head.decoder_dict = nn.ModuleDict(
                {k: nn.Linear(cfg.hidden_size, n) for k, n in sizes.items() if n}
            )
        else:
            self.obj_predict_head = None
        init_bert_weights(self, cfg.initializer_range)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def encode(
        self, x: VLInputs, need_attn: bool = False, maps_only: bool = False, *, tags: TagInputs | None = None
    ) -> WVisualBertOutput:
        """The encoder alone (no heads): what the analyses read. The other architectures' arguments in their
        order, and the detector tags by name."""
        return self.bert(x, tags, need_attn, maps_only)

    def forward(
        self,
        x: VLInputs,
        need_attn: bool = False,
        mlm_positions: Tensor | TokenSelection | None = None,
        tags: TagInputs | None = None,
        tag_positions: Tensor | None = None,
    ) -> WVisualBertPretrainOutput:
        """mlm_positions (B, T) bool (or its `TokenSelection`) / tag_positions (B, L) bool: run the MLM head
        only there, giving (N, V) logits in row-major order; otherwise (B, T, V) / (B, L, V). The visual
        heads run on every region (LXMERT's losses weight the label terms by detector confidence over all
        boxes)."""
        out = self.bert(x, tags, need_attn)
        text = selected_text(out.text, mlm_positions)
        tag_logits = None
        if out.tags is not None:
            t = out.tags if tag_positions is None else out.tags[tag_positions]
            tag_logits = self.cls.predictions(t)
        vis = {}
        if self.obj_predict_head is not None and out.vision.shape[1]:
            hv = self.obj_predict_head.transform(out.vision)
            vis = {k: dec(hv) for k, dec in self.obj_predict_head.decoder_dict.items()}
        match = self.cls.seq_relationship(out.pooled) if self.cls.seq_relationship is not None else None
        return WVisualBertPretrainOutput(
            mlm_logits=self.cls.predictions(text),
            match_logits=match,
            encoded=out,
            tag_logits=tag_logits,
            obj_logits=vis.get("obj"),
            attr_logits=vis.get("attr"),
            feat_pred=vis.get("feat"),
        )


# ---------------------------------------------------------------------------------------------------
# Named configurations (registered in builders.MODEL_CONFIGS)


def wvisualbert_base(**kw) -> WVisualBertConfig:
    """W-VisualBERT (§3.2, §4.1): BERT-base, 12 layers x 12 heads, 2048-d features, tags, no match head."""
    return dataclasses.replace(WVisualBertConfig(), **kw)


def wvisualbert_tiny(**kw) -> WVisualBertConfig:
    """A 2-layer W-VisualBERT of width 32 for unit tests."""
    base = WVisualBertConfig(
        vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
        max_position_embeddings=64, visual_dim=16, num_object_labels=10, num_attr_labels=6,
    )
    return dataclasses.replace(base, **kw)


def wvisualbert_nt(**kw) -> WVisualBertConfig:
    """W-VisualBERT_NT (§4.4, Table 3): no tags, in pre-training or fine-tuning."""
    return dataclasses.replace(WVisualBertConfig(use_tags=False), **kw)


def wvisualbert_nsp_tiny(**kw) -> WVisualBertConfig:
    """`wvisualbert_tiny` with BERT's next-sentence head (for NSP on text documents, footnote 4)."""
    return wvisualbert_tiny(nsp_head=True, **kw)


def wvisualbert_h_tiny(**kw) -> WVisualBertConfig:
    """A tiny H-VisualBERT (`wvisualbert_h`'s settings at `wvisualbert_tiny`'s size) for unit tests."""
    return wvisualbert_tiny(variant="H", match_head=True, **kw)


def wvisualbert_s(**kw) -> WVisualBertConfig:
    """S-VisualBERT (§3.1, §4.1): W-VisualBERT's architecture pre-trained on *paired* data, with the
    text-image match objective added (hence its head)."""
    return dataclasses.replace(WVisualBertConfig(variant="S", match_head=True), **kw)


def wvisualbert_s_nt(**kw) -> WVisualBertConfig:
    """S-VisualBERT_NT (§4.4, Table 3): S-VisualBERT without tags."""
    return dataclasses.replace(WVisualBertConfig(variant="S", match_head=True, use_tags=False), **kw)


def wvisualbert_h(**kw) -> WVisualBertConfig:
    """H-VisualBERT (§4.3, Table 2): S-VisualBERT's architecture and objectives, pre-trained on paired
    data plus extra unpaired images (image-only batches skip the match loss). Identical to
    `wvisualbert_s` as an architecture; the data mix is a run-config setting."""
    return dataclasses.replace(WVisualBertConfig(variant="H", match_head=True), **kw)


# ---------------------------------------------------------------------------------------------------
# Fine-tuning


class WVisualBertForVQA(nn.Module):
    """W-VisualBERT (and its variants) fine-tuned on VQA the way LXMERT is, not VisualBERT's [MASK] slot:
    the released code (uclanlp/visualbert, `unsupervised_visualbert`) is built on LXMERT's and keeps its
    VQA model, and §4.1 says the fine-tuning follows "the recommended setting in previous works". So the
    question alone, `[CLS] question [SEP]`, BERT's pooler on [CLS], and LXMERT's answer head Linear(D, 2D),
    GeLU, LayerNorm, Linear(2D, A) (`AnswerMLP`), trained with BCE on soft scores (§4.1 VQA).

    Detector tags are part of the input at fine-tuning too (§4.4: tags are used "during both pre-training
    and fine-tuning"), built as in pre-training from the detected objects' class names, but never masked
    and never drawn from attributes (fine-tuning and prediction stay deterministic). The _NT variants
    (`use_tags=False`) read no tags. Class attributes: see `VisualBertForVQA`."""

    text_format: ClassVar[str] = "question"  # [CLS] question [SEP]
    encoder_name: ClassVar[str] = "bert"
    head: ClassVar[str] = "pooled"
    loss: ClassVar[str] = "bce"  # W-VisualBERT `configs/vqa.json`: BCE x answers

    def __init__(self, cfg: WVisualBertConfig, num_answers: int):
        super().__init__()
        self.cfg = cfg
        self.bert = WVisualBertModel(cfg)
        self.classifier = AnswerMLP(cfg.hidden_size, num_answers, cfg.layer_norm_eps)
        init_bert_weights(self, cfg.initializer_range)

    @property
    def reads_tags(self) -> bool:
        return self.cfg.use_tags

    def forward(self, x: VLInputs, tags: TagInputs | None = None) -> Tensor:
        """Answer logits (B, A) from the pooled [CLS] of [question ; regions ; tags]."""
        if self.reads_tags and tags is None:
            raise ValueError("this W-VisualBERT reads detector tags (use_tags), but none were given")
        return self.classifier(self.bert.pooled(x, tags))  # (B, D): [CLS] alone in the last layer

    def answer_logits(self, batch: VQABatch) -> Tensor:
        """Answer logits (B, A) of a `VQABatch` laid out as `text_format`, with its tags."""
        return self(batch.inputs, batch.tags)
