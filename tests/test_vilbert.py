"""ViLBERT: the original key layout loads through the converter and reproduces the released forward pass
(written out below from vilbert-multi-task's module tree), SDPA vs explicit attention, padding, stream
exchange only through co-attention, [IMG] and 5-d locations by hand, backward, builders and configs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vlberts.config import to_dict
from vlberts.data.batch import VLInputs
from vlberts.errors import VlbertsError
from vlberts.models.builders import (
    MODEL_CONFIGS,
    build_pretraining_model,
    config_from_dict,
    model_config,
    vilbert_base,
    vilbert_depth2,
    vilbert_depth4,
    vilbert_depth6,
    vilbert_depth8,
    vilbert_single_stream,
    vilbert_tiny,
)
from vlberts.models.convert_vilbert import (
    load_original_vilbert,
    load_vilbert_state_dict,
    vilbert_config_from_original,
)
from vlberts.models.vilbert import ViLBertConfig, ViLBertForPreTraining, image_sequence

TOL = 1e-5


def _close(a, b, atol=TOL):
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def _inputs(seed=0, B=3, T=9, R=5, F=16, V=100):
    """Text padded in example 1, regions padded in example 2 (their features are garbage on purpose)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:] = False
    ids[1, 6:] = 0
    types = torch.zeros(B, T, dtype=torch.long)
    types[:, 5:] = 1
    rmask = torch.ones(B, R, dtype=torch.bool)
    rmask[2, 3:] = False
    feats = torch.randn(B, R, F, generator=g)
    feats[2, 3:] = 50.0
    xy = torch.rand(B, R, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + torch.rand(B, R, 2, generator=g) * 0.5], dim=-1)  # normalised xyxy
    return VLInputs(ids, types, mask, feats, boxes, rmask)


def _single_stream_tiny(**kw):
    return vilbert_single_stream(
        vocab_size=100, hidden_size=32, num_heads=2, intermediate_size=48, num_layers=2, max_position_embeddings=64,
        visual_dim=16, bi_hidden_size=16, bi_num_heads=2, num_region_classes=11, **kw,
    )


VARIANTS = {
    "two-stream": lambda: vilbert_tiny(),
    "no-img-token": lambda: vilbert_tiny(add_image_token=False),
    "single-stream": _single_stream_tiny,
}


