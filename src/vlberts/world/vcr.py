"""VCR-style multiple-choice questions about world scenes, exported in the VCR jsonl format.

Format (formats-and-metrics.md §2.5; Zellers et al. 2019; read back by `vlberts.data.vcr`)::

    OUT/{train,val,test}.jsonl     one question per line (test without answer_label / rationale_label)
    OUT/metadata/{image}.json      per-image detections: boxes [x1, y1, x2, y2, score], segms, names,
                                   width, height (VCR's metadata_fn)

A record holds ``annot_id`` ("val-3", as VCR), ``img_id`` (the world image id as a string: the key of the
image in a region store), ``img_fn`` (the image file under WORLD/images), ``metadata_fn`` (under
OUT/metadata), ``movie`` ("world"), ``objects`` (the shape of every world object, in object id order:
index k is object id k + 1 and box k of the metadata; VCR's detections are these objects), ``question``,
4 ``answer_choices`` and 4 ``rationale_choices`` as token lists whose object references are *lists* of
0-based indices into ``objects`` (``[[0, 2], "are", "red", "."]`` = "0 and 2 are red"), the labels, and
``question_number``. Boxes are gold (score 1.0); ``segms`` is each box as one polygon.

Questions (VCR asks about people in movie stills; here about shapes, and the world ground truth decides
right and wrong; each needs the image, since the text names objects only by their shape):

  colour  Q "What colour is [i] ?"           A "[i] is red ."
          R "[i] is the red shape left of [j] ."
  pair    Q "What colour are [i, j] ?"       A "[i, j] are red ."           (two objects of one colour)
          R "[i, j] are red , and [i] is above [k] ."
  which   Q "What is left of [j] ?"          A "[i] is left of [j] ."       (exactly one object is, and
          R "[i] is the blue shape left of [j] ."                           three others clearly are not)

Exactly one answer and one rationale is true of the scene, and the wrong ones differ from the right one only
in what the image decides (a colour, an object, a relation), never in a way the words alone give away (a
which-question's wrong answers keep its relation). Rendered as words, two objects of one shape have the same
name, so a choice may read like another ("star is below star" about two different stars): only a model that
aligns reference words to regions (VisualBERT) can tell them apart, as in VCR with two people of one name
slot. Relations are the world's strict box relations
(`world.relations`, with a margin), and a false statement is "clearly not" true (no fence-sitters).

Distractors (VCR's adversarial matching, Zellers et al. 2019, draws each question's wrong answers from the right answers of
other questions, re-mapping their object references): a wrong answer here is the right answer of a random
other question of the same kind in the split, written with this question's references, kept when it is
false for this scene and differs from the choices so far (the value that varies: the colour of colour/pair
answers, the relation and second object of colour/pair rationales, the colour of which-rationales; for
which-answers the subject object, an object of this image). When the split's pool cannot give three (tiny
worlds), the remaining values come from the closed vocabulary in random order. VCR additionally picks the
distractors that are most relevant to the question while least similar to the answer (with BERT models);
we do not rank them.

Determinism: question k of image i draws from `SeedSequence([seed, VCR_STREAM, i])` alone (the choices
too, after every image's questions are drafted), so no other world file changes and the output does not
depend on worker processes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vlberts.io import atomic_open
from vlberts.world.scene import Scene
from vlberts.world.vocab import COLOUR_NAMES, POSITIONAL_RELATIONS, RELATION_WORDS

VCR_STREAM = 0x56435231  # "VCR1": this task's SeedSequence key (never used by another stream)
QUESTIONS_PER_IMAGE = 3
KINDS = ("colour", "pair", "which")
NUM_CHOICES = 4
# world split -> VCR file (VCR's splits are train / val / test)
VCR_SPLITS = {"train": "train", "val": "val", "test": "test"}

Token = str | list[int]


def _rel_words(rel: str) -> list[str]:
    return RELATION_WORDS[rel][0].split()


@dataclass
class _Draft:
    """One question before its distractors: the references and the values that make its right choices."""

    kind: str
    refs: tuple[int, ...]  # 0-based object indices the question is about (colour: (i,); pair: (i, j); which: (j,))
    answer: object  # colour (colour, pair) or the subject index i (which)
    rationale: object  # (relation, other index) (colour, pair) or the subject's colour (which)
    subject: int  # the object whose facts the rationale states


def positional_relations(boxes: np.ndarray, size: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The positional relations of `world.relations.scene_geometry` (same margin and "clearly not" rule) for
    many scenes at once: boxes (N, K, 4) xyxy pixels (padding rows anywhere: never read) -> holds[r] and
    clearly_not[r], (N, K, K) bool, [.., i, j]: object i is (clearly not) r of object j. Vectorised because
    the per-scene `scene_geometry` costs more than the whole export (a test checks that both agree)."""
    margin = max(2, round(0.02 * size))
    x1, y1, x2, y2 = (boxes[..., k] for k in range(4))  # (N, K)
    left = x2[:, :, None] + margin <= x1[:, None, :]
    above = y2[:, :, None] + margin <= y1[:, None, :]
    holds = {"left": left, "right": left.transpose(0, 2, 1), "above": above, "below": above.transpose(0, 2, 1)}
    clearly_not = {
        "left": x1[:, :, None] >= x1[:, None, :], "right": x2[:, :, None] <= x2[:, None, :],
        "above": y1[:, :, None] >= y1[:, None, :], "below": y2[:, :, None] <= y2[:, None, :],
    }
    return holds, clearly_not


