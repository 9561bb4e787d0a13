"""The attention explorer: one self-contained HTML page per grounding run (issue 5, item 5).

A user picks an example caption, a layer and a head, clicks a word, and sees that word's attention to
the image's regions drawn as boxes whose opacity and width follow the weight, with the gold boxes of the
entity the word belongs to in another colour (the per-head reading of §3.1, Figure 3, one word at a time).

The page needs no network and works from file://: the data is one JSON document inside
`<script type="application/json">` (`<`, `>`, `&` written as \\u003c, \\u003e, \\u0026, so no caption can
close the script), every word and id is rendered with `textContent`, images are data: URIs, and the
script is plain JavaScript. Its size is bounded: at most `max_examples` captions, attention quantised to
uint8 (base64).

State for tests sits in DOM attributes: the root `#explorer` carries `data-example`, `data-layer`,
`data-head` (1-based, as shown) and `data-word` (0-based word index, "" for none); the drawn region boxes
are SVG `<rect class="attn" data-region data-weight>` (weight: the word's attention to the region divided
by its attention to all regions, 3 decimals), the gold boxes `<rect class="gold">`.

Letters in shape comments: L layers, H heads, W words, R regions, K gold boxes.
"""

from __future__ import annotations

import base64
import html
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vlberts.analysis.entities import EntityCaption
from vlberts.analysis.grounding import GroundingInput, TokenChoice, token_positions
from vlberts.io import atomic_open

DEFAULT_MAX_EXAMPLES = 25
_IMAGE_TYPES = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg"}


@dataclass(frozen=True)
class ExplorerEntity:
    """A grounded phrase of the caption: its words [first, end) and its (K, 4) xyxy pixel gold boxes."""

    first_word: int
    end_word: int
    gold_boxes: np.ndarray  # (K, 4)
    phrase: str = ""


@dataclass(frozen=True)
class ExplorerExample:
    """One caption of the page.

    attn: (L, H, W, R) attention from each word to each region, read from the word's subword(s) as
        `GroundingOptions.token` reads an entity's (one word: "last"/"first" subword, or the mean of its
        subwords); NaN rows for words cut off by the text budget.
    region_boxes: (R, 4) xyxy pixels in the frame of `image_size` (width, height).
    image: the image file's bytes (PNG or JPEG), or None when it is not available.
    """

    caption_id: str
    image_id: str
    words: tuple[str, ...]
    attn: np.ndarray  # (L, H, W, R)
    region_boxes: np.ndarray  # (R, 4)
    entities: tuple[ExplorerEntity, ...]
    image_size: tuple[int, int]  # (width, height)
    image: bytes | None = None


@dataclass(frozen=True)
class ExplorerInfo:
    """What the page says about the model: its grid and which attention maps were read."""

    layers: int
    heads: int
    maps: str = ""  # `AttentionMaps.describe()`
    token: str = "last"  # the subword choice the word rows were read with
    title: str = "Attention explorer"


def word_attention(attn: np.ndarray, word_tokens: Sequence[Sequence[int]], token: TokenChoice) -> np.ndarray:
    """(L, H, T, R) token attention -> (L, H, W, R) per-word attention (NaN for words without a token)."""
    L, H, _, R = attn.shape
    out = np.full((L, H, len(word_tokens), R), np.nan, dtype=np.float64)
    for w, positions in enumerate(word_tokens):
        if positions:
            out[:, :, w, :] = attn[:, :, token_positions([positions], token), :].mean(axis=2)
    return out


def explorer_example(cap: EntityCaption, inp: GroundingInput, token: TokenChoice, image_size: tuple[int, int],
                     image: bytes | None = None) -> ExplorerExample:
    """The page's record of one analysed caption, from what the grounding driver yields for it."""
    entities = tuple(ExplorerEntity(first, end, e.gold_boxes, e.phrase)
                     for e, (first, end) in zip(cap.entities, cap.entity_words))
    return ExplorerExample(cap.caption_id, cap.image_id, tuple(cap.words),
                           word_attention(np.asarray(inp.attn, dtype=np.float64), cap.word_tokens, token),
                           np.asarray(inp.region_boxes, dtype=np.float64), entities, image_size, image)


