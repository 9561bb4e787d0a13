"""Bad settings and damaged inputs found by a sweep of the command line: each is a one-line error (exit 2),
never a traceback and never a run that goes on with a silently wrong result. Settings outside their range
(`config.SETTING_RANGES`), negative objective weights, unknown devices, damaged model directories and
checkpoints, region stores with NaN features or an index that points into other images' rows, a training
loss that turns NaN (stopped before it is checkpointed), an output directory that is a file, a partly
labelled evaluation file, and `--flag=true` for the on/off options of the commands that are not run configs."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import os
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import typer.main
from safetensors.torch import load_file, save_file
from test_nlvr2_task import nlvr2_cfg, nlvr2_file
from test_pretrain import cfg_for

from vlberts.cli import _flags_with_values, main
from vlberts.cli import app as cli_app
from vlberts.config import apply_overrides
from vlberts.data.shards import write_shards
from vlberts.errors import VlbertsError
from vlberts.features.store import RegionStore
from vlberts.io import read_json
from vlberts.objectives.recipe import RECIPES, parse_objectives
from vlberts.recipes.common import resolve_device
from vlberts.recipes.demo import DemoConfig
from vlberts.recipes.finetune_nlvr2 import finetune_nlvr2
from vlberts.recipes.finetune_vqa import FinetuneVQAConfig
from vlberts.recipes.predict_qa import PredictQAConfig
from vlberts.recipes.pretrain import pretrain
from vlberts.training.checkpoint import load_pretraining_model, read_model_config


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


@pytest.mark.parametrize("override, message", [
    ("--batch_size=0", "batch_size: must be at least 1, got 0"),
    ("--grad_accum=0", "grad_accum: must be at least 1"),
    ("--log_every=0", "log_every: must be at least 1"),
    ("--ckpt_every=-5", "ckpt_every: must be at least 1"),
    ("--lr=-1", "lr: must be at least 0, got -1"),
    ("--lr=nan", "lr: must be a finite number, got nan"),
    ("--epochs=inf", "epochs: must be a finite number"),
    ("--epochs=0", "epochs: must be more than 0"),
    ("--warmup=-1", "warmup: must be at least 0, got -1"),
    ("--flip_prob=2", "flip_prob: must be at most 1, got 2"),
    ("--max_text_len=1", "max_text_len: must be at least 8"),
    ("--num_workers=-1", "num_workers: must be at least 0"),
    ("--num_workers=1000", "num_workers: must be at most 128, got 1000"),
    ("--clip=-1", "clip: must be at least 0"),
    ("--momentum=1.5", "momentum: must be at most 1, got 1.5"),
    ("--lr_factor=0", "lr_factor: must be more than 0, got 0"),
    ("--optimizer=adam", "optimizer: 'adam' is not one of 'adamw', 'sgd'"),
    ("--lr_schedule=cosine", "lr_schedule: 'cosine' is not one of 'linear', 'step'"),
])
def test_settings_outside_their_range_are_one_line_errors(override, message):
    with pytest.raises(VlbertsError, match=message.replace("(", r"\(")):
        apply_overrides(FinetuneVQAConfig(), [override])


@pytest.mark.parametrize("setting, message", [
    (dict(grad_accum=0), "PretrainConfig.grad_accum: must be at least 1, got 0"),
    (dict(log_every=0), "PretrainConfig.log_every: must be at least 1, got 0"),
    (dict(batch_size=0), "PretrainConfig.batch_size: must be at least 1, got 0"),
    (dict(seed=-1), "PretrainConfig.seed: must be at least 0, got -1"),
    (dict(mlm_prob=1.5), "PretrainConfig.mlm_prob: must be at most 1, got 1.5"),
    (dict(steps=-5), "PretrainConfig.steps: must be at least 0, got -5"),
    (dict(steps="8"), None),  # converted as the command line converts it
])
def test_a_config_built_in_python_is_checked_as_the_command_lines(tiny_world, tiny_pretrained, tmp_path, setting,
                                                                  message):
    """`recipes.common.start_recipe`: `pretrain(PretrainConfig(grad_accum=0))` from Python stopped deep in
    training with a traceback (or, for mlm_prob=1.5, steps=-5, trained and wrote a model); every recipe now
    checks its config as `from_dict` does, before it writes anything."""
    cfg = cfg_for(tiny_world, tmp_path / "run", steps=2, **{k: v for k, v in setting.items() if k != "steps"})
    if "steps" in setting:
        cfg = dataclasses.replace(cfg, steps=setting["steps"])
    if message is None:
        assert pretrain(cfg) is not None and (tmp_path / "run" / "model").is_dir()
        return
    with pytest.raises(VlbertsError, match=re.escape(message) + "$"):
        pretrain(cfg)
    assert not (tmp_path / "run").exists()
    with pytest.raises(VlbertsError, match=re.escape("FinetuneNLVR2Config.lr: must be at least 0, got -1") + "$"):
        finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, tmp_path / "nlvr2", lr=-1.0))
    assert not (tmp_path / "nlvr2").exists()


def test_a_default_of_zero_stays_allowed_where_it_means_the_runs_own():
    cfg = apply_overrides(PredictQAConfig(), ["--max_text_len=0", "--max_regions=0", "--batch_size=8"])
    assert (cfg.max_text_len, cfg.max_regions, cfg.batch_size) == (0, 0, 8)
    with pytest.raises(VlbertsError, match=r"max_regions: must be at least 1 \(or 0, the default\), got -1$"):
        apply_overrides(PredictQAConfig(), ["--max_regions=-1"])  # the message names the 0 it allows
    assert apply_overrides(FinetuneVQAConfig(), ["--warmup=0", "--clip=0", "--lr=3e-5"]).lr == 3e-5
    assert apply_overrides(FinetuneVQAConfig(), ["--warmup=500"]).warmup == 500  # VL-BERT's 500 updates
    assert apply_overrides(DemoConfig(), ["--length_group=0"]).length_group == 0  # 0: off, where 64 is the default


def test_the_command_line_reports_a_bad_setting_in_one_line(tiny_world, tiny_pretrained, tmp_path, capsys):
    code, _, err = run_cli(["finetune", "vqa", f"--init={tiny_pretrained}", f"--features={tiny_world.store}",
                            f"--out={tmp_path / 'run'}", "--batch_size=0"], capsys)
    assert code == 2 and "batch_size: must be at least 1, got 0" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_negative_objective_weights_and_unknown_devices_are_refused(tiny_pretrained):
    model_cfg, _ = read_model_config(tiny_pretrained)
    with pytest.raises(VlbertsError, match="weight '-1' must be a finite number >= 0"):
        parse_objectives("mlm=-1", RECIPES["visualbert"], model_cfg)
    with pytest.raises(VlbertsError, match="weight 'nan'"):
        parse_objectives("mlm=nan", RECIPES["visualbert"], model_cfg)
    # a repeated name (the later weight would win) and all weights 0 (nothing trained, a model written anyway)
    with pytest.raises(VlbertsError, match="objective 'mlm' given twice in --objectives=mlm=1,mlm=2"):
        parse_objectives("mlm=1,mlm=2", RECIPES["visualbert"], model_cfg)
    with pytest.raises(VlbertsError, match="--objectives=mlm=0,match=0: every weight is 0"):
        parse_objectives("mlm=0,match=0", RECIPES["visualbert"], model_cfg)
    assert parse_objectives("mlm=0,match=1", RECIPES["visualbert"], model_cfg) == {"mlm": 0.0, "match": 1.0}
    with pytest.raises(VlbertsError, match="unknown device 'tpu'; valid: auto, cpu, cuda, cuda:N"):
        resolve_device("tpu")
    with pytest.raises(VlbertsError, match="unknown device 'cpu:1'"):
        resolve_device("cpu:1")
    assert resolve_device("cpu").type == "cpu" and resolve_device("cpu:0").type == "cpu"


def test_damaged_model_directories_name_the_file(tiny_pretrained, tmp_path):
    missing = shutil.copytree(tiny_pretrained, tmp_path / "missing")
    (missing / "model.safetensors").unlink()
    with pytest.raises(VlbertsError, match="weights file not found") as e:
        load_pretraining_model(missing)
    assert str(missing / "model.safetensors") in str(e.value)
    cut = shutil.copytree(tiny_pretrained, tmp_path / "cut")
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(VlbertsError, match="cannot read weights"):
        load_pretraining_model(cut)
    null = shutil.copytree(tiny_pretrained, tmp_path / "null")
    meta = json.loads((null / "config.json").read_text())
    (null / "config.json").write_text(json.dumps({**meta, "config": None}))
    with pytest.raises(VlbertsError, match='config.json needs "arch"'):
        read_model_config(null)


def _copy_store(src: Path, dst: Path, edit) -> Path:
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        edit(f)
    return dst


def test_region_stores_with_nan_features_or_a_bad_index_are_refused(tiny_world, tmp_path):
    store = RegionStore(tiny_world.store)
    first = store.ids()[0]

    def nan_row(f):
        f["features"][3] = np.nan  # image 0's fourth region (every world image has more than 3)
    nan_store = RegionStore(_copy_store(tiny_world.store, tmp_path / "nan.h5", nan_row))
    with pytest.raises(VlbertsError, match=f"record image {first}: features hold NaN or inf") as e:
        nan_store.get(first)
    assert str(tmp_path / "nan.h5") in str(e.value)
    assert nan_store.get(store.ids()[1]).num_boxes == store.num_boxes(store.ids()[1])  # the others read

    def count_999(f):
        f["count"][0] = 999  # image 0 would read the next images' regions
    with pytest.raises(VlbertsError, match=f"damaged store: image {store.ids()[0]}: offset 0 and count 999"):
        RegionStore(_copy_store(tiny_world.store, tmp_path / "count.h5", count_999))

    def no_features(f):
        del f["features"]
    with pytest.raises(VlbertsError, match="damaged store: missing dataset 'features'"):
        RegionStore(_copy_store(tiny_world.store, tmp_path / "nofeat.h5", no_features))

    def duplicate(f):
        ids = f["image_ids"].asstr()[()].tolist()
        ids[1] = ids[0]
        del f["image_ids"]
        f["image_ids"] = np.array(ids, dtype=h5py.string_dtype())
    with pytest.raises(VlbertsError, match=f"image id {first} appears more than once"):
        RegionStore(_copy_store(tiny_world.store, tmp_path / "dup.h5", duplicate))


def test_a_loss_that_turns_nan_stops_the_run_before_it_is_checkpointed(tiny_world, tiny_pretrained, tmp_path):
    bad = shutil.copytree(tiny_pretrained, tmp_path / "nan_init")
    weights = load_file(str(bad / "model.safetensors"))
    name = next(k for k in weights if k.endswith("word_embeddings.weight"))
    # finite in the file (NaN there is refused on load), the sum with the position embeddings overflows to inf
    weights[name] = torch.full_like(weights[name], 3e38)
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "run"
    with pytest.raises(VlbertsError, match="training diverged at update 1: the mlm loss is nan"):
        pretrain(cfg_for(tiny_world, out, init=str(bad), model="visualbert-small", log_every=5, ckpt_every=1))
    assert not list((out / "checkpoints").glob("step_*")) if (out / "checkpoints").exists() else True
    assert not (out / "model").exists()


def test_resuming_from_a_checkpoint_with_nan_names_the_tensor_and_the_earlier_checkpoint(tiny_world, tmp_path):
    out = tmp_path / "run"
    assert pretrain(cfg_for(tiny_world, out, stop_after=7)) is None  # checkpoints at updates 3 and 6
    ckpts = out / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000003", "step_00000006"]
    damaged = ckpts / "step_00000006" / "model.safetensors"
    weights = load_file(str(damaged))
    name = next(k for k in weights if k.endswith("word_embeddings.weight"))
    weights[name][3, 0] = float("inf")
    save_file(weights, str(damaged), metadata={"format": "pt"})
    with pytest.raises(VlbertsError) as err:
        pretrain(cfg_for(tiny_world, out))
    assert str(err.value) == (f"{damaged}: tensor {name} holds NaN or inf (a damaged checkpoint); "
                              "write step_00000003 into checkpoints/latest to resume from it")
    # A file cut short (a machine's crash before the file reached the disk) gives the same advice.
    damaged.write_bytes(damaged.read_bytes()[:5])
    with pytest.raises(VlbertsError, match=re.escape(f"{damaged}: cannot read weights: ") + ".*; write "
                       "step_00000003 into checkpoints/latest to resume from it$"):
        pretrain(cfg_for(tiny_world, out))
    (ckpts / "latest").write_text("step_00000003\n")  # the advice works: the run resumes and finishes
    assert pretrain(cfg_for(tiny_world, out)) == out / "model"


def test_a_vocabulary_longer_than_the_word_embeddings_is_refused(tiny_pretrained, tmp_path):
    model = shutil.copytree(tiny_pretrained, tmp_path / "model")
    tokens = (model / "vocab.txt").read_text().splitlines()
    size = read_json(model / "config.json")["config"]["vocab_size"]
    assert len(tokens) == size
    (model / "vocab.txt").write_text("\n".join(tokens[:-3]) + "\n")  # fewer: a padded table, allowed
    assert read_model_config(model)[0].vocab_size == size
    (model / "vocab.txt").write_text("\n".join([*tokens, "zebra"]) + "\n")
    with pytest.raises(VlbertsError) as err:
        load_pretraining_model(model)
    assert str(err.value) == (f"{model / 'vocab.txt'}: holds {size + 1} tokens but the model in config.json has "
                              f"{size} word embeddings (a vocabulary from another model?)")


def test_a_tokenizer_given_as_its_vocab_file_names_the_folder(tiny_world, tiny_pretrained, tmp_path, capsys):
    """`--tokenizer=DIR/vocab.txt` said "DIR/vocab.txt/vocab.txt: vocabulary file not found"."""
    vocab = tiny_pretrained / "vocab.txt"
    code, _, err = run_cli(["pretrain", f"--captions={tiny_world.captions_train}", f"--features={tiny_world.store}",
                            f"--out={tmp_path / 'pt'}", "--model=visualbert-tiny", "--steps=1", f"--tokenizer={vocab}"],
                           capsys)
    assert code == 2 and err.strip() == (f"error: {vocab}: a tokenizer is a directory holding vocab.txt, not a file: "
                                         f"give {tiny_pretrained}")


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where no directory can be made")
def test_an_output_directory_that_cannot_be_made_is_one_line(tiny_world, capsys):
    out = "/proc/vlberts_cannot_make_this"
    code, _, err = run_cli(["pretrain", f"--captions={tiny_world.captions_train}", f"--features={tiny_world.store}",
                            "--model=visualbert-tiny", "--steps=2", "--batch_size=4", f"--out={out}"], capsys)
    assert code == 2 and err.strip() == f"error: {out}: No such file or directory", err


def test_an_evaluation_file_with_nothing_to_evaluate_is_an_error_before_training(tiny_world, tiny_pretrained,
                                                                                tmp_path, capsys):
    questions, annotations = tiny_world.vqa("train")
    empty_q, empty_a = tmp_path / "q.json", tmp_path / "a.json"
    empty_q.write_text(json.dumps({"questions": []}))
    empty_a.write_text(json.dumps({"annotations": []}))
    out = tmp_path / "run"
    code, _, err = run_cli(["finetune", "vqa", f"--init={tiny_pretrained}", f"--features={tiny_world.store}",
                            f"--train_questions={questions}", f"--train_annotations={annotations}",
                            f"--eval_questions={empty_q}", f"--eval_annotations={empty_a}", "--min_answer_count=1",
                            "--epochs=0.05", "--batch_size=4", f"--out={out}"], capsys)
    assert code == 2 and err.strip() == (f"error: {empty_q}: no example to evaluate (the file holds none, or "
                                         "--skip_bad dropped them all)")
    assert not (out / "model").exists()  # refused before any training


def test_stopping_before_the_first_checkpoint_does_not_promise_a_resume(tiny_world, tmp_path, capsys):
    args = ["pretrain", f"--captions={tiny_world.captions_train}", f"--features={tiny_world.store}",
            "--model=visualbert-tiny", "--vocab_size=200", "--steps=8", "--batch_size=4", "--ckpt_every=3"]
    code, out, _ = run_cli([*args, "--stop_after=2", f"--out={tmp_path / 'a'}"], capsys)
    assert code == 0 and out.strip() == (f"stopped early at --stop_after, before the first checkpoint (--ckpt_every): "
                                         f"nothing was saved, so running again starts over ({tmp_path / 'a'})")
    code, out, _ = run_cli([*args, "--stop_after=4", f"--out={tmp_path / 'b'}"], capsys)
    assert code == 0 and out.strip() == f"stopped early at --stop_after; run again to resume ({tmp_path / 'b'})"


def test_a_killed_runs_forked_workers_do_not_keep_its_directory(tmp_path):
    """A rank killed while its DataLoader workers (forked) lived kept DIR/.vlberts.lock held through their
    inherited descriptors, so torchrun's restart of it was refused ("another vlberts run (pid of the dead
    rank)"). Forked children now close them: the lock ends with the process that took it."""
    import signal
    import subprocess
    import sys
    import time

    from vlberts.io import lock_run_directory

    out = tmp_path / "run"
    script = (
        "import os, sys, time\n"
        "from vlberts.io import lock_run_directory\n"
        f"lock = lock_run_directory({str(out)!r})\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    time.sleep(60); os._exit(0)\n"
        "print(child, flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        with pytest.raises(VlbertsError, match="another vlberts run"):
            lock_run_directory(out)  # the run is alive: refused
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        os.kill(child, 0)  # its forked child still lives
        deadline = time.monotonic() + 5
        while True:  # the lock goes with the killed process, not with its child
            try:
                held = lock_run_directory(out)
                break
            except VlbertsError:
                assert time.monotonic() < deadline, "the dead run's forked child kept the directory locked"
                time.sleep(0.05)
        held.release()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


def test_a_second_run_on_a_directory_in_use_is_refused(tiny_world, tmp_path, capsys):
    # Two jobs on one --out (a scheduler's retry while the first still runs) interleaved their checkpoints and
    # log records; the directory is now taken for the run's lifetime (here by this test, as another job would).
    from vlberts.io import lock_run_directory

    out = tmp_path / "run"
    args = ["pretrain", f"--captions={tiny_world.captions_train}", f"--features={tiny_world.store}",
            "--model=visualbert-tiny", "--vocab_size=200", "--steps=2", "--batch_size=4", f"--out={out}"]
    held = lock_run_directory(out)
    code, _, err = run_cli(args, capsys)
    assert code == 2 and err.strip() == (f"error: {out}: another vlberts run (pid {os.getpid()}) is using this "
                                         "directory; wait for it to end or pick another --out")
    assert not (out / "model").exists()
    held.release()  # the first job ended: the directory is free again, and released after each command
    assert run_cli(args, capsys)[0] == 0 and (out / "model").is_dir()
    assert run_cli(args, capsys)[0] == 0  # the same process again: the first command let the directory go


def test_a_command_that_fails_before_training_leaves_no_run_directory(tiny_world, tmp_path, capsys):
    """A setting found wrong after the tokenizer was written used to leave OUT with tokenizer/ and the lock
    file. A directory the run made is removed when the run fails before any checkpoint or log record; one
    the user made is theirs and stays; a run that trained keeps its checkpoints (tested with --stop_after
    and resumes elsewhere)."""
    out = tmp_path / "late"
    args = ["pretrain", f"--captions={tiny_world.captions_train}", f"--features={tiny_world.store}",
            "--model=visualbert-tiny", "--vocab_size=200", "--steps=2", "--batch_size=4", f"--out={out}",
            "--objectives=region_kl=1"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "no head for objective 'region_kl'" in err
    assert not out.exists()
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    assert run_cli(args, capsys)[0] == 2
    assert (out / "notes.txt").read_text() == "the user's"


def test_an_output_path_that_is_a_file_is_one_line(tiny_world, tmp_path, capsys):
    (tmp_path / "taken").write_text("a file")
    questions, annotations = tiny_world.vqa("test")
    preds = tmp_path / "p.json"
    preds.write_text(json.dumps([{"question_id": q["question_id"], "answer": "yes"}
                                 for q in json.loads(questions.read_text())["questions"]]))
    code, _, err = run_cli(["evaluate", "vqa", f"--predictions={preds}", f"--questions={questions}",
                            f"--annotations={annotations}", f"--out={tmp_path / 'taken'}"], capsys)
    assert code == 2 and str(tmp_path / "taken") in err and len(err.strip().splitlines()) == 1


def test_an_output_path_under_a_file_names_the_file_in_the_way(tiny_world, tmp_path, capsys):
    """`--out=notes.txt/run`: mkdir reports EEXIST (or ENOTDIR) naming only part of the path; the line says
    which file is in the way, for a new run directory, a world and a region store alike."""
    notes = tmp_path / "notes.txt"
    notes.write_text("a file")
    expected = f"error: {notes}: is a file, where the output path needs a folder"
    for args in (["pretrain", f"--captions={tiny_world.captions_train}", f"--features={tiny_world.store}",
                  "--model=visualbert-tiny", "--steps=2", "--batch_size=4", f"--out={notes / 'run'}"],
                 ["world", "build", "--out", str(notes / "world"), "--images", "5"],
                 ["extract", "--world", str(tiny_world.root), "--out", str(notes / "deep" / "x.h5")]):
        code, _, err = run_cli(args, capsys)
        assert code == 2 and err.strip() == expected, (args[0], err)


def test_world_build_out_that_is_a_file_says_so_and_keeps_the_file(tmp_path, capsys):
    """`world build --out notes.txt`: it said "already exists and is not empty (pass --overwrite to replace
    it)", which would not help (a world is a directory); the line says the path is a file."""
    notes = tmp_path / "notes.txt"
    notes.write_text("a file")
    code, _, err = run_cli(["world", "build", "--out", str(notes), "--images", "5"], capsys)
    assert code == 2 and err == f"error: {notes}: is a file, not a directory (a directory is written there)\n"
    assert notes.read_text() == "a file"


def test_a_partly_labelled_evaluation_file_is_an_error_before_training(tiny_world, tiny_pretrained, tmp_path, capsys):
    """A record without its label in a labelled evaluation file is bad input, found before training: an error
    naming it, or with --skip_bad dropped and counted, the rest scored. A file without labels is predicted."""
    lines = nlvr2_file(tiny_world, "test1").read_text().splitlines()
    partly = tmp_path / "test1.json"
    rec = json.loads(lines[3])
    rec.pop("label")
    partly.write_text("\n".join([*lines[:3], json.dumps(rec), *lines[4:]]) + "\n")
    out = tmp_path / "run"
    with pytest.raises(VlbertsError) as err:
        finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, out, eval_statements=str(partly), epochs=0.05))
    assert str(err.value) == f"{partly}: record {rec['identifier']}: no label, where the file's other records have one"
    assert not (out / "model").exists()  # before training
    finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, out, eval_statements=str(partly), epochs=0.05, skip_bad=True))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["skipped_records"]["missing label"] == 1 and metrics["num_examples"] == len(lines) - 1
    assert "accuracy" in metrics and len((out / "predictions.csv").read_text().splitlines()) == len(lines) - 1
    unlabelled = tmp_path / "hidden.json"
    unlabelled.write_text("".join(json.dumps({k: v for k, v in json.loads(x).items() if k != "label"}) + "\n"
                                  for x in lines))
    finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, tmp_path / "hidden", eval_statements=str(unlabelled),
                             epochs=0.05))
    assert "accuracy" not in json.loads((tmp_path / "hidden" / "metrics.json").read_text())


