"""Readers of the region-feature files the original code bases wrote, beside the BUTD and LXMERT TSVs
(`tsv.py`): VL-BERT's per-image JSON, ViLBERT's LMDB, BAN's HDF5, VisualBERT's Detectron `.th` / `.npz`
files and MMF's (Pythia's) and ViLBERT's per-image `.npy` (SPEC §2; formats-and-metrics.md §1.3-1.5). Each reader yields `(where, raw, record)`: where the record sits in the source ("file
000042.json", "key b'42'", "image 3"), the raw bytes it came from (for the importer's content hash and
progress) and the `RegionRecord`; `importers.import_features` streams them into a store.

Conventions the records follow (`record.py`): boxes are (x1, y1, x2, y2) in pixels of the original image;
where a file holds the detector's full class distribution (VL-BERT's `classes`, 1601 columns with the
background first), it becomes `cls_prob` as written, and `obj_id` / `obj_conf` are derived from it as
LXMERT's extractor derives them: the arg-max and max over the non-background columns, 0-based
(formats §1.2); the same for `attrs` into `attr_id` / `attr_conf`.
"""

from __future__ import annotations

import json
import zipfile
import zlib
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from vlberts.errors import first_line, VlbertsError
from vlberts.features import msgpack
from vlberts.features.record import CLS_PROB_ATOL, RegionRecord, coco_number
from vlberts.features.tsv import b64_rows
from vlberts.io import DuplicateKey, unique_keys
from vlberts.safe_pickle import read_npy, safe_load, safe_loads

Source = Iterator[tuple[str, bytes, RegionRecord]]
_F32 = np.dtype("<f4")


