"""Each architecture's pre-training recipe, in one place: which objectives its paper trains, with which
matching-label convention and region masking rule, and the one function that computes their losses.

    arch         paper objectives (default weights)                       text / regions
    visualbert   mlm, match (sentence-image, two captions)  App. A.3      two captions; regions never masked
    vilbert      mlm, region_kl, match (alignment)           §3.1         one caption, p=0.5 another image's;
                                                                           15% regions, 90% zeroed; masked
                                                                           losses only on aligned pairs
    vlbert       mlm, roi_cls                                 §3.2-3.3    one caption, whole words masked;
                                                                           15% RoIs, 90% replaced by the model's
                                                                           mask vector; no matching; soft target
                                                                           (released code) or hard
    lxmert       mlm, feat, obj, attr, match                  §3.1        one caption, p=0.5 another image's;
                                                                           15% regions, 80% zero / 10% other image
    wvisualbert  mlm, tag_mlm, feat, obj, attr (+ match in S/H) §3        tags from the detector's obj_id;
                                                                           W: alternating text-only / image-only
                                                                           batches (unpaired)

Objectives are composable: `parse_objectives("mlm=1,match=0.5", recipe, model_cfg)` gives the weights of a
run; a name the architecture has no head for is a one-line error. LXMERT's image QA (§3.1.3, `qa`) is
trained when the run is given questions (`data.pretrain_qa`: questions as sentences, answers over a joint
answer table), only for the last part of training (§3.3: the last 10 of 20 epochs; `qa_from_step`).
A batch may mix pairs with text-only samples (VL-BERT §3.3, `--text_corpus`) and image-only samples
(H-VisualBERT, `--unpaired_images`): each objective reads the rows of its modality (`pair_rows`,
`image_rows`); `nsp` is next-sentence prediction on text documents through the matching head. The text-only
samples' masked words are a mean of their own, `mlm_text`, added to the captions' `mlm` (VL-BERT's released
`mlm_loss_wvc + mlm_loss_aux`: each stream weighs 1 however many masked words it holds; `text_mlm_apart`).
"""

from __future__ import annotations

import math

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch.nn.functional as F
from torch import Tensor

from vlberts.data.batch import PAIR, TEXT_ONLY, PretrainBatch, TokenSelection, select_tokens
from vlberts.errors import VlbertsError
from vlberts.objectives.matching import Convention, matching_loss, qa_loss
from vlberts.objectives.mlm import masked_positions, mlm_loss
from vlberts.objectives.regions import (
    LXMERT_REGION_MASK,
    VILBERT_REGION_MASK,
    VLBERT_REGION_MASK,
    WVISUALBERT_REGION_MASK,
    RegionMaskRule,
    detected_label_loss,
    feat_regression_loss,
    masked_roi_loss,
    region_kl_loss,
)
from vlberts.objectives.text import IS_NEXT, Source, tag_mlm_loss
from vlberts.text.masking import IGNORE_INDEX

Modality = Literal["text", "image", "pair"]

# Every objective this recipe can train: what it is, and which input it needs. In unpaired training
# (W-VisualBERT) a text-only batch trains the "text" objectives and an image-only batch the "image" ones.
OBJECTIVES: dict[str, tuple[str, Modality]] = {
    "mlm": ("masked language modelling with the image", "text"),
    "match": ("image-text matching (VisualBERT sentence-image, ViLBERT alignment, LXMERT cross-modality)", "pair"),
    "region_kl": ("ViLBERT masked multimodal modelling: KL to the detector's class distribution", "image"),
    "roi_cls": ("VL-BERT masked RoI classification, target = the detector's class", "image"),
    "feat": ("LXMERT RoI-feature regression (SmoothL1, masked regions)", "image"),
    "obj": ("LXMERT detected-object classification (confidence-weighted, all regions)", "image"),
    "attr": ("LXMERT detected-attribute classification (confidence-weighted, all regions)", "image"),
    "tag_mlm": ("W-VisualBERT detector-tag MLM with the shared softmax, tags masked jointly with regions", "image"),
    "qa": ("LXMERT image QA over the joint answer table (needs questions; the last part of training)", "pair"),
    "nsp": ("BERT next-sentence prediction on text documents through the sentence-pair / matching head "
            "(W-VisualBERT footnote 4; needs --text_corpus)", "text"),
    "mlm_text": ("masked language modelling of the text-only samples mixed into the batches (--text_corpus), a mean "
                 "of its own beside the captions' (VL-BERT's released mlm_loss_aux; default: mlm's weight)", "text"),
}

