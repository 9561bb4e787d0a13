"""VisualBERT's task-specific pre-training on a task's own texts (`data/task_texts.py`,
`vlberts pretrain --captions_format=vqa|gqa|nlvr2|vcr`): each format's (image id, text) pairs from the world's
files in their released formats, NLVR2's statements once with each image through the image map, VCR's
question + right answer (+ right rationale) rendered as VCR fine-tuning renders them, and task-specific
pre-training runs on the VQA and VCR questions from a pre-trained model."""

from __future__ import annotations

import json

import pytest

from vlberts.data.gqa import read_gqa
from vlberts.data.nlvr2 import read_image_map, read_nlvr2
from vlberts.data.task_texts import task_caption_refs
from vlberts.data.vcr import read_vcr
from vlberts.data.vqa import read_vqa
from vlberts.errors import VlbertsError
from vlberts.features.store import RegionStore
from vlberts.recipes.pretrain import PretrainConfig, pretrain
from vlberts.training.metrics import MetricsLog


def test_each_format_gives_the_task_texts_with_their_images(tiny_world):
    q, _ = tiny_world.vqa("train")
    refs = task_caption_refs(q, "vqa")
    want = [(str(ex.image_id), ex.question) for ex in read_vqa(q)]
    assert [(r.image_id, r.text) for r in refs] == want and len(want) > 10

    g = tiny_world.root / "gqa" / "train_balanced_questions.json"
    assert [(r.image_id, r.text) for r in task_caption_refs(g, "gqa")] == [
        (ex.image_id, ex.question) for ex in read_gqa(g)]

    n, m = tiny_world.root / "nlvr2" / "train.json", tiny_world.root / "nlvr2" / "images.json"
    names = read_image_map(m)
    refs = task_caption_refs(n, "nlvr2", image_map=m)
    statements = read_nlvr2(n)
    assert [(r.image_id, r.text) for r in refs] == [
        (names[name], ex.sentence) for ex in statements for name in ex.image_ids]  # each statement with each image
    with RegionStore(tiny_world.store) as store:
        assert all(r.image_id in store for r in refs)

    assert task_caption_refs(tiny_world.captions_train, "coco") == task_caption_refs(tiny_world.captions_train)


def test_bad_formats_and_maps_are_one_line_errors(tiny_world, tmp_path):
    q, _ = tiny_world.vqa("train")
    with pytest.raises(VlbertsError, match="unknown captions format 'vqa2'; valid: coco, vqa, gqa, nlvr2, vcr, lxmert$"):
        task_caption_refs(q, "vqa2")
    with pytest.raises(VlbertsError, match="--image_map names NLVR2's images; the vqa format has none"):
        task_caption_refs(q, "vqa", image_map=tiny_world.root / "nlvr2" / "images.json")
    n = tiny_world.root / "nlvr2" / "train.json"
    first = read_nlvr2(n)[0]
    (tmp_path / "map.json").write_text(json.dumps({first.left_image_id: "1"}))
    with pytest.raises(VlbertsError, match=rf"record {first.identifier}: image {first.right_image_id} is not in the image map"):
        task_caption_refs(n, "nlvr2", image_map=tmp_path / "map.json")


def test_task_specific_pretraining_on_the_vqa_questions(tiny_world, tiny_pretrained, tmp_path):
    """VisualBERT §3.3: from the pre-trained model, masked-word prediction with the image on the task's own
    texts (one text an example, MLM only), whose words the run's vocabulary is the model's."""
    q, _ = tiny_world.vqa("train")
    out = tmp_path / "tspt"
    final = pretrain(PretrainConfig(captions=str(q), captions_format="vqa", features=str(tiny_world.store),
                                    init=str(tiny_pretrained), pairs=False, out=str(out), steps=3, batch_size=8,
                                    log_every=1, ckpt_every=100))
    assert final == out / "model"
    log = MetricsLog.read(out / "metrics.jsonl")
    assert [r["step"] for r in log] == [1, 2, 3] and all(r["mlm_loss"] > 0 for r in log)
    assert all(r.get("match_loss", 0.0) == 0.0 for r in log)  # MLM only
    assert (final / "vocab.txt").read_text() == (tiny_pretrained / "vocab.txt").read_text()
    assert json.loads((out / "run_config.json").read_text())["captions_format"] == "vqa"


def _vcr_record(annot_id: str, img_id: str, objects: list, question: list, answers: list, rationales: list,
                labels: tuple[int, int] | None) -> dict:
    """One line of a VCR jsonl file (the released format, formats-and-metrics.md §2.5)."""
    rec = {"movie": "3015_CHARLIE_ST_CLOUD", "objects": objects, "img_fn": f"lsmdc_3015/{img_id}@0.jpg",
           "metadata_fn": f"lsmdc_3015/{img_id}@0.json", "question": question, "answer_choices": answers,
           "rationale_choices": rationales, "img_id": img_id, "annot_id": annot_id, "question_number": 0}
    if labels is not None:
        rec["answer_label"], rec["rationale_label"] = labels
    return rec


