"""Typed, frozen configs: strict loading from dicts/YAML and `--key=value` overrides.

Model configs hold architecture only; run configs hold training switches (DESIGN.md habit 2). Unknown
keys are errors that list the valid ones, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from vlberts.errors import first_line, VlbertsError
from vlberts.io import read_text

C = TypeVar("C")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-ready dict of a (nested) config dataclass."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if dataclasses.is_dataclass(v):
            v = to_dict(v)
        elif isinstance(v, tuple):
            v = list(v)
        out[f.name] = v
    return out


def changed_settings(before: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """The keys whose values differ between two settings dicts (one missing counts as differing), sorted."""
    return sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))


def _convert(value: Any, tp: Any, where: str) -> Any:
    """Convert `value` to the annotated type `tp` (basic types, Optional, tuples, nested dataclasses)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, where)
            except VlbertsError as e:
                errors.append(str(e))
        raise VlbertsError(f"{where}: cannot read {value!r} as {tp}")
    if origin is typing.Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise VlbertsError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (tuple, list):
        args = typing.get_args(tp)
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise VlbertsError(f"{where}: expected a list, got {value!r}")
        elem = args[0] if args else Any
        items = [_convert(v, elem, where) for v in value]
        return tuple(items) if origin is tuple else items
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise VlbertsError(f"{where}: expected a mapping for {tp.__name__}")
        return from_dict(tp, value, where=where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("0", "false", "no", "off"):
            return False
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise VlbertsError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise VlbertsError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        try:
            return int(str(value))
        except ValueError:
            raise VlbertsError(f"{where}: expected an integer, got {value!r}") from None
    if tp is float:
        if isinstance(value, bool):
            raise VlbertsError(f"{where}: expected a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise VlbertsError(f"{where}: expected a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, (str, int, float)):
            raise VlbertsError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


# The allowed range of a run setting, by its name: every recipe names a setting the same way, so one table
# serves them all. (low, high, low excluded); None: unbounded. A value equal to the field's default is
# always allowed (0 is the "off" / "the run's own" / "all" default of several of them), and a float
# setting must be finite.
_COUNTS = ("batch_size", "eval_batch_size", "batch_images", "chunk_images", "ckpt_every", "log_every", "grad_accum",
           "iterations", "max_steps", "pretrain_batch", "vqa_batch", "procs", "per_class", "classes", "top_k",
           "pretrain_steps", "images", "max_boxes", "min_answer_count", "qa_min_answer_count",
           "detector_epochs", "detector_steps", "shuffle_buffer", "vocab_size", "max_regions", "eval_images",
           "max_images", "stop_after", "feature_dim")
_FRACTIONS = ("mlm_prob", "colour_mask_prob", "shape_mask_prob", "mismatch_prob", "text_ratio", "flip_prob",
              "corpus_share", "unpaired_ratio", "qa_last_fraction", "active_threshold", "iou_threshold", "conf_thresh", "nms",
              "momentum")
# The model configurations (models/*.py) are read through `from_dict` too: from a model directory's
# config.json and from the converters of released configs. Their sizes are counts, their dropouts fractions.
_MODEL_COUNTS = ("hidden_size", "num_heads", "intermediate_size", "num_layers", "max_position_embeddings",
                 "type_vocab_size", "visual_dim", "v_hidden_size", "v_num_heads", "v_intermediate_size",
                 "bi_hidden_size", "bi_num_heads")
_MODEL_DEPTHS = ("v_num_layers", "language_layers", "relation_layers", "cross_layers")  # 0: ViLBERT's single stream
# Head sizes where 0 leaves the head out (LXMERT's object, attribute and answer heads; ViLBERT's and VL-BERT's
# region classes; W-VisualBERT's object labels).
_MODEL_HEAD_SIZES = ("num_object_labels", "num_attr_labels", "num_qa_labels", "num_region_classes")
# Layer counts past this are a damaged or mistyped config (the papers' deepest stack is 24), not a model: building
# a million layers would take minutes before anything could say the weights do not fit.
MAX_LAYERS = 1000
_MODEL_FRACTIONS = ("hidden_dropout", "attention_dropout", "v_hidden_dropout", "v_attention_dropout")
SETTING_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    **{name: (1, None, False) for name in _COUNTS + _MODEL_COUNTS if name != "num_layers"},
    "num_layers": (1, MAX_LAYERS, False),
    **{name: (0, 1, False) for name in _FRACTIONS + _MODEL_FRACTIONS},
    **{name: (0, MAX_LAYERS, False) for name in _MODEL_DEPTHS},
    **{name: (0, None, False) for name in _MODEL_HEAD_SIZES},
    "initializer_range": (0, None, False),
    "steps": (0, None, False),  # `pretrain --steps=0`: the untrained network, the no-pre-training control
    "layer_norm_eps": (0, None, True),
    "seed": (0, 2**63 - 1, False),  # numpy's generators take non-negative seeds only, torch's 64-bit ones
    **{name: (0, None, True) for name in ("pretrain_lr", "vqa_lr", "head_lr_mult", "bert_lr_mult",
                                           "perplexity", "vqa_epochs")},
    "lr": (0, None, False),  # 0: no weight moves, and the run saves the weights it started from (a control)
    **{name: (0, None, False) for name in ("clip", "weight_decay", "match_weight", "min_boxes",
                                           "figures", "qualitative", "explorer_examples", "hard_negatives",
                                           "length_group", "object_loss")},  # 0: none / off
    "epochs": (0, None, True),
    "lr_factor": (0, None, True),
    "warmup": (0, None, False),  # a fraction of the updates below 1, a number of them from 1 (`training.optim.warmup_steps`)
    "max_text_len": (8, None, False),  # [CLS], a few subwords, [SEP] (and an answer slot)
    "pixel_size": (16, None, False),
    "prefetch": (-1, None, False),
    # loader processes, each with its own copy of the dataset's index: past this, a typo (1000) rather than
    # a machine (torch itself warns above the CPU count)
    "num_workers": (0, 128, False),
}


