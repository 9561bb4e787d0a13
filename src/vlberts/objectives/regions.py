"""Region-side pre-training objectives: region masking and the masked-region losses of ViLBERT (§3.1),
VL-BERT (§3.2 Task #2), LXMERT (§3.1.2) and W-VisualBERT (§3, detector tags).

Masking is per image, in numpy, driven by an explicit Generator (like `text.masking.mask_tokens`), so a
data pipeline can derive the randomness from (seed, epoch, index). Losses are plain functions of
tensors. Letters: B batch, R regions, C detector classes, K label classes, F feature width, L tag subwords.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from vlberts.text.masking import IGNORE_INDEX


# --------------------------------------------------------------------------------------------------
# Region masking


@dataclass(frozen=True)
class RegionMaskRule:
    """How regions are masked: each region is selected with `prob`; a selected region is zeroed with
    probability `zero`, replaced by another region's feature with `random`, and kept otherwise."""

    prob: float = 0.15
    zero: float = 0.9
    random: float = 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.prob <= 1.0 and self.zero >= 0.0 and self.random >= 0.0 and self.zero + self.random <= 1.0):
            raise ValueError(f"invalid region mask rule {self}")


# Reference §3.1 masking table (original code, which agrees with each paper here):
# ViLBERT §3.1 / concept_cap_dataset.py: 15%, 90% zeroed, 10% unchanged, no random replacement.
VILBERT_REGION_MASK = RegionMaskRule(prob=0.15, zero=0.9, random=0.0)
# LXMERT §3.1.2 says "masking RoI features with zeros" at 0.15; lxmert_pretrain.py does 80% zero,
# 10% a feature from another image, 10% unchanged (the BERT recipe applied to regions).
LXMERT_REGION_MASK = RegionMaskRule(prob=0.15, zero=0.8, random=0.1)
# VL-BERT §3.2 Task #2: "each RoI is randomly masked out (with 15% probability)"; conceptual_captions.py
# masks 90% (feature -> learned mask vector, done by the model from `corrupted`) and keeps 10%.
VLBERT_REGION_MASK = RegionMaskRule(prob=0.15, zero=0.9, random=0.0)
# W-VisualBERT (lxmert_data.py): the LXMERT rule, its code drawing the random feature from another example of
# the same batch (`inbatch_random`). Ours comes from a random other image of the whole set, as LXMERT's
# (`ArchRecipe.replace_from_other_image`): the same distribution of replacements, drawn where the example is
# built rather than when the batch is collated.
WVISUALBERT_REGION_MASK = LXMERT_REGION_MASK


class MaskedRegions(NamedTuple):
    feats: np.ndarray  # (R, F) input features after corruption
    mask: np.ndarray  # (R,) bool, selected regions: the targets of the masked-region losses
    corrupted: np.ndarray  # (R,) bool, selected regions whose input was zeroed (not kept or replaced)


def select_regions(n: int, rng: np.random.Generator, prob: float = 0.15, valid: np.ndarray | None = None) -> np.ndarray:
    """(n,) bool: each region selected independently with `prob`; padding (`valid` False) never is."""
    sel = rng.random(n) < prob
    return sel if valid is None else sel & np.asarray(valid, dtype=bool)


def corrupt_regions(
    feats: np.ndarray,
    selected: np.ndarray,
    rng: np.random.Generator,
    *,
    zero: float = 0.9,
    random: float = 0.0,
    pool: np.ndarray | None = None,
) -> MaskedRegions:
    """Corrupt the `selected` rows of `feats` (R, F): zero (< zero), replace by a row of `pool` (P, F)
    (< zero + random), keep otherwise. One action draw and one pool index per region are always taken,
    so the random stream does not depend on which regions were selected.

    `pool` is where replacement features come from: LXMERT and W-VisualBERT draw from another image (LXMERT's
    `random_feat`; W-VisualBERT's code from another example of the batch); without one, another region of this
    image is used.
    """
    feats = np.asarray(feats)
    selected = np.asarray(selected, dtype=bool)
    n = len(feats)
    action = rng.random(n)
    if pool is None:
        # Another region of the same image: shift by 1..n-1 so a region never replaces itself.
        src = feats
        pick = (np.arange(n) + 1 + rng.integers(0, max(n - 1, 1), size=n)) % max(n, 1)
    else:
        src = np.asarray(pool)
        pick = rng.integers(0, max(len(src), 1), size=n)
    out = feats.copy()
    zeroed = selected & (action < zero)
    out[zeroed] = 0.0
    swap = selected & (action >= zero) & (action < zero + random)
    if swap.any():
        out[swap] = src[pick[swap]]
    return MaskedRegions(out, selected.copy(), zeroed)