def test_on_off_options_also_take_a_value():
    assert _flags_with_values(["demo", "--quick=true", "--seed=1", "--vqa_epochs=2"]) == [
        "demo", "--quick", "--seed=1", "--vqa_epochs=2"]
    assert _flags_with_values(["demo", "--quick=false", "--out=x"]) == ["demo", "--out=x"]
    assert _flags_with_values(["world", "build", "--overwrite=yes", "--out=w"]) == ["world", "build", "--overwrite", "--out=w"]
    # run configs take --key=value as it is
    assert _flags_with_values(["finetune", "vqa", "--skip_bad=true"]) == ["finetune", "vqa", "--skip_bad=true"]


def test_show_config_lists_only_what_the_command_takes():
    """`vlberts show-config extract` listed --nms, --max_steps and --batch_images, which `vlberts extract` did not
    take ("No such option"), and --feature_dim=0, which it refused (min 1). Each command `show-config` describes
    that is not a run config (options declared one by one) now takes every setting, with the same default."""
    import importlib

    from vlberts.cli import SHOW

    commands = typer.main.get_command(cli_app).commands
    for name, module in SHOW.items():
        command = commands.get(name)
        if command is None or command.context_settings.get("allow_extra_args"):
            continue  # a run config: --key=value for every field
        params = {p.name: p for p in command.params}
        for f in dataclasses.fields(importlib.import_module(module).CONFIG_CLASS):
            assert f.name in params, (name, f.name)
            default = params[f.name].default
            assert default == f.default or (default is None and f.default == ""), (name, f.name, default, f.default)


