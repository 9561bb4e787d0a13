"""Recipe: fine-tune any architecture on RefCOCO+ (SPEC §4) and predict the evaluation splits.

ViLBERT §4 and VL-BERT §4.2.3: each candidate region of the image is scored from its final visual state
(`models.refcoco`: ViLBERT's linear layer, VL-BERT's MLP), trained with binary cross-entropy against
IoU >= 0.5 labels (or soft IoU targets, --soft_iou); at inference the highest-scoring region is the
answer, correct when its IoU with the gold box is >= 0.5 (`tasks.refcoco`).

Tracks (VL-BERT Table 3): the candidates are the regions of the --features store.
  detected  the detector's boxes (ViLBERT and VL-BERT use MAttNet's detections; here the world
            detector's proposals after box selection, the store `vlberts extract` writes)
  gt        the images' instance boxes: a store whose regions are exactly the instances.json boxes of
            every image (``vlberts extract --boxes gold``); checked per image before training
With --train_gt_features=GOLD.h5 (such a store) the detected track trains as ViLBERT's code does: each
training image's candidates are its detected regions followed by its instance boxes, --max_regions of them
together (`data.refcoco_dataset.DetectedThenGold`); evaluation reads the detected ones alone.
Next to the accuracy, metrics.json gives per split the upper bound (expressions with any candidate at
IoU >= 0.5) and the trivial baseline: the region the detector is most confident about (the store's
``obj_conf``), which knows nothing of the expression.

    vlberts finetune refcoco --init=runs/pt/model --features=F.h5 --out=runs/refcoco
        --refs='WORLD/refcoco+/refs(unc).p' --instances=WORLD/refcoco+/instances.json

    RUN/model/             the fine-tuned model (weights, config with task "refcoco", head, track; vocabulary)
    RUN/predictions.json   one row per evaluated expression: sent_id, ref_id, image_id, split, box [x, y, w, h]
                           (pixels), score (sigmoid of the top region's logit); `vlberts evaluate refcoco` scores it
    RUN/metrics.json       per split (val, testA, testB): accuracy, upper bound, highest-confidence baseline,
                           counts; the first split's numbers at the top level; skipped_records
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vlberts.config import apply_overrides, from_dict
from vlberts.data.mirror import check_flip
from vlberts.data.refcoco import RefCocoData, RefExpression, read_refcoco, xywh_to_xyxy
from vlberts.data.refcoco_dataset import DetectedThenGold, RefData, collate_refcoco
from vlberts.data.vqa_dataset import model_tag_subwords
from vlberts.errors import BadRecords, VlbertsError
from vlberts.features.identity import BOX_SELECTION, feature_identity, identity_difference
from vlberts.features.store import RegionStore
from vlberts.io import write_json
from vlberts.models.encoders import load_encoder_weights
from vlberts.models.refcoco import RefCocoModel, region_bce_loss
from vlberts.models.vlbert import start_from_roi_transform
from vlberts.recipes.common import FLIP_PROB_HELP, autocast, opt, resolve_device, seed_everything
from vlberts.recipes.finetune_loop import check_features, open_features, finetune_loop, FinetuneConfig, load_task_weights, num_updates, read_task_model, start_finetune
from vlberts.tasks.refcoco import score_regions, write_predictions
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import read_model_config
from vlberts.training.distributed import DistInfo, barrier, merge_over_ranks

TRACKS = ("detected", "gt")


@dataclass(frozen=True)
class FinetuneRefCocoConfig(FinetuneConfig):
    refs: str = opt("", "refs(unc).p (read through the restricted unpickler) or its JSON form refs.json")
    instances: str = opt("", "COCO instances.json holding the refs' images and annotations")
    out: str = opt("runs/refcoco", "run directory")
    epochs: float = opt(20.0, "passes over the training expressions (ViLBERT and VL-BERT: 20)")
    train_split: str = opt("train", "refs split to train on")
    eval_splits: str = opt("val,testA,testB", "comma-separated refs splits to predict and score after training")
    track: str = opt("detected", "detected: the store's regions are detections; gt: they must be exactly the "
                                 "images' instance boxes (a store from `vlberts extract --boxes gold`)")
    train_gt_features: str = opt("", "a store of the images' instance boxes (`vlberts extract --boxes gold`) whose "
                                     "regions follow each training image's detected ones, --max_regions of the two "
                                     "together (ViLBERT's code; raise --max_regions to make room: its config has "
                                     "100); evaluation reads the detected regions alone")
    soft_iou: bool = opt(False, "soft targets: a region's IoU with the gold box when >= 0.5 (ViLBERT's code), "
                                "instead of 1")
    flip_prob: float = opt(0.0, FLIP_PROB_HELP)
    max_text_len: int = opt(24, "expression tokens incl. [CLS] and [SEP]")
    max_regions: int = opt(36, "candidate regions per image (the store's first ones)")
    eval_batch_size: int = opt(256, "expressions per prediction batch")
    skip_bad: bool = opt(False, "drop malformed refs/annotations, refs whose image or annotation is missing and "
                                "expressions whose image is not in the store, counting them (a warning and "
                                "metrics.json's skipped_records), instead of stopping at the first")


CONFIG_CLASS = FinetuneRefCocoConfig


def config_from_args(args: list[str], base: dict | None = None) -> FinetuneRefCocoConfig:
    return apply_overrides(from_dict(FinetuneRefCocoConfig, base or {}), args)


def load_refcoco_model(directory: str | Path) -> tuple[RefCocoModel, TextTokenizer]:
    """Load a model directory written by this recipe (any architecture)."""
    model_cfg, _ = read_task_model(directory, "refcoco", "RefCOCO+")
    return load_task_weights(lambda: RefCocoModel(model_cfg), directory), TextTokenizer.load(directory)


def ref_data(model: RefCocoModel, expressions: list[RefExpression], store: RegionStore, tok: TextTokenizer,
             *, max_text_len: int, max_regions: int, soft: bool = False, float16: bool = False,
             flip_prob: float = 0.0, seed: int = 0, gold: RegionStore | None = None) -> RefData:
    """The expressions laid out for `model`, with detector tags from the store if it reads them; float16
    features kept so with `float16` (`open_features`); training items mirrored with `flip_prob` (`data.mirror`);
    with a `gold` store, each image's candidates are the store's regions followed by gold's (`DetectedThenGold`)."""
    tags = model_tag_subwords(model.reads_tags, store, tok)
    return RefData(expressions, store if gold is None else DetectedThenGold(store, gold), tok, max_text_len=max_text_len, max_regions=max_regions,
                   feature_dim=model.cfg.visual_dim, soft=soft, tag_subwords=tags, float16=float16,
                   flip_prob=flip_prob, seed=seed)


