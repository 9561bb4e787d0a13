"""Original VL-BERT checkpoints (jackroos/VL-BERT) -> vlberts' `VLBertForPreTraining`.

A released or self-trained VL-BERT file is `torch.save({"state_dict": net.state_dict(), "optimizer": ...})`
(`common/callbacks/epoch_end_callbacks/checkpoint.py`), named `PREFIX-EPOCH.model`; it is read with
`torch.load(weights_only=True)` (`models.weights.read_state_dict`), and the `module.` prefix that
(Distributed)DataParallel adds to every key is removed. The network is `ResNetVLBERTForPretraining` (or its
`...Multitask` form with the text-only corpus, or a task network such as `ResNetVLBERTForVQA`): the
transformer sits under `vlbert.` (`common/visual_linguistic_bert.py`, `VisualLinguisticBert[ForPretraining]`),
the visual network under `image_feature_extractor.` (`common/fast_rcnn.py`, `FastRCNN`), a few embeddings
at the top.

The rename table (applied to every key after `module.` is removed; N is a layer index):

| #  | original key                                                     | vlberts key                                        |
|----|------------------------------------------------------------------|----------------------------------------------------|
| 1  | `vlbert.{word,position,token_type,end}_embeddings`/`end_embedding` | `bert.embeddings.` + same name                  |
| 2  | `vlbert.embedding_LayerNorm.`                                    | `bert.embeddings.LayerNorm.`                       |
| 3  | `vlbert.visual_ln_text.`, `vlbert.visual_ln_object.`             | `bert.embeddings.visual_ln_text.` / `_object.`     |
| 4  | `vlbert.encoder.layer.N.` (BERT's names), `vlbert.pooler.dense.` | `bert.encoder.layer.N.`, `bert.pooler.dense.`      |
| 5  | `object_linguistic_embeddings.weight` (the [IMG] token)          | `bert.embeddings.img_embedding.weight`             |
| 6  | `object_mask_word_embedding.weight` (a masked RoI's token)       | `bert.embeddings.object_mask_word_embedding.weight` |
| 7  | `aux_text_visual_embedding.weight` (text-only samples, §3.3)     | `bert.embeddings.text_only_visual_embedding.weight` |
| 8  | `object_mask_visual_embedding.weight` (1, 2048)                  | `bert.embeddings.object_mask_visual_embedding` (2048,) |
| 9  | `image_feature_extractor.obj_downsample.1.` (Linear after Dropout) | `bert.embeddings.visual_fc.`, columns reordered: |
|    |                                                                  | theirs [geometry, appearance], ours [appearance, geometry] |
| 10 | `vlbert.mlm_head.predictions.{transform.dense,transform.LayerNorm,bias}` | `cls.predictions.` + same                  |
| 11 | `vlbert.mlm_head.predictions.decoder.weight`                     | dropped: tied to the word table (checked equal)    |
| 12 | `vlbert.mvrc_head.transform.dense.`, `vlbert.mvrc_head.region_cls_pred.` | `region_head.dense.`, `region_head.decoder.` |
| 13 | `vlbert.relationsip_head.caption_image_relationship.` (sic)      | `cls.seq_relationship.` (needs `with_match_head`)  |
| 14 | `vlbert.special_word_embeddings.weight` (`word_embedding_frozen`) | merged: rows 0..999 of the word table (the       |
|    |                                                                  | original input side looks ids < 1000 up there; its |
|    |                                                                  | tied decoder keeps the frozen rows, ours cannot)   |

Facts this rests on, read in the released code: the geometry embedding (`common/utils/bbox.py
coordinate_embeddings`, 256 wavelengths, (cx, cy, w, h) / image size x 100, [sin, cos] per number) is ours
(`models.vlbert.geometry_embedding`, `geometry_box="cxcywh"`); `obj_downsample` is Dropout -> Linear ->
ReLU over `cat(geometry, appearance)`, ours is the same over `cat(appearance, geometry)`, hence the column
swap; the text elements' visual term is the whole-image element's (`_collect_obj_reps` with tag 0), or
`aux_text_visual_embedding` for text-only samples, through `visual_ln_text`, as ours; objects take
position id = text length and [END] text length + 1 (`obj_pos_id_relative`), segment 2, as ours.

Not representable, and therefore errors rather than guesses:
- `vlbert.visual_1x1_text` / `visual_1x1_object` (configs whose `IMAGE_FINAL_DIM` differs from the hidden
  size: a second Linear after the ReLU), `visual_scale_text` / `visual_scale_object` (`visual_ln: false`),
  `image_feature_extractor.object_embed` (`IMAGE_SEMANTIC`);
- the ResNet of the end-to-end network (`image_feature_extractor.backbone.`, `.roi_head_feature_extractor.`,
  `.head.`): vlberts' VL-BERT reads precomputed region features (or trains its own small CNN), so these
  keys are an error unless `drop_backbone=True`, which loads everything else (the region features you
  then feed should come from a detector like the one the checkpoint was tuned with).
The task heads of the fine-tuning networks (`final_mlp.` of VQA, VCR and RefCOCO+, VCR's `cnn_loss_reg.`) are not
part of this model: they are left out and named in the model's `left_out_head`, as the ResNet is. A file
without MLM head keys (a task network) leaves the pre-training heads freshly initialised, and one without
the pooler (the released pre-training configs set `with_pooler: false`) leaves the pooler so. Any other missing, unexpected or mis-shaped key is a `VlbertsError` naming the
first offending keys (ours and the file's) and the file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from vlberts.errors import VlbertsError
from vlberts.models.builders import vlbert_base
from vlberts.models.vlbert import VLBertConfig, VLBertForPreTraining
from vlberts.models.weights import leave_out, load_into, read_state_dict, rename_key

_E = "bert.embeddings."
ORIGINAL_VLBERT_RULES = [
    (r"^vlbert\.(word_embeddings|position_embeddings|token_type_embeddings|end_embedding)\.", _E + r"\1."),  # 1
    (r"^vlbert\.embedding_LayerNorm\.", _E + "LayerNorm."),  # 2
    (r"^vlbert\.(visual_ln_text|visual_ln_object)\.", _E + r"\1."),  # 3
    (r"^vlbert\.(encoder|pooler)\.", r"bert.\1."),  # 4
    (r"^object_linguistic_embeddings\.", _E + "img_embedding."),  # 5
    (r"^object_mask_word_embedding\.", _E + "object_mask_word_embedding."),  # 6
    (r"^aux_text_visual_embedding\.", _E + "text_only_visual_embedding."),  # 7
    (r"^object_mask_visual_embedding\.weight$", _E + "object_mask_visual_embedding"),  # 8
    (r"^image_feature_extractor\.obj_downsample\.1\.", _E + "visual_fc."),  # 9
    (r"^vlbert\.mlm_head\.predictions\.decoder\.weight$", ""),  # 11 (before 10)
    (r"^vlbert\.mlm_head\.predictions\.", "cls.predictions."),  # 10
    (r"^vlbert\.mvrc_head\.transform\.dense\.", "region_head.dense."),  # 12
    (r"^vlbert\.mvrc_head\.region_cls_pred\.", "region_head.decoder."),  # 12
    (r"^vlbert\.relationsip_head\.caption_image_relationship\.", "cls.seq_relationship."),  # 13
]

_UNSUPPORTED = {
    "vlbert.visual_1x1_": "a projection after the visual FC (IMAGE_FINAL_DIM != hidden size)",
    "vlbert.visual_scale_": "scalar visual scales (visual_ln: false)",
    "image_feature_extractor.object_embed.": "detector-class embeddings in the visual FC (IMAGE_SEMANTIC)",
}
_BACKBONE = ("image_feature_extractor.backbone.", "image_feature_extractor.roi_head_feature_extractor.",
             "image_feature_extractor.head.", "image_feature_extractor.regularizing_predictor.")
_WORDS, _SPECIAL, _DECODER = "vlbert.word_embeddings.weight", "vlbert.special_word_embeddings.weight", \
    "vlbert.mlm_head.predictions.decoder.weight"
_VISUAL_FC = "image_feature_extractor.obj_downsample.1.weight"
_HEADS = ("cls.", "region_head.")
# The task heads of the released fine-tuning networks (vqa/, vcr/, refcoco/ modules): the answer, choice or
# region scorer, and VCR's object classifier on the final states (ENABLE_CNN_REG_LOSS with CNN_LOSS_TOP).
VLBERT_TASK_HEADS = {"final_mlp.": "final_mlp", "cnn_loss_reg.": "cnn_loss_reg"}


def _backbone_keys(sd: dict[str, Tensor]) -> list[str]:
    """The keys of the end-to-end network's ResNet (`_BACKBONE`) in a state dict of original names."""
    return [k for k in sd if k.startswith(_BACKBONE)]


