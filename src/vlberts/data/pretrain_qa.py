"""LXMERT image-QA pre-training data (LXMERT §3.1.3, §3.2, §3.3): questions as sentences, answers as labels.

LXMERT aggregates the train and dev questions of VQA v2, GQA and VG-QA into its pre-training data (§3.2):
"we take questions as sentences from the image-and-sentence data pairs and take answers as labels in the
image QA pre-training task". So a question is one more sentence of its image -- masked for MLM, swapped
for another image's sentence for cross-modality matching, like any caption -- and when the sentence is
its own image's (matched), the image-QA head predicts its answer over a joint answer table (§3.3: 9,500
answers covering about 90% of the questions of the three datasets). The released code draws one answer
per example with probability proportional to its score (`objectives.matching.sample_qa_target`).

Here the sources are a VQA v2 questions + annotations pair and a GQA balanced questions file (either or
both; the world writes both). Where the paper is silent:
* joint answer table: the normalised answers (VQA `multiple_choice_answer` through the official
  normalisation, GQA `answer`) given by at least `min_count` questions of the sources together, most
  frequent first, ties alphabetical; `min_count` is chosen by the user (the world's answers are few);
* targets: a VQA question's official soft scores over the table (`tasks.vqa.example_target`), a GQA
  question's ``{answer: 1.0}`` (`tasks.gqa.gqa_target`); a question none of whose answers is in the table
  stays a sentence without a QA label.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from vlberts.data.coco import CaptionRef
from vlberts.data.gqa import read_gqa
from vlberts.data.vqa import holds_answers, read_vqa
from vlberts.errors import VlbertsError
from vlberts.tasks.gqa import gqa_target, normalize_gqa_answer
from vlberts.tasks.vqa import AnswerVocab, SoftTarget, example_target, normalize_answer


@dataclass(frozen=True)
class PretrainQA:
    """Questions as pre-training sentences, each with its target over the joint answer table."""

    sentences: list[CaptionRef]  # (image id, question) pairs
    targets: list[SoftTarget]  # per sentence; empty labels = no QA label
    answers: AnswerVocab  # the joint answer table
    sources: tuple[tuple[str, int], ...] = ()  # (questions file, its sentences), in the order of `sentences`

    @property
    def labelled(self) -> int:
        """Questions with a QA label."""
        return sum(1 for t in self.targets if t.labels)


def read_pretrain_qa(
    vqa_questions: str | Path = "", vqa_annotations: str | Path = "", gqa_questions: str | Path = "",
    *, min_count: int = 1, answers: AnswerVocab | None = None,
) -> PretrainQA:
    """The questions of the given sources with their targets over the joint answer table (module docstring), or
    over `answers` when given (a released table, `--qa_answers`: answers outside it are dropped from the labels).

    A VQA questions file needs its annotations file (the answers are there; a Pythia imdb `.npy` holds
    both), and at least one source is
    needed; bad records are errors naming the file and the record (the sources' readers)."""
    if bool(vqa_questions) != bool(vqa_annotations) and not (vqa_questions and holds_answers(vqa_questions)):
        raise VlbertsError("image-QA pre-training from VQA needs both the questions and the annotations file",
                           path=vqa_questions or vqa_annotations)
    if not vqa_questions and not gqa_questions:
        raise VlbertsError("image-QA pre-training needs VQA questions + annotations or GQA questions")
    vqa = read_vqa(vqa_questions, vqa_annotations) if vqa_questions else []
    if vqa and not vqa[0].annotated:
        raise VlbertsError("image-QA pre-training needs answered questions: this imdb has none", path=vqa_questions)
    gqa = read_gqa(gqa_questions, require_answers=True) if gqa_questions else []
    if answers is None:
        counts = Counter(normalize_answer(ex.multiple_choice_answer) for ex in vqa if ex.multiple_choice_answer is not None)
        counts.update(normalize_gqa_answer(ex.answer) for ex in gqa)
        answers = AnswerVocab.from_counts(counts, min_count)
    if not len(answers):
        raise VlbertsError(f"no answer is given by {min_count}+ questions of the image-QA sources",
                           path=gqa_questions or vqa_annotations)
    sentences = [CaptionRef(str(ex.image_id), ex.question) for ex in vqa] + [
        CaptionRef(str(ex.image_id), ex.question) for ex in gqa]
    targets = [example_target(ex, answers) for ex in vqa] + [gqa_target(ex, answers) for ex in gqa]
    sources = tuple((str(f), n) for f, n in ((vqa_questions, len(vqa)), (gqa_questions, len(gqa))) if f)
    return PretrainQA(sentences, targets, answers, sources)
