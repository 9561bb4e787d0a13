"""Syntactic grounding (paper §3.1 "Syntactic Grounding", Table 2, Figure 4): accuracies on a hand-made
caption with known answers, parse matching, and the `analyze grounding` recipe on the tiny world."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from vlberts.analysis.boxes import box_iou
from vlberts.analysis.grounding import GroundingEntity, GroundingInput, GroundingOptions
from vlberts.analysis.syntactic import (
    PAPER_TABLE2,
    Arc,
    ParseMismatch,
    SyntacticAccumulator,
    SyntacticInput,
    SyntacticResult,
    arcs_from_parse,
    ground_syntax,
    score_syntactic,
)
from vlberts.data.conllu import parse_conllu, read_conllu
from vlberts.errors import VlbertsError
from vlberts.world.vocab import COLOUR_NAMES, SIZES

COLOURS_AND_SIZES = (*COLOUR_NAMES, *SIZES)

# Words:      a    man  rides on   the  skateboard  .
# Word index: 0    1    2     3    4    5           6
# Positions:  [CLS]=0, a=1, man=2, rides=3, on=4, the=5, skate=6, ##board=7, .=8, [SEP]=9
WORDS = ("a", "man", "rides", "on", "the", "skateboard", ".")
WORD_TOKENS = [[1], [2], [3], [4], [5], [6, 7], [8]]
MAN_BOX = [0.0, 0.0, 10.0, 10.0]
BOARD_BOX = [20.0, 20.0, 30.0, 30.0]
# Region 0 is the man, region 1 the skateboard, region 2 a large box matching neither (IoU 1/9 with each).
REGIONS = np.array([MAN_BOX, BOARD_BOX, [0.0, 0.0, 30.0, 30.0]])
CONF = np.array([0.1, 0.8, 0.5])  # the baseline always picks region 1 (the skateboard), not the first

CONLLU = """# sent_id = 7_0
# text = a man rides on the skateboard .
1\ta\ta\tDET\tDT\t_\t2\tdet\t_\t_
2\tman\tman\tNOUN\tNN\t_\t3\tnsubj\t_\t_
3\trides\tride\tVERB\tVBZ\t_\t0\troot\t_\t_
4\ton\ton\tADP\tIN\t_\t3\tprep\t_\t_
5\tthe\tthe\tDET\tDT\t_\t6\tdet\t_\t_
6\tskateboard\tskateboard\tNOUN\tNN\t_\t4\tpobj\t_\t_
7\t.\t.\tPUNCT\t.\t_\t3\tpunct\t_\t_

