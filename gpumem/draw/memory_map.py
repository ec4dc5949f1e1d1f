"""The memory map: an inline SVG (for Jupyter and offline HTML) and a matplotlib plot.

Layout: the heap's used address range [base, base + top) is cut into rows of
equal address span, like lines of text.  Each row has a thin strip of pages
(used / cached / unmapped) above a strip of blocks (live / pending / free /
unmapped).  Widths are proportional to bytes, so live blocks are drawn to scale;
a block too small to see gets a hairline so that it still has something to
hover.  Every block is one <g class="block"> with a <title> (the tooltip: size,
requested size, stream, allocation site), split into one <rect> per row it
crosses.  Nothing refers to anything outside the document.
"""

from __future__ import annotations

import math
from typing import List, Optional

from .._units import format_size
from . import esc, legend_beside, new_axes

__all__ = ["render_svg", "render_fragment", "render_page", "plot_matplotlib", "BLOCK_COLORS", "PAGE_COLORS"]

BLOCK_COLORS = {
    "live": ("#3b6fb6", "#5b8fd6"),
    "pending": ("#e8871e", "#f0a550"),
    "free": ("#9fd39a", "#9fd39a"),
    "unmapped": ("#ececec", "#ececec"),
}
PAGE_COLORS = {"used": "#1f3f73", "cached": "#8fc1e3", "unmapped": "#d6d6d6", "paused": "#f2c6a0"}
PAGE_STATE_NAMES = {0: "unmapped", 1: "used", 2: "cached", 3: "paused"}

WIDTH = 960
PAGE_H = 7
BLOCK_H = 26
ROW_GAP = 6
LEFT = 70
HEADER_H = 58


def _layout(snap, max_rows: int):
    n_pages = max(len(snap.pages), 1)
    ppr = max(min(n_pages, 32), math.ceil(n_pages / max_rows))
    rows = math.ceil(n_pages / ppr)
    row_bytes = ppr * snap.page_size
    return ppr, rows, row_bytes


def _pieces(start: int, end: int, row_bytes: int):
    """Split [start, end) (offsets from base) into (row, x0, x1) byte spans."""
    while start < end:
        row = start // row_bytes
        row_end = (row + 1) * row_bytes
        stop = min(end, row_end)
        yield row, start - row * row_bytes, stop - row * row_bytes
        start = stop


def _block_title(snap, b) -> str:
    off = b.addr - snap.va_base
    lines = [f"{b.state} block at base+{off:#x} ({b.addr:#x})", f"size {format_size(b.size)}"]
    if b.state in ("live", "pending"):
        lines[-1] += f", requested {format_size(b.requested)}"
        lines.append(f"stream {b.stream}, allocation #{b.alloc_seq}")
        if b.framework or snap.default_framework:
            lines.append(f"allocated by {b.framework or snap.default_framework}")
        frames = b.frames
        if frames:
            lines.append("allocated at " + (b.site or str(frames[0])))
            lines += [f"  {f}" for f in frames[:8]]
        elif b.context:
            lines.append(f"context {b.context:#x}")
        else:
            lines.append("no allocation site (record_history(stacks='python') to keep one)")
    elif b.state == "free":
        lines.append("owner: any stream" if b.stream == (1 << 64) - 1 else f"owner: stream {b.stream}")
    return "\n".join(lines)


def render_svg(snap, max_rows: int = 48, width: int = WIDTH) -> str:
    ppr, rows, row_bytes = _layout(snap, max_rows)
    scale = (width - LEFT - 10) / row_bytes
    row_h = PAGE_H + BLOCK_H + ROW_GAP
    height = HEADER_H + rows * row_h + 10
    out: List[str] = []
    w = out.append
    w(
        f'<svg xmlns="http://www.w3.org/2000/svg" class="gpumem-map" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
    )
    w("<style>.gpumem-map .block:hover rect{stroke:#000;stroke-width:1.2}.gpumem-map text{fill:#222}</style>")
    _header(w, snap, ppr, row_bytes)
    # row labels
    for r in range(rows):
        y = HEADER_H + r * row_h
        w(f'<text x="4" y="{y + PAGE_H + BLOCK_H * 0.7:.1f}" font-size="10">+{esc(format_size(r * row_bytes))}</text>')
    _pages(w, snap, ppr, rows, row_h, scale)
    _blocks(w, snap, row_bytes, row_h, scale)
    w("</svg>")
    return "".join(out)


