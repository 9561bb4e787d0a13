"""Caption data for VisualBERT pre-training (App. A.3; reference §3.2).

Task-agnostic pre-training shows the model two captions, `[CLS] a [SEP] b [SEP]` with segments 0/1,
plus the image's regions. Caption a describes the image; with p = 0.5 caption b is another caption of
the same image, otherwise a caption of a different image. Labels follow BERT's NSP convention:
0 = b matches the image, 1 = b is random. Both captions are masked for MLM, b's masked words being targets
even when b is another image's, as in the released code (`drop_mismatched` drops them); regions never are.
Task-specific pre-training (`pairs=False`) shows one caption and trains MLM only.

The other architectures (objectives/recipe.py says which does what) read one caption that, with
`mismatch_prob`, is replaced by a caption of another image (ViLBERT §3.1 alignment, LXMERT §3.1.3
matching; with `drop_mismatched`, that caption's masked words and the masked regions are no targets).
`mismatch_replace` says what a negative replaces: the caption (the released ViLBERT and LXMERT code), the
image (the caption is shown with another image's regions), or either, half the time each (ViLBERT §3.1:
"we randomly replace either the image or caption with another"). Then come a
`RegionSetup`: regions masked by the paper's rule, the detector's targets (cls_prob,
obj/attr ids and confidences, the original features), and W-VisualBERT's detector tags. Region masking
draws from the same (seed, epoch, index) stream as the text masking, after it, so a resumed run is exact.

End-to-end VL-BERT (`pixels`, a `data.pixels.PixelLoader`): every example also carries its image's pixels
(3, S, S), a deterministic function of the image id, so resuming stays exact; the collate stacks them into
`VLInputs.pixels` (B, 3, S, S), zeros for text-only samples (no image: the model masks their visual elements,
so the zeros are never attended to). The masked RoIs' pixels are zeroed by the model (`roi_masked`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vlberts.data.batch import IMAGE_ONLY, PAIR, PretrainBatch, RegionTargets, VLInputs, bucket, select_tokens
from vlberts.data.coco import CaptionRef
from vlberts.data.regions import (
    FetchedRecord, RegionSource, Regions, length_keys, load_regions, pad_regions, pad_sequences, region_counts,
)
from vlberts.data.sampling import example_rng
from vlberts.errors import VlbertsError
from vlberts.features.record import cls_prob_misfit
from vlberts.models.wvisualbert import collate_tags, tag_tokens
from vlberts.objectives.matching import sample_qa_target
from vlberts.objectives.regions import RegionMaskRule, mask_regions, mask_tags_jointly
from vlberts.objectives.text import Source
from vlberts.text.masking import IGNORE_INDEX, mask_tokens
from vlberts.tasks.vqa import SoftTarget
from vlberts.text.tokenizer import TextTokenizer

MATCH, MISMATCH = 0, 1
MISMATCH_REPLACE = ("caption", "image", "either")  # what a matching negative replaces (module docstring)


def truncate_front(a: list[int], b: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Drop tokens from the front of the longer caption until both fit (VisualBERT trims from the front)."""
    a, b = list(a), list(b)
    while len(a) + len(b) > budget:
        if len(a) >= len(b):
            a.pop(0)
        else:
            b.pop(0)
    return a, b


# Detector outputs carried as region targets (RegionRecord fields), with their padding value.
LABEL_FIELDS: dict[str, Any] = {
    "cls_prob": 0.0, "obj_id": IGNORE_INDEX, "obj_conf": 0.0, "attr_id": IGNORE_INDEX, "attr_conf": 0.0,
}


