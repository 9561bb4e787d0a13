"""FSDP (`--fsdp=true`, training/distributed.py `shard_model`) with 2 CPU processes (gloo): the sharded update
is the single-process update, checkpoints are gathered whole (the same files as an unsharded run's) and
resume with or without FSDP, and a sharded run resumes exactly; evaluation after sharded training
predicts each rank's slice with any number of batches, and BertAdam with per-tensor clipping updates as one
process does. Also: one process with --fsdp=true warns and trains unsharded, and torchrun's in-place
`--max-restarts` restart after a killed rank resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from test_distributed import (
    TORCHRUN,
    VLBERTS,
    _global_batch,
    _kill_processes_of,
    _loss,
    _model,
    _pretrain_args,
    _torchrun,
    _workers_of,
)

from vlberts.data.batch import VLInputs
from vlberts.models.builders import build_pretraining_model, model_config
from vlberts.training.checkpoint import TrainState, restore_checkpoint, save_checkpoint
import vlberts.training.distributed as distributed
from vlberts.training.distributed import (
    free_port,
    full_tensor,
    gather_for_inference,
    init_distributed,
    is_sharded,
    leave_process_group,
    rank_slice,
    GradientSync,
    shard_model,
)
from vlberts.training.loop import loss_shares, update
from vlberts.training.metrics import MetricsLog
from vlberts.training.optim import build_optimizer, linear_warmup_decay

try:
    from torch.distributed.fsdp import fully_shard  # noqa: F401  FSDP2

    HAVE_FSDP2 = True
except ImportError:
    HAVE_FSDP2 = False

needs_fsdp = pytest.mark.skipif(not HAVE_FSDP2, reason="torch.distributed.fsdp.fully_shard (FSDP2) missing")
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists() or not HAVE_FSDP2, reason="torchrun or FSDP2 missing")
CFG = model_config("visualbert-tiny", hidden_dropout=0.0, attention_dropout=0.0)


def _trainer(model):
    optimizer = build_optimizer(model, 1e-3)
    return optimizer, linear_warmup_decay(optimizer, 1, 10)


_SYNCS: dict[torch.nn.Module, GradientSync] = {}  # one per model, as a recipe keeps one


def _step(model, optimizer, scheduler, info) -> None:
    """One update on this rank's slice of the global batch, loss weighted by its share; clip at 1 (the
    tiny model's gradient norm is ~3: clipping acts and needs the global norm)."""
    inputs, labels = _global_batch()
    keys = rank_slice(list(range(labels.shape[0])), info)
    part = VLInputs(**{k: (v[keys] if isinstance(v, torch.Tensor) else v) for k, v in vars(inputs).items()})
    (share,) = loss_shares([{"mlm": float((labels[keys] != -100).sum())}], info)
    if model not in _SYNCS:
        _SYNCS[model] = GradientSync(model, info)
    sync = _SYNCS[model]
    sync.backward(_loss(model, part, labels[keys]) * share["mlm"])
    sync.finish()  # sharded: FSDP reduce-scattered the sums; parameters no rank reached back to None


def _no_read_back(model) -> None:
    raise AssertionError("the flags of the parameters a sharded update used were read off the device")


def _full(model) -> dict[str, torch.Tensor]:
    return {n: full_tensor(p.detach()).clone() for n, p in model.named_parameters()}


