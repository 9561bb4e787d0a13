"""Representation views: word, region and tag representations by class, in t-SNE (W-VisualBERT §5, Figure 2).

W-VisualBERT's Figure 2: "For each of the most frequent 15 object classes ..., we randomly sample at most
50 instances where both the caption contains the label word and the pre-trained Faster R-CNN successfully
detects the object. We feed the instances through each model and take the last layer contextual
representation of the words, the objects, and the tags (when available) and visualize them with t-SNE".
A model that aligns the modalities groups a class's words, regions and tags together.

Here an instance is a grounded entity of a Flickr30K Entities caption (the world writes them; real data
in the same layout works too) whose head word -- the phrase's last word -- is one of the detector's class
names, and whose gold box is overlapped (IoU >= 0.5) by a detected region of that class: the word's
representation is the final state of the head word's last subword, the object's is that region's final
state, and for W-VisualBERT with tags the tag's is the mean final state of that region's tag subwords.
Where the paper is silent: the head word as the label word, IoU >= 0.5 as "successfully detects", the
first such region when several qualify.

Next to the picture, numbers say what it shows without t-SNE's distortions (`nearest_class_agreement`): for
each word, whether its nearest region representation (cosine, in the model's own space) has the word's class,
against the chance of the class mix; and the same for every pair of modalities drawn, one modality with
itself included (a row's nearest *other* row of its kind). Words beside their tags and far from their
regions, or regions grouped by image rather than by class, read off this table as they read off the figure.

t-SNE (van der Maaten & Hinton 2008) is computed here, exactly (O(N^2), fine for the figure's <= 2,250
points): Gaussian input affinities calibrated to a perplexity by bisection, Student-t output affinities,
gradient descent with momentum, early exaggeration and per-parameter gains.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from vlberts.analysis.figures import plain_text
from vlberts.io import atomic_path

MODALITIES = ("word", "region", "tag")
MARKERS = {"word": "o", "region": "^", "tag": "s"}


@dataclass
class RepresentationSet:
    """Final-layer representations (N, D) with their class and modality per row."""

    vectors: np.ndarray  # (N, D)
    classes: list[str]
    modalities: list[str]  # each in MODALITIES
    instances: list[str] = field(default_factory=list)  # per row: which instance (caption id / entity)

    def __post_init__(self) -> None:
        n = len(self.vectors)
        if len(self.classes) != n or len(self.modalities) != n:
            raise ValueError(f"{n} vectors but {len(self.classes)} classes and {len(self.modalities)} modalities")
        bad = sorted(set(self.modalities) - set(MODALITIES))
        if bad:
            raise ValueError(f"unknown modalities {bad}; valid: {', '.join(MODALITIES)}")


def nearest_class_agreement(reps: RepresentationSet, query: str = "word", key: str = "region") -> tuple[float, float]:
    """(% of `query` rows whose nearest `key` row by cosine similarity has the same class, the chance
    rate: the probability that a key drawn at random has the query's class, averaged over the queries).
    With `query == key` a row's nearest *other* row counts, and chance draws among the others."""
    q = np.array([m == query for m in reps.modalities])
    k = np.array([m == key for m in reps.modalities])
    if not q.any() or not k.any():
        raise ValueError(f"no {query} or no {key} representations")
    same = query == key
    if same and q.sum() < 2:
        raise ValueError(f"one {query} representation: it has no other to be nearest to")
    v = reps.vectors / np.maximum(np.linalg.norm(reps.vectors, axis=1, keepdims=True), 1e-12)
    sim = v[q] @ v[k].T  # (Nq, Nk)
    if same:
        np.fill_diagonal(sim, -np.inf)  # not itself
    nearest = sim.argmax(1)  # (Nq,)
    classes = np.array(reps.classes)
    kc = classes[k]
    agree = float((kc[nearest] == classes[q]).mean())
    share = Counter(kc.tolist())
    chance = float(np.mean([(share[c] - same) / (len(kc) - same) for c in classes[q]]))
    return 100 * agree, 100 * chance


def agreement_table(reps: RepresentationSet) -> dict[str, dict[str, tuple[float, float]]]:
    """`nearest_class_agreement` for every (query, key) pair of the modalities present, in MODALITIES order:
    table[query][key] = (agreement %, chance %)."""
    present = [m for m in MODALITIES if reps.modalities.count(m) >= 2]
    return {q: {k: nearest_class_agreement(reps, q, k) for k in present} for q in present}


# --------------------------------------------------------------------------- t-SNE
def _affinities(d2: torch.Tensor, perplexity: float, tol: float = 1e-5, steps: int = 60) -> torch.Tensor:
    """Row-conditional Gaussian affinities P(j|i) whose entropy is log(perplexity), by bisection on each
    row's precision beta = 1 / (2 sigma^2); d2 (N, N) squared distances. Returns the symmetrised joint P."""
    n = d2.shape[0]
    target = float(np.log(perplexity))
    lo = torch.full((n, 1), 0.0, dtype=d2.dtype)
    hi = torch.full((n, 1), float("inf"), dtype=d2.dtype)
    beta = torch.ones(n, 1, dtype=d2.dtype)
    eye = torch.eye(n, dtype=torch.bool)
    d2 = d2.masked_fill(eye, 0.0)
    for _ in range(steps):
        logits = (-d2 * beta).masked_fill(eye, float("-inf"))
        p = torch.softmax(logits, dim=1)
        h = -(p * torch.log(p.clamp_min(1e-300))).sum(1, keepdim=True)  # entropy (nats)
        if (h - target).abs().max() < tol:
            break
        too_flat = h > target  # entropy too high: sharpen (raise beta)
        lo = torch.where(too_flat, beta, lo)
        hi = torch.where(too_flat, hi, beta)
        beta = torch.where(torch.isinf(hi), beta * 2, (lo + hi) / 2)
    P = (p + p.T) / (2 * n)
    return P.clamp_min(1e-12)


def effective_perplexity(perplexity: float, n: int) -> float:
    """The perplexity t-SNE uses for n points: at most (n - 1) / 3, as each point's Gaussian must be able to
    spread over about 3 x perplexity neighbours (van der Maaten's implementations cap it the same way)."""
    return min(perplexity, (n - 1) / 3)


def tsne(x: np.ndarray, *, perplexity: float = 30.0, iterations: int = 750, seed: int = 0,
         exaggeration: float = 12.0, exaggeration_iters: int = 250, learning_rate: float | None = None) -> np.ndarray:
    """(N, D) -> (N, 2) t-SNE embedding (module docstring); deterministic for a seed."""
    n = len(x)
    if n < 3:
        raise ValueError(f"t-SNE needs at least 3 points, got {n}")
    perplexity = effective_perplexity(perplexity, n)
    X = torch.as_tensor(np.asarray(x, dtype=np.float64))
    X = X - X.mean(0)
    P = _affinities(torch.cdist(X, X).square(), perplexity)
    g = torch.Generator().manual_seed(seed)
    Y = torch.randn(n, 2, generator=g, dtype=torch.float64) * 1e-4
    lr = learning_rate if learning_rate is not None else max(n / exaggeration / 4, 50.0)  # Belkina et al. 2019
    velocity = torch.zeros_like(Y)
    gains = torch.ones_like(Y)
    eye = torch.eye(n, dtype=torch.bool)
    for it in range(iterations):
        ex = exaggeration if it < exaggeration_iters else 1.0
        num = 1.0 / (1.0 + torch.cdist(Y, Y).square())  # (N, N) Student-t kernel
        num = num.masked_fill(eye, 0.0)
        Q = (num / num.sum()).clamp_min(1e-12)
        W = (ex * P - Q) * num  # (N, N)
        grad = 4.0 * (W.sum(1, keepdim=True) * Y - W @ Y)  # dC/dY
        same = torch.sign(grad) == torch.sign(velocity)
        gains = torch.where(same, gains * 0.8, gains + 0.2).clamp_min(0.01)
        momentum = 0.5 if it < exaggeration_iters else 0.8
        velocity = momentum * velocity - lr * gains * grad
        Y = Y + velocity
        Y = Y - Y.mean(0)
    return Y.numpy()


# --------------------------------------------------------------------------- figure
@plain_text
def representation_figure(points: np.ndarray, reps: RepresentationSet, *, title: str = "",
                          figsize: tuple[float, float] = (7.5, 6.0)) -> Figure:
    """Figure 2: one point per representation, coloured by class, marker by modality (o word, ^ region,
    s tag)."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    classes = sorted(set(reps.classes))
    colours = {c: f"C{i % 10}" if len(classes) <= 10 else _tab20(i) for i, c in enumerate(classes)}
    cls = np.array(reps.classes)
    mod = np.array(reps.modalities)
    for m in MODALITIES:
        for c in classes:
            sel = (cls == c) & (mod == m)
            if sel.any():
                ax.scatter(points[sel, 0], points[sel, 1], s=14, marker=MARKERS[m], color=colours[c], alpha=0.75,
                           linewidths=0, label=c if m == "word" or not ((cls == c) & (mod == "word")).any() else None)
    for m in MODALITIES:  # the marker legend: grey stand-ins
        if (mod == m).any():
            ax.scatter([], [], marker=MARKERS[m], color="grey", label=f"[{m}]")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5), frameon=False)
    ax.set_xticks([])
    ax.set_yticks([])
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def _tab20(i: int) -> tuple[float, float, float, float]:
    from matplotlib import colormaps

    return colormaps["tab20"](i % 20)


def save_representation_figure(points: np.ndarray, reps: RepresentationSet, path: str | Path, *, dpi: int = 150,
                               **kwargs) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig = representation_figure(points, reps, **kwargs)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=dpi, format="png")
    return path


def sample_instances(classes: Sequence[str], per_class: int, n_classes: int, seed: int) -> list[int]:
    """Indices of at most `per_class` instances of each of the `n_classes` most frequent classes (ties:
    alphabetical), drawn at random with `seed`; in index order."""
    counts = Counter(classes)
    top = sorted(counts, key=lambda c: (-counts[c], c))[:n_classes]
    rng = np.random.default_rng(seed)
    keep: list[int] = []
    for c in top:
        idx = [i for i, k in enumerate(classes) if k == c]
        keep.extend(rng.choice(idx, size=min(per_class, len(idx)), replace=False).tolist())
    return sorted(keep)
