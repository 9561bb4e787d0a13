"""NLVR2 end to end on the tiny world: the world's statements read back through the real-format reader and
their labels re-derived from scenes.jsonl by an independent parser, the exporter's determinism, the task
model for every architecture and both encodings, `finetune nlvr2` writing metrics / official predictions
that `evaluate nlvr2` scores the same, exact resume, and bad input as one-line errors (or counted with
--skip_bad)."""

from __future__ import annotations

import csv
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from vlberts.cli import main
from vlberts.data.nlvr2 import read_nlvr2
from vlberts.data.nlvr2_dataset import collate_nlvr2
from vlberts.data.regions import Regions
from vlberts.errors import VlbertsError
from vlberts.models.builders import model_config
from vlberts.models.encoders import VLEncoder, load_encoder_weights
from vlberts.models.nlvr2 import NLVR2Model
from vlberts.recipes.finetune_nlvr2 import FinetuneNLVR2Config, finetune_nlvr2, load_nlvr2_model
from vlberts.training.metrics import MetricsLog
from vlberts.world.nlvr2 import NLVR2Settings, generate_nlvr2, write_nlvr2
from vlberts.world.scene import read_scenes
from vlberts.world.vocab import NUMBER_WORDS, SHAPE_PLURALS

ARCHS = ("visualbert", "lxmert", "vilbert", "vlbert", "wvisualbert")
SPLITS = {"train": "train", "val": "dev", "test": "test1"}


def nlvr2_file(world, split: str) -> Path:
    return world.root / "nlvr2" / f"{split}.json"


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code, out, err


# --------------------------------------------------------------------------- an independent truth checker

_SINGULAR = {p: s for s, p in SHAPE_PLURALS.items()} | {"objects": "object"}


def _count(objects: list[dict], words: list[str]) -> int:
    """How many objects a phrase like 'large red circle' / 'red objects' / 'stars' describes."""
    *mods, noun = words
    noun = _SINGULAR.get(noun, noun)
    return sum(1 for o in objects
               if (noun == "object" or o["shape"] == noun) and all(m in (o["colour"], o["size"]) for m in mods))


def statement_truth(sentence: str, left: list[dict], right: list[dict]) -> bool:
    """The truth of a world statement, parsed from its words (not the generator's code)."""
    side = {"left": left, "right": right}
    num = {w: i for i, w in enumerate(NUMBER_WORDS)}
    s = sentence.rstrip(".")
    if m := re.fullmatch(r"The (left|right) image (?:shows|contains|has) exactly (\w+) (.+)", s):
        return _count(side[m[1]], m[3].split()) == num[m[2]]
    if m := re.fullmatch(r"The (left|right) image (?:shows|contains|has) at least (\w+) (.+)", s):
        return _count(side[m[1]], m[3].split()) >= num[m[2]]
    if m := re.fullmatch(r"The (left|right) image (?:shows|contains|has) an? (.+)", s):
        return _count(side[m[1]], m[2].split()) >= 1
    if m := re.fullmatch(r"Both images show the same number of (.+)", s):
        return _count(left, m[1].split()) == _count(right, m[1].split())
    if m := re.fullmatch(r"Both images show an? (.+)", s):
        return _count(left, m[1].split()) >= 1 and _count(right, m[1].split()) >= 1
    if m := re.fullmatch(r"Only one image shows an? (.+)", s):
        return (_count(left, m[1].split()) >= 1) != (_count(right, m[1].split()) >= 1)
    if m := re.fullmatch(r"Neither image shows an? (.+)", s):
        return _count(left, m[1].split()) + _count(right, m[1].split()) == 0
    if m := re.fullmatch(r"There are more (.+) in the (left|right) image than in the (left|right) image", s):
        return _count(side[m[2]], m[1].split()) > _count(side[m[3]], m[1].split())
    if m := re.fullmatch(r"The two images show exactly (\w+) (.+) in total", s):
        return _count(left, m[2].split()) + _count(right, m[2].split()) == num[m[1]]
    raise AssertionError(f"unparsed statement {sentence!r}")


