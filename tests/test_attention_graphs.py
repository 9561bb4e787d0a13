"""LXMERT-style attention graphs (analysis/attention_graphs.py, recipes/analyze_attention_graphs.py):
the statistics on hand-made maps with known answers, the new AttentionMaps blocks, and the command on the
tiny world for several architectures."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import random_init_dir
from vlberts.analysis.attention_graphs import (
    TAGS,
    PositionalAccumulator,
    RelationAccumulator,
    TagShareAccumulator,
    positional_sums,
    region_objects,
    relation_hits,
    tag_share_sums,
    token_tags,
    top_edges,
)
from vlberts.cli import main
from vlberts.models.outputs import AttentionMaps


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """The installed entry point (`VlbertsError` -> one line, exit code 2): (exit code, stdout + stderr)."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    out, err = capsys.readouterr()
    return exc.value.code or 0, out + err


def shift_map(T: int, k: int) -> np.ndarray:
    """(T, T) one-hot attention from i to i + k (clipped to the sequence)."""
    a = np.zeros((T, T))
    for i in range(T):
        a[i, min(max(i + k, 0), T - 1)] = 1.0
    return a


def test_positional_sums_on_known_heads():
    T = 4
    # layer 0: head 0 points to the next token, head 1 is uniform; layer 1: head 0 previous, head 1 self
    attn = np.stack([np.stack([shift_map(T, 1), np.full((T, T), 1 / T)]),
                     np.stack([shift_map(T, -1), np.eye(T)])])  # (2, 2, 4, 4)
    nxt, prv, n = positional_sums(attn)
    assert n == 3
    np.testing.assert_allclose(nxt, [[3.0, 0.75], [0.0, 0.0]])
    np.testing.assert_allclose(prv, [[0.0, 0.75], [3.0, 0.0]])

    # a joint map's text block (rows summing to less than one) is renormalised over the words
    nxt_half, prv_half, _ = positional_sums(attn * 0.5)
    np.testing.assert_allclose(nxt_half, nxt)
    np.testing.assert_allclose(prv_half, prv)

    acc = PositionalAccumulator()
    acc.add(attn)
    acc.add(np.stack([np.stack([shift_map(2, 1), np.full((2, 2), 0.5)]),
                      np.stack([shift_map(2, -1), np.eye(2)])]))  # T = 2: one query each way
    r = acc.result()
    assert r["queries"] == 4
    assert r["uniform"] == pytest.approx((3 / 4 + 1 / 2) / 4)  # mean of 1/T over the queries
    np.testing.assert_allclose(r["next"], [[1.0, (0.75 + 0.5) / 4], [0.0, 0.0]])
    assert r["best_next"]["label"] == "1-1" and r["best_next"]["value"] == pytest.approx(1.0)
    assert r["best_previous"]["label"] == "2-1" and r["best_previous"]["value"] == pytest.approx(1.0)
    assert r["best_next"]["ratio_to_baseline"] == pytest.approx(1.0 / 0.3125)


def test_token_tags_give_subwords_their_word_tag():
    # [CLS] a dog ##gy runs [SEP]: words a (1), doggy (2, 3), runs (4)
    tags = token_tags([[1], [2, 3], [4]], ["DET", "NOUN", "VERB"], 6)
    assert tags == ["[CLS]", "DET", "NOUN", "NOUN", "VERB", "[SEP]"]
    assert token_tags([[1], []], ["DET", "weird"], 3) == ["[CLS]", "DET", "[SEP]"]


def test_tag_shares_normalise_each_region_row_over_the_text():
    tags = ["[CLS]", "DET", "NOUN", "[SEP]"]
    attn = np.zeros((2, 1, 2, 4))
    attn[0, 0, 0] = [0.1, 0.2, 0.6, 0.1]  # a two-stream row (sums to 1)
    attn[0, 0, 1] = [0.0, 0.1, 0.1, 0.0]  # a joint-map slice: 0.2 of the row on the text
    # layer 1 sees no regions: zero rows are left out
    s, rows, uniform = tag_share_sums(attn, tags)
    k = {t: TAGS.index(t) for t in tags}
    assert rows.tolist() == [[2], [0]]
    assert s[0, 0, k["NOUN"]] == pytest.approx(0.6 + 0.5)
    assert s[0, 0, k["DET"]] == pytest.approx(0.2 + 0.5)
    assert s[0, 0, k["[CLS]"]] == pytest.approx(0.1)
    assert uniform[k["NOUN"]] == pytest.approx(0.25)

    acc = TagShareAccumulator()
    acc.add(attn, tags)
    r = acc.result()["tags"]
    assert set(r) == set(tags)  # only tags that occur
    assert r["NOUN"]["token_share"] == pytest.approx(0.25)
    assert r["NOUN"]["per_head"] == [[pytest.approx(0.55)], [None]]
    assert r["NOUN"]["mean_share"] == pytest.approx(0.55)
    assert r["NOUN"]["ratio"] == pytest.approx(2.2)
    assert r["DET"]["mean_share"] == pytest.approx(0.35)
    assert sum(t["mean_share"] for t in r.values()) == pytest.approx(1.0)


