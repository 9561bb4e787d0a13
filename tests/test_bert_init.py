"""Initialising the text side from a Hugging Face BERT checkpoint: a random `BertForPreTraining` (every
parameter randomised, so that a wrong mapping cannot hide behind zero biases or unit LayerNorms) is saved
with `save_pretrained`, loaded into VisualBERT and LXMERT, and compared tensor by tensor and output by
output (VisualBERT's MLM logits on text equal BERT's to 1e-5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from vlberts.data.batch import VLInputs  # noqa: E402
from vlberts.errors import VlbertsError  # noqa: E402
from vlberts.models.bert_init import init_text_from_bert  # noqa: E402
from vlberts.models.blocks import mask_bias  # noqa: E402
from vlberts.models.builders import build_pretraining_model, lxmert_tiny, visualbert_tiny  # noqa: E402

TOL = 1e-5
# The tiny BERT: width 32, 2 heads, 2 layers, vocabulary 100 (intermediate 37 so no width is shared by accident).
BERT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37,
            max_position_embeddings=64, type_vocab_size=2)
VB = dict(vocab_size=100, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=37, max_position_embeddings=64)


def save_bert(path: Path, seed: int = 0, **kw):
    """A `BertForPreTraining` with every parameter drawn at random, saved with `save_pretrained`."""
    torch.manual_seed(seed)
    hf = transformers.BertForPreTraining(transformers.BertConfig(**{**BERT, **kw})).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in hf.parameters():  # tied tensors (decoder weight/bias) appear once
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    hf.save_pretrained(path)
    return hf


def text_inputs(B=2, T=9, R=0, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 100, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 6:] = False
    ids[1, 6:] = 0
    types = torch.zeros(B, T, dtype=torch.long)
    types[:, 5:] = 1
    return VLInputs(ids, types, mask, torch.randn(B, R, D, generator=g), torch.rand(B, R, 4, generator=g),
                    torch.zeros(B, R, dtype=torch.bool))


def test_visualbert_takes_bert_tensors_and_predicts_masked_words_like_bert(tmp_path):
    hf = save_bert(tmp_path)
    ref_sd = hf.state_dict()
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny(**VB)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = init_text_from_bert(model, tmp_path)
    sd = model.state_dict()

    # Every mapped tensor equals the original; same names in both (VisualBERT keeps BERT's names) ...
    assert len(report.mapping) == 5 + 2 * 16 + 2 + 5 + 2
    for ours, theirs in report.mapping.items():
        assert torch.equal(sd[ours], ref_sd[theirs]), ours
    for k in report.mapping:
        if not k.startswith("bert.embeddings.visual_"):
            assert report.mapping[k] == k
    # ... the visual segment/position tables are copies of BERT's text tables (special_visual_initialize),
    assert torch.equal(sd["bert.embeddings.visual_position_embeddings.weight"], ref_sd["bert.embeddings.position_embeddings.weight"])
    # ... the MLM decoder follows the word embeddings (tied),
    assert torch.equal(sd["cls.predictions.decoder.weight"], ref_sd["bert.embeddings.word_embeddings.weight"])
    # ... and what has no BERT counterpart is untouched.
    assert sorted(report.random) == ["bert.embeddings.visual_projection.bias", "bert.embeddings.visual_projection.weight",
                                     "cls.seq_relationship.bias", "cls.seq_relationship.weight"]
    for k in report.random:
        assert torch.equal(sd[k], before[k])
    assert sorted(report.unused) == ["cls.seq_relationship.bias", "cls.seq_relationship.weight"]
    assert "bert.encoder.layer.0-1" in report.summary()

    # Text only: VisualBERT's MLM logits are BERT's. With no regions at all (R = 0: an empty region
    # axis works end to end) and with regions that are all padding.
    x = text_inputs()
    with torch.no_grad():
        ref = hf(input_ids=x.input_ids, token_type_ids=x.token_type_ids, attention_mask=x.attention_mask.long())
        enc = hf.bert(input_ids=x.input_ids, token_type_ids=x.token_type_ids, attention_mask=x.attention_mask.long())
        real = x.attention_mask  # padded positions are garbage in both
        for R in (0, 3):
            out = model(text_inputs(R=R))  # same text; R = 3 regions that are all padding
            torch.testing.assert_close(out.mlm_logits[real], ref.prediction_logits[real], atol=TOL, rtol=0)
            torch.testing.assert_close(out.encoded.text[real], enc.last_hidden_state[real], atol=TOL, rtol=0)
            torch.testing.assert_close(out.encoded.pooled, enc.pooler_output, atol=TOL, rtol=0)


def test_lxmert_language_encoder_is_bert_and_cross_layers_are_an_option(tmp_path):
    hf = save_bert(tmp_path)
    ref_sd = hf.state_dict()
    torch.manual_seed(0)
    model = build_pretraining_model(lxmert_tiny(intermediate_size=37)).eval()  # N_L = N_R = N_X = 1
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = init_text_from_bert(model, tmp_path)
    sd = model.state_dict()
    for ours, theirs in report.mapping.items():
        assert torch.equal(sd[ours], ref_sd[theirs]), ours
    # Default (the released code): BERT layer 0 -> language layer 0; BERT layer 1 unused; the
    # cross-modality and object-relationship layers untouched.
    assert report.mapping["lxmert.encoder.layer.0.output.LayerNorm.weight"] == "bert.encoder.layer.0.output.LayerNorm.weight"
    assert report.mapping["lxmert.embeddings.word_embeddings.weight"] == "bert.embeddings.word_embeddings.weight"
    assert report.mapping["lxmert.pooler.dense.weight"] == "bert.pooler.dense.weight"
    assert report.mapping["cls.predictions.transform.dense.weight"] == "cls.predictions.transform.dense.weight"
    assert not any(k.startswith(("lxmert.x_layers", "lxmert.r_encoder")) for k in report.mapping)
    assert all(torch.equal(sd[k], before[k]) for k in sd if k.startswith(("lxmert.x_layers", "lxmert.r_encoder")))
    assert "bert.encoder.layer.1.attention.self.query.weight" in report.unused
    assert torch.equal(sd["cls.predictions.decoder.weight"], ref_sd["bert.embeddings.word_embeddings.weight"])

    # The language encoder computes BERT's first layer: same hidden states as BERT's hidden_states[1].
    x = text_inputs()
    with torch.no_grad():
        ref = hf(input_ids=x.input_ids, token_type_ids=x.token_type_ids, attention_mask=x.attention_mask.long(),
                 output_hidden_states=True)
        lang = model.lxmert.embeddings(x.input_ids, x.token_type_ids)
        lang, _ = model.lxmert.encoder(lang, mask_bias(x.attention_mask, lang.dtype))
    real = x.attention_mask
    torch.testing.assert_close(lang[real], ref.hidden_states[1][real], atol=TOL, rtol=0)

    # Options: the language encoder from BERT's top layer ("the top 9 BERT layers", LXMERT footnote 10),
    # and BERT layer 1 into the language side of cross-modality layer 0.
    torch.manual_seed(0)
    other = build_pretraining_model(lxmert_tiny(intermediate_size=37))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    rep = init_text_from_bert(other, tmp_path, language_from=1, cross_from=1)
    sd = other.state_dict()
    assert torch.equal(sd["lxmert.encoder.layer.0.attention.self.query.weight"], ref_sd["bert.encoder.layer.1.attention.self.query.weight"])
    pairs = {
        "lxmert.x_layers.0.lang_self_att.self.key.bias": "bert.encoder.layer.1.attention.self.key.bias",
        "lxmert.x_layers.0.lang_self_att.output.LayerNorm.weight": "bert.encoder.layer.1.attention.output.LayerNorm.weight",
        "lxmert.x_layers.0.lang_ffn.intermediate.dense.weight": "bert.encoder.layer.1.intermediate.dense.weight",
        "lxmert.x_layers.0.lang_ffn.output.dense.bias": "bert.encoder.layer.1.output.dense.bias",
    }
    for ours, theirs in pairs.items():
        assert rep.mapping[ours] == theirs and torch.equal(sd[ours], ref_sd[theirs])
    assert sum(k.startswith("lxmert.x_layers.0.lang_") for k in rep.mapping) == 16
    for k in ("lxmert.x_layers.0.cross_attention.self.query.weight", "lxmert.x_layers.0.visn_ffn.output.dense.weight"):
        assert k in rep.random and torch.equal(sd[k], before[k])
    with pytest.raises(VlbertsError, match="language_from=2"):
        init_text_from_bert(other, tmp_path, language_from=2)


def test_bare_bert_model_and_legacy_pickle_checkpoint(tmp_path):
    # A bare BertModel: no `bert.` prefix, no MLM head (which stays random).
    full = save_bert(tmp_path / "full")
    full.bert.save_pretrained(tmp_path / "bare")
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny(**VB))
    before = model.state_dict()["cls.predictions.transform.dense.weight"].clone()
    rep = init_text_from_bert(model, tmp_path / "bare")
    assert "cls.predictions.bias" in rep.random and "cls.predictions.transform.dense.weight" in rep.random
    assert torch.equal(model.state_dict()["cls.predictions.transform.dense.weight"], before)
    assert torch.equal(model.state_dict()["bert.encoder.layer.1.output.dense.weight"], full.state_dict()["bert.encoder.layer.1.output.dense.weight"])

    # pytorch_model.bin (read with weights_only) in the TF-converted layout: LayerNorm.gamma/beta, and
    # the output bias stored as the decoder's. (transformers 5 writes safetensors only, so torch.save.)
    sd = {}
    for k, v in full.state_dict().items():
        k = k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        sd["cls.predictions.decoder.bias" if k == "cls.predictions.bias" else k] = v.clone()
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    torch.save(sd, legacy / "pytorch_model.bin")
    (legacy / "config.json").write_text((tmp_path / "full" / "config.json").read_text())
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny(**VB))
    rep = init_text_from_bert(model, legacy)
    got = model.state_dict()
    assert torch.equal(got["bert.embeddings.LayerNorm.weight"], full.state_dict()["bert.embeddings.LayerNorm.weight"])
    assert torch.equal(got["cls.predictions.bias"], full.state_dict()["cls.predictions.bias"])
    assert not any("gamma" in k or "beta" in k for k in rep.unused)


def test_mismatches_are_one_line_errors_naming_the_keys(tmp_path):
    save_bert(tmp_path)
    cases = [
        (visualbert_tiny(**{**VB, "hidden_size": 64}), "word_embeddings.weight"),  # width
        (visualbert_tiny(**{**VB, "vocab_size": 120}), r"bert\.embeddings\.word_embeddings\.weight .*\(100, 32\) vs \(120, 32\)"),
        (visualbert_tiny(**{**VB, "max_position_embeddings": 128}), "position_embeddings.weight"),
        (visualbert_tiny(**{**VB, "num_heads": 4}), "num_attention_heads=2 .* num_heads=4"),  # no shape shows it
        (visualbert_tiny(**{**VB, "hidden_act": "relu"}), "hidden_act"),
        (lxmert_tiny(hidden_size=64, intermediate_size=37), "lxmert.embeddings.word_embeddings.weight"),
        (lxmert_tiny(intermediate_size=37, language_layers=3), "language layers need BERT layers 0..2"),
    ]
    for cfg, pattern in cases:
        model = build_pretraining_model(cfg)
        with pytest.raises(VlbertsError, match=pattern) as err:
            init_text_from_bert(model, tmp_path)
        assert "\n" not in str(err.value)
    with pytest.raises(VlbertsError, match="no config.json"):
        init_text_from_bert(build_pretraining_model(visualbert_tiny(**VB)), tmp_path / "nowhere")
    # A number written as a string in config.json is read as the number ("2" heads), as our configs read one;
    # what is no number says so.
    conf = json.loads((tmp_path / "config.json").read_text())
    for value, outcome in (("2", None), ("two", "num_attention_heads='two': not a whole number"), ("4", "num_attention_heads=4 ")):
        (tmp_path / "config.json").write_text(json.dumps({**conf, "num_attention_heads": value}))
        model = build_pretraining_model(visualbert_tiny(**VB))
        if outcome is None:
            init_text_from_bert(model, tmp_path)
        else:
            with pytest.raises(VlbertsError, match=outcome):
                init_text_from_bert(model, tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(conf))
    # a tensor of integers would be cast into the float weights by the copy without a word; NaN copied
    from safetensors.torch import load_file, save_file

    sd = load_file(tmp_path / "model.safetensors")
    key = next(k for k in sd if k.endswith("layer.0.attention.self.query.weight"))
    for bad, message in ((sd[key].long(), "is stored as int64 but the model's is float32"),
                         (sd[key].clone().fill_(float("nan")), "holds NaN or inf")):
        save_file({**sd, key: bad}, tmp_path / "model.safetensors")
        with pytest.raises(VlbertsError) as err:
            init_text_from_bert(build_pretraining_model(visualbert_tiny(**VB)), tmp_path)
        assert str(err.value).startswith(f"{tmp_path}: tensor {key} ") and message in str(err.value)
    save_file(sd, tmp_path / "model.safetensors")
    with pytest.raises(VlbertsError, match="LXMERT"):
        init_text_from_bert(build_pretraining_model(visualbert_tiny(**VB)), tmp_path, cross_from=0)


def test_without_early_fusion_takes_bert_layers_and_keeps_the_new_layer_random(tmp_path):
    hf = save_bert(tmp_path)
    torch.manual_seed(0)
    model = build_pretraining_model(visualbert_tiny(**{**VB, "num_layers": 3, "fusion_layer": 2})).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rep = init_text_from_bert(model, tmp_path)
    assert all(k in rep.random for k in before if k.startswith("bert.encoder.layer.2."))
    assert "bert.encoder.layer.2" in rep.summary().splitlines()[1]
    # The text-only layers are BERT's: their output is BERT's last hidden state, regions or not.
    x = text_inputs(R=3)
    x.region_mask[:] = True
    outs = []
    hook = model.bert.encoder.layer[1].register_forward_hook(lambda m, i, o: outs.append(o[0]))
    with torch.no_grad():
        model(x)
        ref = hf.bert(x.input_ids, x.attention_mask.long(), x.token_type_ids).last_hidden_state
    hook.remove()
    torch.testing.assert_close(outs[0][x.attention_mask], ref[x.attention_mask], atol=TOL, rtol=0)


# --- the pre-training recipe's --bert_init -------------------------------------------------------------


def _recipe_bert(tmp_path: Path, world) -> tuple[Path, object]:
    """A BERT shaped like visualbert-tiny whose vocab.txt is a vocabulary trained on the world's captions."""
    from vlberts.data.coco import read_caption_refs
    from vlberts.text.tokenizer import TextTokenizer

    tok = TextTokenizer.train([c.text for c in read_caption_refs(str(world.captions_train))], vocab_size=200)
    bert = tmp_path / "bert"
    hf = save_bert(bert, vocab_size=tok.vocab_size, num_attention_heads=4, intermediate_size=64)
    tok.save(bert)
    return bert, hf


