"""Reading GQA balanced question files.

Format (formats-and-metrics.md §2.3; Hudson & Manning 2019, the released ``questions1.2`` files):
``{split}_balanced_questions.json`` is one JSON object mapping a question id (a string of digits,
e.g. ``"201307251"``) to a record::

    {"imageId": "2354786", "question": "Is the sky dark?", "answer": "yes",
     "fullAnswer": "Yes, the sky is dark.", "isBalanced": true,
     "types": {"structural": "verify", "semantic": "attr", "detailed": "verifyAttr"},
     "groups": {"global": null, "local": "06-sky_dark"},
     "entailed": ["..."], "equivalent": ["..."], "semantic": [...], "semanticStr": "...",
     "annotations": {...}}

LXMERT's converted files (``data/gqa/{train,valid,testdev,submit}.json``, its
``process_raw_data_scripts/process_data.py``) are read too: a JSON list of ``{"question_id", "img_id",
"sent", "label": {answer: 1.0}}`` (no label in ``submit``), the same questions without the other fields.

ViLBERT's GQA files (vilbert-multi-task ``vilbert/datasets/gqa_dataset.py``) are read too:
``gqa/cache/{train,val,trainval}_target.pkl``, a pickled list of ``{"question_id", "image_id", "question",
"labels", "scores"}`` whose labels index the answer table ``cache/trainval_ans2label.pkl`` (read through the
restricted unpickler, with that table; `read_gqa(answers=...)`). A question's answer is its label's; one
whose answer is not in the table (no label) reads with the empty answer, which is no class: it trains
toward none and scores 0, as there.

Only ``imageId`` and ``question`` are required: the test and challenge files ship without answers
(and without most other fields). Image ids are strings (Visual Genome ids for train/val, ``n...``
ids of COCO test images for testdev), the key of region stores.

This module only reads and checks; accuracy and prediction files live in `vlberts.tasks.gqa`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlberts.data.vqa import is_target_pickle, target_label, target_records
from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import read_json, require_keys, require_text

_REQUIRED = ("imageId", "question")


@dataclass(frozen=True)
class GQAExample:
    """One GQA question. `answer` and the optional fields are None where the file has none (test)."""

    question_id: str
    image_id: str
    question: str
    answer: str | None = None  # short answer, e.g. "yes", "left", "dark brown"
    full_answer: str | None = None  # "fullAnswer": the answer as a sentence
    is_balanced: bool | None = None  # member of the balanced subset
    structural_type: str | None = None  # types.structural: verify/query/choose/logical/compare
    semantic_type: str | None = None  # types.semantic: rel/attr/obj/cat/global
    detailed_type: str | None = None  # types.detailed, e.g. "verifyAttr"
    entailed: tuple[str, ...] = ()  # question ids entailed by this one (GQA consistency)
    equivalent: tuple[str, ...] = ()
    id_stored_as_number: bool = False  # the file held question_id as a number (a pickle may), not as a string

    @property
    def annotated(self) -> bool:
        return self.answer is not None

    @property
    def sort_id(self) -> str | int:
        """The question id as the file stored it, which is how ViLBERT orders its minval
        (`tasks.predictions.last_questions`): a number, or a string compared as text."""
        return int(self.question_id) if self.id_stored_as_number else self.question_id


def _opt_str(rec: dict, key: str, *, path: Path, record: str) -> str | None:
    value = rec.get(key)
    if value is not None and not isinstance(value, str):
        raise VlbertsError(f"field {key} must be a string, got {type(value).__name__}", path=path, record=record)
    return value


def _str_list(rec: dict, key: str, *, path: Path, record: str) -> tuple[str, ...]:
    value = rec.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise VlbertsError(f"field {key} must be a list of question ids (strings)", path=path, record=record)
    return tuple(value)


def parse_gqa_record(qid: str | int, rec: Any, *, path: Path, record: str) -> GQAExample:
    """Check one question record and turn it into a `GQAExample` (a question id stored as a number is kept
    as its digits, and `id_stored_as_number` says so)."""
    require_keys(rec, _REQUIRED, path=path, record=record)
    image_id = rec["imageId"]
    if isinstance(image_id, int) and not isinstance(image_id, bool):
        image_id = str(image_id)  # tolerate numeric ids; the released files use strings
    if not isinstance(image_id, str) or not image_id:
        raise VlbertsError(f"imageId must be a non-empty string, got {image_id!r}", path=path, record=record)
    question = require_text(rec["question"], "question", path=path, record=record)
    is_balanced = rec.get("isBalanced")
    if is_balanced is not None and not isinstance(is_balanced, bool):
        raise VlbertsError(f"isBalanced must be true or false, got {is_balanced!r}", path=path, record=record)
    types = rec.get("types") or {}
    if not isinstance(types, dict):
        raise VlbertsError("field types must be an object", path=path, record=record)
    return GQAExample(
        question_id=str(qid),
        id_stored_as_number=isinstance(qid, int),
        image_id=image_id,
        question=question,
        answer=_opt_str(rec, "answer", path=path, record=record),
        full_answer=_opt_str(rec, "fullAnswer", path=path, record=record),
        is_balanced=is_balanced,
        structural_type=_opt_str(types, "structural", path=path, record=record),
        semantic_type=_opt_str(types, "semantic", path=path, record=record),
        detailed_type=_opt_str(types, "detailed", path=path, record=record),
        entailed=_str_list(rec, "entailed", path=path, record=record),
        equivalent=_str_list(rec, "equivalent", path=path, record=record),
    )


def _list_items(records: list, path: Path, bad: BadRecords, *, keys: tuple[str, ...], image: str, question: str,
                answer: Callable[[dict, str], str | None]) -> Iterator[tuple[str | int, dict, str]]:
    """The records of a list of questions (LXMERT's, ViLBERT's) as (question id, the record in GQA's own form,
    its name): `image` and `question` name the record's fields, `answer(record, name)` reads its answer (None:
    none); a record is named by its place in the list and its question id. Every record must have `keys`
    and a question id of its own."""
    seen: dict[str, int] = {}
    for i, rec in enumerate(records):
        where = f"[{i}]"
        try:
            require_keys(rec, keys, path=path, record=where)
            qid = rec["question_id"]
            if isinstance(qid, bool) or not isinstance(qid, (str, int)):
                raise VlbertsError(f"question_id must be a string, got {qid!r}", path=path, record=where)
            key, where = str(qid), f"[{i}] (question {qid})"
            if key in seen:
                raise VlbertsError(f"duplicate question id {key} (first at [{seen[key]}])", path=path, record=where)
            gold = answer(rec, where)
        except VlbertsError as err:
            bad.handle(err)
            continue
        seen[key] = i
        # the id as stored (a number stays one: `GQAExample.sort_id`)
        yield qid, {"imageId": rec[image], "question": rec[question], **({} if gold is None else {"answer": gold})}, where


def _lxmert_items(data: list, path: Path, bad: BadRecords) -> Iterator[tuple[str | int, dict, str]]:
    """LXMERT's records: `sent` the question, `img_id` the image, the one key of `label` the answer."""
    def answer(rec: dict, where: str) -> str | None:
        label = rec.get("label")
        if label is not None and not (isinstance(label, dict) and len(label) == 1):
            raise VlbertsError(f"label must hold one answer (GQA's), got {label!r}", path=path, record=where)
        return next(iter(label)) if label else None

    return _list_items(data, path, bad, keys=("question_id", "img_id", "sent"), image="img_id", question="sent",
                       answer=answer)


