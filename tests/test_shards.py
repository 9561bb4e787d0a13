"""WebDataset-style tar shards (issue 6, item 4): exact round trips from the region store, the rank x
worker split, resampling and weighted mixing, determinism, and one-line errors for damaged shards.
Every shard is written inside the test from the tiny world's store and captions."""

from __future__ import annotations

import io
import json
import tarfile
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from torch.utils.data import DataLoader

from vlberts.data.coco import read_caption_refs
from vlberts.data.shards import (
    REGION_FIELDS,
    ShardStream,
    document_sentences,
    load_arrays,
    main,
    mix_streams,
    read_shard,
    sample_regions,
    shards_of_index,
    split_shards,
    write_shards,
)
from vlberts.data.text_corpus import read_documents
from vlberts.errors import VlbertsError
from vlberts.features.store import RegionStore
from vlberts.training.distributed import DistInfo

from conftest import fails_if_it_hangs


@pytest.fixture(scope="module")
def shard_sets(tiny_world, tmp_path_factory):
    """Three corpora as shards: image-text (captioned images), image-only (every image), text-only."""
    out = tmp_path_factory.mktemp("shards")
    refs = read_caption_refs(tiny_world.captions_train)
    it = write_shards(tiny_world.store, refs, out, shard_size=7, prefix="it")
    img = write_shards(tiny_world.store, None, out, shard_size=16, prefix="img")
    txt = write_shards(None, None, out, shard_size=50, prefix="txt", documents=[r.text for r in refs])
    return {"it": it, "img": img, "txt": txt, "refs": refs}


def _key(sample: dict) -> str:
    return sample["__key__"]


def test_round_trip_is_exact(tiny_world, shard_sets):
    refs = shard_sets["refs"]
    by_image: dict[str, list[str]] = {}
    for r in refs:
        by_image.setdefault(r.image_id, []).append(r.text)
    index = json.loads(Path(shard_sets["it"]).read_text())
    assert index["samples"] == len(by_image) and index["kinds"]["image-text"] == len(by_image)
    assert [s["samples"] for s in index["shards"]][:-1] == [7] * (len(index["shards"]) - 1)

    store = RegionStore(tiny_world.store, upcast=False)
    seen = set()
    for shard in shards_of_index(shard_sets["it"]):
        for s in read_shard(shard):
            rec = store.get(s["image_id"])
            assert s["kind"] == "image-text" and s["captions"] == by_image[s["image_id"]]
            assert (s["image_w"], s["image_h"]) == (rec.image_w, rec.image_h)
            for name in REGION_FIELDS:
                a = getattr(rec, name)
                if a is None:
                    assert name not in s
                else:  # bit-exact, in the store's dtype
                    assert s[name].dtype == a.dtype and np.array_equal(s[name], a), name
            regions = sample_regions(s, max_regions=36)
            assert regions.feats.dtype == np.float32 and len(regions.feats) == min(36, rec.num_boxes)
            seen.add(s["image_id"])
    assert seen == set(by_image)

    img = json.loads(Path(shard_sets["img"]).read_text())
    assert img["kinds"] == {"image-text": 0, "image": len(store), "text": 0}
    texts = [s["text"] for sh in shards_of_index(shard_sets["txt"]) for s in read_shard(sh)]
    assert texts == [r.text for r in refs]


def _keys_of(index: Path, rank: int, world: int, workers: int, epoch: int) -> list[str]:
    stream = ShardStream.from_index(index, seed=3, epoch=epoch, buffer=5, dist=DistInfo(rank, world))
    if workers == 0:
        return [_key(s) for s in stream]
    loader = DataLoader(stream, batch_size=None, num_workers=workers, collate_fn=_key)
    return list(loader)


def test_rank_worker_split_covers_every_sample_once(shard_sets):
    index = shard_sets["it"]
    all_keys = sorted(_key(s) for sh in shards_of_index(index) for s in read_shard(sh))
    orders = []
    for epoch in (0, 1):
        got = [k for rank in (0, 1) for k in _keys_of(index, rank, 2, workers=2, epoch=epoch)]
        assert sorted(got) == all_keys  # every sample, exactly once, over 2 ranks x 2 workers
        orders.append(got)
    assert orders[0] != orders[1]  # a new shard order and shuffle each epoch

    n = len(shards_of_index(index))
    parts = [split_shards(n, rank=r, world=2, worker=w, num_workers=2, seed=0, epoch=0) for r in (0, 1) for w in (0, 1)]
    assert sorted(i for p in parts for i in p) == list(range(n))


def test_a_stream_takes_an_index_or_one_shard_as_a_path(shard_sets):
    """`ShardStream("shards/shard-index.json")` read the string as a list of one-letter shard names."""
    index = shard_sets["it"]
    shards = shards_of_index(index)
    keys = [_key(s) for s in ShardStream(shards, seed=3, dist=DistInfo())]
    assert [_key(s) for s in ShardStream(str(index), seed=3, dist=DistInfo())] == keys
    assert [_key(s) for s in ShardStream(index, seed=3, dist=DistInfo())] == keys
    one = [_key(s) for s in ShardStream(str(shards[0]), shuffle=False, buffer=0, dist=DistInfo())]
    assert one == [_key(s) for s in read_shard(shards[0])]


