"""gpumem.snapshot(): what the heap holds, as numbers, pictures and torch's format.

A heap is one reserved address range.  Physical pages (2 MiB unless page_size) are mapped behind
parts of it; blocks tile the range in address order:

    live       handed out (a tensor)
    pending    freed, but a stream named by record_stream may still use it
    free       reusable now, inside mapped pages
    unmapped   address space with no memory behind it

and each page is "used" (some live or pending byte lies in it, or a block kept
for a living private pool), "cached" (mapped but wholly free: what empty_cache()
releases and what defragmentation can move behind a new address) or
"unmapped".  A *segment* is a maximal run of mapped pages; that is what torch's
snapshot format calls a segment of an expandable allocator, so to_torch() maps
one to one.  A block of a private pool (a CUDA graph's, or a MemPool's) carries
the pool's id; a segment's `segment_pool_id` is the pool holding most of its
pooled bytes, (0, 0) when none.

The summary's figures and their definitions:

    live_bytes           sum of live block sizes (512-byte rounded)
    requested_bytes      sum of the sizes asked for
    reserved_bytes       physical memory the heap holds (mapped + spare pages)
    free_mapped_bytes    free bytes inside mapped pages, outside private pools
    largest_free_range   largest run of adjacent free blocks: the biggest request
                         served without touching the device
    fragmentation        1 - largest_free_range / free_mapped_bytes: the share of
                         free mapped memory that lies outside its largest piece
                         (0 = all in one piece, or nothing free)
    defrag_reclaimable   bytes of wholly free pages (cached + spare): what
                         defragmentation can move behind any address, and what
                         empty_cache() would give back to the device
    stranded_bytes       free bytes in pages that also hold live data: neither
                         defragmentation nor empty_cache can reclaim them until
                         the live neighbours are freed (gpumem never moves a
                         live block)
    largest_possible     the largest block the heap could make now, defragmenting
                         and growing up to the cap/device (from the core)
    pool_live_bytes      live and pending bytes of private pools (in live_bytes
                         and pending_bytes too)
    pool_free_bytes      free bytes kept for private pools: only their pool may
                         reuse them, and their pages are never moved or released
"""

from __future__ import annotations

import gzip
import os
import pickle
import re
from array import array
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from ._frameworks import framework_of
from ._C import Heap
from ._which_heap import default_framework, resolve_heap
from .draw import write_page
from .draw.memory_map import plot_matplotlib, render_fragment, render_page, render_svg
from ._units import format_size
from .history import Frame, HistoryEntry, frames_for, site_of
from .timeline import DEFAULT_POINTS, Timeline, from_snapshot, from_trace

__all__ = ["Snapshot", "Block", "Segment", "Summary", "snapshot", "dump_snapshot", "memory_over_time", "TORCH_STATE"]

PAGE_STATES = {0: "unmapped", 1: "used", 2: "cached", 3: "paused"}  # 3: released by a pool pause
_MAPPED_RUN = re.compile(rb"[^\x00]+")  # a run of pages in any state but unmapped
# gpumem block state -> torch's block state
TORCH_STATE = {"live": "active_allocated", "pending": "active_pending_free", "free": "inactive"}
# history action -> torch TraceEntry action (empty_cache shows as its unmaps)
STREAM_ANY = (1 << 64) - 1  # GM_STREAM_ANY: free memory any stream may use

TORCH_ACTION = {
    "alloc": "alloc",
    "free_requested": "free_requested",
    "free_completed": "free_completed",
    "map": "segment_map",
    "remap": "segment_map",
    "unmap": "segment_unmap",
    "oom": "oom",
}


@dataclass(frozen=True)
class Block:
    addr: int
    size: int
    requested: int
    stream: int
    context: int
    alloc_seq: int
    state: str  # live / pending / free / unmapped
    pool: Optional[Tuple[int, int]] = None  # the private pool (torch's MempoolId_t), None: none

    @property
    def end(self) -> int:
        return self.addr + self.size

    @property
    def frames(self) -> Tuple[Frame, ...]:
        return frames_for(self.context) if self.state in ("live", "pending") else ()

    @property
    def site(self) -> str:
        """Allocation site ("file:line in func") when stacks were recorded, else ""."""
        return site_of(self.frames)

    @property
    def framework(self) -> str:
        """ "cupy" / "numba" for blocks those frameworks allocated through gpumem,
        "" for the heap's own user (torch, on the heaps gpumem serves torch with)."""
        return framework_of(self.context)


