"""Pre-training streamed from tar shards (`vlberts pretrain --shards`, data/pretrain_stream.py): examples come
from chunks of the stream, negatives from the chunk's other images, the stream resumes exactly where it
stopped (one process and two torchrun ranks), and misuse is a one-line error."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vlberts.data.coco import read_caption_refs
from vlberts.data.pretrain import MATCH, CaptionPretrainData
from vlberts.data.pretrain_stream import (
    ShardCorpus,
    StreamPosition,
    WorkerPositions,
    image_only_corpus,
    stream_documents,
    stream_examples,
    text_shards,
    worker_batches,
)
import vlberts.data.shards as shards_module
from vlberts.data.shards import write_shards
from vlberts.data.text_corpus import TextOnlyData, read_documents
from vlberts.errors import VlbertsError
from vlberts.recipes.pretrain import PretrainConfig, pretrain
from vlberts.recipes.pretrain_mix import streamed_batch_sizes
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.distributed import DistInfo, free_port
from vlberts.training.metrics import MetricsLog

from conftest import fails_if_it_hangs

VLBERTS = Path(sys.executable).with_name("vlberts")
TORCHRUN = Path(sys.executable).with_name("torchrun")


@pytest.fixture(scope="module")
def shards(tiny_world, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    return write_shards(tiny_world.store, tiny_world.captions_train, out, shard_size=8)


def _args(index: Path, out: Path, *extra: str) -> list[str]:
    return ["pretrain", f"--shards={index}", f"--out={out}", "--model=visualbert-tiny", "--vocab_size=200", "--steps=8",
            "--batch_size=4", "--lr=1e-3", "--log_every=1", "--ckpt_every=3", "--seed=1", "--chunk_images=6",
            "--shuffle_buffer=4", *extra]


def _cfg(index: Path, out: Path, **kw) -> PretrainConfig:
    base = dict(shards=str(index), out=str(out), model="lxmert-tiny", vocab_size=200, steps=8, batch_size=4, lr=1e-3,
                log_every=1, ckpt_every=3, seed=1, chunk_images=6, shuffle_buffer=4)
    return PretrainConfig(**{**base, **kw})


def test_resuming_a_stream_reads_its_current_chunk_not_the_ones_before(tiny_world, shards, monkeypatch):
    """A resumed stream continues its shard reader from the state saved with the position: it decodes the
    samples the shuffle buffer held and the current chunk's draws, however far the run had got."""
    decoded = [0]
    decode = shards_module._decode

    def counting(*args):
        decoded[0] += 1
        return decode(*args)

    monkeypatch.setattr(shards_module, "_decode", counting)
    corpus = ShardCorpus(shards)
    tok = TextTokenizer.train([c.text for c in read_caption_refs(tiny_world.captions_train)], vocab_size=200)

    def make(captions, regions, seed):
        return CaptionPretrainData(captions, regions, tok, pairs=False, mismatch_prob=0.5, seed=seed)

    stream = stream_examples(corpus, make, seed=3, chunk_images=6, dist=DistInfo(), buffer=4)
    items, reads_before = [], []  # samples decoded before each example was drawn
    for _ in range(400):
        reads_before.append(decoded[0])
        items.append(next(stream))
    first = {}  # chunk -> index of its first example
    for k, (_, pos) in enumerate(items):
        first.setdefault(pos.chunk, k)
    late = max(c for c in first if c + 1 in first)  # a chunk whose whole draw the run saw
    assert late >= 10
    k = first[late]  # resume just after this chunk's first example
    chunk_reads = reads_before[first[late + 1]] - reads_before[k]  # what drawing the next chunk read
    decoded[0] = 0
    again = stream_examples(corpus, make, seed=3, chunk_images=6, dist=DistInfo(), buffer=4, start=items[k][1])
    got = [next(again) for _ in range(first[late + 1] - k + 5)]  # into the next chunk
    assert [ex["image_id"] for ex, _ in got] == [ex["image_id"] for ex, _ in items[k + 1:k + 1 + len(got)]]
    assert [p for _, p in got] == [p for _, p in items[k + 1:k + 1 + len(got)]]
    # the buffer's 4 samples again, the resumed chunk's draws and the next chunk's: not the ~400 before
    assert decoded[0] <= 4 + 2 * chunk_reads + 8, (decoded[0], chunk_reads, reads_before[k])
    assert reads_before[k] > 4 * (decoded[0] + 1)


