"""RefCOCO+ end to end on the tiny world: the world's refs/instances read back through the real-format
reader (pickle through the restricted unpickler, and JSON), appearance-only unique expressions; the region
scorer of every architecture (shapes, padding masked out of argmax and loss); `finetune refcoco` writing
metrics (accuracy, upper bound, highest-confidence baseline) and predictions that `evaluate refcoco`
scores the same; exact resume; the ground-truth-region track on a `--boxes gold` store; bad input."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
from conftest import random_init_dir
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from vlberts.cli import main
from vlberts.data.batch import VLInputs
from vlberts.data.refcoco import read_refcoco, read_refs
from vlberts.errors import BadRecords, VlbertsError
from vlberts.features.store import RegionStore
from vlberts.models.builders import model_config
from vlberts.models.refcoco import LinearRegionScorer, RefCocoModel, VLBertRegionScorer, region_bce_loss
from vlberts.models.vlbert import start_from_roi_transform
from vlberts.recipes.extract import ExtractConfig, companion_paths, extract
from vlberts.data.refcoco_dataset import DetectedThenGold
from vlberts.recipes.finetune_refcoco import (
    FinetuneRefCocoConfig,
    finetune_refcoco,
    load_refcoco_model,
    predict_refcoco,
    ref_data,
)
from vlberts.text.tokenizer import TextTokenizer
from vlberts.recipes.pretrain import PretrainConfig, pretrain
from vlberts.world import refcoco as world_refcoco
from vlberts.world.build import make_image
from vlberts.world.vocab import COLOURS, SHAPES, SIZES

ARCH_MODELS = ["visualbert-tiny", "lxmert-tiny", "vilbert-tiny", "vlbert-tiny", "wvisualbert-tiny"]
MAX_REGIONS = 12


def refs_files(world) -> tuple[Path, Path, Path]:
    folder = world.root / "refcoco+"
    return folder / "refs(unc).p", folder / "refs.json", folder / "instances.json"


def ref_cfg(world, init: Path, out: Path, **kw) -> FinetuneRefCocoConfig:
    refs_p, _, inst = refs_files(world)
    base = dict(init=str(init), out=str(out), features=str(world.store), refs=str(refs_p), instances=str(inst),
                epochs=2, batch_size=16, lr=1e-3, log_every=1, ckpt_every=2, max_regions=MAX_REGIONS, device="cpu",
                eval_splits="val,testA,testB")
    base.update(kw)
    return FinetuneRefCocoConfig(**base)


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


# --------------------------------------------------------------------------- the world's files


def test_world_refs_read_back_unique_appearance_only(tiny_world):
    refs_p, refs_json, inst = refs_files(tiny_world)
    assert refs_p.read_bytes()[:2] == b"\x80\x02"  # protocol 2, as released
    assert read_refs(refs_p) == read_refs(refs_json)  # the restricted unpickler and the JSON form agree
    assert pickle.loads(refs_p.read_bytes()) == json.loads(refs_json.read_text())
    data = read_refcoco(refs_p, inst)
    scenes = {}
    for line in (tiny_world.root / "scenes.jsonl").read_text().splitlines():
        rec = json.loads(line)
        scenes[rec["image_id"]] = rec
    assert data.refs and {r.split for r in data.refs} == {"train", "val", "testA", "testB"}
    words = {"colour": set(COLOURS), "size": set(SIZES), "shape": set(SHAPES)}
    for ref in data.refs:
        scene = scenes[ref.image_id]
        objects = {o["object_id"]: o for o in scene["objects"]}
        obj = objects[ref.ann_id % 100]
        assert ref.ann_id // 100 == ref.image_id and SHAPES[ref.category_id - 1] == obj["shape"]
        # split: the image's; test refs go to testA (circle, square, triangle) or testB (the other shapes)
        want = scene["split"] if scene["split"] != "test" else (
            "testA" if obj["shape"] in world_refcoco.TEST_A_SHAPES else "testB")
        assert ref.split == want
        # RefCOCO+: the referred object shares its category with another object of the image
        assert sum(o["shape"] == obj["shape"] for o in objects.values()) >= 2
        assert 2 <= len(ref.sentences) <= 3 and len({s.sent for s in ref.sentences}) == len(ref.sentences)
        for s in ref.sentences:
            assert s.sent == s.raw.lower() and list(s.tokens) == s.sent.split()
            assert not set(s.tokens) & world_refcoco.LOCATION_WORDS, s.sent
            said = {a: next(w for w in s.tokens if w in ws) for a, ws in words.items() if set(s.tokens) & ws}
            assert said and all(obj[a] == v for a, v in said.items()), s.sent  # true of the referent...
            others = [o for o in objects.values() if o is not obj and all(o[a] == v for a, v in said.items())]
            assert not others, s.sent  # ...and of no other object: the expression is unique
        # the gold box is the object's box, in COCO [x, y, w, h]
        x1, y1, x2, y2 = obj["box"]
        assert data.annotations[ref.ann_id].bbox == (x1, y1, x2 - x1, y2 - y1)
    # instances: every object of every image with a ref, categories 1..7 = the shapes
    assert data.categories == {i + 1: s for i, s in enumerate(SHAPES)}
    for image_id in {r.image_id for r in data.refs}:
        assert len(data.image_annotations(image_id)) == len(scenes[image_id]["objects"])
    world = json.loads((tiny_world.root / "world.json").read_text())
    assert world["counts"]["refcoco_refs"] == len(data.refs)
    assert world["counts"]["refcoco_expressions"] == sum(len(r.sentences) for r in data.refs)


def test_refcoco_stream_is_its_own(monkeypatch):
    before = [make_image(k, 3, render=False) for k in range(1, 6)]
    monkeypatch.setattr(world_refcoco, "REFCOCO_STREAM", world_refcoco.REFCOCO_STREAM + 1)
    after = [make_image(k, 3, render=False) for k in range(1, 6)]
    for a, b in zip(before, after):  # every other stream (scene, captions, questions, GQA) untouched
        assert (a.scene, a.captions, a.questions, a.gqa_questions) == (b.scene, b.captions, b.questions, b.gqa_questions)
    assert [a.refcoco_refs for a in before] != [b.refcoco_refs for b in after]
    monkeypatch.undo()  # and the stream is deterministic
    assert [a.refcoco_refs for a in before] == [make_image(k, 3, render=False).refcoco_refs for k in range(1, 6)]


# --------------------------------------------------------------------------- the region scorer


def _inputs(dim: int) -> VLInputs:
    g = torch.Generator().manual_seed(0)
    B, T, R = 2, 5, 4
    x1y1 = torch.rand(B, R, 2, generator=g) * 0.5
    mask = torch.ones(B, R, dtype=torch.bool)
    mask[1, 2:] = False  # the second example has 2 real regions
    return VLInputs(
        input_ids=torch.randint(5, 50, (B, T), generator=g), token_type_ids=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T, dtype=torch.bool), region_feats=torch.randn(B, R, dim, generator=g),
        region_boxes=torch.cat([x1y1, x1y1 + 0.4], -1), region_mask=mask,
    )


@pytest.mark.parametrize("name", ARCH_MODELS)
def test_region_scorer_shapes_and_padding(name):
    torch.manual_seed(0)
    cfg = model_config(name, vocab_size=60)
    model = RefCocoModel(cfg).eval()
    assert isinstance(model.scorer, VLBertRegionScorer if name.startswith("vlbert") else LinearRegionScorer)
    x = _inputs(cfg.visual_dim)
    logits = model(x)
    assert logits.shape == (2, 4)
    low = torch.finfo(logits.dtype).min
    assert (logits[1, 2:] == low).all() and (logits[~x.region_mask] == low).all() and (logits[x.region_mask] > low).all()
    assert logits[1].argmax() < 2  # padding never wins
    # padding regions do not reach the real ones: other padded features, the same real scores
    x2 = VLInputs(**{**vars(x), "region_feats": x.region_feats.clone()})
    x2.region_feats[1, 2:] = 100.0
    assert torch.allclose(model(x2)[x.region_mask], logits[x.region_mask], atol=1e-5)
    # the loss is the BCE over the real regions only: padded targets do not matter
    targets = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    loss = region_bce_loss(logits, targets, x.region_mask)
    real = logits[x.region_mask]
    want = F.binary_cross_entropy_with_logits(real, torch.tensor([1.0, 0, 0, 0, 0, 1.0]))
    assert torch.allclose(loss, want)
    targets[1, 2:] = 0.0
    assert torch.equal(region_bce_loss(logits, targets, x.region_mask), loss)


def test_vlbert_scorer_is_the_releases_final_mlp_started_from_the_roi_head(tiny_world, tmp_path):
    """VL-BERT's RefCOCO+ scorer is the release's `final_mlp`: dense, GELU (no LayerNorm), dropout, linear, both
    linear layers Xavier-uniform with zero biases; `finetune refcoco` starts the dense layer from the
    pre-training model's RoI-classification transform (`region_head.dense`) and says so in metrics.json."""
    torch.manual_seed(0)
    cfg = model_config("vlbert-tiny", vocab_size=60)
    scorer = RefCocoModel(cfg).eval().scorer
    assert [type(m).__name__ for m in scorer.children()] == ["Linear", "Dropout", "Linear"]  # no LayerNorm
    for layer in (scorer.dense, scorer.linear):
        fan_in, fan_out = layer.weight.shape[1], layer.weight.shape[0]
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        assert layer.weight.abs().max() <= bound and layer.weight.std() > 0.8 * bound / math.sqrt(3)
        assert not layer.bias.any()
    v = torch.randn(2, 3, cfg.hidden_size)
    want = (F.gelu(v @ scorer.dense.weight.T + scorer.dense.bias) @ scorer.linear.weight.T + scorer.linear.bias)[..., 0]
    assert torch.allclose(scorer(v), want, atol=1e-6)
    # the recipe: the transform from a VL-BERT pre-training run's RoI head
    init = pretrain(PretrainConfig(captions=str(tiny_world.captions_train), features=str(tiny_world.store),
                                   out=str(tmp_path / "pt"), model="vlbert-tiny", vocab_size=200, steps=2, batch_size=8))
    sd = load_file(str(init / "model.safetensors"))
    model = RefCocoModel(cfg)
    assert start_from_roi_transform(model.scorer.dense, sd)
    assert torch.equal(model.scorer.dense.weight, sd["region_head.dense.weight"])
    assert torch.equal(model.scorer.dense.bias, sd["region_head.dense.bias"])
    out = tmp_path / "ref"
    finetune_refcoco(ref_cfg(tiny_world, init, out, epochs=0.2, eval_splits="val"))
    assert json.loads((out / "metrics.json").read_text())["scorer_from_pretraining"] is True
    assert not start_from_roi_transform(model.scorer.dense, {})  # nothing to give: the Xavier start stays


