"""VisualBERT building blocks: SDPA and explicit attention agree; masking; alignment positions."""

import json

import torch

from vlberts.data.batch import VLInputs
from vlberts.models.builders import build_pretraining_model, visualbert_tiny


def _inputs(B=2, T=7, R=4, D=16, V=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 5:] = False
    rmask = torch.ones(B, R, dtype=torch.bool)
    rmask[B - 1, 2:] = False
    return VLInputs(torch.randint(5, V, (B, T), generator=g), torch.zeros(B, T, dtype=torch.long), mask,
                    torch.randn(B, R, D, generator=g), torch.rand(B, R, 4, generator=g), rmask)


def test_sdpa_and_explicit_attention_agree_and_maps_are_distributions():
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny(visual_spatial="6d")).eval()
    x = _inputs()
    fast = model(x)
    slow = model(x, need_attn=True)
    torch.testing.assert_close(fast.mlm_logits, slow.mlm_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.match_logits, slow.match_logits, atol=1e-5, rtol=0)
    maps = slow.encoded.attentions
    assert len(maps.joint) == 2 and maps.joint[0].shape == (2, 4, 11, 11)
    for m in maps.joint:
        torch.testing.assert_close(m.sum(-1), torch.ones(2, 4, 11))
        assert m[0, :, :, 5:7].abs().max() == 0  # padded words get no attention
        assert m[1, :, :, 7 + 2 :].abs().max() == 0  # padded regions get no attention
    t2r = maps.text_to_region()
    assert t2r.shape == (2, 2, 4, 7, 4)
    torch.testing.assert_close(t2r[1, 0], maps.joint[1][0][:, :7, 7:])


def test_padding_does_not_change_real_outputs():
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny()).eval()
    x = _inputs(B=1)
    x.attention_mask[:] = True
    x.region_mask[:] = True
    longer = VLInputs(
        torch.cat([x.input_ids, torch.zeros(1, 3, dtype=torch.long)], 1), torch.zeros(1, 10, dtype=torch.long),
        torch.cat([x.attention_mask, torch.zeros(1, 3, dtype=torch.bool)], 1),
        torch.cat([x.region_feats, torch.randn(1, 2, 16)], 1), torch.cat([x.region_boxes, torch.rand(1, 2, 4)], 1),
        torch.cat([x.region_mask, torch.zeros(1, 2, dtype=torch.bool)], 1),
    )
    a, b = model(x), model(longer)
    torch.testing.assert_close(a.mlm_logits, b.mlm_logits[:, :7], atol=1e-5, rtol=0)
    torch.testing.assert_close(a.match_logits, b.match_logits, atol=1e-5, rtol=0)


def test_alignment_positions_average_the_aligned_words():
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny()).eval()
    emb = model.bert.embeddings
    x = _inputs(B=1)
    align = torch.full((1, 4, 2), -1, dtype=torch.long)
    align[0, 0] = torch.tensor([1, 3])  # region 0 aligned to words 1 and 3
    x.image_text_alignment = align
    # Recompute region 0's pre-LayerNorm embedding by hand.
    pos = emb.position_embeddings.weight
    expected = (emb.visual_projection(x.region_feats[0, 0]) + emb.visual_token_type_embeddings.weight[1]
                + (pos[1] + pos[3]) / 2 + emb.visual_position_embeddings.weight[0])
    got = emb(x)  # after LayerNorm
    ln = torch.nn.functional.layer_norm(expected, (expected.shape[-1],), emb.LayerNorm.weight, emb.LayerNorm.bias, emb.LayerNorm.eps)
    torch.testing.assert_close(got[0, 7], ln, atol=1e-5, rtol=0)


# --- VisualBERT without early fusion (paper App. B and App. C, C2) ------------------------------------

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from vlberts.errors import VlbertsError  # noqa: E402
from vlberts.models.blocks import mask_bias  # noqa: E402
from vlberts.models.builders import model_config  # noqa: E402


def _layer_outputs(model, x):
    """Each encoder layer's output hidden states, captured with forward hooks."""
    outs = []
    hooks = [layer.register_forward_hook(lambda m, i, o: outs.append(o[0].detach().clone()))
             for layer in model.bert.encoder.layer]
    try:
        model(x)
    finally:
        for h in hooks:
            h.remove()
    return outs