# Store quantities a head's size is taken from (see `ArchRecipe.head_sizes`).
StoreSize = Literal["cls_prob", "classes", "attributes"]


@dataclass(frozen=True)
class ArchRecipe:
    """One architecture's pre-training recipe (module docstring). Data settings are read by
    `data.pretrain.CaptionPretrainData`; the loss settings by `pretrain_losses`."""

    arch: str
    paper: str  # where the recipe comes from
    objectives: Mapping[str, float]  # the paper's objectives and weights: the default of --objectives
    # Objectives whose head exists only when a config field is truthy (field name per objective).
    head_switch: Mapping[str, str] = field(default_factory=dict)
    match_convention: Convention | None = None  # label convention of the (B, 2) matching head
    caption_pairs: bool = False  # VisualBERT's `[CLS] a [SEP] b [SEP]` input; else one caption
    region_rule: RegionMaskRule | None = None  # None: regions are never masked
    zero_in_data: bool = True  # corrupt masked features in the batch; False: the model does (VL-BERT)
    replace_from_other_image: bool = False  # the rule's random replacements come from another image
    # Masked-modelling targets only where the text is the image's (ViLBERT --objective 1); LXMERT's code keeps
    # them on mismatched pairs ("to maximize the GPU utilization", airsplay/lxmert#51), as VisualBERT's does on
    # its second caption. The default of `--mismatched_targets=auto`.
    drop_unmatched: bool = False
    whole_word: bool = False  # MLM selects whole words, all subwords of a word alike (VL-BERT `random_word_wwm`)
    # VL-BERT masked RoI classification target: the released code's soft target (the detector's score vector),
    # or the paper's hard one (its argmax class); `--roi_target` picks (objectives.regions.masked_roi_loss).
    roi_target: Literal["soft", "hard"] = "soft"
    model_inputs: tuple[str, ...] = ()  # extra forward arguments: "roi_masked" (VL-BERT), "tags" (W-VisualBERT)
    head_sizes: Mapping[str, StoreSize] = field(default_factory=dict)  # config field -> store quantity
    # The config value (field, value) that selects unpaired text-only / image-only batches (W-VisualBERT).
    unpaired_when: tuple[str, Any] | None = None
    # Objectives outside the paper recipe whose head every model of the architecture has (VisualBERT's
    # sentence-image head is BERT's NSP head, so `nsp` on text documents uses it).
    optional: tuple[str, ...] = ()
    # This run mixes text-only samples into its caption batches (--text_corpus, not unpaired): `mlm` averages
    # over the caption rows' masked words and `mlm_text` over the text-only rows' (set by the pretrain recipe).
    text_mlm_apart: bool = False

    def available(self, model_cfg: Any) -> tuple[str, ...]:
        """The objectives this model has heads for, in recipe order."""
        names = [*self.objectives, *self.optional, *self.head_switch, "mlm_text"]
        return tuple(dict.fromkeys(n for n in names if getattr(model_cfg, self.head_switch.get(n, ""), True)))

    def unpaired(self, model_cfg: Any) -> bool:
        return self.unpaired_when is not None and getattr(model_cfg, self.unpaired_when[0]) == self.unpaired_when[1]

    def defaults(self, model_cfg: Any) -> dict[str, float]:
        """The paper's objectives that this model has heads for."""
        have = self.available(model_cfg)
        return {k: w for k, w in self.objectives.items() if k in have}


_LXMERT_SIZES: Mapping[str, StoreSize] = {"num_object_labels": "classes", "num_attr_labels": "attributes"}
_LXMERT_HEADS = {"obj": "num_object_labels", "attr": "num_attr_labels", "feat": "feat_regression"}

