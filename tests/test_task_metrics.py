"""Task metrics (GQA, NLVR2, VCR, RefCOCO+, retrieval) against values computed by hand on small examples."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vlberts.data.gqa import GQAExample
from vlberts.data.nlvr2 import NLVR2Example, parse_identifier
from vlberts.data.vcr import VCRExample
from vlberts.errors import VlbertsError
from vlberts.tasks import gqa, nlvr2, refcoco, retrieval, vcr

# --------------------------------------------------------------------------- GQA


def _gqa(qid, answer, structural="query"):
    return GQAExample(question_id=qid, image_id="1", question="?", answer=answer, structural_type=structural)


GQA_EXAMPLES = [_gqa("1", "yes", "verify"), _gqa("2", "dark brown"), _gqa("3", "left", "choose"), _gqa("4", "t-shirt")]
GQA_PREDS = {"1": "yes", "2": " Dark  brown\n", "3": "right", "4": "tshirt"}


def test_gqa_exact_match_with_and_without_normalisation():
    assert gqa.normalize_gqa_answer(" Dark  Brown\n") == "dark brown"
    assert gqa.normalize_gqa_answer("T-Shirt") == "t-shirt"  # hyphen kept: "tshirt" stays a different answer
    scores = gqa.score_predictions(GQA_PREDS, GQA_EXAMPLES)
    # by hand: q1 exact, q2 equal after lower/trim/collapse, q3 wrong, q4 wrong (no punctuation stripping)
    assert scores.accuracy == pytest.approx(100 * 2 / 4)
    assert scores.num_correct == 2 and scores.num_questions == 4
    assert scores.per_structural_type == pytest.approx({"choose": 0.0, "query": 50.0, "verify": 100.0})
    official = gqa.score_predictions(GQA_PREDS, GQA_EXAMPLES, normalize=False)  # eval.py: predicted == gold
    assert official.accuracy == pytest.approx(100 * 1 / 4)


def test_gqa_prediction_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "testdev_predictions.json"
    assert gqa.write_predictions(path, GQA_PREDS.items()) == 4
    assert json.loads(path.read_text())[0] == {"questionId": "1", "prediction": "yes"}
    ids = [ex.question_id for ex in GQA_EXAMPLES]
    assert gqa.read_predictions(path, ids) == GQA_PREDS
    path.write_text(json.dumps([{"questionId": "1", "prediction": "yes"}, {"questionId": "1", "prediction": "no"}]))
    with pytest.raises(VlbertsError, match="record question 1: duplicate prediction"):
        gqa.read_predictions(path, ids)
    path.write_text(json.dumps([{"questionId": "1", "prediction": "yes"}]))
    with pytest.raises(VlbertsError, match=r"record question 2: no prediction for this example \(2 more"):
        gqa.read_predictions(path, ids)
    path.write_text(json.dumps([{"questionId": "77", "prediction": "yes"}]))
    with pytest.raises(VlbertsError, match="record question 77: not a question of the evaluated set"):
        gqa.read_predictions(path, ids)


def test_gqa_majority_answer():
    train = [_gqa("1", "Yes"), _gqa("2", "no"), _gqa("3", "yes "), _gqa("4", "no"), _gqa("5", "left")]
    assert gqa.majority_answer(train) == "no"  # "no" 2, "yes" 2 after normalisation: tie -> alphabetical


# --------------------------------------------------------------------------- NLVR2


def _nlvr2(identifier, label):
    ident = parse_identifier(identifier)
    return NLVR2Example(identifier, "s", label, ident.left_image_id, ident.right_image_id, ident.sentence_key)


# Sentence dev-1--0 has three image pairs, dev-1--1 two, dev-2--0 one. Sentence id 0 of set 1 and
# set 2 are different sentences (grouping by sentence id alone would merge them).
NLVR2_EXAMPLES = [
    _nlvr2("dev-1-0-0", True), _nlvr2("dev-1-1-0", False), _nlvr2("dev-1-2-0", True),
    _nlvr2("dev-1-0-1", False), _nlvr2("dev-1-1-1", True),
    _nlvr2("dev-2-0-0", False),
]  # fmt: skip


def test_nlvr2_accuracy_and_consistency_by_hand():
    preds = {"dev-1-0-0": True, "dev-1-1-0": False, "dev-1-2-0": True,  # dev-1--0: all 3 right
             "dev-1-0-1": False, "dev-1-1-1": False,  # dev-1--1: one of 2 wrong
             "dev-2-0-0": False}  # dev-2--0: right
    scores = nlvr2.score_predictions(preds, NLVR2_EXAMPLES)
    assert scores.accuracy == pytest.approx(100 * 5 / 6)
    assert scores.consistency == pytest.approx(100 * 2 / 3)  # 2 of 3 unique sentences fully right
    assert (scores.num_examples, scores.num_sentences) == (6, 3)
    # Always predicting True: 3/6 right, and no sentence has all its examples right.
    always_true = nlvr2.score_predictions({ex.identifier: True for ex in NLVR2_EXAMPLES}, NLVR2_EXAMPLES)
    assert (always_true.accuracy, always_true.consistency) == (50.0, 0.0)
    assert nlvr2.majority_label(NLVR2_EXAMPLES) is True  # 3 True, 3 False: tie -> True


def test_nlvr2_prediction_csv(tmp_path):
    path = tmp_path / "predictions.csv"
    written = nlvr2.write_predictions(path, [(ex.identifier, ex.label) for ex in NLVR2_EXAMPLES])
    assert written == 6 and path.read_text().splitlines()[:2] == ["dev-1-0-0,True", "dev-1-1-0,False"]
    ids = [ex.identifier for ex in NLVR2_EXAMPLES]
    assert nlvr2.read_predictions(path, ids) == {ex.identifier: ex.label for ex in NLVR2_EXAMPLES}
    path.write_text("dev-1-0-0,true\ndev-1-1-0,FALSE\n" + "".join(f"{i},True\n" for i in ids[2:]))
    preds = nlvr2.read_predictions(path, ids)  # labels compared case-insensitively, as the official script
    assert preds["dev-1-0-0"] is True and preds["dev-1-1-0"] is False
    path.write_text("dev-1-0-0,True\ndev-1-1-0 False\n")
    with pytest.raises(VlbertsError, match=r"predictions\.csv: record line 2: expected 'identifier,True'"):
        nlvr2.read_predictions(path, ids)
    # Another task's predictions.json: the line quoted short, and what the file is said
    path.write_text(json.dumps([{"question_id": i, "answer": "yes"} for i in range(300)]))
    with pytest.raises(VlbertsError) as err:
        nlvr2.read_predictions(path, ids)
    assert len(str(err.value)) < 300 + len(str(path)) and str(err.value).endswith(
        "...' (a JSON file: NLVR2's predictions are CSV lines, as `vlberts finetune nlvr2` writes predictions.csv)")
    path.write_text("dev-1-0-0,True\n")
    with pytest.raises(VlbertsError, match=r"record identifier dev-1-1-0: no prediction for this example \(4 more"):
        nlvr2.read_predictions(path, ids)


# --------------------------------------------------------------------------- VCR


def _vcr(annot_id, answer_label, rationale_label):
    choices = ((("a",),) * 4)
    return VCRExample(annot_id, "img", "img.jpg", "img.json", ("person",), ("q",), choices, choices,
                      answer_label, rationale_label)


def test_vcr_q2a_qa2r_q2ar_by_hand():
    examples = [_vcr("a", 0, 1), _vcr("b", 2, 3), _vcr("c", 1, 0), _vcr("d", 3, 2)]
    answers = {"a": 0, "b": 2, "c": 0, "d": 0}  # right, right, wrong, wrong
    rationales = {"a": 1, "b": 0, "c": 0, "d": 0}  # right, wrong, right, wrong
    scores = vcr.score_predictions(answers, rationales, examples)
    assert (scores.q2a, scores.qa2r, scores.q2ar) == (50.0, 50.0, 25.0)  # only "a" has both right
    assert scores.num_questions == 4


def test_vcr_choices_from_scores_and_ties():
    assert vcr.choose([0.1, 0.7, 0.7, 0.2]) == 1  # tie between 1 and 2: lowest index, like numpy.argmax
    assert vcr.choose([-1.0, -3.0, -2.0, -4.0]) == 0
    assert vcr.choose(np.array([0.2, 0.9, 0.9, 0.1], dtype=np.float32)) == 1  # a logits row as numpy
    with pytest.raises(ValueError, match="NaN"):
        vcr.choose([0.1, float("nan"), 0.3, 0.0])
    examples = [_vcr("a", 1, 2), _vcr("b", 0, 0)]
    scores = vcr.score_logits({"a": [0.0, 0.5, 0.5, 0.1], "b": [1.0, 1.0, 1.0, 1.0]},
                              {"a": [0.0, 0.1, 0.9, 0.2], "b": [0.0, 0.2, 0.1, 0.0]}, examples)
    # a: answer 1 (tie 1/2 -> 1) right, rationale 2 right; b: answer 0 (all tied) right, rationale 1 wrong
    assert (scores.q2a, scores.qa2r, scores.q2ar) == (100.0, 50.0, 50.0)


# --------------------------------------------------------------------------- RefCOCO+


def test_box_iou_by_hand():
    assert refcoco.box_iou((0, 0, 2, 2), (1, 1, 3, 3)) == pytest.approx(1 / 7)  # inter 1, union 4 + 4 - 1
    assert refcoco.box_iou((0, 0, 2, 1), (0, 0, 1, 1)) == pytest.approx(0.5)  # inter 1, union 2
    assert refcoco.box_iou((0, 0, 1, 1), (2, 2, 3, 3)) == 0.0
    assert refcoco.box_iou((0, 0, 4, 4), (0, 0, 4, 4)) == 1.0
    assert refcoco.box_iou((1, 1, 1, 1), (1, 1, 1, 1)) == 0.0  # degenerate: empty union


def test_refcoco_region_targets_binary_and_soft():
    gold = (0.0, 0.0, 4.0, 4.0)
    boxes = [(0.0, 0.0, 4.0, 4.0), (0.0, 0.0, 4.0, 2.0), (0.0, 0.0, 4.0, 3.0), (2.0, 2.0, 6.0, 6.0)]
    # IoUs by hand: 1, 8/16 = 0.5, 12/16 = 0.75, 4/28 = 1/7
    assert refcoco.region_targets(boxes, gold) == [1.0, 1.0, 1.0, 0.0]
    assert refcoco.region_targets(boxes, gold, soft=True) == pytest.approx([1.0, 0.5, 0.75, 0.0])


def test_refcoco_accuracy_top_region_and_threshold():
    gold = [(0.0, 0.0, 4.0, 4.0)] * 3 + [(10.0, 10.0, 12.0, 12.0)]
    boxes = [[(0.0, 0.0, 4.0, 4.0), (2.0, 2.0, 6.0, 6.0)],  # top region exact: right
             [(0.0, 0.0, 4.0, 4.0), (0.0, 0.0, 4.0, 2.0)],  # top region IoU exactly 0.5: right at >=, wrong at >
             [(0.0, 0.0, 4.0, 4.0), (2.0, 2.0, 6.0, 6.0)],  # top region IoU 1/7: wrong, but reachable
             [(0.0, 0.0, 1.0, 1.0), (2.0, 2.0, 6.0, 6.0)]]  # no candidate overlaps: wrong, unreachable
    scores = [[0.9, 0.1], [0.2, 0.8], [0.3, 0.3 + 1e-6], [0.5, 0.5]]
    res = refcoco.score_regions(scores, boxes, gold)
    assert (res.accuracy, res.upper_bound, res.num_correct, res.num_expressions) == (50.0, 75.0, 2, 4)
    strict = refcoco.score_regions(scores, boxes, gold, strict=True)  # VL-BERT / ViLBERT code: IoU > 0.5
    assert (strict.accuracy, strict.upper_bound) == (25.0, 75.0)
    assert refcoco.top_region([0.4, 0.4, 0.1]) == 0  # tie: lowest index
    with pytest.raises(ValueError, match="2 scores for 1 regions"):
        refcoco.score_regions([[0.1, 0.2]], [[(0, 0, 1, 1)]], [(0, 0, 1, 1)])


# --------------------------------------------------------------------------- retrieval

# 3 images x 2 captions each (captions 2k, 2k+1 belong to image k); rows captions, columns images.
RETRIEVAL_SCORES = np.array([
    [0.9, 0.1, 0.2],  # c0 (img0): gold best                        -> t2i rank 0
    [0.5, 0.5, 0.6],  # c1 (img0): img1 ties gold, img2 above       -> t2i rank 2 (tie counts against)
    [0.3, 0.2, 0.8],  # c2 (img1): img0 and img2 above               -> t2i rank 2
    [0.1, 0.7, 0.0],  # c3 (img1): gold best                        -> t2i rank 0
    [0.4, 0.4, 0.4],  # c4 (img2): all tied                          -> t2i rank 2
    [0.0, 0.9, 0.6],  # c5 (img2): img1 above                        -> t2i rank 1
])  # fmt: skip
RETRIEVAL_GT = [0, 0, 1, 1, 2, 2]


def test_retrieval_ranks_with_ties_by_hand():
    assert retrieval.text_to_image_ranks(RETRIEVAL_SCORES, RETRIEVAL_GT).tolist() == [0, 2, 2, 0, 2, 1]
    # image->text: wrong captions scoring >= the best gold caption of the column.
    # img0: best gold 0.9 (c0), none above -> 0; img1: best gold 0.7 (c3), c5 0.9 above -> 1;
    # img2: best gold 0.6 (c5), c2 0.8 above and c1 0.6 tied -> 2
    assert retrieval.image_to_text_ranks(RETRIEVAL_SCORES, RETRIEVAL_GT).tolist() == [0, 1, 2]
    res = retrieval.score_retrieval(RETRIEVAL_SCORES, RETRIEVAL_GT)
    t, i = res.text_to_image, res.image_to_text
    # t2i ranks sorted [0, 0, 1, 2, 2, 2]: median 1.5 -> floor 1, +1 = 2; mean 7/6 + 1
    assert (t.r1, t.r5, t.r10, t.medr) == (pytest.approx(100 * 2 / 6), 100.0, 100.0, 2.0)
    assert t.meanr == pytest.approx(7 / 6 + 1)
    assert (i.r1, i.r5, i.medr, i.meanr) == (pytest.approx(100 / 3), 100.0, 2.0, 2.0)
    assert res.rsum == pytest.approx(100 * 2 / 6 + 200 + 100 / 3 + 200)
    assert (t.num_queries, i.num_queries) == (6, 3)


def test_retrieval_summary_recall_cutoffs_and_median():
    s = retrieval.summarize_ranks([0, 4, 5, 9, 10, 20])
    # R@1: {0}; R@5: {0, 4}; R@10: {0, 4, 5, 9}; median (5 + 9) / 2 = 7 -> medr 8; mean 48 / 6 = 8 -> meanr 9
    assert (s.r1, s.r5, s.r10) == pytest.approx((100 / 6, 200 / 6, 400 / 6))
    assert (s.medr, s.meanr) == (8.0, 9.0)
    assert retrieval.summarize_ranks([3]).medr == 4.0


def test_retrieval_constant_scorer_gets_the_worst_rank_and_order_does_not_matter():
    flat = np.zeros((10, 2))  # 2 images x 5 captions (Flickr30K's 5 per image)
    gt = retrieval.caption_image_index(["b"] * 5 + ["a"] * 5, ["a", "b"])
    assert gt.tolist() == [1] * 5 + [0] * 5
    assert retrieval.text_to_image_ranks(flat, gt).tolist() == [1] * 10  # the other image ties -> above
    assert retrieval.image_to_text_ranks(flat, gt).tolist() == [5, 5]  # all 5 wrong captions tie -> above
    assert retrieval.score_retrieval(flat, gt).text_to_image.r1 == 0.0
    # Permuting the image columns (and the ground truth with them) leaves every rank unchanged.
    perm = [2, 0, 1]
    inverse = np.argsort(perm)
    permuted = retrieval.text_to_image_ranks(RETRIEVAL_SCORES[:, perm], inverse[RETRIEVAL_GT])
    assert permuted.tolist() == [0, 2, 2, 0, 2, 1]


def test_retrieval_bad_input():
    with pytest.raises(ValueError, match="image 2 has no ground-truth caption"):
        retrieval.image_to_text_ranks(RETRIEVAL_SCORES, [0, 0, 1, 1, 1, 1])
    with pytest.raises(ValueError, match="NaN"):
        retrieval.text_to_image_ranks(np.array([[np.nan, 1.0]]), [0])
    with pytest.raises(ValueError, match="outside 0..2"):
        retrieval.text_to_image_ranks(RETRIEVAL_SCORES, [0, 0, 1, 1, 2, 3])
    with pytest.raises(ValueError, match="'z' is not among the scored images"):
        retrieval.caption_image_index(["a", "z"], ["a", "b"])