def mask_regions(
    feats: np.ndarray,
    rng: np.random.Generator,
    rule: RegionMaskRule = VILBERT_REGION_MASK,
    *,
    valid: np.ndarray | None = None,
    pool: np.ndarray | None = None,
) -> MaskedRegions:
    """Select and corrupt regions of one image, feats (R, F), by `rule` (see the presets above)."""
    sel = select_regions(len(feats), rng, rule.prob, valid)
    return corrupt_regions(feats, sel, rng, zero=rule.zero, random=rule.random, pool=pool)


# --------------------------------------------------------------------------------------------------
# ViLBERT masked multimodal modelling (§3.1)


def region_kl_loss(logits: Tensor, target_probs: Tensor, mask: Tensor) -> Tensor:
    """KL(detector || model) on the masked regions, summed over classes and averaged over masked regions.

    logits (B, R, C) region class logits, target_probs (B, R, C) the detector's class distribution,
    mask (B, R) bool. ViLBERT §3.1: "minimize the KL divergence between these two distributions".
    The original (`visual_target=0`) keeps all 1601 columns, background included (it drops the [IMG]
    *position*, not a class; our `region_logits` already exclude [IMG]), and divides the summed KL by the
    number of masked regions with no guard; here a batch with none gives a zero that keeps the graph.
    Every region's KL is computed and the masked ones are averaged (`masked_mean`), so that nothing is
    read back from the device.
    """
    logp = F.log_softmax(logits.float(), dim=-1)  # (B, R, C)
    t = target_probs.float()  # (B, R, C)
    kl = (torch.xlogy(t, t) - t * logp).sum(-1)  # (B, R), 0 log 0 = 0
    return masked_mean(kl, mask)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """values and mask (bool) of one shape, e.g. (B, R) or (B,) -> the mean of the masked values; 0 (with
    the graph kept) when none is masked. Computed on every entry and selected with `where`: a boolean index (`values[mask]`) or a
    test like `mask.any()` would make the host wait for the device."""
    return torch.where(mask, values, 0.0).sum() / mask.sum().clamp_min(1)


# --------------------------------------------------------------------------------------------------
# VL-BERT masked RoI classification (§3.2 Task #2)


def masked_roi_loss(
    logits: Tensor, cls_prob: Tensor, mask: Tensor, target: Literal["soft", "hard"] = "soft"
) -> Tensor:
    """Masked RoI classification on the masked regions, averaged over them.

    logits (B, R, C), cls_prob (B, R, C) the detector's scores (1601 columns incl. background), mask (B, R).
    The paper (§3.2) sets "the category label predicted by pre-trained Faster R-CNN" as ground truth
    (`target="hard"`: cross-entropy against argmax of `cls_prob`); the released code uses the detector's
    whole score vector as a soft target (`soft_cross_entropy`, `target="soft"`, the default).
    """
    if target not in ("soft", "hard"):
        raise ValueError(f"target must be 'soft' or 'hard', got {target!r}")
    logp = F.log_softmax(logits.float(), dim=-1)  # (B, R, C)
    probs = cls_prob.float()  # (B, R, C)
    if target == "hard":
        per_region = -logp.gather(-1, probs.argmax(-1, keepdim=True)).squeeze(-1)  # (B, R)
    else:
        per_region = -(probs * logp).sum(-1)  # (B, R)
    return masked_mean(per_region, mask)


# --------------------------------------------------------------------------------------------------
# LXMERT masked object prediction (§3.1.2)

# lxmert_pretrain.py VisualConfig: every visual loss is multiplied by 1 / obj_mask_rate, so that the mean
# over all B x R regions (of which ~15% carry a loss) has the scale of a mean over the masked ones.
LXMERT_VISUAL_WEIGHT = 1 / 0.15


