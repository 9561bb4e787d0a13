"""ViLBERT (Lu, Batra, Parikh & Lee 2019, "ViLBERT: Pretraining Task-Agnostic Visiolinguistic
Representations for Vision-and-Language Tasks").

Implemented, all from the shared exact-BERT blocks (`blocks.py`):
- §2.2 two parallel streams: a text stream that is BERT (embeddings and `num_layers` BERT layers) and a
  visual stream of its own width, heads and feed-forward size (`v_num_layers` Transformer layers).
- §2.2 / Fig. 2b co-attentional Transformer layers (Co-TRM): each stream computes queries, keys and
  values; the keys and values of each stream go to the other stream's attention, so text queries attend
  over regions and region queries attend over words; each direction is followed by a residual add +
  LayerNorm back into its own stream and then that stream's own feed-forward block.
- Fig. 1 placement: co-attention layer k runs just before text layer `t_biattention_id[k]` and visual
  layer `v_biattention_id[k]` (the released code's convention): with the released 6-layer config
  (t = 6..11, v = 0..5) the text runs 6 BERT layers alone, then 6 blocks of Co-TRM -> TRM; the regions go
  straight from the embedding into the first Co-TRM. The depth ablation (Table 2) varies the number of
  these blocks, k = 2, 4, 6, 8 (`builders.vilbert_depth`).
- §2.2 image representations: the region feature and its 5-d location (x1/W, y1/H, x2/W, y2/H, area
  fraction) are each projected to the visual width and summed; as in the released code a LayerNorm
  and dropout follow the sum. The region sequence starts with an [IMG] element (see below).
- §2.2 alignment prediction: h_IMG and h_CLS are pooled (the code's poolers: Linear + ReLU into the
  co-attention width), multiplied element-wise, and a linear layer predicts aligned / not aligned.
- §2.2 masked multi-modal modelling: the MLM head on the text stream (decoder tied to the word
  embeddings) and a masked-region head over the visual stream predicting a distribution over the
  detector's classes (`num_region_classes`, 1601 = VG classes + background in the release). The KL loss
  belongs to the objectives; this module only produces the logits.
- §4 single-stream baseline (`single_stream=True`, `builders.vilbert_single_stream`): see "Single
  stream" below.

The [IMG] element (`add_image_token`, on by default). The paper: "a special IMG token representing the
entire image (i.e. mean-pooled visual features with a spatial encoding corresponding to the entire
image)". The released data loaders prepend it outside the model; here the model prepends it itself, so
callers pass only their regions:
  feature  = mean of `region_feats` over the real regions (`region_mask`), exactly the fine-tuning
             loaders' rule (sum over boxes / number of boxes). The features are taken as given, so a
             region the pre-training masking zeroed counts as a zero vector. (The pre-training loader
             divides the same sum by the number of boxes that do not overlap a masked box with IoU > 0.4,
             a quirk we do not reproduce: `VLInputs` does not carry that overlap flag.)
  location = (0, 0, 1, 1, 1), the 5-d encoding of the whole-image box (0, 0, 1, 1);
  mask     = always attended, so an image without regions still has one visual element.
With `add_image_token=False` nothing is prepended and, like the released code, the vision pooler reads
the first visual element: use this for region sets whose first element already is a whole-image
feature (e.g. features that went through the original loaders). Outputs always index the caller's
regions: `VLOutput.vision` is (B, R, Dv) without [IMG], `VLOutput.image` is h_IMG (B, Dv) (None without
[IMG]), `region_logits` are for the caller's regions, and `AttentionMaps.text_to_region()` drops the
[IMG] column (`vision_offset`).

Where the released code (facebookresearch/vilbert-multi-task, `vilbert/vilbert.py`) fills in what the
paper leaves open, we follow it, so that released checkpoints load and give the same numbers:
- the co-attention runs at its own width and head count (`bi_hidden_size`, `bi_num_heads`: 1024 and 8
  in the release): text queries are projected from 768 to 1024, visual keys/values from 1024 to 1024,
  and the attended result is projected back to each stream's width before the residual add;
- dropout on the attention probabilities of text queries over regions uses the visual rate
  (`v_attention_dropout`), that of region queries over words the text rate;
- the co-attention layer's text feed-forward has the text stream's sizes, its visual one the visual
  stream's (the release's `bi_intermediate_size` is unused there too);
- both poolers are Linear + ReLU (not BERT's tanh) into `bi_hidden_size`, and dropout (p =
  `hidden_dropout`, 0.1 in the release) is applied to the product before the alignment layer;
- the masked-region head is dense -> activation (`hidden_act`, as the code reads it) -> LayerNorm ->
  linear, at the visual width;
- LayerNorm epsilon is 1e-12 everywhere; the word table has `padding_idx=pad_token_id`.
- Alignment label convention as in the code: logit index 0 = aligned, 1 = not aligned.

Single stream (§4 "Single-Stream": "a single BERT architecture that processes both modality inputs
through the same set of transformer blocks"). Realised as a configuration of this class: no visual
layers and no co-attention; the visual width equals the text width; the text embeddings and the same
ViLBERT image embeddings ([IMG] + regions, 5-d locations) are concatenated, text first, and the text
stream's `num_layers` BERT layers run over the whole sequence with one joint attention (as the
released baseline, `vilbert/basebert.py`, concatenates text then image). To keep the comparison
controlled (the paper trains it "identically to our full model"), the heads are ViLBERT's: pooled
h_IMG * h_CLS for alignment, MLM on the text, region classes on the regions. The released baseline
differs in two details we do not copy: it adds a learned token-type embedding to the regions and
predicts alignment from BERT's tanh pooler on [CLS] alone.

Attention maps (`need_attn=True`; B batch, T words, R' = R + 1 visual elements with [IMG], R without):
  text_self       `num_layers` maps (B, H, T, T), text layer order;
  vision_self     `v_num_layers` maps (B, Hv, R', R'), visual layer order;
  text_to_vision  one map per co-attention layer (B, Hbi, T, R'): text queries over regions ([IMG] at 0);
  vision_to_text  one map per co-attention layer (B, Hbi, R', T);
  vision_offset   1 with [IMG], else 0; `text_to_region()` stacks text_to_vision to (K, B, Hbi, T, R).
Single stream: `joint`, `num_layers` maps (B, H, S, S) over S = T + R', text at 0..T-1, [IMG] at T,
regions after it (`region_index` excludes [IMG]).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from vlberts.data.batch import TokenSelection, VLInputs, VQABatch
from vlberts.models.blocks import (
    AddNorm,
    AnswerMLP,
    BertTextConfig,
    BlockConfig,
    Encoder,
    FeedForward,
    MLMHead,
    MultiHeadAttention,
    PredictionHeadTransform,
    init_bert_weights,
    key_bias,
    selected_text,
)
from vlberts.models.outputs import AttentionMaps, ViLBertPretrainOutput, VLOutput
from vlberts.models.spatial import spatial_encoding

# 5-d location of the whole-image box (0, 0, 1, 1): corners and area fraction 1 (§2.2, released loaders).
IMAGE_LOCATION = (0.0, 0.0, 1.0, 1.0, 1.0)


@dataclass(frozen=True)
class ViLBertConfig(BertTextConfig):
    """Architecture only; training switches live in the run config. Defaults are the released
    `bert_base_6layer_6conect.json` (§3.1: BERT-base text stream; visual stream width 1024, 8 heads)."""

    # Text stream: BERT (its other fields are `BertTextConfig`'s).
    num_layers: int = 12
    pad_token_id: int = 0
    # Visual stream.
    visual_dim: int = 2048  # width of the detector's region features (the release's v_feature_size)
    v_hidden_size: int = 1024
    v_num_heads: int = 8
    v_intermediate_size: int = 1024
    v_num_layers: int = 6
    v_hidden_act: str = "gelu"
    v_hidden_dropout: float = 0.1
    v_attention_dropout: float = 0.1
    # Co-attention (the release's "bi-attention"): width, heads, and where the layers sit. Layer k runs
    # just before text layer t_biattention_id[k] and visual layer v_biattention_id[k].
    bi_hidden_size: int = 1024
    bi_num_heads: int = 8
    t_biattention_id: tuple[int, ...] = (6, 7, 8, 9, 10, 11)
    v_biattention_id: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    # Masked-region head: a distribution over the detector's classes (VG 1600 + background).
    num_region_classes: int = 1601
    add_image_token: bool = True  # prepend [IMG] (mean feature, whole-image location); see module docstring
    single_stream: bool = False  # the paper's single-stream baseline (§4); see module docstring

    def __post_init__(self) -> None:
        super().__post_init__()
        for width, heads, what in (
            (self.v_hidden_size, self.v_num_heads, "v_hidden_size / v_num_heads"),
            (self.bi_hidden_size, self.bi_num_heads, "bi_hidden_size / bi_num_heads"),
        ):
            if heads < 1 or width % heads:
                raise ValueError(f"{what}: width {width} is not a multiple of {heads} heads")
        for name in ("num_layers", "v_num_layers", "num_region_classes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        t, v = tuple(self.t_biattention_id), tuple(self.v_biattention_id)
        if len(t) != len(v):
            raise ValueError(f"t_biattention_id {t} and v_biattention_id {v} must have the same length")
        for ids, n, name in ((t, self.num_layers, "t_biattention_id"), (v, self.v_num_layers, "v_biattention_id")):
            if any(b <= a for a, b in zip(ids, ids[1:])):
                raise ValueError(f"{name} {ids} must be strictly increasing")
            if ids and (ids[0] < 0 or ids[-1] >= n):
                raise ValueError(f"{name} {ids} must lie in 0..{n - 1} (a co-attention layer runs before that layer)")
        if self.single_stream:
            if self.v_num_layers or t:
                raise ValueError("single_stream has no visual layers and no co-attention: set v_num_layers=0 "
                                 "and empty t_biattention_id / v_biattention_id")
            if self.v_hidden_size != self.hidden_size:
                raise ValueError("single_stream runs the regions through the text layers: v_hidden_size must "
                                 f"equal hidden_size ({self.hidden_size}), got {self.v_hidden_size}")

    @property
    def v_block(self) -> BlockConfig:
        """The visual stream's layers."""
        return BlockConfig(
            self.v_hidden_size, self.v_num_heads, self.v_intermediate_size, self.v_hidden_act,
            self.v_hidden_dropout, self.v_attention_dropout, self.layer_norm_eps,
        )

    @property
    def num_co_layers(self) -> int:
        """The number of Co-TRM layers (the paper's depth, Table 2)."""
        return len(self.t_biattention_id)

    def describe(self) -> str:
        if self.single_stream:
            return (f"single stream: {self.num_layers} layers x {self.num_heads} heads over text and regions, "
                    f"width {self.hidden_size}, visual_dim {self.visual_dim}")
        return (f"text {self.num_layers} x {self.num_heads} heads (width {self.hidden_size}), vision "
                f"{self.v_num_layers} x {self.v_num_heads} (width {self.v_hidden_size}), {self.num_co_layers} "
                f"co-attention layers, visual_dim {self.visual_dim}")


