"""VisualBERT building blocks: SDPA and explicit attention agree; masking; alignment positions."""

import torch

from vlberts.data.batch import VLInputs
from vlberts.models.builders import build_pretraining_model, visualbert_tiny


def _inputs(B=2, T=7, R=4, D=16, V=100, seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 5:] = False
    rmask = torch.ones(B, R, dtype=torch.bool)
    rmask[B - 1, 2:] = False
    return VLInputs(torch.randint(5, V, (B, T), generator=g), torch.zeros(B, T, dtype=torch.long), mask,
                    torch.randn(B, R, D, generator=g), torch.rand(B, R, 4, generator=g), rmask)


def test_sdpa_and_explicit_attention_agree_and_maps_are_distributions():
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny(visual_spatial="6d")).eval()
    x = _inputs()
    fast = model(x)
    slow = model(x, need_attn=True)
    torch.testing.assert_close(fast.mlm_logits, slow.mlm_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(fast.match_logits, slow.match_logits, atol=1e-5, rtol=0)
    maps = slow.encoded.attentions
    assert len(maps.joint) == 2 and maps.joint[0].shape == (2, 4, 11, 11)
    for m in maps.joint:
        torch.testing.assert_close(m.sum(-1), torch.ones(2, 4, 11))
        assert m[0, :, :, 5:7].abs().max() == 0  # padded words get no attention
        assert m[1, :, :, 7 + 2 :].abs().max() == 0  # padded regions get no attention
    t2r = maps.text_to_region()
    assert t2r.shape == (2, 2, 4, 7, 4)
    torch.testing.assert_close(t2r[1, 0], maps.joint[1][0][:, :7, 7:])


def test_padding_does_not_change_real_outputs():
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny()).eval()
    x = _inputs(B=1)
    x.attention_mask[:] = True
    x.region_mask[:] = True
    longer = VLInputs(
        torch.cat([x.input_ids, torch.zeros(1, 3, dtype=torch.long)], 1), torch.zeros(1, 10, dtype=torch.long),
        torch.cat([x.attention_mask, torch.zeros(1, 3, dtype=torch.bool)], 1),
        torch.cat([x.region_feats, torch.randn(1, 2, 16)], 1), torch.cat([x.region_boxes, torch.rand(1, 2, 4)], 1),
        torch.cat([x.region_mask, torch.zeros(1, 2, dtype=torch.bool)], 1),
    )
    a, b = model(x), model(longer)
    torch.testing.assert_close(a.mlm_logits, b.mlm_logits[:, :7], atol=1e-5, rtol=0)
    torch.testing.assert_close(a.match_logits, b.match_logits, atol=1e-5, rtol=0)


def test_alignment_positions_average_the_aligned_words():
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny()).eval()
    emb = model.bert.embeddings
    x = _inputs(B=1)
    align = torch.full((1, 4, 2), -1, dtype=torch.long)
    align[0, 0] = torch.tensor([1, 3])  # region 0 aligned to words 1 and 3
    x.image_text_alignment = align
    # Recompute region 0's pre-LayerNorm embedding by hand.
    pos = emb.position_embeddings.weight
    expected = (emb.visual_projection(x.region_feats[0, 0]) + emb.visual_token_type_embeddings.weight[1]
                + (pos[1] + pos[3]) / 2 + emb.visual_position_embeddings.weight[0])
    got = emb(x)  # after LayerNorm
    ln = torch.nn.functional.layer_norm(expected, (expected.shape[-1],), emb.LayerNorm.weight, emb.LayerNorm.bias, emb.LayerNorm.eps)
    torch.testing.assert_close(got[0, 7], ln, atol=1e-5, rtol=0)
