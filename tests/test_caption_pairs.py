"""Which captions pre-training pairs (data/pretrain.py): VisualBERT's second caption is another caption of the
same image when the pair is labelled matching and a caption of another image otherwise (§3.3); ViLBERT's and
LXMERT's `mismatch_prob` replaces the one caption by another image's, and a kept caption is the regions' own.
The streamed path (data/pretrain_stream.py) builds its examples with the same `CaptionPretrainData` over a
chunk: its pairs obey the same rules, with the other image drawn from the chunk.

Every caption here is identifiable: image k's captions are "the <adjective k> <noun c>", so the token ids of
each text name one caption, and with `mlm_prob=0` nothing is masked, so the example's ids read back as the
captions chosen. Each image's region features are filled with its number, so the regions name their image."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from vlberts.data.coco import CaptionRef
from vlberts.data.pretrain import MATCH, MISMATCH, CaptionPretrainData
from vlberts.data.pretrain_stream import ShardCorpus, stream_examples
from vlberts.data.shards import write_shards
from vlberts.errors import VlbertsError
from vlberts.features.record import RegionRecord
from vlberts.features.store import write_store_records
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.distributed import DistInfo

ADJECTIVES = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white"]
NOUNS = ["dog", "cat", "horse", "bird"]
# Image 100 + k has CAPTIONS_PER_IMAGE[k] captions; the last image has a single caption, so its pairs can
# only be mismatched.
CAPTIONS_PER_IMAGE = [3, 4, 2, 3, 4, 3, 2, 1]
D = 4


def _captions() -> list[CaptionRef]:
    return [CaptionRef(str(100 + k), f"the {ADJECTIVES[k]} {NOUNS[c]}")
            for k, n in enumerate(CAPTIONS_PER_IMAGE) for c in range(n)]


def _record(image_id: str, n_boxes: int = 3) -> RegionRecord:
    k = int(image_id)
    boxes = np.array([[10.0 * j, 5.0, 10.0 * j + 20, 30.0] for j in range(n_boxes)], dtype=np.float32)
    return RegionRecord(image_id, 100, 80, boxes, np.full((n_boxes, D), float(k), dtype=np.float32))


class Regions:
    """An in-memory region source: each image's features hold its number."""

    def get(self, image_id: str) -> RegionRecord:
        return _record(image_id)


@pytest.fixture(scope="module")
def setting():
    caps = _captions()
    tok = TextTokenizer.train([c.text for c in caps], vocab_size=120)
    # Each caption's token ids (no specials) -> its index: every caption must be told apart.
    by_ids = {tuple(tok.encode(c.text)): i for i, c in enumerate(caps)}
    assert len(by_ids) == len(caps)
    return caps, tok, by_ids


def _strip(ids: np.ndarray, tok) -> tuple[int, ...]:
    return tuple(int(t) for t in ids if t not in (tok.cls_id, tok.sep_id))


def _pair(ex: dict, tok, by_ids) -> tuple[int, int]:
    """(caption a, caption b) of a VisualBERT pair example, as indices into the caption list."""
    ids, seg = np.asarray(ex["ids"]), np.asarray(ex["segments"])
    assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id and (seg[:-1] <= seg[1:]).all()
    return by_ids[_strip(ids[seg == 0], tok)], by_ids[_strip(ids[seg == 1], tok)]


def _regions_image(ex: dict) -> int:
    feats = ex["regions"].feats
    assert (feats == feats[0, 0]).all()
    return int(feats[0, 0])


def test_visualbert_pairs_match_with_another_caption_of_the_image_and_mismatch_with_another_images(setting):
    caps, tok, by_ids = setting
    data = CaptionPretrainData(caps, Regions(), tok, pairs=True, mlm_prob=0.0, max_text_len=40, seed=11)
    labels = Counter()
    seconds: dict[int, set[int]] = {i: set() for i in range(len(caps))}  # matched second captions seen per example
    other_images: set[str] = set()
    for epoch in range(12):
        for i in range(len(data)):
            ex = data[(epoch, i)]
            a, b = _pair(ex, tok, by_ids)
            image = caps[i].image_id
            assert a == i  # caption a is the example's own caption ...
            assert _regions_image(ex) == int(image) == ex["image_id"]  # ... and the regions are its image's
            labels[ex["match"]] += 1
            if ex["match"] == MATCH:
                # another caption of the same image, never the same caption twice
                assert caps[b].image_id == image and b != i, (epoch, i, caps[i], caps[b])
                seconds[i].add(b)
            else:
                assert ex["match"] == MISMATCH
                assert caps[b].image_id != image, (epoch, i, caps[i], caps[b])
                other_images.add(caps[b].image_id)
    n = sum(labels.values())
    assert abs(labels[MATCH] / n - 0.5) < 0.1, labels  # p = 0.5 (less: the one-caption image never matches)
    # The single caption of the last image has no second caption of its image: its pairs all mismatch.
    lone = len(caps) - 1
    assert CAPTIONS_PER_IMAGE[-1] == 1 and not seconds[lone]
    assert all(data[(e, lone)]["match"] == MISMATCH for e in range(12))
    # Matched second captions come from all the images' captions; mismatched ones from every image.
    assert {b for s in seconds.values() for b in s} == {i for i in range(len(caps)) if i != lone}
    assert other_images == {c.image_id for c in caps}