def _model(cfg, seed=0):
    """A model in eval mode whose every parameter is random (BERT init leaves biases 0 and LayerNorms 1,
    which would hide a misplaced bias)."""
    torch.manual_seed(seed)
    model = build_pretraining_model(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model


# --------------------------------------------------------------------------- the original layout, written out

ORIGINAL_CONFIG = {  # the released JSON format (bert_base_6layer_6conect.json), at tiny sizes
    "attention_probs_dropout_prob": 0.1, "hidden_act": "gelu", "hidden_dropout_prob": 0.1, "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 48, "max_position_embeddings": 64, "num_attention_heads": 2,
    "num_hidden_layers": 3, "type_vocab_size": 2, "vocab_size": 100, "v_feature_size": 16, "v_target_size": 11,
    "v_hidden_size": 24, "v_num_hidden_layers": 2, "v_num_attention_heads": 2, "v_intermediate_size": 40,
    "bi_hidden_size": 16, "bi_num_attention_heads": 2, "bi_intermediate_size": 40, "bi_attention_type": 1,
    "v_attention_probs_dropout_prob": 0.1, "v_hidden_act": "gelu", "v_hidden_dropout_prob": 0.1,
    "v_initializer_range": 0.02, "v_biattention_id": [0, 1], "t_biattention_id": [1, 2], "pooling_method": "mul",
}


def _original_shapes(o: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of vilbert-multi-task's `BertForMultiModalPreTraining`, by its name in the file."""
    D, Dv, Db, V = o["hidden_size"], o["v_hidden_size"], o["bi_hidden_size"], o["vocab_size"]
    I, Iv, C = o["intermediate_size"], o["v_intermediate_size"], o["v_target_size"]
    shapes: dict[str, tuple[int, ...]] = {}

    def lin(name, n_in, n_out):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (n_out, n_in), (n_out,)

    def ln(name, d):
        shapes[f"{name}.weight"], shapes[f"{name}.bias"] = (d,), (d,)

    def bert_layer(p, d, di):
        for n in ("query", "key", "value"):
            lin(f"{p}.attention.self.{n}", d, d)
        lin(f"{p}.attention.output.dense", d, d)
        ln(f"{p}.attention.output.LayerNorm", d)
        lin(f"{p}.intermediate.dense", d, di)
        lin(f"{p}.output.dense", di, d)
        ln(f"{p}.output.LayerNorm", d)

    shapes["bert.embeddings.word_embeddings.weight"] = (V, D)
    shapes["bert.embeddings.position_embeddings.weight"] = (o["max_position_embeddings"], D)
    shapes["bert.embeddings.token_type_embeddings.weight"] = (o["type_vocab_size"], D)
    ln("bert.embeddings.LayerNorm", D)
    lin("bert.v_embeddings.image_embeddings", o["v_feature_size"], Dv)
    lin("bert.v_embeddings.image_location_embeddings", 5, Dv)
    ln("bert.v_embeddings.LayerNorm", Dv)
    for i in range(o["num_hidden_layers"]):
        bert_layer(f"bert.encoder.layer.{i}", D, I)
    for i in range(o["v_num_hidden_layers"]):
        bert_layer(f"bert.encoder.v_layer.{i}", Dv, Iv)
    for i in range(len(o["t_biattention_id"])):
        p = f"bert.encoder.c_layer.{i}"
        for n in ("query1", "key1", "value1"):
            lin(f"{p}.biattention.{n}", Dv, Db)
        for n in ("query2", "key2", "value2"):
            lin(f"{p}.biattention.{n}", D, Db)
        lin(f"{p}.biOutput.dense1", Db, Dv)
        ln(f"{p}.biOutput.LayerNorm1", Dv)
        lin(f"{p}.biOutput.q_dense1", Db, Dv)
        lin(f"{p}.biOutput.dense2", Db, D)
        ln(f"{p}.biOutput.LayerNorm2", D)
        lin(f"{p}.biOutput.q_dense2", Db, D)
        lin(f"{p}.v_intermediate.dense", Dv, Iv)
        lin(f"{p}.v_output.dense", Iv, Dv)
        ln(f"{p}.v_output.LayerNorm", Dv)
        lin(f"{p}.t_intermediate.dense", D, I)
        lin(f"{p}.t_output.dense", I, D)
        ln(f"{p}.t_output.LayerNorm", D)
    lin("bert.t_pooler.dense", D, Db)
    lin("bert.v_pooler.dense", Dv, Db)
    lin("cls.predictions.transform.dense", D, D)
    ln("cls.predictions.transform.LayerNorm", D)
    shapes["cls.predictions.bias"] = (V,)
    lin("cls.bi_seq_relationship", Db, 2)
    lin("cls.imagePredictions.transform.dense", Dv, Dv)
    ln("cls.imagePredictions.transform.LayerNorm", Dv)
    lin("cls.imagePredictions.decoder", Dv, C)
    return shapes


def _original_state_dict(o: dict = ORIGINAL_CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for k, shape in _original_shapes(o).items():
        t = torch.randn(shape, generator=g) * 0.3
        sd[k] = t + 1 if "LayerNorm.weight" in k else t
    sd["cls.predictions.decoder.weight"] = sd["bert.embeddings.word_embeddings.weight"]  # tied, saved twice
    return sd


def _original_forward(sd, o, ids, types, tmask, feats, loc, vmask):
    """The released forward pass (vilbert-multi-task `BertForMultiModalPreTraining`, eval mode), read off
    the file's keys. `feats`, `loc`, `vmask` already hold the [IMG] element the original loaders prepend."""
    H, Hv, Hb = o["num_attention_heads"], o["v_num_attention_heads"], o["bi_num_attention_heads"]

    def lin(x, n):
        return x @ sd[f"{n}.weight"].T + sd[f"{n}.bias"]

    def ln(x, n):
        return F.layer_norm(x, x.shape[-1:], sd[f"{n}.weight"], sd[f"{n}.bias"], eps=1e-12)

    def att(q, k, v, heads, bias):
        B, Sq, W = q.shape
        d = W // heads
        q, k, v = (t.view(B, -1, heads, d).transpose(1, 2) for t in (q, k, v))
        p = (q @ k.transpose(-1, -2) / math.sqrt(d) + bias).softmax(-1)
        return (p @ v).transpose(1, 2).reshape(B, Sq, W), p

    def layer(x, p, heads, bias):
        a, _ = att(lin(x, f"{p}.attention.self.query"), lin(x, f"{p}.attention.self.key"),
                   lin(x, f"{p}.attention.self.value"), heads, bias)
        h = ln(lin(a, f"{p}.attention.output.dense") + x, f"{p}.attention.output.LayerNorm")
        return ln(lin(F.gelu(lin(h, f"{p}.intermediate.dense")), f"{p}.output.dense") + h, f"{p}.output.LayerNorm")

    t_bias = ((1.0 - tmask.float()) * -10000.0)[:, None, None, :]
    v_bias = ((1.0 - vmask.float()) * -10000.0)[:, None, None, :]
    pos = torch.arange(ids.shape[1])
    t = sd["bert.embeddings.word_embeddings.weight"][ids] + sd["bert.embeddings.position_embeddings.weight"][pos]
    t = ln(t + sd["bert.embeddings.token_type_embeddings.weight"][types], "bert.embeddings.LayerNorm")
    v = lin(feats, "bert.v_embeddings.image_embeddings") + lin(loc, "bert.v_embeddings.image_location_embeddings")
    v = ln(v, "bert.v_embeddings.LayerNorm")
    ts = vs = 0
    t2v = []
    for k, (te, ve) in enumerate(zip(o["t_biattention_id"], o["v_biattention_id"])):
        for i in range(ts, te):
            t = layer(t, f"bert.encoder.layer.{i}", H, t_bias)
        for i in range(vs, ve):
            v = layer(v, f"bert.encoder.v_layer.{i}", Hv, v_bias)
        c = f"bert.encoder.c_layer.{k}"
        ctx1, p1 = att(lin(t, f"{c}.biattention.query2"), lin(v, f"{c}.biattention.key1"),
                       lin(v, f"{c}.biattention.value1"), Hb, v_bias)
        ctx2, _ = att(lin(v, f"{c}.biattention.query1"), lin(t, f"{c}.biattention.key2"),
                      lin(t, f"{c}.biattention.value2"), Hb, t_bias)
        v_att = ln(lin(ctx2, f"{c}.biOutput.dense1") + v, f"{c}.biOutput.LayerNorm1")
        t_att = ln(lin(ctx1, f"{c}.biOutput.dense2") + t, f"{c}.biOutput.LayerNorm2")
        v_ffn = lin(F.gelu(lin(v_att, f"{c}.v_intermediate.dense")), f"{c}.v_output.dense")
        v = ln(v_ffn + v_att, f"{c}.v_output.LayerNorm")
        t_ffn = lin(F.gelu(lin(t_att, f"{c}.t_intermediate.dense")), f"{c}.t_output.dense")
        t = ln(t_ffn + t_att, f"{c}.t_output.LayerNorm")
        t2v.append(p1)
        ts, vs = te, ve
    for i in range(vs, o["v_num_hidden_layers"]):
        v = layer(v, f"bert.encoder.v_layer.{i}", Hv, v_bias)
    for i in range(ts, o["num_hidden_layers"]):
        t = layer(t, f"bert.encoder.layer.{i}", H, t_bias)
    pooled = torch.relu(lin(t[:, 0], "bert.t_pooler.dense")) * torch.relu(lin(v[:, 0], "bert.v_pooler.dense"))
    h = ln(F.gelu(lin(t, "cls.predictions.transform.dense")), "cls.predictions.transform.LayerNorm")
    mlm = h @ sd["cls.predictions.decoder.weight"].T + sd["cls.predictions.bias"]
    hv = ln(F.gelu(lin(v, "cls.imagePredictions.transform.dense")), "cls.imagePredictions.transform.LayerNorm")
    return {"text": t, "vision": v, "pooled": pooled, "mlm": mlm, "match": lin(pooled, "cls.bi_seq_relationship"),
            "image": lin(hv, "cls.imagePredictions.decoder"), "t2v": t2v}


def _with_original_image_element(x: VLInputs):
    """What the original fine-tuning loaders feed the model: a global feature (sum of the boxes' features
    / number of boxes) with location [0, 0, 1, 1, 1] in front; 5-d locations by their formula."""
    m = x.region_mask.float()[..., None]
    g = (x.region_feats * m).sum(1, keepdim=True) / m.sum(1, keepdim=True)
    b = x.region_boxes
    area = ((b[..., 3] - b[..., 1]) * (b[..., 2] - b[..., 0]))[..., None]
    loc = torch.cat([b, area], dim=-1)
    whole = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0]).expand(len(b), 1, 5)
    ones = torch.ones(len(b), 1, dtype=torch.bool)
    return torch.cat([g, x.region_feats], 1), torch.cat([whole, loc], 1), torch.cat([ones, x.region_mask], 1)


def _write_original(tmp_path, sd, config=ORIGINAL_CONFIG):
    torch.save(sd, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path / "pytorch_model.bin", tmp_path / "config.json"


def test_original_checkpoint_reproduces_the_released_forward_pass(tmp_path):
    sd = _original_state_dict()
    weights, config = _write_original(tmp_path, sd)
    model = load_original_vilbert(weights, config).eval()
    x = _inputs()
    with torch.no_grad():
        out = model(x)
        slow = model(x, need_attn=True)
        ref = _original_forward(sd, ORIGINAL_CONFIG, x.input_ids, x.token_type_ids, x.attention_mask,
                                *_with_original_image_element(x))
    enc = out.encoded
    _close(enc.text, ref["text"])
    _close(enc.image, ref["vision"][:, 0])
    _close(enc.vision, ref["vision"][:, 1:])
    _close(enc.pooled, ref["pooled"])
    _close(out.mlm_logits, ref["mlm"])
    _close(out.match_logits, ref["match"])
    _close(out.region_logits, ref["image"][:, 1:])
    maps = slow.encoded.attentions
    for ours, want in zip(maps.text_to_vision, ref["t2v"], strict=True):
        assert ours.shape == (3, 2, 9, 6)  # (B, Hbi, T, R + 1): [IMG] is column 0
        _close(ours, want)
    _close(maps.text_to_region(), torch.stack(ref["t2v"])[..., 1:])

    # Every tensor of the file landed somewhere, except the unused q_dense pairs and the tied decoder.
    own = {k for k in model.state_dict() if k != "cls.predictions.decoder.weight"}
    dropped = [k for k in sd if ".q_dense" in k] + ["cls.predictions.decoder.weight"]
    assert len(dropped) == 2 * 2 * 2 + 1 and len(own) == len(sd) - len(dropped)
    # A few by identity of value, in the directions that are easy to swap.
    c1 = model.bert.c_layers[1]
    pairs = {
        "bert.encoder.c_layer.1.biattention.query2.weight": c1.text_attention.self.query.weight,
        "bert.encoder.c_layer.1.biattention.key1.weight": c1.text_attention.self.key.weight,
        "bert.encoder.c_layer.1.biattention.query1.weight": c1.vision_attention.self.query.weight,
        "bert.encoder.c_layer.1.biattention.value2.bias": c1.vision_attention.self.value.bias,
        "bert.encoder.c_layer.1.biOutput.LayerNorm2.weight": c1.text_attention.output.LayerNorm.weight,
        "bert.encoder.c_layer.1.biOutput.dense1.weight": c1.vision_attention.output.dense.weight,
        "bert.encoder.c_layer.1.v_output.LayerNorm.bias": c1.vision_ffn.output.LayerNorm.bias,
        "bert.encoder.v_layer.1.attention.self.query.weight": model.bert.v_encoder.layer[1].attention.self.query.weight,
        "cls.imagePredictions.decoder.weight": model.cls.region_predictions.decoder.weight,
    }
    for k, p in pairs.items():
        assert torch.equal(sd[k], p), k
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_original_config_translation():
    cfg = vilbert_config_from_original(ORIGINAL_CONFIG)
    assert cfg == vilbert_tiny()  # the tiny builder is this very config
    for bad, match in (
        ({"pooling_method": "sum"}, "fusion_method 'mul'"), ({"dynamic_attention": True}, "dynamic"),
        ({"task_specific_tokens": True}, "task_specific_tokens"), ({"with_coattention": False}, "with_coattention"),
    ):
        with pytest.raises(VlbertsError, match=match):
            vilbert_config_from_original({**ORIGINAL_CONFIG, **bad})
    with pytest.raises(VlbertsError, match="lacks bi_hidden_size"):
        vilbert_config_from_original({k: v for k, v in ORIGINAL_CONFIG.items() if k != "bi_hidden_size"})
    with pytest.raises(VlbertsError, match="must have the same length"):
        vilbert_config_from_original({**ORIGINAL_CONFIG, "v_biattention_id": [0]})


def _load_error(sd, **kw) -> str:
    with pytest.raises(VlbertsError) as err:
        load_vilbert_state_dict(ViLBertForPreTraining(vilbert_tiny()), sd, source="orig.bin", **kw)
    return str(err.value)


def test_misnamed_key_is_named_as_in_the_file():
    sd = _original_state_dict()
    sd["bert.encoder.c_layer.0.biattention.quary1.weight"] = sd.pop("bert.encoder.c_layer.0.biattention.query1.weight")
    msg = _load_error(sd)
    assert msg.startswith("orig.bin: weights do not fit the model")
    assert "missing keys: bert.c_layers.0.vision_attention.self.query.weight" in msg
    assert "unexpected keys: bert.encoder.c_layer.0.biattention.quary1.weight" in msg


def test_wrong_shape_names_our_key_and_the_file_key():
    sd = _original_state_dict()
    sd["bert.encoder.c_layer.1.biOutput.dense2.weight"] = torch.zeros(32, 17)
    sd["bert.v_embeddings.image_location_embeddings.weight"] = torch.zeros(24, 4)
    msg = _load_error(sd)
    assert ("shape mismatch: bert.v_embeddings.image_location_embeddings.weight (24, 4) vs (24, 5), "
            "bert.c_layers.1.text_attention.output.dense.weight (file key "
            "bert.encoder.c_layer.1.biOutput.dense2.weight) (32, 17) vs (32, 16)") in msg


def test_unsupported_and_fine_tuning_keys():
    sd = _original_state_dict()
    msg = _load_error({**sd, "bert.embeddings.task_embeddings.weight": torch.zeros(20, 32)})
    assert "unexpected keys: bert.embeddings.task_embeddings.weight" in msg
    # A fine-tuned VILBertForVLTasks file: its task heads are left out and named, the rest loads
    heads = {"vil_prediction.logit_fc.0.weight": torch.zeros(32, 16), "vil_prediction.logit_fc.3.bias": torch.zeros(9),
             "vil_logit.weight": torch.zeros(1, 16), "vision_logit.bias": torch.zeros(1),
             "linguisic_logit.weight": torch.zeros(1, 32)}
    model = load_vilbert_state_dict(ViLBertForPreTraining(vilbert_tiny()), {**sd, **heads})
    assert torch.equal(model.bert.t_pooler.dense.weight, sd["bert.t_pooler.dense.weight"])
    assert model.left_out_head == "the fine-tuning heads vil_prediction, vil_logit, vision_logit, linguisic_logit (5 tensors)"
    assert load_vilbert_state_dict(ViLBertForPreTraining(vilbert_tiny()), sd).left_out_head is None
    assert "unexpected keys: vil_something_new.weight" in _load_error({**sd, "vil_something_new.weight": torch.zeros(1)})
    untied = {**sd, "cls.predictions.decoder.weight": sd["cls.predictions.decoder.weight"] + 1}
    assert "differs from bert.embeddings.word_embeddings.weight" in _load_error(untied)


def test_bare_encoder_and_old_layernorm_names_load():
    sd = {k[len("bert."):]: v for k, v in _original_state_dict().items() if k.startswith("bert.")}
    sd = {(k[: -len(".weight")] + ".gamma" if "LayerNorm.weight" in k else k): v for k, v in sd.items()}
    model = load_vilbert_state_dict(ViLBertForPreTraining(vilbert_tiny()), sd)  # heads stay fresh
    assert torch.equal(model.bert.embeddings.LayerNorm.weight, sd["embeddings.LayerNorm.gamma"])
    partial = {k: v for k, v in _original_state_dict().items() if k != "cls.bi_seq_relationship.bias"}
    assert "missing keys: cls.bi_seq_relationship.bias" in _load_error(partial)


def test_default_config_is_the_released_base_and_a_misfit_is_an_error(tmp_path):
    weights, _ = _write_original(tmp_path, _original_state_dict())
    with pytest.raises(VlbertsError, match=r"pytorch_model\.bin: weights do not fit the model; shape mismatch"):
        load_original_vilbert(weights)  # tiny weights, base config


# --------------------------------------------------------------------------- the model on its own

@pytest.mark.parametrize("variant", VARIANTS)
def test_sdpa_and_explicit_attention_agree_and_maps_are_distributions(variant):
    cfg = VARIANTS[variant]()
    model = _model(cfg)
    x = _inputs()
    with torch.no_grad():
        fast = model(x)
        slow = model(x, need_attn=True)
    assert fast.encoded.attentions is None
    for name in ("mlm_logits", "match_logits", "region_logits"):
        _close(getattr(fast, name), getattr(slow, name))
    _close(fast.encoded.text, slow.encoded.text)
    _close(fast.encoded.vision, slow.encoded.vision)
    maps = slow.encoded.attentions
    B, T, R = 3, 9, 5
    Rp = R + int(cfg.add_image_token)
    if cfg.single_stream:
        S = T + Rp
        assert [m.shape for m in maps.joint] == [(B, 2, S, S)] * 2
        assert maps.region_index.tolist() == list(range(T + 1, S))
        _close(maps.joint[0].sum(-1), torch.ones(B, 2, S))
    else:
        assert [m.shape for m in maps.text_self] == [(B, 2, T, T)] * 3
        assert [m.shape for m in maps.vision_self] == [(B, 2, Rp, Rp)] * 2
        assert [m.shape for m in maps.text_to_vision] == [(B, 2, T, Rp)] * 2  # (B, Hbi, T, R')
        assert [m.shape for m in maps.vision_to_text] == [(B, 2, Rp, T)] * 2
        for m in maps.text_to_vision + maps.vision_to_text + maps.text_self + maps.vision_self:
            _close(m.sum(-1), torch.ones(m.shape[:-1]))
        # Padded regions of example 2 and padded words of example 1 get no attention.
        assert maps.text_to_vision[0][2, :, :, Rp - 2:].abs().max() == 0
        assert maps.vision_to_text[1][1, :, :, 6:].abs().max() == 0
    t2r = maps.text_to_region()
    assert t2r.shape == (2, B, 2, T, R)  # the caller's regions only


@pytest.mark.parametrize("variant", VARIANTS)
def test_padding_does_not_change_real_outputs(variant):
    model = _model(VARIANTS[variant]())
    x = _inputs()
    with torch.no_grad():
        out = model(x)
        for b, (T, R) in enumerate([(9, 5), (6, 5), (9, 3)]):
            one = VLInputs(x.input_ids[b:b + 1, :T], x.token_type_ids[b:b + 1, :T], x.attention_mask[b:b + 1, :T],
                           x.region_feats[b:b + 1, :R], x.region_boxes[b:b + 1, :R], x.region_mask[b:b + 1, :R])
            alone = model(one)
            _close(out.encoded.text[b:b + 1, :T], alone.encoded.text)
            _close(out.encoded.vision[b:b + 1, :R], alone.encoded.vision)
            _close(out.mlm_logits[b:b + 1, :T], alone.mlm_logits, atol=1e-4)
            _close(out.match_logits[b:b + 1], alone.match_logits)
            _close(out.region_logits[b:b + 1, :R], alone.region_logits)


def _other_regions(x: VLInputs, seed=7) -> VLInputs:
    g = torch.Generator().manual_seed(seed)
    return VLInputs(x.input_ids, x.token_type_ids, x.attention_mask, torch.randn(x.region_feats.shape, generator=g),
                    x.region_boxes.flip(-2), x.region_mask)


def test_without_co_attention_the_text_never_sees_the_regions():
    model = _model(vilbert_tiny(t_biattention_id=(), v_biattention_id=()))
    assert len(model.bert.c_layers) == 0
    x = _inputs()
    with torch.no_grad():
        a, b = model(x, need_attn=True), model(_other_regions(x), need_attn=True)
    assert torch.equal(a.encoded.text, b.encoded.text) and torch.equal(a.mlm_logits, b.mlm_logits)
    assert a.encoded.attentions.text_to_vision == []
    # Alignment still depends on both: pool(h_CLS) * pool(h_IMG).
    assert not torch.allclose(a.match_logits, b.match_logits)
    assert not torch.allclose(a.region_logits, b.region_logits)


def test_regions_reach_the_text_only_through_co_attention():
    model = _model(vilbert_tiny())  # co-attention before text layers 1 and 2
    x, y = _inputs(), _other_regions(_inputs())
    with torch.no_grad():
        a, b = model(x, need_attn=True), model(y, need_attn=True)
    ma, mb = a.encoded.attentions, b.encoded.attentions
    assert torch.equal(ma.text_self[0], mb.text_self[0])  # text layer 0 runs before any co-attention
    assert not torch.allclose(ma.text_self[1], mb.text_self[1])
    assert not torch.allclose(a.encoded.text, b.encoded.text)
    # Both directions exchange: the words change what the regions become, too.
    z = VLInputs(torch.randint(5, 100, x.input_ids.shape, generator=torch.Generator().manual_seed(3)),
                 x.token_type_ids, x.attention_mask, x.region_feats, x.region_boxes, x.region_mask)
    with torch.no_grad():
        c = model(z, need_attn=True)
    assert not torch.allclose(ma.vision_self[0], c.encoded.attentions.vision_self[0])  # v layer 0 follows co 0
    # Cut the value path of the text queries in every co-attention layer: the text is region-blind again.
    with torch.no_grad():
        for co in model.bert.c_layers:
            co.text_attention.self.value.weight.zero_()
            co.text_attention.self.value.bias.zero_()
        _close(model(x).encoded.text, model(y).encoded.text, atol=0)


def test_image_element_and_5d_locations_by_hand():
    feats = torch.tensor([[[1.0, 2.0], [3.0, 6.0], [100.0, 100.0]]])
    boxes = torch.tensor([[[0.1, 0.2, 0.5, 0.6], [0.0, 0.0, 0.5, 1.0], [0.9, 0.9, 1.0, 1.0]]])
    rmask = torch.tensor([[True, True, False]])
    x = VLInputs(torch.tensor([[2, 7]]), torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.bool),
                 feats, boxes, rmask)
    f, loc, m = image_sequence(x, add_image_token=True)
    # [IMG] = mean over the two real regions; the padded one does not count.
    torch.testing.assert_close(f, torch.tensor([[[2.0, 4.0], [1.0, 2.0], [3.0, 6.0], [100.0, 100.0]]]))
    torch.testing.assert_close(loc, torch.tensor([[[0.0, 0.0, 1.0, 1.0, 1.0], [0.1, 0.2, 0.5, 0.6, 0.16],
                                                   [0.0, 0.0, 0.5, 1.0, 0.5], [0.9, 0.9, 1.0, 1.0, 0.01]]]))
    assert m.tolist() == [[True, True, True, False]]
    f0, loc0, m0 = image_sequence(x, add_image_token=False)
    assert torch.equal(f0, feats) and torch.equal(loc0, loc[:, 1:]) and torch.equal(m0, rmask)
    # An image without regions still has its [IMG] element (a zero feature).
    none = VLInputs(x.input_ids, x.token_type_ids, x.attention_mask, feats, boxes, torch.zeros(1, 3, dtype=torch.bool))
    f1, _, m1 = image_sequence(none, add_image_token=True)
    assert f1[0, 0].tolist() == [0.0, 0.0] and m1.tolist() == [[True, False, False, False]]

    # The embedding: LayerNorm(W_f f + b_f + W_l loc + b_l), by hand for the [IMG] element.
    emb = _model(vilbert_tiny(visual_dim=2)).bert.v_embeddings
    with torch.no_grad():
        got = emb(f, loc)[0, 0]
        h = emb.image_embeddings.weight @ torch.tensor([2.0, 4.0]) + emb.image_embeddings.bias
        h = h + emb.image_location_embeddings.weight @ torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0])
        h = h + emb.image_location_embeddings.bias
        want = (h - h.mean()) / torch.sqrt(h.var(unbiased=False) + 1e-12) * emb.LayerNorm.weight + emb.LayerNorm.bias
    _close(got, want)


