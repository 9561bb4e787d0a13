"""Tokenizer (WordPiece via `tokenizers`) and MLM masking (BERT 80/10/10 at 15%)."""

import numpy as np
import pytest

from vlberts.errors import VlbertsError
from vlberts.text.masking import IGNORE_INDEX, mask_tokens, word_ids_of
from vlberts.text.tokenizer import SPECIAL_TOKENS, TextTokenizer

CORPUS = ["a small red circle sits above the blue square .", "two green triangles are near a star ."] * 20


def test_trained_vocabulary_has_bert_special_ids_and_roundtrips(tmp_path):
    tok = TextTokenizer.train(CORPUS, vocab_size=200)
    assert [tok.pad_id, tok.unk_id, tok.cls_id, tok.sep_id, tok.mask_id] == [0, 1, 2, 3, 4]
    ids = tok.encode("a small red circle")
    assert tok.decode(ids) == "a small red circle"
    tok.save(tmp_path)
    lines = (tmp_path / "vocab.txt").read_text().splitlines()
    assert lines[:5] == list(SPECIAL_TOKENS)
    again = TextTokenizer.load(tmp_path)
    assert again.encode("a small red circle") == ids
    assert again.vocab_size == tok.vocab_size


def test_bert_vocab_txt_splits_into_wordpieces(tmp_path):
    vocab = list(SPECIAL_TOKENS) + ["red", "circ", "##le", "##s", "a", "."]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = TextTokenizer.from_vocab(tmp_path / "vocab.txt")
    enc = tok.encode_words(["A", "red", "circles", "."])
    assert [tok.id_to_token(i) for i in enc.ids] == ["a", "red", "circ", "##le", "##s", "."]
    assert enc.word_tokens == [[0], [1], [2, 3, 4], [5]]
    assert tok.encode("blue") == [tok.unk_id]


def test_vocab_errors_name_the_file(tmp_path):
    with pytest.raises(VlbertsError, match="vocab.txt"):
        TextTokenizer.from_vocab(tmp_path / "vocab.txt")
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\n[UNK]\n")
    with pytest.raises(VlbertsError, match="line 3"):
        TextTokenizer.from_vocab(tmp_path / "vocab.txt")


def test_masking_rates_and_labels():
    rng = np.random.default_rng(0)
    ids = np.arange(10, 110)  # no special ids
    n, selected, masked, randomized, kept = 0, 0, 0, 0, 0
    for _ in range(400):
        out, labels = mask_tokens(ids, rng, mask_id=4, vocab_size=1000, special_ids={0, 1, 2, 3, 4})
        sel = labels != IGNORE_INDEX
        assert np.array_equal(labels[sel], ids[sel])  # labels are the originals
        assert np.array_equal(out[~sel], ids[~sel])  # unselected tokens untouched
        n += len(ids)
        selected += sel.sum()
        masked += (out[sel] == 4).sum()
        kept += (out[sel] == ids[sel]).sum()
        randomized += ((out[sel] != 4) & (out[sel] != ids[sel])).sum()
    assert abs(selected / n - 0.15) < 0.01
    assert abs(masked / selected - 0.8) < 0.02
    assert abs(kept / selected - 0.1) < 0.015  # a random token can equal the original, rarely
    assert abs(randomized / selected - 0.1) < 0.015


def test_masking_never_selects_special_tokens_and_is_reproducible():
    ids = [2] + list(range(10, 40)) + [3, 0, 0]
    a = mask_tokens(ids, np.random.default_rng(7), mask_id=4, vocab_size=50, special_ids={0, 2, 3, 4}, prob=0.9)
    b = mask_tokens(ids, np.random.default_rng(7), mask_id=4, vocab_size=50, special_ids={0, 2, 3, 4}, prob=0.9)
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
    assert (a[1][[0, 31, 32, 33]] == IGNORE_INDEX).all()


