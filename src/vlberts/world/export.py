"""The embedded world in the real formats (reference/formats-and-metrics.md §2.1, §2.2, §2.7).

Pure functions from world records to the exact structures of the real files; `build.py` writes them.

Ids (all positive ints, derived so that each is stable whatever the split or the worker count):
- image_id: 1..N; image file `images/{image_id:012d}.png`.
- caption id (COCO annotation id = Karpathy sentid): image_id * 10 + caption index (0..4).
- question_id: image_id * 1000 + question index, as in VQA v2.
- chain id (Flickr30K Entities): image_id * 100 + local id (see `grammar`); 0 = notvisual.
- CoNLL-U sent_id: "{image_id}_{caption index}".

Boxes: `scenes.jsonl` holds 0-based pixel-edge boxes, end exclusive (`scene` module docstring).
The Flickr30K Entities XML holds 1-based inclusive pixel indices, as the real data set does:
xmin = x1 + 1, ymin = y1 + 1, xmax = x2, ymax = y2. `vlberts.data.flickr_entities` converts back.
"""

from __future__ import annotations

from vlberts.world.grammar import Caption
from vlberts.world.questions import Question
from vlberts.world.scene import Scene

FORMAT_VERSION = 1
CAPTION_ID_FACTOR = 10
SPLITS = ("train", "val", "test")
WORLD_INFO = {"description": "vlberts embedded world", "version": str(FORMAT_VERSION), "year": 2024,
              "contributor": "vlberts", "url": "", "date_created": ""}
WORLD_LICENSE = {"id": 1, "name": "generated data, no restrictions", "url": ""}


def caption_id(image_id: int, index: int) -> int:
    return image_id * CAPTION_ID_FACTOR + index


def sent_id(image_id: int, index: int) -> str:
    return f"{image_id}_{index}"


# --------------------------------------------------------------------------- COCO + Karpathy

def coco_image(scene: Scene) -> dict:
    return {"id": scene.image_id, "file_name": scene.file_name, "width": scene.width, "height": scene.height,
            "license": 1}


def coco_annotations(scene: Scene, captions: list[Caption]) -> list[dict]:
    return [{"id": caption_id(scene.image_id, k), "image_id": scene.image_id, "caption": c.text}
            for k, c in enumerate(captions)]


def coco_captions_file(images: list[dict], annotations: list[dict]) -> dict:
    """Official COCO captions layout: info, licenses, images, annotations."""
    return {"info": WORLD_INFO, "licenses": [WORLD_LICENSE], "images": images, "annotations": annotations}


def karpathy_image(scene: Scene, captions: list[Caption], split: str) -> dict:
    """One image of a Karpathy split file. `tokens` drop punctuation, as Karpathy's preprocessing does;
    `raw` is the caption text exactly as in every other file."""
    sentences = []
    for k, c in enumerate(captions):
        sentences.append({
            "tokens": [w for w in c.words if w not in (".", ",")], "raw": c.text,
            "imgid": scene.image_id - 1, "sentid": caption_id(scene.image_id, k),
        })
    return {
        "filepath": "images", "filename": scene.file_name, "imgid": scene.image_id - 1, "cocoid": scene.image_id,
        "split": split, "sentids": [s["sentid"] for s in sentences], "sentences": sentences,
    }


# --------------------------------------------------------------------------- VQA v2

def vqa_question(q: Question) -> dict:
    return {"image_id": q.image_id, "question": q.question, "question_id": q.question_id}


def vqa_annotation(q: Question) -> dict:
    return {
        "question_type": q.question_type,
        "multiple_choice_answer": q.multiple_choice_answer,
        "answers": [{"answer": a.answer, "answer_confidence": a.answer_confidence, "answer_id": a.answer_id}
                    for a in q.answers],
        "image_id": q.image_id,
        "answer_type": q.answer_type,
        "question_id": q.question_id,
    }


def vqa_questions_file(split: str, questions: list[dict]) -> dict:
    return {"info": WORLD_INFO, "task_type": "Open-Ended", "data_type": "world", "data_subtype": split,
            "license": WORLD_LICENSE, "questions": questions}


def vqa_annotations_file(split: str, annotations: list[dict]) -> dict:
    return {"info": WORLD_INFO, "task_type": "Open-Ended", "data_type": "world", "data_subtype": split,
            "license": WORLD_LICENSE, "annotations": annotations}


# --------------------------------------------------------------------------- Flickr30K Entities

def flickr_sentence_line(caption: Caption) -> str:
    """'[/EN#1203/other a red circle] sits above [/EN#1205/other the blue square] .'"""
    words = list(caption.words)
    for e in caption.entities:
        words[e.start] = f"[/EN#{e.chain_id}/{e.type} {words[e.start]}"
        words[e.end - 1] = words[e.end - 1] + "]"
    return " ".join(words)


def flickr_sentences_file(captions: list[Caption]) -> str:
    return "".join(flickr_sentence_line(c) + "\n" for c in captions)


def flickr_annotation_xml(scene: Scene, captions: list[Caption]) -> str:
    """PASCAL-VOC-like XML: one <object> per box with every chain id that refers to it, plus one
    <object> per box-less chain (the background: <scene>1</scene>)."""
    names: dict[int, set[int]] = {}  # object id -> chain ids
    scene_chains: set[int] = set()
    for c in captions:
        for e in c.entities:
            if e.type == "scene":
                scene_chains.add(e.chain_id)
            for oid in e.object_ids:
                names.setdefault(oid, set()).add(e.chain_id)
    lines = [
        "<annotation>",
        f"  <filename>{scene.file_name}</filename>",
        "  <size>",
        f"    <width>{scene.width}</width>\n    <height>{scene.height}</height>\n    <depth>3</depth>",
        "  </size>",
    ]
    for o in scene.objects:
        if o.object_id not in names:
            continue
        x1, y1, x2, y2 = o.box
        lines.append("  <object>")
        lines.extend(f"    <name>{cid}</name>" for cid in sorted(names[o.object_id]))
        lines.append(f"    <bndbox>\n      <xmin>{x1 + 1}</xmin>\n      <ymin>{y1 + 1}</ymin>\n"
                     f"      <xmax>{x2}</xmax>\n      <ymax>{y2}</ymax>\n    </bndbox>")
        lines.append("  </object>")
    for cid in sorted(scene_chains):
        lines.append(f"  <object>\n    <name>{cid}</name>\n    <nobndbox>0</nobndbox>\n    <scene>1</scene>\n"
                     "  </object>")
    lines.append("</annotation>")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- CoNLL-U

def conllu_block(image_id: int, index: int, caption: Caption) -> str:
    """One sentence in CoNLL-U: comments, then ID FORM LEMMA UPOS XPOS FEATS HEAD DEPREL DEPS MISC."""
    chain_of = {}
    for e in caption.entities:
        for i in range(e.start, e.end):
            chain_of[i] = e.chain_id
    lines = [f"# sent_id = {sent_id(image_id, index)}", f"# text = {caption.text}"]
    for i, t in enumerate(caption.tokens):
        misc = f"Entity={chain_of[i]}" if i in chain_of else "_"
        lines.append(f"{i + 1}\t{t.form}\t{t.lemma}\t{t.upos}\t{t.xpos}\t_\t{t.head}\t{t.deprel}\t_\t{misc}")
    return "\n".join(lines) + "\n\n"
