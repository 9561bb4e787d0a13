"""VQA v2 official evaluation: normalisation, accuracy, soft scores, vocabulary, baseline, losses, CLI.

Every expected value below is derived by hand from the rules of GT-Vision-Lab/VQA
PythonEvaluationTools/vqaEvaluation/vqaEval.py; the derivation is in the comment or the test id.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import pytest
import torch

from vlberts.cli import main
from vlberts.data.vqa import VQAExample
from vlberts.errors import VlbertsError
from vlberts.tasks.vqa import (
    AnswerVocab,
    SoftTarget,
    accuracy_processed,
    build_answer_vocab,
    dense_targets,
    evaluate_predictions,
    majority_answer,
    majority_baseline,
    normalize_answer,
    process_digit_article,
    process_gt_answers,
    process_punctuation,
    read_answer_vocab,
    read_predictions,
    score_predictions,
    soft_score,
    soft_target,
    soft_targets,
    vqa_accuracy,
    vqa_bce_loss,
    vqa_kl_loss,
    write_answer_vocab,
    write_predictions,
)

# --------------------------------------------------------------------------- normalisation

NORMALIZE_CASES = [
    # (raw prediction, normalised, why)
    ("Two", "2", "lower-case, then manualMap two->2"),
    ("a dog.", "dog", "final period stripped (not followed by a digit), article 'a' dropped"),
    ("dont", "don't", "contractions table"),
    ("don't", "don't", "apostrophe is not in the punctuation list; not a contraction key"),
    ("yes!", "yes", "'!' not next to a space -> replaced by a space, then split/join drops it"),
    ("Yes?", "yes", "'?' -> space, lower-case"),
    ("1,000", "1000", "digit,digit present -> every mark is deleted, not blanked"),
    ("3.5", "3.5", "period followed by a digit is kept"),
    (".5", ".5", "period followed by a digit is kept"),
    ("3.", "3", "typo'd look-behind: a period after a digit is still stripped"),
    ("dog.", "dog", "period not followed by a digit is stripped"),
    ("a.m.", "am", "both periods stripped"),
    ("the cat's", "cat's", "article dropped, apostrophe kept"),
    ("an apple", "apple", "article 'an'"),
    ("a lot of the things", "lot of things", "articles dropped anywhere in the answer"),
    ("the", "", "an answer made only of an article becomes empty"),
    ("black/white", "black white", "'/' inside a word -> space"),
    ("black / white", "black white", "' /' present -> '/' deleted, double space collapsed by split/join"),
    ("t-shirt", "t shirt", "'-' inside a word -> space"),
    ("t-shirt - red", "tshirt red", "one spaced '-' makes every '-' be deleted"),
    ("1,000 red-ish", "1000 redish", "a digit comma makes every mark be deleted"),
    ("red, white", "red white", "', ' present -> ',' deleted"),
    ("red,white", "red white", "',' inside a word -> space"),
    ("(yes)", "yes", "brackets blanked"),
    ('"dog"', "dog", "double quotes blanked"),
    ("one-way", "1 way", "'-' blanked first, then number words map as whole words"),
    ("None", "0", "manualMap none->0"),
    ("2:30", "2:30", "':' is not in the punctuation list"),
    ("50%", "50%", "'%' is not in the punctuation list"),
    ("Im", "im", "QUIRK: the capitalised contraction key 'Im' can never match after lower-casing"),
    ("somebody'd", "somebodyd", "QUIRK: the one reversed entry of the contractions table"),
    ("wont", "won't", "contractions table"),
    (" yes\tno \n", "yes no", "newline/tab to space, strip, split/join"),
    ("." * 33, ".", "QUIRK: re.UNICODE (32) passed as sub's count -> only 32 periods removed"),
]


@pytest.mark.parametrize("raw, expected, why", NORMALIZE_CASES, ids=[c[0] for c in NORMALIZE_CASES])
def test_normalize_answer(raw, expected, why):
    assert normalize_answer(raw) == expected, why


def test_process_punctuation_keeps_case_and_trailing_space():
    # GT answers only get this step: no lower-casing, no number words, no re-stripping.
    assert process_punctuation("red!") == "red "
    assert process_punctuation("Two.") == "Two"
    assert process_punctuation("a dog") == "a dog"


def test_process_digit_article():
    assert process_digit_article("The  THREE dogs") == "3 dogs"
    assert process_digit_article("a an the") == ""


# --------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize("n", range(11))
def test_leave_one_out_accuracy_by_match_count(n):
    # n of the 10 GT answers equal the prediction. Leaving out a matching one leaves n-1 matches,
    # leaving out a non-matching one leaves n: acc = (n*min(1,(n-1)/3) + (10-n)*min(1,n/3)) / 10.
    expected = [0.0, 0.3, 0.6, 0.9, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0][n]
    assert vqa_accuracy("yes", ["yes"] * n + ["no"] * (10 - n)) == expected


@pytest.mark.parametrize("n", range(11))
def test_soft_score_equals_official_10_choose_9_average(n):
    exact = Fraction(n * min(3, max(n - 1, 0)) + (10 - n) * min(3, n), 30)
    assert exact == Fraction([0, 3, 6, 9, 10, 10, 10, 10, 10, 10, 10][n], 10)
    assert float(exact) == soft_score(n)
    # Same value from the official float computation, whatever the order of the GT answers.
    for gts in (["yes"] * n + ["no"] * (10 - n), ["no"] * (10 - n) + ["yes"] * n):
        assert vqa_accuracy("yes", gts) == pytest.approx(soft_score(n), abs=1e-12)


def test_soft_score_table():
    assert [soft_score(c) for c in range(7)] == [0.0, 0.3, 0.6, 0.9, 1.0, 1.0, 1.0]
    with pytest.raises(ValueError):
        soft_score(-1)


def test_gt_answers_differing_only_in_punctuation():
    # Answers not all identical -> GT gets processPunctuation: "red." -> "red" (match),
    # but "red!" -> "red " with a trailing space, which no normalised prediction can equal.
    assert vqa_accuracy("red", ["red."] * 2 + ["red"] + ["blue"] * 7) == pytest.approx(0.9, abs=1e-12)  # n=3
    assert vqa_accuracy("red", ["red!"] * 2 + ["red"] + ["blue"] * 7) == pytest.approx(0.3, abs=1e-12)  # n=1
    assert vqa_accuracy("red!", ["red!"] * 2 + ["red"] + ["blue"] * 7) == pytest.approx(0.3, abs=1e-12)


def test_all_identical_gt_answers_are_not_processed():
    # Ten identical "dog." stay "dog."; the prediction always loses its period -> 0.
    assert process_gt_answers(["dog."] * 10) == ["dog."] * 10
    assert vqa_accuracy("dog.", ["dog."] * 10) == 0.0
    assert vqa_accuracy("dog", ["dog."] * 10) == 0.0
    # One different answer switches processing on: nine "dog" match.
    assert process_gt_answers(["dog."] * 9 + ["cat"]) == ["dog"] * 9 + ["cat"]
    assert vqa_accuracy("dog.", ["dog."] * 9 + ["cat"]) == 1.0


def test_gt_answers_never_get_digit_article_processing():
    # The prediction "Two" becomes "2", the GT "Two"/"two" stay as they are -> no match.
    assert vqa_accuracy("Two", ["Two"] * 10) == 0.0
    assert vqa_accuracy("two", ["two"] * 5 + ["2"] * 5) == 1.0  # matches the five "2"
    assert vqa_accuracy("Yes", ["yes"] * 10) == 1.0
    assert vqa_accuracy("dont", ["dont"] * 10) == 0.0  # prediction -> "don't"


def test_accuracy_processed_general_count():
    # ["a","b","c"], prediction "a": leaving "a" out -> 0 matches; leaving "b" or "c" -> 1 -> 1/3.
    assert accuracy_processed("a", ["a", "b", "c"]) == pytest.approx(2 / 9, abs=1e-15)
    with pytest.raises(ValueError):
        accuracy_processed("a", [])


def _ex(qid, answers, answer_type, question_type, mca=None):
    return VQAExample(
        question_id=qid,
        image_id=qid * 10,
        question=f"q{qid}?",
        answers=list(answers),
        multiple_choice_answer=mca if mca is not None else answers[0],
        answer_type=answer_type,
        question_type=question_type,
    )


def test_score_predictions_per_type_and_rounding():
    examples = [
        _ex(1, ["yes"] * 10, "yes/no", "is the"),  # "yes" -> 1.0
        _ex(2, ["2"] + ["3"] * 9, "number", "how many"),  # "2" -> n=1 -> 0.3
        _ex(3, ["red"] * 10, "other", "what color is the"),  # "blue" -> 0.0
    ]
    scores = score_predictions({1: "yes", 2: "two", 3: "blue"}, examples)
    assert scores.accuracy == 43.33  # round(100 * 1.3 / 3, 2)
    assert scores.accuracy_unrounded == pytest.approx(130 / 3, abs=1e-9)
    assert scores.per_answer_type == {"number": 30.0, "other": 0.0, "yes/no": 100.0}
    assert scores.per_question_type == {"how many": 30.0, "is the": 100.0, "what color is the": 0.0}
    assert scores.num_questions == 3


# --------------------------------------------------------------------------- vocabulary, soft scores


def test_build_answer_vocab():
    mcas = ["Yes", "yes.", "no", "two", "2", "red", "blue", "blue"]
    examples = [_ex(i, ["x"] * 10, "other", "what", mca=m) for i, m in enumerate(mcas)]
    # normalised: yes yes no 2 2 red blue blue -> counts yes 2, 2 2, blue 2, no 1, red 1
    vocab = build_answer_vocab(examples, min_count=2)
    assert vocab.answers == ("2", "blue", "yes")  # ties alphabetical
    assert vocab.ans2idx == {"2": 0, "blue": 1, "yes": 2}
    assert len(vocab) == 3 and "yes" in vocab and "no" not in vocab
    assert build_answer_vocab(examples, min_count=1).answers == ("2", "blue", "yes", "no", "red")


def test_answer_vocab_files(tmp_path):
    vocab = AnswerVocab(("yes", "no", "2"))
    write_answer_vocab(tmp_path / "v.json", vocab)
    assert json.loads((tmp_path / "v.json").read_text()) == ["yes", "no", "2"]
    assert read_answer_vocab(tmp_path / "v.json") == vocab
    (tmp_path / "ans2label.json").write_text(json.dumps({"no": 1, "yes": 0, "2": 2}))  # LXMERT style
    assert read_answer_vocab(tmp_path / "ans2label.json").answers == ("yes", "no", "2")
    (tmp_path / "bad.json").write_text(json.dumps({"no": 1, "yes": 5}))
    with pytest.raises(VlbertsError, match="bad.json"):
        read_answer_vocab(tmp_path / "bad.json")
    with pytest.raises(ValueError):
        AnswerVocab(("a", "a"))


def test_soft_target_and_dropped_answers():
    vocab = AnswerVocab(("blue", "red"))
    t = soft_target(["red"] * 3 + ["blue"] * 6 + ["green"], vocab)
    assert t == SoftTarget(labels=(0, 1), scores=(1.0, 0.9), dropped=("green",))
    # Counted as the evaluator compares: "red." -> "red" (4 in all); "Blue" is never lower-cased.
    t = soft_target(["red."] * 3 + ["red"] + ["Blue"] * 6, vocab)
    assert t == SoftTarget(labels=(1,), scores=(1.0,), dropped=("Blue",))
    with pytest.raises(ValueError):
        soft_target(["red"] * 9, vocab)


def test_soft_targets_stats_and_dense():
    vocab = AnswerVocab(("yes", "no", "2"))
    examples = [
        _ex(1, ["yes"] * 9 + ["no"], "yes/no", "is"),
        _ex(2, ["3"] * 10, "number", "how many"),
        _ex(3, ["2"] * 2 + ["4"] * 8, "number", "how many"),
    ]
    targets, stats = soft_targets(examples, vocab)
    assert targets[0] == SoftTarget((0, 1), (1.0, 0.3), ())
    assert targets[1] == SoftTarget((), (), ("3",))
    assert targets[2] == SoftTarget((2,), (0.6,), ("4",))
    assert (stats.num_questions, stats.num_without_target, stats.num_dropped_answers) == (3, 1, 2)
    dense = dense_targets(targets, len(vocab))
    assert torch.equal(dense, torch.tensor([[1.0, 0.3, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.6]]))


# --------------------------------------------------------------------------- majority baseline


def test_majority_baseline():
    train = [_ex(i, ["x"] * 10, "other", "what", mca=m) for i, m in enumerate(["yes", "Yes.", "no", "2", "yes"])]
    assert majority_answer(train) == "yes"  # normalised: yes yes no 2 yes
    evals = [
        _ex(10, ["yes"] * 10, "yes/no", "is"),  # 1.0
        _ex(11, ["yes"] * 2 + ["no"] * 8, "yes/no", "is"),  # n=2 -> 0.6
        _ex(12, ["2"] * 10, "number", "how many"),  # 0.0
    ]
    scores = majority_baseline(train, evals)
    assert scores.accuracy == 53.33  # round(100 * 1.6 / 3, 2)
    assert scores.per_answer_type == {"number": 0.0, "yes/no": 80.0}
    tie = [_ex(i, ["x"] * 10, "other", "what", mca=m) for i, m in enumerate(["yes", "no", "no", "yes"])]
    assert majority_answer(tie) == "no"  # tie broken alphabetically


# --------------------------------------------------------------------------- losses


def test_vqa_bce_loss():
    logits = torch.zeros(1, 2)
    targets = torch.tensor([[1.0, 0.0]])
    # each element: -log(sigmoid(0)) = log 2; mean = log 2; times A=2
    assert vqa_bce_loss(logits, targets).item() == pytest.approx(2 * math.log(2), rel=1e-6)


def test_vqa_kl_loss():
    logits = torch.zeros(2, 2)  # log_softmax = -log 2 everywhere
    targets = torch.tensor([[1.0, 0.0], [0.3, 0.6]])  # unnormalised soft scores, used as is
    # row 1: 1*(log 1 + log 2) + 0 = log 2; row 2: 0.3*(log .3 + log 2) + 0.6*(log .6 + log 2)
    row2 = 0.3 * math.log(0.6) + 0.6 * math.log(1.2)
    expected = (math.log(2) + row2) / 2  # batchmean: sum / B
    assert vqa_kl_loss(logits, targets).item() == pytest.approx(expected, rel=1e-6)


# --------------------------------------------------------------------------- prediction files


def test_write_and_read_predictions(tmp_path):
    path = tmp_path / "preds.json"
    assert write_predictions(path, [(2, "no"), (1, "yes")]) == 2
    assert json.loads(path.read_text()) == [{"question_id": 2, "answer": "no"}, {"question_id": 1, "answer": "yes"}]
    assert read_predictions(path, [1, 2]) == {1: "yes", 2: "no"}
    assert not list(tmp_path.glob(".*.tmp"))
    with pytest.raises(VlbertsError, match="question_id 1: duplicate"):
        write_predictions(tmp_path / "dup.json", [(1, "yes"), (1, "no")])
    assert not (tmp_path / "dup.json").exists()


# --------------------------------------------------------------------------- the evaluate command

QUESTIONS = [
    {"image_id": 10, "question": "Is it red?", "question_id": 1},
    {"image_id": 10, "question": "How many dogs?", "question_id": 2},
    {"image_id": 11, "question": "What color is the car?", "question_id": 3},
    {"image_id": 11, "question": "What is on the table?", "question_id": 4},
]


def _answers(strings):
    return [{"answer": a, "answer_confidence": "yes", "answer_id": i + 1} for i, a in enumerate(strings)]


ANNOTATIONS = [
    {"question_type": "is it", "multiple_choice_answer": "yes", "answers": _answers(["yes"] * 10),
     "image_id": 10, "answer_type": "yes/no", "question_id": 1},
    {"question_type": "how many", "multiple_choice_answer": "3", "answers": _answers(["2"] * 2 + ["3"] * 8),
     "image_id": 10, "answer_type": "number", "question_id": 2},
    {"question_type": "what color is the", "multiple_choice_answer": "blue",
     "answers": _answers(["red."] * 3 + ["red"] + ["blue"] * 6), "image_id": 11, "answer_type": "other", "question_id": 3},
    {"question_type": "what is on the", "multiple_choice_answer": "cup", "answers": _answers(["cup"] * 10),
     "image_id": 11, "answer_type": "other", "question_id": 4},
]  # fmt: skip

PREDICTIONS = [
    {"question_id": 1, "answer": "Yes"},  # "yes", 10 matches -> 1.0
    {"question_id": 2, "answer": "two"},  # "2", 2 matches -> 0.6
    {"question_id": 3, "answer": "Red."},  # "red"; GT "red." processed -> 4 matches -> 1.0
    {"question_id": 4, "answer": "a mug"},  # "mug" -> 0.0
]

EXPECTED_METRICS = {
    "accuracy": 65.0,  # 100 * (1 + 0.6 + 1 + 0) / 4
    "per_answer_type": {"number": 60.0, "other": 50.0, "yes/no": 100.0},
    "per_question_type": {"how many": 60.0, "is it": 100.0, "what color is the": 100.0, "what is on the": 0.0},
    "num_questions": 4,
}


def _write_vqa_files(tmp_path, questions=QUESTIONS, annotations=ANNOTATIONS, predictions=PREDICTIONS):
    files = {}
    for name, obj in [
        ("questions.json", {"questions": questions, "info": {}, "license": {}}),
        ("annotations.json", {"annotations": annotations, "info": {}}),
        ("preds.json", predictions),
    ]:
        (tmp_path / name).write_text(json.dumps(obj))
        files[name] = tmp_path / name
    return files


def _run_cli(tmp_path, out):
    argv = [
        "evaluate", "vqa",
        "--predictions", str(tmp_path / "preds.json"),
        "--questions", str(tmp_path / "questions.json"),
        "--annotations", str(tmp_path / "annotations.json"),
        "--out", str(out),
    ]  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return exc.value.code


def test_evaluate_predictions_function(tmp_path):
    f = _write_vqa_files(tmp_path)
    metrics = evaluate_predictions(f["preds.json"], f["questions.json"], f["annotations.json"])
    assert metrics["accuracy_unrounded"] == pytest.approx(65.0, abs=1e-9)
    assert {k: v for k, v in metrics.items() if k != "accuracy_unrounded"} == EXPECTED_METRICS


def test_cli_evaluate_vqa(tmp_path, capsys):
    _write_vqa_files(tmp_path)
    out = tmp_path / "eval"
    assert _run_cli(tmp_path, out) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics.pop("accuracy_unrounded") == pytest.approx(65.0, abs=1e-9)
    assert metrics == EXPECTED_METRICS
    stdout = capsys.readouterr().out
    assert "VQA accuracy 65.00% on 4 questions (number 60.00, other 50.00, yes/no 100.00)" in stdout
    assert not list(out.glob(".*.tmp"))


def _drop(key):
    def edit(rec):
        del rec[key]

    return edit


def _set(key, value):
    def edit(rec):
        rec[key] = value

    return edit


# (id, which file to break, how, the file the error must name, the rest of the one-line error)
BAD_INPUTS = [
    ("preds-missing-file", "preds.json", "delete", "preds.json", "file not found"),
    ("preds-malformed", "preds.json", "text:[{", "preds.json", "malformed JSON"),
    ("preds-not-list", "preds.json", "json:" + json.dumps({"question_id": 1, "answer": "yes"}), "preds.json", "expected a JSON list"),
    ("preds-missing-answer", "preds.json", ("pred", 1, _drop("answer")), "preds.json", "record predictions[1]: missing field(s) answer"),
    ("preds-qid-not-int", "preds.json", ("pred", 0, _set("question_id", "1")), "preds.json", "record predictions[0]: question_id must be an integer"),
    ("preds-unknown-qid", "preds.json", ("pred", 3, _set("question_id", 99)), "preds.json", "record question_id 99: not a question"),
    ("preds-duplicate", "preds.json", ("pred", 3, _set("question_id", 2)), "preds.json", "record question_id 2: duplicate prediction"),
    ("preds-missing-question", "preds.json", ("pred-del", 3), "preds.json", "record question_id 4: no prediction"),
    ("preds-answer-not-str", "preds.json", ("pred", 0, _set("answer", 2)), "preds.json", "record question_id 1: answer must be a string"),
    ("questions-malformed", "questions.json", "text:{\"questions\": [", "questions.json", "malformed JSON"),
    ("questions-not-vqa", "questions.json", "json:[]", "questions.json", "a JSON list (LXMERT's questions; VQA v2's are an object) holds its questions' answers, so it takes no annotations file (annotations.json given)"),
    ("questions-not-an-object", "questions.json", "json:3", "questions.json", "expected a JSON object with a 'questions' list"),
    ("question-missing-field", "questions.json", ("q", 2, _drop("question")), "questions.json", "record questions[2]: missing field(s) question"),
    ("question-duplicate-id", "questions.json", ("q", 1, _set("question_id", 1)), "questions.json", "record questions[1]: duplicate question_id 1"),
    ("annotation-without-question", "questions.json", ("q", 3, _set("question_id", 5)), "annotations.json", "record annotations[3]: question_id 4 has no question"),
    ("annotations-not-vqa", "annotations.json", "json:{\"anns\": []}", "annotations.json", "expected a JSON object with a 'annotations' list"),
    ("annotation-nine-answers", "annotations.json", ("a", 1, lambda r: r["answers"].pop()), "annotations.json", "record annotations[1]: answers must be a list of 10"),
    ("annotation-answer-missing", "annotations.json", ("a", 0, lambda r: r["answers"][3].pop("answer")), "annotations.json", "record annotations[0].answers[3]: missing field(s) answer"),
    ("annotation-missing-field", "annotations.json", ("a", 2, _drop("answer_type")), "annotations.json", "record annotations[2]: missing field(s) answer_type"),
    ("annotation-image-mismatch", "annotations.json", ("a", 2, _set("image_id", 12)), "annotations.json", "record annotations[2]: image_id 12 differs"),
    ("annotation-duplicate", "annotations.json", ("a", 3, _set("question_id", 3)), "annotations.json", "record annotations[3]: duplicate annotation for question_id 3"),
    ("question-not-annotated", "annotations.json", ("a-del", 3), "questions.json", "record questions[3]: question_id 4 has no annotation"),
]  # fmt: skip


def _break(tmp_path, filename, how):
    questions = json.loads(json.dumps(QUESTIONS))
    annotations = json.loads(json.dumps(ANNOTATIONS))
    predictions = json.loads(json.dumps(PREDICTIONS))
    if isinstance(how, tuple):
        kind, index = how[0], how[1]
        target = {"pred": predictions, "q": questions, "a": annotations}
        if kind.endswith("-del"):
            del target[kind[:-4]][index]
        else:
            how[2](target[kind][index])
    _write_vqa_files(tmp_path, questions, annotations, predictions)
    if how == "delete":
        (tmp_path / filename).unlink()
    elif isinstance(how, str) and how.startswith("text:"):
        (tmp_path / filename).write_text(how[5:])
    elif isinstance(how, str) and how.startswith("json:"):
        (tmp_path / filename).write_text(how[5:])


@pytest.mark.parametrize("filename, how, named, message", [c[1:] for c in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_cli_evaluate_vqa_bad_input(tmp_path, capsys, filename, how, named, message):
    _break(tmp_path, filename, how)
    out = tmp_path / "eval"
    assert _run_cli(tmp_path, out) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert f"{tmp_path / named}: {message}" in err, err
    assert not (out / "metrics.json").exists()
