"""Turning stored region records into model inputs; shared by every dataset.

Boxes are normalised by the image size here (xyxy / (W, H, W, H)); spatial encodings are computed in
the model from these (SPEC §2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import get_worker_info

from vlberts.data.batch import TagInputs, VLInputs
from vlberts.errors import VlbertsError
from vlberts.features.record import as_float32
from vlberts.models.wvisualbert import image_tags


class RegionRecordLike(Protocol):
    image_id: str
    image_w: int
    image_h: int
    boxes: np.ndarray  # (N, 4) xyxy pixels
    features: np.ndarray  # (N, D)


class RegionSource(Protocol):
    def get(self, image_id: str) -> RegionRecordLike: ...


@dataclass
class Regions:
    feats: np.ndarray  # (R, D) float32 (float16 as stored, when asked: `load_regions`)
    boxes: np.ndarray  # (R, 4) float32 normalised xyxy
    pixel_boxes: np.ndarray  # (R, 4) float32 xyxy pixels
    conf: np.ndarray | None  # (R,) detector confidence, when the store has it
    image_w: float = 0.0  # the image's width in pixels (0: not known; `mirrored` needs it)


class FetchedRecord:
    """A region source holding one record already read, so that a caller that needs the record itself
    (labels, image size, confidence) and its `load_regions` view reads the store once."""

    def __init__(self, rec: Any, path: Any = None):
        self.rec, self.path = rec, path

    def get(self, image_id: str) -> Any:
        return self.rec


def load_regions(source: RegionSource, image_id: str | int, max_regions: int, feature_dim: int | None = None,
                 float16: bool = False) -> Regions:
    """The first `max_regions` regions of an image (stores keep them in detector order); features as float32,
    or, with `float16`, float16 features as they are stored (`RegionSetup.float16`)."""
    rec = source.get(str(image_id))
    feats = rec.features[:max_regions]
    feats = feats if float16 and feats.dtype == np.float16 else as_float32(feats)
    if feature_dim is not None and feats.shape[1] != feature_dim:
        raise VlbertsError(
            f"region features are {feats.shape[1]}-d but the model expects {feature_dim}-d (visual_dim)",
            path=getattr(source, "path", None),
            record=f"image {image_id}",
        )
    pix = np.asarray(rec.boxes[:max_regions], dtype=np.float32)
    scale = np.array([rec.image_w, rec.image_h, rec.image_w, rec.image_h], dtype=np.float32)
    conf = getattr(rec, "obj_conf", None)
    conf = None if conf is None else np.asarray(conf[:max_regions], dtype=np.float32)
    return Regions(feats=feats, boxes=np.clip(pix / scale, 0.0, 1.0), pixel_boxes=pix, conf=conf, image_w=rec.image_w)


def mirrored(r: Regions) -> Regions:
    """The regions of the image flipped left-right (`data.mirror`): x -> W - x in pixels, x -> 1 - x
    normalised, left and right edges exchanged; features as they are."""
    if not r.image_w > 0:
        raise ValueError("mirroring regions needs the image's width (Regions.image_w, set by load_regions)")

    def flip(b: np.ndarray, width: float) -> np.ndarray:  # (R, 4) xyxy -> (R, 4) xyxy
        return np.stack([width - b[:, 2], b[:, 1], width - b[:, 0], b[:, 3]], axis=1).astype(b.dtype, copy=False)

    return replace(r, boxes=flip(r.boxes, 1.0), pixel_boxes=flip(r.pixel_boxes, float(r.image_w)))


def detected_classes(source: RegionSource, image_id: str | int, record: str | None = None) -> np.ndarray:
    """The detector's class per stored region of an image (`obj_id`, (N,)), which W-VisualBERT's tags are
    made of; a store without it is an error naming the store and `record` (default: the image)."""
    obj_id = getattr(source.get(str(image_id)), "obj_id", None)
    if obj_id is None:
        raise VlbertsError("detector tags need each region's obj_id, which this image lacks",
                           path=getattr(source, "path", None), record=record or f"image {image_id}")
    return np.asarray(obj_id)


def detected_tags(
    records: Sequence[Any], image_ids: Sequence[str | int], regions: Sequence[Regions],
    tag_subwords: Sequence[Sequence[int]], path: Any = None, pad_id: int = 0,
) -> TagInputs:
    """W-VisualBERT's unmasked detector tags for a batch of images already read (`records[b]` of image
    `image_ids[b]`, loaded as `regions[b]`): the classes of each image's first len(regions[b].feats) boxes,
    as fine-tuning and the analyses give them. `path` names the store in the error for a missing obj_id."""
    obj_ids = [detected_classes(FetchedRecord(rec, path), i)[: len(r.feats)]
               for rec, i, r in zip(records, image_ids, regions)]
    return image_tags(obj_ids, tag_subwords, pad_id)


def region_counts(source: RegionSource, image_ids: list[str], max_regions: int) -> np.ndarray:
    """(N,) regions each image contributes (at most `max_regions`), read without loading features where
    the source can (a `RegionStore`'s `num_boxes`); used to group batches by length."""
    count = getattr(source, "num_boxes", None) or (lambda i: len(source.get(i).boxes))
    per_image = {i: min(count(i), max_regions) for i in set(image_ids)}
    return np.array([per_image[i] for i in image_ids], dtype=np.int64)


def length_keys(regions: Sequence[int] | np.ndarray, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """(N, 2) each example's (regions, tokens): the two axes a batch pads separately, in the order length
    grouping sorts by them (`data.sampling`)."""
    return np.stack([np.asarray(regions, dtype=np.int64), np.asarray(tokens, dtype=np.int64)], axis=1)


def length_order(items: Sequence[Any], regions: RegionSource, max_regions: int) -> np.ndarray:
    """Indices of `items` (each with `ids`, its token ids, and `image_id`) by token count, then region
    count (stable: ties keep the given order). Batches taken in this order hold examples of similar
    length, so little of what a forward pass computes is padding; the analyses' numbers do not depend
    on the order (tests/test_grounding_driver.py)."""
    if not items:
        return np.zeros(0, dtype=np.int64)
    n_regions = region_counts(regions, [it.image_id for it in items], max_regions)
    return np.lexsort((n_regions, [len(it.ids) for it in items]))


def pad_regions(items: list[Regions]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stack a batch of region sets, zero-padded to the largest: feats (B, R, D), boxes (B, R, 4), mask (B, R).
    The features are float16 when every set with regions holds float16 (`load_regions`), else float32."""
    B = len(items)
    R = max(len(r.feats) for r in items)
    D = items[0].feats.shape[1]
    half = all(r.feats.dtype == np.float16 for r in items if len(r.feats)) and R > 0
    feats = batch_tensor((B, R, D), torch.float16 if half else torch.float32)  # written once: only the padding is zeroed
    boxes = torch.zeros(B, R, 4)
    mask = torch.zeros(B, R, dtype=torch.bool)
    for i, r in enumerate(items):
        n = len(r.feats)
        feats[i, :n] = torch.from_numpy(r.feats)
        feats[i, n:] = 0.0
        boxes[i, :n] = torch.from_numpy(r.boxes)
        mask[i, :n] = True
    return feats, boxes, mask


def batch_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised tensor for a collated batch: in a DataLoader worker, allocated in shared memory, as
    `default_collate` does, so that sending it to the training process does not copy it once more (the
    region features are the batch's bulk: 64 x 36 x 2048 float32 = 19 MB)."""
    if get_worker_info() is None:
        return torch.empty(shape, dtype=dtype)
    numel = int(np.prod(shape))
    proto = torch.empty(0, dtype=dtype)
    return proto.new(proto._typed_storage()._new_shared(numel, device="cpu")).view(shape)


def pad_sequences(seqs: list[np.ndarray | list[int]], value: int) -> torch.Tensor:
    """Right-pad int sequences to (B, T)."""
    T = max(len(s) for s in seqs)
    out = torch.full((len(seqs), T), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.as_tensor(np.asarray(s, dtype=np.int64))
    return out


def caption_inputs(id_seqs: list[list[int]], regions: list[Regions], pad_id: int = 0) -> VLInputs:
    """One-segment inputs `[CLS] caption [SEP]` + regions for a batch (analyses, probes, inference)."""
    feats, boxes, rmask = pad_regions(regions)
    ids = pad_sequences(id_seqs, pad_id)  # (B, T)
    return VLInputs(
        input_ids=ids,
        token_type_ids=torch.zeros_like(ids),
        attention_mask=pad_sequences([[1] * len(s) for s in id_seqs], 0).bool(),
        region_feats=feats,
        region_boxes=boxes,
        region_mask=rmask,
    )