def test_world_nlvr2_files_read_back_with_labels_true_of_the_scenes(tiny_world):
    scenes = {}
    for line in (tiny_world.root / "scenes.jsonl").read_text().splitlines():
        rec = json.loads(line)
        scenes[str(rec["image_id"])] = rec
    image_map = json.loads((tiny_world.root / "nlvr2" / "images.json").read_text())
    templates = Counter()
    for world_split, split in SPLITS.items():
        raw = [json.loads(line) for line in nlvr2_file(tiny_world, split).read_text().splitlines()]
        examples = read_nlvr2(nlvr2_file(tiny_world, split), require_labels=True)
        assert examples and len(examples) == len(raw)
        by_sentence = defaultdict(list)
        for ex, rec in zip(examples, raw):
            assert ex.identifier.startswith(f"{split}-") and rec["label"] in ("True", "False")
            assert ("directory" in rec) == (split == "train") and rec["writer"] == "world"
            left, right = (image_map[name] for name in ex.image_ids)
            assert left != right and {scenes[left]["split"], scenes[right]["split"]} == {world_split}
            assert rec["left_url"] == f"images/{scenes[left]['file_name']}"
            assert rec["right_url"] == f"images/{scenes[right]['file_name']}"
            # the label is what the scenes say (an independent reading of the sentence)
            assert statement_truth(ex.sentence, scenes[left]["objects"], scenes[right]["objects"]) is ex.label
            by_sentence[ex.sentence_key].append(ex)
            templates[rec["template"]] += 1
        for group in by_sentence.values():  # one sentence, 4 image pairs of its set, true of exactly 2
            assert len(group) == 4 and len({ex.sentence for ex in group}) == 1
            assert sorted(ex.label for ex in group) == [False, False, True, True]
            assert len({ex.image_ids for ex in group}) == 4
    assert len(templates) >= 6  # the statements are varied, not one template


def test_nlvr2_export_is_deterministic_and_seeded(tiny_world, tmp_path):
    scenes = read_scenes(tiny_world.root / "scenes.jsonl")
    write_nlvr2(tmp_path / "a", scenes, seed=5)
    for name in ("train.json", "dev.json", "test1.json", "images.json"):  # the world build wrote the same bytes
        assert (tmp_path / "a" / name).read_bytes() == (tiny_world.root / "nlvr2" / name).read_bytes()
    other = generate_nlvr2(scenes, seed=6)
    assert [st.sentence for st in other["train"]] != [st.sentence for st in generate_nlvr2(scenes, seed=5)["train"]]
    counts = write_nlvr2(tmp_path / "b", scenes, seed=5, settings=NLVR2Settings(rounds=1, sentences_per_set=2))
    assert counts["train"] == 48 // 8 * 2 * 4  # 6 sets of 8 train images x 2 sentences x 4 pairs


# --------------------------------------------------------------------------- the model

def _regions(rng: np.random.Generator, n: int, dim: int) -> Regions:
    boxes = np.sort(rng.random((n, 4)).astype(np.float32), axis=1)
    return Regions(rng.standard_normal((n, dim)).astype(np.float32), boxes, boxes * 128, None)


def _items(cfg, joint: bool, tags: bool = False) -> list[dict]:
    rng = np.random.default_rng(0)
    items = [{"ids": [2, 7, 8, 3], "label": 1, "index": 0, "joint": joint,
              "images": [_regions(rng, 3, cfg.visual_dim), _regions(rng, 5, cfg.visual_dim)]},
             {"ids": [2, 9, 3], "label": 0, "index": 1, "joint": joint,
              "images": [_regions(rng, 4, cfg.visual_dim), _regions(rng, 2, cfg.visual_dim)]}]
    if tags:
        for it in items:
            it["tags"] = [([10, 11], [0, 1]), ([12], [0])]
    return items


