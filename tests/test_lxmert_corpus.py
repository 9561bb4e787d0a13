"""LXMERT's pre-training corpus files (`data/lxmert/mscoco_train.json`, ...; formats-and-metrics.md §3.3): the
reader on hand-written records (sources, labels aligned with their questions, damaged records as one-line
errors), LXMERT's answer conversion, the joint table and targets, and `vlberts pretrain
--captions_format=lxmert --qa_lxmert` on the world's captions and questions written in that form."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from vlberts.data.lxmert_corpus import convert_answer, lxmert_image_qa, read_lxmert_corpus
from vlberts.data.task_texts import task_caption_refs
from vlberts.errors import VlbertsError

RECORDS = [
    {"img_id": "COCO_val2014_000000000042", "labelf": {"vqa": [{"Two": 1.0, "three": 0.3}, {}]},
     "sentf": {"mscoco": ["A bus on a street.", "Two buses."], "vqa": ["How many buses?", "Why?"]}},
    {"img_id": "2354786", "labelf": {"gqa": [{"the man": 1.0}]},
     "sentf": {"vg": ["a man holding a kite"], "gqa": ["Who is holding the kite?"]}},
]


def test_corpus_sentences_sources_and_labels(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(RECORDS[:1]))
    (tmp_path / "b.json").write_text(json.dumps(RECORDS[1:]))
    sents = read_lxmert_corpus(f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}")
    assert [(s.image_id, s.source, s.text) for s in sents] == [
        ("COCO_val2014_000000000042", "mscoco", "A bus on a street."), ("COCO_val2014_000000000042", "mscoco", "Two buses."),
        ("COCO_val2014_000000000042", "vqa", "How many buses?"), ("COCO_val2014_000000000042", "vqa", "Why?"),
        ("2354786", "vg", "a man holding a kite"), ("2354786", "gqa", "Who is holding the kite?")]
    assert [s.label for s in sents] == [None, None, {"Two": 1.0, "three": 0.3}, {}, None, {"the man": 1.0}]
    refs = task_caption_refs(f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}", "lxmert")
    assert len(refs) == 6 and refs[2].text == "How many buses?"
    captions = task_caption_refs(f"{tmp_path / 'a.json'},{tmp_path / 'b.json'}", "lxmert", questions=False)
    assert [r.text for r in captions] == ["A bus on a street.", "Two buses.", "a man holding a kite"]
    # An image's record twice, in one file or across two (the same file given twice): its sentences would be
    # read twice
    (tmp_path / "c.json").write_text(json.dumps(RECORDS + RECORDS[:1]))
    with pytest.raises(VlbertsError, match=r"c.json: record \[2\] \(img_id COCO_val2014_000000000042\): img_id "
                                           r"COCO_val2014_000000000042 has a record already \(at \[0\]\)"):
        read_lxmert_corpus(tmp_path / "c.json")
    with pytest.raises(VlbertsError, match=r"has a record already \(at \[0\] of .*a.json, the same file given twice\)"):
        read_lxmert_corpus(f"{tmp_path / 'a.json'},{tmp_path / 'a.json'}")


def test_answers_are_converted_as_lxmert_does_and_the_table_is_counted(tmp_path):
    assert [convert_answer(a) for a in ("Two", "the man", "A Dog.", "grey", "an apple", "ten", "yes")] == \
           ["2", "man", "dog", "gray", "apple", "10", "yes"]
    (tmp_path / "c.json").write_text(json.dumps(RECORDS))
    sents = read_lxmert_corpus(tmp_path / "c.json")
    qa = lxmert_image_qa(sents, "corpus.json", min_count=1)
    assert qa.answers.answers == ("2", "man")  # each question's best answer; "3" is never best; "Why?" has none
    assert [r.text for r in qa.sentences] == ["How many buses?", "Why?", "Who is holding the kite?"]
    assert [(t.labels, t.scores) for t in qa.targets] == [((0,), (1.0,)), ((), ()), ((1,), (1.0,))]
    assert qa.targets[0].dropped == ("3",) and qa.labelled == 2
    with pytest.raises(VlbertsError, match=r"no answer is the best answer of 2\+ questions"):
        lxmert_image_qa(sents, "corpus.json", min_count=2)


ALL_ANS = [{"ans": "man", "dsets": ["gqa", "vqa"]}, {"ans": "kite", "dsets": ["gqa"]}, {"ans": "2", "dsets": ["vqa"]},
           {"ans": "red", "dsets": ["visual7w"]}]  # LXMERT's data/lxmert/all_ans.json: class order, data sets


def test_the_released_answer_table_is_read_in_its_order_and_labels_keep_its_answers_only(tmp_path):
    """`--qa_answers=all_ans.json`: LXMERT's table as released (its QA head's rows), all of it or the answers of
    some data sets (its `--qaSets`); a label's answers outside it are dropped, as its `LXMERTDataset` does."""
    from vlberts.tasks.vqa import read_answer_vocab

    (tmp_path / "all_ans.json").write_text(json.dumps(ALL_ANS))
    assert read_answer_vocab(tmp_path / "all_ans.json").answers == ("man", "kite", "2", "red")
    assert read_answer_vocab(tmp_path / "all_ans.json", ["vqa"]).answers == ("man", "2")
    assert read_answer_vocab(tmp_path / "all_ans.json", ["gqa", "visual7w"]).answers == ("man", "kite", "red")
    (tmp_path / "c.json").write_text(json.dumps(RECORDS))
    qa = lxmert_image_qa(read_lxmert_corpus(tmp_path / "c.json"), "c.json",
                         answers=read_answer_vocab(tmp_path / "all_ans.json", ["vqa"]))
    assert qa.answers.answers == ("man", "2")  # the file's order, not the counted one ("2" first)
    assert [(t.labels, t.scores, t.dropped) for t in qa.targets] == [((1,), (1.0,), ("3",)), ((), (), ()),
                                                                     ((0,), (1.0,), ())]
    with pytest.raises(VlbertsError, match=r"the answer table is empty \(no answer of coco; the file's data sets: "
                                           r"gqa, visual7w, vqa\)"):
        read_answer_vocab(tmp_path / "all_ans.json", ["coco"])
    (tmp_path / "bad.json").write_text(json.dumps([ALL_ANS[0], {"ans": 2, "dsets": ["vqa"]}]))
    with pytest.raises(VlbertsError, match=r"bad\.json: record \[1\]: an all_ans.json record needs ans"):
        read_answer_vocab(tmp_path / "bad.json")
    (tmp_path / "nosets.json").write_text(json.dumps([{"ans": "man"}]))
    assert read_answer_vocab(tmp_path / "nosets.json").answers == ("man",)
    with pytest.raises(VlbertsError, match=r"record \[0\]: an all_ans.json record needs ans .* and dsets"):
        read_answer_vocab(tmp_path / "nosets.json", ["vqa"])
    (tmp_path / "list.json").write_text(json.dumps(["man", "2"]))
    with pytest.raises(VlbertsError, match="answer data sets are named in LXMERT's all_ans.json only"):
        read_answer_vocab(tmp_path / "list.json", ["vqa"])


