"""WordPiece tokenisation through Hugging Face `tokenizers`.

Two ways in: train a WordPiece vocabulary on a corpus (the embedded world, or your captions), or load a
BERT `vocab.txt`. Either way the tokenizer is saved as a BERT-format `vocab.txt` plus a small JSON of its
settings, so a checkpoint directory is self-contained.
"""

from __future__ import annotations

import functools

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from vlberts.errors import VlbertsError
from vlberts.io import atomic_open, read_json_object, refuse_run_directory, write_json

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


@dataclass(frozen=True)
class Encoded:
    """Subword ids of a pre-split sentence and, for each word, the positions of its subwords."""

    ids: list[int]
    word_tokens: list[list[int]]  # word index -> positions in `ids` (0-based, before [CLS] is added)


def read_do_lower_case(path: str | Path) -> bool:
    """`do_lower_case` of a Hugging Face `tokenizer_config.json` (absent: true, as in uncased BERT)."""
    value = read_json_object(path).get("do_lower_case", True)
    if not isinstance(value, bool):
        raise VlbertsError(f"do_lower_case must be true or false, got {value!r}", path=path)
    return value


class TextTokenizer:
    """A BERT WordPiece tokenizer (lower-casing, BERT pre-tokenisation, `##` continuation prefix)."""

    def __init__(self, tok: Tokenizer, lowercase: bool = True):
        self.tok = tok
        self.lowercase = lowercase
        vocab = tok.get_vocab()
        missing = [t for t in SPECIAL_TOKENS if t not in vocab]
        if missing:
            raise VlbertsError(f"vocabulary lacks special token(s) {', '.join(missing)}")
        self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id = (vocab[t] for t in SPECIAL_TOKENS)
        self.special_ids = frozenset((self.pad_id, self.unk_id, self.cls_id, self.sep_id, self.mask_id))

    # ------------------------------------------------------------------ construction

    @staticmethod
    def _pipeline(model: models.Model, lowercase: bool) -> Tokenizer:
        tok = Tokenizer(model)
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece(prefix="##")
        tok.add_special_tokens(list(SPECIAL_TOKENS))  # so that decode(skip_special_tokens=True) drops them
        return tok

    @classmethod
    def train(cls, corpus: Iterable[str], vocab_size: int = 1000, min_frequency: int = 1, lowercase: bool = True) -> TextTokenizer:
        """Build a WordPiece vocabulary from a corpus, deterministically; special tokens take ids 0..4.

        The vocabulary is: the five specials, every character seen (as a word start and as a `##`
        continuation, so any word can be spelled), then whole words by frequency (ties in alphabetical
        order) until `vocab_size`. Words outside it are split by WordPiece's greedy longest match.
        Why not `tokenizers`' WordPieceTrainer: it breaks ties between equally frequent merges in hash
        order, so two runs on the same corpus give different vocabularies (measured: three runs on the
        world's captions, three vocabularies), and a run would not be reproducible from its seed. For
        corpora with a long tail, load a BERT `vocab.txt` instead (`from_vocab`).
        """
        pipeline = cls._pipeline(models.WordPiece(unk_token="[UNK]"), lowercase)
        counts: Counter[str] = Counter()
        # Each distinct text is split once and its words counted as often as it occurs: templated corpora
        # repeat their texts (the demo world's 651,689 texts hold 59,001 distinct ones; 10.8 s -> 2.6 s).
        for text, n in Counter(corpus).items():
            norm = pipeline.normalizer.normalize_str(text)
            for w, _ in pipeline.pre_tokenizer.pre_tokenize_str(norm):
                counts[w] += n
        chars = sorted({c for w in counts for c in w})
        vocab = list(SPECIAL_TOKENS) + chars + ["##" + c for c in chars]
        if len(vocab) > vocab_size:
            raise VlbertsError(f"vocab_size {vocab_size} is smaller than the {len(vocab)} specials and characters of the corpus")
        seen = set(vocab)
        words = sorted((w for w, n in counts.items() if n >= min_frequency and w not in seen), key=lambda w: (-counts[w], w))
        vocab += words[: vocab_size - len(vocab)]
        model = models.WordPiece(vocab={t: i for i, t in enumerate(vocab)}, unk_token="[UNK]", max_input_chars_per_word=100)
        return cls(cls._pipeline(model, lowercase), lowercase)

    @classmethod
    def from_vocab(cls, vocab_file: str | Path, lowercase: bool = True) -> TextTokenizer:
        """Load a BERT `vocab.txt` (one token per line; line number = id)."""
        vocab_file = Path(vocab_file)
        if not vocab_file.is_file():
            raise VlbertsError("vocabulary file not found", path=vocab_file)
        vocab: dict[str, int] = {}
        with open(vocab_file, "rb") as f:
            for i, raw in enumerate(f):
                try:
                    token = raw.decode("utf-8").rstrip("\n")
                except UnicodeDecodeError as e:
                    raise VlbertsError(f"not UTF-8 text ({e.reason} at byte {e.start} of the line)", path=vocab_file,
                                       record=f"line {i + 1}") from None
                if token in vocab:
                    raise VlbertsError(f"duplicate token {token!r}", path=vocab_file, record=f"line {i + 1}")
                vocab[token] = i
        missing = [t for t in SPECIAL_TOKENS if t not in vocab]
        if missing:  # the pipeline would add them past the embedding table, or read [MASK] as a word
            raise VlbertsError(f"vocabulary has no {', '.join(missing)} token{'s' if len(missing) > 1 else ''} "
                               f"(a BERT vocabulary holds {', '.join(SPECIAL_TOKENS)})", path=vocab_file)
        model = models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100)
        return cls(cls._pipeline(model, lowercase), lowercase)

    def save(self, directory: str | Path) -> None:
        """Write `vocab.txt` (BERT format) and `tokenizer_config.json` into `directory`."""
        directory = Path(directory)
        vocab = sorted(self.tok.get_vocab().items(), key=lambda kv: kv[1])
        if [i for _, i in vocab] != list(range(len(vocab))):
            raise VlbertsError("vocabulary ids are not contiguous")
        with atomic_open(directory / "vocab.txt") as f:
            f.writelines(t + "\n" for t, _ in vocab)
        write_json(directory / "tokenizer_config.json", {"do_lower_case": self.lowercase, "tokenizer_class": "BertTokenizer"})

    @classmethod
    def load(cls, directory: str | Path) -> TextTokenizer:
        """Load what `save` wrote (or any BERT checkpoint directory holding `vocab.txt`)."""
        directory = Path(directory)
        if directory.is_file() and directory.suffix == ".txt":  # `--tokenizer=DIR/vocab.txt`: its folder is meant
            raise VlbertsError(f"a tokenizer is a directory holding vocab.txt, not a file: give {directory.parent}",
                               path=directory)
        refuse_run_directory(directory, "vocab.txt")
        cfg_path = directory / "tokenizer_config.json"
        lowercase = read_do_lower_case(cfg_path) if cfg_path.is_file() else True
        return cls.from_vocab(directory / "vocab.txt", lowercase=lowercase)

    # ------------------------------------------------------------------ use

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()

    @functools.cached_property
    def continuation_ids(self) -> frozenset[int]:
        """The ids of the `##` subwords, which continue the word before them (whole-word masking)."""
        return frozenset(i for t, i in self.tok.get_vocab().items() if t.startswith("##"))

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, i: int) -> str:
        return self.tok.id_to_token(i)

    def encode(self, text: str) -> list[int]:
        """Subword ids of `text`, without special tokens."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_words(self, words: list[str]) -> Encoded:
        """Subword ids of an already split sentence, keeping which subwords belong to which word."""
        enc = self.tok.encode(words, is_pretokenized=True, add_special_tokens=False)
        word_tokens: list[list[int]] = [[] for _ in words]
        for pos, w in enumerate(enc.word_ids):
            if w is not None:
                word_tokens[w].append(pos)
        return Encoded(ids=list(enc.ids), word_tokens=word_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