def _fsdp_worker(rank: int, world: int, tmp: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/init", rank=rank, world_size=world)
    # Every gathered copy the graphs hold maps to its sharded parameter: the used-parameter flags come
    # from the host, never from the gradients (the fallback that reads them off the device must not run).
    distributed._drop_unused_sharded_grads = _no_read_back
    _fsdp_work(rank, tmp)
    leave_process_group()  # the sharded models are out of scope now (see leave_process_group)


def _fsdp_work(rank: int, tmp: str) -> None:
    info = init_distributed("cpu")
    torch.manual_seed(rank)  # ranks start apart: shard_model starts every rank from rank 0's weights

    def fresh():
        model = build_pretraining_model(CFG)
        if info.main:
            model.load_state_dict(_model().state_dict())
        return shard_model(model, info)

    model = fresh()
    assert is_sharded(model)
    optimizer, scheduler = _trainer(model)
    found: dict = {}
    for step in range(2):
        _step(model, optimizer, scheduler, info)
        if step == 0:
            found["grads"] = {n: full_tensor(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None}
            found["no_grad"] = sorted(n for n, p in model.named_parameters() if p.grad is None)
        found.setdefault("norms", []).append(float(update(model, optimizer, scheduler, clip=1.0)))
    found["w2"] = _full(model)
    save_checkpoint(f"{tmp}/fsdp", model=model, cfg=CFG, optimizer=optimizer, scheduler=scheduler,
                    state=TrainState(step=2, data={}, extra={}), write=info.main)
    _step(model, optimizer, scheduler, info)
    update(model, optimizer, scheduler, clip=1.0)
    found["w3"] = _full(model)

    # Resumed into fresh sharded models: from this run's own checkpoint, and from the single process's.
    for name in ("fsdp", "single"):
        again = fresh()
        optimizer, scheduler = _trainer(again)
        restore_checkpoint(f"{tmp}/{name}/checkpoints/step_00000002", model=again, optimizer=optimizer,
                           scheduler=scheduler)
        _step(again, optimizer, scheduler, info)
        update(again, optimizer, scheduler, clip=1.0)
        found[f"w3_from_{name}"] = _full(again)

    # Gathered for evaluation: rank 0 runs two forwards, rank 1 one; no collective, so no hang.
    gather_for_inference(model)
    inputs, _ = _global_batch()
    with torch.no_grad():
        logits = [model(inputs).mlm_logits for _ in range(rank + 1)]
    found["eval"] = logits[-1]

    # BertAdam with per-tensor clipping, sharded: each rank sums its shards' squares, one all-reduce gives
    # every tensor's whole norm.
    bert = _model() if info.main else build_pretraining_model(CFG)
    found["bertadam"] = _bertadam_updates(shard_model(bert, info), lambda m: _step(m, None, None, info))
    if info.main:
        torch.save(found, f"{tmp}/found.pt")


@needs_fsdp
def test_sharded_updates_equal_the_single_process_ones_and_checkpoints_cross_over(tmp_path):
    # One process, the whole global batch: 2 updates, an (unsharded) checkpoint, a third update.
    model = _model()
    optimizer, scheduler = _trainer(model)
    one = {"norms": []}
    for step in range(2):
        _loss(model, *_global_batch()).backward()
        if step == 0:
            one["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
            one["no_grad"] = sorted(n for n, p in model.named_parameters() if p.grad is None)
        one["norms"].append(float(update(model, optimizer, scheduler, clip=1.0)))
    one["w2"] = _full(model)
    save_checkpoint(tmp_path / "single", model=model, cfg=CFG, optimizer=optimizer, scheduler=scheduler,
                    state=TrainState(step=2, data={}, extra={}))
    _loss(model, *_global_batch()).backward()
    update(model, optimizer, scheduler, clip=1.0)
    one["w3"] = _full(model)
    with torch.no_grad():
        one["eval"] = model(_global_batch()[0]).mlm_logits

    bertadam = _bertadam_updates(_model(), lambda m: _loss(m, *_global_batch()).backward())

    mp.spawn(_fsdp_worker, args=(2, str(tmp_path)), nprocs=2, join=True)
    found = torch.load(tmp_path / "found.pt", weights_only=True)

    # FSDP summed the rank gradients (no averaging): the single-process gradient; the global norm clips.
    # Parameters no rank used (the match head, the pooler: this loss is MLM only) have no gradient, as
    # with one process, so AdamW neither moves nor decays them (`GradientSync.finish` on a sharded model).
    assert found["no_grad"] == one["no_grad"] and len(one["no_grad"]) >= 2
    assert found["grads"].keys() == one["grads"].keys() and len(one["grads"]) > 10
    for n in one["grads"]:
        torch.testing.assert_close(found["grads"][n], one["grads"][n], rtol=1e-4, atol=1e-6, msg=n)
    assert found["norms"] == pytest.approx(one["norms"], rel=1e-5) and min(one["norms"]) > 1.0
    for key in ("w2", "w3", "w3_from_single"):  # measured: max difference 2.5e-6 (AdamW's first steps)
        for n in one["w3"]:
            torch.testing.assert_close(found[key][n], one[key if key != "w3_from_single" else "w3"][n],
                                       rtol=0, atol=1e-5, msg=f"{key} {n}")
    for n in one["no_grad"]:  # never stepped: still the initial weights, in both runs
        assert torch.equal(found["w3"][n], one["w3"][n]), n
    # A sharded run resumed from its own checkpoint repeats its update bit for bit.
    assert all(torch.equal(found["w3_from_fsdp"][n], found["w3"][n]) for n in found["w3"])
    torch.testing.assert_close(found["eval"], one["eval"], rtol=0, atol=1e-4)
    # `--bias_correction=false --decay_all=true --clip_per_tensor=true` sharded: the single process's updates.
    assert found["bertadam"]["clipped"] == bertadam["clipped"] and 20 <= bertadam["clipped"] <= 70  # of 92
    assert found["bertadam"]["norms"] == pytest.approx(bertadam["norms"], rel=1e-5)
    for n, w in bertadam["w"].items():
        torch.testing.assert_close(found["bertadam"]["w"][n], w, rtol=0, atol=1e-5, msg=f"bertadam {n}")

    # The gathered checkpoint is an unsharded one: the same files, tensor names and shapes ...
    fsdp_ckpt, single_ckpt = tmp_path / "fsdp/checkpoints/step_00000002", tmp_path / "single/checkpoints/step_00000002"
    assert sorted(p.name for p in fsdp_ckpt.iterdir()) == sorted(p.name for p in single_ckpt.iterdir())
    a, b = load_file(fsdp_ckpt / "model.safetensors"), load_file(single_ckpt / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    # Optimizer state: the same entries (none for the parameters no rank used) and shapes.
    a, b = load_file(fsdp_ckpt / "optimizer.safetensors"), load_file(single_ckpt / "optimizer.safetensors")
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in b)
    a, b = (json.loads((c / "state.json").read_text()) for c in (fsdp_ckpt, single_ckpt))
    assert a.keys() == b.keys() and a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]
    assert (a["step"], a["scheduler"]) == (b["step"], b["scheduler"])
    assert (fsdp_ckpt / "config.json").read_text() == (single_ckpt / "config.json").read_text()
    # ... that one unsharded process resumes: its third update is the single process's.
    model = _model()
    optimizer, scheduler = _trainer(model)
    restore_checkpoint(fsdp_ckpt, model=model, optimizer=optimizer, scheduler=scheduler)
    _loss(model, *_global_batch()).backward()
    update(model, optimizer, scheduler, clip=1.0)
    for n, w in _full(model).items():
        torch.testing.assert_close(w, one["w3"][n], rtol=0, atol=1e-5, msg=n)


# --------------------------------------------------------------------------- torchrun runs

STEPS = ("--steps=16", "--ckpt_every=4")


@pytest.fixture(scope="module")
def reference_runs(tiny_world, tmp_path_factory) -> dict[str, Path]:
    """16 updates by 2 processes, replicated (DDP arithmetic) and sharded (FSDP), uninterrupted."""
    base = tmp_path_factory.mktemp("fsdp_refs")
    runs = {"ddp": base / "ddp", "fsdp": base / "fsdp"}
    for name, out in runs.items():
        if name == "fsdp" and not HAVE_FSDP2:
            continue
        proc = _torchrun(_pretrain_args(tiny_world, out, *STEPS, *(["--fsdp=true"] if name == "fsdp" else [])))
        assert proc.returncode == 0, proc.stderr[-3000:]
    return runs


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model" / "model.safetensors")


@needs_torchrun
def test_torchrun_fsdp_pretrain_equals_the_replicated_run(reference_runs):
    ddp, fsdp = reference_runs["ddp"], reference_runs["fsdp"]
    a, b = _weights(fsdp), _weights(ddp)
    assert a.keys() == b.keys()
    for k in a:  # measured: max difference ~1e-8
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=k)
    log, ref = MetricsLog.read(fsdp / "metrics.jsonl"), MetricsLog.read(ddp / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 17))  # rank 0 alone logs
    assert [r["mlm_loss"] for r in log] == pytest.approx([r["mlm_loss"] for r in ref], rel=1e-6)
    # The final model directory is laid out exactly as the unsharded run's.
    assert sorted(p.name for p in (fsdp / "model").iterdir()) == sorted(p.name for p in (ddp / "model").iterdir())
    assert (fsdp / "model" / "config.json").read_text() == (ddp / "model" / "config.json").read_text()


