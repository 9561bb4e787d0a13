"""VL-BERT: layout, embeddings by hand, geometry embedding, text-only samples, masking without leakage,
end-to-end CNN, attention paths, padding."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from vlberts.config import to_dict
from vlberts.data.batch import VLInputs
from vlberts.models.builders import (
    MODEL_CONFIGS,
    arch_of,
    build_pretraining_model,
    config_from_dict,
    model_config,
    vlbert_e2e_tiny,
    vlbert_tiny,
)
from vlberts.models.vlbert import VLBertConfig, geometry_embedding, zero_pixels_in_boxes
from vlberts.objectives.regions import masked_roi_loss

T, R = 7, 4  # text length, regions; the joint sequence is T + 1 (whole image) + R + 1 ([END])


def _boxes(B, R, g):
    xy = torch.rand(B, R, 2, generator=g) * 0.5
    wh = 0.1 + torch.rand(B, R, 2, generator=g) * 0.4
    return torch.cat([xy, xy + wh], -1)  # valid normalised xyxy


def _inputs(B=2, T=T, R=R, D=16, V=100, seed=0, pad=True):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    rmask = torch.ones(B, R, dtype=torch.bool)
    if pad:
        mask[0, 5:] = False
        rmask[B - 1, 2:] = False
    return VLInputs(torch.randint(5, V, (B, T), generator=g), torch.zeros(B, T, dtype=torch.long), mask,
                    torch.randn(B, R, D, generator=g), _boxes(B, R, g), rmask,
                    pixels=torch.randn(B, 3, 32, 32, generator=g))


def _model(cfg, as_built=False):
    """The model in eval mode; its visual LayerNorms get random weights, as a trained model's are, unless
    `as_built` (both start at weight 0, as the release's configs set them, which hides every visual feature)."""
    torch.manual_seed(0)
    model = build_pretraining_model(cfg).eval()
    if not as_built:
        with torch.no_grad():
            model.bert.embeddings.visual_ln_text.weight.normal_()
            model.bert.embeddings.visual_ln_object.weight.normal_()
    return model


def _ln(v, ln):
    return F.layer_norm(v, (v.shape[-1],), ln.weight, ln.bias, ln.eps)


@pytest.mark.parametrize("make", [vlbert_tiny, vlbert_e2e_tiny])
def test_sdpa_and_explicit_attention_agree_and_padding_gets_no_attention(make):
    model = _model(make(with_match_head=True))
    x = _inputs()
    masked = torch.tensor([[False, True, False, False], [True, False, False, False]])
    fast, slow = model(x, roi_masked=masked), model(x, need_attn=True, roi_masked=masked)
    for a, b in [(fast.mlm_logits, slow.mlm_logits), (fast.region_logits, slow.region_logits),
                 (fast.match_logits, slow.match_logits), (fast.encoded.image, slow.encoded.image)]:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    maps = slow.encoded.attentions
    S = T + 1 + R + 1
    assert len(maps.joint) == 2 and maps.joint[0].shape == (2, 4, S, S)
    for m in maps.joint:
        torch.testing.assert_close(m.sum(-1), torch.ones(2, 4, S))
        assert m[0, :, :, 5:T].abs().max() == 0  # padded words
        assert m[1, :, :, T + 1 + 2 : T + 1 + R].abs().max() == 0  # padded regions
        assert m[:, :, :, T].min() > 0 and m[:, :, :, S - 1].min() > 0  # whole image and [END] are attended


def test_text_to_region_reads_only_the_region_columns():
    """Grounding reads columns T+1..T+R of the joint maps: the caller's regions, in order; the whole-image
    element (column T) and [END] (column T+R+1) are not regions and are left out."""
    model = _model(vlbert_tiny())
    x = _inputs()
    enc = model.encode(x, need_attn=True)
    maps = enc.attentions
    assert maps.text_index.tolist() == list(range(T))
    assert maps.region_index.tolist() == list(range(T + 1, T + 1 + R))
    t2r = maps.text_to_region()
    assert t2r.shape == (2, 2, 4, T, R)
    for layer in range(2):
        torch.testing.assert_close(t2r[layer], maps.joint[layer][:, :, :T, T + 1 : T + 1 + R])
    # What is left of each text row went to text, the whole image and [END].
    rest = maps.joint[1][:, :, :T, :T].sum(-1) + maps.joint[1][:, :, :T, T] + maps.joint[1][:, :, :T, -1]
    torch.testing.assert_close(t2r[1].sum(-1) + rest, torch.ones(2, 4, T))


@pytest.mark.parametrize("make", [vlbert_tiny, vlbert_e2e_tiny])
def test_padding_does_not_change_real_outputs(make):
    model = _model(make())
    x = _inputs(B=1, pad=False)
    g = torch.Generator().manual_seed(1)
    longer = dataclasses.replace(
        x,
        input_ids=torch.cat([x.input_ids, torch.zeros(1, 3, dtype=torch.long)], 1),
        token_type_ids=torch.zeros(1, T + 3, dtype=torch.long),
        attention_mask=torch.cat([x.attention_mask, torch.zeros(1, 3, dtype=torch.bool)], 1),
        region_feats=torch.cat([x.region_feats, torch.randn(1, 2, 16, generator=g)], 1),
        region_boxes=torch.cat([x.region_boxes, _boxes(1, 2, g)], 1),
        region_mask=torch.cat([x.region_mask, torch.zeros(1, 2, dtype=torch.bool)], 1),
    )
    masked = torch.tensor([[False, False, True, False]])
    a = model(x, roi_masked=masked)
    b = model(longer, roi_masked=torch.cat([masked, torch.tensor([[True, False]])], 1))  # masking padding: no-op
    torch.testing.assert_close(a.mlm_logits, b.mlm_logits[:, :T], atol=1e-5, rtol=0)
    torch.testing.assert_close(a.region_logits, b.region_logits[:, :R], atol=1e-5, rtol=0)
    torch.testing.assert_close(a.encoded.pooled, b.encoded.pooled, atol=1e-5, rtol=0)
    torch.testing.assert_close(a.encoded.image, b.encoded.image, atol=1e-5, rtol=0)


def test_geometry_embedding_matches_a_hand_computation():
    box = torch.tensor([0.1, 0.2, 0.5, 0.8], dtype=torch.float64)
    # (xc, yc, w, h) x 100 = (30, 50, 40, 60); dim 16 -> K = 2 wavelengths 1000^(0/2) = 1, 1000^(1/2).
    w1 = math.sqrt(1000.0)
    want = []
    for p in (30.0, 50.0, 40.0, 60.0):
        want += [math.sin(p), math.sin(p / w1), math.cos(p), math.cos(p / w1)]
    got = geometry_embedding(box[None], 16)[0]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    want_xyxy = []
    for p in (10.0, 20.0, 50.0, 80.0):  # the paper's text: the corners
        want_xyxy += [math.sin(p), math.sin(p / w1), math.cos(p), math.cos(p / w1)]
    torch.testing.assert_close(geometry_embedding(box, 16, "xyxy"), torch.tensor(want_xyxy, dtype=torch.float64))
    assert geometry_embedding(torch.rand(3, 5, 4), 2048).shape == (3, 5, 2048)


def test_embeddings_by_hand():
    """Token + visual feature + segment + position for a text token, the whole image, a region, a masked
    region and [END] (positions: text 0..n-1, every visual element n, [END] n + 1)."""
    model = _model(vlbert_tiny())  # visual LayerNorm weights random: their terms visible
    emb = model.bert.embeddings
    with torch.no_grad():
        emb.object_mask_visual_embedding.normal_()
    x = _inputs(B=1, pad=False)
    x.attention_mask[0, 6:] = False  # n = 6
    x.token_type_ids[0, 3:] = 1
    masked = torch.tensor([[False, True, False, False]])
    h, mask = emb(x, x.region_feats, masked)
    W, P, S = emb.word_embeddings.weight, emb.position_embeddings.weight, emb.token_type_embeddings.weight

    def vis(app, box):
        geo = geometry_embedding(box, 32)
        return F.relu(emb.visual_fc(torch.cat([app, geo])))

    whole_app = (x.region_feats[0, 0] + x.region_feats[0, 2] + x.region_feats[0, 3]) / 3  # masked RoI left out
    v_whole = vis(whole_app, torch.tensor([0.0, 0.0, 1.0, 1.0]))
    img, end = emb.img_embedding.weight[0], emb.end_embedding.weight[0]
    want = {
        4: W[x.input_ids[0, 4]] + _ln(v_whole, emb.visual_ln_text) + S[1] + P[4],
        T: img + _ln(v_whole, emb.visual_ln_object) + S[2] + P[6],
        T + 1: img + _ln(vis(x.region_feats[0, 0], x.region_boxes[0, 0]), emb.visual_ln_object) + S[2] + P[6],
        T + 2: emb.object_mask_word_embedding.weight[0]
        + _ln(vis(emb.object_mask_visual_embedding, x.region_boxes[0, 1]), emb.visual_ln_object) + S[2] + P[6],
        T + R + 1: end + S[2] + P[7],
    }
    for i, v in want.items():
        torch.testing.assert_close(h[0, i], _ln(v, emb.LayerNorm), atol=1e-5, rtol=0)
    assert mask[0].tolist() == [True] * 6 + [False] + [True] * (1 + R + 1)


def test_text_only_samples_use_the_learned_visual_embedding():
    model = _model(vlbert_tiny())
    emb = model.bert.embeddings
    with torch.no_grad():
        emb.visual_ln_text.weight.normal_()
    x = _inputs(pad=False)
    x.region_mask[1] = False  # sample 1 is text-only
    h, mask = emb(x, x.region_feats, torch.zeros(2, R, dtype=torch.bool))
    want = (emb.word_embeddings.weight[x.input_ids[1, 0]] + _ln(emb.text_only_visual_embedding.weight[0], emb.visual_ln_text)
            + emb.token_type_embeddings.weight[0] + emb.position_embeddings.weight[0])
    torch.testing.assert_close(h[1, 0], _ln(want, emb.LayerNorm), atol=1e-5, rtol=0)
    assert not mask[1, T] and mask[1, -1]  # no whole-image element; [END] stays
    # Its outputs do not depend on the (ignored) region inputs.
    other = dataclasses.replace(x, region_feats=torch.randn_like(x.region_feats), region_boxes=_boxes(2, R, torch.Generator()))
    a, b = model(x), model(other)
    torch.testing.assert_close(a.mlm_logits[1], b.mlm_logits[1], atol=1e-6, rtol=0)
    assert not torch.allclose(a.mlm_logits[0], b.mlm_logits[0])
    # A batch with no region slots at all (the text-only stream) runs and matches row 1.
    none = dataclasses.replace(x, region_feats=x.region_feats[:, :0], region_boxes=x.region_boxes[:, :0],
                               region_mask=x.region_mask[:, :0])
    c = model(none)
    assert c.region_logits.shape == (2, 0, 11)
    torch.testing.assert_close(c.mlm_logits[1], a.mlm_logits[1], atol=1e-5, rtol=0)


def test_masked_roi_features_do_not_leak():
    """A masked RoI's feature reaches nothing: its own element reads the mask vector and the whole-image
    mean leaves it out."""
    model = _model(vlbert_tiny())
    x = _inputs()
    masked = torch.tensor([[True, False, False, False], [False, True, False, False]])
    feats = x.region_feats.clone()
    feats[0, 0] = torch.randn(16)
    feats[1, 1] = torch.randn(16)
    a, b = model(x, roi_masked=masked), model(dataclasses.replace(x, region_feats=feats), roi_masked=masked)
    torch.testing.assert_close(a.mlm_logits, b.mlm_logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(a.region_logits, b.region_logits, atol=1e-6, rtol=0)
    assert not torch.allclose(model(x).mlm_logits, model(dataclasses.replace(x, region_feats=feats)).mlm_logits)


def test_zero_pixels_in_boxes_is_exact():
    pixels = torch.arange(1, 2 * 4 * 6 + 1, dtype=torch.float).view(1, 2, 4, 6)  # (B, C, H=4, W=6)
    boxes = torch.tensor([[[0.25, 0.0, 0.5, 0.5],  # x in [1.5, 3) px -> cols 1, 2; y in [0, 2) -> rows 0, 1
                           [0.0, 0.6, 1 / 6, 1.0],  # not masked
                           [0.9, 0.7, 1.0, 0.75]]])  # x in [5.4, 6) -> col 5; y in [2.8, 3) -> row 2
    masked = torch.tensor([[True, False, True]])
    out = zero_pixels_in_boxes(pixels, boxes, masked)
    keep = torch.ones(4, 6)
    keep[0:2, 1:3] = 0
    keep[2, 5] = 0
    torch.testing.assert_close(out, pixels * keep)
    assert torch.equal(zero_pixels_in_boxes(pixels, boxes, torch.zeros(1, 3, dtype=torch.bool)), pixels)


def test_end_to_end_masks_pixels_and_trains_the_cnn():
    model = _model(vlbert_e2e_tiny())
    x = _inputs()
    masked = torch.tensor([[True, False, False, False], [False, True, False, False]])
    # Pixels inside a masked RoI are zeroed before the CNN: changing them changes nothing.
    inside = zero_pixels_in_boxes(torch.ones_like(x.pixels), x.region_boxes, masked) == 0
    noisy = dataclasses.replace(x, pixels=torch.where(inside, torch.randn_like(x.pixels), x.pixels))
    a, b = model(x, roi_masked=masked), model(noisy, roi_masked=masked)
    torch.testing.assert_close(a.mlm_logits, b.mlm_logits, atol=1e-6, rtol=0)
    torch.testing.assert_close(a.region_logits, b.region_logits, atol=1e-6, rtol=0)
    assert not torch.allclose(model(x).mlm_logits, model(noisy).mlm_logits)  # unmasked, the pixels matter
    # The precomputed features are ignored; the CNN is trained through the model.
    c = model(dataclasses.replace(x, region_feats=torch.zeros(2, R, 0)), roi_masked=masked)
    torch.testing.assert_close(a.mlm_logits, c.mlm_logits)
    model.train()
    out = model(x, roi_masked=masked)
    (out.mlm_logits.logsumexp(-1).mean() + out.region_logits.logsumexp(-1).mean()).backward()
    convs = [m for m in model.bert.visual.backbone if isinstance(m, torch.nn.Conv2d)]
    for conv in convs:
        assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0
    assert model.bert.visual.fc.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="pixels"):
        model(dataclasses.replace(x, pixels=None))


def test_tiny_forward_backward_has_finite_grads():
    model = _model(vlbert_tiny())
    model.train()
    x = _inputs()
    masked = torch.tensor([[True, False, False, False], [False, True, False, False]])
    labels = torch.full((2, T), -100)
    labels[0, 2], labels[1, 4] = 7, 9
    pos = labels != -100
    out = model(x, mlm_positions=pos, roi_masked=masked)
    assert out.mlm_logits.shape == (2, 100) and out.match_logits is None
    targets = torch.softmax(torch.randn(2, R, 11), -1)
    loss = F.cross_entropy(out.mlm_logits, labels[pos]) + masked_roi_loss(out.region_logits, targets, masked)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.isfinite(g).all() for g in grads.values())
    assert grads["region_head.decoder.weight"].abs().sum() > 0
    assert grads["bert.embeddings.object_mask_visual_embedding"].abs().sum() > 0
    assert grads["bert.embeddings.object_mask_word_embedding.weight"].abs().sum() > 0
    assert "bert.embeddings.text_only_visual_embedding.weight" not in grads or \
        grads["bert.embeddings.text_only_visual_embedding.weight"].abs().sum() == 0  # no text-only sample here
    # The loss by hand: soft cross-entropy over the masked RoIs only.
    lp = out.region_logits.log_softmax(-1)
    want = -((targets[0, 0] * lp[0, 0]).sum() + (targets[1, 1] * lp[1, 1]).sum()) / 2
    torch.testing.assert_close(masked_roi_loss(out.region_logits, targets, masked), want)
    assert masked_roi_loss(out.region_logits, targets, torch.zeros(2, R, dtype=torch.bool)) == 0


