"""The `vlberts` command line.

Every command is a thin wrapper over a recipe or library function; heavy imports happen inside the
command so that `vlberts --help` is instant. Bad input raises `VlbertsError`, which `main` prints as one
line (`error: <file>: record <r>: <what>`) and turns into exit code 2.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from vlberts.errors import EXIT_BAD_INPUT, VlbertsError

app = typer.Typer(
    name="vlberts",
    help="Vision-and-language BERTs: build the embedded world, extract region features, pre-train, "
    "fine-tune, evaluate and analyse VisualBERT-family models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
world_app = typer.Typer(help="The embedded world: a seeded image-text world exported in the real data formats.", no_args_is_help=True)
features_app = typer.Typer(help="Region-feature stores: import existing feature files, inspect a store.", no_args_is_help=True)
finetune_app = typer.Typer(help="Fine-tune a pre-trained model on a downstream task.", no_args_is_help=True)
evaluate_app = typer.Typer(help="Score predictions with a task's official metric.", no_args_is_help=True)
analyze_app = typer.Typer(help="Look inside a model: attention-head grounding analysis.", no_args_is_help=True)
predict_app = typer.Typer(help="Answer a questions file with a fine-tuned model (plain inference).", no_args_is_help=True)
models_app = typer.Typer(help="The named model configurations, and released checkpoints imported as model directories.")
app.add_typer(world_app, name="world")
app.add_typer(features_app, name="features")
app.add_typer(finetune_app, name="finetune")
app.add_typer(evaluate_app, name="evaluate")
app.add_typer(analyze_app, name="analyze")
app.add_typer(predict_app, name="predict")
app.add_typer(models_app, name="models")

OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}


# --------------------------------------------------------------------------- world

@world_app.command("build")
def world_build(
    out: Path = typer.Option(..., help="Directory to write the world into."),
    images: int = typer.Option(1000, min=1, help="Number of images."),
    seed: int = typer.Option(0, help="Random seed; the same seed gives the same world."),
    image_size: int = typer.Option(128, min=64, max=4096, help="Image width and height in pixels."),
    overwrite: bool = typer.Option(False, help="Replace an existing non-empty OUT."),
    workers: Optional[int] = typer.Option(None, min=1, help="Worker processes (default: CPU count); the output does not depend on it."),
    referring: str = typer.Option("explicit", help="Captions name colour and shape always (explicit) or the fewest modifiers (minimal)."),
) -> None:
    """Generate images, captions with entities and parses, and VQA questions; export the real formats."""
    from vlberts.world.build import WorldConfig, build_world

    info = build_world(out, n_images=images, seed=seed, image_size=image_size, overwrite=overwrite, workers=workers,
                       config=WorldConfig(referring=referring))
    typer.echo(info.summary())


# --------------------------------------------------------------------------- features

class FeatureFormat(str, Enum):
    """Feature file formats the store imports from and exports to (vlberts.features.tsv.TSV_FORMATS)."""

    butd_tsv = "butd-tsv"
    lxmert_tsv = "lxmert-tsv"


class ImportFormat(str, Enum):
    """Feature file formats the store imports from (vlberts.features.importers.IMPORT_FORMATS)."""

    butd_tsv = "butd-tsv"
    lxmert_tsv = "lxmert-tsv"
    vlbert_json = "vlbert-json"
    vilbert_lmdb = "vilbert-lmdb"
    vilbert_cc_lmdb = "vilbert-cc-lmdb"
    ban_h5 = "ban-h5"
    visualbert_th = "visualbert-th"
    mmf_npy = "mmf-npy"


def _echo_store_written(out: Path) -> None:
    """The one line `features import` and `features extract` end with."""
    from vlberts.features.store import RegionStore

    with RegionStore(out) as store:
        info = store.info()
    typer.echo(
        f"wrote {out}: {info['num_images']} images, {info['num_boxes']} boxes, "
        f"{info['feature_dim']}-d {info['dtype']} features, fields {', '.join(info['fields'])}"
    )


@features_app.command("import")
def features_import(
    src: list[Path] = typer.Argument(..., help="The feature file (or the directory / zip of per-image files) to import; "
                                     "several of one format go into one store, e.g. LXMERT's train2014_obj36.tsv "
                                     "val2014_obj36.tsv."),
    format: ImportFormat = typer.Option(..., "--format", help="butd-tsv (6 fields), lxmert-tsv (10 fields), "
                                        "vlbert-json (per-image JSON), vilbert-lmdb (ViLBERT's feature LMDB), vilbert-cc-lmdb (ViLBERT's "
                                        "Conceptual Captions pre-training LMDB), ban-h5 (BAN's HDF5), "
                                        "visualbert-th (VisualBERT's Detectron .th, or a directory of .npz), mmf-npy (a directory of "
                                        "MMF / Pythia per-image .npy with their _info.npy, or ViLBERT's per-image .npy)."),
    out: Optional[Path] = typer.Option(None, help="The store (.h5) to write (or give --shards)."),
    shards: Optional[Path] = typer.Option(None, help="Instead of --out: write a shard set into this directory, with no store "
                                          "in between (vilbert-cc-lmdb: each image with its caption)."),
    shard_size: int = typer.Option(1000, "--shard-size", help="With --shards: samples per shard."),
    prefix: str = typer.Option("shard", help="With --shards: the shard set's name (PREFIX-000000.tar, PREFIX-index.json)."),
    ids: Optional[Path] = typer.Option(None, help="ban-h5 only: the {split}_imgid2idx.pkl of the .hdf5 (default: the "
                                                "one beside each file, so several splits import with their own)."),
    images: Optional[Path] = typer.Option(None, help="visualbert-th only: the folder of the images (or of folders of them, e.g. "
                                                      "NLVR2's), whose sizes the file does not hold."),
    captions: Optional[Path] = typer.Option(None, help="vilbert-cc-lmdb only: also write its captions here, as a COCO "
                                            "captions file for `vlberts pretrain --captions`."),
    float16: bool = typer.Option(False, "--float16", help="Store features as float16 (half the size)."),
    extractor: str = typer.Option("unknown", help="Name of the extractor that produced SRC, saved in the store."),
    classes: Optional[Path] = typer.Option(None, help="Object vocabulary (objects_vocab.txt) that objects_id indexes."),
    attributes: Optional[Path] = typer.Option(None, help="Attribute vocabulary (attributes_vocab.txt)."),
    overwrite: bool = typer.Option(False, help="Replace an existing OUT (only once the import has succeeded), or a shard "
                                   "set of the same prefix in --shards."),
) -> None:
    """Stream a feature file (or several) into a region store (or a shard set), one image at a time; a bad record
    leaves no store (no shard index) behind."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from vlberts.features.importers import import_features, read_vocab
    from vlberts.features.record import StoreMetadata

    if (out is None) == (shards is None):
        raise VlbertsError("give --out (a store) or --shards (a shard set's directory), not both" if out else
                           "give --out (the store to write) or --shards (a directory for a shard set)")

    meta = StoreMetadata(
        extractor=extractor,
        classes=None if classes is None else read_vocab(classes),
        attributes=None if attributes is None else read_vocab(attributes),
    )
    console = Console(stderr=True)
    size = sum(s.stat().st_size for s in src) if all(s.is_file() for s in src) else None
    columns = (TextColumn("importing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    # No bar when stderr is not a terminal (logs get the summary line only), unless VLBERTS_PROGRESS is set, as
    # for every other command's bars (`recipes.common.progress`): a scheduler's log of a long import.
    quiet = not console.is_terminal and not os.environ.get("VLBERTS_PROGRESS")
    with Progress(*columns, console=console, transient=console.is_terminal, disable=quiet) as bar:
        task = bar.add_task("import", total=size)
        common = dict(dtype="float16" if float16 else "float32", metadata=meta, overwrite=overwrite,
                      progress=lambda n: bar.advance(task, n), ids=ids, images=images)
        written = import_features(src, format.value, shards or out, captions_out=captions, shards=shards is not None,
                                  shard_size=shard_size, prefix=prefix, **common)
    if shards is not None:
        from vlberts.io import read_json

        obj = read_json(written)
        kinds = ", ".join(f"{k} {n}" for k, n in obj["kinds"].items() if n)
        typer.echo(f"wrote {written}: {obj['samples']} samples ({kinds}) in {len(obj['shards'])} shard(s) "
                   f"(vlberts pretrain --shards={written})")
        return
    _echo_store_written(out)
    if captions is not None:
        typer.echo(f"wrote {captions}: each image's caption, in the COCO captions format "
                   f"(vlberts pretrain --captions={captions} --features={out})")


@features_app.command("extract")
def features_extract(
    images: Path = typer.Option(..., help="Directory of images (.jpg, .jpeg, .png, .bmp, .webp); ids are the file stems."),
    weights: Path = typer.Option(..., help="torchvision Faster R-CNN ResNet-50 FPN (v1 or v2) weights (.pth/.safetensors)."),
    out: Path = typer.Option(..., help="The region store (.h5) to write."),
    classes: Optional[Path] = typer.Option(None, help="The detector's class names, one per line (background first, or without it)."),
    min_size: int = typer.Option(800, min=32, help="Resize each image's shorter side to this (torchvision's min_size) ..."),
    max_size: int = typer.Option(1333, min=32, help="... unless the longer side would exceed this."),
    proposals: int = typer.Option(1000, min=1, help="Region proposals per image after the RPN's NMS."),
    min_boxes: int = typer.Option(10, min=0, help="Keep at least this many boxes per image (BUTD MIN_BOXES)."),
    max_boxes: int = typer.Option(36, min=1, help="Keep at most this many boxes per image (BUTD MAX_BOXES)."),
    conf_thresh: float = typer.Option(0.2, min=0.0, max=1.0, help="Keep boxes whose best class score after per-class NMS reaches this."),
    nms: float = typer.Option(0.3, min=0.0, max=1.0, help="Per-class NMS IoU threshold of the box selection."),
    order: str = typer.Option("confidence", help="Kept boxes by confidence, or 'butd': proposal order between min and max."),
    float16: bool = typer.Option(False, "--float16", help="Store features and cls_prob as float16."),
    batch_images: int = typer.Option(2, min=1, help="Images per detector pass."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    overwrite: bool = typer.Option(False, help="Replace an existing OUT (only once extraction has succeeded)."),
    boxes: Optional[Path] = typer.Option(None, help="Describe these boxes instead of detecting: COCO instances "
                                         "(e.g. RefCOCO+'s instances.json, its ground-truth track) or a JSON "
                                         "{image id: [[x1, y1, x2, y2], ...]} in pixels; only its images are extracted."),
) -> None:
    """Detect and describe the regions of a folder of images with a torchvision Faster R-CNN (your weights)."""
    from vlberts.features.frcnn import DetectorSettings, extract_folder, image_files, read_given_boxes
    from vlberts.features.selection import SelectionConfig
    from vlberts.recipes.common import progress, resolve_device, set_threads

    set_threads()
    selection = SelectionConfig(conf_thresh=conf_thresh, min_boxes=min_boxes, max_boxes=max_boxes, nms=nms, order=order)
    done: list[tuple[float, int]] = []  # (time, images) as each detector pass ends

    def advance(n: int) -> None:
        done.append((time.perf_counter(), n))
        bar.advance(task, n)

    start = time.perf_counter()
    with progress() as bar:
        task = bar.add_task("extract", total=len(read_given_boxes(boxes)) if boxes else len(image_files(images)))
        extract_folder(images, weights, out, selection=selection, boxes=boxes,
                       settings=DetectorSettings(min_size=min_size, max_size=max_size, proposals=proposals),
                       dtype="float16" if float16 else "float32", classes=classes,
                       batch_images=batch_images, device=resolve_device(device), overwrite=overwrite,
                       progress=advance)
    _echo_store_written(out)
    # The first pass carries the model's loading (and CUDA's start, its kernels' first runs): the rate after
    # it is what a large folder runs at.
    rate = ""
    if len(done) > 1 and done[-1][0] > done[0][0]:
        rate = f", {sum(n for _, n in done[1:]) / (done[-1][0] - done[0][0]):.1f} images/s after the first pass"
    typer.echo(f"extracted {sum(n for _, n in done)} images in {time.perf_counter() - start:.1f} s{rate}")


@features_app.command("info")
def features_info(store: Path = typer.Argument(..., help="A region store (.h5).")) -> None:
    """Print a JSON summary of a store: images, boxes per image, width, dtype, fields, extractor."""
    import json

    from vlberts.features.store import RegionStore

    with RegionStore(store) as s:
        typer.echo(json.dumps(s.info(), indent=2))


@features_app.command("export")
def features_export(
    store: Path = typer.Argument(..., help="A region store (.h5)."),
    format: FeatureFormat = typer.Option(..., "--format", help="butd-tsv (integer ids) or lxmert-tsv (needs objects)."),
    out: Path = typer.Option(..., help="The TSV file to write."),
    zero_missing_attrs: bool = typer.Option(False, help="lxmert-tsv: write zero attributes when the store has none."),
    overwrite: bool = typer.Option(False, help="Replace an existing OUT (never the store itself)."),
) -> None:
    """Write a store as a BUTD or LXMERT TSV (features as float32)."""
    from vlberts.features.importers import export_tsv

    n = export_tsv(store, out, format.value, zero_missing_attrs=zero_missing_attrs, overwrite=overwrite)
    typer.echo(f"wrote {out}: {n} images as {format.value}")


# --------------------------------------------------------------------------- extract

@app.command("extract")
def extract(
    world: Path = typer.Option(..., help="World directory (scenes.jsonl, world.json, images/)."),
    out: Path = typer.Option(..., help="The region store (.h5) to write."),
    tsv: bool = typer.Option(False, "--tsv", help="Also write OUT-stem.butd.tsv (6 fields) and OUT-stem.lxmert.tsv (10 fields)."),
    detector: Optional[Path] = typer.Option(None, help="Load these world-detector weights (.safetensors + .json) instead of training."),
    float16: bool = typer.Option(False, "--float16", help="Store features and cls_prob as float16."),
    min_boxes: int = typer.Option(10, min=0, help="Keep at least this many boxes per image (BUTD MIN_BOXES)."),
    max_boxes: int = typer.Option(36, min=1, help="Keep at most this many boxes per image (BUTD MAX_BOXES)."),
    conf_thresh: float = typer.Option(0.2, min=0.0, max=1.0, help="Keep boxes whose max class confidence after NMS reaches this."),
    nms: float = typer.Option(0.3, min=0.0, max=1.0, help="Per-class NMS IoU threshold (BUTD cfg.TEST.NMS)."),
    feature_dim: int = typer.Option(0, min=0, help="Region-feature width of a trained detector (0: 128; a loaded one keeps its own)."),
    order: str = typer.Option("confidence", help="Kept boxes by confidence, or 'butd': RoI order between min and max boxes."),
    seed: int = typer.Option(0, help="Seed of detector training and proposals."),
    epochs: int = typer.Option(3, min=1, help="Detector training epochs over the train split."),
    max_steps: int = typer.Option(900, min=1, help="Cap on detector updates (keeps big worlds within about a minute)."),
    batch_images: int = typer.Option(64, min=1, help="Images per backbone pass during extraction."),
    overwrite: bool = typer.Option(False, help="Replace an existing OUT (only once extraction has succeeded)."),
    boxes: str = typer.Option("detected", help="detected: proposals after box selection; gold: exactly the world's "
                                               "object boxes (RefCOCO+'s ground-truth regions; pass --detector)."),
) -> None:
    """Train the world detector (or load one) and extract region features for every world image."""
    import os

    # Before torch loads OpenMP (libgomp): idle threads spin only briefly, then sleep. The detector's
    # many small ops (8-image steps) otherwise slow down 10x when another process shares the cores
    # (measured on 2 cores: 156 s instead of 13 s for a tiny-world run beside another training job),
    # while a short spin keeps the quiet-machine speed (fully passive waiting cost 15-20 %).
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "1000")
    from vlberts.recipes.extract import ExtractConfig
    from vlberts.recipes.extract import extract as run_extract

    cfg = ExtractConfig(
        world=str(world), out=str(out), detector=str(detector or ""), tsv=tsv, float16=float16, min_boxes=min_boxes,
        max_boxes=max_boxes, conf_thresh=conf_thresh, nms=nms, order=order, feature_dim=feature_dim, seed=seed,
        epochs=epochs, max_steps=max_steps, batch_images=batch_images, overwrite=overwrite, boxes=boxes,
    )
    typer.echo(run_extract(cfg).summary())


# --------------------------------------------------------------------------- run-config commands

_RUN_LOCKS: list = []  # run directories this process holds (`io.lock_run_directory`), released when `main` ends


def _run_config(recipe_module, ctx: typer.Context, config: Optional[Path], *, training_run: bool = False):
    """The recipe's typed run config from an optional YAML file plus `--key=value` overrides. A training run
    (pretrain, finetune) takes its --out for this process first (rank 0 under torchrun: the one that writes)."""
    from vlberts.config import load_yaml, to_dict
    from vlberts.io import lock_run_directory

    base = to_dict(load_yaml(recipe_module.CONFIG_CLASS, config)) if config else None
    cfg = recipe_module.config_from_args(list(ctx.args), base)
    if training_run and cfg.out and os.environ.get("RANK", "0") == "0":
        _RUN_LOCKS.append(lock_run_directory(cfg.out))
    return cfg


CONFIG_OPTION = typer.Option(None, "--config", help="YAML file with settings; --key=value flags override it.")


@app.command("pretrain", context_settings=OVERRIDES)
def pretrain_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Pre-train any architecture (--model) with its paper's objectives, e.g. VisualBERT: MLM with the
    image + sentence-image prediction; --objectives=mlm=1,match=0.5 picks and weighs them.

    Reads COCO-format captions and a region store (VisualBERT App. A.3). Started again on the same
    --out, it resumes from RUN/checkpoints exactly.

    Example: vlberts pretrain --captions=WORLD/annotations/captions_train.json --features=F.h5 --out=runs/pt

    Run `vlberts show-config pretrain` for every setting.
    """
    from vlberts.recipes import pretrain as recipe

    cfg = _run_config(recipe, ctx, config, training_run=True)
    final = recipe.pretrain(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 reports
        typer.echo(_stopped_early(cfg.out) if final is None else f"wrote {final}")


@finetune_app.command("vqa", context_settings=OVERRIDES)
def finetune_vqa_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Fine-tune on VQA v2 files, then predict and score with the official metric.

    The answer vocabulary comes from the training answers; targets are soft scores; the loss is BCE.
    Any pre-trained architecture: --init's config.json picks its paper's answer head (VisualBERT and
    VL-BERT the [MASK] slot, ViLBERT h_IMG * h_CLS, LXMERT and W-VisualBERT the pooled output).

    Example: vlberts finetune vqa --init=runs/pt/model --features=F.h5 --train_questions=Q.json
    --train_annotations=A.json --eval_questions=QT.json --eval_annotations=AT.json --out=runs/vqa

    Run `vlberts show-config finetune-vqa` for every setting.
    """
    from vlberts.recipes import finetune_vqa as recipe

    cfg = _run_config(recipe, ctx, config, training_run=True)
    _report_finetune(cfg.out, recipe.finetune_vqa(cfg), _qa_lines("VQA"), "predictions.json")


def _predict(task: str, ctx: typer.Context, config: Optional[Path]) -> None:
    import importlib

    recipe = importlib.import_module(SHOW[f"predict-{task}"])
    cfg = _run_config(recipe, ctx, config)
    path = recipe.predict_file(cfg, task) if task in ("vqa", "gqa") else recipe.predict_file(cfg)
    if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 writes and reports
        typer.echo(f"wrote {path} and {path.with_name('predict.json')}")


@predict_app.command("vqa", context_settings=OVERRIDES)
def predict_vqa_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Answer a VQA v2 questions file (answers not needed: test-dev, test-std) with a fine-tuned VQA model;
    writes OUT/predictions.json in the official results format. Score it with `vlberts evaluate vqa`.

    Example: vlberts predict vqa --model=runs/vqa/model --questions=Q.json --features=F.h5 --out=runs/testdev

    Run `vlberts show-config predict-vqa` for every setting.
    """
    _predict("vqa", ctx, config)


@predict_app.command("gqa", context_settings=OVERRIDES)
def predict_gqa_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Answer a GQA questions file with a fine-tuned GQA model; writes OUT/predictions.json in the official
    results format ([{questionId, prediction}]). Score it with `vlberts evaluate gqa`.

    Run `vlberts show-config predict-gqa` for every setting.
    """
    _predict("gqa", ctx, config)


@predict_app.command("nlvr2", context_settings=OVERRIDES)
def predict_nlvr2_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Label an NLVR2 statements file (labels not needed: the hidden test2) with a fine-tuned NLVR2 model;
    writes OUT/predictions.csv in the official format (identifier,True|False). Score it with
    `vlberts evaluate nlvr2`.

    Example: vlberts predict nlvr2 --model=runs/nlvr2/model --statements=WORLD/nlvr2/test1.json
    --image_map=WORLD/nlvr2/images.json --features=F.h5 --out=runs/nlvr2_test1

    Run `vlberts show-config predict-nlvr2` for every setting.
    """
    _predict("nlvr2", ctx, config)


@predict_app.command("vcr", context_settings=OVERRIDES)
def predict_vcr_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Score a VCR jsonl file (labels not needed: test.jsonl) with a fine-tuned Q->A and a fine-tuned QA->R
    model; writes OUT/submission.csv, the leaderboard's file (the answers' scores and the rationales' scores
    conditioned on each of the 4 answers). Score it with `vlberts evaluate vcr --submission`.

    Example: vlberts predict vcr --qa_model=runs/vcr_qa/model --qar_model=runs/vcr_qar/model
    --questions=WORLD/vcr/test.jsonl --features=F.h5 --out=runs/vcr_test

    Run `vlberts show-config predict-vcr` for every setting.
    """
    _predict("vcr", ctx, config)


@finetune_app.command("gqa", context_settings=OVERRIDES)
def finetune_gqa_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Fine-tune on GQA balanced questions files, then predict and score with exact-match accuracy.

    The answer classes are the training answers; the target is the gold answer's class (LXMERT's
    {answer: 1.0}); the answer head and loss are the architecture's, from --init's config.json, as for VQA.

    Example: vlberts finetune gqa --init=runs/pt/model --features=F.h5
    --train_questions=WORLD/gqa/train_balanced_questions.json
    --eval_questions=WORLD/gqa/testdev_balanced_questions.json --out=runs/gqa

    Run `vlberts show-config finetune-gqa` for every setting.
    """
    from vlberts.recipes import finetune_gqa as recipe

    cfg = _run_config(recipe, ctx, config, training_run=True)
    _report_finetune(cfg.out, recipe.finetune_gqa(cfg), _qa_lines("GQA"), "predictions.json")


@finetune_app.command("vcr", context_settings=OVERRIDES)
def finetune_vcr_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Fine-tune on VCR jsonl files, Q->A (--mode=qa) or QA->R (--mode=qar), then predict and score.

    Each question's 4 choices are 4 sequences `[CLS] context [SEP] choice [SEP]` with the question's object
    regions, scored by a linear layer on the pooled output (ViLBERT: h_IMG * h_CLS), softmax cross-entropy
    over the 4; QA->R reads the question with the right answer. Combine the two runs' predictions with
    `vlberts evaluate vcr` for Q->AR.

    Example: vlberts finetune vcr --mode=qa --init=runs/pt/model --features=F.h5
    --train_file=WORLD/vcr/train.jsonl --eval_file=WORLD/vcr/val.jsonl --out=runs/vcr_qa

    Run `vlberts show-config finetune-vcr` for every setting.
    """
    from vlberts.recipes import finetune_vcr as recipe

    cfg = _run_config(recipe, ctx, config, training_run=True)
    _report_finetune(cfg.out, recipe.finetune_vcr(cfg), lambda m: [
        f"VCR {name} accuracy {m[key]:.2f}% on {m['eval_questions']} questions (chance {m['chance']:.0f}%)"
        for key, name in (("q2a", "Q->A"), ("qa2r", "QA->R")) if key in m
    ], "predictions.json")


@finetune_app.command("refcoco", context_settings=OVERRIDES)
def finetune_refcoco_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Fine-tune on RefCOCO+ (refs + COCO instances), then predict and score val, testA and testB.

    Every candidate region (the store's regions: detections, or with --track=gt the instance boxes of a
    `vlberts extract --boxes gold` store) gets a score from its final visual state (ViLBERT's linear
    layer, VL-BERT's MLP), trained with BCE on IoU >= 0.5 targets (--soft_iou: IoU itself); the top region
    is correct at IoU >= 0.5. Reports the upper bound and the highest-confidence-region baseline too.

    Example: vlberts finetune refcoco --init=runs/pt/model --features=F.h5 --out=runs/refcoco
    --refs='WORLD/refcoco+/refs(unc).p' --instances=WORLD/refcoco+/instances.json

    Run `vlberts show-config finetune-refcoco` for every setting.
    """
    from vlberts.recipes import finetune_refcoco as recipe

    cfg = _run_config(recipe, ctx, config, training_run=True)
    _report_finetune(cfg.out, recipe.finetune_refcoco(cfg), lambda m: [
        f"RefCOCO+ {split} accuracy {r['accuracy']:.2f}% on {r['num_expressions']} expressions (upper bound "
        f"{r['upper_bound']:.2f}%" + (f", highest-confidence baseline {r['confidence_baseline']:.2f}%)"
                                      if "confidence_baseline" in r else ")")
        for split, r in m["splits"].items()
    ], "predictions.json")


@finetune_app.command("flickr_entities", context_settings=OVERRIDES)
def finetune_flickr_entities_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Fine-tune Flickr30K Entities phrase grounding, then predict and score val and test (R@1/5/10).

    VisualBERT App. B.4: an extra attention block on the encoder; the head-averaged attention from a
    phrase's last subword ranks the image's regions (the store's). Targets: regions with IoU >= 0.5 to any
    gold box of the chain (--iou_rule=union: their union box). Reports the upper bound and the
    detector-confidence baseline too.

    Example: vlberts finetune flickr_entities --init=runs/pt/model --entities=WORLD/flickr30k_entities
    --features=F.h5 --out=runs/flickr_entities

    Run `vlberts show-config finetune-flickr-entities` for every setting.
    """
    from vlberts.recipes import finetune_flickr_entities as recipe

    cfg = _run_config(recipe, ctx, config, training_run=True)
    _report_finetune(cfg.out, recipe.finetune_flickr_entities(cfg), lambda m: [
        _flickr_entities_line(split, r) for split, r in m["splits"].items()], "predictions.json")


def _flickr_entities_line(split: str, r: dict) -> str:
    """Flickr30K Entities R@1/5/10 of a split, with the upper bound and the confidence baseline when known."""
    extra = [f"upper bound {r['upper_bound']:.2f}%"] if "upper_bound" in r else []
    if "baseline" in r:
        b = r["baseline"]
        extra.append(f"detector-confidence baseline {b['r@1']:.2f}/{b['r@5']:.2f}/{b['r@10']:.2f}")
    return (f"Flickr30K Entities {split} R@1/5/10 {r['r@1']:.2f}/{r['r@5']:.2f}/{r['r@10']:.2f} on "
            f"{r['num_entities']} phrases" + (f" ({', '.join(extra)})" if extra else ""))


@finetune_app.command("nlvr2", context_settings=OVERRIDES)
def finetune_nlvr2_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Fine-tune on NLVR2 statements (JSON lines), then predict and score accuracy and consistency.

    --encoding=pair (LXMERT, the default except for VisualBERT): the statement is encoded with each image
    and the two pooled outputs are concatenated into Linear-GeLU-LayerNorm-Linear; --encoding=joint
    (VisualBERT only, its default): both images' regions in one sequence, a segment per image. Image
    names (split-setid-pairid-img0/1) are the store's keys, or mapped by --image_map (the world's
    nlvr2/images.json).

    Example: vlberts finetune nlvr2 --init=runs/pt/model --features=F.h5 --out=runs/nlvr2
    --train_statements=WORLD/nlvr2/train.json --eval_statements=WORLD/nlvr2/test1.json
    --image_map=WORLD/nlvr2/images.json

    Run `vlberts show-config finetune-nlvr2` for every setting.
    """
    from vlberts.recipes import finetune_nlvr2 as recipe

    cfg = _run_config(recipe, ctx, config, training_run=True)
    _report_finetune(cfg.out, recipe.finetune_nlvr2(cfg), lambda m: [
        f"NLVR2 accuracy {m['accuracy']:.2f}%, consistency {m['consistency']:.2f}% on {m['num_examples']} examples "
        f"(majority baseline {m['majority_baseline']:.2f}%, {m['majority_baseline_consistency']:.2f}%)"
    ] if "accuracy" in m else [], "predictions.csv")


@finetune_app.command("retrieval", context_settings=OVERRIDES)
def finetune_retrieval_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Fine-tune image-text retrieval 4-way (ViLBERT §4), then rank every eval caption against every eval image.

    Each training caption gives four pairs: the positive, a random caption, a random image and a hard
    negative among the image's --hard_negatives nearest images; softmax cross-entropy over their scores.
    Reports R@1/5/10 both directions next to chance; writes RUN/scores.npy and RUN/metrics.json.

    Example: vlberts finetune retrieval --init=runs/pt/model --features=F.h5
    --split_file=WORLD/dataset_world.json --out=runs/retrieval

    Run `vlberts show-config finetune-retrieval` for every setting.
    """
    from vlberts.recipes import finetune_retrieval as recipe

    cfg = _run_config(recipe, ctx, config, training_run=True)
    _report_finetune(cfg.out, recipe.finetune_retrieval(cfg), _retrieval_lines, "scores.npy")


def _retrieval_lines(m: dict) -> list[str]:
    """Retrieval metrics, both directions, next to the chance baseline."""
    if "text_to_image" not in m:
        return []
    lines = []
    for d, name in (("text_to_image", "text->image"), ("image_to_text", "image->text")):
        r, c = m[d], m["chance"][d]
        lines.append(f"{name} R@1/5/10 {r['r1']:.2f}/{r['r5']:.2f}/{r['r10']:.2f} medr {r['medr']:g} meanr "
                   f"{r['meanr']:.1f} (chance {c['r1']:.2f}/{c['r5']:.2f}/{c['r10']:.2f}) on {m['num_captions']} "
                   f"captions x {m['num_images']} images")
    return lines


def _qa_lines(task: str) -> Callable[[dict], list[str]]:
    """VQA/GQA: accuracy vs the majority-answer baseline."""
    return lambda m: [f"{task} accuracy {m['accuracy']:.2f}% on {m['num_questions']} questions "
                      f"(majority-answer baseline {m['majority_baseline']:.2f}%)"] if "accuracy" in m else []


def _report_finetune(out: str, final: Optional[Path], lines: Callable[[dict], list[str]], written: str = "") -> None:
    """The closing lines of a fine-tuning command (rank 0 only under torchrun): the task's numbers from
    OUT/metrics.json (`lines`), and what was written (the model, OUT/`written` if the run wrote it: a run
    without evaluation questions writes no predictions, metrics.json)."""
    from vlberts.io import read_json

    if os.environ.get("RANK", "0") != "0":
        return
    if final is None:
        typer.echo(_stopped_early(out))
        return
    for line in lines(read_json(Path(out) / "metrics.json")):
        typer.echo(line)
    files = [str(final), *([str(Path(out) / written)] if written and (Path(out) / written).is_file() else []),
             str(Path(out) / "metrics.json")]
    typer.echo(f"wrote {', '.join(files[:-1])} and {files[-1]}")


@analyze_app.command("grounding", context_settings=OVERRIDES)
def analyze_grounding_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Entity and syntactic grounding by attention heads ("What Does BERT with Vision Look At?" §3.1,
    Fig. 3, Table 2, Fig. 4).

    Per-head accuracy at IoU >= 0.5 against Flickr30K Entities boxes, the most-confident-region
    baseline, active heads, the best-heads table and the figure; with dependency parses
    (--parses=auto finds the world's, or --parses=FILE.conllu, or --parser=spacy:PIPELINE with spaCy
    installed) also Table 2 and Figure 4. `--mask_pos=ADJ` (a diagnostic) masks the words of those
    parts of speech first, to see where a word looks when it has to be predicted. With parses it also
    reads the same arcs among the words (Clark et al., 2019): does a head find the other word in the text?

    Example: vlberts analyze grounding --model=runs/pt/model --entities=WORLD/flickr30k_entities
    --features=F.h5 --split=test --out=runs/grounding

    Run `vlberts show-config analyze-grounding` for every setting and its documented default.
    """
    from vlberts.analysis.report import percent
    from vlberts.analysis.syntactic import DIRECTIONS, direction_key
    from vlberts.recipes import analyze_grounding as recipe

    cfg = _run_config(recipe, ctx, config)
    rep = recipe.analyze_grounding(cfg)
    r = rep.result
    if rep.mask_note:
        typer.echo(f"inputs: {rep.mask_note}")
    typer.echo(f"{r.n_entities} entities in {r.n_captions} captions; best head {r.best_head.label} "
               f"{100 * r.best_head.accuracy:.2f}%, baseline {percent(r.baseline_accuracy)}, "
               f"upper bound {100 * r.upper_bound:.2f}%, best layer {r.best_layer + 1} of {r.num_layers}")
    if rep.syntactic is None:
        typer.echo(rep.syntactic_note)
    else:
        s = rep.syntactic
        typer.echo("; ".join([f"syntactic grounding: {s.n_instances} arc instances in {s.n_captions} captions",
                              *(f"{row.relation} {100 * row.head.accuracy:.2f}% ({row.head.label}, baseline "
                                f"{percent(row.baseline)})" for row in s.table2(3)),
                              *([f"skipped captions: {s.skipped}"] if s.skipped else [])]))
        parts = []
        for key in (direction_key(rel, d) for rel in ("pobj", "nsubj", "amod") for d in DIRECTIONS):
            if (r := rep.text_syntax.rows.get(key)) is not None:
                layer, head, acc = r.best()
                parts.append(f"{key} {100 * acc:.2f}% ({layer}-{head}; {r.offset:+d}: {100 * r.offset_accuracy:.2f}%)")
        if parts:
            typer.echo("syntactic heads among the words (best head; best fixed offset): " + "; ".join(parts))
    typer.echo(f"wrote {', '.join(str(p) for p in rep.paths.values())}")


@analyze_app.command("representations", context_settings=OVERRIDES)
def analyze_representations_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """Word, region and tag representations by class in t-SNE (W-VisualBERT §5, Figure 2).

    Instances are grounded phrases whose head word is a detector class and whose box a region of that
    class detects; the final states of the word, the region and (W-VisualBERT) the tag are drawn
    together, and the share of words whose nearest region has their class is reported (and the same
    for every pair of kinds: a region's nearest other region, a word's nearest tag, ...).

    Example: vlberts analyze representations --model=runs/pt/model --entities=WORLD/flickr30k_entities
    --features=F.h5 --out=runs/representations

    Run `vlberts show-config analyze-representations` for every setting.
    """
    from vlberts.recipes import analyze_representations as recipe

    cfg = _run_config(recipe, ctx, config)
    rep = recipe.analyze_representations(cfg)
    counts = ", ".join(f"{rep.reps.modalities.count(m)} {m}s" for m in ("word", "region", "tag") if m in rep.reps.modalities)
    if rep.space != "final states":
        typer.echo(f"drawn in {rep.space}")
    typer.echo(f"{len(set(rep.reps.instances))} instances of {len(set(rep.reps.classes))} classes ({counts}); "
               f"a word's nearest region has its class {rep.agreement:.2f}% of the time (chance {rep.chance:.2f}%)")
    typer.echo("nearest representation of the same class, % (chance), from each kind to each kind (itself left out):")
    for query, row in rep.table.items():
        typer.echo(f"  {query + 's':8s} -> " + ", ".join(f"{k}s {a:.2f} ({c:.2f})" for k, (a, c) in row.items()))
    typer.echo(f"wrote {', '.join(str(p) for p in rep.paths.values())}")


@analyze_app.command("attention-graphs", context_settings=OVERRIDES)
def analyze_attention_graphs_cmd(ctx: typer.Context, config: Optional[Path] = CONFIG_OPTION) -> None:
    """LXMERT-style attention graphs (LXMERT App. E, Figs. 3-5) for any architecture.

    Words -> words: attention to the next / previous token per head against uniform; regions -> words:
    share of a region's attention per POS tag against the tag's share of the tokens (with parses);
    regions -> regions: how often the most attended other region is a related object (with the world's
    scenes). Figures for a few captions; the report names the maps read for the architecture.

    Example: vlberts analyze attention-graphs --model=runs/pt/model --entities=WORLD/flickr30k_entities
    --features=F.h5 --out=runs/attention_graphs

    Run `vlberts show-config analyze-attention-graphs` for every setting.
    """
    from vlberts.recipes import analyze_attention_graphs as recipe

    cfg = _run_config(recipe, ctx, config)
    rep = recipe.analyze_attention_graphs(cfg)
    typer.echo(recipe.summary_line(rep.data))
    typer.echo(f"wrote {', '.join(str(p) for p in rep.paths.values())}")


@app.command("demo", context_settings=OVERRIDES)
def demo_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(Path("runs/demo"), help="Output directory (replaced if it holds an earlier demo; an unfinished one with the same settings is continued, see --resume)."),
    quick: bool = typer.Option(False, "--quick", help="Smaller world and schedules: a smoke test in under 3 minutes."),
    seed: int = typer.Option(0, help="Seed of everything."),
) -> None:
    """The main job on a fresh embedded world, end to end (what `make demo` runs).

    world -> region features -> VisualBERT pre-training -> visual-word probe -> VQA -> entity
    grounding; writes OUT/report.html and OUT/summary.json.

    Further settings as --key=value; run `vlberts show-config demo` for them.
    """
    from vlberts.config import flag_names, parse_overrides
    from vlberts.recipes import demo as recipe

    extra = list(ctx.args)
    cfg = recipe.config_from_args([f"--out={out}", f"--quick={quick}", f"--seed={seed}", *extra])
    cfg = recipe.resolve(cfg, explicit=set(parse_overrides(extra, flag_names(type(cfg)))))
    s = recipe.run_demo(cfg, log=lambda m: typer.echo(m, err=True))
    typer.echo(recipe.format_summary(s, out))


@app.command("compare", context_settings=OVERRIDES)
def compare_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(Path("runs/compare"), help="Output directory (replaced if it holds an earlier demo or compare; an unfinished comparison with the same settings is continued, see --resume)."),
    quick: bool = typer.Option(False, "--quick", help="The demo's smaller world and schedules."),
    archs: Optional[str] = typer.Option(None, help="Comma-separated architectures (default: all five)."),
) -> None:
    """A controlled comparison: the architectures on one world, one feature store and one schedule.

    Builds the world and region features once, then runs the demo's pre-training -> visual-word probe
    -> VQA -> entity grounding for each architecture (its ARCH-small, its paper's objectives) with the
    same settings, in OUT/ARCH/ (and GQA fine-tuning with --tasks=vqa,gqa; --seeds=3 runs each
    architecture with 3 seeds and reports mean ± std); writes OUT/results.json and OUT/results.md and
    prints the table.

    Example: vlberts compare --archs=visualbert,lxmert --tasks=vqa,gqa --seeds=2 --out=runs/compare --quick

    Further settings (the demo's) as --key=value; run `vlberts show-config compare` for them.
    """
    from vlberts.config import flag_names, parse_overrides
    from vlberts.recipes import compare as recipe
    from vlberts.recipes.demo import resolve

    extra = list(ctx.args)
    given = [f"--archs={archs}"] if archs is not None else []
    cfg = recipe.config_from_args([f"--out={out}", f"--quick={quick}", *given, *extra])
    cfg = resolve(cfg, explicit=set(parse_overrides(extra, flag_names(type(cfg)))))
    result = recipe.run_compare(cfg, log=lambda m: typer.echo(m, err=True))
    typer.echo(recipe.markdown_table(result))
    typer.echo(f"wrote {out / recipe.RESULTS_MD} and {out / recipe.RESULTS_JSON}; per architecture: {out}/ARCH/report.html")


SHOW = {
    "pretrain": "vlberts.recipes.pretrain",
    "finetune-vqa": "vlberts.recipes.finetune_vqa",
    "finetune-gqa": "vlberts.recipes.finetune_gqa",
    "finetune-retrieval": "vlberts.recipes.finetune_retrieval",
    "finetune-refcoco": "vlberts.recipes.finetune_refcoco",
    "finetune-flickr-entities": "vlberts.recipes.finetune_flickr_entities",
    "finetune-nlvr2": "vlberts.recipes.finetune_nlvr2",
    "finetune-vcr": "vlberts.recipes.finetune_vcr",
    "predict-vqa": "vlberts.recipes.predict_qa",
    "predict-gqa": "vlberts.recipes.predict_qa",
    "predict-nlvr2": "vlberts.recipes.predict_nlvr2",
    "predict-vcr": "vlberts.recipes.predict_vcr",
    "analyze-grounding": "vlberts.recipes.analyze_grounding",
    "analyze-representations": "vlberts.recipes.analyze_representations",
    "analyze-attention-graphs": "vlberts.recipes.analyze_attention_graphs",
    "demo": "vlberts.recipes.demo",
    "compare": "vlberts.recipes.compare",
    "extract": "vlberts.recipes.extract",
}


@app.command("show-config")
def show_config(words: list[str] = typer.Argument(..., metavar="COMMAND",
                                                 help=f"One of: {', '.join(SHOW)} (or as typed: finetune vqa).")) -> None:
    """Print every setting of a command with its default and meaning."""
    import importlib

    from vlberts.recipes.common import field_help

    command = "-".join(words).replace("_", "-")  # `finetune vqa`, `finetune-vqa`, `analyze grounding`
    if command not in SHOW:
        raise VlbertsError(f"unknown command {command!r}; valid: {', '.join(SHOW)}")
    module = importlib.import_module(SHOW[command])
    typer.echo(field_help(module.CONFIG_CLASS).replace("\n\n", "\n"))


@models_app.callback(invoke_without_command=True)
def models_cmd(ctx: typer.Context) -> None:
    """List the named model configurations (for --model); `vlberts models import` converts a released checkpoint."""
    if ctx.invoked_subcommand is not None:
        return
    from vlberts.models.builders import MODEL_CONFIGS, model_config

    for name in MODEL_CONFIGS:
        c = model_config(name)
        typer.echo(f"{name:27s} {c.describe()}")
    typer.echo("(visual_dim is set from the feature store when a run builds the model)")


@models_app.command("import")
def models_import(
    src: Path = typer.Argument(..., help="The released checkpoint: a directory (hf-*) or a weights file (visualbert, "
                               "lxmert, vilbert, vlbert)."),
    format: str = typer.Option(..., "--format", help="hf-visualbert, hf-lxmert (Hugging Face save_pretrained "
                               "directories), visualbert (uclanlp/visualbert .th), lxmert (airsplay/lxmert *_LXRT.pth), "
                               "vilbert (vilbert-multi-task .bin), vlbert (VL-BERT .model)."),
    out: Path = typer.Option(..., help="The vlberts model directory to write."),
    vocab: Optional[Path] = typer.Option(None, help="The BERT vocab.txt the checkpoint was trained with (default: "
                                         "one beside SRC)."),
    config: Optional[Path] = typer.Option(None, help="A JSON file. vilbert: the original JSON config of the weights "
                                          "(default: the released base config, 6 co-attention layers); vlbert: an "
                                          "object of settings to change from vlbert-base, e.g. a file holding "
                                          "{\"num_region_classes\": 81}; visualbert / lxmert: an object of Hugging "
                                          "Face VisualBertConfig / LxmertConfig settings to change from those read off "
                                          "the weights, e.g. a file holding {\"num_attention_heads\": 12}."),
    qa_answers: Optional[Path] = typer.Option(None, "--qa_answers", help="lxmert / hf-lxmert: the answers of the QA head's rows, in order "
                                              "(LXMERT's all_ans.json), so that VQA/GQA fine-tuning starts from the "
                                              "head (LXMERT's --loadLXMERTQA)."),
    overwrite: bool = typer.Option(False, help="Replace an existing OUT (once the new one is complete)."),
) -> None:
    """Write a released checkpoint as a vlberts model directory, for every command that takes a model
    (`analyze grounding --model`, `finetune TASK --init`, `pretrain --init`).

    Example: vlberts models import visualbert-coco-pre/ --format hf-visualbert --vocab bert-base-uncased/vocab.txt
    --out models/visualbert-coco
    """
    from vlberts.models.builders import arch_of
    from vlberts.models.importing import import_model

    model, path = import_model(src, format, out, vocab=vocab, config=config, qa_answers=qa_answers, overwrite=overwrite)
    if getattr(model, "left_out_head", None):
        typer.echo(f"left out: {model.left_out_head} (no place for it in the pre-training model; config.json's "
                   "left_out)")
    n = sum(p.numel() for p in model.parameters())
    typer.echo(f"imported {src} ({format}) as {arch_of(model.cfg)}, {model.cfg.describe()}, {n / 1e6:.1f}M "
               f"parameters: wrote {path}")


# --------------------------------------------------------------------------- evaluate

def _record_options(ctx: typer.Context) -> None:
    """OUT/run_config.json of an evaluate command that has no config dataclass (nothing without --out): its
    options as given, named as on the command line (`io.write_run_config`, which loads no torch: these
    scoring commands never need it). Called once the predictions are scored, so that a bad input file
    leaves no OUT behind (scoring takes seconds: there is no long run to record before)."""
    from vlberts.io import write_run_config

    out = ctx.params.get("out")
    if out is not None:
        write_run_config(out, {p.name: ctx.params[p.name] for p in ctx.command.params if p.name in ctx.params})


def _write_metrics(out: Path, metrics: dict, lines: list[str]) -> None:
    """The end of an evaluate command: OUT/metrics.json, the score lines, what was written."""
    from vlberts.io import write_json

    write_json(out / "metrics.json", metrics)
    for line in lines:
        typer.echo(line)
    typer.echo(f"wrote {out / 'metrics.json'}")


# evaluate vqa / gqa: the questions finetune's --exclude_images left out, left out again
EXCLUDE_IMAGES_OPTION = typer.Option(None, "--exclude_images", "--exclude-images", help="An image-id list (.npy or one "
                                     "id a line): leave out the questions on those images, after --eval_last, as "
                                     "finetune's --exclude_images does (ViLBERT's clean_datasets).")


@evaluate_app.command("vqa")
def evaluate_vqa(
    ctx: typer.Context,
    predictions: Path = typer.Option(..., help="Official results file: a JSON list of {question_id, answer}."),
    questions: Path = typer.Option(..., help="VQA v2 questions JSON (v2_OpenEnded_mscoco_<split>_questions.json), "
                                             "or a file with the answers: a Pythia / MMF imdb .npy (imdb_minival2014.npy), "
                                             "LXMERT's question list (minival.json)."),
    annotations: Optional[Path] = typer.Option(None, help="VQA v2 annotations JSON (v2_mscoco_<split>_annotations.json), "
                                                          "or ViLBERT's cache/<split>_target.pkl; not with an imdb or "
                                                          "LXMERT's list."),
    answer_vocab: Optional[Path] = typer.Option(None, "--answer_vocab", "--answer-vocab", help="With a target.pkl: "
                                                "the answer table its labels index (ViLBERT's cache/trainval_ans2label.pkl)."),
    eval_last: int = typer.Option(0, "--eval_last", "--eval-last", min=0, help="Score only the N questions with the "
                                  "largest question ids (ViLBERT's minval: the last 3,000 of val2014); 0: all."),
    exclude_images: Optional[Path] = EXCLUDE_IMAGES_OPTION,
    out: Path = typer.Option(..., help="Directory to write metrics.json into."),
) -> None:
    """Score VQA predictions exactly as the official vqaEval.py does; write OUT/metrics.json."""
    from vlberts.tasks.vqa import answer_types, evaluate_predictions

    metrics = evaluate_predictions(predictions, questions, annotations, answer_vocab, eval_last, exclude_images or "")
    _record_options(ctx)  # once the inputs scored: a bad one leaves no OUT behind
    types = answer_types(metrics["per_answer_type"])
    _write_metrics(out, metrics, [f"VQA accuracy {metrics['accuracy']:.2f}% on {metrics['num_questions']} questions{types}"])


@evaluate_app.command("gqa")
def evaluate_gqa(
    ctx: typer.Context,
    predictions: Path = typer.Option(..., help="Official results file: a JSON list of {questionId, prediction}."),
    questions: Path = typer.Option(..., help="GQA questions JSON with answers (<split>_balanced_questions.json), "
                                             "LXMERT's list, or ViLBERT's cache/<split>_target.pkl."),
    out: Path = typer.Option(..., help="Directory to write metrics.json into."),
    train_questions: Optional[Path] = typer.Option(
        None, "--train_questions", "--train-questions", help="Training questions: adds the majority-answer baseline."),
    answer_vocab: Optional[Path] = typer.Option(None, "--answer_vocab", "--answer-vocab", help="With a target.pkl: "
                                                "the answer table its labels index (ViLBERT's cache/trainval_ans2label.pkl)."),
    eval_last: int = typer.Option(0, "--eval_last", "--eval-last", min=0, help="Score only the N questions with the "
                                  "largest question ids, ordered as the file stores them (numbers as numbers, strings "
                                  "as text: ViLBERT's minval, the last 3,000 of trainval); 0: all."),
    exclude_images: Optional[Path] = EXCLUDE_IMAGES_OPTION,
    normalize: bool = typer.Option(True, "--normalize/--no-normalize", help="Compare answers after lower-casing and "
                                   "trimming both sides (the gold answers are already so); --no-normalize compares "
                                   "the strings as they are, as the official eval.py does."),
) -> None:
    """Score GQA predictions by exact match (per structural type); write OUT/metrics.json."""
    from vlberts.tasks.gqa import evaluate_predictions

    metrics = evaluate_predictions(predictions, questions, train_questions, answer_vocab, eval_last, exclude_images or "",
                                   normalize=normalize)
    _record_options(ctx)  # once the inputs scored: a bad one leaves no OUT behind
    baseline = f" (majority-answer baseline {metrics['majority_baseline']:.2f}%)" if "majority_baseline" in metrics else ""
    _write_metrics(out, metrics, [f"GQA accuracy {metrics['accuracy']:.2f}% on {metrics['num_questions']} questions{baseline}"])


@evaluate_app.command("vcr")
def evaluate_vcr_cmd(
    ctx: typer.Context,
    annotations: Path = typer.Option(..., help="VCR jsonl with labels (e.g. WORLD/vcr/val.jsonl)."),
    qa: Optional[Path] = typer.Option(None, help="Q->A predictions.json of `vlberts finetune vcr --mode=qa` (annot_id -> 4 scores)."),
    qar: Optional[Path] = typer.Option(None, help="QA->R predictions.json of `vlberts finetune vcr --mode=qar`."),
    submission: Optional[Path] = typer.Option(None, help="Instead of --qa and --qar: a leaderboard submission CSV "
                                                         "(`vlberts predict vcr`'s submission.csv)."),
    out: Optional[Path] = typer.Option(None, help="Directory to write metrics.json into (optional)."),
) -> None:
    """Score a Q->A and a QA->R predictions file, or a leaderboard submission CSV: Q->A, QA->R and Q->AR
    accuracy (both right); prints JSON."""
    import json

    from vlberts.io import write_json
    from vlberts.recipes.finetune_vcr import evaluate_vcr, evaluate_vcr_submission

    if submission is not None and (qa is not None or qar is not None):
        raise VlbertsError("give either --submission or --qa and --qar, not both")
    if submission is not None:
        scores = evaluate_vcr_submission(annotations, submission)
    elif qa is not None and qar is not None:
        scores = evaluate_vcr(annotations, qa, qar)
    else:
        raise VlbertsError("evaluate vcr needs --qa and --qar (two predictions.json files) or --submission (a CSV)")
    _record_options(ctx)  # once the inputs scored: a bad one leaves no OUT behind
    typer.echo(json.dumps(scores, indent=2))
    if out is not None:
        write_json(out / "metrics.json", scores)
        typer.echo(f"wrote {out / 'metrics.json'}", err=True)


@evaluate_app.command("refcoco")
def evaluate_refcoco(
    ctx: typer.Context,
    predictions: Path = typer.Option(..., help="Predictions: a JSON list of {sent_id, ref_id, box: [x, y, w, h]} (pixels)."),
    refs: Path = typer.Option(..., help="refs(unc).p (restricted unpickler) or refs.json."),
    instances: Path = typer.Option(..., help="COCO instances.json of the refs."),
    out: Path = typer.Option(..., help="Directory to write metrics.json into."),
    splits: Optional[str] = typer.Option(None, help="Comma-separated splits (default: every split with a prediction)."),
) -> None:
    """Score RefCOCO+ predictions: correct when IoU(predicted box, gold box) >= 0.5; write OUT/metrics.json."""
    from vlberts.tasks.refcoco import evaluate_predictions

    metrics = evaluate_predictions(predictions, refs, instances, splits.split(",") if splits else None)
    _record_options(ctx)  # once the inputs scored: a bad one leaves no OUT behind
    _write_metrics(out, metrics, [f"RefCOCO+ {split} accuracy {r['accuracy']:.2f}% on {r['num_expressions']} expressions"
                                  for split, r in metrics["splits"].items()])


@evaluate_app.command("flickr_entities")
def evaluate_flickr_entities(
    ctx: typer.Context,
    predictions: Path = typer.Option(..., help="Predictions: a JSON list of phrase rows (image_id, split, sentence, "
                                               "chain_id, first_word_index, boxes [[x, y, w, h], ...] best first, scores)."),
    entities: Path = typer.Option(..., help="Flickr30K Entities directory (Sentences/, Annotations/, SPLIT.txt)."),
    out: Path = typer.Option(..., help="Directory to write metrics.json into."),
    split: str = typer.Option("test", help="Split to score (rows of other splits are ignored)."),
    features: Optional[Path] = typer.Option(None, help="The region store the candidates came from: adds the upper "
                                                       "bound and the detector-confidence baseline."),
    max_regions: int = typer.Option(36, "--max_regions", "--max-regions", min=1, help="Candidate regions per image (with --features)."),
    iou_rule: str = typer.Option("any", "--iou_rule", "--iou-rule", help="any: IoU >= 0.5 with any gold box of the "
                                                                         "chain; union: with their union box."),
) -> None:
    """Score Flickr30K Entities predictions from their boxes: R@1/5/10 (a box is positive at IoU >= 0.5 with
    a gold box of the phrase's chain); write OUT/metrics.json."""
    from vlberts.features.store import RegionStore
    from vlberts.tasks.flickr_entities import evaluate_predictions

    store = RegionStore(features) if features is not None else None
    metrics = evaluate_predictions(predictions, entities, split, rule=iou_rule, store=store, max_regions=max_regions)
    _record_options(ctx)  # once the inputs scored: a bad one leaves no OUT behind
    _write_metrics(out, metrics, [_flickr_entities_line(split, metrics)])


@evaluate_app.command("nlvr2")
def evaluate_nlvr2(
    ctx: typer.Context,
    predictions: Path = typer.Option(..., help="Official predictions CSV: identifier,True|False per line."),
    statements: Path = typer.Option(..., help="Labelled NLVR2 statements (JSON lines, e.g. test1.json)."),
    out: Optional[Path] = typer.Option(None, help="Directory to write metrics.json into (optional)."),
    train_statements: Optional[Path] = typer.Option(
        None, "--train_statements", "--train-statements", help="Training statements: adds the majority baseline."),
) -> None:
    """Score NLVR2 predictions: accuracy and consistency (nlvr2/eval/metrics.py); print them as JSON."""
    import json

    from vlberts.io import write_json
    from vlberts.tasks.nlvr2 import evaluate_predictions

    metrics = evaluate_predictions(predictions, statements, train_statements)
    _record_options(ctx)  # once the inputs scored: a bad one leaves no OUT behind
    typer.echo(json.dumps(metrics, indent=2))
    if out is not None:
        write_json(out / "metrics.json", metrics)
        typer.echo(f"wrote {out / 'metrics.json'}", err=True)


@evaluate_app.command("retrieval")
def evaluate_retrieval_cmd(
    init: Optional[Path] = typer.Option(None, help="Fine-tuned retrieval model dir, or with --zero_shot a pre-training one."),
    zero_shot: bool = typer.Option(False, "--zero_shot", "--zero-shot", help="Score with the pre-trained matching head (no fine-tuning)."),
    scores: Optional[Path] = typer.Option(None, help="Instead of a model: re-score a saved scores.npy (score_index.json beside it)."),
    features: Optional[Path] = typer.Option(None, help="Region store holding the evaluation images."),
    split_file: Optional[Path] = typer.Option(None, "--split_file", "--split-file", help="Karpathy split json (dataset_flickr30k.json)."),
    split: str = typer.Option("test", help="Split to rank."),
    eval_images: int = typer.Option(0, "--eval_images", "--eval-images", min=0, help="Rank only the first N images and their captions (0: all)."),
    out: Path = typer.Option(..., help="Directory to write metrics.json (and scores.npy) into."),
    max_regions: int = typer.Option(36, "--max_regions", "--max-regions", min=1, help="Regions per image."),
    max_text_len: int = typer.Option(32, "--max_text_len", "--max-text-len", min=8, help="Caption tokens incl. special tokens."),
    batch_size: int = typer.Option(256, "--batch_size", "--batch-size", min=1, help="Pairs per scoring batch."),
    device: str = typer.Option("auto", help="auto, cpu, cuda, cuda:N."),
    skip_bad: bool = typer.Option(False, "--skip_bad", "--skip-bad", help="Drop and count malformed records and images missing from the store."),
) -> None:
    """Rank every caption of a split against every image (R@1/5/10, medr, meanr, both directions, vs chance).

    Example (zero-shot, ViLBERT §4): vlberts evaluate retrieval --init=runs/pt/model --zero_shot
    --features=F.h5 --split_file=WORLD/dataset_world.json --out=runs/zs
    """
    from vlberts.recipes.finetune_retrieval import EvaluateRetrievalConfig, evaluate_retrieval

    cfg = EvaluateRetrievalConfig(
        init=str(init or ""), zero_shot=zero_shot, scores=str(scores or ""), features=str(features or ""),
        split_file=str(split_file or ""), eval_split=split, eval_images=eval_images, out=str(out),
        max_regions=max_regions, max_text_len=max_text_len, eval_batch_size=batch_size, device=device,
        skip_bad=skip_bad,
    )
    evaluate_retrieval(cfg)
    if os.environ.get("RANK", "0") != "0":
        return
    from vlberts.io import read_json

    for line in _retrieval_lines(read_json(out / "metrics.json")):
        typer.echo(line)
    typer.echo(f"wrote {out / 'metrics.json'}")


_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
# How gloo and NCCL report that a peer process went away in the middle of a collective.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted")


def _os_error_line(e: OSError) -> str:
    """One line for an OSError on a path the user gave. A path that runs through a file ("--out=notes.txt/run")
    fails as ENOTDIR or, in a mkdir of its parents, as EEXIST naming only the file: say which file is in the way."""
    if e.errno in (errno.ENOTDIR, errno.EEXIST) and e.filename is not None:
        path = Path(e.filename)
        blocker = next((q for q in (path, *path.parents) if q.is_file()), None)
        if blocker is not None and (blocker != path or e.errno == errno.EEXIST):
            return f"{blocker}: is a file, where the output path needs a folder"
    where = f"{e.filename}: " if e.filename is not None else ""
    return f"{where}{e.strerror or e}"


def _peer_failed(err: RuntimeError) -> bool:
    """A collective failed because another torchrun rank exited (after printing its own error): this rank's
    traceback would only bury that error. True only inside a process group."""
    td = sys.modules.get("torch.distributed")
    if td is None or not td.is_available() or not td.is_initialized():
        return False
    return isinstance(err, getattr(td, "DistNetworkError", ())) or any(m in str(err) for m in _PEER_GONE)


def _peer_failed_line(env: Mapping[str, str]) -> str:
    """What a rank stopped by another rank's failure says, from torchrun's variables: where to read that
    rank's error. torchrun numbers a machine's ranks consecutively (RANK - LOCAL_RANK onwards), and each
    machine prints its own ranks' errors and its own report of a killed one."""
    rank = env.get("RANK", "?")
    try:
        world, here = int(env["WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
        first = int(env["RANK"]) - int(env["LOCAL_RANK"])
    except (KeyError, ValueError):
        world = here = first = 0
    if here == 0 or world <= here:
        return (f"rank {rank} stopped: another rank failed (its error is above, unless it was killed: then "
                "torchrun's report names the signal)")
    mine = f"this machine's rank {first}" if here == 1 else f"one of this machine's ranks {first}-{first + here - 1}"
    return (f"rank {rank} stopped: another rank failed. Its error is printed by the machine that ran it: above if "
            f"it was {mine}, else on another of the job's machines ({world} ranks in all), where torchrun's "
            "report also names a rank that was killed")


def _stopped_early(out: str | Path) -> str:
    """What a run stopped by --stop_after left: a checkpoint to resume from, or nothing yet."""
    if (Path(out) / "checkpoints" / "latest").is_file():
        return f"stopped early at --stop_after; run again to resume ({out})"
    return (f"stopped early at --stop_after, before the first checkpoint (--ckpt_every): nothing was saved, "
            f"so running again starts over ({out})")


def _leave_process_group(ok: bool) -> None:
    """Under torchrun, leave the process group before exiting (`training.distributed.leave_process_group`);
    nothing, and no torch import, when the command never joined one."""
    td = sys.modules.get("torch.distributed")
    if td is None or not td.is_available() or not td.is_initialized():
        return
    from vlberts.training.distributed import leave_process_group

    leave_process_group(ok)


def _flags_with_values(argv: list[str]) -> list[str]:
    """Let the options of the commands that are not run configs (`vlberts extract`, `features`, `evaluate`,
    ...) be written as settings are: `--max_boxes` for `--max-boxes` (`-` and `_` are the same in a name, as
    `vlberts show-config` prints them), and an on/off option as `--quick=true` / `--quick=false` (rewritten
    to the bare flag or dropped). Run-config commands take `--key=value` as they are, so only a command's
    own options change."""
    command = typer.main.get_command(app)
    rest = list(argv)
    while rest and rest[0] in getattr(command, "commands", {}):  # groups (world, finetune, ...) and commands
        command = command.commands[rest.pop(0)]
    declared = [name for p in command.params for name in (*p.opts, *getattr(p, "secondary_opts", ()))
                if name.startswith("--")]
    spelled = {name.replace("_", "-"): name for name in declared}
    flags = {name for p in command.params if getattr(p, "is_flag", False) for name in p.opts}
    out = argv[: len(argv) - len(rest)]
    for arg in rest:
        name, eq, value = arg.partition("=")
        if name.startswith("--") and name not in declared and name.replace("_", "-") in spelled:
            name = spelled[name.replace("_", "-")]
            arg = f"{name}{eq}{value}"
        if eq and name in flags and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            if value.lower() in ("true", "1", "yes", "on"):
                out.append(name)
            continue
        out.append(arg)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    """Entry point: run the app, turning `VlbertsError` into one line and exit code 2."""
    ok = False
    try:
        code = app(args=_flags_with_values(sys.argv[1:] if argv is None else list(argv)), standalone_mode=False)
        if code == 130:  # Ctrl-C (typer's exit status for it, which it gives without a word)
            typer.echo("interrupted: the same command again continues a training run from its last checkpoint",
                       err=True)
        sys.exit(code if isinstance(code, int) else 0)
    except SystemExit as e:
        ok = e.code in (0, None)
        raise
    except typer.Abort:
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    except typer.TyperException as e:  # a command-line usage error (unknown option, missing value, ...): one line
        if not hasattr(e, "format_message"):
            raise
        ctx = getattr(e, "ctx", None)
        where = f" (see: {ctx.command_path} --help)" if ctx is not None else ""
        typer.echo(f"error: {e.format_message()}{where}", err=True)
        sys.exit(getattr(e, "exit_code", EXIT_BAD_INPUT))
    except VlbertsError as e:
        typer.echo(f"error: {e}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except OSError as e:
        # A path the user gave that cannot be made or written (an output directory that is a file, under a
        # missing or read-only folder, ...) or a full disk: their fix too, in one line. Anything else is a bug.
        if e.filename is None and e.errno not in _DISK_ERRNOS:
            raise
        typer.echo(f"error: {_os_error_line(e)}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except RuntimeError as e:
        if not _peer_failed(e):
            raise
        typer.echo(f"error: {_peer_failed_line(os.environ)}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    finally:
        _leave_process_group(ok)
        while _RUN_LOCKS:
            lock = _RUN_LOCKS.pop()
            if lock is not None:
                lock.release(failed=not ok)


if __name__ == "__main__":
    main()
