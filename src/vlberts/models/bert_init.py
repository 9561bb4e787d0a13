"""Initialise the text side of any architecture from a BERT checkpoint in Hugging Face format (SPEC §1).

Input: a directory written by `BertForPreTraining` / `BertModel` `save_pretrained` (config.json +
model.safetensors or pytorch_model.bin; `BertForMaskedLM` and Google-converted checkpoints with
`LayerNorm.gamma/beta` names work too). Copied, through an explicit per-architecture key map (ours <- BERT):

  embeddings   word, position and segment tables + the embedding LayerNorm
  layers       the text Transformer layers (see below)
  pooler       `bert.pooler.dense`
  MLM head     `cls.predictions.transform` + `cls.predictions.bias`; the decoder weight is tied to the
               word embeddings, so it follows them

Everything else (region embeddings, cross-modality, co-attention and object-relationship layers, the
sentence-image / matching head, the LXMERT object and QA heads, the visual / region-class heads) keeps its
fresh initialisation, and the returned report says which of our tensors took BERT's values and which
stayed random.

Which layers:
- VisualBERT is one stream over text and regions, so every layer is a text layer: our layer i <- BERT
  layer i, as far as both go (App. A.2: "initialized from BERT_BASE"). With more layers than BERT (the
  w/o-early-fusion variant's new 13th layer) the extra ones stay random; with fewer, BERT's top layers
  go unused. If `special_visual_initialize` is set, the visual segment and position tables are copied
  from BERT's text tables, as the original code does after loading BERT.
- LXMERT's paper pre-trains from scratch (§3.3) and reports BERT initialisation as an ablation (§5.1,
  Table 3); footnote 10 loads "the top 9 BERT-layer parameters into the LXMERT language encoder". The
  released code (airsplay/lxmert, `LXRTPretraining.from_pretrained("bert-base-uncased")` unless
  `--fromScratch`) matches names, which puts BERT layers 0..N_L-1 into the N_L language layers and
  leaves the cross-modality layers random. We follow the code by default (`language_from=0`);
  `language_from=num_bert_layers - N_L` is the other reading of "top 9". `cross_from=j` additionally
  copies BERT layers j, j+1, ... into the language side (self-attention + feed-forward) of the
  cross-modality layers 0, 1, ... (as many as BERT has); the cross-attention and the vision side have no
  BERT counterpart and stay random either way.
- ViLBERT's text stream is BERT (§3.1: "initialize the linguistic stream of our ViLBERT model with a
  BERT_BASE model"): its embeddings, text layer i <- BERT layer i and the MLM head keep BERT's names. Not
  the pooler: ViLBERT's `t_pooler` is Linear + ReLU into the co-attention width, a different function
  (and usually shape) from BERT's tanh pooler, so it stays random with the visual stream, the
  co-attention layers and `v_pooler`. The single-stream baseline (`single_stream=True`) takes the same
  text mapping; its regions enter through the (random) ViLBERT image embedding.
- VL-BERT (§4.1: "initialized from BERT_BASE") and W-VisualBERT (§3.2, from BERT) are one stream with
  BERT's names: embeddings, layer i <- BERT layer i, pooler, MLM head. VL-BERT's segment table has a third
  row (segment C, the image, id 2) that BERT lacks: BERT's rows go into rows 0 and 1 (segments A, B) and
  row 2 keeps its fresh initialisation; the report lists this under `partial`. With a BERT segment table
  of more rows than VL-BERT's text segments (never the case for Google's BERT), only the first two are
  copied. Region, geometry, tag, box, [IMG]/[END] and masked-object tensors stay random.

Not copied, by choice: BERT's next-sentence head. Both original code bases load it by name into their
matching head, but LXMERT's matching labels are the reverse of BERT's (index 1 = "matches"), so the copy
would start that head predicting the opposite; we start it random in every architecture.

Width, vocabulary, position-table or segment-table mismatches (VL-BERT's extra segment row aside) are
one-line `VlbertsError`s naming the first mismatching keys; so are settings that change the function
without changing any shape (number of heads, activation, LayerNorm epsilon).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vlberts.errors import VlbertsError
from vlberts.io import read_json_object
from vlberts.models.lxmert import LxmertConfig
from vlberts.models.vilbert import ViLBertConfig
from vlberts.models.visualbert import VisualBertConfig
from vlberts.models.vlbert import VLBertConfig
from vlberts.models.weights import read_state_dict, rename_keys, tied_aliases, values_misfit
from vlberts.models.wvisualbert import WVisualBertConfig

# Checkpoint key normalisation: every key becomes a `BertForPreTraining` name.
BERT_RULES = [
    (r"^(embeddings|encoder|pooler)\.", r"bert.\1."),  # a bare `BertModel` has no `bert.` prefix
    (r"LayerNorm\.gamma$", "LayerNorm.weight"),  # TF-converted checkpoints
    (r"LayerNorm\.beta$", "LayerNorm.bias"),
    (r"\.position_ids$", ""),  # a buffer some versions save
    (r"^cls\.predictions\.decoder\.weight$", ""),  # tied to the word embeddings
]

EMBEDDINGS = (
    "word_embeddings.weight",
    "position_embeddings.weight",
    "token_type_embeddings.weight",
    "LayerNorm.weight",
    "LayerNorm.bias",
)
# One BERT layer's tensors, relative to `bert.encoder.layer.N.`.
LAYER = tuple(
    f"{module}.{p}"
    for module in (
        "attention.self.query",
        "attention.self.key",
        "attention.self.value",
        "attention.output.dense",
        "attention.output.LayerNorm",
        "intermediate.dense",
        "output.dense",
        "output.LayerNorm",
    )
    for p in ("weight", "bias")
)
POOLER = ("pooler.dense.weight", "pooler.dense.bias")
MLM_HEAD = (
    "cls.predictions.transform.dense.weight",
    "cls.predictions.transform.dense.bias",
    "cls.predictions.transform.LayerNorm.weight",
    "cls.predictions.transform.LayerNorm.bias",
    "cls.predictions.bias",
)
# Where a BERT layer's parts go in the language side of an LXMERT cross-modality layer.
LXMERT_CROSS_LANG = {
    "attention.self.": "lang_self_att.self.",
    "attention.output.": "lang_self_att.output.",
    "intermediate.": "lang_ffn.intermediate.",
    "output.": "lang_ffn.output.",
}
# VL-BERT's segment ids: 0/1 for the sentences (A, B), 2 for the image (C); only the text rows come from BERT.
VLBERT_TEXT_SEGMENTS = 2
# BERT keys a checkpoint must hold for any text side to be initialised (the layers are checked per map).
REQUIRED = tuple(f"bert.embeddings.{p}" for p in EMBEDDINGS)


def _layer(ours: str, bert: str) -> dict[str, str]:
    return {f"{ours}.{p}": f"{bert}.{p}" for p in LAYER}


def _shared(prefix: str, pooler: bool = True) -> dict[str, str]:
    """Embeddings, pooler and MLM head: the same names in every architecture, under the encoder's prefix."""
    out = {f"{prefix}embeddings.{p}": f"bert.embeddings.{p}" for p in EMBEDDINGS}
    if pooler:
        out.update({f"{prefix}{p}": f"bert.{p}" for p in POOLER})
    out.update({p: p for p in MLM_HEAD})
    return out


