"""Recipe: pre-train VisualBERT on image captions (VisualBERT App. A.3; SPEC §3, §6).

Reads a COCO-format captions file and a region-feature store, and runs
  task-agnostic pre-training  (pairs=true):  MLM with the image + sentence-image prediction, or
  task-specific pre-training  (pairs=false): MLM with the image on single captions,
with AdamW, linear warm-up/decay, gradient accumulation and clipping. Every `ckpt_every` updates it
writes an atomic checkpoint (model, optimizer, scheduler, RNG, data position); started again on the
same run directory it resumes from the newest one and reproduces the uninterrupted run exactly.

    RUN/run_config.yaml   the resolved config
    RUN/metrics.jsonl     one record per logged step
    RUN/checkpoints/      training checkpoints (`latest` names the newest)
    RUN/model/            the final model directory (weights, config, vocabulary)
    RUN/bert_init.json    with --bert_init: which tensors came from the BERT checkpoint, which stayed random
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from vlberts.config import apply_overrides, from_dict
from vlberts.data.coco import read_caption_refs
from vlberts.data.pretrain import CaptionPretrainData, collate_pretrain
from vlberts.data.sampling import Position
from vlberts.errors import VlbertsError
from vlberts.features.store import RegionStore
from vlberts.io import read_json, write_json
from vlberts.models.bert_init import init_text_from_bert
from vlberts.models.builders import build_pretraining_model, model_config
from vlberts.objectives.mlm import masked_positions, match_loss, mlm_loss
from vlberts.recipes.common import autocast, opt, progress, resolve_device, seed_everything, set_threads
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import TrainState, load_pretraining_model, save_checkpoint, save_model_dir
from vlberts.training.loop import batches, start_or_resume, update
from vlberts.training.metrics import MetricsLog
from vlberts.training.optim import build_optimizer, linear_warmup_decay


@dataclass(frozen=True)
class PretrainConfig:
    captions: str = opt("", "COCO-format captions json (official or Karpathy) to pre-train on")
    features: str = opt("", "region-feature store (HDF5) holding every image of the captions")
    out: str = opt("runs/pretrain", "run directory")
    split: str = opt("train", "Karpathy split to use when `captions` is a Karpathy json")
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
    pairs: bool = opt(True, "two captions + sentence-image prediction; false: one caption, MLM only")
    steps: int = opt(1000, "optimizer updates")
    batch_size: int = opt(64, "examples per micro-batch")
    grad_accum: int = opt(1, "micro-batches per update")
    lr: float = opt(1e-4, "peak learning rate")
    warmup: float = opt(0.1, "fraction of the updates spent warming up")
    weight_decay: float = opt(0.01, "AdamW weight decay (not on biases and LayerNorm)")
    clip: float = opt(1.0, "gradient-norm clipping; 0 disables")
    max_text_len: int = opt(48, "tokens per example, [CLS]/[SEP] included")
    max_regions: int = opt(36, "regions per image (the store's first ones)")
    mlm_prob: float = opt(0.15, "MLM selection probability")
    mlm_focus_words: tuple[str, ...] = opt((), "words selected with mlm_focus_prob instead of mlm_prob (comma list; default none)")
    mlm_focus_prob: float = opt(0.15, "selection probability of the mlm_focus_words (see the README: the demo's masking)")
    match_weight: float = opt(1.0, "weight of the sentence-image loss")
    seed: int = opt(0, "seed of initialisation, data order, masking and negatives")
    log_every: int = opt(10, "updates between metrics records")
    ckpt_every: int = opt(200, "updates between checkpoints")
    device: str = opt("auto", "auto, cpu, cuda, cuda:N")
    precision: str = opt("auto", "auto (bf16 autocast on CUDA), fp32 or bf16")
    num_workers: int = opt(0, "DataLoader worker processes")
    preload_features: bool = opt(False, "read the whole region store into memory first (for stores that fit)")
    stop_after: int = opt(0, "stop after this many updates in this invocation, as if interrupted (0: run to the end)")


CONFIG_CLASS = PretrainConfig


def _tokenizer(cfg: PretrainConfig, out: Path, texts: list[str]) -> TextTokenizer:
    saved = out / "tokenizer"
    if (saved / "vocab.txt").is_file():  # resuming: the vocabulary must not change
        return TextTokenizer.load(saved)
    if cfg.init:
        tok = TextTokenizer.load(cfg.init)
    elif cfg.bert_init:
        tok = bert_tokenizer(cfg)
    elif cfg.tokenizer:
        tok = TextTokenizer.load(cfg.tokenizer)
    else:
        # The focus words join the corpus so that a trained vocabulary holds each as one token.
        tok = TextTokenizer.train([*texts, *cfg.mlm_focus_words], vocab_size=cfg.vocab_size)
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
        size = read_json(bert / "config.json").get("vocab_size")
        if size != tok.vocab_size:
            raise VlbertsError(
                f"vocab.txt has {tok.vocab_size} tokens but the BERT checkpoint's vocabulary has {size} "
                "(config.json vocab_size): use the checkpoint's own vocab.txt", path=src / "vocab.txt"
            )
    return tok


def focus_ids(tok: TextTokenizer, words: tuple[str, ...]) -> frozenset[int]:
    """Subword ids of the focus words; a word that is not one subword of the vocabulary is an error."""
    ids = set()
    for w in words:
        sub = tok.encode(w)
        if len(sub) != 1 or sub[0] == tok.unk_id:
            raise VlbertsError(f"mlm_focus_words: {w!r} is not a single token of the vocabulary ({len(sub)} subwords)")
        ids.add(sub[0])
    return frozenset(ids)


def pretrain(cfg: PretrainConfig) -> Path | None:
    """Run (or resume) pre-training; returns the final model directory, or None if stopped early."""
    set_threads()
    out = Path(cfg.out)
    device = resolve_device(cfg.device)
    if not cfg.captions or not cfg.features:
        raise VlbertsError("pretrain needs --captions=FILE and --features=STORE")
    if cfg.init and cfg.bert_init:
        raise VlbertsError("--init and --bert_init both give starting weights; pass one")

    captions = read_caption_refs(cfg.captions, split=cfg.split)
    store = RegionStore(cfg.features)
    if cfg.preload_features:
        store.preload()
    missing = [c.image_id for c in captions if c.image_id not in store]
    if missing:
        raise VlbertsError(f"image id {missing[0]} not in store ({len(missing)} captions affected)", path=cfg.features, record=missing[0])

    tok = _tokenizer(cfg, out, [c.text for c in captions])
    seed_everything(cfg.seed)
    if cfg.init:
        model, model_cfg, _ = load_pretraining_model(cfg.init)
    else:
        model_cfg = model_config(cfg.model, vocab_size=tok.vocab_size, visual_dim=store.feature_dim)
        model = build_pretraining_model(model_cfg)
        if cfg.bert_init:  # on a resume the checkpoint's weights replace these below
            report = init_text_from_bert(model, cfg.bert_init)
            write_json(out / "bert_init.json", report.to_dict())
            print(report.summary(), file=sys.stderr)
    if model_cfg.visual_dim != store.feature_dim:
        raise VlbertsError(
            f"store features are {store.feature_dim}-d but the model expects {model_cfg.visual_dim}-d", path=cfg.features
        )
    if model_cfg.vocab_size != tok.vocab_size:
        raise VlbertsError(f"tokenizer has {tok.vocab_size} tokens but the model's vocabulary is {model_cfg.vocab_size}")
    model.to(device)

    data = CaptionPretrainData(
        captions, store, tok, pairs=cfg.pairs, max_text_len=cfg.max_text_len, max_regions=cfg.max_regions,
        mlm_prob=cfg.mlm_prob, seed=cfg.seed, feature_dim=model_cfg.visual_dim,
        focus_ids=focus_ids(tok, cfg.mlm_focus_words), focus_prob=cfg.mlm_focus_prob,
    )
    optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay)
    scheduler = linear_warmup_decay(optimizer, int(cfg.warmup * cfg.steps), cfg.steps)

    state, resumed = start_or_resume(out, cfg, model, optimizer, scheduler)
    log = MetricsLog(out / "metrics.jsonl", resume_step=state.step if resumed else None)
    stream = batches(
        data, lambda ex: collate_pretrain(ex, tok.pad_id), batch_size=cfg.batch_size, seed=cfg.seed,
        start=Position.from_dict(state.data), num_workers=cfg.num_workers, pin_memory=device.type == "cuda",
    )

    model.train()
    step, done_here = state.step, 0
    t0 = time.perf_counter()
    with progress() as bar:
        task = bar.add_task("pre-train", total=cfg.steps, completed=step, info="")
        while step < cfg.steps:
            totals = {"mlm": 0.0, "match": 0.0}
            for _ in range(cfg.grad_accum):
                batch, pos = next(stream)
                batch = batch.to(device, non_blocking=True)
                where = masked_positions(batch.mlm_labels)
                with autocast(device, cfg.precision):
                    outp = model(batch.inputs, mlm_positions=where)
                l_mlm = mlm_loss(outp.mlm_logits, batch.mlm_labels[where])
                l_match = match_loss(outp.match_logits, batch.match_labels) if cfg.pairs else l_mlm * 0.0
                loss = (l_mlm + cfg.match_weight * l_match) / cfg.grad_accum
                loss.backward()
                totals["mlm"] += l_mlm.item() / cfg.grad_accum
                totals["match"] += l_match.item() / cfg.grad_accum
            grad_norm = update(model, optimizer, scheduler, cfg.clip)
            step += 1
            done_here += 1
            bar.update(task, completed=step, info=f"mlm {totals['mlm']:.3f} match {totals['match']:.3f}")
            if step % cfg.log_every == 0 or step == cfg.steps:
                log.write({
                    "step": step, "loss": totals["mlm"] + cfg.match_weight * totals["match"], "mlm_loss": totals["mlm"],
                    "match_loss": totals["match"], "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                    "seconds": round(time.perf_counter() - t0, 3),
                })
            if step % cfg.ckpt_every == 0 or step == cfg.steps:
                save_checkpoint(
                    out, model=model, cfg=model_cfg, optimizer=optimizer, scheduler=scheduler,
                    state=TrainState(step=step, data=pos.to_dict(), extra={}),
                )
            if cfg.stop_after and done_here >= cfg.stop_after and step < cfg.steps:
                return None

    final = out / "model"
    save_model_dir(final, model, model_cfg, extra={"trained_by": "pretrain", "steps": step})
    tok.save(final)
    return final


def config_from_args(args: list[str], base: dict | None = None) -> PretrainConfig:
    return apply_overrides(from_dict(PretrainConfig, base or {}), args)
