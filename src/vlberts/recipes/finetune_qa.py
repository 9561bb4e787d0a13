"""Fine-tuning any architecture as an answer classifier, shared by the question-answering tasks (SPEC §4).

VQA v2 and GQA are fine-tuned the same way in every paper that reports them (LXMERT §4; VisualBERT,
ViLBERT and VL-BERT for VQA; the VisualBERT-family follow-ups for GQA): a classifier over the answers
seen in training, on the answer head of the pre-trained model's architecture (`VQA_MODELS`):
  visualbert   classifier on the [MASK] slot after the question (VisualBERT App. B.1)
  vlbert       2-layer MLP on the [MASK] answer slot, `[CLS] q [SEP] [MASK] [SEP]` (VL-BERT §4.2.2)
  vilbert      2-layer MLP on pool(h_IMG) * pool(h_CLS) (ViLBERT §3.2 VQA)
  lxmert       Linear(D,2D)-GeLU-LayerNorm-Linear(2D,A) on the pooled cross-modality output (LXMERT §3.1.3)
  wvisualbert  LXMERT's head on the pooled [CLS], detector tags in the input (its released code, §4.4)
with the question laid out for that head (`data.vqa_dataset.TEXT_FORMATS`) and the paper's loss (BCE x
number of answers, or VisualBERT's KL divergence).

What differs between the tasks is a `QATask`: how to read the training and evaluation examples, which
answers become classes, the target of one example (VQA's soft scores; GQA's one-hot `{answer: 1.0}`,
as LXMERT's GQA loader builds it), the official metric next to the majority-answer baseline, and the
official predictions format. `finetune_qa(cfg, task)` is the one training loop: data-parallel under
torchrun, checkpointed and exactly resumable, then predict + score. The task recipes
(`finetune_vqa`, `finetune_gqa`) hold a run config and a task description each.

    RUN/model/             the fine-tuned model (weights, config with the task and answer list, vocabulary)
    RUN/predictions.json   official-format predictions on the evaluation questions
    RUN/metrics.json       the task's metrics, the majority-answer baseline, counts
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from vlberts.data.lxmert_corpus import convert_answer
from vlberts.data.mirror import check_flip
from vlberts.data.regions import RegionSource
from vlberts.data.vqa_dataset import Target, VQAData, collate_vqa, model_tag_subwords
from vlberts.errors import BadRecords, VlbertsError
from vlberts.features.store import RegionStore
from vlberts.io import require_unique, write_json
from vlberts.models.builders import arch_of
from vlberts.models.lxmert import LxmertForVQA
from vlberts.models.vilbert import ViLBertForVQA
from vlberts.models.visualbert import VisualBertForVQA
from vlberts.models.vlbert import ANSWER_CLASSIFIERS, VLBertForVQA
from vlberts.models.weights import first_nonfinite, load_into, read_safetensors
from vlberts.models.wvisualbert import WVisualBertForVQA
from vlberts.recipes.common import FLIP_PROB_HELP, autocast, opt, progress, resolve_device, seed_everything
from vlberts.recipes.finetune_loop import (all_labelled, check_features, labelled_evaluation, open_features, require_eval_examples, require_train_examples, finetune_loop, FinetuneConfig, load_task_weights, num_updates,
                                           read_task_model, start_finetune)
from vlberts.tasks.predictions import excluded_images, last_questions, without_images
from vlberts.tasks.vqa import AnswerVocab, read_answer_vocab, vqa_bce_loss, vqa_kl_loss
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import read_model_config
from vlberts.training.distributed import DistInfo, barrier, merge_over_ranks

LOSSES = {"bce": vqa_bce_loss, "kl": vqa_kl_loss}


def check_loss(choice: str) -> None:
    """`--loss`: auto or one of `LOSSES`; anything else is a one-line error."""
    if choice != "auto" and choice not in LOSSES:
        raise VlbertsError(f"unknown loss {choice!r}; valid: auto, {', '.join(LOSSES)}")


VQAModel = VisualBertForVQA | ViLBertForVQA | VLBertForVQA | LxmertForVQA | WVisualBertForVQA

# architecture -> its answer-classifier model (the answer head of its paper; module docstring)
VQA_MODELS: dict[str, Callable[[Any, int], VQAModel]] = {
    "visualbert": VisualBertForVQA,
    "vilbert": ViLBertForVQA,
    "vlbert": VLBertForVQA,
    "lxmert": LxmertForVQA,
    "wvisualbert": WVisualBertForVQA,
}


@dataclass(frozen=True)
class FinetuneQAConfig(FinetuneConfig):
    """The settings every answer-classifier task shares (the loop's, `FinetuneConfig`, and these); each task
    recipe adds its files and defaults."""

    train_questions: str = opt("", "questions json of the training split (several: comma-separated, e.g. train and val)")
    eval_questions: str = opt("", "questions json to predict and score after training (optional)")
    out: str = opt("runs/qa", "run directory")
    min_answer_count: int = opt(1, "answers given by fewer training questions are not classes")
    answer_vocab: str = opt("", "a fixed answer table instead of the one counted from the training answers: a JSON "
                                "list of answers (class i = item i) or an {answer: index} object, e.g. LXMERT's "
                                "trainval_ans2label.json (VQA v2's 3,129, counted over train+val), or ViLBERT's "
                                "trainval_ans2label.pkl; min_answer_count is then unused")
    loss: str = opt("auto", "auto (the architecture's paper: kl for VisualBERT, bce for the others), bce (BCE x answers) or kl")
    max_text_len: int = opt(32, "question tokens incl. the layout's [CLS], [SEP] and [MASK] slot")
    max_regions: int = opt(36, "regions per image")
    eval_batch_size: int = opt(256, "examples per prediction batch")
    answer_classifier: str = opt("", "VL-BERT: its answer classifier on the [MASK] slot (the released CLASSIFIER_TYPE): "
                                     "2fc (two layers, the default), 1fc, or mlm (BERT's MLM transform started from "
                                     "the pre-trained MLM head's, then a linear layer: the released base VQA config's); "
                                     "empty: --init's")
    answer_word_init: str = opt("auto", "VL-BERT: start the answer classifier's output rows from each answer's mean "
                                        "subword embedding (the released CLASSIFIER_PRETRAINED): auto (with the mlm "
                                        "classifier, as the released base VQA config), true (1fc or mlm), false")
    flip_prob: float = opt(0.0, FLIP_PROB_HELP)
    qa_head_init: bool = opt(True, "start the classifier from the checkpoint's pre-training image-QA head where it has "
                                   "one (LXMERT's --loadLXMERTQA: hidden layers and the rows of shared answers)")
    eval_last: int = opt(0, "evaluate on the N evaluation questions with the largest question ids only, ordered as the "
                            "file stores them (numbers as numbers, strings as text: ViLBERT's minval, the last 3,000 of "
                            "val2014 or of GQA's trainval); 0: all of them")
    exclude_eval_questions: bool = opt(False, "drop the training questions that are also evaluation questions (VisualBERT's "
                                              "exclude_minival, ViLBERT's trainval minus minval); without it such an "
                                              "overlap is an error")
    exclude_images: str = opt("", "a list of image ids whose questions are left out of training and evaluation "
                                  "(ViLBERT's --clean_train_sets: cache/coco_test_ids.npy for VQA, genome_test_ids.npy "
                                  "for GQA; after --eval_last, as its minval): a .npy array or one id a line; a COCO "
                                  "file stem counts as its number")
    skip_bad: bool = opt(False, "drop malformed question/annotation records and questions whose image is not in "
                                "the store, counting them (a warning and metrics.json's skipped_records), "
                                "instead of stopping at the first")


@dataclass(frozen=True)
class QATask:
    """What one question-answering task adds to the shared fine-tuning (module docstring).

    Examples are the task reader's own type; the shared code reads only `question_id`, `image_id`,
    `question` and `annotated` from them."""

    name: str  # "vqa" | "gqa": the model directory's task, the progress label
    required: tuple[str, ...]  # run-config fields that must be set
    answers_field: str  # the run-config field naming the file with the training answers (for errors)
    # run config, bad-record policy, --answer_vocab's answers (None: not given) -> (train, eval examples)
    read: Callable[[Any, BadRecords, tuple[str, ...] | None], tuple[list, list]]
    read_questions: Callable[[str, BadRecords], list]  # a questions file, answers optional -> examples (to predict)
    answer_vocab: Callable[[Sequence, int], AnswerVocab]  # training examples, min_answer_count -> classes
    target: Target  # an annotated example, the classes -> its target scores
    metrics: Callable[[Mapping, Sequence, Sequence], dict]  # predictions, eval, train -> metric + baseline
    write_predictions: Callable[[Path, Iterable[tuple[Any, str]]], int]  # the official predictions file


def file_list(value: str) -> list[str]:
    """A setting naming one file or several, comma-separated (`--train_questions=train.json,val.json`)."""
    return [v for v in value.split(",") if v]


def join_files(parts: Iterable[tuple[str, list]]) -> list:
    """The examples of several files in the order given (each file's own order); a question id in two of
    them is an error naming both (the same file given twice, or two releases of one split)."""
    seen: dict[Any, tuple[int, str]] = {}  # question id -> (file number, its path)
    joined: list = []
    for i, (path, examples) in enumerate(parts):
        for ex in examples:
            j, first = seen.setdefault(ex.question_id, (i, path))
            if j != i:
                raise VlbertsError(f"question id {ex.question_id!r} is also in {first}", path=path)
        joined.extend(examples)
    return joined


def without_eval_questions(train: list, eval_examples: Sequence, exclude: bool, path: str) -> tuple[list, int]:
    """The training examples that are not evaluation questions (read from `path`), and how many were: a
    question in both would score what the model was trained on, so an overlap is an error unless `exclude`
    drops it from training (how VisualBERT trains on train+val minus minival, and ViLBERT on train plus val
    minus its last 3,000)."""
    held_out = {ex.question_id for ex in eval_examples}
    overlap = [ex.question_id for ex in train if ex.question_id in held_out]
    if overlap and not exclude:
        raise VlbertsError(f"{len(overlap)} of these evaluation questions are training questions too (the first: question "
                           f"id {overlap[0]!r}); --exclude_eval_questions drops them from training", path=path)
    return ([ex for ex in train if ex.question_id not in held_out] if overlap else train), len(overlap)


def qa_model(model_cfg: Any, num_answers: int) -> VQAModel:
    """The answer-classifier model of the config's architecture, freshly initialised."""
    return VQA_MODELS[arch_of(model_cfg)](model_cfg, num_answers)


def build_qa_model(init: str | Path, vocab: AnswerVocab, qa_head_init: bool = True,
                   answer_classifier: str = "") -> tuple[VQAModel, Any, int]:
    """An answer-classifier model whose encoder comes from a pre-trained model directory, and the number
    of answer classes whose classifier rows came from the checkpoint too (`copy_qa_head`; else 0: new).
    `answer_classifier`: VL-BERT's classifier type (`VLBertForVQA`), "" for the checkpoint's; the "mlm" one
    starts its transform from the checkpoint's MLM head.

    Every encoder weight must be in the checkpoint (and nothing else under the encoder's name); the
    other pre-training heads are left behind."""
    model_cfg, meta = read_model_config(init)
    model_cfg = with_answer_classifier(model_cfg, answer_classifier, init)
    model = qa_model(model_cfg, len(vocab))
    weights = Path(init) / "model.safetensors"
    sd = read_safetensors(weights)
    prefix = model.encoder_name + "."
    load_into(
        model, {k: v for k, v in sd.items() if k.startswith(prefix)}, source=weights,
        allow_missing=lambda k: k.startswith("classifier."),
    )
    bad = first_nonfinite(sd)  # the pre-training heads too: `copy_qa_head` may start from them
    if bad is not None:
        raise VlbertsError(f"tensor {bad} holds NaN or inf", path=weights)
    if getattr(model_cfg, "answer_classifier", "2fc") == "mlm" and not model.init_answer_transform(sd):
        raise VlbertsError("--answer_classifier=mlm starts from the pre-trained MLM head's transform "
                           "(cls.predictions.transform.*), which the checkpoint lacks", path=weights)
    return model, model_cfg, copy_qa_head(model, sd, meta.get("qa_answers", ()), vocab) if qa_head_init else 0


def with_answer_classifier(model_cfg: Any, answer_classifier: str, init: str | Path) -> Any:
    """The model config with VL-BERT's answer classifier set (`VLBertForVQA`); "" leaves it as --init's. Another
    architecture or an unknown type is a one-line error."""
    if not answer_classifier:
        return model_cfg
    if arch_of(model_cfg) != "vlbert":
        raise VlbertsError(f"--answer_classifier picks VL-BERT's answer classifier; --init holds a {arch_of(model_cfg)} "
                           "model, whose head its paper fixes", path=init)
    if answer_classifier not in ANSWER_CLASSIFIERS:
        raise VlbertsError(f"--answer_classifier must be one of {', '.join(ANSWER_CLASSIFIERS)}, got {answer_classifier!r}")
    return replace(model_cfg, answer_classifier=answer_classifier)


def uses_answer_word_init(setting: str, model_cfg: Any, init: str | Path) -> bool:
    """`--answer_word_init` resolved for the model config (`VLBertForVQA.init_answer_rows`): auto is on for
    VL-BERT's mlm classifier (the released base VQA config pairs it with CLASSIFIER_PRETRAINED); true on
    another architecture or on 2fc (whose output layer reads 2,048-wide states), or a value other than
    auto / true / false, is a one-line error."""
    if setting not in ("auto", "true", "false"):
        raise VlbertsError(f"--answer_word_init must be auto, true or false, got {setting!r}")
    arch = arch_of(model_cfg)
    if setting == "true" and arch != "vlbert":
        raise VlbertsError(f"--answer_word_init=true starts VL-BERT's answer classifier from word embeddings; --init holds "
                           f"a {arch} model", path=init)
    kind = getattr(model_cfg, "answer_classifier", None)
    if setting == "true" and kind == "2fc":
        raise VlbertsError("--answer_word_init=true needs --answer_classifier=1fc or mlm (2fc's output layer reads "
                           "2,048-wide states, not word embeddings)", path=init)
    return arch == "vlbert" and (setting == "true" or (setting == "auto" and kind == "mlm"))


def copy_qa_head(model: VQAModel, sd: Mapping[str, torch.Tensor], pretrain_answers: Sequence[str],
                 vocab: AnswerVocab) -> int:
    """LXMERT's `--loadLXMERTQA` (released `src/pretrain/qa_answer_table.py load_lxmert_qa`): a model whose
    pre-training image-QA head has the same shape as its answer classifier starts from it -- the hidden
    layers copied, and each answer's output row (weights and bias) from the pre-training table's row of the
    answer as LXMERT's `AnswerTable.convert_ans` writes it ("two" reads the row of "2", "the man" that of
    "man"); an answer the table lacks starts at zero, as there. Returns the number of rows copied (0 when the
    checkpoint has no QA head or answer names)."""
    head = {k[len("answer_head."):]: v for k, v in sd.items() if k.startswith("answer_head.")}
    mine = {k[len("classifier."):]: v for k, v in model.state_dict().items() if k.startswith("classifier.")}
    out_layer = "logit_fc.3."  # `AnswerMLP`'s output Linear(2D, A): one row per answer
    if (not head or len(pretrain_answers) != len(head.get(out_layer + "bias", ())) or head.keys() != mine.keys()
            or any(head[k].shape[1:] != v.shape[1:] or (head[k].shape != v.shape and not k.startswith(out_layer))
                   for k, v in mine.items())):
        return 0
    table = {a: i for i, a in enumerate(pretrain_answers)}
    shared = [(d, table[a]) for d, a in enumerate(map(convert_answer, vocab.answers)) if a in table]
    dst, src = [d for d, _ in shared], [s for _, s in shared]
    with torch.no_grad():
        for name, value in mine.items():  # state_dict tensors share the parameters' storage
            if name.startswith(out_layer):
                value.zero_()
                value[dst] = head[name][src]
            else:
                value.copy_(head[name])
    return len(shared)


def load_qa_model(directory: str | Path, task: str) -> tuple[VQAModel, AnswerVocab, TextTokenizer]:
    """Load a model directory fine-tuned on `task` ("vqa", "gqa") by `finetune_qa` (any architecture)."""
    model_cfg, meta = read_task_model(directory, task, task.upper())
    vocab = AnswerVocab(model_answers(meta, Path(directory) / "config.json"))
    return load_task_weights(lambda: qa_model(model_cfg, len(vocab)), directory), vocab, TextTokenizer.load(directory)


def model_answers(meta: Mapping[str, Any], path: Path) -> tuple[str, ...]:
    """The answer classes a fine-tuned model's config.json lists ("answers"): strings, each once. A null
    would be predicted as "None", and a duplicate makes two classes one answer. "" stays allowed: training
    writes it for answers that normalise to nothing ("a", "the")."""
    answers = meta.get("answers")
    if not isinstance(answers, list) or not answers:
        raise VlbertsError("\"answers\" must be a non-empty list of answer strings", path=path)
    first: dict[str, object] = {}  # answer -> where it first appears
    for k, a in enumerate(answers):
        if not isinstance(a, str):
            raise VlbertsError(f"answer must be a string, got {json.dumps(a)}", path=path, record=f"answers[{k}]")
        require_unique(first, a, f"answers[{k}]", what="answer", path=path)
    return tuple(answers)


def qa_data(
    model: VQAModel, examples: list, regions: RegionSource, tok: TextTokenizer, vocab: AnswerVocab,
    *, max_text_len: int, max_regions: int, target: Target | None = None, float16: bool = False,
    flip_prob: float = 0.0, seed: int = 0,
) -> VQAData:
    """The examples laid out for `model`'s head, with detector tags from the store if the model reads them;
    targets by `target` (default: VQA soft scores); float16 features kept so with `float16` (`open_features`);
    training items mirrored with `flip_prob` (`VQAData`)."""
    tags = model_tag_subwords(model.reads_tags, regions, tok)
    return VQAData(examples, regions, tok, vocab, max_text_len=max_text_len, max_regions=max_regions,
                   feature_dim=model.cfg.visual_dim, text_format=model.text_format, tag_subwords=tags, target=target,
                   float16=float16, flip_prob=flip_prob, seed=seed)


@torch.no_grad()
def predict_qa(
    model: VQAModel, vocab: AnswerVocab, tok: TextTokenizer, examples: list, regions: RegionSource,
    *, max_regions: int = 36, max_text_len: int = 32, batch_size: int = 256, device: str | torch.device = "auto",
    precision: str = "auto", dist: DistInfo = DistInfo(),
) -> dict:
    """question_id -> predicted answer (argmax over the answer classes), on every rank.

    Distributed, each rank predicts every world-th question and the shares are merged: each question is
    predicted exactly once (no padded duplicates to double-count)."""
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    model.to(dev).eval()
    mine = examples[dist.rank :: dist.world]
    no_targets: Target = lambda ex, vocab: None  # noqa: E731 -- predicting needs none
    data = qa_data(model, mine, regions, tok, vocab, max_text_len=max_text_len, max_regions=max_regions,
                   target=no_targets)
    preds: dict = {}
    with progress(disable=None if dist.main else True) as bar:  # rank 0's share stands for all
        task = bar.add_task("predict", total=len(data), info="")
        for start in range(0, len(data), batch_size):
            stop = min(start + batch_size, len(data))
            batch = collate_vqa([data[i] for i in range(start, stop)], len(vocab), tok.pad_id).to(dev)
            with autocast(dev, precision):
                logits = model.answer_logits(batch)
            for ex, a in zip(mine[start:stop], logits.argmax(-1).tolist()):  # rows are the examples in order
                preds[ex.question_id] = vocab.answers[a]
            bar.advance(task, stop - start)
    return merge_over_ranks(preds, dist)


def examples_with_features(examples: list, path: str, store: RegionStore, features: str, bad: BadRecords) -> list:
    """The examples whose image is in the store; a missing one is an error naming the store and the image,
    or, when skipping bad records, dropped and counted ("missing features")."""
    missing = [ex.image_id for ex in examples if ex.image_id not in store]
    for image_id in missing:
        bad.handle(VlbertsError(f"image id {image_id} of {path} not in store ({len(missing)} questions affected)",
                                path=features, record=image_id), "missing features")
    return [ex for ex in examples if ex.image_id in store] if missing else examples


def check_targets(train: list, targets: list, path: str, answer_vocab: str, classes: int, dist: DistInfo) -> None:
    """A training question none of whose answers is a class trains toward no answer (the papers' code keeps
    such questions). With a given table (`--answer_vocab`) a one-line warning counts them (a table made for
    other data shows here); with classes counted from the training answers they are the rare answers
    `--min_answer_count` leaves out, counted in metrics.json only. When no question has a target the run
    stops, as it would train on nothing."""
    without = [ex for ex, t in zip(train, targets) if t is not None and not t.labels]
    if not without:
        return
    source = f"the {classes} classes of --answer_vocab={answer_vocab}" if answer_vocab else f"the {classes} classes"
    first = without[0]
    answers = sorted(set(first.answers if hasattr(first, "answers") else [first.answer]))[:3]  # VQA's ten, GQA's one
    if len(without) == len(train):
        raise VlbertsError(f"no training question has an answer among {source} (question {first.question_id}: "
                           f"{', '.join(map(repr, answers))})", path=path)
    if answer_vocab and dist.main:
        print(f"warning: {path}: {len(without)} of {len(train)} training questions have no answer among {source} "
              f"(first: question {first.question_id}); they train toward no answer (metrics.json: "
              f"train_questions_without_target)", file=sys.stderr)


def finetune_qa(cfg: FinetuneQAConfig, task: QATask) -> Path | None:
    """Fine-tune on `task`, then predict and score the evaluation questions; returns the model directory.

    Launched by torchrun it trains data-parallel like `pretrain` (each rank a slice of every global
    batch, its loss weighted by its share of the update, gradients summed, rank 0 writes) and the ranks
    share the prediction of the evaluation set."""
    cfg, out, device, dist = start_finetune(cfg, task.name, ("init", *task.required, "features"))
    check_loss(cfg.loss)
    # Settings checked before any data is read:
    init_cfg = with_answer_classifier(read_model_config(cfg.init)[0], cfg.answer_classifier, cfg.init)
    word_init = uses_answer_word_init(cfg.answer_word_init, init_cfg, cfg.init)
    check_flip(cfg.flip_prob, cfg.init)
    excluded = excluded_images(cfg.exclude_images)
    if cfg.eval_last < 0 or (cfg.eval_last and not cfg.eval_questions):
        raise VlbertsError(f"--eval_last=N keeps the last N of --eval_questions (N >= 0), got {cfg.eval_last}"
                           + ("" if cfg.eval_questions else " and no --eval_questions"))

    bad = BadRecords(skip=cfg.skip_bad)
    table = read_answer_vocab(cfg.answer_vocab) if cfg.answer_vocab else None  # read once: classes, target pickles
    train, eval_examples = task.read(cfg, bad, table.answers if table is not None else None)
    eval_examples = last_questions(eval_examples, cfg.eval_last)  # (ViLBERT's minval)
    train, in_eval = without_eval_questions(train, eval_examples, cfg.exclude_eval_questions, cfg.eval_questions)
    train, on_excluded = without_images(train, excluded)
    eval_examples, eval_on_excluded = without_images(eval_examples, excluded)  # (after --eval_last, as ViLBERT's minval)
    removed = [f"{n} on the images of --exclude_images" for n in (on_excluded,) if n]
    removed += [f"{n} also evaluation questions (--exclude_eval_questions)" for n in (in_eval,) if n]
    require_train_examples(train, cfg.train_questions, "dropped: " + ", ".join(removed) if removed else "")
    vocab = table if table is not None else task.answer_vocab(train, cfg.min_answer_count)
    if not len(vocab):
        raise VlbertsError(f"no answer is given by {cfg.min_answer_count}+ training questions",
                           path=getattr(cfg, task.answers_field) or cfg.train_questions)
    store, float16 = open_features(cfg, device)
    tok = TextTokenizer.load(cfg.init)
    seed_everything(cfg.seed)
    train, eval_examples = (examples_with_features(examples, path, store, cfg.features, bad)
                            for path, examples in ((cfg.train_questions, train), (cfg.eval_questions, eval_examples)))
    eval_examples = labelled_evaluation(eval_examples, lambda ex: ex.annotated, lambda ex: f"question {ex.question_id}",
                                        cfg.eval_questions, bad)
    require_eval_examples(eval_examples, cfg.eval_questions)
    if bad.total and dist.main:
        print(bad.warning(), file=sys.stderr)
    require_train_examples(train, cfg.train_questions)  # after the warning that says what --skip_bad dropped
    model, model_cfg, copied = build_qa_model(cfg.init, vocab, cfg.qa_head_init, cfg.answer_classifier)
    if model_cfg.visual_dim != store.feature_dim:
        raise VlbertsError(
            f"store features are {store.feature_dim}-d but the model expects {model_cfg.visual_dim}-d", path=cfg.features
        )
    # VL-BERT's CLASSIFIER_PRETRAINED: each answer's row from its subwords' embeddings (after the encoder is loaded)
    word_rows = model.init_answer_rows([tok.encode(a) for a in vocab.answers]) if word_init else 0
    features, mismatch = check_features(store, cfg.init, dist)
    data = qa_data(model, train, store, tok, vocab, max_text_len=cfg.max_text_len, max_regions=cfg.max_regions,
                   target=task.target, float16=float16, flip_prob=cfg.flip_prob, seed=cfg.seed)
    check_targets(train, data.targets, getattr(cfg, task.answers_field) or cfg.train_questions, cfg.answer_vocab,
                  len(vocab), dist)
    loss_fn = LOSSES[model.loss if cfg.loss == "auto" else cfg.loss]
    extra = {"task": task.name, "answers": list(vocab.answers), "head": model.head, "features": features}
    final = finetune_loop(
        cfg, out=out, model=model, model_cfg=model_cfg, data=data, device=device, dist=dist, extra=extra, tokenizer=tok,
        collate=lambda ex: collate_vqa(ex, len(vocab), tok.pad_id),
        loss=lambda b: loss_fn(model.answer_logits(b).float(), b.targets), count=lambda b: len(b.targets),
        label=f"fine-tune {task.name.upper()}", lengths=data.lengths() if cfg.length_group > 1 else None,
    )
    if final is None:
        return None

    metrics = {"train_questions": len(train), "train_questions_in_eval_dropped": in_eval,
               "train_questions_on_excluded_images": on_excluded, "eval_questions_on_excluded_images": eval_on_excluded,
               "num_answers": len(vocab), "skipped_records": bad.to_dict(),
               "train_questions_without_target": sum(1 for t in data.targets if t is not None and not t.labels),
               "steps": num_updates(cfg, len(data)), "answer_rows_from_pretraining": copied,
               "answer_rows_from_word_embeddings": word_rows, **mismatch}
    if cfg.eval_questions:
        preds = predict_qa(model, vocab, tok, eval_examples, store, max_regions=cfg.max_regions,
                           max_text_len=cfg.max_text_len, batch_size=cfg.eval_batch_size, device=device,
                           precision=cfg.precision, dist=dist)
        if dist.main:
            task.write_predictions(out / "predictions.json", ((ex.question_id, preds[ex.question_id]) for ex in eval_examples))
        if all_labelled(eval_examples, lambda ex: ex.annotated):
            metrics.update(task.metrics(preds, eval_examples, train))
            # Questions none of whose answers is a class: always wrong (no class can score them).
            metrics["eval_questions_without_target"] = sum(1 for ex in eval_examples if not task.target(ex, vocab).labels)
    if dist.main:
        write_json(out / "metrics.json", metrics)
    barrier(dist)
    return final