@dataclass(frozen=True)
class RegionSetup:
    """The region side of an architecture's pre-training examples (built from `objectives.recipe.ArchRecipe`).

    rule: the paper's region masking rule, or None (regions never masked: VisualBERT).
    zero_in_data: corrupt the masked features in the batch; False leaves them and the model replaces the
        `corrupted` ones itself (VL-BERT's learned mask vector).
    replace_from_other_image: the rule's random replacements are features of another image (LXMERT's
        `random_feat`); otherwise another region of the same image.
    labels: which `LABEL_FIELDS` the examples carry as targets.
    soft_cls_prob: cls_prob is a soft target (ViLBERT's KL, VL-BERT's soft RoI classification): each row
        used is checked to be a distribution (`features.record.cls_prob_misfit`).
    tag_subwords: W-VisualBERT tags, class c -> subword ids of its name (None: no tags); attr_subwords
        likewise for attributes, each box's tag being its attribute with `tag_attr_prob` (reference §3.6).
    float16: float16 features stay float16 in the examples and the batch (the features, the regression
        target; class scores keep the store's type anyway), half the bytes a loader moves; `Batch.to` widens
        them where the step runs. Masking only zeroes and copies rows, so the values are the same.
    """

    rule: RegionMaskRule | None = None
    zero_in_data: bool = True
    replace_from_other_image: bool = False
    labels: tuple[str, ...] = ()
    soft_cls_prob: bool = False
    tag_subwords: tuple[tuple[int, ...], ...] | None = None
    attr_subwords: tuple[tuple[int, ...], ...] | None = None
    tag_attr_prob: float = 0.15
    float16: bool = False


