"""Feature identity (SPEC §9.1): a store says which extractor, weights and settings made its features;
pre-training records it in the model, and fine-tuning and the grounding analysis warn, in one line, when
given features made otherwise. Stores are re-extracted from the tiny world with its own detector."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import pytest

from vlberts.data.pretrain_stream import ShardCorpus
from vlberts.data.shards import write_shards
from vlberts.features.identity import BOX_SELECTION, describe_identity, feature_identity, feature_mismatch, identity_difference
from vlberts.features.importers import export_tsv, import_features
from vlberts.features.store import RegionStore
from vlberts.recipes.analyze_grounding import GroundingConfig, analyze_grounding
from vlberts.recipes.extract import ExtractConfig, companion_paths, extract
from vlberts.recipes.finetune_loop import check_features
from vlberts.recipes.finetune_vqa import FinetuneVQAConfig, finetune_vqa

from conftest import random_init_dir


@pytest.fixture(scope="module")
def stores(tiny_world, tmp_path_factory):
    """The tiny world's store re-extracted with its detector: with the same settings, keeping at most 20
    boxes an image (instead of 36), and of the gold object boxes (RefCOCO+'s ground-truth regions)."""
    out = tmp_path_factory.mktemp("identity")
    detector = str(companion_paths(tiny_world.store)["detector"])
    kinds = {"same": {}, "fewer": {"max_boxes": 20}, "gold": {"boxes": "gold"}}
    for name, kw in kinds.items():
        extract(ExtractConfig(world=str(tiny_world.root), out=str(out / f"{name}.h5"), detector=detector, **kw))
    return {name: out / f"{name}.h5" for name in kinds}


def identity(path: Path) -> dict:
    with RegionStore(path) as store:
        return feature_identity(store)


def with_metadata(src: Path, dst: Path, **changes) -> Path:
    """A copy of a store whose metadata says otherwise (the same features, another stated origin)."""
    shutil.copy(src, dst)
    with h5py.File(dst, "r+") as f:
        f.attrs["metadata"] = json.dumps({**json.loads(f.attrs["metadata"]), **changes})
    return dst


def warnings_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("warning:")]


def test_identity_holds_what_made_the_features_and_not_the_run(tiny_world, stores):
    ident = identity(tiny_world.store)
    with RegionStore(tiny_world.store) as store:
        sha = store.metadata.weights_hash
        all_settings = store.metadata.settings
    assert set(ident) == {"extractor", "weights_sha256", "feature_dim", "settings"}  # extracted, not imported
    assert (ident["extractor"], ident["weights_sha256"], ident["feature_dim"]) == ("vlberts-world-detector", sha, 128)
    assert ident["settings"]["max_boxes"] == 36 and ident["settings"]["proposals"]["seed"] == 0
    # The detector's training report and file name and the val accuracies are in the store, not the identity.
    assert {"detector", "val"} <= set(all_settings) and not {"detector", "val"} & set(ident["settings"])
    assert json.loads(json.dumps(ident)) == ident
    assert describe_identity(ident) == f"extractor vlberts-world-detector (weights sha256 {sha[:12]})"
    # Re-extracted with the same detector (now named by --detector) and settings: the same identity.
    assert identity(stores["same"]) == ident
    assert identity_difference(identity(stores["same"]), ident) is None


def test_other_settings_or_weights_differ_and_the_line_names_the_difference(tiny_world, stores, tmp_path):
    ident = identity(tiny_world.store)
    sha = ident["weights_sha256"]
    assert identity_difference(identity(stores["fewer"]), ident) == "box_policy 10-20 vs 10-36, max_boxes 20 vs 36"
    other = with_metadata(tiny_world.store, tmp_path / "w.h5", weights_hash="0" * 64)
    assert identity_difference(identity(other), ident) == f"weights sha256 000000000000 vs {sha[:12]}"
    renamed = with_metadata(tiny_world.store, tmp_path / "x.h5", extractor="butd-caffe", weights_hash=None)
    assert identity_difference(identity(renamed), ident) == f"extractor butd-caffe vs vlberts-world-detector, " \
                                                            f"weights sha256 none vs {sha[:12]}"
    # The gold boxes differ in their choice only, which RefCOCO+'s gt track leaves out of the comparison.
    assert identity_difference(identity(stores["gold"]), ident) == "box_policy gold vs 10-36"
    assert identity_difference(identity(stores["gold"]), ident, ignore=BOX_SELECTION) is None
    assert identity_difference(identity(stores["fewer"]), ident, ignore=BOX_SELECTION) is None
    assert identity_difference(identity(other), ident, ignore=BOX_SELECTION) is not None
    # A store's source (world path, image count, splits) is not part of it.
    moved = with_metadata(tiny_world.store, tmp_path / "m.h5", source={"world": "/elsewhere", "images": 3})
    assert identity(moved) == ident


def test_imported_files_of_one_format_agree_and_differ_from_extracted_features(tiny_world, tmp_path):
    """Two files of one extractor (a train and a val TSV) import to one identity; against the world
    detector's store every differing field is counted, only the first few named."""
    tsv = tmp_path / "all.tsv"
    export_tsv(tiny_world.store, tsv, "lxmert-tsv")
    lines = tsv.read_text().splitlines(keepends=True)
    (tmp_path / "a.tsv").write_text("".join(lines[:30]))
    (tmp_path / "b.tsv").write_text("".join(lines[30:]))
    a = identity(import_features(tmp_path / "a.tsv", "lxmert-tsv", tmp_path / "a.h5"))
    b = identity(import_features(tmp_path / "b.tsv", "lxmert-tsv", tmp_path / "b.h5"))
    assert a == b == {"extractor": "unknown", "weights_sha256": None, "feature_dim": 128, "settings": {},
                      "imported_from": "lxmert-tsv"}
    assert describe_identity(a) == "extractor unknown (imported from lxmert-tsv)"
    world = identity(tiny_world.store)
    n_settings = len([k for k, v in world["settings"].items() if not isinstance(v, dict)]) \
        + sum(len(v) for v in world["settings"].values() if isinstance(v, dict))
    assert identity_difference(a, world) == (
        f"extractor unknown vs vlberts-world-detector, weights sha256 none vs {world['weights_sha256'][:12]}, "
        f"box_policy none vs 10-36, conf_thresh none vs 0.2 and {n_settings - 2} more settings")