@pytest.mark.parametrize("prob", [0.5, 0.2])
def test_mismatched_caption_is_another_images_and_a_matched_one_the_regions_own(setting, prob):
    caps, tok, by_ids = setting
    data = CaptionPretrainData(caps, Regions(), tok, pairs=False, mismatch_prob=prob, mlm_prob=0.0, seed=4)
    labels = Counter()
    for epoch in range(12):
        for i in range(len(data)):
            ex = data[(epoch, i)]
            ids = np.asarray(ex["ids"])
            assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id and not np.asarray(ex["segments"]).any()
            j = by_ids[_strip(ids, tok)]
            regions_image = _regions_image(ex)
            assert regions_image == int(caps[i].image_id) == ex["image_id"]  # the regions stay the example's image
            labels[ex["match"]] += 1
            if ex["match"] == MATCH:
                assert j == i, (epoch, i, caps[i], caps[j])  # the image's own caption
            else:
                assert ex["match"] == MISMATCH
                assert int(caps[j].image_id) != regions_image, (epoch, i, caps[i], caps[j])
    n = sum(labels.values())
    assert abs(labels[MISMATCH] / n - prob) < 4 * (prob * (1 - prob) / n) ** 0.5, labels
    # Without mismatch_prob every caption is the image's own.
    plain = CaptionPretrainData(caps, Regions(), tok, pairs=False, mlm_prob=0.0, seed=4)
    assert all(by_ids[_strip(plain[(0, i)]["ids"], tok)] == i and plain[(0, i)]["match"] == MATCH
               for i in range(len(plain)))


def test_streamed_chunks_pair_captions_by_the_same_rules(setting, tmp_path):
    caps, tok, by_ids = setting
    store = write_store_records(tmp_path / "f.h5", [_record(str(100 + k)) for k in range(len(CAPTIONS_PER_IMAGE))])
    index = write_shards(store, caps, tmp_path / "shards", shard_size=3)
    chunks: list[set[str]] = []

    def make(pairs: bool):
        def make_data(chunk_captions, regions, seed):
            chunks.append({c.image_id for c in chunk_captions})
            return CaptionPretrainData(chunk_captions, regions, tok, pairs=pairs, mismatch_prob=0.0 if pairs else 0.5,
                                       mlm_prob=0.0, max_text_len=40, seed=seed)
        return make_data

    for pairs in (True, False):
        chunks.clear()
        stream = stream_examples(ShardCorpus(index), make(pairs), seed=3, chunk_images=4, dist=DistInfo(), buffer=4)
        labels = Counter()
        for ex, pos in (next(stream) for _ in range(120)):
            chunk = chunks[pos.chunk]
            image = str(ex["image_id"])
            assert _regions_image(ex) == int(image) and image in chunk
            if pairs:
                a, b = _pair(ex, tok, by_ids)
                assert caps[a].image_id == image  # caption a describes the regions' image
            else:
                a, b = None, by_ids[_strip(np.asarray(ex["ids"]), tok)]
            labels[ex["match"]] += 1
            if ex["match"] == MATCH:
                assert caps[b].image_id == image and b != a  # (a is None for one caption)
            else:
                assert ex["match"] == MISMATCH
                assert caps[b].image_id != image and caps[b].image_id in chunk  # another image of the chunk
        assert len(chunks) >= 2 and labels[MATCH] > 20 and labels[MISMATCH] > 20, (pairs, labels, len(chunks))


@pytest.mark.parametrize("replace", ["image", "either"])
def test_a_negative_replaces_the_image_or_either_as_asked(setting, replace):
    """ViLBERT §3.1: "we randomly replace either the image or caption with another". With
    mismatch_replace="image" a negative shows the example's own caption with another image's regions;
    with "either", half the negatives replace the image and half the caption; "caption" (the default,
    the released code) is the test above, its draws unchanged."""
    caps, tok, by_ids = setting
    data = CaptionPretrainData(caps, Regions(), tok, pairs=False, mismatch_prob=0.5, mismatch_replace=replace,
                               mlm_prob=0.0, seed=4)
    kinds = Counter()
    lengths = data.lengths(epoch=3)
    for epoch in range(12):
        for i in range(len(data)):
            ex = data[(epoch, i)]
            j = by_ids[_strip(np.asarray(ex["ids"]), tok)]
            shown = _regions_image(ex)
            assert shown == ex["image_id"]  # the batch records the image shown
            if epoch == 3:
                assert tuple(lengths[i]) == (len(ex["regions"].feats), len(ex["ids"]))
            if ex["match"] == MATCH:
                assert j == i and shown == int(caps[i].image_id)
                kinds["match"] += 1
            elif j == i:  # the caption kept, the image replaced
                assert shown != int(caps[i].image_id)
                kinds["image"] += 1
            else:  # the image kept, the caption replaced
                assert shown == int(caps[i].image_id) and caps[j].image_id != caps[i].image_id
                kinds["caption"] += 1
    negatives = kinds["image"] + kinds["caption"]
    if replace == "image":
        assert kinds["caption"] == 0 and kinds["image"] > 0
    else:
        assert abs(kinds["image"] / negatives - 0.5) < 4 * (0.25 / negatives) ** 0.5, kinds
    assert kinds["match"] > 0 and negatives > 0
    with pytest.raises(VlbertsError, match="unknown mismatch_replace 'pixels'; valid: caption, image, either"):
        CaptionPretrainData(caps, Regions(), tok, pairs=False, mismatch_prob=0.5, mismatch_replace="pixels")
    with pytest.raises(VlbertsError, match="caption pairs"):
        CaptionPretrainData(caps, Regions(), tok, pairs=True, mismatch_replace="image")
