"""BUTD (6-field) and LXMERT (10-field) TSVs: files produced the way the original scripts produce them,
exact round-trips through the store, and one-line errors for every kind of bad line."""

from __future__ import annotations

import base64
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from vlberts.cli import app
from vlberts.errors import VlbertsError
from vlberts.features.importers import export_tsv, import_features
from vlberts.features.record import RegionRecord
from vlberts.features.store import RegionStore, write_store_records
from vlberts.features.tsv import (
    BUTD_FIELDS,
    LXMERT_FIELDS,
    read_butd_tsv,
    read_lxmert_tsv,
    write_butd_tsv,
    write_lxmert_tsv,
)

VLBERTS = Path(sys.executable).parent / "vlberts"
D = 8  # feature width of the tiny test files (real files: 2048)


def b64(a: np.ndarray) -> str:
    return base64.b64encode(a.tobytes()).decode()


def arrays(n: int, seed: int, w: int = 640, h: int = 480) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    half = np.array([w / 2, h / 2])
    xy = (rng.uniform(0, 1, (n, 2)) * half).astype(np.float32)  # boxes inside the w x h image
    return {
        "boxes": np.concatenate([xy, xy + (rng.uniform(0.01, 1, (n, 2)) * half).astype(np.float32)], 1),
        "features": rng.random((n, D), dtype=np.float32) * 4,
        "objects_id": rng.integers(0, 1600, n).astype(np.int64),
        "objects_conf": rng.random(n, dtype=np.float32),
        "attrs_id": rng.integers(0, 400, n).astype(np.int64),
        "attrs_conf": rng.random(n, dtype=np.float32),
    }


def write_butd_like_generate_tsv(path: Path, items: list[tuple[int, int, int, dict]]) -> None:
    """What bottom-up-attention tools/generate_tsv.py writes: csv.DictWriter, tab, no header, int id."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, delimiter="\t", fieldnames=list(BUTD_FIELDS))
        for image_id, w, h, a in items:
            n = len(a["boxes"])
            writer.writerow(
                {"image_id": image_id, "image_w": w, "image_h": h, "num_boxes": n,
                 "boxes": b64(a["boxes"]), "features": b64(a["features"])}
            )


def write_lxmert_like_extract(path: Path, items: list[tuple[str, int, int, dict]]) -> None:
    """What lxmert's extract_coco_image.py writes (10 fields, img_h before img_w, string id)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, delimiter="\t", fieldnames=list(LXMERT_FIELDS))
        for img_id, w, h, a in items:
            writer.writerow(
                {"img_id": img_id, "img_h": h, "img_w": w,
                 "objects_id": b64(a["objects_id"]), "objects_conf": b64(a["objects_conf"]),
                 "attrs_id": b64(a["attrs_id"]), "attrs_conf": b64(a["attrs_conf"]),
                 "num_boxes": len(a["boxes"]), "boxes": b64(a["boxes"]), "features": b64(a["features"])}
            )


BUTD_ITEMS = [(42, 640, 480, arrays(3, 0, 640, 480)), (9, 500, 375, arrays(36, 1, 500, 375)),
              (131089, 427, 640, arrays(10, 2, 427, 640))]
LXMERT_ITEMS = [
    ("COCO_val2014_000000131089", 640, 480, arrays(36, 3, 640, 480)),
    ("dev-850-0-img0", 300, 200, arrays(5, 4, 300, 200)),
    ("00042", 64, 32, arrays(1, 5, 64, 32)),
]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


# --------------------------------------------------------------------------- readers and writers