def _bert_layers_in_order(out: dict[str, str], num_layers: int, bert_layers: int) -> dict[str, str]:
    """Our layer i <- BERT layer i, as far as both go (our extra layers stay random)."""
    for i in range(min(num_layers, bert_layers)):
        out.update(_layer(f"bert.encoder.layer.{i}", f"bert.encoder.layer.{i}"))
    return out


def visualbert_key_map(cfg: VisualBertConfig, bert_layers: int) -> dict[str, str]:
    """Our key -> BERT key for VisualBERT (pre-training or VQA model; both name the encoder `bert`)."""
    out = _bert_layers_in_order(_shared("bert."), cfg.num_layers, bert_layers)
    if cfg.special_visual_initialize:
        # The original code copies the text tables into the visual ones after loading BERT.
        out["bert.embeddings.visual_token_type_embeddings.weight"] = "bert.embeddings.token_type_embeddings.weight"
        out["bert.embeddings.visual_position_embeddings.weight"] = "bert.embeddings.position_embeddings.weight"
    return out


def lxmert_key_map(
    cfg: LxmertConfig, bert_layers: int, language_from: int = 0, cross_from: int | None = None
) -> dict[str, str]:
    """Our key -> BERT key for LXMERT: language layer i <- BERT layer language_from + i; with `cross_from`,
    the language side of cross-modality layer k <- BERT layer cross_from + k (while BERT has layers)."""
    if language_from < 0 or language_from + cfg.language_layers > bert_layers:
        raise VlbertsError(
            f"language_from={language_from}: the {cfg.language_layers} language layers need BERT layers "
            f"{language_from}..{language_from + cfg.language_layers - 1}, but the checkpoint has {bert_layers}"
        )
    out = _shared("lxmert.")
    for i in range(cfg.language_layers):
        out.update(_layer(f"lxmert.encoder.layer.{i}", f"bert.encoder.layer.{language_from + i}"))
    if cross_from is not None:
        if not 0 <= cross_from < bert_layers:
            raise VlbertsError(f"cross_from={cross_from} is not a layer of the BERT checkpoint (0..{bert_layers - 1})")
        for k in range(min(cfg.cross_layers, bert_layers - cross_from)):
            for p in LAYER:
                part = next(b for b in LXMERT_CROSS_LANG if p.startswith(b))
                ours = f"lxmert.x_layers.{k}.{LXMERT_CROSS_LANG[part]}{p[len(part):]}"
                out[ours] = f"bert.encoder.layer.{cross_from + k}.{p}"
    return out


