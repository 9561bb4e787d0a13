"""Importing the region features the other original code bases wrote (`features/foreign.py`): VL-BERT's
per-image JSON (directory and zip), ViLBERT's LMDB (vilbert-multi-task's numpy records and vilbert_beta's
base64 strings, through the restricted unpickler) and BAN's HDF5 with its imgid2idx pickle. Fixtures are
written here to the layouts in formats-and-metrics.md §1.3-1.5; every bad record is a one-line error
naming the file and the record, and leaves no store behind."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from vlberts.errors import VlbertsError
from vlberts.features.importers import import_features
from vlberts.features.store import RegionStore

VLBERTS = Path(sys.executable).with_name("vlberts")
RNG = np.random.default_rng(0)


def _images(n_images: int = 3, dim: int = 6, classes: int = 5) -> list[dict]:
    """Per image: id, size, pixel boxes inside it, features, a class distribution with the background first."""
    out = []
    for i in range(n_images):
        w, h, n = 640 - 10 * i, 480 + 7 * i, 4 + i
        x1, y1 = RNG.uniform(0, w / 2, n), RNG.uniform(0, h / 2, n)
        boxes = np.stack([x1, y1, x1 + RNG.uniform(5, w / 2, n), y1 + RNG.uniform(5, h / 2, n)], 1).astype(np.float32)
        probs = RNG.dirichlet(np.ones(classes), n).astype(np.float32)
        out.append({"id": 100 + i, "w": w, "h": h, "boxes": boxes, "features": RNG.normal(size=(n, dim)).astype(np.float32),
                    "cls_prob": probs})
    return out


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=np.float32).tobytes()).decode("ascii")


def _check_store(path: Path, images: list[dict], with_cls_prob: bool) -> None:
    with RegionStore(path) as store:
        assert store.ids() == [str(im["id"]) for im in images]
        for im in images:
            rec = store.get(str(im["id"]))
            assert (rec.image_w, rec.image_h) == (im["w"], im["h"])
            np.testing.assert_array_equal(rec.boxes, im["boxes"])
            np.testing.assert_array_equal(rec.features, im["features"])
            if with_cls_prob:
                np.testing.assert_array_equal(rec.cls_prob, im["cls_prob"])
                # LXMERT's convention: arg-max over the classes after the background, 0-based
                np.testing.assert_array_equal(rec.obj_id, im["cls_prob"][:, 1:].argmax(1))
                np.testing.assert_array_equal(rec.obj_conf, im["cls_prob"][:, 1:].max(1))


# --------------------------------------------------------------------------- VL-BERT per-image JSON

def _vlbert_obj(im: dict) -> dict:
    return {"image_id": im["id"], "image_h": im["h"], "image_w": im["w"], "num_boxes": len(im["boxes"]),
            "boxes": _b64(im["boxes"]), "features": _b64(im["features"]), "classes": _b64(im["cls_prob"])}


def test_vlbert_json_directory_and_zip(tmp_path):
    images = _images()
    folder = tmp_path / "vgbua_res101_precomputed"
    folder.mkdir()
    for im in images:
        (folder / f"{im['id']}.json").write_text(json.dumps(_vlbert_obj(im)))
    import_features(folder, "vlbert-json", tmp_path / "dir.h5")
    _check_store(tmp_path / "dir.h5", images, with_cls_prob=True)
    with RegionStore(tmp_path / "dir.h5") as store:
        source = store.metadata.source
    assert (source["format"], source["records"]) == ("vlbert-json", 3)

    with zipfile.ZipFile(tmp_path / "train_frcnn.zip", "w") as z:  # VL-BERT's `file.zip@/...` layout
        for im in images:
            z.writestr(f"train_frcnn/{im['id']}.json", json.dumps(_vlbert_obj(im)))
    import_features(tmp_path / "train_frcnn.zip", "vlbert-json", tmp_path / "zip.h5")
    _check_store(tmp_path / "zip.h5", images, with_cls_prob=True)


@pytest.mark.parametrize("breaker, message", [
    (lambda o: "{not json", "malformed JSON at line 1 column 2"),
    (lambda o: {k: v for k, v in o.items() if k != "features"}, "missing field(s) features"),
    (lambda o: {**o, "num_boxes": o["num_boxes"] + 1}, "num_boxes=7 but boxes holds 6 boxes"),
    (lambda o: {**o, "boxes": o["boxes"][:-8] + "!!!!!!!!"}, "boxes is not valid base64"),
    (lambda o: {**o, "image_w": 0}, "image_w must be an integer >= 1, got 0"),
])
def test_vlbert_json_bad_records_name_the_file(tmp_path, breaker, message):
    images = _images()
    for i, im in enumerate(images):
        obj = _vlbert_obj(im)
        obj = breaker(obj) if i == 2 else obj
        (tmp_path / f"{im['id']}.json").write_text(obj if isinstance(obj, str) else json.dumps(obj))
    with pytest.raises(VlbertsError) as err:
        import_features(tmp_path, "vlbert-json", tmp_path / "out.h5")
    assert message in err.value.message and err.value.record.startswith("file 102.json")
    assert not (tmp_path / "out.h5").exists()


# --------------------------------------------------------------------------- ViLBERT LMDB

def _write_lmdb(path: Path, values: dict[bytes, bytes], keys: list[bytes] | None) -> None:
    import lmdb

    env = lmdb.open(str(path), map_size=1 << 26)
    with env.begin(write=True) as txn:
        for k, v in values.items():
            txn.put(k, v)
        if keys is not None:
            txn.put(b"keys", pickle.dumps(keys))
    env.close()


def _multitask_value(im: dict) -> bytes:
    """vilbert-multi-task `convert_to_lmdb.py`: numpy arrays (and numpy scalars, as np.load gives them)."""
    return pickle.dumps({"image_id": im["id"], "image_h": np.int64(im["h"]), "image_w": np.int64(im["w"]),
                         "num_boxes": len(im["boxes"]), "boxes": im["boxes"], "features": im["features"]})


def test_vilbert_lmdb_multitask_and_beta_records(tmp_path):
    pytest.importorskip("lmdb")
    images = _images()
    keys = [str(im["id"]).encode() for im in images]
    _write_lmdb(tmp_path / "multitask.lmdb", {k: _multitask_value(im) for k, im in zip(keys, images)}, keys)
    import_features(tmp_path / "multitask.lmdb", "vilbert-lmdb", tmp_path / "mt.h5")
    _check_store(tmp_path / "mt.h5", images, with_cls_prob=False)

    # vilbert_beta: the raw TSV row, strings and base64, with the detector's class distribution
    beta = {k: pickle.dumps({"image_id": str(im["id"]), "image_w": str(im["w"]), "image_h": str(im["h"]),
                             "num_boxes": str(len(im["boxes"])), "boxes": _b64(im["boxes"]).encode(),
                             "features": _b64(im["features"]).encode(), "cls_prob": _b64(im["cls_prob"]).encode()})
            for k, im in zip(keys, images)}
    _write_lmdb(tmp_path / "beta.lmdb", beta, keys=None)  # no b"keys": the database's own order
    import_features(tmp_path / "beta.lmdb", "vilbert-lmdb", tmp_path / "beta.h5")
    _check_store(tmp_path / "beta.h5", images, with_cls_prob=True)


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("echo this must never run",))


def test_vilbert_lmdb_refuses_code_in_its_pickles_and_names_the_key(tmp_path):
    pytest.importorskip("lmdb")
    images = _images()
    keys = [str(im["id"]).encode() for im in images]
    values = {k: _multitask_value(im) for k, im in zip(keys, images)}
    values[keys[1]] = pickle.dumps({"image_id": 101, "boxes": _RunsCode()})
    _write_lmdb(tmp_path / "evil.lmdb", values, keys)
    with pytest.raises(VlbertsError, match=r"record key b'101'.*forbidden global posix\.system"):
        import_features(tmp_path / "evil.lmdb", "vilbert-lmdb", tmp_path / "out.h5")
    assert not (tmp_path / "out.h5").exists()

    _write_lmdb(tmp_path / "short.lmdb", {keys[0]: values[keys[0]]}, [keys[0], b"999"])
    with pytest.raises(VlbertsError, match=r"record key b'999': listed in b'keys' but not in the database"):
        import_features(tmp_path / "short.lmdb", "vilbert-lmdb", tmp_path / "out.h5")


# --------------------------------------------------------------------------- BAN HDF5

def _write_ban(path: Path, images: list[dict]) -> dict[int, int]:
    """jnhwkim/ban-vqa adaptive_detection_features_converter.py: all boxes stacked, pos_boxes per image."""
    boxes = np.concatenate([im["boxes"] for im in images])
    spatial = np.concatenate([np.stack([
        im["boxes"][:, 0] / im["w"], im["boxes"][:, 1] / im["h"], im["boxes"][:, 2] / im["w"], im["boxes"][:, 3] / im["h"],
        (im["boxes"][:, 2] - im["boxes"][:, 0]) / im["w"], (im["boxes"][:, 3] - im["boxes"][:, 1]) / im["h"]], 1)
        for im in images])
    ends = np.cumsum([len(im["boxes"]) for im in images])
    with h5py.File(path, "w") as f:
        f["image_features"] = np.concatenate([im["features"] for im in images])
        f["image_bb"] = boxes
        f["spatial_features"] = spatial.astype(np.float32)
        f["pos_boxes"] = np.stack([ends - [len(im["boxes"]) for im in images], ends], 1)
    return {im["id"]: i for i, im in enumerate(images)}


def test_ban_h5_recovers_each_image_size(tmp_path):
    images = _images(4)
    ids = _write_ban(tmp_path / "test36.hdf5", images)
    (tmp_path / "test36_imgid2idx.pkl").write_bytes(pickle.dumps(ids, protocol=2))
    import_features(tmp_path / "test36.hdf5", "ban-h5", tmp_path / "ban.h5", ids=tmp_path / "test36_imgid2idx.pkl")
    _check_store(tmp_path / "ban.h5", images, with_cls_prob=False)

    # Without --ids each file is read with its own index beside it: BAN's splits into one store
    more = _images(6)[4:]
    (tmp_path / "val36_imgid2idx.pkl").write_bytes(pickle.dumps(_write_ban(tmp_path / "val36.hdf5", more), protocol=2))
    import_features([tmp_path / "test36.hdf5", tmp_path / "val36.hdf5"], "ban-h5", tmp_path / "both.h5")
    _check_store(tmp_path / "both.h5", images + more, with_cls_prob=False)
    with pytest.raises(VlbertsError, match=r"--ids is one file's image index, and 2 files are imported: leave it out"):
        import_features([tmp_path / "test36.hdf5", tmp_path / "val36.hdf5"], "ban-h5", tmp_path / "x.h5",
                        ids=tmp_path / "test36_imgid2idx.pkl")
    # Another split's index: refused, whether its rows fit inside this file's or not
    with pytest.raises(VlbertsError, match=r"val36_imgid2idx.pkl: the index names 2 distinct rows, but test36.hdf5 "
                                           r"holds 4 images \(pos_boxes rows\), each indexed once by its own "
                                           r"test36_imgid2idx.pkl: is this that file's index\?"):
        import_features(tmp_path / "test36.hdf5", "ban-h5", tmp_path / "x.h5", ids=tmp_path / "val36_imgid2idx.pkl")
    (tmp_path / "test36_imgid2idx.pkl").rename(tmp_path / "elsewhere.pkl")
    with pytest.raises(VlbertsError, match=r"test36.hdf5: ban-h5 reads each file's image ids from the "
                                           r"test36_imgid2idx.pkl beside it .*: pass it as --ids"):
        import_features(tmp_path / "test36.hdf5", "ban-h5", tmp_path / "x.h5")
    (tmp_path / "elsewhere.pkl").rename(tmp_path / "test36_imgid2idx.pkl")
    with h5py.File(tmp_path / "test36.hdf5", "a") as f:  # two of image 101's boxes normalised by another width
        spatial = f["spatial_features"][...]
        spatial[4:6, 2] *= 0.5
        f["spatial_features"][...] = spatial
    with pytest.raises(VlbertsError, match=r"record image 101 \(index 1\): boxes and spatial_features disagree"):
        import_features(tmp_path / "test36.hdf5", "ban-h5", tmp_path / "x.h5", ids=tmp_path / "test36_imgid2idx.pkl")


def test_cli_imports_vlbert_json_and_reports_bad_input_in_one_line(tmp_path):
    images = _images(2)
    for im in images:
        (tmp_path / f"{im['id']}.json").write_text(json.dumps(_vlbert_obj(im)))
    run = subprocess.run([str(VLBERTS), "features", "import", str(tmp_path), "--format", "vlbert-json",
                          "--out", str(tmp_path / "s.h5")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "wrote" in run.stdout and "2 images, 9 boxes, 6-d float32 features" in run.stdout
    (tmp_path / "101.json").write_text("{")
    run = subprocess.run([str(VLBERTS), "features", "import", str(tmp_path), "--format", "vlbert-json",
                          "--out", str(tmp_path / "t.h5")], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "record file 101.json" in run.stderr


def test_the_restricted_unpickler_admits_numpy_arrays_only_when_asked():
    from vlberts.safe_pickle import safe_loads

    data = {"boxes": np.arange(8, dtype=np.float32).reshape(2, 4), "h": np.int64(480), "names": np.array(["a", 1], dtype=object)}
    for protocol in (0, 2, 4, 5):
        out = safe_loads(pickle.dumps(data, protocol=protocol), numpy=True)
        np.testing.assert_array_equal(out["boxes"], data["boxes"])
        assert out["h"] == 480 and list(out["names"]) == ["a", 1]
    with pytest.raises(VlbertsError, match="forbidden global numpy"):  # plain-data callers stay plain data
        safe_loads(pickle.dumps(data))
    with pytest.raises(VlbertsError, match="forbidden global numpy.ma.core._mareconstruct"):  # no other array types
        safe_loads(pickle.dumps(np.ma.array([1, 2])), numpy=True)
    with pytest.raises(VlbertsError, match="forbidden global posix.system"):  # nor code, inside an object array too
        safe_loads(pickle.dumps(np.array([_RunsCode()], dtype=object)), numpy=True)


# --------------------------------------------------------------------------- VisualBERT Detectron .th / .npz

def _visualbert_images(tmp_path: Path, images: list[dict]) -> Path:
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    for im in images:
        Image.new("RGB", (im["w"], im["h"])).save(folder / f"dev-{im['id']}-0-img0.png")
    return folder


def test_visualbert_th_giant_file_and_npz_directory_read_sizes_from_the_images(tmp_path):
    import torch

    images = _images()
    folder = _visualbert_images(tmp_path, images)
    giant = {f"dev-{im['id']}-0-img0.png": (torch.from_numpy(im["features"]), torch.from_numpy(im["boxes"]),
                                            torch.from_numpy(im["cls_prob"].max(1))) for im in images}
    torch.save(giant, tmp_path / "features_dev_150.th")
    import_features(tmp_path / "features_dev_150.th", "visualbert-th", tmp_path / "th.h5", images=folder)
    npz = tmp_path / "npz"
    npz.mkdir()
    for name, (f, b, c) in giant.items():
        np.savez(npz / f"{name}.npz", box_features=f.numpy(), cls_boxes=b.numpy(), max_conf=c.numpy())
    import_features(npz, "visualbert-th", tmp_path / "npz.h5", images=folder)
    for store in ("th.h5", "npz.h5"):
        with RegionStore(tmp_path / store) as s:
            assert s.ids() == [f"dev-{im['id']}-0-img0" for im in images]
            for im in images:
                rec = s.get(f"dev-{im['id']}-0-img0")
                assert (rec.image_w, rec.image_h) == (im["w"], im["h"])
                np.testing.assert_array_equal(rec.boxes, im["boxes"])
                np.testing.assert_array_equal(rec.features, im["features"])

    # NLVR2's train images sit in numbered folders, and one root serves every split: images below --images count
    (folder / "17").mkdir()
    (folder / "dev-101-0-img0.png").rename(folder / "17" / "dev-101-0-img0.png")
    import_features(tmp_path / "features_dev_150.th", "visualbert-th", tmp_path / "nested.h5", images=tmp_path)
    with RegionStore(tmp_path / "nested.h5") as s:
        assert s.image_size("dev-101-0-img0") == (images[1]["w"], images[1]["h"])
    (folder / "17" / "dev-101-0-img0.png").unlink()
    with pytest.raises(VlbertsError, match=r"record image dev-101-0-img0.png: no image dev-101-0-img0.png in"):
        import_features(tmp_path / "features_dev_150.th", "visualbert-th", tmp_path / "x.h5", images=folder)
    with pytest.raises(VlbertsError, match="visualbert-th needs --images"):
        import_features(tmp_path / "features_dev_150.th", "visualbert-th", tmp_path / "x.h5")
    torch.save({"dev-100-0-img0.png": _RunsCode()}, tmp_path / "evil.th")
    with pytest.raises(VlbertsError, match="cannot read as a torch.save file of tensors"):
        import_features(tmp_path / "evil.th", "visualbert-th", tmp_path / "x.h5", images=folder)
    assert not (tmp_path / "x.h5").exists()


def test_an_imported_store_pretrains_like_the_one_it_came_from(tiny_world, tmp_path):
    """The tiny world's store written out as VL-BERT JSON and imported back holds the same records (class
    distributions and the objects derived from them included), and VL-BERT pre-training (masked RoI classification reads cls_prob) on it
    logs the same losses as on the original store."""
    from test_pretrain import cfg_for

    from vlberts.recipes.pretrain import pretrain
    from vlberts.training.metrics import MetricsLog

    folder = tmp_path / "json"
    folder.mkdir()
    with RegionStore(tiny_world.store) as store:
        originals = list(store.records())
    for rec in originals:
        (folder / f"{rec.image_id}.json").write_text(json.dumps({
            "image_id": rec.image_id, "image_w": rec.image_w, "image_h": rec.image_h, "num_boxes": rec.num_boxes,
            "boxes": _b64(rec.boxes), "features": _b64(rec.features), "classes": _b64(rec.cls_prob)}))
    imported = import_features(folder, "vlbert-json", tmp_path / "imported.h5")
    with RegionStore(imported) as store:
        for rec in originals:
            again = store.get(rec.image_id)
            # obj_id / obj_conf derived from the class distribution equal the world detector's own; the JSON
            # carries no attribute distribution, so the attributes are the one difference
            assert again.differences(rec) == ["attr_id", "attr_conf"]
    logs = []
    for features, out in ((tiny_world.store, tmp_path / "a"), (imported, tmp_path / "b")):
        pretrain(cfg_for(tiny_world, out, model="vlbert-tiny", steps=3, ckpt_every=100, features=str(features)))
        logs.append([(r["mlm_loss"], r["roi_cls_loss"]) for r in MetricsLog.read(out / "metrics.jsonl")])
    assert logs[0] == logs[1]


# --------------------------------------------------------------------------- damaged files (a sweep of 330 cases)

def test_damaged_foreign_files_are_one_line_errors_naming_the_file(tmp_path):
    """A corrupt zip member, a cut-off .npz, an empty .th, overlapping BAN rows: each fails in one line that
    names the file, with no store left behind (they used to be tracebacks, or a store with another
    image's boxes copied in)."""
    images = _images()
    # a zip member whose bytes no longer match its CRC
    with zipfile.ZipFile(tmp_path / "feats.zip", "w", compression=zipfile.ZIP_STORED) as z:
        for im in images:
            z.writestr(f"feats/{im['id']}.json", json.dumps(_vlbert_obj(im)))
    data = bytearray((tmp_path / "feats.zip").read_bytes())
    k = data.index(b'"image_h"', data.index(b"feats/102.json"))
    data[k + 1] = ord("X")
    (tmp_path / "feats.zip").write_bytes(bytes(data))
    # a .npz directory whose second file is cut in half
    npz = tmp_path / "npz"
    npz.mkdir()
    for im in images:
        np.savez(npz / f"dev-{im['id']}-0-img0.png.npz", box_features=im["features"], cls_boxes=im["boxes"],
                 max_conf=im["cls_prob"].max(1))
    cut = npz / "dev-101-0-img0.png.npz"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    (tmp_path / "empty.th").write_bytes(b"")
    ids = _write_ban(tmp_path / "ban.hdf5", images)
    (tmp_path / "ban_imgid2idx.pkl").write_bytes(pickle.dumps(ids, protocol=2))
    with h5py.File(tmp_path / "ban.hdf5", "a") as f:
        pos = f["pos_boxes"][...]
        pos[1, 0] -= 2  # image 101 would also read image 100's last two boxes
        f["pos_boxes"][...] = pos
    folder = _visualbert_images(tmp_path, images)
    cases = [
        (tmp_path / "feats.zip", "vlbert-json", {}, "cannot read this vlbert-json file: BadZipFile: Bad CRC-32"),
        (npz, "visualbert-th", {"images": folder}, "not a VisualBERT feature .npz"),
        (tmp_path / "empty.th", "visualbert-th", {"images": folder}, "cannot read as a torch.save file of tensors"),
        (tmp_path / "ban.hdf5", "ban-h5", {"ids": tmp_path / "ban_imgid2idx.pkl"}, "pos_boxes rows overlap"),
    ]
    for src, fmt, extra, message in cases:
        with pytest.raises(VlbertsError) as err:
            import_features(src, fmt, tmp_path / "out.h5", **extra)
        assert message in str(err.value) and "\n" not in str(err.value), (fmt, str(err.value))
        assert str(src) in str(err.value)  # the file (for the .npz directory: the cut file inside it)
        assert not (tmp_path / "out.h5").exists()


# torch says it checks a sparse tensor's invariants when it loads one with weights_only=True: the safe load wanted.
@pytest.mark.filterwarnings("ignore:Validating sparse tensor invariants")
def test_visualbert_th_takes_tensors_with_grad_bf16_or_sparse_and_vlbert_json_an_image_without_boxes(tmp_path):
    import torch

    images = _images()
    folder = _visualbert_images(tmp_path, images)
    odd = {
        f"dev-{images[0]['id']}-0-img0.png": (torch.from_numpy(images[0]["features"]).requires_grad_(),
                                              torch.from_numpy(images[0]["boxes"]), torch.ones(4)),
        f"dev-{images[1]['id']}-0-img0.png": (torch.from_numpy(images[1]["features"]).bfloat16(),
                                              torch.from_numpy(images[1]["boxes"]).to_sparse(), torch.ones(5)),
    }
    torch.save(odd, tmp_path / "odd.th")
    import_features(tmp_path / "odd.th", "visualbert-th", tmp_path / "odd.h5", images=folder)
    with RegionStore(tmp_path / "odd.h5") as s:
        np.testing.assert_array_equal(s.get(f"dev-{images[0]['id']}-0-img0").features, images[0]["features"])
        np.testing.assert_allclose(s.get(f"dev-{images[1]['id']}-0-img0").features, images[1]["features"], rtol=1e-2)
        np.testing.assert_array_equal(s.get(f"dev-{images[1]['id']}-0-img0").boxes, images[1]["boxes"])
    # VL-BERT JSON: an image with no boxes (its classes an empty list) between two with boxes
    folder_json = tmp_path / "json"
    folder_json.mkdir()
    for k, im in enumerate(images):
        obj = _vlbert_obj(im)
        if k == 1:
            obj.update(num_boxes=0, boxes=_b64(np.zeros((0, 4))), features=_b64(np.zeros((0, 6))), classes="")
        (folder_json / f"{im['id']}.json").write_text(json.dumps(obj))
    import_features(folder_json, "vlbert-json", tmp_path / "json.h5")
    with RegionStore(tmp_path / "json.h5") as s:
        assert [s.num_boxes(str(im["id"])) for im in images] == [len(images[0]["boxes"]), 0, len(images[2]["boxes"])]
        assert s.get(str(images[2]["id"])).cls_prob.shape == images[2]["cls_prob"].shape


# --------------------------------------------------------------------------- MMF / Pythia and ViLBERT per-image .npy

def _write_mmf(folder: Path, images: list[dict], background: bool = False, split: str = "train2014") -> list[str]:
    """MMF's `extract_features_vmb.py` layout: `<name>.npy` the features, `<name>_info.npy` a dict; cls_prob
    with the object columns only (its default) or the background first (`--background`). Returns the names."""
    (folder / split).mkdir(parents=True, exist_ok=True)
    names = []
    for im in images:
        name = f"COCO_{split}_{im['id']:012d}"
        probs = im["cls_prob"] if background else im["cls_prob"][:, 1:]
        np.save(folder / split / f"{name}.npy", im["features"])
        np.save(folder / split / f"{name}_info.npy", {
            "bbox": im["boxes"], "num_boxes": len(im["boxes"]), "objects": probs.argmax(1), "cls_prob": probs,
            "image_width": im["w"], "image_height": im["h"]})
        names.append(name)
    return names


def test_mmf_npy_features_with_their_info_files_and_vilbert_per_image_dicts(tmp_path):
    """MMF's two-file layout under split folders (COCO stems become COCO ids; the background column the
    default extractor cuts off comes back as 1 minus the row's sum; with `--background` the distribution
    is kept as written) and ViLBERT's one-dict layout (its `image_id` inside) import to the same records."""
    images = _images()
    _write_mmf(tmp_path / "fc6", images[:2], split="train2014")
    _write_mmf(tmp_path / "fc6", images[2:], split="val2014")
    import_features(tmp_path / "fc6", "mmf-npy", tmp_path / "mmf.h5")
    with RegionStore(tmp_path / "mmf.h5") as store:
        assert store.ids() == ["100", "101", "102"]
        for im in images:
            rec = store.get(str(im["id"]))
            assert (rec.image_w, rec.image_h) == (im["w"], im["h"])
            np.testing.assert_array_equal(rec.boxes, im["boxes"])
            np.testing.assert_array_equal(rec.features, im["features"])
            np.testing.assert_allclose(rec.cls_prob, im["cls_prob"], atol=1e-6)  # (N, 1 + C), background first
            np.testing.assert_array_equal(rec.obj_id, im["cls_prob"][:, 1:].argmax(1))
    _write_mmf(tmp_path / "bg", images, background=True)
    import_features(tmp_path / "bg", "mmf-npy", tmp_path / "bg.h5")
    _check_store(tmp_path / "bg.h5", images, with_cls_prob=True)

    vilbert = tmp_path / "vilbert"
    vilbert.mkdir()
    for im in images:
        np.save(vilbert / f"{im['id']}.npy", {"image_id": str(im["id"]), "bbox": im["boxes"], "num_boxes": len(im["boxes"]),
                                            "objects": im["cls_prob"].argmax(1), "cls_prob": im["cls_prob"],
                                            "image_width": im["w"], "image_height": im["h"], "features": im["features"]})
    import_features(vilbert, "mmf-npy", tmp_path / "vilbert.h5")
    _check_store(tmp_path / "vilbert.h5", images, with_cls_prob=True)


@pytest.mark.parametrize("breaker, message", [
    (lambda d, n: (d / f"{n}_info.npy").unlink(), "features without COCO_train2014_000000000101_info.npy beside them"),
    (lambda d, n: (d / f"{n}.npy").unlink(), "an _info.npy without the features file of its name beside it"),
    (lambda d, n: np.save(d / f"{n}_info.npy", np.array([_RunsCode()], dtype=object)), "forbidden global posix.system"),
    (lambda d, n: np.save(d / f"{n}.npy", np.zeros((3, 6), np.float32)), "bbox must be an array of shape (3, 4)"),
    (lambda d, n: np.save(d / f"{n}_info.npy", {"bbox": np.zeros((5, 4), np.float32), "image_width": 640}),
     "missing field(s) image_height"),
    (lambda d, n: np.save(d / f"{n}.npy", np.array(["a", "b"])), "expected an (N, D) array of features or a dict"),
    (lambda d, n: (d / f"{n}.npy").write_bytes(b"not numpy"), "not a .npy file"),
    (lambda d, n: (d / f"{n}.npy").write_bytes((d / f"{n}.npy").read_bytes()[:150]), "cannot read this .npy file's array (EOF"),
    (lambda d, n: (d / f"{n}_info.npy").write_bytes((d / f"{n}_info.npy").read_bytes()[:200]), "truncated pickle"),
])
def test_mmf_npy_bad_files_are_one_line_errors_naming_the_file(tmp_path, breaker, message):
    images = _images()
    names = _write_mmf(tmp_path / "fc6", images)
    breaker(tmp_path / "fc6" / "train2014", names[1])
    with pytest.raises(VlbertsError) as err:
        import_features(tmp_path / "fc6", "mmf-npy", tmp_path / "out.h5")
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert names[1] in str(err.value)  # the file (or the record inside the directory) is named
    assert not (tmp_path / "out.h5").exists()


def test_mmf_npy_probabilities_that_sum_past_one_are_refused_and_the_cli_exits_2(tmp_path):
    images = _images(2)
    names = _write_mmf(tmp_path / "fc6", images)
    info = tmp_path / "fc6" / "train2014" / f"{names[0]}_info.npy"
    np.save(info, {"bbox": images[0]["boxes"], "image_width": images[0]["w"], "image_height": images[0]["h"],
                   "cls_prob": images[0]["cls_prob"] * 1.5})
    run = subprocess.run([str(VLBERTS), "features", "import", str(tmp_path / "fc6"), "--format", "mmf-npy",
                          "--out", str(tmp_path / "s.h5")], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "cls_prob rows must be probabilities" in run.stderr and names[0] in run.stderr
    info.unlink()
    (tmp_path / "fc6" / "train2014" / f"{names[0]}.npy").unlink()
    run = subprocess.run([str(VLBERTS), "features", "import", str(tmp_path / "fc6"), "--format", "mmf-npy",
                          "--out", str(tmp_path / "s.h5")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "1 images, 5 boxes, 6-d float32 features, fields boxes, features, cls_prob, obj_id, obj_conf" in run.stdout


def test_the_worlds_store_written_as_mmf_npy_imports_back_to_the_same_records(tiny_world, tmp_path):
    """Every record of the tiny world's store, written in MMF's default layout (the class distribution
    without its background column) and imported back: the same boxes, features and sizes, the background
    column restored to within float32 rounding, and the same objects derived from it."""
    folder = tmp_path / "npy"
    folder.mkdir()
    with RegionStore(tiny_world.store) as store:
        originals = list(store.records())
    for rec in originals:
        np.save(folder / f"{rec.image_id}.npy", rec.features)
        np.save(folder / f"{rec.image_id}_info.npy", {"bbox": rec.boxes, "num_boxes": rec.num_boxes, "cls_prob": rec.cls_prob[:, 1:],
                                                      "image_width": rec.image_w, "image_height": rec.image_h})
    with RegionStore(import_features(folder, "mmf-npy", tmp_path / "imported.h5")) as store:
        assert sorted(store.ids()) == sorted(rec.image_id for rec in originals)
        for rec in originals:
            again = store.get(rec.image_id)
            assert set(again.differences(rec)) <= {"cls_prob", "attr_id", "attr_conf"}
            np.testing.assert_allclose(again.cls_prob, rec.cls_prob, atol=2e-6)
            np.testing.assert_array_equal(again.obj_id, rec.obj_id)


def test_a_format_without_captions_imports_into_image_samples_that_read_back_as_its_records(tmp_path):
    from vlberts.data.shards import read_index, read_shard, sample_record

    images = _images()
    _write_mmf(tmp_path / "fc6", images)
    import_features(tmp_path / "fc6", "mmf-npy", tmp_path / "s.h5")
    index = import_features(tmp_path / "fc6", "mmf-npy", tmp_path / "sh", shard_size=2, shards=True)
    obj = read_index(index)
    assert (obj["samples"], obj["kinds"]["image"], len(obj["shards"])) == (3, 3, 2)
    samples = [s for shard in obj["shards"] for s in read_shard(tmp_path / "sh" / shard["name"])]
    with RegionStore(tmp_path / "s.h5") as store:
        assert [s["image_id"] for s in samples] == store.ids()
        for s in samples:
            assert sample_record(s).differences(store.get(s["image_id"])) == []