def test_stream_examples_come_from_chunks_and_resume_at_any_position(tiny_world, shards):
    corpus = ShardCorpus(shards)
    caption_image = {c.text: c.image_id for c in read_caption_refs(tiny_world.captions_train)}
    tok = TextTokenizer.train(list(caption_image), vocab_size=200)
    chunks: list[set[str]] = []

    def make(captions, regions, seed):
        chunks.append({c.image_id for c in captions})
        assert all(c.image_id in regions for c in captions)
        return CaptionPretrainData(captions, regions, tok, pairs=False, mismatch_prob=0.5, seed=seed)

    stream = stream_examples(corpus, make, seed=2, chunk_images=6, dist=DistInfo(), buffer=4)
    items = [next(stream) for _ in range(70)]
    assert len(chunks) >= 2 and all(len(c) == 6 for c in chunks)  # chunks of distinct images
    positions = [p for _, p in items]
    assert (positions[0].chunk, positions[0].offset) == (0, 1) and positions[-1].chunk >= 1
    # Each example's image is in its chunk; a mismatched caption is another image of the same chunk.
    for ex, pos in items:
        assert str(ex["image_id"]) in chunks[pos.chunk]
    assert {ex["match"] for ex, _ in items} == {0, 1}
    assert all(0 <= ex["match"] <= 1 for ex, _ in items) and any(ex["match"] == MATCH for ex, _ in items)

    # Started again at any position, the stream continues with exactly the same examples.
    for k in (0, 13, 29, 50):
        again = stream_examples(corpus, make, seed=2, chunk_images=6, dist=DistInfo(), buffer=4, start=positions[k])
        for (want, want_pos), (got, got_pos) in zip(items[k + 1:], (next(again) for _ in range(15))):
            assert want_pos == got_pos and want["image_id"] == got["image_id"] and want["match"] == got["match"]
            assert np.array_equal(want["ids"], got["ids"]) and np.array_equal(want["labels"], got["labels"])
    # A position saved before shard readers kept theirs (no `reader`) resumes too, reading the chunks before again.
    old = stream_examples(corpus, make, seed=2, chunk_images=6, dist=DistInfo(), buffer=4,
                          start=StreamPosition(positions[50].chunk, positions[50].offset))
    assert [next(old)[0]["image_id"] for _ in range(10)] == [ex["image_id"] for ex, _ in items[51:61]]
    # Another rank streams other examples.
    other = stream_examples(corpus, make, seed=2, chunk_images=6, dist=DistInfo(1, 2), buffer=4)
    assert [next(other)[0]["image_id"] for _ in range(10)] != [ex["image_id"] for ex, _ in items[:10]]


def test_a_resumed_stream_reads_the_features_of_built_chunks_only(tiny_world, shards, monkeypatch):
    """A position without its reader's state (saved before readers kept one) re-reads the chunks before it:
    that costs their json, not their region arrays."""
    corpus = ShardCorpus(shards)
    tok = TextTokenizer.train([c.text for c in read_caption_refs(tiny_world.captions_train)], vocab_size=200)
    built: list[set[str]] = []

    def make(captions, regions, seed):
        built.append({c.image_id for c in captions})
        return CaptionPretrainData(captions, regions, tok, pairs=False, mismatch_prob=0.5, seed=seed)

    decoded: set[str] = set()  # keys of the samples whose .npy members were decoded
    real = shards_module._array

    def spy(data, shard, key, field):
        decoded.add(key)
        return real(data, shard, key, field)

    corpus.info()  # reads the first sample whole once (the cls_prob width), before the spy
    monkeypatch.setattr(shards_module, "_array", spy)
    stream = stream_examples(corpus, make, seed=2, chunk_images=6, dist=DistInfo(), buffer=4, start=StreamPosition(3, 2))
    _, pos = next(stream)
    assert (pos.chunk, pos.offset) == (3, 3) and len(built) == 1  # chunks 0-2 were read, not built
    assert len(decoded) == 6  # the arrays of chunk 3's six images only


