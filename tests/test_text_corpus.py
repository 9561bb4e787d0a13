"""Text-only and image-only pre-training data (issue 3): the world's documents and image-only set, the
document reader, text-only samples mixed into batches at a ratio (VL-BERT §3.3) that train MLM and nothing
else, next-sentence prediction on documents (W-VisualBERT footnote 4), H-VisualBERT's image-only samples
(§4.3), exact resume with the extra streams, and every new objective's loss falling on the tiny world."""

from __future__ import annotations

from dataclasses import replace

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vlberts.data.coco import read_caption_refs
from vlberts.data.pretrain import CaptionPretrainData, ImageOnlyData, collate_pretrain
from vlberts.data.text_corpus import IMAGE_ONLY, PAIR, TEXT_ONLY, TextOnlyData, read_documents, read_image_ids
from vlberts.errors import VlbertsError
from vlberts.features.store import RegionStore
from vlberts.models.builders import build_pretraining_model, model_config
from vlberts.objectives.recipe import RECIPES, loss_counts, pretrain_losses, run_model
from vlberts.objectives.text import IS_NEXT, NOT_NEXT
from vlberts.recipes.pretrain import PretrainConfig, pretrain, region_setup
from vlberts.recipes.pretrain_mix import build_sources, reads_corpus
from vlberts.text.masking import IGNORE_INDEX
from vlberts.text.tokenizer import TextTokenizer
from vlberts.training.distributed import DistInfo
from vlberts.training.metrics import MetricsLog
from vlberts.world import documents as world_documents
from vlberts.world.build import build_world

from conftest import word_selection_counts


def _losses(record: dict) -> dict[str, float]:
    return {k[: -len("_loss")]: v for k, v in record.items() if k.endswith("_loss")}


def _cfg(world, out: Path, model: str, **kw) -> PretrainConfig:
    base = dict(
        captions=str(world.captions_train), features=str(world.store), out=str(out), model=model, vocab_size=200,
        steps=8, batch_size=8, lr=2e-3, warmup=0.1, log_every=1, ckpt_every=3, seed=3, max_text_len=40,
    )
    return PretrainConfig(**{**base, **kw})


# --------------------------------------------------------------------------- the world's files


def test_world_writes_documents_and_an_image_only_set(tiny_world):
    root = tiny_world.root
    docs = read_documents(root / "text" / "documents.txt")
    assert len(docs) == world_documents.documents_for(60) == world_documents.MIN_DOCUMENTS
    assert all(3 <= len(d) <= 6 for d in docs)
    assert docs[0] == world_documents.generate_document(5, 0)  # document d: its own seed stream (seed 5)
    captions = [c.text for c in read_caption_refs(str(tiny_world.captions_train))]
    sentences = [s for d in docs for s in d]
    # Longer, more complex sentences than the captions (VL-BERT §3.3's reason for the text corpus).
    assert np.mean([len(s.split()) for s in sentences]) > 1.5 * np.mean([len(c.split()) for c in captions])
    assert any(" , while " in s or " , whereas " in s or s.startswith(("although", "while", "as ")) for s in sentences)
    train = [json.loads(line) for line in (root / "scenes.jsonl").read_text().splitlines()]
    train_ids = [s["image_id"] for s in train if s["split"] == "train"]
    image_only = [int(i) for i in read_image_ids(root / "unpaired_images.txt")]
    assert image_only == sorted(image_only) and set(image_only) < set(train_ids)
    assert len(image_only) == round(0.2 * len(train_ids))
    files = json.loads((root / "world.json").read_text())["files"]
    assert "text/documents.txt" in files["text_documents"] and "unpaired_images.txt" in files["unpaired_images"]


def test_documents_leave_every_other_world_file_unchanged(tmp_path, monkeypatch):
    """The documents and the image-only set draw from their own seed streams: changing what they hold
    changes no byte of any other file but the world's vocabulary, which is read back from every text
    (world.language; here the word counts change)."""
    build_world(tmp_path / "a", n_images=12, seed=9, workers=1)
    monkeypatch.setattr(world_documents, "generate_document", lambda seed, d, cfg=None: ["something else ."])
    monkeypatch.setattr(world_documents, "unpaired_images", lambda ids, seed: ids[:1])
    build_world(tmp_path / "b", n_images=12, seed=9, workers=1)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*") if p.is_file())
    changed = [f for f in files if (tmp_path / "a" / f).read_bytes() != (tmp_path / "b" / f).read_bytes()]
    assert changed == [Path("text/documents.txt"), Path("unpaired_images.txt"), Path("vocab/vocab.txt")]


# --------------------------------------------------------------------------- readers


