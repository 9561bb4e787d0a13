"""VisualBERT's Flickr30K box geometry (models/spatial.py, `VisualBertConfig.visual_spatial="6d"`): the 6-d
vector of a box (x1, y1, x2, y2) in a W x H image is (x1/W, y1/H, x2/W, y2/H, w/W, h/H), w = x2 - x1,
h = y2 - y1 (reference §1, BAN's `spatial_features`), concatenated to the region feature before VisualBERT's
visual projection. Values computed by hand for three boxes of a 640 x 480 image, checked from the stored
pixel boxes through `load_regions` and the batch to the model's visual embedding."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlberts.data.batch import VLInputs
from vlberts.data.regions import load_regions, pad_regions
from vlberts.features.record import RegionRecord
from vlberts.models.spatial import SPATIAL_DIMS, spatial_encoding
from vlberts.models.visualbert import VisualBertConfig, VisualBertEmbeddings

W, H = 640, 480
# Pixel boxes (x1, y1, x2, y2), chosen so that no two of the six values coincide by accident in a way a
# swap (x <-> y, w <-> h, w * h for w) would go unnoticed.
PIXEL_BOXES = [
    (32.0, 96.0, 352.0, 192.0),
    (160.0, 0.0, 640.0, 432.0),
    (0.0, 240.0, 64.0, 480.0),
]
# By hand: x1/640, y1/480, x2/640, y2/480, (x2 - x1)/640, (y2 - y1)/480.
SIX_D = [
    (0.05, 0.2, 0.55, 0.4, 0.5, 0.2),
    (0.25, 0.0, 1.0, 0.9, 0.75, 0.9),
    (0.0, 0.5, 0.1, 1.0, 0.1, 0.5),
]
FEAT = 8


def _record() -> RegionRecord:
    feats = np.arange(len(PIXEL_BOXES) * FEAT, dtype=np.float32).reshape(len(PIXEL_BOXES), FEAT) / 10
    return RegionRecord("7", W, H, np.array(PIXEL_BOXES, dtype=np.float32), feats)


class _One:
    def get(self, image_id):
        return _record()


def test_six_d_values_by_hand_from_the_stored_pixel_boxes():
    assert SPATIAL_DIMS["6d"] == 6
    regions = load_regions(_One(), "7", max_regions=36)
    got = spatial_encoding(torch.from_numpy(regions.boxes), "6d")  # (3, 6)
    assert got.shape == (3, 6)
    torch.testing.assert_close(got, torch.tensor(SIX_D), atol=1e-6, rtol=0)
    # As a batch holds them (B, R, 4) -> (B, R, 6), padding included.
    _, boxes, _ = pad_regions([regions, load_regions(_One(), "7", max_regions=1)])
    torch.testing.assert_close(spatial_encoding(boxes, "6d")[0], torch.tensor(SIX_D), atol=1e-6, rtol=0)
    torch.testing.assert_close(spatial_encoding(boxes, "6d")[1, 0], torch.tensor(SIX_D[0]), atol=1e-6, rtol=0)


def _embeddings(spatial: str = "6d") -> VisualBertEmbeddings:
    torch.manual_seed(0)
    cfg = VisualBertConfig(vocab_size=30, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32,
                           max_position_embeddings=16, visual_dim=FEAT, visual_spatial=spatial, hidden_dropout=0.0)
    assert cfg.projection_in == FEAT + (6 if spatial == "6d" else 0)
    return VisualBertEmbeddings(cfg).eval()


def _inputs(boxes: torch.Tensor) -> VLInputs:
    regions = load_regions(_One(), "7", max_regions=36)
    T, R = 4, len(regions.feats)
    return VLInputs(torch.tensor([[2, 5, 6, 3]]), torch.zeros(1, T, dtype=torch.long), torch.ones(1, T, dtype=torch.bool),
                    torch.from_numpy(regions.feats)[None], boxes, torch.ones(1, R, dtype=torch.bool))


def test_visual_embedding_reads_the_six_values_concatenated_to_the_feature():
    emb = _embeddings()
    regions = load_regions(_One(), "7", max_regions=36)
    x = _inputs(torch.from_numpy(regions.boxes)[None])
    T = x.input_ids.shape[1]
    with torch.no_grad():
        out = emb(x)[0, T:]  # (R, D)
        # VisualBERT: LN(Linear([feature ; 6-d]) + visual segment 1 + visual position 0), per region.
        projected = emb.visual_projection(torch.cat([x.region_feats[0], torch.tensor(SIX_D)], dim=-1))
        want = emb.LayerNorm(projected + emb.visual_token_type_embeddings.weight[1]
                             + emb.visual_position_embeddings.weight[0])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_changing_one_box_changes_only_that_regions_embedding():
    emb = _embeddings()
    regions = load_regions(_One(), "7", max_regions=36)
    boxes = torch.from_numpy(regions.boxes)[None]  # (1, 3, 4)
    moved = boxes.clone()
    moved[0, 1] = torch.tensor([0.3, 0.1, 0.6, 0.7])
    with torch.no_grad():
        a, b = emb(_inputs(boxes))[0], emb(_inputs(moved))[0]  # (T + R, D)
    T = 4
    changed = (a - b).abs().amax(-1) > 1e-6  # (T + R,)
    assert changed.tolist() == [False] * T + [False, True, False]
    # Moving one corner of another region (its x2 and so its width, or its y2 and so its height) likewise
    # changes that region's embedding alone.
    for k, delta in ((2, -0.2), (3, -0.3)):
        nudged = boxes.clone()
        nudged[0, 2, k] += delta
        with torch.no_grad():
            c = emb(_inputs(nudged))[0]
        assert ((a - c).abs().amax(-1) > 1e-6).tolist() == [False] * T + [False, False, True]
    # Without the 6-d setting VisualBERT has no box geometry: the same move changes nothing.
    plain = _embeddings("none")
    with torch.no_grad():
        assert torch.equal(plain(_inputs(boxes)), plain(_inputs(moved)))


def test_the_other_encodings_share_the_corners():
    # 4-d is the corners (LXMERT, W-VisualBERT); 5-d adds the area fraction w * h (ViLBERT, reference §1).
    boxes = torch.tensor(PIXEL_BOXES) / torch.tensor([W, H, W, H])
    six = torch.tensor(SIX_D)
    torch.testing.assert_close(spatial_encoding(boxes, "4d"), six[:, :4], atol=1e-6, rtol=0)
    five = torch.cat([six[:, :4], (six[:, 4] * six[:, 5])[:, None]], dim=1)
    torch.testing.assert_close(spatial_encoding(boxes, "5d"), five, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="unknown spatial encoding"):
        spatial_encoding(boxes, "7d")
