"""Reading dependency parses in CoNLL-U (https://universaldependencies.org/format.html).

Each sentence: ``#`` comment lines (``# sent_id = ...``, ``# text = ...``), then one line per word
with ten tab-separated columns ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL DEPS MISC, then a blank
line. Multiword-token lines (``1-2``) and empty nodes (``1.1``) are skipped: the analysis works on
syntactic words. DEPREL is whatever the parser wrote: Stanford basic labels (det, amod, nsubj,
prep, pobj, partmod, nn, num, ...) in the embedded world's gold parses and AllenNLP output, UD
labels from UD-trained parsers.

Sentences are keyed by ``sent_id``; a sentence without one gets its 1-based position in the file
("1", "2", ...). MISC is parsed into a dict (``Entity=1203|SpaceAfter=No`` ->
{"Entity": "1203", "SpaceAfter": "No"}).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlberts.errors import VlbertsError
from vlberts.io import read_text

N_COLUMNS = 10


@dataclass(frozen=True)
class ConlluToken:
    id: int  # 1-based position in the sentence
    form: str
    lemma: str
    upos: str
    xpos: str
    feats: str
    head: int  # id of the head word, 0 for the root
    deprel: str
    deps: str
    misc: dict[str, str]


@dataclass(frozen=True)
class ConlluSentence:
    sent_id: str
    text: str | None  # the "# text = " comment, if any
    tokens: tuple[ConlluToken, ...]

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(t.form for t in self.tokens)

    @property
    def heads(self) -> tuple[int, ...]:
        return tuple(t.head for t in self.tokens)

    def arcs(self) -> list[tuple[int, str, int]]:
        """(head id, deprel, dependent id) for every word; the root has head id 0."""
        return [(t.head, t.deprel, t.id) for t in self.tokens]

    def is_tree(self) -> bool:
        """A single root, and every word reaches it by following heads (no cycles)."""
        return sum(h == 0 for h in self.heads) == 1 and self.reaches_roots()

    def reaches_roots(self) -> bool:
        """Every word reaches a root (HEAD 0) by following heads: no cycle, no head outside the sentence. One
        tree, or several where a caption holds two sentences (spaCy's parse of "A dog runs. It is wet.")."""
        heads = self.heads
        n = len(heads)
        if n == 0:
            return False
        for i in range(1, n + 1):
            j, steps = i, 0
            while j != 0:
                if not 1 <= j <= n:
                    return False
                j = heads[j - 1]
                steps += 1
                if steps > n:
                    return False
        return True


def _misc(value: str) -> dict[str, str]:
    if value == "_":
        return {}
    out = {}
    for item in value.split("|"):
        key, _, val = item.partition("=")
        out[key] = val
    return out


def parse_conllu(text: str, path: str | Path = "<string>") -> dict[str, ConlluSentence]:
    """Parse CoNLL-U text -> {sent_id: sentence}, in file order. Errors name the line."""
    sentences: dict[str, ConlluSentence] = {}
    comments: dict[str, str] = {}
    rows: list[ConlluToken] = []
    start_line: int | None = None  # first line (comment or word) of the sentence being read

    def finish() -> None:
        nonlocal comments, rows, start_line
        if not rows:
            comments, start_line = {}, None
            return
        sid = comments.get("sent_id", str(len(sentences) + 1))
        where = f"sentence {sid} (line {start_line})"
        if sid in sentences:
            raise VlbertsError(f"duplicate sent_id {sid!r}", path=path, record=where)
        n = len(rows)
        for t in rows:
            if not 0 <= t.head <= n:
                raise VlbertsError(f"word {t.id} has head {t.head}, outside 0..{n}", path=path, record=where)
        sentences[sid] = ConlluSentence(sid, comments.get("text"), tuple(rows))
        comments, rows, start_line = {}, [], None

    for lineno, raw in enumerate(text.split("\n"), 1):
        line = raw.rstrip("\r")
        if not line.strip():
            finish()
            continue
        if start_line is None:
            start_line = lineno
        if line.startswith("#"):
            if rows:  # a comment after words starts a new sentence without a blank line: be strict
                raise VlbertsError("comment line inside a sentence (missing blank line?)",
                                   path=path, record=f"line {lineno}")
            key, sep, value = line[1:].partition("=")
            if sep:
                comments[key.strip()] = value.strip()
            continue
        cols = line.split("\t")
        if len(cols) != N_COLUMNS:
            raise VlbertsError(f"expected {N_COLUMNS} tab-separated columns, got {len(cols)}",
                               path=path, record=f"line {lineno}")
        if "-" in cols[0] or "." in cols[0]:
            continue  # multiword token range or empty node
        try:
            tid, head = int(cols[0]), int(cols[6])
        except ValueError:
            raise VlbertsError(f"ID and HEAD must be integers, got {cols[0]!r} and {cols[6]!r}",
                               path=path, record=f"line {lineno}") from None
        if tid != len(rows) + 1:
            raise VlbertsError(f"word id {tid} out of sequence (expected {len(rows) + 1})",
                               path=path, record=f"line {lineno}")
        form, lemma, upos, xpos, feats = cols[1:6]
        rows.append(ConlluToken(tid, form, lemma, upos, xpos, feats, head, cols[7], cols[8], _misc(cols[9])))
    finish()
    return sentences


def read_conllu(path: str | Path) -> dict[str, ConlluSentence]:
    """Read a CoNLL-U file -> {sent_id: sentence}, in file order."""
    return parse_conllu(read_text(path), path)
