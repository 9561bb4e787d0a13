"""Recipe: fine-tune any architecture on VCR, Q->A or QA->R (SPEC §4), predict, and score.

VisualBERT §4.2, VL-BERT §4.2.1 and ViLBERT §4 fine-tune Q->A and QA->R as two separate models with the
same recipe: each question's 4 choices are 4 sequences scored by a linear layer on the pooled output,
trained with softmax cross-entropy over the 4 (`models.vcr`). QA->R reads the question followed by the
*right* answer, in training and in evaluation (formats §2.5; `data.vcr.rationale_context`); Q->AR, both
right, comes from combining the two models' predictions (`vlberts evaluate vcr`, `evaluate_vcr`). For the
unlabelled test split, `vlberts predict vcr` (`recipes.predict_vcr`) writes the leaderboard's file.

    vlberts finetune vcr --mode=qa --init=runs/pt/model --features=F.h5 --out=runs/vcr_qa
        --train_file=WORLD/vcr/train.jsonl --eval_file=WORLD/vcr/val.jsonl

    RUN/model/             the fine-tuned model (weights, config with task "vcr" and the mode, vocabulary)
    RUN/predictions.json   {annot_id: [p_0, p_1, p_2, p_3]}: the 4 choices' softmax probabilities
    RUN/metrics.json       the mode's accuracy (q2a or qa2r, percent) next to chance (25%), counts,
                           skipped_records

The regions of a question are its objects (`data.vcr_dataset`, ``--object_regions``): ``iou`` (default)
maps each object's metadata box to the best-overlapping region of an ordinary detector store; ``gold``
reads a store holding exactly the objects' boxes (``vlberts extract --boxes=gold``).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from vlberts.config import apply_overrides, from_dict
from vlberts.data.mirror import check_flip
from vlberts.data.vcr import VCRExample, parse_vcr_record, read_vcr, read_vcr_metadata
from vlberts.data.vcr_dataset import MODES, OBJECT_REGIONS, VCRBatch, VCRData, collate_vcr
from vlberts.data.vqa_dataset import model_tag_subwords
from vlberts.errors import BadRecords, VlbertsError
from vlberts.features.store import RegionStore
from vlberts.io import DuplicateKey, read_json, read_json_object, require_file, require_unique, unique_keys, write_json
from vlberts.models.builders import arch_of
from vlberts.models.encoders import load_encoder_weights
from vlberts.models.vcr import CHOICE_LOSSES, VCRModel, uses_alignment, vcr_loss, vcr_object_loss
from vlberts.models.vlbert import start_from_roi_transform
from vlberts.recipes.common import FLIP_PROB_HELP, autocast, opt, seed_everything
from vlberts.recipes.finetune_loop import (all_labelled, check_features, labelled_evaluation, open_features, require_eval_examples, finetune_loop, FinetuneConfig, load_task_weights, num_updates,
                                           read_task_model, start_finetune)
from vlberts.tasks.predictions import choose
from vlberts.tasks.vcr import CHANCE, read_submission, score_logits, score_submission
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import read_model_config
from vlberts.training.distributed import DistInfo, barrier, merge_over_ranks

METRIC = {"qa": "q2a", "qar": "qa2r"}  # mode -> its metric in `tasks.vcr`


@dataclass(frozen=True)
class FinetuneVCRConfig(FinetuneConfig):
    mode: str = opt("qa", "qa: Q->A (choose the answer); qar: QA->R (choose the rationale, given the right answer)")
    train_file: str = opt("", "VCR jsonl of the training split (with labels)")
    eval_file: str = opt("", "VCR jsonl to predict (and score, when it has labels) after training")
    metadata_dir: str = opt("", "folder of the records' metadata_fn files (default: metadata/ next to train_file)")
    object_regions: str = opt("iou", "iou: each object's box -> the store region overlapping it most; gold: the "
                                     "store holds exactly the objects' boxes, in order")
    alignment: str = opt("auto", "tie each object's region to the words naming it: VisualBERT gives the region their "
                                 "position (§4.2, App. A); VL-BERT gives those words the region's visual feature "
                                 "instead of the whole image's (its released VCR code). auto: on for VisualBERT, off "
                                 "for VL-BERT (§3.2); false: names only, as the other architectures")
    object_loss: float = opt(0.0, "weight of the object-classification loss: each region's final state names its "
                                   "object's class (VL-BERT §4.2.1's second fine-tuning loss, weight 1 there); 0: off")
    flip_prob: float = opt(0.0, FLIP_PROB_HELP)
    choice_loss: str = opt("softmax", "softmax: cross-entropy over the 4 choices (the papers); sigmoid: a binary "
                                      "cross-entropy per choice (VL-BERT's released VCR configs, CLASSIFIER_SIGMOID)")
    out: str = opt("runs/vcr", "run directory")
    epochs: float = opt(4.0, "passes over the training questions")
    batch_size: int = opt(16, "questions per micro-batch (x4 sequences)")
    lr: float = opt(5e-5, "peak learning rate")
    max_text_len: int = opt(80, "subwords per sequence incl. [CLS] and two [SEP] (the context is cut first)")
    eval_batch_size: int = opt(64, "questions per prediction batch")
    skip_bad: bool = opt(False, "drop malformed records and questions whose image is not in the store or whose "
                                "objects have no boxes, counting them (a warning and metrics.json's skipped_records), "
                                "instead of stopping at the first")


CONFIG_CLASS = FinetuneVCRConfig


# --------------------------------------------------------------------------- reading


def read_vcr_file(path: str | Path, bad: BadRecords, *, require_labels: bool) -> list[VCRExample]:
    """The records of a VCR jsonl file (`data.vcr.parse_vcr_record`, blank lines skipped); a malformed line or
    record (or, with `require_labels`, an unlabelled one, or an annot_id seen on an earlier line) is an error
    naming the file and line, or with `bad.skip` dropped and counted, reading on."""
    path = require_file(path)
    out = []
    first: dict[str, object] = {}  # annot_id -> its line
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    for lineno, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        where = f"line {lineno}"
        try:
            try:
                rec = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
            except UnicodeDecodeError as e:
                raise VlbertsError(f"not UTF-8 text ({e.reason})", path=path, record=where) from None
            except json.JSONDecodeError as e:
                raise VlbertsError(f"malformed JSON line: {e.msg}", path=path, record=where) from None
            except DuplicateKey as e:
                raise VlbertsError(str(e), path=path, record=where) from None
            ex = parse_vcr_record(rec, path=path, record=where)
            if require_labels and not ex.annotated:
                raise VlbertsError("missing field answer_label or rationale_label", path=path, record=where)
            require_unique(first, ex.annot_id, where, what="annot_id", path=path)
        except VlbertsError as err:
            bad.handle(err)
            continue
        out.append(ex)
    return out


def usable_examples(examples: list[VCRExample], path: str, store: RegionStore, features: str, object_regions: str,
                    metadata_dir: Path, bad: BadRecords) -> list[VCRExample]:
    """The examples whose image is in the store (`features`) and whose objects have regions ("missing
    features"), or whose metadata file gives a box per object ("bad metadata")."""
    keep = []
    for ex in examples:
        try:
            if ex.img_id not in store:
                raise VlbertsError(f"image id {ex.img_id} of {path} not in store", path=features, record=ex.annot_id)
            if object_regions == "gold" and store.num_boxes(ex.img_id) != len(ex.objects):
                raise VlbertsError(f"object_regions=gold needs one stored region per object: image {ex.img_id} has "
                                   f"{store.num_boxes(ex.img_id)} for {len(ex.objects)} objects", path=features,
                                   record=ex.annot_id)
        except VlbertsError as err:
            bad.handle(err, "missing features")
            continue
        if object_regions == "iou":
            try:
                # a record pointing at no file is the record's fault: name the jsonl file and the record, and the
                # path it points at (read_vcr_metadata alone would name only that path)
                meta_path = metadata_dir / ex.metadata_fn
                if not ex.metadata_fn:
                    raise VlbertsError("no metadata_fn: --object_regions=iou reads the objects' boxes from it",
                                       path=path, record=ex.annot_id)
                if not meta_path.is_file():
                    why = "is a directory, expected a file" if meta_path.is_dir() else "not found"
                    raise VlbertsError(f"metadata_fn {ex.metadata_fn}: {meta_path} {why}", path=path,
                                       record=ex.annot_id)
                meta = read_vcr_metadata(meta_path)
                if len(meta.boxes) != len(ex.objects):
                    raise VlbertsError(f"metadata has {len(meta.boxes)} boxes for {len(ex.objects)} objects",
                                       path=metadata_dir / ex.metadata_fn, record=ex.annot_id)
                differ = [i for i, (a, b) in enumerate(zip(meta.names, ex.objects)) if a != b]
                if differ:  # another image's metadata, or objects reordered: each box would go to another object
                    i = differ[0]
                    raise VlbertsError(f"metadata names object {i} {meta.names[i]!r}, the record {ex.objects[i]!r} "
                                       f"({len(differ)} of {len(ex.objects)} differ)",
                                       path=metadata_dir / ex.metadata_fn, record=ex.annot_id)
            except VlbertsError as err:
                bad.handle(err, "bad metadata")
                continue
        keep.append(ex)
    return keep


# --------------------------------------------------------------------------- model


def pretrained_vcr_model(init: str | Path, object_classes: int = 0) -> tuple[VCRModel, object, bool]:
    """A VCR model whose encoder comes from a pre-training (or other fine-tuned) model directory; new scorer
    (and object head, with `object_classes`, started by `start_object_head` from the same weights, read once).
    Returns (model, its config, whether the object head started from the initial weights)."""
    model_cfg, _ = read_model_config(init)
    model = VCRModel(model_cfg, object_classes)
    sd = load_encoder_weights(model.encoder, init)
    return model, model_cfg, start_object_head(model, sd)


def object_class_table(examples: list[VCRExample]) -> list[str]:
    """The object classes the object head names: every class name the training questions' objects carry,
    sorted (VCR's are COCO's 80 categories; the release's head has those and background, 81)."""
    return sorted({name for ex in examples for name in ex.objects})


def start_object_head(model: VCRModel, sd: dict[str, torch.Tensor]) -> bool:
    """Start the object head's dense layer from the initial weights' RoI-classification transform
    (``region_head.dense``: a VL-BERT pre-training model's), as the release starts `cnn_loss_reg.0` from
    `mvrc_head.transform`; whether it did (no head, or weights of another model or width: nothing to give)."""
    return model.object_head is not None and start_from_roi_transform(model.object_head.dense, sd)


def load_vcr_model(directory: str | Path) -> tuple[VCRModel, dict, TextTokenizer]:
    """A model directory written by `finetune_vcr`: (model, its config.json (mode, object_regions, alignment,
    ...), tokenizer)."""
    model_cfg, meta = read_task_model(directory, "vcr", "VCR")
    model = load_task_weights(lambda: VCRModel(model_cfg, len(meta.get("object_classes", []))), directory)
    model.uses_alignment = bool(meta.get("alignment", model.uses_alignment))  # as trained
    return model, meta, TextTokenizer.load(directory)


def vcr_data(model: VCRModel, examples: list[VCRExample], mode: str, store: RegionStore, tok: TextTokenizer, *,
             max_text_len: int, object_regions: str, metadata_dir: Path, float16: bool = False,
             object_classes: list[str] | None = None, flip_prob: float = 0.0, seed: int = 0) -> VCRData:
    """The examples laid out for `model` (its reference rendering; W-VisualBERT's detector tags); float16
    features kept so with `float16` (`open_features`); each region's object class with `object_classes`;
    training items mirrored with `flip_prob` (`data.mirror`)."""
    tags = model_tag_subwords(model.reads_tags, store, tok)
    table = {name: i for i, name in enumerate(object_classes)} if object_classes else None
    return VCRData(examples, mode, store, tok, join=model.join, max_text_len=max_text_len,
                   feature_dim=model.cfg.visual_dim, object_regions=object_regions, metadata_dir=metadata_dir,
                   tag_subwords=tags, float16=float16, object_classes=table, flip_prob=flip_prob, seed=seed)


@torch.no_grad()
def predict_vcr(model: VCRModel, data: VCRData, *, batch_size: int = 64, device: torch.device | str = "cpu",
                precision: str = "auto", dist: DistInfo = DistInfo()) -> dict[str, list[float]]:
    """annot_id -> the 4 choices' probabilities, on every rank (each rank scores every world-th question)."""
    dev = torch.device(device) if isinstance(device, str) else device
    model.to(dev).eval()
    mine = list(range(dist.rank, len(data), dist.world))
    out: dict[str, list[float]] = {}
    for start in range(0, len(mine), batch_size):
        idx = mine[start : start + batch_size]
        batch = collate_vcr([data[i] for i in idx], data.tok.pad_id, model.uses_alignment).to(dev)
        with autocast(dev, precision):
            probs = model(batch).float().softmax(-1)  # (B, 4)
        for i, p in zip(idx, probs.tolist()):
            out[data.examples[i].annot_id] = p
    return merge_over_ranks(out, dist)


# --------------------------------------------------------------------------- the recipe


def vcr_losses(model: VCRModel, batch: VCRBatch, choice_loss: str, object_loss: float) -> torch.Tensor:
    """The choice loss over each question's 4 scores, plus `object_loss` x the object-classification loss
    (VL-BERT §4.2.1) when the model has an object head; both are means over the batch's questions."""
    if model.object_head is None:
        return vcr_loss(model(batch), batch.labels, choice_loss)
    logits, objects = model.with_objects(batch)
    return vcr_loss(logits, batch.labels, choice_loss) + object_loss * vcr_object_loss(objects, batch.object_labels)


def finetune_vcr(cfg: FinetuneVCRConfig) -> Path | None:
    """Fine-tune one VCR mode, then predict and score the evaluation file; returns the model directory (None
    when stopped early by `stop_after`). Distributed under torchrun (`finetune_loop`, `predict_vcr`)."""
    cfg, out, device, dist = start_finetune(cfg, "vcr", ("init", "train_file", "features"))
    if cfg.mode not in MODES:
        raise VlbertsError(f"unknown --mode {cfg.mode!r}; valid: qa (Q->A), qar (QA->R)")
    uses_alignment(cfg.alignment, arch_of(read_model_config(cfg.init)[0]))  # a bad --alignment: before any data
    check_flip(cfg.flip_prob, cfg.init)
    if cfg.choice_loss not in CHOICE_LOSSES:
        raise VlbertsError(f"unknown --choice_loss {cfg.choice_loss!r}; valid: {', '.join(CHOICE_LOSSES)}")
    if cfg.object_regions not in OBJECT_REGIONS:
        raise VlbertsError(f"unknown --object_regions {cfg.object_regions!r}; valid: {', '.join(OBJECT_REGIONS)}")
    metadata_dir = Path(cfg.metadata_dir) if cfg.metadata_dir else Path(cfg.train_file).parent / "metadata"
    if cfg.object_regions == "iou" and not metadata_dir.is_dir():  # else every record fails (or is skipped) alike
        raise VlbertsError("metadata folder not found: --object_regions=iou reads each record's metadata_fn from it "
                           "(default: metadata/ next to --train_file); pass --metadata_dir=DIR", path=metadata_dir)

    bad = BadRecords(skip=cfg.skip_bad)
    store, float16 = open_features(cfg, device)
    train = read_vcr_file(cfg.train_file, bad, require_labels=True)
    evaluation = read_vcr_file(cfg.eval_file, bad, require_labels=False) if cfg.eval_file else []
    train = usable_examples(train, cfg.train_file, store, cfg.features, cfg.object_regions, metadata_dir, bad)
    evaluation = usable_examples(evaluation, cfg.eval_file, store, cfg.features, cfg.object_regions, metadata_dir, bad)
    evaluation = labelled_evaluation(evaluation, lambda ex: ex.annotated, lambda ex: ex.annot_id, cfg.eval_file, bad)
    if bad.total and dist.main:  # first, so that an error below for an emptied file shows what was skipped
        print(bad.warning(), file=sys.stderr)
    if not train:
        raise VlbertsError("no usable training questions (the file holds none, or --skip_bad dropped them all)",
                           path=cfg.train_file)
    require_eval_examples(evaluation, cfg.eval_file)

    tok = TextTokenizer.load(cfg.init)
    seed_everything(cfg.seed)
    classes = object_class_table(train) if cfg.object_loss > 0 else []
    model, model_cfg, head_from_pretraining = pretrained_vcr_model(cfg.init, len(classes))
    if model_cfg.visual_dim != store.feature_dim:
        raise VlbertsError(
            f"store features are {store.feature_dim}-d but the model expects {model_cfg.visual_dim}-d", path=cfg.features
        )
    features, mismatch = check_features(store, cfg.init, dist)
    model.uses_alignment = uses_alignment(cfg.alignment, model.arch)
    layout = dict(max_text_len=cfg.max_text_len, object_regions=cfg.object_regions, metadata_dir=metadata_dir)
    data = vcr_data(model, train, cfg.mode, store, tok, **layout, float16=float16, object_classes=classes,
                    flip_prob=cfg.flip_prob, seed=cfg.seed)
    extra = {"task": "vcr", "mode": cfg.mode, "head": "linear_on_pooled", "choice_loss": cfg.choice_loss, "join": model.join,
             "object_regions": cfg.object_regions, "alignment": model.uses_alignment, "features": features,
             **({"object_classes": classes} if classes else {})}
    final = finetune_loop(
        cfg, out=out, tokenizer=tok, model=model, model_cfg=model_cfg, data=data, device=device, dist=dist, extra=extra,
        collate=lambda items: collate_vcr(items, tok.pad_id, model.uses_alignment),
        loss=lambda b: vcr_losses(model, b, cfg.choice_loss, cfg.object_loss),
        count=lambda b: len(b.labels), label=f"fine-tune VCR {cfg.mode}", head_prefixes=model.head_prefixes,
        lengths=data.lengths() if cfg.length_group > 1 else None,
    )
    if final is None:
        return None
    metric = METRIC[cfg.mode]
    metrics: dict = {"mode": cfg.mode, "arch": model.arch, "object_regions": cfg.object_regions, "choice_loss": cfg.choice_loss,
                     "alignment": model.uses_alignment,
                     "train_questions": len(train), "steps": num_updates(cfg, len(data)),
                     **({"object_loss": cfg.object_loss, "object_classes": len(classes),
                         "object_head_from_pretraining": head_from_pretraining} if classes else {}),
                     "skipped_records": bad.to_dict(), **mismatch}
    if cfg.eval_file:
        preds = predict_vcr(model, vcr_data(model, evaluation, cfg.mode, store, tok, **layout),
                            batch_size=cfg.eval_batch_size, device=device, precision=cfg.precision, dist=dist)
        if dist.main:
            write_json(out / "predictions.json", {ex.annot_id: preds[ex.annot_id] for ex in evaluation}, indent=None)
        metrics["eval_questions"] = len(evaluation)
        if all_labelled(evaluation, lambda ex: ex.annotated):
            label = (lambda ex: ex.answer_label) if cfg.mode == "qa" else (lambda ex: ex.rationale_label)
            right = sum(1 for ex in evaluation if choose(preds[ex.annot_id]) == label(ex))
            metrics[metric] = 100.0 * right / len(evaluation)
            metrics["chance"] = CHANCE[metric]
    if dist.main:
        write_json(out / "metrics.json", metrics)
    barrier(dist)
    return final


# --------------------------------------------------------------------------- evaluate


def read_vcr_predictions(path: str | Path) -> dict[str, list[float]]:
    """A predictions file of this recipe: annot_id -> 4 scores."""
    data = read_json(path)
    if not isinstance(data, dict):
        raise VlbertsError("expected an object mapping annot_id to 4 scores", path=path)
    for annot_id, scores in data.items():
        if (not isinstance(scores, list) or len(scores) != 4
                or not all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s)
                           for s in scores)):
            raise VlbertsError(f"expected 4 finite numbers, got {scores!r}", path=path, record=annot_id)
    return data


