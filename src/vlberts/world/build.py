"""Build the embedded world: sample, render and describe N images, and export them in the real formats.

    OUT/images/{image_id:012d}.png
    OUT/scenes.jsonl                                   world ground truth, one image per line
    OUT/annotations/captions_{train,val,test}.json     COCO captions
    OUT/dataset_world.json                             Karpathy split file
    OUT/vqa/v2_OpenEnded_world_{split}_questions.json  VQA v2 questions
    OUT/vqa/v2_world_{split}_annotations.json          VQA v2 annotations (10 answers each)
    OUT/vqa/imdb/imdb_{split}.npy, vqa/answers_vqa.txt  the same questions as Pythia's imdb files + answer table
    OUT/vqa/cache/{split}_target.pkl, trainval_ans2label.pkl  the same answers as ViLBERT's targets + answer table
    OUT/gqa/{train,val,testdev}_balanced_questions.json GQA balanced questions (world splits train/val/test)
    OUT/gqa/cache/{train,val,trainval}_target.pkl, trainval_ans2label.pkl  the same as ViLBERT's GQA files
    OUT/refcoco+/refs(unc).p, refs.json, instances.json  RefCOCO+ refs (pickle and JSON) + COCO instances
    OUT/nlvr2/{train,dev,test1}.json                   NLVR2 statements about image pairs (world splits train/val/test)
    OUT/nlvr2/images.json                              NLVR2 image name -> world image id
    OUT/vcr/{train,val,test}.jsonl, vcr/metadata/*.json VCR multiple-choice questions + per-image boxes (world.vcr)
    OUT/flickr30k_entities/Sentences/{image_id}.txt    Flickr30K Entities phrases + chains
    OUT/flickr30k_entities/Annotations/{image_id}.xml  Flickr30K Entities boxes (1-based pixels)
    OUT/flickr30k_entities/{train,val,test}.txt        image ids per split
    OUT/parses/{train,val,test}.conllu                 gold Stanford dependency parses
    OUT/text/documents.txt                             text-only documents, BERT's format (world.documents)
    OUT/unpaired_images.txt                            H-VisualBERT's image-only set: train image ids
    OUT/vocab/vocab.txt, vocab/tokenizer_config.json   WordPiece vocabulary of every text above (world.language)
    OUT/world.json                                     seed, counts, vocabularies, conventions

Determinism: everything random about image k is drawn from `SeedSequence([seed, k])` (one child
stream each for the scene, the pixels, the captions, the VQA questions and the GQA questions; the GQA
stream is the fifth child, added after the others, so worlds built before GQA existed keep every
other file byte for byte; RefCOCO+ draws from its own `SeedSequence([seed, REFCOCO_STREAM, k])`, NLVR2 from
`SeedSequence([seed, NLVR2_STREAM, ...])` (`world.nlvr2`), VCR from `SeedSequence([seed, VCR_STREAM, k])`
(`world.vcr`), the text documents and the image-only set from their own (`world.documents`)), and the
split from
`SeedSequence([seed, 0])`, so the output is byte-identical for any number of worker processes.
The directory is built under a temporary name and swapped in at the end (`vlberts.io.atomic_dir`).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import pickle
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vlberts.errors import VlbertsError
from vlberts.io import atomic_dir, atomic_open, write_json
from vlberts.world import export
from vlberts.world import refcoco as world_refcoco
from vlberts.world.nlvr2 import write_nlvr2
from vlberts.world import vcr as world_vcr
from vlberts.world import documents as world_documents
from vlberts.world.language import write_world_vocab
from vlberts.world.gqa import GQA_SPLITS, GQAQuestion, generate_gqa_questions, gqa_record
from vlberts.world.grammar import REFERRING_STYLES, Caption, generate_captions
from vlberts.world.png import encode_png
from vlberts.world.questions import QUESTION_ID_FACTOR, Question, generate_questions
from vlberts.world.relations import scene_geometry, scene_referents
from vlberts.world.render import render_scene
from vlberts.world.scene import Scene, SceneConfig, sample_scene, scene_from_json, scene_line
from vlberts.world.vocab import BACKGROUND_TONES, COLOURS, RELATION_WORDS, SHAPES, SIZES

SPLITS = export.SPLITS


@dataclass(frozen=True)
class WorldConfig:
    """Everything that determines a world's content (besides the seed and the number of images)."""

    image_size: int = 128
    min_objects: int = 3
    max_objects: int = 6
    captions_per_image: int = 5
    questions_per_image: int = 6
    gqa_questions_per_image: int = 6
    split_fractions: tuple[float, float, float] = (0.8, 0.1, 0.1)  # train, val, test
    referring: str = "explicit"  # how captions refer to objects: explicit | minimal (grammar.REFERRING_STYLES)

    @property
    def scene(self) -> SceneConfig:
        return SceneConfig(image_size=self.image_size, min_objects=self.min_objects, max_objects=self.max_objects)

    def validate(self) -> None:
        self.scene.validate()
        if self.referring not in REFERRING_STYLES:
            raise VlbertsError(f"referring must be one of {', '.join(REFERRING_STYLES)}, got {self.referring!r}")
        if not 1 <= self.captions_per_image < export.CAPTION_ID_FACTOR:
            raise VlbertsError(f"captions per image must be 1..{export.CAPTION_ID_FACTOR - 1}")
        for n in (self.questions_per_image, self.gqa_questions_per_image):
            if not 0 <= n < QUESTION_ID_FACTOR:
                raise VlbertsError(f"questions per image must be 0..{QUESTION_ID_FACTOR - 1}")
        fr = self.split_fractions
        if len(fr) != 3 or any(f < 0 for f in fr) or abs(sum(fr) - 1) > 1e-6:
            raise VlbertsError(f"split fractions must be three non-negative numbers summing to 1, got {fr}")


