"""The visibility layer on the heaps gpumem serves torch with.

gpumem.torch's install calls these; they connect it to snapshot / history /
explain (the layers below, which never import this one: history reaches
set_stack_hook through the hook install registers in gpumem._heaplike):

  on_install()            sets torch's OOM hook (csrc/python/torch_glue.c), which words
                          torch.OutOfMemoryError with the one formatter gpumem.explain
                          registers for every OOM (GPUMEM_EXPLAIN_OOM=0: the one line
                          alone), and the stack hook when stacks are already being recorded
  set_stack_hook(on)      Python stacks for allocations torch makes (record_history)
  record_torch_history()  torch.cuda.memory._record_memory_history, routed to record_history
  set_memory_metadata()   torch.cuda.memory._set_memory_metadata / _get_memory_metadata
  get_memory_metadata()
  torch_snapshot_dict()   torch.cuda.memory._snapshot / memory_snapshot / _dump_snapshot:
                          Snapshot.to_torch() of every device's heap

torch's context modes decide which trace entries carry a stack: with "state"
(or None) none do, with "alloc" each entry carries the stack of its block's
allocation, with "all" a free and an empty_cache carry the stack of the code
that called them.  The mode and the user metadata in force change over time, so
both are kept as timelines (CLOCK_MONOTONIC nanoseconds, the clock the history
ring stamps its events with) and each entry takes what was in force when it was
recorded.
"""

from __future__ import annotations

import os
import threading
import time
from bisect import bisect_right

from .. import _C
from .._heaplike import MAX_HISTORY  # the history ring's bound (torch's default max_entries is sys.maxsize)
from ..explain import register_oom_formatter
from .._which_heap import registry_heap
from ..history import _record
from ..snapshot import Snapshot
from ..trace import ALLOCATOR_ACTIONS
from . import _regions

__all__ = [
    "on_install",
    "set_stack_hook",
    "record_torch_history",
    "set_memory_metadata",
    "get_memory_metadata",
    "torch_snapshot_dict",
]

# The most changes a timeline keeps; older events take the value of the last change dropped.
TIMELINE_CHANGES = 1 << 16


class _Timeline:
    """A value that changes over time: what was in force at a CLOCK_MONOTONIC time
    (time.monotonic_ns() reads that clock on Linux).  Bounded: past `limit`
    changes, the oldest are dropped and the newest of them becomes the value of
    every earlier time."""

    def __init__(self, initial, limit: int = TIMELINE_CHANGES):
        self._lock = threading.Lock()
        self._limit = limit
        self._before = initial
        self._times: list = []
        self._values: list = []

    def set(self, value) -> None:
        with self._lock:
            self._times.append(time.monotonic_ns())
            self._values.append(value)
            if len(self._times) > self._limit:
                drop = len(self._times) - self._limit // 2
                self._before = self._values[drop - 1]
                del self._times[:drop], self._values[:drop]

    def at(self, t_ns: int):
        return self.reader()(t_ns)

    def reader(self):
        """A function of time giving the value in force then, over the changes made
        so far (a copy: reading many events takes the lock once)."""
        with self._lock:
            before, times, values = self._before, list(self._times), list(self._values)
        if not times:
            return lambda t_ns: before

        def at(t_ns: int):
            i = bisect_right(times, t_ns)
            return values[i - 1] if i else before

        return at

    def current(self):
        with self._lock:
            return self._values[-1] if self._values else self._before

    def __len__(self) -> int:
        return len(self._times)


# torch's context argument in force (None, "state", "alloc", "all").  Before torch's
# _record_memory_history is first called, entries carry their blocks' stacks.
_trace_context = _Timeline("alloc")
# torch.cuda.memory._set_memory_metadata's string in force
_metadata = _Timeline("")
# the innermost torch.compile region running (_regions), "N/A" outside any
_compile_context = _Timeline("N/A")


def set_stack_hook(enabled: bool) -> None:
    """Take the Python stack of each allocation torch makes (enabled), or stop.
    gpumem.record_history reaches here too: its stacks are torch's context="alloc"
    (torch's _record_memory_history has set its own mode before it calls this)."""
    mode = _trace_context.current()
    if enabled and mode is None:
        _trace_context.set("alloc")
    elif not enabled and mode is not None:
        _trace_context.set(None)
    _C._torch_stack_hook(enabled)


def on_install() -> None:
    register_oom_formatter()  # torch's OutOfMemoryError is worded by gpumem.explain's format_oom
    explain = os.environ.get("GPUMEM_EXPLAIN_OOM", "1") != "0"
    _C._torch_explain_oom(explain)
    if _C._stacks_info()["enabled"]:
        set_stack_hook(True)


# The trace actions torch's _record_memory_history(skip_actions=...) names.
TORCH_TRACE_ACTIONS = ALLOCATOR_ACTIONS
_skip_actions: frozenset = frozenset()


