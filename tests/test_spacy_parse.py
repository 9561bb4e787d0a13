"""spaCy parses for the grounding analysis (data/spacy_parse.py, `analyze grounding --parser spacy:...`).

spaCy is an optional extra and not installed here: a stand-in with the Token interface the module reads
(text, idx, i, head.i, dep_, pos_) is passed as the `nlp` callable."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from typing import Any

import pytest

from vlberts.data.conllu import read_conllu
from vlberts.data.spacy_parse import (
    CLEARNLP_TO_STANFORD,
    SpacyAlignmentError,
    load_spacy,
    parse_captions,
    parser_name,
    sentence_from_tokens,
    stanford_label,
)
from vlberts.errors import VlbertsError


@dataclass
class Tok:
    text: str
    idx: int
    i: int
    dep_: str
    pos_: str
    head: Any = None


def doc(text: str, spec: list[tuple[str, int, str, str]]) -> list[Tok]:
    """Tokens of `text` from (token text, head index, ClearNLP label, UPOS); offsets found in order."""
    toks, pos = [], 0
    for i, (t, _, dep, upos) in enumerate(spec):
        pos = text.index(t, pos)
        toks.append(Tok(t, pos, i, dep, upos))
        pos += len(t)
    for tok, (_, h, _, _) in zip(toks, spec):
        tok.head = toks[h]
    return toks


def test_alignment_merges_a_split_word_and_maps_labels():
    words = ["two", "man's", "star", "shapes", "sitting", "."]
    text = " ".join(words)
    # token indices: two 0, man 1, 's 2, star 3, shapes 4, sitting 5, . 6
    tokens = doc(text, [("two", 4, "nummod", "NUM"), ("man", 4, "poss", "NOUN"), ("'s", 1, "case", "PART"),
                        ("star", 4, "compound", "NOUN"), ("shapes", 4, "ROOT", "NOUN"),
                        ("sitting", 4, "acl", "VERB"), (".", 4, "punct", "PUNCT")])
    s = sentence_from_tokens(tokens, words, "7_1")
    assert s.sent_id == "7_1" and s.words == tuple(words)
    assert [(t.head, t.deprel, t.upos) for t in s.tokens] == [
        (4, "num", "NUM"), (4, "poss", "NOUN"), (4, "nn", "NOUN"), (0, "root", "NOUN"),
        (4, "partmod", "VERB"), (4, "punct", "PUNCT")]
    assert s.is_tree()


def test_label_table_keeps_unknown_and_shared_labels():
    assert stanford_label("compound") == "nn" and stanford_label("nummod") == "num"
    assert stanford_label("acl") == "partmod" and stanford_label("relcl") == "rcmod"
    for same in ("det", "amod", "nsubj", "dobj", "prep", "pobj", "punct", "made_up_label"):
        assert stanford_label(same) == same
    assert set(CLEARNLP_TO_STANFORD.values()).isdisjoint({"det", "amod", "nsubj", "dobj", "prep", "pobj"})


def test_a_token_across_words_is_a_counted_mismatch():
    words = ["a", "red", "ball"]
    merged = doc("a red ball", [("a red", 1, "det", "DET"), ("ball", 1, "ROOT", "NOUN")])
    with pytest.raises(SpacyAlignmentError, match=r"caption '3_0'.*'a red'"):
        sentence_from_tokens(merged, words, "3_0")
    good = ["a", "ball"]

    def nlp(text: str) -> list[Tok]:
        if text == "a red ball":
            return merged
        return doc(text, [("a", 1, "det", "DET"), ("ball", 1, "ROOT", "NOUN")])

    parses, failed = parse_captions([("3_0", words), ("3_1", good)], nlp)
    assert list(parses) == ["3_1"] and list(failed) == ["3_0"]
    assert "is not inside one of the caption's words" in failed["3_0"]


def test_parser_spec_and_missing_spacy_are_one_line_errors():
    with pytest.raises(VlbertsError, match="spacy:PIPELINE"):
        parser_name("stanza:en")
    assert parser_name("spacy:en_core_web_sm") == "en_core_web_sm"
    if importlib.util.find_spec("spacy") is not None:
        pytest.skip("spaCy is installed here")
    with pytest.raises(VlbertsError) as e:
        load_spacy("spacy:en_core_web_sm")
    assert "pip install 'vlberts[parse]'" in str(e.value) and "\n" not in str(e.value)


def gold_stand_in(conllu_path, broken: set[str] = frozenset()):
    """A stand-in spaCy pipeline that 'parses' the world's captions as their gold CoNLL-U says, with the
    Stanford labels written back in ClearNLP names; captions in `broken` come back with two words merged."""
    to_clear = {v: k for k, v in CLEARNLP_TO_STANFORD.items()}
    by_text = {" ".join(s.words): s for s in read_conllu(conllu_path).values()}

    def nlp(text: str) -> list[Tok]:
        s = by_text[text]
        if s.sent_id in broken:
            return [Tok(text, 0, 0, "ROOT", "X")]  # one token over the whole caption
        spec = [(t.form, (t.head or t.id) - 1, to_clear.get(t.deprel, t.deprel), t.upos) for t in s.tokens]
        toks = doc(text, spec)
        for tok in toks:
            if tok.head is None:
                tok.head = tok
        return toks

    return nlp


def test_grounding_with_parser_matches_conllu(tiny_world, tiny_pretrained, tmp_path):
    from vlberts.recipes.analyze_grounding import GroundingConfig, analyze_grounding

    common = dict(model=str(tiny_pretrained), entities=str(tiny_world.entities), features=str(tiny_world.store),
                  split="val", explorer_examples=0, qualitative=0)
    conllu = tiny_world.root / "parses" / "val.conllu"
    gold = analyze_grounding(GroundingConfig(**common, out=str(tmp_path / "gold")))
    spacy_run = analyze_grounding(GroundingConfig(**common, out=str(tmp_path / "sp"), parser="spacy:stand_in"),
                                  nlp=gold_stand_in(conllu))
    assert gold.syntactic is not None and spacy_run.syntactic is not None
    assert spacy_run.syntactic.to_dict() == gold.syntactic.to_dict()
    assert "spaCy pipeline stand_in" in spacy_run.syntactic_note

    first = next(iter(read_conllu(conllu)))
    broken = analyze_grounding(GroundingConfig(**common, out=str(tmp_path / "br"), parser="spacy:stand_in"),
                               nlp=gold_stand_in(conllu, {first}))
    reason = "parser tokens do not align with the caption's words"
    assert broken.syntactic.skipped == {reason: 1}
    assert broken.syntactic.n_captions == gold.syntactic.n_captions - 1
    data = json.loads((tmp_path / "br" / "grounding.json").read_text())
    assert list(data["parser_alignment_failures"]) == [first]
    assert first in data["parser_alignment_failures"][first]

    # --mask_pos reads the parts of speech from the parser alike; a caption the parser could not align is
    # left out of a masked analysis (masked and unmasked captions never mix) and the note counts it.
    masked_gold = analyze_grounding(GroundingConfig(**common, out=str(tmp_path / "mg"), mask_pos="ADJ"))
    masked_sp = analyze_grounding(GroundingConfig(**common, out=str(tmp_path / "ms"), mask_pos="ADJ",
                                                  parser="spacy:stand_in"), nlp=gold_stand_in(conllu))
    assert masked_sp.result.to_dict() == masked_gold.result.to_dict()
    assert masked_sp.mask_note == masked_gold.mask_note and "left out" not in masked_gold.mask_note
    masked_br = analyze_grounding(GroundingConfig(**common, out=str(tmp_path / "mb"), mask_pos="ADJ",
                                                  parser="spacy:stand_in"), nlp=gold_stand_in(conllu, {first}))
    assert masked_br.mask_note.endswith("; 1 captions without a parse of their words left out")
    assert masked_br.result.n_captions == masked_gold.result.n_captions - 1