def test_options_are_spelt_with_underscores_as_settings_are():
    """`vlberts show-config extract` prints `--max_boxes=36`, as run configs spell settings, but `vlberts extract
    --max_boxes 20` was "No such option" (typer's name is --max-boxes). Every option of every command that
    is not a run config now takes the underscore spelling too."""
    assert _flags_with_values(["extract", "--world", "w", "--max_boxes", "20", "--min_boxes=5", "--tsv=true"]) == [
        "extract", "--world", "w", "--max-boxes", "20", "--min-boxes=5", "--tsv"]
    checked = 0

    def walk(command, path):
        nonlocal checked
        for name, sub in getattr(command, "commands", {}).items():
            walk(sub, [*path, name])
        if hasattr(command, "commands") or command.context_settings.get("allow_extra_args"):
            return
        for p in command.params:
            for name in p.opts:
                if name.startswith("--") and "-" in name[2:]:
                    underscored = "--" + name[2:].replace("-", "_")
                    got = _flags_with_values([*path, f"{underscored}=1"])[len(path):]
                    kept = underscored if underscored in p.opts else name  # some declare both spellings
                    assert got == ([kept] if getattr(p, "is_flag", False) else [f"{kept}=1"]), (path, name, got)
                    checked += 1

    walk(typer.main.get_command(cli_app), [])
    assert checked > 10, checked


