"""RefCOCO+-style referring expressions for the embedded world, exported in the released refer-API format.

RefCOCO+ (Yu et al. 2016; ViLBERT §4, VL-BERT §4.2.3) was collected with the ReferItGame in COCO images
that hold two or more objects of one category, and its players were forbidden to use location words,
so the expressions describe the referred object by its appearance alone ("man in red shirt", "blue
car"). The world's analogue:

* a ref is an object that shares its shape (the world's COCO category) with another object of its
  image and that some appearance descriptor (a subset of size, colour, shape: `relations.scene_referents`)
  picks out uniquely; objects that no appearance description singles out get no ref;
* each ref has 2 or 3 expressions, each built from one of its unique descriptors ("the large red circle",
  "blue star", "small green one", "red", "the circle in red"); no expression uses a location or relation
  word (`LOCATION_WORDS`: left, right, top, bottom, above, ... -- the RefCOCO+ rule);
* splits follow the world's image split: train -> ``train``, val -> ``val``, test -> ``testA`` or
  ``testB``. RefCOCO+'s testA holds people and testB other objects; here testA holds the refs to the
  three simplest shapes (`TEST_A_SHAPES`: circle, square, triangle, the world's "people") and testB the
  refs to the other four. Unlike RefCOCO+, whose testA and testB images are disjoint, a test image can
  have refs in both (splitting by image would drop the refs of the other group).

Files (formats-and-metrics.md §2.6; read back by `vlberts.data.refcoco`):

    refcoco+/refs(unc).p     a pickle (protocol 2, as released) of a list of plain dicts:
                             {ref_id, ann_id, image_id, category_id, split, file_name, sent_ids,
                              sentences: [{raw, sent, sent_id, tokens}]}
    refcoco+/refs.json       the same list as JSON
    refcoco+/instances.json  COCO style: info, licenses, images (every image with a ref), annotations
                             (one per object of those images: id, image_id, category_id, bbox [x, y, w, h]
                             in pixels, area = w * h, iscrowd 0, segmentation = the box as a polygon),
                             categories (the world's shapes, ids 1..7 in vocabulary order)

Ids: ann_id = ref_id = image_id * 100 + object id (the Flickr30K chain-id / GQA object-id convention of
`export`), sent_id = ref_id * 10 + k, category_id = 1 + the shape's index in `vocab.SHAPES`; file_name
is ``{image_id:012d}_{ann_id}.png`` (RefCOCO's ``COCO_train2014_<image>_<ann>.jpg`` pattern).

Determinism: everything random is drawn from ``SeedSequence([seed, REFCOCO_STREAM, image_id])``, a
stream of its own, so adding RefCOCO+ changed no byte of any earlier world file.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vlberts.world.relations import Referents, values_of
from vlberts.world.scene import Scene
from vlberts.world.vocab import SHAPES

REFCOCO_STREAM = 6172003  # the second entropy word of this task's SeedSequence (module docstring)
ANN_ID_FACTOR = 100  # ann_id = image_id * 100 + object id
SENT_ID_FACTOR = 10  # sent_id = ref_id * 10 + k
TEST_A_SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
# Words RefCOCO+ forbids (absolute location) and the world's relation words: no expression holds one.
LOCATION_WORDS: frozenset[str] = frozenset({
    "left", "right", "top", "bottom", "above", "below", "under", "over", "middle", "center", "centre",
    "front", "behind", "back", "near", "next", "beside", "corner", "upper", "lower", "side", "touching",
    "overlapping", "first", "second", "third", "last", "closest", "farthest",
})
# Nouns standing in for the shape when a descriptor leaves it out ("the small green one").
_PRONOUNS = ("one", "shape", "object", "thing")


@dataclass(frozen=True)
class WorldRef:
    """One referred object and its expressions (raw text, as an annotator typed it)."""

    object_id: int
    shape: str
    expressions: tuple[str, ...]


def _phrase(values: dict[str, str], descriptor: tuple[str, ...], rng: np.random.Generator) -> str:
    """An appearance-only noun phrase for the attributes in `descriptor` (size, colour, shape order)."""
    words = [values[a] for a in descriptor]
    if "shape" in descriptor:
        form = int(rng.integers(3 if "colour" in descriptor else 2))
        if form == 2:  # "the circle in red", "large circle in red"
            rest = [values[a] for a in descriptor if a != "colour"]
            return f"{'the ' if rng.random() < 0.5 else ''}{' '.join(rest)} in {values['colour']}"
        return ("the " if form == 1 else "") + " ".join(words)
    if descriptor == ("colour",) and rng.random() < 0.3:
        return words[0]  # RefCOCO+ has one-word expressions ("red")
    noun = _PRONOUNS[int(rng.integers(len(_PRONOUNS)))]
    return f"{'the ' if rng.random() < 0.5 else ''}{' '.join(words)} {noun}"


def generate_refs(scene: Scene, rng: np.random.Generator, refs: Referents) -> list[WorldRef]:
    """The refs of one scene (module docstring), in object id order; 2 or 3 distinct expressions each
    when the descriptors allow (fewer distinct ones only repeat a phrase if there is no other)."""
    shape_count: dict[str, int] = {}
    for o in scene.objects:
        shape_count[o.shape] = shape_count.get(o.shape, 0) + 1
    out = []
    for o in scene.objects:
        descriptors = refs.unique.get(o.object_id, ())
        if shape_count[o.shape] < 2 or not descriptors:
            continue
        values = dict(zip(("size", "colour", "shape"), values_of(o, ("size", "colour", "shape"))))
        n = int(rng.integers(2, 4))
        texts: list[str] = []
        for _ in range(4 * n):  # a few tries for distinct expressions
            d = descriptors[int(rng.integers(len(descriptors)))]
            text = _phrase(values, d, rng)
            if text not in texts:
                texts.append(text)
            if len(texts) == n:
                break
        raw = tuple(t[0].upper() + t[1:] if rng.random() < 0.3 else t for t in texts)
        out.append(WorldRef(o.object_id, o.shape, raw))
    return out


def ann_id(image_id: int, object_id: int) -> int:
    return image_id * ANN_ID_FACTOR + object_id


def category_id(shape: str) -> int:
    return SHAPES.index(shape) + 1


def ref_split(world_split: str, shape: str) -> str:
    """RefCOCO+ split of a ref: train/val as the image; test -> testA (`TEST_A_SHAPES`) or testB."""
    if world_split != "test":
        return world_split
    return "testA" if shape in TEST_A_SHAPES else "testB"


def ref_record(scene: Scene, ref: WorldRef, world_split: str) -> dict:
    """One entry of ``refs(unc).p`` (the released keys)."""
    rid = ann_id(scene.image_id, ref.object_id)
    sentences = []
    for k, raw in enumerate(ref.expressions):
        sent = raw.lower()
        sentences.append({"tokens": sent.split(), "raw": raw, "sent_id": rid * SENT_ID_FACTOR + k, "sent": sent})
    return {
        "sent_ids": [s["sent_id"] for s in sentences],
        "file_name": f"{scene.image_id:012d}_{rid}.png",
        "ann_id": rid,
        "ref_id": rid,
        "image_id": scene.image_id,
        "split": ref_split(world_split, ref.shape),
        "sentences": sentences,
        "category_id": category_id(ref.shape),
    }


def instance_annotations(scene: Scene) -> list[dict]:
    """COCO instance annotations of every object of the scene (the ground-truth-region candidates)."""
    out = []
    for o in scene.objects:
        x1, y1, x2, y2 = o.box
        w, h = x2 - x1, y2 - y1
        out.append({
            "id": ann_id(scene.image_id, o.object_id), "image_id": scene.image_id,
            "category_id": category_id(o.shape), "bbox": [x1, y1, w, h], "area": w * h, "iscrowd": 0,
            "segmentation": [[x1, y1, x2, y1, x2, y2, x1, y2]],
        })
    return out


def instances_file(images: list[dict], annotations: list[dict], info: dict, licenses: list[dict]) -> dict:
    """COCO ``instances.json``: the world's shapes as categories, 1-based ids in vocabulary order."""
    categories = [{"id": category_id(s), "name": s, "supercategory": "shape"} for s in SHAPES]
    return {"info": info, "licenses": licenses, "images": images, "annotations": annotations,
            "categories": categories}
