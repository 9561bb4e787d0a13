"""GPU pre-training throughput of our VisualBERT-base and LXMERT-base: model FLOPs utilisation (MFU) against
the device's measured bf16 matrix-multiply peak, and the throughput ratio against Hugging Face's models on
the same device, measured in the same run (issue 6, item 2).

    .venv/bin/python benchmarks/gpu_throughput.py [--arch visualbert|lxmert|all] [--batch 64] [--steps 20]
        [--warmup 3] [--run-steps 10] [--runs 3] [--compile] [--compile-modes default,reduce-overhead] [--sdpa-backends cudnn,efficient,math]
        [--attention-kernel auto|efficient|flash|cudnn|math|flash,efficient|...] [--pad-text] [--device cuda|cpu] [--smoke]
        [--precision bf16|fp32] [--json PATH] [--threads N] [--profile DIR]

Workload: the models, losses and batch shapes of `vs_hf.py` (same configuration and weights for ours and
Hugging Face's; one batch of `--batch` examples, 20 tokens + 36 regions of 2048-d features), built there
and imported from there. One training step, as the pre-training recipe runs it on a GPU: the batch, held
in pinned host memory, is copied to the device on a side stream (`training.loop.to_device`); forward with the pre-training
losses under bf16 autocast (`recipes.common.autocast`, fp32 master weights); backward; fused AdamW
(`training.optim.build_optimizer`, the recipe's, for both models). Our attention is
`F.scaled_dot_product_attention` (flash / memory-efficient kernels); Hugging Face's VisualBERT and LXMERT
run their default attention implementation (printed). With `--compile`, a copy of our model is also
compiled in place (`model.compile()`, as `pretrain --compile` does); its first step, which waits for the
compiler, is reported separately. `--compile-modes` compiles one copy per `torch.compile` mode named
(`reduce-overhead` replays each step's kernels as CUDA graphs, so the host launches one graph instead of
thousands of kernels: possible because our step reads nothing back from the device, `TokenSelection`).

Measurement:
- Peak: large square bf16 `torch.matmul` (8192 x 8192, 2 n^3 FLOPs each), after warm-up, timed with CUDA
  events; the median over repeats of 10 back-to-back products. This measured number, not a datasheet's,
  is the MFU denominator.
- Steps: each model is first moved to the device alone and warmed up (`--warmup` steps); its peak memory
  is `torch.cuda.max_memory_allocated` over those steps, above what was allocated before it arrived (so
  the other models' resident weights do not count). Then the models' timed steps are interleaved, one
  step of each per round, so that drift (clocks, a shared machine) hits all alike; each step is timed
  with CUDA events after a synchronize; the median over `--steps` rounds is reported.
  Throughput: examples/s and tokens/s (text + region positions, 56 per example).
- Runs: a step timed alone starts on an idle device, so its batch copy and the host's launches before
  the first kernel count in full. A training loop queues step i+1 (its copy on a side stream,
  `training.loop.to_device`) while the device runs step i. So each model also runs `--run-steps`
  back-to-back steps between two CUDA events, `--runs` times, interleaved; a step's share of the median
  run gives the columns "in a run" and the MFU the goal is checked against (both are printed).
- FLOPs: counted analytically from the configuration (`step_flops`): matrix multiplications only
  (a multiply-add is 2 FLOPs); each linear layer 2 m n k forward and twice that backward (the input's
  and the weight's gradients), except the projections of the raw region features and boxes, whose
  inputs need no gradient (weight gradient only); attention's score and value products, 2 x 2 b h Sq Sk d
  forward and twice that backward. Element-wise work (softmax, LayerNorm, GELU, the optimizer) is not
  counted. Each model's count is what that model computes: ours runs the MLM head at the masked
  positions only (4 of 20 per caption here), and our VisualBERT's last layer only at the rows its heads
  read ([CLS] and the masked words; keys and values over the whole sequence); Hugging Face's VisualBERT
  runs every layer and its MLM head at every text and region position, its LXMERT the MLM head at every
  text position. MFU = (model FLOPs / step time) / measured peak, for each model
  with its own count; for Hugging Face's models the "useful" MFU (our count, i.e. the FLOPs the losses
  need, over their time) is printed too. The MFU goal (>= 40%) is checked on ours.
- Cross-check: one step of each eager model under `torch.utils.flop_counter.FlopCounterMode`, printed
  beside the analytic count, split into linear layers (mm/addmm) and attention (bmm or the fused SDPA
  kernels). FlopCounterMode's formula for the fused kernels' backward also counts the recomputation of
  the scores Q K^T (b h Sq Sk d x 2 more per call); the expected counter value adds it when those
  kernels ran. It has no formula for CPU's flash kernel (`_scaled_dot_product_flash_attention_for_cpu`):
  if attention ran there, its FLOPs are missing from the counter, and the check says so.

`--smoke`: the same pipeline with a small batch (2), 2 timed steps after 1 warm-up and a 1024^2 peak
matmul, to exercise the code; on the CPU when there is no CUDA device (or with `--device cpu`), and then
a line says that the numbers are not GPU measurements (`--precision fp32` there where the CPU has no bf16
instructions: bf16 is emulated on such a CPU, and slow). Without a CUDA device, `--device cuda` (the
default) without `--smoke` stops with a one-line message. `--json PATH` writes every number (atomically).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vs_hf.py sits next to this file

import vs_hf  # noqa: E402
from timing import at_least, guarded, seconds  # noqa: E402
from vs_hf import ARCHS, R, T, batch, counted_flops, models, train_fn  # noqa: E402

from vlberts.io import write_json  # noqa: E402
from vlberts.errors import VlbertsError  # noqa: E402
from vlberts.data.batch import TokenSelection  # noqa: E402
from vlberts.models.blocks import ATTENTION_KERNELS, DEFAULT_ATTENTION_KERNEL, SDPA_KERNELS, use_attention_kernel  # noqa: E402
from vlberts.models.lxmert import LxmertConfig  # noqa: E402
from vlberts.models.visualbert import VisualBertConfig  # noqa: E402
from vlberts.recipes.common import CompileMode, autocast  # noqa: E402
from vlberts.training.loop import pinned, to_device  # noqa: E402
from vlberts.training.optim import build_optimizer  # noqa: E402

GOAL_MFU = 0.40


# --------------------------------------------------------------------------- analytic FLOPs
@dataclass
class Flops:
    """Matrix-multiply FLOPs of one training step (forward + backward), by kind; a multiply-add is 2."""

    linear_fwd: int = 0
    linear_bwd: int = 0
    attn_fwd: int = 0
    attn_bwd: int = 0
    attn_recompute: int = 0  # Q K^T again in the fused kernels' backward: not model FLOPs (cross-check only)

    def linear(self, rows: int, n_in: int, n_out: int, input_grad: bool = True) -> None:
        """nn.Linear(n_in, n_out) on `rows` vectors: 2 rows n_in n_out forward; backward the weight's
        gradient, and the input's unless the input is data (needs no gradient)."""
        f = 2 * rows * n_in * n_out
        self.linear_fwd += f
        self.linear_bwd += f * (2 if input_grad else 1)

    def attention(self, b: int, heads: int, sq: int, sk: int, head_dim: int) -> None:
        """Scores Q K^T and context P V: 2 b h Sq Sk d each forward; backward dQ, dK, dP, dV."""
        f = 2 * b * heads * sq * sk * head_dim
        self.attn_fwd += 2 * f
        self.attn_bwd += 4 * f
        self.attn_recompute += f

    @property
    def linear_total(self) -> int:
        return self.linear_fwd + self.linear_bwd

    @property
    def attn_total(self) -> int:
        return self.attn_fwd + self.attn_bwd

    @property
    def total(self) -> int:
        """Model FLOPs of the step (no recomputation)."""
        return self.linear_total + self.attn_total


