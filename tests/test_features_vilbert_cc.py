"""ViLBERT's Conceptual Captions pre-training LMDB (`vilbert-cc-lmdb`, formats-and-metrics.md §1.3): our
MessagePack reader (`features/msgpack.py`) against byte strings written by hand to the specification, and
the importer on LMDBs written here as tensorpack's `LMDBSerializer` writes them (keys b"00000000", ...,
b"__keys__"; each datapoint [features, cls_prob, boxes, num_boxes, image_h, image_w, image_id, caption]
packed with msgpack_numpy, in the layouts of the old and the new msgpack, or pickled). The captions come
out as a COCO captions file that `vlberts pretrain` reads beside the store."""

from __future__ import annotations

import json
import os
import pickle
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from vlberts.data.task_texts import task_caption_refs
from vlberts.errors import VlbertsError
from vlberts.features import msgpack
from vlberts.features.importers import import_features
from vlberts.features.store import RegionStore

VLBERTS = Path(sys.executable).with_name("vlberts")


# --------------------------------------------------------------------------- a MessagePack writer for the fixtures

def pack(obj, new: bool = True) -> bytes:
    """MessagePack as the two msgpack generations write it: `new` (use_bin_type=True: bytes as bin, str8
    used) or old (bytes as raw str, no str8 and no bin), with numpy arrays and scalars as msgpack_numpy maps
    (byte-string keys in the new layout, text keys in the old one)."""
    if isinstance(obj, np.ndarray):
        k = (lambda s: s.encode()) if new else (lambda s: s)
        fields = {k("nd"): True, k("type"): obj.dtype.str, k("shape"): list(obj.shape), k("data"): obj.tobytes()}
        if new:
            fields[k("kind")] = b""
        return pack(fields, new)
    if isinstance(obj, np.generic):
        k = (lambda s: s.encode()) if new else (lambda s: s)
        return pack({k("nd"): False, k("type"): obj.dtype.str, k("data"): obj.tobytes()}, new)
    if obj is None:
        return b"\xc0"
    if isinstance(obj, bool):
        return b"\xc3" if obj else b"\xc2"
    if isinstance(obj, int):
        if 0 <= obj < 128:
            return bytes([obj])
        if -32 <= obj < 0:
            return bytes([obj & 0xFF])
        for code, fmt in ((0xCC, ">B"), (0xCD, ">H"), (0xCE, ">I"), (0xCF, ">Q")) if obj > 0 else \
                ((0xD0, ">b"), (0xD1, ">h"), (0xD2, ">i"), (0xD3, ">q")):
            try:
                return bytes([code]) + struct.pack(fmt, obj)
            except struct.error:
                continue
    if isinstance(obj, float):
        return b"\xcb" + struct.pack(">d", obj)
    if isinstance(obj, (str, bytes)):
        raw = obj.encode() if isinstance(obj, str) else obj
        n = len(raw)
        if isinstance(obj, bytes) and new:
            head = bytes([0xC4, n]) if n < 256 else (b"\xc5" + struct.pack(">H", n) if n < 65536 else b"\xc6" + struct.pack(">I", n))
        elif n < 32:
            head = bytes([0xA0 | n])
        elif n < 256 and new:
            head = bytes([0xD9, n])
        else:
            head = b"\xda" + struct.pack(">H", n) if n < 65536 else b"\xdb" + struct.pack(">I", n)
        return head + raw
    if isinstance(obj, (list, tuple)):
        n = len(obj)
        head = bytes([0x90 | n]) if n < 16 else b"\xdc" + struct.pack(">H", n) if n < 65536 else b"\xdd" + struct.pack(">I", n)
        return head + b"".join(pack(v, new) for v in obj)
    if isinstance(obj, dict):
        n = len(obj)
        head = bytes([0x80 | n]) if n < 16 else b"\xde" + struct.pack(">H", n) if n < 65536 else b"\xdf" + struct.pack(">I", n)
        return head + b"".join(pack(k, new) + pack(v, new) for k, v in obj.items())
    raise TypeError(type(obj))


# --------------------------------------------------------------------------- the reader, by the specification

