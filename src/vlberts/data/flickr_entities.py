"""Reading Flickr30K Entities: phrase chains (Sentences/*.txt), boxes (Annotations/*.xml), splits.

Format (formats-and-metrics.md §2.7; BryanPlummer/flickr30k_entities README):

* ``Sentences/<image id>.txt``: one caption per line, phrases marked
  ``[/EN#<chain id>/<type 1>/<type 2>... word1 word2 ...]``. Phrases that share a chain id refer to
  the same thing (across the image's captions); ``notvisual`` phrases have the null chain id 0.
* ``Annotations/<image id>.xml``: PASCAL-VOC-like; ``<size>`` then ``<object>`` tags, each with one
  or more ``<name>`` (chain ids) and either ``<bndbox><xmin/><ymin/><xmax/><ymax/></bndbox>`` or
  ``<nobndbox>``/``<scene>`` flags.
* ``train.txt``, ``val.txt``, ``test.txt``: image ids, one per line.

Box convention. The XML holds 1-based inclusive pixel indices (a box over the first 10 columns has
xmin = 1, xmax = 10). We return the library's convention, float xyxy pixel edges, 0-based:
(xmin - 1, ymin - 1, xmax, ymax), so that x2 - x1 is the width in pixels. (The official Python utility
subtracts 1 from all four numbers, i.e. gives inclusive 0-based indices; the two differ by one pixel
in x2 and y2, which matters little at IoU 0.5 but is a choice, so it is named here.)

Image ids are strings (the file names without extension), the canonical key of region stores.
Entities whose chain has no box (scene, nobndbox, notvisual, or absent from the XML) are kept, with
no boxes; grounding code decides whether to skip them (BAN/VisualBERT do).
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vlberts.errors import VlbertsError
from vlberts.io import read_text, require_box, require_file, require_unique

Box = tuple[float, float, float, float]
SPLITS = ("train", "val", "test")
_HEADER = "[/EN#"


@dataclass(frozen=True)
class Phrase:
    first_word_index: int  # 0-based index of its first word in the caption
    words: tuple[str, ...]
    chain_id: int  # 0 = notvisual
    types: tuple[str, ...]  # e.g. ("people",), ("other",), ("people", "other")

    @property
    def text(self) -> str:
        return " ".join(self.words)

    @property
    def end(self) -> int:
        """One past the index of its last word."""
        return self.first_word_index + len(self.words)

    @property
    def last_word_index(self) -> int:
        return self.end - 1


@dataclass(frozen=True)
class EntitySentence:
    words: tuple[str, ...]  # the caption's words, markup removed
    phrases: tuple[Phrase, ...]

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass(frozen=True)
class EntityBoxes:
    """One Annotations/*.xml file."""

    filename: str | None
    width: int
    height: int
    depth: int
    boxes: dict[int, tuple[Box, ...]]  # chain id -> boxes, float xyxy 0-based pixel edges
    scene: frozenset[int]  # chains flagged <scene>1</scene>
    nobox: frozenset[int]  # chains flagged <nobndbox>1</nobndbox>


@dataclass(frozen=True)
class GroundedPhrase:
    phrase: Phrase
    boxes: tuple[Box, ...]  # empty for scene / no-box / notvisual chains
    is_scene: bool
    no_box: bool  # flagged <nobndbox>1</nobndbox>

    @property
    def chain_id(self) -> int:
        return self.phrase.chain_id


@dataclass(frozen=True)
class GroundedCaption:
    image_id: str
    index: int  # line number in Sentences/<id>.txt, 0-based
    words: tuple[str, ...]
    phrases: tuple[GroundedPhrase, ...]

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass(frozen=True)
class FlickrEntitiesImage:
    image_id: str
    width: int
    height: int
    captions: tuple[GroundedCaption, ...]


# --------------------------------------------------------------------------- Sentences

def parse_entity_sentence(line: str, *, path: str | Path = "<string>", record: object = None) -> EntitySentence:
    """Parse one marked-up caption; unbalanced brackets or a bad phrase header raise `VlbertsError`."""
    words: list[str] = []
    phrases: list[Phrase] = []
    current: list[str] | None = None  # words of the open phrase
    header: tuple[int, int, tuple[str, ...]] | None = None  # (first word index, chain, types)

    def fail(msg: str) -> VlbertsError:
        return VlbertsError(msg, path=path, record=record)

    for token in line.split():
        if token.startswith(_HEADER):
            if current is not None:
                raise fail(f"phrase header {token!r} inside an open phrase (missing ']')")
            parts = token[1:].split("/")  # ["", "EN#12", "people", ...]
            try:
                chain = int(parts[1][3:])
            except ValueError:
                raise fail(f"bad chain id in phrase header {token!r}") from None
            types = tuple(parts[2:])
            if not types or any(not t for t in types) or any("]" in t for t in types):
                raise fail(f"phrase header {token!r} names no type (expected [/EN#<chain>/<type> words...])")
            current, header = [], (len(words), chain, types)
            continue
        closes = current is not None and token.endswith("]")
        if closes:
            token = token[:-1]
        elif token.endswith("]"):
            raise fail(f"']' outside a phrase in {token!r}")
        if not token:
            raise fail("empty word (a lone ']' or a phrase without words)")
        words.append(token)
        if current is not None:
            current.append(token)
            if closes:
                assert header is not None
                phrases.append(Phrase(header[0], tuple(current), header[1], header[2]))
                current, header = None, None
    if current is not None:
        raise fail("phrase not closed: the line ends before its ']'")
    return EntitySentence(tuple(words), tuple(phrases))


def read_entity_sentences(path: str | Path) -> list[EntitySentence]:
    """All captions of one Sentences/<id>.txt file (blank lines skipped), in file order; a file without
    one is an error (Flickr30K Entities gives each image 5): its image would drop out of every count."""
    lines = read_text(path).split("\n")
    sentences = [parse_entity_sentence(line, path=path, record=f"line {k}")
                 for k, line in enumerate(lines, 1) if line.strip()]
    if not sentences:
        raise VlbertsError("holds no caption (an image's Sentences file has one per line)", path=path)
    return sentences


# --------------------------------------------------------------------------- Annotations

def _int_text(elem: ET.Element | None, what: str, path: Path, record: str) -> int:
    if elem is None or elem.text is None:
        raise VlbertsError(f"missing <{what}>", path=path, record=record)
    try:
        return int(elem.text.strip())
    except ValueError:
        raise VlbertsError(f"<{what}> is not an integer: {elem.text.strip()!r}", path=path, record=record) from None


def read_entity_boxes(path: str | Path) -> EntityBoxes:
    """Parse one Annotations/<id>.xml file; boxes converted to 0-based float xyxy (module docstring)."""
    path = require_file(path)
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise VlbertsError(f"malformed XML: {e}", path=path, record=f"line {e.position[0]}") from None
    size = root.find("size")
    if size is None:
        raise VlbertsError("missing <size>", path=path, record="size")
    width = _int_text(size.find("width"), "width", path, "size")
    height = _int_text(size.find("height"), "height", path, "size")
    depth_elem = size.find("depth")
    depth = _int_text(depth_elem, "depth", path, "size") if depth_elem is not None else 3
    boxes: dict[int, list[Box]] = {}
    scene: set[int] = set()
    nobox: set[int] = set()
    for k, obj in enumerate(root.findall("object")):
        where = f"object {k}"
        names = obj.findall("name")
        if not names:
            raise VlbertsError("<object> without <name>", path=path, record=where)
        chains = [_int_text(n, "name", path, where) for n in names]
        bnd = obj.find("bndbox")
        if bnd is not None:
            xmin, ymin, xmax, ymax = (_int_text(bnd.find(t), t, path, where) for t in ("xmin", "ymin", "xmax", "ymax"))
            if xmax < xmin or ymax < ymin:
                raise VlbertsError(f"empty box ({xmin}, {ymin}, {xmax}, {ymax})", path=path, record=where)
            # 1-based inclusive -> 0-based edges, inside the <size> image (xmax may equal the width)
            box = require_box((xmin - 1, ymin - 1, xmax, ymax), width, height, path=path, record=where,
                              what=f"<bndbox> xmin, ymin, xmax, ymax = {xmin}, {ymin}, {xmax}, {ymax} (1-based)")
            for c in chains:
                boxes.setdefault(c, []).append(box)
        else:
            flags = {t: obj.find(t) for t in ("nobndbox", "scene")}
            values = {t: (_int_text(e, t, path, where) if e is not None else 0) for t, e in flags.items()}
            if values["scene"] > 0:
                scene.update(chains)
            if values["nobndbox"] > 0:
                nobox.update(chains)
    filename = root.findtext("filename")
    return EntityBoxes(filename.strip() if filename else None, width, height, depth,
                       {c: tuple(b) for c, b in boxes.items()}, frozenset(scene), frozenset(nobox))


# --------------------------------------------------------------------------- together

def ground_sentences(image_id: str, sentences: list[EntitySentence], ann: EntityBoxes) -> list[GroundedCaption]:
    """Attach each phrase's chain boxes and flags."""
    out = []
    for k, s in enumerate(sentences):
        phrases = tuple(
            GroundedPhrase(p, ann.boxes.get(p.chain_id, ()) if p.chain_id != 0 else (),
                           is_scene=p.chain_id in ann.scene or "scene" in p.types, no_box=p.chain_id in ann.nobox)
            for p in s.phrases
        )
        out.append(GroundedCaption(str(image_id), k, s.words, phrases))
    return out


def read_flickr_entities(root: str | Path, image_id: str | int) -> FlickrEntitiesImage:
    """One image's captions with grounded phrases, from `root`/Sentences and `root`/Annotations."""
    root = Path(root)
    image_id = str(image_id)
    sentences = read_entity_sentences(root / "Sentences" / f"{image_id}.txt")
    ann = read_entity_boxes(root / "Annotations" / f"{image_id}.xml")
    return FlickrEntitiesImage(image_id, ann.width, ann.height, tuple(ground_sentences(image_id, sentences, ann)))


def read_flickr_split(root: str | Path, split: str) -> list[str]:
    """Image ids listed in `root`/{split}.txt, in file order; an id listed twice is an error naming the line
    (its captions would be read, trained on and scored twice)."""
    if split not in SPLITS:
        raise VlbertsError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    path = require_file(Path(root) / f"{split}.txt")
    first: dict[str, object] = {}  # image id -> its line
    for k, line in enumerate(read_text(path).split("\n"), 1):
        line = line.strip()
        if not line:
            continue
        if any(c.isspace() for c in line) or "/" in line:
            raise VlbertsError(f"not an image id: {line!r}", path=path, record=f"line {k}")
        require_unique(first, line, f"line {k}", what="image id", path=path)
    return list(first)


def iter_flickr_entities(root: str | Path, split: str) -> Iterator[FlickrEntitiesImage]:
    """Every image of a split, in the split file's order."""
    for image_id in read_flickr_split(root, split):
        yield read_flickr_entities(root, image_id)
