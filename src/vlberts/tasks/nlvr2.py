"""NLVR2: accuracy and consistency, prediction files, majority baseline.

Metrics (formats-and-metrics.md §5; lil-lab/nlvr ``nlvr2/eval/metrics.py``; Suhr et al. 2019 §5):

* accuracy    = #examples whose predicted label equals the gold label / #examples;
* consistency = #unique sentences all of whose examples are predicted correctly / #unique sentences,
  where a sentence is identified by its identifier with the pair id blanked, ``split-setid--sentid``
  (the same sentence was written for, and is paired with, several image pairs of one set).

Both are percentages over exactly the labelled examples; a missing prediction is an error, as in
the official script (which exits on one).

Official predictions file: CSV lines ``identifier,True`` / ``identifier,False``, no header; the
official script compares labels case-insensitively, and so does `read_predictions`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vlberts.data.nlvr2 import NLVR2Example, read_nlvr2
from vlberts.errors import VlbertsError
from vlberts.io import atomic_open, read_text
from vlberts.tasks.predictions import require_complete, unique_rows


@dataclass(frozen=True)
class NLVR2Scores:
    """Accuracy and consistency in percent."""

    accuracy: float
    consistency: float
    num_examples: int
    num_sentences: int  # unique sentence keys

    def to_dict(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "consistency": self.consistency,
            "num_examples": self.num_examples,
            "num_sentences": self.num_sentences,
        }

    def summary(self) -> str:
        return (
            f"NLVR2 accuracy {self.accuracy:.2f}%, consistency {self.consistency:.2f}% "
            f"({self.num_examples} examples, {self.num_sentences} sentences)"
        )


def score_predictions(predictions: Mapping[str, bool], examples: Sequence[NLVR2Example]) -> NLVR2Scores:
    """Accuracy and consistency of `predictions` (identifier -> predicted label) on labelled `examples`."""
    if not examples:
        raise ValueError("no examples to score")
    correct = 0
    all_correct: dict[str, bool] = {}  # sentence key -> every example so far correct
    for ex in examples:
        if ex.label is None:
            raise ValueError(f"example {ex.identifier} has no gold label")
        hit = bool(predictions[ex.identifier]) == ex.label
        correct += hit
        all_correct[ex.sentence_key] = all_correct.get(ex.sentence_key, True) and hit
    return NLVR2Scores(
        accuracy=100.0 * correct / len(examples),
        consistency=100.0 * sum(all_correct.values()) / len(all_correct),
        num_examples=len(examples),
        num_sentences=len(all_correct),
    )


def read_predictions(path: str | Path, identifiers: Sequence[str]) -> dict[str, bool]:
    """Read an official predictions CSV (``identifier,True|False`` per line, case-insensitive label).

    Each of `identifiers` needs exactly one prediction. A malformed line, an unknown or duplicate
    identifier, or a missing one is a one-line `VlbertsError` naming the file and the line/identifier.
    """
    known = set(identifiers)
    preds: dict[str, bool] = {}
    lines = read_text(path).splitlines()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"line {lineno}"
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 2 or parts[1].lower() not in ("true", "false"):
            got = line.strip()
            shown = repr(got if len(got) <= 80 else got[:77] + "...")
            json_file = lineno == 1 and got[:1] in "[{"  # another task's predictions.json, say
            raise VlbertsError(f"expected 'identifier,True' or 'identifier,False', got {shown}"
                               + (" (a JSON file: NLVR2's predictions are CSV lines, as `vlberts finetune nlvr2` "
                                  "writes predictions.csv)" if json_file else ""), path=path, record=where)
        identifier, label = parts
        if identifier not in known:
            raise VlbertsError(f"identifier {identifier} is not an example of the evaluated set",
                               path=path, record=where)
        if identifier in preds:
            raise VlbertsError(f"duplicate prediction for {identifier}", path=path, record=where)
        preds[identifier] = label.lower() == "true"
    require_complete(preds, identifiers, path=path, label="identifier")
    return preds


def write_predictions(path: str | Path, predictions: Iterable[tuple[str, bool]]) -> int:
    """Write the official CSV (``identifier,True|False``) atomically; returns the number of lines."""
    rows = unique_rows(predictions, path=path, label="identifier")
    lines = [f"{identifier},{'True' if label else 'False'}\n" for identifier, label in rows]
    with atomic_open(path) as f:
        f.writelines(lines)
    return len(lines)


def majority_label(train_examples: Iterable[NLVR2Example]) -> bool:
    """The more frequent training label (ties: True); the trivial baseline predicts it everywhere."""
    counts = Counter(ex.label for ex in train_examples if ex.label is not None)
    if not counts:
        raise ValueError("no labelled training examples")
    return counts[True] >= counts[False]


def nlvr2_metrics(
    predictions: Mapping[str, bool], eval_examples: Sequence[NLVR2Example],
    train_examples: Sequence[NLVR2Example] | None = None,
) -> dict:
    """metrics.json of NLVR2: `NLVR2Scores.to_dict()`, plus, when training examples are given, the trivial
    baseline that predicts the training majority label everywhere (``majority_label``, its accuracy
    ``majority_baseline`` and consistency ``majority_baseline_consistency``)."""
    out = score_predictions(predictions, eval_examples).to_dict()
    if train_examples:
        label = majority_label(train_examples)
        base = score_predictions({ex.identifier: label for ex in eval_examples}, eval_examples)
        out.update(majority_label="True" if label else "False", majority_baseline=base.accuracy,
                   majority_baseline_consistency=base.consistency)
    return out


def evaluate_predictions(
    predictions_path: str | Path, statements_path: str | Path, train_path: str | Path | None = None
) -> dict:
    """Score an official predictions CSV against a labelled NLVR2 JSON-lines file (`nlvr2_metrics`), with
    the majority baseline of `train_path` if given. Bad files are one-line `VlbertsError`s."""
    examples = read_nlvr2(statements_path, require_labels=True)
    if not examples:
        raise VlbertsError("no statements to score", path=statements_path)
    preds = read_predictions(predictions_path, [ex.identifier for ex in examples])
    train = read_nlvr2(train_path, require_labels=True) if train_path else None
    return nlvr2_metrics(preds, examples, train)
