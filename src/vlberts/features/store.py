"""The canonical region-feature store: one HDF5 file holding the regions of every image (SPEC §2).

Layout (format "vlberts-region-store", version 1). I images, B = total boxes over all images:

    /image_ids   (I,)    utf-8 variable-length strings, the canonical ids in write order
    /image_w     (I,)    int32
    /image_h     (I,)    int32
    /offset      (I,)    int64   first row of the image in the per-box arrays
    /count       (I,)    int32   its number of boxes N (rows offset .. offset+N)
    /boxes       (B, 4)  float32 xyxy pixels
    /features    (B, D)  float32 or float16 (the store's `dtype`)
    /cls_prob    (B, C)  same dtype as features            (optional)
    /obj_id      (B,)    int64,  /obj_conf  (B,) float32    (optional, together)
    /attr_id     (B,)    int64,  /attr_conf (B,) float32    (optional, together)
    attrs: format, format_version, feature_dim, dtype, metadata (JSON of `StoreMetadata`),
           created (JSON: time, vlberts version)

Flat per-box arrays (rather than padded (I, Nmax, D) blocks) keep variable box counts (10-100
policies) free of padding, and an image is one contiguous slice. Lookup is O(1): the reader loads
the small per-image arrays and builds an id -> row dict when opened (about 0.1 s per 100k images).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import sys
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from vlberts.errors import VlbertsError
from vlberts.features.record import RegionRecord, StoreMetadata, all_finite, as_float32, canonical_image_id, coco_number, labels_misfit, record_misfit
from vlberts.io import atomic_path

STORE_FORMAT = "vlberts-region-store"
STORE_FORMAT_VERSION = 1
STORE_DTYPES = {"float32": np.float32, "float16": np.float16}
OPTIONAL_FIELDS = ("cls_prob", "obj_id", "obj_conf", "attr_id", "attr_conf")

_FLUSH_BYTES = 32 << 20  # buffer this much box data before one resize+write per dataset
_CHUNK_BYTES = 256 << 10  # HDF5 chunk size target: a 36-box 2048-d image spans 2-3 chunks


def _chunk_rows(row_bytes: int) -> int:
    return int(max(1, min(4096, _CHUNK_BYTES // max(1, row_bytes))))


def _as_metadata(metadata: StoreMetadata | dict[str, Any] | None) -> StoreMetadata:
    if metadata is None:
        return StoreMetadata()
    if isinstance(metadata, StoreMetadata):
        return metadata
    return StoreMetadata.from_dict(metadata)


@dataclasses.dataclass(frozen=True)
class RecordLayout:
    """The per-box fields a corpus of region records holds and how they are stored, fixed before its first
    record: a store's datasets (`RegionStoreWriter`), a shard set's members (`data.shards.ShardSetWriter`).
    `arrays` is the one check a record passes to join either: a record that lacks one of the fields, or
    carries one the corpus does not hold, is an error (nothing is dropped or invented silently)."""

    feature_dim: int
    dtype: str = "float32"  # of features and cls_prob (STORE_DTYPES)
    num_classes: int | None = None  # cls_prob's width, or None: no cls_prob
    with_objects: bool = False
    with_attrs: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in STORE_DTYPES:
            raise VlbertsError(f"unknown store dtype {self.dtype!r}; valid: {', '.join(STORE_DTYPES)}")

    @classmethod
    def of(cls, rec: RegionRecord, dtype: str = "float32") -> "RecordLayout":
        """The layout a corpus takes from its first record."""
        return cls(feature_dim=rec.feature_dim, dtype=dtype, num_classes=None if rec.cls_prob is None else rec.cls_prob.shape[1],
                   with_objects=rec.has_objects, with_attrs=rec.has_attrs)

    def box_fields(self) -> list[tuple[str, tuple[int, ...], Any]]:
        """(name, row shape, dtype) of every per-box field, in the store's (and `REGION_FIELDS`') order."""
        np_dtype = STORE_DTYPES[self.dtype]
        fields: list[tuple[str, tuple[int, ...], Any]] = [("boxes", (4,), np.float32), ("features", (self.feature_dim,), np_dtype)]
        if self.num_classes is not None:
            fields.append(("cls_prob", (self.num_classes,), np_dtype))
        if self.with_objects:
            fields += [("obj_id", (), np.int64), ("obj_conf", (), np.float32)]
        if self.with_attrs:
            fields += [("attr_id", (), np.int64), ("attr_conf", (), np.float32)]
        return fields

    def arrays(self, rec: RegionRecord, metadata: StoreMetadata, *, path: Path, holder: str = "store") -> dict[str, np.ndarray]:
        """The record's per-box fields as stored (name -> (N, ...) array, `box_fields`' order), after checking
        that it fits: its feature width, its fields, its cls_prob width and class / attribute ids inside
        `metadata`'s vocabularies, values inside float16's range where it is stored so. Errors name `path`
        and the image."""
        if rec.feature_dim != self.feature_dim and rec.num_boxes:
            raise VlbertsError(f"feature width {rec.feature_dim} but the {holder} holds {self.feature_dim}-d features",
                               path=path, record=rec.image_id)
        present = {"cls_prob": rec.cls_prob is not None, "objects": rec.has_objects, "attrs": rec.has_attrs}
        wanted = {"cls_prob": self.num_classes is not None, "objects": self.with_objects, "attrs": self.with_attrs}
        for name in present:
            if present[name] != wanted[name]:
                has = "has" if present[name] else "lacks"
                holds = "holds" if wanted[name] else "does not hold"
                raise VlbertsError(f"record {has} {name} but the {holder} {holds} them", path=path, record=rec.image_id)
        misfit = record_misfit(rec, cls_prob_width=self.num_classes, classes=metadata.classes,
                               attributes=metadata.attributes, holder=holder)
        if misfit:
            raise VlbertsError(misfit, path=path, record=rec.image_id)
        n = rec.num_boxes
        given = {
            "boxes": rec.boxes,
            "features": rec.features.reshape(n, self.feature_dim),  # a 0-box record may arrive as (0, 0)
            "cls_prob": None if rec.cls_prob is None else rec.cls_prob.reshape(n, -1 if n else self.num_classes),
            "obj_id": rec.obj_id,
            "obj_conf": rec.obj_conf,
            "attr_id": rec.attr_id,
            "attr_conf": rec.attr_conf,
        }
        out = {}
        for name, _, dt in self.box_fields():
            with np.errstate(over="ignore"):  # float16 overflow is reported below, by name
                a = np.asarray(given[name]).astype(dt, copy=False)
            if dt == np.float16 and not all_finite(a) and all_finite(np.asarray(given[name])):
                raise VlbertsError(
                    f"{name} values exceed the float16 range (max |x| = {np.abs(given[name]).max():.4g}); "
                    "store as float32",
                    path=path,
                    record=rec.image_id,
                )
            out[name] = a
        return out


class RegionStoreWriter:
    """Write a store atomically: a temp file next to `path` becomes `path` only on a clean close.

        with RegionStoreWriter("feats.h5", feature_dim=2048, dtype="float16",
                               metadata=StoreMetadata(extractor="butd-caffe"), with_objects=True) as w:
            for rec in records:
                w.add(rec)

    The fields a store holds are fixed when it is opened; a record that lacks one of them, or carries
    one the store does not hold, is an error (nothing is dropped or invented silently). `metadata`
    may be replaced until close (an importer fills in the source hash at the end).
    """

    def __init__(
        self,
        path: str | Path,
        feature_dim: int,
        dtype: str = "float32",
        metadata: StoreMetadata | dict[str, Any] | None = None,
        with_cls_prob: int | None = None,
        with_objects: bool = False,
        with_attrs: bool = False,
    ):
        if dtype not in STORE_DTYPES:
            raise VlbertsError(f"unknown store dtype {dtype!r}; valid: {', '.join(STORE_DTYPES)}", path=path)
        if int(feature_dim) < 1:
            raise VlbertsError(f"feature_dim must be >= 1, got {feature_dim}", path=path)
        if with_cls_prob is not None and int(with_cls_prob) < 1:
            raise VlbertsError(f"with_cls_prob must be the number of classes (>= 1), got {with_cls_prob}", path=path)
        self.path = Path(path)
        self.feature_dim = int(feature_dim)
        self.dtype = dtype
        self.metadata = _as_metadata(metadata)
        self.num_classes = None if with_cls_prob is None else int(with_cls_prob)
        self.with_objects = bool(with_objects)
        self.with_attrs = bool(with_attrs)
        self.layout = RecordLayout(self.feature_dim, dtype, self.num_classes, self.with_objects, self.with_attrs)

        self._ids: list[str] = []
        self._index: dict[str, int] = {}
        self._w: list[int] = []
        self._h: list[int] = []
        self._count: list[int] = []
        self._rows = 0  # rows already written to the per-box datasets
        self._buf: dict[str, list[np.ndarray]] = {}
        self._buf_bytes = 0
        self._closed = False

        # Enter atomic_path by hand so that close()/abort() (or the with-block) decide the outcome.
        self._stack = contextlib.ExitStack()
        self._tmp = self._stack.enter_context(atomic_path(self.path))
        try:
            self._f = h5py.File(self._tmp, "w")
            self._ds = self._create_datasets()
        except BaseException as e:
            self._stack.__exit__(type(e), e, e.__traceback__)
            raise

    def _create_datasets(self) -> dict[str, h5py.Dataset]:
        ds = {}
        for name, row, dt in self.layout.box_fields():
            row_bytes = int(np.prod(row, dtype=np.int64)) * np.dtype(dt).itemsize
            ds[name] = self._f.create_dataset(
                name, shape=(0, *row), maxshape=(None, *row), dtype=dt, chunks=(_chunk_rows(row_bytes), *row)
            )
            self._buf[name] = []
        return ds

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, image_id: object) -> bool:
        try:
            return canonical_image_id(image_id) in self._index
        except VlbertsError:
            return False

    def add(self, rec: RegionRecord) -> None:
        """Append one image. Duplicate ids, a wrong feature width or missing/extra fields are errors."""
        if self._closed:
            raise VlbertsError("store writer is already closed", path=self.path, record=rec.image_id)
        if rec.image_id in self._index:
            raise VlbertsError(
                f"duplicate image id {rec.image_id} (first added as image #{self._index[rec.image_id]})",
                path=self.path,
                record=rec.image_id,
            )
        for name, a in self.layout.arrays(rec, self.metadata, path=self.path).items():
            self._buf[name].append(a)
            self._buf_bytes += a.nbytes
        self._index[rec.image_id] = len(self._ids)
        self._ids.append(rec.image_id)
        self._w.append(rec.image_w)
        self._h.append(rec.image_h)
        self._count.append(rec.num_boxes)
        if self._buf_bytes >= _FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        if not self._buf_bytes and all(not v for v in self._buf.values()):
            return
        new_rows = None
        for name, parts in self._buf.items():
            block = np.concatenate(parts, axis=0)
            new_rows = block.shape[0]
            ds = self._ds[name]
            ds.resize(self._rows + new_rows, axis=0)
            ds[self._rows : self._rows + new_rows] = block
            parts.clear()
        self._rows += new_rows or 0
        self._buf_bytes = 0

    def _finish(self) -> None:
        self._flush()
        f = self._f
        count = np.asarray(self._count, dtype=np.int32)
        offset = np.zeros(len(count), dtype=np.int64)
        np.cumsum(count[:-1], out=offset[1:])
        f.create_dataset("image_ids", data=np.array(self._ids, dtype=object), dtype=h5py.string_dtype("utf-8"))
        f.create_dataset("image_w", data=np.asarray(self._w, dtype=np.int32))
        f.create_dataset("image_h", data=np.asarray(self._h, dtype=np.int32))
        f.create_dataset("offset", data=offset)
        f.create_dataset("count", data=count)
        from vlberts import __version__

        f.attrs["format"] = STORE_FORMAT
        f.attrs["format_version"] = STORE_FORMAT_VERSION
        f.attrs["feature_dim"] = self.feature_dim
        f.attrs["dtype"] = self.dtype
        f.attrs["metadata"] = json.dumps(self.metadata.to_dict())
        created = {"time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "vlberts": __version__}
        f.attrs["created"] = json.dumps(created)

    def close(self) -> Path:
        """Finish the file and move it to `path`; returns `path`."""
        if self._closed:
            return self.path
        self._closed = True
        try:
            self._finish()
            self._f.close()
        except BaseException as e:
            self._f.close()
            self._stack.__exit__(type(e), e, e.__traceback__)
            raise
        self._stack.close()  # os.replace(tmp, path)
        return self.path

    def abort(self) -> None:
        """Drop everything written so far; `path` is left as it was (absent, or the previous store)."""
        if self._closed:
            return
        self._closed = True
        self._f.close()
        err = RuntimeError("aborted")
        with contextlib.suppress(RuntimeError):
            self._stack.__exit__(RuntimeError, err, None)  # atomic_path removes the temp file

    def __enter__(self) -> RegionStoreWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _close_fd(fd: int, pid: int) -> None:
    if os.getpid() == pid:  # a forked child leaves its parent's descriptor alone
        os.close(fd)


class RawRows:
    """Rows of one per-box dataset read straight from the file, at the byte offsets HDF5 reports for its
    chunks (`os.preadv` into the result), instead of through HDF5's selection machinery: for one image on
    2026-11-29's 2-core machine, ~40 us against ~80 us for its features (36 x 2048 float16) and a few us
    against ~40 us for its boxes; the data loaders read one image per example. The bytes are the ones h5py
    returns (tested). Only for datasets stored as raw rows (`usable`: no filter such as compression, native
    byte order, whole rows in each chunk); the caller reads the others, or a chunk HDF5 has not allocated,
    through h5py (`read` returns None)."""

    def __init__(self, ds: h5py.Dataset, fd: int):
        self.ds, self.fd = ds, fd
        self.row_shape = tuple(ds.shape[1:])
        self.dtype = ds.dtype
        self.row_bytes = ds.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64))
        self.chunk_rows = ds.chunks[0] if ds.chunks is not None else None
        n_chunks = 1 if self.chunk_rows is None else -(-ds.shape[0] // self.chunk_rows)
        self.offsets = np.full(max(n_chunks, 1), -1, dtype=np.int64)  # byte offset per chunk; -1 unknown, -2 none

    @staticmethod
    def usable(ds: h5py.Dataset) -> bool:
        try:
            return (hasattr(os, "preadv") and ds.ndim >= 1 and ds.dtype.kind in "fiub" and ds.dtype.isnative
                    and ds.id.get_create_plist().get_nfilters() == 0
                    and (ds.chunks is None or tuple(ds.chunks[1:]) == tuple(ds.shape[1:])))
        except (AttributeError, TypeError, ValueError, RuntimeError, OSError):  # an h5py without these calls
            return False

    def _chunk_offset(self, c: int) -> int:
        """Byte offset of chunk c in the file (-2: not allocated)."""
        off = int(self.offsets[c])
        if off == -1:
            try:
                if self.chunk_rows is None:
                    got = self.ds.id.get_offset()
                else:
                    info = self.ds.id.get_chunk_info_by_coord((c * self.chunk_rows,) + (0,) * len(self.row_shape))
                    got = info.byte_offset if info.filter_mask == 0 else None
            except (AttributeError, RuntimeError, ValueError, KeyError, OSError):  # a layout it cannot locate
                got = None
            off = self.offsets[c] = -2 if got is None else int(got)
        return off

    def read(self, start: int, n: int) -> np.ndarray | None:
        """Rows start .. start + n (n, *row shape), or None where HDF5 must read them."""
        out = np.empty((n, *self.row_shape), dtype=self.dtype)
        if n == 0:
            return out
        buf = memoryview(out.reshape(-1).view(np.uint8))
        step = self.chunk_rows or self.ds.shape[0]
        row, pos, end = start, 0, start + n
        while row < end:
            c = row // step
            k = min(end, (c + 1) * step) - row  # rows of this chunk
            base = self._chunk_offset(0 if self.chunk_rows is None else c)
            if base < 0:
                return None
            nbytes = k * self.row_bytes
            if os.preadv(self.fd, [buf[pos : pos + nbytes]], base + (row - c * step) * self.row_bytes) != nbytes:
                return None  # cut short: HDF5 reports it
            row, pos = row + k, pos + nbytes
        return out


class RegionStore:
    """Read a store: `len`, `in`, `ids()`, `get(id)`, `get_many(ids)`, `records()`, `info()`.

    `upcast=True` (default) returns float16-stored features and cls_prob as float32; `upcast=False`
    returns them as stored (half the memory in a data loader; the model casts anyway).

    Safe in DataLoader workers: the HDF5 handle is opened lazily and reopened in any process other
    than the one that opened it (h5py handles must not cross a fork), and pickling drops it.
    """

    def __init__(self, path: str | Path, upcast: bool = True):
        self.path = Path(path)
        self.upcast = upcast
        if not self.path.is_file():
            raise VlbertsError("region store not found", path=self.path)
        if not h5py.is_hdf5(self.path):  # a feature file to import, or a shard index, given where a store is read
            hint = ("a shard index: pass it as --shards" if self.path.name.endswith("index.json") else
                    "features in another format become a store with `vlberts features import` (or `vlberts extract` "
                    "from images)")
            raise VlbertsError(f"not a region store (an HDF5 file): {hint}", path=self.path)
        self._file: h5py.File | None = None
        self._pid: int | None = None
        self._ds: dict[str, h5py.Dataset] = {}
        self._fd: int | None = None  # this process's descriptor for `RawRows`
        self._fd_closer: weakref.finalize | None = None
        self._raw: dict[str, RawRows | None] = {}
        f = self._h5()
        attrs = f.attrs
        if attrs.get("format") != STORE_FORMAT:
            self.close()
            raise VlbertsError(f"not a {STORE_FORMAT} (HDF5 file without format={STORE_FORMAT!r})", path=self.path)
        raw_version = attrs.get("format_version", -1)
        try:
            version = int(raw_version)
        except (TypeError, ValueError):
            self.close()
            raise VlbertsError(f"damaged store: attribute 'format_version' is {raw_version!r}, not a whole number",
                               path=self.path) from None
        if version > STORE_FORMAT_VERSION:
            self.close()
            raise VlbertsError(
                f"store format version {version} is newer than this vlberts reads ({STORE_FORMAT_VERSION}); upgrade vlberts",
                path=self.path,
            )
        self.format_version = version
        try:
            self._read_header(f)
        except VlbertsError:
            self.close()
            raise
        problem = self._index_problem(f)
        if problem:
            self.close()
            raise VlbertsError(f"damaged store: {problem}", path=self.path)
        self._index = {image_id: i for i, image_id in enumerate(self._ids)}
        self._coco_rows: dict[str, int] | None = None  # COCO id -> row of its file stem (`_find`), when first needed
        self._coco_warned = False
        self._cache: dict[str, RegionRecord] | None = None

    def _read_header(self, f: h5py.File) -> None:
        """The store's attributes and its per-image index (held in memory: 20 bytes + one id per image), each
        checked as it is read, so a damaged file is named with the attribute or dataset at fault."""
        def damaged(what: str) -> VlbertsError:
            return VlbertsError(f"damaged store: {what}", path=self.path)

        attrs = f.attrs
        for name in ("feature_dim", "dtype", "metadata"):
            if name not in attrs:
                raise damaged(f"missing attribute '{name}'")
        try:
            self.feature_dim = int(attrs["feature_dim"])
        except (TypeError, ValueError):
            raise damaged(f"attribute 'feature_dim' is {attrs['feature_dim']!r}, not a whole number") from None
        self.dtype = str(attrs["dtype"])
        json_attrs = {}
        for name in ("metadata", "created"):
            try:
                json_attrs[name] = json.loads(attrs.get(name, "{}"))
            except (TypeError, ValueError) as e:
                raise damaged(f"attribute '{name}' is not JSON ({e})") from None
            if not isinstance(json_attrs[name], dict):
                raise damaged(f"attribute '{name}' is a JSON {type(json_attrs[name]).__name__}, not an object")
        self.metadata = StoreMetadata.from_dict(json_attrs["metadata"], path=self.path)
        self.created = json_attrs["created"]
        self.fields = [name for name in ("boxes", "features", *OPTIONAL_FIELDS) if name in f]
        for name in ("image_ids", "image_w", "image_h", "offset", "count"):
            if name not in f:
                raise damaged(f"missing dataset '{name}'")
        if h5py.check_string_dtype(f["image_ids"].dtype) is None:
            raise damaged(f"dataset 'image_ids' holds {f['image_ids'].dtype}, not strings")
        self._ids: list[str] = f["image_ids"].asstr()[()].tolist()
        self._w = f["image_w"][()]
        self._h = f["image_h"][()]
        self._offset = f["offset"][()]
        self._count = f["count"][()]

    def _index_problem(self, f: h5py.File) -> str | None:
        """What is wrong with the per-image index, or None: every image's rows must be the next `count` rows
        of the per-box arrays (as the writer lays them out), so no image can read another's regions."""
        for name in ("boxes", "features"):
            if name not in f:
                return f"missing dataset '{name}'"
        if f["boxes"].ndim != 2 or f["boxes"].shape[1] != 4:
            return f"dataset 'boxes' has shape {f['boxes'].shape}, not (rows, 4)"
        if f["features"].ndim != 2 or f["features"].shape[1] != self.feature_dim:
            return (f"dataset 'features' has shape {f['features'].shape}, not (rows, {self.feature_dim}) as the "
                    f"attribute feature_dim says")
        n = len(self._ids)
        if any(len(a) != n for a in (self._w, self._h, self._offset, self._count)):
            return f"the index arrays (image_w, image_h, offset, count) do not all have {n} entries, one per image id"
        rows = len(f["boxes"])
        if len(f["features"]) != rows or any(len(f[name]) != rows for name in self.fields):
            return "the per-box arrays do not all have the same number of rows"
        problem = self._layout_problem(np.asarray(self._offset, dtype=np.int64),
                                       np.asarray(self._count, dtype=np.int64), rows)
        if problem:
            return problem
        if len(set(self._ids)) != n:
            dup = next(i for i, c in Counter(self._ids).items() if c > 1)
            return f"image id {dup} appears more than once"
        return None

    def _layout_problem(self, offset: np.ndarray, count: np.ndarray, rows: int) -> str | None:
        """The image whose rows break the layout (image i's rows end where image i + 1's begin, the first
        begins at row 0, the last ends at the last row), or None. The image named is the damaged one: a wrong
        count breaks only its own image's end, a wrong offset breaks the ends of the image before it and of
        its own, which the counts around it then bridge."""
        n = len(count)
        if not n:
            return None
        ids = self._ids
        if (count < 0).any():
            i = int(np.flatnonzero(count < 0)[0])
            return f"image {ids[i]}: negative count {int(count[i])}"
        if offset[0] != 0:
            return f"image {ids[0]}: offset {int(offset[0])}, but the first image starts at row 0"
        end = offset + count  # (I,) one past each image's last row
        start_next = np.append(offset[1:], rows)  # (I,) where the next image starts; the last ends at `rows`
        bad = np.flatnonzero(end != start_next)
        if not bad.size:
            return None
        i = int(bad[0])
        if i + 1 < n and end[i] + count[i + 1] == start_next[i + 1]:  # image i + 1's offset is the wrong one
            return (f"image {ids[i + 1]}: offset {int(offset[i + 1])}, but image {ids[i]} before it ends at row "
                    f"{int(end[i])}")
        if i + 1 < n:
            return (f"image {ids[i]}: offset {int(offset[i])} and count {int(count[i])} end at row {int(end[i])}, "
                    f"but image {ids[i + 1]} after it starts at row {int(offset[i + 1])}")
        return (f"image {ids[i]}: offset {int(offset[i])} and count {int(count[i])} end at row {int(end[i])}, "
                f"but the per-box arrays hold {rows} rows (the counts add up to {int(count.sum())})")

    def preload(self) -> RegionStore:
        """Read every record into memory once (block reads), so `get` no longer touches the file.

        Worth it for stores that fit in memory and are read many times (the world's: ~30 MB for 5,000
        images); a per-image HDF5 read costs ~0.3 ms, a dict lookup nothing. Returns self."""
        self._cache = {rec.image_id: rec for rec in self.records()}
        return self

    def _h5(self) -> h5py.File:
        """The HDF5 handle of this process (opened on first use, reopened after a fork)."""
        if self._file is None or self._pid != os.getpid():
            try:
                # Default HDF5 locking (not locking=False): a second open of the same file in this
                # process with other flags would fail. Where locks fail (some NFS/Lustre mounts), set
                # HDF5_USE_FILE_LOCKING=FALSE; stores are never modified in place, so that is safe.
                self._file = h5py.File(self.path, "r")
            except OSError as e:
                raise VlbertsError(f"cannot open as HDF5 ({e})", path=self.path) from None
            self._pid = os.getpid()
            self._ds, self._raw, self._fd, self._fd_closer = {}, {}, None, None  # a forked child's are the parent's
        return self._file

    def _dataset(self, name: str) -> h5py.Dataset:
        f = self._h5()
        if name not in self._ds:
            self._ds[name] = f[name]
        return self._ds[name]

    def _rows(self, name: str, start: int, n: int) -> np.ndarray:
        """Rows start .. start + n of a per-box dataset: straight from the file where it stores raw rows
        (`RawRows`), else through h5py."""
        self._h5()
        if name not in self._raw:
            ds = self._dataset(name)
            if RawRows.usable(ds):
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                    # closed with the store, or when it is garbage collected unclosed (as h5py's handle is)
                    self._fd_closer = weakref.finalize(self, _close_fd, self._fd, os.getpid())
                self._raw[name] = RawRows(ds, self._fd)
            else:
                self._raw[name] = None
        raw = self._raw[name]
        rows = raw.read(start, n) if raw is not None else None
        return rows if rows is not None else self._dataset(name)[start : start + n]

    def close(self) -> None:
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
            if self._fd_closer is not None:
                self._fd_closer()
        self._file, self._pid, self._ds, self._raw, self._fd, self._fd_closer = None, None, {}, {}, None, None

    def __enter__(self) -> RegionStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(_file=None, _pid=None, _ds={}, _raw={}, _fd=None, _fd_closer=None)  # a spawned worker opens its own
        return state

    def __len__(self) -> int:
        return len(self._ids)

    def __contains__(self, image_id: object) -> bool:
        return self._find(image_id) is not None

    def ids(self) -> list[str]:
        """All image ids, in the order they were written."""
        return list(self._ids)

    def stored_id(self, image_id: object) -> str | None:
        """The id the store holds an image under (`_find`: a COCO image by either of its names), or None."""
        row = self._find(image_id)
        return None if row is None else self._ids[row]

    def _find(self, image_id: object) -> int | None:
        """The row of an image id, or None. A COCO image is found under either of its names: its COCO id (42:
        VQA's, COCO's and Pythia's files, BUTD's TSVs) and its file stem (COCO_val2014_000000000042: LXMERT's
        TSVs and question files), whichever the store was written with."""
        try:
            key = canonical_image_id(image_id)
        except VlbertsError:
            return None
        row = self._index.get(key)
        if row is not None:
            if key.isdigit() and self._coco_stems().get(key, row) != row:
                # Two images under one number: a COCO file stem and a plain id (a store of LXMERT's COCO and
                # Visual Genome TSVs). Which one a number means depends on who asks (VQA's files: COCO's;
                # GQA's: Visual Genome's), so neither is returned.
                raise VlbertsError(f"image id {key} is ambiguous in this store: it holds {key} and "
                                   f"{self._ids[self._coco_stems()[key]]} (a number names a COCO image or another data "
                                   "set's, e.g. Visual Genome's); name COCO images by file stem (LXMERT's question "
                                   "lists) or read a store of one data set", path=self.path, record=f"image {key}")
            return row
        number = key if key.isdigit() else coco_number(key)
        if number is None:
            return None
        if (row := self._index.get(number)) is None:
            row = self._coco_stems().get(number)
        if row is not None:
            self._warn_coco_match(key, self._ids[row])
        return row

    def _coco_stems(self) -> dict[str, int]:
        """COCO id -> row of the store's images written under a COCO file stem (built once)."""
        if self._coco_rows is None:
            self._coco_rows = {}
            for i, stored in enumerate(self._ids):
                if (n := coco_number(stored)) is not None:
                    self._coco_rows.setdefault(n, i)
        return self._coco_rows

    def _warn_coco_match(self, asked: str, stored: str) -> None:
        """One warning line (per store, in the process that reads the data first) when an id is found under
        its other COCO name: a number does not say which data set's image it is (COCO's ids and Visual
        Genome's overlap), so a store of other images under those numbers would be read as the COCO ones."""
        if self._coco_warned:
            return
        self._coco_warned = True
        from torch.utils.data import get_worker_info

        if get_worker_info() is None and os.environ.get("RANK", "0") == "0":
            print(f"warning: {self.path}: image {asked} found as {stored} (COCO's two names for one image: its id and "
                  f"its file stem); this store must hold COCO images under those numbers", file=sys.stderr)

    def _row(self, image_id: str | int) -> int:
        row = self._find(image_id)
        if row is None:
            raise VlbertsError(f"image id {image_id} not in store", path=self.path, record=image_id)
        return row

    def num_boxes(self, image_id: str | int) -> int:
        """Number of boxes of one image, without reading its arrays."""
        return int(self._count[self._row(image_id)])

    def image_size(self, image_id: str | int) -> tuple[int, int]:
        """(width, height) of one image, without reading its arrays."""
        i = self._row(image_id)
        return int(self._w[i]), int(self._h[i])

    def _record(self, i: int, arrays: dict[str, np.ndarray]) -> RegionRecord:
        """Image i's record from its rows; a record the checks refuse (NaN features, reversed boxes, ...) is
        an error naming the store as well as the image."""
        if self.upcast:
            for name in ("features", "cls_prob"):
                if name in arrays and arrays[name].dtype == np.float16:
                    arrays[name] = as_float32(arrays[name])
        try:
            return RegionRecord(image_id=self._ids[i], image_w=int(self._w[i]), image_h=int(self._h[i]), **arrays)
        except VlbertsError as e:
            raise VlbertsError(e.message, path=self.path, record=f"image {self._ids[i]}") from None

    def _read(self, i: int, start: int, n: int) -> RegionRecord:
        return self._record(i, {name: self._rows(name, start, n) for name in self.fields})

    def get(self, image_id: str | int) -> RegionRecord:
        """The record of one image; a missing id is a `VlbertsError` naming the store and the id."""
        i = self._row(image_id)
        if self._cache is not None:
            return self._cache[self._ids[i]]
        return self._read(i, int(self._offset[i]), int(self._count[i]))

    def get_many(self, image_ids: Iterable[str | int]) -> list[RegionRecord]:
        return [self.get(image_id) for image_id in image_ids]

    @property
    def layout(self) -> RecordLayout:
        """The per-box fields this store holds, as its writer laid them out."""
        num_classes = int(self._dataset("cls_prob").shape[1]) if "cls_prob" in self.fields else None
        return RecordLayout(self.feature_dim, self.dtype, num_classes, "obj_id" in self.fields, "attr_id" in self.fields)

    def box_column(self, name: str) -> np.ndarray:
        """One per-box dataset read whole, in row order (obj_id, attr_id: 8 bytes a box)."""
        return self._dataset(name)[()]

    def vocabulary_ids(self, ids: str) -> np.ndarray:
        """Every box's `ids` (obj_id or attr_id; (boxes,), row order), checked to lie inside the store's own
        vocabulary of them (metadata `classes` or `attributes`) where it names one; else a one-line error
        naming the store and the first image whose regions reach past it (a record written elsewhere, or
        metadata cut short)."""
        column = self.box_column(ids)
        vocab = {"obj_id": self.metadata.classes, "attr_id": self.metadata.attributes}[ids]
        misfit = None if vocab is None else labels_misfit({ids: column}, {ids: len(vocab)})
        if misfit is not None:
            raise VlbertsError(misfit[0], path=self.path, record=f"image {self.image_at_row(misfit[1])}")
        return column

    def image_at_row(self, row: int) -> str:
        """The id of the image whose regions hold per-box row `row` (images with no boxes never do)."""
        return self._ids[int(np.searchsorted(self._offset, row, side="right")) - 1]

    def records(self, block_rows: int = 8192) -> Iterator[RegionRecord]:
        """Every record in write order, reading `block_rows` box rows per HDF5 read (for exports)."""
        n_img = len(self._ids)
        i = 0
        while i < n_img:
            j, rows = i, 0
            while j < n_img and (rows == 0 or rows + self._count[j] <= block_rows):
                rows += int(self._count[j])
                j += 1
            start = int(self._offset[i])
            block = {name: self._dataset(name)[start : start + rows] for name in self.fields}
            for k in range(i, j):
                s, n = int(self._offset[k]) - start, int(self._count[k])
                yield self._record(k, {name: a[s : s + n] for name, a in block.items()})
            i = j

    def info(self) -> dict[str, Any]:
        """A JSON-ready summary: counts, boxes per image, width, dtype, fields, extractor metadata.

        Vocabularies are summarised as their sizes (the full lists are in `.metadata`).
        """
        counts = np.asarray(self._count, dtype=np.int64)
        meta = self.metadata.to_dict()
        classes, attributes = meta.pop("classes"), meta.pop("attributes")
        return {
            "path": str(self.path),
            "format": f"{STORE_FORMAT} v{self.format_version}",
            "num_images": len(self),
            "num_boxes": int(counts.sum()),
            "boxes_per_image": {
                "min": int(counts.min()) if counts.size else 0,
                "mean": round(float(counts.mean()), 3) if counts.size else 0.0,
                "max": int(counts.max()) if counts.size else 0,
            },
            "feature_dim": self.feature_dim,
            "dtype": self.dtype,
            "fields": self.fields,
            "num_classes_cls_prob": int(self._dataset("cls_prob").shape[1]) if "cls_prob" in self.fields else None,
            "classes_vocab_size": None if classes is None else len(classes),
            "attributes_vocab_size": None if attributes is None else len(attributes),
            "metadata": meta,
            "created": self.created,
        }


def write_store_records(
    path: str | Path,
    records: Iterable[RegionRecord],
    dtype: str = "float32",
    metadata: StoreMetadata | dict[str, Any] | None = None,
) -> Path:
    """Write records into a new store, taking feature width and fields from the first record.

    Convenient for in-memory producers (the world detector, tests); an empty iterable is an error
    because the feature width would be unknown.
    """
    it = iter(records)
    first = next(it, None)
    if first is None:
        raise VlbertsError("no records to write", path=path)
    if first.num_boxes == 0 and first.feature_dim == 0:
        raise VlbertsError("the first record has no boxes, so the feature width is unknown", path=path, record=first.image_id)
    with RegionStoreWriter(
        path,
        feature_dim=first.feature_dim,
        dtype=dtype,
        metadata=metadata,
        with_cls_prob=None if first.cls_prob is None else first.cls_prob.shape[1],
        with_objects=first.has_objects,
        with_attrs=first.has_attrs,
    ) as w:
        w.add(first)
        for rec in it:
            w.add(rec)
    return Path(path)