def _check_range(name: str, value: Any, default: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return
    if isinstance(value, float) and not math.isfinite(value):
        raise VlbertsError(f"{where}: must be a finite number, got {value}")
    if name not in SETTING_RANGES or value == default:
        return
    low, high, open_low = SETTING_RANGES[name]
    below = (lambda v: v <= low if open_low else v < low) if low is not None else (lambda v: False)
    # the default is allowed too: name it where it lies outside the range (0: "all" / "off")
    also = f" (or {_num(default)}, the default)" if isinstance(default, (int, float)) and below(default) else ""
    if below(value):
        raise VlbertsError(f"{where}: must be {'more than' if open_low else 'at least'} {_num(low)}{also}, got {_num(value)}")
    if high is not None and value > high:
        raise VlbertsError(f"{where}: must be at most {_num(high)}, got {_num(value)}")


def check_values(cfg: Any) -> None:
    """The checks `from_dict` makes of each value (an integer where the field is `int`, a number where it is
    `float`, `SETTING_RANGES`), for a config dataclass built in Python: the model configurations run it in
    `__post_init__`, so that `hidden_size=0` is refused where it is written, not when a model is built."""
    name = type(cfg).__name__
    hints = _type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, tp = getattr(cfg, f.name), hints[f.name]
        if tp in (int, float) and (isinstance(value, bool) or not isinstance(value, int if tp is int else (int, float))):
            raise VlbertsError(f"{name}.{f.name}: expected {'an integer' if tp is int else 'a number'}, got {value!r}")
        _check_range(f.name, value, f.default, f"{name}.{f.name}")


@functools.cache
def _type_hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _num(x: float) -> str:
    """A bound or a value as written: whole numbers in full (a 64-bit seed bound), others as %g."""
    if isinstance(x, int):
        digits = str(x)
        return digits if len(digits) <= 24 else f"{digits[:6]}... ({len(digits)} digits)"
    return str(int(x)) if x.is_integer() and abs(x) < 1e21 else f"{x:g}"


def require_known_keys(data: dict[str, Any], known: Iterable[str], where: str) -> None:
    """Unknown keys in a settings object are an error listing the valid ones: a misspelt setting must not be
    dropped without a word."""
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise VlbertsError(f"{where}: unknown key(s) {', '.join(unknown)}; valid keys: {', '.join(sorted(known))}")


def from_dict(cls: type[C], data: dict[str, Any], where: str = "config") -> C:
    """Build the dataclass `cls` from `data`; unknown keys, bad values and values outside a setting's range
    (`SETTING_RANGES`) are `VlbertsError`s."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    require_known_keys(data, fields, where)
    kwargs = {k: _convert(v, hints[k], f"{where}.{k}") for k, v in data.items()}
    for k, v in kwargs.items():
        _check_range(k, v, fields[k].default, f"{where}.{k}")
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise VlbertsError(f"{where}: {e}") from None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a mapping naming one key twice is an error: PyYAML keeps the last
    value, so a config file setting `lr` twice would run with whichever comes later without a word."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, (str, int, float, bool)):
                continue  # a list or mapping as a key: `load_yaml` refuses it as a setting name
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"setting {key!r} given twice", key_node.start_mark)  # the mark: its line
            seen.add(key)
        return super().construct_mapping(node, deep)


def load_yaml(cls: type[C], path: str | Path) -> C:
    """Read a config dataclass from a YAML file."""
    path = Path(path)
    if not path.is_file():
        raise VlbertsError("config file not found", path=path)
    text = read_text(path)  # bytes that are not UTF-8: one line naming the file
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)  # where PyYAML stopped; its first line does not always say
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        raise VlbertsError(f"malformed YAML: {first_line(e)}{where}", path=path) from None
    if not isinstance(data, dict):
        raise VlbertsError(f"a config file must be a mapping of setting: value, got a {type(data).__name__}", path=path)
    keys = [k for k in data if not isinstance(k, str)]
    if keys:
        raise VlbertsError(f"setting names must be strings, got {keys[0]!r}", path=path)
    # `-` in a name reads as `_`, as on the command line (`eval-questions` is `eval_questions`); the run
    # configs are flat, so the top-level names are all there are.
    settings: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name in given:
            raise VlbertsError(f"setting {name!r} given twice (as {given[name]!r} and {key!r})", path=path)
        given[name], settings[name] = key, value
    return from_dict(cls, settings, where=f"{path}: {cls.__name__}")  # "run.yaml: PretrainConfig.steps: ..."


def flag_names(cls: type) -> frozenset[str]:
    """The dotted names of a config dataclass's bool settings, nested dataclasses included: the settings
    that a bare `--name` (no `=value`) on the command line turns on."""
    out: set[str] = set()
    for name, tp in typing.get_type_hints(cls).items():
        if tp is bool:
            out.add(name)
        elif dataclasses.is_dataclass(tp):
            out.update(f"{name}.{sub}" for sub in flag_names(tp))
    return frozenset(out)


def parse_overrides(args: list[str], flags: frozenset[str] | set[str] = frozenset(),
                    settings: Iterable[str] | None = None, where: str = "config") -> dict[str, Any]:
    """Turn ``["--lr=1e-4", "--model.hidden_size=64", "steps=10"]`` into a nested dict of strings; a bare
    ``--name`` of a setting in `flags` (`flag_names`: the bool ones) means ``--name=true``. Given every
    setting's name (`settings`), a bare ``--name`` that is none of them is an unknown key (listing them)."""
    out: dict[str, Any] = {}
    for arg in args:
        key, sep, value = arg.lstrip("-").partition("=")
        if not sep and key.replace("-", "_") in flags:
            sep, value = "=", "true"
        if not sep and key and settings is not None and key.replace("-", "_").split(".")[0] not in set(settings):
            require_known_keys({key.replace("-", "_"): None}, settings, where)
        if not sep or not key:
            raise VlbertsError(f"override {arg!r} is not of the form --key=value"
                               + (" (only on/off settings may be given without a value)" if key else ""))
        node = out
        parts = key.replace("-", "_").split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise VlbertsError(f"override {arg!r} conflicts with another override")
        node[parts[-1]] = value
    return out


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge `update` into a copy of `base`."""
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def checked(cfg: C) -> C:
    """`cfg` as `from_dict` would have built it from its own values: a config dataclass made in Python
    (`PretrainConfig(steps=-5)`) gets the checks and conversions of one read from the command line or a
    file, and the same one-line errors."""
    return from_dict(type(cfg), to_dict(cfg), where=type(cfg).__name__)


def apply_overrides(cfg: C, args: list[str] | dict[str, Any]) -> C:
    """Return `cfg` with `--key=value` overrides applied and validated."""
    upd = (parse_overrides(args, flag_names(type(cfg)), [f.name for f in dataclasses.fields(cfg)], type(cfg).__name__)
           if isinstance(args, list) else args)
    if not upd:
        return cfg
    return from_dict(type(cfg), merge(to_dict(cfg), upd), where=type(cfg).__name__)
