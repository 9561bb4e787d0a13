"""Named model configurations and builders (DESIGN.md habit 3).

`MODEL_CONFIGS` is the one literal dict of names the CLI accepts for `--model`; `ARCHS` maps an
architecture name to its config class and pre-training model class.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from vlberts.config import from_dict
from vlberts.errors import VlbertsError
from vlberts.models.lxmert import LxmertConfig, LxmertForPreTraining
from vlberts.models.vilbert import ViLBertConfig, ViLBertForPreTraining
from vlberts.models.visualbert import VisualBertConfig, VisualBertForPreTraining
from vlberts.models.vlbert import VLBertConfig, VLBertForPreTraining
from vlberts.models.wvisualbert import (
    WVisualBertConfig,
    WVisualBertForPreTraining,
    wvisualbert_base,
    wvisualbert_h,
    wvisualbert_h_tiny,
    wvisualbert_nsp_tiny,
    wvisualbert_nt,
    wvisualbert_s,
    wvisualbert_s_nt,
    wvisualbert_tiny,
)


def visualbert_base(**kw: Any) -> VisualBertConfig:
    """VisualBERT as analysed in the paper: BERT-base, 12 layers x 12 heads, 2048-d detector features."""
    return dataclasses.replace(VisualBertConfig(), **kw)


def visualbert_tiny(**kw: Any) -> VisualBertConfig:
    """A 2-layer VisualBERT for unit tests."""
    base = VisualBertConfig(
        vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
        max_position_embeddings=64, visual_dim=16,
    )
    return dataclasses.replace(base, **kw)


# Feed-forward width of every laptop-scale (`*-small`) configuration: 2x the model width, not BERT's 4x.
# At width 128 the feed-forward is two thirds of a layer's matrix work; halving it made a visualbert-small
# update 1.37x faster on 2 CPU cores (116 ms vs 159 ms for 32 caption pairs), and the demo's grounding
# came out no worse (best head 45.5% at 2,000 updates vs 43.6% with 512; issue-2 note).
SMALL_FFN = 256


def visualbert_small(**kw: Any) -> VisualBertConfig:
    """The laptop-scale VisualBERT of the demo: 6 layers x 8 heads of width 16 (model width 128), with
    6-d box geometry (VisualBERT's Flickr30K setting, the one its grounding analysis was run in).

    Eight narrow heads rather than four wide ones: the same cost, and in the world runs of issue 2 the
    image helped masked-word prediction more (47.5% vs 15.9% with regions zeroed, against 34.7% vs
    16.5% for a 4-head run with a different masking; see the issue note).

    No dropout: the demo sees each caption only a few times, so there is little to regularise, and on
    CPU dropout's random masks cost about a third of the step time (measured: 0.224 s vs 0.151 s per
    32-example step on 2 cores). Feed-forward width `SMALL_FFN`."""
    base = VisualBertConfig(
        hidden_size=128, num_layers=6, num_heads=8, intermediate_size=SMALL_FFN,
        max_position_embeddings=128, visual_spatial="6d", hidden_dropout=0.0, attention_dropout=0.0,
    )
    return dataclasses.replace(base, **kw)


def visualbert_no_early_fusion(**kw: Any) -> VisualBertConfig:
    """VisualBERT w/o Early Fusion (paper App. B and App. C, C2): the image is "not combined with the text in
    the initial Transformer layer but instead at the very end with a new Transformer layer". BERT-base's 12
    layers run on the text alone and a 13th, new layer sees text and regions (the original code's
    `bypass_transformer` + `additional_layer`). Initialised from BERT, layers 0-11 take BERT's weights and
    layer 12 starts random. Pass `num_layers` to change the depth; the fusion layer stays the last one
    unless `fusion_layer` is given too."""
    num_layers = kw.pop("num_layers", 13)
    kw.setdefault("fusion_layer", num_layers - 1)
    return dataclasses.replace(VisualBertConfig(), num_layers=num_layers, **kw)


def lxmert_base(**kw: Any) -> LxmertConfig:
    """LXMERT as in the paper (§3.3): 9 language, 5 object-relationship, 5 cross-modality layers, width 768,
    12 heads, 2048-d RoI features, heads for 1600 objects, 400 attributes and 9500 answers."""
    return dataclasses.replace(LxmertConfig(), **kw)


def lxmert_tiny(**kw: Any) -> LxmertConfig:
    """A 1/1/1-layer LXMERT of width 32 for unit tests."""
    base = LxmertConfig(
        vocab_size=100, hidden_size=32, num_heads=2, intermediate_size=64, language_layers=1, relation_layers=1,
        cross_layers=1, max_position_embeddings=64, visual_dim=16, num_object_labels=10, num_attr_labels=6,
        num_qa_labels=8,
    )
    return dataclasses.replace(base, **kw)


def lxmert_small(**kw: Any) -> LxmertConfig:
    """The laptop-scale LXMERT, in the spirit of `visualbert_small`: width 128, 8 heads, feed-forward `SMALL_FFN`,
    2 language + 2 object-relationship + 2 cross-modality layers (6 in depth, as visualbert-small's 6), the
    paper's own 4-d box input, no dropout. The QA head is left out (`num_qa_labels=0`): the world has no
    joint answer table for pre-training QA. `vlberts pretrain` sizes the object/attribute heads from the store."""
    base = LxmertConfig(
        hidden_size=128, num_heads=8, intermediate_size=SMALL_FFN, language_layers=2, relation_layers=2, cross_layers=2,
        max_position_embeddings=128, num_qa_labels=0, hidden_dropout=0.0, attention_dropout=0.0,
    )
    return dataclasses.replace(base, **kw)


def vilbert_depth(k: int, **kw: Any) -> ViLBertConfig:
    """ViLBERT with k Co-TRM -> TRM blocks (the depth of the paper's Table 2 ablation): k visual layers and
    k co-attention layers, placed before the last k text layers and before every visual layer, the
    layout of the released `bert_base_{k}layer_{k}conect.json` configs (k = 2, 4, 6, 8). Everything else
    is the released base config; the co-attention keeps 8 heads at every depth (the released 2-layer
    config says 1024 heads of width 1, which we take for a typo)."""
    num_layers = kw.get("num_layers", ViLBertConfig.num_layers)
    placed = ViLBertConfig(
        v_num_layers=k, t_biattention_id=tuple(range(num_layers - k, num_layers)), v_biattention_id=tuple(range(k)),
    )
    return dataclasses.replace(placed, **kw)


def vilbert_base(**kw: Any) -> ViLBertConfig:
    """ViLBERT as in the paper (§3.1) and the released `bert_base_6layer_6conect.json`: a BERT-base text
    stream (12 layers, width 768, 12 heads); a visual stream of width 1024, 8 heads, feed-forward 1024,
    6 layers; 6 co-attention layers (width 1024, 8 heads) before text layers 6..11 and visual layers
    0..5; 2048-d region features; 1601 region classes."""
    return vilbert_depth(6, **kw)


def vilbert_depth2(**kw: Any) -> ViLBertConfig:
    """Table 2's 2-layer ViLBERT: co-attention before text layers 10, 11 and visual layers 0, 1."""
    return vilbert_depth(2, **kw)


def vilbert_depth4(**kw: Any) -> ViLBertConfig:
    """Table 2's 4-layer ViLBERT: co-attention before text layers 8..11 and visual layers 0..3."""
    return vilbert_depth(4, **kw)


def vilbert_depth6(**kw: Any) -> ViLBertConfig:
    """Table 2's 6-layer ViLBERT, the paper's full model (= `vilbert_base`)."""
    return vilbert_depth(6, **kw)


def vilbert_depth8(**kw: Any) -> ViLBertConfig:
    """Table 2's 8-layer ViLBERT: co-attention before text layers 4..11 and visual layers 0..7."""
    return vilbert_depth(8, **kw)


def vilbert_single_stream(**kw: Any) -> ViLBertConfig:
    """The paper's Single-Stream baseline (§4): one BERT-base over [text ; [IMG] ; regions], no visual
    layers and no co-attention; the ViLBERT image embedding (5-d locations) at the text width, and
    ViLBERT's heads (see the module docstring of `vilbert.py` for how it is realised)."""
    # The visual stream's sizes follow the text's: the regions run through the text layers.
    text = {k: kw.get(k, getattr(ViLBertConfig, k)) for k in ("hidden_size", "num_heads", "intermediate_size")}
    single = dict(
        single_stream=True, v_hidden_size=text["hidden_size"], v_num_heads=text["num_heads"],
        v_intermediate_size=text["intermediate_size"], v_num_layers=0, t_biattention_id=(), v_biattention_id=(),
    )
    return ViLBertConfig(**{**single, **kw})


def vilbert_small(**kw: Any) -> ViLBertConfig:
    """The laptop-scale ViLBERT, in the spirit of `visualbert_small`: a 6-layer text stream of width 128 with
    8 heads, a 2-layer visual stream (width 128, 8 heads) and 2 co-attention layers (width 128, 8 heads)
    before text layers 4, 5 and visual layers 0, 1 (the released configs' "last k text layers" layout),
    ViLBERT's own 5-d locations and [IMG] element, no dropout. `vlberts pretrain` sizes the region-class
    head from the store's cls_prob."""
    base = ViLBertConfig(
        hidden_size=128, num_heads=8, intermediate_size=SMALL_FFN, num_layers=6, max_position_embeddings=128,
        v_hidden_size=128, v_num_heads=8, v_intermediate_size=SMALL_FFN, v_num_layers=2, bi_hidden_size=128, bi_num_heads=8,
        t_biattention_id=(4, 5), v_biattention_id=(0, 1), hidden_dropout=0.0, attention_dropout=0.0,
        v_hidden_dropout=0.0, v_attention_dropout=0.0,
    )
    return dataclasses.replace(base, **kw)


def vilbert_tiny(**kw: Any) -> ViLBertConfig:
    """A ViLBERT for unit tests: 3 text layers (width 32), 2 visual layers (width 24), 2 co-attention
    layers (width 16) before text layers 1, 2 and visual layers 0, 1; three different widths so that a
    mixed-up projection cannot go unnoticed."""
    base = ViLBertConfig(
        vocab_size=100, hidden_size=32, num_heads=2, intermediate_size=48, num_layers=3, max_position_embeddings=64,
        visual_dim=16, v_hidden_size=24, v_num_heads=2, v_intermediate_size=40, v_num_layers=2,
        bi_hidden_size=16, bi_num_heads=2, t_biattention_id=(1, 2), v_biattention_id=(0, 1), num_region_classes=11,
    )
    return dataclasses.replace(base, **kw)


def vlbert_base(**kw: Any) -> VLBertConfig:
    """VL-BERT-base (paper §4.1): BERT-base (12 layers x 12 heads, width 768), 2048-d RoI appearance features,
    2048-d sin/cos geometry, 1601 detector classes for masked RoI classification, no relationship head.
    The paper's visual network is a ResNet-101 Fast R-CNN tuned with the model; we do not ship it, so this
    config reads precomputed region features (pass `end_to_end=True` with a CNN of your own for the other mode)."""
    return dataclasses.replace(VLBertConfig(), **kw)


def vlbert_small(**kw: Any) -> VLBertConfig:
    """The laptop-scale VL-BERT, in the spirit of `visualbert_small`: 6 layers x 8 heads, width 128,
    feed-forward `SMALL_FFN`, VL-BERT's own sin/cos geometry at 128 dimensions (the paper's 2048 would dwarf a
    128-wide model), precomputed features, no dropout (visual dropout included). `vlberts pretrain` sizes
    the masked RoI classification head from the store's cls_prob."""
    base = VLBertConfig(
        hidden_size=128, num_layers=6, num_heads=8, intermediate_size=SMALL_FFN, max_position_embeddings=128,
        geometry_dim=128, hidden_dropout=0.0, attention_dropout=0.0, visual_dropout=0.0,
    )
    return dataclasses.replace(base, **kw)


def vlbert_tiny(**kw: Any) -> VLBertConfig:
    """A 2-layer VL-BERT on precomputed features for unit tests."""
    base = VLBertConfig(
        vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
        max_position_embeddings=64, visual_dim=16, geometry_dim=32, num_region_classes=11,
    )
    return dataclasses.replace(base, **kw)


def vlbert_match_small(**kw: Any) -> VLBertConfig:
    """`vlbert_small` with the sentence-image relationship head that VL-BERT tried and left out of its recipe
    (§3: "of no help"; Table 4's setting (c) "would hurt accuracy on all the three downstream tasks";
    `with_match_head`): the head the `match` objective (with `--mismatch_replace`) and next-sentence prediction
    on a text corpus (`nsp`) train, for the paper's ablation."""
    return vlbert_small(**{"with_match_head": True, **kw})


def vlbert_match_tiny(**kw: Any) -> VLBertConfig:
    """`vlbert_tiny` with the sentence-image relationship head (`vlbert_match_small`), for unit tests."""
    return vlbert_tiny(**{"with_match_head": True, **kw})


def vlbert_e2e_tiny(**kw: Any) -> VLBertConfig:
    """A 2-layer end-to-end VL-BERT for unit tests: a 2-conv CNN (8, 16 channels, stride 4) + 4x4 RoIAlign
    inside the model, reading `VLInputs.pixels`."""
    return vlbert_tiny(**{"end_to_end": True, "cnn_channels": (8, 16), "roi_size": 4, **kw})


def wvisualbert_small(**kw: Any) -> WVisualBertConfig:
    """The laptop-scale W-VisualBERT, in the spirit of `visualbert_small`: 6 layers x 8 heads, width 128,
    feed-forward `SMALL_FFN`, tags and its own 4-d boxes, no dropout; the W variant (unpaired batches, no match
    head). `vlberts pretrain` sizes the object/attribute heads from the store."""
    base = WVisualBertConfig(
        hidden_size=128, num_layers=6, num_heads=8, intermediate_size=SMALL_FFN, max_position_embeddings=128,
        hidden_dropout=0.0, attention_dropout=0.0,
    )
    return dataclasses.replace(base, **kw)


def wvisualbert_s_small(**kw: Any) -> WVisualBertConfig:
    """`wvisualbert_small` as S-VisualBERT (W-VisualBERT §3.1, §4.1): the same architecture and tags, pre-trained
    on paired captions and images with the text-image match objective added. The W variant's paper does not
    expect a pre-trained W-VisualBERT to ground ("expected to easily acquire grounding through fine-tuning",
    §2); this one shows the architecture with aligned data (`vlberts demo --model=wvisualbert-s-small`)."""
    return wvisualbert_small(**{"variant": "S", "match_head": True, **kw})


MODEL_CONFIGS: dict[str, Callable[..., Any]] = {
    "visualbert-base": visualbert_base,
    "visualbert-small": visualbert_small,
    "visualbert-tiny": visualbert_tiny,
    "visualbert-no-early-fusion": visualbert_no_early_fusion,
    "lxmert-base": lxmert_base,
    "lxmert-small": lxmert_small,
    "lxmert-tiny": lxmert_tiny,
    "vilbert-base": vilbert_base,
    "vilbert-depth2": vilbert_depth2,
    "vilbert-depth4": vilbert_depth4,
    "vilbert-depth6": vilbert_depth6,
    "vilbert-depth8": vilbert_depth8,
    "vilbert-single-stream": vilbert_single_stream,
    "vilbert-small": vilbert_small,
    "vilbert-tiny": vilbert_tiny,
    "vlbert-base": vlbert_base,
    "vlbert-small": vlbert_small,
    "vlbert-tiny": vlbert_tiny,
    "vlbert-match-small": vlbert_match_small,
    "vlbert-match-tiny": vlbert_match_tiny,
    "vlbert-e2e-tiny": vlbert_e2e_tiny,
    "wvisualbert-base": wvisualbert_base,
    "wvisualbert-small": wvisualbert_small,
    "wvisualbert-s-small": wvisualbert_s_small,
    "wvisualbert-tiny": wvisualbert_tiny,
    "wvisualbert-nt": wvisualbert_nt,
    "wvisualbert-s": wvisualbert_s,
    "wvisualbert-s-nt": wvisualbert_s_nt,
    "wvisualbert-h": wvisualbert_h,
    "wvisualbert-h-tiny": wvisualbert_h_tiny,
    "wvisualbert-nsp-tiny": wvisualbert_nsp_tiny,
}

ARCHS: dict[str, tuple[type, Callable[[Any], nn.Module]]] = {
    "visualbert": (VisualBertConfig, VisualBertForPreTraining),
    "lxmert": (LxmertConfig, LxmertForPreTraining),
    "vilbert": (ViLBertConfig, ViLBertForPreTraining),
    "vlbert": (VLBertConfig, VLBertForPreTraining),
    "wvisualbert": (WVisualBertConfig, WVisualBertForPreTraining),
}

CONFIG_ARCH = {
    VisualBertConfig: "visualbert", LxmertConfig: "lxmert", ViLBertConfig: "vilbert", VLBertConfig: "vlbert",
    WVisualBertConfig: "wvisualbert",
}


def model_config(name: str, **kw: Any):
    """The named configuration with overrides (e.g. the vocabulary size and feature width of the data)."""
    if name not in MODEL_CONFIGS:
        raise VlbertsError(f"unknown model {name!r}; valid: {', '.join(MODEL_CONFIGS)}")
    try:
        return MODEL_CONFIGS[name](**kw)
    except (TypeError, ValueError) as e:
        raise VlbertsError(f"model {name!r}: {e}") from None


def arch_of(cfg: Any) -> str:
    return CONFIG_ARCH[type(cfg)]


# Positions of the one table that an architecture gives to elements after the text: VL-BERT's visual elements
# take the text's length n and its [END] n + 1 (vlbert.py, §3.2); the others' tables embed the text alone.
POSITIONS_AFTER_TEXT = {"vlbert": 2}


def max_text_positions(cfg: Any) -> int:
    """The longest text (tokens, [CLS] and [SEP] included) that the config's position table embeds."""
    return cfg.max_position_embeddings - POSITIONS_AFTER_TEXT.get(arch_of(cfg), 0)


def reads_tags(cfg: Any) -> bool:
    """Whether the model's inputs carry detector tags beside the regions (W-VisualBERT §3.2 with tags on;
    not its NT variants): in pre-training, fine-tuning and the analyses alike."""
    return arch_of(cfg) == "wvisualbert" and bool(cfg.use_tags)


def config_from_dict(arch: str, data: dict[str, Any]):
    if arch not in ARCHS:
        raise VlbertsError(f"unknown architecture {arch!r}; valid: {', '.join(ARCHS)}")
    return from_dict(ARCHS[arch][0], data, where=f"{arch} config")


def build_pretraining_model(cfg: Any, *, initialise: bool = True) -> nn.Module:
    """The architecture's encoder with its pre-training heads. `initialise=False` leaves every parameter
    as allocated (uninitialised memory; on the meta device, no values at all): for a model whose every
    parameter is loaded next, strictly, or whose shapes alone are read. A base model's random
    initialisation takes ~2 s on 2 cores, and on the meta device its first run ~1.4 s of importing the
    reference implementations of the init functions."""
    if initialise:
        return ARCHS[arch_of(cfg)][1](cfg)
    with init_skipped():
        return ARCHS[arch_of(cfg)][1](cfg)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


@contextlib.contextmanager
def init_skipped() -> Iterator[None]:
    """`torch.nn.init`'s in-place initialisers as no-ops while modules are built: the modules' own
    `reset_parameters` and `blocks.init_bert_weights` call them through the module, so nothing is drawn.
    For models whose every parameter is loaded next, strictly (uninitialised memory otherwise)."""
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS}

    def keep(tensor, *args, **kwargs):
        return tensor

    try:
        for name in saved:
            setattr(nn.init, name, keep)
        yield
    finally:
        for name, f in saved.items():
            setattr(nn.init, name, f)