class CaptionPretrainData:
    """Pre-training examples keyed by (epoch, index); everything random derives from (seed, epoch, index)."""

    def __init__(
        self,
        captions: list[CaptionRef],
        regions: RegionSource,
        tokenizer: TextTokenizer,
        *,
        pairs: bool = True,
        max_text_len: int = 48,
        max_regions: int = 36,
        mlm_prob: float = 0.15,
        seed: int = 0,
        feature_dim: int | None = None,
        token_probs: Mapping[int, float] | None = None,
        whole_word: bool = False,
        mismatch_prob: float = 0.0,
        drop_mismatched: bool = False,
        mismatch_replace: str = "caption",
        region_setup: RegionSetup = RegionSetup(),
        qa_targets: Sequence[SoftTarget] | None = None,
        pixels: Any = None,
    ):
        if not captions:
            raise VlbertsError("no captions to pre-train on")
        self.captions = captions
        self.regions = regions
        self.tok = tokenizer
        self.pairs = pairs
        self.max_text_len = max_text_len
        self.max_regions = max_regions
        self.mlm_prob = mlm_prob
        self.seed = seed
        self.feature_dim = feature_dim
        self.token_probs = dict(token_probs or {})
        # VL-BERT masks whole words (`ArchRecipe.whole_word`): its `##` subwords tell where a word goes on.
        self.continuation_ids = tokenizer.continuation_ids if whole_word else None
        # Tokenise once; examples only index into these.
        self.ids = [e.ids for e in tokenizer.tok.encode_batch([c.text for c in captions], add_special_tokens=False)]
        self.by_image: dict[str, list[int]] = {}
        for i, c in enumerate(captions):
            self.by_image.setdefault(c.image_id, []).append(i)
        self.images = list(self.by_image)
        self.image_index = {im: k for k, im in enumerate(self.images)}
        self.mismatch_prob = mismatch_prob
        # Masked words (and masked regions) of a text that is not the image's are no targets: ViLBERT's
        # `--objective 1`; LXMERT's and VisualBERT's code keep them (`PretrainConfig.mismatched_targets`).
        self.drop_mismatched = drop_mismatched
        if mismatch_replace not in MISMATCH_REPLACE:
            raise VlbertsError(f"unknown mismatch_replace {mismatch_replace!r}; valid: {', '.join(MISMATCH_REPLACE)}")
        if pairs and mismatch_replace != "caption":
            raise VlbertsError("caption pairs (VisualBERT's sentence-image prediction) replace the second caption; "
                               f"mismatch_replace={mismatch_replace} needs single-caption matching (pairs off)")
        self.mismatch_replace = mismatch_replace
        self.setup = region_setup
        if (pairs or mismatch_prob > 0) and len(self.by_image) < 2:
            raise VlbertsError("sentence-image prediction needs captions of at least two images")
        # LXMERT image QA (data/pretrain_qa.py): per sentence, its target over the answer table (no labels
        # for captions); None: no example carries a QA target.
        if qa_targets is not None and (pairs or len(qa_targets) != len(captions)):
            raise ValueError("QA targets need single-sentence examples and one target per sentence")
        self.qa_targets = qa_targets
        self.pixels = pixels  # a PixelLoader (end-to-end VL-BERT), or None: no example carries pixels

    def __len__(self) -> int:
        return len(self.captions)

    def lengths(self, epoch: int) -> np.ndarray:
        """(N, 2) each example's regions and tokens in `epoch` (`length_keys`), for length-grouped batches.
        The text (a pair's second caption, a mismatched caption) is drawn per epoch: each example's first
        draws are replayed here as `__getitem__` makes them, so the tokens are the ones its batch holds."""
        texts = [self._text(index, example_rng(self.seed, epoch, index)) for index in range(len(self))]
        return length_keys(region_counts(self.regions, [t[3] for t in texts], self.max_regions),
                           [len(t[0]) for t in texts])

    def _text(self, index: int, rng: np.random.Generator) -> tuple[list[int], list[int], int, str]:
        """(token ids, segment ids, match label, the image whose regions are shown) of example `index`: the
        first draws from its `rng`."""
        tok = self.tok
        image = self.captions[index].image_id
        if self.pairs:
            j, label = self._second_caption(index, rng)
            a, b = truncate_front(self.ids[index], self.ids[j], self.max_text_len - 3)
            return [tok.cls_id, *a, tok.sep_id, *b, tok.sep_id], [0] * (len(a) + 2) + [1] * (len(b) + 1), label, image
        label, text = MATCH, index
        if self.mismatch_prob > 0 and rng.random() < self.mismatch_prob:
            label = MISMATCH
            replace = self.mismatch_replace
            if replace == "either":  # one more draw, only in this mode: the other modes' streams stay as they were
                replace = "image" if rng.random() < 0.5 else "caption"
            if replace == "image":
                image = self._another_image(image, rng)
            else:
                text = self._caption_of_another_image(image, rng)
        a, _ = truncate_front(self.ids[text], [], self.max_text_len - 2)
        return [tok.cls_id, *a, tok.sep_id], [0] * (len(a) + 2), label, image

    def _second_caption(self, index: int, rng: np.random.Generator) -> tuple[int, int]:
        image = self.captions[index].image_id
        same = [j for j in self.by_image[image] if j != index]
        if same and rng.random() < 0.5:
            return int(same[rng.integers(len(same))]), MATCH
        return self._caption_of_another_image(image, rng), MISMATCH

    def _caption_of_another_image(self, image: str, rng: np.random.Generator) -> int:
        while True:
            j = int(rng.integers(len(self.captions)))
            if self.captions[j].image_id != image:
                return j

    def _another_image(self, image: str, rng: np.random.Generator) -> str:
        """A uniformly drawn image other than `image` (one draw)."""
        k = int(rng.integers(max(len(self.images) - 1, 1)))
        return self.images[k + 1 if k >= self.image_index[image] else k]

    def __getitem__(self, key: tuple[int, int]) -> dict:
        epoch, index = key
        rng = example_rng(self.seed, epoch, index)
        tok = self.tok
        ids, segments, label, image = self._text(index, rng)  # image: the caption's own, or a negative's
        masked, labels = mask_tokens(
            ids, rng, mask_id=tok.mask_id, vocab_size=tok.vocab_size, special_ids=tok.special_ids, prob=self.mlm_prob,
            token_probs=self.token_probs, continuation_ids=self.continuation_ids,
        )
        drop = self.drop_mismatched and label == MISMATCH
        if drop:  # the text that is not the image's: caption b of a pair, else the one caption
            other = np.asarray(segments) == 1 if self.pairs else np.ones(len(labels), dtype=bool)  # (T,)
            labels = np.where(other, IGNORE_INDEX, labels)
        rec = self.regions.get(image)
        regions = load_regions(FetchedRecord(rec, getattr(self.regions, "path", None)), image, self.max_regions,
                               self.feature_dim, float16=self.setup.float16)
        example = {
            "ids": masked,
            "segments": np.asarray(segments),
            "labels": labels,
            "match": label,
            "image_id": int(image) if image.isdigit() else index,  # the image shown
        }
        example.update(self._region_side(rec, regions, image, rng))
        if drop and "masked" in example:  # the regions stay corrupted in the input, but are no targets
            example["masked"] = np.zeros_like(example["masked"])
        if self.pixels is not None:  # the image shown (no random draw: `rng` is untouched)
            example["pixels"] = self.pixels.get(image)  # (3, S, S)
        if self.qa_targets is not None:  # LXMERT §3.1.3: the answer is a label only when the pair is matched
            t = self.qa_targets[index]
            k = sample_qa_target(np.asarray(t.scores), rng) if label == MATCH and t.labels else -1
            example["qa_target"] = t.labels[k] if k >= 0 else -1
        return example

    def _region_side(self, rec: Any, regions: Regions, image: str, rng: np.random.Generator) -> dict:
        """Regions (masked by the setup's rule), their targets and tags; draws continue `rng`."""
        setup, n = self.setup, len(regions.feats)
        out: dict[str, Any] = {"regions": regions}
        if setup.rule is None:
            return out
        pool = None
        if setup.replace_from_other_image and setup.rule.random > 0 and len(self.images) > 1:
            other = self._another_image(image, rng)
            pool = load_regions(self.regions, other, self.max_regions, self.feature_dim,
                                float16=setup.float16).feats  # (R', D)
            if not len(pool):
                pool = None
        m = mask_regions(regions.feats, rng, setup.rule, pool=pool)
        if setup.zero_in_data:
            out["regions"] = dataclasses.replace(regions, feats=m.feats)
        out.update(masked=m.mask, corrupted=m.corrupted, orig_feats=regions.feats)
        for name in setup.labels:
            out[name] = np.asarray(getattr(rec, name)[:n])
        if setup.soft_cls_prob and "cls_prob" in out:
            problem = cls_prob_misfit(out["cls_prob"])
            if problem:
                raise VlbertsError(problem, path=getattr(self.regions, "path", None), record=f"image {image}")
        if setup.tag_subwords is not None:
            attr = setup.attr_subwords
            use_attr = rng.random(n) < setup.tag_attr_prob if attr is not None else None
            tag_ids, tag_region = tag_tokens(
                rec.obj_id[:n], setup.tag_subwords, attr_ids=None if attr is None else rec.attr_id[:n],
                attr_subwords=attr, use_attr=use_attr,
            )
            tag_in, tag_labels, _ = mask_tags_jointly(
                np.asarray(tag_ids, dtype=np.int64), np.asarray(tag_region, dtype=np.int64), m.mask, rng,
                mask_id=self.tok.mask_id, vocab_size=self.tok.vocab_size,
            )
            out.update(tag_ids=tag_in, tag_region=np.asarray(tag_region, dtype=np.int64), tag_labels=tag_labels)
        return out


