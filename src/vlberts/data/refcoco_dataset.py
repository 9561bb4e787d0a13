"""RefCOCO+ expressions as model inputs: the expression, the candidate regions, a target per region.

Input (VL-BERT §4.2.3, Fig. 2c: <Query, Image>; ViLBERT §4 alike): ``[CLS] expression [SEP]`` as one
text segment, then the image's regions from the store (its first `max_regions`, the store's order).
The candidates are exactly those regions: the detector's boxes for the detected-region track, the
instance boxes for the ground-truth-region track (a store written by ``vlberts extract --boxes gold``).

Targets (`tasks.refcoco.region_targets`, ViLBERT §4 / VL-BERT §4.2.3): per region, 1 if its IoU with the
gold box is >= 0.5 else 0, or with `soft` the IoU itself above the threshold (ViLBERT's code). W-VisualBERT's
detector tags (§3.2) come along when `tag_subwords` is given (`data.vqa_dataset.detector_tag_subwords`).
With `flip_prob` a training item may be mirrored (VL-BERT's RefCOCO+ config, `data.mirror`): its boxes flipped
and "left" / "right" swapped in the expression; its targets stay (IoU does not change under the flip).

ViLBERT's code trains on more candidates than it evaluates on (its `refer_expression_dataset`: in the train
split the detected boxes and the image's ground-truth boxes, concatenated, at most `max_region_num` of them;
the other splits the detected ones alone): `DetectedThenGold` is that region source, read by `RefData` as
any other (`vlberts finetune refcoco --train_gt_features`).

Letters: B batch, T text length, R regions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vlberts.data.batch import Batch, TagInputs, VLInputs
from vlberts.data.mirror import Flip
from vlberts.data.refcoco import RefExpression
from vlberts.errors import VlbertsError
from vlberts.features.record import RegionRecord
from vlberts.data.regions import RegionSource, detected_classes, load_regions, length_keys, mirrored, pad_regions, pad_sequences, region_counts
from vlberts.models.wvisualbert import collate_tags, tag_tokens
from vlberts.tasks.refcoco import region_targets
from vlberts.text.tokenizer import TextTokenizer


class DetectedThenGold:
    """A region source whose record of an image is its regions in the `detected` store followed by those in the
    `gold` store (ViLBERT's RefCOCO+ training candidates, module docstring). `load_regions` keeps the first
    `max_regions` of the two together, as ViLBERT's cap does. A field one of the stores lacks (e.g. `obj_conf`)
    is left out of the record."""

    def __init__(self, detected: Any, gold: Any):
        self.detected, self.gold = detected, gold
        self.path = getattr(detected, "path", None)

    def __contains__(self, image_id: object) -> bool:
        return image_id in self.detected and image_id in self.gold

    def num_boxes(self, image_id: str | int) -> int:
        return self.detected.num_boxes(image_id) + self.gold.num_boxes(image_id)

    def get(self, image_id: str | int) -> RegionRecord:
        d, g = self.detected.get(str(image_id)), self.gold.get(str(image_id))
        if (d.image_w, d.image_h) != (g.image_w, g.image_h):
            raise VlbertsError(f"image {image_id} is {d.image_w}x{d.image_h} in the detected store ({self.path}) but "
                               f"{g.image_w}x{g.image_h} here: the two stores must come from the same images",
                               path=getattr(self.gold, "path", None), record=f"image {image_id}")

        def both(name: str) -> np.ndarray | None:
            a, b = getattr(d, name), getattr(g, name)
            if a is None or b is None or (a.ndim == 2 and a.shape[1] != b.shape[1]):
                return None
            return np.concatenate([a, b.astype(a.dtype, copy=False)])

        return RegionRecord(image_id=d.image_id, image_w=d.image_w, image_h=d.image_h, boxes=both("boxes"),
                            features=both("features"), cls_prob=both("cls_prob"), obj_id=both("obj_id"),
                            obj_conf=both("obj_conf"), attr_id=both("attr_id"), attr_conf=both("attr_conf"))


@dataclass
class RefBatch(Batch):
    """Expressions with their candidate regions and per-region targets."""

    inputs: VLInputs
    targets: Tensor  # (B, R) float in [0, 1], 0 on padding regions (masked out by inputs.region_mask)
    index: Tensor  # (B,) long, the expressions' positions in the dataset
    tags: TagInputs | None = None  # W-VisualBERT's detector tags of the regions (§3.2)


class RefData:
    """Indexable RefCOCO+ expressions (`RefExpression`s) over a region source."""

    def __init__(
        self,
        expressions: Sequence[RefExpression],
        regions: RegionSource,
        tokenizer: TextTokenizer,
        *,
        max_text_len: int = 24,
        max_regions: int = 36,
        feature_dim: int | None = None,
        soft: bool = False,
        tag_subwords: Sequence[Sequence[int]] | None = None,
        float16: bool = False,
        flip_prob: float = 0.0,
        seed: int = 0,
    ):
        self.expressions = expressions
        self.regions = regions
        self.tok = tokenizer
        self.max_regions = max_regions
        self.feature_dim = feature_dim
        self.float16 = float16
        self.soft = soft
        self.tag_subwords = tag_subwords
        budget = max_text_len - 2  # [CLS] ... [SEP]
        encs = tokenizer.tok.encode_batch([e.sent for e in expressions], add_special_tokens=False)
        self.ids = [[tokenizer.cls_id, *e.ids[:budget], tokenizer.sep_id] for e in encs]
        self.flip = Flip(flip_prob, seed, tokenizer)

    def __len__(self) -> int:
        return len(self.expressions)

    def lengths(self) -> np.ndarray:
        """(N, 2) each example's regions and tokens (`length_keys`), for length-grouped batches."""
        regions = region_counts(self.regions, [str(e.image_id) for e in self.expressions], self.max_regions)
        return length_keys(regions, [len(ids) for ids in self.ids])

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        index = key[1] if isinstance(key, tuple) else key
        ex = self.expressions[index]
        regions = load_regions(self.regions, ex.image_id, self.max_regions, self.feature_dim, self.float16)
        boxes = [tuple(b) for b in regions.pixel_boxes.tolist()]
        targets, ids = region_targets(boxes, ex.gold_box_xyxy, soft=self.soft), self.ids[index]
        if self.flip.drawn(key):  # the same targets: the gold box flips with the regions
            ids, regions = self.flip.swap(ids), mirrored(regions)
        item = {"ids": ids, "regions": regions, "targets": targets, "index": index}
        if self.tag_subwords is not None:
            obj_id = detected_classes(self.regions, ex.image_id)
            item["tags"] = tag_tokens(obj_id[: len(regions.feats)], self.tag_subwords)
        return item


def collate_refcoco(items: list[dict], pad_id: int = 0) -> RefBatch:
    ids = pad_sequences([e["ids"] for e in items], pad_id)  # (B, T)
    feats, boxes, rmask = pad_regions([e["regions"] for e in items])  # (B, R, D), (B, R, 4), (B, R)
    targets = torch.zeros(rmask.shape)  # (B, R)
    for b, e in enumerate(items):
        targets[b, : len(e["targets"])] = torch.tensor(e["targets"], dtype=torch.float32)
    return RefBatch(
        inputs=VLInputs(
            input_ids=ids,
            token_type_ids=torch.zeros_like(ids),  # one segment: the query (VL-BERT Fig. 2c)
            attention_mask=pad_sequences([[1] * len(e["ids"]) for e in items], 0).bool(),
            region_feats=feats,
            region_boxes=boxes,
            region_mask=rmask,
        ),
        targets=targets,
        index=torch.tensor([e["index"] for e in items], dtype=torch.long),
        tags=collate_tags([e["tags"] for e in items], pad_id) if "tags" in items[0] else None,
    )
