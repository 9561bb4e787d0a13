"""Time the world detector: training and extraction for a world of a given size.

    .venv/bin/python benchmarks/extract_world.py --images 3000            # builds the world in a temp dir
    .venv/bin/python benchmarks/extract_world.py --world runs/world3k     # an existing world

The temporary directory (a world built here, the store unless --out names a directory for it) is removed
at the end.

Prints one JSON line: world size, threads, training seconds and steps, extraction seconds and
images/s, boxes per image, and the val accuracies. Targets on 2 CPU cores, 3,000 images: training
about 45 s, extraction under 20 s.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

if "OMP_WAIT_POLICY" not in os.environ:  # as `vlberts extract` does (see cli.py), before torch loads
    os.environ.setdefault("GOMP_SPINCOUNT", "1000")

import torch  # noqa: E402
from timing import at_least, guarded  # noqa: E402

from vlberts.errors import VlbertsError  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", type=at_least(1), default=3000, help="world size when the world is built here")
    ap.add_argument("--world", type=Path, default=None, help="an existing world directory (else one is built)")
    ap.add_argument("--out", type=Path, default=None, help="directory for the store (default: a temp dir)")
    ap.add_argument("--seed", type=at_least(0), default=0)
    ap.add_argument("--epochs", type=at_least(1), default=3)
    ap.add_argument("--max-steps", type=at_least(1), default=900)
    ap.add_argument("--float16", action="store_true")
    args = ap.parse_args()
    if args.world is not None and not (args.world / "scenes.jsonl").is_file():
        raise VlbertsError("--world: not a world directory (no scenes.jsonl; `vlberts world build` writes one)",
                           path=args.world)
    with tempfile.TemporaryDirectory(prefix="vlberts-bench-") as tmp:
        run(args, Path(tmp))


def run(args: argparse.Namespace, tmp: Path) -> None:
    """Build the world in `tmp` unless --world names one, train the detector, extract, print the JSON line."""
    from vlberts.recipes.extract import ExtractConfig, extract

    world = args.world
    build_s = None
    if world is None:
        from vlberts.world.build import build_world

        world = tmp / f"world{args.images}"
        t = time.perf_counter()
        build_world(world, n_images=args.images, seed=args.seed)
        build_s = round(time.perf_counter() - t, 2)
    out = (args.out or tmp) / "world.h5"
    cfg = ExtractConfig(
        world=str(world), out=str(out), seed=args.seed, epochs=args.epochs, max_steps=args.max_steps,
        float16=args.float16, overwrite=True,
    )
    cpu0 = time.process_time()
    res = extract(cfg)
    print(json.dumps({
        "world": str(world) if args.world else None,
        "images": res.num_images,
        "splits": res.splits,
        "threads": torch.get_num_threads(),
        "world_build_s": build_s,
        "train_s": res.train_seconds,
        "train": res.train_report,
        "extract_s": res.extract_seconds,
        "extract_images_per_s": round(res.num_images / res.extract_seconds, 1),
        "cpu_s": round(time.process_time() - cpu0, 1),
        "boxes_per_image": res.boxes,
        "val": res.val,
        "store": str(res.store) if args.out else None,
    }))


if __name__ == "__main__":
    guarded(main)
