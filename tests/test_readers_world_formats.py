"""Readers of the real formats (COCO captions, Karpathy, Flickr30K Entities, CoNLL-U) on the exported
embedded world, and on small hand-written good and bad files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from vlberts.cli import app, main
from vlberts.data.coco import read_caption_refs, read_coco_captions, read_karpathy
from vlberts.data.conllu import parse_conllu, read_conllu
from vlberts.data.flickr_entities import (
    parse_entity_sentence, read_entity_boxes, read_entity_sentences, read_flickr_entities, read_flickr_split,
)
from vlberts.data.vqa import read_vqa
from vlberts.errors import VlbertsError
from vlberts.world.build import WorldConfig, build_world, make_image
from vlberts.world.scene import read_scenes

SEED, N = 5, 40
SPLITS = ("train", "val", "test")


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("w") / "world"
    build_world(out, n_images=N, seed=SEED, workers=2)
    return out


@pytest.fixture(scope="module")
def truth():
    return {i: make_image(i, SEED, WorldConfig(), render=False) for i in range(1, N + 1)}


# --------------------------------------------------------------------------- round trips

def test_coco_and_karpathy_round_trip(world, truth):
    seen = {}
    for split in SPLITS:
        coco = read_coco_captions(world / "annotations" / f"captions_{split}.json")
        for image_id, caps in coco.by_image().items():
            assert coco.images[image_id].file_name == f"{image_id:012d}.png"
            assert [c.text for c in caps] == [c.text for c in truth[image_id].captions]
            assert [c.caption_id for c in caps] == [image_id * 10 + k for k in range(5)]
            seen[image_id] = split
    assert sorted(seen) == list(range(1, N + 1))
    karpathy = read_karpathy(world / "dataset_world.json")
    assert karpathy.dataset == "world" and len(karpathy.images) == N
    for im in karpathy.images:
        assert im.split == seen[im.cocoid] and im.image_id == im.cocoid and im.filename == f"{im.cocoid:012d}.png"
        assert [s.raw for s in im.sentences] == [c.text for c in truth[im.cocoid].captions]
        assert all(s.tokens == tuple(w for w in s.raw.split() if w not in ".,") for s in im.sentences)
    refs = read_caption_refs(world / "dataset_world.json", split="val")
    assert {r.image_id for r in refs} == {str(i) for i, s in seen.items() if s == "val"}
    assert read_caption_refs(world / "annotations" / "captions_test.json")[0].image_id.isdigit()


def test_flickr_entities_round_trip(world, truth):
    root = world / "flickr30k_entities"
    ids = {s: read_flickr_split(root, s) for s in SPLITS}
    assert sorted(int(i) for s in SPLITS for i in ids[s]) == list(range(1, N + 1))
    for image_id in range(1, N + 1):
        im = read_flickr_entities(root, image_id)
        scene = truth[image_id].scene
        boxes = {o.object_id: tuple(float(v) for v in o.box) for o in scene.objects}
        assert (im.image_id, im.width, im.height) == (str(image_id), 128, 128)
        for cap, gold in zip(im.captions, truth[image_id].captions, strict=True):
            assert cap.words == gold.words
            assert len(cap.phrases) == len(gold.entities)
            for p, e in zip(cap.phrases, gold.entities):
                assert (p.phrase.first_word_index, p.phrase.end, p.chain_id, p.phrase.types) == \
                       (e.start, e.end, e.chain_id, (e.type,))
                # every entity's boxes are exactly its objects' boxes (0-based float xyxy again)
                assert sorted(p.boxes) == sorted(boxes[i] for i in e.object_ids)
                assert p.is_scene == (e.type == "scene")


def test_conllu_round_trip(world, truth):
    parses = {}
    for split in SPLITS:
        parses.update(read_conllu(world / "parses" / f"{split}.conllu"))
    assert len(parses) == 5 * N
    for image_id, im in truth.items():
        for k, cap in enumerate(im.captions):
            sent = parses[f"{image_id}_{k}"]
            assert sent.text == cap.text and sent.words == cap.words and sent.is_tree()
            assert [(t.head, t.deprel, t.upos, t.xpos, t.lemma) for t in sent.tokens] == \
                   [(t.head, t.deprel, t.upos, t.xpos, t.lemma) for t in cap.tokens]
            for e in cap.entities:
                assert {sent.tokens[i].misc["Entity"] for i in range(e.start, e.end)} == {str(e.chain_id)}


def test_vqa_files_have_the_real_layout(world, truth):
    for split in SPLITS:
        qf = json.loads((world / "vqa" / f"v2_OpenEnded_world_{split}_questions.json").read_text())
        af = json.loads((world / "vqa" / f"v2_world_{split}_annotations.json").read_text())
        assert set(qf) == {"info", "task_type", "data_type", "data_subtype", "license", "questions"}
        assert set(af) == {"info", "task_type", "data_type", "data_subtype", "license", "annotations"}
        for a in af["annotations"]:
            assert set(a) == {"question_type", "multiple_choice_answer", "answers", "image_id", "answer_type",
                              "question_id"}
            assert [set(x) for x in a["answers"]] == [{"answer", "answer_confidence", "answer_id"}] * 10
        examples = read_vqa(world / "vqa" / f"v2_OpenEnded_world_{split}_questions.json",
                            world / "vqa" / f"v2_world_{split}_annotations.json")
        for ex in examples:
            q = truth[ex.image_id].questions[ex.question_id % 1000]
            assert (ex.question, ex.multiple_choice_answer) == (q.question, q.multiple_choice_answer)
    scenes = read_scenes(world / "scenes.jsonl")
    assert [s.image_id for s, _ in scenes] == list(range(1, N + 1))
    assert all(s == truth[s.image_id].scene for s, _ in scenes)


# --------------------------------------------------------------------------- hand-written files

def test_flickr_sentence_markup_matches_the_official_parser():
    s = parse_entity_sentence("[/EN#18/people A child] in [/EN#19/clothing/other a pink dress] is climbing "
                              "[/EN#0/notvisual something] .")
    assert s.text == "A child in a pink dress is climbing something ."
    assert [(p.first_word_index, p.text, p.chain_id, p.types) for p in s.phrases] == [
        (0, "A child", 18, ("people",)),
        (3, "a pink dress", 19, ("clothing", "other")),
        (8, "something", 0, ("notvisual",)),
    ]


def test_flickr_xml_multiple_names_scene_and_nobox(tmp_path):
    xml = tmp_path / "1.xml"
    xml.write_text(
        "<annotation><filename>1.jpg</filename><size><width>50</width><height>40</height><depth>3</depth></size>"
        "<object><name>5</name><name>7</name><bndbox><xmin>1</xmin><ymin>2</ymin><xmax>10</xmax><ymax>20</ymax>"
        "</bndbox></object>"
        "<object><name>5</name><bndbox><xmin>11</xmin><ymin>1</ymin><xmax>12</xmax><ymax>1</ymax></bndbox></object>"
        "<object><name>8</name><nobndbox>0</nobndbox><scene>1</scene></object>"
        "<object><name>9</name><nobndbox>1</nobndbox><scene>0</scene></object></annotation>")
    ann = read_entity_boxes(xml)
    assert (ann.width, ann.height, ann.filename) == (50, 40, "1.jpg")
    assert ann.boxes == {5: ((0.0, 1.0, 10.0, 20.0), (10.0, 0.0, 12.0, 1.0)), 7: ((0.0, 1.0, 10.0, 20.0),)}
    assert ann.scene == {8} and ann.nobox == {9}


@pytest.mark.parametrize("line, message", [
    ("[/EN#1/other a red circle sits .", "not closed"),
    ("[/EN#1/other a [/EN#2/other red] circle] .", "inside an open phrase"),
    ("a red circle] sits .", "outside a phrase"),
    ("[/EN#x/other a circle] .", "bad chain id"),
    ("[/EN#3 a circle] .", "names no type"),
])
def test_bad_sentence_markup_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "Sentences" / "7.txt"
    path.parent.mkdir()
    path.write_text("[/EN#1/other a circle] .\n" + line + "\n")
    with pytest.raises(VlbertsError, match=message) as err:
        read_entity_sentences(path)
    assert str(err.value).startswith(f"{path}: record line 2: ")


@pytest.mark.parametrize("text, record", [
    ("<annotation><size><width>5</width><height>5</height></size><object><name>1</name>", "record line 1"),
    ("<annotation><object><name>1</name></object></annotation>", "record size"),
    ("<annotation><size><width>5</width><height>5</height></size><object><bndbox/></object></annotation>",
     "record object 0"),
    ("<annotation><size><width>5</width><height>5</height></size><object><name>1</name><bndbox>"
     "<xmin>a</xmin><ymin>1</ymin><xmax>2</xmax><ymax>2</ymax></bndbox></object></annotation>", "record object 0"),
])
def test_bad_xml_names_file_and_record(tmp_path, text, record):
    path = tmp_path / "3.xml"
    path.write_text(text)
    with pytest.raises(VlbertsError) as err:
        read_entity_boxes(path)
    assert str(err.value).startswith(f"{path}: {record}: ") and "\n" not in str(err.value)


def test_bad_coco_and_karpathy_files(tmp_path):
    coco = tmp_path / "captions.json"
    coco.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg"}],
                                "annotations": [{"id": 3, "image_id": 1, "caption": "ok"}, {"id": 4, "image_id": 1}]}))
    with pytest.raises(VlbertsError, match=r"record annotations\[1\]: missing field\(s\) caption"):
        read_coco_captions(coco)
    coco.write_text(json.dumps({"images": [], "annotations": [{"id": 3, "image_id": 2, "caption": "x"}]}))
    with pytest.raises(VlbertsError, match="image_id 2 is not among"):
        read_coco_captions(coco)
    coco.write_text('{"images": [')
    with pytest.raises(VlbertsError, match="malformed JSON"):
        read_coco_captions(coco)
    kp = tmp_path / "dataset.json"
    kp.write_text(json.dumps({"images": [{"filename": "1.jpg", "split": "restval", "sentences": [
        {"raw": "a dog .", "tokens": ["a", "dog"]}]}, {"filename": "2.jpg", "split": "train"}]}))
    with pytest.raises(VlbertsError, match=r"record images\[1\]: missing field\(s\) sentences"):
        read_karpathy(kp)
    kp.write_text(json.dumps({"images": [{"filename": "1000.jpg", "split": "restval", "sentences": [
        {"raw": "a dog .", "tokens": ["a", "dog"]}]}]}))
    assert read_karpathy(kp).images[0].split == "train"
    assert read_karpathy(kp, merge_restval=False).images[0].split == "restval"
    assert read_karpathy(kp).images[0].image_id == "1000"
    # --split=restval reads the restval images alone (train holds them too); an official file takes no split
    from vlberts.data.coco import read_caption_refs

    assert [r.text for r in read_caption_refs(kp, split="restval")] == ["a dog ."]
    assert [r.text for r in read_caption_refs(kp, split="train")] == ["a dog ."]
    with pytest.raises(VlbertsError, match="no captions in split 'val'"):
        read_caption_refs(kp, split="val")
    coco.write_text(json.dumps({"images": [{"id": 1, "file_name": "1.jpg"}],
                                "annotations": [{"id": 3, "image_id": 1, "caption": "ok"}]}))
    assert [r.text for r in read_caption_refs(coco)] == ["ok"]
    with pytest.raises(VlbertsError, match=r"an official COCO captions file is one split already \(the file\); "
                                           r"split 'val' picks the images of a Karpathy split file"):
        read_caption_refs(coco, split="val")
    # Another format's file read as captions: what it looks like, and the --captions_format that reads it
    other = tmp_path / "other.json"
    for value, hint in (([{"img_id": "1", "sentf": {}, "labelf": {}}], "LXMERT's corpus: pass --captions_format=lxmert"),
                        ({"questions": [], "info": {}}, "VQA v2 questions: pass --captions_format=vqa")):
        other.write_text(json.dumps(value))
        with pytest.raises(VlbertsError, match=f"neither a COCO captions file nor a Karpathy split file: .*{hint}"):
            read_caption_refs(other)
    (tmp_path / "train.jsonl").write_text('{"a": 1}\n{"a": 2}\n')
    with pytest.raises(VlbertsError, match="a JSON-lines file, not COCO captions: VCR's\\? pass --captions_format=vcr"):
        read_caption_refs(tmp_path / "train.jsonl")


def test_conllu_reader_good_and_bad(tmp_path):
    good = ("# sent_id = a\n# text = a dog .\n1\ta\ta\tDET\tDT\t_\t2\tdet\t_\tEntity=3\n"
            "2\tdog\tdog\tNOUN\tNN\t_\t0\troot\t_\tEntity=3|SpaceAfter=No\n3\t.\t.\tPUNCT\t.\t_\t2\tpunct\t_\t_\n\n"
            "1-2\tdon't\t_\t_\t_\t_\t_\t_\t_\t_\n1\tdo\tdo\tAUX\tVBP\t_\t0\troot\t_\t_\n"
            "2\tn't\tnot\tPART\tRB\t_\t1\tneg\t_\t_\n")
    sents = parse_conllu(good)
    assert list(sents) == ["a", "2"]  # the sentence without sent_id gets its position
    assert sents["a"].tokens[1].misc == {"Entity": "3", "SpaceAfter": "No"} and sents["a"].is_tree()
    assert sents["2"].words == ("do", "n't") and sents["a"].arcs()[0] == (2, "det", 1)
    path = tmp_path / "bad.conllu"
    for text, message in [
        ("# sent_id = s\n1\ta\ta\tDET\tDT\t_\t2\tdet\t_\n", "expected 10 tab-separated columns"),
        ("1\ta\ta\tDET\tDT\t_\tx\tdet\t_\t_\n", "must be integers"),
        ("1\ta\ta\tDET\tDT\t_\t5\tdet\t_\t_\n", "outside 0..1"),
        ("# sent_id = s\n1\ta\ta\tX\tX\t_\t0\troot\t_\t_\n\n"
         "# sent_id = s\n1\tb\tb\tX\tX\t_\t0\troot\t_\t_\n", "duplicate"),
    ]:
        path.write_text(text)
        with pytest.raises(VlbertsError, match=message) as err:
            read_conllu(path)
        assert str(err.value).startswith(f"{path}: record ")


# --------------------------------------------------------------------------- command line

def test_cli_builds_a_world_and_reports_errors_in_one_line(tmp_path, capsys):
    out = tmp_path / "cli-world"
    result = CliRunner().invoke(app, ["world", "build", "--out", str(out), "--images", "12", "--seed", "2"])
    assert result.exit_code == 0, result.output
    assert "12 images" in result.output and (out / "world.json").is_file()
    assert len(list((out / "flickr30k_entities" / "Sentences").iterdir())) == 12
    with pytest.raises(SystemExit) as exit_:
        main(["world", "build", "--out", str(out), "--images", "12"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {out}: already exists")
