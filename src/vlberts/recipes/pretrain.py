"""Recipe: pre-train any architecture on image captions with its paper's objectives (SPEC §3, §6).

Reads a COCO-format captions file and a region-feature store. VisualBERT (App. A.3) runs
  task-agnostic pre-training  (pairs=true):  MLM with the image + sentence-image prediction, or
  task-specific pre-training  (pairs=false): MLM with the image on single captions;
ViLBERT, VL-BERT, LXMERT and W-VisualBERT run their papers' objectives (`objectives/recipe.py` lists them:
masked-region modelling with the detector's targets, image-text matching on mismatched captions, tag MLM,
W-VisualBERT's unpaired text-only / image-only batches). `--objectives=mlm=1,match=0.5` picks and weighs
them; every loss is logged as `<name>_loss`. `--text_corpus` mixes text-only documents in (VL-BERT §3.3; W-VisualBERT's
text-only batches, with `nsp`), `--unpaired_images` adds H-VisualBERT's image-only samples (recipes/pretrain_mix.py). Training uses AdamW, linear warm-up/decay, gradient accumulation and clipping. Every `ckpt_every` updates it
writes an atomic checkpoint (model, optimizer, scheduler, RNG, data position); started again on the
same run directory it resumes from the newest one and reproduces the uninterrupted run exactly.

    RUN/run_config.json   the resolved config
    RUN/metrics.jsonl     one record per logged step
    RUN/checkpoints/      training checkpoints (`latest` names the newest)
    RUN/model/            the final model directory (weights, config, vocabulary)
    RUN/bert_init.json    with --bert_init: which tensors came from the BERT checkpoint, which stayed random

End-to-end VL-BERT (`--model=vlbert-e2e-tiny`, or any config with end_to_end): the model's CNN reads the
images (`--images=DIR`, `--image_pattern`, `--pixel_size`; data/pixels.py) and its appearance features
replace the store's; the store still gives the boxes, and the detector's cls_prob as the masked RoI
classification targets. The model zeroes the pixels of the masked RoIs itself (§3.3 Task #2).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch

from vlberts.config import apply_overrides, from_dict
from vlberts.data.batch import PretrainBatch
from vlberts.data.coco import CaptionRef
from vlberts.data.task_texts import task_caption_refs
from vlberts.data.pretrain import LABEL_FIELDS, MISMATCH_REPLACE, CaptionPretrainData, FixedShapes, ImageOnlyData, RegionSetup, collate_pretrain, unpaired_view
from vlberts.data.pixels import DEFAULT_PATTERN, DEFAULT_SIZE, PixelLoader
from vlberts.data.lxmert_corpus import counted_answer_table, qa_target
from vlberts.data.pretrain_qa import PretrainQA, read_pretrain_qa
from vlberts.data.pretrain_stream import (
    QuestionRef,
    ShardCorpus,
    StreamPosition,
    WorkerPositions,
    image_only_corpus,
    stream_batches,
    stream_documents,
    stream_examples,
    text_shards,
    worker_batches,
)
from vlberts.data.shards import ShardStream, document_sentences
from vlberts.data.text_corpus import TextOnlyData, read_documents
from vlberts.data.vcr_dataset import JOIN as VCR_JOIN
from vlberts.data.sampling import Position, update_seed
from vlberts.errors import VlbertsError
from vlberts.models.blocks import DEFAULT_ATTENTION_KERNEL, AttentionKernel, use_attention_kernel
from vlberts.features.identity import feature_identity, warn_feature_mismatch
from vlberts.features.record import labels_misfit
from vlberts.features.store import RegionStore
from vlberts.io import read_json_object, write_json
from vlberts.models.bert_init import init_text_from_bert
from vlberts.models.builders import arch_of, build_pretraining_model, model_config
from vlberts.objectives.recipe import (
    OBJECTIVES,
    RECIPES,
    ArchRecipe,
    applies,
    loss_counts,
    parse_objectives,
    pretrain_losses,
    run_model,
    total_loss,
)
from vlberts.objectives.matching import qa_active, qa_from_step
from vlberts.objectives.text import unpaired_schedule
from vlberts.recipes.common import ATTENTION_KERNEL_HELP, BIAS_CORRECTION_HELP, CLIP_PER_TENSOR_HELP, COMPILE_HELP, COMPILE_MODE_HELP, DECAY_ALL_HELP, FLOAT16_BATCHES_HELP, FSDP_HELP, OPTIMIZER_HELP, PRECISION_HELP, PREFETCH_HELP, TENSORBOARD_HELP, WARMUP_HELP, CompileMode, autocast, compile_model, fit_text_len, float16_batches, opt, own_gradients, progress, replays_cuda_graphs, require_compiler, resolve_device, seed_everything, start_recipe
from vlberts.recipes.pretrain_mix import (
    IMAGE_SEED,
    TEXT_SEED,
    StreamedPositions,
    StreamedSources,
    batch_split,
    build_sources,
    check_sources,
    check_streamed_sources,
    draw,
    mix_weights,
    reads_corpus,
    stream_seed,
    streamed_batch_sizes,
    withhold_captions,
)
from vlberts.tasks.vqa import SoftTarget, read_answer_vocab
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import (
    TrainState,
    latest_checkpoint,
    load_pretraining_model,
    read_model_config,
    save_checkpoint,
    save_model_dir,
)
from vlberts.training.distributed import (
    DistInfo,
    GradientSync,
    barrier,
    broadcast_parameters,
    check_ranks_agree,
    init_distributed,
    is_sharded,
    local_device,
    merge_over_ranks,
    shard_model,
    sum_over_ranks,
)
from vlberts.training.loop import (batches, feed, loss_scaler, loss_shares, require_finite, scaler_state, to_device,
                                   start_or_resume, update)
from vlberts.training.metrics import MetricsLog
from vlberts.training.optim import build_optimizer, check_optimizer, linear_warmup_decay, warmup_steps


@dataclass(frozen=True)
class PretrainConfig:
    captions: str = opt("", "COCO-format captions json (official or Karpathy) to pre-train on (or a file of "
                            "--captions_format); several: comma-separated, one after the other")
    features: str = opt("", "region-feature store (HDF5) holding every image of the captions")
    shards: str = opt("", "instead of --captions and --features: a shard index json (`python -m vlberts.data.shards`) "
                      "to stream captioned images from, each rank its own endless stream (data/pretrain_stream.py)")
    chunk_images: int = opt(1000, "with --shards: images per in-memory chunk (the matching objective's negatives "
                            "come from the same chunk)")
    shuffle_buffer: int = opt(1000, "with --shards: samples held by each rank's shuffle buffer")
    chunk_documents: int = opt(1000, "with --shards and a streamed --text_corpus: documents per in-memory chunk "
                               "(next-sentence prediction's other document comes from the same chunk)")
    out: str = opt("runs/pretrain", "run directory")
    split: str = opt("train", "Karpathy split to use when `captions` is a Karpathy json (train, which holds its "
                     "restval images too, val, test, or restval alone); an official COCO file is one split already")
    captions_format: str = opt("coco", "what --captions holds: coco (COCO captions or a Karpathy split), or a "
                                       "task's own texts for VisualBERT's task-specific pre-training: vqa, gqa "
                                       "(questions), nlvr2 (statements, each with each of its images), vcr "
                                       "(labelled jsonl: question + right answer, and + right rationale; "
                                       "data/task_texts.py), or lxmert (LXMERT's pre-training corpus json, several "
                                       "comma-separated: every caption and question)")
    image_map: str = opt("", "with --captions_format=nlvr2: JSON {NLVR2 image name: store image id} (the world's "
                             "nlvr2/images.json); without it the names are the store's keys")
    tokenizer: str = opt("", "directory with a BERT vocab.txt; empty: train a WordPiece vocabulary on the captions")
    vocab_size: int = opt(1000, "size of the WordPiece vocabulary when one is trained")
    model: str = opt("visualbert-small", "named model configuration (see `vlberts models`)")
    init: str = opt("", "start from this vlberts model directory (e.g. a task-agnostic run's RUN/model)")
    bert_init: str = opt(
        "",
        "initialise the text side from this Hugging Face BERT directory (config.json + model.safetensors or "
        "pytorch_model.bin); the vocabulary is then the checkpoint's vocab.txt (its own, or --tokenizer=DIR "
        "holding the same one); writes RUN/bert_init.json listing what was copied and what stayed random",
    )
    bert_lr_mult: float = opt(
        1.0,
        "with --bert_init: the tensors copied from BERT (RUN/bert_init.json's `initialised`) learn at this times "
        "the rate, the rest at the rate (vilbert-multi-task's train_concap.py from BERT: 0.1)",
    )
    pairs: bool = opt(True, "VisualBERT: two captions + sentence-image prediction; false: one caption, MLM only")
    objectives: str = opt(
        "",
        "objectives and weights, e.g. mlm=1,match=1,region_kl=1; empty: the architecture's paper recipe "
        f"(objectives: {', '.join(OBJECTIVES)})",
    )
    steps: int = opt(1000, "optimizer updates (0: write the untrained network, the no-pre-training control)")
    batch_size: int = opt(64, "examples per micro-batch")
    grad_accum: int = opt(1, "micro-batches per update")
    lr: float = opt(1e-4, "peak learning rate")
    warmup: float = opt(0.1, WARMUP_HELP)
    weight_decay: float = opt(0.01, "AdamW weight decay (not on biases and LayerNorm unless --decay_all)")
    clip: float = opt(1.0, "gradient-norm clipping; 0 disables")
    clip_per_tensor: bool = opt(False, CLIP_PER_TENSOR_HELP)
    bias_correction: bool = opt(True, BIAS_CORRECTION_HELP)
    decay_all: bool = opt(False, DECAY_ALL_HELP)
    optimizer: Literal["adamw", "sgd"] = opt("adamw", OPTIMIZER_HELP)
    momentum: float = opt(0.9, "SGD momentum (--optimizer=sgd)")
    max_text_len: int = opt(48, "tokens per example, [CLS]/[SEP] included")
    max_regions: int = opt(36, "regions per image (the store's first ones)")
    mlm_prob: float = opt(0.15, "MLM selection probability")
    mlm_word_probs: tuple[str, ...] = opt(
        (), "word=prob entries: these words (each one subword) are selected for MLM with their own probability "
        "instead of mlm_prob (comma list, e.g. red=0.3,circle=0.7; default none; README, \"The demo's world and masking, and why\")"
    )
    match_weight: float = opt(1.0, "weight of the matching loss in the paper recipe (when --objectives is empty)")
    roi_target: str = opt(ArchRecipe.roi_target, "VL-BERT masked RoI classification target: soft (the detector's score vector, as "
                          "the released code) or hard (its argmax class, as the paper's text; README, \"Every "
                          "architecture's full demo\")")
    mismatch_prob: float = opt(0.5, "single-caption matching: probability that the caption is another image's")
    mismatch_replace: str = opt("caption", "single-caption matching: what a negative replaces: caption (the released "
                                "ViLBERT and LXMERT code), image (the caption with another image's regions), or "
                                "either, half the time each (ViLBERT §3.1's text)")
    mismatched_targets: str = opt("auto", "with matching: are the masked words (and masked regions) of a text that is "
                                  "not the image's still targets? keep (LXMERT's and VisualBERT's released code), drop "
                                  "(ViLBERT's --objective 1), auto: the architecture's released code (docs/pretraining.md, \"Masked "
                                  "words of a mismatched caption\")")
    qa_vqa_questions: str = opt("", "LXMERT image-QA pre-training: VQA v2 questions json whose questions join the "
                                "sentences, answers as QA labels (needs --qa_vqa_annotations), or a Pythia imdb .npy or LXMERT's "
                                "question list (hold both)")
    qa_vqa_annotations: str = opt("", "LXMERT image-QA pre-training: the VQA v2 annotations json of --qa_vqa_questions")
    qa_gqa_questions: str = opt("", "LXMERT image-QA pre-training: GQA balanced questions json (with answers)")
    qa_lxmert: bool = opt(False, "LXMERT image-QA pre-training from LXMERT's own corpus (--captions_format=lxmert, or "
                          "--shards written from it): its VQA, GQA and Visual7W questions carry their answers (labelf) "
                          "as QA labels")
    qa_min_answer_count: int = opt(1, "joint answer table: answers given by at least this many questions")
    qa_answers: str = opt("", "the joint answer table from a file instead of counted from the questions: LXMERT's "
                          "released all_ans.json (9,500 answers, its QA head's rows in order) or any table --answer_vocab "
                          "reads; answers outside it are dropped from the labels")
    qa_answer_sets: str = opt("", "with an all_ans.json --qa_answers: keep the answers of these data sets only (e.g. "
                              "vqa,gqa; LXMERT's --qaSets); default: every answer, as LXMERT's pre-training")
    qa_last_fraction: float = opt(0.5, "the image-QA loss trains in this last fraction of the updates "
                                  "(LXMERT §3.3: the last 10 of 20 epochs)")
    text_corpus: str = opt("", "text-only documents (BERT's format: one sentence per line, a blank line between "
                           "documents; the world's text/documents.txt) mixed into pre-training as <Text, ∅> samples "
                           "trained with MLM only (VL-BERT §3.3); W-VisualBERT draws its text-only batches from "
                           "them; single-stream models only (recipes/pretrain_mix.py). With --shards: the index json "
                           "of text-only shards (python -m vlberts.data.shards --documents FILE), streamed")
    text_ratio: float = opt(0.5, "with --text_corpus: share of text-only samples in every batch (VL-BERT §3.3: 1:1); "
                            "W-VisualBERT: share of text-only updates")
    corpus_share: float = opt(0.5, "W-VisualBERT with --text_corpus: share of its text-only updates drawn from the "
                              "corpus, the others from the captions (§4.2.1: Conceptual Captions' captions and "
                              "BookCorpus; each batch from one of them); 1: the corpus only")
    unpaired_images: str = opt("", "H-VisualBERT: image ids, one per line (the world's unpaired_images.txt), whose "
                               "captions are withheld; they train as image-only samples, image objectives only "
                               "(W-VisualBERT §4.3). With --shards: the index json of shards holding image-only "
                               "samples (python -m vlberts.data.shards --store FILE without --captions), streamed")
    unpaired_ratio: float = opt(0.0, "with --unpaired_images: share of image-only samples in every batch; 0: the "
                                "set's share of all images")
    images: str = opt("", "end-to-end VL-BERT only (end_to_end configs, e.g. vlbert-e2e-tiny): directory of the "
                      "images, read as pixels by the model's CNN (the world's WORLD/images)")
    image_pattern: str = opt(DEFAULT_PATTERN, "with --images: file name of an image id, a Python format string "
                             "with {image_id} (an integer when the id is all digits), e.g. "
                             "'COCO_train2014_{image_id:012d}.jpg' for COCO")
    pixel_size: int = opt(DEFAULT_SIZE, "with --images: images are resized to pixel_size x pixel_size (boxes are "
                          "fractions of the image size, so they stay valid)")
    seed: int = opt(0, "seed of initialisation, data order, masking and negatives")
    log_every: int = opt(10, "updates between metrics records")
    ckpt_every: int = opt(200, "updates between checkpoints")
    device: str = opt("auto", "auto, cpu, cuda, cuda:N")
    precision: str = opt("auto", PRECISION_HELP)
    length_group: int = opt(0, "batch examples of similar length within windows of this many batches (less padding); 0: off")
    num_workers: int = opt(0, "DataLoader worker processes (with --shards: each reads its own stream of the rank's "
                           "shards, so a streamed run resumes with the same number)")
    prefetch: int = opt(-1, PREFETCH_HELP)
    tensorboard: bool = opt(False, TENSORBOARD_HELP)
    preload_features: bool = opt(False, "read the whole region store into memory first (for stores that fit)")
    float16_batches: str = opt("auto", FLOAT16_BATCHES_HELP)
    stop_after: int = opt(0, "stop after this many updates in this invocation, as if interrupted (0: run to the end)")
    fsdp: bool = opt(False, FSDP_HELP)
    compile: bool = opt(False, COMPILE_HELP)
    compile_mode: CompileMode = opt("default", COMPILE_MODE_HELP)
    attention_kernel: tuple[AttentionKernel, ...] = opt(DEFAULT_ATTENTION_KERNEL, ATTENTION_KERNEL_HELP)
    static_shapes: bool = opt(False, "pad every batch to --max_regions regions, and its text length and masked-word "
                              "lists to a few bucket sizes, so that the step keeps a few shapes (what CUDA graphs "
                              "need; no recompiling for new lengths). Same losses up to rounding, except "
                              "the region losses that average over every region slot (LXMERT, W-VisualBERT): "
                              "B x max_regions slots then")


CONFIG_CLASS = PretrainConfig


def _tokenizer(cfg: PretrainConfig, out: Path, texts: list[str], words: list[str] = ()) -> TextTokenizer:
    saved = out / "tokenizer"
    if (saved / "vocab.txt").is_file() and latest_checkpoint(out) is not None:  # resuming: the vocabulary stays
        return TextTokenizer.load(saved)
    # (a tokenizer/ left by a start that stopped before its first checkpoint is made again: that run starts over)
    if cfg.init:
        tok = TextTokenizer.load(cfg.init)
        if cfg.tokenizer and TextTokenizer.load(cfg.tokenizer).tok.get_vocab() != tok.tok.get_vocab():
            raise VlbertsError(f"--tokenizer's vocab.txt differs from the --init model's ({Path(cfg.init) / 'vocab.txt'}), "
                               "whose embedding rows are its words: leave --tokenizer out", path=cfg.tokenizer)
    elif cfg.bert_init:
        tok = bert_tokenizer(cfg)
    elif cfg.tokenizer:
        tok = TextTokenizer.load(cfg.tokenizer)
    else:
        # The words with their own masking probability join the corpus so that a trained vocabulary
        # holds each as one token.
        tok = TextTokenizer.train([*texts, *parse_word_probs(cfg.mlm_word_probs), *words], vocab_size=cfg.vocab_size)
    tok.save(saved)
    return tok


def bert_tokenizer(cfg: PretrainConfig) -> TextTokenizer:
    """The vocabulary of the `bert_init` checkpoint: `tokenizer` if given, else the checkpoint's own
    vocab.txt. Any other vocabulary would hand BERT's embedding rows to the wrong words, so a vocabulary
    that differs from the checkpoint's (its vocab.txt, or the size in its config.json) is an error."""
    bert = Path(cfg.bert_init)
    src = Path(cfg.tokenizer) if cfg.tokenizer else bert
    if not (src / "vocab.txt").is_file():
        where = "--tokenizer has none" if cfg.tokenizer else "the checkpoint directory has none; pass --tokenizer=DIR holding it"
        raise VlbertsError(f"--bert_init needs the checkpoint's vocab.txt: {where}", path=src)
    tok = TextTokenizer.load(src)
    if cfg.tokenizer and (bert / "vocab.txt").is_file():
        if TextTokenizer.load(bert).tok.get_vocab() != tok.tok.get_vocab():
            raise VlbertsError(
                f"--tokenizer's vocab.txt differs from the --bert_init checkpoint's ({bert / 'vocab.txt'})",
                path=src / "vocab.txt",
            )
    if (bert / "config.json").is_file():
        size = read_json_object(bert / "config.json").get("vocab_size")
        if size != tok.vocab_size:
            raise VlbertsError(
                f"vocab.txt has {tok.vocab_size} tokens but the BERT checkpoint's vocabulary has {size} "
                "(config.json vocab_size): use the checkpoint's own vocab.txt", path=src / "vocab.txt"
            )
    return tok


