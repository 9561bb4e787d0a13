"""The GPU path (issue 6, item 2), on a CUDA device; every test here is skipped where there is none (CI).

- Every architecture's pre-training losses and gradients on CUDA equal the CPU's in fp32, and stay within
  bf16's rounding under the bf16 autocast the recipes use there.
- Our attention runs on PyTorch's fused SDPA kernels with the additive masks the models build (no silent
  fallback to the math kernel), and each fused kernel agrees with the explicit softmax path.
- `vlberts pretrain` trains every architecture on CUDA in bf16 with fp32 master weights (MLM falls), and in fp16
  with loss scaling; an interrupted CUDA run resumes to the uninterrupted run's log and weights.
- `--compile=true` on CUDA trains the eager model's numbers; fine-tuning and the grounding analysis run there.
- The pre-training loader hands over batches in pinned memory (every tensor, nested batches included), with
  a float16 store's features float16 up to the device.
- Gradient sums overlapped with backward on CUDA tensors equal one process's (2 processes: NCCL on 2 GPUs,
  gloo on the one GPU both share otherwise).

Run them with `pytest -m gpu` on a machine with a GPU.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from test_distributed import _overlap_worker, check_overlapped_sums
from test_finetune_vqa import vqa_cfg
from test_pretrain import cfg_for
from test_pretrain_archs import _data, tiny_model_and_batch

from vlberts.data.pretrain import collate_pretrain, unpaired_view
from vlberts.models import builders
from vlberts.models.blocks import MultiHeadAttention
from vlberts.objectives.recipe import RECIPES, pretrain_losses, run_model, total_loss
from vlberts.recipes.common import autocast
from vlberts.recipes.finetune_vqa import finetune_vqa
from vlberts.recipes.pretrain import pretrain
from vlberts.training.checkpoint import load_pretraining_model
from vlberts.training.metrics import MetricsLog

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ARCHS = ["visualbert", "vilbert", "vlbert", "lxmert", "wvisualbert"]
CUDA = torch.device("cuda")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _losses_and_grads(arch, model, batch, weights, source, device, precision):
    model.zero_grad(set_to_none=True)
    batch = batch.to(device)
    if source is not None:
        batch = unpaired_view(batch, source)
    with autocast(device, precision):
        out = run_model(RECIPES[arch], model, batch)
    losses = pretrain_losses(RECIPES[arch], out, batch, weights, source)
    total_loss(losses, weights).backward()
    grads = {n: p.grad.detach().cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    return {k: v.detach().float().cpu() for k, v in losses.items()}, grads


@pytest.mark.parametrize("arch", ARCHS)
def test_losses_and_gradients_on_cuda_equal_the_cpus(tiny_world, arch):
    torch.manual_seed(0)
    model, batch, weights = tiny_model_and_batch(tiny_world, arch)
    model.eval()  # dropout off: the same function on both devices
    for source in (("text", "image") if arch == "wvisualbert" else (None,)):
        ref, ref_grads = _losses_and_grads(arch, model, batch, weights, source, torch.device("cpu"), "fp32")
        model.to(CUDA)
        fp32, fp32_grads = _losses_and_grads(arch, model, batch, weights, source, CUDA, "fp32")
        bf16, bf16_grads = _losses_and_grads(arch, model, batch, weights, source, CUDA, "bf16")
        model.cpu()
        assert ref.keys() == fp32.keys() == bf16.keys() and ref, (arch, source)
        for k, v in ref.items():
            assert torch.isfinite(bf16[k]).all(), (arch, source, k)
            assert _rel(fp32[k], v) < 1e-4, (arch, source, k, float(fp32[k]), float(v))
            assert _rel(bf16[k], v) < 3e-2, (arch, source, k, float(bf16[k]), float(v))
        assert ref_grads.keys() == fp32_grads.keys() == bf16_grads.keys()
        flat = [torch.cat([g[n].flatten() for n in sorted(ref_grads)]) for g in (ref_grads, fp32_grads, bf16_grads)]
        assert _rel(flat[1], flat[0]) < 1e-3, (arch, source)
        assert _rel(flat[2], flat[0]) < 5e-2, (arch, source)


def test_the_prefetched_pretraining_batches_are_pinned(tiny_world):
    """Drawn through the recipes' `feed` on a GPU (a thread, with the GPU current there), every tensor of a
    batch, nested ones included, arrives in page-locked memory, so `to(cuda, non_blocking=True)` overlaps the
    GPU's work."""
    from vlberts.data.sampling import Position
    from vlberts.training.loop import batches, feed

    data, tok = _data(tiny_world, "wvisualbert")
    collate = lambda examples: collate_pretrain(examples, pad_id=tok.pad_id)  # noqa: E731
    with feed(batches(data, collate, batch_size=4, seed=0, start=Position()), CUDA) as ahead:
        assert ahead._thread is not None  # drawn ahead by default on a GPU
        batch, _ = next(ahead)
    tensors = list(batch.tensors())
    assert len(tensors) > 15 and all(t.is_pinned() for t in tensors)


