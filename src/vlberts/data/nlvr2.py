"""Reading NLVR2 statements (JSON lines).

Format (formats-and-metrics.md §2.4; Suhr et al. 2019, lil-lab/nlvr ``nlvr2/data/{train,dev,test1}.json``):
one JSON object per line::

    {"identifier": "dev-850-0-0", "sentence": "The left image contains twice the number of dogs ...",
     "label": "True", "left_url": "...", "right_url": "...", "writer": "103",
     "validation": {...}, "extra_validations": {...}, "synset": "...", "query": "...", "directory": 31}

* ``identifier`` is ``split-setid-pairid-sentid``; the two images of the pair are
  ``split-setid-pairid-img0`` (left) and ``...-img1`` (right), the ids LXMERT's feature files use and
  the stems of the released image files (``dev-850-0-img0.png``; the extension may lie).
* ``label`` is the *string* ``"True"`` or ``"False"`` (not a JSON boolean). It is optional here: a
  hidden test file has none. Anything else (``true``, ``1``, ``"yes"``) is an error.
* ``directory`` (train only) is the sub-folder ``train/<directory>/`` holding the images.

LXMERT's converted files (``data/nlvr2/{train,valid,test}.json``, its
``process_raw_data_scripts/process_dataset.py``) are read too: one JSON list of ``{"identifier", "img0",
"img1", "label": 0 | 1, "sent", "uid"}``, the same statements, the label an integer, the images named.

The sentence key for consistency (the same sentence written for several image pairs of one set)
is the identifier with the pair id removed, ``split-setid--sentid`` (nlvr2 ``eval/metrics.py``).
Accuracy and consistency live in `vlberts.tasks.nlvr2`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import first_char, iter_jsonl, read_json, require_keys, require_text

LABEL_STRINGS = {"True": True, "False": False}


@dataclass(frozen=True)
class NLVR2Identifier:
    """The parts of ``split-setid-pairid-sentid``."""

    split: str  # "train", "dev", "test1", ...
    set_id: str
    pair_id: str
    sentence_id: str

    @property
    def left_image_id(self) -> str:
        return f"{self.split}-{self.set_id}-{self.pair_id}-img0"

    @property
    def right_image_id(self) -> str:
        return f"{self.split}-{self.set_id}-{self.pair_id}-img1"

    @property
    def sentence_key(self) -> str:
        """The identifier with the pair id blanked, ``split-setid--sentid``: one key per written sentence."""
        return f"{self.split}-{self.set_id}--{self.sentence_id}"


def parse_identifier(identifier: str) -> NLVR2Identifier:
    """Split ``split-setid-pairid-sentid``; ValueError unless it has four parts, the last three integers."""
    parts = identifier.split("-")
    if len(parts) != 4 or not parts[0] or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"identifier {identifier!r} is not split-setid-pairid-sentid")
    return NLVR2Identifier(*parts)


@dataclass(frozen=True)
class NLVR2Example:
    """One NLVR2 statement about an image pair; `label` is None for an unlabelled (hidden test) file."""

    identifier: str
    sentence: str
    label: bool | None
    left_image_id: str
    right_image_id: str
    sentence_key: str  # identifier with the pair id blanked (consistency groups)
    left_url: str | None = None
    right_url: str | None = None
    directory: str | None = None  # train images live in train/<directory>/

    @property
    def image_ids(self) -> tuple[str, str]:
        return (self.left_image_id, self.right_image_id)


def parse_label(value: Any) -> bool:
    """``"True"`` -> True, ``"False"`` -> False; ValueError for anything else (including JSON booleans)."""
    if isinstance(value, str) and value in LABEL_STRINGS:
        return LABEL_STRINGS[value]
    raise ValueError(f'label must be the string "True" or "False", got {value!r}')


def parse_nlvr2_record(rec: Any, *, path: Path, record: str) -> NLVR2Example:
    """Check one JSON record and turn it into an `NLVR2Example`."""
    require_keys(rec, ("identifier", "sentence"), path=path, record=record)
    identifier, sentence = rec["identifier"], rec["sentence"]
    if not isinstance(identifier, str):
        raise VlbertsError(f"identifier must be a string, got {identifier!r}", path=path, record=record)
    require_text(sentence, "sentence", path=path, record=record)
    try:
        ident = parse_identifier(identifier)
        label = parse_label(rec["label"]) if rec.get("label") is not None else None
    except ValueError as e:
        raise VlbertsError(str(e), path=path, record=f"{record} ({identifier})") from None
    urls = []
    for key in ("left_url", "right_url"):
        url = rec.get(key)
        if url is not None and not isinstance(url, str):
            raise VlbertsError(f"{key} must be a string", path=path, record=record)
        urls.append(url)
    directory = rec.get("directory")
    if directory is not None and (isinstance(directory, bool) or not isinstance(directory, (str, int))):
        raise VlbertsError(f"directory must be a string or an integer, got {directory!r}", path=path, record=record)
    return NLVR2Example(
        identifier=identifier,
        sentence=sentence,
        label=label,
        left_image_id=ident.left_image_id,
        right_image_id=ident.right_image_id,
        sentence_key=ident.sentence_key,
        left_url=urls[0],
        right_url=urls[1],
        directory=None if directory is None else str(directory),
    )


def _lxmert_record(rec: Any, *, path: Path, record: str) -> NLVR2Example:
    """One record of LXMERT's list (module docstring) as an `NLVR2Example`: `sent` the sentence, `label` 1
    (True) or 0 (False), `img0` / `img1` the images (their names in LXMERT's feature files)."""
    require_keys(rec, ("identifier", "sent", "img0", "img1"), path=path, record=record)
    label = rec.get("label")
    if label is not None and (isinstance(label, bool) or not isinstance(label, int) or label not in (0, 1)):
        raise VlbertsError(f"label must be 0 or 1 (LXMERT's form), got {label!r}", path=path, record=record)
    ex = parse_nlvr2_record({"identifier": rec["identifier"], "sentence": rec["sent"],
                             "label": None if label is None else ("False", "True")[label]}, path=path, record=record)
    images = []
    for key in ("img0", "img1"):
        if not isinstance(rec[key], str) or not rec[key]:
            raise VlbertsError(f"{key} must be a non-empty string, got {rec[key]!r}", path=path, record=record)
        images.append(rec[key])
    return dataclasses.replace(ex, left_image_id=images[0], right_image_id=images[1])


def _records(path: Path, bad: BadRecords) -> Iterator[tuple[str, Any, Callable[..., NLVR2Example]]]:
    """(name, record, parser) of each record: NLVR2's JSON lines (``line N``), or LXMERT's JSON list (``[i]``),
    told apart by the file's first character."""
    if first_char(path) == b"[":
        data = read_json(path)
        if not isinstance(data, list):
            raise VlbertsError("expected a JSON list of LXMERT's NLVR2 records", path=path)
        for i, rec in enumerate(data):
            yield f"[{i}]", rec, _lxmert_record
    else:
        for lineno, rec in iter_jsonl(path, bad):
            yield f"line {lineno}", rec, parse_nlvr2_record


def read_nlvr2(path: str | Path, *, require_labels: bool = False, bad: BadRecords | None = None) -> list[NLVR2Example]:
    """Read an NLVR2 JSON-lines file (or LXMERT's JSON list of the same statements); examples in file order,
    blank lines skipped.

    Errors name the file and ``line N``: a malformed or truncated line, a bad identifier or label,
    a duplicate identifier, or (with `require_labels`) a missing label. With `bad` skipping
    (``--skip_bad``), such a line is dropped and counted instead ("malformed record").
    """
    bad = bad if bad is not None else BadRecords()
    examples: list[NLVR2Example] = []
    first_at: dict[str, str] = {}
    for where, rec, parse in _records(Path(path), bad):
        try:
            ex = parse(rec, path=path, record=where)
            if ex.identifier in first_at:
                raise VlbertsError(f"duplicate identifier {ex.identifier} (first at {first_at[ex.identifier]})",
                                   path=path, record=where)
            if require_labels and ex.label is None:
                raise VlbertsError("missing field label", path=path, record=where)
        except VlbertsError as err:
            bad.handle(err)
            continue
        first_at[ex.identifier] = where
        examples.append(ex)
    return examples


def read_image_map(path: str | Path) -> dict[str, str]:
    """{NLVR2 image name: store image id} from a JSON object; ids may be strings or integers."""
    raw = read_json(path)
    if not isinstance(raw, dict):
        raise VlbertsError("image map must be a JSON object {image name: image id (string or integer)}", path=path)
    for name, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
            raise VlbertsError(f"image id must be a non-empty string or an integer, got {json.dumps(value)}",
                               path=path, record=name)
    return {str(k): str(v) for k, v in raw.items()}