@pytest.mark.parametrize("change, message", [
    ({"img_id": 7}, r"\[0\] \(img_id 7\): img_id must be a non-empty string, got 7"),
    ({"labelf": {"vqa": [{"2": 1.0}]}}, r"\[0\] \(img_id X\): labelf.vqa must hold one label for each of the 2 questions, got 1"),
    ({"labelf": {}}, r"\[0\] \(img_id X\): labelf.vqa must hold one label for each of the 2 questions, got none"),
    ({"labelf": {"vqa": [{"2": 1.0}, {"x": 2}]}}, r"\[0\] \(img_id X\).labelf.vqa\[1\]: a label must map answers to scores in \[0, 1\]"),
    ({"sentf": {"mscoco": "a caption"}}, r"\[0\] \(img_id X\): sentf.mscoco must be a list of sentences"),
    ({"sentf": {"mscoco": ["fine", ""]}}, r"\[0\] \(img_id X\).sentf.mscoco: field sentf.mscoco\[1\] is empty"),
])
def test_damaged_records_are_one_line_errors_naming_file_and_record(tmp_path, change, message):
    rec = {"img_id": "X", "sentf": {"mscoco": ["a caption"], "vqa": ["q1?", "q2?"]}, "labelf": {"vqa": [{"2": 1.0}, {}]}}
    (tmp_path / "c.json").write_text(json.dumps([{**rec, **change}]))
    with pytest.raises(VlbertsError, match=r"c\.json: record " + message):
        read_lxmert_corpus(tmp_path / "c.json")