@dataclass(frozen=True)
class WorldImage:
    """One image of the world, in memory."""

    scene: Scene
    pixels: np.ndarray | None  # (H, W, 3) uint8, None when not rendered
    captions: tuple[Caption, ...]
    questions: tuple[Question, ...]
    gqa_questions: tuple[GQAQuestion, ...] = ()
    refcoco_refs: tuple[world_refcoco.WorldRef, ...] = ()


def make_image(image_id: int, seed: int, cfg: WorldConfig = WorldConfig(), render: bool = True) -> WorldImage:
    """Image `image_id` of the world with this seed: the same every time, in any process."""
    # spawn(5)'s first four children are spawn(4)'s: adding the GQA stream changed no other stream.
    scene_ss, pixel_ss, caption_ss, question_ss, gqa_ss = np.random.SeedSequence([seed, image_id]).spawn(5)
    scene = sample_scene(np.random.default_rng(scene_ss), image_id, cfg.scene)
    pixels = render_scene(scene, np.random.default_rng(pixel_ss)) if render else None
    geom, refs = scene_geometry(scene), scene_referents(scene)  # shared by captions and questions
    captions = generate_captions(scene, np.random.default_rng(caption_ss), cfg.captions_per_image, geom, refs, cfg.referring)
    questions = generate_questions(scene, np.random.default_rng(question_ss), cfg.questions_per_image, geom, refs)
    gqa = generate_gqa_questions(scene, np.random.default_rng(gqa_ss), cfg.gqa_questions_per_image, geom, refs)
    refco = world_refcoco.generate_refs(
        scene, np.random.default_rng(np.random.SeedSequence([seed, world_refcoco.REFCOCO_STREAM, image_id])), refs)
    return WorldImage(scene, pixels, tuple(captions), tuple(questions), tuple(gqa), tuple(refco))


def split_sizes(n: int, fractions: tuple[float, float, float]) -> tuple[int, int, int]:
    """(train, val, test) image counts; val and test get at least one image each when n >= 3 and
    their fraction is positive."""
    sizes = [round(n * f) for f in fractions[1:]]
    if n >= 3:
        sizes = [max(1, s) if f > 0 else 0 for s, f in zip(sizes, fractions[1:])]
    n_val, n_test = sizes
    return n - n_val - n_test, n_val, n_test


def assign_splits(n: int, seed: int, fractions: tuple[float, float, float]) -> dict[int, str]:
    """image id (1..n) -> split, a seeded random partition with `split_sizes` parts."""
    perm = np.random.default_rng(np.random.SeedSequence([seed, 0])).permutation(n) + 1
    n_train, n_val, _ = split_sizes(n, fractions)
    out = {}
    for k, image_id in enumerate(perm.tolist()):
        out[image_id] = "train" if k < n_train else ("val" if k < n_train + n_val else "test")
    return out