class _Scene:
    """A scene's objects with 0-based indices and the relation tests the questions need."""

    def __init__(self, scene: Scene, holds: dict[str, np.ndarray], clearly_not: dict[str, np.ndarray]):
        self.colours = [o.colour for o in scene.objects]
        self.n = n = len(scene.objects)
        # nested lists: n <= 9, and plain indexing is much cheaper than numpy's on such small matrices
        self.holds = {r: m[:n, :n].tolist() for r, m in holds.items()}  # [i][j]: i is r of j
        self.clearly_not = {r: m[:n, :n].tolist() for r, m in clearly_not.items()}
        self.rels = [[(r, j) for r in POSITIONAL_RELATIONS for j in range(n) if self.holds[r][i][j]] for i in range(n)]
        # which-questions: (relation, j) -> the one object r of j when every other object is clearly not
        self.unique: dict[tuple[str, int], int] = {}
        for r in POSITIONAL_RELATIONS:
            yes, no = self.holds[r], self.clearly_not[r]
            for j in range(n):
                subjects = [i for i in range(n) if yes[i][j]]
                if len(subjects) == 1 and all(no[k][j] for k in range(n) if k != j and k != subjects[0]):
                    self.unique[(r, j)] = subjects[0]

    def true_rels(self, i: int) -> list[tuple[str, int]]:
        return self.rels[i]

    def false_rel(self, i: int, rel: str, j: int) -> bool:
        return j != i and self.clearly_not[rel][i][j]


# --------------------------------------------------------------------------- drafting (per image)


def _draft(kind: str, sc: _Scene, rng: np.random.Generator) -> _Draft | None:
    if kind == "colour":
        i = int(rng.integers(sc.n))
        rels = sc.true_rels(i)
        if not rels:
            return None
        return _Draft("colour", (i,), sc.colours[i], rels[int(rng.integers(len(rels)))], i)
    if kind == "pair":
        pairs = [(i, j) for i in range(sc.n) for j in range(i + 1, sc.n) if sc.colours[i] == sc.colours[j]]
        if not pairs:
            return None
        i, j = pairs[int(rng.integers(len(pairs)))]
        rels = sc.true_rels(i)
        if not rels:
            return None
        return _Draft("pair", (i, j), sc.colours[i], rels[int(rng.integers(len(rels)))], i)
    # three other objects clearly not REL of j make the wrong answers, all with the question's relation
    cands = [(r, j) for r, j in sc.unique if sc.n - 2 >= NUM_CHOICES - 1]
    if not cands:
        return None
    rel, j = cands[int(rng.integers(len(cands)))]
    i = sc.unique[(rel, j)]
    return _Draft("which", (j,), (rel, i), sc.colours[i], i)


def draft_questions(sc: _Scene, rng: np.random.Generator, n: int = QUESTIONS_PER_IMAGE) -> list[_Draft]:
    """Up to `n` distinct questions about a scene (fewer when the scene offers fewer)."""
    out: list[_Draft] = []
    seen: set[tuple] = set()
    for _ in range(8 * n):
        if len(out) == n:
            break
        d = _draft(KINDS[int(rng.integers(len(KINDS)))], sc, rng)
        if d is None:
            continue
        key = (d.kind, d.refs, d.answer if d.kind != "which" else d.answer[0])  # type: ignore[index]
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


# --------------------------------------------------------------------------- tokens


def question_tokens(d: _Draft) -> list[Token]:
    if d.kind == "colour":
        return ["What", "colour", "is", [d.refs[0]], "?"]
    if d.kind == "pair":
        return ["What", "colour", "are", list(d.refs), "?"]
    rel, _ = d.answer  # type: ignore[misc]
    return ["What", "is", *_rel_words(rel), [d.refs[0]], "?"]


