"""Reading COCO-style caption files: the official captions json and Karpathy's split json.

Formats (formats-and-metrics.md §2.1):

* official ``annotations/captions_{train,val}2014.json``:
  ``{info, licenses, images: [{id, file_name, width, height, ...}], annotations: [{id, image_id, caption}]}``
* Karpathy ``dataset_{coco,flickr30k,...}.json``:
  ``{"dataset": ..., "images": [{filepath, filename, imgid, cocoid, split, sentids,
  sentences: [{tokens, raw, imgid, sentid}]}]}``; Flickr30K's has no ``filepath``/``cocoid``.
  ``split`` is train / restval / val / test; by convention ``restval`` joins train (`merge_restval`).

Image ids keep the type the file gives them (ints for COCO). `read_caption_refs` is the one entry
point that accepts either layout and gives the canonical string image ids of the region stores
(`vlberts.features.record.canonical_image_id`: 42 -> "42"); for a Karpathy image without a cocoid
the id is the file name without extension, as Flickr30K's image ids are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import read_json, require_keys, require_text, require_unique

KARPATHY_SPLITS = ("train", "restval", "val", "test")


@dataclass(frozen=True)
class CocoImage:
    image_id: int | str
    file_name: str
    width: int | None
    height: int | None


@dataclass(frozen=True)
class CocoCaption:
    caption_id: int | str
    image_id: int | str
    text: str


@dataclass(frozen=True)
class CocoCaptions:
    """An official COCO captions file: images by id, and captions in file order."""

    images: dict[int | str, CocoImage]
    captions: tuple[CocoCaption, ...]

    def by_image(self) -> dict[int | str, list[CocoCaption]]:
        out: dict[int | str, list[CocoCaption]] = {i: [] for i in self.images}
        for c in self.captions:
            out[c.image_id].append(c)
        return out


@dataclass(frozen=True)
class KarpathySentence:
    sentid: int | None
    tokens: tuple[str, ...]
    raw: str


@dataclass(frozen=True)
class KarpathyImage:
    imgid: int | None
    cocoid: int | None
    filepath: str  # "" when the file has none (Flickr30K)
    filename: str
    split: str  # train / val / test, or restval when not merged
    sentences: tuple[KarpathySentence, ...]

    @property
    def image_id(self) -> int | str:
        """cocoid when present, else the file name without its extension."""
        return self.cocoid if self.cocoid is not None else Path(self.filename).stem


@dataclass(frozen=True)
class KarpathyDataset:
    dataset: str
    images: tuple[KarpathyImage, ...]

    def split(self, name: str) -> list[KarpathyImage]:
        return [im for im in self.images if im.split == name]


def _is_id(v: Any) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, str) and v != "")


def _opt_int(rec: dict, key: str, *, path: Path, record: str) -> int | None:
    v = rec.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool):
        raise VlbertsError(f"field {key} must be an integer, got {v!r}", path=path, record=record)
    return v


def _list_field(obj: dict, key: str, *, path: Path, record: str) -> list:
    v = obj[key]
    if not isinstance(v, list):
        raise VlbertsError(f"field {key} must be a list, got {type(v).__name__}", path=path, record=record)
    return v


def read_coco_captions(path: str | Path) -> CocoCaptions:
    """Read an official COCO captions file; every caption's image must be listed in `images`."""
    path = Path(path)
    return _coco_from(read_json(path), path)


def _coco_from(obj: Any, path: Path) -> CocoCaptions:
    require_keys(obj, ("images", "annotations"), path=path, record="top level")
    images: dict[int | str, CocoImage] = {}
    for k, rec in enumerate(_list_field(obj, "images", path=path, record="top level")):
        where = f"images[{k}]"
        require_keys(rec, ("id", "file_name"), path=path, record=where)
        if not _is_id(rec["id"]) or not isinstance(rec["file_name"], str):
            raise VlbertsError("id must be an integer or string and file_name a string", path=path, record=where)
        if rec["id"] in images:
            raise VlbertsError(f"duplicate image id {rec['id']!r}", path=path, record=where)
        size = [_opt_int(rec, key, path=path, record=where) for key in ("width", "height")]
        for key, v in zip(("width", "height"), size):
            if v is not None and v <= 0:
                raise VlbertsError(f"image {rec['id']!r}: {key} must be a positive integer, got {v}",
                                   path=path, record=where)
        images[rec["id"]] = CocoImage(rec["id"], rec["file_name"], *size)
    captions = []
    caption_at: dict[int | str, object] = {}  # annotation id -> where it first appears
    for k, rec in enumerate(_list_field(obj, "annotations", path=path, record="top level")):
        where = f"annotations[{k}]"
        require_keys(rec, ("id", "image_id", "caption"), path=path, record=where)
        require_text(rec["caption"], "caption", path=path, record=where)
        if not _is_id(rec["id"]):
            raise VlbertsError(f"id must be an integer or a string, got {rec['id']!r}", path=path, record=where)
        require_unique(caption_at, rec["id"], where, what="annotation id", path=path)
        if rec["image_id"] not in images:
            raise VlbertsError(f"image_id {rec['image_id']!r} is not among the file's images", path=path, record=where)
        captions.append(CocoCaption(rec["id"], rec["image_id"], rec["caption"]))
    return CocoCaptions(images, tuple(captions))


def read_karpathy(path: str | Path, merge_restval: bool = True, bad: BadRecords | None = None) -> KarpathyDataset:
    """Read a Karpathy split file; with `merge_restval`, images of split "restval" get split "train".

    A malformed image record raises, or with `bad` skipping (`--skip_bad`) is dropped and counted."""
    path = Path(path)
    return _karpathy_from(read_json(path), path, merge_restval, bad)


