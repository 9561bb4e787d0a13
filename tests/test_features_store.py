"""The canonical region record and the HDF5 store: conventions, exact round-trips, O(1) lookup,
atomic writes, and use from DataLoader worker processes."""

from __future__ import annotations

import os
import pickle
import re
import time

import h5py
import numpy as np
import pytest

from vlberts.cli import main
from vlberts.errors import VlbertsError
from vlberts.features.record import RegionRecord, StoreMetadata, all_finite, as_float32
import vlberts.features.store as store_module
from vlberts.features.store import RegionStore, RegionStoreWriter, write_store_records


def make_record(image_id, n, d=6, c=None, objects=False, attrs=False, seed=0) -> RegionRecord:
    rng = np.random.default_rng(seed)
    xy = rng.uniform(0, 50, (n, 2)).astype(np.float32)
    wh = rng.uniform(1, 30, (n, 2)).astype(np.float32)
    kw = {}
    if c is not None:
        p = rng.random((n, c)).astype(np.float32)
        kw["cls_prob"] = p / p.sum(1, keepdims=True)
    if objects:
        kw.update(obj_id=rng.integers(0, 20, n), obj_conf=rng.random(n))
    if attrs:
        kw.update(attr_id=rng.integers(0, 7, n), attr_conf=rng.random(n))
    return RegionRecord(
        image_id=image_id,
        image_w=100 + n,
        image_h=80 + n,
        boxes=np.concatenate([xy, xy + wh], axis=1),
        features=rng.normal(size=(n, d)).astype(np.float32),
        **kw,
    )


def leftovers(directory) -> list[str]:
    """Temp files an interrupted write would leave (atomic writes name them .<name>.*.tmp)."""
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# --------------------------------------------------------------------------- record


def test_record_ids_are_strings_and_arrays_are_coerced():
    rec = RegionRecord(
        image_id=np.int64(42),
        image_w=np.int32(640),
        image_h=480,
        boxes=[[0, 0, 10, 20]],
        features=np.ones((1, 3), dtype=np.float64),
        obj_id=[5],
        obj_conf=[0.5],
    )
    assert rec.image_id == "42"
    assert (rec.image_w, rec.image_h, rec.num_boxes, rec.feature_dim) == (640, 480, 1, 3)
    assert rec.boxes.dtype == np.float32 and rec.features.dtype == np.float32
    assert rec.obj_id.dtype == np.int64 and rec.obj_conf.dtype == np.float32
    assert RegionRecord("COCO_val2014_000000131089", 1, 1, np.zeros((0, 4)), np.zeros((0, 3))).num_boxes == 0


@pytest.mark.parametrize(
    "change, words",
    [
        ({"boxes": np.zeros((2, 3))}, "boxes must have shape (N, 4)"),
        ({"features": np.zeros((3, 6))}, "features must have shape (2, D)"),
        ({"boxes": np.array([[10, 0, 5, 5], [0, 0, 1, 1]])}, "x2 >= x1"),
        ({"boxes": np.array([[0, 0, np.nan, 5], [0, 0, 1, 1]])}, "NaN"),
        ({"obj_id": np.zeros(2)}, "obj_id and obj_conf must be given together"),
        ({"attr_id": np.zeros(3), "attr_conf": np.zeros(3)}, "must have shape (2,)"),
        ({"cls_prob": np.zeros((2,))}, "cls_prob must have shape (2, C)"),
        ({"image_w": 0}, "image_w must be a positive integer"),
        ({"image_h": 1.5}, "image_h must be a positive integer"),
        ({"image_id": True}, "image id must be a string or an integer"),
        ({"image_id": "a\tb"}, "tab, newline or other control character"),
        ({"image_id": "a\x00b"}, "tab, newline or other control character"),  # HDF5 strings cannot hold NUL
        ({"features": np.full((2, 6), np.nan)}, "features hold NaN or inf"),
        ({"cls_prob": np.array([[0.5, np.inf], [0.5, 0.5]])}, "cls_prob holds NaN, inf or a negative value"),
        ({"cls_prob": np.array([[1.5, -0.5], [0.5, 0.5]])}, "cls_prob holds NaN, inf or a negative value"),
        ({"obj_id": np.zeros(2), "obj_conf": np.array([0.5, np.nan])}, "obj_conf must be confidences in [0, 1]"),
        ({"attr_id": np.zeros(2), "attr_conf": np.array([0.5, 7.5])}, "attr_conf must be confidences in [0, 1]"),
        ({"obj_id": np.array([-1, 0]), "obj_conf": np.ones(2)}, "obj_id holds a negative class index (-1)"),
        ({"boxes": np.array([[0, 0, 5, 5], [500, 5, 540, 9]])}, "box 1 [500.0, 5.0, 540.0, 9.0] lies outside the 10x10"),
        ({"boxes": np.array([[-3, 0, 5, 5], [0, 0, 1, 1]])}, "box 0 [-3.0, 0.0, 5.0, 5.0] lies outside"),
    ],
)
def test_record_validation_is_one_line(change, words):
    base = dict(image_id="img", image_w=10, image_h=10, boxes=np.zeros((2, 4)), features=np.zeros((2, 6)))
    with pytest.raises(VlbertsError) as e:
        RegionRecord(**{**base, **change})
    assert words in str(e.value) and "\n" not in str(e.value)


