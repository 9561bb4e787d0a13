"""Checkpoints: safetensors + JSON, written atomically, resumed exactly (SPEC §6).

A model directory holds `model.safetensors` and `config.json` ({"format", "arch", "config", ...}).
A training checkpoint is a model directory plus `optimizer.safetensors` and `state.json` (step,
scheduler, data position, RNG states), under `RUN/checkpoints/step_NNNNNNNN/`. The directory is built
under a temporary name and renamed; `RUN/checkpoints/latest` (written atomically last) names the
newest complete one, so an interrupted run resumes from it and loses only the steps since.

A model sharded by FSDP (`training.distributed.shard_model`) is gathered whole on saving (every rank
calls the save, a collective; only the `write` rank writes) and sharded again on restoring, so its files
are exactly an unsharded run's: a checkpoint resumes with or without FSDP, on any number of processes.
"""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from vlberts.config import to_dict
from vlberts.errors import VlbertsError
from vlberts.io import (atomic_dir, atomic_open, atomic_path, read_json, read_text, refuse_run_directory, remove_path,
                        write_json)
from vlberts.models.builders import arch_of, build_pretraining_model, config_from_dict, init_skipped
from vlberts.models.encoders import ENCODER_PREFIX, load_encoder_module
from vlberts.models.vlbert import require_region_features
from vlberts.models.weights import first_nonfinite, load_into, read_safetensors, read_state_dict, tied_aliases
from vlberts.training.distributed import full_tensor, is_sharded, shard_like

if TYPE_CHECKING:
    from vlberts.text.tokenizer import TextTokenizer

FORMAT = "vlberts/1"


# --------------------------------------------------------------------------- model directories

def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """State dict without tied aliases (safetensors refuses shared storage), contiguous, on CPU; a sharded
    model's whole tensors (a collective)."""
    aliases = tied_aliases(model)
    state = model.state_dict()
    return {k: full_tensor(v.detach()).to("cpu").contiguous() for k, v in state.items() if k not in aliases}


def save_model_dir(
    directory: str | Path, model: nn.Module, cfg: Any, extra: dict[str, Any] | None = None, *, write: bool = True,
    tokenizer: TextTokenizer | None = None,
) -> None:
    """Write `model.safetensors` + `config.json` (and, given a `tokenizer`, its `vocab.txt` and
    `tokenizer_config.json`) into `directory`, each file atomically and `config.json` last: a directory
    with `config.json` is complete, which is how a continued demo or comparison tells a finished run (an
    interruption between the files leaves none). Distributed, every rank calls it and only `write` (rank 0)
    writes: a sharded model is gathered from all ranks first."""
    if not write and not is_sharded(model):
        return
    state = _unique_state(model)
    if write:
        _write_model_dir(Path(directory), state, cfg, extra, tokenizer)


