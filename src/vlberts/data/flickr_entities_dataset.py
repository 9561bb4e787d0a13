"""Flickr30K Entities captions as model inputs: the caption, the image's regions, each phrase's position.

Input (VisualBERT App. B.4, BAN's setting): ``[CLS] caption [SEP]`` as one text segment, then the image's
regions from the store (its first `max_regions`, the store's order); the candidates of every phrase of the
caption are exactly those regions. One example is one caption, with all its grounded phrases.

Phrases (BAN/VisualBERT ``_load_flickr30k``, formats-and-metrics.md §2.7):
* phrases whose chain has no box (notvisual chain 0, scene-only, nobndbox) are skipped and counted;
* a phrase's position is its LAST word, and of that word its last subword (VisualBERT: "whichever box
  receives the most attention from the last sub-word of the phrase");
* its targets are the regions with IoU >= 0.5 to any gold box of the chain (`tasks.flickr_entities.
  positive_regions`; the union box with rule "union").
A phrase cut off by the text budget keeps position None: it cannot be predicted (counted wrong at
evaluation) and is not trained on. For training, `EntityData(train=True)` also leaves out phrases without
any positive region (no target to learn) and captions left without phrases.

Letters: B batch (captions), T text length, P phrases per caption, R regions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vlberts.data.batch import Batch, TagInputs, VLInputs
from vlberts.data.flickr_entities import Box, FlickrEntitiesImage, read_flickr_entities, read_flickr_split
from vlberts.data.regions import (
    RegionSource,
    caption_inputs,
    detected_classes,
    length_keys,
    load_regions,
    pad_sequences,
    region_counts,
)
from vlberts.errors import BadRecords, VlbertsError
from vlberts.models.wvisualbert import collate_tags, tag_tokens
from vlberts.tasks.flickr_entities import positive_regions, skip_reason
from vlberts.text.tokenizer import TextTokenizer


def read_split_images(
    entities: str | Path, split: str, store: Container[str], bad: BadRecords, *, max_images: int = 0
) -> list[FlickrEntitiesImage]:
    """The split's images (its first `max_images` if > 0) with their captions and boxes. An image missing
    from the store, whose Sentences/Annotations file is malformed, or whose Annotations `<size>` is not the
    store's image size (its gold boxes and the store's regions would be compared in two frames: features
    extracted from resized images) is an error naming it, or with `bad` skipping (--skip_bad) is dropped and
    counted ("missing features", "malformed entities file", "image size differs"). Sizes within a pixel agree
    (a store may have recovered its sizes from boxes). The store is checked first, so a split the store does
    not cover fails before any file is parsed."""
    ids = read_flickr_split(entities, split)
    if max_images:
        ids = ids[:max_images]
    missing = {i for i in ids if i not in store}
    images = []
    for image_id in ids:
        if image_id in missing:
            bad.handle(VlbertsError(f"image id {image_id} of split {split} not in store ({len(missing)} of the "
                                    f"{len(ids)} images missing)", path=getattr(store, "path", ""),
                                    record=image_id),
                       "missing features")
            continue
        try:
            image = read_flickr_entities(entities, image_id)
        except VlbertsError as err:
            bad.handle(err, "malformed entities file")
            continue
        stored = store.image_size(image_id) if hasattr(store, "image_size") else None
        if stored and (abs(stored[0] - image.width) > 1 or abs(stored[1] - image.height) > 1):
            bad.handle(VlbertsError(
                f"the store's image is {stored[0]}x{stored[1]} but Annotations/{image_id}.xml gives <size> "
                f"{image.width}x{image.height}: its gold boxes and the store's regions are in different frames "
                "(features of resized images?)", path=getattr(store, "path", ""), record=f"image {image_id}"),
                "image size differs")
            continue
        images.append(image)
    return images


@dataclass(frozen=True)
class EntityPhrase:
    """One phrase with gold boxes: what names it, its gold boxes, and where the model reads it."""

    chain_id: int
    first_word_index: int
    text: str
    gold_boxes: tuple[Box, ...]  # xyxy pixels, at least one
    position: int | None  # index in the caption's ids of its last word's last subword; None if cut off


@dataclass(frozen=True)
class PhraseCaption:
    """One caption of an image: `[CLS] words [SEP]` ids and its phrases with gold boxes."""

    image_id: str
    sentence: int  # the caption's index in Sentences/<image id>.txt
    ids: tuple[int, ...]
    phrases: tuple[EntityPhrase, ...]


def phrase_captions(
    images: Iterable[FlickrEntitiesImage], tok: TextTokenizer, max_text_len: int, skipped: Counter | None = None
) -> list[PhraseCaption]:
    """Tokenise every caption keeping each word's subwords and attach its phrases that have gold boxes;
    the others are counted in `skipped` by reason (notvisual, scene, no box). Captions without such a
    phrase are left out. Captions longer than `max_text_len` subwords (with [CLS]/[SEP]) are cut at the
    end; a phrase whose last subword is cut gets position None (counted as "truncated")."""
    skipped = skipped if skipped is not None else Counter()
    keep = max_text_len - 2
    out = []
    for im in images:
        for cap in im.captions:
            enc = tok.encode_words(list(cap.words))
            phrases = []
            for gp in cap.phrases:
                p = gp.phrase
                reason = skip_reason(gp)
                if reason is not None:
                    skipped[reason] += 1
                    continue
                last = enc.word_tokens[p.last_word_index]
                position = last[-1] + 1 if last and last[-1] < keep else None  # +1 for [CLS]
                if position is None:
                    skipped["truncated"] += 1
                phrases.append(EntityPhrase(p.chain_id, p.first_word_index, p.text, gp.boxes, position))
            if phrases:
                ids = (tok.cls_id, *enc.ids[:keep], tok.sep_id)
                out.append(PhraseCaption(cap.image_id, cap.index, ids, tuple(phrases)))
    return out


@dataclass
class EntityBatch(Batch):
    """Captions with their regions, the positions of their phrases and each phrase's target regions."""

    inputs: VLInputs
    positions: Tensor  # (B, P) long index into the text; 0 on padding phrases (masked by phrase_mask)
    phrase_mask: Tensor  # (B, P) bool, True for the phrases to score (train: with a positive region)
    targets: Tensor  # (B, P, R) float, 1 on positive regions, 0 elsewhere and on padding
    index: Tensor  # (B,) long, the captions' positions in the dataset
    tags: TagInputs | None = None  # W-VisualBERT's detector tags of the regions (§3.2)


