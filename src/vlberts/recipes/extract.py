"""Recipe: region features for the embedded world (SPEC §2, §7), as BUTD's generate_tsv.py makes them.

    train the world detector on the train split (or load --detector weights)
    for every image of every split, in scenes.jsonl order:
        proposals -> detector -> BUTD box selection -> RegionRecord -> the store
    val images also score the detector (proposal accuracies, gold recall after selection)

With --boxes=gold the RoIs are the world's gold object boxes instead of proposals, every one kept in
object id order (no selection): a store whose regions are exactly the objects, the candidates of the
ground-truth-region track of RefCOCO+ (VL-BERT §4.2.3). Pass the detector of the detected-region store
(--detector) so that both stores hold features of the same detector.

Outputs, next to each other:

    STORE                          the region store (HDF5; written atomically: all or nothing)
    STORE-stem.detector.safetensors + .json   the trained detector (not when --detector was given)
    STORE-stem.butd.tsv, STORE-stem.lxmert.tsv  with --tsv: the 6-field and 10-field TSVs

The store metadata names the extractor, the weights' sha256, every setting (proposals, NMS,
threshold, min/max boxes, order, feature layer), the class and attribute vocabularies, and the
val accuracies, so a store says how to reproduce it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vlberts.errors import VlbertsError
from vlberts.features.proposals import ProposalConfig
from vlberts.features.record import StoreMetadata
from vlberts.features.selection import SelectionConfig
from vlberts.features.store import RegionStoreWriter
from vlberts.features.world_detector import (
    EXTRACTOR_NAME,
    FEATURE_LAYER,
    DetectorInfo,
    DetectorTrainConfig,
    ProposalAccuracy,
    WorldDetectorConfig,
    gold_regions,
    iter_detections,
    load_detector,
    save_detector,
    select_regions,
    train_detector,
    weights_bytes,
)
from vlberts.features.world_scenes import read_world_scenes
from vlberts.recipes.common import opt, progress, start_recipe


@dataclass(frozen=True)
class ExtractConfig:
    world: str = opt("", "world directory (scenes.jsonl, world.json, images/)")
    out: str = opt("", "region store to write (.h5)")
    detector: str = opt("", "world-detector weights (.safetensors with its .json); empty: train one")
    tsv: bool = opt(False, "also write the BUTD 6-field and LXMERT 10-field TSVs next to the store")
    float16: bool = opt(False, "store features and cls_prob as float16")
    min_boxes: int = opt(10, "BUTD MIN_BOXES: keep at least this many boxes per image")
    max_boxes: int = opt(36, "BUTD MAX_BOXES: keep at most this many boxes per image")
    conf_thresh: float = opt(0.2, "BUTD conf_thresh on a box's max class confidence after per-class NMS")
    nms: float = opt(0.3, "per-class NMS IoU threshold (BUTD cfg.TEST.NMS)")
    order: str = opt("confidence", "confidence: kept boxes sorted by confidence; butd: RoI order between min and max")
    feature_dim: int = opt(0, "region-feature width of a trained detector (0: 128); must match --detector if given")
    seed: int = opt(0, "seed of the detector's initialisation, training order and the proposals")
    epochs: int = opt(3, "detector training epochs over the train split")
    max_steps: int = opt(900, "cap on detector updates (keeps big worlds within about a minute)")
    batch_images: int = opt(64, "images per backbone pass during extraction")
    overwrite: bool = opt(False, "replace an existing store (only once extraction has succeeded)")
    boxes: str = opt("detected", "detected: proposals after BUTD selection; gold: exactly the world's object boxes "
                                 "(object id order, no selection: RefCOCO+'s ground-truth regions)")


CONFIG_CLASS = ExtractConfig


@dataclass
class ExtractResult:
    store: Path
    detector: Path
    tsv: list[Path]
    num_images: int
    splits: dict[str, int]
    boxes: dict[str, float]  # min / mean / max per image, total
    val: dict[str, Any]
    trained: bool
    train_seconds: float
    extract_seconds: float
    weights_hash: str
    train_report: dict[str, Any] | None = None  # steps, epochs, seconds, final losses (None when loaded)
    timings: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        v = self.val
        acc = (
            f"val proposals: class {v['cls_acc']:.1%}, shape {v['obj_acc']:.1%}, colour {v['attr_acc']:.1%}, "
            f"size {v['size_acc']:.1%}; {v['gold_recall']:.1%} of val objects kept with the right class"
            if v.get("obj_acc") is not None
            else "no val split, so no accuracies"
        )
        how = f"trained the world detector in {self.train_seconds:.1f}s" if self.trained else f"loaded {self.detector}"
        tsv = f"; TSVs {', '.join(str(p) for p in self.tsv)}" if self.tsv else ""
        rate = self.num_images / max(self.extract_seconds, 1e-9)
        return (
            f"{how} and extracted {self.num_images} images ({', '.join(f'{k} {n}' for k, n in self.splits.items())}) "
            f"in {self.extract_seconds:.1f}s ({rate:.0f} images/s) into {self.store}: "
            f"{self.boxes['min']:.0f}-{self.boxes['max']:.0f} boxes per image (mean {self.boxes['mean']:.1f}); "
            f"{acc}; detector weights {self.detector} (sha256 {self.weights_hash[:12]}){tsv}."
        )


def companion_paths(store: str | Path) -> dict[str, Path]:
    """Files written next to STORE: the detector weights/config and the two TSVs."""
    stem = Path(store).with_suffix("")
    return {
        "detector": Path(f"{stem}.detector.safetensors"),
        "butd_tsv": Path(f"{stem}.butd.tsv"),
        "lxmert_tsv": Path(f"{stem}.lxmert.tsv"),
    }


def _validate(cfg: ExtractConfig) -> SelectionConfig:
    if not cfg.world or not cfg.out:
        raise VlbertsError("extract needs --world DIR and --out STORE")
    if cfg.feature_dim < 0 or cfg.batch_images < 1:
        raise VlbertsError("feature_dim must be >= 0 (0: default) and batch_images >= 1")
    sel = SelectionConfig(
        conf_thresh=cfg.conf_thresh, min_boxes=cfg.min_boxes, max_boxes=cfg.max_boxes, nms=cfg.nms, order=cfg.order  # type: ignore[arg-type]
    )
    sel.validate()
    if cfg.boxes not in ("detected", "gold"):
        raise VlbertsError(f"unknown --boxes {cfg.boxes!r}; valid: detected, gold")
    out = Path(cfg.out)
    if out.exists() and not cfg.overwrite:
        raise VlbertsError("already exists (pass --overwrite to replace it)", path=out)
    if out.is_dir():
        raise VlbertsError("is a directory; --out names the store file to write", path=out)
    return sel


def extract(cfg: ExtractConfig) -> ExtractResult:
    """Run the recipe (module docstring); returns what was written and how well the detector did."""
    cfg = start_recipe(cfg)
    sel = _validate(cfg)
    out = Path(cfg.out)
    paths = companion_paths(out)
    world = read_world_scenes(cfg.world)  # every line and every image file checked before any training
    vocab = world.vocab
    timings: dict[str, float] = {}

    with progress() as bar:
        t0 = time.perf_counter()
        if cfg.detector:
            model, info, sha = load_detector(cfg.detector)
            if (info.vocab.shapes, info.vocab.colours) != (vocab.shapes, vocab.colours):
                raise VlbertsError(
                    f"detector classes {list(info.vocab.shapes)} / attributes {list(info.vocab.colours)} differ from the "
                    f"world's {list(vocab.shapes)} / {list(vocab.colours)}",
                    path=cfg.detector,
                )
            if cfg.feature_dim and cfg.feature_dim != info.config.feature_dim:
                raise VlbertsError(
                    f"--feature-dim {cfg.feature_dim} but the detector makes {info.config.feature_dim}-d features",
                    path=cfg.detector,
                )
            detector_path, data, trained, report_dict = Path(cfg.detector), b"", False, None
        else:
            model_cfg = WorldDetectorConfig(
                num_classes=len(vocab.shapes), num_attributes=len(vocab.colours), num_sizes=len(vocab.sizes),
                feature_dim=cfg.feature_dim or 128,
            )
            train_cfg = DetectorTrainConfig(epochs=cfg.epochs, max_steps=cfg.max_steps, seed=cfg.seed)
            task = bar.add_task("train detector", total=None, info="")

            def on_step(step: int, total: int, losses: dict[str, float]) -> None:
                bar.update(task, completed=step, total=total, info=" ".join(f"{k} {v:.3f}" for k, v in losses.items()))

            model, report = train_detector(world, model_cfg, train_cfg, ProposalConfig(), on_step=on_step)
            data = weights_bytes(model)
            sha = hashlib.sha256(data).hexdigest()
            report_dict = dataclasses.asdict(report)
            train_meta = {**dataclasses.asdict(train_cfg), "report": report_dict}
            info = DetectorInfo(model_cfg, vocab, ProposalConfig(), train=train_meta)
            detector_path, trained = paths["detector"], True
        timings["train"] = time.perf_counter() - t0

        t1 = time.perf_counter()
        meta = StoreMetadata(
            extractor=EXTRACTOR_NAME,
            weights_hash=sha,
            settings=_settings(cfg, sel, info),
            classes=list(vocab.shapes),
            attributes=list(vocab.colours),
            source={
                "world": str(world.root.resolve()),
                "scenes_sha256": hashlib.sha256((world.root / "scenes.jsonl").read_bytes()).hexdigest(),
                "images": len(world.images),
                "splits": world.splits(),
            },
            notes="boxes are the proposals, un-regressed, as BUTD writes them; cls_prob column 0 is background; "
            "obj_id/attr_id are 0-based into classes/attributes (LXMERT convention)",
        )
        acc = ProposalAccuracy()
        counts = []
        task = bar.add_task("extract", total=len(world.images), info="")
        with RegionStoreWriter(
            out, feature_dim=info.config.feature_dim, dtype="float16" if cfg.float16 else "float32", metadata=meta,
            with_cls_prob=info.config.num_classes + 1, with_objects=True, with_attrs=True,
        ) as writer:
            gold = cfg.boxes == "gold"
            for im, det in iter_detections(model, world, world.images, info.proposals, cfg.seed, cfg.batch_images, gold):
                rec = gold_regions(im, det) if gold else select_regions(im, det, sel)
                writer.add(rec)
                counts.append(rec.num_boxes)
                if im.split == "val":
                    acc.add(im, det, rec)
                bar.advance(task)
            val = acc.to_dict()
            writer.metadata = dataclasses.replace(meta, settings={**meta.settings, "val": val})
            if trained:
                info.val = val
                save_detector(detector_path, model, info, data)
            # The new store replaces the old as this block ends: the old one's TSVs go first, so that none is
            # left beside a store it does not describe (stopped before --tsv writes the new ones, or without
            # --tsv). Stopped here, the old store stands without them.
            for key in ("butd_tsv", "lxmert_tsv"):
                paths[key].unlink(missing_ok=True)
        timings["extract"] = time.perf_counter() - t1

    tsv_paths = []
    if cfg.tsv:
        from vlberts.features.importers import export_tsv

        t2 = time.perf_counter()
        for key, fmt in (("butd_tsv", "butd-tsv"), ("lxmert_tsv", "lxmert-tsv")):
            export_tsv(out, paths[key], fmt, overwrite=True)  # the store's companions, replaced with it
            tsv_paths.append(paths[key])
        timings["tsv"] = time.perf_counter() - t2

    c = np.asarray(counts)
    return ExtractResult(
        store=out, detector=detector_path, tsv=tsv_paths, num_images=len(counts), splits=world.splits(),
        boxes={"min": int(c.min()), "mean": float(c.mean()), "max": int(c.max()), "total": int(c.sum())},
        val=val, trained=trained, train_seconds=round(timings["train"], 2), extract_seconds=round(timings["extract"], 2),
        weights_hash=sha, train_report=report_dict, timings={k: round(v, 2) for k, v in timings.items()},
    )


def _settings(cfg: ExtractConfig, sel: SelectionConfig, info: DetectorInfo) -> dict[str, Any]:
    d = info.to_dict()
    return {
        "box_policy": "gold" if cfg.boxes == "gold" else sel.policy,
        "conf_thresh": sel.conf_thresh,
        "min_boxes": sel.min_boxes,
        "max_boxes": sel.max_boxes,
        "nms": sel.nms,
        "order": sel.order,
        "feature_layer": FEATURE_LAYER,
        "feature_dim": info.config.feature_dim,
        "background_column": "first",
        "attribute_background_column": "none",
        "boxes": "proposals (un-regressed RoIs), xyxy pixels",
        "proposals": {**d["proposals"], "seed": cfg.seed, "stream": 0},
        "detector": {"config": d["config"], "sizes": d["sizes"], "train": d["train"], "weights": str(cfg.detector or "")},
    }
