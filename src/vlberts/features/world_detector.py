"""The embedded world's object detector: BUTD's Faster R-CNN in miniature (SPEC §2, §7).

Bottom-up attention (Anderson et al. 2018, §3.1) runs a ResNet once per image, RoI-pools every RPN
proposal from its feature map, and reads three things off each pooled region: the region feature
(`pool5_flat`, the mean-pooled res5 output, non-negative after ReLU), a softmax over 1600 object
classes plus background (column 0), and a softmax over attributes. This module does the same at the
world's scale, so every downstream path (features, confidences, class/attribute ids, box selection)
runs exactly as it would on real BUTD features:

    image (B, 3, H, W) -> 4 convs (strides 2, 2, 1, 1) -> map (B, C, H/4, W/4)
    proposals -> RoIAlign 7x7 on the map -> fc6 -> ReLU -> fc7 -> ReLU = region feature (K, D)
    region feature -> object logits (K, 1 + shapes), background in column 0
                   -> attribute logits (K, colours)      (BUTD's attribute head)
                   -> size logits (K, sizes)             (auxiliary, not written to stores)

Proposals come from `vlberts.features.proposals` (the RPN's role) and the boxes written are the
proposals themselves, un-regressed, as BUTD writes them. Box selection is `features.selection`.

The attribute head has no "no attribute" column: every world object has exactly one colour, and
BUTD's column 0 only exists because most Visual Genome boxes have no attribute. `attr_id` is thus a
0-based colour index with `attr_conf` its softmax probability. Size is trained as a second attribute
head (it shapes the features) and reported, but a store has one attribute field, and a box's size is
already in its coordinates.

Training (`train_detector`, train split only) follows Faster R-CNN's second stage: proposals with
IoU >= 0.5 to a gold object take its labels, IoU < 0.3 is background, the rest is ignored; each image
contributes 16 sampled RoIs (up to 75 % foreground) plus its gold boxes (Detectron's "gt as proposals";
gold boxes never reach the detector at extraction time). Adam, batches of 8 images, 900 updates at most:
about 45 s on 2 CPU cores, and on a 3,000-image world 91 % shape, 99.5 % colour accuracy on val
foreground proposals. These choices were measured against each other at equal CPU time: small batches
with many updates, BatchNorm and few, mostly-foreground RoIs each bought 5-20 points of shape accuracy.

Letters: B images, K RoIs over the batch, D region-feature width, C object classes incl. background.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from vlberts.config import from_dict
from vlberts.errors import VlbertsError
from vlberts.features.proposals import ProposalConfig, box_iou, label_proposals, make_proposals, proposal_rng
from vlberts.features.record import RegionRecord
from vlberts.features.selection import SelectionConfig, nms_max_conf, select_by_confidence
from vlberts.features.world_scenes import WorldImage, WorldScenes, WorldVocab, load_image
from vlberts.io import atomic_open, atomic_path
from vlberts.models.weights import values_misfit

EXTRACTOR_NAME = "vlberts-world-detector"
DETECTOR_FORMAT = "vlberts-world-detector"
DETECTOR_FORMAT_VERSION = 1
FEATURE_LAYER = "fc7: ReLU(Linear(ReLU(Linear(RoIAlign 7x7 of the stride-4 conv map)))), BUTD pool5's role"


# --------------------------------------------------------------------------- model

@dataclass(frozen=True)
class WorldDetectorConfig:
    """Architecture only (DESIGN habit 2); saved next to the weights."""

    num_classes: int  # object classes without background (the world's shapes)
    num_attributes: int  # colours
    num_sizes: int = 2
    channels: tuple[int, ...] = (16, 32, 32, 32)  # conv widths; the first two convs have stride 2
    batch_norm: bool = True  # after every conv; trains the from-scratch backbone much faster
    roi_size: int = 7
    hidden_dim: int = 256
    feature_dim: int = 128

    def __post_init__(self) -> None:
        if self.num_classes < 1 or self.num_attributes < 1 or self.num_sizes < 1:
            raise VlbertsError("num_classes, num_attributes and num_sizes must be >= 1")
        if len(self.channels) < 2 or min(self.channels) < 1:
            raise VlbertsError(f"channels needs at least two positive widths, got {self.channels}")
        if self.roi_size < 1 or self.hidden_dim < 1 or self.feature_dim < 1:
            raise VlbertsError("roi_size, hidden_dim and feature_dim must be >= 1")

    @property
    def stride(self) -> int:
        return 4  # two stride-2 convs

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["channels"] = list(self.channels)
        return d


@dataclass
class DetectorOutput:
    features: torch.Tensor  # (K, D) region features, >= 0
    cls_logits: torch.Tensor  # (K, C) background first
    attr_logits: torch.Tensor  # (K, A)
    size_logits: torch.Tensor  # (K, S)


class WorldDetector(nn.Module):
    """Backbone once per image, RoIAlign per proposal, a two-layer fc head and three classifiers."""

    def __init__(self, cfg: WorldDetectorConfig):
        super().__init__()
        self.cfg = cfg
        layers: list[nn.Module] = []
        c_in = 3
        for i, c in enumerate(cfg.channels):
            layers.append(nn.Conv2d(c_in, c, 3, stride=2 if i < 2 else 1, padding=1, bias=not cfg.batch_norm))
            if cfg.batch_norm:
                layers.append(nn.BatchNorm2d(c))
            layers.append(nn.ReLU(inplace=True))
            c_in = c
        self.backbone = nn.Sequential(*layers).to(memory_format=torch.channels_last)
        self.fc6 = nn.Linear(c_in * cfg.roi_size**2, cfg.hidden_dim)
        self.fc7 = nn.Linear(cfg.hidden_dim, cfg.feature_dim)
        self.cls_score = nn.Linear(cfg.feature_dim, cfg.num_classes + 1)
        self.attr_score = nn.Linear(cfg.feature_dim, cfg.num_attributes)
        self.size_score = nn.Linear(cfg.feature_dim, cfg.num_sizes)

    def feature_map(self, images: torch.Tensor) -> torch.Tensor:
        """images (B, 3, H, W) uint8 or float in [0, 1] -> (B, C, H/4, W/4)."""
        x = images.float() / 255.0 if images.dtype == torch.uint8 else images
        # channels_last: oneDNN's fast path for small-channel convs on CPU (about 2x here).
        x = ((x - 0.5) / 0.25).contiguous(memory_format=torch.channels_last)
        return self.backbone(x).contiguous()

    def forward(self, images: torch.Tensor, rois: torch.Tensor) -> DetectorOutput:
        """rois (K, 5): [batch index, x1, y1, x2, y2] in input pixels."""
        from torchvision.ops import roi_align  # here: importing torchvision.ops takes over a second (every `vlberts demo` imports this module)

        fmap = self.feature_map(images)
        # aligned=True: pixel-exact sampling (Detectron2's ROIAlignV2). One sample per bin: a 7x7 grid
        # over a RoI of a few map cells already samples every cell (and halves the cost of 2x2).
        pooled = roi_align(fmap, rois, self.cfg.roi_size, spatial_scale=1.0 / self.cfg.stride, sampling_ratio=1, aligned=True)
        h = F.relu(self.fc6(pooled.flatten(1)))  # (K, hidden)
        feats = F.relu(self.fc7(h))  # (K, D)
        return DetectorOutput(feats, self.cls_score(feats), self.attr_score(feats), self.size_score(feats))


def inference_model(model: WorldDetector) -> WorldDetector:
    """An eval-mode copy with every BatchNorm folded into the conv before it: the same arithmetic as
    eval mode (up to float rounding) with one pass over the feature maps less per layer."""
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    m = copy.deepcopy(model).eval()
    layers, fused = list(m.backbone), []
    for layer in layers:
        if isinstance(layer, nn.BatchNorm2d) and fused and isinstance(fused[-1], nn.Conv2d):
            fused[-1] = fuse_conv_bn_eval(fused[-1], layer)
        else:
            fused.append(layer)
    m.backbone = nn.Sequential(*fused).to(memory_format=torch.channels_last)
    return m


# --------------------------------------------------------------------------- batches

def _image_batch(arrays: Sequence[np.ndarray]) -> torch.Tensor:
    """(H, W, 3) uint8 arrays -> (B, 3, Hmax, Wmax) uint8, zero-padded right/bottom (boxes unchanged)."""
    hmax = max(a.shape[0] for a in arrays)
    wmax = max(a.shape[1] for a in arrays)
    out = np.zeros((len(arrays), hmax, wmax, 3), np.uint8)
    for i, a in enumerate(arrays):
        out[i, : a.shape[0], : a.shape[1]] = a
    return torch.from_numpy(out).permute(0, 3, 1, 2).contiguous()  # (B, 3, H, W)


def _rois(proposals: Sequence[np.ndarray]) -> torch.Tensor:
    """Per-image (P_i, 4) boxes -> (K, 5) with the batch index first (torchvision's RoI layout)."""
    parts = [np.concatenate([np.full((len(p), 1), i, np.float32), p.astype(np.float32)], 1) for i, p in enumerate(proposals)]
    return torch.from_numpy(np.concatenate(parts, 0))


# --------------------------------------------------------------------------- training

@dataclass(frozen=True)
class DetectorTrainConfig:
    epochs: int = 3
    max_steps: int = 900  # caps big worlds: 900 x 8 images is about 45 s on 2 CPU cores
    batch_images: int = 8  # small batches, many updates: the best accuracy per CPU second (measured)
    lr: float = 1.5e-3
    warmup_steps: int = 10
    fg_iou: float = 0.5  # Faster R-CNN (Ren et al. 2015 §3.1.2): IoU >= 0.5 takes the object's labels
    bg_iou: float = 0.3  # IoU < 0.3 is background; in between is ignored
    # Sampled labelled proposals per image and their foreground share (Faster R-CNN: 128 of 2000, 25 %).
    # Few RoIs, mostly foreground, spend the step on the shapes: 16 / 0.75 beat 32 / 0.5 by 20 points
    # of val shape accuracy at equal CPU time on a 3,000-image world.
    rois_per_image: int = 16
    fg_fraction: float = 0.75
    gt_as_proposals: bool = True  # train on the gold boxes too, as Detectron does (never at extraction)
    attr_weight: float = 1.0
    size_weight: float = 0.5
    seed: int = 0

    def validate(self) -> None:
        if self.epochs < 1 or self.max_steps < 1 or self.batch_images < 1 or self.lr <= 0:
            raise VlbertsError("epochs, max_steps and batch_images must be >= 1 and lr > 0")
        if not 0 <= self.bg_iou <= self.fg_iou <= 1:
            raise VlbertsError(f"need 0 <= bg_iou <= fg_iou <= 1, got {self.bg_iou} and {self.fg_iou}")


@dataclass(frozen=True)
class Targets:
    cls: torch.Tensor  # (K,) int64: 0 background, 1 + shape id, -1 ignored
    fg: torch.Tensor  # (K,) bool
    attr: torch.Tensor  # (K,) int64 colour id (valid where fg)
    size: torch.Tensor  # (K,) int64 size id (valid where fg)


def proposal_targets(images: Sequence[WorldImage], proposals: Sequence[np.ndarray], fg_iou: float, bg_iou: float) -> Targets:
    """Labels of every proposal of a batch, concatenated in RoI order."""
    cls, fg, attr, size = [], [], [], []
    for im, p in zip(images, proposals):
        lab = label_proposals(p, im.boxes, fg_iou, bg_iou)
        g = np.maximum(lab.gold_index, 0)
        c = np.full(len(p), -1, np.int64)
        c[lab.is_bg] = 0
        if len(im.boxes):
            c[lab.is_fg] = im.shape_ids[g[lab.is_fg]] + 1
            attr.append(np.where(lab.is_fg, im.colour_ids[g], 0))
            size.append(np.where(lab.is_fg, im.size_ids[g], 0))
        else:
            attr.append(np.zeros(len(p), np.int64))
            size.append(np.zeros(len(p), np.int64))
        cls.append(c)
        fg.append(lab.is_fg)
    cat = lambda xs, dt: torch.from_numpy(np.concatenate(xs).astype(dt))  # noqa: E731
    return Targets(cat(cls, np.int64), cat(fg, bool), cat(attr, np.int64), cat(size, np.int64))


def sample_rois(proposals: np.ndarray, gold: np.ndarray, rng: np.random.Generator, train: DetectorTrainConfig) -> np.ndarray:
    """Indices of the labelled proposals one image trains on (Faster R-CNN minibatch sampling).

    Up to `fg_fraction` of `rois_per_image` foreground, the rest background, drawn without replacement;
    ignored proposals (IoU between bg_iou and fg_iou) are never drawn. Fewer RoIs than the 64 proposals
    halve the RoI cost of a step, and a high foreground share spends it on the shapes.
    """
    lab = label_proposals(proposals, gold, train.fg_iou, train.bg_iou)
    fg, bg = np.flatnonzero(lab.is_fg), np.flatnonzero(lab.is_bg)
    n_fg = min(len(fg), int(round(train.fg_fraction * train.rois_per_image)))
    n_bg = min(len(bg), train.rois_per_image - n_fg)
    return np.sort(np.concatenate([rng.choice(fg, n_fg, replace=False), rng.choice(bg, n_bg, replace=False)]))


def detector_loss(
    out: DetectorOutput, t: Targets, attr_weight: float = 1.0, size_weight: float = 0.5
) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on labelled proposals; attribute and size losses on foreground only (BUTD)."""
    l_cls = F.cross_entropy(out.cls_logits, t.cls, ignore_index=-1)
    if t.fg.any():
        l_attr = F.cross_entropy(out.attr_logits[t.fg], t.attr[t.fg])
        l_size = F.cross_entropy(out.size_logits[t.fg], t.size[t.fg])
    else:
        l_attr = l_size = out.attr_logits.sum() * 0.0
    loss = l_cls + attr_weight * l_attr + size_weight * l_size
    return loss, {"cls": l_cls.item(), "attr": l_attr.item(), "size": l_size.item()}


@dataclass
class TrainReport:
    steps: int
    epochs: float  # passes over the train split (fractional when max_steps cut the last one)
    train_images: int
    seconds: float
    final_loss: dict[str, float] = field(default_factory=dict)


StepCallback = Callable[[int, int, dict[str, float]], None]  # (step, total steps, losses)


def train_detector(
    world: WorldScenes,
    cfg: WorldDetectorConfig,
    train: DetectorTrainConfig = DetectorTrainConfig(),
    proposals: ProposalConfig = ProposalConfig(),
    on_step: StepCallback | None = None,
) -> tuple[WorldDetector, TrainReport]:
    """Train on the world's train split only; deterministic for a given `train.seed`.

    Each epoch visits the train images in a fresh seeded order with fresh proposals (stream 1 + epoch);
    training stops after `epochs` or `max_steps` updates, whichever comes first. Adam, linear warm-up
    then cosine decay to zero.
    """
    train.validate()
    proposals.validate()
    images = world.split("train")
    if not images:
        raise VlbertsError("the world has no train split to train the detector on", path=world.root / "scenes.jsonl")
    steps_per_epoch = math.ceil(len(images) / train.batch_images)
    total = min(train.max_steps, train.epochs * steps_per_epoch)

    torch.manual_seed(train.seed)
    model = WorldDetector(cfg)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=train.lr)

    def lr_at(step: int) -> float:  # step is 0-based
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        return 0.5 * (1 + math.cos(math.pi * (step - train.warmup_steps) / max(1, total - train.warmup_steps)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    # Decoded pixels (about 50 kB per 128x128 image), kept only when images are visited more than once.
    cache: dict[int, np.ndarray] = {}
    use_cache = total * train.batch_images > len(images)
    step, losses, t0 = 0, {}, time.perf_counter()
    epoch = 0
    while step < total:
        order = np.random.default_rng([train.seed, epoch]).permutation(len(images))
        for start in range(0, len(order), train.batch_images):
            if step >= total:
                break
            batch = [images[i] for i in order[start : start + train.batch_images]]
            pixels = []
            for im in batch:
                px = cache.get(im.image_id)
                if px is None:
                    px = load_image(world, im)
                    if use_cache:
                        cache[im.image_id] = px
                pixels.append(px)
            props = []
            for im in batch:
                rng = proposal_rng(train.seed, im.image_id, 1 + epoch)
                p = make_proposals(im.boxes, im.width, im.height, rng, proposals)
                p = p[sample_rois(p, im.boxes, rng, train)]
                props.append(np.concatenate([im.boxes, p]) if train.gt_as_proposals else p)
            targets = proposal_targets(batch, props, train.fg_iou, train.bg_iou)
            out = model(_image_batch(pixels), _rois(props))
            loss, losses = detector_loss(out, targets, train.attr_weight, train.size_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            if on_step is not None:
                on_step(step, total, losses)
        epoch += 1
    model.eval()
    report = TrainReport(
        steps=step, epochs=round(step / steps_per_epoch, 3), train_images=len(images),
        seconds=round(time.perf_counter() - t0, 2), final_loss={k: round(v, 4) for k, v in losses.items()},
    )
    return model, report


# --------------------------------------------------------------------------- inference

@dataclass(frozen=True)
class Detections:
    """Every proposal of one image, scored (before box selection)."""

    boxes: np.ndarray  # (P, 4) float32, the proposals
    features: np.ndarray  # (P, D) float32
    cls_prob: np.ndarray  # (P, 1 + shapes) float32, background in column 0
    attr_prob: np.ndarray  # (P, colours) float32
    size_prob: np.ndarray  # (P, sizes) float32


@torch.no_grad()
def detect(model: WorldDetector, pixels: Sequence[np.ndarray], proposals: Sequence[np.ndarray]) -> list[Detections]:
    """Score the proposals of a batch of images ((H, W, 3) uint8 each) in one backbone pass."""
    model.eval()
    out = model(_image_batch(pixels), _rois(proposals))
    feats = out.features.numpy()
    cls_prob = F.softmax(out.cls_logits, -1).numpy()
    attr_prob = F.softmax(out.attr_logits, -1).numpy()
    size_prob = F.softmax(out.size_logits, -1).numpy()
    dets, start = [], 0
    for p in proposals:
        s = slice(start, start + len(p))
        dets.append(Detections(p.astype(np.float32), feats[s], cls_prob[s], attr_prob[s], size_prob[s]))
        start += len(p)
    return dets


def select_regions(im: WorldImage, det: Detections, selection: SelectionConfig) -> RegionRecord:
    """BUTD box selection on one image's detections -> its `RegionRecord`.

    obj_id/obj_conf as LXMERT's extract_coco_image.py: argmax/max over cls_prob[:, 1:] (0-based,
    background excluded, not renormalised); attr_id/attr_conf likewise over the colour softmax.
    """
    keep = select_by_confidence(nms_max_conf(det.boxes, det.cls_prob, selection.nms), selection)
    cls_prob = det.cls_prob[keep]  # (N, C)
    attr_prob = det.attr_prob[keep]  # (N, A)
    return RegionRecord(
        image_id=im.image_id,
        image_w=im.width,
        image_h=im.height,
        boxes=det.boxes[keep],
        features=det.features[keep],
        cls_prob=cls_prob,
        obj_id=cls_prob[:, 1:].argmax(1),
        obj_conf=cls_prob[:, 1:].max(1),
        attr_id=attr_prob.argmax(1),
        attr_conf=attr_prob.max(1),
    )


def gold_regions(im: WorldImage, det: Detections) -> RegionRecord:
    """Every RoI of `det` kept, in order (no NMS, no threshold): with `iter_detections(gold=True)` the
    record's regions are exactly the image's gold objects in object id order -- the candidate regions of
    the ground-truth-region track of RefCOCO+ (VL-BERT §4.2.3). obj/attr fields as in `select_regions`."""
    return RegionRecord(
        image_id=im.image_id, image_w=im.width, image_h=im.height, boxes=det.boxes, features=det.features,
        cls_prob=det.cls_prob, obj_id=det.cls_prob[:, 1:].argmax(1), obj_conf=det.cls_prob[:, 1:].max(1),
        attr_id=det.attr_prob.argmax(1), attr_conf=det.attr_prob.max(1),
    )


def iter_detections(
    model: WorldDetector,
    world: WorldScenes,
    images: Sequence[WorldImage],
    proposals: ProposalConfig = ProposalConfig(),
    seed: int = 0,
    batch_images: int = 64,
    gold: bool = False,
) -> Iterator[tuple[WorldImage, Detections]]:
    """Detections of `images` in order, with the extraction proposals (stream 0 of `seed`), or with
    `gold` the images' gold object boxes as the RoIs (features for given boxes: `gold_regions`)."""
    model = inference_model(model)
    for start in range(0, len(images), batch_images):
        batch = images[start : start + batch_images]
        pixels = [load_image(world, im) for im in batch]
        props = [im.boxes.astype(np.float32) if gold else
                 make_proposals(im.boxes, im.width, im.height, proposal_rng(seed, im.image_id, 0), proposals)
                 for im in batch]
        yield from zip(batch, detect(model, pixels, props))


