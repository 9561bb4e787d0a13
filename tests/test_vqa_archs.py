"""VQA fine-tuning for every architecture in its paper's form, on the tiny world: each tiny model is
pre-trained for a few updates, fine-tuned on VQA, scored; the answer head reads what its paper says
(the [MASK] slot, pool(h_CLS) * pool(h_IMG), the pooled output, with tags for W-VisualBERT); the encoder
comes from the pre-training checkpoint; the fine-tuned directory reloads with the same predictions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_finetune_vqa import vqa_cfg  # the same fine-tuning settings

from vlberts.cli import main
from vlberts.data.batch import TagInputs
from vlberts.data.vqa import read_vqa
from vlberts.data.vqa_dataset import collate_vqa
from vlberts.features.store import RegionStore
from vlberts.models.wvisualbert import WVisualBertForVQA, wvisualbert_tiny
from vlberts.recipes.finetune_vqa import (
    FinetuneVQAConfig,
    build_vqa_model,
    finetune_vqa,
    load_vqa_model,
    predict_vqa,
    vqa_data,
)
from vlberts.recipes.pretrain import PretrainConfig, pretrain
from vlberts.tasks.vqa import AnswerVocab, build_answer_vocab
from vlberts.text.tokenizer import TextTokenizer

VLBERTS = Path(sys.executable).with_name("vlberts")
ARCHS = ["visualbert", "vilbert", "vlbert", "lxmert", "wvisualbert"]
HEADS = {"visualbert": "mask", "vilbert": "img_cls_product", "vlbert": "answer_slot", "lxmert": "pooled",
         "wvisualbert": "pooled"}
MAX_REGIONS = 12


@pytest.fixture(scope="module")
def pretrained(tiny_world, tmp_path_factory) -> dict[str, Path]:
    """arch -> model directory of its tiny config pre-trained for 2 updates with its paper's objectives."""
    root = tmp_path_factory.mktemp("vqa_archs_pt")
    return {arch: pretrain(PretrainConfig(
        captions=str(tiny_world.captions_train), features=str(tiny_world.store), out=str(root / arch),
        model=f"{arch}-tiny", vocab_size=200, steps=2, batch_size=8, ckpt_every=100, max_regions=MAX_REGIONS,
    )) for arch in ARCHS}


def short_cfg(world, init: Path, out: Path) -> FinetuneVQAConfig:
    """test_finetune_vqa's settings, shortened to a few updates on fewer regions."""
    return vqa_cfg(world, init, out, epochs=0.3, ckpt_every=100, max_regions=MAX_REGIONS, device="cpu")


def eval_batch(world, model, tok, vocab, n: int = 6):
    eq, ea = world.vqa("test")
    data = vqa_data(model, read_vqa(eq, ea)[:n], RegionStore(world.store), tok, vocab, max_text_len=32,
                    max_regions=MAX_REGIONS)
    return collate_vqa([data[i] for i in range(len(data))], len(vocab), tok.pad_id)


@pytest.mark.parametrize("arch", ARCHS)
def test_finetune_evaluate_and_reload(tiny_world, pretrained, tmp_path, arch):
    out = tmp_path / "vqa"
    final = finetune_vqa(short_cfg(tiny_world, pretrained[arch], out))
    metrics = json.loads((out / "metrics.json").read_text())
    eq, ea = tiny_world.vqa("test")
    n_test = len(json.loads(eq.read_text())["questions"])
    assert metrics["num_questions"] == n_test and 0 <= metrics["accuracy"] <= 100
    assert 0 < metrics["majority_baseline"] <= 100 and metrics["steps"] >= 2
    preds = json.loads((out / "predictions.json").read_text())
    assert len(preds) == n_test and set(preds[0]) == {"question_id", "answer"}
    meta = json.loads((final / "config.json").read_text())
    assert meta["arch"] == arch and meta["task"] == "vqa" and meta["head"] == HEADS[arch]

    # `vlberts evaluate vqa` scores the file as the recipe did.
    with pytest.raises(SystemExit) as exc:
        main(["evaluate", "vqa", "--predictions", str(out / "predictions.json"), "--questions", str(eq),
              "--annotations", str(ea), "--out", str(tmp_path / "eval")])
    assert exc.value.code == 0
    assert json.loads((tmp_path / "eval" / "metrics.json").read_text())["accuracy"] == metrics["accuracy"]

    # The encoder of a freshly built VQA model is the pre-training checkpoint's, tensor for tensor.
    sd = load_file(str(pretrained[arch] / "model.safetensors"))
    model, _ = build_vqa_model(pretrained[arch], AnswerVocab(("a", "b", "c", "d", "e")))
    own = model.state_dict()
    encoder = [k for k in own if k.startswith(model.encoder_name + ".")]
    assert encoder and all(torch.equal(own[k], sd[k]) for k in encoder)
    assert set(own) - set(encoder) == {k for k in own if k.startswith("classifier.")}

    # The fine-tuned directory reloads and predicts the same answers.
    model, vocab, tok = load_vqa_model(final)
    again = predict_vqa(model, vocab, tok, read_vqa(eq, ea), RegionStore(tiny_world.store),
                        max_regions=MAX_REGIONS, device="cpu")
    assert again == {p["question_id"]: p["answer"] for p in preds}