def _world_corpus(tiny_world, path):
    """The world's training captions and VQA questions written as LXMERT's corpus file (images by COCO stem)."""
    from vlberts.data.vqa import read_vqa
    from vlberts.tasks.vqa import process_gt_answers, soft_score

    caps = json.loads(tiny_world.captions_train.read_text())["annotations"]
    questions = read_vqa(*tiny_world.vqa("train"))
    images: dict[int, dict] = {}
    for c in caps:
        images.setdefault(c["image_id"], {"mscoco": [], "vqa": [], "labels": []})["mscoco"].append(c["caption"])
    for q in questions:
        if q.image_id in images:
            images[q.image_id]["vqa"].append(q.question)
            images[q.image_id]["labels"].append({a: soft_score(n) for a, n in Counter(process_gt_answers(q.answers)).items()})
    corpus = [{"img_id": f"COCO_train2014_{i:012d}", "sentf": {"mscoco": v["mscoco"], "vqa": v["vqa"]},
               "labelf": {"vqa": v["labels"]}} for i, v in images.items()]
    path.write_text(json.dumps(corpus))
    return path


def test_lxmert_pretrains_on_its_corpus_with_image_qa(tiny_world, tmp_path, monkeypatch):
    """The world's captions and VQA questions as LXMERT's corpus (images by COCO file stem): pre-training
    reads every sentence, and with --qa_lxmert the questions train the image-QA head over the counted table.
    The corpus is read once (it was read for the captions and again for the questions: minutes a rank at
    LXMERT's 9.18M sentences)."""
    from vlberts.data import lxmert_corpus
    from vlberts.recipes.pretrain import PretrainConfig, pretrain
    from vlberts.training.metrics import MetricsLog

    _world_corpus(tiny_world, tmp_path / "mscoco_train.json")
    cfg = PretrainConfig(captions=str(tmp_path / "mscoco_train.json"), captions_format="lxmert", qa_lxmert=True,
                         qa_last_fraction=1.0, features=str(tiny_world.store), out=str(tmp_path / "run"),
                         model="lxmert-tiny", vocab_size=200, steps=4, batch_size=8, log_every=1, ckpt_every=100)
    reads, read = [], lxmert_corpus.read_lxmert_files
    monkeypatch.setattr(lxmert_corpus, "read_lxmert_files", lambda paths: reads.append(paths) or read(paths))
    final = pretrain(cfg)
    assert reads == [cfg.captions]
    log = MetricsLog.read(tmp_path / "run" / "metrics.jsonl")
    assert len(log) == 4 and all("qa_loss" in r and "mlm_loss" in r for r in log)
    config = json.loads((final / "config.json").read_text())
    table = lxmert_image_qa(read_lxmert_corpus(tmp_path / "mscoco_train.json"), "c", 1).answers.answers
    assert tuple(config["qa_answers"]) == table and config["config"]["num_qa_labels"] == len(table) > 2
    with pytest.raises(VlbertsError, match="--qa_lxmert reads the questions of LXMERT's corpus"):
        pretrain(dataclasses.replace(cfg, captions_format="coco", out=str(tmp_path / "bad")))

    # LXMERT's released table instead of the counted one: its answers, in its order, are the QA head's rows.
    released = [{"ans": a, "dsets": ["vqa"]} for a in reversed(table[:3])] + [{"ans": "kite", "dsets": ["gqa"]}]
    (tmp_path / "all_ans.json").write_text(json.dumps(released))
    final = pretrain(dataclasses.replace(cfg, out=str(tmp_path / "released"), qa_answers=str(tmp_path / "all_ans.json"),
                                         qa_answer_sets="vqa"))
    config = json.loads((final / "config.json").read_text())
    assert config["qa_answers"] == list(reversed(table[:3])) and config["config"]["num_qa_labels"] == 3
    with pytest.raises(VlbertsError, match="--qa_answer_sets picks answers of an all_ans.json --qa_answers"):
        pretrain(dataclasses.replace(cfg, out=str(tmp_path / "bad"), qa_answer_sets="vqa"))
    with pytest.raises(VlbertsError, match="image-QA pre-training needs VQA questions"):  # a table, no questions
        pretrain(dataclasses.replace(cfg, out=str(tmp_path / "bad"), captions=str(tiny_world.captions_train),
                                     captions_format="coco", qa_lxmert=False, qa_answers=str(tmp_path / "all_ans.json")))


