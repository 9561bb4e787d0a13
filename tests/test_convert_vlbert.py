"""Original VL-BERT checkpoints (jackroos/VL-BERT) load through `models.convert_vlbert`.

The state dicts here are written key by key in the original layout (`ResNetVLBERTForPretraining[Multitask]`
with `VisualLinguisticBertForPretraining` under `vlbert.`), with the original shapes; the embedding layer is
checked against the released embedding computation written out below from `common/visual_linguistic_bert.py`
(`embedding`), `common/fast_rcnn.py` (`obj_downsample` over `cat(coord_embed, appearance)`) and
`common/utils/bbox.py` (`coordinate_embeddings`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from vlberts.data.batch import VLInputs
from vlberts.errors import VlbertsError
from vlberts.models.builders import vlbert_tiny
from vlberts.models.convert_vlbert import load_original_vlbert, load_vlbert_state_dict
from vlberts.models.vlbert import VLBertForPreTraining

CFG = dataclasses.replace(vlbert_tiny(), hidden_dropout=0.0, attention_dropout=0.0, visual_dropout=0.0)
D, V, L, FF, APP, GEO, C = CFG.hidden_size, CFG.vocab_size, CFG.num_layers, CFG.intermediate_size, \
    CFG.visual_dim, CFG.geometry_dim, CFG.num_region_classes


def original_state_dict(seed: int = 0, *, heads: bool = True, multitask: bool = True) -> dict[str, torch.Tensor]:
    """Random tensors under the original network's names and shapes."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.5

    sd = {
        "vlbert.word_embeddings.weight": r(V, D),
        "vlbert.end_embedding.weight": r(1, D),
        "vlbert.position_embeddings.weight": r(CFG.max_position_embeddings, D),
        "vlbert.token_type_embeddings.weight": r(3, D),
        "vlbert.embedding_LayerNorm.weight": 1 + r(D), "vlbert.embedding_LayerNorm.bias": r(D),
        "vlbert.visual_ln_text.weight": 1 + r(D), "vlbert.visual_ln_text.bias": r(D),
        "vlbert.visual_ln_object.weight": 1 + r(D), "vlbert.visual_ln_object.bias": r(D),
        "vlbert.pooler.dense.weight": r(D, D), "vlbert.pooler.dense.bias": r(D),
        "object_linguistic_embeddings.weight": r(1, D),
        "object_mask_word_embedding.weight": r(1, D),
        "object_mask_visual_embedding.weight": r(1, APP),
        "image_feature_extractor.obj_downsample.1.weight": r(D, GEO + APP),  # over cat(geometry, appearance)
        "image_feature_extractor.obj_downsample.1.bias": r(D),
    }
    if multitask:
        sd["aux_text_visual_embedding.weight"] = r(1, D)
    for n in range(L):
        p = f"vlbert.encoder.layer.{n}."
        for name, shape in [("attention.self.query", (D, D)), ("attention.self.key", (D, D)),
                            ("attention.self.value", (D, D)), ("attention.output.dense", (D, D)),
                            ("intermediate.dense", (FF, D)), ("output.dense", (D, FF))]:
            sd[p + name + ".weight"], sd[p + name + ".bias"] = r(*shape), r(shape[0])
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            sd[p + ln + ".weight"], sd[p + ln + ".bias"] = 1 + r(D), r(D)
    if heads:
        m = "vlbert.mlm_head.predictions."
        sd.update({m + "transform.dense.weight": r(D, D), m + "transform.dense.bias": r(D),
                   m + "transform.LayerNorm.weight": 1 + r(D), m + "transform.LayerNorm.bias": r(D),
                   m + "bias": r(V), m + "decoder.weight": sd["vlbert.word_embeddings.weight"].clone(),
                   "vlbert.mvrc_head.transform.dense.weight": r(D, D), "vlbert.mvrc_head.transform.dense.bias": r(D),
                   "vlbert.mvrc_head.region_cls_pred.weight": r(C, D), "vlbert.mvrc_head.region_cls_pred.bias": r(C)})
    return sd


