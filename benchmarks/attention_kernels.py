"""Which attention kernel is fastest on these models' short sequences (issue 6, item 2): one attention call,
forward and backward, per SDPA kernel, with and without a key mask, at the shapes of LXMERT-base's and
VisualBERT-base's pre-training step, and what each `--attention_kernel` setting costs a whole step.

    python3 benchmarks/attention_kernels.py [--batch 512] [--repeats 30] [--dropout 0.1] [--json PATH]
    python3 benchmarks/attention_kernels.py --smoke        # a CPU run of the code path, not a measurement

Why: in CUDA graphs, cuDNN's fused attention (PyTorch's own pick on the H200) took 25% of LXMERT-base's
kernel time at batch 512 for 0.7% of its FLOPs (third H200 run, benchmarks/results/h200-2026-11-27). The
whole-model comparison (`gpu_checks.sh` ATTN_KERNELS) compiles LXMERT-base once per kernel, minutes each;
this measures the kernels alone in seconds, so a session can choose before it compiles.

The call is the model's (`blocks.MultiHeadAttention`'s fast path): q, k, v (B, 12, S, 64) in bf16, attention
dropout at the models' 0.1 (training), and either an additive key mask (B, 1, 1, Sk) as `blocks.mask_bias`
makes it (every key visible: the values do not change the kernels' work) or none. The models pass a mask only
for a key set with padding (`blocks.key_bias`): in a pre-training batch the text is padded to its longest
caption, while LXMERT's images all have 36 regions, so 19 of LXMERT-base's 34 calls (keys: words) take a mask
and 15 (keys: regions) take none; VisualBERT's 12 joint calls take one. Variants:
- `auto`: eager, PyTorch's own pick for each call (the default `--attention_kernel=auto`);
- `cudnn`, `efficient`, `math`, `flash`: eager, SDPA held to that kernel (`sdpa_kernel`); flash takes no
  additive mask, so it is timed without one only;
- `math-compiled`: the math path under `torch.compile` (inductor fuses the scale, mask, softmax and dropout
  around the two batched products), as a compiled step held to `--attention_kernel=math` runs it.
Each variant: `--warmup` calls, then `--repeats` timed calls (CUDA events after a synchronize), median.
A kernel that cannot take the inputs is reported as such, not timed.

A step's cost under a setting of `--attention_kernel` adds each call's time with the kernel that setting runs
for it: a single name runs that kernel wherever it can take the inputs, math elsewhere (math compiled, as in
a compiled step); "flash,NAME" runs flash for the calls without a mask and NAME for the rest. The fastest
setting for LXMERT-base's step is printed as the flag to pass.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from timing import at_least, guarded, seconds  # noqa: E402
from vlberts.io import write_json  # noqa: E402
from vlberts.models.blocks import SDPA_KERNELS, mask_bias  # noqa: E402

# (name, query length, key length, calls per LXMERT-base step, calls per VisualBERT-base step, whether the
# keys are padded, so that the call takes a mask): LXMERT's 9 language + 5 relation layers and 5 cross layers
# (cross-attention both ways, then self-attention per modality); VisualBERT's 12 joint layers over 20 words
# + 36 regions (its last layer's queries are fewer rows; counted here as whole).
SHAPES = (
    ("words over words", 20, 20, 9 + 5, 0, True),
    ("regions over regions", 36, 36, 5 + 5, 0, False),
    ("words over regions", 20, 36, 5, 0, False),
    ("regions over words", 36, 20, 5, 0, True),
    ("joint (VisualBERT)", 56, 56, 0, 12, True),
)
VARIANTS = ("auto", "cudnn", "efficient", "math", "math-compiled", "flash")
LABELS = {"math-compiled": "math compiled"}
MASKS = {"mask": True, "no mask": False}


def attention_fn(variant: str, p_drop: float) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], torch.Tensor]:
    """One attention call as the model makes it, held to `variant`'s kernel (the held set is entered inside
    the function, so that a compiled copy records it in its graph)."""
    if variant == "auto":  # PyTorch picks, per call (`--attention_kernel=auto`)
        return lambda q, k, v, bias: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p_drop)
    kernel = SDPA_KERNELS["math" if variant == "math-compiled" else variant]

    def call(q, k, v, bias):
        with sdpa_kernel([kernel]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=p_drop)

    return torch.compile(call, fullgraph=True) if variant == "math-compiled" else call


def time_call(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of `fn` over `repeats` calls after `warmup`."""
    for _ in range(warmup):
        fn()
    return statistics.median(seconds(fn, device) for _ in range(repeats))


def measure(variant: str, b: int, heads: int, d: int, sq: int, sk: int, p_drop: float, device: torch.device,
            dtype: torch.dtype, warmup: int, repeats: int, masked: bool = True) -> float | None:
    """Seconds of one forward + backward call, or None where the kernel cannot take these inputs."""
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(b, heads, sq, d, device=device, dtype=dtype, generator=g, requires_grad=True)
    k, v = (torch.randn(b, heads, sk, d, device=device, dtype=dtype, generator=g, requires_grad=True) for _ in "kv")
    bias = mask_bias(torch.ones(b, sk, dtype=torch.bool, device=device), dtype) if masked else None
    grad = torch.randn(b, heads, sq, d, device=device, dtype=dtype, generator=g)
    fn = attention_fn(variant, p_drop)

    def step() -> None:
        fn(q, k, v, bias).backward(grad)

    try:
        return time_call(step, device, warmup, repeats)
    except RuntimeError as e:  # the held kernel cannot take these inputs (CUDA and CPU word it differently)
        if not any(m in str(e) for m in ("No available kernel", "No viable backend")):
            raise
        return None


