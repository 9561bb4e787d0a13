"""Which detected regions an image keeps: BUTD's box-selection policy (reference §1.1).

peteanderson80/bottom-up-attention `tools/generate_tsv.py`, for every image:

    max_conf = 0 for every RoI
    for each class c = 1..C (column 0 is background):
        keep = nms(rois, cls_prob[:, c], 0.3)                         # cfg.TEST.NMS
        max_conf[keep] = max(max_conf[keep], cls_prob[keep, c])
    keep_boxes = where(max_conf >= conf_thresh)                      # 0.2
    if len(keep_boxes) < MIN_BOXES: keep_boxes = argsort(max_conf)[::-1][:MIN_BOXES]
    elif len(keep_boxes) > MAX_BOXES: keep_boxes = argsort(max_conf)[::-1][:MAX_BOXES]

So a RoI's confidence is its best score over the classes in which it survives NMS: a duplicate
box around an already-kept object loses that class and keeps only its (low) other scores.
Papers' policies: fixed 36 (min = max = 36, LXMERT, ViLBERT), 10-36 above threshold (VisualBERT,
BUTD), 10-100 (BUTD adaptive, VL-BERT), and VisualBERT's NLVR2 features: 150 Detectron boxes an image of
which its loader keeps the first 144 (`image_feature_cap`; here `--max_regions=144` on a store of them).

Order: BUTD keeps RoI-index order when the count is between MIN and MAX and confidence order
otherwise. `order="confidence"` (our default) sorts every image by confidence, descending, so that
"the first k regions" means the same thing for every image; `order="butd"` reproduces the original.
Ties sort stably (lower RoI index first); NumPy's unstable argsort in the original may order exact
ties differently.

Letters: K RoIs of one image, C classes including background.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from vlberts.errors import VlbertsError

SelectionOrder = Literal["confidence", "butd"]


@dataclass(frozen=True)
class SelectionConfig:
    conf_thresh: float = 0.2
    min_boxes: int = 10
    max_boxes: int = 36
    nms: float = 0.3
    order: SelectionOrder = "confidence"

    def validate(self) -> None:
        if not 0 <= self.min_boxes <= self.max_boxes or self.max_boxes < 1:
            raise VlbertsError(f"need 0 <= min_boxes <= max_boxes and max_boxes >= 1, got {self.min_boxes} and {self.max_boxes}")
        if not 0.0 <= self.nms <= 1.0:
            raise VlbertsError(f"nms threshold must be in [0, 1], got {self.nms}")
        if self.order not in ("confidence", "butd"):
            raise VlbertsError(f"order must be 'confidence' or 'butd', got {self.order!r}")

    @property
    def policy(self) -> str:
        """The paper-style name of the policy: "fixed36", "10-36", ..."""
        return f"fixed{self.max_boxes}" if self.min_boxes == self.max_boxes else f"{self.min_boxes}-{self.max_boxes}"


def nms_max_conf(boxes: np.ndarray, cls_prob: np.ndarray, nms: float = 0.3) -> np.ndarray:
    """Each RoI's best score over the non-background classes in which it survives per-class NMS.

    boxes (K, 4) xyxy, cls_prob (K, C) with background in column 0 -> (K,) float32.
    """
    k, c = cls_prob.shape
    if k == 0 or c < 2:
        return np.zeros(k, np.float32)
    scores = torch.as_tensor(np.ascontiguousarray(cls_prob[:, 1:], dtype=np.float32))  # (K, C-1)
    b = torch.as_tensor(np.asarray(boxes, np.float32)).repeat(c - 1, 1)  # (C-1)*K boxes, class-major
    s = scores.T.reshape(-1)  # ((C-1)*K,) in the same class-major order
    cls = torch.arange(c - 1).repeat_interleave(k)
    from torchvision.ops import batched_nms  # here: importing torchvision.ops takes over a second, and only extraction needs it

    # batched_nms offsets each class's boxes apart, so this is exactly one NMS per class.
    kept = batched_nms(b, s, cls, nms).numpy()
    max_conf = np.zeros(k, np.float32)
    np.maximum.at(max_conf, kept % k, s.numpy()[kept])
    return max_conf


def select_boxes(boxes: np.ndarray, cls_prob: np.ndarray, cfg: SelectionConfig = SelectionConfig()) -> np.ndarray:
    """Indices of the RoIs to keep (BUTD policy, module docstring), in the configured order."""
    max_conf = nms_max_conf(boxes, cls_prob, cfg.nms)
    return select_by_confidence(max_conf, cfg)


def select_by_confidence(max_conf: np.ndarray, cfg: SelectionConfig = SelectionConfig()) -> np.ndarray:
    """The threshold/min/max part of the policy, given each RoI's max confidence (K,) -> kept indices."""
    by_conf = np.argsort(-np.asarray(max_conf, np.float64), kind="stable")  # descending, ties by index
    above = np.flatnonzero(max_conf >= cfg.conf_thresh)
    if len(above) < cfg.min_boxes:
        return by_conf[: cfg.min_boxes].astype(np.int64)
    if len(above) > cfg.max_boxes:
        return by_conf[: cfg.max_boxes].astype(np.int64)
    if cfg.order == "butd":
        return above.astype(np.int64)
    return by_conf[: len(above)].astype(np.int64)  # the same set as `above`, sorted by confidence
