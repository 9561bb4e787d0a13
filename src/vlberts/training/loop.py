"""Loop pieces shared by the training recipes; the loops themselves stay in the recipes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from vlberts.config import changed_settings, to_dict
from vlberts.data.sampling import EpochBatchSampler, Position
from vlberts.errors import VlbertsError
from vlberts.io import read_json, write_json
from vlberts.training.checkpoint import TrainState, latest_checkpoint, restore_checkpoint
from vlberts.training.distributed import DistInfo, RankBatches, full_tensor, sum_over_ranks


def batches(
    data: Any,
    collate: Callable[[list], Any],
    *,
    batch_size: int,
    seed: int,
    start: Position,
    num_workers: int = 0,
    pin_memory: bool = False,
    lengths: Any = None,
    group: int = 1,
    dist: DistInfo = DistInfo(),
) -> Iterator[tuple[Any, Position]]:
    """Endless (batch, position after it) pairs in the resumable order of `EpochBatchSampler`
    (grouped by `lengths` in windows of `group` batches when given). Distributed, each rank gets its
    slice of every global batch (`training.distributed.rank_slice`); positions stay global.

    The loader and the position tracker walk two copies of the same deterministic sampler, so the
    positions stay in step with the batches whatever the number of workers.
    """
    sampler = EpochBatchSampler(len(data), batch_size, seed, start, lengths=lengths, group=group)
    positions = sampler.iter_with_positions()
    # The loader's own generator: creating its iterator draws a base seed, which must not come from the
    # global RNG (a resumed run creates its iterator at another point of that stream than the original).
    loader = DataLoader(
        data, batch_sampler=RankBatches(sampler, dist), collate_fn=collate, num_workers=num_workers,
        pin_memory=pin_memory, persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )
    for batch in loader:
        _, pos = next(positions)
        yield batch, pos


def update(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, clip: float) -> torch.Tensor:
    """Clip, step the optimizer and the schedule, clear gradients; returns the pre-clip gradient norm, a
    0-d tensor on the parameters' device (`float()` it where it is logged, not every update).

    Under FSDP the gradients are shards (DTensors): `clip_grad_norm_` reduces their squared norms over the
    ranks, so the norm and the clipping are the global ones (summed in another order than one process
    sums them: equal to float rounding, ~1e-7 relative)."""
    norm = full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf")))
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.detach()


def check_same_run(out: Path, cfg: Any, ignore: tuple[str, ...] = ("stop_after", "fsdp", "compile"),
                   write: bool = True) -> None:
    """A resumed run must use the settings it started with (except how long this invocation runs, and
    whether it shards or compiles the model: FSDP checkpoints are whole models, the same as unsharded
    ones, and compiling changes no weight or name)."""
    path = out / "run_config.json"
    if path.is_file():
        before = {k: v for k, v in read_json(path).items() if k not in ignore}
        now = {k: v for k, v in to_dict(cfg).items() if k not in ignore}
        diff = changed_settings(before, now)
        if diff:
            raise VlbertsError(
                f"run directory holds a checkpoint of a run with different settings ({', '.join(diff)}); "
                "use a new --out or the original settings",
                path=path,
            )
    if write:
        write_json(path, to_dict(cfg))


def start_or_resume(
    out: Path, cfg: Any, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, write: bool = True
) -> tuple[TrainState, bool]:
    """Restore the newest checkpoint of `out` if there is one; record the run config either way (only
    with `write`: distributed, rank 0 writes and every rank restores)."""
    latest = latest_checkpoint(out)
    if latest is None:
        if write:
            write_json(out / "run_config.json", to_dict(cfg))
        return TrainState(step=0, data=Position().to_dict(), extra={}), False
    check_same_run(out, cfg, write=write)
    return restore_checkpoint(latest, model=model, optimizer=optimizer, scheduler=scheduler), True


def loss_shares(counts: list[dict[str, float]], dist: DistInfo = DistInfo()) -> list[dict[str, float]]:
    """Per micro-batch of this rank, each loss's weight: its count over the update's total count (all
    micro-batches of all ranks; one all-reduce).

    `counts[i][name]` is the number of terms loss `name` averages over in micro-batch i (its
    denominator, e.g. masked words). Weighting each micro-batch mean by its share and summing (over
    micro-batches by backward, over ranks by `sync_gradients`) gives the mean over the whole update: the
    same update for 1 x 4, 4 x 1 or 2 ranks x 2. A loss with no terms anywhere gets weight 0.
    """
    totals = {name: sum(c[name] for c in counts) for name in counts[0]} if counts else {}
    totals = sum_over_ranks(totals, dist)
    return [{name: (n / totals[name] if totals[name] > 0 else 0.0) for name, n in c.items()} for c in counts]