def test_streamed_pretraining_trains_and_resumes_exactly(shards, tmp_path):
    ref = pretrain(_cfg(shards, tmp_path / "ref"))
    log = MetricsLog.read(tmp_path / "ref" / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 9))
    assert all(np.isfinite(list(r.values())[1:]).all() for r in log)
    assert {"mlm_loss", "feat_loss", "obj_loss", "attr_loss", "match_loss"} <= log[-1].keys()
    assert (ref / "vocab.txt").is_file()  # the vocabulary was trained on the shards' captions

    run = tmp_path / "run"
    assert pretrain(_cfg(shards, run, stop_after=5)) is None  # last checkpoint: step 3
    assert pretrain(_cfg(shards, run)) == run / "model"
    assert [r["mlm_loss"] for r in MetricsLog.read(run / "metrics.jsonl")] == [r["mlm_loss"] for r in log]


def test_streamed_float16_batches_train_exactly_as_float32_ones(tiny_world, tmp_path):
    """Shards of a float16 store, streamed with --float16_batches=true (CUDA's default) and false: the same
    losses bit for bit (LXMERT: features zeroed, swapped with another image's, regressed)."""
    from vlberts.features.store import RegionStore, write_store_records

    with RegionStore(tiny_world.store) as s:
        store16 = write_store_records(tmp_path / "f16.h5", s.records(), dtype="float16", metadata=s.metadata)
    index = write_shards(store16, tiny_world.captions_train, tmp_path / "shards", shard_size=8)
    logs = []
    for flag in ("false", "true"):
        pretrain(_cfg(index, tmp_path / flag, steps=5, float16_batches=flag))
        logs.append([{k: v for k, v in r.items() if k.endswith("_loss")} for r in MetricsLog.read(tmp_path / flag / "metrics.jsonl")])
    assert logs[0] == logs[1] and len(logs[0]) == 5 and "feat_loss" in logs[0][-1]


def test_streamed_pretraining_misuse_is_one_clear_error(tiny_world, shards, tmp_path):
    with pytest.raises(VlbertsError, match="either --shards or --captions"):
        pretrain(_cfg(shards, tmp_path / "a", captions=str(tiny_world.captions_train)))
    with pytest.raises(VlbertsError, match=r"question files \(--qa_vqa_questions, --qa_gqa_questions\) do not stream"):
        pretrain(_cfg(shards, tmp_path / "b", qa_gqa_questions=str(tiny_world.root / "gqa" / "train_balanced_questions.json")))
    with pytest.raises(VlbertsError, match="chunk_images must be >= 2"):
        pretrain(_cfg(shards, tmp_path / "c", chunk_images=1))
    # A chunk larger than the corpus holds every image once (it does not wait for images that never come).
    assert pretrain(_cfg(shards, tmp_path / "big", chunk_images=10**6, steps=2)) == tmp_path / "big" / "model"
    # A caption-file run's checkpoint is not resumed by a streamed run.
    file_run = tmp_path / "d"
    pretrain(PretrainConfig(captions=str(tiny_world.captions_train), features=str(tiny_world.store), out=str(file_run),
                            model="lxmert-tiny", vocab_size=200, steps=4, batch_size=4, ckpt_every=2, stop_after=2))
    with pytest.raises(VlbertsError):
        pretrain(_cfg(shards, file_run, steps=4, ckpt_every=2))