def test_added_image_token_equals_a_caller_prepended_one():
    """add_image_token=True on the regions == add_image_token=False on [whole image ; regions]."""
    with_img = _model(vilbert_tiny())
    without = ViLBertForPreTraining(vilbert_tiny(add_image_token=False)).eval()
    without.load_state_dict(with_img.state_dict())
    x = _inputs()
    f, _, m = image_sequence(x, add_image_token=True)
    whole = torch.tensor([0.0, 0.0, 1.0, 1.0]).expand(3, 1, 4)
    x2 = VLInputs(x.input_ids, x.token_type_ids, x.attention_mask, f, torch.cat([whole, x.region_boxes], 1), m)
    with torch.no_grad():
        a, b = with_img(x, need_attn=True), without(x2, need_attn=True)
    _close(a.encoded.text, b.encoded.text)
    _close(a.encoded.image, b.encoded.vision[:, 0])
    _close(a.encoded.vision, b.encoded.vision[:, 1:])
    _close(a.match_logits, b.match_logits)
    _close(a.region_logits, b.region_logits[:, 1:])
    _close(a.encoded.attentions.text_to_region(), b.encoded.attentions.text_to_region()[..., 1:])
    assert b.encoded.image is None


@pytest.mark.parametrize("variant", VARIANTS)
def test_tiny_forward_backward_on_cpu(variant):
    torch.manual_seed(0)
    model = build_pretraining_model(VARIANTS[variant]()).train()  # dropout on
    x = _inputs()
    where = torch.zeros(3, 9, dtype=torch.bool)
    where[:, [2, 4]] = True
    out = model(x, mlm_positions=where)
    assert out.mlm_logits.shape == (6, 100) and out.match_logits.shape == (3, 2)
    assert out.region_logits.shape == (3, 5, 11)
    target = torch.softmax(torch.randn(3, 5, 11), -1)
    region_kl = F.kl_div(F.log_softmax(out.region_logits, -1), target, reduction="none").sum(-1)[x.region_mask].mean()
    mlm = F.cross_entropy(out.mlm_logits, x.input_ids[where])
    loss = mlm + F.cross_entropy(out.match_logits, torch.tensor([0, 1, 0])) + region_kl
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    assert model.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0


