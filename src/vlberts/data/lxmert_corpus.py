"""LXMERT's pre-training corpus files, read as pre-training sentences and image-QA labels (LXMERT §3.2, §3.3;
formats-and-metrics.md §3.3).

airsplay/lxmert's ``data/lxmert/{mscoco_train, mscoco_nominival, mscoco_minival, vgnococo}.json`` are each a
JSON list with one record an image::

    {"img_id": "COCO_val2014_000000000042",
     "sentf": {"mscoco": ["A man ...", ...], "vg": [...], "vqa": ["What is ...?", ...], "gqa": [...]},
     "labelf": {"vqa": [{"net": 1.0, "nets": 0.3}, ...], "gqa": [{"left": 1.0}, ...]}}

``sentf`` holds the image's sentences by source: captions (``mscoco``, ``vg``) and questions (``vqa``, ``gqa``,
``visual7w``); ``labelf`` the questions' answers with their scores, one dict a sentence of the same source
(a question without answers has ``{}``). Every sentence is a pre-training sentence of its image (masked
for MLM, swapped for matching); with image QA (`lxmert_image_qa`) the questions' labels are the QA targets.

Where LXMERT's code fixes what the paper does not, we follow it: answers are normalised by its
``AnswerTable.convert_ans`` (`convert_answer`). Its joint table is a released file (``all_ans.json``, 9,500
answers), read when given (`--qa_answers`, `tasks.vqa.read_answer_vocab`); without it the table is counted
from the files, as `data.pretrain_qa` counts VQA's and GQA's: the converted answers that are the best-scored
answer of at least `min_count` questions, most frequent first, ties alphabetical. Images are named by
``img_id`` as written (COCO file stems, which a store keyed by COCO id also finds; Visual Genome ids).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlberts.data.coco import CaptionRef
from vlberts.data.pretrain_qa import PretrainQA
from vlberts.data.vqa import label_scores
from vlberts.errors import VlbertsError
from vlberts.io import read_json, require_keys, require_text
from vlberts.tasks.vqa import AnswerVocab, SoftTarget, label_target

# The sources whose sentences are questions with answers (`labelf`), as LXMERT's pre-training data names them.
QA_SOURCES = ("vqa", "gqa", "visual7w")
# `AnswerTable.ANS_CONVERT` of LXMERT's `src/pretrain/qa_answer_table.py`.
_ANS_CONVERT = {
    "a man": "man", "the man": "man", "a woman": "woman", "the woman": "woman",
    "one": "1", "two": "2", "three": "3", "four": "4", "five": "5",
    "six": "6", "seven": "7", "eight": "8", "nine": "9", "ten": "10", "grey": "gray",
}  # fmt: skip


@dataclass(frozen=True)
class LxmertSentence:
    """One sentence of LXMERT's corpus: its image, text and source; a question's answers and scores."""

    image_id: str
    text: str
    source: str  # mscoco, vg, vqa, gqa, visual7w
    label: dict[str, float] | None = None  # sources in QA_SOURCES: {answer: score} ({} = no answer)


def convert_answer(answer: str) -> str:
    """LXMERT's `AnswerTable.convert_ans`: lower case; a trailing "." and a leading "a ", "an " or "the " dropped;
    "one".."ten" as digits, "grey" as "gray"."""
    answer = answer.lower()
    if answer.endswith("."):
        answer = answer[:-1].strip()
    for article in ("a ", "an ", "the "):
        if answer.startswith(article):
            answer = answer[len(article):].strip()
    return _ANS_CONVERT.get(answer, answer)


def _image_sentences(rec: Any, *, path: Path, record: str) -> list[LxmertSentence]:
    require_keys(rec, ("img_id", "sentf"), path=path, record=record)
    image_id, sentf, labelf = rec["img_id"], rec["sentf"], rec.get("labelf") or {}
    if not isinstance(image_id, str) or not image_id:
        raise VlbertsError(f"img_id must be a non-empty string, got {image_id!r}", path=path, record=record)
    if not isinstance(sentf, dict) or not isinstance(labelf, dict):
        raise VlbertsError("sentf and labelf must be objects (source -> list)", path=path, record=record)
    out = []
    for source, sents in sentf.items():
        where = f"{record}.sentf.{source}"
        if not isinstance(sents, list):
            raise VlbertsError(f"sentf.{source} must be a list of sentences", path=path, record=record)
        labels = labelf.get(source)
        if source in QA_SOURCES and (not isinstance(labels, list) or len(labels) != len(sents)):
            got = len(labels) if isinstance(labels, list) else "none"
            raise VlbertsError(f"labelf.{source} must hold one label for each of the {len(sents)} questions, got {got}",
                               path=path, record=record)
        for j, text in enumerate(sents):
            label = label_scores(labels[j], path=path, record=f"{record}.labelf.{source}[{j}]") if source in QA_SOURCES else None
            out.append(LxmertSentence(image_id, require_text(text, f"sentf.{source}[{j}]", path=path, record=where),
                                      source, label))
    return out


def read_lxmert_corpus(paths: str | Path) -> list[LxmertSentence]:
    """Every sentence of LXMERT's corpus files (one path, or several comma-separated), file by file, image by
    image, in each image's source order. A damaged record is a one-line error naming the file and the record
    (``[i] (img_id X)``, with the field: ``.sentf.vqa``, ``.labelf.vqa[3]``)."""
    return [s for _, sentences in read_lxmert_files(paths) for s in sentences]


def read_lxmert_files(paths: str | Path) -> list[tuple[str, list[LxmertSentence]]]:
    """`read_lxmert_corpus`'s sentences file by file: (each name as given, its sentences), with the same checks
    (an image's record in two files is an error). Read once where a run takes both the captions and the
    questions of the corpus (`vlberts pretrain --qa_lxmert`: LXMERT's 9.18M sentences in every rank)."""
    out: list[tuple[str, list[LxmertSentence]]] = []
    seen: dict[str, tuple[int, Path, int]] = {}  # img_id -> (file, record) where it was: one record an image
    for k, name in enumerate(p.strip() for p in str(paths).split(",") if p.strip()):
        path = Path(name)
        sentences: list[LxmertSentence] = []
        out.append((name, sentences))
        data = read_json(path)
        if not isinstance(data, list):
            raise VlbertsError("expected a JSON list of image records {img_id, sentf, labelf} (LXMERT's "
                               "pre-training corpus; an LXMERT corpus file as --captions needs "
                               "--captions_format=lxmert)", path=path)
        for i, rec in enumerate(data):
            img = rec.get("img_id") if isinstance(rec, dict) else None
            where = f"[{i}]" + (f" (img_id {img})" if img else "")
            if isinstance(img, str) and img in seen:
                f, first, j = seen[img]
                of = "" if f == k else f" of {first}" + (", the same file given twice" if first == path else "")
                raise VlbertsError(f"img_id {img} has a record already (at [{j}]{of}): its sentences would be read "
                                   "twice", path=path, record=where)
            if isinstance(img, str):
                seen[img] = (k, path, i)
            sentences.extend(_image_sentences(rec, path=path, record=where))
    if not any(sentences for _, sentences in out):
        raise VlbertsError("no sentence in LXMERT's corpus files", path=paths)
    return out


def lxmert_image_qa(sentences: list[LxmertSentence], source: str, min_count: int = 1,
                    answers: AnswerVocab | None = None) -> PretrainQA:
    """The corpus's questions as image-QA sentences (`data.pretrain_qa.PretrainQA`): targets are the questions'
    label scores over the joint table (module docstring), or over `answers` when given (LXMERT's released
    ``all_ans.json``, `--qa_answers`: its code's table, whose answers are already converted); answers outside
    the table leave the label, as LXMERT's `LXMERTDataset` drops them, and a question none of whose answers is
    in the table stays a sentence without a QA label. `source` names the files (for the run's record)."""
    questions = [s for s in sentences if s.label is not None]
    if answers is None:
        answers = counted_answer_table(qa_answer_counts(s.label for s in questions), min_count, source)
    targets = [qa_target(s.label, answers) for s in questions]
    return PretrainQA([CaptionRef(s.image_id, s.text) for s in questions], targets, answers, ((source, len(questions)),))


def qa_answer_counts(labels: Iterable[dict[str, float]]) -> Counter:
    """How many questions have each (converted) answer as their best-scored one: what the joint table is counted
    from (`counted_answer_table`; a shard set's index keeps them for a streamed run)."""
    counts: Counter = Counter()
    for label in labels:
        converted = _converted(label)
        if converted:
            counts[max(converted, key=converted.__getitem__)] += 1
    return counts


def counted_answer_table(counts: Mapping[str, int], min_count: int, source: str | Path) -> AnswerVocab:
    """The joint table of `qa_answer_counts`: answers that are the best of at least `min_count` questions, most
    frequent first, ties alphabetical; none is a one-line error naming `source`."""
    answers = AnswerVocab.from_counts(Counter(counts), min_count)
    if not len(answers):
        raise VlbertsError(f"no answer is the best answer of {min_count}+ questions of LXMERT's corpus", path=source)
    return answers


def qa_target(label: dict[str, float], answers: AnswerVocab) -> SoftTarget:
    """A question's QA target: its label's answers converted (`convert_answer`) and scored over the joint table
    (those outside it dropped)."""
    return label_target(_converted(label), answers)


def _converted(label: dict[str, float]) -> dict[str, float]:
    """A label with its answers converted (`convert_answer`); answers that become one keep the higher score."""
    out: dict[str, float] = {}
    for answer, score in label.items():
        a = convert_answer(answer)
        out[a] = max(score, out.get(a, 0.0))
    return out
