"""Plain inference with a fine-tuned VQA or GQA model (SPEC §9: "hard to run ... for plain inference").

    vlberts predict vqa --model=RUN/model --questions=Q.json --features=F.h5 --out=DIR

answers every question of a questions file, with or without its answers (VQA's test-dev and test-std
have none), and writes

    DIR/predictions.json   the task's official results format: VQA [{question_id, answer}] (EvalAI's),
                           GQA [{questionId, prediction}]
    DIR/predict.json       what was read: the model, the questions, how many were answered, skipped records
    DIR/run_config.json    every setting as given, defaults included (written before the predictions)

with the same layout of the question, answer head and prediction code (`finetune_qa.predict_qa`) as the
predictions a fine-tuning run writes for its evaluation questions, so the two agree question for question
(tests/test_predict_qa.py). Scoring stays one mechanism: `vlberts evaluate vqa|gqa` on the predictions.
The question length and regions per image default to the fine-tuning run's own (RUN/run_config.json
beside RUN/model), else 32 and 36.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from vlberts.config import apply_overrides, from_dict
from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import write_json
from vlberts.recipes.common import (PredictConfig, fine_tuning_setting, opt, predict_text_len, prediction_store,
                                    start_prediction, start_recipe, write_run_config)
from vlberts.recipes.finetune_gqa import GQA
from vlberts.recipes.finetune_qa import QATask, examples_with_features, load_qa_model, predict_qa
from vlberts.recipes.finetune_vqa import VQA
from vlberts.training.distributed import barrier

TASKS: dict[str, QATask] = {"vqa": VQA, "gqa": GQA}


@dataclass(frozen=True)
class PredictQAConfig(PredictConfig):
    model: str = opt("", "fine-tuned model directory (a `vlberts finetune vqa|gqa` run's RUN/model)")
    questions: str = opt("", "questions json to answer (VQA v2 or GQA format; answers not needed)")
    features: str = opt("", "region store holding every question's image")
    out: str = opt("runs/predict", "directory for predictions.json and predict.json")
    max_text_len: int = opt(0, "question tokens (0: the fine-tuning run's, from RUN/run_config.json; else 32)")
    max_regions: int = opt(0, "regions per image (0: the fine-tuning run's; else 36)")
    batch_size: int = opt(256, "questions per prediction batch")
    skip_bad: bool = opt(False, "drop malformed questions and questions whose image is not in the store, counting "
                                "them in predict.json, instead of stopping at the first")


CONFIG_CLASS = PredictQAConfig


def predict_file(cfg: PredictQAConfig, task: str) -> Path:
    """Answer every question of `cfg.questions` with the fine-tuned model; returns OUT/predictions.json."""
    if task not in TASKS:
        raise VlbertsError(f"unknown task {task!r}; valid: {', '.join(TASKS)}")
    for key in ("model", "questions", "features"):
        if not getattr(cfg, key):
            raise VlbertsError(f"predict {task} needs --{key}")
    cfg = start_recipe(cfg)
    device, dist = start_prediction(cfg)
    qa = TASKS[task]
    model_dir, out = Path(cfg.model), Path(cfg.out)
    model, vocab, tok = load_qa_model(model_dir, qa.name)
    bad = BadRecords(skip=cfg.skip_bad)
    examples = qa.read_questions(cfg.questions, bad)
    store, mismatch = prediction_store(cfg, cfg.features, {model_dir: model})
    examples = examples_with_features(examples, cfg.questions, store, cfg.features, bad)
    if bad.total and dist.main:
        print(bad.warning(), file=sys.stderr)
    if not examples:
        raise VlbertsError("no question to answer", path=cfg.questions)
    max_text_len = predict_text_len(cfg.max_text_len, model.cfg, model_dir, 32)
    max_regions = cfg.max_regions or fine_tuning_setting(model_dir, "max_regions", 36)
    if dist.main:
        write_run_config(out, cfg)
    preds = predict_qa(model, vocab, tok, examples, store, max_regions=max_regions, max_text_len=max_text_len,
                       batch_size=cfg.batch_size, device=device, precision=cfg.precision, dist=dist)
    path = out / "predictions.json"
    if dist.main:  # every rank holds every prediction; one writes
        out.mkdir(parents=True, exist_ok=True)
        qa.write_predictions(path, ((ex.question_id, preds[ex.question_id]) for ex in examples))
        write_json(out / "predict.json", {
            "task": qa.name, "model": str(model_dir), "questions": str(cfg.questions), "features": str(cfg.features),
            "answered": len(examples), "answer_classes": len(vocab), "max_text_len": max_text_len,
            "max_regions": max_regions, "skipped_records": bad.to_dict(), "feature_mismatch": mismatch,
            "ranks": dist.world,
        })
    barrier(dist)
    return path


def config_from_args(args: list[str], base: dict | None = None) -> PredictQAConfig:
    return apply_overrides(from_dict(PredictQAConfig, base or {}), args)
