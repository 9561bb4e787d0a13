"""A downstream task's own texts as pre-training captions: VisualBERT's task-specific pre-training (§3.3,
"train with masked language modeling with the image on the task data" before fine-tuning; SPEC §3).

`vlberts pretrain --captions=FILE --captions_format=FORMAT` reads, as (image id, text) pairs:

    coco   a COCO captions file or a Karpathy split file (`--split`), the default
    vqa    VQA v2 questions: each question with its image
    gqa    GQA questions (`*_questions.json`): each question with its image
    nlvr2  NLVR2 statements (JSON lines): each statement twice, once with each of its two images (the
           pre-training data shows one image a text; VisualBERT's NLVR2 model puts both in one sequence),
           image names through `--image_map` (the world's `nlvr2/images.json`) or as the store's keys

Answers and labels are not read: task-specific pre-training is masked-word prediction on the texts alone.
"""

from __future__ import annotations

from pathlib import Path

from vlberts.data.coco import CaptionRef, read_caption_refs
from vlberts.errors import VlbertsError

CAPTION_FORMATS = ("coco", "vqa", "gqa", "nlvr2")


def task_caption_refs(path: str | Path, fmt: str = "coco", *, split: str = "train",
                      image_map: str | Path | None = None) -> list[CaptionRef]:
    """The (image id, text) pairs of `path` read as `fmt` (module docstring)."""
    if fmt not in CAPTION_FORMATS:
        raise VlbertsError(f"unknown captions format {fmt!r}; valid: {', '.join(CAPTION_FORMATS)}")
    if image_map and fmt != "nlvr2":
        raise VlbertsError(f"--image_map names NLVR2's images; the {fmt} format has none to map")
    if fmt == "coco":
        return read_caption_refs(path, split=split)
    if fmt == "vqa":
        from vlberts.data.vqa import read_vqa

        return [CaptionRef(str(ex.image_id), ex.question) for ex in read_vqa(path)]
    if fmt == "gqa":
        from vlberts.data.gqa import read_gqa

        return [CaptionRef(str(ex.image_id), ex.question) for ex in read_gqa(path)]
    from vlberts.data.nlvr2 import read_image_map, read_nlvr2

    names = read_image_map(image_map) if image_map else None
    refs = []
    for ex in read_nlvr2(path):
        for name in ex.image_ids:
            if names is not None and name not in names:
                raise VlbertsError(f"image {name} is not in the image map {image_map}", path=path, record=ex.identifier)
            refs.append(CaptionRef(names[name] if names is not None else name, ex.sentence))
    return refs
