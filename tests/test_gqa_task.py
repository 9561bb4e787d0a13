"""GQA end to end on the tiny world: the world's balanced questions files read back through the real-format
reader, `finetune gqa` (VisualBERT and LXMERT heads, the shared QA fine-tuning) writes metrics with the
majority baseline and an official predictions file that `evaluate gqa` scores the same, resume is exact,
and bad prediction files are one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlberts.cli import main
from vlberts.data.gqa import read_gqa
from vlberts.features.store import RegionStore
from vlberts.recipes.finetune_gqa import FinetuneGQAConfig, finetune_gqa, load_gqa_model
from vlberts.recipes.finetune_qa import predict_qa
from vlberts.recipes.pretrain import PretrainConfig, pretrain
from vlberts.tasks.gqa import build_answer_vocab, gqa_target, normalize_gqa_answer
from vlberts.training.metrics import MetricsLog
from vlberts.world.vocab import SHAPES

MAX_REGIONS = 12
TYPES = {"exist": ("verify", "obj"), "queryAttr": ("query", "attr"), "relS": ("query", "rel"),
         "relVerify": ("verify", "rel"), "chooseAttr": ("choose", "attr")}


def gqa_file(world, split: str) -> Path:
    return world.root / "gqa" / f"{split}_balanced_questions.json"


def gqa_cfg(world, init: Path, out: Path, **kw) -> FinetuneGQAConfig:
    base = dict(
        init=str(init), out=str(out), features=str(world.store), train_questions=str(gqa_file(world, "train")),
        eval_questions=str(gqa_file(world, "testdev")), epochs=0.5, batch_size=16, lr=1e-3, log_every=1,
        ckpt_every=2, max_regions=MAX_REGIONS, device="cpu",
    )
    base.update(kw)
    return FinetuneGQAConfig(**base)


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_world_gqa_files_follow_the_image_split_and_the_format(tiny_world):
    scenes = {}
    for line in (tiny_world.root / "scenes.jsonl").read_text().splitlines():
        rec = json.loads(line)
        scenes[str(rec["image_id"])] = rec
    for world_split, gqa_split in (("train", "train"), ("val", "val"), ("test", "testdev")):
        images = set((tiny_world.entities / f"{world_split}.txt").read_text().split())
        raw = json.loads(gqa_file(tiny_world, gqa_split).read_text())
        examples = read_gqa(gqa_file(tiny_world, gqa_split), require_answers=True)
        assert examples and {ex.image_id for ex in examples} == images
        for ex in examples:
            rec = raw[ex.question_id]
            assert ex.question_id.isdigit() and ex.is_balanced and ex.full_answer
            assert (ex.structural_type, ex.semantic_type) == TYPES[ex.detailed_type]
            assert not ex.question.lower().startswith("how many")  # GQA asks no counting questions
            assert set(rec) >= {"types", "groups", "annotations"} and rec["groups"]["global"] is None
            if ex.structural_type == "verify":
                assert ex.answer in ("yes", "no") and ex.full_answer.startswith(ex.answer.capitalize())
            if ex.structural_type == "choose":  # "Is the X red or blue?": the answer is one of the two
                assert ex.answer in ex.question.rstrip("?").split()[-3::2]
            # annotations point at the objects' nouns, and the objects are the scene's
            words = ex.question.rstrip("?").lower().split()
            objects = {o["object_id"]: o for o in scenes[ex.image_id]["objects"]}
            for index, obj in rec["annotations"]["question"].items():
                assert words[int(index)] in (*SHAPES, "object", "shape")
                assert int(obj) // 100 == int(ex.image_id) and int(obj) % 100 in objects
    world = json.loads((tiny_world.root / "world.json").read_text())
    assert world["counts"]["gqa_questions"] == sum(
        len(read_gqa(gqa_file(tiny_world, s))) for s in ("train", "val", "testdev"))


def test_gqa_targets_are_one_hot_on_the_exact_answer(tiny_world):
    train = read_gqa(gqa_file(tiny_world, "train"), require_answers=True)
    vocab = build_answer_vocab(train, 1)
    assert set(vocab.answers) == {normalize_gqa_answer(ex.answer) for ex in train}
    target = gqa_target(train[0], vocab)
    assert target.scores == (1.0,) and vocab.answers[target.labels[0]] == train[0].answer
    rare = build_answer_vocab(train, 10_000)
    assert not len(rare) and gqa_target(train[0], rare).dropped == (train[0].answer,)



def test_gqa_answer_classes_by_hand():
    """Answers given by at least `min_count` questions, most frequent first, ties alphabetical; answers are
    normalised as GQA's evaluation compares them before they are counted."""
    from vlberts.data.gqa import GQAExample

    answers = ["yes", "no", "Yes", "left", "left", "red", "no", "yes"]  # yes 3, no 2, left 2, red 1
    train = [GQAExample(str(i), "1", "q?", answer=a) for i, a in enumerate(answers)]
    assert normalize_gqa_answer("Yes") == "yes"
    assert build_answer_vocab(train, 1).answers == ("yes", "left", "no", "red")
    assert build_answer_vocab(train, 2).answers == ("yes", "left", "no")  # exactly 2 is enough
    assert build_answer_vocab(train, 3).answers == ("yes",)