def record_torch_history(enabled, *args, **kwargs) -> None:
    """torch._C._cuda_record_memory_history(enabled, context, stacks, max_entries,
    clear_history, compile_context, global_record_annotations, skip_actions) and
    _cuda_record_memory_history_legacy(enabled: bool, record_context,
    trace_alloc_max_entries, ...), answered by gpumem.record_history on every
    device's heap.  Stacks are Python stacks, with stacks="all" preceded by the
    C++ frames (gpumem.record_history's stacks="all"); context=None records none,
    "state" only those of the blocks alive, "alloc" those of trace entries too,
    "all" also the stacks of the code that frees and empties the cache.  clear_history drops the events recorded
    so far; skip_actions leaves those actions out of the trace."""
    global _skip_actions
    clear, skip = False, ()
    if isinstance(enabled, bool):
        record_context = args[0] if args else kwargs.get("record_context", True)
        max_entries = args[1] if len(args) > 1 else kwargs.get("trace_alloc_max_entries", 1)
        alloc_context = args[2] if len(args) > 2 else kwargs.get("trace_alloc_record_context", False)
        mode = "all" if enabled else False
        stacks = "python" if enabled and record_context else None
        context = ("alloc" if alloc_context else "state") if stacks else None
    else:
        context = args[0] if args else kwargs.get("context", "all")
        stack_kind = args[1] if len(args) > 1 else kwargs.get("stacks", "all")
        max_entries = args[2] if len(args) > 2 else kwargs.get("max_entries", MAX_HISTORY)
        clear = args[3] if len(args) > 3 else kwargs.get("clear_history", False)
        skip = args[6] if len(args) > 6 else kwargs.get("skip_actions", None)
        if enabled not in (None, "state", "all"):
            raise ValueError(f"enabled must be None, 'state' or 'all', not {enabled!r}")
        if context not in (None, "state", "alloc", "all"):
            raise ValueError(f"context must be None, 'state', 'alloc' or 'all', not {context!r}")
        mode = enabled or False
        stacks = stack_kind if enabled and context and stack_kind in ("python", "all") else None
        context = context if stacks else None
    if isinstance(skip, str):
        skip = (skip,)
    unknown = sorted(set(skip or ()) - set(TORCH_TRACE_ACTIONS))
    if unknown:
        known = ", ".join(TORCH_TRACE_ACTIONS)
        raise ValueError(f"unknown trace action(s) in skip_actions: {unknown} (known: {known})")
    n = max(1, min(int(max_entries), MAX_HISTORY))
    _follow_regions(mode, args, kwargs, legacy=isinstance(enabled, bool))
    if clear and mode == "all":
        _C.registry_history_enable(0)  # the ring starts empty
    _trace_context.set(context)  # before the ring records in the new mode
    _record(_C.registry_history_enable, mode, stacks, n)
    _skip_actions = frozenset(skip or ())
    # context="all" with a trace to record: frees and empty_cache take their caller's stack
    _C._torch_set_event_stacks(context == "all" and mode == "all")


def _follow_regions(mode, args, kwargs, legacy: bool) -> None:
    """compile_context=True (the legacy form's 6th argument, the other's 5th): trace entries
    carry the torch.compile region they were recorded in; otherwise, or when recording stops,
    "N/A"."""
    at = 5 if legacy else 4
    wanted = args[at] if len(args) > at else kwargs.get("compile_context", False)
    if mode and wanted:
        _regions.start(set_compile_context)
    else:
        _regions.stop()
        set_compile_context(_regions.OUTSIDE)


def set_memory_metadata(metadata) -> None:
    """torch._C._cuda_setMemoryMetadata: the string every trace entry recorded from
    now on carries as "user_metadata" ("" clears it)."""
    if not isinstance(metadata, str):
        raise TypeError(f"memory metadata must be a str, not {type(metadata).__name__}")
    _metadata.set(metadata)


def get_memory_metadata() -> str:
    """torch._C._cuda_getMemoryMetadata: the string set last."""
    return _metadata.current()


def set_compile_context(region: str) -> None:
    """The compiled region trace entries recorded from now on carry as "compile_context"."""
    _compile_context.set(region)


def _entry_hook():
    """Snapshot.to_torch's entry_hook: each trace entry as torch records it, with the
    metadata in force then, and frames only where the context mode in force then
    gives trace entries any."""
    metadata_at, context_at = _metadata.reader(), _trace_context.reader()
    region_at = _compile_context.reader()

    def hook(e, entry) -> None:
        if entry["action"] in ("alloc", "free_requested", "free_completed") and e.requested:
            entry["size"] = e.requested  # torch's entries of a block's life carry the bytes asked for
        entry["user_metadata"] = metadata_at(e.time_ns)
        entry["compile_context"] = region_at(e.time_ns)
        if context_at(e.time_ns) not in ("alloc", "all"):
            entry["frames"] = []

    return hook


def torch_snapshot_dict(arg=None) -> dict:
    """torch._C._cuda_memorySnapshot's answer: each device's Snapshot.to_torch(),
    segments concatenated, device_traces[d] from device d's history ring.
    `arg` is torch's (pool id, pool id, include_traces) tuple, or None; a pool id
    other than (0, 0) keeps the segments of that pool only (MemPool.snapshot())."""
    include_traces = not (isinstance(arg, tuple) and len(arg) >= 3 and arg[2] is False)
    pool = tuple(arg[:2]) if isinstance(arg, tuple) and len(arg) >= 2 else (0, 0)
    devices = _C.registry_devices()
    hook = _entry_hook()
    n = max([_C._torch_device_count()] + [d + 1 for d in devices] + [1])
    out = {"segments": [], "device_traces": [[] for _ in range(n)]}
    for d in devices:
        t = Snapshot.from_heap(registry_heap(d), with_history=include_traces).to_torch(d, entry_hook=hook)
        out["segments"].extend(s for s in t["segments"] if pool == (0, 0) or tuple(s["segment_pool_id"]) == pool)
        out["device_traces"][d] = [e for e in t["device_traces"][d] if e["action"] not in _skip_actions]
        out.setdefault("allocator_settings", t["allocator_settings"])
        out.setdefault("external_annotations", t["external_annotations"])
    return out