def _attention_block(f: Flops, cfg, b: int, sq: int, sk: int) -> None:
    """`blocks.AttentionBlock`: queries from Sq positions, keys/values from Sk, output projection."""
    d = cfg.hidden_size
    f.linear(b * sq, d, d)  # query
    f.linear(b * sk, d, d)  # key
    f.linear(b * sk, d, d)  # value
    f.attention(b, cfg.num_heads, sq, sk, d // cfg.num_heads)
    f.linear(b * sq, d, d)  # output.dense


def _feed_forward(f: Flops, cfg, rows: int) -> None:
    f.linear(rows, cfg.hidden_size, cfg.intermediate_size)
    f.linear(rows, cfg.intermediate_size, cfg.hidden_size)


def _bert_layer(f: Flops, cfg, b: int, s: int) -> None:
    _attention_block(f, cfg, b, s, s)
    _feed_forward(f, cfg, b * s)


def _text_heads(f: Flops, cfg, b: int, mlm_rows: int) -> None:
    """Pooler, MLM head (transform + decoder) at `mlm_rows` positions, matching head."""
    d = cfg.hidden_size
    f.linear(b, d, d)  # pooler
    f.linear(mlm_rows, d, d)  # cls.predictions.transform
    f.linear(mlm_rows, d, cfg.vocab_size)  # cls.predictions.decoder (tied to the word embeddings)
    f.linear(b, d, 2)  # cls.seq_relationship


def visualbert_flops(
    cfg: VisualBertConfig, b: int, t: int, r: int, mlm_rows: int, last_rows: int | None = None
) -> Flops:
    """`VisualBertForPreTraining`: region projection, `num_layers` layers (text only before
    `fusion_layer`), pooler and the two heads. `last_rows`: positions per example the last layer computes
    (ours in pre-training: [CLS] and the masked words, padded to the longest row, `TokenSelection.rows`;
    queries, output and feed-forward there, keys and values over the whole sequence); None: all."""
    f = Flops()
    f.linear(b * r, cfg.projection_in, cfg.hidden_size, input_grad=False)  # visual_projection of the features
    for i in range(cfg.num_layers):
        s = t if i < cfg.fusion_layer else t + r
        if i == cfg.num_layers - 1 and last_rows is not None:
            _attention_block(f, cfg, b, last_rows, s)
            _feed_forward(f, cfg, b * last_rows)
        else:
            _bert_layer(f, cfg, b, s)
    _text_heads(f, cfg, b, mlm_rows)
    return f


def lxmert_flops(cfg: LxmertConfig, b: int, t: int, r: int, mlm_rows: int, last_rows: int | None = None) -> Flops:
    """`LxmertForPreTraining`: object embedding (features and boxes), N_L language layers, N_R
    object-relationship layers, N_X cross-modality layers (shared cross-attention both ways, then
    self-attention and feed-forward per modality), pooler and the heads present in the config. `last_rows`:
    language positions per example the last cross-modality layer's self-attention queries, output and
    feed-forward compute (ours in pre-training: [CLS] and the masked words, `TokenSelection.rows`; its
    cross-attention still runs for every word, whose self-attention keys and values read them all);
    None: all."""
    d = cfg.hidden_size
    f = Flops()
    f.linear(b * r, cfg.visual_dim, d, input_grad=False)  # visn_fc
    f.linear(b * r, cfg.visual_pos_dim, d, input_grad=False)  # box_fc
    for _ in range(cfg.language_layers):
        _bert_layer(f, cfg, b, t)
    for _ in range(cfg.relation_layers):
        _bert_layer(f, cfg, b, r)
    for i in range(cfg.cross_layers):
        q = last_rows if i == cfg.cross_layers - 1 and last_rows is not None else t
        _attention_block(f, cfg, b, t, r)  # language -> vision
        _attention_block(f, cfg, b, r, t)  # vision -> language (same weights)
        _attention_block(f, cfg, b, q, t)
        _attention_block(f, cfg, b, r, r)
        _feed_forward(f, cfg, b * q)
        _feed_forward(f, cfg, b * r)
    _text_heads(f, cfg, b, mlm_rows)
    outs = [cfg.num_object_labels, cfg.num_attr_labels, cfg.visual_dim if cfg.feat_regression else 0]
    if any(outs):  # obj_predict_head on every region: transform, then one decoder per target
        f.linear(b * r, d, d)
        for n in outs:
            if n:
                f.linear(b * r, d, n)
    if cfg.num_qa_labels:  # answer head on the pooled output
        f.linear(b, d, 2 * d)
        f.linear(b, 2 * d, cfg.num_qa_labels)
    return f


FLOPS: dict[str, Callable[..., Flops]] = {"visualbert": visualbert_flops, "lxmert": lxmert_flops}


def our_flops(arch: str, cfg, b: int, t: int, r: int, mlm: TokenSelection) -> Flops:
    """Model FLOPs of one pre-training step of our model with the MLM head at the masked words `mlm`.
    The text positions per example its last layer computes (LXMERT: its last cross-modality layer's
    language side): [CLS] and the masked words padded to the longest row (`mlm.rows`)."""
    return FLOPS[arch](cfg, b, t, r, mlm.count, mlm.rows.shape[1])


# Positions Hugging Face's MLM head runs at: VisualBERT's at every position (text and regions; the labels
# mask the regions out of the loss), LXMERT's at every text position.
HF_MLM_ROWS: dict[str, Callable[[int], int]] = {"visualbert": lambda b: b * (T + R), "lxmert": lambda b: b * T}


def flop_check(analytic: Flops, counts: dict[str, int]) -> dict[str, Any]:
    """The counter's linear (mm/addmm) and attention (the rest: bmm or SDPA kernels) FLOPs against the
    analytic ones, with the analytic value adjusted to the counter's conventions (see the docstring)."""
    linear = sum(n for op, n in counts.items() if op in ("aten.mm", "aten.addmm"))
    attn = sum(counts.values()) - linear
    fused = any("attention" in op for op in counts)
    expected_attn = analytic.attn_total + (analytic.attn_recompute if fused else 0)
    note = "attention counted as bmm (math / eager path)"
    if fused:
        note = "fused SDPA kernels: the counter adds the backward's recomputation of Q K^T"
    if attn == 0 and analytic.attn_total:
        expected_attn = 0
        note = ("FlopCounterMode has no formula for the attention kernel that ran (CPU flash SDPA): "
                f"attention ({analytic.attn_total / analytic.total:.1%} of the analytic total) is missing from it")
    expected = analytic.linear_total + expected_attn
    return {
        "analytic": analytic.total, "analytic_linear": analytic.linear_total, "analytic_attention": analytic.attn_total,
        "counter": sum(counts.values()), "counter_linear": linear, "counter_attention": attn,
        "expected_counter": expected, "rel_diff": sum(counts.values()) / expected - 1 if expected else 0.0,
        "ops": counts, "note": note,
    }


# --------------------------------------------------------------------------- device helpers
def matmul_peak(device: torch.device, n: int, repeats: int, inner: int = 10, dtype: torch.dtype = torch.bfloat16) -> float:
    """Measured matmul throughput (TFLOP/s) in `dtype`: median over `repeats` of `inner` back-to-back n x n products."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)

    def products() -> None:
        for _ in range(inner):
            torch.matmul(a, b, out=c)

    for _ in range(2):  # warm-up: library heuristics, clocks
        seconds(products, device)
    elapsed = statistics.median(seconds(products, device) for _ in range(repeats))
    return 2 * n**3 * inner / elapsed / 1e12


def autocast_step(loss: Callable, device: torch.device, precision: str = "bf16") -> Callable:
    """A `vs_hf` loss function as the recipe runs a step: copy the host batch over (`training.loop.to_device`,
    the recipes' own: on a side stream, beside the previous step's kernels), forward in bf16 autocast
    (`precision="fp32"`: no autocast, for CPU smoke runs where the CPU has no bf16 instructions)."""
    def step(model, host: dict[str, Any]) -> torch.Tensor:
        data = to_device(host, device)
        with autocast(device, precision):
            return loss(model, data)
    return step


@dataclass
class Result:
    model: str
    step_s: float
    examples_s: float
    tokens_s: float
    flops: int  # model FLOPs per step (this model's own count)
    tflops_s: float
    mfu: float
    useful_mfu: float  # with our count (the FLOPs the losses need)
    peak_mem_mib: float | None
    first_step_s: float  # includes compilation for the compiled model
    run_step_s: float  # a step's share of a run of --run-steps back-to-back steps
    run_mfu: float


def kernel_time_us(events) -> float:
    """The kernels' time in profiler events, as the table's footer counts it: the device's own events only.
    An operator's row also carries its kernels' time (and a compiled graph's annotation its whole graph's),
    so summing every row counted each kernel twice (the H200 run of 2026-11-26 printed 2x the footer)."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in events
               if e.device_type == DeviceType.CUDA and not e.is_user_annotation)


