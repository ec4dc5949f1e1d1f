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
processes on the device.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

from . import _C
from ._C import ERROR_NAMES
from ._resolve import registry_heap, resolve_heap
from .snapshot import Snapshot
from ._units import format_size as _fs
from ._units import parse_size

__all__ = ["explain", "last_oom", "Report", "Cause", "format_oom", "register_oom_formatter"]

# The page of a heap made without page_size: a GPU's VMM granularity (2 MiB on every current GPU),
# and the simulated device's default.
DEVICE_PAGE = 2 << 20

CAUSE_KINDS = (
    "too_big",
    "other_processes",
    "outside_allocator",
    "live_tensors",
    "pending",
    "fragmentation",
    "private_pools",
    "cap",
    "device_error",
)


@dataclass
class Cause:
    kind: str
    bytes: int
    headline: str
    details: List[str] = field(default_factory=list)


@dataclass
class Report:
    device: str
    request: int  # bytes asked for (0: no request, a state report)
    stream: int
    is_oom: bool  # built from a failed allocation
    fits: bool  # could the request be served now
    device_total: int
    device_free: int
    cap_bytes: int  # effective cap (device total when none)
    user_cap: int  # the cap set on the heap (0 = none)
    reserved_bytes: int
    live_bytes: int
    n_live: int
    pending_bytes: int
    cached_bytes: int
    free_mapped_bytes: int
    stranded_bytes: int
    largest_free_mapped: int
    largest_possible: int
    pages_needed: int
    page_size: int
    processes: Optional[List[Tuple[int, int]]]  # None: no NVML
    self_pid: int
    self_usage: Optional[int]  # NVML's figure for this process
    outside_allocator: Optional[int]
    other_processes: List[Tuple[int, int]]
    unattributed: int  # used on the device but by no one we can name
    top_sites: List[Tuple[str, int, int]]
    device_error: int
    n_pools: int = 0  # living private pools (CUDA graphs, MemPools)
    pool_live_bytes: int = 0  # live + pending in living private pools
    pool_free_bytes: int = 0  # free, kept for living private pools
    paused_pools: int = 0  # pools paused now (gpumem.pause): their pages are released
    paused_bytes: int = 0  # memory those pauses released (not reserved; resume takes it back)
    chunk_locked_bytes: int = 0  # cached, but in physical allocations of several pages blocks still use
    spilled_bytes: int = 0  # live memory on host pages behind the heap's addresses (spill)
    spill_limit: int = 0  # the most spill may map (0: spill is off)
    by_framework: dict = field(default_factory=dict)  # {framework: (live bytes, blocks)}
    causes: List[Cause] = field(default_factory=list)
    advice: List[str] = field(default_factory=list)
    notebook_refs: List[str] = field(default_factory=list)
    forecast: List[str] = field(default_factory=list)  # from the last gpumem.forecast, if any

    @property
    def shortfall(self) -> int:
        return max(0, self.request - self.largest_possible)

    @property
    def cause_kinds(self) -> List[str]:
        return [c.kind for c in self.causes]

    @property
    def main_cause(self) -> Optional[Cause]:
        return self.causes[0] if self.causes else None

    # ---- rendering -----------------------------------------------------------------

    def text(self, first_line: Optional[str] = None) -> str:
        """The report as text; `first_line` replaces the headline (the OOM
        exception keeps the core's one-line message there)."""
        L: List[str] = []
        if first_line is not None:
            L.append(first_line)
        elif self.is_oom:
            L.append(
                f"CUDA out of memory. Tried to allocate {_fs(self.request)} on {self.device} "
                f"(stream {self.stream}); gpumem could make at most {_fs(self.largest_possible)} "
                f"even after defragmenting: {_fs(self.shortfall)} short."
            )
        elif self.request:
            verdict = "fits" if self.fits else f"does NOT fit ({_fs(self.shortfall)} short)"
            L.append(
                f"A request of {_fs(self.request)} on {self.device} {verdict}: the largest block gpumem "
                f"could make now is {_fs(self.largest_possible)}."
            )
        else:
            L.append(
                f"Memory on {self.device}: the largest block gpumem could make now is {_fs(self.largest_possible)}."
            )
        L.append("")
        L.append(f"Where the device's {_fs(self.device_total)} are:")
        rows = [
            ("held by this heap (reserved)", self.reserved_bytes, ""),
            ("  live tensors", self.live_bytes, f"{self.n_live} blocks"),
            ("  pending free (other streams)", self.pending_bytes, ""),
            ("  free in pages shared with live", self.stranded_bytes, "stranded: not movable"),
            ("  wholly free pages (cached)", self.cached_bytes, "defragmentation reuses these"),
        ]
        if self.pool_live_bytes or self.pool_free_bytes:
            rows.insert(
                2,
                (
                    "  of which in private pools",
                    self.pool_live_bytes,
                    f"{self.n_pools} pool(s): CUDA graphs / MemPools",
                ),
            )
            rows.insert(
                4,
                (
                    "  free, kept for private pools",
                    self.pool_free_bytes,
                    "reusable only by their pool until it is released",
                ),
            )
        if self.spilled_bytes:  # live, but not on the device
            rows.insert(
                2, ("  of which in host memory (spilled)", self.spilled_bytes, f"limit {_fs(self.spill_limit)}")
            )
        if self.chunk_locked_bytes:
            rows.append(
                (
                    "  of which in partly used chunks",
                    self.chunk_locked_bytes,
                    "allocations of several pages: freed only whole",
                )
            )
        if self.paused_pools:
            rows.append(
                (
                    "paused pools (released, not held)",
                    self.paused_bytes,
                    f"{self.paused_pools} pool(s); resume needs this much back",
                )
            )
        if self.outside_allocator is not None:
            rows.append(
                (
                    "this process, outside the allocator",
                    self.outside_allocator,
                    f"NVML {_fs(self.self_usage or 0)} for PID {self.self_pid} - reserved",
                )
            )
        for pid, b in self.other_processes:
            rows.append((f"other process PID {pid}", b, ""))
        if self.unattributed:
            rows.append(
                (
                    "used outside this heap, owner unknown",
                    self.unattributed,
                    "no NVML: other processes and this one's CUDA context together"
                    if self.processes is None
                    else "not listed by NVML",
                )
            )
        rows.append(("free on the device", self.device_free, ""))
        if self.user_cap:
            rows.append(
                (
                    "cap on this heap",
                    self.user_cap,
                    f"{_fs(max(0, self.device_total - self.user_cap))} of the device kept out of reach",
                )
            )
        w = max(len(r[0]) for r in rows)
        for label, b, note in rows:
            L.append(f"  {label:<{w}}  {_fs(b):>11}" + (f"   {note}" if note else ""))
        if self.causes:
            L.append("")
            L.append("Causes, main one first:" if len(self.causes) > 1 else "Cause:")
            for i, c in enumerate(self.causes, 1):
                L.append(f"  {i}. [{c.kind}] {c.headline}")
                L.extend(f"       {d}" for d in c.details)
        if self.forecast:
            L.append("")
            L.append("Forecast (gpumem.forecast):")
            L.extend(f"  {line}" for line in self.forecast)
        if self.notebook_refs:
            L.append("")
            L.append("References this notebook keeps alive:")
            L.extend(f"  - {r}" for r in self.notebook_refs)
        if self.advice:
            L.append("")
            L.append("What to do:")
            L.extend(f"  - {a}" for a in self.advice)
        return "\n".join(L)

    __str__ = text

    def __repr__(self) -> str:
        what = f"request {_fs(self.request)} {'fits' if self.fits else 'does not fit'}" if self.request else "state"
        cause = f", main cause {self.causes[0].kind}" if self.causes else ""
        return (
            f"<gpumem Report {self.device}: {what}{' (OOM)' if self.is_oom else ''}; {_fs(self.live_bytes)} live, "
            f"{_fs(self.reserved_bytes)} reserved{cause}; print() it for the whole report>"
        )

    def _repr_html_(self) -> str:
        import html

        return f"<pre class='gpumem-explain'>{html.escape(self.text())}</pre>"


