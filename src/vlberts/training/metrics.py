"""JSON-lines metrics log that stays consistent with checkpoints.

Each line is one record with a `step`. On resume, records after the checkpoint's step are dropped
(their steps will be run again), so the log of a resumed run equals the log of an uninterrupted one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from vlberts.io import atomic_open


class MetricsLog:
    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is None:
            self.path.unlink(missing_ok=True)
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["step"] <= resume_step]
            with atomic_open(self.path) as f:
                f.writelines(line + "\n" for line in kept)

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean) + "\n")

    @staticmethod
    def read(path: str | Path) -> list[dict[str, Any]]:
        path = Path(path)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line]