def _header(w, snap, ppr: int, row_bytes: int) -> None:
    """The title, what a row holds, and the legend."""
    s = snap.summary
    title = snap.label or snap.device_name
    w(
        f'<text x="4" y="14" font-size="13" font-weight="bold">{esc(title)}: '
        f"{esc(format_size(s.live_bytes))} live, {esc(format_size(s.reserved_bytes))} reserved, "
        f"{esc(format_size(s.free_mapped_bytes))} free in mapped pages, fragmentation {s.fragmentation:.1%}</text>"
    )
    w(
        f'<text x="4" y="30">one row = {esc(format_size(row_bytes))} of address space ({ppr} pages of '
        f"{esc(format_size(snap.page_size))}); {s.n_segments} mapped segments; "
        f"{snap.spare_pages} spare pages held unmapped</text>"
    )
    x = 4
    for name, color in (
        ("live", BLOCK_COLORS["live"][0]),
        ("pending", BLOCK_COLORS["pending"][0]),
        ("free", BLOCK_COLORS["free"][0]),
        ("unmapped", BLOCK_COLORS["unmapped"][0]),
        ("page used", PAGE_COLORS["used"]),
        ("page cached", PAGE_COLORS["cached"]),
        ("page unmapped", PAGE_COLORS["unmapped"]),
    ):
        w(f'<rect x="{x}" y="38" width="12" height="10" fill="{color}" stroke="#999" stroke-width="0.5"/>')
        w(f'<text x="{x + 16}" y="47">{name}</text>')
        x += 22 + 7 * len(name)


def _pages(w, snap, ppr: int, rows: int, row_h: int, scale: float) -> None:
    """The strip of pages above each row, run-length merged per row."""
    w('<g class="pages">')
    pages = snap.pages
    n = len(pages)
    i = 0
    while i < n:
        st = pages[i]
        row = i // ppr
        j = i
        while j < n and pages[j] == st and j // ppr == row:
            j += 1
        x0 = LEFT + (i - row * ppr) * snap.page_size * scale
        x1 = LEFT + (j - row * ppr) * snap.page_size * scale
        y = HEADER_H + row * row_h
        name = PAGE_STATE_NAMES.get(st, "?")
        w(
            f'<rect class="page {name}" x="{x0:.2f}" y="{y}" width="{max(x1 - x0, 0.5):.2f}" height="{PAGE_H - 1}" '
            f'fill="{PAGE_COLORS.get(name, "#f0f")}"><title>{esc(f"pages {i}..{j - 1}: {name} ({j - i} x {format_size(snap.page_size)})")}</title></rect>'  # noqa: E501
        )
        i = j
    page_px = snap.page_size * scale
    if page_px >= 4:
        # page boundaries, so that shared pages can be told apart
        d = []
        for r in range(rows):
            y = HEADER_H + r * row_h
            for k in range(1, ppr):
                if r * ppr + k >= n:
                    break
                d.append(f"M{LEFT + k * page_px:.2f} {y}v{PAGE_H - 1}")
        if d:
            w(f'<path d="{"".join(d)}" stroke="#fff" stroke-width="0.8" pointer-events="none"/>')
    w("</g>")


def _blocks(w, snap, row_bytes: int, row_h: int, scale: float) -> None:
    """One group per block, a rectangle per row it crosses, its tooltip the block's title."""
    w('<g class="blocks">')
    live_i = 0
    for b in snap.blocks:
        color = BLOCK_COLORS.get(b.state, ("#f0f", "#f0f"))
        if b.state == "live":
            fill = color[live_i & 1]  # neighbours alternate shades so that block edges show
            live_i += 1
        else:
            fill = color[0]
        title = esc(_block_title(snap, b))
        w(
            f'<g class="block {b.state}" data-addr="{b.addr}" data-size="{b.size}" data-state="{b.state}">'
            f"<title>{title}</title>"
        )
        for row, o0, o1 in _pieces(b.addr - snap.va_base, b.end - snap.va_base, row_bytes):
            x0 = LEFT + o0 * scale
            bw = max((o1 - o0) * scale, 0.6)
            y = HEADER_H + row * row_h + PAGE_H
            edge = ' stroke="#fff" stroke-width="0.5"' if bw >= 4 else ""
            w(f'<rect x="{x0:.2f}" y="{y}" width="{bw:.2f}" height="{BLOCK_H}" fill="{fill}"{edge}/>')
        w("</g>")
    w("</g>")


