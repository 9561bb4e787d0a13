"""The optimizer every run builds (`training.optim`): BERT's weight-decay exclusions, the fine-tuning head's
learning-rate groups, and the warm-up / decay schedule, against values written out by hand."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from vlberts.training.optim import build_optimizer, linear_warmup_decay


class Tiny(nn.Module):
    """A body (an embedding, a dense layer and a LayerNorm) and a head, with the decoder tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embeddings = nn.Embedding(10, 4)
        self.dense = nn.Linear(4, 4)
        self.LayerNorm = nn.LayerNorm(4)
        self.decoder = nn.Linear(4, 10, bias=False)
        self.decoder.weight = self.embeddings.weight  # tied: one parameter, listed once
        self.classifier = nn.Sequential(nn.Linear(4, 3))
        self.classifier.add_module("LayerNorm", nn.LayerNorm(3))


def groups_by_name(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, tuple[float, float]]:
    """parameter name -> (its group's lr, weight decay); every parameter in exactly one group."""
    where = {}
    for g in optimizer.param_groups:
        for p in g["params"]:
            assert id(p) not in where, "a parameter in two groups"
            where[id(p)] = (g["lr"], g["weight_decay"])
    return {n: where[id(p)] for n, p in model.named_parameters()}  # named_parameters lists a tied one once


def test_biases_and_layer_norms_are_not_decayed_and_tied_weights_are_stepped_once():
    model = Tiny()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.01)
    assert len(opt.param_groups) == 2
    assert groups_by_name(model, opt) == {
        "embeddings.weight": (1e-3, 0.01), "dense.weight": (1e-3, 0.01), "dense.bias": (1e-3, 0.0),
        "LayerNorm.weight": (1e-3, 0.0), "LayerNorm.bias": (1e-3, 0.0),
        "classifier.0.weight": (1e-3, 0.01), "classifier.0.bias": (1e-3, 0.0),
        "classifier.LayerNorm.weight": (1e-3, 0.0), "classifier.LayerNorm.bias": (1e-3, 0.0),
    }
    assert sum(len(g["params"]) for g in opt.param_groups) == 9  # the tied decoder weight is not a tenth


def test_the_head_learns_faster_under_the_same_weight_decay_rule():
    model = Tiny()
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.01, head_prefixes=("classifier.",), head_lr_mult=20.0)
    assert [(g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups] == [
        (1e-3, 0.01, 2), (1e-3, 0.0, 3), (pytest.approx(2e-2), 0.01, 1), (pytest.approx(2e-2), 0.0, 3)]
    by_name = groups_by_name(model, opt)
    assert by_name["classifier.0.weight"] == (pytest.approx(2e-2), 0.01)  # decayed, as the body's weights
    assert by_name["classifier.0.bias"] == (pytest.approx(2e-2), 0.0)
    assert by_name["dense.weight"] == (1e-3, 0.01)
    # A multiplier of 1 keeps the two body groups; prefixes that match nothing leave out the head's.
    assert len(build_optimizer(model, 1e-3, head_prefixes=("classifier.",)).param_groups) == 2
    assert len(build_optimizer(model, 1e-3, head_prefixes=("nothing.",), head_lr_mult=5.0).param_groups) == 2


def lrs(warmup: int, total: int, base: float = 1.0, mult: float = 1.0) -> list[list[float]]:
    """The lr of each group at updates 0..total, as a training loop sees them (step, then scheduler.step)."""
    model = Tiny()
    opt = build_optimizer(model, base, head_prefixes=("classifier.",), head_lr_mult=mult)
    sched = linear_warmup_decay(opt, warmup, total)
    out = []
    for _ in range(total + 1):
        out.append([g["lr"] for g in opt.param_groups])
        opt.step()
        sched.step()
    return out


def test_warm_up_then_linear_decay_to_zero():
    # warm-up 4 of 10 updates: 1/4, 2/4, 3/4, 1, then (10 - k) / 6 for k = 4..10.
    expected = [0.25, 0.5, 0.75, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6, 0.0]
    assert [r[0] for r in lrs(4, 10)] == pytest.approx(expected)
    assert [r[0] for r in lrs(0, 5)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.0])  # no warm-up
    # Every group follows the schedule from its own peak: the head at 20x.
    head = lrs(4, 10, base=1e-3, mult=20.0)
    assert [r[2] for r in head] == pytest.approx([20 * 1e-3 * f for f in expected])
    assert [r[0] for r in head] == pytest.approx([1e-3 * f for f in expected])


