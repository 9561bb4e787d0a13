"""The visual-word probe behind the demo's first check (`analysis.visual_words`): which words it masks, that
a word counts only when every subword comes back, and that "regions zeroed" hands the model zero features
(boxes kept). A stand-in model reads the inputs it is given, so the expected accuracies are known by hand."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from test_grounding_driver import FakeStore, tokenizer

from vlberts.analysis.visual_words import probe_items, visual_word_accuracy
from vlberts.data.coco import CaptionRef
from vlberts.features.store import RegionRecord


class Oracle(torch.nn.Module):
    """An MLM head that answers the masked positions from a table: `answers[k]` is the id it predicts at the
    k-th masked position of a row, but only when the regions carry signal (any non-zero feature); without
    it, it predicts [UNK] everywhere. Like the pre-training models, given `mlm_positions` it answers at
    those tokens only. It records the region features of every call."""

    def __init__(self, vocab_size: int, answers: list[int], visual_dim: int = 16):
        super().__init__()
        self.cfg = SimpleNamespace(visual_dim=visual_dim)
        self.vocab_size, self.answers, self.seen = vocab_size, answers, []

    def forward(self, x, mlm_positions=None):
        self.seen.append(x.region_feats.clone())
        B, T = x.input_ids.shape
        pred = torch.full((B, T), 1)  # [UNK]
        for b in range(B):
            if x.region_feats[b].abs().sum() > 0:
                for k, p in enumerate((x.input_ids[b] == 4).nonzero().flatten().tolist()):  # [MASK] is id 4
                    pred[b, p] = self.answers[k]
        if mlm_positions is not None:  # as the models do: the head at those tokens only, (N,) row-major
            pred = pred[mlm_positions]
        return SimpleNamespace(mlm_logits=torch.nn.functional.one_hot(pred, self.vocab_size).float())


def _record() -> RegionRecord:
    boxes = np.array([[10, 10, 40, 40], [50, 20, 90, 70]], np.float32)
    return RegionRecord("7", 100, 80, boxes, np.random.default_rng(0).random((2, 16), dtype=np.float32) + 0.1)


def test_probe_items_mask_every_subword_of_each_probe_word(tmp_path):
    tok = tokenizer(tmp_path)  # "skateboard" is skate ##board
    caps = [CaptionRef(image_id="7", text="a red skateboard near the red dog ."),
            CaptionRef(image_id="7", text="a man on " + "a " * 60 + "red dog .")]  # too long: no item
    items = probe_items(caps, tok, {"red", "skateboard"})
    assert [(it.word, len(it.positions)) for it in items] == [("red", 1), ("skateboard", 2), ("red", 1)]
    skate = items[1]
    assert [skate.ids[p] for p in skate.positions] == [tok.mask_id, tok.mask_id]
    assert skate.targets == [tok.token_to_id("skate"), tok.token_to_id("##board")]
    assert skate.ids[0] == tok.cls_id and skate.ids[-1] == tok.sep_id
    assert sum(i == tok.mask_id for i in skate.ids) == 2  # nothing else masked


def test_a_word_counts_only_whole_and_zeroed_regions_reach_the_model_as_zeros(tmp_path):
    tok = tokenizer(tmp_path)
    assert tok.mask_id == 4  # the Oracle's [MASK]
    caps = [CaptionRef(image_id="7", text="a red skateboard .")]
    red, skate = probe_items(caps, tok, {"red", "skateboard"})
    store = FakeStore([_record()])
    right = [tok.token_to_id("red")]
    half = [tok.token_to_id("skate"), tok.token_to_id("dog")]  # first subword right, second wrong

    model = Oracle(tok.vocab_size, right)
    assert visual_word_accuracy(model, [red], store, device="cpu")["accuracy"] == 100.0
    zeroed = visual_word_accuracy(model, [red], store, device="cpu", zero_regions=True)
    assert zeroed["accuracy"] == 0.0
    feats = model.seen[-1]
    assert feats.shape[1] == 2 and torch.count_nonzero(feats) == 0  # both regions there, every feature zero
    assert torch.count_nonzero(model.seen[0]) > 0  # and the first call saw the image

    half_model = Oracle(tok.vocab_size, half)
    res = visual_word_accuracy(half_model, [skate], store, device="cpu")
    assert res["accuracy"] == 0.0 and res["per_word"] == {"skateboard": 0.0}
    whole = Oracle(tok.vocab_size, skate.targets)
    assert visual_word_accuracy(whole, [skate, red], store, device="cpu")["per_word"] == {"red": 0.0, "skateboard": 100.0}
