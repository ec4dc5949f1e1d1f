"""Allocation traces: load them, check them, and pack them for Heap.replay.

Two formats are read (see docs/api.md, "Trace formats"):

* gpumem's text format, as in gpumem/data/traces/*.trace.gz: an optional comment line
  (``# action addr size stream ... {JSON}``) and then one ``action addr size stream``
  event per line; gzip'd or plain.
* torch memory snapshots (``torch.cuda.memory._snapshot()`` pickled, optionally
  gzip'd), whose ``device_traces[device]`` lists dicts with action, addr, size, stream.

Only ``alloc`` and ``free_completed`` drive the replay: a block is reusable once its
free has completed, and the segment_* entries are what the *native* allocator asked
of the driver, which an allocator under test must not copy.  Frees are paired with
their alloc by address; each allocation gets a slot number, reused once freed, so
the replay's slot table stays as small as the most blocks ever live at once.
A snapshot's history may begin after blocks were live (recording turned on late,
or a bounded ring that wrapped): those blocks, from its ``segments`` and from
the frees the history never saw allocated, lead the trace (_live_before).

Every problem with a file is a TraceError (a ValueError) whose message is one line:
``FILE:WHERE: reason``, WHERE being a line number for text and
``device_traces[D][I]`` for snapshots.
"""

from __future__ import annotations

import bisect
import gzip
import io
import json
import os
import pickle
import sys
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Tuple

__all__ = [
    "TraceError",
    "Trace",
    "load_trace",
    "EVENT_SIZE",
    "R_ALLOC",
    "R_FREE",
    "ACTIONS",
    "REPLAYED_ACTIONS",
    "IGNORED_ACTIONS",
    "ALLOCATOR_ACTIONS",
]

# Layout of gm_replay_event: struct "<IIQQ" (op, slot, size, stream).  It is built
# as three little-endian 64-bit words per event, (op | slot << 32, size, stream),
# which is the same bytes and lets array('Q') do the packing at C speed.
EVENT_SIZE = 24
R_ALLOC = 0
R_FREE = 1

# The actions of torch's TraceEntry that a trace may hold (any other is an
# error): those that drive the replay, then those that do not change which
# blocks are live.  All but "user_defined" (the user's annotations) are the
# allocator's own: ALLOCATOR_ACTIONS, which gpumem.torch records.
REPLAYED_ACTIONS = ("alloc", "free_completed")
_ALLOCATOR_IGNORED = (
    "free_requested",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
)
IGNORED_ACTIONS = _ALLOCATOR_IGNORED + ("user_defined",)
ALLOCATOR_ACTIONS = REPLAYED_ACTIONS + _ALLOCATOR_IGNORED
ACTIONS = REPLAYED_ACTIONS + IGNORED_ACTIONS
_IGNORED = frozenset(IGNORED_ACTIONS)
_MAX_U64 = (1 << 64) - 1
# The core refuses larger requests as invalid (gm_malloc), not as out of memory.
MAX_ALLOC = 1 << 52
_MAX_SLOTS = (1 << 32) - 1
# The core's GM_STREAM_ANY (2**64-1) names no stream: a trace's streams lie below it.
_MAX_STREAM = _MAX_U64 - 1
# The longest text line read: a trace line is ~50 characters and its header a
# few hundred, so a longer one is not a trace (and must not fill memory).
MAX_LINE_CHARS = 1 << 20


class TraceError(ValueError):
    """A trace file that cannot be replayed; str() is one line: FILE:WHERE: reason."""

    def __init__(self, path, where, reason: str):
        self.path = os.fspath(path)
        self.where = where
        # One line whatever the cause said (pickle's own messages span two).
        reason = " ".join(reason.replace("\r", "\n").split("\n"))
        self.reason = reason
        loc = self.path if where is None else f"{self.path}:{where}"
        super().__init__(f"{loc}: {reason}")


