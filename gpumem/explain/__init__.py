"""Why is GPU memory short?  gpumem.explain() and gpumem.last_oom().

The report splits the device's memory by who holds it, and names each cause
that stands between a request and the memory it needs, with numbers:

    too_big             the request alone is larger than the device (or the cap)
    other_processes     other processes hold memory on the device (by PID, NVML)
    outside_allocator   this process holds memory the allocator does not manage
                        (CUDA context, cuBLAS/cuDNN workspaces, NCCL buffers):
                        NVML's figure for this process minus what the heap reserved
    live_tensors        live blocks, with the allocation sites holding the most
                        bytes when history with stacks is on
    pending             freed blocks still waiting for other streams
    fragmentation       free bytes the heap cannot use for this request: those in
                        pages shared with live blocks ("stranded"; gpumem never
                        moves live data), and what defragmentation could and could
                        not reclaim
    cap                 a cap (set_cap, memory fraction) below what the device has
    device_error        a device call failed while trying to get memory

then ends with advice chosen by the causes found.  In IPython it also names
references the notebook itself keeps alive (Out[...], sys.last_traceback).

Numbers come from the core's report (gm_memory_report / gm_last_oom), a
snapshot of the heap, the device's free/total and, where NVML works, the
processes on the device.  facts.py gathers them, causes.py words the causes and
the advice, report.py holds the Report and lays it out as text.
"""

from __future__ import annotations

import os
from typing import Optional

from .. import _C
from .._which_heap import registry_heap, resolve_heap
from .._units import parse_size
from .facts import _build, set_forecast  # noqa: F401  (set_forecast: gpumem.forecast's)
from .report import CAUSE_KINDS, Cause, Report  # noqa: F401

__all__ = ["explain", "last_oom", "Report", "Cause", "format_oom", "register_oom_formatter"]


def explain(size=None, device=None) -> Report:
    """Why memory is short now: the report for a request of `size` bytes (an int
    or "2GiB"; None: no request, just who holds what) on a heap (a Heap, or None
    / a CUDA device for the heap gpumem installed there).  A Heap may come first,
    as in snapshot(heap): explain(heap) and explain(heap, "2GiB") read that heap."""
    if isinstance(size, _C.Heap):
        if isinstance(device, _C.Heap):
            raise TypeError("gpumem.explain() takes one heap: explain(heap) or explain(size, heap)")
        size, device = device, size
    heap = resolve_heap(device)
    n = 0 if size is None else parse_size(size)
    return _build(heap, heap.memory_report(n), is_oom=False)


def last_oom(device=None) -> Optional[Report]:
    """The report of the heap's last failed allocation, or None if none failed.
    Its numbers are those at the moment of the failure; the top sites are those
    of the blocks live now."""
    heap = resolve_heap(device)
    info = heap.last_oom()
    if info is None:
        return None
    return _build(heap, info, is_oom=True)


def format_oom(heap, info, fallback: str, processes=None) -> str:
    """The OutOfMemoryError message, registered with gpumem._C as the one
    formatter of every OOM: `heap` is a gpumem.Heap (Heap.malloc), or the CUDA
    device number of torch's heap (torch's allocations; `processes` is then what
    the device listed, or None).  The core's one-line message, then the report.
    GPUMEM_EXPLAIN_OOM=0 keeps the one line alone.  A report that fails to build
    leaves the one line with a note, since the OOM itself must still be reported."""
    if os.environ.get("GPUMEM_EXPLAIN_OOM", "1") == "0" or not info:
        return fallback
    if isinstance(heap, int):
        try:
            heap = _torch_heap(heap)
            return _build(heap, dict(info), is_oom=True, processes=processes).text(first_line=fallback)
        except Exception as e:  # noqa: BLE001 - a broken report must not hide the OOM
            return f"{fallback} (gpumem.explain failed: {type(e).__name__}: {e})"
    return _build(heap, dict(info), is_oom=True).text(first_line=fallback)


def _torch_heap(device: int):
    """The heap torch's allocations on `device` go to (tests replace this)."""
    return registry_heap(device)


def register_oom_formatter() -> None:
    """Make format_oom the one formatter of OutOfMemoryError messages (gpumem._C
    calls it for every heap).  gpumem does it when it sets itself up (the
    package, gpumem.install(), torch_allocator(), gpumem.cupy / gpumem.numba's
    install); importing this module alone registers nothing."""
    _C._set_oom_formatter(format_oom)
