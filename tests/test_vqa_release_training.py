"""VL-BERT's VQA fine-tuning as its release trains it (`vqa/function/train.py`, `vqa/data/datasets/vqa.py`):
the answer classifier's rows started from the answers' word embeddings (`CLASSIFIER_PRETRAINED`), and
training questions shown mirrored (`FLIP_PROB`): boxes flipped, "left"/"right" swapped in the question and
in the answers the target is computed from."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_vqa_archs import pretrained, short_cfg  # noqa: F401 -- the module's pre-trained tiny models

from vlberts.data.gqa import GQAExample
from vlberts.data.regions import load_regions, mirrored
from vlberts.data.vqa import VQAExample
from vlberts.data.mirror import mirrored_subwords
from vlberts.data.vqa_dataset import VQAData, mirrored_answers
from vlberts.errors import VlbertsError
from vlberts.features.store import RegionStore
from vlberts.recipes.finetune_qa import build_qa_model, uses_answer_word_init
from vlberts.recipes.finetune_vqa import FinetuneVQAConfig, finetune_vqa
from vlberts.tasks.vqa import AnswerVocab
from vlberts.text.tokenizer import TextTokenizer


def test_answer_rows_start_from_the_answers_word_embeddings(pretrained):  # noqa: F811
    vocab = AnswerVocab(("red", "dark blue", "", "circle"))
    model, cfg, _ = build_qa_model(pretrained["vlbert"], vocab, answer_classifier="mlm")
    tok = TextTokenizer.load(pretrained["vlbert"])
    subwords = [tok.encode(a) for a in vocab.answers]
    assert len(subwords[1]) >= 2 and subwords[2] == []  # an answer of several subwords, one of none
    out = model.classifier[-1]
    before = out.weight.detach().clone()
    assert model.init_answer_rows(subwords) == 3
    table = model.bert.embeddings.word_embeddings.weight.detach()
    for a, ids in enumerate(subwords):
        expected = table[ids].mean(0) if ids else before[a]  # "" keeps its Xavier row
        assert torch.allclose(out.weight[a], expected, atol=0, rtol=0), vocab.answers[a]
    assert not out.bias.any()
    with pytest.raises(ValueError, match="768|wide output layer"):
        build_qa_model(pretrained["vlbert"], vocab, answer_classifier="2fc")[0].init_answer_rows(subwords)


def test_answer_word_init_setting(pretrained):  # noqa: F811
    from vlberts.training.checkpoint import read_model_config
    from dataclasses import replace

    vl = read_model_config(pretrained["vlbert"])[0]
    vb = read_model_config(pretrained["visualbert"])[0]
    mlm, fc1, fc2 = (replace(vl, answer_classifier=k) for k in ("mlm", "1fc", "2fc"))
    assert uses_answer_word_init("auto", mlm, "x") and not uses_answer_word_init("auto", fc1, "x")
    assert uses_answer_word_init("true", fc1, "x") and not uses_answer_word_init("false", mlm, "x")
    assert not uses_answer_word_init("auto", fc2, "x") and not uses_answer_word_init("auto", vb, "x")
    for setting, cfg, message in (("true", fc2, "needs --answer_classifier=1fc or mlm"),
                                  ("true", vb, "--init holds a visualbert model"),
                                  ("yes", mlm, "must be auto, true or false")):
        with pytest.raises(VlbertsError, match=message):
            uses_answer_word_init(setting, cfg, "x")


def test_finetuning_starts_the_mlm_classifier_from_word_embeddings(tiny_world, pretrained, tmp_path):  # noqa: F811
    """With --lr=0 the saved classifier is the one training started from: each answer's row the mean of its
    subwords' embeddings under auto (mlm), Xavier under false."""
    rows = {}
    for setting in ("auto", "false"):
        out = tmp_path / setting
        cfg = {**vars(short_cfg(tiny_world, pretrained["vlbert"], out)), "answer_classifier": "mlm",
               "answer_word_init": setting, "lr": 0.0, "weight_decay": 0.0}
        finetune_vqa(FinetuneVQAConfig(**cfg))
        metrics = json.loads((out / "metrics.json").read_text())
        answers = json.loads((out / "model" / "config.json").read_text())["answers"]
        sd = load_file(str(out / "model" / "model.safetensors"))
        tok = TextTokenizer.load(out / "model")
        means = torch.stack([sd["bert.embeddings.word_embeddings.weight"][tok.encode(a)].mean(0) for a in answers])
        rows[setting] = (metrics["answer_rows_from_word_embeddings"], torch.allclose(sd["classifier.2.weight"], means))
    assert rows["auto"][0] > 0 and rows["auto"][1]
    assert rows["false"] == (0, False)


# ----------------------------------------------------------------------------------------- mirrored questions


