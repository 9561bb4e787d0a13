"""Recipe: a controlled comparison of the architectures (`vlberts compare`).

    1. world + features  built ONCE, exactly as the demo builds them      OUT/world/, OUT/features.h5
    2. per architecture  the demo's steps 3-7 (pretrain -> probe -> VQA   OUT/ARCH/ (pretrain/, vqa/,
                         -> grounding -> summary) with the same settings   grounding/, summary.json, report.html)
    + with --tasks=vqa,gqa,nlvr2,retrieval,refcoco,vcr,flickr_entities, each   OUT/ARCH/TASK/
      task fine-tuned from the same checkpoint with its schedule (`TASK_SCHEDULES`: VQA's epochs, batch
      and learning rate, scaled per task; the same for every architecture)
    + with --seeds=K (K seeds from --seed) or --seeds=0,1,2, step 2 once per   OUT/ARCH/seed-S/
      seed (pre-training, fine-tuning; the world and features stay those of --seed), reported as mean and std
    3. comparison        the headline numbers side by side                 OUT/results.json, OUT/results.md

Interrupted and started again with the same settings, a comparison continues where it stopped (the demo's
`--resume`); `--resume=true` also continues a finished one, e.g. with more --tasks or --archs: every step
and task whose output is complete is kept (a task: its OUT/ARCH/TASK/metrics.json), the rest runs.

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
from vlberts.io import atomic_open, read_json, write_json
from vlberts.models.builders import ARCHS
from vlberts.recipes.common import opt, start_recipe
from vlberts.recipes.demo import (DemoConfig, StepTimes, build_inputs, check_choices, prepare_out, run_model, run_procs,
                                  run_settings)
from vlberts.recipes.finetune_gqa import FinetuneGQAConfig, finetune_gqa
from vlberts.training.checkpoint import load_pretraining_model


@dataclass(frozen=True)
class CompareConfig(DemoConfig):
    """The demo's settings, shared by every architecture (never the per-architecture `ARCH_DEMO` of
    recipes/demo.py), and which architectures to run."""

    out: str = opt("runs/compare", "output directory: OUT/world and OUT/features.h5 once, OUT/ARCH/ per architecture "
                   "(replaced if it holds an earlier demo or compare, unless --resume continues it)")
    arch: str = opt("", "not used by compare: --archs lists the architectures")
    model: str = opt("", "not used by compare: each architecture trains its ARCH-small")
    archs: str = opt(",".join(ARCHS), "comma-separated architectures, each pre-trained with its paper's objectives")
    tasks: str = opt("vqa", "downstream tasks fine-tuned from each checkpoint: vqa plus any of gqa, nlvr2, "
                     "retrieval, refcoco, vcr, flickr_entities (each on VQA's schedule scaled per task, as TASK_SCHEDULES in recipes/compare.py says), "
                     "e.g. vqa,gqa")
    seeds: str = opt("", "K (one number: K seeds, --seed to --seed + K - 1) or comma-separated seeds: each architecture "
                     "is pre-trained and fine-tuned once per seed on the same world and features (those of --seed), the "
                     "table shows mean ± std; empty: --seed only")


@dataclass(frozen=True)
class ExtraTask:
    """A downstream task compare can add to the demo's VQA: its recipe run on the world with VQA's schedule,
    and the two numbers of its column (dotted paths into its metrics.json, stored in the row under
    `TASK_<key>` with dots as underscores)."""

    header: str  # column header, e.g. "GQA / majority"
    score: str  # the main metric, e.g. "accuracy" or "text_to_image.r1"
    baseline: str  # its trivial baseline, e.g. "majority_baseline"
    setup: Callable[[DemoConfig, Path, Path, Path], tuple[Callable[[Any], Any], Any]]  # -> (recipe, run config)

    def row(self, name: str, metrics: dict[str, Any]) -> dict[str, Any]:
        return {f"{name}_{key.replace('.', '_')}": _get(metrics, key) for key in (self.score, self.baseline)}


def _get(metrics: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        metrics = metrics[part]
    return metrics


@dataclass(frozen=True)
class TaskSchedule:
    """A task's fine-tuning schedule relative to the demo's VQA one (`--vqa_epochs/--vqa_batch/--vqa_lr`),
    so that --quick and any other VQA schedule scale every task alike."""

    epochs: float = 1.0  # x VQA's epochs
    lr: float = 1.0  # x VQA's learning rate
    batch_div: int = 1  # VQA's batch / this (tasks whose example is a group of sequences)
    extra: tuple[tuple[str, Any], ...] = ()  # further settings of the task's run config


# Measured on the 1,000-image comparison world (README, "Comparing the architectures"): with VQA's schedule (2 epochs,
# batch 64, lr 5e-4) RefCOCO+ stays near its baseline (VisualBERT 17, LXMERT 17 vs 18) where 10 epochs of
# batch 32 at 1e-4 reach 80-92; VCR needs VL-BERT's larger head learning rate (x20) at 2e-4 for 1 epoch.
# The retrieval and VCR batches count groups of 4 sequences: a quarter of VQA's keeps the sequences per update.
# NLVR2 at VQA's 5e-4 stays at ln 2 from demo-length checkpoints of VisualBERT (2 runs of 3), LXMERT and VL-BERT,
# and leaves it at 2e-4 for all three (docs/finetuning.md, "NLVR2"): 0.4x.
# Retrieval ranks every test image for every caption, one forward pass per pair: the first 100 test images
# (500 captions, 50,000 pairs; 23 s for visualbert-small on 2 cores) keep that cost and the chance level (1%)
# fixed. That is all of the 1,000-image world's test split; the demo-size world's 500 would be 25x the pairs.
TASK_SCHEDULES: dict[str, TaskSchedule] = {
    "nlvr2": TaskSchedule(lr=0.4),
    "refcoco": TaskSchedule(epochs=5.0, lr=0.2, batch_div=2),
    "vcr": TaskSchedule(epochs=0.5, lr=0.4, batch_div=4, extra=(("head_lr_mult", 20.0),)),
    "retrieval": TaskSchedule(batch_div=4, extra=(("eval_images", 100),)),
}


def _schedule(cfg: DemoConfig, arch_out: Path, features: Path, name: str) -> dict[str, Any]:
    """The settings of task `name`'s run: its schedule (`TASK_SCHEDULES`, VQA's by default) and the rest."""
    s = TASK_SCHEDULES.get(name, TaskSchedule())
    return dict(init=str(arch_out / "pretrain" / "model"), out=str(arch_out / name), features=str(features),
                epochs=cfg.vqa_epochs * s.epochs, batch_size=max(1, cfg.vqa_batch // s.batch_div),
                lr=cfg.vqa_lr * s.lr, seed=cfg.seed, device=cfg.device, ckpt_every=10**9, preload_features=True,
                **dict(s.extra))


def _gqa(cfg: DemoConfig, arch_out: Path, world: Path, features: Path):
    return finetune_gqa, FinetuneGQAConfig(
        **_schedule(cfg, arch_out, features, "gqa"), length_group=cfg.length_group, loss=cfg.qa_loss,
        train_questions=str(world / "gqa" / "train_balanced_questions.json"),
        eval_questions=str(world / "gqa" / "testdev_balanced_questions.json"),
    )


def _nlvr2(cfg: DemoConfig, arch_out: Path, world: Path, features: Path):
    from vlberts.recipes.finetune_nlvr2 import FinetuneNLVR2Config, finetune_nlvr2

    return finetune_nlvr2, FinetuneNLVR2Config(
        **_schedule(cfg, arch_out, features, "nlvr2"), length_group=cfg.length_group,
        train_statements=str(world / "nlvr2" / "train.json"), eval_statements=str(world / "nlvr2" / "test1.json"),
        image_map=str(world / "nlvr2" / "images.json"),
    )


def _retrieval(cfg: DemoConfig, arch_out: Path, world: Path, features: Path):
    from vlberts.recipes.finetune_retrieval import FinetuneRetrievalConfig, finetune_retrieval

    return finetune_retrieval, FinetuneRetrievalConfig(
        **_schedule(cfg, arch_out, features, "retrieval"), split_file=str(world / "dataset_world.json"),
    )


def _refcoco(cfg: DemoConfig, arch_out: Path, world: Path, features: Path):
    from vlberts.recipes.finetune_refcoco import FinetuneRefCocoConfig, finetune_refcoco

    return finetune_refcoco, FinetuneRefCocoConfig(
        **_schedule(cfg, arch_out, features, "refcoco"), refs=str(world / "refcoco+" / "refs(unc).p"),
        instances=str(world / "refcoco+" / "instances.json"),
    )


def _vcr(cfg: DemoConfig, arch_out: Path, world: Path, features: Path):
    from vlberts.recipes.finetune_vcr import FinetuneVCRConfig, finetune_vcr

    return finetune_vcr, FinetuneVCRConfig(
        **_schedule(cfg, arch_out, features, "vcr"), mode="qa",
        train_file=str(world / "vcr" / "train.jsonl"), eval_file=str(world / "vcr" / "val.jsonl"),
    )


def _flickr_entities(cfg: DemoConfig, arch_out: Path, world: Path, features: Path):
    from vlberts.recipes.finetune_flickr_entities import FinetuneFlickrEntitiesConfig, finetune_flickr_entities

    return finetune_flickr_entities, FinetuneFlickrEntitiesConfig(
        **_schedule(cfg, arch_out, features, "flickr_entities"), length_group=cfg.length_group,
        entities=str(world / "flickr30k_entities"),
    )


# vqa is part of every run (the demo's step 5); the others run after it, from the same checkpoint
EXTRA_TASKS: dict[str, ExtraTask] = {
    "gqa": ExtraTask("GQA / majority", "accuracy", "majority_baseline", _gqa),
    "nlvr2": ExtraTask("NLVR2 / majority", "accuracy", "majority_baseline", _nlvr2),
    "retrieval": ExtraTask("retrieval R@1 / chance", "text_to_image.r1", "chance.text_to_image.r1", _retrieval),
    "refcoco": ExtraTask("RefCOCO+ val / top-confidence", "accuracy", "confidence_baseline", _refcoco),
    "vcr": ExtraTask("VCR Q->A val / chance", "q2a", "chance", _vcr),
    "flickr_entities": ExtraTask("Flickr30K Entities val R@1 / top-confidence", "r@1", "baseline.r@1",
                                 _flickr_entities),
}
TASKS = ("vqa", *EXTRA_TASKS)


CONFIG_CLASS = CompareConfig

# The summary numbers each comparison row keeps (recipes/demo.py `run_model` writes them for every architecture).
HEADLINE = (
    "model", "mlm_visual_word_acc", "mlm_visual_word_acc_regions_zeroed", "mlm_visual_word_n",
    "mlm_direction_word_acc", "mlm_direction_word_acc_regions_zeroed", "vqa_accuracy",
    "vqa_majority_baseline", "grounding_best_head", "grounding_best_head_acc", "grounding_best_layer",
    "grounding_baseline_acc", "grounding_nouns_masked_best_head", "grounding_nouns_masked_best_head_acc",
    "grounding_nouns_masked_best_layer", "num_layers", "num_heads", "seconds",
)


def comma_list(text: str, option: str) -> list[str]:
    """The items of a comma-separated setting (`--archs`, `--seeds`, `--tasks`; one comma at the end is
    allowed: `--seeds=7,` is the list of seed 7); an empty item (`a,,b`, `,a`) or one named twice is an error,
    as it would run something else than was typed."""
    items = [x.strip() for x in text.split(",")] if text.strip() else []
    if len(items) > 1 and items[-1] == "":
        items = items[:-1]
    if "" in items:
        raise VlbertsError(f"--{option} has an empty item: {text!r}")
    twice = next((x for k, x in enumerate(items) if x in items[:k]), None)
    if twice is not None:
        raise VlbertsError(f"--{option} names {twice!r} twice: {text!r}")
    return items


def arch_list(cfg: CompareConfig) -> list[str]:
    """The architectures to compare, in the order given; an unknown, repeated or missing name is an error."""
    if cfg.arch or cfg.model:
        raise VlbertsError("--arch and --model do not apply to compare; list the architectures in --archs")
    names = comma_list(cfg.archs, "archs")
    if not names:
        raise VlbertsError(f"--archs is empty; valid: {', '.join(ARCHS)}")
    for a in names:
        if a not in ARCHS:
            raise VlbertsError(f"unknown architecture {a!r} in --archs; valid: {', '.join(ARCHS)}")
    return names


RESULTS_JSON, RESULTS_MD = "results.json", "results.md"  # issue 3's DIR/results.json and DIR/results.md


def seed_list(cfg: CompareConfig) -> list[int]:
    """The seeds of the model runs: --seeds=K is K seeds from --seed (issue 3's `--seeds K`), --seeds=A,B,...
    those seeds, no --seeds --seed alone; a malformed, repeated or negative seed, or a non-positive count, is an
    error."""
    text = cfg.seeds.strip()
    if not text:
        return [cfg.seed]
    try:
        numbers = [int(x) for x in comma_list(text, "seeds")]
    except ValueError:
        raise VlbertsError(f"--seeds must be a count or comma-separated integers, got {cfg.seeds!r}") from None
    if "," not in text:
        if numbers[0] < 1:
            raise VlbertsError(f"--seeds=K needs K >= 1 seeds, got {cfg.seeds!r}")
        return list(range(cfg.seed, cfg.seed + numbers[0]))
    if not numbers or len(set(numbers)) != len(numbers):
        raise VlbertsError(f"--seeds must name distinct seeds, got {cfg.seeds!r}")
    if min(numbers) < 0:  # numpy's generators take non-negative seeds only
        raise VlbertsError(f"--seeds must name non-negative seeds, got {cfg.seeds!r}")
    return numbers


def task_list(cfg: CompareConfig) -> list[str]:
    """The downstream tasks, vqa first; an unknown name is an error."""
    names = comma_list(cfg.tasks, "tasks")
    for t in names:
        if t not in TASKS:
            raise VlbertsError(f"unknown task {t!r} in --tasks; valid: {', '.join(TASKS)}")
    if "vqa" not in names:
        raise VlbertsError("--tasks must include vqa (every run fine-tunes VQA, the demo's step 5)")
    return names


def run_task(name: str, cfg: DemoConfig, arch_out: Path, world: Path, features: Path) -> None:
    """Fine-tune extra task `name` from the architecture's pre-trained model (`EXTRA_TASKS`) into ARCH_OUT/NAME."""
    recipe, task_cfg = EXTRA_TASKS[name].setup(cfg, arch_out, world, features)
    run_procs(recipe, task_cfg, ["finetune", name], cfg.procs, arch_out, name)


def arch_config(cfg: CompareConfig, arch: str, out: Path, seed: int | None = None) -> DemoConfig:
    """The demo config that runs `arch` into OUT: every shared setting copied from `cfg` unchanged, with
    the model runs' `seed` (default: cfg's)."""
    shared = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(DemoConfig)}
    return DemoConfig(**{**shared, "arch": arch, "model": "", "out": str(out), "seed": cfg.seed if seed is None else seed})


