"""Replay allocation traces on a simulated heap: peak memory, OOMs, speed, and the
smallest capacity in which a trace fits.

The replay loop itself runs in C (Heap.replay), so the timings measure the core
and not the interpreter.  Memory figures come from one pass and timings from a
separate pass on a fresh heap, so that taking per-op timestamps cannot disturb
what is measured, nor a progress bar the timings.

By default the simulated device completes every event at once: memory a stream
freed is safe for the others as soon as they ask.  `event_delay=N` makes events
recorded on any stream but the legacy default stream 0 complete only after N
further device operations (or at a synchronize), as work still queued on a real
GPU would: a trace with several streams then reuses across streams later, and
its peak reserved memory is closer to what the GPU sees.  Single-stream traces
(stream 0 only) are unaffected.
"""

from __future__ import annotations

import os
import statistics
from array import array
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional, Tuple

from ._units import format_size
from .trace import Trace

__all__ = ["ReplayResult", "replay", "replay_trace", "fits", "min_capacity", "DEFAULT_CAPACITY", "MiB"]

MiB = 1 << 20
DEFAULT_CAPACITY = 80 << 30
# Chunk size for replays with a progress callback: large enough that the per-call
# overhead vanishes, small enough that the bar moves several times a second.
CHUNK_EVENTS = 1 << 16

Progress = Callable[[int, int], None]  # (events done, events total)


@dataclass
class ReplayResult:
    trace: str
    events: int
    allocs: int
    frees: int
    capacity_bytes: int
    peak_live_bytes: int  # largest sum of live sizes as requested
    peak_allocated_bytes: int  # the same, in the heap's 512-byte-rounded block sizes
    peak_reserved_bytes: int
    ooms: int
    first_oom_event: int  # -1 if none
    remaps: int
    num_maps: int
    num_unmaps: int
    num_pages_remapped: int
    num_device_alloc: int
    num_device_free: int
    num_alloc_retries: int
    num_slow_allocs: int
    ns_per_op: Optional[float] = None
    spilled_peak_bytes: int = 0  # the most host memory spill held at once (spill on: heap_kwargs' spill)
    num_spills: int = 0
    min_capacity_bytes: Optional[int] = None
    event_delay: int = 0  # see the module docstring
    extra: dict = field(default_factory=dict)

    def __repr__(self) -> str:
        name = os.path.basename(self.trace)
        return (
            f"<gpumem ReplayResult {name}: {self.events} events at {format_size(self.capacity_bytes)}, peak live "
            f"{format_size(self.peak_live_bytes)}, peak reserved {format_size(self.peak_reserved_bytes)}, "
            f"{self.ooms} OOMs, {self.remaps} remaps>"
        )

    def to_json(self) -> dict:
        d = asdict(self)
        extra = d.pop("extra")
        if d["ns_per_op"] is None:
            del d["ns_per_op"]
        if d["min_capacity_bytes"] is None:
            del d["min_capacity_bytes"]
        d.update(extra)
        return d


def _check_event_delay(event_delay) -> int:
    if isinstance(event_delay, bool) or not isinstance(event_delay, int):
        raise TypeError(f"event_delay must be an int, not {type(event_delay).__name__}")
    if event_delay < 0:
        raise ValueError(f"event_delay must not be negative, got {event_delay}")
    return event_delay


# The simulated device's page when none is given (gm_sim_create).
SIM_PAGE_DEFAULT = 2 * MiB


def _heap(capacity: int, heap_kwargs: Optional[dict], event_delay: int = 0):
    from ._C import Heap  # the extension is only needed once something replays

    kw = dict(heap_kwargs or {})
    try:
        heap = Heap(device="sim", capacity=capacity, **kw)
    except ValueError as e:
        # The core makes no heap on a device smaller than one page; a device of
        # one page capped at `capacity` replays the same way (nothing fits).
        if "page size exceeds the device's memory" not in str(e) or "cap" in kw:
            raise
        heap = Heap(device="sim", capacity=kw.get("page_size") or SIM_PAGE_DEFAULT, cap=capacity, **kw)
    if event_delay:
        heap.sim_set_event_delay(event_delay)
    return heap


