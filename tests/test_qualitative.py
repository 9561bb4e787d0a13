"""Qualitative figures in the style of the paper's Figures 1 and 5 (issue 5, item 4): the choice of each
entity word's region on a hand-made record, the drawn PNG, and `analyze grounding` writing them."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
from PIL import Image

from vlberts.analysis.explorer import ExplorerEntity, ExplorerExample
from vlberts.analysis.grounding import GroundingOptions, GroundingResult
from vlberts.analysis.qualitative import (
    MISSING_GREY,
    TopRegion,
    decode_image,
    default_heads,
    pick_records,
    save_qualitative_figure,
    spread_layers,
    top_regions,
)
from vlberts.errors import VlbertsError
from vlberts.recipes.analyze_grounding import GroundingConfig, analyze_grounding

REGIONS = np.array([[0, 0, 60, 60], [40, 40, 120, 120], [70, 10, 125, 50]], dtype=np.float64)


def record(image: bytes | None = None) -> ExplorerExample:
    """ "a man holds a red ball": entities "a man" (words 0-1) and "a red ball" (words 3-5);
    (L=2, H=2, W=6, R=3) attention set by hand for the entities' first and last words."""
    attn = np.full((2, 2, 6, 3), 0.01)
    # word 1 "man" (last word of entity 0)
    attn[0, 0, 1] = [0.30, 0.10, 0.05]  # -> region 0
    attn[0, 1, 1] = [0.02, 0.02, 0.40]  # -> region 2
    attn[1, 0, 1] = [0.10, 0.50, 0.10]  # -> region 1
    attn[1, 1, 1] = [0.20, 0.20, 0.10]  # a tie: the lower region, 0
    # word 5 "ball" (last word of entity 1)
    attn[0, 0, 5] = [0.05, 0.25, 0.05]  # -> region 1
    attn[0, 1, 5] = [0.00, 0.00, 0.00]  # no attention on regions: left out
    attn[1, 0, 5] = [0.60, 0.10, 0.20]  # -> region 0
    attn[1, 1, 5] = [0.01, 0.02, 0.03]  # -> region 2
    # word 3 "a" (first word of entity 1), read with token="first"
    attn[1, 0, 3] = [0.01, 0.02, 0.35]
    entities = (ExplorerEntity(0, 2, np.array([[0, 0, 60, 60]]), "a man"),
                ExplorerEntity(3, 6, np.array([[40, 40, 120, 120]]), "a red ball"))
    return ExplorerExample("7_2", "7", ("a", "man", "holds", "a", "red", "ball"), attn, REGIONS, entities,
                           (128, 128), image)


def test_top_regions_picks_each_entity_words_most_attended_region():
    rec = record()
    assert top_regions(rec, 0, 0) == [TopRegion(1, 0, 0.30), TopRegion(5, 1, 0.25)]
    assert top_regions(rec, 0, 1) == [TopRegion(1, 2, 0.40)]  # "ball" gives the regions nothing
    assert top_regions(rec, 1, 0) == [TopRegion(1, 1, 0.50), TopRegion(5, 0, 0.60)]
    assert top_regions(rec, 1, 1) == [TopRegion(1, 0, 0.20), TopRegion(5, 2, 0.03)]
    # token="first" reads the entities' first words: "a" (word 0, uniform 0.01 -> region 0) and "a" (word 3)
    assert top_regions(rec, 1, 0, token="first") == [TopRegion(0, 0, 0.01), TopRegion(3, 2, 0.35)]


def test_top_regions_skips_words_cut_by_the_text_budget():
    rec = record()
    attn = rec.attn.copy()
    attn[:, :, 5] = np.nan  # "ball" lost its subwords
    cut = ExplorerExample(rec.caption_id, rec.image_id, rec.words, attn, rec.region_boxes, rec.entities, rec.image_size)
    assert top_regions(cut, 1, 0) == [TopRegion(1, 1, 0.50)]


def result(accuracy: np.ndarray) -> GroundingResult:
    L, H = accuracy.shape
    return GroundingResult(GroundingOptions(), 10, 5, accuracy, np.full((L, H), 0.3), np.ones((L, H), bool), 0.1, 0.9)


def test_default_heads_are_the_best_of_layers_spread_over_the_network():
    assert spread_layers(12) == [0, 4, 7, 11]
    assert spread_layers(2) == [0, 1]
    assert spread_layers(0) == []
    acc = np.zeros((12, 12))
    acc[np.arange(12), (np.arange(12) * 5) % 12] = 0.5  # layer l's best head: 5 l mod 12
    assert default_heads(result(acc)) == [(0, 0), (4, 8), (7, 11), (11, 7)]
    assert default_heads(result(np.array([[0.1, 0.2], [0.4, 0.3]]))) == [(0, 1), (1, 0)]


