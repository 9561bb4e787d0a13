"""Readers and writers for the two region-feature TSVs everyone already has (reference §1.1, §1.2).

BUTD (peteanderson80/bottom-up-attention `tools/generate_tsv.py`), 6 fields:

    image_id  image_w  image_h  num_boxes  boxes  features

LXMERT (airsplay/lxmert `src/utils.py`), 10 fields -- note h before w, and a string id:

    img_id  img_h  img_w  objects_id  objects_conf  attrs_id  attrs_conf  num_boxes  boxes  features

Tab-separated, no header, one image per line, arrays as base64 of little-endian raw bytes: boxes
float32 (N, 4) xyxy pixels, features float32 (N, D), objects_id/attrs_id int64 (N,), confs float32 (N,).
The originals write lines with `csv.DictWriter`, so lines end in "\\r\\n"; we write the same. Their
readers need `csv.field_size_limit(sys.maxsize)` because a line holds ~400 kB of base64; we split
lines ourselves (no field is ever quoted in these files), which also gives byte-exact progress and
line numbers for errors.

Ids: a BUTD id is an integer; it becomes its decimal string ("000042" -> "42", as the original
reader's `int()` does). A non-integer BUTD id is kept as written. LXMERT ids stay as written.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlberts.errors import VlbertsError
from vlberts.features.record import RegionRecord
from vlberts.io import atomic_open

BUTD_FIELDS = ("image_id", "image_w", "image_h", "num_boxes", "boxes", "features")
LXMERT_FIELDS = (
    "img_id", "img_h", "img_w", "objects_id", "objects_conf", "attrs_id", "attrs_conf", "num_boxes", "boxes", "features",
)

_F32 = np.dtype("<f4")
_I64 = np.dtype("<i8")
_DIGITS = re.compile(rb"[0-9]+")


def _int_field(raw: bytes, name: str, minimum: int) -> int:
    if not _DIGITS.fullmatch(raw):  # stricter than int(): no sign, spaces or underscores
        shown = raw[:24].decode("utf-8", "replace") + ("..." if len(raw) > 24 else "")
        raise VlbertsError(f"{name} is not an integer: {shown!r}")
    v = int(raw)
    if v < minimum:
        raise VlbertsError(f"{name} must be >= {minimum}, got {v}")
    return v


def _b64_decode(raw: bytes, name: str, dtype: np.dtype) -> np.ndarray:
    """base64 field -> flat native-endian array of `dtype`."""
    try:
        buf = base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as e:
        raise VlbertsError(f"{name} is not valid base64 ({e})") from None
    if len(buf) % dtype.itemsize:
        raise VlbertsError(f"{name} holds {len(buf)} bytes, not a whole number of {dtype.name} values")
    # copy=True: frombuffer over bytes is read-only, and callers may normalise boxes in place.
    return np.frombuffer(buf, dtype=dtype).astype(dtype.newbyteorder("="), copy=True)


def b64_rows(raw: bytes, name: str, dtype: np.dtype, n: int, width: int | None) -> np.ndarray:
    """base64 field -> (n, width); width None means infer it (the feature width D)."""
    a = _b64_decode(raw, name, dtype)
    if width is None:
        if n == 0:
            if a.size:
                raise VlbertsError(f"num_boxes=0 but {name} holds {a.size} values")
            return a.reshape(0, 0)
        if a.size == 0 or a.size % n:
            raise VlbertsError(f"num_boxes={n} but {name} holds {a.size} {dtype.name} values, not a positive multiple of {n}")
        return a.reshape(n, -1)
    if a.size != n * width:
        raise VlbertsError(f"num_boxes={n} but {name} holds {a.size / width:g} boxes ({a.size} {dtype.name} values)")
    return a.reshape(n, width)


def _b64_vector(raw: bytes, name: str, dtype: np.dtype, n: int) -> np.ndarray:
    """base64 field -> (n,)."""
    a = _b64_decode(raw, name, dtype)
    if a.size != n:
        raise VlbertsError(f"num_boxes={n} but {name} holds {a.size} values")
    return a


def _butd_image_id(raw: bytes) -> str:
    text = raw.decode("utf-8")
    return str(int(text)) if _DIGITS.fullmatch(raw) else text


def _parse_butd(parts: list[bytes]) -> RegionRecord:
    image_id = _butd_image_id(parts[0])
    w = _int_field(parts[1], "image_w", 1)
    h = _int_field(parts[2], "image_h", 1)
    n = _int_field(parts[3], "num_boxes", 0)
    boxes = b64_rows(parts[4], "boxes", _F32, n, 4)
    feats = b64_rows(parts[5], "features", _F32, n, None)
    return RegionRecord(image_id=image_id, image_w=w, image_h=h, boxes=boxes, features=feats)


def _parse_lxmert(parts: list[bytes]) -> RegionRecord:
    image_id = parts[0].decode("utf-8")
    h = _int_field(parts[1], "img_h", 1)  # h before w in this format
    w = _int_field(parts[2], "img_w", 1)
    n = _int_field(parts[7], "num_boxes", 0)
    return RegionRecord(
        image_id=image_id,
        image_w=w,
        image_h=h,
        boxes=b64_rows(parts[8], "boxes", _F32, n, 4),
        features=b64_rows(parts[9], "features", _F32, n, None),
        obj_id=_b64_vector(parts[3], "objects_id", _I64, n),
        obj_conf=_b64_vector(parts[4], "objects_conf", _F32, n),
        attr_id=_b64_vector(parts[5], "attrs_id", _I64, n),
        attr_conf=_b64_vector(parts[6], "attrs_conf", _F32, n),
    )


def _b64(a: np.ndarray, dtype: np.dtype) -> bytes:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes())


def _format_butd(rec: RegionRecord, zero_missing_attrs: bool) -> list[bytes]:
    if not _DIGITS.fullmatch(rec.image_id.encode("utf-8")):
        raise VlbertsError("BUTD TSV image ids are integers; write string ids as lxmert-tsv", record=rec.image_id)
    return [
        rec.image_id.encode(), str(rec.image_w).encode(), str(rec.image_h).encode(), str(rec.num_boxes).encode(),
        _b64(rec.boxes, _F32), _b64(rec.features, _F32),
    ]


def _format_lxmert(rec: RegionRecord, zero_missing_attrs: bool) -> list[bytes]:
    if not rec.has_objects:
        raise VlbertsError("LXMERT TSV needs obj_id/obj_conf, which this record lacks", record=rec.image_id)
    attr_id, attr_conf = rec.attr_id, rec.attr_conf
    if attr_id is None:
        if not zero_missing_attrs:
            raise VlbertsError(
                "LXMERT TSV needs attr_id/attr_conf, which this record lacks "
                "(zero_missing_attrs writes zeros, as the detectron2 port does)",
                record=rec.image_id,
            )
        attr_id, attr_conf = np.zeros(rec.num_boxes, np.int64), np.zeros(rec.num_boxes, np.float32)
    return [
        rec.image_id.encode("utf-8"), str(rec.image_h).encode(), str(rec.image_w).encode(),
        _b64(rec.obj_id, _I64), _b64(rec.obj_conf, _F32), _b64(attr_id, _I64), _b64(attr_conf, _F32),
        str(rec.num_boxes).encode(), _b64(rec.boxes, _F32), _b64(rec.features, _F32),
    ]


@dataclass(frozen=True)
class TsvFormat:
    """One TSV flavour: its field names, a parser of split fields, a formatter of a record."""

    name: str
    fields: tuple[str, ...]
    parse: Callable[[list[bytes]], RegionRecord]
    format: Callable[[RegionRecord, bool], list[bytes]]


TSV_FORMATS: dict[str, TsvFormat] = {
    "butd-tsv": TsvFormat("butd-tsv", BUTD_FIELDS, _parse_butd, _format_butd),
    "lxmert-tsv": TsvFormat("lxmert-tsv", LXMERT_FIELDS, _parse_lxmert, _format_lxmert),
}


def get_format(name: str) -> TsvFormat:
    if name not in TSV_FORMATS:
        raise VlbertsError(f"unknown feature format {name!r}; valid: {', '.join(TSV_FORMATS)}")
    return TSV_FORMATS[name]


def iter_tsv_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line bytes including its end) for every line; a missing file is an error."""
    path = Path(path)
    if path.is_dir():
        raise VlbertsError("is a directory, not a file (a TSV file is expected)", path=path)
    if not path.is_file():
        raise VlbertsError("file not found", path=path)
    with open(path, "rb") as f:
        yield from enumerate(f, 1)


