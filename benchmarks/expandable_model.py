"""A model of torch's CUDA caching allocator with expandable segments
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True), to replay a trace and give its peak reserved
memory with no cap -- the figure that gpumem's room policy is held to.

    python3 benchmarks/expandable_model.py TRACE [TRACE ...]     (shipped names or paths)

The rules modelled (torch 2.5-2.11, default settings, no cap, no empty_cache):
  - a request is rounded up to 512 bytes; at most 1 MiB goes to the small pool, larger to the large;
  - each (stream, pool) grows one segment of its own, mapped in pages of 2 MiB (small pool) or
    20 MiB (large pool) and never unmapped without empty_cache or an out-of-memory;
  - a request takes the best fit among that stream's free mapped blocks of its pool (smallest, then
    lowest address), except that the free block at the segment's mapped end is passed over for the
    next fitting one when there is one (it counts as growable without end);
  - with none, the segment grows: the free block at its end (if any) is extended by as many pages as
    the request lacks;
  - the request takes the front of the block; the rest stays mapped and free; a freed block merges
    with free neighbours.
Reserved memory never falls under these rules, so the peak is what is mapped at the end.  Frees of a
trace are replayed at its free_completed events, as gpumem's replay does.
"""

import argparse
import bisect
import os
import sys

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
PAGE_SMALL, PAGE_LARGE = 2 << 20, 20 << 20


class _Block:
    __slots__ = ("addr", "size", "used", "prev", "next", "seg")

    def __init__(self, addr, size, seg, prev=None, nxt=None):
        self.addr, self.size, self.seg, self.prev, self.next, self.used = addr, size, seg, prev, nxt, False


class _Segment:
    """One (stream, pool)'s segment: its free mapped blocks by (size, address), and its mapped end."""

    __slots__ = ("base", "mapped", "last", "page", "free")

    def __init__(self, base, page):
        self.base, self.page, self.mapped, self.last, self.free = base, page, 0, None, []

    def take(self, b):
        i = bisect.bisect_left(self.free, (b.size, b.addr))
        assert self.free[i][2] is b
        del self.free[i]

    def put(self, b):
        bisect.insort(self.free, (b.size, b.addr, b))


class ExpandableSegments:
    def __init__(self):
        self.segs = {}
        self.reserved = self.peak = self.maps = 0
        self._base = 1 << 40

    def malloc(self, size, stream):
        """A block for `size` bytes on `stream`; None for 0 bytes."""
        if size <= 0:
            return None
        size = -(-size // MIN_BLOCK) * MIN_BLOCK
        small = size <= SMALL_SIZE
        seg = self.segs.get((stream, small))
        if seg is None:
            seg = self.segs[(stream, small)] = _Segment(self._base, PAGE_SMALL if small else PAGE_LARGE)
            self._base += 1 << 44
        fs = seg.free
        i = bisect.bisect_left(fs, (size, -1))
        if i < len(fs):
            if fs[i][2] is seg.last and i + 1 < len(fs):
                i += 1
            b = fs.pop(i)[2]
        else:
            b = self._grow(seg, size)
        if b.size > size:
            r = _Block(b.addr + size, b.size - size, seg, prev=b, nxt=b.next)
            if b.next is not None:
                b.next.prev = r
            b.next = r
            if seg.last is b:
                seg.last = r
            b.size = size
            seg.put(r)
        b.used = True
        return b

    def _grow(self, seg, size):
        p = seg.last if seg.last is not None and not seg.last.used else None
        m = -(-(size - (p.size if p else 0)) // seg.page) * seg.page
        self.reserved += m
        self.peak = max(self.peak, self.reserved)
        self.maps += 1
        if p is not None:
            seg.take(p)
            p.size += m
        else:
            p = _Block(seg.base + seg.mapped, m, seg, prev=seg.last)
            if seg.last is not None:
                seg.last.next = p
            seg.last = p
        seg.mapped += m
        return p

    def free(self, b):
        seg = b.seg
        b.used = False
        p = b.prev
        if p is not None and not p.used:
            seg.take(p)
            self._absorb(p, b)
            b = p
        n = b.next
        if n is not None and not n.used:
            seg.take(n)
            self._absorb(b, n)
        seg.put(b)

    @staticmethod
    def _absorb(a, b):
        """b, the free block right after a, becomes part of a."""
        a.size += b.size
        a.next = b.next
        if b.next is not None:
            b.next.prev = a
        if a.seg.last is b:
            a.seg.last = a


def replay(trace):
    """Peak reserved bytes of `trace` (gpumem.trace.Trace) under the model, and its pages mapped."""
    m = ExpandableSegments()
    w = trace.words
    blocks = [None] * (trace.n_slots + 1)
    for i in range(0, len(w), 3):
        op, slot = w[i] & 0xFFFFFFFF, w[i] >> 32
        if op == 0:
            blocks[slot] = m.malloc(w[i + 1], w[i + 2])
        elif blocks[slot] is not None:
            m.free(blocks[slot])
            blocks[slot] = None
    return dict(peak_reserved=m.peak, maps=m.maps)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="shipped trace names or trace files")
    a = ap.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(here))
    from gpumem.trace import load_trace

    for t in a.traces:
        tr = load_trace(t)
        r = replay(tr)
        ratio = r["peak_reserved"] / tr.peak_live_bytes
        print(f"{tr.name}: peak reserved {r['peak_reserved']} bytes, {ratio:.4f} x peak live")


if __name__ == "__main__":
    main()