def test_butd_reader_decodes_generate_tsv_output(tmp_path):
    src = tmp_path / "butd.tsv"
    write_butd_like_generate_tsv(src, BUTD_ITEMS)
    recs = list(read_butd_tsv(src))
    assert [r.image_id for r in recs] == ["42", "9", "131089"]  # int ids -> decimal strings
    for rec, (_, w, h, a) in zip(recs, BUTD_ITEMS):
        assert (rec.image_w, rec.image_h, rec.num_boxes) == (w, h, len(a["boxes"]))
        np.testing.assert_array_equal(rec.boxes, a["boxes"])
        np.testing.assert_array_equal(rec.features, a["features"])
        assert rec.cls_prob is None and not rec.has_objects
    # writing them back gives the original bytes (csv.DictWriter also ends lines with \r\n)
    write_butd_tsv(tmp_path / "again.tsv", recs)
    assert (tmp_path / "again.tsv").read_bytes() == src.read_bytes()


def test_lxmert_reader_keeps_string_ids_and_h_before_w(tmp_path):
    src = tmp_path / "obj36.tsv"
    write_lxmert_like_extract(src, LXMERT_ITEMS)
    recs = list(read_lxmert_tsv(src))
    assert [r.image_id for r in recs] == ["COCO_val2014_000000131089", "dev-850-0-img0", "00042"]
    rec, (_, w, h, a) = recs[0], LXMERT_ITEMS[0]
    assert (rec.image_w, rec.image_h) == (640, 480) == (w, h)
    assert rec.obj_id.dtype == np.int64 and rec.obj_conf.dtype == np.float32
    for field, key in [("obj_id", "objects_id"), ("obj_conf", "objects_conf"), ("attr_id", "attrs_id"),
                       ("attr_conf", "attrs_conf"), ("boxes", "boxes"), ("features", "features")]:
        np.testing.assert_array_equal(getattr(rec, field), a[key])
    write_lxmert_tsv(tmp_path / "again.tsv", recs)
    assert (tmp_path / "again.tsv").read_bytes() == src.read_bytes()


def test_our_lxmert_file_reads_with_the_original_loader(tmp_path):
    """lxmert src/utils.py load_obj_tsv, condensed: our writer must satisfy it field for field."""
    recs = [RegionRecord(img_id, w, h, a["boxes"], a["features"], obj_id=a["objects_id"], obj_conf=a["objects_conf"],
                         attr_id=a["attrs_id"], attr_conf=a["attrs_conf"]) for img_id, w, h, a in LXMERT_ITEMS]
    write_lxmert_tsv(tmp_path / "ours.tsv", recs)
    default = csv.field_size_limit(sys.maxsize)  # process-wide: put back below for the tests after this one
    try:
        with open(tmp_path / "ours.tsv") as f:
            rows = list(csv.DictReader(f, LXMERT_FIELDS, delimiter="\t"))
    finally:
        csv.field_size_limit(default)
    item = rows[0]
    for key in ["img_h", "img_w", "num_boxes"]:
        item[key] = int(item[key])
    boxes = item["num_boxes"]
    shapes = {"objects_id": (boxes,), "objects_conf": (boxes,), "attrs_id": (boxes,), "attrs_conf": (boxes,),
              "boxes": (boxes, 4), "features": (boxes, -1)}
    dtypes = {"objects_id": np.int64, "objects_conf": np.float32, "attrs_id": np.int64, "attrs_conf": np.float32,
              "boxes": np.float32, "features": np.float32}
    for key, shape in shapes.items():
        item[key] = np.frombuffer(base64.b64decode(item[key]), dtype=dtypes[key]).reshape(shape)
    assert (item["img_id"], item["img_h"], item["img_w"]) == ("COCO_val2014_000000131089", 480, 640)
    np.testing.assert_array_equal(item["features"], recs[0].features)
    np.testing.assert_array_equal(item["objects_id"], recs[0].obj_id)


def test_blank_lines_and_zero_box_images(tmp_path):
    src = tmp_path / "b.tsv"
    write_butd_like_generate_tsv(src, [BUTD_ITEMS[0], (7, 10, 10, arrays(0, 0, 10, 10))])
    src.write_bytes(src.read_bytes() + b"\r\n")
    recs = list(read_butd_tsv(src))
    assert [r.num_boxes for r in recs] == [3, 0]
    out = import_features(src, "butd-tsv", tmp_path / "s.h5")
    with RegionStore(out) as s:
        assert s.get("7").features.shape == (0, D)


