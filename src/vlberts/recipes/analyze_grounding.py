"""Recipe: entity and syntactic grounding by attention heads ("What Does BERT with Vision Look At?",
§3.1, Figure 3, Table 2, Figure 4).

    read the split's Flickr30K Entities captions and boxes; tokenise; keep the grounded phrases
    read the split's dependency parses, if any (CoNLL-U, keyed by sent_id "<image id>_<caption index>")
    run the pre-trained model on `[CLS] caption [SEP]` + the image's regions, with attention maps
    per caption: text-to-region attention of every head -> GroundingAccumulator
                 and, with a parse whose words match the caption's, -> SyntacticAccumulator,
                 with its text-to-text attention -> TextSyntaxAccumulator (syntactic heads among the words)
    write the numbers, Figures 3 and 4 and the tables

    OUT/run_config.json            every setting of the run, defaults included (written before the forward passes)
    OUT/grounding.json             every head's accuracy and region mass, baseline, upper bound, options,
                                   skips; "syntactic_grounding": per relation the same, Table 2, counts;
                                   "text_syntax": per relation and direction, each head's accuracy at
                                   finding the other word of the arc in the text, and the best fixed offset
    OUT/entity_grounding.png       Figure 3: accuracy per head by layer, baseline line, active heads large
    OUT/syntactic_grounding.png    Figure 4: the same per relation (pobj, nsubj, amod), when parses ran
    OUT/grounding.md               the best heads, per-layer numbers and Table 2 as Markdown
    OUT/explorer.html              the attention explorer (vlberts.analysis.explorer): the first
                                   `explorer_examples` analysed captions, each word's attention per head
                                   drawn over the image with the gold boxes; self-contained, no network
    OUT/qualitative/<caption id>.png  Figures 1/5 (vlberts.analysis.qualitative): for `--qualitative` captions
                                   (the first N with at least 2 grounded entities, or those named by
                                   `--qualitative_captions`), the best head of 4 layers spread over the
                                   network, each entity word's most-attended region drawn over the image

Parses (`--parses`, `--parser`): "auto" (default) reads `<entities>/../parses/<split>.conllu`, where the embedded
world writes its gold parses, when that file exists; a path reads that CoNLL-U file (e.g. a parser's
output for real Flickr30K captions, one sentence per caption, `# sent_id = <image id>_<caption index>`
with the caption index the 0-based line of Sentences/<image id>.txt); "none" skips syntactic grounding.
`--parser spacy:PIPELINE` parses the captions with an installed spaCy pipeline instead (the optional extra
`vlberts[parse]`; `vlberts.data.spacy_parse`): spaCy's tokens are aligned to the caption's words and its
ClearNLP labels mapped to the Stanford labels of Table 2 (compound -> nn, nummod -> num, acl -> partmod, ...);
a caption whose tokens cannot be aligned is skipped and counted, its message in grounding.json.
Without parses only entity grounding runs and the report says so. A caption without a parse, whose
parse's words differ from the caption's words, or whose heads do not lead every word to a root (a cycle), is skipped
by the syntactic analysis and counted with its caption id; entity grounding still uses it.

`--mask_pos=ADJ[,VERB,...]` (a diagnostic, not the paper's analysis) replaces every subword of the words
with those parts of speech (UPOS, from the parses) by [MASK] before the forward passes, so that the heads
are read where the model has to predict those words, as in pre-training; captions without a parse of
their words are then left out, and the outputs say what was masked.

Images for the explorer and the qualitative figures (`--images`): "auto" (default) reads
`<entities>/../images`, where the embedded world writes `{image id:012d}.png`, when that directory exists;
a directory (files `<image id>.jpg`/`.png` or the world's names); "none". An image not found is drawn as a
grey canvas (in the explorer marked "image not available"), counted in grounding.json ("figure_images") and in a
warning line; a directory given as --images=DIR that holds none of the images drawn is an error.

The choices the paper leaves open are options with documented defaults (`GroundingOptions`; the
syntactic ones in `vlberts.analysis.syntactic`).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vlberts.analysis.attention_graphs import UPOS_TAGS
from vlberts.analysis.entities import EntityCaption, SkipCounts, entity_captions, grounding_inputs, mask_words_by_pos
from vlberts.analysis.explorer import ExplorerExample, ExplorerInfo, explorer_example, write_explorer
from vlberts.analysis.figures import save_head_accuracy_figure, save_syntactic_grounding_figure
from vlberts.analysis.grounding import (
    BREAKDOWNS, EntityBreakdown, GroundingAccumulator, GroundingInput, GroundingOptions, GroundingResult,
)
from vlberts.analysis.qualitative import default_heads, pick_records, save_qualitative_figure
from vlberts.analysis.report import breakdown_markdown, md_text, summary_markdown, syntactic_summary_markdown
from vlberts.analysis.syntactic import (
    DIRECTIONS,
    FIGURE4_RELATIONS,
    ParseMismatch,
    ParseNotTree,
    QueryWordBreakdown,
    SyntacticAccumulator,
    SyntacticInput,
    SyntacticResult,
    arcs_from_parse,
    direction_key,
)
from vlberts.analysis.text_syntax import TextSyntaxAccumulator, TextSyntaxResult
from vlberts.config import apply_overrides, from_dict
from vlberts.data.conllu import ConlluSentence, read_conllu
from vlberts.data.flickr_entities import FlickrEntitiesImage
from vlberts.data.flickr_entities_dataset import read_split_images
from vlberts.data.spacy_parse import load_spacy, parse_captions, parser_name
from vlberts.data.vqa_dataset import model_tag_subwords
from vlberts.errors import BadRecords, VlbertsError
from vlberts.features.identity import warn_feature_mismatch
from vlberts.features.store import RegionStore
from vlberts.io import atomic_open, nan_as_null, require_file, write_json
from vlberts.models.builders import reads_tags
from vlberts.recipes.common import autocast, fit_text_len, opt, progress, resolve_device, start_recipe, write_run_config
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import load_attention_model


@dataclass(frozen=True)
class GroundingConfig:
    model: str = opt("", "vlberts model directory: a pretrain run's RUN/model, or a finetune run's (its encoder is read)")
    entities: str = opt("", "Flickr30K Entities root: Sentences/, Annotations/, {train,val,test}.txt")
    features: str = opt("", "region store holding the split's images (with detection confidences, for the baseline)")
    split: str = opt("test", "which split's images to analyse (the paper: the evaluation set)")
    out: str = opt("runs/grounding", "output directory")
    token: str = opt("last", "subword standing for an entity: last, first, head_mean, mean (see GroundingOptions)")
    iou_rule: str = opt("any", "any: IoU with any gold box (BAN/VisualBERT); union: with the union box (Plummer et al.)")
    iou_threshold: float = opt(0.5, "a region agrees with the annotation at IoU >= this")
    active_threshold: float = opt(0.2, "heads with more than this mean share of attention on regions are 'active'")
    baseline: str = opt("confidence", "confidence: the paper's baseline, the most confident region (the store must "
                        "hold detection confidences); none: no baseline (n/a in the reports), for stores without "
                        "them (BUTD 6-field TSVs, BAN HDF5)")
    max_images: int = opt(0, "analyse only the split's first N images (0: all)")
    skip_bad: bool = opt(False, "drop images whose Sentences/Annotations file is malformed and images missing from "
                         "the store, counting them (a warning and bad_records in grounding.json) instead of stopping")
    max_text_len: int = opt(64, "subwords per caption incl. [CLS]/[SEP]; phrases cut off are skipped")
    max_regions: int = opt(36, "regions per image (the store's first ones)")
    batch_size: int = opt(64, "captions per forward pass")
    device: str = opt("auto", "auto, cpu, cuda, cuda:N")
    precision: str = opt("fp32", "fp32 or bf16 (attention maps are analysed in float32 either way)")
    top_k: int = opt(10, "rows of the best-heads table and of Table 2")
    parses: str = opt("auto", "CoNLL-U parses for syntactic grounding: auto (<entities>/../parses/<split>.conllu "
                      "if present, as the world writes them), a file (sent_id = <image id>_<caption index>), or none")
    parser: str = opt("", "parse the captions with spaCy instead of reading CoNLL-U: spacy:PIPELINE (e.g. "
                      "spacy:en_core_web_sm; needs pip install 'vlberts[parse]' and the pipeline); empty: use --parses")
    relations: str = opt(",".join(FIGURE4_RELATIONS), "relations drawn in the syntactic grounding figure (Figure 4)")
    explorer_examples: int = opt(25, "captions in OUT/explorer.html, the attention explorer (the first N analysed; 0: no explorer)")
    qualitative: int = opt(3, "captions drawn as OUT/qualitative/<caption id>.png (Figures 1/5): the first N "
                           "analysed with at least 2 grounded entities; 0: none")
    qualitative_captions: str = opt("", "comma-separated caption ids (<image id>_<line>) to draw instead of the first N")
    images: str = opt("auto", "images for the explorer and the qualitative figures: auto (<entities>/../images "
                      "if present, as the world writes them), a directory, or none (boxes on a grey canvas)")
    mask_pos: str = opt("", "diagnostic: replace the words of these parts of speech (UPOS from the parses, "
                        "e.g. ADJ or VERB,ADP) by [MASK] before the forward passes, to see where a word looks when "
                        "it has to be predicted; needs parses (the paper's analysis: unmasked, the default)")


CONFIG_CLASS = GroundingConfig


@dataclass
class GroundingReport:
    result: GroundingResult
    skipped: dict[str, int]
    maps: str  # which attention maps were read
    seconds: float
    paths: dict[str, Path]
    syntactic: SyntacticResult | None = None  # None when no parses were available
    syntactic_note: str = ""  # where the parses came from, or why syntactic grounding did not run
    parse_failures: dict[str, str] = field(default_factory=dict)  # caption id -> why the parser's tokens did not align
    mask_pos: list[str] = field(default_factory=list)  # --mask_pos as UPOS tags (empty: nothing masked)
    mask_note: str = ""  # with --mask_pos: which words were masked, in how many captions
    text_syntax: TextSyntaxResult | None = None  # syntactic heads among the words (None: no parses)
    bad_records: dict = field(default_factory=dict)  # --skip_bad: images dropped, by kind, and the first message
    model_task: str = ""  # the task a fine-tuned model was trained on ("": a pre-trained model)
    figure_images: dict = field(default_factory=dict)  # --images: directory, images drawn, how many not found there
    breakdowns: dict = field(default_factory=dict)  # "type" / "last_word" -> [BreakdownRow]: accuracy by kind of entity
    syntactic_by_word: dict = field(default_factory=dict)  # "amod (dep->head)" -> [BreakdownRow] by the query word
    feature_mismatch: str | None = None  # how the store's features differ from the model's (None: they do not)


def resolve_parses(cfg: GroundingConfig) -> tuple[Path | None, str]:
    """The CoNLL-U file to read (or None) and a sentence for the report saying which and why."""
    if getattr(cfg, "parser", ""):
        return None, f"parses: spaCy pipeline {parser_name(cfg.parser)} (--parser {cfg.parser}), labels mapped to Stanford"
    if cfg.parses == "none":
        return None, "syntactic grounding not run (--parses=none); only entity grounding ran"
    if cfg.parses == "auto":
        path = Path(cfg.entities).parent / "parses" / f"{cfg.split}.conllu"
        if not path.exists():
            return None, (f"syntactic grounding not run: no parses ({path} does not exist; pass "
                          "--parses=FILE.conllu); only entity grounding ran")
        return require_file(path), f"parses: {path} (found next to the entities, as the embedded world writes them)"
    path = require_file(cfg.parses)
    return path, f"parses: {path}"


def load_parses(cfg: GroundingConfig, captions: list[EntityCaption], nlp=None
                ) -> tuple[dict[str, ConlluSentence] | None, dict[str, str], str]:
    """The captions' parses keyed by caption id (None: no parses), the captions a parser could not align
    (caption id -> message) and the report's sentence on where the parses came from.

    `--parser spacy:PIPELINE` parses the captions with spaCy (`vlberts.data.spacy_parse`; `nlp` stands in
    for the pipeline in tests); otherwise `--parses` names a CoNLL-U file (`resolve_parses`), one of whose
    `sent_id`s at least must name a caption (a file under another id convention would analyse nothing).
    """
    path, note = resolve_parses(cfg)
    if getattr(cfg, "parser", ""):
        nlp = nlp or load_spacy(cfg.parser)
        parses, failed = parse_captions(((c.caption_id, c.words) for c in captions), nlp)
        return parses, failed, note
    if not path:
        return None, {}, note
    parses = read_conllu(path)
    if captions and not any(c.caption_id in parses for c in captions):
        first = next(iter(parses), None)
        raise VlbertsError(f"no sent_id names a caption of split {cfg.split!r} ({len(parses)} parses"
                           + (f", the first {first!r}" if first is not None else "") + "): a caption's parse is "
                           f"'# sent_id = <image id>_<caption index>', e.g. {captions[0].caption_id!r} for caption "
                           f"{captions[0].caption_id.rsplit('_', 1)[-1]} (0-based, blank lines not counted) of "
                           f"Sentences/{captions[0].image_id}.txt", path=path)
    return parses, {}, note


def resolve_images(cfg: GroundingConfig) -> Path | None:
    """The directory holding the images for the explorer (`--images`), or None."""
    if cfg.images == "none":
        return None
    if cfg.images == "auto":
        path = Path(cfg.entities).parent / "images"
        return path if path.is_dir() else None
    path = Path(cfg.images)
    if not path.is_dir():
        raise VlbertsError("images directory not found (--images)", path=path)
    return path


def image_names(image_id: str) -> list[str]:
    """The file names an image may have in an --images directory, in the order tried: the world's
    `{id:012d}.png`, then `<id>.jpg` and `<id>.png`."""
    names = [f"{image_id}.jpg", f"{image_id}.png"]
    if image_id.isdigit():
        names.insert(0, f"{int(image_id):012d}.png")
    return names


def image_bytes(images: Path | None, image_id: str) -> bytes | None:
    """The image file's bytes (`image_names`); None if absent."""
    if images is None:
        return None
    for name in image_names(image_id):
        if (images / name).is_file():
            return (images / name).read_bytes()
    return None


