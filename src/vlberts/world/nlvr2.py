"""NLVR2-style statements about pairs of world images, exported in NLVR2's JSON-lines format.

NLVR2 (Suhr et al. 2019; formats-and-metrics.md §2.4) was collected in *sets*: a writer saw a set of
images, wrote a sentence true of some of its image pairs and false of others, and the sentence was then
paired with several (typically four) image pairs of the set, each pair a separate example with its own
label. The world reproduces that:

* a set is 8 images of one world split (a random partition, redrawn `rounds` times so that every image
  meets several partners); its 4 image pairs are images (0, 1), (2, 3), (4, 5), (6, 7). A split with fewer
  than 8 (but at least 3) images has one set of all of them and 4 distinct ordered pairs drawn from them;
* `sentences_per_set` sentences are written for the set, each paired with all 4 pairs. A sentence is kept
  only when it is true of exactly 2 of the 4 pairs, so every label is balanced *per sentence*: the sentence
  alone says nothing about the label (a text-only model scores 50%) and consistency (all 4 pairs of a
  sentence right) needs the images;
* the truth of every example is computed from the scene ground truth (the `Scene` objects behind
  scenes.jsonl), never from the pixels or a detector.

Statements (the phrase is a colour + shape, shape, colour + "object", size + shape or size + colour + shape):

  exist     "The left image shows a large red circle."                    left has >= 1
  exact     "The right image contains exactly two blue objects."          right has exactly n
  at_least  "The left image has at least two stars."                      left has >= n
  both      "Both images show a green square."                            each has >= 1
  only_one  "Only one image shows a red circle."                          exactly one has >= 1
  neither   "Neither image shows a purple hexagon."                       none has any
  more      "There are more stars in the right image than in the left image."   right > left
  same      "Both images show the same number of triangles."              left == right
  total     "The two images show exactly three circles in total."        left + right == n

Files (OUT = the world directory):

    OUT/nlvr2/{train,dev,test1}.json   one JSON object per line (world splits train / val / test):
        {"identifier": "train-12-3-0", "sentence": ..., "label": "True" | "False",
         "left_url": "images/000000000042.png", "right_url": ..., "writer": "world",
         "synset": "circle", "query": "red circle", "validation": {"world": "True"},
         "directory": 13 (train) | "extra_validations": {} (dev, test1), "template": "exact"}
    OUT/nlvr2/images.json              {NLVR2 image name ("train-12-3-img0"): world image id ("42")}

Identifiers are ``split-setid-pairid-sentid``; the pair's images are ``split-setid-pairid-img0`` (left)
and ``-img1`` (right), the names NLVR2's own files and LXMERT's feature files use. Region stores of the
world are keyed by world image ids, hence `images.json` (fine-tuning's ``--image_map``). ``template`` is
an extra field (the reader ignores unknown fields, as it must for the real files' ``validation``).

Determinism: all randomness comes from `SeedSequence([seed, NLVR2_STREAM, split, round])` (the partition)
and `SeedSequence([seed, NLVR2_STREAM, split, round, set])` (pairs and sentences of a set), streams no
other world file draws from, so adding NLVR2 left every other world file byte-identical.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlberts.io import atomic_open, write_json
from vlberts.world.scene import Scene
from vlberts.world.vocab import NUMBER_WORDS, SHAPE_PLURALS

NLVR2_STREAM = 0x4E4C5632  # "NLV2": the first word after the seed of every NLVR2 seed sequence
# world split -> NLVR2 file split (NLVR2 releases train, dev and the public test set test1)
NLVR2_SPLITS = {"train": "train", "val": "dev", "test": "test1"}
SET_SIZE = 8  # images per set (as in NLVR2)
PAIRS_PER_SET = 4  # each sentence is paired with the 4 image pairs of its set (as in NLVR2)
TRIES_PER_SENTENCE = 60  # candidate sentences drawn per slot before giving up on it

# A phrase key names what is counted: ("cs", colour, shape), ("s", shape), ("c", colour),
# ("zs", size, shape), ("zcs", size, colour, shape).
Key = tuple[str, ...]


@dataclass(frozen=True)
class NLVR2Settings:
    """How many statements: `rounds` partitions of each split into sets, `sentences_per_set` per set.
    The defaults give about 7,200 training examples on a 1,000-image world."""

    rounds: int = 3
    sentences_per_set: int = 6


@dataclass(frozen=True)
class NLVR2Statement:
    """One example: a sentence about the image pair (left, right) and its truth."""

    split: str  # NLVR2 split: train | dev | test1
    set_id: int
    pair_id: int
    sentence_id: int
    sentence: str
    label: bool
    left: int  # world image ids
    right: int
    template: str
    synset: str  # the shape (or colour) the sentence is about
    query: str  # the phrase, singular

    @property
    def identifier(self) -> str:
        return f"{self.split}-{self.set_id}-{self.pair_id}-{self.sentence_id}"

    def image_name(self, side: int) -> str:
        return f"{self.split}-{self.set_id}-{self.pair_id}-img{side}"


def image_counts(scene: Scene) -> Counter:
    """Phrase key -> number of the scene's objects it describes (every object is visible: >= 65%)."""
    counts: Counter = Counter()
    for o in scene.objects:
        counts.update([("cs", o.colour, o.shape), ("s", o.shape), ("c", o.colour), ("zs", o.size, o.shape),
                       ("zcs", o.size, o.colour, o.shape)])
    return counts