def test_a_shard_set_is_not_replaced_unless_asked_and_a_directory_is_not_a_file(tiny_world, tmp_path):
    index = write_shards(tiny_world.store, tiny_world.captions_train, tmp_path / "shards", shard_size=50)
    before = index.read_text()
    with pytest.raises(VlbertsError, match=r"a shard set shard-\* is already there \(pass --overwrite"):
        write_shards(tiny_world.store, None, tmp_path / "shards", shard_size=50)
    assert index.read_text() == before
    assert write_shards(tiny_world.store, None, tmp_path / "shards", shard_size=50, overwrite=True) == index
    with pytest.raises(VlbertsError, match="is a directory, expected a file"):
        read_json(tmp_path)



def test_compiling_on_a_cpu_without_a_cxx_compiler_is_one_line(tiny_world, tiny_pretrained, tmp_path, monkeypatch):
    """Inductor builds C++ on the CPU: with no compiler on PATH, pretrain and finetune say so before any
    work (it used to be a page of InductorError from the first update)."""
    monkeypatch.setenv("PATH", str(tmp_path / "no-tools-here"))
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(VlbertsError, match=r"--compile=true on the CPU needs a C\+\+ compiler"):
        pretrain(cfg_for(tiny_world, tmp_path / "pt", compile=True))
    with pytest.raises(VlbertsError, match=r"needs a C\+\+ compiler"):
        finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, tmp_path / "ft", compile=True))
    assert not (tmp_path / "pt").exists() and not (tmp_path / "ft").exists()


