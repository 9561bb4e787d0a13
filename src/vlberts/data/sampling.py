"""Deterministic, resumable batch order.

Epoch e visits the examples in a permutation drawn from (seed, e). A position is (epoch, offset into
that permutation); a sampler started at a saved position yields exactly the batches the uninterrupted
run would have yielded next.

Length grouping (optional): every batch is padded to its longest example, so batches of similar
lengths waste less compute. With `lengths`, the permutation is cut into windows of `group` batches;
each window is sorted by length, cut into batches, and those batches are visited in an order drawn
from (seed, epoch, window). The grouped order is still a deterministic permutation of the epoch, so
positions and resuming work unchanged; batches stay random in which examples they hold, only less
mixed in length (the trade Hugging Face's `group_by_length` makes too). Per-example randomness (masking, negative captions) is derived from
(seed, epoch, index) by the datasets, so neither depends on worker processes or on where a run resumed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Position:
    epoch: int = 0
    offset: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset}

    @classmethod
    def from_dict(cls, d: dict[str, int]) -> Position:
        return cls(int(d["epoch"]), int(d["offset"]))


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    if not shuffle:
        return np.arange(n)
    return np.random.default_rng([seed, epoch, 0x5A3]).permutation(n)


def grouped_order(order: np.ndarray, lengths: np.ndarray, batch_size: int, group: int, seed: int, epoch: int) -> np.ndarray:
    """`order` regrouped so that each batch holds examples of similar `lengths` (see the module docstring)."""
    window = batch_size * group
    out = []
    for w, start in enumerate(range(0, len(order), window)):
        chunk = order[start : start + window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        cuts = [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
        # Only the epoch's final window can end in a short batch; it stays last, so that the sampler's
        # fixed-size slices of the order fall exactly on these batches.
        full = len(chunk) // batch_size
        visit = np.random.default_rng([seed, epoch, w, 0x6B7]).permutation(full)
        out.extend(cuts[i] for i in visit)
        out.extend(cuts[full:])
    return np.concatenate(out) if out else order


class EpochBatchSampler:
    """Infinite iterator of batches of (epoch, index) keys, starting at `start`.

    Each epoch's last batch may be smaller; the next batch starts the next epoch. With `lengths` (n,)
    and `group` > 1, batches are grouped by length (module docstring).
    """

    def __init__(
        self, n: int, batch_size: int, seed: int, start: Position = Position(), shuffle: bool = True,
        lengths: np.ndarray | None = None, group: int = 1,
    ):
        if n <= 0:
            raise ValueError("cannot sample batches from an empty dataset")
        if lengths is not None and len(lengths) != n:
            raise ValueError(f"{len(lengths)} lengths for {n} examples")
        self.n, self.batch_size, self.seed, self.start, self.shuffle = n, batch_size, seed, start, shuffle
        self.lengths = None if lengths is None or group <= 1 else np.asarray(lengths)
        self.group = group

    def order(self, epoch: int) -> np.ndarray:
        """The epoch's visiting order (a permutation of range(n))."""
        order = epoch_order(self.n, self.seed, epoch, self.shuffle)
        if self.lengths is None:
            return order
        return grouped_order(order, self.lengths, self.batch_size, self.group, self.seed, epoch)

    def iter_with_positions(self) -> Iterator[tuple[list[tuple[int, int]], Position]]:
        """Yield (keys of a batch, position after the batch)."""
        epoch, offset = self.start.epoch, self.start.offset
        while True:
            order = self.order(epoch)
            while offset < self.n:
                idx = order[offset : offset + self.batch_size]
                offset += len(idx)
                nxt = Position(epoch, offset) if offset < self.n else Position(epoch + 1, 0)
                yield [(epoch, int(i)) for i in idx], nxt
            epoch, offset = epoch + 1, 0

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        for keys, _ in self.iter_with_positions():
            yield keys


def example_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The random stream of one example in one epoch."""
    return np.random.default_rng([seed, epoch, index])


def update_seed(seed: int, step: int, rank: int = 0) -> int:
    """The torch seed of one update on one rank (dropout and other in-model randomness). Drawn from
    (seed, step, rank) rather than carried over from the previous update, so a resumed run, on any
    number of processes, draws exactly what the uninterrupted one drew."""
    return int(np.random.SeedSequence([seed, step, rank, 0x7C1]).generate_state(1)[0])
