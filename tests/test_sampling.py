"""Batch order: a deterministic permutation per epoch, resumable from any position; length grouping
keeps that and only changes which examples share a batch; drawing ahead in a thread keeps it too."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from vlberts.data.sampling import EpochBatchSampler, Position
from vlberts.errors import VlbertsError
from vlberts.training.loop import Prefetcher


def take(sampler: EpochBatchSampler, n: int):
    it = sampler.iter_with_positions()
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("group", [1, 4])
def test_each_epoch_visits_every_example_once_and_resumes_anywhere(group):
    lengths = np.random.default_rng(0).integers(5, 60, size=103)
    sampler = EpochBatchSampler(103, 8, seed=3, lengths=lengths, group=group)
    got = take(sampler, 40)  # 13 batches per epoch (12 x 8 + 7): three epochs and a bit
    for e in range(3):
        keys = [k for b, _ in got[13 * e : 13 * (e + 1)] for k in b]
        assert {ep for ep, _ in keys} == {e}
        assert sorted(i for _, i in keys) == list(range(103))
    assert [len(b) for b, _ in got[:13]] == [8] * 12 + [7]  # the short batch ends the epoch
    for cut in (0, 5, 12, 13, 20):
        resumed = take(EpochBatchSampler(103, 8, seed=3, start=got[cut][1], lengths=lengths, group=group), 10)
        assert [b for b, _ in resumed] == [b for b, _ in got[cut + 1 : cut + 11]]


def test_grouping_puts_similar_lengths_together_and_stays_random():
    lengths = np.random.default_rng(1).integers(5, 60, size=512)
    plain = take(EpochBatchSampler(512, 16, seed=0), 32)
    grouped = take(EpochBatchSampler(512, 16, seed=0, lengths=lengths, group=8), 32)

    def padding(batches):  # padded positions: every example padded to its batch's longest
        return sum(int(lengths[[i for _, i in b]].max()) * len(b) - int(lengths[[i for _, i in b]].sum()) for b, _ in batches)

    assert padding(grouped) < 0.4 * padding(plain)
    # Windows of 8 batches hold the same examples as the plain order's; only their batching differs.
    for w in range(4):
        a = {i for b, _ in plain[8 * w : 8 * (w + 1)] for _, i in b}
        b = {i for bb, _ in grouped[8 * w : 8 * (w + 1)] for _, i in bb}
        assert a == b
    # Batch order inside a window is shuffled, not sorted by length; other epochs and seeds differ.
    means = [lengths[[i for _, i in b]].mean() for b, _ in grouped[:8]]
    assert means != sorted(means)
    other = take(EpochBatchSampler(512, 16, seed=1, lengths=lengths, group=8), 32)
    assert [b for b, _ in other] != [b for b, _ in grouped]


@pytest.mark.parametrize("group", [4, 16])
def test_two_lengths_are_grouped_on_both_axes_and_pad_less_than_their_sum(group):
    # (regions, tokens) per example: a batch pads each axis to its own longest, so what it computes is
    # len(batch) x (max regions + max tokens).
    rng = np.random.default_rng(2)
    lengths = np.stack([rng.integers(4, 20, size=1024), rng.integers(10, 40, size=1024)], axis=1)

    def padding(batches):
        real = sum(int(lengths[[i for _, i in b]].sum()) for b, _ in batches)
        return 1 - real / sum(len(b) * int(lengths[[i for _, i in b]].max(axis=0).sum()) for b, _ in batches)

    two = padding(take(EpochBatchSampler(1024, 16, seed=0, lengths=lengths, group=group), 64))
    by_sum = padding(take(EpochBatchSampler(1024, 16, seed=0, lengths=lengths.sum(axis=1), group=group), 64))
    plain = padding(take(EpochBatchSampler(1024, 16, seed=0), 64))
    assert two < (0.7 if group >= 16 else 0.9) * by_sum and by_sum < plain
    # One axis alone (the first, then the second) leaves the other mixed.
    from vlberts.data.sampling import grouped_order

    order = np.random.default_rng(0).permutation(1024)
    lex = grouped_order(order, lengths[:, 0] * 100 + lengths[:, 1], 16, group, 0, 0)
    one_axis = padding([([(0, i) for i in lex[k : k + 16]], None) for k in range(0, 1024, 16)])
    assert two < one_axis


def test_lengths_may_change_with_the_epoch():
    rng = np.random.default_rng(3)
    per_epoch = {e: rng.integers(5, 60, size=103) for e in range(3)}
    calls = []

    def lengths(epoch):
        calls.append(epoch)
        return per_epoch[epoch]

    got = take(EpochBatchSampler(103, 8, seed=3, lengths=lengths, group=4), 39)
    for e in range(3):  # each epoch grouped by its own lengths, as an array of them would group it
        fixed = take(EpochBatchSampler(103, 8, seed=3, start=Position(e, 0), lengths=per_epoch[e], group=4), 13)
        assert [b for b, _ in got[13 * e : 13 * (e + 1)]] == [b for b, _ in fixed]
    assert calls == [0, 1, 2]  # once an epoch
    resumed = take(EpochBatchSampler(103, 8, seed=3, start=got[20][1], lengths=lengths, group=4), 10)
    assert [b for b, _ in resumed] == [b for b, _ in got[21:31]]


def test_lengths_must_match_the_dataset():
    with pytest.raises(ValueError, match="3 lengths for 4 examples"):
        EpochBatchSampler(4, 2, seed=0, lengths=np.ones(3), group=2)
    with pytest.raises(ValueError, match="3 lengths for 4 examples"):
        take(EpochBatchSampler(4, 2, seed=0, lengths=lambda epoch: np.ones(3), group=2), 1)


def test_prefetching_keeps_the_order_and_prepares_each_item_in_its_thread():
    sampler = EpochBatchSampler(103, 8, seed=3)
    expected = take(sampler, 30)
    threads = []

    def prepare(item):
        threads.append(threading.current_thread().name)
        return item[0], item[1], "prepared"

    with Prefetcher(sampler.iter_with_positions(), prepare=prepare, depth=3) as ahead:
        got = [next(ahead) for _ in range(30)]
    assert [(b, p) for b, p, _ in got] == expected  # same batches, each with its own position
    assert {tag for *_, tag in got} == {"prepared"}
    assert set(threads) == {"vlberts-prefetch"}
    ended = Prefetcher(iter(range(5)))
    assert list(ended) == [0, 1, 2, 3, 4] and list(ended) == []  # a finite stream ends, and stays ended


def test_an_error_while_drawing_is_raised_at_the_item_it_replaced():
    def records():
        yield from range(4)
        raise VlbertsError("bad record", path="shard-000.tar", record="img7")

    ahead = Prefetcher(records(), depth=2)
    assert [next(ahead) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(VlbertsError, match="^shard-000.tar: record img7: bad record$"):
        next(ahead)
    assert not ahead._thread.is_alive()
    with pytest.raises(StopIteration):  # nothing after the error, and no wait for it
        next(ahead)


def test_closing_stops_the_thread_after_drawing_at_most_depth_ahead():
    drawn = []

    def endless():
        while True:
            drawn.append(len(drawn))
            yield drawn[-1]

    ahead = Prefetcher(endless(), depth=2)
    assert [next(ahead) for _ in range(3)] == [0, 1, 2]
    deadline = time.monotonic() + 5
    while len(drawn) < 6 and time.monotonic() < deadline:  # 3 taken, 2 queued, 1 waiting to be queued
        time.sleep(0.01)
    ahead.close()
    assert not ahead._thread.is_alive()
    assert len(drawn) == 6  # never more than depth + 1 beyond what was taken


def test_the_thread_makes_the_loops_gpu_current_before_drawing(monkeypatch):
    """CUDA's current device is per thread: under torchrun rank 1's prefetch thread must pin for cuda:1, or
    it opens a context on GPU 0. Recorded here with the CUDA calls replaced (no GPU needed)."""
    import torch

    made_current: list[int] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: made_current.append(index))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert list(Prefetcher(iter(range(3)), cuda=torch.device("cuda", 1))) == [0, 1, 2]
    assert list(Prefetcher(iter(range(3)), cuda=torch.device("cuda"))) == [0, 1, 2]  # the caller's current one
    assert list(Prefetcher(iter(range(3)))) == [0, 1, 2]
    assert made_current == [1, 3]


def test_feed_draws_inline_on_a_cpu_and_ahead_pinned_on_a_gpu(monkeypatch):
    """`--prefetch=-1` (the default): inline on a CPU, 2 ahead and pinned on a GPU; N > 0 a thread anywhere.
    The CUDA calls and `Tensor.pin_memory` are replaced here (no GPU needed)."""
    import torch

    from vlberts.training.loop import feed

    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self + 100)
    items = [torch.tensor(i) for i in range(3)]
    cpu = feed(iter(items), torch.device("cpu"))
    assert cpu._thread is None and [int(t) for t in cpu] == [0, 1, 2]  # not pinned on a CPU
    threaded = feed(iter(items), torch.device("cpu"), 3)
    assert threaded._thread is not None and [int(t) for t in threaded] == [0, 1, 2]
    gpu = feed(iter(items), torch.device("cuda", 0))
    assert gpu._thread is not None and gpu._queue.maxsize == 2 and [int(t) for t in gpu] == [100, 101, 102]
    assert [int(t) for t in feed(iter(items), torch.device("cuda", 0), 0)] == [100, 101, 102]  # inline, pinned


def test_to_device_moves_every_batch_and_tensor_and_leaves_the_rest():
    """`to_device`, as the training loops hand a step its batches: typed batches (with the facts read off
    their host tensors) and tensors inside tuples, lists and dicts moved, anything else as it is. The CUDA
    side (a copy stream the compute stream waits for) is checked in tests/test_gpu.py."""
    import torch

    from vlberts.data.batch import VLInputs
    from vlberts.training.loop import to_device

    b = VLInputs(input_ids=torch.ones(2, 3, dtype=torch.long), token_type_ids=torch.zeros(2, 3, dtype=torch.long),
                 attention_mask=torch.tensor([[True, True, False], [True, True, True]]),
                 region_feats=torch.randn(2, 4, 5), region_boxes=torch.rand(2, 4, 4),
                 region_mask=torch.ones(2, 4, dtype=torch.bool))
    assert len(list(b.tensors())) == 6  # region_type_ids is None
    source, micro, extra, pos = to_device(("text", [b], {"x": torch.arange(3)}, 7), torch.device("cpu"))
    assert source == "text" and pos == 7 and isinstance(micro, list) and isinstance(micro[0], VLInputs)
    assert all(torch.equal(x, y) for x, y in zip(micro[0].tensors(), b.tensors()))
    assert micro[0].text_complete is False and micro[0].regions_complete is True  # read on the host
    assert torch.equal(extra["x"], torch.arange(3))