def test_document_reader_splits_on_blank_lines_and_names_bad_input(tmp_path):
    p = tmp_path / "docs.txt"
    p.write_text("first one .\nsecond one .\n\n\n  \nanother doc .\n\nlast .  \n", encoding="utf-8")
    assert read_documents(p) == [["first one .", "second one ."], ["another doc ."], ["last ."]]
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(VlbertsError, match=r"empty.txt: text corpus has no sentences"):
        read_documents(tmp_path / "empty.txt")
    (tmp_path / "bin.txt").write_bytes(b"a fine line\nbad \xff\xfe bytes\n")
    with pytest.raises(VlbertsError, match=r"bin.txt: record line 2: not a UTF-8 text file"):
        read_documents(tmp_path / "bin.txt")
    (tmp_path / "nul.txt").write_bytes(b"ok\n\nok\nx\x00y\n")
    with pytest.raises(VlbertsError, match=r"nul.txt: record line 4: not a UTF-8 text file"):
        read_documents(tmp_path / "nul.txt")
    with pytest.raises(VlbertsError, match=r"missing.txt: text corpus not found"):
        read_documents(tmp_path / "missing.txt")
    with pytest.raises(VlbertsError, match=r": is a directory; a text corpus is one file"):
        read_documents(tmp_path)
    # A captions JSON or JSON lines given as the corpus: its markup would be trained on as sentences
    (tmp_path / "train.jsonl").write_text('{"img_fn": "a.jpg", "question": ["Why"]}\n{"img_fn": "b.jpg"}\n')
    with pytest.raises(VlbertsError, match=r"train.jsonl: record line 1: its first line opens a JSON value"):
        read_documents(tmp_path / "train.jsonl")
    (tmp_path / "ids.txt").write_text("3\n\n7\n3\n")
    assert read_image_ids(tmp_path / "ids.txt") == ["3", "7"]
    (tmp_path / "bad_ids.txt").write_text("3\n7 8\n")
    with pytest.raises(VlbertsError, match=r"bad_ids.txt: record line 2: expected one image id per line"):
        read_image_ids(tmp_path / "bad_ids.txt")


def test_a_utf8_byte_order_mark_is_not_part_of_the_first_id_or_sentence(tmp_path):
    # Windows editors save UTF-8 with a BOM: it stayed on the first image id ("\ufeff3", in no store) and on
    # the first sentence of a corpus; a BOM later in a file is text, as UTF-8 has it
    ids = tmp_path / "ids.txt"
    ids.write_bytes(b"\xef\xbb\xbf3\r\n7\r\n")
    assert read_image_ids(ids) == ["3", "7"]
    docs = tmp_path / "docs.txt"
    docs.write_bytes("\ufefffirst one .\nsecond one .\n".encode("utf-8"))
    assert read_documents(docs) == [["first one .", "second one ."]]
    docs.write_bytes(b"\xef\xbb\xbf\n\nonly one .\n")  # a BOM on a line of its own: a blank line
    assert read_documents(docs) == [["only one ."]]


# --------------------------------------------------------------------------- mixing


def _setup(world, arch: str, model: str, weights: dict[str, float]):
    caps = read_caption_refs(str(world.captions_train))
    store = RegionStore(world.store)
    docs = read_documents(world.root / "text" / "documents.txt")
    tok = TextTokenizer.train([c.text for c in caps] + [s for d in docs for s in d] + list(store.metadata.classes),
                              vocab_size=200)
    recipe = RECIPES[arch]
    with_tags = arch == "wvisualbert"
    setup = region_setup(recipe, weights, store, tok, with_tags=with_tags)
    data = CaptionPretrainData(caps, store, tok, pairs=recipe.caption_pairs, max_text_len=40, seed=2,
                               mismatch_prob=0.5 if "match" in weights and not recipe.caption_pairs else 0.0,
                               region_setup=setup)
    return SimpleNamespace(caps=caps, store=store, docs=docs, tok=tok, recipe=recipe, setup=setup, data=data)