def missing_images(cfg: Any, images: Path | None, image_ids: list[str], report: str) -> dict[str, Any]:
    """Before the forward passes: how many of the images the figures draw (`image_ids`, each once) are not
    in the --images directory, for the analysis's JSON report (`report`, named in the warning). None of
    them in a directory given as --images=DIR is a one-line error naming it and the first missing file
    (the wrong directory, or another naming); some missing, or none in the `auto` directory, a warning
    line: those are drawn on a grey canvas. Without a directory (--images=none, or auto finding none) every
    canvas is grey by choice and nothing is counted missing."""
    if images is None or not image_ids:
        return {"directory": None if images is None else str(images), "drawn": len(image_ids), "missing": 0}
    absent = [i for i in image_ids if not any((images / name).is_file() for name in image_names(i))]
    if absent:
        names = image_names(absent[0])
        which = f"image {absent[0]} as {', '.join(names[:-1])} or {names[-1]}"
        if len(absent) == len(image_ids) and cfg.images != "auto":
            raise VlbertsError(f"holds no image the figures draw ({len(image_ids)} needed; first missing: {which}); "
                               "pass the directory holding them, or --images=none", path=images)
        print(f"warning: {images}: {len(absent)} of {len(image_ids)} images the figures draw not found (first: "
              f"{which}); drawn on a grey canvas; count in {report}", file=sys.stderr)
    return {"directory": str(images), "drawn": len(image_ids), "missing": len(absent)}


