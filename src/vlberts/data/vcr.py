"""Reading VCR (Visual Commonsense Reasoning) annotations and rendering object references as words.

Format (formats-and-metrics.md §2.5; Zellers et al. 2019, ``{train,val,test}.jsonl``): one JSON object
per line::

    {"annot_id": "val-1", "img_id": "val-0", "movie": "3015_CHARLIE_ST_CLOUD",
     "img_fn": "lsmdc_3015_.../..@0.jpg", "metadata_fn": "lsmdc_3015_.../..@0.json",
     "objects": ["person", "person", "person", "car"],
     "question": ["Does", [2], "feel", "comfortable", "?"],
     "answer_choices": [[...], [...], [...], [...]], "answer_label": 1,
     "rationale_choices": [[...], [...], [...], [...]], "rationale_label": 1, ...}

Tokens are strings, or object references: a *list* of 0-based indices into ``objects``, possibly several
(``[[0, 1], "are", "talking"]`` = "0 and 1 are talking"). The test file has no labels. Each question
has 4 answer and 4 rationale choices; QA->R reads the question with the ground-truth answer
(`rationale_context`).

Rendering (`render_tokens`; VisualBERT ``vcr_data_utils.py _fix_tokenization``, VL-BERT
``vcr/data/datasets/vcr.py``): a person becomes a gender-neutral name from `GENDER_NEUTRAL_NAMES`
(the released list, "Peyton" twice included), chosen by the object's index modulo 15; any other
object becomes its class name ("wine glass" gives two words). A multi-index reference becomes one
name per index, either side by side (``join="separate"``, VisualBERT/r2c) or joined with "and"
(``join="and"``, VL-BERT). Every rendered word carries the object indices it refers to -- ``()`` for
ordinary words and for the inserted "and" -- which is VisualBERT's word-region alignment.
VisualBERT/r2c index names by the object's position among the detections it keeps (plus one for the
whole-image box); we use the index in ``objects``, which needs no detection filtering and is stable.

The per-image metadata file (``metadata_fn``) holds ``boxes`` ([x1, y1, x2, y2, score] pixels),
``segms``, ``names``, ``width`` and ``height`` (`read_vcr_metadata`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from vlberts.errors import VlbertsError
from vlberts.io import iter_jsonl, read_json, require_box, require_keys, require_unique

NUM_CHOICES = 4

GENDER_NEUTRAL_NAMES: tuple[str, ...] = (
    "Casey", "Riley", "Jessie", "Jackie", "Avery", "Jaime", "Peyton", "Kerry",
    "Jody", "Kendall", "Peyton", "Skyler", "Frankie", "Pat", "Quinn",
)  # fmt: skip

# A token: a word, or a reference to one or more objects (0-based indices into `objects`).
Token = str | tuple[int, ...]
Tokens = tuple[Token, ...]

_REQUIRED = ("annot_id", "objects", "question", "answer_choices", "rationale_choices")


@dataclass(frozen=True)
class VCRExample:
    """One VCR question with its answer and rationale choices. Labels are None in the test file."""

    annot_id: str
    img_id: str
    img_fn: str
    metadata_fn: str
    objects: tuple[str, ...]  # class names, "person" for people
    question: Tokens
    answer_choices: tuple[Tokens, ...]  # 4
    rationale_choices: tuple[Tokens, ...]  # 4
    answer_label: int | None = None  # 0-based index into answer_choices
    rationale_label: int | None = None  # 0-based index into rationale_choices
    movie: str | None = None

    @property
    def annotated(self) -> bool:
        return self.answer_label is not None and self.rationale_label is not None


def rationale_context(example: VCRExample) -> Tokens:
    """The QA->R query: the question followed by the ground-truth answer (formats §2.5, ``rationales=True``)."""
    if example.answer_label is None:
        raise ValueError(f"{example.annot_id}: QA->R needs the ground-truth answer, and this example has none")
    return example.question + example.answer_choices[example.answer_label]


# --------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class RenderedText:
    """Words after rendering, and for each word the object indices it refers to (``()`` for none)."""

    words: tuple[str, ...]
    refs: tuple[tuple[int, ...], ...]  # len(words)

    @property
    def text(self) -> str:
        return " ".join(self.words)

    def word_positions(self, num_objects: int) -> tuple[tuple[int, ...], ...]:
        """For each object, the positions of the words that refer to it (the inverse of `refs`).

        VisualBERT gives an aligned region the average text-position embedding of these words.
        """
        out: list[list[int]] = [[] for _ in range(num_objects)]
        for pos, refs in enumerate(self.refs):
            for obj in refs:
                out[obj].append(pos)
        return tuple(tuple(p) for p in out)


def object_words(index: int, objects: tuple[str, ...] | list[str]) -> list[str]:
    """The words naming object `index`: a gender-neutral name for a person, else the class name's words."""
    name = objects[index]
    if name == "person":
        return [GENDER_NEUTRAL_NAMES[index % len(GENDER_NEUTRAL_NAMES)]]
    return name.split()


