"""VQA v2: official answer normalisation and accuracy, answer vocabulary, soft scores, losses, prediction files.

The normalisation and accuracy reproduce the official evaluator, GT-Vision-Lab/VQA
``PythonEvaluationTools/vqaEvaluation/vqaEval.py`` (the current, VQA v2 version: straight apostrophes in
the contractions table, 21 punctuation marks), *including its quirks*, so that a number printed here is
the number the evaluation server prints. The quirks are marked ``QUIRK`` below. Note that
formats-and-metrics.md §2.2 lists the punctuation of an older revision of that file (with ``:`` and
``'``, without ``{ } - !``) and its curly-apostrophe contractions; the current file differs.

Per question (vqaEval.evaluate):
  prediction   -> '\\n','\\t' to space, strip, process_punctuation, process_digit_article
  GT answers   -> process_punctuation only, and only when the 10 answers are not all identical
  accuracy     =  mean over the 10 GT answers of min(1, #{other 9 GT answers == prediction} / 3)
Reported numbers (vqaEval.setAccuracy) are 100 * mean, rounded to 2 decimals with Python's round().
"""

from __future__ import annotations

import functools
import json
import pickle
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from vlberts.data.vqa import NUM_GT_ANSWERS, VQAExample, holds_answers, is_target_pickle, read_vqa, warn_unless_pickled_table
from vlberts.errors import VlbertsError
from vlberts.io import atomic_open, read_json, read_text, require_keys, write_json
from vlberts.safe_pickle import safe_load
from vlberts.tasks.predictions import (excluded_images, last_questions, require_complete, without_images,
                                      write_json_predictions)

# --------------------------------------------------------------------------- official normalisation

# vqaEval.punct, in its order. The period is handled separately (PERIOD_STRIP); ':' and "'" are NOT in
# the current list, so "don't" and "2:30" keep them.
PUNCTUATION: tuple[str, ...] = (
    ";", "/", "[", "]", '"', "{", "}", "(", ")", "=", "+", "\\", "_", "-", ">", "<", "@", "`", ",", "?", "!",
)  # fmt: skip

# vqaEval.manualMap: number words up to ten (and "none") become digits.
NUMBER_WORDS: dict[str, str] = {
    "none": "0", "zero": "0", "one": "1", "two": "2", "three": "3", "four": "4",
    "five": "5", "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10",
}  # fmt: skip

ARTICLES = frozenset({"a", "an", "the"})