def _mix_cfg(**kw) -> SimpleNamespace:
    base = dict(batch_size=8, text_ratio=0.5, text_corpus="docs", unpaired_ratio=0.0, max_text_len=40, mlm_prob=0.15,
                seed=4, max_regions=36, num_workers=0, length_group=0)
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize("ratio, n_text", [(0.5, 4), (0.25, 2), (0.75, 6)])
def test_text_only_samples_fill_their_share_of_every_batch(tiny_world, ratio, n_text):
    s = _setup(tiny_world, "vlbert", "vlbert-tiny", {"mlm": 1.0, "roi_cls": 1.0})
    sources = build_sources(
        _mix_cfg(text_ratio=ratio), data=s.data, collate=collate_pretrain, start={}, tok=s.tok, store=s.store,
        documents=s.docs, feature_dim=s.store.feature_dim, weights={"mlm": 1.0, "roi_cls": 1.0}, unpaired=False,
        image_only=[], region_setup=s.setup, dist=DistInfo(),
    )
    for _ in range(3):
        batch, pos = sources.draw(None)
        assert batch.kind.tolist() == [PAIR] * (8 - n_text) + [TEXT_ONLY] * n_text
        text = batch.kind == TEXT_ONLY
        assert not batch.inputs.region_mask[text].any() and batch.inputs.region_mask[~text].any(1).all()
        assert not batch.regions.masked[text].any()  # no region targets on text-only rows
        assert (batch.mlm_labels[text] != IGNORE_INDEX).any()  # but MLM targets
    assert pos.to_dict()["offset"] == 3 * (8 - n_text) and pos.to_dict()["text"]["offset"] > 0


def test_w_visualbert_text_updates_read_the_corpus_or_the_captions(tiny_world):
    """W-VisualBERT §4.2.1 trains on captions and BookCorpus segments, each batch from one of them: a text
    update reads the corpus or the captions (text half only), and only that source's position moves."""
    weights = {"mlm": 1.0, "tag_mlm": 1.0}
    s = _setup(tiny_world, "wvisualbert", "wvisualbert-tiny", weights)
    sources = build_sources(
        _mix_cfg(), data=s.data, collate=collate_pretrain, start={}, tok=s.tok, store=s.store, documents=s.docs,
        feature_dim=s.store.feature_dim, weights=weights, unpaired=True, image_only=[], region_setup=s.setup,
        dist=DistInfo(),
    )
    corpus, pos = sources.draw("text", corpus=True)
    assert corpus.kind.tolist() == [TEXT_ONLY] * 8 and not corpus.inputs.region_mask.any()
    assert pos.to_dict()["offset"] == 0 and pos.to_dict()["text"]["offset"] > 0
    captions, pos2 = sources.draw("text", corpus=False)
    assert captions.kind is None and captions.inputs.region_mask.any(1).all()  # caption pairs: the update keeps the text
    assert pos2.to_dict()["offset"] == 8 and pos2.to_dict()["text"] == pos.to_dict()["text"]
    texts = {s.tok.decode(ids.tolist()) for ids in captions.inputs.input_ids}
    docs = {s.tok.decode(ids.tolist()) for ids in corpus.inputs.input_ids}
    assert not texts & docs


def test_the_corpus_share_of_w_visualbert_text_updates_is_stateless_in_the_step():
    cfg = SimpleNamespace(text_corpus="docs", corpus_share=0.5, seed=3)
    picks = [reads_corpus(cfg, step) for step in range(1000)]
    assert sum(picks) == 500  # exactly half of every block of two steps
    assert [reads_corpus(cfg, step) for step in reversed(range(1000))][::-1] == picks  # any order, as after a resume
    assert picks != [reads_corpus(SimpleNamespace(**{**vars(cfg), "seed": 4}), step) for step in range(1000)]
    assert all(reads_corpus(SimpleNamespace(**{**vars(cfg), "corpus_share": 1.0}), step) for step in range(50))
    assert not any(reads_corpus(SimpleNamespace(**{**vars(cfg), "corpus_share": 0.0}), step) for step in range(50))
    assert not any(reads_corpus(SimpleNamespace(**{**vars(cfg), "text_corpus": ""}), step) for step in range(50))


@pytest.mark.parametrize("whole_word", [True, False])
def test_text_only_samples_are_masked_by_the_captions_rule(tiny_world, whole_word):
    """VL-BERT masks whole words in its captions and in its text corpus alike (reference §3.1)."""
    s = _setup(tiny_world, "vlbert", "vlbert-tiny", {"mlm": 1.0, "roi_cls": 1.0})
    chars = {c for d in s.docs for t in d for c in t.lower() if not c.isspace()}
    tok = TextTokenizer.train([t for d in s.docs for t in d], vocab_size=5 + 2 * len(chars) + 10)  # words spelled out
    data = CaptionPretrainData(s.caps, s.store, tok, max_text_len=40, seed=2, region_setup=s.setup, whole_word=whole_word)
    sources = build_sources(
        _mix_cfg(), data=data, collate=collate_pretrain, start={}, tok=tok, store=s.store, documents=s.docs,
        feature_dim=s.store.feature_dim, weights={"mlm": 1.0, "roi_cls": 1.0}, unpaired=False, image_only=[],
        region_setup=s.setup, dist=DistInfo(),
    )
    partial = whole = 0
    for _ in range(10):
        batch, _ = sources.draw(None)
        for row in np.flatnonzero((batch.kind == TEXT_ONLY).numpy()):
            w, p = word_selection_counts(batch.inputs.input_ids[row].numpy(), batch.mlm_labels[row].numpy(), tok)
            whole, partial = whole + w, partial + p
    assert (partial == 0 and whole > 20) if whole_word else partial > 20