def parse_word_probs(entries: tuple[str, ...]) -> dict[str, float]:
    """`("red=0.3", "circle=0.7")` -> {"red": 0.3, "circle": 0.7}; malformed entries are errors."""
    out = {}
    for e in entries:
        word, sep, value = e.partition("=")
        try:
            prob = float(value)
        except ValueError:
            prob = -1.0
        if not sep or not word or not 0.0 <= prob <= 1.0:
            raise VlbertsError(f"mlm_word_probs: expected word=probability with a probability in [0, 1], got {e!r}")
        out[word] = prob
    return out


def token_probs(tok: TextTokenizer, entries: tuple[str, ...]) -> dict[int, float]:
    """Subword id -> selection probability of the `mlm_word_probs` entries; a word that is not one
    subword of the vocabulary is an error (its pieces would be masked independently)."""
    ids = {}
    for w, prob in parse_word_probs(entries).items():
        sub = tok.encode(w)
        if len(sub) != 1 or sub[0] == tok.unk_id:
            raise VlbertsError(f"mlm_word_probs: {w!r} is not a single token of the vocabulary ({len(sub)} subwords)")
        ids[sub[0]] = prob
    return ids


def store_sizes(store: RegionStore) -> dict[str, int]:
    """Head sizes the store fixes: cls_prob columns, object and attribute vocabularies (those it has)."""
    meta, sizes = store.metadata, {}
    if "cls_prob" in store.fields:
        sizes["cls_prob"] = int(store.info()["num_classes_cls_prob"])
    if meta.classes:
        sizes["classes"] = len(meta.classes)
    if meta.attributes:
        sizes["attributes"] = len(meta.attributes)
    return sizes


