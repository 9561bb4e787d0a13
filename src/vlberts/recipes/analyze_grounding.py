"""Recipe: entity grounding by attention heads ("What Does BERT with Vision Look At?", §3.1, Figure 3).

    read the split's Flickr30K Entities captions and boxes; tokenise; keep the grounded phrases
    run the pre-trained model on `[CLS] caption [SEP]` + the image's regions, with attention maps
    per caption: text-to-region attention of every head -> GroundingAccumulator
    write the numbers, Figure 3 and the best-heads table

    OUT/grounding.json        every head's accuracy and region mass, baseline, upper bound, options, skips
    OUT/entity_grounding.png  Figure 3: accuracy per head by layer, baseline line, active heads large
    OUT/grounding.md          the best heads and per-layer numbers as Markdown

The choices the paper leaves open are options with documented defaults (`GroundingOptions`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlberts.analysis.entities import SkipCounts, entity_captions, grounding_inputs
from vlberts.analysis.figures import save_head_accuracy_figure
from vlberts.analysis.grounding import GroundingAccumulator, GroundingOptions, GroundingResult
from vlberts.analysis.report import summary_markdown
from vlberts.config import apply_overrides, from_dict
from vlberts.data.flickr_entities import read_flickr_entities, read_flickr_split
from vlberts.errors import VlbertsError
from vlberts.features.store import RegionStore
from vlberts.io import atomic_open, write_json
from vlberts.recipes.common import autocast, opt, progress, resolve_device, set_threads
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import load_pretraining_model


@dataclass(frozen=True)
class GroundingConfig:
    model: str = opt("", "pre-trained vlberts model directory (a pretrain run's RUN/model)")
    entities: str = opt("", "Flickr30K Entities root: Sentences/, Annotations/, {train,val,test}.txt")
    features: str = opt("", "region store holding the split's images (with detection confidences)")
    split: str = opt("test", "which split's images to analyse (the paper: the evaluation set)")
    out: str = opt("runs/grounding", "output directory")
    token: str = opt("last", "subword standing for an entity: last, first, head_mean, mean (see GroundingOptions)")
    iou_rule: str = opt("any", "any: IoU with any gold box (BAN/VisualBERT); union: with the union box (Plummer et al.)")
    iou_threshold: float = opt(0.5, "a region agrees with the annotation at IoU >= this")
    active_threshold: float = opt(0.2, "heads with more than this mean share of attention on regions are 'active'")
    max_images: int = opt(0, "analyse only the split's first N images (0: all)")
    max_text_len: int = opt(64, "subwords per caption incl. [CLS]/[SEP]; phrases cut off are skipped")
    max_regions: int = opt(36, "regions per image (the store's first ones)")
    batch_size: int = opt(64, "captions per forward pass")
    device: str = opt("auto", "auto, cpu, cuda, cuda:N")
    precision: str = opt("fp32", "fp32 or bf16 (attention maps are analysed in float32 either way)")
    top_k: int = opt(10, "rows of the best-heads table")


CONFIG_CLASS = GroundingConfig


@dataclass
class GroundingReport:
    result: GroundingResult
    skipped: dict[str, int]
    maps: str  # which attention maps were read
    seconds: float
    paths: dict[str, Path]


def analyze_grounding(cfg: GroundingConfig) -> GroundingReport:
    """Run the analysis (module docstring) and write its outputs."""
    set_threads()
    for key in ("model", "entities", "features"):
        if not getattr(cfg, key):
            raise VlbertsError(f"analyze grounding needs --{key}")
    try:
        options = GroundingOptions(cfg.token, cfg.iou_rule, cfg.iou_threshold, cfg.active_threshold)  # type: ignore[arg-type]
    except ValueError as e:
        raise VlbertsError(str(e)) from None
    out = Path(cfg.out)
    device = resolve_device(cfg.device)
    t0 = time.perf_counter()

    model, model_cfg, _ = load_pretraining_model(cfg.model)
    model.to(device)
    tok = TextTokenizer.load(cfg.model)
    store = RegionStore(cfg.features)
    ids = read_flickr_split(cfg.entities, cfg.split)
    if cfg.max_images:
        ids = ids[: cfg.max_images]
    missing = [i for i in ids if i not in store]
    if missing:
        raise VlbertsError(f"image id {missing[0]} not in store ({len(missing)} images affected)", path=cfg.features, record=missing[0])

    skipped = SkipCounts()
    captions = entity_captions((read_flickr_entities(cfg.entities, i) for i in ids), tok, cfg.max_text_len, skipped)
    acc = GroundingAccumulator(options)
    with progress() as bar, autocast(device, cfg.precision):
        task = bar.add_task("entity grounding", total=len(captions), info="")
        maps = ""
        for _, inp in grounding_inputs(model, captions, store, max_regions=cfg.max_regions, batch_size=cfg.batch_size, device=device):
            acc.add(inp)
            maps = inp.maps
            bar.advance(task)
    if acc.n_entities == 0:
        raise VlbertsError(f"no grounded entity in split {cfg.split!r} (skipped: {skipped.to_dict()})", path=cfg.entities)
    result = acc.result()
    L, H = result.accuracy.shape
    maps = f"{maps}; {L} layers x {H} heads"

    paths = {"json": out / "grounding.json", "figure": out / "entity_grounding.png", "markdown": out / "grounding.md"}
    report = GroundingReport(result, skipped.to_dict(), maps, round(time.perf_counter() - t0, 2), paths)
    write_json(paths["json"], _to_json(cfg, report))
    save_head_accuracy_figure(result, paths["figure"])
    with atomic_open(paths["markdown"]) as f:
        f.write(summary_markdown(result, cfg.top_k, title=f"Entity grounding ({cfg.split} split)"))
        f.write(f"\nAttention maps: {maps}. Skipped phrases: {_skips(report.skipped)}.\n")
    return report


def _skips(skipped: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in skipped.items()) or "none"


def _to_json(cfg: GroundingConfig, report: GroundingReport) -> dict[str, Any]:
    return {
        **report.result.to_dict(),
        "split": cfg.split,
        "model": cfg.model,
        "features": cfg.features,
        "attention_maps": report.maps,
        "skipped_phrases": report.skipped,
        "seconds": report.seconds,
    }


def config_from_args(args: list[str], base: dict | None = None) -> GroundingConfig:
    return apply_overrides(from_dict(GroundingConfig, base or {}), args)
