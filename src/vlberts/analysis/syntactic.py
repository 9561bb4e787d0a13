"""Syntactic grounding by attention heads ("What Does BERT with Vision Look At?", §3.1 "Syntactic
Grounding", Table 2, Figure 4).

"If two words are connected with a dependency relation, w1 -r-> w2, and w1 is an entity aligned to an
image region, we would like to know how often the attention heads attend from w2 to the regions
corresponding to w1." Each head is again read as a classifier: from the *query* word it predicts the
region its attention (restricted to regions) favours most; the prediction is correct when that region
agrees with the gold boxes of the *target* word's entity, under exactly the rule of entity grounding
(`GroundingOptions`: IoU rule, threshold, which subword stands for a word; the helpers are shared with
`grounding.py`, not copied).

Arcs and directions. An arc is (head word, relation, dependent word), in the usual dependency
direction head -r-> dependent (CoNLL-U HEAD/DEPREL). The paper names one direction ("from w2 to the
regions of w1") without saying whether w1 is the head, and its examples go both ways ("wearing" attends
to its subject's region: query = head; "by" aligns to the man: query = head of pobj; "white" of "white
shirt": query = dependent of amod), so every arc is read in both directions, each counted when its
target word belongs to an entity with gold boxes:

    "dep->head": query = the dependent, target = the entity the head word belongs to;
    "head->dep": query = the head, target = the entity the dependent belongs to.

A word "belongs to" an entity when it lies inside the entity's phrase (Flickr30K Entities phrases are
noun-phrase chunks, so det, amod, num and nn arcs usually lie inside one phrase, and Table 2's det row
reads the determiner's attention to its own phrase's region). Both directions may count for one arc.
The numbers per relation pool both directions (the paper's Table 2 and Figure 4 rows are relations,
without direction: "pobj", "amod"); the numbers per direction are kept as well, keyed
"pobj (head->dep)", "pobj (dep->head)".

Other choices, each the plain reading:
- the root arc (HEAD 0) has no head word and is not counted; arcs whose target word is in no grounded
  entity (notvisual, scene-only, no box) are counted in `n_arcs_without_entity` and not scored;
- a query word cut off by the text budget has no attention row: the instance is skipped and counted;
- a word inside two entity phrases (Flickr30K Entities phrases do not overlap; other data may) belongs
  to the first;
- the query word's attention row is chosen by `GroundingOptions.token` applied to that one word
  (`grounding.token_positions`): "last"/"first" its last/first subword, "head_mean"/"mean" the mean of
  its subwords;
- the baseline per relation is entity grounding's: the most confident valid region, scored against
  the target entity;
- a head is "active" for a relation when on average more than `active_threshold` of the query words'
  attention goes to regions (Table 2: "We only consider heads that are allocating on average more than
  20% of the attention from source words to all image regions").

Pure computation, like `grounding.py`: `SyntacticInput` per caption in, `SyntacticAccumulator` streams,
`SyntacticResult` out. Letters in shape comments: L layers, H heads, T text tokens, R regions,
E entities, W words, Q distinct query words, S (arc, direction) instances of a caption.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from vlberts.analysis.grounding import (
    BreakdownRow,
    GroupedGrounding,
    GroundingAccumulator,
    GroundingInput,
    GroundingOptions,
    GroundingResult,
    HeadScore,
    baseline_hits,
    breakdown_rows,
    entity_correct_regions,
    most_confident_region,
    region_predictions,
    token_positions,
    token_weights,
)
from vlberts.data.conllu import ConlluSentence
from vlberts.io import nan_as_null

Direction = Literal["dep->head", "head->dep"]
DIRECTIONS: tuple[Direction, ...] = ("dep->head", "head->dep")
# The relations of the paper's Table 2 (Stanford dependencies; the ten most common in its Flickr30K parses).
PAPER_TABLE2: tuple[str, ...] = ("det", "pobj", "amod", "nsubj", "prep", "dobj", "punct", "partmod", "nn", "num")
# The relations of the paper's Figure 4.
FIGURE4_RELATIONS = ("pobj", "nsubj", "amod")
# How many caption ids a skip reason keeps as examples for the report.
_MAX_EXAMPLES = 10


@dataclass(frozen=True)
class Arc:
    """One dependency arc head -relation-> dependent; words are 0-based indices into the caption."""

    head: int
    relation: str
    dependent: int

    def readings(self) -> tuple[tuple[Direction, int, int], ...]:
        """The arc's two readings as (direction, query word, target word), in `DIRECTIONS` order."""
        return ("dep->head", self.dependent, self.head), ("head->dep", self.head, self.dependent)