def _reloaded(world, pretrained, arch: str):
    """A VQA model built from the pre-trained directory, in eval mode, with its tokenizer and a vocabulary."""
    tq, ta = world.vqa("train")
    vocab = build_answer_vocab(read_vqa(tq, ta), 2)
    model, _ = build_vqa_model(pretrained[arch], vocab)
    return model.eval(), TextTokenizer.load(pretrained[arch]), vocab


@pytest.mark.parametrize("arch", ["visualbert", "vlbert"])
def test_slot_models_read_the_mask_slot(tiny_world, pretrained, arch):
    model, tok, vocab = _reloaded(tiny_world, pretrained, arch)
    batch = eval_batch(tiny_world, model, tok, vocab)
    rows = torch.arange(len(batch.answer_pos))
    ids, seg = batch.inputs.input_ids, batch.inputs.token_type_ids
    assert (ids[rows, batch.answer_pos] == tok.mask_id).all()
    if arch == "vlbert":  # [CLS] q [SEP] [MASK] [SEP]: the answer section is segment B
        assert (ids[rows, batch.answer_pos - 1] == tok.sep_id).all() and (seg[rows, batch.answer_pos] == 1).all()
    else:  # [CLS] q [MASK] [SEP], one segment
        assert (ids[rows, batch.answer_pos + 1] == tok.sep_id).all() and (seg == 0).all()
    with torch.no_grad():
        logits = model.answer_logits(batch)
        text = model.bert(batch.inputs).text
        assert torch.allclose(logits, model.classifier(text[rows, batch.answer_pos]), atol=1e-6)
        assert not torch.allclose(logits, model(batch.inputs, batch.answer_pos - 1), atol=1e-4)


def test_vlbert_answer_classifiers_of_the_release(tiny_world, pretrained, tmp_path):
    """VL-BERT's three released answer classifiers (`CLASSIFIER_TYPE`): "mlm", the base VQA config's, starts
    its transform from the pre-trained MLM head and its linear layer Xavier-uniform with a zero bias; the
    fine-tuned directory records the type and reloads with it, predicting as the run did; --answer_classifier
    is VL-BERT's only, checked before any data is read."""
    from safetensors.torch import load_file as read

    from vlberts.models.blocks import PredictionHeadTransform
    from vlberts.recipes.finetune_qa import build_qa_model
    from vlberts.errors import VlbertsError

    tq, ta = tiny_world.vqa("train")
    vocab = build_answer_vocab(read_vqa(tq, ta), 2)
    sd = read(str(pretrained["vlbert"] / "model.safetensors"))
    model, cfg, _ = build_qa_model(pretrained["vlbert"], vocab, answer_classifier="mlm")
    transform, _, linear = model.classifier
    assert isinstance(transform, PredictionHeadTransform) and cfg.answer_classifier == "mlm"
    for name, value in transform.state_dict().items():
        assert torch.equal(value, sd[f"cls.predictions.transform.{name}"]), name
    assert linear.weight.shape == (len(vocab), cfg.hidden_size) and not linear.bias.any()
    bound = (6 / sum(linear.weight.shape)) ** 0.5  # Xavier-uniform's
    assert linear.weight.abs().max() <= bound and linear.weight.abs().max() > 0.5 * bound
    assert len(build_qa_model(pretrained["vlbert"], vocab, answer_classifier="1fc")[0].classifier) == 2
    assert len(build_qa_model(pretrained["vlbert"], vocab)[0].classifier) == 5  # 2fc, the default

    out = tmp_path / "mlm"
    finetune_vqa(FinetuneVQAConfig(**{**vars(short_cfg(tiny_world, pretrained["vlbert"], out)), "answer_classifier": "mlm"}))
    assert json.loads((out / "model" / "config.json").read_text())["config"]["answer_classifier"] == "mlm"
    model, vocab, tok = load_vqa_model(out / "model")
    assert isinstance(model.classifier[0], PredictionHeadTransform)
    eq, ea = tiny_world.vqa("test")
    preds = json.loads((out / "predictions.json").read_text())
    again = predict_vqa(model, vocab, tok, read_vqa(eq, ea), RegionStore(tiny_world.store), max_regions=MAX_REGIONS,
                        device="cpu")
    assert again == {p["question_id"]: p["answer"] for p in preds}
    for arch, value, message in (("visualbert", "mlm", "picks VL-BERT's answer classifier; --init holds a visualbert"),
                                 ("vlbert", "3fc", "must be one of 2fc, 1fc, mlm, got '3fc'")):
        cfg = {**vars(short_cfg(tiny_world, pretrained[arch], tmp_path / "bad")), "answer_classifier": value,
               "train_questions": str(tmp_path / "missing.json")}  # never read: the check comes first
        with pytest.raises(VlbertsError, match=message):
            finetune_vqa(FinetuneVQAConfig(**cfg))