def test_whole_word_masking_shares_the_decision_across_subwords():
    ids = list(range(10, 22))
    word_ids = [0, 0, 0, 1, 1, 2, 3, 3, 3, 3, 4, 5]
    for seed in range(50):
        out, labels = mask_tokens(ids, np.random.default_rng(seed), mask_id=4, vocab_size=100, prob=0.5, word_ids=word_ids)
        sel = labels != IGNORE_INDEX
        for w in set(word_ids):
            members = [i for i, x in enumerate(word_ids) if x == w]
            assert len({bool(sel[i]) for i in members}) == 1
            assert len({out[i] == 4 for i in members}) == 1


def test_training_is_deterministic_and_spells_unseen_words():
    a = TextTokenizer.train(CORPUS, vocab_size=60)
    b = TextTokenizer.train(list(reversed(CORPUS)), vocab_size=60)
    assert a.tok.get_vocab() == b.tok.get_vocab()
    # Frequent words are whole tokens; an unseen word is spelled from the corpus' characters.
    assert [a.id_to_token(i) for i in a.encode("red")] == ["red"]
    assert [a.id_to_token(i) for i in a.encode("dare")] == ["d", "##a", "##r", "##e"]
    with pytest.raises(VlbertsError, match="smaller than"):
        TextTokenizer.train(CORPUS, vocab_size=10)


def test_words_are_ranked_by_their_count_over_every_text_repeats_included():
    # yy: 4, xx: 3, ww and zz: 1 each. Counting each distinct text once would rank ww (yy 2, the rest 1) second.
    tok = TextTokenizer.train(["xx yy ."] * 3 + ["yy ww zz ."], vocab_size=100)
    words = [t for t, _ in sorted(tok.tok.get_vocab().items(), key=lambda kv: kv[1]) if len(t) == 2 and t[0] == t[1]]
    assert words == ["yy", "xx", "ww", "zz"]


def test_chosen_tokens_get_their_own_selection_probability():
    ids = np.array([2] + [10, 11, 12, 13] * 500 + [3])
    out, labels = mask_tokens(ids, np.random.default_rng(0), mask_id=4, vocab_size=100, special_ids={2, 3, 4},
                              prob=0.1, token_probs={11: 0.9, 13: 0.3, 3: 1.0})
    sel = labels != IGNORE_INDEX
    rate = {t: sel[ids == t].mean() for t in (10, 11, 12, 13)}
    assert 0.06 < rate[10] < 0.14 and 0.06 < rate[12] < 0.14
    assert 0.85 < rate[11] < 0.95 and 0.25 < rate[13] < 0.35
    assert not sel[0] and not sel[-1]  # special tokens never, whatever their probability


def test_whole_words_take_their_first_subwords_selection_probability():
    # words: [11] [12 ##13] [10] repeated; 11 chosen at 0.9, a word starting with 12 at 0.3, the rest at 0.1
    ids = np.array([2] + [11, 12, 13, 10] * 1000 + [3])
    cont = frozenset({13})
    out, labels = mask_tokens(ids, np.random.default_rng(0), mask_id=4, vocab_size=100, special_ids={2, 3, 4},
                              prob=0.1, token_probs={11: 0.9, 12: 0.3, 13: 1.0}, continuation_ids=cont)
    sel = labels != IGNORE_INDEX
    assert (sel[ids == 12] == sel[ids == 13]).all()  # a word's subwords alike; the ## subword's own 1.0 unused
    assert 0.85 < sel[ids == 11].mean() < 0.95 and 0.25 < sel[ids == 12].mean() < 0.35
    assert 0.07 < sel[ids == 10].mean() < 0.13
    assert not sel[0] and not sel[-1]


def test_words_are_found_from_the_continuation_subwords():
    tok = TextTokenizer.train(CORPUS, vocab_size=60)
    ids = [tok.cls_id, *tok.encode("a dare red"), tok.sep_id]  # d ##a ##r ##e: one word of four subwords
    assert word_ids_of(ids, tok.continuation_ids, tok.special_ids) == [None, 0, 1, 1, 1, 1, 2, None]
    assert {tok.id_to_token(i)[:2] for i in tok.continuation_ids} == {"##"}
    # A continuation right after a special token starts a word rather than joining nothing.
    assert word_ids_of([tok.cls_id, ids[3], ids[4]], tok.continuation_ids, tok.special_ids) == [None, 0, 0]