SPEC_CASES = [  # (bytes as the specification lays them out, the value)
    (b"\x00", 0), (b"\x7f", 127), (b"\xff", -1), (b"\xe0", -32),
    (b"\xcc\xff", 255), (b"\xcd\x01\x00", 256), (b"\xce\x00\x01\x00\x00", 65536), (b"\xcf" + (2**40).to_bytes(8, "big"), 2**40),
    (b"\xd0\x80", -128), (b"\xd1\xff\x7f", -129), (b"\xd2\xff\xff\x7f\xff", -32769), (b"\xd3" + (-(2**40)).to_bytes(8, "big", signed=True), -(2**40)),
    (b"\xc0", None), (b"\xc2", False), (b"\xc3", True),
    (b"\xca\x3f\xc0\x00\x00", 1.5), (b"\xcb\x40\x09\x21\xfb\x54\x44\x2d\x18", 3.141592653589793),
    (b"\xa3abc", "abc"), (b"\xd9\x03abc", "abc"), (b"\xda\x00\x02\xc3\xa9", "\u00e9"), (b"\xdb\x00\x00\x00\x01z", "z"),
    (b"\xc4\x02\x00\xff", b"\x00\xff"), (b"\xc5\x00\x01\x07", b"\x07"), (b"\xc6\x00\x00\x00\x00", b""),
    (b"\x93\x01\xa1a\xc3", [1, "a", True]), (b"\xdc\x00\x02\x01\x02", [1, 2]), (b"\xdd\x00\x00\x00\x01\xc0", [None]),
    (b"\x82\xa1a\x01\xa1b\x92\x02\x03", {"a": 1, "b": [2, 3]}), (b"\xde\x00\x01\x01\x02", {1: 2}), (b"\xdf\x00\x00\x00\x00", {}),
]


@pytest.mark.parametrize("data,value", SPEC_CASES, ids=[d.hex() for d, _ in SPEC_CASES])
def test_msgpack_reads_each_type_of_the_specification(data, value):
    out = msgpack.unpackb(data)
    assert out == value and type(out) is type(value)


def test_msgpack_numpy_maps_become_arrays_in_both_layouts():
    a = np.arange(12, dtype="<f4").reshape(3, 4) / 7
    for new in (True, False):
        got = msgpack.unpackb(pack([a, np.int64(-5), np.float32(2.5), "x"], new))
        np.testing.assert_array_equal(got[0], a)
        assert got[0].dtype == a.dtype and got[0].flags.writeable
        assert got[1] == -5 and got[1].dtype == np.int64 and got[2] == np.float32(2.5)
        assert got[3] == "x"
    # old msgpack packs bytes as raw strings; bytes that are not UTF-8 still round-trip to the array
    b = np.array([[np.nan, -0.0], [1e-45, 3.4e38]], dtype="<f4")
    np.testing.assert_array_equal(msgpack.unpackb(pack(b, new=False)), b)
    # a map that only looks like one stays a map
    assert msgpack.unpackb(pack({"nd": "yes", "data": 1})) == {"nd": "yes", "data": 1}


@pytest.mark.parametrize("data,message", [
    (b"\x93\x01\x02", "truncated"),
    (b"\xc4\x05ab", "truncated: 5 bytes needed"),
    (b"\xdd\xff\xff\xff\xff", "truncated: a array of 4294967295 elements"),
    (b"\x01\x02", "1 bytes left after the object"),
    (b"\xc1", "byte 0xc1 at offset 0 is not a msgpack type"),
    (b"\xd4\x01\x00", "extension type"),
    (b"\x91" * 70 + b"\xc0", "nested deeper than 64"),
    (b"\x81\x91\x01\x02", "map key"),
    (pack({b"nd": True, b"type": "<f4", b"shape": [2, 2], b"data": b"\x00" * 12}), "(2, 2) with 12 bytes of data"),
    (pack({b"nd": True, b"type": "|O", b"shape": [1], b"data": b"\x00" * 8}), "dtype |O"),
    (pack({b"nd": True, b"type": "<f9", b"shape": [1], b"data": b""}), "dtype '<f9'"),
    (pack({b"nd": True, b"type": "|V8", b"kind": b"V", b"shape": [1], b"data": b""}), "structured dtype"),
    (pack({b"nd": True, b"type": "<f4", b"shape": [-1], b"data": b""}), "shape [-1]"),
])
def test_msgpack_refuses_what_is_malformed(data, message):
    with pytest.raises(ValueError) as err:
        msgpack.unpackb(data)
    assert message in str(err.value) and "\n" not in str(err.value)


