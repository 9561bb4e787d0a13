"""Recipe: word, region and tag representations by class in t-SNE (W-VisualBERT §5, Figure 2).

    read the split's Flickr30K Entities captions and boxes; keep each grounded phrase whose head word
        (its last word) is a detector class name and whose gold box a detected region of that class
        overlaps (IoU >= 0.5): an instance (analysis/representations.py says why)
    keep at most `per_class` instances of the `classes` most frequent classes (seeded)
    run the pre-trained model on `[CLS] caption [SEP]` + the image's regions (+ the detector tags for
        W-VisualBERT with tags); take the final states of the head word's last subword, of the region, of
        the region's tag subwords (mean)
    (ViLBERT: words and regions through its two poolers into one space, see below)
    t-SNE of all of them together; the figure; how often a word's nearest region has its class, and the
        same for every pair of modalities (a region's nearest other region, a word's nearest tag, ...)

    OUT/run_config.json        every setting of the run, defaults included (written before the forward passes)
    OUT/representations.png    Figure 2: one point per representation, colour = class, marker = modality
    OUT/representations.json   counts, the word -> region agreement and its chance rate, the table of
                               every pair of modalities, every point (class, modality, instance, x, y)

ViLBERT's streams differ in width (768 and 1024 at base size), so its final states share no space. The one
place the model compares the two streams is its alignment prediction (§2.2), whose poolers take h_CLS and
h_IMG through Linear + ReLU into the co-attention width and multiply them there: ViLBERT's words and
regions are drawn in that space, every word through the text pooler and every region through the image
pooler (`OUT/representations.json` "space" says which space was used; the poolers were trained on the first
element of each stream only, which the figure's title and the printed line say too). Models whose streams
share a width are drawn from their final states.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vlberts.analysis.boxes import box_iou
from vlberts.analysis.entities import EntityCaption, SkipCounts, entity_captions
from vlberts.analysis.representations import (
    RepresentationSet,
    agreement_table,
    effective_perplexity,
    sample_instances,
    save_representation_figure,
    tsne,
)
from vlberts.config import apply_overrides, from_dict
from vlberts.data.regions import FetchedRecord, caption_inputs, detected_tags, load_regions
from vlberts.data.vqa_dataset import detector_tag_subwords
from vlberts.errors import BadRecords, VlbertsError
from vlberts.features.store import RegionStore
from vlberts.io import write_json
from vlberts.models.builders import arch_of, reads_tags
from vlberts.models.encoders import ENCODER_PREFIX
from vlberts.recipes.analyze_grounding import analysis_images
from vlberts.recipes.common import fit_text_len, opt, progress, resolve_device, start_recipe, write_run_config
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import load_attention_model


@dataclass(frozen=True)
class RepresentationsConfig:
    model: str = opt("", "vlberts model directory: a pretrain run's RUN/model, or a finetune run's (its encoder is read)")
    entities: str = opt("", "Flickr30K Entities root: Sentences/, Annotations/, {train,val,test}.txt")
    features: str = opt("", "region store of the split's images, with the detector's obj_id and class names")
    split: str = opt("test", "which split's captions to draw from")
    out: str = opt("runs/representations", "output directory")
    classes: int = opt(15, "the most frequent classes drawn (W-VisualBERT Figure 2: 15)")
    per_class: int = opt(50, "instances per class at most (Figure 2: 50)")
    perplexity: float = opt(30.0, "t-SNE perplexity")
    iterations: int = opt(750, "t-SNE gradient steps")
    seed: int = opt(0, "seed of the instance sample and of t-SNE")
    max_images: int = opt(0, "read only the split's first N images (0: all)")
    skip_bad: bool = opt(False, "drop images whose Sentences/Annotations file is malformed and images missing from "
                         "the store, counting them (a warning and bad_records in the JSON) instead of stopping")
    max_text_len: int = opt(64, "subwords per caption incl. [CLS]/[SEP]")
    max_regions: int = opt(36, "regions per image (the store's first ones)")
    batch_size: int = opt(64, "captions per forward pass")
    device: str = opt("auto", "auto, cpu, cuda, cuda:N")


CONFIG_CLASS = RepresentationsConfig


@dataclass(frozen=True)
class Instance:
    caption: int  # index into the captions
    entity: int  # index into the caption's entities
    region: int  # the detected region of the entity's class
    label: str  # the class


@dataclass
class RepresentationsReport:
    reps: RepresentationSet
    points: np.ndarray  # (N, 2)
    paths: dict[str, Path]
    table: dict[str, dict[str, tuple[float, float]]]  # [query][key] -> (% nearest key of the class, chance %)
    space: str = "final states"  # what the vectors are (`representation_space`)

    @property
    def agreement(self) -> float:
        """% of words whose nearest region has their class (the headline entry of `table`)."""
        return self.table["word"]["region"][0]

    @property
    def chance(self) -> float:
        return self.table["word"]["region"][1]


def find_instances(captions: list[EntityCaption], store: RegionStore, class_names: list[str],
                   max_regions: int, skipped: SkipCounts) -> list[Instance]:
    """Every grounded phrase whose head word names a class and whose gold box a region of that class
    detects (IoU >= 0.5, the first such region)."""
    index = {c.split(",")[0].lower(): k for k, c in enumerate(class_names)}
    found = []
    for ci, cap in enumerate(captions):
        rec = None
        for ei, (ent, (_, stop)) in enumerate(zip(cap.entities, cap.entity_words)):
            label = cap.words[stop - 1].lower()
            if label not in index:
                skipped.add("head word is not a detector class")
                continue
            rec = rec or store.get(cap.image_id)
            boxes = np.asarray(rec.boxes[:max_regions], dtype=np.float64)
            hit = (box_iou(boxes, ent.gold_boxes) >= 0.5).any(1) & (np.asarray(rec.obj_id[:max_regions]) == index[label])
            if not hit.any():
                skipped.add("no detected region of the class")
                continue
            found.append(Instance(ci, ei, int(np.flatnonzero(hit)[0]), label))
    return found


def pooler_projections(model: torch.nn.Module, path: str) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """The text and image poolers of a model whose streams differ in width (ViLBERT's `t_pooler`, `v_pooler`:
    Linear + ReLU into `bi_hidden_size`), to draw words and regions in; None where the final states share a
    width. Streams of different widths without such poolers: a one-line error."""
    cfg = model.cfg
    width, v_width = cfg.hidden_size, getattr(cfg, "v_hidden_size", cfg.hidden_size)
    if width == v_width:
        return None
    encoder = getattr(model, ENCODER_PREFIX[arch_of(cfg)])
    if not (hasattr(encoder, "t_pooler") and hasattr(encoder, "v_pooler")):
        raise VlbertsError(f"{arch_of(cfg)}: text states are {width}-d and region states {v_width}-d, and the "
                           "model has no poolers into a common space to draw them in", path=path)
    return encoder.t_pooler, encoder.v_pooler


def representation_space(model_cfg: Any, pooled: bool) -> str:
    """What the drawn vectors are (`representations.json` "space"): the final states, or (`pooled`) their
    projections through ViLBERT's poolers."""
    if not pooled:
        return "final states"
    return (f"ViLBERT's alignment poolers (Linear + ReLU into {model_cfg.bi_hidden_size}-d, trained on h_CLS and "
            "h_IMG): words through the text pooler, regions through the image pooler")


