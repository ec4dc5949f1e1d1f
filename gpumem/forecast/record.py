"""Recording a step's allocations in this process for gpumem.forecast: from a
gpumem.Heap (the simulated device in tests), from gpumem serving torch, or from
torch's own caching allocator (its memory history and snapshot)."""

from __future__ import annotations

import contextlib
import gc
import sys
import time
import zlib
from typing import List, Optional, Tuple

from .align import GPUMEM_GRANULARITY, ForecastError, Recording
from ..trace import Trace, TraceError, _Builder

_HISTORY_ENTRIES = 1 << 20
_LIVE = ("active_allocated", "active_pending_free")  # the states of a snapshot's blocks that are live


class _HeapRecorder:
    """History of a gpumem.Heap (any device; the simulated one in tests)."""

    granularity = GPUMEM_GRANULARITY

    def __init__(self, heap):
        self.heap = heap

    def sync(self) -> None:
        pass

    def drop_workspaces(self) -> None:
        pass

    def live_blocks(self) -> List[Tuple[int, int, int]]:
        """(addr, size, stream) of the blocks live before the step, in address order
        and at the blocks' sizes, as the history records them: a snapshot dumped
        after the step gives the very same ones (gpumem.trace.snapshot_trace)."""
        return [(b[0], b[1], b[3]) for b in self.heap.snapshot()["blocks"] if b[6] in ("live", "pending")]

    def before_step(self) -> Tuple[List[Tuple[int, int, int]], Optional[list]]:
        """The blocks live before the step (live_blocks), and torch's cache then: none here
        (see _TorchNativeRecorder)."""
        return self.live_blocks(), None

    def start(self) -> None:
        self.heap.history_enable(0)  # drop what the ring held
        self.heap.history_enable(_HISTORY_ENTRIES)

    def mark(self) -> int:
        """How many history events the recording holds so far."""
        return len(self.heap.history()[0])

    def stop(self) -> List[tuple]:
        """(action, addr, size, stream, site) per event; the site is the
        allocation's context (an interned Python stack with stacks on)."""
        raw, dropped = self.heap.history()
        self.heap.history_enable(0)
        if dropped:
            raise ForecastError(f"the step made more than {_HISTORY_ENTRIES} history events; record a smaller step")
        return [(e[1], e[2], e[3], e[4], e[5] if len(e) > 5 else 0) for e in raw]

    def capacity(self) -> int:
        return int(self.heap.memory_report(0)["cap_bytes"])


class _TorchGpumemRecorder(_HeapRecorder):
    """gpumem serving torch: its heap's history, synchronizing the device."""

    def __init__(self, heap, torch):
        super().__init__(heap)
        self.torch = torch

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.heap.registry_device)

    def drop_workspaces(self) -> None:
        _drop_torch_workspaces(self.torch)


class _TorchNativeRecorder:
    """torch's own caching allocator: its memory history and snapshot."""

    granularity = GPUMEM_GRANULARITY  # torch's history records its blocks' sizes too

    def __init__(self, torch, device):
        self.torch = torch
        self.device = torch.cuda.current_device() if device is None else torch.device(device).index or 0

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def drop_workspaces(self) -> None:
        _drop_torch_workspaces(self.torch)

    def _snapshot(self) -> dict:
        return self.torch.cuda.memory._snapshot()

    def before_step(self) -> Tuple[List[Tuple[int, int, int]], Optional[list]]:
        """From one snapshot of this device: (addr, size, stream) of the blocks live before the
        step, in the snapshot's order; and the segments that hold them, with their free blocks,
        in the same order: the cache the native model starts from (native_model.with_start).
        None for the cache under expandable segments, which the model does not have."""
        from .native_model import Segment

        live, start, expandable = [], [], False
        for seg in self._snapshot()["segments"]:
            if seg.get("device") != self.device:
                continue
            expandable = expandable or bool(seg.get("is_expandable"))
            addr, blocks = seg["address"], []
            for b in seg["blocks"]:
                is_live = b["state"] in _LIVE
                if is_live:
                    live.append((addr, b.get("requested_size") or b["size"], seg["stream"]))
                blocks.append((b["size"], is_live))
                addr += b["size"]
            if any(held for _, held in blocks):
                start.append(Segment(seg["address"], seg.get("segment_type") == "small", seg["stream"], tuple(blocks)))
        return live, None if expandable else start

    def live_blocks(self) -> List[Tuple[int, int, int]]:
        return self.before_step()[0]

    def native_start(self) -> Optional[list]:
        return self.before_step()[1]

    def _events(self) -> list:
        traces = self._snapshot()["device_traces"]
        return traces[self.device] if self.device < len(traces) else []

    def start(self) -> None:
        m = self.torch.cuda.memory
        m._record_memory_history(enabled=None)
        # stacks of allocations: their call sites help line the recordings up
        kw = dict(context="alloc", stacks="python", max_entries=_HISTORY_ENTRIES)
        try:
            m._record_memory_history(clear_history=True, **kw)
        except TypeError:  # a torch without clear_history: skip what the history already holds
            m._record_memory_history(**kw)
        self.skip = len(self._events())

    def mark(self) -> int:
        return len(self._events()) - self.skip

    def stop(self) -> List[tuple]:
        events = self._events()
        self.torch.cuda.memory._record_memory_history(enabled=None)
        if len(events) >= _HISTORY_ENTRIES:
            raise ForecastError(f"the step made more than {_HISTORY_ENTRIES} history events; record a smaller step")
        site = _Sites()
        out = []
        for e in events[self.skip :]:
            a = e["action"]  # only allocations have call sites (_sites)
            # an "oom" entry (a library's failed try, caught by itself: cuDNN's workspaces) has no address
            addr, size, stream = e.get("addr", 0), e.get("size", 0), e.get("stream", 0)
            out.append((a, addr, size, stream, site(e.get("frames")) if a == "alloc" else 0))
        return out

    def capacity(self) -> int:
        free, total = self.torch.cuda.mem_get_info(self.device)
        fraction = getattr(self.torch.cuda, "get_per_process_memory_fraction", None)
        return int(total * (fraction(self.device) if fraction else 1.0))


