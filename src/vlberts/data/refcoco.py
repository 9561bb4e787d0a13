"""Reading RefCOCO+ referring expressions: the refs file, COCO instances, split selection, detections.

Format (formats-and-metrics.md §2.6; Yu et al. 2016; the refer API ``refer.py`` used by ViLBERT and VL-BERT):

* ``refcoco+/refs(unc).p``: a Python-2 pickle of a list of refs::

      {"ref_id": 0, "ann_id": 1719310, "image_id": 581857, "category_id": 1, "split": "train",
       "file_name": "COCO_train2014_000000581857_16.jpg", "sent_ids": [0, 1, 2],
       "sentences": [{"raw": "The lady with the blue shirt", "sent": "the lady with the blue shirt",
                      "sent_id": 0, "tokens": ["the", "lady", "with", "the", "blue", "shirt"]}, ...]}

  It is read ONLY through `vlberts.safe_pickle` (builtin containers and scalars, nothing else), never
  with ``pickle.load``. The same list stored as JSON (``refs.json``, `write_refs_json`) is read too.
* ``refcoco+/instances.json``: COCO style, ``images`` ({id, file_name, width, height}), ``annotations``
  ({id, image_id, category_id, bbox [x, y, w, h] in pixels, ...}), ``categories`` ({id, name, ...}).
  COCO category ids are 1-based and have gaps (1..90 for 80 classes); `RefCocoData.category_index`
  gives the contiguous 0-based class index a classifier uses.
* Splits of RefCOCO+ (UNC): ``train``, ``val``, ``testA`` (people), ``testB`` (other objects).
  `select_refs` follows ``refer.py getRefIds``: ``testA``/``testB``/``testC`` keep refs whose split
  *contains* the letter (so a ``testAB`` ref is in both), ``test`` keeps every split containing "test",
  ``train``/``val``/``testAB``... match exactly. A ref whose split is none of these names (`SPLITS`) is
  an error naming it: `select_refs` would silently leave it out of every split.
* Detections for the detected-region track (MAttNet ``res101_coco_minus_refer_notime_dets.json``): a
  list of ``{"image_id", "box": [x, y, w, h], "category_id", "score", ...}`` (`read_detections`).

The gold box of an expression is its ref's annotation box (``refer.getRefBox``). Boxes are returned as
given (xywh) and as float xyxy pixel edges (x, y, x + w, y + h), the library's convention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import read_json, require_box, require_keys, require_lists, require_text, require_unique, write_json
from vlberts.safe_pickle import safe_load

Box = tuple[float, float, float, float]

_REF_KEYS = ("ref_id", "ann_id", "image_id", "category_id", "split", "sentences")
_SENT_KEYS = ("sent_id", "sent")
# The split names refer.py's getRefIds knows (`select_refs`); RefCOCO+ uses train, val, testA, testB.
SPLITS = ("train", "val", "test", "testA", "testB", "testC", "testAB", "testBC", "testAC")


def xywh_to_xyxy(box: Box) -> Box:
    """COCO ``[x, y, w, h]`` -> ``(x1, y1, x2, y2)`` = ``(x, y, x + w, y + h)``."""
    x, y, w, h = box
    return (x, y, x + w, y + h)


@dataclass(frozen=True)
class RefSentence:
    sent_id: int
    sent: str  # lower-cased, cleaned text (what ViLBERT tokenizes)
    raw: str  # as written by the annotator
    tokens: tuple[str, ...]  # the released tokenisation (what VL-BERT reads)


@dataclass(frozen=True)
class Ref:
    """One referred object (a COCO annotation) with its expressions."""

    ref_id: int
    ann_id: int
    image_id: int
    category_id: int  # COCO id, 1-based
    split: str
    file_name: str
    sentences: tuple[RefSentence, ...]


@dataclass(frozen=True)
class CocoImage:
    id: int
    file_name: str
    width: int
    height: int


@dataclass(frozen=True)
class CocoAnnotation:
    id: int
    image_id: int
    category_id: int  # COCO id, 1-based
    bbox: Box  # x, y, w, h in pixels

    @property
    def box_xyxy(self) -> Box:
        return xywh_to_xyxy(self.bbox)


@dataclass(frozen=True)
class RefExpression:
    """One evaluation instance: an expression, its image and its gold box."""

    ref_id: int
    sent_id: int
    image_id: int
    ann_id: int
    category_id: int
    split: str
    sent: str
    tokens: tuple[str, ...]
    gold_bbox: Box  # x, y, w, h

    @property
    def gold_box_xyxy(self) -> Box:
        return xywh_to_xyxy(self.gold_bbox)


@dataclass(frozen=True)
class RefCocoData:
    """Refs joined with their COCO instances; every ref's annotation, image and category exist."""

    refs: tuple[Ref, ...]
    images: dict[int, CocoImage]
    annotations: dict[int, CocoAnnotation]
    categories: dict[int, str]  # COCO category id -> name
    category_index: dict[int, int] = field(init=False, repr=False)  # COCO id -> 0-based contiguous index

    def __post_init__(self) -> None:
        object.__setattr__(self, "category_index", {c: i for i, c in enumerate(sorted(self.categories))})

    def image_annotations(self, image_id: int) -> list[CocoAnnotation]:
        """Annotations of one image in id order: the candidate regions of the ground-truth-region track."""
        return sorted((a for a in self.annotations.values() if a.image_id == image_id), key=lambda a: a.id)

    def expressions(self, split: str) -> list[RefExpression]:
        """Every expression of the refs in `split` (see `select_refs`), in refs order then sentence order."""
        out = []
        for ref in select_refs(self.refs, split):
            ann = self.annotations[ref.ann_id]
            for s in ref.sentences:
                out.append(RefExpression(ref.ref_id, s.sent_id, ref.image_id, ref.ann_id, ref.category_id,
                                         ref.split, s.sent, s.tokens, ann.bbox))
        return out


