"""`vlberts predict nlvr2|vcr`: plain inference with fine-tuned models on files without labels (NLVR2's hidden
test2, VCR's test), in the official formats. NLVR2's predictions equal the fine-tuning run's line for line.
VCR's leaderboard CSV holds the Q->A model's scores and the QA->R model's scores conditioned on each of the
4 answers: the column of the gold answer equals the QA->R run's own predictions, the others differ (the
answer really is the context), and `evaluate vcr --submission` scores it as the two predictions files are
scored. Hand-made submissions check that scoring reads the gold answer's rationales; bad input is one line."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_nlvr2_task import nlvr2_cfg, nlvr2_file, run_cli
from test_vcr_task import _fixture as vcr_fixture
from test_vcr_task import vcr_cfg

from vlberts.data.vcr import read_vcr, render_tokens
from vlberts.errors import VlbertsError
from vlberts.models.nlvr2 import predict_labels
from vlberts.recipes import finetune_nlvr2 as finetune_nlvr2_recipe
from vlberts.recipes.finetune_nlvr2 import finetune_nlvr2
from vlberts.recipes.finetune_vcr import evaluate_vcr, evaluate_vcr_submission, finetune_vcr
from vlberts.recipes.predict_nlvr2 import PredictNLVR2Config
from vlberts.recipes.predict_nlvr2 import predict_file as predict_nlvr2_file
from vlberts.recipes import predict_vcr as predict_vcr_recipe
from vlberts.recipes.predict_vcr import PredictVCRConfig
from vlberts.recipes.predict_vcr import predict_file as predict_vcr_file
from vlberts.text.tokenizer import TextTokenizer
from vlberts.tasks.vcr import SUBMISSION_COLUMNS, SubmissionRow, read_submission, write_submission
from vlberts.training.distributed import free_port

VLBERTS = Path(sys.executable).with_name("vlberts")

# --------------------------------------------------------------------------- NLVR2


def _recording_logits(mp: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Record the classifier's logits of every prediction batch (a tiny model labels every statement alike,
    so the labels alone would not show that prediction lays out its inputs as the fine-tuning run did)."""
    seen: list[torch.Tensor] = []

    def labels(model, batch):
        seen.append(model(batch).detach().float().clone())
        return predict_labels(model, batch)

    mp.setattr(finetune_nlvr2_recipe, "predict_labels", labels)
    return seen


@pytest.fixture(scope="module")
def nlvr2_run(tiny_world, tiny_pretrained, tmp_path_factory) -> tuple[Path, torch.Tensor]:
    out = tmp_path_factory.mktemp("nlvr2") / "run"
    with pytest.MonkeyPatch.context() as mp:
        seen = _recording_logits(mp)
        finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, out, encoding="pair", max_regions=10, max_text_len=24))
    return out, torch.cat(seen)


def test_nlvr2_predictions_equal_the_fine_tuning_runs_without_labels(tiny_world, nlvr2_run, tmp_path, capsys,
                                                                     monkeypatch):
    run, run_logits = nlvr2_run
    # the statements with their labels removed, as NLVR2's hidden test2 is released
    lines = [json.loads(x) for x in nlvr2_file(tiny_world, "test1").read_text().splitlines() if x.strip()]
    hidden = tmp_path / "test2.json"
    hidden.write_text("".join(json.dumps({k: v for k, v in rec.items() if k != "label"}) + "\n" for rec in lines))
    seen = _recording_logits(monkeypatch)
    code, stdout, _ = run_cli(["predict", "nlvr2", f"--model={run / 'model'}", f"--statements={hidden}",
                               f"--features={tiny_world.store}", f"--image_map={tiny_world.root / 'nlvr2' / 'images.json'}",
                               f"--out={tmp_path / 'p'}", "--device=cpu"], capsys)
    assert code == 0 and "predictions.csv" in stdout
    ours = (tmp_path / "p" / "predictions.csv").read_text()
    assert ours == (run / "predictions.csv").read_text() and len(ours.splitlines()) == len(lines)
    logits = torch.cat(seen)
    assert logits.shape == run_logits.shape == (len(lines), 2) and torch.allclose(logits, run_logits, atol=1e-5)
    assert (logits - logits.mean(0)).abs().max() > 1e-3  # the statements and images do reach the classifier
    summary = json.loads((tmp_path / "p" / "predict.json").read_text())
    assert (summary["encoding"], summary["max_regions"], summary["max_text_len"]) == ("pair", 10, 24)
    assert summary["predicted"] == len(lines)
    # the official scorer on the labelled file gives the fine-tuning run's accuracy
    code, stdout, _ = run_cli(["evaluate", "nlvr2", "--predictions", str(tmp_path / "p" / "predictions.csv"),
                               "--statements", str(nlvr2_file(tiny_world, "test1"))], capsys)
    assert code == 0 and json.loads(stdout)["accuracy"] == json.loads((run / "metrics.json").read_text())["accuracy"]


