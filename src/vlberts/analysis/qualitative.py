"""Qualitative figures in the style of the paper's Figures 1 and 5 (issue 5, item 4).

Figure 1: "Attention weights of some selected heads in a pre-trained visually grounded language model";
Figure 5: "Attention weights of 6 selected heads in VisualBERT where alignments match Flickr30k
annotations". §4: "We show the best heads of 6 layers that achieve the highest entity grounding accuracy".

For one caption (an `ExplorerExample`) and a few heads (by default the best entity-grounding head of
layers spread over the network), one panel per head: the image, and for each grounded entity the region
its word attends to most, as a box in the entity's colour labelled with the word and the attention
weight; the entity's gold boxes dashed in the same colour. Unlike the paper, regions are not grouped
by hand: each entity word shows its single most-attended region.

The entity's word is the one `GroundingOptions.token` reads: the first word for "first", the last word
(the head noun of a Flickr30K phrase) for "last", "head_mean" and "mean" (the record holds one attention
row per word, so "mean" is shown by its last word). The weight is the raw attention probability from the
word to the region (its share of the word's whole attention row, text included), as in Figure 1.

Letters in shape comments: L layers, H heads, W words, R regions.
"""

from __future__ import annotations

import io
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from vlberts.analysis.explorer import ExplorerEntity, ExplorerExample
from vlberts.analysis.figures import plain_text
from vlberts.analysis.grounding import GroundingResult, TokenChoice
from vlberts.io import atomic_path

# Per-entity colours (matplotlib's tab10 without grey), distinguishable on the world's pastel scenes.
ENTITY_COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#17becf", "#e377c2", "#8c564b", "#bcbd22")
MISSING_GREY = 0.55  # canvas level when the image is not available


class TopRegion(NamedTuple):
    """An entity word's most-attended region in one head: word and region indices, attention weight."""

    word: int
    region: int
    weight: float


def entity_word(entity: ExplorerEntity, token: TokenChoice = "last") -> int:
    """The word index standing for the entity (module docstring): first word for "first", else last."""
    return int(entity.first_word) if token == "first" else int(entity.end_word) - 1


def top_regions(record: ExplorerExample, layer: int, head: int, token: TokenChoice = "last") -> list[TopRegion]:
    """For each grounded entity of `record` (in order), its word's most-attended region in head
    (`layer`, `head`), both 0-based. Ties go to the lowest region index. Entities whose word has no
    attention row (cut by the text budget: NaN) or no attention on regions (e.g. a layer before late
    fusion) are left out, as is a word already listed (two entities ending on the same word).
    """
    attn = np.asarray(record.attn, dtype=np.float64)  # (L, H, W, R)
    out: list[TopRegion] = []
    seen: set[int] = set()
    for ent in record.entities:
        w = entity_word(ent, token)
        if w in seen or not 0 <= w < attn.shape[2] or attn.shape[3] == 0:
            continue
        row = attn[layer, head, w]  # (R,)
        if np.isnan(row).any() or not row.max() > 0.0:
            continue
        r = int(np.argmax(row))
        seen.add(w)
        out.append(TopRegion(w, r, float(row[r])))
    return out


def spread_layers(num_layers: int, n: int = 4) -> list[int]:
    """`n` 0-based layer indices spread evenly from the lowest to the top layer (fewer if L < n)."""
    if num_layers <= 0 or n <= 0:
        return []
    return sorted({int(round(x)) for x in np.linspace(0, num_layers - 1, min(n, num_layers))})


def default_heads(result: GroundingResult, n_layers: int = 4) -> list[tuple[int, int]]:
    """The best entity-grounding head (`GroundingResult.best_per_layer`) of `n_layers` layers spread over
    the network (lowest, ..., top), as 0-based (layer, head) pairs: the paper's "best heads" of Figure 5."""
    best = result.best_per_layer
    return [(best[layer].layer, best[layer].head) for layer in spread_layers(result.num_layers, n_layers)]


