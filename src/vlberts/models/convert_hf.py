"""Hugging Face VisualBERT checkpoints -> vlberts.

Our parameter names follow BERT's, so the map is short: HF's `visual_bert.` prefix becomes `bert.`
(a bare `VisualBertModel` has no prefix), and the MLM decoder, which HF ties to the word embeddings,
is dropped because ours is tied too. Works for checkpoints saved by `save_pretrained`
(`config.json` + `model.safetensors` or `pytorch_model.bin`).

LXMERT's converter lives in `convert_hf_lxmert.py` (its rename table is longer); `load_hf_lxmert` is
re-exported here so that every Hugging Face loader is reachable from this module.
"""

from __future__ import annotations

from pathlib import Path

from vlberts.errors import VlbertsError
from vlberts.config import from_dict
from vlberts.io import read_json_object
from vlberts.models.convert_hf_lxmert import load_hf_lxmert as load_hf_lxmert  # re-export
from vlberts.models.visualbert import VisualBertConfig, VisualBertForPreTraining
from vlberts.models.weights import load_into, read_state_dict, rename_keys

HF_VISUALBERT_RULES = [
    (r"^visual_bert\.", "bert."),
    (r"^(embeddings|encoder|pooler)\.", r"bert.\1."),
    (r"^cls\.predictions\.decoder\.weight$", ""),  # tied to bert.embeddings.word_embeddings
    (r"^cls\.predictions\.decoder\.bias$", ""),  # tied to cls.predictions.bias
    (r"\.position_ids$", ""),  # a non-persistent buffer in recent versions, saved by old ones
]

_HEAD_PREFIX = "cls."


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
        )
    except KeyError as e:
        raise VlbertsError(f"{where} lacks {e.args[0]}") from None
    return from_dict(VisualBertConfig, settings, where=where)


def load_hf_visualbert(path: str | Path) -> VisualBertForPreTraining:
    """Load a HF `VisualBertModel` or `VisualBertForPreTraining` checkpoint directory.

    A bare `VisualBertModel` has no pre-training heads; those stay freshly initialised.
    """
    path = Path(path)
    cfg = visualbert_config_from_hf(read_json_object(path / "config.json"), where=str(path / "config.json"))
    model = VisualBertForPreTraining(cfg)
    sd = rename_keys(read_state_dict(path), HF_VISUALBERT_RULES)
    has_heads = any(k.startswith(_HEAD_PREFIX) for k in sd)
    load_into(
        model,
        sd,
        source=path,
        allow_missing=(lambda k: k.startswith(_HEAD_PREFIX)) if not has_heads else (lambda k: False),
    )
    model.tie_weights()
    return model