# vqaEval.contractions: applied word by word after lower-casing.
# QUIRK: the keys "Id've", "I'dve", "Im", "Ive" have capitals and can never match a lower-cased word,
# so "im" stays "im"; and "somebody'd" maps *to* "somebodyd" (the reverse of every other entry).
CONTRACTIONS: dict[str, str] = {
    "aint": "ain't", "arent": "aren't", "cant": "can't", "couldve": "could've", "couldnt": "couldn't",
    "couldn'tve": "couldn't've", "couldnt've": "couldn't've", "didnt": "didn't", "doesnt": "doesn't",
    "dont": "don't", "hadnt": "hadn't", "hadnt've": "hadn't've", "hadn'tve": "hadn't've", "hasnt": "hasn't",
    "havent": "haven't", "hed": "he'd", "hed've": "he'd've", "he'dve": "he'd've", "hes": "he's",
    "howd": "how'd", "howll": "how'll", "hows": "how's", "Id've": "I'd've", "I'dve": "I'd've",
    "Im": "I'm", "Ive": "I've", "isnt": "isn't", "itd": "it'd", "itd've": "it'd've", "it'dve": "it'd've",
    "itll": "it'll", "let's": "let's", "maam": "ma'am", "mightnt": "mightn't", "mightnt've": "mightn't've",
    "mightn'tve": "mightn't've", "mightve": "might've", "mustnt": "mustn't", "mustve": "must've",
    "neednt": "needn't", "notve": "not've", "oclock": "o'clock", "oughtnt": "oughtn't",
    "ow's'at": "'ow's'at", "'ows'at": "'ow's'at", "'ow'sat": "'ow's'at", "shant": "shan't",
    "shed've": "she'd've", "she'dve": "she'd've", "she's": "she's", "shouldve": "should've",
    "shouldnt": "shouldn't", "shouldnt've": "shouldn't've", "shouldn'tve": "shouldn't've",
    "somebody'd": "somebodyd", "somebodyd've": "somebody'd've", "somebody'dve": "somebody'd've",
    "somebodyll": "somebody'll", "somebodys": "somebody's", "someoned": "someone'd",
    "someoned've": "someone'd've", "someone'dve": "someone'd've", "someonell": "someone'll",
    "someones": "someone's", "somethingd": "something'd", "somethingd've": "something'd've",
    "something'dve": "something'd've", "somethingll": "something'll", "thats": "that's",
    "thered": "there'd", "thered've": "there'd've", "there'dve": "there'd've", "therere": "there're",
    "theres": "there's", "theyd": "they'd", "theyd've": "they'd've", "they'dve": "they'd've",
    "theyll": "they'll", "theyre": "they're", "theyve": "they've", "twas": "'twas", "wasnt": "wasn't",
    "wed've": "we'd've", "we'dve": "we'd've", "weve": "we've", "werent": "weren't", "whatll": "what'll",
    "whatre": "what're", "whats": "what's", "whatve": "what've", "whens": "when's", "whered": "where'd",
    "wheres": "where's", "whereve": "where've", "whod": "who'd", "whod've": "who'd've",
    "who'dve": "who'd've", "wholl": "who'll", "whos": "who's", "whove": "who've", "whyll": "why'll",
    "whyre": "why're", "whys": "why's", "wont": "won't", "wouldve": "would've", "wouldnt": "wouldn't",
    "wouldnt've": "wouldn't've", "wouldn'tve": "wouldn't've", "yall": "y'all", "yall'll": "y'all'll",
    "y'allll": "y'all'll", "yall'd've": "y'all'd've", "y'alld've": "y'all'd've", "y'all'dve": "y'all'd've",
    "youd": "you'd", "youd've": "you'd've", "you'dve": "you'd've", "youll": "you'll", "youre": "you're",
    "youve": "you've",
}  # fmt: skip

# vqaEval.commaStrip: a comma between two digits ("1,000").
COMMA_STRIP = re.compile(r"(\d)(,)(\d)")

# vqaEval.periodStrip is "(?!<=\d)(\.)(?!\d)". QUIRK: "(?!<=\d)" was meant as a look-behind "(?<!\d)"
# but is a look-ahead for the two characters "<=" plus a digit, which can never match where the "."
# is, so it is a no-op: every period NOT FOLLOWED by a digit is removed. "3.5" and ".5" keep theirs,
# "dog." and "3." (which a look-behind would have kept) lose theirs. We write the effective pattern.
PERIOD_STRIP = re.compile(r"\.(?!\d)")

# QUIRK: vqaEval calls periodStrip.sub("", text, re.UNICODE): the flag lands in the positional `count`
# argument, and re.UNICODE == 32, so at most the first 32 periods are removed.
PERIOD_STRIP_MAX = 32


# Both normalisations are pure functions of one string, and a data set repeats its answers (VQA v2 train: 4.4M
# ground-truth answers, a few hundred thousand distinct): cached, they cost once per distinct answer.
@functools.lru_cache(maxsize=1 << 18)
def process_punctuation(text: str) -> str:
    """vqaEval.processPunctuation: delete or blank the 21 punctuation marks, then strip periods.

    For each mark: if it appears next to a space anywhere in the *original* text, or the original
    text contains a digit-comma-digit anywhere, every occurrence of it is deleted; otherwise every
    occurrence becomes a space. QUIRK: the decision is global per mark (one spaced "-" makes
    "t-shirt" collapse to "tshirt"), and a single "1,000" makes *all* marks be deleted. The result is
    not re-stripped, so "red!" becomes "red " (trailing space) -- this matters for GT answers, which
    get no further processing.
    """
    out = text
    has_digit_comma = COMMA_STRIP.search(text) is not None
    for p in PUNCTUATION:
        if (p + " " in text or " " + p in text) or has_digit_comma:
            out = out.replace(p, "")
        else:
            out = out.replace(p, " ")
    return PERIOD_STRIP.sub("", out, count=PERIOD_STRIP_MAX)


