"""Time `build_world` for N images (default 10,000) and print images/s and total seconds.

    .venv/bin/python benchmarks/world_build.py [--images N] [--workers W] [--out DIR] [--keep]

Target (SPEC §7, a laptop in minutes): 10,000 images with all annotations in under a minute on 2 cores.
The world is written to a temporary directory, or to --out, which must not exist yet (a directory this
run creates; removed afterwards unless --keep). Nothing that was there before is ever removed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from timing import at_least, guarded

from vlberts.errors import VlbertsError
from vlberts.world.build import build_world


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=at_least(1), default=10_000)
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--workers", type=at_least(1), default=None, help="default: CPU count")
    ap.add_argument("--out", type=Path, default=None, help="a new directory (default: a temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the world written to --out")
    args = ap.parse_args()

    tmp = None
    out = args.out
    if out is not None and (out.exists() or out.is_symlink()):
        raise VlbertsError("--out must be a new directory (this benchmark removes what it writes unless --keep)",
                           path=out)
    if out is None:
        tmp = Path(tempfile.mkdtemp(prefix="vlberts-world-bench-"))
        out = tmp / "world"
    try:
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        info = build_world(out, n_images=args.images, seed=args.seed, overwrite=False, workers=args.workers)
        seconds = time.perf_counter() - t0
        children = os.times()
        print(info.summary())
        print(f"images: {args.images}  workers: {info.workers}  cpus: {os.cpu_count()}")
        workers_cpu = children.children_user + children.children_system
        print(f"total seconds: {seconds:.2f}  images/s: {args.images / seconds:.1f}  "
              f"cpu seconds (parent {time.process_time() - cpu0:.1f}, workers {workers_cpu:.1f})")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        elif not args.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    guarded(main)
