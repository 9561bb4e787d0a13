"""The fine-tuning loop every downstream task shares (SPEC §4, §6).

A task recipe builds its model (a pre-trained encoder and a new head), its dataset and collate function,
and says how a batch is scored; `finetune_loop` does the rest the same way for every task:

* data-parallel under torchrun: each rank takes its slice of every global batch (`training.loop.batches`),
  its loss weighted by its share of the update's examples (`loss_shares`), gradients summed over ranks,
  so the update is the same however the batch is split over ranks and micro-batches; with `--fsdp=true` the
  model is sharded over the ranks (FSDP, `training.distributed.shard_model`) and gathered whole for
  checkpoints and, after training, for evaluation;
* AdamW with linear warm-up and decay (an optional separate learning rate for the new head), clipping
  (or each code base's own: BertAdam without bias correction, decay on every tensor, per-tensor clipping);
* checkpoints every `ckpt_every` updates (rank 0, atomic), resumed exactly: data position, optimizer,
  schedule and dropout seeds (`start_or_resume`);
* a progress bar and OUT/metrics.jsonl records of the loss, learning rate and gradient norm.

`FinetuneConfig` holds these loop settings; each task's run config extends it with its files and defaults.
A task recipe reads top to bottom as

    cfg, out, device, dist = start_finetune(cfg, "nlvr2", required=("init", "train_statements", "features"))
    ... read the data and the store, build the model ...
    features, mismatch = check_features(store, cfg.init, dist)   # a warning if init was trained on other features
    final = finetune_loop(cfg, out=out, model=model, ..., tokenizer=tok)   # OUT/model, or None if stopped
    ... predict, score, write metrics.json (with **mismatch) ...

and passes `extra={..., "features": features}` so that the fine-tuned model records the features it was
trained on, as the pre-trained one did.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor, nn

from vlberts.data.sampling import Position, update_seed
from vlberts.errors import BadRecords, VlbertsError
from vlberts.features.identity import warn_feature_mismatch
from vlberts.features.store import RegionStore
from vlberts.models.blocks import DEFAULT_ATTENTION_KERNEL, AttentionKernel, use_attention_kernel
from vlberts.recipes.common import ATTENTION_KERNEL_HELP, BIAS_CORRECTION_HELP, CLIP_PER_TENSOR_HELP, COMPILE_HELP, COMPILE_MODE_HELP, DECAY_ALL_HELP, FLOAT16_BATCHES_HELP, FSDP_HELP, OPTIMIZER_HELP, PRECISION_HELP, PREFETCH_HELP, TENSORBOARD_HELP, WARMUP_HELP, CompileMode, autocast, compile_model, fit_text_len, float16_batches, opt, own_gradients, progress, replays_cuda_graphs, require_compiler, resolve_device, start_recipe
from vlberts.text.tokenizer import TextTokenizer
from vlberts.models.weights import find_weights
from vlberts.training.checkpoint import TrainState, load_built, read_model_config, save_checkpoint, save_model_dir
from vlberts.training.distributed import (
    DistInfo,
    GradientSync,
    broadcast_parameters,
    check_ranks_agree,
    gather_for_inference,
    init_distributed,
    is_sharded,
    local_device,
    shard_model,
    sum_over_ranks,
)
from vlberts.training.loop import (batches, feed, loss_scaler, loss_shares, require_finite, scaler_state, to_device,
                                   start_or_resume, update)
from vlberts.training.metrics import MetricsLog
from vlberts.training.optim import (build_optimizer, check_lr_schedule, check_optimizer, linear_warmup_decay,
                                   warmup_step_decay, warmup_steps)


@dataclass(frozen=True)
class FinetuneConfig:
    """The settings of the shared fine-tuning loop (module docstring)."""

    init: str = opt("", "pre-trained vlberts model directory (e.g. a pretrain run's RUN/model)")
    features: str = opt("", "region-feature store holding every image")
    out: str = opt("runs/finetune", "run directory")
    epochs: float = opt(10.0, "passes over the training examples")
    batch_size: int = opt(64, "examples per micro-batch")
    grad_accum: int = opt(1, "micro-batches per update")
    lr: float = opt(5e-5, "peak learning rate")
    head_lr_mult: float = opt(1.0, "learning-rate multiplier of the freshly initialised head (its weights decayed "
                              "as the body's, its biases and LayerNorms not)")
    warmup: float = opt(0.1, WARMUP_HELP)
    weight_decay: float = opt(0.01, "AdamW weight decay (not on biases and LayerNorm unless --decay_all)")
    clip: float = opt(1.0, "gradient-norm clipping; 0 disables")
    clip_per_tensor: bool = opt(False, CLIP_PER_TENSOR_HELP)
    bias_correction: bool = opt(True, BIAS_CORRECTION_HELP)
    decay_all: bool = opt(False, DECAY_ALL_HELP)
    optimizer: Literal["adamw", "sgd"] = opt("adamw", OPTIMIZER_HELP)
    momentum: float = opt(0.9, "SGD momentum (--optimizer=sgd)")
    lr_schedule: Literal["linear", "step"] = opt("linear", "after the warm-up: linear (decay to 0 at the last update) "
                                                   "or step (x --lr_factor after each of --lr_steps epochs: "
                                                   "VL-BERT's VCR configs)")
    lr_steps: tuple[float, ...] = opt((), "epochs after which --lr_schedule=step multiplies the rate by --lr_factor "
                                      "(comma list, e.g. 14,18)")
    lr_factor: float = opt(0.1, "the step schedule's factor")
    seed: int = opt(0, "seed of head initialisation and data order")
    log_every: int = opt(10, "updates between metrics records")
    ckpt_every: int = opt(500, "updates between checkpoints")
    device: str = opt("auto", "auto, cpu, cuda, cuda:N")
    precision: str = opt("auto", PRECISION_HELP)
    length_group: int = opt(0, "batch examples of similar length within windows of this many batches (less padding); 0: off")
    num_workers: int = opt(0, "DataLoader worker processes")
    prefetch: int = opt(-1, PREFETCH_HELP)
    tensorboard: bool = opt(False, TENSORBOARD_HELP)
    preload_features: bool = opt(False, "read the whole region store into memory first (for stores that fit)")
    float16_batches: str = opt("auto", FLOAT16_BATCHES_HELP)
    stop_after: int = opt(0, "stop after this many updates in this invocation, as if interrupted")
    fsdp: bool = opt(False, FSDP_HELP)
    compile: bool = opt(False, COMPILE_HELP)
    compile_mode: CompileMode = opt("default", COMPILE_MODE_HELP)
    attention_kernel: tuple[AttentionKernel, ...] = opt(DEFAULT_ATTENTION_KERNEL, ATTENTION_KERNEL_HELP)


def start_finetune(cfg: Any, task: str, required: Sequence[str]) -> tuple[Any, Path, torch.device, DistInfo]:
    """The start every fine-tuning recipe shares: threads, device, the process group under torchrun (this
    rank's device), a one-line error for each required setting left empty, and the text length checked
    against the position table of the model at `cfg.init` before any data is read (`fit_text_len`: the
    task's default capped at a shorter table, another value beyond it an error). Returns (cfg, out, device,
    dist), cfg with the text length the run uses (and records in OUT/run_config.json)."""
    cfg = start_recipe(cfg)
    device = resolve_device(cfg.device)
    require_compiler(cfg.compile, device)
    use_attention_kernel(cfg.attention_kernel)  # a bad setting stops the run here; compiled graphs keep the kernel
    dist = init_distributed(device.type)
    check_ranks_agree(dist, cfg, Path(cfg.out))  # the same command, data and OUT on every machine
    device = local_device(device, dist)
    for key in required:
        if not getattr(cfg, key):
            raise VlbertsError(f"finetune {task} needs --{key}")
    float16_batches(cfg.float16_batches, device)  # a bad setting stops the run before any data is read
    warmup_steps(cfg.warmup, 1)  # so does a bad --warmup
    check_optimizer(cfg.optimizer, cfg.bias_correction, cfg.momentum)  # and contradictory optimizer settings
    check_lr_schedule(cfg.lr_schedule, cfg.lr_steps, cfg.lr_factor)
    cfg = fit_text_len(cfg, read_model_config(cfg.init)[0], cfg.init)
    return cfg, Path(cfg.out), device, dist


def open_features(cfg: FinetuneConfig, device: torch.device) -> tuple[RegionStore, bool]:
    """The run's region store (`--features`, read into memory first with `--preload_features`) and whether its
    training batches carry float16 features as a float16 store holds them (`--float16_batches`): the store then
    hands them over as stored, the training dataset keeps them (its `float16`), and `Batch.to` widens them on
    the device. Evaluation datasets read the same store and widen in the loader, as before."""
    float16 = float16_batches(cfg.float16_batches, device)
    store = RegionStore(cfg.features, upcast=not float16)
    if cfg.preload_features:
        store.preload()
    return store, float16


def check_features(store: Any, init: str | Path, dist: DistInfo | None = None,
                   ignore: Sequence[str] = ()) -> tuple[dict[str, Any], dict[str, str]]:
    """The store's feature identity (`features.identity`), for the fine-tuned model's config.json
    ("features"), and {"feature_mismatch": line} for metrics.json when `init`'s config.json records the
    features of another extractor or settings (other than the settings named in `ignore`), the line also
    printed once as a warning (rank 0); else {}. Never an error: fine-tuning on other features can be
    deliberate."""
    identity, line = warn_feature_mismatch(store, init, main=dist is None or dist.main, ignore=ignore)
    return identity, {} if line is None else {"feature_mismatch": line}


def require_eval_examples(examples: Sequence[Any], path: str) -> None:
    """An evaluation file given but nothing left to evaluate (an empty file, or every record skipped) is an
    error before training, not a run that ends without a score."""
    if path and not examples:
        raise VlbertsError("no example to evaluate (the file holds none, or --skip_bad dropped them all)", path=path)


def require_train_examples(examples: Sequence[Any], path: str, why: str = "") -> None:
    """Nothing left to train on is an error naming the training file (and, given `why`, what removed the
    examples), before a loader is asked for batches of nothing."""
    if not examples:
        raise VlbertsError(f"no example to train on ({why or 'the file holds none, or --skip_bad dropped them all'})",
                           path=path)


def labelled_evaluation(examples: list[Any], labelled: Callable[[Any], bool], record: Callable[[Any], object],
                        path: str, bad: BadRecords) -> list[Any]:
    """The evaluation examples, checked before training: a file without labels (a hidden test split) is
    predicted only; in a labelled file a record without its label is bad (`record` names it): an error, or
    with --skip_bad dropped and counted ("missing label"), so that the rest is scored."""
    if not any(labelled(ex) for ex in examples):
        return examples
    for ex in examples:
        if not labelled(ex):
            bad.handle(VlbertsError("no label, where the file's other records have one", path=path, record=record(ex)),
                       "missing label")
    return [ex for ex in examples if labelled(ex)]


def all_labelled(examples: Sequence[Any], labelled: Callable[[Any], bool]) -> bool:
    """Whether the evaluation examples (`labelled_evaluation`'s: all labelled or none) can be scored."""
    return bool(examples) and all(labelled(ex) for ex in examples)


def read_task_model(directory: str | Path, task: str, name: str, hint: str = "") -> tuple[Any, dict]:
    """(model config, config.json) of a model directory fine-tuned on `task` (its `finetune_loop` wrote
    "task" into config.json); any other directory is a one-line error calling the task `name`."""
    model_cfg, meta = read_model_config(directory)
    if meta.get("task") != task:
        raise VlbertsError(f"not a fine-tuned {name} model (config.json has no task {task!r}){hint}",
                           path=Path(directory) / "config.json")
    return model_cfg, meta


def load_task_weights(build: Callable[[], nn.Module], directory: str | Path) -> nn.Module:
    """The task model `build()` makes from `read_task_model`'s config, holding the directory's weights
    (`load_built`: strictly, without drawing the initialisation they replace)."""
    return load_built(build, find_weights(directory))


def num_updates(cfg: FinetuneConfig, examples: int) -> int:
    """Updates of `cfg.epochs` passes over `examples` (at least one)."""
    return max(1, round(cfg.epochs * examples / (cfg.batch_size * cfg.grad_accum)))


def finetune_loop(
    cfg: FinetuneConfig,
    *,
    out: Path,
    model: nn.Module,
    model_cfg: Any,
    data: Any,
    collate: Callable[[list], Any],
    loss: Callable[[Any], Tensor],
    count: Callable[[Any], float],
    label: str,
    device: torch.device,
    dist: DistInfo,
    extra: dict[str, Any] | None = None,
    head_prefixes: Sequence[str] = ("classifier.",),
    lengths: Any = None,
    tokenizer: TextTokenizer | None = None,
) -> Path | None:
    """Train `model` on `data` for `num_updates(cfg, len(data))` updates, then write the model directory
    OUT/model (weights, config with `extra`, and the `tokenizer`'s vocabulary; rank 0) and return it; None
    when stopped early by `stop_after` (a checkpoint to resume from is on disk then, if one was due).

    `collate` turns a list of `data` items into a batch with a `.to(device)`; `loss(batch)` is the batch's
    mean loss (the model is called inside); `count(batch)` the number of examples that mean is over (the
    loss weights by it across micro-batches and ranks). `extra` goes into every checkpoint's config.json.
    Parameters whose names start with one of `head_prefixes` form the head (`head_lr_mult`).
    """
    model.to(device)
    if cfg.fsdp:  # in place: the task's `loss` closure calls this same module (training/distributed.py)
        shard_model(model, dist)
    if cfg.compile:  # in place too, so the `loss` closure runs the compiled forward; state dict names unchanged
        compile_model(model, cfg.compile_mode)
    graphs = replays_cuda_graphs(cfg.compile, cfg.compile_mode, device)  # then each micro-batch's gradients are copied out
    steps = num_updates(cfg, len(data))
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, head_prefixes=head_prefixes, head_lr_mult=cfg.head_lr_mult,
                                bias_correction=cfg.bias_correction, decay_all=cfg.decay_all, kind=cfg.optimizer,
                                momentum=cfg.momentum)
    if cfg.lr_schedule == "step":  # milestones in updates: an epoch is steps / epochs of them
        milestones = [int(e * steps / cfg.epochs) for e in cfg.lr_steps]
        scheduler = warmup_step_decay(optimizer, warmup_steps(cfg.warmup, steps), milestones, cfg.lr_factor)
    else:
        scheduler = linear_warmup_decay(optimizer, warmup_steps(cfg.warmup, steps), steps)

    scaler = loss_scaler(device, cfg.precision, sharded=is_sharded(model))  # fp16 only; a no-op otherwise

    state, resumed = start_or_resume(out, cfg, model, optimizer, scheduler, write=dist.main)
    if "grad_scaler" in state.extra:
        scaler.load_state_dict(state.extra["grad_scaler"])
    log = (MetricsLog(out / "metrics.jsonl", resume_step=state.step if resumed else None, tensorboard=cfg.tensorboard)
           if dist.main else None)
    broadcast_parameters(model, dist)
    grads = GradientSync(model, dist)  # the ranks' gradients summed while backward runs
    stream = batches(
        data, collate, batch_size=cfg.batch_size, seed=cfg.seed, start=Position.from_dict(state.data),
        num_workers=cfg.num_workers,
        lengths=lengths if cfg.length_group > 1 else None, group=cfg.length_group, dist=dist,
    )

    model.train()
    step, done_here = state.step, 0
    t0 = time.perf_counter()
    # On a GPU drawn ahead in a thread and pinned there: the host collates while the device computes.
    with progress(disable=None if dist.main else True) as bar, feed(stream, device, cfg.prefetch) as ahead:
        bar_task = bar.add_task(label, total=steps, completed=step, info="")
        while step < steps:
            torch.manual_seed(update_seed(cfg.seed, step, dist.rank))  # dropout: the same on a resume
            total: Any = 0.0  # on the device until logged (`pretrain`: no read-back each update)
            micro = []
            for _ in range(cfg.grad_accum):
                batch, pos = next(ahead)
                micro.append(batch)
            # Each micro-batch's mean loss weighs by its share of the update's examples on every rank,
            # so the update is the same however it is split (`loss_shares`). Counted on the host batches.
            shares = loss_shares([{"loss": float(count(b))} for b in micro], dist)
            for i, batch in enumerate(micro):
                batch = to_device(batch, device)  # on a GPU copied beside the previous update's kernels
                if graphs:  # each forward starts a new step of the CUDA graphs (the loop keeps no output of the last)
                    torch.compiler.cudagraph_mark_step_begin()
                with autocast(device, cfg.precision):
                    value = loss(batch).float()
                value = value * shares[i]["loss"]  # read after the forward: the ranks' counts were summed meanwhile
                grads.backward(scaler.scale(value), last=i == len(micro) - 1)
                if graphs and i < len(micro) - 1:
                    own_gradients(model)
                total = total + value.detach()
            grads.finish()
            grad_norm = update(model, optimizer, scheduler, cfg.clip, scaler, cfg.clip_per_tensor)
            step += 1
            done_here += 1
            bar.update(bar_task, completed=step)
            log_step = step % cfg.log_every == 0 or step == steps
            if log_step or step % cfg.ckpt_every == 0:  # the update's loss: the ranks' shares summed
                total = sum_over_ranks({"loss": float(total)}, dist)["loss"]
                require_finite({"loss": total}, step, scaler)  # never checkpoint a diverged model
                bar.update(bar_task, info=f"loss {total:.3f}")
                if log is not None and log_step:
                    scale = {"loss_scale": scaler.get_scale()} if scaler.is_enabled() else {}
                    log.write({"step": step, "loss": total, "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                               **scale, "seconds": round(time.perf_counter() - t0, 3)})
            if step % cfg.ckpt_every == 0 or step == steps:  # every rank: a sharded model is gathered; rank 0 writes
                save_checkpoint(out, model=model, cfg=model_cfg, optimizer=optimizer, scheduler=scheduler,
                                state=TrainState(step=step, data=pos.to_dict(), extra=scaler_state(scaler)),
                                model_extra=extra or {},
                                write=dist.main)
            if cfg.stop_after and done_here >= cfg.stop_after and step < steps:
                break
    if log is not None:
        log.close()
    if step < steps:  # stopped by --stop_after, as if interrupted
        return None
    final = out / "model"
    save_model_dir(final, model, model_cfg, extra=extra, write=dist.main, tokenizer=tokenizer)
    # Sharded, every rank now holds the whole model, so that each can predict its own slice of the
    # evaluation examples (any number of batches) with no collective in the forward.
    gather_for_inference(model)
    return final