def test_analysis_reads_co_attention_maps_over_the_callers_regions():
    """`grounding_inputs` (entity grounding) gets (co-attention layers, Hbi, T, R): [IMG] dropped."""
    from vlberts.analysis.entities import EntityCaption, grounding_inputs
    from vlberts.analysis.grounding import GroundingEntity
    from vlberts.features.record import RegionRecord

    boxes = np.array([[10, 10, 40, 40], [50, 20, 90, 70], [0, 0, 99, 79]], np.float32)
    rec = RegionRecord("7", 100, 80, boxes, np.random.default_rng(0).random((3, 16), dtype=np.float32),
                       obj_id=[0, 1, 2], obj_conf=[0.5, 0.1, 0.9])

    class Store:
        def get(self, image_id):
            return rec

    man = GroundingEntity(word_tokens=[[1], [2]], gold_boxes=boxes[:1])
    cap = EntityCaption("7", "7_0", ("a", "man"), [2, 11, 12, 3], [[1], [2]], [man], [(0, 2)])
    model = _model(vilbert_tiny())
    ((_, got),) = list(grounding_inputs(model, [cap], Store()))
    assert got.attn.shape == (2, 2, 4, 3)  # (co-attention layers, Hbi, T, R)
    scale = np.array([100, 80, 100, 80], np.float32)
    x = VLInputs(torch.tensor([cap.ids]), torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.bool),
                 torch.from_numpy(rec.features)[None], torch.from_numpy(boxes / scale)[None],
                 torch.ones(1, 3, dtype=torch.bool))
    with torch.no_grad():
        want = torch.stack(model.encode(x, need_attn=True).attentions.text_to_vision)[:, 0, :, :, 1:]
    np.testing.assert_allclose(got.attn, want.numpy(), atol=1e-6)


