"""Image-text retrieval data (Flickr30K): captions and images of a Karpathy split, 4-way training groups,
and (caption, image) pairs for scoring the full matrix.

Reading. Flickr30K's released split file `dataset_flickr30k.json` is a Karpathy split file
(`data.coco.read_karpathy`; formats-and-metrics.md §2.1): images with a train/val/test split and five
sentences each; the image id is the file name without extension (cocoid where the file has one, as the
embedded world's `dataset_world.json`, which is read as it is). Images missing from the region store and
malformed records are errors, or with `--skip_bad` dropped and counted (`BadRecords`).

Training groups (ViLBERT §4: "we train in a 4-way multiple-choice setting ... for each image-caption
pair ... three distractors: a random caption, a random image, and a hard negative from among the 100
nearest neighbors of the target image"). For caption c of image I, group = four (caption, image) pairs:

    0  (c, I)        the positive
    1  (c', I)       c' a random caption of another image
    2  (c, I')       I' a random other image
    3  (c, I_hard)   I_hard drawn from the K nearest training images of I (never I itself)

Nearest neighbours are by a cheap image embedding, the mean of the image's region features (first
`max_regions`), L2-normalised, compared by cosine similarity (the paper does not say which embedding;
our choice). ViLBERT takes K = 100 of ~29,000 training images (0.3%); the embedded world has 800
training images, so the recipe's default K is 10 (1.25%): hard enough to share most of the image's
content, with enough of them to vary over epochs. The draws come from `example_rng(seed, epoch, index)`,
so a group is a pure function of (seed, epoch, caption) and a resumed run sees exactly the groups the
uninterrupted one saw, whatever the workers or ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlberts.data.batch import Batch, TagInputs, VLInputs
from vlberts.data.coco import read_karpathy
from vlberts.data.regions import Regions, RegionSource, detected_classes, load_regions, pad_regions, pad_sequences
from vlberts.data.sampling import example_rng
from vlberts.errors import BadRecords, VlbertsError
from vlberts.models.wvisualbert import collate_tags, tag_tokens
from vlberts.tasks.retrieval import caption_image_index
from vlberts.text.tokenizer import TextTokenizer

GROUP = 4  # pairs per training group (ViLBERT §4)
POSITIVE, RANDOM_CAPTION, RANDOM_IMAGE, HARD_IMAGE = range(GROUP)


@dataclass(frozen=True)
class RetrievalCaption:
    caption_id: int | str  # Karpathy sentid (its position in the split when the file has none)
    image_id: str  # canonical string id, the region store's key
    text: str


@dataclass(frozen=True)
class RetrievalSplit:
    """The captions and images of one split: images in file order, captions image by image."""

    captions: tuple[RetrievalCaption, ...]
    image_ids: tuple[str, ...]

    def caption_image(self) -> np.ndarray:
        """(C,) each caption's image column in a (captions, images) score matrix."""
        return caption_image_index([c.image_id for c in self.captions], self.image_ids)

    def first_images(self, n: int) -> RetrievalSplit:
        """The first n images (0: all) and their captions: a smaller evaluation."""
        if n <= 0 or n >= len(self.image_ids):
            return self
        keep = set(self.image_ids[:n])
        return RetrievalSplit(tuple(c for c in self.captions if c.image_id in keep), self.image_ids[:n])