def process_digit_article(text: str) -> str:
    """vqaEval.processDigitArticle: lower-case, split on whitespace, number words to digits, drop
    articles, expand contractions, join with single spaces.

    Order matters: number words are mapped before the article check and contractions after it, and
    everything works on whole words, so "one way" -> "1 way" and "the" alone -> "" (empty answer).
    """
    words = [NUMBER_WORDS.get(w, w) for w in text.lower().split()]
    words = [CONTRACTIONS.get(w, w) for w in words if w not in ARTICLES]
    return " ".join(words)


@functools.lru_cache(maxsize=1 << 18)
def normalize_answer(answer: str) -> str:
    """The full normalisation the official evaluator applies to a *predicted* answer."""
    answer = answer.replace("\n", " ").replace("\t", " ").strip()
    return process_digit_article(process_punctuation(answer))


def process_gt_answers(answers: Sequence[str]) -> list[str]:
    """What the official evaluator compares a normalised prediction against.

    QUIRK (vqaEval.evaluate): GT answers only get `process_punctuation` -- never lower-casing, number
    words, articles or contractions -- and only when the answers are *not all identical*. So ten GT
    "dog." are compared as "dog." and no prediction can match them (a prediction always loses its
    final period), while nine "dog." and one "cat" become "dog" and match "dog". VQA v2 GT answers
    were cleaned by the dataset authors, so this rarely bites on the real data.
    """
    if len(set(answers)) > 1:
        return [process_punctuation(a) for a in answers]
    return list(answers)


# --------------------------------------------------------------------------- official accuracy


def accuracy_processed(prediction: str, gt_answers: Sequence[str]) -> float:
    """Leave-one-out accuracy of an already normalised prediction against processed GT answers.

    For each GT answer: acc = min(1, #(other GT answers equal to the prediction) / 3); the question's
    accuracy is the mean over the GT answers (Antol et al. 2015 §4; vqaEval.evaluate). Summed in the
    same order with the same float operations as the official script, so results are bit-identical.

    vqaEval leaves out a GT answer by comparing whole answer records (answer, confidence, id); with
    the distinct answer_ids 1..10 of the real files that is exactly "leave this one out", which is
    what we do (duplicate answer records are not reproduced).
    """
    if not gt_answers:
        raise ValueError("a question needs at least one ground-truth answer to be scored")
    n_match = sum(1 for g in gt_answers if g == prediction)
    accs = [min(1, float(n_match - (g == prediction)) / 3) for g in gt_answers]
    return float(sum(accs)) / len(accs)


def vqa_accuracy(prediction: str, gt_answers: Sequence[str]) -> float:
    """Official VQA accuracy in [0, 1] of one raw predicted answer against the raw GT answers."""
    return accuracy_processed(normalize_answer(prediction), process_gt_answers(gt_answers))


def example_accuracy(prediction: str, example: VQAExample) -> float:
    """The accuracy of one predicted answer for an annotated example: the official one from its ten answers,
    or, for a question read from LXMERT's list (scores, not answers), LXMERT's: the score its label gives the
    predicted answer (`VQAEvaluator.evaluate`; the official accuracy where the answer strings agree)."""
    if example.answers:
        return vqa_accuracy(prediction, example.answers)
    if example.label is None:
        raise ValueError(f"question_id {example.question_id} has no GT answers")
    return example.label.get(prediction, 0.0)


def soft_score(count: int) -> float:
    """VQA soft score of an answer given by `count` of the 10 annotators: 0, .3, .6, .9, 1 for 0..3, >=4.

    hengyuan-hu/bottom-up-attention-vqa ``tools/compute_softscore.py:get_score``, used by LXMERT and
    ViLBERT (VisualBERT's ``min(0.3 * count, 1)`` is the same table). For 10 GT answers it equals the
    official leave-one-out accuracy: (n*min(1,(n-1)/3) + (10-n)*min(1,n/3)) / 10.
    """
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    return (0.0, 0.3, 0.6, 0.9)[count] if count < 4 else 1.0


