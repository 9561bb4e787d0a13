"""End-to-end VL-BERT pre-training (VL-BERT §3.2-3.3, the CNN inside the model): the pixel loader
(data/pixels.py) and `vlberts pretrain --model=vlbert-e2e-tiny --images=DIR` on the tiny world."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlberts.data.coco import read_caption_refs
from vlberts.data.pixels import IMAGENET_MEAN, IMAGENET_STD, PixelLoader
from vlberts.data.pretrain import CaptionPretrainData, collate_pretrain
from vlberts.errors import VlbertsError
from vlberts.features.store import RegionStore
from vlberts.models.builders import build_pretraining_model, model_config
from vlberts.objectives.recipe import RECIPES, run_model
from vlberts.recipes.pretrain import PretrainConfig, pretrain, region_setup, run_weights
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import load_pretraining_model
from vlberts.training.metrics import MetricsLog

VLBERTS = Path(sys.executable).with_name("vlberts")


# ---------------------------------------------------------------- the loader


def test_loader_normalises_with_imagenet_statistics(tmp_path):
    # A 2x2 image read at its own size: every value is (v / 255 - mean_c) / std_c, computed here by hand.
    rgb = np.array([[[255, 0, 51], [0, 0, 0]], [[102, 204, 255], [10, 20, 30]]], dtype=np.uint8)  # (H, W, 3)
    Image.fromarray(rgb).save(tmp_path / "000000000007.png")
    px = PixelLoader(tmp_path, size=2).get("7")
    assert px.shape == (3, 2, 2) and px.dtype == torch.float32
    # pixel (0, 0) = (255, 0, 51): R (1 - 0.485) / 0.229 = 2.2489..., G (0 - 0.456) / 0.224 = -2.0357...,
    # B (0.2 - 0.406) / 0.225 = -0.9155...
    assert px[:, 0, 0].tolist() == pytest.approx([2.248908, -2.035714, -0.915556], abs=1e-5)
    assert px[:, 0, 1].tolist() == pytest.approx([-0.485 / 0.229, -0.456 / 0.224, -0.406 / 0.225], abs=1e-5)
    for c in range(3):
        expect = (rgb[..., c] / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c]
        np.testing.assert_allclose(px[c].numpy(), expect, atol=1e-5)


def test_loader_resizes_converts_to_rgb_and_caches(tmp_path):
    # 12 wide x 8 high, left half black, right half white, saved as greyscale ("L"): converted to RGB and
    # resized to 4x4; the outer columns keep their colour exactly, every row is the same.
    grey = np.zeros((8, 12), dtype=np.uint8)
    grey[:, 6:] = 255
    Image.fromarray(grey, mode="L").save(tmp_path / "img_3.png")
    loader = PixelLoader(tmp_path, pattern="img_{image_id}.png", size=4)
    px = loader.get(3)
    assert px.shape == (3, 4, 4)
    black = torch.tensor([-m / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)])
    white = torch.tensor([(1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)])
    torch.testing.assert_close(px[:, :, 0], black[:, None].expand(3, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(px[:, :, 3], white[:, None].expand(3, 4), atol=1e-5, rtol=0)
    assert torch.equal(px[:, 0], px[:, 3])  # rows are identical: only the columns vary
    assert loader.get("3") is px  # cached by image id


def test_loader_missing_and_unreadable_images_are_one_line_errors(tmp_path):
    loader = PixelLoader(tmp_path)
    with pytest.raises(VlbertsError) as e:
        loader.get("42")
    msg = str(e.value)
    assert "000000000042.png" in msg and "image 42" in msg and "\n" not in msg
    (tmp_path / "000000000005.png").write_bytes(b"not a png")
    with pytest.raises(VlbertsError, match=r"000000000005\.png: record image 5: cannot read the image"):
        loader.get(5)
    with pytest.raises(VlbertsError, match=r"image 9.*image file missing \(1 of 2 images"):
        Image.fromarray(np.zeros((2, 2, 3), np.uint8)).save(tmp_path / "000000000008.png")
        loader.check(["8", "9", "8"])
    with pytest.raises(VlbertsError, match="image directory not found"):
        PixelLoader(tmp_path / "nope")


# ---------------------------------------------------------------- pre-training


def e2e_cfg(world, out: Path, **kw) -> PretrainConfig:
    base = dict(
        captions=str(world.captions_train), features=str(world.store), out=str(out), model="vlbert-e2e-tiny",
        images=str(world.root / "images"), vocab_size=200, steps=8, batch_size=8, lr=2e-3, log_every=1,
        ckpt_every=3, seed=3, max_text_len=40, pixel_size=64,
    )
    return PretrainConfig(**{**base, **kw})


def test_batches_carry_each_images_pixels_and_the_model_masks_roi_pixels(tiny_world, tmp_path):
    store = RegionStore(tiny_world.store)
    caps = read_caption_refs(tiny_world.captions_train)[:6]
    tok = TextTokenizer.train([c.text for c in caps], vocab_size=100)
    recipe = RECIPES["vlbert"]
    classes = int(store.info()["num_classes_cls_prob"])
    mcfg = model_config("vlbert-e2e-tiny", vocab_size=tok.vocab_size, num_region_classes=classes)
    weights = run_weights(e2e_cfg(tiny_world, tmp_path), recipe, mcfg)
    loader = PixelLoader(tiny_world.root / "images", size=32)
    data = CaptionPretrainData(caps, store, tok, pairs=False, feature_dim=store.feature_dim, seed=1,
                               region_setup=region_setup(recipe, weights, store, tok, with_tags=False), pixels=loader,
                               mlm_prob=0.5)
    batch = collate_pretrain([data[(0, i)] for i in range(6)])
    assert batch.inputs.pixels.shape == (6, 3, 32, 32)
    for i, c in enumerate(caps):
        assert torch.equal(batch.inputs.pixels[i], loader.get(c.image_id))
    # The region side still comes from the store: boxes, and cls_prob as the masked-RoI targets.
    assert batch.regions.cls_prob is not None and batch.regions.corrupted.any()
    # run_model hands the corrupted RoIs to the model, which zeroes their pixels before the CNN: the CNN's
    # input equals the pixels with exactly those boxes blanked.
    model = build_pretraining_model(mcfg).eval()
    seen = []
    hook = model.bert.visual.backbone.register_forward_hook(lambda m, args, out: seen.append(args[0].detach()))
    with torch.no_grad():
        run_model(recipe, model, batch)
    hook.remove()
    from vlberts.models.vlbert import zero_pixels_in_boxes

    expect = zero_pixels_in_boxes(batch.inputs.pixels, batch.inputs.region_boxes,
                                  batch.regions.corrupted & batch.inputs.region_mask)
    assert torch.equal(seen[0], expect) and not torch.equal(expect, batch.inputs.pixels)


def test_e2e_pretraining_trains_the_cnn_and_the_losses_fall(tiny_world, tmp_path, monkeypatch):
    import vlberts.recipes.pretrain as recipe_mod

    initial = {}

    def build_and_keep(cfg):  # the recipe's model builder, keeping a copy of the CNN's initial weights
        model = build_pretraining_model(cfg)
        initial.update({k: v.detach().clone() for k, v in model.bert.visual.state_dict().items()})
        return model

    monkeypatch.setattr(recipe_mod, "build_pretraining_model", build_and_keep)
    out = tmp_path / "e2e"
    # The hard target: the tiny world's detector scores are close to uniform, so the soft target's loss
    # starts at its floor (their entropy) and cannot fall by 5% (test_text_corpus.py says the same).
    final = pretrain(e2e_cfg(tiny_world, out, steps=30, ckpt_every=100, roi_target="hard"))
    log = MetricsLog.read(out / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 31))
    assert all(r.keys() >= {"mlm_loss", "roi_cls_loss"} and math.isfinite(r["loss"]) for r in log)
    for k in ("mlm_loss", "roi_cls_loss"):
        v = [r[k] for r in log]
        assert np.mean(v[-5:]) < 0.95 * np.mean(v[:5]), (k, v)
    # The CNN was trained: every one of its tensors moved from its initial value.
    model, mcfg, _ = load_pretraining_model(final)
    assert mcfg.end_to_end and mcfg.visual_dim == 16  # the config's CNN width, not the store's feature width
    trained = model.bert.visual.state_dict()
    assert set(initial) == set(trained) == {"backbone.0.weight", "backbone.0.bias", "backbone.2.weight",
                                             "backbone.2.bias", "fc.weight", "fc.bias"}
    for name, w0 in initial.items():
        assert (trained[name] - w0).abs().max() > 1e-4, name


def test_interrupted_e2e_run_resumes_exactly(tiny_world, tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    pretrain(e2e_cfg(tiny_world, ref))
    assert pretrain(e2e_cfg(tiny_world, run, stop_after=5)) is None  # last checkpoint: step 3
    assert pretrain(e2e_cfg(tiny_world, run)) == run / "model"
    a, b = MetricsLog.read(ref / "metrics.jsonl"), MetricsLog.read(run / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 9))
    keys = ("mlm_loss", "roi_cls_loss")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    assert len({r["roi_cls_loss"] for r in a}) > 1


def test_cli_e2e_needs_images_and_region_models_refuse_them(tiny_world, tmp_path):
    proc = subprocess.run(
        [str(VLBERTS), "pretrain", f"--captions={tiny_world.captions_train}", f"--features={tiny_world.store}",
         f"--out={tmp_path / 'cli'}", "--steps=1", "--batch_size=2", "--vocab_size=200", "--model=vlbert-e2e-tiny"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "end-to-end VL-BERT reads image pixels: pass --images=DIR" in proc.stderr
    with pytest.raises(VlbertsError, match=r"000000000\d{3}\.png: record image \d+: image file missing"):
        pretrain(e2e_cfg(tiny_world, tmp_path / "a", images=str(tmp_path)))  # a directory without the images
    with pytest.raises(VlbertsError, match="reads region features from the store, not pixels"):
        pretrain(e2e_cfg(tiny_world, tmp_path / "b", model="vlbert-tiny"))


def test_text_only_samples_get_zero_pixels(tiny_world, tmp_path):
    # Collate: an example without pixels (a text-only <Text, ∅> sample) gets a zero image beside the others.
    store = RegionStore(tiny_world.store)
    caps = read_caption_refs(tiny_world.captions_train)[:2]
    tok = TextTokenizer.train([c.text for c in caps], vocab_size=100)
    loader = PixelLoader(tiny_world.root / "images", size=16)
    data = CaptionPretrainData(caps, store, tok, pairs=False, feature_dim=store.feature_dim, pixels=loader)
    with_px = data[(0, 0)]
    text_only = {k: v for k, v in data[(0, 1)].items() if k != "pixels"}
    px = collate_pretrain([with_px, text_only]).inputs.pixels
    assert px.shape == (2, 3, 16, 16)
    assert torch.equal(px[0], loader.get(caps[0].image_id)) and not px[1].any()
    # A run mixing the world's text-only documents in (VL-BERT §3.3) trains end-to-end.
    out = tmp_path / "mix"
    pretrain(e2e_cfg(tiny_world, out, steps=2, text_corpus=str(tiny_world.root / "text" / "documents.txt")))
    log = MetricsLog.read(out / "metrics.jsonl")
    assert len(log) == 2 and all(math.isfinite(r["mlm_loss"]) and math.isfinite(r["roi_cls_loss"]) for r in log)