def test_warmup_is_a_fraction_or_a_number_of_updates():
    from vlberts.errors import VlbertsError
    from vlberts.training.optim import warmup_steps

    assert warmup_steps(0.1, 1000) == 100 and warmup_steps(0.0, 1000) == 0 and warmup_steps(0.999, 10) == 9
    assert warmup_steps(500, 25_000) == 500 and warmup_steps(1, 7) == 1  # VL-BERT's fixed 500 updates
    assert warmup_steps(500, 200) == 200  # a run shorter than its warm-up peaks at its last update
    for bad in (-0.1, 2.5):
        with pytest.raises(VlbertsError, match="fraction of the updates .* or a whole number of updates"):
            warmup_steps(bad, 100)


def test_a_run_warms_up_for_a_number_of_updates(tiny_world, tiny_pretrained, tmp_path):
    """`finetune --warmup=3`: the first three updates rise to the peak (1/3, 2/3, 1 of it), then it decays;
    a bad value stops the run before any data is read."""
    import json

    from test_finetune_vqa import vqa_cfg

    from vlberts.errors import VlbertsError
    from vlberts.recipes.finetune_vqa import finetune_vqa

    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "w", warmup=3.0, lr=3e-4, epochs=1.0))
    log = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in log if "lr" in r]  # record k: the rate of update k + 1 (update 1 ran at 1/3)
    assert lrs[:3] == pytest.approx([2e-4, 3e-4, 3e-4])  # update 3 reaches the peak, update 4 (0-based 3 = w) holds it
    assert lrs[2] > lrs[3] > lrs[-1]
    with pytest.raises(VlbertsError, match="got 1.5"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "bad", warmup=1.5,
                             train_questions=str(tmp_path / "missing.json")))


def test_a_checkpoint_whose_optimizer_groups_differ_is_a_one_line_error(tmp_path):
    """A run checkpointed with other parameter groups (e.g. before `--head_lr_mult` kept the head's weight
    decay, one head group instead of two) cannot take its optimizer state: one error naming the checkpoint."""
    from vlberts.errors import VlbertsError
    from vlberts.models.builders import build_pretraining_model, visualbert_tiny
    from vlberts.training.checkpoint import TrainState, restore_checkpoint, save_checkpoint

    cfg = visualbert_tiny(vocab_size=50)
    model = build_pretraining_model(cfg)
    opt = build_optimizer(model, 1e-3)
    ckpt = save_checkpoint(tmp_path, model=model, cfg=cfg, optimizer=opt, scheduler=linear_warmup_decay(opt, 1, 10),
                           state=TrainState(step=1, data={}, extra={}))
    same = build_optimizer(model, 1e-3)
    assert restore_checkpoint(ckpt, model=model, optimizer=same, scheduler=linear_warmup_decay(same, 1, 10)).step == 1
    other = build_optimizer(model, 1e-3, head_prefixes=("cls.",), head_lr_mult=5.0)
    assert len(other.param_groups) == 4
    with pytest.raises(VlbertsError, match=r"state\.json: the optimizer state does not fit this run's parameter groups"):
        restore_checkpoint(ckpt, model=model, optimizer=other, scheduler=linear_warmup_decay(other, 1, 10))


# --------------------------------------------------------------------------- the code bases' own optimizers