def run_arch(acfg: DemoConfig, arch_out: Path, out: Path, tasks: list[str], log: Callable[[str], None],
             resumed: bool = False) -> dict[str, Any]:
    """One architecture, one seed: the demo's steps 3-7 and the extra tasks; its comparison row. `resumed`:
    keep what ARCH_OUT already holds finished (OUT/ARCH/timings.json)."""
    arch_out.mkdir(parents=True, exist_ok=resumed)
    timings = StepTimes(arch_out, resumed)
    s = run_model(acfg, arch_out, out / "world", out / "features.h5", log, timings=timings)
    row = {
        "arch": acfg.arch,
        "seed": acfg.seed,
        "params": count_parameters(arch_out / "pretrain" / "model"),
        "pretrain_seconds": s["timings"]["pretrain"],
        **{k: s[k] for k in HEADLINE},
    }
    for name in tasks[1:]:
        t = time.perf_counter()
        task = EXTRA_TASKS[name]
        metrics = arch_out / name / "metrics.json"
        if not timings.keep((name,), metrics.is_file(), log, f"{name} ({metrics})"):
            run_task(name, acfg, arch_out, out / "world", out / "features.h5")
            timings.record(name, t)
        numbers = task.row(name, read_json(metrics))
        row.update(numbers, **{f"{name}_seconds": timings[name]})
        score, baseline = numbers.values()
        log(f"{name}: {task.header.split(' / ')[0]} {score:.2f} ({task.header.split(' / ')[1]} {baseline:.2f})")
    return row