@pytest.mark.parametrize("arch", ARCHS)
def test_pair_encoding_classifies_the_two_encodings_concatenated(arch):
    """LXMERT App. B: logits = classifier([x0; x1]) with x_k the pooled output of (statement, image k)."""
    torch.manual_seed(0)
    cfg = model_config(f"{arch}-tiny")
    model = NLVR2Model(cfg, "auto" if arch != "visualbert" else "pair").eval()
    batch = collate_nlvr2(_items(cfg, joint=False, tags=model.reads_tags))
    assert batch.inputs.input_ids.shape[0] == 4 and batch.labels.tolist() == [1, 0]
    assert torch.equal(batch.inputs.input_ids[0], batch.inputs.input_ids[1])  # rows 2i, 2i+1: one statement
    logits = model(batch)
    assert logits.shape == (2, 2)
    pooled = model.encoder(batch.inputs, tags=batch.tags).pooled  # (4, P)
    want = model.classifier(torch.cat([pooled[0::2], pooled[1::2]], dim=1))
    assert torch.allclose(logits, want, atol=1e-6)
    assert next(iter(model.state_dict())).startswith("encoder.model.")  # a VLEncoder, as in every task model


def test_joint_encoding_gives_each_image_its_visual_segment():
    """VisualBERT App. B.3: one sequence, left regions segment 0, right regions segment 1; swapping the
    segments changes the output (they are read)."""
    torch.manual_seed(0)
    cfg = model_config("visualbert-tiny")
    model = NLVR2Model(cfg).eval()
    assert model.encoding == "joint"
    batch = collate_nlvr2(_items(cfg, joint=True))
    x = batch.inputs
    assert x.input_ids.shape[0] == 2 and x.region_feats.shape[1] == 8  # 3 + 5 regions in row 0
    assert x.region_type_ids[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert x.region_type_ids[1, :6].tolist() == [0, 0, 0, 0, 1, 1] and x.region_mask[1].sum() == 6
    logits = model(batch)
    assert logits.shape == (2, 2)
    x.region_type_ids = 1 - x.region_type_ids
    assert not torch.allclose(model(batch), logits)


@pytest.mark.parametrize("arch", ARCHS[1:])
def test_joint_encoding_is_refused_without_a_visual_segment_embedding(arch):
    with pytest.raises(VlbertsError, match=f"{arch} has no visual segment embedding"):
        NLVR2Model(model_config(f"{arch}-tiny"), "joint")


# --------------------------------------------------------------------------- fine-tuning end to end

def nlvr2_cfg(world, init: Path, out: Path, **kw) -> FinetuneNLVR2Config:
    base = dict(
        init=str(init), out=str(out), features=str(world.store), train_statements=str(nlvr2_file(world, "train")),
        eval_statements=str(nlvr2_file(world, "test1")), image_map=str(world.root / "nlvr2" / "images.json"),
        epochs=0.15, batch_size=16, lr=1e-3, log_every=1, ckpt_every=2, max_regions=12, device="cpu",
    )
    base.update(kw)
    return FinetuneNLVR2Config(**base)


def test_finetune_nlvr2_writes_model_predictions_and_metrics_that_evaluate_reproduces(
    tiny_world, tiny_pretrained, tmp_path, capsys
):
    out = tmp_path / "run"
    final = finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, out))
    m = json.loads((out / "metrics.json").read_text())
    test = read_nlvr2(nlvr2_file(tiny_world, "test1"), require_labels=True)
    train = read_nlvr2(nlvr2_file(tiny_world, "train"), require_labels=True)
    assert m["encoding"] == "joint" and m["train_examples"] == len(train) and m["num_examples"] == len(test)
    assert m["train_labels"] == {"True": len(train) // 2, "False": len(train) // 2}
    assert m["num_sentences"] == len(test) // 4 and m["skipped_records"]["total"] == 0
    # the majority baseline: the tie goes to True; every sentence has two False pairs -> consistency 0
    assert (m["majority_label"], m["majority_baseline"], m["majority_baseline_consistency"]) == ("True", 50.0, 0.0)
    rows = list(csv.reader((out / "predictions.csv").open()))
    assert [r[0] for r in rows] == [ex.identifier for ex in test] and {r[1] for r in rows} <= {"True", "False"}
    preds = {r[0]: r[1] == "True" for r in rows}
    assert m["accuracy"] == pytest.approx(100 * sum(preds[ex.identifier] == ex.label for ex in test) / len(test))

    code, stdout, _ = run_cli(["evaluate", "nlvr2", "--predictions", str(out / "predictions.csv"),
                               "--statements", str(nlvr2_file(tiny_world, "test1")),
                               "--train_statements", str(nlvr2_file(tiny_world, "train"))], capsys)
    assert code == 0 and json.loads(stdout) == {k: m[k] for k in json.loads(stdout)}

    # the saved model reloads (either way) and predicts the same
    model, _ = load_nlvr2_model(final)
    assert model.encoding == "joint" and json.loads((final / "config.json").read_text())["task"] == "nlvr2"
    enc = VLEncoder(model.cfg)
    load_encoder_weights(enc, final)  # the fine-tuned directory still holds the encoder under its name
    assert torch.equal(enc.model.embeddings.word_embeddings.weight, model.encoder.model.embeddings.word_embeddings.weight)


def test_finetune_nlvr2_resume_equals_uninterrupted(tiny_world, tiny_pretrained, tmp_path):
    kw = dict(encoding="pair", epochs=0.2)
    finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, tmp_path / "ref", **kw))
    assert finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, tmp_path / "run", stop_after=2, **kw)) is None
    finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, tmp_path / "run", **kw))
    a, b = MetricsLog.read(tmp_path / "ref" / "metrics.jsonl"), MetricsLog.read(tmp_path / "run" / "metrics.jsonl")
    assert len(a) >= 4 and [r["loss"] for r in a] == [r["loss"] for r in b]
    assert (tmp_path / "ref" / "predictions.csv").read_text() == (tmp_path / "run" / "predictions.csv").read_text()
    ref, run = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("ref", "run"))
    assert ref == run and ref["encoding"] == "pair"