def _karpathy_from(obj: Any, path: Path, merge_restval: bool, bad: BadRecords | None = None) -> KarpathyDataset:
    require_keys(obj, ("images",), path=path, record="top level")
    images = []
    seen: dict[str, int] = {}  # image id -> its record's index: an image listed twice would train (or rank) twice
    for k, rec in enumerate(_list_field(obj, "images", path=path, record="top level")):
        try:
            image = _karpathy_image(rec, f"images[{k}]", path, merge_restval)
            if image.image_id in seen:
                raise VlbertsError(f"duplicate image id {image.image_id} (first at images[{seen[image.image_id]}])",
                                   path=path, record=f"images[{k}]")
            seen[image.image_id] = k
            images.append(image)
        except VlbertsError as err:
            (bad or BadRecords()).handle(err)
    return KarpathyDataset(str(obj.get("dataset", "")), tuple(images))


def _karpathy_image(rec: Any, where: str, path: Path, merge_restval: bool) -> KarpathyImage:
    """One image record of a Karpathy file (`where` names it in errors)."""
    require_keys(rec, ("filename", "split", "sentences"), path=path, record=where)
    split = rec["split"]
    if split not in KARPATHY_SPLITS:
        raise VlbertsError(f"split must be one of {', '.join(KARPATHY_SPLITS)}, got {split!r}",
                           path=path, record=where)
    if merge_restval and split == "restval":
        split = "train"
    sentences = []
    for j, s in enumerate(_list_field(rec, "sentences", path=path, record=where)):
        swhere = f"{where}.sentences[{j}]"
        require_keys(s, ("raw", "tokens"), path=path, record=swhere)
        if not isinstance(s["tokens"], list) or not all(isinstance(t, str) for t in s["tokens"]):
            raise VlbertsError("tokens must be a list of strings", path=path, record=swhere)
        require_text(s["raw"], "raw", path=path, record=swhere)
        sentid = _opt_int(s, "sentid", path=path, record=swhere)
        sentences.append(KarpathySentence(sentid, tuple(s["tokens"]), s["raw"]))
    return KarpathyImage(
        imgid=_opt_int(rec, "imgid", path=path, record=where),
        cocoid=_opt_int(rec, "cocoid", path=path, record=where),
        filepath=str(rec.get("filepath", "")), filename=str(rec["filename"]), split=split,
        sentences=tuple(sentences),
    )


@dataclass(frozen=True)
class CaptionRef:
    """One caption of one image: what caption pre-training and the probes consume."""

    image_id: str
    text: str


def _other_format(obj: Any) -> str | None:
    """What a JSON value read as captions looks like instead, with the --captions_format that reads it, or None."""
    if isinstance(obj, list) and obj and isinstance(obj[0], dict):
        if "sentf" in obj[0]:
            return "a list of {img_id, sentf, labelf} records, LXMERT's corpus: pass --captions_format=lxmert"
        if "sent" in obj[0] and "identifier" in obj[0]:
            return "a list of NLVR2 statements (LXMERT's form): pass --captions_format=nlvr2"
        if "sent" in obj[0]:
            return "a list of LXMERT's question records: pass --captions_format=vqa (or gqa)"
    if isinstance(obj, dict) and "questions" in obj and "annotations" not in obj:
        return "VQA v2 questions: pass --captions_format=vqa"
    return None


def read_caption_refs(path: str | Path, split: str = "train", merge_restval: bool = True) -> list[CaptionRef]:
    """(image id, caption text) pairs from an official COCO captions file or a Karpathy split file.

    The layout is recognised by its top-level keys (``annotations`` for COCO); `split` applies to
    Karpathy files only (an official file is one split already: a split other than the default "train" is
    an error for it, not ignored). With `merge_restval` a Karpathy file's "train" holds its restval images
    too (as the papers train); "restval" alone reads those. Image ids are canonical strings.
    """
    path = Path(path)
    if path.suffix.lower() == ".jsonl":  # (read as JSON it would fail on its second line's "Extra data")
        raise VlbertsError("a JSON-lines file, not COCO captions: VCR's? pass --captions_format=vcr (or the format of "
                           "the task's texts)", path=path)
    obj = read_json(path)
    hint = _other_format(obj)
    if hint:
        raise VlbertsError(f"neither a COCO captions file nor a Karpathy split file: {hint}", path=path)
    if isinstance(obj, dict) and "annotations" in obj:
        if split != "train":
            raise VlbertsError(f"an official COCO captions file is one split already (the file); split {split!r} "
                               "picks the images of a Karpathy split file", path=path)
        coco = _coco_from(obj, path)
        return [CaptionRef(str(c.image_id), c.text) for c in coco.captions]
    if split not in ("train", "val", "test", "restval"):
        raise VlbertsError(f"split must be train, val, test or restval, got {split!r}", path=path)
    images = obj.get("images") if isinstance(obj, dict) else None
    if isinstance(images, list) and images and isinstance(images[0], dict) and "sentences" not in images[0]:
        # COCO's images list without its annotations, read as a Karpathy file, would blame images[0]
        raise VlbertsError("neither a COCO captions file (no 'annotations' list) nor a Karpathy split file "
                           "(images[0] has no 'sentences')", path=path)
    data = _karpathy_from(obj, path, merge_restval and split != "restval")
    refs = [CaptionRef(str(im.image_id), s.raw) for im in data.split(split) for s in im.sentences]
    if not refs:
        raise VlbertsError(f"no captions in split {split!r}", path=path)
    return refs