class EntityData:
    """Indexable `PhraseCaption`s over a region source. Item k: the caption's ids, its regions, and per
    scored phrase its position and positive-region flags (`phrases[k]` lists which phrases those are)."""

    def __init__(
        self,
        captions: Sequence[PhraseCaption],
        regions: RegionSource,
        *,
        max_regions: int = 36,
        feature_dim: int | None = None,
        rule: str = "any",
        train: bool = False,
        tag_subwords: Sequence[Sequence[int]] | None = None,
        float16: bool = False,
    ):
        self.regions = regions
        self.max_regions = max_regions
        self.feature_dim = feature_dim
        self.float16 = float16
        self.rule = rule
        self.tag_subwords = tag_subwords
        boxes: dict[str, list[Box]] = {}
        kept_captions, kept_phrases, self.positives = [], [], []
        self.source: list[int] = []  # per kept caption: its position in `captions`
        for k, cap in enumerate(captions):
            if cap.image_id not in boxes:
                boxes[cap.image_id] = [tuple(b) for b in regions.get(cap.image_id).boxes[:max_regions].tolist()]
            chosen, flags = [], []
            for j, p in enumerate(cap.phrases):
                if p.position is None:
                    continue
                pos = positive_regions(boxes[cap.image_id], p.gold_boxes, rule)
                if train and not any(pos):  # no target to learn from (VisualBERT/BAN train on matched phrases)
                    continue
                chosen.append(j)
                flags.append(pos)
            if chosen:
                self.source.append(k)
                kept_captions.append(cap)
                kept_phrases.append(chosen)
                self.positives.append(flags)
        self.captions = kept_captions
        self.phrases = kept_phrases  # per kept caption: indices into its `phrases` that are scored

    def __len__(self) -> int:
        return len(self.captions)

    def lengths(self) -> np.ndarray:
        """(N, 2) each example's regions and tokens (`length_keys`), for length-grouped batches."""
        regions = region_counts(self.regions, [c.image_id for c in self.captions], self.max_regions)
        return length_keys(regions, [len(c.ids) for c in self.captions])

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        index = key[1] if isinstance(key, tuple) else key
        cap = self.captions[index]
        regions = load_regions(self.regions, cap.image_id, self.max_regions, self.feature_dim, self.float16)
        item = {
            "ids": list(cap.ids),
            "regions": regions,
            "positions": [cap.phrases[j].position for j in self.phrases[index]],
            "targets": self.positives[index],
            "index": index,
        }
        if self.tag_subwords is not None:
            obj_id = detected_classes(self.regions, cap.image_id)
            item["tags"] = tag_tokens(obj_id[: len(regions.feats)], self.tag_subwords)
        return item


def collate_entities(items: list[dict], pad_id: int = 0) -> EntityBatch:
    inputs = caption_inputs([e["ids"] for e in items], [e["regions"] for e in items], pad_id)  # one segment
    B, R = inputs.region_mask.shape
    P = max(len(e["positions"]) for e in items)
    positions = pad_sequences([e["positions"] for e in items], 0)  # (B, P)
    phrase_mask = pad_sequences([[1] * len(e["positions"]) for e in items], 0).bool()  # (B, P)
    targets = torch.zeros(B, P, R)  # (B, P, R)
    for b, e in enumerate(items):
        for j, flags in enumerate(e["targets"]):
            targets[b, j, : len(flags)] = torch.tensor(flags, dtype=torch.float32)
    return EntityBatch(
        inputs=inputs,
        positions=positions,
        phrase_mask=phrase_mask,
        targets=targets,
        index=torch.tensor([e["index"] for e in items], dtype=torch.long),
        tags=collate_tags([e["tags"] for e in items], pad_id) if "tags" in items[0] else None,
    )