# --------------------------------------------------------------------------- the LMDB, as ViLBERT's pre-training reads it

def _images(n: int = 4, dim: int = 6, classes: int = 5, pad_to: int = 0) -> list[dict]:
    """CC-style datapoints: crc32-of-URL ids; with `pad_to` the arrays hold more rows than num_boxes."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        w, h, k = 500 + 10 * i, 375 + 5 * i, 3 + i
        rows = max(k, pad_to)
        x1, y1 = rng.uniform(0, w / 2, rows), rng.uniform(0, h / 2, rows)
        boxes = np.stack([x1, y1, x1 + rng.uniform(5, w / 2, rows), y1 + rng.uniform(5, h / 2, rows)], 1).astype(np.float32)
        out.append({"id": zlib.crc32(f"http://example.com/{i}.jpg".encode()) & 0xFFFFFFFF, "w": w, "h": h, "n": k,
                    "features": rng.normal(size=(rows, dim)).astype(np.float32), "boxes": boxes,
                    "cls_prob": rng.dirichlet(np.ones(classes), rows).astype(np.float32),
                    "caption": f"a photo number {i} of a caf\u00e9"})
    return out


def _datapoint(im: dict) -> list:
    return [im["features"], im["cls_prob"], im["boxes"], im["n"], im["h"], im["w"], im["id"], im["caption"]]


def _write_cc_lmdb(path: Path, values: list[bytes], keys_value: bytes | None) -> None:
    """tensorpack's LMDBSerializer.save: keys '{:08}' in order, then b'__keys__' holding their list."""
    import lmdb

    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for i, v in enumerate(values):
            txn.put(f"{i:08}".encode("ascii"), v)
        if keys_value is not None:
            txn.put(b"__keys__", keys_value)
    env.close()


def _keys(n: int) -> list[bytes]:
    return [f"{i:08}".encode("ascii") for i in range(n)]


def _check(store_path: Path, captions_path: Path, images: list[dict]) -> None:
    with RegionStore(store_path) as store:
        assert store.ids() == [str(im["id"]) for im in images]
        for im in images:
            rec, n = store.get(str(im["id"])), im["n"]
            assert (rec.image_w, rec.image_h, rec.num_boxes) == (im["w"], im["h"], n)
            np.testing.assert_array_equal(rec.features, im["features"][:n])
            np.testing.assert_array_equal(rec.boxes, im["boxes"][:n])
            np.testing.assert_array_equal(rec.cls_prob, im["cls_prob"][:n])
            np.testing.assert_array_equal(rec.obj_id, im["cls_prob"][:n, 1:].argmax(1))  # background first, 0-based
            np.testing.assert_array_equal(rec.obj_conf, im["cls_prob"][:n, 1:].max(1))
    coco = json.loads(captions_path.read_text())
    assert [a["caption"] for a in coco["annotations"]] == [im["caption"] for im in images]
    assert [i["id"] for i in coco["images"]] == [im["id"] for im in images]  # the ids as written: ints
    # what `vlberts pretrain --captions=... --captions_format=coco` reads: every caption with its store id
    refs = task_caption_refs(captions_path, "coco")
    assert [(r.image_id, r.text) for r in refs] == [(str(im["id"]), im["caption"]) for im in images]