def render_tokens(
    tokens: Tokens | list, objects: tuple[str, ...] | list[str], *, join: Literal["separate", "and"] = "separate"
) -> RenderedText:
    """Render VCR tokens to words, keeping each word's object indices (see the module docstring).

    ``["Why", "is", [0, 2], "sad", "?"]`` with objects ``["person", "dog", "person"]`` gives
    words ``Why is Casey Jessie sad ?`` (``join="separate"``) or ``Why is Casey and Jessie sad ?``
    (``join="and"``), with refs ``(), (), (0,), (2,), (), ()`` (the "and" has ``()``).
    """
    if join not in ("separate", "and"):
        raise ValueError(f"join must be 'separate' or 'and', got {join!r}")
    words: list[str] = []
    refs: list[tuple[int, ...]] = []
    for tok in tokens:
        if isinstance(tok, str):
            words.append(tok)
            refs.append(())
            continue
        for k, index in enumerate(tok):
            if not 0 <= index < len(objects):
                raise IndexError(f"object reference {index} outside 0..{len(objects) - 1}")
            if k > 0 and join == "and":
                words.append("and")
                refs.append(())
            for w in object_words(index, objects):
                words.append(w)
                refs.append((index,))
    return RenderedText(tuple(words), tuple(refs))


# --------------------------------------------------------------------------- reading


def _parse_tokens(value: Any, num_objects: int, *, path: Path, record: str, field: str) -> Tokens:
    if not isinstance(value, list):
        raise VlbertsError(f"{field} must be a list of tokens", path=path, record=record)
    if not any(not isinstance(tok, str) or tok.strip() for tok in value):  # would reach the model as no text
        raise VlbertsError(f"{field} is empty", path=path, record=record)
    out: list[Token] = []
    for j, tok in enumerate(value):
        if isinstance(tok, str):
            out.append(tok)
            continue
        if not isinstance(tok, list) or not tok:
            raise VlbertsError(
                f"{field}[{j}] must be a word or a non-empty list of object indices, got {tok!r}",
                path=path,
                record=record,
            )
        for index in tok:
            if not isinstance(index, int) or isinstance(index, bool):
                raise VlbertsError(f"{field}[{j}] holds a non-integer object index {index!r}", path=path, record=record)
            if not 0 <= index < num_objects:
                raise VlbertsError(
                    f"{field}[{j}] refers to object {index}, but the example has {num_objects} objects "
                    f"(indices are 0-based)",
                    path=path,
                    record=record,
                )
        out.append(tuple(tok))
    return tuple(out)


def _parse_choices(rec: dict, key: str, num_objects: int, *, path: Path, record: str) -> tuple[Tokens, ...]:
    choices = rec[key]
    if not isinstance(choices, list) or len(choices) != NUM_CHOICES:
        got = len(choices) if isinstance(choices, list) else type(choices).__name__
        raise VlbertsError(f"{key} must be a list of {NUM_CHOICES} token lists, got {got}", path=path, record=record)
    return tuple(
        _parse_tokens(c, num_objects, path=path, record=record, field=f"{key}[{k}]") for k, c in enumerate(choices)
    )


def _parse_label(rec: dict, key: str, *, path: Path, record: str) -> int | None:
    label = rec.get(key)
    if label is None:
        return None
    if not isinstance(label, int) or isinstance(label, bool) or not 0 <= label < NUM_CHOICES:
        raise VlbertsError(f"{key} must be an integer in 0..{NUM_CHOICES - 1} (0-based), got {label!r}",
                           path=path, record=record)
    return label


def _opt_str(rec: dict, key: str, default: str, *, path: Path, record: str) -> str:
    value = rec.get(key, default)
    if not isinstance(value, str):
        raise VlbertsError(f"{key} must be a string, got {value!r}", path=path, record=record)
    return value