def _model(name: str, tok: TextTokenizer, store: RegionStore, **kw):
    torch.manual_seed(0)
    model = build_pretraining_model(model_config(name, vocab_size=tok.vocab_size, visual_dim=store.feature_dim, **kw))
    return model.eval()  # dropout off: the same rows give the same outputs in any batch


def test_a_text_only_sample_contributes_mlm_and_nothing_else(tiny_world):
    """Appending text-only samples to a batch leaves every image loss unchanged, and the MLM loss becomes
    the masked-token-weighted mean of the two parts (computed by hand from each part alone)."""
    cases = [
        ("vlbert", "vlbert-tiny", {"num_region_classes": None}, {"mlm": 1.0, "roi_cls": 1.0}),
        ("visualbert", "visualbert-tiny", {}, {"mlm": 1.0, "match": 1.0}),
        ("wvisualbert", "wvisualbert-h-tiny", {"num_object_labels": None, "num_attr_labels": None},
         {"mlm": 1.0, "tag_mlm": 1.0, "feat": 1.0, "obj": 1.0, "attr": 1.0, "match": 1.0}),
    ]
    for arch, name, heads, weights in cases:
        s = _setup(tiny_world, arch, name, weights)
        sizes = {"num_region_classes": s.store.info().get("num_classes_cls_prob"),
                 "num_object_labels": len(s.store.metadata.classes), "num_attr_labels": len(s.store.metadata.attributes)}
        model = _model(name, s.tok, s.store, **{k: int(sizes[k]) for k in heads})
        text = TextOnlyData(s.docs, s.tok, feature_dim=s.store.feature_dim, max_text_len=40, seed=1)
        pairs = [s.data[(0, i)] for i in range(5)]
        texts = [text[(0, i)] for i in range(3)]
        with torch.no_grad():
            out = {}
            for part, ex in (("pairs", pairs), ("text", texts), ("mixed", pairs + texts)):
                batch = collate_pretrain(ex)
                outp = run_model(s.recipe, model, batch)
                out[part] = (batch, pretrain_losses(s.recipe, outp, batch, {"mlm": 1.0} if part == "text" else weights))
        (bp, lp), (bt, lt), (bm, lm) = out["pairs"], out["text"], out["mixed"]
        for k in weights:
            if k != "mlm":
                assert lm[k].item() == pytest.approx(lp[k].item(), rel=1e-5, abs=1e-6), (arch, k)
        n_p, n_t = (loss_counts(b, ["mlm"])["mlm"] for b in (bp, bt))
        assert n_p > 0 and n_t > 0
        expected = (lp["mlm"].item() * n_p + lt["mlm"].item() * n_t) / (n_p + n_t)
        assert lm["mlm"].item() == pytest.approx(expected, rel=1e-5), arch
        assert loss_counts(bm, [k for k in weights if k != "mlm"]) == loss_counts(bp, [k for k in weights if k != "mlm"])
        # A run with --text_corpus keeps the two apart (VL-BERT's released mlm_loss_wvc + mlm_loss_aux): the
        # captions' mean is the pairs' alone, the documents' their own, each counted over its own words.
        apart = replace(s.recipe, text_mlm_apart=True)
        with torch.no_grad():
            la = pretrain_losses(apart, run_model(apart, model, bm), bm, {**weights, "mlm_text": 1.0})
            lpa = pretrain_losses(apart, run_model(apart, model, bp), bp, {"mlm": 1.0, "mlm_text": 1.0})
        assert la["mlm"].item() == pytest.approx(lp["mlm"].item(), rel=1e-5), arch
        assert la["mlm_text"].item() == pytest.approx(lt["mlm"].item(), rel=1e-5), arch
        assert loss_counts(bm, ["mlm", "mlm_text"], apart) == {"mlm": n_p, "mlm_text": n_t}
        assert lpa["mlm_text"].item() == 0.0 and loss_counts(bp, ["mlm", "mlm_text"], apart) == {"mlm": n_p, "mlm_text": 0}


