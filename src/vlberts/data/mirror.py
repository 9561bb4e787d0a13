"""Mirrored training examples: VL-BERT's left-right flip (the released `TRAIN.FLIP_PROB`, 0.5 in its VQA,
RefCOCO+ and VCR configs; `vqa/data/datasets/vqa.py`, `refcoco/data/datasets/refcoco.py`).

With probability `flip_prob`, drawn per (epoch, example) so that a resumed run draws what the uninterrupted
one drew, a training item shows its image flipped left-right: its boxes mirrored (`regions.mirrored`; the
region features stay as they are, as VL-BERT's precomputed ones do) and the subwords `left` and `right`
swapped in its text. Answers that mention a side are swapped by the task (`data.vqa_dataset`); a target
that depends on boxes alone, such as RefCOCO+'s IoU targets, is the same for both (IoU is mirror-invariant).
Evaluation items, asked for by index alone, are never mirrored.
"""

from __future__ import annotations

from vlberts.data.sampling import example_rng
from vlberts.errors import VlbertsError
from vlberts.text.tokenizer import TextTokenizer

MIRRORED_WORDS = {"left": "right", "right": "left"}  # what a left-right flip changes in a text


def mirror_words(text: str) -> str:
    """`text` as it reads of the mirrored image: each space-separated "left" / "right" swapped (VL-BERT's
    `flip_tokens` over an answer's words)."""
    return " ".join(MIRRORED_WORDS.get(w, w) for w in text.split(" "))


def check_flip_prob(flip_prob: float) -> None:
    """`--flip_prob` is a probability; anything else is a one-line error."""
    if not 0.0 <= flip_prob <= 1.0:
        raise VlbertsError(f"--flip_prob must be a probability in [0, 1], got {flip_prob}")


def check_flip(flip_prob: float, model_dir: str) -> None:
    """`--flip_prob` checked before any data is read: a probability, and above 0 a model whose vocabulary
    holds "left" and "right" as tokens (`mirrored_subwords`)."""
    check_flip_prob(flip_prob)
    if flip_prob:
        mirrored_subwords(TextTokenizer.load(model_dir))


def mirrored_subwords(tok: TextTokenizer) -> dict[int, int]:
    """{id of "left": id of "right", and back}: the subwords a flip swaps (VL-BERT swaps the wordpieces `left`
    and `right`). A vocabulary without both as single tokens is an error: the flipped boxes would then
    disagree with the text."""
    ids = {w: tok.tok.token_to_id(w) for w in MIRRORED_WORDS}
    missing = [w for w, i in ids.items() if i is None]
    if missing:
        raise VlbertsError(f"--flip_prob swaps 'left' and 'right' in the text, but {' and '.join(map(repr, missing))} "
                           "is not a token of the model's vocabulary")
    return {ids[w]: ids[m] for w, m in MIRRORED_WORDS.items()}


class Flip:
    """Which items a dataset mirrors, and their swapped subwords (module docstring). `flip_prob` 0: none."""

    def __init__(self, flip_prob: float, seed: int, tok: TextTokenizer):
        check_flip_prob(flip_prob)
        self.prob, self.seed = flip_prob, seed
        self.subwords = mirrored_subwords(tok) if flip_prob else {}

    def drawn(self, key: int | tuple[int, int]) -> bool:
        """Whether the item at `key` is mirrored: a training key (epoch, index) with probability `flip_prob`
        from `example_rng(seed, epoch, index)`; an index alone (evaluation) never."""
        return self.prob > 0 and isinstance(key, tuple) and example_rng(self.seed, *key).random() < self.prob

    def swap(self, ids: list[int]) -> list[int]:
        """Subword ids with `left` and `right` swapped."""
        return [self.subwords.get(i, i) for i in ids]
