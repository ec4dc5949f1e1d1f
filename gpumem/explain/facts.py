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
    try:
        procs = heap.device_processes() if processes is _ASK else processes
    except Exception:  # a failing NVML must not hide the OOM
        procs = None
    me = os.getpid()
    self_usage, outside, others = _split_processes(procs, me, reserved)
    used = max(0, total - dfree)
    named = reserved + (outside or 0) + sum(b for _, b in others)
    unattributed = max(0, used - named) if total else 0
    user_cap = heap.get_cap()
    page = snap.page_size
    r = Report(
        device=heap.device_name,
        request=request,
        stream=int(info.get("stream", 0)),
        is_oom=is_oom,
        fits=request <= int(info["largest_possible"]) if request else True,
        device_total=total,
        device_free=dfree,
        cap_bytes=int(info["cap_bytes"]),
        user_cap=user_cap,
        reserved_bytes=reserved,
        live_bytes=int(info["live_bytes"]),
        n_live=s.n_live,
        pending_bytes=int(info["pending_bytes"]),
        cached_bytes=int(info["cached_bytes"]),
        free_mapped_bytes=int(info["free_mapped_bytes"]),
        stranded_bytes=s.stranded_bytes,
        largest_free_mapped=int(info["largest_free_mapped"]),
        largest_possible=int(info["largest_possible"]),
        pages_needed=int(info["pages_needed"]),
        chunk_locked_bytes=int(info.get("chunk_locked_bytes", 0)),
        page_size=page,
        processes=procs,
        self_pid=me,
        self_usage=self_usage,
        outside_allocator=outside,
        other_processes=others,
        unattributed=unattributed,
        top_sites=snap.top_sites(5),
        device_error=int(info.get("device_error", 0)),
        n_pools=len(snap.pools),
        paused_pools=sum(1 for p in snap.pools if p.get("paused")),
        paused_bytes=sum(int(p.get("paused_pages", 0)) for p in snap.pools) * page,
        pool_live_bytes=int(info.get("pool_live_bytes", 0)),
        pool_free_bytes=int(info.get("pool_free_bytes", 0)),
        by_framework=snap.by_framework(),
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


def _split_processes(procs, me: int, reserved: int):
    """(NVML's bytes for this process or None, those outside the allocator or
    None, the other processes' [(pid, bytes)], largest first) of the device's
    process list (None: unknown)."""
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
    return self_usage, outside, others


# Set by gpumem.forecast (a layer above): capacity in bytes -> lines for the report.
_forecast_lines: Optional[Callable[[int], List[str]]] = None


def set_forecast(lines_for_capacity: Optional[Callable[[int], List[str]]]) -> None:
    """Make reports carry a forecast's lines (None: no more)."""
    global _forecast_lines
    _forecast_lines = lines_for_capacity
