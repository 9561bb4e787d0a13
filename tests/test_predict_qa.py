"""`vlberts predict vqa|gqa`: plain inference with a fine-tuned model on a questions file without answers.
Its predictions equal the ones the fine-tuning run wrote for the same questions (same layout, head and
prediction code), `vlberts evaluate` scores them to the fine-tuning run's accuracy, and bad input (a model
of the other task, a question whose image is not in the store) is a one-line error or, with --skip_bad,
a count in predict.json."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_finetune_vqa import vqa_cfg
from test_gqa_task import gqa_cfg

from vlberts.errors import VlbertsError
from vlberts.recipes.finetune_gqa import finetune_gqa
from vlberts.recipes.finetune_vqa import finetune_vqa
from vlberts.recipes.predict_qa import PredictQAConfig, predict_file
from vlberts.tasks.vqa import evaluate_predictions
from vlberts.training.distributed import free_port

VLBERTS = Path(sys.executable).with_name("vlberts")


def _answers(path: Path, key: str, value: str) -> dict:
    return {p[key]: p[value] for p in json.loads(path.read_text())}


@pytest.fixture(scope="module")
def vqa_run(tiny_world, tiny_pretrained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vqa") / "run"
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, out, max_regions=20, max_text_len=24))
    return out


def test_vqa_predictions_equal_the_fine_tuning_runs_and_score_the_same(tiny_world, vqa_run, tmp_path):
    questions, annotations = tiny_world.vqa("test")
    path = predict_file(PredictQAConfig(model=str(vqa_run / "model"), questions=str(questions),
                                        features=str(tiny_world.store), out=str(tmp_path / "p"), device="cpu"), "vqa")
    ours = _answers(path, "question_id", "answer")
    assert ours == _answers(vqa_run / "predictions.json", "question_id", "answer") and len(ours) > 30
    assert len(set(ours.values())) > 1, ours  # a model that answers more than one thing
    summary = json.loads((tmp_path / "p" / "predict.json").read_text())
    assert (summary["max_text_len"], summary["max_regions"], summary["answered"]) == (24, 20, len(ours))
    scored = evaluate_predictions(path, questions, annotations)
    assert scored["accuracy"] == json.loads((vqa_run / "metrics.json").read_text())["accuracy"]


def test_gqa_predictions_equal_the_fine_tuning_runs(tiny_world, tiny_pretrained, tmp_path):
    run = tmp_path / "gqa"
    cfg = gqa_cfg(tiny_world, tiny_pretrained, run)
    finetune_gqa(cfg)
    path = predict_file(PredictQAConfig(model=str(run / "model"), questions=cfg.eval_questions,
                                        features=str(tiny_world.store), out=str(tmp_path / "p"), device="cpu"), "gqa")
    ours = _answers(path, "questionId", "prediction")
    assert ours == _answers(run / "predictions.json", "questionId", "prediction") and ours


def test_bad_input_is_one_line_or_counted(tiny_world, vqa_run, tmp_path):
    questions, _ = tiny_world.vqa("test")
    cfg = PredictQAConfig(model=str(vqa_run / "model"), questions=str(questions), features=str(tiny_world.store),
                          out=str(tmp_path / "p"), device="cpu")
    with pytest.raises(VlbertsError, match="not a fine-tuned GQA model"):
        predict_file(cfg, "gqa")
    q = json.loads(questions.read_text())
    q["questions"].append(dict(q["questions"][0], question_id=987654321, image_id=999999))
    (tmp_path / "q.json").write_text(json.dumps(q))
    with pytest.raises(VlbertsError, match="image id 999999 .* not in store"):
        predict_file(PredictQAConfig(**{**vars(cfg), "questions": str(tmp_path / "q.json")}), "vqa")
    predict_file(PredictQAConfig(**{**vars(cfg), "questions": str(tmp_path / "q.json"), "skip_bad": True}), "vqa")
    summary = json.loads((tmp_path / "p" / "predict.json").read_text())
    assert summary["skipped_records"]["missing features"] == 1 and summary["answered"] == len(q["questions"]) - 1


def test_cli(tiny_world, vqa_run, tmp_path):
    questions, _ = tiny_world.vqa("test")
    run = subprocess.run([str(VLBERTS), "predict", "vqa", f"--model={vqa_run / 'model'}", f"--questions={questions}",
                          f"--features={tiny_world.store}", f"--out={tmp_path / 'p'}", "--device=cpu"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == f"wrote {tmp_path / 'p' / 'predictions.json'} and {tmp_path / 'p' / 'predict.json'}"
    run = subprocess.run([str(VLBERTS), "predict", "vqa", f"--questions={questions}"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip() == "error: predict vqa needs --model"


@pytest.mark.skipif(not VLBERTS.with_name("torchrun").exists(), reason="torchrun not installed")
def test_two_processes_predict_each_question_once_and_write_what_one_process_writes(tiny_world, vqa_run, tmp_path):
    # Under torchrun each rank answers every second question; rank 0 alone writes the merged file.
    questions, _ = tiny_world.vqa("test")
    args = ["predict", "vqa", f"--model={vqa_run / 'model'}", f"--questions={questions}",
            f"--features={tiny_world.store}", "--device=cpu", "--batch_size=7"]
    one = subprocess.run([str(VLBERTS), *args, f"--out={tmp_path / 'one'}"], capture_output=True, text=True)
    assert one.returncode == 0, one.stderr
    two = subprocess.run([str(VLBERTS.with_name("torchrun")), "--nproc_per_node=2", f"--master_port={free_port()}",
                          str(VLBERTS), *args, f"--out={tmp_path / 'two'}"],
                         capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    assert (tmp_path / "two" / "predictions.json").read_bytes() == (tmp_path / "one" / "predictions.json").read_bytes()
    summary = json.loads((tmp_path / "two" / "predict.json").read_text())
    assert summary["ranks"] == 2 and summary["answered"] == len(json.loads(questions.read_text())["questions"])
    assert two.stdout.count("wrote ") == 1  # one rank reports


def test_max_text_len_beyond_the_position_embeddings(tiny_world, vqa_run, tmp_path, capsys):
    # A question longer than the model's position table, asked for with --max_text_len above it: one line
    # naming the model's config.json and exit code 2, not an IndexError from the embedding lookup.
    from vlberts.cli import main

    questions, _ = tiny_world.vqa("val")
    data = json.loads(questions.read_text())
    data["questions"][0]["question"] = " ".join(["is the small circle red"] * 100) + "?"
    long_q = tmp_path / "long.json"
    long_q.write_text(json.dumps(data))
    with pytest.raises(SystemExit) as exc:
        main(["predict", "vqa", f"--model={vqa_run / 'model'}", f"--questions={long_q}",
              f"--features={tiny_world.store}", f"--out={tmp_path / 'p'}", "--max_text_len=100000"])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and "Traceback" not in err and err.strip().count("\n") == 0
    assert f"{vqa_run / 'model' / 'config.json'}: --max_text_len=100000 is more than the model's" in err, (out, err)
