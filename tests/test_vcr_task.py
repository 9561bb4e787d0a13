"""VCR end to end on the tiny world: the world's VCR files read back through the real-format reader (right
choices true of the scene, distractors false), the multiple-choice model on every architecture, Q->A /
QA->R fine-tuning (metrics, predictions, exact resume, bad input), and `evaluate vcr` on a hand-made fixture."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import random_init_dir
import torch
from safetensors.torch import load_file

from vlberts.cli import main
from vlberts.data.batch import VLInputs
from vlberts.data.vcr import read_vcr, read_vcr_metadata, render_tokens
from vlberts.data.vcr_dataset import VCRBatch, VCRData, collate_vcr, layout_choice
from vlberts.errors import BadRecords, VlbertsError
from vlberts.features.store import RegionStore
from vlberts.models.builders import model_config
from vlberts.models.vcr import VCRModel, vcr_loss
from vlberts.recipes.finetune_vcr import (
    FinetuneVCRConfig, evaluate_vcr, finetune_vcr, load_vcr_model, predict_vcr, pretrained_vcr_model,
    start_object_head, usable_examples, vcr_data,
)
from vlberts.text.tokenizer import TextTokenizer
from vlberts.world.relations import scene_geometry
from vlberts.world.scene import scene_from_json
from vlberts.world.vcr import positional_relations, generate_vcr

ARCH_MODELS = ["visualbert-tiny", "lxmert-tiny", "vilbert-tiny", "vlbert-tiny", "wvisualbert-tiny"]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def _scenes(world) -> dict[int, object]:
    return {s.image_id: s for s, _ in (scene_from_json(json.loads(line))
                                       for line in (world.root / "scenes.jsonl").read_text().splitlines())}


# --------------------------------------------------------------------------- the world's files

_REL = {("left", "of"): "left", ("right", "of"): "right", ("above",): "above", ("below",): "below"}


def _statement_true(words: list, scene) -> bool:
    """Whether a choice (tokens) holds in the scene, parsed back from the exporter's four sentence forms."""
    obj = scene.objects
    g = scene_geometry(scene)
    colours = {"red", "orange", "yellow", "green", "cyan", "blue", "purple", "white"}

    def rel_at(k: int) -> tuple[str, int]:
        for words_, rel in _REL.items():
            if tuple(words[k : k + len(words_)]) == words_:
                return rel, k + len(words_)
        raise AssertionError(words)

    def holds(rel: str, i: int, j: int) -> bool:
        return bool(g.holds[rel][i, j])

    subj = words[0]
    if words[1] == "are":  # "[i, j] are C ." or "[i, j] are C , and [i] is REL [k] ."
        ok = all(obj[i].colour == words[2] for i in subj)
        if len(words) > 4:
            rel, k = rel_at(7)
            ok = ok and holds(rel, words[5][0], words[k][0])
        return ok
    i = subj[0]
    if words[2] in colours:  # "[i] is C ."
        return obj[i].colour == words[2]
    if words[2] == "the":  # "[i] is the C shape REL [j] ."
        rel, k = rel_at(5)
        return obj[i].colour == words[3] and holds(rel, i, words[k][0])
    rel, k = rel_at(2)  # "[i] is REL [j] ."
    return holds(rel, i, words[k][0])


def test_world_vcr_read_back_one_right_choice_true_of_the_scene(tiny_world):
    scenes = _scenes(tiny_world)
    vcr = tiny_world.root / "vcr"
    examples = {s: read_vcr(vcr / f"{s}.jsonl") for s in ("train", "val", "test")}
    assert all(examples.values()) and all(ex.annotated for s in ("train", "val") for ex in examples[s])
    assert not any(ex.answer_label is not None or ex.rationale_label is not None for ex in examples["test"])
    multi = 0
    for ex in examples["train"] + examples["val"]:
        scene = scenes[int(ex.img_id)]
        assert list(ex.objects) == [o.shape for o in scene.objects]
        meta = read_vcr_metadata(vcr / "metadata" / ex.metadata_fn)
        assert [list(b) for b in meta.boxes] == [list(map(float, o.box)) for o in scene.objects]
        multi += any(not isinstance(t, str) and len(t) > 1 for t in ex.question)
        for choices, label in ((ex.answer_choices, ex.answer_label), (ex.rationale_choices, ex.rationale_label)):
            truth = [_statement_true(list(c), scene) for c in choices]
            assert truth[label] and sum(truth) == 1, (ex.annot_id, truth)
            assert len(set(choices)) == 4  # distinct choices
    assert multi > 0  # multi-object references ("[0, 2]") occur, and render as two names
    pair = next(ex for ex in examples["train"] if not isinstance(ex.question[3], str) and len(ex.question[3]) == 2)
    r = render_tokens(pair.question, pair.objects, join="and")
    i, j = pair.question[3]
    assert r.refs[3:6] == ((i,), (), (j,)) and r.words[4] == "and"
    world = json.loads((tiny_world.root / "world.json").read_text())
    assert "vcr/{train,val,test}.jsonl" in world["files"]["vcr"]


