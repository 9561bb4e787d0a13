"""Box geometry for the grounding analysis: areas, pairwise IoU, union boxes.

Boxes are float (x1, y1, x2, y2) in pixels. Areas use the continuous convention, (x2 - x1) * (y2 - y1),
as BAN's `calculate_iou`, which VisualBERT's Flickr30K code copies (formats-and-metrics §4, §5); the
"+1 pixel" convention of py-faster-rcnn / ViLBERT is not used. Letters: N and M box counts, K gold boxes.
"""

from __future__ import annotations

import numpy as np


def as_boxes(boxes, name: str = "boxes") -> np.ndarray:
    """`boxes` as a float64 (N, 4) array; a single box (4,) becomes (1, 4). Raises on other shapes."""
    arr = np.asarray(boxes, dtype=np.float64)
    if arr.ndim == 1 and arr.shape[0] == 4:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] != 4:
        raise ValueError(f"{name} must have shape (N, 4) in xyxy order, got {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or infinite coordinates")
    if (arr[:, 2] < arr[:, 0]).any() or (arr[:, 3] < arr[:, 1]).any():
        raise ValueError(f"{name} has x2 < x1 or y2 < y1: boxes must be (x1, y1, x2, y2), not (x, y, w, h)")
    return arr


def box_area(boxes) -> np.ndarray:
    """(N, 4) -> (N,) areas."""
    b = as_boxes(boxes)
    return (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])


def box_iou(a, b) -> np.ndarray:
    """Pairwise intersection over union: (N, 4) x (M, 4) -> (N, M) float64, vectorised.

    Two boxes whose union has zero area (both degenerate) get IoU 0, never NaN.
    """
    a, b = as_boxes(a, "a"), as_boxes(b, "b")
    lt = np.maximum(a[:, None, :2], b[None, :, :2])  # (N, M, 2) top-left of the intersection
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])  # (N, M, 2) bottom-right of the intersection
    wh = np.clip(rb - lt, 0.0, None)
    inter = wh[..., 0] * wh[..., 1]  # (N, M)
    union = box_area(a)[:, None] + box_area(b)[None, :] - inter
    out = np.zeros_like(inter)
    np.divide(inter, union, out=out, where=union > 0)
    return out


def union_box(boxes) -> np.ndarray:
    """(K, 4) -> (4,): the smallest box holding all K boxes.

    This is how the original Flickr30K Entities protocol (Plummer et al.) scores a phrase that has
    several gold boxes (formats-and-metrics §5).
    """
    b = as_boxes(boxes)
    return np.array([b[:, 0].min(), b[:, 1].min(), b[:, 2].max(), b[:, 3].max()])