VOCAB_CAPTIONS = 50_000  # with --shards and no vocabulary given, one is trained on this many first captions
LOADER_SEED = 0x4C4F4144  # "LOAD": with --shards and --num_workers, worker stream k's seed key is LOADER_SEED + k


def shard_documents(shards: list[Path], limit: int) -> list[list[str]]:
    """The first documents of text-only shards in file order, up to `limit` sentences (to train a vocabulary on)."""
    out: list[list[str]] = []
    for sample in ShardStream(shards, shuffle=False, kinds=("text",), dist=DistInfo()):
        out.append(document_sentences(sample))
        limit -= len(out[-1])
        if limit <= 0:
            break
    return out


def shard_captions(corpus: ShardCorpus, limit: int) -> list[CaptionRef]:
    """The first `limit` captions (and questions) of the shards in file order (to train a vocabulary on)."""
    out: list[CaptionRef] = []
    for sample in ShardStream(corpus.shards, shuffle=False, kinds=("image-text",), dist=DistInfo(), arrays=False):
        out.extend(CaptionRef(sample["image_id"], c) for c in sample["captions"])
        out.extend(CaptionRef(sample["image_id"], q["text"]) for q in sample.get("questions", ()))
        if len(out) >= limit:
            break
    return out[:limit]


def stream_state(pos: StreamPosition | WorkerPositions | StreamedPositions, dist: DistInfo) -> dict[str, Any]:
    """A streamed run's data state: every rank's position in its caption stream ("stream"; its loader
    workers' streams' with --num_workers), and in its text-only and image-only streams ("text_stream",
    "image_stream") when it reads them, in rank order."""
    own = pos.to_dict() if isinstance(pos, StreamedPositions) else {"stream": pos.to_dict()}
    positions = merge_over_ranks({dist.rank: own}, dist)
    return {key: [positions[r][key] for r in range(dist.world)] for key in own}


