"""Reading the real VQA v2 question and annotation files.

Formats (formats-and-metrics.md §2.2, Goyal et al. 2017):

* questions ``v2_OpenEnded_mscoco_{split}_questions.json``:
  ``{"questions": [{image_id, question, question_id}], ...}``
* annotations ``v2_mscoco_{split}_annotations.json``:
  ``{"annotations": [{question_type, multiple_choice_answer, answers: [{answer, answer_confidence,
  answer_id}] x 10, image_id, answer_type, question_id}], ...}``

* Pythia's (MMF's) imdb ``imdb_{split}.npy``, what VisualBERT's and VL-BERT's VQA code read
  (formats-and-metrics.md §1.5): ``np.save`` of an object array whose element 0 is a header dict and
  every other element one question, ``{image_name, image_id, question_id, feature_path, question_str,
  question_tokens, all_answers, valid_answers}`` (the answers absent in a test split); MMF's later
  form is a dict ``{"metadata": ..., "data": [questions]}``. `read_vqa` reads it when the questions
  file ends in ``.npy`` (`read_vqa_imdb`); it holds its answers, so it takes no annotations file.
* LXMERT's converted files ``data/vqa/{train,nominival,minival,test}.json`` (its
  ``process_raw_data_scripts``, answers scored by hengyuan-hu's ``compute_softscore.py``): a JSON list
  of ``{answer_type, img_id, label: {answer: score}, question_id, question_type, sent}`` (no label in
  test), ``img_id`` the COCO file stem. It keeps each answer's soft score, not the ten answers, so a
  question is scored as LXMERT's evaluator scores it, by the label's score of the predicted answer
  (the official accuracy where the answer strings agree); `read_vqa` reads a questions file that holds
  a JSON list this way (`questions_format`).

* ViLBERT's answer targets ``cache/{train,val}_target.pkl`` (vilbert-multi-task's VQA data, written by
  hengyuan-hu's ``tools/compute_softscore.py``): a pickled list of ``{question_id, image_id, labels,
  scores}``, each label an index into ``cache/trainval_ans2label.pkl`` (the 3,129 answers) and each score
  its answer's 0.3-step soft score, beside the VQA v2 questions file. `read_vqa` reads one given as the
  annotations file (a ``.pkl``; through the restricted unpickler) with that answer table, into the same
  ``{answer: score}`` labels as LXMERT's lists.

Test splits ship without annotations, so annotations are optional. When they are given, every
annotation must belong to a question and every question must have exactly one annotation: the
official evaluator (GT-Vision-Lab/VQA ``vqaTools/vqa.py``) indexes both files by question_id and
silently lets a later duplicate win, which we refuse instead.

This module only reads and checks; answer normalisation, accuracy and soft scores live in
`vlberts.tasks.vqa`.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import atomic_open, first_char, read_json, require_keys, require_text
from vlberts.safe_pickle import read_npy, safe_load

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
_TARGET_KEYS = ("question_id", "image_id", "labels", "scores")  # ViLBERT's target.pkl records


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
    # LXMERT's files: {answer: soft score} in place of the ten answers (`answers` then empty); {} when none of
    # the question's answers is in LXMERT's table.
    label: dict[str, float] | None = None

    @property
    def annotated(self) -> bool:
        return bool(self.answers) or self.label is not None


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


def _read_questions(
    path: Path, data: Any, bad: BadRecords,
) -> tuple[list[VQAExample], dict[int, int], dict[int, int], set[int], int]:
    """Questions in file order, question_id -> index into that list, question_id -> record position, the
    ids of the questions skipped as bad (where the id itself could be read), whose annotations are then
    left out without being counted again, and how many were skipped with an id that could not be read
    (as many annotations without a question are theirs, and left out uncounted too)."""
    records = _top_level_list(data, "questions", path=path)
    examples: list[VQAExample] = []
    index: dict[int, int] = {}
    first_at: dict[int, int] = {}  # question_id -> its record's position in the file
    skipped: set[int] = set()
    unreadable = 0
    for i, rec in enumerate(records):
        where = f"questions[{i}]"
        qid = None
        try:
            require_keys(rec, ("question_id",), path=path, record=where)
            qid = _check_question_id(rec, path=path, record=where)  # first: a bad question is known by its id
            require_keys(rec, _QUESTION_KEYS, path=path, record=where)
            image_id = _check_image_id(rec, path=path, record=where)
            question = require_text(rec["question"], "question", path=path, record=where)
            if qid in index:
                raise VlbertsError(f"duplicate question_id {qid} (first at questions[{first_at[qid]}])", path=path, record=where)
        except VlbertsError as err:
            bad.handle(err)
            if qid is None:
                unreadable += 1
            elif qid not in index:
                skipped.add(qid)
            continue
        index[qid], first_at[qid] = len(examples), i
        examples.append(VQAExample(question_id=qid, image_id=image_id, question=question))
    return examples, index, first_at, skipped, unreadable


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
    questions_path: str | Path, annotations_path: str | Path | None = None, bad: BadRecords | None = None,
    answers: Sequence[str] | None = None,
) -> list[VQAExample]:
    """Read a VQA v2 questions file and, optionally, its annotations file (or a file that holds both: a
    Pythia imdb `.npy`, `read_vqa_imdb`; LXMERT's question list, `questions_format`). The annotations may
    be ViLBERT's target pickle (`is_target_pickle`), whose labels index `answers`, the answer table it was
    made with (trainval_ans2label.pkl, `tasks.vqa.read_answer_vocab`).

    Returns one `VQAExample` per question. Without annotations the order is the questions file's;
    with annotations it is the annotations file's, the order in which the official evaluator
    iterates (and sums) questions. Bad input raises `VlbertsError` naming the file and the record
    (``questions[i]``, ``annotations[i]``, ``annotations[i].answers[j]``; a target pickle's ``[i]``); with
    `bad` skipping, a bad record is dropped and counted instead (and so is a question left without its
    annotation).
    """
    bad = bad if bad is not None else BadRecords()
    questions_path = Path(questions_path)
    kind = questions_format(questions_path)
    if kind != "v2" and annotations_path:
        what = "an imdb .npy" if kind == "imdb" else "a JSON list (LXMERT's questions; VQA v2's are an object)"
        raise VlbertsError(f"{what} holds its questions' answers, so it takes no annotations file "
                           f"({Path(annotations_path).name} given)", path=questions_path)
    if kind == "imdb":
        return read_vqa_imdb(questions_path, bad)
    data = read_json(questions_path)
    if kind == "lxmert":
        return _read_lxmert(questions_path, data, bad)
    questions, q_index, q_record, q_skipped, unreadable = _read_questions(questions_path, data, bad)
    if not annotations_path:
        return questions

    annotations_path = Path(annotations_path)
    if is_target_pickle(annotations_path):
        if answers is None:
            raise VlbertsError("ViLBERT's target pickle names answers by their index in the answer table it was made "
                               "with: give that table (trainval_ans2label.pkl) as --answer_vocab", path=annotations_path)
        records, keys, name = target_records(annotations_path), _TARGET_KEYS, "[{}]"
        build = partial(_target_example, answers=tuple(answers))
    else:
        records = _top_level_list(read_json(annotations_path), "annotations", path=annotations_path)
        keys, name, build = _ANNOTATION_KEYS, "annotations[{}]", _annotation_example
    examples: list[VQAExample] = []
    seen: dict[int, str] = {}
    for i, rec in enumerate(records):
        where = name.format(i)
        try:
            require_keys(rec, ("question_id",), path=annotations_path, record=where)
            qid = _check_question_id(rec, path=annotations_path, record=where)
            if qid in seen:
                raise VlbertsError(f"duplicate annotation for question_id {qid} (first at {seen[qid]})",
                                   path=annotations_path, record=where)
            seen[qid] = where  # first: a bad annotation is its question's, which is not counted again below
            require_keys(rec, keys, path=annotations_path, record=where)
            if qid in q_skipped:  # its question was bad, and counted as such
                continue
            if qid not in q_index and unreadable:  # the annotation of a question whose id was bad, counted
                unreadable -= 1
                continue
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
            examples.append(build(rec, question, path=annotations_path, record=where))
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


def _annotation_example(rec: dict, question: VQAExample, *, path: Path, record: str) -> VQAExample:
    """A VQA v2 annotation record of `question` -> the annotated example."""
    return VQAExample(
        question_id=question.question_id,
        image_id=question.image_id,
        question=question.question,
        answers=_read_answers(rec, path=path, record=record),
        multiple_choice_answer=_check_str(rec, "multiple_choice_answer", path=path, record=record),
        answer_type=_check_str(rec, "answer_type", path=path, record=record),
        question_type=_check_str(rec, "question_type", path=path, record=record),
    )


# --------------------------------------------------------------------------- ViLBERT's target pickles

def is_target_pickle(path: str | Path) -> bool:
    """Whether an annotations file is ViLBERT's `{split}_target.pkl` (told by its suffix) rather than VQA v2 JSON."""
    return Path(path).suffix.lower() == ".pkl"


def warn_unless_pickled_table(table: str | Path, pickle: str | Path) -> None:
    """ViLBERT's target pickles label their answers by index into the table its preprocessing wrote
    (cache/trainval_ans2label.pkl, or trainval_label2ans.pkl); any other table names other answers at the same
    indices, and every score would be silently wrong. A table that is not a pickle gets a one-line warning on
    stderr naming both files (it may still be that table, converted)."""
    if Path(table).suffix.lower() != ".pkl":
        print(f"warning: {pickle}: its labels index ViLBERT's answer table (cache/trainval_ans2label.pkl); --answer_vocab "
              f"{table} is not that pickle: unless it lists the same answers in the same order, every answer is "
              "misnamed", file=sys.stderr)


def target_records(path: Path, keys: Sequence[str] = _TARGET_KEYS) -> list:
    """The records of a ViLBERT target pickle (VQA's, GQA's), through the restricted unpickler; anything but a
    list is an error naming the file and the record keys expected."""
    records = safe_load(path)
    if not isinstance(records, list):
        raise VlbertsError(f"expected a pickled list of {{{', '.join(keys)}}} records (ViLBERT's "
                           f"target.pkl), got a {type(records).__name__}", path=path)
    return records


def target_label(rec: dict, answers: Sequence[str], *, path: Path, record: str) -> dict[str, float]:
    """A ViLBERT target record's `labels` (indices into the answer table `answers`) and `scores` as an
    {answer: score} label (LXMERT's form); VQA's and GQA's target pickles share it. Lists of different
    lengths, an index outside the table, a label twice or a score outside [0, 1] name the record."""
    labels, scores = rec["labels"], rec["scores"]
    if not isinstance(labels, list) or not isinstance(scores, list) or len(labels) != len(scores):
        raise VlbertsError(f"labels and scores must be lists of one length, got {labels!r} and {scores!r}",
                           path=path, record=record)
    label: dict[str, float] = {}
    for index, score in zip(labels, scores):
        if not _is_int(index) or not 0 <= index < len(answers):
            raise VlbertsError(f"label {index!r} is not an index into the {len(answers)}-answer table",
                               path=path, record=record)
        if answers[index] in label:
            raise VlbertsError(f"label {index} ({answers[index]!r}) is given twice", path=path, record=record)
        label[answers[index]] = label_scores({answers[index]: score}, path=path, record=record)[answers[index]]
    return label


def _target_example(rec: dict, question: VQAExample, *, answers: tuple[str, ...], path: Path,
                    record: str) -> VQAExample:
    """A target record of `question` -> the example with its {answer: score} label (the answers named through
    `answers`); the multiple-choice answer, which --min_answer_count counts, is the best-scored one (ties:
    the first), as for LXMERT's lists; the optional question_type / answer_type are kept."""
    label = target_label(rec, answers, path=path, record=record)
    types = {k: _check_str(rec, k, path=path, record=record) if rec.get(k) is not None else None
             for k in ("answer_type", "question_type")}
    return VQAExample(question_id=question.question_id, image_id=question.image_id, question=question.question,
                      label=label, multiple_choice_answer=max(label, key=label.__getitem__) if label else None, **types)


# --------------------------------------------------------------------------- files that hold their answers

def questions_format(path: str | Path) -> str:
    """"imdb" (a Pythia / MMF `.npy`), "lxmert" (a JSON list: LXMERT's converted questions) or "v2" (a JSON
    object: VQA v2 questions, whose answers are in an annotations file), told without parsing the file."""
    if Path(path).suffix.lower() == ".npy":
        return "imdb"
    return "lxmert" if first_char(path) == b"[" else "v2"


def holds_answers(path: str | Path) -> bool:
    """Whether a VQA questions file holds its answers (imdb, LXMERT's list) and so takes no annotations file."""
    return questions_format(path) != "v2"


def _like_the_first(first: bool | None, has: bool, what: str, *, path: Path, record: str) -> bool:
    """Either every question of a file that holds its answers has them or none has (a test split): the first
    question decides (`first` None: this is it); returns the file's choice."""
    if first is not None and has != first:
        raise VlbertsError(f"has no {what}, which the file's first question has" if first else
                           f"has {what}, which the file's first question has not", path=path, record=record)
    return has if first is None else first


def label_scores(value: Any, *, path: Path, record: str) -> dict[str, float]:
    """LXMERT's label, {answer: score} with scores in [0, 1] (its VQA lists and its pre-training corpus), checked."""
    if not isinstance(value, dict) or not all(
            isinstance(a, str) and isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
            for a, v in value.items()):
        raise VlbertsError(f"a label must map answers to scores in [0, 1], got {value!r}", path=path, record=record)
    return {a: float(v) for a, v in value.items()}


def _read_lxmert(path: Path, data: list, bad: BadRecords) -> list[VQAExample]:
    """LXMERT's question list (module docstring) -> `VQAExample`s with `label`, in file order; a record is named
    by its place in the list (``[i]``). The multiple-choice answer (what `--min_answer_count` counts) is the
    label's highest-scored answer (ties: the first); either every question has a label or none has (test)."""
    examples: list[VQAExample] = []
    first_at: dict[int, int] = {}
    labelled: bool | None = None
    for i, rec in enumerate(data):
        where = f"[{i}]"
        try:
            require_keys(rec, ("img_id", "question_id", "sent"), path=path, record=where)
            qid = _check_question_id(rec, path=path, record=where)
            if qid in first_at:
                raise VlbertsError(f"duplicate question_id {qid} (first at [{first_at[qid]}])", path=path, record=where)
            image_id = _check_image_id({"image_id": rec["img_id"]}, path=path, record=where)
            question = require_text(rec["sent"], "sent", path=path, record=where)
            label = None if rec.get("label") is None else label_scores(rec["label"], path=path, record=where)
            types = {k: _check_str(rec, k, path=path, record=where) if rec.get(k) is not None else None
                     for k in ("answer_type", "question_type")}
            labelled = _like_the_first(labelled, label is not None, "label", path=path, record=where)
        except VlbertsError as err:
            bad.handle(err)
            continue
        first_at[qid] = i
        examples.append(VQAExample(question_id=qid, image_id=image_id, question=question, label=label,
                                   multiple_choice_answer=max(label, key=label.__getitem__) if label else None,
                                   **types))
    return examples


# --------------------------------------------------------------------------- Pythia / MMF imdb files

def _imdb_records(path: Path) -> tuple[list, int]:
    """The question records of an imdb file and the position of the first (1 after Pythia's header)."""
    obj, _ = read_npy(path)
    if isinstance(obj, dict) and isinstance(obj.get("data"), (list, np.ndarray)):  # MMF: {metadata, data}
        records = list(obj["data"])
    elif isinstance(obj, np.ndarray) and obj.ndim == 1 and obj.dtype == object:  # Pythia: [header, q, q, ...]
        records = list(obj)
    else:
        raise VlbertsError("expected an imdb: an object array of question dicts (Pythia) or a dict with a "
                           "'data' list (MMF)", path=path)
    # Pythia's element 0 is a header ({create_time, dataset_name, version, has_answer, ...}), no question;
    # MMF's loader skips it the same way (its first record names no image).
    start = 1 if records and isinstance(records[0], dict) and "question_id" not in records[0] else 0
    return records, start


def _python_ints(rec: dict, keys: tuple[str, ...]) -> dict:
    """`rec` with numpy integers (an imdb built from numpy arrays) at `keys` as Python ints, for the checks."""
    return {**rec, **{k: int(rec[k]) for k in keys if isinstance(rec.get(k), np.integer)}}


def _imdb_question(rec: dict, *, path: Path, record: str) -> str:
    """`question_str`, or, in imdbs built without it, the question's tokens joined by spaces (Pythia's
    tokens are lower-cased with the punctuation split off: "what", "color", "is", ...)."""
    if "question_str" in rec:
        return require_text(rec["question_str"], "question_str", path=path, record=record)
    tokens = rec.get("question_tokens")
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise VlbertsError("needs question_str or a non-empty list of question_tokens", path=path, record=record)
    return require_text(" ".join(tokens), "question_tokens", path=path, record=record)


def _imdb_answers(rec: dict, *, path: Path, record: str) -> list[str] | None:
    """The 10 annotators' answers: `all_answers` (Pythia) or `answers` (MMF, VL-BERT's reader); None for an
    unanswered (test) question. `valid_answers` alone is refused: it keeps only the answers in the build's
    answer table, and the official accuracy counts all ten."""
    key = next((k for k in ("all_answers", "answers") if k in rec), None)
    if key is None:
        if "valid_answers" in rec:
            raise VlbertsError("has valid_answers (the answers in Pythia's answer table) but not all_answers: "
                               "the official accuracy needs all ten", path=path, record=record)
        return None
    answers = rec[key]
    if isinstance(answers, np.ndarray):
        answers = answers.tolist()
    if not isinstance(answers, (list, tuple)) or len(answers) != NUM_GT_ANSWERS:
        got = f"{len(answers)}" if isinstance(answers, (list, tuple)) else type(answers).__name__
        raise VlbertsError(f"{key} must be a list of {NUM_GT_ANSWERS} strings, got {got}", path=path, record=record)
    if not all(isinstance(a, str) for a in answers):
        raise VlbertsError(f"{key} must hold strings only", path=path, record=record)
    return list(answers)


def read_vqa_imdb(path: str | Path, bad: BadRecords | None = None) -> list[VQAExample]:
    """Read a Pythia / MMF imdb `.npy` (module docstring) into `VQAExample`s, in the file's order.

    The object array is unpickled by the restricted unpickler (plain data and numpy arrays only). A record
    is named by its position in the array (``imdb[i]``, the header being imdb[0]). An imdb has no
    `multiple_choice_answer`, `answer_type` or `question_type`: the first is derived as VQA defines it, the
    most frequent of the ten answers (ties: the first given); the types stay None (the metrics then have no
    per-type rows). Either every question has its answers or none has (a test split)."""
    bad = bad if bad is not None else BadRecords()
    path = Path(path)
    records, start = _imdb_records(path)
    examples: list[VQAExample] = []
    first_at: dict[int, int] = {}
    annotated: bool | None = None
    for i in range(start, len(records)):
        rec, where = records[i], f"imdb[{i}]"
        try:
            require_keys(rec, ("image_id", "question_id"), path=path, record=where)
            rec = _python_ints(rec, ("image_id", "question_id"))
            qid = _check_question_id(rec, path=path, record=where)
            if qid in first_at:
                raise VlbertsError(f"duplicate question_id {qid} (first at imdb[{first_at[qid]}])", path=path, record=where)
            image_id = _check_image_id(rec, path=path, record=where)
            question = _imdb_question(rec, path=path, record=where)
            answers = _imdb_answers(rec, path=path, record=where)
            annotated = _like_the_first(annotated, answers is not None, "answers", path=path, record=where)
        except VlbertsError as err:
            bad.handle(err)
            continue
        first_at[qid] = i
        examples.append(VQAExample(
            question_id=qid, image_id=image_id, question=question, answers=answers or [],
            multiple_choice_answer=Counter(answers).most_common(1)[0][0] if answers else None,
        ))
    return examples


def _imdb_tokens(question: str) -> list[str]:
    """Pythia's `text_processing.tokenize`, near enough for a file we write: lower-cased words with the
    punctuation dropped."""
    return [t for t in "".join(c if c.isalnum() or c in "-'" else " " for c in question.lower()).split() if t]


def write_vqa_imdb(path: str | Path, examples: Iterable[VQAExample], answers: Iterable[str] | None = None,
                   image_name: str = "{image_id}") -> int:
    """Write VQA examples as a Pythia imdb `.npy` (header + one dict a question), atomically; returns the number
    of questions. `valid_answers` are the answers in `answers` (the answer table; all ten without one), or
    ``["<unk>"]`` when none is, as Pythia's `build_imdb` writes them; `image_name` formats the image's name
    (Pythia's COCO form: ``"COCO_train2014_{image_id:012d}"``). Unanswered examples get no answer fields."""
    table = set(answers) if answers is not None else None
    rows: list[dict[str, Any]] = []
    for ex in examples:
        name = image_name.format(image_id=ex.image_id)
        row: dict[str, Any] = {"image_name": name, "image_id": ex.image_id, "question_id": ex.question_id,
                               "feature_path": f"{name}.npy", "question_str": ex.question,
                               "question_tokens": _imdb_tokens(ex.question)}
        if ex.answers:  # (an example read from LXMERT's list has scores, not the ten answers: none written)
            valid = [a for a in ex.answers if table is None or a in table]
            row.update(all_answers=list(ex.answers), valid_answers=valid or ["<unk>"])
        rows.append(row)
    header = {"create_time": "", "dataset_name": "vqa", "version": 1,
              "has_answer": any("all_answers" in r for r in rows), "has_gt_layout": False}
    # Through JSON text first: pickle writes a string object that occurs twice once and refers back to it, and
    # which strings are one object depends on where the examples came from (another process, a JSON file);
    # read back from one text they are shared the same way, so the bytes depend on the content alone.
    array = np.empty(len(rows) + 1, dtype=object)
    array[:] = json.loads(json.dumps([header, *rows]))
    with atomic_open(path, "wb", encoding=None) as f:
        np.save(f, array, allow_pickle=True)
    return len(rows)
