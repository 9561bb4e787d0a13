"""Question-answering examples (VQA, GQA) as model inputs: the question laid out for the model's answer
head, + regions, + the target scores over the answer classes.

Layouts (`TEXT_FORMATS`; each VQA model names its own in `text_format`):
  mask            `[CLS] question [MASK] [SEP]`, one segment: VisualBERT App. B.1, the answer read off the
                  [MASK] slot appended after the question (the original loader's `no_next_sentence`).
  answer_segment  `[CLS] question [SEP] [MASK] [SEP]`, the answer section (segment B) a single [MASK]:
                  VL-BERT §4.2.2, Fig. 2b (released `prepare_text_from_qa`).
  question        `[CLS] question [SEP]`: ViLBERT, LXMERT and W-VisualBERT, whose heads read pooled
                  outputs; `answer_pos` is then 0 ([CLS]) and unused.
W-VisualBERT's detector tags (§3.2) come along when `tag_subwords` is given.

Examples are any task reader's type with `question_id`, `image_id`, `question` and `annotated`
(`data.vqa.VQAExample`, `data.gqa.GQAExample`); a `Target` function turns an annotated one into
scores over the classes (default: VQA soft scores).

Mirrored training questions (`flip_prob`; VL-BERT's `FLIP_PROB`, `data.mirror`): a mirrored item's boxes are
flipped left-right and "left" / "right" swapped in the question's subwords and in every answer's words, its
target taken from the swapped answers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from vlberts.data.batch import VLInputs, VQABatch
from vlberts.data.mirror import Flip, mirror_words
from vlberts.data.regions import RegionSource, detected_classes, load_regions, length_keys, mirrored, pad_regions, pad_sequences, region_counts
from vlberts.data.vqa import VQAExample
from vlberts.errors import VlbertsError
from vlberts.models.wvisualbert import collate_tags, tag_tokens
from vlberts.tasks.vqa import AnswerVocab, SoftTarget, dense_targets, example_target
from vlberts.text.tokenizer import TextTokenizer

# A target: annotated example, answer classes -> its scores (None: no target, e.g. when only predicting).
Target = Callable[[Any, AnswerVocab], SoftTarget | None]


def vqa_soft_target(example: VQAExample, vocab: AnswerVocab) -> SoftTarget:
    """VQA v2's target: soft scores of the ten GT answers (`tasks.vqa.example_target`; LXMERT's label scores
    for its files)."""
    return example_target(example, vocab)


# A layout: question subwords, tokenizer -> (ids, segments, answer position).
Layout = Callable[[list[int], TextTokenizer], tuple[list[int], list[int], int]]


def _mask_slot(q: list[int], tok: TextTokenizer) -> tuple[list[int], list[int], int]:
    return [tok.cls_id, *q, tok.mask_id, tok.sep_id], [0] * (len(q) + 3), len(q) + 1


def _answer_segment(q: list[int], tok: TextTokenizer) -> tuple[list[int], list[int], int]:
    return [tok.cls_id, *q, tok.sep_id, tok.mask_id, tok.sep_id], [0] * (len(q) + 2) + [1, 1], len(q) + 2


def _question(q: list[int], tok: TextTokenizer) -> tuple[list[int], list[int], int]:
    return [tok.cls_id, *q, tok.sep_id], [0] * (len(q) + 2), 0


# name -> (special tokens the layout adds, layout)
TEXT_FORMATS: dict[str, tuple[int, Layout]] = {
    "mask": (3, _mask_slot),
    "answer_segment": (4, _answer_segment),
    "question": (2, _question),
}


def mirrored_answers(example: Any) -> Any:
    """The example with its answers as they read of the mirrored image (`mirror_words`): the fields the
    readers keep answers in -- VQA's ten `answers` and `multiple_choice_answer`, LXMERT's `label` keys,
    GQA's `answer` -- whichever the example has."""
    changes: dict[str, Any] = {}
    for name in ("answers", "multiple_choice_answer", "label", "answer"):
        value = getattr(example, name, None)
        if isinstance(value, str):
            changes[name] = mirror_words(value)
        elif isinstance(value, list):
            changes[name] = [mirror_words(a) for a in value]
        elif isinstance(value, dict):
            changes[name] = {mirror_words(a): score for a, score in value.items()}
    return replace(example, **changes)


def detector_tag_subwords(classes: Sequence[str], tok: TextTokenizer) -> tuple[tuple[int, ...], ...]:
    """W-VisualBERT tags (§3.2): class c -> the subwords of its name, the vocabulary line's first synonym
    (as the released code and `vlberts pretrain` build them)."""
    return tuple(tuple(tok.encode(c.split(",")[0])) for c in classes)


def model_tag_subwords(reads_tags: bool, regions: Any, tok: TextTokenizer) -> tuple[tuple[int, ...], ...] | None:
    """The detector tags a task model's batches carry: None for a model that reads none, else
    `detector_tag_subwords` of the region store's class names (an error naming the store without them)."""
    if not reads_tags:
        return None
    classes = getattr(getattr(regions, "metadata", None), "classes", None)
    if not classes:
        raise VlbertsError("this W-VisualBERT reads detector tags, which need the store's class names "
                           "(metadata classes) and obj_id", path=getattr(regions, "path", None))
    return detector_tag_subwords(classes, tok)


