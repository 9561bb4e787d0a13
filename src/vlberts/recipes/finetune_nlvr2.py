"""Recipe: fine-tune any architecture on NLVR2 (SPEC §4), then predict and score accuracy and consistency.

The model is `models.nlvr2.NLVR2Model`: the pre-trained encoder of --init and a new two-way classifier,
with the statement encoded once per image and the two pooled outputs concatenated (LXMERT §4.2, App. B;
`--encoding=pair`, the default except for VisualBERT) or both images' regions in one sequence with a
segment per image (VisualBERT App. B.3; `--encoding=joint`, VisualBERT's default and only VisualBERT's),
trained with cross-entropy through the shared loop (`finetune_loop`: data-parallel under torchrun,
checkpointed, exactly resumable).

Images: NLVR2 names the two images of an example ``split-setid-pairid-img0`` / ``-img1``. Without
--image_map these names are the region-store keys (as in LXMERT's NLVR2 feature files); with it, a JSON
object {name: store image id} (the world's ``nlvr2/images.json``) maps them first.

    vlberts finetune nlvr2 --init=runs/pt/model --features=F.h5 --out=runs/nlvr2
        --train_statements=WORLD/nlvr2/train.json --eval_statements=WORLD/nlvr2/test1.json
        --image_map=WORLD/nlvr2/images.json

    RUN/model/            the fine-tuned model (weights, config with task "nlvr2" and the encoding, vocabulary)
    RUN/predictions.csv   official predictions file (``identifier,True|False``) of the evaluation statements
    RUN/metrics.json      accuracy and consistency (percent), the majority baseline (always the training
                          majority label: its accuracy and consistency), counts, skipped_records
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlberts.config import apply_overrides, from_dict
from vlberts.data.nlvr2 import NLVR2Example, read_image_map, read_nlvr2
from vlberts.data.nlvr2_dataset import NLVR2Data, collate_nlvr2
from vlberts.data.regions import RegionSource
from vlberts.data.vqa_dataset import model_tag_subwords
from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import write_json
from vlberts.models.encoders import load_encoder_weights
from vlberts.models.nlvr2 import NLVR2Model, nlvr2_loss, predict_labels
from vlberts.recipes.common import autocast, opt, resolve_device, seed_everything
from vlberts.recipes.finetune_loop import (all_labelled, check_features, labelled_evaluation, open_features, require_eval_examples, require_train_examples, finetune_loop, FinetuneConfig, load_task_weights, num_updates,
                                           read_task_model, start_finetune)
from vlberts.tasks.nlvr2 import nlvr2_metrics, write_predictions
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import read_model_config
from vlberts.training.distributed import DistInfo, barrier, merge_over_ranks


@dataclass(frozen=True)
class FinetuneNLVR2Config(FinetuneConfig):
    train_statements: str = opt("", "NLVR2 statements (JSON lines, labelled) of the training split, e.g. train.json")
    eval_statements: str = opt("", "NLVR2 statements to predict (and score, when labelled) after training, e.g. test1.json")
    image_map: str = opt("", "JSON {NLVR2 image name: store image id} (the world's nlvr2/images.json); "
                             "empty: the names are the store's keys")
    out: str = opt("runs/nlvr2", "run directory")
    encoding: str = opt("auto", "pair (LXMERT: each image encoded with the statement, pooled outputs concatenated), "
                                "joint (VisualBERT: both images in one sequence, a segment per image; VisualBERT "
                                "only) or auto (joint for VisualBERT, pair otherwise)")
    max_text_len: int = opt(40, "statement tokens incl. [CLS] and [SEP]")
    max_regions: int = opt(36, "regions per image")
    eval_batch_size: int = opt(128, "examples per prediction batch")
    skip_bad: bool = opt(False, "drop malformed statement lines and statements whose images are not in the image "
                                "map or the store, counting them (a warning and metrics.json's skipped_records), "
                                "instead of stopping at the first")


CONFIG_CLASS = FinetuneNLVR2Config


def resolve_images(
    examples: Sequence[NLVR2Example], path: str, store: RegionSource, features: str,
    image_map: Mapping[str, str] | None, map_path: str, bad: BadRecords,
) -> tuple[list[NLVR2Example], list[tuple[str, str]]]:
    """The examples both of whose images have features, with their store ids. An image missing from the
    image map or the store is an error naming the file and the statement, or, when skipping bad records,
    the statement is dropped and counted ("missing image")."""
    kept, ids = [], []
    for ex in examples:
        pair = []
        for name in ex.image_ids:
            if image_map is not None and name not in image_map:
                bad.handle(VlbertsError(f"image {name} of {path} is not in the image map", path=map_path,
                                        record=ex.identifier), "missing image")
                break
            image_id = image_map[name] if image_map is not None else name
            if image_id not in store:
                shown = name if image_id == name else f"{name} (image id {image_id})"
                bad.handle(VlbertsError(f"image {shown} of {path} not in store", path=features,
                                        record=ex.identifier), "missing image")
                break
            pair.append(image_id)
        if len(pair) == 2:
            kept.append(ex)
            ids.append((pair[0], pair[1]))
    return kept, ids


def nlvr2_data(
    model: NLVR2Model, examples: Sequence[NLVR2Example], images: Sequence[tuple[str, str]], regions: RegionSource,
    tok: TextTokenizer, *, max_text_len: int, max_regions: int, float16: bool = False,
) -> NLVR2Data:
    """The examples laid out for the model's encoding, with detector tags when the model reads them; float16
    features kept so with `float16` (`open_features`)."""
    tags = model_tag_subwords(model.reads_tags, regions, tok)
    return NLVR2Data(examples, images, regions, tok, encoding=model.encoding, max_text_len=max_text_len,
                     max_regions=max_regions, feature_dim=model.cfg.visual_dim, tag_subwords=tags, float16=float16)


def build_nlvr2_model(init: str | Path, encoding: str = "auto") -> tuple[NLVR2Model, Any]:
    """An NLVR2 model whose encoder comes from a pre-trained (or fine-tuned) model directory; new classifier."""
    model_cfg, _ = read_model_config(init)
    model = NLVR2Model(model_cfg, encoding)
    load_encoder_weights(model.encoder, init)
    return model, model_cfg


def load_nlvr2_model(directory: str | Path) -> tuple[NLVR2Model, TextTokenizer]:
    """Load a model directory fine-tuned by this recipe (any architecture, either encoding)."""
    model_cfg, meta = read_task_model(directory, "nlvr2", "NLVR2")
    return load_task_weights(lambda: NLVR2Model(model_cfg, meta["encoding"]), directory), TextTokenizer.load(directory)


@torch.no_grad()
def predict_nlvr2(
    model: NLVR2Model, tok: TextTokenizer, examples: Sequence[NLVR2Example], images: Sequence[tuple[str, str]],
    regions: RegionSource, *, max_regions: int = 36, max_text_len: int = 40, batch_size: int = 128,
    device: str | torch.device = "auto", precision: str = "auto", dist: DistInfo = DistInfo(),
) -> dict[str, bool]:
    """identifier -> predicted label, on every rank (each rank predicts every world-th example; merged)."""
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    model.to(dev).eval()
    mine = list(examples[dist.rank :: dist.world])
    data = nlvr2_data(model, mine, list(images[dist.rank :: dist.world]), regions, tok,
                      max_text_len=max_text_len, max_regions=max_regions)
    preds: dict[str, bool] = {}
    for start in range(0, len(data), batch_size):
        stop = min(start + batch_size, len(data))
        batch = collate_nlvr2([data[i] for i in range(start, stop)], tok.pad_id).to(dev)
        with autocast(dev, precision):
            labels = predict_labels(model, batch)
        for ex, label in zip(mine[start:stop], labels):
            preds[ex.identifier] = label
    return merge_over_ranks(preds, dist)


def finetune_nlvr2(cfg: FinetuneNLVR2Config) -> Path | None:
    """Fine-tune on NLVR2, then predict and score the evaluation statements; returns the model directory
    (None when stopped early by `stop_after`)."""
    cfg, out, device, dist = start_finetune(cfg, "nlvr2", ("init", "train_statements", "features"))

    # Statements, and the store ids of their images.
    bad = BadRecords(skip=cfg.skip_bad)
    train = read_nlvr2(cfg.train_statements, require_labels=True, bad=bad)
    evals = read_nlvr2(cfg.eval_statements, bad=bad) if cfg.eval_statements else []
    image_map = read_image_map(cfg.image_map) if cfg.image_map else None
    store, float16 = open_features(cfg, device)
    train, train_images = resolve_images(train, cfg.train_statements, store, cfg.features, image_map, cfg.image_map, bad)
    evals = labelled_evaluation(evals, lambda ex: ex.label is not None, lambda ex: ex.identifier, cfg.eval_statements,
                                bad)
    evals, eval_images = resolve_images(evals, cfg.eval_statements, store, cfg.features, image_map, cfg.image_map, bad)
    require_eval_examples(evals, cfg.eval_statements)
    if bad.total and dist.main:
        print(bad.warning(), file=sys.stderr)
    require_train_examples(train, cfg.train_statements)

    # Model: the pre-trained encoder and a new classifier.
    tok = TextTokenizer.load(cfg.init)
    seed_everything(cfg.seed)
    model, model_cfg = build_nlvr2_model(cfg.init, cfg.encoding)
    if model_cfg.visual_dim != store.feature_dim:
        raise VlbertsError(
            f"store features are {store.feature_dim}-d but the model expects {model_cfg.visual_dim}-d", path=cfg.features
        )
    features, mismatch = check_features(store, cfg.init, dist)
    data = nlvr2_data(model, train, train_images, store, tok, max_text_len=cfg.max_text_len, max_regions=cfg.max_regions,
                      float16=float16)

    # Train through the shared loop.
    extra = {"task": "nlvr2", "encoding": model.encoding, "features": features}
    final = finetune_loop(
        cfg, out=out, tokenizer=tok, model=model, model_cfg=model_cfg, data=data, device=device, dist=dist, extra=extra,
        collate=lambda items: collate_nlvr2(items, tok.pad_id),
        loss=lambda b: nlvr2_loss(model(b), b.labels), count=lambda b: b.size,
        label="fine-tune NLVR2", lengths=data.lengths() if cfg.length_group > 1 else None,
    )
    if final is None:
        return None

    # Predict, write the official file, score against the majority baseline.
    metrics: dict[str, Any] = {
        "encoding": model.encoding, "train_examples": len(train),
        "train_labels": {"True": sum(1 for ex in train if ex.label), "False": sum(1 for ex in train if not ex.label)},
        "eval_examples": len(evals), "steps": num_updates(cfg, len(data)), "skipped_records": bad.to_dict(), **mismatch,
    }
    if evals:
        preds = predict_nlvr2(model, tok, evals, eval_images, store, max_regions=cfg.max_regions,
                              max_text_len=cfg.max_text_len, batch_size=cfg.eval_batch_size, device=device,
                              precision=cfg.precision, dist=dist)
        if dist.main:
            write_predictions(out / "predictions.csv", ((ex.identifier, preds[ex.identifier]) for ex in evals))
        if all_labelled(evals, lambda ex: ex.label is not None):
            metrics.update(nlvr2_metrics(preds, evals, train))
    if dist.main:
        write_json(out / "metrics.json", metrics)
    barrier(dist)
    return final


def config_from_args(args: list[str], base: dict | None = None) -> FinetuneNLVR2Config:
    return apply_overrides(from_dict(FinetuneNLVR2Config, base or {}), args)
