"""Deterministic, resumable batch order.

Epoch e visits the examples in a permutation drawn from (seed, e). A position is (epoch, offset into
that permutation); a sampler started at a saved position yields exactly the batches the uninterrupted
run would have yielded next. Per-example randomness (masking, negative captions) is derived from
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


class EpochBatchSampler:
    """Infinite iterator of batches of (epoch, index) keys, starting at `start`.

    Each epoch's last batch may be smaller; the next batch starts the next epoch.
    """

    def __init__(self, n: int, batch_size: int, seed: int, start: Position = Position(), shuffle: bool = True):
        if n <= 0:
            raise ValueError("cannot sample batches from an empty dataset")
        self.n, self.batch_size, self.seed, self.start, self.shuffle = n, batch_size, seed, start, shuffle

    def iter_with_positions(self) -> Iterator[tuple[list[tuple[int, int]], Position]]:
        """Yield (keys of a batch, position after the batch)."""
        epoch, offset = self.start.epoch, self.start.offset
        while True:
            order = epoch_order(self.n, self.seed, epoch, self.shuffle)
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