def _flip_data(world, tok: TextTokenizer, flip_prob: float) -> tuple[VQAData, str]:
    store = RegionStore(world.store)
    image = store.ids()[0]
    ex = VQAExample(question_id=7, image_id=image, question="what is left of the circle right here?",
                    answers=["left"] * 6 + ["right"] * 3 + ["far left"])
    vocab = AnswerVocab(("left", "right", "far right", "yes"))
    return VQAData([ex], store, tok, vocab, max_regions=12, text_format="question", flip_prob=flip_prob, seed=3), image


def test_a_mirrored_item_flips_boxes_question_and_answers(tiny_world, pretrained):  # noqa: F811
    tok = TextTokenizer.load(pretrained["vlbert"])
    data, image = _flip_data(tiny_world, tok, flip_prob=1.0)
    plain, flipped = data[0], data[(0, 0)]
    left, right = tok.tok.token_to_id("left"), tok.tok.token_to_id("right")
    swap = {left: right, right: left}
    assert left in plain["ids"] and right in plain["ids"]
    assert flipped["ids"] == [swap.get(i, i) for i in plain["ids"]]
    b, f = plain["regions"].boxes, flipped["regions"].boxes
    assert len(b) and np.allclose(f[:, [0, 2]], 1 - b[:, [2, 0]], atol=1e-6) and np.array_equal(f[:, [1, 3]], b[:, [1, 3]])
    assert np.array_equal(flipped["regions"].feats, plain["regions"].feats)
    rec = RegionStore(tiny_world.store).get(image)
    assert np.allclose(flipped["regions"].pixel_boxes[:, 0], rec.image_w - plain["regions"].pixel_boxes[:, 2])
    # Targets: the official soft scores of the swapped answers; "far left" (no class) becomes "far right" (a class).
    as_dict = lambda t: dict(zip(t.labels, np.round(t.scores, 6)))  # noqa: E731
    assert as_dict(plain["target"]) == {0: 1.0, 1: 0.9}
    assert as_dict(flipped["target"]) == {1: 1.0, 0: 0.9, 2: 0.3}
    # The draw is per (epoch, example): the same key always gives the same item; an index alone never flips.
    assert data[(0, 0)]["ids"] == flipped["ids"] and data[0]["ids"] == plain["ids"]
    assert _flip_data(tiny_world, tok, flip_prob=0.0)[0][(0, 0)]["ids"] == plain["ids"]
    half = _flip_data(tiny_world, tok, flip_prob=0.5)[0]
    drawn = [half[(e, 0)]["ids"] != plain["ids"] for e in range(400)]
    assert 0.42 < np.mean(drawn) < 0.58
    with pytest.raises(VlbertsError, match=r"--flip_prob must be a probability in \[0, 1\], got 1.5"):
        _flip_data(tiny_world, tok, flip_prob=1.5)


def test_mirrored_answers_of_every_reader():
    vqa = VQAExample(question_id=1, image_id=1, question="q", answers=["left", "on the right", "leftover"],
                     multiple_choice_answer="left")
    m = mirrored_answers(vqa)
    assert m.answers == ["right", "on the left", "leftover"] and m.multiple_choice_answer == "right"
    lxmert = VQAExample(question_id=2, image_id=1, question="q", label={"left": 1.0, "right": 0.3, "red": 0.6})
    assert mirrored_answers(lxmert).label == {"right": 1.0, "left": 0.3, "red": 0.6}
    assert mirrored_answers(GQAExample(question_id="3", image_id="1", question="q", answer="right")).answer == "left"
    assert mirrored_answers(vqa).question == "q"  # the question is swapped on its subwords (`VQAData`)
    only_left = SimpleNamespace(tok=SimpleNamespace(token_to_id=lambda w: 5 if w == "left" else None))
    with pytest.raises(VlbertsError, match="'right' is not a token of the model's vocabulary"):
        mirrored_subwords(only_left)


def test_finetuning_with_mirrored_questions(tiny_world, pretrained, tmp_path):  # noqa: F811
    """--flip_prob reaches the training items: every question mirrored (1.0) trains on other inputs than
    none (0.0), from the same start; a bad value stops the run before any file is read."""
    first = {}
    for p in (0.0, 1.0):
        out = tmp_path / f"flip{p}"
        finetune_vqa(FinetuneVQAConfig(**{**vars(short_cfg(tiny_world, pretrained["lxmert"], out)), "flip_prob": p}))
        log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        first[p] = next(r["loss"] for r in log if "loss" in r)
    assert first[0.0] != first[1.0]
    cfg = {**vars(short_cfg(tiny_world, pretrained["lxmert"], tmp_path / "bad")), "flip_prob": -0.1,
           "train_questions": str(tmp_path / "missing.json")}
    with pytest.raises(VlbertsError, match=r"FinetuneVQAConfig.flip_prob: must be at least 0, got -0.1$"):
        finetune_vqa(FinetuneVQAConfig(**cfg))
    cfg = {**cfg, "flip_prob": 1.0, "init": str(_without_left(pretrained["lxmert"], tmp_path / "no_left"))}
    with pytest.raises(VlbertsError, match="'left' is not a token of the model's vocabulary"):
        finetune_vqa(FinetuneVQAConfig(**cfg))


