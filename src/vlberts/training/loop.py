"""Loop pieces shared by the training recipes; the loops themselves stay in the recipes."""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from vlberts.config import changed_settings, to_dict
from vlberts.data.batch import Batch
from vlberts.data.sampling import EpochBatchSampler, Position
from vlberts.errors import VlbertsError
from vlberts.io import read_json, write_json
from vlberts.training.checkpoint import TrainState, latest_checkpoint, restore_checkpoint
from vlberts.training.data_record import check_same_data, record_data
from vlberts.training.distributed import DistInfo, RankBatches, full_tensor, start_sum_over_ranks


def batches(
    data: Any,
    collate: Callable[[list], Any],
    *,
    batch_size: int,
    seed: int,
    start: Position,
    num_workers: int = 0,
    lengths: Any = None,
    group: int = 1,
    dist: DistInfo = DistInfo(),
) -> Iterator[tuple[Any, Position]]:
    """Endless (batch, position after it) pairs in the resumable order of `EpochBatchSampler`
    (grouped by `lengths` in windows of `group` batches when given). Distributed, each rank gets its
    slice of every global batch (`training.distributed.rank_slice`); positions stay global.

    The loader and the position tracker walk two copies of the same deterministic sampler, so the
    positions stay in step with the batches whatever the number of workers. Nothing is pinned here:
    the recipes draw every stream through `feed`, which pins on a GPU.
    """
    sampler = EpochBatchSampler(len(data), batch_size, seed, start, lengths=lengths, group=group)
    positions = sampler.iter_with_positions()
    # The loader's own generator: creating its iterator draws a base seed, which must not come from the
    # global RNG (a resumed run creates its iterator at another point of that stream than the original).
    loader = DataLoader(
        data, batch_sampler=RankBatches(sampler, dist), collate_fn=collate, num_workers=num_workers,
        persistent_workers=num_workers > 0,
        generator=torch.Generator().manual_seed(seed),
    )
    for batch in loader:
        _, pos = next(positions)
        yield batch, pos


T = TypeVar("T")
_END = object()


def _each(item: Any, fn: Callable[[Any], Any]) -> Any:
    """`item` with `fn` applied to every typed batch and tensor in it (inside tuples, lists and dicts);
    anything else (positions, names) as it is."""
    if isinstance(item, (Batch, torch.Tensor)):
        return fn(item)
    if isinstance(item, (tuple, list)):
        return type(item)(_each(x, fn) for x in item)
    if isinstance(item, dict):
        return {k: _each(v, fn) for k, v in item.items()}
    return item


def pinned(item: Any) -> Any:
    """`item` with every typed batch and tensor in it in page-locked memory (needs an accelerator)."""
    return _each(item, lambda x: x.pin_memory())