def collect(model: torch.nn.Module, captions: list[EntityCaption], instances: list[Instance], store: RegionStore,
            tok: TextTokenizer, class_names: list[str], cfg: RepresentationsConfig, device: torch.device,
            pooled: tuple[torch.nn.Module, torch.nn.Module] | None = None) -> RepresentationSet:
    """The final states of each instance's word, region and (W-VisualBERT with tags) tag; `pooled`: the
    projections the words and the regions go through first (ViLBERT's poolers, `pooler_projections`)."""
    with_tags = reads_tags(model.cfg)
    tag_words = detector_tag_subwords(class_names, tok) if with_tags else None
    by_caption: dict[int, list[Instance]] = {}
    for inst in instances:
        by_caption.setdefault(inst.caption, []).append(inst)
    order = sorted(by_caption)
    vectors, classes, modalities, names = [], [], [], []
    model.eval()
    with progress() as bar, torch.no_grad():
        task = bar.add_task("representations", total=len(order), info="")
        for start in range(0, len(order), cfg.batch_size):
            chunk = [captions[i] for i in order[start : start + cfg.batch_size]]
            recs = [store.get(c.image_id) for c in chunk]  # each record read once
            regs = [load_regions(FetchedRecord(r, store.path), c.image_id, cfg.max_regions, model.cfg.visual_dim)
                    for r, c in zip(recs, chunk)]
            x = caption_inputs([c.ids for c in chunk], regs).to(device)
            tags = tag_region = None
            if with_tags:
                tags = detected_tags(recs, [c.image_id for c in chunk], regs, tag_words, store.path, tok.pad_id)
                tags = tags.to(device)
                tag_region = tags.tag_region.cpu().numpy()
            out = model.encode(x, tags=tags) if with_tags else model.encode(x)
            text_t, vision_t = out.text, out.vision  # (B, T, D), (B, R, Dv)
            if pooled is not None:  # ViLBERT: into the poolers' common space (module docstring)
                text_t, vision_t = pooled[0](text_t), pooled[1](vision_t)  # (B, T, Db), (B, R, Db)
            text, vision = text_t.float().cpu().numpy(), vision_t.float().cpu().numpy()
            tag_states = out.tags.float().cpu().numpy() if with_tags and out.tags is not None else None
            for b, cap in enumerate(chunk):
                for inst in by_caption[order[start + b]]:
                    ent = cap.entities[inst.entity]
                    name = f"{cap.caption_id}/{ent.chain_id or inst.entity}"
                    rows = [("word", text[b, ent.word_tokens[-1][-1]]), ("region", vision[b, inst.region])]
                    if tag_states is not None:
                        sel = (tag_region[b] == inst.region) & tags.tag_mask[b].cpu().numpy()
                        if sel.any():
                            rows.append(("tag", tag_states[b, sel].mean(0)))
                    for modality, v in rows:
                        vectors.append(v)
                        classes.append(inst.label)
                        modalities.append(modality)
                        names.append(name)
            bar.advance(task, len(chunk))
    return RepresentationSet(np.stack(vectors), classes, modalities, names)