def _percent(values: Sequence[float]) -> float:
    # vqaEval.setAccuracy computes 100*float(sum(acc))/len(acc): multiply the sum, then divide.
    return 100 * float(sum(values)) / len(values)


@dataclass(frozen=True)
class VQAScores:
    """Official VQA metrics. Percentages rounded to 2 decimals as vqaEval.setAccuracy does.

    `per_answer_type` / `per_question_type` hold only the types present (as the official script; none
    for questions read from a Pythia imdb, which has no types); keys are sorted. `accuracy_unrounded`
    keeps the full-precision overall percentage.
    """

    accuracy: float
    accuracy_unrounded: float
    per_answer_type: dict[str, float]
    per_question_type: dict[str, float]
    num_questions: int
    num_label_scored: int = 0  # questions from LXMERT's list, scored by their label (`example_accuracy`)

    def to_dict(self) -> dict:
        label = {"label_scored_questions": self.num_label_scored} if self.num_label_scored else {}
        return {
            "accuracy": self.accuracy,
            "accuracy_unrounded": self.accuracy_unrounded,
            "per_answer_type": dict(self.per_answer_type),
            "per_question_type": dict(self.per_question_type),
            "num_questions": self.num_questions,
            **label,
        }

    def summary(self) -> str:
        return f"VQA accuracy {self.accuracy:.2f}% on {self.num_questions} questions{answer_types(self.per_answer_type)}"


def answer_types(per_answer_type: Mapping[str, float]) -> str:
    """" (number 66.93, other 71.72, yes/no 71.31)", or "" when the questions have no answer types."""
    types = ", ".join(f"{k} {v:.2f}" for k, v in per_answer_type.items())
    return f" ({types})" if types else ""


def score_predictions(predictions: Mapping[int, str], examples: Sequence[VQAExample]) -> VQAScores:
    """Score raw predicted answers (question_id -> answer) on annotated examples, officially (questions read
    from LXMERT's list by their label scores, counted in `num_label_scored`).

    Every example must be annotated and have a prediction (check a predictions *file* with
    `read_predictions` first for user-facing errors). Questions are summed in `examples` order.
    """
    if not examples:
        raise ValueError("no questions to score")
    per_q: list[float] = []
    by_answer_type: dict[str, list[float]] = {}
    by_question_type: dict[str, list[float]] = {}
    for ex in examples:
        if not ex.annotated:
            raise ValueError(f"question_id {ex.question_id} has no GT answers")
        acc = example_accuracy(predictions[ex.question_id], ex)
        per_q.append(acc)
        if ex.answer_type is not None:  # an imdb's questions have no types (`read_vqa_imdb`)
            by_answer_type.setdefault(ex.answer_type, []).append(acc)
        if ex.question_type is not None:
            by_question_type.setdefault(ex.question_type, []).append(acc)
    unrounded = _percent(per_q)
    return VQAScores(
        accuracy=round(unrounded, 2),
        accuracy_unrounded=unrounded,
        per_answer_type={k: round(_percent(v), 2) for k, v in sorted(by_answer_type.items())},
        per_question_type={k: round(_percent(v), 2) for k, v in sorted(by_question_type.items())},
        num_questions=len(per_q),
        num_label_scored=sum(1 for ex in examples if not ex.answers),
    )


# --------------------------------------------------------------------------- prediction files