def test_export_refuses_what_the_format_cannot_hold(tmp_path):
    store = write_store_records(tmp_path / "s.h5", [RegionRecord("world_1", 8, 8, np.zeros((1, 4)), np.ones((1, 2)))])
    with pytest.raises(VlbertsError, match="BUTD TSV image ids are integers"):
        export_tsv(store, tmp_path / "b.tsv", "butd-tsv")
    with pytest.raises(VlbertsError, match=r"s\.h5: record world_1: LXMERT TSV needs obj_id/obj_conf"):
        export_tsv(store, tmp_path / "l.tsv", "lxmert-tsv")  # the store lacks them: named, not the TSV
    assert not (tmp_path / "b.tsv").exists() and not (tmp_path / "l.tsv").exists() and leftovers(tmp_path) == []
    objs = write_store_records(
        tmp_path / "o.h5", [RegionRecord("w1", 8, 8, np.zeros((2, 4)), np.ones((2, 2)), obj_id=[3, 4], obj_conf=[0.9, 0.8])]
    )
    assert export_tsv(objs, tmp_path / "l.tsv", "lxmert-tsv", zero_missing_attrs=True) == 1
    # an existing file is replaced only when asked, and never the store itself (it was, exit 0)
    with pytest.raises(VlbertsError, match=r"l\.tsv: already exists \(pass --overwrite to replace it\)"):
        export_tsv(objs, tmp_path / "l.tsv", "lxmert-tsv", zero_missing_attrs=True)
    assert export_tsv(objs, tmp_path / "l.tsv", "lxmert-tsv", zero_missing_attrs=True, overwrite=True) == 1
    with pytest.raises(VlbertsError, match=r"o\.h5: is the store being exported"):
        export_tsv(objs, tmp_path / "o.h5", "lxmert-tsv", zero_missing_attrs=True, overwrite=True)
    assert RegionStore(objs).ids() == ["w1"]
    (rec,) = read_lxmert_tsv(tmp_path / "l.tsv")
    assert rec.attr_id.tolist() == [0, 0] and rec.obj_id.tolist() == [3, 4]


# --------------------------------------------------------------------------- import into the store


@pytest.mark.parametrize("fmt, writer, items", [
    ("butd-tsv", write_butd_like_generate_tsv, BUTD_ITEMS),
    ("lxmert-tsv", write_lxmert_like_extract, LXMERT_ITEMS),
])
def test_import_round_trip_tsv_store_tsv(tmp_path, fmt, writer, items):
    src = tmp_path / "in.tsv"
    writer(src, items)
    expected = list((read_butd_tsv if fmt == "butd-tsv" else read_lxmert_tsv)(src))
    out = import_features(src, fmt, tmp_path / "s.h5")
    with RegionStore(out) as s:
        assert s.ids() == [r.image_id for r in expected]
        assert all(s.get(r.image_id).differences(r) == [] for r in expected)
        source = s.metadata.source
        assert (source["format"], source["file"], source["lines"]) == (fmt, str(src.resolve()), 3)
        assert source["bytes"] == src.stat().st_size
        export_tsv(s, tmp_path / "out.tsv", fmt)
    assert (tmp_path / "out.tsv").read_bytes() == src.read_bytes()


def test_import_float16(tmp_path):
    src = tmp_path / "in.tsv"
    write_lxmert_like_extract(src, LXMERT_ITEMS)
    out = import_features(src, "lxmert-tsv", tmp_path / "s.h5", dtype="float16")
    with RegionStore(out) as s:
        assert s.dtype == "float16"
        for rec in read_lxmert_tsv(src):
            got = s.get(rec.image_id)
            assert got.differences(rec, atol=4e-3) == []  # features in [0, 4): float16 step <= 2**-9
            assert got.differences(rec) == ["features"]  # everything else is exact


