"""Fixed-shape pre-training batches (`vlberts pretrain --static_shapes`, `data.pretrain.fixed_shapes`): every
batch padded to the run's region count, its text length to bucket sizes, the masked-word lists to powers of
two, with the same losses as unpadded batches; what CUDA graphs (`--compile_mode=reduce-overhead`) need."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from safetensors.torch import load_file
from test_pretrain import cfg_for

from vlberts.data.batch import bucket, coarse_bucket, select_tokens
from vlberts.models import builders
from vlberts.recipes import pretrain as pretrain_module
from vlberts.recipes.pretrain import pretrain
from vlberts.text.masking import IGNORE_INDEX
from vlberts.training.metrics import MetricsLog

TINY = {"visualbert": "visualbert-tiny", "vilbert": "vilbert-tiny", "vlbert": "vlbert-tiny",
        "lxmert": "lxmert-tiny", "wvisualbert": "wvisualbert-tiny"}


def test_bucket_sizes_hold_the_count_with_at_most_a_quarter_more():
    assert [bucket(n) for n in (0, 1, 8, 9, 16, 17, 100, 768, 790)] == [0, 8, 8, 10, 16, 20, 112, 768, 896]
    for n in range(9, 5000):
        assert n <= bucket(n) <= 1.25 * n
    # masked-word counts of a batch of 256 x 20 tokens vary by a few dozen: one or two sizes
    assert len({bucket(n) for n in range(740, 800)}) == 2


def test_coarse_bucket_sizes_are_powers_of_two_that_hold_the_count():
    assert [coarse_bucket(n) for n in (0, 1, 8, 9, 16, 17, 100, 768, 790)] == [0, 8, 8, 16, 16, 32, 128, 1024, 1024]
    for n in range(9, 5000):
        assert n <= coarse_bucket(n) < 2 * n and coarse_bucket(n) & (coarse_bucket(n) - 1) == 0
    # the masked words of a batch of 240 x 30 tokens (about 720, a few dozen either way): one size where
    # `bucket` has two, and the most in one example (8 to 13 in such a batch) at most two where it has four
    assert len({coarse_bucket(n) for n in range(640, 800)}) == 1 < len({bucket(n) for n in range(640, 800)})
    assert len({coarse_bucket(n) for n in range(8, 14)}) == 2 < len({bucket(n) for n in range(8, 14)})


def test_bucketed_selection_pads_with_cls_of_the_first_example():
    labels = torch.full((3, 6), IGNORE_INDEX)
    labels[0, 2], labels[1, 1], labels[1, 4], labels[2, 5] = 7, 8, 9, 10  # 4 masked words, at most 2 in a row
    plain, padded = select_tokens(labels != IGNORE_INDEX), select_tokens(labels != IGNORE_INDEX, bucketed=True)
    assert padded.example.shape == (8,) and padded.rows.shape == (3, 1 + 8) and padded.count == plain.count == 4
    assert torch.equal(padded.example[:4], plain.example) and torch.equal(padded.position[:4], plain.position)
    assert torch.equal(padded.rows[:, :3], plain.rows) and not padded.rows[:, 3:].any()
    assert not padded.example[4:].any() and not padded.position[4:].any() and not padded.slot[4:].any()
    # the padding entries gather [CLS] of example 0, whose label is never set: a loss over them ignores them
    assert (labels[padded.example, padded.position][4:] == IGNORE_INDEX).all()


def _shapes_of_each_batch(monkeypatch) -> list[dict[str, tuple]]:
    """Record the tensor shapes of every batch the pre-training collate makes."""
    seen = []
    collate = pretrain_module.collate_pretrain

    def recording(*args, **kw):
        batch = collate(*args, **kw)
        sel = batch.mlm_tokens
        seen.append({"text": tuple(batch.inputs.input_ids.shape), "regions": tuple(batch.inputs.region_feats.shape),
                     "labels": tuple(batch.mlm_labels.shape), "selected": (sel.example.shape[0], sel.rows.shape[1]),
                     "masked": sel.count,
                     "targets": None if batch.regions is None else tuple(batch.regions.masked.shape),
                     "tags": None if batch.tags is None else tuple(batch.tags.tag_ids.shape)})
        return batch

    monkeypatch.setattr(pretrain_module, "collate_pretrain", recording)
    return seen


@pytest.mark.parametrize("arch", sorted(TINY))
def test_every_batch_keeps_its_shapes(tiny_world, tmp_path, monkeypatch, arch):
    seen = _shapes_of_each_batch(monkeypatch)
    pretrain(cfg_for(tiny_world, tmp_path / "run", model=TINY[arch], steps=10, batch_size=32, max_text_len=40,
                     max_regions=30, static_shapes=True, ckpt_every=100))
    assert len(seen) >= 10
    # The epoch's last batch is shorter (one more shape, once an epoch): 240 captions in batches of 32.
    assert {s["text"][0] for s in seen} == {32, 16} and all(s["labels"] == s["text"] for s in seen)
    # text lengths in bucket sizes, at most --max_text_len; every region count --max_regions
    lengths = {s["text"][1] for s in seen}
    assert all(bucket(t) == t or t == 40 for t in lengths) and max(lengths) <= 40 and len(lengths) <= 3
    assert {s["regions"][:2] for s in seen} == {(32, 30), (16, 30)}
    assert {s["targets"] for s in seen} <= {None, (32, 30), (16, 30)}
    assert len({s["tags"] for s in seen if s["tags"] and s["tags"][0] == 32}) <= 2  # W-VisualBERT's tags, bucketed
    # The masked words (about 110 a batch of 32 here, half that for ViLBERT, which drops the targets of
    # mismatched pairs) and their largest number in one example take powers of two: fewer shapes than counts.
    full = [s for s in seen if s["text"][0] == 32]
    sizes = {s["selected"] for s in full}
    assert all(coarse_bucket(n) == n and coarse_bucket(m - 1) == m - 1 for n, m in sizes)
    assert all(s["masked"] <= s["selected"][0] < 2 * s["masked"] for s in full)
    assert len({n for n, _ in sizes}) < len({s["masked"] for s in full})
    unpadded = _shapes_of_each_batch(monkeypatch)
    pretrain(cfg_for(tiny_world, tmp_path / "plain", model=TINY[arch], steps=10, batch_size=32, max_text_len=40,
                     max_regions=30, ckpt_every=100))
    assert len({s["text"] for s in unpadded}) > 1  # without the option the lengths do vary (the test has teeth)


def _without_dropout(name: str):
    make = builders.MODEL_CONFIGS[name]

    def build(**kw):
        cfg = make(**kw)
        return dataclasses.replace(cfg, **{f.name: 0.0 for f in dataclasses.fields(cfg) if "dropout" in f.name})
    return build


@pytest.mark.parametrize("arch", ["visualbert", "vilbert", "vlbert", "wvisualbert", "lxmert"])
def test_padded_batches_train_the_same_model(tiny_world, tmp_path, monkeypatch, arch):
    """Dropout off (its masks are drawn per element, so padding would move them): the same losses and
    weights up to float rounding. LXMERT's and W-VisualBERT's region losses average over every region slot,
    so with padding they are scaled by the batch's region count over --max_regions: there the first
    update's text losses are compared."""
    name = f"{TINY[arch]}-nodrop"
    monkeypatch.setitem(builders.MODEL_CONFIGS, name, _without_dropout(TINY[arch]))
    runs = {}
    for static in (False, True):
        out = tmp_path / f"static{static}"
        pretrain(cfg_for(tiny_world, out, model=name, steps=6, batch_size=8, max_text_len=40, max_regions=30,
                         static_shapes=static, ckpt_every=100))
        runs[static] = (MetricsLog.read(out / "metrics.jsonl"), load_file(str(out / "model" / "model.safetensors")))
    (log_a, w_a), (log_b, w_b) = runs[False], runs[True]
    slot_averaged = arch in ("lxmert", "wvisualbert")
    if slot_averaged:  # the first update's text losses only: the region losses scale differently
        log_a, log_b = log_a[:1], log_b[:1]
    compared = 0
    for a, b in zip(log_a, log_b, strict=True):
        keys = [k for k in a if k.endswith("_loss") and (not slot_averaged or k in ("mlm_loss", "match_loss"))]
        assert keys == [k for k in b if k in keys]  # W-VisualBERT alternates text and image batches
        for k in keys:
            assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), (a["step"], k)
        compared += "mlm_loss" in keys
    assert compared
    if not slot_averaged:
        assert all(torch.allclose(w_a[k], w_b[k], rtol=1e-4, atol=1e-5) for k in w_a)


