"""Hugging Face VisualBERT checkpoints -> vlberts.

Our parameter names follow BERT's, so the map is short: HF's `visual_bert.` prefix becomes `bert.`
(a bare `VisualBertModel` has no prefix), and the MLM decoder, which HF ties to the word embeddings,
is dropped because ours is tied too. Works for checkpoints saved by `save_pretrained`
(`config.json` + `model.safetensors` or `pytorch_model.bin`).

The rename table, applied in order to every key of the file:

| # | Hugging Face key                                   | vlberts key                                   |
|---|----------------------------------------------------|-----------------------------------------------|
| 1 | `visual_bert.`                                     | `bert.`                                       |
| 2 | `embeddings.` / `encoder.` / `pooler.` (bare model) | `bert.embeddings.` / `bert.encoder.` / ...    |
| 3 | `cls.predictions.decoder.{weight,bias}`            | dropped: tied to the word embeddings / `cls.predictions.bias` |
| 4 | `*.position_ids` (saved by old versions)           | dropped: not a parameter                      |
| 5 | `cls.predictions.`, `cls.seq_relationship.`        | unchanged                                     |

`load_hf_visualbert` reads what each HF class holds into our `VisualBertForPreTraining`:

| HF class (config.json `architectures`) | encoder | MLM + sentence-image heads | task head, left out           |
|----------------------------------------|---------|----------------------------|-------------------------------|
| `VisualBertModel`                      | loaded  | freshly initialised        | -                             |
| `VisualBertForPreTraining`             | loaded  | loaded                     | -                             |
| `VisualBertForQuestionAnswering`       | loaded  | freshly initialised        | `cls.weight`, `cls.bias` (answers) |
| `VisualBertForVisualReasoning`         | loaded  | freshly initialised        | `cls.weight`, `cls.bias` (NLVR2) |
| `VisualBertForMultipleChoice`          | loaded  | freshly initialised        | `cls.weight`, `cls.bias` (1 score) |
| `VisualBertForRegionToPhraseAlignment` | loaded  | loaded (HF keeps them)     | `attention.{query,key,value}.{weight,bias}` |

A task head is recognised by its keys and, when config.json lists `architectures` (save_pretrained writes
it), by that class too: the three classifiers share their names, and a head that is not the listed class's
is an error. The model's `left_out_head` says which head was left out (None when none was), and
`vlberts models import` records it in the written config.json (`left_out`) and prints it. Any other missing,
unexpected or mis-shaped key is a `VlbertsError` naming the first offending keys.

`VisualBertForQuestionAnswering`'s head is our `VisualBertForVQA`'s (dropout + linear on the [MASK] before
[SEP]; HF reads text position `attention_mask.sum(1) - 2`): `load_hf_visualbert_vqa` loads encoder and
classifier (`cls.` -> `classifier.`), with as many answers as `cls.weight` has rows.

VisualBERT's own released files (uclanlp/visualbert: `coco_pre_trained.th`, `vqa_pre_trained.th`,
`vqa_fine_tuned.th`, `nlvr2_*.th`, `vcr_*.th`; `torch.save` state dicts) load through the same code after the
renames Hugging Face's conversion script (`convert_visual_bert_original_pytorch_checkpoint_to_pytorch.py`)
applies to them, as `load_original_visualbert`:

| # | VisualBERT's key                        | as Hugging Face's                    |
|---|-----------------------------------------|--------------------------------------|
| 1 | `bert.bert.`                            | `visual_bert.`                       |
| 2 | `bert.cls.`, `bert.classifier.`         | `cls.` (the second: a task head)     |
| 3 | `token_type_embeddings_visual`          | `visual_token_type_embeddings`       |
| 4 | `position_embeddings_visual`            | `visual_position_embeddings`         |
| 5 | `projection`                            | `visual_projection`                  |
| 6 | `detector.*` (VCR's ResNet-50)          | left out: vlberts reads region features from a store |

The file holds no config: widths, layers, vocabulary, positions, segment types and the visual feature width
are read off the tensors, the attention heads are hidden_size / 64 (BERT's 12) unless `config` says
otherwise (`{"visual_spatial": "6d"}` there: a Flickr30K model trained with `add_spatial_features`, whose
projection reads each 2048-d feature and its box's 6 coordinates, `VisualBertConfig.visual_spatial`), and
the task head is told by the file's name, as Hugging Face's script tells it (`vqa` -> question answering,
`nlvr` -> visual reasoning, `vcr` -> multiple choice; `pre` in the name: none).

LXMERT's converter lives in `convert_hf_lxmert.py` (its rename table is longer); `load_hf_lxmert` is
re-exported here so that every Hugging Face loader is reachable from this module.
"""

