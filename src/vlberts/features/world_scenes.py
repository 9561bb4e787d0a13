"""Read what the world detector needs from an embedded-world directory (SPEC §7).

    WORLD/scenes.jsonl   one image per line: {"image_id", "file_name", "width", "height", "split",
                         "objects": [{"object_id", "shape", "colour", "size", "box": [x1, y1, x2, y2]}, ...]}
    WORLD/world.json     metadata; its vocabularies (shapes, colours, sizes) fix the class ids
    WORLD/images/        the PNG files named by `file_name` (relative to WORLD, or a bare name under images/)

Only those fields are read (the world writes more), so the detector depends on the world's file
format, not on its Python code. Every problem is a one-line `VlbertsError` naming the file and the
record (the line number and image id). Letters: G gold objects of one image.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from vlberts.errors import VlbertsError
from vlberts.io import DuplicateKey, iter_jsonl, unique_keys

_IMAGE_KEYS = ("image_id", "file_name", "width", "height", "split", "objects")
_OBJECT_KEYS = ("shape", "colour", "size", "box")


@dataclass(frozen=True)
class WorldVocab:
    """Class and attribute vocabularies; list position is the 0-based id (background excluded)."""

    shapes: tuple[str, ...]
    colours: tuple[str, ...]
    sizes: tuple[str, ...]


@dataclass(frozen=True)
class WorldImage:
    image_id: int
    file_name: str
    width: int
    height: int
    split: str
    boxes: np.ndarray  # (G, 4) float32 xyxy pixels
    shape_ids: np.ndarray  # (G,) int64 into vocab.shapes
    colour_ids: np.ndarray  # (G,) int64 into vocab.colours
    size_ids: np.ndarray  # (G,) int64 into vocab.sizes


@dataclass(frozen=True)
class WorldScenes:
    root: Path
    vocab: WorldVocab
    images: tuple[WorldImage, ...]

    def image_path(self, im: WorldImage) -> Path:
        """WORLD/file_name; a bare file name ("000000000001.png") not found there is looked up under WORLD/images/."""
        path = self.root / im.file_name
        if "/" not in im.file_name and not path.is_file() and (self.root / "images").is_dir():
            return self.root / "images" / im.file_name
        return path

    def split(self, name: str) -> list[WorldImage]:
        return [im for im in self.images if im.split == name]

    def splits(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for im in self.images:
            counts[im.split] = counts.get(im.split, 0) + 1
        return counts


def _vocab_list(meta: dict, key: str) -> list[str] | None:
    """`meta["vocab"][key]` (or `meta[key]`) as a list of names; a {name: value} object gives its keys
    in file order (world.json writes colours as {name: rgb})."""
    for holder in (meta.get("vocab"), meta.get("vocabulary"), meta):
        if isinstance(holder, dict) and isinstance(holder.get(key), (list, dict)) and holder[key]:
            return [str(v) for v in holder[key]]
    return None


def read_world_vocab(root: Path) -> WorldVocab:
    """The vocabularies in world.json; where absent, the embedded world's own (`vlberts.world.vocab`)."""
    from vlberts.world import vocab as default

    meta: dict = {}
    path = root / "world.json"
    if path.is_file():
        try:
            meta = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
        except (json.JSONDecodeError, UnicodeDecodeError, DuplicateKey) as e:
            raise VlbertsError(f"malformed JSON ({e})", path=path) from None
        if not isinstance(meta, dict):
            raise VlbertsError("expected a JSON object", path=path)
    shapes = _vocab_list(meta, "shapes") or list(default.SHAPES)
    colours = _vocab_list(meta, "colours") or _vocab_list(meta, "colors") or list(default.COLOUR_NAMES)
    sizes = _vocab_list(meta, "sizes") or list(default.SIZES)
    for name, values in (("shapes", shapes), ("colours", colours), ("sizes", sizes)):
        if len(set(values)) != len(values):
            raise VlbertsError(f"vocabulary {name} holds duplicates: {values}", path=path)
    return WorldVocab(tuple(shapes), tuple(colours), tuple(sizes))


