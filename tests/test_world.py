"""The embedded world: determinism, truth of every caption and question, parses, scene statistics.

The checks re-derive truth from the boxes with their own code (margins as documented in
`vlberts.world.relations`), reading the words of captions and questions, not the generator's plans.
"""

from __future__ import annotations

import filecmp
import itertools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vlberts.errors import VlbertsError
from vlberts.world.build import WorldConfig, assign_splits, build_world, make_image, split_sizes
from vlberts.world.grammar import STANFORD_TABLE2, is_tree
from vlberts.world.scene import WorldObject
from vlberts.world.vocab import COLOURS, NUMBER_WORDS, SHAPE_PLURALS, SHAPES, SIZES

SEED = 11
N_MEMORY = 300  # images generated in memory for the statistical checks
SINGULAR = {**{s: s for s in SHAPES}, **{p: s for s, p in SHAPE_PLURALS.items()}}
MARGIN, NEAR = 3, 12.8  # 2% and 10% of 128 pixels


@pytest.fixture(scope="module")
def images():
    cfg = WorldConfig()
    return [make_image(i, SEED, cfg) for i in range(1, N_MEMORY + 1)]


# --------------------------------------------------------------------------- independent truth

def described(words, objects: list[WorldObject]) -> set[int]:
    """Objects matching every colour, size and shape word of a phrase."""
    colours = [w for w in words if w in COLOURS]
    sizes = [w for w in words if w in SIZES]
    shapes = [SINGULAR[w] for w in words if w in SINGULAR]
    assert len(colours) <= 1 and len(sizes) <= 1 and len(shapes) <= 1, words
    return {
        o.object_id for o in objects
        if (not colours or o.colour == colours[0]) and (not sizes or o.size == sizes[0])
        and (not shapes or o.shape == shapes[0])
    }


def holds(rel: str, a: WorldObject, b: WorldObject, touching: set) -> bool:
    (ax1, ay1, ax2, ay2), (bx1, by1, bx2, by2) = a.box, b.box
    dx = max(0, bx1 - ax2, ax1 - bx2)
    dy = max(0, by1 - ay2, ay1 - by2)
    near = (dx * dx + dy * dy) ** 0.5 <= NEAR
    pair = (min(a.object_id, b.object_id), max(a.object_id, b.object_id))
    return {
        "left": ax2 + MARGIN <= bx1, "right": bx2 + MARGIN <= ax1,
        "above": ay2 + MARGIN <= by1, "below": by2 + MARGIN <= ay1,
        "near": near,
        "next": near and min(ay2, by2) - max(ay1, by1) >= 0.5 * min(ay2 - ay1, by2 - by1),
        "touch": pair in touching and dx == 0 and dy == 0,
        "cover": pair in touching and a.object_id > b.object_id,
    }[rel]


CUES = {"above": "above", "below": "below", "near": "near", "left": "left", "right": "right", "next": "next",
        "touching": "touch", "overlapping": "touch", "touches": "touch", "overlaps": "touch",
        "covering": "cover", "covers": "cover"}


def check_caption(cap, scene) -> None:
    objs = {o.object_id: o for o in scene.objects}
    words = cap.words
    ents = [e for e in cap.entities if e.type == "other"]
    assert ents, cap.text
    for e in ents:  # the phrase picks out exactly its objects; a number word is their count
        ew = words[e.start:e.end]
        assert described(ew, list(objs.values())) == set(e.object_ids), (cap.text, e)
        nums = [w for w in ew if w in NUMBER_WORDS]
        assert (NUMBER_WORDS.index(nums[0]) if nums else 1) == len(e.object_ids), (cap.text, e)
    if cap.template == "copula":  # "the large circle is red ." / "the red object is a star ."
        (obj,) = [objs[i] for i in ents[0].object_ids]
        pred = [t.form for t in cap.tokens[ents[0].end + 1:] if t.upos in ("ADJ", "NOUN")]
        assert pred and all(w in (obj.colour, obj.size, obj.shape) for w in pred), cap.text
    touching = {tuple(p) for p in scene.touching}
    for i, w in enumerate(words):
        if w not in CUES or (w in ("left", "right") and cap.tokens[i].deprel not in ("advmod", "pobj")):
            continue
        if "each" in words:  # "A and B are near each other"
            a, b = ents[0], ents[1]
        else:
            a, b = ents[0], next(e for e in ents if e.start > i)
        for x, y in itertools.product(a.object_ids, b.object_ids):
            assert holds(CUES[w], objs[x], objs[y], touching), (cap.text, w, objs[x].box, objs[y].box)


def test_every_caption_is_true_and_refers_uniquely(images):
    for im in images:
        assert len(im.captions) == 5
        for cap in im.captions:
            check_caption(cap, im.scene)


