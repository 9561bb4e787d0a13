"""What resuming a streamed pre-training costs (issue 6, item 4): the re-reading of the stream up to the
checkpoint's position, with each sample's json alone against each sample read whole.

    .venv/bin/python benchmarks/stream_resume.py [--images 2000] [--passes 3]

`vlberts pretrain --shards` resumes by re-reading its rank's stream up to the checkpoint's (chunk, offset)
(`data/pretrain_stream.py`): the stream is a pure function of (seed, rank), so the examples after the
position are exactly the uninterrupted run's. Writes a store of `--images` images x 36 regions of 2048-d
float16 (`loader_speed.random_store`) and shards of it, then times, in one process, median of `--passes`:

  (a) the stream read whole (`ShardStream(arrays=True)`, every .npy decoded): what each re-read sample
      cost before `read_shard(arrays=False)`;
  (b) the stream read as the resume reads it (`arrays=False`: json and tar headers, the .npy members
      stepped over), over the same samples;
  (c) `stream_examples` started at the chunk after those samples (chunks of 500 images), up to its first
      example: the whole resume, including building that chunk's examples.

The files were just written, so they are in the page cache; from a network file system or a cold disk
(a) also pays for reading 150 kB a sample, which (b) does not read.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from loader_speed import D, R, random_store

from vlberts.data.pretrain import CaptionPretrainData
from vlberts.data.pretrain_stream import ShardCorpus, StreamPosition, stream_examples
from vlberts.data.shards import ShardStream, shards_of_index, write_shards
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.distributed import DistInfo

CHUNK = 500


def replay(shards: list[Path], n: int, arrays: bool) -> float:
    """Seconds to read the first n samples of a resampling stream (the pre-training recipe's settings)."""
    stream = iter(ShardStream(shards, seed=0, resample=True, buffer=1000, dist=DistInfo(), kinds=("image-text",),
                              arrays=arrays))
    t = time.perf_counter()
    for _ in range(n):
        next(stream)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--shard-size", type=int, default=250)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        refs = random_store(root / "features.h5", args.images)
        index = write_shards(root / "features.h5", refs, root / "shards", shard_size=args.shard_size)
        shards = shards_of_index(index)
        n = 2 * args.images  # the resampled stream's first 2n draws: several chunks' worth
        whole = statistics.median(replay(shards, n, True) for _ in range(args.passes))
        light = statistics.median(replay(shards, n, False) for _ in range(args.passes))

        corpus = ShardCorpus(index)
        tok = TextTokenizer.train([r.text for r in refs[:5000]], vocab_size=200)

        def make(captions, regions, seed):
            return CaptionPretrainData(captions, regions, tok, feature_dim=D, seed=seed)

        def resume(chunk: int) -> float:
            t = time.perf_counter()
            next(stream_examples(corpus, make, seed=0, chunk_images=CHUNK, dist=DistInfo(),
                                 start=StreamPosition(chunk, 0)))
            return time.perf_counter() - t

        corpus.info()
        at0 = statistics.median(resume(0) for _ in range(args.passes))
        chunks = args.images // CHUNK * 2
        atk = statistics.median(resume(chunks) for _ in range(args.passes))

    print(f"{args.images} images x {R} regions x {D}-d float16 in {len(shards)} shards; median of {args.passes}")
    print(f"{'':52s}{'seconds':>9s}{'samples/s':>11s}")
    print(f"{'(a) stream read whole, ' + str(n) + ' samples':52s}{whole:9.2f}{n / whole:11.0f}")
    print(f"{'(b) stream read as a resume reads it, same samples':52s}{light:9.2f}{n / light:11.0f}")
    print(f"(b) re-reads {whole / light:.1f}x faster than (a)")
    print(f"{'(c) resume at chunk 0 (build one chunk)':52s}{at0:9.2f}")
    print(f"{f'(c) resume at chunk {chunks} (re-read {chunks} x {CHUNK} images, build one)':52s}{atk:9.2f}")


if __name__ == "__main__":
    main()
