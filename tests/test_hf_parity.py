"""Numerical parity with Hugging Face's VisualBERT: save a random HF model, load it through our
converter, compare outputs on the same inputs (padding included) to 1e-5."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vlberts.data.batch import VLInputs
from vlberts.errors import VlbertsError
from vlberts.models.convert_hf import load_hf_visualbert

TOL = 1e-5


def _hf_config(**kw):
    base = dict(
        vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
        visual_embedding_dim=20, max_position_embeddings=64, type_vocab_size=2,
    )
    base.update(kw)
    return transformers.VisualBertConfig(**base)


def _inputs(seed=0, B=3, T=9, R=5, D=20, V=99):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:] = False  # padded text
    ids[1, 6:] = 0
    types = torch.zeros(B, T, dtype=torch.long)
    types[:, 4:] = 1
    rmask = torch.ones(B, R, dtype=torch.bool)
    rmask[2, 3:] = False  # padded regions
    feats = torch.randn(B, R, D, generator=g)
    return VLInputs(ids, types, mask, feats, torch.rand(B, R, 4, generator=g), rmask)


def _hf_forward(hf, x):
    return hf(
        input_ids=x.input_ids, token_type_ids=x.token_type_ids, attention_mask=x.attention_mask.long(),
        visual_embeds=x.region_feats, visual_attention_mask=x.region_mask.long(),
        output_hidden_states=True, output_attentions=True,
    )


@pytest.mark.parametrize("cls_name", ["VisualBertForPreTraining", "VisualBertModel"])
def test_visualbert_matches_hugging_face(tmp_path, cls_name):
    torch.manual_seed(0)
    hf = getattr(transformers, cls_name)(_hf_config()).eval()
    hf.save_pretrained(tmp_path)
    ours = load_hf_visualbert(tmp_path).eval()
    x = _inputs()
    T = x.input_ids.shape[1]
    with torch.no_grad():
        ref = _hf_forward(hf, x)
        out = ours(x)
        out_attn = ours(x, need_attn=True)
    if cls_name == "VisualBertForPreTraining":
        torch.testing.assert_close(out.mlm_logits, ref.prediction_logits[:, :T], atol=TOL, rtol=0)
        torch.testing.assert_close(out.match_logits, ref.seq_relationship_logits, atol=TOL, rtol=0)
        ref_hidden = ref.hidden_states[-1]
    else:
        ref_hidden = ref.last_hidden_state
        torch.testing.assert_close(out.encoded.pooled, ref.pooler_output, atol=TOL, rtol=0)
    hidden = torch.cat([out.encoded.text, out.encoded.vision], dim=1)
    # Padded positions are garbage in both implementations; compare the real ones.
    real = torch.cat([x.attention_mask, x.region_mask], dim=1)
    torch.testing.assert_close(hidden[real], ref_hidden[real], atol=TOL, rtol=0)
    # The explicit attention path returns HF's attention maps and the same outputs.
    for ours_map, ref_map in zip(out_attn.encoded.attentions.joint, ref.attentions, strict=True):
        torch.testing.assert_close(ours_map, ref_map, atol=TOL, rtol=0)
    torch.testing.assert_close(out_attn.mlm_logits, out.mlm_logits, atol=TOL, rtol=0)


def test_visual_embedding_dim_mismatch_names_the_key(tmp_path):
    hf = transformers.VisualBertForPreTraining(_hf_config())
    hf.save_pretrained(tmp_path)
    import json

    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["visual_embedding_dim"] = 21
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VlbertsError, match="visual_projection.weight"):
        load_hf_visualbert(tmp_path)