def read_retrieval_split(
    path: str | Path, split: str, regions: RegionSource | None = None, bad: BadRecords | None = None,
    *, store_path: str | Path | None = None,
) -> RetrievalSplit:
    """One split of a Karpathy split file (restval joins train). Images without sentences, and with
    `regions` images missing from it, are errors naming the file and the image, or counted in `bad`."""
    bad = bad or BadRecords()
    data = read_karpathy(path, bad=bad)
    captions: list[RetrievalCaption] = []
    image_ids: list[str] = []
    sentid_image: dict[int, str] = {}  # sentid -> the image it was first seen in (the score index's caption ids)
    numbered: bool | None = None  # whether the split's sentences carry sentids (all or none: positions otherwise)
    for im in data.split(split):
        image_id = str(im.image_id)
        if not im.sentences:
            bad.handle(VlbertsError("image has no sentences", path=path, record=f"image {image_id}"))
            continue
        numbered = im.sentences[0].sentid is not None if numbered is None else numbered
        odd = next((k for k, s in enumerate(im.sentences) if (s.sentid is not None) != numbered), None)
        if odd is not None:  # a position standing in for a missing sentid could be another sentence's sentid
            bad.handle(VlbertsError(f"sentences[{odd}] {'lacks a' if numbered else 'has a'} sentid, where the split's "
                                    f"first sentence {'has one' if numbered else 'has none'}: all or none",
                                    path=path, record=f"image {image_id}"))
            continue
        if image_id in image_ids:
            bad.handle(VlbertsError("image listed twice", path=path, record=f"image {image_id}"))
            continue
        ids = [s.sentid for s in im.sentences if s.sentid is not None]
        dup = next((i for k, i in enumerate(ids) if i in sentid_image or i in ids[:k]), None)
        if dup is not None:
            where = f"also in image {sentid_image[dup]}" if dup in sentid_image else "twice in this image"
            bad.handle(VlbertsError(f"duplicate sentid {dup} ({where}); each sentence needs its own id", path=path,
                                    record=f"image {image_id}"))
            continue
        if regions is not None and image_id not in regions:
            bad.handle(VlbertsError(f"image {image_id} of {path} not in the region store",
                                    path=store_path or getattr(regions, "path", None), record=image_id),
                       "missing features")
            continue
        image_ids.append(image_id)
        sentid_image.update((i, image_id) for i in ids)
        for s in im.sentences:
            cid = s.sentid if s.sentid is not None else len(captions)
            captions.append(RetrievalCaption(cid, image_id, s.raw))
    return RetrievalSplit(tuple(captions), tuple(image_ids))


# --------------------------------------------------------------------------- hard negatives

def image_embeddings(regions: RegionSource, image_ids: Sequence[str], max_regions: int) -> np.ndarray:
    """(I, D) the mean of each image's first `max_regions` region features, L2-normalised."""
    out = []
    for image_id in image_ids:
        feats = np.asarray(regions.get(image_id).features[:max_regions], dtype=np.float32)  # (R, D)
        out.append(feats.mean(axis=0) if len(feats) else np.zeros(feats.shape[1], np.float32))
    emb = np.stack(out)
    return emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)


def nearest_neighbours(emb: np.ndarray, k: int, block: int = 1024) -> np.ndarray:
    """(I, k') for each image the k' = min(k, I - 1) most cosine-similar other images, most similar first
    (ties by index). emb (I, D) L2-normalised; computed in blocks of rows, so never an (I, I) matrix."""
    n = len(emb)
    k = min(k, n - 1)
    if k < 1:
        raise VlbertsError(f"hard negatives need at least 2 training images, got {n}")
    out = np.empty((n, k), dtype=np.int64)
    for start in range(0, n, block):
        sim = emb[start : start + block] @ emb.T  # (b, I)
        rows = np.arange(sim.shape[0])
        sim[rows, start + rows] = -np.inf  # never the image itself
        order = np.argsort(-sim, axis=1, kind="stable")[:, :k]  # (b, k)
        out[start : start + block] = order
    return out


# --------------------------------------------------------------------------- pairs as model inputs

def _caption(c: list[int], tok: TextTokenizer) -> tuple[list[int], list[int]]:
    return [tok.cls_id, *c, tok.sep_id], [0] * (len(c) + 2)


def _second_segment(c: list[int], tok: TextTokenizer) -> tuple[list[int], list[int]]:
    return [tok.cls_id, tok.sep_id, *c, tok.sep_id], [0, 0] + [1] * (len(c) + 1)


# name -> (special tokens the layout adds, layout); models.retrieval.TEXT_FORMATS says which model reads which
LAYOUTS = {"caption": (2, _caption), "second_segment": (3, _second_segment)}


@dataclass
class RetrievalBatch(Batch):
    """N (caption, image) pairs; in training N = 4 x groups, each group's four pairs contiguous, positive first."""

    inputs: VLInputs
    tags: TagInputs | None = None  # W-VisualBERT's detector tags of each pair's image

    @property
    def num_pairs(self) -> int:
        return self.inputs.batch_size