def test_fewer_distinct_images_than_the_index_lists_is_an_error_not_a_hang(tiny_world, shards, tmp_path):
    # A shard copied over another: the index still counts its images, the stream holds fewer distinct ones.
    # A chunk of "all the corpus's images" could never be filled; the stream says so (and names --check)
    # instead of drawing forever.
    from vlberts.data.shards import shards_of_index

    d = tmp_path / "dup"
    d.mkdir()
    (d / shards.name).write_bytes(shards.read_bytes())
    files = shards_of_index(shards)
    for f in files:
        (d / f.name).write_bytes(files[0].read_bytes() if f == files[1] else f.read_bytes())
    corpus = ShardCorpus(d / shards.name)
    tok = TextTokenizer.train([c.text for c in read_caption_refs(tiny_world.captions_train)], vocab_size=200)

    def make(captions, regions, seed):
        return CaptionPretrainData(captions, regions, tok, pairs=False, mismatch_prob=0.5, seed=seed)

    stream = stream_examples(corpus, make, seed=0, chunk_images=10**6, dist=DistInfo(), buffer=4)
    with fails_if_it_hangs(), pytest.raises(VlbertsError, match=r"fewer distinct captioned images than the \d+ "
                                            r"their index lists \(check them: python -m vlberts.data.shards --check "):
        next(stream)
    # The untouched set fills such a chunk with every image.
    assert next(stream_examples(ShardCorpus(shards), make, seed=0, chunk_images=10**6, dist=DistInfo(), buffer=4))


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), "--nproc_per_node=2", f"--master_port={free_port()}", str(VLBERTS), *args]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)


# --------------------------------------------------------------------------- streamed text-only documents
@pytest.fixture(scope="module")
def text_index(tiny_world, tmp_path_factory) -> Path:
    """The world's text corpus (BERT's format) as text-only shards, each document with its sentences."""
    out = tmp_path_factory.mktemp("text-shards")
    return write_shards(None, None, out, shard_size=3, prefix="txt",
                        documents=read_documents(tiny_world.root / "text" / "documents.txt"))


def test_documents_stream_in_chunks_with_their_sentences_and_resume_at_any_position(tiny_world, text_index):
    docs = read_documents(tiny_world.root / "text" / "documents.txt")
    tok = TextTokenizer.train([s for d in docs for s in d], vocab_size=200)
    chunks: list[list[list[str]]] = []

    def make(chunk_docs, seed):
        chunks.append(chunk_docs)
        return TextOnlyData(chunk_docs, tok, feature_dim=8, nsp=True, seed=seed)

    stream = stream_documents(text_shards(text_index), make, seed=5, chunk_documents=4, dist=DistInfo(), buffer=2)
    items = [next(stream) for _ in range(60)]
    assert len(chunks) >= 2 and all(len(c) == 4 for c in chunks)
    assert all(d in docs for c in chunks for d in c)  # whole documents, sentence by sentence
    assert {ex["nsp"] for ex, _ in items} == {0, 1} and all(len(ex["regions"].feats) == 0 for ex, _ in items)
    for k in (0, 17, 41):
        again = stream_documents(text_shards(text_index), make, seed=5, chunk_documents=4, dist=DistInfo(), buffer=2,
                                 start=items[k][1])
        for (want, want_pos), (got, got_pos) in zip(items[k + 1:], (next(again) for _ in range(12))):
            assert want_pos == got_pos and np.array_equal(want["ids"], got["ids"]) and want["nsp"] == got["nsp"]


@pytest.mark.parametrize("model", ["vlbert-tiny", "wvisualbert-tiny"])
def test_streamed_runs_mix_in_streamed_documents_and_resume_exactly(shards, text_index, tmp_path, monkeypatch, model):
    """VL-BERT §3.3: half of every batch text-only, here streamed from text shards; W-VisualBERT §3: its
    text-only updates read the corpus (with next-sentence prediction) or the captions. Interrupted and
    resumed, both streams continue where they stood."""
    log = _extra_source_run_resumes_exactly(shards, tmp_path, monkeypatch, "TextOnlyData", dict(
        model=model, text_corpus=str(text_index), chunk_documents=5, objectives=""), "text_corpus", "text_stream")
    if model == "wvisualbert-tiny":  # unpaired: whole text-only updates (the corpus's or the captions') and image-only ones
        assert {r["source"] for r in log} == {"text", "image"}