def test_pretrain_recipe_bert_init(tiny_world, tmp_path):
    from vlberts.recipes.pretrain import PretrainConfig, pretrain
    from vlberts.training.checkpoint import load_pretraining_model

    bert, hf = _recipe_bert(tmp_path, tiny_world)
    base = dict(captions=str(tiny_world.captions_train), features=str(tiny_world.store), model="visualbert-tiny",
                steps=1, batch_size=4, max_text_len=40, lr=0.0, weight_decay=0.0, ckpt_every=100)
    final = pretrain(PretrainConfig(out=str(tmp_path / "run"), bert_init=str(bert), **base))
    model, _, _ = load_pretraining_model(final)
    sd, ref = model.state_dict(), hf.state_dict()
    for k in ("bert.embeddings.word_embeddings.weight", "bert.encoder.layer.1.output.LayerNorm.bias", "cls.predictions.bias"):
        assert torch.equal(sd[k], ref[k]), k  # lr 0: the run's weights are BERT's
    assert (final / "vocab.txt").read_text() == (bert / "vocab.txt").read_text()
    rec = json.loads((tmp_path / "run" / "bert_init.json").read_text())
    assert "bert.embeddings.visual_projection.weight" in rec["random"]

    # Vocabulary errors: none in the checkpoint, a different one, --init together with --bert_init.
    (tmp_path / "novocab").mkdir()
    for name in ("config.json", "model.safetensors"):
        (tmp_path / "novocab" / name).write_bytes((bert / name).read_bytes())
    with pytest.raises(VlbertsError, match="needs the checkpoint's vocab.txt"):
        pretrain(PretrainConfig(out=str(tmp_path / "r2"), bert_init=str(tmp_path / "novocab"), **base))
    other = tmp_path / "other_vocab"
    other.mkdir()
    lines = (bert / "vocab.txt").read_text().splitlines()
    (other / "vocab.txt").write_text("\n".join(lines[:5] + lines[6:] + [lines[5]]) + "\n")  # same size, reordered
    with pytest.raises(VlbertsError, match="differs from the --bert_init checkpoint's"):
        pretrain(PretrainConfig(out=str(tmp_path / "r3"), bert_init=str(bert), tokenizer=str(other), **base))
    (other / "vocab.txt").write_text("\n".join(lines[:-3]) + "\n")
    with pytest.raises(VlbertsError, match=f"has {len(lines) - 3} tokens but the BERT checkpoint's vocabulary has {len(lines)}"):
        pretrain(PretrainConfig(out=str(tmp_path / "r4"), bert_init=str(tmp_path / "novocab"), tokenizer=str(other), **base))
    with pytest.raises(VlbertsError, match="--init and --bert_init"):
        pretrain(PretrainConfig(out=str(tmp_path / "r5"), bert_init=str(bert), init=str(final), **base))