def phrase(key: Key, plural: bool = False) -> str:
    """'large red circle(s)', 'red object(s)', 'circle(s)'."""
    kind, *values = key
    noun = "object" if kind == "c" else values[-1]
    if plural:
        noun = "objects" if kind == "c" else SHAPE_PLURALS[noun]
    return " ".join([*values[:-1], noun] if kind != "c" else [values[0], noun])


def _a(text: str) -> str:
    return f"{'an' if text[0] in 'aeiou' else 'a'} {text}"


def _number(n: int) -> str:
    return NUMBER_WORDS[n]


# --------------------------------------------------------------------------- templates

# (left count, right count) -> truth
Truth = Callable[[int, int], bool]


@dataclass(frozen=True)
class _Candidate:
    template: str
    sentence: str
    key: Key
    truth: Truth


SIDES = ("left", "right")
VERBS = ("shows", "contains", "has")


def _pick(u: float, options: Sequence):
    """The option a uniform draw u in [0, 1) falls on."""
    n = len(options)
    return options[min(int(u * n), n - 1)]  # u * n may round up to n when u is within 2**-53 of 1


def _side_truth(side: str, test: Callable[[int], bool]) -> Truth:
    return (lambda left, right: test(left)) if side == "left" else (lambda left, right: test(right))


# Each writer: (uniform draws u, phrase key, a count seen in the set) -> (sentence, truth).

def _exist(u, key, n_hint):
    side, verb = _pick(u[0], SIDES), _pick(u[1], VERBS)
    return f"The {side} image {verb} {_a(phrase(key))}.", _side_truth(side, lambda c: c >= 1)


def _exact(u, key, n_hint):
    side, verb = _pick(u[0], SIDES), _pick(u[1], VERBS)
    n = min(3, max(1, n_hint + _pick(u[2], (-1, 0, 1))))
    return (f"The {side} image {verb} exactly {_number(n)} {phrase(key, n > 1)}.",
            _side_truth(side, lambda c: c == n))


def _at_least(u, key, n_hint):
    side, verb = _pick(u[0], SIDES), _pick(u[1], VERBS)
    n = min(3, max(2, n_hint))
    return f"The {side} image {verb} at least {_number(n)} {phrase(key, True)}.", _side_truth(side, lambda c: c >= n)


def _both(u, key, n_hint):
    return f"Both images show {_a(phrase(key))}.", lambda left, right: left >= 1 and right >= 1


def _only_one(u, key, n_hint):
    return f"Only one image shows {_a(phrase(key))}.", lambda left, right: (left >= 1) != (right >= 1)


def _neither(u, key, n_hint):
    return f"Neither image shows {_a(phrase(key))}.", lambda left, right: left == 0 and right == 0


