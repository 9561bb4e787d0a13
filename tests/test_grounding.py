"""Entity grounding analysis (paper §3.1, Figure 3) on hand-made attention maps with known answers.

All attention values are multiples of 1/64 so every accuracy and mean mass below is exact in floating
point and compared with ==.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from PIL import Image

from vlberts.analysis.boxes import box_iou, union_box
from vlberts.analysis.figures import ACTIVE_COLOR, BASELINE_COLOR, INACTIVE_COLOR, save_head_accuracy_figure
from vlberts.analysis.grounding import (
    GroundingAccumulator,
    GroundingEntity,
    GroundingInput,
    GroundingOptions,
    GroundingResult,
    ground,
    score_caption,
)
from vlberts.analysis.report import best_heads, best_heads_html, best_heads_markdown, summary_markdown
from vlberts.errors import VlbertsError

BOX0 = [0, 0, 10, 10]
BOX1 = [20, 0, 30, 10]
BOX2 = [0, 20, 10, 30]


def caption_a() -> GroundingInput:
    """2 layers x 2 heads, 3 regions, two entities: "man" (token 1, gold = region 0) and "dog" (token 3,
    gold = region 2). The most confident detection is region 0, so the baseline gets "man" only.

    head   "man" row -> pick        "dog" row -> pick        accuracy  mean region mass
    1-1    [16, 8, 0]  r0 right     [0, 8, 16]  r2 right     1.0       (24+24)/2/64 = .375
    1-2    [4, 8, 0]   r1 wrong     [0, 0, 4]   r2 right     0.5       (12+4)/2/64  = .125
    2-1    [8, 32, 8]  r1 wrong     [8, 16, 8]  r1 wrong     0.0       (48+32)/2/64 = .625
    2-2    [32, 16, 0] r0 right     [16, 0, 8]  r0 wrong     0.5       (48+24)/2/64 = .5625
    """
    attn = np.full((2, 2, 4, 3), 1 / 64)  # (L, H, T, R); tokens 0 and 2 are not entities
    attn[0, 0, 1], attn[0, 0, 3] = [16, 8, 0], [0, 8, 16]
    attn[0, 1, 1], attn[0, 1, 3] = [4, 8, 0], [0, 0, 4]
    attn[1, 0, 1], attn[1, 0, 3] = [8, 32, 8], [8, 16, 8]
    attn[1, 1, 1], attn[1, 1, 3] = [32, 16, 0], [16, 0, 8]
    attn[:, :, [1, 3]] /= 64
    return GroundingInput(
        attn=attn,
        region_boxes=np.array([BOX0, BOX1, BOX2], dtype=np.float64),
        region_conf=np.array([0.9, 0.5, 0.1]),
        entities=[
            GroundingEntity([[1]], np.array([BOX0], dtype=np.float64), "a", "1", "man"),
            GroundingEntity([[3]], np.array([BOX2], dtype=np.float64), "a", "2", "dog"),
        ],
    )


def caption_b() -> GroundingInput:
    """Same model shape, 2 regions. "ball" (token 1) is region 1; "sky" (token 2) matches no region, so
    no head can get it (upper bound 1/2). The baseline (region 1) gets "ball"."""
    attn = np.zeros((2, 2, 3, 2))  # (L, H, T, R)
    attn[0, 0, 1], attn[0, 0, 2] = [0, 32], [16, 0]  # ball right
    attn[0, 1, 1], attn[0, 1, 2] = [8, 0], [4, 0]  # ball wrong
    attn[1, 0, 1], attn[1, 0, 2] = [0, 16], [16, 16]  # ball right; tie on sky goes to region 0
    attn[1, 1, 1], attn[1, 1, 2] = [16, 32], [0, 8]  # ball right
    attn /= 64
    return GroundingInput(
        attn=attn,
        region_boxes=np.array([BOX0, [50, 50, 60, 60]], dtype=np.float64),
        region_conf=np.array([0.2, 0.8]),
        entities=[
            GroundingEntity([[1]], [[50, 50, 60, 60]], "b", "1", "ball"),
            GroundingEntity([[2]], [[100, 100, 110, 110]], "b", "2", "sky"),
        ],
    )


# ---------------------------------------------------------------------------------------- boxes


def test_box_iou_exact_values_and_degenerate_boxes():
    a = np.array([[0, 0, 10, 10], [0, 0, 0, 0]], dtype=np.float64)
    b = np.array([[0, 0, 20, 10], [5, 5, 15, 15], [30, 30, 40, 40]], dtype=np.float64)
    iou = box_iou(a, b)
    assert iou.shape == (2, 3)
    assert iou[0].tolist() == [0.5, 25 / 175, 0.0]
    assert iou[1].tolist() == [0.0, 0.0, 0.0]  # zero-area box: 0, not NaN
    assert box_iou([0, 0, 0, 0], [0, 0, 0, 0]).tolist() == [[0.0]]
    assert union_box([[0, 0, 10, 10], [10, 5, 20, 30]]).tolist() == [0, 0, 20, 30]
    with pytest.raises(ValueError, match="x2 < x1"):
        box_iou([[10, 10, 5, 5]], [[0, 0, 1, 1]])  # (x, y, w, h) passed by mistake


# -------------------------------------------------------------------------- hand-made accuracies


def test_per_head_accuracy_baseline_mass_and_best_heads():
    res = ground([caption_a()])
    assert res.n_entities == 2 and res.n_captions == 1
    assert res.accuracy.tolist() == [[1.0, 0.5], [0.0, 0.5]]
    assert res.mean_region_mass.tolist() == [[0.375, 0.125], [0.625, 0.5625]]
    assert res.active.tolist() == [[True, False], [True, True]]
    assert res.baseline_accuracy == 0.5
    assert res.upper_bound == 1.0
    assert res.best_head.label == "1-1" and res.best_head.accuracy == 1.0
    assert (res.best_head.layer, res.best_head.head) == (0, 0)
    assert res.best_active_head.label == "1-1"
    assert [h.label for h in res.best_per_layer] == ["1-1", "2-2"]
    assert res.best_layer == 0
    assert res.layer_max.tolist() == [1.0, 0.5]
    assert res.layer_mean.tolist() == [0.75, 0.25]


def test_caption_scores_per_entity():
    s = score_caption(caption_a())
    assert s.pred.tolist() == [[[0, 2], [1, 2]], [[1, 1], [0, 0]]]  # (L, H, E)
    assert s.hit.tolist() == [[[True, True], [False, True]], [[False, False], [True, False]]]
    assert s.baseline_pred.tolist() == [0, 0]
    assert s.baseline_hit.tolist() == [True, False]
    assert s.reachable.tolist() == [True, True]


def test_float32_maps_give_the_same_answer():
    a = caption_a()
    a32 = GroundingInput(a.attn.astype(np.float32), a.region_boxes, a.region_conf, a.entities)
    r64, r32 = ground([a]), ground([a32])
    assert r32.accuracy.tolist() == r64.accuracy.tolist()
    assert r32.mean_region_mass.tolist() == r64.mean_region_mass.tolist()


def test_active_flag_at_exactly_twenty_percent():
    # One head per mass pattern; the mass is the mean over entities (0.1 and 0.3 average to 0.2).
    attn = np.zeros((1, 4, 3, 2))  # (L, H, T, R); every head picks region 0 for both entities
    attn[..., 0] = 0.01
    mass = np.array([[[0, 0.2, 0.2], [0, 0.1, 0.3], [0, 0.25, 0.25], [0, 0.125, 0.125]]])  # (L, H, T)
    inp = GroundingInput(
        attn=attn,
        region_mass=mass,
        region_boxes=[BOX0, BOX1],
        region_conf=[1.0, 0.0],
        entities=[GroundingEntity([[1]], [BOX0]), GroundingEntity([[2]], [BOX0])],
    )
    strict = ground([inp])
    assert strict.mean_region_mass.tolist() == [[0.2, 0.2, 0.25, 0.125]]
    assert strict.active.tolist() == [[False, False, True, False]]  # "more than 20%" (§3.1)
    inclusive = ground([inp], GroundingOptions(active_inclusive=True))
    assert inclusive.active.tolist() == [[True, True, True, False]]
    # Accuracy is computed for every head, active or not.
    assert strict.accuracy.tolist() == [[1.0, 1.0, 1.0, 1.0]]
    assert strict.best_active_head.label == "1-3"


def test_token_options_on_multi_subword_phrase():
    # "a ##n skate ##board" at positions 1, 2 | 3, 4 (two words of two subwords); 1 layer, 1 head.
    # Each option reads different rows and so picks a different region; the gold box is region 1.
    rows = {1: [32, 0, 0, 24], 2: [0, 0, 0, 40], 3: [0, 0, 24, 8], 4: [0, 30, 20, 0]}
    attn = np.zeros((1, 1, 6, 4))  # (L, H, T, R)
    for t, row in rows.items():
        attn[0, 0, t] = np.array(row) / 64
    boxes = [BOX0, BOX1, BOX2, [40, 40, 50, 50]]
    ent = GroundingEntity([[1, 2], [3, 4]], [BOX1], "c", "1", "an skateboard")
    inp = GroundingInput(attn, boxes, [0.0, 0.0, 0.0, 1.0], [ent])
    expected = {
        # token: (picked region, accuracy, region mass)
        "first": (0, 0.0, 56 / 64),  # row 1
        "last": (1, 1.0, 50 / 64),  # row 4
        "head_mean": (2, 0.0, 41 / 64),  # rows 3, 4: [0, 30, 44, 8] / 2
        "mean": (3, 0.0, 178 / 256),  # rows 1-4: [32, 30, 44, 72] / 4
    }
    for token, (region, acc, mass) in expected.items():
        opts = GroundingOptions(token=token)
        assert score_caption(inp, opts).pred.tolist() == [[[region]]], token
        res = ground([inp], opts)
        assert res.accuracy.tolist() == [[acc]], token
        assert res.mean_region_mass.tolist() == [[mass]], token
    assert GroundingOptions().token == "last"


def test_any_versus_union_iou_rule_on_two_box_entity():
    # "two dogs": gold boxes side by side, union [0, 0, 20, 10].
    # Region 0 = [0, 0, 9, 10]: IoU 0.9 with the first dog, 0.45 with the union.
    # Region 1 = [1, 0, 19, 10]: IoU 0.47 with each dog, 0.9 with the union.
    attn = np.zeros((1, 2, 2, 2))  # (L, H, T, R)
    attn[0, 0, 1] = [0.5, 0.25]  # head 1-1 picks region 0
    attn[0, 1, 1] = [0.25, 0.5]  # head 1-2 picks region 1
    ent = GroundingEntity([[1]], [[0, 0, 10, 10], [10, 0, 20, 10]], phrase="two dogs")
    inp = GroundingInput(attn, [[0, 0, 9, 10], [1, 0, 19, 10]], [0.0, 1.0], [ent])
    any_ = ground([inp], GroundingOptions(iou_rule="any"))
    union = ground([inp], GroundingOptions(iou_rule="union"))
    assert any_.accuracy.tolist() == [[1.0, 0.0]]
    assert union.accuracy.tolist() == [[0.0, 1.0]]
    assert (any_.baseline_accuracy, union.baseline_accuracy) == (0.0, 1.0)  # baseline = region 1
    assert (any_.upper_bound, union.upper_bound) == (1.0, 1.0)
    # A stricter threshold: nothing reaches 0.95.
    assert ground([inp], GroundingOptions(iou_threshold=0.95)).upper_bound == 0.0


def test_iou_threshold_is_inclusive():
    # Region [0, 0, 10, 10] against gold [0, 0, 20, 10]: IoU exactly 0.5 counts (§3.1 "IoU >= 0.5").
    inp = GroundingInput(np.full((1, 1, 1, 1), 0.5), [BOX0], [1.0], [GroundingEntity([[0]], [[0, 0, 20, 10]])])
    assert ground([inp]).accuracy.tolist() == [[1.0]]
    assert ground([inp], GroundingOptions(iou_threshold=0.51)).accuracy.tolist() == [[0.0]]


def test_upper_bound_counts_entities_with_a_correct_region():
    res = ground([caption_b()])
    assert res.upper_bound == 0.5  # "sky" has no region at IoU >= 0.5
    assert res.baseline_accuracy == 0.5
    assert res.accuracy.tolist() == [[0.5, 0.0], [0.5, 0.5]]


def test_padded_regions_are_never_predicted_nor_counted():
    # Region 2 is padding: it has the most attention, the highest confidence and the gold box.
    attn = np.zeros((1, 1, 2, 3))  # (L, H, T, R)
    attn[0, 0, 1] = [0.125, 0.25, 0.5]
    boxes = [BOX0, BOX1, BOX2]
    ents = [GroundingEntity([[1]], [BOX2]), GroundingEntity([[0]], [BOX1])]
    valid = np.array([True, True, False])
    attn[0, 0, 0] = [0.0, 0.25, 0.5]
    padded = GroundingInput(attn, boxes, [0.5, 0.25, 1.0], ents, region_valid=valid)
    s = score_caption(padded)
    assert s.pred.tolist() == [[[1, 1]]]
    assert s.baseline_pred.tolist() == [0, 0]
    res = ground([padded])
    assert res.accuracy.tolist() == [[0.5]]  # only the second entity (gold = region 1)
    assert res.baseline_accuracy == 0.0
    assert res.upper_bound == 0.5  # the first entity's only match is padding
    # The derived region mass counts valid regions only.
    assert res.mean_region_mass.tolist() == [[(0.375 + 0.25) / 2]]
    # Without the mask the padded region wins everywhere: the mask is what changed the answer.
    unmasked = ground([GroundingInput(attn, boxes, [0.5, 0.25, 1.0], ents)])
    assert (unmasked.accuracy.tolist(), unmasked.baseline_accuracy, unmasked.upper_bound) == ([[0.5]], 0.5, 1.0)


def test_streaming_equals_one_shot_and_merge():
    a, b = caption_a(), caption_b()
    acc = GroundingAccumulator()
    scores = [acc.add(a), acc.add(b)]
    streamed = acc.result()
    # One shot: pool the per-entity outcomes of both captions and average them directly.
    hit = np.concatenate([s.hit for s in scores], axis=-1)  # (L, H, 4)
    mass = np.concatenate([s.mass for s in scores], axis=-1)  # (L, H, 4)
    assert streamed.accuracy.tolist() == hit.mean(-1).tolist() == [[0.75, 0.25], [0.25, 0.5]]
    assert streamed.mean_region_mass.tolist() == mass.mean(-1).tolist() == [[0.375, 0.109375], [0.5, 0.5]]
    assert streamed.active.tolist() == [[True, False], [True, True]]
    assert (streamed.baseline_accuracy, streamed.upper_bound) == (0.5, 0.75)
    assert (streamed.n_entities, streamed.n_captions) == (4, 2)
    # Two shards merged give the same result as one stream.
    left, right = GroundingAccumulator(), GroundingAccumulator()
    left.add(a)
    right.add(b)
    merged = left.merge(right).result()
    assert merged.to_dict() == streamed.to_dict()
    assert GroundingAccumulator().merge(acc).result().to_dict() == streamed.to_dict()


def test_caption_without_entities_adds_nothing_but_is_counted():
    a = caption_a()
    empty = GroundingInput(a.attn, a.region_boxes, a.region_conf, [])
    assert ground([a, empty]).accuracy.tolist() == ground([a]).accuracy.tolist()
    assert ground([a, empty]).n_captions == 2
    with pytest.raises(ValueError, match="no entities"):
        ground([empty])


def test_mismatched_model_shapes_are_rejected():
    acc = GroundingAccumulator()
    acc.add(caption_a())
    one_layer = GroundingInput(np.zeros((1, 2, 4, 3)), [BOX0, BOX1, BOX2], [1, 0, 0], [])
    with pytest.raises(ValueError, match=r"\(L, H\) = \(1, 2\)"):
        acc.add(one_layer)
    with pytest.raises(ValueError, match="different options"):
        acc.merge(GroundingAccumulator(GroundingOptions(token="first")))


def test_input_validation_names_the_problem():
    a = caption_a()
    with pytest.raises(ValueError, match="outside the text axis"):
        GroundingInput(a.attn, a.region_boxes, a.region_conf, [GroundingEntity([[4]], [BOX0])])
    with pytest.raises(ValueError, match="bool array"):
        GroundingInput(a.attn, a.region_boxes, a.region_conf, [], region_valid=np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="no gold box"):
        GroundingEntity([[1]], np.zeros((0, 4)))
    with pytest.raises(ValueError, match="appears twice"):
        GroundingEntity([[1, 2], [2]], [BOX0])
    with pytest.raises(ValueError, match="region_mass must have shape"):
        GroundingInput(a.attn, a.region_boxes, a.region_conf, [], region_mass=np.zeros((2, 2, 3)))
    with pytest.raises(ValueError, match="token must be one of"):
        GroundingOptions(token="middle")
    with pytest.raises(VlbertsError, match="unknown key"):
        GroundingOptions.from_dict({"tokn": "last"})


def test_result_round_trips_through_json():
    res = ground([caption_a(), caption_b()], GroundingOptions(iou_rule="union", active_threshold=0.25))
    d = json.loads(json.dumps(res.to_dict()))
    assert d["best_head"] == {
        "layer": 0, "head": 0, "accuracy": 0.75, "region_mass": 0.375, "active": True, "label": "1-1"
    }
    assert (d["best_layer_index"], d["best_layer_number"]) == (0, 1)
    assert d["options"] == {
        "token": "last", "iou_rule": "union", "iou_threshold": 0.5, "active_threshold": 0.25,
        "active_inclusive": False,
    }
    again = GroundingResult.from_dict(d)
    assert again.to_dict() == res.to_dict()


# ----------------------------------------------------------------------------- presentation


def test_best_heads_markdown_table():
    res = ground([caption_a()])
    assert best_heads_markdown(res, k=3) == (
        "| rank | head | accuracy (%) | attention on regions (%) | active |\n"
        "|---:|:---|---:|---:|:---:|\n"
        "| 1 | 1-1 | 100.00 | 37.50 | yes |\n"
        "| 2 | 1-2 | 50.00 | 12.50 | no |\n"
        "| 3 | 2-2 | 50.00 | 56.25 | yes |\n"
    )
    assert [h.label for h in best_heads(res, k=10, active_only=True)] == ["1-1", "2-2", "2-1"]
    summary = summary_markdown(res, k=2, title="VisualBERT | COCO")
    assert summary.startswith("## VisualBERT \\| COCO\n")
    assert "- baseline (most confident region): 50.00%\n" in summary
    assert "- best head: 1-1 at 100.00% (active)\n" in summary
    assert "| 2 | 2-2 | 50.00 | 25.00 | 2/2 |\n" in summary


def test_best_heads_html_is_escaped():
    html = best_heads_html(ground([caption_a()]), k=1, caption="<script>alert('x')</script> & co")
    assert "<script>" not in html
    assert "<caption>&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt; &amp; co</caption>" in html
    assert '<tr class="active"><td>1</td><td>1-1</td><td>100.00</td><td>37.50</td><td>yes</td></tr>' in html


def _rgb(hex_color: str) -> tuple[int, int, int]:
    return tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5))


def test_figure_is_a_png_of_the_expected_size_with_both_kinds_of_dot(tmp_path):
    res = ground([caption_a(), caption_b()])
    path = save_head_accuracy_figure(res, tmp_path / "fig" / "entity_grounding.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR" and struct.unpack(">II", data[16:24]) == (960, 600)
    assert 10_000 < len(data) < 500_000
    with Image.open(path) as im:
        rgb = np.asarray(im.convert("RGB")).reshape(-1, 3)  # (pixels, 3)
    pixels = set(map(tuple, np.unique(rgb, axis=0).tolist()))
    # Active (dark) and inactive (light) heads and the grey baseline are all drawn.
    for color in (ACTIVE_COLOR, INACTIVE_COLOR, BASELINE_COLOR):
        assert _rgb(color) in pixels, color
    assert not list(tmp_path.joinpath("fig").glob("*.tmp"))  # written atomically


def test_heads_that_see_no_regions_pick_nothing_and_are_inactive():
    # Layer 1 of caption_a with zero attention to every region, as text_to_region() reports the layers
    # before the fusion layer of VisualBERT without early fusion: no pick (-1), no hit, zero mass.
    inp = caption_a()
    attn = inp.attn.copy()
    attn[0] = 0.0
    blind = GroundingInput(attn=attn, region_boxes=inp.region_boxes, region_conf=inp.region_conf, entities=inp.entities)
    scores = score_caption(blind)
    assert (scores.pred[0] == -1).all() and not scores.hit[0].any() and (scores.mass[0] == 0).all()
    assert (scores.pred[1] == score_caption(inp).pred[1]).all()  # the layer that sees regions is unchanged
    res = ground([blind])
    assert res.accuracy[0].tolist() == [0.0, 0.0] and not res.active[0].any()
    assert res.accuracy[1].tolist() == ground([inp]).accuracy[1].tolist()
    assert res.baseline_accuracy == 0.5  # the baseline does not depend on the heads


# ------------------------------------------------------------------------ accuracy by kind of entity


def caption_c() -> GroundingInput:
    """One entity, "kite" (token 1, gold = region 1), that only head 2-2 finds; the baseline (region 0) misses it."""
    attn = np.zeros((2, 2, 2, 2))  # (L, H, T, R)
    attn[0, 0, 1], attn[0, 1, 1], attn[1, 0, 1], attn[1, 1, 1] = [16, 8], [8, 0], [32, 0], [0, 16]
    attn /= 64
    return GroundingInput(attn=attn, region_boxes=np.array([BOX0, BOX1], dtype=np.float64), region_conf=np.array([0.9, 0.1]),
                          entities=[GroundingEntity([[1]], [BOX1], "c", "1", "the red kite", ("other",))])


def test_breakdown_by_type_and_last_word_on_hand_made_maps():
    from dataclasses import replace

    from vlberts.analysis.grounding import BREAKDOWNS, EntityBreakdown
    from vlberts.analysis.report import breakdown_markdown

    a, b, c = caption_a(), caption_b(), caption_c()
    a.entities = [replace(a.entities[0], types=("people",)), replace(a.entities[1], types=("animals",))]
    b.entities = [replace(b.entities[0], types=("animals",)), replace(b.entities[1], types=("scene", "other"))]
    acc = GroundingAccumulator()
    groups = {name: EntityBreakdown(GroundingOptions(), key) for name, key in BREAKDOWNS.items()}
    for inp in (a, b, c):
        scores = acc.add(inp)
        for g in groups.values():
            g.add_caption(inp, scores)
    overall = acc.result()
    # per entity (heads 1-1, 1-2, 2-1, 2-2): man T F F T, dog T T F F, ball T F T T, sky F F F F, kite F F F T
    assert overall.accuracy.tolist() == [[0.6, 0.2], [0.2, 0.6]] and overall.best_head.label == "1-1"
    rows = [(r.group, r.n, r.baseline, r.overall_head, r.overall_head_accuracy, r.best_head, r.best_accuracy)
            for r in groups["type"].rows(overall)]
    assert rows == [  # the most entities first, then by name
        ("animals", 2, 0.5, "1-1", 1.0, "1-1", 1.0),  # dog (baseline wrong) and ball (right)
        ("other", 1, 0.0, "1-1", 0.0, "2-2", 1.0),  # the kite: only head 2-2 finds it
        ("people", 1, 1.0, "1-1", 1.0, "1-1", 1.0),
        ("scene/other", 1, 0.0, "1-1", 0.0, "1-1", 0.0),  # the sky matches no region
    ]
    words = {r.group: r for r in groups["last_word"].rows(overall)}
    assert set(words) == {"man", "dog", "ball", "sky", "kite"} and words["kite"].best_head == "2-2"
    # the groups add up to the whole
    for g in groups.values():
        rs = g.rows(overall)
        assert sum(r.n for r in rs) == overall.n_entities
        assert sum(r.overall_head_accuracy * r.n for r in rs) == pytest.approx(0.6 * 5)
        assert sum(r.baseline * r.n for r in rs) == pytest.approx(overall.baseline_accuracy * 5)
    md = breakdown_markdown(groups["type"].rows(overall), "By entity type", k=2, note="a note")
    assert "a note; 4 groups, the 2 largest:" in md and "| group | entities | baseline (%) | head 1-1 (%) |" in md
    assert "| animals | 2 | 50.00 | 100.00 | 1-1 | 100.00 |" in md and "| other | 1 | 0.00 | 0.00 | 2-2 | 100.00 |" in md
    assert "people" not in md  # beyond k


def test_group_sums_add_each_key_exactly_across_flushes():
    """Breakdowns and syntactic relations sum their queries in bulk (`GroupSums`): whatever the flush size,
    each key's sums are those of its own queries, and keys come in order of first appearance."""
    from vlberts.analysis.grounding import GroupSums

    rng = np.random.default_rng(0)
    calls = []
    for _ in range(9):  # captions of 0-6 queries, keys of any hashable kind
        n = int(rng.integers(0, 7))
        keys = [("nsubj", w) if k % 2 else w for k, w in zip(rng.integers(0, 4, n), rng.choice(["a", "b", "c"], n))]
        calls.append((keys, rng.random((2, 3, n)) < 0.5, rng.random((2, 3, n)), rng.random(n)))
    want: dict = {}
    for keys, hit, mass, base in calls:
        for i, k in enumerate(keys):
            h, m, b = want.get(k, (0, 0.0, 0.0))
            want[k] = (h + hit[..., i].astype(int), m + mass[..., i], b + base[i])
    for flush_every in (1, 4, 1000):
        sums = GroupSums(flush_every=flush_every)
        for keys, hit, mass, base in calls:
            sums.add(keys, hit, mass, base)
        got = sums.totals()
        assert list(got) == list(want)  # first appearance, over every flush
        for k, (h, m, b) in want.items():
            np.testing.assert_array_equal(got[k][0], h)
            np.testing.assert_allclose(got[k][1], m, rtol=1e-12)
            assert got[k][2] == pytest.approx(b, rel=1e-12)
    with pytest.raises(ValueError, match="2 keys"):
        GroupSums().add(["a", "b"], np.zeros((2, 3, 1)))