# --------------------------------------------------------------------------- builders and configs

TINY_WIDTHS = dict(vocab_size=100, hidden_size=32, num_heads=2, intermediate_size=48, max_position_embeddings=64,
                   visual_dim=16, v_hidden_size=24, v_num_heads=2, v_intermediate_size=40, bi_hidden_size=16,
                   bi_num_heads=2, num_region_classes=11)


@pytest.mark.parametrize(
    "k, builder", [(2, vilbert_depth2), (4, vilbert_depth4), (6, vilbert_depth6), (8, vilbert_depth8)]
)
def test_depth_variants_have_k_co_attention_blocks(k, builder):
    cfg = builder(**TINY_WIDTHS)
    assert cfg.num_co_layers == k and cfg.v_num_layers == k and cfg.num_layers == 12
    assert cfg.t_biattention_id == tuple(range(12 - k, 12)) and cfg.v_biattention_id == tuple(range(k))
    model = _model(cfg)
    assert len(model.bert.c_layers) == k and len(model.bert.v_encoder.layer) == k
    assert len(model.bert.encoder.layer) == 12
    with torch.no_grad():
        maps = model(_inputs(), need_attn=True).encoded.attentions
    assert len(maps.text_to_vision) == k and len(maps.text_self) == 12 and len(maps.vision_self) == k
    full = builder()
    assert (full.hidden_size, full.v_hidden_size, full.bi_hidden_size, full.bi_num_heads) == (768, 1024, 1024, 8)