# --------------------------------------------------------------------------- evaluation

@dataclass
class ProposalAccuracy:
    """Accuracy on labelled proposals of held-out images (counts kept so that batches add up)."""

    n_labelled: int = 0  # foreground + background proposals
    n_fg: int = 0
    cls_correct: int = 0  # argmax over all C columns (background included) == label
    obj_correct: int = 0  # foreground: argmax over non-background columns (the written obj_id) == shape
    attr_correct: int = 0
    size_correct: int = 0
    n_gold: int = 0
    gold_found: int = 0  # gold objects with a kept box of IoU >= 0.5 whose obj_id is their shape

    def add(
        self, im: WorldImage, det: Detections, rec: RegionRecord | None = None, fg_iou: float = 0.5, bg_iou: float = 0.3
    ) -> None:
        lab = label_proposals(det.boxes, im.boxes, fg_iou, bg_iou)
        g = np.maximum(lab.gold_index, 0)
        labelled = lab.is_fg | lab.is_bg
        cls = np.where(lab.is_fg, im.shape_ids[g] + 1 if len(im.boxes) else 0, 0)
        self.n_labelled += int(labelled.sum())
        self.cls_correct += int((det.cls_prob.argmax(1) == cls)[labelled].sum())
        fg = lab.is_fg
        self.n_fg += int(fg.sum())
        if fg.any():
            self.obj_correct += int((det.cls_prob[fg, 1:].argmax(1) == im.shape_ids[g[fg]]).sum())
            self.attr_correct += int((det.attr_prob[fg].argmax(1) == im.colour_ids[g[fg]]).sum())
            self.size_correct += int((det.size_prob[fg].argmax(1) == im.size_ids[g[fg]]).sum())
        if rec is not None and len(im.boxes):
            iou = box_iou(im.boxes, rec.boxes)  # (G, N)
            hit = (iou >= fg_iou) & (rec.obj_id[None, :] == im.shape_ids[:, None])
            self.n_gold += len(im.boxes)
            self.gold_found += int(hit.any(1).sum())

    def to_dict(self) -> dict[str, Any]:
        r = lambda a, b: round(a / b, 4) if b else None  # noqa: E731
        return {
            "cls_acc": r(self.cls_correct, self.n_labelled),
            "obj_acc": r(self.obj_correct, self.n_fg),
            "attr_acc": r(self.attr_correct, self.n_fg),
            "size_acc": r(self.size_correct, self.n_fg),
            "gold_recall": r(self.gold_found, self.n_gold),
            "labelled_proposals": self.n_labelled,
            "fg_proposals": self.n_fg,
            "gold_objects": self.n_gold,
        }


