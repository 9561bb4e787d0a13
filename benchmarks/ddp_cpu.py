"""Data-parallel pre-training on one CPU machine: torchrun with P processes of C/P threads each against one
process using all C cores, same recipe, same global batches (issue 6; SPEC §6).

    .venv/bin/python benchmarks/ddp_cpu.py [--images 600] [--steps 120] [--model visualbert-small]

Builds a small world and its features once, then pre-trains `--steps` updates of 32 caption pairs each
way and prints updates per second and the ratio. Small models do not use many cores well (the
matrices are too small to split across threads), so P single-threaded processes can beat one
P-threaded process. Absolute times on shared machines are noise; the ratio, measured in one run, is the
claim.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import at_least, guarded

from vlberts.errors import VlbertsError
from vlberts.models.builders import MODEL_CONFIGS
from vlberts.recipes.extract import ExtractConfig, extract
from vlberts.training.distributed import free_port
from vlberts.world.build import build_world

VLBERTS = Path(sys.executable).with_name("vlberts")
TORCHRUN = Path(sys.executable).with_name("torchrun")


def run(cmd: list[str], env: dict[str, str]) -> float:
    """Wall seconds of `cmd`; a failed run is one line with the last line it printed to stderr."""
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "")
        raise VlbertsError(f"{' '.join(cmd[:2])} ... failed (exit {done.returncode}): {last}")
    return time.perf_counter() - t


def train_seconds(out: Path) -> float:
    """Seconds the run spent in its update loop (from its metrics log: start-up and saving excluded)."""
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records[-1]["seconds"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=at_least(50), default=600)
    ap.add_argument("--steps", type=at_least(1), default=120)
    ap.add_argument("--model", choices=sorted(MODEL_CONFIGS), default="visualbert-small", metavar="MODEL")
    ap.add_argument("--procs", type=at_least(1), default=2)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build_world(root / "world", n_images=args.images, seed=0)
        extract(ExtractConfig(world=str(root / "world"), out=str(root / "f.h5"), epochs=1, max_steps=100))
        common = [
            "pretrain", f"--captions={root / 'world/annotations/captions_train.json'}", f"--features={root / 'f.h5'}",
            f"--model={args.model}", f"--steps={args.steps}", "--batch_size=32", "--lr=1e-3", "--log_every=10",
            f"--ckpt_every={10 * args.steps}", "--preload_features=true",
        ]
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        single = run([str(VLBERTS), *common, f"--out={root / 'one'}"], env)
        per = max(1, cores // args.procs)
        ddp = run([str(TORCHRUN), f"--nproc_per_node={args.procs}", f"--master_port={free_port()}", str(VLBERTS),
                   *common, f"--out={root / 'ddp'}"], {**env, "OMP_NUM_THREADS": str(per)})
        t1, t2 = train_seconds(root / "one"), train_seconds(root / "ddp")

    print(f"{args.model}, {args.steps} updates of 32 caption pairs, {cores} cores")
    print(f"  1 process x {cores} threads       {args.steps / t1:6.2f} updates/s  (wall incl. start-up {single:.0f}s)")
    print(f"  {args.procs} processes x {per} thread(s)   {args.steps / t2:6.2f} updates/s  (wall incl. start-up {ddp:.0f}s)")
    print(f"  ratio (DDP / single)            {t1 / t2:6.2f}x")


if __name__ == "__main__":
    guarded(main)