def released_embedding(sd, ids, types, app, boxes_px, im_wh):
    """The released embedding layer for unpadded inputs whose first box is the whole image.

    ids/types (B, T); app (B, K, F) appearance with the whole image first; boxes_px (B, K, 4) x1 y1 x2 y2
    in pixels; im_wh (B, 2). Returns (B, T + K + 1, D)."""
    B, T = ids.shape
    K = app.shape[1]
    # coordinate_embeddings(boxes + image size, 256-equivalent): (cx, cy, w, h) / size * 100, sin/cos per number
    x1, y1, x2, y2 = boxes_px.unbind(-1)
    w, h = im_wh[:, None, 0], im_wh[:, None, 1]
    pos = torch.stack([(x1 + x2) / 2 / w, (y1 + y2) / 2 / h, (x2 - x1) / w, (y2 - y1) / h], -1) * 100  # (B, K, 4)
    dim = GEO // 8
    dim_mat = 1000 ** (torch.arange(dim, dtype=app.dtype) / dim)
    angle = pos[..., None] / dim_mat
    coord = torch.cat([angle.sin(), angle.cos()], -1).reshape(B, K, -1)  # (B, K, GEO)
    W, b = sd["image_feature_extractor.obj_downsample.1.weight"], sd["image_feature_extractor.obj_downsample.1.bias"]
    obj_reps = F.relu(torch.cat([coord, app], -1) @ W.T + b)  # (B, K, D)

    def ln(x, name):
        return F.layer_norm(x, (D,), sd[name + ".weight"], sd[name + ".bias"], eps=1e-12)

    text = sd["vlbert.word_embeddings.weight"][ids] + ln(obj_reps[:, :1], "vlbert.visual_ln_text")  # tag 0 = image
    objects = sd["object_linguistic_embeddings.weight"][0] + ln(obj_reps, "vlbert.visual_ln_object")
    end = sd["vlbert.end_embedding.weight"].expand(B, 1, D)
    vl = torch.cat([text, objects, end], 1)
    tt = torch.cat([types, torch.full((B, K + 1), 2)], 1)
    position = torch.cat([torch.arange(T).expand(B, T), torch.full((B, K), T), torch.full((B, 1), T + 1)], 1)
    e = vl + sd["vlbert.position_embeddings.weight"][position] + sd["vlbert.token_type_embeddings.weight"][tt]
    return ln(e, "vlbert.embedding_LayerNorm")


def test_embeddings_reproduce_the_released_computation():
    """In float64: the geometry's sin/cos of angles up to 100 rad would turn float32 rounding of the pixel
    scaling (ours normalised, theirs in pixels) into differences of ~1e-5."""
    torch.set_default_dtype(torch.float64)
    try:
        _check_embeddings()
    finally:
        torch.set_default_dtype(torch.float32)


def _check_embeddings():
    sd = {k: v.double() for k, v in original_state_dict().items()}
    model = load_vlbert_state_dict(VLBertForPreTraining(CFG).double(), sd, source="orig.model").eval()
    g = torch.Generator().manual_seed(1)
    B, T, R = 2, 6, 4
    ids = torch.randint(5, V, (B, T), generator=g)
    types = torch.zeros(B, T, dtype=torch.long)
    types[:, 4:] = 1
    im_wh = torch.tensor([[640.0, 480.0], [320.0, 400.0]])
    xy = torch.rand(B, R, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + 0.1 + torch.rand(B, R, 2, generator=g) * 0.4], -1)  # normalised xyxy
    feats = torch.rand(B, R, APP, generator=g)
    x = VLInputs(ids, types, torch.ones(B, T, dtype=torch.bool), feats, boxes, torch.ones(B, R, dtype=torch.bool))
    ours, mask = model.bert.embeddings(x, feats, torch.zeros(B, R, dtype=torch.bool))
    # the released network's inputs: the whole image as box 0, its appearance the mean of the regions'
    whole = torch.cat([torch.zeros(B, 1, 2), im_wh[:, None]], -1)
    boxes_px = torch.cat([whole, boxes * im_wh.repeat(1, 2)[:, None]], 1)
    app = torch.cat([feats.mean(1, keepdim=True), feats], 1)
    expected = released_embedding(sd, ids, types, app, boxes_px, im_wh)
    torch.testing.assert_close(ours, expected, atol=1e-10, rtol=0)
    assert mask.all()


def test_every_tensor_lands_where_the_table_says():
    sd = original_state_dict(multitask=True)
    model = load_vlbert_state_dict(VLBertForPreTraining(CFG), sd)
    own = model.state_dict()
    e = "bert.embeddings."
    assert torch.equal(own[e + "text_only_visual_embedding.weight"], sd["aux_text_visual_embedding.weight"])
    assert torch.equal(own[e + "img_embedding.weight"], sd["object_linguistic_embeddings.weight"])
    assert torch.equal(own[e + "object_mask_visual_embedding"], sd["object_mask_visual_embedding.weight"][0])
    W = sd["image_feature_extractor.obj_downsample.1.weight"]
    assert torch.equal(own[e + "visual_fc.weight"][:, :APP], W[:, GEO:])  # appearance columns first here
    assert torch.equal(own[e + "visual_fc.weight"][:, APP:], W[:, :GEO])
    assert torch.equal(own["bert.encoder.layer.1.output.LayerNorm.bias"], sd["vlbert.encoder.layer.1.output.LayerNorm.bias"])
    assert torch.equal(own["region_head.decoder.weight"], sd["vlbert.mvrc_head.region_cls_pred.weight"])
    assert torch.equal(own["cls.predictions.bias"], sd["vlbert.mlm_head.predictions.bias"])
    assert torch.equal(own["cls.predictions.decoder.weight"], sd["vlbert.word_embeddings.weight"])  # tied


