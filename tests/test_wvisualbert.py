"""W-VisualBERT: tag inputs, tag embeddings, attention paths, padding, text-only / image-only batches."""

import pytest
import torch

from vlberts.data.batch import VLInputs
from vlberts.models.builders import MODEL_CONFIGS, build_pretraining_model, model_config
from vlberts.models.wvisualbert import TagInputs, collate_tags, tag_tokens, wvisualbert_tiny

D_FEAT = 16


def _inputs(B=2, T=7, R=4, V=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    if T > 5:
        mask[0, 5:] = False
    rmask = torch.ones(B, R, dtype=torch.bool)
    if R > 2:
        rmask[B - 1, 2:] = False
    return VLInputs(torch.randint(5, V, (B, T), generator=g), torch.zeros(B, T, dtype=torch.long), mask,
                    torch.randn(B, R, D_FEAT, generator=g), torch.rand(B, R, 4, generator=g), rmask)


# class c -> subwords: "dog" = [20], "hot dog" = [21, 20], "table" = [22]
CLASSES = [[20], [21, 20], [22]]


def _tags(B=2):
    # image 0: boxes of classes 1, 0, 2, 0 -> 5 subwords; image 1: classes 2, 1 (its boxes 2, 3 are padding)
    return collate_tags([tag_tokens([1, 0, 2, 0], CLASSES), tag_tokens([2, 1], CLASSES)][:B])


def test_tag_tokens_by_hand():
    ids, region = tag_tokens([1, 0, 2], CLASSES)
    assert ids == [21, 20, 20, 22]
    assert region == [0, 0, 1, 2]  # both subwords of "hot dog" point at box 0
    # attributes replace the object word where the caller drew them ("red" = [30], "big" = [31, 32])
    ids, region = tag_tokens([1, 0, 2], CLASSES, attr_ids=[0, 1, 0], attr_subwords=[[30], [31, 32]],
                             use_attr=[False, True, False])
    assert (ids, region) == ([21, 20, 31, 32, 22], [0, 0, 1, 1, 2])
    # truncation keeps whole tags only
    assert tag_tokens([0, 1, 2], CLASSES, max_tokens=2) == ([20], [0])
    assert tag_tokens([], CLASSES) == ([], [])
    batch = collate_tags([([20], [0]), ([21, 20], [1, 1])])
    assert batch.tag_ids.tolist() == [[20, 0], [21, 20]]
    assert batch.tag_region.tolist() == [[0, 0], [1, 1]]
    assert batch.tag_mask.tolist() == [[True, False], [True, True]]


def test_tag_embedding_is_word_plus_its_box_spatial_embedding():
    torch.manual_seed(0)
    model = build_pretraining_model(wvisualbert_tiny(hidden_dropout=0.0)).eval()
    emb = model.bert.embeddings
    x, tags = _inputs(), _tags()
    h, T, R, L = emb(x, tags)
    assert (T, R, L) == (7, 4, 5)
    ln = torch.nn.functional.layer_norm
    eps = 1e-12

    def spatial(box):  # LN(W_b b), by hand
        return ln(box @ emb.spatial.box_fc.weight.T + emb.spatial.box_fc.bias, (32,),
                  emb.spatial.box_layer_norm.weight, emb.spatial.box_layer_norm.bias, eps)

    # image 0, tag subword 1 is the "dog" of "hot dog" (id 20) from box 0
    word = ln(emb.word_embeddings.weight[20], (32,), emb.tag_layer_norm.weight, emb.tag_layer_norm.bias, eps)
    torch.testing.assert_close(h[0, T + R + 1], word + spatial(x.region_boxes[0, 0]))
    # image 1, tag subword 2 is "dog" again, now from box 1: same word part, box 1's spatial part
    word2 = word + spatial(x.region_boxes[1, 1])
    torch.testing.assert_close(h[1, T + R + 2], word2)
    # a region is LN(W_f f) + the same spatial embedding
    visn = ln(x.region_feats[0, 3] @ emb.visn_fc.weight.T + emb.visn_fc.bias, (32,),
              emb.visn_layer_norm.weight, emb.visn_layer_norm.bias, eps)
    torch.testing.assert_close(h[0, T + 3], visn + spatial(x.region_boxes[0, 3]))


def test_sdpa_and_explicit_agree_and_text_to_region_covers_regions_only():
    torch.manual_seed(0)
    model = build_pretraining_model(wvisualbert_tiny()).eval()
    x, tags = _inputs(), _tags()
    fast = model(x, tags=tags)
    slow = model(x, need_attn=True, tags=tags)
    for a, b in [(fast.mlm_logits, slow.mlm_logits), (fast.tag_logits, slow.tag_logits),
                 (fast.obj_logits, slow.obj_logits), (fast.feat_pred, slow.feat_pred)]:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert fast.match_logits is None  # unpaired W-VisualBERT has no match head
    assert fast.tag_logits.shape == (2, 5, 100) and fast.obj_logits.shape == (2, 4, 10)
    maps = slow.encoded.attentions
    S = 7 + 4 + 5
    assert len(maps.joint) == 2 and maps.joint[0].shape == (2, 4, S, S)
    for m in maps.joint:
        torch.testing.assert_close(m.sum(-1), torch.ones(2, 4, S))
        assert m[0, :, :, 5:7].abs().max() == 0  # padded words
        assert m[1, :, :, 7 + 2 : 7 + 4].abs().max() == 0  # padded regions
        assert m[1, :, :, 7 + 4 + 3 :].abs().max() == 0  # padded tags (image 1 has 3 tag subwords)
    t2r = maps.text_to_region()
    assert t2r.shape == (2, 2, 4, 7, 4)  # region columns only, no tag columns
    torch.testing.assert_close(t2r[1, 0], maps.joint[1][0][:, :7, 7:11])
    assert slow.encoded.tag_index.tolist() == list(range(11, 16))


def test_tag_logits_use_the_shared_tied_mlm_head_and_positions_select():
    torch.manual_seed(0)
    model = build_pretraining_model(wvisualbert_tiny()).eval()
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    x, tags = _inputs(), _tags()
    full = model(x, tags=tags)
    torch.testing.assert_close(full.tag_logits, model.cls.predictions(full.encoded.tags))
    pos = tags.tag_mask.clone()
    pos[0, 0] = False
    part = model(x, tags=tags, mlm_positions=x.attention_mask, tag_positions=pos)
    torch.testing.assert_close(part.tag_logits, full.tag_logits[pos], atol=1e-5, rtol=0)
    torch.testing.assert_close(part.mlm_logits, full.mlm_logits[x.attention_mask], atol=1e-5, rtol=0)


def test_padding_does_not_change_real_outputs():
    torch.manual_seed(0)
    model = build_pretraining_model(wvisualbert_tiny()).eval()
    x = _inputs(B=1)
    x.attention_mask[:] = True
    x.region_mask[:] = True
    tags = _tags(B=1)
    longer = VLInputs(
        torch.cat([x.input_ids, torch.zeros(1, 3, dtype=torch.long)], 1), torch.zeros(1, 10, dtype=torch.long),
        torch.cat([x.attention_mask, torch.zeros(1, 3, dtype=torch.bool)], 1),
        torch.cat([x.region_feats, torch.randn(1, 2, D_FEAT)], 1), torch.cat([x.region_boxes, torch.rand(1, 2, 4)], 1),
        torch.cat([x.region_mask, torch.zeros(1, 2, dtype=torch.bool)], 1),
    )
    longer_tags = TagInputs(
        torch.cat([tags.tag_ids, torch.tensor([[7, 8]])], 1), torch.cat([tags.tag_region, torch.tensor([[4, 5]])], 1),
        torch.cat([tags.tag_mask, torch.zeros(1, 2, dtype=torch.bool)], 1),
    )
    a, b = model(x, tags=tags), model(longer, tags=longer_tags)
    torch.testing.assert_close(a.mlm_logits, b.mlm_logits[:, :7], atol=1e-5, rtol=0)
    torch.testing.assert_close(a.tag_logits, b.tag_logits[:, :5], atol=1e-5, rtol=0)
    torch.testing.assert_close(a.obj_logits, b.obj_logits[:, :4], atol=1e-5, rtol=0)


def test_text_only_and_image_only_batches_run():
    torch.manual_seed(0)
    model = build_pretraining_model(wvisualbert_tiny()).eval()
    # text-only batch (W-VisualBERT's text stream): no regions, no tags
    text = _inputs(R=0)
    out = model(text)
    assert out.mlm_logits.shape == (2, 7, 100)
    assert out.tag_logits is None and out.obj_logits is None and out.encoded.vision.shape == (2, 0, 32)
    # a text-only batch equals BERT on the text: regions absent, not just masked
    ref = model.bert.encoder(model.bert.embeddings.text(text.input_ids, text.token_type_ids),
                             torch.where(text.attention_mask, 0.0, torch.finfo(torch.float32).min)[:, None, None])[0]
    torch.testing.assert_close(out.encoded.text, ref, atol=1e-5, rtol=0)
    # image-only batch: no text, regions + tags
    image = _inputs(T=0)
    out = model(image, tags=_tags(), need_attn=True)
    assert out.mlm_logits.shape == (2, 0, 100) and out.tag_logits.shape == (2, 5, 100)
    assert out.obj_logits.shape == (2, 4, 10)
    assert out.encoded.attentions.text_to_region().shape == (2, 2, 4, 0, 4)


def test_no_tags_variant_ignores_tags_and_has_no_tag_parameters():
    torch.manual_seed(0)
    model = build_pretraining_model(model_config("wvisualbert-nt", **_TINY)).eval()
    assert model.bert.embeddings.tag_layer_norm is None
    x = _inputs()
    a, b = model(x), model(x, tags=_tags())
    torch.testing.assert_close(a.mlm_logits, b.mlm_logits)
    assert b.tag_logits is None and b.encoded.vision.shape[1] == 4


_TINY = dict(vocab_size=100, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
             max_position_embeddings=64, visual_dim=D_FEAT, num_object_labels=10, num_attr_labels=6)


@pytest.mark.parametrize("name,tags,match", [
    ("wvisualbert-base", True, False), ("wvisualbert-nt", False, False), ("wvisualbert-s", True, True),
    ("wvisualbert-s-nt", False, True), ("wvisualbert-h", True, True),
])
def test_variants(name, tags, match):
    cfg = model_config(name, **_TINY)
    assert (cfg.use_tags, cfg.match_head) == (tags, match)
    assert name in MODEL_CONFIGS
    out = build_pretraining_model(cfg).eval()(_inputs(), tags=_tags())
    assert (out.match_logits is not None) == match
    assert (out.tag_logits is not None) == tags
    base = model_config(name)
    assert (base.num_layers, base.hidden_size, base.num_heads, base.visual_dim) == (12, 768, 12, 2048)
    assert base.describe().split(":")[0] in {"W-VisualBERT", "W-VisualBERT_NT", "S-VisualBERT",
                                              "S-VisualBERT_NT", "H-VisualBERT"}


def test_s_small_is_the_small_config_trained_on_pairs():
    import dataclasses

    s, w = model_config("wvisualbert-s-small"), model_config("wvisualbert-small")
    assert (s.variant, s.match_head, w.variant, w.match_head) == ("S", True, "W", False)
    assert dataclasses.replace(s, variant="W", match_head=False) == w
    assert s.describe().startswith("S-VisualBERT")


def test_tiny_forward_backward_reaches_tag_and_region_parameters():
    torch.manual_seed(0)
    model = build_pretraining_model(wvisualbert_tiny()).train()
    x, tags = _inputs(), _tags()
    out = model(x, tags=tags)
    labels = torch.randint(0, 100, tags.tag_ids.shape)
    loss = (torch.nn.functional.cross_entropy(out.tag_logits[tags.tag_mask], labels[tags.tag_mask])
            + out.mlm_logits.logsumexp(-1).mean() + out.feat_pred.pow(2).mean() + out.obj_logits.mean())
    loss.backward()
    emb = model.bert.embeddings
    for p in (emb.spatial.box_fc.weight, emb.tag_layer_norm.weight, emb.visn_fc.weight,
              model.obj_predict_head.decoder_dict["feat"].weight):
        assert p.grad is not None and p.grad.abs().sum() > 0
    # the tag word ids (20, 21, 22) receive gradient through the shared word table
    assert emb.word_embeddings.weight.grad[[20, 21, 22]].abs().sum(-1).min() > 0
    assert torch.isfinite(loss)


def test_config_round_trips_through_the_checkpoint_dict_and_rejects_bad_values():
    from vlberts.config import to_dict
    from vlberts.errors import VlbertsError
    from vlberts.models.builders import arch_of, config_from_dict

    cfg = model_config("wvisualbert-s-nt", **_TINY)
    assert arch_of(cfg) == "wvisualbert"
    assert config_from_dict("wvisualbert", to_dict(cfg)) == cfg
    with pytest.raises(VlbertsError, match="visual_pos_dim"):
        model_config("wvisualbert-base", visual_pos_dim=5)
