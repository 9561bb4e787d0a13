"""Hugging Face LXMERT checkpoints -> vlberts (`LxmertModel`, `LxmertForPreTraining` and
`LxmertForQuestionAnswering` directories written by `save_pretrained`: `config.json` +
`model.safetensors` or `pytorch_model.bin`).

The rename table, applied in order to every key of the file (a bare `LxmertModel` has no `lxmert.`
prefix; rule 1 adds it):

| # | Hugging Face key                                   | vlberts key                                   |
|---|----------------------------------------------------|-----------------------------------------------|
| 1 | `embeddings.` / `encoder.` / `pooler.` (bare model) | `lxmert.embeddings.` / `lxmert.encoder.` / ... |
| 2 | `lxmert.encoder.visn_fc.{visn_fc,visn_layer_norm,box_fc,box_layer_norm}` | `lxmert.object_embeddings.{same}` |
| 3 | `lxmert.encoder.layer.N.`                          | `lxmert.encoder.layer.N.` (unchanged, BERT's names) |
| 4 | `lxmert.encoder.r_layers.N.`                       | `lxmert.r_encoder.layer.N.`                   |
| 5 | `lxmert.encoder.x_layers.N.`                       | `lxmert.x_layers.N.`                          |
| 6 | `x_layers.N.visual_attention.att.{query,key,value}` | `x_layers.N.cross_attention.self.{same}`      |
| 7 | `x_layers.N.visual_attention.output.`              | `x_layers.N.cross_attention.output.`          |
| 8 | `x_layers.N.{lang,visn}_self_att.{self,output}.`   | unchanged                                     |
| 9 | `x_layers.N.{lang,visn}_inter.`                    | `x_layers.N.{lang,visn}_ffn.intermediate.`    |
| 10| `x_layers.N.{lang,visn}_output.`                   | `x_layers.N.{lang,visn}_ffn.output.`          |
| 11| `lxmert.pooler.`, `lxmert.embeddings.`, `cls.`, `obj_predict_head.`, `answer_head.` | unchanged |
| 12| `cls.predictions.decoder.weight`                   | dropped: tied to the word embeddings          |
| 13| `*.position_ids` (saved by old versions)           | dropped: not a parameter                      |

Heads the file does not hold (all of them for a bare `LxmertModel`; `cls` and `obj_predict_head` for
`LxmertForQuestionAnswering`) stay freshly initialised; any other missing, unexpected or mis-shaped key
is a `VlbertsError` naming the first offending keys.

LXMERT's own checkpoints (airsplay/lxmert `snap/pretrained/model_LXRT.pth`, the released `Epoch20_LXRT.pth`: a
`torch.save`d state dict of its `LXRTPretraining`, keys prefixed `module.` when saved from `DataParallel`) use
Hugging Face's module names but for the backbone's prefix, `bert.` where Hugging Face has `lxmert.` (Hugging
Face's port keeps LXMERT's names: `encoder.visn_fc`, `encoder.layer/r_layers/x_layers`, `visual_attention`,
`lang_inter`, `obj_predict_head.decoder_dict`, `answer_head.logit_fc`). `load_original_lxmert` strips
`module.`, renames `bert.` -> `lxmert.` and applies the table above. Such a file carries no config: the
layer counts, widths, vocabulary, feature size and heads are read off the tensors' names and shapes; the
number of attention heads is not in them, so it is hidden_size / 64 (LXMERT's and BERT's 12 for 768) unless
`config` says otherwise (a JSON object of Hugging Face `LxmertConfig` settings).
"""

from __future__ import annotations

from pathlib import Path

from vlberts.errors import VlbertsError
from vlberts.config import from_dict, require_known_keys
from vlberts.io import read_json_object
from vlberts.models.lxmert import LxmertConfig, LxmertForPreTraining
from vlberts.models.weights import (dim_of, hf_setting_missing, layer_count, leave_out, load_into, read_state_dict,
                                    rename_key)