@needs_torchrun
def test_torchrun_fsdp_pretrain_resumes_exactly_with_or_without_fsdp(tiny_world, reference_runs, tmp_path):
    # Interrupted after 6 updates (last checkpoint: step 4), resumed sharded: bit-identical.
    run, other = tmp_path / "run", tmp_path / "other"
    assert _torchrun(_pretrain_args(tiny_world, run, *STEPS, "--fsdp=true", "--stop_after=6")).returncode == 0
    shutil.copytree(run, other)
    settings = json.loads((other / "run_config.json").read_text())
    (other / "run_config.json").write_text(json.dumps({**settings, "out": str(other)}))  # the copy's own --out
    proc = _torchrun(_pretrain_args(tiny_world, run, *STEPS, "--fsdp=true"))
    assert proc.returncode == 0, proc.stderr[-3000:]

    def records(r):  # all but the wall-clock time
        return [{k: v for k, v in rec.items() if k != "seconds"} for rec in MetricsLog.read(r / "metrics.jsonl")]

    assert records(run) == records(reference_runs["fsdp"]) and len(records(run)) == 16
    a, b = _weights(run), _weights(reference_runs["fsdp"])
    assert all(torch.equal(a[k], b[k]) for k in b)

    # The same sharded checkpoint resumed replicated (no --fsdp): the replicated run's weights.
    proc = _torchrun(_pretrain_args(tiny_world, other, *STEPS))
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = _weights(other), _weights(reference_runs["ddp"])
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-5, msg=k)
    log, ref = MetricsLog.read(other / "metrics.jsonl"), MetricsLog.read(reference_runs["ddp"] / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 17))
    assert [r["mlm_loss"] for r in log] == pytest.approx([r["mlm_loss"] for r in ref], rel=1e-6)