def _int(v: object, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not float(v).is_integer():
        raise ValueError(f"{name} must be an integer, got {v!r}")
    return int(v)


def _parse_image(rec: object, vocab: WorldVocab, lookup: dict[str, dict[str, int]]) -> WorldImage:
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    missing = [k for k in _IMAGE_KEYS if k not in rec]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    image_id = _int(rec["image_id"], "image_id")
    w, h = _int(rec["width"], "width"), _int(rec["height"], "height")
    if image_id < 0 or w <= 0 or h <= 0:
        raise ValueError(f"image_id must be >= 0 and width/height > 0, got {image_id}, {w}, {h}")
    if not isinstance(rec["file_name"], str) or not rec["file_name"]:
        raise ValueError(f"file_name must be a non-empty string, got {rec['file_name']!r}")
    if not isinstance(rec["split"], str) or not rec["split"]:
        raise ValueError(f"split must be a non-empty string, got {rec['split']!r}")
    if not isinstance(rec["objects"], list):
        raise ValueError("objects must be a list")
    boxes, ids = [], {"shape": [], "colour": [], "size": []}
    for k, o in enumerate(rec["objects"]):
        if not isinstance(o, dict) or any(key not in o for key in _OBJECT_KEYS):
            raise ValueError(f"object {k} must be an object with {', '.join(_OBJECT_KEYS)}")
        box = o["box"]
        if (
            not isinstance(box, list) or len(box) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box)
        ):
            raise ValueError(f"object {k} box must be 4 finite numbers [x1, y1, x2, y2], got {box!r}")
        x1, y1, x2, y2 = (float(v) for v in box)
        if not (0 <= x1 < x2 <= w and 0 <= y1 < y2 <= h):
            raise ValueError(f"object {k} box {box} is not a non-empty xyxy box inside the {w}x{h} image")
        boxes.append((x1, y1, x2, y2))
        for field, table in lookup.items():
            value = o[field]
            if value not in table:
                raise ValueError(f"object {k} {field} {value!r} is not in the world's vocabulary {list(table)}")
            ids[field].append(table[value])
    return WorldImage(
        image_id=image_id, file_name=rec["file_name"], width=w, height=h, split=rec["split"],
        boxes=np.asarray(boxes, np.float32).reshape(-1, 4),
        shape_ids=np.asarray(ids["shape"], np.int64), colour_ids=np.asarray(ids["colour"], np.int64),
        size_ids=np.asarray(ids["size"], np.int64),
    )


def read_world_scenes(root: str | Path, check_images: bool = True) -> WorldScenes:
    """Read WORLD/scenes.jsonl (and the vocabularies); with `check_images`, every image file must exist.

    Checking files up front means a missing image is reported before minutes of training, not after.
    """
    root = Path(root)
    path = root / "scenes.jsonl"
    if not root.is_dir():
        raise VlbertsError("world directory not found", path=root)
    if not path.is_file():
        raise VlbertsError("scenes.jsonl not found (is this a world directory? build one with `vlberts world build`)", path=path)
    vocab = read_world_vocab(root)
    lookup = {
        "shape": {v: i for i, v in enumerate(vocab.shapes)},
        "colour": {v: i for i, v in enumerate(vocab.colours)},
        "size": {v: i for i, v in enumerate(vocab.sizes)},
    }
    world = WorldScenes(root=root, vocab=vocab, images=())
    images: list[WorldImage] = []
    first_line: dict[int, int] = {}
    for lineno, rec in iter_jsonl(path):
        where = f"line {lineno}" + (f" (image {rec['image_id']})" if isinstance(rec, dict) and "image_id" in rec else "")
        try:
            im = _parse_image(rec, vocab, lookup)
        except ValueError as e:
            raise VlbertsError(str(e), path=path, record=where) from None
        if im.image_id in first_line:
            first = first_line[im.image_id]
            raise VlbertsError(f"duplicate image id {im.image_id} (first on line {first})", path=path, record=where)
        first_line[im.image_id] = lineno
        if check_images and not world.image_path(im).is_file():
            raise _image_not_found(world, im)
        images.append(im)
    if not images:
        raise VlbertsError("no images in scenes.jsonl", path=path)
    return WorldScenes(root=root, vocab=vocab, images=tuple(images))


def _image_not_found(world: WorldScenes, im: WorldImage) -> VlbertsError:
    """The error for an image file that is not there: it names the images folder when that folder is
    missing or empty (a world copied without its images), else the file."""
    path = world.image_path(im)
    bare = "/" not in im.file_name
    folder = world.root / "images" if bare else path.parent
    where = f"image {im.image_id}"
    if not folder.is_dir():
        also = " (nor is it in the world directory)" if bare else ""
        return VlbertsError(f"images folder not found: scenes.jsonl names {im.file_name} in it{also}", path=folder,
                            record=where)
    if not any(folder.iterdir()):
        return VlbertsError(f"images folder is empty: scenes.jsonl names {im.file_name} in it", path=folder,
                            record=where)
    return VlbertsError("image file not found", path=path, record=where)


def load_image(world: WorldScenes, im: WorldImage) -> np.ndarray:
    """One world image as (H, W, 3) uint8 RGB; missing, unreadable or wrongly sized files are errors."""
    path = world.image_path(im)
    if not path.is_file():
        raise _image_not_found(world, im)
    try:
        with Image.open(path) as img:
            arr = np.asarray(img.convert("RGB"))
    except (OSError, ValueError) as e:
        raise VlbertsError(f"cannot read image ({e})", path=path, record=f"image {im.image_id}") from None
    if arr.shape[:2] != (im.height, im.width):
        raise VlbertsError(
            f"image is {arr.shape[1]}x{arr.shape[0]} but scenes.jsonl says {im.width}x{im.height}",
            path=path,
            record=f"image {im.image_id}",
        )
    return arr