def parse_vcr_record(rec: Any, *, path: Path, record: str) -> VCRExample:
    """Check one JSON record and turn it into a `VCRExample`."""
    require_keys(rec, _REQUIRED, path=path, record=record)
    objects = rec["objects"]
    if not isinstance(objects, list) or not all(isinstance(o, str) for o in objects):
        raise VlbertsError("objects must be a list of class names", path=path, record=record)
    blank = [i for i, o in enumerate(objects) if not o.strip()]
    if blank:  # a reference to it would render as no word
        raise VlbertsError(f"objects[{blank[0]}] is an empty class name", path=path, record=record)
    n = len(objects)
    movie = rec.get("movie")
    if movie is not None and not isinstance(movie, str):
        raise VlbertsError(f"movie must be a string, got {movie!r}", path=path, record=record)
    return VCRExample(
        annot_id=_opt_str(rec, "annot_id", "", path=path, record=record),
        img_id=_opt_str(rec, "img_id", "", path=path, record=record),
        img_fn=_opt_str(rec, "img_fn", "", path=path, record=record),
        metadata_fn=_opt_str(rec, "metadata_fn", "", path=path, record=record),
        objects=tuple(objects),
        question=_parse_tokens(rec["question"], n, path=path, record=record, field="question"),
        answer_choices=_parse_choices(rec, "answer_choices", n, path=path, record=record),
        rationale_choices=_parse_choices(rec, "rationale_choices", n, path=path, record=record),
        answer_label=_parse_label(rec, "answer_label", path=path, record=record),
        rationale_label=_parse_label(rec, "rationale_label", path=path, record=record),
        movie=movie,
    )


def read_vcr(path: str | Path, *, require_labels: bool = False) -> list[VCRExample]:
    """Read a VCR JSON-lines file; examples in file order, blank lines skipped.

    Errors name the file and ``line N``: a malformed or truncated line, a token that is neither a word
    nor a list of in-range object indices, a wrong number of choices, a bad label, an annot_id seen on an
    earlier line, or (with `require_labels`) a missing label.
    """
    examples = []
    first: dict[str, object] = {}  # annot_id -> its line
    for lineno, rec in iter_jsonl(path):
        where = f"line {lineno}"
        ex = parse_vcr_record(rec, path=path, record=where)
        if require_labels and not ex.annotated:
            raise VlbertsError("missing field answer_label or rationale_label", path=path, record=where)
        require_unique(first, ex.annot_id, where, what="annot_id", path=path)
        examples.append(ex)
    return examples


@dataclass(frozen=True)
class VCRMetadata:
    """One per-image metadata file: detections as float xyxy pixel boxes with their scores."""

    width: int
    height: int
    boxes: tuple[tuple[float, float, float, float], ...]  # x1, y1, x2, y2 in pixels
    scores: tuple[float, ...]
    names: tuple[str, ...]  # class names, parallel to the example's `objects`


def read_vcr_metadata(path: str | Path) -> VCRMetadata:
    """Read a VCR ``metadata_fn`` JSON (``boxes`` as [x1, y1, x2, y2, score], ``names``, ``width``, ``height``);
    each box must lie inside the width x height image (one pixel of slack) with a positive area."""
    path = Path(path)
    data = read_json(path)
    require_keys(data, ("boxes", "names", "width", "height"), path=path, record="metadata")
    boxes, names = data["boxes"], data["names"]
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise VlbertsError("names must be a list of class names", path=path, record="names")
    if not isinstance(boxes, list) or len(boxes) != len(names):
        raise VlbertsError(f"boxes must be a list with one box per name ({len(names)})", path=path, record="boxes")
    for key in ("width", "height"):
        v = data[key]
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise VlbertsError(f"{key} must be a positive integer, got {v!r}", path=path, record="metadata")
    out_boxes, scores = [], []
    for k, b in enumerate(boxes):
        if (not isinstance(b, list) or len(b) != 5
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in b)):
            raise VlbertsError(f"expected [x1, y1, x2, y2, score], got {b!r}", path=path, record=f"boxes[{k}]")
        if b[2] < b[0] or b[3] < b[1]:
            raise VlbertsError(f"box has x2 < x1 or y2 < y1: {b!r}", path=path, record=f"boxes[{k}]")
        out_boxes.append(require_box(b[:4], data["width"], data["height"], path=path, record=f"boxes[{k}]"))
        scores.append(float(b[4]))
    return VCRMetadata(data["width"], data["height"], tuple(out_boxes), tuple(scores), tuple(names))
