"""Data-parallel training across processes and machines on PyTorch's own engine (SPEC §6, §8).

Launch a training recipe with torchrun; nothing in the recipe changes:

    torchrun --nproc_per_node=2 .venv/bin/vlberts pretrain ...          # one machine, 2 processes
    torchrun --nnodes=2 --node_rank=R --nproc_per_node=8 \\
             --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 .venv/bin/vlberts pretrain ...

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; `init_distributed` joins the process group (gloo on
CPU, NCCL on GPU); every rank starts from rank 0's weights and sums its gradients with the others' in
one all-reduce per update (`sync_gradients`: the arithmetic of DistributedDataParallel, why not its
wrapper is said there). The batch order stays the single-process one: every rank walks the same global
batches (`data.sampling`) and keeps its slice `keys[rank::world]`, so positions, checkpoints and
resuming are the same as without distribution, and a run may resume on another number of processes.
Each rank weighs its loss by its share of the update's loss terms (`training.loop.loss_shares`: e.g.
its masked words over all ranks' masked words), so the summed gradient is exactly the gradient one
process computes on the whole global batch, even when the ranks hold different numbers of terms (where
DDP's mean of the ranks' means is not); tests/test_distributed.py checks it. Only rank 0 writes logs,
checkpoints and the final model; logged losses are the update's, summed over the ranks' shares.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        """The process that writes files and prints."""
        return self.rank == 0


def launched_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group torchrun describes; a single process needs (and gets) none."""
    if launched_world_size() <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))


def local_device(device: torch.device, info: DistInfo) -> torch.device:
    """Each process of a machine drives its own GPU (cuda:LOCAL_RANK); CPU processes share the CPU."""
    if device.type == "cuda" and info.enabled:
        torch.cuda.set_device(info.local_rank)
        return torch.device("cuda", info.local_rank)
    return device


def broadcast_parameters(model: nn.Module, info: DistInfo) -> None:
    """Start every rank from rank 0's weights (they already agree when seeded alike; this makes it so)."""
    if info.enabled:
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t.data, src=0)


def sync_gradients(model: nn.Module, info: DistInfo) -> None:
    """Sum the gradients over the ranks, after backward and before the optimizer step. Each rank's loss
    is already weighted by its share of the update (`training.loop.loss_shares`), so the sum is the
    gradient of the update's loss, the same as one process would compute on the whole global batch.

    One all-reduce of all gradients flattened together. A parameter that got no gradient on a rank
    (a head that sat out the update: VL-BERT's pooler, W-VisualBERT's text-only steps, ViLBERT's masked
    losses on a rank whose pairs were all mismatched) counts as zero there, so every rank always joins
    the same collective. This is DDP's arithmetic without its hooks: DDP's `find_unused_parameters`
    cannot see through our typed (dataclass) model outputs, and an unused head would stall it.
    """
    if not info.enabled:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def rank_slice(keys: list, info: DistInfo) -> list:
    """This rank's share of a global batch: every world-th key from position `rank`. A batch with fewer
    keys than ranks (an epoch's short last batch) gives some keys to two ranks: every rank must take
    part in every update."""
    if not info.enabled:
        return keys
    if len(keys) < info.world:
        return [keys[info.rank % len(keys)]]
    return keys[info.rank :: info.world]


class RankBatches:
    """A batch sampler that yields this rank's slice of each batch of `sampler`."""

    def __init__(self, sampler, info: DistInfo):
        self.sampler, self.info = sampler, info

    def __iter__(self) -> Iterator[list]:
        for keys in self.sampler:
            yield rank_slice(keys, self.info)


def sum_over_ranks(values: Mapping[str, float], info: DistInfo) -> dict[str, float]:
    """Sum scalars over the ranks, on every rank (every rank calls it, with the same keys)."""
    if not info.enabled or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return dict(zip(keys, t.tolist()))


def merge_over_ranks(part: Mapping, info: DistInfo) -> dict:
    """The union of every rank's dict (each rank computed a disjoint share, e.g. predictions for its
    slice `examples[rank::world]`), on every rank; nothing is counted twice and nothing is padded."""
    if not info.enabled:
        return dict(part)
    parts: list = [None] * info.world
    dist.all_gather_object(parts, dict(part))
    return {k: v for p in parts for k, v in p.items()}


def cpu_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def free_port() -> int:
    """A TCP port free right now on this machine, for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], procs: int, log_file: Path) -> None:
    """Run `vlberts ARGS` as `procs` processes on this machine through torchrun (each with cores/procs
    threads), its output going to `log_file`; a failure is an error quoting the log's last line."""
    from vlberts.errors import VlbertsError

    # `python -m torch.distributed.run ... -m vlberts.cli`: torchrun's and our entry points by module, so
    # no console script has to be on PATH or beside the interpreter.
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={procs}", f"--master_port={free_port()}",
           "-m", "vlberts.cli", *args]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, cpu_cores() // procs))}
    with open(log_file, "w", encoding="utf-8") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        lines = [ln for ln in log_file.read_text(encoding="utf-8", errors="replace").splitlines() if ln.strip()]
        ours = [ln for ln in lines if ln.startswith("error: ")]  # a rank's own one-line error, if it gave one
        why = ours[0].removeprefix("error: ") if ours else (lines[-1] if lines else "no output")
        raise VlbertsError(f"{procs}-process run failed: {why} (full log)", path=log_file)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