RECIPES: dict[str, ArchRecipe] = {
    "visualbert": ArchRecipe(
        arch="visualbert", paper="VisualBERT App. A.3", objectives={"mlm": 1.0, "match": 1.0},
        match_convention="visualbert", caption_pairs=True, optional=("nsp",),
    ),
    "vilbert": ArchRecipe(
        arch="vilbert", paper="ViLBERT §3.1", objectives={"mlm": 1.0, "region_kl": 1.0, "match": 1.0},
        match_convention="vilbert", region_rule=VILBERT_REGION_MASK, drop_unmatched=True,
        head_sizes={"num_region_classes": "cls_prob"},
    ),
    "vlbert": ArchRecipe(
        arch="vlbert", paper="VL-BERT §3.2-3.3", objectives={"mlm": 1.0, "roi_cls": 1.0},
        head_switch={"match": "with_match_head", "nsp": "with_match_head"}, match_convention="visualbert", region_rule=VLBERT_REGION_MASK,
        zero_in_data=False, model_inputs=("roi_masked",), head_sizes={"num_region_classes": "cls_prob"},
        whole_word=True,
    ),
    "lxmert": ArchRecipe(
        arch="lxmert", paper="LXMERT §3.1", objectives={"mlm": 1.0, "feat": 1.0, "obj": 1.0, "attr": 1.0, "match": 1.0},
        head_switch={**_LXMERT_HEADS, "qa": "num_qa_labels"}, match_convention="lxmert", region_rule=LXMERT_REGION_MASK,
        replace_from_other_image=True, head_sizes=_LXMERT_SIZES,
    ),
    "wvisualbert": ArchRecipe(
        arch="wvisualbert", paper="W-VisualBERT §3",
        objectives={"mlm": 1.0, "tag_mlm": 1.0, "feat": 1.0, "obj": 1.0, "attr": 1.0, "match": 1.0},
        head_switch={**_LXMERT_HEADS, "tag_mlm": "use_tags", "match": "match_head", "nsp": "pair_head"},
        match_convention="lxmert",
        region_rule=WVISUALBERT_REGION_MASK, replace_from_other_image=True, model_inputs=("tags",),
        head_sizes=_LXMERT_SIZES, unpaired_when=("variant", "W"),
    ),
}


def parse_objectives(spec: str, recipe: ArchRecipe, model_cfg: Any) -> dict[str, float]:
    """Weights of a run from `name=weight,...` (empty: the paper's recipe). An unknown name, or one the
    model has no head for, is a one-line error naming the valid ones."""
    if not spec.strip():
        return recipe.defaults(model_cfg)
    have = recipe.available(model_cfg)
    weights: dict[str, float] = {}
    for item in spec.split(","):
        name, eq, value = item.strip().partition("=")
        if name in weights:
            raise VlbertsError(f"objective {name!r} given twice in --objectives={spec}")
        if name not in OBJECTIVES:
            raise VlbertsError(f"unknown objective {name!r}; valid: {', '.join(OBJECTIVES)}")
        if name not in have:
            raise VlbertsError(f"{recipe.arch} model has no head for objective {name!r}; its objectives: {', '.join(have)}")
        try:
            weights[name] = float(value) if eq else 1.0
        except ValueError:
            raise VlbertsError(f"objective {name}: weight {value!r} is not a number") from None
        if not math.isfinite(weights[name]) or weights[name] < 0:
            raise VlbertsError(f"objective {name}: weight {value!r} must be a finite number >= 0 "
                               "(a negative weight would maximise the loss)")
    if not any(weights.values()):
        raise VlbertsError(f"--objectives={spec}: every weight is 0, so nothing would be trained; give one a weight > 0")
    return weights


def applies(name: str, source: Source | None) -> bool:
    """Whether objective `name` is computed on a batch from `source` (None: paired, every objective)."""
    modality = OBJECTIVES[name][1]
    return source is None or modality == source


def run_model(recipe: ArchRecipe, model: Any, batch: PretrainBatch) -> Any:
    """The pre-training forward pass, with the MLM head only at the masked tokens and the extra inputs
    the architecture reads (VL-BERT's masked RoIs, W-VisualBERT's tags)."""
    extra = {}
    if "roi_masked" in recipe.model_inputs and batch.regions is not None:
        extra["roi_masked"] = batch.regions.corrupted
    if "tags" in recipe.model_inputs and batch.tags is not None:
        extra["tags"] = batch.tags
    return model(batch.inputs, mlm_positions=mlm_tokens(batch), **extra)


