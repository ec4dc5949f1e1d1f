"""python -m gpumem explain SNAPSHOT [--capacity SIZE] [--device N] [--json]

For a torch snapshot (or a gpumem text trace) that ends in an OOM, or at a
given capacity: would gpumem have fitted it, and in how much memory.
Registered by gpumem/cli/__init__.py.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple

from .._units import format_size
from ..replay import min_capacity, replay
from ..trace import MAX_ALLOC, TraceError, _PlainUnpickler, load_trace, snapshot_trace
from .args import EXIT_OK, _max_sim_capacity, _usage_failure, add_capacity_arg, add_device_arg


def add_explain_args(p) -> None:
    p.add_argument(
        "snapshot",
        metavar="SNAPSHOT",
        help="a torch memory snapshot pickle (.pickle, .pickle.gz) or a gpumem text trace",
    )
    add_capacity_arg(
        p, "--capacity", "the device size to judge against (default: what torch had when it ran out of memory)"
    )
    add_device_arg(p, "device of a snapshot (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


@dataclass
class OomPoint:
    index: int  # position in device_traces[d]
    size: int  # bytes requested
    device_free: int  # what CUDA reported free
    reserved: int  # torch's segments at that moment
    live: int  # torch's live bytes at that moment

    @property
    def capacity(self) -> int:
        return self.reserved + self.device_free


def _load_plain(path: str) -> dict:
    """A torch snapshot pickle as plain data (gzip'd or not); no code runs."""
    with open(path, "rb") as raw:
        f = gzip.GzipFile(fileobj=raw) if raw.peek(2)[:2] == b"\x1f\x8b" else raw
        return _PlainUnpickler(f).load()


def _size_field(path: str, where: str, e: dict, key: str, default=None) -> int:
    """A byte count of a snapshot entry: a non-negative 64-bit int, else TraceError."""
    if key not in e and default is not None:
        return default
    v = e.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(path, where, f"malformed event: {key} is {type(v).__name__}, not int")
    if not 0 <= v < 1 << 64:
        raise TraceError(path, where, f"{key} {v} is not a 64-bit unsigned value")
    return v


_SEGMENT_GROWTH = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def _segment_delta(path: str, entries, device: int, first: int = 0) -> Tuple[int, int]:
    """(net bytes the segment events from index `first` on reserve, how many there are)."""
    net = n = 0
    for i, e in enumerate(entries[first:], first):
        sign = _SEGMENT_GROWTH.get(e.get("action"))
        if sign:
            net += sign * _size_field(path, f"device_traces[{device}][{i}]", e, "size")
            n += 1
    return net, n


def _segments_total(path: str, data: dict, device: int) -> int:
    segs = data.get("segments", [])
    if not isinstance(segs, list) or not all(isinstance(s, dict) for s in segs):
        raise TraceError(path, "segments", "malformed snapshot: segments is not a list of dicts")
    return sum(
        _size_field(path, f"segments[{k}]", s, "total_size", 0)
        for k, s in enumerate(segs)
        if s.get("device", device) == device
    )


def _torch_oom_point(data: dict, device: int, path: str = "snapshot", live_before: int = 0) -> Optional[OomPoint]:
    """The first 'oom' event of a torch snapshot, with torch's reserved and live
    memory at that moment, counted from its segment and alloc events (and the
    `live_before` bytes live before its history began).  Where the history began
    late, or holds no segment events before the OOM, reserved memory is counted
    back from the snapshot's segments.  The events were checked by load_trace;
    the fields only this reads are checked here (TraceError)."""
    entries = data["device_traces"][device]
    live = live_before
    for i, e in enumerate(entries):
        a = e.get("action")
        if a == "alloc":
            live += e["size"]
        elif a == "free_completed":
            live -= e["size"]
        elif a == "oom":
            where = f"device_traces[{device}][{i}]"
            reserved, seg_events = _segment_delta(path, entries[:i], device)
            if live_before or seg_events == 0:
                # the segments as the snapshot holds them, less what the events after the OOM reserved
                reserved = _segments_total(path, data, device) - _segment_delta(path, entries, device, i + 1)[0]
            request = _size_field(path, where, e, "size")
            if request > MAX_ALLOC:
                raise TraceError(path, where, f"size {request} is larger than any allocation gpumem serves (4 PiB)")
            return OomPoint(i, request, _size_field(path, where, e, "device_free", 0), max(reserved, 0), live)
    return None


def live_before_line(trace) -> str:
    """One line on the blocks live before a snapshot's history began (counted in its figures)."""
    top = trace.live_before_sites[0] if trace.live_before_sites else None
    where = f", most at {top[0]} ({format_size(top[1])})" if top and not top[0].startswith("<") else ""
    return (
        f"{format_size(trace.live_before_bytes)} in {trace.live_before} blocks was live before the history "
        f"began, counted from the snapshot's segments{where}"
    )


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


class _Refused(Exception):
    """The explanation cannot be made: the message of the one error line."""


def run_explain(args) -> int:
    path = args.snapshot
    device = args.device or 0
    try:
        trace, oom, capacity = _judged_trace(args, path, device)
    except _Refused as e:
        return _usage_failure(str(e))
    res = replay(trace, capacity, timing=False)
    ok = res.ooms == 0
    need = min_capacity(trace)
    if args.json:
        print(json.dumps(_explain_json(path, device, trace, oom, capacity, res, need)))
        return EXIT_OK
    name = os.path.basename(path)
    # Events are counted one way: the allocations and frees gpumem replays (the failed request last).
    n = trace.n_events
    lines = [f"{name}: {n} allocations and frees (device {device}), peak live {format_size(trace.peak_live_bytes)}"]
    if trace.live_before:
        lines.append(f"  {live_before_line(trace)}")
    if oom:
        lines += _oom_lines(oom, n, device)
    verdict = "FITS" if ok else "does NOT fit"
    what = "the trace up to and including the failed request" if oom else "the trace"
    lines.append(
        f"gpumem on a {format_size(capacity)} device: {what} {verdict}"
        + (
            f" (peak reserved {format_size(res.peak_reserved_bytes)})"
            if ok
            else f" ({res.ooms} OOM{'' if res.ooms == 1 else 's'})"
        )
    )
    ratio = need / trace.peak_live_bytes if trace.peak_live_bytes else float("nan")
    lines.append(f"gpumem needs at least {format_size(need)} for it ({ratio:.3f} x peak live, to 1 MiB)")
    print("\n".join(lines))
    return EXIT_OK


def _judged_trace(args, path: str, device: int):
    """(the trace up to torch's OOM, or all of it; the OomPoint or None; the capacity to judge it
    against), or _Refused."""
    try:
        trace = load_trace(path, device=args.device)
        src = trace.path  # the file a short name resolved to
        data = _load_plain(src) if trace.format == "snapshot" else None
        oom = _torch_oom_point(data, device, src, trace.live_before_bytes) if data is not None else None
        if oom is not None:
            trace = snapshot_trace(src, data, device, stop=oom.index, extra=oom.size)
    except TraceError as e:
        raise _Refused(str(e)) from None
    if not trace.n_events:
        raise _Refused(f"{path}: no allocations and no OOM: nothing to explain")
    capacity = args.capacity or (oom.capacity if oom else None)
    if capacity is None:
        raise _Refused(f"{path}: the trace ends without an OOM; give --capacity SIZE to judge it against")
    if capacity <= 0:
        raise _Refused(
            f"{path}: torch's OOM event leaves no capacity to judge against (reserved "
            f"{oom.reserved} + device free {oom.device_free} bytes); give --capacity SIZE"
        )
    if capacity > _max_sim_capacity():
        raise _Refused(
            f"{path}: torch's OOM event implies a device of {capacity} bytes (reserved {oom.reserved} + device "
            f"free {oom.device_free}), more than the simulated device holds ({format_size(_max_sim_capacity())}); "
            "give --capacity SIZE"
        )
    return trace, oom, capacity


def _explain_json(path: str, device: int, trace, oom: Optional[OomPoint], capacity: int, res, need: int) -> dict:
    return {
        "trace": path,
        "device": device,
        "events": trace.n_events,
        "peak_live_bytes": trace.peak_live_bytes,
        "capacity_bytes": capacity,
        "gpumem_fits": res.ooms == 0,
        "gpumem_min_capacity_bytes": need,
        "gpumem_peak_reserved_bytes": res.peak_reserved_bytes,
        "live_before_bytes": trace.live_before_bytes,
        "live_before_blocks": trace.live_before,
        "torch_oom": None
        if oom is None
        else {
            "event": oom.index,
            "request_bytes": oom.size,
            "device_free_bytes": oom.device_free,
            "reserved_bytes": oom.reserved,
            "live_bytes": oom.live,
        },
    }


def _oom_lines(oom: OomPoint, n: int, device: int) -> List[str]:
    return [
        f"torch ran out of memory at the {_ordinal(n)} of them (the snapshot's device_traces[{device}]"
        f"[{oom.index}]): asked for {format_size(oom.size)} with "
        f"{format_size(oom.live)} live, {format_size(oom.reserved)} reserved and "
        f"{format_size(oom.device_free)} free on the device, so it had about "
        f"{format_size(oom.capacity)} to work with",
        f"  (reserved - live = {format_size(oom.reserved - oom.live)} cached or fragmented in torch's segments)",
    ]