# --------------------------------------------------------------------------- checks


def _int(value: Any, what: str, *, path: Path, record: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise VlbertsError(f"{what} must be an integer, got {value!r}", path=path, record=record)
    return value


def _str(value: Any, what: str, *, path: Path, record: str) -> str:
    if not isinstance(value, str):
        raise VlbertsError(f"{what} must be a string, got {value!r}", path=path, record=record)
    return value


def _bbox(value: Any, *, path: Path, record: str) -> Box:
    if (not isinstance(value, (list, tuple)) or len(value) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
        raise VlbertsError(f"bbox must be [x, y, w, h] (4 finite numbers), got {value!r}", path=path, record=record)
    if value[2] < 0 or value[3] < 0:
        raise VlbertsError(f"bbox has a negative width or height: {value!r}", path=path, record=record)
    return (float(value[0]), float(value[1]), float(value[2]), float(value[3]))


def _shown(bbox: Box) -> str:
    """A COCO bbox as the file writes it: ``[x, y, w, h]``."""
    return "[" + ", ".join(f"{v:g}" for v in bbox) + "]"


# --------------------------------------------------------------------------- refs


def _parse_ref(rec: Any, *, path: Path, record: str) -> Ref:
    require_keys(rec, _REF_KEYS, path=path, record=record)
    ref_id = _int(rec["ref_id"], "ref_id", path=path, record=record)
    record = f"{record} (ref_id {ref_id})"
    category_id = _int(rec["category_id"], "category_id", path=path, record=record)
    split = _str(rec["split"], "split", path=path, record=record)
    if split not in SPLITS:
        raise VlbertsError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}", path=path, record=record)
    if category_id < 1:
        raise VlbertsError(f"category_id {category_id}: COCO category ids are 1-based", path=path, record=record)
    sentences = rec["sentences"]
    if not isinstance(sentences, list) or not sentences:
        raise VlbertsError("sentences must be a non-empty list", path=path, record=record)
    sents = []
    for j, s in enumerate(sentences):
        where = f"{record} sentences[{j}]"
        require_keys(s, _SENT_KEYS, path=path, record=where)
        sent = require_text(s["sent"], "sent", path=path, record=where)
        tokens = s.get("tokens", sent.split())
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            raise VlbertsError("tokens must be a list of strings", path=path, record=where)
        sents.append(RefSentence(_int(s["sent_id"], "sent_id", path=path, record=where), sent,
                                 _str(s.get("raw", sent), "raw", path=path, record=where), tuple(tokens)))
    return Ref(
        ref_id=ref_id,
        ann_id=_int(rec["ann_id"], "ann_id", path=path, record=record),
        image_id=_int(rec["image_id"], "image_id", path=path, record=record),
        category_id=category_id,
        split=split,
        file_name=_str(rec.get("file_name", ""), "file_name", path=path, record=record),
        sentences=tuple(sents),
    )


def read_refs(path: str | Path, bad: BadRecords | None = None) -> list[Ref]:
    """Read ``refs(unc).p`` (through the restricted unpickler) or its JSON form (``*.json``).

    Errors name the file and ``refs[i] (ref_id N)``; a pickle naming any non-builtin global (code to
    run, a class to build) is refused before anything is constructed from it. With `bad` skipping, a
    malformed or duplicate ref is dropped and counted instead.
    """
    return [ref for _, ref in _read_refs(Path(path), bad if bad is not None else BadRecords())]


def _read_refs(path: Path, bad: BadRecords) -> list[tuple[int, Ref]]:
    """`read_refs` with each ref's index in the file (for error messages)."""
    data = read_json(path) if path.suffix.lower() == ".json" else safe_load(path)
    if not isinstance(data, list):
        raise VlbertsError(f"expected a list of refs, got {type(data).__name__}", path=path)
    refs = []
    seen: dict[int, int] = {}
    # sent_id -> (refs index, ref_id, sentence index): expressions are keyed by sent_id (predictions,
    # evaluation), so a repeated one would silently replace another and later errors would blame other files.
    sent_seen: dict[int, tuple[int, int, int]] = {}
    for i, rec in enumerate(data):
        try:
            ref = _parse_ref(rec, path=path, record=f"refs[{i}]")
            if ref.ref_id in seen:
                raise VlbertsError(f"duplicate ref_id {ref.ref_id} (first at refs[{seen[ref.ref_id]}])",
                                   path=path, record=f"refs[{i}]")
            here: dict[int, tuple[int, int, int]] = {}
            for j, s in enumerate(ref.sentences):
                first = sent_seen.get(s.sent_id) or here.get(s.sent_id)
                if first is not None:
                    k, first_ref, m = first
                    raise VlbertsError(f"duplicate sent_id {s.sent_id} (first in ref_id {first_ref}: refs[{k}] "
                                       f"sentences[{m}])", path=path,
                                       record=f"refs[{i}] (ref_id {ref.ref_id}) sentences[{j}]")
                here[s.sent_id] = (i, ref.ref_id, j)
        except VlbertsError as err:
            bad.handle(err)
            continue
        seen[ref.ref_id] = i
        sent_seen.update(here)
        refs.append((i, ref))
    return refs


def write_refs_json(path: str | Path, refs: list[Ref]) -> None:
    """Write refs as the JSON form of ``refs(unc).p`` (same keys), atomically."""
    rows = [
        {
            "ref_id": r.ref_id, "ann_id": r.ann_id, "image_id": r.image_id, "category_id": r.category_id,
            "split": r.split, "file_name": r.file_name, "sent_ids": [s.sent_id for s in r.sentences],
            "sentences": [{"raw": s.raw, "sent": s.sent, "sent_id": s.sent_id, "tokens": list(s.tokens)}
                          for s in r.sentences],
        }
        for r in refs
    ]  # fmt: skip
    write_json(path, rows, indent=None)


def select_refs(refs: tuple[Ref, ...] | list[Ref], split: str) -> list[Ref]:
    """The refs of one split, by ``refer.py getRefIds``'s rules (module docstring)."""
    if split in ("testA", "testB", "testC"):
        return [r for r in refs if split[-1] in r.split]
    if split == "test":
        return [r for r in refs if "test" in r.split]
    if split in ("train", "val", "testAB", "testBC", "testAC"):
        return [r for r in refs if r.split == split]
    raise VlbertsError(f"unknown split {split!r} ({', '.join(SPLITS)})")


# --------------------------------------------------------------------------- instances


def read_instances(
    path: str | Path, bad: BadRecords | None = None, dropped: set[int] | None = None,
) -> tuple[dict[int, CocoImage], dict[int, CocoAnnotation], dict[int, str]]:
    """Read a COCO ``instances.json``: images, annotations and categories by id. An annotation's bbox must lie
    inside its image (one pixel of slack); zero-area boxes pass here (COCO train2014 holds a few) and are
    refused as a ref's gold box (`read_refcoco`). With `bad` skipping, a malformed annotation (a repeated
    id, a box outside the image, a missing image or category) is dropped and counted instead, and its id
    (where it could be read) added to `dropped`."""
    bad = bad if bad is not None else BadRecords()
    path = Path(path)
    data = read_json(path)
    require_lists(data, ("images", "annotations", "categories"), path=path, record="instances")
    images: dict[int, CocoImage] = {}
    seen_images: dict[int, object] = {}  # id -> where it first appears (a repeated id would replace the first)
    for i, rec in enumerate(data["images"]):
        where = f"images[{i}]"
        require_keys(rec, ("id", "width", "height"), path=path, record=where)
        img = CocoImage(_int(rec["id"], "id", path=path, record=where),
                        _str(rec.get("file_name", ""), "file_name", path=path, record=where),
                        _int(rec["width"], "width", path=path, record=where),
                        _int(rec["height"], "height", path=path, record=where))
        require_unique(seen_images, img.id, where, what="image id", path=path)
        images[img.id] = img
    categories: dict[int, str] = {}
    seen_categories: dict[int, object] = {}
    for i, rec in enumerate(data["categories"]):
        where = f"categories[{i}]"
        require_keys(rec, ("id", "name"), path=path, record=where)
        cid = _int(rec["id"], "id", path=path, record=where)
        if cid < 1:
            raise VlbertsError(f"category id {cid}: COCO category ids are 1-based", path=path, record=where)
        require_unique(seen_categories, cid, where, what="category id", path=path)
        categories[cid] = _str(rec["name"], "name", path=path, record=where)
    annotations: dict[int, CocoAnnotation] = {}
    first: dict[int, object] = {}  # annotation id -> where it first appears
    for i, rec in enumerate(data["annotations"]):
        where = f"annotations[{i}]"
        ann = None
        try:
            require_keys(rec, ("id", "image_id", "category_id", "bbox"), path=path, record=where)
            ann = CocoAnnotation(_int(rec["id"], "id", path=path, record=where),
                                 _int(rec["image_id"], "image_id", path=path, record=where),
                                 _int(rec["category_id"], "category_id", path=path, record=where),
                                 _bbox(rec["bbox"], path=path, record=where))
            where = f"annotations[{i}] (id {ann.id})"
            img = images.get(ann.image_id)
            if img is None:
                raise VlbertsError(f"image_id {ann.image_id} is not in images", path=path, record=where)
            if ann.category_id not in categories:
                raise VlbertsError(f"category_id {ann.category_id} is not in categories", path=path, record=where)
            require_box(ann.box_xyxy, img.width, img.height, what=f"bbox {_shown(ann.bbox)}", allow_empty=True,
                        path=path, record=where)
            require_unique(first, ann.id, f"annotations[{i}]", what="annotation id", path=path, record=where)
        except VlbertsError as err:
            bad.handle(err)
            if ann is not None and dropped is not None and ann.id not in first:
                dropped.add(ann.id)
            continue
        annotations[ann.id] = ann
    return images, annotations, categories


def read_refcoco(refs_path: str | Path, instances_path: str | Path, bad: BadRecords | None = None) -> RefCocoData:
    """Read refs and instances and check that they agree (image, annotation and category of every ref).

    A ref's annotation is its gold box, so it must have a positive width and height. With `bad` skipping,
    malformed records are dropped and counted (`read_refs`, `read_instances`), and so is a ref whose image
    ("missing image") or annotation ("missing annotation") is not in the instances or disagrees with them,
    or whose gold box has zero area ("bad box")."""
    bad = bad if bad is not None else BadRecords()
    refs_path = Path(refs_path)
    all_refs = _read_refs(refs_path, bad)
    dropped: set[int] = set()
    images, annotations, categories = read_instances(instances_path, bad, dropped)
    refs = []
    for i, ref in all_refs:
        where = f"refs[{i}] (ref_id {ref.ref_id})"
        ann = annotations.get(ref.ann_id)
        if ann is None and ref.ann_id in dropped:  # its annotation was bad, and counted as such
            continue
        try:
            if ref.image_id not in images:
                bad.handle(VlbertsError(f"image_id {ref.image_id} is not in {Path(instances_path).name}",
                                        path=refs_path, record=where), "missing image")
                continue
            if ann is None:
                raise VlbertsError(f"ann_id {ref.ann_id} is not in {Path(instances_path).name}",
                                   path=refs_path, record=where)
            if ann.image_id != ref.image_id:
                raise VlbertsError(f"image_id {ref.image_id} differs from its annotation's image_id {ann.image_id}",
                                   path=refs_path, record=where)
            if ann.category_id != ref.category_id:
                raise VlbertsError(f"category_id {ref.category_id} differs from its annotation's {ann.category_id}",
                                   path=refs_path, record=where)
        except VlbertsError as err:
            bad.handle(err, "missing annotation")
            continue
        img = images[ref.image_id]
        try:
            require_box(ann.box_xyxy, img.width, img.height, what=f"bbox {_shown(ann.bbox)}", path=instances_path,
                        record=f"annotation id {ann.id} (the gold box of ref_id {ref.ref_id})")
        except VlbertsError as err:
            bad.handle(err, "bad box")
            continue
        refs.append(ref)
    return RefCocoData(tuple(refs), images, annotations, categories)


def read_detections(path: str | Path) -> dict[int, list[Box]]:
    """Read MAttNet-style detections (a JSON list of ``{image_id, box: [x, y, w, h], ...}``).

    Returns image id -> boxes (xywh, file order): the candidates of the detected-region track.
    """
    path = Path(path)
    data = read_json(path)
    if not isinstance(data, list):
        raise VlbertsError("expected a JSON list of {image_id, box} detections", path=path)
    out: dict[int, list[Box]] = {}
    for i, rec in enumerate(data):
        where = f"detections[{i}]"
        require_keys(rec, ("image_id", "box"), path=path, record=where)
        out.setdefault(_int(rec["image_id"], "image_id", path=path, record=where), []).append(
            _bbox(rec["box"], path=path, record=where))
    return out
