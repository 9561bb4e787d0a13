"""Region proposals for the embedded world: the role BUTD's RPN plays for Faster R-CNN.

A real RPN proposes boxes that scatter around objects (most overlap them well, none is exact), boxes
on parts of objects, boxes that span several objects, and many background boxes; the second stage
then scores every proposal. We imitate that output directly from the gold boxes, so that the world
detector faces the same selection problem as BUTD without training an RPN:

  - per object, 1-3 *jittered* boxes (centre shift and log-size noise); the first is redrawn until
    its IoU with the object is >= `min_first_iou` (0.6), so every object has a good proposal;
  - per object, `parts_per_object` *part* boxes inside it covering 10-40 % of it (IoU 0.1-0.4);
  - `pair_boxes` boxes spanning two objects (their union, jittered);
  - random *background* boxes filling up to `num_proposals`.

Proposals are shuffled (an RPN's order says nothing about which box is an object) and are a pure
function of (seed, image id, stream): extraction uses stream 0; training epoch e uses stream 1 + e,
so the detector sees fresh proposals every epoch. Gold boxes reach the detector only through this
jitter; it never sees them at extraction time.

Letters: P proposals, G gold boxes.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from vlberts.errors import VlbertsError


@dataclass(frozen=True)
class ProposalConfig:
    num_proposals: int = 64  # total per image; background boxes fill up to this
    jitter_per_object: tuple[int, int] = (1, 3)  # inclusive range of jittered boxes per object
    jitter_std: float = 0.1  # std of the centre shift (x box size) and of the log width/height change
    min_first_iou: float = 0.6  # the first jittered box of each object reaches this IoU
    parts_per_object: int = 1
    pair_boxes: int = 3
    min_side: float = 4.0  # pixels; no proposal is thinner than this

    def validate(self) -> None:
        lo, hi = self.jitter_per_object
        if not 1 <= lo <= hi:
            raise VlbertsError(f"jitter_per_object must be (lo, hi) with 1 <= lo <= hi, got {self.jitter_per_object}")
        if self.num_proposals < 1 or self.parts_per_object < 0 or self.pair_boxes < 0:
            raise VlbertsError("num_proposals must be >= 1; parts_per_object and pair_boxes >= 0")
        if not 0.0 < self.min_first_iou < 1.0 or self.jitter_std < 0 or self.min_side <= 0:
            raise VlbertsError("min_first_iou must be in (0, 1), jitter_std >= 0 and min_side > 0")


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of (P, 4) and (G, 4) xyxy boxes -> (P, G) float64 (continuous areas, no +1 pixel)."""
    a = np.asarray(a, np.float64).reshape(-1, 4)
    b = np.asarray(b, np.float64).reshape(-1, 4)
    lt = np.maximum(a[:, None, :2], b[None, :, :2])  # (P, G, 2)
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)  # (P, G)
    area_a = (a[:, 2:] - a[:, :2]).prod(-1)
    area_b = (b[:, 2:] - b[:, :2]).prod(-1)
    union = area_a[:, None] + area_b[None, :] - inter
    return np.where(union > 0, inter / np.maximum(union, 1e-12), 0.0)


def _id_number(image_id: int | str) -> int:
    """A stable non-negative integer for an image id (ints as they are, strings hashed)."""
    if isinstance(image_id, (int, np.integer)) and not isinstance(image_id, bool) and image_id >= 0:
        return int(image_id)
    s = str(image_id)
    if s.isdigit():
        return int(s)
    return int.from_bytes(hashlib.sha256(s.encode("utf-8")).digest()[:8], "little")


def proposal_rng(seed: int, image_id: int | str, stream: int = 0) -> np.random.Generator:
    """The generator of one image's proposals: stream 0 for extraction, 1 + epoch for training."""
    return np.random.default_rng(np.random.SeedSequence([int(seed) & 0xFFFFFFFF, _id_number(image_id), int(stream)]))


def _clip(boxes: np.ndarray, width: int, height: int, min_side: float) -> np.ndarray:
    """Clip xyxy boxes to the image and widen any box thinner than `min_side` (inside the image)."""
    b = np.minimum(np.maximum(boxes, 0.0), np.array([width, height, width, height], np.float64))
    for lo, hi, size in ((0, 2, width), (1, 3, height)):
        side = min(min_side, size)
        short = b[:, hi] - b[:, lo] < side
        if short.any():
            centre = np.clip((b[short, lo] + b[short, hi]) / 2, side / 2, size - side / 2)
            b[short, lo], b[short, hi] = centre - side / 2, centre + side / 2
    return b


def _jitter(rng: np.random.Generator, boxes: np.ndarray, std: float) -> np.ndarray:
    """(N, 4) boxes with centres shifted by N(0, std * size) and sides scaled by exp(N(0, std))."""
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    noise = rng.normal(0.0, std, size=(len(boxes), 4))
    cx = (boxes[:, 0] + boxes[:, 2]) / 2 + noise[:, 0] * w
    cy = (boxes[:, 1] + boxes[:, 3]) / 2 + noise[:, 1] * h
    w, h = w * np.exp(noise[:, 2]), h * np.exp(noise[:, 3])
    return np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)


def _paired_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """IoU of a[i] with b[i] for (..., 4) boxes -> (...)."""
    iw = np.clip(np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0]), 0, None)
    ih = np.clip(np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1]), 0, None)
    inter = iw * ih
    union = (a[..., 2] - a[..., 0]) * (a[..., 3] - a[..., 1]) + (b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1]) - inter
    return inter / np.maximum(union, 1e-12)