def stream_start(data: dict[str, Any], dist: DistInfo, out: Path, key: str = "stream",
                 workers: int = 0) -> StreamPosition | WorkerPositions:
    """This rank's position in a resumed streamed run's stream `key` (the start of it in a new run): one
    position, or with `workers` loader workers each one's (`data.pretrain_stream.worker_batches`)."""
    if not data:
        return WorkerPositions.fresh(workers) if workers else StreamPosition()
    positions = data.get(key)
    if positions is None or len(positions) != dist.world:
        have = "a caption-file run" if positions is None else f"{len(positions)} ranks"
        raise VlbertsError(f"the checkpoint is of {have}; a streamed run resumes with the same number of ranks "
                           f"({dist.world} now)", path=out / "checkpoints")
    mine = positions[dist.rank]
    had = int(mine.get("workers", 0))
    if had != workers:  # each loader worker reads its own stream: their number is part of the run
        raise VlbertsError(f"the checkpoint's stream was read by {had} loader worker(s) per rank; a streamed run "
                           f"resumes with the same --num_workers ({workers} now)", path=out / "checkpoints")
    return WorkerPositions.from_dict(mine) if workers else StreamPosition.from_dict(mine)


def end_to_end_pixels(cfg: PretrainConfig, end_to_end: bool, image_ids: list[str]) -> PixelLoader | None:
    """The pixel loader of an end-to-end model (None otherwise); every listed image's file must exist."""
    name = cfg.init or cfg.model
    if not end_to_end:
        if cfg.images:
            raise VlbertsError(f"--images: {name} reads region features from the store, not pixels; only end-to-end "
                               "VL-BERT configurations (e.g. vlbert-e2e-tiny) read images")
        return None
    if not cfg.images:
        raise VlbertsError(f"{name}: end-to-end VL-BERT reads image pixels: pass --images=DIR (the world's "
                           "WORLD/images; --image_pattern names the files, default '{image_id:012d}.png')")
    loader = PixelLoader(cfg.images, cfg.image_pattern, cfg.pixel_size)
    loader.check(image_ids)
    return loader


def image_qa(cfg: PretrainConfig, arch: str, shards: ShardCorpus | None = None,
             lxmert: dict[str, list] | None = None) -> PretrainQA | None:
    """LXMERT's image-QA pre-training data when the run names question files (or `--qa_lxmert`), else None.
    A streamed run (`shards`) reads the questions its shards hold as they stream (`QuestionRef`): here only
    the joint table, from `--qa_answers` or counted from the index's counts, and no sentences. `lxmert`: the
    corpus's sentences by file, where the run has read them already (`read_lxmert_files`)."""
    if not (cfg.qa_vqa_questions or cfg.qa_vqa_annotations or cfg.qa_gqa_questions or cfg.qa_lxmert
            or cfg.qa_answers or cfg.qa_answer_sets):
        return None
    if arch != "lxmert":
        raise VlbertsError(f"image-QA pre-training (--qa_*) is LXMERT's objective (§3.1.3); {arch} has no answer head")
    sets = [s.strip() for s in cfg.qa_answer_sets.split(",") if s.strip()]
    if sets and not cfg.qa_answers:
        raise VlbertsError("--qa_answer_sets picks answers of an all_ans.json --qa_answers; give the file")
    answers = read_answer_vocab(cfg.qa_answers, sets) if cfg.qa_answers else None
    if shards is not None:
        if not cfg.qa_lxmert or cfg.qa_vqa_questions or cfg.qa_vqa_annotations or cfg.qa_gqa_questions:
            raise VlbertsError("with --shards, image QA reads the questions the shards hold (--qa_lxmert); question "
                               "files (--qa_vqa_questions, --qa_gqa_questions) do not stream")
        if not shards.questions:
            raise VlbertsError("--qa_lxmert: these shards hold no questions (write LXMERT's corpus into shards with "
                               "python -m vlberts.data.shards --captions FILES --captions-format lxmert)", path=shards.path)
        if answers is None:
            answers = counted_answer_table(shards.qa_answer_counts, cfg.qa_min_answer_count, shards.path)
        return PretrainQA([], [], answers, ((str(shards.path), shards.questions),))
    if cfg.qa_lxmert:
        if cfg.captions_format != "lxmert" or cfg.qa_vqa_questions or cfg.qa_gqa_questions:
            raise VlbertsError("--qa_lxmert reads the questions of LXMERT's corpus: it needs --captions_format=lxmert "
                               "and no --qa_vqa_questions / --qa_gqa_questions")
        from vlberts.data.lxmert_corpus import lxmert_image_qa, read_lxmert_corpus

        sentences = [s for ss in lxmert.values() for s in ss] if lxmert else read_lxmert_corpus(cfg.captions)
        return lxmert_image_qa(sentences, cfg.captions, cfg.qa_min_answer_count, answers)
    return read_pretrain_qa(cfg.qa_vqa_questions, cfg.qa_vqa_annotations, cfg.qa_gqa_questions,
                            min_count=cfg.qa_min_answer_count, answers=answers)


def setting_default(name: str) -> Any:
    """A `PretrainConfig` setting's default (what a run that does not give it has)."""
    return next(f.default for f in dataclasses.fields(PretrainConfig) if f.name == name)


def caption_files(value: str) -> list[str]:
    """--captions as its files, in order (comma-separated; one file has no comma)."""
    return [p.strip() for p in value.split(",") if p.strip()]


def require_distinct_caption_files(parts: list[tuple[str, list[CaptionRef]]], fmt: str) -> None:
    """Several --captions files are read one after the other: a file given twice, or (COCO captions and Karpathy
    files, one record an image) an image in two of them, would train its captions twice: a one-line error
    naming both files. (A task's texts, questions or statements, share images across files as within one.)"""
    files: set[Path] = set()
    image_file: dict[str, str] = {}  # image id -> the file it came from (COCO and Karpathy files)
    for path, refs in parts:
        if Path(path).resolve() in files:
            raise VlbertsError("named twice in --captions", path=path)
        files.add(Path(path).resolve())
        if fmt != "coco":
            continue
        for image in dict.fromkeys(ref.image_id for ref in refs):
            if image in image_file:
                raise VlbertsError(f"image {image} is also in {image_file[image]}: its captions would be trained on "
                                   "twice (the same images in two files?)", path=path)
            image_file[image] = path


def run_weights(cfg: PretrainConfig, recipe: ArchRecipe, model_cfg, with_qa: bool = False) -> dict[str, float]:
    """The objectives of this run: --objectives, or the paper's (VisualBERT's match only with pairs; LXMERT's
    image QA when the run has questions). `qa` needs questions."""
    if cfg.objectives.strip():
        if not with_qa and "qa" in (item.partition("=")[0].strip() for item in cfg.objectives.split(",")):
            raise VlbertsError("objective qa needs questions: --qa_vqa_questions/--qa_vqa_annotations or --qa_gqa_questions")
        return parse_objectives(cfg.objectives, recipe, model_cfg)
    weights = recipe.defaults(model_cfg)
    if with_qa and "qa" in recipe.available(model_cfg):
        weights["qa"] = 1.0
    if "match" in weights:
        weights["match"] = cfg.match_weight
    if recipe.caption_pairs and not cfg.pairs:
        weights.pop("match", None)  # VisualBERT task-specific pre-training: MLM only
    if recipe.unpaired(model_cfg):
        weights.pop("match", None)
    return weights