def test_pretrain_bert_lr_mult_slows_exactly_the_tensors_copied_from_bert(tiny_world, tmp_path):
    """--bert_lr_mult (vilbert-multi-task's train_concap.py from BERT: 0.1): the tensors `bert_init.json`
    lists as BERT's learn at a tenth of the rate, the rest at the rate. One Adam update without warm-up or
    decay moves an element with a gradient by about the rate (the update is m / sqrt(v) = the gradient's sign
    at step 1), so each tensor's largest change names its rate."""
    from vlberts.models.builders import build_pretraining_model
    from vlberts.recipes.pretrain import PretrainConfig, pretrain
    from vlberts.training.checkpoint import load_pretraining_model
    from vlberts.training.optim import build_optimizer

    bert, _ = _recipe_bert(tmp_path, tiny_world)
    base = dict(captions=str(tiny_world.captions_train), features=str(tiny_world.store), model="visualbert-tiny",
                steps=1, batch_size=4, max_text_len=40, lr=1e-2, warmup=0, weight_decay=0.0, clip=0, ckpt_every=100,
                bert_init=str(bert))
    start = pretrain(PretrainConfig(out=str(tmp_path / "start"), **{**base, "lr": 0.0}))  # BERT's weights, unmoved
    slow = pretrain(PretrainConfig(out=str(tmp_path / "slow"), bert_lr_mult=0.1, **base))
    rec = json.loads((tmp_path / "slow" / "bert_init.json").read_text())
    w0, w1 = (load_pretraining_model(d)[0].state_dict() for d in (start, slow))
    moved = {k: (w1[k] - w0[k]).abs().max().item() for k in rec["initialised"] + rec["random"]}
    for k in rec["initialised"]:
        assert moved[k] <= 1e-3 * 1.001, k  # 0.1 x 1e-2
    fast = [k for k in rec["random"] if moved[k] > 1e-3 * 1.5]
    assert "bert.embeddings.visual_projection.weight" in fast and len(fast) >= len(rec["random"]) // 2
    assert max(moved[k] for k in rec["initialised"]) > 0.5e-3  # and they did learn
    # The groups: the body's decayed / not decayed, then BERT's tensors' two at a tenth of the rate.
    model = build_pretraining_model(load_pretraining_model(start)[1])
    opt = build_optimizer(model, 1e-2, slow=rec["initialised"], slow_lr_mult=0.1)
    assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-2, pytest.approx(1e-3), pytest.approx(1e-3)]
    assert sum(len(g["params"]) for g in opt.param_groups[2:]) == len(rec["initialised"])
    with pytest.raises(VlbertsError, match="--bert_lr_mult sets the rate of the tensors --bert_init copies"):
        pretrain(PretrainConfig(out=str(tmp_path / "r6"), **{**base, "bert_init": ""}, bert_lr_mult=0.1))


