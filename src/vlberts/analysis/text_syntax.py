"""Syntactic heads in the text: does a head attend from a word to its dependency neighbour?

"What Does BERT with Vision Look At?" follows Clark et al. (2019, "What Does BERT Look At?"), who read
each BERT head as a parser: from a word, the word its attention favours most. The paper's VisualBERT
starts from BERT, whose heads already do this; syntactic grounding (`syntactic.py`) then asks whether
such a head lands on the neighbour's *region*. This module measures the text side on its own, so a
report can say whether a model has syntactic heads over words at all (docs/grounding-analysis.md, "Syntactic grounding").

Reading, per (arc, direction) instance (the directions of `syntactic.py`): the query word's attention
row (`GroundingOptions.token`'s subword choice, as in grounding) is summed over each word's subwords
(Clark et al.: attention *to* a split word is the sum over its pieces); [CLS], [SEP] and the query word
itself are left out; the head is right when its most-attended word is the other end of the arc.
Baseline per relation and direction: the best fixed offset (Clark et al.'s), i.e. the share of
instances whose target is the most common distance from the query ("the word before": -1).

Pure computation: (L, H, T, T) maps in, `TextSyntaxResult` out. Letters: L layers, H heads, T text
tokens, W words, S instances.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vlberts.analysis.grounding import GroupSums, TokenChoice, token_positions, token_weights
from vlberts.analysis.syntactic import DIRECTIONS, Arc, direction_key


@dataclass
class TextSyntaxScores:
    """One caption's instances: the key "relation (direction)", the signed word distance from query to
    target, and whether each head's most-attended other word is the target."""

    keys: list[str]  # (S,)
    offsets: np.ndarray  # (S,) int, target word index - query word index
    hit: np.ndarray  # (L, H, S) bool


def score_text_syntax(attn: np.ndarray, word_tokens: Sequence[Sequence[int]], arcs: Sequence[Arc],
                      token: TokenChoice = "last") -> TextSyntaxScores:
    """attn (L, H, T, T): word-piece attention over the caption's text (rows: from, columns: to).
    word_tokens: word index -> its positions on T (an empty list: cut off; its arcs are not read)."""
    attn = np.asarray(attn, dtype=np.float64)
    L, H, T, _ = attn.shape
    W = len(word_tokens)
    cols = np.zeros((T, W))  # (T, W): sums a row's pieces into words
    for w, pos in enumerate(word_tokens):
        cols[list(pos), w] = 1.0
    to_words = attn @ cols  # (L, H, T, T) @ (T, W) -> (L, H, T, W)
    keys, query, target = [], [], []
    for arc in arcs:
        for d, q, t in arc.readings():
            if word_tokens[q] and word_tokens[t]:
                keys.append(direction_key(arc.relation, d))
                query.append(q)
                target.append(t)
    if not keys:
        return TextSyntaxScores([], np.zeros(0, dtype=np.int64), np.zeros((L, H, 0), dtype=bool))
    rows = token_weights([token_positions([word_tokens[q]], token) for q in query], T)  # (S, T)
    by_word = rows @ to_words  # (S, T) @ (L, H, T, W) -> (L, H, S, W)
    q, t = np.array(query), np.array(target)
    by_word[:, :, np.arange(len(q)), q] = -np.inf  # the query word itself never counts
    hit = by_word.argmax(-1) == t  # (L, H, S)
    return TextSyntaxScores(keys, t - q, hit)


@dataclass
class TextSyntaxRow:
    """One relation in one direction over a data set."""

    n: int
    accuracy: np.ndarray  # (L, H) fraction of instances each head gets right
    offset: int  # the best fixed offset
    offset_accuracy: float  # its share of the instances

    def best(self) -> tuple[int, int, float]:
        """(layer, head) 1-based and the accuracy of the best head."""
        l, h = np.unravel_index(int(self.accuracy.argmax()), self.accuracy.shape)
        return int(l) + 1, int(h) + 1, float(self.accuracy[l, h])


@dataclass
class TextSyntaxResult:
    """Per "relation (direction)" key, most common relations first."""

    rows: dict[str, TextSyntaxRow] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {k: {"n": r.n, "accuracy": r.accuracy.round(6).tolist(), "offset": r.offset,
                    "offset_accuracy": round(r.offset_accuracy, 6)} for k, r in self.rows.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TextSyntaxResult:
        return cls({k: TextSyntaxRow(v["n"], np.asarray(v["accuracy"]), v["offset"], v["offset_accuracy"])
                    for k, v in d.items()})

    def markdown(self, relations: Sequence[str]) -> str:
        """A table of `relations` (both directions each): best head, its accuracy, the offset baseline."""
        lines = ["| relation (direction) | instances | best head | accuracy (%) | best fixed offset | its accuracy (%) |",
                 "|:---|---:|:---|---:|---:|---:|"]
        for rel in relations:
            for d in DIRECTIONS:
                r = self.rows.get(direction_key(rel, d))
                if r is not None:
                    layer, head, acc = r.best()
                    lines.append(f"| {rel} ({d}) | {r.n} | {layer}-{head} | {acc * 100:.2f} | {r.offset:+d} | "
                                 f"{r.offset_accuracy * 100:.2f} |")
        return "\n".join(lines) + "\n"


class TextSyntaxAccumulator:
    """Streams `score_text_syntax` captions into per-key counts; `result` at any point."""

    def __init__(self, token: TokenChoice = "last"):
        self.token = token
        self.hits = GroupSums()  # key -> (L, H) hits
        self.n: Counter = Counter()
        self.offsets: Counter = Counter()  # (key, offset) -> instances

    def add(self, attn: np.ndarray, word_tokens: Sequence[Sequence[int]], arcs: Sequence[Arc]) -> TextSyntaxScores:
        s = score_text_syntax(attn, word_tokens, arcs, self.token)
        self.hits.add(s.keys, s.hit)
        self.n.update(s.keys)
        self.offsets.update(zip(s.keys, s.offsets.tolist()))
        return s

    def result(self) -> TextSyntaxResult:
        hits = self.hits.totals()
        offsets: dict[str, dict[int, int]] = {}
        for (key, offset), count in self.offsets.items():
            offsets.setdefault(key, {})[offset] = count
        rows = {}
        for key in sorted(self.n, key=lambda k: (-self.n[k], k)):
            # Ties between offsets go to the nearer one, then the one before the query word.
            offset, count = min(offsets[key].items(), key=lambda kv: (-kv[1], abs(kv[0]), kv[0]))
            rows[key] = TextSyntaxRow(self.n[key], np.rint(hits[key][0]) / self.n[key], offset, count / self.n[key])
        return TextSyntaxResult(rows)