from __future__ import annotations

from pathlib import Path

from vlberts.errors import VlbertsError
from vlberts.config import from_dict, require_known_keys
from vlberts.io import read_json_object
from vlberts.models.convert_hf_lxmert import load_hf_lxmert as load_hf_lxmert  # re-export
from vlberts.models.spatial import SPATIAL_DIMS
from vlberts.models.visualbert import VisualBertConfig, VisualBertForPreTraining, VisualBertForVQA
from vlberts.models.weights import (dim_of, hf_setting_missing, layer_count, load_into, read_state_dict, rename_key,
                                    rename_keys)

HF_VISUALBERT_RULES = [
    (r"^visual_bert\.", "bert."),
    (r"^(embeddings|encoder|pooler)\.", r"bert.\1."),
    (r"^cls\.predictions\.decoder\.weight$", ""),  # tied to bert.embeddings.word_embeddings
    (r"^cls\.predictions\.decoder\.bias$", ""),  # tied to cls.predictions.bias
    (r"\.position_ids$", ""),  # a non-persistent buffer in recent versions, saved by old ones
]

_HEAD_PREFIX = "cls."
_PRETRAINING_HEADS = ("cls.predictions.", "cls.seq_relationship.")
_CLASSIFIER = ("cls.weight", "cls.bias")
# HF's fine-tuned classes -> (the keys of their task head, which our pre-training model has no place for;
# what the head is). The three classifiers share their names: config.json's `architectures` tells them apart.
HF_VISUALBERT_TASK_HEADS: dict[str, tuple[tuple[str, ...], str]] = {
    "VisualBertForQuestionAnswering": (_CLASSIFIER, "answer classifier on the [MASK] before [SEP]"),
    "VisualBertForVisualReasoning": (_CLASSIFIER, "NLVR2 classifier on the pooled output"),
    "VisualBertForMultipleChoice": (_CLASSIFIER, "choice scorer on the pooled output"),
    "VisualBertForRegionToPhraseAlignment": (
        tuple(f"attention.{m}.{p}" for m in ("query", "key", "value") for p in ("weight", "bias")),
        "region-to-phrase attention",
    ),
}
_TASK_KEYS = {k for keys, _ in HF_VISUALBERT_TASK_HEADS.values() for k in keys}
# HF classes whose files hold the MLM and sentence-image heads
_WITH_PRETRAINING_HEADS = ("VisualBertForPreTraining", "VisualBertForRegionToPhraseAlignment")


# The Hugging Face `VisualBertConfig` settings `visualbert_config_from_hf` reads, and our `visual_spatial` (a
# --config of changes may name these only)
HF_VISUALBERT_SETTINGS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
    "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings", "type_vocab_size",
    "layer_norm_eps", "pad_token_id", "initializer_range", "visual_embedding_dim", "special_visual_initialize",
    "visual_spatial", "bypass_transformer", "tie_word_embeddings",
)