# --- ViLBERT, VL-BERT, W-VisualBERT ---------------------------------------------------------------------


def _init_and_check(model, path, ref_sd):
    """Load BERT into `model`; every copied tensor equals BERT's, every other one is as initialised, and the
    report's initialised + random lists cover the model (tied decoder aside). Returns the report."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    report = init_text_from_bert(model, path)
    sd = model.state_dict()
    for ours, theirs in report.mapping.items():
        if ours not in report.partial:
            assert torch.equal(sd[ours], ref_sd[theirs]), ours
    for k in report.random:
        assert torch.equal(sd[k], before[k]), k
    assert sorted(report.initialised + report.random) == sorted(k for k in sd if k != "cls.predictions.decoder.weight")
    assert set(report.initialised) == set(report.mapping)
    # The MLM decoder is tied to the word embeddings, so it follows them.
    assert torch.equal(sd["cls.predictions.decoder.weight"], ref_sd["bert.embeddings.word_embeddings.weight"])
    assert sorted(report.unused) == sorted(k for k in ref_sd if k not in set(report.mapping.values())
                                           and not k.startswith("cls.predictions.decoder."))  # tied aliases
    return report


def _text_side(ref_sd, num_layers: int, pooler: bool, prefix: str = "bert.") -> set[str]:
    """Our keys that BERT's tensors go to, for a one-stream or text-stream model with BERT's names."""
    keys = {f"{prefix}embeddings.{p}" for p in ("word_embeddings.weight", "position_embeddings.weight",
                                                "token_type_embeddings.weight", "LayerNorm.weight", "LayerNorm.bias")}
    layer = [k[len("bert.encoder.layer.0."):] for k in ref_sd if k.startswith("bert.encoder.layer.0.")]
    assert len(layer) == 16
    keys |= {f"{prefix}encoder.layer.{i}.{p}" for i in range(num_layers) for p in layer}
    if pooler:
        keys |= {f"{prefix}pooler.dense.weight", f"{prefix}pooler.dense.bias"}
    keys |= {"cls.predictions.transform.dense.weight", "cls.predictions.transform.dense.bias",
             "cls.predictions.transform.LayerNorm.weight", "cls.predictions.transform.LayerNorm.bias",
             "cls.predictions.bias"}
    return keys


def test_vilbert_text_stream_is_bert_and_its_poolers_visual_stream_and_co_attention_stay_random(tmp_path):
    from vlberts.models.builders import vilbert_single_stream, vilbert_tiny

    hf = save_bert(tmp_path)
    ref_sd = hf.state_dict()
    # Two streams: 3 text layers (BERT has 2, so text layer 2 stays random), co-attention before text layer 2.
    torch.manual_seed(0)
    model = build_pretraining_model(vilbert_tiny(num_heads=2, intermediate_size=37, t_biattention_id=(2,),
                                                 v_biattention_id=(0,))).eval()
    rep = _init_and_check(model, tmp_path, ref_sd)
    assert set(rep.mapping) == _text_side(ref_sd, 2, pooler=False)
    assert all(ours == theirs for ours, theirs in rep.mapping.items())  # BERT's names
    random_prefixes = ("bert.v_embeddings.", "bert.v_encoder.", "bert.c_layers.", "bert.t_pooler.", "bert.v_pooler.",
                       "bert.encoder.layer.2.", "cls.bi_seq_relationship.", "cls.region_predictions.")
    assert all(k.startswith(random_prefixes) for k in rep.random)
    for p in random_prefixes:
        assert any(k.startswith(p) for k in rep.random), p
    assert "bert.pooler.dense.weight" in rep.unused  # BERT's tanh pooler is not ViLBERT's ReLU pooler
    assert "bert.t_pooler" in rep.summary().splitlines()[1]
    # BERT's pooler and next-sentence head go unused, named as themselves, not as the whole `bert` or `cls`
    # (the MLM head under `cls` was used)
    assert rep.summary().splitlines()[2] == "unused checkpoint tensors (4): bert.pooler, cls.seq_relationship"

    # The text layers before the first co-attention layer compute BERT: layer 1's output is BERT's last state.
    x = text_inputs(R=3, D=16)
    outs = []
    keep = lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o)  # noqa: E731
    hook = model.bert.encoder.layer[1].register_forward_hook(keep)
    with torch.no_grad():
        model(x)
        ref = hf.bert(x.input_ids, x.attention_mask.long(), x.token_type_ids).last_hidden_state
    hook.remove()
    torch.testing.assert_close(outs[0][x.attention_mask], ref[x.attention_mask], atol=TOL, rtol=0)

    # Single stream: the same text mapping; the image embedding and both poolers stay random.
    torch.manual_seed(0)
    single = build_pretraining_model(vilbert_single_stream(
        vocab_size=100, hidden_size=32, num_heads=2, intermediate_size=37, num_layers=2, max_position_embeddings=64,
        visual_dim=16, bi_hidden_size=16, bi_num_heads=2, num_region_classes=11))
    rep = _init_and_check(single, tmp_path, ref_sd)
    assert set(rep.mapping) == _text_side(ref_sd, 2, pooler=False)
    assert all(k.startswith(("bert.v_embeddings.", "bert.t_pooler.", "bert.v_pooler.", "cls.bi_seq_relationship.",
                             "cls.region_predictions.")) for k in rep.random)
    assert "bert.t_pooler.dense.weight" in rep.random


def test_vlbert_takes_bert_segments_into_rows_0_1_and_keeps_the_image_segment(tmp_path):
    from vlberts.models.builders import vlbert_tiny

    hf = save_bert(tmp_path)
    ref_sd = hf.state_dict()
    torch.manual_seed(0)
    model = build_pretraining_model(vlbert_tiny(num_heads=2, intermediate_size=37))
    seg_before = model.state_dict()["bert.embeddings.token_type_embeddings.weight"].clone()  # (3, D)
    rep = _init_and_check(model, tmp_path, ref_sd)
    assert set(rep.mapping) == _text_side(ref_sd, 2, pooler=True)
    seg = model.state_dict()["bert.embeddings.token_type_embeddings.weight"]
    assert seg.shape == (3, 32)
    assert torch.equal(seg[:2], ref_sd["bert.embeddings.token_type_embeddings.weight"])  # segments A, B
    assert torch.equal(seg[2], seg_before[2])  # segment C (the image) as initialised
    assert rep.partial == {"bert.embeddings.token_type_embeddings.weight": "rows 0-1 from BERT, row 2 as initialised"}
    assert "copied in part: bert.embeddings.token_type_embeddings.weight rows 0-1" in rep.summary().splitlines()[3]
    assert "bert.embeddings.token_type_embeddings.weight" in rep.initialised
    assert rep.to_dict()["partial"] == rep.partial
    random_prefixes = ("bert.embeddings.visual_", "bert.embeddings.img_embedding.", "bert.embeddings.end_embedding.",
                       "bert.embeddings.object_mask_", "bert.embeddings.text_only_visual_embedding.", "region_head.")
    assert all(k.startswith(random_prefixes) for k in rep.random), rep.random

    # A BERT with 3 segment rows: still only the two text rows are copied, and the report says so.
    save_bert(tmp_path / "three", type_vocab_size=3)
    torch.manual_seed(0)
    model = build_pretraining_model(vlbert_tiny(num_heads=2, intermediate_size=37))
    seg_before = model.state_dict()["bert.embeddings.token_type_embeddings.weight"].clone()
    rep = init_text_from_bert(model, tmp_path / "three")
    seg = model.state_dict()["bert.embeddings.token_type_embeddings.weight"]
    assert torch.equal(seg[2], seg_before[2])
    assert rep.partial["bert.embeddings.token_type_embeddings.weight"] == (
        "rows 0-1 from BERT, row 2 as initialised, BERT's row 2 unused")
    # A different width is still an error, naming the table.
    save_bert(tmp_path / "wide", hidden_size=64, num_attention_heads=2)
    with pytest.raises(VlbertsError, match="word_embeddings.weight"):
        init_text_from_bert(build_pretraining_model(vlbert_tiny(num_heads=2, intermediate_size=37)), tmp_path / "wide")


def test_wvisualbert_takes_bert_and_keeps_visual_tag_and_box_modules_random(tmp_path):
    from vlberts.models.wvisualbert import wvisualbert_tiny

    hf = save_bert(tmp_path)
    ref_sd = hf.state_dict()
    torch.manual_seed(0)
    model = build_pretraining_model(wvisualbert_tiny(num_heads=2, intermediate_size=37))
    rep = _init_and_check(model, tmp_path, ref_sd)
    assert set(rep.mapping) == _text_side(ref_sd, 2, pooler=True)
    assert all(ours == theirs for ours, theirs in rep.mapping.items())
    random_prefixes = ("bert.embeddings.visn_", "bert.embeddings.spatial.", "bert.embeddings.tag_layer_norm.",
                       "obj_predict_head.")
    assert all(k.startswith(random_prefixes) for k in rep.random), rep.random
    for p in random_prefixes:
        assert any(k.startswith(p) for k in rep.random), p
    assert rep.partial == {}
    assert sorted(rep.unused) == ["cls.seq_relationship.bias", "cls.seq_relationship.weight"]
    with pytest.raises(VlbertsError, match="LXMERT"):
        init_text_from_bert(model, tmp_path, language_from=1)
