"""Figures of the grounding analysis (matplotlib, Agg; no pyplot global state).

`head_accuracy_figure` draws the paper's Figure 3: "Entity grounding accuracy of the attention heads
organized by layer. The rule-based baseline is drawn as the grey line." `syntactic_grounding_figure`
draws Figure 4, the same panel for each of several dependency relations (pobj, nsubj, amod).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from vlberts.analysis.grounding import GroundingResult
from vlberts.analysis.syntactic import FIGURE4_RELATIONS, SyntacticResult
from vlberts.io import atomic_path

ACTIVE_COLOR = "#08306b"  # dark blue: heads that look at the image (§3.1 "dark and large dots")
INACTIVE_COLOR = "#9ecae1"  # light blue: heads that mostly look at the words ("light and small dots")
BASELINE_COLOR = "#808080"  # §3.1 / Figure 3: the baseline is "the grey line"



_Build = TypeVar("_Build", bound=Callable)


def plain_text(build: _Build) -> _Build:
    """Build a figure whose text is drawn as it is: captions, words, tokens and class names come from the
    user's files, and a `$` in them is a dollar sign, not the start of matplotlib's mathtext (two of them
    set the words between as maths, or fail to parse and stop the run)."""
    @functools.wraps(build)
    def built(*args, **kwargs):
        with matplotlib.rc_context({"text.parse_math": False}):  # read when each Text is made
            return build(*args, **kwargs)
    return built  # type: ignore[return-value]


@plain_text
def head_accuracy_figure(
    result: GroundingResult,
    *,
    title: str | None = "Entity grounding accuracy of attention heads",
    show_upper_bound: bool = True,
    xlabel: str = "Layer",
    figsize: tuple[float, float] = (6.4, 4.0),
) -> Figure:
    """Figure 3: one dot per head at (layer number, accuracy in %); active heads dark and large,
    inactive light and small; the most-confident-region baseline as a grey line; optionally the upper
    bound (best any head could do with these regions) as a dashed line.

    For two-stream models pass e.g. `xlabel="Cross-attention layer"`.
    """
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    draw_head_accuracy(ax, result, title=title, show_upper_bound=show_upper_bound, xlabel=xlabel)
    fig.tight_layout()
    return fig


def draw_head_accuracy(
    ax,
    result: GroundingResult,
    *,
    title: str | None,
    show_upper_bound: bool = True,
    xlabel: str = "Layer",
    ylabel: str = "Grounding accuracy (%)",
    legend_size: str = "small",
) -> None:
    """Draw one Figure-3-style panel (dots per head by layer, grey baseline line) on a matplotlib Axes.

    Used for entity grounding (Figure 3) and for each relation of syntactic grounding (Figure 4),
    where `result` holds one relation's numbers.
    """
    L, H = result.accuracy.shape
    acc = 100.0 * result.accuracy  # (L, H) percent
    x = np.broadcast_to(np.arange(1, L + 1)[:, None], (L, H))  # (L, H) 1-based layer numbers
    thr = 100.0 * result.options.active_threshold
    # Legend words follow the options' comparison: strict by default, so exactly 20% is inactive.
    above, below = ("\u2265", "<") if result.options.active_inclusive else (">", "\u2264")

    active, inactive = result.active, ~result.active
    # Inactive first so the active heads are drawn on top where dots overlap.
    if inactive.any():
        ax.scatter(x[inactive], acc[inactive], s=10, c=INACTIVE_COLOR, linewidths=0, zorder=2,
                   label=f"heads with {below} {thr:g}% of attention on regions")
    if active.any():
        ax.scatter(x[active], acc[active], s=36, c=ACTIVE_COLOR, linewidths=0, zorder=3,
                   label=f"heads with {above} {thr:g}% of attention on regions")
    has_baseline = np.isfinite(result.baseline_accuracy)  # (not without detection confidences)
    if has_baseline:
        ax.axhline(100.0 * result.baseline_accuracy, color=BASELINE_COLOR, linewidth=1.5, zorder=1,
                   label=f"baseline: most confident region ({100.0 * result.baseline_accuracy:.2f}%)")
    top = max(float(acc.max()), 100.0 * result.baseline_accuracy if has_baseline else 0.0)
    if show_upper_bound:
        ax.axhline(100.0 * result.upper_bound, color="black", linestyle="--", linewidth=1.0, zorder=1,
                   label=f"upper bound ({100.0 * result.upper_bound:.2f}%)")
        top = max(top, 100.0 * result.upper_bound)
    ax.set_xlim(0.5, L + 0.5)
    ax.set_xticks(np.arange(1, L + 1))
    # Head room for the legend; never far past 100%, but a dot at 100% stays whole.
    ax.set_ylim(0.0, min(105.0, top * 1.2 + 2.0))
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="best", fontsize=legend_size, frameon=False)


@plain_text
def syntactic_grounding_figure(
    result: SyntacticResult,
    relations: Sequence[str] = FIGURE4_RELATIONS,
    *,
    show_upper_bound: bool = False,
    xlabel: str = "Layer",
    panel_size: tuple[float, float] = (4.8, 4.0),
) -> Figure:
    """Figure 4: "Accuracy of attention heads of VisualBERT for syntactic grounding on specific
    dependency relationships ("pobj", "nsubj", "amod"). The grey lines denote a baseline that always
    chooses the region with the highest detection confidence." One panel per relation, side by side,
    drawn like Figure 3; a relation with no scored instance gets a panel that says so.
    """
    if not relations:
        raise ValueError("name at least one relation to draw")
    n = len(relations)
    fig = Figure(figsize=(panel_size[0] * n, panel_size[1]))
    FigureCanvasAgg(fig)
    for i, name in enumerate(relations):
        ax = fig.add_subplot(1, n, i + 1)
        if name in result.relations or name in result.by_direction:
            r = result.relation(name)
            draw_head_accuracy(ax, r, title=f"{name} (n = {r.n_entities})",
                               show_upper_bound=show_upper_bound, xlabel=xlabel,
                               ylabel="Grounding accuracy (%)" if i == 0 else "", legend_size="x-small")
        else:
            ax.set_title(name)
            ax.text(0.5, 0.5, f"no {name} arc with a grounded entity", ha="center", va="center",
                    transform=ax.transAxes)
            ax.set_axis_off()
    fig.tight_layout()
    return fig


def save_syntactic_grounding_figure(result: SyntacticResult, path: str | Path, *, dpi: int = 150, **kwargs) -> Path:
    """Write `syntactic_grounding_figure(result, **kwargs)` as a PNG (atomically)."""
    path = Path(path)
    fig = syntactic_grounding_figure(result, **kwargs)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    return path


def save_head_accuracy_figure(result: GroundingResult, path: str | Path, *, dpi: int = 150, **kwargs) -> Path:
    """Write `head_accuracy_figure(result, **kwargs)` as a PNG (atomically); the size in pixels is
    figsize * dpi exactly (no tight bounding box), 960 x 600 by default."""
    path = Path(path)
    fig = head_accuracy_figure(result, **kwargs)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    return path