# --------------------------------------------------------------------------- bad input

def _bad_train_file(world, tmp_path: Path) -> Path:
    lines = nlvr2_file(world, "train").read_text().splitlines()
    lines[3] = lines[3][: len(lines[3]) // 2]  # cut off mid-record
    rec = json.loads(lines[5])
    rec["label"] = "true"  # not the string "True"
    lines[5] = json.dumps(rec)
    path = tmp_path / "train.json"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_statements_and_missing_images_are_one_line_errors_or_counted(tiny_world, tiny_pretrained, tmp_path,
                                                                          capsys):
    bad_train = _bad_train_file(tiny_world, tmp_path)
    code, _, err = run_cli(["finetune", "nlvr2", f"--init={tiny_pretrained}", f"--features={tiny_world.store}",
                            f"--train_statements={bad_train}", f"--out={tmp_path / 'x'}"], capsys)
    assert code == 2 and err.startswith(f"error: {bad_train}: record line 4: malformed JSON line: ")
    assert len(err.strip().splitlines()) == 1

    # without the image map, the world's NLVR2 names are not store keys
    with pytest.raises(VlbertsError) as e:
        finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, tmp_path / "y", image_map=""))
    first = read_nlvr2(nlvr2_file(tiny_world, "train"))[0]
    assert str(e.value) == (f"{tiny_world.store}: record {first.identifier}: image {first.left_image_id} of "
                            f"{nlvr2_file(tiny_world, 'train')} not in store")

    # an image map that lacks one image, and a statement whose mapped image is not in the store
    image_map = json.loads((tiny_world.root / "nlvr2" / "images.json").read_text())
    test = read_nlvr2(nlvr2_file(tiny_world, "test1"))
    del image_map[test[0].left_image_id]
    image_map[test[5].right_image_id] = "999999"
    (tmp_path / "images.json").write_text(json.dumps(image_map))
    with pytest.raises(VlbertsError, match=rf"images\.json: record {test[0].identifier}: image "
                                           rf"{test[0].left_image_id} of .* is not in the image map"):
        finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, tmp_path / "z", image_map=str(tmp_path / "images.json")))

    # --skip_bad: all four dropped and counted, the run completes and says so
    out = tmp_path / "skip"
    finetune_nlvr2(nlvr2_cfg(tiny_world, tiny_pretrained, out, train_statements=str(bad_train), skip_bad=True,
                             image_map=str(tmp_path / "images.json"), epochs=0.05))
    m = json.loads((out / "metrics.json").read_text())
    # every statement of a set pairs with the same image pairs: the two broken pairs cost all their statements
    lost = [ex for ex in test if test[0].left_image_id in ex.image_ids or test[5].right_image_id in ex.image_ids]
    assert len(lost) == 2 * 6  # two pairs x the 6 sentences of their set
    assert m["skipped_records"]["malformed record"] == 2 and m["skipped_records"]["missing image"] == len(lost)
    assert m["skipped_records"]["total"] == 2 + len(lost)
    assert m["skipped_records"]["first"].startswith(f"{bad_train}: record line 4: malformed JSON line")
    train_lines = len(nlvr2_file(tiny_world, "train").read_text().splitlines())
    assert m["num_examples"] == len(test) - len(lost) and m["train_examples"] == train_lines - 2
    assert f"warning: skipped {2 + len(lost)} bad records (2 malformed record, {len(lost)} missing image)" in \
        capsys.readouterr().err


