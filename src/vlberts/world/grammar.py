"""Captions of the embedded world, each with entity spans and a gold dependency parse.

Every caption is generated together with its tree: each template below builds the words and writes
every arc explicitly, in Stanford basic dependencies (the labels of the AllenNLP/Stanford parsers
used by "What Does BERT with Vision Look At?", Table 2: det, pobj, amod, nsubj, prep, dobj, punct,
partmod, nn, num; plus root, cop, expl, aux, advmod, cc, conj).

Templates, with an example each (A, B: referring noun phrases; REL: a relation true of their boxes):
  rel_verb      A sits|lies|rests|is REL B .         a small red circle sits above the blue square .
  rel_prog      A is sitting|lying|resting REL B .   two green triangles are resting near a star .
  partmod_rel   A sitting|resting|placed REL B .     a yellow star resting left of a purple diamond .
  partmod_obj   A touching|overlapping B .           a red circle touching a blue square .
  transitive    A touches|overlaps|partly covers B . the white cross partly covers a green hexagon .
  exist_rel     there is|are A REL B .               there is a red star to the left of the cyan square .
  exist_list    there is|are A (, B) and C .         there is a blue diamond and two white circles .
  exist_scene   there is|are A on SCENE .            there are two red objects on a grey background .
  copula        the A is ADJ (and ADJ) | is a SHAPE . the large circle is red .
  shows         the image shows A (, B) and C .      the picture shows an orange square and a star shape .
  reciprocal    A and B are next to|near|touching each other .   ("each other": a notvisual entity)
  frag_rel      A REL B .                            a green cross below the small red star .
  frag_scene    A on SCENE .                         a large yellow hexagon on a speckled grey background .

A caption holds one to three referring phrases (at most four objects in all).
Referring phrases pick out their objects uniquely in the image (`relations.scene_referents`);
`explicit` style (default) names colour and shape always, `minimal` style uses the fewest modifiers,
sometimes one more (REFERRING_STYLES); plural phrases carry their exact count
("two red circles" only when exactly two objects are red circles). The head noun is the shape word,
"object"/"shape" when the phrase names no shape, or "shape" with the shape word as a noun compound
("a red star shape", nn). Five captions of one image rotate over templates, over which objects they
mention first, and over which modifiers they use, so that two captions rarely repeat an attribute
that the other states (a masked colour word should have to be read off the image, not copied).

Entities: each phrase that refers to objects is an entity of type "other" whose chain id is shared by
every phrase (in any caption of the image) that refers to exactly the same objects. Chain ids are
global: `image_id * 100 + local`, local = object id (1..9) for one object, 10 for the background
(type "scene"), 11.. for plural sets in order of first mention. "each other" is a "notvisual" entity
with chain id 0, as in Flickr30K Entities.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from vlberts.analysis.syntactic import PAPER_TABLE2
from vlberts.world.relations import Geometry, Referents, scene_geometry, scene_referents, values_of
from vlberts.world.scene import Scene
from vlberts.world.vocab import NUMBER_WORDS, RELATION_WORDS, SHAPE_PLURALS

STANFORD_TABLE2 = PAPER_TABLE2  # the world's parses hold every relation the paper's Table 2 lists
SCENE_LOCAL_ID = 10
FIRST_GROUP_LOCAL_ID = 11
CHAIN_FACTOR = 100  # chain id = image_id * CHAIN_FACTOR + local id


@dataclass(frozen=True)
class Token:
    form: str
    lemma: str
    upos: str  # Universal POS tag
    xpos: str  # Penn Treebank tag
    head: int  # 1-based index of the head word; 0 for the root
    deprel: str  # Stanford basic dependency label


@dataclass(frozen=True)
class Entity:
    start: int  # index (0-based) of the phrase's first word
    end: int  # one past its last word
    chain_id: int  # shared by every mention of the same object(s) in this image's captions; 0 = notvisual
    type: str  # "other" (objects), "scene" (the background) or "notvisual"
    object_ids: tuple[int, ...]  # the objects it refers to; empty for scene and notvisual


@dataclass(frozen=True)
class Caption:
    tokens: tuple[Token, ...]
    entities: tuple[Entity, ...]
    template: str

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(t.form for t in self.tokens)

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass(frozen=True)
class Ref:
    """A referring expression's content: the objects, and which of their attributes the phrase states."""

    ids: tuple[int, ...]
    attrs: tuple[str, ...]  # subset of ("size", "colour", "shape"), in that order
    values: tuple[str, ...]

    @property
    def plural(self) -> bool:
        return len(self.ids) > 1


