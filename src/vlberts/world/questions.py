"""VQA v2-style questions about a scene, with ten noisy annotator answers each.

Four kinds, balanced over the world (each image starts the cycle at a random kind):
  attribute  "What color is the large circle?"  "What shape is the red object?"  "What size is the blue star?"
  count      "How many blue objects are there?"  "How many circles are there?"   (answers "0".."9")
  existence  "Is there a green star?"  (yes/no balanced; a "no" usually names a colour and a shape that are
             both in the image, only not together, so that binding colour to shape is needed)
  relation   "What color is the shape left of the red circle?"  "Is the blue square above the yellow star?"
A question is asked only when its referents are unique and its answer is well defined
(`relations.Geometry.clearly_not`: no object sits on the fence of the relation asked about).

Annotators: each question draws an accuracy p ~ U(0.75, 0.98); each of the ten annotators answers
right with probability p, otherwise with a plausible confusion (a neighbouring colour, a near shape,
the count +-1, the other size, the opposite yes/no). A few answers get surface variants that the
official VQA normalisation maps together or that it deliberately does not ("Red", "red.", "two" for
2, "a circle"), to exercise evaluation code. `multiple_choice_answer` is the most frequent answer
after normalisation (ties go to the true answer).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from vlberts.world.relations import Geometry, Referents, opposite, scene_geometry, scene_referents, values_of
from vlberts.world.scene import Scene
from vlberts.world.vocab import (
    COLOUR_CONFUSIONS, COLOUR_NAMES, NUMBER_WORDS, POSITIONAL_RELATIONS, SHAPE_CONFUSIONS, SHAPE_PLURALS,
    SHAPES, SIZES,
)

KINDS = ("attribute", "count", "existence", "relation")
N_ANSWERS = 10
P_VARIANT = 0.05  # share of annotator answers written in a surface variant
QUESTION_ID_FACTOR = 1000  # question_id = image_id * 1000 + index, as in VQA v2


@dataclass(frozen=True)
class AnnotatorAnswer:
    answer: str  # as written by the annotator (maybe a surface variant)
    answer_confidence: str  # "yes" | "maybe" | "no"
    answer_id: int  # 1..10
    normalized: str  # what it means (the canonical answer it is a variant of)


@dataclass(frozen=True)
class Question:
    question_id: int
    image_id: int
    question: str
    kind: str  # one of KINDS
    question_type: str  # VQA-style prefix, e.g. "what color is the"
    answer_type: str  # "yes/no" | "number" | "other"
    answer: str  # the true answer
    answers: tuple[AnnotatorAnswer, ...]
    multiple_choice_answer: str
    object_ids: tuple[int, ...]  # the objects the question is about (world ground truth, not exported to VQA)


@dataclass(frozen=True)
class _Draft:
    text: str
    kind: str
    question_type: str
    answer_type: str
    answer: str
    object_ids: tuple[int, ...]


def _phrase(attrs: tuple[str, ...], values: tuple[str, ...], noun: str = "object") -> str:
    """'large red circle' / 'red object': the words of a descriptor, shape last (or `noun`)."""
    vals = dict(zip(attrs, values))
    words = [vals[a] for a in ("size", "colour") if a in vals]
    words.append(vals.get("shape", noun))
    return " ".join(words)


def _article(phrase: str) -> str:
    return "an" if phrase[0] in "aeiou" else "a"


class QuestionWriter:
    def __init__(self, scene: Scene, rng: np.random.Generator,
                 geom: Geometry | None = None, refs: Referents | None = None):
        self.scene = scene
        self.rng = rng
        self.geom: Geometry = geom if geom is not None else scene_geometry(scene)
        self.refs: Referents = refs if refs is not None else scene_referents(scene)
        self.objects = {o.object_id: o for o in scene.objects}

    def _choice(self, items):
        return items[int(self.rng.integers(len(items)))]

    # kinds ----------------------------------------------------------------
    def attribute(self) -> _Draft | None:
        u = self.rng.random()
        target = "colour" if u < 0.5 else ("shape" if u < 0.85 else "size")
        cands = [(oid, d) for oid, ds in self.refs.unique.items() for d in ds if target not in d]
        if not cands:
            return None
        oid, d = self._choice(cands)
        obj = self.objects[oid]
        noun = self._choice(("object", "shape")) if target != "shape" else "object"
        phrase = _phrase(d, values_of(obj, d), noun=noun)
        word = {"colour": "color", "shape": "shape", "size": "size"}[target]
        return _Draft(f"What {word} is the {phrase}?", "attribute", f"what {word} is the", "other",
                      getattr(obj, target), (oid,))

    def count(self) -> _Draft:
        rng = self.rng
        u = rng.random()
        attrs = ("colour",) if u < 0.3 else ("shape",) if u < 0.6 else ("colour", "shape") if u < 0.8 else \
            ("size",) if u < 0.9 else ()
        if rng.random() < 0.8:  # about something in the image (count >= 1)
            values = values_of(self._choice(self.scene.objects), attrs)
        else:
            pools = {"colour": COLOUR_NAMES, "shape": SHAPES, "size": SIZES}
            values = tuple(self._choice(pools[a]) for a in attrs)
        ids = tuple(o.object_id for o in self.scene.objects if values_of(o, attrs) == values)
        vals = dict(zip(attrs, values))
        words = [vals[a] for a in ("size", "colour") if a in vals]
        words.append(SHAPE_PLURALS[vals["shape"]] if "shape" in vals else self._choice(("objects", "shapes")))
        return _Draft(f"How many {' '.join(words)} are there?", "count", "how many", "number", str(len(ids)), ids)

    def existence(self) -> _Draft:
        rng = self.rng
        u = rng.random()
        attrs = ("colour", "shape") if u < 0.75 else ("size", "shape") if u < 0.85 else ("size", "colour", "shape")
        present = {values_of(o, attrs) for o in self.scene.objects}
        if rng.random() < 0.5:
            values = self._choice(sorted(present))
        else:
            # A hard "no": every value occurs in the image, only never on one object together.
            per_attr = [sorted({getattr(o, a) for o in self.scene.objects}) for a in attrs]
            combos = [c for c in _product(per_attr) if c not in present]
            if not combos:
                pools = {"colour": COLOUR_NAMES, "shape": SHAPES, "size": SIZES}
                combos = [c for c in _product([list(pools[a]) for a in attrs]) if c not in present]
            values = self._choice(combos)
        phrase = _phrase(attrs, values)
        ids = tuple(o.object_id for o in self.scene.objects if values_of(o, attrs) == values)
        return _Draft(f"Is there {_article(phrase)} {phrase}?", "existence", "is there a", "yes/no",
                      "yes" if ids else "no", ids)

    def relation(self) -> _Draft | None:
        """Try the relations and both question forms in a random order; None if none can be asked."""
        if len(self.scene.objects) < 2 or not self.refs.unique:
            return None
        rels = [POSITIONAL_RELATIONS[i] for i in self.rng.permutation(len(POSITIONAL_RELATIONS))]
        forms = (self._relation_what, self._relation_yes_no)
        first = int(self.rng.integers(2))
        for rel in rels:
            for k in (first, 1 - first):
                draft = forms[k](rel)
                if draft is not None:
                    return draft
        return None

    def _relation_phrase(self, oid: int) -> str:
        d = self._choice(self.refs.unique[oid])
        return _phrase(d, values_of(self.objects[oid], d))

    def _relation_words(self, rel: str) -> str:
        return self._choice({"left": ("left of", "to the left of"), "right": ("right of", "to the right of"),
                             "above": ("above",), "below": ("below",)}[rel])

    def _relation_what(self, rel: str) -> _Draft | None:
        """'What color is the shape left of the red circle?': exactly one object is left of the
        reference and every other object is clearly not."""
        pairs, clearly_not = self.geom.pairs[rel], self.geom.clearly_not[rel]
        cands = []
        for ref in sorted(self.refs.unique):
            inside = [o for o in self.objects if (o, ref) in pairs]
            fence = [o for o in self.objects if o != ref and (o, ref) not in pairs and not clearly_not[o - 1, ref - 1]]
            if len(inside) == 1 and not fence:
                cands.append((inside[0], ref))
        if not cands:
            return None
        target, ref = self._choice(cands)
        attr = "colour" if self.rng.random() < 0.6 else "shape"
        word = "color" if attr == "colour" else "shape"
        noun = self._choice(("object", "shape")) if attr == "colour" else "object"
        text = f"What {word} is the {noun} {self._relation_words(rel)} the {self._relation_phrase(ref)}?"
        answer = getattr(self.objects[target], attr)
        return _Draft(text, "relation", f"what {word} is the", "other", answer, (target, ref))

    def _relation_yes_no(self, rel: str) -> _Draft | None:
        """'Is the blue square above the yellow star?': yes if it is, no if the opposite holds."""
        want_yes = self.rng.random() < 0.5
        truth = self.geom.pairs[rel if want_yes else opposite(rel)]
        cands = sorted((a, b) for a, b in truth if a in self.refs.unique and b in self.refs.unique)
        if not cands:
            return None
        a, b = self._choice(cands)
        text = f"Is the {self._relation_phrase(a)} {self._relation_words(rel)} the {self._relation_phrase(b)}?"
        return _Draft(text, "relation", "is the", "yes/no", "yes" if want_yes else "no", (a, b))

    # annotators -----------------------------------------------------------
    def _confusion(self, draft: _Draft) -> str:
        a = draft.answer
        if draft.answer_type == "yes/no":
            return "no" if a == "yes" else "yes"
        if draft.answer_type == "number":
            n = int(a)
            return str(n + 1) if n == 0 or self.rng.random() < 0.5 else str(n - 1)
        if a in COLOUR_CONFUSIONS:
            return self._choice(COLOUR_CONFUSIONS[a])
        if a in SHAPE_CONFUSIONS:
            return self._choice(SHAPE_CONFUSIONS[a])
        return "large" if a == "small" else "small"

    def _variant(self, canonical: str, answer_type: str) -> str:
        if answer_type == "number":
            n = int(canonical)
            return NUMBER_WORDS[n] if n < len(NUMBER_WORDS) else canonical
        options = [canonical.capitalize(), canonical + "."]
        if canonical in SHAPE_CONFUSIONS:
            options += [f"a {canonical}", f"the {canonical}"]
        return self._choice(options)

    def annotate(self, draft: _Draft) -> tuple[tuple[AnnotatorAnswer, ...], str]:
        rng = self.rng
        p = rng.uniform(0.75, 0.98)
        answers = []
        for k in range(N_ANSWERS):
            right = rng.random() < p
            canonical = draft.answer if right else self._confusion(draft)
            written = self._variant(canonical, draft.answer_type) if rng.random() < P_VARIANT else canonical
            u = rng.random()
            if right:
                conf = "yes" if u < 0.85 else ("maybe" if u < 0.97 else "no")
            else:
                conf = "yes" if u < 0.4 else ("maybe" if u < 0.85 else "no")
            answers.append(AnnotatorAnswer(written, conf, k + 1, canonical))
        counts = Counter(a.normalized for a in answers)
        best = max(counts.values())
        top = sorted(a for a, c in counts.items() if c == best)
        mc = draft.answer if draft.answer in top else top[0]
        return tuple(answers), mc

    def drafts(self, n: int, kinds: tuple[str, ...] = KINDS) -> Iterator[_Draft]:
        """Up to `n` distinct drafts, the kinds balanced: slot k wants kinds[(start + k) % len], from a
        random start. Lazy, so that a caller's own draws between drafts (annotators) stay in order."""
        start = int(self.rng.integers(len(kinds)))
        seen: set[str] = set()
        for k in range(n):
            # Each slot wants one kind; when it is impossible or repeats a question, try the next kinds.
            for attempt in range(4 * len(kinds)):
                draft = getattr(self, kinds[(start + k + attempt) % len(kinds)])()
                if draft is not None and draft.text not in seen:
                    break
            else:
                continue
            seen.add(draft.text)
            yield draft

    def write(self, n: int) -> list[Question]:
        out: list[Question] = []
        for draft in self.drafts(n):
            answers, mc = self.annotate(draft)
            qid = self.scene.image_id * QUESTION_ID_FACTOR + len(out)
            out.append(Question(
                question_id=qid, image_id=self.scene.image_id, question=draft.text, kind=draft.kind,
                question_type=draft.question_type, answer_type=draft.answer_type, answer=draft.answer,
                answers=answers, multiple_choice_answer=mc, object_ids=draft.object_ids,
            ))
        return out


def _product(lists: list[list[str]]) -> list[tuple[str, ...]]:
    out: list[tuple[str, ...]] = [()]
    for values in lists:
        out = [o + (v,) for o in out for v in values]
    return out


def generate_questions(
    scene: Scene, rng: np.random.Generator, n: int = 6, geom: Geometry | None = None, refs: Referents | None = None
) -> list[Question]:
    """Up to `n` distinct questions about `scene` (module docstring); fewer only if none can be asked."""
    if n >= QUESTION_ID_FACTOR:
        raise ValueError(f"at most {QUESTION_ID_FACTOR - 1} questions per image")
    return QuestionWriter(scene, rng, geom, refs).write(n)
