"""Reading the real VQA v2 question and annotation files.

Formats (formats-and-metrics.md §2.2, Goyal et al. 2017):

* questions ``v2_OpenEnded_mscoco_{split}_questions.json``:
  ``{"questions": [{image_id, question, question_id}], ...}``
* annotations ``v2_mscoco_{split}_annotations.json``:
  ``{"annotations": [{question_type, multiple_choice_answer, answers: [{answer, answer_confidence,
  answer_id}] x 10, image_id, answer_type, question_id}], ...}``

Test splits ship without annotations, so annotations are optional. When they are given, every
annotation must belong to a question and every question must have exactly one annotation: the
official evaluator (GT-Vision-Lab/VQA ``vqaTools/vqa.py``) indexes both files by question_id and
silently lets a later duplicate win, which we refuse instead.

This module only reads and checks; answer normalisation, accuracy and soft scores live in
`vlberts.tasks.vqa`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import read_json, require_keys, require_text

# Every VQA v1/v2 question was answered by 10 workers; the official accuracy (a 10-choose-9 average)
# and the 0.3-step soft scores are defined for exactly that many.
NUM_GT_ANSWERS = 10

_QUESTION_KEYS = ("image_id", "question", "question_id")
_ANNOTATION_KEYS = (
    "question_type",
    "multiple_choice_answer",
    "answers",
    "image_id",
    "answer_type",
    "question_id",
)


@dataclass(frozen=True)
class VQAExample:
    """One VQA question, with its ten raw ground-truth answers when annotated.

    `answers` are the annotators' strings exactly as stored (not normalised); it is empty, and the
    three annotation fields are None, for an unannotated (test) question.
    """

    question_id: int
    image_id: int | str
    question: str
    answers: list[str] = field(default_factory=list)
    multiple_choice_answer: str | None = None
    answer_type: str | None = None  # "yes/no" | "number" | "other" in VQA v2
    question_type: str | None = None  # e.g. "what color is the" (65 prefixes in VQA v2)

    @property
    def annotated(self) -> bool:
        return bool(self.answers)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_str(rec: dict, key: str, *, path: Path, record: str) -> str:
    value = rec[key]
    if not isinstance(value, str):
        raise VlbertsError(f"field {key} must be a string, got {type(value).__name__}", path=path, record=record)
    return value


def _check_question_id(rec: dict, *, path: Path, record: str) -> int:
    qid = rec["question_id"]
    if not _is_int(qid):
        raise VlbertsError(f"question_id must be an integer, got {qid!r}", path=path, record=record)
    return qid


def _check_image_id(rec: dict, *, path: Path, record: str) -> int | str:
    # COCO image ids are integers; other VQA-format sets (and the embedded world) may use strings.
    image_id = rec["image_id"]
    if not (_is_int(image_id) or isinstance(image_id, str)):
        raise VlbertsError(f"image_id must be an integer or a string, got {image_id!r}", path=path, record=record)
    return image_id


def _top_level_list(obj: Any, key: str, *, path: Path) -> list:
    if not isinstance(obj, dict) or not isinstance(obj.get(key), list):
        raise VlbertsError(f"expected a JSON object with a '{key}' list (the VQA v2 format)", path=path)
    return obj[key]


def _read_questions(path: Path, bad: BadRecords) -> tuple[list[VQAExample], dict[int, int], dict[int, int]]:
    """Questions in file order, question_id -> index into that list, and question_id -> record position."""
    records = _top_level_list(read_json(path), "questions", path=path)
    examples: list[VQAExample] = []
    index: dict[int, int] = {}
    first_at: dict[int, int] = {}  # question_id -> its record's position in the file
    for i, rec in enumerate(records):
        where = f"questions[{i}]"
        try:
            require_keys(rec, _QUESTION_KEYS, path=path, record=where)
            qid = _check_question_id(rec, path=path, record=where)
            image_id = _check_image_id(rec, path=path, record=where)
            question = require_text(rec["question"], "question", path=path, record=where)
            if qid in index:
                raise VlbertsError(f"duplicate question_id {qid} (first at questions[{first_at[qid]}])", path=path, record=where)
        except VlbertsError as err:
            bad.handle(err)
            continue
        index[qid], first_at[qid] = len(examples), i
        examples.append(VQAExample(question_id=qid, image_id=image_id, question=question))
    return examples, index, first_at


def _read_answers(rec: dict, *, path: Path, record: str) -> list[str]:
    answers = rec["answers"]
    if not isinstance(answers, list) or len(answers) != NUM_GT_ANSWERS:
        got = f"{len(answers)}" if isinstance(answers, list) else type(answers).__name__
        raise VlbertsError(f"answers must be a list of {NUM_GT_ANSWERS} objects, got {got}", path=path, record=record)
    out = []
    for j, ans in enumerate(answers):
        # answer_confidence and answer_id are not read: neither the official accuracy nor the soft
        # scores use them, so files that omit them are accepted.
        require_keys(ans, ("answer",), path=path, record=f"{record}.answers[{j}]")
        out.append(_check_str(ans, "answer", path=path, record=f"{record}.answers[{j}]"))
    return out


def read_vqa(
    questions_path: str | Path, annotations_path: str | Path | None = None, bad: BadRecords | None = None
) -> list[VQAExample]:
    """Read a VQA v2 questions file and, optionally, its annotations file.

    Returns one `VQAExample` per question. Without annotations the order is the questions file's;
    with annotations it is the annotations file's, the order in which the official evaluator
    iterates (and sums) questions. Bad input raises `VlbertsError` naming the file and the record
    (``questions[i]``, ``annotations[i]``, ``annotations[i].answers[j]``); with `bad` skipping, a bad
    record is dropped and counted instead (and so is a question left without its annotation).
    """
    bad = bad if bad is not None else BadRecords()
    questions_path = Path(questions_path)
    questions, q_index, q_record = _read_questions(questions_path, bad)
    if annotations_path is None:
        return questions

    annotations_path = Path(annotations_path)
    records = _top_level_list(read_json(annotations_path), "annotations", path=annotations_path)
    examples: list[VQAExample] = []
    seen: dict[int, int] = {}
    for i, rec in enumerate(records):
        where = f"annotations[{i}]"
        try:
            require_keys(rec, _ANNOTATION_KEYS, path=annotations_path, record=where)
            qid = _check_question_id(rec, path=annotations_path, record=where)
            if qid in seen:
                raise VlbertsError(
                    f"duplicate annotation for question_id {qid} (first at annotations[{seen[qid]}])",
                    path=annotations_path,
                    record=where,
                )
            seen[qid] = i
            if qid not in q_index:
                raise VlbertsError(
                    f"question_id {qid} has no question in {questions_path.name}", path=annotations_path, record=where
                )
            question = questions[q_index[qid]]
            image_id = _check_image_id(rec, path=annotations_path, record=where)
            if image_id != question.image_id:
                raise VlbertsError(
                    f"image_id {image_id!r} differs from the question's image_id {question.image_id!r} "
                    f"in {questions_path.name}",
                    path=annotations_path,
                    record=where,
                )
            examples.append(
                VQAExample(
                    question_id=qid,
                    image_id=image_id,
                    question=question.question,
                    answers=_read_answers(rec, path=annotations_path, record=where),
                    multiple_choice_answer=_check_str(rec, "multiple_choice_answer", path=annotations_path, record=where),
                    answer_type=_check_str(rec, "answer_type", path=annotations_path, record=where),
                    question_type=_check_str(rec, "question_type", path=annotations_path, record=where),
                )
            )
        except VlbertsError as err:
            bad.handle(err)

    for question in questions:
        if question.question_id not in seen:
            bad.handle(VlbertsError(
                f"question_id {question.question_id} has no annotation in {annotations_path.name}",
                path=questions_path,
                record=f"questions[{q_record[question.question_id]}]",
            ), "question without annotation")
    return examples