def parse_mask_pos(value: str) -> list[str]:
    """`--mask_pos` as a list of UPOS tags (empty: nothing masked); an unknown tag lists the valid ones."""
    tags = [t.strip() for t in value.split(",") if t.strip()]
    unknown = [t for t in tags if t not in UPOS_TAGS]
    if unknown:
        raise VlbertsError(f"--mask_pos: unknown part of speech {', '.join(unknown)}; valid (UPOS): {', '.join(UPOS_TAGS)}")
    return tags


def apply_mask_pos(pos: list[str], captions: list[EntityCaption], parses: dict[str, ConlluSentence] | None,
                   tok: TextTokenizer, entities: str) -> tuple[list[EntityCaption], str]:
    """With `--mask_pos`, the captions with those words masked (`entities.mask_words_by_pos`) and the
    report's sentence on it; otherwise the captions as they are and no sentence. (A caption the parser
    could not align has no entry in `parses`, so it is left out with the unparsed ones.)"""
    if not pos:
        return captions, ""
    masked, n_words, left_out = mask_words_by_pos(captions, parses or {}, pos, tok.mask_id)
    if not any(c.entities for c in masked):
        raise VlbertsError(f"--mask_pos: none of the {len(captions)} captions has a parse of its words", path=entities)
    note = (f"words tagged {', '.join(pos)} replaced by [MASK] (--mask_pos): {n_words} words in {len(masked)} "
            f"captions" + (f"; {left_out} captions without a parse of their words left out" if left_out else ""))
    if left_out:
        print(f"warning: --mask_pos left out {left_out} captions without a parse of their words", file=sys.stderr)
    return masked, note