def replay_trace(heap, trace: Trace, progress: Optional[Progress] = None, chunk: int = CHUNK_EVENTS) -> dict:
    """Replay `trace` on `heap` (memory pass, no timing).

    Returns the summed replay counters: allocs, frees, ooms, first_oom_event.
    With `progress`, the events go in chunks that share one slot table, so that
    frees in a later chunk find the blocks an earlier one allocated.
    """
    total = trace.n_events
    if progress is None:
        r = heap.replay(trace.events, trace.n_slots)
        _raise_on_error(r, trace, 0)
        return {k: r[k] for k in ("allocs", "frees", "ooms", "first_oom_event")}
    slots, live = _slot_table(trace), 0
    out = {"allocs": 0, "frees": 0, "ooms": 0, "first_oom_event": -1}
    progress(0, total)
    for start, events in trace.chunks(chunk):
        r = heap.replay(events, trace.n_slots, slots=slots, live_bytes=live)
        live = r["live_bytes"]
        _raise_on_error(r, trace, start)
        out["allocs"] += r["allocs"]
        out["frees"] += r["frees"]
        out["ooms"] += r["ooms"]
        if out["first_oom_event"] < 0 and r["first_oom_event"] >= 0:
            out["first_oom_event"] = start + r["first_oom_event"]
        progress(start + len(events) // 24, total)
    return out


def _slot_table(trace: Trace) -> array:
    """A zeroed slot table that chunks of `trace` replayed one after another share."""
    return array("Q", bytes(8 * max(trace.n_slots, 1)))[: trace.n_slots]


def _raise_on_error(r: dict, trace: Trace, offset: int) -> None:
    if r.get("error", 0):
        raise RuntimeError(
            f"{trace.path}: replay stopped by {r.get('error_name', r['error'])} "
            f"near event {offset + r['allocs'] + r['frees']}"
        )


def time_trace(trace: Trace, capacity: int, heap_kwargs: Optional[dict] = None, event_delay: int = 0) -> float:
    """Median wall time of one event in the core, in ns, from a fresh heap."""
    if trace.n_events == 0:
        return 0.0
    heap = _heap(capacity, heap_kwargs, _check_event_delay(event_delay))
    try:
        r = heap.replay(trace.events, trace.n_slots, timing=True)
    finally:
        heap.close()
    return float(statistics.median(r["op_ns"]))


def replay(
    trace: Trace,
    capacity: int = DEFAULT_CAPACITY,
    *,
    timing: bool = True,
    progress: Optional[Progress] = None,
    heap_kwargs: Optional[dict] = None,
    chunk: int = CHUNK_EVENTS,
    event_delay: int = 0,
) -> ReplayResult:
    """Replay `trace` on a fresh sim heap of `capacity` bytes and measure it.

    `event_delay`: events on streams other than 0 complete only after that many
    further device operations (see the module docstring); 0 completes them at once.
    """
    event_delay = _check_event_delay(event_delay)
    heap = _heap(capacity, heap_kwargs, event_delay)
    try:
        counts = replay_trace(heap, trace, progress, chunk)
        s = heap.stats()
    finally:
        heap.close()
    result = ReplayResult(
        trace=trace.path,
        events=trace.n_events,
        allocs=counts["allocs"],
        frees=counts["frees"],
        capacity_bytes=capacity,
        # Peak live counts the sizes as asked for (torch's requested_bytes), as the
        # traces README does: traces hold unrounded sizes (8, 3312, ...), and the
        # heap's 512-byte rounding is its own overhead, reported separately.
        peak_live_bytes=s["requested_bytes.all.peak"],
        peak_allocated_bytes=s["allocated_bytes.all.peak"],
        peak_reserved_bytes=s["reserved_bytes.all.peak"],
        ooms=counts["ooms"],
        first_oom_event=counts["first_oom_event"],
        remaps=s["num_remaps"],
        **{name: s[name] for name in _COUNTERS},
        spilled_peak_bytes=s.get("spilled_bytes.all.peak", 0),
        num_spills=s.get("num_spills", 0),
        event_delay=event_delay,
    )
    if timing:
        result.ns_per_op = time_trace(trace, capacity, heap_kwargs, event_delay)
    return result


# the heap's counters a ReplayResult carries under their own names
_COUNTERS = (
    "num_maps",
    "num_unmaps",
    "num_pages_remapped",
    "num_device_alloc",
    "num_device_free",
    "num_alloc_retries",
    "num_slow_allocs",
)


def fits(trace: Trace, capacity: int, heap_kwargs: Optional[dict] = None, event_delay: int = 0) -> bool:
    """True if `trace` replays with no OOM on a fresh heap of `capacity` bytes."""
    heap = _heap(capacity, heap_kwargs, _check_event_delay(event_delay))
    try:
        return replay_trace(heap, trace)["ooms"] == 0
    finally:
        heap.close()


def _narrow(lo: int, hi: int, holds: Callable[[int], bool]) -> Tuple[int, int]:
    """Bisect lo < hi, where `holds` is true at lo and false at hi (and flips once
    between them), down to the adjacent pair (last that holds, first that does not)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if holds(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def min_capacity(
    trace: Trace,
    precision: int = MiB,
    heap_kwargs: Optional[dict] = None,
    on_probe: Optional[Callable[[int, bool], None]] = None,
    limit: int = 1 << 50,
    event_delay: int = 0,
) -> int:
    """Smallest capacity (a multiple of `precision`) at which `trace` replays with no OOM.

    Nothing fits below the trace's peak live bytes, so the search starts there;
    the upper bound starts at twice that and doubles until the trace fits.  It
    assumes that more capacity never hurts, which holds for any sane allocator
    and is what the tests check around the answer.
    """
    if precision <= 0:
        raise ValueError("precision must be positive")
    event_delay = _check_event_delay(event_delay)

    def probe(units: int) -> bool:
        ok = fits(trace, units * precision, heap_kwargs, event_delay)
        if on_probe:
            on_probe(units * precision, ok)
        return ok

    peak = trace.peak_live_bytes
    lo = max(-(-peak // precision) - 1, 0)  # lo * precision < peak, or 0: cannot fit
    hi = max(lo + 1, -(-2 * peak // precision), 1)
    while not probe(hi):
        lo = hi
        hi *= 2
        if hi * precision > limit:
            raise RuntimeError(f"{trace.path}: does not replay without OOM even at {format_size(lo * precision)}")
    return _narrow(lo, hi, lambda units: not probe(units))[1] * precision