def answer_tokens(d: _Draft, value: object) -> list[Token]:
    if d.kind == "colour":
        return [[d.refs[0]], "is", str(value), "."]
    if d.kind == "pair":
        return [list(d.refs), "are", str(value), "."]
    rel, i = value  # type: ignore[misc]
    return [[i], "is", *_rel_words(rel), [d.refs[0]], "."]


def rationale_tokens(d: _Draft, value: object) -> list[Token]:
    if d.kind == "which":
        rel, _ = d.answer  # type: ignore[misc]
        return [[d.subject], "is", "the", str(value), "shape", *_rel_words(rel), [d.refs[0]], "."]
    rel, k = value  # type: ignore[misc]
    if d.kind == "colour":
        return [[d.subject], "is", "the", str(d.answer), "shape", *_rel_words(rel), [k], "."]
    return [list(d.refs), "are", str(d.answer), ",", "and", [d.subject], "is", *_rel_words(rel), [k], "."]


def answer_false(d: _Draft, sc: _Scene, value: object) -> bool:
    """Is the answer with this value clearly false for the scene?"""
    if d.kind in ("colour", "pair"):
        return any(sc.colours[i] != value for i in d.refs)
    rel, i = value  # type: ignore[misc]
    return sc.false_rel(i, rel, d.refs[0])


def rationale_false(d: _Draft, sc: _Scene, value: object) -> bool:
    if d.kind == "which":
        return sc.colours[d.subject] != value
    rel, k = value  # type: ignore[misc]
    return sc.false_rel(d.subject, rel, k)


# --------------------------------------------------------------------------- distractors (per split)


def _pick(
    rng: np.random.Generator, right: object, pool: Sequence[object], remap: Callable[[object], object],
    fallback: Sequence[object], is_false: Callable[[object], bool],
) -> list[object]:
    """Three values for the wrong choices: other questions' right values (remapped), then the vocabulary."""
    chosen: list[object] = []
    for k in rng.integers(len(pool), size=24).tolist() if pool else ():
        v = remap(pool[k])
        if v != right and v not in chosen and is_false(v):
            chosen.append(v)
            if len(chosen) == NUM_CHOICES - 1:
                return chosen
    for k in rng.permutation(len(fallback)).tolist():
        v = fallback[k]
        if v != right and v not in chosen and is_false(v):
            chosen.append(v)
            if len(chosen) == NUM_CHOICES - 1:
                break
    return chosen


@dataclass(frozen=True)
class VCRQuestion:
    """One finished question: tokens of the 4 choices and the 0-based labels."""

    image_id: int
    number: int  # question index within the image
    kind: str
    question: list[Token]
    answer_choices: list[list[Token]]
    answer_label: int
    rationale_choices: list[list[Token]]
    rationale_label: int


def _finish(scene: Scene, sc: _Scene, k: int, d: _Draft, rng: np.random.Generator, pools: dict
            ) -> VCRQuestion | None:
    n = sc.n
    objs = list(range(n))
    if d.kind == "which":
        rel = d.answer[0]  # type: ignore[index]
        a_pool = pools["which_subject"]  # other questions' subjects, each taken as an object index of this image
        a_remap = lambda v: (rel, v % n)  # noqa: E731
        a_fallback = [(rel, i) for i in objs]  # the question's relation only: no wrong answer is told by its words
        r_pool, r_remap, r_fallback = pools["which_colour"], (lambda v: v), list(COLOUR_NAMES)
    else:
        a_pool, a_remap, a_fallback = pools["colour"], (lambda v: v), list(COLOUR_NAMES)
        r_pool = pools["rel"]
        r_remap = lambda v: (v[0], v[1] % n)  # noqa: E731 -- another question's (relation, object) as one here
        r_fallback = [(r, j) for r in POSITIONAL_RELATIONS for j in objs]
    wrong_a = _pick(rng, d.answer, a_pool, a_remap, a_fallback, lambda v: answer_false(d, sc, v))
    wrong_r = _pick(rng, d.rationale, r_pool, r_remap, r_fallback, lambda v: rationale_false(d, sc, v))
    if len(wrong_a) < NUM_CHOICES - 1 or len(wrong_r) < NUM_CHOICES - 1:
        return None
    a_label, r_label = int(rng.integers(NUM_CHOICES)), int(rng.integers(NUM_CHOICES))
    wrong_a.insert(a_label, d.answer)
    wrong_r.insert(r_label, d.rationale)
    return VCRQuestion(
        image_id=scene.image_id, number=k, kind=d.kind, question=question_tokens(d),
        answer_choices=[answer_tokens(d, v) for v in wrong_a], answer_label=a_label,
        rationale_choices=[rationale_tokens(d, v) for v in wrong_r], rationale_label=r_label,
    )


