"""Allocation history: the core's ring buffer of events, and the Python stack of
each allocation.

The ring (csrc/core/history.c) keeps the last N alloc / free / map / unmap /
remap / oom / empty_cache events with time, address, size, stream and the
block's context id.  With stacks on, gpumem._C interns the Python stack of
each allocation made while the GIL is held (csrc/python/history_glue.c) and
uses the interned id as the context: one record per distinct stack, so memory
stays bounded however many allocations there are.  Allocations made without
the GIL (autograd's worker threads, C++ code) get no stack, as the issue asks.

    gpumem.record_history(heap, max_entries=100_000)   # stacks="python"
    ...
    for e in gpumem.history(heap).entries: print(e.action, e.size, e.site)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Tuple

from . import _C
from ._heaplike import torch_hook
from ._which_heap import resolve_heap, torch_active

__all__ = [
    "record_history",
    "history",
    "History",
    "HistoryEntry",
    "Frame",
    "frames_for",
    "site_of",
    "stack_table_info",
    "DEFAULT_MAX_ENTRIES",
]

DEFAULT_MAX_ENTRIES = 100_000
_TAG = 1 << 63


class Frame(NamedTuple):
    filename: str
    name: str
    line: int

    def __str__(self) -> str:
        return f"{self.filename}:{self.line} in {self.name}"


_frame_cache: Dict[int, Tuple[Frame, ...]] = {}


def frames_for(context: int) -> Tuple[Frame, ...]:
    """The stack interned under `context`, innermost first; () if none is known
    (no stack was taken, or the id was passed by the caller)."""
    if not context or not context & _TAG:
        return ()
    got = _frame_cache.get(context)
    if got is None:
        raw = _C._stack_frames(context)
        got = tuple(Frame(str(f["filename"]), str(f["name"]), int(f["line"])) for f in raw or ())
        _frame_cache[context] = got
    return got


_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def site_of(frames: Tuple[Frame, ...]) -> str:
    """The allocation site to show: the innermost frame outside gpumem itself
    and outside torch's Python wrappers, as "file:line in func"."""
    for i, f in enumerate(frames):
        fn = f.filename
        if fn.startswith(_PKG_DIR) or f"{os.sep}torch{os.sep}" in fn:
            continue
        if f.name in _COMPREHENSIONS and i + 1 < len(frames) and frames[i + 1].filename == fn:
            continue  # before 3.12 a comprehension is a frame of its own: name its function
        return str(f)
    return str(frames[0]) if frames else ""


def stack_table_info() -> dict:
    """Size and counters of the interned stack table (bytes, stacks, overflow...)."""
    return _C._stacks_info()


ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "map",
    "unmap",
    "remap",
    "oom",
    "empty_cache",
    "spill",  # pages at addr moved to (or placed in) host memory
    "unspill",  # pages at addr moved back to the device
    "handoff",  # memory another stream freed went to `stream`, made to wait on the GPU for that stream's work
)


@dataclass(frozen=True)
class HistoryEntry:
    time_ns: int
    action: str
    addr: int
    size: int
    stream: int
    context: int
    requested: int = 0  # alloc and frees: the bytes asked for (size is the block's, rounded up to 512)

    @property
    def frames(self) -> Tuple[Frame, ...]:
        return frames_for(self.context)

    @property
    def site(self) -> str:
        return site_of(self.frames)


@dataclass
class History:
    entries: List[HistoryEntry]
    dropped: int  # older events the ring overwrote

    def __len__(self) -> int:
        return len(self.entries)

    def __repr__(self) -> str:
        return f"<gpumem History: {len(self.entries)} entries, {self.dropped} dropped>"


def history(device=None) -> History:
    """The events the heap's ring holds, oldest first."""
    heap = resolve_heap(device)
    raw, dropped = heap.history()
    return History([HistoryEntry(*e) for e in raw], dropped)


def record_history(
    enabled=True,
    stacks: Optional[str] = "python",
    max_entries: int = DEFAULT_MAX_ENTRIES,
    device=None,
    *,
    max_depth: int = 64,
    max_stacks: int = 1 << 16,
) -> None:
    """Start or stop recording allocator events (and Python stacks) on a heap.

    enabled: True / "all" keeps the last `max_entries` events in the core's ring;
        "state" keeps no events but still takes a stack per allocation (like
        torch's enabled="state"); False / None stops both and drops the ring.
    stacks: "python" takes the Python stack of each allocation made while the
        GIL is held; "all" its C++ frames too (through torch's unwinder, which
        costs what it costs under torch's own allocator; without torch, the Python
        frames alone); None / "none" takes none.  The stack table is shared by
        every heap in the process, so turning stacks off affects all of them.
    device: a Heap, or None / a CUDA device for the heap gpumem installed there;
        for those the ring is switched on every device's heap, now and later, and
        the stacks of torch's allocations come from torch's own threads (a C++ or
        autograd thread has no Python stack and gets none).
    max_depth / max_stacks bound the stack table (frames per stack, distinct stacks).
    """
    if isinstance(enabled, _C.Heap):
        raise TypeError("gpumem.record_history() takes the heap as device=: record_history(True, device=heap)")
    _record(resolve_heap(device).history_enable, enabled, stacks, max_entries, max_depth, max_stacks)


def _native_unwinder():
    """torch's native stack gatherer and symbolizer, for stacks="all" (C++ frames); None
    without torch, where stacks="all" takes the Python frames alone (_stacks_info()["cpp"]
    says which)."""
    try:
        from torch._C import _profiler
    except ImportError:
        return None
    return _profiler.gather_traceback, _profiler.symbolize_tracebacks


def _record(history_enable, enabled, stacks, max_entries, max_depth=64, max_stacks=1 << 16) -> None:
    """record_history's work, with the heap's (or every torch heap's) history switch."""
    if stacks in (None, False, "none"):
        want_stacks = False
    elif stacks in ("python", "all"):
        want_stacks = True
    else:
        raise ValueError(f"stacks must be 'python', 'all' or None, not {stacks!r}")
    native = _native_unwinder() if stacks == "all" else None
    if enabled in (True, "all"):
        if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
            raise ValueError(f"max_entries must be a positive int, not {max_entries!r}")
        history_enable(max_entries)
    elif enabled == "state":
        history_enable(0)
    elif enabled in (False, None):
        history_enable(0)
        want_stacks = False
    else:
        raise ValueError(f"enabled must be True, False, 'all' or 'state', not {enabled!r}")
    _C._stacks_enable(want_stacks, max_depth=max_depth, max_stacks=max_stacks)
    _C._stacks_cpp(*(native if want_stacks and native else (None, None)))
    # Allocations torch makes reach the core through gpumem.torch's context hook,
    # not through Heap.malloc: point it at the stack table, or take it away.
    stack_hook = torch_hook("stack_hook")
    if stack_hook is not None and torch_active():
        stack_hook(want_stacks)
