"""Typed batches: named fields, never positional tuples (DESIGN.md habit 5).

Letters in shape comments: B batch, T text length, R regions, D feature width, A answers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """A copy of dataclass `obj` with `fn` applied to every tensor field, recursively, and the facts a
    batch reads off its host tensors (`Batch.host_facts`) set on the copy: `fn` moves or pins the tensors,
    it does not change their values."""
    changes = {}
    for f in dataclasses.fields(obj):
        if not f.init:
            continue  # host facts: set below, bound to the copy's tensors
        v = getattr(obj, f.name)
        if isinstance(v, Tensor):
            changes[f.name] = fn(v)
        elif dataclasses.is_dataclass(v):
            changes[f.name] = _map_tensors(v, fn)
    out = dataclasses.replace(obj, **changes)
    if isinstance(obj, Batch):
        out.bind_host_facts(obj.host_facts())
    return out


def _tensors(obj: Any) -> Iterator[Tensor]:
    """Every tensor field of dataclass `obj`, recursively, in `_map_tensors`'s order."""
    for f in dataclasses.fields(obj):
        if not f.init:
            continue
        v = getattr(obj, f.name)
        if isinstance(v, Tensor):
            yield v
        elif dataclasses.is_dataclass(v):
            yield from _tensors(v)


BatchT = TypeVar("BatchT", bound="Batch")


def _float32(t: Tensor) -> Tensor:
    return t.float() if t.dtype == torch.float16 else t


class Batch:
    """What every typed batch (a dataclass of tensors and nested batches) can do with its tensors.

    `pin_memory` is what `DataLoader(pin_memory=True)` calls on each batch it yields: it pins tensors,
    mappings and sequences itself but leaves any other object as it is, so a dataclass without the
    method reaches the training loop in pageable memory, and its `to(device, non_blocking=True)` copy
    cannot overlap the GPU's work."""

    def to(self: BatchT, device: torch.device | str, non_blocking: bool = False) -> BatchT:
        """Every tensor field (recursively) on `device`, float16 ones as float32 there: a batch may carry region
        features and class scores as a float16 store holds them (`RegionSetup.float16`), so that the loader
        moves half the bytes, and the model and the losses read float32 (the same values: float16 -> float32
        is exact)."""
        return _map_tensors(self, lambda t: _float32(t.to(device, non_blocking=non_blocking)))

    def pin_memory(self: BatchT) -> BatchT:
        """Every tensor field (recursively) in page-locked host memory (needs an accelerator)."""
        return _map_tensors(self, lambda t: t.pin_memory())

    def tensors(self) -> Iterator[Tensor]:
        """Every tensor field, recursively (those `to` and `pin_memory` move)."""
        return _tensors(self)

    def host_facts(self) -> dict[str, Any]:
        """Facts about the batch's values that a model uses and that are free to read where the tensors
        are on the host but would cost a wait for the GPU on the device; `to` and `pin_memory` set them on
        the copy they return (`bind_host_facts`). None here."""
        return {}

    def bind_host_facts(self, facts: dict[str, Any]) -> None:
        """Keep `host_facts()` of the batch this one was copied from, for this one's tensors."""


@dataclass(frozen=True)
class MaskFact:
    """Whether every entry of `mask` was True, read on the host, and the mask's state then: the tensor
    object and its `_version` (which every in-place edit bumps)."""

    mask: Tensor
    version: int
    complete: bool

    def about(self, mask: Tensor) -> bool | None:
        """`complete` if `mask` is still the tensor it was read off, unedited; else None (unknown). A
        compiled graph takes the fact as it was traced (dynamo cannot guard on `_version`); the training
        step it compiles reads batches fresh from `to`."""
        if torch.compiler.is_compiling():
            return self.complete
        return self.complete if mask is self.mask and mask._version == self.version else None


