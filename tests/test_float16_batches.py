"""`--float16_batches` in fine-tuning: a float16 store's features stay float16 from the store through each task's
training dataset and collation, and `Batch.to` widens them where the step runs. Every task then trains exactly
as with float32 batches (the same losses and weights, bit for bit, and the same metrics), while the batches the
loader hands the loop are float16 (half the bytes a loader moves and copies to a GPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_finetune_vqa import vqa_cfg
from test_flickr_entities_task import fe_cfg
from test_nlvr2_task import nlvr2_cfg
from test_refcoco_task import ref_cfg
from test_retrieval_task import ret_cfg
from test_vcr_task import vcr_cfg

import vlberts.recipes.finetune_loop as loop_module
from vlberts.errors import VlbertsError
from vlberts.recipes.finetune_flickr_entities import finetune_flickr_entities
from vlberts.recipes.finetune_nlvr2 import finetune_nlvr2
from vlberts.recipes.finetune_refcoco import finetune_refcoco
from vlberts.recipes.finetune_retrieval import finetune_retrieval
from vlberts.recipes.finetune_vcr import finetune_vcr
from vlberts.recipes.finetune_vqa import finetune_vqa
from vlberts.training.metrics import MetricsLog

# task -> (recipe, its tests' config builder, settings that keep the run to a handful of updates)
TASKS = {
    "vqa": (finetune_vqa, vqa_cfg, dict(epochs=0.5)),
    "nlvr2": (finetune_nlvr2, nlvr2_cfg, dict(epochs=0.1)),
    "refcoco": (finetune_refcoco, ref_cfg, dict(epochs=0.2, eval_splits="val")),
    "retrieval": (finetune_retrieval, ret_cfg, dict(epochs=0.3)),
    "vcr": (finetune_vcr, vcr_cfg, dict(epochs=0.3)),
    "flickr_entities": (finetune_flickr_entities, fe_cfg, dict(epochs=0.3, eval_splits="val")),
}


def _losses(path) -> list[dict]:
    """Each metrics record without its clock readings."""
    return [{k: v for k, v in r.items() if k not in ("seconds", "time")} for r in MetricsLog.read(path)]


@pytest.mark.parametrize("task", list(TASKS))
def test_float16_batches_fine_tune_exactly_as_float32_ones(task, tiny_world, tiny_pretrained, float16_store, tmp_path,
                                                           monkeypatch):
    recipe, cfg_of, short = TASKS[task]
    moved = []  # per batch the loop moves to its device: the dtypes of its floating-point tensors
    to_device = loop_module.to_device

    def spy(batch, device):
        moved.append({t.dtype for t in batch.tensors() if t.is_floating_point()})
        return to_device(batch, device)

    monkeypatch.setattr(loop_module, "to_device", spy)
    runs = {}
    for flag in ("false", "true"):
        moved.clear()
        out = tmp_path / flag
        recipe(cfg_of(tiny_world, tiny_pretrained, out, features=str(float16_store), float16_batches=flag,
                      ckpt_every=1000, **short))
        runs[flag] = (_losses(out / "metrics.jsonl"), load_file(out / "model" / "model.safetensors"),
                      json.loads((out / "metrics.json").read_text()), [set(d) for d in moved])
    (log32, w32, m32, dt32), (log16, w16, m16, dt16) = runs["false"], runs["true"]
    assert len(log32) >= 2 and log16 == log32
    assert w16.keys() == w32.keys() and all(torch.equal(w16[k], w32[k]) for k in w32)
    assert {k: v for k, v in m16.items() if not k.endswith("seconds")} == {k: v for k, v in m32.items()
                                                                           if not k.endswith("seconds")}
    assert dt32 and all(torch.float16 not in d for d in dt32)
    assert dt16 and all(torch.float16 in d for d in dt16)  # the region features, as the store holds them


def test_a_bad_float16_batches_setting_stops_fine_tuning_before_any_data(tiny_world, tiny_pretrained, tmp_path):
    with pytest.raises(VlbertsError, match="--float16_batches must be auto, true or false, got 'half'"):
        finetune_vqa(vqa_cfg(tiny_world, tiny_pretrained, tmp_path / "bad", float16_batches="half"))
    assert not (tmp_path / "bad").exists()