# The store fields each objective reads (besides the features, which every store has).
NEEDS: dict[str, tuple[str, ...]] = {
    "region_kl": ("cls_prob",), "roi_cls": ("cls_prob",), "obj": ("obj_id", "obj_conf"),
    "attr": ("attr_id", "attr_conf"), "tag_mlm": ("obj_id",),
}


# Classifier objectives: the class-index field each reads and the store quantity its head is sized by.
LABEL_HEADS: dict[str, tuple[str, str]] = {"obj": ("obj_id", "classes"), "attr": ("attr_id", "attributes")}


def head_label_sizes(recipe: ArchRecipe, model_cfg: Any, weights: dict[str, float]) -> dict[str, int]:
    """obj_id / attr_id -> the number of classes of the model head the run's objectives train on them."""
    field_of = {quantity: name for name, quantity in recipe.head_sizes.items()}
    return {ids: int(getattr(model_cfg, field_of[quantity])) for objective, (ids, quantity) in LABEL_HEADS.items()
            if objective in weights and quantity in field_of}


def check_store_labels(store: RegionStore | ShardCorpus, head_sizes: dict[str, int], reads: set[str]) -> None:
    """The class indices the run reads (`reads`: obj_id, attr_id), against the store's vocabularies and the
    model's heads, before training: one past a head is an IndexError in the loss mid-run. A region store's
    are read whole here (8 bytes a box); a shard set's are checked as each sample is read
    (`shards.check_sample_record`), which this sets up."""
    if isinstance(store, ShardCorpus):
        store.head_sizes = {k: v for k, v in head_sizes.items() if k in reads}
        return
    meta = store.metadata
    vocab = {"obj_id": meta.classes, "attr_id": meta.attributes}
    for ids in ("obj_id", "attr_id"):
        if ids not in reads or ids not in store.fields:
            continue
        misfit = labels_misfit({ids: store.vocabulary_ids(ids)}, head_sizes, holder="model head")  # (B,) ids
        if misfit is not None:
            message, row = misfit  # heads are sized from the store's vocabularies, when it has them
            message += ("; --init's heads are smaller than the store's vocabulary" if vocab[ids] is not None else
                        "; the store names no vocabulary to size the heads from (import it with --classes and "
                        "--attributes)")
            raise VlbertsError(message, path=store.path, record=f"image {store.image_at_row(row)}")


def require_images(sentences: list[CaptionRef], sources: list[tuple[str, int]], store: RegionStore) -> None:
    """Every sentence's image in the store; else a one-line error naming the store, the first missing image
    and the file its sentence came from (`sources`: (file, sentences) in the order of `sentences`)."""
    start = 0
    for path, n in sources:
        missing = [c.image_id for c in sentences[start:start + n] if c.image_id not in store]
        if missing:
            raise VlbertsError(f"image id {missing[0]} of {path} not in store ({len(missing)} sentences of that file "
                               "affected)", path=store.path, record=missing[0])
        start += n


MISMATCHED_TARGETS = ("auto", "keep", "drop")


def check_mismatched_targets(choice: str) -> None:
    """`--mismatched_targets`: one of `MISMATCHED_TARGETS`; anything else is a one-line error."""
    if choice not in MISMATCHED_TARGETS:
        raise VlbertsError(f"--mismatched_targets must be one of {', '.join(MISMATCHED_TARGETS)}, got {choice!r}")


def drop_mismatched(choice: str, recipe: ArchRecipe) -> bool:
    """Whether a mismatched text's masked words (and masked regions) are dropped as targets: `--mismatched_targets`,
    "auto" being the architecture's released code (`ArchRecipe.drop_unmatched`)."""
    return recipe.drop_unmatched if choice == "auto" else choice == "drop"


def region_setup(
    recipe: ArchRecipe, weights: dict[str, float], store: RegionStore, tok: TextTokenizer, with_tags: bool
) -> RegionSetup:
    """What the examples carry on the region side for these objectives (and, `with_tags`, the detector
    tags the model reads); a store without a field an objective needs is a one-line error."""
    needs = {f for name in weights for f in NEEDS.get(name, ())} | ({"obj_id"} if with_tags else set())
    missing = sorted(needs - set(store.fields))
    if missing:
        raise VlbertsError(f"objectives {', '.join(weights)} need the store's {', '.join(missing)}, which it lacks",
                           path=store.path)
    if recipe.region_rule is None or not (with_tags or any(OBJECTIVES[n][1] == "image" for n in weights)):
        return RegionSetup()
    tags = attrs = None
    if with_tags:
        if not store.metadata.classes:
            raise VlbertsError("detector tags need the store's class names (metadata classes)", path=store.path)
        # A tag is its class name's subwords (the released code takes the vocabulary line's first synonym).
        tags = tuple(tuple(tok.encode(c.split(",")[0])) for c in store.metadata.classes)
        if store.metadata.attributes and "attr_id" in store.fields:
            attrs = tuple(tuple(tok.encode(a.split(",")[0])) for a in store.metadata.attributes)
    return RegionSetup(
        rule=recipe.region_rule, zero_in_data=recipe.zero_in_data,
        replace_from_other_image=recipe.replace_from_other_image,
        labels=tuple(k for k in LABEL_FIELDS if k in needs), tag_subwords=tags, attr_subwords=attrs,
        soft_cls_prob="region_kl" in weights or ("roi_cls" in weights and recipe.roi_target == "soft"),
    )