def _shown_id(raw: bytes) -> str:
    """The id field as an error names the line: as written when it is printable UTF-8 text (cut at 80
    characters), else (a binary file, a mangled line) its repr cut at 24 characters, so that the one-line
    error stays short and shows no raw bytes."""
    text = raw.decode("utf-8", "replace")
    if text.isprintable() and "\ufffd" not in text:
        return text[:80] + ("..." if len(text) > 80 else "")
    return repr(text[:24]) + ("..." if len(text) > 24 else "")


def parse_tsv_line(fmt: TsvFormat, line: bytes, *, path: str | Path, lineno: int) -> RegionRecord | None:
    """One raw line -> a record (None for a blank line). Errors name the file, the line and the id."""
    line = line.rstrip(b"\r\n")
    if not line.strip():
        return None
    parts = line.split(b"\t")
    image_id = _shown_id(parts[0]) if parts[0] else None
    record = f"line {lineno}" + (f" (image {image_id})" if image_id else "")
    if len(parts) != len(fmt.fields):
        other = [f.name for f in TSV_FORMATS.values() if f is not fmt and len(f.fields) == len(parts)]
        hint = f" (this looks like {other[0]})" if other else " (truncated line?)" if len(parts) < len(fmt.fields) else ""
        raise VlbertsError(
            f"expected {len(fmt.fields)} tab-separated fields ({', '.join(fmt.fields)}) for {fmt.name}, "
            f"got {len(parts)}{hint}",
            path=path,
            record=record,
        )
    try:
        return fmt.parse(parts)
    except VlbertsError as e:
        raise VlbertsError(e.message, path=path, record=record) from None
    except UnicodeDecodeError as e:
        raise VlbertsError(f"image id is not UTF-8 text ({e.reason})", path=path, record=record) from None


