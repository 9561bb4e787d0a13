"""The grounding driver: Flickr30K Entities captions -> token positions -> model attention ->
GroundingInputs, and the `analyze grounding` recipe and CLI on the tiny world."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vlberts.analysis.entities import SkipCounts, entity_captions, grounding_inputs, region_confidence
from vlberts.analysis.grounding import GroundingAccumulator, GroundingResult
from vlberts.analysis.syntactic import SyntacticResult
from vlberts.data.flickr_entities import EntityBoxes, ground_sentences, parse_entity_sentence, FlickrEntitiesImage
from vlberts.errors import VlbertsError
from vlberts.features.record import RegionRecord
from vlberts.models.builders import build_pretraining_model, visualbert_tiny
from vlberts.recipes.analyze_grounding import GroundingConfig, analyze_grounding
from vlberts.text.tokenizer import TextTokenizer

VLBERTS = Path(sys.executable).with_name("vlberts")


def tokenizer(tmp_path: Path) -> TextTokenizer:
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "the", "red", "skate", "##board", "man", "on",
             "each", "other", "near", "dog", "and", "are", "."]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return TextTokenizer.from_vocab(tmp_path / "vocab.txt")


def image(lines: list[str]) -> FlickrEntitiesImage:
    sentences = [parse_entity_sentence(line) for line in lines]
    ann = EntityBoxes(
        filename=None, width=100, height=80, depth=3,
        boxes={11: ((10.0, 10.0, 40.0, 40.0),), 12: ((50.0, 20.0, 90.0, 70.0), (0.0, 0.0, 5.0, 5.0))},
        scene=frozenset({13}), nobox=frozenset({14}),
    )
    return FlickrEntitiesImage("7", 100, 80, tuple(ground_sentences("7", sentences, ann)))


def test_entity_positions_follow_subwords_and_skips_are_counted(tmp_path):
    tok = tokenizer(tmp_path)
    im = image([
        "[/EN#11/people a man] on [/EN#12/other the red skateboard] .",
        "[/EN#11/people a man] and [/EN#15/animals a dog] are near [/EN#0/notvisual each other] "
        "[/EN#13/scene the] [/EN#14/other man] .",
    ])
    skipped = SkipCounts()
    caps = entity_captions([im], tok, skipped=skipped)
    c0 = caps[0]
    # [CLS] a man on the red skate ##board . [SEP]
    assert [tok.id_to_token(i) for i in c0.ids] == ["[CLS]", "a", "man", "on", "the", "red", "skate", "##board", ".", "[SEP]"]
    assert tok.decode(c0.ids) == "a man on the red skateboard."
    assert [e.word_tokens for e in c0.entities] == [[[1], [2]], [[4], [5], [6, 7]]]
    assert c0.entities[1].positions("last") == [7] and c0.entities[1].positions("head_mean") == [6, 7]
    np.testing.assert_array_equal(c0.entities[1].gold_boxes, [[50, 20, 90, 70], [0, 0, 5, 5]])
    assert c0.entities[0].caption_id == "7_0" and c0.entities[0].chain_id == "11"
    # Second caption: chain 15 has no annotation at all ("no box"), 0 is notvisual, 13 scene, 14 nobndbox.
    assert [e.phrase for e in caps[1].entities] == ["a man"]
    assert skipped.to_dict() == {"no box": 2, "notvisual": 1, "scene": 1}
    # one line names the phrases without a box by their first (the analysis prints it; scene and notvisual
    # phrases carry no box by the format's rule and are not in it)
    assert skipped.warning("phrases without a gold box", "ANN", ("no box",)) == (
        "warning: ANN: skipped 2 phrases without a gold box (no box: 2 (first: caption 7_1, chain 15 'a dog'))")
    assert SkipCounts().warning("phrases", "ANN") == ""


def test_truncated_phrases_are_skipped(tmp_path):
    tok = tokenizer(tmp_path)
    skipped = SkipCounts()
    caps = entity_captions([image(["[/EN#11/people a man] on [/EN#12/other the red skateboard] ."])], tok,
                           max_text_len=7, skipped=skipped)
    # Budget 5 subwords: "a man on the red" -> the skateboard phrase loses its last word.
    assert [e.phrase for e in caps[0].entities] == ["a man"]
    assert skipped.to_dict() == {"truncated": 1}


def test_region_confidence_sources():
    boxes = np.array([[0, 0, 5, 5], [1, 1, 9, 9]], np.float32)
    feats = np.zeros((2, 4), np.float32)
    with_conf = RegionRecord("1", 10, 10, boxes, feats, obj_id=[0, 1], obj_conf=[0.2, 0.9])
    np.testing.assert_allclose(region_confidence(with_conf), [0.2, 0.9])
    cls = np.array([[0.9, 0.05, 0.05], [0.1, 0.3, 0.6]], np.float32)  # column 0 = background
    np.testing.assert_allclose(region_confidence(RegionRecord("1", 10, 10, boxes, feats, cls_prob=cls)), [0.05, 0.6])
    with pytest.raises(VlbertsError, match="no detection confidences"):
        region_confidence(RegionRecord("1", 10, 10, boxes, feats), path="f.h5")


class FakeStore:
    def __init__(self, records):
        self.records = {r.image_id: r for r in records}

    def get(self, image_id):
        return self.records[str(image_id)]


def test_grounding_inputs_slice_the_joint_map_and_drop_padding(tmp_path):
    tok = tokenizer(tmp_path)
    caps = entity_captions([image([
        "[/EN#11/people a man] on [/EN#12/other the red skateboard] .",
        "[/EN#11/people a man] .",
    ])], tok)
    rng = np.random.default_rng(0)
    boxes = np.array([[10, 10, 40, 40], [50, 20, 90, 70], [0, 0, 99, 79]], np.float32)
    rec = RegionRecord("7", 100, 80, boxes, rng.random((3, 16), dtype=np.float32), obj_id=[0, 1, 2], obj_conf=[0.5, 0.1, 0.9])
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny(vocab_size=tok.vocab_size))
    got = list(grounding_inputs(model, caps, FakeStore([rec]), batch_size=2))
    assert len(got) == 2
    (c0, g0), (c1, g1) = got
    assert g0.attn.shape == (2, 4, len(c0.ids), 3) and g1.attn.shape == (2, 4, len(c1.ids), 3)
    np.testing.assert_allclose(g0.region_conf, [0.5, 0.1, 0.9])

    # Same numbers as the explicit joint map of an unbatched forward pass on the second caption.
    from vlberts.data.batch import VLInputs

    ids = torch.tensor([c1.ids])
    x = VLInputs(ids, torch.zeros_like(ids), torch.ones_like(ids, dtype=torch.bool), torch.from_numpy(rec.features)[None],
                 torch.from_numpy(boxes / np.array([100, 80, 100, 80], np.float32))[None], torch.ones(1, 3, dtype=torch.bool))
    model.eval()
    joint = model.encode(x, need_attn=True).attentions.joint  # per layer (1, H, S, S)
    T = len(c1.ids)
    want = np.stack([m[0, :, :T, T:].detach().numpy() for m in joint])  # (L, H, T, R)
    np.testing.assert_allclose(g1.attn, want, atol=1e-6)
    assert g1.text_attn is None  # only on request, below
    (_, g0t), (_, g1t) = grounding_inputs(model, caps, FakeStore([rec]), batch_size=2, text_maps=True)
    np.testing.assert_allclose(g1t.text_attn, np.stack([m[0, :, :T, :T].detach().numpy() for m in joint]), atol=1e-6)
    assert g0t.text_attn.shape == (2, 4, len(c0.ids), len(c0.ids))
    # Each text row's region share is below 1 (the rest went to words).
    assert (g1.region_mass < 1).all() and (g1.region_mass > 0).all()
    acc = GroundingAccumulator()
    for _, g in got:
        acc.add(g)
    assert acc.result().n_entities == 3


def test_captions_are_batched_by_subwords_then_regions(tmp_path):
    from vlberts.analysis.entities import length_order

    tok = tokenizer(tmp_path)
    rng = np.random.default_rng(0)
    recs = [RegionRecord(str(i), 100, 80, np.tile([[0, 0, 9, 9]], (n, 1)).astype(np.float32),
                         rng.random((n, 16), dtype=np.float32)) for i, n in enumerate([2, 4, 1, 4])]
    long, short = "[/EN#11/people a man] on [/EN#12/other the red skateboard] .", "[/EN#11/people a man] ."
    caps = []
    for rec, line in zip(recs, [long, short, long, short]):
        (cap,) = entity_captions([image([line])], tok)
        caps.append(dataclasses.replace(cap, image_id=rec.image_id))
    # Subwords 4, 4 (short) before 10, 10 (long); then regions: short 4, 4 (split order kept), long 1 < 2.
    assert list(length_order(caps, FakeStore(recs), max_regions=36)) == [1, 3, 2, 0]
    assert list(length_order(caps, FakeStore(recs), max_regions=1)) == [1, 3, 0, 2]  # counts capped: ties


def test_batching_in_length_order_changes_no_number_and_no_chosen_caption(tiny_world, tiny_pretrained, tmp_path):
    common = dict(model=str(tiny_pretrained), entities=str(tiny_world.entities), features=str(tiny_world.store),
                  split="test", explorer_examples=4, qualitative=2)
    one = analyze_grounding(GroundingConfig(out=str(tmp_path / "one"), batch_size=1, **common))  # no padding
    many = analyze_grounding(GroundingConfig(out=str(tmp_path / "many"), batch_size=7, **common))
    np.testing.assert_array_equal(one.result.accuracy, many.result.accuracy)
    np.testing.assert_allclose(one.result.mean_region_mass, many.result.mean_region_mass, atol=1e-6)
    assert one.syntactic.relations.keys() == many.syntactic.relations.keys()
    for rel, a in one.syntactic.relations.items():
        np.testing.assert_array_equal(a.accuracy, many.syntactic.relations[rel].accuracy)
    # The explorer and the figures show the split's first captions in the split's order, whatever order
    # the batches ran in (length order: the split's first captions are not the shortest).
    import re

    from vlberts.data.flickr_entities import read_flickr_entities, read_flickr_split

    tok = TextTokenizer.load(tiny_pretrained)
    ids = read_flickr_split(tiny_world.entities, "test")
    analysed = [c for c in entity_captions((read_flickr_entities(tiny_world.entities, i) for i in ids), tok) if c.entities]
    first = [c.caption_id for c in analysed]
    assert sorted(first[:4], key=lambda c: len(analysed[first.index(c)].ids)) != first[:4]
    for run in ("one", "many"):
        html = (tmp_path / run / "explorer.html").read_text()
        assert re.findall(r'"caption_id":"([^"]+)"', html) == first[:4]
        drawn = sorted(p.stem for p in (tmp_path / run / "qualitative").iterdir())
        assert drawn == sorted([c.caption_id for c in analysed if len(c.entities) >= 2][:2])


def _test_phrases(entities: Path) -> list[str]:
    """Every visual phrase ([/EN#N/type words], N > 0) of the test split's Sentences files, read with a regex."""
    import re

    ids = (entities / "test.txt").read_text().split()
    return [m.group(1) for i in ids for m in re.finditer(r"\[/EN#[1-9]\d*/\S+ ([^\]]+)\]", (entities / "Sentences" / f"{i}.txt").read_text())]


def test_analyze_recipe_writes_numbers_figure_and_table(tiny_world, tiny_pretrained, tmp_path):
    out = tmp_path / "g"
    rep = analyze_grounding(GroundingConfig(model=str(tiny_pretrained), entities=str(tiny_world.entities),
                                            features=str(tiny_world.store), split="test", out=str(out)))
    data = json.loads((out / "grounding.json").read_text())
    assert data["num_layers"] == 2 and data["num_heads"] == 4
    assert data["n_entities"] == rep.result.n_entities > 0
    assert 0 <= data["baseline_accuracy"] <= data["upper_bound"] <= 1
    assert data["attention_maps"].startswith("joint self-attention maps of 2 layers")
    assert data["attention_maps"].endswith("2 layers x 4 heads")
    assert set(data["skipped_phrases"]) <= {"notvisual", "scene", "no box", "truncated"}
    assert (out / "entity_grounding.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| rank | head |" in (out / "grounding.md").read_text()
    # By entity type (the world's phrases are all "other") and by the phrase's last word: the groups add up.
    best = rep.result.best_head
    for key in ("by_entity_type", "by_last_word"):
        rows = data[key]
        assert sum(r["n"] for r in rows) == data["n_entities"]
        assert all(r["overall_head"] == best.label for r in rows)
        assert sum(r["overall_head_accuracy"] * r["n"] for r in rows) == pytest.approx(best.accuracy * data["n_entities"])
        assert sum(r["baseline"] * r["n"] for r in rows) == pytest.approx(data["baseline_accuracy"] * data["n_entities"])
    assert [r["group"] for r in data["by_entity_type"]] == ["other"]
    words = {w.split()[-1].lower() for w in _test_phrases(tiny_world.entities)}
    assert {r["group"] for r in data["by_last_word"]} <= words and len(data["by_last_word"]) > 3
    md = (out / "grounding.md").read_text()
    assert "### By entity type (Flickr30K Entities)" in md and "### By the phrase's last word" in md
    # With the world's parses: the same arcs read among the words, every head, with the offset baseline.
    nsubj = data["text_syntax"]["nsubj (head->dep)"]
    assert nsubj["n"] > 0 and np.asarray(nsubj["accuracy"]).shape == (2, 4) and 0 < nsubj["offset_accuracy"] <= 1
    assert rep.text_syntax.rows["nsubj (head->dep)"].n == nsubj["n"]
    assert "## Syntactic heads among the words" in (out / "grounding.md").read_text()


def test_analyze_options_change_the_numbers_and_bad_options_fail(tiny_world, tiny_pretrained, tmp_path):
    common = dict(model=str(tiny_pretrained), entities=str(tiny_world.entities), features=str(tiny_world.store), split="test")
    last = analyze_grounding(GroundingConfig(out=str(tmp_path / "a"), **common)).result
    first = analyze_grounding(GroundingConfig(out=str(tmp_path / "b"), token="first", **common)).result
    assert last.n_entities == first.n_entities and not np.array_equal(last.accuracy, first.accuracy)
    with pytest.raises(VlbertsError, match="token must be one of"):
        analyze_grounding(GroundingConfig(out=str(tmp_path / "c"), token="middle", **common))


def test_cli_analyze_grounding_and_missing_image(tiny_world, tiny_pretrained, tmp_path):
    proc = subprocess.run(
        [str(VLBERTS), "analyze", "grounding", f"--model={tiny_pretrained}", f"--entities={tiny_world.entities}",
         f"--features={tiny_world.store}", "--split=val", f"--out={tmp_path / 'g'}"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "best head" in proc.stdout and "baseline" in proc.stdout
    assert "syntactic heads among the words (best head; best fixed offset): pobj (dep->head)" in proc.stdout

    # A split file naming an image the store does not hold.
    ents = tmp_path / "ents"
    import shutil

    shutil.copytree(tiny_world.entities, ents)
    (ents / "test.txt").write_text("424242\n")
    proc = subprocess.run(
        [str(VLBERTS), "analyze", "grounding", f"--model={tiny_pretrained}", f"--entities={ents}",
         f"--features={tiny_world.store}", f"--out={tmp_path / 'h'}"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {tiny_world.store}: record 424242: image id 424242 of split test not in "
                                   "store (1 of the 1 images missing)")
    assert not (tmp_path / "h").exists()


def test_analyze_grounding_skip_bad_drops_and_counts_bad_images(tiny_world, tiny_pretrained, tmp_path):
    """A real Flickr30K Entities split can hold an image the store lacks or an Annotations file with a box
    outside its image: without --skip_bad the first stops the analysis naming it; with it both images are
    dropped, counted in grounding.json and warned about, and the rest is analysed exactly as without them."""
    import re
    import shutil

    ents = tmp_path / "ents"
    shutil.copytree(tiny_world.entities, ents)
    good = (ents / "test.txt").read_text().split()
    broken = good[1]
    xml = ents / "Annotations" / f"{broken}.xml"
    text, n = re.subn(r"<xmax>\d+</xmax>", "<xmax>99999</xmax>", xml.read_text(), count=1)
    assert n == 1
    xml.write_text(text)
    (ents / "test.txt").write_text("\n".join(["424242", *good]) + "\n")
    args = [str(VLBERTS), "analyze", "grounding", f"--model={tiny_pretrained}", f"--entities={ents}",
            f"--features={tiny_world.store}", "--explorer_examples=0", "--qualitative=0"]

    proc = subprocess.run([*args, f"--out={tmp_path / 'strict'}"], capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "record 424242: image id 424242 of split test not in store (1 of the" in proc.stderr

    proc = subprocess.run([*args, f"--out={tmp_path / 'lenient'}", "--skip-bad"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert ("warning: skipped 2 bad records (1 malformed entities file, 1 missing features); first: "
            f"{tiny_world.store}: record 424242") in proc.stderr
    data = json.loads((tmp_path / "lenient" / "grounding.json").read_text())
    bad = data["bad_records"]
    assert (bad["total"], bad["malformed entities file"], bad["missing features"]) == (2, 1, 1)
    assert "Images dropped by --skip_bad: 2" in (tmp_path / "lenient" / "grounding.md").read_text()

    # The same numbers as a split file that never listed the two images.
    (ents / "test.txt").write_text("\n".join(i for i in good if i != broken) + "\n")
    clean = analyze_grounding(GroundingConfig(model=str(tiny_pretrained), entities=str(ents),
                                              features=str(tiny_world.store), out=str(tmp_path / "clean"),
                                              explorer_examples=0, qualitative=0)).result
    assert data["n_entities"] == clean.n_entities > 0
    assert np.allclose(np.asarray(data["accuracy"]), clean.accuracy)


def one_captioned_image(tmp_path):
    """A tokenizer, one caption with two entities, and its image's three regions (16-d features)."""
    tok = tokenizer(tmp_path)
    caps = entity_captions([image(["[/EN#11/people a man] on [/EN#12/other the red skateboard] ."])], tok)
    rng = np.random.default_rng(0)
    boxes = np.array([[10, 10, 40, 40], [50, 20, 90, 70], [0, 0, 99, 79]], np.float32)
    rec = RegionRecord("7", 100, 80, boxes, rng.random((3, 16), dtype=np.float32), obj_id=[0, 1, 2], obj_conf=[0.5, 0.1, 0.9])
    return tok, caps, rec


def test_grounding_inputs_without_early_fusion_give_zero_attention_before_the_fusion_layer(tmp_path):
    tok, caps, rec = one_captioned_image(tmp_path)
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny(vocab_size=tok.vocab_size, num_layers=3, fusion_layer=2))
    (cap, g), = grounding_inputs(model, caps, FakeStore([rec]))
    assert g.attn.shape == (3, 4, len(cap.ids), 3)
    assert (g.attn[:2] == 0).all() and (g.attn[2] > 0).all()
    assert "layers 1-2 see no regions" in g.maps
    acc = GroundingAccumulator()
    acc.add(g)
    res = acc.result()
    assert (res.accuracy[:2] == 0).all() and not res.active[:2].any() and (res.mean_region_mass[:2] == 0).all()


def test_grounding_inputs_read_a_two_stream_models_cross_attention(tmp_path):
    from vlberts.models.builders import lxmert_tiny

    tok, caps, rec = one_captioned_image(tmp_path)
    torch.manual_seed(0)
    model = build_pretraining_model(lxmert_tiny(vocab_size=tok.vocab_size, cross_layers=2))
    (cap, g), = grounding_inputs(model, caps, FakeStore([rec]))
    assert g.attn.shape == (2, 2, len(cap.ids), 3)  # (N_X, heads, T, R)
    np.testing.assert_allclose(g.attn.sum(-1), 1.0, rtol=1e-5)  # cross-attention rows are over regions only
    assert g.maps.startswith("text-to-vision cross-attention maps of 2 layers")


def test_wvisualbert_is_analysed_and_probed_with_its_detector_tags(tmp_path):
    """W-VisualBERT never sees an image without its detector tags (§3.2: pre-training's image batches and
    fine-tuning give [regions ; tags]), so the grounding analysis and the probe give them too; the maps'
    region columns stay the regions. Without the image (probe, regions zeroed) there are no tags either."""
    from vlberts.analysis.visual_words import ProbeItem, visual_word_accuracy
    from vlberts.data.batch import VLInputs
    from vlberts.models.wvisualbert import image_tags, wvisualbert_tiny

    tok, caps, rec = one_captioned_image(tmp_path)
    subwords = ((tok.token_to_id("skate"), tok.token_to_id("##board")), (tok.token_to_id("man"),),
                (tok.token_to_id("dog"),))  # detector classes 0, 1, 2 as tag subwords
    torch.manual_seed(0)
    model = build_pretraining_model(wvisualbert_tiny(vocab_size=tok.vocab_size))
    (cap, g), = grounding_inputs(model, caps, FakeStore([rec]), tag_subwords=subwords)
    (_, g_plain), = grounding_inputs(model, caps, FakeStore([rec]))
    T = len(cap.ids)
    assert g.attn.shape == (2, 4, T, 3)  # regions only: the 4 tag subwords are not columns
    assert not np.allclose(g.attn, g_plain.attn)  # the tags took part
    assert g.maps.endswith("detector tags in the input beside the regions, not counted as regions")

    # The same numbers as one explicit forward pass of [text ; regions ; tags].
    ids = torch.tensor([cap.ids])
    x = VLInputs(ids, torch.zeros_like(ids), torch.ones_like(ids, dtype=torch.bool), torch.from_numpy(rec.features)[None],
                 torch.from_numpy(rec.boxes / np.array([100, 80, 100, 80], np.float32))[None], torch.ones(1, 3, dtype=torch.bool))
    tags = image_tags([[0, 1, 2]], subwords)
    assert tags.tag_ids.tolist() == [list(subwords[0] + subwords[1] + subwords[2])]
    assert tags.tag_region.tolist() == [[0, 0, 1, 2]]
    model.eval()
    joint = model.encode(x, need_attn=True, tags=tags).attentions.joint  # per layer (1, H, T + 3 + 4, same)
    assert joint[0].shape[-1] == T + 3 + 4
    want = np.stack([m[0, :, :T, T : T + 3].detach().numpy() for m in joint])  # (L, H, T, R)
    np.testing.assert_allclose(g.attn, want, atol=1e-6)

    # The probe hands the model the tags with the image, and neither without it.
    seen = []
    forward = model.forward
    model.forward = lambda x, **kw: (seen.append(kw.get("tags")), forward(x, **kw))[1]
    red = cap.ids.index(tok.token_to_id("red"))
    items = [ProbeItem(image_id="7", ids=cap.ids[:red] + [tok.mask_id] + cap.ids[red + 1 :], positions=[red],
                       targets=[cap.ids[red]], word="red")]
    visual_word_accuracy(model, items, FakeStore([rec]), device="cpu", tag_subwords=subwords)
    visual_word_accuracy(model, items, FakeStore([rec]), device="cpu", tag_subwords=subwords, zero_regions=True)
    assert seen[0] is not None and seen[0].tag_ids.tolist() == tags.tag_ids.tolist() and seen[1] is None

    # A store without the detector's class per region cannot give the tags: one error naming the record,
    # from the analysis and from the probe alike.
    bare = dataclasses.replace(rec, obj_id=None, obj_conf=None)
    with pytest.raises(VlbertsError, match="image 7: detector tags need each region's obj_id"):
        list(grounding_inputs(model, caps, FakeStore([bare]), tag_subwords=subwords))
    with pytest.raises(VlbertsError, match="image 7: detector tags need each region's obj_id"):
        visual_word_accuracy(model, items, FakeStore([bare]), device="cpu", tag_subwords=subwords)


def _conllu(sent_id: str, rows: list[tuple[str, str]]) -> str:
    """A CoNLL-U sentence of (form, UPOS) rows, each word attached to the first (heads do not matter here)."""
    lines = [f"# sent_id = {sent_id}"]
    for i, (form, upos) in enumerate(rows, start=1):
        lines.append("\t".join([str(i), form, form, upos, "_", "_", "0" if i == 1 else "1",
                                "root" if i == 1 else "dep", "_", "_"]))
    return "\n".join(lines) + "\n\n"


def test_mask_pos_masks_every_subword_of_the_chosen_words_and_leaves_out_unparsed_captions(tmp_path):
    from vlberts.analysis.entities import mask_words_by_pos
    from vlberts.data.conllu import parse_conllu

    tok = tokenizer(tmp_path)
    im = image(["[/EN#11/people a man] on [/EN#12/other the red skateboard] .",
                "[/EN#11/people a man] on [/EN#12/other the skateboard] .",
                "[/EN#11/people a man] on [/EN#12/other the red skateboard] ."])
    caps = entity_captions([im], tok)
    rows = [("a", "DET"), ("man", "NOUN"), ("on", "ADP"), ("the", "DET"), ("red", "ADJ"), ("skateboard", "NOUN"),
            (".", "PUNCT")]
    parses = parse_conllu(_conllu("7_0", rows)  # caption 7_1 has a parse of other words, 7_2 none at all
                          + _conllu("7_1", rows))
    masked, n_words, left_out = mask_words_by_pos(caps, parses, ["NOUN", "ADJ"], tok.mask_id)
    assert (n_words, left_out) == (3, 2) and [c.caption_id for c in masked] == ["7_0"]
    # [CLS] a man on the red skate ##board . [SEP]: "man", "red" and both subwords of "skateboard"
    assert [tok.id_to_token(i) for i in masked[0].ids] == [
        "[CLS]", "a", "[MASK]", "on", "the", "[MASK]", "[MASK]", "[MASK]", ".", "[SEP]"]
    # The rest of the caption is untouched: its words (the parse still matches them) and its entities.
    assert masked[0].words == caps[0].words and masked[0].entities == caps[0].entities
    assert caps[0].ids[2] == tok.encode("man")[0]  # the input captions are not changed in place


def test_mask_pos_runs_the_analysis_on_masked_captions(tiny_world, tiny_pretrained, tmp_path):
    # `--mask_pos` is a diagnostic: the heads are read where the model has to predict the chosen words.
    # The recipe's numbers must be those of the masked captions (computed here through the library) and
    # differ from the unmasked run's; the outputs say what was masked.
    from vlberts.analysis.entities import mask_words_by_pos
    from vlberts.data.conllu import read_conllu
    from vlberts.data.flickr_entities import read_flickr_entities, read_flickr_split
    from vlberts.features.store import RegionStore
    from vlberts.training.checkpoint import load_pretraining_model

    common = dict(model=str(tiny_pretrained), entities=str(tiny_world.entities), features=str(tiny_world.store),
                  split="test", explorer_examples=0, qualitative=0)
    plain = analyze_grounding(GroundingConfig(out=str(tmp_path / "plain"), **common))
    rep = analyze_grounding(GroundingConfig(out=str(tmp_path / "adj"), mask_pos="NOUN,ADJ", **common))
    assert not np.array_equal(plain.result.accuracy, rep.result.accuracy)

    tok = TextTokenizer.load(tiny_pretrained)
    ids = read_flickr_split(tiny_world.entities, "test")
    caps = entity_captions((read_flickr_entities(tiny_world.entities, i) for i in ids), tok)
    parses = read_conllu(Path(tiny_world.entities).parent / "parses" / "test.conllu")
    masked, n_words, left_out = mask_words_by_pos(caps, parses, ["NOUN", "ADJ"], tok.mask_id)
    assert left_out == 0 and n_words > 0
    model, _, _ = load_pretraining_model(tiny_pretrained)
    acc = GroundingAccumulator()
    for _, inp in grounding_inputs(model, masked, RegionStore(tiny_world.store)):
        acc.add(inp)
    np.testing.assert_array_equal(acc.result().accuracy, rep.result.accuracy)

    data = json.loads((tmp_path / "adj" / "grounding.json").read_text())
    assert data["mask_pos"] == ["NOUN", "ADJ"] and data["mask_note"] == rep.mask_note
    assert rep.mask_note == f"words tagged NOUN, ADJ replaced by [MASK] (--mask_pos): {n_words} words in {len(masked)} captions"
    assert f"Inputs: {rep.mask_note}." in (tmp_path / "adj" / "grounding.md").read_text()
    assert json.loads((tmp_path / "plain" / "grounding.json").read_text())["mask_pos"] == []

    with pytest.raises(VlbertsError, match=r"unknown part of speech ADJX; valid \(UPOS\): NOUN, PROPN"):
        analyze_grounding(GroundingConfig(out=str(tmp_path / "x"), mask_pos="ADJX", **common))
    with pytest.raises(VlbertsError, match="--mask_pos needs parses"):
        analyze_grounding(GroundingConfig(out=str(tmp_path / "y"), mask_pos="ADJ", parses="none", **common))


@pytest.mark.parametrize("arch", ["visualbert", "lxmert", "vilbert", "vlbert", "wvisualbert"])
def test_the_probe_batches_by_length_and_scores_each_item_by_its_own_row(tmp_path, arch):
    """The probe runs its items in length order (`length_order`) and the MLM head at the masked words only
    (`mlm_positions`); each outcome must land on its own item. Targets are the model's own unbatched
    prediction from every position's logits for even items and another id for odd ones, half the items mask
    two words (one word of two subwords, as the probe does), and each item has its own word, so `per_word`
    shows every item's outcome, for every architecture's pre-training model."""
    from vlberts.analysis.visual_words import ProbeItem, visual_word_accuracy
    from vlberts.data.regions import FetchedRecord, caption_inputs, load_regions
    from vlberts.models.builders import model_config

    tok = tokenizer(tmp_path)
    rng = np.random.default_rng(0)
    recs = [RegionRecord(str(i), 100, 80, np.array([[10, 10, 40, 40]] * n, np.float32),
                         rng.random((n, 16), dtype=np.float32)) for i, n in ((1, 3), (2, 1), (3, 2))]
    store = FakeStore(recs)
    torch.manual_seed(0)
    model = build_pretraining_model(model_config(f"{arch}-tiny", vocab_size=tok.vocab_size)).eval()
    words = ["a", "the", "red", "man", "on", "dog", "near", "each"]
    items = []
    for k, n_words in enumerate((6, 2, 4, 3, 5, 2, 6, 3)):  # lengths out of order, so the batches reorder them
        ids = [tok.cls_id, *(tok.token_to_id(w) for w in words[:n_words]), tok.sep_id]
        masked = [1, 2] if k % 4 < 2 else [1]
        for p in masked:
            ids[p] = tok.mask_id
        image_id = str(k % 3 + 1)
        x = caption_inputs([ids], [load_regions(FetchedRecord(store.get(image_id), None), image_id, 36, 16)])
        with torch.no_grad():
            own = [int(model(x).mlm_logits[0, p].argmax()) for p in masked]
        target = own if k % 2 == 0 else [*own[:-1], (own[-1] + 1) % tok.vocab_size]  # the last word wrong
        items.append(ProbeItem(image_id, ids, masked, target, f"w{k}"))
    out = visual_word_accuracy(model, items, store, batch_size=3, device="cpu")
    assert out["per_word"] == {f"w{k}": 100.0 if k % 2 == 0 else 0.0 for k in range(8)}
    assert out["accuracy"] == 50.0


def test_a_fine_tuned_model_is_analysed_through_its_encoder(tiny_world, tiny_pretrained, tmp_path):
    """`--model` may name a fine-tuned model (here VQA): its encoder is loaded strictly, its task head left
    behind, and the analysis is the one of a pre-training model holding that encoder. A run directory in
    place of its model directory is a one-line error naming RUN/model."""
    import shutil

    from safetensors.torch import load_file
    from test_finetune_vqa import vqa_cfg

    from vlberts.recipes.finetune_vqa import finetune_vqa
    from vlberts.training.checkpoint import load_attention_model, save_model_dir

    vqa = finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "vqa", epochs=0.5, ckpt_every=100))
    model, cfg, meta = load_attention_model(vqa)
    assert meta["task"] == "vqa"
    tuned, pretrained = load_file(str(Path(vqa) / "model.safetensors")), load_file(str(tiny_pretrained / "model.safetensors"))
    encoder = {k: v for k, v in model.state_dict().items() if k.startswith("bert.")}
    assert encoder and all(torch.equal(v, tuned[k]) for k, v in encoder.items())
    assert any(not torch.equal(v, pretrained[k]) for k, v in encoder.items())  # fine-tuning moved the encoder
    encoder_tensors = {id(p) for p in model.bert.parameters()}
    heads = [p for p in model.parameters() if id(p) not in encoder_tensors]
    assert heads and all(not p.any() for p in heads)  # built without random draws, left at zero: never read

    same = tmp_path / "same"
    save_model_dir(same, model, cfg)
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(Path(vqa) / name, same / name)
    common = dict(entities=str(tiny_world.entities), features=str(tiny_world.store), explorer_examples=0, qualitative=0)
    a = analyze_grounding(GroundingConfig(model=str(vqa), out=str(tmp_path / "a"), **common))
    b = analyze_grounding(GroundingConfig(model=str(same), out=str(tmp_path / "b"), **common))
    assert (a.model_task, b.model_task) == ("vqa", "")
    np.testing.assert_array_equal(a.result.accuracy, b.result.accuracy)
    assert json.loads((tmp_path / "a" / "grounding.json").read_text())["model_task"] == "vqa"

    with pytest.raises(VlbertsError, match=r"not a model directory \(no config.json\): a run directory\? its model is "):
        analyze_grounding(GroundingConfig(model=str(tmp_path / "vqa"), out=str(tmp_path / "c"), **common))
    with pytest.raises(VlbertsError, match=r"not a model directory \(no vocab.txt\): a run directory\? its model is "):
        TextTokenizer.load(tmp_path / "vqa")  # as `vlberts finetune TASK --init=RUN` reads it first
    # One of a run's training checkpoints, a model's weights file, a released checkpoint: each said for what it is
    step = tmp_path / "run" / "checkpoints" / "step_00000040"
    step.mkdir(parents=True)
    (step / "state.json").write_text("{}")
    with pytest.raises(VlbertsError, match=r"step_00000040: a training checkpoint, not a model directory \(no "
                                           r"vocab.txt\): the run's model is .*run/model once it ends"):
        TextTokenizer.load(step)
    with pytest.raises(VlbertsError, match=r"model.safetensors: is a file; a model is a directory \(config.json, "
                                           r"model.safetensors, vocab.txt\): this one's, .*same\?"):
        analyze_grounding(GroundingConfig(model=str(same / "model.safetensors"), out=str(tmp_path / "c"), **common))
    (tmp_path / "Epoch20_LXRT.pth").write_bytes(b"")
    with pytest.raises(VlbertsError, match=r"Epoch20_LXRT.pth: is a file; .*a released checkpoint becomes one with "
                                           r"`vlberts models import`"):
        TextTokenizer.load(tmp_path / "Epoch20_LXRT.pth")


def test_a_store_without_detection_confidences_runs_with_baseline_none(tiny_world, tiny_pretrained, tmp_path):
    """BUTD's 6-field TSVs (and BAN's HDF5) hold no detection confidences, so no most-confident-region baseline:
    the analysis says so in one line and how to go on; with --baseline=none every head's numbers are the same as
    with the baseline, and the baseline is n/a (null in grounding.json, no grey line), not 0."""
    from vlberts.features.importers import export_tsv, import_features

    export_tsv(tiny_world.store, tmp_path / "butd.tsv", "butd-tsv")
    import_features(tmp_path / "butd.tsv", "butd-tsv", tmp_path / "butd.h5")
    common = dict(model=str(tiny_pretrained), entities=str(tiny_world.entities), explorer_examples=0, qualitative=0,
                  max_images=12)
    with pytest.raises(VlbertsError, match=r"butd.h5: record image \S+: the store has no detection confidences .* or "
                                           r"pass --baseline=none to analyse without the baseline"):
        analyze_grounding(GroundingConfig(out=str(tmp_path / "x"), features=str(tmp_path / "butd.h5"), **common))
    ref = analyze_grounding(GroundingConfig(out=str(tmp_path / "ref"), features=str(tiny_world.store), **common))
    rep = analyze_grounding(GroundingConfig(out=str(tmp_path / "none"), features=str(tmp_path / "butd.h5"),
                                            baseline="none", **common))
    np.testing.assert_allclose(rep.result.accuracy, ref.result.accuracy, atol=1e-12)
    assert np.isnan(rep.result.baseline_accuracy) and rep.result.upper_bound == ref.result.upper_bound
    data = json.loads((tmp_path / "none" / "grounding.json").read_text())
    assert data["baseline_accuracy"] is None and np.isnan(GroundingResult.from_dict(data).baseline_accuracy)
    assert all(row["baseline"] is None for row in data["syntactic_grounding"]["table2"])
    # The results' own to_dict is JSON-ready too (it had NaN, which only the recipe's writer turned into null),
    # and from_dict its inverse.
    for result, cls in ((rep.result, GroundingResult), (rep.syntactic, SyntacticResult)):
        d = result.to_dict()
        assert json.loads(json.dumps(d, allow_nan=False)) == d
        assert cls.from_dict(d).to_dict() == d
    assert rep.result.to_dict()["baseline_accuracy"] is None
    md = (tmp_path / "none" / "grounding.md").read_text()
    assert "- baseline (most confident region): n/a (no detection confidences read: --baseline=none)" in md
    assert "| n/a |" in md and "nan" not in md
    with pytest.raises(VlbertsError, match="--baseline must be one of confidence, none, got 'largest'"):
        analyze_grounding(GroundingConfig(out=str(tmp_path / "y"), features=str(tiny_world.store), baseline="largest",
                                          **common))
