"""Recipe: fine-tune any architecture on VQA v2 in its paper's form (SPEC §4) and predict.

The shared answer-classifier fine-tuning (`recipes.finetune_qa`: the head of each architecture, the
loss, the loop, prediction) with VQA's part of it (`VQA`): training reads VQA v2 questions +
annotations (or a file that holds both: a Pythia / MMF imdb `.npy`, VisualBERT's and VL-BERT's form,
or LXMERT's question list) and a region store; the answer vocabulary is built from the training answers (answers
given by at least `min_answer_count` questions; 9 over train+val gives VQA v2's 3,129), or read from a
fixed table (`answer_vocab`, e.g. LXMERT's trainval_ans2label.json); targets are the VQA soft
scores; after training the model predicts the evaluation questions, writes them in the official
results format, and scores them with the official VQA accuracy next to the majority-answer baseline.

    RUN/model/             the fine-tuned model (weights, config with the answer list, vocabulary)
    RUN/predictions.json   official-format predictions on the evaluation questions
    RUN/metrics.json       accuracy (percent), per answer type, majority baseline
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlberts.config import apply_overrides, from_dict
from vlberts.errors import BadRecords, VlbertsError
from vlberts.data.vqa import VQAExample, holds_answers, is_target_pickle, read_vqa, warn_unless_pickled_table
from vlberts.data.vqa_dataset import vqa_soft_target
from vlberts.recipes.common import opt
from vlberts.recipes.finetune_qa import (  # noqa: F401 -- re-exported: VQA's names for the shared pieces
    LOSSES,
    VQA_MODELS,
    FinetuneQAConfig,
    QATask,
    VQAModel,
    build_qa_model,
    file_list,
    finetune_qa,
    join_files,
    load_qa_model,
    predict_qa,
    qa_data,
    qa_model,
)
from vlberts.tasks.vqa import (
    AnswerVocab,
    build_answer_vocab,
    majority_baseline,
    score_predictions,
    write_predictions,
)
from vlberts.text.tokenizer import TextTokenizer


@dataclass(frozen=True)
class FinetuneVQAConfig(FinetuneQAConfig):
    train_questions: str = opt("", "VQA v2 questions json of the training split, or a file with questions and "
                                   "answers in one (no --train_annotations): a Pythia / MMF imdb .npy, LXMERT's "
                                   "question list; several: comma-separated (train2014 and val2014)")
    out: str = opt("runs/vqa", "run directory")
    min_answer_count: int = opt(9, "answers given by fewer training questions are not classes (9 over VQA v2 train+val "
                                        "gives the 3,129 of LXMERT and ViLBERT; over train alone fewer: for theirs, "
                                        "--answer_vocab=trainval_ans2label.json)")
    train_annotations: str = opt("", "VQA v2 annotations json of the training split (not for an imdb or LXMERT list), "
                                     "or ViLBERT's cache/train_target.pkl (with --answer_vocab=trainval_ans2label.pkl); "
                                     "several: comma-separated, one for each questions json, in order")
    eval_annotations: str = opt("", "annotations json (or ViLBERT's target.pkl) of the evaluation questions (optional; "
                                    "scores them)")


CONFIG_CLASS = FinetuneVQAConfig


def _read(cfg: FinetuneVQAConfig, bad: BadRecords,
          answers: tuple[str, ...] | None) -> tuple[list[VQAExample], list[VQAExample]]:
    if cfg.eval_annotations and not cfg.eval_questions:
        raise VlbertsError("--eval_annotations needs --eval_questions (the questions they answer)")
    questions, annotations = file_list(cfg.train_questions), iter(file_list(cfg.train_annotations))
    for q in (*questions, *file_list(cfg.eval_questions)):
        if is_target_pickle(q):  # (GQA's target pickles do hold the questions; VQA's do not)
            raise VlbertsError("ViLBERT's VQA target pickle holds answers, not question text: give it as the "
                               "annotations (--train_annotations / --eval_annotations) beside the VQA v2 questions "
                               "JSON of the same split", path=q)
    json_files = [q for q in questions if not holds_answers(q)]
    if json_files and not cfg.train_annotations:
        raise VlbertsError("--train_annotations is required with a VQA v2 questions JSON (a Pythia imdb .npy "
                           "or LXMERT's question list holds its answers)", path=json_files[0])
    if len(file_list(cfg.train_annotations)) != len(json_files):
        read_as = "; ".join(f"{q} reads as {'a list or imdb holding its answers' if holds_answers(q) else 'VQA v2 questions'}"
                            for q in questions)
        raise VlbertsError(f"--train_annotations names {len(file_list(cfg.train_annotations))} file(s) for "
                           f"{len(json_files)} VQA v2 questions JSON file(s): one each, in the same order (an imdb "
                           f".npy or LXMERT's list holds its answers and takes none; {read_as})",
                           path=cfg.train_annotations)
    table = _target_table(cfg, answers)
    parts = [(q, read_vqa(q, None if holds_answers(q) else next(annotations), bad, table)) for q in questions]
    for path, examples in parts:
        if examples and not examples[0].annotated:
            raise VlbertsError("the training questions have no answers (a test split's file?)", path=path)
    train = join_files(parts)
    return train, read_vqa(cfg.eval_questions, cfg.eval_annotations or None, bad, table) if cfg.eval_questions else []


def _target_table(cfg: FinetuneVQAConfig, answers: tuple[str, ...] | None) -> tuple[str, ...] | None:
    """The answers of --answer_vocab (`answers`) when an annotations file is ViLBERT's target pickle (its labels
    are indices into that table, trainval_ans2label.pkl), else None."""
    pickles = [a for a in file_list(cfg.train_annotations) + file_list(cfg.eval_annotations) if is_target_pickle(a)]
    if not pickles:
        return None
    if answers is None:
        raise VlbertsError("ViLBERT's target pickle names answers by their index in the answer table it was made "
                           "with: give that table (trainval_ans2label.pkl) as --answer_vocab", path=pickles[0])
    warn_unless_pickled_table(cfg.answer_vocab, pickles[0])
    return answers


def _metrics(preds: dict[int, str], eval_examples: list[VQAExample], train: list[VQAExample]) -> dict:
    baseline = majority_baseline(train, eval_examples)
    return {**score_predictions(preds, eval_examples).to_dict(), "majority_baseline": baseline.accuracy,
            "majority_baseline_per_answer_type": baseline.per_answer_type}


VQA = QATask(
    name="vqa", required=("train_questions",), answers_field="train_annotations", read=_read,
    read_questions=lambda path, bad: read_vqa(path, None, bad), answer_vocab=build_answer_vocab, target=vqa_soft_target, metrics=_metrics, write_predictions=write_predictions,
)


def finetune_vqa(cfg: FinetuneVQAConfig) -> Path | None:
    """Fine-tune on VQA v2, then predict and score the evaluation questions; returns the model directory
    (None when stopped early by `stop_after`). Distributed under torchrun (`finetune_qa`)."""
    return finetune_qa(cfg, VQA)


def vqa_model(model_cfg: Any, num_answers: int) -> VQAModel:
    """The VQA model of the config's architecture, freshly initialised."""
    return qa_model(model_cfg, num_answers)


def build_vqa_model(init: str | Path, vocab: AnswerVocab) -> tuple[VQAModel, Any]:
    """A VQA model whose encoder comes from a pre-trained model directory; the classifier is new (except
    LXMERT's rows of answers its pre-training QA head knows: `copy_qa_head`)."""
    model, model_cfg, _ = build_qa_model(init, vocab)
    return model, model_cfg


def load_vqa_model(directory: str | Path) -> tuple[VQAModel, AnswerVocab, TextTokenizer]:
    """Load a fine-tuned VQA model directory written by this recipe (any architecture)."""
    return load_qa_model(directory, "vqa")


# VQA's examples laid out for a model, and its predictions: the shared functions (VQA targets by default).
vqa_data = qa_data
predict_vqa = predict_qa


def config_from_args(args: list[str], base: dict | None = None) -> FinetuneVQAConfig:
    return apply_overrides(from_dict(FinetuneVQAConfig, base or {}), args)
