"""Pre-training examples streamed from tar shards, for corpora that do not fit in memory (SPEC §6, issue 6).

`vlberts pretrain --shards=INDEX` reads the shards `data.shards.write_shards` wrote instead of a caption
file and a region store. Each rank streams its own endless sequence of image-text samples
(`ShardStream(resample=True)`: shards drawn with replacement from (seed, rank), a shuffle buffer), so
no rank waits for another at an epoch end and pre-training is counted in updates, as the papers count it.

The stream is cut into CHUNKS of `chunk_images` distinct images (all of them when the corpus has fewer). A chunk is a small in-memory corpus,
and the examples of an architecture are built from it by the same `CaptionPretrainData` the file-based
path uses: the same masking, the same region targets and tags, and the matching objective's other
captions and other images drawn from the chunk's other images (LXMERT §3.1.3 and ViLBERT §3.1 only need
"a sentence from another image"). A chunk's examples are visited in a permutation drawn from
(seed, rank, chunk), then the next chunk is read. H-VisualBERT's image-only samples (kind "image", its
`--unpaired_images` as shards) stream the same way, in chunks of images built into `ImageOnlyData`, and text-only
documents in chunks of documents (`stream_documents`). An image's questions (shards of LXMERT's corpus) join
its captions as `QuestionRef`s, which carry their answers for LXMERT's image QA (`--qa_lxmert`).

Position and exact resume: a rank's position is (chunk, examples of that chunk consumed, where its shard
reader stood when it began drawing that chunk: `ShardReader.state()`, the shard RNG, the shard being read
and how far, and the shuffle buffer as references). Its stream is a pure function of (seed, rank), so a
resumed run continues the reader from that state, re-reads the buffered samples' json and the current
shard's headers (not every sample before, so resuming costs the same at any point of a long run), draws
the same chunk again and continues with exactly the examples the uninterrupted run would have seen. The
stream reads each sample's json alone and its region arrays only when its chunk is built
(`read_shard(arrays=False)`, `load_arrays`). Checkpoints store every rank's position
(`TrainState.data["stream"]`); the world size must then stay the same. The split-invariance of the file-based path (the same update however a global batch is split
over ranks) does not carry over: ranks read different shards by design, as WebDataset training does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from vlberts.data.coco import CaptionRef
from vlberts.data.shards import (
    ShardReader,
    ShardStream,
    check_sample_record,
    document_sentences,
    index_store,
    load_arrays,
    read_index,
    sample_record,
    shards_of_index,
)
from vlberts.errors import VlbertsError
from vlberts.features.record import RegionRecord
from vlberts.training.distributed import DistInfo


@dataclass(frozen=True)
class StreamPosition:
    """Where a rank's stream stands: chunks finished, examples of the current chunk consumed, and where
    its shard reader stood when it began drawing the current chunk (`ShardReader.state()`; None: at the
    start, or a position saved before readers kept one, from which the chunks before are read again)."""

    chunk: int = 0
    offset: int = 0
    reader: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> StreamPosition:
        return cls(**d) if d else cls()


@dataclass(frozen=True)
class QuestionRef(CaptionRef):
    """A question of a chunk's image (LXMERT's corpus in shards): a pre-training sentence, with its answers
    {answer: score} for image QA."""

    label: dict[str, float] | None = None


class ShardCorpus:
    """A shard index's description of its corpus, standing in for a `RegionStore` where pre-training
    asks what the regions hold: `feature_dim`, `fields`, `metadata` (classes, attributes), `info()`."""

    def __init__(self, index: str | Path):
        self.path = Path(index)
        self.shards = shards_of_index(self.path)
        index = read_index(self.path)
        self.kinds = {k: int(v) for k, v in index.get("kinds", {}).items()}  # samples of each kind
        self.images = self.kinds.get("image-text", 0)  # captioned images
        self.questions = int(index.get("questions", 0))  # LXMERT's image-QA questions among their sentences
        self.qa_answer_counts: dict[str, int] = dict(index.get("qa_answer_counts", {}))  # best answers' counts
        if not index.get("store"):
            raise VlbertsError("shards hold no region features (written without a store)", path=self.path)
        self.feature_dim, self.fields, self.metadata = index_store(index, self.path)
        self._cls_prob: int | None = None
        self.head_sizes: dict[str, int] = {}  # obj_id / attr_id -> the model head's classes (set by pretrain)

    def info(self) -> dict[str, Any]:
        """`RegionStore.info`'s head-size entry: the number of cls_prob columns (read from one sample)."""
        if self._cls_prob is None and "cls_prob" in self.fields:
            first = ShardStream(self.shards[:1], shuffle=False, kinds=("image-text", "image"), dist=DistInfo())
            sample = next(iter(first), None)  # read by every rank alike (not split across ranks)
            if sample is None:
                raise VlbertsError("the first shard holds no image sample", path=self.shards[0])
            self._cls_prob = int(sample["cls_prob"].shape[1])
        return {"num_classes_cls_prob": self._cls_prob}

    def require_same_regions(self, other: ShardCorpus) -> ShardCorpus:
        """This corpus, if its regions are read as `other`'s are (feature width, fields, extractor, class and
        attribute names, cls_prob columns): a second stream of one run (H-VisualBERT's image-only shards beside
        the captions') feeds the same model. Else a one-line error naming the first difference. (Where the
        stores came from, `source`, may differ: the same extractor run over two sets of images.)"""
        mine, theirs = self.metadata.to_dict(), other.metadata.to_dict()

        def shown(v: Any) -> str:
            return f"{len(v)} entries" if isinstance(v, (list, tuple)) else repr(v)

        for what, a, b in (("feature width", self.feature_dim, other.feature_dim),
                           ("region fields", sorted(self.fields), sorted(other.fields)),
                           *((f"metadata {k}", mine[k], theirs[k]) for k in ("extractor", "weights_hash", "classes",
                                                                              "attributes")),
                           ("cls_prob columns", self.info()["num_classes_cls_prob"], other.info()["num_classes_cls_prob"])):
            if a != b:
                raise VlbertsError(f"these shards' {what} ({shown(a)}) differ from {other.path}'s ({shown(b)}): one run "
                                   "reads every stream's regions alike", path=self.path)
        return self

    def record(self, sample: dict[str, Any]) -> RegionRecord:
        """A sample's regions, checked against this index and the model's heads (`shards.check_sample_record`)."""
        info = self.info()
        return check_sample_record(
            sample, sample_record(sample), feature_dim=self.feature_dim, fields=self.fields,
            cls_prob_width=info["num_classes_cls_prob"], classes=self.metadata.classes,
            attributes=self.metadata.attributes, head_sizes=self.head_sizes)


