"""VCR: Q->A, QA->R and Q->AR accuracy.

Metrics (formats-and-metrics.md §5; Zellers et al. 2019 §5; vilbert-multi-task
``script/VCR_Q_AR_evaluation.py``, VL-BERT ``vcr/val.py``):

* Q->A  = fraction of questions whose chosen answer is the gold answer;
* QA->R = fraction whose chosen rationale is the gold rationale, the rationale being chosen with the
  *gold* answer appended to the question (`vlberts.data.vcr.rationale_context`), not the predicted one;
* Q->AR = fraction with both right (one question, two argmaxes, scored jointly).

A choice is the argmax of the 4 scores; on a tie the lowest index wins (``numpy.argmax``).
Reported as percentages. Chance is 25 / 25 / 6.25.

The leaderboard's submission file (r2c ``models/README.md``, "Submitting to the leaderboard"; its
``eval_for_leaderboard.py``) is a CSV with a header row and one row per question: ``annot_id``, the 4
answer scores ``answer_0..3``, and for each answer k the 4 rationale scores computed with answer k as the
context, ``rationale_conditioned_on_a{k}_{j}`` (the test set has no labels, so QA->R is scored for every
answer and the scorer reads the row of the gold one). `score_submission` scores it that way: the argmax
answer for Q->A, the argmax of the rationales conditioned on the *gold* answer for QA->R.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vlberts.data.vcr import NUM_CHOICES, VCRExample
from vlberts.errors import VlbertsError, first_line
from vlberts.io import atomic_open, read_text
from vlberts.tasks.predictions import choose, require_complete, unique_rows

CHANCE = {"q2a": 25.0, "qa2r": 25.0, "q2ar": 6.25}


@dataclass(frozen=True)
class VCRScores:
    """Q->A, QA->R and Q->AR accuracy in percent."""

    q2a: float
    qa2r: float
    q2ar: float
    num_questions: int

    def to_dict(self) -> dict:
        return {"q2a": self.q2a, "qa2r": self.qa2r, "q2ar": self.q2ar, "num_questions": self.num_questions}

    def summary(self) -> str:
        return (f"VCR Q->A {self.q2a:.2f}%, QA->R {self.qa2r:.2f}%, Q->AR {self.q2ar:.2f}% "
                f"on {self.num_questions} questions")


def score_predictions(
    answer_choices: Mapping[str, int], rationale_choices: Mapping[str, int], examples: Sequence[VCRExample]
) -> VCRScores:
    """Score chosen answer and rationale indices (annot_id -> 0-based index) on annotated `examples`.

    The rationale choices must come from scoring with the gold answer as context (QA->R).
    """
    if not examples:
        raise ValueError("no questions to score")
    n_a = n_r = n_ar = 0
    for ex in examples:
        if not ex.annotated:
            raise ValueError(f"{ex.annot_id} has no gold answer/rationale label")
        a_ok = answer_choices[ex.annot_id] == ex.answer_label
        r_ok = rationale_choices[ex.annot_id] == ex.rationale_label
        n_a += a_ok
        n_r += r_ok
        n_ar += a_ok and r_ok
    n = len(examples)
    return VCRScores(q2a=100.0 * n_a / n, qa2r=100.0 * n_r / n, q2ar=100.0 * n_ar / n, num_questions=n)


def score_logits(
    answer_scores: Mapping[str, Sequence[float]],
    rationale_scores: Mapping[str, Sequence[float]],
    examples: Sequence[VCRExample],
) -> VCRScores:
    """`score_predictions` from per-choice scores (annot_id -> 4 scores), choosing each with `choose`."""
    return score_predictions(
        {ex.annot_id: choose(answer_scores[ex.annot_id]) for ex in examples},
        {ex.annot_id: choose(rationale_scores[ex.annot_id]) for ex in examples},
        examples,
    )


# --------------------------------------------------------------------------- the leaderboard's submission CSV

SUBMISSION_COLUMNS = (
    "annot_id",
    *(f"answer_{j}" for j in range(NUM_CHOICES)),
    *(f"rationale_conditioned_on_a{k}_{j}" for k in range(NUM_CHOICES) for j in range(NUM_CHOICES)),
)


@dataclass(frozen=True)
class SubmissionRow:
    """One question of a submission: the 4 answer scores, and rationale[k] the 4 rationale scores given answer k."""

    answers: tuple[float, ...]  # (4,)
    rationales: tuple[tuple[float, ...], ...]  # (4, 4)


def write_submission(path: str | Path, rows: Iterable[tuple[str, SubmissionRow]]) -> int:
    """Write the leaderboard CSV (`SUBMISSION_COLUMNS`, header first) atomically; returns the number of rows."""
    rows = unique_rows(rows, path=path, label="annot_id")
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(SUBMISSION_COLUMNS)
    for annot_id, row in rows:
        if len(row.answers) != NUM_CHOICES or len(row.rationales) != NUM_CHOICES or any(
                len(r) != NUM_CHOICES for r in row.rationales):
            raise ValueError(f"{annot_id}: expected 4 answer scores and 4 x 4 rationale scores")
        writer.writerow([annot_id, *(repr(float(x)) for x in row.answers),
                         *(repr(float(x)) for r in row.rationales for x in r)])
    with atomic_open(path) as f:
        f.write(buf.getvalue())
    return len(rows)


def _csv_rows(reader: Iterator[list[str]], path: str | Path) -> Iterator[list[str]]:
    """The rows of a `csv.reader` (its header already read), a malformed row (a field past the csv module's
    size limit, a quote left open) a one-line error naming the file and the line."""
    while True:
        try:
            yield next(reader)
        except StopIteration:
            return
        except csv.Error as e:
            raise VlbertsError(f"malformed CSV ({first_line(e)})", path=path,
                               record=f"line {reader.line_num}") from None  # type: ignore[attr-defined]


def read_submission(path: str | Path, annot_ids: Sequence[str] | None = None) -> dict[str, SubmissionRow]:
    """Read a leaderboard CSV. A wrong header, a row with another number of fields, a score that is not a
    finite number, a duplicate annot_id, or (given `annot_ids`) an unknown or missing one is a one-line
    `VlbertsError` naming the file and the line or question."""
    lines = csv.reader(io.StringIO(read_text(path)))
    header = next(lines, None)
    if header is None or tuple(h.strip() for h in header) != SUBMISSION_COLUMNS:
        got = "an empty file" if header is None else ",".join(header[:3]) + ("..." if len(header) > 3 else "")
        raise VlbertsError(f"expected the leaderboard header annot_id,answer_0,...,rationale_conditioned_on_a3_3 "
                           f"({len(SUBMISSION_COLUMNS)} columns), got {got}", path=path, record="line 1")
    known = set(annot_ids) if annot_ids is not None else None
    out: dict[str, SubmissionRow] = {}
    for lineno, fields in enumerate(_csv_rows(lines, path), 2):
        if not fields or not any(f.strip() for f in fields):
            continue
        where = f"line {lineno}"
        if len(fields) != len(SUBMISSION_COLUMNS):
            raise VlbertsError(f"expected {len(SUBMISSION_COLUMNS)} fields, got {len(fields)}", path=path, record=where)
        annot_id = fields[0].strip()
        try:
            scores = [float(f) for f in fields[1:]]
        except ValueError:
            raise VlbertsError(f"{annot_id}: a score is not a number", path=path, record=where) from None
        if not all(math.isfinite(x) for x in scores):
            raise VlbertsError(f"{annot_id}: a score is not finite", path=path, record=where)
        if known is not None and annot_id not in known:
            raise VlbertsError(f"annot_id {annot_id} is not a question of the evaluated file", path=path, record=where)
        if annot_id in out:
            raise VlbertsError(f"duplicate row for {annot_id}", path=path, record=where)
        n = NUM_CHOICES
        out[annot_id] = SubmissionRow(tuple(scores[:n]), tuple(tuple(scores[n + k * n : n + (k + 1) * n])
                                                               for k in range(n)))
    if annot_ids is not None:
        require_complete(out, annot_ids, path=path, label="annot_id")
    return out


def score_submission(submission: Mapping[str, SubmissionRow], examples: Sequence[VCRExample]) -> VCRScores:
    """Q->A, QA->R and Q->AR of a submission on annotated `examples`, as the leaderboard scores it: QA->R reads
    the rationale scores conditioned on each question's gold answer."""
    for ex in examples:
        if not ex.annotated:
            raise ValueError(f"{ex.annot_id} has no gold answer/rationale label")
    return score_logits({ex.annot_id: submission[ex.annot_id].answers for ex in examples},
                        {ex.annot_id: submission[ex.annot_id].rationales[ex.answer_label] for ex in examples},
                        examples)