def test_relation_hits_skip_own_object_and_count_chance():
    objects = np.array([0, 1, -1, 0])  # region 2 detects no object; region 3 is a duplicate of object 0
    related = np.array([[False, True], [True, False]])
    attn = np.zeros((1, 2, 4, 4))
    attn[0, 0, 0] = [0.5, 0.2, 0.1, 0.2]  # itself and its duplicate skipped, then region 1 (related): hit
    attn[0, 0, 1] = [0.1, 0.3, 0.6, 0.0]  # region 2: no object, miss
    attn[0, 0, 3] = [0.3, 0.1, 0.6, 0.0]  # miss
    attn[0, 1, 0] = [0.2, 0.1, 0.7, 0.0]  # miss
    attn[0, 1, 1] = [0.1, 0.4, 0.1, 0.4]  # itself skipped; region 3 (0.4, object 0, related): hit
    attn[0, 1, 3] = [0.9, 0.05, 0.05, 0.0]  # region 0 is its own object; then a tie 1 vs 2 -> region 1: hit
    hits, rows, chance, n = relation_hits(attn, objects, related)
    assert hits.tolist() == [[1, 2]] and rows.tolist() == [[3, 3]]
    # candidates: row 0 -> {1, 2} (1 related), row 1 -> {0, 2, 3} (2 related), row 3 -> {1, 2} (1 related)
    assert n == 3 and chance == pytest.approx(0.5 + 2 / 3 + 0.5)
    acc = RelationAccumulator()
    acc.add(attn, objects, related)
    r = acc.result()
    assert r["first_layer_per_head"] == [pytest.approx(1 / 3), pytest.approx(2 / 3)]
    assert r["chance"] == pytest.approx((0.5 + 2 / 3 + 0.5) / 3)
    assert r["first_layer_best"]["label"] == "1-2" and r["objects"] == 3


def test_region_objects_and_top_edges():
    regions = np.array([[0, 0, 10, 10], [50, 50, 60, 60], [0, 0, 9, 10]], dtype=float)
    objects = np.array([[0, 0, 10, 10], [100, 100, 120, 120]], dtype=float)
    assert region_objects(regions, objects).tolist() == [0, -1, 0]
    a = np.array([[0.9, 0.05, 0.05], [0.6, 0.3, 0.1], [0.2, 0.3, 0.5]])
    assert top_edges(a, 2) == [(0, 1, pytest.approx(0.6)), (1, 2, pytest.approx(0.3))]


def test_attention_maps_blocks_for_joint_and_two_stream():
    torch.manual_seed(0)
    m = torch.rand(1, 2, 5, 5)  # text at 0..2, regions at 3..4
    maps = AttentionMaps(joint=[torch.rand(1, 2, 3, 3), m], text_index=torch.arange(3),
                         region_index=torch.arange(3, 5), fusion_layer=1)
    assert torch.equal(maps.text_to_text()[1], m[:, :, :3, :3])
    assert torch.equal(maps.region_to_text()[1], m[:, :, 3:, :3])
    assert torch.equal(maps.region_to_region()[1], m[:, :, 3:, 3:])
    assert maps.region_to_region()[0].abs().sum() == 0  # before fusion: no regions
    v = torch.rand(1, 2, 4, 4)  # [IMG] + 3 regions
    v2t = torch.rand(1, 2, 4, 3)
    two = AttentionMaps(text_self=[torch.rand(1, 2, 3, 3)], vision_self=[v], vision_to_text=[v2t], vision_offset=1)
    assert torch.equal(two.region_to_region()[0], v[:, :, 1:, 1:])
    assert torch.equal(two.region_to_text()[0], v2t[:, :, 1:])


