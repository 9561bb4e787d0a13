"""VisualBERT's task-specific pre-training on a task's own texts (`data/task_texts.py`,
`vlberts pretrain --captions_format=vqa|gqa|nlvr2`): each format's (image id, text) pairs from the world's
files in their released formats, NLVR2's statements once with each image through the image map, and a
task-specific pre-training run on the VQA questions from a pre-trained model."""

from __future__ import annotations

import json

import pytest

from vlberts.data.gqa import read_gqa
from vlberts.data.nlvr2 import read_image_map, read_nlvr2
from vlberts.data.task_texts import task_caption_refs
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
    with pytest.raises(VlbertsError, match="unknown captions format 'vqa2'; valid: coco, vqa, gqa, nlvr2"):
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