@dataclass
class Trace:
    """A loaded trace, packed for Heap.replay."""

    path: str
    format: str  # "text" or "snapshot"
    device: int
    words: array  # 3 'Q' words per event (see EVENT_SIZE)
    n_slots: int
    allocs: int
    frees: int
    peak_live_bytes: int  # largest sum of live sizes over the trace
    peak_event: int  # index of the event at which live first reached its peak (-1 if none)
    meta: dict = field(default_factory=dict)
    # A snapshot whose history began after blocks were live (recording turned on late, or a
    # ring that wrapped): its first `live_before` events allocate those blocks, `live_before_bytes`
    # in all; live_before_sites: (site, bytes, blocks) of the most of it, where frames say
    live_before: int = 0
    live_before_bytes: int = 0
    live_before_sites: list = field(default_factory=list)

    def __repr__(self) -> str:
        # Short: the packed events can be millions of words.
        return (
            f"<gpumem.trace.Trace {self.name}: {self.format}, device {self.device}, {self.n_events} events "
            f"({self.allocs} allocs, {self.frees} frees), peak live {self.peak_live_bytes} bytes>"
        )

    @property
    def name(self) -> str:
        base = os.path.basename(self.path)
        for suffix in (".gz", ".trace", ".pickle", ".pkl"):
            if base.endswith(suffix):
                base = base[: -len(suffix)]
        return base

    @property
    def n_events(self) -> int:
        return len(self.words) // 3

    @property
    def events(self) -> memoryview:
        """The packed events as bytes (no copy)."""
        return memoryview(self.words).cast("B")

    def chunks(self, events_per_chunk: int) -> Iterator[Tuple[int, memoryview]]:
        """Yield (first event index, memoryview of packed events) in order."""
        if events_per_chunk <= 0:
            raise ValueError("events_per_chunk must be positive")
        mv = self.events
        for start in range(0, self.n_events, events_per_chunk):
            stop = min(start + events_per_chunk, self.n_events)
            yield start, mv[start * EVENT_SIZE : stop * EVENT_SIZE]

    def decode(self):
        """Yield (op, slot, size, stream) per event; for tests and debugging."""
        w = self.words
        for i in range(0, len(w), 3):
            yield w[i] & 0xFFFFFFFF, w[i] >> 32, w[i + 1], w[i + 2]


class _Builder:
    """Pairs frees with allocs by address and packs the events."""

    def __init__(self, path: str):
        self.path = path
        self.words = array("Q")
        self.live = {}  # addr -> (slot, size, where it was allocated)
        self.spare_slots = []
        self.n_slots = 0
        self.allocs = 0
        self.frees = 0
        self.live_bytes = 0
        self.peak_live = 0
        self.peak_event = -1

    def alloc(self, addr: int, size: int, stream: int, where) -> None:
        prior = self.live.get(addr)
        if prior is not None:
            raise TraceError(
                self.path, where, f"alloc at address {addr:#x}, which is still live (allocated at {prior[2]})"
            )
        if self.spare_slots:
            slot = self.spare_slots.pop()
        else:
            slot = self.n_slots
            if slot >= _MAX_SLOTS:
                raise TraceError(self.path, where, "more than 2**32-1 blocks live at once")
            self.n_slots += 1
        self.live[addr] = (slot, size, where)
        self.words.extend((R_ALLOC | slot << 32, size, stream))
        self.allocs += 1
        self.live_bytes += size
        if self.live_bytes > self.peak_live:
            self.peak_live = self.live_bytes
            self.peak_event = len(self.words) // 3 - 1

    def free(self, addr: int, stream: int, where, unknown_reason=None) -> None:
        entry = self.live.pop(addr, None)
        if entry is None:
            raise TraceError(
                self.path,
                where,
                unknown_reason()
                if unknown_reason
                else f"free of unknown address {addr:#x} (never allocated, or already freed)",
            )
        slot, size, _ = entry
        self.spare_slots.append(slot)
        self.words.extend((R_FREE | slot << 32, size, stream))
        self.frees += 1
        self.live_bytes -= size

    def finish(self, fmt: str, device: int, meta: dict) -> Trace:
        if sys.byteorder != "little":
            self.words.byteswap()
        return Trace(
            self.path,
            fmt,
            device,
            self.words,
            self.n_slots,
            self.allocs,
            self.frees,
            self.peak_live,
            self.peak_event,
            meta,
        )


def _short(text: str, limit: int = 60) -> str:
    text = text.rstrip("\r\n")
    return repr(text if len(text) <= limit else text[:limit] + "...")


