"""Loading weight files safely and mapping foreign key layouts onto ours.

Our own checkpoints are safetensors + JSON. Foreign `.bin`/`.pth` files are read with
`torch.load(weights_only=True)`, which refuses arbitrary pickled objects.
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from vlberts.errors import first_line, VlbertsError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def find_weights(path: str | Path) -> Path:
    """A weights file, or the standard weights file inside a checkpoint directory."""
    path = Path(path)
    if path.is_dir():
        for name in WEIGHT_FILES:
            if (path / name).is_file():
                return path / name
        raise VlbertsError(f"no weights file ({' or '.join(WEIGHT_FILES)}) in directory", path=path)
    if not path.is_file():
        raise VlbertsError("weights file not found", path=path)
    return path


def read_safetensors(path: str | Path) -> dict[str, Tensor]:
    """A safetensors file as name -> tensor (on CPU); a missing, truncated or corrupt file is a one-line
    `VlbertsError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise VlbertsError("weights file not found", path=path)
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors' own errors: bad header, truncated data, ...
        raise VlbertsError(f"cannot read weights: {first_line(e)}", path=path) from None


def read_state_dict(path: str | Path) -> dict[str, Tensor]:
    """Read a safetensors or PyTorch weights file into a flat name -> tensor dict (on CPU)."""
    path = find_weights(path)
    if path.suffix == ".safetensors":
        return read_safetensors(path)
    with open(path, "rb") as f:
        head = f.read(4)
    # torch.save writes a zip archive (since PyTorch 1.6) or, before, a pickle (protocol opcode 0x80); anything
    # else (an HDF5 store, a text file) would reach the unpickler and read as "refused objects".
    if not head.startswith((b"PK", b"\x80")):
        raise VlbertsError(f"cannot read weights: not a PyTorch weights file (it starts with {head!r}, where "
                           "torch.save writes a zip archive or a pickle)", path=path)
    try:
        with warnings.catch_warnings():  # e.g. a plain pickle's legacy-format UserWarning: the error below says it
            warnings.simplefilter("ignore")
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not str(e).startswith("Weights only load failed"):  # e.g. "pickle data was truncated"
            raise VlbertsError(f"cannot read weights (truncated, corrupt, or not a PyTorch weights file): "
                               f"{first_line(e)}", path=path) from None
        # weights_only refused an object (never retried without): torch's message has boilerplate lines
        # around the one that says what was refused
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        what = next((ln for ln in lines if not ln.startswith(("Weights only load failed", "Please file an issue",
                                                              "Check the documentation"))), first_line(e))
        raise VlbertsError(f"refused: the file holds pickled objects other than tensors ({what}); a weights file "
                           "loads only as a state dict of tensors (torch.load weights_only=True)", path=path) from None
    except Exception as e:  # truncated or corrupt file, not a torch file, ...
        raise VlbertsError(f"cannot read weights (truncated, corrupt, or not a PyTorch weights file): {first_line(e)}",
                           path=path) from None
    if isinstance(sd, dict) and "state_dict" in sd and isinstance(sd["state_dict"], dict):
        sd = sd["state_dict"]  # common training-checkpoint wrapper
    if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
        raise VlbertsError("weights file does not hold a flat name -> tensor state dict", path=path)
    return sd


def hf_setting_missing(hf: Mapping, where: str, key: str) -> VlbertsError:
    """The error for a Hugging Face config.json without `key`; a vlberts model directory's config.json (which
    a Hugging Face loader was given by mistake) is told apart, with the loader it needs."""
    if str(hf.get("format", "")).startswith("vlberts/"):
        return VlbertsError(f"{where}: a vlberts model directory, not a Hugging Face one: load it with "
                            "vlberts.training.checkpoint.load_pretraining_model (or load_attention_model)")
    return VlbertsError(f"{where} lacks {key}")


def rename_keys(sd: dict[str, Tensor], rules: list[tuple[str, str]]) -> dict[str, Tensor]:
    """Apply regex substitutions in order to every key; a rule mapping to "" drops the key."""
    out = {}
    for k, v in sd.items():
        k = rename_key(k, rules)
        if k:
            out[k] = v
    return out


def rename_key(key: str, rules: list[tuple[str, str]]) -> str:
    """One key through `rename_keys`' rules ("" = dropped)."""
    for pat, rep in rules:
        key = re.sub(pat, rep, key)
    return key


def layer_count(sd: Mapping[str, Tensor], prefix: str) -> int:
    """How many numbered layers a state dict holds under `prefix` ("encoder.layer." -> 0, 1, ...): what a
    released file without a config says of its depth."""
    return len({k[len(prefix):].split(".")[0] for k in sd if k.startswith(prefix)})


def dim_of(sd: Mapping[str, Tensor], key: str, axis: int = 0, default: int = 0) -> int:
    """`sd[key].shape[axis]`, or `default` when the file lacks the tensor (a config read off the weights)."""
    return int(sd[key].shape[axis]) if key in sd else default


def leave_out(sd: dict[str, Tensor], heads: Mapping[str, str]) -> tuple[dict[str, Tensor], str | None]:
    """`sd` without the keys under the task-head prefixes `heads` (prefix -> the head's name, e.g.
    {"vil_prediction.": "vil_prediction"}), and a line naming what was left out (None: nothing was), for
    the model's `left_out_head`: a fine-tuned file's task heads have no place in a pre-training model."""
    kept, dropped = {}, {}
    for k, v in sd.items():
        prefix = next((p for p in heads if k.startswith(p)), None)
        if prefix is None:
            kept[k] = v
        else:
            dropped[heads[prefix]] = dropped.get(heads[prefix], 0) + 1
    if not dropped:
        return kept, None
    n = sum(dropped.values())
    return kept, (f"the fine-tuning head{'s' if len(dropped) > 1 else ''} {', '.join(dropped)} "
                  f"({n} tensor{'s' if n > 1 else ''})")


def load_into(
    model: nn.Module,
    sd: dict[str, Tensor],
    *,
    source: str | Path,
    allow_missing: Callable[[str], bool] = lambda k: False,
    allow_unexpected: Callable[[str], bool] = lambda k: False,
    file_names: dict[str, str] | None = None,
) -> list[str]:
    """Copy `sd` into `model`, checking names and shapes.

    Any key the model lacks, any model key the file lacks, or any shape disagreement is a one-line
    `VlbertsError` naming the first few offending keys, unless the predicates allow it; so is a tensor of
    another kind than the model's (`values_misfit`: integer for float) or one holding NaN or inf. Returns the
    model keys left at their initial values. `file_names` maps renamed keys back to the names in the
    file, so that errors about keys from the file also give the name the user can find there.
    """
    names = file_names or {}

    def shown(k: str) -> str:
        return f"{k} (file key {names[k]})" if names.get(k, k) != k else k

    own = model.state_dict()
    # Tied parameters appear under several names; they need to be present only once.
    tied = tied_aliases(model)
    missing = [k for k in own if k not in sd and k not in tied and not allow_missing(k)]
    unexpected = [shown(k) for k in sd if k not in own and not allow_unexpected(k)]
    bad_shape = [
        f"{shown(k)} {tuple(sd[k].shape)} vs {tuple(own[k].shape)}"
        for k in sd
        if k in own and sd[k].shape != own[k].shape
    ]
    problems = []
    if bad_shape:
        problems.append("shape mismatch: " + ", ".join(bad_shape[:3]))
    if missing:
        problems.append("missing keys: " + ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else ""))
    if unexpected:
        problems.append("unexpected keys: " + ", ".join(unexpected[:5]) + (" ..." if len(unexpected) > 5 else ""))
    if problems:
        raise VlbertsError("weights do not fit the model; " + "; ".join(problems), path=source)
    kept = {k: v for k, v in sd.items() if k in own}
    problem = values_misfit(kept, own)
    if problem:
        key, what = problem
        raise VlbertsError(f"tensor {shown(key)} {what}", path=source)
    model.load_state_dict(kept, strict=False)
    return [k for k in own if k not in sd and k not in tied]


def _kind(t: Tensor) -> str:
    if t.is_floating_point():
        return "floating-point"
    return "bool" if t.dtype == torch.bool else "complex" if t.is_complex() else "integer"


def first_nonfinite(tensors: Mapping[str, Tensor]) -> str | None:
    """The key of the first floating-point tensor holding NaN or inf, or None."""
    return next((k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())), None)


def values_misfit(sd: Mapping[str, Tensor], own: Mapping[str, Tensor]) -> tuple[str, str] | None:
    """(key, what is wrong) for the first tensor of `sd` whose kind (floating-point, integer, bool) is not
    its model tensor's in `own`, or that holds NaN or inf; None when all fit. `load_state_dict` would cast
    an int64 tensor into a float parameter silently; float16 / bfloat16 / float32 differ only in precision."""
    for k, v in sd.items():
        if k in own and _kind(v) != _kind(own[k]):
            kind = _kind(own[k])
            expected = {"floating-point": "a float32, float16 or bfloat16", "integer": "an integer"}.get(kind, f"a {kind}")
            return k, (f"is stored as {str(v.dtype).removeprefix('torch.')} but the model's is "
                       f"{str(own[k].dtype).removeprefix('torch.')}; expected {expected} tensor")
    bad = first_nonfinite(sd)
    return (bad, "holds NaN or inf") if bad is not None else None


def tied_aliases(model: nn.Module) -> set[str]:
    """Names of parameters that share storage with an earlier-named parameter."""
    seen: dict[int, str] = {}
    aliases = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            aliases.add(name)
        else:
            seen[id(p)] = name
    return aliases
