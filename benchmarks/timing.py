"""One timer for every benchmark script: the wall time of a call's work on its device."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def seconds(fn: Callable[[], Any], device: torch.device | None = None, calls: int = 1) -> float:
    """Seconds of `fn()`'s work, per call over `calls` back-to-back calls: on a CUDA device, CUDA events
    recorded around them after a synchronize (nothing queued before counts; waits for their kernels to
    end), so that with `calls` > 1 the host may queue call i+1 while the device runs call i, as a training
    loop does; elsewhere, the wall clock around the calls."""
    if device is None or device.type != "cuda":
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t) / calls
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / calls