def test_configs_builders_and_heads():
    for name in ("vlbert-base", "vlbert-tiny", "vlbert-e2e-tiny"):
        assert name in MODEL_CONFIGS
        cfg = model_config(name)
        assert arch_of(cfg) == "vlbert" and config_from_dict("vlbert", to_dict(cfg)) == cfg
    base = model_config("vlbert-base")
    assert (base.num_layers, base.hidden_size, base.num_heads, base.visual_dim, base.geometry_dim) == (12, 768, 12, 2048, 2048)
    assert (base.type_vocab_size, base.num_region_classes, base.with_match_head, base.end_to_end) == (3, 1601, False, False)
    assert model_config("vlbert-e2e-tiny").end_to_end
    off, on = _model(vlbert_tiny(), as_built=True), _model(vlbert_tiny(with_match_head=True))
    assert not any("seq_relationship" in n for n, _ in off.named_parameters())
    assert on(_inputs()).match_logits.shape == (2, 2)
    assert off.cls.predictions.decoder.weight is off.bert.embeddings.word_embeddings.weight  # tied MLM head
    # Released init (pre-training configs): both visual LayerNorms at weight 0.
    assert torch.equal(off.bert.embeddings.visual_ln_text.weight, torch.zeros(32))
    assert torch.equal(off.bert.embeddings.visual_ln_object.weight, torch.zeros(32))
    for bad in (dict(geometry_dim=30), dict(geometry_box="xywh"), dict(type_vocab_size=2),
                dict(end_to_end=True, cnn_channels=())):
        with pytest.raises(ValueError):
            VLBertConfig(**bad)