def _parse_meta(comment: str) -> dict:
    """The JSON object a text trace's first line may carry; {} if none or unreadable."""
    start = comment.find("{")
    end = comment.rfind("}")
    if start < 0 or end < start:
        return {}
    try:
        meta = json.loads(comment[start : end + 1])
    except (ValueError, RecursionError):  # RecursionError: nested too deep
        return {}
    return meta if isinstance(meta, dict) else {}


def _load_text(path: str, stream, device: Optional[int]) -> Trace:
    if device not in (None, 0):
        raise TraceError(path, None, f"a text trace holds one device; --device {device} does not apply")
    b = _Builder(path)
    meta = {}
    text = io.TextIOWrapper(stream, encoding="utf-8", newline=None)
    lineno = 0
    try:
        while True:
            line = text.readline(MAX_LINE_CHARS + 1)
            if not line:
                break
            lineno += 1
            if len(line) > MAX_LINE_CHARS:
                raise TraceError(path, lineno, f"not a trace: a line longer than {MAX_LINE_CHARS} characters")
            parts = line.split()
            if not parts:
                continue
            action = parts[0]
            if action.startswith("#"):
                if lineno == 1:
                    meta = _parse_meta(line)
                continue
            if len(parts) != 4:
                raise TraceError(
                    path, lineno, f"malformed line: expected 'action addr size stream', got {_short(line)}"
                )
            try:
                addr = int(parts[1])
                size = int(parts[2])
                stream_id = int(parts[3])
            except ValueError:
                raise TraceError(
                    path, lineno, f"malformed line: addr, size and stream must be integers, got {_short(line)}"
                ) from None
            if action == "alloc":
                _check_fields(path, lineno, addr, size, stream_id)
                b.alloc(addr, size, stream_id, lineno)
            elif action == "free_completed":
                _check_fields(path, lineno, addr, size, stream_id)
                b.free(addr, stream_id, lineno)
            elif action in _IGNORED:
                if size < 0:
                    raise TraceError(path, lineno, f"negative size {size}")
            else:
                raise TraceError(path, lineno, f"unknown action {action!r}")
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise TraceError(path, lineno + 1, f"corrupt gzip data: {e}") from None
    except UnicodeDecodeError:
        raise TraceError(path, lineno + 1, "not a text trace: bytes that are not UTF-8") from None
    return b.finish("text", 0, meta)


def _check_fields(path, where, addr, size, stream) -> None:
    if size < 0:
        raise TraceError(path, where, f"negative size {size}")
    if size > _MAX_U64:
        raise TraceError(path, where, f"size {size} does not fit in 64 bits")
    if size > MAX_ALLOC:
        raise TraceError(path, where, f"size {size} is larger than any allocation gpumem serves (4 PiB)")
    if addr < 0 or addr > _MAX_U64:
        raise TraceError(path, where, f"address {addr} is not a 64-bit unsigned value")
    if stream < 0 or stream > _MAX_STREAM:
        raise TraceError(path, where, f"stream {stream} is not a stream id (0 to 2**64-2)")


