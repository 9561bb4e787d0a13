"""The attention explorer (issue 5, item 5): the page built from hand-made records (escaping, no network),
driven in headless Chromium through ChromeDriver (W3C WebDriver over plain HTTP, standard library only),
and written by `analyze grounding` on the tiny world."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from vlberts.analysis.explorer import ExplorerEntity, ExplorerExample, ExplorerInfo, explorer_html, word_attention, write_explorer
from vlberts.recipes.analyze_grounding import GroundingConfig, analyze_grounding

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
EVIL = "<script>alert(1)</script>"
GOLD = (0x2F, 0x9E, 0x44)  # rect.gold's stroke colour in the page's style sheet


def attention() -> np.ndarray:
    """(L=2, H=2, W=2, R=3) distinct weights; each row sums to < 1 as in a single-stream joint map."""
    return (np.arange(24, dtype=np.float64).reshape(2, 2, 2, 3) + 1) / 100


def attention_2() -> np.ndarray:
    """Example 2's attention: word 0's rows reversed, so that its top region (0) differs from word 1's (2)."""
    a = attention()
    a[:, :, 0] = a[:, :, 0, ::-1]
    return a


def png(size: int = 128) -> bytes:
    """A gradient image, so that the screenshot has an image to show."""
    ramp = np.linspace(0, 255, size, dtype=np.uint8)
    rgb = np.stack([np.tile(ramp, (size, 1)), np.tile(ramp[:, None], (1, size)), np.full((size, size), 90, np.uint8)], -1)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def examples() -> list[ExplorerExample]:
    regions = np.array([[0, 0, 60, 60], [40, 40, 120, 120], [70, 10, 125, 50]], dtype=np.float64)
    plain = ExplorerExample("1_0", "1", ("a", "dog"), attention()[..., ::-1].copy(), regions,
                            (ExplorerEntity(0, 2, np.array([[0, 0, 60, 60]]), "a dog"),), (128, 128), None)
    evil = ExplorerExample("2_1 & <b>", "2", (EVIL, "&"), attention_2(), regions,
                           (ExplorerEntity(1, 2, np.array([[38, 42, 118, 121]]), "&"),), (128, 128), png())
    return [plain, evil]


INFO = ExplorerInfo(layers=2, heads=2, maps="joint self-attention maps <test>", token="last")


def page_data(page: str) -> dict[str, Any]:
    m = re.search(r'<script type="application/json" id="explorer-data">(.*?)</script>', page, re.S)
    assert m is not None
    return json.loads(m.group(1))


def test_page_escapes_text_and_needs_no_network():
    page = explorer_html(examples(), INFO)
    assert EVIL not in page and "alert(1)</script>" not in page and "2_1 & <b>" not in page and "<test>" not in page
    assert not re.search(r"https?://", page)
    data = page_data(page)  # the escapes are JSON: the text comes back exactly
    assert data["examples"][1]["words"] == [EVIL, "&"] and data["examples"][1]["caption_id"] == "2_1 & <b>"
    assert data["examples"][0]["image"] is None and data["examples"][1]["image"].startswith("data:image/png;base64,")
    share = np.frombuffer(base64.b64decode(data["examples"][1]["share"]), np.uint8).reshape(2, 2, 2, 3) / 255
    row = attention_2()[1, 0, 1]
    np.testing.assert_allclose(share[1, 0, 1], row / row.sum(), atol=0.5 / 255 + 1e-9)
    assert len(page_data(explorer_html(examples() * 20, INFO, max_examples=25))["examples"]) == 25


def test_word_attention_reads_each_word_like_an_entity():
    attn = np.arange(2 * 1 * 5 * 2, dtype=np.float64).reshape(2, 1, 5, 2)  # (L, H, T, R)
    tokens = [[1], [2, 3], []]  # "a skate ##board" and a word cut off
    last = word_attention(attn, tokens, "last")
    np.testing.assert_array_equal(last[:, :, 1], attn[:, :, 3])
    np.testing.assert_array_equal(word_attention(attn, tokens, "head_mean")[:, :, 1], attn[:, :, 2:4].mean(axis=2))
    assert np.isnan(last[:, :, 2]).all()


# --- headless Chromium through ChromeDriver (W3C WebDriver, HTTP + JSON) -----------------------------------

ELEMENT = "element-6066-11e4-a52e-4f735466cecf"  # the W3C web element reference key
TIMEOUT = 20.0