@pytest.mark.parametrize("layout", ["msgpack", "msgpack-old", "pickle"])
def test_vilbert_cc_lmdb_imports_the_features_and_the_captions(tmp_path, layout):
    pytest.importorskip("lmdb")
    images = _images(pad_to=5 if layout == "msgpack" else 0)  # padded rows beyond num_boxes are dropped
    dumps = {"msgpack": pack, "msgpack-old": lambda o: pack(o, new=False), "pickle": pickle.dumps}[layout]
    _write_cc_lmdb(tmp_path / "cc.lmdb", [dumps(_datapoint(im)) for im in images], dumps(_keys(len(images))))
    import_features(tmp_path / "cc.lmdb", "vilbert-cc-lmdb", tmp_path / "cc.h5", captions_out=tmp_path / "cc.json")
    _check(tmp_path / "cc.h5", tmp_path / "cc.json", images)


def test_vilbert_cc_lmdb_without_its_key_list_reads_the_database_order(tmp_path):
    pytest.importorskip("lmdb")
    images = _images(3)
    _write_cc_lmdb(tmp_path / "cc.lmdb", [pack(_datapoint(im)) for im in images], keys_value=None)
    # the captions file in a directory that does not exist yet, as the store may be
    captions = tmp_path / "new" / "dir" / "cc.json"
    import_features(tmp_path / "cc.lmdb", "vilbert-cc-lmdb", tmp_path / "cc.h5", captions_out=captions)
    _check(tmp_path / "cc.h5", captions, images)
    assert sorted(p.name for p in captions.parent.iterdir()) == ["cc.json"]  # the spool left nothing behind


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


@pytest.mark.parametrize("change,message", [
    (lambda dp: dp[:7], "expected the 8 fields features, cls_prob, boxes, num_boxes, image_h, image_w, image_id, caption, got 7 fields"),
    (lambda dp: dp[:3] + [9] + dp[4:], "features must be an array of at least num_boxes = 9 rows, got (4, 6)"),
    (lambda dp: dp[:7] + [""], "caption must be a non-empty string"),
    (lambda dp: dp[:6] + [[1]] + dp[7:], "image_id must be an integer or a string"),
    (lambda dp: dp[:3] + [-1] + dp[4:], "num_boxes must be an integer >= 0, got -1"),
])
def test_a_bad_cc_record_names_the_file_and_its_key_and_leaves_nothing(tmp_path, change, message):
    pytest.importorskip("lmdb")
    images = _images(3)
    values = [pack(_datapoint(im)) for im in images]
    values[1] = pack(change(_datapoint(images[1])))
    _write_cc_lmdb(tmp_path / "cc.lmdb", values, pack(_keys(3)))
    with pytest.raises(VlbertsError) as err:
        import_features(tmp_path / "cc.lmdb", "vilbert-cc-lmdb", tmp_path / "cc.h5", captions_out=tmp_path / "cc.json")
    assert message in err.value.message, err.value.message
    assert err.value.record == "key b'00000001'" and Path(err.value.path) == tmp_path / "cc.lmdb"
    assert not (tmp_path / "cc.h5").exists() and not (tmp_path / "cc.json").exists()


def test_cc_lmdb_damage_and_code_are_one_line_errors(tmp_path):
    pytest.importorskip("lmdb")
    images = _images(3)
    good = [pack(_datapoint(im)) for im in images]
    cases = {
        "truncated": (good[:1] + [good[1][:-7]] + good[2:], pack(_keys(3)), "key b'00000001'", "truncated"),
        "code": (good[:1] + [pickle.dumps(_datapoint(images[1])[:7] + [_RunsCode()])] + good[2:], pack(_keys(3)),
                 "key b'00000001'", "forbidden global posix.system"),
        "listed": (good[:2], pack(_keys(3)), "key b'00000002'", "listed in b'__keys__' but not in the database"),
        "keys": (good, pack([1, 2]), "key b'__keys__'", "not a list of byte strings"),
    }
    for name, (values, keys_value, record, message) in cases.items():
        _write_cc_lmdb(tmp_path / f"{name}.lmdb", values, keys_value)
        with pytest.raises(VlbertsError) as err:
            import_features(tmp_path / f"{name}.lmdb", "vilbert-cc-lmdb", tmp_path / "out.h5", captions_out=tmp_path / "c.json")
        assert err.value.record == record and message in err.value.message, (name, err.value)
        assert not (tmp_path / "out.h5").exists() and not (tmp_path / "c.json").exists()


