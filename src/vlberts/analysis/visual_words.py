"""Does the image help masked language modelling? A probe on visual words.

For every caption and every occurrence of a word from `words` (in the world: colour and shape words),
mask all of that word's subwords and ask the pre-trained MLM head to fill them in, given
`[CLS] caption [SEP]` and the image's regions. A prediction counts when every subword is recovered.
Running the same probe with the region features zeroed (boxes kept) measures how much of that
accuracy comes from the image rather than from the text (SPEC §7: "image-conditioned MLM beats
text-only MLM on visual words").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vlberts.data.coco import CaptionRef
from vlberts.data.regions import FetchedRecord, RegionSource, caption_inputs, detected_tags, length_order, load_regions
from vlberts.recipes.common import resolve_device
from vlberts.text.tokenizer import TextTokenizer


@dataclass(frozen=True)
class ProbeItem:
    image_id: str
    ids: list[int]  # [CLS] caption [SEP] with one word's subwords replaced by [MASK]
    positions: list[int]  # the masked positions
    targets: list[int]  # their original ids
    word: str


def probe_items(captions: Iterable[CaptionRef], tok: TextTokenizer, words: set[str], max_text_len: int = 48) -> list[ProbeItem]:
    """One item per occurrence of a probe word (captions are split on whitespace into words)."""
    items = []
    for cap in captions:
        split = cap.text.split()
        enc = tok.encode_words(split)
        ids = [tok.cls_id, *enc.ids, tok.sep_id]
        if len(ids) > max_text_len:
            continue
        for w, positions in zip(split, enc.word_tokens):
            if w.lower() not in words or not positions:
                continue
            pos = [p + 1 for p in positions]  # +1 for [CLS]
            masked = list(ids)
            for p in pos:
                masked[p] = tok.mask_id
            items.append(ProbeItem(cap.image_id, masked, pos, [ids[p] for p in pos], w.lower()))
    return items


@torch.no_grad()
def visual_word_accuracy(
    model: torch.nn.Module,
    items: list[ProbeItem],
    regions: RegionSource,
    *,
    zero_regions: bool = False,
    max_regions: int = 36,
    batch_size: int = 256,
    device: str = "auto",
    tag_subwords: Sequence[Sequence[int]] | None = None,
) -> dict[str, float]:
    """Accuracy (percent) of the pre-training model's MLM head on the probe items, overall and per word.

    `tag_subwords` (W-VisualBERT with tags: `vqa_dataset.model_tag_subwords`): the image's detector tags
    join its regions, as in pre-training and fine-tuning. With `zero_regions` they are left out too: the
    tags are read off the image, so a probe without the image has neither."""
    dev = resolve_device(device)
    model.to(dev).eval()
    correct = np.zeros(len(items), dtype=bool)
    feature_dim = model.cfg.visual_dim
    # Batches of similar length (`length_order`): in the given order half of what the demo's probe
    # computed was padding. Each item's prediction is its own row's, so the order changes no number.
    order = length_order(items, regions, max_regions)
    for start in range(0, len(items), batch_size):
        index = order[start : start + batch_size]
        chunk = [items[i] for i in index]
        path = getattr(regions, "path", None)
        recs = [regions.get(it.image_id) for it in chunk]  # each record read once
        regs = [load_regions(FetchedRecord(r, path), it.image_id, max_regions, feature_dim) for r, it in zip(recs, chunk)]
        x = caption_inputs([it.ids for it in chunk], regs)
        if zero_regions:
            x.region_feats = torch.zeros_like(x.region_feats)
        x = x.to(dev)
        # The MLM head runs at the masked words only (as in pre-training: `mlm_positions`), which also
        # lets VisualBERT and LXMERT compute their last layer for those rows alone.
        masked = torch.zeros(x.input_ids.shape, dtype=torch.bool)  # (B, T)
        for row, it in enumerate(chunk):
            masked[row, list(it.positions)] = True
        extra = {}
        if tag_subwords is not None and not zero_regions:
            extra["tags"] = detected_tags(recs, [it.image_id for it in chunk], regs, tag_subwords, path).to(dev)
        logits = model(x, mlm_positions=masked.to(dev), **extra).mlm_logits  # (N, V), row-major over `masked`
        pred = iter(logits.argmax(-1).tolist())
        for i, it in zip(index, chunk):
            # Row-major order: an item's positions come out sorted.
            got = dict(zip(sorted(it.positions), (next(pred) for _ in it.positions)))
            correct[i] = all(got[p] == t for p, t in zip(it.positions, it.targets))
    per_word: dict[str, list[bool]] = {}
    for it, c in zip(items, correct):
        per_word.setdefault(it.word, []).append(bool(c))
    return {
        "accuracy": 100.0 * float(correct.mean()) if len(items) else float("nan"),
        "n": len(items),
        "per_word": {w: 100.0 * float(np.mean(v)) for w, v in sorted(per_word.items())},
    }
