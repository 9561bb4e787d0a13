"""GQA from ViLBERT's own files (vilbert-multi-task `vilbert/datasets/gqa_dataset.py`): `cache/{split}_target.pkl`,
a pickled list of {question_id, image_id, question, labels, scores} whose labels index
`cache/trainval_ans2label.pkl`; its minval is the last 3,000 of trainval by question id, as numbers."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from vlberts.data.gqa import read_gqa
from vlberts.errors import BadRecords, VlbertsError
from vlberts.tasks.gqa import build_answer_vocab, normalize_gqa_answer
from vlberts.tasks.predictions import last_questions
from vlberts.tasks.vqa import read_answer_vocab

VLBERTS = Path(sys.executable).with_name("vlberts")
TABLE = ["yes", "no", "left", "dark blue"]


def _rec(qid, labels=(2,), scores=(1.0,), **kw) -> dict:
    return {"question_id": qid, "image_id": "n42", "question": f"Which side is {qid}?", "labels": list(labels),
            "scores": list(scores), **kw}


def _pickle(path: Path, obj, protocol: int = 2) -> Path:
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return path


def test_a_target_pickle_reads_as_gqa_questions_with_their_answers(tmp_path):
    path = _pickle(tmp_path / "val_target.pkl", [_rec("02930152"), _rec(7, labels=[], scores=[])], protocol=0)
    first, unknown = read_gqa(path, require_answers=True, answers=TABLE)
    assert (first.question_id, first.image_id, first.question, first.answer) == \
        ("02930152", "n42", "Which side is 02930152?", "left")  # the id kept as a string, leading zero and all
    # No label: the answer is not in the table; it reads as "", no class, so it trains toward none and scores 0.
    assert (unknown.question_id, unknown.answer) == ("7", "")


@pytest.mark.parametrize("record, message", [
    ({k: v for k, v in _rec("1").items() if k != "question"}, r"\[0\]: missing field\(s\) question"),
    (_rec("1", labels=[4]), r"\[0\] \(question 1\): label 4 is not an index into the 4-answer table"),
    (_rec("1", labels=[0, 1], scores=[1.0]), r"\[0\] \(question 1\): labels and scores must be lists of one length"),
    (_rec("1", scores=[2.0]), r"\[0\] \(question 1\): a label must map answers to scores in \[0, 1\], got \{'left': 2\.0\}"),
    (_rec(True), r"\[0\]: question_id must be a string, got True"),
])
def test_bad_records_name_the_file_and_the_record(tmp_path, record, message):
    path = _pickle(tmp_path / "train_target.pkl", [record, _rec("2")])
    with pytest.raises(VlbertsError, match=r"train_target\.pkl: record " + message):
        read_gqa(path, answers=TABLE)
    bad = BadRecords(skip=True)
    assert [ex.question_id for ex in read_gqa(path, answers=TABLE, bad=bad)] == ["2"] and bad.total == 1


def test_a_target_pickle_needs_its_table_and_unique_ids(tmp_path):
    path = _pickle(tmp_path / "train_target.pkl", [_rec("1"), _rec("1")])
    with pytest.raises(VlbertsError, match="give that table \\(cache/trainval_ans2label.pkl\\) as --answer_vocab"):
        read_gqa(path)
    with pytest.raises(VlbertsError, match=r"record \[1\] \(question 1\): duplicate question id 1 \(first at \[0\]\)"):
        read_gqa(path, answers=TABLE)
    with pytest.raises(VlbertsError, match=r"expected a pickled list of \{question_id, image_id, question, labels, "
                                           r"scores\} records"):
        read_gqa(_pickle(tmp_path / "d.pkl", {"question_id": "1"}), answers=TABLE)


def test_minval_is_the_last_of_trainval_by_question_id_as_the_pickle_stores_it(tmp_path):
    """ViLBERT sorts its pickle's records by `question_id` as stored (gqa_dataset.py): strings as text, so "9"
    comes after "100" (GQA's ids are digit strings of 8 and 9 digits), numbers as numbers."""
    as_text = [_rec(q) for q in ("9", "100", "011", "10")]
    examples = read_gqa(_pickle(tmp_path / "s.pkl", as_text), answers=TABLE)
    assert [ex.question_id for ex in last_questions(examples, 2)] == ["9", "100"]  # "100" < "9" as text
    as_numbers = [{**rec, "question_id": int(rec["question_id"])} for rec in as_text]
    examples = read_gqa(_pickle(tmp_path / "n.pkl", as_numbers), answers=TABLE)
    assert [ex.question_id for ex in examples] == ["9", "100", "11", "10"]  # read back as the digits
    assert [ex.question_id for ex in last_questions(examples, 2)] == ["100", "11"]


def test_the_world_writes_vilberts_gqa_files(tiny_world):
    gqa, cache = tiny_world.root / "gqa", tiny_world.root / "gqa" / "cache"
    table = read_answer_vocab(cache / "trainval_ans2label.pkl")
    from_json = {split: read_gqa(gqa / f"{split}_balanced_questions.json", require_answers=True) for split in ("train", "val")}
    assert table == build_answer_vocab(from_json["train"] + from_json["val"])  # every train + val answer
    from_json["trainval"] = from_json["train"] + from_json["val"]
    for split, expected in from_json.items():
        got = read_gqa(cache / f"{split}_target.pkl", require_answers=True, answers=table.answers)
        assert [(ex.question_id, ex.image_id, ex.question, ex.answer) for ex in got] == \
            [(ex.question_id, ex.image_id, ex.question, normalize_gqa_answer(ex.answer)) for ex in expected]


def test_finetuning_from_vilberts_gqa_files_equals_the_json_run(tiny_world, tiny_pretrained, tmp_path):
    """Train + val for training, the last val questions held out (ViLBERT's minval, here of val), the same
    answer table: the run from the target pickles predicts and scores exactly as the run from GQA's JSON."""
    from vlberts.recipes.finetune_gqa import FinetuneGQAConfig, finetune_gqa

    gqa, cache = tiny_world.root / "gqa", tiny_world.root / "gqa" / "cache"
    common = dict(init=str(tiny_pretrained), features=str(tiny_world.store), epochs=0.5, batch_size=16, lr=1e-3,
                  ckpt_every=100, answer_vocab=str(cache / "trainval_ans2label.pkl"), eval_last=20,
                  exclude_eval_questions=True)
    finetune_gqa(FinetuneGQAConfig(**common, out=str(tmp_path / "json"),
                                   train_questions=f"{gqa / 'train_balanced_questions.json'},{gqa / 'val_balanced_questions.json'}",
                                   eval_questions=str(gqa / "val_balanced_questions.json")))
    finetune_gqa(FinetuneGQAConfig(**common, out=str(tmp_path / "vil"), train_questions=str(cache / "trainval_target.pkl"),
                                   eval_questions=str(cache / "val_target.pkl")))
    m_json, m_vil = (json.loads((tmp_path / r / "metrics.json").read_text()) for r in ("json", "vil"))
    assert m_vil["accuracy"] == m_json["accuracy"] and m_vil["train_questions_in_eval_dropped"] == 20
    assert (tmp_path / "vil" / "predictions.json").read_text() == (tmp_path / "json" / "predictions.json").read_text()
    assert len(json.loads((tmp_path / "vil" / "predictions.json").read_text())) == 20

    # `vlberts evaluate gqa` scores the minval predictions from the pickle and its table, as the run did.
    evaluate = [str(VLBERTS), "evaluate", "gqa", "--predictions", str(tmp_path / "vil" / "predictions.json"),
                "--questions", str(cache / "val_target.pkl"), "--out", str(tmp_path / "eval")]
    proc = subprocess.run(evaluate, capture_output=True, text=True)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "give that table" in proc.stderr
    evaluate += ["--answer_vocab", str(cache / "trainval_ans2label.pkl")]
    proc = subprocess.run(evaluate, capture_output=True, text=True)  # minval's predictions against all of val
    assert proc.returncode == 2 and "no prediction" in proc.stderr
    proc = subprocess.run([*evaluate, "--eval_last", "20"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["accuracy"] == m_vil["accuracy"]
    with pytest.raises(VlbertsError, match="give that table"):
        finetune_gqa(FinetuneGQAConfig(**{**common, "answer_vocab": ""}, out=str(tmp_path / "bad"),
                                       train_questions=str(cache / "train_target.pkl"),
                                       eval_questions=str(cache / "val_target.pkl")))
