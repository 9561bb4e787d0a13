"""Representation views (W-VisualBERT §5, Figure 2): t-SNE keeps clusters apart, the cross-modal agreement
is what it says on hand-made vectors, instances are sampled per class, and `vlberts analyze
representations` draws the words, regions and tags of a W-VisualBERT checkpoint."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vlberts.analysis.representations import (
    RepresentationSet, agreement_table, nearest_class_agreement, sample_instances, tsne,
)
from vlberts.errors import VlbertsError
from vlberts.recipes.pretrain import PretrainConfig, pretrain

VLBERTS = Path(sys.executable).with_name("vlberts")


def test_tsne_keeps_separated_clusters_apart_and_is_deterministic():
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 20)) * 10
    x = np.concatenate([c + rng.normal(size=(30, 20)) for c in centres])
    labels = np.repeat(np.arange(3), 30)
    y = tsne(x, perplexity=10, iterations=500, seed=1)
    assert y.shape == (90, 2) and np.isfinite(y).all()
    d = np.linalg.norm(y[:, None] - y[None], axis=-1)
    np.fill_diagonal(d, np.inf)
    nearest5 = np.argsort(d, axis=1)[:, :5]
    assert (labels[nearest5] == labels[:, None]).mean() > 0.98  # each point's neighbours are its cluster's
    assert np.array_equal(y, tsne(x, perplexity=10, iterations=500, seed=1))
    with pytest.raises(ValueError, match="at least 3 points"):
        tsne(x[:2])


def test_nearest_class_agreement_by_hand():
    # words a, b; regions a, b, b. Word 0 (a) is nearest region 0 (a): agrees; word 1 (b) is nearest
    # region 0 (a) too: disagrees. Chance: P(region class = a) = 1/3 for word 0, 2/3 for word 1 -> 1/2.
    reps = RepresentationSet(
        vectors=np.array([[1.0, 0.0], [0.9, 0.1], [1.0, 0.05], [0.0, 1.0], [-1.0, 0.2]]),
        classes=["a", "b", "a", "b", "b"], modalities=["word", "word", "region", "region", "region"],
    )
    assert nearest_class_agreement(reps) == pytest.approx((50.0, 50.0))
    # Regions to words: region 0 (a) is nearest word 0 (a), regions 1 and 2 (b) word 1 (b): all agree;
    # chance 1/2 for each.
    assert nearest_class_agreement(reps, "region", "word") == pytest.approx((100.0, 50.0))
    # Within one kind a row's nearest *other* row counts. Region 0 (a) is nearest region 1 (b, cosine 0.05
    # against -0.97): disagrees; regions 1 and 2 (b) are each other's nearest: agree -> 2/3. Chance among
    # the others: 0/2 for region 0, 1/2 for regions 1 and 2 -> 1/3. The two words are each other's
    # nearest and differ: 0%, and neither has another word of its class: chance 0.
    assert nearest_class_agreement(reps, "region", "region") == pytest.approx((200 / 3, 100 / 3))
    assert nearest_class_agreement(reps, "word", "word") == pytest.approx((0.0, 0.0))
    table = agreement_table(reps)  # every pair of the kinds present, tags absent
    assert list(table) == ["word", "region"] and all(list(row) == ["word", "region"] for row in table.values())
    assert table["region"]["region"] == pytest.approx((200 / 3, 100 / 3))
    assert table["word"]["region"] == pytest.approx((50.0, 50.0))
    with pytest.raises(ValueError, match="no word or no tag"):
        nearest_class_agreement(reps, key="tag")
    with pytest.raises(ValueError, match="one word representation: it has no other"):
        nearest_class_agreement(RepresentationSet(reps.vectors[1:], reps.classes[1:], reps.modalities[1:]), "word", "word")
    with pytest.raises(ValueError, match="unknown modalities"):
        RepresentationSet(np.zeros((1, 2)), ["a"], ["pixel"])


def test_sample_instances_takes_the_most_frequent_classes_and_caps_each():
    classes = ["x"] * 5 + ["y"] * 3 + ["z"] * 1
    keep = sample_instances(classes, per_class=2, n_classes=2, seed=0)
    assert keep == sorted(keep) and len(keep) == 4
    assert sorted(classes[i] for i in keep) == ["x", "x", "y", "y"]


def _draw(tiny_world, tmp_path, arch: str) -> tuple[Path, Path, subprocess.CompletedProcess]:
    """`arch` pre-trained for 2 updates on the tiny world, and `analyze representations` of it: (model, out, run)."""
    model = pretrain(PretrainConfig(
        captions=str(tiny_world.captions_train), features=str(tiny_world.store), out=str(tmp_path / "pt"),
        model=arch, vocab_size=200, steps=2, batch_size=8,
    ))
    out = tmp_path / "rep"
    proc = subprocess.run(
        [str(VLBERTS), "analyze", "representations", f"--model={model}", f"--entities={tiny_world.entities}",
         f"--features={tiny_world.store}", "--split=train", f"--out={out}", "--per_class=10", "--iterations=100"],
        capture_output=True, text=True,
    )
    return model, out, proc


def test_cli_draws_words_regions_and_tags_of_a_wvisualbert(tiny_world, tmp_path):
    model, out, proc = _draw(tiny_world, tmp_path, "wvisualbert-tiny")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "a word's nearest region has its class" in proc.stdout
    assert "  words    -> words " in proc.stdout and "  tags     -> words " in proc.stdout
    rep = json.loads((out / "representations.json").read_text())
    kinds = ["word", "region", "tag"]
    assert list(rep["nearest_same_class"]) == kinds and all(list(r) == kinds for r in rep["nearest_same_class"].values())
    assert rep["nearest_same_class"]["word"]["region"] == {"agreement": rep["word_nearest_region_same_class"],
                                                          "chance": rep["chance"]}
    for row in rep["nearest_same_class"].values():
        assert all(0 <= v["agreement"] <= 100 and 0 <= v["chance"] <= 100 for v in row.values())
    n = rep["instances"]
    assert n >= 10 and rep["points"] == {"word": n, "region": n, "tag": n}
    assert all(c in {"circle", "square", "triangle", "star", "hexagon", "diamond", "cross"} for c in rep["classes"])
    assert 0 <= rep["chance"] <= 100 and len(rep["rows"]) == 3 * n
    assert (out / "representations.png").stat().st_size > 10_000

    # An image the store lacks, listed first: an error naming it, or with --skip_bad dropped and counted.
    ents = tmp_path / "ents"
    shutil.copytree(tiny_world.entities, ents)
    (ents / "train.txt").write_text("424242\n" + (ents / "train.txt").read_text())
    args = [str(VLBERTS), "analyze", "representations", f"--model={model}", f"--entities={ents}",
            f"--features={tiny_world.store}", "--split=train", "--per_class=10", "--iterations=100"]
    proc = subprocess.run([*args, f"--out={tmp_path / 'strict'}"], capture_output=True, text=True)
    assert proc.returncode == 2 and "record 424242: image id 424242 of split train not in store" in proc.stderr
    proc = subprocess.run([*args, f"--out={tmp_path / 'lenient'}", "--skip_bad=true"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lenient = json.loads((tmp_path / "lenient" / "representations.json").read_text())
    assert lenient["bad_records"]["missing features"] == 1 and lenient["instances"] == n

    bad = subprocess.run([str(VLBERTS), "analyze", "representations", f"--model={model}", f"--out={out}"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "needs --entities" in bad.stderr and "Traceback" not in bad.stderr


def test_vilbert_is_drawn_through_its_alignment_poolers(tiny_world, tmp_path):
    """ViLBERT's streams differ in width (tiny: 32 and 24), so its words and regions are drawn in the space its
    alignment prediction multiplies h_CLS and h_IMG in: each word through the text pooler, each region
    through the image pooler (it was an error). A model with such widths and no poolers is one line."""
    from vlberts.models.builders import build_pretraining_model, model_config
    from vlberts.recipes.analyze_representations import pooler_projections

    _, out, proc = _draw(tiny_world, tmp_path, "vilbert-tiny")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("drawn in ViLBERT's alignment poolers (Linear + ReLU into 16-d")
    rep = json.loads((out / "representations.json").read_text())
    assert rep["space"].startswith("ViLBERT's alignment poolers") and list(rep["nearest_same_class"]) == ["word", "region"]
    n = rep["instances"]
    assert n >= 10 and rep["points"] == {"word": n, "region": n}

    vil = build_pretraining_model(model_config("vilbert-tiny", vocab_size=50, visual_dim=16))
    t, v = pooler_projections(vil, "m")
    assert t is vil.bert.t_pooler and v is vil.bert.v_pooler
    bi = vil.cfg.bi_hidden_size
    assert t(torch.randn(2, 5, 32)).shape == (2, 5, bi) and v(torch.randn(2, 7, 24)).shape == (2, 7, bi)
    del vil.bert.t_pooler
    with pytest.raises(VlbertsError, match="text states are 32-d and region states 24-d, and the model has no poolers"):
        pooler_projections(vil, "m")
    same = build_pretraining_model(model_config("lxmert-tiny", vocab_size=50, visual_dim=16))
    assert pooler_projections(same, "m") is None  # one width: the final states themselves
