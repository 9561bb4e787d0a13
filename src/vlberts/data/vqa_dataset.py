"""VQA examples as model inputs: `[CLS] question [MASK] [SEP]` + regions (VisualBERT App. B.1).

The answer is read off the [MASK] slot appended after the question, as in the original VisualBERT
VQA data loader (its `no_next_sentence` setting).
"""

from __future__ import annotations

import numpy as np
import torch

from vlberts.data.batch import VLInputs, VQABatch
from vlberts.data.regions import RegionSource, load_regions, pad_regions, pad_sequences
from vlberts.data.vqa import VQAExample
from vlberts.tasks.vqa import AnswerVocab, SoftTarget, dense_targets, soft_target
from vlberts.text.tokenizer import TextTokenizer


class VQAData:
    """Indexable VQA examples; targets are soft scores over `vocab` (empty for unannotated questions)."""

    def __init__(
        self,
        examples: list[VQAExample],
        regions: RegionSource,
        tokenizer: TextTokenizer,
        vocab: AnswerVocab,
        *,
        max_text_len: int = 32,
        max_regions: int = 36,
        feature_dim: int | None = None,
    ):
        self.examples = examples
        self.regions = regions
        self.tok = tokenizer
        self.vocab = vocab
        self.max_regions = max_regions
        self.feature_dim = feature_dim
        budget = max_text_len - 3  # [CLS], [MASK], [SEP]
        encs = tokenizer.tok.encode_batch([e.question for e in examples], add_special_tokens=False)
        self.ids = [[tokenizer.cls_id, *e.ids[-budget:], tokenizer.mask_id, tokenizer.sep_id] for e in encs]
        self.targets: list[SoftTarget | None] = [
            soft_target(e.answers, vocab) if e.annotated else None for e in examples
        ]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        index = key[1] if isinstance(key, tuple) else key
        ex = self.examples[index]
        return {
            "ids": self.ids[index],
            "target": self.targets[index],
            "question_id": ex.question_id,
            "regions": load_regions(self.regions, ex.image_id, self.max_regions, self.feature_dim),
        }


def collate_vqa(examples: list[dict], num_answers: int, pad_id: int = 0) -> VQABatch:
    ids = pad_sequences([e["ids"] for e in examples], pad_id)  # (B, T)
    feats, boxes, rmask = pad_regions([e["regions"] for e in examples])
    lengths = torch.tensor([len(e["ids"]) for e in examples])
    empty = SoftTarget((), ())
    return VQABatch(
        inputs=VLInputs(
            input_ids=ids,
            token_type_ids=torch.zeros_like(ids),
            attention_mask=pad_sequences([np.ones(len(e["ids"]), dtype=np.int64) for e in examples], 0).bool(),
            region_feats=feats,
            region_boxes=boxes,
            region_mask=rmask,
        ),
        targets=dense_targets([e["target"] or empty for e in examples], num_answers),
        question_ids=torch.tensor([e["question_id"] for e in examples], dtype=torch.long),
        answer_pos=lengths - 2,  # the [MASK] before the final [SEP]
    )
