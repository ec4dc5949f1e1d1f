"""The visibility layer on the heaps gpumem serves torch with.

gpumem.torch's install calls these; they connect it to snapshot / history /
explain (the layers below, which never import this one: history reaches
set_stack_hook through the hook install registers in gpumem._heap):

  on_install()            sets torch's OOM hook (csrc/python/torch_viz.c), which words
                          torch.OutOfMemoryError with the one formatter gpumem.explain
                          registers for every OOM (GPUMEM_EXPLAIN_OOM=0: the one line
                          alone), and the stack hook when stacks are already being recorded
  set_stack_hook(on)      Python stacks for allocations torch makes (record_history)
  record_torch_history()  torch.cuda.memory._record_memory_history, routed to record_history
  torch_snapshot_dict()   torch.cuda.memory._snapshot / memory_snapshot / _dump_snapshot:
                          Snapshot.to_torch() of every device's heap
"""

from __future__ import annotations

import os

from .. import _C
from .._heap import MAX_HISTORY  # the history ring's bound (torch's default max_entries is sys.maxsize)
from .._resolve import TorchHeap
from ..history import _record
from ..snapshot import Snapshot

__all__ = ["on_install", "set_stack_hook", "record_torch_history", "torch_snapshot_dict"]


def _hooks():
    return _C._torch_viz_hooks()


def set_stack_hook(enabled: bool) -> None:
    """Take the Python stack of each allocation torch makes (enabled), or stop."""
    _C._torch_set_context_hook(_hooks()["context"] if enabled else 0)


def on_install() -> None:
    explain = os.environ.get("GPUMEM_EXPLAIN_OOM", "1") != "0"
    _C._torch_set_oom_formatter(_hooks()["oom_formatter"] if explain else 0)
    if _C._stacks_info()["enabled"]:
        set_stack_hook(True)


# The trace actions torch's _record_memory_history(skip_actions=...) names.
TORCH_TRACE_ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
)
_skip_actions: frozenset = frozenset()


def record_torch_history(enabled, *args, **kwargs) -> None:
    """torch._C._cuda_record_memory_history(enabled, context, stacks, max_entries,
    clear_history, compile_context, global_record_annotations, skip_actions) and
    _cuda_record_memory_history_legacy(enabled: bool, record_context,
    trace_alloc_max_entries, ...), answered by gpumem.record_history on every
    device's heap.  Stacks are Python stacks ("all" asks for C++ frames too; gpumem
    has only the Python ones); context=None records none.  clear_history drops the
    events recorded so far; skip_actions leaves those actions out of the trace."""
    global _skip_actions
    clear, skip = False, ()
    if isinstance(enabled, bool):
        record_context = args[0] if args else kwargs.get("record_context", True)
        max_entries = args[1] if len(args) > 1 else kwargs.get("trace_alloc_max_entries", 1)
        mode = "all" if enabled else False
        stacks = "python" if enabled and record_context else None
    else:
        context = args[0] if args else kwargs.get("context", "all")
        stack_kind = args[1] if len(args) > 1 else kwargs.get("stacks", "all")
        max_entries = args[2] if len(args) > 2 else kwargs.get("max_entries", MAX_HISTORY)
        clear = args[3] if len(args) > 3 else kwargs.get("clear_history", False)
        skip = args[6] if len(args) > 6 else kwargs.get("skip_actions", None)
        if enabled not in (None, "state", "all"):
            raise ValueError(f"enabled must be None, 'state' or 'all', not {enabled!r}")
        mode = enabled or False
        stacks = "python" if enabled and context and stack_kind in ("python", "all") else None
    if isinstance(skip, str):
        skip = (skip,)
    unknown = sorted(set(skip or ()) - set(TORCH_TRACE_ACTIONS))
    if unknown:
        known = ", ".join(TORCH_TRACE_ACTIONS)
        raise ValueError(f"unknown trace action(s) in skip_actions: {unknown} (known: {known})")
    n = max(1, min(int(max_entries), MAX_HISTORY))
    if clear and mode == "all":
        _C._torch_history_enable(0)  # the ring starts empty
    _record(_C._torch_history_enable, mode, stacks, n)
    _skip_actions = frozenset(skip or ())


def torch_snapshot_dict(arg=None) -> dict:
    """torch._C._cuda_memorySnapshot's answer: each device's Snapshot.to_torch(),
    segments concatenated, device_traces[d] from device d's history ring.
    `arg` is torch's (pool id, pool id, include_traces) tuple, or None; a pool id
    other than (0, 0) keeps the segments of that pool only (MemPool.snapshot())."""
    include_traces = not (isinstance(arg, tuple) and len(arg) >= 3 and arg[2] is False)
    pool = tuple(arg[:2]) if isinstance(arg, tuple) and len(arg) >= 2 else (0, 0)
    devices = _C._torch_devices()
    n = max([_C._torch_device_count()] + [d + 1 for d in devices] + [1])
    out = {"segments": [], "device_traces": [[] for _ in range(n)]}
    for d in devices:
        t = Snapshot.from_heap(TorchHeap(d), with_history=include_traces).to_torch(d)
        out["segments"].extend(s for s in t["segments"] if pool == (0, 0) or tuple(s["segment_pool_id"]) == pool)
        out["device_traces"][d] = [e for e in t["device_traces"][d] if e["action"] not in _skip_actions]
        out.setdefault("allocator_settings", t["allocator_settings"])
        out.setdefault("external_annotations", t["external_annotations"])
    return out