def _drop_torch_workspaces(torch) -> None:
    """Free the cuBLAS workspaces torch keeps once a matrix product has run, so
    that the next step allocates them again where the first step of a fresh run
    does: in the middle of it, in whatever free block then fits best.  Made
    before the step instead, they would sit where no fresh run puts them."""
    clear = getattr(getattr(torch, "_C", None), "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _recorder(heap, device):
    from .._C import Heap

    if heap is not None:
        if not isinstance(heap, Heap):
            raise TypeError(f"heap must be a gpumem.Heap, not {type(heap).__name__}")
        return _HeapRecorder(heap)
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        raise ForecastError(
            "no torch with CUDA in this process: pass heap=gpumem.Heap(...) for a step that drives a gpumem heap, "
            "or forecast from recorded traces (Forecast.from_traces, python -m gpumem forecast)"
        )
    from .._which_heap import resolve_heap, torch_active

    if torch_active():
        return _TorchGpumemRecorder(resolve_heap(device), torch)
    return _TorchNativeRecorder(torch, device)


def _record(rec, step, k: int, name: str, warmup: int, steps: int, reset) -> Recording:
    """Warm up, then record `steps` steps at knob value k."""
    t0 = time.perf_counter()
    for _ in range(warmup):
        step(k)
    if reset is not None:
        reset()
    rec.drop_workspaces()
    rec.sync()
    live, start = rec.before_step()
    rec.start()
    marks = []
    try:
        for i in range(steps):
            if i:
                rec.sync()
                marks.append(rec.mark())
            step(k)
        rec.sync()
    finally:
        with _no_gc():
            events = rec.stop()
    with _no_gc():
        trace = _to_trace(f"{name}={k}", live, events, rec.granularity)
        sites = _sites(live, events)
    r = Recording(k, trace, rec.granularity, time.perf_counter() - t0, sites, native_start=start)
    r.step_starts = [len(live)] + _step_starts(live, events, marks)
    return r


_RECORD_FILE = _record.__code__.co_filename


@contextlib.contextmanager
def _no_gc():
    """The cyclic garbage collector off while a history's events are turned
    into tuples: hundreds of thousands of objects without cycles, which it
    would otherwise walk again and again (half the time of a 141K-event stop)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _site(frames) -> int:
    """A call site as a number, the same in every recording of this process
    and others (0: none known): a checksum of the files and lines of the
    stack (innermost first) up to the step's call from _record.  The frames
    from there out are the forecast's own and its caller's: they differ between
    recordings made at different points of the forecast, the step's do not."""
    parts = []
    for f in frames or ():
        if not isinstance(f, dict):
            continue
        if f.get("name") == "_record" and f.get("filename") == _RECORD_FILE:
            break
        parts.append(f"{f.get('filename', '')}:{f.get('line', 0)}")
    text = "|".join(parts)
    return zlib.crc32(text.encode()) | 1 if text else 0


class _Sites:
    """_site for the events of one snapshot, each stack worked out once:
    torch's snapshot makes one dict per distinct frame and shares it between
    the events' frame lists, so a stack is known by its frames' identities
    (valid while the snapshot, which holds them all, is alive)."""

    def __init__(self):
        self.known = {}

    def __call__(self, frames) -> int:
        if not frames:
            return 0
        key = tuple(map(id, frames))
        got = self.known.get(key)
        if got is None:
            got = self.known[key] = _site(frames)
        return got


def _sites(live, events) -> Optional[List[int]]:
    """Per trace event (as _to_trace makes them) its allocation's call site;
    None when no allocation has one."""
    out = [0] * len(live)
    for e in events:
        if e[0] == "alloc":
            out.append(e[4] if len(e) > 4 else 0)
        elif e[0] == "free_completed":
            out.append(0)
    return out if any(out) else None


def _step_starts(live, events, marks) -> List[int]:
    """The trace event (as _to_trace makes them) at which each recorded step
    begins, from the history's length at each step's start (`marks`)."""
    out = []
    n, seen = len(live), 0
    for m in marks:
        for e in events[seen:m]:
            if e[0] in ("alloc", "free_completed"):
                n += 1
        seen = max(seen, m)
        out.append(n)
    return out


def _to_trace(name: str, live, events, granularity: int) -> Trace:
    """The blocks live before the step as allocations made first, then the step's events."""
    b = _Builder(name)
    for i, (addr, size, stream) in enumerate(live):
        b.alloc(addr, size, stream, f"live block {i}")
    try:
        for i, e in enumerate(events):
            action, addr, size, stream = e[:4]
            if action == "alloc":
                b.alloc(addr, size, stream, i)
            elif action == "free_completed":
                b.free(addr, stream, i)
    except TraceError as e:
        raise ForecastError(f"the recorded history is inconsistent: {e.reason}") from None
    return b.finish("recorded", 0, {"size_granularity": granularity})