@needs_torchrun
def test_torchrun_fsdp_finetune_vqa_predicts_as_its_saved_model_does(tiny_world, tiny_pretrained, tmp_path):
    from test_distributed import _finetune_args

    from vlberts.data.vqa import read_vqa
    from vlberts.features.store import RegionStore
    from vlberts.recipes.finetune_vqa import load_vqa_model, predict_vqa

    run = tmp_path / "run"
    proc = _torchrun(_finetune_args(tiny_world, tiny_pretrained, run, "--fsdp=true"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("VQA accuracy") == 1
    eq, ea = tiny_world.vqa("test")
    examples = read_vqa(eq, ea)
    preds = {p["question_id"]: p["answer"] for p in json.loads((run / "predictions.json").read_text())}
    assert len(preds) == len(examples)
    model, vocab, tok = load_vqa_model(run / "model")
    assert predict_vqa(model, vocab, tok, examples, RegionStore(tiny_world.store), device="cpu") == preds


def test_fsdp_in_one_process_warns_and_trains_unsharded(tiny_world, tmp_path):
    proc = subprocess.run([str(VLBERTS), *_pretrain_args(tiny_world, tmp_path / "run", "--fsdp=true", "--steps=2")],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    warning = [ln for ln in proc.stderr.splitlines() if "fsdp" in ln.lower()]
    assert warning == ["warning: --fsdp=true in one process: nothing to shard, training unsharded "
                       "(launch with torchrun --nproc_per_node=N to shard)"]
    assert (tmp_path / "run" / "model" / "model.safetensors").is_file()


# --------------------------------------------------------------------------- in-place elastic restart

@pytest.mark.skipif(not TORCHRUN.exists() or not Path("/proc").is_dir(), reason="torchrun or /proc missing")
def test_torchrun_restarts_a_killed_rank_in_place_and_the_run_resumes_exactly(tiny_world, reference_runs, tmp_path):
    """torchrun --max-restarts=1: a worker SIGKILLed after the first checkpoint makes torchrun stop the
    group and start it again in place; the new workers resume from the newest complete checkpoint and the
    job ends with exit 0 and the uninterrupted run's log and weights. The log has each step once: on
    resuming, MetricsLog drops the records after the checkpoint's step (training/metrics.py), and the
    lost steps are logged again as they are redone."""
    ref = reference_runs["ddp"]
    run = tmp_path / "run"
    cmd = [str(TORCHRUN), "--nproc_per_node=2", "--max-restarts=1", f"--master_port={free_port()}", str(VLBERTS),
           *_pretrain_args(tiny_world, run, *STEPS)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 300
        while not (run / "checkpoints" / "step_00000004").is_dir():  # 12 updates (~3 s) still to go
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
            time.sleep(0.01)
        workers = _workers_of(proc.pid)
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_processes_of(run)  # never leave workers running
    assert proc.returncode == 0, out[-3000:]
    assert "exitcode: -9" in out, out[-3000:]  # a worker was killed, and yet the job succeeded: restarted in place
    log = MetricsLog.read(run / "metrics.jsonl")
    ref_log = MetricsLog.read(ref / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 17))
    assert [r["mlm_loss"] for r in log] == [r["mlm_loss"] for r in ref_log]
    a, b = _weights(run), _weights(ref)
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_a_checkpoint_removes_the_half_written_leftovers_of_a_killed_writer(tmp_path):
    """A writer killed inside `save_checkpoint` leaves its temporaries (never read: `latest` names complete
    checkpoints only); the next checkpoint of the restarted run removes them."""
    ckpts = tmp_path / "checkpoints"
    (ckpts / ".step_00000004.k2j3.tmp").mkdir(parents=True)
    (ckpts / ".step_00000004.k2j3.tmp" / "model.safetensors").write_bytes(b"half")
    (ckpts / ".latest.x81.tmp").write_text("step_000")
    model = _model()
    optimizer, scheduler = _trainer(model)
    save_checkpoint(tmp_path, model=model, cfg=CFG, optimizer=optimizer, scheduler=scheduler,
                    state=TrainState(step=4, data={}, extra={}))
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_00000004"]


def _bertadam(model):
    optimizer = build_optimizer(model, 1e-3, bias_correction=False, decay_all=True)
    return optimizer, linear_warmup_decay(optimizer, 1, 10)


def _bertadam_updates(model, step) -> dict:
    """Two updates with LXMERT's / VisualBERT's optimizer settings (`--bias_correction=false --decay_all=true
    --clip_per_tensor=true`; clip 0.03: some tensors' gradients are clipped, others not)."""
    optimizer, scheduler = _bertadam(model)
    found = {"norms": [], "clipped": 0}
    for _ in range(2):
        step(model)
        found["clipped"] += sum(int(full_tensor(p.grad).norm() > 0.03) for p in model.parameters() if p.grad is not None)
        found["norms"].append(float(update(model, optimizer, scheduler, clip=0.03, clip_per_tensor=True)))
    found["w"] = _full(model)
    return found


@pytest.mark.parametrize("name", ["visualbert-tiny", "lxmert-tiny", "vilbert-tiny", "vlbert-tiny", "wvisualbert-tiny"])
def test_every_sharded_unit_computes_only_inside_its_own_forward(name):
    """FSDP gathers a unit's weights in its forward: a layer whose weights a model reads through another
    method ran on the shards (`--fsdp=true` with LXMERT crashed: "mixed torch.Tensor and DTensor", its last
    cross-modality layer entered through `.last()`). Every unit `shard_model` makes, in every pre-training
    forward with masked words (the path where last layers compute only some rows) and in the VQA models'
    forward (one row), touches its parameters only between its own forward hooks."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    from vlberts.models.builders import arch_of
    from vlberts.recipes.finetune_qa import VQA_MODELS
    from vlberts.training.distributed import _layer_units

    cfg = model_config(name)
    g = torch.Generator().manual_seed(0)
    x = VLInputs(torch.randint(5, 90, (2, 7), generator=g), torch.zeros(2, 7, dtype=torch.long),
                 torch.ones(2, 7, dtype=torch.bool), torch.randn(2, 4, cfg.visual_dim, generator=g),
                 torch.rand(2, 4, 4, generator=g).sort(-1).values, torch.ones(2, 4, dtype=torch.bool))
    where = torch.zeros(2, 7, dtype=torch.bool)
    where[0, 2] = where[1, 4] = True

    def check(model, run) -> int:
        units = _layer_units(model)
        owner = {id(p): i for i, u in enumerate(units) for p in u.parameters()}
        inside: list[int] = []
        for i, unit in enumerate(units):
            unit.register_forward_pre_hook(lambda m, a, i=i: inside.append(i))
            unit.register_forward_hook(lambda m, a, o, i=i: inside.remove(i))
        outside: list[str] = []

        class Watch(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                for t in tree_leaves((args, kwargs or {})):
                    if isinstance(t, torch.Tensor) and owner.get(id(t)) is not None and owner[id(t)] not in inside:
                        outside.append(f"{getattr(func, '__name__', func)} on unit {owner[id(t)]}")
                return func(*args, **(kwargs or {}))

        with Watch():
            run(model)
        assert not outside, f"{name}: {outside[:3]}"
        return len(units)

    assert check(build_pretraining_model(cfg), lambda m: m(x, mlm_positions=where)) >= 2
    vqa = VQA_MODELS[arch_of(cfg)](cfg, 9)
    pos = torch.tensor([3, 5])
    if name.startswith("wvisualbert"):  # its detector tags beside the regions
        from vlberts.models.wvisualbert import collate_tags, tag_tokens

        tags = collate_tags([tag_tokens(c, [[20], [21, 20], [22]]) for c in ([1, 0, 2, 0], [2, 1, 0, 0])])
        check(vqa, lambda m: m(x, tags))
    else:
        check(vqa, lambda m: m(x) if name.startswith(("lxmert", "vilbert")) else m(x, pos))
