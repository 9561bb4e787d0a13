"""GQA: exact-match accuracy, its answer normalisation, prediction files, majority baseline, and the
answer classes and targets of fine-tuning.

Metric (formats-and-metrics.md §2.3, §5; Hudson & Manning 2019 §4.4): accuracy = fraction of questions
whose predicted answer equals the gold ``answer``. The official ``eval.py`` compares the raw strings
(``correct = predicted == gold``) and LXMERT's local evaluator looks the raw prediction up in the label
dict, so neither normalises anything. The released gold answers are already lower-case, trimmed,
single-spaced words ("yes", "dark brown", "t-shirt"), so we normalise both sides with exactly those
three operations (`normalize_gqa_answer`): a prediction can only gain from it by differing from a gold
answer in case or spacing, never in content. ``normalize=False`` reproduces ``eval.py`` byte for byte.

Official results file (the GQA evaluation server and ``eval.py``):
``[{"questionId": "201307251", "prediction": "yes"}, ...]``.

Reported numbers are percentages (100 * mean), unrounded, as `vlberts.tasks.vqa` does before rounding.

Fine-tuning (LXMERT ``src/tasks/gqa.py`` and ``data/gqa/process_raw_data_scripts/process_data.py``): a
classifier over the training answers (LXMERT's 1,842 of trainval), label ``{answer: 1.0}``; the losses
are VQA's (`vlberts.tasks.vqa`), applied to this one-hot target.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from vlberts.data.gqa import GQAExample, read_gqa
from vlberts.data.vqa import is_target_pickle, warn_unless_pickled_table
from vlberts.errors import VlbertsError
from vlberts.io import read_json, require_keys
from vlberts.tasks.vqa import AnswerVocab, SoftTarget, read_answer_vocab, write_target_pickle
from vlberts.tasks.predictions import (excluded_images, last_questions, require_complete, without_images,
                                      write_json_predictions)


def normalize_gqa_answer(answer: str) -> str:
    """Lower-case, trim and collapse runs of whitespace to one space: ``" Dark  Brown\\n"`` -> ``"dark brown"``.

    Deliberately nothing else: GQA answers contain hyphens and apostrophes ("t-shirt", "man's"), and
    articles or number words are part of some answers, so VQA's punctuation/article rules would merge
    distinct GQA answers.
    """
    return " ".join(answer.lower().split())


def answers_match(prediction: str, gold: str, *, normalize: bool = True) -> bool:
    """Exact match, after `normalize_gqa_answer` on both sides unless `normalize` is False (official)."""
    if normalize:
        return normalize_gqa_answer(prediction) == normalize_gqa_answer(gold)
    return prediction == gold


@dataclass(frozen=True)
class GQAScores:
    """GQA accuracy in percent, overall and per structural type (verify/query/choose/logical/compare).

    `per_structural_type` holds only the types present, keys sorted; questions without a type count
    under ``"unknown"``.
    """

    accuracy: float
    per_structural_type: dict[str, float]
    num_questions: int
    num_correct: int

    def to_dict(self) -> dict:
        return {
            "accuracy": self.accuracy,
            "per_structural_type": dict(self.per_structural_type),
            "num_questions": self.num_questions,
            "num_correct": self.num_correct,
        }

    def summary(self) -> str:
        return f"GQA accuracy {self.accuracy:.2f}% on {self.num_questions} questions"


def score_predictions(
    predictions: Mapping[str, str], examples: Sequence[GQAExample], *, normalize: bool = True
) -> GQAScores:
    """Exact-match accuracy of `predictions` (question id -> answer) over annotated `examples`.

    Every example needs a gold answer and a prediction (check a predictions *file* with
    `read_predictions` first for user-facing errors).
    """
    if not examples:
        raise ValueError("no questions to score")
    correct = 0
    by_type: dict[str, list[int]] = {}
    for ex in examples:
        if ex.answer is None:
            raise ValueError(f"question {ex.question_id} has no gold answer")
        hit = int(answers_match(predictions[ex.question_id], ex.answer, normalize=normalize))
        correct += hit
        by_type.setdefault(ex.structural_type or "unknown", []).append(hit)
    return GQAScores(
        accuracy=100.0 * correct / len(examples),
        per_structural_type={k: 100.0 * sum(v) / len(v) for k, v in sorted(by_type.items())},
        num_questions=len(examples),
        num_correct=correct,
    )


def read_predictions(path: str | Path, question_ids: Sequence[str]) -> dict[str, str]:
    """Read an official results file ``[{"questionId": str, "prediction": str}, ...]``.

    Every question in `question_ids` needs exactly one prediction; unknown or duplicate ids, and
    non-string fields, are one-line `VlbertsError`s naming the file and the question. (``eval.py``
    silently keeps the last duplicate and crashes with a KeyError on a missing one.)
    """
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, list):
        raise VlbertsError("expected a JSON list of {questionId, prediction} objects (the GQA results format)",
                           path=path)
    known = set(question_ids)
    preds: dict[str, str] = {}
    for i, rec in enumerate(data):
        require_keys(rec, ("questionId", "prediction"), path=path, record=f"predictions[{i}]")
        qid = rec["questionId"]
        if isinstance(qid, int) and not isinstance(qid, bool):
            qid = str(qid)
        if not isinstance(qid, str):
            raise VlbertsError(f"questionId must be a string, got {qid!r}", path=path, record=f"predictions[{i}]")
        where = f"question {qid}"
        if qid not in known:
            raise VlbertsError("not a question of the evaluated set", path=path, record=where)
        if qid in preds:
            raise VlbertsError("duplicate prediction", path=path, record=where)
        if not isinstance(rec["prediction"], str):
            raise VlbertsError(f"prediction must be a string, got {rec['prediction']!r}", path=path, record=where)
        preds[qid] = rec["prediction"]
    require_complete(preds, question_ids, path=path, label="question")
    return preds


def write_predictions(path: str | Path, predictions: Iterable[tuple[str, str]]) -> int:
    """Write ``[{"questionId", "prediction"}]`` atomically; returns the number written."""
    rows = ((str(qid), str(answer)) for qid, answer in predictions)
    return write_json_predictions(path, rows, id_field="questionId", value_field="prediction", label="question")


def _answer_counts(train_examples: Iterable[GQAExample]) -> Counter[str]:
    return Counter(normalize_gqa_answer(ex.answer) for ex in train_examples if ex.answer is not None)


def majority_answer(train_examples: Iterable[GQAExample]) -> str:
    """Most frequent normalised training answer (ties: alphabetically first); the trivial baseline."""
    counts = _answer_counts(train_examples)
    if not counts:
        raise ValueError("no annotated training questions")
    return min(counts, key=lambda a: (-counts[a], a))


def majority_baseline(train_examples: Iterable[GQAExample], eval_examples: Sequence[GQAExample]) -> GQAScores:
    """Exact-match accuracy of always predicting the most frequent training answer."""
    answer = majority_answer(train_examples)
    return score_predictions({ex.question_id: answer for ex in eval_examples}, eval_examples)


def gqa_metrics(
    predictions: Mapping[str, str], eval_examples: Sequence[GQAExample],
    train_examples: Sequence[GQAExample] | None = None, *, normalize: bool = True,
) -> dict:
    """metrics.json of GQA: `GQAScores.to_dict()`, plus the majority-answer baseline when training
    examples are given (``majority_answer``, ``majority_baseline``, ``majority_baseline_per_structural_type``).
    `normalize=False`: the official eval.py's comparison of the strings as they are (``answers_normalized``)."""
    out = {**score_predictions(predictions, eval_examples, normalize=normalize).to_dict(), "answers_normalized": normalize}
    if train_examples:
        baseline = majority_baseline(train_examples, eval_examples)
        out.update(majority_answer=majority_answer(train_examples), majority_baseline=baseline.accuracy,
                   majority_baseline_per_structural_type=baseline.per_structural_type)
    return out


