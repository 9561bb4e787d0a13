"""Recipe: a controlled comparison of the architectures (`vlberts compare`).

    1. world + features  built ONCE, exactly as the demo builds them      OUT/world/, OUT/features.h5
    2. per architecture  the demo's steps 3-7 (pretrain -> probe -> VQA   OUT/ARCH/ (pretrain/, vqa/,
                         -> grounding -> summary) with the same settings   grounding/, summary.json, report.html)
    + with --tasks=vqa,gqa, GQA fine-tuning from the same checkpoint          OUT/ARCH/gqa/
    + with --seeds=0,1,2, step 2 once per seed (pre-training, fine-tuning;     OUT/ARCH/seed-S/
      the world and features stay those of --seed), reported as mean and std
    3. comparison        the headline numbers side by side                 OUT/comparison.json, OUT/comparison.md

What each paper argues about (one stream or two, which objectives help) only shows when everything else
is held fixed: every architecture reads the same world, the same region features and the same schedule
(seed, pre-training steps, batch, learning rate, word-masking probabilities, VQA epochs). What differs
is the architecture and the objectives its paper pre-trains with (objectives/recipe.py); each is trained
as its laptop-scale configuration `ARCH-small`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vlberts.config import apply_overrides, from_dict
from vlberts.errors import VlbertsError
from vlberts.io import read_json, write_json
from vlberts.models.builders import ARCHS
from vlberts.recipes.common import opt, set_threads
from vlberts.recipes.demo import DemoConfig, build_inputs, prepare_out, run_model, run_procs
from vlberts.recipes.finetune_gqa import FinetuneGQAConfig, finetune_gqa
from vlberts.training.checkpoint import load_pretraining_model


@dataclass(frozen=True)
class CompareConfig(DemoConfig):
    """The demo's settings, shared by every architecture, and which architectures to run."""

    out: str = opt("runs/compare", "output directory: OUT/world and OUT/features.h5 once, OUT/ARCH/ per architecture "
                   "(replaced if it holds an earlier demo or compare)")
    arch: str = opt("", "not used by compare: --archs lists the architectures")
    model: str = opt("", "not used by compare: each architecture trains its ARCH-small")
    archs: str = opt(",".join(ARCHS), "comma-separated architectures, each pre-trained with its paper's objectives")
    tasks: str = opt("vqa", "downstream tasks fine-tuned from each checkpoint: vqa, or vqa,gqa (GQA with VQA's "
                     "epochs, batch and learning rate)")
    seeds: str = opt("", "comma-separated seeds: each architecture is pre-trained and fine-tuned once per seed on the "
                     "same world and features (those of --seed), the table shows mean ± std; empty: --seed only")


TASKS = ("vqa", "gqa")  # vqa is part of every run (the demo's step 5)


CONFIG_CLASS = CompareConfig

# The summary numbers each comparison row keeps (recipes/demo.py `run_model` writes them for every architecture).
HEADLINE = (
    "model", "mlm_visual_word_acc", "mlm_visual_word_acc_regions_zeroed", "mlm_visual_word_n", "vqa_accuracy",
    "vqa_majority_baseline", "grounding_best_head", "grounding_best_head_acc", "grounding_best_layer",
    "grounding_baseline_acc", "num_layers", "num_heads", "seconds",
)


def arch_list(cfg: CompareConfig) -> list[str]:
    """The architectures to compare, in the order given; an unknown, repeated or missing name is an error."""
    if cfg.arch or cfg.model:
        raise VlbertsError("--arch and --model do not apply to compare; list the architectures in --archs")
    names = [a.strip() for a in cfg.archs.split(",") if a.strip()]
    if not names:
        raise VlbertsError(f"--archs is empty; valid: {', '.join(ARCHS)}")
    for a in names:
        if a not in ARCHS:
            raise VlbertsError(f"unknown architecture {a!r} in --archs; valid: {', '.join(ARCHS)}")
    if len(set(names)) != len(names):
        raise VlbertsError(f"--archs names an architecture twice: {cfg.archs}")
    return names


