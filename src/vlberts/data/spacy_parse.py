"""Dependency parses from spaCy, as the same `ConlluSentence`s a CoNLL-U file gives (issue 5, item 7).

`vlberts analyze grounding --parser spacy:en_core_web_sm` parses each caption with an installed spaCy
pipeline instead of reading CoNLL-U. spaCy is an optional extra (`pip install 'vlberts[parse]'`, then
`python -m spacy download en_core_web_sm`); it is imported only when a parser is asked for.

Alignment. The analysis indexes subwords by the caption's own words (Flickr30K Entities `Sentences/`,
space-separated). The caption text given to spaCy is those words joined by single spaces, so every
word has a known character span; each spaCy token (`token.idx`, `len(token.text)`) must lie inside
exactly one word's span. spaCy never joins across a space, but it may split a word ("man's" ->
"man" "'s", "t-shirt" -> "t" "-" "shirt"): such a word is represented by its *root token*, the first
of its tokens whose head lies outside the word (or that is a sentence root, head = itself), as spaCy's
`Span.root` does. The word's head is the word holding the root token's head; its label and UPOS are the
root token's. A token that crosses a word boundary or a word without any token (neither happens with
spaCy's tokenizer on space-joined words, but a custom pipeline may merge tokens) is a `SpacyAlignmentError`
naming the caption and word: the syntactic analysis skips that caption and counts it, like a CoNLL-U
parse whose words differ. A caption spaCy splits into two sentences simply has two roots (HEAD 0).

Labels. spaCy's English pipelines are trained on ClearNLP-converted OntoNotes; the analysis and Table 2
of "What Does BERT with Vision Look At?" use Stanford basic dependencies (det, amod, nsubj, dobj, prep,
pobj, num, nn, partmod, punct), as the embedded world's gold parses do. `CLEARNLP_TO_STANFORD` maps the
labels whose names differ; every other label (det, amod, nsubj, nsubjpass, dobj, prep, pobj, poss,
punct, advmod, aux, auxpass, cc, conj, ccomp, xcomp, advcl, attr, acomp, prt, mark, neg, expl, appos,
pcomp, agent, npadvmod, predet, preconj, quantmod, ...) is the same in both schemes and is kept as it
is, and so is any label the table does not know.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from vlberts.data.conllu import ConlluSentence, ConlluToken
from vlberts.errors import VlbertsError

# ClearNLP (spaCy English) label -> Stanford basic dependency label, only where the two differ.
CLEARNLP_TO_STANFORD: dict[str, str] = {
    "ROOT": "root",  # spaCy's sentence root; Stanford/CoNLL-U write "root" (HEAD 0)
    "compound": "nn",  # noun compound modifier: "star shape", "tennis ball"
    "nummod": "num",  # numeric modifier: "two dogs"
    "acl": "partmod",  # clausal modifier of a noun, mostly participial: "a man wearing a hat"
    "relcl": "rcmod",  # relative clause modifier: "the dog that runs"
    "case": "possessive",  # ClearNLP marks the possessive 's with case: "man 's"
    "dative": "iobj",  # indirect object: "gave him a ball"
    "intj": "discourse",  # interjection
}

INSTALL_HINT = "pip install 'vlberts[parse]' and the pipeline (python -m spacy download {name})"


class SpacyAlignmentError(ValueError):
    """spaCy's tokens cannot be mapped onto the caption's words (message names caption and word)."""


class SpacyToken(Protocol):
    """The part of spaCy's `Token` interface used here (tests pass a stand-in with these attributes)."""

    text: str
    idx: int  # character offset in the parsed text
    i: int  # index in the document
    head: Any  # the head token (itself for a sentence root); only `.i` is read
    dep_: str
    pos_: str  # universal POS tag


def stanford_label(label: str) -> str:
    """A ClearNLP label in Stanford basic dependencies (`CLEARNLP_TO_STANFORD`); unknown labels unchanged."""
    return CLEARNLP_TO_STANFORD.get(label, label)


def caption_text(words: Sequence[str]) -> str:
    """What spaCy parses: the caption's words joined by single spaces."""
    return " ".join(words)


