"""JSON-lines metrics log that stays consistent with checkpoints, optionally mirrored to TensorBoard.

Each line is one record with a `step`. On resume, records after the checkpoint's step are dropped
(their steps will be run again), so the log of a resumed run equals the log of an uninterrupted one.
A run killed while appending a record leaves a torn last line (no newline at its end, not JSON); its step
is after the last checkpoint (a record is logged before its step's checkpoint is written), so resuming
drops it with the others and reading skips it. A bad line anywhere else is an error naming the line.

With `tensorboard=True` (the recipes' `--tensorboard=true`; SPEC §6 "TensorBoard optional") every numeric
field of every record is also written as a TensorBoard scalar under its JSONL name, at the record's step,
into event files in `tensorboard/` beside the log (`tensorboard --logdir RUN/tensorboard`). A resumed run
starts its event file with a purge at the checkpoint's step + 1, so TensorBoard drops what the interrupted
run logged after its checkpoint, as the JSONL log does. Needs the `tensorboard` package (the extra
`vlberts[tensorboard]`, in the test extras too).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from vlberts.errors import VlbertsError
from vlberts.io import atomic_open, read_text

TENSORBOARD_DIR = "tensorboard"


class MetricsLog:
    def __init__(self, path: str | Path, resume_step: int | None = None, tensorboard: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            kept = [r for r in _records(self.path) if r["step"] <= resume_step]
            with atomic_open(self.path) as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
        self.board = _summary_writer(self.path.parent / TENSORBOARD_DIR, resume_step) if tensorboard else None

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")
        if self.board is not None:
            for key, value in clean.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.board.add_scalar(key, value, global_step=clean["step"])
            self.board.flush()  # a record every --log_every updates: visible while the run goes on

    def close(self) -> None:
        if self.board is not None:
            self.board.close()

    @staticmethod
    def read(path: str | Path) -> list[dict[str, Any]]:
        path = Path(path)
        return _records(path) if path.exists() else []


def _records(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics log, less a torn last line (see the module docstring)."""
    text = read_text(path)  # bytes that are not UTF-8: one line naming the log
    lines = text.split("\n")  # the last item is "" when the file ends with a newline, the torn line if not
    records = []
    for n, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines):  # no newline after it: an append cut short
                break
            raise VlbertsError(f"line {n} is not JSON (a metrics log has one JSON record per line)", path=path) from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise VlbertsError(f"line {n} is not a record with a whole-number 'step'", path=path)
        records.append(record)
    return records


def _summary_writer(directory: Path, resume_step: int | None) -> Any:
    """A TensorBoard writer in `directory`: a fresh run (`resume_step` None) first removes the event files of
    an earlier run there, as it removes its JSONL log; a resumed one purges the steps after `resume_step`."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise VlbertsError("--tensorboard=true needs the tensorboard package: pip install 'vlberts[tensorboard]'") from None
    if resume_step is None:
        shutil.rmtree(directory, ignore_errors=True)
    return SummaryWriter(str(directory), purge_step=None if resume_step is None else resume_step + 1)