def test_base_is_the_released_config():
    cfg = vilbert_base()
    assert cfg == vilbert_depth6()
    released = {"hidden_size": 768, "num_heads": 12, "num_layers": 12, "intermediate_size": 3072, "visual_dim": 2048,
                "v_hidden_size": 1024, "v_num_heads": 8, "v_intermediate_size": 1024, "v_num_layers": 6,
                "bi_hidden_size": 1024, "bi_num_heads": 8, "t_biattention_id": (6, 7, 8, 9, 10, 11),
                "v_biattention_id": (0, 1, 2, 3, 4, 5), "num_region_classes": 1601, "vocab_size": 30522}
    assert {k: getattr(cfg, k) for k in released} == released
    with torch.device("meta"):  # shapes only, no memory
        model = ViLBertForPreTraining(cfg)
    sd = model.state_dict()
    assert sd["bert.c_layers.5.text_attention.self.query.weight"].shape == (1024, 768)
    assert sd["bert.c_layers.5.vision_attention.self.key.weight"].shape == (1024, 768)
    assert sd["bert.c_layers.0.text_attention.output.dense.weight"].shape == (768, 1024)
    assert sd["bert.c_layers.0.text_ffn.intermediate.dense.weight"].shape == (3072, 768)
    assert sd["bert.c_layers.0.vision_ffn.intermediate.dense.weight"].shape == (1024, 1024)
    assert sd["bert.t_pooler.dense.weight"].shape == (1024, 768)
    assert sd["cls.region_predictions.decoder.weight"].shape == (1601, 1024)