@dataclass
class VLInputs(Batch):
    """What every architecture reads: a text sequence and a set of image regions.

    Boxes are (x1, y1, x2, y2) divided by the image width/height, so in [0, 1]; spatial encodings
    (4-d, 5-d, 6-d, sin/cos) are computed from them inside the model, never baked into files (SPEC §2).
    """

    input_ids: Tensor  # (B, T) long, WordPiece ids
    token_type_ids: Tensor  # (B, T) long, text segment (0 = first sentence, 1 = second)
    attention_mask: Tensor  # (B, T) bool, True for real tokens
    region_feats: Tensor  # (B, R, D) float
    region_boxes: Tensor  # (B, R, 4) float, normalised xyxy
    region_mask: Tensor  # (B, R) bool, True for real regions
    region_type_ids: Tensor | None = None  # (B, R) long; None = all 1 (VisualBERT visual segment)
    image_text_alignment: Tensor | None = None  # (B, R, K) long word positions, -1 = none (VCR)
    # (B, 3, H, W) float image pixels, normalised as the model's CNN expects; region_boxes are relative to
    # this H, W. Only end-to-end models (VL-BERT `end_to_end`) read it; None everywhere else.
    pixels: Tensor | None = None
    # Whether every text token / every region of every example is real (no padding): `text_complete`,
    # `regions_complete`. Read off the host masks by `to` (and `pin_memory`) into the copy it returns;
    # None (unknown) on inputs built or changed since (`dataclasses.replace`, a mask edited in place or
    # replaced), which then keep their masks. A model leaves the attention mask out for a key set known to
    # be complete (`models.blocks.key_bias`), so that SDPA may run the flash kernel, which takes none;
    # reading the mask on the GPU instead would make the host wait for it every step.
    text_fact: MaskFact | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    regions_fact: MaskFact | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def text_complete(self) -> bool | None:
        return self.text_fact.about(self.attention_mask) if self.text_fact is not None else None

    @property
    def regions_complete(self) -> bool | None:
        return self.regions_fact.about(self.region_mask) if self.regions_fact is not None else None

    def host_facts(self) -> dict[str, Any]:
        """`text_complete` and `regions_complete`: read off the masks when they are on the host, as they
        are now (an edit made in place before the copy counts), else the ones this batch carries."""
        def complete(mask: Tensor, known: bool | None) -> bool | None:
            return bool(mask.all()) if mask.device.type == "cpu" else known
        return {"text_complete": complete(self.attention_mask, self.text_complete),
                "regions_complete": complete(self.region_mask, self.regions_complete)}

    def bind_host_facts(self, facts: dict[str, Any]) -> None:
        def fact(mask: Tensor, complete: bool | None) -> MaskFact | None:
            return None if complete is None else MaskFact(mask, mask._version, complete)
        self.text_fact = fact(self.attention_mask, facts["text_complete"])
        self.regions_fact = fact(self.region_mask, facts["regions_complete"])

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]


@dataclass
class TagInputs(Batch):
    """Detector tags of a batch (W-VisualBERT §3.2), as subword tokens that each point at the region they
    came from. L tag subwords."""

    tag_ids: Tensor  # (B, L) long, WordPiece ids of the tag subwords
    tag_region: Tensor  # (B, L) long, index into the batch's regions (0..R-1) of each subword's box
    tag_mask: Tensor  # (B, L) bool, True for real tag subwords


@dataclass
class RegionTargets(Batch):
    """Masked-region modelling: which regions were masked and what the region losses compare against.
    C detector classes (background included, as `cls_prob` is stored)."""

    masked: Tensor  # (B, R) bool, regions selected for masking: the targets of the masked-region losses
    corrupted: Tensor  # (B, R) bool, selected regions whose input was replaced (zeroed, or VL-BERT's mask vector)
    feats: Tensor  # (B, R, D) float, the original (uncorrupted) features: RoI-feature regression target
    cls_prob: Tensor | None = None  # (B, R, C) float, the detector's class distribution (0 on padding)
    obj_id: Tensor | None = None  # (B, R) long, detected object label, -100 on padding
    obj_conf: Tensor | None = None  # (B, R) float, its confidence (0 on padding)
    attr_id: Tensor | None = None  # (B, R) long, detected attribute label, -100 on padding
    attr_conf: Tensor | None = None  # (B, R) float