# --------------------------------------------------------------------------- fine-tuning




def test_finetune_refcoco_metrics_predictions_evaluate_reload(tiny_world, tiny_pretrained, tmp_path, capsys):
    out = tmp_path / "ref"
    refs_p, _, inst = refs_files(tiny_world)
    cfg = ref_cfg(tiny_world, tiny_pretrained, out, epochs=20, lr=3e-3, log_every=5,
                  eval_splits="train,val,testA,testB")
    args = [f"--{k}={v}" for k, v in vars(cfg).items() if k in (
        "init", "out", "features", "refs", "instances", "epochs", "batch_size", "lr", "max_regions", "device",
        "eval_splits", "log_every")]
    code, stdout, _ = run_cli(["finetune", "refcoco", *args], capsys)
    assert code == 0 and "RefCOCO+ val accuracy" in stdout and "highest-confidence baseline" in stdout

    metrics = json.loads((out / "metrics.json").read_text())
    data = read_refcoco(refs_p, inst)
    assert metrics["track"] == "detected" and metrics["head"] == "linear"
    assert metrics["train_expressions"] == len(data.expressions("train")) and metrics["skipped_records"]["total"] == 0
    for split in ("val", "testA", "testB"):
        m = metrics["splits"][split]
        assert m["num_expressions"] == len(data.expressions(split))
        assert 0 <= m["accuracy"] <= m["upper_bound"] <= 100 and 0 <= m["confidence_baseline"] <= m["upper_bound"]
    assert metrics["accuracy"] == metrics["splits"]["train"]["accuracy"]
    # it learns: the training loss falls, and the model beats the expression-blind highest-confidence
    # region, by a wide margin on the expressions it trained on (measured: train 28.3 vs 5.5, val 21.9 vs 9.4)
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(losses[-3:]) / 3 < 0.6 * sum(losses[:3]) / 3
    train, val = metrics["splits"]["train"], metrics["splits"]["val"]
    assert train["accuracy"] > train["confidence_baseline"] + 15 and val["accuracy"] > val["confidence_baseline"]

    preds = json.loads((out / "predictions.json").read_text())
    assert len(preds) == sum(m["num_expressions"] for m in metrics["splits"].values())
    assert set(preds[0]) == {"sent_id", "ref_id", "image_id", "split", "box", "score"} and 0 < preds[0]["score"] < 1
    meta = json.loads((out / "model" / "config.json").read_text())
    assert meta["task"] == "refcoco" and meta["track"] == "detected" and meta["arch"] == "visualbert"

    # `vlberts evaluate refcoco` scores the predictions file as the recipe did
    code, stdout, _ = run_cli(["evaluate", "refcoco", "--predictions", str(out / "predictions.json"), "--refs",
                               str(refs_p), "--instances", str(inst), "--out", str(tmp_path / "eval")], capsys)
    assert code == 0 and "RefCOCO+ val accuracy" in stdout
    scored = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    for split in ("train", "val", "testA", "testB"):
        assert scored["splits"][split]["num_correct"] == metrics["splits"][split]["num_correct"]

    # the model directory reloads and scores the same regions
    model, tok = load_refcoco_model(out / "model")
    val = data.expressions("val")
    scores = predict_refcoco(model, tok, val, RegionStore(tiny_world.store), max_regions=MAX_REGIONS)
    val_rows = [p for p in preds if p["split"] == "val"]
    for i, row in enumerate(val_rows):
        box = RegionStore(tiny_world.store).get(str(val[i].image_id)).boxes[int(torch.tensor(scores[i]).argmax())]
        assert row["sent_id"] == val[i].sent_id and row["box"][:2] == pytest.approx(box[:2].tolist())