def segment_pool_id(blocks) -> Tuple[int, int]:
    """torch's segment_pool_id for a run of blocks: the private pool that holds
    the most bytes among them (lowest id on ties), (0, 0) when none does."""
    by: Dict[Tuple[int, int], int] = {}
    for b in blocks:
        if b.pool is not None and b.state != "unmapped":
            by[tuple(b.pool)] = by.get(tuple(b.pool), 0) + b.size
    if not by:
        return (0, 0)
    return min(by, key=lambda k: (-by[k], k))


@dataclass
class Segment:
    """A maximal run of mapped pages and the blocks that tile it."""

    addr: int
    size: int
    blocks: List[Block]

    def __repr__(self) -> str:
        return f"<gpumem Segment {self.addr:#x}+{format_size(self.size)}: {len(self.blocks)} blocks>"


@dataclass
class Summary:
    live_bytes: int
    requested_bytes: int
    pending_bytes: int
    reserved_bytes: int
    mapped_bytes: int
    used_page_bytes: int
    cached_bytes: int
    spare_bytes: int
    free_mapped_bytes: int
    largest_free_range: int
    fragmentation: float
    defrag_reclaimable: int
    stranded_bytes: int
    largest_possible: int
    n_live: int
    n_pending: int
    n_free: int
    n_segments: int
    cap_bytes: int
    device_total: int
    device_free: int
    pool_live_bytes: int = 0  # live and pending blocks of private pools
    pool_free_bytes: int = 0  # free blocks kept for private pools (not in free_mapped_bytes)

    def __repr__(self) -> str:
        f = format_size
        return (
            f"<gpumem Summary: {f(self.live_bytes)} live in {self.n_live} blocks, {f(self.reserved_bytes)} "
            f"reserved, {f(self.free_mapped_bytes)} free mapped, fragmentation {self.fragmentation:.1%}>"
        )

    def rows(self) -> List[Tuple[str, str, str]]:
        """(label, value, what it means) for tables."""
        f = format_size
        return [
            ("live", f"{f(self.live_bytes)} in {self.n_live} blocks", f"requested {f(self.requested_bytes)}"),
            ("pending", f(self.pending_bytes), "freed, waiting for other streams"),
            ("reserved", f(self.reserved_bytes), "physical memory held (mapped + spare pages)"),
            ("free but mapped", f(self.free_mapped_bytes), f"in {self.n_free} free blocks"),
            ("largest free range", f(self.largest_free_range), "served without any device call"),
            (
                "fragmentation",
                f"{self.fragmentation:.1%}",
                "1 - largest free range / free mapped: free memory outside its largest piece",
            ),
            (
                "defrag could reclaim",
                f(self.defrag_reclaimable),
                "wholly free pages: remappable behind any address, or released by empty_cache",
            ),
            ("stranded", f(self.stranded_bytes), "free bytes in pages shared with live blocks"),
            ("largest block possible", f(self.largest_possible), "after defragmenting and growing to the cap"),
            ("cap", f(self.cap_bytes), f"device {f(self.device_total)} total, {f(self.device_free)} free"),
        ] + (
            [
                (
                    "private pools",
                    f"{f(self.pool_live_bytes)} live, {f(self.pool_free_bytes)} free",
                    "kept for CUDA graphs / MemPools: their pages never move",
                )
            ]
            if self.pool_live_bytes or self.pool_free_bytes
            else []
        )

    def text(self) -> str:
        w = max(len(r[0]) for r in self.rows())
        return "\n".join(f"{label:<{w}}  {value:<26}  {why}" for label, value, why in self.rows())


