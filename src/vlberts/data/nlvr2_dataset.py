"""NLVR2 examples as model inputs: the statement with the regions of its two images, in one of two layouts.

  pair   (LXMERT §4.2 and App. B) the statement is encoded twice, once with each image: a batch of B
         examples is 2B encoder rows, row 2i = (statement i, left image), row 2i + 1 = (statement i, right
         image), so that the encoder runs once and the pooled outputs reshape to (B, 2, D).
  joint  (VisualBERT App. B.3) one sequence per example: the statement, then the left image's regions, then
         the right image's, with "features from different images [assigned] different segment embeddings":
         `region_type_ids` 0 for the left image's regions and 1 for the right's (the released loader's
         `visual_embeddings_type`, formats-and-metrics.md §1.5).

Text is `[CLS] statement [SEP]`, one segment, cut to `max_text_len` (keeping the start). Each image brings
its first `max_regions` regions. W-VisualBERT's detector tags (§3.2) come along per encoder row when
`tag_subwords` is given (pair layout only: no architecture reading tags has a joint layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from vlberts.data.batch import Batch, TagInputs, VLInputs
from vlberts.data.nlvr2 import NLVR2Example
from vlberts.data.regions import (
    Regions,
    RegionSource,
    detected_classes,
    length_keys,
    load_regions,
    pad_regions,
    pad_sequences,
    region_counts,
)
from vlberts.models.wvisualbert import collate_tags, tag_tokens
from vlberts.text.tokenizer import TextTokenizer

ENCODINGS = ("pair", "joint")
IGNORE_LABEL = -100  # label of an unlabelled example (cross-entropy's ignore index)


@dataclass
class NLVR2Batch(Batch):
    """B examples; `inputs` has 2B rows in the pair layout and B in the joint one (module docstring)."""

    inputs: VLInputs
    labels: Tensor  # (B,) long: 1 = "True", 0 = "False", -100 = no label
    index: Tensor  # (B,) long, the examples' positions in the dataset
    tags: TagInputs | None = None  # W-VisualBERT's detector tags, one row per encoder row

    @property
    def size(self) -> int:
        return len(self.labels)


class NLVR2Data:
    """Indexable NLVR2 examples. `images[i]` are the region-store ids of example i's left and right image
    (its NLVR2 image names, or what an image map turned them into)."""

    def __init__(
        self,
        examples: Sequence[NLVR2Example],
        images: Sequence[tuple[str, str]],
        regions: RegionSource,
        tokenizer: TextTokenizer,
        *,
        encoding: str = "pair",
        max_text_len: int = 40,
        max_regions: int = 36,
        feature_dim: int | None = None,
        tag_subwords: Sequence[Sequence[int]] | None = None,
        float16: bool = False,
    ):
        if encoding not in ENCODINGS:
            raise ValueError(f"unknown encoding {encoding!r}; valid: {', '.join(ENCODINGS)}")
        if encoding == "joint" and tag_subwords is not None:
            raise ValueError("detector tags are only laid out for the pair encoding")
        if len(images) != len(examples):
            raise ValueError("one (left, right) image pair per example")
        self.examples, self.images, self.regions, self.tok = examples, images, regions, tokenizer
        self.encoding, self.max_regions, self.feature_dim, self.tag_subwords = encoding, max_regions, feature_dim, tag_subwords
        self.float16 = float16
        budget = max_text_len - 2
        encs = tokenizer.tok.encode_batch([e.sentence for e in examples], add_special_tokens=False)
        self.ids = [[tokenizer.cls_id, *e.ids[:budget], tokenizer.sep_id] for e in encs]

    def __len__(self) -> int:
        return len(self.examples)

    def lengths(self) -> np.ndarray:
        """(N, 2) each example's regions and tokens (`length_keys`), for length-grouped batches: with the
        joint encoding both images' regions, with the pair encoding the larger image's."""
        left = region_counts(self.regions, [a for a, _ in self.images], self.max_regions)
        right = region_counts(self.regions, [b for _, b in self.images], self.max_regions)
        regions = left + right if self.encoding == "joint" else np.maximum(left, right)
        return length_keys(regions, [len(ids) for ids in self.ids])

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        index = key[1] if isinstance(key, tuple) else key
        label = self.examples[index].label
        item = {
            "ids": self.ids[index],
            "label": IGNORE_LABEL if label is None else int(label),
            "index": index,
            "images": [load_regions(self.regions, i, self.max_regions, self.feature_dim, self.float16)
                       for i in self.images[index]],
            "joint": self.encoding == "joint",
        }
        if self.tag_subwords is not None:
            item["tags"] = [self._tags(i, len(r.feats)) for i, r in zip(self.images[index], item["images"])]
        return item

    def _tags(self, image_id: str, n: int) -> tuple[list[int], list[int]]:
        """The detector tags of the image's first n regions: (subword ids, region of each subword)."""
        return tag_tokens(detected_classes(self.regions, image_id)[:n], self.tag_subwords)


def _joined(left: Regions, right: Regions) -> Regions:
    """Both images' regions as one set, left first (the joint layout)."""
    conf = None if left.conf is None or right.conf is None else np.concatenate([left.conf, right.conf])
    return Regions(feats=np.concatenate([left.feats, right.feats]), boxes=np.concatenate([left.boxes, right.boxes]),
                   pixel_boxes=np.concatenate([left.pixel_boxes, right.pixel_boxes]), conf=conf)


def collate_nlvr2(items: list[dict], pad_id: int = 0) -> NLVR2Batch:
    """A batch in the layout the items were made for (`NLVR2Data.encoding`)."""
    joint = items[0]["joint"]
    if joint:
        ids = [it["ids"] for it in items]
        regions = [_joined(*it["images"]) for it in items]
        # VisualBERT App. B.3: segment 0 for the left image's regions, 1 for the right's.
        types = [[0] * len(it["images"][0].feats) + [1] * len(it["images"][1].feats) for it in items]
    else:  # rows 2i, 2i + 1: the statement with the left, then the right image (LXMERT App. B)
        ids = [it["ids"] for it in items for _ in range(2)]
        regions = [r for it in items for r in it["images"]]
        types = None
    feats, boxes, rmask = pad_regions(regions)  # (B', R, D), (B', R, 4), (B', R)
    input_ids = pad_sequences(ids, pad_id)  # (B', T)
    return NLVR2Batch(
        inputs=VLInputs(
            input_ids=input_ids,
            token_type_ids=torch.zeros_like(input_ids),
            attention_mask=pad_sequences([[1] * len(s) for s in ids], 0).bool(),
            region_feats=feats,
            region_boxes=boxes,
            region_mask=rmask,
            region_type_ids=None if types is None else pad_sequences(types, 0),  # (B, R); padding is masked
        ),
        labels=torch.tensor([it["label"] for it in items], dtype=torch.long),
        index=torch.tensor([it["index"] for it in items], dtype=torch.long),
        tags=collate_tags([t for it in items for t in it["tags"]], pad_id) if "tags" in items[0] else None,
    )