@torch.no_grad()
def predict_refcoco(
    model: RefCocoModel, tok: TextTokenizer, expressions: list[RefExpression], store: RegionStore,
    *, max_regions: int = 36, max_text_len: int = 24, batch_size: int = 256, device: torch.device | str = "cpu",
    precision: str = "auto", dist: DistInfo = DistInfo(),
) -> dict[int, list[float]]:
    """position in `expressions` -> the logits of its candidate regions (the store's first `max_regions`),
    on every rank. Distributed, each rank scores every world-th expression and the shares are merged."""
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    model.to(dev).eval()
    mine = list(range(dist.rank, len(expressions), dist.world))
    data = ref_data(model, [expressions[i] for i in mine], store, tok, max_text_len=max_text_len,
                    max_regions=max_regions)
    out: dict[int, list[float]] = {}
    for start in range(0, len(data), batch_size):
        items = [data[i] for i in range(start, min(start + batch_size, len(data)))]
        batch = collate_refcoco(items, tok.pad_id).to(dev)
        with autocast(dev, precision):
            logits = model(batch.inputs, batch.tags).float()  # (B, R)
        for row, item in zip(logits.cpu(), items):
            out[mine[item["index"]]] = row[: len(item["targets"])].tolist()
    return merge_over_ranks(out, dist)


def _with_features(exprs: list[RefExpression], split: str, store: RegionStore, bad: BadRecords) -> list[RefExpression]:
    """The expressions whose image is in the store; a missing image is an error naming the store, or with
    --skip_bad dropped and counted ("missing features")."""
    missing = sorted({e.image_id for e in exprs if e.image_id not in store})
    for image_id in missing:
        n = sum(1 for e in exprs if e.image_id == image_id)
        bad.handle(VlbertsError(f"image id {image_id} of split {split} not in store ({n} expressions affected)",
                                path=store.path, record=image_id), "missing features")
    return [e for e in exprs if e.image_id in store] if missing else exprs


def check_gold_store(data: RefCocoData, image_ids: set[int], store: RegionStore, max_regions: int,
                     setting: str = "--track=gt") -> None:
    """Track gt (or --train_gt_features' store, `setting`): every image's store regions are exactly its instance
    boxes (any order, 0.5 px)."""
    for image_id in sorted(image_ids):
        want = sorted(xywh_to_xyxy(a.bbox) for a in data.image_annotations(image_id))
        boxes = store.get(str(image_id)).boxes
        got = sorted(tuple(b) for b in boxes[:max_regions].tolist())
        if len(boxes) > max_regions or len(got) != len(want) or any(
                max(abs(p - q) for p, q in zip(g, w)) > 0.5 for g, w in zip(got, want)):
            raise VlbertsError(
                f"{setting} needs a store whose regions are exactly each image's instance boxes (at most "
                f"--max_regions={max_regions}); this image's {len(boxes)} regions are not its {len(want)} instance "
                f"boxes (write such a store with `vlberts features extract --boxes instances.json` from your images, "
                f"or `vlberts extract --boxes gold` on the world)", path=store.path,
                record=f"image {image_id}")


