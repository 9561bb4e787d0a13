"""Data-parallel training with 2 CPU processes (gloo): an averaged-gradient update equals the single-process one,
a pre-training run launched by torchrun trains, logs once and resumes exactly, also on another number of
processes; a VQA fine-tuning run does too, and its ranks share the predictions without counting any twice."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from vlberts.data.batch import VLInputs
from vlberts.models.builders import build_pretraining_model, model_config
from vlberts.training.distributed import (
    DistInfo,
    GradientSync,
    broadcast_parameters,
    free_port,
    init_distributed,
    leave_process_group,
    rank_slice,
    sync_gradients,
)
from vlberts.training.loop import loss_shares
from vlberts.training.metrics import MetricsLog

TORCHRUN = Path(sys.executable).with_name("torchrun")
VLBERTS = Path(sys.executable).with_name("vlberts")


def _global_batch(B: int = 6, T: int = 7, R: int = 5) -> tuple[VLInputs, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    inputs = VLInputs(
        input_ids=torch.randint(5, 100, (B, T), generator=g), token_type_ids=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T, dtype=torch.bool), region_feats=torch.randn(B, R, 16, generator=g),
        region_boxes=torch.rand(B, R, 4, generator=g).sort(-1).values,  # x1 < y1 < x2 < y2: valid boxes
        region_mask=torch.ones(B, R, dtype=torch.bool),
    )
    labels = torch.randint(5, 100, (B, T), generator=g)
    labels[torch.rand(B, T, generator=g) < 0.6] = -100  # unlabelled: the ranks hold different numbers of targets
    labels[0, :] = -100  # rank 0's first row none at all
    return inputs, labels


def _model():
    torch.manual_seed(0)
    return build_pretraining_model(model_config("visualbert-tiny", hidden_dropout=0.0, attention_dropout=0.0))


def _loss(model, inputs: VLInputs, labels: torch.Tensor) -> torch.Tensor:
    # Mean over the labelled tokens. The ranks hold different numbers of them, so only weighting each
    # rank's mean by its share (`loss_shares`) makes the summed gradient the global one. The match head
    # and pooler sit out: they must not stall the all-reduce, and come back with no gradient.
    out = model(inputs)
    return torch.nn.functional.cross_entropy(out.mlm_logits.flatten(0, 1), labels.flatten())


def _ddp_worker(rank: int, world: int, init_file: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    info = init_distributed("cpu")
    assert info == DistInfo(rank, world, rank)
    torch.manual_seed(rank)  # ranks start apart; broadcast_parameters must make them agree
    model = build_pretraining_model(model_config("visualbert-tiny", hidden_dropout=0.0, attention_dropout=0.0))
    if info.main:
        model.load_state_dict(_model().state_dict())
    broadcast_parameters(model, info)
    inputs, labels = _global_batch()
    keys = rank_slice(list(range(labels.shape[0])), info)
    part = VLInputs(**{k: (v[keys] if isinstance(v, torch.Tensor) else v) for k, v in vars(inputs).items()})
    (share,) = loss_shares([{"mlm": float((labels[keys] != -100).sum())}], info)
    (_loss(model, part, labels[keys]) * share["mlm"]).backward()
    sync_gradients(model, info)
    if info.main:
        torch.save({n: p.grad for n, p in model.named_parameters()}, out)
    del model
    leave_process_group()


def test_summed_gradient_of_shares_equals_the_single_process_gradient(tmp_path):
    out = tmp_path / "grads.pt"
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    ddp = torch.load(out, weights_only=True)

    model = _model()
    _loss(model, *_global_batch()).backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    assert ddp.keys() == ref.keys() and len(ref) > 10
    # The heads no rank used (match head, pooler) have no gradient, as in one process: AdamW skips them.
    unused = {n for n, g in ref.items() if g is None}
    assert unused and {n for n, g in ddp.items() if g is None} == unused
    for n in ref.keys() - unused:
        torch.testing.assert_close(ddp[n], ref[n], rtol=1e-4, atol=1e-6, msg=n)


def _micro_losses(model, rank: int, world: int, device: str = "cpu") -> list[torch.Tensor]:
    """Rank `rank`'s two micro-batches of the global batch, each loss weighted by its share of the update.
    Rank 0's first micro-batch also trains the match head and the pooler, which then have a gradient on
    rank 0 from an earlier micro-batch but none in its last backward, and none at all on rank 1."""
    inputs, labels = _global_batch(B=8)
    info = DistInfo(rank, world, rank)
    keys = rank_slice(list(range(labels.shape[0])), info)
    micro = [keys[:3], keys[3:]]  # 3 + 1 rows
    counts = [{"mlm": float((labels[k] != -100).sum()), "match": 4.0 * (rank == 0 and j == 0)} for j, k in enumerate(micro)]
    counts_all = [[{"mlm": float((labels[k] != -100).sum()), "match": 4.0 * (r == 0 and j == 0)}
                   for j, k in enumerate((ks[:3], ks[3:]))]
                  for r in range(world) for ks in [rank_slice(list(range(labels.shape[0])), DistInfo(r, world, r))]]
    totals = {name: sum(c[name] for rank_counts in counts_all for c in rank_counts) for name in ("mlm", "match")}
    losses = []
    for j, (k, c) in enumerate(zip(micro, counts)):
        part = VLInputs(**{n: (v[k] if isinstance(v, torch.Tensor) else v) for n, v in vars(inputs).items()})
        out = model(part.to(device))
        targets = labels[k].flatten().to(device)
        loss = torch.nn.functional.cross_entropy(out.mlm_logits.flatten(0, 1), targets) * c["mlm"] / totals["mlm"]
        if c["match"]:
            target = torch.ones(len(k), dtype=torch.long, device=device)
            loss = loss + torch.nn.functional.cross_entropy(out.match_logits, target) * c["match"] / totals["match"]
        losses.append(loss)
    return losses


def _overlap_worker(rank: int, world: int, init_file: str, out: str, device: str = "cpu", backend: str = "gloo") -> None:
    """Two updates of 2 micro-batches each, with `GradientSync` overlapping and not; rank 0 saves the
    gradients and how many buckets were being summed near the end of each last backward. Also run on
    CUDA by tests/test_gpu.py (`device` cuda:N, NCCL or gloo)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    torch.distributed.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    info = init_distributed("cpu")
    results = {}
    for overlap in (True, False):
        model = _model().to(device)
        # Buckets being summed when the word embeddings' gradient is final, near the end of backward (this
        # hook runs before the sync's own on that tensor: registered first).
        launched = []
        words = model.bert.embeddings.word_embeddings.weight
        words.register_post_accumulate_grad_hook(lambda _: launched.append(sync.launched) if sync._armed else None)
        sync = GradientSync(model, info, bucket_mb=0.002, overlap=overlap)  # 2 KiB: a bucket per few tensors
        for update in range(2):  # the second update: hooks re-armed, gradients of the first cleared
            model.zero_grad(set_to_none=True)
            losses = _micro_losses(model, rank, world, device)
            for j, loss in enumerate(losses):
                sync.backward(loss, last=j == len(losses) - 1)
            sync.finish()
        grads = {n: None if p.grad is None else p.grad.cpu() for n, p in model.named_parameters()}
        results[overlap] = (grads, launched, len(sync.buckets))
    if info.main:
        torch.save(results, out)
    leave_process_group()


