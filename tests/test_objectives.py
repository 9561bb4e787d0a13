"""Pre-training objectives (SPEC §3): each loss against a value worked out by hand on a tiny input, each
loss falls when the prediction moves toward its target, region/tag masking exactly on a tiny input (with
scripted random draws) and statistically with a fixed seed, and the batch-source schedules exactly."""

import math

import numpy as np
import pytest
import torch

from vlberts.objectives.matching import (
    alignment_features,
    flip_match_labels,
    match_labels,
    matching_loss,
    qa_active,
    qa_from_step,
    qa_loss,
    sample_qa_target,
    vilbert_alignment_loss,
)
from vlberts.objectives.regions import (
    LXMERT_REGION_MASK,
    VILBERT_REGION_MASK,
    VLBERT_REGION_MASK,
    corrupt_regions,
    detected_label_loss,
    feat_regression_loss,
    mask_regions,
    mask_tags_jointly,
    masked_roi_loss,
    region_kl_loss,
)
from vlberts.objectives.text import (
    IS_NEXT,
    NOT_NEXT,
    mix_schedule,
    nsp_loss,
    nsp_pair,
    tag_mlm_loss,
    unpaired_schedule,
)
from vlberts.text.masking import IGNORE_INDEX

LN2, LN3 = math.log(2.0), math.log(3.0)


class ScriptedRng:
    """Stands in for np.random.Generator: hands out the given draws in order, checking their sizes."""

    def __init__(self, *draws):
        self.draws = [np.asarray(d) for d in draws]

    def _next(self, size):
        d = self.draws.pop(0)
        if size is not None:
            assert d.shape == (size,), (d.shape, size)
        return d if size is not None else d.item()

    def random(self, size=None):
        return self._next(size)

    def integers(self, low, high, size=None):
        d = self._next(size)
        assert (np.asarray(d) >= low).all() and (np.asarray(d) < high).all()
        return d

    def empty(self):
        return not self.draws


def approx(x, v, tol=1e-6):
    return abs(float(x) - v) < tol


# ---------------------------------------------------------------------------------------- masking


def test_region_masking_exact_on_four_regions():
    feats = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0], [4.0, 4.0]], dtype=np.float32)
    pool = np.array([[7.0, 7.0], [9.0, 9.0]], dtype=np.float32)
    rng = ScriptedRng(
        [0.10, 0.50, 0.05, 0.12],  # selection: < 0.15 -> regions 0, 2, 3
        [0.30, 0.10, 0.85, 0.95],  # action: 0.30 < 0.8 zero; 0.85 in [0.8, 0.9) replace; 0.95 keep
        [0, 0, 1, 0],  # pool row per region: region 2 takes pool[1]
    )
    out = mask_regions(feats, rng, LXMERT_REGION_MASK, pool=pool)
    assert rng.empty()
    np.testing.assert_array_equal(out.mask, [True, False, True, True])
    np.testing.assert_array_equal(out.corrupted, [True, False, False, False])
    np.testing.assert_array_equal(out.feats, [[0, 0], [2, 2], [9, 9], [4, 4]])
    np.testing.assert_array_equal(feats[0], [1, 1])  # input untouched


def test_vilbert_rule_never_replaces_and_padding_is_never_selected():
    feats = np.arange(8, dtype=np.float32).reshape(4, 2)
    # Action .85 would be a replacement under the LXMERT rule; ViLBERT zeroes it (< .9). Action .95 keeps.
    # Region 3 is padding: selected by its draw, but never masked.
    rng = ScriptedRng([0.0, 0.0, 0.0, 0.0], [0.5, 0.85, 0.95, 0.2], [0, 0, 0, 0])
    out = mask_regions(feats, rng, VILBERT_REGION_MASK, valid=np.array([True, True, True, False]))
    np.testing.assert_array_equal(out.mask, [True, True, True, False])
    np.testing.assert_array_equal(out.corrupted, [True, True, False, False])
    np.testing.assert_array_equal(out.feats, [[0, 0], [0, 0], [4, 5], [6, 7]])