def image_sequence(x: VLInputs, add_image_token: bool) -> tuple[Tensor, Tensor, Tensor]:
    """The visual stream's input: features (B, R', F), 5-d locations (B, R', 5) and mask (B, R') bool.

    With `add_image_token`, R' = R + 1 and element 0 is [IMG]: the mean feature over the real regions,
    location (0, 0, 1, 1, 1), always attended (module docstring). Locations are
    (x1, y1, x2, y2, (x2 - x1) * (y2 - y1)) of the normalised boxes (§2.2).
    """
    feats, mask = x.region_feats, x.region_mask.bool()  # (B, R, F), (B, R)
    loc = spatial_encoding(x.region_boxes, "5d").to(feats.dtype)  # (B, R, 5)
    if not add_image_token:
        return feats, loc, mask
    B = feats.shape[0]
    w = mask.to(feats.dtype)[..., None]  # (B, R, 1)
    mean = (feats * w).sum(1) / w.sum(1).clamp(min=1)  # (B, F)
    img_loc = loc.new_tensor(IMAGE_LOCATION).expand(B, 1, 5)  # (B, 1, 5)
    feats = torch.cat([mean[:, None], feats], dim=1)  # (B, R + 1, F)
    loc = torch.cat([img_loc, loc], dim=1)  # (B, R + 1, 5)
    mask = torch.cat([mask.new_ones(B, 1), mask], dim=1)  # (B, R + 1)
    return feats, loc, mask


