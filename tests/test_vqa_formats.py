"""The VQA files besides VQA v2's JSON pair. Pythia's (MMF's) imdb `.npy` question files, VisualBERT's and
VL-BERT's form (formats-and-metrics.md §1.5): the reader on files written by hand as Pythia's `build_imdb`
writes them, the awkward cases (header element, MMF's dict form, questions given as tokens only, numpy
integers, a test split without answers), damaged files as one-line errors, `answers_vqa.txt` answer tables,
and fine-tuning and scoring from the world's questions written as imdb files giving what the VQA v2 JSON
gives. LXMERT's converted question lists (§2.2: label scores instead of the ten answers): the reader, its
targets and LXMERT's scoring against the official one, and the same run from them."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from vlberts.data.vqa import read_vqa, read_vqa_imdb, write_vqa_imdb
from vlberts.errors import BadRecords, VlbertsError
from vlberts.tasks.vqa import read_answer_vocab

VLBERTS = Path(sys.executable).with_name("vlberts")
TEN = ["red", "red", "dark red", "red", "maroon", "red", "dark red", "red", "red", "dark red"]


def _save(path: Path, items: list) -> Path:
    """`np.save(np.array(imdb))` as Pythia's build_imdb does (an object array of dicts)."""
    array = np.empty(len(items), dtype=object)
    array[:] = items
    np.save(path, array, allow_pickle=True)
    return path


def _header(has_answer: bool = True) -> dict:
    return {"create_time": "2018-06-01", "dataset_name": "vqa", "version": 1, "has_answer": has_answer,
            "has_gt_layout": False}


def _question(qid: int, image_id, **kw) -> dict:
    rec = {"image_name": f"COCO_val2014_{int(image_id):012d}", "image_id": image_id, "question_id": qid,
           "feature_path": f"COCO_val2014_{int(image_id):012d}.npy", "question_str": "What color is the bus?",
           "question_tokens": ["what", "color", "is", "the", "bus"], "all_answers": list(TEN),
           "valid_answers": ["red"] * 6 + ["maroon"]}
    rec.update(kw)
    return {k: v for k, v in rec.items() if v is not None}


def test_pythia_imdb_reads_questions_answers_and_derives_the_majority_answer(tmp_path):
    tokens_only = _question(11, 42, question_str=None, question_tokens=["is", "it", "raining"],
                            all_answers=["yes"] * 5 + ["no"] * 5)  # a tie: the first given wins
    path = _save(tmp_path / "imdb_minival2014.npy", [
        _header(), _question(10, np.int64(42)), tokens_only, _question(12, 7, all_answers=None, answers=TEN[::-1])])
    examples = read_vqa(path)  # the questions path alone: the imdb holds the answers
    assert [(ex.question_id, ex.image_id) for ex in examples] == [(10, 42), (11, 42), (12, 7)]
    assert type(examples[0].image_id) is int  # a numpy integer becomes a Python one (the store's COCO id)
    assert examples[0].question == "What color is the bus?" and examples[1].question == "is it raining"
    assert examples[0].answers == TEN and examples[2].answers == TEN[::-1]  # MMF's `answers` when no all_answers
    assert [ex.multiple_choice_answer for ex in examples] == ["red", "yes", "red"]
    assert examples[0].answer_type is None and examples[0].question_type is None
    assert read_vqa_imdb(path) == examples


def test_mmf_dict_form_and_a_test_split_without_answers(tmp_path):
    data = [_question(1, 3, all_answers=None, valid_answers=None), _question(2, 4, all_answers=None, valid_answers=None)]
    path = tmp_path / "imdb_test2015.npy"
    np.save(path, np.array({"metadata": {"version": 1}, "data": data}, dtype=object), allow_pickle=True)
    examples = read_vqa(path)
    assert [ex.question_id for ex in examples] == [1, 2] and not any(ex.annotated for ex in examples)


def _pickled_code(tmp_path: Path) -> Path:
    class Boom:
        def __reduce__(self):
            return (print, ("code ran",))

    body = pickle.dumps(np.array([_header(), Boom()], dtype=object))
    path = _save(tmp_path / "evil.npy", [_header(), _question(1, 2)])
    raw = path.read_bytes()
    head = raw[: raw.index(b"\n") + 1]
    path.write_bytes(head + body)
    return path