def test_metadata_rejects_unknown_keys():
    with pytest.raises(VlbertsError, match="unknown store metadata key.*extracter"):
        StoreMetadata.from_dict({"extracter": "typo"})


# --------------------------------------------------------------------------- store


def test_store_round_trip_is_exact_with_every_field(tmp_path):
    recs = [make_record(f"img{i}", n, c=5, objects=True, attrs=True, seed=i) for i, n in enumerate([3, 0, 36, 1])]
    meta = StoreMetadata(
        extractor="test-detector",
        weights_hash="sha256:abc",
        settings={"box_policy": "10-36", "conf_thresh": 0.2, "min_boxes": 10, "max_boxes": 36, "feature_layer": "pool5"},
        classes=[f"c{i}" for i in range(20)],
        attributes=[f"a{i}" for i in range(7)],
    )
    path = tmp_path / "s.h5"
    with RegionStoreWriter(path, 6, metadata=meta, with_cls_prob=5, with_objects=True, with_attrs=True) as w:
        for r in recs:
            w.add(r)
    with RegionStore(path) as s:
        assert len(s) == 4 and s.ids() == ["img0", "img1", "img2", "img3"]
        for r in recs:
            got = s.get(r.image_id)
            assert got.differences(r) == []
            assert got.features.dtype == np.float32 and got.obj_id.dtype == np.int64
        assert s.metadata == meta
        assert s.image_size("img2") == (136, 116) and s.num_boxes("img2") == 36
        info = s.info()
    assert info["num_images"] == 4 and info["num_boxes"] == 40
    assert info["boxes_per_image"] == {"min": 0, "mean": 10.0, "max": 36}
    assert info["fields"] == ["boxes", "features", "cls_prob", "obj_id", "obj_conf", "attr_id", "attr_conf"]
    assert (info["feature_dim"], info["dtype"], info["num_classes_cls_prob"]) == (6, "float32", 5)
    assert (info["classes_vocab_size"], info["attributes_vocab_size"]) == (20, 7)
    assert info["metadata"]["settings"]["box_policy"] == "10-36"


def test_float16_storage_is_close_and_upcast_by_default(tmp_path):
    recs = [make_record(i, 12, d=64, c=9, seed=i) for i in range(5)]
    write_store_records(tmp_path / "f16.h5", recs, dtype="float16")
    with h5py.File(tmp_path / "f16.h5") as f:
        assert f["features"].dtype == np.float16 and f["cls_prob"].dtype == np.float16
        assert f["boxes"].dtype == np.float32  # boxes stay exact pixels
    with RegionStore(tmp_path / "f16.h5") as s:
        assert s.dtype == "float16"
        for r in recs:
            got = s.get(int(r.image_id))  # int ids are looked up by their decimal string
            assert got.features.dtype == np.float32
            np.testing.assert_allclose(got.features, r.features, rtol=1e-3, atol=1e-4)
            np.testing.assert_allclose(got.cls_prob, r.cls_prob, rtol=1e-3, atol=1e-4)
            np.testing.assert_array_equal(got.boxes, r.boxes)
    with RegionStore(tmp_path / "f16.h5", upcast=False) as s:
        assert s.get("0").features.dtype == np.float16