def vilbert_key_map(cfg: ViLBertConfig, bert_layers: int) -> dict[str, str]:
    """Our key -> BERT key for ViLBERT (two-stream or single-stream): text embeddings, text layers, MLM
    head. No pooler: `t_pooler` is ViLBERT's own (ReLU into the co-attention width)."""
    return _bert_layers_in_order(_shared("bert.", pooler=False), cfg.num_layers, bert_layers)


def vlbert_key_map(cfg: VLBertConfig, bert_layers: int) -> dict[str, str]:
    """Our key -> BERT key for VL-BERT: embeddings (the segment table only in part, see `PARTIAL_ROWS`),
    layers, pooler, MLM head."""
    return _bert_layers_in_order(_shared("bert."), cfg.num_layers, bert_layers)


def wvisualbert_key_map(cfg: WVisualBertConfig, bert_layers: int) -> dict[str, str]:
    """Our key -> BERT key for W-VisualBERT (and its S / H / NT variants): embeddings, layers, pooler, MLM head."""
    return _bert_layers_in_order(_shared("bert."), cfg.num_layers, bert_layers)


# Tables copied only in part: our key -> how many of its leading rows may come from BERT (the rest keep
# their initialisation). Everything else must match BERT's shape exactly.
PARTIAL_ROWS: dict[type, dict[str, int]] = {
    VLBertConfig: {"bert.embeddings.token_type_embeddings.weight": VLBERT_TEXT_SEGMENTS},
}


@dataclass
class BertInitReport:
    """What `init_text_from_bert` did. Key lists hold our state-dict names (tied aliases left out: the
    MLM decoder weight is the word-embedding table) and the checkpoint's normalised names."""

    source: str
    mapping: dict[str, str]  # our key -> the BERT key copied into it
    initialised: list[str]
    random: list[str]
    unused: list[str] = field(default_factory=list)  # checkpoint keys nothing was copied from
    checkpoint: list[str] = field(default_factory=list)  # every checkpoint key (what `unused` is named against)
    # our key -> which rows took BERT's values, for tables copied in part (VL-BERT's segment table);
    # such a key is also listed in `initialised`
    partial: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """Three lines: what took BERT's values, what stayed random, what of the checkpoint went unused; a
        fourth names the tables copied in part, if any."""
        everything = self.initialised + self.random
        extra = [f"copied in part: {'; '.join(f'{k} {v}' for k, v in self.partial.items())}"] if self.partial else []
        return "\n".join([
            f"from BERT {self.source} ({len(self.initialised)} tensors): "
            f"{', '.join(_units(self.initialised, everything))}",
            f"left random ({len(self.random)} tensors): {', '.join(_units(self.random, everything)) or 'none'}",
            f"unused checkpoint tensors ({len(self.unused)}): {', '.join(_units(self.unused, self.checkpoint or self.unused)) or 'none'}",
            *extra,
        ])

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "initialised": self.initialised, "random": self.random,
                "unused": self.unused, "partial": self.partial, "mapping": self.mapping}


