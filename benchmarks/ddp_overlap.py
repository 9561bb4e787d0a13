"""Data-parallel training step with the gradient all-reduce overlapped with backward, against the same step
summing all gradients after backward, in one run (issue 6; `training.distributed.GradientSync`).

    .venv/bin/python benchmarks/ddp_overlap.py [--arch visualbert|lxmert] [--procs 2] [--repeats 8] [--device cuda]

Launches itself with torchrun (`--procs` processes: on CPU the cores split between them and gloo; with
`--device cuda` one GPU each, NCCL, bf16 autocast as the recipes train there). Each rank
holds its share of the issue's batch (8 x (20 tokens + 36 regions of 2048-d), split over the ranks) for
the base model and runs training steps (forward, backward, the gradient sum over the ranks, fused AdamW),
alternating the two ways of summing, and prints rank 0's medians and their ratio, with the time a step
spends after backward waiting for the sums. Both ways compute the same sums (tests/test_distributed.py);
the difference is only when the all-reduces run. Absolute times on shared machines are noise; the ratio,
measured in one run, is the claim.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import at_least, guarded  # noqa: E402
from vs_hf import B, batch, lxmert_our_step, visualbert_our_step  # noqa: E402  (the same batch and losses)

from vlberts.models.builders import build_pretraining_model, model_config  # noqa: E402
from vlberts.recipes.common import autocast  # noqa: E402
from vlberts.training.distributed import GradientSync, init_distributed, leave_process_group, local_device  # noqa: E402
from vlberts.training.optim import build_optimizer  # noqa: E402

ARCHS = {
    "visualbert": ("visualbert-base", {}, visualbert_our_step),
    "lxmert": ("lxmert-base", {}, lxmert_our_step),
}


def to_device(d: dict, device: torch.device) -> dict:
    return {k: v.to(device) for k, v in d.items()}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def worker(args: argparse.Namespace) -> None:
    info = init_distributed(args.device)
    device = local_device(torch.device(args.device), info)
    torch.set_num_threads(args.threads)
    name, overrides, loss_fn = ARCHS[args.arch]
    torch.manual_seed(0)
    model = build_pretraining_model(model_config(name, **overrides)).to(device)
    model.train()
    optimizer = build_optimizer(model, 1e-5, 0.01)
    data = to_device(batch(seed=info.rank, b=B // info.world), device)  # this rank's share of the global batch
    ways = {"overlapped": GradientSync(model, info, overlap=True), "after backward": GradientSync(model, info, overlap=False)}
    step_s: dict[str, list[float]] = {k: [] for k in ways}
    wait_s: dict[str, list[float]] = {k: [] for k in ways}
    for i in range(args.warmup + args.repeats):
        for way, sync in ways.items():
            dist.barrier()
            synchronize(device)
            t0 = time.perf_counter()
            with autocast(device, "auto"):
                loss = loss_fn(model, data)
            sync.backward(loss)
            synchronize(device)
            t1 = time.perf_counter()
            sync.finish()
            synchronize(device)
            t2 = time.perf_counter()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            synchronize(device)
            t3 = time.perf_counter()
            if i >= args.warmup:
                step_s[way].append(t3 - t0)
                wait_s[way].append(t2 - t1)
    if info.main:
        params = sum(p.numel() for p in model.parameters())
        sync = ways["overlapped"]
        where = f"{info.world} GPUs" if device.type == "cuda" else f"{info.world} processes x {args.threads} thread(s)"
        print(f"{name} ({params / 1e6:.1f}M parameters, {len(sync.buckets)} buckets of <= 25 MiB), "
              f"{where}, {B // info.world} examples each, "
              f"median of {args.repeats} interleaved steps")
        print(f"{'gradient sum':<18}{'step (s)':>10}{'wait after backward (s)':>26}")
        for way in ways:
            print(f"{way:<18}{statistics.median(step_s[way]):>10.3f}{statistics.median(wait_s[way]):>26.3f}")
        ratio = statistics.median(step_s["after backward"]) / statistics.median(step_s["overlapped"])
        print(f"ratio (after backward / overlapped): {ratio:.2f}x")
    leave_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="visualbert")
    ap.add_argument("--procs", type=at_least(1), default=2)
    ap.add_argument("--repeats", type=at_least(1), default=8)
    ap.add_argument("--warmup", type=at_least(0), default=2)
    ap.add_argument("--threads", type=at_least(0), default=0, help="per process (default: the cores / --procs)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return
    if args.device == "cuda" and torch.cuda.device_count() < args.procs:
        sys.exit(f"--device cuda: {args.procs} processes need {args.procs} CUDA devices, this machine has "
                 f"{torch.cuda.device_count()}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = args.threads or max(1, cores // args.procs)
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", f"--nproc_per_node={args.procs}", __file__, f"--arch={args.arch}",
           f"--procs={args.procs}", f"--repeats={args.repeats}", f"--warmup={args.warmup}", f"--threads={threads}",
           f"--device={args.device}"]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    guarded(main)