def _write_model_dir(directory: Path, state: dict[str, torch.Tensor], cfg: Any, extra: dict[str, Any] | None,
                     tokenizer: TextTokenizer | None = None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tokenizer.save(directory)
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file(state, str(tmp), metadata={"format": FORMAT})
    write_json(directory / "config.json", {"format": FORMAT, "arch": arch_of(cfg), "config": to_dict(cfg), **(extra or {})})


def read_model_config(directory: str | Path) -> tuple[Any, dict[str, Any]]:
    """The architecture config and the whole `config.json` of a vlberts model directory."""
    directory = Path(directory)
    refuse_run_directory(directory, "config.json")
    meta = read_json(directory / "config.json")
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise VlbertsError(f"not a vlberts model directory (config.json format is not {FORMAT!r})", path=directory / "config.json")
    if not isinstance(meta.get("arch"), str) or not isinstance(meta.get("config"), dict):
        raise VlbertsError("config.json needs \"arch\" (a name) and \"config\" (an object)", path=directory / "config.json")
    try:
        cfg = config_from_dict(meta["arch"], meta["config"])
    except VlbertsError as e:
        raise VlbertsError(e.message, path=directory / "config.json") from None
    require_vocab_fits(directory / "vocab.txt", cfg)
    require_config_fits_weights(directory, cfg, meta)
    return cfg, meta


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(str(n) for n in shape) or "a scalar"


def require_config_fits_weights(directory: Path, cfg: Any, meta: dict[str, Any]) -> None:
    """config.json's sizes against the shapes in model.safetensors, before a model is built from them. A
    config.json whose sizes the weights do not have describes a model they cannot load, and one with sizes far
    beyond them (a damaged file) would first allocate that model, or build layers for minutes. The
    pre-training model of the config is built on the meta device (no memory, no values): every tensor it
    shares by name with the file must have the file's shape, and a pre-trained directory's file must hold
    every tensor it has. Settings config.json lacks (their defaults were used) are named. A missing or
    unreadable weights file is left to the loading, which names it."""
    weights = directory / "model.safetensors"
    if not weights.is_file():
        return
    try:
        with safe_open(str(weights), framework="pt") as f:
            shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception:  # noqa: BLE001 -- a damaged file: `read_safetensors` reports it when the model loads it
        return
    with torch.device("meta"):
        model = build_pretraining_model(cfg, initialise=False)
    lacking = sorted(set(to_dict(cfg)) - set(meta["config"]))
    hint = f" (config.json lacks {', '.join(lacking)}: the defaults were used)" if lacking else ""
    for name, t in model.state_dict().items():
        if name in shapes and tuple(t.shape) != shapes[name]:
            raise VlbertsError(f"does not fit model.safetensors: {name} is {_shape(shapes[name])} there but "
                               f"{_shape(tuple(t.shape))} in the model these sizes describe{hint}",
                               path=directory / "config.json")
    if "task" not in meta:  # a fine-tuned directory holds its encoder (compared above) and its head, not these heads
        aliases = tied_aliases(model)  # stored once, under the first name
        absent = [name for name in model.state_dict() if name not in shapes and name not in aliases]
        if absent and lacking:  # else the strict loading names the file's misfit as it finds it
            raise VlbertsError(f"does not fit model.safetensors: the model these sizes describe has {absent[0]}, "
                               f"which the weights lack ({len(absent)} tensors){hint}", path=directory / "config.json")


def require_vocab_fits(vocab: Path, cfg: Any, holder: str = "the model in config.json") -> None:
    """A vocab.txt with more tokens than the model (`holder`, for the message) has word embeddings is another
    model's vocabulary: its extra tokens would index past the table. Fewer is allowed (tables padded to a
    multiple of 8 or 64). Model directories and `models import` alike."""
    size = getattr(cfg, "vocab_size", None)
    if size is None or not vocab.is_file():
        return
    with open(vocab, "rb") as f:
        tokens = sum(1 for _ in f)
    if tokens > size:
        raise VlbertsError(f"holds {tokens} tokens but {holder} has {size} word embeddings "
                           "(a vocabulary from another model?)", path=vocab)


def load_built(build: Callable[[], nn.Module], weights: Path) -> nn.Module:
    """The model `build()` makes, holding every tensor of the weights file (strictly: `load_into`). It is
    built without drawing the random initialisation the weights replace (`init_skipped`: ~2 s for a base
    model on 2 cores); the file is read first, so a missing or damaged one is reported before any building."""
    sd = read_state_dict(weights)
    with init_skipped():
        model = build()
    load_into(model, sd, source=weights)
    return model


def load_pretraining_model(directory: str | Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    """Build the pre-training model a directory describes and load its weights (strictly)."""
    directory = Path(directory)
    cfg, meta = read_model_config(directory)
    return load_built(lambda: build_pretraining_model(cfg), directory / "model.safetensors"), cfg, meta


def load_attention_model(directory: str | Path) -> tuple[nn.Module, Any, dict[str, Any]]:
    """The model whose attention maps and hidden states an analysis reads (`model.encode`), with the whole
    `config.json`. A pre-trained model directory loads as `load_pretraining_model` does; a fine-tuned one
    (config.json names its "task": VQA, NLVR2, RefCOCO+, ...) loads its encoder, strictly, into the
    pre-training model of its architecture, whose heads no analysis reads: they are built without drawing
    random weights (`init_skipped`, ~2 s for a base model) and left at zero. An end-to-end VL-BERT, which reads
    pixels where the analyses give region features, is a one-line error before its weights are read."""
    cfg, meta = read_model_config(directory)
    require_region_features(cfg, "Each analysis (analyze grounding, attention-graphs, representations)")
    if "task" not in meta:
        return load_pretraining_model(directory)
    model = build_pretraining_model(cfg, initialise=False)
    arch = arch_of(cfg)
    encoder = getattr(model, ENCODER_PREFIX[arch])
    load_encoder_module(encoder, arch, directory)
    loaded = {id(p) for p in encoder.parameters()}  # (a decoder tied to the word embeddings is one of them)
    with torch.no_grad():
        for p in model.parameters():
            if id(p) not in loaded:
                p.zero_()
    return model, cfg, meta


# --------------------------------------------------------------------------- RNG

def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    np_state = np.random.get_state()
    py_state = random.getstate()
    meta = {
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    return tensors, meta


def set_rng_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    torch.set_rng_state(tensors["rng.torch"])
    cuda = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)
    n = meta["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    p = meta["python"]
    random.setstate((p[0], tuple(p[1]), p[2]))


# --------------------------------------------------------------------------- training checkpoints

def _flatten_optimizer(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for name, v in st.items():
            if isinstance(v, torch.Tensor):  # a sharded parameter's state is sharded too: gathered whole
                tensors[f"state.{idx}.{name}"] = full_tensor(v.detach()).to("cpu").contiguous()
            else:
                scalars[f"{idx}.{name}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {}
    for key, v in tensors.items():
        _, idx, name = key.split(".", 2)
        state.setdefault(int(idx), {})[name] = v
    for key, v in meta["scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = v
    return {"state": state, "param_groups": meta["param_groups"]}


@dataclass
class TrainState:
    """What a resumed run needs besides the weights."""

    step: int  # optimizer updates done
    data: dict[str, Any]  # the data position, e.g. {"epoch": 1, "index": 4096}
    extra: dict[str, Any]


def save_checkpoint(
    run_dir: str | Path,
    *,
    model: nn.Module,
    cfg: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    state: TrainState,
    model_extra: dict[str, Any] | None = None,
    keep: int = 2,
    write: bool = True,
) -> Path | None:
    """Atomically write a full training checkpoint and point `latest` at it; keep the newest `keep`.
    Distributed, every rank calls it and only `write` (rank 0) writes (a sharded model and its optimizer
    state are gathered from all ranks first); returns the checkpoint directory, None where not written."""
    if not write and not is_sharded(model):
        return None
    weights = _unique_state(model)
    opt_tensors, opt_meta = _flatten_optimizer(optimizer)
    if not write:
        return None
    ckpt_root = Path(run_dir) / "checkpoints"
    name = f"step_{state.step:08d}"
    with atomic_dir(ckpt_root / name, overwrite=True) as tmp:
        _write_model_dir(tmp, weights, cfg, model_extra)
        rng_tensors, rng_meta = rng_state()
        save_file({**opt_tensors, **rng_tensors}, str(tmp / "optimizer.safetensors"))
        write_json(
            tmp / "state.json",
            {
                "step": state.step,
                "data": state.data,
                "extra": state.extra,
                "optimizer": opt_meta,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "rng": rng_meta,
            },
        )
    with atomic_open(ckpt_root / "latest") as f:
        f.write(name + "\n")
    old = sorted(p for p in ckpt_root.glob("step_*") if p.is_dir() and p.name != name)
    for p in old[: max(0, len(old) - (keep - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    # Half-written leftovers of a writer killed mid-checkpoint (rank 0 is the only writer, so any other
    # temporary here is stale): never read (`latest` names complete ones only), removed now.
    for p in [*ckpt_root.glob(".step_*.tmp"), *ckpt_root.glob(".step_*.old"), *ckpt_root.glob(".latest.*.tmp")]:
        remove_path(p, ignore_errors=True)
    return ckpt_root / name


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    pointer = Path(run_dir) / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    name = read_text(pointer).strip()
    path = pointer.parent / name
    if not re.fullmatch(r"step_\d+", name) or not (path / "state.json").is_file():
        have = sorted(p.name for p in pointer.parent.glob("step_*") if (p / "state.json").is_file())
        what = "is incomplete" if path.is_dir() else "does not exist"
        hint = f"; complete checkpoints here: {', '.join(have)} (write one of them into {pointer})" if have else ""
        raise VlbertsError(f"the checkpoint named by 'latest' {what}{hint}", path=path)
    return path


def _require_finite_tensors(tensors: dict[str, torch.Tensor], *, path: Path) -> None:
    """A checkpoint is written only after its update's losses were checked, so NaN or inf in it means a
    damaged file; resuming from it would fail only at the next log step, blaming the learning rate."""
    key = first_nonfinite(tensors)
    if key is not None:
        raise VlbertsError(f"tensor {key} holds NaN or inf (a damaged checkpoint); {_earlier_hint(path)}", path=path)


def _earlier_hint(path: Path) -> str:
    """For a damaged file of checkpoint step_N (`path`): how to resume from the one before it."""
    earlier = sorted(q.name for q in path.parent.parent.glob("step_*") if q.name < path.parent.name)
    return f"write {earlier[-1]} into checkpoints/latest to resume from it" if earlier else "start a new run"


def _read_checkpoint_file(path: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's safetensors file; one that cannot be read (cut short by a crash of the machine) is an
    error saying how to resume from the checkpoint before it."""
    try:
        return read_safetensors(path)
    except VlbertsError as e:
        raise VlbertsError(f"{e.message}; {_earlier_hint(path)}", path=path) from None


def restore_checkpoint(
    path: str | Path, *, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> TrainState:
    """Load weights, optimizer, scheduler and RNG states from a training checkpoint directory. A sharded
    model (and its optimizer) takes this rank's shards of the whole tensors every rank reads."""
    path = Path(path)
    weights = _read_checkpoint_file(path / "model.safetensors")
    tensors = _read_checkpoint_file(path / "optimizer.safetensors")
    for name, stored in (("model.safetensors", weights), ("optimizer.safetensors", tensors)):
        _require_finite_tensors(stored, path=path / name)
    if is_sharded(model):
        own = model.state_dict()
        weights = {k: shard_like(v, own[k]) if k in own and own[k].shape == v.shape else v for k, v in weights.items()}
    load_into(model, weights, source=path / "model.safetensors")
    meta = read_json(path / "state.json")
    named = re.fullmatch(r"step_(\d+)", path.name)
    if named and meta.get("step") != int(named.group(1)):  # an edited file: it would skip or repeat updates
        raise VlbertsError(f"step {meta.get('step')!r} disagrees with the checkpoint's name {path.name}",
                           path=path / "state.json")
    opt_tensors = {k: v for k, v in tensors.items() if k.startswith("state.")}
    opt_state = _unflatten_optimizer(opt_tensors, meta["optimizer"])
    if is_sharded(model):  # each parameter's moments laid out as the parameter (indices: param_groups order)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for idx, st in opt_state["state"].items():
            for name, v in st.items():
                if isinstance(v, torch.Tensor) and idx < len(params) and v.shape == params[idx].shape:
                    st[name] = shard_like(v, params[idx])
    try:
        optimizer.load_state_dict(opt_state)
    except ValueError as e:  # other parameter groups: a checkpoint of another vlberts version or another model
        raise VlbertsError(f"the optimizer state does not fit this run's parameter groups ({e}); the checkpoint was "
                           "written by another version of vlberts or for another model: start the run in a new --out",
                           path=path / "state.json") from None
    if scheduler is not None and meta["scheduler"] is not None:
        scheduler.load_state_dict(meta["scheduler"])
    set_rng_state({k: v for k, v in tensors.items() if k.startswith("rng.")}, meta["rng"])
    return TrainState(step=meta["step"], data=meta["data"], extra=meta["extra"])


def dumps_config(cfg: Any) -> str:
    return json.dumps(to_dict(cfg), indent=2)