def test_image_only_samples_train_the_image_objectives_only(tiny_world):
    """H-VisualBERT: an image-only sample has no text and no MLM target; it joins the image losses (they equal
    those of the pairs' and image-only rows taken as one set of images) and not the match loss."""
    weights = {"mlm": 1.0, "tag_mlm": 1.0, "feat": 1.0, "obj": 1.0, "attr": 1.0, "match": 1.0}
    s = _setup(tiny_world, "wvisualbert", "wvisualbert-h-tiny", weights)
    ids = read_image_ids(tiny_world.root / "unpaired_images.txt")
    only = ImageOnlyData(ids, s.store, s.tok, seed=1, feature_dim=s.store.feature_dim, region_setup=s.setup)
    ex = only[(0, 0)]
    assert len(ex["ids"]) == 0 and ex["kind"] == IMAGE_ONLY and len(ex["tag_ids"]) > 0 and ex["masked"].shape == (len(ex["regions"].feats),)
    model = _model("wvisualbert-h-tiny", s.tok, s.store, num_object_labels=len(s.store.metadata.classes),
                   num_attr_labels=len(s.store.metadata.attributes))
    pairs = [s.data[(0, i)] for i in range(4)]
    images = [only[(0, i)] for i in range(3)]
    with torch.no_grad():
        bp = collate_pretrain(pairs)
        bm = collate_pretrain(pairs + images)
        lp = pretrain_losses(s.recipe, run_model(s.recipe, model, bp), bp, weights)
        lm = pretrain_losses(s.recipe, run_model(s.recipe, model, bm), bm, weights)
        # The same rows all labelled pairs: the image losses see every row, the match loss too.
        ball = collate_pretrain(pairs + [{**e, "kind": PAIR} for e in images])
        la = pretrain_losses(s.recipe, run_model(s.recipe, model, ball), ball, weights)
    assert bm.kind.tolist() == [PAIR] * 4 + [IMAGE_ONLY] * 3
    assert lm["match"].item() == pytest.approx(lp["match"].item(), rel=1e-5)
    assert lm["mlm"].item() == pytest.approx(lp["mlm"].item(), rel=1e-5)
    for k in ("feat", "obj", "attr", "tag_mlm"):
        assert lm[k].item() == pytest.approx(la[k].item(), rel=1e-5), k
        # the image-only rows count: they add terms to each image loss (their data are seeded, so this does
        # not depend on the model's random weights, unlike comparing the loss values themselves)
        assert loss_counts(bm, [k])[k] > loss_counts(bp, [k])[k], k
    assert loss_counts(bm, ["match", "obj"]) == {"match": 4.0, "obj": 7.0 * bm.regions.masked.shape[1]}


# --------------------------------------------------------------------------- next-sentence prediction


def test_nsp_pairs_and_loss_by_hand(tiny_world):
    s = _setup(tiny_world, "visualbert", "visualbert-tiny", {"mlm": 1.0})
    data = TextOnlyData(s.docs, s.tok, feature_dim=s.store.feature_dim, max_text_len=200, mlm_prob=0.0, seed=3, nsp=True)
    assert len(data) == sum(len(d) for d in s.docs)
    sentences = [s.tok.encode(x) for d in s.docs for x in d]
    labels = []
    for i, (d, k) in enumerate(data.items):
        ex = data[(0, i)]
        ids, seg = list(ex["ids"]), list(ex["segments"])
        sep = ids.index(s.tok.sep_id)
        a, b = ids[1:sep], ids[sep + 1 : -1]
        assert a == s.tok.encode(s.docs[d][k]) and seg == [0] * (sep + 1) + [1] * (len(b) + 1)
        if ex["nsp"] == IS_NEXT:
            assert b == s.tok.encode(s.docs[d][k + 1])
        else:
            assert ex["nsp"] == NOT_NEXT and b in sentences and b not in [s.tok.encode(x) for x in s.docs[d]]
        labels.append(ex["nsp"])
        assert ex["kind"] == TEXT_ONLY and len(ex["regions"].feats) == 0
    assert 0.2 < np.mean(labels) < 0.9  # both kinds; the last sentence of a document is always NotNext

    # The loss through the matching head, in each architecture's convention, rows without a pair ignored.
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [5.0, -5.0]])
    batch = SimpleNamespace(nsp_labels=torch.tensor([IS_NEXT, NOT_NEXT, -1]), matched=torch.ones(3, dtype=torch.bool))
    out = SimpleNamespace(match_logits=logits)
    from vlberts.objectives.recipe import LOSSES

    # visualbert: index 0 = IsNext (BERT's NSP head): (log(1 + e^-2) + log(1 + e^-1)) / 2
    assert LOSSES["nsp"](RECIPES["visualbert"], out, batch).item() == pytest.approx(
        (math.log1p(math.exp(-2)) + math.log1p(math.exp(-1))) / 2, rel=1e-6)
    # wvisualbert (LXMERT's convention, index 1 = matched): (log(1 + e^2) + log(1 + e)) / 2
    assert LOSSES["nsp"](RECIPES["wvisualbert"], out, batch).item() == pytest.approx(
        (math.log1p(math.exp(2)) + math.log1p(math.exp(1))) / 2, rel=1e-6)


