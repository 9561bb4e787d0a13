"""Recipe: fine-tune any architecture on Flickr30K Entities phrase grounding (SPEC §4) and predict the
evaluation splits.

VisualBERT App. B.4 (BAN's setting): an extra attention block on top of the encoder; the head-averaged
attention from a phrase's last subword to the image's regions is the phrase's distribution over the
regions (`models.flickr_entities`), trained with cross-entropy against the uniform distribution over its
positive regions (IoU >= 0.5 with any gold box of its chain; KL up to a constant). The most-attended region
is the prediction; R@1/5/10 over the entities with gold boxes, and the candidates' upper bound
(`tasks.flickr_entities`). Phrases without boxes (notvisual, scene, nobndbox) are skipped, as BAN does.

Next to R@K, metrics.json gives per split the trivial baseline: the regions ranked by the detector's
confidence (the store's ``obj_conf``), which knows nothing of the phrase.

    vlberts finetune flickr_entities --init=runs/pt/model --entities=WORLD/flickr30k_entities
        --features=F.h5 --out=runs/flickr_entities

    RUN/model/             the fine-tuned model (weights, config with task "flickr_entities", iou_rule; vocabulary)
    RUN/predictions.json   one row per evaluated phrase (format in `tasks.flickr_entities`): image_id, split,
                           sentence, chain_id, first_word_index, phrase, top-10 boxes [x, y, w, h] (pixels) and
                           their attention; `vlberts evaluate flickr_entities` scores it
    RUN/metrics.json       per split (val, test): r@1, r@5, r@10, upper_bound, baseline {r@1, r@5, r@10},
                           counts, skipped phrases; the first split's numbers at the top level; skipped_records
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from vlberts.config import apply_overrides, from_dict
from vlberts.data.flickr_entities_dataset import (
    EntityData,
    PhraseCaption,
    collate_entities,
    phrase_captions,
    read_split_images,
)
from vlberts.data.vqa_dataset import model_tag_subwords
from vlberts.errors import BadRecords, VlbertsError
from vlberts.features.store import RegionStore
from vlberts.io import write_json
from vlberts.models.encoders import load_encoder_weights
from vlberts.models.flickr_entities import FlickrEntitiesModel, grounding_loss
from vlberts.recipes.common import autocast, opt, resolve_device, seed_everything
from vlberts.recipes.finetune_loop import check_features, open_features, finetune_loop, FinetuneConfig, load_task_weights, num_updates, read_task_model, start_finetune
from vlberts.tasks.flickr_entities import IOU_RULES, TOP_K, candidates, rank_regions, score_regions, write_predictions
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import read_model_config
from vlberts.training.distributed import DistInfo, barrier, merge_over_ranks


@dataclass(frozen=True)
class FinetuneFlickrEntitiesConfig(FinetuneConfig):
    entities: str = opt("", "Flickr30K Entities directory: Sentences/, Annotations/, train.txt, val.txt, test.txt")
    out: str = opt("runs/flickr_entities", "run directory")
    train_split: str = opt("train", "split to train on")
    eval_splits: str = opt("val,test", "comma-separated splits to predict and score after training")
    iou_rule: str = opt("any", "a region is positive (target and metric) at IoU >= 0.5 with: any gold box of the "
                               "phrase's chain (BAN/VisualBERT), or union: the union box of its boxes (Plummer et al.)")
    max_text_len: int = opt(64, "caption tokens incl. [CLS] and [SEP]; a phrase cut off counts as wrong")
    max_regions: int = opt(36, "candidate regions per image (the store's first ones)")
    eval_batch_size: int = opt(128, "captions per prediction batch")
    skip_bad: bool = opt(False, "drop images whose Sentences/Annotations file is malformed and images missing from the "
                                "store, counting them (a warning and metrics.json's skipped_records), instead of "
                                "stopping at the first")


CONFIG_CLASS = FinetuneFlickrEntitiesConfig


def config_from_args(args: list[str], base: dict | None = None) -> FinetuneFlickrEntitiesConfig:
    return apply_overrides(from_dict(FinetuneFlickrEntitiesConfig, base or {}), args)


def load_flickr_entities_model(directory: str | Path) -> tuple[FlickrEntitiesModel, TextTokenizer]:
    """Load a model directory written by this recipe (any architecture)."""
    model_cfg, _ = read_task_model(directory, "flickr_entities", "Flickr30K Entities")
    return load_task_weights(lambda: FlickrEntitiesModel(model_cfg), directory), TextTokenizer.load(directory)


def entity_data(model: FlickrEntitiesModel, captions: list[PhraseCaption], store: RegionStore, tok: TextTokenizer,
                *, max_regions: int, rule: str, train: bool, float16: bool = False) -> EntityData:
    """The captions laid out for `model`, with detector tags from the store if it reads them; float16 features
    kept so with `float16` (`open_features`)."""
    tags = model_tag_subwords(model.reads_tags, store, tok)
    return EntityData(captions, store, max_regions=max_regions, feature_dim=model.cfg.visual_dim, rule=rule,
                      train=train, tag_subwords=tags, float16=float16)


@torch.no_grad()
def predict_flickr_entities(
    model: FlickrEntitiesModel, tok: TextTokenizer, captions: list[PhraseCaption], store: RegionStore,
    *, max_regions: int = 36, batch_size: int = 128, device: torch.device | str = "cpu", precision: str = "auto",
    dist: DistInfo = DistInfo(),
) -> dict[tuple[int, int], list[float]]:
    """(caption position, phrase position) -> the head-averaged attention of the phrase's last subword over
    its image's regions (the store's first `max_regions`), on every rank; phrases cut off by the text budget
    have no entry. Distributed, each rank predicts every world-th caption and the shares are merged."""
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    model.to(dev).eval()
    mine = list(range(dist.rank, len(captions), dist.world))
    data = entity_data(model, [captions[i] for i in mine], store, tok, max_regions=max_regions, rule="any",
                       train=False)
    out: dict[tuple[int, int], list[float]] = {}
    for start in range(0, len(data), batch_size):
        items = [data[i] for i in range(start, min(start + batch_size, len(data)))]
        batch = collate_entities(items, tok.pad_id).to(dev)
        with autocast(dev, precision):
            attn = model(batch.inputs, batch.positions, batch.tags).float().exp()  # (B, P, R)
        for rows, item in zip(attn.cpu(), items):
            k = item["index"]
            n = len(item["targets"][0])  # the image's regions
            for p, j in enumerate(data.phrases[k]):
                out[(mine[data.source[k]], j)] = rows[p, :n].tolist()
    return merge_over_ranks(out, dist)


def score_split(captions: list[PhraseCaption], scores: dict[tuple[int, int], list[float]], store: RegionStore,
                max_regions: int, rule: str) -> tuple[dict, list[tuple[PhraseCaption, int, list[float] | None, list]]]:
    """R@1/5/10 of the model, the candidates' upper bound and the highest-confidence baseline (absent when
    the store has no obj_conf), in percent, with counts; and per phrase (caption, phrase index, scores or
    None, candidate boxes) for the predictions file."""
    entries = [(cap, j) for cap in captions for j in range(len(cap.phrases))]
    keys = {id(cap): c for c, cap in enumerate(captions)}
    boxes, conf = candidates(store, [cap.image_id for cap, _ in entries], max_regions)
    model_scores = [scores.get((keys[id(cap)], j)) for cap, j in entries]
    golds = [cap.phrases[j].gold_boxes for cap, j in entries]
    result = score_regions(model_scores, boxes, golds, rule)
    out = {**result.to_dict(), "num_captions": len(captions), "num_images": len({c.image_id for c in captions}),
           "truncated": sum(s is None for s in model_scores)}
    if all(c is not None for c in conf):
        out["baseline"] = {f"r@{k}": v for k, v in score_regions(conf, boxes, golds, rule).recall.items()}
    return out, [(cap, j, s, b) for (cap, j), s, b in zip(entries, model_scores, boxes)]


def prediction_rows(split: str, phrases: list[tuple[PhraseCaption, int, list[float] | None, list]]) -> list[dict]:
    """The predictions file rows of one split: the top-10 regions' boxes as [x, y, w, h] and their attention."""
    rows = []
    for cap, j, scores, boxes in phrases:
        p = cap.phrases[j]
        top = rank_regions(scores)[:TOP_K] if scores is not None else []
        rows.append({"image_id": cap.image_id, "split": split, "sentence": cap.sentence, "chain_id": p.chain_id,
                     "first_word_index": p.first_word_index, "phrase": p.text,
                     "boxes": [[boxes[i][0], boxes[i][1], boxes[i][2] - boxes[i][0], boxes[i][3] - boxes[i][1]]
                               for i in top],
                     "scores": [scores[i] for i in top]})
    return rows


