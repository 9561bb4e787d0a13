"""Pre-training on more than image-caption pairs: the pieces `recipes/pretrain.py` uses for
`--text_corpus` (text-only samples), `nsp` (next-sentence prediction on its documents) and
`--unpaired_images` (H-VisualBERT's image-only samples).

  VL-BERT §3.3     each mini-batch draws from Conceptual Captions and BooksCorpus & Wikipedia at 1:1:
                   `--text_corpus=FILE --text_ratio=0.5` puts round(B x 0.5) text-only samples <Text, ∅>
                   in every batch of B (the rest are caption pairs); they train MLM only.
  W-VisualBERT §3  W-VisualBERT's text-only batches (the unpaired schedule) come from the corpus or the
                   captions, each batch from one of them (§4.2.1: "3M captions from CC, and 2.5M text segments
                   from BookCorpus"; the released code's batch sampler): `--text_ratio` is then the share of
                   text-only updates and `--corpus_share` the share of those that read the corpus
                   (`reads_corpus`). With `nsp` in --objectives, the corpus's samples are sentence pairs
                   (footnote 4); the captions have no next sentence and train MLM only.
  W-VisualBERT §4.3 H-VisualBERT: caption pairs plus images whose captions are withheld
                   (`--unpaired_images=FILE`, the world's unpaired_images.txt), round(B x --unpaired_ratio)
                   of them per batch, trained with the image objectives only.

Every source is its own resumable stream (`training.loop.batches`) with its own position in the checkpoint
(`data["text"]`, `data["image_only"]` beside the captions' epoch and offset) and its own seed, so an
interrupted run resumes exactly. A streamed run (`--shards`) streams its text corpus and its image-only set
too, from text-only shards (`--text_corpus=INDEX.json`) and from shards of image-only samples
(`--unpaired_images=INDEX.json`; `StreamedSources`): each rank its own chunks of documents
(`data.pretrain_stream.stream_documents`) and of images (`stream_examples(kind="image")`), their positions
saved beside its caption stream's. Text-only
samples need a single-stream model: the two-stream models' cross-attention layers attend from the words
to the regions, and a text-only sample has none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from vlberts.data.coco import CaptionRef
from vlberts.data.pretrain import ImageOnlyData
from vlberts.data.pretrain_stream import StreamPosition, WorkerPositions
from vlberts.data.sampling import EpochBatchSampler, Position
from vlberts.data.text_corpus import TextOnlyData, read_image_ids
from vlberts.errors import VlbertsError
from vlberts.objectives.text import mix_schedule
from vlberts.training.distributed import DistInfo, rank_slice
from vlberts.training.loop import batches

SINGLE_STREAM = ("visualbert", "vlbert", "wvisualbert")
TEXT_SEED, IMAGE_SEED = 0x54455854, 0x494D4147  # "TEXT", "IMAG": the extra streams' seed keys
CORPUS_SEED = 0x434F5250  # "CORP": the key of W-VisualBERT's corpus-or-captions schedule


def stream_seed(seed: int, key: int) -> int:
    """A source's own seed (sampling order and per-example randomness), derived from the run's seed."""
    return int(np.random.SeedSequence([seed, key]).generate_state(1)[0])


def reads_corpus(cfg: Any, step: int) -> bool:
    """Whether W-VisualBERT's text-only update `step` reads the --text_corpus (else the captions): a share
    `--corpus_share` of them, placed by `mix_schedule` with the run's own key, so stateless in `step` and the
    same in a resumed run. False without a corpus."""
    if not cfg.text_corpus:
        return False
    return mix_schedule(step, cfg.corpus_share, stream_seed(cfg.seed, CORPUS_SEED)) == "text"


def check_streamed_sources(cfg: Any, streamed: bool) -> None:
    """Which extra sources a streamed run (`--shards`) can read, checked before any is opened: a text corpus
    as text-only shards and H-VisualBERT's image-only set as shards of image-only samples (and only then)."""
    if cfg.unpaired_images and streamed != cfg.unpaired_images.endswith(".json"):
        raise VlbertsError(
            "with --shards, --unpaired_images is the index json of shards holding image-only samples (python -m "
            "vlberts.data.shards --store FILE --out DIR, without --captions), streamed as the captions are"
            if streamed else "--unpaired_images=INDEX.json streams image-only shards, which a streamed run (--shards) "
            "reads; without --shards give a file of image ids, one per line", path=cfg.unpaired_images)
    if cfg.text_corpus and streamed != cfg.text_corpus.endswith(".json"):
        raise VlbertsError(
            "with --shards, --text_corpus is the index json of text-only shards (python -m vlberts.data.shards "
            "--documents FILE --out DIR), streamed as the captions are" if streamed else
            "--text_corpus=INDEX.json streams text-only shards, which a streamed run (--shards) reads; without "
            "--shards give the corpus as a text file (BERT's format)", path=cfg.text_corpus)