def test_vilbert_head_reads_the_product_of_h_img_and_h_cls(tiny_world, pretrained):
    model, tok, vocab = _reloaded(tiny_world, pretrained, "vilbert")
    batch = eval_batch(tiny_world, model, tok, vocab)
    assert (batch.inputs.input_ids[:, 0] == tok.cls_id).all()
    with torch.no_grad():
        logits = model.answer_logits(batch)
        out = model.bert(batch.inputs)
        product = model.bert.t_pooler(out.text[:, 0]) * model.bert.v_pooler(out.image)  # (B, Db)
        assert torch.allclose(logits, model.classifier(product), atol=1e-6)
        # Changing h_IMG alone (through a hook on the [IMG]-reading pooler) changes the answers' logits.
        noise = torch.randn(out.image.shape[0], model.cfg.bi_hidden_size, generator=torch.Generator().manual_seed(0))
        hook = model.bert.v_pooler.register_forward_hook(lambda m, i, o: o + noise)
        try:
            assert not torch.allclose(model.answer_logits(batch), logits, atol=1e-4)
        finally:
            hook.remove()


@pytest.mark.parametrize("arch", ["lxmert", "wvisualbert"])
def test_pooled_heads(tiny_world, pretrained, arch):
    model, tok, vocab = _reloaded(tiny_world, pretrained, arch)
    batch = eval_batch(tiny_world, model, tok, vocab)
    rows = torch.arange(len(batch.answer_pos))
    assert (batch.answer_pos == 0).all() and (batch.inputs.input_ids[rows, batch.inputs.attention_mask.sum(1) - 1]
                                             == tok.sep_id).all()
    assert not (batch.inputs.input_ids == tok.mask_id).any()  # no answer slot in the question layout
    encoder = getattr(model, model.encoder_name)
    with torch.no_grad():
        logits = model.answer_logits(batch)
        args = (batch.inputs, batch.tags) if arch == "wvisualbert" else (batch.inputs,)
        assert torch.allclose(logits, model.classifier(encoder(*args).pooled), atol=1e-6)
    if arch == "wvisualbert":
        # The tags are the detected objects' class names, one per region, and the model reads them.
        classes = RegionStore(tiny_world.store).metadata.classes
        assert batch.tags is not None and batch.tags.tag_mask.any()
        first = batch.tags.tag_ids[0][batch.tags.tag_mask[0]].tolist()
        rec = RegionStore(tiny_world.store).get(str(read_vqa(*tiny_world.vqa("test"))[0].image_id))
        n = int(batch.inputs.region_mask[0].sum())
        assert first == [w for c in rec.obj_id[:n] for w in tok.encode(classes[c].split(",")[0])]
        with torch.no_grad():
            assert not torch.allclose(model(batch.inputs, _drop_tags(batch.tags)), logits, atol=1e-4)
        with pytest.raises(ValueError, match="reads detector tags"):
            model(batch.inputs, None)


def _drop_tags(tags):
    """The same tags with every subword masked out (the model then sees regions only)."""
    return TagInputs(tags.tag_ids, tags.tag_region, torch.zeros_like(tags.tag_mask))


def test_wvisualbert_nt_reads_no_tags():
    cfg = wvisualbert_tiny(use_tags=False)
    model = WVisualBertForVQA(cfg, 4)
    assert not model.reads_tags and model.text_format == "question"


def test_cli_finetune_vqa_lxmert(tiny_world, pretrained, tmp_path):
    tq, ta = tiny_world.vqa("train")
    eq, ea = tiny_world.vqa("test")
    out = tmp_path / "cli"
    proc = subprocess.run(
        [str(VLBERTS), "finetune", "vqa", f"--init={pretrained['lxmert']}", f"--features={tiny_world.store}",
         f"--train_questions={tq}", f"--train_annotations={ta}", f"--eval_questions={eq}",
         f"--eval_annotations={ea}", f"--out={out}", "--min_answer_count=2", "--epochs=0.2", "--batch_size=16",
         f"--max_regions={MAX_REGIONS}", "--device=cpu"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "VQA accuracy" in proc.stdout and (out / "predictions.json").is_file()
    assert json.loads((out / "model" / "config.json").read_text())["head"] == "pooled"
