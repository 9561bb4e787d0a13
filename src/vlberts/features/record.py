"""The canonical per-image region record (SPEC §2) and the metadata that names its extractor.

Every feature format vlberts reads (BUTD TSV, LXMERT TSV, ...) becomes a `RegionRecord`; every
writer takes one. Conventions, fixed here once:

- `image_id` is always a string. BUTD's integer ids become their decimal string ("42"), LXMERT's
  string ids ("COCO_val2014_000000131089") stay as they are.
- `boxes` are (x1, y1, x2, y2) in pixels of the original image, float32. Normalising them (and
  every spatial encoding) happens in collate/the model, never in files.
- Letters in shape comments: N boxes of this image, D feature width, C detector classes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vlberts.errors import VlbertsError

CLS_PROB_ATOL = 1e-2  # |row sum - 1| allowed of a cls_prob row used as a soft target

# Characters that would break a TSV line or a one-line error message.
_BAD_ID_CHARS = ("\t", "\n", "\r")


def canonical_image_id(image_id: object) -> str:
    """The canonical string key: ints (and numpy ints) become their decimal string, strings stay."""
    if isinstance(image_id, (bool, np.bool_)):
        raise VlbertsError(f"image id must be a string or an integer, got {image_id!r}")
    if isinstance(image_id, (int, np.integer)):
        return str(int(image_id))
    if not isinstance(image_id, str):
        raise VlbertsError(f"image id must be a string or an integer, got {type(image_id).__name__}")
    if not image_id or any(c in image_id for c in _BAD_ID_CHARS) or not image_id.isprintable():
        raise VlbertsError(f"image id {image_id!r} is empty or holds a tab, newline or other control character")
    return image_id


# A COCO image's file stem ("COCO_val2014_000000000042"), which LXMERT's TSVs and question files and MMF's
# feature files use as the image's id, where VQA's, COCO's and Pythia's files use the COCO id (42).
_COCO_STEM = re.compile(r"COCO_[A-Za-z]+\d{4}_(\d+)")


def coco_number(image_id: str) -> str | None:
    """The COCO id of a COCO file stem as a key ("COCO_val2014_000000000042" -> "42"), None for other ids.
    COCO's ids are unique over its splits, so the stem and the number name one image."""
    m = _COCO_STEM.fullmatch(image_id)
    return str(int(m.group(1))) if m else None


def as_float32(a: Any) -> np.ndarray:
    """`a` as a float32 array (no copy when it is one). float16 is converted by torch's vectorised kernel:
    numpy's float16 -> float32 conversion runs about 10x slower per element (116 vs 12 us for 36 x 2048 on
    2026-11-29's 2-core Intel machine), the largest single cost of reading a region record from a float16 store."""
    a = np.asarray(a)
    if a.dtype != np.float16:
        return np.asarray(a, dtype=np.float32)
    if not (a.flags.c_contiguous and a.flags.writeable):  # torch shares memory with writable contiguous arrays only
        a = np.array(a, order="C")
    return torch.from_numpy(a).float().numpy()


def all_finite(a: np.ndarray) -> bool:
    """Whether every element of a float array is finite. float16 is read by its exponent bits (all ones: inf
    or NaN): numpy's isfinite on float16 runs about 10x slower than on float32 (117 vs 10 us for 36 x 2048)."""
    if a.dtype == np.float16:
        return not bool(((np.ascontiguousarray(a).view(np.uint16) & 0x7C00) == 0x7C00).any())
    return bool(np.isfinite(a).all())


def _array(value: Any, dtype: Any, name: str, image_id: str) -> np.ndarray:
    try:
        with np.errstate(over="ignore", invalid="ignore"):  # a value too big becomes inf: refused by name below
            return np.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise VlbertsError(f"{name} cannot be read as {np.dtype(dtype).name}: {e}", record=image_id) from None


def record_misfit(rec: "RegionRecord", *, cls_prob_width: int | None, classes: list[str] | None,
                  attributes: list[str] | None, holder: str = "store") -> str | None:
    """What a valid record breaks of the corpus it belongs to (a store's fixed dataset shapes and metadata,
    or the index of a shard set): its cls_prob width, and class / attribute ids inside the vocabularies.
    None when it fits. One check for the store writer and the shard reader."""
    if (cls_prob_width is not None and rec.cls_prob is not None and rec.num_boxes
            and rec.cls_prob.shape[1] != cls_prob_width):
        return f"cls_prob has {rec.cls_prob.shape[1]} classes but the {holder} holds {cls_prob_width}"
    misfit = labels_misfit({"obj_id": rec.obj_id, "attr_id": rec.attr_id},
                           {"obj_id": None if classes is None else len(classes),
                            "attr_id": None if attributes is None else len(attributes)}, holder=holder)
    return None if misfit is None else misfit[0]