def analyze_grounding(cfg: GroundingConfig, nlp=None) -> GroundingReport:
    """Run the analysis (module docstring) and write its outputs.

    nlp: with `--parser`, a parser to use instead of loading the named spaCy pipeline (any callable text ->
    tokens with spaCy's Token interface, `vlberts.data.spacy_parse.SpacyToken`); tests pass a stand-in."""
    cfg = start_recipe(cfg)
    for key in ("model", "entities", "features"):
        if not getattr(cfg, key):
            raise VlbertsError(f"analyze grounding needs --{key}")
    try:
        options = GroundingOptions(cfg.token, cfg.iou_rule, cfg.iou_threshold, cfg.active_threshold)  # type: ignore[arg-type]
    except ValueError as e:
        raise VlbertsError(str(e)) from None
    if cfg.baseline not in BASELINES:
        raise VlbertsError(f"--baseline must be one of {', '.join(BASELINES)}, got {cfg.baseline!r}")
    out = Path(cfg.out)
    device = resolve_device(cfg.device)
    t0 = time.perf_counter()

    model, model_cfg, meta = load_attention_model(cfg.model)
    cfg = fit_text_len(cfg, model_cfg, cfg.model)
    model.to(device)
    tok = TextTokenizer.load(cfg.model)
    store = RegionStore(cfg.features)
    mismatch = warn_feature_mismatch(store, cfg.model)[1]  # one warning line if the model was trained on other features
    tags = model_tag_subwords(reads_tags(model_cfg), store, tok)  # W-VisualBERT: tags beside the regions

    if cfg.parser and cfg.parses not in ("auto", "none"):
        raise VlbertsError("--parser and --parses=FILE both name parses; give one")
    if cfg.parser and nlp is None:
        nlp = load_spacy(cfg.parser)  # fails now, not after the forward passes
    relations = [r.strip() for r in cfg.relations.split(",") if r.strip()]
    if (cfg.parser or resolve_parses(cfg)[0]) and not relations:
        raise VlbertsError("--relations names no relation to draw")
    if cfg.explorer_examples < 0:
        raise VlbertsError("--explorer_examples must be >= 0")
    if cfg.qualitative < 0:
        raise VlbertsError("--qualitative must be >= 0")
    mask_pos = parse_mask_pos(cfg.mask_pos)
    if mask_pos and not (cfg.parser or resolve_parses(cfg)[0]):
        raise VlbertsError(f"--mask_pos needs parses to find the words' parts of speech; {resolve_parses(cfg)[1]}")
    qual_ids = [c.strip() for c in cfg.qualitative_captions.split(",") if c.strip()]
    images = resolve_images(cfg) if cfg.explorer_examples or cfg.qualitative or qual_ids else None

    split_images, bad = analysis_images(cfg, store)
    skipped = SkipCounts()
    captions = entity_captions(split_images, tok, cfg.max_text_len, skipped)
    # Phrases whose chain has no box in the annotations (not the not-visual and scene ones, which carry none by
    # the format's own rule): named on stderr as well as counted in grounding.json
    if (line := skipped.warning("phrases without a gold box", str(Path(cfg.entities) / "Annotations"), ("no box",))):
        print(line, file=sys.stderr)
    _check_qualitative_ids(qual_ids, captions, cfg.split)
    parses, parse_failed, syntactic_note = load_parses(cfg, captions, nlp)
    captions, mask_note = apply_mask_pos(mask_pos, captions, parses, tok, cfg.entities)
    acc = GroundingAccumulator(options)
    breakdowns = {name: EntityBreakdown(options, key) for name, key in BREAKDOWNS.items()}
    syn = SyntacticAccumulator(options) if parses is not None else None
    text_syn = TextSyntaxAccumulator(options.token) if parses is not None else None
    syn_words = QueryWordBreakdown(options) if parses is not None else None
    shown: list[ExplorerExample] = []  # the explorer's captions, collected from the same forward passes
    drawn: list[ExplorerExample] = []  # the qualitative figures' captions (records shared with the explorer)
    # Which captions those are is decided in split order here: the forward passes come in length order.
    analysed = [c for c in captions if c.entities]
    show_ids = {c.caption_id for c in analysed[: cfg.explorer_examples]}
    with_two = [c for c in analysed if len(c.entities) >= 2]  # the figures draw captions with two entities
    draw_ids = set(qual_ids) or {c.caption_id for c in with_two[: cfg.qualitative]}
    figure_images = missing_images(cfg, images, list(dict.fromkeys(
        c.image_id for c in analysed if c.caption_id in show_ids or c.caption_id in draw_ids)), "grounding.json")
    write_run_config(out, cfg)  # the inputs are read and checked; the forward passes are the long part
    with progress() as bar, autocast(device, cfg.precision):
        task = bar.add_task("entity grounding" if syn is None else "entity + syntactic grounding",
                            total=len(captions), info="")
        maps = ""
        for cap, inp in grounding_inputs(model, captions, store, max_regions=cfg.max_regions, batch_size=cfg.batch_size,
                                         device=device, tag_subwords=tags, text_maps=syn is not None,
                                         baseline=cfg.baseline == "confidence"):
            scores = acc.add(inp)
            for breakdown in breakdowns.values():
                breakdown.add_caption(inp, scores)
            if syn is not None:
                _add_syntactic(syn, parses, cap, inp, parse_failed, text_syn, syn_words)
            to_show, to_draw = cap.caption_id in show_ids, cap.caption_id in draw_ids
            if to_show or to_draw:
                rec = store.get(cap.image_id)
                example = explorer_example(cap, inp, options.token, (rec.image_w, rec.image_h),
                                           image_bytes(images, cap.image_id))
                if to_show:
                    shown.append(example)
                if to_draw:
                    drawn.append(example)
            maps = inp.maps
            bar.advance(task)
    position = {c.caption_id: k for k, c in enumerate(captions)}
    shown.sort(key=lambda e: position[e.caption_id])
    drawn.sort(key=lambda e: position[e.caption_id])
    if acc.n_entities == 0:
        raise VlbertsError(f"no grounded entity in split {cfg.split!r} (skipped: {skipped.to_dict()})", path=cfg.entities)
    result = acc.result()
    L, H = result.accuracy.shape
    explorer_info = ExplorerInfo(L, H, maps, options.token, f"Attention explorer: {cfg.split} split"
                                 + (f" ({mask_note})" if mask_note else ""))
    maps = f"{maps}; {L} layers x {H} heads"

    syntactic = syn.result() if syn is not None else None
    if syn is not None and syn.skipped:  # on stderr as well as in grounding.json: parses the user gave
        first = next(iter(syn.skipped_examples.items()), ("", []))
        source = "" if getattr(cfg, "parser", "") else f"{resolve_parses(cfg)[0]}: "  # the CoNLL-U file read
        print(f"warning: {source}syntactic grounding skipped {sum(syn.skipped.values())} captions ("
              + ", ".join(f"{k}: {v}" for k, v in sorted(syn.skipped.items()))
              + (f"; first: {first[1][0]}, {first[0]}" if first[1] else "") + "); counts in grounding.json",
              file=sys.stderr)

    paths = {"json": out / "grounding.json", "figure": out / "entity_grounding.png", "markdown": out / "grounding.md"}
    if syntactic is not None and syntactic.relations:
        paths["syntactic_figure"] = out / "syntactic_grounding.png"
    if shown:
        paths["explorer"] = out / "explorer.html"
    drawn = pick_records(drawn, cfg.qualitative, qual_ids)
    if drawn:
        paths["qualitative"] = out / "qualitative"
    report = GroundingReport(result, skipped.to_dict(), maps, round(time.perf_counter() - t0, 2), paths,
                             syntactic, syntactic_note, parse_failed, mask_pos, mask_note,
                             None if text_syn is None else text_syn.result(), bad.to_dict(),
                             str(meta.get("task", "")), figure_images,
                             {name: b.rows(result) for name, b in breakdowns.items()},
                             {} if syn_words is None or syntactic is None else syn_words.rows(syntactic), mismatch)
    clear_stale_outputs(out, paths)
    write_json(paths["json"], nan_as_null(_to_json(cfg, report)))  # (a baseline not computed: null)
    save_head_accuracy_figure(result, paths["figure"])
    if "syntactic_figure" in paths:
        absent = [r for r in relations if r not in syntactic.relations and r not in syntactic.by_direction]
        if absent:
            print(f"warning: --relations: no arc labelled {', '.join(absent)} was analysed (valid here: "
                  f"{', '.join(sorted(syntactic.relations))})", file=sys.stderr)
        save_syntactic_grounding_figure(syntactic, paths["syntactic_figure"], relations=relations)
    if "explorer" in paths:
        write_explorer(paths["explorer"], shown, explorer_info, max_examples=cfg.explorer_examples)
    heads = default_heads(result)
    for example in drawn:
        save_qualitative_figure(example, heads, paths["qualitative"] / f"{example.caption_id}.png", token=options.token)
    with atomic_open(paths["markdown"]) as f:
        f.write(summary_markdown(result, cfg.top_k, title=f"Entity grounding ({cfg.split} split)"))
        f.write(f"\nAttention maps: {maps}. Skipped phrases: {_skips(report.skipped)}.\n\n")
        if report.model_task:
            f.write(f"Model: fine-tuned on {md_text(report.model_task)} (its encoder; no head is read).\n\n")
        if report.feature_mismatch:
            f.write(f"Features: {md_text(report.feature_mismatch)}.\n\n")
        if bad.total:
            f.write(f"Images dropped by --skip_bad: {bad.total} ({_skips(dict(bad.counts))}; first: {md_text(bad.first)}).\n\n")
        if mask_note:
            f.write(f"Inputs: {mask_note}.\n\n")
        f.write(breakdown_markdown(report.breakdowns["type"], "By entity type (Flickr30K Entities)", cfg.top_k))
        f.write(breakdown_markdown(report.breakdowns["last_word"], "By the phrase's last word", cfg.top_k,
                                   note="the word the default --token=last reads"
                                   + ("" if options.token == "last" else f" (this run: --token={options.token})")))
        if syntactic is None:
            f.write(f"Syntactic grounding: {syntactic_note}.\n")
        else:
            f.write(syntactic_summary_markdown(syntactic, cfg.top_k, title=f"Syntactic grounding ({cfg.split} split)"))
            f.write(f"\nSyntactic grounding {syntactic_note}.\n")
            f.write("\n## Syntactic grounding by the query word\n\n"
                    "Each relation of --relations, each direction, split by the word whose attention is read "
                    "(lower-cased): the words' counts, baselines, the relation's best head on them, and their "
                    "own best heads.\n\n")
            for key in [direction_key(r, d) for r in relations for d in DIRECTIONS]:
                if key in report.syntactic_by_word:
                    f.write(breakdown_markdown(report.syntactic_by_word[key], key, cfg.top_k, note="query words",
                                               counted="instances"))
            f.write("\n## Syntactic heads among the words (Clark et al., 2019)\n\n"
                    "From each word of an arc, the word each head's attention favours most (summed over a word's "
                    "subwords; [CLS], [SEP] and the word itself left out), against the best fixed offset "
                    "(-1: always the word before). A head that finds the other word here but not its region "
                    "tracks syntax in the text only.\n\n")
            f.write(report.text_syntax.markdown(list(syntactic.counts)[: cfg.top_k]))
    return report