def test_compile_mode_reaches_torch_compile_in_pretraining_and_finetuning(tiny_world, tiny_pretrained, tmp_path,
                                                                         monkeypatch):
    """`--compile_mode` is passed to `torch.compile` by every training command (the compiling itself is
    replaced here: `tests/test_compile.py` compiles for real). With `--static_shapes` each shape gets a graph
    of its own, never a dynamic one (Inductor failed on the dynamic graph on the H200, `compile_model`), and
    dynamo may keep 64 of them."""
    import torch._dynamo.config as dynamo_config
    from test_finetune_vqa import vqa_cfg

    from vlberts.recipes.finetune_vqa import finetune_vqa

    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: calls.append((kw.get("mode"), kw.get("dynamic"))))
    monkeypatch.setenv("CXX", sys.executable)  # nothing is built: the C++ compiler pre-check must not stop it
    # restored after the test by the config's own patch (pytest's monkeypatch leaves torch's config module without
    # the attribute, which broke test_compile when it ran later in the same process)
    with dynamo_config.patch(recompile_limit=8):
        pretrain(cfg_for(tiny_world, tmp_path / "pt", steps=2, compile=True, compile_mode="max-autotune"))
        assert dynamo_config.recompile_limit == 8
        pretrain(cfg_for(tiny_world, tmp_path / "static", steps=2, compile=True, compile_mode="reduce-overhead",
                         static_shapes=True))
        assert dynamo_config.recompile_limit == 64
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "ft", compile=True, compile_mode="reduce-overhead",
                             epochs=0.1))
    assert calls == [("max-autotune", None), ("reduce-overhead", False), ("reduce-overhead", None)]


def test_the_loops_copy_gradients_out_of_cuda_graphs_between_micro_batches_only_where_graphs_replay():
    """`--compile_mode` reduce-overhead and max-autotune replay CUDA graphs on a GPU (and only there); with
    `--grad_accum` > 1 the loops then replace each gradient by an eager copy between micro-batches (the next
    replay would overwrite the graph's memory: tests/test_gpu.py runs it), same values, new storage."""
    from vlberts.recipes.common import own_gradients, replays_cuda_graphs

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert replays_cuda_graphs(True, "reduce-overhead", cuda) and replays_cuda_graphs(True, "max-autotune", cuda)
    assert not replays_cuda_graphs(True, "default", cuda) and not replays_cuda_graphs(True, "max-autotune-no-cudagraphs", cuda)
    assert not replays_cuda_graphs(True, "reduce-overhead", cpu) and not replays_cuda_graphs(False, "reduce-overhead", cuda)
    model = torch.nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    before = {n: p.grad for n, p in model.named_parameters()}
    own_gradients(model)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]) and p.grad.data_ptr() != before[n].data_ptr()
