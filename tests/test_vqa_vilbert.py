"""ViLBERT's VQA files (vilbert-multi-task `datasets/VQA/cache/`, formats-and-metrics.md §2.2): the target
pickles `{split}_target.pkl` (hengyuan-hu's `compute_softscore.py`: per question the indices of its answers
in `trainval_ans2label.pkl` and their 0.3-step scores) read beside VQA v2's questions JSON, the answer table
pickles, ViLBERT's minval (`--eval_last`), the world's export of them, and fine-tuning and scoring from them
giving what the VQA v2 JSON pair gives."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from vlberts.data.vqa import read_vqa
from vlberts.errors import BadRecords, VlbertsError
from vlberts.tasks.predictions import last_questions
from vlberts.tasks.vqa import build_answer_vocab, example_target, read_answer_vocab

VLBERTS = Path(sys.executable).with_name("vlberts")
TABLE = ["yes", "no", "2", "red", "dark red"]

# A target list as Python 2's cPickle writes it (protocol 0: byte strings as STRING opcodes, a long question
# id, get_score's int 1 for four or more annotators): [{question_id: 7L, image_id: 42, labels: [3, 4],
# scores: [0.9, 1]}, {question_id: 8, image_id: 42, labels: [], scores: []}].
PY2_TARGETS = (b"(lp0\n(dp1\nS'question_id'\np2\nL7L\nsS'image_id'\np3\nI42\nsS'labels'\np4\n(lp5\nI3\naI4\nas"
               b"S'scores'\np6\n(lp7\nF0.9\naI1\nasa(dp8\ng2\nI8\nsg3\nI42\nsg4\n(lp9\nsg6\n(lp10\nsa.")


def _questions(tmp_path: Path, ids: list[int], image_id: int = 42) -> Path:
    path = tmp_path / "v2_OpenEnded_mscoco_val2014_questions.json"
    path.write_text(json.dumps({"questions": [
        {"image_id": image_id, "question": f"What is {qid}?", "question_id": qid} for qid in ids]}))
    return path


def _pickle(path: Path, obj, protocol: int = 4) -> Path:
    path.write_bytes(pickle.dumps(obj, protocol=protocol))
    return path


def test_a_python2_target_pickle_reads_as_labels_of_the_answer_table(tmp_path):
    q = _questions(tmp_path, [8, 7])
    (tmp_path / "val_target.pkl").write_bytes(PY2_TARGETS)
    examples = read_vqa(q, tmp_path / "val_target.pkl", answers=TABLE)
    assert [ex.question_id for ex in examples] == [7, 8]  # the target file's order, as annotations'
    first, empty = examples
    assert first.label == {"red": 0.9, "dark red": 1.0} and first.answers == []
    assert first.multiple_choice_answer == "dark red"  # the best-scored: what --min_answer_count counts
    assert first.question == "What is 7?" and first.image_id == 42
    assert empty.annotated and empty.label == {} and empty.multiple_choice_answer is None  # no answer in the table


def test_answer_table_pickles_in_both_of_vilberts_forms(tmp_path):
    by_answer = read_answer_vocab(_pickle(tmp_path / "trainval_ans2label.pkl", {a: i for i, a in enumerate(TABLE)}, 2))
    by_label = read_answer_vocab(_pickle(tmp_path / "trainval_label2ans.pkl", list(TABLE)))
    assert by_answer.answers == by_label.answers == tuple(TABLE)
    with pytest.raises(VlbertsError, match=r"bad\.pkl: answer-to-index object must map strings to the indices 0\.\.N-1"):
        read_answer_vocab(_pickle(tmp_path / "bad.pkl", {"yes": 0, "no": 2}))
    (tmp_path / "code.pkl").write_bytes(b"cos\nsystem\n(S'true'\ntR.")  # a pickle that would run a command
    with pytest.raises(VlbertsError, match=r"code\.pkl: refused or malformed pickle: forbidden global os\.system"):
        read_answer_vocab(tmp_path / "code.pkl")


GOOD = {"question_id": 2, "image_id": 42, "labels": [0], "scores": [1.0]}


@pytest.mark.parametrize("change, message", [
    ({"labels": [5]}, r"label 5 is not an index into the 5-answer table"),
    ({"labels": [-1]}, r"label -1 is not an index into the 5-answer table"),
    ({"labels": [0, 1]}, r"labels and scores must be lists of one length"),
    ({"labels": [0, 0], "scores": [0.3, 0.6]}, r"label 0 \('yes'\) is given twice"),
    ({"scores": [1.3]}, r"a label must map answers to scores in \[0, 1\]"),
    ({"labels": "0"}, r"labels and scores must be lists of one length"),
    ({"image_id": 43}, r"image_id 43 differs from the question's image_id 42"),
    # records that name no question 2, which is then left without answers too (a second count)
    ({"question_id": 9}, r"question_id 9 has no question in v2_OpenEnded_mscoco_val2014_questions\.json"),
    ({"question_id": 1}, r"duplicate annotation for question_id 1 \(first at \[0\]\)"),
    ({"scores": None}, r"missing field\(s\) scores"),
])
def test_bad_target_records_name_the_file_and_the_record(tmp_path, change, message):
    q = _questions(tmp_path, [1, 2])
    rec = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    targets = _pickle(tmp_path / "val_target.pkl", [{**GOOD, "question_id": 1}, rec])
    with pytest.raises(VlbertsError, match=r"val_target\.pkl: record \[1\]: " + message):
        read_vqa(q, targets, answers=TABLE)
    bad = BadRecords(skip=True)
    assert [ex.question_id for ex in read_vqa(q, targets, bad=bad, answers=TABLE)] == [1]
    # a record that names question 2 (one missing its scores too: its id is read first) is that question's
    # only count; one that names another question leaves question 2 without answers, a second count
    names_question_2 = change.get("question_id", 2) == 2
    assert bad.total == (1 if names_question_2 else 2)


def test_a_target_pickle_needs_its_answer_table_and_must_be_a_list(tmp_path):
    q = _questions(tmp_path, [1])
    targets = _pickle(tmp_path / "val_target.pkl", [{**GOOD, "question_id": 1}])
    with pytest.raises(VlbertsError, match=r"val_target\.pkl: ViLBERT's target pickle names answers by their index"):
        read_vqa(q, targets)
    with pytest.raises(VlbertsError, match=r"dict\.pkl: expected a pickled list of \{question_id, image_id, labels, "
                                           r"scores\} records \(ViLBERT's target\.pkl\), got a dict"):
        read_vqa(q, _pickle(tmp_path / "dict.pkl", {"question_id": 1}), answers=TABLE)


def test_eval_last_keeps_the_largest_question_ids_in_their_own_order():
    class Q:
        def __init__(self, qid):
            self.question_id = qid

    examples = [Q(5), Q(1), Q(9), Q(3), Q(7)]
    assert [ex.question_id for ex in last_questions(examples, 3)] == [5, 9, 7]
    assert last_questions(examples, 0) is examples and last_questions(examples, 10) is examples


def test_the_world_writes_vilberts_targets_of_its_vqa_answers(tiny_world):
    cache = tiny_world.root / "vqa" / "cache"
    vocab = read_answer_vocab(cache / "trainval_ans2label.pkl")
    train, val = (read_vqa(*tiny_world.vqa(split)) for split in ("train", "val"))
    assert vocab == build_answer_vocab(train + val, 9)  # hengyuan-hu's table: 9+ questions over train + val
    for split in ("train", "val", "test"):
        from_json = read_vqa(*tiny_world.vqa(split))
        from_pickle = read_vqa(tiny_world.vqa(split)[0], cache / f"{split}_target.pkl", answers=vocab.answers)
        assert [ex.question_id for ex in from_pickle] == [ex.question_id for ex in from_json]
        targets = [[(t.labels, t.scores) for t in map(lambda ex: example_target(ex, vocab), examples)]
                   for examples in (from_pickle, from_json)]
        assert targets[0] == targets[1]


def test_finetune_and_evaluate_from_vilberts_files_equal_the_json_run(tiny_world, tiny_pretrained, tmp_path):
    """ViLBERT's trainval / minval: train and val questions for training, the last val questions held out
    (--eval_last, --exclude_eval_questions); from the target pickles and the answer-table pickle the run
    trains on the same targets as from the JSON annotations, so it predicts the same answers and scores
    them the same (ViLBERT's label scoring is the official accuracy where the strings agree)."""
    from vlberts.recipes.finetune_vqa import FinetuneVQAConfig, finetune_vqa

    cache = tiny_world.root / "vqa" / "cache"
    (tq, ta), (vq, va) = tiny_world.vqa("train"), tiny_world.vqa("val")
    common = dict(init=str(tiny_pretrained), features=str(tiny_world.store), epochs=0.5, batch_size=16, lr=1e-3,
                  ckpt_every=100, answer_vocab=str(cache / "trainval_ans2label.pkl"), eval_last=20,
                  exclude_eval_questions=True, train_questions=f"{tq},{vq}", eval_questions=str(vq))
    finetune_vqa(FinetuneVQAConfig(**common, out=str(tmp_path / "json"), train_annotations=f"{ta},{va}",
                                   eval_annotations=str(va)))
    finetune_vqa(FinetuneVQAConfig(**common, out=str(tmp_path / "vil"), eval_annotations=str(cache / "val_target.pkl"),
                                   train_annotations=f"{cache / 'train_target.pkl'},{cache / 'val_target.pkl'}"))
    with pytest.raises(VlbertsError, match=r"train_target.pkl: ViLBERT's VQA target pickle holds answers, not question "
                                           r"text: give it as the annotations"):  # as GQA's are given, which do
        finetune_vqa(FinetuneVQAConfig(**{**common, "train_questions": str(cache / "train_target.pkl")},
                                       out=str(tmp_path / "x"), train_annotations=str(ta)))
    m_json, m_vil = (json.loads((tmp_path / r / "metrics.json").read_text()) for r in ("json", "vil"))
    assert m_vil["num_questions"] == m_json["num_questions"] == 20
    assert m_vil["train_questions_in_eval_dropped"] == 20
    assert m_vil["accuracy"] == m_json["accuracy"] and m_vil["label_scored_questions"] == 20
    preds = json.loads((tmp_path / "vil" / "predictions.json").read_text())
    val_ids = sorted(ex.question_id for ex in read_vqa(vq, va))
    assert sorted(p["question_id"] for p in preds) == val_ids[-20:]  # ViLBERT's minval: the last by question id
    assert (tmp_path / "vil" / "predictions.json").read_text() == (tmp_path / "json" / "predictions.json").read_text()

    evaluate = [str(VLBERTS), "evaluate", "vqa", "--predictions", str(tmp_path / "vil" / "predictions.json"),
                "--questions", str(vq), "--annotations", str(cache / "val_target.pkl"), "--out", str(tmp_path / "eval")]
    proc = subprocess.run(evaluate, capture_output=True, text=True)
    assert proc.returncode == 2 and "give that table (trainval_ans2label.pkl) as --answer_vocab" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    evaluate += ["--answer_vocab", str(cache / "trainval_ans2label.pkl")]
    proc = subprocess.run(evaluate, capture_output=True, text=True)  # predictions of minval, scored against val
    assert proc.returncode == 2 and "no prediction for this example" in proc.stderr
    proc = subprocess.run([*evaluate, "--eval_last", "20"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["accuracy"] == m_json["accuracy"]
    assert "warning" not in proc.stderr
    # Another table than the pickle's (the world's Pythia table, whose rows differ) names other answers at the
    # same indices: a warning names both files
    other = [*evaluate[:evaluate.index("--answer_vocab") + 1], str(tiny_world.root / "vqa" / "answers_vqa.txt"),
             "--eval_last", "20"]
    proc = subprocess.run(other, capture_output=True, text=True)
    assert proc.stderr.startswith(f"warning: {cache / 'val_target.pkl'}: its labels index ViLBERT's answer table")
    assert "answers_vqa.txt is not that pickle" in proc.stderr


def test_image_id_lists_as_vilbert_writes_them(tmp_path):
    """ViLBERT's `cache/coco_test_ids.npy` (numbers), as text too; a pickled object array or a 2-d one is refused."""
    import numpy as np

    from vlberts.data.text_corpus import read_image_ids

    np.save(tmp_path / "coco_test_ids.npy", np.array([42, 7, 42], dtype=np.int64))
    assert read_image_ids(tmp_path / "coco_test_ids.npy") == ["42", "7"]
    (tmp_path / "ids.txt").write_text("42\n\n7\n")
    assert read_image_ids(tmp_path / "ids.txt") == ["42", "7"]
    np.save(tmp_path / "obj.npy", np.array([42, "x"], dtype=object), allow_pickle=True)
    with pytest.raises(VlbertsError, match=r"obj\.npy: not a \.npy array of image ids"):
        read_image_ids(tmp_path / "obj.npy")
    np.save(tmp_path / "flat.npy", np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(VlbertsError, match=r"flat\.npy: expected a non-empty 1-d array of image ids"):
        read_image_ids(tmp_path / "flat.npy")


def test_excluded_images_leave_training_as_vilberts_clean_train_sets(tiny_world, tiny_pretrained, tmp_path):
    """--exclude_images drops the training and evaluation questions on the listed images (a COCO file stem
    counts as its number), counted in metrics.json; a missing list stops the run before any data is read."""
    import numpy as np

    from vlberts.data.vqa import VQAExample
    from vlberts.tasks.predictions import excluded_images, without_images
    from vlberts.recipes.finetune_vqa import FinetuneVQAConfig, finetune_vqa

    examples = [VQAExample(question_id=i, image_id=image, question="q")
                for i, image in enumerate([42, "COCO_val2014_000000000042", 7, "n42"])]
    np.save(tmp_path / "test_ids.npy", np.array([42], dtype=np.int64))
    kept, dropped = without_images(examples, excluded_images(str(tmp_path / "test_ids.npy")))
    assert [ex.image_id for ex in kept] == [7, "n42"] and dropped == 2

    (tq, ta), (eq, ea) = tiny_world.vqa("train"), tiny_world.vqa("test")
    train, test = read_vqa(tq, ta), read_vqa(eq, ea)
    banned = sorted({ex.image_id for ex in train})[:3] + sorted({ex.image_id for ex in test})[:1]
    np.save(tmp_path / "banned.npy", np.array(banned, dtype=np.int64))
    common = dict(init=str(tiny_pretrained), features=str(tiny_world.store), epochs=0.2, batch_size=16,
                  ckpt_every=100, min_answer_count=2, train_questions=str(tq), train_annotations=str(ta),
                  eval_questions=str(eq), eval_annotations=str(ea))
    finetune_vqa(FinetuneVQAConfig(**common, out=str(tmp_path / "run"), exclude_images=str(tmp_path / "banned.npy")))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    on_banned = sum(ex.image_id in banned for ex in train)
    assert on_banned > 0 and metrics["train_questions_on_excluded_images"] == on_banned
    assert metrics["train_questions"] == len(train) - on_banned
    on_banned_test = sum(ex.image_id in banned for ex in test)
    assert metrics["eval_questions_on_excluded_images"] == on_banned_test > 0
    assert metrics["num_questions"] == len(test) - on_banned_test
    # `evaluate vqa --exclude_images` scores the same questions again (without it, the left-out ones have no
    # prediction)
    evaluate = [str(VLBERTS), "evaluate", "vqa", "--predictions", str(tmp_path / "run" / "predictions.json"),
                "--questions", str(eq), "--annotations", str(ea), "--out", str(tmp_path / "eval")]
    proc = subprocess.run(evaluate, capture_output=True, text=True)
    assert proc.returncode == 2 and "no prediction for this example" in proc.stderr
    proc = subprocess.run([*evaluate, "--exclude_images", str(tmp_path / "banned.npy")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    scored = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert scored["accuracy"] == metrics["accuracy"] and scored["questions_on_excluded_images"] == on_banned_test
    with pytest.raises(VlbertsError, match="missing.npy: image list not found"):
        finetune_vqa(FinetuneVQAConfig(**{**common, "train_questions": str(tmp_path / "nowhere.json")},
                                       out=str(tmp_path / "bad"), exclude_images=str(tmp_path / "missing.npy")))
