"""Text-only pre-training data: a corpus of documents in BERT's pre-training text format (one sentence per
line, a blank line between documents), read into `<Text, ∅>` examples, and the image-only set of
H-VisualBERT (a list of image ids).

VL-BERT §3.3 mixes BooksCorpus & English Wikipedia into every mini-batch: such a sample is "<Text, ∅>",
trained with MLM only. `TextOnlyData` gives those examples, keyed by (epoch, index) like the caption
examples (`data.pretrain.CaptionPretrainData`) so that they go through the same sampler, resume and
collate; their regions are empty (R = 0), which every model reads as a text-only sample. Two layouts:

  mlm  consecutive sentences of a document packed into one segment of at most `max_text_len` tokens
       (`[CLS] s_i s_i+1 ... [SEP]`, segment A), the way BERT's pre-training data fills its sequences;
  nsp  one example per sentence: `[CLS] a [SEP] b [SEP]` (segments A/B) where b is a's successor or, with
       p = 0.5, a sentence of another document (`objectives.text.nsp_pair`; W-VisualBERT footnote 4, BERT
       §3.1 Task #2), MLM-masked as well (BERT trains both on the same input).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from vlberts.data.batch import IMAGE_ONLY, PAIR, TEXT_ONLY
from vlberts.data.pretrain import truncate_front
from vlberts.data.regions import Regions
from vlberts.data.sampling import example_rng
from vlberts.errors import VlbertsError
from vlberts.objectives.text import nsp_pair
from vlberts.text.masking import mask_tokens
from vlberts.text.tokenizer import TextTokenizer

__all__ = ["IMAGE_ONLY", "PAIR", "TEXT_ONLY", "TextOnlyData", "empty_regions", "read_documents", "read_image_ids"]


def _decode_line(raw: bytes, n: int) -> str:
    """Line `n` (1-based) of a UTF-8 text file, stripped; a byte-order mark opening the file (as Windows
    editors save UTF-8) is dropped, else it would stay on the first sentence or image id."""
    return raw.decode("utf-8-sig" if n == 1 else "utf-8").strip()


def read_documents(path: str | Path) -> list[list[str]]:
    """Documents (lists of sentences) of a BERT-format text file. A missing file, a directory, a file that is
    not UTF-8 text (the line is named), one with no sentence, or one whose first line opens a JSON value (a
    captions file or JSON lines given for the corpus, which would train on their markup) is a one-line error."""
    path = Path(path)
    if path.is_dir():
        raise VlbertsError("is a directory; a text corpus is one file (one sentence a line, a blank line between "
                           "documents)", path=path)
    if not path.is_file():
        raise VlbertsError("text corpus not found", path=path)
    docs: list[list[str]] = [[]]
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                if b"\x00" in raw:
                    raise UnicodeDecodeError("utf-8", raw, 0, 1, "NUL byte")
                line = _decode_line(raw, n)
            except UnicodeDecodeError:
                raise VlbertsError("not a UTF-8 text file (one sentence per line expected)", path=path,
                                   record=f"line {n}") from None
            if line and n == 1 and line[0] in "[{":
                raise VlbertsError(f"its first line opens a JSON value ({line[:40]!r}...): a text corpus is plain text, "
                                   "one sentence a line, a blank line between documents", path=path, record="line 1")
            if line:
                docs[-1].append(line)
            elif docs[-1]:
                docs.append([])
    docs = [d for d in docs if d]
    if not docs:
        raise VlbertsError("text corpus has no sentences (one sentence per line, a blank line between documents)",
                           path=path)
    return docs


def read_image_ids(path: str | Path) -> list[str]:
    """Image ids, one per line (blank lines skipped), as the region store keys them: H-VisualBERT's
    image-only set (`WORLD/unpaired_images.txt`); or a `.npy` array of them (ViLBERT's `cache/coco_test_ids.npy`,
    numbers; read without pickles). Empty, or not text (not a 1-d array of numbers or strings): a one-line
    error."""
    if Path(path).suffix.lower() == ".npy":
        return _npy_ids(Path(path))
    return list(image_id_lines(path))


def _npy_ids(path: Path) -> list[str]:
    if not path.is_file():
        raise VlbertsError("image list not found", path=path)
    try:
        ids = np.load(path, allow_pickle=False)
    except ValueError as e:  # an object array (it would need pickles), or not a .npy file
        raise VlbertsError(f"not a .npy array of image ids ({e})", path=path) from None
    if ids.ndim != 1 or ids.dtype.kind not in "iuU" or not len(ids):
        raise VlbertsError(f"expected a non-empty 1-d array of image ids (numbers or strings), got shape {ids.shape} "
                           f"of {ids.dtype}", path=path)
    return list(dict.fromkeys(str(i) for i in ids.tolist()))


def image_id_lines(path: str | Path) -> dict[str, int]:
    """`read_image_ids` with the line each id is first on ({id: line number}, in file order), for an
    error about an id to name its line."""
    path = Path(path)
    if not path.is_file():
        raise VlbertsError("image list not found", path=path)
    ids: dict[str, int] = {}
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            try:
                line = _decode_line(raw, n)
            except UnicodeDecodeError:
                raise VlbertsError("not a UTF-8 text file (one image id per line expected)", path=path,
                                   record=f"line {n}") from None
            if not line:
                continue
            if len(line.split()) != 1 or "\x00" in line:
                raise VlbertsError(f"expected one image id per line, got {line[:40]!r}", path=path, record=f"line {n}")
            ids.setdefault(line, n)
    if not ids:
        raise VlbertsError("image list is empty (one image id per line)", path=path)
    return ids


def empty_regions(feature_dim: int) -> Regions:
    """No regions: what a text-only sample carries (R = 0)."""
    return Regions(
        feats=np.zeros((0, feature_dim), dtype=np.float32), boxes=np.zeros((0, 4), dtype=np.float32),
        pixel_boxes=np.zeros((0, 4), dtype=np.float32), conf=None,
    )


class TextOnlyData:
    """Text-only examples `<Text, ∅>` of a document corpus (module docstring), keyed by (epoch, index);
    everything random derives from (seed, epoch, index)."""

    def __init__(
        self,
        documents: list[list[str]],
        tokenizer: TextTokenizer,
        *,
        feature_dim: int,
        max_text_len: int = 48,
        mlm_prob: float = 0.15,
        seed: int = 0,
        nsp: bool = False,
        token_probs: Mapping[int, float] | None = None,
        whole_word: bool = False,
    ):
        if not documents or not any(documents):
            raise ValueError("no documents")
        if nsp and len(documents) < 2:
            raise ValueError("next-sentence prediction needs at least two documents")
        self.tok, self.max_text_len, self.mlm_prob, self.seed, self.nsp = tokenizer, max_text_len, mlm_prob, seed, nsp
        self.feature_dim = feature_dim
        self.token_probs = dict(token_probs or {})
        self.continuation_ids = tokenizer.continuation_ids if whole_word else None  # VL-BERT's whole words
        enc = tokenizer.tok.encode_batch([s for d in documents for s in d], add_special_tokens=False)
        flat = iter(e.ids for e in enc)
        self.docs: list[list[list[int]]] = [[next(flat) for _ in d] for d in documents]  # doc -> sentence -> ids
        if nsp:
            self.items = [(d, s) for d, doc in enumerate(self.docs) for s in range(len(doc))]
        else:
            self.items = self._pack(max_text_len - 2)

    def _pack(self, budget: int) -> list[tuple[int, int, int]]:
        """(doc, first sentence, end sentence) segments: consecutive sentences while they fit `budget`
        tokens (a longer sentence alone, truncated at the end)."""
        out = []
        for d, doc in enumerate(self.docs):
            s = 0
            while s < len(doc):
                e, n = s + 1, len(doc[s])
                while e < len(doc) and n + len(doc[e]) <= budget:
                    n, e = n + len(doc[e]), e + 1
                out.append((d, s, e))
                s = e
        return out

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        epoch, index = key
        rng = example_rng(self.seed, epoch, index)
        tok = self.tok
        nsp = -1
        if self.nsp:
            d, s = self.items[index]
            a, b, nsp = nsp_pair(self.docs, d, s, rng)
            a, b = truncate_front(a, b, self.max_text_len - 3)
            ids = [tok.cls_id, *a, tok.sep_id, *b, tok.sep_id]
            segments = [0] * (len(a) + 2) + [1] * (len(b) + 1)
        else:
            d, s, e = self.items[index]
            words = [w for sent in self.docs[d][s:e] for w in sent][: self.max_text_len - 2]
            ids = [tok.cls_id, *words, tok.sep_id]
            segments = [0] * len(ids)
        masked, labels = mask_tokens(
            ids, rng, mask_id=tok.mask_id, vocab_size=tok.vocab_size, special_ids=tok.special_ids, prob=self.mlm_prob,
            token_probs=self.token_probs, continuation_ids=self.continuation_ids,
        )
        return {
            "ids": masked, "segments": np.asarray(segments), "labels": labels, "match": 0, "image_id": -1,
            "regions": empty_regions(self.feature_dim), "kind": TEXT_ONLY, "nsp": nsp,
        }