@dataclass(frozen=True)
class WorldInfo:
    out: Path
    seed: int
    n_images: int
    image_size: int
    splits: dict[str, int]
    n_objects: int
    n_captions: int
    n_entities: int
    n_questions: int
    seconds: float
    workers: int
    format_version: int = export.FORMAT_VERSION
    template_counts: dict[str, int] = field(default_factory=dict)
    n_gqa_questions: int = 0
    n_refcoco_refs: int = 0
    n_refcoco_expressions: int = 0

    def summary(self) -> str:
        rate = self.n_images / self.seconds if self.seconds > 0 else float("inf")
        parts = " / ".join(f"{k} {v}" for k, v in self.splits.items())
        return (
            f"Built the embedded world in {self.out}: {self.n_images} images of {self.image_size}x{self.image_size} "
            f"pixels (seed {self.seed}; {parts}) with {self.n_objects} objects, {self.n_captions} captions holding "
            f"{self.n_entities} entity phrases and gold dependency parses, {self.n_questions} VQA questions with "
            f"10 answers each, {self.n_gqa_questions} GQA questions and {self.n_refcoco_refs} RefCOCO+ refs, NLVR2 "
            f"statements, VCR questions, text documents and an image-only set, in COCO, Karpathy, VQA v2 (and Pythia "
            f"imdb, ViLBERT's targets), GQA, NLVR2, VCR, RefCOCO+, Flickr30K Entities and CoNLL-U formats (every "
            f"file: world.json); "
            f"{self.seconds:.1f} s ({rate:.0f} images/s, {self.workers} worker{'s' if self.workers != 1 else ''})."
        )


# --------------------------------------------------------------------------- per-image work (in workers)

@dataclass
class _ImageOut:
    """What a worker hands back for one image: ready-made records for the per-split files."""

    image_id: int
    split: str
    scene_line: str
    coco_image: dict
    coco_annotations: list[dict]
    karpathy: dict
    vqa_questions: list[dict]
    vqa_annotations: list[dict]
    gqa_questions: list[tuple[str, dict]]
    conllu: str
    n_objects: int
    n_entities: int
    templates: list[str]
    refcoco_refs: list[dict] = field(default_factory=list)  # refs(unc).p entries
    refcoco_annotations: list[dict] = field(default_factory=list)  # instances.json annotations (images with refs)


_JOB: dict = {}  # set once per worker process by _init_worker


def _init_worker(root: str, seed: int, cfg: WorldConfig) -> None:
    _JOB.update(root=Path(root), seed=seed, cfg=cfg)


def _build_image(item: tuple[int, str]) -> _ImageOut:
    image_id, split = item
    root, seed, cfg = _JOB["root"], _JOB["seed"], _JOB["cfg"]
    im = make_image(image_id, seed, cfg)
    scene, captions = im.scene, list(im.captions)
    (root / "images" / scene.file_name).write_bytes(encode_png(im.pixels))
    # Per-image files are written plainly: the whole directory only appears when complete (atomic_dir).
    fl = root / "flickr30k_entities"
    (fl / "Sentences" / f"{image_id}.txt").write_text(export.flickr_sentences_file(captions), encoding="utf-8")
    (fl / "Annotations" / f"{image_id}.xml").write_text(export.flickr_annotation_xml(scene, captions), encoding="utf-8")
    world_vcr.write_metadata(root / "vcr", scene)
    return _ImageOut(
        image_id=image_id,
        split=split,
        scene_line=scene_line(scene, split),
        coco_image=export.coco_image(scene),
        coco_annotations=export.coco_annotations(scene, captions),
        karpathy=export.karpathy_image(scene, captions, split),
        vqa_questions=[export.vqa_question(q) for q in im.questions],
        vqa_annotations=[export.vqa_annotation(q) for q in im.questions],
        gqa_questions=[gqa_record(q, scene) for q in im.gqa_questions],
        conllu="".join(export.conllu_block(image_id, k, c) for k, c in enumerate(captions)),
        n_objects=len(scene.objects),
        n_entities=sum(len(c.entities) for c in captions),
        templates=[c.template for c in captions],
        refcoco_refs=[world_refcoco.ref_record(scene, r, split) for r in im.refcoco_refs],
        refcoco_annotations=world_refcoco.instance_annotations(scene) if im.refcoco_refs else [],
    )