class ParseMismatch(ValueError):
    """A parse whose words are not the caption's words (another tokenisation, another sentence)."""


class ParseNotTree(ValueError):
    """A parse whose heads do not lead every word to a root: a cycle, or no root at all."""


def arcs_from_parse(sentence: ConlluSentence, words: Sequence[str]) -> list[Arc]:
    """The arcs of a CoNLL-U sentence over the caption `words`, root arc left out.

    Words must agree one to one and exactly (same count, same forms, case included): the analysis
    indexes the caption's subwords by word, so a parse of a differently tokenised sentence would
    silently pair the wrong words. Raises `ParseMismatch` naming the first difference, and `ParseNotTree`
    for heads that do not lead every word to a root (its arcs would be scored as if they were a parse); a
    caption parsed as two sentences (two roots) is read.
    """
    check_parse_words(sentence, words)
    if not sentence.reaches_roots():
        raise ParseNotTree(f"parse {sentence.sent_id!r}: following the heads, some word never reaches a root (HEAD 0)")
    return [Arc(head - 1, rel, dep - 1) for head, rel, dep in sentence.arcs() if head != 0]


def check_parse_words(sentence: ConlluSentence, words: Sequence[str]) -> None:
    """Raise `ParseMismatch` naming the first difference unless the parse's words are exactly `words`
    (`arcs_from_parse`'s rule; the attention graphs read a parse's UPOS tags under the same rule)."""
    got = sentence.words
    if tuple(got) != tuple(words):
        if len(got) != len(words):
            why = f"{len(got)} words in the parse, {len(words)} in the caption"
        else:
            i = next(i for i, (a, b) in enumerate(zip(got, words)) if a != b)
            why = f"word {i + 1} is {got[i]!r} in the parse, {words[i]!r} in the caption"
        raise ParseMismatch(f"parse {sentence.sent_id!r} does not match the caption's words: {why}")


@dataclass
class SyntacticInput:
    """What the driver hands over for one parsed caption.

    grounding: the caption's `GroundingInput` (attention maps, regions, grounded entities).
    word_tokens: word index -> its positions on the text axis T of `grounding.attn` ([CLS] offset
        included); an empty list for a word cut off by the text budget.
    entity_words: per entity of `grounding.entities`, in the same order, its word span [start, end).
    arcs: the caption's dependency arcs over the same words (`arcs_from_parse`).
    caption_id: for messages and reports.
    """

    grounding: GroundingInput
    word_tokens: list[list[int]]
    entity_words: list[tuple[int, int]]
    arcs: list[Arc]
    caption_id: str = ""

    def __post_init__(self) -> None:
        where = f"caption {self.caption_id!r}"
        W = len(self.word_tokens)
        T = self.grounding.shape[2]
        self.word_tokens = [[int(p) for p in w] for w in self.word_tokens]
        bad = [p for w in self.word_tokens for p in w if not 0 <= p < T]
        if bad:
            raise ValueError(f"{where}: token positions {bad} outside the text axis (T = {T})")
        self.entity_words = [(int(a), int(b)) for a, b in self.entity_words]
        if len(self.entity_words) != len(self.grounding.entities):
            raise ValueError(f"{where}: {len(self.entity_words)} entity spans for "
                             f"{len(self.grounding.entities)} entities")
        for a, b in self.entity_words:
            if not 0 <= a < b <= W:
                raise ValueError(f"{where}: entity span ({a}, {b}) outside the caption's {W} words")
        for arc in self.arcs:
            if not (0 <= arc.head < W and 0 <= arc.dependent < W) or arc.head == arc.dependent:
                raise ValueError(f"{where}: arc {arc} does not join two of the caption's {W} words")


@dataclass
class SyntacticCaptionScores:
    """Per-instance outcome for one caption (an instance is one arc read in one direction)."""

    relation: list[str]  # (S,)
    direction: list[Direction]  # (S,)
    query_word: np.ndarray  # (S,) int, word whose attention is read
    target_word: np.ndarray  # (S,) int, word whose entity's boxes are the answer
    target_entity: np.ndarray  # (S,) int, index into grounding.entities
    pred: np.ndarray  # (L, H, S) int, the region each head picks; -1: no attention to any region
    hit: np.ndarray  # (L, H, S) bool
    mass: np.ndarray  # (L, H, S) float64, share of the query word's attention on regions
    baseline_hit: np.ndarray  # (S,) bool, or NaN floats without a baseline
    reachable: np.ndarray  # (S,) bool, some valid region agrees with the target's gold boxes
    n_arcs: int  # arcs of the caption (root excluded)
    n_arcs_without_entity: int  # arcs neither of whose words is in a grounded entity
    n_truncated_queries: int  # instances dropped because the query word was cut off


