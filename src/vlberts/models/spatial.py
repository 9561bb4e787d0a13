"""Spatial encodings of boxes, computed in the model from normalised xyxy boxes (SPEC §2).

- 4-d: (x1, y1, x2, y2)                                   LXMERT, W-VisualBERT
- 5-d: (x1, y1, x2, y2, area fraction)                    ViLBERT
- 6-d: (x1, y1, x2, y2, w, h)                             VisualBERT (Flickr30K setting)
"""

from __future__ import annotations

import torch
from torch import Tensor

SPATIAL_DIMS = {"none": 0, "4d": 4, "5d": 5, "6d": 6}


def spatial_encoding(boxes: Tensor, kind: str) -> Tensor:
    """boxes (..., 4) normalised xyxy -> (..., SPATIAL_DIMS[kind])."""
    x1, y1, x2, y2 = boxes.unbind(-1)
    w, h = x2 - x1, y2 - y1
    if kind == "4d":
        return boxes
    if kind == "5d":
        return torch.stack([x1, y1, x2, y2, w * h], dim=-1)
    if kind == "6d":
        return torch.stack([x1, y1, x2, y2, w, h], dim=-1)
    raise ValueError(f"unknown spatial encoding {kind!r}; valid: {', '.join(k for k in SPATIAL_DIMS if k != 'none')}")