# Numbers that vary with the seed: averaged over seeds, with their standard deviation as KEY_std.
SEED_VARYING = ("mlm_visual_word_acc", "mlm_visual_word_acc_regions_zeroed", "mlm_direction_word_acc",
                "mlm_direction_word_acc_regions_zeroed", "vqa_accuracy", "grounding_best_head_acc",
                "grounding_nouns_masked_best_head_acc",
                "pretrain_seconds", "seconds",
                *(f"{name}_{t.score.replace('.', '_')}" for name, t in EXTRA_TASKS.items()),
                *(f"{name}_seconds" for name in EXTRA_TASKS))


def mean_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One row for several seeds: the seed-varying numbers' mean and (population) standard deviation, the
    best grounding head and layer of each seed, each seed's own row under `runs`."""
    row = {k: v for k, v in runs[0].items() if k not in SEED_VARYING}
    for key in SEED_VARYING:
        if key in runs[0]:
            values = np.array([r[key] for r in runs], dtype=float)
            row[key], row[key + "_std"] = round(float(values.mean()), 2), round(float(values.std()), 2)
    row.update(seed=[r["seed"] for r in runs], runs=runs,
               **{k: ",".join(r[k] for r in runs) for k in ("grounding_best_head", "grounding_nouns_masked_best_head")},
               **{k: [r[k] for r in runs] for k in ("grounding_best_layer", "grounding_nouns_masked_best_layer")})
    return row


