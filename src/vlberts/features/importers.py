"""Import existing feature files into the canonical store, and export a store back to them.

`import_features` streams: one TSV line is decoded and appended at a time, so a 20 GB COCO TSV needs
the memory of one image plus the writer's 32 MB buffer. The store is written atomically: a bad line
anywhere (even the last, truncated one) leaves no output file behind, and an existing store under
the same name stays as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlberts.errors import VlbertsError
from vlberts.features.record import StoreMetadata
from vlberts.features.store import RegionStore, RegionStoreWriter
from vlberts.features.tsv import TSV_FORMATS, get_format, iter_tsv_lines, parse_tsv_line, write_tsv

IMPORT_FORMATS = tuple(TSV_FORMATS)  # ("butd-tsv", "lxmert-tsv")


def read_vocab(path: str | Path) -> list[str]:
    """A vocabulary file (objects_vocab.txt, attributes_vocab.txt): one entry per line, synonyms
    ("gray,grey") kept as written. Line i is class/attribute id i (LXMERT's 0-based ids)."""
    path = Path(path)
    if not path.is_file():
        raise VlbertsError("vocabulary file not found", path=path)
    names = path.read_text(encoding="utf-8").splitlines()
    while names and not names[-1].strip():
        names.pop()
    if not names:
        raise VlbertsError("vocabulary file is empty", path=path)
    return names


def import_features(
    src: str | Path,
    format: str,
    out: str | Path,
    dtype: str = "float32",
    *,
    metadata: StoreMetadata | dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
) -> Path:
    """Stream a BUTD ("butd-tsv") or LXMERT ("lxmert-tsv") TSV into a new store at `out`.

    `metadata` describes the extractor when the user knows it; the importer adds `source`
    (format, absolute file path, bytes, sha256 of the file, lines). `progress` is called with the
    number of bytes consumed after each line. Every bad line raises `VlbertsError(path=src,
    record="line L (image ID)")`; a duplicate id names the line it first appeared on.
    """
    fmt = get_format(format)
    src, out = Path(src), Path(out)
    if out.exists() and not overwrite:
        raise VlbertsError("already exists (pass --overwrite to replace it)", path=out)
    meta = metadata if isinstance(metadata, StoreMetadata) else StoreMetadata.from_dict(metadata or {})
    sha = hashlib.sha256()
    n_bytes = 0
    first_line: dict[str, int] = {}
    lineno = 0
    with contextlib.ExitStack() as stack:
        writer: RegionStoreWriter | None = None
        for lineno, line in iter_tsv_lines(src):
            sha.update(line)
            n_bytes += len(line)
            rec = parse_tsv_line(fmt, line, path=src, lineno=lineno)
            if rec is not None:
                where = f"line {lineno} (image {rec.image_id})"
                if rec.image_id in first_line:
                    raise VlbertsError(
                        f"duplicate image id {rec.image_id} (first on line {first_line[rec.image_id]})",
                        path=src,
                        record=where,
                    )
                first_line[rec.image_id] = lineno
                if writer is None:
                    if rec.num_boxes == 0:
                        raise VlbertsError("the first image has no boxes, so the feature width is unknown", path=src, record=where)
                    writer = stack.enter_context(
                        RegionStoreWriter(
                            out,
                            feature_dim=rec.feature_dim,
                            dtype=dtype,
                            metadata=meta,
                            with_objects=rec.has_objects,
                            with_attrs=rec.has_attrs,
                        )
                    )
                try:
                    writer.add(rec)
                except VlbertsError as e:
                    hint = " (truncated line?)" if "feature width" in e.message else ""
                    raise VlbertsError(e.message + hint, path=src, record=where) from None
            if progress is not None:
                progress(len(line))
        if writer is None:
            raise VlbertsError(f"no records in this {format} file", path=src)
        source = {"format": format, "file": str(src.resolve()), "bytes": n_bytes, "sha256": sha.hexdigest(), "lines": lineno}
        writer.metadata = dataclasses.replace(meta, source=source)
    return out


def export_tsv(
    store: RegionStore | str | Path, path: str | Path, format: str, zero_missing_attrs: bool = False
) -> int:
    """Write a store (or a store path) as a BUTD or LXMERT TSV, atomically; returns the lines written.

    BUTD needs integer image ids; LXMERT needs objects (and attributes, unless `zero_missing_attrs`).
    """
    get_format(format)
    if isinstance(store, RegionStore):
        return write_tsv(path, store.records(), format, zero_missing_attrs)
    with RegionStore(store) as s:
        return write_tsv(path, s.records(), format, zero_missing_attrs)
