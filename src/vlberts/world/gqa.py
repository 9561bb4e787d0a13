"""GQA-style questions about a scene, exported in the GQA balanced questions format.

Format (formats-and-metrics.md §2.3; Hudson & Manning 2019, the released ``questions1.2`` files):
``{split}_balanced_questions.json`` maps a question id (a string of digits) to::

    {"imageId": "12", "question": "Is the red circle left of the blue star?", "answer": "yes",
     "fullAnswer": "Yes, the red circle is left of the blue star.", "isBalanced": true,
     "types": {"structural": "verify", "semantic": "rel", "detailed": "relVerify"},
     "groups": {"global": null, "local": "relVerify-12_3"},
     "annotations": {"question": {"1": "1203", ...}, "answer": {}, "fullAnswer": {...}}}

The questions reuse the VQA drafts of `vlberts.world.questions` (same referents, same "clearly not"
rule for relations), but GQA has one unambiguous answer per question, so the draft's true answer is
the answer (no annotator noise) and counting is left out (GQA asks no "how many" questions). Kinds and
their GQA types (structural / semantic / detailed, as in the GQA paper's Table 1 taxonomy):

  existence  "Is there a green star?"                        verify / obj  / exist
  attribute  "What color is the large circle?"               query  / attr / queryAttr
  relation   "What color is the shape left of the circle?"   query  / rel  / relS
             "Is the blue square above the yellow star?"     verify / rel  / relVerify
  choose     "Is the large circle red or blue?"              choose / attr / chooseAttr

Ids: question id = image_id * 1000 + index (as for VQA; they live in separate files), the image id is
the world image id as a string (the region stores' key), object ids in `annotations` are
image_id * 100 + object id (the Flickr30K chain-id convention of `export`).
Splits: the world's train / val / test images become GQA's train / val / testdev files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from vlberts.world.questions import QUESTION_ID_FACTOR, QuestionWriter, _article, _Draft, _phrase
from vlberts.world.relations import Geometry, Referents, values_of
from vlberts.world.scene import Scene
from vlberts.world.vocab import COLOUR_CONFUSIONS, SHAPES

KINDS = ("existence", "attribute", "relation", "choose")
# world split -> GQA file split (GQA's test-dev is the split everyone reports on)
GQA_SPLITS = {"train": "train", "val": "val", "test": "testdev"}
OBJECT_ID_FACTOR = 100
# (draft kind, yes/no answer) -> GQA types: structural, semantic, detailed (module docstring)
GQA_TYPES: dict[tuple[str, bool], tuple[str, str, str]] = {
    ("existence", True): ("verify", "obj", "exist"),
    ("attribute", False): ("query", "attr", "queryAttr"),
    ("relation", False): ("query", "rel", "relS"),
    ("relation", True): ("verify", "rel", "relVerify"),
    ("choose", False): ("choose", "attr", "chooseAttr"),
}


@dataclass(frozen=True)
class GQAQuestion:
    question_id: int
    image_id: int
    question: str
    answer: str
    full_answer: str
    structural: str  # verify | query | choose
    semantic: str  # obj | attr | rel
    detailed: str  # exist | queryAttr | relS | relVerify | chooseAttr
    object_ids: tuple[int, ...]


def _types(draft: _Draft) -> tuple[str, str, str]:
    return GQA_TYPES[(draft.kind, draft.answer_type == "yes/no")]


def _full_answer(draft: _Draft) -> str:
    """The answer as a sentence, GQA's ``fullAnswer``, rebuilt from the question's words."""
    text, a = draft.text.rstrip("?"), draft.answer
    if draft.kind == "existence":
        phrase = text.split(" ", 3)[3]  # "Is there a red circle" -> "red circle"
        return f"Yes, there is {_article(phrase)} {phrase}." if a == "yes" else f"No, there is no {phrase}."
    if draft.kind == "choose":  # "Is the X red or blue" -> "The X is red."
        subject = text[len("Is the "):].rsplit(" ", 3)[0]
        return f"The {subject} is {a}."
    if draft.answer_type == "yes/no":  # "Is the A left of the B" -> "Yes, the A is left of the B."
        m = re.fullmatch(r"Is the (.+?) ((?:to the )?(?:left of|right of)|above|below) the (.+)", text)
        assert m is not None, text
        neg = "" if a == "yes" else "not "
        return f"{a.capitalize()}, the {m[1]} is {neg}{m[2]} the {m[3]}."
    subject = text.split(" ", 4)[4]  # "What color is the large circle" -> "large circle"
    value = f"a {a}" if a in SHAPES else a
    return f"The {subject} is {value}."


class GQAWriter(QuestionWriter):
    """`QuestionWriter`'s drafts without annotator noise or counting, plus GQA's "choose" form."""

    def choose(self) -> _Draft | None:
        """'Is the large circle red or blue?': a uniquely described object, its colour and a near miss."""
        cands = [(oid, d) for oid, ds in self.refs.unique.items() for d in ds if "colour" not in d]
        if not cands:
            return None
        oid, d = self._choice(cands)
        obj = self.objects[oid]
        other = self._choice(COLOUR_CONFUSIONS[obj.colour])
        first, second = (obj.colour, other) if self.rng.random() < 0.5 else (other, obj.colour)
        text = f"Is the {_phrase(d, values_of(obj, d))} {first} or {second}?"
        return _Draft(text, "choose", "is the", "other", obj.colour, (oid,))

    def write_gqa(self, n: int) -> list[GQAQuestion]:
        out: list[GQAQuestion] = []
        for draft in self.drafts(n, KINDS):
            structural, semantic, detailed = _types(draft)
            out.append(GQAQuestion(
                question_id=self.scene.image_id * QUESTION_ID_FACTOR + len(out), image_id=self.scene.image_id,
                question=draft.text, answer=draft.answer, full_answer=_full_answer(draft), structural=structural,
                semantic=semantic, detailed=detailed, object_ids=draft.object_ids,
            ))
        return out


def generate_gqa_questions(
    scene: Scene, rng: np.random.Generator, n: int = 6, geom: Geometry | None = None, refs: Referents | None = None
) -> list[GQAQuestion]:
    """Up to `n` distinct GQA questions about `scene` (module docstring); fewer only if none can be asked."""
    if n >= QUESTION_ID_FACTOR:
        raise ValueError(f"at most {QUESTION_ID_FACTOR - 1} questions per image")
    return GQAWriter(scene, rng, geom, refs).write_gqa(n)


def _pointers(text: str, q: GQAQuestion, scene: Scene) -> dict[str, str]:
    """GQA ``annotations``: word index (as a string) -> object id, for each object's noun in `text`.

    The objects are named in `object_ids` order, so each one's noun is the first later word that is its
    shape or a generic "object"/"shape" (not the "shape" of "What shape is ..."); words are the
    whitespace tokens with punctuation stripped, as in the released files."""
    words = [w.strip("?.,").lower() for w in text.split()]
    objects = {o.object_id: o for o in scene.objects}
    out: dict[str, str] = {}
    i = 2 if words[0] == "what" else 0
    for oid in q.object_ids:
        nouns = (objects[oid].shape, "object", "shape")
        i = next((j for j in range(i, len(words)) if words[j] in nouns), len(words))
        if i == len(words):
            break
        out[str(i)] = str(q.image_id * OBJECT_ID_FACTOR + oid)
        i += 1
    return out


def gqa_record(q: GQAQuestion, scene: Scene) -> tuple[str, dict]:
    """(question id, record) of the balanced questions file."""
    return str(q.question_id), {
        "imageId": str(q.image_id),
        "question": q.question,
        "answer": q.answer,
        "fullAnswer": q.full_answer,
        "isBalanced": True,
        "types": {"structural": q.structural, "semantic": q.semantic, "detailed": q.detailed},
        "groups": {"global": None, "local": f"{q.detailed}-{'_'.join(str(o) for o in q.object_ids)}"},
        "annotations": {
            "question": _pointers(q.question, q, scene),
            "answer": {},
            "fullAnswer": _pointers(q.full_answer, q, scene),
        },
    }
