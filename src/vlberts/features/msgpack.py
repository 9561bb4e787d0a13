"""Reading MessagePack, as ViLBERT's Conceptual Captions LMDB holds its records, without the msgpack package.

ViLBERT's pre-training data (formats-and-metrics.md §1.3) was written by tensorpack's `LMDBSerializer`,
which serialises each datapoint with msgpack and msgpack_numpy: a numpy array becomes a map
{"nd": True, "type": dtype string ("<f4"), "shape": [...], "data": raw bytes} (and "kind", empty for the
plain dtypes), a numpy scalar {"nd": False, "type": ..., "data": raw bytes}. Depending on the msgpack
version that wrote it, the map keys and the raw bytes come as msgpack `bin` or as `str` (the "raw" strings
of msgpack before 0.4, which carry arbitrary bytes); both are read.

`unpackb` decodes one complete object of the MessagePack specification (nil, booleans, integers, floats,
str, bin, arrays, maps; extension types are refused: nothing here writes them) and turns the
msgpack_numpy maps back into arrays of the plain numeric dtypes. Anything malformed (a length running past
the end, bytes left over, an unknown type byte, nesting deeper than `MAX_DEPTH`, an array map whose data
does not fill its shape) raises `ValueError` with a one-line reason; callers add the file and the record.
`str` values are decoded as UTF-8 with `surrogateescape`, so a raw string holding array bytes round-trips
to the same bytes (`as_bytes`).
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

MAX_DEPTH = 64  # deeper nesting is refused (a record is a list of arrays and scalars: depth 3)
_NUMERIC_KINDS = frozenset("biuf")  # bool, signed, unsigned, float: what region features and labels are

# Fixed-width scalars: type byte -> struct format (big-endian, as the specification writes them).
_FIXED = {0xCA: ">f", 0xCB: ">d", 0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q",
          0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q"}
# Length-prefixed types: type byte -> (kind, struct format of the length).
_SIZED = {0xC4: ("bin", ">B"), 0xC5: ("bin", ">H"), 0xC6: ("bin", ">I"),
          0xD9: ("str", ">B"), 0xDA: ("str", ">H"), 0xDB: ("str", ">I"),
          0xDC: ("array", ">H"), 0xDD: ("array", ">I"), 0xDE: ("map", ">H"), 0xDF: ("map", ">I")}
_EXT = frozenset({0xC7, 0xC8, 0xC9, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8})


def as_bytes(value: Any) -> bytes:
    """A msgpack `bin` or raw `str` value as the bytes that were written."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    raise ValueError(f"expected bytes, got {type(value).__name__}")


class _Reader:
    def __init__(self, data: bytes):
        self.data = memoryview(data)
        self.pos = 0

    def take(self, n: int) -> memoryview:
        if n > len(self.data) - self.pos:
            raise ValueError(f"truncated: {n} bytes needed at offset {self.pos}, {len(self.data) - self.pos} left")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def value(self, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"nested deeper than {MAX_DEPTH} levels")
        at = self.pos
        t = self.take(1)[0]
        if t <= 0x7F:  # positive fixint
            return t
        if t >= 0xE0:  # negative fixint
            return t - 0x100
        if 0x80 <= t <= 0x8F:
            return self.collection("map", t & 0x0F, depth)
        if 0x90 <= t <= 0x9F:
            return self.collection("array", t & 0x0F, depth)
        if 0xA0 <= t <= 0xBF:
            return self.text(t & 0x1F)
        if t == 0xC0:
            return None
        if t in (0xC2, 0xC3):
            return t == 0xC3
        if t in _FIXED:
            return self.unpack(_FIXED[t])
        if t in _SIZED:
            kind, fmt = _SIZED[t]
            n = self.unpack(fmt)
            if kind == "bin":
                return bytes(self.take(n))
            if kind == "str":
                return self.text(n)
            return self.collection(kind, n, depth)
        if t in _EXT:
            raise ValueError(f"msgpack extension type (byte 0x{t:02x} at offset {at}) is not supported")
        raise ValueError(f"byte 0x{t:02x} at offset {at} is not a msgpack type")

    def text(self, n: int) -> str:
        return bytes(self.take(n)).decode("utf-8", "surrogateescape")

    def collection(self, kind: str, n: int, depth: int) -> Any:
        if n > len(self.data) - self.pos:  # every element takes at least one byte
            raise ValueError(f"truncated: a {kind} of {n} elements at offset {self.pos}, {len(self.data) - self.pos} bytes left")
        if kind == "array":
            return [self.value(depth + 1) for _ in range(n)]
        out: dict[Any, Any] = {}
        for _ in range(n):
            key = self.value(depth + 1)
            if isinstance(key, (list, dict)):
                raise ValueError(f"a map key at offset {self.pos} is a {type(key).__name__}")
            out[key] = self.value(depth + 1)
        return _numpy(out)


def _numpy(obj: dict[Any, Any]) -> Any:
    """A msgpack_numpy array or scalar map as numpy; any other map as it is (keys as text where they are)."""
    m = {(k.decode("utf-8", "surrogateescape") if isinstance(k, bytes) else k): v for k, v in obj.items()}
    if "nd" not in m or not isinstance(m["nd"], bool) or not {"type", "data"} <= m.keys():
        return obj
    if as_bytes(m.get("kind", b"")) != b"":  # b"V": a structured dtype, written as a field list
        raise ValueError("a msgpack_numpy array of a structured dtype is not supported")
    try:
        dtype = np.dtype(as_bytes(m["type"]).decode("ascii"))
    except (TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"a msgpack_numpy dtype {m['type']!r} numpy does not know ({e})") from None
    if dtype.kind not in _NUMERIC_KINDS:
        raise ValueError(f"a msgpack_numpy array of dtype {dtype.str} (only bool, integer and float arrays are read)")
    data = as_bytes(m["data"])
    if not m["nd"]:  # a numpy scalar
        if len(data) != dtype.itemsize:
            raise ValueError(f"a msgpack_numpy {dtype.str} scalar of {len(data)} bytes")
        return np.frombuffer(data, dtype)[0]
    shape = m.get("shape")
    if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape):
        raise ValueError(f"a msgpack_numpy array with shape {shape!r}")
    if len(data) != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise ValueError(f"a msgpack_numpy {dtype.str} array of shape {tuple(shape)} with {len(data)} bytes of data")
    return np.frombuffer(data, dtype).reshape(shape).copy()


def unpackb(data: bytes) -> Any:
    """One MessagePack object from `data` (all of it), msgpack_numpy arrays as numpy arrays."""
    r = _Reader(data)
    out = r.value()
    if r.pos != len(r.data):
        raise ValueError(f"{len(r.data) - r.pos} bytes left after the object (ends at offset {r.pos})")
    return out