_CSS = """
.gpumem-report{font-family:sans-serif;font-size:13px;color:#222}
.gpumem-report table{border-collapse:collapse;margin:6px 0 10px 0}
.gpumem-report td,.gpumem-report th{border:1px solid #ddd;padding:2px 8px;text-align:left;vertical-align:top}
.gpumem-report th{background:#f4f4f4}
.gpumem-report .num{text-align:right;font-variant-numeric:tabular-nums}
.gpumem-report .why{color:#666}
"""


def _summary_table(snap) -> str:
    rows = "".join(
        f"<tr><th>{esc(a)}</th><td class='num'>{esc(b)}</td><td class='why'>{esc(c)}</td></tr>"
        for a, b, c in snap.summary.rows()
    )
    return f"<table class='summary'>{rows}</table>"


def _sites_table(snap, n: int = 10) -> str:
    sites = snap.top_sites(n)
    if not sites:
        return ""
    rows = "".join(
        f"<tr><td>{esc(site)}</td><td class='num'>{esc(format_size(b))}</td><td class='num'>{k}</td></tr>"
        for site, b, k in sites
    )
    return f"<table class='sites'><tr><th>allocation site</th><th>live</th><th>blocks</th></tr>{rows}</table>"


def _timeline_svg(snap) -> str:
    tl = snap.memory_over_time()
    return "" if tl is None else tl.to_svg()


def render_fragment(snap) -> str:
    """What Jupyter shows for a Snapshot: summary table, memory map, memory over
    time (when the snapshot has a history or a replay's timeline), top sites."""
    return (
        f"<div class='gpumem-report'><style>{_CSS}</style>{_summary_table(snap)}"
        f"{render_svg(snap)}{_timeline_svg(snap)}{_sites_table(snap)}</div>"
    )


def render_page(snap, title: Optional[str] = None) -> str:
    title = title or f"gpumem snapshot: {snap.label or snap.device_name}"
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{esc(title)}</title></head><body>"
        f"<h2 style='font-family:sans-serif'>{esc(title)}</h2>{render_fragment(snap)}"
        "<p style='font-family:sans-serif;color:#666;font-size:12px'>Hover a block for its size, stream "
        "and allocation site, a mark of the timeline for what happened there. Made by gpumem; this file "
        "needs no network.</p></body></html>\n"
    )


def plot_matplotlib(snap, ax=None, max_rows: int = 32):
    """The same map with matplotlib: one horizontal band per row of address space."""
    from matplotlib.patches import Patch

    ppr, rows, row_bytes = _layout(snap, max_rows)
    ax = new_axes(ax, (12, 0.9 + 0.32 * rows))
    mib = 1 << 20
    spans = {}
    live_i = 0
    for b in snap.blocks:
        color = BLOCK_COLORS[b.state][live_i & 1] if b.state == "live" else BLOCK_COLORS[b.state][0]
        live_i += b.state == "live"
        for row, o0, o1 in _pieces(b.addr - snap.va_base, b.end - snap.va_base, row_bytes):
            spans.setdefault((color, row), []).append((o0 / mib, (o1 - o0) / mib))
    # one call per colour and row keeps large heaps fast to draw
    for (color, row), items in spans.items():
        ax.broken_barh(items, (row + 0.22, 0.7), facecolors=color, edgecolors="white", linewidth=0.2)
    page_mib = snap.page_size / mib
    pspans = {}
    for i, st in enumerate(snap.pages):
        row = i // ppr
        pspans.setdefault((PAGE_COLORS[PAGE_STATE_NAMES[st]], row), []).append(((i - row * ppr) * page_mib, page_mib))
    for (color, row), items in pspans.items():
        ax.broken_barh(items, (row, 0.18), facecolors=color, edgecolors="white", linewidth=0.2)
    ax.set_xlim(0, row_bytes / mib)
    ax.set_ylim(rows, 0)
    ax.set_xlabel(f"offset within row (MiB); one row = {format_size(row_bytes)}")
    ax.set_yticks([r + 0.5 for r in range(rows)])
    ax.set_yticklabels([f"+{format_size(r * row_bytes)}" for r in range(rows)], fontsize=7)
    s = snap.summary
    ax.set_title(
        f"{snap.label or snap.device_name}: {format_size(s.live_bytes)} live, "
        f"{format_size(s.reserved_bytes)} reserved, fragmentation {s.fragmentation:.1%}",
        fontsize=10,
    )
    handles = [Patch(color=BLOCK_COLORS[k][0], label=k) for k in ("live", "pending", "free", "unmapped")]
    handles += [Patch(color=PAGE_COLORS[k], label=f"page {k}") for k in ("used", "cached", "unmapped")]
    return legend_beside(ax, handles)