class _PlainUnpickler(pickle.Unpickler):
    """torch snapshots are plain dicts, lists, strings and numbers; refusing every
    global keeps a hostile pickle from running code."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it refers to {module}.{name}; only plain data is accepted")


def _event_int(path, where, ev: dict, key: str) -> int:
    if key not in ev:
        raise TraceError(path, where, f"malformed event: no {key!r}")
    v = ev[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(path, where, f"malformed event: {key} is {type(v).__name__}, not int")
    return v


def _load_snapshot(path: str, stream, device: Optional[int]) -> Trace:
    try:
        data = _PlainUnpickler(stream).load()
    except (OSError, EOFError, zlib.error) as e:
        raise TraceError(path, None, f"corrupt gzip data: {e}") from None
    except MemoryError:  # a frame or object that claims more than the host has
        raise TraceError(path, None, "not a readable pickle: it claims more memory than this host has") from None
    except Exception as e:  # any unpickling failure is a bad file, not a crash
        raise TraceError(path, None, f"not a readable pickle: {str(e) or type(e).__name__}") from None
    return snapshot_trace(path, data, 0 if device is None else device)


def _check_snapshot(path: str, data, d: int) -> list:
    """The events of device d of a snapshot dict (TraceError where it is not one)."""
    if not isinstance(data, dict) or "device_traces" not in data:
        raise TraceError(
            path,
            None,
            "not a torch memory snapshot: no 'device_traces' (record with "
            "torch.cuda.memory._record_memory_history first)",
        )
    traces = data["device_traces"]
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise TraceError(path, None, "malformed snapshot: device_traces is not a list of lists")
    if not 0 <= d < len(traces):
        raise TraceError(path, None, f"no device {d}: device_traces holds {len(traces)} device(s)")
    return traces[d]


def _replayed_event(path: str, where: str, ev) -> Optional[Tuple[bool, int, int, int]]:
    """(is_alloc, addr, size, stream) of an alloc or free_completed entry, None for
    the entries that do not drive the replay; TraceError for a malformed one."""
    if not isinstance(ev, dict) or "action" not in ev:
        raise TraceError(path, where, "malformed event: not a dict with an 'action'")
    action = ev["action"]
    if not isinstance(action, str):
        raise TraceError(path, where, f"malformed event: action is {type(action).__name__}, not str")
    if action == "alloc" or action == "free_completed":
        addr = _event_int(path, where, ev, "addr")
        size = _event_int(path, where, ev, "size")
        stream_id = _event_int(path, where, ev, "stream")
        _check_fields(path, where, addr, size, stream_id)
        return action == "alloc", addr, size, stream_id
    if action not in _IGNORED:
        raise TraceError(path, where, f"unknown action {action!r}")
    size = ev.get("size", 0)
    if isinstance(size, int) and size < 0:
        raise TraceError(path, where, f"negative size {size}")
    return None


def snapshot_trace(path: str, data, device: int = 0, stop: Optional[int] = None, extra: Optional[int] = None) -> Trace:
    """The trace of device `device` of a snapshot dict: first the blocks live before
    its history began (_live_before), then its events (those before index `stop`
    when given), then one allocation of `extra` bytes when given (the request an
    OOM event says failed).  Raises TraceError."""
    events = _check_snapshot(path, data, device)
    b = _Builder(path)
    prior = _live_before(path, data, device, events)
    for addr, size, stream_id, _, where in prior:
        b.alloc(addr, size, stream_id, f"{where} (live before the history)")
    for i, ev in enumerate(events if stop is None else events[:stop]):
        where = f"device_traces[{device}][{i}]"
        got = _replayed_event(path, where, ev)
        if got is None:
            continue
        if got[0]:
            b.alloc(got[1], got[2], got[3], where)
        else:
            b.free(got[1], got[3], where)
    if extra is not None:
        b.alloc(-1, extra, 0, f"device_traces[{device}][{stop}]")  # -1: no real address
    meta = {k: data[k] for k in ("allocator_settings",) if k in data}
    t = b.finish("snapshot", device, meta)
    t.live_before = len(prior)
    t.live_before_bytes = sum(p[1] for p in prior)
    t.live_before_sites = _top_sites(prior)
    return t


# ---- the blocks live before a snapshot's history ---------------------------------------
#
# A history may begin after blocks were live: recording was turned on once the model was
# built, or a bounded ring (max_entries) dropped its oldest events.  Such a block shows
# either as a free the history never saw allocated, or as a block the snapshot's segments
# hold live that the history did not allocate.  Both are live before the history: the
# replay allocates them first, in address order (the order a fresh heap lays them out).

# block states of a snapshot's segments that hold memory: allocated, or freed while a
# stream may still use it (its free has not completed)
LIVE_STATES = ("active_allocated", "active_pending_free")


def _seg_int(path: str, where: str, d: dict, key: str, default=None) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_U64:
        got = "missing" if key not in d else f"{v!r}"
        raise TraceError(path, where, f"malformed snapshot: {key} is {got}, not a 64-bit unsigned int")
    return v


def segment_blocks(path: str, data, device: Optional[int] = None):
    """(address, block dict, segment dict, where) of each block of the snapshot's
    segments (of `device`, or every device when None), in order.  A block's
    address is its segment's address plus the sizes of the blocks before it."""
    segments = data.get("segments", [])
    if not isinstance(segments, list) or not all(isinstance(seg, dict) for seg in segments):
        raise TraceError(path, "segments", "malformed snapshot: segments is not a list of dicts")
    for k, seg in enumerate(segments):
        where = f"segments[{k}]"
        if not isinstance(seg.get("blocks", []), list):
            raise TraceError(path, where, "malformed snapshot: blocks is not a list")
        dev = _seg_int(path, where, seg, "device", 0 if device is None else device)
        if device is not None and dev != device:
            continue
        addr = _seg_int(path, where, seg, "address")
        for j, blk in enumerate(seg.get("blocks", [])):
            if not isinstance(blk, dict) or not isinstance(blk.get("state"), str):
                raise TraceError(path, f"{where}.blocks[{j}]", "malformed snapshot: not a dict with a 'state'")
            yield addr, blk, seg, f"{where}.blocks[{j}]"
            addr += _seg_int(path, f"{where}.blocks[{j}]", blk, "size")