def visualbert_config_from_hf(hf: dict, where: str = "HF VisualBERT config") -> VisualBertConfig:
    """Translate a HF `VisualBertConfig` dict (`where`: its file, for messages); settings we do not implement
    are errors, not ignored, and so are values of the wrong type or out of range (`config.from_dict`)."""
    if hf.get("bypass_transformer"):
        raise VlbertsError(f"{where}: bypass_transformer=True (VisualBERT without early fusion) is not supported by this converter")
    if hf.get("tie_word_embeddings") is False:
        raise VlbertsError(f"{where}: tie_word_embeddings=False (an MLM decoder apart from the word embeddings) is not supported")
    try:
        settings = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            hidden_act=hf.get("hidden_act", "gelu"),
            hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
            attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
            max_position_embeddings=hf.get("max_position_embeddings", 512),
            type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12),
            pad_token_id=hf.get("pad_token_id", 0) or 0,
            initializer_range=hf.get("initializer_range", 0.02),
            visual_dim=hf["visual_embedding_dim"],
            special_visual_initialize=hf.get("special_visual_initialize", True),
            visual_spatial=hf.get("visual_spatial", "none"),  # ours, not Hugging Face's (`load_original_visualbert`)
        )
    except KeyError as e:
        raise hf_setting_missing(hf, where, e.args[0]) from None
    return from_dict(VisualBertConfig, settings, where=where)


def _architectures(hf: dict, where: str) -> list[str] | None:
    """config.json's `architectures` (the HF classes save_pretrained wrote it from), or None when absent."""
    archs = hf.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise VlbertsError(f"{where}: architectures: expected a list of class names, got {archs!r}")
    return archs


def _read(path: Path) -> tuple[VisualBertConfig, list[str] | None, dict, dict[str, str]]:
    """config.json (translated, and its architectures) and the renamed weights with their names in the file."""
    where = str(path / "config.json")
    hf = read_json_object(path / "config.json")
    cfg = visualbert_config_from_hf(hf, where=where)
    raw = read_state_dict(path)
    names = {rename_key(k, HF_VISUALBERT_RULES): k for k in raw}
    return cfg, _architectures(hf, where), rename_keys(raw, HF_VISUALBERT_RULES), names


def _task_head(sd: dict, archs: list[str] | None, cfg: VisualBertConfig, path: Path) -> tuple[list[str], str | None]:
    """The keys of the task head `sd` holds and what it is (None: no task head). With `architectures`, the
    head must be that class's; without, its keys must be one class's whole head, or they stay unexpected."""
    present = sorted(k for k in sd if k in _TASK_KEYS)
    if archs is not None:
        listed = [a for a in archs if a in HF_VISUALBERT_TASK_HEADS]
        expected = set(HF_VISUALBERT_TASK_HEADS[listed[0]][0]) if listed else set()
        missing, extra = sorted(expected - set(sd)), sorted(set(present) - expected)
        if missing or extra:
            problems = ([f"missing keys: {', '.join(missing)}"] if missing else []) + (
                [f"unexpected keys: {', '.join(extra)}"] if extra else [])
            raise VlbertsError(f"the task head does not fit config.json's architectures {archs}; "
                               + "; ".join(problems), path=path)
        classes = listed[:1]
    else:
        classes = [a for a, (keys, _) in HF_VISUALBERT_TASK_HEADS.items() if set(keys) == set(present)]
    if not present or not classes:
        return [], None
    # the head reads the encoder's hidden states: a weight of another width is another model's
    weights = [k for k in present if k.endswith("weight")]
    bad = [f"{k} {tuple(sd[k].shape)}, {k[:-6]}bias {tuple(sd[k[:-6] + 'bias'].shape)}" for k in weights
           if sd[k].ndim != 2 or sd[k].shape[1] != cfg.hidden_size or sd[k[:-6] + "bias"].shape != sd[k].shape[:1]]
    if bad:
        raise VlbertsError(f"weights do not fit the model; shape mismatch: {', '.join(bad)} (the task head reads "
                           f"hidden size {cfg.hidden_size})", path=path)
    keys = ", ".join(HF_VISUALBERT_TASK_HEADS[classes[0]][0])
    if classes[0] == "VisualBertForRegionToPhraseAlignment":
        return present, f"VisualBertForRegionToPhraseAlignment's region-to-phrase attention ({keys})"
    n = sd["cls.weight"].shape[0]
    outputs = f"{keys}: {n} output{'s' if n != 1 else ''}"
    if archs is None:  # only the architectures tell the three classifiers apart
        return present, (f"a task classifier ({outputs}) of {', '.join(classes[:-1])} or {classes[-1]} (config.json "
                         "names no architecture)")
    name = classes[0]
    vqa = "; load_hf_visualbert_vqa loads it" if name == "VisualBertForQuestionAnswering" else ""
    return present, f"{name}'s {HF_VISUALBERT_TASK_HEADS[name][1]} ({outputs}{vqa})"


