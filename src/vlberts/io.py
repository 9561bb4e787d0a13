"""Atomic writes and careful reads.

Every file vlberts writes goes through a temp file in the same directory and an `os.replace`, so an
interrupted run never leaves a half-written file under the final name. Directories that are built in
one go (a world, a report) are built under a temporary name and swapped in at the end.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import math
import os
import re
import shutil
import socket
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from vlberts.errors import BadRecords, VlbertsError


def _umask() -> int:
    """The process umask (read by setting and restoring it; there is no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_prefix(path: Path) -> str:
    """The name of a temporary for `path`: `.NAME.PID@HOST-` then mkstemp's random part and `.tmp`. The writer's
    process and machine in it let a later writer of the same path remove what a killed one left
    (`_sweep_stale`)."""
    return f".{path.name}.{os.getpid()}@{_HOST}-"


_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]  # this machine, in temporaries' names


def _sweep_stale(path: Path) -> None:
    """Remove the temporaries of `path` whose writer, on this machine, is no longer alive (killed while
    writing: a store-sized `.features.h5.*.tmp`, a half-built world directory), before writing it again. Ones
    of a live process or of another machine (a shared file system) are left alone."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)@{_HOST}-[^/]*\.tmp")
    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        match = pattern.fullmatch(tmp.name)
        if match is not None and not _alive(int(match.group(1))):
            remove_path(tmp, ignore_errors=True)


def remove_path(path: Path, ignore_errors: bool = False) -> None:
    """Remove `path`: a directory with what it holds, a file or a link (never what a link points to)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=ignore_errors)
    elif ignore_errors:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    else:
        path.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; on success it replaces `path`, on error it is removed. A
    directory at `path` is refused before any work (a file cannot replace it)."""
    path = Path(path)
    if path.is_dir():
        raise VlbertsError("is a directory, where a file is written: give a file name", path=path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(path)
    fd, tmp = tempfile.mkstemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.exists():  # mkstemp makes files 0600; give them the usual umask-based mode
            os.chmod(tmp_path, 0o666 & ~_umask())
        os.replace(tmp_path, path)
    except BaseException:
        tmp_path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_open(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[Any]:
    """Open a temp file for writing; it becomes `path` only if the block finishes."""
    if "b" in mode:
        encoding = None
    with atomic_path(path) as tmp:
        with open(tmp, mode, encoding=encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())


LOCK_NAME = ".vlberts.lock"


# The lock files this process holds. A forked child (a DataLoader worker) inherits their descriptors, and
# an flock lasts while any process holds one: a rank killed with live workers kept its directory locked until
# they noticed, and torchrun's restart of it was refused ("another vlberts run"). Children close them at once.
_HELD_LOCKS: set[int] = set()


def _close_inherited_locks() -> None:
    """In a forked child: each lock's descriptor pointed at /dev/null instead (dup2 closes the child's copy of
    the locked file, the parent's lock stays). Not a bare close: the number stays taken, so the lock's file
    object, if the child ever closes it, cannot close a file the child opened later under that number."""
    if not _HELD_LOCKS:
        return
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_RDWR)
        for fd in list(_HELD_LOCKS):
            with contextlib.suppress(OSError):
                os.dup2(null, fd)
        os.close(null)
    _HELD_LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_locks)


class RunLock:
    """An exclusive lock on DIR/.vlberts.lock (`lock_run_directory`), held until `release`."""

    def __init__(self, directory: Path, file: IO[str], made: bool):
        self.directory, self.file, self.made = directory, file, made
        _HELD_LOCKS.add(file.fileno())

    def release(self, failed: bool = False) -> None:
        """Let the directory go. One this lock made is removed again when nothing else filled it (a run
        refused at its start), or when the command `failed` before training wrote anything (no checkpoint,
        no metrics record: a setting found wrong after the tokenizer was built), so that a failed command
        leaves no half-made run directory. A run that trained keeps its checkpoints and its log."""
        names = {p.name for p in self.directory.iterdir()} if self.directory.is_dir() else set()
        if self.made and (names == {LOCK_NAME} or (failed and not names & {"checkpoints", "metrics.jsonl"})):
            shutil.rmtree(self.directory, ignore_errors=True)
        _HELD_LOCKS.discard(self.file.fileno())
        self.file.close()


def lock_run_directory(directory: str | Path) -> RunLock | None:
    """Take the run directory for this process (made if missing): an exclusive lock on DIR/.vlberts.lock,
    held until released. A second run started on the same --out while the first is alive (a scheduler's
    retry) would interleave checkpoints and log records; it is refused in one line. No lock where the
    system has no `fcntl` (Windows)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return None
    directory = Path(directory)
    made = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    f = open(directory / LOCK_NAME, "a+", encoding="utf-8")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise VlbertsError(f"another vlberts run (pid {holder}) is using this directory; wait for it to end or "
                           "pick another --out", path=directory) from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return RunLock(directory, f, made)