def check_overlapped_sums(results: dict, rtol: float = 1e-5, atol: float = 1e-7) -> None:
    """`_overlap_worker`'s gradients equal one process's, overlapped or not, and the overlapped updates
    were summing most buckets before backward ended."""
    model = _model()
    for rank in range(2):  # every rank's micro-batches in one process: the update's gradient
        for loss in _micro_losses(model, rank, 2):
            loss.backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is not None for g in ref.values())  # the match head and pooler too (rank 0's first micro-batch)
    for overlap, (grads, launched, n_buckets) in results.items():
        assert grads.keys() == ref.keys()
        for n in ref:
            torch.testing.assert_close(grads[n], ref[n], rtol=rtol, atol=atol, msg=f"{n} (overlap={overlap})")
        if overlap:  # in both updates, most buckets were being summed while backward still ran
            assert n_buckets > 10 and len(launched) == 2 and all(n_buckets // 2 < k < n_buckets for k in launched), (
                launched, n_buckets)
        else:
            assert launched == []


def test_overlapped_sums_equal_one_process_with_accumulation_and_heads_used_on_one_rank(tmp_path):
    out = tmp_path / "grads.pt"
    mp.spawn(_overlap_worker, args=(2, str(tmp_path / "init"), str(out)), nprocs=2, join=True)
    check_overlapped_sums(torch.load(out, weights_only=True))


