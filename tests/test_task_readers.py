"""Readers of the downstream-task formats (GQA, NLVR2, VCR, RefCOCO+), on small files written here by hand
to the released specifications (formats-and-metrics.md §2.3-2.6), including their awkward cases."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle

import pytest

from vlberts.data.gqa import read_gqa
from vlberts.data.nlvr2 import parse_identifier, read_nlvr2
from vlberts.data.refcoco import (
    read_detections,
    read_refcoco,
    read_refs,
    select_refs,
    write_refs_json,
    xywh_to_xyxy,
)
from vlberts.data.vcr import (
    GENDER_NEUTRAL_NAMES,
    rationale_context,
    read_vcr,
    read_vcr_metadata,
    render_tokens,
)
from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import read_json
from vlberts.safe_pickle import safe_load, safe_loads


def _write_jsonl(path, rows, extra_lines=()):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        for line in extra_lines:
            f.write(line + "\n")
    return path


# --------------------------------------------------------------------------- GQA


GQA_QUESTIONS = {
    "201307251": {
        "imageId": "2354786", "question": "Is the sky dark?", "answer": "yes",
        "fullAnswer": "Yes, the sky is dark.", "isBalanced": True,
        "types": {"structural": "verify", "semantic": "attr", "detailed": "verifyAttr"},
        "groups": {"global": None, "local": "06-sky_dark"},
        "entailed": ["201307252"], "equivalent": ["201307251"],
        "semantic": [{"operation": "select", "dependencies": [], "argument": "sky (2486325)"}],
        "semanticStr": "select: sky (2486325)->verify color: dark [0]", "annotations": {"answer": {}},
    },
    "201307252": {"imageId": "2354786", "question": "What color is the sky?", "answer": "dark blue",
                  "isBalanced": True, "types": {"structural": "query"}},
}  # fmt: skip


def test_gqa_reads_balanced_questions(tmp_path):
    path = tmp_path / "val_balanced_questions.json"
    path.write_text(json.dumps(GQA_QUESTIONS))
    q1, q2 = read_gqa(path, require_answers=True)
    assert (q1.question_id, q1.image_id, q1.question, q1.answer) == ("201307251", "2354786", "Is the sky dark?", "yes")
    assert q1.full_answer == "Yes, the sky is dark." and q1.is_balanced is True
    assert (q1.structural_type, q1.semantic_type, q1.detailed_type) == ("verify", "attr", "verifyAttr")
    assert q1.entailed == ("201307252",) and q1.equivalent == ("201307251",)
    assert q2.answer == "dark blue" and q2.structural_type == "query" and q2.semantic_type is None


def test_gqa_test_split_without_answers(tmp_path):
    # The released test/challenge files have only imageId, question and isBalanced.
    path = tmp_path / "testdev_balanced_questions.json"
    path.write_text(json.dumps({"20968379": {"imageId": "n288870", "question": "Is it a cat?", "isBalanced": True}}))
    (q,) = read_gqa(path)
    assert q.answer is None and not q.annotated and q.image_id == "n288870"
    with pytest.raises(VlbertsError) as err:
        read_gqa(path, require_answers=True)
    assert str(err.value) == f"{path}: record question 20968379: missing field answer"


def test_gqa_bad_records_name_file_and_question(tmp_path):
    path = tmp_path / "q.json"
    path.write_text(json.dumps({"7": {"question": "Is it red?", "answer": "no"}}))
    with pytest.raises(VlbertsError, match=r"q\.json: record question 7: missing field\(s\) imageId"):
        read_gqa(path)
    path.write_text(json.dumps({"8": {"imageId": "1", "question": "Is it red?", "answer": 3}}))
    with pytest.raises(VlbertsError, match=r"record question 8: field answer must be a string, got int"):
        read_gqa(path)
    path.write_text(json.dumps([{"imageId": "1", "question": "?"}]))  # a list (LXMERT's form) of GQA's records
    with pytest.raises(VlbertsError, match=r"q\.json: record \[0\]: missing field\(s\) question_id, img_id, sent"):
        read_gqa(path)
    path.write_text(json.dumps("questions"))
    with pytest.raises(VlbertsError, match="mapping question ids"):
        read_gqa(path)
    path.write_text('{"9": {"imageId": "1", "question": "Is')  # truncated download
    with pytest.raises(VlbertsError, match=r"q\.json: malformed JSON at line 1"):
        read_gqa(path)


def test_gqa_reads_lxmerts_converted_list(tmp_path):
    """LXMERT's data/gqa/*.json: a list of {question_id, img_id, sent, label: {answer: 1.0}} (submit.json
    without labels); the same questions as GQA's own file, less the fields LXMERT dropped."""
    (tmp_path / "gqa.json").write_text(json.dumps(GQA_QUESTIONS))
    lxmert = [{"img_id": r["imageId"], "label": {r["answer"]: 1.0}, "question_id": qid, "sent": r["question"]}
              for qid, r in GQA_QUESTIONS.items()]
    (tmp_path / "valid.json").write_text(json.dumps(lxmert))
    ours, theirs = read_gqa(tmp_path / "gqa.json"), read_gqa(tmp_path / "valid.json", require_answers=True)
    assert [(q.question_id, q.image_id, q.question, q.answer) for q in theirs] == \
           [(q.question_id, q.image_id, q.question, q.answer) for q in ours]
    (tmp_path / "submit.json").write_text(json.dumps([{"img_id": "n1", "question_id": 5, "sent": "Is it red?"}]))
    (q,) = read_gqa(tmp_path / "submit.json")
    assert (q.question_id, q.image_id, q.answer) == ("5", "n1", None)
    for rows, message in [
        ([lxmert[0], lxmert[0]], r"\[1\] \(question 201307251\): duplicate question id 201307251 \(first at \[0\]\)"),
        ([dict(lxmert[0], label={"yes": 1.0, "no": 1.0})], r"\[0\] \(question 201307251\): label must hold one answer"),
        ([dict(lxmert[0], sent=" ")], r"\[0\] \(question 201307251\): field question is empty"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps(rows))
        with pytest.raises(VlbertsError, match=r"bad\.json: record " + message):
            read_gqa(tmp_path / "bad.json")
    bad = BadRecords(skip=True)
    assert len(read_gqa(tmp_path / "bad.json", bad=bad)) == 0 and bad.total == 1


# --------------------------------------------------------------------------- NLVR2


def _nlvr2_row(identifier, label, sentence="There are two dogs.", **extra):
    row = {"identifier": identifier, "sentence": sentence, "left_url": "http://l.jpg", "right_url": "http://r.jpg",
           "writer": "103", "validation": {"97": "True"}, "synset": "n02084071", "query": "dog"}
    if label is not None:
        row["label"] = label
    row.update(extra)
    return row


def test_nlvr2_reads_true_false_strings_and_image_ids(tmp_path):
    path = _write_jsonl(tmp_path / "dev.json", [
        _nlvr2_row("dev-850-0-0", "True"),
        _nlvr2_row("dev-850-1-0", "False"),
        _nlvr2_row("train-10171-3-2", "False", directory=31),
    ], extra_lines=[""])  # a trailing blank line is fine
    a, b, c = read_nlvr2(path, require_labels=True)
    assert a.label is True and b.label is False and c.label is False  # strings, not truthiness of "False"
    assert a.image_ids == ("dev-850-0-img0", "dev-850-0-img1")
    assert b.left_image_id == "dev-850-1-img0" and b.right_image_id == "dev-850-1-img1"
    assert a.sentence_key == b.sentence_key == "dev-850--0"
    assert c.sentence_key == "train-10171--2" and c.directory == "31" and c.left_image_id == "train-10171-3-img0"
    assert a.left_url == "http://l.jpg"


def test_nlvr2_reads_lxmerts_converted_list(tmp_path):
    """LXMERT's data/nlvr2/*.json: one JSON list of {identifier, img0, img1, label 0/1, sent, uid}: the same
    statements as NLVR2's JSON lines, the images as named there."""
    rows = [_nlvr2_row("dev-850-0-0", "True"), _nlvr2_row("dev-850-1-0", "False", sentence="One dog.")]
    ours = read_nlvr2(_write_jsonl(tmp_path / "dev.json", rows))
    lxmert = [{"identifier": r["identifier"], "img0": r["identifier"][:-2] + "-img0", "img1": r["identifier"][:-2] + "-img1",
               "label": int(r["label"] == "True"), "sent": r["sentence"], "uid": f"nlvr2_dev_{i}"} for i, r in enumerate(rows)]
    (tmp_path / "valid.json").write_text(json.dumps(lxmert))
    theirs = read_nlvr2(tmp_path / "valid.json", require_labels=True)
    assert [dataclasses.replace(e, left_url=None, right_url=None) for e in ours] == theirs
    for change, message in [
        ({"label": "True"}, r"label must be 0 or 1 \(LXMERT's form\), got 'True'"),
        ({"label": 1.0}, r"label must be 0 or 1"),
        ({"img1": ""}, r"img1 must be a non-empty string"),
        ({"sent": None}, r"field sentence must be a string"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps([lxmert[0], {**lxmert[1], **change}]))
        with pytest.raises(VlbertsError, match=r"bad\.json: record \[1\]: " + message):
            read_nlvr2(tmp_path / "bad.json")
    (tmp_path / "dup.json").write_text(json.dumps([lxmert[0], lxmert[0]]))
    with pytest.raises(VlbertsError, match=r"dup\.json: record \[1\]: duplicate identifier dev-850-0-0 \(first at \[0\]\)"):
        read_nlvr2(tmp_path / "dup.json")


def test_nlvr2_identifier_parts():
    ident = parse_identifier("test1-1000-2-1")
    assert (ident.split, ident.set_id, ident.pair_id, ident.sentence_id) == ("test1", "1000", "2", "1")
    with pytest.raises(ValueError):
        parse_identifier("dev-850-0")  # three parts


@pytest.mark.parametrize("label", [True, "true", 1, "yes"])
def test_nlvr2_label_must_be_the_string_true_or_false(tmp_path, label):
    path = _write_jsonl(tmp_path / "dev.json", [_nlvr2_row("dev-1-0-0", "True"), _nlvr2_row("dev-1-1-0", label)])
    with pytest.raises(VlbertsError) as err:
        read_nlvr2(path)
    assert str(err.value) == (
        f'{path}: record line 2 (dev-1-1-0): label must be the string "True" or "False", got {label!r}'
    )


def test_nlvr2_truncated_and_bad_lines_name_file_and_line(tmp_path):
    good = json.dumps(_nlvr2_row("dev-1-0-0", "True"))
    path = tmp_path / "dev.json"
    path.write_text(good + "\n" + good[: len(good) // 2] + "\n")  # second line cut off mid-record
    with pytest.raises(VlbertsError, match=r"dev\.json: record line 2: malformed JSON line") as err:
        read_nlvr2(path)
    # the column is the line's own (the cut), not that of the line break after it (column 1 of a next line)
    expected = json.JSONDecoder()
    try:
        expected.decode(good[: len(good) // 2])
    except json.JSONDecodeError as e:
        assert str(err.value).endswith(f"(column {e.colno})") and e.colno > 1
    path.write_text('{"a": "unterminated')
    with pytest.raises(VlbertsError, match=r"malformed JSON at line 1 column 7: Unterminated string starting$"):
        read_json(path)
    _write_jsonl(path, [_nlvr2_row("dev-1-0-0", "True"), _nlvr2_row("dev-1-0-0", "False")])
    with pytest.raises(VlbertsError, match=r"record line 2: duplicate identifier dev-1-0-0 \(first at line 1\)"):
        read_nlvr2(path)
    _write_jsonl(path, [_nlvr2_row("dev-1-img0", "True")])
    with pytest.raises(VlbertsError, match=r"record line 1 \(dev-1-img0\): identifier .* is not split-setid-pairid"):
        read_nlvr2(path)
    _write_jsonl(path, [_nlvr2_row("test2-1-0-0", None)])
    assert read_nlvr2(path)[0].label is None  # unlabelled (hidden test) file
    with pytest.raises(VlbertsError, match="record line 1: missing field label"):
        read_nlvr2(path, require_labels=True)


# --------------------------------------------------------------------------- VCR


def _vcr_row(**over):
    row = {
        "movie": "3015_CHARLIE_ST_CLOUD", "objects": ["person", "person", "person", "wine glass"],
        "interesting_scores": [0], "answer_likelihood": "possible",
        "img_fn": "lsmdc_3015/3015_00.23.57.935@0.jpg", "metadata_fn": "lsmdc_3015/3015_00.23.57.935@0.json",
        "question_orig": "Does 3 feel comfortable?", "answer_orig": "No she does not",
        "rationale_orig": "She is standing with her arms crossed",
        "question": ["Does", [2], "feel", "comfortable", "?"],
        "answer_choices": [["Yes", "because", [0, 1], "are", "smiling", "."], ["No", "she", "does", "not", "."],
                           ["Yes", "she", "holds", [3], "."], ["No", "."]],
        "answer_label": 1,
        "rationale_choices": [[[2], "is", "standing", "with", "her", "arms", "crossed", "."],
                              ["She", "is", "happy", "."],
                              [[0], "looks", "at", [2], "."], ["It", "is", "night", "."]],
        "rationale_label": 0, "answer_match_iter": [3, 0, 2, 1], "answer_sources": [3287, 0, 10184, 2260],
        "rationale_match_iter": [1, 3, 2, 0], "rationale_sources": [1, 2, 3, 4],
        "img_id": "val-0", "question_number": 1, "annot_id": "val-1", "match_fold": "val-0", "match_index": 1,
    }  # fmt: skip
    row.update(over)
    return row


def test_vcr_reads_multi_index_references(tmp_path):
    path = _write_jsonl(tmp_path / "val.jsonl", [_vcr_row(), _vcr_row(annot_id="test-1", answer_label=None,
                                                                       rationale_label=None)])
    ex, test_ex = read_vcr(path)
    assert ex.annot_id == "val-1" and ex.img_id == "val-0" and ex.movie == "3015_CHARLIE_ST_CLOUD"
    assert ex.objects == ("person", "person", "person", "wine glass")
    assert ex.question == ("Does", (2,), "feel", "comfortable", "?")
    assert ex.answer_choices[0][2] == (0, 1)  # a two-object reference stays one token
    assert (ex.answer_label, ex.rationale_label) == (1, 0) and ex.annotated
    assert not test_ex.annotated and test_ex.answer_label is None
    # QA->R reads the question followed by the *gold* answer.
    assert rationale_context(ex) == ("Does", (2,), "feel", "comfortable", "?", "No", "she", "does", "not", ".")
    with pytest.raises(ValueError):
        rationale_context(test_ex)


def test_vcr_render_names_and_alignment():
    objects = ["person", "dog", "person", "wine glass"]
    tokens = ["Why", "is", [0, 2], "near", [3], "?"]
    sep = render_tokens(tokens, objects)
    assert sep.text == "Why is Casey Jessie near wine glass ?"  # person 0 -> Casey, person 2 -> Jessie
    assert sep.refs == ((), (), (0,), (2,), (), (3,), (3,), ())  # both words of "wine glass" point at object 3
    joined = render_tokens(tokens, objects, join="and")
    assert joined.text == "Why is Casey and Jessie near wine glass ?"
    assert joined.refs == ((), (), (0,), (), (2,), (), (3,), (3,), ())  # the inserted "and" refers to nothing
    assert joined.word_positions(4) == ((2,), (), (4,), (6, 7))
    assert render_tokens([[1]], objects).words == ("dog",)


def test_vcr_person_names_cycle_over_fifteen():
    objects = ["person"] * 17
    words = render_tokens([[6], [10], [15], [16]], objects).words
    assert len(GENDER_NEUTRAL_NAMES) == 15
    assert words == ("Peyton", "Peyton", "Casey", "Riley")  # the released list has Peyton twice; 15 -> 0


def test_vcr_bad_references_name_file_and_line(tmp_path):
    path = tmp_path / "val.jsonl"
    # 1-based thinking: 4 objects, index 4 does not exist (indices are 0-based).
    _write_jsonl(path, [_vcr_row(), _vcr_row(question=["Is", [4], "ok", "?"])])
    with pytest.raises(VlbertsError) as err:
        read_vcr(path)
    assert str(err.value) == (f"{path}: record line 2: question[1] refers to object 4, but the example has 4 objects "
                              "(indices are 0-based)")
    _write_jsonl(path, [_vcr_row(question=["Is", [], "ok"])])
    with pytest.raises(VlbertsError, match=r"record line 1: question\[1\] must be a word or a non-empty list"):
        read_vcr(path)
    _write_jsonl(path, [_vcr_row(answer_choices=[["a"], ["b"], ["c"]])])
    with pytest.raises(VlbertsError, match="record line 1: answer_choices must be a list of 4 token lists, got 3"):
        read_vcr(path)
    _write_jsonl(path, [_vcr_row(rationale_label=4)])
    with pytest.raises(VlbertsError, match=r"record line 1: rationale_label must be an integer in 0\.\.3"):
        read_vcr(path)
    # Text that would reach the model as nothing: an empty question or choice, a blank class name.
    for change, message in (({"question": []}, "question is empty"), ({"question": [" "]}, "question is empty"),
                            ({"answer_choices": [[], ["b"], ["c"], ["d"]]}, r"answer_choices\[0\] is empty"),
                            ({"objects": ["person", "", "person", "dog"]}, r"objects\[1\] is an empty class name")):
        _write_jsonl(path, [_vcr_row(**change)])
        with pytest.raises(VlbertsError, match=rf"record line 1: {message}$"):
            read_vcr(path)
    row = json.dumps(_vcr_row())
    path.write_text(row + "\n" + row[:-40] + "\n")
    with pytest.raises(VlbertsError, match=r"val\.jsonl: record line 2: malformed JSON line"):
        read_vcr(path)


def test_vcr_metadata(tmp_path):
    path = tmp_path / "meta.json"
    path.write_text(json.dumps({"boxes": [[10, 20, 110, 220, 0.99], [0.5, 1.5, 30.5, 41.5, 0.7]],
                                "segms": [[[[10, 20], [110, 20], [110, 220]]], []],
                                "names": ["person", "dog"], "width": 640, "height": 360}))
    meta = read_vcr_metadata(path)
    assert meta.boxes == ((10.0, 20.0, 110.0, 220.0), (0.5, 1.5, 30.5, 41.5))
    assert meta.scores == (0.99, 0.7) and meta.names == ("person", "dog") and (meta.width, meta.height) == (640, 360)
    path.write_text(json.dumps({"boxes": [[10, 20, 110, 220]], "names": ["person"], "width": 640, "height": 360}))
    with pytest.raises(VlbertsError, match=r"record boxes\[0\]: expected \[x1, y1, x2, y2, score\]"):
        read_vcr_metadata(path)


# --------------------------------------------------------------------------- RefCOCO+

REFS = [
    {"ref_id": 0, "ann_id": 101, "image_id": 581857, "category_id": 1, "split": "train",
     "file_name": "COCO_train2014_000000581857_101.jpg", "sent_ids": [0, 1],
     "sentences": [{"raw": "The lady in Blue", "sent": "the lady in blue", "sent_id": 0,
                    "tokens": ["the", "lady", "in", "blue"]},
                   {"raw": "left woman", "sent": "left woman", "sent_id": 1, "tokens": ["left", "woman"]}]},
    {"ref_id": 1, "ann_id": 102, "image_id": 581857, "category_id": 90, "split": "testB",
     "file_name": "COCO_train2014_000000581857_102.jpg", "sent_ids": [2],
     "sentences": [{"raw": "toothbrush", "sent": "toothbrush", "sent_id": 2, "tokens": ["toothbrush"]}]},
    {"ref_id": 2, "ann_id": 103, "image_id": 9, "category_id": 1, "split": "testA",
     "file_name": "COCO_train2014_000000000009_103.jpg", "sent_ids": [3],
     "sentences": [{"raw": "man", "sent": "man", "sent_id": 3, "tokens": ["man"]}]},
    {"ref_id": 3, "ann_id": 104, "image_id": 9, "category_id": 1, "split": "testAB",
     "file_name": "COCO_train2014_000000000009_104.jpg", "sent_ids": [4],
     "sentences": [{"raw": "guy", "sent": "guy", "sent_id": 4, "tokens": ["guy"]}]},
]  # fmt: skip

INSTANCES = {
    "images": [{"id": 581857, "file_name": "COCO_train2014_000000581857.jpg", "width": 640, "height": 480},
               {"id": 9, "file_name": "COCO_train2014_000000000009.jpg", "width": 640, "height": 480}],
    "annotations": [
        {"id": 101, "image_id": 581857, "category_id": 1, "bbox": [103.93, 299.99, 134.22, 177.42],
         "area": 1.0, "iscrowd": 0, "segmentation": [[1, 2, 3, 4, 5, 6]]},
        {"id": 102, "image_id": 581857, "category_id": 90, "bbox": [10, 10, 5, 20], "area": 100.0, "iscrowd": 0},
        {"id": 103, "image_id": 9, "category_id": 1, "bbox": [0, 0, 100, 200], "area": 1.0, "iscrowd": 0},
        {"id": 104, "image_id": 9, "category_id": 1, "bbox": [300, 0, 100, 200], "area": 1.0, "iscrowd": 0},
        {"id": 105, "image_id": 9, "category_id": 18, "bbox": [50, 50, 10, 10], "area": 1.0, "iscrowd": 0},
    ],
    "categories": [{"id": 1, "name": "person", "supercategory": "person"},
                   {"id": 18, "name": "dog", "supercategory": "animal"},
                   {"id": 90, "name": "toothbrush", "supercategory": "indoor"}],
}  # fmt: skip


@pytest.fixture()
def refcoco_files(tmp_path):
    refs_p = tmp_path / "refs(unc).p"
    refs_p.write_bytes(pickle.dumps(REFS, protocol=2))  # as written by Python 2's cPickle (protocol 2)
    inst = tmp_path / "instances.json"
    inst.write_text(json.dumps(INSTANCES))
    return refs_p, inst


def test_refcoco_reads_pickle_through_restricted_unpickler(refcoco_files):
    refs_p, inst = refcoco_files
    data = read_refcoco(refs_p, inst)
    assert [r.ref_id for r in data.refs] == [0, 1, 2, 3]
    ref = data.refs[0]
    assert (ref.ann_id, ref.image_id, ref.category_id, ref.split) == (101, 581857, 1, "train")
    assert ref.sentences[0].raw == "The lady in Blue" and ref.sentences[0].tokens == ("the", "lady", "in", "blue")
    # COCO category ids are 1-based with gaps; the classifier index is contiguous and 0-based.
    assert data.category_index == {1: 0, 18: 1, 90: 2}
    assert data.categories[90] == "toothbrush"
    exprs = data.expressions("train")
    assert [(e.ref_id, e.sent_id, e.sent) for e in exprs] == [(0, 0, "the lady in blue"), (0, 1, "left woman")]
    assert exprs[0].gold_bbox == (103.93, 299.99, 134.22, 177.42)
    assert exprs[0].gold_box_xyxy == pytest.approx((103.93, 299.99, 238.15, 477.41))
    assert [a.id for a in data.image_annotations(9)] == [103, 104, 105]  # ground-truth-region candidates
    assert xywh_to_xyxy((1.0, 2.0, 3.0, 4.0)) == (1.0, 2.0, 4.0, 6.0)


def test_refcoco_json_form_equals_pickle(refcoco_files, tmp_path):
    refs_p, _ = refcoco_files
    from_pickle = read_refs(refs_p)
    refs_json = tmp_path / "refs.json"
    write_refs_json(refs_json, from_pickle)
    assert json.loads(refs_json.read_text()) == REFS  # same keys and values as the pickle's dicts
    assert read_refs(refs_json) == from_pickle


def test_refcoco_split_selection(refcoco_files):
    refs = read_refs(refcoco_files[0])
    ids = {s: [r.ref_id for r in select_refs(refs, s)] for s in ("train", "val", "testA", "testB", "test", "testAB")}
    # refer.py: testA/testB match by the letter, so a testAB ref belongs to both; "test" takes every test split.
    assert ids == {"train": [0], "val": [], "testA": [2, 3], "testB": [1, 3], "test": [1, 2, 3], "testAB": [3]}
    with pytest.raises(VlbertsError, match="unknown split 'dev'"):
        select_refs(refs, "dev")


def test_refcoco_inconsistent_files_name_the_ref(refcoco_files, tmp_path):
    refs_p, inst = refcoco_files
    bad = [dict(REFS[0]), dict(REFS[1], category_id=18)]
    p = tmp_path / "bad.p"
    p.write_bytes(pickle.dumps(bad, protocol=2))
    with pytest.raises(VlbertsError) as err:
        read_refcoco(p, inst)
    assert str(err.value) == f"{p}: record refs[1] (ref_id 1): category_id 18 differs from its annotation's 90"
    p.write_bytes(pickle.dumps([dict(REFS[0], category_id=0)], protocol=2))  # a 0-based id slipped in
    with pytest.raises(VlbertsError, match=r"refs\[0\] \(ref_id 0\): category_id 0: COCO category ids are 1-based"):
        read_refs(p)
    p.write_bytes(pickle.dumps([dict(REFS[0], ann_id=999)], protocol=2))
    with pytest.raises(VlbertsError, match=r"refs\[0\] \(ref_id 0\): ann_id 999 is not in instances\.json"):
        read_refcoco(p, inst)
    p.write_bytes(pickle.dumps({"refs": REFS}, protocol=2))
    with pytest.raises(VlbertsError, match="expected a list of refs, got dict"):
        read_refs(p)
    # Re-pickled from Python 3 with bytes for names: the fields are there, as byte strings, and the message says so
    p.write_bytes(pickle.dumps([{k.encode(): v for k, v in REFS[0].items()}], protocol=2))
    with pytest.raises(VlbertsError, match=r"refs\[0\]: missing field\(s\) .* \(present as byte strings, b'\w+': the "
                                           r"file's keys must be text\)"):
        read_refs(p)


def test_refcoco_detections(tmp_path):
    path = tmp_path / "dets.json"
    path.write_text(json.dumps([{"image_id": 9, "box": [0, 0, 10, 10], "category_id": 1, "score": 0.9, "det_id": 1},
                                {"image_id": 9, "box": [5, 5, 10, 10], "category_id": 1, "score": 0.8, "det_id": 2}]))
    assert read_detections(path) == {9: [(0.0, 0.0, 10.0, 10.0), (5.0, 5.0, 10.0, 10.0)]}
    path.write_text(json.dumps([{"image_id": 9, "box": [0, 0, 10]}]))
    with pytest.raises(VlbertsError, match=r"record detections\[0\]: bbox must be \[x, y, w, h\]"):
        read_detections(path)


# --------------------------------------------------------------------------- restricted unpickler


class _RemovesAFile:
    """Unpickling this with plain `pickle.loads` would delete `target` (a stand-in for any code execution)."""

    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.remove, (self.target,))


def test_safe_pickle_rejects_a_forbidden_global(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("still here")
    path = tmp_path / "refs(unc).p"
    path.write_bytes(pickle.dumps([{"ref_id": 0, "payload": _RemovesAFile(str(victim))}], protocol=2))
    with pytest.raises(VlbertsError) as err:
        read_refs(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: refused or malformed pickle: forbidden global ")
    assert f"{os.remove.__module__}.remove" in msg and "only builtin containers and scalars are allowed" in msg
    assert "\n" not in msg
    assert victim.read_text() == "still here"  # nothing from the file was run


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_safe_pickle_refuses_builtin_callables_but_allows_containers(tmp_path, protocol):
    data = pickle.dumps({"a": [1, 2.5, None, True], "b": ("x", b"y"), "c": {3, 4}, "d": frozenset({5})},
                        protocol=protocol)
    assert safe_loads(data) == {"a": [1, 2.5, None, True], "b": ("x", b"y"), "c": {3, 4}, "d": frozenset({5})}
    # GLOBAL 'builtins eval' + REDUCE: a builtin that is not a container/scalar type is refused too.
    evil = b"cbuiltins\neval\n(S'1+1'\ntR."
    with pytest.raises(VlbertsError, match="forbidden global builtins.eval"):
        safe_loads(evil, source="evil.p")
    # Python 3 bytes at protocol <= 2 go through _codecs.encode(text, "latin1"); no other codec is let through.
    with pytest.raises(VlbertsError, match=r"evil\.p: .*forbidden call _codecs\.encode\(\.\.\., 'zlib'\)"):
        safe_loads(b"c_codecs\nencode\n(Vabc\nVzlib\ntR.", source="evil.p")


def test_safe_pickle_reads_a_python2_protocol0_pickle(tmp_path):
    # What Python 2's ``pickle.dump(refs, f)`` writes by default: protocol 0, byte strings (S'...') holding
    # UTF-8, a unicode string (V...), an int and a long (L suffix).
    py2 = (b"(lp0\n(dp1\nS'sent'\np2\nS'caf\\xc3\\xa9 on the left'\np3\nsS'raw'\np4\nVCaf\\u00e9\np5\n"
           b"sS'ref_id'\np6\nI7\nsS'ann_id'\np7\nL1719310L\nsa.")
    path = tmp_path / "refs(unc).p"
    path.write_bytes(py2)
    assert safe_load(path) == [{"sent": "caf\u00e9 on the left", "raw": "Caf\u00e9", "ref_id": 7, "ann_id": 1719310}]


def test_safe_pickle_truncated_and_missing(tmp_path):
    path = tmp_path / "refs(unc).p"
    path.write_bytes(pickle.dumps(REFS, protocol=2)[:50])
    with pytest.raises(VlbertsError, match=r"refs\(unc\)\.p: truncated pickle"):
        safe_load(path)
    with pytest.raises(VlbertsError, match="file not found"):
        safe_load(tmp_path / "nope.p")


# --------------------------------------------------------------------------- blank text, every reader


def _blank_text_cases(tmp_path):
    """(reader call, expected message) for each format with one blank question, statement or caption."""
    from vlberts.data.coco import read_coco_captions, read_karpathy
    from vlberts.data.vqa import read_vqa

    def write(name, obj):
        p = tmp_path / name
        p.write_text(json.dumps(obj))
        return p

    vqa = write("vqa_q.json", {"questions": [{"question_id": 1, "image_id": 5, "question": "What colour?"},
                                             {"question_id": 2, "image_id": 5, "question": " "}]})
    gqa = write("gqa.json", {"7": {"imageId": "1", "question": "", "answer": "no"}})
    nlvr2 = _write_jsonl(tmp_path / "nlvr2.json", [_nlvr2_row("dev-850-0-0", "True"),
                                                   _nlvr2_row("dev-850-1-0", "False", sentence="\t")])
    coco = write("captions.json", {"images": [{"id": 5, "file_name": "5.jpg"}],
                                   "annotations": [{"id": 1, "image_id": 5, "caption": "  "}]})
    karpathy = write("karpathy.json", {"images": [{"filename": "5.jpg", "split": "train", "sentences": [
        {"raw": "", "tokens": []}]}]})
    refs = tmp_path / "refs.p"
    refs.write_bytes(pickle.dumps([REFS[0], dict(REFS[1], sentences=[dict(REFS[1]["sentences"][0], sent="")])],
                                  protocol=2))
    return [
        (lambda: read_vqa(vqa), r"vqa_q\.json: record questions\[1\]: field question is empty"),
        (lambda: read_gqa(gqa), r"gqa\.json: record question 7: field question is empty"),
        (lambda: read_nlvr2(nlvr2), r"nlvr2\.json: record line 2: field sentence is empty"),
        (lambda: read_coco_captions(coco), r"captions\.json: record annotations\[0\]: field caption is empty"),
        (lambda: read_karpathy(karpathy), r"karpathy\.json: record images\[0\]\.sentences\[0\]: field raw is empty"),
        (lambda: read_refs(refs), r"refs\.p: record refs\[1\] \(ref_id 1\) sentences\[0\]: field sent is empty"),
    ]


def test_blank_question_statement_or_caption_is_a_bad_record(tmp_path):
    # A blank text would reach the model as [CLS] [SEP] alone: trained or scored on nothing, silently.
    for read, message in _blank_text_cases(tmp_path):
        with pytest.raises(VlbertsError, match=message):
            read()


def test_blank_question_is_skipped_and_counted_with_skip_bad(tmp_path):
    from vlberts.data.vqa import read_vqa
    from vlberts.errors import BadRecords

    _blank_text_cases(tmp_path)
    bad = BadRecords(skip=True)
    (kept,) = read_vqa(tmp_path / "vqa_q.json", bad=bad)
    assert kept.question_id == 1 and bad.total == 1
