"""Reading VQA v2 question / annotation files into `VQAExample`s, and refusing bad ones."""

from __future__ import annotations

import json

import pytest

from vlberts.data.vqa import VQAExample, read_vqa
from vlberts.errors import VlbertsError


def _answers(strings):
    return [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(strings)]


def _files(tmp_path, questions, annotations=None):
    q = tmp_path / "q.json"
    q.write_text(json.dumps({"info": {}, "task_type": "Open-Ended", "questions": questions}))
    if annotations is None:
        return q, None
    a = tmp_path / "a.json"
    a.write_text(json.dumps({"info": {}, "annotations": annotations}))
    return q, a


QUESTIONS = [
    {"image_id": 42, "question": "What is it?", "question_id": 420},
    {"image_id": "img_7", "question": "Is it red?", "question_id": 70},
]
ANNOTATIONS = [  # deliberately in the reverse order of the questions
    {"question_type": "is it", "multiple_choice_answer": "yes", "answers": _answers(["yes"] * 9 + ["Yes!"]),
     "image_id": "img_7", "answer_type": "yes/no", "question_id": 70},
    {"question_type": "what is", "multiple_choice_answer": "dog", "answers": _answers(["dog"] * 5 + ["a dog."] * 5),
     "image_id": 42, "answer_type": "other", "question_id": 420},
]  # fmt: skip


def test_read_questions_only(tmp_path):
    q, _ = _files(tmp_path, QUESTIONS)
    assert read_vqa(q) == [
        VQAExample(question_id=420, image_id=42, question="What is it?"),
        VQAExample(question_id=70, image_id="img_7", question="Is it red?"),
    ]
    assert not read_vqa(q)[0].annotated


def test_read_with_annotations_in_annotation_order(tmp_path):
    q, a = _files(tmp_path, QUESTIONS, ANNOTATIONS)
    examples = read_vqa(q, a)
    assert examples == [
        VQAExample(70, "img_7", "Is it red?", ["yes"] * 9 + ["Yes!"], "yes", "yes/no", "is it"),
        VQAExample(420, 42, "What is it?", ["dog"] * 5 + ["a dog."] * 5, "dog", "other", "what is"),
    ]
    assert all(ex.annotated for ex in examples)


def test_answer_confidence_and_id_are_optional(tmp_path):
    anns = json.loads(json.dumps(ANNOTATIONS))
    anns[0]["answers"] = [{"answer": "yes"}] * 10
    q, a = _files(tmp_path, QUESTIONS, anns)
    assert read_vqa(q, a)[0].answers == ["yes"] * 10


def _error(tmp_path, questions=QUESTIONS, annotations=ANNOTATIONS) -> VlbertsError:
    q, a = _files(tmp_path, questions, annotations)
    with pytest.raises(VlbertsError) as exc:
        read_vqa(q, a)
    assert "\n" not in str(exc.value)
    return exc.value


def _edited(records, index, **changes):
    out = json.loads(json.dumps(records))
    for k, v in changes.items():
        if v is None:
            del out[index][k]
        else:
            out[index][k] = v
    return out


def test_errors_name_file_and_record(tmp_path):
    e = _error(tmp_path, questions=_edited(QUESTIONS, 1, question_id=True))
    assert (e.path, e.record) == (str(tmp_path / "q.json"), "questions[1]") and "integer" in e.message
    e = _error(tmp_path, questions=_edited(QUESTIONS, 0, image_id=[1]))
    assert (e.path, e.record) == (str(tmp_path / "q.json"), "questions[0]") and "image_id" in e.message
    e = _error(tmp_path, questions=_edited(QUESTIONS, 0, question=None))
    assert e.record == "questions[0]" and e.message == "missing field(s) question"
    e = _error(tmp_path, annotations=_edited(ANNOTATIONS, 1, multiple_choice_answer=3))
    assert (e.path, e.record) == (str(tmp_path / "a.json"), "annotations[1]")
    e = _error(tmp_path, annotations=_edited(ANNOTATIONS, 0, answers="yes"))
    assert e.record == "annotations[0]" and e.message == "answers must be a list of 10 objects, got str"
    e = _error(tmp_path, annotations=_edited(ANNOTATIONS, 0, answers=_answers(["yes"] * 9) + ["yes"]))
    assert e.record == "annotations[0].answers[9]" and e.message == "expected an object, got str"
    e = _error(tmp_path, annotations=_edited(ANNOTATIONS, 1, question_id=999))
    assert (e.path, e.record) == (str(tmp_path / "a.json"), "annotations[1]")
    assert e.message == "question_id 999 has no question in q.json"
    e = _error(tmp_path, annotations=ANNOTATIONS[:1])
    assert (e.path, e.record) == (str(tmp_path / "q.json"), "questions[0]")
    assert e.message == "question_id 420 has no annotation in a.json"
    e = _error(tmp_path, annotations=_edited(ANNOTATIONS, 0, image_id=42))
    assert e.record == "annotations[0]" and "image_id 42 differs from the question's image_id 'img_7'" in e.message


def test_skipping_a_bad_question_counts_it_once(tmp_path):
    """A question skipped as bad is one record: its annotation, left without a question, is not counted again
    (where the question's id can be read)."""
    from vlberts.errors import BadRecords

    for change in ({"question": None}, {"question": ""}, {"image_id": [1]}):
        bad = BadRecords(skip=True)
        got = read_vqa(*_files(tmp_path, _edited(QUESTIONS, 0, **change), ANNOTATIONS), bad=bad)
        assert [ex.question_id for ex in got] == [70] and bad.total == 1, (change, bad.to_dict())
    # an annotation whose question the file never had is still its own bad record
    bad = BadRecords(skip=True)
    read_vqa(*_files(tmp_path, QUESTIONS, [*ANNOTATIONS, _edited(ANNOTATIONS, 0, question_id=5)[0]]), bad=bad)
    assert bad.total == 1 and "question_id 5 has no question" in bad.first


def test_malformed_and_missing_files(tmp_path):
    (tmp_path / "q.json").write_text('{"questions": [}')
    with pytest.raises(VlbertsError, match=r"q\.json: malformed JSON at line 1"):
        read_vqa(tmp_path / "q.json")
    with pytest.raises(VlbertsError, match=r"nope\.json: file not found"):
        read_vqa(tmp_path / "nope.json")
    (tmp_path / "q.json").write_text('{"questions": {}}')
    with pytest.raises(VlbertsError, match="expected a JSON object with a 'questions' list"):
        read_vqa(tmp_path / "q.json")