def test_nsp_objective_needs_a_corpus_and_a_head(tiny_world, tmp_path):
    docs = str(tiny_world.root / "text" / "documents.txt")
    with pytest.raises(VlbertsError, match="objective nsp needs text documents: --text_corpus=FILE"):
        pretrain(_cfg(tiny_world, tmp_path / "a", "visualbert-tiny", objectives="mlm=1,nsp=1"))
    with pytest.raises(VlbertsError, match="vlbert model has no head for objective 'nsp'; its objectives: mlm, roi_cls"):
        pretrain(_cfg(tiny_world, tmp_path / "b", "vlbert-tiny", objectives="mlm=1,nsp=1", text_corpus=docs))
    with pytest.raises(VlbertsError, match="wvisualbert model has no head for objective 'nsp'"):
        pretrain(_cfg(tiny_world, tmp_path / "c", "wvisualbert-tiny", objectives="mlm=1,nsp=1", text_corpus=docs))
    for model in ("lxmert-tiny", "vilbert-tiny"):
        with pytest.raises(VlbertsError, match="is two-stream; .* a text-only sample has none"):
            pretrain(_cfg(tiny_world, tmp_path / model, model, text_corpus=docs))
    with pytest.raises(VlbertsError, match="--unpaired_images is H-VisualBERT's"):
        pretrain(_cfg(tiny_world, tmp_path / "d", "vlbert-tiny", unpaired_images=str(tiny_world.root / "unpaired_images.txt")))
    with pytest.raises(VlbertsError, match="objective mlm_text is the masked words of the text-only samples that "
                                           "--text_corpus mixes into the caption batches: give --text_corpus"):
        pretrain(_cfg(tiny_world, tmp_path / "t", "vlbert-tiny", objectives="mlm=1,mlm_text=1"))
    with pytest.raises(VlbertsError, match="; W-VisualBERT's own text-only batches train mlm"):
        pretrain(_cfg(tiny_world, tmp_path / "u", "wvisualbert-tiny", objectives="mlm=1,mlm_text=1", text_corpus=docs))
    with pytest.raises(VlbertsError, match=r"--text_ratio must be in \(0, 1\)"):
        pretrain(_cfg(tiny_world, tmp_path / "e", "vlbert-tiny", text_corpus=docs, text_ratio=1.0))
    (tmp_path / "bin.txt").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(VlbertsError, match=r"bin.txt: record line 1: not a UTF-8 text file"):
        pretrain(_cfg(tiny_world, tmp_path / "f", "vlbert-tiny", text_corpus=str(tmp_path / "bin.txt")))
    # A blank line after every sentence: every document one sentence, every pair NotNext
    one_each = tmp_path / "spaced.txt"
    one_each.write_text("".join(f"sentence {i} .\n\n" for i in range(6)))
    with pytest.raises(VlbertsError, match=r"spaced.txt: objective nsp needs documents of two sentences or more, and "
                                           r"all 6 hold one \(a blank line after every sentence\?\)"):
        pretrain(_cfg(tiny_world, tmp_path / "g", "visualbert-tiny", objectives="mlm=1,nsp=1", text_corpus=str(one_each)))


# --------------------------------------------------------------------------- runs


RESUME_CASES = {
    "vlbert-text": ("vlbert-tiny", {"text_corpus": "docs"}),
    "w-nsp": ("wvisualbert-nsp-tiny", {"text_corpus": "docs"}),
    "h-both": ("wvisualbert-h-tiny", {"text_corpus": "docs", "unpaired_images": "images", "text_ratio": 0.25}),
}


def _paths(world, kw: dict) -> dict:
    where = {"docs": str(world.root / "text" / "documents.txt"), "images": str(world.root / "unpaired_images.txt")}
    return {k: where.get(v, v) if isinstance(v, str) else v for k, v in kw.items()}


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_interrupted_run_with_extra_sources_resumes_exactly(tiny_world, tmp_path, case):
    model, kw = RESUME_CASES[case]
    kw = _paths(tiny_world, kw)
    ref = tmp_path / "ref"
    pretrain(_cfg(tiny_world, ref, model, **kw))
    run = tmp_path / "run"
    assert pretrain(_cfg(tiny_world, run, model, stop_after=5, **kw)) is None  # last checkpoint: step 3
    # every extra source's position is saved beside the captions' epoch and offset
    data = json.loads((run / "checkpoints" / "step_00000003" / "state.json").read_text())["data"]
    assert {"epoch", "offset"} <= data.keys()
    assert ("text" in data) == ("text_corpus" in kw) and ("image_only" in data) == ("unpaired_images" in kw)
    assert pretrain(_cfg(tiny_world, run, model, **kw)) == run / "model"
    a, b = MetricsLog.read(ref / "metrics.jsonl"), MetricsLog.read(run / "metrics.jsonl")
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [_losses(r) for r in a] == [_losses(r) for r in b]
    assert len({r["mlm_loss"] for r in a if "mlm_loss" in r}) > 1
    if case == "w-nsp":  # W-VisualBERT's text-only updates read the documents, with NSP (footnote 4), or the captions
        assert {r["source"] for r in a} == {"text", "image"}
        text = [_losses(r) for r in a if r["source"] == "text"]
        # a caption has no next sentence: no NSP term, and no nsp_loss in its update's record
        assert {frozenset(r) for r in text} == {frozenset({"mlm", "nsp"}), frozenset({"mlm"})}
        assert all(r["nsp"] > 0 for r in text if "nsp" in r)


