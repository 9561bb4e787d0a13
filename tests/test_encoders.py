"""`VLEncoder`: every architecture's encoder behind one call, loaded from a pre-training checkpoint."""

import pytest
import torch

from vlberts.data.batch import VLInputs
from vlberts.errors import VlbertsError
from vlberts.models.builders import build_pretraining_model, model_config
from vlberts.models.encoders import ENCODER_PREFIX, VLEncoder, load_encoder_weights
from vlberts.training.checkpoint import save_model_dir

ARCH_MODELS = ["visualbert-tiny", "lxmert-tiny", "vilbert-tiny", "vlbert-tiny", "wvisualbert-tiny"]


def _inputs(dim: int) -> VLInputs:
    g = torch.Generator().manual_seed(0)
    B, T, R = 2, 5, 3
    x1y1 = torch.rand(B, R, 2, generator=g) * 0.5
    return VLInputs(
        input_ids=torch.randint(5, 50, (B, T), generator=g), token_type_ids=torch.zeros(B, T, dtype=torch.long),
        attention_mask=torch.ones(B, T, dtype=torch.bool), region_feats=torch.randn(B, R, dim, generator=g),
        region_boxes=torch.cat([x1y1, x1y1 + 0.4], -1), region_mask=torch.ones(B, R, dtype=torch.bool),
    )


@pytest.mark.parametrize("name", ARCH_MODELS)
def test_encoder_loads_the_pretrained_encoder_and_matches_it(tmp_path, name):
    torch.manual_seed(0)
    cfg = model_config(name, vocab_size=60)
    pre = build_pretraining_model(cfg).eval()
    save_model_dir(tmp_path / "m", pre, cfg)
    enc = VLEncoder(cfg).eval()
    load_encoder_weights(enc, tmp_path / "m")
    x = _inputs(cfg.visual_dim)
    inner = getattr(pre, ENCODER_PREFIX[enc.arch])
    want = inner(x) if enc.arch != "wvisualbert" else inner(x, None)
    got = enc(x)
    assert torch.equal(got.pooled, want.pooled) and torch.equal(got.vision, want.vision)
    assert got.text.shape[-1] == enc.hidden_size and got.vision.shape[-1] == enc.vision_size


def test_encoder_from_a_directory_without_its_weights_is_one_clear_error(tmp_path):
    cfg = model_config("visualbert-tiny", vocab_size=60)
    save_model_dir(tmp_path / "m", build_pretraining_model(model_config("lxmert-tiny", vocab_size=60)),
                   model_config("lxmert-tiny", vocab_size=60))
    with pytest.raises(VlbertsError, match="no visualbert encoder weights"):
        load_encoder_weights(VLEncoder(cfg), tmp_path / "m")


@pytest.mark.parametrize("name", ["visualbert-tiny", "lxmert-tiny", "vilbert-tiny"])
def test_a_loaded_task_model_skips_its_random_initialisation_and_equals_the_saved_one(tmp_path, name):
    """`load_task_weights` builds every task model without drawing the initialisation its weights replace:
    no random number drawn, every tensor the saved one's."""
    from vlberts.models.flickr_entities import FlickrEntitiesModel
    from vlberts.models.nlvr2 import NLVR2Model
    from vlberts.models.refcoco import RefCocoModel
    from vlberts.models.retrieval import RetrievalModel
    from vlberts.models.vcr import VCRModel
    from vlberts.recipes.finetune_loop import load_task_weights
    from vlberts.recipes.finetune_qa import qa_model

    cfg = model_config(name, vocab_size=50, visual_dim=16)
    builds = {"vqa": lambda: qa_model(cfg, 7), "nlvr2": lambda: NLVR2Model(cfg), "vcr": lambda: VCRModel(cfg),
              "refcoco": lambda: RefCocoModel(cfg), "retrieval": lambda: RetrievalModel(cfg),
              "flickr_entities": lambda: FlickrEntitiesModel(cfg)}
    for task, build in builds.items():
        torch.manual_seed(5)
        saved = build()
        save_model_dir(tmp_path / task, saved, cfg, extra={"task": task})
        rng = torch.get_rng_state()
        model = load_task_weights(build, tmp_path / task)
        assert torch.equal(torch.get_rng_state(), rng), task  # nothing drawn
        want = saved.state_dict()
        assert all(torch.equal(t, want[k]) for k, t in model.state_dict().items()), task
        build()
        assert not torch.equal(torch.get_rng_state(), rng), task  # as a build without loading does
