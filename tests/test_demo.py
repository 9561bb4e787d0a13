"""`vlberts demo` end to end at toy scale: every step runs, summary.json holds the issue's keys, the
report is self-contained HTML, an interrupted demo continues, and an earlier demo directory is replaced while a
foreign one is not."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_bad_settings import run_cli

VLBERTS = Path(sys.executable).with_name("vlberts")

KEYS = {
    "mlm_visual_word_acc", "mlm_visual_word_acc_regions_zeroed", "vqa_accuracy", "vqa_majority_baseline",
    "grounding_best_head_acc", "grounding_baseline_acc", "grounding_best_layer", "num_layers", "seconds",
    "mlm_direction_word_acc", "mlm_direction_word_acc_regions_zeroed", "mlm_direction_word_n",
    "grounding_nouns_masked_best_head_acc", "grounding_nouns_masked_best_head", "grounding_nouns_masked_best_layer",
}

# Toy settings on top of --quick: the point is that every step runs and reports, not the numbers.
TOY = ["--images=48", "--pretrain_steps=4", "--pretrain_batch=8", "--vqa_epochs=0.2", "--model=visualbert-tiny",
       "--detector_epochs=1"]


def test_demo_runs_every_step_and_writes_summary_and_report(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run([str(VLBERTS), "demo", "--quick", "--out", str(out), *TOY], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert KEYS <= set(summary)
    assert summary["num_layers"] == 2 and 1 <= summary["grounding_best_layer"] <= 2
    assert summary["images"] == 48 and summary["quick"] is True
    # VisualBERT's own demo settings (ARCH_DEMO), with the value in use (TOY gives --vqa_epochs).
    assert summary["arch_settings"] == {"pretrain_lr": 0.0015, "shape_mask_prob": 0.9, "vqa_epochs": 0.2, "vqa_batch": 32}
    assert "circle=0.9" in (out / "pretrain_config.yaml").read_text()
    assert "batch_size: 32" in (out / "vqa_config.yaml").read_text()
    assert "lr: 0.0015" in (out / "pretrain_config.yaml").read_text()
    for step in ("world", "features", "pretrain", "probe", "vqa", "grounding", "grounding_nouns_masked"):
        assert step in summary["timings"]
    html = (out / "report.html").read_text()
    assert html.startswith("<!doctype html>") and "data:image/png;base64," in html
    assert "<h1>vlberts demo: VisualBERT on the embedded world</h1>" in html
    assert "http://" not in html and "https://" not in html  # self-contained
    by_word = json.loads((out / "grounding/grounding.json").read_text())["by_last_word"]
    assert "By the phrase's last word" in html and f"<tr><td>{by_word[0]['group']}</td><td>{by_word[0]['n']}</td>" in html
    assert "entity grounding" in proc.stdout and "report:" in proc.stdout
    # The direction-word probe counts every left/right/above/below of the test captions.
    test_caps = json.loads((out / "world/annotations/captions_test.json").read_text())["annotations"]
    n_dir = sum(w in ("left", "right", "above", "below") for c in test_caps for w in c["caption"].split())
    assert summary["mlm_direction_word_n"] == n_dir > 0
    assert "masked direction words" in proc.stdout and "masked direction words" in html
    # The second reading of the same heads, every NOUN of the parses masked, is the one its directory holds.
    nouns = json.loads((out / "grounding-nouns-masked/grounding.json").read_text())
    assert nouns["mask_pos"] == ["NOUN"] and "NOUN" in nouns["mask_note"]
    assert summary["grounding_nouns_masked_best_head"] == nouns["best_head"]["label"]
    assert summary["grounding_nouns_masked_best_head_acc"] == round(100 * nouns["best_head"]["accuracy"], 2)
    assert "grounding, nouns masked" in proc.stdout and "with every noun masked" in html
    for sub in ("world/annotations/captions_train.json", "features.h5", "pretrain/model/model.safetensors",
                "vqa/predictions.json", "grounding/entity_grounding.png"):
        assert (out / sub).exists(), sub

    # The default vocabulary is trained on the captions; it has no "?" (README, "The world's vocabulary").
    assert "?" not in (out / "pretrain/model/vocab.txt").read_text().split("\n")

    # Interrupted after pre-training's second-last checkpoint, before its model and VQA's metrics were
    # written: the same command continues. It keeps the world and features, pre-trains the last update
    # again from the checkpoint (the same weights, byte for byte) and fine-tunes VQA again (the same score).
    model = (out / "pretrain/model/model.safetensors").read_bytes()
    features_mtime = (out / "features.h5").stat().st_mtime_ns
    for sub in ("pretrain/model", "vqa/metrics.json", "summary.json"):
        shutil.rmtree(out / sub) if (out / sub).is_dir() else (out / sub).unlink()
    checkpoints = sorted(p.name for p in (out / "pretrain/checkpoints").glob("step_*"))
    (out / "pretrain/checkpoints/latest").write_text(checkpoints[-2])
    proc = subprocess.run([str(VLBERTS), "demo", "--quick", "--out", str(out), *TOY], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "kept the world and its region features" in proc.stderr and "Built the embedded world" not in proc.stderr
    step = int(checkpoints[-2].removeprefix("step_"))  # and says where the pre-training went on from
    assert f"for updates {step + 1}-" in proc.stderr and "continued from its checkpoint" in proc.stderr, proc.stderr
    assert (out / "features.h5").stat().st_mtime_ns == features_mtime
    assert (out / "pretrain/model/model.safetensors").read_bytes() == model
    resumed = json.loads((out / "summary.json").read_text())
    assert resumed["vqa_accuracy"] == summary["vqa_accuracy"] and resumed["timings"]["world"] == summary["timings"]["world"]
    # --resume=true keeps every finished step; with other settings it refuses in one line.
    proc = subprocess.run([str(VLBERTS), "demo", "--quick", "--out", str(out), *TOY, "--resume=true"],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and "kept the VQA fine-tuning" in proc.stderr, proc.stderr
    proc = subprocess.run([str(VLBERTS), "demo", "--quick", "--out", str(out), *TOY, "--resume=true", "--seed=1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "other settings (seed 0 -> 1)" in proc.stderr and (out / "summary.json").is_file()

    # Running again replaces the earlier demo; --vocab=world pre-trains with the world's vocabulary.
    # (In this process: the replacing run's own torchrun launches would add 13 s and test nothing new.)
    proc = subprocess.run([str(VLBERTS), "demo", "--quick", "--out", str(out), *TOY, "--seed=1", "--vocab=world",
                           "--procs=1"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((out / "summary.json").read_text())["seed"] == 1
    assert (out / "pretrain/model/vocab.txt").read_text() == (out / "world/vocab/vocab.txt").read_text()


def test_demo_refuses_a_directory_it_did_not_make(tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "thesis.tex").write_text("precious")
    code, _, err = run_cli(["demo", "--quick", "--out", str(out)], capsys)
    assert code == 2
    assert "was not made by `vlberts demo`" in err and "Traceback" not in err
    assert (out / "thesis.tex").read_text() == "precious"
    code, _, err = run_cli(["demo", "--quick", "--out", str(tmp_path / "v"), "--vocab=bert"], capsys)
    assert code == 2 and "Traceback" not in err
    assert "unknown vocabulary 'bert'; valid: captions, world" in err and not (tmp_path / "v").exists()


# The architectures whose demo trains in 2 torchrun processes here, as `vlberts demo` does by default: the
# two with the most heads and losses (LXMERT's five, W-VisualBERT's alternating text-only and image-only
# batches), where a rank's batch leaves parameters without a gradient. The others train in the demo's own
# process (--procs=1): each torchrun launch costs 6-7 s of process start-up on 2 cores, two per demo.
TORCHRUN_ARCHS = ("lxmert", "wvisualbert")


@pytest.mark.parametrize("arch", ["vilbert", "vlbert", "lxmert", "wvisualbert"])
def test_demo_runs_every_architecture_with_the_same_summary(tmp_path, arch):
    out = tmp_path / arch
    toy = [a for a in TOY if not a.startswith("--model=")] + ([] if arch in TORCHRUN_ARCHS else ["--procs=1"])
    proc = subprocess.run([str(VLBERTS), "demo", "--quick", "--out", str(out), *toy, f"--arch={arch}"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (out / "pretrain.log").is_file() == (out / "vqa.log").is_file() == (arch in TORCHRUN_ARCHS)
    summary = json.loads((out / "summary.json").read_text())
    assert KEYS <= set(summary)
    assert summary["arch"] == arch and summary["model"] == f"{arch}-small"
    title = {"vilbert": "ViLBERT", "vlbert": "VL-BERT", "lxmert": "LXMERT", "wvisualbert": "W-VisualBERT"}[arch]
    assert f"<h1>vlberts demo: {title} on the embedded world</h1>" in (out / "report.html").read_text()
    maps = json.loads((out / "grounding" / "grounding.json").read_text())["attention_maps"]
    assert ("text-to-vision" in maps) == (arch in ("vilbert", "lxmert")), maps  # two-stream: cross-attention
    # An architecture's own demo settings (ARCH_DEMO) reach its runs and are printed; --pretrain_steps given wins.
    own = {"lxmert": {"pretrain_steps": 4, "mismatched_targets": "drop", "qa_loss": "kl"},
           "vilbert": {"pretrain_steps": 4}, "vlbert": {"pretrain_steps": 4}, "wvisualbert": {"vqa_epochs": 0.2, "vqa_batch": 32}}[arch]
    assert summary["arch_settings"] == own
    if own:
        assert f"{arch}'s demo settings: " + " ".join(f"--{k}={v}" for k, v in own.items()) in proc.stdout
    assert ("demo settings, in place of the shared defaults" in (out / "report.html").read_text()) == bool(own)
    pre, vqa = (json.loads((out / step / "run_config.json").read_text()) for step in ("pretrain", "vqa"))
    assert (pre["mismatched_targets"] == "drop" and vqa["loss"] == "kl") == (arch == "lxmert"), (pre, vqa)
    assert vqa["batch_size"] == (32 if arch == "wvisualbert" else 64), vqa  # W-VisualBERT §4.1's batch


def test_an_architectures_demo_settings_apply_unless_given_and_never_in_compare():
    from vlberts.recipes.compare import CompareConfig
    from vlberts.recipes.demo import DemoConfig, resolve

    lx = resolve(DemoConfig(arch="lxmert"))
    assert (lx.pretrain_steps, lx.mismatched_targets, lx.qa_loss) == (8000, "drop", "kl")
    assert resolve(DemoConfig(model="lxmert-tiny")).mismatched_targets == "drop"  # --model's architecture
    given = resolve(DemoConfig(arch="lxmert", qa_loss="bce", pretrain_steps=4000), explicit={"qa_loss", "pretrain_steps"})
    assert (given.pretrain_steps, given.mismatched_targets, given.qa_loss) == (4000, "drop", "bce")
    assert resolve(DemoConfig(arch="vilbert", quick=True)).pretrain_steps == 60  # --quick stays quick
    assert resolve(DemoConfig(arch="vilbert")).pretrain_steps == resolve(DemoConfig(arch="vlbert")).pretrain_steps == 12000
    assert resolve(DemoConfig(arch="wvisualbert")) == DemoConfig(arch="wvisualbert", vqa_epochs=8.0, vqa_batch=32)  # §4.1
    # `make demo`: VisualBERT with the shared defaults but its peak pre-training rate, its shape-word masking and
    # 2 VQA epochs at batch 32; given, the rate wins.
    assert resolve(DemoConfig()) == DemoConfig(pretrain_lr=1.5e-3, shape_mask_prob=0.9, vqa_epochs=2.0, vqa_batch=32)
    assert resolve(DemoConfig(pretrain_lr=1e-3), explicit={"pretrain_lr"}).pretrain_lr == 1e-3
    assert resolve(CompareConfig()) == CompareConfig()  # one schedule for every architecture


def test_the_four_checks_at_their_boundaries():
    """The demo's [ok] lines (`html_report.phenomena`, printed and in report.html) on summaries made by hand:
    each check holds at its threshold and fails just below it; the best layer must be above the middle."""
    from vlberts.analysis.html_report import phenomena

    def checks(**kw) -> list[bool]:
        s = dict(mlm_visual_word_acc=45.0, mlm_visual_word_acc_regions_zeroed=20.0, vqa_accuracy=60.0,
                 vqa_majority_baseline=30.0, grounding_best_head_acc=50.0, grounding_baseline_acc=25.0,
                 grounding_best_layer=4, num_layers=6)
        return [ok for _, ok in phenomena({**s, **kw})]

    assert checks() == [True, True, True, True]  # every one exactly at its threshold: 25 points, 2x, 2x, layer 4 of 6
    assert checks(mlm_visual_word_acc=44.99) == [False, True, True, True]
    assert checks(vqa_accuracy=59.99) == [True, False, True, True]
    assert checks(grounding_best_head_acc=49.99) == [True, True, False, True]
    assert checks(grounding_best_layer=3) == [True, True, True, False]  # layer 3 of 6: the lower half
    assert checks(grounding_best_layer=3, num_layers=5)[3] and not checks(grounding_best_layer=2, num_layers=5)[3]
    assert checks(grounding_best_layer=2, num_layers=2)[3] and not checks(grounding_best_layer=1, num_layers=2)[3]


def test_a_replacement_stopped_half_way_leaves_a_directory_the_next_run_replaces(tmp_path, monkeypatch):
    """`prepare_out` removed an earlier demo's OUT with one rmtree, its marker among the first files: Ctrl-C
    in a large OUT left a directory every later run refused ("was not made by `vlberts demo`"). The marker
    now goes last."""
    from vlberts.recipes import demo

    out = tmp_path / "out"
    demo.prepare_out(out, {"command": "demo", "seed": 0})
    for name in ("a", "b", "c"):
        (out / name).mkdir()
        (out / name / "f.txt").write_text("x")
    rmtree, calls = shutil.rmtree, []

    def interrupted(path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return rmtree(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        demo.prepare_out(out, {"command": "demo", "seed": 1})
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    assert (out / demo.MARKER).is_file()
    assert demo.prepare_out(out, {"command": "demo", "seed": 1}) is False
    assert sorted(p.name for p in out.iterdir()) == sorted([demo.MARKER, demo.SETTINGS])
