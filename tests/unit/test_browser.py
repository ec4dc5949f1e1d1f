"""The offline HTML map renders in headless Chromium: the screenshot is not blank
and shows the block colours.  GPUMEM_BROWSER names the browser, or is "none" to
skip (.ci/run sets it, and says so when the machine has no Chromium); without it
a Chromium on PATH is used, else the test skips -- except on CI, where a browser
that goes missing unannounced is a failure."""

import os
import shutil
import subprocess

import pytest

import gpumem
from gpumem.draw.memory_map import BLOCK_COLORS, PAGE_COLORS

MiB = 1 << 20


def chromium():
    chosen = os.environ.get("GPUMEM_BROWSER", "")
    if chosen == "none":
        pytest.skip("no Chromium on this machine (GPUMEM_BROWSER=none)")
    if chosen:
        path = shutil.which(chosen)
        if not path:
            pytest.fail(f"GPUMEM_BROWSER={chosen!r} is not an executable")
        return path
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        path = shutil.which(name)
        if path:
            return path
    if os.environ.get("CI"):
        pytest.fail("no Chromium on CI: set GPUMEM_BROWSER (.ci/run does), or install one")
    pytest.skip("no chromium installed")


def hex_rgb(c):
    return tuple(int(c[i : i + 2], 16) for i in (1, 3, 5))


def screenshot(browser, Image, page, tmp_path, window):
    """`page` as headless Chromium shows it in a window of `window` ("W,H") pixels, an RGB image."""
    shot = tmp_path / "shot.png"
    cmd = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        f"--user-data-dir={tmp_path / 'profile'}",
        f"--window-size={window}",
        f"--screenshot={shot}",
        page.as_uri(),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert shot.exists(), f"no screenshot (exit {r.returncode}): {r.stderr[-2000:]}"
    return Image.open(shot).convert("RGB")


def near(present, rgb):
    """Whether a colour within 12 (summed over R, G, B) of `rgb` is among `present`."""
    return any(sum(abs(a - b) for a, b in zip(rgb, c)) <= 12 for c in present)


def test_offline_html_renders_in_headless_chromium(tmp_path):
    browser = chromium()
    Image = pytest.importorskip("PIL.Image")
    with gpumem.Heap(device="sim", capacity=256 * MiB) as h:
        ptrs = [h.malloc((i % 5 + 1) * 900 * 1024) for i in range(60)]
        for p in ptrs[::2]:
            h.free(p)
        h.free(h.malloc(40 * MiB))
        page = tmp_path / "map.html"
        gpumem.snapshot(h).to_html(page)
    # The page must render with no network: nothing here can be fetched anyway,
    # and the check below needs the SVG's own colours on screen.
    img = screenshot(browser, Image, page, tmp_path, "1100,900")
    assert img.size == (1100, 900)
    colors = img.getcolors(maxcolors=1 << 20)
    total = img.size[0] * img.size[1]
    white = sum(n for n, c in colors if c == (255, 255, 255))
    assert white < 0.95 * total, "screenshot is (nearly) blank"
    present = {c for _, c in colors}
    for name in (BLOCK_COLORS["live"][0], BLOCK_COLORS["free"][0], PAGE_COLORS["used"]):
        assert near(present, hex_rgb(name)), f"colour {name} not on screen"


def test_timeline_renders_in_headless_chromium(tmp_path):
    """Memory over time, as Timeline.to_html writes it: live, reserved, cap and the OOM on screen."""
    from gpumem.draw.timeline import CAP_COLOR, LIVE_COLOR, OOM_COLOR, RESERVED_COLOR

    browser = chromium()
    Image = pytest.importorskip("PIL.Image")
    page = tmp_path / "timeline.html"
    gpumem.memory_over_time("seed_fragmentation", capacity="1.5GiB").to_html(page)
    present = {c for _, c in screenshot(browser, Image, page, tmp_path, "1000,420").getcolors(maxcolors=1 << 20)}
    for name in (LIVE_COLOR, RESERVED_COLOR, CAP_COLOR, OOM_COLOR):
        assert near(present, hex_rgb(name)), f"colour {name} not on screen"
