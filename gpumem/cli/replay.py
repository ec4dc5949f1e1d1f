"""python -m gpumem replay TRACE [TRACE...] [--capacity SIZE] [--min-capacity] [--event-delay N] [--json]

Replay allocation traces on a simulated device and print a table (or JSON
lines) of what each needed; --snapshot / --html also write the sim heap at the
moment of peak live memory, as a torch snapshot pickle (torch.cuda._memory_viz,
pytorch.org/memory_viz) and/or as the offline HTML memory map.  Registered by
gpumem/cli/__init__.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import List, Optional

from .._units import format_size
from ..replay import _check_event_delay, _heap, min_capacity, replay
from ..trace import TraceError, load_trace
from .args import (
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    _check_output_path,
    _error_line,
    _size_arg,
    _whole_arg,
    add_capacity_arg,
    add_device_arg,
    add_traces_arg,
    replay_heap_kwargs,
)
from .explain import live_before_line

HISTORY_CAP = 1_000_000  # ring entries kept for the snapshot's device_traces

# Replays longer than this get a progress bar even when stderr is not a terminal.
LONG_REPLAY_EVENTS = 2_000_000


# ---- progress ------------------------------------------------------------------


class ProgressBar:
    """A one-line bar on stderr, redrawn at most ~10 times a second."""

    def __init__(self, label: str, stream=None, width: int = 30):
        self.label = label
        self.stream = stream or sys.stderr
        self.width = width
        self.last = 0.0
        self.tty = self.stream.isatty()
        self.shown = False
        self.next_line_pct = 0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        pct = 100 * done // total if total else 100
        if self.tty:
            if done < total and now - self.last < 0.1:
                return
            self.last = now
            filled = self.width * pct // 100
            bar = "#" * filled + "." * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {pct:3d}% {done}/{total}")
            self.shown = True
        elif pct >= self.next_line_pct:
            # Logs get a line per quarter instead of carriage returns.
            self.stream.write(f"{self.label}: {pct}% ({done}/{total} events)\n")
            self.next_line_pct = pct + 25
        self.stream.flush()

    def note(self, text: str) -> None:
        if self.tty:
            self.stream.write(f"\r{self.label} {text}\x1b[K")
            self.shown = True
            self.stream.flush()

    def close(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _want_progress(args, n_events: int) -> bool:
    if args.no_progress:
        return False
    return sys.stderr.isatty() or n_events >= LONG_REPLAY_EVENTS


# ---- replay ----------------------------------------------------------------------


def _event_delay_arg(text: str) -> int:
    return _whole_arg(text, "event delay", 0, (1 << 64) - 1, "2**64-1", " of operations")


def _heap_option_arg(key: str, value):
    """value, once the core has checked it as heap option `key` (its message otherwise)."""
    from .. import _C

    try:
        _C.check_option(key, value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def _chunk_pages_arg(text: str) -> int:
    return _heap_option_arg("chunk_pages", _whole_arg(text, "chunk pages", 0, (1 << 64) - 1, "2**64-1"))


def _pressure_arg(text: str) -> float:
    try:
        f = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"pressure must be a number: {text!r}") from None
    return _heap_option_arg("pressure", f)


def _page_size_arg(text: str) -> int:
    n = _size_arg(text)
    if n & (n - 1) or n < 4096:
        raise argparse.ArgumentTypeError(f"page size must be a power of two of at least 4 KiB: {text!r}")
    return n


def add_replay_args(p: argparse.ArgumentParser) -> None:
    add_traces_arg(
        p,
        "a text trace (.trace or .trace.gz), a torch snapshot pickle (.pickle, .pickle.gz), "
        "or the name of a trace shipped with gpumem (e.g. gpt2_varlen)",
    )
    add_capacity_arg(
        p, "--capacity", "capacity of the simulated device (default 80GiB); e.g. 24GiB, 1.5GB, 512MiB", 80 << 30
    )
    p.add_argument(
        "--min-capacity",
        action="store_true",
        help="also binary-search the smallest capacity (to 1 MiB) that replays with no OOM",
    )
    add_device_arg(p, "which device of a torch snapshot to replay (default 0)")
    p.add_argument(
        "--event-delay",
        type=_event_delay_arg,
        default=0,
        metavar="N",
        help="events on streams other than 0 complete only after N further device operations, "
        "as queued GPU work would (default 0: at once); matters for multi-stream traces",
    )
    p.add_argument(
        "--chunk-pages",
        type=_chunk_pages_arg,
        default=None,
        metavar="N",
        help="the most pages one physical allocation holds (default: gpumem's, 1)",
    )
    p.add_argument(
        "--page-size",
        type=_page_size_arg,
        default=None,
        metavar="SIZE",
        help="the heap's page, each one physical allocation (default 2MiB, a GPU's granularity); e.g. 8MiB: "
        "growth makes fewer device calls, and a block keeps whole pages",
    )
    p.add_argument(
        "--pressure",
        type=_pressure_arg,
        default=None,
        metavar="F",
        help="where the heap tightens, as a fraction of its limit (default 0.875; 0: always tight)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per trace per line")
    p.add_argument("--no-timing", action="store_true", help="skip the separate timing pass (ns_per_op)")
    p.add_argument("--no-progress", action="store_true", help="never draw a progress bar")
    add_replay_options(p)


def _replay_one(args, path: str) -> dict:
    trace = load_trace(path, device=args.device)
    if not trace.n_events:
        raise TraceError(path, None, "no allocations: nothing to replay")
    bar = ProgressBar(trace.name) if _want_progress(args, trace.n_events) else None
    try:
        kw = replay_heap_kwargs(args)
        result = replay(
            trace,
            args.capacity,
            timing=not args.no_timing,
            progress=bar,
            heap_kwargs=kw,
            event_delay=args.event_delay,
        )
        if args.min_capacity:
            if bar:
                bar.note("searching the smallest capacity...")
            probe = (
                (lambda cap, ok: bar.note(f"min-capacity probe {format_size(cap)}: {'fits' if ok else 'OOM'}"))
                if bar
                else None
            )
            result.min_capacity_bytes = min_capacity(
                trace, heap_kwargs=kw, on_probe=probe, event_delay=args.event_delay
            )
    finally:
        if bar:
            bar.close()
    out = result.to_json()
    out["trace"] = path
    out["name"] = trace.name
    out["format"] = trace.format
    out["device"] = trace.device
    out["n_slots"] = trace.n_slots
    out["live_before_bytes"] = trace.live_before_bytes
    out["live_before_blocks"] = trace.live_before
    if trace.live_before:
        out["live_before"] = live_before_line(trace)
    out.update(write_peak_outputs(args, trace))
    return out


def _ratio(num: Optional[int], den: int) -> str:
    return f"{num / den:.3f}" if num is not None and den else "-"


def _print_table(rows: List[dict], stream=None) -> None:
    stream = stream or sys.stdout
    header = [
        "trace",
        "events",
        "capacity",
        "peak live",
        "peak reserved",
        "reserved/live",
        "min capacity",
        "min/live",
        "OOMs",
        "remaps",
        "ns/op",
    ]
    lines = [header]
    for r in rows:
        live = r["peak_live_bytes"]
        mc = r.get("min_capacity_bytes")
        lines.append(
            [
                r["name"],
                str(r["events"]),
                format_size(r["capacity_bytes"]),
                format_size(live),
                format_size(r["peak_reserved_bytes"]),
                _ratio(r["peak_reserved_bytes"], live),
                format_size(mc) if mc is not None else "-",
                _ratio(mc, live),
                str(r["ooms"]),
                str(r["remaps"]),
                f"{r['ns_per_op']:.0f}" if r.get("ns_per_op") is not None else "-",
            ]
        )
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    for n, row in enumerate(lines):
        cells = [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells), file=stream)
        if n == 0:
            print("  ".join("-" * w for w in widths), file=stream)


def run_replay(args) -> int:
    check_replay_options(args, UsageError)
    if args.page_size and args.page_size > args.capacity:
        page, device = format_size(args.page_size), format_size(args.capacity)
        raise UsageError(f"--page-size {page} is larger than the device (--capacity {device})")
    rows = []
    status = EXIT_OK
    for path in args.traces:
        try:
            row = _replay_one(args, path)
        except TraceError as e:
            _error_line(str(e))
            status = EXIT_USAGE
            continue
        if args.json:
            print(json.dumps(row), flush=True)
        rows.append(row)
    if rows and not args.json:
        _print_table(rows)
        for r in rows:
            if r.get("live_before"):
                print(f"{r['name']}: {r['live_before']}")
    return status


# ---- replay --snapshot / --html -------------------------------------------------------


def add_replay_options(p) -> None:
    p.add_argument(
        "--snapshot",
        metavar="OUT.pickle",
        default=None,
        help="write a torch-format snapshot of the sim heap at peak live memory (one TRACE only)",
    )
    p.add_argument(
        "--html",
        metavar="OUT.html",
        default=None,
        help="write the offline HTML memory map of the sim heap at peak live memory, with live, "
        "reserved and cap over the whole trace (one TRACE only)",
    )


def check_replay_options(args, usage_error) -> None:
    if (args.snapshot or args.html) and len(args.traces) != 1:
        raise usage_error("--snapshot and --html take one TRACE (the picture is of one heap)")
    if args.snapshot:
        _check_output_path("--snapshot", args.snapshot, usage_error)
    if args.html:
        _check_output_path("--html", args.html, usage_error)


def peak_snapshot(trace, capacity: int, heap_kwargs: Optional[dict] = None, event_delay: int = 0):
    """Replay `trace` on a fresh sim heap (events completing `event_delay`
    device operations late, as in replay) up to the event where live memory
    peaks, and snapshot it there.  Returns (Snapshot, replay result dict)."""
    from ..snapshot import Snapshot

    heap = _heap(capacity, heap_kwargs, _check_event_delay(event_delay))
    try:
        heap.history_enable(max(1, min(HISTORY_CAP, 4 * trace.n_events)))
        stop = trace.peak_event if trace.peak_event >= 0 else -1
        r = heap.replay(trace.events, trace.n_slots, stop_at=stop)
        label = f"{trace.name} at peak live (event {stop} of {trace.n_events})"
        if r.get("ooms"):
            label += f", {r['ooms']} OOM(s) before it"
        snap = Snapshot.from_heap(heap, label=label)
    finally:
        heap.close()
    return snap, r


def write_peak_outputs(args, trace) -> dict:
    """Write --snapshot / --html for one replayed trace; returns JSON-able notes."""
    if not (args.snapshot or args.html):
        return {}
    kw = replay_heap_kwargs(args)
    snap, r = peak_snapshot(trace, args.capacity, heap_kwargs=kw, event_delay=args.event_delay)
    out = {"peak_event": trace.peak_event, "snapshot_live_bytes": snap.summary.live_bytes}
    if args.html:
        # the whole trace over time, under the map of its peak
        from ..timeline import from_trace

        snap.timeline = from_trace(trace, args.capacity, heap_kwargs=kw, event_delay=args.event_delay)
    if args.snapshot:
        snap.dump(args.snapshot)
        out["snapshot"] = args.snapshot
    if args.html:
        snap.to_html(args.html)
        out["html"] = args.html
    return out
