"""A downstream task's own texts as pre-training captions: VisualBERT's task-specific pre-training (§3.3,
"train with masked language modeling with the image on the task data" before fine-tuning; SPEC §3).

`vlberts pretrain --captions=FILE --captions_format=FORMAT` reads, as (image id, text) pairs:

    coco   a COCO captions file or a Karpathy split file (`--split`), the default
    vqa    VQA v2 questions: each question with its image
    gqa    GQA questions (`*_questions.json`): each question with its image
    nlvr2  NLVR2 statements (JSON lines): each statement twice, once with each of its two images (the
           pre-training data shows one image a text; VisualBERT's NLVR2 model puts both in one sequence),
           image names through `--image_map` (the world's `nlvr2/images.json`) or as the store's keys
    vcr    VCR questions (`{train,val}.jsonl`, labelled): each question twice with its image (`img_id`, the
           key VCR fine-tuning looks regions up by), as question + right answer and as question + right
           answer + right rationale; the test file (no labels) is refused
    lxmert LXMERT's pre-training corpus (`mscoco_train.json`, `vgnococo.json`, ...; several comma-separated):
           every caption and question of each image (`data.lxmert_corpus`); with `questions=False` the
           captions only (the questions then come with their answers through `lxmert_image_qa`)

Answers and labels are not read (task-specific pre-training is masked-word prediction on the texts alone),
except VCR's, which choose the answer and rationale that are true of the image.

VCR: object references become words as VCR fine-tuning writes them (`data.vcr.render_tokens`, a person a
gender-neutral name, multi-object references with VisualBERT's join, `data.vcr_dataset.JOIN`). The two
texts follow VisualBERT's released task-specific pre-training (``configs/vcr/pre-train.json``,
``pretraining_include_qa_and_qar``): a question gives its Q->A sequences and its QA->R sequences (context
= question + right answer), here one text each. The released loader also pre-trains on the three wrong
answers and rationales (8 sequences a question); we keep only the right ones, since a caption here is read
as true of its image (VCR's wrong choices are other questions' right answers, false of this one). A
caption is one text (`CaptionRef`: image id and text), so VCR's context/choice segments and VisualBERT's
word-region alignment (which object each name refers to) are not used in pre-training; the image's
regions are its stored regions, not the objects' regions VCR fine-tuning reads (`data.vcr_dataset`).
"""

from __future__ import annotations

from pathlib import Path

from vlberts.data.coco import CaptionRef, read_caption_refs
from vlberts.errors import VlbertsError

CAPTION_FORMATS = ("coco", "vqa", "gqa", "nlvr2", "vcr", "lxmert")


def task_caption_refs(path: str | Path, fmt: str = "coco", *, split: str = "train",
                      image_map: str | Path | None = None, join: str | None = None,
                      questions: bool = True, sentences: list | None = None) -> list[CaptionRef]:
    """The (image id, text) pairs of `path` read as `fmt` (module docstring).

    join: with ``vcr``, how a multi-object reference is written (`data.vcr_dataset.JOIN`); None: VisualBERT's.
    questions: with ``lxmert``, False leaves the corpus's questions out.
    sentences: with ``lxmert``, the file's sentences already read (`data.lxmert_corpus.read_lxmert_files`)."""
    if fmt not in CAPTION_FORMATS:
        raise VlbertsError(f"unknown captions format {fmt!r}; valid: {', '.join(CAPTION_FORMATS)}")
    if image_map and fmt != "nlvr2":
        raise VlbertsError(f"--image_map names NLVR2's images; the {fmt} format has none to map")
    if fmt == "coco":
        return read_caption_refs(path, split=split)
    if split != "train":  # (the default)
        raise VlbertsError(f"--split picks the images of a Karpathy split file; a {fmt} file has no splits to pick "
                           f"(got {split!r})", path=path)
    if fmt == "vqa":
        from vlberts.data.vqa import read_vqa

        return [CaptionRef(str(ex.image_id), ex.question) for ex in read_vqa(path)]
    if fmt == "gqa":
        from vlberts.data.gqa import read_gqa

        return [CaptionRef(str(ex.image_id), ex.question) for ex in read_gqa(path)]
    if fmt == "vcr":
        return vcr_caption_refs(path, join=join)
    if fmt == "lxmert":
        from vlberts.data.lxmert_corpus import read_lxmert_corpus

        read = read_lxmert_corpus(path) if sentences is None else sentences
        return [CaptionRef(s.image_id, s.text) for s in read if questions or s.label is None]
    from vlberts.data.nlvr2 import read_image_map, read_nlvr2

    names = read_image_map(image_map) if image_map else None
    refs = []
    for ex in read_nlvr2(path):
        for name in ex.image_ids:
            if names is not None and name not in names:
                raise VlbertsError(f"image {name} is not in the image map {image_map}", path=path, record=ex.identifier)
            refs.append(CaptionRef(names[name] if names is not None else name, ex.sentence))
    return refs


def vcr_caption_refs(path: str | Path, *, join: str | None = None) -> list[CaptionRef]:
    """Per labelled VCR question, in file order: (img_id, question + right answer) and (img_id, question + right
    answer + right rationale), object references rendered as VCR fine-tuning renders them (module docstring)."""
    from vlberts.data.vcr import rationale_context, read_vcr, render_tokens
    from vlberts.data.vcr_dataset import JOIN

    join = join or JOIN["visualbert"]
    refs = []
    for ex in read_vcr(path):
        if not ex.annotated:
            raise VlbertsError("no answer_label or rationale_label (a VCR test file?): the vcr pre-training texts "
                               "are the right answer and rationale, so the file must be labelled (train or val)",
                               path=path, record=ex.annot_id)
        qa = rationale_context(ex)  # question + right answer, QA->R's context
        for tokens in (qa, qa + ex.rationale_choices[ex.rationale_label]):  # type: ignore[index]
            text = render_tokens(tokens, ex.objects, join=join).text  # type: ignore[arg-type]
            refs.append(CaptionRef(ex.img_id, text))
    return refs