@pytest.fixture(scope="module")
def lxmert_pretrained(tiny_world, tmp_path_factory) -> Path:
    return pretrain(PretrainConfig(
        captions=str(tiny_world.captions_train), features=str(tiny_world.store),
        out=str(tmp_path_factory.mktemp("gqa_lxmert_pt") / "run"), model="lxmert-tiny", vocab_size=200, steps=2,
        batch_size=8, ckpt_every=100, max_regions=MAX_REGIONS,
    ))


@pytest.mark.parametrize("arch", ["visualbert", "lxmert"])
def test_finetune_gqa_metrics_predictions_and_evaluate(tiny_world, tiny_pretrained, lxmert_pretrained, tmp_path,
                                                       capsys, arch):
    init = tiny_pretrained if arch == "visualbert" else lxmert_pretrained
    out = tmp_path / "gqa"
    train_q, test_q = gqa_file(tiny_world, "train"), gqa_file(tiny_world, "testdev")
    args = [f"--{k}={v}" for k, v in vars(gqa_cfg(tiny_world, init, out)).items() if k in (
        "init", "out", "features", "train_questions", "eval_questions", "epochs", "batch_size", "lr", "max_regions",
        "device")]
    code, stdout, _ = run_cli(["finetune", "gqa", *args], capsys)
    assert code == 0 and "GQA accuracy" in stdout and "majority-answer baseline" in stdout

    metrics = json.loads((out / "metrics.json").read_text())
    test = read_gqa(test_q, require_answers=True)
    assert metrics["num_questions"] == len(test) and 0 <= metrics["accuracy"] <= 100
    assert 0 < metrics["majority_baseline"] <= 100 and metrics["majority_answer"] in ("yes", "no")
    assert set(metrics["per_structural_type"]) <= {"verify", "query", "choose"}
    assert metrics["eval_questions_without_target"] >= 0 and metrics["num_answers"] >= 10
    preds = json.loads((out / "predictions.json").read_text())
    assert [p["questionId"] for p in preds] == [ex.question_id for ex in test] and set(preds[0]) == {
        "questionId", "prediction"}
    meta = json.loads((out / "model" / "config.json").read_text())
    assert meta["task"] == "gqa" and meta["arch"] == arch

    # `vlberts evaluate gqa` scores the official file as the recipe did, baseline included.
    code, stdout, _ = run_cli(["evaluate", "gqa", "--predictions", str(out / "predictions.json"), "--questions",
                               str(test_q), "--train_questions", str(train_q), "--out", str(tmp_path / "eval")], capsys)
    assert code == 0 and "GQA accuracy" in stdout
    scored = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert {k: scored[k] for k in ("accuracy", "majority_baseline", "num_correct")} == {
        k: metrics[k] for k in ("accuracy", "majority_baseline", "num_correct")}

    # The model directory reloads and predicts the same answers.
    model, vocab, tok = load_gqa_model(out / "model")
    again = predict_qa(model, vocab, tok, test, RegionStore(tiny_world.store), max_regions=MAX_REGIONS, device="cpu")
    assert again == {p["questionId"]: p["prediction"] for p in preds}


