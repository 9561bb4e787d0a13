"""VQA fine-tuning recipe on the tiny world: official-format predictions, metrics with the majority
baseline, the CLI, resume, and errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vlberts.errors import VlbertsError
from vlberts.recipes.finetune_vqa import VQA_MODELS, FinetuneVQAConfig, finetune_vqa, load_vqa_model
from vlberts.training import loop
from vlberts.training.metrics import MetricsLog

VLBERTS = Path(sys.executable).with_name("vlberts")


def vqa_cfg(world, init: Path, out: Path, **kw) -> FinetuneVQAConfig:
    tq, ta = world.vqa("train")
    eq, ea = world.vqa("test")
    base = dict(
        init=str(init), out=str(out), features=str(world.store), train_questions=str(tq), train_annotations=str(ta),
        eval_questions=str(eq), eval_annotations=str(ea), min_answer_count=2, epochs=1.0, batch_size=16,
        lr=1e-3, log_every=1, ckpt_every=2,
    )
    base.update(kw)
    return FinetuneVQAConfig(**base)


def test_finetune_writes_model_predictions_and_metrics(tiny_world, tiny_pretrained, tmp_path):
    out = tmp_path / "vqa"
    final = finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, out))
    metrics = json.loads((out / "metrics.json").read_text())
    eq, ea = tiny_world.vqa("test")
    n_test = len(json.loads(eq.read_text())["questions"])
    assert metrics["num_questions"] == n_test
    assert 0 <= metrics["accuracy"] <= 100 and 0 < metrics["majority_baseline"] <= 100
    assert set(metrics["per_answer_type"]) <= {"yes/no", "number", "other"}
    preds = json.loads((out / "predictions.json").read_text())
    assert len(preds) == n_test and set(preds[0]) == {"question_id", "answer"}

    # The official-format file scores the same through `vlberts evaluate vqa`.
    proc = subprocess.run(
        [str(VLBERTS), "evaluate", "vqa", "--predictions", str(out / "predictions.json"), "--questions", str(eq),
         "--annotations", str(ea), "--out", str(tmp_path / "eval")],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["accuracy"] == metrics["accuracy"]

    model, vocab, tok = load_vqa_model(final)
    assert model.classifier.out_features == len(vocab) == metrics["num_answers"]


def test_a_fixed_answer_table_sets_the_classes_and_their_order(tiny_world, tiny_pretrained, tmp_path, capsys):
    """--answer_vocab (LXMERT's trainval_ans2label.json form): the table's classes in its index order, answers
    the training set gives rarely (or never) included, min_answer_count unused; an empty table is an error."""
    from vlberts.tasks.vqa import build_answer_vocab, normalize_answer
    from vlberts.data.vqa import read_vqa

    tq, ta = tiny_world.vqa("train")
    counted = build_answer_vocab(read_vqa(tq, ta), min_count=2).answers
    table = [*reversed(counted[:6]), "an answer nobody gives"]  # not the counted order, one never a target
    (tmp_path / "ans2label.json").write_text(json.dumps({a: i for i, a in enumerate(table)}))
    out = tmp_path / "vqa"
    final = finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, out, epochs=0.25, min_answer_count=10**6,
                                 answer_vocab=str(tmp_path / "ans2label.json")))
    model, vocab, _ = load_vqa_model(final)
    assert list(vocab.answers) == table and model.classifier.out_features == len(table)
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["num_answers"] == len(table)
    # the training questions whose answers are none of the table's classes are counted
    expected = sum(1 for ex in read_vqa(tq, ta) if not {normalize_answer(a) for a in ex.answers} & set(table))
    assert metrics["train_questions_without_target"] == expected > 0
    assert {p["answer"] for p in json.loads((out / "predictions.json").read_text())} <= set(table)
    # ... and said in one warning line naming the answers' file
    warned = [line for line in capsys.readouterr().err.splitlines() if "no answer among" in line]
    assert warned == [f"warning: {ta}: {expected} of {metrics['train_questions']} training questions have no answer "
                      f"among the 7 classes of --answer_vocab={tmp_path / 'ans2label.json'} (first: question "
                      f"{warned[0].split('first: question ')[1].split(')')[0]}); they train toward no answer "
                      f"(metrics.json: train_questions_without_target)"]
    # A table none of whose classes any training question answers would train on nothing: an error.
    (tmp_path / "other.json").write_text(json.dumps(["zebra", "giraffe"]))
    with pytest.raises(VlbertsError, match=rf"{ta.name}: no training question has an answer among the 2 classes of "
                                           rf"--answer_vocab=.*other.json \(question \d+: '"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "o", answer_vocab=str(tmp_path / "other.json")))

    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(VlbertsError, match=r"empty.json: the answer table is empty"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "e", answer_vocab=str(tmp_path / "empty.json")))


def test_finetune_resume_equals_uninterrupted(tiny_world, tiny_pretrained, tmp_path):
    """Also with the first part's batches drawn ahead in a thread (`--prefetch`, a GPU's default): the same run."""
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "ref"))
    assert finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "run", stop_after=3, prefetch=2)) is None
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "run"))
    a, b = MetricsLog.read(tmp_path / "ref" / "metrics.jsonl"), MetricsLog.read(tmp_path / "run" / "metrics.jsonl")
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert json.loads((tmp_path / "ref" / "metrics.json").read_text())["accuracy"] == \
        json.loads((tmp_path / "run" / "metrics.json").read_text())["accuracy"]


def test_fp16_fine_tuning_scales_its_loss_and_resumes_exactly(tiny_world, tiny_pretrained, tmp_path, monkeypatch):
    """Every task's loop (`finetune_loop`) under `--precision=fp16`: the first updates overflow with this first
    scale and are skipped, halving it; interrupted after that, the run resumes with the checkpoint's scale."""
    monkeypatch.setattr(loop, "FP16_INIT_SCALE", 2.0**30)
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "ref", precision="fp16", tensorboard=True))
    assert len(list((tmp_path / "ref" / "tensorboard").glob("events.out.tfevents.*"))) == 1  # fine-tuning's log too
    assert finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "run", precision="fp16", stop_after=3)) is None
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "run", precision="fp16"))
    a, b = MetricsLog.read(tmp_path / "ref" / "metrics.jsonl"), MetricsLog.read(tmp_path / "run" / "metrics.jsonl")
    assert a[0]["loss_scale"] < 2.0**30 and a[1]["loss_scale"] < a[0]["loss_scale"]  # skipped, halved
    assert [(r["loss"], r["loss_scale"]) for r in a] == [(r["loss"], r["loss_scale"]) for r in b]
    assert json.loads((tmp_path / "ref" / "metrics.json").read_text())["accuracy"] == \
        json.loads((tmp_path / "run" / "metrics.json").read_text())["accuracy"]