class PairEncoder:
    """Turns (caption, image) pairs into collatable items: captions tokenised once and laid out, an
    image's regions (and tags) loaded on request and cached when `cache` (evaluation reads each image
    once per caption)."""

    def __init__(
        self, texts: Sequence[str], regions: RegionSource, tok: TextTokenizer, *, text_format: str,
        max_text_len: int, max_regions: int, feature_dim: int | None = None,
        tag_subwords: Sequence[Sequence[int]] | None = None, cache: bool = False, float16: bool = False,
    ):
        if text_format not in LAYOUTS:
            raise ValueError(f"unknown text_format {text_format!r}; valid: {', '.join(LAYOUTS)}")
        specials, layout = LAYOUTS[text_format]
        budget = max_text_len - specials
        encs = tok.tok.encode_batch(list(texts), add_special_tokens=False) if texts else []
        self.text = [layout(e.ids[:budget], tok) for e in encs]  # (ids, segments) per caption
        self.regions, self.max_regions, self.feature_dim = regions, max_regions, feature_dim
        self.float16 = float16
        self.tag_subwords = tag_subwords
        self.pad_id = tok.pad_id
        self._cache: dict[str, dict] | None = {} if cache else None

    def image(self, image_id: str) -> dict:
        if self._cache is not None and image_id in self._cache:
            return self._cache[image_id]
        item: dict = {"regions": load_regions(self.regions, image_id, self.max_regions, self.feature_dim, self.float16)}
        if self.tag_subwords is not None:
            obj_id = detected_classes(self.regions, image_id)
            item["tags"] = tag_tokens(obj_id[: len(item["regions"].feats)], self.tag_subwords)
        if self._cache is not None:
            self._cache[image_id] = item
        return item

    def pair(self, caption: int, image_id: str) -> dict:
        ids, segments = self.text[caption]
        return {"ids": ids, "segments": segments, **self.image(image_id)}


def collate_pairs(pairs: list[dict], pad_id: int = 0) -> RetrievalBatch:
    """Pairs (`PairEncoder.pair`) -> a batch, in order."""
    ids = pad_sequences([p["ids"] for p in pairs], pad_id)  # (N, T)
    regions: list[Regions] = [p["regions"] for p in pairs]
    feats, boxes, rmask = pad_regions(regions)  # (N, R, D), (N, R, 4), (N, R)
    return RetrievalBatch(
        inputs=VLInputs(
            input_ids=ids,
            token_type_ids=pad_sequences([p["segments"] for p in pairs], 0),  # (N, T)
            attention_mask=pad_sequences([[1] * len(p["ids"]) for p in pairs], 0).bool(),
            region_feats=feats, region_boxes=boxes, region_mask=rmask,
        ),
        tags=collate_tags([p["tags"] for p in pairs], pad_id) if "tags" in pairs[0] else None,
    )


def collate_groups(groups: list[list[dict]], pad_id: int = 0) -> RetrievalBatch:
    """Training groups (each `GROUP` pairs) -> one batch of 4 x len(groups) pairs, groups contiguous."""
    return collate_pairs([p for g in groups for p in g], pad_id)


class RetrievalGroups:
    """Indexable 4-way training groups, one per training caption (module docstring); an item is a list of
    four pairs for `collate_groups`, keyed (epoch, caption index) by the loop's sampler."""

    def __init__(self, split: RetrievalSplit, encoder: PairEncoder, neighbours: np.ndarray, seed: int):
        if len(split.image_ids) < 2:
            raise VlbertsError(f"4-way training needs at least 2 training images, got {len(split.image_ids)}")
        if neighbours.shape[0] != len(split.image_ids):
            raise ValueError(f"{neighbours.shape[0]} neighbour rows for {len(split.image_ids)} images")
        self.split, self.encoder, self.neighbours, self.seed = split, encoder, neighbours, seed
        self.caption_image = split.caption_image()  # (C,)
        self.num_images = len(split.image_ids)

    def __len__(self) -> int:
        return len(self.split.captions)

    def group(self, epoch: int, index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(caption indices, image indices) of the four pairs of caption `index` in `epoch`."""
        rng = example_rng(self.seed, epoch, index)
        image = int(self.caption_image[index])
        while True:  # a caption of another image (one draw when most captions belong to other images)
            other_caption = int(rng.integers(len(self)))
            if self.caption_image[other_caption] != image:
                break
        k = int(rng.integers(self.num_images - 1))
        other_image = k + 1 if k >= image else k  # uniform over the other images
        hard = int(self.neighbours[image, rng.integers(self.neighbours.shape[1])])
        return (index, other_caption, index, index), (image, image, other_image, hard)

    def __getitem__(self, key: int | tuple[int, int]) -> list[dict]:
        epoch, index = key if isinstance(key, tuple) else (0, key)
        captions, images = self.group(epoch, index)
        return [self.encoder.pair(c, self.split.image_ids[i]) for c, i in zip(captions, images)]

    def lengths(self) -> np.ndarray:
        """(C,) text length of each group's positive pair (for length-grouped batches)."""
        return np.array([len(self.encoder.text[i][0]) for i in range(len(self))])