def read_predictions(path: str | Path, question_ids: Sequence[int]) -> dict[int, str]:
    """Read an official results file ``[{"question_id": int, "answer": str}, ...]``.

    The official loader (vqaTools/vqa.py:loadRes) asserts that the predicted question ids are exactly
    the annotated ones. We are stricter in one way -- a duplicate prediction is an error, where the
    official script silently keeps the last -- and every problem is a one-line `VlbertsError` naming
    the file and the question id (or ``predictions[i]`` when the id itself is unusable).
    """
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, list):
        raise VlbertsError("expected a JSON list of {question_id, answer} objects (the official results format)", path=path)
    known = set(question_ids)
    first_at: dict[int, int] = {}
    preds: dict[int, str] = {}
    for i, rec in enumerate(data):
        require_keys(rec, ("question_id", "answer"), path=path, record=f"predictions[{i}]")
        qid = rec["question_id"]
        if not isinstance(qid, int) or isinstance(qid, bool):
            raise VlbertsError(f"question_id must be an integer, got {qid!r}", path=path, record=f"predictions[{i}]")
        where = f"question_id {qid}"
        if qid not in known:
            raise VlbertsError("not a question of the annotation set", path=path, record=where)
        if qid in first_at:
            raise VlbertsError(
                f"duplicate prediction (predictions[{first_at[qid]}] and predictions[{i}]); "
                "the official script needs exactly one per question",
                path=path,
                record=where,
            )
        answer = rec["answer"]
        if not isinstance(answer, str):
            raise VlbertsError(f"answer must be a string, got {answer!r}", path=path, record=where)
        first_at[qid] = i
        preds[qid] = answer
    require_complete(preds, question_ids, path=path, label="question_id")
    return preds


def write_predictions(path: str | Path, predictions: Iterable[tuple[int, str]]) -> int:
    """Write ``[{"question_id", "answer"}]`` atomically (the EvalAI / official results format).

    Returns the number written. A duplicate question id is an error: the server would score it once.
    """
    rows = ((int(qid), str(answer)) for qid, answer in predictions)
    return write_json_predictions(path, rows, id_field="question_id", value_field="answer", label="question_id")


def evaluate_predictions(
    predictions_path: str | Path, questions_path: str | Path, annotations_path: str | Path | None = None,
    answer_vocab: str | Path | None = None, last: int = 0, exclude_images: str | Path = "",
) -> dict:
    """Score an official predictions file as vqaEval.py does; returns `VQAScores.to_dict()`. The answers come
    from the annotations file, or from the questions file itself when it is a Pythia imdb `.npy`. ViLBERT's
    target pickle as the annotations file names its answers through `answer_vocab` (trainval_ans2label.pkl);
    its questions score their label's score of the prediction, as ViLBERT's evaluation does. `last`: score only
    the questions with the `last` largest ids (ViLBERT's minval, `tasks.predictions.last_questions`); then
    `exclude_images` (an image-id list) leaves out the questions on those images, as `finetune vqa
    --exclude_images` does (their count: ``questions_on_excluded_images``).

    Keys: ``accuracy`` (percent, 2 decimals), ``accuracy_unrounded``, ``per_answer_type``,
    ``per_question_type``, ``num_questions``.
    """
    if not annotations_path and not holds_answers(questions_path):
        raise VlbertsError("scoring a VQA v2 questions JSON needs its annotations file (--annotations)",
                           path=questions_path)
    table = read_answer_vocab(answer_vocab).answers if answer_vocab else None
    if answer_vocab and annotations_path and is_target_pickle(annotations_path):
        warn_unless_pickled_table(answer_vocab, annotations_path)
    examples = last_questions(read_vqa(questions_path, annotations_path, answers=table), last)
    examples, on_excluded = without_images(examples, excluded_images(str(exclude_images)))
    if not examples or not examples[0].annotated:
        raise VlbertsError("no annotated questions to score", path=annotations_path or questions_path)
    preds = read_predictions(predictions_path, [ex.question_id for ex in examples])
    scores = score_predictions(preds, examples).to_dict()
    return {**scores, "questions_on_excluded_images": on_excluded} if exclude_images else scores


# --------------------------------------------------------------------------- answer vocabulary


@dataclass(frozen=True)
class AnswerVocab:
    """The answer classes of a VQA classifier head: index i <-> `answers[i]` (normalised strings)."""

    answers: tuple[str, ...]
    ans2idx: dict[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "answers", tuple(self.answers))
        ans2idx = {a: i for i, a in enumerate(self.answers)}
        if len(ans2idx) != len(self.answers):
            raise ValueError("answer vocabulary has duplicate entries")
        object.__setattr__(self, "ans2idx", ans2idx)

    def __len__(self) -> int:
        return len(self.answers)

    def __contains__(self, answer: object) -> bool:
        return answer in self.ans2idx

    @classmethod
    def from_counts(cls, counts: Mapping[str, int], min_count: int = 1) -> AnswerVocab:
        """The answers counted at least `min_count` times, most frequent first, ties alphabetical (so index 0
        is the majority answer): how every answer table here is built from training answers."""
        return cls(tuple(sorted((a for a, c in counts.items() if c >= min_count), key=lambda a: (-counts[a], a))))