# ---- building the report ------------------------------------------------------------


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
        spilled_bytes=int(info.get("spilled_bytes", 0)),
        spill_limit=int(info.get("spill_limit", 0)),
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
    _diagnose(r, heap)
    if r.causes:
        r.notebook_refs = _notebook_refs()
    if _forecast_lines is not None and r.cap_bytes:
        try:
            r.forecast = list(_forecast_lines(r.cap_bytes))
        except Exception as e:  # noqa: BLE001 - a failing forecast must not hide the report
            r.forecast = [f"(the forecast failed: {type(e).__name__}: {e})"]
    return r


# Set by gpumem.forecast (a layer above): capacity in bytes -> lines for the report.
_forecast_lines: Optional[Callable[[int], List[str]]] = None


def set_forecast(lines_for_capacity: Optional[Callable[[int], List[str]]]) -> None:
    """Make reports carry a forecast's lines (None: no more)."""
    global _forecast_lines
    _forecast_lines = lines_for_capacity


def _diagnose(r: Report, heap) -> None:
    """Fill r.causes (main first) and r.advice."""
    causes: List[Cause] = []
    advice: List[str] = []
    short = r.shortfall if r.request else 0
    # a request larger than the whole device, else than the cap: nothing can make it fit
    for limit, what in ((r.device_total, "the whole device"), (r.user_cap, "the cap")):
        if r.request and limit and r.request > limit:
            text = f"the request ({_fs(r.request)}) is larger than {what} ({_fs(limit)})"
            causes.append(Cause("too_big", r.request - limit, text))
            break
    if not r.request or short or r.is_oom:
        ranked: List[Cause] = []
        if r.live_bytes:
            details = [f"{_fs(b):>11} in {n:>4} blocks  {site}" for site, b, n in r.top_sites]
            if r.top_sites and all(site.startswith("<no stack") for site, _, _ in r.top_sites):
                details = ["no allocation sites recorded: gpumem.record_history(stacks='python') keeps them"]
            if any(k in ("cupy", "numba") for k in r.by_framework):
                details.insert(
                    0,
                    "by framework: "
                    + ", ".join(
                        f"{k} {_fs(b)} in {n} block{'s' if n != 1 else ''}" for k, (b, n) in r.by_framework.items()
                    ),
                )
            ranked.append(
                Cause(
                    "live_tensors", r.live_bytes, f"live tensors hold {_fs(r.live_bytes)} in {r.n_live} blocks", details
                )
            )
        if r.other_processes:
            tot = sum(b for _, b in r.other_processes)
            ranked.append(
                Cause(
                    "other_processes",
                    tot,
                    f"{len(r.other_processes)} other process(es) hold {_fs(tot)} on this device",
                    [f"PID {pid}: {_fs(b)}" for pid, b in r.other_processes[:8]],
                )
            )
        if r.outside_allocator:
            ranked.append(
                Cause(
                    "outside_allocator",
                    r.outside_allocator,
                    f"this process holds {_fs(r.outside_allocator)} outside the allocator "
                    f"(CUDA context, library workspaces): NVML reports {_fs(r.self_usage or 0)} for "
                    f"PID {r.self_pid}, the heap reserved {_fs(r.reserved_bytes)}",
                )
            )
        if r.unattributed and r.processes is None:
            ranked.append(
                Cause(
                    "other_processes",
                    r.unattributed,
                    f"{_fs(r.unattributed)} of the device is used outside this heap, by other "
                    "processes or this process's CUDA context (NVML is not available to tell which)",
                )
            )
        if r.pool_free_bytes:
            ranked.append(
                Cause(
                    "private_pools",
                    r.pool_free_bytes,
                    f"{_fs(r.pool_free_bytes)} are free but kept for private pools (CUDA graphs, "
                    f"MemPools), which also hold {_fs(r.pool_live_bytes)} live: no other allocation "
                    "may reuse them, and their pages are never moved or released",
                    [
                        "a graph's memory stays reserved for it while the graph lives: delete graphs "
                        "no longer replayed (torch._dynamo.reset() for torch.compile's), and share one "
                        "pool between graphs run in sequence (torch.cuda.graph_pool_handle())"
                    ],
                )
            )
        if r.pending_bytes:
            ranked.append(
                Cause(
                    "pending",
                    r.pending_bytes,
                    f"{_fs(r.pending_bytes)} are freed but wait for work on other streams "
                    "(record_stream) before they can be reused",
                )
            )
        frag = r.stranded_bytes
        if frag and (short == 0 or frag >= r.page_size):
            ranked.append(
                Cause(
                    "fragmentation",
                    frag,
                    f"{_fs(frag)} are free but stranded in pages that also hold live blocks",
                    [
                        f"defragmentation already reuses wholly free pages ({_fs(r.cached_bytes)} cached now) by "
                        f"remapping them behind a new address; it cannot reclaim the {_fs(frag)} stranded, because "
                        "gpumem never moves live data",
                        f"largest free range in mapped memory: {_fs(r.largest_free_mapped)}; "
                        f"largest block possible after defragmenting: {_fs(r.largest_possible)}",
                    ],
                )
            )
        if r.chunk_locked_bytes:
            ranked.append(
                Cause(
                    "chunks",
                    r.chunk_locked_bytes,
                    f"{_fs(r.chunk_locked_bytes)} are free pages inside physical allocations of several pages "
                    "(growth with chunk_pages > 1 or with room, or a resumed pool) that live blocks still use: "
                    "an allocation is unmapped only as a whole, so "
                    "defragmentation cannot move them",
                )
            )
        if r.user_cap and r.user_cap < r.device_total:
            beyond = max(0, min(r.device_total - r.user_cap, r.device_free))
            if beyond:
                ranked.append(
                    Cause(
                        "cap",
                        beyond,
                        f"a cap of {_fs(r.user_cap)} keeps {_fs(beyond)} of free device memory out "
                        f"of reach (device {_fs(r.device_total)})",
                    )
                )
        ranked.sort(key=lambda c: -c.bytes)
        causes.extend(ranked)
    if r.device_error:
        # Listed last: a failed call (e.g. a synchronize refused while streams
        # still run) is how the shortage showed, rarely why memory is short.
        causes.append(
            Cause(
                "device_error",
                0,
                f"a device call failed ({_code_name(r.device_error)}) while gpumem tried to free or get memory",
            )
        )
    # Advice follows the causes, in their order (main cause first: by the bytes
    # each accounts for), one set per kind of cause.
    seen = set()
    for c in causes:
        if c.kind in seen:
            continue
        seen.add(c.kind)
        if c.kind == "live_tensors" and "too_big" in seen:
            continue  # the too_big advice already says to split the work
        advice.extend(_advice_for(c.kind, r, short))
    r.causes = causes
    r.advice = advice


