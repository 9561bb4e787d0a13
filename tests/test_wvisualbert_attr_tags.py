"""W-VisualBERT's detector tags in pre-training (data/pretrain.py `_region_side`, reference §3.6): each box's tag
is its object class name or, drawn per box with p = `insert_attr_ratio` = 0.15, its attribute word. Counted
over many boxes from a small store whose class names and attribute words are all different, reading each
box's tag back from the example (a masked tag's label holds its subwords). The rate is what
`vlberts pretrain` configures (`recipes.pretrain.region_setup`); at rate 0 every tag is a class name, at
rate 1 every tag is the box's attribute, and a store without attributes gives class names at any rate."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vlberts.data.coco import CaptionRef
from vlberts.data.pretrain import CaptionPretrainData, RegionSetup
from vlberts.features.record import RegionRecord, StoreMetadata
from vlberts.features.store import RegionStore, write_store_records
from vlberts.objectives.recipe import RECIPES
from vlberts.recipes.pretrain import region_setup
from vlberts.text.masking import IGNORE_INDEX
from vlberts.text.tokenizer import TextTokenizer

CLASSES = ["dog", "cat", "car", "tree,bush", "table"]  # a vocabulary line's first synonym is the tag
ATTRIBUTES = ["red", "green", "wooden", "small,tiny"]
N_IMAGES, N_BOXES = 24, 10
EPOCHS = 16  # 24 images x 10 boxes x 16 epochs = 3,840 tags per rate


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A store of N_IMAGES images with N_BOXES boxes each, its captions, tokenizer and W-VisualBERT setup."""
    rng = np.random.default_rng(0)
    records = []
    for k in range(N_IMAGES):
        x1, y1 = rng.uniform(0, 50, (2, N_BOXES))
        boxes = np.stack([x1, y1, x1 + rng.uniform(5, 50, N_BOXES), y1 + rng.uniform(5, 50, N_BOXES)], axis=1)
        records.append(RegionRecord(
            str(k + 1), 100, 100, boxes, rng.normal(size=(N_BOXES, 6)).astype(np.float32),
            obj_id=rng.integers(0, len(CLASSES), N_BOXES), obj_conf=rng.uniform(0.3, 1.0, N_BOXES),
            attr_id=rng.integers(0, len(ATTRIBUTES), N_BOXES), attr_conf=rng.uniform(0.3, 1.0, N_BOXES)))
    path = tmp_path_factory.mktemp("tags") / "f.h5"
    write_store_records(path, records, metadata=StoreMetadata(classes=CLASSES, attributes=ATTRIBUTES))
    store = RegionStore(path).preload()
    caps = [CaptionRef(str(k + 1), f"a photo of thing number {k}") for k in range(N_IMAGES)]
    tok = TextTokenizer.train([c.text for c in caps] + CLASSES + ATTRIBUTES, vocab_size=150)
    recipe = RECIPES["wvisualbert"]
    setup = region_setup(recipe, dict(recipe.objectives), store, tok, with_tags=True)
    # Every class name and attribute word reads differently, so each box's tag says which it is.
    assert setup.tag_subwords is not None and setup.attr_subwords is not None
    assert len(set(setup.tag_subwords) | set(setup.attr_subwords)) == len(CLASSES) + len(ATTRIBUTES)
    return store, caps, tok, setup


def _tag_kinds(store, caps, tok, setup: RegionSetup, epochs: int = EPOCHS) -> tuple[np.ndarray, list[np.ndarray]]:
    """Per box of every example of `epochs` epochs: 1 if its tag is its attribute word, 0 if its class name
    (anything else fails); and the same per example."""
    data = CaptionPretrainData(caps, store, tok, pairs=False, seed=9, region_setup=setup)
    kinds, per_example = [], []
    for epoch in range(epochs):
        for i in range(len(data)):
            ex = data[(epoch, i)]
            rec = store.get(caps[i].image_id)
            labels, region = np.asarray(ex["tag_labels"]), np.asarray(ex["tag_region"])
            tags = np.where(labels != IGNORE_INDEX, labels, ex["tag_ids"])  # the tags before masking
            assert (np.diff(region) >= 0).all() and set(region.tolist()) == set(range(N_BOXES))
            row = []
            for j in range(N_BOXES):
                words = tuple(int(t) for t in tags[region == j])
                cls = setup.tag_subwords[rec.obj_id[j]]
                attr = None if setup.attr_subwords is None else setup.attr_subwords[rec.attr_id[j]]
                assert words in (cls, attr), (epoch, i, j, words, cls, attr)
                row.append(int(words == attr))
            kinds.extend(row)
            per_example.append(np.array(row))
    return np.array(kinds), per_example


def test_the_configured_rate_is_the_released_codes():
    assert RegionSetup().tag_attr_prob == 0.15


def test_a_box_is_tagged_with_its_attribute_at_the_configured_rate(world):
    store, caps, tok, setup = world
    assert setup.tag_attr_prob == 0.15  # as `vlberts pretrain` sets it up
    for p in (setup.tag_attr_prob, 0.4):
        kinds, per_example = _tag_kinds(store, caps, tok, dataclasses.replace(setup, tag_attr_prob=p))
        n = len(kinds)
        assert n == N_IMAGES * N_BOXES * EPOCHS
        share = kinds.mean()
        # Binomial(n, p): within 4.5 standard deviations (about 0.026 at p = 0.15).
        assert abs(share - p) < 4.5 * (p * (1 - p) / n) ** 0.5, (p, share, n)
        # Drawn per box, not per image: most examples mix attribute and class tags.
        mixed = sum(0 < r.sum() < N_BOXES for r in per_example)
        assert mixed > 0.7 * len(per_example), (p, mixed, len(per_example))


def test_rate_zero_gives_class_names_and_rate_one_attributes(world):
    store, caps, tok, setup = world
    kinds, _ = _tag_kinds(store, caps, tok, dataclasses.replace(setup, tag_attr_prob=0.0), epochs=3)
    assert len(kinds) and not kinds.any()
    kinds, _ = _tag_kinds(store, caps, tok, dataclasses.replace(setup, tag_attr_prob=1.0), epochs=3)
    assert len(kinds) and kinds.all()
    # A store without attribute names gives no attribute to use: class names at any rate.
    kinds, _ = _tag_kinds(store, caps, tok, dataclasses.replace(setup, tag_attr_prob=1.0, attr_subwords=None), epochs=3)
    assert len(kinds) and not kinds.any()