# Where a pre-training example comes from (`PretrainBatch.kind`): an image with its text, a text-only sample
# (VL-BERT §3.3 <Text, ∅>), an image without text (H-VisualBERT's image-only set).
PAIR, TEXT_ONLY, IMAGE_ONLY = 0, 1, 2


@dataclass
class TokenSelection(Batch):
    """The text positions the pre-training heads read (the masked words), as index tensors.

    Built on the host from a (B, T) bool mask (`select_tokens`; the pre-training collate builds one per
    batch), they let the forward pass and the MLM loss pick those rows with plain integer indexing. Picking
    them with the mask itself (`h[mask]`) or sizing a tensor by a count read off the device
    (`int(counts.max())`) makes the host wait for every kernel queued before it, once per such read, and
    splits a `torch.compile` graph there; integer indices whose sizes the host already knows do neither.
    `h[sel.example, sel.position]` lists the selected rows in the row-major order of `h[mask]`."""

    example: Tensor  # (N,) long: the example b of each selected token, row-major
    position: Tensor  # (N,) long: its text position t
    rows: Tensor  # (B, 1 + n) long: 0 ([CLS]), then example b's selected positions ascending, padded with 0
    slot: Tensor  # (N,) long: where token k sits in rows[:, 1:] (row b = example[k])
    # How many of the N entries are selected tokens, when the lists are padded to a bucket size
    # (`select_tokens(..., bucketed=True)`): the rest point at [CLS] of example 0, whose label is never set,
    # so a loss over labels gathered at them ignores them. None: every entry is a selected token.
    real: int | None = None

    @property
    def count(self) -> int:
        """The number of selected tokens (known on the host: reading it never waits for the device)."""
        return self.example.shape[0] if self.real is None else self.real


def bucket(n: int) -> int:
    """The smallest size of the form m * 2^k (m = 5..8) that holds n, and 8 for 1..8 (0 stays 0): at most a
    quarter more than n, and one or two sizes for a count that varies a little from batch to batch, so
    that a step padded to it keeps a few shapes (what CUDA graphs need: one graph per shape)."""
    if n <= 8:
        return 0 if n <= 0 else 8
    step = 1 << ((n - 1).bit_length() - 3)
    return -(-n // step) * step


def coarse_bucket(n: int) -> int:
    """The smallest power of two that holds n, and 8 for 1..8 (0 stays 0): at most twice n. For counts that
    are sums of random draws (the masked words of a batch, their largest number in one example), whose spread
    from batch to batch crosses `bucket`'s finer boundaries every few batches: on the H200 (2026-11-27) a
    `--static_shapes` loop with those finer sizes was still compiling new graphs (one every 16 s, 9 in all,
    for the sizes of the rows, of the lists and of the text) when it was stopped. The lists they size feed
    only the last layer's queries and the MLM head, a small part of a step, so the padding costs little."""
    return 0 if n <= 0 else max(8, 1 << (n - 1).bit_length())


def select_tokens(positions: Tensor, bucketed: bool = False) -> TokenSelection:
    """positions (B, T) bool -> the `TokenSelection` of its True entries. Reads the mask's values (call it
    where they are on the host); a mask with no columns (an image-only batch) is read from its shape.

    `bucketed`: the token lists padded to `coarse_bucket(N)` entries and the rows to `1 + coarse_bucket(n)`, so
    that batches whose masked-word counts differ share their shapes (`data.pretrain.fixed_shapes`).
    The padding entries point at [CLS] (position 0) of example 0."""
    B, T = positions.shape
    dev = positions.device
    if T == 0 or B == 0:
        empty = torch.zeros(0, dtype=torch.long, device=dev)
        return TokenSelection(empty, empty, torch.zeros(B, 1, dtype=torch.long, device=dev), empty)
    example, position = positions.nonzero(as_tuple=True)  # (N,), (N,): row-major
    counts = positions.sum(1)  # (B,)
    n = int(counts.max())
    ordered = torch.where(positions, torch.arange(T, device=dev), T).sort(dim=1).values[:, :n]  # (B, n), selected first
    valid = torch.arange(n, device=dev) < counts[:, None]  # (B, n)
    rows = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), ordered.masked_fill(~valid, 0)], 1)
    slot = torch.arange(n, device=dev).expand(B, n)[valid]  # (N,): the rank of each token within its example
    if not bucketed:
        return TokenSelection(example, position, rows, slot)
    N = example.shape[0]
    extra, wider = coarse_bucket(N) - N, coarse_bucket(n) - n
    pad = torch.zeros(extra, dtype=torch.long, device=dev)
    rows = torch.cat([rows, torch.zeros(B, wider, dtype=torch.long, device=dev)], 1)  # (B, 1 + coarse_bucket(n))
    return TokenSelection(torch.cat([example, pad]), torch.cat([position, pad]), rows, torch.cat([slot, pad]), real=N)