def test_vcr_relations_agree_with_the_world_geometry_and_stream_is_its_own(tiny_world):
    scenes = list(_scenes(tiny_world).values())[:20]
    K = max(len(s.objects) for s in scenes)
    boxes = np.zeros((len(scenes), K, 4))
    for k, s in enumerate(scenes):
        boxes[k, : len(s.objects)] = [o.box for o in s.objects]
    holds, clearly_not = positional_relations(boxes, scenes[0].width)
    for k, s in enumerate(scenes):
        g, n = scene_geometry(s), len(s.objects)
        for r in holds:
            assert np.array_equal(holds[r][k, :n, :n], g.holds[r]) and np.array_equal(clearly_not[r][k, :n, :n], g.clearly_not[r])
    # one image's questions do not depend on which other images are drafted with it (its own SeedSequence);
    # the distractor pool is the split's, so compare the drafted right answers
    a = generate_vcr([(scenes[0], "train"), (scenes[1], "train")], seed=3)["train"]
    b = generate_vcr([(scenes[0], "train")], seed=3)["train"]
    first = [q for q in a if q.image_id == scenes[0].image_id]
    assert [(q.question, q.answer_choices[q.answer_label]) for q in first] == \
        [(q.question, q.answer_choices[q.answer_label]) for q in b]


# --------------------------------------------------------------------------- data and model


def test_layout_alignment_points_at_the_reference_subwords():
    tok = TextTokenizer.train(["what colour is the red circle and square left of star"], vocab_size=80)
    ids, segments, align = layout_choice(("What", "colour", "are", (0, 2), "?"), ((0, 2), "are", "red", "."),
                                         ["circle", "star", "square"], tok, join="and", max_text_len=64)
    assert ids[0] == tok.cls_id and ids.count(tok.sep_id) == 2 and ids[-1] == tok.sep_id
    first_sep = ids.index(tok.sep_id)
    assert segments == [0] * (first_sep + 1) + [1] * (len(ids) - first_sep - 1)
    # object 0 ("circle") is named once in the question and once in the choice; object 1 never
    assert align[1] == [] and len(align[0]) == 2 * len(tok.encode("circle"))
    assert [ids[p] for p in align[0]] == tok.encode("circle") * 2 and [ids[p] for p in align[2]] == tok.encode("square") * 2
    assert all(p < first_sep for p in align[0][:1]) and align[0][-1] > first_sep
    # a too long context loses its first subwords; the alignment follows
    ids2, _, align2 = layout_choice(("What", "colour", "are", (0, 2), "?"), ((0, 2), "are", "red", "."),
                                    ["circle", "star", "square"], tok, join="and", max_text_len=len(ids) - 2)
    assert len(ids2) == len(ids) - 2 and [ids2[p] for p in align2[0]] == tok.encode("circle") * 2


def _batch(dim: int, with_align: bool) -> VCRBatch:
    g = torch.Generator().manual_seed(0)
    B, T, R = 2, 7, 3
    x1y1 = torch.rand(B * 4, R, 2, generator=g) * 0.5
    mask = torch.ones(B * 4, R, dtype=torch.bool)
    mask[4:, 2] = False  # the second question has 2 objects
    align = torch.full((B * 4, R, 2), -1, dtype=torch.long)
    align[:, 0, 0] = 2
    return VCRBatch(
        inputs=VLInputs(
            input_ids=torch.randint(5, 50, (B * 4, T), generator=g), token_type_ids=torch.zeros(B * 4, T, dtype=torch.long),
            attention_mask=torch.ones(B * 4, T, dtype=torch.bool), region_feats=torch.randn(B * 4, R, dim, generator=g),
            region_boxes=torch.cat([x1y1, x1y1 + 0.4], -1), region_mask=mask,
            image_text_alignment=align if with_align else None),
        labels=torch.tensor([1, 3]), index=torch.tensor([0, 1]),
    )