def _uint8_b64(x: np.ndarray) -> str:
    """[0, 1] floats -> uint8 (round(255 x)) bytes in C order, base64."""
    q = np.rint(np.clip(np.nan_to_num(x, nan=0.0), 0.0, 1.0) * 255.0).astype(np.uint8)
    return base64.b64encode(q.tobytes()).decode("ascii")


def _data_uri(image: bytes | None) -> str | None:
    if image is None:
        return None
    for magic, mime in _IMAGE_TYPES.items():
        if image.startswith(magic):
            return f"data:{mime};base64," + base64.b64encode(image).decode("ascii")
    return None  # not an image type a browser is sure to draw: treated as missing


def _boxes(b: np.ndarray) -> list[list[float]]:
    return [[round(float(v), 1) for v in row] for row in np.asarray(b, dtype=np.float64).reshape(-1, 4)]


def _example_json(ex: ExplorerExample, info: ExplorerInfo) -> dict[str, Any]:
    attn = np.asarray(ex.attn, dtype=np.float64)
    L, H, W, R = attn.shape
    if (L, H) != (info.layers, info.heads) or W != len(ex.words) or R != len(ex.region_boxes):
        raise ValueError(f"example {ex.caption_id!r}: attn {attn.shape} does not match {info.layers} layers x "
                         f"{info.heads} heads, {len(ex.words)} words, {len(ex.region_boxes)} regions")
    cut = np.isnan(attn).any(axis=(0, 1, 3))  # (W,) words without a token
    attn = np.nan_to_num(attn, nan=0.0)
    mass = attn.sum(axis=-1)  # (L, H, W) the word's attention to all regions
    # Normalised over regions (what the boxes show); a word with no attention to regions gets zeros.
    share = np.divide(attn, mass[..., None], out=np.zeros_like(attn), where=mass[..., None] > 0)  # (L, H, W, R)
    return {
        "caption_id": str(ex.caption_id),
        "image_id": str(ex.image_id),
        "words": [str(w) for w in ex.words],
        "cut": [int(i) for i in np.flatnonzero(cut)],
        "share": _uint8_b64(share),  # (L, H, W, R) uint8
        "mass": _uint8_b64(mass),  # (L, H, W) uint8
        "regions": _boxes(ex.region_boxes),
        "entities": [{"first": int(e.first_word), "end": int(e.end_word), "phrase": str(e.phrase),
                      "gold": _boxes(e.gold_boxes)} for e in ex.entities],
        "size": [int(ex.image_size[0]), int(ex.image_size[1])],
        "image": _data_uri(ex.image),
    }


