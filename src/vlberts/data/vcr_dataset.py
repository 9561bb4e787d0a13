"""VCR examples as model inputs: 4 sequences per question (one per choice) over the question's objects.

Text (VisualBERT §4.2, VL-BERT §4.2.1, ViLBERT §4; the same for every architecture here): choice c of a
question is ``[CLS] context [SEP] choice_c [SEP]``, the context in segment 0 and the choice in segment 1,
where for Q->A the context is the question and the choices the answers, and for QA->R the context is the
question followed by the *right* answer (`data.vcr.rationale_context`) and the choices the rationales.
When too long, the context loses its first subwords and the choice is kept whole (our choice; the
released loaders truncate in their own ways).

Object references become words (`data.vcr.render_tokens`): a person a gender-neutral name, anything else
its class name. Multi-object references: VisualBERT (r2c's loader) writes the names side by side
(``join="separate"``); VL-BERT joins them with "and"; ViLBERT, LXMERT and W-VisualBERT (no VCR loader, or
none reported) use "and" too -- our choice (`JOIN`).

Regions: VCR's detections are the question's objects, so the regions of an example are exactly the
record's ``objects``, region k = object k (`object_regions`):
  ``gold``  the store holds, for the image, exactly one region per object in object order (a store
            extracted for the objects' own boxes: ``vlberts extract --boxes=gold``), as VCR's detector runs
            on the given boxes;
  ``iou``   the store holds detector proposals (the usual store); object k gets the stored region with the
            highest IoU with its metadata box (VCR's ``metadata_fn``), that region's feature and box. Our
            approximation of "features of the given box" when no gold-box store exists.
VisualBERT/r2c also add the whole image as a box; we do not (VL-BERT's encoder adds its own whole-image
element).

Word-region alignment (VisualBERT §3.2/App. A: `VLInputs.image_text_alignment`): for region k, the
sequence positions of the subwords of every word that refers to object k, padded with -1. VisualBERT reads
it (on by default); VL-BERT with `--alignment=true` gives those words region k's visual feature embedding,
as its released VCR code does (`models.vcr.ALIGNING`); the others get names only.

Mirrored training questions (`flip_prob`, VL-BERT's `FLIP_PROB`, 0.5 in its VCR configs; `data.mirror`): the
objects' boxes flipped left-right and "left" / "right" swapped in all four choices' text (context and choice);
the label, the alignment positions and the object classes stay. The release's `vcr.py` flips the image and its
boxes but not the words, so that a mirrored "the man on the left" names the other side; here the text is
mirrored as its VQA and RefCOCO+ loaders mirror it (our choice).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from vlberts.data.batch import Batch, TagInputs, VLInputs
from vlberts.data.mirror import Flip
from vlberts.data.regions import Regions, RegionSource, detected_classes, length_keys, mirrored, pad_regions, pad_sequences
from vlberts.data.vcr import NUM_CHOICES, VCRExample, rationale_context, read_vcr_metadata, render_tokens
from vlberts.errors import VlbertsError
from vlberts.features.record import as_float32
from vlberts.models.wvisualbert import collate_tags, tag_tokens
from vlberts.text.tokenizer import TextTokenizer

MODES = ("qa", "qar")  # Q->A, QA->R
IGNORE = -100  # an object label no loss reads (cross_entropy's ignore_index)
OBJECT_REGIONS = ("iou", "gold")
# architecture -> how a multi-object reference is rendered (module docstring)
JOIN = {"visualbert": "separate", "vlbert": "and", "vilbert": "and", "lxmert": "and", "wvisualbert": "and"}


def box_iou(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(N, 4) x (M, 4) xyxy -> (N, M) intersection over union."""
    lt = np.maximum(a[:, None, :2], b[None, :, :2])
    rb = np.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = np.clip(rb - lt, 0, None).prod(-1)
    area = lambda x: (x[:, 2] - x[:, 0]) * (x[:, 3] - x[:, 1])  # noqa: E731
    return inter / np.maximum(area(a)[:, None] + area(b)[None, :] - inter, 1e-9)


def vcr_text(example: VCRExample, mode: str, choice: int) -> tuple[tuple, tuple]:
    """(context tokens, choice tokens) of choice `choice` in `mode` ("qa" or "qar")."""
    if mode == "qa":
        return example.question, example.answer_choices[choice]
    return rationale_context(example), example.rationale_choices[choice]


