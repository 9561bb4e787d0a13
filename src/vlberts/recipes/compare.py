"""Recipe: a controlled comparison of the architectures (`vlberts compare`).

    1. world + features  built ONCE, exactly as the demo builds them      OUT/world/, OUT/features.h5
    2. per architecture  the demo's steps 3-7 (pretrain -> probe -> VQA   OUT/ARCH/ (pretrain/, vqa/,
                         -> grounding -> summary) with the same settings   grounding/, summary.json, report.html)
    + with --tasks=vqa,gqa, GQA fine-tuning from the same checkpoint          OUT/ARCH/gqa/
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


def arch_config(cfg: CompareConfig, arch: str, out: Path) -> DemoConfig:
    """The demo config that runs `arch` into OUT: every shared setting copied from `cfg` unchanged."""
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(DemoConfig)}
    return DemoConfig(**{**shared, "arch": arch, "model": "", "out": str(out)})


def count_parameters(model_dir: Path) -> int:
    """Parameters of the saved pre-training model (encoder and heads; tied tables counted once)."""
    model, _, _ = load_pretraining_model(model_dir)
    return sum(p.numel() for p in model.parameters())


def run_compare(cfg: CompareConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the world and features once, run every architecture on them; returns what comparison.json holds."""
    set_threads()
    archs, tasks = arch_list(cfg), task_list(cfg)  # bad names fail before any work
    out = Path(cfg.out)
    prepare_out(out, command="compare")
    t0 = time.perf_counter()
    inputs = build_inputs(cfg, out, log)
    rows: dict[str, dict[str, Any]] = {}
    for arch in archs:
        log(f"--- {arch} ---")
        arch_out = out / arch
        arch_out.mkdir()
        s = run_model(arch_config(cfg, arch, arch_out), arch_out, out / "world", out / "features.h5", log)
        rows[arch] = {
            "arch": arch,
            "params": count_parameters(arch_out / "pretrain" / "model"),
            "pretrain_seconds": s["timings"]["pretrain"],
            **{k: s[k] for k in HEADLINE},
        }
        if "gqa" in tasks:
            t = time.perf_counter()
            g = run_gqa(arch_config(cfg, arch, arch_out), arch_out, out / "world", out / "features.h5")
            rows[arch].update(gqa_accuracy=g["accuracy"], gqa_majority_baseline=g["majority_baseline"],
                              gqa_seconds=round(time.perf_counter() - t, 1))
            log(f"GQA test-dev accuracy {g['accuracy']:.2f}% (majority-answer baseline {g['majority_baseline']:.2f}%)")
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("arch", "model")}
    result = {"settings": settings, "inputs_seconds": inputs, "seconds": round(time.perf_counter() - t0, 1),
              "archs": rows}
    write_json(out / "comparison.json", result)
    (out / "comparison.md").write_text(markdown_table(result) + "\n")
    return result


def _params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def markdown_table(result: dict[str, Any]) -> str:
    """comparison.md: one row per architecture, accuracies in %."""
    gqa = all("gqa_accuracy" in r for r in result["archs"].values()) and bool(result["archs"])
    lines = [
        "| arch | params | pretrain s | probe with / zeroed | VQA / majority | "
        + ("GQA / majority | " if gqa else "") + "best grounding head (layer) / baseline |",
        "|---|---:|---:|---:|---:|" + ("---:|" if gqa else "") + "---:|",
    ]
    for r in result["archs"].values():
        lines.append(
            f"| {r['arch']} | {_params(r['params'])} | {r['pretrain_seconds']:.1f} "
            f"| {r['mlm_visual_word_acc']:.2f} / {r['mlm_visual_word_acc_regions_zeroed']:.2f} "
            f"| {r['vqa_accuracy']:.2f} / {r['vqa_majority_baseline']:.2f} "
            + (f"| {r['gqa_accuracy']:.2f} / {r['gqa_majority_baseline']:.2f} " if gqa else "")
            + f"| {r['grounding_best_head']} {r['grounding_best_head_acc']:.2f} ({r['grounding_best_layer']}/{r['num_layers']}) "
            f"/ {r['grounding_baseline_acc']:.2f} |"
        )
    return "\n".join(lines)


def config_from_args(args: list[str], base: dict | None = None) -> CompareConfig:
    """The compare config from an optional base dict plus `--key=value` overrides."""
    return apply_overrides(from_dict(CompareConfig, base or {}), args)
