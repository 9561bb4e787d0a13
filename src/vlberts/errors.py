"""User-facing errors.

Bad input must never end in a traceback or a silently wrong result: every reader raises
`VlbertsError` with the file and the record it was reading, and the CLI turns it into one line on
stderr and exit code 2.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

EXIT_BAD_INPUT = 2


def first_line(error: BaseException) -> str:
    """The first line of an exception's message, or its type name when the message is empty."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


MAX_MESSAGE = 2000  # characters of an error line before its middle is left out (the longest list of valid
# settings a message gives is about 1,000)


def shortened(text: str, limit: int = MAX_MESSAGE) -> str:
    """`text`, or for a longer one its start and end with the middle left out and counted: an error quoting a
    value read from a file (a megabyte-long answer, a field of a damaged CSV) stays one readable line."""
    if len(text) <= limit:
        return text
    keep = (limit - 40) // 2
    return f"{text[:keep]} ...({len(text) - 2 * keep:,} characters left out)... {text[-keep:]}"


def printable(text: str) -> str:
    """`text` with each character that would not print (NUL, ESC, CR, DEL, format and unassigned code points)
    written as its Python escape (``\\x00``, ``\\x1b``, ``\\u200b``): a value read from a binary or mangled
    file then shows in a one-line message without moving the cursor or ringing the terminal. Printable text
    (any script) is returned unchanged."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class VlbertsError(Exception):
    """An error the user can fix: bad input, a missing file, an impossible setting.

    `str(err)` is one printable line: ``<file>: <record>: <message>`` with the parts that are known (characters
    that would not print, as a binary file's bytes, escaped by `printable`).
    """

    def __init__(self, message: str, *, path: str | Path | None = None, record: object = None):
        self.message = shortened(" ".join(str(message).split()))  # always one line, of a readable length
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
        return printable(": ".join(parts))


@dataclass
class BadRecords:
    """What a reader does with a bad record: raise (the default), or, with `skip` (`--skip_bad`), drop the
    record and count it by `kind`, keeping the first error's line for the warning and metrics.json."""

    skip: bool = False
    counts: Counter = field(default_factory=Counter)
    first: str = ""

    def handle(self, err: VlbertsError, kind: str = "malformed record") -> None:
        """Raise `err`, or count it under `kind` when skipping."""
        if not self.skip:
            raise err
        self.counts[kind] += 1
        self.first = self.first or str(err)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_dict(self) -> dict:
        return {"total": self.total, **dict(sorted(self.counts.items())), "first": self.first}

    def warning(self) -> str:
        """One line for stderr, or "" when nothing was skipped."""
        if not self.total:
            return ""
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.counts.items()))
        return f"warning: skipped {self.total} bad records ({kinds}); first: {self.first}"
