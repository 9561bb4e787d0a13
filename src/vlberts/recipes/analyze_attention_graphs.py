"""Recipe: LXMERT-style attention graphs for any architecture (LXMERT App. E, Figures 3-5).

    read the split's Flickr30K Entities captions; tokenise (`[CLS] caption [SEP]`, as the grounding analysis)
    read the captions' parses (CoNLL-U, or spaCy with --parser) for their UPOS tags, if any
    read the world's scenes (scenes.jsonl) for the gold relations between objects, if any
    run the pre-trained model on every caption with its image's regions, with every attention map
    per caption: words -> words maps       -> attention to the next / previous token per head
                 regions -> words maps     -> share of a region's text attention per POS tag
                 regions -> regions maps   -> is the most attended other region a related object?
    draw the figures for a few captions; write the numbers

    OUT/run_config.json             every setting of the run, defaults included (written before the forward passes)
    OUT/attention_graphs.json       which maps stand for the three encoders; per layer and head the mean
                                    attention to the next and to the previous token, the best head of each
                                    and the uniform baseline; per tag the share of the regions' attention
                                    against the tag's share of the tokens (with parses); the relation
                                    statistic against chance (with scenes); counts of what was skipped
    OUT/attention_graphs.md         the same in short
    OUT/graphs/<caption id>_language.png   Fig. 3: word->word graphs of the best next- and previous-token heads
    OUT/graphs/<caption id>_objects.png    Fig. 4: the top-k region pairs of the first region layer, on the image
    OUT/graphs/<caption id>_cross.png      Fig. 5: attention each word receives from the regions, per cross layer

Which maps (`vlberts.analysis.attention_graphs.select_views`): LXMERT's language encoder, object-relationship
encoder and cross-modality encoder; ViLBERT's text stream, visual stream and co-attention layers; the
text, region and cross blocks of the joint maps of single-stream models.

Parses (`--parses`, `--parser`): as `vlberts analyze grounding` (auto: `<entities>/../parses/<split>.conllu`).
Scenes (`--scenes`): "auto" reads `<entities>/../scenes.jsonl`, where the embedded world writes its ground
truth; a path; "none". Two objects are related when the world says they are near each other (gap at most
10% of the image side) or touching (`vlberts.world.relations`); a region detects the object its box
overlaps best at IoU >= 0.5.
Images (`--images`) for the object figure: as `vlberts analyze grounding` (a directory given that holds none of
the images drawn is an error; missing ones are drawn grey and counted in attention_graphs.json's figure_images).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vlberts.analysis.attention_graphs import (
    VIEW_NAMES,
    PositionalAccumulator,
    RelationAccumulator,
    TagShareAccumulator,
    region_objects,
    row_normalise,
    select_views,
    token_tags,
)
from vlberts.analysis.entities import EntityCaption, SkipCounts, attention_batches, entity_captions
from vlberts.analysis.graph_figures import GraphExample, save_cross_figure, save_language_figure, save_objects_figure
from vlberts.analysis.syntactic import ParseMismatch, check_parse_words
from vlberts.config import apply_overrides, from_dict
from vlberts.data.spacy_parse import load_spacy
from vlberts.data.vqa_dataset import model_tag_subwords
from vlberts.errors import VlbertsError
from vlberts.features.store import RegionStore
from vlberts.io import atomic_open, write_json
from vlberts.models.builders import arch_of, reads_tags
from vlberts.recipes.analyze_grounding import (analysis_images, image_bytes, load_parses, missing_images, resolve_images,
                                              resolve_parses)
from vlberts.recipes.common import autocast, fit_text_len, opt, progress, resolve_device, start_recipe, write_run_config
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import load_attention_model
from vlberts.world.relations import scene_geometry
from vlberts.world.scene import read_scenes

# Gold relations of the object-graph statistic (module docstring).
RELATED = ("near", "touching")


@dataclass(frozen=True)
class AttentionGraphsConfig:
    model: str = opt("", "vlberts model directory: a pretrain run's RUN/model, or a finetune run's (its encoder is read)")
    entities: str = opt("", "Flickr30K Entities root: Sentences/, Annotations/, {train,val,test}.txt")
    features: str = opt("", "region store holding the split's images")
    split: str = opt("test", "which split's captions to analyse")
    out: str = opt("runs/attention_graphs", "output directory")
    parses: str = opt("auto", "CoNLL-U parses for the POS tags: auto (<entities>/../parses/<split>.conllu if present), "
                      "a file (sent_id = <image id>_<caption index>), or none")
    parser: str = opt("", "parse the captions with spaCy instead: spacy:PIPELINE (needs pip install 'vlberts[parse]')")
    scenes: str = opt("auto", "gold scenes for the object-relation statistic: auto (<entities>/../scenes.jsonl if "
                      "present, as the world writes it), a scenes.jsonl file, or none")
    captions: str = opt("", "comma-separated caption ids (<image id>_<line>) to draw; empty: the first `figures` "
                        "captions with grounded entities")
    figures: int = opt(3, "captions drawn when --captions is empty")
    top_k: int = opt(5, "region pairs drawn on the image (the strongest of the first region layer)")
    images: str = opt("auto", "images for the object figure: auto (<entities>/../images), a directory, or none")
    max_images: int = opt(0, "analyse only the split's first N images (0: all)")
    skip_bad: bool = opt(False, "drop images whose Sentences/Annotations file is malformed and images missing from "
                         "the store, counting them (a warning and bad_records in the JSON) instead of stopping")
    max_text_len: int = opt(64, "subwords per caption incl. [CLS]/[SEP]")
    max_regions: int = opt(36, "regions per image (the store's first ones)")
    batch_size: int = opt(64, "captions per forward pass")
    device: str = opt("auto", "auto, cpu, cuda, cuda:N")
    precision: str = opt("fp32", "fp32 or bf16 (maps are analysed in float32 either way)")


CONFIG_CLASS = AttentionGraphsConfig


@dataclass
class AttentionGraphsReport:
    arch: str
    data: dict[str, Any]  # what OUT/attention_graphs.json holds
    paths: dict[str, Path]


def resolve_scenes(cfg: AttentionGraphsConfig) -> tuple[Path | None, str]:
    """The scenes.jsonl to read (or None) and a sentence saying which and why."""
    if cfg.scenes == "none":
        return None, "object-relation statistic not computed (--scenes=none)"
    path = Path(cfg.entities).parent / "scenes.jsonl" if cfg.scenes == "auto" else Path(cfg.scenes)
    if not path.is_file():
        if cfg.scenes == "auto":
            return None, f"object-relation statistic not computed: no gold scenes ({path} does not exist)"
        raise VlbertsError("scenes file not found (--scenes)", path=path)
    return path, f"gold relations: {' or '.join(RELATED)} in {path}"


def gold_relations(path: Path, image_ids: set[str]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """image id -> (object boxes (N, 4) float xyxy pixels, related (N, N) bool) for the given images. The
    scenes reader checks what `scene_geometry` relies on (object ids 1..N, touching pairs among them)."""
    out = {}
    for scene, _ in read_scenes(path):
        if str(scene.image_id) not in image_ids:
            continue
        g = scene_geometry(scene)
        related = np.zeros((len(scene.objects),) * 2, dtype=bool)
        for r in RELATED:
            related |= g.holds[r]
        out[str(scene.image_id)] = (np.array([o.box for o in scene.objects], dtype=np.float64).reshape(-1, 4), related)
    return out


def pick_captions(cfg: AttentionGraphsConfig, captions: list[EntityCaption]) -> list[str]:
    """The caption ids to draw: --captions (each must be analysed), else the first N with grounded entities."""
    if cfg.figures < 0 or cfg.top_k < 0:
        raise VlbertsError("--figures and --top_k must be >= 0")
    named = [c.strip() for c in cfg.captions.split(",") if c.strip()]
    known = {c.caption_id for c in captions}
    for cid in named:
        if cid not in known:
            raise VlbertsError(f"--captions: caption {cid!r} is not in the analysed {cfg.split!r} images "
                               "(caption ids are <image id>_<line>)")
    return named or [c.caption_id for c in captions if c.entities][: cfg.figures]


def analyze_attention_graphs(cfg: AttentionGraphsConfig) -> AttentionGraphsReport:
    """Run the analysis (module docstring) and write its outputs."""
    cfg = start_recipe(cfg)
    for key in ("model", "entities", "features"):
        if not getattr(cfg, key):
            raise VlbertsError(f"analyze attention-graphs needs --{key}")
    if cfg.parser and cfg.parses not in ("auto", "none"):
        raise VlbertsError("--parser and --parses=FILE both name parses; give one")
    nlp = load_spacy(cfg.parser) if cfg.parser else None
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    model, model_cfg, meta = load_attention_model(cfg.model)
    cfg = fit_text_len(cfg, model_cfg, cfg.model)
    model.to(device)
    arch = arch_of(model_cfg)
    tok = TextTokenizer.load(cfg.model)
    store = RegionStore(cfg.features)
    tags = model_tag_subwords(reads_tags(model_cfg), store, tok)  # W-VisualBERT: tags beside the regions
    images, bad = analysis_images(cfg, store)
    ids = [im.image_id for im in images]
    captions = entity_captions(images, tok, cfg.max_text_len, SkipCounts())
    if not captions:
        raise VlbertsError(f"no caption in split {cfg.split!r}", path=cfg.entities)
    drawn_ids = pick_captions(cfg, captions)
    parses, parse_failed, parse_note = load_parses(cfg, captions, nlp)
    scenes_path, scenes_note = resolve_scenes(cfg)
    scenes = gold_relations(scenes_path, set(ids)) if scenes_path else None
    images = resolve_images(cfg) if drawn_ids else None
    figure_images = missing_images(cfg, images, list(dict.fromkeys(
        c.image_id for c in captions if c.caption_id in drawn_ids)), "attention_graphs.json")
    write_run_config(cfg.out, cfg)  # before the forward passes

    positional, shares, relations = PositionalAccumulator(), TagShareAccumulator(), RelationAccumulator()
    skipped = SkipCounts()  # captions left out of a statistic, by reason, each with its first
    examples: dict[str, GraphExample] = {}
    views = None
    with progress() as bar, autocast(device, cfg.precision):
        task = bar.add_task("attention graphs", total=len(captions), info="")
        for chunk, recs, regs, maps in attention_batches(model, captions, store, max_regions=cfg.max_regions,
                                                         batch_size=cfg.batch_size, device=device, tag_subwords=tags):
            views = select_views(maps, arch, model_cfg)
            for b, (cap, rec, reg) in enumerate(zip(chunk, recs, regs)):
                T, R = len(cap.ids), len(reg.feats)
                language = row_normalise(views.language[:, b, :, :T, :T])  # (L_l, H_l, T, T), rows over the words
                objects = views.objects[:, b, :, :R, :R]  # (L_o, H_o, R, R)
                cross = views.cross[:, b, :, :R, :T]  # (L_x, H_x, R, T)
                positional.add(language)
                tags = _caption_tags(cap, parses, parse_failed, skipped)
                if tags is not None:
                    shares.add(cross, tags)
                if scenes is not None:
                    if cap.image_id not in scenes:
                        skipped.add(_NOT_IN_SCENES, example=f"image {cap.image_id}")
                    else:
                        boxes, related = scenes[cap.image_id]
                        relations.add(objects, region_objects(reg.pixel_boxes, boxes), related)
                if cap.caption_id in drawn_ids:
                    examples[cap.caption_id] = GraphExample(
                        cap.caption_id, [tok.id_to_token(i) for i in cap.ids], tags, language, objects, cross,
                        np.asarray(reg.pixel_boxes, dtype=np.float64), (rec.image_w, rec.image_h),
                        image_bytes(images, cap.image_id))
            bar.advance(task, len(chunk))

    pos = positional.result()
    data: dict[str, Any] = {
        "model": cfg.model, "model_task": meta.get("task"), "arch": arch, "split": cfg.split, "captions": len(captions),
        "maps": {k: {"reads": VIEW_NAMES[k], "maps": v} for k, v in views.describe.items()},
        "shapes": {k: {"layers": int(getattr(views, k).shape[0]), "heads": int(getattr(views, k).shape[2])}
                   for k in ("language", "objects", "cross")},
        "positional": pos,
        "pos_shares": shares.result() if shares.n_rows else None,
        "pos_note": parse_note if parses is not None else
        "no POS shares: no parses (pass --parses=FILE.conllu or --parser=spacy:PIPELINE)",
        "object_relations": relations.result(views.object_layer),
        "object_relations_note": scenes_note,
        "skipped": skipped.to_dict(),
        "skipped_first": dict(sorted(skipped.first.items())),
        "bad_records": bad.to_dict(),
        "figure_images": figure_images,  # the object figures' images: missing ones drawn grey
        "parser_alignment_failures": dict(list(parse_failed.items())[:20]),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    # on stderr as well as in attention_graphs.json, each naming the file it concerns and the first caption or image
    parse_source = cfg.parser or str(resolve_parses(cfg)[0])
    for line in (skipped.warning("captions from the POS shares", parse_source, _PARSE_SKIPS),
                 skipped.warning("captions from the object relations", str(scenes_path), (_NOT_IN_SCENES,))):
        if line:
            print(line, file=sys.stderr)
    out = Path(cfg.out)
    paths = {"json": out / "attention_graphs.json", "markdown": out / "attention_graphs.md"}
    nx, pv = pos["best_next"], pos["best_previous"]
    heads = [(nx["layer"] - 1, nx["head"] - 1, "next-token head"), (pv["layer"] - 1, pv["head"] - 1, "previous-token head")]
    for cid in drawn_ids:
        ex = examples[cid]
        paths[f"{cid}_language"] = save_language_figure(ex, heads, out / "graphs" / f"{cid}_language.png")
        paths[f"{cid}_objects"] = save_objects_figure(
            ex, views.object_layer, out / "graphs" / f"{cid}_objects.png", k=cfg.top_k,
            title=f"{arch}: regions -> regions, layer {views.object_layer + 1} (mean over heads), top {cfg.top_k} pairs")
        paths[f"{cid}_cross"] = save_cross_figure(ex, out / "graphs" / f"{cid}_cross.png", title=f"{arch}: regions -> words")
    data["figures"] = {k: str(v) for k, v in paths.items() if k not in ("json", "markdown")}
    write_json(paths["json"], data)
    with atomic_open(paths["markdown"]) as f:
        f.write(summary_markdown(data))
    return AttentionGraphsReport(arch, data, paths)


_NOT_IN_SCENES = "image not in the scenes"
_PARSE_SKIPS = ("parser tokens do not align with the caption's words", "no parse", "parse words differ")


def _caption_tags(cap: EntityCaption, parses: dict | None, parse_failed: dict[str, str],
                  skipped: SkipCounts) -> list[str] | None:
    """The caption's token tags from its parse, or None (counted in `skipped` with the reason)."""
    if parses is None:
        return None
    where = f"caption {cap.caption_id}"
    if cap.caption_id in parse_failed:
        skipped.add(_PARSE_SKIPS[0], example=where)
        return None
    sentence = parses.get(cap.caption_id)
    if sentence is None:
        skipped.add(_PARSE_SKIPS[1], example=where)
        return None
    try:
        check_parse_words(sentence, cap.words)
    except ParseMismatch:
        skipped.add(_PARSE_SKIPS[2], example=where)
        return None
    return token_tags(cap.word_tokens, [t.upos for t in sentence.tokens], len(cap.ids))


