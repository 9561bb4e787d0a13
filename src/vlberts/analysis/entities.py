"""From annotated captions, a region store and a model to the per-caption inputs of the grounding analysis.

The analysis itself (`grounding.py`) is pure numbers; this module is the driver around it:

    Flickr30K Entities captions ─ entity_captions ─> EntityCaption (subword ids, entity positions, gold boxes)
    EntityCaption + regions + model ─ grounding_inputs ─> GroundingInput (attention text -> regions per head)

The model sees `[CLS] caption [SEP]` and the image's regions, exactly as in pre-training's single-caption
form; the paper analyses the pre-trained model "before fine-tuning on any task" (§3, footnote 2).

Which entities are analysed (reference §4 and BAN/VisualBERT's Flickr30K reader): phrases of the null
chain (notvisual), phrases whose chain has no box (`nobndbox`, `scene`-only) and phrases cut off by the
text budget are left out and counted, so a report can say how many were skipped and why.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from vlberts.analysis.grounding import GroundingEntity, GroundingInput
from vlberts.analysis.syntactic import ParseMismatch, check_parse_words
from vlberts.data.conllu import ConlluSentence
from vlberts.data.flickr_entities import FlickrEntitiesImage
from vlberts.data.regions import (
    FetchedRecord,
    RegionSource,
    caption_inputs,
    detected_tags,
    length_order,
    load_regions,
)
from vlberts.errors import VlbertsError
from vlberts.models.outputs import AttentionMaps
from vlberts.text.tokenizer import TextTokenizer


@dataclass
class EntityCaption:
    """One caption ready for the model: `[CLS] words [SEP]` ids and its grounded entities."""

    image_id: str
    caption_id: str  # "<image id>_<line>" (the CoNLL-U sent_id convention of the world)
    words: tuple[str, ...]
    ids: list[int]  # [CLS] subwords [SEP]
    word_tokens: list[list[int]]  # word index -> positions in `ids` ([CLS] offset included)
    entities: list[GroundingEntity]
    entity_words: list[tuple[int, int]]  # per entity: (first word index, one past the last)


@dataclass
class SkipCounts:
    """What an analysis could not use (phrases, captions), by reason, with the first one of each reason
    (e.g. "caption 6_0: the man") for the warning line that names it."""

    counts: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)

    def add(self, reason: str, n: int = 1, example: str = "") -> None:
        self.counts[reason] += n
        if example:
            self.first.setdefault(reason, example)

    def to_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))

    def warning(self, what: str, source: str, reasons: Collection[str] | None = None) -> str:
        """One line for stderr counting the skipped `what` of `reasons` (default: all) read from `source`, each
        reason with its first example, or "" when there are none."""
        shown = {k: n for k, n in sorted(self.counts.items()) if reasons is None or k in reasons}
        if not shown:
            return ""
        parts = ", ".join(f"{k}: {n}" + (f" (first: {self.first[k]})" if k in self.first else "") for k, n in shown.items())
        return f"warning: {source}: skipped {sum(shown.values())} {what} ({parts})"


def entity_captions(
    images: Iterable[FlickrEntitiesImage], tok: TextTokenizer, max_text_len: int = 64, skipped: SkipCounts | None = None
) -> list[EntityCaption]:
    """Tokenise every caption, keeping each word's subword positions, and attach each grounded phrase.

    Captions longer than `max_text_len` subwords (with [CLS]/[SEP]) are cut at the end; phrases that
    lose a word to the cut are skipped as "truncated".
    """
    skipped = skipped if skipped is not None else SkipCounts()
    out = []
    for im in images:
        for cap in im.captions:
            enc = tok.encode_words(list(cap.words))
            keep = max_text_len - 2
            ids = [tok.cls_id, *enc.ids[:keep], tok.sep_id]
            word_tokens = [[p + 1 for p in w if p < keep] for w in enc.word_tokens]  # +1 for [CLS]
            entities, spans = [], []
            for gp in cap.phrases:
                p = gp.phrase
                if p.chain_id == 0:
                    skipped.add("notvisual")
                    continue
                if not gp.boxes:
                    skipped.add("scene" if gp.is_scene else "no box",
                                example=f"caption {cap.image_id}_{cap.index}, chain {p.chain_id} {p.text!r}")
                    continue
                words = [word_tokens[i] for i in range(p.first_word_index, p.end)]
                if any(len(w) == 0 for w in words):
                    skipped.add("truncated")
                    continue
                entities.append(GroundingEntity(
                    word_tokens=words,
                    gold_boxes=np.asarray(gp.boxes, dtype=np.float64),
                    caption_id=f"{cap.image_id}_{cap.index}",
                    chain_id=str(p.chain_id),
                    phrase=p.text,
                    types=tuple(p.types),
                ))
                spans.append((p.first_word_index, p.end))
            out.append(EntityCaption(cap.image_id, f"{cap.image_id}_{cap.index}", cap.words, ids, word_tokens, entities, spans))
    return out


def _parse_fits(sentence: ConlluSentence, words: Sequence[str]) -> bool:
    try:
        check_parse_words(sentence, words)
    except ParseMismatch:
        return False
    return True


def mask_words_by_pos(
    captions: list[EntityCaption], parses: dict[str, ConlluSentence], pos: Iterable[str], mask_id: int,
) -> tuple[list[EntityCaption], int, int]:
    """Each caption with every subword of its words whose part of speech (the UPOS column of its parse)
    is in `pos` replaced by [MASK]: where a word's attention goes when the model has to predict that word,
    as in pre-training, rather than read it (`vlberts analyze grounding --mask_pos`, a diagnostic; the
    paper analyses unmasked captions). The words themselves are kept, so the parse still matches them.
    A caption without a parse of its words is left out: masked and unmasked captions would mix.
    Returns (the masked captions, the number of words masked, the number of captions left out)."""
    pos = frozenset(pos)
    out: list[EntityCaption] = []
    masked, left_out = 0, 0
    for cap in captions:
        sentence = parses.get(cap.caption_id)
        if sentence is None or not _parse_fits(sentence, cap.words):
            left_out += 1
            continue
        ids = list(cap.ids)
        for token, positions in zip(sentence.tokens, cap.word_tokens):
            if token.upos in pos and positions:
                masked += 1
                for p in positions:
                    ids[p] = mask_id
        out.append(replace(cap, ids=ids))
    return out, masked, left_out


def region_confidence(record, path: object = None) -> np.ndarray:
    """(N,) detection confidence of each region, for the most-confident-region baseline (§3.1).

    The detector's `obj_conf` when the store has it (LXMERT TSVs, world stores); otherwise the best
    non-background class probability of `cls_prob` (column 0 is background). BUTD 6-field TSVs carry
    neither, and then no baseline can be computed.
    """
    if getattr(record, "obj_conf", None) is not None:
        return np.asarray(record.obj_conf, dtype=np.float64)
    if getattr(record, "cls_prob", None) is not None:
        return np.asarray(record.cls_prob, dtype=np.float64)[:, 1:].max(axis=1)
    raise VlbertsError(
        "the store has no detection confidences (obj_conf or cls_prob), which the most-confident-region "
        "baseline needs; import features that carry them (e.g. an LXMERT TSV), or pass --baseline=none to "
        "analyse without the baseline",
        path=path,
        record=f"image {record.image_id}",
    )


@torch.no_grad()
def attention_batches(
    model: torch.nn.Module,
    captions: list[EntityCaption],
    regions: RegionSource,
    *,
    max_regions: int = 36,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    tag_subwords: Sequence[Sequence[int]] | None = None,
) -> Iterator[tuple[list[EntityCaption], list, list, AttentionMaps]]:
    """Run the model on `captions`, `batch_size` at a time, with their images and yield, per batch, the
    captions, their store records, their loaded regions (`load_regions`) and every attention map of the
    forward pass (`model.encode(x, need_attn=True, maps_only=True).attentions`: no hidden states, so a
    single-stream model stops its last layer at the attention probabilities). Row b of each map is caption b, padded
    to the batch's longest caption and region count: callers slice with `len(caption.ids)` and
    `len(regions[b].feats)`. Shared by the grounding analysis and the attention graphs.

    `tag_subwords` (W-VisualBERT with tags: `vqa_dataset.model_tag_subwords`): each image's detector tags
    join its regions, unmasked, as in fine-tuning; the model was pre-trained with tags beside every image
    and has never seen an image without them. The maps' region columns stay the regions' (`region_index`).

    Batches hold captions of similar length (ordered by subwords, then regions; `length_order`), not
    the split's order: a batch is padded to its longest caption and its image with the most regions,
    and in split order a third of the rows the model computes are padding (1,000-image world: 151,104
    rows for 112,963 real ones; in length order 117,384). Callers must not depend on the order.
    """
    model.eval()
    feature_dim = model.cfg.visual_dim
    order = length_order(captions, regions, max_regions)
    for start in range(0, len(captions), batch_size):
        chunk = [captions[i] for i in order[start : start + batch_size]]
        recs = [regions.get(c.image_id) for c in chunk]
        path = getattr(regions, "path", None)
        regs = [load_regions(FetchedRecord(r, path), c.image_id, max_regions, feature_dim) for c, r in zip(chunk, recs)]
        x = caption_inputs([c.ids for c in chunk], regs).to(device)
        if tag_subwords is None:
            maps = model.encode(x, need_attn=True, maps_only=True).attentions
        else:
            tags = detected_tags(recs, [c.image_id for c in chunk], regs, tag_subwords, path).to(device)
            maps = model.encode(x, need_attn=True, tags=tags, maps_only=True).attentions
        if maps is None:
            raise VlbertsError(f"the model returned no attention maps for need_attn=True ({type(model).__name__})")
        yield chunk, recs, regs, maps


@torch.no_grad()
def grounding_inputs(
    model: torch.nn.Module,
    captions: list[EntityCaption],
    regions: RegionSource,
    *,
    max_regions: int = 36,
    batch_size: int = 64,
    device: torch.device | str = "cpu",
    tag_subwords: Sequence[Sequence[int]] | None = None,
    text_maps: bool = False,
    baseline: bool = True,
) -> Iterator[tuple[EntityCaption, GroundingInput]]:
    """Run the model on each caption with its image and yield the caption with its `GroundingInput`.

    `model.encode(x, need_attn=True)` must return a `VLOutput` whose `attentions.text_to_region()` is
    (L, B, H, T, R): the joint map's text rows and region columns for single-stream models, the
    text-to-vision maps for two-stream ones. Captions without entities are not run; the others come in
    `attention_batches`' length order, not the split's. `tag_subwords`: W-VisualBERT's tags, as there.
    `text_maps`: also hand over the text-to-text maps (`GroundingInput.text_attn`). `baseline`: read each region's
    detection confidence for the most-confident-region baseline (False: none, and the baseline is NaN).

    For VisualBERT without early fusion (`cfg.fusion_layer` > 0) the layers before the fusion layer do
    not see the regions; `text_to_region()` gives them zero attention, so their heads keep their place in
    the (L, H) grid (comparable with the full model's) with zero region mass and no hits.
    """
    work = [c for c in captions if c.entities]
    path = getattr(regions, "path", None)
    for chunk, recs, regs, maps in attention_batches(model, work, regions, max_regions=max_regions,
                                                     batch_size=batch_size, device=device, tag_subwords=tag_subwords):
        t2r = maps.text_to_region().float().cpu().numpy()  # (L, B, H, T, R)
        t2t = maps.text_to_text().float().cpu().numpy() if text_maps else None  # (L', B, H, T, T)
        for b, (cap, rec, reg) in enumerate(zip(chunk, recs, regs)):
            n = len(reg.feats)
            conf = region_confidence(rec, path)[:n] if baseline else None
            yield cap, GroundingInput(
                attn=t2r[:, b, :, : len(cap.ids), :n],  # (L, H, T_b, R_b): drop padding
                region_boxes=reg.pixel_boxes.astype(np.float64),
                region_conf=conf,
                entities=cap.entities,
                maps=maps.describe() + ("; detector tags in the input beside the regions, not counted as regions"
                                        if tag_subwords is not None else ""),
                text_attn=None if t2t is None else t2t[:, b, :, : len(cap.ids), : len(cap.ids)],
            )