def test_the_default_loss_is_the_papers(tiny_world, tiny_pretrained, tmp_path):
    """VisualBERT fine-tunes with its KL divergence (the original code), not the others' BCE x answers."""
    losses = {}
    for loss in ("auto", "kl", "bce"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / loss, loss=loss, stop_after=1))
        losses[loss] = MetricsLog.read(tmp_path / loss / "metrics.jsonl")[0]["loss"]
    assert losses["auto"] == losses["kl"] != losses["bce"]
    assert {arch: model.loss for arch, model in VQA_MODELS.items()} == {
        "visualbert": "kl", "vilbert": "bce", "vlbert": "bce", "lxmert": "bce", "wvisualbert": "bce"}


def test_skip_bad_counts_what_it_drops(tiny_world, tiny_pretrained, tmp_path):
    """Malformed records and questions about images missing from the store stop a run, naming the file and
    the record; with --skip_bad they are dropped, counted by kind in metrics.json, and the run goes on."""
    tq, ta = tiny_world.vqa("train")
    q, a = json.loads(tq.read_text()), json.loads(ta.read_text())
    n = len(q["questions"])
    q["questions"][0]["question"] = 5  # a malformed question (its annotation goes with it)
    a["annotations"][1]["answers"] = a["annotations"][1]["answers"][:9]  # 9 answers (its question loses it)
    extra = dict(q["questions"][2], question_id=987654321, image_id=999999)  # an image not in the store
    q["questions"].append(extra)
    a["annotations"].append(dict(a["annotations"][2], question_id=987654321, image_id=999999))
    bq, ba = tmp_path / "q.json", tmp_path / "a.json"
    bq.write_text(json.dumps(q)), ba.write_text(json.dumps(a))

    with pytest.raises(VlbertsError, match=r"q\.json: record questions\[0\]: field question must be a string, got int"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "strict", train_questions=str(bq),
                             train_annotations=str(ba)))
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "skip", train_questions=str(bq),
                         train_annotations=str(ba), skip_bad=True))
    metrics = json.loads((tmp_path / "skip" / "metrics.json").read_text())
    skipped = metrics["skipped_records"]
    # Bad records: question 0 (its annotation goes with it, not counted again), annotation 1 (its question goes
    # with it), and the question about the missing image.
    assert {k: v for k, v in skipped.items() if k != "first"} == {"total": 3, "malformed record": 2, "missing features": 1}
    assert "q.json: record questions[0]" in skipped["first"]
    assert metrics["train_questions"] == n - 2  # questions 0 and 1 lost; the missing image's dropped too
    assert metrics["num_questions"] > 0