def original_to_vlberts(
    sd: dict[str, Tensor],
    cfg: VLBertConfig,
    *,
    source: str | Path = "<state dict>",
    drop_prefixes: tuple[str, ...] = (),
    drop_backbone: bool = False,
) -> tuple[dict[str, Tensor], dict[str, str]]:
    """An original-layout state dict -> (our state dict, our key -> file key), through the table above."""
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    sd = {k: v for k, v in sd.items() if not (drop_prefixes and k.startswith(drop_prefixes))}
    for prefix, what in _UNSUPPORTED.items():
        bad = [k for k in sd if k.startswith(prefix)]
        if bad:
            raise VlbertsError(f"{bad[0]}: {what} is not supported by vlberts' VL-BERT", path=source)
    backbone = _backbone_keys(sd)
    if backbone and not drop_backbone:
        raise VlbertsError(f"{backbone[0]} (+{len(backbone) - 1} more): this is an end-to-end checkpoint with its "
                           "ResNet; vlberts' VL-BERT reads precomputed region features: pass drop_backbone=True "
                           "to load everything else", path=source)
    sd = {k: v for k, v in sd.items() if k not in backbone}

    words, decoder = sd.get(_WORDS), sd.get(_DECODER)
    if words is not None and decoder is not None and not torch.equal(words, decoder):
        raise VlbertsError(f"{_DECODER} differs from {_WORDS}; VL-BERT ties them, so this is not a VL-BERT "
                           "checkpoint", path=source)
    if words is not None and _SPECIAL in sd:
        # Row 14: the input side reads ids < 1000 ([PAD], [unused*], [UNK], [CLS], [SEP], [MASK]) from the
        # special table while the tied MLM decoder keeps the frozen rows; one tied table cannot hold both, so
        # those 1000 decoder rows change too (they are never MLM targets, except [UNK]).
        special = sd.pop(_SPECIAL)
        words = words.clone()
        words[: special.shape[0]] = special
        sd[_WORDS] = words
        sd.pop(_DECODER, None)

    ours, file_names = {}, {}
    for k, v in sd.items():
        name = rename_key(k, ORIGINAL_VLBERT_RULES)
        if not name:
            continue
        if k == _VISUAL_FC:  # row 9: [geometry | appearance] columns -> [appearance | geometry]
            if v.shape[1] != cfg.geometry_dim + cfg.visual_dim:
                raise VlbertsError(f"{k} has {v.shape[1]} inputs; the config expects geometry {cfg.geometry_dim} + "
                                   f"appearance {cfg.visual_dim}", path=source)
            v = torch.cat([v[:, cfg.geometry_dim :], v[:, : cfg.geometry_dim]], dim=1)
        elif name == _E + "object_mask_visual_embedding":  # row 8: an Embedding(1, F) there, a vector here
            v = v.reshape(-1)
        ours[name], file_names[name] = v, k
    return ours, file_names