_VILBERT_KEYS = ("question_id", "image_id", "question", "labels", "scores")  # ViLBERT's GQA target.pkl records


def _vilbert_items(records: list, answers: Sequence[str], path: Path, bad: BadRecords) -> Iterator[tuple[str | int, dict, str]]:
    """ViLBERT's target records: the answer is the best-scored label's (GQA's targets hold one, at 1.0), or ""
    when the answer is not in the table."""
    def answer(rec: dict, where: str) -> str:
        label = target_label(rec, answers, path=path, record=where)
        return max(label, key=label.__getitem__) if label else ""

    return _list_items(records, path, bad, keys=_VILBERT_KEYS, image="image_id", question="question", answer=answer)


def read_gqa(path: str | Path, *, require_answers: bool = False, bad: BadRecords | None = None,
             answers: Sequence[str] | None = None) -> list[GQAExample]:
    """Read a GQA ``*_questions.json`` file (or LXMERT's converted list of the same questions, or ViLBERT's
    target pickle with its answer table `answers`); examples in file order.

    With `require_answers`, a question without an answer is an error (use it for train/val/testdev,
    whose answers a metric needs). Errors name the file and the question id as ``question <id>`` (a list's
    or pickle's record as ``[i] (question <id>)``); with `bad` skipping, a bad question is dropped and
    counted instead.
    """
    bad = bad if bad is not None else BadRecords()
    path = Path(path)
    if is_target_pickle(path):
        if answers is None:
            raise VlbertsError("ViLBERT's GQA target pickle names answers by their index in the answer table it was "
                               "made with: give that table (cache/trainval_ans2label.pkl) as --answer_vocab", path=path)
        items = _vilbert_items(target_records(path, _VILBERT_KEYS), answers, path, bad)
        return _parsed(items, path, require_answers, bad)
    data = read_json(path)
    if isinstance(data, list):
        items = _lxmert_items(data, path, bad)
    elif isinstance(data, dict):
        items = ((qid, rec, f"question {qid}") for qid, rec in data.items())
    else:
        raise VlbertsError("expected a JSON object mapping question ids to question records (the GQA questions "
                           "format) or a list of LXMERT's question records", path=path)
    return _parsed(items, path, require_answers, bad)


def _parsed(items: Iterator[tuple[str | int, dict, str]], path: Path, require_answers: bool, bad: BadRecords) -> list[GQAExample]:
    """The items' records as examples (`parse_gqa_record`), in order; bad ones raise or are counted by `bad`."""
    examples = []
    for qid, rec, where in items:
        try:
            ex = parse_gqa_record(qid, rec, path=path, record=where)
            if require_answers and ex.answer is None:
                raise VlbertsError("missing field answer", path=path, record=where)
        except VlbertsError as err:
            bad.handle(err)
            continue
        examples.append(ex)
    return examples