def test_bertadam_update_written_out_by_hand():
    """`BertAdamW` (`--bias_correction=false`): m / (sqrt(v) + eps) + wd p, no bias correction. p = 1, lr 0.1,
    wd 0.01, gradients 0.5 then -0.2:
    update 1: m = 0.05, v = 0.00025, 0.05 / (0.0158114 + 1e-6) = 3.162078; p = 1 - 0.1 (3.162078 + 0.01) = 0.682792
    update 2: m = 0.025, v = 0.00028975, 0.025 / (0.0170220 + 1e-6) = 1.468597; p = 0.682792 - 0.1 (1.468597
    + 0.0068279) = 0.535250. Bias-corrected AdamW's first update would be 1 - 0.1 (1 + 0.01) = 0.899."""
    from vlberts.training.optim import BertAdamW

    p = nn.Parameter(torch.tensor([1.0]))
    opt = BertAdamW([{"params": [p], "weight_decay": 0.01}], lr=0.1)
    p.grad = torch.tensor([0.5])
    opt.step()
    assert p.item() == pytest.approx(0.682792, abs=2e-6)
    p.grad = torch.tensor([-0.2])
    opt.step()
    assert p.item() == pytest.approx(0.535250, abs=2e-6)


def bertadam_reference(params, grads_per_step, lr, wd, eps=1e-6, b1=0.9, b2=0.999):
    """BertAdam's loop as pytorch-pretrained-bert writes it, one parameter at a time (clipping and schedule left
    out): next_m, next_v; update = next_m / (sqrt(next_v) + e); update += wd * p; p -= lr * update."""
    ps = [p.detach().clone() for p in params]
    ms = [torch.zeros_like(p) for p in ps]
    vs = [torch.zeros_like(p) for p in ps]
    for grads in grads_per_step:
        for i, (p, g) in enumerate(zip(ps, grads)):
            ms[i] = b1 * ms[i] + (1 - b1) * g
            vs[i] = b2 * vs[i] + (1 - b2) * g * g
            update = ms[i] / (vs[i].sqrt() + eps) + wd[i] * p
            ps[i] = p - lr * update
    return ps


@pytest.mark.parametrize("decay_all", [False, True])
def test_no_bias_correction_is_bertadam_on_every_parameter_group(decay_all):
    """`build_optimizer(bias_correction=False)` steps every parameter as BertAdam's own loop does, with BERT's
    exclusions (VisualBERT's grouping) or decay on every tensor (`decay_all`: LXMERT's BertAdam over
    `model.parameters()`), the head's groups included."""
    from vlberts.training.optim import BertAdamW

    torch.manual_seed(0)
    model = Tiny()
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.1, head_prefixes=("classifier",), head_lr_mult=1.0,
                          bias_correction=False, decay_all=decay_all)
    assert isinstance(opt, BertAdamW)
    params = list(model.parameters())
    decayed = {n: wd for n, (_, wd) in groups_by_name(model, opt).items()}
    wd = [decayed[n] for n, _ in model.named_parameters()]
    if decay_all:
        assert set(wd) == {0.1}
    else:
        assert decayed["dense.bias"] == decayed["LayerNorm.weight"] == 0.0 and decayed["dense.weight"] == 0.1
    steps = [[torch.randn_like(p) for p in params] for _ in range(3)]
    expected = bertadam_reference(params, steps, lr=1e-2, wd=wd)
    for grads in steps:
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.step()
    for (name, p), want in zip(model.named_parameters(), expected):
        torch.testing.assert_close(p.detach(), want, rtol=1e-6, atol=1e-7, msg=name)


def test_decay_all_puts_biases_and_layer_norms_under_weight_decay_with_torch_adamw():
    """VL-BERT's AdamW: bias-corrected, decay on every parameter."""
    model = Tiny()
    opt = build_optimizer(model, lr=1e-3, weight_decay=1e-4, decay_all=True)
    assert isinstance(opt, torch.optim.AdamW)
    assert set(groups_by_name(model, opt).values()) == {(1e-3, 1e-4)}