@pytest.mark.parametrize("name", ARCH_MODELS)
def test_vcr_model_shapes_and_loss(name):
    torch.manual_seed(0)
    cfg = model_config(name, vocab_size=60)
    if name.startswith("wvisualbert"):
        cfg = model_config(name, vocab_size=60, use_tags=False)
    model = VCRModel(cfg).eval()
    batch = _batch(cfg.visual_dim, with_align=True)
    logits = model(batch)
    assert logits.shape == (2, 4) and torch.isfinite(logits).all()
    want = -torch.log_softmax(logits, -1)[torch.arange(2), batch.labels].mean()
    assert torch.allclose(vcr_loss(logits, batch.labels), want)
    # only VisualBERT reads the word-region alignment (§4.2); the others ignore it
    other = model(_batch(cfg.visual_dim, with_align=False))
    assert torch.allclose(other, logits) != (name == "visualbert-tiny")
    # With an object head, the whole encoder runs: the same choice scores, and 5 class logits per region
    # of every choice's sequence.
    torch.manual_seed(0)
    with_head = VCRModel(cfg, object_classes=5).eval()
    scores, objects = with_head.with_objects(batch)
    assert torch.allclose(scores, with_head(batch), atol=1e-5)
    assert objects.shape == (8, batch.inputs.region_feats.shape[1], 5)


@pytest.mark.parametrize("name", ARCH_MODELS)
def test_the_scorer_starts_as_each_release_starts_it(name):
    """VL-BERT's released VCR classifier (`1fc`) starts Xavier-uniform with a zero bias; the others BERT's
    normal(0, 0.02)."""
    torch.manual_seed(0)
    cfg = model_config(name, vocab_size=60, **({"use_tags": False} if name.startswith("wvisualbert") else {}))
    w = VCRModel(cfg).scorer.weight.detach()  # (1, width)
    bound = math.sqrt(6.0 / (w.shape[1] + 1))  # Xavier-uniform over fan_in = width, fan_out = 1
    if name.startswith("vlbert"):
        assert w.abs().max() <= bound and w.std() > 0.8 * bound / math.sqrt(3)  # U(-b, b) has std b / sqrt(3)
    else:
        assert w.std() < 1.5 * cfg.initializer_range
    assert not VCRModel(cfg).scorer.bias.any()


# --------------------------------------------------------------------------- fine-tuning


def vcr_cfg(world, init: Path, out: Path, **kw) -> FinetuneVCRConfig:
    base = dict(init=str(init), features=str(world.store), out=str(out), train_file=str(world.root / "vcr" / "train.jsonl"),
                eval_file=str(world.root / "vcr" / "val.jsonl"), epochs=1.0, batch_size=8, lr=1e-3, log_every=2,
                device="cpu", precision="fp32")
    base.update(kw)
    return FinetuneVCRConfig(**base)




def test_finetune_vcr_writes_metrics_predictions_and_reloads(tiny_world, tiny_pretrained, tmp_path, capsys):
    out = tmp_path / "qa"
    code, stdout, _ = run_cli(["finetune", "vcr", f"--init={tiny_pretrained}", f"--features={tiny_world.store}",
                               f"--train_file={tiny_world.root / 'vcr' / 'train.jsonl'}",
                               f"--eval_file={tiny_world.root / 'vcr' / 'val.jsonl'}", f"--out={out}", "--mode=qa",
                               "--epochs=1", "--batch_size=8", "--device=cpu"], capsys)
    assert code == 0 and "VCR Q->A accuracy" in stdout and "(chance 25%)" in stdout
    m = json.loads((out / "metrics.json").read_text())
    val = read_vcr(tiny_world.root / "vcr" / "val.jsonl")
    assert m["mode"] == "qa" and m["chance"] == 25.0 and m["eval_questions"] == len(val) and m["alignment"] is True
    assert m["skipped_records"]["total"] == 0 and 0.0 <= m["q2a"] <= 100.0
    preds = json.loads((out / "predictions.json").read_text())
    assert set(preds) == {ex.annot_id for ex in val}
    assert all(len(p) == 4 and abs(sum(p) - 1) < 1e-5 for p in preds.values())
    right = sum(int(np.argmax(preds[ex.annot_id])) == ex.answer_label for ex in val)
    assert m["q2a"] == pytest.approx(100.0 * right / len(val))
    model, meta, tok = load_vcr_model(out / "model")
    assert meta["mode"] == "qa" and meta["object_regions"] == "iou" and model.arch == "visualbert"
    # QA->R: the rationale model; `evaluate vcr` combines both predictions files
    finetune_vcr(vcr_cfg(tiny_world, tiny_pretrained, tmp_path / "qar", mode="qar", epochs=0.3))
    mr = json.loads((tmp_path / "qar" / "metrics.json").read_text())
    assert "qa2r" in mr and mr["chance"] == 25.0
    code, stdout, _ = run_cli(["evaluate", "vcr", f"--annotations={tiny_world.root / 'vcr' / 'val.jsonl'}",
                               f"--qa={out / 'predictions.json'}", f"--qar={tmp_path / 'qar' / 'predictions.json'}"], capsys)
    scores = json.loads(stdout)
    assert code == 0 and scores["q2a"] == pytest.approx(m["q2a"]) and scores["qa2r"] == pytest.approx(mr["qa2r"])