def check_sources(cfg: Any, arch: str, model_cfg: Any, weights: dict[str, float], unpaired: bool) -> None:
    """One-line errors for settings the extra sources cannot run with."""
    if cfg.text_corpus and arch not in SINGLE_STREAM:
        raise VlbertsError(
            f"--text_corpus: {arch} is two-stream; its cross-attention layers attend from the words to the regions "
            f"and a text-only sample has none; text-only samples work with {', '.join(SINGLE_STREAM)}")
    if "nsp" in weights and not cfg.text_corpus:
        raise VlbertsError("objective nsp needs text documents: --text_corpus=FILE")
    if not 0.0 < cfg.text_ratio < 1.0:
        raise VlbertsError(f"--text_ratio must be in (0, 1), got {cfg.text_ratio}")
    if cfg.unpaired_images and not (arch == "wvisualbert" and getattr(model_cfg, "variant", "") == "H"):
        raise VlbertsError("--unpaired_images is H-VisualBERT's extra image-only data (W-VisualBERT §4.3); "
                           "use an H model (wvisualbert-h, wvisualbert-h-tiny)")
    if not 0.0 <= cfg.unpaired_ratio < 1.0:
        raise VlbertsError(f"--unpaired_ratio must be in [0, 1), got {cfg.unpaired_ratio}")
    if cfg.unpaired_ratio and not cfg.unpaired_images:  # else the ratio would be silently ignored
        raise VlbertsError(f"--unpaired_ratio={cfg.unpaired_ratio:g} is the share of --unpaired_images' image-only "
                           "samples in every batch; give --unpaired_images too")


def mix_weights(cfg: Any, recipe: Any, model_cfg: Any, weights: dict[str, float]) -> dict[str, float]:
    """The run's objectives with what its extra sources add. Text-only samples mixed into the caption batches
    (--text_corpus) train `mlm_text`, a mean of their own masked words beside the captions' `mlm`, at mlm's
    weight unless --objectives gives it (VL-BERT's released loss adds the two streams' means, `mlm_loss_wvc +
    mlm_loss_aux`, so that the captions' few masked words are not outweighed by the documents' many).
    W-VisualBERT's paper recipe (empty --objectives) trains next-sentence prediction on a document corpus when
    the model has the head (footnote 4: "when long documents are available")."""
    unpaired = recipe.unpaired(model_cfg)
    if "mlm_text" in weights and (unpaired or not cfg.text_corpus):
        raise VlbertsError("objective mlm_text is the masked words of the text-only samples that --text_corpus mixes "
                           "into the caption batches" + ("; W-VisualBERT's own text-only batches train mlm" if unpaired
                                                         else ": give --text_corpus"))
    if cfg.text_corpus and not unpaired and "mlm" in weights and "mlm_text" not in weights:
        weights = {**weights, "mlm_text": weights["mlm"]}
    if cfg.text_corpus and not cfg.objectives.strip() and unpaired and "nsp" in recipe.available(model_cfg):
        return {**weights, "nsp": 1.0}
    return weights


def withhold_captions(cfg: Any, captions: list[CaptionRef], store: Any) -> tuple[list[CaptionRef], list[str]]:
    """H-VisualBERT: the captions of the `--unpaired_images` images are withheld; returns the remaining
    captions and the image-only set (ids in file order). Ids the store lacks are an error."""
    if not cfg.unpaired_images:
        return captions, []
    ids = read_image_ids(cfg.unpaired_images)
    missing = [i for i in ids if i not in store]
    if missing:
        raise VlbertsError(f"image id {missing[0]} not in the feature store ({len(missing)} ids affected)",
                           path=cfg.unpaired_images, record=missing[0])
    held = set(ids)
    kept = [c for c in captions if c.image_id not in held]
    if not kept:
        raise VlbertsError("every captioned image is in the image-only set: no caption pairs are left",
                           path=cfg.unpaired_images)
    return kept, ids


