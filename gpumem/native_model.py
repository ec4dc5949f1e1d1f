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
  cached oversize segments are released first (largest first, until enough is
  freed; only with a max_split_size), then every cached segment that is wholly
  free, trying the new segment again after each; if it still does not fit, the
  request fails (torch's out-of-memory).

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

    from gpumem.native_model import replay_native, min_capacity_native
    r = replay_native(trace, capacity=16 << 30)      # r.ooms, r.peak_reserved_bytes
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from .trace import R_ALLOC, Trace

__all__ = [
    "NativeAllocator",
    "allowed_bytes",
    "NativeResult",
    "replay_native",
    "fits_native",
    "min_capacity_native",
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

UNLIMITED = 1 << 62
_TOP = 1 << 56  # segments are placed downwards from here


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


class _Block:
    __slots__ = ("addr", "size", "small", "stream", "free", "prev", "next")

    def __init__(self, addr: int, size: int, small: bool, stream: int):
        self.addr = addr
        self.size = size
        self.small = small
        self.stream = stream
        self.free = True
        self.prev: Optional[_Block] = None
        self.next: Optional[_Block] = None


class NativeAllocator:
    """The model's state: segments, blocks, the free blocks of each pool and stream."""

    def __init__(self, capacity: int = UNLIMITED, max_split_size: Optional[int] = None):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, not {capacity}")
        if max_split_size is not None and max_split_size <= LARGE_BUFFER:
            # torch refuses max_split_size_mb of 20 or less
            raise ValueError(f"max_split_size must be more than 20 MiB, not {max_split_size}")
        self.capacity = capacity
        self.max_split = UNLIMITED if max_split_size is None else max_split_size
        # (small?, stream) -> sorted [(size, addr)] of free blocks
        self.pools: Dict[Tuple[bool, int], List[Tuple[int, int]]] = {}
        self.blocks: Dict[int, _Block] = {}  # addr -> block (free or not)
        self.next_addr = _TOP
        self.reserved = 0
        self.peak_reserved = 0
        self.allocated = 0  # sum of the sizes of blocks handed out (torch's allocated_bytes)
        self.peak_allocated = 0
        self.segments = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        self.num_alloc_retries = 0
        self.ooms = 0

    # ---- pools -----------------------------------------------------------------------

    def _pool(self, small: bool, stream: int) -> List[Tuple[int, int]]:
        key = (small, stream)
        pool = self.pools.get(key)
        if pool is None:
            pool = self.pools[key] = []
        return pool

    def _insert(self, b: _Block) -> None:
        insort(self._pool(b.small, b.stream), (b.size, b.addr))

    def _remove(self, b: _Block) -> None:
        pool = self.pools[(b.small, b.stream)]
        i = bisect_left(pool, (b.size, b.addr))
        del pool[i]

    # ---- device ----------------------------------------------------------------------

    def _new_segment(self, size: int, small: bool, stream: int) -> Optional[_Block]:
        if self.reserved + size > self.capacity:
            return None
        self.next_addr -= size + ROUND_LARGE  # below every other segment, with a gap: segments never touch
        b = _Block(self.next_addr, size, small, stream)
        self.blocks[b.addr] = b
        self.reserved += size
        self.segments += 1
        self.num_device_alloc += 1
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        return b

    def empty_cache(self) -> int:
        """Release every wholly free segment (what an OOM does before its retry,
        and torch.cuda.empty_cache()); returns the bytes released."""
        released = 0
        for pool in self.pools.values():
            keep = []
            for size, addr in pool:
                b = self.blocks[addr]
                if b.prev is None and b.next is None:
                    del self.blocks[addr]
                    released += size
                    self.segments -= 1
                    self.num_device_free += 1
                else:
                    keep.append((size, addr))
            pool[:] = keep
        self.reserved -= released
        return released

    # ---- malloc / free ---------------------------------------------------------------

    def malloc(self, size: int, stream: int = 0) -> Optional[int]:
        """The address of a block for `size` bytes on `stream`, or None (out of memory)."""
        rounded = round_size(size)
        small = rounded <= SMALL_SIZE
        b = self._free_block(rounded, small, stream)
        if b is None:
            want = segment_size(rounded)
            b = self._new_segment(want, small, stream)
            if b is None:
                self.num_alloc_retries += 1
                if self._release_oversize(rounded, small, stream):
                    b = self._new_segment(want, small, stream)
                if b is None:
                    self.empty_cache()
                    b = self._new_segment(want, small, stream)
                if b is None:
                    self.ooms += 1
                    return None
        remaining = b.size - rounded
        if small:
            split = remaining >= MIN_BLOCK
        else:
            split = rounded < self.max_split and remaining > SMALL_SIZE
        if split:
            rest = _Block(b.addr + rounded, remaining, small, stream)
            rest.prev = b
            rest.next = b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = rounded
            self.blocks[rest.addr] = rest
            self._insert(rest)
        b.free = False
        self.allocated += b.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return b.addr

    def _free_block(self, rounded: int, small: bool, stream: int) -> Optional[_Block]:
        """Take the best-fitting cached block, if one may serve the request."""
        pool = self._pool(small, stream)
        i = bisect_left(pool, (rounded, -1))
        if i == len(pool):
            return None
        size, addr = pool[i]
        if rounded < self.max_split and size >= self.max_split:
            return None  # an oversize block is not given to a smaller request
        if rounded >= self.max_split and size >= rounded + LARGE_BUFFER:
            return None  # nor to a larger one it exceeds by 20 MiB or more
        del pool[i]
        return self.blocks[addr]

    def _release_oversize(self, rounded: int, small: bool, stream: int) -> bool:
        """With a max_split_size: release a cached oversize segment large enough
        for the request, or else oversize ones from the largest down until as
        many bytes are freed; False if that cannot free enough."""
        if self.max_split == UNLIMITED:
            return False
        pool = self._pool(small, stream)
        want = max(rounded, self.max_split)
        i = bisect_left(pool, (want, -1))
        if i < len(pool):
            victims = [i]  # oversize: never split, so a whole segment
        else:
            victims, total, j = [], 0, len(pool) - 1
            while total < want and j >= 0 and pool[j][0] >= self.max_split:
                victims.append(j)
                total += pool[j][0]
                j -= 1
            if total < want:
                return False
        for j in victims:  # descending indices: deleting keeps the others valid
            size, addr = pool.pop(j)
            del self.blocks[addr]
            self.reserved -= size
            self.segments -= 1
            self.num_device_free += 1
        return True

    def free(self, addr: int) -> None:
        b = self.blocks.get(addr)
        if b is None or b.free:
            raise ValueError(f"free of an address the model did not hand out: {addr:#x}")
        self.allocated -= b.size
        b.free = True
        p = b.prev
        if p is not None and p.free:
            self._remove(p)
            self._join(p, b)
            b = p
        n = b.next
        if n is not None and n.free:
            self._remove(n)
            self._join(b, n)
        self._insert(b)

    def _join(self, left: _Block, right: _Block) -> None:
        """Merge `right` into its neighbour `left`; `right` leaves the block map."""
        del self.blocks[right.addr]
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left


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
    a = NativeAllocator(capacity, max_split_size)
    slots: Dict[int, int] = {}
    w = trace.words
    first_oom = -1
    for i in range(0, len(w), 3):
        head = w[i]
        op = head & 0xFFFFFFFF
        slot = head >> 32
        if op == R_ALLOC:
            addr = a.malloc(w[i + 1], w[i + 2])
            if addr is None:
                if first_oom < 0:
                    first_oom = i // 3
                if stop_at_oom:
                    break
                continue
            slots[slot] = addr
        else:
            addr = slots.pop(slot, None)
            if addr is not None:
                a.free(addr)
    return NativeResult(
        capacity_bytes=capacity,
        ooms=a.ooms,
        first_oom_event=first_oom,
        peak_reserved_bytes=a.peak_reserved,
        peak_allocated_bytes=a.peak_allocated,
        segments=a.segments,
        num_device_alloc=a.num_device_alloc,
        num_device_free=a.num_device_free,
        num_alloc_retries=a.num_alloc_retries,
    )


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