def test_lxmert_corpus_streams_from_shards_with_its_questions_and_image_qa(tiny_world, tmp_path):
    """LXMERT's corpus written into shards (`python -m vlberts.data.shards --captions-format lxmert`): each image
    keeps its questions with their answers, the index counts the best answers, and a streamed `--qa_lxmert` run
    counts the same joint table as a run reading the file, trains the QA head on the questions' targets (only
    theirs) and resumes exactly."""
    import subprocess
    import sys

    from vlberts.data.pretrain_stream import QuestionRef, ShardCorpus, stream_examples
    from vlberts.data.shards import read_index
    from vlberts.features.store import RegionStore
    from vlberts.recipes.pretrain import PretrainConfig, pretrain
    from vlberts.training.distributed import DistInfo
    from vlberts.training.metrics import MetricsLog

    corpus_file = _world_corpus(tiny_world, tmp_path / "mscoco_train.json")
    sentences = read_lxmert_corpus(corpus_file)
    proc = subprocess.run([sys.executable, "-m", "vlberts.data.shards", "--store", str(tiny_world.store), "--captions",
                           str(corpus_file), "--captions-format", "lxmert", "--out", str(tmp_path / "shards"),
                           "--shard-size", "8"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    index = tmp_path / "shards" / "shard-index.json"
    questions = [s for s in sentences if s.label is not None]
    assert read_index(index)["questions"] == len(questions) > 0
    table = lxmert_image_qa(sentences, "c", 1).answers
    assert ShardCorpus(index).qa_answer_counts == dict(Counter(max(t, key=t.get) for t in
                                                               (dict(q.label) for q in questions) if t))

    # A chunk's sentences: every caption and question of its images, the questions with their labels.
    seen = []
    stream = stream_examples(ShardCorpus(index), lambda caps, regions, seed: seen.append(caps) or {(0, 0): {}},
                             seed=0, chunk_images=4, dist=DistInfo(), buffer=2)
    next(stream)
    store = RegionStore(tiny_world.store)
    by_image = {}  # by the id the store holds the image under (its COCO number; the corpus names the file stem)
    for s in sentences:
        by_image.setdefault(store.stored_id(s.image_id), []).append((s.text, s.label))
    chunk = {r.image_id for r in seen[0]}
    assert sorted((r.text, r.label if isinstance(r, QuestionRef) else None) for r in seen[0]) == sorted(
        x for img in chunk for x in by_image[img])

    cfg = PretrainConfig(shards=str(index), qa_lxmert=True, qa_last_fraction=1.0, out=str(tmp_path / "run"),
                         model="lxmert-tiny", vocab_size=200, steps=6, batch_size=8, log_every=1, ckpt_every=2,
                         chunk_images=6, shuffle_buffer=4, seed=1)
    final = pretrain(cfg)
    log = MetricsLog.read(tmp_path / "run" / "metrics.jsonl")
    assert len(log) == 6 and all(r["qa_loss"] > 0 and "mlm_loss" in r for r in log)
    config = json.loads((final / "config.json").read_text())
    assert tuple(config["qa_answers"]) == table.answers and config["config"]["num_qa_labels"] == len(table)
    resumed = tmp_path / "resumed"
    assert pretrain(dataclasses.replace(cfg, out=str(resumed), stop_after=3)) is None  # last checkpoint: step 2
    pretrain(dataclasses.replace(cfg, out=str(resumed)))
    assert [r["qa_loss"] for r in MetricsLog.read(resumed / "metrics.jsonl")] == [r["qa_loss"] for r in log]

    with pytest.raises(VlbertsError, match="with --shards, image QA reads the questions the shards hold"):
        pretrain(dataclasses.replace(cfg, out=str(tmp_path / "bad"), qa_vqa_questions=str(tiny_world.vqa("train")[0])))
    from vlberts.data.shards import write_shards

    plain = write_shards(tiny_world.store, tiny_world.captions_train, tmp_path / "plain", shard_size=8)
    with pytest.raises(VlbertsError, match="--qa_lxmert: these shards hold no questions"):
        pretrain(dataclasses.replace(cfg, shards=str(plain), out=str(tmp_path / "bad")))
