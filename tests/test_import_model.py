"""`vlberts models import`: a released checkpoint written as a vlberts model directory. The directory loads
back as every command loads a model, with the converter's outputs to the bit; the grounding analysis runs
on an imported Hugging Face VisualBERT; bad input is one line and exit code 2."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from vlberts.data.batch import VLInputs
from vlberts.features.store import RegionStore
from vlberts.recipes.analyze_grounding import GroundingConfig, analyze_grounding
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import load_pretraining_model

transformers = pytest.importorskip("transformers")

@pytest.fixture
def run(capsys):
    """`vlberts models import ARGS` in this process (the entry point `main`, as the installed command runs it):
    (exit code, stdout, stderr)."""
    from test_bad_settings import run_cli

    def run_import(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()  # what the test printed before (transformers' save_pretrained progress) is not ours
        return run_cli(["models", "import", *args], capsys)

    return run_import


def _batch(V: int, D: int, seed: int = 0, B: int = 2, T: int = 7, R: int = 5) -> VLInputs:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, V, (B, T), generator=g)
    xy = torch.rand(B, R, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + torch.rand(B, R, 2, generator=g) * 0.5], dim=-1)
    return VLInputs(ids, torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.bool),
                    torch.randn(B, R, D, generator=g), boxes, torch.ones(B, R, dtype=torch.bool))


def _vocab(path: Path, n: int) -> Path:
    """A BERT vocab.txt of `n` tokens: the five specials, then words."""
    path.write_text("".join(f"{t}\n" for t in ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *(f"w{i}" for i in range(n - 5))]))
    return path


def _randomised(hf):
    """Every parameter random (HF starts biases at 0 and LayerNorms at 1, which would hide a misplaced one)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return hf.eval()


def test_hf_visualbert_imports_loads_back_and_is_analysed(tiny_world, tiny_pretrained, tmp_path, run):
    from vlberts.models.convert_hf import load_hf_visualbert

    vocab = (tiny_pretrained / "vocab.txt").read_text().splitlines()
    dim = RegionStore(tiny_world.store).feature_dim
    hf = _randomised(transformers.VisualBertForPreTraining(transformers.VisualBertConfig(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
        visual_embedding_dim=dim, max_position_embeddings=80, type_vocab_size=2)))
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    shutil.copy(tiny_pretrained / "vocab.txt", src / "vocab.txt")  # found beside the checkpoint

    code, out_, err = run(str(src), "--format=hf-visualbert", f"--out={tmp_path / 'm'}")
    assert code == 0, err
    assert out_.strip().endswith(f"wrote {tmp_path / 'm'}") and "as visualbert, 3 layers x 4 heads" in out_
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    assert meta["import_format"] == "hf-visualbert" and meta["imported_from"] == str(src) and "task" not in meta
    assert TextTokenizer.load(tmp_path / "m").vocab_size == len(vocab)

    ours, _, _ = load_pretraining_model(tmp_path / "m")  # strictly, as every command loads a model
    ref = load_hf_visualbert(src)
    x = _batch(len(vocab), dim)
    with torch.no_grad():
        a, b = ours.eval()(x), ref.eval()(x)
    assert torch.equal(a.mlm_logits, b.mlm_logits) and torch.equal(a.match_logits, b.match_logits)

    rep = analyze_grounding(GroundingConfig(model=str(tmp_path / "m"), entities=str(tiny_world.entities),
                                            features=str(tiny_world.store), out=str(tmp_path / "g"),
                                            explorer_examples=0, qualitative=0))
    assert rep.result.accuracy.shape == (3, 4) and rep.result.n_entities > 0


