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

Every problem with a file is a TraceError (a ValueError) whose message is one line:
``FILE:WHERE: reason``, WHERE being a line number for text and
``device_traces[D][I]`` for snapshots.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import sys
import zlib
from array import array
from dataclasses import dataclass, field
from typing import Iterator, Optional, Tuple

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
    d = 0 if device is None else device
    if not 0 <= d < len(traces):
        raise TraceError(path, None, f"no device {d}: device_traces holds {len(traces)} device(s)")

    def owner_of(addr):
        """Which other device allocated `addr`, for a clearer message."""
        for other, entries in enumerate(traces):
            if other != d and any(
                isinstance(e, dict) and e.get("action") == "alloc" and e.get("addr") == addr for e in entries
            ):
                return f"free of address {addr:#x}, which is not live on device {d}: it was allocated on device {other}"
        return f"free of unknown address {addr:#x} (never allocated, or already freed)"

    b = _Builder(path)
    for i, ev in enumerate(traces[d]):
        where = f"device_traces[{d}][{i}]"
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
            if action == "alloc":
                b.alloc(addr, size, stream_id, where)
            else:
                b.free(addr, stream_id, where, lambda: owner_of(addr))
        elif action in _IGNORED:
            size = ev.get("size", 0)
            if isinstance(size, int) and size < 0:
                raise TraceError(path, where, f"negative size {size}")
        else:
            raise TraceError(path, where, f"unknown action {action!r}")
    meta = {k: data[k] for k in ("allocator_settings",) if k in data}
    return b.finish("snapshot", d, meta)


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
