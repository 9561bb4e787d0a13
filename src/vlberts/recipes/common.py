"""Pieces every recipe uses: devices and precision, seeding, run directories, progress bars."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import torch
import yaml
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from vlberts.config import checked, to_dict
from vlberts.errors import VlbertsError
from vlberts.io import atomic_open, read_json
from vlberts.io import write_run_config as write_settings
from vlberts.models.builders import max_text_positions
from vlberts.training.loop import auto_device_type, precision_in_effect

C = TypeVar("C")


def resolve_device(name: str) -> torch.device:
    """`auto` (CUDA when there is a GPU, else the CPU), `cpu`, `cuda` or `cuda:N`; anything else, or CUDA
    on a machine without it, is a one-line error."""
    if name == "auto":
        return torch.device(auto_device_type())
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        device = None
    # The CPU is one device to torch: 'cpu:1' would run on it as 'cpu' does, so it names nothing that exists.
    if device is None or device.type not in ("cpu", "cuda") or (device.type == "cpu" and device.index):
        raise VlbertsError(f"unknown device {name!r}; valid: auto, cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise VlbertsError(f"device {name!r} requested but CUDA is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise VlbertsError(f"device {name!r} requested but this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def require_compiler(compile: bool, device: torch.device) -> None:
    """`--compile=true` on the CPU: Inductor writes C++ and builds it, so on a machine without a C++
    compiler the first update failed with a page of PyTorch's error, after the run directory was made. Say
    so first, in one line, when none of $CXX, g++, clang++ and c++ is on PATH (on a GPU Inductor writes
    Triton kernels and Python)."""
    if not compile or device.type != "cpu":
        return
    if not any(name and shutil.which(name) for name in (os.environ.get("CXX", ""), "g++", "clang++", "c++")):
        raise VlbertsError("--compile=true on the CPU needs a C++ compiler (torch.compile's Inductor builds C++ "
                           "there): none of $CXX, g++, clang++, c++ is on PATH; install one (e.g. apt-get install "
                           "g++) or leave --compile off")


def compile_model(model: torch.nn.Module, mode: str, static_shapes: bool = False) -> None:
    """`--compile`: torch.compile `model` in place (its state dict keeps its names, no `_orig_mod.` prefix).

    With `static_shapes` (pre-training's `--static_shapes`: every batch padded to a few bucket sizes) each
    shape gets its own graph, never a dynamic one: a CUDA graph is recorded per shape anyway, and on the H200
    (torch 2.11, 2026-11-27) Inductor's Triton code generation failed an assertion on the dynamic graph that
    torch.compile made after the second shape. The text-length, masked-word and batch-size buckets (an epoch's
    short last batch) can make more shapes than dynamo's default limit of 8 compiled graphs per function,
    after which the new shapes would run eagerly; the limit is raised to 64 for the process."""
    if static_shapes:
        import torch._dynamo.config as dynamo_config

        name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"  # torch < 2.6
        setattr(dynamo_config, name, max(getattr(dynamo_config, name), 64))
    model.compile(mode=mode, dynamic=False if static_shapes else None)


def replays_cuda_graphs(compile_: bool, mode: str, device: torch.device) -> bool:
    """Whether `--compile` in `mode` on `device` replays the step as CUDA graphs (reduce-overhead, max-autotune).
    Inductor is imported only when it is: its import takes about 2 s."""
    if not compile_ or device.type != "cuda":
        return False
    import torch._inductor

    return bool(torch._inductor.list_mode_options(mode).get("triton.cudagraphs"))


def own_gradients(model: torch.nn.Module) -> None:
    """Between the micro-batches of an update replayed as CUDA graphs (`--grad_accum` > 1): after the first
    backward each parameter's gradient is an output of the backward graph, held in memory that the next
    micro-batch's replay writes before its gradients are added (PyTorch then stops with "accessing tensor
    output of CUDAGraphs that has been overwritten"). An eager copy of each survives the replay; the copies
    cost one pass over the gradients per extra micro-batch."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad.clone()


PRECISIONS = ("auto", "fp32", "bf16", "fp16")
PRECISION_HELP = ("auto (bf16 autocast on CUDA, fp32 on CPU), fp32, bf16, or fp16 (autocast with dynamic loss "
                  "scaling, for GPUs without bf16)")


def autocast(device: torch.device, precision: str):
    """bf16 autocast on CUDA when asked (or 'auto'); fp16 autocast when asked (training scales the loss:
    `training.loop.loss_scaler`); full fp32 on CPU unless bf16 or fp16 is forced."""
    if precision not in PRECISIONS:
        raise VlbertsError(f"precision must be {', '.join(PRECISIONS[:-1])} or {PRECISIONS[-1]}, got {precision!r}")
    if precision == "fp16":
        return torch.autocast(device_type=device.type, dtype=torch.float16)
    if precision_in_effect(precision, device.type) != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


FLOAT16_BATCHES_HELP = ("float16 features stay float16 from the store or shards to the device, which widens them "
                        "(the same values, half the bytes a loader moves): auto (on CUDA), true, false")


def float16_batches(setting: str, device: torch.device) -> bool:
    """`--float16_batches`: auto keeps float16 features float16 up to the device on CUDA, where the loader's bytes
    (36 x 2048 a region set) cost host memory bandwidth and copy time; a CPU step widens them itself, so there
    it only moves the conversion from the loader workers into the training process."""
    if setting not in ("auto", "true", "false"):
        raise VlbertsError(f"--float16_batches must be auto, true or false, got {setting!r}")
    return device.type == "cuda" if setting == "auto" else setting == "true"


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def start_recipe(cfg: C) -> C:
    """What every recipe does first: its settings checked as the command line checks them (`checked`: a
    config built in Python gets the same errors), and torch's threads set (`set_threads`). A recipe is a
    run: it also seeds Python's, NumPy's and torch's global generators from its seed and selects the
    attention kernel for the process (`--attention_kernel`), which later models in the same process keep."""
    cfg = checked(cfg)
    set_threads()
    return cfg


def start_prediction(cfg: Any) -> tuple[torch.device, Any]:
    """The device and process group of a `vlberts predict` run. Under torchrun every rank predicts its share
    of the examples (`examples[rank::world]`, merged as a fine-tuning run's evaluation merges them: each
    example once) and rank 0 alone writes OUT; every rank first checks that all run the same command on the
    same data (`check_ranks_agree`). One process: the device and no group."""
    from vlberts.training.distributed import check_ranks_agree, init_distributed, local_device

    device = resolve_device(cfg.device)
    dist = init_distributed(device.type)
    check_ranks_agree(dist, cfg, None)  # only rank 0 writes OUT, so it need not be shared
    return local_device(device, dist), dist


def set_threads() -> None:
    """Use every core we were given (CI: 2), shared among the processes torchrun started on this machine,
    unless the user pinned a number (OMP_NUM_THREADS; torchrun sets 1 unless told otherwise)."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))


def save_run_config(out: Path, cfg: Any, name: str = "run_config.yaml") -> None:
    with atomic_open(out / name) as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


def write_run_config(out: str | Path, cfg: Any) -> None:
    """OUT/run_config.json of a run that does not train, from its config dataclass (`io.write_run_config`)."""
    write_settings(out, to_dict(cfg))


def fine_tuning_setting(model_dir: str | Path, key: str, default: int) -> int:
    """A positive integer setting (max_text_len, max_regions) of the fine-tuning run that wrote `model_dir`
    (RUN/run_config.json beside RUN/model), or `default` when the run's config or the key is not there: what
    plain inference (`vlberts predict`) lays its inputs out with unless told otherwise. A value that is there
    but not a positive integer is an error: the default would lay the inputs out unlike training."""
    run_config = Path(model_dir).parent / "run_config.json"
    if not run_config.is_file():
        return default
    settings = read_json(run_config)
    if not isinstance(settings, dict):
        raise VlbertsError(f"expected a JSON object of settings, got {type(settings).__name__}", path=run_config)
    if key not in settings:
        return default
    value = settings[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise VlbertsError(f"must be a positive integer, got {json.dumps(value)}", path=run_config, record=key)
    return value


def progress(disable: bool | None = None) -> Progress:
    """A rich progress bar for long steps (quiet when stderr is not a terminal, unless forced)."""
    if disable is None:
        disable = not sys.stderr.isatty() and not os.environ.get("VLBERTS_PROGRESS")
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        disable=disable,
        transient=False,
    )


def field_help(cls: type) -> str:
    """`--key=value` documentation of a run-config dataclass, from each field's `help` metadata. A list
    default is shown as the flag takes it, comma-separated."""
    lines = []
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        if isinstance(default, (tuple, list)):
            default = ",".join(map(str, default))
        lines.append(f"--{f.name}={default}: {f.metadata.get('help', '')}")
    return "\n\n".join(lines)


def opt(default: Any, help: str) -> Any:
    """A run-config field with its help text."""
    return dataclasses.field(default=default, metadata={"help": help})


# Help texts of the options every training recipe (pre-training and each fine-tuning task) shares.
FLIP_PROB_HELP = ("show each training example mirrored with this probability: its boxes flipped left-right, "
                  "'left' and 'right' swapped in its text (and, for VQA and GQA, in its answers) (VL-BERT's "
                  "FLIP_PROB, 0.5 in its VQA, RefCOCO+ and VCR configs; the region features stay as they are)")
WARMUP_HELP = ("learning-rate warm-up: a fraction of the updates (below 1), or a number of updates (1 or more: "
               "VL-BERT's released configs warm up for 500)")
BIAS_CORRECTION_HELP = ("Adam's bias correction of its moment estimates; false: BertAdam's update without it "
                        "(VisualBERT's, LXMERT's and W-VisualBERT's BertAdam, ViLBERT's AdamW(correct_bias=False))")
DECAY_ALL_HELP = ("weight decay on every parameter, biases and LayerNorm weights too (LXMERT's BertAdam, VL-BERT's "
                  "AdamW); false: BERT's exclusions")
OPTIMIZER_HELP = ("adamw (Adam with decoupled weight decay; the papers' optimizer) or sgd (with --momentum and L2 "
                  "weight decay: VL-BERT's VCR configs)")
CLIP_PER_TENSOR_HELP = ("clip each parameter's gradient to norm --clip on its own (VisualBERT's BertAdam) instead of "
                        "all of them by their global norm")
FSDP_HELP = ("under torchrun: shard parameters, gradients and optimizer state over the ranks (FSDP) "
             "instead of replicating them; checkpoints stay whole. One process: a warning, no sharding")
PREFETCH_HELP = ("updates whose batches a thread draws ahead (and pins, on a GPU) while the device runs the current "
                 "one; 0: drawn in the loop; -1: 2 on a GPU, 0 on a CPU (a thread beside the compute threads slows a "
                 "small CPU). Results are the same either way")
TENSORBOARD_HELP = ("also write the metrics log as TensorBoard event files in OUT/tensorboard (needs the "
                    "tensorboard package: pip install 'vlberts[tensorboard]')")
COMPILE_HELP = ("torch.compile the model in place (inductor): the first updates wait for the compiler, "
                "later ones run fused kernels; CPU needs a C++ compiler. Weights and checkpoints are unchanged")
# torch.compile's modes (`--compile_mode`, with --compile)
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
COMPILE_MODE_HELP = ("torch.compile's mode with --compile: reduce-overhead replays each step as a CUDA graph (on a "
                     "GPU), one recorded per shape (pre-training: give it --static_shapes)")

ATTENTION_KERNEL_HELP = ("the kernel every attention call of the fast path uses (PyTorch's math path where it cannot take "
                         "the inputs): auto (PyTorch picks: cuDNN's kernel on the H200 measured), efficient, flash, cudnn or math, "
                         "or several tried in order (flash,efficient: flash for the calls whose keys have no padding, which "
                         "get no mask, efficient for the rest). The default, efficient,flash, was the fastest on the H200 "
                         "(a CPU has no efficient kernel: flash or math there, as auto). Same function, another kernel; held "
                         "inside compiled graphs too")


@dataclass(frozen=True)
class PredictConfig:
    """The settings every plain-inference recipe (`vlberts predict TASK`) shares; each task adds its files."""

    device: str = opt("auto", "auto, cpu, cuda, cuda:N")
    precision: str = opt("auto", PRECISION_HELP)
    preload_features: bool = opt(False, "read the whole region store into memory first (for stores that fit)")


def prediction_store(cfg: PredictConfig, features: str, models: dict[str, Any]) -> tuple[Any, str | None]:
    """The region store a `vlberts predict` run reads (preloaded if asked), checked against each model
    (`models`: model directory -> its model): features of another width are an error; features from
    another extraction than a model was trained on, a warning line (as fine-tuning and the analyses print
    it), returned for predict.json."""
    from vlberts.features.identity import warn_feature_mismatch
    from vlberts.features.store import RegionStore

    store = RegionStore(features)
    if cfg.preload_features:
        store.preload()
    mismatch = None
    for model_dir, model in models.items():
        if model.cfg.visual_dim != store.feature_dim:
            raise VlbertsError(f"store features are {store.feature_dim}-d but the model expects "
                               f"{model.cfg.visual_dim}-d", path=features)
        mismatch = mismatch or warn_feature_mismatch(store, model_dir)[1]
    return store, mismatch


def check_text_len(max_text_len: int, model_cfg, model_dir: str | Path | None, *, inherited: bool = False) -> int:
    """The text length to use: `max_text_len`, if the model has a position embedding for each of its tokens
    (`models.builders.max_text_positions`: VL-BERT's regions and [END] take two more after the text).
    Asked for (--max_text_len) beyond that: a one-line error, as a longer text would index past the embedding
    table deep inside the forward pass. Not asked for (`inherited`: from the fine-tuning run, or the
    recipe's default, `fit_text_len`): capped at the table, which changes nothing a run could have done (it
    too failed on anything longer). `model_dir` None: a named configuration (`--model`), not a directory."""
    if getattr(model_cfg, "max_position_embeddings", None) is None:
        return max_text_len
    limit = max_text_positions(model_cfg)
    if max_text_len <= limit:
        return max_text_len
    if inherited:
        return limit
    table = model_cfg.max_position_embeddings
    after = f" less the {table - limit} it places after the text" if table > limit else ""
    raise VlbertsError(f"--max_text_len={max_text_len} is more than the model's {table} position embeddings "
                       f"(max_position_embeddings){after}; use at most {limit}",
                       path=None if model_dir is None else Path(model_dir) / "config.json")


def predict_text_len(asked: int, model_cfg, model_dir: str | Path, default: int) -> int:
    """The text length `vlberts predict` lays its inputs out with: `asked` (--max_text_len; 0: none), else the
    fine-tuning run's (`fine_tuning_setting`, or `default`), checked against the model's position table
    (`check_text_len`: asked beyond it, an error; inherited, capped)."""
    length = asked or fine_tuning_setting(model_dir, "max_text_len", default)
    return check_text_len(length, model_cfg, model_dir, inherited=not asked)


def fit_text_len(cfg: Any, model_cfg, model_dir: str | Path | None) -> Any:
    """`cfg` (a run config with `max_text_len`) with a text length the model at `model_dir` embeds
    (`check_text_len`): a value beyond the model's position table is a one-line error, except the config
    class's own default (VCR's 80 against a tiny model's 64), which is capped at the table. The config
    system keeps no record of which settings were given, so a given value equal to the default counts as
    the default (as its range check does)."""
    default = next(f.default for f in dataclasses.fields(cfg) if f.name == "max_text_len")
    fitted = check_text_len(cfg.max_text_len, model_cfg, model_dir, inherited=cfg.max_text_len == default)
    return cfg if fitted == cfg.max_text_len else dataclasses.replace(cfg, max_text_len=fitted)