def test_hf_lxmert_imports_with_its_heads_and_loads_back(tmp_path, run):
    from vlberts.models.convert_hf_lxmert import load_hf_lxmert

    hf = _randomised(transformers.LxmertForPreTraining(transformers.LxmertConfig(
        vocab_size=40, hidden_size=32, num_attention_heads=2, intermediate_size=37, l_layers=2, r_layers=1,
        x_layers=2, visual_feat_dim=16, max_position_embeddings=64, num_qa_labels=7, num_object_labels=11,
        num_attr_labels=5)))
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    vocab = _vocab(tmp_path / "vocab.txt", 15)

    code, out_, err = run(str(src), "--format=hf-lxmert", f"--vocab={vocab}", f"--out={tmp_path / 'm'}")
    assert code == 0, err
    ours, cfg, _ = load_pretraining_model(tmp_path / "m")
    assert (cfg.num_qa_labels, cfg.num_object_labels, cfg.num_attr_labels) == (7, 11, 5)
    assert TextTokenizer.load(tmp_path / "m").vocab_size == 15
    ref = load_hf_lxmert(src)
    x = _batch(40, 16)
    with torch.no_grad():
        a, b = ours.eval()(x), ref.eval()(x)
    for name in ("mlm_logits", "match_logits", "obj_logits", "attr_logits", "feat_pred", "qa_logits"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_original_lxmert_imports_from_its_own_key_layout_with_the_same_outputs(tmp_path, run):
    """airsplay/lxmert's `*_LXRT.pth` (`bert.` where Hugging Face has `lxmert.`, `module.` from DataParallel, the
    tied decoder saved too): imported with its config read off the tensors, the outputs are the HF model's."""
    from vlberts.models.convert_hf_lxmert import load_hf_lxmert

    hf = _randomised(transformers.LxmertForPreTraining(transformers.LxmertConfig(
        vocab_size=40, hidden_size=128, num_attention_heads=2, intermediate_size=37, l_layers=2, r_layers=1,
        x_layers=3, visual_feat_dim=16, max_position_embeddings=64, num_qa_labels=7, num_object_labels=11,
        num_attr_labels=5)))
    original = {"module." + ("bert." + k[len("lxmert."):] if k.startswith("lxmert.") else k): v.clone()
                for k, v in hf.state_dict().items()}
    assert "module.bert.encoder.x_layers.2.visual_attention.att.query.weight" in original
    assert "module.cls.predictions.decoder.weight" in original and "module.answer_head.logit_fc.3.bias" in original
    torch.save(original, tmp_path / "Epoch20_LXRT.pth")
    vocab = _vocab(tmp_path / "vocab.txt", 40)

    code, out_, err = run(str(tmp_path / "Epoch20_LXRT.pth"), "--format=lxmert", f"--vocab={vocab}",
                          f"--out={tmp_path / 'm'}")
    assert code == 0, err
    ours, cfg, meta = load_pretraining_model(tmp_path / "m")
    assert (cfg.language_layers, cfg.relation_layers, cfg.cross_layers, cfg.num_heads, cfg.intermediate_size) == (2, 1, 3, 2, 37)
    assert (cfg.num_qa_labels, cfg.num_object_labels, cfg.num_attr_labels, cfg.visual_dim) == (7, 11, 5, 16)
    assert meta["import_format"] == "lxmert"
    hf.save_pretrained(tmp_path / "hf")  # the same weights in Hugging Face's layout, read by its converter
    ref = load_hf_lxmert(tmp_path / "hf")
    x = _batch(40, 16)
    with torch.no_grad():
        a, b = ours.eval()(x), ref.eval()(x)
    for name in ("mlm_logits", "match_logits", "obj_logits", "attr_logits", "feat_pred", "qa_logits"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name

    # A fine-tuned task model (src/tasks/vqa.py's BEST.pth, its encoder under DataParallel): the encoder, its
    # answer head left out and named
    best = {"lxrt_encoder.model.module." + k[len("module."):]: v for k, v in original.items() if k.startswith("module.bert.")}
    best.update({"logit_fc.0.weight": torch.zeros(256, 128), "logit_fc.3.bias": torch.zeros(9)})
    torch.save(best, tmp_path / "BEST.pth")
    code, out_, err = run(str(tmp_path / "BEST.pth"), "--format=lxmert", f"--vocab={vocab}", f"--out={tmp_path / 'ft'}")
    assert code == 0, err
    assert "left out: the fine-tuning head logit_fc (2 tensors)" in out_
    tuned, _, _ = load_pretraining_model(tmp_path / "ft")
    with torch.no_grad():
        torch.testing.assert_close(tuned.eval().lxmert(x).text, ours.lxmert(x).text, rtol=0, atol=0)

    # The heads are not in the names of the weights: hidden_size / 64 unless --config says.
    (tmp_path / "heads.json").write_text(json.dumps({"num_attention_heads": 4}))
    code, _, err = run(str(tmp_path / "Epoch20_LXRT.pth"), "--format=lxmert", f"--vocab={vocab}",
                       f"--out={tmp_path / 'm4'}", f"--config={tmp_path / 'heads.json'}")
    assert code == 0, err
    assert load_pretraining_model(tmp_path / "m4")[1].num_heads == 4
    # A misspelt setting is not dropped without a word.
    (tmp_path / "typo.json").write_text(json.dumps({"num_attention_head": 4}))
    code, _, err = run(str(tmp_path / "Epoch20_LXRT.pth"), "--format=lxmert", f"--vocab={vocab}",
                       f"--out={tmp_path / 'm5'}", f"--config={tmp_path / 'typo.json'}")
    assert code == 2 and err.startswith(f"error: {tmp_path / 'typo.json'}: unknown key(s) num_attention_head; valid "
                                        "keys: attention_probs_dropout_prob, hidden_act, ") and err.count("\n") == 1
    torch.save({"module.something.weight": torch.zeros(2)}, tmp_path / "other.pth")
    code, _, err = run(str(tmp_path / "other.pth"), "--format=lxmert", f"--vocab={vocab}", f"--out={tmp_path / 'x'}")
    assert code == 2 and err.strip() == (f"error: {tmp_path / 'other.pth'}: not an LXMERT checkpoint: no "
                                         "bert.embeddings.word_embeddings.weight (LXMERT's LXRTPretraining state dict, "
                                         "e.g. Epoch20_LXRT.pth)")


def _original_visualbert(hf, head: str = "cls") -> dict:
    """A Hugging Face VisualBERT's weights in uclanlp/visualbert's own names (Hugging Face's conversion script's
    renames undone; the old code had no decoder bias, and the task head was `bert.classifier`)."""
    out = {}
    for k, v in hf.state_dict().items():
        if k.endswith("position_ids") or k == "cls.predictions.decoder.bias":
            continue
        k = ("bert.bert." + k[len("visual_bert."):] if k.startswith("visual_bert.") else
             "bert." + k if k.startswith("cls.predictions.") or k.startswith("cls.seq_relationship.") else
             f"bert.{head}." + k[len("cls."):] if k.startswith("cls.") else k)
        for theirs, ours in (("visual_token_type_embeddings", "token_type_embeddings_visual"),
                             ("visual_position_embeddings", "position_embeddings_visual"),
                             ("visual_projection", "projection")):
            k = k.replace(theirs, ours)
        out[k] = v.clone()
    return out


def test_original_visualbert_imports_from_its_own_key_layout_with_the_same_outputs(tmp_path, run):
    """uclanlp/visualbert's `.th` files: a pre-trained one imports with its config read off the tensors and the
    outputs of the same weights saved by Hugging Face; a fine-tuned one gives its encoder, its task head (told
    by the file's name) and VCR's ResNet-50 left out and named."""
    from vlberts.models.convert_hf import load_hf_visualbert

    config = transformers.VisualBertConfig(vocab_size=40, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                           intermediate_size=37, visual_embedding_dim=16, max_position_embeddings=64)
    hf = _randomised(transformers.VisualBertForPreTraining(config))
    original = _original_visualbert(hf)
    assert {"bert.bert.embeddings.projection.weight", "bert.bert.embeddings.token_type_embeddings_visual.weight",
            "bert.cls.seq_relationship.weight", "bert.cls.predictions.decoder.weight"} <= original.keys()
    torch.save(original, tmp_path / "coco_pre_trained.th")
    vocab = _vocab(tmp_path / "vocab.txt", 40)
    code, out_, err = run(str(tmp_path / "coco_pre_trained.th"), "--format=visualbert", f"--vocab={vocab}",
                          f"--out={tmp_path / 'm'}")
    assert code == 0, err
    assert "as visualbert, 2 layers x 2 heads, width 128, visual_dim 16" in out_
    ours, cfg, meta = load_pretraining_model(tmp_path / "m")
    assert meta["import_format"] == "visualbert" and "left_out" not in meta and cfg.intermediate_size == 37
    hf.save_pretrained(tmp_path / "hf")
    ref = load_hf_visualbert(tmp_path / "hf")
    x = _batch(40, 16)
    with torch.no_grad():
        a, b = ours.eval()(x), ref.eval()(x)
    assert torch.equal(a.mlm_logits, b.mlm_logits) and torch.equal(a.match_logits, b.match_logits)

    vcr = _randomised(transformers.VisualBertForMultipleChoice(config))
    fine_tuned = {**_original_visualbert(vcr, head="classifier"), "detector.backbone.conv1.weight": torch.zeros(4, 3, 7, 7)}
    assert "bert.classifier.weight" in fine_tuned
    torch.save(fine_tuned, tmp_path / "vcr_fine_tune.th")
    (tmp_path / "heads.json").write_text(json.dumps({"num_attention_heads": 4}))
    code, out_, err = run(str(tmp_path / "vcr_fine_tune.th"), "--format=visualbert", f"--vocab={vocab}",
                          f"--out={tmp_path / 'vcr'}", f"--config={tmp_path / 'heads.json'}")
    assert code == 0, err
    ours, cfg, meta = load_pretraining_model(tmp_path / "vcr")
    assert cfg.num_heads == 4
    assert meta["left_out"].startswith("VisualBertForMultipleChoice's choice scorer on the pooled output")
    assert meta["left_out"].endswith("the ResNet-50 detector (1 detector.* tensors; region features come from a store)")
    enc = {k: v for k, v in ours.state_dict().items() if k.startswith("bert.")}
    assert all(torch.equal(v, vcr.state_dict()["visual_bert." + k[len("bert."):]]) for k, v in enc.items()
               if "visual_bert." + k[len("bert."):] in vcr.state_dict())

    # A Flickr30K model trained with add_spatial_features: its projection reads 16 feature values and the box's 6
    # coordinates; with --config {"visual_spatial": "6d"} ours appends them itself, as the original loader did.
    flickr = _randomised(transformers.VisualBertForPreTraining(
        transformers.VisualBertConfig(**{**config.to_dict(), "visual_embedding_dim": 22})))
    torch.save(_original_visualbert(flickr), tmp_path / "flickr_pre_trained.th")
    (tmp_path / "6d.json").write_text(json.dumps({"visual_spatial": "6d"}))
    code, _, err = run(str(tmp_path / "flickr_pre_trained.th"), "--format=visualbert", f"--vocab={vocab}",
                       f"--out={tmp_path / 'flickr'}", f"--config={tmp_path / '6d.json'}")
    assert code == 0, err
    ours, cfg, _ = load_pretraining_model(tmp_path / "flickr")
    assert (cfg.visual_dim, cfg.projection_in) == (16, 22)
    (tmp_path / "typo.json").write_text(json.dumps({"visual_spatial": "6d", "bogus": 1}))
    code, _, err = run(str(tmp_path / "flickr_pre_trained.th"), "--format=visualbert", f"--vocab={vocab}",
                       f"--out={tmp_path / 'flickr2'}", f"--config={tmp_path / 'typo.json'}")
    assert code == 2 and err.startswith(f"error: {tmp_path / 'typo.json'}: unknown key(s) bogus; valid keys: ")
    flickr.save_pretrained(tmp_path / "hf-flickr")
    ref = load_hf_visualbert(tmp_path / "hf-flickr")
    b = x.region_boxes
    spatial = torch.stack([b[..., 0], b[..., 1], b[..., 2], b[..., 3], b[..., 2] - b[..., 0], b[..., 3] - b[..., 1]], -1)
    with torch.no_grad():
        a = ours.eval()(x)
        r = ref.eval()(dataclasses.replace(x, region_feats=torch.cat([x.region_feats, spatial], -1)))
    assert torch.allclose(a.mlm_logits, r.mlm_logits, atol=1e-5) and torch.allclose(a.match_logits, r.match_logits, atol=1e-5)

    torch.save({"something.weight": torch.zeros(2)}, tmp_path / "other.th")
    code, _, err = run(str(tmp_path / "other.th"), "--format=visualbert", f"--vocab={vocab}", f"--out={tmp_path / 'x'}")
    assert code == 2 and err.strip() == (f"error: {tmp_path / 'other.th'}: not a VisualBERT checkpoint: no "
                                         "bert.bert.embeddings.word_embeddings.weight (uclanlp/visualbert's .th state "
                                         "dict, e.g. coco_pre_trained.th)")


def test_original_vilbert_imports_with_its_config_and_loads_back(tmp_path, run):
    from test_vilbert import ORIGINAL_CONFIG, _original_state_dict, _write_original

    from vlberts.models.convert_vilbert import load_original_vilbert

    weights, config = _write_original(tmp_path, _original_state_dict())
    vocab = _vocab(tmp_path / "vocab.txt", 100)
    code, out_, err = run(str(weights), "--format=vilbert", f"--config={config}", f"--out={tmp_path / 'm'}")  # vocab beside it
    assert code == 0, err
    ours, cfg, _ = load_pretraining_model(tmp_path / "m")
    assert cfg.v_hidden_size == ORIGINAL_CONFIG["v_hidden_size"]
    assert TextTokenizer.load(tmp_path / "m").vocab_size == len(vocab.read_text().splitlines())
    ref = load_original_vilbert(weights, config)
    x = _batch(100, 16)
    with torch.no_grad():
        a, b = ours.eval()(x), ref.eval()(x)
    assert torch.equal(a.mlm_logits, b.mlm_logits) and torch.equal(a.encoded.pooled, b.encoded.pooled)


def test_original_vlbert_imports_with_a_config_and_loads_back(tmp_path, run):
    from test_convert_vlbert import CFG, original_state_dict

    from vlberts.config import to_dict
    from vlberts.models.convert_vlbert import load_original_vlbert

    weights = tmp_path / "vl-bert_tiny_e2e-0009.model"
    torch.save({"state_dict": original_state_dict()}, weights)
    _vocab(tmp_path / "vocab.txt", CFG.vocab_size)
    config = tmp_path / "changes.json"
    config.write_text(json.dumps(to_dict(CFG)))  # every setting: the tiny config the weights were written for
    code, out_, err = run(str(weights), "--format=vlbert", f"--config={config}", f"--out={tmp_path / 'm'}")
    assert code == 0, err
    ours, cfg, _ = load_pretraining_model(tmp_path / "m")
    assert cfg == CFG
    ref = load_original_vlbert(weights, CFG, drop_backbone=True)
    x = _batch(CFG.vocab_size, CFG.visual_dim)
    with torch.no_grad():
        a, b = ours.eval()(x), ref.eval()(x)
    assert torch.equal(a.mlm_logits, b.mlm_logits) and torch.equal(a.encoded.pooled, b.encoded.pooled)

    assert "left out" not in out_ and "left_out" not in json.loads((tmp_path / "m" / "config.json").read_text())
    # an end-to-end file: its ResNet is left behind and said so, as a fine-tuned file's task head is
    e2e = original_state_dict()
    e2e["image_feature_extractor.backbone.conv1.weight"] = torch.randn(4, 3, 7, 7)
    torch.save({"state_dict": e2e}, weights)
    code, out_, err = run(str(weights), "--format=vlbert", f"--config={config}", f"--out={tmp_path / 'e2e'}")
    assert code == 0, err
    assert "left out: the end-to-end ResNet (1 image_feature_extractor.* tensors" in out_
    assert json.loads((tmp_path / "e2e" / "config.json").read_text())["left_out"].startswith("the end-to-end ResNet")

    config.write_text(json.dumps({"num_region_clases": 81}))
    code, out_, err = run(str(weights), "--format=vlbert", f"--config={config}", f"--out={tmp_path / 'n'}")
    assert code == 2 and "num_region_clases" in err and "num_region_classes" in err
    assert len(err.strip().splitlines()) == 1


def test_bad_imports_are_one_line(tmp_path, run):
    hf = transformers.VisualBertModel(transformers.VisualBertConfig(
        vocab_size=12, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20,
        visual_embedding_dim=8))
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    out = tmp_path / "m"

    def error(*args: str) -> str:
        code, _, err = run(*args)
        assert code == 2 and "Traceback" not in err, err
        lines = err.strip().splitlines()
        assert len(lines) == 1, lines
        return lines[0]

    assert error(str(src), "--format=hf-visualbert", f"--out={out}") == (
        f"error: {src}: no vocab.txt beside the checkpoint: pass --vocab with the BERT vocabulary it was trained "
        "with (e.g. bert-base-uncased's vocab.txt)")
    assert "unknown format 'hf-visualbrt'; valid: hf-visualbert, visualbert, hf-lxmert, lxmert, vilbert, vlbert" in error(
        str(src), "--format=hf-visualbrt", f"--out={out}")
    big = _vocab(tmp_path / "big.txt", 13)
    assert error(str(src), "--format=hf-visualbert", f"--vocab={big}", f"--out={out}") == (
        f"error: {big}: holds 13 tokens but the checkpoint has 12 word embeddings (a vocabulary from another model?)")
    assert error(str(tmp_path / "nothing"), "--format=hf-lxmert", f"--vocab={big}", f"--out={out}") == (
        f"error: {tmp_path / 'nothing'}: checkpoint not found")
    weights = next(src.glob("model.safetensors"))  # the file, where the format reads its folder
    assert error(str(weights), "--format=hf-visualbert", f"--vocab={big}", f"--out={out}") == (
        f"error: {weights}: --format hf-visualbert reads a save_pretrained directory (config.json and the weights), "
        f"not a file: give its folder, {src.resolve()}")
    assert error(str(big), "--format=hf-visualbert", f"--vocab={big}", f"--out={out}").endswith(
        "not a file: give that directory")  # a file in no save_pretrained folder: no folder to suggest
    assert not out.exists()  # nothing half-written

    small = _vocab(tmp_path / "vocab.txt", 12)
    assert run(str(src), "--format=hf-visualbert", f"--vocab={small}", f"--out={out}")[0] == 0
    assert "already exists and is not empty (pass --overwrite to replace it)" in error(
        str(src), "--format=hf-visualbert", f"--vocab={small}", f"--out={out}")
    assert run(str(src), "--format=hf-visualbert", f"--vocab={small}", f"--out={out}", "--overwrite")[0] == 0


def test_hf_lxmert_with_its_answer_table_starts_vqa_from_its_qa_head(tiny_world, tiny_pretrained, tmp_path, run):
    """`--qa_answers=all_ans.json` names the QA head's rows (LXMERT's released table, in order): VQA fine-tuning
    from the imported model then starts its classifier from the head, LXMERT's `--loadLXMERTQA`."""
    from vlberts.data.vqa import read_vqa
    from vlberts.recipes.finetune_qa import build_qa_model
    from vlberts.tasks.vqa import build_answer_vocab

    vqa_answers = build_answer_vocab(read_vqa(*tiny_world.vqa("train")), 1).answers
    table = [*reversed(vqa_answers[1:]), "kite"]  # every VQA answer but the first, in another order
    hf = _randomised(transformers.LxmertForPreTraining(transformers.LxmertConfig(
        vocab_size=len((tiny_pretrained / "vocab.txt").read_text().splitlines()), hidden_size=32,
        num_attention_heads=2, intermediate_size=37, l_layers=1, r_layers=1, x_layers=1,
        visual_feat_dim=RegionStore(tiny_world.store).feature_dim, max_position_embeddings=64,
        num_qa_labels=len(table), num_object_labels=11, num_attr_labels=5)))
    src = tmp_path / "hf"
    hf.save_pretrained(src)
    (tmp_path / "all_ans.json").write_text(json.dumps([{"ans": a, "dsets": ["vqa"]} for a in table]))
    out = tmp_path / "m"
    code, _, err = run(str(src), "--format=hf-lxmert", f"--vocab={tiny_pretrained / 'vocab.txt'}", f"--out={out}",
                       f"--qa_answers={tmp_path / 'all_ans.json'}")
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["qa_answers"] == table

    model, _, copied = build_qa_model(out, build_answer_vocab(read_vqa(*tiny_world.vqa("train")), 1))
    assert copied == len(vqa_answers) - 1
    head = {k: v for k, v in hf.state_dict().items() if k.startswith("answer_head.logit_fc.3.")}
    w, b = model.state_dict()["classifier.logit_fc.3.weight"], model.state_dict()["classifier.logit_fc.3.bias"]
    for i, answer in enumerate(vqa_answers[1:], 1):
        assert torch.equal(w[i], head["answer_head.logit_fc.3.weight"][table.index(answer)])
        assert torch.equal(b[i], head["answer_head.logit_fc.3.bias"][table.index(answer)])
    assert not w[0].any() and b[0] == 0  # not in the table: zero, as LXMERT's load_lxmert_qa leaves it

    (tmp_path / "short.json").write_text(json.dumps(table[:-1]))
    code, _, err = run(str(src), "--format=hf-lxmert", f"--vocab={tiny_pretrained / 'vocab.txt'}",
                       f"--out={tmp_path / 'bad'}", f"--qa_answers={tmp_path / 'short.json'}")
    assert code == 2 and err.strip() == (f"error: {tmp_path / 'short.json'}: --qa_answers names {len(table) - 1} "
                                         f"answers but the checkpoint's QA head has {len(table)} rows")
    assert not (tmp_path / "bad").exists()


def test_a_vocabulary_much_shorter_than_the_word_table_is_warned_of(tmp_path, run):
    """An uncased checkpoint with a cased vocab.txt (28,996 tokens for 30,522 rows) imports, but every token would
    take another's embedding: a warning names the file; a table padded by a few rows says nothing."""
    hf = transformers.VisualBertModel(transformers.VisualBertConfig(
        vocab_size=300, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20,
        visual_embedding_dim=8))
    hf.save_pretrained(tmp_path / "hf")
    short = _vocab(tmp_path / "short.txt", 100)
    code, _, err = run(str(tmp_path / "hf"), "--format=hf-visualbert", f"--vocab={short}", f"--out={tmp_path / 'a'}")
    assert code == 0 and err.startswith(f"warning: {short}: 100 tokens for the checkpoint's 300 word embeddings; a "
                                        "padded table has a few rows more, not 200")
    padded = _vocab(tmp_path / "padded.txt", 290)
    code, _, err = run(str(tmp_path / "hf"), "--format=hf-visualbert", f"--vocab={padded}", f"--out={tmp_path / 'b'}")
    assert code == 0 and "warning" not in err


def test_a_file_of_another_size_without_config_says_to_pass_one(tmp_path, run):
    """A ViLBERT file read with the assumed base config (no --config) does not fit its shapes: the one-line error
    says first that --config is what is missing, then which shapes differ."""
    from test_vilbert import _original_state_dict, _write_original

    weights, _ = _write_original(tmp_path, _original_state_dict())
    _vocab(tmp_path / "vocab.txt", 100)
    code, _, err = run(str(weights), "--format=vilbert", f"--out={tmp_path / 'm'}")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"error: {weights}: weights do not fit vilbert-multi-task's base config "
                          "(bert_base_6layer_6conect.json), which is assumed without --config: pass the file's own "
                          "config with --config; shape mismatch: ")