def test_batches_are_copied_on_a_side_stream_that_the_compute_stream_waits_for():
    """`to_device` (every training loop's copy) queues the copy on its side stream, not the compute stream,
    and the compute stream waits for it: with the side stream held up first (a spin kernel), a sum queued
    on the compute stream right after still reads the copied values, not what the memory held before
    (-1 here, from a tensor freed on the side stream, whose block the copy reuses)."""
    from vlberts.training.loop import copy_stream, pinned, to_device

    n = 1 << 23  # 64 MiB of int64
    host = pinned(("source", {"x": torch.full((n,), 3, dtype=torch.int64)}))
    side = copy_stream(CUDA)
    assert side != torch.cuda.current_stream(CUDA)
    # The kernels used below loaded first: a kernel's first launch loads its module, which took longer than
    # 0.25 s of spinning when this test ran alone.
    assert int(to_device(host, CUDA)[1]["x"].sum()) == 3 * n
    torch.cuda._sleep(1000)
    torch.cuda.synchronize(CUDA)
    with torch.cuda.stream(side):
        torch.full((n,), -1, dtype=torch.int64, device=CUDA)  # freed at once: its block goes back to the side stream's pool
        torch.cuda._sleep(4_000_000_000)  # 2-4 s of spinning on the side stream (clocks 1-2 GHz), before the copy
    torch.cuda.current_stream(CUDA).synchronize()
    source, moved = to_device(host, CUDA)
    total = moved["x"].sum()  # queued on the compute stream
    assert not side.query()  # the copy is still held up behind the spin
    assert source == "source" and moved["x"].device.type == "cuda"
    assert int(total) == 3 * n


def test_a_run_mixing_three_sources_copies_pinned_batches_to_the_gpu(tiny_world, tmp_path, monkeypatch):
    """H-VisualBERT with text-only documents and image-only samples: batches collated from three streams in
    the training process (not by a DataLoader) reach the GPU from page-locked memory too."""
    from test_text_corpus import _cfg

    from vlberts.data.batch import PretrainBatch

    copied: list[bool] = []
    to = PretrainBatch.to

    def recording_to(self, device, non_blocking=False):
        if torch.device(device).type == "cuda":
            copied.extend(t.is_pinned() for t in self.tensors())
        return to(self, device, non_blocking=non_blocking)

    monkeypatch.setattr(PretrainBatch, "to", recording_to)
    root = tiny_world.root
    pretrain(_cfg(tiny_world, tmp_path / "h", "wvisualbert-h-tiny", text_corpus=str(root / "text" / "documents.txt"),
                  unpaired_images=str(root / "unpaired_images.txt"), text_ratio=0.25, device="cuda"))
    assert len(copied) > 8 * 10 and all(copied)