def test_fast_float16_conversion_and_finiteness_agree_with_numpy_bit_for_bit():
    """`as_float32` (torch's vectorised conversion) and `all_finite` (float16 by its exponent bits), which the
    store and the loaders use for speed, against numpy on every one of the 65,536 float16 bit patterns, and on
    strided, read-only and float32 arrays; a float16 NaN or inf in a stored record is still refused."""
    every = np.arange(65536, dtype=np.uint16).view(np.float16)
    finite = np.isfinite(every)
    assert np.array_equal(as_float32(every[finite]).view(np.uint32), every[finite].astype(np.float32).view(np.uint32))
    assert [all_finite(every[i:i + 1]) for i in range(65536)] == finite.tolist()
    strided, read_only = every[finite][::3], every[finite].copy()
    read_only.flags.writeable = False
    for a in (strided, read_only):
        assert np.array_equal(as_float32(a), a.astype(np.float32))
    f32 = np.ones((2, 3), np.float32)
    assert as_float32(f32) is f32 and all_finite(f32) and not all_finite(np.array([1.0, np.nan], np.float32))
    bad = np.zeros((1, 2), np.float16)
    bad[0, 1] = np.inf
    with pytest.raises(VlbertsError, match="features hold NaN or inf"):
        RegionRecord("x", 10, 10, np.zeros((1, 4)), bad)


def test_float16_overflow_is_an_error(tmp_path):
    rec = RegionRecord("big", 10, 10, np.zeros((1, 4)), np.full((1, 2), 1e6))
    with pytest.raises(VlbertsError, match="exceed the float16 range"):
        write_store_records(tmp_path / "s.h5", [rec], dtype="float16")
    assert not (tmp_path / "s.h5").exists() and leftovers(tmp_path) == []


def test_missing_id_names_store_and_id(tmp_path):
    path = write_store_records(tmp_path / "s.h5", [make_record("a", 2)])
    with RegionStore(path) as s:
        assert "a" in s and "b" not in s and 3 not in s
        with pytest.raises(VlbertsError) as e:
            s.get("b")
    assert str(e.value) == f"{path}: record b: image id b not in store"
    assert e.value.path == str(path) and e.value.record == "b"


def test_a_coco_image_is_found_by_its_id_and_by_its_file_stem(tmp_path, capsys):
    """LXMERT's TSVs key COCO images by file stem, VQA's and Pythia's files by COCO id: a store written either
    way answers both (the record keeps the id it was written with), saying so once a store (a number alone
    does not say whose image it is); other ids are not touched."""
    stems = write_store_records(tmp_path / "stems.h5", [
        make_record("COCO_val2014_000000000042", 2), make_record("COCO_train2014_000000000009", 3, seed=1),
        make_record("7", 1, seed=2), make_record("vg_42x", 1, seed=3)])
    numbers = write_store_records(tmp_path / "numbers.h5", [make_record(42, 2), make_record(9, 3, seed=1)])
    with RegionStore(stems) as s, RegionStore(numbers) as n:
        for store in (s, n):
            assert 42 in store and "42" in store and "COCO_test2015_000000000042" in store
            assert store.num_boxes(9) == store.num_boxes("COCO_train2014_000000000009") == 3
            assert np.array_equal(store.get(42).features, store.get("COCO_val2014_000000000042").features)
        assert s.get(42).image_id == "COCO_val2014_000000000042" and n.get("COCO_val2014_000000000042").image_id == "42"
        assert s.get(7).image_id == "7" and "COCO_val2014_000000000007" not in n
        assert "0042" not in s and 43 not in s and "x42" not in s and "COCO_val2014_x" not in s
        with pytest.raises(VlbertsError, match="image id 43 not in store"):
            s.get(43)
    err = capsys.readouterr().err.splitlines()
    assert err == [f"warning: {stems}: image 42 found as COCO_val2014_000000000042 (COCO's two names for one image: "
                   "its id and its file stem); this store must hold COCO images under those numbers",
                   f"warning: {numbers}: image COCO_test2015_000000000042 found as 42 (COCO's two names for one "
                   "image: its id and its file stem); this store must hold COCO images under those numbers"]
    with RegionStore(numbers) as n:  # an exact id says nothing
        assert n.get(42).image_id == "42"
    assert capsys.readouterr().err == ""