def test_nothing_left_to_train_on_is_one_line_naming_the_file(tiny_world, tiny_pretrained, tmp_path, capsys):
    """--skip_bad dropping every training question (every image missing from the store) ended in a
    traceback from the batch sampler; an empty training file named no file and blamed --exclude_images."""
    tq, ta = tiny_world.vqa("train")
    q, a = json.loads(tq.read_text()), json.loads(ta.read_text())
    for rec in (*q["questions"], *a["annotations"]):
        rec["image_id"] = 999999
    bq, ba = tmp_path / "q.json", tmp_path / "a.json"
    bq.write_text(json.dumps(q)), ba.write_text(json.dumps(a))
    with pytest.raises(VlbertsError, match=r"q\.json: no example to train on \(the file holds none, or --skip_bad "
                                           r"dropped them all\)"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "skip", train_questions=str(bq),
                             train_annotations=str(ba), skip_bad=True))
    assert f"skipped {len(q['questions'])} bad records ({len(q['questions'])} missing features)" in capsys.readouterr().err
    bq.write_text(json.dumps({**q, "questions": []})), ba.write_text(json.dumps({**a, "annotations": []}))
    with pytest.raises(VlbertsError, match=r"q\.json: no example to train on \(the file holds none"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "empty", train_questions=str(bq),
                             train_annotations=str(ba)))
    # every training question also an evaluation question, dropped by --exclude_eval_questions: said so
    eq, ea = tiny_world.vqa("test")
    with pytest.raises(VlbertsError, match=rf"{eq.name}: no example to train on \(dropped: \d+ also evaluation "
                                           r"questions \(--exclude_eval_questions\)\)"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "same", train_questions=str(eq),
                             train_annotations=str(ea), exclude_eval_questions=True))


def test_bad_settings_are_one_line_errors(tiny_world, tiny_pretrained, tmp_path):
    with pytest.raises(VlbertsError, match="unknown loss 'mse'; valid: auto, bce, kl"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "a", loss="mse"))
    with pytest.raises(VlbertsError, match="no answer is given by 100000\\+ training questions"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "b", min_answer_count=100000))
    # VQA v2's questions as a bare list read as LXMERT's list, which holds its answers: the message says so
    tq, _ = tiny_world.vqa("train")
    (tmp_path / "list.json").write_text(json.dumps(json.loads(tq.read_text())["questions"]))
    with pytest.raises(VlbertsError, match=r"names 1 file\(s\) for 0 VQA v2 questions JSON file\(s\): .*; "
                                           r".*list\.json reads as a list or imdb holding its answers\)$"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "c", train_questions=str(tmp_path / "list.json")))