def test_entities_chains_and_types(images):
    for im in images:
        chain_objects: dict[int, tuple] = {}
        for cap in im.captions:
            for e in cap.entities:
                if e.type == "notvisual":
                    assert e.chain_id == 0 and e.object_ids == ()
                    continue
                assert e.chain_id // 100 == im.scene.image_id
                if e.type == "scene":
                    assert e.chain_id % 100 == 10 and e.object_ids == ()
                # the same objects, in any caption of the image, share one chain id (and vice versa)
                assert chain_objects.setdefault(e.chain_id, e.object_ids) == e.object_ids
        assert len(set(chain_objects.values())) == len(chain_objects)
    types = Counter(e.type for im in images for c in im.captions for e in c.entities)
    assert types["scene"] > 0 and types["notvisual"] > 0 and types["other"] > 10 * types["scene"]


def test_parses_are_trees_with_all_table2_relations(images):
    caps = [c for im in images for c in im.captions]
    seen = Counter()
    for c in caps:
        assert is_tree([t.head for t in c.tokens]), c.text
        assert c.text == " ".join(c.words) and c.words[-1] == "." and c.text == c.text.lower()
        seen.update({t.deprel for t in c.tokens})
    for rel in STANFORD_TABLE2:  # each of the paper's ten relations occurs often, not just once
        assert seen[rel] >= 0.05 * len(caps), (rel, seen[rel])
    assert {"root", "cop", "expl", "aux", "advmod", "cc", "conj"} <= set(seen)


def test_captions_of_one_image_vary(images):
    overlaps = []
    for im in images:
        texts = [c.text for c in im.captions]
        assert len(set(texts)) == len(texts)
        for a, b in itertools.combinations(im.captions, 2):
            wa, wb = set(a.words), set(b.words)
            overlaps.append(len(wa & wb) / len(wa | wb))
        assert len({c.template for c in im.captions}) >= 3
    assert np.mean(overlaps) < 0.4


def test_scene_statistics(images):
    scenes = [im.scene for im in images]
    shape_pair = colour_pair = 0
    for s in scenes:
        assert 3 <= len(s.objects) <= 6
        objs = s.objects
        shape_pair += any(a.shape == b.shape and a.colour != b.colour for a, b in itertools.combinations(objs, 2))
        colour_pair += any(a.colour == b.colour and a.shape != b.shape for a, b in itertools.combinations(objs, 2))
        for o in objs:
            x1, y1, x2, y2 = o.box
            assert 0 <= x1 < x2 <= 128 and 0 <= y1 < y2 <= 128
            side = max(x2 - x1, y2 - y1)
            assert (12 <= side <= 22) if o.size == "small" else (25 <= side <= 40), o  # sizes never overlap
            assert o.visible >= 0.65
        by_id = {o.object_id: o for o in objs}
        assert all(by_id[i].colour != by_id[j].colour for i, j in s.touching)  # no two-shape blobs
    assert shape_pair / len(scenes) > 0.65 and colour_pair / len(scenes) > 0.65
    assert len({o.shape for s in scenes for o in s.objects}) == 7
    assert len({o.colour for s in scenes for o in s.objects}) == 8


def test_pixels_show_the_objects_on_a_grey_or_brown_background(images):
    for im in images[:60]:
        px = im.pixels.astype(int)
        assert px.shape == (128, 128, 3) and im.pixels.dtype == np.uint8
        free = np.ones((128, 128), dtype=bool)
        for k, o in enumerate(im.scene.objects):
            x1, y1, x2, y2 = o.box
            free[y1:y2, x1:x2] = False
            cx, cy = (x1 + x2) // 2, (y1 + y2) // 2
            covered = any(p.box[0] <= cx < p.box[2] and p.box[1] <= cy < p.box[3] for p in im.scene.objects[k + 1:])
            if o.shape in ("circle", "square", "diamond", "hexagon") and not covered:
                centre = px[cy - 1:cy + 2, cx - 1:cx + 2].reshape(-1, 3).mean(0)
                assert np.abs(centre - np.array(COLOURS[o.colour])).max() < 30, (o, centre)
        bg = px[free]
        assert np.median(bg.max(1) - bg.min(1)) < 30  # low saturation: never an object colour


# --------------------------------------------------------------------------- questions

def _objects_of(phrase: str, objs) -> set[int]:
    return described(phrase.split(), objs)