def test_without_early_fusion_regions_do_not_reach_layers_before_the_fusion_layer():
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny(num_layers=3, fusion_layer=2)).eval()
    x = _inputs()
    other = dataclasses.replace(x, region_feats=torch.randn_like(x.region_feats), region_boxes=torch.rand_like(x.region_boxes))
    no_regions = dataclasses.replace(x, region_feats=x.region_feats[:, :0], region_boxes=x.region_boxes[:, :0],
                                     region_mask=x.region_mask[:, :0])
    a, b, c = _layer_outputs(model, x), _layer_outputs(model, other), _layer_outputs(model, no_regions)
    for i in (0, 1):  # text alone: (B, T, D), whatever the regions, and the same as with no regions at all
        assert a[i].shape == (2, 7, 32)
        assert torch.equal(a[i], b[i]) and torch.equal(a[i], c[i])
    assert a[2].shape == (2, 11, 32)
    assert not torch.allclose(a[2][:, :7], b[2][:, :7])  # the fusion layer's text sees the regions
    assert not torch.allclose(model(x).mlm_logits, model(other).mlm_logits)


def test_without_early_fusion_sdpa_and_explicit_agree_and_text_to_region_is_zero_before_fusion():
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny(num_layers=3, fusion_layer=2, visual_spatial="6d")).eval()
    x = _inputs()
    fast, slow = model(x), model(x, need_attn=True)
    torch.testing.assert_close(fast.mlm_logits, slow.mlm_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.match_logits, slow.match_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.encoded.vision, slow.encoded.vision, atol=1e-5, rtol=0)
    maps = slow.encoded.attentions
    assert maps.fusion_layer == 2
    assert [tuple(m.shape) for m in maps.joint] == [(2, 4, 7, 7), (2, 4, 7, 7), (2, 4, 11, 11)]
    for m in maps.joint:
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
        assert m[0, :, :, 5:7].abs().max() == 0  # padded words get no attention, before fusion too
    t2r = maps.text_to_region()
    assert t2r.shape == (3, 2, 4, 7, 4)
    assert t2r[:2].abs().max() == 0  # layers that do not see the regions pay them nothing
    torch.testing.assert_close(t2r[2], maps.joint[2][:, :, :7, 7:])
    assert "layers 1-2 see no regions" in maps.describe()


def test_fusion_layer_zero_is_the_old_model():
    torch.manual_seed(0)
    old = build_pretraining_model(visualbert_tiny()).eval()
    torch.manual_seed(0)
    new = build_pretraining_model(visualbert_tiny(fusion_layer=0)).eval()
    torch.manual_seed(0)
    late = build_pretraining_model(visualbert_tiny(fusion_layer=1)).eval()
    sd_old, sd_new, sd_late = old.state_dict(), new.state_dict(), late.state_dict()
    assert sd_old.keys() == sd_new.keys() == sd_late.keys()  # the field adds no parameter
    assert all(torch.equal(sd_old[k], sd_new[k]) and torch.equal(sd_old[k], sd_late[k]) for k in sd_old)
    x = _inputs()
    # The old forward, written out: embeddings, all layers over [text ; regions], heads.
    bert = old.bert
    h = bert.embeddings(x)
    mask = torch.cat([x.attention_mask, x.region_mask], dim=1)
    h, _ = bert.encoder(h, mask_bias(mask, h.dtype))
    want = old.cls.predictions(h[:, :7])
    for out in (old(x), new(x)):
        assert torch.equal(out.mlm_logits, want)
        assert torch.equal(out.match_logits, old.cls.seq_relationship(bert.pooler(h[:, 0])))
    assert not torch.allclose(late(x).mlm_logits, want)  # same weights, later fusion: another function


def test_fusion_layer_config_and_named_variant():
    with pytest.raises(ValueError, match="fusion_layer"):
        visualbert_tiny(fusion_layer=2)  # 2 layers: the last one (index 1) must see the regions
    with pytest.raises(ValueError, match="fusion_layer"):
        visualbert_tiny(fusion_layer=-1)
    cfg = model_config("visualbert-no-early-fusion")
    assert (cfg.num_layers, cfg.fusion_layer, cfg.hidden_size, cfg.num_heads) == (13, 12, 768, 12)
    assert model_config("visualbert-no-early-fusion", num_layers=4).fusion_layer == 3
    assert visualbert_tiny(fusion_layer=1).fusion_layer == 1
    with pytest.raises(VlbertsError, match="fusion_layer"):
        model_config("visualbert-small", fusion_layer=6)


def test_models_command_describes_every_architecture():
    from typer.testing import CliRunner

    from vlberts.cli import app
    from vlberts.models.builders import MODEL_CONFIGS

    res = CliRunner().invoke(app, ["models"])
    assert res.exit_code == 0, res.output
    lines = {ln.split()[0]: ln for ln in res.output.splitlines() if ln.strip() and not ln.startswith("(")}
    assert set(lines) == set(MODEL_CONFIGS)
    assert "6 co-attention layers" in lines["vilbert-base"]
    assert "2 co-attention layers" in lines["vilbert-depth2"]
    assert "9 language + 5 object-relationship + 5 cross-modality" in lines["lxmert-base"]
    assert "regions join at layer 13" in lines["visualbert-no-early-fusion"]