def pretrain(cfg: PretrainConfig) -> Path | None:
    """Run (or resume) pre-training; returns the final model directory, or None if stopped early."""
    cfg = start_recipe(cfg)
    out = Path(cfg.out)
    device = resolve_device(cfg.device)
    require_compiler(cfg.compile, device)
    use_attention_kernel(cfg.attention_kernel)  # a bad setting stops the run here; compiled graphs keep the kernel
    dist = init_distributed(device.type)  # torchrun: one process per rank (training/distributed.py)
    check_ranks_agree(dist, cfg, out)  # the same command, data and OUT on every machine
    device = local_device(device, dist)
    streamed = bool(cfg.shards)
    float16 = float16_batches(cfg.float16_batches, device)
    warmup_steps(cfg.warmup, cfg.steps)  # a bad --warmup stops the run before any data is read
    check_optimizer(cfg.optimizer, cfg.bias_correction, cfg.momentum)  # so does a contradictory optimizer setting
    if streamed and (cfg.captions or cfg.features):
        raise VlbertsError("give either --shards or --captions and --features")
    if not streamed and (not cfg.captions or not cfg.features):
        raise VlbertsError("pretrain needs --captions=FILE and --features=STORE (or --shards=INDEX)")
    check_streamed_sources(cfg, streamed)
    if cfg.init and cfg.bert_init:
        raise VlbertsError("--init and --bert_init both give starting weights; pass one")
    if cfg.bert_lr_mult != 1.0 and not cfg.bert_init:
        raise VlbertsError("--bert_lr_mult sets the rate of the tensors --bert_init copies from BERT; give --bert_init")

    chosen = read_model_config(cfg.init)[0] if cfg.init else model_config(cfg.model)
    arch = arch_of(chosen)
    cfg = fit_text_len(cfg, chosen, cfg.init or None)  # a text beyond the position table: one line, before any data
    default_model = setting_default("model")
    if cfg.init and cfg.model != default_model and arch_of(model_config(cfg.model)) != arch:
        raise VlbertsError(f"--model={cfg.model} is a {arch_of(model_config(cfg.model))} model but --init holds a "
                           f"{arch} model; with --init the model is --init's, so leave --model out", path=cfg.init)
    if cfg.init and cfg.model != default_model:  # the same architecture at another size would be trained silently
        named, sizes = model_config(cfg.model), ("hidden_size", "num_layers", "num_heads", "language_layers",
                                                 "relation_layers", "cross_layers", "t_num_layers", "v_num_layers")
        differ = [f for f in sizes if hasattr(named, f) and getattr(named, f) != getattr(chosen, f, None)]
        if differ:
            there = ", ".join(f"{f} {getattr(chosen, f)}" for f in differ)
            raise VlbertsError(f"--model={cfg.model} is not the model --init holds ({there}, where {cfg.model} has "
                               f"{', '.join(str(getattr(named, f)) for f in differ)}); with --init the model is "
                               "--init's, so leave --model out", path=cfg.init)
    if cfg.roi_target not in ("soft", "hard"):
        raise VlbertsError(f"--roi_target must be soft or hard, got {cfg.roi_target!r}")
    check_mismatched_targets(cfg.mismatched_targets)
    if cfg.mismatch_replace not in MISMATCH_REPLACE:
        raise VlbertsError(f"--mismatch_replace must be one of {', '.join(MISMATCH_REPLACE)}, got {cfg.mismatch_replace!r}")
    recipe = replace(RECIPES[arch], roi_target=cfg.roi_target)
    corpus = ShardCorpus(cfg.shards) if streamed else None
    # LXMERT's corpus gives both the captions and the image-QA questions: read once (9.18M sentences in LXMERT's
    # own run; it was read twice, in every rank).
    lxmert: dict[str, list] = {}
    if cfg.qa_lxmert and not streamed and cfg.captions_format == "lxmert":
        from vlberts.data.lxmert_corpus import read_lxmert_files

        lxmert = dict(read_lxmert_files(cfg.captions))
    qa = image_qa(cfg, arch, corpus, lxmert)
    if corpus is not None:
        if cfg.batch_size % dist.world:
            raise VlbertsError(f"with --shards each of the {dist.world} ranks streams batch_size / ranks examples: "
                               f"--batch_size={cfg.batch_size} must be a multiple of {dist.world}")
        store: RegionStore | ShardCorpus = corpus
        captions = shard_captions(store, VOCAB_CAPTIONS)  # for training a vocabulary only
        # H-VisualBERT's image-only set, streamed from its own shards (their "image" samples).
        image_store = image_only_corpus(cfg.unpaired_images, store) if cfg.unpaired_images else None
    else:
        # VCR's texts are written as this architecture's VCR fine-tuning writes them (its join of names).
        parts = [(path, task_caption_refs(path, cfg.captions_format, split=cfg.split, image_map=cfg.image_map,
                                          join=VCR_JOIN[arch], questions=not cfg.qa_lxmert,  # (QA questions join below)
                                          sentences=lxmert.get(path)))
                 for path in caption_files(cfg.captions)]
        require_distinct_caption_files(parts, cfg.captions_format)
        captions = [c for _, refs in parts for c in refs]
        if not captions:
            raise VlbertsError("no captions to pre-train on" + (f" in split {cfg.split!r}" if cfg.split else ""),
                               path=cfg.captions)
        store = RegionStore(cfg.features, upcast=not float16)
        image_store = None
    # H-VisualBERT: the image-only set's captions are withheld (recipes/pretrain_mix.py).
    captions, image_only = withhold_captions(cfg, captions, store) if not streamed else (captions, [])
    # A streamed text corpus is read chunk by chunk; its first documents train a vocabulary (as the captions').
    streamed_text = text_shards(cfg.text_corpus) if streamed and cfg.text_corpus else []
    documents = read_documents(cfg.text_corpus) if cfg.text_corpus and not streamed else []
    vocab_documents = shard_documents(streamed_text, VOCAB_CAPTIONS) if streamed_text else documents
    qa_targets = None
    # the file each run of sentences comes from, in order (all of --captions as one where some were withheld)
    sources = [(cfg.captions, len(captions))]
    if not streamed and sum(len(refs) for _, refs in parts) == len(captions):
        sources = [(path, len(refs)) for path, refs in parts]
    if qa is not None:  # questions join the sentences; captions carry no QA label
        qa_targets = [SoftTarget((), ())] * len(captions) + qa.targets
        captions = captions + qa.sentences
        sources += qa.sources
    if cfg.preload_features and not streamed:
        store.preload()
    if not streamed:
        require_images(captions, sources, store)
    # Tag words (detector class names) join the corpus so that a trained vocabulary spells them well.
    tag_words = list(store.metadata.classes or []) + list(store.metadata.attributes or []) if "tags" in recipe.model_inputs else []
    if dist.main:  # rank 0 trains (or loads) and saves the vocabulary; the others load the saved one
        tok = _tokenizer(cfg, out, [c.text for c in captions] + [s for d in vocab_documents for s in d], tag_words)
    barrier(dist)
    if not dist.main:
        tok = TextTokenizer.load(out / "tokenizer")
    seed_everything(cfg.seed)
    from_bert: list[str] = []  # the tensors --bert_init copies (--bert_lr_mult's)
    if cfg.init:
        model, model_cfg, meta = load_pretraining_model(cfg.init)
        # a model pre-trained on another extractor's features: one warning line, as fine-tuning gives
        warn_feature_mismatch(store, cfg.init, main=dist.main)
        if qa is not None and tuple(meta.get("qa_answers", ())) != qa.answers.answers:
            raise VlbertsError("--init's image-QA head was trained on another joint answer table (config.json "
                               "qa_answers); continue with the same questions", path=Path(cfg.init) / "config.json")
    else:
        sizes = store_sizes(store)
        heads = {field: sizes[what] for field, what in recipe.head_sizes.items() if what in sizes}
        if arch == "lxmert":  # the image-QA head: one class per joint-table answer, none without questions
            heads["num_qa_labels"] = len(qa.answers) if qa is not None else 0
        # End-to-end: visual_dim is the CNN head's width (the config's), not the store's feature width.
        dims = {} if getattr(model_config(cfg.model), "end_to_end", False) else {"visual_dim": store.feature_dim}
        model_cfg = model_config(cfg.model, vocab_size=tok.vocab_size, **dims, **heads)
        model = build_pretraining_model(model_cfg)
        if cfg.bert_init:  # on a resume the checkpoint's weights replace these below
            report = init_text_from_bert(model, cfg.bert_init)
            from_bert = report.initialised
            if dist.main:
                write_json(out / "bert_init.json", report.to_dict())
                print(report.summary(), file=sys.stderr)
    end_to_end = bool(getattr(model_cfg, "end_to_end", False))
    pixels = end_to_end_pixels(cfg, end_to_end, [] if streamed else [c.image_id for c in captions])
    if not end_to_end and model_cfg.visual_dim != store.feature_dim:
        raise VlbertsError(
            f"store features are {store.feature_dim}-d but the model expects {model_cfg.visual_dim}-d", path=cfg.features
        )
    if model_cfg.vocab_size != tok.vocab_size:
        source = Path(cfg.init or cfg.tokenizer or out / "tokenizer") / "vocab.txt"
        raise VlbertsError(f"vocab.txt has {tok.vocab_size} tokens but the model's vocabulary is {model_cfg.vocab_size}"
                           + (f" ({Path(cfg.init) / 'config.json'} vocab_size)" if cfg.init else ""), path=source)
    model.to(device)
    if cfg.fsdp:  # each rank keeps a shard of every tensor (training/distributed.py)
        model = shard_model(model, dist)
    if cfg.compile:
        compile_model(model, cfg.compile_mode, cfg.static_shapes)
    graphs = replays_cuda_graphs(cfg.compile, cfg.compile_mode, device)  # then each micro-batch's gradients are copied out
    weights = mix_weights(cfg, recipe, model_cfg, run_weights(cfg, recipe, model_cfg, with_qa=qa is not None))
    recipe = replace(recipe, text_mlm_apart="mlm_text" in weights)  # the captions' and the documents' masked words
    qa_from = qa_from_step(cfg.steps, cfg.qa_last_fraction) if "qa" in weights else None
    unpaired = recipe.unpaired(model_cfg)
    if unpaired and "match" in weights:
        raise VlbertsError(f"{model_cfg.__class__.__name__} variant {model_cfg.variant} trains on unpaired batches: "
                           "it has no matching objective")
    check_sources(cfg, arch, model_cfg, weights, unpaired)
    pairs = recipe.caption_pairs and cfg.pairs
    if cfg.mismatch_replace != "caption" and (pairs or "match" not in weights):
        raise VlbertsError(f"--mismatch_replace={cfg.mismatch_replace} changes single-caption matching negatives, but this "
                           "run has " + ("caption pairs (VisualBERT's sentence-image prediction; --pairs=false for one "
                                         "caption)" if pairs else "no matching objective"))
    # Settings of objectives this run does not train change nothing: refused, as --mismatch_replace is above
    if cfg.mismatch_prob != setting_default("mismatch_prob") and (pairs or "match" not in weights):
        raise VlbertsError(f"--mismatch_prob={cfg.mismatch_prob:g} sets how often single-caption matching's caption is "
                           "another image's, but this run has " + ("caption pairs (VisualBERT's sentence-image "
                                                                  "prediction)" if pairs else "no matching objective"))
    if cfg.mismatched_targets != setting_default("mismatched_targets") and "match" not in weights:
        raise VlbertsError(f"--mismatched_targets={cfg.mismatched_targets} decides the targets of a mismatched caption, "
                           "but this run has no matching objective")
    if not cfg.pairs and not recipe.caption_pairs:
        raise VlbertsError(f"--pairs=false turns VisualBERT's two-caption texts into one caption; {arch} reads one "
                           "caption already")
    # The width of the store's features as read: the model's, or, end-to-end, the store's own (the CNN
    # replaces them; they only pad batches alongside the boxes).
    feature_dim = store.feature_dim if end_to_end else model_cfg.visual_dim
    tags_in = "tags" in recipe.model_inputs and getattr(model_cfg, "use_tags", False)
    reads = {f for name in weights for f in NEEDS.get(name, ())} | ({"obj_id", "attr_id"} if tags_in else set())
    for labelled in (store, image_store) if image_store else (store,):
        check_store_labels(labelled, head_label_sizes(recipe, model_cfg, weights), reads)

    regions_setup = dataclasses.replace(region_setup(recipe, weights, store, tok, with_tags=tags_in), float16=float16)
    make_data = partial(
        CaptionPretrainData, tokenizer=tok, pairs=pairs, max_text_len=cfg.max_text_len, max_regions=cfg.max_regions,
        mlm_prob=cfg.mlm_prob, feature_dim=feature_dim, token_probs=token_probs(tok, cfg.mlm_word_probs),
        whole_word=recipe.whole_word,
        mismatch_prob=cfg.mismatch_prob if "match" in weights and not pairs else 0.0,
        drop_mismatched="match" in weights and drop_mismatched(cfg.mismatched_targets, recipe),
        mismatch_replace=cfg.mismatch_replace if "match" in weights and not pairs else "caption",
        region_setup=regions_setup, pixels=pixels,
    )
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, bias_correction=cfg.bias_correction,
                                decay_all=cfg.decay_all, kind=cfg.optimizer, momentum=cfg.momentum,
                                slow=from_bert, slow_lr_mult=cfg.bert_lr_mult)
    scheduler = linear_warmup_decay(optimizer, warmup_steps(cfg.warmup, cfg.steps), cfg.steps)

    scaler = loss_scaler(device, cfg.precision, sharded=is_sharded(model))  # fp16 only; a no-op otherwise

    state, resumed = start_or_resume(out, cfg, model, optimizer, scheduler, write=dist.main)
    if "grad_scaler" in state.extra:
        scaler.load_state_dict(state.extra["grad_scaler"])
    log = (MetricsLog(out / "metrics.jsonl", resume_step=state.step if resumed else None, tensorboard=cfg.tensorboard)
           if dist.main else None)
    broadcast_parameters(model, dist)
    grads = GradientSync(model, dist)  # the ranks' gradients summed while backward runs
    collate = partial(collate_pretrain, pad_id=tok.pad_id,
                      shapes=FixedShapes(cfg.max_text_len, cfg.max_regions) if cfg.static_shapes else None)
    if streamed:  # each rank its own stream of chunks (one per loader worker), resumed at its own position
        resumed_data = state.data if resumed else {}
        n_image_only = image_store.kinds.get("image", 0) if image_store else 0
        sizes = streamed_batch_sizes(batch_split(cfg, unpaired, store.images, n_image_only), unpaired, dist)
        joined = bool(streamed_text or image_store)  # other streams' examples join the captions' before collating
        pair_collate = list if joined else collate

        def pair_batches(reader: tuple[int, int] | None, start: StreamPosition) -> Iterator[tuple[Any, StreamPosition]]:
            """The caption stream of this rank (reader None) or of one of its loader workers."""
            return stream_batches(stream_examples(
                store, lambda caps, regions, seed: make_data(caps, regions, seed=seed, qa_targets=streamed_qa(caps)),
                seed=cfg.seed if reader is None else stream_seed(cfg.seed, LOADER_SEED + reader[0]),
                chunk_images=cfg.chunk_images, dist=dist, start=start, buffer=cfg.shuffle_buffer, reader=reader,
            ), pair_collate, sizes["pairs"])

        def streamed_qa(caps: list[CaptionRef]) -> list[SoftTarget] | None:
            """A chunk's QA targets: its questions' over the joint table (LXMERT §3.1.3), none for captions."""
            if "qa" not in weights:
                return None
            return [qa_target(c.label, qa.answers) if isinstance(c, QuestionRef) and c.label is not None
                    else SoftTarget((), ()) for c in caps]

        pairs_start = stream_start(resumed_data, dist, out, workers=cfg.num_workers)
        stream = (worker_batches(lambda k, pos: pair_batches((k, cfg.num_workers), pos), pairs_start)
                  if cfg.num_workers else pair_batches(None, pairs_start))
        if joined:  # text-only documents and image-only samples: each its own stream and position, mixed in as from files
            streams, starts = {"pairs": stream}, StreamedPositions(pairs_start)
            if streamed_text:
                make_text = partial(TextOnlyData, tokenizer=tok, feature_dim=feature_dim, max_text_len=cfg.max_text_len,
                                    mlm_prob=cfg.mlm_prob, nsp="nsp" in weights, whole_word=recipe.whole_word)
                starts = replace(starts, text=stream_start(resumed_data, dist, out, key="text_stream"))
                streams["text"] = stream_batches(stream_documents(
                    streamed_text, lambda docs, seed: make_text(docs, seed=seed), seed=stream_seed(cfg.seed, TEXT_SEED),
                    chunk_documents=cfg.chunk_documents, dist=dist, buffer=cfg.shuffle_buffer, start=starts.text,
                ), list, sizes["text"])
            if image_store:
                make_images = partial(ImageOnlyData, tokenizer=tok, max_regions=cfg.max_regions, feature_dim=feature_dim,
                                      region_setup=regions_setup)
                starts = replace(starts, image_only=stream_start(resumed_data, dist, out, key="image_stream"))
                streams["image_only"] = stream_batches(stream_examples(
                    image_store, lambda _, regions, seed: make_images(list(regions.records), regions, seed=seed),
                    seed=stream_seed(cfg.seed, IMAGE_SEED), chunk_images=cfg.chunk_images, dist=dist,
                    start=starts.image_only, buffer=cfg.shuffle_buffer, kind="image",
                ), list, sizes["image_only"])
            stream = StreamedSources(streams, collate, unpaired, starts)
    else:
        data = make_data(captions, store, seed=cfg.seed, qa_targets=qa_targets if "qa" in weights else None)
        stream = batches(
            data, collate, batch_size=cfg.batch_size, seed=cfg.seed,
            start=Position.from_dict(state.data), num_workers=cfg.num_workers,
            lengths=data.lengths if cfg.length_group > 1 else None, group=cfg.length_group, dist=dist,
        )
        if documents or image_only:  # text-only and image-only samples, each source its own stream
            stream = build_sources(
                cfg, data=data, collate=collate, start=state.data, tok=tok, store=store, documents=documents,
                feature_dim=feature_dim, weights=weights, unpaired=unpaired, image_only=image_only,
                region_setup=regions_setup, dist=dist,
                lengths=data.lengths if cfg.length_group > 1 else None,
            )

    # Logged every record: the paper's objectives (0.0 when this run switches one off) and any others.
    logged = [*(k for k in recipe.objectives if k in recipe.available(model_cfg)), *weights]
    logged = list(dict.fromkeys(logged))

    def update_batches(step: int) -> Iterator[tuple[str | None, list[PretrainBatch], Any]]:
        """Each update's (source, micro-batches, data position after them), from update `step` on."""
        while True:
            # W-VisualBERT §3: each update draws a text-only or an image-only batch (stateless in `step`).
            # With --text_corpus the text-only share of the updates is --text_ratio, and --corpus_share of
            # those read the corpus, the others the captions (recipes/pretrain_mix.py).
            source = unpaired_schedule(step, cfg.seed, cfg.text_ratio if cfg.text_corpus else 0.5) if unpaired else None
            corpus = source == "text" and reads_corpus(cfg, step)
            micro = []
            for _ in range(cfg.grad_accum):
                batch, pos = draw(stream, source, corpus)
                micro.append(unpaired_view(batch, source) if source is not None else batch)
            yield source, micro, pos
            step += 1

    model.train()
    step, done_here = state.step, 0
    t0 = time.perf_counter()
    # On a GPU drawn ahead in a thread and pinned there: the host collates while the device computes.
    with progress(disable=None if dist.main else True) as bar, feed(update_batches(step), device, cfg.prefetch) as updates:
        task = bar.add_task("pre-train", total=cfg.steps, completed=step, info="")
        while step < cfg.steps:
            source, micro, pos = next(updates)  # host batches: everything the step needs to know is read here
            torch.manual_seed(update_seed(cfg.seed, step, dist.rank))
            # The update's losses, kept on the device until a record is written: reading one back (`.item()`)
            # would make the host wait for the GPU every update instead of queueing the next one's kernels.
            totals: dict[str, Any] = {k: 0.0 for k in logged if k not in weights or applies(k, source)}
            # LXMERT §3.3: the image-QA loss only from `qa_from` on (its weight is 0 before).
            step_weights = {k: w for k, w in weights.items() if k != "qa" or qa_active(step, qa_from)}
            active = [k for k in step_weights if applies(k, source)]
            # Each micro-batch's mean losses weighted by its share of the update's terms, over every rank:
            # the update is the same however it is split (`loss_shares`). Counted on the host batches.
            shares = loss_shares([loss_counts(b, active, recipe) for b in micro], dist)
            for i, batch in enumerate(micro):
                batch = to_device(batch, device)  # on a GPU copied beside the previous update's kernels
                if graphs:  # each forward starts a new step of the CUDA graphs (the loop keeps no output of the last)
                    torch.compiler.cudagraph_mark_step_begin()
                with autocast(device, cfg.precision):
                    outp = run_model(recipe, model, batch)
                share = shares[i]  # read after the forward: the ranks' counts were summed meanwhile
                losses = {k: v * share[k] for k, v in pretrain_losses(recipe, outp, batch, step_weights, source).items()}
                grads.backward(scaler.scale(total_loss(losses, step_weights)), last=i == len(micro) - 1)
                if graphs and i < len(micro) - 1:
                    own_gradients(model)
                for k, v in losses.items():
                    totals[k] = totals[k] + v.detach()
            grads.finish()
            grad_norm = update(model, optimizer, scheduler, cfg.clip, scaler, cfg.clip_per_tensor)
            step += 1
            done_here += 1
            bar.update(task, completed=step)
            log_step = step % cfg.log_every == 0 or step == cfg.steps
            if log_step or step % cfg.ckpt_every == 0:  # the update's losses: the ranks' shares summed
                totals = sum_over_ranks({k: float(v) for k, v in totals.items()}, dist)
                require_finite({f"{k} loss": v for k, v in totals.items()}, step, scaler)  # never checkpoint a diverged model
                bar.update(task, info=" ".join(f"{k} {v:.3f}" for k, v in totals.items()))
            if log is not None and log_step:
                record = {"step": step, "loss": sum(weights.get(k, 0.0) * v for k, v in totals.items())}
                # a loss with no terms in this update (NSP in a text update of captions) is not a 0 to average in
                record.update({f"{k}_loss": v for k, v in totals.items() if shares.counts.get(k, 1) > 0})
                if source is not None:
                    record["source"] = source
                if scaler.is_enabled():
                    record["loss_scale"] = scaler.get_scale()
                log.write({**record, "lr": scheduler.get_last_lr()[0], "grad_norm": float(grad_norm),
                           "seconds": round(time.perf_counter() - t0, 3)})
            if step % cfg.ckpt_every == 0 or step == cfg.steps:
                # Streams: every rank's own position (gathered on every rank: a collective call).
                position = stream_state(pos, dist) if streamed else pos.to_dict()
                save_checkpoint(  # every rank: a sharded model is gathered; rank 0 writes
                    out, model=model, cfg=model_cfg, optimizer=optimizer, scheduler=scheduler,
                    state=TrainState(step=step, data=position, extra=scaler_state(scaler)), write=dist.main,
                )
            if cfg.stop_after and done_here >= cfg.stop_after and step < cfg.steps:
                break
    if log is not None:
        log.close()
    if step < cfg.steps:  # stopped by --stop_after, as if interrupted
        return None

    final = out / "model"
    # Where the features came from (a store's or a shard index's metadata): fine-tuning and analysis warn
    # when given features of another extractor or settings (features/identity.py).
    extra = {"trained_by": "pretrain", "steps": step, "features": feature_identity(store)}
    if qa is not None:  # the answer names of the image-QA head's rows (VQA fine-tuning can reuse them)
        extra["qa_answers"] = list(qa.answers.answers)
    save_model_dir(final, model, model_cfg, extra=extra, write=dist.main, tokenizer=tok)  # every rank: gathered if sharded
    barrier(dist)
    return final


def config_from_args(args: list[str], base: dict | None = None) -> PretrainConfig:
    return apply_overrides(from_dict(PretrainConfig, base or {}), args)
