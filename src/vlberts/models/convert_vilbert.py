"""Original ViLBERT checkpoints (facebookresearch/vilbert-multi-task, `vilbert/vilbert.py`) -> vlberts.

The released weights are a bare state dict (`.bin`, read with `torch.load(weights_only=True)`) of
`BertForMultiModalPreTraining` (pre-training) or `VILBertForVLTasks` (fine-tuning), with the
architecture in a separate JSON file such as `config/bert_base_6layer_6conect.json`.

The rename table, applied in order to every key of the file. N is a layer index; `co.` stands for
`bert.encoder.c_layer.N.` in the file and `bert.c_layers.N.` in ours.

| #  | original key                                                  | vlberts key                                   |
|----|---------------------------------------------------------------|-----------------------------------------------|
| 1  | `embeddings.`, `v_embeddings.`, `encoder.`, `t_pooler.`, `v_pooler.` (bare `BertModel`) | `bert.` + same |
| 2  | `*.gamma` / `*.beta` (old LayerNorm names; the original loader renames them too) | `*.weight` / `*.bias` |
| 3  | `bert.embeddings.{word,position,token_type}_embeddings`, `.LayerNorm` | unchanged                      |
| 4  | `bert.v_embeddings.{image_embeddings,image_location_embeddings,LayerNorm}` | unchanged                 |
| 5  | `bert.encoder.layer.N.` (text stream, BERT's names)           | unchanged                                     |
| 6  | `bert.encoder.v_layer.N.` (visual stream, BERT's names)       | `bert.v_encoder.layer.N.`                     |
| 7  | `co.biattention.query2` / `key1` / `value1`                   | `co.text_attention.self.query`/`key`/`value` |
|    | (text queries over the regions' keys and values)              |                                               |
| 8  | `co.biattention.query1` / `key2` / `value2`                   | `co.vision_attention.self.query`/`key`/`value` |
|    | (region queries over the words' keys and values)              |                                               |
| 9  | `co.biOutput.dense2` / `LayerNorm2` (back into the text)      | `co.text_attention.output.dense` / `LayerNorm` |
| 10 | `co.biOutput.dense1` / `LayerNorm1` (back into the regions)   | `co.vision_attention.output.dense`/`LayerNorm` |
| 11 | `co.biOutput.q_dense1` / `q_dense2`                           | dropped: built, never used in the forward     |
| 12 | `co.t_intermediate.` / `co.t_output.`                         | `co.text_ffn.intermediate.` / `.output.`      |
| 13 | `co.v_intermediate.` / `co.v_output.`                         | `co.vision_ffn.intermediate.` / `.output.`    |
| 14 | `bert.t_pooler.dense`, `bert.v_pooler.dense`                  | unchanged                                     |
| 15 | `cls.predictions.{transform.dense,transform.LayerNorm,bias}`  | unchanged                                     |
| 16 | `cls.predictions.decoder.weight`                              | dropped: tied to the word table (checked equal) |
| 17 | `cls.bi_seq_relationship`                                     | unchanged                                     |
| 18 | `cls.imagePredictions.{transform,decoder}`                    | `cls.region_predictions.{transform,decoder}`  |

Names 3-18 were read in `vilbert/vilbert.py` of facebookresearch/vilbert-multi-task (the module tree of
`BertModel`, `BertEncoder`, `BertConnectionLayer`, `BertBiAttention`, `BertBiOutput`, the poolers and
`BertPreTrainingHeads`); no released weights file was opened, so the table has not been run against one.
Unsure, and therefore errors rather than guesses:
- the file also defines an optional "dynamic attention" (`dyLinear_q` / `dyLinear_k` in the visual
  layers, off in the released configs), and, from memory and not verified in a stored copy, later
  versions add multi-task task tokens (`bert.embeddings.task_embeddings`); neither is implemented here,
  so such keys are reported as unexpected;
Fine-tuned files (`VILBertForVLTasks`, e.g. the released `multi_task_model.bin`) hold the encoder, `cls` and
the task heads `VILBERT_TASK_HEADS` (`vil_prediction`, `vil_logit`, `vision_logit`, `linguisic_logit`, ...),
which have no place in this model: they are left out and named in the model's `left_out_head` (`vlberts
models import` prints it and keeps it in config.json's `left_out`).
A file without any `cls.` key (a bare encoder) leaves the heads freshly initialised; any other missing,
unexpected or mis-shaped key is a `VlbertsError` naming the first offending keys (with the file's name).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vlberts.errors import VlbertsError
from vlberts.config import from_dict
from vlberts.io import read_json_object
from vlberts.models.builders import vilbert_base
from vlberts.models.vilbert import ViLBertConfig, ViLBertForPreTraining
from vlberts.models.weights import leave_out, load_into, read_state_dict, rename_key

_CO = r"^bert\.encoder\.c_layer\.(\d+)\."
ORIGINAL_VILBERT_RULES = [
    (r"^(embeddings|v_embeddings|encoder|t_pooler|v_pooler)\.", r"bert.\1."),  # 1
    (r"\.gamma$", ".weight"),  # 2
    (r"\.beta$", ".bias"),  # 2
    (r"^bert\.encoder\.v_layer\.(\d+)\.", r"bert.v_encoder.layer.\1."),  # 6
    (_CO + r"biattention\.query2\.", r"bert.c_layers.\1.text_attention.self.query."),  # 7
    (_CO + r"biattention\.key1\.", r"bert.c_layers.\1.text_attention.self.key."),  # 7
    (_CO + r"biattention\.value1\.", r"bert.c_layers.\1.text_attention.self.value."),  # 7
    (_CO + r"biattention\.query1\.", r"bert.c_layers.\1.vision_attention.self.query."),  # 8
    (_CO + r"biattention\.key2\.", r"bert.c_layers.\1.vision_attention.self.key."),  # 8
    (_CO + r"biattention\.value2\.", r"bert.c_layers.\1.vision_attention.self.value."),  # 8
    (_CO + r"biOutput\.dense2\.", r"bert.c_layers.\1.text_attention.output.dense."),  # 9
    (_CO + r"biOutput\.LayerNorm2\.", r"bert.c_layers.\1.text_attention.output.LayerNorm."),  # 9
    (_CO + r"biOutput\.dense1\.", r"bert.c_layers.\1.vision_attention.output.dense."),  # 10
    (_CO + r"biOutput\.LayerNorm1\.", r"bert.c_layers.\1.vision_attention.output.LayerNorm."),  # 10
    (_CO + r"biOutput\.q_dense[12]\.(weight|bias)$", ""),  # 11
    (_CO + r"t_intermediate\.", r"bert.c_layers.\1.text_ffn.intermediate."),  # 12
    (_CO + r"t_output\.", r"bert.c_layers.\1.text_ffn.output."),  # 12
    (_CO + r"v_intermediate\.", r"bert.c_layers.\1.vision_ffn.intermediate."),  # 13
    (_CO + r"v_output\.", r"bert.c_layers.\1.vision_ffn.output."),  # 13
    (r"^cls\.predictions\.decoder\.weight$", ""),  # 16
    (r"^cls\.imagePredictions\.", "cls.region_predictions."),  # 18
]

_TIED_DECODER = "cls.predictions.decoder.weight"
# The task heads of vilbert-multi-task's fine-tuning network (`VILBertForVLTasks`, vilbert/vilbert.py): VQA's,
# GQA's, NLVR2's, retrieval's and RefCOCO's / VCR's scorers, visual entailment's, and the per-stream logits.
VILBERT_TASK_HEADS = {f"{name}.": name for name in (
    "vil_prediction", "vil_prediction_gqa", "vil_binary_prediction", "vil_logit", "vil_tri_prediction",
    "vision_logit", "linguisic_logit")}
_WORDS = "bert.embeddings.word_embeddings.weight"


def vilbert_config_from_original(orig: dict[str, Any], where: str = "original ViLBERT config") -> ViLBertConfig:
    """Translate an original ViLBERT JSON config (e.g. `bert_base_6layer_6conect.json`).

    Training switches in it (`visual_target`, `predict_feature`, `fast_mode`, `fixed_*_layer`,
    `in_batch_pairs`, `objective`, ...) are not architecture and are ignored, as are
    `bi_intermediate_size`, `bi_attention_type` and `v_initializer_range`, which the original model never
    reads. Settings we do not implement are errors, and so are values of the wrong type or out of range
    (`config.from_dict`); `where` (its file) is named in the messages."""
    if orig.get("fusion_method", orig.get("pooling_method", "mul")) != "mul":
        raise VlbertsError(f"{where}: only fusion_method 'mul' (the paper's h_IMG * h_CLS) is supported")
    for flag in ("dynamic_attention", "task_specific_tokens"):
        if orig.get(flag):
            raise VlbertsError(f"{where}: {flag}=true is not supported by vlberts' ViLBERT")
    if orig.get("with_coattention", True) is False:
        raise VlbertsError(f"{where}: with_coattention=false is not supported; use empty t/v_biattention_id instead")
    try:
        settings = dict(
            vocab_size=orig["vocab_size"],
            hidden_size=orig["hidden_size"],
            num_heads=orig["num_attention_heads"],
            intermediate_size=orig["intermediate_size"],
            num_layers=orig["num_hidden_layers"],
            hidden_act=orig.get("hidden_act", "gelu"),
            hidden_dropout=orig.get("hidden_dropout_prob", 0.1),
            attention_dropout=orig.get("attention_probs_dropout_prob", 0.1),
            max_position_embeddings=orig.get("max_position_embeddings", 512),
            type_vocab_size=orig.get("type_vocab_size", 2),
            initializer_range=orig.get("initializer_range", 0.02),
            visual_dim=orig["v_feature_size"],
            v_hidden_size=orig["v_hidden_size"],
            v_num_heads=orig["v_num_attention_heads"],
            v_intermediate_size=orig["v_intermediate_size"],
            v_num_layers=orig["v_num_hidden_layers"],
            v_hidden_act=orig.get("v_hidden_act", "gelu"),
            v_hidden_dropout=orig.get("v_hidden_dropout_prob", 0.1),
            v_attention_dropout=orig.get("v_attention_probs_dropout_prob", 0.1),
            bi_hidden_size=orig["bi_hidden_size"],
            bi_num_heads=orig["bi_num_attention_heads"],
            t_biattention_id=orig["t_biattention_id"],
            v_biattention_id=orig["v_biattention_id"],
            num_region_classes=orig.get("v_target_size", 1601),
        )
    except KeyError as e:
        raise VlbertsError(f"{where} lacks {e.args[0]}") from None
    return from_dict(ViLBertConfig, settings, where=where)


def load_vilbert_state_dict(
    model: ViLBertForPreTraining,
    sd: dict[str, Tensor],
    *,
    source: str | Path = "<state dict>",
    drop_prefixes: tuple[str, ...] = (),
) -> ViLBertForPreTraining:
    """Copy an original-layout state dict into `model` through the rename table (module docstring).

    Keys starting with one of `drop_prefixes` (in the file's names) are ignored, and a fine-tuned file's task
    heads are left out (`left_out_head` names them). Returns `model`."""
    words, decoder = sd.get(_WORDS), sd.get(_TIED_DECODER)
    if words is not None and decoder is not None and not torch.equal(words, decoder):
        raise VlbertsError(f"{_TIED_DECODER} differs from {_WORDS}; ViLBERT ties them, so this is not a ViLBERT "
                           "pre-training checkpoint", path=source)
    sd, model.left_out_head = leave_out(sd, VILBERT_TASK_HEADS)
    ours, file_names = {}, {}
    for k, v in sd.items():
        if drop_prefixes and k.startswith(drop_prefixes):
            continue
        name = rename_key(k, ORIGINAL_VILBERT_RULES)
        if name:
            ours[name], file_names[name] = v, k
    has_heads = any(k.startswith("cls.") for k in ours)
    load_into(
        model, ours, source=source, file_names=file_names,
        allow_missing=(lambda k: False) if has_heads else (lambda k: k.startswith("cls.")),
    )
    model.tie_weights()
    return model


def load_original_vilbert(
    path: str | Path,
    config: ViLBertConfig | str | Path | None = None,
    *,
    drop_prefixes: tuple[str, ...] = (),
) -> ViLBertForPreTraining:
    """Load an original ViLBERT weights file (`.bin`) into a new `ViLBertForPreTraining`.

    `config`: a `ViLBertConfig`, the path of the original JSON config that goes with the weights, or
    None for the released base config (`builders.vilbert_base`: 6 co-attention layers). A config that
    does not fit the file gives a `VlbertsError` naming the mis-shaped or missing keys."""
    if config is None:
        config = vilbert_base()
    elif not isinstance(config, ViLBertConfig):
        config = vilbert_config_from_original(read_json_object(config), where=str(config))
    model = ViLBertForPreTraining(config)
    return load_vilbert_state_dict(model, read_state_dict(path), source=path, drop_prefixes=drop_prefixes)