def summary_markdown(data: dict[str, Any]) -> str:
    """The numbers of OUT/attention_graphs.json in short."""
    pos = data["positional"]
    lines = [f"# Attention graphs ({data['arch']}, {data['split']} split, {data['captions']} captions)", "",
             "Maps read:", ""]
    lines += [f"- {v['reads']}: {v['maps']}" for v in data["maps"].values()]
    lines += ["", f"Words -> words (uniform baseline {pos['uniform']:.3f}):", ""]
    for key, name in (("best_next", "next token"), ("best_previous", "previous token")):
        b = pos[key]
        lines.append(f"- best {name} head {b['label']}: {b['value']:.3f} ({b['ratio_to_baseline']:.1f} x uniform)")
    lines += ["", "Regions -> words, share of a region's text attention per tag:", ""]
    if data["pos_shares"] is None:
        lines.append(f"- {data['pos_note']}")
    else:
        lines += ["| tag | token share | mean share | ratio | best head | its share |", "|---|---|---|---|---|---|"]
        for tag, t in data["pos_shares"]["tags"].items():
            mean = "-" if t["mean_share"] is None else f"{t['mean_share']:.3f}"
            ratio = "-" if t["ratio"] is None else f"{t['ratio']:.2f}"
            lines.append(f"| {tag} | {t['token_share']:.3f} | {mean} | {ratio} | {t['best_head']['label']} | "
                         f"{t['best_head']['value']:.3f} |")
    lines += ["", "Regions -> regions:", ""]
    rel = data["object_relations"]
    if rel is None:
        lines.append(f"- {data['object_relations_note']}")
    else:
        mean = "-" if rel["first_layer_mean"] is None else f"{rel['first_layer_mean']:.3f}"
        lines.append(f"- layer {rel['first_layer']}: the most attended region of another object detects a related object "
                     f"{mean} of the time (mean over heads; best head {rel['first_layer_best']['label']} "
                     f"{rel['first_layer_best']['value']:.3f}); chance {rel['chance']:.3f}; {rel['objects']} objects; "
                     f"{data['object_relations_note']}")
    if data["skipped"]:
        lines += ["", "Skipped: " + ", ".join(f"{k} {v}" for k, v in data["skipped"].items())]
    return "\n".join(lines) + "\n"