def score_syntactic(inp: SyntacticInput, options: GroundingOptions = GroundingOptions()) -> SyntacticCaptionScores:
    """Score every (layer, head, arc instance) of one caption; heads vectorised, arcs a short loop."""
    g = inp.grounding
    T = g.shape[2]
    word_entity = np.full(len(inp.word_tokens), -1, dtype=np.int64)  # (W,)
    for e, (a, b) in reversed(list(enumerate(inp.entity_words))):  # reversed: the first entity wins
        word_entity[a:b] = e

    rel: list[str] = []
    dirs: list[Direction] = []
    query, target, ent = [], [], []
    without_entity = truncated = 0
    for arc in inp.arcs:
        if word_entity[arc.head] < 0 and word_entity[arc.dependent] < 0:
            without_entity += 1
            continue
        for d, q, t in arc.readings():
            if word_entity[t] < 0:
                continue
            if not inp.word_tokens[q]:
                truncated += 1
                continue
            rel.append(arc.relation)
            dirs.append(d)
            query.append(q)
            target.append(t)
            ent.append(int(word_entity[t]))

    q_words = sorted(set(query))
    q_index = {w: i for i, w in enumerate(q_words)}
    qi = np.array([q_index[q] for q in query], dtype=np.int64)  # (S,) into q_words
    ei = np.array(ent, dtype=np.int64)  # (S,)
    w = token_weights([token_positions([inp.word_tokens[q]], options.token) for q in q_words], T)  # (Q, T)
    pred_q, blind_q, mass_q = region_predictions(g, w)  # (L, H, Q) each
    pred = pred_q[:, :, qi]  # (L, H, S)
    correct = entity_correct_regions(g, options)  # (E, R)
    hit = correct[ei, pred] & ~blind_q[:, :, qi]  # (E, R)[(S,), (L, H, S)] -> (L, H, S)
    base = most_confident_region(g)
    return SyntacticCaptionScores(
        relation=rel,
        direction=dirs,
        query_word=np.array(query, dtype=np.int64),
        target_word=np.array(target, dtype=np.int64),
        target_entity=ei,
        pred=pred,
        hit=hit,
        mass=mass_q[:, :, qi],
        baseline_hit=baseline_hits(correct[ei], base),  # (S,)
        reachable=correct[ei].any(axis=1),  # (E, R)[(S,)] -> (S, R) -> (S,)
        n_arcs=len(inp.arcs),
        n_arcs_without_entity=without_entity,
        n_truncated_queries=truncated,
    )


def direction_key(relation: str, direction: str) -> str:
    """The key of a relation read in one direction: "pobj (head->dep)"."""
    return f"{relation} ({direction})"


@dataclass(frozen=True)
class Table2Row:
    """One row of the paper's Table 2: a relation, its baseline, its best head and that head's accuracy.

    `head` is the best active head (Table 2 "only consider[s] heads that are allocating on average more
    than 20% ... to all image regions"); when no head is active for the relation it is the best head
    overall and `head.active` is False, so the row is still filled and says so.
    """

    relation: str
    count: int
    baseline: float  # fraction
    head: HeadScore

    def to_dict(self) -> dict[str, Any]:
        return {"relation": self.relation, "count": self.count, "baseline": self.baseline,
                "accuracy": self.head.accuracy, "head": self.head.label, "active": self.head.active}