def chain_id(image_id: int, local: int) -> int:
    return image_id * CHAIN_FACTOR + local


# --------------------------------------------------------------------------- tree building

_ROOT = -1
_VOWELS = "aeiou"


class _Tree:
    """Words appended left to right; arcs set explicitly by the templates."""

    def __init__(self) -> None:
        self.rows: list[list] = []  # [form, lemma, upos, xpos, head (0-based or _ROOT), deprel]
        self.entities: list[Entity] = []

    def add(self, form: str, upos: str, xpos: str, lemma: str | None = None) -> int:
        self.rows.append([form, lemma or form, upos, xpos, None, None])
        return len(self.rows) - 1

    def dep(self, child: int, head: int, rel: str) -> None:
        self.rows[child][4] = head
        self.rows[child][5] = rel

    def root(self, i: int) -> None:
        self.dep(i, _ROOT, "root")

    def n(self) -> int:
        return len(self.rows)

    def caption(self, template: str) -> Caption:
        tokens = []
        for form, lemma, upos, xpos, head, rel in self.rows:
            assert head is not None, f"{template}: {form!r} has no head"
            tokens.append(Token(form, lemma, upos, xpos, 0 if head == _ROOT else head + 1, rel))
        return Caption(tuple(tokens), tuple(sorted(self.entities, key=lambda e: e.start)), template)

    # word classes ---------------------------------------------------------
    def det(self, form: str) -> int:
        return self.add(form, "DET", "DT", "a" if form == "an" else form)

    def adj(self, form: str) -> int:
        return self.add(form, "ADJ", "JJ")

    def noun(self, form: str, lemma: str | None = None, plural: bool = False) -> int:
        return self.add(form, "NOUN", "NNS" if plural else "NN", lemma)

    def num(self, n: int) -> int:
        return self.add(NUMBER_WORDS[n], "NUM", "CD")

    def prep(self, form: str) -> int:
        return self.add(form, "ADP", "TO" if form == "to" else "IN")

    def adv(self, form: str) -> int:
        return self.add(form, "ADV", "RB")

    def verb(self, form: str, xpos: str, lemma: str, upos: str = "VERB") -> int:
        return self.add(form, upos, xpos, lemma)

    def punct(self, form: str = ".") -> int:
        return self.add(form, "PUNCT", form)

    def cc(self) -> int:
        return self.add("and", "CCONJ", "CC")


def is_tree(heads: list[int]) -> bool:
    """True when 1-based `heads` (0 = root) form a single-rooted tree over all words."""
    n = len(heads)
    if n == 0 or sum(h == 0 for h in heads) != 1 or any(not 0 <= h <= n for h in heads):
        return False
    for i in range(1, n + 1):  # follow heads up from every word; a cycle never reaches 0
        seen, j = 0, i
        while j != 0:
            j = heads[j - 1]
            seen += 1
            if seen > n:
                return False
    return True


# --------------------------------------------------------------------------- the writer

# How referring phrases choose their modifiers:
#   explicit  every phrase names the colour and the shape, plus the size where that alone is not unique
#             ("the small red circle"); a masked colour or shape word is then decided by the image
#   minimal   the fewest modifiers that make the phrase unique, sometimes one more ("the red object",
#             "a circle"); masked words are often undecidable even with the image, and colour/shape
#             compete with "small"/"object" for the same slot
# Measured (VisualBERT-small, 1,500 updates on 5,000 images): with `minimal` captions the image never
# helped masked-word prediction; with `explicit` captions it did. See the note of issue 2.
REFERRING_STYLES = ("explicit", "minimal")
P_NN = 0.18  # "a red star shape": shape word as a noun compound
P_DEFINITE = 0.45
P_SCENE_PP = 0.08  # rel_verb ends with "on a grey background"