def feat_regression_loss(
    pred: Tensor,
    target: Tensor,
    mask: Tensor,
    kind: Literal["smooth_l1", "l2"] = "smooth_l1",
    weight: float = LXMERT_VISUAL_WEIGHT,
) -> Tensor:
    """RoI-feature regression on the masked regions.

    pred, target (B, R, F), mask (B, R). The paper (§3.1.2) says L2; the released code (visual loss
    'feat', named 'l2') uses SmoothL1, so `kind="smooth_l1"` is the default and `"l2"` (squared error)
    the paper's. Reduction as the original: mean over F, times the mask, mean over all B x R, times `weight`.
    """
    if kind == "smooth_l1":
        per = F.smooth_l1_loss(pred.float(), target.float(), reduction="none")
    elif kind == "l2":
        per = (pred.float() - target.float()) ** 2
    else:
        raise ValueError(f"kind must be 'smooth_l1' or 'l2', got {kind!r}")
    return (per.mean(-1) * mask.float()).mean() * weight  # (B, R) -> ()


def detected_label_loss(
    logits: Tensor,
    labels: Tensor,
    conf: Tensor,
    mask: Tensor | None = None,
    over: Literal["all", "masked"] = "all",
    weight: float = LXMERT_VISUAL_WEIGHT,
) -> Tensor:
    """Detected-label classification (objects or attributes): cross-entropy against the detector's label.

    logits (B, R, K), labels (B, R) the detector's argmax class (LXMERT: 0-based, background excluded),
    conf (B, R) its confidence, mask (B, R). The paper (§3.1.2) classifies "the labels of masked objects";
    the released code weights each region's CE by the detector confidence over *all* regions, masked or
    not (`over="all"`, the default; lxmert issues #41, #90). `over="masked"` weights by conf x mask.
    Reduction as the original: mean over all B x R, times `weight`.
    """
    # Padded regions may carry IGNORE_INDEX labels: their CE is 0 (LXMERT itself never pads: 36 boxes).
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none",
                         ignore_index=IGNORE_INDEX).view(labels.shape)  # (B, R)
    w = conf.float()
    if over == "masked":
        if mask is None:
            raise ValueError("over='masked' needs the region mask")
        w = w * mask.float()
    elif over != "all":
        raise ValueError(f"over must be 'all' or 'masked', got {over!r}")
    return (ce * w).mean() * weight


# --------------------------------------------------------------------------------------------------
# W-VisualBERT: detector tags masked jointly with their regions (§3; reference §3.6)


def mask_tags_jointly(
    tag_ids: np.ndarray,
    tag_region: np.ndarray,
    region_mask: np.ndarray,
    rng: np.random.Generator,
    *,
    mask_id: int,
    vocab_size: int,
    tag_prob: float = 0.15,
    joint_prob: float = 0.9,
    tag_to_region: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask detector-tag subwords, each tag jointly with its region.

    tag_ids (L,) the tag subwords, tag_region (L,) the region each subword tags (one tag per region, so
    this also names the tag), region_mask (R,) bool the regions already selected for masking.
    A tag is selected if `rand < tag_prob` or (its region is masked and `rand < joint_prob`), as
    tag_data_utilis.py (0.15 / 0.9); a selected tag has all its subwords -> [MASK] 80%, random tokens
    10%, kept 10%. The paper (§3) only says tags are masked and predicted like words. The original
    couples region -> tag only; `tag_to_region=True` also marks the region of every selected tag (the
    caller then corrupts regions with `corrupt_regions`).
    Returns (tag input ids (L,), tag labels (L,) with IGNORE_INDEX where unselected, region mask (R,)).
    """
    tag_ids = np.asarray(tag_ids, dtype=np.int64)
    tag_region = np.asarray(tag_region, dtype=np.int64)
    region_mask = np.asarray(region_mask, dtype=bool)
    R = len(region_mask)
    # One decision per tag (= per region), shared by its subwords.
    alone = rng.random(R) < tag_prob
    joint = region_mask & (rng.random(R) < joint_prob)
    action = rng.random(R)
    tag_sel = alone | joint  # (R,)
    sel = tag_sel[tag_region]  # (L,)
    act = action[tag_region]  # (L,)
    random_tok = rng.integers(0, vocab_size, size=len(tag_ids))
    labels = np.where(sel, tag_ids, IGNORE_INDEX)
    out = tag_ids.copy()
    out[sel & (act < 0.8)] = mask_id
    swap = sel & (act >= 0.8) & (act < 0.9)
    out[swap] = random_tok[swap]
    present = np.zeros(R, dtype=bool)
    present[tag_region] = True
    new_region_mask = region_mask | (tag_sel & present) if tag_to_region else region_mask.copy()
    return out, labels, new_region_mask