def read_tsv(path: str | Path, format: str) -> Iterator[RegionRecord]:
    """Stream the records of a BUTD or LXMERT TSV ("butd-tsv" / "lxmert-tsv"), one line at a time.

    Also checks that every line has the feature width of the first one (a line truncated at a
    base64 boundary can otherwise decode into a narrower but plausible array).
    """
    fmt = get_format(format)
    width: tuple[int, int] | None = None  # (D, line it was first seen on)
    for lineno, line in iter_tsv_lines(path):
        rec = parse_tsv_line(fmt, line, path=path, lineno=lineno)
        if rec is None:
            continue
        if rec.num_boxes:
            if width is None:
                width = (rec.feature_dim, lineno)
            elif rec.feature_dim != width[0]:
                raise VlbertsError(
                    f"features are {rec.feature_dim}-d but line {width[1]} has {width[0]}-d (truncated line?)",
                    path=path,
                    record=f"line {lineno} (image {rec.image_id})",
                )
        yield rec


def read_butd_tsv(path: str | Path) -> Iterator[RegionRecord]:
    return read_tsv(path, "butd-tsv")


def read_lxmert_tsv(path: str | Path) -> Iterator[RegionRecord]:
    return read_tsv(path, "lxmert-tsv")


def format_tsv_line(rec: RegionRecord, format: str, zero_missing_attrs: bool = False) -> bytes:
    """One record as one TSV line (with its "\\r\\n")."""
    return b"\t".join(get_format(format).format(rec, zero_missing_attrs)) + b"\r\n"


def write_tsv(
    path: str | Path, records: Iterable[RegionRecord], format: str, zero_missing_attrs: bool = False,
    source: str | Path | None = None,
) -> int:
    """Write records as a BUTD or LXMERT TSV, atomically; returns the number of lines written.

    Features are written as float32 whatever they were stored as (both formats are float32).
    `zero_missing_attrs` (LXMERT only) writes zero attribute ids/confs for records without attributes.
    A record the format cannot hold is an error naming `source` (where the records come from, e.g. the
    store; default `path`) and the record.
    """
    fmt = get_format(format)
    n = 0
    with atomic_open(path, "wb") as f:
        for rec in records:
            try:
                f.write(b"\t".join(fmt.format(rec, zero_missing_attrs)) + b"\r\n")
            except VlbertsError as e:
                raise VlbertsError(e.message, path=source or path, record=rec.image_id) from None
            n += 1
    return n


def write_butd_tsv(path: str | Path, records: Iterable[RegionRecord]) -> int:
    return write_tsv(path, records, "butd-tsv")


def write_lxmert_tsv(path: str | Path, records: Iterable[RegionRecord], zero_missing_attrs: bool = False) -> int:
    return write_tsv(path, records, "lxmert-tsv", zero_missing_attrs)