def generate_vcr(scenes: Sequence[tuple[Scene, str]], seed: int, per_image: int = QUESTIONS_PER_IMAGE
                 ) -> dict[str, list[VCRQuestion]]:
    """World split -> its questions, in image id order (module docstring)."""
    drafted: list[tuple[Scene, _Scene, str, np.random.Generator, list[_Draft]]] = []
    K = max((len(s.objects) for s, _ in scenes), default=1)
    boxes = np.zeros((len(scenes), K, 4))
    for k, (s, _) in enumerate(scenes):
        boxes[k, : len(s.objects)] = [o.box for o in s.objects]
    sizes = {s.width for s, _ in scenes}
    rels = {w: positional_relations(boxes, w) for w in sizes}  # one world has one image size
    for k, (scene, split) in enumerate(scenes):
        rng = np.random.default_rng(np.random.SeedSequence([seed, VCR_STREAM, scene.image_id]))
        holds, clearly_not = rels[scene.width]
        sc = _Scene(scene, {r: m[k] for r, m in holds.items()}, {r: m[k] for r, m in clearly_not.items()})
        drafted.append((scene, sc, split, rng, draft_questions(sc, rng, per_image)))
    pools: dict[str, dict[str, list]] = {s: {"colour": [], "rel": [], "which_subject": [], "which_colour": []}
                                         for s in VCR_SPLITS}
    for _, _, split, _, ds in drafted:
        p = pools[split]
        for d in ds:
            if d.kind == "which":
                p["which_subject"].append(d.subject)
                p["which_colour"].append(d.rationale)
            else:
                p["colour"].append(d.answer)
                p["rel"].append(d.rationale)
    out: dict[str, list[VCRQuestion]] = {s: [] for s in VCR_SPLITS}
    for scene, sc, split, rng, ds in drafted:
        for k, d in enumerate(ds):
            q = _finish(scene, sc, k, d, rng, pools[split])
            if q is not None:
                out[split].append(q)
    return out


# --------------------------------------------------------------------------- files


def metadata_name(scene: Scene) -> str:
    return scene.file_name.rsplit(".", 1)[0] + ".json"


def metadata_record(scene: Scene) -> dict:
    """VCR's per-image metadata: gold boxes as detections (score 1.0), each box as one polygon."""
    boxes = [[*map(float, o.box), 1.0] for o in scene.objects]
    segms = [[[[x1, y1], [x2, y1], [x2, y2], [x1, y2]]] for x1, y1, x2, y2 in (o.box for o in scene.objects)]
    return {"boxes": boxes, "segms": segms, "names": [o.shape for o in scene.objects],
            "width": scene.width, "height": scene.height}


def vcr_record(q: VCRQuestion, scene: Scene, split: str, index: int, labels: bool) -> dict:
    rec = {
        "movie": "world",
        "objects": [o.shape for o in scene.objects],
        "img_fn": scene.file_name,
        "metadata_fn": metadata_name(scene),
        "question": q.question,
        "answer_choices": q.answer_choices,
        "rationale_choices": q.rationale_choices,
        "img_id": str(scene.image_id),
        "annot_id": f"{split}-{index}",
        "question_number": q.number,
    }
    if labels:
        rec["answer_label"] = q.answer_label
        rec["rationale_label"] = q.rationale_label
    return rec


def write_metadata(out: str | Path, scene: Scene) -> None:
    """OUT/metadata/{image}.json (a plain write: the world directory appears only when complete, `atomic_dir`)."""
    (Path(out) / "metadata" / metadata_name(scene)).write_text(
        json.dumps(metadata_record(scene), separators=(",", ":")) + "\n", encoding="utf-8")


def write_vcr(out: str | Path, scenes: Sequence[tuple[Scene, str]], seed: int, metadata: bool = True) -> dict[str, int]:
    """Write OUT/{train,val,test}.jsonl and (with `metadata`; the world build writes them in its workers)
    OUT/metadata/*.json; returns the questions per VCR split."""
    out = Path(out)
    (out / "metadata").mkdir(parents=True, exist_ok=True)
    by_id = {s.image_id: s for s, _ in scenes}
    questions = generate_vcr(scenes, seed)
    counts = {}
    for split, qs in questions.items():
        name = VCR_SPLITS[split]
        with atomic_open(out / f"{name}.jsonl") as f:
            f.writelines(json.dumps(vcr_record(q, by_id[q.image_id], name, k, labels=name != "test"),
                                    separators=(",", ":")) + "\n" for k, q in enumerate(qs))
        counts[name] = len(qs)
    if metadata:
        for scene, _ in scenes:
            write_metadata(out, scene)
    return counts
