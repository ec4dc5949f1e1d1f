"""The report gpumem.explain() and gpumem.last_oom() return: the facts (Report,
and the Causes found, main first) and their layout as text.  How the facts are
gathered is gpumem/explain/facts.py; how each cause and its advice is worded,
causes.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

from .._units import format_size as _fs

__all__ = ["Report", "Cause", "CAUSE_KINDS"]

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
        L: List[str] = [self._headline() if first_line is None else first_line, ""]
        L.append(f"Where the device's {_fs(self.device_total)} are:")
        rows = self._heap_rows() + self._device_rows()
        w = max(len(r[0]) for r in rows)
        for label, b, note in rows:
            L.append(f"  {label:<{w}}  {_fs(b):>11}" + (f"   {note}" if note else ""))
        if self.causes:
            L.append("")
            L.append("Causes, main one first:" if len(self.causes) > 1 else "Cause:")
            for i, c in enumerate(self.causes, 1):
                L.append(f"  {i}. [{c.kind}] {c.headline}")
                L.extend(f"       {d}" for d in c.details)
        for title, lines, bullet in (
            ("Forecast (gpumem.forecast):", self.forecast, ""),
            ("References this notebook keeps alive:", self.notebook_refs, "- "),
            ("What to do:", self.advice, "- "),
        ):
            if lines:
                L.append("")
                L.append(title)
                L.extend(f"  {bullet}{line}" for line in lines)
        return "\n".join(L)

    def _headline(self) -> str:
        if self.is_oom:
            return (
                f"CUDA out of memory. Tried to allocate {_fs(self.request)} on {self.device} "
                f"(stream {self.stream}); gpumem could make at most {_fs(self.largest_possible)} "
                f"even after defragmenting: {_fs(self.shortfall)} short."
            )
        if self.request:
            verdict = "fits" if self.fits else f"does NOT fit ({_fs(self.shortfall)} short)"
            return (
                f"A request of {_fs(self.request)} on {self.device} {verdict}: the largest block gpumem "
                f"could make now is {_fs(self.largest_possible)}."
            )
        return f"Memory on {self.device}: the largest block gpumem could make now is {_fs(self.largest_possible)}."

    def _heap_rows(self) -> List[Tuple[str, int, str]]:
        """(label, bytes, note) of what this heap holds."""
        rows = [
            ("held by this heap (reserved)", self.reserved_bytes, ""),
            ("  live tensors", self.live_bytes, f"{self.n_live} blocks"),
            ("  pending free (other streams)", self.pending_bytes, ""),
            ("  free in pages shared with live", self.stranded_bytes, "stranded: not movable"),
            ("  wholly free pages (cached)", self.cached_bytes, "defragmentation reuses these"),
        ]
        if self.pool_live_bytes or self.pool_free_bytes:
            pools = f"{self.n_pools} pool(s): CUDA graphs / MemPools"
            rows.insert(2, ("  of which in private pools", self.pool_live_bytes, pools))
            kept = "reusable only by their pool until it is released"
            rows.insert(4, ("  free, kept for private pools", self.pool_free_bytes, kept))
        if self.spilled_bytes:  # live, but not on the device
            limit = f"limit {_fs(self.spill_limit)}"
            rows.insert(2, ("  of which in host memory (spilled)", self.spilled_bytes, limit))
        if self.chunk_locked_bytes:
            chunks = "allocations of several pages: freed only whole"
            rows.append(("  of which in partly used chunks", self.chunk_locked_bytes, chunks))
        if self.paused_pools:
            paused = f"{self.paused_pools} pool(s); resume needs this much back"
            rows.append(("paused pools (released, not held)", self.paused_bytes, paused))
        return rows

    def _device_rows(self) -> List[Tuple[str, int, str]]:
        """(label, bytes, note) of the device outside this heap."""
        rows = []
        if self.outside_allocator is not None:
            nvml = f"NVML {_fs(self.self_usage or 0)} for PID {self.self_pid} - reserved"
            rows.append(("this process, outside the allocator", self.outside_allocator, nvml))
        for pid, b in self.other_processes:
            rows.append((f"other process PID {pid}", b, ""))
        if self.unattributed:
            why = (
                "no NVML: other processes and this one's CUDA context together"
                if self.processes is None
                else "not listed by NVML"
            )
            rows.append(("used outside this heap, owner unknown", self.unattributed, why))
        rows.append(("free on the device", self.device_free, ""))
        if self.user_cap:
            kept = f"{_fs(max(0, self.device_total - self.user_cap))} of the device kept out of reach"
            rows.append(("cap on this heap", self.user_cap, kept))
        return rows

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