def batch_split(cfg: Any, unpaired: bool, n_pair_images: int, n_image_only: int) -> dict[str, int]:
    """Examples per global batch from each source: captions, text-only, image-only."""
    B = cfg.batch_size
    n_text = round(B * cfg.text_ratio) if cfg.text_corpus and not unpaired else 0
    n_img = 0
    if n_image_only:
        # Default: the image-only set's share of all images (what sampling images uniformly would give).
        ratio = cfg.unpaired_ratio or n_image_only / (n_image_only + n_pair_images)
        n_img = max(1, round(B * ratio))
    split = {"pairs": B - n_text - n_img, "text": n_text, "image_only": n_img}
    if split["pairs"] < 1 or (cfg.text_corpus and not unpaired and n_text < 1):
        raise VlbertsError(f"--batch_size={B} cannot hold {n_text} text-only, {n_img} image-only samples and at "
                           "least one caption pair: use a larger batch or smaller ratios")
    return split


@dataclass(frozen=True)
class SourcePosition:
    """Where every source stands: the captions' (epoch, offset) at the top level (what a caption-only run
    saves), each extra source's under its name."""

    state: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return dict(self.state)


def _draw_examples(next_of: Callable[[str], list[dict]], streams: Any, unpaired: bool, source: str | None,
                   corpus: bool) -> list[dict]:
    """One draw's examples from a run's sources (`Sources`, `StreamedSources`): W-VisualBERT's whole batch from
    one source (text from the corpus or the captions), or a mixed batch: pairs first, then text-only, then
    image-only samples, from those of them the run reads (`streams`)."""
    if unpaired:
        return next_of("text" if source == "text" and corpus else "pairs")
    return [e for name in ("pairs", "text", "image_only") if name in streams for e in next_of(name)]


def _examples(items: list[dict]) -> list[dict]:
    """The identity collate: a batch of examples, collated after the sources are joined."""
    return items


class Sources:
    """The batches of a run that reads more than captions: `draw(source)` returns (batch, SourcePosition).
    `source` is the unpaired schedule's ("text" / "image") for W-VisualBERT, else None (a mixed batch)."""

    def __init__(self, streams: dict[str, Iterator[tuple[list[dict], Position]]], split: dict[str, int],
                 collate: Callable[[list[dict]], Any], start: dict[str, Any], unpaired: bool):
        self.streams, self.split, self.collate, self.unpaired = streams, split, collate, unpaired
        self.state = {"epoch": int(start.get("epoch", 0)), "offset": int(start.get("offset", 0)),
                      **{k: start.get(k, Position().to_dict()) for k in streams if k != "pairs"}}

    def _next(self, name: str) -> list[dict]:
        examples, pos = next(self.streams[name])
        if name == "pairs":
            self.state.update(pos.to_dict())
        else:
            self.state[name] = pos.to_dict()
        return examples

    def draw(self, source: str | None, corpus: bool = True) -> tuple[Any, SourcePosition]:
        examples = _draw_examples(self._next, self.streams, self.unpaired, source, corpus)
        return self.collate(examples), SourcePosition(dict(self.state))


def build_sources(
    cfg: Any, *, data: Any, collate: Callable[[list[dict]], Any], start: dict[str, Any], tok: Any, store: Any,
    documents: list[list[str]], feature_dim: int, weights: dict[str, float], unpaired: bool, image_only: list[str],
    region_setup: Any, dist: DistInfo, lengths: Any = None,
) -> Sources:
    """The caption stream plus the text-only and image-only streams this run reads (module docstring)."""
    split = batch_split(cfg, unpaired, len(data.images), len(image_only))
    sizes = {"pairs": cfg.batch_size if unpaired else split["pairs"], "text": cfg.batch_size if unpaired else split["text"],
             "image_only": split["image_only"]}
    sources: dict[str, Any] = {"pairs": data}
    if documents:
        if "nsp" in weights and len(documents) < 2:
            raise VlbertsError("objective nsp needs at least two documents (blank-line separated)", path=cfg.text_corpus)
        if "nsp" in weights and all(len(d) == 1 for d in documents):  # every pair NotNext: a constant to learn
            raise VlbertsError(f"objective nsp needs documents of two sentences or more, and all {len(documents)} hold "
                               "one (a blank line after every sentence?): no sentence has a next one",
                               path=cfg.text_corpus)
        sources["text"] = TextOnlyData(
            documents, tok, feature_dim=feature_dim, max_text_len=cfg.max_text_len,
            mlm_prob=cfg.mlm_prob, seed=stream_seed(cfg.seed, TEXT_SEED), nsp="nsp" in weights,
            whole_word=data.continuation_ids is not None,  # masked as the captions are (VL-BERT: whole words)
        )
    if image_only:
        sources["image_only"] = ImageOnlyData(
            image_only, store, tok, max_regions=cfg.max_regions, seed=stream_seed(cfg.seed, IMAGE_SEED),
            feature_dim=feature_dim, region_setup=region_setup,
        )
    streams = {}
    for name, ds in sources.items():
        pos = Position.from_dict({**Position().to_dict(), **(start if name == "pairs" else start.get(name, {}))})
        if name == "pairs":  # the captions' stream as in a caption-only run
            streams[name] = batches(
                ds, _examples, batch_size=sizes[name], seed=cfg.seed, start=pos, num_workers=cfg.num_workers,
                dist=dist, lengths=lengths, group=cfg.length_group,
            )
        else:
            key = TEXT_SEED if name == "text" else IMAGE_SEED
            streams[name] = fixed_batches(ds, sizes[name], stream_seed(cfg.seed, key), pos, dist)
    return Sources(streams, split, collate, start, unpaired)


