"""What every benchmark script shares: the wall time of a call's work on its device (`seconds`), argparse
types for counts (`at_least`), and a `main` guard that reports bad input in one line (`guarded`)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Callable

import torch

from vlberts.errors import VlbertsError


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `low` (repeats, steps, images, processes: 0 or a negative count would
    fail later, after minutes of set-up, or time nothing)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return parse


def guarded(main: Callable[[], Any]) -> None:
    """Run a script's `main`: bad input (a `VlbertsError`: a world directory that is not one, a malformed
    captions file) is one line on stderr and exit status 1, as `vlberts` reports it, not a traceback."""
    try:
        main()
    except VlbertsError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


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
