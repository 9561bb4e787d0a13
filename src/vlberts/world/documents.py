"""Text-only documents and an image-only set for the embedded world (issue 3: what VL-BERT's text corpus,
BERT's next-sentence prediction and H-VisualBERT's unpaired images need).

    OUT/text/documents.txt     text-only documents in BERT's pre-training text format: one sentence per line,
                               a blank line between documents (VL-BERT §3.3 mixes BooksCorpus & Wikipedia
                               in; W-VisualBERT footnote 4 trains NSP "when long documents are available")
    OUT/unpaired_images.txt    train image ids, one per line, whose captions an H-VisualBERT run withholds:
                               the "additional unaligned images" of W-VisualBERT §4.3 (H-VisualBERT+)

A document describes an *imagined* scene (never rendered, not one of the world's images): a scene is
sampled and described by the caption grammar (`world.grammar`), and its captions are joined two or three
at a time with connectives into longer, more complex sentences than the captions, as BooksCorpus sentences
are longer than Conceptual Captions' (VL-BERT §3.3). Sentences within a document follow the scene, so a
sentence and its successor are about the same objects, and a sentence from another document is about
other objects: next-sentence prediction has something to learn.

Determinism: document d draws from `SeedSequence([seed, TEXT_STREAM, d])` and the image-only set from
`SeedSequence([seed, UNPAIRED_STREAM])`, streams no other file uses, so adding these files changed no
byte of any other file of a world. The train split only (the documents are not about world images, and
no evaluation reads them). The number of documents is `documents_for(n_images)`: proportional to the
world, and cheap (one scene and its captions each, no pixels).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vlberts.io import atomic_open
from vlberts.world.grammar import generate_captions
from vlberts.world.scene import SceneConfig, sample_scene

TEXT_STREAM = 0x54585431  # "TXT1": the documents' SeedSequence key (never used by another stream)
UNPAIRED_STREAM = 0x554E5031  # "UNP1": the image-only set's SeedSequence key
IMAGES_PER_DOCUMENT = 16  # one document per this many world images (at least MIN_DOCUMENTS)
MIN_DOCUMENTS = 4  # next-sentence prediction needs other documents to draw random sentences from
UNPAIRED_FRACTION = 0.2  # share of the train images in the image-only set

# How two clauses are joined: (connective before the first, connective between them). Coordinating,
# contrasting and subordinating forms, so that the sentences are longer and less uniform than captions.
_JOINS = (
    ("", ", and"), ("", ", while"), ("", ", whereas"), ("", "; meanwhile ,"), ("", ", but"),
    ("while", ","), ("although", ","), ("as", ","), ("", ", and we can also see that"),
)
_OPENERS = (
    "in this picture ,", "looking closely ,", "at first glance ,", "on the other side ,", "from a distance ,",
)


def documents_for(n_images: int) -> int:
    """How many documents a world of `n_images` images has."""
    return max(MIN_DOCUMENTS, n_images // IMAGES_PER_DOCUMENT)


def _clause(text: str) -> str:
    return text[:-2] if text.endswith(" .") else text


def generate_document(seed: int, d: int, cfg: SceneConfig = SceneConfig()) -> list[str]:
    """Document `d` of the world with this seed: 3 to 6 sentences of 1 to 3 joined captions each, about one
    imagined scene. The same every time."""
    scene_ss, text_ss = np.random.SeedSequence([seed, TEXT_STREAM, d]).spawn(2)
    rng = np.random.default_rng(text_ss)
    scene = sample_scene(np.random.default_rng(scene_ss), d + 1, cfg)
    n_sentences = int(rng.integers(3, 7))
    parts = [int(rng.choice([1, 2, 2, 3])) for _ in range(n_sentences)]
    clauses = [_clause(c.text) for c in generate_captions(scene, rng, sum(parts))]
    sentences, k = [], 0
    for n in parts:
        group, k = clauses[k : k + n], k + n
        if n == 1:
            opener = _OPENERS[int(rng.integers(len(_OPENERS)))] if rng.random() < 0.5 else ""
            text = f"{opener} {group[0]}".strip()
        else:
            lead, mid = _JOINS[int(rng.integers(len(_JOINS)))]
            text = f"{lead} {group[0]} {mid} {group[1]}".strip()
            if n == 3:
                text += f" , and {group[2]}"
        sentences.append(text + " .")
    return sentences


def write_documents(path: Path, seed: int, n_documents: int, cfg: SceneConfig = SceneConfig()) -> int:
    """Write `n_documents` documents in BERT's text format (module docstring); returns the sentence count."""
    count = 0
    with atomic_open(path) as f:
        for d in range(n_documents):
            sentences = generate_document(seed, d, cfg)
            count += len(sentences)
            if d:
                f.write("\n")
            f.writelines(s + "\n" for s in sentences)
    return count


def unpaired_images(train_ids: list[int], seed: int, fraction: float = UNPAIRED_FRACTION) -> list[int]:
    """A seeded `fraction` of the train images (at least one when there are two or more, never all of
    them), in id order: the image-only set."""
    n = len(train_ids)
    k = min(max(1 if n >= 2 else 0, round(n * fraction)), max(n - 1, 0))
    pick = np.random.default_rng(np.random.SeedSequence([seed, UNPAIRED_STREAM])).permutation(n)[:k]
    return sorted(int(train_ids[i]) for i in pick)


def write_unpaired_images(path: Path, image_ids: list[int]) -> None:
    with atomic_open(path) as f:
        f.writelines(f"{i}\n" for i in image_ids)