# --------------------------------------------------------------------------- evaluate nlvr2

def _fixture(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Two sentences of one set, each paired with two image pairs; the training file is 2 True : 1 False."""
    def row(identifier: str, label: str) -> dict:
        return {"identifier": identifier, "sentence": "s", "label": label, "left_url": "l", "right_url": "r"}

    dev = [row("dev-7-0-0", "True"), row("dev-7-1-0", "False"), row("dev-7-0-1", "False"), row("dev-7-1-1", "False")]
    train = [row("train-1-0-0", "False"), row("train-1-1-0", "True"), row("train-1-2-0", "True")]
    for name, rows in (("dev.json", dev), ("train.json", train)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    # right, right | wrong, right: accuracy 3/4, consistency 1/2 (sentence 0 all right, sentence 1 not)
    (tmp_path / "p.csv").write_text("dev-7-0-0,true\ndev-7-1-0,False\ndev-7-0-1,TRUE\ndev-7-1-1,False\n")
    return tmp_path / "p.csv", tmp_path / "dev.json", tmp_path / "train.json"


def test_evaluate_nlvr2_on_a_hand_written_fixture(tmp_path, capsys):
    preds, dev, train = _fixture(tmp_path)
    code, stdout, err = run_cli(["evaluate", "nlvr2", "--predictions", str(preds), "--statements", str(dev),
                                 "--train_statements", str(train), "--out", str(tmp_path / "eval")], capsys)
    m = json.loads(stdout)
    assert code == 0 and m == json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert (m["accuracy"], m["consistency"], m["num_examples"], m["num_sentences"]) == (75.0, 50.0, 4, 2)
    # always "True" (the training majority): right on 1 of 4, no sentence entirely right
    assert (m["majority_label"], m["majority_baseline"], m["majority_baseline_consistency"]) == ("True", 25.0, 0.0)


def test_evaluate_nlvr2_bad_predictions_exit_2_with_one_line(tmp_path, capsys):
    preds, dev, _ = _fixture(tmp_path)
    preds.write_text("dev-7-0-0,True\ndev-7-1-0,maybe\n")
    code, _, err = run_cli(["evaluate", "nlvr2", "--predictions", str(preds), "--statements", str(dev)], capsys)
    assert code == 2 and err.strip() == (f"error: {preds}: record line 2: expected 'identifier,True' or "
                                         "'identifier,False', got 'dev-7-1-0,maybe'")
    preds.write_text("dev-7-0-0,True\n")
    code, _, err = run_cli(["evaluate", "nlvr2", "--predictions", str(preds), "--statements", str(dev)], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "dev-7-1-0" in err