def seed_list(cfg: CompareConfig) -> list[int]:
    """The seeds of the model runs: --seeds, or --seed alone; a malformed or repeated seed is an error."""
    if not cfg.seeds.strip():
        return [cfg.seed]
    try:
        seeds = [int(x) for x in cfg.seeds.split(",") if x.strip()]
    except ValueError:
        raise VlbertsError(f"--seeds must be comma-separated integers, got {cfg.seeds!r}") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise VlbertsError(f"--seeds must name distinct seeds, got {cfg.seeds!r}")
    return seeds


def task_list(cfg: CompareConfig) -> list[str]:
    """The downstream tasks, vqa first; an unknown name is an error."""
    names = [t.strip() for t in cfg.tasks.split(",") if t.strip()]
    for t in names:
        if t not in TASKS:
            raise VlbertsError(f"unknown task {t!r} in --tasks; valid: {', '.join(TASKS)}")
    if "vqa" not in names:
        raise VlbertsError("--tasks must include vqa (every run fine-tunes VQA, the demo's step 5)")
    return names


def run_gqa(cfg: DemoConfig, arch_out: Path, world: Path, features: Path) -> dict[str, Any]:
    """GQA fine-tuning of the architecture's pre-trained model with the VQA schedule; its metrics.json."""
    gqa = world / "gqa"
    gqa_cfg = FinetuneGQAConfig(
        init=str(arch_out / "pretrain" / "model"), out=str(arch_out / "gqa"), features=str(features),
        train_questions=str(gqa / "train_balanced_questions.json"),
        eval_questions=str(gqa / "testdev_balanced_questions.json"),
        epochs=cfg.vqa_epochs, batch_size=cfg.vqa_batch, lr=cfg.vqa_lr, seed=cfg.seed, device=cfg.device,
        ckpt_every=10**9, preload_features=True, length_group=cfg.length_group,
    )
    run_procs(finetune_gqa, gqa_cfg, ["finetune", "gqa"], cfg.procs, arch_out, "gqa")
    return read_json(arch_out / "gqa" / "metrics.json")


def arch_config(cfg: CompareConfig, arch: str, out: Path, seed: int | None = None) -> DemoConfig:
    """The demo config that runs `arch` into OUT: every shared setting copied from `cfg` unchanged, with
    the model runs' `seed` (default: cfg's)."""
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(DemoConfig)}
    return DemoConfig(**{**shared, "arch": arch, "model": "", "out": str(out), "seed": cfg.seed if seed is None else seed})


def run_arch(acfg: DemoConfig, arch_out: Path, out: Path, tasks: list[str], log: Callable[[str], None]) -> dict[str, Any]:
    """One architecture, one seed: the demo's steps 3-7 and the extra tasks; its comparison row."""
    s = run_model(acfg, arch_out, out / "world", out / "features.h5", log)
    row = {
        "arch": acfg.arch,
        "seed": acfg.seed,
        "params": count_parameters(arch_out / "pretrain" / "model"),
        "pretrain_seconds": s["timings"]["pretrain"],
        **{k: s[k] for k in HEADLINE},
    }
    if "gqa" in tasks:
        t = time.perf_counter()
        g = run_gqa(acfg, arch_out, out / "world", out / "features.h5")
        row.update(gqa_accuracy=g["accuracy"], gqa_majority_baseline=g["majority_baseline"],
                   gqa_seconds=round(time.perf_counter() - t, 1))
        log(f"GQA test-dev accuracy {g['accuracy']:.2f}% (majority-answer baseline {g['majority_baseline']:.2f}%)")
    return row


# Numbers that vary with the seed: averaged over seeds, with their standard deviation as KEY_std.
SEED_VARYING = ("mlm_visual_word_acc", "mlm_visual_word_acc_regions_zeroed", "vqa_accuracy", "grounding_best_head_acc",
                "gqa_accuracy", "pretrain_seconds", "gqa_seconds", "seconds")