def load_hf_visualbert(path: str | Path) -> VisualBertForPreTraining:
    """Load a HF `VisualBertModel`, `VisualBertForPreTraining` or fine-tuned task checkpoint directory
    (the table in the module docstring).

    Pre-training heads the file does not hold stay freshly initialised. A task head is left out, and the
    model's `left_out_head` says which (None: none was).
    """
    path = Path(path)
    return _load_pretraining(*_read(path), path)


ORIGINAL_VISUALBERT_RULES = [  # uclanlp/visualbert's names -> Hugging Face's (the module docstring's table)
    (r"^bert\.bert\.", "visual_bert."),
    (r"^bert\.(cls|classifier)\.", "cls."),
    (r"token_type_embeddings_visual", "visual_token_type_embeddings"),
    (r"position_embeddings_visual", "visual_position_embeddings"),
    (r"\.projection\.", ".visual_projection."),
    (r"^detector\..*", ""),  # VCR's fine-tuned ResNet-50: features come from a store here
]
# The task head of a released file, told by its name as Hugging Face's conversion script tells it.
_ORIGINAL_TASKS = (("vcr", "VisualBertForMultipleChoice"), ("nlvr", "VisualBertForVisualReasoning"),
                   ("vqa", "VisualBertForQuestionAnswering"))


def load_original_visualbert(path: str | Path, config: str | Path | None = None) -> VisualBertForPreTraining:
    """Load one of VisualBERT's own released `.th` files into our `VisualBertForPreTraining` (module docstring):
    its config read off the tensors, `config` a JSON object of Hugging Face `VisualBertConfig` settings that
    changes it; a fine-tuned file's task head is left out and named, as for Hugging Face's classes."""
    path = Path(path)
    raw = read_state_dict(path)
    hf_names = {k: rename_key(k, ORIGINAL_VISUALBERT_RULES) for k in raw}
    detector = sum(1 for k in raw if k.startswith("detector."))
    sd_hf = {hf_names[k]: v for k, v in raw.items() if hf_names[k]}
    hf = original_visualbert_config(sd_hf, path)
    overrides = read_json_object(config) if config is not None else {}
    require_known_keys(overrides, HF_VISUALBERT_SETTINGS, str(config))
    hf.update(overrides)
    if "visual_embedding_dim" not in overrides:  # the projection reads each feature and its box geometry
        hf["visual_embedding_dim"] -= SPATIAL_DIMS.get(hf.get("visual_spatial", "none"), 0)
    cfg = visualbert_config_from_hf(hf, where=str(config or path))
    names = {ours: k for k, h in hf_names.items() if h and (ours := rename_key(h, HF_VISUALBERT_RULES))}
    stem = path.name.lower()
    archs = None if "pre" in stem else next(([c] for key, c in _ORIGINAL_TASKS if key in stem), None)
    model = _load_pretraining(cfg, archs, rename_keys(sd_hf, HF_VISUALBERT_RULES), names, path)
    if model.left_out_head:  # no config.json here: the file's name is what would have told the head
        model.left_out_head = model.left_out_head.replace("config.json names no architecture",
                                                          "the file's name does not say which").replace(
            "; load_hf_visualbert_vqa loads it", "")  # (which reads a Hugging Face directory, not this file)
    if detector:
        model.left_out_head = "; ".join(x for x in (model.left_out_head, f"the ResNet-50 detector ({detector} detector.* "
                                                    "tensors; region features come from a store)") if x)
    return model


