"""LXMERT: numerical parity with Hugging Face (random weights saved by `save_pretrained`, loaded through
our converter, same inputs with padded text and padded regions, 1e-5), SDPA vs explicit attention,
converter errors, and the tiny builder training on CPU."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vlberts.data.batch import VLInputs
from vlberts.errors import VlbertsError
from vlberts.models.builders import build_pretraining_model, lxmert_tiny, model_config
from vlberts.models.convert_hf import load_hf_lxmert  # re-exported from convert_hf_lxmert

TOL = 1e-5


def _inputs(seed=0, B=3, T=9, R=5, F=16, V=99):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:] = False  # padded text
    ids[1, 6:] = 0
    types = torch.zeros(B, T, dtype=torch.long)
    types[:, 5:] = 1
    rmask = torch.ones(B, R, dtype=torch.bool)
    rmask[2, 3:] = False  # padded regions
    xy = torch.rand(B, R, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + torch.rand(B, R, 2, generator=g) * 0.5], dim=-1)  # normalised xyxy
    return VLInputs(ids, types, mask, torch.randn(B, R, F, generator=g), boxes, rmask)


# --------------------------------------------------------------------------- Hugging Face parity

def _transformers():
    """The reference implementation; only the parity and converter tests need it."""
    return pytest.importorskip("transformers")


def _hf_config(**kw):
    base = dict(
        vocab_size=99, hidden_size=32, num_attention_heads=2, intermediate_size=37, l_layers=2, r_layers=1,
        x_layers=2, visual_feat_dim=16, max_position_embeddings=64, num_qa_labels=7, num_object_labels=11,
        num_attr_labels=5,
    )
    base.update(kw)
    return _transformers().LxmertConfig(**base)


def _random_hf(cls_name, **kw):
    """A HF model whose every parameter is random: HF initialises biases to 0, LayerNorms to 1 and the
    padding rows to 0, which would hide a misplaced bias or LayerNorm in the key map."""
    torch.manual_seed(0)
    hf = getattr(_transformers(), cls_name)(_hf_config(**kw)).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return hf


def _hf_forward(hf, x):
    return hf(
        input_ids=x.input_ids, visual_feats=x.region_feats, visual_pos=x.region_boxes,
        attention_mask=x.attention_mask.long(), visual_attention_mask=x.region_mask.long(),
        token_type_ids=x.token_type_ids, output_attentions=True, output_hidden_states=True,
    )


def _close(a, b):
    torch.testing.assert_close(a, b, atol=TOL, rtol=0)


@pytest.mark.parametrize("cls_name", ["LxmertForPreTraining", "LxmertModel", "LxmertForQuestionAnswering"])
def test_lxmert_matches_hugging_face(tmp_path, cls_name):
    hf = _random_hf(cls_name)
    hf.save_pretrained(tmp_path)
    ours = load_hf_lxmert(tmp_path).eval()
    assert ours.left_out_head is None  # as every converter's model says which head it left out (none here)
    x = _inputs()
    with torch.no_grad():
        ref = _hf_forward(hf, x)
        out = ours(x)
        slow = ours(x, need_attn=True)

    lang_ref, vis_ref = ref.language_hidden_states[-1], ref.vision_hidden_states[-1]
    enc = out.encoded
    # HF's attention is the explicit formula, so padded positions agree too; compare them all.
    _close(enc.text, lang_ref)
    _close(enc.vision, vis_ref)
    if cls_name == "LxmertModel":
        _close(enc.pooled, ref.pooled_output)
    if cls_name == "LxmertForPreTraining":
        _close(out.mlm_logits, ref.prediction_logits)
        _close(out.match_logits, ref.cross_relationship_score)
        _close(out.qa_logits, ref.question_answering_score)
        # HF computes the object heads only inside its loss; call them on HF's vision output.
        with torch.no_grad():
            obj_ref = hf.obj_predict_head(vis_ref)
        _close(out.obj_logits, obj_ref["obj"])
        _close(out.attr_logits, obj_ref["attr"])
        _close(out.feat_pred, obj_ref["feat"])
        assert out.obj_logits.shape == (3, 5, 11) and out.attr_logits.shape == (3, 5, 5)
        assert out.feat_pred.shape == (3, 5, 16) and out.qa_logits.shape == (3, 7)
    if cls_name == "LxmertForQuestionAnswering":
        _close(out.qa_logits, ref.question_answering_score)

    # The explicit path gives HF's attention maps (the ones HF returns) and the same outputs.
    maps = slow.encoded.attentions
    assert len(maps.text_self) == 2 + 2 and len(maps.vision_self) == 1 + 2
    for ours_map, ref_map in zip(maps.text_self[:2], ref.language_attentions, strict=True):
        _close(ours_map, ref_map)
    for ours_map, ref_map in zip(maps.vision_self[:1], ref.vision_attentions, strict=True):
        _close(ours_map, ref_map)
    for ours_map, ref_map in zip(maps.text_to_vision, ref.cross_encoder_attentions, strict=True):
        assert ours_map.shape == (3, 2, 9, 5)  # (B, H, T, R)
        _close(ours_map, ref_map)
    _close(slow.mlm_logits, out.mlm_logits)
    _close(slow.encoded.vision, out.encoded.vision)


def test_padding_with_no_visual_mask_in_hf_is_the_same_as_all_regions_real(tmp_path):
    """HF treats a missing `visual_attention_mask` as "every region is real"; ours with an all-True mask."""
    hf = _random_hf("LxmertModel")
    hf.save_pretrained(tmp_path)
    ours = load_hf_lxmert(tmp_path).eval()
    x = _inputs()
    x.region_mask[:] = True
    with torch.no_grad():
        ref = hf(input_ids=x.input_ids, visual_feats=x.region_feats, visual_pos=x.region_boxes,
                 attention_mask=x.attention_mask.long(), token_type_ids=x.token_type_ids)
        out = ours.encode(x)
    _close(out.vision, ref.vision_output)
    _close(out.pooled, ref.pooled_output)


def test_hf_config_switches_decide_which_heads_exist(tmp_path):
    hf = _random_hf("LxmertForPreTraining", task_qa=False, visual_attr_loss=False)
    hf.save_pretrained(tmp_path)
    ours = load_hf_lxmert(tmp_path).eval()
    assert ours.answer_head is None and set(ours.obj_predict_head.decoder_dict) == {"obj", "feat"}
    out = ours(_inputs())
    assert out.qa_logits is None and out.attr_logits is None and out.obj_logits.shape == (3, 5, 11)


# --------------------------------------------------------------------------- converter errors

def _saved(tmp_path):
    _random_hf("LxmertForPreTraining").save_pretrained(tmp_path)
    return tmp_path


def test_unknown_key_names_the_key_as_in_the_file(tmp_path):
    path = _saved(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    bad = "lxmert.encoder.x_layers.1.visual_attention.att.quary.weight"
    sd[bad] = sd.pop("lxmert.encoder.x_layers.1.visual_attention.att.query.weight")
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(VlbertsError) as err:
        load_hf_lxmert(path)
    msg = str(err.value)
    assert "unexpected keys: lxmert.x_layers.1.cross_attention.self.quary.weight" in msg
    assert f"file key {bad}" in msg
    assert "missing keys: lxmert.x_layers.1.cross_attention.self.query.weight" in msg


def test_shape_mismatch_names_the_key(tmp_path):
    path = _saved(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["visual_feat_dim"] = 17
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VlbertsError, match=r"shape mismatch: lxmert\.object_embeddings\.visn_fc\.weight"):
        load_hf_lxmert(path)


def test_partial_head_is_an_error(tmp_path):
    path = _saved(tmp_path)
    sd = load_file(str(path / "model.safetensors"))
    del sd["obj_predict_head.decoder_dict.attr.bias"]
    save_file(sd, str(path / "model.safetensors"))
    with pytest.raises(VlbertsError, match=r"missing keys: obj_predict_head\.decoder_dict\.attr\.bias"):
        load_hf_lxmert(path)


# --------------------------------------------------------------------------- our model on its own

def test_sdpa_and_explicit_attention_agree_and_maps_are_distributions():
    torch.manual_seed(0)
    model = build_pretraining_model(lxmert_tiny(language_layers=2, cross_layers=2)).eval()
    x = _inputs(V=100)
    fast = model(x)
    slow = model(x, need_attn=True)
    assert fast.encoded.attentions is None
    for name in ("mlm_logits", "match_logits", "obj_logits", "attr_logits", "feat_pred", "qa_logits"):
        _close(getattr(fast, name), getattr(slow, name))
    _close(fast.encoded.vision, slow.encoded.vision)
    maps = slow.encoded.attentions
    B, H, T, R = 3, 2, 9, 5
    assert [m.shape for m in maps.text_self] == [(B, H, T, T)] * 4  # N_L + N_X
    assert [m.shape for m in maps.vision_self] == [(B, H, R, R)] * 3  # N_R + N_X
    assert [m.shape for m in maps.text_to_vision] == [(B, H, T, R)] * 2
    assert [m.shape for m in maps.vision_to_text] == [(B, H, R, T)] * 2
    for m in maps.text_self + maps.vision_to_text:
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
        assert m[1, :, :, 6:].abs().max() == 0  # padded words get no attention
    for m in maps.vision_self + maps.text_to_vision:
        torch.testing.assert_close(m.sum(-1), torch.ones(m.shape[:-1]))
        assert m[2, :, :, 3:].abs().max() == 0  # padded regions get no attention
    assert maps.text_to_region().shape == (2, B, H, T, R)
    assert maps.describe() == "text-to-vision cross-attention maps of 2 layers"


def test_padding_does_not_change_real_outputs():
    torch.manual_seed(0)
    model = build_pretraining_model(lxmert_tiny()).eval()
    full = _inputs(V=100)  # row 0 has no padding
    x = VLInputs(*(getattr(full, k)[:1] for k in
                   ("input_ids", "token_type_ids", "attention_mask", "region_feats", "region_boxes", "region_mask")))
    longer = VLInputs(
        torch.cat([x.input_ids, torch.zeros(1, 3, dtype=torch.long)], 1), torch.zeros(1, 12, dtype=torch.long),
        torch.cat([x.attention_mask, torch.zeros(1, 3, dtype=torch.bool)], 1),
        torch.cat([x.region_feats, torch.randn(1, 2, 16)], 1), torch.cat([x.region_boxes, torch.rand(1, 2, 4)], 1),
        torch.cat([x.region_mask, torch.zeros(1, 2, dtype=torch.bool)], 1),
    )
    longer.token_type_ids[:, :9] = x.token_type_ids
    a, b = model(x), model(longer)
    _close(a.mlm_logits, b.mlm_logits[:, :9])
    _close(a.obj_logits, b.obj_logits[:, :5])
    _close(a.match_logits, b.match_logits)
    _close(a.qa_logits, b.qa_logits)


def test_object_embedding_is_the_mean_of_two_normalised_projections():
    """Eq. 1: v = (LN(W_F f + b_F) + LN(W_P p + b_P)) / 2, computed by hand."""
    torch.manual_seed(0)
    emb = build_pretraining_model(lxmert_tiny()).eval().lxmert.object_embeddings
    x = _inputs(V=100)
    f, p = x.region_feats[0, 0], x.region_boxes[0, 0]
    ln = torch.nn.functional.layer_norm
    want = (ln(f @ emb.visn_fc.weight.T + emb.visn_fc.bias, (32,), eps=1e-12)
            + ln(p @ emb.box_fc.weight.T + emb.box_fc.bias, (32,), eps=1e-12)) / 2  # LayerNorms start at 1, 0
    _close(emb(x.region_feats, x.region_boxes)[0, 0], want)


def test_tiny_builder_trains_on_cpu_and_round_trips(tmp_path):
    from vlberts.training.checkpoint import load_pretraining_model, save_model_dir

    torch.manual_seed(0)
    cfg = model_config("lxmert-tiny")
    assert cfg == lxmert_tiny() and model_config("lxmert-base").num_layers == 9 + 5 + 5
    model = build_pretraining_model(cfg).train()
    assert model.cls.predictions.decoder.weight is model.lxmert.embeddings.word_embeddings.weight
    x = _inputs(V=100)
    where = torch.zeros(3, 9, dtype=torch.bool)
    where[:, 2] = True
    out = model(x, mlm_positions=where)
    assert out.mlm_logits.shape == (3, 100)
    loss = (
        torch.nn.functional.cross_entropy(out.mlm_logits, x.input_ids[where])
        + torch.nn.functional.cross_entropy(out.match_logits, torch.tensor([1, 0, 1]))
        + torch.nn.functional.cross_entropy(out.obj_logits.flatten(0, 1), torch.zeros(15, dtype=torch.long))
        + torch.nn.functional.cross_entropy(out.attr_logits.flatten(0, 1), torch.zeros(15, dtype=torch.long))
        + torch.nn.functional.smooth_l1_loss(out.feat_pred, x.region_feats)
        + torch.nn.functional.cross_entropy(out.qa_logits, torch.tensor([0, 3, 7]))
    )
    loss.backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not no_grad
    # Row 0 of the position table is a padding row (released LXMERT code): it never learns.
    assert model.lxmert.embeddings.position_embeddings.weight.grad[0].abs().max() == 0

    save_model_dir(tmp_path / "m", model, cfg)
    again, cfg2, meta = load_pretraining_model(tmp_path / "m")
    assert cfg2 == cfg and meta["arch"] == "lxmert"
    model.eval(), again.eval()
    _close(again(x).qa_logits, model(x).qa_logits)


def test_config_validation():
    with pytest.raises(ValueError, match="multiple"):
        lxmert_tiny(num_heads=3)
    with pytest.raises(ValueError, match="visual_pos_dim"):
        lxmert_tiny(visual_pos_dim=5)
    with pytest.raises(VlbertsError, match="lxmert-tiny"):
        model_config("lxmert-tiny", hidden_size=33)


@pytest.mark.parametrize("cross_layers", [1, 2])
def test_pretraining_heads_from_the_rows_they_read_equal_the_whole_forward(cross_layers):
    """With `mlm_positions` the last cross-modality layer computes the language [CLS] and masked words only (and
    every region, for the object heads): every head's output and every gradient equal the whole forward's."""
    torch.manual_seed(0)
    cfg = lxmert_tiny(cross_layers=cross_layers, language_layers=2, hidden_dropout=0.0, attention_dropout=0.0)
    model = build_pretraining_model(cfg)
    x = _inputs(V=100)
    where = torch.zeros(3, 9, dtype=torch.bool)
    where[0, [2, 5]] = True  # example 1 has no masked word
    where[2, [1, 3, 8]] = True
    full, part = model(x), model(x, mlm_positions=where)
    assert part.encoded is None and part.mlm_logits.shape == (5, 100)
    torch.testing.assert_close(part.mlm_logits, full.mlm_logits[where], atol=1e-5, rtol=0)
    for name in ("match_logits", "obj_logits", "attr_logits", "feat_pred", "qa_logits"):
        torch.testing.assert_close(getattr(part, name), getattr(full, name), atol=1e-5, rtol=0, msg=name)

    def grads(out, logits):
        model.zero_grad()
        loss = logits.logsumexp(-1).sum() + sum(getattr(out, k).square().sum() for k in (
            "match_logits", "obj_logits", "attr_logits", "feat_pred", "qa_logits"))
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    a, b = grads(full, full.mlm_logits[where]), grads(part, part.mlm_logits)
    assert a.keys() == b.keys() and len(a) > 30
    for n in a:
        torch.testing.assert_close(b[n], a[n], atol=1e-5, rtol=1e-4, msg=n)


def test_vqa_head_reads_the_cls_row_alone_with_the_whole_forwards_values():
    """LXMERT's VQA head reads the pooled language [CLS]: its last cross-modality layer computes that row and no
    vision state, with the logits and gradients of the whole forward pass."""
    from vlberts.models.lxmert import LxmertForVQA

    torch.manual_seed(0)
    model = LxmertForVQA(lxmert_tiny(cross_layers=2, hidden_dropout=0.0, attention_dropout=0.0), 7)
    x = _inputs(V=100)
    calls = []
    last = model.lxmert.x_layers[-1]
    for sub in (last.visn_self_att, last.visn_ffn):
        sub.register_forward_hook(lambda *a: calls.append(1))

    def grads(logits):
        model.zero_grad()
        logits.logsumexp(-1).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    a = model.classifier(model.lxmert(x).pooled)
    n_full = len(calls)
    b = model(x)
    assert n_full == 2 and len(calls) == 2  # the VQA path ran no vision self-attention or FFN in the last layer
    torch.testing.assert_close(b, a, atol=1e-5, rtol=0)
    ga, gb = grads(a), grads(b)
    for n in gb:
        torch.testing.assert_close(gb[n], ga[n], atol=1e-5, rtol=1e-4, msg=n)