# --------------------------------------------------------------------------- bad input


def _butd_lines(tmp_path: Path) -> list[str]:
    write_butd_like_generate_tsv(tmp_path / "good.tsv", BUTD_ITEMS)
    return (tmp_path / "good.tsv").read_bytes().decode().split("\r\n")[:3]


def _cut_in_boxes(line: str) -> str:
    """The line cut off in its 5th field (boxes): what a download interrupted there leaves."""
    return line[: line.index("\t", line.index("\t", line.index("\t") + 1) + 1) + 20]


def _break(lines: list[str], field: int, value: str) -> list[str]:
    parts = lines[2].split("\t")
    parts[field] = value
    return lines[:2] + ["\t".join(parts)]


BAD_LINES = {
    "truncated-in-boxes": (lambda ls: ls[:2] + [_cut_in_boxes(ls[2])], "expected 6 tab-separated fields"),
    "truncated-in-features": (lambda ls: ls[:2] + [ls[2][:-5]], "features is not valid base64"),
    "truncated-at-4-chars": (lambda ls: ls[:2] + [ls[2][:-8]], "features holds 315 bytes, not a whole number"),
    "bad-base64": (lambda ls: _break(ls, 4, "!!" + ls[2].split("\t")[4][2:]), "boxes is not valid base64"),
    "num-boxes": (lambda ls: _break(ls, 3, "11"), "num_boxes=11 but boxes holds 10 boxes"),
    "non-integer": (lambda ls: _break(ls, 1, "42x"), "image_w is not an integer: '42x'"),
    "duplicate": (lambda ls: _break(ls, 0, "42"), "duplicate image id 42 (first on line 1)"),
    "narrower": (lambda ls: _break(ls, 5, b64(np.zeros((10, 4), np.float32))), "feature width 4"),
}


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_bad_line_is_one_error_naming_file_and_line_and_no_store(tmp_path, kind):
    breaker, words = BAD_LINES[kind]
    lines = breaker(_butd_lines(tmp_path))
    src = tmp_path / "bad.tsv"
    src.write_text("\r\n".join(lines))  # no final newline, as a cut-off download
    image_id = "42" if kind == "duplicate" else "131089"
    with pytest.raises(VlbertsError) as e:
        import_features(src, "butd-tsv", tmp_path / "s.h5")
    assert e.value.path == str(src)
    assert e.value.record == f"line 3 (image {image_id})"
    assert words in e.value.message, e.value.message
    assert not (tmp_path / "s.h5").exists() and leftovers(tmp_path) == []


def test_wrong_format_is_named(tmp_path):
    write_lxmert_like_extract(tmp_path / "obj36.tsv", LXMERT_ITEMS)
    with pytest.raises(VlbertsError, match=r"got 10 \(this looks like lxmert-tsv\)"):
        import_features(tmp_path / "obj36.tsv", "butd-tsv", tmp_path / "s.h5")


def test_import_refuses_to_clobber_and_keeps_the_old_store_on_failure(tmp_path):
    write_butd_like_generate_tsv(tmp_path / "good.tsv", BUTD_ITEMS)
    out = import_features(tmp_path / "good.tsv", "butd-tsv", tmp_path / "s.h5")
    with pytest.raises(VlbertsError, match="already exists"):
        import_features(tmp_path / "good.tsv", "butd-tsv", out)
    (tmp_path / "bad.tsv").write_text("\r\n".join(BAD_LINES["truncated-in-boxes"][0](_butd_lines(tmp_path))))
    with pytest.raises(VlbertsError):
        import_features(tmp_path / "bad.tsv", "butd-tsv", out, overwrite=True)
    with RegionStore(out) as s:
        assert len(s) == 3


# --------------------------------------------------------------------------- CLI