def test_per_tensor_clipping_clips_each_gradient_to_the_norm_on_its_own():
    """`update(..., clip_per_tensor=True)` (VisualBERT's BertAdam): a gradient of norm 5 (3, 4) becomes norm 1
    (0.6, 0.8); one of norm 0.5 stays; the returned norm is the global one before clipping, sqrt(25 + 0.25)."""
    from vlberts.training.loop import update

    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(1))
    model = nn.ParameterList([a, b])
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.5])
    seen = {}

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            seen.update(a=a.grad.clone(), b=b.grad.clone())

    opt = Capture(model.parameters(), lr=0.0)
    norm = update(model, opt, linear_warmup_decay(opt, 0, 10), clip=1.0, clip_per_tensor=True)
    assert float(norm) == pytest.approx(25.25 ** 0.5)
    torch.testing.assert_close(seen["a"], torch.tensor([0.6, 0.8]), rtol=1e-5, atol=1e-6)
    assert seen["b"].tolist() == [0.5]
    # The global rule on the same gradients scales both by 1 / 5.025.
    a.grad, b.grad = torch.tensor([3.0, 4.0]), torch.tensor([0.5])
    update(model, opt, linear_warmup_decay(opt, 0, 10), clip=1.0)
    assert seen["b"].item() == pytest.approx(0.5 / 25.25 ** 0.5, rel=1e-5)


def test_a_fine_tuning_run_with_lxmerts_optimizer_resumes_exactly(tiny_world, tiny_pretrained, tmp_path):
    """`--bias_correction=false --decay_all=true --clip_per_tensor=true` reach the loop (other losses than the
    default optimizer's from the second update on), the checkpoint keeps BertAdam's state (no fused AdamW
    settings, weight decay on every group), and an interrupted run resumes to the same losses."""
    import json

    from test_finetune_vqa import vqa_cfg

    from vlberts.recipes.finetune_vqa import finetune_vqa
    from vlberts.training.metrics import MetricsLog

    bert = dict(bias_correction=False, decay_all=True, clip_per_tensor=True, clip=0.5)
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "ref", **bert))
    assert finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "run", stop_after=3, **bert)) is None
    groups = json.loads((tmp_path / "run" / "checkpoints" / "step_00000002" / "state.json").read_text())
    groups = groups["optimizer"]["param_groups"]
    assert {g["weight_decay"] for g in groups if g["params"]} == {0.01} and not any("fused" in g for g in groups)
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "run", **bert))
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "adamw", clip=0.5))
    ref, run, adamw = (MetricsLog.read(tmp_path / name / "metrics.jsonl") for name in ("ref", "run", "adamw"))
    losses = [[r["loss"] for r in log if "loss" in r] for log in (ref, run, adamw)]
    assert losses[0] == losses[1]
    assert losses[0][0] == losses[2][0] and losses[0][1:] != losses[2][1:]


def test_sgd_with_momentum_and_l2_decay_written_out_by_hand():
    """`--optimizer=sgd` (VL-BERT's VCR configs): the decay is added to the gradient (L2), momentum 0.9.
    p = 1, lr 0.1, wd 0.01, gradients 0.5 then -0.2:
    update 1: d = 0.5 + 0.01 = 0.51, buffer 0.51, p = 1 - 0.051 = 0.949
    update 2: d = -0.2 + 0.00949 = -0.19051, buffer 0.9 x 0.51 - 0.19051 = 0.26849, p = 0.949 - 0.026849 = 0.922151.
    A bias is not decayed (BERT's exclusions), unless `decay_all` (VL-BERT's groups decay every tensor)."""
    lin = nn.Linear(1, 1)
    opt = build_optimizer(lin, lr=0.1, weight_decay=0.01, kind="sgd")
    assert isinstance(opt, torch.optim.SGD) and {g["momentum"] for g in opt.param_groups} == {0.9}
    assert groups_by_name(lin, opt) == {"weight": (0.1, 0.01), "bias": (0.1, 0.0)}
    assert set(groups_by_name(lin, build_optimizer(lin, 0.1, 0.01, kind="sgd", decay_all=True)).values()) == {(0.1, 0.01)}
    with torch.no_grad():
        lin.weight.fill_(1.0)
    for g in (0.5, -0.2):
        lin.weight.grad, lin.bias.grad = torch.full((1, 1), g), torch.zeros(1)
        opt.step()
    assert lin.weight.item() == pytest.approx(0.922151, abs=1e-6)