def _extra_source_run_resumes_exactly(index: Path, tmp_path: Path, monkeypatch, made: str, extra: dict, option: str,
                                      key: str) -> list[dict]:
    """A streamed run with an extra source (`option`, built into chunks of 5 by `recipes.pretrain.<made>`):
    it trains, the source changes the losses, its stream's position (`key`) is in the checkpoint, and the
    run interrupted at step 5 and resumed repeats the uninterrupted one. Returns the reference run's log."""
    import vlberts.recipes.pretrain as recipe

    built: list[int] = []
    base = getattr(recipe, made)

    class Recording(base):
        def __init__(self, items, *a, **kw):
            built.append(len(items))
            super().__init__(items, *a, **kw)

    monkeypatch.setattr(recipe, made, Recording)
    ref = tmp_path / "ref"
    pretrain(_cfg(index, ref, **extra))
    log = MetricsLog.read(ref / "metrics.jsonl")
    assert built and set(built) == {5} and [r["step"] for r in log] == list(range(1, 9))
    # Without the source (and its ratio: --unpaired_ratio alone is refused, it would do nothing).
    off = {option: "", **({"unpaired_ratio": 0.0} if option == "unpaired_images" else {})}
    without = tmp_path / "without"
    pretrain(_cfg(index, without, **{**extra, **off}))
    assert [r["loss"] for r in MetricsLog.read(without / "metrics.jsonl")] != [r["loss"] for r in log]

    run = tmp_path / "run"
    assert pretrain(_cfg(index, run, stop_after=5, **extra)) is None  # last checkpoint: step 3
    state = json.loads(max((run / "checkpoints").glob("step_*/state.json")).read_text())
    assert set(state["data"]) == {"stream", key} and state["data"][key][0]["chunk"] >= 0
    # Resumed without the source: one line (the run's settings are part of its checkpoint).
    with pytest.raises(VlbertsError, match=rf"different settings \(.*{option} '.*index.json' -> ''"):
        pretrain(_cfg(index, run, **{**extra, **off}))
    assert pretrain(_cfg(index, run, **extra)) == run / "model"
    assert [r["loss"] for r in MetricsLog.read(run / "metrics.jsonl")] == [r["loss"] for r in log]
    return log


def test_streamed_text_misuse_is_one_clear_error(tiny_world, shards, text_index, tmp_path):
    docs = str(tiny_world.root / "text" / "documents.txt")
    with pytest.raises(VlbertsError, match="with --shards, --text_corpus is the index json of text-only shards"):
        pretrain(_cfg(shards, tmp_path / "a", model="vlbert-tiny", text_corpus=docs))
    with pytest.raises(VlbertsError, match="--text_corpus=INDEX.json streams text-only shards, which a streamed run"):
        pretrain(PretrainConfig(captions=str(tiny_world.captions_train), features=str(tiny_world.store),
                                out=str(tmp_path / "b"), model="vlbert-tiny", text_corpus=str(text_index)))
    with pytest.raises(VlbertsError, match="the shards hold 0 text-only document"):
        pretrain(_cfg(shards, tmp_path / "c", model="vlbert-tiny", text_corpus=str(shards)))
    with pytest.raises(VlbertsError, match="chunk_documents must be >= 2"):
        pretrain(_cfg(shards, tmp_path / "d", model="vlbert-tiny", text_corpus=str(text_index), chunk_documents=1))
    # Two ranks share every batch: 3 caption and 1 text example per batch of 4 cannot be split between them.
    with pytest.raises(VlbertsError, match=r"--batch_size=4 with --text_ratio=0.25 gives 3 pairs and 1 text examples, "
                                           r"not multiples of 2"):
        streamed_batch_sizes({"pairs": 3, "text": 1, "image_only": 0}, False, DistInfo(0, 2))
    assert streamed_batch_sizes({"pairs": 4, "text": 4, "image_only": 0}, False, DistInfo(0, 2)) == {"pairs": 2, "text": 2}
    assert streamed_batch_sizes({"pairs": 8, "text": 0, "image_only": 0}, True, DistInfo(0, 2)) == {"pairs": 4, "text": 4}