def evaluate_detector(
    model: WorldDetector,
    world: WorldScenes,
    images: Sequence[WorldImage],
    proposals: ProposalConfig = ProposalConfig(),
    selection: SelectionConfig | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Proposal accuracies on `images` (and gold recall after `selection`, when given)."""
    acc = ProposalAccuracy()
    for im, det in iter_detections(model, world, images, proposals, seed):
        acc.add(im, det, None if selection is None else select_regions(im, det, selection))
    return acc.to_dict()


# --------------------------------------------------------------------------- weights

@dataclass
class DetectorInfo:
    """The JSON written next to the weights: architecture, vocabularies, proposals, how it was trained."""

    config: WorldDetectorConfig
    vocab: WorldVocab
    proposals: ProposalConfig = ProposalConfig()
    train: dict[str, Any] = field(default_factory=dict)  # DetectorTrainConfig + TrainReport
    val: dict[str, Any] = field(default_factory=dict)  # ProposalAccuracy on the val split of its world

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": DETECTOR_FORMAT,
            "format_version": DETECTOR_FORMAT_VERSION,
            "config": self.config.to_dict(),
            "classes": list(self.vocab.shapes),
            "attributes": list(self.vocab.colours),
            "sizes": list(self.vocab.sizes),
            "proposals": {**asdict(self.proposals), "jitter_per_object": list(self.proposals.jitter_per_object)},
            "train": self.train,
            "val": self.val,
        }


def detector_json_path(weights: str | Path) -> Path:
    """`X.safetensors` -> `X.json`."""
    return Path(weights).with_suffix(".json")


def weights_bytes(model: WorldDetector) -> bytes:
    """The safetensors serialisation of the weights (hashed for the store metadata, then written)."""
    from safetensors.torch import save

    return save({k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()})


def save_detector(path: str | Path, model: WorldDetector, info: DetectorInfo, data: bytes | None = None) -> str:
    """Write `path` (.safetensors) and its .json atomically; returns the sha256 of the weights file."""
    path = Path(path)
    data = weights_bytes(model) if data is None else data
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    with atomic_open(detector_json_path(path)) as f:
        json.dump(info.to_dict(), f, indent=2)
        f.write("\n")
    return hashlib.sha256(data).hexdigest()


def load_detector(path: str | Path) -> tuple[WorldDetector, DetectorInfo, str]:
    """Load weights + JSON written by `save_detector` -> (model in eval mode, info, sha256 of the weights)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    meta_path = detector_json_path(path)
    if not path.is_file():
        raise VlbertsError("detector weights not found", path=path)
    if not meta_path.is_file():
        raise VlbertsError("detector config not found (expected next to the weights)", path=meta_path)
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise VlbertsError(f"malformed JSON ({e})", path=meta_path) from None
    if not isinstance(meta, dict) or meta.get("format") != DETECTOR_FORMAT:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise VlbertsError(f"not a {DETECTOR_FORMAT} config (format={found!r})", path=meta_path)
    try:
        cfg = from_dict(WorldDetectorConfig, meta["config"], where=str(meta_path))
        prop = from_dict(ProposalConfig, meta.get("proposals", {}), where=str(meta_path))
        vocab = WorldVocab(tuple(meta["classes"]), tuple(meta["attributes"]), tuple(meta["sizes"]))
    except KeyError as e:
        raise VlbertsError(f"missing key {e}", path=meta_path) from None
    data = path.read_bytes()
    try:
        state = load(data)
    except (SafetensorError, ValueError) as e:
        raise VlbertsError(f"cannot read safetensors ({e})", path=path) from None
    model = WorldDetector(cfg)
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        raise VlbertsError(f"weights do not fit the config: {str(e).splitlines()[-1].strip()}", path=path) from None
    if missing or unexpected:
        raise VlbertsError(f"weights do not fit the config: missing {missing[:3]}, unexpected {unexpected[:3]}", path=path)
    problem = values_misfit(state, model.state_dict())  # NaN weights would only show as NaN confidences later
    if problem:
        raise VlbertsError(f"tensor {problem[0]} {problem[1]}", path=path)
    model.eval()
    info = DetectorInfo(cfg, vocab, prop, meta.get("train", {}), meta.get("val", {}))
    return model, info, hashlib.sha256(data).hexdigest()