def load_vlbert_state_dict(
    model: VLBertForPreTraining,
    sd: dict[str, Tensor],
    *,
    source: str | Path = "<state dict>",
    drop_prefixes: tuple[str, ...] = (),
    drop_backbone: bool = False,
) -> VLBertForPreTraining:
    """Copy an original-layout state dict into `model` (module docstring). Returns `model`.

    Always allowed to be missing: the text-only visual embedding (only the multitask network has one), the
    masked-RoI appearance (absent when raw pixels are masked) and the pooler (`with_pooler: false`); they keep
    their initial values. Without any MLM head key in the file, every pre-training head stays freshly
    initialised. A fine-tuning network's task heads are left out, as the ResNet is with `drop_backbone`."""
    sd = {k.removeprefix("module."): v for k, v in sd.items()}
    sd, heads = leave_out(sd, VLBERT_TASK_HEADS)
    ours, file_names = original_to_vlberts(sd, model.cfg, source=source, drop_prefixes=drop_prefixes,
                                           drop_backbone=drop_backbone)
    backbone = len(_backbone_keys(sd))  # dropped above, if any
    has_heads = any(k.startswith("cls.predictions.") for k in ours)
    optional = (_E + "text_only_visual_embedding.", _E + "object_mask_visual_embedding", _E + "object_mask_word_embedding.",
                "bert.pooler.")
    load_into(
        model, ours, source=source, file_names=file_names,
        allow_missing=lambda k: k.startswith(optional) or (not has_heads and k.startswith(_HEADS)),
    )
    model.tie_weights()
    # What was left behind, as `convert_hf` names a fine-tuned file's task head (`vlberts models import`
    # prints it and keeps it in config.json's `left_out`)
    resnet = (f"the end-to-end ResNet ({backbone} image_feature_extractor.* tensors; region features come from a "
              "store)") if backbone else None
    model.left_out_head = "; ".join(note for note in (resnet, heads) if note) or None
    return model


def load_original_vlbert(
    path: str | Path,
    config: VLBertConfig | None = None,
    *,
    drop_prefixes: tuple[str, ...] = (),
    drop_backbone: bool = False,
) -> VLBertForPreTraining:
    """Load an original VL-BERT file (`PREFIX-EPOCH.model`, or a bare state dict) into a new
    `VLBertForPreTraining` with `config` (default `builders.vlbert_base()`: BERT-base, 2048-d appearance
    and geometry, 1601 region classes). A config that does not fit the file gives a `VlbertsError` naming
    the mis-shaped or missing keys; e.g. set `num_region_classes` to the file's `mvrc_head` size, or
    `with_match_head=True` for a file trained with the relationship head."""
    model = VLBertForPreTraining(config or vlbert_base())
    return load_vlbert_state_dict(model, read_state_dict(path), source=path, drop_prefixes=drop_prefixes,
                                  drop_backbone=drop_backbone)
