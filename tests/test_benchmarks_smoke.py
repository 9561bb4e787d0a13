"""Checks of benchmark code that run in seconds on a CPU: the analytic FLOP count of
`benchmarks/gpu_throughput.py` (the numerator of its MFU) against `torch.utils.flop_counter` on tiny
models, forward and backward, and its refusal to run without a GPU."""

import os
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_throughput  # noqa: E402

from vlberts.data.batch import VLInputs, select_tokens  # noqa: E402
from vlberts.models.builders import build_pretraining_model, model_config  # noqa: E402
from vlberts.models.convert_hf import visualbert_config_from_hf  # noqa: E402

B, T, R = 3, 7, 5


def _inputs(vocab: int, visual_dim: int) -> VLInputs:
    g = torch.Generator().manual_seed(0)
    return VLInputs(
        torch.randint(1, vocab, (B, T), generator=g), torch.zeros(B, T, dtype=torch.long),
        torch.ones(B, T, dtype=torch.bool), torch.randn(B, R, visual_dim, generator=g),
        torch.rand(B, R, 4, generator=g).sort(-1).values, torch.ones(B, R, dtype=torch.bool),
    )


def _backward_all(out) -> None:
    """Backward of a loss that touches every tensor output (every head)."""
    sum(v.float().sum() for v in vars(out).values() if isinstance(v, torch.Tensor)).backward()


def _assert_exact(analytic, counts) -> None:
    check = gpu_throughput.flop_check(analytic, counts)
    assert check["counter_attention"] > 0, check["note"]  # the attention products were seen by the counter
    assert check["counter_linear"] == check["analytic_linear"], check
    assert check["counter"] == check["expected_counter"], check


@pytest.mark.parametrize("name", ["visualbert-tiny", "lxmert-tiny"])
def test_our_step_flops_match_flop_counter(name):
    torch.manual_seed(0)
    cfg = model_config(name)
    model = build_pretraining_model(cfg).train()  # dropout on: CPU attention takes the counted bmm path
    x = _inputs(cfg.vocab_size, cfg.visual_dim)
    mlm = torch.zeros(B, T, dtype=torch.bool)
    mlm[:, 2] = True
    mlm[0, [4, 5]] = True  # uneven rows: VisualBERT's last layer pads to the longest (3 + [CLS])
    mlm = select_tokens(mlm)  # as the pre-training collate hands it over
    counts = gpu_throughput.counted_flops(lambda: _backward_all(model(x, mlm_positions=mlm)))
    arch = name.split("-")[0]
    ours = gpu_throughput.our_flops(arch, cfg, B, T, R, mlm)
    _assert_exact(ours, counts)
    # and the count is sensitive to what is computed: every position through the MLM head is more
    assert gpu_throughput.FLOPS[arch](cfg, B, T, R, B * T).total > ours.total


def test_hugging_face_visualbert_flops_match_flop_counter():
    """Hugging Face's VisualBERT runs every layer and its MLM head at every text and region position."""
    torch.manual_seed(0)
    hf_cfg = transformers.VisualBertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                           intermediate_size=37, visual_embedding_dim=20, max_position_embeddings=64)
    hf = transformers.VisualBertForPreTraining(hf_cfg).train()
    x = _inputs(99, 20)
    counts = gpu_throughput.counted_flops(lambda: _backward_all(hf(
        input_ids=x.input_ids, token_type_ids=x.token_type_ids, attention_mask=x.attention_mask.long(),
        visual_embeds=x.region_feats, visual_attention_mask=x.region_mask.long())))
    cfg = visualbert_config_from_hf(hf_cfg.to_dict())
    _assert_exact(gpu_throughput.visualbert_flops(cfg, B, T, R, B * (T + R)), counts)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_gpu_throughput_without_cuda_stops_with_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        gpu_throughput.main(["--arch", "visualbert"])
    assert isinstance(e.value.code, str) and "no CUDA device" in e.value.code and "\n" not in e.value.code


def test_timing_runs_back_to_back_calls_and_reports_a_calls_share():
    from timing import seconds

    calls = []
    t = seconds(lambda: calls.append(1), torch.device("cpu"), calls=3)
    assert len(calls) == 3 and t > 0


