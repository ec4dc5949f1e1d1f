"""Memory over time: live and reserved bytes, and the cap, over the events of a
trace replayed on the simulated device or of a heap's recorded history, with the
peak, the remaps and any OOM marked.

    tl = gpumem.memory_over_time("gpt2_varlen", capacity="20GiB")   # a trace, replayed
    tl = gpumem.memory_over_time(heap)          # a heap's history (record_history first)
    tl.to_html("timeline.html"); tl.plot()      # offline HTML (inline SVG) / matplotlib

`python -m gpumem replay TRACE --html OUT.html` and the HTML of a Snapshot (its
Jupyter view and to_html) show this view under the memory map.  This module is
the data; gpumem/draw/timeline.py draws it.

The x axis counts events: a trace's alloc and free events, or the history's
entries (alloc, free, map, unmap, remap, oom, empty_cache).  A trace of up to
`points` events is drawn event by event; a longer one is replayed in steps of
several events, and each point is then the largest value within its step
(counting the state the step starts from), so no peak is lost between points.
The cap is drawn when it is within reach of the curves or when a request failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from ._units import format_size, parse_size
from .draw.timeline import plot_matplotlib, render_page, render_svg

__all__ = ["Timeline", "from_trace", "from_history", "from_snapshot"]

DEFAULT_POINTS = 2000


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
        return render_page(self, path, title)

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
    tl = Timeline(trace.name, [0], [0], [0], n, cap_bytes=capacity, step=step, source="trace")
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
            tl.x.append(end)
            # one event per step: the value after it; more: the largest in the step
            kind = "current" if step == 1 else "peak"
            tl.live.append(s[f"requested_bytes.all.{kind}"])
            tl.reserved.append(s[f"reserved_bytes.all.{kind}"])
            if s["num_remaps"] > done_remaps:
                tl.remaps.append((end, s["num_remaps"] - done_remaps))
                done_remaps = s["num_remaps"]
            if r["ooms"]:
                first = start + r["first_oom_event"]
                tl.ooms.append((first, _event_size(trace, first)))
                if r["ooms"] > 1:
                    tl.ooms.extend([(end, 0)] * (r["ooms"] - 1))
    finally:
        heap.close()
    return tl


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
    tl = Timeline(label, [0], [0], [0], len(actions), cap_bytes=cap_bytes, step=1, source="history")
    for i, (a, size) in enumerate(actions, 1):
        if a == "alloc":
            lv += size
        elif a == "free_requested":
            lv -= size
        elif a in ("map", "remap"):
            rv += size
            if a == "remap":
                tl.remaps.append((i, 1))
        elif a == "unmap":
            rv -= size
        elif a == "oom":
            tl.ooms.append((i, size))
        else:
            continue
        tl.x.append(i)
        tl.live.append(lv)
        tl.reserved.append(rv)
    dl = 0 if final_live is None else final_live - lv
    dr = 0 if final_reserved is None else final_reserved - rv
    if dl or dr:
        tl.live = [v + dl for v in tl.live]
        tl.reserved = [v + dr for v in tl.reserved]
    return tl


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
