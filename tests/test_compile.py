"""`--compile=true` (torch.compile in place, issue 6's optional compile): the compiled run trains the same
model as the eager one, to float tolerance, and writes the same checkpoint names, in pre-training and in
the fine-tuning loop every task shares. Skipped where inductor
has no C++ compiler to build CPU kernels with."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from test_finetune_vqa import vqa_cfg
from test_pretrain import cfg_for

from vlberts.models import builders
from vlberts.recipes.finetune_vqa import finetune_vqa
from vlberts.recipes.pretrain import pretrain
from vlberts.training.metrics import MetricsLog

pytestmark = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                reason="torch.compile on CPU needs a C++ compiler")


def test_compiled_pretraining_equals_eager(tiny_world, tmp_path, monkeypatch):
    """Pre-training compiled as `--compile=true --compile_mode=reduce-overhead --static_shapes` (CUDA graphs on
    a GPU; on a CPU the mode compiles as the default one does) trains the eager run's model, and the step
    compiles a few graphs, not one per batch: the shapes hold still. (The default mode with shapes that vary
    per batch is the fine-tuning test's: each test costs 40-60 s of C++ kernel building on 2 cores when
    inductor's cache is cold, as in CI.)"""
    # Dropout off: compiled kernels draw their random masks differently from eager ones.
    monkeypatch.setitem(builders.MODEL_CONFIGS, "visualbert-tiny-nodrop",
                        lambda **kw: builders.visualbert_tiny(hidden_dropout=0.0, attention_dropout=0.0, **kw))
    # Captions cut to 12 tokens: every batch's text is padded to the same length (the bucket of 12), so the
    # six batches make one or two shapes (masked-word buckets), each graph costing ~25 s of kernel building.
    cfg = dict(model="visualbert-tiny-nodrop", steps=6, batch_size=16, compile_mode="reduce-overhead", static_shapes=True,
               max_text_len=12)
    logs, weights = {}, {}
    for name, compile_ in (("eager", False), ("compiled", True)):
        out = tmp_path / name
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        pretrain(cfg_for(tiny_world, out, ckpt_every=100, compile=compile_, **cfg))
        logs[name] = MetricsLog.read(out / "metrics.jsonl")
        weights[name] = load_file(out / "model" / "model.safetensors")
        compiled_graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert (compiled_graphs > 0) == compile_, (name, compiled_graphs)  # the forward really was compiled
        assert compiled_graphs <= 2, compiled_graphs  # not one graph per batch: the shapes hold still
    assert len(logs["eager"]) == 6
    for a, b in zip(logs["eager"], logs["compiled"], strict=True):
        for key in ("mlm_loss", "match_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["step"], key)
    assert weights["compiled"].keys() == weights["eager"].keys()  # no `_orig_mod.` prefix
    for k, w in weights["eager"].items():
        assert (weights["compiled"][k] - w).abs().max() < 1e-4, k

    # A compiled run interrupted after its checkpoint at update 2 resumes eagerly (compile may change on
    # resume): it ends with the eager run's log and weights.
    out = tmp_path / "switched"
    torch._dynamo.reset()
    assert pretrain(cfg_for(tiny_world, out, compile=True, stop_after=2, ckpt_every=2, **cfg)) is None
    pretrain(cfg_for(tiny_world, out, compile=False, ckpt_every=2, **cfg))
    switched = MetricsLog.read(out / "metrics.jsonl")
    assert [r["step"] for r in switched] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(logs["eager"], switched, strict=True):
        assert b["mlm_loss"] == pytest.approx(a["mlm_loss"], rel=1e-4, abs=1e-6), a["step"]
    for k, w in load_file(out / "model" / "model.safetensors").items():
        assert (w - weights["eager"][k]).abs().max() < 1e-4, k


def test_compiled_finetuning_equals_eager(tiny_world, tiny_pretrained, tmp_path):
    init = tmp_path / "init"  # the tiny checkpoint with dropout off
    shutil.copytree(tiny_pretrained, init)
    cfg = json.loads((init / "config.json").read_text())
    cfg["config"].update(hidden_dropout=0.0, attention_dropout=0.0)
    (init / "config.json").write_text(json.dumps(cfg))
    logs = {}
    for name, compile_ in (("eager", False), ("compiled", True)):
        out = tmp_path / name
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        finetune_vqa(vqa_cfg(tiny_world, init, out, ckpt_every=100, compile=compile_))
        logs[name] = MetricsLog.read(out / "metrics.jsonl")
        assert (torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0) == compile_, name
    assert len(logs["eager"]) >= 2
    for a, b in zip(logs["eager"], logs["compiled"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6), a["step"]
