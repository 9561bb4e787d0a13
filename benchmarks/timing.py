"""One timer for every benchmark script: the wall time of a call's work on its device."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch


def seconds(fn: Callable[[], Any], device: torch.device | None = None) -> float:
    """Seconds of `fn()`'s work: on a CUDA device, CUDA events recorded around it after a synchronize (nothing
    queued before counts; waits for its kernels to end); elsewhere, the wall clock around the call."""
    if device is None or device.type != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3