def test_replacement_without_pool_uses_another_region_of_the_image():
    feats = np.array([[1.0], [2.0], [3.0]], dtype=np.float32)
    # Region 0 replaced; shift draw 1 -> (0 + 1 + 1) % 3 = region 2.
    rng = ScriptedRng([0.85, 0.95, 0.95], [1, 0, 0])
    out = corrupt_regions(feats, np.array([True, False, False]), rng, zero=0.8, random=0.1)
    np.testing.assert_array_equal(out.feats[:, 0], [3.0, 2.0, 3.0])


@pytest.mark.parametrize("rule, zero, rand", [(LXMERT_REGION_MASK, 0.8, 0.1), (VILBERT_REGION_MASK, 0.9, 0.0),
                                              (VLBERT_REGION_MASK, 0.9, 0.0)])
def test_region_masking_proportions(rule, zero, rand):
    n = 100_000
    feats = np.ones((n, 1), dtype=np.float32) * 5.0
    pool = np.full((4, 1), 2.0, dtype=np.float32)
    out = mask_regions(feats, np.random.default_rng(0), rule, pool=pool)
    k = out.mask.sum()
    # Binomial sd of the selected share: sqrt(.15 * .85 / 1e5) = 0.0011; 4 sd = 0.0045.
    assert abs(k / n - 0.15) < 0.0045
    sel = out.feats[out.mask, 0]
    # Among ~15,000 selected, sd of a share p is at most sqrt(.25 / 15000) = 0.0041; 4 sd = 0.017.
    assert abs((sel == 0.0).mean() - zero) < 0.017
    assert abs((sel == 2.0).mean() - rand) < 0.017
    assert abs((sel == 5.0).mean() - (1 - zero - rand)) < 0.017
    assert (out.feats[~out.mask, 0] == 5.0).all()
    again = mask_regions(feats, np.random.default_rng(0), rule, pool=pool)
    np.testing.assert_array_equal(again.feats, out.feats)  # deterministic given the Generator


def test_joint_tag_masking_exact():
    # Three regions; region 1 is masked. Tags: region 0 -> [10, 11], region 1 -> [12], region 2 -> [13].
    tag_ids = np.array([10, 11, 12, 13])
    tag_region = np.array([0, 0, 1, 2])
    rng = ScriptedRng(
        [0.10, 0.90, 0.90],  # alone: only tag 0 (< 0.15)
        [0.95, 0.50, 0.00],  # joint: region 1 masked and 0.50 < 0.9 -> tag 1; region 2 not masked
        [0.85, 0.20, 0.20],  # action per tag: tag 0 random tokens (0.85), tag 1 [MASK]
        [5, 6, 7, 8],  # random token per subword
    )
    out, labels, rmask = mask_tags_jointly(tag_ids, tag_region, np.array([False, True, False]), rng,
                                           mask_id=4, vocab_size=50, tag_to_region=True)
    assert rng.empty()
    np.testing.assert_array_equal(out, [5, 6, 4, 13])  # both subwords of tag 0 share its action
    np.testing.assert_array_equal(labels, [10, 11, 12, IGNORE_INDEX])
    np.testing.assert_array_equal(rmask, [True, True, False])  # tag 0 masked -> its region too (option)


def test_joint_tag_masking_proportions():
    R = 50_000
    tag_region = np.arange(R)
    ids = np.full(R, 9)
    _, lab_free, same = mask_tags_jointly(ids, tag_region, np.zeros(R, bool), np.random.default_rng(1),
                                          mask_id=4, vocab_size=50)
    _, lab_joint, _ = mask_tags_jointly(ids, tag_region, np.ones(R, bool), np.random.default_rng(1),
                                        mask_id=4, vocab_size=50)
    assert not same.any()  # region -> tag only by default (as the original)
    assert abs((lab_free != IGNORE_INDEX).mean() - 0.15) < 0.007  # 4 sd = 4 * sqrt(.15 * .85 / 5e4) = 0.0064
    # Masked region: 1 - P(not alone) P(not joint) = 1 - 0.85 * 0.1 = 0.915.
    assert abs((lab_joint != IGNORE_INDEX).mean() - 0.915) < 0.006


# ---------------------------------------------------------------------------------------- ViLBERT