def mean_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for several seeds: the seed-varying numbers' mean and (population) standard deviation, the
    best grounding head and layer of each seed, each seed's own row under `runs`."""
    row = {k: v for k, v in runs[0].items() if k not in SEED_VARYING}
    for key in SEED_VARYING:
        if key in runs[0]:
            values = np.array([r[key] for r in runs], dtype=float)
            row[key], row[key + "_std"] = round(float(values.mean()), 2), round(float(values.std()), 2)
    row.update(seed=[r["seed"] for r in runs], grounding_best_head=",".join(r["grounding_best_head"] for r in runs),
               grounding_best_layer=[r["grounding_best_layer"] for r in runs], runs=runs)
    return row


def count_parameters(model_dir: Path) -> int:
    """Parameters of the saved pre-training model (encoder and heads; tied tables counted once)."""
    model, _, _ = load_pretraining_model(model_dir)
    return sum(p.numel() for p in model.parameters())


def run_compare(cfg: CompareConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the world and features once, run every architecture on them; returns what comparison.json holds."""
    set_threads()
    archs, tasks, seeds = arch_list(cfg), task_list(cfg), seed_list(cfg)  # bad names fail before any work
    out = Path(cfg.out)
    prepare_out(out, command="compare")
    t0 = time.perf_counter()
    inputs = build_inputs(cfg, out, log)
    rows: dict[str, dict[str, Any]] = {}
    for arch in archs:
        runs = []
        for seed in seeds:
            log(f"--- {arch} ---" if len(seeds) == 1 else f"--- {arch}, seed {seed} ---")
            arch_out = out / arch if len(seeds) == 1 else out / arch / f"seed-{seed}"
            arch_out.mkdir(parents=True)
            runs.append(run_arch(arch_config(cfg, arch, arch_out, seed), arch_out, out, tasks, log))
        rows[arch] = runs[0] if len(seeds) == 1 else mean_row(runs)
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("arch", "model")}
    result = {"settings": settings, "inputs_seconds": inputs, "seconds": round(time.perf_counter() - t0, 1),
              "archs": rows}
    write_json(out / "comparison.json", result)
    (out / "comparison.md").write_text(markdown_table(result) + "\n")
    return result


def _params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def _acc(r: dict[str, Any], key: str) -> str:
    """An accuracy in %, as mean ± std when the row averages seeds."""
    return f"{r[key]:.2f} ± {r[key + '_std']:.2f}" if key + "_std" in r else f"{r[key]:.2f}"


def _layers(r: dict[str, Any]) -> str:
    layers = r["grounding_best_layer"]
    return ",".join(map(str, layers)) if isinstance(layers, list) else str(layers)


def markdown_table(result: dict[str, Any]) -> str:
    """comparison.md: one row per architecture, accuracies in % (mean ± std over seeds with --seeds)."""
    gqa = all("gqa_accuracy" in r for r in result["archs"].values()) and bool(result["archs"])
    lines = [
        "| arch | params | pretrain s | probe with / zeroed | VQA / majority | "
        + ("GQA / majority | " if gqa else "") + "best grounding head (layer) / baseline |",
        "|---|---:|---:|---:|---:|" + ("---:|" if gqa else "") + "---:|",
    ]
    for r in result["archs"].values():
        lines.append(
            f"| {r['arch']} | {_params(r['params'])} | {r['pretrain_seconds']:.1f} "
            f"| {_acc(r, 'mlm_visual_word_acc')} / {_acc(r, 'mlm_visual_word_acc_regions_zeroed')} "
            f"| {_acc(r, 'vqa_accuracy')} / {r['vqa_majority_baseline']:.2f} "
            + (f"| {_acc(r, 'gqa_accuracy')} / {r['gqa_majority_baseline']:.2f} " if gqa else "")
            + f"| {r['grounding_best_head']} {_acc(r, 'grounding_best_head_acc')} ({_layers(r)}/{r['num_layers']}) "
            f"/ {r['grounding_baseline_acc']:.2f} |"
        )
    return "\n".join(lines)


def config_from_args(args: list[str], base: dict | None = None) -> CompareConfig:
    """The compare config from an optional base dict plus `--key=value` overrides."""
    return apply_overrides(from_dict(CompareConfig, base or {}), args)