def test_cli_truncated_file_exits_2_with_one_line(tmp_path):
    lines = _butd_lines(tmp_path)
    src = tmp_path / "cut.tsv"
    src.write_text("\r\n".join(lines[:2] + [_cut_in_boxes(lines[2])]))
    out = tmp_path / "s.h5"
    proc = subprocess.run([str(VLBERTS), "features", "import", str(src), "--format", "butd-tsv", "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"error: {src}: record line 3 (image 131089): expected 6 tab-separated fields (image_id, image_w, image_h, "
        "num_boxes, boxes, features) for butd-tsv, got 5 (truncated line?)"
    ]
    assert proc.stdout == "" and not out.exists() and leftovers(tmp_path) == []


def test_cli_binary_file_error_is_one_short_printable_line(tmp_path):
    """A binary file given as a TSV (an executable, a .npy): its first bytes are the "image id"; the error
    shows them escaped and cut short, never raw (NUL, CR, ESC would garble or split the terminal line)."""
    src = tmp_path / "bin.tsv"
    src.write_bytes(b"\x7fELF\x02\x01\x01\x00\x1b[31m\r\x00\x07" + bytes(range(256)) * 4)
    out = tmp_path / "s.h5"
    proc = subprocess.run([str(VLBERTS), "features", "import", str(src), "--format", "butd-tsv", "--out", str(out)],
                          capture_output=True)
    assert proc.returncode == 2 and proc.stdout == b"" and not out.exists()
    err = proc.stderr.decode("ascii")  # nothing but ASCII: no raw byte came through
    assert err.endswith("\n") and err[:-1].isprintable(), err
    assert err.startswith(f"error: {src}: record line 1 (image '\\x7fELF\\x02\\x01\\x01\\x00\\x1b[31m\\r\\x00"
                          "\\x07\\x00\\x01\\x02\\x03\\x04\\x05\\x06\\x07'...): expected 6 tab-separated fields")
    assert len(err) - len(str(src)) < 250, err  # the id cut at 24 characters


def test_error_line_escapes_what_would_not_print():
    """Whatever a reader quotes into an error (a path, a record name, a value), the line stays one printable
    line; printable text, any script, is unchanged."""
    e = VlbertsError("value '\x1b[2J' is \x00 odd", path="a\x07b.tsv", record="line 1 (image caf\u00e9\u200b\x7f)")
    assert str(e) == "a\\x07b.tsv: record line 1 (image caf\u00e9\\u200b\\x7f): value '\\x1b[2J' is \\x00 odd"
    assert str(VlbertsError("bad\tvalue\r\nhere", path="ü/x.tsv", record=3)) == "ü/x.tsv: record 3: bad value here"


def test_cli_import_info_export(tmp_path):
    src = tmp_path / "obj36.tsv"
    write_lxmert_like_extract(src, LXMERT_ITEMS)
    out = tmp_path / "s.h5"
    runner = CliRunner()
    res = runner.invoke(app, ["features", "import", str(src), "--format", "lxmert-tsv", "--out", str(out),
                              "--float16", "--extractor", "butd-caffe-36"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"wrote {out}: 3 images, 42 boxes, 8-d float16 features")
    res = runner.invoke(app, ["features", "info", str(out)])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["num_images"] == 3 and info["boxes_per_image"] == {"min": 1, "mean": 14.0, "max": 36}
    assert (info["feature_dim"], info["dtype"]) == (8, "float16")
    assert info["fields"] == ["boxes", "features", "obj_id", "obj_conf", "attr_id", "attr_conf"]
    assert info["metadata"]["extractor"] == "butd-caffe-36"
    assert info["metadata"]["source"]["format"] == "lxmert-tsv"
    res = runner.invoke(app, ["features", "export", str(out), "--format", "lxmert-tsv", "--out", str(tmp_path / "x.tsv")])
    assert res.exit_code == 0, res.output
    assert [r.image_id for r in read_lxmert_tsv(tmp_path / "x.tsv")] == [i[0] for i in LXMERT_ITEMS]


def test_several_files_of_one_format_import_into_one_store(tmp_path):
    """LXMERT's train2014 and val2014 TSVs into one store (`features import A B`): every image of both, as the
    single-file import reads each; the store's source lists both files; an image in both is an error naming
    both files, and an empty file among them names itself; no store is left by a failure."""
    a, b = tmp_path / "train2014_obj36.tsv", tmp_path / "val2014_obj36.tsv"
    write_lxmert_like_extract(a, LXMERT_ITEMS[:2])
    write_lxmert_like_extract(b, LXMERT_ITEMS[2:])
    write_lxmert_like_extract(tmp_path / "all.tsv", LXMERT_ITEMS)
    runner = CliRunner()
    res = runner.invoke(app, ["features", "import", str(a), str(b), "--format", "lxmert-tsv", "--out", str(tmp_path / "s.h5")])
    assert res.exit_code == 0, res.output
    assert res.output.startswith(f"wrote {tmp_path / 's.h5'}: 3 images, 42 boxes")
    one = import_features(tmp_path / "all.tsv", "lxmert-tsv", tmp_path / "one.h5")
    with RegionStore(tmp_path / "s.h5") as both, RegionStore(one) as single:
        assert both.ids() == single.ids() == [i[0] for i in LXMERT_ITEMS]
        assert all(both.get(i).differences(single.get(i)) == [] for i in single.ids())
        source = both.metadata.source
    assert source["format"] == "lxmert-tsv" and [f["file"] for f in source["files"]] == [str(a.resolve()), str(b.resolve())]
    assert [f["lines"] for f in source["files"]] == [2, 1] and source["files"][1]["bytes"] == b.stat().st_size

    write_lxmert_like_extract(b, LXMERT_ITEMS[1:])  # its first image is in a.tsv too
    with pytest.raises(VlbertsError) as err:
        import_features([a, b], "lxmert-tsv", tmp_path / "dup.h5")
    assert str(err.value) == f"{b}: record line 1 (image dev-850-0-img0): duplicate image id dev-850-0-img0 (first on line 2 of {a})"
    b.write_text("")
    with pytest.raises(VlbertsError, match=rf"^{b}: no records in this lxmert-tsv file$"):
        import_features([a, b], "lxmert-tsv", tmp_path / "empty.h5")
    assert not (tmp_path / "dup.h5").exists() and not (tmp_path / "empty.h5").exists() and leftovers(tmp_path) == []


def test_a_zipped_tsv_says_to_unzip_it(tmp_path):
    """LXMERT distributes its TSVs zipped; the zip given as the TSV read as one cut-off line."""
    import zipfile

    with zipfile.ZipFile(tmp_path / "train2014_obj36.zip", "w") as z:
        z.writestr("train2014_obj36.tsv", "x\ty\n")
    with pytest.raises(VlbertsError, match=r"train2014_obj36.zip: is a zip archive, not a TSV: unzip it"):
        import_features(tmp_path / "train2014_obj36.zip", "lxmert-tsv", tmp_path / "s.h5")


def test_cli_import_keeps_its_progress_in_a_log_with_vlberts_progress(tmp_path):
    """`features import` drew its bar on a terminal only, and ignored VLBERTS_PROGRESS, which every other
    command's bars honour: a scheduler's log of a long import (BUTD's tens of GB) showed nothing until the
    last line."""
    src = tmp_path / "f.tsv"
    src.write_text("\r\n".join(_butd_lines(tmp_path)))
    env = {**os.environ, "VLBERTS_PROGRESS": "1"}
    proc = subprocess.run([str(VLBERTS), "features", "import", str(src), "--format", "butd-tsv", "--out",
                           str(tmp_path / "s.h5")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "importing" in proc.stderr, proc.stderr
    env.pop("VLBERTS_PROGRESS")
    proc = subprocess.run([str(VLBERTS), "features", "import", str(src), "--format", "butd-tsv", "--out",
                           str(tmp_path / "t.h5")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "importing" not in proc.stderr  # a log without it: the summary line only