def _best_non_background(scores: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, 1 + C) scores with the background first -> (arg-max over the C classes, 0-based; that max)."""
    rest = scores[:, 1:]
    if rest.shape[1] == 0:
        raise VlbertsError(f"a class distribution needs the background and at least one class, got {scores.shape[1]} columns")
    return rest.argmax(1).astype(np.int64), rest.max(1).astype(np.float32)


def _positive_int(obj: dict[str, Any], key: str, minimum: int = 1) -> int:
    v = obj.get(key)
    if isinstance(v, str) and v.isdigit():  # vilbert_beta's records are TSV rows of strings
        v = int(v)
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v < minimum:
        raise VlbertsError(f"{key} must be an integer >= {minimum}, got {v!r}")
    return int(v)


def _missing(obj: dict[str, Any], keys: tuple[str, ...]) -> None:
    absent = [k for k in keys if k not in obj]
    if absent:
        raise VlbertsError(f"missing field(s) {', '.join(absent)} (has {', '.join(sorted(map(str, obj))) or 'none'})")


def _float_array(value: Any, name: str) -> np.ndarray:
    """A tensor (any dtype or layout, with or without grad) or an array-like of numbers -> float32 array."""
    if hasattr(value, "detach") and hasattr(value, "is_sparse"):  # a torch tensor (torch is imported lazily)
        value = value.detach()
        if value.is_sparse:
            value = value.to_dense()
        value = value.float().numpy()
    try:
        with np.errstate(over="ignore", invalid="ignore"):
            a = np.asarray(value, dtype=np.float32)
    except (TypeError, ValueError):
        raise VlbertsError(f"{name} must hold numbers, got {type(value).__name__}") from None
    return a


def _b64_or_array(value: Any, name: str, n: int, width: int | None) -> np.ndarray:
    """A field stored base64 (float32, as the BUTD-derived writers do) or as a numpy array -> (n, width)."""
    if isinstance(value, (str, bytes)):
        # a non-ASCII character becomes "?", which the base64 check then rejects with the field's name
        return b64_rows(value.encode("ascii", "replace") if isinstance(value, str) else value, name, _F32, n, width)
    a = np.asarray(value)
    if a.dtype.kind not in "fiu" or a.ndim != 2 or a.shape[0] != n or (width is not None and a.shape[1] != width):
        want = f"({n}, {width if width is not None else 'D'})"
        raise VlbertsError(f"{name} must be an array of shape {want}, got {a.dtype} {a.shape}")
    with np.errstate(over="ignore", invalid="ignore"):  # too big for float32: inf, refused by the record
        return a.astype(np.float32, copy=False)


def _record(obj: Any, fields: dict[str, str]) -> RegionRecord:
    """A VL-BERT / ViLBERT per-image dict -> record. `fields` maps our names to the file's keys."""
    if not isinstance(obj, dict):
        raise VlbertsError(f"expected an object with the image's fields, got {type(obj).__name__}")
    _missing(obj, tuple(fields[k] for k in ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")))
    n = _positive_int(obj, fields["num_boxes"], 0)
    rec: dict[str, Any] = dict(
        image_id=obj[fields["image_id"]],
        image_w=_positive_int(obj, fields["image_w"]),
        image_h=_positive_int(obj, fields["image_h"]),
        boxes=_b64_or_array(obj[fields["boxes"]], "boxes", n, 4),
        features=_b64_or_array(obj[fields["features"]], "features", n, None),
    )
    if isinstance(rec["image_id"], str) and rec["image_id"].isdigit():  # a TSV row of strings: numeric ids as ints
        rec["image_id"] = int(rec["image_id"])
    if fields.get("cls_prob") in obj:
        rec["cls_prob"] = _b64_or_array(obj[fields["cls_prob"]], fields["cls_prob"], n, None)
        rec["obj_id"], rec["obj_conf"] = _best_non_background(rec["cls_prob"]) if n else (np.zeros(0), np.zeros(0))
    if fields.get("attrs") in obj:
        attrs = _b64_or_array(obj[fields["attrs"]], fields["attrs"], n, None)
        rec["attr_id"], rec["attr_conf"] = _best_non_background(attrs) if n else (np.zeros(0), np.zeros(0))
    return RegionRecord(**rec)


# --------------------------------------------------------------------------- VL-BERT per-image JSON (§1.4)

VLBERT_FIELDS = {"image_id": "image_id", "image_w": "image_w", "image_h": "image_h", "num_boxes": "num_boxes",
                 "boxes": "boxes", "features": "features", "cls_prob": "classes", "attrs": "attrs"}


def _json_files(src: Path) -> Iterator[tuple[str, bytes]]:
    """(name, bytes) of every *.json in a directory, or in a zip (VL-BERT's `*.zip@/...` layout), by name; one
    holding none (an LMDB's folder, a torch.save file, which is a zip too) is an error saying what is read."""
    none = "holds no .json file: vlbert-json reads a directory of per-image .json files, or a .zip of them"
    if src.is_dir():
        paths = sorted(src.glob("*.json"))
        if not paths:
            raise VlbertsError(none, path=src)
        for path in paths:
            yield path.name, path.read_bytes()
    elif zipfile.is_zipfile(src):
        with zipfile.ZipFile(src) as z:
            names = sorted(n for n in z.namelist() if n.endswith(".json"))
            if not names:
                raise VlbertsError(none, path=src)
            for name in names:
                yield name, z.read(name)
    elif src.exists():
        raise VlbertsError("vlbert-json reads a directory of per-image .json files, or a .zip of them", path=src)
    else:
        raise VlbertsError("not found", path=src)


def read_vlbert_json(src: str | Path) -> Source:
    """VL-BERT's precomputed features: one JSON object per image (`{image_id}.json`, keys image_id,
    image_w, image_h, num_boxes, and base64 float32 boxes (N, 4), features (N, D), optionally classes
    (N, 1601) and attrs), in a directory or a zip."""
    src = Path(src)
    for name, data in _json_files(src):
        try:
            obj = json.loads(data, object_pairs_hook=unique_keys)
            yield f"file {name}", data, _record(obj, VLBERT_FIELDS)
        except json.JSONDecodeError as e:
            raise VlbertsError(f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg}", path=src,
                               record=f"file {name}") from None
        except UnicodeDecodeError as e:
            raise VlbertsError(f"not UTF-8 text (byte {e.start}: {e.object[e.start:e.start + 1]!r})", path=src,
                               record=f"file {name}") from None
        except DuplicateKey as e:
            raise VlbertsError(str(e), path=src, record=f"file {name}") from None
        except VlbertsError as e:
            raise VlbertsError(e.message, path=src, record=f"file {name}") from None


# --------------------------------------------------------------------------- ViLBERT LMDB (§1.3)

VILBERT_FIELDS = {"image_id": "image_id", "image_w": "image_w", "image_h": "image_h", "num_boxes": "num_boxes",
                  "boxes": "boxes", "features": "features", "cls_prob": "cls_prob"}


def _lmdb_values(src: Path, format: str, keys_entry: bytes, load_keys: Callable[[bytes], Any]
                 ) -> Iterator[tuple[str, bytes]]:
    """(where, value) of every record of an LMDB (a directory or a single file), in the order the list stored
    under `keys_entry` gives (decoded by `load_keys`), or without it in the database's own key order."""
    try:
        import lmdb
    except ImportError:
        raise VlbertsError(f"{format} needs the lmdb package: pip install 'vlberts[lmdb]'") from None
    if not src.exists():
        raise VlbertsError("not found", path=src)
    try:
        env = lmdb.open(str(src), readonly=True, lock=False, readahead=False, subdir=src.is_dir())
    except lmdb.Error as e:
        raise VlbertsError(f"cannot open as LMDB ({e})", path=src) from None
    with env, env.begin() as txn:
        listed = txn.get(keys_entry)
        if listed is not None:
            where = f"key {keys_entry!r}"
            try:
                keys = load_keys(listed)
            except VlbertsError as e:
                raise VlbertsError(e.message, path=src, record=where) from None
            if not isinstance(keys, list) or not all(isinstance(k, bytes) for k in keys):
                raise VlbertsError(f"the {keys_entry!r} entry is not a list of byte strings", path=src, record=where)
        else:
            keys = [k for k, _ in txn.cursor()]
        for key in keys:
            where = f"key {key[:40]!r}"
            value = txn.get(key)
            if value is None:
                raise VlbertsError(f"listed in {keys_entry!r} but not in the database", path=src, record=where)
            yield where, value


def read_vilbert_lmdb(src: str | Path) -> Source:
    """ViLBERT's fine-tuning LMDB: each value a pickled dict (image_id, image_h, image_w, num_boxes, boxes,
    features) with numpy arrays (vilbert-multi-task) or base64 strings (vilbert_beta, which may add
    cls_prob); the key `b"keys"` a pickled list of every image's key, in the order read here (without it,
    the database's own key order). Pickles go through the restricted unpickler (`safe_pickle`, numpy arrays
    allowed). Needs the `lmdb` package (`pip install 'vlberts[lmdb]'`)."""
    src = Path(src)
    load = partial(safe_loads, source=f"{src} (key b'keys')", numpy=True)
    for where, value in _lmdb_values(src, "vilbert-lmdb", b"keys", load):
        try:
            yield where, value, _record(safe_loads(value, source=src, numpy=True), VILBERT_FIELDS)
        except VlbertsError as e:
            raise VlbertsError(e.message, path=src, record=where) from None


# --------------------------------------------------------------------------- ViLBERT's Conceptual Captions LMDB (§1.3)

# The datapoint vilbert_beta's `conceptual_caption_preprocess_sequential_train.py` writes, in this order.
VILBERT_CC_FIELDS = ("features", "cls_prob", "boxes", "num_boxes", "image_h", "image_w", "image_id", "caption")


def _tensorpack_loads(value: bytes, src: Path) -> Any:
    """A value tensorpack's `LMDBSerializer` wrote: msgpack with msgpack_numpy (ViLBERT's, formats §1.3), or a
    pickle, which tensorpack-style serialisers can be set to write instead (it starts with the PROTO opcode
    0x80, which as msgpack would be an empty map, never a datapoint), read through the restricted
    unpickler. (tensorpack's third serialiser, pyarrow's, is not read: its value fails as msgpack.)"""
    if value[:1] == b"\x80":
        return safe_loads(value, source=src, numpy=True)
    try:
        return msgpack.unpackb(value)
    except ValueError as e:
        raise VlbertsError(f"cannot read this value as msgpack: {first_line(e)}") from None


def read_vilbert_cc_lmdb(src: str | Path, captions: Any = None) -> Source:
    """ViLBERT's pre-training LMDB of Conceptual Captions (tensorpack's `LMDBSerializer`: keys b"00000000",
    b"00000001", ..., listed in order under b"__keys__"): each value the list `VILBERT_CC_FIELDS`, features
    (N, D), the detector's class distribution (N, 1601, background first), pixel boxes (N, 4), the number
    of boxes (the arrays may hold more rows; as ViLBERT's reader, the first `num_boxes` are the image's),
    the image size, the image id (crc32 of the image's URL) and its caption. `cls_prob` becomes `obj_id` /
    `obj_conf` as for the other formats. Each record's (image id, caption) is appended to `captions` when
    given (a list, or the importer's `CaptionSpool`). Needs the `lmdb` package."""
    src = Path(src)
    for where, value in _lmdb_values(src, "vilbert-cc-lmdb", b"__keys__", lambda v: _key_list(_tensorpack_loads(v, src))):
        try:
            rec, image_id, caption = _cc_record(_tensorpack_loads(value, src))
        except VlbertsError as e:
            raise VlbertsError(e.message, path=src, record=where) from None
        if captions is not None:
            captions.append((image_id, caption))
        yield where, value, rec


def _key_list(keys: Any) -> Any:
    """tensorpack's key list: byte strings, which a msgpack that wrote `str` for bytes gives as text."""
    return [msgpack.as_bytes(k) if isinstance(k, str) else k for k in keys] if isinstance(keys, list) else keys


def _cc_record(dp: Any) -> tuple[RegionRecord, str | int, str]:
    """A datapoint -> (record, the image id as written (an int or a string), caption)."""
    if not isinstance(dp, (list, tuple)) or len(dp) != len(VILBERT_CC_FIELDS):
        got = f"{len(dp)} fields" if isinstance(dp, (list, tuple)) else type(dp).__name__
        raise VlbertsError(f"expected the {len(VILBERT_CC_FIELDS)} fields {', '.join(VILBERT_CC_FIELDS)}, got {got}")
    obj = dict(zip(VILBERT_CC_FIELDS, dp))
    n = _positive_int(obj, "num_boxes", 0)
    for name in ("features", "cls_prob", "boxes"):
        a = obj[name]
        if not isinstance(a, np.ndarray) or a.ndim != 2 or a.shape[0] < n:
            shape = a.shape if isinstance(a, np.ndarray) else type(a).__name__
            raise VlbertsError(f"{name} must be an array of at least num_boxes = {n} rows, got {shape}")
        obj[name] = a[:n]
    caption = obj["caption"]
    if isinstance(caption, bytes):
        caption = caption.decode("utf-8", "surrogateescape")
    if not isinstance(caption, str) or not caption.strip():
        raise VlbertsError(f"caption must be a non-empty string, got {caption!r}")
    try:
        caption.encode("utf-8")
    except UnicodeEncodeError:
        raise VlbertsError("the caption is not UTF-8 text") from None
    image_id = obj["image_id"]
    if isinstance(image_id, bytes):
        image_id = image_id.decode("utf-8", "replace")
    elif isinstance(image_id, np.integer):
        image_id = int(image_id)
    if isinstance(image_id, bool) or not isinstance(image_id, (int, str)):
        raise VlbertsError(f"image_id must be an integer or a string, got {image_id!r}")
    obj["image_id"] = image_id
    return _record(obj, VILBERT_FIELDS), image_id, caption


# --------------------------------------------------------------------------- BAN HDF5 (§1.5)

def read_ban_h5(src: str | Path, ids: str | Path) -> Source:
    """BAN's HDF5 (jnhwkim/ban-vqa `adaptive_detection_features_converter.py`; VisualBERT's Flickr30K
    features): `image_features` (sum N, D), `image_bb` (sum N, 4) xyxy pixels, `spatial_features`
    (sum N, 6) = (x1/W, y1/H, x2/W, y2/H, w/W, h/H), `pos_boxes` (images, 2) each image's [start, end)
    rows; `ids` the `{split}_imgid2idx.pkl` beside it, {image id: row of pos_boxes} (restricted unpickler),
    which must index every row once (another split's index would name other images).

    The file holds no image size: W and H come back from the boxes and their normalised coordinates
    (W = x2 / (x2 / W) for the box reaching furthest right; every box must agree to within a pixel)."""
    import h5py

    src = Path(src)
    index = safe_load(ids)
    if not isinstance(index, dict):
        raise VlbertsError(f"expected a dict of image id -> index, got {type(index).__name__}", path=ids)
    try:
        f = h5py.File(src, "r")
    except OSError as e:
        raise VlbertsError(f"cannot open as HDF5 ({e})", path=src) from None
    with f:
        missing = [k for k in ("image_features", "image_bb", "spatial_features", "pos_boxes") if k not in f]
        if missing:
            raise VlbertsError(f"not a BAN feature file: no dataset(s) {', '.join(missing)}", path=src)
        pos = f["pos_boxes"][:] if isinstance(f["pos_boxes"], h5py.Dataset) else None
        rows = len(f["image_bb"]) if isinstance(f["image_bb"], h5py.Dataset) else -1
        if pos is None or pos.ndim != 2 or pos.shape[1] != 2 or pos.dtype.kind not in "iu":
            raise VlbertsError("pos_boxes must be an (images, 2) integer dataset of [start, end) rows", path=src)
        # each image's rows: inside the per-box datasets, in order, never shared with another image
        starts, ends = pos[:, 0].astype(np.int64), pos[:, 1].astype(np.int64)
        if len(pos) and ((starts < 0).any() or (ends < starts).any() or (ends > rows).any()
                         or (starts[1:] < ends[:-1]).any()):
            raise VlbertsError(f"pos_boxes rows overlap, run backwards or leave the {rows} box rows", path=src)
        for name in ("image_features", "image_bb", "spatial_features"):
            if not isinstance(f[name], h5py.Dataset) or f[name].ndim != 2 or len(f[name]) != rows:
                raise VlbertsError(f"{name} must be a 2-d dataset with a row per box ({rows})", path=src)
        bad_index = [(k, i) for k, i in index.items() if not isinstance(i, int) or isinstance(i, bool)
                     or not 0 <= i < len(pos)]
        if bad_index:
            k, i = bad_index[0]
            raise VlbertsError(f"index {i!r} is not a row of {src.name}'s pos_boxes (0..{len(pos) - 1}): is this "
                               "that file's index?", path=ids, record=f"image {k}")
        # BAN's converter indexes every image of its file once: another split's index may fit inside the rows
        # and still name other images
        if sorted(index.values()) != list(range(len(pos))):
            raise VlbertsError(f"the index names {len(set(index.values()))} distinct rows, but {src.name} holds "
                               f"{len(pos)} images (pos_boxes rows), each indexed once by its own "
                               f"{src.stem}_imgid2idx.pkl: is this that file's index?", path=ids)
        for image_id, i in sorted(index.items(), key=lambda item: item[1]):
            where = f"image {image_id} (index {i})"
            a, b = (int(v) for v in pos[i])
            boxes = f["image_bb"][a:b].astype(np.float32)
            feats = f["image_features"][a:b].astype(np.float32)
            spatial = f["spatial_features"][a:b].astype(np.float64)
            try:
                w, h = _image_size(boxes, spatial)
                rec = RegionRecord(image_id=image_id, image_w=w, image_h=h, boxes=boxes, features=feats)
            except VlbertsError as e:
                raise VlbertsError(e.message, path=src, record=where) from None
            yield where, boxes.tobytes() + feats.tobytes(), rec


def _image_size(boxes: np.ndarray, spatial: np.ndarray) -> tuple[int, int]:
    """(W, H) from pixel boxes (N, 4) and BAN's (x1/W, y1/H, x2/W, y2/H, ...) (N, 6)."""
    if len(boxes) == 0:
        raise VlbertsError("no boxes: the image size cannot be recovered")
    if spatial.shape != (len(boxes), 6):
        raise VlbertsError(f"spatial_features must be ({len(boxes)}, 6), got {spatial.shape}")
    sizes = []
    for axis, col in ((2, 2), (3, 3)):  # x2 / (x2 / W), y2 / (y2 / H)
        j = int(np.argmax(boxes[:, axis]))
        if spatial[j, col] <= 0:
            raise VlbertsError("boxes at the image's corner only: the image size cannot be recovered")
        size = boxes[j, axis] / spatial[j, col]
        implied = boxes[:, axis] / np.where(spatial[:, col] > 0, spatial[:, col], np.nan)
        if np.nanmax(np.abs(implied - size)) > 1.0:
            raise VlbertsError("boxes and spatial_features disagree on the image size")
        sizes.append(int(round(float(size))))
    return sizes[0], sizes[1]


# --------------------------------------------------------------------------- VisualBERT Detectron .th / .npz (§1.5)

def read_visualbert_th(src: str | Path, images: str | Path) -> Source:
    """VisualBERT's Detectron features (`utils/get_image_features/extract_image_features_nlvr.py`; NLVR2 and
    COCO-for-NLVR2): one `torch.save`d dict {image file name: (box_features (N, D), cls_boxes (N, 4) xyxy
    pixels, max_conf (N,))} (`--one_giant_file X.th`, read with `weights_only=True`), or a directory of
    per-image `<image file name>.npz` files with those three arrays (read without pickles). Neither holds
    the image size, so it is read from the header of the image of that name in `images` or any folder below
    it (NLVR2's train images sit in numbered folders, and one root serves train, dev and test1); the id is
    the image file's stem. `max_conf` comes without the class it belongs to, so it is not kept (the store's
    object confidences go with class ids); boxes stay in the file's order."""
    import torch
    from PIL import Image, UnidentifiedImageError

    src, images = Path(src), Path(images)
    if not images.is_dir():
        raise VlbertsError("not a directory of images (visualbert-th reads the image sizes from them)", path=images)
    below: dict[str, Path] = {}  # file name -> path, for the names not directly in `images` (walked once)

    def find(name: str) -> Path | None:
        if (images / name).is_file():
            return images / name
        if not below:
            for path in sorted(images.rglob("*")):
                if path.is_file():
                    below.setdefault(path.name, path)
            below.setdefault("", images)  # walked (and empty names never match)
        return below.get(name)

    def size(name: str, where: str) -> tuple[int, int]:
        path = find(name)
        if path is None or not name:
            raise VlbertsError(f"no image {name} in {images} or below it to read its size from", path=src,
                               record=where)
        try:
            with Image.open(path) as im:
                return im.size
        except FileNotFoundError:
            raise VlbertsError(f"no image {name} in {images} to read its size from", path=src, record=where) from None
        except (UnidentifiedImageError, OSError) as e:
            raise VlbertsError(f"cannot read as an image ({first_line(e)})", path=path) from None

    def items() -> Iterator[tuple[str, Any]]:
        if src.is_dir():
            for path in sorted(src.glob("*.npz")):
                try:
                    with np.load(path, allow_pickle=False) as z:
                        yield path.name.removesuffix(".npz"), tuple(z[k] for k in ("box_features", "cls_boxes", "max_conf"))
                except (KeyError, ValueError, TypeError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
                    raise VlbertsError("not a VisualBERT feature .npz (box_features, cls_boxes, max_conf): "
                                       f"{type(e).__name__}: {first_line(e)}", path=path) from None
        else:
            try:
                data = torch.load(src, map_location="cpu", weights_only=True)
            except Exception as e:  # a corrupt file, or a pickle with anything but tensors and containers
                raise VlbertsError(f"cannot read as a torch.save file of tensors ({first_line(e)})", path=src) from None
            if not isinstance(data, dict):
                raise VlbertsError(f"expected a dict of image file name -> features, got {type(data).__name__}", path=src)
            yield from sorted(data.items())

    for name, value in items():
        where = f"image {name}"
        try:
            if not isinstance(value, (tuple, list)) or len(value) != 3:
                raise VlbertsError("expected (box_features, cls_boxes, max_conf)")
            feats, boxes = (_float_array(v, name) for name, v in zip(("box_features", "cls_boxes"), value[:2]))
            w, h = size(name, where)
            rec = RegionRecord(image_id=Path(name).stem, image_w=w, image_h=h, boxes=boxes, features=feats)
        except VlbertsError as e:
            raise VlbertsError(e.message, path=e.path or src, record=e.record or where) from None
        yield where, boxes.tobytes() + feats.tobytes(), rec


# --------------------------------------------------------------------------- MMF / Pythia and ViLBERT per-image .npy (§1.3, §1.5)

def _full_distribution(cls_prob: np.ndarray) -> np.ndarray:
    """A detector's class scores as the store keeps them: (N, 1 + C), background first, rows summing to 1.
    Rows that already sum to 1 have the background column (ViLBERT's extractor; MMF's with `--background`);
    MMF's default writes the C object columns alone (the softmax over all columns, the background's cut
    off), and the background's column comes back as 1 minus the row's sum."""
    if cls_prob.ndim != 2 or cls_prob.shape[1] == 0:
        raise VlbertsError(f"cls_prob must be an (N, C) array, got shape {cls_prob.shape}")
    if not len(cls_prob):
        return cls_prob
    sums = cls_prob.sum(1, dtype=np.float64)
    if not np.isfinite(sums).all() or (cls_prob < 0).any() or (sums > 1 + CLS_PROB_ATOL).any():
        raise VlbertsError("cls_prob rows must be probabilities (non-negative, summing to at most 1)")
    if (np.abs(sums - 1) <= CLS_PROB_ATOL).all():
        return cls_prob
    background = np.clip(1 - sums, 0, 1).astype(np.float32)[:, None]
    return np.concatenate([background, cls_prob], 1)


def _npy_record(name: str, info: dict[str, Any], features: Any) -> RegionRecord:
    """One image's fields, as MMF's `_info.npy` or ViLBERT's per-image dict names them, -> record."""
    _missing(info, ("bbox", "image_width", "image_height"))
    feats = np.asarray(features)
    if feats.dtype.kind not in "fiu" or feats.ndim != 2:
        raise VlbertsError(f"features must be an (N, D) array of numbers, got {feats.dtype} {feats.shape}")
    n = len(feats)
    boxes = _b64_or_array(info["bbox"], "bbox", n, 4)
    image_id: Any = info.get("image_id", name)
    if isinstance(image_id, str) and (coco := coco_number(image_id)) is not None:
        image_id = int(coco)  # keyed by its COCO id, as the VQA and COCO caption files name it
    rec: dict[str, Any] = dict(image_id=image_id, image_w=_positive_int(info, "image_width"),
                               image_h=_positive_int(info, "image_height"), boxes=boxes,
                               features=_float_array(feats, "features"))
    if "cls_prob" in info:
        rec["cls_prob"] = _full_distribution(_b64_or_array(info["cls_prob"], "cls_prob", n, None))
        rec["obj_id"], rec["obj_conf"] = _best_non_background(rec["cls_prob"]) if n else (np.zeros(0), np.zeros(0))
    return RegionRecord(**rec)


def read_mmf_npy(src: str | Path) -> Source:
    """Per-image `.npy` files under a directory (searched recursively, in path order), in either layout:

    - MMF / Pythia (`tools/scripts/features/extract_features_vmb.py`; VisualBERT's VQA features,
      `detectron_fix_100/fc6/...`): `<name>.npy` the features (N, D), and beside it `<name>_info.npy`, a dict
      with `bbox` (N, 4) xyxy pixels, `image_width`, `image_height`, `num_boxes`, `objects` and `cls_prob`;
    - ViLBERT's `script/extract_features.py`: one `<name>.npy` holding that dict with `features` and
      `image_id` in it.

    Every row is kept, as MMF's reader keeps them (`num_boxes` counts the rows that some class's NMS kept;
    the file holds the top `--num_features` whatever their score). `cls_prob` becomes the store's full
    distribution (`_full_distribution`), and `obj_id` / `obj_conf` come from it as for the other formats
    (`objects` is its arg-max, so it is not read). The id is the dict's `image_id`, else the file's stem;
    a COCO stem (`COCO_train2014_000000000009`) becomes its COCO id (9). Dicts are read through the
    restricted unpickler; features alone, without their `_info.npy`, are refused (no boxes)."""
    src = Path(src)
    if not src.is_dir():
        raise VlbertsError("mmf-npy reads a directory of per-image .npy files" if src.exists() else "not found",
                           path=src)
    files = sorted(src.rglob("*.npy"))
    infos = {p for p in files if p.name.endswith("_info.npy")}
    feature_files = set(files) - infos  # sets: a VQA split holds 80,000 images or more
    stray = sorted(p for p in infos if p.with_name(p.name.removesuffix("_info.npy") + ".npy") not in feature_files)
    if stray:
        raise VlbertsError("an _info.npy without the features file of its name beside it", path=stray[0])
    for path in sorted(feature_files):
        where = f"file {path.relative_to(src)}"
        info_path = path.with_name(path.stem + "_info.npy")
        try:
            data, raw = read_npy(path)
            if isinstance(data, dict):  # ViLBERT's layout: the fields and the features in one dict
                _missing(data, ("features",))
                info, features = data, data["features"]
            elif isinstance(data, np.ndarray) and data.dtype.kind in "fiu":
                if info_path not in infos:
                    raise VlbertsError(f"features without {info_path.name} beside them: MMF's extractor writes the "
                                       "boxes and the image size there, and a store's regions need both")
                (info, info_raw), features = read_npy(info_path), data
                raw += info_raw
                if not isinstance(info, dict):
                    raise VlbertsError(f"expected a dict of the image's fields, got {type(info).__name__}", path=info_path)
            else:
                got = f"{data.dtype} array" if isinstance(data, np.ndarray) else type(data).__name__
                raise VlbertsError(f"expected an (N, D) array of features or a dict of the image's fields, got {got}")
            rec = _npy_record(path.stem, info, features)
        except VlbertsError as e:
            raise VlbertsError(e.message, path=e.path or path, record=e.record or where) from None
        yield where, raw, rec