def _pad_stack(arrays: list[np.ndarray], value: Any) -> torch.Tensor:
    """Right-pad arrays of shape (n_i, ...) along the first axis to (B, max n_i, ...) with `value`."""
    first = np.asarray(arrays[0])
    n = max(len(a) for a in arrays)
    out = np.full((len(arrays), n, *first.shape[1:]), value, dtype=first.dtype)
    for i, a in enumerate(arrays):
        out[i, : len(a)] = a
    return torch.from_numpy(out)


# Region-side example keys: a text-only example (no regions) gets empty ones to batch with the others.
_REGION_SIDE = ("masked", "corrupted", "orig_feats", *LABEL_FIELDS, "tag_ids", "tag_region", "tag_labels")


def _fill_region_side(examples: list[dict]) -> list[dict]:
    """Examples without the region-side keys that others carry (text-only samples: R = 0) get zero-length
    arrays of the same trailing shape and type, so that they pad to all-padding rows."""
    template = next((e for e in examples if "masked" in e), None)
    if template is None:
        return examples
    keys = [k for k in _REGION_SIDE if k in template]
    return [e if "masked" in e else {**e, **{k: np.zeros((0, *np.shape(template[k])[1:]), np.asarray(template[k]).dtype)
                                            for k in keys}} for e in examples]


def _stack_pixels(examples: list[dict]) -> torch.Tensor | None:
    """(B, 3, S, S) pixels of the examples that carry them, zeros for those without an image (text-only
    samples); None when no example carries pixels."""
    template = next((e["pixels"] for e in examples if "pixels" in e), None)
    if template is None:
        return None
    return torch.stack([torch.as_tensor(e["pixels"]) if "pixels" in e else torch.zeros_like(template) for e in examples])