def _more(u, key, n_hint):
    side = _pick(u[0], SIDES)
    other = SIDES[1 - SIDES.index(side)]
    text = f"There are more {phrase(key, True)} in the {side} image than in the {other} image."
    return text, (lambda left, right: left > right) if side == "left" else (lambda left, right: right > left)


def _same(u, key, n_hint):
    return f"Both images show the same number of {phrase(key, True)}.", lambda left, right: left == right


def _total(u, key, n_hint):
    n = min(4, max(1, n_hint + _pick(u[2], (-1, 0, 1))))
    return (f"The two images show exactly {_number(n)} {phrase(key, n > 1)} in total.",
            lambda left, right: left + right == n)


# name -> (writer, phrase kinds it uses, weight). Counting statements use the coarser phrases (shape,
# colour, colour + shape), whose counts vary; existence statements also the sized ones.
TEMPLATES: dict[str, tuple[Callable, tuple[str, ...], float]] = {
    "exist": (_exist, ("cs", "zs", "zcs"), 2.0),
    "exact": (_exact, ("cs", "s", "c"), 1.5),
    "at_least": (_at_least, ("s", "c"), 1.0),
    "both": (_both, ("cs", "s", "zs"), 1.5),
    "only_one": (_only_one, ("cs", "s", "zs"), 1.5),
    "neither": (_neither, ("cs", "zs"), 0.5),
    "more": (_more, ("s", "c", "cs"), 1.5),
    "same": (_same, ("s", "c"), 0.5),
    "total": (_total, ("s", "c", "cs"), 1.0),
}
_NAMES = tuple(TEMPLATES)
_CUMULATIVE = np.cumsum([TEMPLATES[t][2] for t in _NAMES]).tolist()


def object_keys(scene: Scene) -> list[dict[str, Key]]:
    """Per object, phrase kind -> the key of the phrase describing it."""
    return [{"cs": ("cs", o.colour, o.shape), "s": ("s", o.shape), "c": ("c", o.colour),
             "zs": ("zs", o.size, o.shape), "zcs": ("zcs", o.size, o.colour, o.shape)} for o in scene.objects]


def _candidate(rng: np.random.Generator, keys: Sequence[list[dict[str, Key]]], counts: Sequence[Counter]) -> _Candidate:
    """A sentence about a set, the way an NLVR2 writer looking at the set's images would: about an object
    of one of its images (`keys`: `object_keys` of each image), with a number close to a count seen in one
    of them."""
    u = rng.random(8).tolist()  # one draw per candidate (plain floats: numpy calls per choice are slow)
    name = _NAMES[min(bisect.bisect_right(_CUMULATIVE, u[0] * _CUMULATIVE[-1]), len(_NAMES) - 1)]
    write, kinds, _ = TEMPLATES[name]
    objects = _pick(u[1], keys)
    key = _pick(u[2], objects)[_pick(u[3], kinds)]
    n_hint = _pick(u[4], counts)[key]
    sentence, truth = write(u[5:], key, n_hint)
    return _Candidate(name, sentence, key, truth)


# --------------------------------------------------------------------------- sets

def _set_pairs(rng: np.random.Generator, images: Sequence[int]) -> list[tuple[int, int]]:
    """The 4 (left, right) image pairs of a set: consecutive images of a full set; 4 distinct ordered
    pairs of distinct images of a small one (a split of 3..7 images)."""
    if len(images) >= 2 * PAIRS_PER_SET:
        return [(images[2 * p], images[2 * p + 1]) for p in range(PAIRS_PER_SET)]
    ordered = [(a, b) for a in images for b in images if a != b]
    pick = rng.choice(len(ordered), size=PAIRS_PER_SET, replace=False)
    return [ordered[k] for k in pick]