def build_answer_vocab(examples: Iterable[VQAExample], min_count: int = 9) -> AnswerVocab:
    """Answers kept as classes: normalised `multiple_choice_answer`s of at least `min_count` questions.

    Follows hengyuan-hu ``compute_softscore.py`` (``filter_answers``), whose vocabulary LXMERT and
    ViLBERT reuse: min_count=9 over VQA v2 train+val gives their 3129 answers. Its extra
    ``.replace(',', '')`` is a no-op after `process_punctuation` (every comma is deleted or blanked),
    so `normalize_answer` alone is used. Its order is Python-2 dict order (arbitrary); ours is
    deterministic: most frequent first, ties alphabetical -- so index 0 is the majority answer.
    """
    counts = Counter(
        normalize_answer(ex.multiple_choice_answer) for ex in examples if ex.multiple_choice_answer is not None
    )
    return AnswerVocab.from_counts(counts, min_count)


def write_answer_vocab(path: str | Path, vocab: AnswerVocab) -> None:
    """Write the vocabulary as a JSON list (label -> answer), atomically."""
    write_json(path, list(vocab.answers), indent=None)


def _answer_lines(path: str | Path) -> list[str]:
    """A text file with one answer a line (Pythia's `answers_vqa.txt`, VisualBERT's and VL-BERT's table), line
    i the class i; a blank line is an error naming it (Pythia would make it the class "")."""
    lines = read_text(path).split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline ending the last line
    for i, line in enumerate(lines, 1):
        if not line.strip():
            raise VlbertsError("blank line in an answer table (one answer a line)", path=path, record=f"line {i}")
    return [line.strip() for line in lines]


def read_answer_vocab(path: str | Path, sets: Sequence[str] = ()) -> AnswerVocab:
    """Read a JSON list of answers, an ``{answer: index}`` object (LXMERT's trainval_ans2label.json), LXMERT's
    joint pre-training table ``all_ans.json`` (a list of ``{"ans": answer, "dsets": [data sets]}``, in class
    order), a text file of one answer a line (`.txt`: Pythia's answers_vqa.txt, kept as written, its
    `<unk>` line too, so class indices are VisualBERT's; no ground-truth answer normalises to `<unk>`, so that
    class is never a target, which is VisualBERT's `<unk>` -> 0), or a pickle of either JSON form (`.pkl`,
    through the restricted unpickler: ViLBERT's cache/trainval_ans2label.pkl or trainval_label2ans.pkl).

    sets: keep only the answers of ``all_ans.json`` used by one of these data sets (``vqa``, ``gqa``,
    ``visual7w``), in the file's order, as LXMERT's ``AnswerTable(dsets)`` does; the other forms name no data
    set, so giving sets for them is an error."""
    suffix = Path(path).suffix.lower()
    data = _answer_lines(path) if suffix == ".txt" else safe_load(path) if suffix == ".pkl" else read_json(path)
    data_sets = data  # (all_ans.json's records, for naming its data sets)
    if isinstance(data, list) and data and all(isinstance(a, dict) for a in data):
        data = _lxmert_answers(data, sets, path)
    elif sets:
        raise VlbertsError("answer data sets are named in LXMERT's all_ans.json only ({ans, dsets} records)", path=path)
    if isinstance(data, dict):
        if sorted(data.values()) != list(range(len(data))) or not all(isinstance(a, str) for a in data):
            raise VlbertsError("answer-to-index object must map strings to the indices 0..N-1", path=path)
        answers = sorted(data, key=data.__getitem__)
    elif isinstance(data, list) and all(isinstance(a, str) for a in data):
        answers = data
    else:
        raise VlbertsError("expected a list of answers, an {answer: index} object or LXMERT's all_ans.json "
                           "({ans, dsets} records)", path=path)
    if len(set(answers)) != len(answers):
        raise VlbertsError("answer vocabulary has duplicate entries", path=path)
    if not answers:
        present = sorted({d for rec in data_sets if isinstance(rec, dict) for d in rec.get("dsets", [])
                          if isinstance(d, str)}) if sets and isinstance(data_sets, list) else []
        raise VlbertsError("the answer table is empty" + (f" (no answer of {', '.join(sets)}"
                                                          + (f"; the file's data sets: {', '.join(present)}" if present else "")
                                                          + ")" if sets else ""), path=path)
    return AnswerVocab(tuple(answers))


