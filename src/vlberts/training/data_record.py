"""What a training run read, so that a resumed run can tell when the files under the same paths changed.

`check_same_run` compares a resumed run's settings with the ones it started with; a setting that names a file
compares as a path, so a captions file, a region store or a shard index replaced at the same path passed, and
the run went on from its checkpoint on other data, silently. `OUT/data_record.json`, written when a run starts,
holds a fingerprint of every input its settings name (each path of a setting, comma-separated ones too), and a
resumed run compares them:

    a region store (.h5, .hdf5)   the features' identity (`features.identity.feature_identity`: extractor,
                                  detector weights, settings), the number of images and a sha256 of their ids
                                  (its features are not hashed: a store may hold hundreds of gigabytes)
    any other file up to 1 GiB    the sha256 of its bytes
    a larger file                 its size
    a directory                   the number of files directly in it and a sha256 of their names and sizes

Paths that do not exist, and the settings that name no input (`out`; `init` and `bert_init`, read only when a
run starts: a resumed run restores its own weights), are left out. A run without the record (started before
vlberts kept one) resumes as before.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

from vlberts.errors import VlbertsError
from vlberts.io import read_json, write_json

RECORD = "data_record.json"
NOT_INPUTS = ("out", "init", "bert_init")  # settings that name no input a resumed run reads
HASHED_BYTES = 1 << 30  # files up to this size are hashed whole
_STORE_SUFFIXES = (".h5", ".hdf5")


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(path: Path) -> dict[str, Any]:
    """The fingerprint of one input (module docstring)."""
    if path.is_dir():  # (an image folder may hold a million files: their listing's hash, not the listing)
        listing = sorted(f"{p.name}\t{p.stat().st_size}" for p in path.iterdir() if p.is_file())
        return {"files": len(listing), "listing_sha256": hashlib.sha256("\n".join(listing).encode()).hexdigest()}
    if path.suffix.lower() in _STORE_SUFFIXES:
        from vlberts.features.identity import feature_identity
        from vlberts.features.store import RegionStore

        try:
            with RegionStore(path) as store:
                ids = store.ids()
                return {"features": feature_identity(store), "images": len(ids),
                        "image_ids_sha256": hashlib.sha256("\n".join(ids).encode()).hexdigest()}
        except VlbertsError:
            pass  # not a region store (another HDF5 file): fingerprinted as a file
    size = path.stat().st_size
    return {"sha256": _sha256_file(path)} if size <= HASHED_BYTES else {"size": size}


def fingerprints(cfg: Any, skip: tuple[str, ...] = NOT_INPUTS) -> dict[str, dict[str, Any]]:
    """Setting name (with the path, for a setting naming several) -> fingerprint, for every existing path a
    string setting of the run config `cfg` names, but those of the settings in `skip`."""
    out: dict[str, dict[str, Any]] = {}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if field.name in skip or not isinstance(value, str) or not value:
            continue
        paths = [p.strip() for p in value.split(",") if p.strip()]
        for p in paths:
            path = Path(p)
            if path.exists():
                key = field.name if len(paths) == 1 else f"{field.name} {p}"
                out[key] = fingerprint(path)
    return out


def record_data(out: Path, cfg: Any) -> None:
    """Write OUT/data_record.json for a run that starts (rank 0)."""
    write_json(out / RECORD, fingerprints(cfg))


def check_same_data(out: Path, cfg: Any) -> None:
    """A resumed run reads the inputs it started with: a file its settings name that now holds other data (a
    store of another detector or other images, another captions file under the same name) is a one-line
    error naming the setting and the file."""
    path = out / RECORD
    if not path.is_file():
        return
    before = read_json(path)
    for key, now in fingerprints(cfg).items():
        then = before.get(key)
        if then is not None and then != now:
            setting, _, named = key.partition(" ")
            what = "features or images" if "features" in now else "contents"
            raise VlbertsError(f"--{setting}: its {what} differ from those this run started with (the same path, "
                               f"other data; {RECORD} in {out} holds what it read); a resumed run must read its own "
                               "data: put it back, or use a new --out", path=named or getattr(cfg, setting))