BASELINES = ("confidence", "none")  # --baseline

# What `analyze grounding` may write into OUT besides grounding.json/md and entity_grounding.png (always written)
OPTIONAL_OUTPUTS = ("syntactic_grounding.png", "explorer.html", "qualitative")


def clear_stale_outputs(out: Path, paths: dict[str, Path]) -> None:
    """Before writing into an OUT that held an earlier analysis: remove that run's optional outputs which this
    one does not write (an explorer page, a Figure 4, qualitative figures of other captions), so that every
    file in OUT is this run's. Only the analysis' own file names are touched."""
    for name in OPTIONAL_OUTPUTS:
        old = out / name
        if old.is_dir():  # qualitative/: this run draws its own captions' figures anew
            for png in old.glob("*.png"):
                png.unlink()
        elif old.is_file() and old not in paths.values():  # (a file this run writes is replaced whole)
            old.unlink()


def analysis_images(cfg: Any, store: RegionStore) -> tuple[list[FlickrEntitiesImage], BadRecords]:
    """The split's images an analysis reads (`cfg`: entities, split, max_images, skip_bad), and what
    --skip_bad dropped (a warning on stderr; the caller writes `bad.to_dict()` to its JSON). An image
    missing from the store or with a malformed Sentences/Annotations file stops the analysis unless
    --skip_bad; with nothing left it stops either way."""
    bad = BadRecords(skip=cfg.skip_bad)
    images = read_split_images(cfg.entities, cfg.split, store, bad, max_images=cfg.max_images)
    if bad.total:
        print(bad.warning(), file=sys.stderr)
    if not images:
        raise VlbertsError(f"no image of split {cfg.split!r} is left to analyse ({bad.total} dropped by --skip_bad)",
                           path=Path(cfg.entities) / f"{cfg.split}.txt")
    return images, bad