def test_pick_records():
    two = record()
    one = ExplorerExample("8_0", "8", two.words, two.attn, two.region_boxes, two.entities[:1], two.image_size)
    other = ExplorerExample("9_1", "9", two.words, two.attn, two.region_boxes, two.entities, two.image_size)
    assert pick_records([one, two, other], 1) == [two]
    assert pick_records([one, two, other], 5) == [two, other]
    assert pick_records([one, two, other], 0) == []
    assert pick_records([one, two, other], 3, ["9_1", "8_0", "nope"]) == [other, one]


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_the_figure_is_a_png_with_one_panel_per_head(tmp_path):
    rgb = np.zeros((128, 128, 3), np.uint8)
    rgb[:, :64] = (250, 250, 0)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    path = save_qualitative_figure(record(buf.getvalue()), [(0, 0), (1, 0), (1, 1)], tmp_path / "q" / "7_2.png", dpi=100)
    data = path.read_bytes()
    width, height = png_size(data)
    assert (width, height) == (960, 410)  # 3 panels of 3.2 in, 3.2 + 0.9 in high, at 100 dpi
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert ((pixels == (250, 250, 0)).all(-1)).sum() > 1000  # the image is drawn
    assert ((np.abs(pixels.astype(int) - (0xD6, 0x27, 0x28)).sum(-1) < 30)).sum() > 100  # entity 0's red boxes
    # A JPEG (Flickr30K's images are JPEGs; matplotlib's own reader takes PNG only) is drawn too
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="JPEG", quality=95)
    jpeg = save_qualitative_figure(record(buf.getvalue()), [(0, 0)], tmp_path / "jpeg.png", dpi=100)
    pixels = np.asarray(Image.open(jpeg).convert("RGB")).astype(int)
    assert ((np.abs(pixels - (250, 250, 0)).sum(-1) < 20)).sum() > 1000
    # Without image bytes: a grey canvas, still a figure.
    grey = save_qualitative_figure(record(), [(0, 1)], tmp_path / "grey.png", dpi=100)
    assert png_size(grey.read_bytes()) == (320, 410)
    with pytest.raises(ValueError, match="outside"):
        save_qualitative_figure(record(), [(2, 0)], tmp_path / "bad.png")


def test_dollar_signs_in_a_caption_are_text_not_mathtext(tmp_path):
    """"$5 ... $10": two dollar signs would start and end matplotlib's mathtext, which fails to parse this
    one and stopped the run; the figures draw the text as it is."""
    from dataclasses import replace

    rec = replace(record(), words=("a", "$5", "holds", "50%", "off", "$10"))
    path = save_qualitative_figure(rec, [(0, 0), (1, 0)], tmp_path / "dollars.png", dpi=60)
    assert png_size(path.read_bytes())[0] == 384


def test_an_image_file_that_cannot_be_decoded_is_drawn_grey_with_a_warning(capsys):
    canvas = decode_image(b"not an image", (30, 20), "caption 7_2")
    assert canvas.shape == (20, 30, 3) and (canvas == MISSING_GREY).all()
    assert capsys.readouterr().err.startswith("warning: caption 7_2: the image file could not be decoded (")


def test_analyze_grounding_writes_qualitative_figures(tiny_world, tiny_pretrained, tmp_path):
    common = dict(model=str(tiny_pretrained), entities=str(tiny_world.entities), features=str(tiny_world.store), split="test")
    rep = analyze_grounding(GroundingConfig(out=str(tmp_path / "g"), explorer_examples=0, qualitative=2, **common))
    files = sorted((tmp_path / "g" / "qualitative").glob("*.png"))
    assert rep.paths["qualitative"] == tmp_path / "g" / "qualitative" and len(files) == 2
    assert "explorer" not in rep.paths
    for f in files:
        width, height = png_size(f.read_bytes())
        assert (width, height) == (960, 615)  # 2 layers of visualbert-tiny: 2 panels at 150 dpi
    chosen = files[1].stem
    analyze_grounding(GroundingConfig(out=str(tmp_path / "c"), qualitative_captions=chosen, **common))
    assert [f.stem for f in (tmp_path / "c" / "qualitative").glob("*.png")] == [chosen]
    none = analyze_grounding(GroundingConfig(out=str(tmp_path / "n"), qualitative=0, explorer_examples=0, **common))
    assert "qualitative" not in none.paths and not (tmp_path / "n" / "qualitative").exists()
    # The same OUT again, writing neither: the earlier run's figures and page do not stay behind as if this run's
    (tmp_path / "g" / "explorer.html").write_text("<html></html>")
    analyze_grounding(GroundingConfig(out=str(tmp_path / "g"), qualitative=0, explorer_examples=0, parses="none", **common))
    assert not list((tmp_path / "g" / "qualitative").glob("*.png")) and not (tmp_path / "g" / "explorer.html").exists()
    assert not (tmp_path / "g" / "syntactic_grounding.png").exists() and (tmp_path / "g" / "grounding.json").is_file()
    with pytest.raises(VlbertsError, match="not in the analysed"):
        analyze_grounding(GroundingConfig(out=str(tmp_path / "x"), qualitative_captions="999999_0", **common))
