"""Reading pickles that hold plain data only, without ever running code from the file.

Some released annotation files exist only as pickles, notably RefCOCO+'s ``refs(unc).p`` (a list of
dicts of strings and numbers, written by Python 2's cPickle; formats-and-metrics.md §2.6). A pickle
can name any importable callable and have the loader call it, so ``pickle.load`` on a downloaded file
runs whatever the file says. `safe_load` uses an unpickler whose `find_class` admits only the builtin
container and scalar types and refuses everything else -- including builtins such as ``eval``,
``getattr`` or ``__import__`` -- with a one-line `VlbertsError` naming the file and the global.

Containers and scalars (dict, list, tuple, str, bytes, int, float, bool, None) are built by opcodes and
never reach `find_class`; sets, frozensets, bytearrays and complex numbers do (through
``builtins.set`` etc., or ``__builtin__.set`` in a Python 2 pickle), so those names are allowed. One
more: Python 3 writes ``bytes`` at protocols 0-2 as ``_codecs.encode(text, "latin1")``; that name is
answered with a function that does exactly that conversion and refuses any other codec.
Persistent ids (PERSID) are refused too: there is nothing they could legitimately refer to.

`read_npy` reads a `.npy` file the same way: a numeric array without any pickle, an object array (what
``np.save`` writes for a dict or a list of dicts: MMF's feature info files, Pythia's imdb question files)
through this unpickler.

With ``numpy=True`` (ViLBERT's LMDB feature records pickle numpy arrays; formats-and-metrics.md §1.3) the
names numpy's own pickles use are admitted as well, and nothing else: ``numpy.dtype``, ``numpy.ndarray``,
``numpy(._)core.multiarray._reconstruct`` (accepted only with ``numpy.ndarray`` as the type to build)
and ``.scalar``, and protocol 5's ``numpy(._)core.numeric._frombuffer`` (an array over a byte string). Their state (shape, dtype, raw bytes) is set by ``__setstate__``, which runs no
code from the file, and whatever an array of Python objects holds is unpickled through the same
restricted lookup.
"""

from __future__ import annotations

import builtins
import io
import pickle
from pathlib import Path
from typing import Any

from vlberts.errors import VlbertsError, first_line
from vlberts.io import require_file

# Global names a plain-data pickle may use, by the name the pickle gives (Python 3 and Python 2 spellings).
_BUILTIN_MODULES = frozenset({"builtins", "__builtin__"})
_ALLOWED_NAMES: dict[str, str] = {
    "dict": "dict", "list": "list", "tuple": "tuple", "set": "set", "frozenset": "frozenset",
    "str": "str", "bytes": "bytes", "bytearray": "bytearray",
    "int": "int", "float": "float", "complex": "complex", "bool": "bool",
    "unicode": "str", "long": "int",  # Python 2 names, as in a cPickle written by Python 2
}  # fmt: skip


def _latin1_bytes(text: str, encoding: str) -> bytes:
    """Stand-in for ``_codecs.encode`` limited to the one call pickle makes for bytes."""
    if not isinstance(text, str) or encoding != "latin1":
        raise pickle.UnpicklingError(
            f"forbidden call _codecs.encode(..., {encoding!r}): only the latin1 form of bytes is allowed"
        )
    return text.encode("latin1")


def _numpy_globals() -> dict[tuple[str, str], Any]:
    """The globals numpy's pickles of arrays, dtypes and scalars name (both module spellings: numpy 1 and 2)."""
    import numpy as np

    try:
        from numpy._core import multiarray, numeric
    except ImportError:  # numpy 1
        from numpy.core import multiarray, numeric

    def reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
        if subtype is not np.ndarray:
            raise pickle.UnpicklingError(f"forbidden array type {subtype!r}: only numpy.ndarray is allowed")
        return multiarray._reconstruct(subtype, shape, dtype)

    found: dict[tuple[str, str], Any] = {("numpy", "dtype"): np.dtype, ("numpy", "ndarray"): np.ndarray}
    for core in ("numpy.core", "numpy._core"):
        found[(f"{core}.multiarray", "_reconstruct")] = reconstruct
        found[(f"{core}.multiarray", "scalar")] = multiarray.scalar
        found[(f"{core}.numeric", "_frombuffer")] = numeric._frombuffer  # protocol 5: bytes, dtype, shape, order
    return found