def test_finetune_refcoco_resume_equals_uninterrupted_wvisualbert_tags(tiny_world, tiny_pretrained, tmp_path):
    init = random_init_dir("wvisualbert-tiny", tiny_pretrained, tmp_path / "init")
    kw = dict(epochs=1, eval_splits="val", soft_iou=True)
    finetune_refcoco(ref_cfg(tiny_world, init, tmp_path / "ref", **kw))
    assert finetune_refcoco(ref_cfg(tiny_world, init, tmp_path / "run", stop_after=2, **kw)) is None
    assert not (tmp_path / "run" / "metrics.json").exists()
    finetune_refcoco(ref_cfg(tiny_world, init, tmp_path / "run", **kw))
    a, b = load_file(str(tmp_path / "ref" / "model" / "model.safetensors")), load_file(
        str(tmp_path / "run" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "ref" / "predictions.json").read_text() == (tmp_path / "run" / "predictions.json").read_text()
    meta = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert meta["arch"] == "wvisualbert" and meta["soft_iou"] is True


def test_ground_truth_track_on_a_gold_box_store(tiny_world, tiny_pretrained, tmp_path):
    gold = tmp_path / "gold.h5"
    extract(ExtractConfig(world=str(tiny_world.root), out=str(gold), boxes="gold",
                          detector=str(companion_paths(tiny_world.store)["detector"])))
    store = RegionStore(gold)
    assert store.metadata.settings["box_policy"] == "gold"
    refs_p, _, inst = refs_files(tiny_world)
    data = read_refcoco(refs_p, inst)
    for image_id in {r.image_id for r in data.refs}:  # the regions are exactly the instance boxes, in id order
        want = [[a.bbox[0], a.bbox[1], a.bbox[0] + a.bbox[2], a.bbox[1] + a.bbox[3]]
                for a in data.image_annotations(image_id)]
        assert store.get(str(image_id)).boxes.tolist() == want
    finetune_refcoco(ref_cfg(tiny_world, tiny_pretrained, tmp_path / "gt", features=str(gold), track="gt",
                             epochs=0.2))
    metrics = json.loads((tmp_path / "gt" / "metrics.json").read_text())
    assert all(m["upper_bound"] == 100.0 for m in metrics["splits"].values()) and metrics["track"] == "gt"
    # a detected-region store is refused for the gt track, with what to do
    with pytest.raises(VlbertsError, match="--boxes gold"):
        finetune_refcoco(ref_cfg(tiny_world, tiny_pretrained, tmp_path / "bad", track="gt"))

    # ViLBERT's training candidates: each training image's detected regions, then its instance boxes, at most
    # --max_regions of the two; the evaluation splits read the detected regions alone.
    detected = RegionStore(tiny_world.store)
    train = data.expressions("train")
    image = str(train[0].image_id)
    mixed = DetectedThenGold(detected, store)
    rec = mixed.get(image)
    n_det = len(detected.get(image).boxes)
    assert mixed.num_boxes(image) == len(rec.boxes) == n_det + len(store.get(image).boxes)
    assert rec.boxes.tolist() == detected.get(image).boxes.tolist() + store.get(image).boxes.tolist()
    assert rec.features.tolist() == detected.get(image).features.tolist() + store.get(image).features.tolist()
    model = load_refcoco_model(tmp_path / "gt" / "model")[0]
    tok = TextTokenizer.load(tiny_pretrained)
    room = max(len(detected.get(str(e.image_id)).boxes) for e in train) + 10  # every instance box fits
    plain = ref_data(model, train, detected, tok, max_text_len=24, max_regions=room)
    with_gold = ref_data(model, train, detected, tok, max_text_len=24, max_regions=room, gold=store)
    assert all(max(with_gold[i]["targets"]) == 1.0 for i in range(len(train)))  # the gold box is a candidate
    assert sum(max(plain[i]["targets"]) == 1.0 for i in range(len(train))) < len(train)
    capped = ref_data(model, train, detected, tok, max_text_len=24, max_regions=n_det + 1, gold=store)
    assert len(capped[0]["regions"].feats) == n_det + 1  # ViLBERT's cap counts both
    finetune_refcoco(ref_cfg(tiny_world, tiny_pretrained, tmp_path / "mix", epochs=0.2, train_gt_features=str(gold)))
    mix = json.loads((tmp_path / "mix" / "metrics.json").read_text())
    assert mix["train_gt_features"] == str(gold) and mix["track"] == "detected"
    assert all(m["upper_bound"] < 100.0 for m in mix["splits"].values())  # evaluated on detections only
    with pytest.raises(VlbertsError, match="with --track=gt the candidates are already those boxes"):
        finetune_refcoco(ref_cfg(tiny_world, tiny_pretrained, tmp_path / "bad2", features=str(gold), track="gt",
                                 train_gt_features=str(gold)))
    with pytest.raises(VlbertsError, match="--train_gt_features needs a store whose regions are exactly each image's"):
        finetune_refcoco(ref_cfg(tiny_world, tiny_pretrained, tmp_path / "bad3", train_gt_features=str(tiny_world.store)))


# --------------------------------------------------------------------------- bad input


def _broken_copy(tiny_world, tmp_path: Path) -> tuple[Path, Path]:
    """refs.json + instances.json with one ref whose annotation is missing and one ref on an image that
    the instances have but the store does not."""
    _, refs_json, inst = refs_files(tiny_world)
    refs = json.loads(refs_json.read_text())
    instances = json.loads(inst.read_text())
    train = [r for r in refs if r["split"] == "train"]
    train[0]["ann_id"] = 99_999_999  # no such annotation
    ghost = json.loads(json.dumps(train[1]))
    ghost.update(ref_id=777_701, ann_id=777_701, image_id=7777)
    for k, s in enumerate(ghost["sentences"]):
        s["sent_id"] = 777_701 * 10 + k
    refs.append(ghost)
    instances["images"].append({"id": 7777, "file_name": "x.png", "width": 128, "height": 128})
    instances["annotations"].append({"id": 777_701, "image_id": 7777, "category_id": ghost["category_id"],
                                     "bbox": [1, 1, 20, 20]})
    (tmp_path / "refs.json").write_text(json.dumps(refs))
    (tmp_path / "instances.json").write_text(json.dumps(instances))
    return tmp_path / "refs.json", tmp_path / "instances.json"


def test_bad_records_are_errors_or_counted_with_skip_bad(tiny_world, tiny_pretrained, tmp_path):
    refs, inst = _broken_copy(tiny_world, tmp_path)
    cfg = ref_cfg(tiny_world, tiny_pretrained, tmp_path / "run", refs=str(refs), instances=str(inst), epochs=0.2,
                  eval_splits="val")
    with pytest.raises(VlbertsError) as err:
        finetune_refcoco(cfg)
    assert str(err.value).startswith(f"{refs}: record refs[") and "ann_id 99999999 is not in instances.json" in str(err.value)
    finetune_refcoco(FinetuneRefCocoConfig(**{**vars(cfg), "skip_bad": True}))
    skipped = json.loads((tmp_path / "run" / "metrics.json").read_text())["skipped_records"]
    assert skipped["total"] == 2 and skipped["missing annotation"] == 1 and skipped["missing features"] == 1
    # without the broken ref, the missing image alone stops the run with the store and the image
    data = json.loads(refs.read_text())
    refs.write_text(json.dumps([r for r in data if r["ann_id"] != 99_999_999]))
    with pytest.raises(VlbertsError, match=r"record 7777: image id 7777 of split train not in store"):
        finetune_refcoco(FinetuneRefCocoConfig(**{**vars(cfg), "out": str(tmp_path / "run2")}))
    with pytest.raises(VlbertsError, match="unknown track 'boxes'"):
        finetune_refcoco(FinetuneRefCocoConfig(**{**vars(cfg), "track": "boxes"}))


# --------------------------------------------------------------------------- evaluate on a hand-made fixture


def _fixture(tmp_path: Path) -> tuple[Path, Path]:
    images = [{"id": 1, "file_name": "a.png", "width": 100, "height": 100},
              {"id": 2, "file_name": "b.png", "width": 100, "height": 100}]
    anns = [{"id": 10, "image_id": 1, "category_id": 1, "bbox": [0, 0, 10, 10]},
            {"id": 11, "image_id": 1, "category_id": 1, "bbox": [50, 50, 20, 20]},
            {"id": 20, "image_id": 2, "category_id": 2, "bbox": [10, 10, 40, 20]}]
    (tmp_path / "instances.json").write_text(json.dumps({"images": images, "annotations": anns, "categories": [
        {"id": 1, "name": "circle"}, {"id": 2, "name": "square"}]}))
    sent = lambda i, text: {"sent_id": i, "sent": text, "raw": text, "tokens": text.split()}  # noqa: E731
    refs = [{"ref_id": 1, "ann_id": 10, "image_id": 1, "category_id": 1, "split": "val",
             "sentences": [sent(100, "red circle"), sent(101, "the red one")]},
            {"ref_id": 2, "ann_id": 11, "image_id": 1, "category_id": 1, "split": "val",
             "sentences": [sent(102, "blue circle")]},
            {"ref_id": 3, "ann_id": 20, "image_id": 2, "category_id": 2, "split": "testA",
             "sentences": [sent(200, "green square"), sent(201, "square in green")]}]
    with open(tmp_path / "refs.p", "wb") as f:
        pickle.dump(refs, f, protocol=2)
    return tmp_path / "refs.p", tmp_path / "instances.json"


def test_evaluate_refcoco_hand_made_fixture(tmp_path, capsys):
    refs, inst = _fixture(tmp_path)
    preds = [
        {"sent_id": 100, "ref_id": 1, "box": [0, 0, 10, 10]},  # IoU 1: correct
        {"sent_id": 101, "ref_id": 1, "box": [0, 0, 5, 10]},  # IoU 50/100 = 0.5: correct at >= 0.5
        {"sent_id": 102, "ref_id": 2, "box": [0, 0, 10, 10]},  # the other circle: IoU 0
        {"sent_id": 200, "ref_id": 3, "box": [10, 10, 40, 20]},  # IoU 1
        {"sent_id": 201, "ref_id": 3, "box": [30, 10, 40, 20]},  # inter 20x20 = 400, union 1200: 1/3
    ]
    (tmp_path / "p.json").write_text(json.dumps(preds))
    args = ["evaluate", "refcoco", "--predictions", str(tmp_path / "p.json"), "--refs", str(refs), "--instances",
            str(inst), "--out", str(tmp_path / "eval")]
    code, stdout, _ = run_cli(args, capsys)
    assert code == 0
    assert "RefCOCO+ val accuracy 66.67% on 3 expressions" in stdout and "testA accuracy 50.00% on 2" in stdout
    m = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert m["splits"]["val"]["num_correct"] == 2 and m["splits"]["testA"]["num_correct"] == 1
    assert m["accuracy"] == pytest.approx(200 / 3)
    # a missing prediction, an unknown expression, a wrong ref: one line each, exit code 2
    for bad, message in (
        (preds[:-1], "record sent_id 201: no prediction for this example"),
        (preds + [{"sent_id": 999, "ref_id": 1, "box": [0, 0, 1, 1]}], "record sent_id 999: not an expression of the refs"),
        ([{**preds[0], "ref_id": 2}] + preds[1:], "record sent_id 100: ref_id 2 but the expression belongs to ref 1"),
        ([{**preds[0], "image_id": 2}] + preds[1:], "record sent_id 100: image_id 2 but the expression is of image 1"),
        ([{**preds[0], "box": [0, 0, -1, 3]}] + preds[1:], "box must be [x, y, w, h] with w, h >= 0"),
    ):
        (tmp_path / "p.json").write_text(json.dumps(bad))
        code, _, err = run_cli(args, capsys)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("change, record, message", [
    # ref 2's expression takes ref 1's second sent_id: it would replace that expression without a word
    (lambda refs: refs[1]["sentences"][0].update(sent_id=101), "refs[1] (ref_id 2) sentences[0]",
     "duplicate sent_id 101 (first in ref_id 1: refs[0] sentences[1])"),
    (lambda refs: refs[2]["sentences"][1].update(sent_id=200), "refs[2] (ref_id 3) sentences[1]",
     "duplicate sent_id 200 (first in ref_id 3: refs[2] sentences[0])"),
    (lambda refs: refs[2].update(ref_id=1), "refs[2]", "duplicate ref_id 1 (first at refs[0])"),
])
def test_duplicate_sent_or_ref_id_names_the_refs_file(change, record, message, tmp_path, capsys):
    refs, inst = _fixture(tmp_path)
    data = pickle.loads(refs.read_bytes())
    change(data)
    with open(refs, "wb") as f:
        pickle.dump(data, f, protocol=2)
    (tmp_path / "p.json").write_text("[]")
    code, _, err = run_cli(["evaluate", "refcoco", "--predictions", str(tmp_path / "p.json"), "--refs", str(refs),
                            "--instances", str(inst), "--out", str(tmp_path / "eval")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.strip() == f"error: {refs}: record {record}: {message}"
    # the reader finetune shares: with --skip_bad the ref is dropped and counted, the first one kept
    bad = BadRecords(skip=True)
    kept = read_refcoco(refs, inst, bad)
    assert [r.ref_id for r in kept.refs] == [r["ref_id"] for k, r in enumerate(data) if f"refs[{k}]" not in record]
    assert bad.total == 1 and bad.first == f"{refs}: record {record}: {message}"