def count_parameters(model_dir: Path) -> int:
    """Parameters of the saved pre-training model (encoder and heads; tied tables counted once)."""
    model, _, _ = load_pretraining_model(model_dir)
    return sum(p.numel() for p in model.parameters())


def compare_settings(cfg: CompareConfig) -> dict[str, Any]:
    """What OUT/settings.json records for a comparison. --archs and --tasks only say which rows and columns
    to run (a continued comparison may add to them); the seeds are recorded as the list they stand for, so
    that --seeds=3 and --seeds=0,1,2 are one run, and as "" when that is --seed alone (--seeds=1, or none:
    as comparisons recorded before --seeds=K existed)."""
    seeds = seed_list(cfg)
    listed = "" if seeds == [cfg.seed] else ",".join(map(str, seeds))
    return run_settings(dataclasses.replace(cfg, seeds=listed), "compare", ignore=("archs", "tasks", "arch", "model"))


def run_compare(cfg: CompareConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Build the world and features once, run every architecture on them; returns what results.json holds."""
    cfg = start_recipe(cfg)
    archs, tasks, seeds = arch_list(cfg), task_list(cfg), seed_list(cfg)  # bad names fail before any work
    out = Path(cfg.out)
    check_choices(cfg, out / "world")
    resumed = prepare_out(out, compare_settings(cfg), cfg.resume, finished=RESULTS_JSON)
    t0 = time.perf_counter()
    inputs = build_inputs(cfg, out, log, StepTimes(out, resumed))
    rows: dict[str, dict[str, Any]] = {}
    for arch in archs:
        runs = []
        for seed in seeds:
            log(f"--- {arch} ---" if len(seeds) == 1 else f"--- {arch}, seed {seed} ---")
            arch_out = out / arch if len(seeds) == 1 else out / arch / f"seed-{seed}"
            runs.append(run_arch(arch_config(cfg, arch, arch_out, seed), arch_out, out, tasks, log, resumed))
        rows[arch] = runs[0] if len(seeds) == 1 else mean_row(runs)
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("arch", "model")}
    settings["seeds"] = ",".join(map(str, seeds))  # the seeds that ran (--seeds=3: "0,1,2")
    # seconds: this invocation's (a continued comparison's rows keep their steps' first seconds)
    result = {"settings": settings, "inputs_seconds": dict(inputs), "seconds": round(time.perf_counter() - t0, 1),
              "archs": rows}
    with atomic_open(out / RESULTS_MD) as f:
        f.write(markdown_table(result) + "\n")
    write_json(out / RESULTS_JSON, result)  # last: it marks the comparison finished (`prepare_out`)
    return result


def _params(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e5 else f"{n / 1e3:.1f}K"


def _acc(r: dict[str, Any], key: str, digits: int = 2) -> str:
    """An accuracy in % (or seconds), as mean ± std when the row averages seeds."""
    return f"{r[key]:.{digits}f} ± {r[key + '_std']:.{digits}f}" if key + "_std" in r else f"{r[key]:.{digits}f}"


def _layers(r: dict[str, Any], key: str = "grounding_best_layer") -> str:
    layers = r[key]
    return ",".join(map(str, layers)) if isinstance(layers, list) else str(layers)


def markdown_table(result: dict[str, Any]) -> str:
    """results.md: one row per architecture, accuracies in % (mean ± std over seeds with --seeds); a column
    per extra task every row has."""
    rows = list(result["archs"].values())
    extra = [(name, t) for name, t in EXTRA_TASKS.items()
             if rows and all(f"{name}_{t.score.replace('.', '_')}" in r for r in rows)]
    lines = [
        "| arch | params | pretrain s | probe with / zeroed | VQA / majority | "
        + "".join(f"{t.header} | " for _, t in extra) + "best grounding head (layer) / baseline | "
        "the same, nouns masked (not a check) |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(extra) + "---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['arch']} | {_params(r['params'])} | {_acc(r, 'pretrain_seconds', 1)} "
            f"| {_acc(r, 'mlm_visual_word_acc')} / {_acc(r, 'mlm_visual_word_acc_regions_zeroed')} "
            f"| {_acc(r, 'vqa_accuracy')} / {r['vqa_majority_baseline']:.2f} "
            + "".join(f"| {_acc(r, f'{name}_{t.score}'.replace('.', '_'))} / {r[f'{name}_{t.baseline}'.replace('.', '_')]:.2f} "
                      for name, t in extra)
            + f"| {r['grounding_best_head']} {_acc(r, 'grounding_best_head_acc')} ({_layers(r)}/{r['num_layers']}) "
            f"/ {r['grounding_baseline_acc']:.2f} "
            f"| {r['grounding_nouns_masked_best_head']} {_acc(r, 'grounding_nouns_masked_best_head_acc')} "
            f"({_layers(r, 'grounding_nouns_masked_best_layer')}/{r['num_layers']}) |"
        )
    return "\n".join(lines)


def config_from_args(args: list[str], base: dict | None = None) -> CompareConfig:
    """The compare config from an optional base dict plus `--key=value` overrides."""
    return apply_overrides(from_dict(CompareConfig, base or {}), args)
