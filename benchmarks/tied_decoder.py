"""Our MLM head's decoder layout against the textbook `F.linear` one, in the same model, on the same batch,
interleaved (issue 6; `MLMHead.forward`). Both compute the same logits; they differ in backward's
gradient for the word table that the decoder shares with the word embeddings. `F.linear`'s is a transposed
view, so autograd adds the embeddings' part into a new (V, D) tensor; ours is a fresh contiguous tensor,
which autograd adds into in place. Prints the median training step of each (forward, the pre-training
losses of `vs_hf.py`, backward, fused AdamW), their ratio, and the (V, D) additions one step runs.

    .venv/bin/python benchmarks/tied_decoder.py --arch visualbert|lxmert [--threads 2] [--repeats 12]

The model is `vs_hf.py`'s base configuration, its batch is `vs_hf.py`'s (8 examples, 20 tokens, 36 regions
of 2048-d features). Absolute times on shared machines are noise; the ratio, measured in one run, is the
claim.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import vs_hf
from timing import at_least, guarded, seconds

from vlberts.models.blocks import MLMHead

OURS = MLMHead.forward


def linear_forward(self: MLMHead, x: torch.Tensor) -> torch.Tensor:
    """The textbook head: `F.linear` with the tied weight, then the bias."""
    return F.linear(self.transform(x), self.decoder.weight) + self.bias


LAYOUTS = {"ours": OURS, "F.linear": linear_forward}


def table_adds(run, table: torch.Tensor) -> list[str]:
    """The additions on a tensor of the word table's shape in one call of `run`."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        run()
    return [e.name for e in prof.events() if e.name in ("aten::add", "aten::add_")
            and e.input_shapes and list(e.input_shapes[0]) == list(table.shape)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(vs_hf.ARCHS), default="visualbert")
    ap.add_argument("--threads", type=at_least(1), default=2)
    ap.add_argument("--repeats", type=at_least(1), default=12)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    vs_hf.transformers.utils.logging.disable_progress_bar()  # save_pretrained's shard bar
    arch = vs_hf.ARCHS[args.arch]
    with tempfile.TemporaryDirectory() as tmp:
        _, model = vs_hf.models(arch, Path(tmp))
    model.train()
    data = vs_hf.batch()
    run = vs_hf.train_fn(model, arch.our_step, torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True), data)
    table = next(p for n, p in model.named_parameters() if "word_embeddings" in n)

    times: dict[str, list[float]] = {name: [] for name in LAYOUTS}
    adds: dict[str, list[str]] = {}
    try:
        for name, forward in LAYOUTS.items():  # one warm-up step each, counted
            MLMHead.forward = forward
            adds[name] = table_adds(run, table)
        for i in range(args.repeats):
            for name in (list(LAYOUTS) if i % 2 == 0 else list(LAYOUTS)[::-1]):
                MLMHead.forward = LAYOUTS[name]
                times[name].append(seconds(run))
    finally:
        MLMHead.forward = OURS

    print(f"{arch.name}, batch {vs_hf.B} x ({vs_hf.T} tokens + {vs_hf.R} regions of {vs_hf.D}-d), {args.threads} "
          f"threads, median of {args.repeats} interleaved training steps; word table {tuple(table.shape)}")
    for name in LAYOUTS:
        print(f"{name:10s} {statistics.median(times[name]):7.3f} s   table-sized additions a step: {adds[name]}")
    ratio = statistics.median(times["F.linear"]) / statistics.median(times["ours"])
    print(f"F.linear / ours: {ratio:.3f}x")


if __name__ == "__main__":
    guarded(main)