def _script_json(data: Any) -> str:
    """JSON safe inside a <script> element: no `<`, `>` or `&` survives (they become \\u003c ...)."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def explorer_html(examples: Sequence[ExplorerExample], info: ExplorerInfo,
                  max_examples: int = DEFAULT_MAX_EXAMPLES) -> str:
    """The self-contained page (module docstring) for the first `max_examples` examples."""
    data = {
        "layers": int(info.layers),
        "heads": int(info.heads),
        "maps": str(info.maps),
        "token": str(info.token),
        "examples": [_example_json(ex, info) for ex in list(examples)[:max_examples]],
    }
    fill = {"__TITLE__": html.escape(info.title), "__DATA__": _script_json(data)}
    return re.sub("__TITLE__|__DATA__", lambda m: fill[m.group(0)], _PAGE)  # one pass: no text is read twice


def write_explorer(path: str | Path, examples: Sequence[ExplorerExample], info: ExplorerInfo,
                   max_examples: int = DEFAULT_MAX_EXAMPLES) -> Path:
    """Write `explorer_html(...)` to `path` atomically; returns the path."""
    path = Path(path)
    with atomic_open(path) as f:
        f.write(explorer_html(examples, info, max_examples))
    return path


# The page. `__DATA__` is replaced by `_script_json`, `__TITLE__` by escaped text; nothing else is
# substituted, and the script builds every text node with textContent.
_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>__TITLE__</title>
<style>
body { font-family: sans-serif; margin: 1.5em; color: #222; }
#controls label { margin-right: 1em; }
#words { margin: 1em 0; line-height: 2.2; }
#words button { font-size: 1em; margin: 0 .15em; border: 1px solid #bbb; background: #f6f6f6; border-radius: 3px; cursor: pointer; }
#words button.entity { border-color: #1a7f37; border-bottom-width: 3px; }
#words button.selected { background: #ffd9a8; border-color: #d9480f; }
#words button.cut { color: #999; cursor: default; }
svg { border: 1px solid #999; background: #888; }
rect.attn { fill: none; stroke: #e8590c; }
rect.gold { fill: none; stroke: #2f9e44; stroke-width: 2; stroke-dasharray: 5 3; }
#missing { color: #a00; }
.note { color: #666; font-size: .9em; }
</style>
</head>
<body>
<div id="explorer" data-example="" data-layer="" data-head="" data-word="">
<h1>__TITLE__</h1>
<p class="note" id="about"></p>
<div id="controls">
<label>example <select id="example"></select></label>
<label>layer <select id="layer"></select></label>
<label>head <select id="head"></select></label>
</div>
<p id="caption-id" class="note"></p>
<div id="words"></div>
<p id="missing" hidden>image not available</p>
<svg id="canvas" width="384" height="384"></svg>
<p id="top"></p>
<p class="note">Orange boxes: the clicked word's attention to each region, normalised over the regions
(opacity and width follow the weight; the strongest region is opaque). Green dashed boxes: the gold boxes of
the entity the word belongs to.</p>
</div>
<script type="application/json" id="explorer-data">__DATA__</script>
<script>
"use strict";
(function () {
  var data = JSON.parse(document.getElementById("explorer-data").textContent);
  var root = document.getElementById("explorer");
  var svg = document.getElementById("canvas");
  var NS = svg.namespaceURI;
  var sel = {example: document.getElementById("example"), layer: document.getElementById("layer"),
             head: document.getElementById("head")};
  var cache = {};

  function bytes(b64) {
    var s = atob(b64), out = new Uint8Array(s.length);
    for (var i = 0; i < s.length; i++) out[i] = s.charCodeAt(i);
    return out;
  }
  function decoded(i) {
    if (!cache[i]) {
      var ex = data.examples[i];
      cache[i] = {share: bytes(ex.share), mass: bytes(ex.mass)};
    }
    return cache[i];
  }
  function option(select, value, text) {
    var o = document.createElement("option");
    o.value = String(value);
    o.textContent = text;
    select.appendChild(o);
  }
  function svgEl(name, attrs) {
    var el = document.createElementNS(NS, name);
    for (var k in attrs) el.setAttribute(k, String(attrs[k]));
    return el;
  }
  function boxRect(b, cls) {
    return svgEl("rect", {"class": cls, x: b[0], y: b[1], width: Math.max(b[2] - b[0], 0), height: Math.max(b[3] - b[1], 0)});
  }
  function entitiesOf(ex, w) {
    return ex.entities.filter(function (e) { return w >= e.first && w < e.end; });
  }
  function firstEntityWord(ex) {
    return ex.entities.length ? ex.entities[0].end - 1 : -1;
  }
  function state() {
    return {example: Number(sel.example.value), layer: Number(sel.layer.value), head: Number(sel.head.value),
            word: root.dataset.word === "" ? -1 : Number(root.dataset.word)};
  }

  function drawWords(ex, word) {
    var box = document.getElementById("words");
    box.textContent = "";
    ex.words.forEach(function (text, w) {
      var b = document.createElement("button");
      b.type = "button";
      b.textContent = text;
      b.dataset.index = String(w);
      if (entitiesOf(ex, w).length) b.classList.add("entity");
      if (ex.cut.indexOf(w) >= 0) { b.classList.add("cut"); b.title = "cut off by the text budget"; }
      if (w === word) b.classList.add("selected");
      b.addEventListener("click", function () { selectWord(w); });
      box.appendChild(b);
    });
  }

  function draw() {
    var s = state(), ex = data.examples[s.example];
    root.dataset.example = String(s.example + 1);
    root.dataset.layer = String(s.layer + 1);
    root.dataset.head = String(s.head + 1);
    document.getElementById("caption-id").textContent = "caption " + ex.caption_id + ", image " + ex.image_id;
    drawWords(ex, s.word);
    var W = ex.size[0], Hpx = ex.size[1];
    svg.textContent = "";
    svg.setAttribute("viewBox", "0 0 " + W + " " + Hpx);
    svg.setAttribute("height", String(Math.round(384 * Hpx / Math.max(W, 1))));
    document.getElementById("missing").hidden = Boolean(ex.image);
    if (ex.image) {
      svg.appendChild(svgEl("image", {href: ex.image, x: 0, y: 0, width: W, height: Hpx, preserveAspectRatio: "none"}));
    } else {
      svg.appendChild(svgEl("rect", {"class": "background", x: 0, y: 0, width: W, height: Hpx, fill: "#888"}));
    }
    var top = document.getElementById("top");
    if (s.word < 0 || ex.cut.indexOf(s.word) >= 0 || !ex.regions.length) {
      top.textContent = s.word < 0 ? "Click a word." : !ex.regions.length ? "This image has no regions." :
        "This word was cut off by the text budget: no attention.";
      return;
    }
    var R = ex.regions.length, nW = ex.words.length, d = decoded(s.example);
    var base = ((s.layer * data.heads + s.head) * nW + s.word) * R;  // (L, H, W, R) row-major
    var weights = [];
    for (var r = 0; r < R; r++) weights.push(d.share[base + r] / 255);
    var mass = d.mass[(s.layer * data.heads + s.head) * nW + s.word] / 255;
    var best = 0;
    for (r = 1; r < R; r++) if (weights[r] > weights[best]) best = r;
    var scale = weights[best] > 0 ? weights[best] : 1;
    var order = weights.map(function (_, i) { return i; }).sort(function (a, b) { return weights[a] - weights[b]; });
    order.forEach(function (r) {
      var rect = boxRect(ex.regions[r], "attn");
      var rel = weights[r] / scale;
      rect.setAttribute("data-region", String(r));
      rect.setAttribute("data-weight", weights[r].toFixed(3));
      rect.setAttribute("stroke-opacity", rel.toFixed(3));
      rect.setAttribute("stroke-width", (0.5 + 2.5 * rel).toFixed(2));
      var tip = svgEl("title", {});
      tip.textContent = "region " + r + ": " + weights[r].toFixed(3);
      rect.appendChild(tip);
      svg.appendChild(rect);
    });
    entitiesOf(ex, s.word).forEach(function (e) {
      e.gold.forEach(function (b) { svg.appendChild(boxRect(b, "gold")); });
    });
    top.textContent = "\\u201c" + ex.words[s.word] + "\\u201d, layer " + (s.layer + 1) + " head " + (s.head + 1) +
      ": top region " + best + " with " + weights[best].toFixed(3) + " of the word's attention to regions (" +
      mass.toFixed(3) + " of its whole attention row went to regions).";
  }

  function selectWord(w) {
    root.dataset.word = String(w);
    draw();
  }
  function selectExample() {
    var ex = data.examples[Number(sel.example.value)];
    var w = firstEntityWord(ex);
    root.dataset.word = w < 0 ? "" : String(w);
    draw();
  }

  document.getElementById("about").textContent = data.layers + " layers x " + data.heads + " heads; maps: " +
    data.maps + "; a word's attention is read from its " + data.token + " subword(s) (grounding option token).";
  data.examples.forEach(function (ex, i) { option(sel.example, i, (i + 1) + ": " + ex.words.join(" ")); });
  for (var l = 0; l < data.layers; l++) option(sel.layer, l, String(l + 1));
  for (var h = 0; h < data.heads; h++) option(sel.head, h, String(h + 1));
  sel.example.addEventListener("change", selectExample);
  sel.layer.addEventListener("change", draw);
  sel.head.addEventListener("change", draw);
  if (data.examples.length) selectExample();
  else document.getElementById("top").textContent = "No example.";
})();
</script>
</body>
</html>
"""