@dataclass(frozen=True)
class FixedShapes:
    """The shapes every pre-training batch is padded to (`vlberts pretrain --static_shapes`): R regions (the
    run's --max_regions; LXMERT's images all have 36), and the counts that vary from batch to batch rounded
    up: the text length (at most `text_len`) and the tag subwords to `batch.bucket` sizes, the masked words
    and their largest number in one example to `batch.coarse_bucket` sizes (powers of two). Padding the
    text to --max_text_len instead would make a step on short captions do up to twice the work (48 tokens
    for 20). A step whose tensors keep their shapes can run as a CUDA graph (torch.compile's reduce-overhead
    mode records one per shape) and never recompiles for a new length."""

    text_len: int
    regions: int


def _pad_to(t: Tensor | None, dim: int, size: int, value: Any) -> Tensor | None:
    """`t` right-padded with `value` along `dim` to `size` (as it is when already that long)."""
    if t is None or t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, t.new_full(shape, value)], dim)


def fixed_shapes(batch: PretrainBatch, shapes: FixedShapes, pad_id: int) -> PretrainBatch:
    """`batch` padded to `shapes`: padded tokens and regions are masked out of attention and carry no
    label, so every loss is the same up to float rounding but the region losses that average over every
    (example, region) slot (LXMERT's and W-VisualBERT's feature regression and detector labels, as LXMERT's
    code does, whose images all have 36 boxes): with padding their slots are B x R in every batch instead
    of B x the batch's largest region count."""
    x = batch.inputs
    T, R = min(bucket(x.input_ids.shape[1]), shapes.text_len), shapes.regions
    inputs = dataclasses.replace(
        x, input_ids=_pad_to(x.input_ids, 1, T, pad_id), token_type_ids=_pad_to(x.token_type_ids, 1, T, 0),
        attention_mask=_pad_to(x.attention_mask, 1, T, False), region_feats=_pad_to(x.region_feats, 1, R, 0.0),
        region_boxes=_pad_to(x.region_boxes, 1, R, 0.0), region_mask=_pad_to(x.region_mask, 1, R, False),
        region_type_ids=_pad_to(x.region_type_ids, 1, R, 0),
    )
    regions = batch.regions
    if regions is not None:
        pads = {"masked": False, "corrupted": False, "feats": 0.0, **LABEL_FIELDS}
        regions = dataclasses.replace(regions, **{k: _pad_to(getattr(regions, k), 1, R, v) for k, v in pads.items()})
    tags, tag_labels = batch.tags, batch.tag_labels
    if tags is not None:
        L = bucket(tags.tag_ids.shape[1])
        tags = dataclasses.replace(tags, tag_ids=_pad_to(tags.tag_ids, 1, L, pad_id),
                                   tag_region=_pad_to(tags.tag_region, 1, L, 0), tag_mask=_pad_to(tags.tag_mask, 1, L, False))
        tag_labels = _pad_to(tag_labels, 1, L, IGNORE_INDEX)
    mlm_labels = _pad_to(batch.mlm_labels, 1, T, IGNORE_INDEX)
    return dataclasses.replace(batch, inputs=inputs, regions=regions, tags=tags, tag_labels=tag_labels,
                               mlm_labels=mlm_labels, mlm_tokens=select_tokens(mlm_labels != IGNORE_INDEX, bucketed=True))