def test_region_kl_loss_by_hand():
    # Region 0: logits (0, 0, 0) -> q = (1/3, 1/3, 1/3); detector p = (.5, .5, 0):
    #   KL = .5 ln(.5 / (1/3)) * 2 + 0 = ln 1.5
    # Region 1: logits (0, ln 2, 0) -> q = (1/4, 1/2, 1/4); p = (0, 1, 0): KL = ln(1 / .5) = ln 2
    # Region 2 is not masked. Mean over the 2 masked regions: (ln 1.5 + ln 2) / 2 = ln(3) / 2 = 0.549306
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, LN2, 0.0], [5.0, -5.0, 0.0]]])
    target = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    mask = torch.tensor([[True, True, False]])
    assert approx(region_kl_loss(logits, target, mask), 0.549306)
    assert region_kl_loss(logits, target, torch.zeros_like(mask)).item() == 0.0


def test_region_kl_loss_decreases_toward_target():
    target = torch.tensor([[[0.7, 0.2, 0.1]]])
    mask = torch.tensor([[True]])
    far = region_kl_loss(torch.tensor([[[0.0, 2.0, 0.0]]]), target, mask)
    near = region_kl_loss(torch.tensor([[[1.0, 0.5, 0.0]]]), target, mask)
    exact = region_kl_loss(target.log(), target, mask)
    assert far > near > exact and approx(exact, 0.0)


def test_alignment_labels_and_loss_by_hand():
    h_img, h_cls = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0]])
    assert alignment_features(h_img, h_cls).tolist() == [[3.0, -2.0]]
    # logits (0, ln 3): p = (1/4, 3/4). ViLBERT: aligned -> label 0 -> -ln(1/4) = ln 4 = 1.386294
    logits = torch.tensor([[0.0, LN3]])
    assert approx(vilbert_alignment_loss(logits, torch.tensor([True])), 1.386294)
    # not aligned -> label 1 -> -ln(3/4) = 0.287682
    assert approx(vilbert_alignment_loss(logits, torch.tensor([False])), 0.287682)
    assert vilbert_alignment_loss(torch.tensor([[2.0, 0.0]]), torch.tensor([True])) < \
        vilbert_alignment_loss(torch.tensor([[0.5, 0.0]]), torch.tensor([True]))


# ---------------------------------------------------------------------------------------- VL-BERT


def test_masked_roi_loss_by_hand():
    # Masked region 0: logits (ln 2, 0, 0) -> q = (1/2, 1/4, 1/4); detector scores (.6, .3, .1).
    #   soft: -(.6 ln .5 + .3 ln .25 + .1 ln .25) = .6 ln 2 + .4 * 2 ln 2 = 1.4 ln 2 = 0.970406
    #   hard: argmax = class 0 -> -ln .5 = ln 2 = 0.693147
    logits = torch.tensor([[[LN2, 0.0, 0.0], [9.0, 0.0, 0.0]]])
    cls_prob = torch.tensor([[[0.6, 0.3, 0.1], [0.0, 0.0, 1.0]]])
    mask = torch.tensor([[True, False]])
    assert approx(masked_roi_loss(logits, cls_prob, mask), 0.970406)
    assert approx(masked_roi_loss(logits, cls_prob, mask, target="hard"), 0.693147)


@pytest.mark.parametrize("target", ["soft", "hard"])
def test_masked_roi_loss_decreases_toward_target(target):
    cls_prob = torch.tensor([[[0.6, 0.3, 0.1]]])
    mask = torch.tensor([[True]])
    far = masked_roi_loss(torch.tensor([[[0.0, 0.0, 2.0]]]), cls_prob, mask, target)
    near = masked_roi_loss(torch.tensor([[[1.0, 0.5, 0.0]]]), cls_prob, mask, target)
    assert near < far


# ---------------------------------------------------------------------------------------- LXMERT