def test_cli_imports_cc_with_captions_and_refuses_captions_for_other_formats(tmp_path):
    pytest.importorskip("lmdb")
    images = _images(3)
    _write_cc_lmdb(tmp_path / "cc.lmdb", [pack(_datapoint(im)) for im in images], pack(_keys(3)))
    run = subprocess.run([str(VLBERTS), "features", "import", str(tmp_path / "cc.lmdb"), "--format", "vilbert-cc-lmdb",
                          "--out", str(tmp_path / "cc.h5"), "--captions", str(tmp_path / "cc.json")],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "wrote " + str(tmp_path / "cc.h5") + ": 3 images, 12 boxes" in run.stdout
    assert "cc.json: each image's caption, in the COCO captions format" in run.stdout
    _check(tmp_path / "cc.h5", tmp_path / "cc.json", images)

    again = subprocess.run([str(VLBERTS), "features", "import", str(tmp_path / "cc.lmdb"), "--format", "vilbert-cc-lmdb",
                            "--out", str(tmp_path / "other.h5"), "--captions", str(tmp_path / "cc.json")],
                           capture_output=True, text=True)
    assert again.returncode == 2 and "cc.json: already exists" in again.stderr and len(again.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "other.h5").exists()

    (tmp_path / "f.tsv").write_text("")
    other = subprocess.run([str(VLBERTS), "features", "import", str(tmp_path / "f.tsv"), "--format", "butd-tsv",
                            "--out", str(tmp_path / "f.h5"), "--captions", str(tmp_path / "f.json")],
                           capture_output=True, text=True)
    assert other.returncode == 2 and "butd-tsv files hold no captions" in other.stderr
    assert len(other.stderr.strip().splitlines()) == 1


def test_vilbert_pretrains_on_an_imported_cc_lmdb(tmp_path):
    """The two files the import writes are what `vlberts pretrain` reads: ViLBERT's objectives, its masked
    multimodal modelling against the LMDB's class distributions (region_kl) included."""
    pytest.importorskip("lmdb")
    images = _images(8)
    _write_cc_lmdb(tmp_path / "cc.lmdb", [pack(_datapoint(im)) for im in images], pack(_keys(8)))
    import_features(tmp_path / "cc.lmdb", "vilbert-cc-lmdb", tmp_path / "cc.h5", captions_out=tmp_path / "cc.json")
    run = subprocess.run([str(VLBERTS), "pretrain", f"--captions={tmp_path / 'cc.json'}", f"--features={tmp_path / 'cc.h5'}",
                          "--model=vilbert-tiny", "--steps=2", "--batch_size=4", f"--out={tmp_path / 'pt'}"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    last = json.loads((tmp_path / "pt" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and all(np.isfinite(last[k]) and last[k] > 0 for k in ("mlm_loss", "region_kl_loss", "match_loss"))


# --------------------------------------------------------------------------- straight into shards (--shards)

def test_cc_lmdb_straight_into_shards_writes_what_the_store_then_shards_would(tmp_path):
    """`import_features(shards=True)` (no store in between) writes shard files byte for byte equal to those `write_shards`
    makes from the store and captions `import_features` writes; the index differs only in naming no store."""
    pytest.importorskip("lmdb")
    from vlberts.data.shards import read_index, write_shards

    images = _images(7, pad_to=9)
    _write_cc_lmdb(tmp_path / "cc.lmdb", [pack(_datapoint(im)) for im in images], pack(_keys(7)))
    import_features(tmp_path / "cc.lmdb", "vilbert-cc-lmdb", tmp_path / "cc.h5", captions_out=tmp_path / "cc.json")
    via_store = write_shards(tmp_path / "cc.h5", tmp_path / "cc.json", tmp_path / "a", shard_size=3)
    direct = import_features(tmp_path / "cc.lmdb", "vilbert-cc-lmdb", tmp_path / "b", shard_size=3, shards=True)
    a, b = read_index(via_store), read_index(direct)
    assert [s["name"] for s in b["shards"]] == ["shard-000000.tar", "shard-000001.tar", "shard-000002.tar"]
    for shard in a["shards"]:
        assert (tmp_path / "a" / shard["name"]).read_bytes() == (tmp_path / "b" / shard["name"]).read_bytes()
    assert (b["samples"], b["kinds"]["image-text"], b["shards"]) == (a["samples"], 7, a["shards"])
    assert b["store"]["path"] is None and a["store"]["path"] == str(tmp_path / "cc.h5")
    assert {k: v for k, v in b["store"].items() if k != "path"} == {k: v for k, v in a["store"].items() if k != "path"}
    assert b["store"]["metadata"]["source"]["format"] == "vilbert-cc-lmdb"  # the LMDB's hash, as in the store


def test_a_bad_record_stops_the_shard_import_with_no_index_and_the_shard_in_progress_removed(tmp_path):
    pytest.importorskip("lmdb")

    images = _images(6)
    values = [pack(_datapoint(im)) for im in images]
    odd = dict(images[4], cls_prob=np.full((images[4]["n"], 4), 0.25, np.float32))  # 4 classes where the rest have 5
    values[4] = pack(_datapoint(odd))
    _write_cc_lmdb(tmp_path / "cc.lmdb", values, pack(_keys(6)))
    with pytest.raises(VlbertsError) as err:
        import_features(tmp_path / "cc.lmdb", "vilbert-cc-lmdb", tmp_path / "s", shard_size=3, shards=True)
    assert "cls_prob has 4 classes but the shard set holds 5" in str(err.value) and "key b'00000004'" in str(err.value)
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["shard-000000.tar"]  # finished; no index, no temp file
    # in float16 a feature past its range is refused as the store writer refuses it, not written as inf
    values[4] = pack(_datapoint(dict(images[4], features=images[4]["features"] * 1e5)))
    _write_cc_lmdb(tmp_path / "big.lmdb", values, pack(_keys(6)))
    with pytest.raises(VlbertsError, match=r"key b'00000004'.*features values exceed the float16 range"):
        import_features(tmp_path / "big.lmdb", "vilbert-cc-lmdb", tmp_path / "t", "float16", shards=True)
    assert not (tmp_path / "t" / "shard-index.json").exists()
    with pytest.raises(VlbertsError, match="unknown store dtype 'bfloat16'; valid: float32, float16"):
        import_features(tmp_path / "cc.lmdb", "vilbert-cc-lmdb", tmp_path / "u", "bfloat16", shards=True)


def test_cli_imports_into_shards_that_pretrain_reads_and_refuses_mixed_targets(tmp_path):
    pytest.importorskip("lmdb")
    images = _images(8)
    _write_cc_lmdb(tmp_path / "cc.lmdb", [pack(_datapoint(im)) for im in images], pack(_keys(8)))
    base = [str(VLBERTS), "features", "import", str(tmp_path / "cc.lmdb"), "--format", "vilbert-cc-lmdb"]
    run = subprocess.run([*base, "--shards", str(tmp_path / "sh"), "--shard-size", "5", "--float16"],
                         capture_output=True, text=True)
    index = tmp_path / "sh" / "shard-index.json"
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == (f"wrote {index}: 8 samples (image-text 8) in 2 shard(s) (vlberts pretrain --shards={index})")
    assert json.loads(index.read_text())["store"]["dtype"] == "float16"
    run = subprocess.run([str(VLBERTS), "pretrain", f"--shards={index}", "--model=vilbert-tiny", "--steps=2",
                          "--batch_size=4", "--chunk_images=8", f"--out={tmp_path / 'pt'}"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    last = json.loads((tmp_path / "pt" / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 2 and all(np.isfinite(last[k]) and last[k] > 0 for k in ("mlm_loss", "region_kl_loss", "match_loss"))
    for extra, message in (([], "give --out (the store to write) or --shards"),
                           (["--out", str(tmp_path / "x.h5"), "--shards", str(tmp_path / "y")], "not both"),
                           (["--shards", str(tmp_path / "y"), "--captions", str(tmp_path / "c.json")], "they go into the shards")):
        run = subprocess.run([*base, *extra], capture_output=True, text=True)
        assert run.returncode == 2 and run.stderr.count("\n") == 1 and message in run.stderr, run.stderr