class ChunkRegions:
    """The region records of one chunk's images, as a region source (`data.regions.RegionSource`)."""

    def __init__(self, records: dict[str, RegionRecord], path: Path):
        self.records, self.path = records, path

    def get(self, image_id: str) -> RegionRecord:
        rec = self.records.get(str(image_id))
        if rec is None:
            raise VlbertsError(f"image id {image_id} is not in the current chunk", path=self.path, record=image_id)
        return rec

    def __contains__(self, image_id: object) -> bool:
        return str(image_id) in self.records


# chunk captions, chunk regions, seed -> the architecture's examples over them (a `CaptionPretrainData`;
# for image-only chunks, no captions: an `ImageOnlyData` over the chunk's images, `ChunkRegions.records` in
# the order drawn)
MakeData = Callable[[list[CaptionRef], ChunkRegions, int], Any]


# What a stream of each sample kind reads: the least number of such images it needs, and their name.
_STREAMED_IMAGES = {"image-text": (2, "captioned image"), "image": (1, "image-only image")}


def stream_examples(
    corpus: ShardCorpus, make_data: MakeData, *, seed: int, chunk_images: int, dist: DistInfo,
    start: StreamPosition = StreamPosition(), buffer: int = 1000, reader: tuple[int, int] | None = None,
    kind: str = "image-text",
) -> Iterator[tuple[dict[str, Any], StreamPosition]]:
    """This rank's endless (example, position after it) pairs (module docstring), from `start` on; `reader`:
    which of a rank's loader-worker streams this is (`worker_batches`), None: the rank's one stream.
    `kind`: the samples read, "image-text" (captioned images), or "image" (image-only samples, H-VisualBERT's
    extra images: their chunks have no captions and `make_data` builds from the chunk's regions alone)."""
    least, what = _STREAMED_IMAGES[kind]
    if chunk_images < 2:
        raise VlbertsError(f"chunk_images must be >= 2 (matching draws another image), got {chunk_images}")
    n_images = corpus.kinds.get(kind, 0)
    if n_images < least:
        raise VlbertsError(f"the shards hold {n_images} {what}(s); pre-training on them needs {least} or more",
                           path=corpus.path)
    chunk_images = min(chunk_images, n_images)  # a chunk holds distinct images: at most all of them
    samples, chunk = _resumed(ShardStream(corpus.shards, seed=seed, resample=True, buffer=buffer, dist=dist,
                                          kinds=(kind,), arrays=False, reader=reader), start)  # arrays: chunks built
    rank_seed = seed * 1_000_003 + dist.rank  # the ranks' examples draw from different streams
    # Drawing with replacement, a chunk of every image of the corpus needs about n ln n draws and at most
    # a few n draws in a row without a new image (the chance of 50 n is e^-50). Fewer distinct images
    # than the index lists (an image in two shards: `shards --check` finds them) would otherwise never end.
    max_misses = 50 * n_images
    while True:
        at = samples.state()  # where this chunk's draws begin: its examples' positions carry it
        records: dict[str, RegionRecord] = {}
        captions: list[CaptionRef] = []
        misses = 0
        while len(records) < chunk_images:  # distinct images: resampling may draw one twice
            s = next(samples)
            if s["image_id"] in records:
                misses += 1
                if misses > max_misses:
                    raise VlbertsError(
                        f"{misses} samples in a row repeat images of a chunk of {len(records)}: the shards hold "
                        f"fewer distinct {what}s than the {n_images} their index lists (check them: "
                        f"python -m vlberts.data.shards --check {corpus.path})", path=corpus.path)
                continue
            misses = 0
            records[s["image_id"]] = corpus.record(load_arrays(s)) if chunk >= start.chunk else None
            captions.extend(CaptionRef(s["image_id"], c) for c in s.get("captions", ()))
            captions.extend(QuestionRef(s["image_id"], q["text"], q["label"]) for q in s.get("questions", ()))
        if chunk < start.chunk:  # consumed before the resume point: read, not built
            chunk += 1
            continue
        yield from _chunk_examples(make_data(captions, ChunkRegions(records, corpus.path), rank_seed), chunk,
                                   rank_seed, start, 0xC4, at)
        chunk += 1


