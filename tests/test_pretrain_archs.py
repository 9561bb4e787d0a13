"""`vlberts pretrain` for every architecture with its paper's objectives (objectives/recipe.py) on the tiny
world: every expected loss is logged and finite, MLM falls, interrupted runs resume exactly, the examples
carry what each recipe needs (mismatched captions, region masking from (seed, epoch, index), detector
targets, tags), and the objective weights can be overridden."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vlberts.data.coco import read_caption_refs
from vlberts.data.pretrain import MATCH, MISMATCH, CaptionPretrainData, collate_pretrain, unpaired_view
from vlberts.data.batch import PretrainBatch
from vlberts.errors import VlbertsError
from vlberts.features.store import RegionStore
from vlberts.models import builders
from vlberts.objectives.recipe import RECIPES, pretrain_losses
from vlberts.recipes.pretrain import PretrainConfig, drop_mismatched, pretrain, region_setup, store_sizes
from vlberts.text.masking import IGNORE_INDEX
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.metrics import MetricsLog

from conftest import word_selection_counts

VLBERTS = Path(sys.executable).with_name("vlberts")

# The losses each architecture's paper recipe logs (objectives/recipe.py).
PAPER_LOSSES = {
    "visualbert-tiny": {"mlm", "match"},
    "vilbert-tiny": {"mlm", "region_kl", "match"},
    "vlbert-tiny": {"mlm", "roi_cls"},
    "lxmert-tiny": {"mlm", "feat", "obj", "attr", "match"},
    "wvisualbert-tiny": {"mlm", "tag_mlm", "feat", "obj", "attr"},
}


def cfg_for(world, out: Path, model: str, **kw) -> PretrainConfig:
    base = dict(
        captions=str(world.captions_train), features=str(world.store), out=str(out), model=model, vocab_size=200,
        steps=8, batch_size=8, lr=2e-3, warmup=0.1, log_every=1, ckpt_every=3, seed=3, max_text_len=40,
    )
    return PretrainConfig(**{**base, **kw})


def losses_of(record: dict) -> dict[str, float]:
    return {k[: -len("_loss")]: v for k, v in record.items() if k.endswith("_loss")}


@pytest.mark.parametrize("model", list(PAPER_LOSSES))
def test_every_architecture_trains_its_paper_objectives(tiny_world, tmp_path, model, monkeypatch):
    from vlberts.recipes import pretrain as recipe

    counted = []  # each update's (one micro-batch's) terms per loss, as the loop counts them
    count = recipe.loss_counts
    monkeypatch.setattr(recipe, "loss_counts", lambda batch, names, run_recipe=None: counted.append(
        count(batch, names, run_recipe)) or counted[-1])
    out = tmp_path / model
    pretrain(cfg_for(tiny_world, out, model, steps=30, ckpt_every=100))
    log = MetricsLog.read(out / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 31))
    seen = set()
    for r in log:
        losses = losses_of(r)
        assert losses.keys() <= PAPER_LOSSES[model]
        assert all(math.isfinite(v) for v in losses.values()), r
        seen |= losses.keys()
    assert seen == PAPER_LOSSES[model]
    if model == "wvisualbert-tiny":  # unpaired: text-only and image-only updates alternate by schedule
        assert {r["source"] for r in log} == {"text", "image"}
        assert all(losses_of(r).keys() == ({"mlm"} if r["source"] == "text" else {"tag_mlm", "feat", "obj", "attr"})
                   for r in log)
    else:
        assert all(losses_of(r).keys() == PAPER_LOSSES[model] - {k for k, n in c.items() if n == 0}
                   for r, c in zip(log, counted, strict=True))
        # (an update with no term for a loss, no masked region say, leaves it out of its record rather than log 0)
    mlm = [r["mlm_loss"] for r in log if "mlm_loss" in r]
    assert np.mean(mlm[-5:]) < 0.95 * np.mean(mlm[:5]), mlm


@pytest.mark.parametrize("model", ["lxmert-tiny", "vlbert-tiny", "wvisualbert-tiny"])
def test_interrupted_run_resumes_exactly(tiny_world, tmp_path, model):
    ref = tmp_path / "ref"
    pretrain(cfg_for(tiny_world, ref, model))
    run = tmp_path / "run"
    assert pretrain(cfg_for(tiny_world, run, model, stop_after=5)) is None  # last checkpoint: step 3
    assert pretrain(cfg_for(tiny_world, run, model)) == run / "model"
    a, b = MetricsLog.read(ref / "metrics.jsonl"), MetricsLog.read(run / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [losses_of(r) for r in a] == [losses_of(r) for r in b]
    assert len({r["mlm_loss"] for r in a if "mlm_loss" in r}) > 1  # the losses actually vary


def test_objective_weights_override_and_bad_names(tiny_world, tmp_path):
    out = tmp_path / "w"
    pretrain(cfg_for(tiny_world, out, "lxmert-tiny", steps=2, objectives="mlm=1,obj=0.5"))
    for r in MetricsLog.read(out / "metrics.jsonl"):
        # Paper objectives switched off in this run are logged as 0.0.
        assert r["feat_loss"] == r["attr_loss"] == r["match_loss"] == 0.0
        assert r["obj_loss"] > 0 and r["loss"] == pytest.approx(r["mlm_loss"] + 0.5 * r["obj_loss"])
    with pytest.raises(VlbertsError, match="vlbert model has no head for objective 'match'; its objectives: mlm, roi_cls"):
        pretrain(cfg_for(tiny_world, tmp_path / "x", "vlbert-tiny", objectives="mlm=1,match=1"))
    with pytest.raises(VlbertsError, match="unknown objective 'itm'; valid: mlm, match, region_kl"):
        pretrain(cfg_for(tiny_world, tmp_path / "y", "vilbert-tiny", objectives="itm=1"))
    with pytest.raises(VlbertsError, match="weight 'x' is not a number"):
        pretrain(cfg_for(tiny_world, tmp_path / "z", "vilbert-tiny", objectives="mlm=x"))
    with pytest.raises(VlbertsError, match="--mismatched_targets must be one of auto, keep, drop, got 'some'"):
        pretrain(cfg_for(tiny_world, tmp_path / "w", "lxmert-tiny", mismatched_targets="some"))


def _data(world, arch: str, **kw) -> tuple[CaptionPretrainData, TextTokenizer]:
    caps = read_caption_refs(str(world.captions_train))
    store = RegionStore(world.store)
    tok = TextTokenizer.train([c.text for c in caps] + list(store.metadata.classes), vocab_size=200)
    recipe = RECIPES[arch]
    weights = recipe.objectives
    setup = region_setup(recipe, dict(weights), store, tok, with_tags=arch == "wvisualbert")
    data = CaptionPretrainData(caps, store, tok, pairs=False, seed=2, mismatch_prob=0.5, region_setup=setup, **kw)
    return data, tok


def test_half_the_texts_are_the_images_own(tiny_world):
    """VisualBERT §3.3: the second caption describes the image half of the time and is a random caption of
    another image otherwise; ViLBERT's alignment and LXMERT's matching replace the one caption at
    `mismatch_prob`. Counted over every example of 4 epochs."""
    caps = read_caption_refs(str(tiny_world.captions_train))
    store = RegionStore(tiny_world.store)
    tok = TextTokenizer.train([c.text for c in caps], vocab_size=200)
    for kw, matched_share in ((dict(pairs=True), 0.5), (dict(pairs=False, mismatch_prob=0.5), 0.5),
                              (dict(pairs=False, mismatch_prob=0.2), 0.8), (dict(pairs=False), 1.0)):
        data = CaptionPretrainData(caps, store, tok, seed=7, **kw)
        labels = [data[(epoch, i)]["match"] for epoch in range(4) for i in range(len(data))]
        share = labels.count(MATCH) / len(labels)
        assert set(labels) <= {MATCH, MISMATCH}
        assert abs(share - matched_share) < 3.5 * (0.25 / len(labels)) ** 0.5 + 1e-9, (kw, share, len(labels))


def test_each_examples_lengths_are_those_of_its_batch_in_every_epoch(tiny_world):
    # Length grouping sorts by (regions, tokens) per epoch: a pair's second caption and a mismatched
    # caption are drawn per epoch, and `lengths(epoch)` replays those draws.
    caps = read_caption_refs(str(tiny_world.captions_train))
    store = RegionStore(tiny_world.store)
    tok = TextTokenizer.train([c.text for c in caps], vocab_size=200)
    for kw in (dict(pairs=True), dict(pairs=False, mismatch_prob=0.5)):
        data = CaptionPretrainData(caps, store, tok, seed=5, max_regions=7, **kw)
        by_epoch = [data.lengths(epoch) for epoch in range(3)]
        assert by_epoch[0].shape == (len(data), 2)
        assert not np.array_equal(by_epoch[0][:, 1], by_epoch[1][:, 1])  # another draw, another text
        for epoch, lengths in enumerate(by_epoch):
            for i in range(len(data)):
                ex = data[(epoch, i)]
                assert lengths[i].tolist() == [len(ex["regions"].feats), len(ex["ids"])], (kw, epoch, i)
        assert by_epoch[0][:, 0].max() <= 7


def record_data_argument(monkeypatch, name: str) -> list:
    """Make `vlberts pretrain` record the keyword argument `name` of every `CaptionPretrainData` it builds, in
    the returned list."""
    import vlberts.recipes.pretrain as pretrain_recipe

    seen = []

    class Recording(CaptionPretrainData):
        def __init__(self, *a, **kw):
            seen.append(kw.get(name))
            super().__init__(*a, **kw)

    monkeypatch.setattr(pretrain_recipe, "CaptionPretrainData", Recording)
    return seen


def tiny_model_and_batch(world, arch: str, n: int = 8) -> tuple[torch.nn.Module, PretrainBatch, dict[str, float]]:
    """A `{arch}-tiny` pre-training model with its heads sized from the tiny world's store (as `pretrain`
    sizes them), a collated batch of `n` examples with the recipe's targets, and the paper's objective
    weights. Seed torch before calling for a reproducible model."""
    recipe = RECIPES[arch]
    data, tok = _data(world, arch, drop_mismatched=recipe.drop_unmatched)
    batch = collate_pretrain([data[(0, i)] for i in range(n)], pad_id=tok.pad_id)
    store = RegionStore(world.store)
    sizes = store_sizes(store)  # detector classes and attributes
    heads = {field: sizes[what] for field, what in recipe.head_sizes.items() if what in sizes}
    cfg = builders.model_config(f"{arch}-tiny", vocab_size=tok.vocab_size, visual_dim=store.feature_dim, **heads)
    weights = {k: 1.0 for k in recipe.objectives if k in recipe.available(cfg)}
    return builders.build_pretraining_model(cfg), batch, weights


def test_examples_carry_each_recipes_targets(tiny_world):
    lx, _ = _data(tiny_world, "lxmert")
    ex = [lx[(0, i)] for i in range(40)]
    # Matching: about half the captions are another image's; the masking is a function of (seed, epoch, index).
    assert 10 < sum(e["match"] != MATCH for e in ex) < 30
    again = lx[(0, 7)]
    assert np.array_equal(again["ids"], ex[7]["ids"]) and np.array_equal(again["masked"], ex[7]["masked"])
    assert np.array_equal(again["regions"].feats, ex[7]["regions"].feats)
    assert any(not np.array_equal(lx[(1, i)]["masked"], ex[i]["masked"]) for i in range(10))
    b = collate_pretrain(ex[:8])
    r = b.regions
    assert r.masked.any() and r.obj_id.dtype == torch.long and r.cls_prob is None  # LXMERT reads no cls_prob
    # LXMERT's rule: zeroed masked regions in the input, the original features kept as the regression target.
    z = r.corrupted & b.inputs.region_mask
    assert z.any() and b.inputs.region_feats[z].abs().sum() == 0 and r.feats[z].abs().sum() > 0
    assert (r.obj_id[~b.inputs.region_mask] == IGNORE_INDEX).all()

    # VL-BERT: the model replaces masked RoIs itself, so the batch keeps their features.
    vl, _ = _data(tiny_world, "vlbert")
    bv = collate_pretrain([vl[(0, i)] for i in range(8)])
    assert bv.regions.corrupted.any() and bv.inputs.region_feats[bv.regions.corrupted].abs().sum() > 0
    assert bv.regions.cls_prob.shape[-1] == 8


def test_mismatched_targets_keep_or_drop_the_masked_words_of_a_text_that_is_not_the_images(tiny_world):
    # Single caption (ViLBERT's rule; LXMERT's code keeps them): a mismatched caption trains no masked word and
    # no masked region, and everything else (input, masks drawn, matched pairs) is the same as keeping them.
    for arch in ("vilbert", "lxmert"):
        kept, _ = _data(tiny_world, arch, drop_mismatched=False)
        dropped, _ = _data(tiny_world, arch, drop_mismatched=True)
        k = collate_pretrain([kept[(0, i)] for i in range(16)])
        d = collate_pretrain([dropped[(0, i)] for i in range(16)])
        mis = ~d.matched
        assert mis.any() and d.matched.any() and torch.equal(k.matched, d.matched)
        assert (k.mlm_labels[mis] != IGNORE_INDEX).any() and k.regions.masked[mis].any()  # kept: targets there
        assert (d.mlm_labels[mis] == IGNORE_INDEX).all() and not d.regions.masked[mis].any()
        assert torch.equal(d.mlm_labels[~mis], k.mlm_labels[~mis]) and torch.equal(d.regions.masked[~mis], k.regions.masked[~mis])
        assert torch.equal(d.inputs.input_ids, k.inputs.input_ids) and torch.equal(d.inputs.region_feats, k.inputs.region_feats)
    # VisualBERT's caption pairs: only caption b (segment 1) of a mismatched pair loses its targets.
    caps = read_caption_refs(str(tiny_world.captions_train))
    store = RegionStore(tiny_world.store)
    tok = TextTokenizer.train([c.text for c in caps], vocab_size=200)
    kw = dict(pairs=True, seed=3, mlm_prob=0.5)
    k = collate_pretrain([CaptionPretrainData(caps, store, tok, **kw)[(0, i)] for i in range(24)])
    d = collate_pretrain([CaptionPretrainData(caps, store, tok, drop_mismatched=True, **kw)[(0, i)] for i in range(24)])
    b = d.inputs.token_type_ids == 1  # (B, T)
    mis = ~d.matched[:, None]  # (B, 1)
    assert (k.mlm_labels[b & mis] != IGNORE_INDEX).any() and (d.mlm_labels[b & mis] == IGNORE_INDEX).all()
    assert torch.equal(d.mlm_labels[~(b & mis)], k.mlm_labels[~(b & mis)])
    assert (d.mlm_labels[~b & mis] != IGNORE_INDEX).any()  # caption a is the image's: its words still train
    # The run option: auto is each architecture's released code.
    assert [drop_mismatched("auto", RECIPES[a]) for a in ("visualbert", "vilbert", "lxmert", "wvisualbert")] == \
        [False, True, False, False]
    assert drop_mismatched("drop", RECIPES["lxmert"]) and not drop_mismatched("keep", RECIPES["vilbert"])


def test_pretrain_and_demo_pass_on_mismatched_targets_and_the_demos_answer_loss(tiny_world, tmp_path, monkeypatch):
    from vlberts.recipes import demo

    seen = record_data_argument(monkeypatch, "drop_mismatched")
    runs = [("lxmert-tiny", "auto", ""), ("lxmert-tiny", "drop", ""), ("vilbert-tiny", "auto", ""),
            ("vilbert-tiny", "keep", ""), ("lxmert-tiny", "auto", "mlm=1,obj=1")]  # no matching: nothing to drop
    for i, (model, choice, objectives) in enumerate(runs):
        pretrain(cfg_for(tiny_world, tmp_path / str(i), model, steps=1, ckpt_every=100, mismatched_targets=choice,
                         objectives=objectives))
    assert seen == [False, True, True, False, False]
    # A choice for a run without matching would change nothing: refused (as --mismatch_replace and --mismatch_prob)
    with pytest.raises(VlbertsError, match="--mismatched_targets=drop decides the targets of a mismatched caption, but "
                                           "this run has no matching objective"):
        pretrain(cfg_for(tiny_world, tmp_path / "x", "lxmert-tiny", steps=1, mismatched_targets="drop",
                         objectives="mlm=1,obj=1"))
    with pytest.raises(VlbertsError, match="--mismatch_prob=0.3 sets how often single-caption matching's caption is "
                                           "another image's, but this run has no matching objective"):
        pretrain(cfg_for(tiny_world, tmp_path / "y", "vlbert-tiny", steps=1, mismatch_prob=0.3))
    with pytest.raises(VlbertsError, match="--pairs=false turns VisualBERT's two-caption texts into one caption; "
                                           "lxmert reads one caption already"):
        pretrain(cfg_for(tiny_world, tmp_path / "z", "lxmert-tiny", steps=1, pairs=False))
    # `vlberts demo` / `vlberts compare` hand their --mismatched_targets to pre-training.
    for args, want in (([], ("auto", "auto")), (["--mismatched_targets=drop", "--qa_loss=kl"], ("drop", "kl"))):
        cfg = demo.config_from_args(["--arch=lxmert", *args])
        pre = demo.pretrain_config(cfg, "lxmert-small", tmp_path, tmp_path / "f.h5", tmp_path / "p")
        vqa = demo.vqa_config(cfg, tmp_path / "p" / "model", tmp_path, tmp_path / "f.h5", tmp_path / "v")
        assert (pre.mismatched_targets, vqa.loss) == want
    # A bad choice fails before any work, in `vlberts demo` and `vlberts compare` alike (both call check_choices).
    for args, msg in ((["--mismatched_targets=some"], "--mismatched_targets must be one of auto, keep, drop"),
                      (["--qa_loss=mse"], "unknown loss 'mse'; valid: auto, bce, kl")):
        with pytest.raises(VlbertsError, match=msg):
            demo.run_demo(demo.config_from_args([f"--out={tmp_path / 'never'}", *args]))
        assert not (tmp_path / "never").exists()


def test_pretrain_passes_on_what_a_negative_replaces_and_refuses_it_where_nothing_is_replaced(tiny_world, tmp_path,
                                                                                               monkeypatch):
    """--mismatch_replace reaches the examples of a run with single-caption matching (ViLBERT §3.1: the image
    or the caption); with caption pairs or without matching it would change nothing, so it is refused."""
    seen = record_data_argument(monkeypatch, "mismatch_replace")
    pretrain(cfg_for(tiny_world, tmp_path / "v", "vilbert-tiny", steps=1, ckpt_every=100, mismatch_replace="either"))
    assert seen == ["either"]
    for model, kw, msg in (("visualbert-tiny", {}, "caption pairs"), ("lxmert-tiny", {"objectives": "mlm=1"},
                                                                      "no matching objective")):
        with pytest.raises(VlbertsError, match=f"--mismatch_replace=image changes single-caption matching.*{msg}"):
            pretrain(cfg_for(tiny_world, tmp_path / model, model, steps=1, mismatch_replace="image", **kw))
    with pytest.raises(VlbertsError, match="--mismatch_replace must be one of caption, image, either, got 'both'"):
        pretrain(cfg_for(tiny_world, tmp_path / "b", "vilbert-tiny", mismatch_replace="both"))


def test_wvisualbert_tags_are_class_names_of_the_detected_objects(tiny_world):
    data, tok = _data(tiny_world, "wvisualbert")
    classes = RegionStore(tiny_world.store).metadata.classes
    ex = data[(0, 3)]
    rec = RegionStore(tiny_world.store).get(data.captions[3].image_id)
    labels, region = ex["tag_labels"], ex["tag_region"]
    # Every masked tag subword's label is a subword of its region's class (or attribute) name.
    for k in np.flatnonzero(labels != IGNORE_INDEX):
        words = tok.encode(classes[rec.obj_id[region[k]]])
        attr = tok.encode(RegionStore(tiny_world.store).metadata.attributes[rec.attr_id[region[k]]])
        assert labels[k] in words + attr
    b = collate_pretrain([data[(0, i)] for i in range(6)])
    text, image = unpaired_view(b, "text"), unpaired_view(b, "image")
    assert text.inputs.region_feats.shape[1] == 0 and text.tags is None
    assert image.inputs.input_ids.shape[1] == 0 and image.tags.tag_ids.shape == b.tags.tag_ids.shape


def test_match_labels_follow_each_papers_convention():
    # Logits that put all mass on index 1 for every row: LXMERT reads index 1 as matched, ViLBERT as
    # not aligned, so a batch of matched pairs costs ~0 under one convention and a lot under the other.
    out = SimpleNamespace(match_logits=torch.tensor([[-20.0, 20.0]] * 4))
    batch = SimpleNamespace(matched=torch.ones(4, dtype=torch.bool))
    lx = pretrain_losses(RECIPES["lxmert"], out, batch, {"match": 1.0})["match"]
    vi = pretrain_losses(RECIPES["vilbert"], out, batch, {"match": 1.0})["match"]
    assert lx.item() < 1e-6 and vi.item() == pytest.approx(40.0, abs=1e-3)


def test_cli_pretrain_lxmert(tiny_world, tmp_path):
    out = tmp_path / "cli"
    proc = subprocess.run(
        [str(VLBERTS), "pretrain", "--model=lxmert-tiny", f"--captions={tiny_world.captions_train}",
         f"--features={tiny_world.store}", f"--out={out}", "--steps=2", "--batch_size=4", "--vocab_size=200",
         "--log_every=1"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"wrote {out / 'model'}" in proc.stdout
    rec = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"mlm_loss", "feat_loss", "obj_loss", "attr_loss", "match_loss"} <= rec.keys()
    assert json.loads((out / "model" / "config.json").read_text())["config"]["num_object_labels"] == 7
    bad = subprocess.run(
        [str(VLBERTS), "pretrain", "--model=vlbert-tiny", f"--captions={tiny_world.captions_train}",
         f"--features={tiny_world.store}", f"--out={tmp_path / 'bad'}", "--objectives=region_kl=1"],
        capture_output=True, text=True,
    )
    assert bad.returncode == 2 and "no head for objective 'region_kl'" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_end_to_end_vlbert_is_a_one_line_error(tiny_world, tmp_path):
    vlberts = Path(sys.executable).with_name("vlberts")
    proc = subprocess.run(
        [str(vlberts), "pretrain", f"--captions={tiny_world.captions_train}", f"--features={tiny_world.store}",
         f"--out={tmp_path / 'e2e'}", "--model=vlbert-e2e-tiny", "--steps=2", "--batch_size=2"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert "end-to-end VL-BERT reads image pixels" in proc.stderr and "Traceback" not in proc.stderr


def test_vlbert_masked_roi_target_is_soft_by_default_and_hard_on_request(tiny_world, tmp_path):
    # The loss of a batch follows the recipe's target: the detector's score vector (released code) or its argmax.
    from dataclasses import replace

    from vlberts.models.builders import build_pretraining_model, model_config
    from vlberts.objectives.recipe import run_model
    from vlberts.objectives.regions import masked_roi_loss

    assert RECIPES["vlbert"].roi_target == "soft"
    data, tok = _data(tiny_world, "vlbert")
    batch = collate_pretrain([data[(0, i)] for i in range(8)])
    assert batch.regions.masked.any()
    torch.manual_seed(0)
    cfg = model_config("vlbert-tiny", vocab_size=tok.vocab_size, visual_dim=batch.inputs.region_feats.shape[-1],
                       num_region_classes=batch.regions.cls_prob.shape[-1])
    model = build_pretraining_model(cfg)
    out = run_model(RECIPES["vlbert"], model, batch)
    r = batch.regions
    loss = {}
    for target in ("soft", "hard"):
        loss[target] = pretrain_losses(replace(RECIPES["vlbert"], roi_target=target), out, batch, {"roi_cls": 1.0})["roi_cls"]
        torch.testing.assert_close(loss[target], masked_roi_loss(out.region_logits, r.cls_prob, r.masked, target=target))
    assert abs(loss["soft"].item() - loss["hard"].item()) > 1e-3

    # `--roi_target` reaches the loss: same first batch and weights, so MLM agrees and roi_cls does not;
    # the default run is the soft one.
    first = {}
    for name, kw in {"default": {}, "soft": {"roi_target": "soft"}, "hard": {"roi_target": "hard"}}.items():
        pretrain(cfg_for(tiny_world, tmp_path / name, "vlbert-tiny", steps=1, ckpt_every=100, **kw))
        first[name] = MetricsLog.read(tmp_path / name / "metrics.jsonl")[0]
    assert first["default"]["roi_cls_loss"] == first["soft"]["roi_cls_loss"] != first["hard"]["roi_cls_loss"]
    assert first["soft"]["mlm_loss"] == first["hard"]["mlm_loss"]
    with pytest.raises(VlbertsError, match="--roi_target must be soft or hard, got 'argmax'"):
        pretrain(cfg_for(tiny_world, tmp_path / "bad", "vlbert-tiny", roi_target="argmax"))


def test_the_prefetch_thread_pins_every_tensor_of_an_update(tiny_world, monkeypatch):
    """On a GPU the recipes draw each update's micro-batches through `feed`, which pins them (`pinned`): every
    tensor of every batch (W-VisualBERT's: regions, tags, masked-word indices nested inside) must be pinned,
    the position passed through. (A `DataLoader(pin_memory=True)` pins an object only through its own
    `pin_memory` method, so typed batches need one: `data.batch.Batch`.) Pinning needs a GPU
    (tests/test_gpu.py checks `is_pinned()` there); here `Tensor.pin_memory` is replaced by a copy that
    records its input."""
    from vlberts.data.sampling import Position
    from vlberts.training.loop import pinned

    data, tok = _data(tiny_world, "wvisualbert")
    micro = [collate_pretrain([data[(0, i)] for i in range(k, k + 4)], pad_id=tok.pad_id) for k in (0, 4)]
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: seen.append(self) or self.clone())
    source, after, pos = pinned(("image", micro, Position(0, 8)))
    assert (source, pos) == ("image", Position(0, 8))
    for batch, out in zip(micro, after, strict=True):
        assert batch.tags is not None and batch.regions is not None and batch.mlm_tokens is not None
        before_t, after_t = list(batch.tensors()), list(out.tensors())
        assert type(out) is type(batch) and len(before_t) == len(after_t) > 15
        assert all(a is not b and torch.equal(a, b) for a, b in zip(after_t, before_t))  # every one was copied
    assert len(seen) == sum(len(list(b.tensors())) for b in micro)


def test_vlbert_masks_whole_words_and_the_others_subwords(tiny_world, tmp_path, monkeypatch):
    """VL-BERT's MLM selects whole words (`random_word_wwm`): the subwords of a word are selected, and
    [MASK]ed, together. The others select each subword on its own (BERT's `random_word`)."""
    caps = read_caption_refs(str(tiny_world.captions_train))
    store = RegionStore(tiny_world.store)
    # A vocabulary of the characters and 10 words, so that most words are spelled in several subwords.
    chars = {c for cap in caps for c in cap.text.lower() if not c.isspace()}
    tok = TextTokenizer.train([c.text for c in caps], vocab_size=5 + 2 * len(chars) + 10)

    def word_splits(whole_word: bool) -> tuple[int, int]:
        """Over 300 examples: (words of several subwords selected whole, words selected only in part)."""
        data = CaptionPretrainData(caps, store, tok, pairs=False, seed=2, whole_word=whole_word)
        counts = [word_selection_counts(ex["ids"], ex["labels"], tok)
                  for ex in (data[(i // len(data), i % len(data))] for i in range(300))]
        return sum(c[0] for c in counts), sum(c[1] for c in counts)

    assert RECIPES["vlbert"].whole_word and not any(RECIPES[a].whole_word for a in RECIPES if a != "vlbert")
    whole, partial = word_splits(whole_word=True)
    assert whole > 50 and partial == 0
    whole, partial = word_splits(whole_word=False)
    assert partial > 50

    # `vlberts pretrain` builds its examples with the recipe's setting.
    seen = record_data_argument(monkeypatch, "whole_word")
    for model in ("vlbert-tiny", "visualbert-tiny"):
        pretrain(cfg_for(tiny_world, tmp_path / model, model, steps=1, ckpt_every=100))
    assert seen == [True, False]


@pytest.mark.parametrize("model", ["visualbert-tiny", "lxmert-tiny", "vilbert-tiny", "wvisualbert-tiny"])
def test_float16_batches_train_exactly_as_float32_ones(tiny_world, float16_store, tmp_path, model):
    """--float16_batches=true (the default on CUDA) keeps a float16 store's features float16 through masking
    (zeroed, swapped with another image's, kept) and collation, and `Batch.to` widens them where the step
    runs: the same losses, bit for bit, and the same weights as float32 batches; the batches the loader
    hands over are float16."""
    from safetensors.torch import load_file

    runs = {}
    for flag in ("false", "true"):
        out = tmp_path / flag
        pretrain(cfg_for(tiny_world, out, model, features=str(float16_store), steps=6, float16_batches=flag))
        runs[flag] = (MetricsLog.read(out / "metrics.jsonl"), load_file(out / "model" / "model.safetensors"))
    (log32, w32), (log16, w16) = runs["false"], runs["true"]
    assert [losses_of(r) for r in log16] == [losses_of(r) for r in log32] and len(log16) == 6
    assert w16.keys() == w32.keys() and all(torch.equal(w16[k], w32[k]) for k in w32)

    with RegionStore(float16_store, upcast=False) as store:
        tok = TextTokenizer.train([c.text for c in read_caption_refs(tiny_world.captions_train)], vocab_size=200)
        recipe = RECIPES[model.split("-")[0]]
        setup = region_setup(recipe, recipe.objectives, store, tok, with_tags=False)
        data = CaptionPretrainData(read_caption_refs(tiny_world.captions_train)[:16], store, tok, pairs=False,
                                   region_setup=dataclasses.replace(setup, float16=True))
        batch = collate_pretrain([data[(0, i)] for i in range(8)], pad_id=tok.pad_id)
    assert batch.inputs.region_feats.dtype == torch.float16
    if batch.regions is not None:
        assert batch.regions.feats is None or batch.regions.feats.dtype == torch.float16
    moved = batch.to("cpu")
    assert moved.inputs.region_feats.dtype == torch.float32
    assert torch.equal(moved.inputs.region_feats, batch.inputs.region_feats.float())
    with pytest.raises(VlbertsError, match="--float16_batches must be auto, true or false, got 'yes'"):
        pretrain(cfg_for(tiny_world, tmp_path / "bad", model, float16_batches="yes"))