def test_training_checkpoint_file_with_module_prefix_and_task_head(tmp_path):
    """`torch.save({"state_dict": ..., "optimizer": ...})` of a DDP-wrapped VQA network: no pre-training heads,
    `module.` everywhere, a `final_mlp` head to drop."""
    sd = original_state_dict(heads=False, multitask=False)
    sd["final_mlp.1.weight"] = torch.randn(7, D)
    path = tmp_path / "vl-bert_base_vqa-0019.model"
    torch.save({"state_dict": {"module." + k: v for k, v in sd.items()}, "optimizer": {"state": {}, "param_groups": []}},
               path)
    model = load_original_vlbert(path, CFG)
    assert torch.equal(model.bert.embeddings.end_embedding.weight, sd["vlbert.end_embedding.weight"])
    assert model.left_out_head == "the fine-tuning head final_mlp (1 tensor)"
    fresh = VLBertForPreTraining(CFG)  # heads and the absent text-only embedding keep the initialisation's shapes
    assert model.region_head.decoder.weight.shape == fresh.region_head.decoder.weight.shape


def test_released_pretraining_file_without_pooler_loads():
    """The released pre-training configs set `with_pooler: false` (cfgs/pretrain/base_prec_4x16G_fp32.yaml), so
    vl-bert-base-prec.model has no `vlbert.pooler.*`: the pooler keeps its initial values, as the release's task
    networks start theirs, and everything else loads."""
    sd = {k: v for k, v in original_state_dict().items() if not k.startswith("vlbert.pooler.")}
    torch.manual_seed(0)
    fresh = VLBertForPreTraining(CFG)
    torch.manual_seed(0)
    model = load_vlbert_state_dict(VLBertForPreTraining(CFG), sd)
    assert torch.equal(model.bert.pooler.dense.weight, fresh.bert.pooler.dense.weight)
    assert torch.equal(model.bert.embeddings.end_embedding.weight, sd["vlbert.end_embedding.weight"])
    assert model.left_out_head is None


def test_frozen_word_embedding_special_rows_are_merged():
    sd = original_state_dict()
    special = torch.randn(10, D)
    sd["vlbert.special_word_embeddings.weight"] = special  # the decoder stays tied to the frozen table
    model = load_vlbert_state_dict(VLBertForPreTraining(CFG), sd)
    words = model.bert.embeddings.word_embeddings.weight
    assert torch.equal(words[:10], special)
    assert torch.equal(words[10:], sd["vlbert.word_embeddings.weight"][10:])


@pytest.mark.parametrize("key,shape,match", [
    ("image_feature_extractor.backbone.conv1.weight", (4, 3, 7, 7), "drop_backbone=True"),
    ("vlbert.visual_1x1_object.weight", (D, D), "IMAGE_FINAL_DIM"),
    ("vlbert.visual_scale_text", (), "visual_ln: false"),
])
def test_unsupported_parts_are_named(key, shape, match):
    sd = original_state_dict()
    sd[key] = torch.randn(shape) if shape else torch.tensor(1.0)
    with pytest.raises(VlbertsError, match=match):
        load_vlbert_state_dict(VLBertForPreTraining(CFG), sd, source="x.model")


def test_end_to_end_backbone_can_be_dropped():
    sd = original_state_dict()
    sd["image_feature_extractor.backbone.conv1.weight"] = torch.randn(4, 3, 7, 7)
    sd["image_feature_extractor.head.0.0.conv1.weight"] = torch.randn(4, 4, 1, 1)
    model = load_vlbert_state_dict(VLBertForPreTraining(CFG), sd, drop_backbone=True)
    assert torch.equal(model.bert.pooler.dense.weight, sd["vlbert.pooler.dense.weight"])
    # what was left behind is named (`vlberts models import` prints it), and nothing when nothing was
    assert model.left_out_head == ("the end-to-end ResNet (2 image_feature_extractor.* tensors; region features "
                                   "come from a store)")
    assert load_vlbert_state_dict(VLBertForPreTraining(CFG), original_state_dict()).left_out_head is None


def test_mismatches_name_the_file_key():
    sd = original_state_dict()
    sd["vlbert.mvrc_head.region_cls_pred.weight"] = torch.randn(C + 3, D)
    with pytest.raises(VlbertsError, match=r"region_head.decoder.weight \(file key vlbert.mvrc_head.region_cls_pred.weight\)"):
        load_vlbert_state_dict(VLBertForPreTraining(CFG), sd, source="x.model")
    sd = original_state_dict()
    del sd["vlbert.encoder.layer.0.output.dense.bias"]
    with pytest.raises(VlbertsError, match="missing keys: bert.encoder.layer.0.output.dense.bias"):
        load_vlbert_state_dict(VLBertForPreTraining(CFG), sd, source="x.model")
    sd = original_state_dict()
    sd["vlbert.mlm_head.predictions.decoder.weight"] = torch.randn(V, D)
    with pytest.raises(VlbertsError, match="ties them"):
        load_vlbert_state_dict(VLBertForPreTraining(CFG), sd, source="x.model")