def test_single_stream_is_one_bert_over_both_modalities():
    cfg = vilbert_single_stream()
    assert cfg.single_stream and cfg.v_num_layers == 0 and cfg.num_co_layers == 0 and cfg.v_hidden_size == 768
    model = _model(_single_stream_tiny())
    assert len(model.bert.v_encoder.layer) == 0 and len(model.bert.c_layers) == 0
    x = _inputs()
    with torch.no_grad():
        a, b = model(x), model(_other_regions(x))
    assert not torch.allclose(a.encoded.text, b.encoded.text)  # joint attention from the first layer on


def test_registered_names_round_trip_and_save(tmp_path):
    from vlberts.training.checkpoint import load_pretraining_model, save_model_dir

    for name in ("vilbert-base", "vilbert-depth2", "vilbert-depth4", "vilbert-depth6", "vilbert-depth8",
                 "vilbert-single-stream", "vilbert-tiny"):
        assert name in MODEL_CONFIGS
        cfg = model_config(name, vocab_size=50, visual_dim=12)
        assert config_from_dict("vilbert", json.loads(json.dumps(to_dict(cfg)))) == cfg
    model = _model(vilbert_tiny())
    save_model_dir(tmp_path / "m", model, model.cfg)
    loaded, cfg, _ = load_pretraining_model(tmp_path / "m")
    assert cfg == model.cfg
    x = _inputs()
    with torch.no_grad():
        _close(loaded.eval()(x).match_logits, model(x).match_logits, atol=0)


