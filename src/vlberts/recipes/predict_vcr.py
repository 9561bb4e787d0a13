"""Plain inference on VCR with a fine-tuned Q->A and a fine-tuned QA->R model: the leaderboard's submission.

    vlberts predict vcr --qa_model=RUN_QA/model --qar_model=RUN_QAR/model --questions=WORLD/vcr/test.jsonl
        --features=F.h5 --out=DIR

VCR's test file has no labels, so the rationale model cannot be given the right answer: the leaderboard
asks for the rationales scored with *each* of the 4 answers as the context (16 scores a question) and
reads the row of the gold answer itself (r2c's "Submitting to the leaderboard"; `tasks.vcr`). This
recipe runs the Q->A model once and the QA->R model 4 times, answer k appended to the question in run k
(`data.vcr.rationale_context` on the record with answer k), and writes

    DIR/submission.csv   the leaderboard CSV: annot_id, answer_0..3, rationale_conditioned_on_a{k}_{j}
                         (softmax probabilities over each question's 4 choices)
    DIR/predict.json     what was read: the two models, the questions, how many were predicted, skipped records
    DIR/run_config.json  every setting as given, defaults included (written before the predictions)

Each model lays out its inputs as its fine-tuning run did (`finetune_vcr.vcr_data`: the rendering of
object references, VisualBERT's word-region alignment, the object regions rule from the model's
config.json, the subword budget from the run's run_config.json), so on a labelled file the rationales
conditioned on the gold answer equal the QA->R run's own predictions.json (tests/test_predict_vcr.py).
`vlberts evaluate vcr --submission=DIR/submission.csv --annotations=val.jsonl` scores a submission on a
labelled file as the leaderboard does.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from vlberts.config import apply_overrides, from_dict
from vlberts.data.vcr import NUM_CHOICES
from vlberts.errors import BadRecords, VlbertsError
from vlberts.io import write_json
from vlberts.recipes.common import (PredictConfig, opt, predict_text_len, prediction_store, start_prediction, start_recipe,
                                    write_run_config)
from vlberts.recipes.finetune_vcr import load_vcr_model, predict_vcr, read_vcr_file, usable_examples, vcr_data
from vlberts.tasks.vcr import SubmissionRow, write_submission
from vlberts.training.distributed import barrier


@dataclass(frozen=True)
class PredictVCRConfig(PredictConfig):
    qa_model: str = opt("", "fine-tuned Q->A model directory (a `vlberts finetune vcr --mode=qa` run's RUN/model)")
    qar_model: str = opt("", "fine-tuned QA->R model directory (a `vlberts finetune vcr --mode=qar` run's RUN/model)")
    questions: str = opt("", "VCR jsonl to predict (labels not needed: test.jsonl)")
    features: str = opt("", "region store holding every question's image")
    metadata_dir: str = opt("", "folder of the records' metadata_fn files (default: metadata/ next to --questions)")
    out: str = opt("runs/predict_vcr", "directory for submission.csv and predict.json")
    max_text_len: int = opt(0, "subwords per sequence (0: each fine-tuning run's, from RUN/run_config.json; else 80)")
    batch_size: int = opt(64, "questions per prediction batch (x4 sequences)")
    skip_bad: bool = opt(False, "drop malformed records and questions whose image is not in the store or whose "
                                "objects have no boxes, counting them in predict.json, instead of stopping at the first")


CONFIG_CLASS = PredictVCRConfig


def _load(directory: str, mode: str, flag: str):
    """(model, config.json, tokenizer) of a VCR run of `mode`; the other mode's model is a one-line error."""
    model, meta, tok = load_vcr_model(directory)
    if meta.get("mode") != mode:
        raise VlbertsError(f"--{flag} must be a `vlberts finetune vcr --mode={mode}` model, this one was fine-tuned "
                           f"with --mode={meta.get('mode')}", path=directory)
    return model, meta, tok


def predict_file(cfg: PredictVCRConfig) -> Path:
    """Score every question of `cfg.questions` with both models; returns OUT/submission.csv."""
    for key in ("qa_model", "qar_model", "questions", "features"):
        if not getattr(cfg, key):
            raise VlbertsError(f"predict vcr needs --{key}")
    cfg = start_recipe(cfg)
    device, dist = start_prediction(cfg)
    runs = {"qa": _load(cfg.qa_model, "qa", "qa_model"), "qar": _load(cfg.qar_model, "qar", "qar_model")}
    store, mismatch = prediction_store(cfg, cfg.features, {cfg.qa_model: runs["qa"][0], cfg.qar_model: runs["qar"][0]})

    # The questions both models can see (each reads the objects' regions by its own rule).
    metadata_dir = Path(cfg.metadata_dir) if cfg.metadata_dir else Path(cfg.questions).parent / "metadata"
    bad = BadRecords(skip=cfg.skip_bad)
    examples = read_vcr_file(cfg.questions, bad, require_labels=False)
    for rule in sorted({meta["object_regions"] for _, meta, _ in runs.values()}):
        examples = usable_examples(examples, cfg.questions, store, cfg.features, rule, metadata_dir, bad)
    if bad.total and dist.main:
        print(bad.warning(), file=sys.stderr)
    if not examples:
        raise VlbertsError("no question to predict", path=cfg.questions)
    if dist.main:
        write_run_config(cfg.out, cfg)

    def scores(mode: str, questions: list) -> dict[str, list[float]]:
        model, meta, tok = runs[mode]
        model_dir = cfg.qa_model if mode == "qa" else cfg.qar_model
        data = vcr_data(model, questions, mode, store, tok, metadata_dir=metadata_dir,
                        max_text_len=predict_text_len(cfg.max_text_len, model.cfg, model_dir, 80),
                        object_regions=meta["object_regions"])
        return predict_vcr(model, data, batch_size=cfg.batch_size, device=device, precision=cfg.precision, dist=dist)

    answers = scores("qa", examples)
    # QA->R with answer k as the context, for every k (the leaderboard's rationale_conditioned_on_a{k})
    rationales = [scores("qar", [dataclasses.replace(ex, answer_label=k) for ex in examples])
                  for k in range(NUM_CHOICES)]
    out = Path(cfg.out)
    path = out / "submission.csv"
    if dist.main:  # every rank holds every score; one writes
        out.mkdir(parents=True, exist_ok=True)
        write_submission(path, ((ex.annot_id, SubmissionRow(tuple(answers[ex.annot_id]),
                                                            tuple(tuple(r[ex.annot_id]) for r in rationales)))
                                for ex in examples))
        write_json(out / "predict.json", {
            "task": "vcr", "qa_model": cfg.qa_model, "qar_model": cfg.qar_model, "questions": cfg.questions,
            "features": cfg.features, "predicted": len(examples), "skipped_records": bad.to_dict(),
            "feature_mismatch": mismatch, "ranks": dist.world,
        })
    barrier(dist)
    return path


def config_from_args(args: list[str], base: dict | None = None) -> PredictVCRConfig:
    return apply_overrides(from_dict(PredictVCRConfig, base or {}), args)