def write_vcr_fixture(path, labels: bool = True):
    """Two VCR questions: a two-person reference ([[0, 1], ...]), people named by their object index (0 Casey,
    1 Riley, 3 Jackie), a two-word class name ("wine glass"), right choices not at index 0."""
    wrong = [["They", "are", "dancing", "."], ["Nobody", "is", "there", "."], ["It", "is", "raining", "."]]
    records = [
        _vcr_record("train-0", "train-0", ["person", "person", "wine glass", "person"],
                    ["What", "are", [0, 1], "doing", "?"],
                    [wrong[0], [[0, 1], "are", "talking", "."], wrong[1], wrong[2]],
                    [wrong[1], wrong[2], wrong[0], [[0], "holds", "a", [2], "and", "faces", [1], "."]],
                    (1, 3) if labels else None),
        _vcr_record("train-1", "train-7", ["dog", "person", "person", "person"],
                    ["Why", "is", [3], "smiling", "?"],
                    [wrong[0], wrong[1], [[3], "sees", "the", [0], "."], wrong[2]],
                    [[[1, 3], "are", "friends", "."], wrong[0], wrong[1], wrong[2]],
                    (2, 0) if labels else None),
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_vcr_gives_question_and_right_answer_then_with_right_rationale_as_finetuning_renders_them(tmp_path):
    """Two texts a question (VisualBERT's released Q->A and QA->R pre-training sequences, right choices only),
    object references as VCR fine-tuning writes them for VisualBERT (names side by side), keyed by img_id
    (the key VCR fine-tuning reads the region store by, not img_fn)."""
    path = write_vcr_fixture(tmp_path / "train.jsonl")
    refs = task_caption_refs(path, "vcr")
    assert [(r.image_id, r.text) for r in refs] == [
        ("train-0", "What are Casey Riley doing ? Casey Riley are talking ."),
        ("train-0", "What are Casey Riley doing ? Casey Riley are talking . Casey holds a wine glass and faces Riley ."),
        ("train-7", "Why is Jackie smiling ? Jackie sees the dog ."),
        ("train-7", "Why is Jackie smiling ? Jackie sees the dog . Riley Jackie are friends ."),
    ]
    joined = task_caption_refs(path, "vcr", join="and")  # VL-BERT's rendering (data.vcr_dataset.JOIN)
    assert joined[1].text == ("What are Casey and Riley doing ? Casey and Riley are talking . "
                              "Casey holds a wine glass and faces Riley .")


def test_vcr_without_labels_is_refused_in_one_line_naming_the_file(tmp_path):
    path = write_vcr_fixture(tmp_path / "test.jsonl", labels=False)
    with pytest.raises(VlbertsError) as err:
        task_caption_refs(path, "vcr")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}: record train-0: no answer_label or rationale_label")
    assert "right answer and rationale" in msg
    with pytest.raises(VlbertsError, match="--image_map names NLVR2's images; the vcr format has none"):
        task_caption_refs(write_vcr_fixture(tmp_path / "train.jsonl"), "vcr", image_map=tmp_path / "map.json")


def test_task_specific_pretraining_on_the_world_vcr_questions(tiny_world, tiny_pretrained, tmp_path):
    """The world's VCR files: two texts a training question, with the image the store holds under its img_id
    (the store VCR fine-tuning reads); the unlabelled test file is refused; a short MLM-only run from the
    pre-trained model reads them."""
    train = tiny_world.root / "vcr" / "train.jsonl"
    examples = read_vcr(train)
    refs = task_caption_refs(train, "vcr")
    assert len(examples) > 5 and [r.image_id for r in refs] == [ex.img_id for ex in examples for _ in range(2)]
    for qa, qar in zip(refs[::2], refs[1::2]):
        assert qar.text.startswith(qa.text + " ") and "[" not in qar.text  # references became words
    with RegionStore(tiny_world.store) as store:
        assert all(r.image_id in store for r in refs)
    test = tiny_world.root / "vcr" / "test.jsonl"
    with pytest.raises(VlbertsError, match=rf"^{test}: record test-0: no answer_label or rationale_label"):
        task_caption_refs(test, "vcr")

    out = tmp_path / "tspt"
    final = pretrain(PretrainConfig(captions=str(train), captions_format="vcr", features=str(tiny_world.store),
                                    init=str(tiny_pretrained), pairs=False, out=str(out), steps=2, batch_size=8,
                                    log_every=1, ckpt_every=100))
    log = MetricsLog.read(out / "metrics.jsonl")
    assert final == out / "model" and [r["step"] for r in log] == [1, 2] and all(r["mlm_loss"] > 0 for r in log)
    assert all(r.get("match_loss", 0.0) == 0.0 for r in log)  # MLM only
    assert json.loads((out / "run_config.json").read_text())["captions_format"] == "vcr"