def labels_misfit(labels: dict[str, np.ndarray | None], sizes: dict[str, int | None],
                  holder: str = "store") -> tuple[str, int] | None:
    """(what is wrong, row of the first bad index) when a class index array (obj_id, attr_id) reaches past
    the size its `holder` gives it (a vocabulary's entries, a model head's classes), else None. One check
    for a record against its store or shard set (`record_misfit`) and a whole store against a model."""
    for ids, a in labels.items():
        size = sizes.get(ids)
        if a is None or size is None or not a.size:
            continue
        bad = np.flatnonzero(a >= size)  # (< 0: the record refuses)
        if bad.size:
            return f"{ids} outside the {holder}'s {size}-entry vocabulary (range {a.min()}..{a.max()})", int(bad[0])
    return None


def cls_prob_misfit(cls_prob: np.ndarray, atol: float = CLS_PROB_ATOL) -> str | None:
    """What is wrong with cls_prob as a soft target, or None: each row must be a distribution (sum 1 within
    `atol`; a float16 row of 1601 classes rounds to within about 5e-4). Stores may hold other scores for
    hard targets and tags; a KL or soft cross-entropy against them is no loss the paper trains."""
    if not len(cls_prob):
        return None
    sums = cls_prob.astype(np.float64).sum(1)  # (N,)
    bad = np.flatnonzero(np.abs(sums - 1.0) > atol)
    if bad.size:
        return (f"cls_prob row {int(bad[0])} sums to {sums[bad[0]]:.3g}, not 1 (within {atol}): soft targets "
                "need the detector's class distribution")
    return None