def _framework_advice(r: Report) -> List[str]:
    """For arrays CuPy / Numba hold in the heap they share with torch."""
    out = []
    for fw in ("cupy", "numba"):
        if fw in r.by_framework:
            b, n = r.by_framework[fw]
            name = "CuPy" if fw == "cupy" else "Numba"
            out.append(
                f"{name} holds {_fs(b)} in {n} array(s) of this heap: compute in chunks (e.g. a matmul "
                f"by blocks of rows, C[i:j] = A[i:j] @ B, each copied out or reduced before the next) so "
                f"that only one chunk of the result is live at a time, and `del` arrays you are done with."
            )
    return out


def _advice_for(kind: str, r: Report, short: int) -> List[str]:
    """What to do about one kind of cause."""
    if kind == "too_big":
        if r.user_cap and r.request <= r.device_total:
            return [f"The request is larger than the cap: raise the cap ({_fs(r.user_cap)}), or split the work."]
        return [
            "No setting makes one tensor larger than the GPU fit: split the work (smaller batch, chunk "
            "the computation), use a smaller dtype (bf16/fp16, 8-bit optimizers), or shard it over devices."
        ]
    if kind == "live_tensors":
        limit = r.user_cap if r.user_cap else r.device_total
        share = (
            f" ({100.0 * r.live_bytes / limit:.0f}% of the {_fs(limit)} {'cap' if r.user_cap else 'device'})"
            if limit
            else ""
        )
        return [
            f"Live tensors hold {_fs(r.live_bytes)}{share}: the work is too big for this memory. Use a "
            "smaller batch (or shorter sequences / smaller images) and gradient accumulation (e.g. half the "
            "batch, two backward() per optimizer.step()) to keep the effective batch; activation "
            "checkpointing (torch.utils.checkpoint) trades compute for activation memory.",
            "Inference: run under torch.no_grad() / torch.inference_mode() so no activations are "
            "kept for backward; split a large batch into chunks.",
            "`del` tensors you no longer need (losses kept for logging: keep loss.item(), not loss), "
            "then gpumem/torch.cuda.empty_cache() to give the pages back to other processes.",
        ] + _framework_advice(r)
    if kind == "other_processes":
        pids = ", ".join(str(p) for p, _ in r.other_processes[:5]) or "see nvidia-smi"
        return [
            f"Free the GPU from other processes (PIDs {pids}): stop them, or give them another GPU "
            "with CUDA_VISIBLE_DEVICES."
        ]
    if kind == "outside_allocator":
        return [
            f"Leave room for the {_fs(r.outside_allocator or 0)} this process holds outside the allocator: "
            "cap gpumem lower, or shrink library workspaces (CUBLAS_WORKSPACE_CONFIG=:4096:8, "
            "torch.backends.cudnn.benchmark=False)."
        ]
    if kind == "pending":
        return [
            "Synchronize the side streams (or avoid record_stream on short-lived tensors) so that "
            "pending blocks become reusable."
        ]
    if kind == "fragmentation" and (r.is_oom or short):
        advice = [
            "Stranded memory comes from small long-lived tensors sharing pages with freed ones: "
            "allocate persistent buffers (weights, optimizer state, caches) before the loop, and free "
            "the small tensors the top sites list."
        ]
        if r.page_size > DEVICE_PAGE:
            advice.append(
                f"This heap's pages are {_fs(r.page_size)} (page_size): a block keeps whole pages, so the "
                f"larger the page the more a small tensor strands. The default page ({_fs(DEVICE_PAGE)}, "
                "GPUMEM_CONF without page_size for torch) strands less."
            )
        return advice
    if kind == "chunks" and (r.is_oom or short):
        return [
            "Memory near its limit defragments best page by page: with chunk_pages > 1, create the heap "
            "with chunk_pages=1 (GPUMEM_CONF=chunk_pages:1 for torch), which makes every page it grows "
            "by its own allocation. A resumed pool's allocations stay whole until all their pages are free, "
            "even after the pool ends: free its tensors. While far from its limit the heap also grows large "
            "requests by such allocations; pressure=0 (GPUMEM_CONF=pressure:0 for torch) makes it grow page "
            "by page everywhere."
        ]
    if kind == "private_pools":
        return [
            "Release CUDA graphs and MemPools you no longer replay (del the graph / pool, or "
            "graph.reset()): their pools' memory then returns to the heap."
        ]
    if kind == "cap":
        return [
            f"Raise or remove the cap (heap.set_cap / torch.cuda.set_per_process_memory_fraction): "
            f"the device has {_fs(r.device_free)} free beyond it."
        ]
    return []


def _code_name(code: int) -> str:
    return ERROR_NAMES.get(code, f"error {code}")


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