@pytest.mark.parametrize("records, message", [
    ([_header(), {"image_id": 1, "question_str": "q?", "all_answers": TEN}], r"imdb\[1\]: missing field\(s\) question_id"),
    ([_header(), _question(1, 2, all_answers=TEN[:9])], r"imdb\[1\]: all_answers must be a list of 10 strings, got 9"),
    ([_header(), _question(1, 2, all_answers=None)], r"imdb\[1\]: has valid_answers .* not all_answers"),
    ([_header(), _question(1, 2), _question(1, 3)], r"imdb\[2\]: duplicate question_id 1 \(first at imdb\[1\]\)"),
    ([_header(), _question(1, 2), _question(2, 3, all_answers=None, valid_answers=None)],
     r"imdb\[2\]: has no answers, which the file's first question has"),
    ([_header(), _question(1, 2, question_str="  ")], r"imdb\[1\]: field question_str is empty"),
    ([_header(), _question(1.5, 2)], r"imdb\[1\]: question_id must be an integer, got 1.5"),
])
def test_bad_records_name_the_file_and_the_record(tmp_path, records, message):
    path = _save(tmp_path / "imdb_train2014.npy", records)
    with pytest.raises(VlbertsError, match=r"imdb_train2014\.npy: record " + message):
        read_vqa(path)
    bad = BadRecords(skip=True)  # --skip_bad: the bad record is dropped and counted
    kept = read_vqa(path, bad=bad)
    assert bad.total == 1 and len(kept) == len(records) - 2


def test_damaged_files_are_one_line_errors(tmp_path):
    with pytest.raises(VlbertsError, match=r"evil\.npy: refused or malformed pickle: forbidden global builtins\.print"):
        read_vqa(_pickled_code(tmp_path))
    np.save(tmp_path / "numbers.npy", np.zeros((3, 4), dtype=np.float32))
    with pytest.raises(VlbertsError, match=r"numbers\.npy: expected an imdb"):
        read_vqa(tmp_path / "numbers.npy")
    (tmp_path / "text.npy").write_text("not numpy")
    with pytest.raises(VlbertsError, match=r"text\.npy: not a \.npy file"):
        read_vqa(tmp_path / "text.npy")
    path = _save(tmp_path / "imdb.npy", [_header(), _question(1, 2)])
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(VlbertsError, match=r"imdb\.npy: truncated pickle"):
        read_vqa(path)
    with pytest.raises(VlbertsError, match=r"ok\.npy: an imdb \.npy holds its questions' answers, so it takes no "
                                           r"annotations file \(ann\.json given\)"):
        read_vqa(_save(tmp_path / "ok.npy", [_header(), _question(1, 2)]), tmp_path / "ann.json")


def test_answers_txt_keeps_its_lines_as_the_classes(tmp_path):
    (tmp_path / "answers_vqa.txt").write_text("<unk>\nyes\nno\n2\n")
    assert read_answer_vocab(tmp_path / "answers_vqa.txt").answers == ("<unk>", "yes", "no", "2")
    (tmp_path / "blank.txt").write_text("yes\n\nno\n")
    with pytest.raises(VlbertsError, match=r"blank\.txt: record line 2: blank line"):
        read_answer_vocab(tmp_path / "blank.txt")
    (tmp_path / "dup.txt").write_text("yes\nno\nyes\n")
    with pytest.raises(VlbertsError, match=r"dup\.txt: answer vocabulary has duplicate entries"):
        read_answer_vocab(tmp_path / "dup.txt")