@dataclass
class Snapshot:
    device_name: str
    device_kind: str
    va_base: int
    top: int
    page_size: int
    blocks: List[Block]
    pages: bytes  # gm_page_state per page of [va_base, va_base + top)
    spare_pages: int
    cap_bytes: int
    stats: Dict[str, int]
    device_total: int = 0
    device_free: int = 0
    largest_possible: int = 0
    history: List[HistoryEntry] = field(default_factory=list)
    history_dropped: int = 0
    oom: Optional[dict] = None
    label: str = ""
    default_framework: Optional[str] = None  # who owns untagged blocks: "torch" on torch's heaps
    timeline: Optional[object] = None  # a gpumem.timeline.Timeline to show instead of the history's
    pools: List[dict] = field(default_factory=list)  # the heap's living private pools (dicts)
    # per page, native-endian uint32: the growth that mapped it (or gave it to its pool); b"": unknown
    growth: bytes = b""
    # per page, 1 where the page behind it lies in host memory (spill); b"": none
    host: bytes = b""

    # ---- construction -----------------------------------------------------------

    @classmethod
    def from_heap(cls, heap, *, with_history: bool = True, label: str = "") -> "Snapshot":
        raw = heap.snapshot()
        report = heap.memory_report(0)
        hist, dropped = heap.history() if with_history else ([], 0)
        pools = list(heap.pools())
        return cls(
            device_name=heap.device_name,
            device_kind=heap.device_kind,
            va_base=raw["va_base"],
            top=raw["top"],
            page_size=raw["page_size"],
            blocks=[Block(*b) for b in raw["blocks"]],
            pages=bytes(raw["pages"]),
            spare_pages=raw["spare_pages"],
            cap_bytes=raw["cap_bytes"],
            stats=dict(raw["stats"]),
            device_total=report["device_total"],
            device_free=report["device_free"],
            largest_possible=report["largest_possible"],
            history=[HistoryEntry(*e) for e in hist],
            history_dropped=dropped,
            oom=heap.last_oom(),
            label=label,
            default_framework=default_framework(heap),
            pools=pools,
            growth=bytes(raw.get("growth", b"")),
            host=bytes(raw.get("host", b"")),
        )

    # ---- structure ----------------------------------------------------------------

    def page_state(self, i: int) -> str:
        return PAGE_STATES[self.pages[i]]

    def location(self, addr: int, size: int) -> str:
        """ "host" when a page of [addr, addr+size) lies in host memory (spill), else "device"."""
        host = getattr(self, "host", b"")  # a snapshot pickled before spill has none
        first, last = (addr - self.va_base) // self.page_size, -(-(addr + size - self.va_base) // self.page_size)
        return "host" if any(host[first:last]) else "device"

    @property
    def segments(self) -> List[Segment]:
        """Maximal runs of mapped pages with the blocks inside them, in address order.  A paused
        pool's released pages count as part of a run: its blocks are still there."""
        segs: List[Segment] = []
        ps = self.page_size
        bi = 0
        blocks = self.blocks
        # The runs of non-zero page states are found in C: a heap of tiny pages
        # has millions of them, and a loop per page here took minutes.
        for m in _MAPPED_RUN.finditer(bytes(self.pages)):
            i, j = m.span()
            lo, hi = self.va_base + i * ps, self.va_base + j * ps
            inside = []
            while bi < len(blocks) and blocks[bi].end <= lo:
                bi += 1
            k = bi
            while k < len(blocks) and blocks[k].addr < hi:
                b = blocks[k]
                if b.addr < lo or b.end > hi or b.state == "unmapped":
                    raise ValueError(
                        f"block {b.addr:#x}+{b.size} ({b.state}) crosses the mapped run "
                        f"[{lo:#x}, {hi:#x}): the heap broke an invariant"
                    )
                inside.append(b)
                k += 1
            segs.append(Segment(lo, hi - lo, inside))
        return segs

    @property
    def summary(self) -> Summary:
        live = [b for b in self.blocks if b.state == "live"]
        pending = [b for b in self.blocks if b.state == "pending"]
        # Free blocks of a living private pool serve only that pool: kept apart.
        free = [b for b in self.blocks if b.state == "free" and b.pool is None]
        pool_free = sum(b.size for b in self.blocks if b.state == "free" and b.pool is not None)
        pool_live = sum(b.size for b in self.blocks if b.state in ("live", "pending") and b.pool is not None)
        pages = bytes(self.pages)
        counts = {state: pages.count(state.to_bytes(1, "little")) for state in (1, 2)}  # used, cached
        ps = self.page_size
        largest = run = 0
        prev_end = None
        for b in self.blocks:
            if b.state == "free" and b.pool is None:
                run = run + b.size if prev_end == b.addr else b.size
                prev_end = b.end
                largest = max(largest, run)
            else:
                prev_end = None
                run = 0
        free_mapped = sum(b.size for b in free)
        cached = counts.get(2, 0) * ps
        spare = self.spare_pages * ps
        return Summary(
            live_bytes=sum(b.size for b in live),
            requested_bytes=sum(b.requested for b in live),
            pending_bytes=sum(b.size for b in pending),
            reserved_bytes=int(
                self.stats.get("reserved_bytes.all.current", (counts.get(1, 0) + counts.get(2, 0)) * ps + spare)
            ),
            mapped_bytes=(counts.get(1, 0) + counts.get(2, 0)) * ps,
            used_page_bytes=counts.get(1, 0) * ps,
            cached_bytes=cached + spare,
            spare_bytes=spare,
            free_mapped_bytes=free_mapped,
            largest_free_range=largest,
            fragmentation=(1.0 - largest / free_mapped) if free_mapped else 0.0,
            defrag_reclaimable=cached + spare,
            stranded_bytes=free_mapped - cached,
            largest_possible=self.largest_possible,
            n_live=len(live),
            n_pending=len(pending),
            n_free=len(free),
            n_segments=len(self.segments),
            cap_bytes=self.cap_bytes,
            device_total=self.device_total,
            device_free=self.device_free,
            pool_live_bytes=pool_live,
            pool_free_bytes=pool_free,
        )

    def by_framework(self) -> Dict[str, Tuple[int, int]]:
        """{framework: (live bytes, live blocks)}, largest first: "torch", "cupy",
        "numba" on the heaps shared by frameworks; untagged blocks of another
        heap count as "untagged"."""
        own = self.default_framework or "untagged"
        return {k: (size, n) for k, size, n in self._live_by(lambda b: b.framework or own)}

    def top_sites(self, n: int = 10) -> List[Tuple[str, int, int]]:
        """(site, live bytes, blocks) of the allocation sites holding the most live memory."""
        return self._live_by(lambda b: b.site or "<no stack recorded>")[:n]

    def _live_by(self, key) -> List[Tuple[str, int, int]]:
        """(key, live bytes, live blocks) per key(block), most bytes first (first seen first on ties)."""
        by: Dict[str, List[int]] = {}
        for b in self.blocks:
            if b.state == "live":
                acc = by.setdefault(key(b), [0, 0])
                acc[0] += b.size
                acc[1] += 1
        return sorted(((k, v[0], v[1]) for k, v in by.items()), key=lambda t: -t[1])

    # ---- torch's format ---------------------------------------------------------------

    def _growth_ids(self):
        """The growth of each page (an array of ints), or None when the snapshot has none."""
        raw = getattr(self, "growth", b"")  # a snapshot pickled before growths were recorded has none
        if not raw:
            return None
        g = array("I")
        g.frombytes(raw)
        return g

    def _growth_runs(self, seg: Segment, growth) -> List[List[Block]]:
        """seg's blocks cut where the growth that mapped the pages changes -- one growth is
        what a native allocator maps with one cudaMalloc.  A live or pending block across
        such a page keeps its two growths together; a free block across one is cut there."""
        if growth is None:
            return [seg.blocks]
        ps, base = self.page_size, self.va_base
        first, last = (seg.addr - base) // ps, (seg.addr + seg.size - base) // ps
        ids = growth[first:last]
        cuts = [base + (first + i + 1) * ps for i, (a, b) in enumerate(zip(ids, ids[1:])) if a != b]
        if not cuts:
            return [seg.blocks]
        runs: List[List[Block]] = [[]]
        k = 0
        for b in seg.blocks:
            while k < len(cuts) and cuts[k] <= b.addr:
                if runs[-1]:
                    runs.append([])
                k += 1
            while k < len(cuts) and cuts[k] < b.end:
                if b.state in ("live", "pending"):  # never cut inside a block in use
                    k += 1
                    continue
                runs[-1].append(replace(b, size=cuts[k] - b.addr))  # a free block across a cut: two parts
                b = replace(b, addr=cuts[k], size=b.end - cuts[k])
                runs.append([])
                k += 1
            runs[-1].append(b)
        return [r for r in runs if r]

    def _pool_runs(self) -> List[Segment]:
        """Mapped runs cut where the growth that mapped them changes (_growth_runs), and
        where the pool or the stream of the blocks changes (torch gives every segment one
        segment_pool_id, and serves each stream from segments of its own): a free block
        stays in the run it lies in (a pool's, in a run of its pool); live or pending
        blocks make runs of their pool and stream."""
        out: List[Segment] = []
        growth = self._growth_ids()
        for blocks in (r for seg in self.segments for r in self._growth_runs(seg, growth)):
            run: List[Block] = []
            pool: Optional[Tuple[int, int]] = None
            stream: Optional[int] = None
            for b in blocks:
                active = b.state in ("live", "pending")
                p = tuple(b.pool) if b.pool is not None else (0, 0) if active else None
                # a free block joins either side: within one growth a segment is cut only
                # between blocks in use on two streams
                s = b.stream if active and b.stream != STREAM_ANY else None
                if run and (
                    (p is not None and pool is not None and p != pool) or (s is not None and stream not in (None, s))
                ):
                    out.append(Segment(run[0].addr, sum(x.size for x in run), run))
                    run, pool, stream = [], None, None
                if pool is None:
                    pool = p
                if stream is None:
                    stream = s
                run.append(b)
            if run:
                out.append(Segment(run[0].addr, sum(x.size for x in run), run))
        return out

    def to_torch(self, device: int = 0, entry_hook=None) -> dict:
        """This snapshot as torch.cuda.memory._snapshot() returns it, so that
        torch.cuda._memory_viz and the memory_viz web page read it.  Each segment
        is one run of mapped pages (torch does the same for expandable segments);
        device_traces come from the history ring, oldest first.  entry_hook, if
        given, is called as entry_hook(history_entry, trace_entry) for each trace
        entry and may change the trace entry (gpumem.torch sets its frames and
        user_metadata by what was in force when the event was recorded)."""
        segments = [self._torch_segment(seg, device) for seg in self._pool_runs()]
        traces: List[list] = [[] for _ in range(device + 1)]
        traces[device] = self._torch_trace(entry_hook)
        return {
            "segments": segments,
            "device_traces": traces,
            "allocator_settings": {
                "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                "max_split_size": -1,
                "garbage_collection_threshold": 0.0,
                # gpumem maps pages behind one reserved range, as expandable segments do
                "expandable_segments": True,
                "pinned_num_register_threads": 1,
                "release_lock_on_cudamalloc": False,
                "pinned_use_cuda_host_register": False,
                "graph_capture_record_stream_reuse": False,
                "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)},
                "allocator": "gpumem",
                "gpumem_device": self.device_name,
                "gpumem_page_size": self.page_size,
            },
            "external_annotations": [],
        }

    def _torch_segment(self, seg: Segment, device: int) -> dict:
        """One of to_torch()'s segments."""
        live_streams = Counter(b.stream for b in seg.blocks if b.state in ("live", "pending")) or Counter(
            b.stream for b in seg.blocks if b.pool is not None and b.stream != STREAM_ANY
        )
        blocks = []
        for b in seg.blocks:
            blocks.append(
                {
                    "address": b.addr,
                    "size": b.size,
                    "requested_size": b.requested,
                    "state": TORCH_STATE[b.state],
                    "frames": [f._asdict() for f in b.frames],
                }
            )
        return {
            "device": device,
            "address": seg.addr,
            "total_size": seg.size,
            "allocated_size": sum(b.size for b in seg.blocks if b.state == "live"),
            "active_size": sum(b.size for b in seg.blocks if b.state in ("live", "pending")),
            "requested_size": sum(b.requested for b in seg.blocks if b.state in ("live", "pending")),
            "stream": live_streams.most_common(1)[0][0] if live_streams else 0,
            "segment_type": "large" if seg.size > (1 << 20) else "small",
            "segment_pool_id": segment_pool_id(seg.blocks),
            "is_expandable": True,
            "frames": [],
            "blocks": blocks,
            "location": self.location(seg.addr, seg.size),
        }

    def _torch_trace(self, entry_hook=None) -> list:
        """to_torch()'s device trace: the history ring's entries torch has an action for, oldest first."""
        trace = []
        last_oom_free = (self.oom or {}).get("device_free", 0)
        for e in self.history:
            action = TORCH_ACTION.get(e.action)
            if action is None:
                continue
            entry = {
                "action": action,
                "addr": e.addr,
                "compile_context": "N/A",
                "frames": [f._asdict() for f in e.frames],
                "size": e.size,
                "stream": e.stream,
                "time_us": e.time_ns // 1000,
                "user_metadata": "",
            }
            if action == "oom":
                entry["device_free"] = last_oom_free
            if entry_hook is not None:
                entry_hook(e, entry)
            trace.append(entry)
        return trace

    def dump(self, path, device: int = 0) -> None:
        """Write to_torch() as a pickle (protocol 4; gzip'd if path ends in .gz)."""
        data = self.to_torch(device)
        path = os.fspath(path)
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "wb") as f:
            pickle.dump(data, f, protocol=4)

    # ---- pictures ------------------------------------------------------------------------

    def memory_over_time(self):
        """Live, reserved and cap over time (a gpumem.timeline.Timeline): the one
        attached to this snapshot (replay --html attaches the whole trace's), else
        the one its history gives; None when it has neither."""
        if self.timeline is not None:
            return self.timeline
        return from_snapshot(self)

    def to_svg(self, **kw) -> str:
        return render_svg(self, **kw)

    def _repr_html_(self) -> str:
        return render_fragment(self)

    def to_html(self, path=None, title: Optional[str] = None) -> str:
        """A self-contained HTML page (no network: inline SVG and CSS); written to
        `path` when given.  Returns the HTML."""
        return write_page(path, render_page(self, title=title))

    def plot(self, ax=None, max_rows: int = 32):
        """Draw the memory map with matplotlib; returns the Axes."""
        return plot_matplotlib(self, ax=ax, max_rows=max_rows)

    def __repr__(self) -> str:
        s = self.summary
        return (
            f"<gpumem.Snapshot {self.device_name}: {format_size(s.live_bytes)} live in {s.n_live} blocks, "
            f"{format_size(s.reserved_bytes)} reserved, {s.n_segments} segments, "
            f"fragmentation {s.fragmentation:.1%}>"
        )

    def __str__(self) -> str:
        return f"{self!r}\n{self.summary.text()}"