def _live_before(path: str, data, d: int, events: list) -> list:
    """(addr, size, stream, frames, where) of each block live when device d's history
    began, in address order: the frees of blocks the history never allocated (a
    second such free of one address is a double free), then the blocks the
    segments hold live that the history did not leave live itself."""
    live: Dict[int, str] = {}  # address the history allocated and has not freed -> where
    prior: Dict[int, tuple] = {}
    owner = _SegmentOwner(path, data, d)
    for i, ev in enumerate(events):
        where = f"device_traces[{d}][{i}]"
        got = _replayed_event(path, where, ev)
        if got is None:
            continue
        is_alloc, addr, size, stream_id = got
        if is_alloc:
            if addr in live:
                raise TraceError(
                    path, where, f"alloc at address {addr:#x}, which is still live (allocated at {live[addr]})"
                )
            live[addr] = where
        elif addr in live:
            del live[addr]
        elif addr in prior:
            raise TraceError(path, where, f"free of address {addr:#x}, already freed at {prior[addr][4]}")
        else:
            owner.check(addr, where)
            prior[addr] = (addr, size, stream_id, ev.get("frames"), where)
    settings = data.get("allocator_settings")
    gpumem_dump = isinstance(settings, dict) and settings.get("allocator") == "gpumem"
    for addr, blk, seg, where in segment_blocks(path, data, d):
        if blk["state"] not in LIVE_STATES or addr in live:
            continue
        if addr in prior:
            raise TraceError(
                path,
                where,
                f"malformed snapshot: a live block at {addr:#x}, which the history frees at {prior[addr][4]}",
            )
        # torch's history records requested sizes, gpumem's its blocks' (512-byte rounded)
        size = _seg_int(path, where, blk, "size")
        if not gpumem_dump and blk.get("requested_size"):
            size = _seg_int(path, where, blk, "requested_size")
        stream_id = _seg_int(path, where, seg, "stream", 0)
        _check_fields(path, where, addr, size, stream_id)
        prior[addr] = (addr, size, stream_id, blk.get("frames"), where)
    return sorted(prior.values())


class _SegmentOwner:
    """Which device an address belongs to: a free of a block the history never
    allocated, at an address that this device's segments do not hold but another
    device's segments or history do, is a free on the wrong device (a mixed-up
    file), not a block live before the history."""

    def __init__(self, path: str, data, d: int):
        self.path, self.data, self.d = path, data, d
        self.spans: Dict[int, List[Tuple[int, int]]] = {}
        self.allocated: Optional[Dict[int, int]] = None  # address -> another device whose history allocates it
        segments = data.get("segments", [])
        for k, seg in enumerate(segments if isinstance(segments, list) else []):
            if isinstance(seg, dict):
                where = f"segments[{k}]"
                lo = _seg_int(path, where, seg, "address")
                hi = lo + _seg_int(path, where, seg, "total_size", 0)
                self.spans.setdefault(_seg_int(path, where, seg, "device", d), []).append((lo, hi))
        for spans in self.spans.values():
            spans.sort()

    def _holds(self, dev, addr: int) -> bool:
        spans = self.spans.get(dev, [])
        k = bisect.bisect_right(spans, (addr, _MAX_U64 + 1)) - 1
        return k >= 0 and spans[k][0] <= addr < spans[k][1]

    def _other(self, addr: int):
        for dev in self.spans:
            if dev != self.d and self._holds(dev, addr):
                return dev, "the snapshot's segments place it on"
        if self.allocated is None:
            self.allocated = {}
            for dev, entries in enumerate(self.data["device_traces"]):
                for e in entries if dev != self.d else ():
                    if isinstance(e, dict) and e.get("action") == "alloc" and isinstance(e.get("addr"), int):
                        self.allocated.setdefault(e["addr"], dev)
        dev = self.allocated.get(addr)
        return None if dev is None else (dev, "it was allocated on")

    def check(self, addr: int, where: str) -> None:
        if self._holds(self.d, addr):
            return
        other = self._other(addr)
        if other is not None:
            raise TraceError(
                self.path,
                where,
                f"free of address {addr:#x}, which is not live on device {self.d}: {other[1]} device {other[0]}",
            )