def _check_qualitative_ids(qual_ids: list[str], captions: list[EntityCaption], split: str) -> None:
    """Before any forward pass: every caption named by --qualitative_captions is analysed (in the split,
    with a grounded entity), so a typo fails now rather than after the run."""
    grounded = {c.caption_id: bool(c.entities) for c in captions}
    for cid in qual_ids:
        if cid not in grounded:
            raise VlbertsError(f"--qualitative_captions: caption {cid!r} is not in the analysed {split!r} images "
                               "(caption ids are <image id>_<line>)")
        if not grounded[cid]:
            raise VlbertsError(f"--qualitative_captions: caption {cid!r} has no grounded entity to draw")


def _add_syntactic(syn: SyntacticAccumulator, parses: dict[str, ConlluSentence], cap: EntityCaption,
                   inp: GroundingInput, parse_failed: dict[str, str] | None = None,
                   text_syn: TextSyntaxAccumulator | None = None, by_word: QueryWordBreakdown | None = None) -> None:
    """Score one caption's arcs, or count why it cannot be (no parse; a parse of other words; a parser's
    tokens that do not align with the caption's words, `parse_failed`); with `text_syn`, also the same
    arcs among the words (`inp.text_attn`); with `by_word`, the instances by their query word."""
    if parse_failed and cap.caption_id in parse_failed:
        syn.skip("parser tokens do not align with the caption's words", cap.caption_id)
        return
    sentence = parses.get(cap.caption_id)
    if sentence is None:
        syn.skip("no parse", cap.caption_id)
        return
    try:
        arcs = arcs_from_parse(sentence, cap.words)
    except ParseMismatch as e:  # the example keeps the first difference
        syn.skip("parse words differ", f"{cap.caption_id} ({str(e).split(': ', 1)[-1]})")
        return
    except ParseNotTree:
        syn.skip("parse has a cycle (a word that reaches no root)", cap.caption_id)
        return
    scores = syn.add(SyntacticInput(inp, cap.word_tokens, cap.entity_words, arcs, cap.caption_id))
    if by_word is not None:
        by_word.add(scores, cap.words)
    if text_syn is not None and inp.text_attn is not None:
        text_syn.add(inp.text_attn, cap.word_tokens, arcs)