@pytest.mark.parametrize("kw, match", [
    (dict(t_biattention_id=(1,)), "same length"),
    (dict(t_biattention_id=(2, 1)), "strictly increasing"),
    (dict(t_biattention_id=(1, 3)), r"must lie in 0\.\.2"),
    (dict(v_biattention_id=(0, 2)), r"must lie in 0\.\.1"),
    (dict(bi_num_heads=3), "bi_hidden_size / bi_num_heads"),
    (dict(single_stream=True), "single_stream has no visual layers"),
])
def test_config_validation(kw, match):
    with pytest.raises(ValueError, match=match):
        vilbert_tiny(**kw)
    with pytest.raises(ValueError, match="v_hidden_size must equal hidden_size"):
        _single_stream_tiny(v_hidden_size=24)
    with pytest.raises(VlbertsError, match="unknown key"):
        config_from_dict("vilbert", {"v_layers": 3})


def test_pretrain_recipe_runs_vilbert(tiny_world, tmp_path):
    from vlberts.recipes.pretrain import PretrainConfig, pretrain
    from vlberts.training.checkpoint import load_pretraining_model

    final = pretrain(PretrainConfig(
        captions=str(tiny_world.captions_train), features=str(tiny_world.store), out=str(tmp_path / "run"),
        model="vilbert-tiny", vocab_size=200, steps=3, batch_size=4, ckpt_every=100, max_text_len=40,
    ))
    model, cfg, _ = load_pretraining_model(final)
    assert isinstance(cfg, ViLBertConfig) and cfg.vocab_size == model.cfg.vocab_size
    assert isinstance(model, ViLBertForPreTraining)
