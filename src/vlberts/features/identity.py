"""Where a store's features came from, as one small JSON object, and how two of them differ (SPEC §9.1).

A model pre-trained on one extractor's features and then fine-tuned or analysed on another's of the same
width runs without complaint and quietly does worse (what users of the original code bases meet as
"self-extracted features silently differ from released ones"). So `pretrain` records the identity of its
store in the model's config.json ("features"), fine-tuning carries it into the fine-tuned model's, and
fine-tuning and the grounding analysis compare it with the store they are given: a difference is one
warning line, never an error (switching features can be deliberate). A model that records none (older
models, imported checkpoints) is compared with nothing.

The identity holds what determines the features, from the store's `StoreMetadata`:

    extractor       the extractor's name (an import's --extractor, "unknown" unless given)
    weights_sha256  the detector weights' sha256 (None for imports: their weights are not known)
    feature_dim     the region-feature width
    imported_from   the foreign format an imported store was read from (butd-tsv, vilbert-lmdb, ...);
                    absent for extracted stores
    settings        the extraction settings (box policy, thresholds, box counts, NMS, order, feature layer,
                    image sizes, proposals), less what does not change the features: the world detector's
                    training report and file name (its weights hash stands for it) and its val accuracies
                    (a result, not a setting)

and not the store's path, image count, splits, source file hash (a train and a val file of one extractor
differ) or dtype (float16 rounding is not another extractor).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# Settings that describe the run rather than the features (see the module docstring).
_NOT_IDENTITY = ("detector", "val")
# Settings that choose which boxes a store holds, not what a box's features are: RefCOCO+'s ground-truth
# track reads a store of the gold boxes on purpose (`finetune_refcoco --track=gt` compares without them).
BOX_SELECTION = ("box_policy", "boxes", "conf_thresh", "min_boxes", "max_boxes", "nms", "order", "proposals")
MAX_SHOWN = 4  # differences named in one line; the rest are counted
_MAX_VALUE = 40  # characters of one value in a line


def feature_identity(store: Any) -> dict[str, Any]:
    """The identity (module docstring) of a `RegionStore`, or of anything with its `metadata` and
    `feature_dim` (a shard index's `ShardCorpus`): a JSON-ready dict."""
    meta = store.metadata
    identity: dict[str, Any] = {
        "extractor": meta.extractor,
        "weights_sha256": meta.weights_hash,
        "feature_dim": int(store.feature_dim),
        "settings": {k: v for k, v in meta.settings.items() if k not in _NOT_IDENTITY},
    }
    if meta.source and meta.source.get("format"):
        identity["imported_from"] = meta.source["format"]
    return json.loads(json.dumps(identity))  # the form config.json holds (tuples as lists), so equal means equal


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _show(key: str, value: Any) -> str:
    if value is None:
        return "none"
    if key == "weights_sha256" and isinstance(value, str):
        return value[:12]
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= _MAX_VALUE else text[: _MAX_VALUE - 3] + "..."


def identity_difference(current: dict[str, Any], recorded: dict[str, Any], ignore: Sequence[str] = ()) -> str | None:
    """What differs between two identities, `current`'s value first, e.g. "max_boxes 20 vs 36,
    proposals.seed 1 vs 0"; None when they agree. Only top-level fields both hold are compared (an identity
    recorded before a field was added does not differ by lacking it); settings are compared one by one,
    nested ones by dotted name, except those named in `ignore` (a name covers its nested ones). At most `MAX_SHOWN` differences are named,
    the rest counted."""
    diffs = []
    for key in ("extractor", "weights_sha256", "feature_dim", "imported_from"):
        if key in current and key in recorded and current[key] != recorded[key]:
            name = "weights sha256" if key == "weights_sha256" else key.replace("_", " ")
            diffs.append(f"{name} {_show(key, current[key])} vs {_show(key, recorded[key])}")
    if isinstance(current.get("settings"), dict) and isinstance(recorded.get("settings"), dict):
        mine, theirs = _flat(current["settings"]), _flat(recorded["settings"])
        for key in [*mine, *(k for k in theirs if k not in mine)]:
            if key.split(".")[0] not in ignore and mine.get(key) != theirs.get(key):
                diffs.append(f"{key} {_show(key, mine.get(key))} vs {_show(key, theirs.get(key))}")
    if not diffs:
        return None
    more = len(diffs) - MAX_SHOWN
    return ", ".join(diffs[:MAX_SHOWN]) + (f" and {more} more setting{'s' * (more > 1)}" if more > 0 else "")


def describe_identity(identity: dict[str, Any]) -> str:
    """Short words for an identity: "extractor X (weights sha256 abc123def456)" or "extractor unknown
    (imported from butd-tsv)"."""
    extras = []
    if identity.get("weights_sha256"):
        extras.append(f"weights sha256 {identity['weights_sha256'][:12]}")
    if identity.get("imported_from"):
        extras.append(f"imported from {identity['imported_from']}")
    return f"extractor {identity.get('extractor', 'unknown')}" + (f" ({', '.join(extras)})" if extras else "")


def recorded_identity(model_dir: str | Path) -> dict[str, Any] | None:
    """The feature identity a model directory's config.json records ("features"), or None: none recorded,
    or no config.json to read (the model's own loading reports that)."""
    path = Path(model_dir) / "config.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    features = meta.get("features") if isinstance(meta, dict) else None
    return features if isinstance(features, dict) else None


def feature_mismatch(store: Any, model_dir: str | Path, current: dict[str, Any] | None = None,
                     ignore: Sequence[str] = ()) -> str | None:
    """One line saying how `store`'s features differ from those the model in `model_dir` was trained on,
    naming both; None when they agree (`ignore`: settings not compared) or the model records none.
    `current`: the store's identity, if already computed."""
    recorded = recorded_identity(model_dir)
    if recorded is None:
        return None
    current = feature_identity(store) if current is None else current
    diff = identity_difference(current, recorded, ignore)
    if diff is None:
        return None
    return (f"{store.path}: features from {describe_identity(current)} but {model_dir} was trained on features "
            f"from {describe_identity(recorded)}: {diff}")


def warn_feature_mismatch(store: Any, model_dir: str | Path, *, main: bool = True,
                          ignore: Sequence[str] = ()) -> tuple[dict[str, Any], str | None]:
    """(the store's identity, the `feature_mismatch` line or None), the line printed to stderr as
    "warning: ..." when `main` (rank 0 under torchrun; the others stay quiet)."""
    current = feature_identity(store)
    line = feature_mismatch(store, model_dir, current, ignore)
    if line is not None and main:
        print(f"warning: {line}", file=sys.stderr)
    return current, line