def test_pretrain_records_the_identity_of_its_store_and_of_shards(tiny_world, tiny_pretrained, tmp_path):
    recorded = json.loads((tiny_pretrained / "config.json").read_text())["features"]
    assert recorded == identity(tiny_world.store)
    # Streamed pre-training records the identity of the shard index's corpus: the store's, carried over.
    index = write_shards(tiny_world.store, tiny_world.captions_train, tmp_path / "shards", shard_size=20)
    assert feature_identity(ShardCorpus(index)) == recorded


def vqa_cfg(world, init: Path, features: Path, out: Path) -> FinetuneVQAConfig:
    tq, ta = world.vqa("train")
    return FinetuneVQAConfig(init=str(init), out=str(out), features=str(features), train_questions=str(tq),
                             train_annotations=str(ta), min_answer_count=2, epochs=0.25, batch_size=16, ckpt_every=100)


def test_finetuning_on_other_features_warns_once_and_records_it(tiny_world, tiny_pretrained, stores, tmp_path, capsys):
    fewer = stores["fewer"]
    out = tmp_path / "vqa"
    final = finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, fewer, out))
    sha = identity(tiny_world.store)["weights_sha256"][:12]
    line = (f"{fewer}: features from extractor vlberts-world-detector (weights sha256 {sha}) but {tiny_pretrained} "
            f"was trained on features from extractor vlberts-world-detector (weights sha256 {sha}): "
            "box_policy 10-20 vs 10-36, max_boxes 20 vs 36")
    assert warnings_of(capsys.readouterr().err) == [f"warning: {line}"]
    assert json.loads((out / "metrics.json").read_text())["feature_mismatch"] == line
    # The fine-tuned model records the features it was fine-tuned on, so it can be compared in turn.
    assert json.loads((final / "config.json").read_text())["features"] == identity(fewer)
    with RegionStore(tiny_world.store) as store:
        assert feature_mismatch(store, final).endswith("box_policy 10-36 vs 10-20, max_boxes 36 vs 20")
    # `vlberts predict` with that model on other features says so too (it answered without a word)
    from vlberts.recipes.predict_qa import PredictQAConfig, predict_file

    questions, _ = tiny_world.vqa("test")
    predict_file(PredictQAConfig(model=str(final), questions=str(questions), features=str(tiny_world.store),
                                 out=str(tmp_path / "p"), device="cpu"), "vqa")
    again = (f"{tiny_world.store}: features from extractor vlberts-world-detector (weights sha256 {sha}) but {final} "
             f"was trained on features from extractor vlberts-world-detector (weights sha256 {sha}): "
             "box_policy 10-36 vs 10-20, max_boxes 36 vs 20")
    assert warnings_of(capsys.readouterr().err) == [f"warning: {again}"]
    assert json.loads((tmp_path / "p" / "predict.json").read_text())["feature_mismatch"] == again
    # and `vlberts analyze grounding` keeps it in grounding.json and grounding.md (it only printed it)
    from vlberts.recipes.analyze_grounding import GroundingConfig, analyze_grounding

    analyze_grounding(GroundingConfig(model=str(final), entities=str(tiny_world.root / "flickr30k_entities"),
                                      features=str(tiny_world.store), split="val", out=str(tmp_path / "g"),
                                      device="cpu", explorer_examples=0, qualitative=0, parses="none"))
    assert warnings_of(capsys.readouterr().err) == [f"warning: {again}"]
    assert json.loads((tmp_path / "g" / "grounding.json").read_text())["feature_mismatch"] == again
    assert f"Features: {again}" in (tmp_path / "g" / "grounding.md").read_text().replace("\\", "")


def test_finetuning_on_the_same_features_or_from_a_model_without_a_record_is_quiet(tiny_world, tiny_pretrained,
                                                                                   stores, tmp_path, capsys):
    out = tmp_path / "vqa"
    final = finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, stores["same"], out))  # re-extracted alike
    assert warnings_of(capsys.readouterr().err) == []
    assert "feature_mismatch" not in json.loads((out / "metrics.json").read_text())
    assert json.loads((final / "config.json").read_text())["features"] == identity(tiny_world.store)
    # A model that records no identity (older models, imported checkpoints): nothing to compare with.
    bare = random_init_dir("visualbert-tiny", tiny_pretrained, tmp_path / "bare")
    with RegionStore(stores["fewer"]) as store:
        assert check_features(store, bare) == (identity(stores["fewer"]), {})
    assert warnings_of(capsys.readouterr().err) == []


def test_grounding_analysis_warns_on_other_features(tiny_world, tiny_pretrained, stores, tmp_path, capsys):
    analyze_grounding(GroundingConfig(model=str(tiny_pretrained), entities=str(tiny_world.entities),
                                      features=str(stores["fewer"]), split="test", out=str(tmp_path / "g"),
                                      explorer_examples=0, qualitative=0))
    (warning,) = warnings_of(capsys.readouterr().err)
    assert warning.startswith(f"warning: {stores['fewer']}: features from ") and str(tiny_pretrained) in warning
    assert warning.endswith(": box_policy 10-20 vs 10-36, max_boxes 20 vs 36")
