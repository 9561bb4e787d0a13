"""Our VisualBERT-base against Hugging Face's `VisualBertForPreTraining`: same configuration, same weights
(ours converted from theirs), same batch (issue 6; SPEC §6). Times a training step (forward, MLM +
sentence-image losses, backward, AdamW) and inference, interleaving the two models so that load on a
shared machine hits both alike; prints medians and ratios, and checks the outputs agree.

    .venv/bin/python benchmarks/visualbert_vs_hf.py [--threads 2] [--repeats 10] [--layers 12]

Batch as the issue says: 8 examples, 20 tokens, 36 regions of 2048-d features. Absolute times on shared
machines are noise; the ratios, measured in one run, are the claim. Peak memory is measured per model in
its own subprocess (`--peak-only`): the maximum resident set size of building it and two training
steps, above the process's size after its imports.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from vlberts.data.batch import VLInputs
from vlberts.models.convert_hf import load_hf_visualbert, visualbert_config_from_hf
from vlberts.models.visualbert import VisualBertForPreTraining

B, T, R, D, V = 8, 20, 36, 2048, 30522


def batch(seed: int = 0) -> tuple[VLInputs, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = VLInputs(
        input_ids=torch.randint(1000, V, (B, T), generator=g), token_type_ids=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T, dtype=torch.bool), region_feats=torch.randn(B, R, D, generator=g),
        region_boxes=torch.rand(B, R, 4, generator=g), region_mask=torch.ones(B, R, dtype=torch.bool),
    )
    labels = torch.full((B, T + R), -100)
    labels[:, 1:T:6] = x.input_ids[:, 1:T:6]  # a few masked-word targets per caption
    return x, labels, torch.randint(0, 2, (B,), generator=g)


def models(layers: int, tmp: Path):
    torch.manual_seed(0)
    cfg = transformers.VisualBertConfig(num_hidden_layers=layers, visual_embedding_dim=D)
    hf = transformers.VisualBertForPreTraining(cfg)
    hf.save_pretrained(tmp)
    return hf, load_hf_visualbert(tmp)


def hf_step(hf, x, labels, match) -> torch.Tensor:
    out = hf(input_ids=x.input_ids, token_type_ids=x.token_type_ids, attention_mask=x.attention_mask.long(),
             visual_embeds=x.region_feats, visual_attention_mask=x.region_mask.long(),
             labels=labels, sentence_image_labels=match)
    return out.loss


def our_step(ours, x, labels, match) -> torch.Tensor:
    text = labels[:, :T]
    where = text != -100
    out = ours(x, mlm_positions=where)
    mlm = torch.nn.functional.cross_entropy(out.mlm_logits, text[where])
    return mlm + torch.nn.functional.cross_entropy(out.match_logits, match)


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def train_fn(model, step, opt, data):
    def run():
        loss = step(model, *data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def status_mib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: now, VmHWM: peak) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak(which: str, layers: int) -> None:
    """Child process: max RSS (MiB) of building one model and 2 training steps, above the RSS after the
    imports. Our model is built from the same configuration directly (its weights' values do not
    change its memory), so the other model never sits in this process."""
    Path("/proc/self/clear_refs").write_text("5")  # Linux: restart the peak (VmHWM) from the current size
    start = status_mib("VmRSS")
    cfg = transformers.VisualBertConfig(num_hidden_layers=layers, visual_embedding_dim=D)
    if which == "hf":
        model, step = transformers.VisualBertForPreTraining(cfg), hf_step
    else:
        model, step = VisualBertForPreTraining(visualbert_config_from_hf(cfg.to_dict())), our_step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    data = batch()
    for _ in range(2):
        train_fn(model, step, opt, data)()
    print(status_mib("VmHWM") - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--peak-only", choices=["hf", "ours"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.peak_only:
        peak(args.peak_only, args.layers)
        return

    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = models(args.layers, Path(tmp))
    data = batch()
    # Same outputs first (eval mode: no dropout).
    hf.eval(), ours.eval()
    with torch.no_grad():
        x = data[0]
        ref = hf(input_ids=x.input_ids, token_type_ids=x.token_type_ids, attention_mask=x.attention_mask.long(),
                 visual_embeds=x.region_feats, visual_attention_mask=x.region_mask.long())
        out = ours(x)
    diff = (out.mlm_logits - ref.prediction_logits[:, :T]).abs().max().item()

    infer = {"hf": lambda: hf_step(hf, *data), "ours": lambda: our_step(ours, *data)}
    times: dict[str, dict[str, list[float]]] = {"train": {"hf": [], "ours": []}, "infer": {"hf": [], "ours": []}}
    with torch.no_grad():
        for i in range(args.repeats + 2):
            for name in ("hf", "ours"):
                t = timed(infer[name])
                if i >= 2:
                    times["infer"][name].append(t)
    hf.train(), ours.train()
    train = {
        "hf": train_fn(hf, hf_step, torch.optim.AdamW(hf.parameters(), lr=1e-5), data),
        "ours": train_fn(ours, our_step, torch.optim.AdamW(ours.parameters(), lr=1e-5), data),
    }
    for i in range(args.repeats + 2):
        for name in ("hf", "ours"):
            t = timed(train[name])
            if i >= 2:
                times["train"][name].append(t)

    mem = {}
    for name in ("hf", "ours"):
        proc = subprocess.run([sys.executable, __file__, f"--peak-only={name}", f"--layers={args.layers}",
                               f"--threads={args.threads}"], capture_output=True, text=True, check=True)
        mem[name] = float(proc.stdout.strip().splitlines()[-1])

    print(f"VisualBERT {args.layers} layers, batch {B} x ({T} tokens + {R} regions of {D}-d), "
          f"{args.threads} threads, median of {args.repeats}; max |logit diff| (eval) {diff:.1e}")
    print(f"{'':22s}{'Hugging Face':>14s}{'vlberts':>10s}{'ratio':>8s}")
    for kind, label in (("train", "training step (s)"), ("infer", "inference (s)")):
        h, o = statistics.median(times[kind]["hf"]), statistics.median(times[kind]["ours"])
        print(f"{label:22s}{h:14.3f}{o:10.3f}{h / o:7.2f}x")
    print(f"{'peak memory (MiB)':22s}{mem['hf']:14.0f}{mem['ours']:10.0f}{mem['hf'] / mem['ours']:7.2f}x")


if __name__ == "__main__":
    main()