def sentence_from_tokens(tokens: Iterable[SpacyToken], words: Sequence[str], sent_id: str) -> ConlluSentence:
    """Align spaCy tokens of `caption_text(words)` to `words` (module docstring) -> one CoNLL-U sentence
    over exactly `words`, labels mapped to Stanford. Raises `SpacyAlignmentError`."""
    tokens = list(tokens)
    starts, pos = [], 0
    for w in words:
        starts.append(pos)
        pos += len(w) + 1
    word_of: dict[int, int] = {}  # token index (token.i) -> word index
    members: list[list[SpacyToken]] = [[] for _ in words]
    for t in tokens:
        if not t.text.strip():
            continue  # whitespace tokens (spaCy's for repeated spaces) carry no word
        begin, end = t.idx, t.idx + len(t.text)
        w = next((k for k, s in enumerate(starts) if s <= begin and end <= s + len(words[k])), None)
        if w is None:
            raise SpacyAlignmentError(f"caption {sent_id!r}: spaCy token {t.text!r} at characters {begin}-{end} "
                                      "is not inside one of the caption's words")
        word_of[t.i] = w
        members[w].append(t)
    rows = []
    for w, toks in enumerate(members):
        if not toks:
            raise SpacyAlignmentError(f"caption {sent_id!r}: word {w + 1} {words[w]!r} got no spaCy token")
        root = next((t for t in toks if t.head.i == t.i or word_of.get(t.head.i) != w), None)
        if root is None:  # only a cycle inside the word could do this
            raise SpacyAlignmentError(f"caption {sent_id!r}: word {w + 1} {words[w]!r} has no root token")
        if root.head.i == root.i:
            head = 0
        elif root.head.i in word_of:
            head = word_of[root.head.i] + 1
        else:
            raise SpacyAlignmentError(f"caption {sent_id!r}: the head of word {w + 1} {words[w]!r} is a "
                                      "token outside the caption's words")
        rows.append(ConlluToken(w + 1, words[w], "_", root.pos_ or "_", "_", "_", head, stanford_label(root.dep_),
                                "_", {}))
    return ConlluSentence(sent_id, caption_text(words), tuple(rows))


def parse_captions(captions: Iterable[tuple[str, Sequence[str]]], nlp: Callable[[str], Iterable[SpacyToken]]
                   ) -> tuple[dict[str, ConlluSentence], dict[str, str]]:
    """Parse (caption id, words) pairs with `nlp` (a spaCy pipeline, or any callable text -> tokens) ->
    ({caption id: sentence}, {caption id: why it could not be aligned})."""
    parses: dict[str, ConlluSentence] = {}
    failed: dict[str, str] = {}
    for cid, words in captions:
        try:
            parses[cid] = sentence_from_tokens(nlp(caption_text(words)), words, cid)
        except SpacyAlignmentError as e:
            failed[cid] = str(e)
    return parses, failed


def parser_name(spec: str) -> str:
    """`--parser` value "spacy:PIPELINE" -> PIPELINE; anything else is a `VlbertsError`."""
    kind, sep, name = spec.partition(":")
    if kind != "spacy" or not sep or not name.strip():
        raise VlbertsError(f"--parser must be spacy:PIPELINE (e.g. spacy:en_core_web_sm), got {spec!r}")
    return name.strip()


def load_spacy(spec: str) -> Callable[[str], Iterable[SpacyToken]]:
    """The spaCy pipeline named by `--parser spacy:PIPELINE`, imported lazily; a one-line
    `VlbertsError` when spaCy or the pipeline is not installed (nothing is downloaded)."""
    name = parser_name(spec)
    try:
        import spacy  # noqa: PLC0415 - optional extra, imported only when asked for
    except ImportError:
        raise VlbertsError(f"--parser {spec}: spaCy is not installed; {INSTALL_HINT.format(name=name)}") from None
    try:
        return spacy.load(name)
    except OSError:
        raise VlbertsError(f"--parser {spec}: the spaCy pipeline {name!r} is not installed; "
                           f"{INSTALL_HINT.format(name=name)}") from None