_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def _site(frames) -> str:
    """The innermost frame outside torch and gpumem, as "file:line in name" ("" if none)."""
    shown = [f for f in frames if isinstance(f, dict) and f.get("filename")] if isinstance(frames, list) else []
    for f in shown:
        fn = str(f["filename"])
        if not fn.startswith(_PKG_DIR) and f"{os.sep}torch{os.sep}" not in fn:
            return f"{fn}:{f.get('line', 0)} in {f.get('name', '?')}"
    return ""


def _top_sites(prior: list, n: int = 3) -> List[Tuple[str, int, int]]:
    """(site, bytes, blocks) of the sites holding the most of the blocks live before, most first."""
    by: Dict[str, List[int]] = {}
    for p in prior:
        acc = by.setdefault(_site(p[3]) or "<no stack recorded>", [0, 0])
        acc[0] += p[1]
        acc[1] += 1
    return sorted(((k, v[0], v[1]) for k, v in by.items()), key=lambda t: -t[1])[:n]


def _resolve_short_name(path: str) -> str:
    """A path as given, or the shipped file a short name names (a TraceError
    listing the known names when it names none)."""
    from . import data

    if os.path.exists(path) or not data.is_short_name(path):
        return path
    try:
        return str(data.trace_path(path))
    except data.UnknownDataError as e:
        if path in data.list_snapshots():
            return str(data.snapshot_path(path))
        raise TraceError(path, None, f"no such file; {e}") from None


def load_trace(path, device: Optional[int] = None) -> Trace:
    """Load a text trace or a torch snapshot pickle (either may be gzip'd).

    `device` picks a device of a snapshot (default 0).  `path` may also be the
    short name of a trace or snapshot shipped with gpumem ("gpt2_varlen",
    see gpumem.data) when no file of that name exists.  Raises TraceError.
    """
    path = _resolve_short_name(os.fspath(path))
    try:
        raw = open(path, "rb")
    except FileNotFoundError:
        raise TraceError(path, None, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, None, "is a directory, not a trace") from None
    except OSError as e:
        raise TraceError(path, None, f"cannot open: {e.strerror or e}") from None
    with raw:
        stream = raw
        try:
            magic = raw.peek(2)[:2]
        except OSError as e:  # /proc/self/mem, a folder's device, ...
            raise TraceError(path, None, f"cannot read: {e.strerror or e}") from None
        if not magic:
            raise TraceError(path, None, "empty file: not a trace or a snapshot")
        if magic == b"\x1f\x8b":
            stream = gzip.GzipFile(fileobj=raw, mode="rb")
        try:
            head = stream.peek(1)[:1] if hasattr(stream, "peek") else b""
        except (OSError, EOFError, zlib.error) as e:
            raise TraceError(path, 1, f"corrupt gzip data: {e}") from None
        if not head:
            raise TraceError(path, None, "empty file (once decompressed): not a trace or a snapshot")
        lowered = path.lower()
        if head == b"\x80" or lowered.endswith((".pickle", ".pickle.gz", ".pkl", ".pkl.gz")):
            return _load_snapshot(path, stream, device)
        return _load_text(path, stream, device)