@pytest.mark.parametrize("sq,sk", [(20, 20), (20, 36), (56, 56), (37, 13)])
def test_attention_runs_on_fused_kernels_and_equals_the_explicit_path(sq, sk):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    attn = MultiHeadAttention(hidden_size=768, num_heads=12, dropout=0.1).to(CUDA).eval()
    x, ctx = torch.randn(4, sq, 768, device=CUDA), torch.randn(4, sk, 768, device=CUDA)
    # The models' additive key mask (B, 1, 1, Sk): padding at the end of two rows.
    keep = torch.ones(4, sk, dtype=torch.bool, device=CUDA)
    keep[1, sk // 2:] = False
    keep[3, -1:] = False
    bias = torch.zeros(4, 1, 1, sk, device=CUDA).masked_fill(~keep[:, None, None, :], torch.finfo(torch.float32).min)
    fused = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]
    with torch.no_grad():
        ref, probs = attn(x, bias, ctx=ctx, need_weights=True)  # explicit softmax path, fp32
        with torch.autocast("cuda", dtype=torch.bfloat16):
            with sdpa_kernel(fused):  # raises "No available kernel" if only the math kernel could take it
                out, none = attn(x, bias.to(torch.bfloat16), ctx=ctx)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # fp32 through the memory-efficient kernel
            out32, _ = attn(x, bias, ctx=ctx)
    assert probs is not None and float(probs[1, :, :, sk // 2:].max()) == 0.0
    assert none is None and out.dtype == torch.bfloat16
    assert _rel(out, ref) < 2e-2, (sq, sk)
    assert _rel(out32, ref) < 1e-5


def test_attention_kernels_are_tried_in_the_order_named_and_flash_runs_without_a_mask(monkeypatch):
    """`--attention_kernel=flash,efficient`: a call without a mask (keys with no padding, `blocks.key_bias`)
    runs flash, one with a mask the memory-efficient kernel; named the other way round, efficient runs both."""
    from vlberts.models import blocks

    monkeypatch.setattr(blocks, "_kernels", None)
    monkeypatch.setattr(blocks, "_setting", "auto")
    torch.manual_seed(0)
    attn = MultiHeadAttention(hidden_size=768, num_heads=12, dropout=0.1).to(CUDA).train()
    x = torch.randn(8, 36, 768, device=CUDA)
    bias = blocks.mask_bias(torch.ones(8, 36, dtype=torch.bool, device=CUDA), torch.bfloat16)

    def kernels(b) -> set[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                attn(x, b)[0].sum().backward()
        return {e.key for e in prof.key_averages() if "attention" in e.key and "backward" not in e.key}

    flash, efficient = "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention"
    blocks.use_attention_kernel("flash,efficient")
    assert flash in kernels(None) and efficient not in kernels(None)
    assert efficient in kernels(bias) and flash not in kernels(bias)
    blocks.use_attention_kernel("efficient,flash")
    assert efficient in kernels(None) and flash not in kernels(None)
    blocks.use_attention_kernel(blocks.DEFAULT_ATTENTION_KERNEL)  # the default: efficient, with a mask or without
    assert efficient in kernels(None) and efficient in kernels(bias) and flash not in kernels(bias) | kernels(None)


@pytest.mark.parametrize("model", [f"{a}-tiny" for a in ARCHS])
def test_pretraining_on_cuda_in_bf16_learns(tiny_world, tmp_path, model):
    out = tmp_path / model
    final = pretrain(cfg_for(tiny_world, out, model=model, steps=30, batch_size=8, lr=2e-3, ckpt_every=100,
                             device="cuda", precision="auto"))
    log = MetricsLog.read(out / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 31))
    assert all(torch.isfinite(torch.tensor(v)) for r in log for k, v in r.items() if k.endswith("_loss"))
    mlm = [r["mlm_loss"] for r in log if "mlm_loss" in r]  # W-VisualBERT: its text-only updates
    first, last = sum(mlm[:4]) / 4, sum(mlm[-4:]) / 4
    assert last < first, (model, first, last)
    weights = load_file(final / "model.safetensors")
    assert all(w.dtype == torch.float32 for w in weights.values())  # fp32 master weights, bf16 only in autocast
    loaded, _, _ = load_pretraining_model(final)  # a CUDA run's model loads on the CPU
    assert next(loaded.parameters()).device.type == "cpu"


def test_fp16_pretraining_on_cuda_learns_with_loss_scaling(tiny_world, tmp_path):
    """`--precision=fp16` (GPUs without bf16): fp16 autocast, the loss scaled; MLM falls, the scale is logged,
    the weights stay fp32."""
    out = tmp_path / "fp16"
    final = pretrain(cfg_for(tiny_world, out, steps=30, batch_size=8, lr=2e-3, ckpt_every=100, device="cuda",
                             precision="fp16"))
    log = MetricsLog.read(out / "metrics.jsonl")
    assert all(r["loss_scale"] > 0 for r in log) and all(torch.isfinite(torch.tensor(r["mlm_loss"])) for r in log)
    mlm = [r["mlm_loss"] for r in log]
    assert sum(mlm[-4:]) < sum(mlm[:4])
    assert all(w.dtype == torch.float32 for w in load_file(final / "model.safetensors").values())


def test_interrupted_cuda_run_resumes_to_the_same_run(tiny_world, tmp_path):
    cfg = dict(model="visualbert-tiny", steps=8, ckpt_every=3, device="cuda", precision="bf16")
    ref = tmp_path / "ref"
    pretrain(cfg_for(tiny_world, ref, **cfg))
    run = tmp_path / "run"
    assert pretrain(cfg_for(tiny_world, run, stop_after=5, **cfg)) is None
    pretrain(cfg_for(tiny_world, run, **cfg))
    a, b = MetricsLog.read(ref / "metrics.jsonl"), MetricsLog.read(run / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 9))
    for x, y in zip(a, b, strict=True):  # CUDA kernels may reduce in another order: equal to rounding
        assert y["mlm_loss"] == pytest.approx(x["mlm_loss"], rel=1e-3) and y["lr"] == x["lr"], x["step"]
    wa, wb = load_file(ref / "model" / "model.safetensors"), load_file(run / "model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert max(_rel(wb[k], wa[k]) for k in wa if wa[k].norm() > 0) < 1e-3


def test_float16_batches_on_cuda_train_as_float32_ones(tiny_world, tiny_pretrained, float16_store, tmp_path):
    """On CUDA a float16 store's features stay float16 to the device by default (`--float16_batches=auto`),
    widened on the copy stream: the run is the float32-batch run's, to CUDA's rounding (LXMERT: masked,
    swapped and regressed features), in pre-training and in fine-tuning (VQA)."""
    logs = {}
    for flag in ("auto", "false"):
        pretrain(cfg_for(tiny_world, tmp_path / flag, model="lxmert-tiny", features=str(float16_store), steps=6,
                         device="cuda", precision="fp32", float16_batches=flag))
        logs[flag] = MetricsLog.read(tmp_path / flag / "metrics.jsonl")
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / f"vqa-{flag}", features=str(float16_store),
                             epochs=0.5, device="cuda", precision="fp32", float16_batches=flag))
        logs["vqa-" + flag] = MetricsLog.read(tmp_path / f"vqa-{flag}" / "metrics.jsonl")
    for x, y in zip(logs["false"], logs["auto"], strict=True):
        for k in ("mlm_loss", "feat_loss", "obj_loss"):
            assert y[k] == pytest.approx(x[k], rel=1e-4), (x["step"], k)
    for x, y in zip(logs["vqa-false"], logs["vqa-auto"], strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4), x["step"]


