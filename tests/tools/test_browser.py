"""Headless-browser check of the batch display: render a multimodal BatchView's HTML (what
Jupyter shows for ``show(batch, recipe)``) in Chromium, take a screenshot, and find in its
pixels the red document-boundary markers (one per document) and every image thumbnail (each at
its exact pixels, in reading order).

Needs Chromium (Debian/Ubuntu: ``apt-get install -y chromium``); skipped with the reason when
it is not installed. Set ``ZEPHON_CHROMIUM`` to use another binary.
"""

from __future__ import annotations

import base64
import io
import os
import shutil
import subprocess
from html.parser import HTMLParser

import numpy as np
import pytest

pytest.importorskip("PIL")

import itertools

from PIL import Image
from vl_fixtures import vl_config, write_vl_root

from zephon import Recipe
from zephon.tools.display import show

BOUNDARY_RGB = (0xE1, 0x1D, 0x48)  # the zp-boundary colour, #e11d48
WIDTH, HEIGHT = 1000, 2400


def _chromium():
    for c in (os.environ.get("ZEPHON_CHROMIUM"), "chromium", "chromium-browser", "google-chrome", "/usr/bin/chromium"):
        if c and shutil.which(c):
            return shutil.which(c)
    return None


CHROMIUM = _chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="Chromium is not installed (apt-get install -y chromium), "
    "or set ZEPHON_CHROMIUM to a Chromium/Chrome binary",
)


def screenshot(html: str, folder) -> np.ndarray:
    """``html`` rendered by headless Chromium at WIDTH x HEIGHT, device scale 1, as uint8 RGB."""
    page = os.path.join(folder, "page.html")
    with open(page, "w", encoding="utf-8") as f:
        f.write(
            '<!DOCTYPE html><html><head><meta charset="utf-8"></head>'
            f'<body style="margin:8px;background:#ffffff">{html}</body></html>'
        )
    png = os.path.join(folder, "shot.png")
    cmd = [
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--hide-scrollbars",
        "--force-device-scale-factor=1",
        "--force-color-profile=srgb",
        f"--user-data-dir={os.path.join(folder, 'profile')}",
        f"--screenshot={png}",
        f"--window-size={WIDTH},{HEIGHT}",
        "file://" + page,
    ]
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert p.returncode == 0 and os.path.exists(png), f"chromium failed (rc {p.returncode}):\n{p.stdout[-3000:]}"
    with Image.open(png) as im:
        return np.asarray(im.convert("RGB"))


class Thumbs(HTMLParser):
    """Every ``zp-thumb`` image: (data-image, decoded RGB pixels); and the boundary count."""

    def __init__(self, html: str):
        super().__init__()
        self.thumbs, self.boundaries = [], 0
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("class") == "zp-thumb":
            raw = base64.b64decode(a["src"].split(",", 1)[1])
            with Image.open(io.BytesIO(raw)) as im:
                self.thumbs.append((int(a["data-image"]), np.asarray(im.convert("RGB"))))
        elif a.get("class") == "zp-boundary":
            self.boundaries += 1

    handle_startendtag = handle_starttag


def components(mask: np.ndarray, join: int = 3) -> list:
    """Connected groups of True pixels (8-neighbourhood, pixels up to ``join`` apart joined):
    bounding boxes (y0, x0, y1, x1)."""
    ys, xs = np.nonzero(mask)
    pts = set(zip(ys.tolist(), xs.tolist()))
    boxes = []
    while pts:
        stack = [pts.pop()]
        y0 = y1 = stack[0][0]
        x0 = x1 = stack[0][1]
        while stack:
            y, x = stack.pop()
            y0, y1, x0, x1 = min(y0, y), max(y1, y), min(x0, x), max(x1, x)
            for dy in range(-join, join + 1):
                for dx in range(-join, join + 1):
                    q = (y + dy, x + dx)
                    if q in pts:
                        pts.remove(q)
                        stack.append(q)
        boxes.append((y0, x0, y1, x1))
    return boxes


def find(shot: np.ndarray, thumb: np.ndarray, tol: float = 2.0):
    """Top-left (y, x) of ``thumb`` in ``shot`` (mean abs difference <= tol), or None."""
    h, w = thumb.shape[:2]
    H, W = shot.shape[:2]
    ref = thumb.astype(np.int16)
    first = np.abs(shot[: H - h + 1, : W - w + 1].astype(np.int16) - ref[0, 0]).max(axis=2) <= 4
    for y, x in zip(*np.nonzero(first)):
        if np.abs(shot[y : y + h, x : x + w].astype(np.int16) - ref).mean() <= tol:
            return int(y), int(x)
    return None


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    r = write_vl_root(tmp_path_factory.mktemp("browser"), seed=4, n_wds=24, n_parquet=16, n_interleaved=8)
    return Recipe.from_dict(vl_config(r), r)


@pytest.mark.timeout(300)
def test_screenshot_shows_boundaries_and_thumbnails(recipe, tmp_path):
    with recipe.global_loader(1) as g:
        b = next(g)
    rows = 4
    view = show(b, recipe, max_rows=rows, max_chars=2000)
    html = view._repr_html_()
    parsed = Thumbs(html)
    assert len(parsed.thumbs) == int(b["images_per_row"][:rows].sum()) > 0
    assert parsed.boundaries == sum(len(view.segments(i)) for i in range(rows))
    shot = screenshot(html, str(tmp_path))
    assert shot.shape[1] == WIDTH
    # the page fits the window: its last rows are white
    assert (shot[-40:] == 255).all(), "the rendered display is taller than the window"

    # thumbnails: each at its exact pixels, in reading order (row by row, left to right)
    spots, found = [], {}
    for n, px in parsed.thumbs:
        where = find(shot, px)
        assert where is not None, f"thumbnail of image {n} ({px.shape[1]}x{px.shape[0]}) not found in the screenshot"
        found[n] = where
        spots.append((where[0] + px.shape[0] / 2, where[1], n))
    assert [n for *_, n in spots] == sorted(n for *_, n in spots)
    for (cy0, x0, _), (cy1, x1, _) in itertools.pairwise(spots):
        assert cy1 > cy0 + 4 or (abs(cy1 - cy0) <= 4 and x1 > x0), "thumbnails out of reading order"

    # boundary markers: one red glyph (two bars, joined) per document boundary. A pixel is of the
    # marker's colour C when it is C blended over the white page (anti-aliasing): the same
    # coverage a = (255 - p) / (255 - C) in all three channels, here a >= 0.45. The thumbnails
    # (found above) are blanked first: their pictures may hold that red too.
    page = shot.copy()
    for n, px in parsed.thumbs:
        y, x = found[n]
        page[y : y + px.shape[0], x : x + px.shape[1]] = 255
    a = (255.0 - page) / (255.0 - np.array(BOUNDARY_RGB, np.float64))
    red = (a.min(axis=2) >= 0.45) & (a.max(axis=2) - a.min(axis=2) <= 0.12) & (a.max(axis=2) <= 1.08)
    boxes = components(red)
    assert len(boxes) == parsed.boundaries, f"{len(boxes)} red marks for {parsed.boundaries} boundaries"
    for y0, x0, y1, x1 in boxes:
        assert 6 <= y1 - y0 + 1 <= 30 and x1 - x0 + 1 <= 20, (y0, x0, y1, x1)  # glyph-sized
    # each row's first document starts its row's first line: a marker at the left edge per row
    left = sorted(y0 for y0, x0, _, _ in boxes if x0 < 30)
    assert len(left) >= rows
