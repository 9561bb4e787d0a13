"""LXMERT image-QA pre-training (§3.1.3, §3.3): questions join the sentences, their answers over a joint
answer table are labels of matched pairs only, the loss trains in the last part of the run, resumes exactly,
and VQA fine-tuning starts its classifier from the pre-trained QA head (LXMERT's --loadLXMERTQA)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vlberts.data.gqa import read_gqa
from vlberts.data.pretrain import MATCH, CaptionPretrainData
from vlberts.data.pretrain_qa import read_pretrain_qa
from vlberts.data.vqa import read_vqa
from vlberts.errors import VlbertsError
from vlberts.features.store import RegionStore
from vlberts.recipes.finetune_vqa import build_vqa_model
from vlberts.recipes.pretrain import PretrainConfig, pretrain
from vlberts.tasks.vqa import SoftTarget, build_answer_vocab
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.metrics import MetricsLog

VLBERTS = Path(sys.executable).with_name("vlberts")


def qa_files(world) -> dict[str, str]:
    q, a = world.vqa("train")
    return dict(qa_vqa_questions=str(q), qa_vqa_annotations=str(a),
                qa_gqa_questions=str(world.root / "gqa" / "train_balanced_questions.json"))


def cfg_for(world, out: Path, **kw) -> PretrainConfig:
    base = dict(
        captions=str(world.captions_train), features=str(world.store), out=str(out), model="lxmert-tiny",
        vocab_size=200, steps=8, batch_size=8, lr=2e-3, log_every=1, ckpt_every=3, seed=3, **qa_files(world),
    )
    return PretrainConfig(**{**base, **kw})


def test_joint_answer_table_and_targets(tiny_world):
    files = qa_files(tiny_world)
    qa = read_pretrain_qa(files["qa_vqa_questions"], files["qa_vqa_annotations"], files["qa_gqa_questions"])
    vqa = read_vqa(files["qa_vqa_questions"], files["qa_vqa_annotations"])
    gqa = read_gqa(files["qa_gqa_questions"])
    assert len(qa.sentences) == len(qa.targets) == len(vqa) + len(gqa)
    assert [s.text for s in qa.sentences] == [e.question for e in vqa] + [e.question for e in gqa]
    # The table holds both sources' answers, most frequent first; every GQA answer is a class (min_count 1).
    assert {e.answer for e in gqa} <= set(qa.answers.answers)
    assert set(build_answer_vocab(vqa, 1).answers) <= set(qa.answers.answers)
    # A GQA question's target is its answer with score 1; a VQA question's, the official soft scores.
    g = qa.targets[len(vqa)]
    assert g.labels == (qa.answers.ans2idx[gqa[0].answer],) and g.scores == (1.0,)
    v = qa.targets[0]
    counts = {a: vqa[0].answers.count(a) for a in set(vqa[0].answers)}
    assert dict(zip((qa.answers.answers[i] for i in v.labels), v.scores)) == pytest.approx(
        {a: min(1.0, c * 0.3) if c < 3 else 1.0 for a, c in counts.items() if a in qa.answers})
    # A higher count threshold keeps fewer answers; questions whose answers all fell out have no label.
    strict = read_pretrain_qa(gqa_questions=files["qa_gqa_questions"], min_count=3)
    assert len(strict.answers) < len(qa.answers) and strict.labelled < len(strict.targets)
    with pytest.raises(VlbertsError, match="needs both the questions and the annotations"):
        read_pretrain_qa(vqa_questions=files["qa_vqa_questions"])


def test_question_examples_carry_answers_only_when_matched(tiny_world):
    files = qa_files(tiny_world)
    qa = read_pretrain_qa(gqa_questions=files["qa_gqa_questions"])
    tok = TextTokenizer.train([s.text for s in qa.sentences], vocab_size=200)
    caption = SoftTarget((), ())
    sentences = [qa.sentences[-1], *qa.sentences]  # an unlabelled sentence (a "caption") first, then questions
    targets = [caption, *qa.targets]
    data = CaptionPretrainData(sentences, RegionStore(tiny_world.store), tok, pairs=False, mismatch_prob=0.5,
                               seed=1, qa_targets=targets)
    seen = {"matched": 0, "mismatched": 0}
    for i in range(len(data)):
        ex = data[(0, i)]
        if i == 0 or ex["match"] != MATCH:  # captions and mismatched pairs: no label
            assert ex["qa_target"] == -1
            seen["mismatched"] += i > 0
        else:
            assert ex["qa_target"] in targets[i].labels
            seen["matched"] += 1
    assert seen["matched"] > 10 and seen["mismatched"] > 10


def test_lxmert_pretrains_image_qa_in_the_last_half_and_resumes_exactly(tiny_world, tmp_path):
    ref = pretrain(cfg_for(tiny_world, tmp_path / "ref", qa_last_fraction=0.5))
    log = MetricsLog.read(tmp_path / "ref" / "metrics.jsonl")
    assert [r["qa_loss"] > 0 for r in log] == [False] * 4 + [True] * 4  # LXMERT §3.3: the last half only
    meta = json.loads((ref / "config.json").read_text())
    answers = meta["qa_answers"]
    assert meta["config"]["num_qa_labels"] == len(answers) > 5 and "yes" in answers
    assert load_file(str(ref / "model.safetensors"))["answer_head.logit_fc.3.weight"].shape[0] == len(answers)

    run = tmp_path / "run"
    assert pretrain(cfg_for(tiny_world, run, qa_last_fraction=0.5, stop_after=5)) is None  # checkpoint at 3
    assert pretrain(cfg_for(tiny_world, run, qa_last_fraction=0.5)) == run / "model"
    want, got = load_file(str(ref / "model.safetensors")), load_file(str(run / "model" / "model.safetensors"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)

    # VQA fine-tuning starts from the QA head: hidden layers copied, the rows of shared answers copied.
    q, an = tiny_world.vqa("train")
    vocab = build_answer_vocab(read_vqa(q, an), 1)
    model, _ = build_vqa_model(ref, vocab)
    own = model.state_dict()
    shared = [a for a in vocab.answers if a in answers]
    assert shared and len(shared) < len(vocab) + len(answers)
    for answer in shared:
        row = want["answer_head.logit_fc.3.weight"][answers.index(answer)]
        assert torch.equal(own["classifier.logit_fc.3.weight"][vocab.ans2idx[answer]], row)
    assert torch.equal(own["classifier.logit_fc.0.weight"], want["answer_head.logit_fc.0.weight"])
    new = [i for i, answer in enumerate(vocab.answers) if answer not in answers]  # zero, as LXMERT leaves them
    assert all(not own["classifier.logit_fc.3.weight"][i].any() for i in new)


def test_each_fine_tuning_answer_starts_from_the_row_of_its_lxmert_form():
    """`copy_qa_head` is LXMERT's `load_lxmert_qa`: a fine-tuning answer reads the pre-training row of the answer
    as `AnswerTable.convert_ans` writes it ("two" -> "2", "the man" -> "man"); one the table lacks starts at zero
    (weights and bias); the hidden layers are copied."""
    from vlberts.models.builders import model_config
    from vlberts.recipes.finetune_qa import copy_qa_head, qa_model
    from vlberts.tasks.vqa import AnswerVocab

    cfg = model_config("lxmert-tiny", vocab_size=50, visual_dim=16)
    torch.manual_seed(0)
    pre = ("man", "2", "yes")
    sd = {"answer_head." + k[len("classifier."):]: v for k, v in qa_model(cfg, len(pre)).state_dict().items()
          if k.startswith("classifier.")}  # a classifier of the pre-training table's size stands for the head
    model = qa_model(cfg, 4)
    assert copy_qa_head(model, sd, pre, AnswerVocab(("two", "yes", "cat", "the man"))) == 3
    got = model.state_dict()
    for dst, src in ((0, 1), (1, 2), (3, 0)):
        for part in ("weight", "bias"):
            assert torch.equal(got[f"classifier.logit_fc.3.{part}"][dst], sd[f"answer_head.logit_fc.3.{part}"][src])
    assert not got["classifier.logit_fc.3.weight"][2].any() and got["classifier.logit_fc.3.bias"][2] == 0
    assert torch.equal(got["classifier.logit_fc.0.weight"], sd["answer_head.logit_fc.0.weight"])
    assert copy_qa_head(model, sd, pre[:2], AnswerVocab(("two", "yes", "cat", "the man"))) == 0  # 2 names, 3 rows


def test_image_qa_needs_lxmert_and_questions(tiny_world, tmp_path):
    with pytest.raises(VlbertsError, match="LXMERT's objective"):
        pretrain(cfg_for(tiny_world, tmp_path / "v", model="visualbert-tiny"))
    with pytest.raises(VlbertsError, match="objective qa needs questions"):
        pretrain(cfg_for(tiny_world, tmp_path / "l", objectives="mlm=1,qa=1", qa_vqa_questions="",
                         qa_vqa_annotations="", qa_gqa_questions=""))
    # Through the CLI: a one-line error, exit code 2.
    proc = subprocess.run(
        [str(VLBERTS), "pretrain", "--model=vilbert-tiny", f"--captions={tiny_world.captions_train}",
         f"--features={tiny_world.store}", f"--out={tmp_path / 'cli'}",
         f"--qa_gqa_questions={qa_files(tiny_world)['qa_gqa_questions']}"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2 and "vilbert has no answer head" in proc.stderr and "Traceback" not in proc.stderr


def test_a_question_whose_image_is_not_in_the_store_names_its_file(tiny_world, tmp_path):
    gqa = json.loads(Path(qa_files(tiny_world)["qa_gqa_questions"]).read_text())
    qid = next(iter(gqa))
    gqa[qid]["imageId"] = "99999"
    bad = tmp_path / "gqa.json"
    bad.write_text(json.dumps(gqa))
    with pytest.raises(VlbertsError) as err:
        pretrain(cfg_for(tiny_world, tmp_path / "run", qa_gqa_questions=str(bad)))
    assert str(err.value) == (f"{tiny_world.store}: record 99999: image id 99999 of {bad} not in store "
                              "(1 sentences of that file affected)")


def test_lxmert_without_questions_has_no_qa_head(tiny_world, tmp_path):
    out = pretrain(cfg_for(tiny_world, tmp_path / "noqa", qa_vqa_questions="", qa_vqa_annotations="",
                           qa_gqa_questions="", steps=2))
    meta = json.loads((out / "config.json").read_text())
    assert meta["config"]["num_qa_labels"] == 0 and "qa_answers" not in meta
    assert not any(k.startswith("answer_head.") for k in load_file(str(out / "model.safetensors")))
    assert np.isfinite([r["loss"] for r in MetricsLog.read(tmp_path / "noqa" / "metrics.jsonl")]).all()