def test_drawing_ahead_in_a_thread_gives_the_same_run(tiny_world, tmp_path):
    """`--prefetch=N` draws N updates ahead in a thread (the default on a GPU; inline on a CPU). Forced here on
    the CPU, it gives the same run, interrupted (threaded) and resumed (inline) or not: H-VisualBERT (three
    sources; each update's source picked by the unpaired schedule) and VL-BERT's mixed batches, the latter
    with 2 DataLoader workers started from the feed's thread."""
    for case, workers in (("h-both", 0), ("vlbert-text", 2)):
        model, kw = RESUME_CASES[case]
        kw = _paths(tiny_world, kw)
        ref = tmp_path / case / "inline"
        pretrain(_cfg(tiny_world, ref, model, **kw))
        run = tmp_path / case / "threaded"
        assert pretrain(_cfg(tiny_world, run, model, stop_after=5, num_workers=workers, prefetch=2, **kw)) is None
        assert pretrain(_cfg(tiny_world, run, model, num_workers=workers, prefetch=0, **kw)) == run / "model"
        a, b = MetricsLog.read(ref / "metrics.jsonl"), MetricsLog.read(run / "metrics.jsonl")
        assert [(r.get("source"), _losses(r)) for r in a] == [(r.get("source"), _losses(r)) for r in b]
        wa, wb = (load_file(d / "model" / "model.safetensors") for d in (ref, run))
        assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
        again = tmp_path / case / "threaded-throughout"
        pretrain(_cfg(tiny_world, again, model, num_workers=workers, prefetch=3, **kw))
        wc = load_file(again / "model" / "model.safetensors")
        assert all(torch.equal(wa[k], wc[k]) for k in wa)


def _falls(values: list[float], factor: float = 0.95) -> bool:
    return np.mean(values[-5:]) < factor * np.mean(values[:5])


def test_losses_fall_with_text_only_samples_nsp_and_image_only_samples(tiny_world, tmp_path):
    docs = str(tiny_world.root / "text" / "documents.txt")
    # VL-BERT with the text corpus mixed in 1:1: MLM and masked RoI classification both fall. The tiny
    # world's detector scores are close to uniform, so the soft target's loss sits at its floor (their
    # entropy, ~ln 8) from the start; the hard target (their argmax) is what can be seen to fall here.
    out = tmp_path / "vlbert"
    pretrain(_cfg(tiny_world, out, "vlbert-tiny", steps=30, ckpt_every=100, text_corpus=docs, roi_target="hard"))
    log = MetricsLog.read(out / "metrics.jsonl")
    for k in ("mlm_loss", "mlm_text_loss", "roi_cls_loss"):  # the captions' masked words and the documents'
        assert _falls([r[k] for r in log]), (k, [r[k] for r in log])
    assert json.loads((out / "run_config.json").read_text())["objectives"] == ""  # mlm_text came with the corpus
    # NSP through VisualBERT's sentence-image head. On the world's documents a 2-layer model needs far more
    # than a short run to compare two sentences; on two-sentence documents the first thing it learns is that a
    # document's last sentence has no successor (always NotNext, as in BERT's data): the loss falls only if
    # each row's label reaches the head's output for that row.
    topics = ["red circle", "blue square", "green star", "white cross", "purple hexagon", "orange diamond",
              "cyan triangle", "yellow star"]
    corpus = tmp_path / "topics.txt"
    corpus.write_text("\n\n".join("\n".join(f"the {t} number {k} is here ." for k in range(2)) for t in topics) + "\n")
    out = tmp_path / "nsp"
    pretrain(_cfg(tiny_world, out, "visualbert-tiny", steps=40, ckpt_every=100, text_corpus=str(corpus),
                  objectives="mlm=1,nsp=1", batch_size=16))
    nsp = [r["nsp_loss"] for r in MetricsLog.read(out / "metrics.jsonl")]
    assert _falls(nsp, 0.9), nsp
    # H-VisualBERT with its image-only set: every objective falls (the image ones see the extra images).
    out = tmp_path / "h"
    pretrain(_cfg(tiny_world, out, "wvisualbert-h-tiny", steps=30, ckpt_every=100,
                  unpaired_images=str(tiny_world.root / "unpaired_images.txt")))
    log = MetricsLog.read(out / "metrics.jsonl")
    for k in ("mlm_loss", "tag_mlm_loss", "obj_loss", "attr_loss"):
        assert _falls([r[k] for r in log]), (k, [r[k] for r in log])
    assert all(math.isfinite(r["match_loss"]) and r["match_loss"] > 0 for r in log)


