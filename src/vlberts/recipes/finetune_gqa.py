"""Recipe: fine-tune any architecture on GQA (SPEC §4) and predict.

GQA is fine-tuned as an answer classifier over the training answers, exactly like VQA (LXMERT §4,
``src/tasks/gqa.py``; the VisualBERT-family follow-ups), so this recipe is the shared fine-tuning of
`recipes.finetune_qa` (each architecture's answer head and paper loss, the loop, prediction) with GQA's
part (`GQA`): balanced questions files (`data.gqa.read_gqa`; the answers are in the questions file),
classes = the normalised training answers given by at least `min_answer_count` questions (1: every
answer, as LXMERT), target = LXMERT's one-hot ``{answer: 1.0}``, metric = exact-match accuracy per
structural type next to the majority-answer baseline, predictions in GQA's official results format.

    vlberts finetune gqa --init=runs/pt/model --features=F.h5 --out=runs/gqa
        --train_questions=WORLD/gqa/train_balanced_questions.json
        --eval_questions=WORLD/gqa/testdev_balanced_questions.json

    RUN/model/             the fine-tuned model (weights, config with task "gqa" and the answer list, vocabulary)
    RUN/predictions.json   [{"questionId", "prediction"}] on the evaluation questions
    RUN/metrics.json       accuracy (percent), per structural type, majority baseline, counts; questions whose
                           answer is not a class (always wrong) in eval_questions_without_target
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlberts.config import apply_overrides, from_dict
from vlberts.errors import BadRecords
from vlberts.data.gqa import GQAExample, read_gqa
from vlberts.data.vqa import is_target_pickle, warn_unless_pickled_table
from vlberts.recipes.common import opt
from vlberts.recipes.finetune_qa import (
    FinetuneQAConfig, QATask, VQAModel, file_list, finetune_qa, join_files, load_qa_model,
)
from vlberts.tasks.gqa import build_answer_vocab, gqa_metrics, gqa_target, write_predictions
from vlberts.tasks.vqa import AnswerVocab
from vlberts.text.tokenizer import TextTokenizer


@dataclass(frozen=True)
class FinetuneGQAConfig(FinetuneQAConfig):
    train_questions: str = opt("", "GQA balanced questions json of the training split (with answers), LXMERT's list "
                                   "or ViLBERT's cache/train_target.pkl (with --answer_vocab=trainval_ans2label.pkl); "
                                   "several: comma-separated (LXMERT: train and val)")
    eval_questions: str = opt("", "GQA questions json to predict (and score, when it has answers) after training")
    out: str = opt("runs/gqa", "run directory")
    min_answer_count: int = opt(1, "answers given by fewer training questions are not classes (1: all, as LXMERT)")


CONFIG_CLASS = FinetuneGQAConfig


def _read(cfg: FinetuneGQAConfig, bad: BadRecords,
          answers: tuple[str, ...] | None) -> tuple[list[GQAExample], list[GQAExample]]:
    # ViLBERT's target pickles name their answers through --answer_vocab (its cache/trainval_ans2label.pkl)
    files = file_list(cfg.train_questions) + file_list(cfg.eval_questions)
    pickles = [f for f in files if is_target_pickle(f)]
    table = answers if pickles else None
    if pickles and cfg.answer_vocab:
        warn_unless_pickled_table(cfg.answer_vocab, pickles[0])
    train = join_files((q, read_gqa(q, require_answers=True, bad=bad, answers=table))
                       for q in file_list(cfg.train_questions))
    return train, read_gqa(cfg.eval_questions, bad=bad, answers=table) if cfg.eval_questions else []


GQA = QATask(
    name="gqa", required=("train_questions",), answers_field="train_questions", read=_read,
    read_questions=lambda path, bad: read_gqa(path, bad=bad), answer_vocab=build_answer_vocab, target=gqa_target, metrics=gqa_metrics, write_predictions=write_predictions,
)


def finetune_gqa(cfg: FinetuneGQAConfig) -> Path | None:
    """Fine-tune on GQA, then predict and score the evaluation questions; returns the model directory
    (None when stopped early by `stop_after`). Distributed under torchrun (`finetune_qa`)."""
    return finetune_qa(cfg, GQA)


def load_gqa_model(directory: str | Path) -> tuple[VQAModel, AnswerVocab, TextTokenizer]:
    """Load a model directory fine-tuned by this recipe (any architecture)."""
    return load_qa_model(directory, "gqa")


def config_from_args(args: list[str], base: dict | None = None) -> FinetuneGQAConfig:
    return apply_overrides(from_dict(FinetuneGQAConfig, base or {}), args)
