"""What resuming a streamed pre-training costs (issue 6, item 4): a resume from the reader state a
checkpoint keeps, against re-reading the stream up to the position, at a position late in the run.

    .venv/bin/python benchmarks/stream_resume.py [--images 2000] [--passes 3] [--chunk K]

`vlberts pretrain --shards` keeps, with each rank's (chunk, offset), where its shard reader stood when it
began drawing that chunk (`ShardReader.state()`: shard RNG, the shard being read and how far, the
shuffle buffer as references; `data/pretrain_stream.py`). A resumed run continues the reader from there,
so the examples after the position are exactly the uninterrupted run's. A position saved without that
state (by an earlier version) is reached by re-reading the stream from its start, each sample's json and
tar headers only. Writes a store of `--images` images x 36 regions of 2048-d float16
(`loader_speed.random_store`) and shards of it, then times, in one process, median of `--passes`:

  (a) the stream read whole (`ShardStream(arrays=True)`, every .npy decoded);
  (b) the stream read as a re-read reads it (`arrays=False`: json and tar headers, the .npy members
      stepped over), over the same samples;
  (c) `stream_examples` resumed up to its first example (chunks of 500 images; the whole resume, building
      that chunk's examples included): at chunk 0, and at chunk --chunk (default 2 x --images / 500, at
      least 1: thousands of draws into the run), from its saved reader state and, as before readers kept one, by
      re-reading.

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
from timing import at_least, guarded

from vlberts.data.pretrain import CaptionPretrainData
from vlberts.data.pretrain_stream import ShardCorpus, StreamPosition, stream_examples
from vlberts.data.shards import ShardStream, shards_of_index, write_shards
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.distributed import DistInfo

CHUNK = 500


class Unbuilt:
    """A chunk's examples, not built: where only the positions of a stream are wanted."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: tuple[int, int]) -> None:
        return None


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
    ap.add_argument("--images", type=at_least(1), default=2000)
    ap.add_argument("--passes", type=at_least(1), default=3)
    ap.add_argument("--shard-size", type=at_least(1), default=250)
    ap.add_argument("--chunk", type=at_least(1), default=None,
                    help="the late position's chunk (default 2 x --images / 500, at least 1); the re-read grows with it")
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

        def resume(start: StreamPosition) -> float:
            t = time.perf_counter()
            next(stream_examples(corpus, make, seed=0, chunk_images=CHUNK, dist=DistInfo(), start=start))
            return time.perf_counter() - t

        # A position late in the run: where the stream stands after the chunks of its first n draws. The
        # chunks' draws, and so the position, do not depend on the examples built; cheap stand-ins go there.
        run = stream_examples(corpus, lambda captions, regions, seed: Unbuilt(len(captions)), seed=0,
                              chunk_images=CHUNK, dist=DistInfo())
        late = next(pos for _, pos in run if pos.chunk == (args.chunk or max(1, args.images // CHUNK * 2)))
        corpus.info()
        at0 = statistics.median(resume(StreamPosition()) for _ in range(args.passes))
        saved = statistics.median(resume(late) for _ in range(args.passes))
        reread = statistics.median(resume(StreamPosition(late.chunk, late.offset)) for _ in range(args.passes))

    print(f"{args.images} images x {R} regions x {D}-d float16 in {len(shards)} shards; median of {args.passes}")
    print(f"{'':58s}{'seconds':>9s}{'samples/s':>11s}")
    print(f"{'(a) stream read whole, ' + str(n) + ' samples':58s}{whole:9.2f}{n / whole:11.0f}")
    print(f"{'(b) stream read as a re-read reads it, same samples':58s}{light:9.2f}{n / light:11.0f}")
    print(f"(b) reads {whole / light:.1f}x faster than (a)")
    print(f"{'(c) resume at chunk 0 (build one chunk)':58s}{at0:9.2f}")
    print(f"{f'(c) resume at chunk {late.chunk}, from the saved reader state':58s}{saved:9.2f}")
    print(f"{f'(c) resume at chunk {late.chunk}, re-reading (no reader state)':58s}{reread:9.2f}")
    print(f"(c) at chunk {late.chunk}: the saved state resumes {reread / saved:.1f}x as fast as re-reading, "
          f"{saved / at0:.2f}x the time of a resume at chunk 0")


if __name__ == "__main__":
    guarded(main)