def check_question(q, scene) -> None:
    objs = list(scene.objects)
    by_id = {o.object_id: o for o in objs}
    text = q.question
    assert text.endswith("?") and text[0].isupper()
    body = text[:-1].lower()
    rels = {"left of": "left", "to the left of": "left", "right of": "right", "to the right of": "right",
            "above": "above", "below": "below"}
    if body.startswith("how many "):
        phrase = body[len("how many "):-len(" are there")]
        assert q.answer == str(len(_objects_of(phrase, objs)))
    elif body.startswith("is there "):
        phrase = body.split(" ", 3)[3]
        assert q.answer == ("yes" if _objects_of(phrase, objs) else "no")
    elif body.startswith("what "):
        _, word, _, _, rest = body.split(" ", 4)
        attr = {"color": "colour", "shape": "shape", "size": "size"}[word]
        rel = next((r for r in sorted(rels, key=len, reverse=True) if f" {r} the " in f" {rest} "), None)
        if rel is None:  # "What color is the large circle?"
            (oid,) = _objects_of(rest, objs)
        else:  # "What color is the shape left of the red circle?"
            (ref,) = _objects_of(rest.split(f" {rel} the ")[1], objs)
            inside = [o.object_id for o in objs if holds(rels[rel], o, by_id[ref], set())]
            assert len(inside) == 1, text
            oid = inside[0]
        assert q.answer == getattr(by_id[oid], attr), text
    elif body.startswith("is the "):
        rest = body[len("is the "):]
        rel = next(r for r in sorted(rels, key=len, reverse=True) if f" {r} the " in rest)
        pa, pb = rest.split(f" {rel} the ")
        (a,), (b,) = _objects_of(pa, objs), _objects_of(pb, objs)
        yes = holds(rels[rel], by_id[a], by_id[b], set())
        opposite = {"left": "right", "right": "left", "above": "below", "below": "above"}[rels[rel]]
        assert q.answer == ("yes" if yes else "no") and (yes or holds(opposite, by_id[a], by_id[b], set())), text
    else:
        raise AssertionError(f"unexpected question {text!r}")


def test_questions_are_true_balanced_and_noisy(images):
    qs = [q for im in images for q in im.questions]
    for im in images:
        assert len(im.questions) == 6 and len({q.question for q in im.questions}) == 6
        for q in im.questions:
            check_question(q, im.scene)
            assert [a.answer_id for a in q.answers] == list(range(1, 11))
            assert q.answer_type == {"count": "number", "existence": "yes/no"}.get(
                q.kind, q.answer_type if q.kind == "relation" else "other")
    kinds = Counter(q.kind for q in qs)
    assert all(kinds[k] > 0.2 * len(qs) for k in ("attribute", "count", "existence", "relation")), kinds
    yn = Counter(q.answer for q in qs if q.answer_type == "yes/no")
    assert 0.4 < yn["yes"] / (yn["yes"] + yn["no"]) < 0.6
    majority = Counter(q.multiple_choice_answer for q in qs).most_common(1)[0][1] / len(qs)
    assert majority < 0.3  # a majority-answer baseline stays far below a model that looks
    assert np.mean([q.multiple_choice_answer == q.answer for q in qs]) > 0.98
    disagree = np.mean([len({a.normalized for a in q.answers}) > 1 for q in qs])
    assert 0.3 < disagree < 0.95  # annotators disagree, but not always
    written = [a.answer for q in qs for a in q.answers]
    assert any(w.endswith(".") for w in written) and any(w[0].isupper() for w in written)
    assert any(w in NUMBER_WORDS for w in written) and any(w.startswith(("a ", "the ")) for w in written)


# --------------------------------------------------------------------------- the build

def _build(tmp: Path, name: str, **kw) -> Path:
    out = tmp / name
    build_world(out, n_images=kw.pop("n", 40), seed=kw.pop("seed", SEED), **kw)
    return out


def _same_tree(a: Path, b: Path) -> bool:
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    return all(filecmp.cmp(a / f, b / f, shallow=False) for f in files)


def test_build_is_deterministic_whatever_the_workers(tmp_path):
    one = _build(tmp_path, "one", workers=1)
    two = _build(tmp_path, "two", workers=2)
    assert _same_tree(one, two)
    other = _build(tmp_path, "other", seed=SEED + 1, workers=1)
    a = json.loads((one / "annotations/captions_train.json").read_text())
    b = json.loads((other / "annotations/captions_train.json").read_text())
    assert a["annotations"] != b["annotations"]
    for image_id in (1, 40):  # the PNG files decode (with PIL) to exactly the rendered pixels
        with Image.open(one / "images" / f"{image_id:012d}.png") as png:
            assert png.mode == "RGB" and np.array_equal(np.asarray(png), make_image(image_id, SEED).pixels)
    meta = json.loads((one / "world.json").read_text())
    assert meta["seed"] == SEED and meta["counts"]["images"] == 40 and sum(meta["splits"].values()) == 40
    assert set(meta["vocab"]["shapes"]) == set(SHAPES)