# --------------------------------------------------------------------------- loader workers
def _numbered_batches(stream: int, start: StreamPosition):
    """A stand-in worker stream: batch i of stream k is "k:i", with the position after it."""
    for i in itertools.count(start.offset):
        yield f"{stream}:{i}", StreamPosition(0, i + 1)


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_worker_streams_are_taken_in_turn_and_resume_where_they_stood():
    got = list(itertools.islice(worker_batches(_numbered_batches, WorkerPositions.fresh(3)), 7))
    assert [b for b, _ in got] == ["0:0", "1:0", "2:0", "0:1", "1:1", "2:1", "0:2"]
    after = got[4][1]  # after "1:1": stream 2 is next
    assert after == WorkerPositions((StreamPosition(0, 2), StreamPosition(0, 2), StreamPosition(0, 1)), 2)
    assert WorkerPositions.from_dict(json.loads(json.dumps(after.to_dict()))) == after
    again = [b for b, _ in itertools.islice(worker_batches(_numbered_batches, after), 4)]
    assert again == ["2:1", "0:2", "1:2", "2:2"]  # the uninterrupted order, worker 0 now reading stream 2


def test_streamed_pretraining_with_loader_workers_trains_and_resumes_exactly(shards, text_index, tmp_path):
    """--num_workers with --shards: each worker reads its own stream of the rank's shards; the checkpoint
    keeps every worker stream's position, and the resumed run repeats the uninterrupted one, also with
    text-only documents mixed in. Another --num_workers on resume is a one-line error."""
    for name, extra in (("lxmert", {}), ("vlbert", dict(model="vlbert-tiny", text_corpus=str(text_index),
                                                         chunk_documents=5))):
        ref = tmp_path / f"{name}-ref"
        pretrain(_cfg(shards, ref, num_workers=2, **extra))
        log = MetricsLog.read(ref / "metrics.jsonl")
        assert [r["step"] for r in log] == list(range(1, 9))
        run = tmp_path / f"{name}-run"
        assert pretrain(_cfg(shards, run, num_workers=2, stop_after=5, **extra)) is None  # last checkpoint: step 3
        state = json.loads(max((run / "checkpoints").glob("step_*/state.json")).read_text())
        assert state["data"]["stream"][0]["workers"] == 2 and len(state["data"]["stream"][0]["positions"]) == 2
        with pytest.raises(VlbertsError, match=r"read by 2 loader worker\(s\) per rank; a streamed run resumes with "
                                               r"the same --num_workers \(0 now\)"):
            pretrain(_cfg(shards, run, **extra))
        assert pretrain(_cfg(shards, run, num_workers=2, **extra)) == run / "model"
        assert [r["loss"] for r in MetricsLog.read(run / "metrics.jsonl")] == [r["loss"] for r in log]


# --------------------------------------------------------------------------- streamed image-only samples
@pytest.fixture(scope="module")
def h_index(tiny_world, tmp_path_factory) -> Path:
    """H-VisualBERT's corpus as one shard set: the training captions, those of the world's image-only set
    (unpaired_images.txt) withheld and its images written as image-only samples."""
    from vlberts.data.text_corpus import read_image_ids

    out = tmp_path_factory.mktemp("h-shards")
    return write_shards(tiny_world.store, tiny_world.captions_train, out, shard_size=8, prefix="h",
                        withhold=read_image_ids(tiny_world.root / "unpaired_images.txt"))