def layout_choice(
    context: tuple, choice: tuple, objects: Sequence[str], tok: TextTokenizer, *, join: str, max_text_len: int
) -> tuple[list[int], list[int], list[list[int]]]:
    """``[CLS] context [SEP] choice [SEP]``: (ids, segments, per object the positions of its words' subwords)."""
    ctx, ch = render_tokens(context, objects, join=join), render_tokens(choice, objects, join=join)  # type: ignore[arg-type]
    e_ctx, e_ch = tok.encode_words(list(ctx.words)), tok.encode_words(list(ch.words))
    keep = max(0, max_text_len - 3 - len(e_ch.ids))
    if len(e_ch.ids) + 3 > max_text_len:
        raise ValueError(f"a choice of {len(e_ch.ids)} subwords does not fit max_text_len {max_text_len}")
    drop = max(0, len(e_ctx.ids) - keep)  # context subwords cut from the front
    ids = [tok.cls_id, *e_ctx.ids[drop:], tok.sep_id, *e_ch.ids, tok.sep_id]
    segments = [0] * (len(e_ctx.ids) - drop + 2) + [1] * (len(e_ch.ids) + 1)
    align: list[list[int]] = [[] for _ in objects]
    for refs, subs in zip(ctx.refs, e_ctx.word_tokens):
        for obj in refs:
            align[obj].extend(1 + p - drop for p in subs if p >= drop)
    base = len(e_ctx.ids) - drop + 2
    for refs, subs in zip(ch.refs, e_ch.word_tokens):
        for obj in refs:
            align[obj].extend(base + p for p in subs)
    return ids, segments, align


@dataclass
class VCRBatch(Batch):
    """B questions x 4 choices: the choices' sequences flattened question-major, (B*4, ...)."""

    inputs: VLInputs  # (B*4, T) text, (B*4, R, D) regions (each question's repeated 4 times)
    labels: Tensor  # (B,) long, the right choice, -1 when unknown (test)
    index: Tensor  # (B,) long, the examples' positions in the dataset
    tags: TagInputs | None = None  # W-VisualBERT's detector tags, (B*4, L)
    object_labels: Tensor | None = None  # (B, R) long: each region's object class, -100 for padding or unknown


class VCRData:
    """Indexable VCR questions of one mode as 4 laid-out choices + the objects' regions (module docstring).

    metadata_dir: where the records' ``metadata_fn`` files are (object boxes for ``iou``). flip_prob: a training
    item (keyed (epoch, index)) is mirrored with this probability (module docstring, `data.mirror.Flip`)."""

    def __init__(
        self, examples: Sequence[VCRExample], mode: str, regions: RegionSource, tokenizer: TextTokenizer, *,
        join: str = "separate", max_text_len: int = 80, feature_dim: int | None = None,
        object_regions: str = "iou", metadata_dir: str | Path | None = None,
        tag_subwords: Sequence[Sequence[int]] | None = None, float16: bool = False,
        object_classes: Mapping[str, int] | None = None, flip_prob: float = 0.0, seed: int = 0,
    ):
        if mode not in MODES:
            raise VlbertsError(f"unknown VCR mode {mode!r}; valid: {', '.join(MODES)}")
        if object_regions not in OBJECT_REGIONS:
            raise VlbertsError(f"unknown object_regions {object_regions!r}; valid: {', '.join(OBJECT_REGIONS)}")
        if object_regions == "iou" and metadata_dir is None:
            raise VlbertsError("object_regions=iou needs the metadata directory (the objects' boxes)")
        self.examples, self.mode, self.regions, self.tok = examples, mode, regions, tokenizer
        self.feature_dim, self.object_regions, self.tag_subwords = feature_dim, object_regions, tag_subwords
        self.float16, self.object_classes = float16, object_classes
        self.metadata_dir = Path(metadata_dir) if metadata_dir is not None else None
        self.flip = Flip(flip_prob, seed, tokenizer)
        self.choices = []  # per example: 4 x (ids, segments, alignment)
        for ex in examples:
            self.choices.append([layout_choice(*vcr_text(ex, mode, c), ex.objects, tokenizer, join=join,
                                               max_text_len=max_text_len) for c in range(NUM_CHOICES)])
        self.labels = [(ex.answer_label if mode == "qa" else ex.rationale_label) for ex in examples]

    def __len__(self) -> int:
        return len(self.examples)

    def lengths(self) -> np.ndarray:
        """(N, 2) each question's objects (its regions) and its longest choice's tokens (`length_keys`), for
        length-grouped batches."""
        return length_keys([len(ex.objects) for ex in self.examples], [max(len(c[0]) for c in cs) for cs in self.choices])

    def object_regions_of(self, ex: VCRExample) -> tuple[Regions, np.ndarray]:
        """The regions of the example's objects (region k = object k) and the store rows they came from."""
        store_path = getattr(self.regions, "path", None)
        rec = self.regions.get(ex.img_id)  # a missing image: VlbertsError naming the store and the id
        n = len(ex.objects)
        if self.object_regions == "gold":
            if len(rec.boxes) != n:
                raise VlbertsError(f"object_regions=gold needs one stored region per object: image {ex.img_id} has "
                                   f"{len(rec.boxes)} regions for {n} objects", path=store_path, record=ex.annot_id)
            rows = np.arange(n)
        else:
            meta_path = self.metadata_dir / ex.metadata_fn  # type: ignore[operator]
            meta = read_vcr_metadata(meta_path)
            if len(meta.boxes) != n:
                raise VlbertsError(f"metadata has {len(meta.boxes)} boxes for {n} objects", path=meta_path,
                                   record=ex.annot_id)
            sx, sy = rec.image_w / meta.width, rec.image_h / meta.height  # store pixels per metadata pixel
            boxes = np.asarray(meta.boxes, dtype=np.float64) * np.array([sx, sy, sx, sy])
            rows = box_iou(boxes, np.asarray(rec.boxes, dtype=np.float64)).argmax(1)  # (n,)
        feats = np.asarray(rec.features)[rows]  # (n, D)
        feats = feats if self.float16 and feats.dtype == np.float16 else as_float32(feats)
        if self.feature_dim is not None and feats.shape[1] != self.feature_dim:
            raise VlbertsError(f"region features are {feats.shape[1]}-d but the model expects {self.feature_dim}-d "
                               f"(visual_dim)", path=store_path, record=f"image {ex.img_id}")
        pix = np.asarray(rec.boxes, dtype=np.float32)[rows]  # (n, 4)
        scale = np.array([rec.image_w, rec.image_h, rec.image_w, rec.image_h], dtype=np.float32)
        return Regions(feats=feats, boxes=np.clip(pix / scale, 0.0, 1.0), pixel_boxes=pix, conf=None,
                       image_w=rec.image_w), rows

    def __getitem__(self, key: int | tuple[int, int]) -> dict:
        index = key[1] if isinstance(key, tuple) else key
        ex = self.examples[index]
        regions, rows = self.object_regions_of(ex)
        choices = self.choices[index]
        if self.flip.drawn(key):
            choices = [(self.flip.swap(ids), segments, align) for ids, segments, align in choices]
            regions = mirrored(regions)
        item = {"choices": choices, "regions": regions, "index": index,
                "label": -1 if self.labels[index] is None else self.labels[index]}
        if self.tag_subwords is not None:
            obj_id = detected_classes(self.regions, ex.img_id, record=ex.annot_id)
            item["tags"] = tag_tokens(obj_id[rows], self.tag_subwords)
        if self.object_classes is not None:  # region k's class is object k's (VL-BERT §4.2.1's second loss)
            item["object_labels"] = [self.object_classes.get(name, IGNORE) for name in ex.objects]
        return item