@contextlib.contextmanager
def atomic_dir(path: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Build a directory under a temporary name; swap it in as `path` when the block succeeds.

    An existing non-empty `path` is an error unless `overwrite` is set, in which case it is replaced
    only after the new directory is complete. A file at `path` is always an error (--overwrite would not
    help: it replaces a directory, never a file).
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise VlbertsError("is a file, not a directory (a directory is written there)", path=path)
    if path.exists() and not overwrite and any(path.iterdir()):
        raise VlbertsError("already exists and is not empty (pass --overwrite to replace it)", path=path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep_stale(path)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_prefix(path), suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def nan_as_null(obj: Any) -> Any:
    """`obj` with every NaN float (e.g. the baseline of an analysis without one) as None, JSON's null: json
    writes NaN as a bare `NaN`, which is not JSON."""
    if isinstance(obj, float) and obj != obj:
        return None
    if isinstance(obj, dict):
        return {k: nan_as_null(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [nan_as_null(v) for v in obj]
    return obj


def write_json(path: str | Path, obj: Any, indent: int | None = 2) -> None:
    """Write JSON atomically."""
    with atomic_open(path) as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")


def write_run_config(out: str | Path, settings: dict[str, Any]) -> None:
    """OUT/run_config.json for a run that does not train (an analysis, `vlberts predict`, `vlberts evaluate`),
    written as it starts, as training runs write theirs (`training.loop.start_or_resume`): the run's settings,
    paths as strings. A training run's own record (beside its model/ or checkpoints/) is never replaced: a
    resumed run and `vlberts predict` read it."""
    out = Path(out)
    if (out / "run_config.json").is_file() and ((out / "model").is_dir() or (out / "checkpoints").is_dir()):
        raise VlbertsError("is a training run's directory (its run_config.json records that run); give this "
                           "command another --out", path=out)
    write_json(out / "run_config.json", {k: str(v) if isinstance(v, Path) else v for k, v in settings.items()})


def require_file(path: str | Path) -> Path:
    """`path` as a Path when it is a file; a missing path, or a directory where a file is expected, is a
    one-line `VlbertsError` naming it."""
    path = Path(path)
    if path.is_dir():
        raise VlbertsError("is a directory, expected a file", path=path)
    if not path.is_file():
        raise VlbertsError("file not found", path=path)
    return path


def refuse_run_directory(directory: str | Path, name: str) -> None:
    """Where a model directory was expected but `directory` lacks `name`: a one-line error saying what was
    given instead, when that is clear: a run directory (its model is RUN/model: `vlberts pretrain --out=RUN`
    writes it), one of a run's training checkpoints, or a file (a model's weights file, or a released
    checkpoint, which `vlberts models import` turns into a model directory)."""
    directory = Path(directory)
    if directory.is_file():
        raise VlbertsError("is a file; a model is a directory (config.json, model.safetensors, vocab.txt): "
                           + (f"this one's, {directory.parent}?" if (directory.parent / name).is_file() else
                              "a released checkpoint becomes one with `vlberts models import`"), path=directory)
    if (directory / name).is_file():
        return
    if (directory / "model" / name).is_file():
        raise VlbertsError(f"not a model directory (no {name}): a run directory? its model is {directory / 'model'}",
                           path=directory)
    if directory.parent.name == "checkpoints" and (directory / "state.json").is_file():
        run = directory.parent.parent
        raise VlbertsError(f"a training checkpoint, not a model directory (no {name}): the run's model is {run / 'model'} "
                           f"once it ends, and `--out={run}` continues the run from its newest checkpoint", path=directory)


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's contents; a missing file or bytes that are not UTF-8 is a one-line `VlbertsError`.
    A byte-order mark opening the file (as Windows editors save UTF-8) is dropped, not read as text: it
    would otherwise stick to the first vocabulary entry, CoNLL-U line or predictions header."""
    path = require_file(path)
    try:
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise VlbertsError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=path) from None


class DuplicateKey(ValueError):
    """A JSON object names one key twice (raised by `unique_keys`)."""

    def __init__(self, key: str):
        super().__init__(f"key {key!r} appears twice in one JSON object (a JSON reader keeps only the last)")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`object_pairs_hook` for `json.load(s)`: the object as a dict, or `DuplicateKey`. Python's JSON reader
    keeps the last of two equal keys without a word; for an id-keyed file (GQA questions, VCR or NLVR2
    predictions, an image map) that silently drops a record or replaces an answer."""
    obj = dict(pairs)
    if len(obj) < len(pairs):
        counts = Counter(k for k, _ in pairs)
        raise DuplicateKey(next(k for k, _ in pairs if counts[k] > 1))
    return obj


def read_json(path: str | Path) -> Any:
    """Read a JSON file; a missing or malformed file, or an object naming a key twice, is a one-line
    `VlbertsError` naming it."""
    path = require_file(path)
    try:
        with open(path, encoding="utf-8-sig") as f:  # a byte-order mark opening the file is dropped (RFC 8259 §8.1)
            return json.load(f, object_pairs_hook=unique_keys)
    except json.JSONDecodeError as e:
        # ("Unterminated string starting at" names the position json's message goes on to give: it is given first)
        raise VlbertsError(f"malformed JSON at line {e.lineno} column {e.colno}: {e.msg.removesuffix(' at')}",
                           path=path) from None
    except DuplicateKey as e:
        raise VlbertsError(str(e), path=path) from None
    except UnicodeDecodeError as e:
        raise VlbertsError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=path) from None


def read_json_object(path: str | Path) -> dict[str, Any]:
    """A JSON file that must hold one object (a config, a map): anything else is an error naming the file."""
    obj = read_json(path)
    if not isinstance(obj, dict):
        raise VlbertsError(f"expected a JSON object, got {type(obj).__name__ if obj is not None else 'null'}", path=path)
    return obj


def first_char(path: str | Path) -> bytes:
    """The first character of a text file past a byte-order mark and white space (b"" if none in its first 4 KiB):
    b"[" for a JSON list, b"{" for a JSON object or JSON lines, to tell a file's layout without parsing it."""
    with open(require_file(path), "rb") as f:
        return f.read(4096).removeprefix(b"\xef\xbb\xbf").lstrip()[:1]


def iter_jsonl(path: str | Path, bad: BadRecords | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, parsed record) for each non-blank line of a JSON-lines file; a malformed or truncated
    line, or bytes that are not UTF-8, is an error naming the file and the line. With `bad` a malformed
    line goes to it instead (raised, or with --skip_bad dropped and counted)."""
    path = require_file(path)
    lineno = 0
    try:
        with open(path, encoding="utf-8-sig") as f:  # as read_json: a byte-order mark opening the file is dropped
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line.rstrip("\r\n"), object_pairs_hook=unique_keys)  # columns of the line itself
                except (json.JSONDecodeError, DuplicateKey) as e:
                    what = str(e) if isinstance(e, DuplicateKey) else f"malformed JSON line: {e.msg} (column {e.colno})"
                    error = VlbertsError(what, path=path, record=f"line {lineno}")
                    if bad is None:
                        raise error from None
                    bad.handle(error)
                    continue
                yield lineno, rec
    except UnicodeDecodeError as e:
        raise VlbertsError(f"not UTF-8 text ({e.reason} at byte {e.start})", path=path, record=f"line {lineno + 1}") from None


def read_jsonl(path: str | Path) -> list[Any]:
    """Read a JSON-lines file; the error for a bad line names the line number as the record."""
    return [rec for _, rec in iter_jsonl(path)]


def require_text(value: Any, field: str, *, path: str | Path, record: object) -> str:
    """The text a model reads (a question, a caption, a statement): a string with at least one
    non-blank character. A blank one would reach the model as `[CLS] [SEP]` and train or score on nothing."""
    if not isinstance(value, str):
        raise VlbertsError(f"field {field} must be a string, got {type(value).__name__}", path=path, record=record)
    if not value.strip():
        raise VlbertsError(f"field {field} is empty", path=path, record=record)
    return value


def require_keys(obj: Any, keys: tuple[str, ...], *, path: str | Path, record: object) -> None:
    """Fail with a one-line error when a JSON record is not a dict holding `keys`."""
    if not isinstance(obj, dict):
        raise VlbertsError(f"expected an object, got {type(obj).__name__}", path=path, record=record)
    missing = [k for k in keys if k not in obj]
    if missing:
        # a pickle of Python 3 bytes holds its names as byte strings (b'ref_id'): there, but not as text
        as_bytes = [k for k in missing if k.encode() in obj]
        raise VlbertsError(f"missing field(s) {', '.join(missing)}"
                           + (f" (present as byte strings, b{as_bytes[0]!r}: the file's keys must be text)"
                              if as_bytes else ""), path=path, record=record)


def require_lists(obj: Any, keys: tuple[str, ...], *, path: str | Path, record: object) -> None:
    """Fail with a one-line error when a JSON record is not a dict whose `keys` all hold lists."""
    require_keys(obj, keys, path=path, record=record)
    for key in keys:
        if not isinstance(obj[key], list):
            raise VlbertsError(f"field {key} must be a list, got {type(obj[key]).__name__}", path=path, record=record)


def require_unique(seen: dict[Any, object], key: Any, at: object, *, what: str, path: str | Path | None,
                   record: object = None) -> None:
    """Note that `key` (an id) appears `at` this place of the file (a line, a list position); one seen before
    is a one-line `VlbertsError` naming both places: the record would be trained on or scored twice, or
    replace the first. `record` (default `at`) is how the error names this place."""
    if key in seen:
        raise VlbertsError(f"duplicate {what} {key!r} (first at {seen[key]})", path=path,
                           record=at if record is None else record)
    seen[key] = at


def require_box(box: Any, width: float, height: float, *, what: str | None = None, allow_empty: bool = False,
                path: str | Path | None = None, record: object = None) -> tuple[float, float, float, float]:
    """`box` (x1, y1, x2, y2 pixel edges) as floats when it has positive width and height (with `allow_empty`,
    zero is enough) and lies inside a `width` x `height` image, with one pixel of slack for rounding as the
    region store allows (`features.record`); otherwise a one-line `VlbertsError` naming `path` and `record`.
    `what` is how the message shows the box (default: its xyxy edges), e.g. as the file writes it."""
    try:
        x1, y1, x2, y2 = (float(v) for v in box)
    except (TypeError, ValueError):
        raise VlbertsError(f"expected a box of 4 numbers, got {box!r}", path=path, record=record) from None
    shown = what or f"box ({x1:g}, {y1:g}, {x2:g}, {y2:g})"
    edges = f" (x1, y1, x2, y2 = {x1:g}, {y1:g}, {x2:g}, {y2:g})" if what else ""
    if not all(math.isfinite(v) for v in (x1, y1, x2, y2)):
        raise VlbertsError(f"{shown} holds NaN or inf", path=path, record=record)
    if not width > 0 or not height > 0:
        raise VlbertsError(f"image size {width}x{height} must be positive", path=path, record=record)
    if (x2 < x1 or y2 < y1) if allow_empty else (x2 <= x1 or y2 <= y1):
        kind, op = ("negative", ">=") if allow_empty else ("zero or negative", ">")
        raise VlbertsError(f"{shown} has {kind} width or height{edges}; expected x2 {op} x1 and y2 {op} y1",
                           path=path, record=record)
    if x1 < -1 or y1 < -1 or x2 > width + 1 or y2 > height + 1:
        raise VlbertsError(f"{shown} lies outside the {width:g}x{height:g} image{edges}; expected 0 <= x1, "
                           f"0 <= y1, x2 <= {width:g}, y2 <= {height:g} (one pixel of slack)", path=path, record=record)
    return x1, y1, x2, y2