def test_image_only_samples_stream_in_chunks_without_text_and_resume_at_any_position(tiny_world, h_index):
    from vlberts.data.batch import IMAGE_ONLY
    from vlberts.data.pretrain import ImageOnlyData

    corpus = ShardCorpus(h_index)
    from vlberts.data.text_corpus import read_image_ids

    held = set(read_image_ids(tiny_world.root / "unpaired_images.txt"))
    captioned = {c.image_id for c in read_caption_refs(tiny_world.captions_train)} - held  # as written
    assert corpus.kinds == {"image-text": len(captioned), "image": len(held), "text": 0}
    tok = TextTokenizer.train([c.text for c in read_caption_refs(tiny_world.captions_train)], vocab_size=200)
    chunks: list[list[str]] = []

    def make(captions, regions, seed):
        assert captions == []  # image-only samples carry none
        chunks.append(list(regions.records))
        return ImageOnlyData(list(regions.records), regions, tok, seed=seed)

    stream = stream_examples(corpus, make, seed=3, chunk_images=5, dist=DistInfo(), buffer=4, kind="image")
    items = [next(stream) for _ in range(23)]
    assert len(chunks) >= 4 and all(len(set(c)) == len(c) == 5 for c in chunks)
    assert {str(ex["image_id"]) for ex, _ in items} <= held  # the image-only samples only
    assert all(ex["kind"] == IMAGE_ONLY and len(ex["ids"]) == 0 and len(ex["regions"].feats) > 0 for ex, _ in items)
    assert [(p.chunk, p.offset) for _, p in items[:6]] == [(0, k) for k in range(1, 6)] + [(1, 1)]
    for k in (0, 7, 16):
        again = stream_examples(corpus, make, seed=3, chunk_images=5, dist=DistInfo(), buffer=4, kind="image",
                                start=items[k][1])
        for (want, want_pos), (got, got_pos) in zip(items[k + 1:], (next(again) for _ in range(6))):
            assert want_pos == got_pos and want["image_id"] == got["image_id"]
            assert np.array_equal(want["regions"].feats, got["regions"].feats)
    # The caption stream of the same shards reads the captioned images only.
    pairs = stream_examples(corpus, lambda caps, regions, seed: CaptionPretrainData(caps, regions, tok, seed=seed),
                            seed=3, chunk_images=5, dist=DistInfo(), buffer=4)
    assert all(str(next(pairs)[0]["image_id"]) in captioned for _ in range(12))


def test_h_visualbert_streams_its_image_only_set_and_resumes_exactly(tiny_world, h_index, tmp_path, monkeypatch):
    """W-VisualBERT §4.3's H-VisualBERT, streamed: caption pairs from the shards' captioned images, plus
    --unpaired_ratio of every batch from their image-only samples (image objectives only), each stream
    with its own position in the checkpoint; interrupted and resumed = uninterrupted."""
    log = _extra_source_run_resumes_exactly(h_index, tmp_path, monkeypatch, "ImageOnlyData", dict(
        model="wvisualbert-h-tiny", unpaired_images=str(h_index), unpaired_ratio=0.25, chunk_images=5),
        "unpaired_images", "image_stream")
    assert all(np.isfinite(list(r.values())[1:]).all() for r in log)


def test_streamed_image_only_misuse_is_one_clear_error(tiny_world, shards, h_index, tmp_path):
    ids = str(tiny_world.root / "unpaired_images.txt")
    h = dict(model="wvisualbert-h-tiny")
    with pytest.raises(VlbertsError, match="with --shards, --unpaired_images is the index json of shards holding "
                                           "image-only samples"):
        pretrain(_cfg(h_index, tmp_path / "a", unpaired_images=ids, **h))
    with pytest.raises(VlbertsError, match="--unpaired_images=INDEX.json streams image-only shards, which a streamed"):
        pretrain(PretrainConfig(captions=str(tiny_world.captions_train), features=str(tiny_world.store),
                                out=str(tmp_path / "b"), unpaired_images=str(h_index), **h))
    with pytest.raises(VlbertsError, match=r"the shards hold 0 image-only samples \(write them with python -m "):
        pretrain(_cfg(h_index, tmp_path / "c", unpaired_images=str(shards), **h))
    with pytest.raises(VlbertsError, match="--unpaired_images is H-VisualBERT's"):
        pretrain(_cfg(h_index, tmp_path / "d", unpaired_images=str(h_index), model="wvisualbert-tiny"))
    # A ratio of image-only samples without the image-only set would be silently ignored.
    with pytest.raises(VlbertsError, match=r"--unpaired_ratio=0.25 is the share of --unpaired_images' image-only"):
        pretrain(_cfg(h_index, tmp_path / "e", unpaired_ratio=0.25, **h))
    # Two ranks share every batch: 3 caption and 1 image-only example per batch of 4 cannot be split.
    with pytest.raises(VlbertsError, match=r"--batch_size=4 with --unpaired_ratio=0.25 gives 3 pairs and 1 image_only "
                                           r"examples, not multiples of 2"):
        streamed_batch_sizes({"pairs": 3, "text": 0, "image_only": 1}, False, DistInfo(0, 2))
    # An image-only set whose regions are not the captions' (here: another feature width) is named.
    other = ShardCorpus(h_index)
    other.feature_dim += 1
    with pytest.raises(VlbertsError, match=r"these shards' feature width \(\d+\) differ from .*h-index.json's"):
        ShardCorpus(h_index).require_same_regions(other)
    other = ShardCorpus(h_index)
    other.metadata = dataclasses.replace(other.metadata, classes=["only one"])
    with pytest.raises(VlbertsError, match=r"metadata classes \(\d+ entries\) differ .*\(1 entries\)"):
        ShardCorpus(h_index).require_same_regions(other)


