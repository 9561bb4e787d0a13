"""Figures of the attention graphs (LXMERT App. E, Figures 3-5), matplotlib Agg, no pyplot state.

For one caption (`GraphExample`):
- `language_figure` (Fig. 3): word->word bipartite graphs, the tokens in two columns (queries left,
  keys right), one line per pair with opacity = attention weight, for given heads (the analysis passes
  the heads most specialised to next-word and to previous-word attention);
- `objects_figure` (Fig. 4): on the image, lines between the centres of the region pairs with the
  highest attention in one layer (mean over its heads; `attention_graphs.top_edges`), the regions'
  boxes, line width and opacity by weight;
- `cross_figure` (Fig. 5): per layer of the cross block, bars of the attention each token receives from
  the regions (mean over heads and regions), coloured by POS tag as Fig. 5 marks them (nouns blue,
  pronouns pink, articles/determiners red).

Letters in shape comments: L layers, H heads, T tokens, R regions.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from vlberts.analysis.attention_graphs import top_edges
from vlberts.analysis.figures import plain_text
from vlberts.analysis.qualitative import decode_image
from vlberts.io import atomic_path

LINE_COLOR = "#1f4e9c"
EDGE_COLOR = "#ffd000"  # LXMERT Fig. 4 draws the recovered graph in yellow
TAG_COLORS = {"NOUN": "#1f77b4", "PROPN": "#1f77b4", "PRON": "#e377c2", "DET": "#d62728"}  # Fig. 5's marks
OTHER_COLOR = "#b0b0b0"
MIN_ALPHA = 0.02  # lines fainter than this are not drawn


@dataclass
class GraphExample:
    """One caption's maps, kept for the figures (padding dropped)."""

    caption_id: str
    tokens: list[str]  # (T,) subword strings with [CLS] and [SEP]
    tags: list[str] | None  # (T,) POS tag per token (attention_graphs.token_tags) or None without parses
    language: np.ndarray  # (L_l, H_l, T, T)
    objects: np.ndarray  # (L_o, H_o, R, R)
    cross: np.ndarray  # (L_x, H_x, R, T)
    region_boxes: np.ndarray  # (R, 4) pixels
    image_size: tuple[int, int]  # (width, height)
    image: bytes | None = None


def _save(fig: Figure, path: str | Path, dpi: int = 130) -> Path:
    path = Path(path)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    return path


@plain_text
def language_figure(example: GraphExample, heads: Sequence[tuple[int, int, str]]) -> Figure:
    """One bipartite panel per (layer, head, title) with 0-based layer and head of `example.language`."""
    T = len(example.tokens)
    fig = Figure(figsize=(2.6 * len(heads), 0.9 + 0.24 * T))
    FigureCanvasAgg(fig)
    for n, (layer, head, title) in enumerate(heads):
        ax = fig.add_subplot(1, len(heads), n + 1)
        a = example.language[layer, head]  # (T, T)
        for i in range(T):
            for j in range(T):
                if a[i, j] >= MIN_ALPHA:
                    ax.plot([0, 1], [i, j], color=LINE_COLOR, alpha=float(min(1.0, a[i, j])), linewidth=1.6)
        for i, t in enumerate(example.tokens):
            ax.text(-0.04, i, t, ha="right", va="center", fontsize=8)
            ax.text(1.04, i, t, ha="left", va="center", fontsize=8)
        ax.set_xlim(-0.8, 1.8)
        ax.set_ylim(T - 0.5, -0.5)
        ax.axis("off")
        ax.set_title(f"{title}\nlayer {layer + 1}, head {head + 1}", fontsize=9)
    fig.tight_layout()
    return fig


@plain_text
def objects_figure(example: GraphExample, layer: int, k: int = 5, title: str = "") -> Figure:
    """The image with the `k` strongest region pairs of `layer` (0-based; mean over heads) joined."""
    width, height = example.image_size
    fig = Figure(figsize=(4.2, 4.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.imshow(decode_image(example.image, example.image_size, f"caption {example.caption_id}"), extent=(0, width, height, 0), interpolation="nearest")
    mean = example.objects[layer].mean(0)  # (H, R, R) -> (R, R)
    edges = top_edges(mean, k)
    boxes = np.asarray(example.region_boxes, dtype=np.float64)
    top = max((w for _, _, w in edges), default=1.0) or 1.0
    for r in sorted({i for e in edges for i in e[:2]}):
        x1, y1, x2, y2 = boxes[r]
        ax.add_patch(Rectangle((x1, y1), x2 - x1, y2 - y1, fill=False, linewidth=1.0, edgecolor="white", alpha=0.8))
    for i, j, w in edges:
        (ax1, ay1), (bx1, by1) = ((boxes[i, 0] + boxes[i, 2]) / 2, (boxes[i, 1] + boxes[i, 3]) / 2), \
                                  ((boxes[j, 0] + boxes[j, 2]) / 2, (boxes[j, 1] + boxes[j, 3]) / 2)
        ax.plot([ax1, bx1], [ay1, by1], color=EDGE_COLOR, linewidth=1 + 3 * w / top, alpha=0.35 + 0.65 * w / top)
        ax.plot([ax1, bx1], [ay1, by1], "o", color=EDGE_COLOR, markersize=3)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title or f"regions -> regions, layer {layer + 1}: top {len(edges)} pairs", fontsize=9)
    fig.tight_layout()
    return fig


@plain_text
def cross_figure(example: GraphExample, title: str = "regions -> words") -> Figure:
    """Per cross layer, the mean attention each token receives from the regions (bars)."""
    L = example.cross.shape[0]
    T = len(example.tokens)
    received = example.cross.astype(np.float64).mean(axis=(1, 2))  # (L, H, R, T) -> (L, T)
    colors = [TAG_COLORS.get(t, OTHER_COLOR) for t in example.tags] if example.tags else [LINE_COLOR] * T
    fig = Figure(figsize=(max(4.0, 0.38 * T + 1.2), 1.0 + 1.5 * L))
    FigureCanvasAgg(fig)
    for layer in range(L):
        ax = fig.add_subplot(L, 1, layer + 1)
        ax.bar(np.arange(T), received[layer], color=colors)
        ax.set_xticks(np.arange(T))
        ax.set_xticklabels(example.tokens if layer == L - 1 else [], rotation=60, fontsize=7, ha="right")
        ax.set_ylabel(f"layer {layer + 1}", fontsize=8)
        ax.tick_params(axis="y", labelsize=7)
    legend = " (blue: nouns, pink: pronouns, red: determiners)" if example.tags else ""
    fig.suptitle("\n".join(textwrap.wrap(f"{title}: attention received per token, mean over heads and regions"
                                         f"{legend}", 90)), fontsize=9)
    fig.tight_layout()
    return fig


def save_language_figure(example: GraphExample, heads: Sequence[tuple[int, int, str]], path: str | Path) -> Path:
    return _save(language_figure(example, heads), path)


def save_objects_figure(example: GraphExample, layer: int, path: str | Path, k: int = 5, title: str = "") -> Path:
    return _save(objects_figure(example, layer, k, title), path)


def save_cross_figure(example: GraphExample, path: str | Path, title: str = "regions -> words") -> Path:
    return _save(cross_figure(example, title), path)