def test_a_number_naming_two_images_of_a_mixed_store_is_an_error(tmp_path):
    """LXMERT's COCO and Visual Genome TSVs in one store: "42" (a Visual Genome image) and
    COCO_val2014_000000000042 (a COCO one). A VQA file's 42 means the COCO image, a GQA file's the Visual Genome
    one; the store cannot tell, so a plain 42 is an error naming both; the stem and other numbers are read."""
    mixed = write_store_records(tmp_path / "mixed.h5", [
        make_record("COCO_val2014_000000000042", 2), make_record("42", 3, seed=1), make_record("2354786", 1, seed=2)])
    with RegionStore(mixed) as s:
        with pytest.raises(VlbertsError) as err:
            s.get(42)
        assert s.get("COCO_val2014_000000000042").num_boxes == 2 and s.get("2354786").num_boxes == 1
    assert str(err.value) == (f"{mixed}: record image 42: image id 42 is ambiguous in this store: it holds 42 and "
                              "COCO_val2014_000000000042 (a number names a COCO image or another data set's, e.g. Visual "
                              "Genome's); name COCO images by file stem (LXMERT's question lists) or read a store of one "
                              "data set")


@pytest.mark.parametrize(
    "bad, words",
    [
        (make_record("a", 2, seed=9), "duplicate image id a (first added as image #0)"),
        (make_record("c", 2, d=5), "feature width 5 but the store holds 6-d features"),
        (make_record("c", 2, objects=True), "record has objects but the store does not hold them"),
        (make_record("c", 2, c=3), "record has cls_prob but the store does not hold them"),
    ],
)
def test_writer_errors_name_the_record_and_leave_nothing(tmp_path, bad, words):
    path = tmp_path / "s.h5"
    with pytest.raises(VlbertsError) as e:
        with RegionStoreWriter(path, 6) as w:
            w.add(make_record("a", 2))
            w.add(make_record("b", 3))
            w.add(bad)
    assert words in str(e.value) and f"record {bad.image_id}" in str(e.value)
    assert not path.exists() and leftovers(tmp_path) == []


def test_vocabulary_range_is_checked(tmp_path):
    rec = make_record("a", 4, objects=True)  # obj_id in [0, 20)
    with pytest.raises(VlbertsError, match="obj_id outside the store's 3-entry vocabulary"):
        write_store_records(tmp_path / "s.h5", [rec], metadata={"classes": ["a", "b", "c"]})


def test_interrupt_keeps_the_previous_store(tmp_path):
    path = write_store_records(tmp_path / "s.h5", [make_record("old", 2)])
    with pytest.raises(KeyboardInterrupt):
        with RegionStoreWriter(path, 6) as w:
            w.add(make_record("new", 2))
            raise KeyboardInterrupt
    with RegionStore(path) as s:
        assert s.ids() == ["old"]
    assert leftovers(tmp_path) == []