def collate_vcr(items: list[dict], pad_id: int = 0, alignment: bool = True) -> VCRBatch:
    """Stack B questions into (B*4)-row inputs; with `alignment`, VisualBERT's word-region alignment."""
    seqs = [c for it in items for c in it["choices"]]  # B*4 (ids, segments, align), question-major
    feats, boxes, rmask = pad_regions([it["regions"] for it in items for _ in range(NUM_CHOICES)])  # (B*4, R, .)
    align = None
    if alignment:
        R = feats.shape[1]
        K = max(1, max((len(p) for _, _, a in seqs for p in a), default=1))
        align = torch.full((len(seqs), R, K), -1, dtype=torch.long)  # (B*4, R, K)
        for s, (_, _, a) in enumerate(seqs):
            for k, positions in enumerate(a):
                if positions:
                    align[s, k, : len(positions)] = torch.tensor(positions)
    tags = None
    if "tags" in items[0]:
        tags = collate_tags([it["tags"] for it in items for _ in range(NUM_CHOICES)], pad_id)
    object_labels = None
    if "object_labels" in items[0]:
        object_labels = torch.full((len(items), feats.shape[1]), IGNORE, dtype=torch.long)  # (B, R)
        for b, it in enumerate(items):
            object_labels[b, : len(it["object_labels"])] = torch.tensor(it["object_labels"], dtype=torch.long)
    return VCRBatch(
        inputs=VLInputs(
            input_ids=pad_sequences([ids for ids, _, _ in seqs], pad_id),  # (B*4, T)
            token_type_ids=pad_sequences([seg for _, seg, _ in seqs], 0),
            attention_mask=pad_sequences([np.ones(len(ids), dtype=np.int64) for ids, _, _ in seqs], 0).bool(),
            region_feats=feats, region_boxes=boxes, region_mask=rmask, image_text_alignment=align,
        ),
        labels=torch.tensor([it["label"] for it in items], dtype=torch.long),
        index=torch.tensor([it["index"] for it in items], dtype=torch.long),
        tags=tags, object_labels=object_labels,
    )
