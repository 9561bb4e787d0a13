"""The embedded world's closed vocabulary: shapes, colours, sizes, relation words.

Everything the grammar, the question generator and the renderer agree on lives here, so that a
vocabulary change is one edit. Colours are far apart in hue (and white in lightness) and far from
the low-saturation backgrounds, so that they stay distinguishable under the rendering noise.
"""

from __future__ import annotations

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "star", "cross", "hexagon")
SHAPE_PLURALS: dict[str, str] = {s: s + ("es" if s.endswith("ss") else "s") for s in SHAPES}

# Name -> RGB fill. Hues roughly 0, 30, 55, 130, 185, 225, 285 degrees, plus white.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "orange": (240, 130, 20),
    "yellow": (235, 215, 35),
    "green": (40, 165, 55),
    "cyan": (30, 195, 205),
    "blue": (35, 75, 215),
    "purple": (145, 50, 185),
    "white": (240, 240, 240),
}
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)

SIZES: tuple[str, ...] = ("small", "large")
# Extent (side of the square canvas the shape is drawn in) at a 128-pixel image; scaled with the image.
SIZE_EXTENTS_128: dict[str, tuple[int, int]] = {"small": (14, 22), "large": (28, 40)}

# Plausible annotator confusions for VQA answers (SPEC §7 "ten noisy annotator answers").
COLOUR_CONFUSIONS: dict[str, tuple[str, ...]] = {
    "red": ("orange", "purple"),
    "orange": ("red", "yellow"),
    "yellow": ("orange", "white"),
    "green": ("cyan", "yellow"),
    "cyan": ("green", "blue"),
    "blue": ("cyan", "purple"),
    "purple": ("blue", "red"),
    "white": ("yellow", "cyan"),
}
SHAPE_CONFUSIONS: dict[str, tuple[str, ...]] = {
    "circle": ("hexagon",),
    "square": ("diamond", "hexagon"),
    "triangle": ("diamond", "star"),
    "diamond": ("square", "triangle"),
    "star": ("cross", "triangle"),
    "cross": ("star", "square"),
    "hexagon": ("circle", "square"),
}

NUMBER_WORDS: tuple[str, ...] = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")

# Spatial relations. The first four are strict box relations with a margin; near / next to are
# box-gap relations; touching means the two shapes' pixels overlap.
POSITIONAL_RELATIONS: tuple[str, ...] = ("left", "right", "above", "below")
SYMMETRIC_RELATIONS: tuple[str, ...] = ("near", "next_to", "touching")
RELATIONS: tuple[str, ...] = POSITIONAL_RELATIONS + SYMMETRIC_RELATIONS
RELATION_WORDS: dict[str, tuple[str, ...]] = {
    "left": ("left of", "to the left of", "on the left of"),
    "right": ("right of", "to the right of", "on the right of"),
    "above": ("above",),
    "below": ("below",),
    "near": ("near",),
    "next_to": ("next to",),
    "touching": ("touching", "overlapping"),
}
OPPOSITE: dict[str, str] = {"left": "right", "right": "left", "above": "below", "below": "above"}

BACKGROUND_TONES: tuple[str, ...] = ("grey", "brown")