def test_rank_slices_cover_every_key_once_and_short_batches_reach_every_rank():
    keys = list(range(7))
    parts = [rank_slice(keys, DistInfo(r, 3)) for r in range(3)]
    assert sorted(k for p in parts for k in p) == keys
    assert [rank_slice([4], DistInfo(r, 2)) for r in range(2)] == [[4], [4]]
    assert rank_slice(keys, DistInfo()) == keys


def _pretrain_args(world, out: Path, *extra: str) -> list[str]:
    return [
        "pretrain", f"--captions={world.captions_train}", f"--features={world.store}", f"--out={out}",
        "--model=visualbert-tiny", "--vocab_size=200", "--steps=8", "--batch_size=4", "--lr=1e-3", "--warmup=0.25",
        "--log_every=1", "--ckpt_every=3", "--seed=1", "--max_text_len=40", *extra,
    ]


def _torchrun(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(TORCHRUN), "--nproc_per_node=2", f"--master_port={free_port()}", str(VLBERTS), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_the_peers_of_a_rank_that_failed_say_so_in_one_line(tiny_world, tmp_path):
    # Rank 0 alone writes the run's vocabulary and fails on a path that is a file; rank 1, waiting for it
    # in a collective, used to die with a 40-line gloo traceback that buried rank 0's error.
    taken = tmp_path / "run"
    taken.mkdir()
    (taken / "tokenizer").write_text("a file")
    proc = _torchrun(_pretrain_args(tiny_world, taken))
    worker_lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert f"error: {taken / 'tokenizer'}: is a file, where the output path needs a folder" in worker_lines, proc.stderr[-3000:]
    # Rank 1 says so in one line (torchrun may also stop it first, with SIGTERM: then it says nothing).
    assert "[rank1]: Traceback" not in proc.stderr and "Connection closed by peer" not in proc.stderr
    assert set(worker_lines) <= {f"error: {taken / 'tokenizer'}: is a file, where the output path needs a folder",
                                 "error: rank 1 stopped: another rank failed (its error is above, unless it was "
                                 "killed: then torchrun's report names the signal)"}


def test_restarts_over_several_machines_through_the_shared_store_are_warned_about():
    from vlberts.training.distributed import restart_warning

    env = {"TORCHELASTIC_MAX_RESTARTS": "3", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"}
    line = restart_warning(env)
    assert line.startswith("warning: torchrun --max_restarts=3 over 2 machines shares one store with every restart")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line and "\n" not in line
    for safe in ({"TORCHELASTIC_MAX_RESTARTS": "0"}, {"GROUP_WORLD_SIZE": "1"},
                 {"TORCHELASTIC_USE_AGENT_STORE": "False"}):  # no restart, one machine, a fresh store per round
        assert restart_warning({**env, **safe}) is None
    assert restart_warning({}) is None  # not under torchrun


def test_a_peer_on_several_machines_says_where_the_failed_ranks_error_is():
    from vlberts.cli import _peer_failed_line

    one = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    assert _peer_failed_line(one) == ("rank 1 stopped: another rank failed (its error is above, unless it was "
                                      "killed: then torchrun's report names the signal)")
    # The second of two machines with 2 ranks each holds ranks 2 and 3.
    two = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    assert _peer_failed_line(two) == (
        "rank 3 stopped: another rank failed. Its error is printed by the machine that ran it: above if it was one "
        "of this machine's ranks 2-3, else on another of the job's machines (4 ranks in all), where torchrun's "
        "report also names a rank that was killed")
    alone = {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1"}  # one rank per machine
    assert "above if it was this machine's rank 1, else on another" in _peer_failed_line(alone)
    assert _peer_failed_line({"RANK": "1"}).startswith("rank 1 stopped: another rank failed (its error is above")


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_torchrun_pretrain_logs_once_and_resumes_exactly(tiny_world, tmp_path):
    ref = tmp_path / "ref"
    proc = _torchrun(_pretrain_args(tiny_world, ref))
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref_log = MetricsLog.read(ref / "metrics.jsonl")
    assert [r["step"] for r in ref_log] == list(range(1, 9))  # rank 0 alone writes the log
    assert (ref / "model" / "model.safetensors").is_file()

    # Interrupted after 5 updates (last checkpoint: step 3), resumed by 2 processes again.
    run, one = tmp_path / "run", tmp_path / "one"
    assert _torchrun(_pretrain_args(tiny_world, run, "--stop_after=5")).returncode == 0
    shutil.copytree(run, one)  # the interrupted run, resumed below by one process
    settings = json.loads((one / "run_config.json").read_text())
    (one / "run_config.json").write_text(json.dumps({**settings, "out": str(one)}))  # the copy's own --out
    proc = _torchrun(_pretrain_args(tiny_world, run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = MetricsLog.read(run / "metrics.jsonl")
    assert [r["mlm_loss"] for r in log] == [r["mlm_loss"] for r in ref_log]

    # The same checkpoint resumed by one process: positions are global, so it trains on.
    proc = subprocess.run([str(VLBERTS), *_pretrain_args(tiny_world, one)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in MetricsLog.read(one / "metrics.jsonl")] == list(range(1, 9))


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_a_failed_launch_is_a_one_line_error_naming_its_log(tmp_path):
    from vlberts.errors import VlbertsError
    from vlberts.training.distributed import launch

    log = tmp_path / "run.log"
    with pytest.raises(VlbertsError, match=r"2-process run failed: .*missing.json: file not found \(full log\)"):
        launch(["pretrain", f"--captions={tmp_path / 'missing.json'}", f"--features={tmp_path / 'f.h5'}"], 2, log)
    assert log.is_file()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_launcher_takes_its_torchrun_workers_with_it(tiny_world, tmp_path):
    """`launch` (the demo's and compare's 2-process steps) ran torchrun with subprocess.run: the demo killed,
    torchrun and its ranks ran on under init, writing into OUT, and the next run met their lock. torchrun
    now gets SIGTERM when its launcher dies (even by SIGKILL) and stops its workers."""
    import signal
    import time

    out = tmp_path / "run"
    args = _pretrain_args(tiny_world, out, "--steps=100000", "--ckpt_every=100000")
    script = ("import sys\nfrom pathlib import Path\nfrom vlberts.training.distributed import launch\n"
              f"launch({args!r}, 2, Path({str(tmp_path / 'run.log')!r}))\n")
    launcher = subprocess.Popen([sys.executable, "-c", script])

    def ours() -> list[int]:  # torchrun and the ranks: every process naming this run's directory
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                cmdline = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if proc.name.isdigit() and int(proc.name) != launcher.pid and str(out).encode() in cmdline:
                pids.append(int(proc.name))
        return pids

    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").is_file():  # both ranks are training
            assert launcher.poll() is None and time.monotonic() < deadline, (tmp_path / "run.log").read_text()
            time.sleep(0.2)
        assert len(ours()) >= 3  # torchrun + 2 ranks
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 60
        while ours():
            assert time.monotonic() < deadline, f"torchrun's processes outlived their launcher: {ours()}"
            time.sleep(0.2)
    finally:
        for pid in ours():
            os.kill(pid, signal.SIGKILL)


def _finetune_args(world, init: Path, out: Path, *extra: str) -> list[str]:
    tq, ta = world.vqa("train")
    eq, ea = world.vqa("test")
    return [
        "finetune", "vqa", f"--init={init}", f"--out={out}", f"--features={world.store}", f"--train_questions={tq}",
        f"--train_annotations={ta}", f"--eval_questions={eq}", f"--eval_annotations={ea}", "--min_answer_count=2",
        "--epochs=1", "--batch_size=16", "--lr=1e-3", "--log_every=1", "--ckpt_every=2", "--eval_batch_size=7", *extra,
    ]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_torchrun_finetune_vqa_predicts_each_question_once_and_resumes_exactly(tiny_world, tiny_pretrained, tmp_path):
    import json

    from vlberts.recipes.finetune_vqa import load_vqa_model, predict_vqa
    from vlberts.data.vqa import read_vqa
    from vlberts.features.store import RegionStore

    ref = tmp_path / "ref"
    proc = _torchrun(_finetune_args(tiny_world, tiny_pretrained, ref))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("VQA accuracy") == 1  # rank 0 alone reports
    log = MetricsLog.read(ref / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, len(log) + 1)) and len(log) >= 3

    # The ranks predicted disjoint halves of the test questions; merged, each appears once, and they are
    # exactly what the saved model predicts for every question in one process.
    eq, ea = tiny_world.vqa("test")
    examples = read_vqa(eq, ea)
    preds = {p["question_id"]: p["answer"] for p in json.loads((ref / "predictions.json").read_text())}
    assert len(preds) == len(examples) == json.loads((ref / "metrics.json").read_text())["num_questions"]
    model, vocab, tok = load_vqa_model(ref / "model")
    assert predict_vqa(model, vocab, tok, examples, RegionStore(tiny_world.store), device="cpu") == preds

    # Interrupted after 3 updates (last checkpoint: step 2) and resumed: the same losses, the same answers.
    run = tmp_path / "run"
    assert _torchrun(_finetune_args(tiny_world, tiny_pretrained, run, "--stop_after=3")).returncode == 0
    proc = _torchrun(_finetune_args(tiny_world, tiny_pretrained, run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["loss"] for r in MetricsLog.read(run / "metrics.jsonl")] == [r["loss"] for r in log]
    assert (run / "predictions.json").read_text() == (ref / "predictions.json").read_text()


def _workers_of(pid: int) -> list[int]:
    """The processes torchrun (pid) started: its children, found through /proc."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # field 4 of stat: the parent's pid
            kids.append(int(stat.parent.name))
    return kids


def _kill_processes_of(run_dir: Path) -> None:
    """SIGKILL every process whose command line names `run_dir` (the test's own workers)."""
    import signal

    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(run_dir) in cmdline.read_bytes().decode(errors="replace"):
                os.kill(int(cmdline.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


@pytest.mark.skipif(not TORCHRUN.exists() or not Path("/proc").is_dir(), reason="torchrun or /proc missing")
def test_a_rank_killed_mid_run_leaves_a_checkpoint_the_relaunched_job_resumes_exactly(tiny_world, tmp_path):
    """A rank killed mid-run (SIGKILL: no clean-up, possibly inside a checkpoint write) fails the job; the
    job launched again on the same --out resumes from the newest complete checkpoint (never a half-written
    one) and ends with the uninterrupted run's losses. This is what a scheduler's retry, or torchrun's
    own `--max-restarts`, does after a failure."""
    import signal
    import time

    steps = ["--steps=40", "--ckpt_every=10"]
    ref = tmp_path / "ref"
    assert _torchrun(_pretrain_args(tiny_world, ref, *steps)).returncode == 0

    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [str(TORCHRUN), "--nproc_per_node=2", f"--master_port={free_port()}", str(VLBERTS),
           *_pretrain_args(tiny_world, run, *steps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        deadline = time.monotonic() + 600
        while not (run / "checkpoints" / "step_00000010").is_dir():
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint before the run ended"
            time.sleep(0.02)
        workers = _workers_of(proc.pid)
        assert len(workers) == 2
        os.kill(workers[-1], signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        _kill_processes_of(run)  # a killed torchrun leaves its workers behind; never leave them running
    assert proc.returncode != 0 and "exitcode: -9" in out, out[-3000:]  # the job failed with the killed rank

    proc = _torchrun(_pretrain_args(tiny_world, run, *steps))  # launched again
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = MetricsLog.read(run / "metrics.jsonl")
    ref_log = MetricsLog.read(ref / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 41))
    assert [r["mlm_loss"] for r in log] == [r["mlm_loss"] for r in ref_log]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_matching_negatives_come_from_the_whole_dataset_alike_on_one_and_two_ranks(tiny_world, tiny_pretrained, tmp_path):
    """Image-text matching: an example's mismatched caption is drawn from the whole caption set by
    `example_rng(seed, epoch, index)` (data/pretrain.py), not from a rank's slice of the batch, so the
    2 ranks' slices hold exactly the pairs (negatives included) that one process holds. With dropout off,
    2 ranks and 1 process then log the same matching and MLM losses and end with the same weights.
    (Retrieval's distractors are drawn the same way, data/retrieval.py; tests/test_distributed_tasks.py
    compares its 1- and 2-process fine-tuning.)"""
    from safetensors.torch import load_file

    init = tmp_path / "init"  # the tiny VisualBERT without dropout (rank-seeded dropout masks differ)
    shutil.copytree(tiny_pretrained, init)
    meta = json.loads((init / "config.json").read_text())
    meta["config"].update(hidden_dropout=0.0, attention_dropout=0.0)
    (init / "config.json").write_text(json.dumps(meta))
    runs = {n: tmp_path / n for n in ("one", "two")}
    args = {n: _pretrain_args(tiny_world, out, f"--init={init}", "--steps=4") for n, out in runs.items()}
    proc = subprocess.run([str(VLBERTS), *args["one"]], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = _torchrun(args["two"])
    assert proc.returncode == 0, proc.stderr[-3000:]

    one, two = (MetricsLog.read(runs[n] / "metrics.jsonl") for n in ("one", "two"))
    assert [r["step"] for r in two] == [1, 2, 3, 4] and all(r["match_loss"] > 0 for r in two)
    for key in ("match_loss", "mlm_loss"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-5), key
    a, b = (load_file(runs[n] / "model" / "model.safetensors") for n in ("one", "two"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-5, msg=k)


def test_loss_shares_sum_the_ranks_counts_in_flight_until_a_share_is_read(monkeypatch):
    """The counts' all-reduce is started when the shares are made and waited for only where one is first
    read (after the forward pass in the loops), so the ranks do not meet before the forward. A stand-in
    all-reduce plays the other rank: it adds its counts (3 masked words and 1 match pair) when waited for."""
    calls = []

    class Work:
        def __init__(self, t):
            self.t, self.waited = t, 0

        def wait(self):
            self.waited += 1
            self.t += torch.tensor([1.0, 3.0], dtype=torch.float64)  # sorted names: match, mlm

    def all_reduce(t, async_op=False):
        assert async_op, "the counts must not be summed synchronously"
        calls.append(Work(t))
        return calls[-1]

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    shares = loss_shares([{"mlm": 2.0, "match": 1.0}, {"mlm": 5.0, "match": 0.0}], DistInfo(0, 2, 0))
    assert len(calls) == 1 and calls[0].waited == 0 and len(shares) == 2  # started, not waited for
    assert shares[1] == {"mlm": 0.5, "match": 0.0} and shares[0] == {"mlm": 0.2, "match": 0.5}  # 10 words, 2 pairs
    assert calls[0].waited == 1 and list(shares) == [shares[0], shares[1]]  # waited for once
    # One process: nothing to sum, and a loss with no terms anywhere weighs 0.
    assert list(loss_shares([{"mlm": 4.0, "match": 0.0}])) == [{"mlm": 1.0, "match": 0.0}] and len(calls) == 1


def _agree_worker(rank: int, world: int, init_file: str, root: str, case: str) -> None:
    """Rank `rank` of a run whose two ranks differ as `case` says; writes what check_ranks_agree said."""
    from vlberts.errors import VlbertsError
    from vlberts.recipes.pretrain import PretrainConfig
    from vlberts.training.distributed import check_ranks_agree

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", LOCAL_RANK=str(rank))
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    info = init_distributed("cpu")
    out = Path(root) / ("run" if case != "own_out" or rank == 0 else f"run_on_machine_{rank}")
    cfg = PretrainConfig(captions=str(Path(root) / "captions.json"), out=str(out),
                         lr=2e-4 if case == "lr" and rank == 1 else 1e-3)
    try:
        check_ranks_agree(info, cfg, out)
        said = "agree"
    except VlbertsError as e:
        said = str(e)
    (Path(root) / f"said_{rank}.txt").write_text(said)
    leave_process_group()


@pytest.mark.parametrize("case", ["same", "own_out", "lr"])
def test_ranks_started_apart_stop_at_once_with_the_same_line(tmp_path, case):
    # Each machine starts its own ranks: an OUT on each machine's own disk, or a setting typed differently on one
    # machine, went on silently (rank 1 found no vocabulary or checkpoint; its replica took its own rate).
    (tmp_path / "captions.json").write_text("{}")
    mp.spawn(_agree_worker, args=(2, str(tmp_path / "init"), str(tmp_path), case), nprocs=2, join=True)
    said = [(tmp_path / f"said_{r}.txt").read_text() for r in range(2)]
    # every rank stops with the same line (none waits in a collective for the others), each naming its own --out
    assert said[0] == said[1].replace(str(tmp_path / "run_on_machine_1"), str(tmp_path / "run"))
    host = socket.gethostname()
    expected = {
        "same": "agree",
        "own_out": f"{tmp_path / 'run'}: --out is not one directory for every rank: rank(s) 1 (host {host}) do not find "
                   f"the file rank 0 (host {host}) has just written there. OUT must be on a file system that every "
                   "machine shares: every rank reads the run's vocabulary and resumes from its checkpoints",
        "lr": f"rank 1 (host {host}) was started with other settings than rank 0 (host {host}): --lr=0.0002 against "
              "--lr=0.001; every machine must run the same command",
    }[case]
    assert said[0] == expected
    assert [p.name for p in (tmp_path / "run").iterdir()] == []  # rank 0's probe file is gone again


def test_ranks_reading_other_data_are_named_with_the_setting():
    from vlberts.training.distributed import ranks_disagree

    def rank(host, inputs, lr=1e-3):
        return {"host": host, "sees_out": True, "settings": {"lr": lr, "features": "/d/f.h5"}, "inputs": inputs}

    store = {"features": {"extractor": "x"}, "images": 3, "image_ids_sha256": "a"}
    other = {**store, "image_ids_sha256": "b"}
    # Ranks on rank 0's machine (LOCAL_RANK > 0) fingerprint nothing: they read rank 0's files.
    assert ranks_disagree([rank("a", {"features": store}), rank("a", None), rank("b", {"features": store})]) is None
    assert ranks_disagree([rank("a", {"features": store}), rank("a", None), rank("b", {"features": other})]) == (
        "rank 2 (host b) reads other data than rank 0 (host a): --features=/d/f.h5 holds other features or images; "
        "every machine must read the same inputs (a file system every machine shares, or identical copies at the "
        "same paths)")
    assert "--features=/d/f.h5 is missing there;" in ranks_disagree([rank("a", {"features": store}), rank("b", {})])
    blind = [rank("a", {}), *[{**rank("b", None), "sees_out": False}] * 3, rank("c", {}),
             {**rank("d", None), "sees_out": False}]
    assert ranks_disagree(blind).startswith("--out is not one directory for every rank: rank(s) 1-3, 5 (host b, d) do")
