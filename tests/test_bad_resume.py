"""A run directory damaged between two starts of `vlberts pretrain`, and settings that would be silently dropped:
each is one line naming the file, or the run does what its settings say (found by the sixth bad-input sweep)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_bad_settings import run_cli

from vlberts.cli import main
from vlberts.text.tokenizer import TextTokenizer


def _args(world, out: Path, *more: str) -> list[str]:
    return ["pretrain", f"--captions={world.captions_train}", f"--features={world.store}", "--model=visualbert-tiny",
            "--steps=6", "--batch_size=4", "--ckpt_every=2", "--log_every=1", f"--out={out}", "--device=cpu", *more]


@pytest.fixture(scope="module")
def stopped(tiny_world, tmp_path_factory) -> Path:
    """A run stopped after 4 of its 6 updates: checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("resume") / "base"
    with pytest.raises(SystemExit) as exc:  # (run_cli needs capsys, which a module fixture cannot take)
        main(_args(tiny_world, out, "--stop_after=4"))
    assert exc.value.code in (0, None)
    return out


def _damaged(stopped: Path, tmp_path: Path, damage) -> Path:
    run = tmp_path / "run"
    shutil.copytree(stopped, run)
    damage(run)
    return run


@pytest.mark.parametrize("damage, message", [
    # bytes that are not UTF-8 in the files a resume reads (they were tracebacks)
    (lambda r: (r / "checkpoints" / "latest").write_bytes(b"\xff\xfe"), "checkpoints/latest: not UTF-8 text"),
    (lambda r: (r / "metrics.jsonl").open("ab").write(b"\xfe\xff garbage\n"), "metrics.jsonl: not UTF-8 text"),
    # a resume with its settings record gone took any settings, and wrote them down as the run's
    (lambda r: (r / "run_config.json").unlink(), "run_config.json: run directory holds a checkpoint but no "
                                                 "run_config.json"),
    # a state.json whose step was edited skipped updates 5-7
    (lambda r: (r / "checkpoints" / "step_00000004" / "state.json").write_text(
        (r / "checkpoints" / "step_00000004" / "state.json").read_text().replace('"step": 4', '"step": 7', 1)),
     "state.json: step 7 disagrees with the checkpoint's name step_00000004"),
    # `latest` naming a checkpoint that is not there was "incomplete", with nothing to do about it
    (lambda r: (r / "checkpoints" / "latest").write_text("step_00000999"),
     "step_00000999: the checkpoint named by 'latest' does not exist; complete checkpoints here: step_00000002, "
     "step_00000004 (write one of them into "),
    (lambda r: (r / "checkpoints" / "step_00000004" / "state.json").unlink(),
     "step_00000004: the checkpoint named by 'latest' is incomplete; complete checkpoints here: step_00000002"),
])  # fmt: skip
def test_a_damaged_run_directory_is_one_line(tiny_world, stopped, tmp_path, capsys, damage, message):
    run = _damaged(stopped, tmp_path, damage)
    code, _, err = run_cli(_args(tiny_world, run, "--lr=1e-3" if "run_config" in message else "--lr=1e-4"), capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err


def test_a_config_file_that_is_not_utf8_is_one_line(tmp_path, capsys):
    bad = tmp_path / "b.yaml"
    bad.write_bytes(b"lr: 0.001 # caf\xe9\n")
    code, _, err = run_cli(["pretrain", f"--config={bad}"], capsys)
    assert code == 2 and err == f"error: {bad}: not UTF-8 text (invalid continuation byte at byte 15)\n"


def test_the_vocabulary_is_the_runs_own(tiny_world, stopped, tmp_path, capsys):
    # A start stopped before its first checkpoint leaves tokenizer/ behind; the next start begins again and
    # reads --tokenizer, where it used to take the stale vocabulary and record --tokenizer as used.
    out = tmp_path / "early"
    code, _, err = run_cli(_args(tiny_world, out, "--stop_after=1"), capsys)
    assert code in (0, None) and (out / "tokenizer" / "vocab.txt").is_file()
    world_vocab = tiny_world.root / "vocab"
    code, _, err = run_cli(_args(tiny_world, out, f"--tokenizer={world_vocab}", "--steps=2"), capsys)
    assert code in (0, None), err
    assert (out / "model" / "vocab.txt").read_text() == (world_vocab / "vocab.txt").read_text()
    # --tokenizer beside --init: another vocabulary than the model's rows is refused (it was ignored)
    init = tmp_path / "early" / "model"
    code, _, err = run_cli(_args(tiny_world, tmp_path / "y", f"--init={init}", f"--tokenizer={stopped / 'tokenizer'}",
                                 "--steps=2"), capsys)
    assert code == 2 and "--tokenizer's vocab.txt differs from the --init model's" in err
    # a model directory whose vocab.txt is not its embedding table's: named
    shutil.copytree(init, tmp_path / "short")
    words = (init / "vocab.txt").read_text().splitlines()
    (tmp_path / "short" / "vocab.txt").write_text("\n".join(words[:10]) + "\n")
    assert TextTokenizer.load(tmp_path / "short").vocab_size == 10
    code, _, err = run_cli(_args(tiny_world, tmp_path / "z", f"--init={tmp_path / 'short'}", "--steps=2"), capsys)
    assert code == 2 and f"{tmp_path / 'short' / 'vocab.txt'}: vocab.txt has 10 tokens but the model's vocabulary is " \
                         f"{len(words)} ({tmp_path / 'short' / 'config.json'} vocab_size)" in err, err
    assert json.loads((init / "config.json").read_text())["config"]["vocab_size"] == len(words)
