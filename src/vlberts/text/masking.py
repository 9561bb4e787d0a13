"""Masked language modelling input corruption (BERT; VisualBERT App. A.3; reference §3.1).

Each subword is selected independently with probability 0.15 (VisualBERT's `random_word`); a selected
subword becomes [MASK] 80% of the time, a random vocabulary token 10% and stays unchanged 10%. With
`word_ids` (or `continuation_ids`, the `##` subwords, from which `word_ids_of` finds the words), whole
words are selected and every subword of a word shares the decision (VL-BERT's `random_word_wwm`).
Special tokens are never selected. `token_probs` gives chosen subwords (e.g. the world's colour and
shape words) their own selection probability instead of `prob` (`PretrainConfig.mlm_word_probs`, and
the README's "The demo's world and masking" for why); with whole words, a word takes its first
subword's probability. Randomness comes from an explicit numpy
Generator, so a data pipeline can derive it from (seed, epoch, index) and resume exactly.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

IGNORE_INDEX = -100


def mask_tokens(
    ids: list[int] | np.ndarray,
    rng: np.random.Generator,
    *,
    mask_id: int,
    vocab_size: int,
    special_ids: frozenset[int] | set[int] = frozenset(),
    prob: float = 0.15,
    word_ids: list[int | None] | None = None,
    token_probs: Mapping[int, float] | None = None,
    continuation_ids: frozenset[int] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Corrupt `ids` for MLM.

    Returns (input ids, labels) as int64 arrays; labels hold the original id where a token was selected
    and IGNORE_INDEX elsewhere.
    """
    ids = np.asarray(ids, dtype=np.int64)
    n = len(ids)
    eligible = np.array([i not in special_ids for i in ids.tolist()], dtype=bool)
    if word_ids is None and continuation_ids is not None:
        word_ids = word_ids_of(ids.tolist(), continuation_ids, special_ids)
    if word_ids is None:
        p = np.array([token_probs.get(i, prob) for i in ids.tolist()]) if token_probs else np.full(n, prob)
        selected = (rng.random(n) < p) & eligible
        # One draw per token decides between [MASK] (< 0.8), random (< 0.9) and keep.
        action = rng.random(n)
        random_tok = rng.integers(0, vocab_size, size=n)
    else:
        # Whole-word masking: decide per word, apply the same action to all its subwords.
        words = [w for w in word_ids]
        uniq = sorted({w for w in words if w is not None})
        first: dict[int, int] = {}  # word -> its first subword's id
        for w, i in zip(words, ids.tolist()):
            if w is not None:
                first.setdefault(w, i)
        w_prob = {w: (token_probs or {}).get(first[w], prob) for w in uniq}
        w_sel = dict(zip(uniq, rng.random(len(uniq)) < np.array([w_prob[w] for w in uniq])))
        w_act = dict(zip(uniq, rng.random(len(uniq))))
        selected = np.array([w is not None and w_sel[w] for w in words], dtype=bool) & eligible
        action = np.array([w_act[w] if w is not None else 1.0 for w in words])
        random_tok = rng.integers(0, vocab_size, size=n)
    labels = np.where(selected, ids, IGNORE_INDEX)
    out = ids.copy()
    out[selected & (action < 0.8)] = mask_id
    swap = selected & (action >= 0.8) & (action < 0.9)
    out[swap] = random_tok[swap]
    return out, labels


def word_ids_of(ids: list[int], continuation_ids: frozenset[int], special_ids: frozenset[int] | set[int] = frozenset()) -> list[int | None]:
    """The word index of each subword (None for special tokens): a `##` subword (one of `continuation_ids`)
    continues the word before it, any other subword starts a new one. This is how BERT's WordPiece spells a
    word, so the words found are the basic tokenizer's words that VL-BERT's whole-word masking draws."""
    out: list[int | None] = []
    word = -1
    for i in ids:
        if i in special_ids:
            out.append(None)
            continue
        if i not in continuation_ids or not out or out[-1] is None:
            word += 1
        out.append(word)
    return out
