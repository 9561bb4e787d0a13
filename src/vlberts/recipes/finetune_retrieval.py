"""Recipe: image-text retrieval (Flickr30K) on any architecture: 4-way fine-tuning, the full ranking
evaluation, and zero-shot retrieval from the pre-trained matching head (SPEC §4; ViLBERT §4).

Fine-tuning (ViLBERT §4): each training caption gives a group of four (caption, image) pairs, the
positive, a random caption of another image, a random image, and a hard negative among the image's K
nearest training images (`data.retrieval`); the model scores each pair (`models.retrieval`), and the loss
is softmax cross-entropy over the group's four scores, the positive being the answer (`four_way_loss`).
Training runs through the shared `finetune_loop` (one example = one group).

Evaluation (formats-and-metrics.md §5): every caption of the evaluation split is scored against every
image of it, a (captions x images) score matrix, ranked in both directions with `tasks.retrieval`
(R@1/5/10, median and mean rank, ties against the model). Flickr30K's test split is 1,000 images x
5,000 captions; `eval_images` keeps the first N images and their captions for a cheaper run.
Under torchrun each rank scores every world-th caption row and the rows are merged (no row twice).

Zero-shot (ViLBERT §4, "zero-shot caption-based image retrieval ... using the pretrained alignment head,
no fine-tuning"): `evaluate_retrieval` with `zero_shot` scores with a pre-trained model's matching head,
turned into the scorer's log-odds of "match" (`models.retrieval`); architectures pre-trained without such
a head (VL-BERT, W-VisualBERT) cannot be evaluated zero-shot.

    vlberts finetune retrieval --init=runs/pt/model --features=F.h5 --split_file=WORLD/dataset_world.json
        --out=runs/retrieval
    vlberts evaluate retrieval --init=runs/pt/model --zero_shot --features=F.h5
        --split_file=WORLD/dataset_world.json --out=runs/retrieval_zs
    vlberts evaluate retrieval --scores=runs/retrieval/scores.npy --out=runs/rescored

    RUN/model/             the fine-tuned model (config.json: task "retrieval", head, hard-negative K)
    RUN/scores.npy         (C, I) float32 score matrix of the evaluation split
    RUN/score_index.json   its rows' caption ids and image ids, its columns' image ids
    RUN/metrics.json       both directions' R@1/5/10, medr, meanr, rsum; the chance baseline; counts;
                           skipped_records
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vlberts.config import apply_overrides, from_dict
from vlberts.data.regions import RegionSource
from vlberts.data.retrieval import (
    GROUP, PairEncoder, RetrievalBatch, RetrievalGroups, RetrievalSplit, collate_groups, collate_pairs,
    image_embeddings, nearest_neighbours, read_retrieval_split,
)
from vlberts.data.vqa_dataset import model_tag_subwords
from vlberts.errors import BadRecords, VlbertsError, first_line
from vlberts.features.store import RegionStore
from vlberts.io import atomic_open, read_json, require_file, require_unique, write_json
from vlberts.models.encoders import load_encoder_weights
from vlberts.models.retrieval import NO_MATCH_HEAD, RetrievalModel, four_way_loss, match_head_weights
from vlberts.models.weights import read_state_dict
from vlberts.recipes.common import (autocast, fit_text_len, opt, progress, resolve_device, seed_everything, start_recipe,
                                    write_run_config)
from vlberts.recipes.finetune_loop import check_features, open_features, finetune_loop, FinetuneConfig, load_task_weights, num_updates, read_task_model, start_finetune
from vlberts.tasks.retrieval import RECALL_AT, caption_image_index, score_retrieval
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import read_model_config
from vlberts.training.distributed import DistInfo, barrier, check_ranks_agree, init_distributed, local_device, merge_over_ranks


@dataclass(frozen=True)
class FinetuneRetrievalConfig(FinetuneConfig):
    split_file: str = opt("", "Karpathy split json (Flickr30K's dataset_flickr30k.json; the world's dataset_world.json)")
    train_split: str = opt("train", "split to train on (restval joins train)")
    eval_split: str = opt("test", "split to rank after training ('' for none)")
    eval_images: int = opt(0, "rank only the first N images of the eval split and their captions (0: all)")
    out: str = opt("runs/retrieval", "run directory")
    epochs: float = opt(4.0, "passes over the training captions (one 4-way group each)")
    batch_size: int = opt(16, "4-way groups per micro-batch (4 pairs each)")
    hard_negatives: int = opt(10, "K: the hard negative is drawn from the image's K nearest training images "
                                  "(ViLBERT: 100 of ~29k; 10 suits the world's 800)")
    max_text_len: int = opt(32, "caption tokens incl. the layout's special tokens")
    max_regions: int = opt(36, "regions per image")
    eval_batch_size: int = opt(256, "pairs per scoring batch")
    skip_bad: bool = opt(False, "drop malformed split-file records and images missing from the store, counting "
                                "them (a warning and metrics.json's skipped_records), instead of stopping")


CONFIG_CLASS = FinetuneRetrievalConfig


@dataclass(frozen=True)
class EvaluateRetrievalConfig:
    """`vlberts evaluate retrieval`: rank an evaluation split with a model, or re-score a saved matrix."""

    init: str = ""  # a fine-tuned retrieval model directory, or with zero_shot a pre-training one
    zero_shot: bool = False  # score with the pre-trained matching head, no fine-tuning
    scores: str = ""  # instead of a model: a saved scores.npy (with its score_index.json beside it)
    features: str = ""
    split_file: str = ""
    eval_split: str = "test"
    eval_images: int = 0
    out: str = "runs/retrieval_eval"
    max_text_len: int = 32
    max_regions: int = 36
    eval_batch_size: int = 256
    device: str = "auto"
    precision: str = "auto"
    skip_bad: bool = False


# --------------------------------------------------------------------------- models

def pretrained_retrieval_model(init: str | Path) -> tuple[RetrievalModel, Any, str]:
    """A retrieval model whose encoder comes from a pre-training model directory and whose scorer starts
    as that checkpoint's matching head ("match_head"), or new when it has none ("new")."""
    model_cfg, meta = read_model_config(init)
    if meta.get("task") is not None:
        raise VlbertsError(f"a fine-tuned {meta['task']} model, not a pre-training one", path=Path(init) / "config.json")
    model = RetrievalModel(model_cfg)
    load_encoder_weights(model.encoder, init)
    head = match_head_weights(read_state_dict(init), model.arch)
    if head is not None:
        model.init_from_match_head(*head)
    return model, model_cfg, "match_head" if head is not None else "new"


