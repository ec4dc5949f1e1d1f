"""Memory over time, drawn: an inline SVG (for Jupyter and offline HTML), an
HTML page and a matplotlib plot of a gpumem.Timeline (live and reserved bytes
as step areas, the cap, the remaps and OOMs as marks, the peak).  The model of
the curves, and how a trace or a history gives them, is gpumem/timeline.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

from .._units import format_size
from . import esc, legend_beside, new_axes, write_page

__all__ = ["render_svg", "render_page", "plot_matplotlib"]

LIVE_COLOR = "#3b6fb6"
RESERVED_COLOR = "#9ec5ea"
CAP_COLOR = "#c0392b"
REMAP_COLOR = "#e8871e"
OOM_COLOR = "#d62728"


def _envelope(tl, max_points: int):
    """At most max_points (x, live, reserved), each the largest of its bucket."""
    n = len(tl.x)
    if n <= max_points:
        return list(zip(tl.x, tl.live, tl.reserved))
    per = math.ceil(n / max_points)
    out = []
    for i in range(0, n, per):
        j = min(n, i + per)
        out.append((tl.x[j - 1], max(tl.live[i:j]), max(tl.reserved[i:j])))
    return out


def _nice_step(span: float, ticks: int = 5) -> float:
    raw = span / max(ticks, 1)
    if raw <= 0:
        return 1.0
    mag = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _byte_ticks(top: int, ticks: int = 5) -> List[int]:
    """Tick values in round binary units (MiB / GiB multiples)."""
    unit = 1 << 30 if top >= 4 << 30 else 1 << 20 if top >= 4 << 20 else 1 << 10
    step = max(1, _nice_step(top / unit, ticks)) * unit
    return [int(k * step) for k in range(int(top // step) + 1)]


@dataclass
class _Chart:
    """The plot area of the SVG: events to x, bytes to y."""

    left: int
    top_pad: int
    pw: int
    ph: int
    x_max: int
    top: int

    def X(self, e):
        return self.left + self.pw * (e / self.x_max)

    def Y(self, b):
        return self.top_pad + self.ph * (1 - b / self.top)


def render_svg(tl, width: int = 960, height: int = 300) -> str:
    left, right, top_pad, bottom = 78, 16, 46, 40
    pw, ph = width - left - right, height - top_pad - bottom
    peak_r = max(tl.reserved) if tl.reserved else 0
    peak_l = max(tl.live) if tl.live else 0
    top = max(peak_r, peak_l, 1)
    show_cap = bool(tl.cap_bytes) and (tl.cap_bytes <= 1.5 * top or bool(tl.ooms))
    if show_cap:
        top = max(top, tl.cap_bytes)
    c = _Chart(left, top_pad, pw, ph, max(tl.n_events, 1), int(top * 1.08) + 1)
    out: List[str] = []
    w = out.append
    w(
        f'<svg xmlns="http://www.w3.org/2000/svg" class="gpumem-timeline" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">'
    )
    w(
        "<style>.gpumem-timeline text{fill:#222}.gpumem-timeline .tl-remap:hover,"
        ".gpumem-timeline .tl-oom:hover{stroke-width:3}</style>"
    )
    _heading(w, tl, peak_r)
    _axes(w, c, tl, height)
    pts = _envelope(tl, max(2, pw))
    _area(w, c, pts, 2, "tl-reserved", RESERVED_COLOR, f"reserved (held from the device); peak {format_size(peak_r)}")
    _area(w, c, pts, 1, "tl-live", LIVE_COLOR, f"live (allocated to tensors); peak {format_size(peak_l)}")
    _cap(w, c, tl, show_cap)
    _marks(w, c, tl)
    _legend(w, left)
    w("</svg>")
    return "".join(out)


def _heading(w, tl, peak_r: int) -> None:
    px, pl = tl.peak_live
    every = "" if tl.step == 1 else f"; each point is the largest of {tl.step} events"
    w(f'<text x="4" y="14" font-size="13" font-weight="bold">Memory over time: {esc(tl.label)}</text>')
    w(
        f'<text x="4" y="30">peak live {esc(format_size(pl))} at event {px}, peak reserved '
        f"{esc(format_size(peak_r))}, {tl.n_remaps} remaps, {len(tl.ooms)} OOMs"
        f"{esc(every)}</text>"
    )


def _axes(w, c: _Chart, tl, height: int) -> None:
    """The plot area, the byte grid on the left and the event ticks below."""
    left, top_pad, pw, ph = c.left, c.top_pad, c.pw, c.ph
    w(f'<rect x="{left}" y="{top_pad}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>')
    for v in _byte_ticks(c.top):
        y = c.Y(v)
        if y < top_pad - 0.5:
            continue
        w(f'<path d="M{left} {y:.1f}h{pw}" stroke="#e4e4e4"/>')
        w(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{esc(format_size(v))}</text>')
    xs = _nice_step(c.x_max, 8)
    k = 0
    while k * xs <= c.x_max:
        xv = c.X(k * xs)
        w(f'<path d="M{xv:.1f} {top_pad + ph}v4" stroke="#888"/>')
        w(f'<text x="{xv:.1f}" y="{top_pad + ph + 15}" text-anchor="middle" font-size="10">{int(k * xs)}</text>')
        k += 1
    w(
        f'<text x="{left + pw / 2:.0f}" y="{height - 6}" text-anchor="middle">'
        f"{'trace event' if tl.source == 'trace' else 'history entry'}</text>"
    )


def _area(w, c: _Chart, pts, ys_index: int, cls: str, color: str, title: str) -> None:
    """A step area: the value holds until the next point."""
    d = [f"M{c.X(pts[0][0]):.1f} {c.Y(0):.1f}"]
    prev = None
    for p in pts:
        xv, yv = c.X(p[0]), c.Y(p[ys_index])
        if prev is not None:
            d.append(f"L{xv:.1f} {prev:.1f}")  # steps: the value holds until the next event
        d.append(f"L{xv:.1f} {yv:.1f}")
        prev = yv
    d.append(f"L{c.X(pts[-1][0]):.1f} {c.Y(0):.1f}Z")
    w(
        f'<path class="{cls}" d="{"".join(d)}" fill="{color}" stroke="{color}" stroke-width="0.8">'
        f"<title>{esc(title)}</title></path>"
    )


def _cap(w, c: _Chart, tl, show_cap: bool) -> None:
    left, pw = c.left, c.pw
    if show_cap:
        yc = c.Y(tl.cap_bytes)
        w(
            f'<g class="tl-cap"><title>{esc(f"cap {format_size(tl.cap_bytes)}")}</title>'
            f'<path d="M{left} {yc:.1f}h{pw}" stroke="{CAP_COLOR}" stroke-dasharray="6 4" stroke-width="1.5"/>'
            f'<text x="{left + pw - 4}" y="{yc - 4:.1f}" text-anchor="end" fill="{CAP_COLOR}">'
            f"cap {esc(format_size(tl.cap_bytes))}</text></g>"
        )
    elif tl.cap_bytes:
        w(
            f'<text class="tl-cap" x="{left + pw - 4}" y="{c.top_pad + 12}" text-anchor="end" fill="{CAP_COLOR}">'
            f"cap {esc(format_size(tl.cap_bytes))} (above the chart)</text>"
        )


def _marks(w, c: _Chart, tl) -> None:
    """The remaps along the bottom, the OOMs across the chart, the peak."""
    top_pad, ph = c.top_pad, c.ph
    for e, n in tl.remaps:
        xv = c.X(e)
        w(
            f'<path class="tl-remap" d="M{xv:.1f} {top_pad + ph}v-9" stroke="{REMAP_COLOR}" stroke-width="1.5">'
            f"<title>{esc(f'{n} remap(s) by event {e}: free pages mapped again behind a new address')}</title></path>"
        )
    for e, size in tl.ooms:
        xv = c.X(e)
        what = f"OOM at event {e}" + (f": a request of {format_size(size)} failed" if size else "")
        w(
            f'<path class="tl-oom" d="M{xv:.1f} {top_pad}v{ph}" stroke="{OOM_COLOR}" stroke-width="1.5">'
            f"<title>{esc(what)}</title></path>"
        )
    px, pl = tl.peak_live
    xp, yp = c.X(px), c.Y(pl)
    w(
        f'<g class="tl-peak"><title>{esc(f"peak live {format_size(pl)} at event {px}")}</title>'
        f'<circle cx="{xp:.1f}" cy="{yp:.1f}" r="4" fill="#fff" stroke="#000" stroke-width="1.5"/>'
        f'<text x="{min(xp + 6, c.left + c.pw - 90):.1f}" y="{max(yp - 6, top_pad + 10):.1f}" font-size="10">'
        f"peak {esc(format_size(pl))}</text></g>"
    )


def _legend(w, left: int) -> None:
    x = left + 4
    items = [
        ("live", LIVE_COLOR),
        ("reserved", RESERVED_COLOR),
        ("cap", CAP_COLOR),
        ("remap", REMAP_COLOR),
        ("OOM", OOM_COLOR),
    ]
    for name, color in items:
        w(
            f'<rect x="{x}" y="36" width="12" height="6" fill="{color}"/><text x="{x + 15}" y="43" '
            f'font-size="10">{name}</text>'
        )
        x += 26 + 6 * len(name)


def render_page(tl, path=None, title: Optional[str] = None) -> str:
    """A self-contained HTML page (inline SVG, no network); written to `path` when given."""
    title = title or f"gpumem: memory over time, {tl.label}"
    page = (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        f"<title>{esc(title)}</title></head><body style='font-family:sans-serif'>"
        f"<h2>{esc(title)}</h2>{render_svg(tl)}"
        "<p style='color:#666;font-size:12px'>Made by gpumem; this file needs no network.</p>"
        "</body></html>\n"
    )
    return write_page(path, page)


def plot_matplotlib(tl, ax=None):
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax = new_axes(ax, (12, 3.6))
    gib = float(1 << 30)
    unit, uname = (gib, "GiB") if max(tl.reserved + [tl.cap_bytes or 0]) >= (1 << 30) else (float(1 << 20), "MiB")
    xs = tl.x
    ax.fill_between(xs, [v / unit for v in tl.reserved], step="post", color=RESERVED_COLOR, label="reserved")
    ax.fill_between(xs, [v / unit for v in tl.live], step="post", color=LIVE_COLOR, label="live")
    top = max(max(tl.reserved or [0]), max(tl.live or [0]), 1)
    handles = [Patch(color=LIVE_COLOR, label="live"), Patch(color=RESERVED_COLOR, label="reserved")]
    if tl.cap_bytes and (tl.cap_bytes <= 1.5 * top or tl.ooms):
        ax.axhline(tl.cap_bytes / unit, color=CAP_COLOR, linestyle="--", linewidth=1.2)
        handles.append(Line2D([], [], color=CAP_COLOR, linestyle="--", label=f"cap {format_size(tl.cap_bytes)}"))
        top = max(top, tl.cap_bytes)
    for e, _ in tl.remaps:
        ax.axvline(e, ymax=0.04, color=REMAP_COLOR, linewidth=1)
    if tl.remaps:
        handles.append(Line2D([], [], color=REMAP_COLOR, label=f"remaps ({tl.n_remaps})"))
    for e, _ in tl.ooms:
        ax.axvline(e, color=OOM_COLOR, linewidth=1.2)
    if tl.ooms:
        handles.append(Line2D([], [], color=OOM_COLOR, label=f"OOM ({len(tl.ooms)})"))
    px, pl = tl.peak_live
    ax.plot([px], [pl / unit], marker="o", markerfacecolor="white", markeredgecolor="black")
    right = px > 0.75 * max(tl.n_events, 1)
    ax.annotate(
        f"peak live {format_size(pl)}",
        (px, pl / unit),
        textcoords="offset points",
        xytext=(-6 if right else 6, 6),
        ha="right" if right else "left",
        fontsize=8,
    )
    ax.set_xlim(0, max(tl.n_events, 1))
    ax.set_ylim(0, top * 1.08 / unit)
    ax.set_xlabel("trace event" if tl.source == "trace" else "history entry")
    ax.set_ylabel(uname)
    ax.set_title(f"Memory over time: {tl.label}", fontsize=10)
    return legend_beside(ax, handles)
