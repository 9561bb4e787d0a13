"""--max_text_len against the model's position table in the fine-tuning and evaluate commands
(`recipes.common.check_text_len`, `fit_text_len`): a length given beyond the table is one line naming the
model's config.json, before any data is read (a text that long indexed past the table deep in the forward
pass, an IndexError); a task's default beyond a small model's table (VCR's 80 against a tiny model's 64) is
capped at it."""

from __future__ import annotations

import json

import pytest
from test_vcr_task import vcr_cfg

from vlberts.cli import main
from vlberts.errors import VlbertsError
from vlberts.models.builders import model_config
from vlberts.recipes.analyze_grounding import GroundingConfig
from vlberts.recipes.common import check_text_len, fit_text_len
from vlberts.recipes.finetune_vcr import finetune_vcr


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code or 0, out, err


# Each task's required data settings, pointed at files that do not exist: the length is refused before them.
TASK_FILES = {
    "vqa": ("train_questions", "train_annotations"),
    "gqa": ("train_questions",),
    "nlvr2": ("train_statements",),
    "vcr": ("train_file",),
    "refcoco": ("refs", "instances"),
    "retrieval": ("split_file",),
    "flickr_entities": ("entities",),
}


@pytest.mark.parametrize("task", TASK_FILES)
def test_finetune_max_text_len_beyond_the_position_embeddings_is_refused_first(task, tiny_pretrained, tmp_path,
                                                                               capsys):
    missing = tmp_path / "not-there"
    code, _, err = run_cli(["finetune", task, f"--init={tiny_pretrained}", f"--features={missing}",
                            *(f"--{key}={missing}" for key in TASK_FILES[task]), "--max_text_len=65",
                            f"--out={tmp_path / 'run'}", "--device=cpu"], capsys)
    assert code == 2, err
    assert err.strip() == (f"error: {tiny_pretrained / 'config.json'}: --max_text_len=65 is more than the model's 64 "
                           "position embeddings (max_position_embeddings); use at most 64")
    assert not (tmp_path / "run").exists()


def test_evaluate_retrieval_max_text_len_beyond_the_position_embeddings_is_refused_first(tiny_pretrained, tmp_path,
                                                                                         capsys):
    missing = tmp_path / "not-there"
    code, _, err = run_cli(["evaluate", "retrieval", f"--init={tiny_pretrained}", "--zero_shot",
                            f"--features={missing}", f"--split_file={missing}", "--max_text_len=100",
                            f"--out={tmp_path / 'eval'}", "--device=cpu"], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{tiny_pretrained / 'config.json'}: --max_text_len=100 is more than the model's 64" in err


def test_vcr_default_beyond_a_tiny_model_is_capped_at_its_table(tiny_world, tiny_pretrained, tmp_path):
    # VCR's default 80 against visualbert-tiny's 64 position embeddings: a question and answer longer than 64
    # subwords crashed in the embedding lookup (IndexError); the default is capped, and recorded as used.
    lines = (tiny_world.root / "vcr" / "train.jsonl").read_text().splitlines()[:8]
    recs = [json.loads(x) for x in lines]
    recs[0]["question"] = ["is", "the", "small", "circle", "red"] * 20 + ["?"]
    train = tmp_path / "vcr" / "train.jsonl"
    train.parent.mkdir()
    train.write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "vcr" / "metadata").symlink_to(tiny_world.root / "vcr" / "metadata")
    out = tmp_path / "run"
    assert finetune_vcr(vcr_cfg(tiny_world, tiny_pretrained, out, train_file=str(train), eval_file="",
                                epochs=1.0, batch_size=8)) == out / "model"
    assert json.loads((out / "run_config.json").read_text())["max_text_len"] == 64


def test_vlbert_leaves_two_positions_after_the_text():
    # VL-BERT's regions take the text's length n as their position and [END] n + 1 (models/vlbert.py): a
    # 63-token text indexed position 64 of a 64-row table.
    vlbert, visualbert = model_config("vlbert-tiny"), model_config("visualbert-tiny")
    assert check_text_len(62, vlbert, "m") == 62 and check_text_len(64, visualbert, "m") == 64
    with pytest.raises(VlbertsError) as err:
        check_text_len(63, vlbert, "m")
    assert str(err.value) == ("m/config.json: --max_text_len=63 is more than the model's 64 position embeddings "
                              "(max_position_embeddings) less the 2 it places after the text; use at most 62")
    assert check_text_len(64, vlbert, "m", inherited=True) == 62
    # an analysis's default (64) is capped for VL-BERT; a value given beyond the table is refused
    assert fit_text_len(GroundingConfig(), vlbert, "m").max_text_len == 62
    assert fit_text_len(GroundingConfig(), visualbert, "m") == GroundingConfig()
    with pytest.raises(VlbertsError, match="use at most 62"):
        fit_text_len(GroundingConfig(max_text_len=100), vlbert, "m")


def test_pretrain_max_text_len_beyond_the_position_embeddings_is_refused_first(tiny_pretrained, tmp_path, capsys):
    """Pre-training too: a named configuration's table (`--model`) or `--init`'s, before any data is read
    (a caption that long was an IndexError in the embedding mid-run)."""
    missing = tmp_path / "not-there"
    files = [f"--captions={missing}", f"--features={missing}", f"--out={tmp_path / 'run'}"]
    code, _, err = run_cli(["pretrain", "--model=visualbert-tiny", "--max_text_len=500", *files], capsys)
    assert code == 2 and err.strip() == ("error: --max_text_len=500 is more than the model's 64 position embeddings "
                                         "(max_position_embeddings); use at most 64")
    code, _, err = run_cli(["pretrain", f"--init={tiny_pretrained}", "--max_text_len=65", *files], capsys)
    assert code == 2 and err.strip().startswith(f"error: {tiny_pretrained / 'config.json'}: --max_text_len=65 is more")
    code, _, err = run_cli(["pretrain", "--model=vlbert-tiny", "--max_text_len=63", *files], capsys)
    assert code == 2 and "less the 2 it places after the text; use at most 62" in err
    assert not (tmp_path / "run").exists()