def decode_image(data: bytes | None, image_size: tuple[int, int], name: str = "") -> np.ndarray:
    """(h, w, 3) uint8 image decoded from a PNG or JPEG file's bytes (Pillow, which matplotlib brings; its own
    `imread` reads PNG only), or a grey canvas of `image_size` (width, height) when there are none; bytes that
    cannot be decoded are drawn grey too, with a warning on stderr naming `name` (what the figure shows)."""
    if data is not None:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(io.BytesIO(data)) as im:
                return np.asarray(im.convert("RGB"))
        except (UnidentifiedImageError, OSError, ValueError) as e:
            print(f"warning: {name or 'an image'}: the image file could not be decoded ({e}); drawn as a grey canvas",
                  file=sys.stderr)
    width, height = image_size
    return np.full((max(1, int(height)), max(1, int(width)), 3), MISSING_GREY)


@plain_text
def qualitative_figure(
    record: ExplorerExample,
    heads: Sequence[tuple[int, int]],
    *,
    token: TokenChoice = "last",
    show_gold: bool = True,
    panel_size: float = 3.2,
) -> Figure:
    """Figures 1/5 for one caption: one panel per 0-based (layer, head), titled "layer l, head h"
    (1-based), with each entity word's most-attended region (`top_regions`) drawn over the image."""
    if not heads:
        raise ValueError("name at least one (layer, head) to draw")
    L, H = np.asarray(record.attn).shape[:2]
    for layer, head in heads:
        if not (0 <= layer < L and 0 <= head < H):
            raise ValueError(f"head ({layer}, {head}) outside the record's {L} layers x {H} heads")
    n = len(heads)
    image = decode_image(record.image, record.image_size, f"caption {record.caption_id}")
    width, height = record.image_size
    fig = Figure(figsize=(panel_size * n, panel_size + 0.9))
    FigureCanvasAgg(fig)
    colour = {entity_word(e, token): ENTITY_COLORS[i % len(ENTITY_COLORS)] for i, e in enumerate(record.entities)}
    for i, (layer, head) in enumerate(heads):
        ax = fig.add_subplot(1, n, i + 1)
        # The world's images are 128 x 128: scaled up with nearest so the pixels stay sharp.
        ax.imshow(image, extent=(0, width, height, 0), interpolation="nearest")
        if show_gold:
            for j, ent in enumerate(record.entities):
                for x1, y1, x2, y2 in np.asarray(ent.gold_boxes, dtype=np.float64).reshape(-1, 4):
                    ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, linestyle="--", linewidth=1.0,
                                           edgecolor=ENTITY_COLORS[j % len(ENTITY_COLORS)], alpha=0.8))
        labels_at: dict[int, int] = {}  # region -> labels already drawn on it (stacked downwards)
        for top in top_regions(record, layer, head, token):
            x1, y1, x2, y2 = np.asarray(record.region_boxes[top.region], dtype=np.float64)
            c = colour[top.word]
            ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, linewidth=2.0, edgecolor=c))
            k = labels_at.get(top.region, 0)
            labels_at[top.region] = k + 1
            ax.annotate(f"{record.words[top.word]} {top.weight:.2f}", xy=(x1, y1), xytext=(2, -2 - 11 * k),
                        textcoords="offset points", va="top", ha="left", fontsize=7, color="white",
                        bbox=dict(boxstyle="square,pad=0.15", facecolor=c, edgecolor="none", alpha=0.9))
        ax.set_xlim(0, width)
        ax.set_ylim(height, 0)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_title(f"layer {layer + 1}, head {head + 1}", fontsize=9)
    caption = " ".join(record.words)
    fig.suptitle("\n".join(textwrap.wrap(caption, width=max(30, int(40 * n)))), fontsize=10)
    fig.tight_layout()
    return fig


def save_qualitative_figure(record: ExplorerExample, heads: Sequence[tuple[int, int]], path: str | Path, *,
                            dpi: int = 150, **kwargs) -> Path:
    """Write `qualitative_figure(record, heads, **kwargs)` as a PNG (atomically)."""
    path = Path(path)
    fig = qualitative_figure(record, heads, **kwargs)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    return path


def pick_records(records: Sequence[ExplorerExample], n: int, caption_ids: Sequence[str] = (),
                 min_entities: int = 2) -> list[ExplorerExample]:
    """The captions to draw: those named by `caption_ids` (in that order; absent ones left out), or else
    the first `n` records with at least `min_entities` grounded entities."""
    if caption_ids:
        by_id = {r.caption_id: r for r in records}
        return [by_id[c] for c in caption_ids if c in by_id]
    return [r for r in records if len(r.entities) >= min_entities][: max(0, n)]
