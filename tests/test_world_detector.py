"""The world detector and `vlberts extract`: proposals, BUTD box selection, training, the store and
TSVs it writes, and bad input. Everything runs on a tiny embedded world (120 images)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vlberts.errors import VlbertsError
from vlberts.features.proposals import ProposalConfig, box_iou, label_proposals, make_proposals, proposal_rng
from vlberts.features.selection import SelectionConfig, nms_max_conf, select_boxes, select_by_confidence
from vlberts.features.store import RegionStore
from vlberts.features.tsv import read_butd_tsv, read_lxmert_tsv
from vlberts.features.world_detector import (
    DetectorTrainConfig,
    WorldDetector,
    WorldDetectorConfig,
    evaluate_detector,
    load_detector,
    train_detector,
)
from vlberts.features.world_scenes import read_world_scenes
from vlberts.recipes.extract import ExtractConfig, companion_paths, extract

VLBERTS = Path(sys.executable).with_name("vlberts")


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.fixture(scope="module")
def world_dir(tmp_path_factory) -> Path:
    from vlberts.world.build import build_world

    out = tmp_path_factory.mktemp("world") / "w"
    build_world(out, n_images=120, seed=3, workers=1)
    return out


@pytest.fixture(scope="module")
def extracted(world_dir, tmp_path_factory):
    """One recipe run shared by the store/TSV/CLI tests: 12 epochs on ~96 train images (~36 updates)."""
    out = tmp_path_factory.mktemp("feats") / "world.h5"
    result = extract(ExtractConfig(world=str(world_dir), out=str(out), tsv=True, epochs=12, seed=0))
    return result


# --------------------------------------------------------------------------- proposals


def test_proposals_are_deterministic_and_find_every_object(world_dir):
    world = read_world_scenes(world_dir)
    cfg = ProposalConfig()
    for im in world.images[:30]:
        p = make_proposals(im.boxes, im.width, im.height, proposal_rng(0, im.image_id), cfg)
        again = make_proposals(im.boxes, im.width, im.height, proposal_rng(0, im.image_id), cfg)
        other = make_proposals(im.boxes, im.width, im.height, proposal_rng(0, im.image_id, stream=1), cfg)
        np.testing.assert_array_equal(p, again)
        assert not np.array_equal(p, other)
        assert p.shape == (64, 4) and p.dtype == np.float32
        assert (p[:, 0] >= 0).all() and (p[:, 2] <= im.width).all() and (p[:, 1] >= 0).all() and (p[:, 3] <= im.height).all()
        assert (p[:, 2] - p[:, 0] >= cfg.min_side - 1e-4).all() and (p[:, 3] - p[:, 1] >= cfg.min_side - 1e-4).all()
        iou = box_iou(p, im.boxes)  # (P, G)
        assert (iou.max(0) >= 0.6).all()  # every object has a good proposal ...
        assert not (iou.max(0) > 0.9999).all()  # ... but the gold boxes themselves are not handed over
        # part boxes (IoU 0.1-0.4 with an object) are there too
        assert ((iou > 0.1) & (iou < 0.4)).any()


def test_label_proposals_thresholds():
    gold = np.array([[0, 0, 10, 10], [20, 20, 40, 40]], np.float32)
    props = np.array([
        [0, 0, 10, 10],  # IoU 1 with object 0
        [0, 0, 10, 5],  # IoU 0.5 with object 0: foreground (>=)
        [0, 0, 10, 4],  # IoU 0.4: ignored
        [0, 0, 10, 3],  # IoU 0.3: ignored (background is < 0.3)
        [0, 0, 10, 2],  # IoU 0.2: background
        [20, 20, 40, 35],  # IoU 0.75 with object 1
        [60, 60, 70, 70],  # nothing
    ], np.float32)
    lab = label_proposals(props, gold)
    assert lab.is_fg.tolist() == [True, True, False, False, False, True, False]
    assert lab.is_bg.tolist() == [False, False, False, False, True, False, True]
    assert lab.gold_index.tolist() == [0, 0, -1, -1, -1, 1, -1]


# --------------------------------------------------------------------------- selection


def _probs(rows):
    """Rows of non-background scores -> (K, 1 + C) with the background column making rows sum to 1."""
    s = np.asarray(rows, np.float32)
    return np.concatenate([1 - s.sum(1, keepdims=True), s], 1)


def test_nms_max_conf_drops_duplicates_to_their_other_classes():
    boxes = np.array([[0, 0, 10, 10], [1, 0, 11, 10], [50, 50, 60, 60]], np.float32)  # 0 and 1 overlap (IoU 0.82)
    cls_prob = _probs([[0.9, 0.05], [0.8, 0.15], [0.1, 0.6]])
    # class 1: box 1 is suppressed by box 0; class 2: box 0 is suppressed by box 1 (0.15 > 0.05)
    np.testing.assert_allclose(nms_max_conf(boxes, cls_prob, 0.3), [0.9, 0.15, 0.6], rtol=1e-6)
    # with NMS off (threshold 1) every box keeps its best class
    np.testing.assert_allclose(nms_max_conf(boxes, cls_prob, 1.0), [0.9, 0.8, 0.6], rtol=1e-6)


def test_selection_threshold_min_max_and_order():
    conf = np.array([0.1, 0.5, 0.25, 0.9, 0.05, 0.3, 0.2, 0.15])
    # 4 boxes >= 0.2 (1, 2, 3, 5) plus 6 at exactly 0.2 -> 5 kept; between min=2 and max=6
    cfg = SelectionConfig(conf_thresh=0.2, min_boxes=2, max_boxes=6)
    assert select_by_confidence(conf, cfg).tolist() == [3, 1, 5, 2, 6]
    assert select_by_confidence(conf, SelectionConfig(0.2, 2, 6, order="butd")).tolist() == [1, 2, 3, 5, 6]
    # fewer than min above the threshold: top-min by confidence
    assert select_by_confidence(conf, SelectionConfig(0.6, 3, 6)).tolist() == [3, 1, 5]
    # more than max: top-max by confidence (also in butd order, as the original sorts here)
    assert select_by_confidence(conf, SelectionConfig(0.1, 2, 3, order="butd")).tolist() == [3, 1, 5]
    # fixed 36-style policy: min = max
    assert select_by_confidence(conf, SelectionConfig(0.2, 4, 4)).tolist() == [3, 1, 5, 2]
    # ties keep the lower index first
    assert select_by_confidence(np.array([0.5, 0.5, 0.5]), SelectionConfig(0.9, 2, 2)).tolist() == [0, 1]
    assert SelectionConfig(0.2, 10, 36).policy == "10-36" and SelectionConfig(0.2, 36, 36).policy == "fixed36"
    with pytest.raises(VlbertsError):
        SelectionConfig(0.2, 12, 10).validate()


def test_select_boxes_end_to_end():
    boxes = np.array([[0, 0, 10, 10], [1, 0, 11, 10], [50, 50, 60, 60], [20, 0, 30, 10]], np.float32)
    cls_prob = _probs([[0.9, 0.05], [0.8, 0.15], [0.1, 0.6], [0.1, 0.1]])
    # max_conf after NMS = [0.9, 0.15, 0.6, 0.1]: two boxes >= 0.2, min 3 -> top 3
    assert select_boxes(boxes, cls_prob, SelectionConfig(0.2, 3, 36)).tolist() == [0, 2, 1]
    assert select_boxes(boxes, cls_prob, SelectionConfig(0.2, 1, 36)).tolist() == [0, 2]


# --------------------------------------------------------------------------- detector


def test_detector_shapes_and_nonnegative_features():
    cfg = WorldDetectorConfig(num_classes=7, num_attributes=8, feature_dim=24)
    torch.manual_seed(0)
    model = WorldDetector(cfg).eval()
    images = torch.randint(0, 256, (2, 3, 128, 128), dtype=torch.uint8)
    rois = torch.tensor([[0, 0, 0, 20, 20], [1, 10, 30, 60, 90], [1, 0, 0, 128, 128]], dtype=torch.float32)
    with torch.no_grad():
        out = model(images, rois)
    assert out.features.shape == (3, 24) and (out.features >= 0).all()
    assert out.cls_logits.shape == (3, 8) and out.attr_logits.shape == (3, 8) and out.size_logits.shape == (3, 2)


def test_training_is_deterministic(world_dir):
    world = read_world_scenes(world_dir)
    cfg = WorldDetectorConfig(num_classes=len(world.vocab.shapes), num_attributes=len(world.vocab.colours), feature_dim=16)
    train = DetectorTrainConfig(epochs=1, max_steps=2, batch_images=8, seed=5)
    a, rep = train_detector(world, cfg, train)
    b, _ = train_detector(world, cfg, train)
    assert rep.steps == 2
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_trained_detector_beats_chance_on_val(extracted, world_dir):
    # 7 shapes (chance 14%), 8 colours (chance 12.5%); measured here: class 0.83, shape 0.54, colour 0.96
    val = extracted.val
    assert val["fg_proposals"] > 50
    assert val["attr_acc"] >= 0.85
    assert val["obj_acc"] >= 0.35
    assert val["cls_acc"] >= 0.75
    # the numbers in the store metadata are the detector's on this world's val split
    model, info, _ = load_detector(extracted.detector)
    world = read_world_scenes(world_dir)
    again = evaluate_detector(model, world, world.split("val"), info.proposals, SelectionConfig(), seed=0)
    assert again == val


# --------------------------------------------------------------------------- the store and TSVs


def test_store_holds_every_image_with_all_fields(extracted, world_dir):
    world = read_world_scenes(world_dir)
    with RegionStore(extracted.store) as s:
        assert s.ids() == [str(im.image_id) for im in world.images]
        assert s.fields == ["boxes", "features", "cls_prob", "obj_id", "obj_conf", "attr_id", "attr_conf"]
        assert s.feature_dim == 128 and s.dtype == "float32"
        meta = s.metadata
        assert meta.extractor == "vlberts-world-detector"
        assert meta.classes == list(world.vocab.shapes) and meta.attributes == list(world.vocab.colours)
        assert len(meta.weights_hash) == 64 and meta.weights_hash == extracted.weights_hash
        for key in ("box_policy", "conf_thresh", "min_boxes", "max_boxes", "nms", "order", "feature_layer", "proposals", "val"):
            assert key in meta.settings, key
        assert (meta.settings["box_policy"], meta.settings["background_column"]) == ("10-36", "first")
        assert meta.settings["val"] == extracted.val
        for im in world.images:
            rec = s.get(im.image_id)
            assert 10 <= rec.num_boxes <= 36
            assert (rec.image_w, rec.image_h) == (im.width, im.height)
            assert rec.cls_prob.shape == (rec.num_boxes, len(world.vocab.shapes) + 1)
            np.testing.assert_allclose(rec.cls_prob.sum(1), 1.0, atol=1e-5)
            np.testing.assert_array_equal(rec.obj_id, rec.cls_prob[:, 1:].argmax(1))
            np.testing.assert_array_equal(rec.obj_conf, rec.cls_prob[:, 1:].max(1))
            assert (rec.features >= 0).all() and (rec.attr_id < len(world.vocab.colours)).all()
            # boxes written are proposals (stream 0), un-regressed
            props = make_proposals(im.boxes, im.width, im.height, proposal_rng(0, im.image_id, 0))
            assert all((props == b).all(1).any() for b in rec.boxes)
            assert len({tuple(b) for b in rec.boxes}) == rec.num_boxes
    # detector files next to the store, and the hash is theirs
    assert extracted.detector == companion_paths(extracted.store)["detector"]
    _, _, sha = load_detector(extracted.detector)
    assert sha == extracted.weights_hash


def test_tsvs_read_back_equal_to_the_store(extracted):
    butd, lxmert = extracted.tsv
    assert butd.name == "world.butd.tsv" and lxmert.name == "world.lxmert.tsv"
    with RegionStore(extracted.store) as s:
        stored = {r.image_id: r for r in s.records()}
    from_butd = list(read_butd_tsv(butd))
    from_lxmert = list(read_lxmert_tsv(lxmert))
    assert [r.image_id for r in from_butd] == [r.image_id for r in from_lxmert] == list(stored)
    for r in from_butd:
        want = stored[r.image_id]
        assert r.differences(want) == ["cls_prob", "obj_id", "obj_conf", "attr_id", "attr_conf"]  # BUTD has 6 fields
        np.testing.assert_array_equal(r.boxes, want.boxes)
        np.testing.assert_array_equal(r.features, want.features)
    for r in from_lxmert:
        assert r.differences(stored[r.image_id]) == ["cls_prob"]  # the 10 fields carry no class distribution


def test_loaded_detector_reproduces_the_store(extracted, world_dir, tmp_path):
    out = tmp_path / "again.h5"
    res = extract(ExtractConfig(world=str(world_dir), out=str(out), detector=str(extracted.detector), float16=True))
    assert not res.trained and res.weights_hash == extracted.weights_hash
    assert not companion_paths(out)["detector"].exists()  # loaded weights are not copied
    with RegionStore(out, upcast=True) as a, RegionStore(extracted.store) as b:
        assert a.dtype == "float16"
        for ra, rb in zip(a.records(), b.records()):
            assert ra.differences(rb, atol=2e-2 * max(1.0, float(rb.features.max()))) == []


# --------------------------------------------------------------------------- CLI and bad input


def test_cli_extract_with_detector(extracted, world_dir, tmp_path):
    out = tmp_path / "cli.h5"
    proc = subprocess.run(
        [str(VLBERTS), "extract", "--world", str(world_dir), "--out", str(out), "--detector", str(extracted.detector),
         "--min-boxes", "36", "--max-boxes", "36", "--order", "butd"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"loaded {extracted.detector} and extracted 120 images")
    with RegionStore(out) as s:
        assert s.info()["boxes_per_image"] == {"min": 36, "mean": 36.0, "max": 36}
        assert (s.metadata.settings["box_policy"], s.metadata.settings["order"]) == ("fixed36", "butd")


def test_cli_extract_trains(world_dir, tmp_path):
    from typer.testing import CliRunner

    from vlberts.cli import app

    out = tmp_path / "small.h5"
    res = CliRunner().invoke(app, ["extract", "--world", str(world_dir), "--out", str(out), "--epochs", "1", "--feature-dim", "16"])
    assert res.exit_code == 0, res.output
    assert res.output.startswith("trained the world detector in ")
    with RegionStore(out) as s:
        assert s.feature_dim == 16
    assert companion_paths(out)["detector"].is_file()
    info = json.loads(companion_paths(out)["detector"].with_suffix(".json").read_text())
    assert info["config"]["feature_dim"] == 16 and info["classes"] == list(read_world_scenes(world_dir).vocab.shapes)


def _copy_world(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def _run_bad(world: Path, out: Path, *extra: str, capsys) -> str:
    """`vlberts extract` in-process through `cli.main` (as the console script runs it) -> its stderr."""
    from vlberts.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["extract", "--world", str(world), "--out", str(out), *extra])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert not out.exists() and leftovers(out.parent) == []
    return err.strip()


def test_bad_input_exits_2_with_one_line_and_no_store(world_dir, extracted, tmp_path, capsys):
    out = tmp_path / "out" / "s.h5"
    out.parent.mkdir()
    # no scenes.jsonl
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _run_bad(empty, out, capsys=capsys) == f"error: {empty / 'scenes.jsonl'}: scenes.jsonl not found " \
        "(is this a world directory? build one with `vlberts world build`)"
    # a malformed line, named by number
    w = _copy_world(world_dir, tmp_path / "w1")
    lines = (world_dir / "scenes.jsonl").read_text().splitlines()
    cut = lines[:4] + [lines[4][: len(lines[4]) // 2]] + lines[5:]
    (w / "scenes.jsonl").write_text("\n".join(cut) + "\n")
    assert _run_bad(w, out, capsys=capsys).startswith(f"error: {w / 'scenes.jsonl'}: record line 5: malformed JSON line")
    # an unknown shape
    bad = list(lines)
    bad[2] = bad[2].replace('"shape":"', '"shape":"blob', 1).replace('"shape": "', '"shape": "blob', 1)
    (w / "scenes.jsonl").write_text("\n".join(bad) + "\n")
    assert "record line 3 (image 3): object 0 shape 'blob" in _run_bad(w, out, capsys=capsys)
    # a missing image file: reported before any training
    w2 = _copy_world(world_dir, tmp_path / "w2")
    world = read_world_scenes(w2)
    im = world.images[7]
    victim = world.image_path(im)
    victim.unlink()
    assert _run_bad(w2, out, capsys=capsys) == f"error: {victim}: record image {im.image_id}: image file not found"
    # a corrupt image found mid-extraction: the half-written store is dropped, an older store survives
    victim.write_bytes(b"not a png")
    err = _run_bad(w2, out, "--detector", str(extracted.detector), capsys=capsys)
    assert err.startswith(f"error: {victim}: record image {im.image_id}: cannot read image")
    from vlberts.cli import main

    out.write_bytes(b"previous store")
    with pytest.raises(SystemExit):
        main(["extract", "--world", str(w2), "--out", str(out), "--detector", str(extracted.detector), "--overwrite"])
    assert "cannot read image" in capsys.readouterr().err
    assert out.read_bytes() == b"previous store" and leftovers(out.parent) == []
    # an existing store without --overwrite is refused up front
    with pytest.raises(SystemExit):
        main(["extract", "--world", str(world_dir), "--out", str(out)])
    assert "already exists (pass --overwrite to replace it)" in capsys.readouterr().err
    assert out.read_bytes() == b"previous store"


def test_a_world_without_its_images_folder_names_the_folder(world_dir, tmp_path, capsys):
    """A world copied without images/ (or with it empty): the line names the folder, not a file beside it
    (it named WORLD/000000000001.png, a path the world never has)."""
    import shutil

    w = tmp_path / "w"
    shutil.copytree(world_dir, w, ignore=shutil.ignore_patterns("images"))
    first = read_world_scenes(world_dir).images[0]
    out = tmp_path / "out" / "s.h5"
    out.parent.mkdir()
    assert _run_bad(w, out, capsys=capsys) == (
        f"error: {w / 'images'}: record image {first.image_id}: images folder not found: scenes.jsonl names "
        f"{first.file_name} in it (nor is it in the world directory)")
    (w / "images").mkdir()
    assert _run_bad(w, out, capsys=capsys) == (
        f"error: {w / 'images'}: record image {first.image_id}: images folder is empty: scenes.jsonl names "
        f"{first.file_name} in it")


def test_a_replaced_store_keeps_no_tsv_of_the_old_one(world_dir, extracted, tmp_path):
    """`extract --overwrite` published the new store, then wrote the TSVs: stopped in between (or run without
    --tsv) it left the old store's TSVs beside a store they do not describe. They now go as the new store
    replaces the old one, and --tsv writes the new ones after."""
    out = tmp_path / "w.h5"
    first = extract(ExtractConfig(world=str(world_dir), out=str(out), tsv=True, detector=str(extracted.detector),
                                  max_boxes=24))
    assert all(p.is_file() for p in first.tsv)
    again = extract(ExtractConfig(world=str(world_dir), out=str(out), detector=str(extracted.detector), max_boxes=12,
                                  overwrite=True))
    assert again.tsv == [] and not any(p.exists() for p in first.tsv)
    assert RegionStore(out).get(RegionStore(out).ids()[0]).num_boxes <= 12