def test_resampling_draws_shards_uniformly_and_forever(shard_sets):
    shards = shards_of_index(shard_sets["img"])  # 4 shards
    stream = ShardStream(shards, seed=1, resample=True, dist=DistInfo())
    draws = Counter(p.name for _, p in zip(range(2000), stream.reader_shards()))
    p = 1 / len(shards)
    tol = 4 * (2000 * p * (1 - p)) ** 0.5  # 4 binomial standard deviations
    assert set(draws) == {s.name for s in shards}
    assert all(abs(c - 2000 * p) < tol for c in draws.values()), draws
    total = json.loads(Path(shard_sets["img"]).read_text())["samples"]
    samples = [s for _, s in zip(range(3 * total), stream)]
    assert len(samples) == 3 * total  # more than one pass: it never ends


@pytest.mark.parametrize("resample", [False, True])
def test_a_reader_continues_from_its_saved_state_exactly(shard_sets, resample):
    """`ShardReader.state()` at any point, through JSON, continues with the samples an unbroken reader gives:
    in the middle of a shard, at its end, and (one pass) while the shuffle buffer drains at the end."""
    index = shard_sets["it"]

    def stream(**kw):
        return ShardStream.from_index(index, seed=4, resample=resample, buffer=5, dist=DistInfo(), arrays=False, **kw)

    total = json.loads(Path(index).read_text())["samples"]
    n = 3 * total if resample else total
    reader = iter(stream())
    states, keys = [], []
    for _ in range(n):
        states.append(json.loads(json.dumps(reader.state())))
        keys.append(_key(next(reader)))
    if not resample:
        assert sorted(keys) == sorted(_key(s) for sh in shards_of_index(index) for s in read_shard(sh))
        assert next(reader, None) is None and states[-1]["drain"] is not None  # the last came from the buffer
    for k in sorted({1, 2, 7, n // 2, n - 3, n - 1}):
        again = stream().resume(states[k])
        assert [_key(s) for _, s in zip(range(n - k), again)] == keys[k:], k
        if not resample:
            assert next(again, None) is None
    with pytest.raises(VlbertsError, match="saved stream position of .* cannot continue"):
        ShardStream(shards_of_index(index)[:2], seed=4, resample=resample, buffer=5).resume(states[3])


def _mixed(shard_sets, seed: int):
    streams = [ShardStream.from_index(shard_sets[k], seed=seed, resample=True, buffer=20, dist=DistInfo())
               for k in ("it", "txt", "img")]
    return mix_streams(streams, [0.5, 0.3, 0.2], seed=seed)


def test_resampling_a_set_without_the_wanted_kind_is_an_error_not_a_hang(shard_sets):
    # Text-only shards asked for image-text samples: resampling would draw shards forever.
    stream = ShardStream(shards_of_index(shard_sets["txt"]), resample=True, buffer=0, dist=DistInfo(),
                         kinds=("image-text",))
    with fails_if_it_hangs(), pytest.raises(VlbertsError, match=r"shards drawn in a row hold no image-text sample, "
                                                                r"of \d+ shards"):
        next(iter(stream))
    # One shard in many with the kind is enough (the guard does not fire on bad luck).
    mixed = shards_of_index(shard_sets["txt"]) * 20 + shards_of_index(shard_sets["it"])[:1]
    stream = ShardStream(mixed, resample=True, buffer=0, dist=DistInfo(), kinds=("image-text",))
    samples = iter(stream)
    assert all(next(samples)["kind"] == "image-text" for _ in range(50))


def test_mixing_proportions_and_determinism(shard_sets):
    draws = [s for _, s in zip(range(2000), _mixed(shard_sets, seed=4))]
    counts = Counter(s["kind"] for s in draws)
    for kind, w in (("image-text", 0.5), ("text", 0.3), ("image", 0.2)):
        assert abs(counts[kind] - 2000 * w) < 4 * (2000 * w * (1 - w)) ** 0.5, counts
    again = [s for _, s in zip(range(2000), _mixed(shard_sets, seed=4))]
    assert [_key(s) for s in again] == [_key(s) for s in draws]
    other = [s for _, s in zip(range(2000), _mixed(shard_sets, seed=5))]
    assert [_key(s) for s in other] != [_key(s) for s in draws]

    # Same seed, same epoch: the same order; a finite stream that runs out is dropped from the mix.
    a = [_key(s) for s in ShardStream.from_index(shard_sets["it"], seed=9, buffer=8)]
    assert a == [_key(s) for s in ShardStream.from_index(shard_sets["it"], seed=9, buffer=8)]
    short = ShardStream.from_index(shard_sets["it"], seed=9, buffer=8)
    mixed = list(mix_streams([short, ShardStream.from_index(shard_sets["img"], buffer=0)], [0.9, 0.1], seed=0))
    n_images = json.loads(Path(shard_sets["img"]).read_text())["samples"]
    assert Counter(s["kind"] for s in mixed) == {"image-text": len(a), "image": n_images}


def _rewrite(src: Path, dst: Path, edit) -> None:
    """Copy a shard member by member; `edit(name, data)` returns new bytes, or None to drop the member."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w", format=tarfile.USTAR_FORMAT) as tout:
        for info in tin:
            data = edit(info.name, tin.extractfile(info).read())
            if data is not None:
                info.size = len(data)
                tout.addfile(info, io.BytesIO(data))


def _error(shard: Path, arrays: bool = True) -> str:
    with pytest.raises(VlbertsError) as e:
        [load_arrays(s) for s in read_shard(shard, arrays=arrays)]
    msg = str(e.value)
    assert "\n" not in msg and shard.name in msg
    return msg


@pytest.mark.parametrize("arrays", [True, False], ids=["arrays", "json-then-load_arrays"])
def test_damaged_shards_name_shard_and_key(shard_sets, tmp_path, arrays):
    src = shards_of_index(shard_sets["it"])[0]
    keys = [_key(s) for s in read_shard(src)]
    victim = keys[2]

    garbage = tmp_path / "garbage.tar"
    _rewrite(src, garbage, lambda n, d: b"not an npy file" if n == f"{victim}.features.npy" else d)
    assert f"key {victim}" in _error(garbage, arrays) and "features.npy" in _error(garbage, arrays)

    missing = tmp_path / "missing.tar"
    _rewrite(src, missing, lambda n, d: None if n == f"{victim}.boxes.npy" else d)
    assert f"key {victim}" in _error(missing, arrays) and "boxes.npy" in _error(missing, arrays)

    data = src.read_bytes()
    cut = tmp_path / "cut.tar"  # cut inside the features of the third sample
    with tarfile.open(src) as t:
        member = next(m for m in t if m.name == f"{victim}.features.npy")
    cut.write_bytes(data[: member.offset_data + 100])
    assert f"key {victim}" in _error(cut, arrays)

    headless = tmp_path / "headless.tar"  # cut at a member boundary: tarfile alone would stop quietly
    headless.write_bytes(data[: member.offset])
    msg = _error(headless, arrays)
    assert "truncated" in msg and f"key {victim}" in msg

    # Through the stream, the same one-line error reaches the caller.
    with pytest.raises(VlbertsError, match="garbage.tar"):
        [load_arrays(s) for s in ShardStream([garbage], buffer=0, dist=DistInfo(), arrays=arrays)]


def test_json_only_reading_loads_the_same_arrays_later(shard_sets, tmp_path):
    """read_shard(arrays=False) steps over the .npy members; load_arrays reads them, bit-exact, later."""
    for shard in shards_of_index(shard_sets["it"]):
        for full, light in zip(read_shard(shard), read_shard(shard, arrays=False), strict=True):
            assert set(light["__arrays__"]) == set(full["fields"])
            assert not any(f in light for f in full["fields"])  # nothing read yet
            loaded = load_arrays(light)
            assert loaded.keys() == full.keys() and "__arrays__" not in loaded
            for f in full["fields"]:
                assert loaded[f].dtype == full[f].dtype and np.array_equal(loaded[f], full[f])
    assert load_arrays(full) is full  # a sample read whole is returned as it is
    # A shard changed between the two reads: one line naming it and the key, not a wrong array.
    src = shards_of_index(shard_sets["it"])[0]
    copy = tmp_path / "changing.tar"
    copy.write_bytes(src.read_bytes())
    light = list(read_shard(copy, arrays=False))
    copy.write_bytes(src.read_bytes()[:1024])
    with pytest.raises(VlbertsError, match=f"changing.tar.*key {_key(light[-1])}"):
        load_arrays(light[-1])


def test_command_line(tiny_world, tmp_path, capsys):
    assert main(["--store", str(tiny_world.store), "--captions", str(tiny_world.captions_train),
                 "--out", str(tmp_path / "s"), "--shard-size", "25"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["shards"] == len(list((tmp_path / "s").glob("shard-*.tar"))) > 1
    # Overwritten by a set of fewer shards: the old set's later shards go too (a reader globbing shard-*.tar,
    # as WebDataset's patterns do, would read them with the new ones).
    assert main(["--store", str(tiny_world.store), "--captions", str(tiny_world.captions_train),
                 "--out", str(tmp_path / "s"), "--overwrite"]) == 0
    assert json.loads(capsys.readouterr().out)["shards"] == 1
    assert [p.name for p in (tmp_path / "s").glob("shard-*.tar")] == ["shard-000000.tar"]
    assert main(["--store", str(tmp_path / "nope.h5"), "--out", str(tmp_path / "t")]) == 2
    assert "nope.h5" in capsys.readouterr().err
    # --out naming a file (or a path under one): one line naming it, not a traceback from the shard writer.
    (tmp_path / "f").write_text("")
    for out in (tmp_path / "f", tmp_path / "f" / "sub"):
        assert main(["--store", str(tiny_world.store), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {out}: cannot make the output directory")
    # Bad arguments: one line and exit 2, not argparse's usage block first.
    for argv, message in ((["--store", "f.h5", "--bogus=1"], "unrecognized arguments: --bogus=1"),
                          ([], "writing shards needs --store"),
                          (["--check", "i.json", "--out", "d"], "--check reads a written shard set; it takes no --out")):
        with pytest.raises(SystemExit) as stop:
            main(argv)
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and err.startswith(f"error: {message}")


def test_command_line_reads_a_tasks_texts_as_captions(tiny_world, tmp_path, capsys):
    """--captions-format: a task's own texts (here VQA's questions, VisualBERT's task-specific pre-training) are
    each image's captions, as `vlberts pretrain --captions_format` reads them; an unknown format is one line."""
    from vlberts.data.vqa import read_vqa

    questions = tiny_world.vqa("train")[0]
    assert main(["--store", str(tiny_world.store), "--captions", str(questions), "--captions-format", "vqa",
                 "--out", str(tmp_path / "q")]) == 0
    capsys.readouterr()
    written = Counter((s["image_id"], c) for s in ShardStream(shards_of_index(tmp_path / "q" / "shard-index.json"),
                                                               shuffle=False, dist=DistInfo()) for c in s["captions"])
    assert written == Counter((str(q.image_id), q.question) for q in read_vqa(questions))
    assert main(["--store", str(tiny_world.store), "--captions", str(questions), "--captions-format", "vqq",
                 "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown captions format 'vqq'" in err
    # NLVR2's statements, each with each of its images, through the map of its image names (streamed NLVR2
    # task pre-training)
    from vlberts.data.task_texts import task_caption_refs

    nlvr2, names = tiny_world.root / "nlvr2" / "train.json", tiny_world.root / "nlvr2" / "images.json"
    assert main(["--store", str(tiny_world.store), "--captions", str(nlvr2), "--captions-format", "nlvr2",
                 "--image-map", str(names), "--out", str(tmp_path / "n")]) == 0
    capsys.readouterr()
    written = Counter((s["image_id"], c) for s in ShardStream(shards_of_index(tmp_path / "n" / "shard-index.json"),
                                                               shuffle=False, dist=DistInfo()) for c in s["captions"])
    assert written == Counter((r.image_id, r.text) for r in task_caption_refs(nlvr2, "nlvr2", image_map=names))


def test_documents_keep_their_sentences(tiny_world, tmp_path, capsys):
    """A BERT-format corpus (`--documents`) becomes text-only samples, one per document, each with its
    sentences (next-sentence prediction needs them) and their joined text (what other readers read)."""
    corpus = tiny_world.root / "text" / "documents.txt"
    assert main(["--documents", str(corpus), "--out", str(tmp_path / "d"), "--prefix", "txt", "--shard-size", "4"]) == 0
    summary = json.loads(capsys.readouterr().out)
    docs = read_documents(corpus)
    assert summary["kinds"] == {"image-text": 0, "image": 0, "text": len(docs)}
    samples = [x for sh in shards_of_index(summary["index"]) for x in read_shard(sh)]
    assert [document_sentences(x) for x in samples] == docs and [x["text"] for x in samples] == [" ".join(d) for d in docs]
    # A plain text is one sentence; a blank sentence is refused when written, naming the document.
    index = write_shards(None, None, tmp_path / "p", documents=["one text only.", ["first.", "second."]])
    assert [document_sentences(x) for sh in shards_of_index(index) for x in read_shard(sh)] == [
        ["one text only."], ["first.", "second."]]
    with pytest.raises(VlbertsError, match=r"q: record document 1: field sentences\[1\] is empty"):
        write_shards(None, None, tmp_path / "q", documents=[["fine."], ["fine.", "  "]])


def test_webdataset_reads_our_shards(tiny_world, shard_sets):
    # The layout is WebDataset's: its reader, given our shard files, yields the same samples (key, json,
    # one `<field>.npy` per region field, bit-exact) as ours.
    wds = pytest.importorskip("webdataset")
    shards = [str(s) for s in shards_of_index(shard_sets["it"])]
    ours = [s for sh in shards_of_index(shard_sets["it"]) for s in read_shard(sh)]
    theirs = list(wds.WebDataset(shards, shardshuffle=False, empty_check=False))
    assert [t["__key__"] for t in theirs] == [_key(s) for s in ours]
    for t, s in zip(theirs, ours, strict=True):
        meta = json.loads(t["json"])
        assert meta["image_id"] == s["image_id"] and meta["captions"] == s["captions"]
        fields = [name for name in REGION_FIELDS if name in s]
        assert sorted(k for k in t if k.endswith(".npy")) == sorted(f"{name}.npy" for name in fields)
        for name in fields:
            a = np.load(io.BytesIO(t[f"{name}.npy"]))
            assert a.dtype == s[name].dtype and np.array_equal(a, s[name]), name


def _npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def _load(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def test_sample_records_are_checked_against_their_index(shard_sets, tmp_path):
    # The index describes the corpus as a region store's datasets and metadata do; a sample that does not
    # fit it (or whose json lacks what its kind needs) is one line naming the shard file and the key,
    # where these used to end in a KeyError, an IndexError in LXMERT's loss, or a numpy broadcast error.
    from vlberts.data.pretrain_stream import ShardCorpus

    index = shard_sets["it"]
    shards = shards_of_index(index)
    victim_shard = shards[1]  # not the first: the corpus reads the cls_prob width off the first sample
    victim = _key(next(iter(read_shard(victim_shard))))

    def corpus_with(edit) -> tuple[ShardCorpus, Path]:
        d = tmp_path / f"set{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / index.name).write_bytes(index.read_bytes())
        for s in shards:
            if s == victim_shard:
                _rewrite(s, d / s.name, lambda n, b: edit(n, b) if n.startswith(f"{victim}.") else b)
            else:
                (d / s.name).write_bytes(s.read_bytes())
        return ShardCorpus(d / index.name), d / victim_shard.name

    def error(edit) -> str:
        corpus, shard = corpus_with(edit)
        with pytest.raises(VlbertsError) as e:
            for sample in read_shard(shard):
                corpus.record(sample)
        msg = str(e.value)
        assert msg.startswith(f"{shard}: record key {victim}: ") and "\n" not in msg
        return msg.split(": ", 2)[2]

    def json_edit(change):
        return lambda n, b: json.dumps(change(json.loads(b))).encode() if n.endswith(".json") else b

    def array_edit(field, change):
        return lambda n, b: _npy(change(_load(b))) if n == f"{victim}.{field}.npy" else b

    n_classes = len(ShardCorpus(index).metadata.classes)
    assert error(json_edit(lambda m: {k: v for k, v in m.items() if k != "captions"})) == \
        f"{victim}.json (image-text) has no captions"
    assert error(json_edit(lambda m: {**m, "captions": ["  "]})) == "field captions[0] is empty"
    assert error(array_edit("obj_id", lambda a: np.full_like(a, n_classes))) == \
        f"obj_id outside the shard set's {n_classes}-entry vocabulary (range {n_classes}..{n_classes})"
    assert error(array_edit("obj_id", lambda a: a.astype(np.float32) + 0.5)).startswith(
        "obj_id holds a fractional class index")
    assert error(array_edit("cls_prob", lambda a: a[:, :3])).startswith("cls_prob has 3 classes but the shard set")
    assert error(array_edit("features", lambda a: a[:, :-1])).startswith("features are")
    # A key written twice in one shard (its members apart): the reader refuses the second.
    corpus, shard = corpus_with(lambda n, b: b)
    doubled = tmp_path / "doubled.tar"
    with tarfile.open(shard) as tin, tarfile.open(doubled, "w", format=tarfile.USTAR_FORMAT) as tout:
        members = [(info, tin.extractfile(info).read()) for info in tin]
        for info, data in [*members, *[(i, d) for i, d in members if i.name.startswith(f"{victim}.")]]:
            tout.addfile(info, io.BytesIO(data))
    with pytest.raises(VlbertsError, match=f"doubled.tar: record key {victim}: sample key {victim} appears twice"):
        list(read_shard(doubled))
    # The untouched copy reads through.
    assert all(corpus.record(s) is not None for s in read_shard(shard))


def test_check_reads_a_whole_set_and_finds_what_lies_across_shards(shard_sets, tmp_path, capsys):
    # A rank reads only its own shards, so a key or an image id in two shards, or a shard unlike its index
    # entry, is found only by reading the whole set: `check_shard_set` / `--check`. Each problem is one line
    # naming the shard and the key; a damaged shard ends only itself.
    from vlberts.data.shards import check_shard_set

    for name in ("it", "img", "txt"):
        report = check_shard_set(shard_sets[name])
        index = json.loads(shard_sets[name].read_text())
        assert report.ok and report.problems == [] and report.shards == len(index["shards"])
        assert dict(report.kinds) == {k: v for k, v in index["kinds"].items() if v}

    index = shard_sets["it"]
    shards = shards_of_index(index)
    assert len(shards) >= 5

    def copy_set(edit_shards) -> Path:
        d = tmp_path / f"set{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / index.name).write_bytes(index.read_bytes())
        for s in shards:
            (d / s.name).write_bytes(s.read_bytes())
        edit_shards(d)
        return d / index.name

    def problems(idx: Path, **kw) -> list[str]:
        report = check_shard_set(idx, **kw)
        assert not report.ok and all("\n" not in p for p in report.problems)
        return report.problems

    first_keys = [_key(s) for s in read_shard(shards[0])]
    # Shard 1 replaced by a copy of shard 0 (same sample count, so the counts agree): every sample of it is
    # a duplicate, reported once, at shard 1, with the shard it was first read in.
    dup = copy_set(lambda d: (d / shards[1].name).write_bytes(shards[0].read_bytes()))
    at = dup.parent / shards[1].name
    assert problems(dup) == [f"{at}: record key {k}: sample key {k} is also in {shards[0].name}" for k in first_keys]

    # Another key for an image id already read: only the image id is a duplicate.
    victim = _key(next(iter(read_shard(shards[2]))))

    def rename(d: Path) -> None:
        src = d / shards[2].name
        tmp = d / "tmp.tar"
        _rewrite(src, tmp, lambda n, b: json.dumps({**json.loads(b), "image_id": first_keys[3]}).encode()
                 if n == f"{victim}.json" else b)
        tmp.replace(src)
    renamed = copy_set(rename)
    assert problems(renamed) == [f"{renamed.parent / shards[2].name}: record key {victim}: "
                                 f"image id {first_keys[3]} is also in {shards[0].name}"]

    # A missing shard, a truncated one, a shard with one sample fewer than its index entry, and a sample
    # whose regions misfit the index: four problems, and the check reads on past each.
    def damage(d: Path) -> None:
        (d / shards[0].name).unlink()
        data = (d / shards[1].name).read_bytes()
        (d / shards[1].name).write_bytes(data[: len(data) // 2])
        last = [_key(s) for s in read_shard(shards[2])][-1]
        _rewrite(shards[2], d / shards[2].name, lambda n, b: None if n.startswith(f"{last}.") else b)
        bad = _key(next(iter(read_shard(shards[3]))))
        _rewrite(shards[3], d / shards[3].name,
                 lambda n, b: _npy(np.full_like(_load(b), 10_000)) if n == f"{bad}.obj_id.npy" else b)
    damaged = copy_set(damage)
    found = problems(damaged)
    assert len(found) == 4
    assert found[0] == f"{damaged.parent / shards[0].name}: shard listed in the index is missing"
    assert found[1].startswith(f"{damaged.parent / shards[1].name}: ") and "truncated" in found[1]
    assert found[2] == f"{damaged.parent / shards[2].name}: holds 6 image-text samples; the index lists 7 image-text"
    assert "obj_id outside the shard set's" in found[3] and shards[3].name in found[3]
    report = check_shard_set(damaged)
    assert report.shards == len(shards) - 2  # all but the missing and the truncated one read to the end
    assert len(check_shard_set(damaged, max_problems=1).problems) == 1
    assert check_shard_set(damaged, max_problems=1).more_problems == 3

    # The command: one `error:` line per problem on stderr, the summary on stdout, exit 2 (0 when clean).
    assert main(["--check", str(damaged), "--max-problems", "2"]) == 2
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert lines[:2] == [f"error: {p}" for p in found[:2]] and lines[2] == "error: ... and 2 more problem(s)"
    assert json.loads(out.out)["problems"] == 4
    assert main(["--check", str(index)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["problems"] == 0 and summary["samples"] == json.loads(index.read_text())["samples"]
    assert main(["--check", str(tmp_path / "nope.json")]) == 2
    assert "nope.json" in capsys.readouterr().err
    # An index whose totals are not the sum of its shards' entries (edited by hand).
    edited = copy_set(lambda d: (d / index.name).write_text(json.dumps(
        {**json.loads(index.read_text()), "kinds": {"image-text": 1, "image": 0, "text": 0}})))
    n = json.loads(index.read_text())["kinds"]["image-text"]
    assert problems(edited) == [f"{edited}: the index's totals (1 image-text, 0 image, 0 text) are not the sum of "
                                f"its shards' entries ({n} image-text, 0 image, 0 text)"]
    # Image samples in a set whose index names no region store (a text-only set with an image shard added):
    # nothing to check their regions against, so each is a problem.
    txt_index = shard_sets["txt"]
    mixed_dir = tmp_path / "mixed"
    mixed_dir.mkdir()
    entries = json.loads(txt_index.read_text())
    for f in shards_of_index(txt_index) + [shards[0]]:
        (mixed_dir / f.name).write_bytes(f.read_bytes())
    it_entry = json.loads(index.read_text())["shards"][0]
    entries["shards"].append(it_entry)
    entries["kinds"]["image-text"] += it_entry["kinds"]["image-text"]
    (mixed_dir / txt_index.name).write_text(json.dumps(entries))
    found = problems(mixed_dir / txt_index.name)
    assert len(found) == len(first_keys) and all(
        p.endswith("image sample in a shard set whose index lists no region store") for p in found)
    # Counts that are not whole numbers: one line naming the index and the shard entry.
    counted = copy_set(lambda d: (d / index.name).write_text(json.dumps({**json.loads(index.read_text()), "shards": [
        {**e, "kinds": {"image-text": "seven"}} for e in json.loads(index.read_text())["shards"]]})))
    assert main(["--check", str(counted)]) == 2
    assert capsys.readouterr().err == (f"error: {counted}: record {shards[0].name}: sample counts by kind must be "
                                       "whole numbers, got {'image-text': 'seven'}\n")
    # An index that lists its shards wrongly is one line too, for the check and for streaming alike.
    broken = tmp_path / "broken-index.json"
    for obj in ({"format": "vlberts-shards", "shards": 3}, {"format": "vlberts-shards", "shards": [{"samples": 1}]},
                {"format": "vlberts-shards", "shards": [{"name": "s.tar"}], "store": {"fields": []}},
                {"format": "vlberts-shards", "shards": []}):
        broken.write_text(json.dumps(obj))
        assert main(["--check", str(broken)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {broken}: the index's") and err.count("\n") == 1
        with pytest.raises(VlbertsError, match="the index's"):
            shards_of_index(broken)


def test_withheld_captions_leave_their_images_as_image_only_samples(tiny_world, tmp_path, capsys):
    """`--withhold FILE` (H-VisualBERT's image-only set, W-VisualBERT §4.3): the listed images' captions are
    left out and the images written as "image" samples; the other captioned images as usual. An id the
    store lacks is one line naming the list's first missing id."""
    from vlberts.data.text_corpus import read_image_ids

    held_file = tiny_world.root / "unpaired_images.txt"
    held = set(read_image_ids(held_file))
    captioned = {c.image_id for c in read_caption_refs(tiny_world.captions_train)}
    assert main(["--store", str(tiny_world.store), "--captions", str(tiny_world.captions_train),
                 "--withhold", str(held_file), "--out", str(tmp_path / "h")]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["kinds"] == {"image-text": len(captioned - held), "image": len(held), "text": 0}
    samples = [x for sh in shards_of_index(summary["index"]) for x in read_shard(sh, arrays=False)]
    assert {x["image_id"] for x in samples if x["kind"] == "image"} == held
    assert all(x["captions"] == [] for x in samples if x["kind"] == "image")
    bad = tmp_path / "ids.txt"
    bad.write_text(f"{sorted(held)[0]}\nno-such-image\n")
    assert main(["--store", str(tiny_world.store), "--captions", str(tiny_world.captions_train),
                 "--withhold", str(bad), "--out", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {bad}: record line 2: image id no-such-image is not in")


def test_a_withheld_id_the_store_lacks_names_the_list_file_and_its_line(tiny_world, tmp_path, capsys):
    """The error for an id of the --withhold list that the store lacks named the store and the id only:
    it names the list and the id's line (the first such line), as any bad record of a file. A list saved
    with a UTF-8 byte-order mark (Windows editors) reads as without it."""
    from vlberts.data.text_corpus import read_image_ids

    held = read_image_ids(tiny_world.root / "unpaired_images.txt")
    ids = tmp_path / "ids.txt"
    ids.write_bytes(f"\ufeff{held[0]}\r\n\r\nzz-missing\r\n{held[1]}\r\naa-missing\r\n".encode())
    args = ["--store", str(tiny_world.store), "--captions", str(tiny_world.captions_train), "--withhold", str(ids)]
    assert main([*args, "--out", str(tmp_path / "bad")]) == 2
    assert capsys.readouterr().err == (f"error: {ids}: record line 3: image id zz-missing is not in the store "
                                       f"{tiny_world.store} (2 withheld id(s) missing from it)\n")
    assert not (tmp_path / "bad").exists()
    ids.write_bytes(f"\ufeff{held[0]}\r\n{held[1]}\r\n".encode())
    assert main([*args, "--out", str(tmp_path / "ok")]) == 0
    assert json.loads(capsys.readouterr().out)["kinds"]["image"] == 2


def test_npy_members_decode_as_numpy_reads_them_with_headers_parsed_once():
    """`_load_npy` parses each distinct .npy header once (numpy's parser was a sixth of a sample's decoding)
    and views the member's bytes: the arrays np.load gives, for format 1.0 and 2.0 headers, C and Fortran
    order; a damaged member is refused after its header was seen intact."""
    from vlberts.data import shards as shards_module

    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal((36, 8)).astype(np.float16), rng.uniform(0, 9, (36, 4)).astype(np.float32),
              np.asfortranarray(rng.standard_normal((3, 5))), np.arange(7, dtype=np.int64)]
    for version in ((1, 0), (2, 0)):
        for a in arrays:
            buf = io.BytesIO()
            np.lib.format.write_array(buf, a, version=version)
            for _ in range(2):  # parsed, then from the cache
                got = shards_module._load_npy(bytearray(buf.getvalue()))
                assert got.dtype == a.dtype and got.shape == a.shape and np.array_equal(got, a)
                assert got.flags.f_contiguous == a.flags.f_contiguous
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arrays[0])
    data = bytearray(buf.getvalue())
    assert any(key == bytes(data[: len(key)]) for key in shards_module._NPY_HEADERS)  # its header is cached
    with pytest.raises(ValueError):
        shards_module._load_npy(data[:-10])  # cut short: fewer bytes than the cached header's shape needs
    with pytest.raises(ValueError):
        shards_module._load_npy(bytearray(b"\x93NUMPX") + data[6:])  # another magic: numpy's parser refuses it


@pytest.mark.parametrize("fmt", ["ustar", "gnu", "pax", "pax-float-mtime", "v7", "mixed"])
def test_tar_headers_read_directly_agree_with_tarfile(shard_sets, tmp_path, fmt):
    """`read_shard` reads plain tar headers itself (`_tar_files`; tarfile's header decoding was a fifth of a
    streamed sample) and hands anything else to tarfile from that header on: shards written by other tools
    (GNU long-name records, pax headers as webdataset's writer emits for a float mtime, v7 headers, a
    directory member, a member name split into ustar's prefix) give the members tarfile lists, at the same
    offsets, and the same samples as our writer's shard."""
    from vlberts.data.shards import _tar_files

    src = shards_of_index(shard_sets["it"])[0]
    long_dir = "d" * 120  # past ustar's 100-byte name: a prefix (ustar), a long-name record (gnu), a pax path
    formats = {"ustar": tarfile.USTAR_FORMAT, "gnu": tarfile.GNU_FORMAT, "v7": tarfile.USTAR_FORMAT}
    dst = tmp_path / f"{fmt}.tar"
    with tarfile.open(src) as tin, tarfile.open(dst, "w", format=formats.get(fmt, tarfile.PAX_FORMAT)) as tout:
        folder = tarfile.TarInfo("adir/")  # a directory: by its type, and in v7 by its trailing slash
        folder.type = tarfile.DIRTYPE if fmt != "v7" else tarfile.AREGTYPE
        tout.addfile(folder)
        for i, info in enumerate(tin):
            data = tin.extractfile(info).read()
            new = tarfile.TarInfo(f"{long_dir}/{info.name}" if fmt in ("ustar", "gnu", "pax") else info.name)
            new.size = len(data)
            if fmt == "pax-float-mtime" or (fmt == "mixed" and i >= 4):
                new.mtime = 1234.5  # a float: tarfile's pax writer records it in an extended header
            tout.addfile(new, io.BytesIO(data))
    if fmt == "v7":  # the same bytes with ustar's magic blanked (and the checksum made right again)
        raw = bytearray(dst.read_bytes())
        for pos in range(0, len(raw), 512):
            if raw[pos + 257 : pos + 262] == b"ustar":
                raw[pos + 257 : pos + 265] = bytes(8)
                raw[pos + 148 : pos + 156] = b" " * 8
                raw[pos + 148 : pos + 155] = b"%06o\0" % sum(raw[pos : pos + 512])
        dst.write_bytes(bytes(raw))
    with tarfile.open(dst) as t:
        want = [(m.name, m.offset_data, m.size) for m in t if m.isfile()]
    with open(dst, "rb") as f:
        got = list(_tar_files(f, dst.stat().st_size))
    assert got == want and len(got) == len(list(tarfile.open(src)))
    ours = list(read_shard(src))
    theirs = list(read_shard(dst))
    assert [_key(s) for s in theirs] == [_key(s) for s in ours]
    for a, b in zip(ours, theirs, strict=True):
        assert all(np.array_equal(a[n], b[n]) for n in REGION_FIELDS if n in a) and a["captions"] == b["captions"]


def test_a_tar_header_with_a_wrong_checksum_is_reported_with_the_shard(shard_sets, tmp_path):
    src = shards_of_index(shard_sets["it"])[0]
    raw = bytearray(src.read_bytes())
    with tarfile.open(src) as t:
        third = [m for m in t][5]
    raw[third.offset + 10] ^= 0x01  # one bit of a member name: its header's checksum no longer adds up
    bad = tmp_path / "bad-checksum.tar"
    bad.write_bytes(bytes(raw))
    msg = _error(bad)
    assert "unreadable tar (a damaged header at byte" in msg and "record key" in msg  # tarfile alone: a quiet stop


def test_the_shard_writer_writes_what_tarfile_and_np_save_write(tmp_path):
    """Our tar and .npy writers against the standard ones: every member's header equal to tarfile's USTAR
    header (mode 644, owner 0, mtime 0) but the device-number fields (NUL in Python 3.11's tarfile for regular
    files, zeros in some versions) and so the checksum, the data and padding equal, the archive's end padded
    alike; each .npy equal to np.save's bytes; an id too long for a member name gets a numbered key."""
    from vlberts.data.shards import _npy_bytes, _sample_key, _ShardWriter

    rng = np.random.default_rng(0)
    arrays = [rng.normal(size=(3, 5)).astype(np.float16), rng.normal(size=(0, 7)).astype(np.float32),
              np.arange(4, dtype=np.int64), np.asfortranarray(rng.normal(size=(4, 3)).astype(np.float32)),
              rng.normal(size=(36, 2048)).astype(np.float32)]
    for a in arrays * 2:  # the second time from the header cache
        buf = io.BytesIO()
        np.save(buf, np.ascontiguousarray(a), allow_pickle=False)
        assert _npy_bytes(a) == buf.getvalue()
    samples = [(f"img{i}", {"json": json.dumps({"i": i}).encode() * (i * 37 + 1),
                            "features.npy": _npy_bytes(rng.normal(size=(i + 1, 9)).astype(np.float32))}) for i in range(5)]
    writer = _ShardWriter(tmp_path, "shard", 3)
    for key, members in samples:
        writer.add(key, members, "image")
    writer.close()
    expected = []
    for part in (samples[:3], samples[3:]):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for key, members in part:
                for ext, data in members.items():
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size, info.mode, info.mtime = len(data), 0o644, 0
                    tar.addfile(info, io.BytesIO(data))
        expected.append(buf.getvalue())
    for name, want in zip(("shard-000000.tar", "shard-000001.tar"), expected):
        got = (tmp_path / name).read_bytes()
        assert len(got) == len(want) and len(got) % 10240 == 0
        blanked = [bytearray(b) for b in (got, want)]
        with tarfile.open(tmp_path / name) as tar:  # tarfile accepts our checksums, and finds every member
            offsets = [m.offset for m in tar.getmembers()]
            assert [m.name for m in tar.getmembers()] == [f"{k}.{e}" for k, ms in (samples[:3] if name.endswith("0.tar") else samples[3:]) for e in ms]
        for b in blanked:
            for off in offsets:
                b[off + 148:off + 156] = bytes(8)
                b[off + 329:off + 345] = bytes(16)
        assert blanked[0] == blanked[1]
    assert _sample_key("a" * 80, 7) == "a" * 80 and _sample_key("a" * 81, 7) == "sample000000007"


def test_an_interrupted_overwrite_leaves_no_index_over_a_mix_of_sets(tiny_world, tmp_path, monkeypatch):
    """`--overwrite` replaced the shards one by one and wrote the new index last: stopped in between, the old
    index read the new set's first shards with the old set's last ones (another detector's features) as one
    set, and `--check` found nothing. The old index now goes before the first new shard is written; a set
    refused before anything was written (captions of an image the store lacks) keeps its index."""
    from vlberts.data import shards
    from vlberts.data.coco import CaptionRef

    refs = read_caption_refs(tiny_world.captions_train)
    out = tmp_path / "s"
    index = write_shards(tiny_world.store, refs, out, shard_size=10)
    old = index.read_text()
    with pytest.raises(VlbertsError, match="not in the store"):
        write_shards(tiny_world.store, [*refs, CaptionRef("no-such-image", "a caption")], out, shard_size=10,
                     overwrite=True)
    assert index.read_text() == old  # refused before writing: the old set stands

    class Stop(Exception):
        pass

    add, calls = shards._ShardWriter.add, []

    def stopping(self, *args, **kw):  # the run stopped while writing its third shard
        calls.append(1)
        if len(calls) == 25:
            raise Stop
        return add(self, *args, **kw)

    monkeypatch.setattr(shards._ShardWriter, "add", stopping)
    with pytest.raises(Stop):
        write_shards(tiny_world.store, refs, out, shard_size=10, overwrite=True)
    assert not index.exists() and (out / "shard-000001.tar").exists()


def test_ctrl_c_on_the_shard_writer_is_one_line(tiny_world, tmp_path, capsys, monkeypatch):
    """Ctrl-C on `python -m vlberts.data.shards` printed a 20-line KeyboardInterrupt traceback."""
    from vlberts.data import shards

    def interrupted(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(shards, "write_shards", interrupted)
    code = main(["--store", str(tiny_world.store), "--captions", str(tiny_world.captions_train), "--out",
                 str(tmp_path / "s")])
    assert code == 130
    assert capsys.readouterr().err == f"interrupted: no shard index written in {tmp_path / 's'}; run the command again\n"