def image_only_corpus(index: str | Path, captions: ShardCorpus) -> ShardCorpus:
    """The image-only samples of a shard index, as a second corpus of a run that streams `captions`
    (H-VisualBERT's `--unpaired_images`): an index without any, or whose regions are not read as the
    captions' are (`ShardCorpus.require_same_regions`), is a one-line error."""
    corpus = ShardCorpus(index)
    if corpus.kinds.get("image", 0) < 1:
        raise VlbertsError("the shards hold 0 image-only samples (write them with python -m vlberts.data.shards "
                           "--store FILE without --captions, or with --image-only for the uncaptioned images)", path=index)
    return corpus.require_same_regions(captions)


# chunk documents (lists of sentences), seed -> text-only examples over them (a `TextOnlyData`)
MakeText = Callable[[list[list[str]], int], Any]


def text_shards(index: str | Path) -> list[Path]:
    """The shards of a shard index that holds text-only documents (`write_shards(documents=...)`, or
    `python -m vlberts.data.shards --documents`); an index without any is a one-line error."""
    kinds = read_index(Path(index)).get("kinds", {})
    if int(kinds.get("text", 0)) < 2:
        raise VlbertsError(f"the shards hold {int(kinds.get('text', 0))} text-only document(s); a streamed text corpus "
                           "needs 2 or more (write them with python -m vlberts.data.shards --documents FILE)",
                           path=index)
    return shards_of_index(index)


def stream_documents(
    shards: list[Path], make_text: MakeText, *, seed: int, chunk_documents: int, dist: DistInfo,
    start: StreamPosition = StreamPosition(), buffer: int = 1000,
) -> Iterator[tuple[dict[str, Any], StreamPosition]]:
    """This rank's endless (text-only example, position after it) pairs from the text samples of `shards`:
    the same chunks, order and exact resume as `stream_examples` (module docstring), over documents. A
    chunk holds `chunk_documents` draws (resampling may draw a document twice, as an epoch over shards
    would not; next-sentence prediction's "another document" is drawn from the chunk)."""
    if chunk_documents < 2:
        raise VlbertsError(f"chunk_documents must be >= 2 (next-sentence prediction draws another document), "
                           f"got {chunk_documents}")
    samples, chunk = _resumed(ShardStream(shards, seed=seed, resample=True, buffer=buffer, dist=dist, kinds=("text",)),
                              start)
    rank_seed = seed * 1_000_003 + dist.rank
    while True:
        at = samples.state()
        docs = [document_sentences(next(samples)) for _ in range(chunk_documents)]
        if chunk < start.chunk:  # consumed before the resume point: read, not built
            chunk += 1
            continue
        yield from _chunk_examples(make_text(docs, rank_seed), chunk, rank_seed, start, 0x7E, at)
        chunk += 1