def profile_steps(fn: Callable[[], Any], device: torch.device, steps: int = 3) -> dict[str, Any]:
    """Where a training step's time goes: `torch.profiler` over `steps` steps. Returns the per-step host
    (CPU) and device (CUDA kernel) time and the operators' table sorted by device time (CPU time on a
    CPU run). A step whose host time is near its wall time while the kernels take much less is bound by
    launching them, not by the GPU."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    seconds(fn, device)  # nothing left queued from before
    with profile(activities=activities) as prof:
        wall = sum(seconds(fn, device) for _ in range(steps)) / steps
    events = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernel_us = kernel_time_us(events) if cuda else 0.0
    host_us = sum(e.self_cpu_time_total for e in events)
    return {
        "wall_ms": wall * 1e3,
        "host_ms": host_us / steps / 1e3,  # CPU time of the operators (launches included), per step
        "kernel_ms": kernel_us / steps / 1e3,  # sum of kernel times per step (0 on a CPU run)
        "table": events.table(sort_by=sort, row_limit=30),
    }


SDPA_BACKENDS = tuple(SDPA_KERNELS)
COMPILE_MODES: tuple[str, ...] = CompileMode.__args__  # torch.compile modes (`--compile_mode`)


def only_sdpa(backend: str, loss: Callable) -> Callable:
    """`loss` with `F.scaled_dot_product_attention` held to one kernel (an unsupported input raises
    "No available kernel" instead of falling back). On the H200 run of 2026-11-26, PyTorch chose cuDNN's
    fused attention, which took 133 us forward and 154 us backward per call for 256 x 12 heads x 56
    tokens: 13% of VisualBERT's kernel time and 22% of LXMERT's, for a small share of their FLOPs."""
    from torch.nn.attention import sdpa_kernel

    kernel = SDPA_KERNELS[backend]

    def restricted(model, data):
        with sdpa_kernel([kernel]):
            return loss(model, data)
    return restricted


def compiled_key(mode: str) -> str:
    """The results key of our model compiled in `mode` ("ours_compiled" for the default mode)."""
    return "ours_compiled" if mode == "default" else f"ours_compiled_{mode.replace('-', '_')}"


def run_arch(name: str, args, device: torch.device, peak: float) -> dict[str, Any]:
    arch = ARCHS[name]
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = models(arch, Path(tmp))
    cfg = ours.cfg
    b = args.batch
    host = batch(b=b, pad_text=args.pad_text)
    if device.type == "cuda":
        host = pinned(host)
    ours_count = our_flops(name, cfg, b, T, R, host["mlm"])
    hf_flops = FLOPS[name](cfg, b, T, R, HF_MLM_ROWS[name](b))
    entries = {"hf": (hf, arch.hf_step, hf_flops), "ours": (ours, arch.our_step, ours_count)}
    for mode in args.compile_modes:
        compiled = copy.deepcopy(ours)
        compiled.compile(mode=mode)  # in place, as `pretrain --compile`
        entries[compiled_key(mode)] = (compiled, arch.our_step, ours_count)
    for backend in args.sdpa_backends:  # eager copies whose attention may use this one kernel only
        entries[f"ours_sdpa_{backend}"] = (copy.deepcopy(ours), only_sdpa(backend, arch.our_step), ours_count)

    fns, first, mem = {}, {}, {}
    for key, (model, loss, _) in list(entries.items()):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        model.to(device).train()
        fns[key] = train_fn(model, autocast_step(loss, device, args.precision), build_optimizer(model, lr=1e-5), host)
        try:
            first[key] = seconds(fns[key], device)  # compilation happens here for the compiled model
        except RuntimeError as e:
            if "No available kernel" not in str(e):
                raise
            print(f"{arch.name}: {key}: no kernel of that kind takes these inputs (additive mask, dropout); "
                  "not timed")
            del fns[key], entries[key]
            model.to("cpu")
            continue
        for _ in range(args.warmup - 1):
            seconds(fns[key], device)
        mem[key] = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None

    checks = {key: flop_check(entries[key][2], counted_flops(fns[key])) for key in ("ours", "hf")}

    times: dict[str, list[float]] = {key: [] for key in fns}
    for i in range(args.steps + 1):  # one untimed round after the counter's step
        for key, fn in fns.items():
            t = seconds(fn, device)
            if i:
                times[key].append(t)
    runs: dict[str, list[float]] = {key: [] for key in fns}
    for _ in range(args.runs):  # back-to-back steps: the host queues step i+1 (its copy too) while step i runs
        for key, fn in fns.items():
            runs[key].append(seconds(fn, device, calls=args.run_steps))

    profiles = {}
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
        for key, fn in fns.items():
            p = profile_steps(fn, device)
            (args.profile / f"{name}_{key}_b{b}.txt").write_text(p.pop("table"))
            profiles[key] = p

    labels = {"hf": "Hugging Face", "ours": "vlberts",
              **{compiled_key(m): "vlberts compiled" + ("" if m == "default" else f" ({m})") for m in args.compile_modes},
              **{f"ours_sdpa_{b}": f"vlberts, attention: {b} only" for b in args.sdpa_backends}}
    results = {}
    for key, (_, _, flops) in entries.items():
        s, run = statistics.median(times[key]), statistics.median(runs[key])
        results[key] = Result(labels[key], s, b / s, b * (T + R) / s, flops.total, flops.total / s / 1e12,
                              flops.total / s / 1e12 / peak, ours_count.total / s / 1e12 / peak, mem[key], first[key],
                              run, flops.total / run / 1e12 / peak)
    for model, *_ in entries.values():
        model.to("cpu")
    del fns, entries
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "name": arch.name, "hf_attn_implementation": str(getattr(hf.config, "_attn_implementation", "unknown")),
        "results": {k: asdict(v) for k, v in results.items()},
        "ratio_ours_hf": results["hf"].step_s / results["ours"].step_s,
        "ratio_compiled_hf": results["hf"].step_s / results["ours_compiled"].step_s if "ours_compiled" in results else None,
        "ratio_compiled_modes_hf": {m: results["hf"].step_s / results[compiled_key(m)].step_s for m in args.compile_modes},
        "run_ratio_hf": {k: results["hf"].run_step_s / r.run_step_s for k, r in results.items() if k != "hf"},
        "flop_check": checks,
        "profiles": profiles,
    }


def print_arch(out: dict[str, Any], caveat: str) -> None:
    print(f"\n{out['name']}  (Hugging Face attention: {out['hf_attn_implementation']})")
    print("| model | step ms | examples/s | tokens/s | GFLOP/step | TFLOP/s | MFU | useful MFU | peak MiB "
          "| first step s | in a run: step ms | MFU |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in out["results"].values():
        mem = f"{r['peak_mem_mib']:.0f}" if r["peak_mem_mib"] is not None else "n/a"
        print(f"| {r['model']} | {r['step_s'] * 1e3:.1f} | {r['examples_s']:.1f} | {r['tokens_s']:.0f} | "
              f"{r['flops'] / 1e9:.1f} | {r['tflops_s']:.3f} | {r['mfu']:.1%} | {r['useful_mfu']:.1%} | {mem} | "
              f"{r['first_step_s']:.2f} | {r['run_step_s'] * 1e3:.1f} | {r['run_mfu']:.1%} |")
    print(f"throughput ours / Hugging Face (same run, interleaved): {out['ratio_ours_hf']:.2f}x"
          + "".join(f"; compiled{'' if m == 'default' else f' ({m})'}: {r:.2f}x"
                    for m, r in out["ratio_compiled_modes_hf"].items()))
    print("in runs of back-to-back steps: " + "; ".join(f"{out['results'][k]['model']} {r:.2f}x Hugging Face"
                                                       for k, r in out["run_ratio_hf"].items()))
    for key in out["results"]:
        if key != "hf":
            r = out["results"][key]
            tag = f" ({caveat})" if caveat else ""
            print(f"MFU goal >= {GOAL_MFU:.0%}, {r['model']}: {r['run_mfu']:.1%} in a run of steps "
                  f"{'PASS' if r['run_mfu'] >= GOAL_MFU else 'FAIL'} ({r['mfu']:.1%} a step timed alone){tag}")
    for key, p in out["profiles"].items():
        print(f"profile {key}: wall {p['wall_ms']:.1f} ms/step, operators' host time {p['host_ms']:.1f} ms, "
              f"kernels {p['kernel_ms']:.1f} ms (table in the --profile directory)")
    for key, c in out["flop_check"].items():
        print(f"FLOPs/step {key}: analytic {c['analytic'] / 1e9:.3f} G (linear {c['analytic_linear'] / 1e9:.3f}, "
              f"attention {c['analytic_attention'] / 1e9:.3f}); FlopCounterMode {c['counter'] / 1e9:.3f} G "
              f"(linear {c['counter_linear'] / 1e9:.3f}, attention {c['counter_attention'] / 1e9:.3f}); "
              f"expected {c['expected_counter'] / 1e9:.3f} G, diff {c['rel_diff']:+.2%}; {c['note']}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", choices=[*sorted(ARCHS), "all"], default="all")
    ap.add_argument("--batch", type=at_least(1), default=None, help="examples per step (default 64; 2 with --smoke)")
    ap.add_argument("--steps", type=at_least(1), default=None, help="timed steps per model (default 20; 2 with --smoke)")
    ap.add_argument("--warmup", type=at_least(1), default=None, help="warm-up steps per model (default 3; 1 with --smoke)")
    ap.add_argument("--run-steps", type=at_least(1), default=None,
                    help="back-to-back steps per timed run (default 10; 2 with --smoke)")
    ap.add_argument("--runs", type=at_least(1), default=None, help="timed runs per model (default 3; 1 with --smoke)")
    ap.add_argument("--compile", action="store_true", help="also time our model under torch.compile (default mode)")
    ap.add_argument("--compile-modes", default="",
                    help="comma-separated torch.compile modes to time, one compiled copy each "
                         "(default, reduce-overhead, max-autotune, ...); --compile adds default")
    ap.add_argument("--sdpa-backends", default="",
                    help=f"comma-separated attention kernels ({', '.join(SDPA_BACKENDS)}): also time an eager "
                         "copy of our model whose attention may use that kernel only, one row each")
    ap.add_argument("--attention-kernel", default=None,
                    help=f"hold every attention call of our models, eager and compiled, to this kernel, or to these "
                         f"in order (comma-separated, of {', '.join(ATTENTION_KERNELS)}; `pretrain --attention_kernel`, "
                         "held inside the compiled graphs; default: pretrain's, "
                         f"{','.join(DEFAULT_ATTENTION_KERNEL)}, or auto with --sdpa-backends); Hugging Face's eager "
                         "attention does not call SDPA")
    ap.add_argument("--pad-text", action="store_true",
                    help="captions of 12-20 tokens padded to 20, as a real batch is (default: all 20 real, so "
                         "that no attention call of ours takes a mask); the regions are all real either way")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--smoke", action="store_true", help="small CPU run that exercises the code path")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16",
                    help="the steps' autocast and the peak matmul's dtype (fp32: neither in bf16; for CPU smoke runs "
                         "on CPUs without bf16 instructions, where bf16 is emulated and slow)")
    ap.add_argument("--matmul-size", type=at_least(1), default=None, help="peak matmul size n (default 8192; 1024 smoke)")
    ap.add_argument("--threads", type=at_least(1), default=None, help="torch CPU threads (default: torch's own)")
    ap.add_argument("--json", default=None, help="write the numbers to this JSON file")
    ap.add_argument("--profile", type=Path, default=None,
                    help="also profile 3 steps of each model: per-step host and kernel time, and the operator "
                         "tables (DIR/ARCH_MODEL_bBATCH.txt)")
    args = ap.parse_args(argv)
    modes = [m.strip() for m in args.compile_modes.split(",") if m.strip()]
    args.compile_modes = list(dict.fromkeys((["default"] if args.compile else []) + modes))
    if unknown := [m for m in args.compile_modes if m not in COMPILE_MODES]:
        ap.error(f"--compile-modes: unknown {', '.join(unknown)} (choose from {', '.join(COMPILE_MODES)})")
    args.sdpa_backends = [b.strip() for b in args.sdpa_backends.split(",") if b.strip()]
    if unknown := [b for b in args.sdpa_backends if b not in SDPA_BACKENDS]:
        ap.error(f"--sdpa-backends: unknown {', '.join(unknown)} (choose from {', '.join(SDPA_BACKENDS)})")
    if args.attention_kernel is None:  # each --sdpa-backends row holds its own kernel with PyTorch's switches
        args.attention_kernel = "auto" if args.sdpa_backends else ",".join(DEFAULT_ATTENTION_KERNEL)
    if args.sdpa_backends and args.attention_kernel != "auto":  # the model's held kernel would override each row's
        ap.error("--sdpa-backends and --attention-kernel: choose one (the kernel held inside the model wins over "
                 "the rows' own)")
    try:
        use_attention_kernel(args.attention_kernel)
    except VlbertsError as e:
        ap.error(f"--attention-kernel: {e}")
    if args.threads:
        torch.set_num_threads(args.threads)
    vs_hf.transformers.utils.logging.disable_progress_bar()  # save_pretrained's shard bar

    cuda = torch.cuda.is_available()
    if args.device == "cuda" and not cuda:
        if not args.smoke:
            raise SystemExit("no CUDA device found: run on a machine with a GPU, or pass --smoke (--device cpu) "
                             "for a CPU smoke run")
        args.device = "cpu"
    small = args.smoke
    args.batch = args.batch or (2 if small else 64)
    args.steps = args.steps or (2 if small else 20)
    args.warmup = max(1, args.warmup or (1 if small else 3))
    args.run_steps = max(1, args.run_steps or (2 if small else 10))
    args.runs = max(1, args.runs or (1 if small else 3))
    n = args.matmul_size or (1024 if small else 8192)
    device = torch.device(args.device)

    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {dev_name}; torch {torch.__version__}, transformers {vs_hf.transformers.__version__}, "
          f"{torch.get_num_threads()} CPU threads")
    cpu_run = device.type == "cpu"
    caveat = "CPU run: not a GPU measurement" if cpu_run else "smoke run: small batch" if small else ""
    if cpu_run:
        kind = "smoke run on CPU" if args.smoke else "run on CPU (--device cpu)"
        print(f"{'no CUDA device: ' if not cuda else ''}{kind}, numbers are not GPU measurements")
    t0 = time.perf_counter()
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    peak = matmul_peak(device, n, repeats=3 if small else 10, inner=2 if small else 10, dtype=dtype)
    print(f"{args.precision} matmul peak (measured, {n}x{n}): {peak:.3f} TFLOP/s  [{time.perf_counter() - t0:.1f} s]")
    transfer = "pinned host batch copied to the GPU each step, on a side stream; " if device.type == "cuda" else ""
    if args.attention_kernel != "auto":
        print(f"our attention: {args.attention_kernel} (in that order where several; math where none can take the inputs)")
    text = "12-20 tokens padded to " if args.pad_text else ""
    mode = "bf16 autocast" if args.precision == "bf16" else "fp32 (no autocast)"
    print(f"batch {args.batch} x ({text}{T} tokens + {R} regions of {vs_hf.D}-d); {mode}, fused AdamW; {transfer}"
          f"median of {args.steps} interleaved steps after {args.warmup} warm-up, each timed alone; then the median of "
          f"{args.runs} runs of {args.run_steps} back-to-back steps")

    report: dict[str, Any] = {
        "device": dev_name, "device_type": device.type, "smoke": small, "caveat": caveat, "torch": torch.__version__,
        "transformers": vs_hf.transformers.__version__, "peak_tflops": peak, "matmul_size": n, "precision": args.precision,
        "batch": args.batch, "tokens": T, "regions": R, "steps": args.steps, "warmup": args.warmup,
        "run_steps": args.run_steps, "runs": args.runs,
        "mfu_goal": GOAL_MFU, "attention_kernel": args.attention_kernel, "pad_text": args.pad_text, "archs": {},
    }
    for name in (list(ARCHS) if args.arch == "all" else [args.arch]):
        out = run_arch(name, args, device, peak)
        print_arch(out, caveat)
        report["archs"][name] = out
        sys.stdout.flush()
    if args.json:
        write_json(args.json, report)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    guarded(main)