def snapshot(device=None, *, history: bool = True) -> Snapshot:
    """Take a Snapshot of a heap: a gpumem.Heap, or None / a CUDA device for the
    heap gpumem installed as torch's allocator there."""
    return Snapshot.from_heap(resolve_heap(device), with_history=history)


def dump_snapshot(path, device=None) -> None:
    """Write a torch-format snapshot pickle (protocol 4) that
    torch.cuda._memory_viz and the memory_viz web page read.  The heap may come first,
    as in snapshot(heap): dump_snapshot(heap, path)."""
    if isinstance(path, Heap) and not isinstance(device, Heap):
        path, device = device, path
    heap = resolve_heap(device)
    # A heap gpumem serves torch with is filed under its CUDA device index.
    Snapshot.from_heap(heap).dump(path, device=getattr(heap, "registry_device", None) or 0)


def memory_over_time(source=None, capacity=80 << 30, points: int = DEFAULT_POINTS) -> Timeline:
    """Memory over time of `source`: a trace (a gpumem.trace.Trace, a path, or a
    shipped trace's name like "gpt2_varlen"), replayed on a sim device of
    `capacity`; or a heap (a gpumem.Heap, or None / a CUDA device for the heap
    gpumem installed there), from its recorded history (gpumem.record_history)."""
    from .trace import Trace  # not at import: `import gpumem` needs no trace reader

    if isinstance(source, (Trace, str, os.PathLike)) and not (isinstance(source, str) and source.startswith("cuda")):
        return from_trace(source, capacity, points=points)
    if isinstance(source, Snapshot):
        tl = from_snapshot(source)
    else:
        heap = source if isinstance(source, Heap) else resolve_heap(source)
        tl = from_snapshot(Snapshot.from_heap(heap))
    if tl is None:
        raise ValueError("this heap has recorded no history: call gpumem.record_history() first")
    return tl
