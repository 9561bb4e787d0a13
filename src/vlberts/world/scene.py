"""Scenes of the embedded world: which objects, where, and the exact ground truth.

A scene is sampled from a numpy Generator alone, so the same (seed, image id) always gives the same
scene whatever process draws it. Objects are drawn in list order: a later object occludes an earlier
one, and object ids (1-based) are that draw order.

Distractors that share attributes (SPEC §7 "a grammar that makes vision necessary"): with high
probability two objects share a shape but not a colour, and two share a colour but not a shape, so
that "circle" or "red" alone rarely picks out one object and the modifiers must be read off the image.
Occasionally two objects share both colour and shape ("two red circles"), which the grammar needs
for plural, counted noun phrases.

Occlusion: objects may overlap, but every object keeps at least 65% of its pixels visible, and two
objects of the same colour never touch (they would read as one blob).

Box convention (used by every world file except the Flickr30K Entities XML): tight xyxy integer pixel
edges, 0-based, end exclusive: an object covering pixel columns 10..29 has x1 = 10, x2 = 30, so
x2 - x1 is its width in pixels. Read as floats this is the library's box convention.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from vlberts.errors import VlbertsError
from vlberts.io import read_jsonl, require_box, require_keys, require_unique
from vlberts.world.vocab import BACKGROUND_TONES, COLOUR_NAMES, SHAPES, SIZE_EXTENTS_128

Box = tuple[int, int, int, int]


@dataclass(frozen=True)
class SceneConfig:
    """How scenes are sampled. Sizes are given for a 128-pixel image and scale with `image_size`."""

    image_size: int = 128
    min_objects: int = 3
    max_objects: int = 6
    p_shape_pair: float = 0.7  # force two objects of one shape with different colours
    p_colour_pair: float = 0.7  # force two objects of one colour with different shapes
    p_twin: float = 0.25  # force two objects of the same colour and shape (plural phrases, counts)
    p_large: float = 0.45
    min_visible: float = 0.65  # every object keeps at least this fraction of its pixels visible
    edge_margin: int = 2  # pixels kept free at the image border

    def validate(self) -> None:
        if not 64 <= self.image_size <= 4096:
            raise VlbertsError(f"image size must be between 64 and 4096 pixels, got {self.image_size}")
        if not 1 <= self.min_objects <= self.max_objects <= 9:
            raise VlbertsError(
                f"need 1 <= min_objects <= max_objects <= 9, got {self.min_objects} and {self.max_objects}"
            )

    def extent_range(self, size: str) -> tuple[int, int]:
        lo, hi = SIZE_EXTENTS_128[size]
        scale = self.image_size / 128
        return max(4, round(lo * scale)), max(5, round(hi * scale))


@dataclass(frozen=True)
class WorldObject:
    object_id: int  # 1-based draw order; later objects occlude earlier ones
    shape: str
    colour: str
    size: str  # "small" | "large"
    box: Box  # tight box of the whole shape (also where it is occluded), see module docstring
    extent: int  # side of the square canvas the shape was drawn in
    origin: tuple[int, int]  # (x, y) of that canvas' top-left pixel in the image
    visible: float  # fraction of the shape's pixels not hidden by later objects

    def to_json(self) -> dict:
        return {
            "object_id": self.object_id, "shape": self.shape, "colour": self.colour, "size": self.size,
            "box": list(self.box), "extent": self.extent, "origin": list(self.origin), "visible": self.visible,
        }


@dataclass(frozen=True)
class Background:
    tone: str  # "grey" | "brown": the word captions may use for it
    rgb: tuple[int, int, int]  # base colour before blobs and noise


@dataclass(frozen=True)
class Scene:
    image_id: int
    width: int
    height: int
    background: Background
    objects: tuple[WorldObject, ...]
    touching: frozenset[tuple[int, int]]  # (i, j) object ids, i < j, whose shapes share pixels

    @property
    def file_name(self) -> str:
        return image_file_name(self.image_id)

    def to_json(self, split: str) -> dict:
        return {
            "image_id": self.image_id, "file_name": self.file_name, "width": self.width, "height": self.height,
            "split": split,
            "background": {"tone": self.background.tone, "rgb": list(self.background.rgb)},
            "objects": [o.to_json() for o in self.objects],
            "touching": [list(p) for p in sorted(self.touching)],
        }


def image_file_name(image_id: int) -> str:
    return f"{image_id:012d}.png"


# --------------------------------------------------------------------------- shape masks

@lru_cache(maxsize=None)
def shape_mask(shape: str, extent: int) -> np.ndarray:
    """Boolean (extent, extent) mask of `shape` drawn to fill a square canvas (cached; do not modify)."""
    e = extent - 1  # PIL coordinates are pixel centres: 0 .. extent-1
    c = e / 2
    img = Image.new("L", (extent, extent), 0)
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse((0, 0, e, e), fill=1)
    elif shape == "square":
        draw.rectangle((0, 0, e, e), fill=1)  # full canvas: every shape's longer side is its extent
    elif shape == "triangle":
        draw.polygon([(c, 0), (e, e), (0, e)], fill=1)
    elif shape == "diamond":
        draw.polygon([(c, 0), (e, c), (c, e), (0, c)], fill=1)
    elif shape == "star":
        pts = []
        for k in range(10):
            r = c if k % 2 == 0 else 0.45 * c
            a = -np.pi / 2 + k * np.pi / 5
            pts.append((c + r * np.cos(a), c + r * np.sin(a)))
        draw.polygon(pts, fill=1)
    elif shape == "cross":
        t = e / 3
        draw.rectangle((t, 0, e - t, e), fill=1)
        draw.rectangle((0, t, e, e - t), fill=1)
    elif shape == "hexagon":
        pts = [(c + c * np.cos(np.pi / 3 * k), c + c * np.sin(np.pi / 3 * k)) for k in range(6)]
        draw.polygon(pts, fill=1)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    mask = np.asarray(img, dtype=bool)
    mask.setflags(write=False)
    return mask


@lru_cache(maxsize=None)
def _mask_bounds(shape: str, extent: int) -> tuple[int, int, int, int, int]:
    """(c0, r0, c1, r1, area): tight bounds of the mask inside its canvas (end exclusive) and its pixel count."""
    m = shape_mask(shape, extent)
    rows, cols = np.flatnonzero(m.any(axis=1)), np.flatnonzero(m.any(axis=0))
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1, int(m.sum())


# --------------------------------------------------------------------------- sampling

def _attributes(rng: np.random.Generator, n: int, cfg: SceneConfig) -> tuple[list[str], list[str], list[str]]:
    """Uniform colours and shapes, then the forced shared-attribute pairs (module docstring)."""
    shapes = [SHAPES[i] for i in rng.integers(len(SHAPES), size=n)]
    colours = [COLOUR_NAMES[i] for i in rng.integers(len(COLOUR_NAMES), size=n)]
    sizes = ["large" if u < cfg.p_large else "small" for u in rng.random(n)]
    perm = [int(i) for i in rng.permutation(n)]
    u_shape, u_colour, u_twin = rng.random(3)

    def other(values: tuple[str, ...], not_this: str) -> str:
        return [v for v in values if v != not_this][int(rng.integers(len(values) - 1))]

    def has_pair(same: list[str], diff: list[str]) -> bool:
        return any(same[i] == same[j] and diff[i] != diff[j] for i in range(n) for j in range(i + 1, n))

    if n >= 2 and u_shape < cfg.p_shape_pair and not has_pair(shapes, colours):
        a, b = perm[0], perm[1]
        shapes[b] = shapes[a]
        if colours[b] == colours[a]:
            colours[b] = other(COLOUR_NAMES, colours[a])
    if n >= 3 and u_colour < cfg.p_colour_pair and not has_pair(colours, shapes):
        a, c = perm[0], perm[2]  # leaves the shape pair (perm[0], perm[1]) intact
        colours[c] = colours[a]
        if shapes[c] == shapes[a]:
            shapes[c] = other(SHAPES, shapes[a])
    if n >= 4 and u_twin < cfg.p_twin:
        src, dst = perm[int(rng.integers(3))], perm[3]  # copying onto perm[3] keeps both pairs above
        shapes[dst], colours[dst] = shapes[src], colours[src]
    return shapes, colours, sizes


def _place(rng: np.random.Generator, shapes, colours, sizes, cfg: SceneConfig, image_id: int) -> Scene | None:
    """Place objects one by one, rejecting positions that hide too much of an earlier object."""
    S = cfg.image_size
    n = len(shapes)
    label = np.zeros((S, S), dtype=np.int8)  # (S, S): 0 background, k = object k on top
    visible = [0] * n  # visible pixel count per placed object
    areas, extents, origins, boxes = [], [], [], []
    for k in range(n):
        lo, hi = cfg.extent_range(sizes[k])
        e = int(rng.integers(lo, hi + 1))
        mask = shape_mask(shapes[k], e)
        c0, r0, c1, r1, area = _mask_bounds(shapes[k], e)
        hi_pos = S - cfg.edge_margin - e
        if hi_pos < cfg.edge_margin:
            return None
        same_colour = [j + 1 for j in range(k) if colours[j] == colours[k]]
        for _ in range(40):
            x, y = (int(v) for v in rng.integers(cfg.edge_margin, hi_pos + 1, size=2))
            # Two shapes of one colour that touch would read as one blob: keep 2 pixels between them.
            if same_colour and np.isin(label[max(0, y - 2):y + e + 2, max(0, x - 2):x + e + 2], same_colour).any():
                continue
            under = label[y:y + e, x:x + e][mask]  # labels this shape would cover
            lost = np.bincount(under, minlength=k + 1)
            if all(visible[j] - lost[j + 1] >= cfg.min_visible * areas[j] for j in range(k)):
                break
        else:
            return None
        for j in range(k):
            visible[j] -= int(lost[j + 1])
        label[y:y + e, x:x + e][mask] = k + 1
        visible[k] = area
        areas.append(area)
        extents.append(e)
        origins.append((x, y))
        boxes.append((x + c0, y + r0, x + c1, y + r1))

    touching = set()
    for i in range(n):
        for j in range(i + 1, n):
            bi, bj = boxes[i], boxes[j]
            x1, y1, x2, y2 = max(bi[0], bj[0]), max(bi[1], bj[1]), min(bi[2], bj[2]), min(bi[3], bj[3])
            if x1 >= x2 or y1 >= y2:
                continue
            (xi, yi), (xj, yj) = origins[i], origins[j]
            mi = shape_mask(shapes[i], extents[i])[y1 - yi:y2 - yi, x1 - xi:x2 - xi]
            mj = shape_mask(shapes[j], extents[j])[y1 - yj:y2 - yj, x1 - xj:x2 - xj]
            if (mi & mj).any():
                touching.add((i + 1, j + 1))

    objects = tuple(
        WorldObject(
            object_id=k + 1, shape=shapes[k], colour=colours[k], size=sizes[k], box=boxes[k],
            extent=extents[k], origin=origins[k], visible=round(visible[k] / areas[k], 3),
        )
        for k in range(n)
    )
    return Scene(image_id, S, S, _background(rng), objects, frozenset(touching))


def _background(rng: np.random.Generator) -> Background:
    """A low-saturation grey or brown, never close to any object colour (SPEC §7 textured backgrounds)."""
    tone = BACKGROUND_TONES[int(rng.integers(len(BACKGROUND_TONES)))]
    level = rng.uniform(80, 150)
    if tone == "grey":
        tint = rng.uniform(-3, 3, size=3)
    else:
        tint = np.array([14.0, 4.0, -12.0]) * rng.uniform(0.7, 1.0)
    rgb = tuple(int(round(v)) for v in level + tint)
    return Background(tone, rgb)  # type: ignore[arg-type]


def sample_scene(rng: np.random.Generator, image_id: int, cfg: SceneConfig = SceneConfig()) -> Scene:
    """Draw one scene; a crowded draw that cannot keep every object visible enough is redrawn."""
    for _ in range(200):
        n = int(rng.integers(cfg.min_objects, cfg.max_objects + 1))
        shapes, colours, sizes = _attributes(rng, n, cfg)
        if max(Counter(zip(sizes, colours, shapes)).values()) > 3:
            continue  # four identical objects could not all be referred to (plural phrases stop at three)
        scene = _place(rng, shapes, colours, sizes, cfg, image_id)
        if scene is not None:
            return scene
    raise VlbertsError(
        f"could not place {cfg.max_objects} objects in a {cfg.image_size}-pixel image; use fewer objects"
    )


# --------------------------------------------------------------------------- reading scenes.jsonl

def scene_from_json(rec: dict, *, path: str | Path = "", record: object = None) -> tuple[Scene, str]:
    """One `scenes.jsonl` line -> (Scene, split). Malformed records (missing keys, boxes outside the image,
    object ids other than 1..N in order, touching pairs naming no object) raise `VlbertsError`."""
    require_keys(rec, ("image_id", "width", "height", "split", "objects"), path=path, record=record)
    try:
        bg = rec.get("background") or {"tone": "grey", "rgb": [128, 128, 128]}
        objects = []
        for k, o in enumerate(rec["objects"]):
            require_keys(o, ("object_id", "shape", "colour", "size", "box"), path=path, record=f"{record} object {k}")
            box = tuple(int(v) for v in o["box"])
            if len(box) != 4:
                raise ValueError(f"object {k} box has {len(box)} numbers, expected 4")
            objects.append(WorldObject(
                object_id=int(o["object_id"]), shape=str(o["shape"]), colour=str(o["colour"]), size=str(o["size"]),
                box=box, extent=int(o.get("extent", box[2] - box[0])),  # type: ignore[arg-type]
                origin=tuple(o.get("origin", box[:2])), visible=float(o.get("visible", 1.0)),  # type: ignore[arg-type]
            ))
        scene = Scene(
            image_id=int(rec["image_id"]), width=int(rec["width"]), height=int(rec["height"]),
            background=Background(str(bg["tone"]), tuple(int(v) for v in bg["rgb"])),  # type: ignore[arg-type]
            objects=tuple(objects),
            touching=frozenset(_touching_pair(p) for p in rec.get("touching", [])),
        )
    except (TypeError, ValueError, KeyError) as e:
        raise VlbertsError(f"malformed scene: {e}", path=path, record=record) from None
    for k, o in enumerate(scene.objects):  # the relations and IoUs read from the boxes need them inside the image
        require_box(o.box, scene.width, scene.height, path=path, record=f"{record} object {k}")
    _check_object_ids(scene, path, record)
    return scene, str(rec["split"])


def _check_object_ids(scene: Scene, path: str | Path, record: object) -> None:
    """Object ids are the draw order, 1..N (`WorldObject`): the relations (`relations.scene_geometry`) read
    object k as row k - 1 and `touching` by object id, so other ids, or a touching pair naming an object the
    scene does not have, would index out of range or silently relate the wrong objects."""
    ids = [o.object_id for o in scene.objects]
    if ids != list(range(1, len(ids) + 1)):
        raise VlbertsError(f"object ids must be 1..{len(ids)} in order, got {ids[:8]}", path=path, record=record)
    for pair in sorted(scene.touching):
        if not all(1 <= i <= len(ids) for i in pair):
            raise VlbertsError(f"touching pair {list(pair)} names an object the scene does not have "
                               f"(object ids 1..{len(ids)})", path=path, record=record)


def _touching_pair(p: object) -> tuple[int, int]:
    """A "touching" entry: two object ids (a ValueError otherwise, which the caller names)."""
    if not isinstance(p, (list, tuple)) or len(p) != 2:
        raise ValueError(f"touching entry {p!r} is not a pair of object ids")
    return int(p[0]), int(p[1])


def read_scenes(path: str | Path) -> list[tuple[Scene, str]]:
    """Read a world's `scenes.jsonl` -> [(Scene, split)] in file order (image id order); an image listed
    twice is an error (which of its scenes holds?)."""
    scenes, seen = [], {}
    for i, rec in enumerate(read_jsonl(path), 1):
        scene, split = scene_from_json(rec, path=path, record=f"line {i}")
        require_unique(seen, scene.image_id, f"line {i}", what="image_id", path=path)
        scenes.append((scene, split))
    return scenes


def scene_line(scene: Scene, split: str) -> str:
    return json.dumps(scene.to_json(split), separators=(",", ":"))


__all__ = [
    "Background", "Box", "Scene", "SceneConfig", "WorldObject", "image_file_name", "read_scenes",
    "sample_scene", "scene_from_json", "scene_line", "shape_mask",
]