def _skips(skipped: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in skipped.items()) or "none"


def _to_json(cfg: GroundingConfig, report: GroundingReport) -> dict[str, Any]:
    return {
        **report.result.to_dict(),
        "split": cfg.split,
        "model": cfg.model,
        "model_task": report.model_task or None,  # fine-tuned on this task: its encoder's maps
        "features": cfg.features,
        "feature_mismatch": report.feature_mismatch,  # as fine-tuning's metrics.json and predict.json keep it
        "attention_maps": report.maps,
        "skipped_phrases": report.skipped,
        "bad_records": report.bad_records,
        "figure_images": report.figure_images,  # the explorer's and figures' images: missing ones drawn grey
        "seconds": report.seconds,
        "syntactic_grounding": None if report.syntactic is None else report.syntactic.to_dict(),
        "syntactic_grounding_note": report.syntactic_note,
        "text_syntax": None if report.text_syntax is None else report.text_syntax.to_dict(),
        # Per caption, why the parser's tokens could not be aligned with its words (the first 20).
        "parser_alignment_failures": dict(list(report.parse_failures.items())[:20]),
        "mask_pos": report.mask_pos,
        "mask_note": report.mask_note,
        # Entity grounding by the entities' Flickr30K Entities type and by their phrase's last word.
        "by_entity_type": [r.to_dict() for r in report.breakdowns.get("type", [])],
        "by_last_word": [r.to_dict() for r in report.breakdowns.get("last_word", [])],
        # Syntactic grounding per relation-direction by the word whose attention is read (its 20 commonest).
        "syntactic_by_query_word": {k: [r.to_dict() for r in rows[:20]] for k, rows in report.syntactic_by_word.items()},
    }


def config_from_args(args: list[str], base: dict | None = None) -> GroundingConfig:
    return apply_overrides(from_dict(GroundingConfig, base or {}), args)
