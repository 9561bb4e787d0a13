"""What every task's prediction file shares: one prediction per example, no duplicates, none missing; which
examples an evaluation keeps (`last_questions`)."""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vlberts.errors import VlbertsError
from vlberts.features.record import coco_number
from vlberts.io import write_json


def require_complete(preds: Mapping[Any, Any], expected: Iterable[Hashable], *, path: str | Path, label: str) -> None:
    """Every expected id has a prediction; the error names the first missing one as `label id`."""
    missing = [k for k in expected if k not in preds]
    if missing:
        more = f" ({len(missing) - 1} more also missing)" if len(missing) > 1 else ""
        raise VlbertsError(f"no prediction for this example{more}", path=path, record=f"{label} {missing[0]}")


def unique_rows(predictions: Iterable[tuple[Any, Any]], *, path: str | Path, label: str) -> list[tuple[Any, Any]]:
    """The (id, prediction) pairs as a list; a repeated id is an error (a scorer would count it once)."""
    rows, seen = [], set()
    for key, value in predictions:
        if key in seen:
            raise VlbertsError("duplicate prediction", path=path, record=f"{label} {key}")
        seen.add(key)
        rows.append((key, value))
    return rows


def write_json_predictions(
    path: str | Path, predictions: Iterable[tuple[Any, Any]], *, id_field: str, value_field: str, label: str
) -> int:
    """Write `[{id_field: id, value_field: prediction}]` atomically; returns the number written."""
    rows = unique_rows(predictions, path=path, label=label)
    write_json(path, [{id_field: k, value_field: v} for k, v in rows], indent=None)
    return len(rows)


def choose(scores: Sequence[float]) -> int:
    """Index of the highest score; ties go to the lowest index (``numpy.argmax``). NaN is an error."""
    if len(scores) == 0:  # also accepts numpy arrays
        raise ValueError("no scores to choose from")
    best = 0
    for i, s in enumerate(scores):
        if math.isnan(s):
            raise ValueError(f"score {i} is NaN")
        if s > scores[best]:
            best = i
    return best


def last_questions(examples: list, n: int) -> list:
    """The `n` examples with the largest question ids, in their own order (all of them for n = 0): ViLBERT's
    VQA minval is the last 3,000 of val2014's questions sorted by id (vilbert-multi-task `vqa_dataset.py`), its
    GQA minval the last 3,000 of trainval's (`gqa_dataset.py`), each sorted by the id as its pickle stores it
    (`sorted(items, key=lambda x: x["question_id"])`): numbers as numbers, strings as text ("9" after "100").
    An example's `sort_id` is that stored value where it differs from `question_id` (`GQAExample`)."""
    if not n or n >= len(examples):
        return examples
    kept = set(ex.question_id for ex in sorted(examples, key=lambda ex: getattr(ex, "sort_id", ex.question_id))[-n:])
    return [ex for ex in examples if ex.question_id in kept]


def _image_key(image_id: Any) -> str:
    """An image id as `--exclude_images` compares it: a string, a COCO file stem as its number
    ("COCO_val2014_000000000042" is 42)."""
    return coco_number(str(image_id)) or str(image_id)


def excluded_images(path: str) -> set[str]:
    """The image ids listed in `path` (`data.text_corpus.read_image_ids`: a .npy array or one id a line), as
    `_image_key`s; an empty setting lists none."""
    from vlberts.data.text_corpus import read_image_ids  # (here: data.text_corpus reaches this module through tasks.vqa)

    return {_image_key(i) for i in read_image_ids(path)} if path else set()


def without_images(examples: list, excluded: set[str]) -> tuple[list, int]:
    """The examples whose image is not `excluded`, and how many were dropped: ViLBERT's `clean_datasets`, which
    keeps the test images of its other tasks out of its training and evaluation splits."""
    kept = [ex for ex in examples if _image_key(ex.image_id) not in excluded] if excluded else examples
    return kept, len(examples) - len(kept)
