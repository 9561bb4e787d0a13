"""The torchvision Faster R-CNN extractor (`features/frcnn.py`, `vlberts features extract`): a weights file
written here from a randomly initialised torchvision detector (nothing is downloaded), images of the
embedded world plus a non-square one. Checks: the kept regions are proposals selected as BUTD selects
them, in the original image's pixels; the stored feature is what the box classifier reads (its class
distribution recomputed from the stored feature equals the stored one); v1 and v2 are told apart by
their keys; bad weights and unreadable images are one-line errors that leave no store behind."""

from __future__ import annotations

import hashlib
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlberts.errors import VlbertsError
from vlberts.features.frcnn import DetectorSettings, build_detector, extract_folder
from vlberts.features.selection import SelectionConfig
from vlberts.features.store import RegionStore

VLBERTS = Path(sys.executable).with_name("vlberts")
SMALL = DetectorSettings(min_size=64, max_size=256, proposals=200)
SELECT = SelectionConfig(min_boxes=5, max_boxes=20)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> Path:
    from torchvision.models.detection import fasterrcnn_resnet50_fpn

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("frcnn") / "fasterrcnn_random.pth"
    torch.save(fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=5).state_dict(), path)
    return path


@pytest.fixture()
def images(tiny_world, tmp_path) -> Path:
    folder = tmp_path / "images"
    folder.mkdir()
    for png in sorted((tiny_world.root / "images").glob("*.png"))[:2]:
        (folder / png.name).write_bytes(png.read_bytes())
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (100, 200, 3), dtype=np.uint8)).save(folder / "COCO_val2014_000000000007.jpg")
    return folder


def test_kept_regions_are_selected_proposals_with_the_classifiers_features(weights, images, tmp_path):
    out = extract_folder(images, weights, tmp_path / "f.h5", selection=SELECT, settings=SMALL,
                         classes=["__background__", "a", "b", "c", "d"])
    model, arch, num_classes = build_detector(weights, SMALL)
    assert (arch, num_classes) == ("fasterrcnn_resnet50_fpn", 5)
    with RegionStore(out) as store:
        # all-digit stems become integer ids (BUTD), others stay as they are (LXMERT)
        assert store.ids() == ["1", "2", "COCO_val2014_000000000007"]
        meta = store.metadata
        assert meta.extractor == "torchvision-fasterrcnn_resnet50_fpn" and meta.classes == ["a", "b", "c", "d"]
        assert meta.weights_hash == hashlib.sha256(weights.read_bytes()).hexdigest()
        assert meta.settings["box_policy"] == "5-20" and meta.settings["background_column"] == "first"
        for image_id in store.ids():
            rec = store.get(image_id)
            assert 5 <= rec.num_boxes <= 20 and rec.features.shape[1] == 1024 and rec.cls_prob.shape[1] == 5
            assert (rec.boxes >= -1e-3).all() and (rec.boxes[:, [0, 2]] <= rec.image_w + 1e-3).all()
            assert (rec.boxes[:, [1, 3]] <= rec.image_h + 1e-3).all()
            with torch.no_grad():  # the stored feature is the box classifier's input
                logits, _ = model.roi_heads.box_predictor(torch.from_numpy(rec.features))
            np.testing.assert_allclose(logits.softmax(-1).numpy(), rec.cls_prob, rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(rec.obj_id, rec.cls_prob[:, 1:].argmax(1))
        wide = store.get("COCO_val2014_000000000007")
        assert (wide.image_w, wide.image_h) == (200, 100)
        # resized to 128 x 64 for the detector; boxes back in the original's pixels
        assert wide.boxes[:, 2].max() > 128 + 1


def test_the_same_selection_as_butd_over_the_proposals(weights, images, tmp_path):
    """Keeping everything (min = max = number of proposals) gives every proposal; with BUTD's policy the kept
    boxes are a subset of them."""
    every = extract_folder(images, weights, tmp_path / "all.h5", settings=SMALL,
                           selection=SelectionConfig(min_boxes=200, max_boxes=200))
    kept = extract_folder(images, weights, tmp_path / "kept.h5", settings=SMALL, selection=SELECT)
    with RegionStore(every) as a, RegionStore(kept) as b:
        for image_id in a.ids():
            all_boxes = {tuple(x) for x in a.get(image_id).boxes.round(3).tolist()}
            assert a.get(image_id).num_boxes == 200
            assert {tuple(x) for x in b.get(image_id).boxes.round(3).tolist()} <= all_boxes


def test_v2_weights_are_recognised(images, tmp_path):
    from torchvision.models.detection import fasterrcnn_resnet50_fpn_v2

    path = tmp_path / "v2.pth"
    torch.save(fasterrcnn_resnet50_fpn_v2(weights=None, weights_backbone=None, num_classes=3).state_dict(), path)
    out = extract_folder(images, path, tmp_path / "v2.h5", settings=SMALL, selection=SELECT, batch_images=3)
    with RegionStore(out) as store:
        assert store.metadata.extractor == "torchvision-fasterrcnn_resnet50_fpn_v2"
        assert store.get("1").features.shape[1] == 1024 and store.get("1").cls_prob.shape[1] == 3


def test_bad_weights_and_unreadable_images_are_one_line_errors(weights, images, tmp_path):
    sd = torch.load(weights, weights_only=True)
    del sd["roi_heads.box_head.fc7.bias"]
    torch.save(sd, tmp_path / "short.pth")
    with pytest.raises(VlbertsError, match=r"roi_heads\.box_head\.fc7\.bias"):
        extract_folder(images, tmp_path / "short.pth", tmp_path / "x.h5", settings=SMALL)
    torch.save({"backbone.body.conv1.weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(VlbertsError, match="not a torchvision Faster R-CNN"):
        extract_folder(images, tmp_path / "other.pth", tmp_path / "x.h5", settings=SMALL)

    (images / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(VlbertsError, match=r"broken\.png: cannot read as an image"):
        extract_folder(images, weights, tmp_path / "x.h5", settings=SMALL, selection=SELECT)
    assert not (tmp_path / "x.h5").exists()


def test_cli_extracts_a_folder(weights, images, tmp_path):
    run = subprocess.run([str(VLBERTS), "features", "extract", "--images", str(images), "--weights", str(weights),
                          "--out", str(tmp_path / "s.h5"), "--min-size", "64", "--max-size", "256", "--proposals", "200",
                          "--min-boxes", "5", "--max-boxes", "20", "--device", "cpu"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert "3 images" in run.stdout and "1024-d float32 features, fields boxes, features, cls_prob, obj_id, obj_conf" in run.stdout
    assert re.search(r"extracted 3 images in [0-9.]+ s, [0-9.]+ images/s after the first pass", run.stdout), run.stdout
    run = subprocess.run([str(VLBERTS), "features", "extract", "--images", str(tmp_path / "none"), "--weights",
                          str(weights), "--out", str(tmp_path / "t.h5")], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr.strip().endswith("not a directory of images")