class VQAData:
    """Indexable QA examples; targets are `target(example, vocab)` (None for unannotated questions).

    text_format: a `TEXT_FORMATS` name; tag_subwords: with it, each example also carries its regions'
    detector tags (`detector_tag_subwords`), read from the source's `obj_id`. An item's `question_id` is
    the example's id when it is an int (VQA) and its position otherwise (GQA's string ids), so that
    batches hold it as a tensor; `predict_qa` maps predictions back by position. flip_prob: a training
    item (keyed (epoch, index), as the samplers give them) is mirrored with this probability (`data.mirror.Flip`,
    seeded by `seed`); an item asked for by index alone never is."""

    def __init__(
        self,
        examples: Sequence[Any],
        regions: RegionSource,
        tokenizer: TextTokenizer,
        vocab: AnswerVocab,
        *,
        max_text_len: int = 32,
        max_regions: int = 36,
        feature_dim: int | None = None,
        text_format: str = "mask",
        tag_subwords: Sequence[Sequence[int]] | None = None,
        target: Target | None = None,
        float16: bool = False,
        flip_prob: float = 0.0,
        seed: int = 0,
    ):
        if text_format not in TEXT_FORMATS:
            raise ValueError(f"unknown text_format {text_format!r}; valid: {', '.join(TEXT_FORMATS)}")
        self.examples = examples
        self.regions = regions
        self.tok = tokenizer
        self.vocab = vocab
        self.max_regions = max_regions
        self.feature_dim = feature_dim
        self.float16 = float16
        self.tag_subwords = tag_subwords
        specials, layout = TEXT_FORMATS[text_format]
        budget = max_text_len - specials
        encs = tokenizer.tok.encode_batch([e.question for e in examples], add_special_tokens=False)
        self.ids, self.segments, self.answer_pos = [], [], []
        for e in encs:
            ids, segments, pos = layout(e.ids[-budget:], tokenizer)
            self.ids.append(ids)
            self.segments.append(segments)
            self.answer_pos.append(pos)
        target = target or vqa_soft_target
        self.targets: list[SoftTarget | None] = [target(e, vocab) if e.annotated else None for e in examples]
        self.flip = Flip(flip_prob, seed, tokenizer)
        # index -> the target of the mirrored answers, where mirroring changes an answer
        self.mirrored_targets: dict[int, SoftTarget] = {}
        for i, e in enumerate(examples if flip_prob else ()):
            m = mirrored_answers(e) if e.annotated else e
            if m != e:
                self.mirrored_targets[i] = target(m, vocab)

    def __len__(self) -> int:
        return len(self.examples)

    def lengths(self) -> np.ndarray:
        """(N, 2) each example's regions and tokens (`length_keys`), for length-grouped batches."""
        regions = region_counts(self.regions, [e.image_id for e in self.examples], self.max_regions)
        return length_keys(regions, [len(ids) for ids in self.ids])

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        index = key[1] if isinstance(key, tuple) else key
        ex = self.examples[index]
        ids, target = self.ids[index], self.targets[index]
        regions = load_regions(self.regions, ex.image_id, self.max_regions, self.feature_dim, self.float16)
        if self.flip.drawn(key):
            ids, target, regions = self.flip.swap(ids), self.mirrored_targets.get(index, target), mirrored(regions)
        item = {
            "ids": ids,
            "segments": self.segments[index],
            "answer_pos": self.answer_pos[index],
            "target": target,
            "question_id": ex.question_id if isinstance(ex.question_id, int) else index,
            "regions": regions,
        }
        if self.tag_subwords is not None:
            item["tags"] = self._tags(ex.image_id, len(item["regions"].feats))
        return item

    def _tags(self, image_id: str | int, n: int) -> tuple[list[int], list[int]]:
        """The detector tags of the image's first n regions: (subword ids, region of each subword)."""
        return tag_tokens(detected_classes(self.regions, image_id)[:n], self.tag_subwords)


def collate_vqa(examples: list[dict], num_answers: int, pad_id: int = 0) -> VQABatch:
    ids = pad_sequences([e["ids"] for e in examples], pad_id)  # (B, T)
    feats, boxes, rmask = pad_regions([e["regions"] for e in examples])
    empty = SoftTarget((), ())
    return VQABatch(
        inputs=VLInputs(
            input_ids=ids,
            token_type_ids=pad_sequences([e["segments"] for e in examples], 0),  # (B, T)
            attention_mask=pad_sequences([np.ones(len(e["ids"]), dtype=np.int64) for e in examples], 0).bool(),
            region_feats=feats,
            region_boxes=boxes,
            region_mask=rmask,
        ),
        targets=dense_targets([e["target"] or empty for e in examples], num_answers),
        question_ids=torch.tensor([e["question_id"] for e in examples], dtype=torch.long),
        answer_pos=torch.tensor([e["answer_pos"] for e in examples], dtype=torch.long),
        tags=collate_tags([e["tags"] for e in examples], pad_id) if "tags" in examples[0] else None,
    )