def test_mirroring_keeps_an_empty_image_and_needs_the_width(tmp_path):
    rec = SimpleNamespace(features=np.zeros((0, 4), np.float32), boxes=np.zeros((0, 4), np.float32), image_w=10,
                          image_h=8)
    source = SimpleNamespace(get=lambda image_id: rec)
    assert mirrored(load_regions(source, "1", 36)).boxes.shape == (0, 4)
    rec.image_w = 0
    with pytest.raises(ValueError, match="needs the image's width"):
        mirrored(load_regions(source, "1", 36))


# ----------------------------------------------------------------------------------------- RefCOCO+ mirrored


def test_a_mirrored_referring_expression_keeps_its_targets(tiny_world, pretrained):  # noqa: F811
    """VL-BERT's RefCOCO+ config flips too: the boxes mirrored, "left"/"right" swapped in the expression, the
    per-region targets unchanged (the gold box flips with the regions, and IoU does not change)."""
    from vlberts.data.refcoco import RefExpression
    from vlberts.data.refcoco_dataset import RefData

    tok = TextTokenizer.load(pretrained["vlbert"])
    store = RegionStore(tiny_world.store)
    image = store.ids()[0]
    x1, y1, x2, y2 = store.get(image).boxes[0].tolist()
    ex = RefExpression(ref_id=1, sent_id=1, image_id=int(image), ann_id=1, category_id=1, split="train",
                       sent="the shape on the left", tokens=(), gold_bbox=(x1, y1, x2 - x1, y2 - y1))
    data = RefData([ex], store, tok, max_regions=12, flip_prob=1.0, seed=0)
    plain, flipped = data[0], data[(0, 0)]
    left, right = tok.tok.token_to_id("left"), tok.tok.token_to_id("right")
    assert left in plain["ids"] and flipped["ids"] == [right if i == left else i for i in plain["ids"]]
    b, f = plain["regions"].boxes, flipped["regions"].boxes
    assert np.allclose(f[:, [0, 2]], 1 - b[:, [2, 0]], atol=1e-6)
    assert flipped["targets"] == plain["targets"] and plain["targets"][0] == 1.0


def test_finetuning_refcoco_with_mirrored_expressions(tiny_world, pretrained, tmp_path):  # noqa: F811
    """`finetune refcoco --flip_prob` reaches the training items: all mirrored trains on other inputs than none
    (VL-BERT reads the boxes through its geometry embedding; VisualBERT, without spatial features, would not
    see the flip)."""
    import json as _json

    from test_refcoco_task import ref_cfg

    from vlberts.recipes.finetune_refcoco import FinetuneRefCocoConfig, finetune_refcoco

    first = {}
    for p in (0.0, 1.0):
        cfg = ref_cfg(tiny_world, pretrained["vlbert"], tmp_path / f"flip{p}", epochs=0.2, eval_splits="val",
                      max_regions=12)
        finetune_refcoco(FinetuneRefCocoConfig(**{**vars(cfg), "flip_prob": p, "log_every": 1}))
        log = [_json.loads(line) for line in (tmp_path / f"flip{p}" / "metrics.jsonl").read_text().splitlines()]
        first[p] = next(r["loss"] for r in log if "loss" in r)
    assert first[0.0] != first[1.0]
    # Bad settings stop the run before the refs are read: a value that is no probability, and a model whose
    # vocabulary cannot swap the words.
    missing = {**vars(cfg), "refs": str(tmp_path / "missing.p")}
    with pytest.raises(VlbertsError, match=r"FinetuneRefCocoConfig.flip_prob: must be at most 1, got 1.5$"):
        finetune_refcoco(FinetuneRefCocoConfig(**{**missing, "flip_prob": 1.5}))
    no_left = _without_left(pretrained["vlbert"], tmp_path / "no_left")
    with pytest.raises(VlbertsError, match="'left' is not a token of the model's vocabulary"):
        finetune_refcoco(FinetuneRefCocoConfig(**{**missing, "init": str(no_left), "flip_prob": 0.5}))


def _without_left(model_dir: Path, out: Path) -> Path:
    """A copy of a model directory whose vocabulary spells "left" otherwise (same size, so the model loads)."""
    import shutil

    shutil.copytree(model_dir, out)
    vocab = out / "vocab.txt"
    vocab.write_text("".join("lef-t\n" if line == "left\n" else line for line in vocab.open()))
    return out