def read_bert_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Tensor]]:
    """config.json and the weights of a Hugging Face BERT directory, keys normalised to
    `BertForPreTraining` names."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise VlbertsError("not a Hugging Face BERT directory (no config.json)", path=path)
    config = read_json_object(path / "config.json")
    sd = rename_keys(read_state_dict(path), BERT_RULES)
    # The MLM output bias is one tensor tied under two names; some saves keep only the decoder's.
    bias = sd.pop("cls.predictions.decoder.bias", None)
    if bias is not None:
        sd.setdefault("cls.predictions.bias", bias)
    missing = [k for k in REQUIRED if k not in sd]
    if missing:
        raise VlbertsError(f"not a BERT checkpoint: no {missing[0]} among its tensors", path=path)
    return config, sd


def _bert_layers(sd: dict[str, Tensor]) -> int:
    idx = {int(m.group(1)) for k in sd if (m := re.match(r"^bert\.encoder\.layer\.(\d+)\.", k))}
    return max(idx) + 1 if idx else 0


def _check_config(bert: dict[str, Any], cfg: Any, path: Path) -> None:
    """Settings that change the function without changing any tensor's shape must agree."""
    checks = [
        ("num_attention_heads", "num_heads", bert.get("num_attention_heads"), cfg.num_heads),
        ("hidden_act", "hidden_act", bert.get("hidden_act", "gelu"), cfg.hidden_act),
        ("layer_norm_eps", "layer_norm_eps", bert.get("layer_norm_eps", 1e-12), cfg.layer_norm_eps),
        ("position_embedding_type", "(absolute positions)",
         bert.get("position_embedding_type", "absolute"), "absolute"),
    ]
    for theirs, ours, a, b in checks:
        if isinstance(a, str) and isinstance(b, (int, float)) and not isinstance(b, bool):
            try:  # a number written as a string ("4"), read as our own configs read one
                a = type(b)(a)
            except ValueError:
                kind = "whole number" if isinstance(b, int) else "number"
                raise VlbertsError(f"BERT checkpoint has {theirs}={a!r}: not a {kind}", path=path) from None
        if a != b:
            raise VlbertsError(f"BERT checkpoint has {theirs}={a!r} but the model has {ours}={b!r}", path=path)