class _PlainDataUnpickler(pickle.Unpickler):
    """An unpickler that can build builtin containers and scalars and nothing else (and, with `numpy`,
    numpy arrays, dtypes and scalars)."""

    def __init__(self, file: Any, *, encoding: str, numpy: bool = False):
        super().__init__(file, encoding=encoding)
        self._numpy = _numpy_globals() if numpy else {}

    def find_class(self, module: str, name: str) -> Any:
        if module in _BUILTIN_MODULES and name in _ALLOWED_NAMES:
            return getattr(builtins, _ALLOWED_NAMES[name])
        if (module, name) == ("_codecs", "encode"):
            return _latin1_bytes
        if (module, name) in self._numpy:
            return self._numpy[(module, name)]
        allowed = "builtin containers and scalars" + (" and numpy arrays" if self._numpy else "")
        raise pickle.UnpicklingError(f"forbidden global {module}.{name}: only {allowed} are allowed")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("forbidden persistent id: only builtin containers and scalars are allowed")


def safe_loads(data: bytes, *, source: str | Path = "<bytes>", encoding: str = "utf-8", numpy: bool = False) -> Any:
    """Unpickle `data`, allowing only builtin containers and scalars (and numpy arrays with `numpy`).

    `encoding` decodes Python 2 ``str`` objects (byte strings); the released refs files store UTF-8
    text in them. Any failure -- a forbidden global, a truncated stream, undecodable text -- raises a
    one-line `VlbertsError` naming `source`.
    """
    try:
        return _PlainDataUnpickler(io.BytesIO(data), encoding=encoding, numpy=numpy).load()
    except pickle.UnpicklingError as e:
        if "truncated" in str(e):  # the C unpickler's word for running out of data mid-opcode
            raise VlbertsError("truncated pickle (ends before its STOP opcode)", path=source) from None
        raise VlbertsError(f"refused or malformed pickle: {e}", path=source) from None
    except EOFError:
        raise VlbertsError("truncated pickle (ends before its STOP opcode)", path=source) from None
    except UnicodeDecodeError as e:
        raise VlbertsError(f"pickle holds a byte string that is not {encoding} ({e.reason})", path=source) from None
    except (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, MemoryError) as e:
        # What the pickle machinery raises on corrupt opcodes/arguments (e.g. "unsupported pickle protocol").
        raise VlbertsError(f"malformed pickle: {type(e).__name__}: {e}", path=source) from None


def safe_load(path: str | Path, *, encoding: str = "utf-8", numpy: bool = False) -> Any:
    """Read a pickle file holding plain data only (see `safe_loads`); a missing file is a `VlbertsError`."""
    path = require_file(path)
    return safe_loads(path.read_bytes(), source=path, encoding=encoding, numpy=numpy)


def read_npy(path: str | Path) -> tuple[Any, bytes]:
    """One `.npy` file -> (what it holds, its bytes): a numeric array, read without pickles; or an object array
    (what `np.save` writes for a dict), whose pickled body goes through the restricted unpickler (numpy arrays
    allowed); a 0-d object array gives the object it holds."""
    import numpy as np
    from numpy.lib import format as npy

    path = require_file(path)
    data = path.read_bytes()
    f = io.BytesIO(data)
    try:
        version = npy.read_magic(f)
    except ValueError:
        raise VlbertsError("not a .npy file (no numpy magic string)", path=path) from None
    read_header = {(1, 0): npy.read_array_header_1_0, (2, 0): npy.read_array_header_2_0}.get(version)
    if read_header is None:
        raise VlbertsError(f"unsupported .npy format version {version[0]}.{version[1]}", path=path)
    try:
        shape, _, dtype = read_header(f)
    except ValueError as e:
        raise VlbertsError(f"cannot read this .npy file's header ({first_line(e)})", path=path) from None
    if not dtype.hasobject:
        f.seek(0)
        try:
            return npy.read_array(f, allow_pickle=False), data
        except ValueError as e:  # cut short: "EOF: reading array data, expected 128 bytes got 22"
            raise VlbertsError(f"cannot read this .npy file's array ({first_line(e)})", path=path) from None
    obj = safe_loads(data[f.tell():], source=path, numpy=True)
    if not isinstance(obj, np.ndarray) or obj.shape != shape:
        raise VlbertsError(f"the pickled body is not the {shape} object array its header announces", path=path)
    return (obj[()] if obj.shape == () else obj), data