class WebDriver:
    """The few W3C WebDriver commands the test needs, over urllib with a timeout on every request."""

    def __init__(self, port: int):
        self.base = f"http://127.0.0.1:{port}"
        self.session = ""

    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json; charset=utf-8"})
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
                return json.loads(r.read() or b"{}").get("value")
        except urllib.error.HTTPError as e:
            raise AssertionError(f"WebDriver {method} {path}: {e.code} {e.read()[:500]!r}") from None

    def s(self, method: str, path: str, body: dict | None = None) -> Any:
        return self.call(method, f"/session/{self.session}{path}", body)

    def find(self, css: str) -> str:
        return self.s("POST", "/element", {"using": "css selector", "value": css})[ELEMENT]

    def find_all(self, css: str) -> list[str]:
        return [e[ELEMENT] for e in self.s("POST", "/elements", {"using": "css selector", "value": css})]

    def click(self, css: str) -> None:
        self.s("POST", f"/element/{self.find(css)}/click", {})

    def attr(self, element: str, name: str) -> str | None:
        return self.s("GET", f"/element/{element}/attribute/{name}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png_pixels(data: bytes) -> tuple[int, int, np.ndarray]:
    """A PNG's width and height from its IHDR chunk, and its (h, w, 3) pixels (Pillow, a dependency already)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    pixels = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert pixels.shape[:2] == (height, width)
    return width, height, pixels


@pytest.fixture
def browser(tmp_path):
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip(f"{CHROMIUM} or {CHROMEDRIVER} not installed (make test installs Debian's chromium and "
                    "chromium-driver when it can)")
    port = free_port()
    # Its own process group, so that Chromium (started by ChromeDriver) goes down with it.
    proc = subprocess.Popen([str(CHROMEDRIVER), f"--port={port}"], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    wd = WebDriver(port)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                if wd.call("GET", "/status")["ready"]:
                    break
            except (OSError, AssertionError):
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise AssertionError("chromedriver did not start")
            time.sleep(0.1)
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage", "--window-size=1000,1000", f"--user-data-dir={tmp_path / 'chromium'}"]
        caps = {"capabilities": {"alwaysMatch": {"goog:chromeOptions": {"binary": str(CHROMIUM), "args": args}}}}
        wd.session = wd.call("POST", "/session", caps)["sessionId"]
        yield wd
    finally:
        if wd.session:
            try:
                wd.call("DELETE", f"/session/{wd.session}")
            except (OSError, AssertionError):
                pass
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_browser_click_through(browser, tmp_path):
    page = write_explorer(tmp_path / "explorer.html", examples(), INFO)
    wd = browser
    wd.s("POST", "/url", {"url": page.resolve().as_uri()})
    root = wd.find("#explorer")
    # On load: example 1, whose image is missing, with its first entity's last word selected.
    assert (wd.attr(root, "data-example"), wd.attr(root, "data-word")) == ("1", "1")
    assert wd.s("GET", f"/element/{wd.find('#missing')}/property/hidden") is False

    wd.click('#example option[value="1"]')  # example 2 (values are 0-based, labels and data-* 1-based)
    wd.click('#layer option[value="1"]')  # layer 2
    wd.click('#head option[value="0"]')  # head 1
    words = [wd.s("GET", f"/element/{b}/property/textContent") for b in wd.find_all("#words button")]
    assert words == [EVIL, "&"]  # shown as text, not run
    assert wd.s("POST", "/execute/sync", {"script": "return document.querySelectorAll('#explorer script').length;",
                                          "args": []}) == 0
    assert wd.s("GET", f"/element/{wd.find('#missing')}/property/hidden") is True
    for word, top, n_gold in ((0, 0, 0), (1, 2, 1)):  # the script word is in no entity; "&" is
        wd.click(f'#words button[data-index="{word}"]')
        state = {k: wd.attr(root, f"data-{k}") for k in ("example", "layer", "head", "word")}
        assert state == {"example": "2", "layer": "2", "head": "1", "word": str(word)}
        rects = wd.find_all("svg rect.attn")
        assert len(rects) == 3  # one per region
        got = {int(wd.attr(r, "data-region")): float(wd.attr(r, "data-weight")) for r in rects}
        row = attention_2()[1, 0, word]  # (layer 2, head 1, word) of example 2
        np.testing.assert_allclose([got[r] for r in range(3)], row / row.sum(), atol=0.5 / 255 + 1e-3)
        assert f"top region {top} " in wd.s("GET", f"/element/{wd.find('#top')}/property/textContent")
        assert len(wd.find_all("svg rect.gold")) == n_gold
    gold = wd.find("svg rect.gold")
    assert [float(wd.attr(gold, k)) for k in ("x", "y", "width", "height")] == [38, 42, 80, 79]

    shot = base64.b64decode(wd.s("GET", "/screenshot"))
    (tmp_path / "screenshot.png").write_bytes(shot)
    width, height, pixels = png_pixels(shot)
    assert width > 100 and height > 100
    colours = np.unique(pixels.reshape(-1, 3), axis=0)
    assert len(colours) > 50  # text, the gradient image and the boxes; not a blank page
    assert (pixels == GOLD).all(axis=-1).sum() > 50  # the gold box is on screen


def test_analyze_grounding_writes_the_explorer(tiny_world, tiny_pretrained, tmp_path):
    common = dict(model=str(tiny_pretrained), entities=str(tiny_world.entities), features=str(tiny_world.store), split="test")
    rep = analyze_grounding(GroundingConfig(out=str(tmp_path / "g"), explorer_examples=3, **common))
    page = (tmp_path / "g" / "explorer.html").read_text()
    assert rep.paths["explorer"] == tmp_path / "g" / "explorer.html" and not re.search(r"https?://", page)
    data = page_data(page)
    assert (data["layers"], data["heads"]) == (2, 4) and data["token"] == "last"
    assert len(data["examples"]) == 3
    for ex in data["examples"]:
        assert ex["image"].startswith("data:image/png;base64,")  # found in WORLD/images by --images=auto
        share = np.frombuffer(base64.b64decode(ex["share"]), np.uint8).reshape(2, 4, len(ex["words"]), len(ex["regions"]))
        assert share.shape[-1] > 0 and ex["entities"]
    none = analyze_grounding(GroundingConfig(out=str(tmp_path / "n"), explorer_examples=0, **common))
    assert "explorer" not in none.paths and not (tmp_path / "n" / "explorer.html").exists()
