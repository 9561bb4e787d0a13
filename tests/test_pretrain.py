"""VisualBERT pre-training recipe on the tiny world: losses fall, checkpoints resume exactly, the
metrics log of a resumed run equals an uninterrupted one, bad settings and data are one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlberts.errors import VlbertsError
from vlberts.models.blocks import DEFAULT_ATTENTION_KERNEL
from vlberts.recipes.pretrain import PretrainConfig, pretrain
from vlberts.training import loop
from vlberts.training.checkpoint import latest_checkpoint, load_pretraining_model
from vlberts.training.loop import loss_scaler, scaler_state, update
from vlberts.training.metrics import MetricsLog
from vlberts.training.optim import build_optimizer, linear_warmup_decay

VLBERTS = Path(sys.executable).with_name("vlberts")


def cfg_for(world, out: Path, **kw) -> PretrainConfig:
    base = dict(
        captions=str(world.captions_train), features=str(world.store), out=str(out), model="visualbert-tiny",
        vocab_size=200, steps=8, batch_size=4, lr=1e-3, warmup=0.25, log_every=1, ckpt_every=3, seed=1,
        max_text_len=40,
    )
    base.update(kw)
    return PretrainConfig(**base)


def test_interrupted_run_resumes_exactly(tiny_world, tmp_path):
    # Uninterrupted reference run.
    ref = tmp_path / "ref"
    final = pretrain(cfg_for(tiny_world, ref))
    assert final == ref / "model"
    ref_log = MetricsLog.read(ref / "metrics.jsonl")
    assert [r["step"] for r in ref_log] == list(range(1, 9))

    # Interrupted after 5 updates: the last checkpoint is at step 3, so steps 4-5 are redone on resume.
    run = tmp_path / "run"
    assert pretrain(cfg_for(tiny_world, run, stop_after=5)) is None
    assert latest_checkpoint(run).name == "step_00000003"
    assert pretrain(cfg_for(tiny_world, run)) == run / "model"
    log = MetricsLog.read(run / "metrics.jsonl")

    assert [r["step"] for r in log] == list(range(1, 9))
    for a, b in zip(ref_log, log):
        assert a["mlm_loss"] == b["mlm_loss"] and a["match_loss"] == b["match_loss"] and a["lr"] == b["lr"]
    wa, wb = load_file(str(ref / "model" / "model.safetensors")), load_file(str(run / "model" / "model.safetensors"))
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_torn_last_log_record_is_dropped_on_resume(tiny_world, tmp_path):
    """Killed while appending a record, a run leaves a torn last line in metrics.jsonl; resuming drops it
    (its step is after the last checkpoint) and the log ends as the uninterrupted run's."""
    ref = tmp_path / "ref"
    pretrain(cfg_for(tiny_world, ref))
    run = tmp_path / "run"
    assert pretrain(cfg_for(tiny_world, run, stop_after=5)) is None
    with open(run / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 6, "loss": 3.')  # the append cut short
    assert [r["step"] for r in MetricsLog.read(run / "metrics.jsonl")] == [1, 2, 3, 4, 5]  # reading skips it
    assert pretrain(cfg_for(tiny_world, run)) == run / "model"
    untimed = [{k: v for k, v in r.items() if k != "seconds"} for r in MetricsLog.read(run / "metrics.jsonl")]
    assert untimed == [{k: v for k, v in r.items() if k != "seconds"} for r in MetricsLog.read(ref / "metrics.jsonl")]


@pytest.mark.parametrize("text, line", [('{"step": 1}\n{"step": 2, "lo\n{"step": 3}\n', 2),
                                        ('{"step": 1}\n[2]\n', 2), ('{"loss": 1.0}\n', 1)])
def test_a_bad_log_line_before_the_last_is_an_error_naming_it(tmp_path, text, line):
    path = tmp_path / "metrics.jsonl"
    path.write_text(text)
    with pytest.raises(VlbertsError, match=rf"metrics.jsonl: line {line} is not"):
        MetricsLog(path, resume_step=1)


def test_zero_steps_writes_the_untrained_network_for_the_no_pretraining_control(tiny_world, tmp_path):
    """`--steps=0`: the model directory of the network as the seed initialises it (no update, no checkpoint),
    with the run's vocabulary, so every `finetune TASK --init` reads it as the no-pre-training control."""
    a = pretrain(cfg_for(tiny_world, tmp_path / "a", steps=0))
    b = pretrain(cfg_for(tiny_world, tmp_path / "b", steps=0))
    trained = pretrain(cfg_for(tiny_world, tmp_path / "t", steps=2))
    assert a == tmp_path / "a" / "model" and json.loads((a / "config.json").read_text())["steps"] == 0
    assert not (tmp_path / "a" / "checkpoints").exists() or not any((tmp_path / "a" / "checkpoints").iterdir())
    assert (a / "vocab.txt").read_text() == (trained / "vocab.txt").read_text()
    wa, wb, wt = (load_file(str(d / "model.safetensors")) for d in (a, b, trained))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)  # the seed's initialisation, reproducibly
    assert any(not torch.equal(wa[k], wt[k]) for k in wa)  # and not a trained network
    model, _, _ = load_pretraining_model(a)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_model_directory_is_finished_only_when_config_json_is_there(tiny_world, tmp_path, monkeypatch):
    """A continued demo or comparison keeps a pre-training whose model/config.json exists, so config.json is
    the last file written: interrupted while the final directory is written (here in its tokenizer files),
    the run leaves no config.json, and the same command then finishes the directory."""
    from vlberts.text.tokenizer import TextTokenizer

    out = tmp_path / "run"
    real_save = TextTokenizer.save

    def interrupted(self, directory):
        if Path(directory) == out / "model":
            raise KeyboardInterrupt
        real_save(self, directory)

    monkeypatch.setattr(TextTokenizer, "save", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pretrain(cfg_for(tiny_world, out))
    assert not (out / "model" / "config.json").exists()
    monkeypatch.setattr(TextTokenizer, "save", real_save)
    assert pretrain(cfg_for(tiny_world, out)) == out / "model"
    assert {"vocab.txt", "tokenizer_config.json", "model.safetensors", "config.json"} <= {
        p.name for p in (out / "model").iterdir()}
    assert [r["step"] for r in MetricsLog.read(out / "metrics.jsonl")] == list(range(1, 9))  # nothing trained twice


def test_resume_refuses_changed_settings(tiny_world, tmp_path):
    run = tmp_path / "run"
    pretrain(cfg_for(tiny_world, run, stop_after=4))
    with pytest.raises(VlbertsError, match=r"different settings \(lr 0.001 -> 0.0005\)"):
        pretrain(cfg_for(tiny_world, run, lr=5e-4))
    with pytest.raises(VlbertsError, match="different settings.*precision 'auto' -> 'bf16'"):
        pretrain(cfg_for(tiny_world, run, precision="bf16"))  # auto is fp32 on the CPU: another arithmetic


def test_resume_accepts_the_same_run_named_otherwise(tiny_world, tmp_path, monkeypatch):
    """Settings that change no number may change on resume: the run directory named by a relative path
    and then an absolute one, an input file through a link, --device=auto and the CPU it picks here,
    --precision=auto and fp32, and the loader's worker processes (each example has its own random
    stream). The resumed run equals the uninterrupted one bit for bit."""
    ref = tmp_path / "ref"
    pretrain(cfg_for(tiny_world, ref))
    monkeypatch.chdir(tmp_path)
    pretrain(cfg_for(tiny_world, Path("run"), stop_after=5, device="auto", precision="auto", num_workers=0))
    (tmp_path / "captions.json").symlink_to(tiny_world.captions_train)
    run = tmp_path / "run"
    pretrain(cfg_for(tiny_world, run, captions=str(tmp_path / "captions.json"), device="cpu", precision="fp32",
                     num_workers=2))
    wa, wb = load_file(str(ref / "model" / "model.safetensors")), load_file(str(run / "model" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [r["mlm_loss"] for r in MetricsLog.read(run / "metrics.jsonl")] == \
        [r["mlm_loss"] for r in MetricsLog.read(ref / "metrics.jsonl")]


def test_a_run_recorded_before_a_setting_existed_resumes_with_its_default(tiny_world, tmp_path):
    """A run started by an older vlberts has no record of settings added since: their defaults are what
    it ran with, so it resumes; another value is a change."""
    run = tmp_path / "run"
    pretrain(cfg_for(tiny_world, run, stop_after=4))
    record = json.loads((run / "run_config.json").read_text())
    del record["static_shapes"]
    (run / "run_config.json").write_text(json.dumps(record))
    with pytest.raises(VlbertsError, match="static_shapes None -> True"):
        pretrain(cfg_for(tiny_world, run, static_shapes=True))
    assert pretrain(cfg_for(tiny_world, run)) == run / "model"


def test_a_file_based_run_may_change_its_loader_workers_on_resume(tmp_path):
    """A file-based run may change its workers on resume (they change no number); a streamed run may not
    (tests/test_pretrain_stream.py: each worker reads its own stream)."""
    from dataclasses import dataclass

    @dataclass
    class Run:
        captions: str = "captions.json"
        num_workers: int = 0

    (tmp_path / "run_config.json").write_text(json.dumps({"captions": "captions.json", "num_workers": 0}))  # the start's
    loop.check_same_run(tmp_path, Run())
    loop.check_same_run(tmp_path, Run(num_workers=2))


def test_losses_fall_and_model_directory_loads(tiny_world, tmp_path):
    out = tmp_path / "pt"
    pretrain(cfg_for(tiny_world, out, steps=80, batch_size=16, log_every=5, ckpt_every=100, lr=2e-3))
    log = MetricsLog.read(out / "metrics.jsonl")
    assert log[-1]["mlm_loss"] < 0.8 * log[0]["mlm_loss"]
    model, cfg, meta = load_pretraining_model(out / "model")
    assert cfg.num_layers == 2 and meta["steps"] == 80 and meta["arch"] == "visualbert"
    assert (out / "model" / "vocab.txt").is_file()
    assert json.loads((out / "run_config.json").read_text())["steps"] == 80


@pytest.mark.parametrize("arch", ["visualbert-tiny", "vlbert-tiny", "vilbert-tiny", "lxmert-tiny", "wvisualbert-tiny"])
def test_a_loaded_model_skips_its_random_initialisation_and_equals_the_saved_one(arch, tmp_path, monkeypatch):
    """`load_pretraining_model` builds with `initialise=False` (every tensor is loaded next, strictly): no
    random number is drawn, `torch.nn.init` is restored afterwards (also when building fails), and every
    tensor equals the saved model's, for every architecture."""
    from vlberts.models import builders
    from vlberts.training.checkpoint import save_model_dir

    cfg = builders.model_config(arch, vocab_size=50, visual_dim=16)
    torch.manual_seed(3)
    saved = builders.build_pretraining_model(cfg)
    save_model_dir(tmp_path / "m", saved, cfg)
    rng = torch.get_rng_state()
    inits = {name: getattr(torch.nn.init, name) for name in builders._INIT_FUNCTIONS}
    model, _, _ = load_pretraining_model(tmp_path / "m")
    assert torch.equal(torch.get_rng_state(), rng)  # nothing drawn
    assert {name: getattr(torch.nn.init, name) for name in inits} == inits
    want = saved.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items())
    def fails(cfg):
        raise RuntimeError("building failed")

    kind = builders.arch_of(cfg)
    with monkeypatch.context() as m:
        m.setitem(builders.ARCHS, kind, (builders.ARCHS[kind][0], fails))
        with pytest.raises(RuntimeError, match="building failed"):
            builders.build_pretraining_model(cfg, initialise=False)
    assert {name: getattr(torch.nn.init, name) for name in inits} == inits
    # Built as usual, the model draws its initial values.
    builders.build_pretraining_model(cfg)
    assert not torch.equal(torch.get_rng_state(), rng)


def test_gradient_accumulation_runs_and_counts_updates(tiny_world, tmp_path):
    out = tmp_path / "acc"
    pretrain(cfg_for(tiny_world, out, steps=3, batch_size=2, grad_accum=2, ckpt_every=100))
    assert [r["step"] for r in MetricsLog.read(out / "metrics.jsonl")] == [1, 2, 3]


def test_accumulation_splits_make_the_same_update(tiny_world, tmp_path, monkeypatch):
    """1 x 4 and 4 x 1 (batch x micro-batches): the same examples, so the same losses and gradients, although
    the micro-batches hold different numbers of masked words (each weighs by its share of the update's)."""
    from vlberts.models import builders

    monkeypatch.setitem(builders.MODEL_CONFIGS, "visualbert-tiny-nodrop",
                        lambda **kw: builders.visualbert_tiny(hidden_dropout=0.0, attention_dropout=0.0, **kw))
    logs = {}
    for name, bs, acc in (("4x1", 4, 1), ("1x4", 1, 4), ("2x2", 2, 2)):
        out = tmp_path / name
        pretrain(cfg_for(tiny_world, out, model="visualbert-tiny-nodrop", steps=3, batch_size=bs, grad_accum=acc,
                         ckpt_every=100))
        logs[name] = MetricsLog.read(out / "metrics.jsonl")
    for name in ("1x4", "2x2"):
        for a, b in zip(logs["4x1"], logs[name], strict=True):
            for key in ("mlm_loss", "match_loss", "grad_norm"):
                assert b[key] == pytest.approx(a[key], rel=1e-4), (name, a["step"], key)


def test_accumulation_splits_make_the_same_update_with_text_only_samples(tiny_world, tmp_path, monkeypatch):
    """With --text_corpus the captions' and the documents' masked words are two means (`mlm`, `mlm_text`), each
    over its own rows of the whole update, however the update is split into micro-batches."""
    from vlberts.models import builders

    monkeypatch.setitem(builders.MODEL_CONFIGS, "visualbert-tiny-nodrop",
                        lambda **kw: builders.visualbert_tiny(hidden_dropout=0.0, attention_dropout=0.0, **kw))
    logs = {}
    for name, bs, acc in (("4x1", 4, 1), ("2x2", 2, 2)):
        out = tmp_path / name
        pretrain(cfg_for(tiny_world, out, model="visualbert-tiny-nodrop", steps=3, batch_size=bs, grad_accum=acc,
                         ckpt_every=100, text_corpus=str(tiny_world.root / "text" / "documents.txt")))
        logs[name] = MetricsLog.read(out / "metrics.jsonl")
    for a, b in zip(logs["4x1"], logs["2x2"], strict=True):
        for key in ("mlm_loss", "mlm_text_loss", "match_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), (a["step"], key)


def test_task_specific_single_caption_mode(tiny_world, tmp_path):
    out = tmp_path / "mlm"
    pretrain(cfg_for(tiny_world, out, steps=2, pairs=False, ckpt_every=100))
    assert all(r["match_loss"] == 0.0 for r in MetricsLog.read(out / "metrics.jsonl"))


def test_unknown_model_name_lists_the_valid_ones(tiny_world, tmp_path):
    with pytest.raises(VlbertsError, match="unknown model 'visualbert-huge'; valid: visualbert-base"):
        pretrain(cfg_for(tiny_world, tmp_path / "x", model="visualbert-huge"))


def test_cli_pretrain_bad_override_and_missing_image(tiny_world, tmp_path):
    proc = subprocess.run([str(VLBERTS), "pretrain", "--stepz=3"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "unknown key(s) stepz" in proc.stderr and "Traceback" not in proc.stderr

    # A captions file naming an image the store lacks.
    caps = json.loads(tiny_world.captions_train.read_text())
    caps["images"].append({**caps["images"][0], "id": 999999})
    caps["annotations"][0]["image_id"] = 999999
    bad = tmp_path / "captions.json"
    bad.write_text(json.dumps(caps))
    out = tmp_path / "run"
    proc = subprocess.run(
        [str(VLBERTS), "pretrain", f"--captions={bad}", f"--features={tiny_world.store}", f"--out={out}",
         "--model=visualbert-tiny", "--steps=1"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"{tiny_world.store}: record 999999: image id 999999 of {bad} not in store (1 sentences of that file" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (out / "model").exists()
    # Several files, comma-separated (VisualBERT's task pre-training on train + val): the missing image's file named
    val = json.loads(Path(str(tiny_world.captions_train).replace("train", "val")).read_text())
    val["images"].append({**val["images"][0], "id": 999999})
    val["annotations"][0]["image_id"] = 999999
    bad = tmp_path / "captions_val.json"
    bad.write_text(json.dumps(val))
    proc = subprocess.run(
        [str(VLBERTS), "pretrain", f"--captions={tiny_world.captions_train},{bad}", f"--features={tiny_world.store}",
         f"--out={out}", "--model=visualbert-tiny", "--steps=1"], capture_output=True, text=True)
    assert proc.returncode == 2 and f"image id 999999 of {bad} not in store (1 sentences of that file" in proc.stderr


def test_several_captions_files_are_read_one_after_the_other(tiny_world, tmp_path, monkeypatch):
    from vlberts.data.task_texts import task_caption_refs
    from vlberts.recipes import pretrain as recipe

    seen = []
    monkeypatch.setattr(recipe, "require_images", lambda sentences, sources, store: seen.append((sentences, sources)))
    one = task_caption_refs(tiny_world.captions_train)
    train, val = str(tiny_world.captions_train), str(tiny_world.captions_train).replace("train", "val")
    other = task_caption_refs(val)
    pretrain(cfg_for(tiny_world, tmp_path / "two", captions=f"{train},{val}", steps=1))
    (sentences, sources), = seen
    assert sources == [(train, len(one)), (val, len(other))] and sentences == one + other
    # A file twice, or the same images in two files (COCO's file and its Karpathy one): one line, not twice the data
    with pytest.raises(VlbertsError, match=rf"{train}: named twice in --captions"):
        pretrain(cfg_for(tiny_world, tmp_path / "twice", captions=f"{train},{train}", steps=1))
    data = json.loads(Path(val).read_text())
    overlap = tmp_path / "overlap.json"
    image = json.loads(Path(train).read_text())["images"][0]  # a train image, captioned in the val file too
    overlap.write_text(json.dumps({**data, "images": data["images"] + [image], "annotations": data["annotations"] + [
        {"id": 10 ** 9, "image_id": image["id"], "caption": "a caption of a train image"}]}))
    with pytest.raises(VlbertsError, match=rf"{overlap}: image \S+ is also in {train}: its captions would be trained"):
        pretrain(cfg_for(tiny_world, tmp_path / "overlap", captions=f"{train},{overlap}", steps=1))


def test_cli_pretrain_runs_and_help_lists_settings(tiny_world, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [str(VLBERTS), "pretrain", f"--captions={tiny_world.captions_train}", f"--features={tiny_world.store}",
         f"--out={out}", "--model=visualbert-tiny", "--steps=2", "--batch_size=4", "--vocab_size=200"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out / 'model'}" in proc.stdout
    show = subprocess.run([str(VLBERTS), "show-config", "pretrain"], capture_output=True, text=True)
    assert show.returncode == 0 and "--grad_accum=1" in show.stdout and "--mlm_prob=0.15" in show.stdout
    default_kernels = ",".join(DEFAULT_ATTENTION_KERNEL)  # efficient,flash where torch takes an order
    assert f"--attention_kernel={default_kernels}:" in show.stdout and "--mlm_word_probs=:" in show.stdout  # lists as the flag takes them


def test_word_probs_must_be_single_tokens_with_a_probability(tmp_path):
    from vlberts.recipes.pretrain import token_probs
    from vlberts.text.tokenizer import TextTokenizer

    tok = TextTokenizer.train(["a red circle", "two blue squares"], vocab_size=100)
    assert token_probs(tok, ("red=0.3", "squares=0.7")) == {tok.encode("red")[0]: 0.3, tok.encode("squares")[0]: 0.7}
    with pytest.raises(VlbertsError, match="'zebra' is not a single token"):
        token_probs(tok, ("zebra=0.5",))
    for bad in ("red", "red=", "red=1.5", "=0.3", "red=x"):
        with pytest.raises(VlbertsError, match="expected word=probability"):
            token_probs(tok, (bad,))


def test_length_grouped_run_resumes_exactly(tiny_world, tmp_path):
    ref = tmp_path / "ref"
    pretrain(cfg_for(tiny_world, ref, length_group=4))
    run = tmp_path / "run"
    assert pretrain(cfg_for(tiny_world, run, length_group=4, stop_after=5)) is None
    pretrain(cfg_for(tiny_world, run, length_group=4))
    a, b = MetricsLog.read(ref / "metrics.jsonl"), MetricsLog.read(run / "metrics.jsonl")
    assert [r["mlm_loss"] for r in a] == [r["mlm_loss"] for r in b]
    plain = MetricsLog.read(Path(pretrain(cfg_for(tiny_world, tmp_path / "plain"))).parent / "metrics.jsonl")
    assert [r["mlm_loss"] for r in plain] != [r["mlm_loss"] for r in a]  # grouping changed the batches


def test_fp16_skips_overflowing_updates_and_resumes_exactly(tiny_world, tmp_path, monkeypatch):
    """`--precision=fp16`: autocast to fp16 with dynamic loss scaling. With a first scale too large for fp16,
    the first updates overflow: each is skipped (the weights stay, its gradient norm is not finite) and
    halves the scale, until updates go through. A run interrupted after the scale changed resumes with the
    checkpoint's scale: the same log and weights as the uninterrupted run."""
    monkeypatch.setattr(loop, "FP16_INIT_SCALE", 2.0**24)
    ref = tmp_path / "ref"
    pretrain(cfg_for(tiny_world, ref, steps=12, precision="fp16"))
    log = MetricsLog.read(ref / "metrics.jsonl")
    scales = [r["loss_scale"] for r in log]
    skipped = [r["grad_norm"] is None for r in log]  # a NaN norm is written as null
    assert scales[0] == 2.0**23 and skipped[0] and not skipped[-1]
    assert all(b == a / 2 if s else b == a for a, b, s in zip([2.0**24, *scales], scales, skipped))
    assert sum(skipped) >= 3 and scales[2] < 2.0**22  # the checkpoint at update 3 holds a changed scale
    # The same arithmetic as fp32 up to fp16's rounding: the first update's loss (same weights, same batch).
    fp32 = tmp_path / "fp32"
    pretrain(cfg_for(tiny_world, fp32, steps=1))
    assert log[0]["mlm_loss"] == pytest.approx(MetricsLog.read(fp32 / "metrics.jsonl")[0]["mlm_loss"], rel=1e-3)

    run = tmp_path / "run"
    assert pretrain(cfg_for(tiny_world, run, steps=12, precision="fp16", stop_after=5)) is None
    assert pretrain(cfg_for(tiny_world, run, steps=12, precision="fp16")) == run / "model"
    again = MetricsLog.read(run / "metrics.jsonl")
    assert [(r["loss_scale"], r["mlm_loss"]) for r in again] == [(r["loss_scale"], r["mlm_loss"]) for r in log]
    wa, wb = load_file(str(ref / "model" / "model.safetensors")), load_file(str(run / "model" / "model.safetensors"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_a_skipped_fp16_update_leaves_the_weights_and_halves_the_scale():
    model = torch.nn.Linear(4, 2)
    optimizer = build_optimizer(model, 1e-2)
    scheduler = linear_warmup_decay(optimizer, 0, 10)
    scaler = loss_scaler(torch.device("cpu"), "fp16")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    model.weight.grad[0, 0] = float("inf")
    update(model, optimizer, scheduler, clip=1.0, scaler=scaler)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert scaler.get_scale() == loop.FP16_INIT_SCALE / 2
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    update(model, optimizer, scheduler, clip=1.0, scaler=scaler)
    assert not torch.equal(model.weight, before["weight"]) and scaler.get_scale() == loop.FP16_INIT_SCALE / 2
    # Other precisions: a disabled scaler, nothing kept in checkpoints; FSDP refuses fp16 in one line.
    assert not loss_scaler(torch.device("cpu"), "bf16").is_enabled()
    assert scaler_state(loss_scaler(torch.device("cpu"), "fp32")) == {}
    with pytest.raises(VlbertsError, match="fp16 with --fsdp=true is not supported"):
        loss_scaler(torch.device("cpu"), "fp16", sharded=True)


def test_tensorboard_mirrors_the_log_and_a_resumed_run_purges_the_redone_steps(tiny_world, tmp_path):
    """`--tensorboard=true`: every numeric field of the JSONL log as a scalar at its step. Interrupted after
    update 5 (checkpoint at 3) and resumed, TensorBoard shows each update once, with the resumed values,
    as the JSONL log does."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert pretrain(cfg_for(tiny_world, run, stop_after=5, tensorboard=True)) is None
    pretrain(cfg_for(tiny_world, run, tensorboard=True))
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per invocation
    board = EventAccumulator(str(run / "tensorboard"))
    board.Reload()
    log = MetricsLog.read(run / "metrics.jsonl")
    assert {"loss", "mlm_loss", "match_loss", "lr", "grad_norm", "seconds"} <= set(board.Tags()["scalars"])
    for key in ("mlm_loss", "lr", "grad_norm"):
        events = board.Scalars(key)
        assert [e.step for e in events] == [r["step"] for r in log] == list(range(1, 9))
        assert [e.value for e in events] == pytest.approx([r[key] for r in log], rel=1e-6)  # stored as float32
    # A fresh run (no checkpoint in its --out) starts a fresh board, as it starts a fresh JSONL log.
    fresh = tmp_path / "fresh"
    (fresh / "tensorboard").mkdir(parents=True)
    (fresh / "tensorboard" / "events.out.tfevents.0.stale").write_bytes(b"")
    pretrain(cfg_for(tiny_world, fresh, steps=2, tensorboard=True))
    assert [p.name for p in (fresh / "tensorboard").iterdir()] != [] and not (fresh / "tensorboard" / "events.out.tfevents.0.stale").exists()


def test_tensorboard_without_the_package_is_a_one_line_error(tiny_world, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(VlbertsError, match=r"needs the tensorboard package: pip install 'vlberts\[tensorboard\]'"):
        pretrain(cfg_for(tiny_world, tmp_path / "run", tensorboard=True))


def test_a_resume_refuses_other_data_at_the_same_paths(tiny_world, tmp_path):
    """A run resumed on other data under the same names (a captions file rewritten, a store of another detector or
    of other images) used to go on from its checkpoint silently: the fingerprints of what it started with
    (OUT/data_record.json) are compared, and a difference names the setting and the file."""
    import shutil

    from vlberts.features.importers import export_tsv, import_features

    caps, store = tmp_path / "captions.json", tmp_path / "features.h5"
    shutil.copy(tiny_world.captions_train, caps)
    shutil.copy(tiny_world.store, store)
    run = tmp_path / "run"
    cfg = cfg_for(tiny_world, run, captions=str(caps), features=str(store), stop_after=4)
    assert pretrain(cfg) is None
    record = json.loads((run / "data_record.json").read_text())
    assert set(record) == {"captions", "features"} and record["features"]["images"] > 0

    data = json.loads(caps.read_text())
    caps.write_text(json.dumps({**data, "annotations": data["annotations"][:-1]}))  # one caption fewer
    with pytest.raises(VlbertsError, match=rf"^{caps}: --captions: its contents differ from those this run started "
                                           r"with \(the same path, other data; data_record.json"):
        pretrain(cfg)
    shutil.copy(tiny_world.captions_train, caps)  # put back: the run goes on

    export_tsv(tiny_world.store, tmp_path / "same.tsv", "lxmert-tsv")  # the same boxes, another store (an import)
    store.unlink()
    import_features(tmp_path / "same.tsv", "lxmert-tsv", store)
    with pytest.raises(VlbertsError, match=rf"^{store}: --features: its features or images differ"):
        pretrain(cfg)
    shutil.copy(tiny_world.store, store)
    assert pretrain(cfg_for(tiny_world, run, captions=str(caps), features=str(store))) is not None


def test_continued_pre_training_on_other_features_is_warned_of(tiny_world, tmp_path, capsys):
    """`pretrain --init` on a store of another extractor (here the same boxes re-imported from a TSV) says so in
    one warning line, as fine-tuning does; the new model records only the store it was given."""
    from vlberts.features.importers import export_tsv, import_features

    first = pretrain(cfg_for(tiny_world, tmp_path / "a", steps=2))
    export_tsv(tiny_world.store, tmp_path / "same.tsv", "lxmert-tsv")
    import_features(tmp_path / "same.tsv", "lxmert-tsv", tmp_path / "other.h5")
    capsys.readouterr()
    pretrain(cfg_for(tiny_world, tmp_path / "b", steps=2, init=str(first), features=str(tmp_path / "other.h5")))
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1 and "features" in err.split("warning: ")[1].splitlines()[0]
    capsys.readouterr()
    pretrain(cfg_for(tiny_world, tmp_path / "c", steps=2, init=str(first)))  # the same store: nothing said
    assert "warning" not in capsys.readouterr().err
    # --model naming another size of the same architecture would be ignored for --init's: refused
    with pytest.raises(VlbertsError, match=r"--model=visualbert-base is not the model --init holds \(hidden_size "):
        pretrain(cfg_for(tiny_world, tmp_path / "d", steps=2, init=str(first), model="visualbert-base"))