HF_LXMERT_RULES = [
    (r"^(embeddings|encoder|pooler)\.", r"lxmert.\1."),  # 1
    (r"^lxmert\.encoder\.visn_fc\.", "lxmert.object_embeddings."),  # 2
    (r"^lxmert\.encoder\.r_layers\.(\d+)\.", r"lxmert.r_encoder.layer.\1."),  # 4
    (r"^lxmert\.encoder\.x_layers\.", "lxmert.x_layers."),  # 5
    (r"\.visual_attention\.att\.", ".cross_attention.self."),  # 6
    (r"\.visual_attention\.output\.", ".cross_attention.output."),  # 7
    (r"^(lxmert\.x_layers\.\d+)\.(lang|visn)_inter\.", r"\1.\2_ffn.intermediate."),  # 9
    (r"^(lxmert\.x_layers\.\d+)\.(lang|visn)_output\.", r"\1.\2_ffn.output."),  # 10
    (r"^cls\.predictions\.decoder\.weight$", ""),  # 12
    (r"\.position_ids$", ""),  # 13
]

_HEAD_PREFIXES = ("cls.", "obj_predict_head.", "answer_head.")


# The Hugging Face `LxmertConfig` settings `lxmert_config_from_hf` reads (a --config of changes may name these only)
HF_LXMERT_SETTINGS = (
    "vocab_size", "hidden_size", "num_attention_heads", "intermediate_size", "l_layers", "r_layers", "x_layers",
    "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
    "type_vocab_size", "initializer_range", "visual_feat_dim", "visual_pos_dim", "task_obj_predict",
    "visual_obj_loss", "visual_attr_loss", "visual_feat_loss", "num_object_labels", "num_attr_labels",
    "num_qa_labels", "task_qa", "tie_word_embeddings",
)


def lxmert_config_from_hf(hf: dict, where: str = "HF LXMERT config") -> LxmertConfig:
    """Translate a HF `LxmertConfig` dict (`where`: its file, for messages); settings we do not implement are
    errors, not ignored, and so are values of the wrong type or out of range (`config.from_dict`)."""
    if hf.get("tie_word_embeddings") is False:
        raise VlbertsError(f"{where}: tie_word_embeddings=False (an MLM decoder apart from the word embeddings) is not supported")
    obj = hf.get("task_obj_predict", True)
    try:
        settings = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_heads=hf["num_attention_heads"],
            intermediate_size=hf["intermediate_size"],
            language_layers=hf["l_layers"],
            relation_layers=hf["r_layers"],
            cross_layers=hf["x_layers"],
            hidden_act=hf.get("hidden_act", "gelu"),
            hidden_dropout=hf.get("hidden_dropout_prob", 0.1),
            attention_dropout=hf.get("attention_probs_dropout_prob", 0.1),
            max_position_embeddings=hf.get("max_position_embeddings", 512),
            type_vocab_size=hf.get("type_vocab_size", 2),
            initializer_range=hf.get("initializer_range", 0.02),
            visual_dim=hf["visual_feat_dim"],
            visual_pos_dim=hf.get("visual_pos_dim", 4),
            # HF builds a head only if its task (and, for object prediction, its loss) is switched on.
            num_object_labels=hf.get("num_object_labels", 1600) if obj and hf.get("visual_obj_loss", True) else 0,
            num_attr_labels=hf.get("num_attr_labels", 400) if obj and hf.get("visual_attr_loss", True) else 0,
            feat_regression=bool(obj and hf.get("visual_feat_loss", True)),
            num_qa_labels=hf.get("num_qa_labels", 9500) if hf.get("task_qa", True) else 0,
        )
    except KeyError as e:
        raise hf_setting_missing(hf, where, e.args[0]) from None
    return from_dict(LxmertConfig, settings, where=where)


def load_hf_lxmert(path: str | Path) -> LxmertForPreTraining:
    """Load a HF LXMERT checkpoint directory into our `LxmertForPreTraining`."""
    path = Path(path)
    cfg = lxmert_config_from_hf(read_json_object(path / "config.json"), where=str(path / "config.json"))
    return _load(cfg, read_state_dict(path), path)


# LXMERT's own checkpoint keys -> Hugging Face's: DataParallel's prefix dropped, the backbone renamed; a
# fine-tuned task model's encoder (src/tasks/*_model.py: `lxrt_encoder.model`, its `module.` under --multiGPU)
# read as the pre-trained model's.
ORIGINAL_LXMERT_RULES = [(r"^lxrt_encoder\.model\.(module\.)?", ""), (r"^module\.", ""), (r"^bert\.", "lxmert.")]
# The answer head of LXMERT's VQA, GQA and NLVR2 models (the `logit_fc` beside `lxrt_encoder`): left out and named.
LXMERT_TASK_HEADS = {"logit_fc.": "logit_fc"}