def _dump_json(path: Path, obj: object) -> None:
    # json.dumps (C encoder) rather than vlberts.io.write_json's json.dump (pure-Python encoder): the
    # VQA and Karpathy files hold hundreds of thousands of records, and this is several times faster.
    with atomic_open(path) as f:
        f.write(json.dumps(obj, separators=(",", ":")))
        f.write("\n")


def _pool_context() -> mp.context.BaseContext:
    # fork where it exists (as torch's DataLoader does): no re-import of the caller's main module, so a
    # script without an `if __name__ == "__main__"` guard works. Workers touch only numpy and PIL,
    # never torch, so threads a parent may run do not matter to them. spawn elsewhere.
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


# --------------------------------------------------------------------------- the build

def build_world(
    out: str | Path,
    n_images: int,
    seed: int,
    image_size: int = 128,
    overwrite: bool = False,
    workers: int | None = None,
    config: WorldConfig | None = None,
) -> WorldInfo:
    """Generate the embedded world into `out` (see the module docstring for the layout).

    `config` sets everything but the image size (`image_size` wins); `workers` defaults to the CPU count.
    Raises `VlbertsError` for bad settings or a non-empty `out` without `overwrite`.
    """
    t0 = time.perf_counter()
    cfg = dataclasses.replace(config or WorldConfig(), image_size=image_size)
    cfg.validate()
    if not 1 <= n_images <= 10**8:
        raise VlbertsError(f"number of images must be between 1 and 100000000, got {n_images}")
    if seed < 0:
        raise VlbertsError(f"seed must be a non-negative integer, got {seed}")
    n_workers = max(1, workers if workers is not None else (os.cpu_count() or 1))
    n_workers = min(n_workers, max(1, n_images // 16))  # tiny worlds are not worth a process pool

    splits = assign_splits(n_images, seed, cfg.split_fractions)
    items = [(i, splits[i]) for i in range(1, n_images + 1)]

    out_path = Path(out)
    if overwrite and out_path.exists() and not (out_path.is_dir() and (
            not any(out_path.iterdir()) or (out_path / "world.json").is_file())):
        # --overwrite replaces an earlier world, never a file or a folder of something else
        raise VlbertsError("exists and is not a world directory (no world.json); refusing to replace it", path=out_path)
    with atomic_dir(out, overwrite=overwrite) as root:
        for sub in ("images", "annotations", "vqa", "gqa", "refcoco+", "parses", "flickr30k_entities/Sentences",
                    "flickr30k_entities/Annotations", "vcr/metadata"):
            (root / sub).mkdir(parents=True, exist_ok=True)

        if n_workers == 1:
            _init_worker(str(root), seed, cfg)
            results = [_build_image(it) for it in items]
            _write_collections(root, results, seed, n_images, cfg, pool=None)
        else:
            chunk = max(1, min(64, n_images // (n_workers * 8)))
            with _pool_context().Pool(n_workers, initializer=_init_worker, initargs=(str(root), seed, cfg)) as pool:
                results = list(pool.imap(_build_image, items, chunksize=chunk))
                _write_collections(root, results, seed, n_images, cfg, pool=pool)
        write_world_vocab(root)  # read back from the files above: the language every reader will see
        info = WorldInfo(
            out=Path(out), seed=seed, n_images=n_images, image_size=cfg.image_size,
            splits={s: sum(1 for r in results if r.split == s) for s in SPLITS},
            n_objects=sum(r.n_objects for r in results),
            n_captions=sum(len(r.coco_annotations) for r in results),
            n_entities=sum(r.n_entities for r in results),
            n_questions=sum(len(r.vqa_questions) for r in results),
            seconds=0.0, workers=n_workers,
            template_counts=_count(t for r in results for t in r.templates),
            n_gqa_questions=sum(len(r.gqa_questions) for r in results),
            n_refcoco_refs=sum(len(r.refcoco_refs) for r in results),
            n_refcoco_expressions=sum(len(x["sentences"]) for r in results for x in r.refcoco_refs),
        )
        write_json(root / "world.json", _world_json(info, cfg))
    seconds = time.perf_counter() - t0
    return dataclasses.replace(info, seconds=seconds)


def _count(items) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in items:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))


def _export_from_scenes(root: Path, seed: int, n_images: int, cfg: WorldConfig, task: str) -> None:
    """One of the exports that need every image's scene (or none), run in a worker after the images:
    NLVR2 and VCR (their sets and distractors span images), the text documents. Each reads the scenes
    from OUT/scenes.jsonl, so nothing large crosses the process boundary."""
    if task == "documents":
        (root / "text").mkdir(exist_ok=True)
        world_documents.write_documents(root / "text" / "documents.txt", seed, world_documents.documents_for(n_images),
                                        cfg.scene)
        return
    with open(root / "scenes.jsonl", encoding="utf-8") as f:
        scenes = [scene_from_json(json.loads(line)) for line in f]
    if task == "nlvr2":
        write_nlvr2(root / "nlvr2", scenes, seed)
    else:
        world_vcr.write_vcr(root / "vcr", scenes, seed, metadata=False)


def _write_collections(root: Path, results: list[_ImageOut], seed: int, n_images: int, cfg: WorldConfig,
                       pool) -> None:
    """The files that gather all images (or all images of a split); `results` are in image id order.

    The three exports that need all scenes (`_export_from_scenes`) run in the pool's workers while this
    process writes the rest, so the build's tail uses both cores instead of one; their outputs do not
    depend on where they run."""
    with atomic_open(root / "scenes.jsonl") as f:
        f.writelines(r.scene_line + "\n" for r in results)
    tasks = ("vcr", "nlvr2", "documents")
    if pool is None:
        pending = [_export_from_scenes(root, seed, n_images, cfg, t) for t in tasks]
    else:
        pending = [pool.apply_async(_export_from_scenes, (root, seed, n_images, cfg, t)) for t in tasks]
    _dump_json(root / "dataset_world.json", {"dataset": "world", "images": [r.karpathy for r in results]})
    for split in SPLITS:
        part = [r for r in results if r.split == split]
        _dump_json(root / "annotations" / f"captions_{split}.json", export.coco_captions_file(
            [r.coco_image for r in part], [a for r in part for a in r.coco_annotations]))
        _dump_json(root / "vqa" / f"v2_OpenEnded_world_{split}_questions.json",
                   export.vqa_questions_file(split, [q for r in part for q in r.vqa_questions]))
        _dump_json(root / "vqa" / f"v2_world_{split}_annotations.json",
                   export.vqa_annotations_file(split, [a for r in part for a in r.vqa_annotations]))
        _dump_json(root / "gqa" / f"{GQA_SPLITS[split]}_balanced_questions.json",
                   dict(rec for r in part for rec in r.gqa_questions))
        with atomic_open(root / "flickr30k_entities" / f"{split}.txt") as f:
            f.writelines(f"{r.image_id}\n" for r in part)
        with atomic_open(root / "parses" / f"{split}.conllu") as f:
            f.writelines(r.conllu for r in part)
    _write_vqa_imdb(root / "vqa", results)
    _write_vqa_targets(root / "vqa" / "cache", results)
    _write_gqa_targets(root / "gqa" / "cache", results)
    _write_refcoco(root / "refcoco+", results)
    # The image-only set (`world.documents`; the text documents are one of the pool's exports).
    world_documents.write_unpaired_images(root / "unpaired_images.txt", world_documents.unpaired_images(
        [r.image_id for r in results if r.split == "train"], seed))
    if pool is not None:
        for job in pending:
            job.get()  # re-raises a worker's exception here


def _write_vqa_imdb(folder: Path, results: list[_ImageOut]) -> None:
    """The VQA questions once more in VisualBERT's form (`data.vqa.write_vqa_imdb`): Pythia's imdb file of each
    split, `imdb/imdb_{split}.npy`, and its answer table `answers_vqa.txt`: `<unk>` (as Pythia's VQA table
    has it), then every training question's multiple-choice answer, most frequent first."""
    from vlberts.data.vqa import write_vqa_imdb

    counts = Counter(a["multiple_choice_answer"] for r in results if r.split == "train" for a in r.vqa_annotations)
    table = ["<unk>", *sorted(counts, key=lambda a: (-counts[a], a))]
    with atomic_open(folder / "answers_vqa.txt") as f:
        f.write("\n".join(table) + "\n")
    for split in SPLITS:
        write_vqa_imdb(folder / "imdb" / f"imdb_{split}.npy", _vqa_examples(results, split), table,
                       image_name="{image_id:012d}")


def _vqa_examples(results: list[_ImageOut], split: str) -> list:
    """The split's VQA questions with their ten answers, as `data.vqa.VQAExample`s."""
    from vlberts.data.vqa import VQAExample

    return [VQAExample(question_id=q["question_id"], image_id=q["image_id"], question=q["question"],
                       answers=[x["answer"] for x in a["answers"]], multiple_choice_answer=a["multiple_choice_answer"])
            for r in results if r.split == split for q, a in zip(r.vqa_questions, r.vqa_annotations)]


def _write_vqa_targets(folder: Path, results: list[_ImageOut]) -> None:
    """The VQA answers once more in ViLBERT's form (`data.vqa`, vilbert-multi-task's `cache/`): the answer table
    `trainval_ans2label.pkl` (hengyuan-hu's: answers of at least 9 train + val questions) and each split's
    `{split}_target.pkl` of soft scores over it, beside the VQA v2 questions files."""
    from vlberts.tasks.vqa import build_answer_vocab, write_answer_table, write_vqa_targets

    examples = {split: _vqa_examples(results, split) for split in SPLITS}
    vocab = build_answer_vocab(examples["train"] + examples["val"], 9)
    write_answer_table(folder / "trainval_ans2label.pkl", vocab)
    for split in SPLITS:
        write_vqa_targets(folder / f"{split}_target.pkl", examples[split], vocab)


def _write_gqa_targets(folder: Path, results: list[_ImageOut]) -> None:
    """The GQA questions of train and val once more in ViLBERT's form (`data.gqa`, vilbert-multi-task's `cache/`):
    the answer table `trainval_ans2label.pkl` (every train + val answer) and `{train,val,trainval}_target.pkl`,
    each record its question with its answer's class. (ViLBERT reads testdev as GQA's JSON, written above.)"""
    from vlberts.data.gqa import parse_gqa_record
    from vlberts.tasks.gqa import build_answer_vocab, write_gqa_targets
    from vlberts.tasks.vqa import write_answer_table

    examples = {split: [parse_gqa_record(qid, rec, path=folder, record=qid) for r in results if r.split == split
                        for qid, rec in r.gqa_questions] for split in ("train", "val")}
    examples["trainval"] = examples["train"] + examples["val"]
    vocab = build_answer_vocab(examples["trainval"])
    write_answer_table(folder / "trainval_ans2label.pkl", vocab)
    for name, part in examples.items():
        write_gqa_targets(folder / f"{name}_target.pkl", part, vocab)


def _write_refcoco(folder: Path, results: list[_ImageOut]) -> None:
    """RefCOCO+ (`world.refcoco`): the refs as a protocol-2 pickle (as released) and as JSON, and the
    COCO instances of every image with a ref."""
    refs = [x for r in results for x in r.refcoco_refs]
    _dump_json(folder / "refs.json", refs)
    # Pickled from the JSON text: pickle memoizes shared objects, and which strings are shared depends on
    # whether the records crossed a process boundary; read back from one text they are the same for any
    # number of workers, and so are the bytes.
    with atomic_open(folder / "refs(unc).p", "wb") as f:
        pickle.dump(json.loads((folder / "refs.json").read_text(encoding="utf-8")), f, protocol=2)
    _dump_json(folder / "instances.json", world_refcoco.instances_file(
        [r.coco_image for r in results if r.refcoco_refs], [a for r in results for a in r.refcoco_annotations],
        export.WORLD_INFO, [export.WORLD_LICENSE]))


def _world_json(info: WorldInfo, cfg: WorldConfig) -> dict:
    return {
        "name": "world",
        "format_version": export.FORMAT_VERSION,
        "seed": info.seed,
        "n_images": info.n_images,
        "image_size": [cfg.image_size, cfg.image_size],
        "objects_per_image": [cfg.min_objects, cfg.max_objects],
        "captions_per_image": cfg.captions_per_image,
        "referring": cfg.referring,
        "questions_per_image": cfg.questions_per_image,
        "gqa_questions_per_image": cfg.gqa_questions_per_image,
        "splits": info.splits,
        "counts": {"images": info.n_images, "objects": info.n_objects, "captions": info.n_captions,
                   "entities": info.n_entities, "questions": info.n_questions,
                   "gqa_questions": info.n_gqa_questions, "refcoco_refs": info.n_refcoco_refs,
                   "refcoco_expressions": info.n_refcoco_expressions},
        "caption_templates": info.template_counts,
        "vocab": {
            "shapes": list(SHAPES),
            "colours": {k: list(v) for k, v in COLOURS.items()},
            "sizes": list(SIZES),
            "relations": {k: list(v) for k, v in RELATION_WORDS.items()},
            "background_tones": list(BACKGROUND_TONES),
        },
        "files": {
            "images": "images/{image_id:012d}.png",
            "scenes": "scenes.jsonl",
            "coco_captions": "annotations/captions_{split}.json",
            "karpathy": "dataset_world.json",
            "vqa_questions": "vqa/v2_OpenEnded_world_{split}_questions.json",
            "vqa_annotations": "vqa/v2_world_{split}_annotations.json",
            "vqa_imdb": "vqa/imdb/imdb_{split}.npy (Pythia's imdb: the same questions and answers), "
                        "vqa/answers_vqa.txt (its answer table, <unk> first)",
            "vqa_targets": "vqa/cache/{split}_target.pkl (ViLBERT's soft-score targets of the same questions), "
                           "vqa/cache/trainval_ans2label.pkl (their answer table)",
            "gqa_questions": "gqa/{train,val,testdev}_balanced_questions.json (world splits train, val, test)",
            "gqa_targets": "gqa/cache/{train,val,trainval}_target.pkl (ViLBERT's GQA files: the train and val "
                           "questions with their answers' classes), gqa/cache/trainval_ans2label.pkl (their answer table)",
            "refcoco": "refcoco+/refs(unc).p (pickle, protocol 2), refcoco+/refs.json (the same refs), "
                       "refcoco+/instances.json (COCO instances of the images with refs); splits train, val, "
                       "testA (test refs to circles, squares, triangles), testB (the other shapes)",
            "nlvr2": "nlvr2/{train,dev,test1}.json (JSON lines; world splits train, val, test), "
                     "nlvr2/images.json (NLVR2 image name -> world image id)",
            "vcr": "vcr/{train,val,test}.jsonl (VCR questions, JSON lines; test without labels), "
                   "vcr/metadata/{image_id:012d}.json (VCR per-image metadata: the objects' gold boxes)",
            "flickr30k_entities": "flickr30k_entities",
            "parses": "parses/{split}.conllu",
            "text_documents": "text/documents.txt (text-only documents about imagined scenes, BERT's format: one "
                              "sentence per line, a blank line between documents; train only)",
            "unpaired_images": "unpaired_images.txt (train image ids whose captions H-VisualBERT withholds: "
                               "its image-only set)",
        },
        "conventions": {
            "boxes": "scenes.jsonl: [x1, y1, x2, y2] integer pixel edges, 0-based, end exclusive (x2 - x1 = width); "
                     "read as float xyxy pixels this is the library convention",
            "flickr_boxes": "Annotations/*.xml: 1-based inclusive pixel indices (xmin = x1 + 1, xmax = x2), as in "
                            "Flickr30K Entities; vlberts.data.flickr_entities converts back to 0-based float xyxy",
            "object_id": "1-based draw order within an image; later objects occlude earlier ones",
            "caption_id": "image_id * 10 + caption index (COCO annotation id = Karpathy sentid)",
            "question_id": "image_id * 1000 + question index (VQA: int; GQA: the same number as a string)",
            "gqa_object_id": "GQA annotations: image_id * 100 + object id, as a string",
            "chain_id": "image_id * 100 + local id: object id (1..9), 10 = background (scene), 11.. = plural sets; "
                        "0 = notvisual",
            "sent_id": "{image_id}_{caption index}",
            "karpathy_tokens": "caption words without punctuation; raw is the exact caption text",
        },
    }