def test_optimizer_and_schedule_settings_that_contradict_are_one_line_errors():
    from vlberts.errors import VlbertsError
    from vlberts.training.optim import check_lr_schedule, check_optimizer

    with pytest.raises(VlbertsError, match="--bias_correction=false is a setting of Adam"):
        check_optimizer("sgd", bias_correction=False)
    with pytest.raises(VlbertsError, match="unknown --optimizer='lamb'; valid: adamw, sgd"):
        check_optimizer("lamb")
    with pytest.raises(VlbertsError, match="--momentum must be in"):
        check_optimizer("sgd", momentum=1.0)
    with pytest.raises(VlbertsError, match="--lr_schedule=step needs --lr_steps"):
        check_lr_schedule("step", (), 0.1)
    with pytest.raises(VlbertsError, match="--lr_steps=14.0 needs --lr_schedule=step"):
        check_lr_schedule("linear", (14.0,), 0.1)
    for bad in ((18.0, 14.0), (0.0, 2.0), (2.0, 2.0)):
        with pytest.raises(VlbertsError, match="--lr_steps must rise from above 0"):
            check_lr_schedule("step", bad, 0.1)
    check_lr_schedule("step", (14.0, 18.0), 0.1)


def test_warm_up_then_steps_down_at_each_milestone():
    """VL-BERT's WarmupMultiStepLR: 2 warm-up updates, x0.1 from update 4 and again from update 6."""
    from vlberts.training.optim import warmup_step_decay

    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    sched = warmup_step_decay(opt, 2, [4, 6], 0.1)
    lrs = []
    for _ in range(8):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 1.0, 0.1, 0.1, 0.01, 0.01])


def test_a_fine_tuning_run_with_sgd_and_a_step_schedule_resumes_exactly(tiny_world, tiny_pretrained, tmp_path):
    """VL-BERT's VCR settings on a VQA run: the logged rate steps down after half the epoch (`--lr_steps=0.5`),
    the checkpoint holds SGD's momentum buffers, and an interrupted run resumes to the same losses; a step
    schedule without steps stops the run before any data is read."""
    from test_finetune_vqa import vqa_cfg

    from vlberts.errors import VlbertsError
    from vlberts.recipes.finetune_vqa import finetune_vqa
    from vlberts.training.metrics import MetricsLog

    sgd = dict(optimizer="sgd", lr=0.05, weight_decay=1e-4, decay_all=True, lr_schedule="step", lr_steps=(0.5,),
               warmup=0.0, clip=10.0)
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "ref", **sgd))
    assert finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "run", stop_after=3, **sgd)) is None
    state = load_file(tmp_path / "run" / "checkpoints" / "step_00000002" / "optimizer.safetensors")
    assert any(k.endswith(".momentum_buffer") for k in state)
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "run", **sgd))
    ref, run = (MetricsLog.read(tmp_path / name / "metrics.jsonl") for name in ("ref", "run"))
    assert [r["loss"] for r in ref if "loss" in r] == [r["loss"] for r in run if "loss" in r]
    lrs = [r["lr"] for r in ref if "lr" in r]  # record k: the rate of update k + 1
    n = len(lrs)
    assert n >= 6 and lrs[: n // 2 - 1] == [0.05] * (n // 2 - 1)
    assert lrs[n // 2 + 1:] == pytest.approx([0.005] * (n - n // 2 - 1))
    with pytest.raises(VlbertsError, match="--lr_schedule=step needs --lr_steps"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "bad", lr_schedule="step",
                             train_questions=str(tmp_path / "missing.json")))