@pytest.mark.parametrize("fusion", [0, 2])
def test_pretraining_heads_from_the_rows_they_read_equal_the_whole_forward(fusion):
    """With `mlm_positions` the last layer computes only [CLS] and the masked words (`TokenSelection.rows`): logits,
    and every gradient equal those of the whole forward, with and without early fusion."""
    torch.manual_seed(0)
    cfg = visualbert_tiny(num_layers=3, fusion_layer=fusion, hidden_dropout=0.0, attention_dropout=0.0)
    model = build_pretraining_model(cfg)
    x = _inputs(B=3, T=7, R=4)
    where = torch.zeros(3, 7, dtype=torch.bool)
    where[0, [2, 4]] = True  # example 1 has no masked word, example 2 three
    where[2, [1, 3, 6]] = True
    full = model(x)
    part = model(x, mlm_positions=where)
    assert part.encoded is None and part.mlm_logits.shape == (5, 100)
    torch.testing.assert_close(part.mlm_logits, full.mlm_logits[where], atol=1e-5, rtol=0)
    torch.testing.assert_close(part.match_logits, full.match_logits, atol=1e-5, rtol=0)

    def grads(out, logits):
        model.zero_grad()
        (logits.logsumexp(-1).sum() + out.match_logits.square().sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    a, b = grads(full, full.mlm_logits[where]), grads(part, part.mlm_logits)
    assert a.keys() == b.keys() and len(a) > 20
    for n in a:
        torch.testing.assert_close(b[n], a[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("arch", ["visualbert", "lxmert"])
def test_tied_word_table_gradient_equals_a_linear_decoders(arch):
    """The MLM decoder shares its weight with the word embeddings, and `MLMHead` computes its logits as
    (W h^T)^T so that autograd sums the table's two gradients in place (checked in
    `test_benchmarks_smoke.py` with `benchmarks/tied_decoder.py`'s counter). Logits and the table's gradient
    equal those of the textbook `F.linear` decoder."""
    import torch.nn.functional as F

    from vlberts.models.builders import lxmert_tiny

    torch.manual_seed(0)
    cfg = visualbert_tiny(hidden_dropout=0.0, attention_dropout=0.0) if arch == "visualbert" else \
        lxmert_tiny(hidden_dropout=0.0, attention_dropout=0.0)
    model = build_pretraining_model(cfg)
    x = _inputs(B=3, T=7, R=4, D=cfg.visual_dim)
    where = torch.zeros(3, 7, dtype=torch.bool)
    where[0, [2, 4]] = True
    where[2, [1, 3, 6]] = True
    table = next(p for n, p in model.named_parameters() if "word_embeddings" in n)
    head = next(m for m in model.modules() if type(m).__name__ == "MLMHead")
    assert head.decoder.weight is table

    def logits_and_grad():
        model.zero_grad(set_to_none=True)
        logits = model(x, mlm_positions=where).mlm_logits
        logits.logsumexp(-1).sum().backward()
        return logits.detach(), table.grad

    ours = logits_and_grad()
    original = type(head).forward
    try:
        type(head).forward = lambda self, h: F.linear(self.transform(h), self.decoder.weight, self.bias)
        linear = logits_and_grad()
    finally:
        type(head).forward = original
    torch.testing.assert_close(ours[0], linear[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(ours[1], linear[1], atol=1e-6, rtol=1e-5)


def test_token_selection_lists_cls_then_the_masked_positions_in_order():
    from vlberts.data.batch import select_tokens

    where = torch.tensor([[0, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    sel = select_tokens(where)
    assert sel.count == 5
    assert sel.example.tolist() == [0, 0, 2, 2, 2] and sel.position.tolist() == [1, 3, 0, 1, 2]  # where.nonzero()
    assert sel.rows.tolist() == [[0, 1, 3, 0], [0, 0, 0, 0], [0, 0, 1, 2]]  # [CLS], then each row's, padded
    assert sel.slot.tolist() == [0, 1, 0, 1, 2]  # rows[example, 1 + slot] == position
    assert (sel.rows[sel.example, 1 + sel.slot] == sel.position).all()
    h = torch.randn(3, 4, 2)
    assert torch.equal(h[sel.example, sel.position], h[where])
    empty = select_tokens(torch.zeros(3, 0, dtype=torch.bool))  # an image-only batch: from the shape alone
    assert empty.count == 0 and empty.rows.tolist() == [[0], [0], [0]]


def test_pretraining_forward_and_losses_read_nothing_back_from_the_device(tiny_world):
    """One pre-training forward and its losses, per architecture, compile to a single graph: no boolean
    index, no `.item()`, no size read off a tensor, so on a GPU the host never waits for the kernels it
    queued (and `torch.compile` has no graph break). The batch's `mlm_tokens` were built by the collate
    on the host; W-VisualBERT is checked on both its text-only and image-only batches."""
    import torch._dynamo as dynamo
    from test_pretrain_archs import tiny_model_and_batch

    from vlberts.data.pretrain import unpaired_view
    from vlberts.objectives.recipe import RECIPES, pretrain_losses, run_model, total_loss

    for arch in ("visualbert", "vilbert", "vlbert", "lxmert", "wvisualbert"):
        model, batch, weights = tiny_model_and_batch(tiny_world, arch)
        model.train()
        recipe = RECIPES[arch]
        for source in (("text", "image") if arch == "wvisualbert" else (None,)):
            b = unpaired_view(batch, source) if source else batch
            assert b.mlm_tokens is not None

            def step(b, source=source):
                return total_loss(pretrain_losses(recipe, run_model(recipe, model, b), b, weights, source), weights)

            dynamo.reset()
            explained = dynamo.explain(step)(b)
            reasons = [r.reason.splitlines()[0] for r in explained.break_reasons]
            assert explained.graph_break_count == 0 and explained.graph_count == 1, (arch, source, reasons)


def _attention_ops(fn) -> set[str]:
    """The attention operators a call runs, as the profiler names them."""
    with torch.profiler.profile() as prof:
        fn()
    return {e.key for e in prof.key_averages() if "attention" in e.key}


CPU_FLASH, MATH = "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::_scaled_dot_product_attention_math"


def test_attention_kernel_holds_the_fast_path_eager_and_inside_compiled_graphs(monkeypatch):
    """`--attention_kernel` (`blocks.use_attention_kernel`): every name computes the same attention; a CPU has
    flash and math only, so efficient and cuDNN fall back to math. A compiled graph calls the kernel held when
    it was traced and is traced again when the kernel changes (the global is guarded): switches set outside the
    graph did not reach torch.compile's cached graphs on the H200 run of 2026-11-27."""
    from vlberts.models import blocks

    monkeypatch.setattr(blocks, "_kernels", None)  # restored after the test
    torch.manual_seed(0)
    att = blocks.MultiHeadAttention(16, 4, 0.0).eval()
    x = torch.randn(2, 7, 16)
    bias = blocks.mask_bias(torch.tensor([[1] * 7, [1] * 5 + [0] * 2]), x.dtype)
    ref = att(x, bias)[0]
    assert _attention_ops(lambda: att(x, bias)) >= {CPU_FLASH}
    expected = {"auto": CPU_FLASH, "flash": CPU_FLASH, "efficient": MATH, "cudnn": MATH, "math": MATH}
    assert set(expected) == set(blocks.ATTENTION_KERNELS)
    for name, op in expected.items():
        blocks.use_attention_kernel(name)
        assert blocks.attention_kernel() == name
        torch.testing.assert_close(att(x, bias)[0], ref, atol=1e-6, rtol=0)
        ops = _attention_ops(lambda: att(x, bias))
        assert op in ops and ({CPU_FLASH, MATH} - {op}).isdisjoint(ops), (name, ops)

    compiled = torch.compile(att, backend="aot_eager", fullgraph=True)  # fullgraph: no break at sdpa_kernel
    blocks.use_attention_kernel("math")
    torch.testing.assert_close(compiled(x, bias)[0], ref, atol=1e-6, rtol=0)
    assert CPU_FLASH not in _attention_ops(lambda: compiled(x, bias))
    blocks.use_attention_kernel("auto")
    assert CPU_FLASH in _attention_ops(lambda: compiled(x, bias))

    # Several kernels: held in the order named, math last, and handed to SDPA as an order (`set_priority`;
    # a CPU picks between its two kernels by its own rule, so which one runs is checked on CUDA, test_gpu.py).
    from torch.nn.attention import SDPBackend

    held = []
    real_sdpa_kernel = blocks.sdpa_kernel
    monkeypatch.setattr(blocks, "sdpa_kernel", lambda ks, **kw: held.append((list(ks), kw)) or real_sdpa_kernel(ks, **kw))
    for names in ("flash,efficient", ("efficient", "flash"), "cudnn,math"):
        blocks.use_attention_kernel(names)
        assert blocks.attention_kernel() == (names if isinstance(names, str) else ",".join(names))
        torch.testing.assert_close(att(x, bias)[0], ref, atol=1e-6, rtol=0)
    order = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    assert [ks for ks, _ in held] == [[order[n] for n in names] for names in
                                      (("flash", "efficient", "math"), ("efficient", "flash", "math"), ("cudnn", "math"))]
    assert all(kw == ({"set_priority": True} if blocks._ORDERED else {}) for _, kw in held)

    with pytest.raises(VlbertsError, match="unknown attention kernel 'fast'; valid: auto, efficient, flash, cudnn, math"):
        blocks.use_attention_kernel("fast")
    with pytest.raises(VlbertsError, match="auto stands alone"):
        blocks.use_attention_kernel("auto,flash")
    assert blocks.attention_kernel() == "cudnn,math"  # a refused setting leaves the held one


def test_default_attention_kernel_trains_on_a_cpu_as_pytorchs_pick_to_the_bit(monkeypatch):
    """`--attention_kernel`'s default (efficient,flash: the fastest on the H200) on a CPU, which has no
    efficient kernel, runs what PyTorch's pick runs: the same outputs and gradients to the bit, with a key
    mask and without, with dropout and without, so the CPU demos and their numbers stay as they were."""
    from vlberts.models import blocks

    monkeypatch.setattr(blocks, "_kernels", None)  # restored after the test
    assert blocks.DEFAULT_ATTENTION_KERNEL == (("efficient", "flash") if blocks._ORDERED else ("auto",))
    keep = torch.ones(4, 20, dtype=torch.bool)
    keep[1:, 15:] = False
    for bias in (blocks.mask_bias(keep, torch.float32), None):
        for p_drop in (0.0, 0.1):
            results = []
            for setting in ("auto", blocks.DEFAULT_ATTENTION_KERNEL):
                blocks.use_attention_kernel(setting)
                torch.manual_seed(0)
                att = blocks.MultiHeadAttention(64, 4, p_drop).train()
                x = torch.randn(4, 20, 64, requires_grad=True)
                out = att(x, bias)[0]
                out.square().sum().backward()
                results.append((out.detach(), x.grad, att.query.weight.grad))
            for a, b in zip(*results, strict=True):
                assert torch.equal(a, b), (bias is not None, p_drop)


def test_pretrain_attention_kernel_is_recorded_and_may_change_on_resume(tiny_world, tmp_path, monkeypatch):
    """`pretrain --attention_kernel=math` holds the kernel for the run and records it; a resumed run may
    use another kernel (it computes the same function), like --compile."""
    from test_pretrain import cfg_for

    from vlberts.models import blocks
    from vlberts.recipes.pretrain import pretrain
    from vlberts.training.metrics import MetricsLog

    monkeypatch.setattr(blocks, "_kernels", None)
    out = tmp_path / "run"
    assert pretrain(cfg_for(tiny_world, out, steps=4, ckpt_every=2, stop_after=2, attention_kernel="math")) is None
    assert blocks.attention_kernel() == "math"
    assert json.loads((out / "run_config.json").read_text())["attention_kernel"] == ["math"]  # as the command line records it
    pretrain(cfg_for(tiny_world, out, steps=4, ckpt_every=2, attention_kernel="auto"))
    assert blocks.attention_kernel() == "auto"
    assert [r["step"] for r in MetricsLog.read(out / "metrics.jsonl")] == [1, 2, 3, 4]
    # A setting that cannot be held stops the run before it writes anything.
    with pytest.raises(VlbertsError, match="auto stands alone"):
        pretrain(cfg_for(tiny_world, tmp_path / "bad", attention_kernel=("auto", "flash")))
    assert not (tmp_path / "bad").exists()


def test_to_reads_which_key_sets_are_complete_off_the_host_masks():
    """`VLInputs.text_complete` / `regions_complete`: set by `to` (and `pin_memory`, nested batches too) from
    the masks as they are then, in-place edits included; unknown (None) on inputs built or changed since."""
    from vlberts.data.batch import PretrainBatch

    x = _inputs()  # row 0 has padded words, row 1 padded regions
    assert (x.text_complete, x.regions_complete) == (None, None)
    moved = x.to("cpu")
    assert (moved.text_complete, moved.regions_complete) == (False, False)
    x.attention_mask[:] = True
    assert x.to("cpu").text_complete is True and x.to("cpu").regions_complete is False
    x.region_mask[:] = True
    full = x.to("cpu")
    assert (full.text_complete, full.regions_complete) == (True, True)
    assert dataclasses.replace(full, attention_mask=full.attention_mask.clone()).text_complete is None
    # The facts travel with the tensors, through a batch that holds the inputs.
    batch = PretrainBatch(inputs=x, mlm_labels=torch.full((2, 7), -100), match_labels=torch.zeros(2, dtype=torch.long),
                          image_ids=torch.arange(2)).to("cpu")
    assert (batch.inputs.text_complete, batch.inputs.regions_complete) == (True, True)
    assert dataclasses.replace(full, region_mask=full.region_mask.clone()).to("cpu").regions_complete is True


@pytest.mark.parametrize("arch", ["visualbert", "lxmert"])
def test_a_mask_edited_after_to_is_read_as_it_is(arch):
    """A mask edited in place (or replaced) after `to` (an ablation: hide some regions of a moved batch)
    makes the copy's fact unknown, so the model reads the mask as it is now: the same outputs as inputs
    built with that mask. Before, the fact read at `to` ("every region real") left the mask out."""
    from vlberts.models.builders import lxmert_tiny

    torch.manual_seed(0)
    cfg = visualbert_tiny(visual_spatial="6d") if arch == "visualbert" else lxmert_tiny()
    model = build_pretraining_model(cfg).eval()
    x = _inputs()
    x.attention_mask[:] = True
    x.region_mask[:] = True
    moved = x.to("cpu")
    assert (moved.text_complete, moved.regions_complete) == (True, True)
    moved.region_mask[:, 2:] = False  # in place, after the copy (on a CPU `to` shares the tensors)
    moved.attention_mask = torch.tensor([[True] * 5 + [False] * 2, [True] * 7])  # replaced
    assert (moved.text_complete, moved.regions_complete) == (None, None)
    fresh = VLInputs(x.input_ids, x.token_type_ids, moved.attention_mask.clone(), x.region_feats, x.region_boxes,
                     moved.region_mask.clone())
    with torch.no_grad():
        got, want = model(moved), model(fresh)
    torch.testing.assert_close(got.mlm_logits, want.mlm_logits, atol=0, rtol=0)
    assert moved.to("cpu").regions_complete is False  # a new copy reads the edited mask


@pytest.mark.parametrize("arch", ["visualbert", "lxmert", "vilbert", "vlbert", "wvisualbert"])
def test_key_sets_without_padding_get_no_mask_and_the_same_outputs(tiny_world, arch, monkeypatch):
    """`blocks.key_bias`: a model leaves the attention mask out for the key sets its host batch says are
    complete (so that flash may run on a GPU), and computes the same losses. LXMERT with padded words and
    every region real: the calls over regions take no mask, those over words do. W-VisualBERT's tag subwords
    are padded, so its joint calls keep their mask."""
    from test_pretrain_archs import tiny_model_and_batch

    from vlberts.models import blocks
    from vlberts.objectives.recipe import RECIPES, pretrain_losses, run_model, total_loss

    torch.manual_seed(0)
    model, batch, weights = tiny_model_and_batch(tiny_world, arch)
    model.eval()
    recipe = RECIPES[arch]
    calls: list[bool] = []  # per attention call: did it get a mask
    sdpa = blocks.F.scaled_dot_product_attention
    monkeypatch.setattr(blocks.F, "scaled_dot_product_attention",
                        lambda *a, attn_mask=None, **kw: calls.append(attn_mask is not None) or sdpa(*a, attn_mask=attn_mask, **kw))

    def loss_and_masks(b):
        calls.clear()
        with torch.no_grad():
            loss = total_loss(pretrain_losses(recipe, run_model(recipe, model, b), b, weights, None), weights)
        return loss, list(calls)

    x = batch.inputs
    complete = dataclasses.replace(batch, inputs=dataclasses.replace(
        x, attention_mask=torch.ones_like(x.attention_mask), region_mask=torch.ones_like(x.region_mask)))
    ref, masks = loss_and_masks(complete)  # built on the host and never moved: not known, every call masked
    assert masks and all(masks)
    loss, masks = loss_and_masks(complete.to("cpu"))
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=0)
    assert all(masks) if arch == "wvisualbert" else not any(masks), masks

    if arch == "lxmert":
        words = torch.ones_like(x.attention_mask)
        words[0, -1] = False  # one padded word
        padded = dataclasses.replace(complete, inputs=dataclasses.replace(complete.inputs, attention_mask=words))
        ref, _ = loss_and_masks(padded)
        loss, masks = loss_and_masks(padded.to("cpu"))
        torch.testing.assert_close(loss, ref, atol=1e-6, rtol=0)
        cfg = model.cfg
        # keys = words: language layers, vision->language cross-attention, language self-attention per cross layer
        assert sum(masks) == cfg.language_layers + 2 * cfg.cross_layers
        assert masks.count(False) == cfg.relation_layers + 2 * cfg.cross_layers


@pytest.mark.parametrize("arch", ["visualbert", "visualbert-late", "vlbert", "wvisualbert", "lxmert", "vilbert"])
def test_maps_only_gives_the_same_maps_without_the_last_layers_values_and_feed_forward(arch):
    """`encode(x, need_attn=True, maps_only=True)`, what the attention analyses call: the same maps as the whole
    forward pass, bit for bit. A single-stream model's last layer stops at its attention probabilities (its value
    projection, output and feed-forward never run) and the hidden states are None; a two-stream model computes
    everything."""
    from vlberts.models.builders import lxmert_tiny, vilbert_tiny, vlbert_tiny
    from vlberts.models.wvisualbert import collate_tags, tag_tokens, wvisualbert_tiny

    torch.manual_seed(0)
    cfg = {"visualbert": lambda: visualbert_tiny(num_layers=3), "visualbert-late": lambda: visualbert_tiny(
        num_layers=3, fusion_layer=1), "vlbert": vlbert_tiny, "wvisualbert": wvisualbert_tiny, "lxmert": lxmert_tiny,
        "vilbert": vilbert_tiny}[arch]()
    model = build_pretraining_model(cfg).eval()
    x = _inputs(B=2, T=7, R=4, D=cfg.visual_dim)
    kw = {}
    if arch == "wvisualbert":
        kw["tags"] = collate_tags([tag_tokens([1, 0, 2, 0], [[20], [21, 20], [22]]), tag_tokens([2, 1], [[20], [21, 20], [22]])])
    single = arch not in ("lxmert", "vilbert")
    last = [m for m in model.modules() if type(m).__name__ == "TransformerLayer"][-1] if single else None
    calls = []
    if single:
        for sub in (last.attention.self.value, last.attention.output, last.intermediate, last.output):
            sub.register_forward_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        full = model.encode(x, need_attn=True, **kw)
        n_full = len(calls)
        only = model.encode(x, need_attn=True, maps_only=True, **kw)
    assert n_full == (4 if single else 0) and len(calls) == n_full  # none of them ran with maps_only
    a, b = full.attentions, only.attentions
    assert len(a.joint) == len(b.joint) and len(a.text_to_vision) == len(b.text_to_vision)
    for m, n in zip(a.joint + a.text_to_vision, b.joint + b.text_to_vision):
        assert torch.equal(m, n)
    assert torch.equal(a.text_to_region(), b.text_to_region()) and torch.equal(a.text_to_text(), b.text_to_text())
    if single:
        assert only.text is None and only.vision is None and only.pooled is None
    else:
        assert torch.equal(only.text, full.text)


@pytest.mark.parametrize("arch", ["visualbert", "visualbert-late", "vlbert", "wvisualbert"])
def test_vqa_heads_from_the_one_row_they_read_equal_the_whole_forward(arch):
    """A single-stream VQA model reads one row (VisualBERT's and VL-BERT's [MASK] slot, W-VisualBERT's [CLS] through
    the pooler), so its last layer computes that row alone (`Encoder.forward` rows): logits and every gradient
    equal those of reading it off the whole forward pass."""
    from vlberts.models.builders import vlbert_tiny
    from vlberts.models.visualbert import VisualBertForVQA
    from vlberts.models.vlbert import VLBertForVQA
    from vlberts.models.wvisualbert import WVisualBertForVQA, collate_tags, tag_tokens, wvisualbert_tiny

    torch.manual_seed(0)
    no_drop = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    cls, cfg = {
        "visualbert": (VisualBertForVQA, lambda: visualbert_tiny(num_layers=3, **no_drop)),
        "visualbert-late": (VisualBertForVQA, lambda: visualbert_tiny(num_layers=3, fusion_layer=1, **no_drop)),
        "vlbert": (VLBertForVQA, lambda: vlbert_tiny(visual_dropout=0.0, **no_drop)),
        "wvisualbert": (WVisualBertForVQA, lambda: wvisualbert_tiny(**no_drop)),
    }[arch]
    cfg = cfg()
    model = cls(cfg, 9)
    x = _inputs(B=3, T=7, R=4, D=cfg.visual_dim)
    pos = torch.tensor([4, 2, 6])
    if arch == "wvisualbert":
        tags = collate_tags([tag_tokens(c, [[20], [21, 20], [22]]) for c in ([1, 0, 2, 0], [2, 1], [0])])
        fast = lambda: model(x, tags)  # noqa: E731
        slow = lambda: model.classifier(model.bert(x, tags).pooled)  # noqa: E731
    else:
        fast = lambda: model(x, pos)  # noqa: E731
        text = lambda: model.bert(x).text[torch.arange(3), pos]  # noqa: E731
        slow = (lambda: model.classifier(model.dropout(text()))) if arch.startswith("visualbert") else \
            (lambda: model.classifier(text()))

    def grads(logits):
        model.zero_grad()
        logits.logsumexp(-1).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    a, b = slow(), fast()
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    ga, gb = grads(a), grads(b)
    assert ga.keys() == gb.keys() and len(ga) > 20
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("arch", ["visualbert", "visualbert-late", "vlbert", "wvisualbert", "lxmert", "vilbert"])
def test_encoder_pooled_alone_equals_the_whole_forwards_pooled_output(arch):
    """`VLEncoder.pooled` (the NLVR2, VCR and retrieval heads' one input): a single-stream encoder's last layer
    computes [CLS] alone; values and every gradient equal `forward(x).pooled`'s, for every architecture."""
    from vlberts.models.builders import lxmert_tiny, vilbert_tiny, vlbert_tiny
    from vlberts.models.encoders import VLEncoder
    from vlberts.models.wvisualbert import collate_tags, tag_tokens, wvisualbert_tiny

    torch.manual_seed(0)
    no_drop = {"hidden_dropout": 0.0, "attention_dropout": 0.0}
    cfg = {"visualbert": lambda: visualbert_tiny(num_layers=3, **no_drop),
           "visualbert-late": lambda: visualbert_tiny(num_layers=3, fusion_layer=1, **no_drop),
           "vlbert": lambda: vlbert_tiny(visual_dropout=0.0, **no_drop), "wvisualbert": lambda: wvisualbert_tiny(**no_drop),
           "lxmert": lambda: lxmert_tiny(**no_drop),
           "vilbert": lambda: vilbert_tiny(v_hidden_dropout=0.0, v_attention_dropout=0.0, **no_drop)}[arch]()
    enc = VLEncoder(cfg)
    x = _inputs(B=3, T=7, R=4, D=cfg.visual_dim)
    tags = collate_tags([tag_tokens(c, [[20], [21, 20], [22]]) for c in ([1, 0, 2, 0], [2, 1], [0])]) \
        if arch == "wvisualbert" else None

    def grads(pooled):
        enc.zero_grad()
        pooled.square().sum().backward()
        return {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}

    a, b = enc(x, tags).pooled, enc.pooled(x, tags)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    ga, gb = grads(a), grads(b)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for n in ga:
        torch.testing.assert_close(gb[n], ga[n], atol=1e-5, rtol=1e-4, msg=n)


@pytest.mark.parametrize("name", ["visualbert-tiny", "lxmert-tiny", "vilbert-tiny", "vlbert-tiny", "wvisualbert-tiny"])
def test_region_inputs_are_read_in_the_models_dtype(name):
    """The layer that first reads the region features casts them (and the box encoding) to its weights'
    dtype, in every architecture: float64 features (`torch.from_numpy` of a float64 array) give the float32
    outputs, and a bf16 model reads the float32 features `Batch.to` hands it. Before, four of the five
    architectures stopped in a matrix multiply ("must have the same dtype"); W-VisualBERT cast already."""
    from vlberts.models.builders import model_config

    cfg = model_config(name)
    torch.manual_seed(0)
    model = build_pretraining_model(cfg).eval()
    g = torch.Generator().manual_seed(1)
    B, T, R = 2, 6, 5
    feats, boxes = torch.randn(B, R, cfg.visual_dim, generator=g, dtype=torch.float64), torch.rand(B, R, 4, generator=g)
    x64 = VLInputs(torch.randint(5, 50, (B, T), generator=g), torch.zeros(B, T, dtype=torch.long),
                   torch.ones(B, T, dtype=torch.bool), feats, boxes.double(), torch.ones(B, R, dtype=torch.bool))
    x32 = dataclasses.replace(x64, region_feats=feats.float(), region_boxes=boxes)
    with torch.no_grad():
        out64, out32 = model.encode(x64), model.encode(x32)
        assert out64.text.dtype == torch.float32
        # The [IMG] / whole-image mean of ViLBERT and VL-BERT is taken before the cast, in float64.
        torch.testing.assert_close(out64.text, out32.text, atol=1e-6, rtol=0)
        half = model.to(torch.bfloat16).encode(x32.to("cpu"))
    assert half.text.dtype == torch.bfloat16 and torch.isfinite(half.text.float()).all()