def init_text_from_bert(
    model: nn.Module, path: str | Path, *, language_from: int = 0, cross_from: int | None = None
) -> BertInitReport:
    """Copy a Hugging Face BERT checkpoint into the text side of `model` (in place) and report what was copied.

    model: a VisualBERT, LXMERT, ViLBERT, VL-BERT or W-VisualBERT model of this package (pre-training or
        task model; `model.cfg` says which).
    language_from, cross_from: LXMERT only; which BERT layers feed the language and cross-modality
        layers (see the module docstring). Defaults: BERT layers 0..N_L-1 into the language layers, no
        cross-modality layer from BERT.
    """
    path = Path(path)
    cfg = getattr(model, "cfg", None)
    if type(cfg) not in KEY_MAPS:
        raise VlbertsError(f"no BERT key map for {type(model).__name__} (config {type(cfg).__name__})")
    if not isinstance(cfg, LxmertConfig) and (language_from or cross_from is not None):
        raise VlbertsError(f"language_from / cross_from choose LXMERT layers; {type(cfg).__name__} takes BERT's "
                           "layers in order")
    bert_cfg, sd = read_bert_checkpoint(path)
    _check_config(bert_cfg, cfg, path)
    n = _bert_layers(sd)
    if isinstance(cfg, LxmertConfig):
        mapping = lxmert_key_map(cfg, n, language_from, cross_from)
    else:
        mapping = KEY_MAPS[type(cfg)](cfg, n)
    rows = PARTIAL_ROWS.get(type(cfg), {})

    own = model.state_dict()
    mapping = {ours: b for ours, b in mapping.items() if ours in own}  # e.g. a VQA model has no MLM head
    absent = [b for ours, b in mapping.items() if b not in sd]
    # The pooler and the MLM head may be missing (BertModel, BertForMaskedLM); embeddings and layers not.
    needed = [b for b in absent if not b.startswith(("cls.", "bert.pooler."))]
    if needed:
        more = " ..." if len(needed) > 3 else ""
        raise VlbertsError(f"BERT checkpoint lacks {', '.join(needed[:3])}{more}", path=path)
    mapping = {ours: b for ours, b in mapping.items() if b in sd}
    partial: dict[str, str] = {}
    bad = []
    for ours, b in mapping.items():
        theirs, mine = sd[b].shape, own[ours].shape
        if ours in rows and theirs[1:] == mine[1:]:
            k = min(theirs[0], mine[0], rows[ours])  # rows 0..k-1 from BERT
            note = [f"{_rows(0, k - 1)} from BERT"]
            if k < mine[0]:
                note.append(f"{_rows(k, mine[0] - 1)} as initialised")
            if k < theirs[0]:
                note.append(f"BERT's {_rows(k, theirs[0] - 1)} unused")
            if len(note) > 1:
                partial[ours] = ", ".join(note)
        elif theirs != mine:
            bad.append(f"{ours} (file key {b}) {tuple(theirs)} vs {tuple(mine)}")
    if bad:
        raise VlbertsError(
            "BERT checkpoint does not fit the model (vocabulary or width differ): " + ", ".join(bad[:3]), path=path
        )
    # An integer tensor would be cast into the float weights by copy_ without a word; NaN or inf copied.
    problem = values_misfit({b: sd[b] for b in mapping.values()}, {b: own[ours] for ours, b in mapping.items()})
    if problem is not None:
        raise VlbertsError(f"tensor {problem[0]} {problem[1]}", path=path)

    with torch.no_grad():
        for ours, b in mapping.items():
            if ours in rows:
                k = min(sd[b].shape[0], own[ours].shape[0], rows[ours])
                own[ours][:k].copy_(sd[b][:k])  # the other rows keep their initialisation
            else:
                own[ours].copy_(sd[b])  # state_dict tensors share storage with the parameters
    tied = tied_aliases(model)
    keys = [k for k in own if k not in tied]
    used = set(mapping.values())
    return BertInitReport(
        source=str(path),
        mapping=mapping,
        initialised=[k for k in keys if k in mapping],
        random=[k for k in keys if k not in mapping],
        unused=[k for k in sd if k not in used],
        checkpoint=list(sd),
        partial=partial,
    )


# Config type -> key map (LXMERT's takes extra arguments and is called on its own).
KEY_MAPS = {
    VisualBertConfig: visualbert_key_map,
    LxmertConfig: lxmert_key_map,
    ViLBertConfig: vilbert_key_map,
    VLBertConfig: vlbert_key_map,
    WVisualBertConfig: wvisualbert_key_map,
}


def _units(keys: list[str], everything: list[str]) -> list[str]:
    """Short readable names for a set of tensor names: each tensor is named by its shortest enclosing
    module whose tensors (among `everything`) all lie in `keys`, never shorter than its first numbered
    block (a layer); runs of block numbers become ranges ("bert.encoder.layer.0-11")."""
    chosen = set(keys)
    names: list[str] = []
    for k in keys:
        parts = k.split(".")
        numbered = [i for i, c in enumerate(parts) if c.isdigit()]
        name = k
        for j in range((numbered[0] + 1) if numbered else 1, len(parts)):
            prefix = ".".join(parts[:j])
            if all(o in chosen for o in everything if o.startswith(prefix + ".")):
                name = prefix
                break
        if name not in names:
            names.append(name)
    # Merge names that differ only in their first number.
    groups: dict[tuple[str, str], list[int]] = {}
    order: list[tuple[str, str] | str] = []
    for name in names:
        m = re.match(r"^(.*?\.)(\d+)((?:\..*)?)$", name)
        if not m:
            order.append(name)
            continue
        key = (m.group(1), m.group(3))
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(m.group(2)))
    return [o if isinstance(o, str) else f"{o[0]}{_ranges(groups[o])}{o[1]}" for o in order]


def _rows(a: int, b: int) -> str:
    return f"row {a}" if a == b else f"rows {a}-{b}"


def _ranges(idx: list[int]) -> str:
    idx = sorted(set(idx))
    parts, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)