def test_not_a_store_is_a_clear_error(tmp_path):
    (tmp_path / "text.h5").write_text("hello")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["x"] = 1
    with pytest.raises(VlbertsError, match=r"not a region store \(an HDF5 file\): features in another format become "
                                           "a store with `vlberts features import`"):
        RegionStore(tmp_path / "text.h5")
    (tmp_path / "shard-index.json").write_text("{}")
    with pytest.raises(VlbertsError, match=r"shard-index.json: not a region store \(an HDF5 file\): a shard index: "
                                           "pass it as --shards"):
        RegionStore(tmp_path / "shard-index.json")
    with pytest.raises(VlbertsError, match="not a vlberts-region-store"):
        RegionStore(tmp_path / "other.h5")
    with pytest.raises(VlbertsError, match="region store not found"):
        RegionStore(tmp_path / "absent.h5")


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_rows_are_read_straight_from_the_file_as_hdf5_reads_them(tmp_path, monkeypatch, dtype):
    """`RawRows` reads an image's rows at the byte offsets HDF5 gives for its chunks: the same bytes as h5py's
    own read, for every field, across chunk edges (small chunks here) and for images without boxes; a
    dataset stored another way (compressed) is read through h5py, with the same records."""
    monkeypatch.setattr(store_module, "_CHUNK_BYTES", 200)  # chunks of a few rows: images span several
    recs = [make_record(f"im{i}", n, c=5, objects=True, attrs=True, seed=i)
            for i, n in enumerate([3, 0, 36, 1, 7, 0, 12, 5])]
    path = tmp_path / "s.h5"
    meta = StoreMetadata(classes=[f"c{i}" for i in range(20)], attributes=[f"a{i}" for i in range(7)])
    with RegionStoreWriter(path, 6, dtype=dtype, metadata=meta, with_cls_prob=5, with_objects=True,
                           with_attrs=True) as w:
        for r in recs:
            w.add(r)
    with RegionStore(path) as s, h5py.File(path) as f:
        offset, count = f["offset"][()], f["count"][()]
        assert f["features"].chunks[0] < 36 and f["boxes"].chunks[0] < 36  # the 36-box image spans chunks
        for name in s.fields:
            for i in range(len(recs)):
                want = f[name][offset[i] : offset[i] + count[i]]
                got = s._rows(name, int(offset[i]), int(count[i]))
                assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes(), (name, i)
        assert all(isinstance(s._raw[name], store_module.RawRows) for name in s.fields)  # none through h5py
        for r in recs:
            assert s.get(r.image_id).differences(r if dtype == "float32" else s.get(r.image_id)) == []
        stored = [s.get(r.image_id) for r in recs]
    with h5py.File(path, "a") as f:  # the features again, compressed: HDF5 must decode them
        data = f["features"][()]
        del f["features"]
        f.create_dataset("features", data=data, chunks=(4, 6), compression="gzip")
    with RegionStore(path) as s:
        assert [s.get(r.image_id).differences(want) for r, want in zip(recs, stored)] == [[]] * len(recs)
        assert s._raw["features"] is None and isinstance(s._raw["boxes"], store_module.RawRows)
    if os.path.isdir("/proc/self/fd"):  # the file descriptor goes with the store, closed or dropped unclosed
        import gc

        gc.collect()  # earlier tests' unreachable objects may hold descriptors: closed now, not during the count
        before = len(os.listdir("/proc/self/fd"))
        for _ in range(30):
            RegionStore(path).get("im0")
        gc.collect()
        assert len(os.listdir("/proc/self/fd")) == before


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """3000 tiny images with 0..4 boxes whose features spell their own row: a wrong lookup shows."""
    rng = np.random.default_rng(1)
    counts = rng.integers(0, 5, 3000)
    recs = [
        RegionRecord(
            image_id=f"im{i:05d}",
            image_w=10 + i,
            image_h=20 + i,
            boxes=np.tile(np.array([[0, 0, 1, 1]], np.float32), (n, 1)) * (i + 1),
            features=np.full((n, 2), i, np.float32) + np.arange(n, dtype=np.float32)[:, None] / 10,
        )
        for i, n in enumerate(counts)
    ]
    path = tmp_path_factory.mktemp("many") / "many.h5"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(store_module, "_FLUSH_BYTES", 100)  # many small resize+write flushes, not one
        write_store_records(path, recs)
    return path, recs


def test_lookup_by_id_on_thousands_of_images(many):
    path, recs = many
    t0 = time.perf_counter()
    s = RegionStore(path)
    assert time.perf_counter() - t0 < 1.0
    order = np.random.default_rng(2).permutation(len(recs))
    for i in order[:1500]:
        got = s.get(f"im{i:05d}")
        assert got.differences(recs[i]) == [], i
    with h5py.File(path) as f:  # the layout the docstring promises: contiguous slices
        assert f["offset"][-1] + f["count"][-1] == f["features"].shape[0] == sum(r.num_boxes for r in recs)


def test_records_iterates_in_write_order_across_blocks(many):
    path, recs = many
    with RegionStore(path) as s:
        got = list(s.records(block_rows=7))
    assert [r.image_id for r in got] == [r.image_id for r in recs]
    assert all(a.differences(b) == [] for a, b in zip(got, recs))


class _StoreDataset:
    def __init__(self, store: RegionStore, ids: list[str]):
        self.store, self.ids = store, ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        rec = self.store.get(self.ids[i])
        assert self.store._pid == os.getpid()  # this worker opened its own handle
        return rec.image_id, float(rec.features.sum())


def test_usable_from_dataloader_workers_and_pickle(many):
    torch = pytest.importorskip("torch")
    path, recs = many
    store = RegionStore(path)
    store.get("im00000")  # the parent's handle is open when the workers fork
    ids = [r.image_id for r in recs[:200]]
    loader = torch.utils.data.DataLoader(
        _StoreDataset(store, ids), batch_size=None, num_workers=2, multiprocessing_context="fork"
    )
    got = dict(loader)
    assert got == {r.image_id: float(r.features.sum()) for r in recs[:200]}
    clone = pickle.loads(pickle.dumps(store))  # what a spawned worker receives
    assert clone.get("im00007").differences(recs[7]) == []
    assert store.get("im00009").differences(recs[9]) == []  # the parent still reads after the fork