TEMPLATE_WEIGHTS: dict[str, float] = {
    "rel_verb": 3.0, "rel_prog": 1.0, "partmod_rel": 1.6, "partmod_obj": 1.4, "transitive": 1.0,
    "exist_rel": 1.0, "exist_list": 1.0, "exist_scene": 0.45, "copula": 1.6, "shows": 1.0,
    "reciprocal": 0.7, "frag_rel": 1.0, "frag_scene": 0.4,
}
_REL_WEIGHT = {"left": 1.0, "right": 1.0, "above": 1.0, "below": 1.0, "near": 0.5, "next_to": 0.6}
_COPULA_PREDICATES = ((("colour",), 0.45), (("shape",), 0.25), (("size",), 0.15), (("size", "colour"), 0.15))

Unit = tuple[int, ...]  # the object ids a referring phrase picks out


class CaptionWriter:
    """Writes the captions of one scene; holds what earlier captions already said."""

    def __init__(self, scene: Scene, rng: np.random.Generator,
                 geom: Geometry | None = None, refs: Referents | None = None, referring: str = "explicit"):
        if referring not in REFERRING_STYLES:
            raise ValueError(f"referring must be one of {', '.join(REFERRING_STYLES)}, got {referring!r}")
        self.referring = referring
        self.scene = scene
        self.rng = rng
        self.geom: Geometry = geom if geom is not None else scene_geometry(scene)
        self.refs: Referents = refs if refs is not None else scene_referents(scene)
        self.objects = {o.object_id: o for o in scene.objects}
        units: list[Unit] = [(oid,) for oid in sorted(self.refs.unique)] + sorted(self.refs.groups)
        self.units = units
        self.mentions: Counter[int] = Counter()
        self.used_desc: dict[Unit, Counter] = {u: Counter() for u in units}
        self.used_templates: Counter[str] = Counter()
        self.chains: dict[Unit, int] = {}
        self._next_group = FIRST_GROUP_LOCAL_ID
        self._weights: dict[Unit, float] = {}  # unit weights for the caption being written

        # Which relations hold between which referents (a relation holds for plural referents when it
        # holds for every pair of members). At most four objects per caption pair.
        names = tuple(_REL_WEIGHT) + ("touching",)
        one = {(i, j): frozenset(r for r in names if (i, j) in self.geom.pairs[r])
               for i in self.objects for j in self.objects if i != j}
        between: dict[tuple[Unit, Unit], frozenset[str]] = {}
        for a in units:
            for b in units:
                if len(a) + len(b) <= 4 and not set(a) & set(b):
                    rs = frozenset.intersection(*(one[i, j] for i in a for j in b))
                    if len(a) + len(b) > 2:
                        rs = rs - {"touching"}  # "touching" only between two single objects
                    if rs:
                        between[a, b] = rs
        self.rel_pairs = [(a, b, r) for (a, b), rs in between.items() for r in _REL_WEIGHT if r in rs]
        self.touch_pairs = [(a, b) for (a, b), rs in between.items() if "touching" in rs]
        self.cover_pairs = [(a, b) for a, b in self.touch_pairs if a[0] > b[0]]  # a drawn later, on top
        # "A and B are near each other": single objects only, so that no plural member is left out.
        self.sym_pairs = [
            (a, b, r) for (a, b), rs in between.items() if a < b and len(a) == len(b) == 1
            for r in ("near", "next_to", "touching") if r in rs
        ]
        self.n_disjoint_pairs = sum(1 for a in units for b in units if a < b and not set(a) & set(b))
        self.copulas = [
            (oid, d, p, w)
            for oid, ds in self.refs.unique.items() for d in ds for p, w in _COPULA_PREDICATES
            if not set(d) & set(p)
        ]

    # choosing -------------------------------------------------------------
    def _pick(self, items: list, weights: list[float]):
        """One item, with probability proportional to its weight (plain Python: lists here are short)."""
        x = self.rng.random() * sum(weights)
        for item, w in zip(items, weights):
            x -= w
            if x < 0:
                return item
        return items[-1]

    def _unit_weight(self, u: Unit) -> float:
        w = self._weights.get(u)
        if w is None:
            # Rotate the focus: objects already mentioned in this image's captions are chosen less.
            w = 1.0 / (1.0 + sum(self.mentions[i] for i in u) / len(u)) ** 2
            w *= 1.4 if len(u) > 1 else 1.0  # plural phrases keep "num" frequent
            self._weights[u] = w
        return w

    def _describe(self, u: Unit) -> Ref:
        ds = self.refs.unique[u[0]] if len(u) == 1 else self.refs.groups[u]
        if self.referring == "explicit":
            # Colour and shape always, size only where it is needed to be unique.
            full = [d for d in ds if "colour" in d and "shape" in d]
            if full:
                least = [d for d in full if not any(set(e) < set(d) for e in full)]
                return self._ref(u, self._pick(least, [0.25 ** self.used_desc[u][d] for d in least]))
        minimal = {d for d in ds if not any(set(e) < set(d) for e in ds)}
        weights = []
        for d in ds:
            w = 1.0 if d in minimal else 0.3  # sometimes one modifier more than needed
            w *= 1.5 if "shape" in d else 1.0
            w *= 0.25 ** self.used_desc[u][d]  # vary the modifiers across captions
            weights.append(w)
        d = self._pick(list(ds), weights)
        return self._ref(u, d)

    def _ref(self, u: Unit, d: tuple[str, ...]) -> Ref:
        self.used_desc[u][d] += 1
        return Ref(u, d, values_of(self.objects[u[0]], d))

    def chain(self, u: Unit) -> int:
        if u not in self.chains:
            if len(u) == 1:
                local = u[0]
            else:
                local, self._next_group = self._next_group, self._next_group + 1
            self.chains[u] = chain_id(self.scene.image_id, local)
        return self.chains[u]

    # phrases --------------------------------------------------------------
    def noun_phrase(self, t: _Tree, ref: Ref, definite: bool | None = None) -> int:
        """Append a referring noun phrase; returns its head word. Records the entity."""
        rng = self.rng
        start = t.n()
        vals = dict(zip(ref.attrs, ref.values))
        plural = ref.plural
        if definite is None:
            definite = rng.random() < (0.4 if plural else P_DEFINITE)
        adjs = [vals[a] for a in ("size", "colour") if a in vals]
        shape = vals.get("shape")
        nn = shape is not None and rng.random() < P_NN
        if shape is not None and not nn:
            head_form, head_lemma = (SHAPE_PLURALS[shape] if plural else shape), shape
        else:
            head_lemma = "shape" if nn or rng.random() < 0.35 else "object"
            head_form = head_lemma + ("s" if plural else "")
        first_content = adjs[0] if adjs else (shape if nn else head_form)
        mods: list[tuple[int, str]] = []
        if plural:
            if definite:
                mods.append((t.det("the"), "det"))
            mods.append((t.num(len(ref.ids)), "num"))
        else:
            article = "the" if definite else ("an" if first_content[0] in _VOWELS else "a")
            mods.append((t.det(article), "det"))
        for a in adjs:
            mods.append((t.adj(a), "amod"))
        if nn:
            mods.append((t.noun(shape), "nn"))  # type: ignore[arg-type]
        head = t.noun(head_form, head_lemma, plural)
        for i, rel in mods:
            t.dep(i, head, rel)
        t.entities.append(Entity(start, t.n(), self.chain(ref.ids), "other", ref.ids))
        return head

    def scene_phrase(self, t: _Tree) -> int:
        """'a (speckled) (light) grey background' or 'a grey noise pattern' (nn); a scene entity."""
        rng = self.rng
        bg = self.scene.background
        start = t.n()
        level = sum(bg.rgb) / 3
        shade = "dark" if level < 100 else ("light" if level > 135 else None)
        words = []
        if rng.random() < 0.35:
            words.append(("noisy", "speckled", "textured")[int(rng.integers(3))])
        if shade is not None and rng.random() < 0.5:
            words.append(shade)
        words.append(bg.tone)
        compound = rng.random() < 0.3
        article = "an" if words[0][0] in _VOWELS else "a"
        mods = [(t.det(article), "det")] + [(t.adj(w), "amod") for w in words]
        if compound:
            mods.append((t.noun("noise"), "nn"))
            head = t.noun("pattern")
        else:
            head = t.noun("background")
        for i, rel in mods:
            t.dep(i, head, rel)
        t.entities.append(Entity(start, t.n(), chain_id(self.scene.image_id, SCENE_LOCAL_ID), "scene", ()))
        return head

    def relation(self, t: _Tree, head: int, rel: str, b: Ref) -> None:
        """Append 'REL B' attached to `head` (a verb or a noun)."""
        wording = RELATION_WORDS[rel][int(self.rng.integers(len(RELATION_WORDS[rel])))]
        parts = wording.split()
        if len(parts) == 1:  # above / below / near
            p = t.prep(parts[0])
            t.dep(p, head, "prep")
            t.dep(self.noun_phrase(t, b), p, "pobj")
        elif len(parts) == 2:  # "left of", "right of", "next to": ADVP(left PP(of NP))
            a = t.adv(parts[0])
            t.dep(a, head, "advmod")
            p = t.prep(parts[1])
            t.dep(p, a, "prep")
            t.dep(self.noun_phrase(t, b), p, "pobj")
        else:  # "to the left of", "on the left of": PP(to NP(the left PP(of NP)))
            p = t.prep(parts[0])
            t.dep(p, head, "prep")
            d = t.det("the")
            side = t.noun(parts[2])
            t.dep(d, side, "det")
            t.dep(side, p, "pobj")
            of = t.prep("of")
            t.dep(of, side, "prep")
            t.dep(self.noun_phrase(t, b), of, "pobj")

    def be(self, t: _Tree, plural: bool, upos: str = "VERB") -> int:
        return t.verb("are" if plural else "is", "VBP" if plural else "VBZ", "be", upos)

    # templates ------------------------------------------------------------
    def _rel_triple(self):
        return self._pick(
            self.rel_pairs, [self._unit_weight(a) * self._unit_weight(b) * _REL_WEIGHT[r] for a, b, r in self.rel_pairs]
        )

    def t_rel_verb(self, t: _Tree) -> None:
        a, b, r = self._rel_triple()
        A = self._describe(a)
        h = self.noun_phrase(t, A)
        forms = (("sits", "sit"), ("lies", "lie"), ("rests", "rest"), ("is", "are"))
        k = int(self.rng.integers(len(forms)))
        lemma = ("sit", "lie", "rest", "be")[k]
        v = t.verb(forms[k][1] if A.plural else forms[k][0], "VBP" if A.plural else "VBZ", lemma)
        t.dep(h, v, "nsubj")
        t.root(v)
        self.relation(t, v, r, self._describe(b))
        if self.rng.random() < P_SCENE_PP:
            on = t.prep("on")
            t.dep(on, v, "prep")
            t.dep(self.scene_phrase(t), on, "pobj")
        t.dep(t.punct(), v, "punct")

    def t_rel_prog(self, t: _Tree) -> None:
        a, b, r = self._rel_triple()
        A = self._describe(a)
        h = self.noun_phrase(t, A)
        aux = self.be(t, A.plural, upos="AUX")
        form, lemma = (("sitting", "sit"), ("lying", "lie"), ("resting", "rest"))[int(self.rng.integers(3))]
        v = t.verb(form, "VBG", lemma)
        t.dep(h, v, "nsubj")
        t.dep(aux, v, "aux")
        t.root(v)
        self.relation(t, v, r, self._describe(b))
        t.dep(t.punct(), v, "punct")

    def t_partmod_rel(self, t: _Tree) -> None:
        a, b, r = self._rel_triple()
        h = self.noun_phrase(t, self._describe(a))
        t.root(h)
        choices = (("sitting", "VBG", "sit"), ("resting", "VBG", "rest"), ("lying", "VBG", "lie"),
                   ("placed", "VBN", "place"), ("positioned", "VBN", "position"))
        form, xpos, lemma = choices[int(self.rng.integers(len(choices)))]
        v = t.verb(form, xpos, lemma)
        t.dep(v, h, "partmod")  # reduced relative clause: Stanford "partmod" (VBG and VBN alike)
        self.relation(t, v, r, self._describe(b))
        t.dep(t.punct(), h, "punct")

    def _touch_pair(self) -> tuple[Unit, Unit, str]:
        """(a, b, verb lemma): 'cover' only when a is drawn over b."""
        options = [(a, b, "touch") for a, b in self.touch_pairs] + [(a, b, "overlap") for a, b in self.touch_pairs]
        options += [(a, b, "cover") for a, b in self.cover_pairs]
        return self._pick(options, [self._unit_weight(a) * self._unit_weight(b) for a, b, _ in options])

    def t_partmod_obj(self, t: _Tree) -> None:
        a, b, lemma = self._touch_pair()
        h = self.noun_phrase(t, self._describe(a))
        t.root(h)
        partly = t.adv("partly") if lemma == "cover" else None
        v = t.verb({"touch": "touching", "overlap": "overlapping", "cover": "covering"}[lemma], "VBG", lemma)
        if partly is not None:
            t.dep(partly, v, "advmod")
        t.dep(v, h, "partmod")
        t.dep(self.noun_phrase(t, self._describe(b)), v, "dobj")
        t.dep(t.punct(), h, "punct")

    def t_transitive(self, t: _Tree) -> None:
        a, b, lemma = self._touch_pair()
        h = self.noun_phrase(t, self._describe(a))
        partly = t.adv("partly") if lemma == "cover" else None
        v = t.verb({"touch": "touches", "overlap": "overlaps", "cover": "covers"}[lemma], "VBZ", lemma)
        if partly is not None:
            t.dep(partly, v, "advmod")
        t.dep(h, v, "nsubj")
        t.root(v)
        t.dep(self.noun_phrase(t, self._describe(b)), v, "dobj")
        t.dep(t.punct(), v, "punct")

    def _there(self, t: _Tree, plural: bool) -> int:
        there = t.add("there", "PRON", "EX")
        be = self.be(t, plural)
        t.dep(there, be, "expl")
        t.root(be)
        return be

    def t_exist_rel(self, t: _Tree) -> None:
        a, b, r = self._rel_triple()
        A = self._describe(a)
        be = self._there(t, A.plural)
        h = self.noun_phrase(t, A, definite=False)
        t.dep(h, be, "nsubj")
        self.relation(t, h, r, self._describe(b))  # NP-attached PP: (NP (NP a circle) (PP above ...))
        t.dep(t.punct(), be, "punct")

    def _disjoint_units(self, k: int) -> list[Unit]:
        """Up to `k` referents with no object in common (lists of three use single objects only)."""
        chosen: list[Unit] = []
        for _ in range(k):
            free = [u for u in self.units if not any(set(u) & set(c) for c in chosen)
                    and (k <= 2 or len(u) == 1)]
            if not free:
                break
            chosen.append(self._pick(free, [self._unit_weight(u) for u in free]))
        if len(chosen) < min(k, 2):
            return self._disjoint_units(k - 1) if k > 2 else chosen
        return chosen

    def _coordination(self, t: _Tree, units: list[Unit], definite: bool | None = None) -> int:
        """'A , B and C' / 'A and B': the first conjunct heads cc, conj and the commas."""
        heads = []
        for k, u in enumerate(units):
            if k > 0:
                if k == len(units) - 1:
                    t.dep(t.cc(), heads[0], "cc")
                else:
                    t.dep(t.punct(","), heads[0], "punct")
            heads.append(self.noun_phrase(t, self._describe(u), definite=definite))
        for h in heads[1:]:
            t.dep(h, heads[0], "conj")
        return heads[0]

    def t_exist_list(self, t: _Tree) -> None:
        units = self._disjoint_units(3 if self.rng.random() < 0.3 else 2)
        be = self._there(t, len(units[0]) > 1)
        t.dep(self._coordination(t, units, definite=False), be, "nsubj")
        t.dep(t.punct(), be, "punct")

    def t_exist_scene(self, t: _Tree) -> None:
        (u,) = self._disjoint_units(1)
        A = self._describe(u)
        be = self._there(t, A.plural)
        h = self.noun_phrase(t, A, definite=False)
        t.dep(h, be, "nsubj")
        on = t.prep("on")
        t.dep(on, h, "prep")
        t.dep(self.scene_phrase(t), on, "pobj")
        t.dep(t.punct(), be, "punct")

    def t_copula(self, t: _Tree) -> None:
        oid, d, p, _ = self._pick(self.copulas, [w * self._unit_weight((oid,)) * 0.25 ** self.used_desc[(oid,)][d]
                                                 for oid, d, p, w in self.copulas])
        obj = self.objects[oid]
        h = self.noun_phrase(t, self._ref((oid,), d), definite=True)
        cop = self.be(t, False, upos="AUX")
        if p == ("shape",):  # "the red object is a star ."
            det = t.det("an" if obj.shape[0] in _VOWELS else "a")
            pred = t.noun(obj.shape)
            t.dep(det, pred, "det")
        else:  # "the large circle is red ." / "the circle is small and red ."
            vals = values_of(obj, p)
            pred = t.adj(vals[0])
            if len(vals) == 2:
                t.dep(t.cc(), pred, "cc")
                t.dep(t.adj(vals[1]), pred, "conj")
        t.dep(h, pred, "nsubj")
        t.dep(cop, pred, "cop")
        t.root(pred)
        t.dep(t.punct(), pred, "punct")

    def t_shows(self, t: _Tree) -> None:
        units = self._disjoint_units(3 if self.rng.random() < 0.3 else 2)
        det = t.det("the")
        subj = t.noun(("image", "picture")[int(self.rng.integers(2))])
        t.dep(det, subj, "det")
        v = t.verb("shows", "VBZ", "show")
        t.dep(subj, v, "nsubj")
        t.root(v)
        t.dep(self._coordination(t, units), v, "dobj")
        t.dep(t.punct(), v, "punct")

    def t_reciprocal(self, t: _Tree) -> None:
        pairs = self.sym_pairs
        a, b, r = self._pick(pairs, [self._unit_weight(a) * self._unit_weight(b) for a, b, _ in pairs])
        first = self._coordination(t, [a, b])
        if r == "touching":  # "A and B are touching each other ."
            aux = self.be(t, True, upos="AUX")
            v = t.verb("touching", "VBG", "touch")
            t.dep(first, v, "nsubj")
            t.dep(aux, v, "aux")
            t.root(v)
            attach, rel = v, "dobj"
        else:
            v = self.be(t, True)
            t.dep(first, v, "nsubj")
            t.root(v)
            if r == "near":
                attach = t.prep("near")
                t.dep(attach, v, "prep")
            else:
                nxt = t.adv("next")
                t.dep(nxt, v, "advmod")
                attach = t.prep("to")
                t.dep(attach, nxt, "prep")
            rel = "pobj"
        start = t.n()
        each = t.det("each")
        other = t.add("other", "ADJ", "JJ")
        t.dep(each, other, "det")
        t.dep(other, attach, rel)
        t.entities.append(Entity(start, t.n(), 0, "notvisual", ()))
        t.dep(t.punct(), v, "punct")

    def t_frag_rel(self, t: _Tree) -> None:
        a, b, r = self._rel_triple()
        h = self.noun_phrase(t, self._describe(a))
        t.root(h)
        self.relation(t, h, r, self._describe(b))
        t.dep(t.punct(), h, "punct")

    def t_frag_scene(self, t: _Tree) -> None:
        (u,) = self._disjoint_units(1)
        h = self.noun_phrase(t, self._describe(u))
        t.root(h)
        on = t.prep("on")
        t.dep(on, h, "prep")
        t.dep(self.scene_phrase(t), on, "pobj")
        t.dep(t.punct(), h, "punct")

    # driver ---------------------------------------------------------------
    def feasible(self) -> dict[str, bool]:
        rel = bool(self.rel_pairs)
        touch = bool(self.touch_pairs)
        two = self.n_disjoint_pairs > 0
        one = bool(self.units)
        return {
            "rel_verb": rel, "rel_prog": rel, "partmod_rel": rel, "partmod_obj": touch, "transitive": touch,
            "exist_rel": rel, "exist_list": two, "exist_scene": one, "copula": bool(self.copulas),
            "shows": two, "reciprocal": bool(self.sym_pairs), "frag_rel": rel, "frag_scene": one,
        }

    def write(self) -> Caption:
        ok = self.feasible()
        names = [n for n in TEMPLATE_WEIGHTS if ok[n]]
        if not names:  # cannot happen: min_objects >= 1 gives every object a unique descriptor or a group
            raise RuntimeError(f"image {self.scene.image_id}: no caption template applies")
        weights = [TEMPLATE_WEIGHTS[n] * 0.3 ** self.used_templates[n] for n in names]
        name = self._pick(names, weights)
        t = _Tree()
        getattr(self, "t_" + name)(t)
        self.used_templates[name] += 1
        cap = t.caption(name)
        for e in cap.entities:
            self.mentions.update(e.object_ids)
        self._weights.clear()
        return cap


def generate_captions(
    scene: Scene, rng: np.random.Generator, n: int = 5, geom: Geometry | None = None, refs: Referents | None = None,
    referring: str = "explicit",
) -> list[Caption]:
    """`n` true captions of `scene` with entities and gold parses (module docstring)."""
    writer = CaptionWriter(scene, rng, geom, refs, referring)
    return [writer.write() for _ in range(n)]


__all__ = [
    "Caption", "CaptionWriter", "Entity", "Ref", "STANFORD_TABLE2", "Token", "chain_id", "generate_captions",
    "is_tree",
]