def fixed_batches(data: Any, size: int, seed: int, start: Position, dist: DistInfo) -> Iterator[tuple[list[dict], Position]]:
    """Endless batches of exactly `size` examples of `data` (this rank's slice of them), in the resumable
    order of `EpochBatchSampler`, running on into the next epoch instead of ending one with a short batch:
    the share of each source in a batch stays the set ratio however small the source. Examples are made in
    this process (text-only and image-only examples are cheap)."""
    order = EpochBatchSampler(len(data), 1, seed, start).iter_with_positions()
    while True:
        keys, pos = [], start
        for _ in range(size):
            (key,), pos = next(order)
            keys.append(key)
        yield [data[k] for k in rank_slice(keys, dist)], pos


@dataclass(frozen=True)
class StreamedPositions:
    """Where a rank of a streamed run with more than a caption stream stands in each of its streams (the
    caption stream's: one position, or its loader workers' `WorkerPositions`; None: a stream it does not read)."""

    pairs: StreamPosition | WorkerPositions
    text: StreamPosition | None = None
    image_only: StreamPosition | None = None

    def to_dict(self) -> dict[str, Any]:
        keys = {"pairs": "stream", "text": "text_stream", "image_only": "image_stream"}
        return {key: pos.to_dict() for name, key in keys.items() if (pos := getattr(self, name)) is not None}


def streamed_batch_sizes(split: dict[str, int], unpaired: bool, dist: DistInfo) -> dict[str, int]:
    """Examples per rank and draw of a streamed run's caption, text and image-only streams: their shares of
    the mixed batch (`batch_split`), or W-VisualBERT's whole batch from the caption or the text stream;
    shares that do not divide among the ranks are a one-line error."""
    B = sum(split.values())
    if unpaired:
        return {"pairs": B // dist.world, "text": B // dist.world}
    uneven = [f"{split[k]} {k}" for k in ("pairs", "text", "image_only") if split[k] % dist.world]
    if uneven:
        ratios = [f"--{name}={split[k] / B:g}" for k, name in (("text", "text_ratio"), ("image_only", "unpaired_ratio"))
                  if split[k]]
        raise VlbertsError(f"with --shards each of the {dist.world} ranks streams its share of a batch: "
                           f"--batch_size={B}{' with ' + ' and '.join(ratios) if ratios else ''} gives "
                           f"{' and '.join(uneven)} examples, not multiples of {dist.world}")
    return {k: split[k] // dist.world for k in ("pairs", "text", "image_only") if split[k]}


class StreamedSources:
    """A streamed run's batches when it also streams text-only documents or image-only samples: this rank's
    share of every batch from its caption stream and its other streams, as `Sources` mixes them (`draw`:
    mixed batches, or W-VisualBERT's whole batches from one source). Every stream gives (examples, position)
    pairs of the sizes `streamed_batch_sizes` sets (`data.pretrain_stream.stream_batches` or `worker_batches`
    over uncollated examples); the examples are collated here, after they are joined."""

    def __init__(self, streams: dict[str, Iterator[tuple[list[dict], Any]]], collate: Callable[[list[dict]], Any],
                 unpaired: bool, start: StreamedPositions):
        self.streams, self.collate, self.unpaired, self.position = streams, collate, unpaired, start

    def _next(self, name: str) -> list[dict]:
        examples, pos = next(self.streams[name])
        self.position = replace(self.position, **{name: pos})
        return examples

    def draw(self, source: str | None, corpus: bool = True) -> tuple[Any, StreamedPositions]:
        return self.collate(_draw_examples(self._next, self.streams, self.unpaired, source, corpus)), self.position


def draw(stream: Any, source: str | None, corpus: bool = True) -> tuple[Any, Any]:
    """The next (batch, position) of a run's stream: a `Sources` (or `StreamedSources`) picks by the update's
    source (and, for W-VisualBERT's text-only updates, `corpus`: the corpus or the captions)."""
    return stream.draw(source, corpus) if isinstance(stream, (Sources, StreamedSources)) else next(stream)
