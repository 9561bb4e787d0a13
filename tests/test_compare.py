"""`vlberts compare` at toy scale: the world and features are built once and shared, every architecture
runs the demo's per-model steps (and GQA with --tasks=vqa,gqa) in its own directory, and the comparison
files hold one row per architecture; a bad architecture or task name is one line and exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_bad_settings import run_cli

VLBERTS = Path(sys.executable).with_name("vlberts")

ROW_KEYS = {
    "arch", "model", "params", "pretrain_seconds", "mlm_visual_word_acc", "mlm_visual_word_acc_regions_zeroed",
    "mlm_direction_word_acc", "mlm_direction_word_acc_regions_zeroed",
    "vqa_accuracy", "vqa_majority_baseline", "grounding_best_head", "grounding_best_head_acc", "grounding_best_layer",
    "grounding_baseline_acc", "num_layers", "grounding_nouns_masked_best_head", "grounding_nouns_masked_best_head_acc",
    "grounding_nouns_masked_best_layer",
}

# task -> (x VQA's learning rate, x its epochs, its batch divided by): NLVR2 and VCR at 0.4x the learning
# rate, RefCOCO+ 5x the epochs at 0.2x, retrieval and VCR count groups of 4 sequences (README, "Comparing").
SCHEDULES = {"gqa": (1.0, 1.0, 1), "nlvr2": (0.4, 1.0, 1), "retrieval": (1.0, 1.0, 4), "refcoco": (0.2, 5.0, 2),
             "vcr": (0.4, 0.5, 4)}

# The demo test's toy settings (tests/test_demo.py): the point is that every step runs, not the numbers.
TOY = ["--images=48", "--pretrain_steps=4", "--pretrain_batch=8", "--vqa_epochs=0.2", "--detector_epochs=1"]
# Every test here trains in compare's own process (--procs=1): a torchrun launch costs 6-7 s of process
# start-up on 2 cores (torchrun and both ranks import torch), 14 launches in the first test. Compare runs its
# steps through the demo's `run_model` and `run_procs`, whose torchrun path tests/test_demo.py runs for
# every architecture (pre-training and VQA) and tests/test_distributed_tasks.py for the other tasks.
IN_PROCESS = ["--procs=1"]


def test_compare_builds_inputs_once_and_writes_one_row_per_arch(tmp_path):
    out = tmp_path / "cmp"
    proc = subprocess.run([str(VLBERTS), "compare", "--quick", "--archs=visualbert,lxmert", "--tasks=vqa,gqa,nlvr2,retrieval,refcoco,vcr",
                           "--out", str(out), *TOY, *IN_PROCESS], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

    # One world and one feature store, at OUT/; the architectures' directories hold none.
    assert (out / "features.h5").is_file() and (out / "world" / "annotations").is_dir()
    assert proc.stderr.count("Built the embedded world") == 1 and proc.stderr.count("trained the world detector") == 1
    for arch in ("visualbert", "lxmert"):
        assert not (out / arch / "world").exists() and not list((out / arch).rglob("*.h5")), arch
        for sub in ("pretrain/model/model.safetensors", "vqa/metrics.json", "gqa/metrics.json", "nlvr2/metrics.json",
                    "retrieval/metrics.json", "refcoco/metrics.json", "vcr/metrics.json", "summary.json", "report.html"):
            assert (out / arch / sub).exists(), f"{arch}/{sub}"

    result = json.loads((out / "results.json").read_text())
    assert list(result["archs"]) == ["visualbert", "lxmert"]
    for arch, row in result["archs"].items():
        assert ROW_KEYS | {"gqa_accuracy", "gqa_majority_baseline"} <= set(row), (arch, ROW_KEYS - set(row))
        gqa = json.loads((out / arch / "gqa" / "metrics.json").read_text())
        assert row["gqa_accuracy"] == gqa["accuracy"] and row["gqa_majority_baseline"] == gqa["majority_baseline"]
        nlvr2 = json.loads((out / arch / "nlvr2" / "metrics.json").read_text())
        assert row["nlvr2_accuracy"] == nlvr2["accuracy"] and row["nlvr2_majority_baseline"] == nlvr2["majority_baseline"]
        ret = json.loads((out / arch / "retrieval" / "metrics.json").read_text())
        assert row["retrieval_text_to_image_r1"] == ret["text_to_image"]["r1"]
        assert row["retrieval_chance_text_to_image_r1"] == ret["chance"]["text_to_image"]["r1"]
        ref = json.loads((out / arch / "refcoco" / "metrics.json").read_text())
        assert row["refcoco_accuracy"] == ref["accuracy"] and row["refcoco_confidence_baseline"] == ref["confidence_baseline"]
        vcr = json.loads((out / arch / "vcr" / "metrics.json").read_text())
        assert vcr["mode"] == "qa" and row["vcr_q2a"] == vcr["q2a"] and row["vcr_chance"] == 25.0
        assert row["arch"] == arch and row["model"] == f"{arch}-small" and row["params"] > 0
        # Each task ran on VQA's schedule scaled as TASK_SCHEDULES says (x learning rate, x epochs, / batch).
        vqa_run = json.loads((out / arch / "vqa" / "run_config.json").read_text())
        for task, (lr_x, epochs_x, batch_div) in SCHEDULES.items():
            run = json.loads((out / arch / task / "run_config.json").read_text())
            assert run["lr"] == pytest.approx(vqa_run["lr"] * lr_x), (arch, task)
            assert run["epochs"] == pytest.approx(vqa_run["epochs"] * epochs_x), (arch, task)
            assert run["batch_size"] == max(1, vqa_run["batch_size"] // batch_div), (arch, task)
        assert json.loads((out / arch / "retrieval" / "run_config.json").read_text())["eval_images"] == 100
    # Identical settings: both pre-trained for the same updates on the same world.
    summaries = [json.loads((out / a / "summary.json").read_text()) for a in ("visualbert", "lxmert")]
    for key in ("seed", "images", "pretrain_steps", "shape_mask_prob", "colour_mask_prob"):
        assert summaries[0][key] == summaries[1][key], key
    assert summaries[0]["images"] == 48 and result["settings"]["pretrain_steps"] == 4
    assert result["archs"]["visualbert"]["params"] != result["archs"]["lxmert"]["params"]

    md = (out / "results.md").read_text().strip().splitlines()
    assert md[0].startswith("| arch | params |") and len(md) == 2 + 2
    assert ("| GQA / majority | NLVR2 / majority | retrieval R@1 / chance | RefCOCO+ val / top-confidence "
            "| VCR Q->A val / chance |") in md[0] and md[0].endswith("| the same, nouns masked (not a check) |")
    assert [line.split("|")[1].strip() for line in md[2:]] == ["visualbert", "lxmert"]
    assert "| visualbert |" in proc.stdout and "| lxmert |" in proc.stdout  # the table is printed


def test_compare_rejects_an_unknown_arch_in_one_line(tmp_path, capsys):
    out = tmp_path / "cmp"
    code, _, err = run_cli(["compare", "--archs=visualbert,vilbrt", "--out", str(out)], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "unknown architecture 'vilbrt'" in lines[0] and "lxmert" in lines[0]
    assert not out.exists()  # nothing was built

    code, _, err = run_cli(["compare", "--tasks=vqa,nlvr3", "--out", str(out)], capsys)
    assert code == 2 and "unknown task 'nlvr3' in --tasks; valid: vqa, gqa" in err
    assert not out.exists()

    code, _, err = run_cli(["compare", "--seeds=0,x", "--out", str(out)], capsys)
    assert code == 2 and "--seeds must be a count or comma-separated integers, got '0,x'" in err
    assert not out.exists()


def test_compare_over_seeds_reports_mean_and_std(tmp_path):
    out = tmp_path / "cmp"
    proc = subprocess.run([str(VLBERTS), "compare", "--quick", "--archs=visualbert", "--seeds=2", "--out", str(out),
                           *TOY, *IN_PROCESS], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((out / "results.json").read_text())
    assert result["settings"]["seeds"] == "0,1"  # --seeds=2 from --seed=0
    row = result["archs"]["visualbert"]
    runs = row["runs"]
    assert [r["seed"] for r in runs] == row["seed"] == [0, 1]
    for r, seed in zip(runs, (0, 1)):  # each seed's run in its own directory, with that seed
        summary = json.loads((out / "visualbert" / f"seed-{seed}" / "summary.json").read_text())
        assert summary["seed"] == seed and r["vqa_accuracy"] == summary["vqa_accuracy"]
    vqa = np.array([r["vqa_accuracy"] for r in runs])
    assert row["vqa_accuracy"] == round(vqa.mean(), 2) and row["vqa_accuracy_std"] == round(vqa.std(), 2)
    assert row["grounding_best_head"] == ",".join(r["grounding_best_head"] for r in runs)
    assert row["grounding_nouns_masked_best_layer"] == [r["grounding_nouns_masked_best_layer"] for r in runs]
    md = (out / "results.md").read_text()
    assert f"{row['vqa_accuracy']:.2f} ± {row['vqa_accuracy_std']:.2f}" in md
    assert f"| {row['pretrain_seconds']:.1f} ± {row['pretrain_seconds_std']:.1f} |" in md  # training time too


def test_compare_continues_with_more_tasks_and_refuses_other_settings(tmp_path):
    out = tmp_path / "cmp"
    base = [str(VLBERTS), "compare", "--quick", "--out", str(out), *TOY, *IN_PROCESS]
    proc = subprocess.run([*base, "--archs=visualbert"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    first = json.loads((out / "results.json").read_text())["archs"]["visualbert"]
    model_mtime = (out / "visualbert/pretrain/model/model.safetensors").stat().st_mtime_ns

    # --resume=true adds a task and an architecture to the finished comparison: nothing it holds is redone.
    proc = subprocess.run([*base, "--archs=visualbert,lxmert", "--tasks=vqa,gqa", "--resume=true"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "Built the embedded world" not in proc.stderr and "trained the world detector" not in proc.stderr
    assert "kept the pre-trained visualbert-small" in proc.stderr and "kept the VQA fine-tuning" in proc.stderr
    assert (out / "visualbert/pretrain/model/model.safetensors").stat().st_mtime_ns == model_mtime
    rows = json.loads((out / "results.json").read_text())["archs"]
    assert list(rows) == ["visualbert", "lxmert"]
    assert rows["visualbert"]["vqa_accuracy"] == first["vqa_accuracy"]
    assert rows["visualbert"]["pretrain_seconds"] == first["pretrain_seconds"]  # the kept step's own seconds
    for arch in rows:
        gqa = json.loads((out / arch / "gqa" / "metrics.json").read_text())
        assert rows[arch]["gqa_accuracy"] == gqa["accuracy"]

    # Other settings: one line naming the difference, and the comparison is left as it was.
    proc = subprocess.run([*base, "--archs=visualbert", "--resume=true", "--pretrain_lr=0.002"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "other settings (pretrain_lr 0.001 -> 0.002)" in proc.stderr
    assert (out / "lxmert" / "gqa" / "metrics.json").is_file()


def test_seeds_is_a_count_or_a_list_and_both_record_the_same_run():
    from vlberts.errors import VlbertsError
    from vlberts.recipes.compare import CompareConfig, compare_settings, seed_list

    assert seed_list(CompareConfig()) == [0]
    assert seed_list(CompareConfig(seeds="3")) == [0, 1, 2]  # issue 3's `--seeds K`: K seeds from --seed
    assert seed_list(CompareConfig(seed=5, seeds="2")) == [5, 6]
    assert seed_list(CompareConfig(seeds="4,1")) == [4, 1]
    assert seed_list(CompareConfig(seeds="7,")) == [7]  # a comma makes it a list
    # an interrupted --seeds=3 continues under --seeds=0,1,2 (the recorded settings are equal), not 0,1
    assert compare_settings(CompareConfig(seeds="3")) == compare_settings(CompareConfig(seeds="0,1,2"))
    assert compare_settings(CompareConfig(seeds="3"))["seeds"] == "0,1,2"
    assert compare_settings(CompareConfig(seeds="2")) != compare_settings(CompareConfig(seeds="0,1,2"))
    # one seed, --seed's, is recorded as no --seeds at all (so older single-seed comparisons continue)
    assert compare_settings(CompareConfig(seeds="1"))["seeds"] == compare_settings(CompareConfig())["seeds"] == ""
    assert compare_settings(CompareConfig(seed=3, seeds="3,"))["seeds"] == ""
    assert compare_settings(CompareConfig(seeds="5,"))["seeds"] == "5"
    for bad, message in (("0", "--seeds=K needs K >= 1 seeds, got '0'"), ("1,1", "--seeds names '1' twice: '1,1'"),
                         ("1,,2", "--seeds has an empty item: '1,,2'"),  # it ran seeds 1 and 2
                         ("two", "--seeds must be a count or comma-separated integers, got 'two'")):
        with pytest.raises(VlbertsError, match=message):
            seed_list(CompareConfig(seeds=bad))
    # the architectures and tasks alike (an empty item ran the others without a word)
    from vlberts.recipes.compare import arch_list, task_list

    assert arch_list(CompareConfig(archs="visualbert, lxmert")) == ["visualbert", "lxmert"]
    for cfg, message in ((CompareConfig(archs="visualbert,,lxmert"), "--archs has an empty item"),
                         (CompareConfig(archs="lxmert,lxmert"), "--archs names 'lxmert' twice"),
                         (CompareConfig(tasks="vqa,gqa,gqa"), "--tasks names 'gqa' twice")):
        with pytest.raises(VlbertsError, match=message):
            arch_list(cfg) if cfg.archs != CompareConfig().archs else task_list(cfg)
