"""Cost of every base configuration's pre-training model on CPU: parameters, training-step time, peak memory.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/base_configs.py [--models a,b,...] [--steps N]

Models: every name in `MODEL_CONFIGS` ending in `-base`, plus `visualbert-no-early-fusion` and
`vilbert-single-stream` (the two ablations that change the cost).

Workload: batch 8, 20 text tokens, 36 regions of 2048-d features (random, fixed seed), 15% of the
tokens as MLM positions (the MLM head runs only there, as in pre-training); W-VisualBERT variants with
tags also get one tag subword per region (36 tags). One step = forward with every pre-training head the
model has + backward of a loss that touches every head output + an AdamW step. Two warm-up steps, then
the median of `--steps` timed steps.

Memory: the peak resident set size (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) of a fresh Python
subprocess per model, so models do not inherit each other's peaks. It includes the interpreter and the
torch import (reported separately as the `import` baseline, measured before the model is built);
`tracemalloc` would not see torch's allocations.

Timings are reported as ratios against `visualbert-base` measured in the same run (it is always run,
first, and again last, to show how much the machine drifted meanwhile); absolute seconds on shared
machines are noise and are printed for reference only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from timing import at_least, guarded

REFERENCE = "visualbert-base"
EXTRA = ("visualbert-no-early-fusion", "vilbert-single-stream")
B, T, R, F = 8, 20, 36, 2048


def default_models() -> list[str]:
    from vlberts.models.builders import MODEL_CONFIGS

    return [n for n in MODEL_CONFIGS if n.endswith("-base")] + [n for n in EXTRA if n in MODEL_CONFIGS]


def _rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # Linux: KiB -> GiB


def measure(name: str, steps: int) -> dict:
    """Runs inside the per-model subprocess."""
    import dataclasses

    import torch

    from vlberts.data.batch import VLInputs
    from vlberts.models.builders import build_pretraining_model, model_config

    torch.manual_seed(0)
    base_rss = _rss_gb()
    cfg = model_config(name)
    model = build_pretraining_model(cfg).train()
    n_params = sum(p.numel() for p in model.parameters())  # tied tables counted once
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

    g = torch.Generator().manual_seed(0)
    vocab = cfg.vocab_size
    x = VLInputs(
        torch.randint(1000, vocab, (B, T), generator=g), torch.zeros(B, T, dtype=torch.long),
        torch.ones(B, T, dtype=torch.bool), torch.randn(B, R, F, generator=g),
        torch.rand(B, R, 4, generator=g).sort(-1).values, torch.ones(B, R, dtype=torch.bool),
    )
    mlm = torch.rand(B, T, generator=g) < 0.15
    mlm[:, 1] = True  # at least one per row
    kw = {"mlm_positions": mlm}
    if getattr(cfg, "use_tags", False):
        from vlberts.models.wvisualbert import collate_tags

        kw["tags"] = collate_tags([(torch.randint(1000, vocab, (R,), generator=g).tolist(), list(range(R)))] * B)

    def step() -> float:
        t0 = time.perf_counter()
        out = model(x, **kw)
        loss = 0.0
        for f in dataclasses.fields(out):
            v = getattr(out, f.name)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and v.numel():
                loss = loss + v.float().pow(2).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    for _ in range(2):
        step()
    times = [step() for _ in range(steps)]
    return {"model": name, "params": n_params, "step_s": statistics.median(times), "peak_rss_gb": _rss_gb(),
            "import_rss_gb": base_rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=None, help="comma-separated names (default: all base configurations)")
    ap.add_argument("--steps", type=at_least(1), default=5, help="timed steps per model after 2 warm-ups")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: measure one model, print JSON
    args = ap.parse_args()

    if args.worker:
        print(json.dumps(measure(args.worker, args.steps)))
        return

    models = args.models.split(",") if args.models else default_models()
    from vlberts.models.builders import MODEL_CONFIGS

    unknown = [m for m in models if m not in MODEL_CONFIGS]
    if unknown:
        ap.error(f"argument --models: unknown {', '.join(unknown)}; valid: {', '.join(MODEL_CONFIGS)}")
    models = [REFERENCE] + [m for m in models if m != REFERENCE]
    if len(models) > 1:
        models.append(REFERENCE)  # again at the end: how much the machine drifted during the run
    rows, failed = [], []
    for name in models:
        proc = subprocess.run(
            [sys.executable, __file__, "--worker", name, "--steps", str(args.steps)],
            capture_output=True, text=True, env=os.environ.copy(),
        )
        if proc.returncode:
            print(f"{name}: failed\n{proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}",
                  file=sys.stderr)
            failed.append(name)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(f"measured {name}", file=sys.stderr, flush=True)

    refs = [r["step_s"] for r in rows if r["model"] == REFERENCE]
    ref = refs[0] if refs else None
    if len(refs) > 1:
        rows = [r for i, r in enumerate(rows) if r["model"] != REFERENCE or i == 0]
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"batch {B}, {T} tokens, {R} regions x {F}-d, CPU, OMP_NUM_THREADS={threads}, median of {args.steps} steps")
    print(f"step ratio vs {REFERENCE} (same run); absolute seconds on a shared machine are noise\n")
    print("| model | parameters (M) | step time ratio vs visualbert-base | step seconds | peak RSS (GB) |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        ratio = f"{r['step_s'] / ref:.2f}" if ref else "n/a"
        print(f"| {r['model']} | {r['params'] / 1e6:.1f} | {ratio} | {r['step_s']:.2f} | {r['peak_rss_gb']:.2f} |")
    if len(refs) > 1:
        print(f"\n{REFERENCE} measured again last: {refs[1]:.2f} s ({refs[1] / refs[0]:.2f}x the first); "
              "ratios use the first, and differ by about that much from run to run")
    if rows:
        print(f"peak RSS includes the interpreter + torch import (~{rows[0]['import_rss_gb']:.2f} GB here)")
    if failed:
        sys.exit(f"failed: {', '.join(failed)} (their rows are missing above)")


if __name__ == "__main__":
    guarded(main)