def _resumed(stream: ShardStream, start: StreamPosition) -> tuple[ShardReader, int]:
    """The shard reader of a stream that resumes at `start`, and the chunk it reads first: the current
    chunk's, from where its reader stood (`StreamPosition.reader`), or from the beginning, chunk 0, for a
    position without one (the chunks before `start.chunk` are then read again, not built)."""
    if start.reader is None:
        return iter(stream), 0
    return stream.resume(start.reader), start.chunk


def _chunk_examples(data: Any, chunk: int, rank_seed: int, start: StreamPosition, salt: int,
                    reader: dict[str, Any]) -> Iterator[tuple[dict[str, Any], StreamPosition]]:
    """A built chunk's examples in the order drawn from (rank seed, chunk), from the resume point on when
    `chunk` is the one the run stopped in; each with the position after it (`reader`: where the chunk's
    draws began)."""
    order = np.random.default_rng([rank_seed, chunk, salt]).permutation(len(data))
    for k in range(start.offset if chunk == start.chunk else 0, len(order)):
        yield data[(chunk, int(order[k]))], StreamPosition(chunk, k + 1, reader)


@dataclass(frozen=True)
class WorkerPositions:
    """Where a rank stands whose stream is read by loader workers (`worker_batches`): each worker stream's
    position, and which stream's batch comes next."""

    positions: tuple[StreamPosition, ...]
    next: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"workers": len(self.positions), "next": self.next, "positions": [p.to_dict() for p in self.positions]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerPositions:
        return cls(tuple(StreamPosition.from_dict(p) for p in d["positions"]), int(d["next"]))

    @classmethod
    def fresh(cls, workers: int) -> WorkerPositions:
        return cls(tuple(StreamPosition() for _ in range(workers)))


# (worker stream, its start) -> that stream's endless (batch, position after it) pairs
MakeBatches = Callable[[int, StreamPosition], Iterator[tuple[Any, StreamPosition]]]


class _WorkerStreams(IterableDataset):
    """What each DataLoader worker runs: worker w reads stream (w + start.next) mod W, so that the loader's
    round-robin over its workers hands out the streams' batches in the order the run left them."""

    def __init__(self, make_batches: MakeBatches, start: WorkerPositions):
        self.make_batches, self.start = make_batches, start

    def __iter__(self) -> Iterator[tuple[int, Any, StreamPosition]]:
        info = get_worker_info()
        workers = len(self.start.positions)
        if info is None or info.num_workers != workers:
            raise RuntimeError(f"worker streams run in a DataLoader of {workers} workers")
        stream = (info.id + self.start.next) % workers
        for batch, pos in self.make_batches(stream, self.start.positions[stream]):
            yield stream, batch, pos


def _as_is(item: Any) -> Any:
    return item


def worker_batches(make_batches: MakeBatches, start: WorkerPositions) -> Iterator[tuple[Any, WorkerPositions]]:
    """A rank's batches read by W loader workers, each its own stream (`make_batches(stream, start)`, e.g.
    `stream_batches(stream_examples(..., reader=(stream, W)))`), taken in turn: batch k comes from stream
    (start.next + k) mod W. Each with every stream's position after it, so a run resumed from them
    continues exactly with the same W (the streams differ from a one-stream run: W is part of the run)."""
    workers = len(start.positions)
    loader = DataLoader(_WorkerStreams(make_batches, start), batch_size=None, num_workers=workers,
                        collate_fn=_as_is)
    positions = list(start.positions)
    for stream, batch, pos in loader:  # in turn: the loader takes workers round-robin, in order
        positions[stream] = pos
        yield batch, WorkerPositions(tuple(positions), (stream + 1) % workers)


def stream_batches(
    examples: Iterator[tuple[dict[str, Any], StreamPosition]], collate: Callable[[list], Any], batch_size: int,
) -> Iterator[tuple[Any, StreamPosition]]:
    """Batches of `batch_size` consecutive examples, each with the position after its last example."""
    while True:
        items = [next(examples) for _ in range(batch_size)]
        yield collate([e for e, _ in items]), items[-1][1]