def mlm_tokens(batch: PretrainBatch) -> TokenSelection:
    """The masked words of `batch` as index tensors: the ones its collate built on the host (so the step
    reads nothing back from the device), or built here from `mlm_labels` for a batch made without them."""
    return batch.mlm_tokens if batch.mlm_tokens is not None else select_tokens(masked_positions(batch.mlm_labels))


# Rows of a batch that mixes sources (`PretrainBatch.kind`: 0 pair, 1 text-only, 2 image-only). Each
# objective reads only the rows of its modality, so that appending text-only samples to a batch leaves its
# image losses unchanged (VL-BERT §3.3: a <Text, ∅> sample trains MLM only). The MLM, masked-region and tag
# losses need no selection (a text-only row has no region targets, an image-only row no masked word); the
# ones that average over every row or every (row, region) slot do.


def pair_rows(batch: PretrainBatch) -> Tensor | slice:
    """The rows that hold an image with its text (matching, image QA)."""
    kind = getattr(batch, "kind", None)
    return slice(None) if kind is None else kind == PAIR


def image_rows(batch: PretrainBatch) -> Tensor | slice:
    """The rows that hold an image (pairs and image-only samples)."""
    kind = getattr(batch, "kind", None)
    return slice(None) if kind is None else kind != TEXT_ONLY


def nsp_rows(batch: PretrainBatch) -> Tensor:
    """The rows that hold a next-sentence pair."""
    return batch.nsp_labels >= 0 if batch.nsp_labels is not None else batch.matched.new_zeros(batch.matched.shape)


def _mlm(recipe: ArchRecipe, out: Any, batch: PretrainBatch) -> Tensor:
    sel = mlm_tokens(batch)
    labels = batch.mlm_labels[sel.example, sel.position]  # (N,)
    if recipe.text_mlm_apart and batch.kind is not None:
        return _mean_over(out.mlm_logits, labels.masked_fill(batch.kind[sel.example] == TEXT_ONLY, IGNORE_INDEX))
    return mlm_loss(out.mlm_logits, labels)


def _mlm_text(recipe: ArchRecipe, out: Any, batch: PretrainBatch) -> Tensor:
    """The text-only rows' masked words, their own mean (`text_mlm_apart`); 0 in a batch without such rows."""
    sel = mlm_tokens(batch)
    if batch.kind is None:
        return out.mlm_logits.sum() * 0.0
    labels = batch.mlm_labels[sel.example, sel.position]  # (N,)
    return _mean_over(out.mlm_logits, labels.masked_fill(batch.kind[sel.example] != TEXT_ONLY, IGNORE_INDEX))


def _mean_over(logits: Tensor, labels: Tensor) -> Tensor:
    """Cross-entropy averaged over the labels that are set (0, with the graph kept, when none is), with no
    read back from the device (a count of zero is clamped, not tested on the host)."""
    total = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def _mlm_count(batch: PretrainBatch, recipe: ArchRecipe | None, text: bool) -> int:
    """Masked words of the caption rows (`text` False) or of the text-only rows: `mlm`'s and `mlm_text`'s
    denominators when a run keeps them apart, on the host batch."""
    sel = mlm_tokens(batch)
    if recipe is None or not recipe.text_mlm_apart or batch.kind is None:
        return 0 if text else sel.count
    real = batch.mlm_labels[sel.example, sel.position] != IGNORE_INDEX
    return int((real & ((batch.kind[sel.example] == TEXT_ONLY) == text)).sum())


def _match(recipe: ArchRecipe, out: Any, batch: PretrainBatch) -> Tensor:
    rows = pair_rows(batch)
    return matching_loss(out.match_logits, batch.matched, recipe.match_convention,
                         rows=None if isinstance(rows, slice) else rows)


def _nsp(recipe: ArchRecipe, out: Any, batch: PretrainBatch) -> Tensor:
    """Next-sentence prediction through the matching head: IsNext is the head's "matched" class in the
    architecture's convention (VisualBERT's head is BERT's NSP head: 0 = IsNext)."""
    if batch.nsp_labels is None:
        return out.match_logits.sum() * 0.0
    return matching_loss(out.match_logits, batch.nsp_labels == IS_NEXT, recipe.match_convention, rows=nsp_rows(batch))


def _region_kl(recipe: ArchRecipe, out: Any, batch: PretrainBatch) -> Tensor:
    return region_kl_loss(out.region_logits, batch.regions.cls_prob, batch.regions.masked)


