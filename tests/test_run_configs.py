"""Every command that does not train records its settings as training runs do (SPEC §6, "the resolved config
saved with every run"): `vlberts analyze ...`, `vlberts predict TASK` and `vlberts evaluate TASK` write
OUT/run_config.json, every setting with its value (defaults included, paths as given), before their long work.
An evaluate command without a config dataclass records its options by their command-line names (`evaluate vcr`
and `evaluate nlvr2` print their scores, and write them and the record only with `--out`). Another command run on the same OUT replaces the record; a training run's own
record (beside its model/) is never replaced."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_finetune_vqa import vqa_cfg
from test_flickr_entities_task import R0, R1, R2, R4, _entities_dir, _row
from test_nlvr2_task import nlvr2_cfg, nlvr2_file, run_cli
from test_refcoco_task import _fixture as refcoco_fixture
from test_vcr_task import vcr_cfg

from vlberts.config import to_dict
from vlberts.errors import VlbertsError
from vlberts.recipes import analyze_attention_graphs, analyze_grounding, analyze_representations
from vlberts.recipes import predict_nlvr2, predict_qa, predict_vcr
from vlberts.recipes.finetune_nlvr2 import finetune_nlvr2
from vlberts.recipes.finetune_retrieval import EvaluateRetrievalConfig
from vlberts.recipes.finetune_vcr import finetune_vcr
from vlberts.recipes.finetune_vqa import finetune_vqa


def recorded(out: Path) -> dict:
    return json.loads((out / "run_config.json").read_text())


def test_analyses_record_every_setting(tiny_world, tiny_pretrained, tmp_path, capsys):
    common = [f"--model={tiny_pretrained}", f"--entities={tiny_world.entities}", f"--features={tiny_world.store}",
              "--device=cpu", "--max_regions=10", "--batch_size=7", "--max_text_len=40"]
    for name, recipe, extra in (
        ("grounding", analyze_grounding, ["--max_images=4", "--explorer_examples=0", "--qualitative=0",
                                          "--mask_pos=ADJ"]),
        ("attention-graphs", analyze_attention_graphs, ["--split=val", "--max_images=4", "--figures=0"]),
        ("representations", analyze_representations, ["--split=train", "--max_images=12", "--per_class=5",
                                                      "--iterations=50"]),
    ):
        args = [*common, *extra, f"--out={tmp_path / name}"]
        code, _, err = run_cli(["analyze", name, *args], capsys)
        assert code == 0, err
        settings = recorded(tmp_path / name)
        assert settings == to_dict(recipe.config_from_args(args))  # every setting, defaults included
        assert (settings["max_regions"], settings["batch_size"], settings["max_text_len"]) == (10, 7, 40)
        assert settings["model"] == str(tiny_pretrained) and settings["out"] == str(tmp_path / name)
    assert recorded(tmp_path / "grounding")["mask_pos"] == "ADJ"
    assert recorded(tmp_path / "grounding")["precision"] == "fp32"  # a default the command line did not give


@pytest.fixture(scope="module")
def runs(tiny_world, tiny_pretrained, tmp_path_factory) -> dict[str, Path]:
    """The shortest fine-tuning runs that give a model directory of each task `vlberts predict` reads."""
    root = tmp_path_factory.mktemp("run_configs")
    short = dict(epochs=0.01, max_regions=8, ckpt_every=100, eval_questions="", eval_annotations="")
    finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, root / "vqa", **short))
    finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, root / "nlvr2", epochs=0.01, max_regions=8,
                             ckpt_every=100, eval_statements=""))
    for mode in ("qa", "qar"):
        finetune_vcr(vcr_cfg(tiny_world, tiny_pretrained, root / mode, mode=mode, epochs=0.01, eval_file=""))
    return {name: root / name for name in ("vqa", "nlvr2", "qa", "qar")}


def test_predictions_record_every_setting(tiny_world, runs, tmp_path, capsys):
    questions, _ = tiny_world.vqa("test")
    cases = {
        "vqa": (predict_qa, [f"--model={runs['vqa'] / 'model'}", f"--questions={questions}"]),
        "nlvr2": (predict_nlvr2, [f"--model={runs['nlvr2'] / 'model'}",
                                  f"--statements={nlvr2_file(tiny_world, 'test1')}",
                                  f"--image_map={tiny_world.root / 'nlvr2' / 'images.json'}", "--max_regions=6"]),
        "vcr": (predict_vcr, [f"--qa_model={runs['qa'] / 'model'}", f"--qar_model={runs['qar'] / 'model'}",
                              f"--questions={tiny_world.root / 'vcr' / 'val.jsonl'}"]),
    }
    for task, (recipe, extra) in cases.items():
        args = [*extra, f"--features={tiny_world.store}", "--device=cpu", "--batch_size=5", "--max_text_len=30",
                f"--out={tmp_path / task}"]
        code, _, err = run_cli(["predict", task, *args], capsys)
        assert code == 0, err
        settings = recorded(tmp_path / task)
        assert settings == to_dict(recipe.config_from_args(args))
        assert (settings["batch_size"], settings["max_text_len"], settings["precision"]) == (5, 30, "auto")
    assert recorded(tmp_path / "nlvr2")["max_regions"] == 6 and recorded(tmp_path / "vqa")["max_regions"] == 0

    # `vlberts evaluate` on the predictions, into the same folder (README's example): it records its own options.
    _, annotations = tiny_world.vqa("test")
    code, _, err = run_cli(["evaluate", "vqa", "--predictions", str(tmp_path / "vqa" / "predictions.json"),
                            "--questions", str(questions), "--annotations", str(annotations),
                            "--out", str(tmp_path / "vqa")], capsys)
    assert code == 0, err
    assert recorded(tmp_path / "vqa") == {"predictions": str(tmp_path / "vqa" / "predictions.json"),
                                          "questions": str(questions), "annotations": str(annotations),
                                          "answer_vocab": None, "eval_last": 0, "exclude_images": None,
                                          "out": str(tmp_path / "vqa")}

    # ... but never over a training run's record, which a resumed run and `vlberts predict` read
    before = (runs["vqa"] / "run_config.json").read_text()
    code, _, err = run_cli(["evaluate", "vqa", "--predictions", str(tmp_path / "vqa" / "predictions.json"),
                            "--questions", str(questions), "--annotations", str(annotations),
                            "--out", str(runs["vqa"])], capsys)
    assert code == 2 and "training run's directory" in err and err.count("\n") == 1
    assert (runs["vqa"] / "run_config.json").read_text() == before
    with pytest.raises(VlbertsError, match="training run's directory"):
        predict_qa.predict_file(predict_qa.PredictQAConfig(model=str(runs["vqa"] / "model"), questions=str(questions),
                                                           features=str(tiny_world.store), out=str(runs["vqa"]),
                                                           device="cpu"), "vqa")
    assert (runs["vqa"] / "run_config.json").read_text() == before


class Interrupted(Exception):
    pass


def _interrupt(*args, **kwargs):
    raise Interrupted


def test_a_run_stopped_in_its_long_work_has_recorded_its_settings(tiny_world, tiny_pretrained, runs, tmp_path,
                                                                  monkeypatch):
    """The record is written before the forward passes: a run interrupted there (here: at its first batch)
    still says how it was started."""
    from vlberts.recipes import finetune_retrieval

    test1 = nlvr2_file(tiny_world, "test1")
    data = dict(entities=str(tiny_world.entities), features=str(tiny_world.store), device="cpu", max_regions=9)
    questions, _ = tiny_world.vqa("test")
    cases = [
        (analyze_grounding, "grounding_inputs", analyze_grounding.analyze_grounding,
         analyze_grounding.GroundingConfig(model=str(tiny_pretrained), max_images=4, **data)),
        (analyze_representations, "collect", analyze_representations.analyze_representations,
         analyze_representations.RepresentationsConfig(model=str(tiny_pretrained), split="train", max_images=12,
                                                       **data)),
        (analyze_attention_graphs, "attention_batches", analyze_attention_graphs.analyze_attention_graphs,
         analyze_attention_graphs.AttentionGraphsConfig(model=str(tiny_pretrained), split="val", max_images=4, **data)),
        (predict_qa, "predict_qa", lambda cfg: predict_qa.predict_file(cfg, "vqa"),
         predict_qa.PredictQAConfig(model=str(runs["vqa"] / "model"), questions=str(questions),
                                    features=str(tiny_world.store), device="cpu", batch_size=3)),
        (predict_nlvr2, "predict_nlvr2", predict_nlvr2.predict_file,
         predict_nlvr2.PredictNLVR2Config(model=str(runs["nlvr2"] / "model"), statements=str(test1),
                                          image_map=str(tiny_world.root / "nlvr2" / "images.json"),
                                          features=str(tiny_world.store), device="cpu", batch_size=3)),
        (predict_vcr, "predict_vcr", predict_vcr.predict_file,
         predict_vcr.PredictVCRConfig(qa_model=str(runs["qa"] / "model"), qar_model=str(runs["qar"] / "model"),
                                      questions=str(tiny_world.root / "vcr" / "val.jsonl"),
                                      features=str(tiny_world.store), device="cpu", batch_size=3)),
        (finetune_retrieval, "rank_split", finetune_retrieval.evaluate_retrieval,
         EvaluateRetrievalConfig(init=str(tiny_pretrained), zero_shot=True, features=str(tiny_world.store),
                                 split_file=str(tiny_world.root / "dataset_world.json"), eval_images=3, max_regions=9,
                                 device="cpu")),
    ]
    for k, (module, long_work, run, cfg) in enumerate(cases):
        cfg = replace(cfg, out=str(tmp_path / str(k)))
        monkeypatch.setattr(module, long_work, _interrupt)
        with pytest.raises(Interrupted):
            run(cfg)
        assert recorded(tmp_path / str(k)) == to_dict(cfg), module.__name__


def test_evaluations_record_their_options(tiny_world, tmp_path, capsys):
    # GQA and NLVR2: every prediction the same answer
    gqa_questions = tiny_world.root / "gqa" / "testdev_balanced_questions.json"
    (tmp_path / "gqa.json").write_text(json.dumps([{"questionId": q, "prediction": "yes"}
                                                   for q in json.loads(gqa_questions.read_text())]))
    statements = nlvr2_file(tiny_world, "test1")
    (tmp_path / "nlvr2.csv").write_text("".join(f"{json.loads(x)['identifier']},True\n"
                                                for x in statements.read_text().splitlines() if x.strip()))
    # RefCOCO+ and Flickr30K Entities: the hand-made files of their own tests
    refs, instances = refcoco_fixture(tmp_path)
    (tmp_path / "refcoco.json").write_text(json.dumps([{"sent_id": s, "ref_id": r, "box": [0, 0, 10, 10]}
                                                       for s, r in ((100, 1), (101, 1), (102, 2), (200, 3), (201, 3))]))
    entities = _entities_dir(tmp_path)
    (tmp_path / "fe.json").write_text(json.dumps([_row(0, 11, 0, [R1, R0]), _row(0, 12, 3, [R2, R1]),
                                                  _row(2, 16, 0, [R4])]))
    # VCR: every choice's first score highest, for Q->A and QA->R alike
    vcr_val = tiny_world.root / "vcr" / "val.jsonl"
    first_choice = json.dumps({json.loads(x)["annot_id"]: [1.0, 0.0, 0.0, 0.0]
                               for x in vcr_val.read_text().splitlines() if x.strip()})
    (tmp_path / "vcr.json").write_text(first_choice)
    (tmp_path / "vcr_qar.json").write_text(first_choice)  # (one file as both would be refused)
    # retrieval: a saved score matrix re-scored
    (tmp_path / "s").mkdir()
    np.save(tmp_path / "s" / "scores.npy", np.eye(2, dtype=np.float32))
    (tmp_path / "s" / "score_index.json").write_text(json.dumps({"caption_image_ids": ["1", "2"],
                                                                 "image_ids": ["1", "2"]}))

    cases = {
        "gqa": ["--predictions", str(tmp_path / "gqa.json"), "--questions", str(gqa_questions)],
        "nlvr2": ["--predictions", str(tmp_path / "nlvr2.csv"), "--statements", str(statements)],
        "refcoco": ["--predictions", str(tmp_path / "refcoco.json"), "--refs", str(refs), "--instances", str(instances),
                    "--splits", "val"],
        "flickr_entities": ["--predictions", str(tmp_path / "fe.json"), "--entities", str(entities),
                            "--max_regions", "12", "--iou_rule", "union"],
        "retrieval": ["--scores", str(tmp_path / "s" / "scores.npy"), "--max_regions", "12", "--batch_size", "9"],
        "vcr": ["--annotations", str(vcr_val), "--qa", str(tmp_path / "vcr.json"), "--qar", str(tmp_path / "vcr_qar.json")],
    }
    for task, args in cases.items():
        out = tmp_path / f"eval_{task}"
        code, _, err = run_cli(["evaluate", task, *args, "--out", str(out)], capsys)
        assert code == 0, err
        assert (out / "metrics.json").is_file()
        settings = recorded(out)
        given = {k.lstrip("-"): v for k, v in zip(args[::2], args[1::2])}
        if task == "retrieval":  # its settings are EvaluateRetrievalConfig's, every one
            assert set(settings) == set(to_dict(EvaluateRetrievalConfig()))
            assert (settings["scores"], settings["max_regions"], settings["eval_batch_size"]) == (
                given["scores"], 12, 9)
            assert settings["precision"] == "auto" and settings["out"] == str(out)
            continue
        assert {k: settings[k] for k in given} == {k: int(v) if v.isdigit() else v for k, v in given.items()}
        assert settings["out"] == str(out)
    assert recorded(tmp_path / "eval_gqa")["train_questions"] is None  # an option not given: its default
    assert recorded(tmp_path / "eval_flickr_entities")["split"] == "test"

    # the same command again on the same OUT: its record is replaced, nothing is refused
    train = tiny_world.root / "gqa" / "train_balanced_questions.json"
    code, _, err = run_cli(["evaluate", "gqa", *cases["gqa"], "--out", str(tmp_path / "eval_gqa"),
                            "--train_questions", str(train)], capsys)
    assert code == 0, err
    assert recorded(tmp_path / "eval_gqa")["train_questions"] == str(train)
