"""Spatial relations and referring descriptors, computed exactly from a scene's boxes and pixels.

Captions and questions only state what these functions say is true, and questions only ask what
they say is well defined.

Relations (object i REL object j), with a margin m = max(2, 2% of the image side):
- left:  box_i.x2 + m <= box_j.x1   (all of i lies left of all of j);  right, above, below alike.
- near:  the gap between the two boxes is at most 10% of the image side.
- next_to: near, and the boxes overlap vertically by at least half the smaller height (side by side).
- touching: the two shapes share pixels (one partly occludes the other).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from vlberts.world.scene import Scene, WorldObject
from vlberts.world.vocab import OPPOSITE

ATTRIBUTES: tuple[str, ...] = ("size", "colour", "shape")  # also the word order inside a noun phrase
DESCRIPTORS: tuple[tuple[str, ...], ...] = tuple(
    d for r in (1, 2, 3) for d in itertools.combinations(ATTRIBUTES, r)
)  # the 7 non-empty attribute subsets, each in noun-phrase order


@dataclass(frozen=True)
class Geometry:
    """Pairwise relations between the objects of one scene; row/column k is object id k + 1."""

    holds: dict[str, np.ndarray]  # relation -> (n, n) bool, holds[r][i, j]: object i is r of object j
    clearly_not: dict[str, np.ndarray]  # positional relation -> (n, n) bool: i is clearly not r of j
    pairs: dict[str, frozenset[tuple[int, int]]]  # relation -> {(id_i, id_j)} where it holds (fast lookup)

    def rel(self, relation: str, a: tuple[int, ...], b: tuple[int, ...]) -> bool:
        """Does `relation` hold from every object id in `a` to every object id in `b`?"""
        s = self.pairs[relation]
        return all((i, j) in s for i in a for j in b)


def scene_geometry(scene: Scene) -> Geometry:
    S = scene.width
    n = len(scene.objects)
    margin = max(2, round(0.02 * S))
    near_px = 0.1 * S
    b = np.array([o.box for o in scene.objects], dtype=np.float64).reshape(n, 4)  # (n, 4)
    x1, y1, x2, y2 = (b[:, k] for k in range(4))
    left = x2[:, None] + margin <= x1[None, :]
    above = y2[:, None] + margin <= y1[None, :]
    dx = np.maximum(0, np.maximum(x1[None, :] - x2[:, None], x1[:, None] - x2[None, :]))
    dy = np.maximum(0, np.maximum(y1[None, :] - y2[:, None], y1[:, None] - y2[None, :]))
    off_diag = ~np.eye(n, dtype=bool)
    near = (np.hypot(dx, dy) <= near_px) & off_diag
    h = y2 - y1
    v_overlap = np.minimum(y2[:, None], y2[None, :]) - np.maximum(y1[:, None], y1[None, :])
    next_to = near & (v_overlap >= 0.5 * np.minimum(h[:, None], h[None, :]))
    touching = np.zeros((n, n), dtype=bool)
    for i, j in scene.touching:
        touching[i - 1, j - 1] = touching[j - 1, i - 1] = True
    holds = {
        "left": left, "right": left.T, "above": above, "below": above.T,
        "near": near, "next_to": next_to, "touching": touching,
    }
    # "Clearly not": used so that a question such as "what is left of X?" has exactly one answer
    # and no object sits on the fence (partly left of X's left edge but not strictly left of X).
    clearly_not = {
        "left": x1[:, None] >= x1[None, :], "right": x2[:, None] <= x2[None, :],
        "above": y1[:, None] >= y1[None, :], "below": y2[:, None] <= y2[None, :],
    }
    pairs = {r: frozenset((int(i) + 1, int(j) + 1) for i, j in zip(*np.nonzero(m))) for r, m in holds.items()}
    return Geometry(holds, clearly_not, pairs)


def opposite(relation: str) -> str:
    return OPPOSITE[relation]


def matches(obj: WorldObject, attrs: tuple[str, ...], values: tuple[str, ...]) -> bool:
    return all(getattr(obj, a) == v for a, v in zip(attrs, values))


def values_of(obj: WorldObject, attrs: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(getattr(obj, a) for a in attrs)


@dataclass(frozen=True)
class Referents:
    """Which attribute sets pick out which objects of a scene.

    `unique[oid]`: descriptors (attribute subsets) that match object `oid` and no other object.
    `groups[ids]`: descriptors that match exactly the objects `ids` (2 or 3 of them), so a counted
    plural ("two red circles") is true and exhaustive.
    """

    unique: dict[int, tuple[tuple[str, ...], ...]]
    groups: dict[tuple[int, ...], tuple[tuple[str, ...], ...]]

    def minimal(self, oid: int) -> tuple[tuple[str, ...], ...]:
        """The unique descriptors of `oid` with no unique proper subset."""
        ds = self.unique.get(oid, ())
        return tuple(d for d in ds if not any(set(e) < set(d) for e in ds))


def scene_referents(scene: Scene) -> Referents:
    unique: dict[int, list[tuple[str, ...]]] = {}
    groups: dict[tuple[int, ...], list[tuple[str, ...]]] = {}
    for d in DESCRIPTORS:
        classes: dict[tuple[str, ...], list[int]] = {}
        for o in scene.objects:
            classes.setdefault(values_of(o, d), []).append(o.object_id)
        for ids in classes.values():
            if len(ids) == 1:
                unique.setdefault(ids[0], []).append(d)
            elif len(ids) <= 3:
                groups.setdefault(tuple(ids), []).append(d)
    return Referents(
        unique={k: tuple(v) for k, v in unique.items()},
        groups={k: tuple(v) for k, v in groups.items()},
    )