def _lxmert_answers(records: list[dict], sets: Sequence[str], path: str | Path) -> list[str]:
    """The answers of LXMERT's all_ans.json records, those of `sets` only when given."""
    out = []
    for i, rec in enumerate(records):
        answer, used = rec.get("ans"), rec.get("dsets", None if sets else [])
        if not isinstance(answer, str) or not isinstance(used, list) or not all(isinstance(d, str) for d in used):
            raise VlbertsError("an all_ans.json record needs ans (a string) and dsets (a list of data set names)",
                               path=path, record=f"[{i}]")
        if not sets or set(used) & set(sets):
            out.append(answer)
    return out


# --------------------------------------------------------------------------- soft-score targets


@dataclass(frozen=True)
class SoftTarget:
    """Sparse soft-score target of one question: vocabulary indices (ascending) and their scores.

    `dropped` lists the distinct GT answers (as the evaluator sees them) that are not in the vocabulary.
    """

    labels: tuple[int, ...]
    scores: tuple[float, ...]
    dropped: tuple[str, ...] = ()


@dataclass(frozen=True)
class SoftTargetStats:
    num_questions: int
    num_without_target: int  # questions none of whose GT answers is in the vocabulary
    num_dropped_answers: int  # (question, distinct GT answer) pairs outside the vocabulary


def soft_target(gt_answers: Sequence[str], vocab: AnswerVocab) -> SoftTarget:
    """Soft scores over the vocabulary from the count of GT answers equal to each class.

    GT answers are counted *as the official evaluator compares them* (`process_gt_answers`), so the
    score of class c is exactly the official accuracy of predicting c: training targets and the
    metric agree. (hengyuan-hu counts the raw strings; on the already-clean VQA v2 answers the two
    differ only for the few answers with punctuation.)
    """
    if len(gt_answers) != NUM_GT_ANSWERS:
        raise ValueError(f"soft scores need {NUM_GT_ANSWERS} GT answers, got {len(gt_answers)}")
    counts = Counter(process_gt_answers(gt_answers))
    hits = sorted((vocab.ans2idx[a], soft_score(c)) for a, c in counts.items() if a in vocab)
    dropped = tuple(sorted(a for a in counts if a not in vocab))
    return SoftTarget(tuple(i for i, _ in hits), tuple(s for _, s in hits), dropped)


def example_target(example: VQAExample, vocab: AnswerVocab) -> SoftTarget:
    """An annotated example's soft scores over the vocabulary: `soft_target` of its ten answers, or, read from
    LXMERT's list, its label's scores of the answers that are classes (LXMERT's target, computed by
    hengyuan-hu's `compute_softscore.py` from the same counts)."""
    if example.answers or example.label is None:
        return soft_target(example.answers, vocab)
    return label_target(example.label, vocab)


def write_vqa_targets(path: str | Path, examples: Iterable[VQAExample], vocab: AnswerVocab) -> int:
    """Write annotated examples as ViLBERT's target pickle (`data.vqa` docstring: hengyuan-hu's
    `compute_target`), atomically: each question's soft scores over `vocab` (`example_target`, the scores
    training uses), its classes as indices; returns the number of records."""
    rows = (({"question_id": ex.question_id, "image_id": ex.image_id}, example_target(ex, vocab)) for ex in examples)
    return write_target_pickle(path, rows)


