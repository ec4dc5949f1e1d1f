"""Memory over time: live and reserved bytes, and the cap, over the events of a
trace replayed on the simulated device or of a heap's recorded history, with the
peak, the remaps and any OOM marked.

    tl = gpumem.memory_over_time("gpt2_varlen", capacity="20GiB")   # a trace, replayed
    tl = gpumem.memory_over_time(heap)          # a heap's history (record_history first)
    tl.to_html("timeline.html"); tl.plot()      # offline HTML (inline SVG) / matplotlib

`python -m gpumem replay TRACE --html OUT.html` and the HTML of a Snapshot (its
Jupyter view and to_html) show this view under the memory map.

The x axis counts events: a trace's alloc and free events, or the history's
entries (alloc, free, map, unmap, remap, oom, empty_cache).  A trace of up to
`points` events is drawn event by event; a longer one is replayed in steps of
several events, and each point is then the largest value within its step
(counting the state the step starts from), so no peak is lost between points.
The cap is drawn when it is within reach of the curves or when a request failed.
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ._units import format_size, parse_size

__all__ = ["Timeline", "from_trace", "from_history", "from_snapshot"]

DEFAULT_POINTS = 2000
LIVE_COLOR = "#3b6fb6"
RESERVED_COLOR = "#9ec5ea"
CAP_COLOR = "#c0392b"
REMAP_COLOR = "#e8871e"
OOM_COLOR = "#d62728"


@dataclass
class Timeline:
    """Live / reserved bytes at event indices x (same length lists)."""

    label: str
    x: List[int]
    live: List[int]
    reserved: List[int]
    n_events: int
    cap_bytes: int = 0  # 0: no cap known
    step: int = 1  # events per point (1: exact)
    remaps: List[Tuple[int, int]] = field(default_factory=list)  # (event, how many remaps there)
    ooms: List[Tuple[int, int]] = field(default_factory=list)  # (event, bytes requested; 0 unknown)
    source: str = "trace"  # "trace" or "history"

    # ---- figures ------------------------------------------------------------------------

    @property
    def peak_live(self) -> Tuple[int, int]:
        """(event, bytes) of the first point where live memory is largest."""
        return self._peak(self.live)

    @property
    def peak_reserved(self) -> Tuple[int, int]:
        return self._peak(self.reserved)

    def _peak(self, ys: List[int]) -> Tuple[int, int]:
        if not ys:
            return (0, 0)
        i = max(range(len(ys)), key=lambda k: (ys[k], -k))
        return (self.x[i], ys[i])

    @property
    def n_remaps(self) -> int:
        return sum(n for _, n in self.remaps)

    def __repr__(self) -> str:
        px, pl = self.peak_live
        return (
            f"<gpumem.Timeline {self.label}: {len(self.x)} points over {self.n_events} events, "
            f"peak live {format_size(pl)} at event {px}, peak reserved {format_size(self.peak_reserved[1])}, "
            f"{self.n_remaps} remaps, {len(self.ooms)} OOMs>"
        )

    # ---- pictures -----------------------------------------------------------------------

    def to_svg(self, width: int = 960, height: int = 300) -> str:
        return render_svg(self, width=width, height=height)

    def _repr_html_(self) -> str:
        return self.to_svg()

    def to_html(self, path=None, title: Optional[str] = None) -> str:
        """A self-contained HTML page (inline SVG, no network); written to `path` when given."""
        title = title or f"gpumem: memory over time, {self.label}"
        page = (
            "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
            f"<title>{html.escape(title)}</title></head><body style='font-family:sans-serif'>"
            f"<h2>{html.escape(title)}</h2>{self.to_svg()}"
            "<p style='color:#666;font-size:12px'>Made by gpumem; this file needs no network.</p>"
            "</body></html>\n"
        )
        if path is not None:
            with open(os.fspath(path), "w", encoding="utf-8") as f:
                f.write(page)
        return page

    def plot(self, ax=None):
        """Draw it with matplotlib; returns the Axes."""
        return plot_matplotlib(self, ax=ax)


# ---- building ----------------------------------------------------------------------------


def from_trace(
    trace,
    capacity: int = 80 << 30,
    points: int = DEFAULT_POINTS,
    heap_kwargs: Optional[dict] = None,
    event_delay: int = 0,
) -> Timeline:
    """Replay `trace` (a gpumem.trace.Trace, a path or a shipped trace's name) on a
    fresh sim heap of `capacity` bytes (events completing `event_delay` device
    operations late, as in replay), reading live and reserved memory every
    ceil(events / points) events (the largest value of each step)."""
    # not at import: `import gpumem` needs neither the trace reader nor replay's statistics
    from .replay import _check_event_delay, _heap, _raise_on_error, _slot_table
    from .trace import Trace, load_trace

    if not isinstance(trace, Trace):
        trace = load_trace(trace)
    capacity = parse_size(capacity)
    n = trace.n_events
    step = max(1, math.ceil(n / max(1, points)))
    heap = _heap(capacity, heap_kwargs, _check_event_delay(event_delay))
    x, live, reserved = [0], [0], [0]
    remaps: List[Tuple[int, int]] = []
    ooms: List[Tuple[int, int]] = []
    try:
        slots, live_bytes = _slot_table(trace), 0
        done_remaps = 0
        for start, events in trace.chunks(step):
            heap.reset_peak_stats()
            r = heap.replay(events, trace.n_slots, slots=slots, live_bytes=live_bytes)
            live_bytes = r["live_bytes"]
            _raise_on_error(r, trace, start)
            s = heap.stats()
            end = start + len(events) // 24
            x.append(end)
            # one event per step: the value after it; more: the largest in the step
            kind = "current" if step == 1 else "peak"
            live.append(s[f"requested_bytes.all.{kind}"])
            reserved.append(s[f"reserved_bytes.all.{kind}"])
            if s["num_remaps"] > done_remaps:
                remaps.append((end, s["num_remaps"] - done_remaps))
                done_remaps = s["num_remaps"]
            if r["ooms"]:
                first = start + r["first_oom_event"]
                ooms.append((first, _event_size(trace, first)))
                if r["ooms"] > 1:
                    ooms.extend([(end, 0)] * (r["ooms"] - 1))
    finally:
        heap.close()
    return Timeline(
        label=trace.name,
        x=x,
        live=live,
        reserved=reserved,
        n_events=n,
        cap_bytes=capacity,
        step=step,
        remaps=remaps,
        ooms=ooms,
        source="trace",
    )


def _event_size(trace, i: int) -> int:
    w = trace.words
    return int(w[3 * i + 1]) if 0 <= i < trace.n_events else 0


def from_history(
    entries,
    *,
    final_live: Optional[int] = None,
    final_reserved: Optional[int] = None,
    cap_bytes: int = 0,
    label: str = "history",
) -> Timeline:
    """A timeline from history entries (HistoryEntry or the (time, action, addr,
    size, stream, context) tuples Heap.history() gives), oldest first.

    Live grows at each alloc and shrinks at each free_requested; reserved grows at
    each map and remap and shrinks at each unmap.  When older entries were
    dropped from the ring, final_live / final_reserved (the heap's figures now)
    anchor the curves so that they end where the heap is."""
    actions = []
    for e in entries:
        if hasattr(e, "action"):
            actions.append((e.action, int(e.size)))
        else:
            actions.append((e[1], int(e[3])))
    lv = rv = 0
    x, live, reserved = [0], [0], [0]
    remaps: List[Tuple[int, int]] = []
    ooms: List[Tuple[int, int]] = []
    for i, (a, size) in enumerate(actions, 1):
        if a == "alloc":
            lv += size
        elif a == "free_requested":
            lv -= size
        elif a in ("map", "remap"):
            rv += size
            if a == "remap":
                remaps.append((i, 1))
        elif a == "unmap":
            rv -= size
        elif a == "oom":
            ooms.append((i, size))
        else:
            continue
        x.append(i)
        live.append(lv)
        reserved.append(rv)
    dl = 0 if final_live is None else final_live - lv
    dr = 0 if final_reserved is None else final_reserved - rv
    if dl or dr:
        live = [v + dl for v in live]
        reserved = [v + dr for v in reserved]
    return Timeline(
        label=label,
        x=x,
        live=live,
        reserved=reserved,
        n_events=len(actions),
        cap_bytes=cap_bytes,
        step=1,
        remaps=remaps,
        ooms=ooms,
        source="history",
    )


def from_snapshot(snap) -> Optional[Timeline]:
    """The timeline of a Snapshot's history, anchored at the snapshot's live and
    reserved bytes; None when the snapshot holds no history."""
    if not snap.history:
        return None
    s = snap.summary
    return from_history(
        snap.history,
        final_live=s.live_bytes,
        final_reserved=s.reserved_bytes,
        cap_bytes=snap.cap_bytes,
        label=snap.label or snap.device_name,
    )


# ---- the SVG -------------------------------------------------------------------------------


def _esc(s) -> str:
    return html.escape(str(s), quote=True)


def _envelope(tl: Timeline, max_points: int):
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


def render_svg(tl: Timeline, width: int = 960, height: int = 300) -> str:
    left, right, top_pad, bottom = 78, 16, 46, 40
    pw, ph = width - left - right, height - top_pad - bottom
    pts = _envelope(tl, max(2, pw))
    x_max = max(tl.n_events, 1)
    peak_r = max(tl.reserved) if tl.reserved else 0
    peak_l = max(tl.live) if tl.live else 0
    top = max(peak_r, peak_l, 1)
    show_cap = bool(tl.cap_bytes) and (tl.cap_bytes <= 1.5 * top or bool(tl.ooms))
    if show_cap:
        top = max(top, tl.cap_bytes)
    top = int(top * 1.08) + 1

    def X(e):
        return left + pw * (e / x_max)

    def Y(b):
        return top_pad + ph * (1 - b / top)

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
    px, pl = tl.peak_live
    every = "" if tl.step == 1 else f"; each point is the largest of {tl.step} events"
    w(f'<text x="4" y="14" font-size="13" font-weight="bold">Memory over time: {_esc(tl.label)}</text>')
    w(
        f'<text x="4" y="30">peak live {_esc(format_size(pl))} at event {px}, peak reserved '
        f"{_esc(format_size(peak_r))}, {tl.n_remaps} remaps, {len(tl.ooms)} OOMs"
        f"{_esc(every)}</text>"
    )
    # axes and grid
    w(f'<rect x="{left}" y="{top_pad}" width="{pw}" height="{ph}" fill="#fafafa" stroke="#ccc"/>')
    for v in _byte_ticks(top):
        y = Y(v)
        if y < top_pad - 0.5:
            continue
        w(f'<path d="M{left} {y:.1f}h{pw}" stroke="#e4e4e4"/>')
        w(f'<text x="{left - 4}" y="{y + 4:.1f}" text-anchor="end" font-size="10">{_esc(format_size(v))}</text>')
    xs = _nice_step(x_max, 8)
    k = 0
    while k * xs <= x_max:
        xv = X(k * xs)
        w(f'<path d="M{xv:.1f} {top_pad + ph}v4" stroke="#888"/>')
        w(f'<text x="{xv:.1f}" y="{top_pad + ph + 15}" text-anchor="middle" font-size="10">{int(k * xs)}</text>')
        k += 1
    w(
        f'<text x="{left + pw / 2:.0f}" y="{height - 6}" text-anchor="middle">'
        f"{'trace event' if tl.source == 'trace' else 'history entry'}</text>"
    )

    def area(ys_index, cls, color, title):
        d = [f"M{X(pts[0][0]):.1f} {Y(0):.1f}"]
        prev = None
        for p in pts:
            xv, yv = X(p[0]), Y(p[ys_index])
            if prev is not None:
                d.append(f"L{xv:.1f} {prev:.1f}")  # steps: the value holds until the next event
            d.append(f"L{xv:.1f} {yv:.1f}")
            prev = yv
        d.append(f"L{X(pts[-1][0]):.1f} {Y(0):.1f}Z")
        w(
            f'<path class="{cls}" d="{"".join(d)}" fill="{color}" stroke="{color}" stroke-width="0.8">'
            f"<title>{_esc(title)}</title></path>"
        )

    area(2, "tl-reserved", RESERVED_COLOR, f"reserved (held from the device); peak {format_size(peak_r)}")
    area(1, "tl-live", LIVE_COLOR, f"live (allocated to tensors); peak {format_size(peak_l)}")
    if show_cap:
        yc = Y(tl.cap_bytes)
        w(
            f'<g class="tl-cap"><title>{_esc(f"cap {format_size(tl.cap_bytes)}")}</title>'
            f'<path d="M{left} {yc:.1f}h{pw}" stroke="{CAP_COLOR}" stroke-dasharray="6 4" stroke-width="1.5"/>'
            f'<text x="{left + pw - 4}" y="{yc - 4:.1f}" text-anchor="end" fill="{CAP_COLOR}">'
            f"cap {_esc(format_size(tl.cap_bytes))}</text></g>"
        )
    elif tl.cap_bytes:
        w(
            f'<text class="tl-cap" x="{left + pw - 4}" y="{top_pad + 12}" text-anchor="end" fill="{CAP_COLOR}">'
            f"cap {_esc(format_size(tl.cap_bytes))} (above the chart)</text>"
        )
    for e, n in tl.remaps:
        xv = X(e)
        w(
            f'<path class="tl-remap" d="M{xv:.1f} {top_pad + ph}v-9" stroke="{REMAP_COLOR}" stroke-width="1.5">'
            f"<title>{_esc(f'{n} remap(s) by event {e}: free pages mapped again behind a new address')}</title></path>"
        )
    for e, size in tl.ooms:
        xv = X(e)
        what = f"OOM at event {e}" + (f": a request of {format_size(size)} failed" if size else "")
        w(
            f'<path class="tl-oom" d="M{xv:.1f} {top_pad}v{ph}" stroke="{OOM_COLOR}" stroke-width="1.5">'
            f"<title>{_esc(what)}</title></path>"
        )
    # the peak
    xp, yp = X(px), Y(pl)
    w(
        f'<g class="tl-peak"><title>{_esc(f"peak live {format_size(pl)} at event {px}")}</title>'
        f'<circle cx="{xp:.1f}" cy="{yp:.1f}" r="4" fill="#fff" stroke="#000" stroke-width="1.5"/>'
        f'<text x="{min(xp + 6, left + pw - 90):.1f}" y="{max(yp - 6, top_pad + 10):.1f}" font-size="10">'
        f"peak {_esc(format_size(pl))}</text></g>"
    )
    # legend
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
    w("</svg>")
    return "".join(out)


def plot_matplotlib(tl: Timeline, ax=None):
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(12, 3.6))
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
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    return ax