def gold_candidates(cfg: FinetuneRefCocoConfig, data: RefCocoData, store: RegionStore, train: list[RefExpression],
                    bad: BadRecords, float16: bool) -> RegionStore | None:
    """--train_gt_features' store, checked: the detected track only; its regions exactly each training image's
    instance boxes; features of the same extractor and width as --features' (the box selection aside)."""
    if not cfg.train_gt_features:
        return None
    if cfg.track != "detected":
        raise VlbertsError("--train_gt_features adds the instance boxes to the detected track's training candidates; "
                           "with --track=gt the candidates are already those boxes")
    gold = RegionStore(cfg.train_gt_features, upcast=not float16)
    if gold.feature_dim != store.feature_dim:
        raise VlbertsError(f"its features are {gold.feature_dim}-d but --features' are {store.feature_dim}-d",
                           path=cfg.train_gt_features)
    differ = identity_difference(feature_identity(gold), feature_identity(store), ignore=BOX_SELECTION)
    if differ:
        raise VlbertsError(f"its features come from another extractor or settings than --features' ({differ}): the "
                           "two stores' regions are scored side by side", path=cfg.train_gt_features)
    ids = {e.image_id for e in train if e.image_id in gold}
    check_gold_store(data, ids, gold, max_regions=max((gold.num_boxes(i) for i in ids), default=0),
                     setting="--train_gt_features")
    return gold


def split_metrics(exprs: list[RefExpression], scores: dict[int, list[float]], store: RegionStore,
                  max_regions: int) -> dict:
    """Accuracy of the model's top region, the candidates' upper bound and the highest-confidence baseline
    (the store's obj_conf; absent when the store has none), in percent, with counts."""
    boxes, conf, gold = [], [], []
    for e in exprs:
        rec = store.get(str(e.image_id))
        boxes.append([tuple(b) for b in rec.boxes[:max_regions].tolist()])
        conf.append(None if rec.obj_conf is None else rec.obj_conf[:max_regions].tolist())
        gold.append(e.gold_box_xyxy)
    model = score_regions([scores[i] for i in range(len(exprs))], boxes, gold)
    out = {"accuracy": model.accuracy, "upper_bound": model.upper_bound,
           "num_expressions": model.num_expressions, "num_correct": model.num_correct,
           "num_refs": len({e.ref_id for e in exprs}), "num_images": len({e.image_id for e in exprs})}
    if all(c is not None for c in conf):
        out["confidence_baseline"] = score_regions(conf, boxes, gold).accuracy
    return out


def prediction_rows(split: str, exprs: list[RefExpression], scores: dict[int, list[float]], store: RegionStore,
                    max_regions: int) -> list[dict]:
    """The predictions file rows of one split: the top region's box as [x, y, w, h] and its sigmoid score."""
    rows = []
    for i, e in enumerate(exprs):
        s = scores[i]
        top = int(np.argmax(s))  # ties: the lowest index, as tasks.refcoco.top_region
        x1, y1, x2, y2 = store.get(str(e.image_id)).boxes[top].tolist()
        rows.append({"sent_id": e.sent_id, "ref_id": e.ref_id, "image_id": e.image_id, "split": split,
                     "box": [x1, y1, x2 - x1, y2 - y1], "score": 1.0 / (1.0 + math.exp(-s[top]))})
    return rows


