"""Syntactic heads among the words (Clark et al., 2019), on hand-made attention maps with known answers."""

import numpy as np

from vlberts.analysis.syntactic import Arc
from vlberts.analysis.text_syntax import TextSyntaxAccumulator, TextSyntaxResult, score_text_syntax

# "a red circle sits": [CLS]=0, a=1, red=2, circle=3,4 (two subwords), sits=5, [SEP]=6.
WORD_TOKENS = [[1], [2], [3, 4], [5]]
ARCS = [Arc(2, "amod", 1), Arc(3, "nsubj", 2)]  # circle -amod-> red; sits -nsubj-> circle


def hand_map() -> np.ndarray:
    """(L=1, H=2, T=7, T=7); only the rows of the query subwords matter."""
    a = np.zeros((1, 2, 7, 7))
    # From "red" (2). Head 0: circle's two pieces (0.3 + 0.3). Head 1: "a" (0.5) beats circle (0.2 + 0.2).
    a[0, 0, 2, [3, 4]] = 0.3
    a[0, 1, 2, 1], a[0, 1, 2, [3, 4]] = 0.5, 0.2
    # From circle's last piece (4). Head 0: its own pieces (0.35) are left out, so "red" (0.3) wins over "sits".
    # Head 1: [SEP] (0.5) is not a word, so "sits" (0.3) wins.
    a[0, 0, 4, [3, 4]], a[0, 0, 4, 2], a[0, 0, 4, 5], a[0, 0, 4, 6] = 0.175, 0.3, 0.1, 0.25
    a[0, 1, 4, 6], a[0, 1, 4, 5], a[0, 1, 4, 2], a[0, 1, 4, 3] = 0.5, 0.3, 0.1, 0.1
    # From "sits" (5). Head 0: [CLS] (0.3) is left out, and circle's pieces sum to 0.4 > "red" 0.25, though
    # each piece alone (0.2) is less. Head 1: "red" (0.35) beats circle (0.15 + 0.15).
    a[0, 0, 5, 0], a[0, 0, 5, 2], a[0, 0, 5, [3, 4]] = 0.3, 0.25, 0.2
    a[0, 1, 5, 2], a[0, 1, 5, [3, 4]] = 0.35, 0.15
    return a


def test_each_head_picks_the_most_attended_other_word_summing_its_subwords():
    s = score_text_syntax(hand_map(), WORD_TOKENS, ARCS)
    assert s.keys == ["amod (dep->head)", "amod (head->dep)", "nsubj (dep->head)", "nsubj (head->dep)"]
    assert s.offsets.tolist() == [1, -1, 1, -1]
    assert s.hit.shape == (1, 2, 4)
    assert s.hit[0, 0].tolist() == [True, True, False, True]
    assert s.hit[0, 1].tolist() == [False, False, True, False]


def test_the_first_subword_reads_another_row():
    # token="first": circle is read from its first piece (3), whose row is all zeros: the first word, "a".
    s = score_text_syntax(hand_map(), WORD_TOKENS, ARCS, token="first")
    assert s.hit[0, :, 1].tolist() == [False, False] and s.hit[0, :, 2].tolist() == [False, False]


def test_an_arc_to_a_word_cut_off_is_not_read():
    s = score_text_syntax(hand_map(), [[1], [2], [3, 4], []], ARCS)
    assert s.keys == ["amod (dep->head)", "amod (head->dep)"]


def test_accumulated_accuracy_and_the_best_fixed_offset():
    acc = TextSyntaxAccumulator()
    acc.add(hand_map(), WORD_TOKENS, ARCS)
    acc.add(hand_map(), WORD_TOKENS, ARCS)
    # A zero map picks the first word other than the query, in both heads: from word 2 that is the
    # target (word 0), from word 3 it is not (target: word 2).
    acc.add(np.zeros((1, 2, 6, 6)), [[1], [2], [3], [4]], [Arc(2, "nsubj", 0), Arc(3, "nsubj", 2)])
    r = acc.result()
    assert list(r.rows)[:2] == ["nsubj (dep->head)", "nsubj (head->dep)"]  # 4 instances each, before amod's 2
    row = r.rows["nsubj (head->dep)"]  # from sits, sits, word 2, word 3
    assert row.n == 4
    np.testing.assert_allclose(row.accuracy, [[3 / 4, 1 / 4]])  # head 0: hit, hit, hit, miss; head 1: the zero map's hit
    assert (row.offset, row.offset_accuracy) == (-1, 3 / 4)  # -1 three times, -2 once
    assert row.best() == (1, 1, 0.75)
    # A tie between offsets goes to the nearer one, then to the one before the query word.
    tie = TextSyntaxAccumulator()
    four = [[1], [2], [3], [4]]
    tie.add(np.zeros((1, 1, 6, 6)), four, [Arc(1, "nsubj", 0), Arc(1, "nsubj", 2)])  # head->dep: -1 and +1
    tie.add(np.zeros((1, 1, 6, 6)), four, [Arc(1, "dobj", 2), Arc(3, "dobj", 1)])  # head->dep: +1 and -2
    assert tie.result().rows["nsubj (head->dep)"].offset == -1
    assert tie.result().rows["dobj (head->dep)"].offset == 1
    again = TextSyntaxResult.from_dict(r.to_dict())
    assert again.rows.keys() == r.rows.keys()
    np.testing.assert_allclose(again.rows["nsubj (head->dep)"].accuracy, row.accuracy)
    assert "| nsubj (head->dep) | 4 | 1-1 | 75.00 | -1 | 75.00 |" in r.markdown(["nsubj"])
