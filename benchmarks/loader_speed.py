"""Data loading speed (issue 6, item 5): examples per second from the canonical region store and from tar
shards, each through a DataLoader with 2 workers, against what a base model's training step consumes.

    .venv/bin/python benchmarks/loader_speed.py [--images 2000] [--store features.h5 --captions caps.json]

Without `--store`, writes a store of `--images` images x 36 regions of 2048-d float16 (random features,
the store's own writer) and 5 random captions per image, then shards of it. Measures, after one warm-up
batch (worker start-up excluded):

  (a) `CaptionPretrainData` over the store through the pre-training recipe's loader
      (`training.loop.batches`: 2 workers, batch 64, no `preload`): masked caption pairs + regions, collated;
  (b) `ShardStream` over the shards, 2 workers, batch 64: each sample decoded, its regions prepared
      (`sample_regions`), its first caption tokenised, and the batch padded (`pad_regions`);
  (c) a training step of VisualBERT-base (visual_dim 2048, vocabulary 30522) on batches of 8 from (a),
      2 threads: forward, the paper's losses, backward, AdamW; examples/s over 3 steps after one warm-up;
  (d) `vlberts pretrain --shards`' own stream (`data.pretrain_stream`: chunks of 500 images, masked
      single-caption examples with matching negatives, collated), in the training process (`--num_workers=0`)
      and read by 2 loader workers, each its own stream (`worker_batches`, `--num_workers=2`).

(a) and (d) run twice more with float16 batches (`--float16_batches`, the default on CUDA: the features
stay float16 from the file to the device, which widens them), interleaved with float32 runs; the ratio
of the medians is printed.

The files were just written, so they are in the page cache: these are loader costs, not disk speed.
"""

from __future__ import annotations

import argparse
import itertools
from functools import partial
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from timing import at_least, guarded
from torch.utils.data import DataLoader

from vlberts.data.coco import CaptionRef, read_caption_refs
from vlberts.data.pretrain import CaptionPretrainData, RegionSetup, collate_pretrain
from vlberts.data.regions import pad_regions, pad_sequences
from vlberts.data.sampling import Position
from vlberts.data.pretrain_stream import (
    ShardCorpus,
    StreamPosition,
    WorkerPositions,
    stream_batches,
    stream_examples,
    worker_batches,
)
from vlberts.data.shards import ShardStream, sample_regions, shards_of_index, write_shards
from vlberts.training.distributed import DistInfo
from vlberts.features.record import RegionRecord
from vlberts.features.store import RegionStore, RegionStoreWriter
from vlberts.models.builders import build_pretraining_model, model_config
from vlberts.objectives.recipe import RECIPES, pretrain_losses, run_model, total_loss
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.loop import batches

R, D, BATCH, WORKERS = 36, 2048, 64, 2
WORDS = "a the man woman dog cat red blue small large sits runs on under next to near table street park ball".split()


def random_store(path: Path, n: int, seed: int = 0) -> list[CaptionRef]:
    """A store of n images x R regions of D-d float16, and 5 random captions per image."""
    rng = np.random.default_rng(seed)
    refs = []
    with RegionStoreWriter(path, feature_dim=D, dtype="float16") as w:
        for i in range(n):
            xy = rng.uniform(0, 300, (R, 2)).astype(np.float32)
            boxes = np.concatenate([xy, xy + rng.uniform(10, 200, (R, 2)).astype(np.float32)], 1)
            boxes = np.minimum(boxes, np.array([640, 480, 640, 480], np.float32))  # inside the 640 x 480 image
            feats = rng.standard_normal((R, D), dtype=np.float32).astype(np.float16)
            w.add(RegionRecord(image_id=str(i), image_w=640, image_h=480, boxes=boxes, features=feats))
            refs += [CaptionRef(str(i), " ".join(rng.choice(WORDS, rng.integers(8, 16)))) for _ in range(5)]
    return refs


def rate(loader, n_batches: int, size=len) -> float:
    """Examples per second over `n_batches` batches after the first (which pays for worker start-up)."""
    it = iter(loader)
    next(it)
    t, n = time.perf_counter(), 0
    for batch in itertools.islice(it, n_batches):
        n += size(batch)
    return n / (time.perf_counter() - t)


def interleaved(measure, variants: tuple, repeats: int = 3) -> list[float]:
    """The median rate of each variant (`measure(variant)`), the variants run in turn `repeats` times."""
    rates: list[list[float]] = [[] for _ in variants]
    for _ in range(repeats):
        for i, v in enumerate(variants):
            rates[i].append(measure(v))
    return [float(np.median(r)) for r in rates]


def store_rate(data: CaptionPretrainData, pad_id: int, n_batches: int) -> float:
    stream = batches(data, lambda ex: collate_pretrain(ex, pad_id=pad_id), batch_size=BATCH, seed=0, start=Position(),
                     num_workers=WORKERS)
    return rate((b for b, _ in stream), n_batches, size=lambda b: b.inputs.input_ids.shape[0])


class ShardCollate:
    """Decoded samples -> padded regions and first-caption token ids (a picklable collate function)."""

    def __init__(self, tok: TextTokenizer):
        self.tok = tok

    def __call__(self, samples: list[dict]) -> tuple[torch.Tensor, ...]:
        regions = [sample_regions(s, R, D) for s in samples]
        ids = pad_sequences([self.tok.encode(s["captions"][0]) for s in samples], self.tok.pad_id)
        return (ids, *pad_regions(regions))