@dataclass(frozen=True)
class SyntacticResult:
    """Syntactic grounding over a data set.

    relations: relation -> per-head numbers, both directions pooled (the paper's rows).
    by_direction: "relation (direction)" -> the same numbers for one direction.
    Each value is a `GroundingResult` whose `n_entities` counts (arc, direction) instances and whose
    `n_captions` counts the captions contributing at least one; accuracies are fractions.
    n_captions: captions scored (parse matched); n_arcs: their arcs (root excluded);
    n_arcs_without_entity: arcs with no word in a grounded entity (not scored);
    n_truncated_queries: instances dropped because the query word was cut off by the text budget.
    skipped: captions not scored, by reason ("no parse", "parse words differ"), with up to ten
    example caption ids per reason in `skipped_examples`.
    """

    options: GroundingOptions
    relations: dict[str, GroundingResult]
    by_direction: dict[str, GroundingResult]
    n_captions: int
    n_arcs: int
    n_arcs_without_entity: int
    n_truncated_queries: int
    skipped: dict[str, int] = field(default_factory=dict)
    skipped_examples: dict[str, list[str]] = field(default_factory=dict)

    @property
    def counts(self) -> dict[str, int]:
        """Instances per relation, most common first (ties by name)."""
        items = sorted(self.relations.items(), key=lambda kv: (-kv[1].n_entities, kv[0]))
        return {k: v.n_entities for k, v in items}

    @property
    def n_instances(self) -> int:
        return sum(r.n_entities for r in self.relations.values())

    def relation(self, name: str) -> GroundingResult:
        """The numbers of one relation ("pobj") or one relation and direction ("pobj (head->dep)")."""
        if name in self.relations:
            return self.relations[name]
        if name in self.by_direction:
            return self.by_direction[name]
        known = ", ".join(self.counts) or "none"
        raise KeyError(f"no instance of relation {name!r} was scored (relations: {known})")

    def layer_accuracy(self, name: str) -> np.ndarray:
        """(L, H) accuracy of every head for one relation: Figure 4's dots, layer by layer."""
        return self.relation(name).accuracy

    def table2(self, k: int = 10, *, directions: bool = False, relations: Sequence[str] | None = None) -> list[Table2Row]:
        """The paper's Table 2: the k most common relations (or relation-directions), each with its
        most-confident-region baseline and its best head (active heads only, see `Table2Row`).

        `relations`: these relations instead, in this order, those with scored instances (both directions
        of each with `directions`), e.g. `PAPER_TABLE2`, the ten the paper lists, which on other data need
        not be the ten most common."""
        if k < 1:
            raise ValueError(f"k must be at least 1, got {k}")
        table = self.by_direction if directions else self.relations
        if relations is None:
            names = sorted(table, key=lambda n: (-table[n].n_entities, n))[:k]
        else:
            names = [n for r in relations for n in ([direction_key(r, d) for d in DIRECTIONS] if directions else [r])
                     if n in table]
        rows = []
        for n in names:
            r = table[n]
            rows.append(Table2Row(n, r.n_entities, r.baseline_accuracy, r.best_active_head or r.best_head))
        return rows

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (NaN baselines as None); per relation the `GroundingResult.to_dict` fields with `n_entities` renamed
        `n_instances`; Table 2 (pooled and per direction) included as derived rows."""

        def rel(r: GroundingResult) -> dict[str, Any]:
            d = r.to_dict()
            d.pop("options")
            d["n_instances"] = d.pop("n_entities")
            return d

        return nan_as_null({
            "options": self.options.to_dict(),
            "n_captions": self.n_captions,
            "n_arcs": self.n_arcs,
            "n_arcs_without_entity": self.n_arcs_without_entity,
            "n_truncated_queries": self.n_truncated_queries,
            "n_instances": self.n_instances,
            "skipped": dict(self.skipped),
            "skipped_examples": {k: list(v) for k, v in self.skipped_examples.items()},
            "counts": self.counts,
            "table2": [row.to_dict() for row in self.table2(10)] if self.relations else [],
            "table2_paper_relations": [row.to_dict() for row in self.table2(relations=PAPER_TABLE2)],
            "table2_by_direction": [row.to_dict() for row in self.table2(10, directions=True)]
            if self.by_direction else [],
            "relations": {k: rel(v) for k, v in self.relations.items()},
            "by_direction": {k: rel(v) for k, v in self.by_direction.items()},
        })

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SyntacticResult:
        """Inverse of `to_dict` (derived fields are recomputed, not read)."""
        options = GroundingOptions.from_dict(data["options"])

        def rel(d: dict[str, Any]) -> GroundingResult:
            return GroundingResult.from_dict({**d, "options": data["options"], "n_entities": d["n_instances"]})

        return cls(
            options=options,
            relations={k: rel(v) for k, v in data["relations"].items()},
            by_direction={k: rel(v) for k, v in data["by_direction"].items()},
            n_captions=int(data["n_captions"]),
            n_arcs=int(data["n_arcs"]),
            n_arcs_without_entity=int(data["n_arcs_without_entity"]),
            n_truncated_queries=int(data["n_truncated_queries"]),
            skipped={k: int(v) for k, v in data.get("skipped", {}).items()},
            skipped_examples={k: [str(x) for x in v] for k, v in data.get("skipped_examples", {}).items()},
        )


class SyntacticAccumulator:
    """Streaming syntactic grounding: `add` one parsed caption at a time, `skip` the captions that
    cannot be scored (with the reason and caption id), `result` at any point.

    One `GroundingAccumulator` per relation and per relation-direction holds the (L, H) counts, so the
    accuracy, region mass, active flags, baseline and upper bound follow entity grounding's rules.
    """

    def __init__(self, options: GroundingOptions = GroundingOptions()):
        self.options = options
        self.shape: tuple[int, int] | None = None  # (L, H)
        self.relations = GroupedGrounding(options)  # instances by relation
        self.by_direction = GroupedGrounding(options)  # instances by "relation (direction)"
        self.n_captions = 0
        self.n_arcs = 0
        self.n_arcs_without_entity = 0
        self.n_truncated_queries = 0
        self.skipped: Counter = Counter()
        self.skipped_examples: dict[str, list[str]] = {}

    def skip(self, reason: str, caption_id: str) -> None:
        """Count a caption that could not be scored ("no parse", "parse words differ", ...)."""
        self.skipped[reason] += 1
        ex = self.skipped_examples.setdefault(reason, [])
        if len(ex) < _MAX_EXAMPLES:
            ex.append(str(caption_id))

    def add(self, inp: SyntacticInput) -> SyntacticCaptionScores:
        """Score one caption, add it to the totals and return its per-instance scores."""
        L, H, _, _ = inp.grounding.shape
        if self.shape is None:
            self.shape = (L, H)
        elif self.shape != (L, H):
            raise ValueError(f"caption {inp.caption_id!r} has (L, H) = {(L, H)} but earlier captions had {self.shape}")
        s = score_syntactic(inp, self.options)
        self.n_captions += 1
        self.n_arcs += s.n_arcs
        self.n_arcs_without_entity += s.n_arcs_without_entity
        self.n_truncated_queries += s.n_truncated_queries
        keys = [direction_key(r, d) for r, d in zip(s.relation, s.direction)]
        for table, groups in ((self.relations, s.relation), (self.by_direction, keys)):
            # A caption counts once for each relation (relation-direction) it holds: at its first instance.
            first = np.zeros(len(groups))
            first[[groups.index(g) for g in dict.fromkeys(groups)]] = 1.0
            table.add(groups, s.hit, s.mass, s.baseline_hit, s.reachable, captions=first)
        return s

    def result(self) -> SyntacticResult:
        """The totals so far; a result with no relations when nothing could be scored (the report
        then says why, from `skipped` and the arc counts)."""
        return SyntacticResult(
            options=self.options,
            relations={k: a.result() for k, a in self.relations.groups.items()},
            by_direction={k: a.result() for k, a in self.by_direction.groups.items()},
            n_captions=self.n_captions,
            n_arcs=self.n_arcs,
            n_arcs_without_entity=self.n_arcs_without_entity,
            n_truncated_queries=self.n_truncated_queries,
            skipped=dict(sorted(self.skipped.items())),
            skipped_examples={k: list(v) for k, v in sorted(self.skipped_examples.items())},
        )


class QueryWordBreakdown:
    """Syntactic grounding of each relation-direction split by its query word (lower-cased), the word whose
    attention is read: amod (dep->head) by adjective, nsubj (head->dep) by verb, pobj (head->dep) by
    preposition. Table 2 takes one head per relation; a relation whose words are grounded by different
    heads (one for "red", another for "green") shows here. Fed with the instance scores
    `SyntacticAccumulator.add` returns and the caption's words."""

    def __init__(self, options: GroundingOptions = GroundingOptions()):
        self.options = options
        self.table = GroupedGrounding(options)  # groups: (relation-direction, lower-cased query word)

    def add(self, s: SyntacticCaptionScores, words: Sequence[str]) -> None:
        self.table.add([(direction_key(r, d), str(words[q]).lower()) for r, d, q in zip(s.relation, s.direction, s.query_word)],
                       s.hit, s.mass, s.baseline_hit, s.reachable)

    def rows(self, result: SyntacticResult) -> dict[str, list[BreakdownRow]]:
        """Per relation-direction, its query words' rows against that relation-direction's best head."""
        by_key: dict[str, dict[Hashable, GroundingAccumulator]] = {}
        for (key, word), acc in self.table.groups.items():
            by_key.setdefault(key, {})[word] = acc
        return {k: breakdown_rows(groups, result.by_direction[k]) for k, groups in by_key.items()}


def ground_syntax(inputs: Iterable[SyntacticInput], options: GroundingOptions = GroundingOptions()) -> SyntacticResult:
    """Syntactic grounding over an iterable of parsed captions (streamed)."""
    acc = SyntacticAccumulator(options)
    for inp in inputs:
        acc.add(inp)
    return acc.result()