def test_finetune_gqa_resume_equals_uninterrupted(tiny_world, tiny_pretrained, tmp_path):
    finetune_gqa(gqa_cfg(tiny_world, tiny_pretrained, tmp_path / "ref"))
    assert finetune_gqa(gqa_cfg(tiny_world, tiny_pretrained, tmp_path / "run", stop_after=3)) is None
    finetune_gqa(gqa_cfg(tiny_world, tiny_pretrained, tmp_path / "run"))
    a, b = MetricsLog.read(tmp_path / "ref" / "metrics.jsonl"), MetricsLog.read(tmp_path / "run" / "metrics.jsonl")
    assert len(a) >= 4 and [r["loss"] for r in a] == [r["loss"] for r in b]
    assert (tmp_path / "ref" / "predictions.json").read_text() == (tmp_path / "run" / "predictions.json").read_text()
    assert json.loads((tmp_path / "ref" / "metrics.json").read_text()) == \
        json.loads((tmp_path / "run" / "metrics.json").read_text())


def test_evaluate_gqa_scores_exact_match_after_normalisation(tiny_world, tmp_path, capsys):
    """Gold answers written in another case/spacing count; one wrong answer costs exactly one question."""
    test_q = gqa_file(tiny_world, "testdev")
    test = read_gqa(test_q, require_answers=True)
    preds = [{"questionId": ex.question_id, "prediction": f" {ex.answer.upper()} "} for ex in test]
    preds[0]["prediction"] = "no" if test[0].answer == "yes" else "yes"
    (tmp_path / "p.json").write_text(json.dumps(preds))
    code, _, _ = run_cli(["evaluate", "gqa", "--predictions", str(tmp_path / "p.json"), "--questions", str(test_q),
                          "--out", str(tmp_path / "eval")], capsys)
    metrics = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert code == 0 and metrics["num_correct"] == len(test) - 1 and "majority_baseline" not in metrics
    assert metrics["accuracy"] == pytest.approx(100 * (len(test) - 1) / len(test)) and metrics["answers_normalized"]
    # --no-normalize: the official eval.py's comparison of the strings as they are, so none of these counts
    code, _, _ = run_cli(["evaluate", "gqa", "--predictions", str(tmp_path / "p.json"), "--questions", str(test_q),
                          "--out", str(tmp_path / "raw"), "--no-normalize"], capsys)
    raw = json.loads((tmp_path / "raw" / "metrics.json").read_text())
    assert code == 0 and raw["num_correct"] == 0 and raw["answers_normalized"] is False


def test_evaluate_gqa_bad_predictions_exit_2_with_one_line(tiny_world, tmp_path, capsys):
    test_q = gqa_file(tiny_world, "testdev")
    test = read_gqa(test_q, require_answers=True)
    good = [{"questionId": ex.question_id, "prediction": ex.answer} for ex in test]
    cases = {
        "missing.json": (None, "file not found"),
        "malformed.json": ('[{"questionId": "1",', "malformed JSON"),
        "unknown.json": (json.dumps(good + [{"questionId": "999999999", "prediction": "yes"}]),
                         "question 999999999: not a question of the evaluated set"),
        "incomplete.json": (json.dumps(good[1:]), f"question {test[0].question_id}: no prediction for this example"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        code, _, err = run_cli(["evaluate", "gqa", "--predictions", str(path), "--questions", str(test_q),
                                "--out", str(tmp_path / "eval")], capsys)
        assert code == 2, (name, err)
        assert err.count("\n") == 1 and str(path) in err and message in err, (name, err)
    assert not (tmp_path / "eval").exists()