def test_cli_bad_text_corpus_is_one_line_naming_file_and_line(tiny_world, tmp_path):
    bad = tmp_path / "corpus.bin"
    bad.write_bytes(b"a sentence .\n\x89PNG\x00\xff\n")
    proc = subprocess.run(
        [str(Path(sys.executable).with_name("vlberts")), "pretrain", f"--captions={tiny_world.captions_train}",
         f"--features={tiny_world.store}", f"--out={tmp_path / 'run'}", "--model=vlbert-tiny", "--steps=1",
         f"--text_corpus={bad}"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]  # one line
    assert f"{bad}: record line 2: not a UTF-8 text file" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_text_files_read_whole_drop_a_byte_order_mark_too(tiny_world, tmp_path):
    """`io.read_text` (vocabularies, CoNLL-U parses, Flickr30K Entities files, predictions files), `read_json`
    and `iter_jsonl` drop a BOM opening the file as the line readers above do: it stuck to the first
    vocabulary entry ("\\ufeffcircle") and to the first CoNLL-U line, and JSON files with one were refused."""
    from vlberts.data.conllu import read_conllu
    from vlberts.features.importers import read_vocab

    vocab = tmp_path / "objects_vocab.txt"
    vocab.write_bytes("\ufeffcircle\nsquare\n".encode("utf-8"))
    assert read_vocab(vocab) == ["circle", "square"]
    parses = tiny_world.root / "parses" / "test.conllu"
    bom = tmp_path / "test.conllu"
    bom.write_bytes(b"\xef\xbb\xbf" + parses.read_bytes())
    assert read_conllu(bom) == read_conllu(parses)
    # JSON and JSON lines: RFC 8259 lets a reader ignore the mark (Python's json module refuses it)
    from vlberts.io import iter_jsonl, read_json

    obj = tmp_path / "a.json"
    obj.write_bytes(b"\xef\xbb\xbf" + json.dumps({"k": 1}).encode())
    assert read_json(obj) == {"k": 1}
    lines = tmp_path / "a.jsonl"
    lines.write_bytes(b"\xef\xbb\xbf" + b'{"k": 1}\n{"k": 2}\n')
    assert list(iter_jsonl(lines)) == [(1, {"k": 1}), (2, {"k": 2})]


def test_vlbert_with_its_relationship_head_trains_matching_and_nsp(tiny_world, tmp_path):
    """VL-BERT's ablated sentence-image relationship head (Table 4 (c)) is a named model: matching on the pairs
    and next-sentence prediction on a corpus train through it."""
    docs = str(tiny_world.root / "text" / "documents.txt")
    pretrain(_cfg(tiny_world, tmp_path / "m", "vlbert-match-tiny", objectives="mlm=1,roi_cls=1,match=1,nsp=1",
                  text_corpus=docs))
    logged = [json.loads(line) for line in (tmp_path / "m" / "metrics.jsonl").read_text().splitlines()]
    assert any("match_loss" in r for r in logged) and any(r.get("nsp_loss", 0) > 0 for r in logged)


def test_a_loss_with_nothing_to_score_in_an_update_is_not_logged_as_zero(tiny_world, tmp_path):
    """W-VisualBERT's text updates drawn from the captions hold no next-sentence pairs: their records leave
    nsp_loss out (it used to be 0.0, diluting any mean NSP curve); the corpus updates log it."""
    docs = str(tiny_world.root / "text" / "documents.txt")
    pretrain(_cfg(tiny_world, tmp_path / "w", "wvisualbert-nsp-tiny", text_corpus=docs, corpus_share=0.5, steps=16))
    text = [json.loads(line) for line in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    text = [r for r in text if r.get("source") == "text"]
    with_nsp = [r for r in text if "nsp_loss" in r]
    assert with_nsp and len(with_nsp) < len(text) and all(r["nsp_loss"] > 0 for r in with_nsp)