"""


def row(region: int, strong: bool = True) -> list[float]:
    """An attention row over the 3 regions favouring `region`: 0.7 of the row on regions when strong
    (an active head), 0.07 when weak (inactive: below 20%)."""
    r = [0.1, 0.1, 0.1]
    r[region] = 0.5
    return [x / (1 if strong else 10) for x in r]


def attention() -> np.ndarray:
    """(L=2, H=2, T=10, R=3). Rows of [CLS], [SEP] stay zero (never read)."""
    attn = np.zeros((2, 2, 10, 3))
    # Layer 1 head 1: right for every query except "on" (-> man, the pobj target is the skateboard) and
    # the first subword "skate" (-> man), which only the token="first" option reads.
    for pos, reg in {1: 0, 2: 0, 3: 0, 4: 0, 5: 1, 6: 0, 7: 1, 8: 2}.items():
        attn[0, 0, pos] = row(reg)
    # Layer 1 head 2: weak (inactive); everything on the big box, except "on" -> skateboard (right).
    for pos in range(1, 9):
        attn[0, 1, pos] = row(1 if pos == 4 else 2, strong=False)
    # Layer 2 head 1: always the skateboard. Layer 2 head 2: always the man.
    for pos in range(1, 9):
        attn[1, 0, pos] = row(1)
        attn[1, 1, pos] = row(0)
    return attn


def syntactic_input(word_tokens=None) -> SyntacticInput:
    entities = [
        GroundingEntity([[1], [2]], np.array([MAN_BOX]), caption_id="7_0", chain_id="1", phrase="a man"),
        GroundingEntity([[5], [6, 7]], np.array([BOARD_BOX]), caption_id="7_0", chain_id="2", phrase="the skateboard"),
    ]
    g = GroundingInput(attn=attention(), region_boxes=REGIONS, region_conf=CONF, entities=entities)
    arcs = arcs_from_parse(parse_conllu(CONLLU)["7_0"], WORDS)
    return SyntacticInput(g, word_tokens or WORD_TOKENS, [(0, 2), (4, 6)], arcs, caption_id="7_0")


def test_arcs_from_parse_and_mismatches():
    sent = parse_conllu(CONLLU)["7_0"]
    arcs = arcs_from_parse(sent, WORDS)
    # 0-based word indices, root arc dropped.
    assert arcs == [Arc(1, "det", 0), Arc(2, "nsubj", 1), Arc(2, "prep", 3), Arc(5, "det", 4),
                    Arc(3, "pobj", 5), Arc(2, "punct", 6)]
    with pytest.raises(ParseMismatch, match="word 6 is 'skateboard' in the parse, 'skate' in the caption"):
        arcs_from_parse(sent, ("a", "man", "rides", "on", "the", "skate", "."))
    with pytest.raises(ParseMismatch, match="7 words in the parse, 6 in the caption"):
        arcs_from_parse(sent, WORDS[:-1])
    with pytest.raises(ParseMismatch):  # case matters: another tokeniser's output is not silently paired
        arcs_from_parse(sent, ("A",) + WORDS[1:])


def test_instances_both_directions_and_arcs_without_entity():
    s = score_syntactic(syntactic_input())
    # det(man -> a): dep->head (query "a", target "a man") and head->dep (query "man", same entity);
    # nsubj(rides -> man): only head->dep ("rides" is in no entity); prep(rides -> on) and
    # punct(rides -> .): no entity word, not scored; det(skateboard -> the): both ways;
    # pobj(on -> skateboard): only head->dep.
    got = list(zip(s.relation, s.direction, s.query_word.tolist(), s.target_entity.tolist()))
    assert got == [
        ("det", "dep->head", 0, 0), ("det", "head->dep", 1, 0),
        ("nsubj", "head->dep", 2, 0),
        ("det", "dep->head", 4, 1), ("det", "head->dep", 5, 1),
        ("pobj", "head->dep", 3, 1),
    ]
    assert s.n_arcs == 6 and s.n_arcs_without_entity == 2 and s.n_truncated_queries == 0
    # Predicted regions of layer 1 head 1 per instance: a->0, man->0, rides->0, the->1, ##board->1, on->0.
    assert s.pred[0, 0].tolist() == [0, 0, 0, 1, 1, 0]
    assert s.hit[0, 0].tolist() == [True, True, True, True, True, False]
    assert s.baseline_hit.tolist() == [False, False, False, True, True, True]


def test_accuracies_per_relation_head_and_direction():
    res = ground_syntax([syntactic_input()])
    assert res.counts == {"det": 4, "nsubj": 1, "pobj": 1}
    assert "prep" not in res.relations and "punct" not in res.relations
    with pytest.raises(KeyError, match="no instance of relation 'prep'"):
        res.relation("prep")
    assert (res.n_captions, res.n_arcs, res.n_arcs_without_entity, res.n_instances) == (1, 6, 2, 6)

    det, nsubj, pobj = res.relation("det"), res.relation("nsubj"), res.relation("pobj")
    # det: targets man, man, skateboard, skateboard.
    #   L1H1: a->0 ok, man->0 ok, the->1 ok, ##board->1 ok = 4/4; L1H2: all on region 2 = 0/4;
    #   L2H1: all on region 1 = 2/4 (the skateboard's two); L2H2: all on region 0 = 2/4 (the man's two).
    np.testing.assert_array_equal(det.accuracy, [[1.0, 0.0], [0.5, 0.5]])
    # nsubj: "rides" -> man. L1H1 -> 0 ok; L1H2 -> 2; L2H1 -> 1; L2H2 -> 0 ok.
    np.testing.assert_array_equal(nsubj.accuracy, [[1.0, 0.0], [0.0, 1.0]])
    # pobj: "on" -> skateboard. L1H1 -> 0; L1H2 -> 1 ok (weak); L2H1 -> 1 ok; L2H2 -> 0.
    np.testing.assert_array_equal(pobj.accuracy, [[0.0, 1.0], [1.0, 0.0]])
    np.testing.assert_array_equal(res.layer_accuracy("pobj"), pobj.accuracy)
    # Baseline: region 1 (most confident) is right for targets in "the skateboard" only.
    assert det.baseline_accuracy == 0.5 and nsubj.baseline_accuracy == 0.0 and pobj.baseline_accuracy == 1.0
    assert det.upper_bound == nsubj.upper_bound == pobj.upper_bound == 1.0
    # Region mass of the query rows: 0.7 for the strong heads, 0.07 for the weak one (inactive).
    np.testing.assert_allclose(pobj.mean_region_mass, [[0.7, 0.07], [0.7, 0.7]])
    np.testing.assert_array_equal(pobj.active, [[True, False], [True, True]])

    # Per direction.
    assert set(res.by_direction) == {"det (dep->head)", "det (head->dep)", "nsubj (head->dep)", "pobj (head->dep)"}
    # det dep->head: queries "a" (man) and "the" (skateboard). L2H1 (skateboard): 1/2; L2H2 (man): 1/2.
    d = res.relation("det (dep->head)")
    assert d.n_entities == 2
    np.testing.assert_array_equal(d.accuracy, [[1.0, 0.0], [0.5, 0.5]])

    # Table 2: most common first (ties by name), best *active* head. For pobj the best head overall is
    # 1-2 (the weak one), but Table 2 takes the best active head: 2-1.
    assert pobj.best_head.label == "1-2" and not pobj.best_head.active
    rows = [(r.relation, r.count, r.baseline, r.head.label, r.head.accuracy) for r in res.table2(10)]
    assert rows == [("det", 4, 0.5, "1-1", 1.0), ("nsubj", 1, 0.0, "1-1", 1.0), ("pobj", 1, 1.0, "2-1", 1.0)]
    assert [r.relation for r in res.table2(2)] == ["det", "nsubj"]
    assert [r.relation for r in res.table2(1, directions=True)] == ["det (dep->head)"]
    # The paper's ten relations in its order, those scored here, whatever their frequency; k does not cut them.
    assert [r.relation for r in res.table2(1, relations=PAPER_TABLE2)] == ["det", "pobj", "nsubj"]
    assert [r.relation for r in res.table2(relations=("pobj", "prep", "det"), directions=True)] == [
        "pobj (head->dep)", "det (dep->head)", "det (head->dep)"]


def test_query_word_breakdown_splits_each_relation_by_the_word_read():
    from vlberts.analysis.syntactic import QueryWordBreakdown

    inp = syntactic_input()
    inp.grounding.attn[0, 0, 1] = row(2)  # head 1-1 now misses from "a" (the big box); only 2-2 finds the man
    acc, by_word = SyntacticAccumulator(), QueryWordBreakdown()
    by_word.add(acc.add(inp), ("A",) + WORDS[1:])  # the words as the caption has them: lower-cased here
    res = acc.result()
    # det (dep->head): "a" -> man (1-1 wrong, 1-2 big box, 2-1 skateboard, 2-2 right), "the" -> skateboard
    # (1-1 right, 2-1 right): per head 1/2, 0, 1/2, 1/2, so the relation's best head is 1-1 (the first of three).
    assert res.relation("det (dep->head)").best_head.label == "1-1"
    rows = by_word.rows(res)
    got = [(r.group, r.n, r.baseline, r.overall_head, r.overall_head_accuracy, r.best_head, r.best_accuracy)
           for r in rows["det (dep->head)"]]
    assert got == [("a", 1, 0.0, "1-1", 0.0, "2-2", 1.0), ("the", 1, 1.0, "1-1", 1.0, "1-1", 1.0)]
    assert [(r.group, r.best_head) for r in rows["nsubj (head->dep)"]] == [("rides", "1-1")]
    assert [r.group for r in rows["pobj (head->dep)"]] == ["on"]
    assert set(rows) == set(res.by_direction)
    for key, rs in rows.items():  # the words add up to their relation-direction
        whole = res.by_direction[key]
        assert sum(r.n for r in rs) == whole.n_entities
        assert sum(r.overall_head_accuracy * r.n for r in rs) == pytest.approx(whole.best_head.accuracy * whole.n_entities)


def test_token_option_and_iou_rule_are_those_of_entity_grounding():
    # token="first": "skateboard" is read from "skate" (-> man), so L1H1's det drops to 3/4.
    first = ground_syntax([syntactic_input()], GroundingOptions(token="first"))
    np.testing.assert_array_equal(first.relation("det").accuracy, [[0.75, 0.0], [0.5, 0.5]])
    # IoU threshold 0.1: the big box (IoU 1/9 = 0.111 with each gold box) is now right for every target,
    # so the weak head's det becomes 4/4.
    loose = ground_syntax([syntactic_input()], GroundingOptions(iou_threshold=0.1))
    assert loose.relation("det").accuracy[0, 1] == 1.0
    assert box_iou(REGIONS[2:], REGIONS[:1])[0, 0] == pytest.approx(1 / 9)


def test_a_layer_that_sees_no_region_predicts_nothing():
    # VisualBERT without early fusion: layers before the fusion layer have all-zero text-to-region maps.
    # Their heads pick no region (-1) and never score, even where the last region (what index -1 would
    # read) is correct, as it is for every target at IoU >= 0.1.
    inp = syntactic_input()
    inp.grounding.attn[0] = 0.0
    inp.grounding.region_mass[0] = 0.0
    s = score_syntactic(inp, GroundingOptions(iou_threshold=0.1))
    assert (s.pred[0] == -1).all() and not s.hit[0].any()
    np.testing.assert_array_equal(s.hit[1], score_syntactic(syntactic_input(), GroundingOptions(iou_threshold=0.1)).hit[1])


def test_truncated_query_words_are_skipped_and_counted():
    tokens = [list(w) for w in WORD_TOKENS]
    tokens[2] = []  # "rides" cut off: the nsubj instance has no attention row
    res = ground_syntax([syntactic_input(tokens)])
    assert res.n_truncated_queries == 1 and "nsubj" not in res.relations
    assert res.counts == {"det": 4, "pobj": 1}


def test_accumulator_streams_skips_and_round_trips():
    acc = SyntacticAccumulator()
    acc.add(syntactic_input())
    acc.add(syntactic_input())
    acc.skip("parse words differ", "8_1")
    acc.skip("no parse", "9_0")
    res = acc.result()
    assert res.counts == {"det": 8, "nsubj": 2, "pobj": 2} and res.n_captions == 2
    assert res.relation("det").n_captions == 2
    np.testing.assert_array_equal(res.relation("det").accuracy, [[1.0, 0.0], [0.5, 0.5]])
    assert res.skipped == {"no parse": 1, "parse words differ": 1}
    assert res.skipped_examples == {"no parse": ["9_0"], "parse words differ": ["8_1"]}
    d = json.loads(json.dumps(res.to_dict()))
    assert d["table2"][0] == {"relation": "det", "count": 8, "baseline": 0.5, "accuracy": 1.0, "head": "1-1", "active": True}
    back = SyntacticResult.from_dict(d)
    assert back.counts == res.counts and back.skipped_examples == res.skipped_examples
    np.testing.assert_array_equal(back.relation("pobj (head->dep)").accuracy, res.relation("pobj").accuracy)
    np.testing.assert_array_equal(back.relation("pobj").active, res.relation("pobj").active)
    assert [r.to_dict() for r in back.table2()] == [r.to_dict() for r in res.table2()]
    # An empty accumulator gives an empty result, not an error (the report says nothing was scored).
    assert SyntacticAccumulator().result().relations == {}


# ----------------------------------------------------------------------------- end to end


def brute_force(model_dir, world, split: str, relation: str, direction: str) -> tuple[np.ndarray, int, float]:
    """Accuracy (L, H), count and baseline of one relation-direction, by plain loops over heads and arcs."""
    from vlberts.analysis.entities import entity_captions, grounding_inputs
    from vlberts.data.flickr_entities import read_flickr_entities, read_flickr_split
    from vlberts.features.store import RegionStore
    from vlberts.text.tokenizer import TextTokenizer
    from vlberts.training.checkpoint import load_pretraining_model

    model, _, _ = load_pretraining_model(model_dir)
    tok = TextTokenizer.load(model_dir)
    parses = read_conllu(world.root / "parses" / f"{split}.conllu")
    caps = entity_captions([read_flickr_entities(world.entities, i) for i in read_flickr_split(world.entities, split)], tok)
    hits, n, base_hits = None, 0, 0
    for cap, inp in grounding_inputs(model, caps, RegionStore(world.store)):
        L, H, _, _ = inp.attn.shape
        hits = np.zeros((L, H)) if hits is None else hits
        sent = parses[cap.caption_id]
        for t in sent.tokens:
            if t.deprel != relation or t.head == 0:
                continue
            head, dep = t.head - 1, t.id - 1
            q, tw = (dep, head) if direction == "dep->head" else (head, dep)
            ents = [e for e, (a, b) in enumerate(cap.entity_words) if a <= tw < b]
            if not ents:
                continue
            gold = cap.entities[ents[0]].gold_boxes
            ok = box_iou(inp.region_boxes, gold).max(axis=1) >= 0.5  # (R,)
            pos = cap.word_tokens[q][-1]
            n += 1
            base_hits += bool(ok[int(np.argmax(inp.region_conf))])
            for layer in range(L):
                for h in range(H):
                    hits[layer, h] += bool(ok[int(np.argmax(inp.attn[layer, h, pos]))])
    return hits / n, n, base_hits / n


def test_recipe_writes_table2_and_figure4_and_matches_a_brute_force_count(tiny_world, tiny_pretrained, tmp_path):
    from vlberts.recipes.analyze_grounding import GroundingConfig, analyze_grounding

    out = tmp_path / "g"
    rep = analyze_grounding(GroundingConfig(model=str(tiny_pretrained), entities=str(tiny_world.entities),
                                            features=str(tiny_world.store), split="test", out=str(out)))
    data = json.loads((out / "grounding.json").read_text())
    syn = data["syntactic_grounding"]
    assert syn is not None and rep.syntactic is not None
    assert "parses/test.conllu" in data["syntactic_grounding_note"]
    assert syn["skipped"] == {} and syn["n_captions"] == rep.result.n_captions
    # The world's captions have these relations touching an entity.
    assert {"det", "amod", "nsubj", "pobj"} <= set(syn["counts"])
    assert len(syn["table2"]) == min(10, len(syn["counts"]))
    assert [r["relation"] for r in syn["table2"]] == list(syn["counts"])[: len(syn["table2"])]
    assert [r["relation"] for r in syn["table2_paper_relations"]] == [r for r in PAPER_TABLE2 if r in syn["counts"]]
    assert "### The paper's ten relations" in (out / "grounding.md").read_text()
    for name, r in syn["relations"].items():  # pooled = sum of its directions
        parts = [v["n_instances"] for k, v in syn["by_direction"].items() if k.startswith(name + " (")]
        assert r["n_instances"] == sum(parts) > 0
        assert np.asarray(r["accuracy"]).shape == (2, 4)

    want, n, base = brute_force(tiny_pretrained, tiny_world, "test", "amod", "dep->head")
    got = rep.syntactic.relation("amod (dep->head)")
    assert got.n_entities == n > 0
    np.testing.assert_allclose(got.accuracy, want)
    assert got.baseline_accuracy == pytest.approx(base)

    assert (out / "syntactic_grounding.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "grounding.md").read_text()
    assert "### Table 2: the 10 most common relations" in md and "| amod |" in md and "(dep->head)" in md
    # By the query word: the adjectives of amod (dep->head), their counts adding up to the relation-direction's,
    # checked against the brute-force count above (colour and size words of the world).
    words = data["syntactic_by_query_word"]["amod (dep->head)"]
    assert sum(r["n"] for r in words) == n
    assert {r["group"] for r in words} <= set(COLOURS_AND_SIZES) and len(words) > 1
    assert all(r["overall_head"] == got.best_head.label for r in words)
    assert "## Syntactic grounding by the query word" in md and "### amod (dep-\\>head)" in md


def test_recipe_without_parses_and_with_mismatched_parses(tiny_world, tiny_pretrained, tmp_path):
    from vlberts.recipes.analyze_grounding import GroundingConfig, analyze_grounding

    common = dict(model=str(tiny_pretrained), entities=str(tiny_world.entities), features=str(tiny_world.store),
                  split="test")
    rep = analyze_grounding(GroundingConfig(out=str(tmp_path / "none"), parses="none", **common))
    data = json.loads((tmp_path / "none" / "grounding.json").read_text())
    assert rep.syntactic is None and data["syntactic_grounding"] is None
    assert "only entity grounding ran" in (tmp_path / "none" / "grounding.md").read_text()
    assert not (tmp_path / "none" / "syntactic_grounding.png").exists()

    # A copy of the entities without a parses/ folder beside it: "auto" finds none and says so.
    ents = tmp_path / "w" / "flickr30k_entities"
    shutil.copytree(tiny_world.entities, ents)
    rep = analyze_grounding(GroundingConfig(out=str(tmp_path / "auto"), **{**common, "entities": str(ents)}))
    assert rep.syntactic is None and "no parses" in rep.syntactic_note

    # A user's parse file: one sentence with a changed word, one sentence missing.
    sents = list(read_conllu(tiny_world.root / "parses" / "test.conllu").values())
    scored = {c for c in _captions_with_entities(tiny_world, tiny_pretrained)}
    changed, dropped = [s for s in sents if s.sent_id in scored][:2]
    text = (tiny_world.root / "parses" / "test.conllu").read_text()
    blocks = [b for b in text.split("\n\n") if b.strip()]
    out_blocks = []
    for b in blocks:
        if f"# sent_id = {dropped.sent_id}\n" in b:
            continue
        if f"# sent_id = {changed.sent_id}\n" in b:
            lines = b.split("\n")
            i = next(k for k, line in enumerate(lines) if not line.startswith("#"))
            cols = lines[i].split("\t")
            cols[1] = cols[1] + "x"
            lines[i] = "\t".join(cols)
            b = "\n".join(lines)
        out_blocks.append(b)
    parses = tmp_path / "user.conllu"
    parses.write_text("\n\n".join(out_blocks) + "\n\n")
    rep = analyze_grounding(GroundingConfig(out=str(tmp_path / "user"), parses=str(parses), **common))
    syn = rep.syntactic
    assert syn.skipped == {"no parse": 1, "parse words differ": 1}
    word = changed.words[0]
    why = f"word 1 is {word + 'x'!r} in the parse, {word!r} in the caption"  # the first difference is kept
    assert syn.skipped_examples == {"no parse": [dropped.sent_id], "parse words differ": [f"{changed.sent_id} ({why})"]}
    assert syn.n_captions == rep.result.n_captions - 2
    md = (tmp_path / "user" / "grounding.md").read_text()
    assert f"parse words differ 1 (e.g. {changed.sent_id.replace('_', chr(92) + '_')} ({why}))" in md
    # A file whose sent_ids follow another convention names no caption: an error that shows the convention
    (tmp_path / "other.conllu").write_text(parses.read_text().replace("# sent_id = ", "# sent_id = img"))
    with pytest.raises(VlbertsError, match=r"other.conllu: no sent_id names a caption of split 'test' \(\d+ parses, "
                                           r"the first 'img.*'\): a caption's parse is '# sent_id = <image id>_<caption "
                                           r"index>', e.g. "):
        analyze_grounding(GroundingConfig(out=str(tmp_path / "x"), parses=str(tmp_path / "other.conllu"), **common))

    with pytest.raises(VlbertsError, match="nope.conllu: file not found"):
        analyze_grounding(GroundingConfig(out=str(tmp_path / "x"), parses=str(tmp_path / "nope.conllu"), **common))
    with pytest.raises(VlbertsError, match="user: is a directory, expected a file"):  # said "not found"
        analyze_grounding(GroundingConfig(out=str(tmp_path / "x"), parses=str(tmp_path / "user"), **common))


def _captions_with_entities(world, model_dir) -> list[str]:
    """Caption ids of the test split that have a grounded entity (the ones the analysis runs), in order."""
    from vlberts.analysis.entities import entity_captions
    from vlberts.data.flickr_entities import read_flickr_entities, read_flickr_split
    from vlberts.text.tokenizer import TextTokenizer

    tok = TextTokenizer.load(model_dir)
    caps = entity_captions([read_flickr_entities(world.entities, i) for i in read_flickr_split(world.entities, "test")], tok)
    return [c.caption_id for c in caps if c.entities]