_COPY_STREAMS: dict[int, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream on which `to_device` copies batches to CUDA `device` (one per device)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _COPY_STREAMS:
        _COPY_STREAMS[index] = torch.cuda.Stream(index)
    return _COPY_STREAMS[index]


def to_device(item: Any, device: torch.device) -> Any:
    """`item` (a typed batch, a tensor, or tuples, lists and dicts of them) on `device`, as the training
    loops hand a step its batch.

    On a GPU the host-to-device copy runs on a side stream (`copy_stream`), so that it overlaps the
    previous update's kernels: the host queues update k's copy while the GPU still computes update k-1
    (the loops read nothing back between updates), and the compute stream waits for the copy only where
    update k's kernels begin. On the compute stream itself the copy would wait for update k-1 to end:
    on the H200, 2.8 ms of LXMERT-base's 64 ms step at batch 512 (36 x 2048 float32 regions an example).
    The copies' memory is marked as used by the compute stream (`record_stream`), so that the caching
    allocator does not hand it to the next copy while a kernel still reads it. A pinned source (`feed`)
    makes the copy asynchronous; a pageable one is copied before this returns. Elsewhere: `.to(device)`."""
    if device.type != "cuda":
        return _each(item, lambda x: x.to(device))
    compute, side = torch.cuda.current_stream(device), copy_stream(device)
    with torch.cuda.stream(side):
        moved = _each(item, lambda x: x.to(device, non_blocking=True))
    compute.wait_stream(side)

    def used_by_compute(x: Any) -> Any:
        for t in x.tensors() if isinstance(x, Batch) else (x,):
            t.record_stream(compute)
        return x

    _each(moved, used_by_compute)
    return moved


class Prefetcher(Generic[T]):
    """The items of `items`, passed through `prepare`, in the same order; with `depth` > 0 drawn that many
    ahead by a background thread (and prepared there), so that the next update's batches are read,
    collated and pinned while the device runs this one. `depth=0` draws each item when it is asked for,
    in the caller's thread. `feed` picks for a device.

    One thread draws every item, so the order, and with it each checkpoint's data position, is the
    stream's own. An exception raised while drawing (a bad record) is raised again by the `next()` that
    would have returned that item. Use it as a context manager, or `close()` it: the thread stops after
    the item it is drawing, and items drawn ahead are dropped (a checkpoint's position is the one of the
    last item consumed, so a resumed run reads them again).

    `cuda`: the GPU the thread makes current before it draws. CUDA's current device is per thread, and a
    thread that pins memory without one set opens a context on GPU 0: under torchrun every rank would
    then hold memory on GPU 0 (`DataLoader`'s own pinning thread sets it too).
    """

    def __init__(self, items: Iterator[T], prepare: Callable[[T], T] | None = None, depth: int = 2,
                 cuda: torch.device | None = None):
        self._items, self._prepare = items, prepare or (lambda item: item)
        # The index as the caller's thread sees it ("cuda" alone: the caller's current device).
        self._cuda = None if cuda is None else cuda.index if cuda.index is not None else torch.cuda.current_device()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vlberts-prefetch", daemon=True) if depth > 0 else None
        if self._thread is not None:
            self._thread.start()

    def _put(self, entry: tuple[Any, BaseException | None]) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            if self._cuda is not None:
                torch.cuda.set_device(self._cuda)
            for item in self._items:
                if not self._put((self._prepare(item), None)):
                    return
            self._put((_END, None))
        except BaseException as err:  # handed to the consumer, raised there
            self._put((None, err))

    def __iter__(self) -> Prefetcher[T]:
        return self

    def __next__(self) -> T:
        if self._thread is None:
            return self._prepare(next(self._items))
        if self._stop.is_set():  # closed, ended or failed: nothing more will come
            raise StopIteration
        item, err = self._queue.get()
        if err is not None:
            self.close()
            raise err
        if item is _END:
            self.close()
            raise StopIteration
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:  # the item being drawn, at most (a daemon: never holds up an exit)
            self._thread.join(timeout=60.0)

    def __enter__(self) -> Prefetcher[T]:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def feed(items: Iterator[T], device: torch.device, depth: int = -1) -> Prefetcher[T]:
    """How a training loop draws its batches on `device` (`--prefetch`): `depth` updates ahead in a thread,
    pinned there on a GPU, for every stream a run reads (the captions' DataLoader, the mixed text-only
    and image-only sources, the shards), with or without DataLoader workers; 0: when asked, in the loop's
    thread. -1 picks: 2 on a GPU, 0 on a CPU. On a CPU the device is the CPU itself: a thread collating
    beside the 2 compute threads of one process on 2 cores made the demo's pre-training 1.45-1.52x slower
    (150 updates: 12.8 / 13.0 s inline, 18.6 / 19.8 s threaded; the same weights either way)."""
    cuda = device if device.type == "cuda" else None
    if depth < 0:
        depth = 2 if cuda is not None else 0
    return Prefetcher(items, prepare=pinned if cuda is not None else None, depth=depth, cuda=cuda)


FP16_INIT_SCALE = 2.0**16  # the first loss scale of an fp16 run (PyTorch's default)


def loss_scaler(device: torch.device, precision: str, sharded: bool = False) -> torch.amp.GradScaler:
    """Dynamic loss scaling for `--precision=fp16` (SPEC §6: "fp16 with scaler"), disabled (every call a
    no-op, `state_dict()` empty) for the other precisions: bf16 has fp32's exponent range and needs none.

    fp16's smallest normal number is 6e-5, so small gradients of an fp16 backward underflow to zero; the
    loss is multiplied by a scale (`FP16_INIT_SCALE` to start) before backward, the gradients divided by it before
    clipping, and an update whose gradients hold an inf or NaN is skipped with the scale halved (doubled
    again after 2,000 clean updates). Replicated ranks hold the same summed gradients, so they skip the
    same updates; FSDP's ranks each see their own shards and would not, hence the error."""
    if precision == "fp16" and sharded:
        raise VlbertsError("--precision=fp16 with --fsdp=true is not supported (each rank would check only its own "
                           "gradient shards for overflow); use --precision=bf16, or train replicated")
    return torch.amp.GradScaler(device.type, init_scale=FP16_INIT_SCALE, enabled=precision == "fp16")


def scaler_state(scaler: torch.amp.GradScaler) -> dict[str, Any]:
    """What a checkpoint's `TrainState.extra` keeps of the loss scaler (nothing when it is disabled): its
    scale and clean-update count, so that a resumed fp16 run skips the same updates as the uninterrupted one."""
    return {"grad_scaler": scaler.state_dict()} if scaler.is_enabled() else {}


def update(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, clip: float,
           scaler: torch.amp.GradScaler | None = None, clip_per_tensor: bool = False) -> torch.Tensor:
    """Clip, step the optimizer and the schedule, clear gradients; returns the pre-clip gradient norm, a
    0-d tensor on the parameters' device (`float()` it where it is logged, not every update).

    `clip_per_tensor`: each parameter's gradient is clipped to norm `clip` on its own (`clip_each_`), as
    VisualBERT's BertAdam does inside its step, instead of all of them together by their global norm.

    With an enabled `scaler` (fp16) the gradients are unscaled first, and an update with an inf or NaN
    among them leaves the weights as they were (the fused AdamW reads the overflow flag on the device, so
    nothing is read back); the schedule steps either way, so the learning rate of update k is the same
    in every run.

    Under FSDP the gradients are shards (DTensors): `clip_grad_norm_` reduces their squared norms over the
    ranks, so the norm and the clipping are the global ones (summed in another order than one process
    sums them: equal to float rounding, ~1e-7 relative)."""
    if scaler is not None:
        scaler.unscale_(optimizer)
    if clip_per_tensor:
        norm = clip_each_([p.grad for p in model.parameters() if p.grad is not None], clip)
    else:
        norm = full_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf")))
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return norm.detach()


def clip_each_(grads: list[torch.Tensor], clip: float) -> torch.Tensor:
    """Scale each gradient whose norm exceeds `clip` down to `clip` (coefficient clip / (norm + 1e-6), as
    `clip_grad_norm_` computes it; `clip` 0: none), in place; returns the global norm before clipping.

    Under FSDP a gradient is a shard (DTensor): each rank sums its shards' squares and one all-reduce gives
    every tensor's whole norm, so every rank scales its shard by the same coefficient."""
    if not grads:
        return torch.zeros(())
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(g, DTensor) for g in grads)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    squares = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) ** 2 for t in local])  # (tensors,)
    if sharded:
        torch.distributed.all_reduce(squares)
    norms = squares.sqrt()
    if clip > 0:
        coefs = (clip / (norms + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(local, [c.to(t.dtype) for c, t in zip(coefs.unbind(), local)])
    return squares.sum().sqrt()


def require_finite(losses: dict[str, float], step: int, scaler: torch.amp.GradScaler) -> None:
    """Stop a run whose logged loss is NaN or inf (the same on every rank: the ranks' summed shares) with a
    one-line error, before the update is checkpointed, instead of training on: the newest checkpoint is
    then one from before the divergence. Under fp16 loss scaling an overflowing update is expected and
    skipped by the scaler, so this check is off there."""
    if scaler.is_enabled():
        return
    bad = {k: v for k, v in losses.items() if not math.isfinite(v)}
    if bad:
        name, value = next(iter(bad.items()))
        raise VlbertsError(f"training diverged at update {step}: the {name} is {value}; lower --lr, or look for "
                           "NaN or inf in the inputs or the initial weights (the newest checkpoint predates it)")


# Settings a resumed run may change, because they change no number of it: how long this invocation runs,
# whether it shards the model (FSDP checkpoints are whole models, as unsharded ones) or compiles it, in
# whichever mode (no weight or name changes), which attention kernel it uses (the same function), whether it
# draws its batches ahead or mirrors its log to TensorBoard, and where its run directory is (the record was
# found in it: a moved directory, or one named by another path, is the same run), and how many loader workers
# it has (each example draws from its own random stream, `data.sampling.example_rng`; a streamed run's workers
# each read their own stream, so its checkpoint records their number and `pretrain` refuses another).
UNNUMBERED = ("stop_after", "fsdp", "compile", "compile_mode", "attention_kernel", "prefetch", "tensorboard", "out",
              "num_workers")


def check_same_run(out: Path, cfg: Any, write: bool = True) -> None:
    """A resumed run must use the settings it started with, but for those in `UNNUMBERED`. A file named by
    another path (relative against absolute, through a link) is the same setting; so are `--device=auto`
    and the device it picks on this machine, and `--precision=auto` and the precision it picks there."""
    path = out / "run_config.json"
    if not path.is_file():  # called with a checkpoint to resume from: its settings are what the record holds
        raise VlbertsError("run directory holds a checkpoint but no run_config.json to check this run's settings "
                           "against (deleted?); use a new --out, or put the record back", path=path)
    before = {k: v for k, v in read_json(path).items() if k not in UNNUMBERED}
    now = {k: v for k, v in to_dict(cfg).items() if k not in UNNUMBERED}
    # A setting the record lacks was added to vlberts after the run started: its default is the old behaviour.
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    diff = [k for k in changed_settings(before, now)
            if not (k not in before and now.get(k) == defaults.get(k)) and not _same_setting(k, before, now)]
    if diff:
        changes = ", ".join(f"{k} {before.get(k)!r} -> {now.get(k)!r}" for k in diff)
        raise VlbertsError(
            f"run directory holds a checkpoint of a run with different settings ({changes}); "
            "use a new --out or the original settings",
            path=path,
        )
    if write:
        write_json(path, to_dict(cfg))


def _same_setting(key: str, before: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether two textually different values of setting `key` name the same thing (`check_same_run`)."""
    a, b = before.get(key), now.get(key)
    if key == "device":
        return _device_kind(a) == _device_kind(b)
    if key == "precision":
        kind = _device_kind(now.get("device"))
        return precision_in_effect(a, kind) == precision_in_effect(b, kind)
    if isinstance(a, str) and isinstance(b, str) and a and b:
        try:  # the same file or directory, named by another path
            return os.path.samefile(a, b)
        except OSError:  # one of them is not there (or not a path at all)
            return False
    return False


def auto_device_type() -> str:
    """What `--device=auto` runs on here: CUDA when there is a GPU, else the CPU (`recipes.common.resolve_device`)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def precision_in_effect(precision: Any, device_type: Any) -> Any:
    """The arithmetic a `--precision` value means on a device type: 'auto' is bf16 autocast on CUDA and fp32
    on the CPU (`recipes.common.autocast` reads it from here)."""
    if precision == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return precision


def _device_kind(name: Any) -> Any:
    """The kind of device a `--device` value runs on: 'auto' as this machine resolves it; any GPU's index
    alike (`cuda`, `cuda:1`: the same arithmetic)."""
    if name == "auto":
        return auto_device_type()
    try:
        return torch.device(name).type
    except (RuntimeError, ValueError, TypeError):
        return name


def start_or_resume(
    out: Path, cfg: Any, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, write: bool = True
) -> tuple[TrainState, bool]:
    """Restore the newest checkpoint of `out` if there is one; record the run config either way (only
    with `write`: distributed, rank 0 writes and every rank restores), and the fingerprints of the data a
    starting run reads, which a resumed run must read again (`data_record.check_same_data`)."""
    latest = latest_checkpoint(out)
    if latest is None:
        if write:
            write_json(out / "run_config.json", to_dict(cfg))
            record_data(out, cfg)  # what it reads, for a resume to compare (training/data_record.py)
        return TrainState(step=0, data=Position().to_dict(), extra={}), False
    check_same_run(out, cfg, write=write)
    check_same_data(out, cfg)
    return restore_checkpoint(latest, model=model, optimizer=optimizer, scheduler=scheduler), True


def loss_shares(counts: list[dict[str, float]], dist: DistInfo = DistInfo()) -> LossShares:
    """Per micro-batch of this rank, each loss's weight: its count over the update's total count (all
    micro-batches of all ranks; one all-reduce).

    `counts[i][name]` is the number of terms loss `name` averages over in micro-batch i (its
    denominator, e.g. masked words). Weighting each micro-batch mean by its share and summing (over
    micro-batches by backward, over ranks by `GradientSync`) gives the mean over the whole update: the
    same update for 1 x 4, 4 x 1 or 2 ranks x 2. A loss with no terms anywhere gets weight 0.

    Distributed, the all-reduce is started here and waited for where a share is first read: the loops
    count on the host batches before the forward pass and read the first share after it, so the ranks
    do not meet before the forward (every meeting waits for the slower rank). Entries are read as a
    list's: `shares[i]`, `len`, iteration.
    """
    return LossShares(counts, dist)


class LossShares:
    """`loss_shares`' result: the totals' all-reduce in flight until an entry is first read."""

    def __init__(self, counts: list[dict[str, float]], dist: DistInfo):
        self._counts = counts
        local = {name: sum(c[name] for c in counts) for name in counts[0]} if counts else {}
        self._totals = start_sum_over_ranks(local, dist)
        self._shares: list[dict[str, float]] | None = None
        self._summed: dict[str, float] = {}

    def _ready(self) -> list[dict[str, float]]:
        if self._shares is None:
            totals = self._summed = self._totals()
            self._shares = [{name: (n / totals[name] if totals[name] > 0 else 0.0) for name, n in c.items()}
                            for c in self._counts]
        return self._shares

    @property
    def counts(self) -> dict[str, float]:
        """Each loss's terms in the whole update (all micro-batches, all ranks): 0 for a loss this update had
        nothing for (W-VisualBERT's NSP in a text update drawn from captions), which a log leaves out."""
        self._ready()
        return self._summed

    def __getitem__(self, i: int) -> dict[str, float]:
        return self._ready()[i]

    def __len__(self) -> int:
        return len(self._counts)

    def __iter__(self) -> Iterator[dict[str, float]]:
        return iter(self._ready())