def summary_line(data: dict[str, Any]) -> str:
    """One line for the terminal: the best positional heads, the noun / determiner shares, the relations."""
    pos = data["positional"]
    nx, pv = pos["best_next"], pos["best_previous"]
    parts = [f"{data['arch']}, {data['captions']} captions: next-token head {nx['label']} {nx['value']:.3f}, "
             f"previous-token head {pv['label']} {pv['value']:.3f} (uniform {pos['uniform']:.3f})"]
    if data["pos_shares"] is not None:
        tags = data["pos_shares"]["tags"]
        parts.append("regions -> words: " + ", ".join(
            f"{t} {tags[t]['mean_share']:.3f} vs {tags[t]['token_share']:.3f} of tokens"
            for t in ("NOUN", "PRON", "DET") if t in tags and tags[t]["mean_share"] is not None))
    else:
        parts.append(data["pos_note"])
    rel = data["object_relations"]
    if rel is not None and rel["first_layer_mean"] is not None:
        parts.append(f"regions -> regions layer {rel['first_layer']}: related object {rel['first_layer_mean']:.3f} "
                     f"(chance {rel['chance']:.3f})")
    else:
        parts.append(data["object_relations_note"])
    return "; ".join(parts)


def config_from_args(args: list[str], base: dict | None = None) -> AttentionGraphsConfig:
    return apply_overrides(from_dict(AttentionGraphsConfig, base or {}), args)
