"""Our VisualBERT-base and LXMERT-base against Hugging Face's `VisualBertForPreTraining` and
`LxmertForPreTraining`: same configuration, same weights (ours converted from theirs), same batch
(issue 6; SPEC §6). Times a training step (forward, the pre-training losses, backward, AdamW) and
inference, interleaving the two models so that load on a shared machine hits both alike; prints medians
and ratios, and checks the outputs agree.

    .venv/bin/python benchmarks/vs_hf.py --arch visualbert|lxmert [--threads 2] [--repeats 10]

Batch as the issue says: 8 examples, 20 tokens, 36 regions of 2048-d features. Losses: VisualBERT's
MLM + sentence-image prediction; LXMERT's five (MLM, matching, object and attribute classification and
feature regression on every region weighted by a mask, image QA), as Hugging Face computes them. Ours
runs the MLM head at the masked words only; that is the model's design, not a benchmark shortcut. Both
models step with fused AdamW (Hugging Face Trainer's default optimizer, and ours).
Absolute times on shared machines are noise; the ratios, measured in one run, are the claim. Peak
memory is measured per model in its own subprocess (`--peak-only`): the maximum resident set size of
building it and two training steps, above the process's size after its imports.

The last row counts each model's floating-point operations in one training forward and backward
(`torch.utils.flop_counter.FlopCounterMode`: matrix multiplies and attention). A step that is nearly
all matrix multiplies (on CPU, ours is) cannot be faster than Hugging Face's by much more than the
ratio of the two counts unless the same multiplies run faster: that ratio is the ceiling of what
doing less work buys.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
import transformers
from torch.utils.flop_counter import FlopCounterMode

from timing import at_least, guarded, seconds

from vlberts.data.batch import VLInputs, select_tokens
from vlberts.models.convert_hf import load_hf_visualbert, visualbert_config_from_hf
from vlberts.models.convert_hf_lxmert import load_hf_lxmert, lxmert_config_from_hf
from vlberts.models.lxmert import LxmertForPreTraining
from vlberts.models.visualbert import VisualBertForPreTraining

B, T, R, D, V = 8, 20, 36, 2048, 30522
N_OBJ, N_ATTR, N_QA = 1600, 400, 9500  # LXMERT's detector classes, attributes and answer table


def batch(seed: int = 0, b: int = B, pad_text: bool = False) -> dict[str, Any]:
    """The benchmark batch on the CPU: `b` examples (default the issue's 8) of the shapes above. Every token is
    real, or with `pad_text` example i has T - 2 (i mod 5) of them (20, 18, ..., 12) and padding after, as a
    batch of captions of several lengths has; the regions are all real either way (LXMERT's 36 a image)."""
    g = torch.Generator().manual_seed(seed)
    lengths = T - 2 * (torch.arange(b) % 5) if pad_text else torch.full((b,), T)
    real = torch.arange(T)[None, :] < lengths[:, None]  # (b, T)
    x = VLInputs(
        input_ids=torch.randint(1000, V, (b, T), generator=g) * real, token_type_ids=torch.zeros(b, T, dtype=torch.long),
        attention_mask=real, region_feats=torch.randn(b, R, D, generator=g),
        region_boxes=torch.rand(b, R, 4, generator=g).sort(-1).values, region_mask=torch.ones(b, R, dtype=torch.bool),
    )
    words = torch.full((b, T), -100)
    words[:, 1:T:6] = x.input_ids[:, 1:T:6]  # a few masked-word targets per caption
    words[~real] = -100  # none on padding
    return {
        # the masked words as index tensors, built here on the host as the pre-training collate builds them
        "x": x, "words": words, "mlm": select_tokens(words != -100), "match": torch.randint(0, 2, (b,), generator=g),
        "obj": torch.randint(0, N_OBJ, (b, R), generator=g), "attr": torch.randint(0, N_ATTR, (b, R), generator=g),
        "region_mask": (torch.rand(b, R, generator=g) < 0.15).float(), "ans": torch.randint(0, N_QA, (b,), generator=g),
    }


# --------------------------------------------------------------------------- VisualBERT
def visualbert_hf_config() -> transformers.VisualBertConfig:
    return transformers.VisualBertConfig(visual_embedding_dim=D)


def visualbert_hf_step(hf, d) -> torch.Tensor:
    x = d["x"]
    words = d["words"]
    labels = torch.cat([words, torch.full((len(words), R), -100, device=words.device)], 1)  # no targets on the regions
    out = hf(input_ids=x.input_ids, token_type_ids=x.token_type_ids, attention_mask=x.attention_mask.long(),
             visual_embeds=x.region_feats, visual_attention_mask=x.region_mask.long(),
             labels=labels, sentence_image_labels=d["match"])
    return out.loss


def visualbert_our_step(ours, d) -> torch.Tensor:
    sel = d["mlm"]
    out = ours(d["x"], mlm_positions=sel)
    return F.cross_entropy(out.mlm_logits, d["words"][sel.example, sel.position]) + F.cross_entropy(out.match_logits, d["match"])


def visualbert_logit_diff(hf, ours, d) -> float:
    x = d["x"]
    ref = hf(input_ids=x.input_ids, token_type_ids=x.token_type_ids, attention_mask=x.attention_mask.long(),
             visual_embeds=x.region_feats, visual_attention_mask=x.region_mask.long())
    return (ours(x).mlm_logits - ref.prediction_logits[:, :T]).abs().max().item()


# --------------------------------------------------------------------------- LXMERT
def lxmert_hf_config() -> transformers.LxmertConfig:
    return transformers.LxmertConfig(num_object_labels=N_OBJ, num_attr_labels=N_ATTR, num_qa_labels=N_QA)


# 6.67, HF's weight of the three region losses; read once (building the config costs ~2 ms, a GPU step's share)
VISUAL_LOSS_NORMALIZER = lxmert_hf_config().visual_loss_normalizer


def lxmert_hf_step(hf, d) -> torch.Tensor:
    x, m = d["x"], d["region_mask"]
    out = hf(input_ids=x.input_ids, visual_feats=x.region_feats, visual_pos=x.region_boxes,
             attention_mask=x.attention_mask.long(), visual_attention_mask=x.region_mask.long(),
             token_type_ids=x.token_type_ids, labels=d["words"], matched_label=d["match"],
             obj_labels={"obj": (d["obj"], m), "attr": (d["attr"], m), "feat": (x.region_feats, m)}, ans=d["ans"])
    return out.loss


def lxmert_our_step(ours, d) -> torch.Tensor:
    """The same five losses with the same weights (HF `LxmertForPreTraining.forward`)."""
    x, m = d["x"], d["region_mask"].view(-1)
    sel = d["mlm"]
    out = ours(x, mlm_positions=sel)
    norm = VISUAL_LOSS_NORMALIZER
    obj = (F.cross_entropy(out.obj_logits.reshape(-1, N_OBJ), d["obj"].view(-1), reduction="none") * m).mean()
    attr = (F.cross_entropy(out.attr_logits.reshape(-1, N_ATTR), d["attr"].view(-1), reduction="none") * m).mean()
    feat = (F.smooth_l1_loss(out.feat_pred.reshape(-1, D), x.region_feats.reshape(-1, D), reduction="none").mean(1) * m).mean()
    return (F.cross_entropy(out.mlm_logits, d["words"][sel.example, sel.position]) + F.cross_entropy(out.match_logits, d["match"])
            + norm * (obj + attr + feat) + F.cross_entropy(out.qa_logits, d["ans"]))


def lxmert_logit_diff(hf, ours, d) -> float:
    x = d["x"]
    ref = hf(input_ids=x.input_ids, visual_feats=x.region_feats, visual_pos=x.region_boxes,
             attention_mask=x.attention_mask.long(), visual_attention_mask=x.region_mask.long(),
             token_type_ids=x.token_type_ids)
    return (ours(x).mlm_logits - ref.prediction_logits).abs().max().item()


@dataclass(frozen=True)
class Arch:
    name: str
    hf_config: Callable[[], Any]
    hf_class: Any
    ours_class: Any
    config_from_hf: Callable[[dict], Any]
    load_ours: Callable[[Path], Any]
    hf_step: Callable
    our_step: Callable
    logit_diff: Callable


ARCHS = {
    "visualbert": Arch("VisualBERT-base", visualbert_hf_config, transformers.VisualBertForPreTraining, VisualBertForPreTraining,
                       visualbert_config_from_hf, load_hf_visualbert, visualbert_hf_step, visualbert_our_step,
                       visualbert_logit_diff),
    "lxmert": Arch("LXMERT-base (9+5+5 layers)", lxmert_hf_config, transformers.LxmertForPreTraining, LxmertForPreTraining,
                   lxmert_config_from_hf, load_hf_lxmert, lxmert_hf_step, lxmert_our_step, lxmert_logit_diff),
}


def models(arch: Arch, tmp: Path):
    torch.manual_seed(0)
    hf = arch.hf_class(arch.hf_config())
    hf.save_pretrained(tmp)
    return hf, arch.load_ours(tmp)


def train_fn(model, step, opt, data):
    def run():
        loss = step(model, data)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def counted_flops(run: Callable[[], Any]) -> dict[str, int]:
    """FLOPs per aten op that `FlopCounterMode` counts over `run()`."""
    with FlopCounterMode(display=False) as counter:
        run()
    return {str(op): int(n) for op, n in counter.get_flop_counts().get("Global", {}).items()}


def step_gflops(model, step, data) -> float:
    """Floating-point operations (GFLOP) of one training forward and backward; no optimizer step."""
    total = sum(counted_flops(lambda: step(model, data).backward()).values())
    model.zero_grad(set_to_none=True)
    return total / 1e9


def status_mib(field: str) -> float:
    """A memory field of /proc/self/status (VmRSS: now, VmHWM: peak) in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak(arch: Arch, which: str) -> None:
    """Child process: max RSS (MiB) of building one model and 2 training steps, above the RSS after the
    imports. Our model is built from the same configuration directly (its weights' values do not
    change its memory), so the other model never sits in this process."""
    Path("/proc/self/clear_refs").write_text("5")  # Linux: restart the peak (VmHWM) from the current size
    start = status_mib("VmRSS")
    cfg = arch.hf_config()
    if which == "hf":
        model, step = arch.hf_class(cfg), arch.hf_step
    else:
        model, step = arch.ours_class(arch.config_from_hf(cfg.to_dict())), arch.our_step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    data = batch()
    for _ in range(2):
        train_fn(model, step, opt, data)()
    print(status_mib("VmHWM") - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=sorted(ARCHS), default="visualbert")
    ap.add_argument("--threads", type=at_least(1), default=2)
    ap.add_argument("--repeats", type=at_least(1), default=10)
    ap.add_argument("--peak-only", choices=["hf", "ours"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()  # save_pretrained's shard bar
    arch = ARCHS[args.arch]
    if args.peak_only:
        peak(arch, args.peak_only)
        return

    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = models(arch, Path(tmp))
    data = batch()
    hf.eval(), ours.eval()  # same outputs first (eval mode: no dropout)
    with torch.no_grad():
        diff = arch.logit_diff(hf, ours, data)

    infer = {"hf": lambda: arch.hf_step(hf, data), "ours": lambda: arch.our_step(ours, data)}
    times: dict[str, dict[str, list[float]]] = {"train": {"hf": [], "ours": []}, "infer": {"hf": [], "ours": []}}
    with torch.no_grad():
        for i in range(args.repeats + 2):
            for name in ("hf", "ours"):
                t = seconds(infer[name])
                if i >= 2:
                    times["infer"][name].append(t)
    hf.train(), ours.train()
    gflops = {"hf": step_gflops(hf, arch.hf_step, data), "ours": step_gflops(ours, arch.our_step, data)}
    train = {
        "hf": train_fn(hf, arch.hf_step, torch.optim.AdamW(hf.parameters(), lr=1e-5, fused=True), data),
        "ours": train_fn(ours, arch.our_step, torch.optim.AdamW(ours.parameters(), lr=1e-5, fused=True), data),
    }
    for i in range(args.repeats + 2):
        for name in ("hf", "ours"):
            t = seconds(train[name])
            if i >= 2:
                times["train"][name].append(t)

    mem = {}
    for name in ("hf", "ours"):
        proc = subprocess.run([sys.executable, __file__, f"--arch={args.arch}", f"--peak-only={name}",
                               f"--threads={args.threads}"], capture_output=True, text=True, check=True)
        mem[name] = float(proc.stdout.strip().splitlines()[-1])

    print(f"{arch.name}, batch {B} x ({T} tokens + {R} regions of {D}-d), {args.threads} threads, "
          f"median of {args.repeats}; max |MLM logit diff| (eval) {diff:.1e}")
    print(f"{'':22s}{'Hugging Face':>14s}{'vlberts':>10s}{'ratio':>8s}")
    for kind, label in (("train", "training step (s)"), ("infer", "inference (s)")):
        h, o = statistics.median(times[kind]["hf"]), statistics.median(times[kind]["ours"])
        print(f"{label:22s}{h:14.3f}{o:10.3f}{h / o:7.2f}x")
    print(f"{'peak memory (MiB)':22s}{mem['hf']:14.0f}{mem['ours']:10.0f}{mem['hf'] / mem['ours']:7.2f}x")
    print(f"{'GFLOP per train step':22s}{gflops['hf']:14.1f}{gflops['ours']:10.1f}{gflops['hf'] / gflops['ours']:7.2f}x")


if __name__ == "__main__":
    guarded(main)