def as_selection(positions: Tensor | TokenSelection) -> TokenSelection:
    """A `TokenSelection`, given one or the (B, T) bool mask it is built from (eager callers and tests)."""
    return positions if isinstance(positions, TokenSelection) else select_tokens(positions)


@dataclass
class PretrainBatch(Batch):
    """Caption pre-training: MLM with the image + image-text matching (VisualBERT §A.3), and for the other
    architectures the region-side targets (`regions`) and detector tags (`tags`) their objectives read."""

    inputs: VLInputs
    mlm_labels: Tensor  # (B, T) long, -100 where not masked
    match_labels: Tensor  # (B,) long, BERT NSP convention: 0 = caption_b matches the image, 1 = random
    image_ids: Tensor  # (B,) long
    # (B,) bool, the text matches the image (any convention's labels derive from it: objectives.matching);
    # None only in batches built before this field existed.
    matched: Tensor | None = None
    regions: RegionTargets | None = None  # masked-region targets; None = regions never masked (VisualBERT)
    tags: TagInputs | None = None  # W-VisualBERT detector tags (inputs, after masking)
    tag_labels: Tensor | None = None  # (B, L) long, original tag subword where masked, -100 elsewhere
    qa_targets: Tensor | None = None  # (B,) long, LXMERT image-QA answer index, -1 = none (unmatched, caption)
    # (B,) long, where each example comes from (`data.text_corpus`): 0 an image with its text, 1 a text-only
    # sample (VL-BERT §3.3 <Text, ∅>: no regions), 2 an image-only sample (H-VisualBERT: no text).
    # None: every example is a pair. The image objectives skip kind 1, the pair objectives (matching) 1 and 2.
    kind: Tensor | None = None
    nsp_labels: Tensor | None = None  # (B,) long, next-sentence labels (0 = IsNext, 1 = NotNext), -1 = none
    # Where mlm_labels is set, as index tensors built with it on the host (`collate_pretrain`), so that the
    # step never reads the mask back from the device. None: built from mlm_labels when needed.
    mlm_tokens: TokenSelection | None = None


@dataclass
class VQABatch(Batch):
    """VQA: question + regions, soft answer scores as targets."""

    inputs: VLInputs
    targets: Tensor  # (B, A) float soft scores in [0, 1]
    question_ids: Tensor  # (B,) long
    # (B,) long, position of the [MASK] answer slot (VisualBERT App. A, VL-BERT §4.2.2); 0 ([CLS]) in the
    # `question` layout, whose models read pooled outputs and ignore it
    answer_pos: Tensor
    tags: TagInputs | None = None  # W-VisualBERT's detector tags of the regions (§3.2), for models that read them