def set_statements(
    rng: np.random.Generator, split: str, set_id: int, pairs: Sequence[tuple[int, int]], scenes: dict[int, Scene],
    counts: dict[int, Counter], n_sentences: int,
) -> list[NLVR2Statement]:
    """Up to `n_sentences` distinct sentences for one set, each true of exactly half of its pairs, as
    statements (sentence-major, then pair order)."""
    images = sorted({i for pair in pairs for i in pair})
    set_keys, set_counts = [object_keys(scenes[i]) for i in images], [counts[i] for i in images]
    pair_counts = [(counts[a], counts[b]) for a, b in pairs]
    out: list[NLVR2Statement] = []
    seen: set[str] = set()
    tries = 0
    while len(seen) < n_sentences and tries < TRIES_PER_SENTENCE * n_sentences:
        tries += 1
        cand = _candidate(rng, set_keys, set_counts)
        if cand.sentence in seen:
            continue
        key, truth = cand.key, cand.truth
        labels = [truth(left[key], right[key]) for left, right in pair_counts]
        if 2 * sum(labels) != len(labels):  # balanced per sentence (module docstring)
            continue
        sentence_id = len(seen)
        seen.add(cand.sentence)
        synset = cand.key[-1]
        out.extend(
            NLVR2Statement(split, set_id, p, sentence_id, cand.sentence, label, a, b, cand.template, synset,
                           phrase(cand.key))
            for p, ((a, b), label) in enumerate(zip(pairs, labels))
        )
    return out


def generate_nlvr2(
    scenes: Sequence[tuple[Scene, str]], seed: int, settings: NLVR2Settings = NLVR2Settings()
) -> dict[str, list[NLVR2Statement]]:
    """NLVR2 split -> its statements, from the world's (scene, world split) list (module docstring)."""
    by_id = {s.image_id: s for s, _ in scenes}
    counts = {s.image_id: image_counts(s) for s, _ in scenes}
    out: dict[str, list[NLVR2Statement]] = {}
    for split_index, (world_split, split) in enumerate(NLVR2_SPLITS.items()):
        ids = sorted(s.image_id for s, sp in scenes if sp == world_split)
        out[split] = []
        if len(ids) < 3:  # no 4 distinct ordered pairs
            continue
        n_sets = max(1, len(ids) // SET_SIZE)
        for r in range(settings.rounds):
            order = np.random.default_rng(np.random.SeedSequence([seed, NLVR2_STREAM, split_index, r])).permutation(ids)
            for k in range(n_sets):
                set_id = r * n_sets + k
                rng = np.random.default_rng(np.random.SeedSequence([seed, NLVR2_STREAM, split_index, r, k]))
                members = [int(i) for i in order[k * SET_SIZE : (k + 1) * SET_SIZE]]
                pairs = _set_pairs(rng, members)
                out[split].extend(set_statements(rng, split, set_id, pairs, by_id, counts, settings.sentences_per_set))
    return out


# --------------------------------------------------------------------------- files

def nlvr2_record(st: NLVR2Statement, scenes: dict[int, Scene]) -> dict:
    """One line of ``{split}.json`` (module docstring)."""
    label = "True" if st.label else "False"
    rec = {
        "identifier": st.identifier, "sentence": st.sentence, "label": label,
        "left_url": f"images/{scenes[st.left].file_name}", "right_url": f"images/{scenes[st.right].file_name}",
        "writer": "world", "synset": st.synset, "query": st.query, "validation": {"world": label},
    }
    if st.split == "train":
        rec["directory"] = st.set_id % 100 + 1  # NLVR2's train images sit in train/1 .. train/100
    else:
        rec["extra_validations"] = {}
    rec["template"] = st.template
    return rec


def write_nlvr2(
    out: str | Path, scenes: Sequence[tuple[Scene, str]], seed: int, settings: NLVR2Settings = NLVR2Settings()
) -> dict[str, int]:
    """Write OUT/{train,dev,test1}.json and OUT/images.json (atomically); returns the number of examples
    per NLVR2 split."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    by_id = {s.image_id: s for s, _ in scenes}
    statements = generate_nlvr2(scenes, seed, settings)
    images: dict[str, str] = {}
    for split, sts in statements.items():
        with atomic_open(out / f"{split}.json") as f:
            f.writelines(json.dumps(nlvr2_record(st, by_id), separators=(", ", ": ")) + "\n" for st in sts)
        for st in sts:
            images[st.image_name(0)] = str(st.left)
            images[st.image_name(1)] = str(st.right)
    write_json(out / "images.json", images)
    return {split: len(sts) for split, sts in statements.items()}