def test_cli_malformed_annotations_exit_2_naming_the_file(tiny_world, tiny_pretrained, tmp_path):
    tq, _ = tiny_world.vqa("train")
    bad = tmp_path / "annotations.json"
    bad.write_text('{"annotations": [{"question_id": 1,')
    proc = subprocess.run(
        [str(VLBERTS), "finetune", "vqa", f"--init={tiny_pretrained}", f"--features={tiny_world.store}",
         f"--train_questions={tq}", f"--train_annotations={bad}", f"--out={tmp_path / 'run'}"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and str(bad) in proc.stderr and "malformed JSON" in proc.stderr
    assert not (tmp_path / "run").exists()


def _finetune_cli(world, init: Path, features: Path, out: Path) -> subprocess.CompletedProcess:
    tq, ta = world.vqa("train")
    return subprocess.run(
        [str(VLBERTS), "finetune", "vqa", f"--init={init}", f"--features={features}", f"--train_questions={tq}",
         f"--train_annotations={ta}", f"--out={out}", "--min_answer_count=2"],
        capture_output=True, text=True,
    )


def test_feature_dimension_that_disagrees_with_the_model(tiny_world, tiny_pretrained, tmp_path):
    """A store whose features are wider than the model's visual_dim is named, with the image."""
    import numpy as np

    from vlberts.features.record import RegionRecord, StoreMetadata
    from vlberts.features.store import RegionStore, RegionStoreWriter

    wide = tmp_path / "wide.h5"
    with RegionStore(tiny_world.store) as src, RegionStoreWriter(wide, feature_dim=src.feature_dim + 4, metadata=StoreMetadata(extractor="test")) as w:
        for rec in src.records():
            w.add(RegionRecord(rec.image_id, rec.image_w, rec.image_h, rec.boxes,
                               np.concatenate([rec.features, np.zeros((rec.num_boxes, 4), np.float32)], 1)))
    proc = _finetune_cli(tiny_world, tiny_pretrained, wide, tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    assert "features are" in proc.stderr and "expects" in proc.stderr and str(wide) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_wvisualbert_on_a_store_without_detected_classes_is_one_line(tiny_world, tiny_pretrained, tmp_path):
    """W-VisualBERT reads each region's detector tag (`obj_id` and the class names): a store that has the
    class names but no `obj_id` per box is named in one line, exit 2, before any training."""
    from conftest import random_init_dir

    from vlberts.features.record import RegionRecord
    from vlberts.features.store import RegionStore, RegionStoreWriter

    bare = tmp_path / "no_obj_id.h5"
    with RegionStore(tiny_world.store) as src, RegionStoreWriter(bare, src.feature_dim, metadata=src.metadata) as w:
        assert src.metadata.classes  # the names stay; the per-box class ids go
        for rec in src.records():
            w.add(RegionRecord(rec.image_id, rec.image_w, rec.image_h, rec.boxes, rec.features))
    init = random_init_dir("wvisualbert-tiny", tiny_pretrained, tmp_path / "w")
    proc = _finetune_cli(tiny_world, init, bare, tmp_path / "run")
    assert proc.returncode == 2, proc.stderr
    assert "obj_id" in proc.stderr and str(bare) in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_several_training_files_and_questions_also_evaluated(tiny_world, tiny_pretrained, tmp_path):
    """--train_questions=A,B (a VQA v2 JSON and an imdb mixed; one annotations file per JSON, in order) trains on
    both; a training question that is also an evaluation question is an error, and --exclude_eval_questions
    drops it from training (VisualBERT's train+val minus minival), counted in metrics.json; a file given twice
    names the first; GQA takes several files the same way."""
    import dataclasses

    from vlberts.data.vqa import read_vqa
    from vlberts.errors import BadRecords
    from vlberts.recipes import finetune_gqa

    (tq, ta), (vq, va) = tiny_world.vqa("train"), tiny_world.vqa("val")
    val_imdb = tiny_world.root / "vqa" / "imdb" / "imdb_val.npy"
    n_train, n_val = len(read_vqa(tq)), len(read_vqa(vq))
    both = dict(train_questions=f"{tq},{val_imdb}", train_annotations=str(ta), epochs=0.1)
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "both", **both))
    metrics = json.loads((tmp_path / "both" / "metrics.json").read_text())
    assert metrics["train_questions"] == n_train + n_val and metrics["train_questions_in_eval_dropped"] == 0

    minival = vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "minival", **both, eval_questions=str(vq),
                      eval_annotations=str(va))
    with pytest.raises(VlbertsError, match=rf"{vq.name}: {n_val} of these evaluation questions are training questions "
                                           r"too \(the first: question id \d+\); --exclude_eval_questions"):
        finetune_vqa(minival)
    finetune_vqa(dataclasses.replace(minival, exclude_eval_questions=True))
    metrics = json.loads((tmp_path / "minival" / "metrics.json").read_text())
    assert metrics["train_questions"] == n_train and metrics["train_questions_in_eval_dropped"] == n_val

    with pytest.raises(VlbertsError, match=r"--train_annotations names 2 file\(s\) for 1 VQA v2 questions JSON"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "x", **{**both, "train_annotations": f"{ta},{va}"}))
    with pytest.raises(VlbertsError, match=rf"imdb_val\.npy: question id \d+ is also in {val_imdb}"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "y", train_questions=f"{val_imdb},{val_imdb}",
                             train_annotations=""))
    gqa = tiny_world.root / "gqa"
    train, _ = finetune_gqa._read(finetune_gqa.FinetuneGQAConfig(
        train_questions=f"{gqa / 'train_balanced_questions.json'},{gqa / 'val_balanced_questions.json'}"), BadRecords(),
        None)  # no --answer_vocab
    assert len(train) == sum(len(json.loads((gqa / f"{s}_balanced_questions.json").read_text())) for s in ("train", "val"))


def test_the_closing_line_names_only_files_the_run_wrote(tmp_path, capsys, monkeypatch):
    """A run without evaluation questions writes no predictions.json, and its last line does not name one."""
    from vlberts import cli

    monkeypatch.delenv("RANK", raising=False)
    (tmp_path / "metrics.json").write_text(json.dumps({"num_train_questions": 10}))
    cli._report_finetune(str(tmp_path), tmp_path / "model", cli._qa_lines("VQA"), "predictions.json")
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'model'} and {tmp_path / 'metrics.json'}"
    (tmp_path / "predictions.json").write_text("[]")
    cli._report_finetune(str(tmp_path), tmp_path / "model", cli._qa_lines("VQA"), "predictions.json")
    assert capsys.readouterr().out.strip() == (f"wrote {tmp_path / 'model'}, {tmp_path / 'predictions.json'} and "
                                               f"{tmp_path / 'metrics.json'}")