def evaluate_predictions(
    predictions_path: str | Path, questions_path: str | Path, train_questions_path: str | Path | None = None,
    answer_vocab: str | Path | None = None, last: int = 0, exclude_images: str | Path = "", normalize: bool = True,
) -> dict:
    """Score an official results file against a balanced questions file (`gqa_metrics`; `normalize=False`: the
    official eval.py's exact comparison of the strings as they are), with the
    majority baseline of `train_questions_path` if given. Either file may be ViLBERT's target pickle, whose
    answers `answer_vocab` names (its cache/trainval_ans2label.pkl); `last`: score only the questions with the
    `last` largest ids (ViLBERT's minval, `tasks.predictions.last_questions`), then without the questions on
    the images `exclude_images` lists (as `finetune gqa --exclude_images`; their count:
    ``questions_on_excluded_images``). Bad files are one-line `VlbertsError`s."""
    table = read_answer_vocab(answer_vocab).answers if answer_vocab else None
    pickles = [p for p in (questions_path, train_questions_path) if p and is_target_pickle(p)]
    if answer_vocab and pickles:
        warn_unless_pickled_table(answer_vocab, pickles[0])
    examples = last_questions(read_gqa(questions_path, require_answers=True, answers=table), last)
    examples, on_excluded = without_images(examples, excluded_images(str(exclude_images)))
    if not examples:
        raise VlbertsError("no questions to score", path=questions_path)
    preds = read_predictions(predictions_path, [ex.question_id for ex in examples])
    train = read_gqa(train_questions_path, require_answers=True, answers=table) if train_questions_path else None
    metrics = gqa_metrics(preds, examples, train, normalize=normalize)
    return {**metrics, "questions_on_excluded_images": on_excluded} if exclude_images else metrics


# --------------------------------------------------------------------------- fine-tuning


def build_answer_vocab(train_examples: Iterable[GQAExample], min_count: int = 1) -> AnswerVocab:
    """Answer classes: normalised training answers given by at least `min_count` questions, most frequent
    first, ties alphabetical (index 0 is the majority answer). LXMERT keeps every trainval answer (1)."""
    counts = _answer_counts(train_examples)
    return AnswerVocab.from_counts(counts, min_count)


def write_gqa_targets(path: str | Path, examples: Iterable[GQAExample], vocab: AnswerVocab) -> int:
    """Write answered questions as ViLBERT's GQA target pickle (`data.gqa` docstring), atomically: each record's
    question, image and its answer's class (`gqa_target`: none when the answer is not one); returns the number
    of records."""
    rows = (({"question_id": ex.question_id, "image_id": ex.image_id, "question": ex.question}, gqa_target(ex, vocab))
            for ex in examples)
    return write_target_pickle(path, rows)


def gqa_target(example: GQAExample, vocab: AnswerVocab) -> SoftTarget:
    """LXMERT's GQA label ``{answer: 1.0}``: the gold answer's class scored 1.0; no class (the answer in
    `dropped`) when the answer is not one of the classes -- the question can then only be answered wrong."""
    if example.answer is None:
        raise ValueError(f"question {example.question_id} has no gold answer")
    answer = normalize_gqa_answer(example.answer)
    if answer in vocab:
        return SoftTarget((vocab.ans2idx[answer],), (1.0,))
    return SoftTarget((), (), (answer,))
