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

The model runs in C (csrc/model/native_model.c); NativeAllocator drives it a
call at a time, replay_native replays a whole trace inside it.

    from gpumem.native_model import replay_native, min_capacity_native
    r = replay_native(trace, capacity=16 << 30)      # r.ooms, r.peak_reserved_bytes
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .. import _C
from ..trace import Trace

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