def finetune_flickr_entities(cfg: FinetuneFlickrEntitiesConfig) -> Path | None:
    """Fine-tune phrase grounding, then predict and score the evaluation splits; returns the model directory
    (None when stopped early by `stop_after`). Under torchrun the ranks train data-parallel through
    `finetune_loop` and share the prediction."""
    cfg, out, device, dist = start_finetune(cfg, "flickr_entities", ("init", "entities", "features"))
    if cfg.iou_rule not in IOU_RULES:
        raise VlbertsError(f"unknown iou_rule {cfg.iou_rule!r}; valid: {', '.join(IOU_RULES)}")
    eval_splits = [s for s in cfg.eval_splits.split(",") if s]
    if len(set(eval_splits)) != len(eval_splits):
        raise VlbertsError(f"--eval_splits={cfg.eval_splits} names a split twice")

    bad = BadRecords(skip=cfg.skip_bad)
    store, float16 = open_features(cfg, device)
    train_images = read_split_images(cfg.entities, cfg.train_split, store, bad)
    eval_images = {s: read_split_images(cfg.entities, s, store, bad) for s in eval_splits}
    if bad.total and dist.main:
        print(bad.warning(), file=sys.stderr)

    model_cfg, _ = read_model_config(cfg.init)
    tok = TextTokenizer.load(cfg.init)
    seed_everything(cfg.seed)
    model = FlickrEntitiesModel(model_cfg)
    load_encoder_weights(model.encoder, cfg.init)
    if model_cfg.visual_dim != store.feature_dim:
        raise VlbertsError(
            f"store features are {store.feature_dim}-d but the model expects {model_cfg.visual_dim}-d", path=cfg.features
        )
    features, mismatch = check_features(store, cfg.init, dist)
    train_skipped: Counter = Counter()
    train_captions = phrase_captions(train_images, tok, cfg.max_text_len, train_skipped)
    train_data = entity_data(model, train_captions, store, tok, max_regions=cfg.max_regions, rule=cfg.iou_rule,
                             train=True, float16=float16)
    if not len(train_data):
        raise VlbertsError(f"no training phrase of split {cfg.train_split!r} has a positive region",
                           path=Path(cfg.entities) / f"{cfg.train_split}.txt")
    extra = {"task": "flickr_entities", "iou_rule": cfg.iou_rule, "features": features}
    final = finetune_loop(
        cfg, out=out, tokenizer=tok, model=model, model_cfg=model_cfg, data=train_data, device=device, dist=dist,
        extra=extra, collate=lambda items: collate_entities(items, tok.pad_id),
        loss=lambda b: grounding_loss(model(b.inputs, b.positions, b.tags), b.targets, b.phrase_mask),
        count=lambda b: int(b.phrase_mask.sum()),  # the loss is a mean over the scored phrases
        label="fine-tune Flickr30K Entities", head_prefixes=model.head_prefixes,
        lengths=train_data.lengths() if cfg.length_group > 1 else None,
    )
    if final is None:
        return None

    train_phrases = sum(len(p) for p in train_data.phrases)
    no_positive = sum(len(c.phrases) for c in train_captions) - train_skipped["truncated"] - train_phrases
    metrics: dict = {"iou_rule": cfg.iou_rule, "max_regions": cfg.max_regions, "train_captions": len(train_data),
                     "train_phrases": train_phrases,
                     "train_skipped_phrases": {**dict(sorted(train_skipped.items())), "no positive region": no_positive},
                     "steps": num_updates(cfg, len(train_data)), "skipped_records": bad.to_dict(),
                     **mismatch, "splits": {}}
    rows: list[dict] = []
    for split, images in eval_images.items():
        skipped: Counter = Counter()
        captions = phrase_captions(images, tok, cfg.max_text_len, skipped)
        if not captions:
            if dist.main:
                print(f"warning: {Path(cfg.entities) / f'{split}.txt'}: no phrase to evaluate in split {split!r} "
                      f"({len(images)} images); it is not scored", file=sys.stderr)
            continue
        scores = predict_flickr_entities(model, tok, captions, store, max_regions=cfg.max_regions,
                                         batch_size=cfg.eval_batch_size, device=device, precision=cfg.precision,
                                         dist=dist)
        if dist.main:
            numbers, phrases = score_split(captions, scores, store, cfg.max_regions, cfg.iou_rule)
            skipped.pop("truncated", None)  # counted wrong, reported as "truncated" in the split's numbers
            metrics["splits"][split] = {**numbers, "skipped_phrases": dict(sorted(skipped.items()))}
            rows.extend(prediction_rows(split, phrases))
    if dist.main:
        if metrics["splits"]:  # the first evaluated split's numbers at the top level
            first = next(iter(metrics["splits"].values()))
            metrics.update({k: first[k] for k in ("r@1", "r@5", "r@10", "upper_bound", "baseline", "num_entities")
                            if k in first})
            metrics["eval_split"] = next(iter(metrics["splits"]))
        write_predictions(out / "predictions.json", rows)
        write_json(out / "metrics.json", metrics)
    barrier(dist)
    return final