def analyze_representations(cfg: RepresentationsConfig) -> RepresentationsReport:
    """Run the analysis (module docstring) and write its outputs."""
    cfg = start_recipe(cfg)
    for key in ("model", "entities", "features"):
        if not getattr(cfg, key):
            raise VlbertsError(f"analyze representations needs --{key}")
    if cfg.classes < 1 or cfg.per_class < 1:
        raise VlbertsError("--classes and --per_class must be >= 1")
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    model, model_cfg, meta = load_attention_model(cfg.model)
    cfg = fit_text_len(cfg, model_cfg, cfg.model)
    model.to(device)
    pooled = pooler_projections(model, cfg.model)  # ViLBERT: its streams' widths differ
    tok = TextTokenizer.load(cfg.model)
    store = RegionStore(cfg.features)
    class_names = store.metadata.classes
    if not class_names or "obj_id" not in store.fields:
        raise VlbertsError("the store has no detector class names (metadata classes) and obj_id: instances are "
                           "phrases whose class the detector found", path=cfg.features)
    store.vocabulary_ids("obj_id")  # checked: a region's class is its name in class_names
    images, bad = analysis_images(cfg, store)
    skipped = SkipCounts()
    captions = entity_captions(images, tok, cfg.max_text_len, skipped)
    found = find_instances(captions, store, class_names, cfg.max_regions, skipped)
    keep = sample_instances([f.label for f in found], cfg.per_class, cfg.classes, cfg.seed)
    instances = [found[i] for i in keep]
    if len(instances) < 2:
        raise VlbertsError(f"{len(instances)} instance(s) found in split {cfg.split!r} (skipped: {skipped.to_dict()})",
                           path=cfg.entities)
    write_run_config(cfg.out, cfg)  # before the forward passes and t-SNE
    reps = collect(model, captions, instances, store, tok, class_names, cfg, device, pooled)
    space = representation_space(model_cfg, pooled is not None)
    points = tsne(reps.vectors, perplexity=cfg.perplexity, iterations=cfg.iterations, seed=cfg.seed)
    table = agreement_table(reps)

    out = Path(cfg.out)
    paths = {"figure": out / "representations.png", "json": out / "representations.json"}
    arch = arch_of(model_cfg)
    save_representation_figure(points, reps, paths["figure"],
                               title=f"{arch}: final-layer representations ({len(instances)} instances, "
                                     f"{len(set(reps.classes))} classes)"
                                     + ("" if pooled is None else "\nthrough the alignment poolers (h_CLS, h_IMG)"))
    write_json(paths["json"], _to_json(cfg, reps, points, table, skipped, bad, meta.get("task"),
                                       time.perf_counter() - t0, space))
    return RepresentationsReport(reps, points, paths, table, space)


def _to_json(cfg: RepresentationsConfig, reps: RepresentationSet, points: np.ndarray,
             table: dict[str, dict[str, tuple[float, float]]], skipped: SkipCounts, bad: BadRecords,
             task: str | None, seconds: float, space: str) -> dict[str, Any]:
    agreement, chance = table["word"]["region"]
    return {
        "model": cfg.model, "model_task": task, "split": cfg.split, "space": space,
        "instances": len(set(reps.instances)),
        "points": {m: reps.modalities.count(m) for m in ("word", "region", "tag") if m in reps.modalities},
        "classes": sorted(set(reps.classes)),
        "word_nearest_region_same_class": round(agreement, 2), "chance": round(chance, 2),
        "nearest_same_class": {q: {k: {"agreement": round(a, 2), "chance": round(c, 2)} for k, (a, c) in row.items()}
                               for q, row in table.items()},
        "skipped": skipped.to_dict(), "bad_records": bad.to_dict(), "seconds": round(seconds, 2),
        # the perplexity t-SNE used (capped by the number of points), beside the one asked for
        "tsne": {"perplexity": round(effective_perplexity(cfg.perplexity, len(points)), 4),
                 "perplexity_asked": cfg.perplexity, "iterations": cfg.iterations, "seed": cfg.seed},
        "rows": [{"class": c, "modality": m, "instance": i, "x": round(float(x), 3), "y": round(float(y), 3)}
                 for c, m, i, (x, y) in zip(reps.classes, reps.modalities, reps.instances, points)],
    }


def config_from_args(args: list[str], base: dict | None = None) -> RepresentationsConfig:
    return apply_overrides(from_dict(RepresentationsConfig, base or {}), args)