def collate_pretrain(examples: list[dict], pad_id: int = 0, shapes: FixedShapes | None = None) -> PretrainBatch:
    """Pad examples into a `PretrainBatch`. Examples may mix
    sources (`kind`: pairs, text-only, image-only; `data.text_corpus`). With `shapes`, padded to them
    (`fixed_shapes`)."""
    examples = _fill_region_side(examples)
    ids = pad_sequences([e["ids"] for e in examples], pad_id)  # (B, T)
    regions: list[Regions] = [e["regions"] for e in examples]
    feats, boxes, rmask = pad_regions(regions)
    inputs = VLInputs(
        input_ids=ids,
        token_type_ids=pad_sequences([e["segments"] for e in examples], 0),
        attention_mask=pad_sequences([np.ones(len(e["ids"]), dtype=np.int64) for e in examples], 0).bool(),
        region_feats=feats,
        region_boxes=boxes,
        region_mask=rmask,
        pixels=_stack_pixels(examples),
    )
    mlm_labels = pad_sequences([e["labels"] for e in examples], IGNORE_INDEX)  # (B, T)
    matched = torch.tensor([e["match"] == MATCH for e in examples], dtype=torch.bool)  # (B,)
    targets = None
    if "masked" in examples[0]:
        masked = _pad_stack([e["masked"] for e in examples], False)  # (B, R)
        labels = {k: _pad_stack([e[k] for e in examples], v) for k, v in LABEL_FIELDS.items() if k in examples[0]}
        targets = RegionTargets(
            masked=masked, corrupted=_pad_stack([e["corrupted"] for e in examples], False),
            feats=_pad_stack([e["orig_feats"] for e in examples], 0.0), **labels,
        )
    tags, tag_labels = None, None
    if "tag_ids" in examples[0]:
        tags = collate_tags([(e["tag_ids"], e["tag_region"]) for e in examples], pad_id)
        tag_labels = _pad_stack([e["tag_labels"] for e in examples], IGNORE_INDEX)  # (B, L)
    kind = torch.tensor([e.get("kind", PAIR) for e in examples], dtype=torch.long)  # (B,)
    batch = PretrainBatch(
        inputs=inputs,
        mlm_labels=mlm_labels,
        match_labels=torch.tensor([e["match"] for e in examples], dtype=torch.long),
        image_ids=torch.tensor([e["image_id"] for e in examples], dtype=torch.long),
        matched=matched,
        regions=targets,
        tags=tags,
        tag_labels=tag_labels,
        qa_targets=torch.tensor([e.get("qa_target", -1) for e in examples], dtype=torch.long) if "qa_target" in examples[0] else None,
        kind=kind if bool(kind.any()) else None,
        nsp_labels=torch.tensor([e.get("nsp", -1) for e in examples], dtype=torch.long) if any("nsp" in e for e in examples) else None,
        mlm_tokens=select_tokens(mlm_labels != IGNORE_INDEX) if shapes is None else None,  # fixed_shapes: bucketed
    )
    return batch if shapes is None else fixed_shapes(batch, shapes, pad_id)


def unpaired_view(batch: PretrainBatch, source: Source) -> PretrainBatch:
    """The text-only (R = 0) or image-only (T = 0, regions and tags) half of a batch: W-VisualBERT §3
    trains on batches of one modality at a time, so the model never sees a caption with its image."""
    x = batch.inputs
    if source == "text":
        r = batch.regions
        regions = None if r is None else RegionTargets(
            **{f.name: None if getattr(r, f.name) is None else getattr(r, f.name)[:, :0] for f in dataclasses.fields(r)}
        )
        inputs = dataclasses.replace(x, region_feats=x.region_feats[:, :0], region_boxes=x.region_boxes[:, :0],
                                     region_mask=x.region_mask[:, :0])
        return dataclasses.replace(batch, inputs=inputs, regions=regions, tags=None, tag_labels=None)
    inputs = dataclasses.replace(x, input_ids=x.input_ids[:, :0], token_type_ids=x.token_type_ids[:, :0],
                                 attention_mask=x.attention_mask[:, :0])
    labels = batch.mlm_labels[:, :0]
    return dataclasses.replace(batch, inputs=inputs, mlm_labels=labels, mlm_tokens=select_tokens(labels != IGNORE_INDEX))


class ImageOnlyData:
    """Image-only samples (H-VisualBERT, W-VisualBERT §4.3: "when the training sample comes from OI, we
    provide only the image"): each image's regions, masked by the recipe's rule, with the detector's targets
    and tags (`region_setup`), and no text (T = 0, no MLM labels), keyed by (epoch, index) like the captions.
    `kind` IMAGE_ONLY (2): the image objectives train on them, the matching objective does not."""

    def __init__(self, image_ids: Sequence[str], regions: RegionSource, tokenizer: TextTokenizer, *,
                 max_regions: int = 36, seed: int = 0, feature_dim: int | None = None,
                 region_setup: RegionSetup = RegionSetup()):
        self.inner = CaptionPretrainData(
            [CaptionRef(str(i), "") for i in image_ids], regions, tokenizer, pairs=False, max_regions=max_regions,
            seed=seed, feature_dim=feature_dim, region_setup=region_setup,
        )

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, key: tuple[int, int]) -> dict:
        ex = self.inner[key]
        none = np.zeros(0, dtype=np.int64)
        return {**ex, "ids": none, "segments": none, "labels": none, "kind": IMAGE_ONLY}
