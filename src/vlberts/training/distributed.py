"""Data-parallel training across processes and machines on PyTorch's own engine (SPEC §6, §8).

Launch any training recipe with torchrun; nothing in the recipe changes:

    torchrun --nproc_per_node=2 -m vlberts.cli pretrain ...            # one machine, 2 processes
    torchrun --nnodes=2 --node_rank=R --nproc_per_node=8 \\
             --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 -m vlberts.cli pretrain ...

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; `init_distributed` joins the process group (gloo on CPU,
NCCL on GPU). The batch order stays the single-process one: every rank walks the same global batches
(`data.sampling`) and keeps its slice `keys[rank::world]`, so positions, checkpoints and resuming are
the same as without distribution, and a run may resume on another number of processes. DDP averages
the ranks' gradients, so an update is the gradient of the mean of the ranks' batch losses (as in every
DDP recipe; with equal per-rank loss denominators this is exactly the single-process gradient, which
tests/test_distributed.py checks). Only rank 0 writes logs, checkpoints and the final model; logged
losses are averaged over the ranks.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

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


def wrap(model: nn.Module, info: DistInfo, device: torch.device, find_unused: bool = False) -> nn.Module:
    """DistributedDataParallel around `model` when distributed, else `model` itself."""
    if not info.enabled:
        return model
    ids = [device.index] if device.type == "cuda" else None
    return nn.parallel.DistributedDataParallel(model, device_ids=ids, find_unused_parameters=find_unused)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (what checkpoints hold)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


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


def mean_over_ranks(values: Mapping[str, float], info: DistInfo) -> dict[str, float]:
    """Average logged scalars over the ranks (every rank calls it, in the same order)."""
    if not info.enabled or not values:
        return dict(values)
    keys = sorted(values)
    t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    return {k: float(v) / info.world for k, v in zip(keys, t.tolist())}


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