def _abcde_store(path, name: str, i: int, value: int):
    """Five images a..e of 3 boxes (offsets 0, 3, 6, 9, 12; 15 rows) with `name`[i] set to `value`."""
    write_store_records(path, [make_record(k, 3, seed=j) for j, k in enumerate("abcde")])
    with h5py.File(path, "a") as f:
        f[name][i] = value
    return path


@pytest.mark.parametrize("name, i, value, problem", [
    # image c's count: c would read d's regions; the check used to blame d, the intact image after it
    ("count", 2, 50, "image c: offset 6 and count 50 end at row 56, but image d after it starts at row 9"),
    ("count", 2, 2, "image c: offset 6 and count 2 end at row 8, but image d after it starts at row 9"),
    ("offset", 2, 7, "image c: offset 7, but image b before it ends at row 6"),
    ("offset", 4, 11, "image e: offset 11, but image d before it ends at row 12"),
    ("offset", 0, 1, "image a: offset 1, but the first image starts at row 0"),
    ("count", 4, 4, "image e: offset 12 and count 4 end at row 16, but the per-box arrays hold 15 rows (the counts "
                    "add up to 16)"),
    ("count", 1, -1, "image b: negative count -1"),
])
def test_damaged_index_names_the_damaged_image(tmp_path, name, i, value, problem):
    path = _abcde_store(tmp_path / "s.h5", name, i, value)
    with pytest.raises(VlbertsError) as e:
        RegionStore(path)
    assert str(e.value) == f"{path}: damaged store: {problem}"


def _replace(f, name, value):
    del f[name]
    f[name] = value


@pytest.mark.parametrize("damage, problem", [
    (lambda f: f.attrs.__delitem__("feature_dim"), "missing attribute 'feature_dim'"),
    (lambda f: f.attrs.__delitem__("dtype"), "missing attribute 'dtype'"),
    (lambda f: f.attrs.__setitem__("feature_dim", "abc"), "attribute 'feature_dim' is 'abc', not a whole number"),
    (lambda f: f.attrs.__setitem__("format_version", "x"), "attribute 'format_version' is 'x', not a whole number"),
    (lambda f: f.attrs.__setitem__("metadata", "{bad"), "attribute 'metadata' is not JSON"),
    (lambda f: f.attrs.__setitem__("created", "[]"), "attribute 'created' is a JSON list, not an object"),
    (lambda f: _replace(f, "image_ids", np.arange(5)), "dataset 'image_ids' holds int64, not strings"),
    (lambda f: f.__delitem__("image_w"), "missing dataset 'image_w'"),
    # the width the header states must be the width of the features, and boxes must be 4 numbers
    (lambda f: f.attrs.__setitem__("feature_dim", 64), "dataset 'features' has shape (15, 6), not (rows, 64)"),
    (lambda f: _replace(f, "boxes", f["boxes"][:, :3]), "dataset 'boxes' has shape (15, 3), not (rows, 4)"),
])
def test_damaged_header_names_the_attribute_or_dataset(tmp_path, capsys, damage, problem):
    path = tmp_path / "s.h5"
    write_store_records(path, [make_record(k, 3, seed=j) for j, k in enumerate("abcde")])
    with h5py.File(path, "a") as f:
        damage(f)
    with pytest.raises(VlbertsError, match=re.escape(f"{path}: damaged store: {problem}")):
        RegionStore(path)
    with pytest.raises(SystemExit) as exc:  # the CLI: one line, exit 2, no traceback
        main(["features", "info", str(path)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and "damaged store" in err


def test_cli_damaged_count_is_one_line_exit_2(tmp_path, capsys):
    path = _abcde_store(tmp_path / "s.h5", "count", 2, 50)
    with pytest.raises(SystemExit) as exc:
        main(["features", "info", str(path)])
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "" and err.count("\n") == 1
    assert err == (f"error: {path}: damaged store: image c: offset 6 and count 50 end at row 56, but image d after "
                   "it starts at row 9\n")