class ViLBertTextEmbeddings(nn.Module):
    """BERT's embeddings (§2.1 "Text Representation"): LayerNorm(word + position + segment), dropout."""

    def __init__(self, cfg: ViLBertConfig):
        super().__init__()
        D = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, D, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, D)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, D)
        self.LayerNorm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        """input_ids, token_type_ids (B, T) -> (B, T, D)."""
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        h = self.word_embeddings(input_ids) + self.position_embeddings(pos)[None]  # (B, T, D)
        h = h + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(h))


class ViLBertImageEmbeddings(nn.Module):
    """§2.2 "Image Representations": project the feature and the 5-d location to the visual width and sum
    them; LayerNorm and dropout follow (released code). Names as the release's `BertImageEmbeddings`."""

    def __init__(self, cfg: ViLBertConfig):
        super().__init__()
        Dv = cfg.v_hidden_size
        self.image_embeddings = nn.Linear(cfg.visual_dim, Dv)
        self.image_location_embeddings = nn.Linear(5, Dv)
        self.LayerNorm = nn.LayerNorm(Dv, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def forward(self, feats: Tensor, loc: Tensor) -> Tensor:
        """feats (B, R', F), loc (B, R', 5) -> (B, R', Dv)."""
        dtype = self.image_embeddings.weight.dtype  # the model's (a float64 array's features, a .half() model)
        feats, loc = feats.to(dtype), loc.to(dtype)
        return self.dropout(self.LayerNorm(self.image_embeddings(feats) + self.image_location_embeddings(loc)))


class CoAttentionBlock(nn.Module):
    """One direction of the co-attention (Fig. 2b): queries from this stream (width `q_dim`), keys and
    values from the other stream (width `kv_dim`), attention at width `bi_hidden`, then BERT's
    residual add + LayerNorm back at `q_dim` (`output`).

    `self` is the shared `MultiHeadAttention` (SDPA or explicit path) with its query projection swapped
    for one that reads `q_dim`: the shared block sizes its query projection by its own width, and
    ViLBERT's queries come from a stream of another width (768 -> 1024 for text queries).
    """

    def __init__(self, q_dim: int, kv_dim: int, bi_hidden: int, bi_heads: int, attn_dropout: float,
                 out_dropout: float, eps: float):
        super().__init__()
        self.self = MultiHeadAttention(bi_hidden, bi_heads, attn_dropout, ctx_dim=kv_dim)
        self.self.query = nn.Linear(q_dim, bi_hidden)
        self.output = AddNorm(bi_hidden, q_dim, out_dropout, eps)

    def forward(
        self, x: Tensor, ctx: Tensor, ctx_bias: Tensor | None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """x (B, Sq, q_dim) queries, ctx (B, Sk, kv_dim), ctx_bias (B, 1, 1, Sk) additive key mask (None: no key
        is padded).

        Returns (B, Sq, q_dim) and, if asked, the probabilities (B, H, Sq, Sk)."""
        h, probs = self.self(x, ctx_bias, ctx, need_weights)  # (B, Sq, bi_hidden)
        return self.output(h, x), probs


class CoAttentionLayer(nn.Module):
    """§2.2 co-attentional Transformer layer (the release's `BertConnectionLayer`).

    `text_attention`: text queries over the regions' keys/values; `vision_attention`: region queries over
    the words' keys/values. Both read this layer's inputs (neither sees the other's result), then each
    stream runs its own feed-forward block (`text_ffn`, `vision_ffn`)."""

    def __init__(self, cfg: ViLBertConfig):
        super().__init__()
        D, Dv, Db, eps = cfg.hidden_size, cfg.v_hidden_size, cfg.bi_hidden_size, cfg.layer_norm_eps
        H = cfg.bi_num_heads
        self.text_attention = CoAttentionBlock(D, Dv, Db, H, cfg.v_attention_dropout, cfg.hidden_dropout, eps)
        self.vision_attention = CoAttentionBlock(Dv, D, Db, H, cfg.attention_dropout, cfg.v_hidden_dropout, eps)
        self.text_ffn = FeedForward(cfg.block)
        self.vision_ffn = FeedForward(cfg.v_block)

    def forward(
        self, text: Tensor, text_bias: Tensor | None, vision: Tensor, vision_bias: Tensor | None, need_weights: bool = False
    ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """text (B, T, D), vision (B, R', Dv); biases (B, 1, 1, T) and (B, 1, 1, R') additive key masks.

        Returns text (B, T, D), vision (B, R', Dv) and, if asked, the text->vision (B, H, T, R') and
        vision->text (B, H, R', T) attention probabilities."""
        t_hat, t2v = self.text_attention(text, vision, vision_bias, need_weights)  # (B, T, D)
        v_hat, v2t = self.vision_attention(vision, text, text_bias, need_weights)  # (B, R', Dv)
        return self.text_ffn(t_hat), self.vision_ffn(v_hat), t2v, v2t


class ViLBertPooler(nn.Module):
    """The released poolers (`BertTextPooler`, `BertImagePooler`): ReLU(W h_first + b) into the
    co-attention width, so h_CLS and h_IMG can be multiplied element-wise (§2.2)."""

    def __init__(self, in_size: int, out_size: int):
        super().__init__()
        self.dense = nn.Linear(in_size, out_size)

    def forward(self, first: Tensor) -> Tensor:
        return torch.relu(self.dense(first))


class ViLBertModel(nn.Module):
    """The ViLBERT encoder: two embeddings, two streams with co-attention layers, two poolers.

    Parameter names: `embeddings` (text, BERT's), `v_embeddings`, `encoder.layer.N` (the text stream,
    BERT's names, so BERT checkpoints load as they are), `v_encoder.layer.N` (visual stream),
    `c_layers.N` (co-attention), `t_pooler`, `v_pooler`.
    """

    def __init__(self, cfg: ViLBertConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = ViLBertTextEmbeddings(cfg)
        self.v_embeddings = ViLBertImageEmbeddings(cfg)
        self.encoder = Encoder(cfg.block, cfg.num_layers)
        self.v_encoder = Encoder(cfg.v_block, cfg.v_num_layers)
        self.c_layers = nn.ModuleList([CoAttentionLayer(cfg) for _ in range(cfg.num_co_layers)])
        self.t_pooler = ViLBertPooler(cfg.hidden_size, cfg.bi_hidden_size)
        self.v_pooler = ViLBertPooler(cfg.v_hidden_size, cfg.bi_hidden_size)

    def pooled(self, x: VLInputs) -> Tensor:
        """`forward(x).pooled` (B, Db): pool(h_CLS) * pool(h_IMG) reads the last co-attention layer of both
        streams, so the whole model runs (the call every encoder model answers; `VLEncoder.pooled`)."""
        return self(x).pooled

    def forward(self, x: VLInputs, need_attn: bool = False) -> VLOutput:
        """Encode a batch; `x.region_type_ids` and `x.image_text_alignment` are VisualBERT inputs, unused.

        Returns text (B, T, D), vision (B, R, Dv) at the caller's regions, image h_IMG (B, Dv) (None
        without [IMG]), pooled (B, Db) = pool(h_CLS) * pool(h_IMG), and with `need_attn` the maps listed
        in the module docstring."""
        feats, loc, vmask = image_sequence(x, self.cfg.add_image_token)  # (B, R', F), (B, R', 5), (B, R')
        text = self.embeddings(x.input_ids, x.token_type_ids)  # (B, T, D)
        vision = self.v_embeddings(feats, loc)  # (B, R', Dv)
        tmask = x.attention_mask.bool()  # (B, T)
        # Additive key masks, None for a stream with no padded key ([IMG] is always real).
        if self.cfg.single_stream:
            bias = key_bias(torch.cat([tmask, vmask], dim=1), text.dtype, x.text_complete and x.regions_complete)
            text, vision, attn = self._joint(text, vision, bias, need_attn)  # bias (B, 1, 1, T + R')
        else:
            t_bias = key_bias(tmask, text.dtype, x.text_complete)  # (B, 1, 1, T)
            v_bias = key_bias(vmask, vision.dtype, x.regions_complete)  # (B, 1, 1, R')
            text, vision, attn = self._streams(text, t_bias, vision, v_bias, need_attn)
        off = int(self.cfg.add_image_token)
        # §2.2: h_IMG and h_CLS are the holistic representations; the released poolers read element 0
        # of each stream ([CLS]; [IMG], or the caller's first region without it).
        pooled = self.t_pooler(text[:, 0]) * self.v_pooler(vision[:, 0])  # (B, Db)
        return VLOutput(
            text=text, vision=vision[:, off:], pooled=pooled, attentions=attn,
            image=vision[:, 0] if off else None,
        )

    def _streams(
        self, text: Tensor, t_bias: Tensor | None, vision: Tensor, v_bias: Tensor | None, need_attn: bool
    ) -> tuple[Tensor, Tensor, AttentionMaps | None]:
        """Fig. 1: the text and visual layers up to each co-attention layer, the co-attention layer, and
        after the last one the remaining layers of each stream."""
        t_layers, v_layers = self.encoder.layer, self.v_encoder.layer
        text_self, vision_self, t2v, v2t = [], [], [], []
        ti = vi = 0
        ends = zip(self.cfg.t_biattention_id, self.cfg.v_biattention_id)
        # One pass per co-attention layer, then a last pass (co=None) for each stream's remaining layers.
        for co, (t_end, v_end) in zip([*self.c_layers, None], [*ends, (len(t_layers), len(v_layers))]):
            for layer in t_layers[ti:t_end]:
                text, p = layer(text, t_bias, need_attn)
                text_self.append(p)
            for layer in v_layers[vi:v_end]:
                vision, p = layer(vision, v_bias, need_attn)
                vision_self.append(p)
            ti, vi = t_end, v_end
            if co is not None:
                text, vision, a, b = co(text, t_bias, vision, v_bias, need_attn)
                t2v.append(a)
                v2t.append(b)
        attn = None
        if need_attn:
            attn = AttentionMaps(
                text_self=text_self, vision_self=vision_self, text_to_vision=t2v, vision_to_text=v2t,
                source="text_to_vision", vision_offset=int(self.cfg.add_image_token),
            )
        return text, vision, attn

    def _joint(
        self, text: Tensor, vision: Tensor, bias: Tensor | None, need_attn: bool
    ) -> tuple[Tensor, Tensor, AttentionMaps | None]:
        """§4 single-stream baseline: the text layers over [text ; [IMG] ; regions] with joint attention."""
        T, S = text.shape[1], text.shape[1] + vision.shape[1]
        h = torch.cat([text, vision], dim=1)  # (B, S, D), S = T + R'
        h, maps = self.encoder(h, bias, need_weights=need_attn)
        off = int(self.cfg.add_image_token)
        attn = AttentionMaps.of_joint(maps, T, T + off, S - T - off, h.device) if need_attn else None
        return h[:, :T], h[:, T:], attn


class RegionClassHead(nn.Module):
    """§2.2 masked-region head (the release's `BertImagePredictionHead`): transform, then a linear layer
    to the detector's classes; its logits are compared with the detector's distribution (KL)."""

    def __init__(self, cfg: ViLBertConfig):
        super().__init__()
        self.transform = PredictionHeadTransform(cfg.v_hidden_size, cfg.hidden_act, cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.v_hidden_size, cfg.num_region_classes)

    def forward(self, vision: Tensor) -> Tensor:
        """vision (B, R, Dv) -> class logits (B, R, C)."""
        return self.decoder(self.transform(vision))


class ViLBertForPreTraining(nn.Module):
    """ViLBERT with its pre-training heads (§2.2), named as the release's `BertForMultiModalPreTraining`
    where it makes sense: `cls.predictions` (MLM, decoder tied to the word embeddings),
    `cls.bi_seq_relationship` (alignment from pool(h_IMG) * pool(h_CLS)), `cls.region_predictions`
    (masked-region classes; the release's `cls.imagePredictions`)."""

    def __init__(self, cfg: ViLBertConfig):
        super().__init__()
        self.cfg = cfg
        self.bert = ViLBertModel(cfg)
        self.cls = nn.Module()
        self.cls.predictions = MLMHead(cfg.hidden_size, cfg.vocab_size, cfg.hidden_act, cfg.layer_norm_eps)
        self.cls.bi_seq_relationship = nn.Linear(cfg.bi_hidden_size, 2)
        self.cls.region_predictions = RegionClassHead(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)  # on the product, before the alignment layer (code)
        init_bert_weights(self, cfg.initializer_range)
        self.tie_weights()

    def tie_weights(self) -> None:
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def encode(self, x: VLInputs, need_attn: bool = False, maps_only: bool = False) -> VLOutput:
        """The encoder alone (no heads): what the analyses read. `maps_only` is accepted for one call
        across the architectures; a two-stream model computes every state anyway (`VLOutput`)."""
        return self.bert(x, need_attn)

    def forward(
        self, x: VLInputs, need_attn: bool = False, mlm_positions: Tensor | TokenSelection | None = None
    ) -> ViLBertPretrainOutput:
        """All heads. With `mlm_positions` (B, T) bool (or its `TokenSelection`), the MLM head runs only
        there: logits (N, V) for the N selected tokens in row-major order; otherwise (B, T, V). Region
        logits are (B, R, C) for the caller's regions."""
        out = self.bert(x, need_attn)
        text = selected_text(out.text, mlm_positions)
        return ViLBertPretrainOutput(
            mlm_logits=self.cls.predictions(text),
            match_logits=self.cls.bi_seq_relationship(self.dropout(out.pooled)),  # (B, 2), 0 = aligned
            encoded=out,
            region_logits=self.cls.region_predictions(out.vision),
        )


class ViLBertForVQA(nn.Module):
    """ViLBERT fine-tuned on VQA (§3.2 "a two layer MLP on top of the element-wise product of the image and
    text representations h_IMG and h_CLS"): the question alone, `[CLS] question [SEP]`; the encoder's pooled
    output is pool(h_CLS) * pool(h_IMG) (B, Db) (the released poolers, §2.2), dropout on the product as the
    release does, then the release's two-layer `SimpleClassifier` (vilbert-multi-task): Linear(Db, 2Db),
    GeLU, LayerNorm, Linear(2Db, A) (`AnswerMLP`). Without [IMG] (`add_image_token=False`) the vision
    pooler reads the caller's first region, as the released code does. Class attributes: see
    `VisualBertForVQA`."""

    text_format: ClassVar[str] = "question"  # [CLS] question [SEP]
    encoder_name: ClassVar[str] = "bert"
    head: ClassVar[str] = "img_cls_product"
    loss: ClassVar[str] = "bce"  # ViLBERT `task_utils.py`: BCE x answers
    reads_tags: ClassVar[bool] = False

    def __init__(self, cfg: ViLBertConfig, num_answers: int):
        super().__init__()
        self.cfg = cfg
        self.bert = ViLBertModel(cfg)
        self.dropout = nn.Dropout(cfg.hidden_dropout)
        self.classifier = AnswerMLP(cfg.bi_hidden_size, num_answers, cfg.layer_norm_eps)
        init_bert_weights(self, cfg.initializer_range)

    def forward(self, x: VLInputs) -> Tensor:
        """Answer logits (B, A) from pool(h_CLS) * pool(h_IMG)."""
        product = self.bert.pooled(x)  # (B, Db)
        return self.classifier(self.dropout(product))

    def answer_logits(self, batch: VQABatch) -> Tensor:
        """Answer logits (B, A) of a `VQABatch` laid out as `text_format`."""
        return self(batch.inputs)