def test_gpu_throughput_smoke_times_single_steps_and_runs_of_steps(tmp_path, capsys):
    """`--smoke` on a CPU: the whole pipeline with base-size VisualBERT and Hugging Face's, batch 2: steps
    timed alone and in runs (`--run-steps`), both MFUs, the goal checked on the runs' figure, and the
    numbers labelled as no GPU measurement. In fp32: on a CPU without bf16 instructions bf16 is emulated,
    and this test took 305 s instead of about a minute (2026-11-28, an AVX2-only AMD EPYC); the bf16 step
    is checked below on a small model."""
    import json

    out = tmp_path / "gt.json"
    gpu_throughput.main(["--smoke", "--device", "cpu", "--arch", "visualbert", "--steps", "1", "--run-steps", "2",
                         "--runs", "1", "--precision", "fp32", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["device_type"] == "cpu" and report["run_steps"] == 2 and report["runs"] == 1
    assert report["precision"] == "fp32"
    arch = report["archs"]["visualbert"]
    for r in arch["results"].values():
        assert r["run_step_s"] > 0 and r["run_mfu"] == pytest.approx(r["flops"] / r["run_step_s"] / 1e12 / report["peak_tflops"])
    hf, ours = arch["results"]["hf"], arch["results"]["ours"]
    assert arch["run_ratio_hf"]["ours"] == pytest.approx(hf["run_step_s"] / ours["run_step_s"])
    printed = capsys.readouterr().out
    assert "in a run of steps" in printed and "not a GPU measurement" in printed


def test_the_timed_step_runs_its_forward_in_the_precision_asked():
    loss = lambda model, data: model(data["x"])  # noqa: E731
    model, host = torch.nn.Linear(4, 4), {"x": torch.randn(2, 4)}
    assert gpu_throughput.autocast_step(loss, torch.device("cpu"), "bf16")(model, host).dtype == torch.bfloat16
    assert gpu_throughput.autocast_step(loss, torch.device("cpu"), "fp32")(model, host).dtype == torch.float32


def test_profile_steps_splits_a_step_into_host_and_kernel_time():
    a = torch.randn(64, 64)
    out = gpu_throughput.profile_steps(lambda: a @ a, torch.device("cpu"), steps=2)
    assert out["wall_ms"] > 0 and out["host_ms"] > 0 and out["kernel_ms"] == 0.0  # no device on a CPU run
    assert "aten::mm" in out["table"]


def test_profile_kernel_time_counts_each_kernel_once():
    """An operator's row carries its kernels' time and a compiled graph's annotation its graph's: only the
    device's own events count (the H200 profile of 2026-11-26 was printed at twice the footer's total)."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(device, us, annotation=False):
        return SimpleNamespace(device_type=device, self_device_time_total=us, is_user_annotation=annotation)

    events = [event(DeviceType.CPU, 30.0),  # aten::mm, carrying its kernel's 30 us
              event(DeviceType.CUDA, 30.0),  # the kernel
              event(DeviceType.CUDA, 50.0, annotation=True),  # "## Call CompiledFxGraph ..." over its kernels
              event(DeviceType.CUDA, 20.0)]
    assert gpu_throughput.kernel_time_us(events) == 50.0


def test_attention_kernels_times_what_runs_and_adds_up_a_step(tmp_path, capsys):
    """`benchmarks/attention_kernels.py --smoke`: on a CPU the CUDA-only kernels are "n/a", not timed; a
    step's cost under a setting adds each call's time with the kernel that setting runs for it (with a mask
    where the call's keys are padded: LXMERT's words, not its regions) times that model's calls; the pick is
    the cheapest setting that could be costed."""
    import json

    import attention_kernels as ak

    out = tmp_path / "k.json"
    ak.main(["--smoke", "--batch", "1", "--repeats", "1", "--variants", "cudnn,math", "--json", str(out)])
    r = json.loads(out.read_text())
    s = r["seconds"]
    assert all(s[shape]["cudnn"] == {"mask": None, "no mask": None} for shape, *_ in ak.SHAPES)
    assert all(s[shape]["math"]["mask"] > 0 and s[shape]["math"]["no mask"] > 0 for shape, *_ in ak.SHAPES)
    for model, col in (("LXMERT-base", 3), ("VisualBERT-base", 4)):
        want = sum(s[sh[0]]["math"]["mask" if sh[5] else "no mask"] * sh[col] for sh in ak.SHAPES)
        assert r["per_step_seconds"][model]["math"] == pytest.approx(want)
        assert r["per_step_seconds"][model]["cudnn"] is None
    assert sum(sh[3] for sh in ak.SHAPES) == 34 and sum(sh[4] for sh in ak.SHAPES) == 12
    assert sum(sh[3] for sh in ak.SHAPES if sh[5]) == 19  # keys: words (9 + 5 language self, 5 vision->language)
    assert r["best_lxmert"] == "math"
    assert "--attention_kernel=math" in capsys.readouterr().out
    # Which kernel each setting runs for calls without / with a mask: flash alone falls back to math, compiled
    # where that was timed; flash before another kernel leaves it the masked calls.
    assert ak.settings(list(ak.VARIANTS)) == {
        "auto": ("auto", "auto"), "cudnn": ("cudnn", "cudnn"), "efficient": ("efficient", "efficient"), "math": ("math-compiled", "math-compiled"),
        "flash": ("flash", "math-compiled"), "flash,cudnn": ("flash", "cudnn"), "flash,efficient": ("flash", "efficient")}
    rows = {sh[0]: {"flash": {"mask": None, "no mask": 1.0}, "efficient": {"mask": 3.0, "no mask": 2.0}} for sh in ak.SHAPES}
    costs = ak.step_costs(rows, ["efficient", "flash"], 3)
    assert costs == {"efficient": 19 * 3.0 + 15 * 2.0, "flash": None, "flash,efficient": 19 * 3.0 + 15 * 1.0}
    assert ak.best_kernel(costs) == "flash,efficient"
    with pytest.raises(SystemExit, match="no CUDA device"):  # the suite hides any GPU from this test
        ak.main([])


def test_tied_decoder_counts_the_table_sized_additions_of_each_layout():
    """`benchmarks/tied_decoder.py` on a tiny VisualBERT: our MLM head adds the tied word table's gradient in
    place, `F.linear`'s into a new tensor, and the script puts our head back after timing the other."""
    import tied_decoder

    from vlberts.models.blocks import MLMHead

    torch.manual_seed(0)
    cfg = model_config("visualbert-tiny")
    model = build_pretraining_model(cfg)
    x = _inputs(cfg.vocab_size, cfg.visual_dim)
    table = model.bert.embeddings.word_embeddings.weight

    def step():
        model(x, mlm_positions=select_tokens(x.input_ids % 3 == 0)).mlm_logits.logsumexp(-1).sum().backward()
        model.zero_grad(set_to_none=True)

    counted = {}
    try:
        for name, forward in tied_decoder.LAYOUTS.items():
            MLMHead.forward = forward
            counted[name] = tied_decoder.table_adds(step, table)
    finally:
        MLMHead.forward = tied_decoder.OURS
    assert counted == {"ours": ["aten::add_"], "F.linear": ["aten::add"]}


def test_count_arguments_and_bad_input_are_one_line_errors(tmp_path, capsys, monkeypatch):
    """`timing.at_least` and `timing.guarded`, which every script uses: `--repeats 0` failed after minutes of
    set-up in a median of nothing, and bad input (a world directory that is not one) was a traceback."""
    import argparse

    from timing import at_least, guarded

    from vlberts.errors import VlbertsError

    assert at_least(1)("3") == 3
    for bad, message in (("0", "must be at least 1, got 0"), ("x", "expected an integer, got 'x'")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            at_least(1)(bad)

    def bad_input() -> None:
        raise VlbertsError("not a world directory", path=tmp_path)

    with pytest.raises(SystemExit) as e:
        guarded(bad_input)
    assert e.value.code == 1 and capsys.readouterr().err == f"error: {tmp_path}: not a world directory\n"


def test_world_build_never_removes_a_directory_it_did_not_create(tmp_path, monkeypatch, capsys):
    """`benchmarks/world_build.py --out DIR` removed DIR after `build_world` refused to write into it (its
    `finally` cleaned up what it took for its own): an existing folder and its files were deleted."""
    import world_build

    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    monkeypatch.setattr(sys, "argv", ["world_build.py", "--images", "4", "--out", str(precious)])
    with pytest.raises(SystemExit) as e:
        world_build.guarded(world_build.main)
    assert e.value.code == 1 and "--out must be a new directory" in capsys.readouterr().err
    assert (precious / "notes.txt").read_text() == "mine"
    monkeypatch.setattr(sys, "argv", ["world_build.py", "--images", "4", "--out", str(tmp_path / "new")])
    world_build.main()
    assert not (tmp_path / "new").exists()  # made by the run, removed by it (no --keep)


def test_grounding_speed_gives_a_verdict_only_at_the_targets_size(monkeypatch):
    """A 30-image, width-96 run printed "PASS" against a target set for 1,000 images of a base model."""
    import argparse

    # The script sets these for its own process when imported; this one keeps its own.
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "2"))
    monkeypatch.setenv("GOMP_SPINCOUNT", os.environ.get("GOMP_SPINCOUNT", "1000"))
    import grounding_speed

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        target = argparse.Namespace(images=1000, width=768)
        assert grounding_speed.verdict(target, 12, 12, 100.0) == "PASS"
        assert grounding_speed.verdict(target, 12, 12, 130.0) == "FAIL"
        assert grounding_speed.verdict(argparse.Namespace(images=30, width=96), 12, 12, 1.0).startswith("n/a")
    finally:
        torch.set_num_threads(threads)