def load_retrieval_model(directory: str | Path) -> RetrievalModel:
    """A model directory written by `finetune_retrieval` (any architecture)."""
    model_cfg, _ = read_task_model(directory, "retrieval", "retrieval", "; for a pre-training model pass --zero_shot")
    return load_task_weights(lambda: RetrievalModel(model_cfg), directory)


def pair_encoder(model: RetrievalModel, texts: list[str], regions: RegionSource, tok: TextTokenizer, *,
                 max_text_len: int, max_regions: int, cache: bool = False, float16: bool = False) -> PairEncoder:
    """Pairs laid out for `model` (its caption layout; W-VisualBERT's detector tags from the store); float16
    features kept so with `float16` (`open_features`)."""
    tags = model_tag_subwords(model.reads_tags, regions, tok)
    return PairEncoder(texts, regions, tok, text_format=model.text_format, max_text_len=max_text_len,
                       max_regions=max_regions, feature_dim=model.cfg.visual_dim, tag_subwords=tags, cache=cache,
                       float16=float16)


# --------------------------------------------------------------------------- evaluation

@torch.no_grad()
def score_matrix(
    scorer: Callable[[RetrievalBatch], Tensor], split: RetrievalSplit, encoder: PairEncoder, *,
    batch_size: int = 256, device: torch.device | str = "cpu", precision: str = "fp32", dist: DistInfo = DistInfo(),
) -> np.ndarray:
    """(C, I) float32 scores of every caption of `split` (rows, in order) against every image (columns),
    on every rank. `encoder` lays out the split's captions in order. Distributed, each rank scores the rows
    rank, rank + world, ... and the rows are merged: every cell is scored exactly once."""
    dev = torch.device(device) if isinstance(device, str) else device
    images = split.image_ids
    mine = range(dist.rank, len(split.captions), dist.world)
    # Cells row-major over this rank's rows, by index (a list of every (caption, image) pair would hold
    # 125M tuples for COCO's 5k test images before the first forward pass).
    n_cells = len(mine) * len(images)
    flat = np.empty(n_cells, dtype=np.float32)
    with progress(disable=None if dist.main else True) as bar:  # rank 0's share stands for all
        task = bar.add_task("score pairs", total=n_cells, info="")
        for start in range(0, n_cells, batch_size):
            stop = min(start + batch_size, n_cells)
            pairs = [encoder.pair(mine[k // len(images)], images[k % len(images)]) for k in range(start, stop)]
            batch = collate_pairs(pairs, encoder.pad_id).to(dev)
            with autocast(dev, precision):
                flat[start:stop] = scorer(batch).float().cpu().numpy()
            bar.advance(task, stop - start)
    rows = flat.reshape(len(mine), len(images))  # (C / world, I)
    merged = merge_over_ranks({c: rows[k] for k, c in enumerate(mine)}, dist)
    return np.stack([merged[c] for c in range(len(split.captions))]) if split.captions else np.zeros((0, len(images)), np.float32)


def chance_recalls(caption_image: np.ndarray, num_images: int) -> dict:
    """Expected R@K (percent) of a uniformly random ranking, both directions: text->image K / I (one gold
    image among I); image->text P(one of the image's g gold captions among the top K of C), averaged over
    images, = 1 - C(C-g, K) / C(C, K) (K / C when g = 1)."""
    C = len(caption_image)
    gold = np.bincount(caption_image, minlength=num_images)  # (I,) captions per image

    def p_hit(g: int, n: int, k: int) -> float:  # at least one of g gold among the top k of n
        k = min(k, n)
        miss = 1.0
        for j in range(k):  # P(the top k are all wrong), drawn without replacement
            miss *= max(n - g - j, 0) / (n - j)
        return 1.0 - miss

    return {
        "text_to_image": {f"r{k}": 100.0 * min(k, num_images) / num_images for k in RECALL_AT},
        "image_to_text": {f"r{k}": 100.0 * float(np.mean([p_hit(int(g), C, k) for g in gold])) for k in RECALL_AT},
    }


def retrieval_metrics(scores: np.ndarray, caption_image: np.ndarray) -> dict:
    """Both directions' R@1/5/10, medr, meanr, rsum, the chance baseline, and the counts."""
    result = score_retrieval(scores, caption_image)
    chance = chance_recalls(caption_image, scores.shape[1])
    chance["rsum"] = sum(v for d in chance.values() for v in d.values())
    return {**result.to_dict(), "chance": chance, "num_captions": int(scores.shape[0]),
            "num_images": int(scores.shape[1]), "summary": result.summary()}


def save_scores(out: Path, scores: np.ndarray, split: RetrievalSplit) -> None:
    """RUN/scores.npy (atomic) and RUN/score_index.json (what its rows and columns are)."""
    with atomic_open(out / "scores.npy", "wb") as f:
        np.save(f, scores.astype(np.float32))
    write_json(out / "score_index.json", {
        "caption_ids": [c.caption_id for c in split.captions],
        "caption_image_ids": [c.image_id for c in split.captions],
        "image_ids": list(split.image_ids),
    }, indent=None)


def rank_split(
    model: RetrievalModel, tok: TextTokenizer, split: RetrievalSplit, regions: RegionSource, *, max_text_len: int,
    max_regions: int, batch_size: int, device: torch.device, precision: str, dist: DistInfo,
) -> tuple[np.ndarray, float]:
    """The model's (C, I) score matrix of `split` and the seconds it took."""
    model.to(device).eval()
    encoder = pair_encoder(model, [c.text for c in split.captions], regions, tok, max_text_len=max_text_len,
                           max_regions=max_regions, cache=True)
    t0 = time.perf_counter()
    scores = score_matrix(lambda b: model(b.inputs, b.tags), split, encoder, batch_size=batch_size, device=device,
                          precision=precision, dist=dist)
    return scores, time.perf_counter() - t0


def _eval_split(path: str, split_name: str, eval_images: int, store: RegionStore, features: str,
                bad: BadRecords) -> RetrievalSplit:
    split = read_retrieval_split(path, split_name, store, bad, store_path=features).first_images(eval_images)
    if not split.captions:
        raise VlbertsError(f"no captions in split {split_name!r} (with their images in the store)", path=path)
    return split


# --------------------------------------------------------------------------- fine-tuning

def finetune_retrieval(cfg: FinetuneRetrievalConfig) -> Path | None:
    """Fine-tune 4-way on the training split, then rank the evaluation split; returns the model directory
    (None when stopped early by `stop_after`). Distributed under torchrun (`finetune_loop`, `score_matrix`)."""
    cfg, out, device, dist = start_finetune(cfg, "retrieval", ("init", "split_file", "features"))
    if cfg.hard_negatives < 1:
        raise VlbertsError(f"--hard_negatives must be at least 1, got {cfg.hard_negatives}")

    bad = BadRecords(skip=cfg.skip_bad)
    store, float16 = open_features(cfg, device)
    train = read_retrieval_split(cfg.split_file, cfg.train_split, store, bad, store_path=cfg.features)
    evaluation = _eval_split(cfg.split_file, cfg.eval_split, cfg.eval_images, store, cfg.features, bad) \
        if cfg.eval_split else None
    if bad.total and dist.main:  # what --skip_bad dropped, before any error it led to
        print(bad.warning(), file=sys.stderr)
    if len(train.image_ids) < 2:
        raise VlbertsError(f"split {cfg.train_split!r} has {len(train.image_ids)} images with features; 4-way "
                           "training needs at least 2", path=cfg.split_file)

    tok = TextTokenizer.load(cfg.init)
    seed_everything(cfg.seed)
    model, model_cfg, head_init = pretrained_retrieval_model(cfg.init)
    if model_cfg.visual_dim != store.feature_dim:
        raise VlbertsError(
            f"store features are {store.feature_dim}-d but the model expects {model_cfg.visual_dim}-d", path=cfg.features
        )
    features, mismatch = check_features(store, cfg.init, dist)
    # ViLBERT §4: hard negatives among the nearest neighbours of the target image (data.retrieval).
    neighbours = nearest_neighbours(image_embeddings(store, train.image_ids, cfg.max_regions), cfg.hard_negatives)
    encoder = pair_encoder(model, [c.text for c in train.captions], store, tok, max_text_len=cfg.max_text_len,
                           max_regions=cfg.max_regions, float16=float16)
    data = RetrievalGroups(train, encoder, neighbours, cfg.seed)
    extra = {"task": "retrieval", "head": "linear_on_pooled", "head_init": head_init,
             "text_format": model.text_format, "hard_negatives": int(neighbours.shape[1]), "features": features}
    final = finetune_loop(
        cfg, out=out, tokenizer=tok, model=model, model_cfg=model_cfg, data=data, device=device, dist=dist, extra=extra,
        collate=lambda groups: collate_groups(groups, tok.pad_id),
        loss=lambda b: four_way_loss(model(b.inputs, b.tags)),  # softmax CE over each group's 4 scores
        count=lambda b: b.num_pairs // GROUP,  # the loss is a mean over groups
        label="fine-tune retrieval", head_prefixes=model.head_prefixes,
        lengths=data.lengths() if cfg.length_group > 1 else None,
    )
    if final is None:
        return None
    metrics: dict = {"mode": "fine-tuned", "arch": model.arch, "head_init": head_init,
                     "train_captions": len(train.captions), "train_images": len(train.image_ids),
                     "hard_negatives": int(neighbours.shape[1]), "steps": num_updates(cfg, len(data)),
                     "skipped_records": bad.to_dict(), **mismatch}
    if evaluation is not None:
        scores, seconds = rank_split(model, tok, evaluation, store, max_text_len=cfg.max_text_len,
                                     max_regions=cfg.max_regions, batch_size=cfg.eval_batch_size, device=device,
                                     precision=cfg.precision, dist=dist)
        metrics.update(retrieval_metrics(scores, evaluation.caption_image()))
        metrics.update(eval_split=cfg.eval_split, eval_seconds=round(seconds, 2))
        if dist.main:
            save_scores(out, scores, evaluation)
    if dist.main:
        write_json(out / "metrics.json", metrics)
    barrier(dist)
    return final


# --------------------------------------------------------------------------- evaluate (zero-shot, fine-tuned, saved)

def check_caption_ids(index: dict, path: Path) -> None:
    """The score index's caption_ids (optional): one per row, each once (one sentid per caption)."""
    ids = index.get("caption_ids")
    if ids is None:
        return
    if not isinstance(ids, list) or len(ids) != len(index["caption_image_ids"]):
        raise VlbertsError("caption_ids must be a list with one id per caption_image_ids entry", path=path)
    first: dict = {}  # caption id -> where it first appears
    for k, cid in enumerate(ids):
        if isinstance(cid, (list, dict)):
            raise VlbertsError(f"caption id must be an integer or a string, got {type(cid).__name__}", path=path,
                               record=f"caption_ids[{k}]")
        require_unique(first, cid, f"caption_ids[{k}]", what="caption id", path=path)


def rescore(scores_path: str | Path) -> dict:
    """Metrics of a saved score matrix, its rows and columns read from the score_index.json beside it."""
    path = require_file(scores_path)
    try:
        scores = np.load(path, allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:  # EOFError: an empty or cut-short file (click would say "Aborted!")
        raise VlbertsError(f"not a .npy score matrix ({first_line(e)})", path=path) from None
    if not isinstance(scores, np.ndarray):  # an .npz archive under a .npy name
        scores.close()
        raise VlbertsError("not a .npy score matrix (an .npz archive)", path=path)
    if scores.dtype.kind not in "fiu":  # strings, bools, complex or structured records are not scores
        raise VlbertsError(f"not a .npy score matrix (dtype {scores.dtype}, expected real numbers)", path=path)
    index_path = path.parent / "score_index.json"
    index = read_json(index_path)
    if not isinstance(index, dict) or not {"caption_image_ids", "image_ids"} <= set(index):
        raise VlbertsError("needs caption_image_ids and image_ids", path=index_path)
    check_caption_ids(index, index_path)
    shape = (len(index["caption_image_ids"]), len(index["image_ids"]))
    if scores.ndim != 2 or scores.shape != shape:
        raise VlbertsError(f"score matrix has shape {scores.shape}, its score_index.json says {shape} "
                           "(captions, images)", path=path)
    if not np.isfinite(scores).all():
        raise VlbertsError("score matrix holds NaN or infinite values", path=path)
    try:
        caption_image = caption_image_index(index["caption_image_ids"], index["image_ids"])
    except ValueError as e:
        raise VlbertsError(str(e), path=path.parent / "score_index.json") from None
    return retrieval_metrics(scores, caption_image)


def evaluate_retrieval(cfg: EvaluateRetrievalConfig) -> dict:
    """Rank the evaluation split with a fine-tuned model, or (`zero_shot`) a pre-training model's matching
    head, or re-score a saved matrix; writes OUT/metrics.json (and the matrix when scoring) and returns the
    metrics."""
    cfg = start_recipe(cfg)
    out = Path(cfg.out)
    if cfg.scores:
        if cfg.init:
            raise VlbertsError("give either --scores (re-score a saved matrix) or --init (score with a model)")
        metrics = {"mode": "rescored", "scores": str(cfg.scores), **rescore(cfg.scores)}
        write_run_config(out, cfg)  # once the matrix is scored: a refused one leaves no OUT behind
        write_json(out / "metrics.json", metrics)
        return metrics
    for key in ("init", "split_file", "features"):
        if not getattr(cfg, key):
            raise VlbertsError(f"evaluate retrieval needs --{key} (or --scores)")
    cfg = fit_text_len(cfg, read_model_config(cfg.init)[0], cfg.init)  # before the split and the store are read
    device = resolve_device(cfg.device)
    dist = init_distributed(device.type)
    check_ranks_agree(dist, cfg, None)  # the same command and data on every machine (only rank 0 writes OUT)
    device = local_device(device, dist)
    bad = BadRecords(skip=cfg.skip_bad)
    store = RegionStore(cfg.features)
    split = _eval_split(cfg.split_file, cfg.eval_split, cfg.eval_images, store, cfg.features, bad)
    if bad.total and dist.main:
        print(bad.warning(), file=sys.stderr)
    if cfg.zero_shot:
        model, model_cfg, head_init = pretrained_retrieval_model(cfg.init)
        if head_init != "match_head":
            why = NO_MATCH_HEAD.get(model.arch, "the checkpoint has no matching head")
            raise VlbertsError(f"no pre-trained matching head to score zero-shot with: {why}; fine-tune instead "
                               "(vlberts finetune retrieval)", path=cfg.init)
    else:
        model = load_retrieval_model(cfg.init)
    if model.cfg.visual_dim != store.feature_dim:
        raise VlbertsError(f"store features are {store.feature_dim}-d but the model expects "
                           f"{model.cfg.visual_dim}-d", path=cfg.features)
    tok = TextTokenizer.load(cfg.init)
    if dist.main:
        write_run_config(out, cfg)
    scores, seconds = rank_split(model, tok, split, store, max_text_len=cfg.max_text_len, max_regions=cfg.max_regions,
                                 batch_size=cfg.eval_batch_size, device=device, precision=cfg.precision, dist=dist)
    metrics = {"mode": "zero-shot" if cfg.zero_shot else "fine-tuned", "arch": model.arch, "init": str(cfg.init),
               **retrieval_metrics(scores, split.caption_image()), "eval_split": cfg.eval_split,
               "eval_seconds": round(seconds, 2), "skipped_records": bad.to_dict()}
    if dist.main:
        save_scores(out, scores, split)
        write_json(out / "metrics.json", metrics)
    barrier(dist)
    return metrics


def config_from_args(args: list[str], base: dict | None = None) -> FinetuneRetrievalConfig:
    return apply_overrides(from_dict(FinetuneRetrievalConfig, base or {}), args)
