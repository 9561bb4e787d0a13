"""User-facing errors.

Bad input must never end in a traceback or a silently wrong result: every reader raises
`VlbertsError` with the file and the record it was reading, and the CLI turns it into one line on
stderr and exit code 2.
"""

from __future__ import annotations

from pathlib import Path

EXIT_BAD_INPUT = 2


class VlbertsError(Exception):
    """An error the user can fix: bad input, a missing file, an impossible setting.

    `str(err)` is one line: ``<file>: <record>: <message>`` with the parts that are known.
    """

    def __init__(self, message: str, *, path: str | Path | None = None, record: object = None):
        self.message = " ".join(str(message).split())  # always one line
        self.path = None if path is None else str(path)
        self.record = record
        super().__init__(self.__str__())

    def __str__(self) -> str:
        parts = []
        if self.path is not None:
            parts.append(self.path)
        if self.record is not None:
            parts.append(f"record {self.record}")
        parts.append(self.message)
        return ": ".join(parts)