def _roi_cls(recipe: ArchRecipe, out: Any, batch: PretrainBatch) -> Tensor:
    return masked_roi_loss(out.region_logits, batch.regions.cls_prob, batch.regions.masked, target=recipe.roi_target)


def _feat(recipe: ArchRecipe, out: Any, batch: PretrainBatch) -> Tensor:
    i = image_rows(batch)
    return feat_regression_loss(out.feat_pred[i], batch.regions.feats[i], batch.regions.masked[i])


def _obj(recipe: ArchRecipe, out: Any, batch: PretrainBatch) -> Tensor:
    r, i = batch.regions, image_rows(batch)
    return detected_label_loss(out.obj_logits[i], r.obj_id[i], r.obj_conf[i], r.masked[i])


def _attr(recipe: ArchRecipe, out: Any, batch: PretrainBatch) -> Tensor:
    r, i = batch.regions, image_rows(batch)
    return detected_label_loss(out.attr_logits[i], r.attr_id[i], r.attr_conf[i], r.masked[i])


def _tag_mlm(recipe: ArchRecipe, out: Any, batch: PretrainBatch) -> Tensor:
    return tag_mlm_loss(out.tag_logits, batch.tag_labels)


def _qa(recipe: ArchRecipe, out: Any, batch: PretrainBatch) -> Tensor:
    return qa_loss(out.qa_logits, batch.qa_targets, batch.qa_targets >= 0, batch.matched)


LOSSES = {
    "mlm": _mlm, "mlm_text": _mlm_text, "match": _match, "region_kl": _region_kl, "roi_cls": _roi_cls, "feat": _feat, "obj": _obj,
    "attr": _attr, "tag_mlm": _tag_mlm, "qa": _qa, "nsp": _nsp,
}


# Each loss is a mean; its denominator in a batch (the number of terms it averages over) lets an update
# split into micro-batches (gradient accumulation) and ranks weigh each part by its share of the update's
# total, so that 1 x 4, 4 x 1 and 2 ranks x 2 make the same update (`training.loop.loss_shares`). The
# LXMERT-style region losses average over every (example, region) slot as the originals do, so theirs is
# B x R (padding included: exact across splits when the parts pad to the same number of regions).
COUNTS = {  # ("mlm" and "mlm_text" in `loss_counts`: they depend on the run's recipe)
    "match": lambda batch: batch.matched[pair_rows(batch)].numel(),
    "region_kl": lambda batch: batch.regions.masked.sum(),
    "roi_cls": lambda batch: batch.regions.masked.sum(),
    "feat": lambda batch: batch.regions.masked[image_rows(batch)].numel(),
    "obj": lambda batch: batch.regions.masked[image_rows(batch)].numel(),
    "attr": lambda batch: batch.regions.masked[image_rows(batch)].numel(),
    "tag_mlm": lambda batch: masked_positions(batch.tag_labels).sum(),
    "qa": lambda batch: ((batch.qa_targets >= 0) & batch.matched).sum(),
    "nsp": lambda batch: nsp_rows(batch).sum(),
}


def loss_counts(batch: PretrainBatch, names: Iterable[str], recipe: ArchRecipe | None = None) -> dict[str, float]:
    """The denominator of each named objective's loss in `batch` (`COUNTS`; the masked words' by `recipe`, as the
    run's: None counts every row's for `mlm`)."""
    return {name: float(_mlm_count(batch, recipe, text=name == "mlm_text") if name in ("mlm", "mlm_text")
                        else COUNTS[name](batch)) for name in names}


def pretrain_losses(
    recipe: ArchRecipe, output: Any, batch: PretrainBatch, weights: Mapping[str, float], source: Source | None = None
) -> dict[str, Tensor]:
    """The unweighted loss of every objective in `weights` that applies to this batch (`applies`), by name.
    Combine them with `total_loss`."""
    return {name: LOSSES[name](recipe, output, batch) for name in weights if applies(name, source)}


def total_loss(losses: Mapping[str, Tensor], weights: Mapping[str, float]) -> Tensor:
    """sum_k weights[k] * losses[k] (every paper adds its losses with weight 1 by default)."""
    return sum(weights[k] * v for k, v in losses.items())