def _first_jitters(rng: np.random.Generator, gold: np.ndarray, width: int, height: int, cfg: ProposalConfig) -> np.ndarray:
    """One jittered box per gold box with IoU >= min_first_iou after clipping -> (G, 4).

    Each object takes the first of 16 draws that qualifies; objects with 16 misses (tiny or clipped
    boxes) draw again with half the noise, up to 4 rounds, and finally take their gold box.
    """
    out = gold.copy()
    todo = np.arange(len(gold))
    for r in range(4):
        if not len(todo):
            break
        g = np.repeat(gold[todo], 16, axis=0)  # (T*16, 4)
        cand = _jitter(rng, g, cfg.jitter_std / 2**r).reshape(len(todo), 16, 4)
        ok = _paired_iou(_clip(cand.reshape(-1, 4), width, height, cfg.min_side), g).reshape(len(todo), 16) >= cfg.min_first_iou
        found = ok.any(1)
        out[todo[found]] = cand[found, ok[found].argmax(1)]
        todo = todo[~found]
    return out


def _parts(rng: np.random.Generator, boxes: np.ndarray) -> np.ndarray:
    """One sub-box per box covering a fraction U(0.1, 0.4) of its area, so IoU = that fraction."""
    u = rng.random((len(boxes), 4))
    frac = 0.1 + 0.3 * u[:, 0]
    fw = frac + (1 - frac) * u[:, 1]  # width fraction; the height fraction frac / fw is then <= 1
    fh = frac / fw
    w, h = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    x = boxes[:, 0] + u[:, 2] * (1 - fw) * w
    y = boxes[:, 1] + u[:, 3] * (1 - fh) * h
    return np.stack([x, y, x + fw * w, y + fh * h], 1)


def _backgrounds(rng: np.random.Generator, n: int, width: int, height: int, min_side: float) -> np.ndarray:
    """n random boxes of sides U(2 * min_side, half the image) anywhere in the image."""
    u = rng.random((n, 4))
    w = 2 * min_side + u[:, 0] * max(0.0, width / 2 - 2 * min_side)
    h = 2 * min_side + u[:, 1] * max(0.0, height / 2 - 2 * min_side)
    x = u[:, 2] * np.maximum(0.0, width - w)
    y = u[:, 3] * np.maximum(0.0, height - h)
    return np.stack([x, y, x + w, y + h], 1)


def make_proposals(
    gold: np.ndarray, width: int, height: int, rng: np.random.Generator, cfg: ProposalConfig = ProposalConfig()
) -> np.ndarray:
    """Proposals for one image with gold boxes `gold` (G, 4) -> (P, 4) float32 xyxy pixels.

    P = max(`cfg.num_proposals`, the number of object-derived boxes); see the module docstring.
    """
    gold = np.asarray(gold, np.float64).reshape(-1, 4)
    lo, hi = cfg.jitter_per_object
    n_jit = rng.integers(lo, hi + 1, size=len(gold))  # jittered boxes per object
    # The RPN finds every object at least once: one good box each, then the free jitters.
    out = [_first_jitters(rng, gold, width, height, cfg)]
    out.append(_jitter(rng, np.repeat(gold, n_jit - 1, axis=0), cfg.jitter_std))
    out += [_parts(rng, gold) for _ in range(cfg.parts_per_object)]
    if len(gold) >= 2 and cfg.pair_boxes:
        i = rng.integers(len(gold), size=cfg.pair_boxes)
        pairs = np.stack([i, (i + rng.integers(1, len(gold), size=cfg.pair_boxes)) % len(gold)], 1)  # (pairs, 2), distinct
        a, b = gold[pairs[:, 0]], gold[pairs[:, 1]]
        union = np.concatenate([np.minimum(a[:, :2], b[:, :2]), np.maximum(a[:, 2:], b[:, 2:])], 1)
        out.append(_jitter(rng, union, cfg.jitter_std / 2))
    n = sum(len(o) for o in out)
    out.append(_backgrounds(rng, max(0, cfg.num_proposals - n), width, height, cfg.min_side))
    boxes = _clip(np.concatenate(out), width, height, cfg.min_side)
    return boxes[rng.permutation(len(boxes))].astype(np.float32)


@dataclass(frozen=True)
class ProposalLabels:
    """Training targets of proposals (Faster R-CNN's second stage, Ren et al. 2015 §3.1.2)."""

    gold_index: np.ndarray  # (P,) int64: the matched gold box, -1 for background or ignored
    is_fg: np.ndarray  # (P,) bool: max IoU >= fg_iou -> takes the labels of its best gold box
    is_bg: np.ndarray  # (P,) bool: max IoU < bg_iou -> background class
    max_iou: np.ndarray  # (P,) float64


def label_proposals(proposals: np.ndarray, gold: np.ndarray, fg_iou: float = 0.5, bg_iou: float = 0.3) -> ProposalLabels:
    """Match proposals to gold boxes: IoU >= `fg_iou` foreground, < `bg_iou` background, else ignored."""
    p = len(proposals)
    if len(gold) == 0:
        return ProposalLabels(np.full(p, -1, np.int64), np.zeros(p, bool), np.ones(p, bool), np.zeros(p))
    iou = box_iou(proposals, gold)  # (P, G)
    best = iou.argmax(1)
    max_iou = iou[np.arange(p), best]
    is_fg = max_iou >= fg_iou
    return ProposalLabels(np.where(is_fg, best, -1).astype(np.int64), is_fg, max_iou < bg_iou, max_iou)