def load_original_lxmert(path: str | Path, config: str | Path | None = None) -> LxmertForPreTraining:
    """Load an airsplay/lxmert checkpoint (`*_LXRT.pth`) into our `LxmertForPreTraining` (module docstring):
    its config read off the tensors, `config` a JSON object of Hugging Face settings that changes it. A
    fine-tuned task model's file (`BEST.pth` of src/tasks/vqa.py, gqa.py, nlvr2.py) gives its encoder, the
    pre-training heads fresh; its answer head is left out and named in the model's `left_out_head`."""
    path = Path(path)
    state, names = {}, {}
    raw, left_out = leave_out(read_state_dict(path), LXMERT_TASK_HEADS)
    for k, v in raw.items():
        hf_key = rename_key(k, ORIGINAL_LXMERT_RULES)
        state[hf_key], names[hf_key] = v, k
    hf = original_lxmert_config(state, path)
    if config is not None:
        changes = read_json_object(config)
        require_known_keys(changes, HF_LXMERT_SETTINGS, str(config))
        hf.update(changes)
    model = _load(lxmert_config_from_hf(hf, where=str(config or path)), state, path, names)
    model.left_out_head = left_out
    return model


def original_lxmert_config(state: dict, path: str | Path) -> dict:
    """The Hugging Face `LxmertConfig` settings an LXMERT state dict's names and shapes hold (its keys already
    in Hugging Face's names); a file without LXMERT's word embeddings is an error naming it."""
    word = state.get("lxmert.embeddings.word_embeddings.weight")
    if word is None:
        raise VlbertsError("not an LXMERT checkpoint: no bert.embeddings.word_embeddings.weight (LXMERT's "
                           "LXRTPretraining state dict, e.g. Epoch20_LXRT.pth)", path=path)

    hidden = int(word.shape[1])
    ffn = next((v for k, v in state.items() if k.endswith(("intermediate.dense.weight", "lang_inter.dense.weight"))), None)
    heads = "obj_predict_head.decoder_dict."
    return {
        "vocab_size": int(word.shape[0]), "hidden_size": hidden, "num_attention_heads": max(1, hidden // 64),
        "intermediate_size": int(ffn.shape[0]) if ffn is not None else 4 * hidden,
        "l_layers": layer_count(state, "lxmert.encoder.layer."), "r_layers": layer_count(state, "lxmert.encoder.r_layers."),
        "x_layers": layer_count(state, "lxmert.encoder.x_layers."),
        "max_position_embeddings": dim_of(state, "lxmert.embeddings.position_embeddings.weight"),
        "type_vocab_size": dim_of(state, "lxmert.embeddings.token_type_embeddings.weight"),
        "visual_feat_dim": dim_of(state, "lxmert.encoder.visn_fc.visn_fc.weight", 1, 2048),
        "visual_pos_dim": dim_of(state, "lxmert.encoder.visn_fc.box_fc.weight", 1, 4),
        "task_obj_predict": any(k.startswith(heads) for k in state),
        "num_object_labels": dim_of(state, heads + "obj.weight"), "visual_obj_loss": heads + "obj.weight" in state,
        "num_attr_labels": dim_of(state, heads + "attr.weight"), "visual_attr_loss": heads + "attr.weight" in state,
        "visual_feat_loss": heads + "feat.weight" in state,
        "num_qa_labels": dim_of(state, "answer_head.logit_fc.3.weight"), "task_qa": "answer_head.logit_fc.3.weight" in state,
    }


def _load(cfg: LxmertConfig, state: dict, source: Path, names: dict[str, str] | None = None) -> LxmertForPreTraining:
    """`state` (Hugging Face's key names; `names`: each one's name in the file, for messages) into a new model of
    `cfg`, strictly but for the heads the file lacks."""
    model = LxmertForPreTraining(cfg)
    sd, file_names = {}, {}
    for k, v in state.items():
        ours = rename_key(k, HF_LXMERT_RULES)
        if ours:
            sd[ours], file_names[ours] = v, (names or {}).get(k, k)
    absent = tuple(p for p in _HEAD_PREFIXES if not any(k.startswith(p) for k in sd))
    load_into(model, sd, source=source, allow_missing=lambda k: k.startswith(absent), file_names=file_names)
    model.tie_weights()
    model.left_out_head = None  # as every converter's model says (`load_original_lxmert` names a task head)
    return model