@pytest.mark.parametrize("arch", ["visualbert", "lxmert-tiny", "vilbert-tiny"])
def test_command_on_tiny_world(arch, tiny_world, tiny_pretrained, tmp_path, capsys):
    model = tiny_pretrained if arch == "visualbert" else random_init_dir(arch, tiny_pretrained, tmp_path / "init")
    out = tmp_path / "ag"
    code, output = run_cli(["analyze", "attention-graphs", f"--model={model}", f"--entities={tiny_world.entities}",
                            f"--features={tiny_world.store}", "--split=val", f"--out={out}", "--figures=2"], capsys)
    assert code == 0, output
    assert "next-token head" in output and "attention_graphs.json" in output
    data = json.loads((out / "attention_graphs.json").read_text())
    assert set(data["maps"]) == {"language", "objects", "cross", "cross_t2r"}
    if arch == "lxmert-tiny":
        assert data["maps"]["language"]["maps"] == "language encoder self-attention (1 layers)"
        assert data["maps"]["objects"]["maps"].startswith("object-relationship encoder")
        assert data["shapes"]["language"] == {"layers": 1, "heads": 2}
    elif arch == "vilbert-tiny":
        assert data["maps"]["cross"]["maps"].startswith("co-attention vision->text")
        assert data["shapes"]["objects"] == {"layers": 2, "heads": 2}
    else:
        assert data["maps"]["objects"]["maps"].startswith("joint self-attention maps of 2 layers")
    pos = data["positional"]
    L, H = data["shapes"]["language"]["layers"], data["shapes"]["language"]["heads"]
    assert np.asarray(pos["next"]).shape == (L, H)
    assert 0 < pos["uniform"] < 1
    assert all(0 <= v <= 1 for row in pos["next"] + pos["previous"] for v in row)
    assert pos["best_next"]["value"] == pytest.approx(np.max(pos["next"]))
    shares = data["pos_shares"]  # the world writes gold parses with UPOS
    assert shares is not None and data["skipped"] == {}
    assert {"NOUN", "DET", "[CLS]", "[SEP]"} <= set(shares["tags"])
    assert sum(t["token_share"] for t in shares["tags"].values()) == pytest.approx(1.0)
    assert sum(t["mean_share"] for t in shares["tags"].values()) == pytest.approx(1.0, abs=1e-4)
    rel = data["object_relations"]  # the world has scenes
    assert rel is not None and rel["objects"] > 0 and 0 < rel["chance"] < 1
    assert all(v is None or 0 <= v <= 1 for v in rel["first_layer_per_head"])
    figs = sorted(p.name for p in (out / "graphs").iterdir())
    assert len(figs) == 6 and all(p.stat().st_size > 5000 for p in (out / "graphs").iterdir())
    assert {f.rsplit("_", 1)[1] for f in figs} == {"language.png", "objects.png", "cross.png"}
    assert "Maps read" in (out / "attention_graphs.md").read_text()


def test_command_names_bad_caption_and_runs_without_parses(tiny_world, tiny_pretrained, tmp_path, capsys):
    base = ["analyze", "attention-graphs", f"--model={tiny_pretrained}", f"--entities={tiny_world.entities}",
            f"--features={tiny_world.store}", "--split=val"]
    code, output = run_cli([*base, f"--out={tmp_path / 'a'}", "--captions=999_9"], capsys)
    assert code == 2 and "999_9" in output and "Traceback" not in output
    code, output = run_cli([*base, f"--out={tmp_path / 'b'}", "--parses=none", "--scenes=none", "--figures=0"], capsys)
    assert code == 0, output
    data = json.loads((tmp_path / "b" / "attention_graphs.json").read_text())
    assert data["pos_shares"] is None and "no parses" in data["pos_note"]
    assert data["object_relations"] is None and "--scenes=none" in data["object_relations_note"]


def test_command_skip_bad_drops_an_image_missing_from_the_store(tiny_world, tiny_pretrained, tmp_path, capsys):
    import shutil

    ents = tmp_path / "ents"
    shutil.copytree(tiny_world.entities, ents)
    (ents / "val.txt").write_text("424242\n" + (ents / "val.txt").read_text())
    base = ["analyze", "attention-graphs", f"--model={tiny_pretrained}", f"--entities={ents}",
            f"--features={tiny_world.store}", "--split=val", "--figures=0"]
    code, output = run_cli([*base, f"--out={tmp_path / 'a'}"], capsys)
    assert code == 2 and "record 424242: image id 424242 of split val not in store" in output
    code, output = run_cli([*base, f"--out={tmp_path / 'b'}", "--skip_bad=true"], capsys)
    assert code == 0, output
    assert "warning: skipped 1 bad records (1 missing features)" in output
    data = json.loads((tmp_path / "b" / "attention_graphs.json").read_text())
    assert data["bad_records"]["missing features"] == 1 and data["captions"] > 0


def test_skipped_captions_are_named_with_their_file(tiny_world, tiny_pretrained, tmp_path, capsys):
    """A parse whose words differ from its caption is left out of the POS shares: the warning names the CoNLL-U
    file and the first such caption (it said only "skipped parse words differ: 1")."""
    import shutil

    root = tmp_path / "w"
    shutil.copytree(tiny_world.entities, root / "flickr30k_entities")
    shutil.copytree(tiny_world.entities.parent / "parses", root / "parses")
    conllu = root / "parses" / "val.conllu"
    lines = conllu.read_text().split("\n")
    sent = next(line.split("= ")[1] for line in lines if line.startswith("# sent_id"))
    k = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))  # its first word
    cols = lines[k].split("\t")
    lines[k] = "\t".join([cols[0], cols[1] + "x", *cols[2:]])
    conllu.write_text("\n".join(lines))
    code, output = run_cli(["analyze", "attention-graphs", f"--model={tiny_pretrained}",
                            f"--entities={root / 'flickr30k_entities'}", f"--features={tiny_world.store}",
                            "--split=val", f"--out={tmp_path / 'a'}", "--figures=0"], capsys)
    assert code == 0, output
    assert (f"warning: {conllu}: skipped 1 captions from the POS shares (parse words differ: 1 (first: caption "
            f"{sent}))") in output
    data = json.loads((tmp_path / "a" / "attention_graphs.json").read_text())
    assert data["skipped"] == {"parse words differ": 1} and data["skipped_first"] == {"parse words differ": f"caption {sent}"}
