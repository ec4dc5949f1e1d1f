"""Gathering the facts of a report: the core's figures (gm_memory_report /
gm_last_oom), a snapshot of the heap, the device's free and total memory, the
processes on the device where NVML works, the references a notebook keeps, and
the last forecast's lines.  The causes and advice are worded by causes.py.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, List, Optional, Tuple

from .._units import format_size as _fs
from ..snapshot import Snapshot
from .causes import diagnose
from .report import Report


def _notebook_refs() -> List[str]:
    """References that IPython itself holds: the Out cache and the last traceback."""
    refs: List[str] = []
    ip = None
    mod = sys.modules.get("IPython")
    if mod is not None:
        try:
            ip = mod.get_ipython()
        except Exception:
            ip = None
    if ip is not None:
        out = ip.user_ns.get("Out") or {}
        torch = sys.modules.get("torch")
        tensors = []
        for k, v in list(out.items()):
            if torch is not None and isinstance(v, torch.Tensor) and v.is_cuda:
                tensors.append(f"Out[{k}] ({_fs(v.element_size() * v.nelement())})")
        if tensors:
            refs.append(
                "the output cache holds CUDA tensors: "
                + ", ".join(tensors[:10])
                + (" ..." if len(tensors) > 10 else "")
                + "; `%reset -f out` drops them"
            )
        elif out:
            refs.append(
                f"the output cache Out[...] holds {len(out)} results (e.g. Out[{max(out)}]); "
                "results displayed by a cell stay alive there: `%reset -f out` drops them"
            )
    if getattr(sys, "last_traceback", None) is not None:
        refs.append(
            "sys.last_traceback keeps the frames (and tensors) of the last error alive: "
            "`sys.last_traceback = sys.last_value = None` releases them"
        )
    return refs


# _build's processes when the heap should be asked for them
_ASK = object()

# The core's figures a Report carries as they are; those it may leave out count as 0.
_CORE_FIGURES = (
    "cap_bytes",
    "live_bytes",
    "pending_bytes",
    "cached_bytes",
    "free_mapped_bytes",
    "largest_free_mapped",
    "largest_possible",
    "pages_needed",
)
_CORE_FIGURES_OR_0 = (
    "stream",
    "chunk_locked_bytes",
    "device_error",
    "pool_live_bytes",
    "pool_free_bytes",
    "spilled_bytes",
    "spill_limit",
)


def _build(heap, info: dict, is_oom: bool, processes=_ASK) -> Report:
    """The report on `heap` for the core's `info`; `processes`: the device's
    process list already taken ([(pid, bytes)], or None for "unknown"), else the
    heap is asked."""
    snap = Snapshot.from_heap(heap, with_history=False)
    s = snap.summary
    request = int(info["request"])
    total = int(info["device_total"])
    dfree = int(info["device_free"])
    reserved = int(info["reserved_bytes"])
    figures = {k: int(info[k]) for k in _CORE_FIGURES}
    figures.update({k: int(info.get(k, 0)) for k in _CORE_FIGURES_OR_0})
    page = snap.page_size
    r = Report(
        device=heap.device_name,
        request=request,
        is_oom=is_oom,
        fits=request <= figures["largest_possible"] if request else True,
        device_total=total,
        device_free=dfree,
        user_cap=heap.get_cap(),
        reserved_bytes=reserved,
        n_live=s.n_live,
        stranded_bytes=s.stranded_bytes,
        page_size=page,
        top_sites=snap.top_sites(5),
        n_pools=len(snap.pools),
        paused_pools=sum(1 for p in snap.pools if p.get("paused")),
        paused_bytes=sum(int(p.get("paused_pages", 0)) for p in snap.pools) * page,
        by_framework=snap.by_framework(),
        **figures,
        **_process_figures(heap, processes, reserved, total, dfree),
    )
    r.causes, r.advice = diagnose(r)
    if r.causes:
        r.notebook_refs = _notebook_refs()
    if _forecast_lines is not None and r.cap_bytes:
        try:
            r.forecast = list(_forecast_lines(r.cap_bytes))
        except Exception as e:  # noqa: BLE001 - a failing forecast must not hide the report
            r.forecast = [f"(the forecast failed: {type(e).__name__}: {e})"]
    return r


def _process_figures(heap, processes, reserved: int, total: int, dfree: int) -> dict:
    """The Report's figures of the processes on the device: NVML's list (`processes`, or the
    heap's answer), this process's share outside the allocator, the others largest first, and
    what no one listed holds."""
    try:
        procs = heap.device_processes() if processes is _ASK else processes
    except Exception:  # a failing NVML must not hide the OOM
        procs = None
    me = os.getpid()
    self_usage = outside = None
    others: List[Tuple[int, int]] = []
    if procs is not None:
        for pid, b in procs:
            if pid == me:
                self_usage = (self_usage or 0) + b
            elif b:
                others.append((pid, b))
        others.sort(key=lambda t: -t[1])
        if self_usage is not None:
            outside = max(0, self_usage - reserved)
    named = reserved + (outside or 0) + sum(b for _, b in others)
    return {
        "processes": procs,
        "self_pid": me,
        "self_usage": self_usage,
        "outside_allocator": outside,
        "other_processes": others,
        "unattributed": max(0, max(0, total - dfree) - named) if total else 0,
    }


# Set by gpumem.forecast (a layer above): capacity in bytes -> lines for the report.
_forecast_lines: Optional[Callable[[int], List[str]]] = None


def set_forecast(lines_for_capacity: Optional[Callable[[int], List[str]]]) -> None:
    """Make reports carry a forecast's lines (None: no more)."""
    global _forecast_lines
    _forecast_lines = lines_for_capacity