def write_target_pickle(path: str | Path, rows: Iterable[tuple[dict, SoftTarget]]) -> int:
    """ViLBERT's target pickle (VQA's, GQA's), atomically: each (record fields, target) as the record with the
    target's `labels` (class indices) and `scores`, a protocol-2 list; returns the number of records."""
    records = [{**fields, "labels": list(t.labels), "scores": list(t.scores)} for fields, t in rows]
    # Through JSON text, as `data.vqa.write_vqa_imdb`: which equal strings are one object (pickled once, then
    # referred back to) then depends on the content alone, not on the process the examples came from.
    records = json.loads(json.dumps(records))
    with atomic_open(path, "wb", encoding=None) as f:
        pickle.dump(records, f, protocol=2)
    return len(records)


def write_answer_table(path: str | Path, vocab: AnswerVocab) -> None:
    """The answer table as ViLBERT's `trainval_ans2label.pkl` ({answer: index}), atomically."""
    with atomic_open(path, "wb", encoding=None) as f:
        pickle.dump(dict(vocab.ans2idx), f, protocol=2)


def label_target(label: Mapping[str, float], vocab: AnswerVocab) -> SoftTarget:
    """A label's scores ({answer: score}, LXMERT's form) over the vocabulary; answers that are no class are
    `dropped`."""
    hits = sorted((vocab.ans2idx[a], s) for a, s in label.items() if a in vocab and s > 0)
    dropped = tuple(sorted(a for a in label if a not in vocab))
    return SoftTarget(tuple(i for i, _ in hits), tuple(s for _, s in hits), dropped)


def soft_targets(examples: Sequence[VQAExample], vocab: AnswerVocab) -> tuple[list[SoftTarget], SoftTargetStats]:
    """`example_target` for every annotated example, with counts of what fell outside the vocabulary."""
    targets = [example_target(ex, vocab) for ex in examples]
    stats = SoftTargetStats(
        num_questions=len(targets),
        num_without_target=sum(1 for t in targets if not t.labels),
        num_dropped_answers=sum(len(t.dropped) for t in targets),
    )
    return targets, stats


def dense_targets(targets: Sequence[SoftTarget], num_answers: int) -> Tensor:
    """Stack sparse targets into the (B, A) float tensor the losses take."""
    out = torch.zeros(len(targets), num_answers)  # (B, A)
    for b, t in enumerate(targets):
        if t.labels:
            out[b, list(t.labels)] = torch.tensor(t.scores)
    return out


# --------------------------------------------------------------------------- majority baseline


def majority_answer(train_examples: Iterable[VQAExample]) -> str:
    """Most frequent normalised `multiple_choice_answer` (ties: alphabetically first). "yes" on VQA v2."""
    counts = Counter(
        normalize_answer(ex.multiple_choice_answer) for ex in train_examples if ex.multiple_choice_answer is not None
    )
    if not counts:
        raise ValueError("no annotated training questions")
    return min(counts, key=lambda a: (-counts[a], a))


def majority_baseline(train_examples: Iterable[VQAExample], eval_examples: Sequence[VQAExample]) -> VQAScores:
    """Official accuracy of always predicting the most frequent training answer."""
    answer = majority_answer(train_examples)
    return score_predictions({ex.question_id: answer for ex in eval_examples}, eval_examples)


# --------------------------------------------------------------------------- losses


def vqa_bce_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Binary cross-entropy with logits against soft scores, mean over elements times the number of answers.

    logits, targets: (B, A). The "* A" makes it a per-question sum over answers averaged over the
    batch: LXMERT ``src/tasks/vqa.py`` (``bce_loss(logit, target) * logit.size(1)``), ViLBERT
    ``vilbert/task_utils.py`` (mean * ``target.size(1)``), VL-BERT (``* label.size(1)``).
    """
    return F.binary_cross_entropy_with_logits(logits, targets, reduction="mean") * targets.size(1)


def vqa_kl_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """VisualBERT's VQA loss: KL(targets || softmax(logits)), summed over answers, averaged over the batch.

    logits, targets: (B, A). The soft-score vector is used as is, *not* normalised to sum to 1, as in
    uclanlp/visualbert (``KLDivLoss(reduction="batchmean")`` on ``log_softmax``); zero targets add 0.
    """
    return F.kl_div(F.log_softmax(logits, dim=-1), targets, reduction="batchmean")