def test_sigmoid_choice_loss_by_hand():
    """`--choice_loss=sigmoid` (VL-BERT's CLASSIFIER_SIGMOID): logits [0, ln 3, 0, 0], right choice 1: the
    binary targets [0, 1, 0, 0] give -(3 ln(1/2) + ln(3/4)) / 4 = (3 ln 2 + ln 4 - ln 3) / 4 = 0.59775."""
    import math

    logits, labels = torch.tensor([[0.0, math.log(3.0), 0.0, 0.0]]), torch.tensor([1])
    assert vcr_loss(logits, labels, "sigmoid").item() == pytest.approx((3 * math.log(2) + math.log(4) - math.log(3)) / 4)
    assert vcr_loss(logits, labels).item() == pytest.approx(-math.log(3 / 6))  # softmax: 3 / (1 + 3 + 1 + 1)


def test_object_loss_by_hand():
    """VL-BERT §4.2.1's object classification: each region's class cross-entropy over the 4 choices'
    sequences, averaged within a question, then over questions. Question 0: two objects of classes 0 and 2,
    uniform logits over 3 classes except choice 0's first region ([ln 2, 0, 0]: -ln(2/4)); question 1: one
    object. So question 0 averages 7 x ln 3 and 1 x ln 2 over 8; question 1 is ln 3."""
    from vlberts.models.vcr import vcr_object_loss

    logits = torch.zeros(8, 2, 3)  # (B*4, R, C)
    logits[0, 0, 0] = math.log(2.0)
    labels = torch.tensor([[0, 2], [1, -100]])  # (B, R)
    q0 = (7 * math.log(3) + math.log(2)) / 8
    assert vcr_object_loss(logits, labels).item() == pytest.approx((q0 + math.log(3)) / 2)