@dataclass(frozen=True, eq=False)
class RegionRecord:
    """Detected regions of one image.

    Arrays are coerced on construction: boxes/obj_conf/attr_conf to float32, obj_id/attr_id to int64,
    cls_prob to float32 unless it is float16; features keep float16 when given float16 (a store read
    with `upcast=False`), otherwise float32. Any shape disagreement is a one-line `VlbertsError`.
    `num_boxes` is derived from `boxes`, so it can never disagree with the arrays.
    """

    image_id: str
    image_w: int
    image_h: int
    boxes: np.ndarray  # (N, 4) float32, xyxy pixels of the original image
    features: np.ndarray  # (N, D) float32 (or float16 as stored)
    cls_prob: np.ndarray | None = None  # (N, C) detector class distribution (column layout as the extractor wrote it)
    obj_id: np.ndarray | None = None  # (N,) int64, detected object class index (LXMERT: 0-based, background excluded)
    obj_conf: np.ndarray | None = None  # (N,) float32, its confidence
    attr_id: np.ndarray | None = None  # (N,) int64, detected attribute index
    attr_conf: np.ndarray | None = None  # (N,) float32, its confidence

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: coerce fields once, here
        image_id = canonical_image_id(self.image_id)
        set_(self, "image_id", image_id)
        for name in ("image_w", "image_h"):
            v = getattr(self, name)
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise VlbertsError(f"{name} must be a positive integer, got {v!r}", record=image_id)
            set_(self, name, int(v))

        boxes = _array(self.boxes, np.float32, "boxes", image_id)
        if boxes.ndim != 2 or boxes.shape[1] != 4:
            raise VlbertsError(f"boxes must have shape (N, 4), got {boxes.shape}", record=image_id)
        n = boxes.shape[0]
        if not np.isfinite(boxes).all():
            raise VlbertsError("boxes hold NaN or inf", record=image_id)
        # xyxy, not xywh: a file in the wrong convention usually trips this.
        if n and ((boxes[:, 2] < boxes[:, 0]).any() or (boxes[:, 3] < boxes[:, 1]).any()):
            raise VlbertsError("boxes must be (x1, y1, x2, y2) with x2 >= x1 and y2 >= y1", record=image_id)
        # Inside the image (a pixel of slack for rounding): a box far outside is a file for another image
        # size, or boxes in another unit, and would give normalised coordinates outside [0, 1].
        if n and ((boxes[:, :2] < -1).any() or (boxes[:, 2] > self.image_w + 1).any()
                  or (boxes[:, 3] > self.image_h + 1).any()):
            k = int(np.flatnonzero((boxes[:, :2] < -1).any(1) | (boxes[:, 2] > self.image_w + 1)
                                   | (boxes[:, 3] > self.image_h + 1))[0])
            raise VlbertsError(f"box {k} {boxes[k].tolist()} lies outside the {self.image_w}x{self.image_h} image",
                               record=image_id)
        set_(self, "boxes", boxes)

        feats = np.asarray(self.features)
        feats = _array(feats, np.float16 if feats.dtype == np.float16 else np.float32, "features", image_id)
        if feats.ndim != 2 or feats.shape[0] != n:
            raise VlbertsError(f"features must have shape ({n}, D) for {n} boxes, got {feats.shape}", record=image_id)
        if not all_finite(feats):  # a NaN would reach every loss and answer it touches
            raise VlbertsError("features hold NaN or inf", record=image_id)
        set_(self, "features", feats)

        if self.cls_prob is not None:
            cp = np.asarray(self.cls_prob)
            cp = _array(cp, np.float16 if cp.dtype == np.float16 else np.float32, "cls_prob", image_id)
            if cp.ndim != 2 or cp.shape[0] != n:
                raise VlbertsError(f"cls_prob must have shape ({n}, C) for {n} boxes, got {cp.shape}", record=image_id)
            if not all_finite(cp) or (cp < 0).any():
                raise VlbertsError("cls_prob holds NaN, inf or a negative value", record=image_id)
            set_(self, "cls_prob", cp)

        for ids, conf in (("obj_id", "obj_conf"), ("attr_id", "attr_conf")):
            i, c = getattr(self, ids), getattr(self, conf)
            if (i is None) != (c is None):
                raise VlbertsError(f"{ids} and {conf} must be given together", record=image_id)
            if i is None:
                continue
            raw = np.asarray(i)
            if raw.dtype.kind == "f" and raw.size and not np.array_equal(raw, np.floor(raw)):
                # a class index stored as a float must be a whole number; truncating 2.7 to 2 is another class
                raise VlbertsError(f"{ids} holds a fractional class index ({float(raw[raw != np.floor(raw)][0])})",
                                   record=image_id)
            i = _array(i, np.int64, ids, image_id)
            c = _array(c, np.float32, conf, image_id)
            if i.shape != (n,) or c.shape != (n,):
                raise VlbertsError(
                    f"{ids} and {conf} must have shape ({n},) for {n} boxes, got {i.shape} and {c.shape}",
                    record=image_id,
                )
            if (i < 0).any():
                raise VlbertsError(f"{ids} holds a negative class index ({int(i.min())})", record=image_id)
            if not np.isfinite(c).all() or (c < 0).any() or (c > 1 + 1e-3).any():
                raise VlbertsError(f"{conf} must be confidences in [0, 1] (no NaN or inf)", record=image_id)
            set_(self, ids, i)
            set_(self, conf, c)

    @property
    def num_boxes(self) -> int:
        return int(self.boxes.shape[0])

    @property
    def feature_dim(self) -> int:
        return int(self.features.shape[1])

    @property
    def has_objects(self) -> bool:
        return self.obj_id is not None

    @property
    def has_attrs(self) -> bool:
        return self.attr_id is not None

    def differences(self, other: RegionRecord, atol: float = 0.0) -> list[str]:
        """Names of the fields that differ (arrays compared with `atol`); [] means the same record.

        A list rather than a bool so that a failing comparison (tests, "do my re-extracted features
        match the released ones?") says where.
        """
        diffs = []
        for f in dataclasses.fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if a is None or b is None or a.shape != b.shape:
                    diffs.append(f.name)
                elif not np.allclose(a.astype(np.float64), b.astype(np.float64), rtol=0.0, atol=atol, equal_nan=True):
                    diffs.append(f.name)
            elif a != b:
                diffs.append(f.name)
        return diffs


STORE_METADATA_KEYS = ("extractor", "weights_hash", "settings", "classes", "attributes", "source", "notes")


@dataclass
class StoreMetadata:
    """What produced a store; saved with it so that features can be reproduced and compared.

    `settings` holds the extraction settings as JSON values. Keys other code relies on, when known:
    `box_policy` ("fixed36", "10-36", "10-100", "144"), `conf_thresh`, `min_boxes`, `max_boxes`,
    `nms`, `feature_layer` ("pool5", "fc6", ...), `background_column` ("first"/"last"/"none").
    `classes`/`attributes` are the vocabularies `obj_id`/`attr_id` index into (one name per line of
    e.g. objects_vocab.txt, synonyms kept as written). `source` records an import: format, file, bytes, sha256.
    """

    extractor: str = "unknown"
    weights_hash: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    classes: list[str] | None = None
    attributes: list[str] | None = None
    source: dict[str, Any] | None = None
    notes: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, path: object = None) -> StoreMetadata:
        """Build from a dict; unknown keys are an error (a typo must not vanish silently)."""
        unknown = sorted(set(d) - set(STORE_METADATA_KEYS))
        if unknown:
            raise VlbertsError(
                f"unknown store metadata key(s) {', '.join(unknown)}; valid: {', '.join(STORE_METADATA_KEYS)}",
                path=path,
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
