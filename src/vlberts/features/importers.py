"""Import existing feature files into the canonical store, and export a store back to them.

Formats (SPEC §2; formats-and-metrics.md §1): the BUTD 6-field and LXMERT 10-field TSVs (`tsv.py`), and
the files the other original code bases wrote (`foreign.py`): VL-BERT's per-image JSON (a directory or
a zip), ViLBERT's LMDBs (its fine-tuning features, and its Conceptual Captions pre-training data with
the captions), BAN's HDF5 (with its `imgid2idx.pkl`), VisualBERT's Detectron `.th` (or `.npz`
directory, with the images for their sizes).

`import_features` streams: one record is decoded and appended at a time, so a 20 GB COCO TSV needs the
memory of one image plus the writer's 32 MB buffer. Several files of one format go into one store, file
after file (LXMERT's `train2014_obj36.tsv` and `val2014_obj36.tsv` for training on train + nominival; its
`vg_gqa_obj36.tsv` beside them for pre-training), an image id in two of them being an error naming both.
The store is written atomically: a bad record anywhere (even the last, truncated one) leaves no output
file behind, and an existing store under the same name stays as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import pickle
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from vlberts.errors import first_line, VlbertsError
from vlberts.features.foreign import (
    read_ban_h5, read_mmf_npy, read_vilbert_cc_lmdb, read_vilbert_lmdb, read_visualbert_th, read_vlbert_json,
)
from vlberts.features.record import RegionRecord, StoreMetadata
from vlberts.features.store import RecordLayout, RegionStore, RegionStoreWriter
from vlberts.features.tsv import TSV_FORMATS, get_format, iter_tsv_lines, parse_tsv_line, write_tsv
from vlberts.io import atomic_open, read_text

FOREIGN_FORMATS = ("vlbert-json", "vilbert-lmdb", "vilbert-cc-lmdb", "ban-h5", "visualbert-th", "mmf-npy")
DIRECTORY_FORMATS = ("vlbert-json", "vilbert-lmdb", "vilbert-cc-lmdb", "visualbert-th", "mmf-npy")  # may read a directory; the others a file
IMPORT_FORMATS = (*TSV_FORMATS, *FOREIGN_FORMATS)  # butd-tsv, lxmert-tsv, then the others
CAPTION_FORMATS = ("vilbert-cc-lmdb",)  # formats whose records also hold a caption (`captions_out`)


def read_vocab(path: str | Path) -> list[str]:
    """A vocabulary file (objects_vocab.txt, attributes_vocab.txt): one entry per line, synonyms
    ("gray,grey") kept as written. Line i is class/attribute id i (LXMERT's 0-based ids)."""
    names = read_text(path).splitlines()
    while names and not names[-1].strip():
        names.pop()
    if not names:
        raise VlbertsError("vocabulary file is empty", path=path)
    return names


def _tsv_records(src: Path, format: str) -> Iterator[tuple[str, bytes, RegionRecord | None]]:
    fmt = get_format(format)
    if zipfile.is_zipfile(src):  # LXMERT distributes its TSVs zipped (train2014_obj36.zip)
        raise VlbertsError(f"is a zip archive, not a TSV: unzip it and import the .tsv inside (--format {format})",
                           path=src)
    for lineno, line in iter_tsv_lines(src):
        yield f"line {lineno}", line, parse_tsv_line(fmt, line, path=src, lineno=lineno)


def ban_ids_beside(src: str | Path) -> Path:
    """The image-id index BAN's converter writes beside each `{split}.hdf5`: `{split}_imgid2idx.pkl` (what
    ban-h5 reads when --ids is not given, so that several splits import with their own indices)."""
    path = Path(src).with_name(f"{Path(src).stem}_imgid2idx.pkl")
    if not path.is_file():
        raise VlbertsError(f"ban-h5 reads each file's image ids from the {path.name} beside it (BAN's converter writes "
                           "one per split), which is not there: pass it as --ids", path=src)
    return path


def read_records(src: Path, format: str, ids: str | Path | None = None, images: str | Path | None = None,
                 captions: CaptionSpool | None = None) -> Iterator[tuple[str, bytes, RegionRecord | None]]:
    """(where, raw bytes, record or None for a blank line) of a feature file in any `IMPORT_FORMATS`;
    `captions` collects the (image id, caption) pairs of a format that holds them (vilbert-cc-lmdb)."""
    if format in IMPORT_FORMATS and format not in DIRECTORY_FORMATS and Path(src).is_dir():
        raise VlbertsError(f"is a directory, not a file (--format {format} reads one file)", path=src)
    if format in TSV_FORMATS:
        return _tsv_records(src, format)
    if format == "vlbert-json":
        return read_vlbert_json(src)
    if format == "vilbert-lmdb":
        return read_vilbert_lmdb(src)
    if format == "vilbert-cc-lmdb":
        return read_vilbert_cc_lmdb(src, captions)
    if format == "ban-h5":
        return read_ban_h5(src, ids if ids is not None else ban_ids_beside(src))
    if format == "visualbert-th":
        if images is None:
            raise VlbertsError("visualbert-th needs --images, the directory of the images (their sizes are not in the file)")
        return read_visualbert_th(src, images)
    if format == "mmf-npy":
        return read_mmf_npy(src)
    raise VlbertsError(f"unknown feature format {format!r}; valid: {', '.join(IMPORT_FORMATS)}")


# What a damaged foreign file can raise while it is decoded (a bad zip member, a truncated .npz, bytes that are
# not UTF-8, a ragged list, a tensor numpy cannot take, ...): every one of them is the file's fault.
_DECODE_ERRORS = (ValueError, TypeError, IndexError, KeyError, AttributeError, OSError, EOFError, RuntimeError,
                  OverflowError, zlib.error, zipfile.BadZipFile, pickle.UnpicklingError)


def _guarded(records: Iterator[tuple[str, bytes, RegionRecord | None]], src: Path, format: str
             ) -> Iterator[tuple[str, bytes, RegionRecord | None]]:
    """The records of a feature file, with any decoding failure turned into a one-line `VlbertsError`
    naming the file and the last record read (the readers name the record themselves where they can)."""
    at: str | None = None
    it = iter(records)
    while True:
        try:
            item = next(it)
        except StopIteration:
            return
        except VlbertsError as e:
            raise VlbertsError(e.message, path=e.path or src,
                               record=e.record or (f"after {at}" if at else None)) from None  # none read: the file's fault
        except _DECODE_ERRORS as e:
            raise VlbertsError(f"cannot read this {format} file: {type(e).__name__}: {first_line(e)}", path=src,
                               record=f"after {at}" if at else "the first record") from None
        at = item[0]
        yield item


def import_features(
    src: str | Path | Sequence[str | Path],
    format: str,
    out: str | Path,
    dtype: str = "float32",
    *,
    metadata: StoreMetadata | dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    ids: str | Path | None = None,
    images: str | Path | None = None,
    captions_out: str | Path | None = None,
    shards: bool = False,
    shard_size: int = 1000,
    prefix: str = "shard",
) -> Path:
    """Stream a feature file in one of `IMPORT_FORMATS` (or several, `src` a sequence: one after the other) into
    a new store at `out` (`ids`: BAN's imgid2idx pickle; `images`: the image directory visualbert-th reads the
    image sizes from; `captions_out`: vilbert-cc-lmdb only, where to write its records' captions as an
    official COCO captions file, for `vlberts pretrain --captions`, once the store is complete). Returns `out`.

    With `shards`, `out` is a directory, and the records go straight into a shard set there
    (`data.shards.ShardSetWriter`: `shard_size` samples a shard, `<prefix>-index.json`, whose path is
    returned), with no store in between, for a corpus too large to keep twice: a format whose records hold
    a caption (vilbert-cc-lmdb) gives "image-text" samples, the others "image" samples; a bad record stops
    the import with the shard in progress removed and no index written.

    `metadata` describes the extractor when the user knows it; the importer adds `source`
    (format, absolute path, bytes read, sha256 of them, and the lines of a TSV or the records of the
    others; for several files, the format and `files`, a list of those per file). `progress` is called with
    the number of bytes consumed after each record. Every bad record raises `VlbertsError(path=src,
    record="line L (image ID)")` (or "file F", "key K", ...); a duplicate id names where it first appeared
    (and in which file, when that is another).
    """
    sources = [Path(src)] if isinstance(src, (str, Path)) else [Path(s) for s in src]
    if not sources:
        raise VlbertsError("no feature file to import")
    out = Path(out)
    if format not in IMPORT_FORMATS:
        raise VlbertsError(f"unknown feature format {format!r}; valid: {', '.join(IMPORT_FORMATS)}")
    if ids is not None and len(sources) > 1:
        raise VlbertsError(f"--ids is one file's image index, and {len(sources)} files are imported: leave it out, and "
                           "each .hdf5 is read with the {split}_imgid2idx.pkl beside it")
    meta = metadata if isinstance(metadata, StoreMetadata) else StoreMetadata.from_dict(metadata or {})
    if shards:
        return _import_to_shards(sources, format, out, dtype, meta, overwrite, progress, ids, images, captions_out,
                                 shard_size, prefix)
    if out.exists() and not overwrite:
        raise VlbertsError("already exists (pass --overwrite to replace it)", path=out)
    if captions_out is not None and format not in CAPTION_FORMATS:
        raise VlbertsError(f"{format} files hold no captions (--captions reads {', '.join(CAPTION_FORMATS)})")
    if captions_out is not None and Path(captions_out).exists() and not overwrite:
        raise VlbertsError("already exists (pass --overwrite to replace it)", path=captions_out)
    captions = CaptionSpool(Path(captions_out).resolve().parent) if captions_out is not None else None
    with contextlib.closing(captions) if captions is not None else contextlib.nullcontext():
        def open_writer(layout: RecordLayout) -> RegionStoreWriter:
            return RegionStoreWriter(out, feature_dim=layout.feature_dim, dtype=dtype, metadata=meta,
                                     with_objects=layout.with_objects, with_attrs=layout.with_attrs,
                                     with_cls_prob=layout.num_classes)

        _import_records(sources, format, dtype, meta, progress, ids, images, captions, open_writer,
                        lambda writer, rec: writer.add(rec))
        if captions is not None:  # once the store is complete
            captions.write(Path(captions_out), f"captions of {', '.join(s.name for s in sources)}")
    return out


def _import_to_shards(sources: list[Path], format: str, out_dir: Path, dtype: str, meta: StoreMetadata, overwrite: bool,
                      progress: Callable[[int], None] | None, ids: str | Path | None, images: str | Path | None,
                      captions_out: str | Path | None, shard_size: int, prefix: str) -> Path:
    """`import_features(shards=True)`: each record, with its caption where the format holds one, into a
    `ShardSetWriter`; returns the index json."""
    from vlberts.data.shards import ShardSetWriter

    if captions_out is not None:
        raise VlbertsError("--captions writes the captions beside a store (--out); with --shards they go into the shards")
    pending: list[tuple[str | int, str]] = []  # the record just read's (image id, caption), where it has one

    def open_writer(layout: RecordLayout) -> ShardSetWriter:
        return ShardSetWriter(out_dir, layout, meta, shard_size=shard_size, prefix=prefix, overwrite=overwrite)

    def add(writer: ShardSetWriter, rec: RegionRecord) -> None:
        captions = [caption for _, caption in pending]
        pending.clear()
        writer.add(rec, captions)

    _import_records(sources, format, dtype, meta, progress, ids, images, pending, open_writer, add)
    return out_dir / f"{prefix}-index.json"


def _import_records(sources: list[Path], format: str, dtype: str, meta: StoreMetadata, progress: Callable[[int], None] | None,
                    ids: str | Path | None, images: str | Path | None, captions: Any,
                    open_writer: Callable[[RecordLayout], Any], add: Callable[[Any, RegionRecord], None]) -> None:
    """The streaming loop of `import_features` (into a store or a shard set): every record of each file of
    `sources` in turn, checked (duplicate ids, within a file and across files; the first image must have
    boxes, which fix the feature width), into the writer `open_writer` makes from the first record's layout
    (a `RegionStoreWriter`, a `ShardSetWriter`: entered as a context, its `metadata` given the source at the
    end) by `add(writer, record)`."""
    first_seen: dict[str, tuple[Path, str]] = {}
    files = []  # per file: what `source` records of it
    with contextlib.ExitStack() as stack:
        writer: Any = None
        for src in sources:
            sha = hashlib.sha256()
            n_bytes = n_items = n_records = 0
            for at, raw, rec in _guarded(read_records(src, format, ids, images, captions), src, format):
                sha.update(raw)
                n_bytes += len(raw)
                n_items += 1
                if rec is not None:
                    n_records += 1
                    where = f"{at} (image {rec.image_id})"
                    if rec.image_id in first_seen:
                        path, first = first_seen[rec.image_id]
                        raise VlbertsError(f"duplicate image id {rec.image_id} (first on {first}"
                                           + ("" if path == src else f" of {path}") + ")", path=src, record=where)
                    first_seen[rec.image_id] = (src, at)
                    if writer is None:
                        if rec.num_boxes == 0:
                            raise VlbertsError("the first image has no boxes, so the feature width is unknown", path=src,
                                               record=where)
                        writer = stack.enter_context(open_writer(RecordLayout.of(rec, dtype)))
                    try:
                        add(writer, rec)
                    except VlbertsError as e:
                        hint = " (truncated line?)" if "feature width" in e.message and format in TSV_FORMATS else ""
                        raise VlbertsError(e.message + hint, path=src, record=where) from None
                if progress is not None:
                    progress(len(raw))
            if not n_records:
                raise VlbertsError(f"no records in this {format} file", path=src)
            count = {"lines": n_items} if format in TSV_FORMATS else {"records": n_items}
            files.append({"file": str(src.resolve()), "bytes": n_bytes, "sha256": sha.hexdigest(), **count})
        source = {"format": format, **files[0]} if len(files) == 1 else {"format": format, "files": files}
        writer.metadata = dataclasses.replace(meta, source=source)


class CaptionSpool:
    """The (image id, caption) pairs of an import, spooled to an unnamed temporary file as they are read and
    written out at the end as an official COCO captions file (formats §2.1: one image per id, in the pairs'
    order, no file names since the features stand for the images; annotation ids 0, 1, ...), so that the
    captions of millions of images take no memory. The importer refuses duplicate image ids, so each pair
    is its own image."""

    def __init__(self, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)  # where the captions file goes, as `atomic_open` would
        self._file = tempfile.TemporaryFile("w+", encoding="utf-8", dir=directory)

    def append(self, pair: tuple[str | int, str]) -> None:
        self._file.write(json.dumps(list(pair)) + "\n")

    def _pairs(self) -> Iterator[tuple[str | int, str]]:
        self._file.seek(0)
        for line in self._file:
            image_id, caption = json.loads(line)
            yield image_id, caption

    def write(self, path: Path, description: str) -> None:
        with atomic_open(path) as f:
            f.write(f'{{"info": {json.dumps({"description": description})}, "images": [')
            for k, (image_id, _) in enumerate(self._pairs()):
                f.write((", " if k else "") + json.dumps({"id": image_id, "file_name": ""}))
            f.write('], "annotations": [')
            for k, (image_id, caption) in enumerate(self._pairs()):
                f.write((", " if k else "") + json.dumps({"id": k, "image_id": image_id, "caption": caption}))
            f.write("]}\n")

    def close(self) -> None:
        self._file.close()

def export_tsv(
    store: RegionStore | str | Path, path: str | Path, format: str, zero_missing_attrs: bool = False,
    overwrite: bool = False,
) -> int:
    """Write a store (or a store path) as a BUTD or LXMERT TSV, atomically; returns the lines written. An
    existing `path` is replaced only with `overwrite`, and never when it is the store itself.

    BUTD needs integer image ids; LXMERT needs objects (and attributes, unless `zero_missing_attrs`).
    """
    get_format(format)
    store_path = Path(store.path if isinstance(store, RegionStore) else store)
    if Path(path).is_dir():
        raise VlbertsError("is a directory; name the .tsv file to write", path=path)
    if Path(path).exists() and Path(path).resolve() == store_path.resolve():
        raise VlbertsError("is the store being exported; name another file to write", path=path)
    if Path(path).exists() and not overwrite:
        raise VlbertsError("already exists (pass --overwrite to replace it)", path=path)
    if isinstance(store, RegionStore):
        return write_tsv(path, store.records(), format, zero_missing_attrs, source=store_path)
    with RegionStore(store) as s:
        return write_tsv(path, s.records(), format, zero_missing_attrs, source=store_path)