@pytest.mark.parametrize("choice_loss", ["softmax", "sigmoid"])
def test_vcr_fits_a_handful_of_questions(choice_loss, tiny_world, tiny_pretrained, tmp_path):
    """Through the whole recipe (loop, collate, alignment, scorer), VisualBERT fits 8 training questions: the
    loss falls and it picks their right answers, with either choice loss. (Generalising needs grounding colour
    words in regions, which the tiny 4-update checkpoint cannot do cheaply; see README for the cmp5 numbers.)"""
    few = tmp_path / "vcr" / "train.jsonl"
    few.parent.mkdir()
    few.write_text("".join((tiny_world.root / "vcr" / "train.jsonl").read_text().splitlines(True)[:8]))
    (tmp_path / "vcr" / "metadata").symlink_to(tiny_world.root / "vcr" / "metadata")
    out = tmp_path / "fit"
    finetune_vcr(vcr_cfg(tiny_world, tiny_pretrained, out, train_file=str(few), eval_file=str(few), epochs=40,
                         lr=3e-3, head_lr_mult=10, batch_size=8, warmup=0.0, log_every=1, choice_loss=choice_loss))
    m = json.loads((out / "metrics.json").read_text())
    losses = [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    # Sigmoid's loss stops near the prior's (binary entropy of 1/4: 0.56) once the right choice scores highest.
    assert max(losses[-5:]) < (0.5 if choice_loss == "softmax" else 0.9) * losses[0], losses
    assert m["q2a"] >= 75.0 and m["choice_loss"] == choice_loss, m
    # At the start every score is near 0: softmax's loss is ~ln 4, sigmoid's ~ln 2.
    assert losses[0] == pytest.approx(math.log(4) if choice_loss == "softmax" else math.log(2), rel=0.3)
    if choice_loss == "sigmoid":
        with pytest.raises(VlbertsError, match="unknown --choice_loss 'hinge'; valid: softmax, sigmoid"):
            finetune_vcr(vcr_cfg(tiny_world, tiny_pretrained, tmp_path / "bad", choice_loss="hinge"))


def test_finetune_vcr_resume_equals_uninterrupted_wvisualbert_tags(tiny_world, tiny_pretrained, tmp_path):
    init = random_init_dir("wvisualbert-tiny", tiny_pretrained, tmp_path / "init")
    kw = dict(epochs=0.3, mode="qar")
    finetune_vcr(vcr_cfg(tiny_world, init, tmp_path / "ref", **kw))
    assert finetune_vcr(vcr_cfg(tiny_world, init, tmp_path / "run", stop_after=2, ckpt_every=2, **kw)) is None
    assert not (tmp_path / "run" / "metrics.json").exists()
    finetune_vcr(vcr_cfg(tiny_world, init, tmp_path / "run", ckpt_every=2, **kw))
    a, b = (load_file(str(tmp_path / d / "model" / "model.safetensors")) for d in ("ref", "run"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "ref" / "predictions.json").read_text() == (tmp_path / "run" / "predictions.json").read_text()


def test_gold_object_regions_read_the_store_rows_in_object_order(tiny_world, tiny_pretrained, tmp_path):
    """--object_regions=gold reads region k as object k; iou maps each metadata box to its best store region."""
    store = RegionStore(tiny_world.store)
    val = read_vcr(tiny_world.root / "vcr" / "val.jsonl")
    tok = TextTokenizer.load(tiny_pretrained)
    data = VCRData(val, "qa", store, tok, metadata_dir=tiny_world.root / "vcr" / "metadata")
    ex = val[0]
    regions, rows = data.object_regions_of(ex)
    rec = store.get(ex.img_id)
    meta = read_vcr_metadata(tiny_world.root / "vcr" / "metadata" / ex.metadata_fn)
    for k, box in enumerate(meta.boxes):  # each object's region is the stored region overlapping it most
        ious = [_iou(box, b) for b in rec.boxes]
        assert rows[k] == int(np.argmax(ious)) and np.allclose(regions.pixel_boxes[k], rec.boxes[rows[k]])
    batch = collate_vcr([data[0], data[1]], tok.pad_id)
    assert batch.inputs.input_ids.shape[0] == 8 and batch.inputs.region_feats.shape[1] == max(
        len(val[0].objects), len(val[1].objects))
    # a detector store does not have one region per object: gold is refused, naming the image
    with pytest.raises(VlbertsError, match="one stored region per object"):
        finetune_vcr(vcr_cfg(tiny_world, tiny_pretrained, tmp_path / "gold", object_regions="gold"))


def test_a_mirrored_question_flips_its_objects_boxes_and_every_choices_left_and_right(tiny_world, tiny_pretrained):
    """--flip_prob (VL-BERT's FLIP_PROB): a training item keyed (epoch, index) shows its objects' boxes flipped
    left-right and "left" / "right" swapped in all four sequences; label, segments and alignment stay; an
    index alone (prediction) never flips."""
    store = RegionStore(tiny_world.store)
    val = read_vcr(tiny_world.root / "vcr" / "val.jsonl")
    tok = TextTokenizer.load(tiny_pretrained)
    left, right = tok.tok.token_to_id("left"), tok.tok.token_to_id("right")
    data = VCRData(val, "qar", store, tok, metadata_dir=tiny_world.root / "vcr" / "metadata", flip_prob=1.0, seed=3)
    i = next(k for k, cs in enumerate(data.choices) if any({left, right} & set(ids) for ids, _, _ in cs))
    plain, flipped = data[i], data[(0, i)]
    swap = {left: right, right: left}
    assert flipped["label"] == plain["label"] and flipped["index"] == plain["index"] == i
    for (ids, seg, align), (fids, fseg, falign) in zip(plain["choices"], flipped["choices"]):
        assert fids == [swap.get(t, t) for t in ids] and fseg == seg and falign == align
    assert flipped["choices"] != plain["choices"]
    b, f = plain["regions"], flipped["regions"]
    assert np.allclose(f.boxes[:, [0, 2]], 1 - b.boxes[:, [2, 0]], atol=1e-6)
    assert np.array_equal(f.boxes[:, [1, 3]], b.boxes[:, [1, 3]]) and np.array_equal(f.feats, b.feats)
    width = store.get(val[i].img_id).image_w
    assert np.allclose(f.pixel_boxes[:, 0], width - b.pixel_boxes[:, 2])
    assert data[(0, i)]["choices"] == flipped["choices"] and data[i]["choices"] == plain["choices"]
    unflipped = VCRData(val, "qar", store, tok, metadata_dir=tiny_world.root / "vcr" / "metadata", seed=3)
    assert unflipped[(0, i)]["choices"] == plain["choices"]
    half = VCRData(val, "qar", store, tok, metadata_dir=tiny_world.root / "vcr" / "metadata", flip_prob=0.5, seed=3)
    assert 0.4 < np.mean([half[(e, i)]["choices"] != plain["choices"] for e in range(300)]) < 0.6


def test_finetune_vcr_with_mirrored_questions(tiny_world, tiny_pretrained, tmp_path):
    """--flip_prob reaches the training items: all mirrored trains on other inputs than none, from the same
    start; a bad value stops the run before any file is read."""
    first = {}
    for p in (0.0, 1.0):
        out = tmp_path / f"flip{p}"
        finetune_vcr(vcr_cfg(tiny_world, tiny_pretrained, out, mode="qar", epochs=0.1, eval_file="", flip_prob=p))
        log = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        first[p] = next(r["loss"] for r in log if "loss" in r)
    assert first[0.0] != first[1.0]
    cfg = vcr_cfg(tiny_world, tiny_pretrained, tmp_path / "bad", flip_prob=1.5, train_file=str(tmp_path / "missing.jsonl"))
    with pytest.raises(VlbertsError, match=r"FinetuneVCRConfig.flip_prob: must be at most 1, got 1.5$"):
        finetune_vcr(cfg)  # checked as the command line checks it (`start_recipe`), before any file is read


def _iou(a, b) -> float:
    ix = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    iy = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = ix * iy
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def test_bad_records_are_errors_or_counted_with_skip_bad(tiny_world, tiny_pretrained, tmp_path, capsys):
    lines = (tiny_world.root / "vcr" / "train.jsonl").read_text().splitlines()
    bad_ref = json.loads(lines[1])
    bad_ref["question"] = ["What", "colour", "is", [9], "?"]  # object 9 does not exist
    no_image = json.loads(lines[2])
    no_image["img_id"] = "99999"
    broken = tmp_path / "vcr" / "train.jsonl"
    broken.parent.mkdir()
    broken.write_text("\n".join([lines[0], json.dumps(bad_ref), json.dumps(no_image), "{not json", *lines[3:]]) + "\n")
    (tmp_path / "vcr" / "metadata").symlink_to(tiny_world.root / "vcr" / "metadata")
    args = ["finetune", "vcr", f"--init={tiny_pretrained}", f"--features={tiny_world.store}", f"--train_file={broken}",
            f"--out={tmp_path / 'run'}", "--epochs=0.1", "--device=cpu"]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and "line 2" in err and "refers to object 9" in err and str(broken) in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = run_cli([*args, "--skip_bad=true"], capsys)
    assert code == 0 and "skipped 3 bad records" in err, err
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["skipped_records"]["total"] == 3 and m["skipped_records"]["missing features"] == 1
    assert m["skipped_records"]["malformed record"] == 2 and m["train_questions"] == len(lines) - 2
    code, _, err = run_cli([*args[:-2], f"--out={tmp_path / 'run2'}", "--mode=qq"], capsys)
    assert code == 2 and "unknown --mode 'qq'" in err


@pytest.mark.parametrize("metadata_fn, message", [
    ("nope.json", "metadata_fn nope.json: {meta}/nope.json not found"),
    ("", "no metadata_fn: --object_regions=iou reads the objects' boxes from it"),
])
def test_missing_metadata_file_names_the_record_pointing_at_it(metadata_fn, message, tiny_world, tiny_pretrained,
                                                               tmp_path, capsys):
    """A record whose metadata_fn is not a file: the error names the jsonl file and the record (the metadata
    folder is intact; the record is what is wrong), and --skip_bad counts it as bad metadata."""
    lines = (tiny_world.root / "vcr" / "train.jsonl").read_text().splitlines()
    rec = json.loads(lines[3])
    rec["metadata_fn"] = metadata_fn
    broken = tmp_path / "train.jsonl"
    broken.write_text("\n".join([*lines[:3], json.dumps(rec), *lines[4:]]) + "\n")
    meta = tiny_world.root / "vcr" / "metadata"
    code, _, err = run_cli(["finetune", "vcr", f"--init={tiny_pretrained}", f"--features={tiny_world.store}",
                            f"--train_file={broken}", f"--metadata_dir={meta}", f"--out={tmp_path / 'run'}",
                            "--epochs=0.1", "--device=cpu"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.strip() == f"error: {broken}: record {rec['annot_id']}: {message.format(meta=meta)}"
    bad = BadRecords(skip=True)
    kept = usable_examples(read_vcr(broken), str(broken), RegionStore(tiny_world.store), str(tiny_world.store),
                           "iou", meta, bad)
    assert len(kept) == len(lines) - 1 and rec["annot_id"] not in {ex.annot_id for ex in kept}
    assert bad.counts == {"bad metadata": 1} and bad.first == err.strip().removeprefix("error: ")


# --------------------------------------------------------------------------- evaluate vcr


def _fixture(tmp_path: Path) -> Path:
    """Three labelled questions (answer labels 0, 1, 2; rationale labels 3, 2, 1)."""
    rec = {"objects": ["person", "dog"], "question": ["Why", "is", [0], "here", "?"],
           "answer_choices": [["a"], ["b"], ["c"], ["d"]], "rationale_choices": [["e"], ["f"], ["g"], ["h"]],
           "img_fn": "x.jpg", "metadata_fn": "x.json", "img_id": "1"}
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps({**rec, "annot_id": f"val-{k}", "answer_label": a, "rationale_label": r}) + "\n"
                            for k, (a, r) in enumerate([(0, 3), (1, 2), (2, 1)])))
    return path


def test_evaluate_vcr_hand_made_fixture(tmp_path, capsys):
    ann = _fixture(tmp_path)
    # Q->A: val-0 right, val-1 right, val-2 wrong (a tie 0.3/0.3 goes to the lower index 1, label 2) -> 2/3
    qa = {"val-0": [0.7, 0.1, 0.1, 0.1], "val-1": [0.1, 0.6, 0.2, 0.1], "val-2": [0.3, 0.3, 0.2, 0.2]}
    # QA->R: val-0 right, val-1 wrong, val-2 right -> 2/3; both right only for val-0 -> Q->AR 1/3
    qar = {"val-0": [0.1, 0.1, 0.1, 0.7], "val-1": [0.9, 0.0, 0.1, 0.0], "val-2": [0.0, 0.8, 0.1, 0.1]}
    (tmp_path / "qa.json").write_text(json.dumps(qa))
    (tmp_path / "qar.json").write_text(json.dumps(qar))
    code, out, _ = run_cli(["evaluate", "vcr", f"--annotations={ann}", f"--qa={tmp_path / 'qa.json'}",
                            f"--qar={tmp_path / 'qar.json'}"], capsys)
    got = json.loads(out)
    assert code == 0 and got["num_questions"] == 3
    assert got["q2a"] == pytest.approx(200 / 3) and got["qa2r"] == pytest.approx(200 / 3)
    assert got["q2ar"] == pytest.approx(100 / 3) and got["chance"] == {"q2a": 25.0, "qa2r": 25.0, "q2ar": 6.25}
    assert evaluate_vcr(ann, tmp_path / "qa.json", tmp_path / "qar.json") == got
    # a missing prediction and a malformed one are one-line errors naming the file
    (tmp_path / "short.json").write_text(json.dumps({"val-0": qa["val-0"]}))
    code, _, err = run_cli(["evaluate", "vcr", f"--annotations={ann}", f"--qa={tmp_path / 'short.json'}",
                            f"--qar={tmp_path / 'qar.json'}"], capsys)
    assert code == 2 and "no prediction for 2 of 3 questions" in err and "short.json" in err
    (tmp_path / "bad.json").write_text(json.dumps({**qa, "val-1": [0.5, 0.5]}))
    code, _, err = run_cli(["evaluate", "vcr", f"--annotations={ann}", f"--qa={tmp_path / 'qa.json'}",
                            f"--qar={tmp_path / 'bad.json'}"], capsys)
    assert code == 2 and "expected 4 finite numbers" in err and "val-1" in err
    (tmp_path / "nan.json").write_text(json.dumps({**qa, "val-2": [float("nan"), 0.5, 0.2, 0.3]}))  # JSON's NaN
    code, _, err = run_cli(["evaluate", "vcr", f"--annotations={ann}", f"--qa={tmp_path / 'nan.json'}",
                            f"--qar={tmp_path / 'qar.json'}"], capsys)
    assert code == 2 and "expected 4 finite numbers" in err and "val-2" in err
    # The two files swapped (each beside its run's metrics.json, as finetune writes them), or one file twice: the
    # scores cannot tell, the runs' records can
    for mode, preds in (("qa", qa), ("qar", qar)):
        (tmp_path / mode).mkdir()
        (tmp_path / mode / "predictions.json").write_text(json.dumps(preds))
        (tmp_path / mode / "metrics.json").write_text(json.dumps({"mode": mode}))
    assert evaluate_vcr(ann, tmp_path / "qa" / "predictions.json", tmp_path / "qar" / "predictions.json") == got
    code, _, err = run_cli(["evaluate", "vcr", f"--annotations={ann}", f"--qa={tmp_path / 'qar' / 'predictions.json'}",
                            f"--qar={tmp_path / 'qa' / 'predictions.json'}"], capsys)
    assert code == 2 and err.startswith(f"error: {tmp_path / 'qar' / 'predictions.json'}: this file comes from a "
                                        "--mode=qar run") and "(--qa and --qar swapped?)" in err
    code, _, err = run_cli(["evaluate", "vcr", f"--annotations={ann}", f"--qa={tmp_path / 'qa.json'}",
                            f"--qar={tmp_path / 'qa.json'}"], capsys)
    assert code == 2 and "--qa and --qar name the same file" in err


def test_object_classification_loss_trains_reloads_and_starts_from_vlberts_roi_head(tiny_world, tiny_pretrained,
                                                                                    tmp_path):
    """`--object_loss=1` (VL-BERT §4.2.1): the classes are the training objects' names; the head's dense
    layer starts from a VL-BERT pre-training model's RoI-classification transform; the first logged loss is
    the choices' ~ln 4 plus the objects' ~ln C; the model directory reloads with its head and predicts as the
    run did. From VisualBERT's pre-training (no RoI head) the head starts fresh."""
    from vlberts.models.weights import read_state_dict

    init = random_init_dir("vlbert-tiny", tiny_pretrained, tmp_path / "init")
    out = tmp_path / "obj"
    finetune_vcr(vcr_cfg(tiny_world, init, out, epochs=0.3, object_loss=1.0, log_every=1, warmup=0.0,
                         alignment="true"))  # and the words naming objects take their regions' visual features
    m = json.loads((out / "metrics.json").read_text())
    assert m["alignment"] is True
    names = sorted({name for ex in read_vcr(tiny_world.root / "vcr" / "train.jsonl") for name in ex.objects})
    assert m["object_classes"] == len(names) >= 3 and m["object_head_from_pretraining"] is True
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first == pytest.approx(math.log(4) + math.log(len(names)), rel=0.25)
    model, meta, tok = load_vcr_model(out / "model")
    assert meta["object_classes"] == names and model.object_head is not None and model.uses_alignment
    trained = load_file(str(out / "model" / "model.safetensors"))
    start = read_state_dict(init / "model.safetensors")["region_head.dense.weight"]
    assert trained["object_head.decoder.weight"].shape[0] == len(names)
    assert not torch.equal(trained["object_head.dense.weight"], start)  # trained from there
    store = RegionStore(tiny_world.store)
    val = read_vcr(tiny_world.root / "vcr" / "val.jsonl")
    data = vcr_data(model, val, "qa", store, tok, max_text_len=80, object_regions="iou",
                    metadata_dir=tiny_world.root / "vcr" / "metadata")
    preds = predict_vcr(model, data)
    saved = json.loads((out / "predictions.json").read_text())
    assert all(np.allclose(preds[k], saved[k], atol=1e-5) for k in saved)
    # At the start (no update), the dense layer is the RoI head's, exactly; VisualBERT's has none to give.
    model0, _, started = pretrained_vcr_model(init, len(names))
    assert started and torch.equal(model0.object_head.dense.weight, start)
    assert not pretrained_vcr_model(tiny_pretrained, len(names))[2]
    assert not start_object_head(pretrained_vcr_model(init)[0], read_state_dict(init / "model.safetensors"))  # no head


def test_vlbert_words_naming_an_object_take_its_regions_visual_feature():
    """`--alignment=true` for VL-BERT (its released VCR code): the word positions aligned to region k read
    visual element k + 1 (0 is the whole image); the other words keep the whole image's, so only the aligned
    rows of the embeddings change. auto: on for VisualBERT, off for VL-BERT; true for LXMERT is an error."""
    from vlberts.models.vcr import uses_alignment
    from vlberts.models.vlbert import VLBertModel, text_visual_index

    align = torch.tensor([[[1, 3], [-1, -1]], [[-1, -1], [2, -1]]])  # (B=2, R=2, K=2)
    assert text_visual_index(align, 5).tolist() == [[0, 1, 0, 1, 0], [0, 0, 2, 0, 0]]
    torch.manual_seed(0)
    cfg = model_config("vlbert-tiny", vocab_size=60, hidden_dropout=0.0)
    enc = VLBertModel(cfg).eval()
    x = _batch(cfg.visual_dim, with_align=True).inputs
    plain = type(x)(**{**x.__dict__, "image_text_alignment": None})
    with torch.no_grad():
        a = enc.embeddings(x, x.region_feats, torch.zeros(x.region_mask.shape, dtype=torch.bool))[0]
        b = enc.embeddings(plain, x.region_feats, torch.zeros(x.region_mask.shape, dtype=torch.bool))[0]
    T = x.input_ids.shape[1]
    aligned = text_visual_index(x.image_text_alignment, T) > 0  # (B*4, T)
    assert aligned.any() and (~aligned).any()
    diff = (a[:, :T] - b[:, :T]).abs().amax(-1)  # (B*4, T)
    assert (diff[aligned] > 1e-4).all() and (diff[~aligned] == 0).all()
    assert torch.equal(a[:, T:], b[:, T:])  # the visual elements and [END] as before
    assert uses_alignment("auto", "visualbert") and not uses_alignment("auto", "vlbert")
    assert uses_alignment("true", "vlbert") and not uses_alignment("false", "visualbert")
    with pytest.raises(VlbertsError, match="lxmert reads no word-region alignment"):
        uses_alignment("true", "lxmert")
