"""Hugging Face's fine-tuned VisualBERT classes (`VisualBertForQuestionAnswering`, `...ForVisualReasoning`,
`...ForMultipleChoice`, `...ForRegionToPhraseAlignment`) through our converter: the encoder loads and matches
HF's `visual_bert` to 1e-5, the task head is left out and named (in Python, in `models import`'s config.json
and output), the VQA head loads into `VisualBertForVQA` with HF's logits, and keys that are no head's stay
errors naming them."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from test_hf_parity import TOL, _hf_config, _hf_forward, _inputs

from vlberts.data.batch import VLInputs
from vlberts.errors import VlbertsError
from vlberts.models.convert_hf import load_hf_visualbert, load_hf_visualbert_vqa

transformers = pytest.importorskip("transformers")

TASKS = {  # class -> (num_labels, the head's keys as the report names them)
    "VisualBertForQuestionAnswering": (7, "cls.weight, cls.bias: 7 outputs"),
    "VisualBertForVisualReasoning": (2, "cls.weight, cls.bias: 2 outputs"),
    "VisualBertForMultipleChoice": (2, "cls.weight, cls.bias: 1 output)"),  # its head scores one choice
    "VisualBertForRegionToPhraseAlignment": (2, "attention.query.weight, attention.query.bias, attention.key.weight"),
}


def _saved(cls_name: str, path, seed: int = 0):
    """A tiny random HF `cls_name` written by save_pretrained to `path`; every parameter is random (HF starts
    biases at 0 and LayerNorms at 1, which would hide a misplaced one)."""
    torch.manual_seed(seed)
    hf = getattr(transformers, cls_name)(_hf_config(num_labels=TASKS[cls_name][0]))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    hf.eval().save_pretrained(path)
    return hf


def _edit(path, *, drop=(), add=None, config=None):
    """Change a saved checkpoint: drop / add weights, change config.json (a value None removes the key)."""
    weights = path / "model.safetensors"
    sd = {k: v for k, v in load_file(str(weights)).items() if k not in drop}
    save_file({**sd, **(add or {})}, str(weights), metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    for k, v in (config or {}).items():
        if v is None:
            del cfg[k]
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("cls_name", list(TASKS))
def test_a_task_checkpoints_encoder_matches_hugging_face_and_its_head_is_named(tmp_path, cls_name):
    hf = _saved(cls_name, tmp_path / "task")
    ours = load_hf_visualbert(tmp_path / "task").eval()
    x = _inputs()
    with torch.no_grad():
        ref = _hf_forward(hf.visual_bert, x)
        out = ours.encode(x)
    real = torch.cat([x.attention_mask, x.region_mask], dim=1)
    hidden = torch.cat([out.text, out.vision], dim=1)
    torch.testing.assert_close(hidden[real], ref.last_hidden_state[real], atol=TOL, rtol=0)
    torch.testing.assert_close(out.pooled, ref.pooler_output, atol=TOL, rtol=0)
    # the head left out is named, with the class config.json lists
    assert ours.left_out_head.startswith(f"{cls_name}'s ") and TASKS[cls_name][1] in ours.left_out_head
    if cls_name == "VisualBertForRegionToPhraseAlignment":
        # HF keeps VisualBertForPreTraining's heads in this class: they load, with HF's logits
        with torch.no_grad():
            mlm, match = hf.cls(ref.last_hidden_state, ref.pooler_output)
            full = ours(x)
        torch.testing.assert_close(full.mlm_logits, mlm[:, : x.input_ids.shape[1]], atol=TOL, rtol=0)
        torch.testing.assert_close(full.match_logits, match, atol=TOL, rtol=0)
    else:
        # the pre-training heads, which the file does not hold, are initialised as for a bare VisualBertModel
        hf.visual_bert.save_pretrained(tmp_path / "bare")
        torch.manual_seed(1)
        a = load_hf_visualbert(tmp_path / "task").state_dict()
        torch.manual_seed(1)
        b = load_hf_visualbert(tmp_path / "bare").state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert load_hf_visualbert(tmp_path / "bare").left_out_head is None


def test_without_architectures_a_classifier_is_recognised_by_its_keys(tmp_path):
    _saved("VisualBertForVisualReasoning", tmp_path)
    _edit(tmp_path, config={"architectures": None})
    head = load_hf_visualbert(tmp_path).left_out_head
    assert head.startswith("a task classifier (cls.weight, cls.bias: 2 outputs) of VisualBertForQuestionAnswering, "
                           "VisualBertForVisualReasoning or VisualBertForMultipleChoice")


def test_question_answering_loads_as_our_vqa_model_with_hugging_faces_logits(tmp_path):
    hf = _saved("VisualBertForQuestionAnswering", tmp_path)
    ours = load_hf_visualbert_vqa(tmp_path).eval()
    assert ours.classifier.out_features == 7
    # [CLS] question [MASK] [SEP] [PAD]...: HF reads attention_mask.sum(1) - 2, the [MASK] before [SEP]
    g = torch.Generator().manual_seed(3)
    B, T, R, CLS, SEP, MASK = 3, 9, 5, 2, 3, 4
    lengths = torch.tensor([9, 5, 7])
    ids = torch.randint(5, 99, (B, T), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    ids[:, 0] = CLS
    ids[torch.arange(B), lengths - 2] = MASK
    ids[torch.arange(B), lengths - 1] = SEP
    ids[~mask] = 0
    rmask = torch.ones(B, R, dtype=torch.bool)
    rmask[1, 3:] = False
    x = VLInputs(ids, torch.zeros(B, T, dtype=torch.long), mask, torch.randn(B, R, 20, generator=g),
                 torch.rand(B, R, 4, generator=g), rmask)
    answer_pos = (ids == MASK).nonzero()[:, 1]  # found by the token, not by HF's formula
    assert answer_pos.tolist() == [7, 3, 5]
    with torch.no_grad():
        ref = hf(input_ids=ids, token_type_ids=x.token_type_ids, attention_mask=mask.long(),
                 visual_embeds=x.region_feats, visual_attention_mask=rmask.long()).logits
        logits = ours(x, answer_pos)
    assert logits.shape == (B, 7)
    torch.testing.assert_close(logits, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("cls_name, edit, loader, message", [
    # a key that is no head's, beside a task head, is an error naming it as the file has it
    ("VisualBertForQuestionAnswering", dict(add={"visual_bert.adapter.weight": torch.zeros(3)}), load_hf_visualbert,
     "unexpected keys: bert.adapter.weight (file key visual_bert.adapter.weight)"),
    ("VisualBertForMultipleChoice", dict(add={"answer_head.weight": torch.zeros(3)}), load_hf_visualbert,
     "unexpected keys: answer_head.weight"),
    ("VisualBertForQuestionAnswering", dict(add={"cls.extra.weight": torch.zeros(3)}), load_hf_visualbert_vqa,
     "unexpected keys: cls.extra.weight"),
    # a head that is not the class's config.json lists
    ("VisualBertForQuestionAnswering", dict(config={"architectures": ["VisualBertForPreTraining"]}),
     load_hf_visualbert, "architectures ['VisualBertForPreTraining']; unexpected keys: cls.bias, cls.weight"),
    ("VisualBertForRegionToPhraseAlignment", dict(drop=("attention.value.weight", "attention.value.bias")),
     load_hf_visualbert, "missing keys: attention.value.bias, attention.value.weight"),
    # without architectures, half a head is no head
    ("VisualBertForRegionToPhraseAlignment",
     dict(drop=("attention.value.weight", "attention.value.bias"), config={"architectures": None}),
     load_hf_visualbert, "unexpected keys: attention.key.bias, attention.key.weight, attention.query.bias"),
    # a head of another width, and the pre-training heads half there
    ("VisualBertForVisualReasoning", dict(add={"cls.weight": torch.zeros(2, 31)}), load_hf_visualbert,
     "shape mismatch: cls.weight (2, 31)"),
    ("VisualBertForRegionToPhraseAlignment", dict(drop=("cls.seq_relationship.weight",)), load_hf_visualbert,
     "missing keys: cls.seq_relationship.weight"),
    # our VQA model reads only a question-answering head
    ("VisualBertForVisualReasoning", {}, load_hf_visualbert_vqa,
     "architectures ['VisualBertForVisualReasoning']: not a VisualBertForQuestionAnswering checkpoint"),
])  # fmt: skip
def test_keys_that_are_no_known_head_stay_errors_naming_them(tmp_path, cls_name, edit, loader, message):
    _saved(cls_name, tmp_path)
    _edit(tmp_path, **edit)
    with pytest.raises(VlbertsError) as err:
        loader(tmp_path)
    assert str(err.value).startswith(str(tmp_path)) and message in str(err.value)


def test_models_import_writes_a_task_checkpoints_encoder_and_names_the_head(tmp_path, capsys):
    from test_bad_settings import run_cli
    from test_import_model import _vocab

    from vlberts.training.checkpoint import load_pretraining_model

    _saved("VisualBertForQuestionAnswering", tmp_path / "hf")
    vocab = _vocab(tmp_path / "vocab.txt", 99)
    capsys.readouterr()
    code, out, err = run_cli(["models", "import", str(tmp_path / "hf"), "--format=hf-visualbert", f"--vocab={vocab}",
                              f"--out={tmp_path / 'm'}"], capsys)
    assert code == 0, err
    head = "VisualBertForQuestionAnswering's answer classifier on the [MASK] before [SEP] (cls.weight, cls.bias: 7 outputs"
    assert f"left out: {head}" in out and out.strip().endswith(f"wrote {tmp_path / 'm'}")
    meta = json.loads((tmp_path / "m" / "config.json").read_text())
    assert meta["left_out"].startswith(head) and meta["import_format"] == "hf-visualbert"
    ours, _, _ = load_pretraining_model(tmp_path / "m")
    ref = load_hf_visualbert(tmp_path / "hf")
    mine, theirs = ours.bert.state_dict(), ref.bert.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
