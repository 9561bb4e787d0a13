"""Image-text retrieval end to end on the tiny world: 4-way groups (positive, random caption, random image,
hard negative among the image's nearest neighbours), the full score matrix ranked by hand through the
recipe's evaluation path, the scorer of every architecture (and its start as the pre-trained matching head's
log-odds), `finetune retrieval` writing metrics next to chance, exact resume, zero-shot scoring from a
pre-trained checkpoint through the CLI, re-scoring a saved matrix, and bad input."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from vlberts.cli import main
from vlberts.data.batch import TagInputs, VLInputs
from vlberts.data.retrieval import (
    HARD_IMAGE, POSITIVE, RANDOM_CAPTION, RANDOM_IMAGE, PairEncoder, RetrievalCaption, RetrievalGroups,
    RetrievalSplit, collate_pairs, image_embeddings, nearest_neighbours, read_retrieval_split,
)
from vlberts.errors import BadRecords, VlbertsError
from vlberts.features.store import RegionStore
from vlberts.models.builders import build_pretraining_model, model_config
from vlberts.models.encoders import ENCODER_PREFIX
from vlberts.models.retrieval import MATCH_HEADS, RetrievalModel, four_way_loss
from vlberts.recipes.finetune_retrieval import (
    FinetuneRetrievalConfig, finetune_retrieval, load_retrieval_model, retrieval_metrics, score_matrix,
)
from vlberts.recipes.pretrain import PretrainConfig, pretrain
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.checkpoint import load_pretraining_model
from vlberts.training.metrics import MetricsLog

ARCH_MODELS = ["visualbert-tiny", "lxmert-tiny", "vilbert-tiny", "vlbert-tiny", "wvisualbert-tiny"]
MAX_REGIONS = 12


def split_file(world) -> Path:
    return world.root / "dataset_world.json"


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def ret_cfg(world, init: Path, out: Path, **kw) -> FinetuneRetrievalConfig:
    base = dict(init=str(init), out=str(out), features=str(world.store), split_file=str(split_file(world)),
                epochs=1.0, batch_size=8, lr=1e-3, log_every=1, ckpt_every=3, max_regions=MAX_REGIONS,
                hard_negatives=3, eval_images=4, device="cpu")
    base.update(kw)
    return FinetuneRetrievalConfig(**base)


# --------------------------------------------------------------------------- groups


def test_nearest_neighbours_by_hand():
    emb = np.array([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [0.6, 0.8]], dtype=np.float32)  # unit rows
    # cosines: 0-1 .8, 0-2 0, 0-3 .6, 1-2 .6, 1-3 .96, 2-3 .8
    assert nearest_neighbours(emb, 2, block=3).tolist() == [[1, 3], [3, 0], [3, 1], [1, 2]]
    assert nearest_neighbours(emb, 10).shape == (4, 3)  # K is capped at the other images
    with pytest.raises(VlbertsError, match="at least 2 training images"):
        nearest_neighbours(emb[:1], 3)


def test_four_way_groups_are_what_they_claim(tiny_world, tiny_pretrained):
    store = RegionStore(tiny_world.store)
    train = read_retrieval_split(split_file(tiny_world), "train", store)
    assert len(train.captions) == 5 * len(train.image_ids) >= 100
    neighbours = nearest_neighbours(image_embeddings(store, train.image_ids, MAX_REGIONS), 3)
    tok = TextTokenizer.load(tiny_pretrained)
    encoder = PairEncoder([c.text for c in train.captions], store, tok, text_format="caption", max_text_len=32,
                          max_regions=MAX_REGIONS)
    data = RetrievalGroups(train, encoder, neighbours, seed=7)
    gold = train.caption_image()
    hard_seen = set()
    for epoch in range(2):
        for index in range(len(data)):
            captions, images = data.group(epoch, index)
            image = gold[index]
            assert (captions[POSITIVE], images[POSITIVE]) == (index, image)
            assert images[RANDOM_CAPTION] == image and gold[captions[RANDOM_CAPTION]] != image
            assert captions[RANDOM_IMAGE] == index and images[RANDOM_IMAGE] != image
            assert captions[HARD_IMAGE] == index and images[HARD_IMAGE] in neighbours[image]
            assert images[HARD_IMAGE] != image
            hard_seen.add((image, images[HARD_IMAGE]))
            assert data.group(epoch, index) == (captions, images)  # a pure function of (seed, epoch, index)
    assert len(hard_seen) > len(train.image_ids)  # the hard negative varies among the K neighbours
    assert [data.group(0, i) for i in range(20)] != [data.group(1, i) for i in range(20)]  # and over epochs
    # an item is the four pairs, in order, laid out as `[CLS] caption [SEP]` with the pair's image
    item = data[(1, 5)]
    captions, images = data.group(1, 5)
    assert len(item) == 4 and item[RANDOM_CAPTION]["ids"] == encoder.text[captions[RANDOM_CAPTION]][0]
    assert item[0]["ids"][0] == tok.cls_id and item[0]["ids"][-1] == tok.sep_id
    want = store.get(train.image_ids[images[HARD_IMAGE]]).features[:MAX_REGIONS]
    assert np.allclose(item[HARD_IMAGE]["regions"].feats, want)


# --------------------------------------------------------------------------- the score matrix by hand


@dataclass
class _Record:
    image_id: str
    image_w: int
    image_h: int
    boxes: np.ndarray
    features: np.ndarray
    obj_id: np.ndarray | None = None


class _ConstantImages:
    """Image j: one region whose 1-d feature is `values[j]`."""

    def __init__(self, values: dict[str, float]):
        self.values = values

    def __contains__(self, image_id: object) -> bool:
        return image_id in self.values

    def get(self, image_id: str) -> _Record:
        return _Record(image_id, 10, 10, np.array([[0, 0, 10, 10]], np.float32),
                       np.array([[self.values[image_id]]], np.float32))


def test_score_matrix_of_a_toy_scorer_ranks_by_hand(tiny_pretrained):
    """Toy score = -(caption tokens incl. [CLS]/[SEP] - the image's feature)^2, so every cell is known:

        images A=3 B=4 C=5    A    B    C   gold  t->i rank
        c0 "red"        (3)   0   -1   -4    A      0
        c1 "red red red"(5)  -4   -1    0    A      2
        c2 "red red"    (4)  -1    0   -1    B      0
        c3 "red red"    (4)  -1    0   -1    C      2  (A ties with C: ties go against the model)
    image->text: A best gold 0 (c0), no other caption >= 0: rank 0; B gold c2 = 0, c3 ties: rank 1;
    C gold c3 = -1, c1 (0) and c2 (-1, a tie) at least as high: rank 2."""
    tok = TextTokenizer.load(tiny_pretrained)
    assert len(tok.encode("red")) == 1
    split = RetrievalSplit(
        (RetrievalCaption(0, "A", "red"), RetrievalCaption(1, "A", "red red red"), RetrievalCaption(2, "B", "red red"),
         RetrievalCaption(3, "C", "red red")), ("A", "B", "C"))
    images = _ConstantImages({"A": 3.0, "B": 4.0, "C": 5.0})
    encoder = PairEncoder([c.text for c in split.captions], images, tok, text_format="caption", max_text_len=16,
                          max_regions=4, cache=True)

    def toy(batch):
        n = batch.inputs.attention_mask.sum(1).float()  # (N,)
        return -(n - batch.inputs.region_feats[:, 0, 0]) ** 2

    scores = score_matrix(toy, split, encoder, batch_size=5)  # batches cut across caption rows
    assert scores.tolist() == [[0, -1, -4], [-4, -1, 0], [-1, 0, -1], [-1, 0, -1]]
    m = retrieval_metrics(scores, split.caption_image())
    t, i = m["text_to_image"], m["image_to_text"]
    assert (t["r1"], t["r5"], t["medr"], t["meanr"], t["num_queries"]) == (50.0, 100.0, 2.0, 2.0, 4)
    assert (i["r1"], i["r5"], i["medr"], i["meanr"], i["num_queries"]) == (pytest.approx(100 / 3), 100.0, 2.0, 2.0, 3)
    assert m["rsum"] == pytest.approx(50 + 100 + 100 + 100 / 3 + 100 + 100)
    # chance: t->i K / 3 images (capped at 100); i->t at least one of g gold among the top K of 4 captions
    assert m["chance"]["text_to_image"] == {"r1": pytest.approx(100 / 3), "r5": 100.0, "r10": 100.0}
    # A has 2 gold captions (1 - 2/4 * 1 = ... P(top-1 wrong) = 2/4), B and C one each (P(top-1 wrong) = 3/4)
    assert m["chance"]["image_to_text"]["r1"] == pytest.approx(100 * (0.5 + 0.25 + 0.25) / 3)
    assert (m["num_captions"], m["num_images"]) == (4, 3)


def test_chance_text_to_image_is_k_over_images():
    from vlberts.recipes.finetune_retrieval import chance_recalls

    chance = chance_recalls(np.repeat(np.arange(100), 5), 100)
    assert chance["text_to_image"] == {"r1": 1.0, "r5": 5.0, "r10": 10.0}
    # one image's 5 gold captions among 500: P(top 1 gold) = 5/500
    assert chance["image_to_text"]["r1"] == pytest.approx(1.0)
    assert 5.0 < chance["image_to_text"]["r10"] < 10.0  # < 5 x 10 / 500 x 100 (the captions are drawn together)


# --------------------------------------------------------------------------- the model, every architecture


def _inputs(cfg, n: int, tags: bool) -> tuple[VLInputs, TagInputs | None]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, cfg.vocab_size, (n, 7), generator=g)
    ids[:, 0] = 2
    x = VLInputs(input_ids=ids, token_type_ids=torch.zeros_like(ids), attention_mask=torch.ones(n, 7, dtype=torch.bool),
                 region_feats=torch.randn(n, 5, cfg.visual_dim, generator=g),
                 region_boxes=torch.tensor([0.1, 0.1, 0.6, 0.7]).expand(n, 5, 4).clone(),
                 region_mask=torch.ones(n, 5, dtype=torch.bool))
    t = TagInputs(torch.randint(5, cfg.vocab_size, (n, 3), generator=g), torch.randint(0, 5, (n, 3), generator=g),
                  torch.ones(n, 3, dtype=torch.bool)) if tags else None
    return x, t


@pytest.mark.parametrize("name", ARCH_MODELS)
def test_scorer_shapes_and_match_head_start(name):
    """One score per pair; the 4-way loss is the softmax CE with the positive first; and a scorer started
    from a pre-training model's matching head scores exactly that head's log-odds of "match", in the
    architecture's label convention (VL-BERT and W-VisualBERT built with their optional heads)."""
    torch.manual_seed(0)
    extra = {"vlbert-tiny": {"with_match_head": True}, "wvisualbert-tiny": {"match_head": True, "variant": "S"}}
    cfg = model_config(name, vocab_size=60, **extra.get(name, {}))
    model = RetrievalModel(cfg).eval()
    x, tags = _inputs(cfg, 8, model.reads_tags)
    scores = model(x, tags)
    assert scores.shape == (8,)
    loss = four_way_loss(scores)
    want = torch.nn.functional.cross_entropy(scores.view(2, 4), torch.zeros(2, dtype=torch.long))
    assert torch.allclose(loss, want)

    pt = build_pretraining_model(cfg).eval()
    model.encoder.model.load_state_dict(getattr(pt, ENCODER_PREFIX[model.arch]).state_dict())
    head = pt.get_submodule(MATCH_HEADS[model.arch])
    model.init_from_match_head(head.weight, head.bias)
    logits = (pt(x, tags=tags) if tags is not None else pt(x)).match_logits  # (8, 2)
    m = 1 if model.arch in ("lxmert", "wvisualbert") else 0  # LXMERT's convention: index 1 = matched
    assert torch.allclose(model(x, tags), logits[:, m] - logits[:, 1 - m], atol=1e-5)


def test_the_four_way_loss_is_learnable(tiny_world, tiny_pretrained):
    """Gradients reach the encoder and the scorer: on one fixed batch of 4-way groups from the tiny world the
    pre-trained VisualBERT fits the positives, the loss falling from chance (ln 4) far below it. (Learning
    to match unseen pairs takes far longer: with fresh negatives each epoch the loss sits at ln 4 for a
    while first, the README's measurements.)"""
    from vlberts.data.retrieval import collate_groups
    from vlberts.recipes.finetune_retrieval import pair_encoder, pretrained_retrieval_model

    torch.manual_seed(0)
    store = RegionStore(tiny_world.store)
    train = read_retrieval_split(split_file(tiny_world), "train", store)
    model, _, head_init = pretrained_retrieval_model(tiny_pretrained)
    assert head_init == "match_head"
    tok = TextTokenizer.load(tiny_pretrained)
    encoder = pair_encoder(model, [c.text for c in train.captions], store, tok, max_text_len=32, max_regions=MAX_REGIONS)
    data = RetrievalGroups(train, encoder, nearest_neighbours(image_embeddings(store, train.image_ids, MAX_REGIONS), 3), 0)
    batch = collate_groups([data[(0, i)] for i in range(0, 40, 5)], tok.pad_id)  # 8 groups of 4 pairs
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(60):
        loss = four_way_loss(model(batch.inputs, batch.tags))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert abs(losses[0] - np.log(4)) < 0.05 and min(losses[-10:]) < 1.0, losses[::10]


# --------------------------------------------------------------------------- end to end


def test_finetune_retrieval_cli_writes_metrics_and_rescoring_agrees(tiny_world, tiny_pretrained, tmp_path, capsys):
    out = tmp_path / "ret"
    cfg = ret_cfg(tiny_world, tiny_pretrained, out)
    args = [f"--{k}={v}" for k, v in vars(cfg).items() if k in (
        "init", "out", "features", "split_file", "epochs", "batch_size", "lr", "max_regions", "hard_negatives",
        "eval_images", "device", "log_every")]
    code, stdout, err = run_cli(["finetune", "retrieval", *args], capsys)
    assert code == 0, err
    assert "text->image R@1/5/10" in stdout and "image->text" in stdout and "chance" in stdout

    m = json.loads((out / "metrics.json").read_text())
    assert m["mode"] == "fine-tuned" and m["head_init"] == "match_head" and m["hard_negatives"] == 3
    assert (m["num_images"], m["num_captions"]) == (4, 20) and m["skipped_records"]["total"] == 0
    assert m["chance"]["text_to_image"] == {"r1": 25.0, "r5": 100.0, "r10": 100.0}
    for d in ("text_to_image", "image_to_text"):
        assert set(m[d]) == {"r1", "r5", "r10", "medr", "meanr", "num_queries"}
    scores = np.load(out / "scores.npy")
    assert scores.shape == (20, 4) and scores.dtype == np.float32
    index = json.loads((out / "score_index.json").read_text())
    test = read_retrieval_split(split_file(tiny_world), "test").first_images(4)
    assert index["image_ids"] == list(test.image_ids)
    meta = json.loads((out / "model" / "config.json").read_text())
    assert meta["task"] == "retrieval" and meta["text_format"] == "second_segment"  # tiny_pretrained: VisualBERT

    log = MetricsLog.read(out / "metrics.jsonl")
    assert len(log) == m["steps"] and all(np.isfinite(r["loss"]) for r in log)

    # a saved matrix re-scores to the same metrics; the reloaded model scores the same matrix
    code, stdout, err = run_cli(["evaluate", "retrieval", "--scores", str(out / "scores.npy"), "--out",
                                 str(tmp_path / "re")], capsys)
    assert code == 0, err
    again = json.loads((tmp_path / "re" / "metrics.json").read_text())
    assert {k: again[k] for k in ("text_to_image", "image_to_text", "rsum", "chance")} == {
        k: m[k] for k in ("text_to_image", "image_to_text", "rsum", "chance")}
    code, _, err = run_cli(["evaluate", "retrieval", "--init", str(out / "model"), "--features", str(tiny_world.store),
                            "--split_file", str(split_file(tiny_world)), "--eval_images", "4", "--max_regions",
                            str(MAX_REGIONS), "--device", "cpu", "--out", str(tmp_path / "ev")], capsys)
    assert code == 0, err
    assert np.allclose(np.load(tmp_path / "ev" / "scores.npy"), scores, atol=1e-5)
    assert isinstance(load_retrieval_model(out / "model"), RetrievalModel)


def test_finetune_retrieval_resume_equals_uninterrupted(tiny_world, tiny_pretrained, tmp_path):
    kw = dict(epochs=0.25, batch_size=4, eval_images=3)
    finetune_retrieval(ret_cfg(tiny_world, tiny_pretrained, tmp_path / "ref", **kw))
    assert finetune_retrieval(ret_cfg(tiny_world, tiny_pretrained, tmp_path / "run", stop_after=4, **kw)) is None
    finetune_retrieval(ret_cfg(tiny_world, tiny_pretrained, tmp_path / "run", **kw))
    a, b = MetricsLog.read(tmp_path / "ref" / "metrics.jsonl"), MetricsLog.read(tmp_path / "run" / "metrics.jsonl")
    assert len(a) >= 6 and [r["loss"] for r in a] == [r["loss"] for r in b]
    assert np.array_equal(np.load(tmp_path / "ref" / "scores.npy"), np.load(tmp_path / "run" / "scores.npy"))


@pytest.fixture(scope="module")
def vlbert_pretrained(tiny_world, tmp_path_factory) -> Path:
    return pretrain(PretrainConfig(
        captions=str(tiny_world.captions_train), features=str(tiny_world.store),
        out=str(tmp_path_factory.mktemp("ret_vlbert_pt") / "run"), model="vlbert-tiny", vocab_size=200, steps=1,
        batch_size=4, ckpt_every=100, max_regions=MAX_REGIONS,
    ))


def test_zero_shot_cli_scores_with_the_pretrained_matching_head(tiny_world, tiny_pretrained, vlbert_pretrained,
                                                               tmp_path, capsys):
    common = ["--features", str(tiny_world.store), "--split_file", str(split_file(tiny_world)), "--eval_images", "3",
              "--max_regions", str(MAX_REGIONS), "--device", "cpu"]
    code, stdout, err = run_cli(["evaluate", "retrieval", "--init", str(tiny_pretrained), "--zero_shot", *common,
                                 "--out", str(tmp_path / "zs")], capsys)
    assert code == 0, err
    assert "text->image R@1/5/10" in stdout
    m = json.loads((tmp_path / "zs" / "metrics.json").read_text())
    assert m["mode"] == "zero-shot" and m["arch"] == "visualbert" and m["num_images"] == 3
    scores = np.load(tmp_path / "zs" / "scores.npy")  # (15, 3)

    # cell (c, i) is the pre-trained head's log-odds of "match" (VisualBERT: index 0 = IsNext) of
    # `[CLS] [SEP] caption [SEP]` with image i, computed here from the pre-training model itself
    pt, _, _ = load_pretraining_model(tiny_pretrained)
    pt.eval()
    tok = TextTokenizer.load(tiny_pretrained)
    test = read_retrieval_split(split_file(tiny_world), "test").first_images(3)
    store = RegionStore(tiny_world.store)
    enc = PairEncoder([c.text for c in test.captions], store, tok, text_format="second_segment", max_text_len=32,
                      max_regions=MAX_REGIONS)
    cells = [(0, 0), (0, 2), (7, 1), (14, 2)]
    batch = collate_pairs([enc.pair(c, test.image_ids[i]) for c, i in cells], tok.pad_id)
    assert batch.inputs.token_type_ids[0, :3].tolist() == [0, 0, 1]
    with torch.no_grad():
        logits = pt(batch.inputs).match_logits
    want = (logits[:, 0] - logits[:, 1]).numpy()
    assert np.allclose([scores[c, i] for c, i in cells], want, atol=1e-5)

    # VL-BERT pre-trains without a matching head: no zero-shot, a one-line reason
    code, _, err = run_cli(["evaluate", "retrieval", "--init", str(vlbert_pretrained), "--zero_shot", *common,
                            "--out", str(tmp_path / "zs2")], capsys)
    assert code == 2 and err.count("\n") == 1 and "no pre-trained matching head" in err and "VL-BERT" in err
    # a pre-training model without --zero_shot is not a retrieval model
    code, _, err = run_cli(["evaluate", "retrieval", "--init", str(tiny_pretrained), *common, "--out",
                            str(tmp_path / "zs3")], capsys)
    assert code == 2 and "not a fine-tuned retrieval model" in err and "--zero_shot" in err


# --------------------------------------------------------------------------- bad input


def test_bad_split_records_and_missing_images(tiny_world, tiny_pretrained, tmp_path, capsys):
    obj = json.loads(split_file(tiny_world).read_text())
    test_images = [k for k, im in enumerate(obj["images"]) if im["split"] == "test"]
    obj["images"][test_images[0]]["sentences"] = "not a list"
    obj["images"][test_images[1]]["cocoid"] = 987654  # an image the store does not hold
    bad_file = tmp_path / "dataset_bad.json"
    bad_file.write_text(json.dumps(obj))
    common = ["--init", str(tiny_pretrained), "--zero_shot", "--features", str(tiny_world.store), "--max_regions",
              str(MAX_REGIONS), "--eval_images", "3", "--device", "cpu", "--out", str(tmp_path / "o")]

    code, _, err = run_cli(["evaluate", "retrieval", "--split_file", str(bad_file), *common], capsys)
    assert code == 2 and err.count("\n") == 1
    assert str(bad_file) in err and f"images[{test_images[0]}]" in err and "sentences must be a list" in err

    obj["images"][test_images[0]]["sentences"] = []
    bad_file.write_text(json.dumps(obj))
    code, _, err = run_cli(["evaluate", "retrieval", "--split_file", str(bad_file), *common], capsys)
    assert code == 2 and "image has no sentences" in err

    good = tmp_path / "dataset_missing.json"  # only the missing image
    good.write_text(json.dumps({**obj, "images": [im for im in obj["images"] if im["sentences"]]}))
    with pytest.raises(VlbertsError, match=f"{good}: record 987654: image 987654 .* not in the region store"):
        read_retrieval_split(good, "test", RegionStore(tiny_world.store), BadRecords(skip=False), store_path=good)

    obj["images"][test_images[0]]["sentences"] = "not a list"
    bad_file.write_text(json.dumps(obj))

    code, _, err = run_cli(["evaluate", "retrieval", "--split_file", str(bad_file), "--skip_bad", *common], capsys)
    assert code == 0 and "skipped 2 bad records" in err
    m = json.loads((tmp_path / "o" / "metrics.json").read_text())
    assert m["skipped_records"]["total"] == 2 and m["skipped_records"]["missing features"] == 1
    assert m["skipped_records"]["malformed record"] == 1 and m["num_images"] == 3


def test_too_few_training_images_left_says_what_skip_bad_dropped(tiny_world, tiny_pretrained, tmp_path, capsys):
    """With every training image missing from the store, --skip_bad's count came after nothing: the error
    about the split was the only line."""
    obj = json.loads(split_file(tiny_world).read_text())
    for im in obj["images"]:
        if im["split"] == "train":
            im["cocoid"] += 500000
    bad_file = tmp_path / "dataset_bad.json"
    bad_file.write_text(json.dumps(obj))
    with pytest.raises(VlbertsError, match="split 'train' has 0 images with features"):
        finetune_retrieval(ret_cfg(tiny_world, tiny_pretrained, tmp_path / "r", split_file=str(bad_file), skip_bad=True))
    assert "warning: skipped " in capsys.readouterr().err


@pytest.mark.parametrize("kind, detail", [
    ("strings", "dtype <U1, expected real numbers"),
    ("complex", "dtype complex128, expected real numbers"),
    ("empty", "No data left in file"),  # EOFError, which click alone would turn into "Aborted!" exit 1
    ("npz", "an .npz archive"),
])
def test_saved_scores_not_a_numeric_matrix(kind, detail, tmp_path, capsys):
    """A scores.npy of strings, complex numbers, no bytes at all or an .npz archive: one line naming it, exit 2."""
    scores = tmp_path / "s" / "scores.npy"
    scores.parent.mkdir()
    if kind == "strings":
        np.save(scores, np.full((3, 2), "a"))
    elif kind == "complex":
        np.save(scores, np.zeros((3, 2), complex))
    elif kind == "empty":
        scores.write_bytes(b"")
    else:
        with open(scores, "wb") as f:
            np.savez(f, scores=np.zeros((3, 2), np.float32))
    (tmp_path / "s" / "score_index.json").write_text(json.dumps(
        {"caption_image_ids": ["1", "1", "2"], "image_ids": ["1", "2"]}))
    code, _, err = run_cli(["evaluate", "retrieval", "--scores", str(scores), "--out", str(tmp_path / "o")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.strip() == f"error: {scores}: not a .npy score matrix ({detail})"
    assert not (tmp_path / "o").exists()  # the run's record is written once the matrix is scored


def test_bad_saved_scores_and_missing_settings(tiny_world, tiny_pretrained, tmp_path, capsys):
    (tmp_path / "s").mkdir()
    np.save(tmp_path / "s" / "scores.npy", np.zeros((3, 2), np.float32))
    (tmp_path / "s" / "score_index.json").write_text(json.dumps(
        {"caption_image_ids": ["1", "1", "2"], "image_ids": ["1", "2", "3"]}))
    code, _, err = run_cli(["evaluate", "retrieval", "--scores", str(tmp_path / "s" / "scores.npy"), "--out",
                            str(tmp_path / "o")], capsys)
    assert code == 2 and "shape (3, 2)" in err and "(3, 3)" in err
    (tmp_path / "s" / "scores.npy").write_text("junk")
    code, _, err = run_cli(["evaluate", "retrieval", "--scores", str(tmp_path / "s" / "scores.npy"), "--out",
                            str(tmp_path / "o")], capsys)
    assert code == 2 and "not a .npy score matrix" in err
    code, _, err = run_cli(["finetune", "retrieval", f"--init={tiny_pretrained}", f"--features={tiny_world.store}",
                            f"--out={tmp_path / 'f'}"], capsys)
    assert code == 2 and "needs --split_file" in err
    code, _, err = run_cli(["finetune", "retrieval", f"--init={tiny_pretrained}", f"--features={tiny_world.store}",
                            f"--split_file={split_file(tiny_world)}", "--train_split=val", "--hard_negatives=0",
                            f"--out={tmp_path / 'f'}"], capsys)
    assert code == 2 and "--hard_negatives must be at least 1" in err
