"""Caption data for VisualBERT pre-training (App. A.3; reference §3.2).

Task-agnostic pre-training shows the model two captions, `[CLS] a [SEP] b [SEP]` with segments 0/1,
plus the image's regions. Caption a describes the image; with p = 0.5 caption b is another caption of
the same image, otherwise a caption of a different image. Labels follow BERT's NSP convention:
0 = b matches the image, 1 = b is random. Both captions are masked for MLM; regions never are.
Task-specific pre-training (`pairs=False`) shows one caption and trains MLM only.
"""

from __future__ import annotations

import numpy as np
import torch

from vlberts.data.batch import PretrainBatch, VLInputs
from vlberts.data.coco import CaptionRef
from vlberts.data.regions import RegionSource, Regions, load_regions, pad_regions, pad_sequences
from vlberts.data.sampling import example_rng
from vlberts.text.masking import IGNORE_INDEX, mask_tokens
from vlberts.text.tokenizer import TextTokenizer

MATCH, MISMATCH = 0, 1


def truncate_front(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Drop tokens from the front of the longer caption until both fit (VisualBERT trims from the front)."""
    a, b = list(a), list(b)
    while len(a) + len(b) > budget:
        if len(a) >= len(b):
            a.pop(0)
        else:
            b.pop(0)
    return a, b


class CaptionPretrainData:
    """Pre-training examples keyed by (epoch, index); everything random derives from (seed, epoch, index)."""

    def __init__(
        self,
        captions: list[CaptionRef],
        regions: RegionSource,
        tokenizer: TextTokenizer,
        *,
        pairs: bool = True,
        max_text_len: int = 48,
        max_regions: int = 36,
        mlm_prob: float = 0.15,
        seed: int = 0,
        feature_dim: int | None = None,
        focus_ids: frozenset[int] = frozenset(),
        focus_prob: float | None = None,
    ):
        if not captions:
            raise ValueError("no captions to pre-train on")
        self.captions = captions
        self.regions = regions
        self.tok = tokenizer
        self.pairs = pairs
        self.max_text_len = max_text_len
        self.max_regions = max_regions
        self.mlm_prob = mlm_prob
        self.seed = seed
        self.feature_dim = feature_dim
        self.focus_ids = focus_ids
        self.focus_prob = focus_prob
        # Tokenise once; examples only index into these.
        self.ids = [e.ids for e in tokenizer.tok.encode_batch([c.text for c in captions], add_special_tokens=False)]
        self.by_image: dict[str, list[int]] = {}
        for i, c in enumerate(captions):
            self.by_image.setdefault(c.image_id, []).append(i)
        if pairs and len(self.by_image) < 2:
            raise ValueError("sentence-image prediction needs captions of at least two images")

    def __len__(self) -> int:
        return len(self.captions)

    def _second_caption(self, index: int, rng: np.random.Generator) -> tuple[int, int]:
        image = self.captions[index].image_id
        same = [j for j in self.by_image[image] if j != index]
        if same and rng.random() < 0.5:
            return int(same[rng.integers(len(same))]), MATCH
        while True:  # a caption of another image
            j = int(rng.integers(len(self.captions)))
            if self.captions[j].image_id != image:
                return j, MISMATCH

    def __getitem__(self, key: tuple[int, int]) -> dict:
        epoch, index = key
        rng = example_rng(self.seed, epoch, index)
        cap = self.captions[index]
        tok = self.tok
        if self.pairs:
            j, label = self._second_caption(index, rng)
            a, b = truncate_front(self.ids[index], self.ids[j], self.max_text_len - 3)
            ids = [tok.cls_id, *a, tok.sep_id, *b, tok.sep_id]
            segments = [0] * (len(a) + 2) + [1] * (len(b) + 1)
        else:
            label = MATCH
            a, _ = truncate_front(self.ids[index], [], self.max_text_len - 2)
            ids = [tok.cls_id, *a, tok.sep_id]
            segments = [0] * len(ids)
        masked, labels = mask_tokens(
            ids, rng, mask_id=tok.mask_id, vocab_size=tok.vocab_size, special_ids=tok.special_ids, prob=self.mlm_prob,
            focus_ids=self.focus_ids, focus_prob=self.focus_prob,
        )
        regions = load_regions(self.regions, cap.image_id, self.max_regions, self.feature_dim)
        return {
            "ids": masked,
            "segments": np.asarray(segments),
            "labels": labels,
            "match": label,
            "regions": regions,
            "image_id": int(cap.image_id) if cap.image_id.isdigit() else index,
        }


def collate_pretrain(examples: list[dict], pad_id: int = 0) -> PretrainBatch:
    ids = pad_sequences([e["ids"] for e in examples], pad_id)  # (B, T)
    regions: list[Regions] = [e["regions"] for e in examples]
    feats, boxes, rmask = pad_regions(regions)
    inputs = VLInputs(
        input_ids=ids,
        token_type_ids=pad_sequences([e["segments"] for e in examples], 0),
        attention_mask=pad_sequences([np.ones(len(e["ids"]), dtype=np.int64) for e in examples], 0).bool(),
        region_feats=feats,
        region_boxes=boxes,
        region_mask=rmask,
    )
    return PretrainBatch(
        inputs=inputs,
        mlm_labels=pad_sequences([e["labels"] for e in examples], IGNORE_INDEX),
        match_labels=torch.tensor([e["match"] for e in examples], dtype=torch.long),
        image_ids=torch.tensor([e["image_id"] for e in examples], dtype=torch.long),
    )