def _labelled(annotations: str | Path) -> list[VCRExample]:
    examples = read_vcr(annotations, require_labels=True)
    if not examples:
        raise VlbertsError("no questions", path=annotations)
    return examples


def evaluate_vcr(annotations: str | Path, qa_predictions: str | Path, qar_predictions: str | Path) -> dict:
    """Q->A, QA->R and Q->AR accuracy (percent) of a Q->A and a QA->R predictions file on a labelled VCR
    jsonl file (`tasks.vcr.score_logits`: Q->AR = both argmaxes right), with chance levels."""
    examples = _labelled(annotations)
    if Path(qa_predictions).resolve() == Path(qar_predictions).resolve():
        raise VlbertsError("--qa and --qar name the same file; they take a --mode=qa and a --mode=qar run's "
                           "predictions", path=qa_predictions)
    for path, expected, option in ((qa_predictions, "qa", "--qa"), (qar_predictions, "qar", "--qar")):
        mode = _run_mode(path)
        if mode is not None and mode != expected:
            raise VlbertsError(f"this file comes from a --mode={mode} run ({Path(path).parent / 'metrics.json'}); "
                               f"{option} takes a --mode={expected} run's predictions (--qa and --qar swapped?)",
                               path=path)
    qa, qar = read_vcr_predictions(qa_predictions), read_vcr_predictions(qar_predictions)
    known = {ex.annot_id for ex in examples}
    for path, preds in ((qa_predictions, qa), (qar_predictions, qar)):
        unknown = [annot_id for annot_id in preds if annot_id not in known]
        if unknown:  # as the submission path (`read_submission`): a prediction for another file's question
            raise VlbertsError(f"annot_id {unknown[0]} is not a question of {annotations} ({len(unknown)} such); "
                               "expected predictions for its questions only", path=path, record=f"annot_id {unknown[0]}")
        missing = [ex.annot_id for ex in examples if ex.annot_id not in preds]
        if missing:
            raise VlbertsError(f"no prediction for {len(missing)} of {len(examples)} questions (first: {missing[0]})",
                               path=path, record=missing[0])
    scores = score_logits(qa, qar, examples)
    return {**scores.to_dict(), "chance": dict(CHANCE)}


def _run_mode(predictions: str | Path) -> str | None:
    """The --mode of the fine-tuning run that wrote `predictions` (its metrics.json beside it), or None when no
    such record is there (a file moved or written elsewhere: the scores cannot tell the two modes apart)."""
    record = Path(predictions).parent / "metrics.json"
    if not record.is_file():
        return None
    try:
        mode = read_json_object(record).get("mode")
    except VlbertsError:  # a damaged record says nothing about the file beside it
        return None
    return mode if mode in ("qa", "qar") else None


def evaluate_vcr_submission(annotations: str | Path, submission: str | Path) -> dict:
    """The same scores of a leaderboard submission CSV (`vlberts predict vcr`'s submission.csv), read as the
    leaderboard reads it: QA->R from the rationales conditioned on each question's gold answer."""
    examples = _labelled(annotations)
    rows = read_submission(submission, [ex.annot_id for ex in examples])
    return {**score_submission(rows, examples).to_dict(), "chance": dict(CHANCE)}


def config_from_args(args: list[str], base: dict | None = None) -> FinetuneVCRConfig:
    return apply_overrides(from_dict(FinetuneVCRConfig, base or {}), args)