def test_the_world_writes_its_questions_as_imdb_files_too(tiny_world, tmp_path):
    """`vlberts world build` writes vqa/imdb/imdb_{split}.npy and vqa/answers_vqa.txt: the JSON's questions and
    answers, Pythia's layout (header first, valid_answers against the table), and a table whose classes are
    `<unk>` and then the training questions' multiple-choice answers."""
    table = read_answer_vocab(tiny_world.root / "vqa" / "answers_vqa.txt").answers
    train = read_vqa(*tiny_world.vqa("train"))
    assert table[0] == "<unk>" and set(table[1:]) == {ex.multiple_choice_answer for ex in train}
    for split in ("train", "val", "test"):
        examples = read_vqa(*tiny_world.vqa(split))
        path = tiny_world.root / "vqa" / "imdb" / f"imdb_{split}.npy"
        back = read_vqa(path)
        assert [(e.question_id, e.image_id, e.question, e.answers) for e in back] == \
               [(e.question_id, e.image_id, e.question, e.answers) for e in examples]
        raw = np.load(path, allow_pickle=True)  # Pythia's layout, header first
        assert raw[0]["has_answer"] and raw[1]["image_name"] == f"{examples[0].image_id:012d}"
        assert raw[1]["question_tokens"] == examples[0].question.lower().rstrip("?").split()
        assert all(set(r["valid_answers"]) <= set(table) for r in raw[1:])
    unanswered = read_vqa(tiny_world.vqa("test")[0])
    write_vqa_imdb(tmp_path / "imdb_test_q.npy", unanswered)
    assert read_vqa(tmp_path / "imdb_test_q.npy") == unanswered