def test_the_build_summary_names_every_data_set_it_wrote(tmp_path):
    info = build_world(tmp_path / "w", n_images=12, seed=SEED)
    written = {p.name for p in (tmp_path / "w").iterdir() if p.is_dir()} - {"images", "annotations", "vocab"}
    names = {"vqa": "VQA v2", "gqa": "GQA", "nlvr2": "NLVR2", "vcr": "VCR", "refcoco+": "RefCOCO+",
             "flickr30k_entities": "Flickr30K Entities", "parses": "CoNLL-U", "text": "text documents"}
    assert written == set(names)  # a new export needs its name in the summary (and here)
    summary = info.summary()
    assert all(name in summary for name in names.values()), summary
    assert f"{info.n_refcoco_refs} RefCOCO+ refs" in summary and info.n_refcoco_refs > 0


def test_build_is_atomic_and_refuses_to_overwrite(tmp_path):
    out = _build(tmp_path, "w", n=20)
    with pytest.raises(VlbertsError, match="already exists"):
        build_world(out, n_images=20, seed=SEED)
    with pytest.raises(VlbertsError, match="objects"):
        build_world(tmp_path / "bad", n_images=5, seed=0, config=WorldConfig(min_objects=5, max_objects=3))
    assert not (tmp_path / "bad").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp dirs left
    build_world(out, n_images=10, seed=SEED, overwrite=True)
    assert len(list((out / "images").iterdir())) == 10
    # --overwrite replaces a world, never a file or someone's folder
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("keep me")
    (tmp_path / "file.txt").write_text("keep me too")
    for path in (tmp_path / "notes", tmp_path / "file.txt"):
        with pytest.raises(VlbertsError, match="not a world directory"):
            build_world(path, n_images=5, seed=SEED, overwrite=True)
    assert (tmp_path / "notes" / "mine.txt").read_text() == "keep me" and (tmp_path / "file.txt").is_file()


def test_splits_partition_the_images():
    assert split_sizes(10_000, (0.8, 0.1, 0.1)) == (8000, 1000, 1000)
    assert split_sizes(3, (0.8, 0.1, 0.1)) == (1, 1, 1)
    s = assign_splits(100, 5, (0.8, 0.1, 0.1))
    assert sorted(s) == list(range(1, 101)) and Counter(s.values()) == {"train": 80, "val": 10, "test": 10}
    assert s == assign_splits(100, 5, (0.8, 0.1, 0.1)) and s != assign_splits(100, 6, (0.8, 0.1, 0.1))


def test_explicit_phrases_name_colour_and_shape_and_minimal_ones_need_not(images):
    """Default `explicit` style: a referring phrase names its objects' colour and shape whenever a unique
    descriptor with both exists (always for single objects); `minimal` keeps the fewest modifiers."""
    def phrases(imgs):
        for im in imgs:
            for cap in im.captions:
                if cap.template == "copula":  # the predicate, not the phrase, states the rest
                    continue
                for e in cap.entities:
                    if e.type == "other" and len(e.object_ids) == 1:
                        yield cap.words[e.start:e.end]

    explicit = list(phrases(images))
    assert explicit and all(any(w in COLOURS for w in p) and any(w in SINGULAR for w in p) for p in explicit)
    minimal = list(phrases([make_image(i, SEED, WorldConfig(referring="minimal")) for i in range(1, 80)]))
    lacking = sum(1 for p in minimal if not (any(w in COLOURS for w in p) and any(w in SINGULAR for w in p)))
    assert lacking > 0.3 * len(minimal)
    with pytest.raises(VlbertsError, match="referring must be one of explicit, minimal"):
        build_world("unused", n_images=1, seed=0, config=WorldConfig(referring="verbose"))


def test_world_vocabulary_holds_every_word_of_every_text_as_one_token(tiny_world):
    """WORLD/vocab/ (world.language): questions, statements and rationales reach the model word by word,
    where a vocabulary of the captions alone spells them letter by letter or as [UNK]."""
    from vlberts.text.tokenizer import TextTokenizer
    from vlberts.world.language import world_texts

    tok = TextTokenizer.load(tiny_world.root / "vocab")
    texts = list(world_texts(tiny_world.root))
    kinds = {"what size is", "exactly", "only one image", "in total", "?"}
    assert all(any(k in t.lower() for t in texts) for k in kinds)  # VQA, NLVR2, GQA/VCR text is in it
    vocab = tok.tok.get_vocab()
    pieces = {i for t, i in vocab.items() if t.startswith("##")} | {tok.unk_id}
    for text in texts:
        ids = tok.encode(text)
        assert ids and not pieces & set(ids), text  # every word one whole token, none unknown
    captions = json.loads(tiny_world.captions_train.read_text())["annotations"]
    captions_only = TextTokenizer.train(c["caption"] for c in captions)
    assert captions_only.unk_id in captions_only.encode("what size is it?")