def shard_rate(index: Path, tok: TextTokenizer, n_batches: int) -> float:
    stream = ShardStream(shards_of_index(index), seed=0, buffer=256, resample=True)  # endless: no epoch edge
    loader = DataLoader(stream, batch_size=BATCH, num_workers=WORKERS, collate_fn=ShardCollate(tok))
    return rate(loader, n_batches, size=lambda b: b[0].shape[0])


def pretrain_stream_rate(index: Path, tok: TextTokenizer, n_batches: int, workers: int, float16: bool = False) -> float:
    corpus = ShardCorpus(index)
    corpus.info()

    def make(captions, regions, seed):
        return CaptionPretrainData(captions, regions, tok, feature_dim=D, pairs=False, mismatch_prob=0.5, seed=seed,
                                   region_setup=RegionSetup(float16=float16))

    def stream(reader, start):
        return stream_batches(stream_examples(corpus, make, seed=0 if reader is None else 1 + reader[0], chunk_images=500,
                                              dist=DistInfo(), start=start, reader=reader),
                              partial(collate_pretrain, pad_id=tok.pad_id), BATCH)

    batches_ = (worker_batches(lambda k, pos: stream((k, workers), pos), WorkerPositions.fresh(workers)) if workers
                else stream(None, StreamPosition()))
    return rate((b for b, _ in batches_), n_batches, size=lambda b: b.inputs.input_ids.shape[0])


def train_rate(data: CaptionPretrainData, pad_id: int, steps: int = 3, batch: int = 8) -> float:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    recipe = RECIPES["visualbert"]
    model = build_pretraining_model(model_config("visualbert-base", visual_dim=D, vocab_size=30522)).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    examples = [collate_pretrain([data[(0, i * batch + j)] for j in range(batch)], pad_id=pad_id) for i in range(steps + 1)]

    def step(b) -> None:
        loss = total_loss(pretrain_losses(recipe, run_model(recipe, model, b), b, recipe.objectives), recipe.objectives)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(examples[0])  # warm-up
    t = time.perf_counter()
    for b in examples[1:]:
        step(b)
    return steps * batch / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=at_least(32), default=2000, help="(the training step (c) reads 32 captions)")
    ap.add_argument("--store", help="an existing region store (default: write a random one)")
    ap.add_argument("--captions", help="its captions (required with --store)")
    ap.add_argument("--batches", type=at_least(1), default=60, help="batches of 64 timed per loader")
    ap.add_argument("--shard-size", type=at_least(1), default=250)
    ap.add_argument("--stream-batches", type=at_least(1), default=300,
                    help="batches of 64 timed for (d): several chunks of 2,500 examples, each worker's first included")
    args = ap.parse_args()
    if bool(args.store) != bool(args.captions):
        ap.error("--store and --captions go together (a store and the captions of its images)")
    torch.set_num_threads(1)  # loaders: the workers do the work; the main process only receives batches

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if args.store:
            store_path, refs = Path(args.store), read_caption_refs(args.captions)
        else:
            store_path = root / "features.h5"
            t = time.perf_counter()
            refs = random_store(store_path, args.images)
            print(f"wrote store: {args.images} images x {R} x {D} float16 in {time.perf_counter() - t:.1f}s")
        t = time.perf_counter()
        index = write_shards(store_path, refs, root / "shards", shard_size=args.shard_size)
        n_shards = len(shards_of_index(index))
        print(f"wrote {n_shards} shards in {time.perf_counter() - t:.1f}s")

        tok = TextTokenizer.train([r.text for r in refs[:5000]], vocab_size=200)
        store = RegionStore(store_path)
        data = CaptionPretrainData(refs, store, tok, feature_dim=D)
        data16 = CaptionPretrainData(refs, RegionStore(store_path, upcast=False), tok, feature_dim=D,
                                     region_setup=RegionSetup(float16=True))
        a, a16 = interleaved(lambda d: store_rate(d, tok.pad_id, args.batches), (data, data16))
        b = shard_rate(index, tok, args.batches)
        c = train_rate(data, tok.pad_id)
        d0 = pretrain_stream_rate(index, tok, args.stream_batches, 0)
        d2, d16 = interleaved(lambda f: pretrain_stream_rate(index, tok, args.stream_batches, WORKERS, f), (False, True))

    what = f"{len(store)} images of {args.store}" if args.store else f"{len(store)} images x {R} regions x {D}-d float16"
    print(f"\n{what}; loaders: {WORKERS} workers, batch {BATCH}")
    print(f"{'':44s}{'examples/s':>12s}{'x training':>12s}")
    print(f"{'(a) store -> CaptionPretrainData':44s}{a:12.0f}{a / c:11.0f}x")
    print(f"{'(b) shards -> ShardStream':44s}{b:12.0f}{b / c:11.0f}x")
    print(f"{'(c) VisualBERT-base training step, 2 threads':44s}{c:12.1f}{1:11.0f}x")
    print(f"{'(d) pretrain --shards stream, no workers':44s}{d0:12.0f}{d0 / c:11.0f}x")
    print(f"{'(d) pretrain --shards stream, 2 workers':44s}{d2:12.0f}{d2 / c:11.0f}x")
    print(f"(d) 2 workers read the pre-training stream {d2 / d0:.2f}x as fast as the training process alone")
    print(f"{'(a) float16 batches':44s}{a16:12.0f}{a16 / c:11.0f}x   {a16 / a:.2f}x float32 batches (medians of 3, interleaved)")
    print(f"{'(d) float16 batches, 2 workers':44s}{d16:12.0f}{d16 / c:11.0f}x   {d16 / d2:.2f}x float32 batches (medians of 3, interleaved)")


if __name__ == "__main__":
    guarded(main)