def test_finetune_and_evaluate_from_imdb_files_equal_the_json_run(tiny_world, tiny_pretrained, tmp_path):
    """The same questions as VQA v2 JSON and as imdb files, the same answer table (as a JSON list and as
    answers_vqa.txt): the same model, predictions and accuracy; `vlberts evaluate vqa` scores the imdb alone."""
    from vlberts.recipes.finetune_vqa import FinetuneVQAConfig, finetune_vqa

    (tq, ta), (eq, ea) = tiny_world.vqa("train"), tiny_world.vqa("test")
    vqa = tiny_world.root / "vqa"
    table = list(read_answer_vocab(vqa / "answers_vqa.txt").answers)
    (tmp_path / "answers.json").write_text(json.dumps(table))
    common = dict(init=str(tiny_pretrained), features=str(tiny_world.store), epochs=0.5, batch_size=16, lr=1e-3,
                  ckpt_every=100)
    finetune_vqa(FinetuneVQAConfig(**common, out=str(tmp_path / "json"), train_questions=str(tq),
                                   train_annotations=str(ta), eval_questions=str(eq), eval_annotations=str(ea),
                                   answer_vocab=str(tmp_path / "answers.json")))
    finetune_vqa(FinetuneVQAConfig(**common, out=str(tmp_path / "imdb"), train_questions=str(vqa / "imdb" / "imdb_train.npy"),
                                   eval_questions=str(vqa / "imdb" / "imdb_test.npy"),
                                   answer_vocab=str(vqa / "answers_vqa.txt")))
    m_json, m_imdb = (json.loads((tmp_path / r / "metrics.json").read_text()) for r in ("json", "imdb"))
    assert m_imdb["accuracy"] == m_json["accuracy"] and m_imdb["num_questions"] == m_json["num_questions"] > 0
    assert m_imdb["train_questions"] == m_json["train_questions"] and m_imdb["num_answers"] == len(table)
    preds = (tmp_path / "imdb" / "predictions.json").read_text()
    assert preds == (tmp_path / "json" / "predictions.json").read_text()

    proc = subprocess.run([str(VLBERTS), "evaluate", "vqa", "--predictions", str(tmp_path / "imdb" / "predictions.json"),
                           "--questions", str(vqa / "imdb" / "imdb_test.npy"), "--out", str(tmp_path / "eval")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["accuracy"] == m_json["accuracy"]
    # an imdb has no answer types: no per-type rows (the JSON run has them), no "(None ...)" in the line
    assert m_imdb["per_answer_type"] == {} and m_json["per_answer_type"]
    assert proc.stdout.splitlines()[0] == f"VQA accuracy {m_json['accuracy']:.2f}% on {m_json['num_questions']} questions"
    # A JSON questions file without its annotations: one line, exit 2, for training and for scoring.
    for args in (["finetune", "vqa", f"--init={tiny_pretrained}", f"--features={tiny_world.store}",
                  f"--train_questions={tq}", f"--out={tmp_path / 'no'}"],
                 ["evaluate", "vqa", "--predictions", str(tmp_path / "imdb" / "predictions.json"), "--questions",
                  str(eq), "--out", str(tmp_path / "no2")]):
        proc = subprocess.run([str(VLBERTS), *args], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "annotations" in proc.stderr, proc.stderr


def test_lxmert_image_qa_reads_an_imdb_as_the_json_pair(tiny_world, tmp_path):
    """LXMERT's image-QA pre-training source (`--qa_vqa_questions`) takes an imdb alone: the same questions,
    joint answer table and targets as from the questions + annotations JSON (the world's multiple-choice
    answer is its most frequent one, as the imdb's derived one is); an unanswered imdb is refused."""
    from vlberts.data.pretrain_qa import read_pretrain_qa

    tq, ta = tiny_world.vqa("train")
    from_json = read_pretrain_qa(tq, ta, min_count=2)
    from_imdb = read_pretrain_qa(tiny_world.root / "vqa" / "imdb" / "imdb_train.npy", min_count=2)
    assert from_imdb.answers == from_json.answers and len(from_json.answers) > 2
    assert from_imdb.sentences == from_json.sentences and from_imdb.targets == from_json.targets
    write_vqa_imdb(tmp_path / "imdb_test.npy", read_vqa(tiny_world.vqa("test")[0]))
    with pytest.raises(VlbertsError, match=r"imdb_test\.npy: image-QA pre-training needs answered questions"):
        read_pretrain_qa(tmp_path / "imdb_test.npy")


# --------------------------------------------------------------------------- LXMERT's question lists


def _lxmert(examples, stem: bool = True) -> list[dict]:
    """The examples as LXMERT's converted files hold them: the label is hengyuan-hu's soft score of each
    distinct (normalised) answer, img_id the COCO file stem."""
    from vlberts.tasks.vqa import process_gt_answers, soft_score

    rows = []
    for ex in examples:
        row = {"answer_type": ex.answer_type, "img_id": f"COCO_val2014_{ex.image_id:012d}" if stem else ex.image_id,
               "question_id": ex.question_id, "question_type": ex.question_type, "sent": ex.question}
        if ex.answers:
            row["label"] = {a: soft_score(c) for a, c in Counter(process_gt_answers(ex.answers)).items()}
        rows.append(row)
    return rows


def test_lxmert_question_list_reads_labels_and_scores_as_lxmert_does(tmp_path):
    """A JSON list is LXMERT's form: question_id, img_id (kept as written), sent, the label's scores, the
    types; the multiple-choice answer is the best-scored one; scoring reads the label's score of the
    prediction, which is the official accuracy where the ten answers are known."""
    from vlberts.data.vqa import VQAExample
    from vlberts.tasks.vqa import example_target, score_predictions, soft_target

    official = VQAExample(question_id=5, image_id=42, question="What color is the bus?", answers=list(TEN),
                          answer_type="other", question_type="what color is the")
    rows = _lxmert([official]) + [{"img_id": "COCO_val2014_000000000007", "question_id": 6, "sent": "Is it?",
                                   "label": {}}]
    (tmp_path / "minival.json").write_text(json.dumps(rows))
    ex, empty = read_vqa(tmp_path / "minival.json")
    assert (ex.question_id, ex.image_id, ex.question, ex.answers) == (5, "COCO_val2014_000000000042", official.question, [])
    assert ex.label == {"red": 1.0, "dark red": 0.9, "maroon": 0.3} and ex.multiple_choice_answer == "red"
    assert (ex.answer_type, ex.question_type) == ("other", "what color is the") and ex.annotated
    assert empty.annotated and empty.label == {} and empty.multiple_choice_answer is None
    vocab = read_answer_vocab_from(tmp_path, ["maroon", "red", "blue", "dark red"])
    assert example_target(ex, vocab) == soft_target(official.answers, vocab)
    for answer in ("red", "dark red", "maroon", "blue"):
        mine = score_predictions({5: answer}, [ex])
        assert mine.accuracy == score_predictions({5: answer}, [official]).accuracy
        assert mine.to_dict()["label_scored_questions"] == 1
    assert "label_scored_questions" not in score_predictions({5: "red"}, [official]).to_dict()
    (tmp_path / "test.json").write_text(json.dumps([{"img_id": "x", "question_id": 1, "sent": "Why?"}]))
    assert not read_vqa(tmp_path / "test.json")[0].annotated


def read_answer_vocab_from(tmp_path: Path, answers: list[str]):
    (tmp_path / "table.json").write_text(json.dumps(answers))
    return read_answer_vocab(tmp_path / "table.json")


@pytest.mark.parametrize("change, message", [
    ({"label": ["red"]}, r"a label must map answers to scores in \[0, 1\]"),
    ({"label": {"red": 1.5}}, r"a label must map answers to scores in \[0, 1\]"),
    ({"sent": ""}, r"field sent is empty"),
    ({"question_id": "5"}, r"question_id must be an integer, got '5'"),
    ({"question_type": 3}, r"field question_type must be a string"),
    ({"question_id": 1}, r"duplicate question_id 1 \(first at \[0\]\)"),
    ({"label": None}, r"has no label, which the file's first question has"),
])
def test_lxmert_bad_records_name_the_file_and_the_record(tmp_path, change, message):
    good = {"img_id": "COCO_val2014_000000000042", "question_id": 1, "sent": "Is it red?", "label": {"yes": 1}}
    (tmp_path / "train.json").write_text(json.dumps([good, {**good, "question_id": 2, **change}]))
    with pytest.raises(VlbertsError, match=r"train\.json: record \[1\]: " + message):
        read_vqa(tmp_path / "train.json")
    bad = BadRecords(skip=True)
    assert len(read_vqa(tmp_path / "train.json", bad=bad)) == 1 and bad.total == 1


def test_finetune_and_evaluate_from_lxmert_lists_equal_the_json_run(tiny_world, tiny_pretrained, tmp_path):
    """The world's questions as LXMERT's lists (images named by COCO file stem, which the store, keyed by
    COCO id, finds): the same targets, so the same model and predictions as from the JSON pair, and the same
    accuracy by LXMERT's scoring; LXMERT's image-QA source reads them too."""
    from vlberts.data.pretrain_qa import read_pretrain_qa
    from vlberts.recipes.finetune_vqa import FinetuneVQAConfig, finetune_vqa

    (tq, ta), (eq, ea) = tiny_world.vqa("train"), tiny_world.vqa("test")
    for name, (q, a) in (("train", (tq, ta)), ("minival", (eq, ea))):
        (tmp_path / f"{name}.json").write_text(json.dumps(_lxmert(read_vqa(q, a))))
    table = json.dumps(list(read_answer_vocab(tiny_world.root / "vqa" / "answers_vqa.txt").answers))
    (tmp_path / "answers.json").write_text(table)
    common = dict(init=str(tiny_pretrained), features=str(tiny_world.store), epochs=0.5, batch_size=16, lr=1e-3,
                  ckpt_every=100, answer_vocab=str(tmp_path / "answers.json"))
    finetune_vqa(FinetuneVQAConfig(**common, out=str(tmp_path / "json"), train_questions=str(tq),
                                   train_annotations=str(ta), eval_questions=str(eq), eval_annotations=str(ea)))
    finetune_vqa(FinetuneVQAConfig(**common, out=str(tmp_path / "lx"), train_questions=str(tmp_path / "train.json"),
                                   eval_questions=str(tmp_path / "minival.json")))
    m_json, m_lx = (json.loads((tmp_path / r / "metrics.json").read_text()) for r in ("json", "lx"))
    assert m_lx["accuracy"] == m_json["accuracy"] and m_lx["per_answer_type"] == m_json["per_answer_type"]
    assert m_lx["label_scored_questions"] == m_lx["num_questions"] == m_json["num_questions"]
    assert (tmp_path / "lx" / "predictions.json").read_text() == (tmp_path / "json" / "predictions.json").read_text()
    proc = subprocess.run([str(VLBERTS), "evaluate", "vqa", "--predictions", str(tmp_path / "lx" / "predictions.json"),
                           "--questions", str(tmp_path / "minival.json"), "--out", str(tmp_path / "eval")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["accuracy"] == m_json["accuracy"]
    from_json, from_lx = read_pretrain_qa(tq, ta, min_count=2), read_pretrain_qa(tmp_path / "train.json", min_count=2)
    assert from_lx.answers == from_json.answers and from_lx.targets == from_json.targets
