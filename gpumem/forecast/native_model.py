"""A model of PyTorch's native CUDA caching allocator, to replay traces on.

gpumem's forecasts compare gpumem with the allocator torch uses when gpumem is
not installed.  This module follows that allocator's documented behaviour with
its default settings (no PYTORCH_CUDA_ALLOC_CONF: no expandable segments, no
garbage collection threshold, no power-of-two rounding; max_split_size may be
given, as ``max_split_size_mb`` sets it):

* every request is rounded up to a multiple of 512 bytes (512 at least);
* requests of at most 1 MiB are served from the *small* pool, whose segments
  are 2 MiB; larger ones from the *large* pool, whose segments are 20 MiB for
  requests under 10 MiB and the request rounded up to 2 MiB otherwise;
* a request takes the best-fitting free block of its pool and stream (the
  smallest that is large enough, the lowest address among equals); blocks are
  never shared between streams;
* a block larger than the request is split when what remains is at least 512
  bytes (small pool) or more than 1 MiB (large pool); otherwise the request
  keeps the whole block;
* with a max_split_size, blocks of that size or more are "oversize": never
  split, never given to a request under max_split_size, and given to a larger
  request only if they exceed it by less than 20 MiB;
* a freed block merges with free neighbours of its segment; segments are kept
  (cached) until memory runs out;
* when no free block fits and a new segment would exceed the memory limit,
  cached oversize blocks are released first (only with a max_split_size: the
  first one not below the request, or else from the largest down until enough
  is freed), then every cached segment that is wholly free, trying the new
  segment again after each; if it still does not fit, the request fails
  (torch's out-of-memory).  Only a wholly free segment is ever released: with a
  max_split_size that is not a whole MiB, a free block that is part of a split
  segment can be oversize, and it is passed over there, as torch passes over
  the blocks of expandable segments.

Ties between free blocks of one size go to the lowest address, so where the
driver puts each new segment decides which of two equal blocks is reused and
which stays free (and can be released).  Replaying traces recorded on a GPU
with the addresses the driver really gave reproduces torch's choice at every
large request; the driver's addresses follow no simple rule, but placing each
new segment below all earlier ones (the newest of equal blocks is reused first)
reproduces torch's peak reserved bytes on the recorded traces where rising
addresses do not (a generation loop: 7% under with rising addresses).

The memory limit is what torch compares with the bytes its segments reserve
(segments only: the CUDA context and memory allocated outside the allocator
do not count): the device's memory, or under
torch.cuda.set_per_process_memory_fraction(f) the fraction f of the device's
total memory as cudaMemGetInfo reports it (allowed_bytes(f, total)).

The model starts with nothing cached.  Torch does not, when a trace's history
begins after blocks were live: the segments those blocks lie in keep their free
blocks (what building the model left, e.g. weights made in fp32 and then cast;
empty_cache cannot release a segment that holds a live block).  with_start(trace,
start) replays from that cache instead: `start` lists torch's segments that hold
the trace's first allocations (as recorded from torch's snapshot by
gpumem.forecast under torch's own allocator).

The model runs in C (csrc/model/native_model.c); NativeAllocator drives it a
call at a time, replay_native replays a whole trace inside it.

    from gpumem.native_model import replay_native, min_capacity_native
    r = replay_native(trace, capacity=16 << 30)      # r.ooms, r.peak_reserved_bytes
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from .. import _C
from ..trace import R_ALLOC, R_FREE, Trace

__all__ = [
    "NativeAllocator",
    "allowed_bytes",
    "NativeResult",
    "replay_native",
    "fits_native",
    "min_capacity_native",
    "Segment",
    "with_start",
    "round_size",
    "segment_size",
    "MIN_BLOCK",
    "SMALL_SIZE",
    "SMALL_BUFFER",
    "LARGE_BUFFER",
    "MIN_LARGE_ALLOC",
    "ROUND_LARGE",
]

MiB = 1 << 20
MIN_BLOCK = 512  # every block is a multiple of this
SMALL_SIZE = 1 * MiB  # largest request the small pool serves
SMALL_BUFFER = 2 * MiB  # a small-pool segment
LARGE_BUFFER = 20 * MiB  # a large-pool segment for requests under MIN_LARGE_ALLOC
MIN_LARGE_ALLOC = 10 * MiB
ROUND_LARGE = 2 * MiB  # larger requests get a segment of their size rounded to this

UNLIMITED = _C.NATIVE_UNLIMITED  # 1 << 62: no memory limit; larger limits count as this one


def allowed_bytes(fraction: float, total: int) -> int:
    """The memory limit torch sets under set_per_process_memory_fraction(fraction)
    on a device of `total` bytes (cudaMemGetInfo's total): what its segments may reserve."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be between 0 and 1, not {fraction}")
    if total <= 0:
        raise ValueError(f"total must be positive, not {total}")
    return int(fraction * float(total))


def round_size(size: int) -> int:
    """The block size the native allocator gives a request of `size` bytes."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    return -(-size // MIN_BLOCK) * MIN_BLOCK


def segment_size(rounded: int) -> int:
    """The segment the native allocator asks the device for when no cached block
    fits a request whose rounded size is `rounded`."""
    if rounded <= SMALL_SIZE:
        return SMALL_BUFFER
    if rounded < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-rounded // ROUND_LARGE) * ROUND_LARGE


class NativeAllocator(_C.NativeModel):
    """The model's state: segments, blocks, the free blocks of each pool and stream.

    NativeAllocator(capacity=UNLIMITED, max_split_size=None): malloc(size,
    stream=0) returns a block's address or None (out of memory), free(addr)
    gives it back (ValueError for an address it did not hand out),
    empty_cache() releases every wholly free segment and returns the bytes
    released (what an OOM does before its retry, and torch.cuda.empty_cache()).
    The counters are read-only attributes: reserved, peak_reserved, allocated
    (the sizes of the blocks handed out: torch's allocated_bytes),
    peak_allocated, segments, num_device_alloc, num_device_free,
    num_alloc_retries, ooms; and capacity, max_split_size as given.  blocks()
    lists every block as (segment, addr, size, stream, small, free)."""

    __slots__ = ()


@dataclass
class NativeResult:
    capacity_bytes: int
    ooms: int
    first_oom_event: int  # -1 if none
    peak_reserved_bytes: int
    peak_allocated_bytes: int  # torch's max_memory_allocated: the blocks' sizes
    segments: int  # held at the end
    num_device_alloc: int
    num_device_free: int
    num_alloc_retries: int


def replay_native(
    trace: Trace, capacity: int = UNLIMITED, stop_at_oom: bool = False, max_split_size: Optional[int] = None
) -> NativeResult:
    """Replay `trace` through the model with `capacity` bytes.  A request that
    fails counts as an OOM and its block stays unallocated (its free is skipped),
    as gpumem's replay does; `stop_at_oom` stops at the first one instead."""
    r = _C.native_replay(trace.words, capacity, stop_at_oom, max_split_size)
    return NativeResult(capacity_bytes=capacity, **r)


def fits_native(trace: Trace, capacity: int) -> bool:
    """True if `trace` replays through the model in `capacity` bytes with no OOM."""
    return replay_native(trace, capacity, stop_at_oom=True).ooms == 0


def min_capacity_native(trace: Trace) -> int:
    """The smallest memory limit (a multiple of 2 MiB, as every segment is) in
    which the model replays `trace` with no OOM.  With no limit the model never
    fails, so its peak reserved bytes bound the search from above."""
    unit = ROUND_LARGE
    hi = -(-replay_native(trace).peak_reserved_bytes // unit)
    if hi == 0:
        return 0
    lo = max(-(-trace.peak_live_bytes // unit) - 1, 0)  # below peak live nothing fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits_native(trace, mid * unit):
            hi = mid
        else:
            lo = mid
    return hi * unit


@dataclass(frozen=True)
class Segment:
    """One of torch's segments: its address, pool, stream, and its blocks in
    address order as (size, live).  The live ones are the trace's first
    allocations, in the order of the segments as given and of their blocks."""

    addr: int
    small: bool
    stream: int
    blocks: Tuple[Tuple[int, bool], ...]


def _holds(block: int, requested: int, small: bool) -> bool:
    """Whether torch hands a block of `block` bytes out whole to a request of `requested` bytes."""
    r = round_size(requested)
    return r <= block and (block - r < MIN_BLOCK if small else block - r <= SMALL_SIZE)


def _describes(seg: Segment, w, first: int) -> bool:
    """Whether `seg` is a segment torch could hold and its live blocks hold the
    trace's allocations from event `first` on, each whole and on its stream."""
    if seg.small and sum(b[0] for b in seg.blocks) != SMALL_BUFFER:
        return False
    if not seg.small and any(b[0] <= SMALL_SIZE for b in seg.blocks):
        return False
    sizes = [b[0] for b in seg.blocks if b[1]]
    for j, size in enumerate(sizes, first):
        if w[3 * j] & 0xFFFFFFFF != R_ALLOC or w[3 * j + 2] != seg.stream or not _holds(size, w[3 * j + 1], seg.small):
            return False
    return True


def _pieces(seg: Segment) -> List[Tuple[int, bool]]:
    """The blocks of a segment as requests that rebuild it: a small segment's free
    blocks cut to at most SMALL_SIZE (larger requests belong to the large pool)."""
    if not seg.small:
        return list(seg.blocks)
    out = []
    for size, live in seg.blocks:
        while not live and size > SMALL_SIZE:
            out.append((SMALL_SIZE, False))
            size -= SMALL_SIZE
        out.append((size, live))
    return out


def _rebuild(seg: Segment, live_slots: List[int], next_slot: int, words: List[int], spare: list) -> int:
    """Append the events that rebuild `seg` (its live blocks in `live_slots`, its
    free ones in slots from `next_slot` on, noted in `spare`); the next free slot."""
    if not seg.small:  # taken whole and freed: one segment of its size
        total = sum(b[0] for b in seg.blocks)
        words += [R_ALLOC | next_slot << 32, total, seg.stream, R_FREE | next_slot << 32, total, seg.stream]
    live = iter(live_slots)
    for size, is_live in _pieces(seg):
        if is_live:
            slot = next(live)
        else:
            slot, next_slot = next_slot, next_slot + 1
            spare.append((slot, size, seg.stream))
        words += [R_ALLOC | slot << 32, size, seg.stream]
    return next_slot


def with_start(trace: Trace, start: Optional[Sequence[Segment]]) -> Trace:
    """`trace` as the model replays it from torch's cache `start` (see the module):
    each segment made, from the highest address down (the model places each new
    one below the earlier ones), its blocks handed out in address order (a large
    segment is first taken whole and freed, so that it is one segment of its
    size), its free blocks freed once all are made; then the trace after its first
    allocations, which the live blocks stand for.  A segment whose live blocks do
    not hold the trace's allocations (a block that grows with the knob: the trace
    is another value's) is left out, its blocks allocated as the trace makes them;
    the trace itself where none is left.  Its replay's peak allocated bytes count
    the whole cache, held while it is rebuilt: take them from `trace`'s."""
    w = trace.words
    n_live = sum(1 for seg in start or () for b in seg.blocks if b[1])
    if not start or n_live > trace.n_events:
        return trace
    firsts, first = [], 0  # the trace's event of each segment's first live block
    for seg in start:
        firsts.append(first)
        first += sum(1 for b in seg.blocks if b[1])
    kept = [i for i, seg in enumerate(start) if _describes(seg, w, firsts[i])]
    if not kept:
        return trace
    words: List[int] = []
    spare: List[Tuple[int, int, int]] = []
    next_slot = trace.n_slots
    for i in sorted(kept, key=lambda i: -start[i].addr):
        n = sum(1 for b in start[i].blocks if b[1])
        live = [w[3 * j] >> 32 for j in range(firsts[i], firsts[i] + n)]
        next_slot = _rebuild(start[i], live, next_slot, words, spare)
    left_out = set(range(len(start))) - set(kept)
    for i in sorted(left_out):  # their live blocks as the trace allocates them
        n = sum(1 for b in start[i].blocks if b[1])
        words += w[3 * firsts[i] : 3 * (firsts[i] + n)]
    for slot, size, stream in spare:
        words += [R_FREE | slot << 32, size, stream]
    out = array("Q", words)
    out.extend(w[3 * n_live :])
    events = len(words) // 3
    frees = len(spare) + sum(1 for i in kept if not start[i].small)
    return Trace(
        trace.path,
        trace.format,
        trace.device,
        out,
        next_slot,
        trace.allocs - n_live + events - frees,
        trace.frees + frees,
        max(trace.peak_live_bytes, sum(b[0] for i in kept for b in start[i].blocks)),
        trace.peak_event + events - n_live if trace.peak_event >= 0 else -1,
        dict(trace.meta),
    )
