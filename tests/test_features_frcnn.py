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


def test_given_boxes_are_described_exactly_under_the_files_ids(weights, images, tmp_path):
    """--boxes (RefCOCO+'s ground-truth track, VCR's boxes): only the boxes file's images, each at exactly its
    boxes in its order, feature = the box head's output there (its classifier's distribution recomputed from the
    stored feature), under the file's ids: a COCO id finds `COCO_val2014_000000000007.jpg`."""
    import json

    from vlberts.features.frcnn import read_given_boxes

    instances = {"images": [{"id": 7}, {"id": 2}], "annotations": [
        {"image_id": 7, "bbox": [10.0, 20.0, 50.0, 30.0]}, {"image_id": 2, "bbox": [0, 0, 64, 64]},
        {"image_id": 7, "bbox": [150.5, 5.0, 40.0, 90.0]}]}
    (tmp_path / "instances.json").write_text(json.dumps(instances))
    out = extract_folder(images, weights, tmp_path / "g.h5", settings=SMALL, boxes=tmp_path / "instances.json")
    model, _, _ = build_detector(weights, SMALL)
    with RegionStore(out) as store:
        assert sorted(store.ids()) == ["2", "7"]  # image 1 is not in the file
        assert store.metadata.settings["box_policy"] == "given"
        seven = store.get("7")
        np.testing.assert_array_equal(seven.boxes, [[10, 20, 60, 50], [150.5, 5, 190.5, 95]])  # xywh -> xyxy, in order
        assert (seven.image_w, seven.image_h) == (200, 100)
        with torch.no_grad():
            logits, _ = model.roi_heads.box_predictor(torch.from_numpy(seven.features))
        np.testing.assert_allclose(logits.softmax(-1).numpy(), seven.cls_prob, rtol=1e-5, atol=1e-6)
        # the feature is the box head's at that box: pool it by hand at the resized box
        img = torch.from_numpy(np.array(Image.open(images / "COCO_val2014_000000000007.jpg").convert("RGB"))
                               ).permute(2, 0, 1).float() / 255
        with torch.no_grad():
            batch, _ = model.transform([img])
            feats = model.backbone(batch.tensors)
            h1, w1 = batch.image_sizes[0]
            box = torch.tensor([[10.0, 20.0, 60.0, 50.0]]) * torch.tensor([w1 / 200, h1 / 100] * 2)
            want = model.roi_heads.box_head(model.roi_heads.box_roi_pool(feats, [box], batch.image_sizes))
        np.testing.assert_allclose(seven.features[0], want[0].numpy(), rtol=1e-4, atol=1e-4)  # batched with another image
        np.testing.assert_array_equal(store.get("2").boxes, [[0, 0, 64, 64]])

    # the {image id: xyxy boxes} form, and one-line errors naming the record
    (tmp_path / "plain.json").write_text(json.dumps({"COCO_val2014_000000000007": [[1, 2, 30, 40]]}))
    assert read_given_boxes(tmp_path / "plain.json")["COCO_val2014_000000000007"].tolist() == [[1, 2, 30, 40]]
    for bad, match in [({"annotations": [{"image_id": 7, "bbox": [1, 2, 3]}]}, r"annotations\[0\]: a box must be four"),
                       ({"7": [[5, 5, 5, 9]]}, r"record 7: a box has no positive width"),
                       ({"99": [[0, 0, 4, 4]]}, r"record 99: no image file for image id 99"),
                       # past the 200 x 100 image: named with the boxes file (it named no file)
                       ({"7": [[10, 10, 500, 500]]}, r"^\S*bad\.json: record 7: box 0 .* lies outside the 200x100 image")]:
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(VlbertsError, match=match):
            extract_folder(images, weights, tmp_path / "b.h5", settings=SMALL, boxes=tmp_path / "bad.json")
    assert not (tmp_path / "b.h5").exists()
    (tmp_path / "classes.txt").write_text("bg\na\nb\n")  # the detector has 5 classes
    with pytest.raises(VlbertsError, match=r"classes\.txt: 3 class names for a detector of 5 classes \(with "
                                           r"background, or 4 without\)$"):
        extract_folder(images, weights, tmp_path / "b.h5", settings=SMALL, classes=tmp_path / "classes.txt")


def test_cli_given_boxes(weights, images, tmp_path):
    (tmp_path / "boxes.json").write_text('{"7": [[1, 2, 30, 40], [0, 0, 200, 100]]}')
    run = subprocess.run([str(VLBERTS), "features", "extract", "--images", str(images), "--weights", str(weights),
                          "--out", str(tmp_path / "s.h5"), "--min-size", "64", "--max-size", "256",
                          "--boxes", str(tmp_path / "boxes.json"), "--device", "cpu"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    with RegionStore(tmp_path / "s.h5") as store:
        assert store.ids() == ["7"] and store.get("7").num_boxes == 2