def finetune_refcoco(cfg: FinetuneRefCocoConfig) -> Path | None:
    """Fine-tune on RefCOCO+, then predict and score the evaluation splits; returns the model directory
    (None when stopped early by `stop_after`). Under torchrun the ranks train data-parallel through
    `finetune_loop` and share the prediction."""
    cfg, out, device, dist = start_finetune(cfg, "refcoco", ("init", "refs", "instances", "features"))
    if cfg.track not in TRACKS:
        raise VlbertsError(f"unknown track {cfg.track!r}; valid: {', '.join(TRACKS)}")
    check_flip(cfg.flip_prob, cfg.init)
    eval_splits = [s for s in cfg.eval_splits.split(",") if s]

    bad = BadRecords(skip=cfg.skip_bad)
    data = read_refcoco(cfg.refs, cfg.instances, bad)
    store, float16 = open_features(cfg, device)
    train = _with_features(data.expressions(cfg.train_split), cfg.train_split, store, bad)
    gold = gold_candidates(cfg, data, store, train, bad, float16)
    if gold is not None:  # ViLBERT's training candidates: the images' instance boxes too
        train = _with_features(train, cfg.train_split, gold, bad)
    evals = {s: _with_features(data.expressions(s), s, store, bad) for s in eval_splits}
    if bad.total and dist.main:  # first, so that an error below for an emptied split shows what was skipped
        print(bad.warning(), file=sys.stderr)
    if not train:
        raise VlbertsError(f"no training expressions in split {cfg.train_split!r}"
                           + (" with regions in both stores" if gold is not None else ""), path=cfg.refs)
    if sum(len(ex) for ex in evals.values()) != len({e.sent_id for ex in evals.values() for e in ex}):
        raise VlbertsError(f"--eval_splits={cfg.eval_splits} share expressions (e.g. test and testA); "
                           "name each split once")
    if cfg.track == "gt":
        check_gold_store(data, {e.image_id for ex in (train, *evals.values()) for e in ex}, store, cfg.max_regions)

    model_cfg, _ = read_model_config(cfg.init)
    tok = TextTokenizer.load(cfg.init)
    seed_everything(cfg.seed)
    model = RefCocoModel(model_cfg)
    sd = load_encoder_weights(model.encoder, cfg.init)
    # VL-BERT's scorer starts its transform from the pre-training model's RoI head, as the release's config does
    scorer_started = model.head == "vlbert_mlp" and start_from_roi_transform(model.scorer.dense, sd)
    if model_cfg.visual_dim != store.feature_dim:
        raise VlbertsError(
            f"store features are {store.feature_dim}-d but the model expects {model_cfg.visual_dim}-d", path=cfg.features
        )
    # The gt track's store holds the gold boxes on purpose: only a difference in the features of a box warns.
    features, mismatch = check_features(store, cfg.init, dist, ignore=BOX_SELECTION if cfg.track == "gt" else ())
    train_data = ref_data(model, train, store, tok, max_text_len=cfg.max_text_len, max_regions=cfg.max_regions,
                          soft=cfg.soft_iou, float16=float16, flip_prob=cfg.flip_prob, seed=cfg.seed, gold=gold)
    extra = {"task": "refcoco", "head": model.head, "track": cfg.track, "soft_iou": cfg.soft_iou, "features": features,
             "train_gt_features": bool(gold)}
    final = finetune_loop(
        cfg, out=out, tokenizer=tok, model=model, model_cfg=model_cfg, data=train_data, device=device, dist=dist, extra=extra,
        collate=lambda items: collate_refcoco(items, tok.pad_id),
        loss=lambda b: region_bce_loss(model(b.inputs, b.tags), b.targets, b.inputs.region_mask),
        count=lambda b: int(b.inputs.region_mask.sum()),  # the loss is a mean over the real regions
        label="fine-tune RefCOCO+", head_prefixes=model.head_prefixes,
        lengths=train_data.lengths() if cfg.length_group > 1 else None,
    )
    if final is None:
        return None

    metrics: dict = {"track": cfg.track, "head": model.head, "soft_iou": cfg.soft_iou,
                     "train_gt_features": str(cfg.train_gt_features) if gold is not None else None,
                     **({"scorer_from_pretraining": scorer_started} if model.head == "vlbert_mlp" else {}),
                     "train_expressions": len(train), "train_refs": len({e.ref_id for e in train}),
                     "steps": num_updates(cfg, len(train_data)), "skipped_records": bad.to_dict(),
                     **mismatch, "splits": {}}
    rows: list[dict] = []
    for split, exprs in evals.items():
        if not exprs:
            continue
        scores = predict_refcoco(model, tok, exprs, store, max_regions=cfg.max_regions, max_text_len=cfg.max_text_len,
                                 batch_size=cfg.eval_batch_size, device=device, precision=cfg.precision, dist=dist)
        if dist.main:
            metrics["splits"][split] = split_metrics(exprs, scores, store, cfg.max_regions)
            rows.extend(prediction_rows(split, exprs, scores, store, cfg.max_regions))
    if dist.main:
        if metrics["splits"]:  # the first evaluated split's numbers at the top level
            first = next(iter(metrics["splits"].values()))
            metrics.update({k: first[k] for k in ("accuracy", "upper_bound", "confidence_baseline", "num_expressions")
                            if k in first})
            metrics["eval_split"] = next(iter(metrics["splits"]))
        write_predictions(out / "predictions.json", rows)
        write_json(out / "metrics.json", metrics)
    barrier(dist)
    return final
