"""VCR: Q->A, QA->R and Q->AR accuracy.

Metrics (formats-and-metrics.md §5; Zellers et al. 2019 §5; vilbert-multi-task
``script/VCR_Q_AR_evaluation.py``, VL-BERT ``vcr/val.py``):

* Q->A  = fraction of questions whose chosen answer is the gold answer;
* QA->R = fraction whose chosen rationale is the gold rationale, the rationale being chosen with the
  *gold* answer appended to the question (`vlberts.data.vcr.rationale_context`), not the predicted one;
* Q->AR = fraction with both right (one question, two argmaxes, scored jointly).

A choice is the argmax of the 4 scores; on a tie the lowest index wins (``numpy.argmax``).
Reported as percentages. Chance is 25 / 25 / 6.25.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from vlberts.data.vcr import VCRExample
from vlberts.tasks.predictions import choose

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