@pytest.mark.parametrize("mode, static, accum", [("default", False, 1), ("reduce-overhead", True, 2)])
def test_compiled_training_on_cuda_equals_eager(tiny_world, tmp_path, monkeypatch, mode, static, accum):
    """Compiled training logs the eager run's losses. In `--compile_mode=reduce-overhead --static_shapes`
    the step is replayed as CUDA graphs (a few, one per bucket size), here with two micro-batches an
    update: a graph's outputs are overwritten by its next replay, so a loop that kept one across
    micro-batches would fail."""
    monkeypatch.setitem(builders.MODEL_CONFIGS, "visualbert-tiny-nodrop",
                        lambda **kw: builders.visualbert_tiny(hidden_dropout=0.0, attention_dropout=0.0, **kw))
    logs = {}
    for name, compile_ in (("eager", False), ("compiled", True)):
        torch._dynamo.reset()
        out = tmp_path / name
        pretrain(cfg_for(tiny_world, out, model="visualbert-tiny-nodrop", steps=6, batch_size=16, grad_accum=accum,
                         ckpt_every=100, device="cuda", precision="fp32", compile=compile_, compile_mode=mode,
                         static_shapes=static))
        logs[name] = MetricsLog.read(out / "metrics.jsonl")
    for a, b in zip(logs["eager"], logs["compiled"], strict=True):
        for key in ("mlm_loss", "match_loss"):
            assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-5), (a["step"], key)


def test_vqa_finetuning_on_cuda(tiny_world, tiny_pretrained, tmp_path):
    out = tmp_path / "vqa"
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, out, device="cuda"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert 0 <= metrics["accuracy"] <= 100 and metrics["num_questions"] > 0
    log = MetricsLog.read(out / "metrics.jsonl")
    assert log and all(torch.isfinite(torch.tensor(r["loss"])) for r in log if "loss" in r)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (one per torchrun rank)")
def test_torchrun_on_two_gpus_trains_logs_once_and_resumes(tiny_world, tmp_path):
    # NCCL carries the gradients and gloo the CPU-side totals and predictions (init_distributed's
    # "cpu:gloo,cuda:nccl"): NCCL alone fails on the first CPU tensor the recipe reduces.
    from test_distributed import _pretrain_args, _torchrun

    ref = tmp_path / "ref"
    proc = _torchrun(_pretrain_args(tiny_world, ref, "--device=auto"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = MetricsLog.read(ref / "metrics.jsonl")
    assert [r["step"] for r in log] == list(range(1, 9))  # rank 0 logs, once per update
    run = tmp_path / "run"
    assert _torchrun(_pretrain_args(tiny_world, run, "--stop_after=5")).returncode == 0
    proc = _torchrun(_pretrain_args(tiny_world, run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for a, b in zip(log, MetricsLog.read(run / "metrics.jsonl"), strict=True):
        assert b["mlm_loss"] == pytest.approx(a["mlm_loss"], rel=1e-3), a["step"]


def test_gradient_sums_overlapped_with_backward_on_cuda_equal_one_process(tmp_path):
    two = torch.cuda.device_count() >= 2  # NCCL needs a GPU per rank (the recipes' backends); one GPU: gloo
    out = tmp_path / "grads.pt"
    mp.spawn(_overlap_cuda, args=(str(tmp_path / "init"), str(out), two), nprocs=2, join=True)
    check_overlapped_sums(torch.load(out, weights_only=True), rtol=1e-4, atol=1e-6)


def _overlap_cuda(rank: int, init_file: str, out: str, two: bool) -> None:
    _overlap_worker(rank, 2, init_file, out, device=f"cuda:{rank if two else 0}", backend="cpu:gloo,cuda:nccl" if two else "gloo")