def test_checkpoint_round_trip(tmp_path):
    from vlberts.training.checkpoint import load_pretraining_model, save_model_dir

    cfg = vlbert_e2e_tiny()
    model = _model(cfg)
    save_model_dir(tmp_path / "m", model, cfg)
    loaded, cfg2, _ = load_pretraining_model(tmp_path / "m")
    assert cfg2 == cfg
    x = _inputs()
    torch.testing.assert_close(loaded.eval()(x).mlm_logits, model(x).mlm_logits)


@pytest.mark.parametrize("task", ["VQA", "RefCOCO+", "VCR", "NLVR2", "Flickr30K Entities", "retrieval"])
def test_every_task_model_refuses_an_end_to_end_vlbert_up_front(task):
    """Fine-tuning reads stored region features: an end-to-end VL-BERT is one line naming the task when its
    task model is built, not an error from the first forward pass (VQA's was a bare ValueError there)."""
    from vlberts.errors import VlbertsError
    from vlberts.models.builders import vlbert_e2e_tiny
    from vlberts.models.flickr_entities import FlickrEntitiesModel
    from vlberts.models.nlvr2 import NLVR2Model
    from vlberts.models.refcoco import RefCocoModel
    from vlberts.models.retrieval import RetrievalModel
    from vlberts.models.vcr import VCRModel
    from vlberts.models.vlbert import VLBertForVQA

    build = {"VQA": lambda c: VLBertForVQA(c, 5), "RefCOCO+": RefCocoModel, "VCR": VCRModel,
             "NLVR2": lambda c: NLVR2Model(c, "pair"), "Flickr30K Entities": FlickrEntitiesModel,
             "retrieval": RetrievalModel}[task]
    with pytest.raises(VlbertsError, match=rf"^{task}.* reads stored region features; an end-to-end VL-BERT"):
        build(vlbert_e2e_tiny())


def test_the_analyses_refuse_an_end_to_end_vlbert_in_one_line(tmp_path):
    """The analyses feed stored region features: an end-to-end model directory is refused when loaded, not with
    a traceback from the first forward pass (or a misleading feature-width message)."""
    from vlberts.errors import VlbertsError
    from vlberts.models.builders import build_pretraining_model, vlbert_e2e_tiny
    from vlberts.training.checkpoint import load_attention_model, save_model_dir

    cfg = vlbert_e2e_tiny()
    save_model_dir(tmp_path / "e2e", build_pretraining_model(cfg), cfg)
    with pytest.raises(VlbertsError, match=r"^Each analysis \(analyze grounding, attention-graphs, representations\) "
                                           "reads stored region features; an end-to-end VL-BERT"):
        load_attention_model(tmp_path / "e2e")