def test_nlvr2_bad_input_is_one_line_or_counted(tiny_world, nlvr2_run, tiny_pretrained, tmp_path, capsys):
    statements = nlvr2_file(tiny_world, "test1")
    base = dict(model=str(nlvr2_run[0] / "model"), statements=str(statements), features=str(tiny_world.store),
                image_map=str(tiny_world.root / "nlvr2" / "images.json"), out=str(tmp_path / "p"), device="cpu")
    with pytest.raises(VlbertsError, match="NLVR2"):  # a pre-trained (not NLVR2 fine-tuned) model
        predict_nlvr2_file(PredictNLVR2Config(**{**base, "model": str(tiny_pretrained)}))
    lines = statements.read_text().splitlines()
    # a statement about images the image map does not have (NLVR2 names them after the identifier), and a
    # line cut off mid-record
    unknown = dict(json.loads(lines[1]), identifier="test1-999-0-0")
    broken = tmp_path / "s.json"
    broken.write_text("\n".join([*lines[3:], json.dumps(unknown), lines[0][: len(lines[0]) // 2]]) + "\n")
    code, _, err = run_cli(["predict", "nlvr2", *(f"--{k}={v}" for k, v in {**base, "statements": broken}.items())],
                           capsys)
    assert code == 2 and str(broken) in err and f"line {len(lines) - 1}" in err and len(err.strip().splitlines()) == 1
    predict_nlvr2_file(PredictNLVR2Config(**{**base, "statements": str(broken), "skip_bad": True}))
    summary = json.loads((tmp_path / "p" / "predict.json").read_text())
    assert summary["skipped_records"]["total"] == 2 and summary["skipped_records"]["missing image"] == 1
    assert summary["predicted"] == len(lines) - 3
    code, _, err = run_cli(["predict", "nlvr2", f"--statements={statements}"], capsys)
    assert code == 2 and "needs --model" in err
    (tmp_path / "empty.json").write_text("\n")
    with pytest.raises(VlbertsError, match="no statement to label"):
        predict_nlvr2_file(PredictNLVR2Config(**{**base, "statements": str(tmp_path / "empty.json")}))


# --------------------------------------------------------------------------- VCR


@pytest.fixture(scope="module")
def vcr_runs(tiny_world, tiny_pretrained, tmp_path_factory) -> tuple[Path, Path]:
    """A Q->A and a QA->R model fitted to 8 training questions (a short run on all of them leaves a tiny model's
    scorer near 1/4 for every choice, too flat to tell one context from another)."""
    root = tmp_path_factory.mktemp("vcr")
    few = root / "vcr" / "train.jsonl"
    few.parent.mkdir()
    few.write_text("".join((tiny_world.root / "vcr" / "train.jsonl").read_text().splitlines(True)[:8]))
    (root / "vcr" / "metadata").symlink_to(tiny_world.root / "vcr" / "metadata")
    qa, qar = root / "qa", root / "qar"
    fit = dict(train_file=str(few), eval_file=str(few), epochs=25, lr=3e-3, head_lr_mult=10, warmup=0.0, max_text_len=48)
    finetune_vcr(vcr_cfg(tiny_world, tiny_pretrained, qa, mode="qa", **fit))
    finetune_vcr(vcr_cfg(tiny_world, tiny_pretrained, qar, mode="qar", **fit))
    return qa, qar


def _vcr_config(world, runs: tuple[Path, Path], out: Path, **kw) -> PredictVCRConfig:
    qa, qar = runs
    return PredictVCRConfig(**{**dict(qa_model=str(qa / "model"), qar_model=str(qar / "model"),
                                      questions=str(world.root / "vcr" / "val.jsonl"), features=str(world.store),
                                      out=str(out), device="cpu"), **kw})


def test_vcr_submission_holds_both_runs_predictions_and_scores_the_same(tiny_world, vcr_runs, tmp_path, capsys):
    val_file = vcr_runs[0].parent / "vcr" / "train.jsonl"  # the 8 questions the runs fitted and predicted
    val = read_vcr(val_file)
    path = predict_vcr_file(_vcr_config(tiny_world, vcr_runs, tmp_path / "p", questions=str(val_file)))
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    assert tuple(header) == SUBMISSION_COLUMNS and len(header) == 21
    rows = read_submission(path, [ex.annot_id for ex in val])
    qa = json.loads((vcr_runs[0] / "predictions.json").read_text())
    qar = json.loads((vcr_runs[1] / "predictions.json").read_text())
    for ex in val:
        row = rows[ex.annot_id]
        assert row.answers == pytest.approx(qa[ex.annot_id], abs=1e-6)
        # conditioned on the gold answer: what the QA->R run itself predicted
        assert row.rationales[ex.answer_label] == pytest.approx(qar[ex.annot_id], abs=1e-6)
        assert all(sum(r) == pytest.approx(1.0, abs=1e-5) for r in row.rationales)
    spread = max(abs(a - b) for r in rows.values() for a, b in zip(r.answers, r.answers[1:]))
    assert spread > 1e-3  # a scorer that tells the choices apart (1e-6 above means something)
    by_files = evaluate_vcr(val_file, vcr_runs[0] / "predictions.json", vcr_runs[1] / "predictions.json")
    code, stdout, _ = run_cli(["evaluate", "vcr", f"--annotations={val_file}", f"--submission={path}"], capsys)
    assert code == 0 and json.loads(stdout) == by_files
    assert json.loads((tmp_path / "p" / "predict.json").read_text())["predicted"] == len(val)


@pytest.mark.skipif(not VLBERTS.with_name("torchrun").exists(), reason="torchrun not installed")
def test_vcr_submission_of_two_processes_equals_one_processs(tiny_world, vcr_runs, tmp_path):
    # Under torchrun each rank scores every second question (5 passes: Q->A and QA->R per answer), rank 0
    # writes the merged CSV.
    qa, qar = vcr_runs
    args = ["predict", "vcr", f"--qa_model={qa / 'model'}", f"--qar_model={qar / 'model'}",
            f"--questions={tiny_world.root / 'vcr' / 'val.jsonl'}", f"--features={tiny_world.store}", "--device=cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([str(VLBERTS), *args, f"--out={tmp_path / 'one'}"], capture_output=True, text=True, env=env)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([str(VLBERTS.with_name("torchrun")), "--nproc_per_node=2", f"--master_port={free_port()}",
                          str(VLBERTS), *args, f"--out={tmp_path / 'two'}"], capture_output=True, text=True, env=env,
                         timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    ids = [ex.annot_id for ex in read_vcr(tiny_world.root / "vcr" / "val.jsonl")]
    rows1, rows2 = (read_submission(d / "submission.csv", ids) for d in (tmp_path / "one", tmp_path / "two"))
    assert rows1.keys() == rows2.keys() and len(rows1) == len(ids) > 2
    for k, row in rows1.items():
        assert rows2[k].answers == pytest.approx(row.answers, abs=1e-5)
        for got, want in zip(rows2[k].rationales, row.rationales, strict=True):
            assert got == pytest.approx(want, abs=1e-5)
    assert json.loads((tmp_path / "two" / "predict.json").read_text())["ranks"] == 2


def test_vcr_rationale_column_k_is_scored_with_answer_k_as_the_context(tiny_world, vcr_runs, tmp_path, monkeypatch):
    """Each QA->R pass sees every question with answer k in its context, and its scores land in the columns
    rationale_conditioned_on_a{k}_*: a stand-in scorer that puts 0.7 on the index of the answer it was given
    shows where each pass went."""
    real = predict_vcr_recipe.predict_vcr
    contexts: dict[int, list[int]] = {}

    def stand_in(model, data, **kw):
        if data.mode == "qa":
            return real(model, data, **kw)
        k = data.examples[0].answer_label
        assert all(ex.answer_label == k for ex in data.examples)
        ids = list(data.choices[0][0][0])  # question 0, choice 0: [CLS] question answer_k [SEP] rationale_0 [SEP]
        contexts[k] = ids[: ids.index(data.tok.sep_id)]
        return {ex.annot_id: [0.7 if j == k else 0.1 for j in range(4)] for ex in data.examples}

    monkeypatch.setattr(predict_vcr_recipe, "predict_vcr", stand_in)
    val = read_vcr(tiny_world.root / "vcr" / "val.jsonl")
    rows = read_submission(predict_vcr_file(_vcr_config(tiny_world, vcr_runs, tmp_path / "p")))
    assert all(rows[ex.annot_id].rationales[k][k] == 0.7 and sum(rows[ex.annot_id].rationales[k]) == pytest.approx(1.0)
               for ex in val for k in range(4))
    # question 0's context in pass k ends with answer k's subwords
    tok = TextTokenizer.load(vcr_runs[1] / "model")
    ends = [tok.encode(render_tokens(a, val[0].objects).text) for a in val[0].answer_choices]
    assert sorted(contexts) == [0, 1, 2, 3] and len({tuple(c) for c in contexts.values()}) == len(set(map(tuple, ends))) > 1
    assert all(contexts[k][-len(ends[k]):] == ends[k] for k in range(4)), (contexts, ends)


def test_vcr_unlabelled_test_file_gets_a_row_per_question(tiny_world, vcr_runs, tmp_path, capsys):
    test_file = tiny_world.root / "vcr" / "test.jsonl"
    test = read_vcr(test_file)
    assert test and all(ex.answer_label is None for ex in test)
    code, stdout, _ = run_cli(["predict", "vcr", f"--qa_model={vcr_runs[0] / 'model'}",
                               f"--qar_model={vcr_runs[1] / 'model'}", f"--questions={test_file}",
                               f"--features={tiny_world.store}", f"--out={tmp_path / 't'}", "--device=cpu"], capsys)
    assert code == 0 and "submission.csv" in stdout
    rows = read_submission(tmp_path / "t" / "submission.csv", [ex.annot_id for ex in test])
    assert len(rows) == len(test)
    code, _, err = run_cli(["evaluate", "vcr", f"--annotations={test_file}",
                            f"--submission={tmp_path / 't' / 'submission.csv'}"], capsys)
    assert code == 2 and "answer_label" in err  # an unlabelled file cannot be scored


def test_vcr_models_of_the_wrong_mode_and_bad_records(tiny_world, vcr_runs, tmp_path, capsys):
    qa, qar = vcr_runs
    with pytest.raises(VlbertsError, match="--qar_model must be a `vlberts finetune vcr --mode=qar` model"):
        predict_vcr_file(_vcr_config(tiny_world, (qa, qa), tmp_path / "p"))
    lines = (tiny_world.root / "vcr" / "val.jsonl").read_text().splitlines()
    no_image = dict(json.loads(lines[1]), img_id="99999")
    broken = tmp_path / "vcr" / "val.jsonl"
    broken.parent.mkdir()
    broken.write_text("\n".join([lines[0], json.dumps(no_image), *lines[2:]]) + "\n")
    (tmp_path / "vcr" / "metadata").symlink_to(tiny_world.root / "vcr" / "metadata")
    args = ["predict", "vcr", f"--qa_model={qa / 'model'}", f"--qar_model={qar / 'model'}", f"--questions={broken}",
            f"--features={tiny_world.store}", f"--out={tmp_path / 'p'}", "--device=cpu"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "image id 99999" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli([*args, "--skip_bad=true"], capsys)
    assert code == 0 and "skipped 1 bad record" in err
    summary = json.loads((tmp_path / "p" / "predict.json").read_text())
    assert summary["skipped_records"]["missing features"] == 1 and summary["predicted"] == len(lines) - 1


# --------------------------------------------------------------------------- the submission format, by hand


def _row(answers, gold_rationales, gold: int, other=(0.97, 0.01, 0.01, 0.01)) -> SubmissionRow:
    """Rationale scores `gold_rationales` given the gold answer and `other` (favouring choice 0) given the rest."""
    return SubmissionRow(tuple(answers), tuple(tuple(gold_rationales) if k == gold else other for k in range(4)))


def _with_first_score(line: str, value: str) -> str:
    annot_id, _, *rest = line.split(",")
    return ",".join([annot_id, value, *rest])


def test_submission_scoring_reads_the_rationales_of_the_gold_answer(tmp_path, capsys):
    ann = vcr_fixture(tmp_path)  # answer labels 0, 1, 2; rationale labels 3, 2, 1
    rows = {
        # Q->A right; given the gold answer (0) the rationale is right (3)
        "val-0": _row([0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7], gold=0),
        # Q->A right; given the gold answer (1) rationale 0 wins (wrong), though given answer 2 choice 2 would
        "val-1": SubmissionRow((0.1, 0.6, 0.2, 0.1), ((0.2, 0.2, 0.3, 0.3), (0.9, 0.0, 0.1, 0.0),
                                                      (0.0, 0.0, 1.0, 0.0), (0.25, 0.25, 0.25, 0.25))),
        # Q->A wrong (tie 0.3 / 0.3 -> index 0); given the gold answer (2) the rationale is right (1)
        "val-2": _row([0.3, 0.3, 0.2, 0.2], [0.0, 0.8, 0.1, 0.1], gold=2),
    }
    path = tmp_path / "submission.csv"
    assert write_submission(path, rows.items()) == 3
    got = evaluate_vcr_submission(ann, path)
    assert got["q2a"] == pytest.approx(200 / 3) and got["qa2r"] == pytest.approx(200 / 3)
    assert got["q2ar"] == pytest.approx(100 / 3) and got["num_questions"] == 3
    assert read_submission(path) == rows  # exact round trip of the scores

    text = path.read_text().splitlines()
    cases = {
        "header": ("annot_id,answer_0\n" + "\n".join(text[1:]), "expected the leaderboard header", "line 1"),
        "fields": ("\n".join([*text[:2], text[2].rsplit(",", 1)[0], text[3]]), "expected 21 fields, got 20", "line 3"),
        "number": ("\n".join([*text[:3], _with_first_score(text[3], "x")]), "a score is not a number", "line 4"),
        "nan": ("\n".join([*text[:3], _with_first_score(text[3], "nan")]), "not finite", "line 4"),
        "duplicate": ("\n".join([*text, text[1]]), "duplicate row for val-0", "line 5"),
        "unknown": ("\n".join([*text, text[1].replace("val-0", "val-9", 1)]), "val-9 is not a question", "line 5"),
        "missing": ("\n".join(text[:3]), "no prediction for this example", "annot_id val-2"),
        # a field past the csv module's limit was a traceback (_csv.Error)
        "huge field": ("\n".join([*text[:3], _with_first_score(text[3], "1" * 200_000)]), "malformed CSV (field "
                       "larger than field limit", "line 4"),
        "open quote": ("\n".join([*text[:3], _with_first_score(text[3], '"0.1')]), "expected 21 fields, got 2", "line 4"),
    }
    assert csv.field_size_limit() == 131072  # the csv module's default, as in a `vlberts` process
    for name, (content, message, where) in cases.items():
        bad = tmp_path / f"{name}.csv"
        bad.write_text(content + "\n")
        code, _, err = run_cli(["evaluate", "vcr", f"--annotations={ann}", f"--submission={bad}"], capsys)
        assert code == 2 and message in err and where in err and str(bad) in err, (name, err)
        assert len(err.strip().splitlines()) == 1, (name, err)
    code, _, err = run_cli(["evaluate", "vcr", f"--annotations={ann}", f"--submission={path}", f"--qa={path}"], capsys)
    assert code == 2 and "either --submission or --qa and --qar" in err
    code, _, err = run_cli(["evaluate", "vcr", f"--annotations={ann}", f"--qa={path}"], capsys)
    assert code == 2 and "needs --qa and --qar" in err
