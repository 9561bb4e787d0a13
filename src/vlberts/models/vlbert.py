"""VL-BERT (Su et al., ICLR 2020, "VL-BERT: Pre-training of Generic Visual-Linguistic Representations").

One Transformer over one sequence (§3.2, Fig. 1):

    [CLS] text [SEP]  [IMG]_whole  [IMG]_1 ... [IMG]_R  [END]
    segment  A/B      C            C ...                C       (ids 0/1, 2, 2, 2; type_vocab_size 3)
    position 0..n-1   n            n ...                n + 1   (n = the sample's real text length)

Every element's embedding is token + visual feature + segment + sequence position (§3.2), then BERT's
embedding LayerNorm and dropout:
- token: WordPiece for words; one learned [IMG] embedding for every visual element (a learned object-[MASK]
  embedding for a masked RoI); a learned [END] embedding.
- visual feature embedding = ReLU(FC(concat(appearance, geometry))) (§3.2 "the output of a fully connected
  layer taking the concatenation of visual appearance feature and visual geometry embedding"). Appearance is
  the RoI's detector feature (2048-d in the paper); geometry is the box embedded with sin/cos at different
  wavelengths (2048-d; `geometry_embedding`). Visual elements get their own RoI's; text elements get the
  whole-image RoI's (§3.2 "for the non-visual elements ... features extracted on the whole input image").
  Text and visual elements each pass their visual feature embedding through their own LayerNorm; the text one
  starts with weight 0, so an initialisation from BERT starts as BERT on the text (released code:
  `visual_ln_text`, `visual_scale_text_init=0`). The visual elements' LayerNorm starts at weight 0 as well,
  as the released pre-training configs set it (`visual_scale_object_init: 0.0`; the class default of their
  code is 1): a visual element starts as its [IMG] token, segment and position, and its features enter as
  the weight grows. Until 2026-12-01 ours started at 1 (docs/architecture-demos.md has the demo at both).
- text-only samples (§3.3, the BooksCorpus/Wikipedia stream, input "<Text, ∅>"): "the visual feature
  embedding term is a learnable embedding shared for all words"; such a sample has no visual elements, so its
  whole-image element is masked out too (a sample with no real region is treated as text-only).

The whole image is one extra visual element (released code `ADD_IMAGE_AS_A_BOX`, box [0, 0, 1, 1]); with
precomputed features its appearance is the mean of the sample's real, unmasked region features (released code),
in end-to-end mode it is RoIAlign over the whole image.

Masked RoI classification (§3.3 Task #2): a masked RoI's [IMG] token becomes the object-[MASK] embedding and its
appearance a learned vector (zero-initialised, released code `object_mask_visual_embedding`). In end-to-end mode
the pixels inside every masked RoI are also set to zero before the CNN ("to avoid any visual clue leakage from
the visual feature embedding of other elements"): the whole-image element and overlapping RoIs then cannot see
the masked object either.

End-to-end mode (`end_to_end=True`): a CNN backbone + RoIAlign + FC head inside the model turns pixels
(`VLInputs.pixels`) and the boxes into appearance features, trained with the rest (paper: Fast R-CNN on
ResNet-101; here a small CNN, `VisualBackbone`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlberts.data.batch import TokenSelection, VLInputs, VQABatch
from vlberts.models.blocks import (
    BertTextConfig,
    Encoder,
    MLMHead,
    Pooler,
    PredictionHeadTransform,
    activation,
    first_row,
    init_bert_weights,
    key_bias,
    selected_text,
)
from vlberts.errors import VlbertsError
from vlberts.models.outputs import AttentionMaps, VLBertPretrainOutput, VLOutput

# Released code `coordinate_embeddings`: normalised coordinates are scaled by 100 and divided by
# wavelengths 1000 ** (k / K), k = 0..K-1 (the Relation Networks recipe the paper cites).
GEOMETRY_SCALE = 100.0
GEOMETRY_WAVE = 1000.0


ANSWER_CLASSIFIERS = ("2fc", "1fc", "mlm")  # `VLBertConfig.answer_classifier`, `VLBertForVQA`


@dataclass(frozen=True)
class VLBertConfig(BertTextConfig):
    """Architecture only; training switches live in the run config.

    The paper's visual network is a Fast R-CNN on ResNet-101 (§4.1), fine-tuned with the model. We do not ship
    it: `vlbert_base` reads precomputed 2048-d region features, and `end_to_end=True` builds the small CNN of
    `VisualBackbone` (`cnn_channels`, `roi_size`), whose weights the user trains or loads.
    """

    type_vocab_size: int = 3  # A, B for the sentences, C for the image (§3.2); BERT's is 2
    num_layers: int = 12
    pad_token_id: int = 0
    visual_dim: int = 2048  # appearance feature width (precomputed, or the CNN head's output)
    geometry_dim: int = 2048  # sin/cos geometry embedding width (§3.2 "2048-d in paper"); a multiple of 8
    # Which 4 numbers of the box are embedded. The paper's text says (x1/W, y1/H, x2/W, y2/H); the released
    # code embeds (xc/W, yc/H, w/W, h/H). We follow the code, which produced the paper's numbers.
    geometry_box: Literal["cxcywh", "xyxy"] = "cxcywh"
    visual_dropout: float = 0.1  # before the visual feature FC (released code: Dropout(0.1) -> Linear -> ReLU)
    visual_scale_text_init: float = 0.0  # initial weight of the text elements' visual LayerNorm
    visual_scale_object_init: float = 0.0  # initial weight of the visual elements' visual LayerNorm (release)
    num_region_classes: int = 1601  # masked RoI classification: detector classes incl. background
    # Sentence-image relationship head. Off: the paper (§4.3, Table 4) found the task harmful and the
    # released pre-training configs set WITH_REL_LOSS false.
    with_match_head: bool = False
    end_to_end: bool = False  # CNN + RoIAlign inside the model, reading VLInputs.pixels
    cnn_channels: tuple[int, ...] = (32, 64)  # end-to-end only: conv widths; the first two convs have stride 2
    roi_size: int = 7  # end-to-end only: RoIAlign output grid
    # The answer classifier of VQA / GQA fine-tuning on the [MASK] slot, the released module's CLASSIFIER_TYPE
    # (`VLBertForVQA`): "2fc", "1fc" or "mlm" (the released base VQA config's).
    answer_classifier: Literal["2fc", "1fc", "mlm"] = "2fc"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.answer_classifier not in ANSWER_CLASSIFIERS:
            raise ValueError(f"answer_classifier must be one of {', '.join(ANSWER_CLASSIFIERS)}, got {self.answer_classifier!r}")
        if self.geometry_dim <= 0 or self.geometry_dim % 8:
            raise ValueError(f"geometry_dim must be a positive multiple of 8 (sin and cos of 4 numbers), got {self.geometry_dim}")
        if self.geometry_box not in ("cxcywh", "xyxy"):
            raise ValueError(f"geometry_box must be 'cxcywh' or 'xyxy', got {self.geometry_box!r}")
        if self.type_vocab_size < 3:
            raise ValueError(f"type_vocab_size must be >= 3 (segments A, B, C), got {self.type_vocab_size}")
        if self.end_to_end and not self.cnn_channels:
            raise ValueError("end_to_end needs at least one CNN layer in cnn_channels")

    def describe(self) -> str:
        vis = (f"end-to-end CNN {'-'.join(map(str, self.cnn_channels))} + RoIAlign {self.roi_size}x{self.roi_size}"
               if self.end_to_end else f"visual_dim {self.visual_dim}")
        return (f"{self.num_layers} layers x {self.num_heads} heads, width {self.hidden_size}, {vis}, "
                f"{self.geometry_dim}-d sin/cos geometry")


def geometry_embedding(boxes: Tensor, dim: int = 2048, box: str = "cxcywh") -> Tensor:
    """boxes (..., 4) normalised xyxy -> (..., dim) sin/cos embedding (paper §3.2, Relation Networks).

    The 4 numbers p (centre and size, or the corners) are scaled by 100; with K = dim / 8 wavelengths
    w_k = 1000 ** (k / K), the embedding is, per number, [sin(p / w_0..K-1), cos(p / w_0..K-1)], and the
    four numbers' blocks follow one another (released code's layout: (4, 2K) flattened).
    """
    x1, y1, x2, y2 = boxes.unbind(-1)
    if box == "cxcywh":
        p = torch.stack([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1], dim=-1)
    elif box == "xyxy":
        p = boxes
    else:
        raise ValueError(f"unknown geometry box format {box!r}; valid: cxcywh, xyxy")
    K = dim // 8
    wave = GEOMETRY_WAVE ** (torch.arange(K, device=boxes.device, dtype=boxes.dtype) / K)  # (K,)
    angle = (p * GEOMETRY_SCALE)[..., None] / wave  # (..., 4, K)
    return torch.cat([angle.sin(), angle.cos()], dim=-1).flatten(-2)  # (..., 4 * 2K)


def zero_pixels_in_boxes(pixels: Tensor, boxes: Tensor, masked: Tensor) -> Tensor:
    """Pixel masking for masked RoI classification in end-to-end mode (paper §3.3, Task #2).

    pixels (B, C, H, W); boxes (B, R, 4) normalised xyxy; masked (B, R) bool. Returns a copy of `pixels`
    with every pixel that a masked box touches set to zero: pixel column j (covering [j, j + 1) in pixel
    units) is inside when j + 1 > x1 * W and j < x2 * W, i.e. j in [floor(x1 W), ceil(x2 W)), and rows the
    same. "Touches" rather than "centre inside" so that no sliver of the object survives the mask.
    """
    B, _, H, W = pixels.shape
    cols = torch.arange(W, device=pixels.device, dtype=boxes.dtype)  # (W,)
    rows = torch.arange(H, device=pixels.device, dtype=boxes.dtype)  # (H,)
    x1, y1, x2, y2 = (boxes * boxes.new_tensor([W, H, W, H])).unbind(-1)  # (B, R) each, in pixels
    in_x = (cols + 1 > x1[..., None]) & (cols < x2[..., None])  # (B, R, W)
    in_y = (rows + 1 > y1[..., None]) & (rows < y2[..., None])  # (B, R, H)
    inside = in_y[..., :, None] & in_x[..., None, :] & masked.bool()[..., None, None]  # (B, R, H, W)
    return pixels.masked_fill(inside.any(1)[:, None], 0.0)  # (B, C, H, W)


class VisualBackbone(nn.Module):
    """End-to-end visual network: a small CNN over the pixels, RoIAlign per box, an FC head to `visual_dim`
    (the Fast R-CNN detection branch's role in the paper, at toy size).

    Pixels are read as given (normalised by the data pipeline), so zeroed pixels are zeros at the CNN input.
    """

    def __init__(self, cfg: VLBertConfig):
        super().__init__()
        layers: list[nn.Module] = []
        c_in = 3
        for i, c in enumerate(cfg.cnn_channels):
            layers += [nn.Conv2d(c_in, c, 3, stride=2 if i < 2 else 1, padding=1), nn.ReLU()]
            c_in = c
        self.backbone = nn.Sequential(*layers)
        self.stride = 2 ** min(2, len(cfg.cnn_channels))
        self.roi_size = cfg.roi_size
        self.fc = nn.Linear(c_in * cfg.roi_size**2, cfg.visual_dim)

    def forward(self, pixels: Tensor, boxes: Tensor) -> Tensor:
        """pixels (B, 3, H, W); boxes (B, K, 4) normalised xyxy -> appearance features (B, K, visual_dim)."""
        B, _, H, W = pixels.shape
        K = boxes.shape[1]
        fmap = self.backbone(pixels)  # (B, C, H/s, W/s)
        xyxy = boxes * boxes.new_tensor([W, H, W, H])  # (B, K, 4) in pixels
        batch = torch.arange(B, device=boxes.device, dtype=boxes.dtype).repeat_interleave(K)  # (B*K,)
        rois = torch.cat([batch[:, None], xyxy.reshape(B * K, 4)], dim=1)  # (B*K, 5)
        from torchvision.ops import roi_align  # here: importing torchvision.ops takes 1.5 s, and only this model uses it

        pooled = roi_align(fmap, rois, self.roi_size, spatial_scale=1.0 / self.stride, sampling_ratio=2, aligned=True)
        return F.relu(self.fc(pooled.flatten(1))).view(B, K, -1)  # (B, K, visual_dim)


def text_visual_index(alignment: Tensor, T: int) -> Tensor:
    """alignment (B, R, K) word positions naming region k, -1 padding -> (B, T) long: the visual element each
    word's visual feature embedding comes from, 0 the whole image and k + 1 region k. VL-BERT's released VCR
    code does this (`text_tags` into `_collect_obj_reps`, the whole image being its box 0); §3.2 gives every
    word the whole image's. No value is read back from the device: padding entries scatter into a spare
    column T, dropped after; a word named by two regions takes the later one."""
    B, R, K = alignment.shape
    valid = alignment >= 0  # (B, R, K)
    positions = torch.where(valid, alignment, T).view(B, R * K)  # (B, RK), padding -> column T
    element = torch.arange(1, R + 1, device=alignment.device).repeat_interleave(K).expand(B, -1)  # (B, RK)
    index = torch.zeros(B, T + 1, dtype=torch.long, device=alignment.device)
    index.scatter_reduce_(1, positions, element * valid.view(B, R * K), reduce="amax")
    return index[:, :T]


class VLBertEmbeddings(nn.Module):
    """Token + visual feature + segment + position embeddings of `[CLS] text [SEP] [IMG]_whole regions [END]`."""

    def __init__(self, cfg: VLBertConfig):
        super().__init__()
        D = cfg.hidden_size
        self.cfg = cfg
        self.word_embeddings = nn.Embedding(cfg.vocab_size, D, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, D)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, D)
        self.img_embedding = nn.Embedding(1, D)  # the [IMG] token of every visual element
        self.object_mask_word_embedding = nn.Embedding(1, D)  # token of a masked RoI
        self.end_embedding = nn.Embedding(1, D)  # [END]
        self.text_only_visual_embedding = nn.Embedding(1, D)  # §3.3: shared visual term of text-only samples
        # Appearance of a masked RoI (precomputed features); zero-initialised as in the released code.
        self.object_mask_visual_embedding = nn.Parameter(torch.zeros(cfg.visual_dim))
        self.visual_dropout = nn.Dropout(cfg.visual_dropout)
        self.visual_fc = nn.Linear(cfg.visual_dim + cfg.geometry_dim, D)  # FC(concat(appearance, geometry))
        self.visual_ln_text = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.visual_ln_object = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.LayerNorm = nn.LayerNorm(D, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout)

    def visual_feature(self, appearance: Tensor, boxes: Tensor) -> Tensor:
        """appearance (B, K, F), boxes (B, K, 4) normalised xyxy -> visual feature embedding (B, K, D)."""
        appearance = appearance.to(self.visual_fc.weight.dtype)  # the model's (float64 arrays, a .half() model)
        geo = geometry_embedding(boxes, self.cfg.geometry_dim, self.cfg.geometry_box).to(appearance.dtype)
        return F.relu(self.visual_fc(self.visual_dropout(torch.cat([appearance, geo], dim=-1))))

    def forward(
        self, x: VLInputs, feats: Tensor, roi_masked: Tensor, image_feat: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """feats (B, R, F) region appearance; roi_masked (B, R) bool; image_feat (B, F) whole-image appearance,
        or None to average the real unmasked regions'. Returns embeddings (B, S, D) and the key mask (B, S),
        S = T + 1 + R + 1."""
        B, T = x.input_ids.shape
        R = feats.shape[1]
        dev = x.input_ids.device
        rmask = x.region_mask.bool()  # (B, R)
        has_image = rmask.any(1)  # (B,) a sample without a real region is a text-only sample
        if image_feat is None:
            keep = (rmask & ~roi_masked).to(feats.dtype)[..., None]  # (B, R, 1)
            image_feat = (feats * keep).sum(1) / keep.sum(1).clamp(min=1)  # (B, F)
        appearance = torch.where(roi_masked[..., None], self.object_mask_visual_embedding.to(feats.dtype), feats)
        appearance = torch.cat([image_feat[:, None], appearance], dim=1)  # (B, 1 + R, F)
        whole = x.region_boxes.new_tensor([0.0, 0.0, 1.0, 1.0]).expand(B, 1, 4)
        boxes = torch.cat([whole, x.region_boxes], dim=1)  # (B, 1 + R, 4)
        vis = self.visual_feature(appearance, boxes)  # (B, 1 + R, D)

        # Text elements: the whole image's visual feature, or the learned one for text-only samples; with
        # `x.image_text_alignment` (VCR), a word naming region k takes region k's (`text_visual_index`).
        if x.image_text_alignment is None:
            text_vis = vis[:, :1]  # (B, 1, D), every word alike
        else:
            index = text_visual_index(x.image_text_alignment, T)  # (B, T): 0 the whole image, k + 1 region k
            text_vis = vis.gather(1, index[..., None].expand(-1, -1, vis.shape[-1]))  # (B, T, D)
        text_vis = torch.where(has_image[:, None, None], text_vis, self.text_only_visual_embedding.weight)
        text = self.word_embeddings(x.input_ids) + self.visual_ln_text(text_vis)  # (B, T, D)

        img_tok = self.img_embedding.weight.expand(B, 1 + R, -1)  # (B, 1 + R, D)
        masked_tok = torch.cat([roi_masked.new_zeros(B, 1), roi_masked], dim=1)[..., None]  # whole image never masked
        tok = torch.where(masked_tok, self.object_mask_word_embedding.weight, img_tok)
        objects = tok + self.visual_ln_object(vis)  # (B, 1 + R, D)
        end = self.end_embedding.weight.expand(B, 1, -1)  # (B, 1, D)
        h = torch.cat([text, objects, end], dim=1)  # (B, S, D)

        # Segments: text as given (A/B), every visual element and [END] C (= 2).
        seg = torch.cat([x.token_type_ids, x.token_type_ids.new_full((B, R + 2), 2)], dim=1)  # (B, S)
        # Positions: text 0..T-1; every visual element the sample's text length n (§3.2: all the same); [END] n + 1.
        n = x.attention_mask.long().sum(1, keepdim=True)  # (B, 1)
        pos = torch.cat([torch.arange(T, device=dev).expand(B, T), n.expand(B, R + 1), n + 1], dim=1)  # (B, S)
        h = h + self.token_type_embeddings(seg) + self.position_embeddings(pos)
        mask = torch.cat([x.attention_mask.bool(), has_image[:, None], rmask, rmask.new_ones(B, 1)], dim=1)  # (B, S)
        return self.dropout(self.LayerNorm(h)), mask


class VLBertModel(nn.Module):
    """The VL-BERT encoder: (optional CNN), embeddings, BERT layers, pooler."""

    def __init__(self, cfg: VLBertConfig):
        super().__init__()
        self.cfg = cfg
        self.visual = VisualBackbone(cfg) if cfg.end_to_end else None
        self.embeddings = VLBertEmbeddings(cfg)
        self.encoder = Encoder(cfg.block, cfg.num_layers)
        self.pooler = Pooler(cfg.hidden_size)

    def forward(
        self, x: VLInputs, need_attn: bool = False, roi_masked: Tensor | None = None, maps_only: bool = False
    ) -> VLOutput:
        """roi_masked (B, R) bool: RoIs masked for masked RoI classification (None = none). `maps_only`
        (with `need_attn`): the maps alone, for less work (`VLOutput.maps_only`).

        `vision` holds the caller's R regions, `image` the whole-image element. With `need_attn`,
        `attentions.joint` holds one (B, H, S, S) map per layer over S = T + 1 + R + 1 elements: text at
        0..T-1, the whole image at T, regions at T+1..T+R, [END] at T+R+1. `text_to_region()` reads the
        region columns T+1..T+R only, so its column r is the caller's region r (not the whole image, not [END]).
        """
        T, R = x.input_ids.shape[1], x.region_boxes.shape[1]
        h, maps = self.hidden(x, need_attn, roi_masked, maps_only=maps_only)
        attn = AttentionMaps.of_joint(maps, T, T + 1, R, x.input_ids.device) if need_attn else None
        if h is None:
            return VLOutput.maps_only(attn)
        return VLOutput(text=h[:, :T], vision=h[:, T + 1 : T + 1 + R], pooled=self.pooler(h[:, 0]),
                        attentions=attn, image=h[:, T])

    def pooled(self, x: VLInputs) -> Tensor:
        """`forward(x).pooled` (B, D) alone: the last layer computes [CLS] alone (`Encoder.forward` rows)."""
        h, _ = self.hidden(x, rows=first_row(x.input_ids))  # (B, 1, D)
        return self.pooler(h[:, 0])

    def hidden(
        self, x: VLInputs, need_attn: bool = False, roi_masked: Tensor | None = None, rows: Tensor | None = None,
        maps_only: bool = False,
    ) -> tuple[Tensor | None, list[Tensor]]:
        """Final hidden states (B, S, D) over the layout of `forward`, and the attention maps if asked;
        with `rows` (B, M) only those positions' states, (B, M, D); with `maps_only` the maps alone and
        None (`Encoder.forward`)."""
        B, R = x.input_ids.shape[0], x.region_boxes.shape[1]
        masked = torch.zeros(B, R, dtype=torch.bool, device=x.region_boxes.device)
        if roi_masked is not None:
            masked = roi_masked.bool() & x.region_mask.bool()
        image_feat = None
        if self.visual is not None:
            if x.pixels is None:
                raise ValueError("an end-to-end VL-BERT reads VLInputs.pixels, which is None")
            pixels = zero_pixels_in_boxes(x.pixels, x.region_boxes, masked) if masked.any() else x.pixels
            whole = x.region_boxes.new_tensor([0.0, 0.0, 1.0, 1.0]).expand(B, 1, 4)
            app = self.visual(pixels, torch.cat([whole, x.region_boxes], dim=1))  # (B, 1 + R, F)
            image_feat, feats = app[:, 0], app[:, 1:]
        else:
            feats = x.region_feats
        h, mask = self.embeddings(x, feats, masked, image_feat)  # (B, S, D), (B, S)
        # Complete when text and regions are: the whole image and [END] are real wherever a region is.
        complete = x.text_complete and x.regions_complete and R > 0
        return self.encoder(h, key_bias(mask, h.dtype, complete), need_weights=need_attn, rows=rows,
                            maps_only=maps_only)


class RoIClassificationHead(nn.Module):
    """Masked RoI classification (§3.3 Task #2): dense -> activation -> linear over the detector's classes
    (released code: dense, GeLU, Linear(768 -> 1601))."""

    def __init__(self, hidden_size: int, num_classes: int, act: str):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.act = activation(act)
        self.decoder = nn.Linear(hidden_size, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.decoder(self.act(self.dense(x)))


ROI_TRANSFORM = "region_head.dense"  # the pre-training model's RoI-classification transform (released: mvrc_head.transform)


def start_from_roi_transform(dense: nn.Linear, sd: Mapping[str, Tensor]) -> bool:
    """Copy a VL-BERT pre-training state dict's RoI-classification transform (`ROI_TRANSFORM`) into a task
    head's first layer, as the release's task configs start theirs (`PARTIAL_PRETRAIN_PREFIX_CHANGES`
    `mvrc_head.transform->final_mlp.0` for RefCOCO+, `->cnn_loss_reg.0` for VCR); whether it did (weights
    of another model or width hold nothing to give)."""
    w, b = sd.get(f"{ROI_TRANSFORM}.weight"), sd.get(f"{ROI_TRANSFORM}.bias")
    if w is None or b is None or w.shape != dense.weight.shape:
        return False
    with torch.no_grad():
        dense.weight.copy_(w)
        dense.bias.copy_(b)
    return True


class VLBertForPreTraining(nn.Module):
    """VL-BERT with its pre-training heads: MLM with visual clues (tied to the word embeddings), masked RoI
    classification with linguistic clues, and, only if `with_match_head`, sentence-image relationship."""

    def __init__(self, cfg: VLBertConfig):
        super().__init__()
        self.cfg = cfg
        self.bert = VLBertModel(cfg)
        self.cls = nn.Module()
        self.cls.predictions = MLMHead(cfg.hidden_size, cfg.vocab_size, cfg.hidden_act, cfg.layer_norm_eps)
        self.cls.seq_relationship = nn.Linear(cfg.hidden_size, 2) if cfg.with_match_head else None
        self.region_head = RoIClassificationHead(cfg.hidden_size, cfg.num_region_classes, cfg.hidden_act)
        init_bert_weights(self, cfg.initializer_range)
        emb = self.bert.embeddings
        with torch.no_grad():
            emb.visual_ln_text.weight.fill_(cfg.visual_scale_text_init)
            emb.visual_ln_object.weight.fill_(cfg.visual_scale_object_init)
        if self.bert.visual is not None:
            # Convs keep PyTorch's default (Kaiming-uniform) init: N(0, 0.02) would starve a ReLU CNN.
            for m in self.bert.visual.backbone:
                if isinstance(m, nn.Conv2d):
                    m.reset_parameters()
            nn.init.kaiming_uniform_(self.bert.visual.fc.weight, a=math.sqrt(5))
        self.tie_weights()

    def tie_weights(self) -> None:
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def encode(
        self, x: VLInputs, need_attn: bool = False, roi_masked: Tensor | None = None, maps_only: bool = False
    ) -> VLOutput:
        """The encoder alone (no heads): what the analyses read."""
        return self.bert(x, need_attn, roi_masked, maps_only)

    def forward(
        self, x: VLInputs, need_attn: bool = False, mlm_positions: Tensor | TokenSelection | None = None,
        roi_masked: Tensor | None = None,
    ) -> VLBertPretrainOutput:
        """With `mlm_positions` (B, T) bool (or its `TokenSelection`), the MLM head runs only there: logits
        (N, V) in row-major order; otherwise (B, T, V). `roi_masked` (B, R) bool marks the RoIs masked for
        Task #2; `region_logits` (B, R, C) cover every region (the loss reads the masked ones)."""
        out = self.bert(x, need_attn, roi_masked)
        text = selected_text(out.text, mlm_positions)
        head = self.cls.seq_relationship
        return VLBertPretrainOutput(
            mlm_logits=self.cls.predictions(text),
            match_logits=head(out.pooled) if head is not None else None,
            encoded=out,
            region_logits=self.region_head(out.vision),
        )


def require_region_features(cfg: Any, task: str) -> None:
    """Fine-tuning reads stored region features: an end-to-end VL-BERT (its CNN and RoIAlign in the model, fed
    image pixels) is refused up front, naming the task, for every task model and the analyses alike."""
    if getattr(cfg, "end_to_end", False):
        raise VlbertsError(f"{task} reads stored region features; an end-to-end VL-BERT (end_to_end=true) needs "
                           "image pixels, which this task does not load: use a model on precomputed region features")


# The width of the "2fc" answer MLP. Not the release's: its `CLASSIFIER_HIDDEN_SIZE` defaults to 1,024
# (`vqa/function/config.py`), which no released config changes, and its base VQA config uses "mlm", which has
# no hidden layer. Kept at 2,048 so that the VQA numbers recorded with it hold (docs/reproducing-vlbert.md).
VQA_CLASSIFIER_HIDDEN = 2048


class VLBertForVQA(nn.Module):
    """VL-BERT fine-tuned on VQA (§4.2.2, Fig. 2b): the input is <Question, Answer, Image> with the answer
    section a single [MASK], `[CLS] question [SEP] [MASK] [SEP]` (the answer section is segment B, as the
    released `prepare_text_from_qa` lays it out), and "the answer prediction is made from a multi-class
    classifier based upon the output feature of the [MASK] element". The released module
    (`vqa/modules/resnet_vlbert_for_vqa.py`) has three, `cfg.answer_classifier`:

      2fc  dropout, Linear(D, 2048), ReLU, dropout, Linear(2048, A) (BERT's initialisation here; the release:
           1,024 wide, Xavier-uniform, `VQA_CLASSIFIER_HIDDEN`)
      1fc  dropout, Linear(D, A)
      mlm  BERT's MLM transform (dense, GeLU, LayerNorm), dropout, Linear(D, A): the released base VQA
           config's (`cfgs/vqa/base_4x16G_fp32.yaml`), whose transform starts from the pre-trained MLM head's
           (`init_answer_transform`)

    and, as released, the 1fc and mlm linear layers start Xavier-uniform with zero biases; with the released
    `CLASSIFIER_PRETRAINED` their rows then start from the answers' word embeddings (`init_answer_rows`).
    Class attributes: see `VisualBertForVQA`."""

    text_format: ClassVar[str] = "answer_segment"  # [CLS] question [SEP] [MASK] [SEP]
    encoder_name: ClassVar[str] = "bert"
    head: ClassVar[str] = "answer_slot"
    loss: ClassVar[str] = "bce"  # VL-BERT: BCE x answers
    reads_tags: ClassVar[bool] = False

    def __init__(self, cfg: VLBertConfig, num_answers: int):
        super().__init__()
        require_region_features(cfg, "VQA fine-tuning")
        self.cfg = cfg
        self.bert = VLBertModel(cfg)
        D, H, p = cfg.hidden_size, VQA_CLASSIFIER_HIDDEN, cfg.hidden_dropout
        layers: dict[str, list[nn.Module]] = {
            "2fc": [nn.Dropout(p), nn.Linear(D, H), nn.ReLU(), nn.Dropout(p), nn.Linear(H, num_answers)],
            "1fc": [nn.Dropout(p), nn.Linear(D, num_answers)],
            "mlm": [PredictionHeadTransform(D, cfg.hidden_act, cfg.layer_norm_eps), nn.Dropout(p), nn.Linear(D, num_answers)],
        }
        self.classifier = nn.Sequential(*layers[cfg.answer_classifier])
        init_bert_weights(self, cfg.initializer_range)
        if cfg.answer_classifier != "2fc":  # the released `init_weight` of `final_mlp`
            last = self.classifier[-1]
            nn.init.xavier_uniform_(last.weight)
            nn.init.zeros_(last.bias)

    def init_answer_transform(self, sd: Mapping[str, Tensor]) -> bool:
        """With the "mlm" classifier: its transform from a pre-training state dict's MLM head
        (`cls.predictions.transform.*`, the released `PARTIAL_PRETRAIN_PREFIX_CHANGES`
        `vlbert.mlm_head.predictions.transform->final_mlp.0`). Returns whether it was copied."""
        prefix = "cls.predictions.transform."
        if self.cfg.answer_classifier != "mlm" or not any(k.startswith(prefix) for k in sd):
            return False
        self.classifier[0].load_state_dict({k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)})
        return True

    def init_answer_rows(self, answer_subwords: Sequence[Sequence[int]]) -> int:
        """The released `CLASSIFIER_PRETRAINED` (`vqa/function/train.py`, on in the base VQA config): the output
        row of answer a starts as the mean of the word embeddings of a's subwords (its bias stays 0), so the
        classifier starts where the MLM decoder would score the answer's words. An answer with no subwords
        ("" for answers that normalise to nothing) keeps its Xavier row. Needs a classifier whose output
        layer reads D-wide states (1fc, mlm); returns the number of rows set."""
        out = self.classifier[-1]
        if out.in_features != self.cfg.hidden_size or len(answer_subwords) != out.out_features:
            raise ValueError(f"answer rows from word embeddings need a {self.cfg.hidden_size}-wide output layer (1fc, mlm) "
                             f"and one subword list per answer; this classifier is {self.cfg.answer_classifier} with "
                             f"{out.out_features} answers, given {len(answer_subwords)}")
        table = self.bert.embeddings.word_embeddings.weight  # (V, D)
        rows = [(a, list(ids)) for a, ids in enumerate(answer_subwords) if len(ids)]
        with torch.no_grad():
            for a, ids in rows:
                out.weight[a] = table[ids].mean(0)
        return len(rows)

    def forward(self, x: VLInputs, answer_pos: Tensor) -> Tensor:
        """answer_pos (B,) index of the [MASK] answer slot in the text; returns answer logits (B, A). The
        head reads that slot alone, so the last layer computes it alone (`Encoder.forward` rows)."""
        slot, _ = self.bert.hidden(x, rows=answer_pos[:, None])  # (B, 1, D)
        return self.classifier(slot[:, 0])

    def answer_logits(self, batch: VQABatch) -> Tensor:
        """Answer logits (B, A) of a `VQABatch` laid out as `text_format`."""
        return self(batch.inputs, batch.answer_pos)