def original_visualbert_config(sd: dict, path: str | Path) -> dict:
    """The Hugging Face `VisualBertConfig` settings a VisualBERT state dict's names and shapes hold (its keys
    in Hugging Face's names); a file without the word embeddings is an error naming it."""
    word = sd.get("visual_bert.embeddings.word_embeddings.weight")
    if word is None:
        raise VlbertsError("not a VisualBERT checkpoint: no bert.bert.embeddings.word_embeddings.weight (uclanlp/"
                           "visualbert's .th state dict, e.g. coco_pre_trained.th)", path=path)
    hidden, emb = int(word.shape[1]), "visual_bert.embeddings."
    return {
        "vocab_size": int(word.shape[0]), "hidden_size": hidden, "num_attention_heads": max(1, hidden // 64),
        "num_hidden_layers": layer_count(sd, "visual_bert.encoder.layer."),
        "intermediate_size": dim_of(sd, "visual_bert.encoder.layer.0.intermediate.dense.weight", 0, 4 * hidden),
        "max_position_embeddings": dim_of(sd, emb + "position_embeddings.weight", 0, 512),
        "type_vocab_size": dim_of(sd, emb + "token_type_embeddings.weight", 0, 2),
        "visual_embedding_dim": dim_of(sd, emb + "visual_projection.weight", 1, 2048),
    }


def _load_pretraining(cfg: VisualBertConfig, archs: list[str] | None, sd: dict, names: dict[str, str],
                      path: Path) -> VisualBertForPreTraining:
    """`load_hf_visualbert`'s body: the renamed weights into the pre-training model, a task head left out."""
    model = VisualBertForPreTraining(cfg)
    head_keys, left_out = _task_head(sd, archs, cfg, path)
    sd = {k: v for k, v in sd.items() if k not in head_keys}
    # the MLM and sentence-image heads: all or none (cls.weight, a task classifier, is not one of them)
    has_heads = any(k.startswith(_PRETRAINING_HEADS) for k in sd) or bool(set(archs or ()) & set(_WITH_PRETRAINING_HEADS))
    load_into(
        model,
        sd,
        source=path,
        allow_missing=(lambda k: k.startswith(_HEAD_PREFIX)) if not has_heads else (lambda k: False),
        file_names=names,
    )
    model.tie_weights()
    model.left_out_head = left_out
    return model


def load_hf_visualbert_vqa(path: str | Path) -> VisualBertForVQA:
    """Load a HF `VisualBertForQuestionAnswering` checkpoint directory, encoder and answer classifier, as our
    `VisualBertForVQA` (the same head: HF's `attention_mask.sum(1) - 2` is the [MASK] of `[CLS] question
    [MASK] [SEP]`, our `answer_pos`); the number of answers is `cls.weight`'s rows. A config.json that lists
    another architecture is an error; one that lists none is taken at its keys' word."""
    path = Path(path)
    cfg, archs, sd, names = _read(path)
    if archs is not None and "VisualBertForQuestionAnswering" not in archs:
        raise VlbertsError(f"{path / 'config.json'}: architectures {archs}: not a VisualBertForQuestionAnswering "
                           "checkpoint (load_hf_visualbert loads its encoder)")
    weight = sd.get("cls.weight")
    if weight is None or weight.ndim != 2:
        raise VlbertsError("no answer classifier (cls.weight, 2-d) in the weights: not a "
                           "VisualBertForQuestionAnswering checkpoint", path=path)
    model = VisualBertForVQA(cfg, num_answers=weight.shape[0])
    rules = [(r"^cls\.(weight|bias)$", r"classifier.\1")]
    load_into(model, rename_keys(sd, rules), source=path,
              file_names={rename_key(k, rules): f for k, f in names.items()})
    return model