def test_an_index_with_bad_counts_or_no_shards_is_one_line_for_every_stream(shards, h_index, tmp_path):
    """Pre-training sizes its streams from the index's sample counts by kind: counts that are not whole
    numbers (a traceback, or 2.7 images read as 2) and an empty shard list are one line naming the index,
    whichever of --shards, --unpaired_images or --text_corpus it is given as."""
    obj = json.loads(h_index.read_text())
    bad = tmp_path / h_index.name
    for shard in shards_module.shards_of_index(h_index):
        (tmp_path / shard.name).write_bytes(shard.read_bytes())
    for kinds in ([1], {"image": "x"}, {"image-text": 2.7}, {"text": "many"}):
        bad.write_text(json.dumps({**obj, "kinds": kinds}))
        for read in (ShardCorpus, text_shards, lambda index: image_only_corpus(index, ShardCorpus(h_index))):
            with pytest.raises(VlbertsError, match=f"^{re.escape(str(bad))}: sample counts by kind must be whole"):
                read(bad)
    bad.write_text(json.dumps({**obj, "shards": []}))
    with pytest.raises(VlbertsError, match=f"^{re.escape(str(bad))}: the index's shard list is empty$"):
        ShardCorpus(bad)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not installed")
def test_two_ranks_stream_every_kind_and_resume_exactly(h_index, text_index, tmp_path):
    """Under torchrun each rank streams its own captions, text-only documents and image-only samples (one
    run reads all three: H-VisualBERT with a text corpus); the checkpoint keeps both ranks' positions in
    every stream, each with its shard reader's state, and the resumed run repeats the uninterrupted one.
    One process cannot take over two ranks' streams: a clear error, not a silently different run."""
    extra = ("--model=wvisualbert-h-tiny", "--batch_size=8", f"--unpaired_images={h_index}", "--unpaired_ratio=0.25",
             "--chunk_images=5", f"--text_corpus={text_index}", "--chunk_documents=5")
    proc = _torchrun(*_args(h_index, tmp_path / "ref"), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ref = MetricsLog.read(tmp_path / "ref" / "metrics.jsonl")
    assert all(r["tag_mlm_loss"] > 0 for r in ref)  # image-only samples (tags) were in every batch
    assert _torchrun(*_args(h_index, tmp_path / "run", "--stop_after=5"), *extra).returncode == 0
    state = json.loads(max((tmp_path / "run" / "checkpoints").glob("step_*/state.json")).read_text())
    for key in ("stream", "text_stream", "image_stream"):
        assert len(state["data"][key]) == 2 and all(p["reader"] for p in state["data"][key]), key
    proc = subprocess.run([str(VLBERTS), *_args(h_index, tmp_path / "run"), *extra], capture_output=True, text=True)
    assert proc.returncode == 2 and "same number of ranks" in proc.stderr and "Traceback" not in proc.stderr
    proc = _torchrun(*_args(h_index, tmp_path / "run"), *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["loss"] for r in MetricsLog.read(tmp_path / "run" / "metrics.jsonl")] == [r["loss"] for r in ref]