def test_feat_regression_loss_by_hand():
    # Region 0 (masked): pred (0, 2), target (.5, 0). SmoothL1 (beta 1): |.5| -> .5 * .5^2 = .125;
    #   |2| -> 2 - .5 = 1.5; mean over F = .8125. Region 1 unmasked -> 0. Mean over B x R = 2: .40625.
    #   L2: (.25 + 4) / 2 = 2.125 -> / 2 = 1.0625. Default weight 1/0.15: .40625 / .15 = 2.708333.
    pred = torch.tensor([[[0.0, 2.0], [9.0, 9.0]]])
    target = torch.tensor([[[0.5, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[True, False]])
    assert approx(feat_regression_loss(pred, target, mask, weight=1.0), 0.40625)
    assert approx(feat_regression_loss(pred, target, mask, kind="l2", weight=1.0), 1.0625)
    assert approx(feat_regression_loss(pred, target, mask), 2.708333, 1e-5)


@pytest.mark.parametrize("kind", ["smooth_l1", "l2"])
def test_feat_regression_loss_decreases_toward_target(kind):
    target, mask = torch.tensor([[[0.5, 0.0]]]), torch.tensor([[True]])
    far = feat_regression_loss(torch.tensor([[[3.0, 2.0]]]), target, mask, kind)
    near = feat_regression_loss(torch.tensor([[[1.0, 0.5]]]), target, mask, kind)
    assert near < far and approx(feat_regression_loss(target, target, mask, kind), 0.0)


def test_detected_label_loss_by_hand():
    # Region 0: logits (ln 2, 0, 0) -> q0 = 1/2, label 0: CE = ln 2; conf .5.
    # Region 1: logits (0, 0, 0), label 2: CE = ln 3; conf 1.0.
    # over all (original): (.5 ln 2 + 1.0 ln 3) / 2 = (.346574 + 1.098612) / 2 = 0.722593
    # over masked (mask = (no, yes)): (0 + 1.0 ln 3) / 2 = 0.549306
    logits = torch.tensor([[[LN2, 0.0, 0.0], [0.0, 0.0, 0.0]]])
    labels = torch.tensor([[0, 2]])
    conf = torch.tensor([[0.5, 1.0]])
    mask = torch.tensor([[False, True]])
    assert approx(detected_label_loss(logits, labels, conf, weight=1.0), 0.722593)
    assert approx(detected_label_loss(logits, labels, conf, mask, over="masked", weight=1.0), 0.549306)
    with pytest.raises(ValueError):
        detected_label_loss(logits, labels, conf, over="masked")
    # A padded region (label IGNORE_INDEX, conf 0) adds 0 but still counts in the B x R mean:
    #   (.5 ln 2 + 0) / 2 = 0.173287
    padded = torch.tensor([[0, IGNORE_INDEX]])
    assert approx(detected_label_loss(logits, padded, torch.tensor([[0.5, 0.0]]), weight=1.0), 0.173287)


def test_detected_label_loss_decreases_toward_target():
    labels, conf = torch.tensor([[1]]), torch.tensor([[0.8]])
    far = detected_label_loss(torch.tensor([[[2.0, 0.0, 0.0]]]), labels, conf)
    near = detected_label_loss(torch.tensor([[[0.0, 1.0, 0.0]]]), labels, conf)
    assert near < far


def test_match_label_conventions_and_lxmert_loss_by_hand():
    matched = torch.tensor([True, False])
    assert match_labels(matched, "lxmert").tolist() == [1, 0]
    assert match_labels(matched, "vilbert").tolist() == [0, 1]
    assert match_labels(matched, "visualbert").tolist() == [0, 1]
    assert flip_match_labels(match_labels(matched, "visualbert")).tolist() == [1, 0]
    # logits (0, ln 3): p(index 1) = 3/4. LXMERT matched -> label 1 -> -ln(3/4) = 0.287682
    assert approx(matching_loss(torch.tensor([[0.0, LN3]]), torch.tensor([True]), "lxmert"), 0.287682)
    assert matching_loss(torch.tensor([[0.0, 3.0]]), torch.tensor([True]), "lxmert") < \
        matching_loss(torch.tensor([[0.0, LN3]]), torch.tensor([True]), "lxmert")
    # Only some rows (a batch mixing pairs with text-only samples): row 1's loss (-ln(1/4)) is left out.
    two, rows = torch.tensor([[0.0, LN3], [0.0, LN3]]), torch.tensor([True, False])
    assert approx(matching_loss(two, torch.tensor([True, False]), "lxmert", rows=rows), 0.287682)
    assert matching_loss(two, torch.tensor([True, False]), "lxmert", rows=torch.zeros(2, dtype=torch.bool)).item() == 0.0


def test_losses_over_a_subset_read_nothing_back_from_the_device():
    """Each loss that averages over a data-dependent subset (masked regions, masked tags, the rows of one
    kind, answered questions) traces to one graph: no boolean index and no `.any()` test, so on a GPU the
    host never waits for the device inside a step (`test_models.py` checks whole pre-training steps)."""
    import torch._dynamo as dynamo

    g = torch.Generator().manual_seed(0)
    B, R, C = 3, 4, 5
    mask = torch.tensor([[True, False, False, True], [False] * 4, [False, True, False, False]])
    tags = torch.full((B, R), IGNORE_INDEX)
    tags[0, 1], tags[2, 3] = 2, 4
    probs = torch.softmax(torch.randn(B, R, C, generator=g), -1)
    has, matched = torch.tensor([True, False, True]), torch.tensor([True, True, False])
    cases = {
        "region_kl": (region_kl_loss, (torch.randn(B, R, C, generator=g), probs, mask)),
        "roi_cls soft": (masked_roi_loss, (torch.randn(B, R, C, generator=g), probs, mask)),
        "roi_cls hard": (lambda lg, p, m: masked_roi_loss(lg, p, m, target="hard"), (torch.randn(B, R, C, generator=g), probs, mask)),
        "tag_mlm": (tag_mlm_loss, (torch.randn(B, R, C, generator=g), tags)),
        "matching rows": (lambda lg, m, r: matching_loss(lg, m, "lxmert", rows=r), (torch.randn(B, 2, generator=g), matched, has)),
        "qa": (qa_loss, (torch.randn(B, 6, generator=g), torch.tensor([1, -1, 2]), has, matched)),
        "qa soft": (qa_loss, (torch.randn(B, 6, generator=g), torch.rand(B, 6, generator=g), has, matched)),
    }
    for name, (fn, args) in cases.items():
        dynamo.reset()
        explained = dynamo.explain(fn)(*args)
        assert explained.graph_break_count == 0 and explained.graph_count == 1, (name, explained.break_reasons)
        assert torch.isfinite(fn(*args)), name


def test_qa_loss_by_hand_only_matched_pairs_with_answers():
    logits = torch.tensor([[0.0, LN3], [9.0, -9.0], [9.0, -9.0]])
    has_answer = torch.tensor([True, True, False])
    matched = torch.tensor([True, False, True])
    # Only row 0 counts. CE: target 1, p = 3/4 -> -ln(3/4) = 0.287682
    assert approx(qa_loss(logits, torch.tensor([1, 0, 0]), has_answer, matched), 0.287682)
    # Soft scores, row 0 logits (0, 0) -> sigmoid .5: BCE(1) = ln 2, BCE(.3) = -(.3 + .7) ln .5 = ln 2;
    #   mean over A = ln 2, times A = 2: 2 ln 2 = 1.386294
    soft = torch.tensor([[1.0, 0.3], [0.0, 1.0], [0.0, 1.0]])
    assert approx(qa_loss(torch.zeros(3, 2), soft, has_answer, matched), 1.386294)
    assert qa_loss(logits, soft, torch.zeros(3, dtype=torch.bool), matched).item() == 0.0


def test_qa_loss_decreases_toward_target():
    has, matched = torch.tensor([True]), torch.tensor([True])
    for t in (torch.tensor([1]), torch.tensor([[0.0, 0.9]])):
        far = qa_loss(torch.tensor([[2.0, -1.0]]), t, has, matched)
        near = qa_loss(torch.tensor([[-1.0, 2.0]]), t, has, matched)
        assert near < far


def test_qa_target_sampling_and_schedule():
    rng = np.random.default_rng(0)
    assert sample_qa_target(np.array([0.0, 0.3, 0.0]), rng) == 1
    assert sample_qa_target(np.zeros(3), rng) == -1
    draws = [sample_qa_target(np.array([0.3, 0.9]), np.random.default_rng(s)) for s in range(2000)]
    assert abs(np.mean(draws) - 0.75) < 0.04  # P(index 1) = .9 / 1.2; 4 sd = 4 * sqrt(.1875 / 2000) = 0.039
    assert qa_from_step(100, 0.5) == 50 and qa_from_step(100, 0.0) == 100 and qa_from_step(100, 1.0) == 0
    assert not qa_active(49, 50) and qa_active(50, 50) and qa_active(0, None)


# ---------------------------------------------------------------------------------------- text side


@pytest.mark.parametrize("ratio, period", [(0.25, 4), (1 / 3, 3), (0.1, 10), (0.0, 1), (1.0, 1)])
def test_mix_schedule_is_exact_and_deterministic(ratio, period):
    steps = 300 * period
    seq = [mix_schedule(s, ratio, seed=7) for s in range(steps)]
    assert seq.count("text") == round(ratio * steps)  # exact, not approximate
    for b in range(0, steps, period):  # and exact within every period
        assert seq[b : b + period].count("text") == round(ratio * period)
    assert seq == [mix_schedule(s, ratio, seed=7) for s in range(steps)]
    assert set(seq) <= {"text", "image"}


def test_mix_schedule_depends_on_seed_and_unpaired_alternates_evenly():
    a = [mix_schedule(s, 0.25, seed=0) for s in range(400)]
    b = [mix_schedule(s, 0.25, seed=1) for s in range(400)]
    assert a != b
    u = [unpaired_schedule(s, seed=3) for s in range(1000)]
    assert u.count("text") == u.count("image") == 500


def test_tag_mlm_loss_by_hand():
    # Only position 1 is a masked tag: logits (0, 0, ln 2) -> p(2) = 2/4 -> -ln .5 = ln 2 = 0.693147
    logits = torch.tensor([[[5.0, 0.0, 0.0], [0.0, 0.0, LN2], [0.0, 5.0, 0.0]]])
    labels = torch.tensor([[IGNORE_INDEX, 2, IGNORE_INDEX]])
    assert approx(tag_mlm_loss(logits, labels), 0.693147)
    assert tag_mlm_loss(logits, torch.full_like(labels, IGNORE_INDEX)).item() == 0.0
    closer = logits.clone()
    closer[0, 1, 2] = 3.0
    assert tag_mlm_loss(closer, labels) < tag_mlm_loss(logits, labels)


def test_nsp_pairs_exact():
    docs = [["a1", "a2", "a3"], ["b1", "b2"]]
    # coin .9 >= .5 and a successor exists -> the real next sentence.
    assert nsp_pair(docs, 0, 0, ScriptedRng(0.9, 0, 0.0)) == ("a1", "a2", IS_NEXT)
    # coin .1 < .5 -> random: other-document draw 0 skips doc 0 -> doc 1; u = .6 -> sentence int(.6 * 2) = 1.
    assert nsp_pair(docs, 0, 0, ScriptedRng(0.1, 0, 0.6)) == ("a1", "b2", NOT_NEXT)
    # The last sentence has no successor: always random, whatever the coin. From doc 1, draw 0 -> doc 0.
    assert nsp_pair(docs, 1, 1, ScriptedRng(0.9, 0, 0.0)) == ("b2", "a1", NOT_NEXT)
    labels = [nsp_pair(docs, 0, 0, np.random.default_rng(s))[2] for s in range(2000)]
    assert abs(np.mean(labels) - 0.5) < 0.045  # 4 sd = 4 * sqrt(.25 / 2000) = 0.045


def test_nsp_loss_by_hand():
    # logits (0, ln 3), label NOT_NEXT = 1: -ln(3/4) = 0.287682; label IS_NEXT: -ln(1/4) = 1.386294
    logits = torch.tensor([[0.0, LN3]])
    assert approx(nsp_loss(logits, torch.tensor([NOT_NEXT])), 0.287682)
    assert approx(nsp_loss(logits, torch.tensor([IS_NEXT])), 1.386294)
    assert nsp_loss(torch.tensor([[2.0, 0.0]]), torch.tensor([IS_NEXT])) < nsp_loss(logits, torch.tensor([IS_NEXT]))