@pytest.mark.parametrize("text, message", [
    ("- 1\n- 2\n", "a config file must be a mapping of setting: value, got a list"),
    ("1: 2\n", "setting names must be strings, got 1"),
    ("just words\n", "a config file must be a mapping of setting: value, got a str"),
    ("lr: 0.001\nepochs: 2\nlr: 0.1\n", "malformed YAML: setting 'lr' given twice (line 3, column 1)"),
    ("lr: 0.001\nepochs: 2: 3\n", "malformed YAML: mapping values are not allowed here (line 2, column 10)"),
    ("batch_size: ten\n", "FinetuneVQAConfig.batch_size: expected an integer, got 'ten'"),
    ("batch_size: 8\nbatch-size: 16\n", "setting 'batch_size' given twice (as 'batch_size' and 'batch-size')"),
])
def test_a_config_file_that_is_not_a_mapping_of_names_is_one_line(text, message, tmp_path, capsys):
    """`--config=FILE` holding a list, a bare string or a number as a key was a TypeError traceback or a
    list of the string's letters as "unknown keys"; a setting given twice ran with the last value."""
    config = tmp_path / "run.yaml"
    config.write_text(text)
    code, _, err = run_cli(["finetune", "vqa", f"--config={config}", f"--out={tmp_path / 'run'}"], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{config}: {message}" in err


def test_show_config_takes_a_command_as_it_is_typed(capsys):
    """`vlberts show-config finetune vqa` (the command as a user types it) was an "unexpected extra argument";
    only `finetune-vqa` worked. Both forms print the same settings; an unknown command lists the valid ones."""
    outputs = []
    for words in (["finetune", "vqa"], ["finetune-vqa"], ["finetune", "flickr_entities"], ["analyze", "grounding"]):
        try:
            main(["show-config", *words])
            code = 0
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        assert code == 0 and err == "", (words, err)
        outputs.append(out)
    assert outputs[0] == outputs[1] and "--eval_questions=" in outputs[0]
    assert "--entities=" in outputs[2] and "--iou_rule=" in outputs[2] and "--token=last" in outputs[3]
    code, _, err = run_cli(["show-config", "finetune", "vqq"], capsys)
    assert code == 2 and "unknown command 'finetune-vqq'; valid: pretrain, finetune-vqa" in err


def test_a_config_file_reads_a_dash_in_a_setting_name_as_an_underscore(tmp_path):
    """The README: "`-` and `_` are the same in a key", on the command line and in a `--config` file (the
    file's `eval-questions:` was an unknown key)."""
    from vlberts.config import load_yaml
    from vlberts.recipes.finetune_vqa import FinetuneVQAConfig

    config = tmp_path / "run.yaml"
    config.write_text("eval-questions: q.json\nbatch-size: 8\nskip_bad: true\n")
    cfg = load_yaml(FinetuneVQAConfig, config)
    assert (cfg.eval_questions, cfg.batch_size, cfg.skip_bad) == ("q.json", 8, True)


def test_a_json_key_given_twice_is_an_error_naming_the_file_and_the_key(tmp_path):
    """Python's JSON reader keeps the last of two equal keys: a GQA questions file, a VCR predictions file
    or an NLVR2 image map with an id twice lost a record or swapped an answer without a word."""
    from vlberts.errors import BadRecords
    from vlberts.io import iter_jsonl

    questions = tmp_path / "questions.json"
    questions.write_text('{"q1": {"question": "Is it red?", "nested": {"a": 1, "b": 2}},\n'
                         ' "q2": {"question": "Is it blue?"},\n "q1": {"question": "Is it green?"}}')
    with pytest.raises(VlbertsError, match=r"questions\.json: key 'q1' appears twice in one JSON object"):
        read_json(questions)
    inner = tmp_path / "inner.json"
    inner.write_text('[{"id": 1, "answer": "yes", "answer": "no"}]')  # at any depth
    with pytest.raises(VlbertsError, match=r"inner\.json: key 'answer' appears twice"):
        read_json(inner)
    nested = tmp_path / "nested.json"
    nested.write_text('{"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}')  # one key in different objects is fine
    assert read_json(nested) == {"a": {"a": 1}, "b": [{"a": 2}, {"a": 3}]}

    lines = tmp_path / "records.jsonl"
    lines.write_text('{"annot_id": "val-0"}\n{"annot_id": "val-1", "annot_id": "val-2"}\n{"annot_id": "val-3"}\n')
    with pytest.raises(VlbertsError, match=r"records\.jsonl: record line 2: key 'annot_id' appears twice"):
        list(iter_jsonl(lines))
    bad = BadRecords(skip=True)  # --skip_bad drops the line and counts it
    assert [rec["annot_id"] for _, rec in iter_jsonl(lines, bad)] == ["val-0", "val-3"] and bad.total == 1
    # VCR's fine-tuning reader parses its lines itself: the same rule there
    from vlberts.recipes.finetune_vcr import read_vcr_file

    vcr = tmp_path / "val.jsonl"
    vcr.write_text('\n{"annot_id": "val-1", "annot_id": "val-2"}\n')
    with pytest.raises(VlbertsError, match=r"val\.jsonl: record line 2: key 'annot_id' appears twice"):
        read_vcr_file(vcr, BadRecords(), require_labels=False)


def test_negative_seeds_are_refused_before_anything_runs(tmp_path, capsys):
    # numpy's generators take non-negative seeds only: a negative one was a traceback mid-run
    code, _, err = run_cli(["pretrain", f"--out={tmp_path / 'run'}", "--seed=-1"], capsys)
    assert code == 2 and "PretrainConfig.seed: must be at least 0, got -1" in err and len(err.strip().splitlines()) == 1
    from vlberts.recipes.compare import CompareConfig, seed_list

    with pytest.raises(VlbertsError, match="--seeds must name non-negative seeds, got '1,-3'"):
        seed_list(CompareConfig(seeds="1,-3"))


def test_an_error_quoting_a_huge_value_stays_a_readable_line(tmp_path, capsys):
    """A reader's message quotes the bad value; a megabyte-long one (an answer, a CSV header) made a
    megabyte-long "line". The middle is left out and counted, the start and the end kept."""
    from vlberts.errors import MAX_MESSAGE

    err = VlbertsError(f"answer must be a string, got {['x' * 1_000_000]!r}", path="p.json", record="[3]")
    text = str(err)
    assert len(text) < MAX_MESSAGE + 40 and "\n" not in text
    assert text.startswith("p.json: record [3]: answer must be a string, got ['xxx") and text.endswith("xxx']")
    assert re.search(r" \.\.\.\(9\d\d,\d{3} characters left out\)\.\.\. ", text)
    assert str(VlbertsError("short")) == "short"
    # through a command: the official VQA evaluation of a predictions file with such an answer
    preds = tmp_path / "preds.json"
    preds.write_text(json.dumps([{"question_id": 1, "answer": ["x" * 1_000_000]}]))
    (tmp_path / "q.json").write_text(json.dumps({"questions": [{"question_id": 1, "image_id": 1, "question": "what?"}]}))
    (tmp_path / "a.json").write_text(json.dumps({"annotations": [{
        "question_id": 1, "image_id": 1, "multiple_choice_answer": "red", "answer_type": "other",
        "question_type": "what", "answers": [{"answer": "red", "answer_id": k + 1} for k in range(10)]}]}))
    code, _, err = run_cli(["evaluate", "vqa", f"--predictions={preds}", f"--questions={tmp_path / 'q.json'}",
                            f"--annotations={tmp_path / 'a.json'}", f"--out={tmp_path / 'e'}"], capsys)
    assert code == 2 and len(err) < MAX_MESSAGE + 200 and err.count("\n") == 1 and "characters left out" in err


def test_a_killed_writers_temporaries_are_removed_when_the_path_is_written_again(tmp_path):
    """`io.atomic_path` / `atomic_dir`: a writer killed mid-write left `.NAME.*.tmp` beside its target for good
    (a store-sized `.features.h5.*.tmp`, half a world directory), swept only inside checkpoints/. Temporaries
    now carry their writer's pid and machine, and the next writer of the same path removes those of a dead
    process on this machine; a live writer's, another machine's and foreign names stay."""
    import subprocess
    import sys

    from vlberts.io import _HOST, atomic_dir, atomic_open

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale_file = tmp_path / f".out.json.{dead}@{_HOST}-abc123.tmp"
    stale_file.write_text("half")
    stale_dir = tmp_path / f".world.{dead}@{_HOST}-def456.tmp"
    (stale_dir / "images").mkdir(parents=True)
    kept = [tmp_path / f".out.json.{os.getpid()}@{_HOST}-live.tmp",  # a live writer (this process)
            tmp_path / f".out.json.{dead}@00000000-other.tmp",  # another machine's
            tmp_path / ".out.json.xyz.tmp"]  # not ours
    for p in kept:
        p.write_text("keep")
    with atomic_open(tmp_path / "out.json") as f:
        f.write("{}")
    with atomic_dir(tmp_path / "world") as d:
        (d / "a").write_text("x")
    assert not stale_file.exists() and not stale_dir.exists()
    assert all(p.exists() for p in kept) and (tmp_path / "out.json").read_text() == "{}"


def test_ctrl_c_says_how_to_go_on(tiny_world, tmp_path, capsys, monkeypatch):
    """Ctrl-C ended any command with exit status 130 and not a word (typer's way); it now says that the same
    command continues a training run."""
    import vlberts.recipes.pretrain as recipe

    def interrupted(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(recipe, "pretrain", interrupted)
    code, _, err = run_cli(["pretrain", f"--captions={tiny_world.captions_train}", f"--features={tiny_world.store}",
                            f"--out={tmp_path / 'run'}"], capsys)
    assert code == 130
    assert err.strip() == "interrupted: the same command again continues a training run from its last checkpoint"