def settings(variants: list[str]) -> dict[str, tuple[str, str]]:
    """The `--attention_kernel` settings to cost, each as (variant for the calls without a mask, variant for the
    calls with one): every single kernel, and flash before each other kernel that takes a mask. Math is what a
    compiled step runs for it, so "math" costs math compiled where that was timed, and it is the fallback of
    flash alone."""
    math = "math-compiled" if "math-compiled" in variants else "math"
    kernels = [v for v in variants if not (v == "math" and math == "math-compiled")]
    out = {v.removesuffix("-compiled"): (v, math if v == "flash" else v) for v in kernels}
    if "flash" in variants:
        out.update({f"flash,{v}": ("flash", v) for v in kernels if v not in ("flash", "auto", math)})
    return out


def step_costs(rows: dict[str, dict[str, dict[str, float | None]]], variants: list[str], col: int) -> dict[str, float | None]:
    """Seconds of a step's attention (the model's calls: SHAPES column `col`) under each setting; None where
    a call it needs was not timed (a kernel that cannot run here)."""
    costs = {}
    for name, (free, masked) in settings(variants).items():
        parts = [(rows[s[0]].get(masked if s[5] else free, {}).get("mask" if s[5] else "no mask"), s[col])
                 for s in SHAPES if s[col]]
        costs[name] = None if any(t is None for t, _ in parts) else sum(t * n for t, n in parts)
    return costs


def best_kernel(per_step: dict[str, float | None]) -> str:
    """The fastest `--attention_kernel` setting of those costed."""
    usable = {v: t for v, t in per_step.items() if t is not None}
    if not usable:
        raise ValueError("no setting could be costed")
    return min(usable, key=usable.get)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=at_least(1), default=None, help="examples (default 512; 2 with --smoke)")
    ap.add_argument("--heads", type=at_least(1), default=12)
    ap.add_argument("--head-dim", type=at_least(1), default=64)
    ap.add_argument("--dropout", type=float, default=0.1, help="attention dropout (the models' training value)")
    ap.add_argument("--warmup", type=at_least(0), default=None, help="untimed calls per variant (default 5; 1 smoke)")
    ap.add_argument("--repeats", type=at_least(1), default=None, help="timed calls per variant (default 30; 2 smoke)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--smoke", action="store_true", help="a tiny CPU run of the code path (not a measurement)")
    ap.add_argument("--json", default=None, help="write the numbers to this JSON file")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    # PyTorch warns why each kernel it could not use was skipped; a held kernel that cannot run is "n/a" here
    warnings.filterwarnings("ignore", category=UserWarning, module=__name__)
    if unknown := [v for v in variants if v not in VARIANTS]:
        ap.error(f"--variants: unknown {', '.join(unknown)} (choose from {', '.join(VARIANTS)})")
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA device found: run on a machine with a GPU, or pass --smoke for a CPU run of the code")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    b = args.batch or (2 if args.smoke else 512)
    warmup = args.warmup if args.warmup is not None else (1 if args.smoke else 5)
    repeats = args.repeats or (2 if args.smoke else 30)
    name = torch.cuda.get_device_name(device) if cuda else "CPU (smoke run: not a measurement)"
    print(f"device: {name}; torch {torch.__version__}; batch {b} x {args.heads} heads x {args.head_dim}-d, "
          f"{dtype}, dropout {args.dropout}; forward + backward, median of {repeats} after {warmup}")
    if "math-compiled" in variants:
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 4 * len(SHAPES))

    # rows[shape][variant]["mask" | "no mask"]: seconds of one call (flash is never given a mask)
    rows: dict[str, dict[str, dict[str, float | None]]] = {}
    for shape, sq, sk, *_ in SHAPES:
        rows[shape] = {v: {m: None if (v == "flash" and masked) else measure(
            v, b, args.heads, args.head_dim, sq, sk, args.dropout, device, dtype, warmup, repeats, masked)
            for m, masked in MASKS.items()} for v in variants}

    def us(s: float | None) -> str:
        return "n/a" if s is None else f"{s * 1e6:.1f}"

    cols = [(v, m) for v in variants for m in MASKS]
    print("\n| shape (queries over keys) | Sq x Sk | " + " | ".join(f"{LABELS.get(v, v)}, {m} (us)" for v, m in cols) + " |")
    print("|---|---|" + "---:|" * len(cols))
    for shape, sq, sk, *_ in SHAPES:
        print(f"| {shape} | {sq} x {sk} | " + " | ".join(us(rows[shape][v][m]) for v, m in cols) + " |")
    per_step: dict[str, dict[str, float | None]] = {}
    for model, col in (("LXMERT-base", 3), ("VisualBERT-base", 4)):
        per_step[model] = step_costs(rows, variants, col)
        calls, masked = sum(s[col] for s in SHAPES), sum(s[col] for s in SHAPES if s[5])
        ms = {v: "n/a" if t is None else f"{t * 1e3:.2f} ms" for v, t in per_step[model].items()}
        print(f"{model}, {calls} calls a step ({masked} with a mask), by --attention_kernel: "
              + "; ".join(f"{v} {t}" for v, t in ms.items()))
    try:
        best = best_kernel(per_step["LXMERT-base"])
        print(f"fastest for LXMERT-base's step: --attention_kernel={best}")
    except ValueError as e:
        best = None
        print(f"fastest for LXMERT-base's step: none ({e})")
    if args.json:
        write_json(args.json, {"best_lxmert": best, "device": name, "torch": torch.__version__, "batch": b, "heads": args.heads,
                               "head_dim": args.head_dim, "dropout": args.dropout, "dtype": str(dtype),
                               "repeats": repeats, "seconds": rows, "per_step_seconds": per_step})
        print(f"wrote {args.json}")


if __name__ == "__main__":
    guarded(main)
