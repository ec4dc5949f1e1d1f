"""A plain reference of torch's native caching allocator, block by block.

It follows c10/cuda/CUDACachingAllocator.cpp with default settings (no
expandable segments, no garbage collection threshold), written for clarity,
not speed: each pool a sorted list of (size, addr) keys.  The differential
tests in test_boundary_native.py drive it and gpumem's C model
(csrc/model/native_model.c) with the same calls and compare every answer,
counter and block.  Segments are placed as the model places them: each below
all earlier ones, with a 2 MiB gap.

Where torch assumes what only holds for a max_split_size in whole MiB (that
an oversize free block is a whole segment), the reference follows torch's
treatment of blocks it cannot release (expandable segments' blocks): the
out-of-memory path passes over free blocks that are part of a split segment.
"""

import bisect

MiB = 1 << 20
MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER = 512, MiB, 2 * MiB
LARGE_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE = 20 * MiB, 10 * MiB, 2 * MiB
UNLIMITED = 1 << 62
TOP = 1 << 56


class Block:
    __slots__ = ("addr", "size", "pool", "prev", "next", "free")

    def __init__(self, addr, size, pool):
        self.addr, self.size, self.pool = addr, size, pool
        self.prev = self.next = None
        self.free = True


class Reference:
    def __init__(self, capacity=UNLIMITED, max_split_size=None):
        self.capacity = min(capacity, UNLIMITED)
        self.max_split = max_split_size if max_split_size else UNLIMITED
        self.next_addr = TOP
        self.pools = {}  # (stream, small) -> sorted [(size, addr)]
        self.by_addr = {}  # addr -> Block, every block
        self.reserved = self.peak_reserved = self.allocated = self.peak_allocated = 0
        self.segments = self.num_device_alloc = self.num_device_free = 0
        self.num_alloc_retries = self.ooms = 0

    # ---- pools
    def _pool(self, key):
        return self.pools.setdefault(key, [])

    def _insert(self, b):
        bisect.insort(self._pool(b.pool), (b.size, b.addr))

    def _remove(self, b):
        p = self.pools[b.pool]
        del p[bisect.bisect_left(p, (b.size, b.addr))]

    # ---- segments
    def _alloc_block(self, size, pool):
        if self.reserved + size > self.capacity:
            return None
        self.next_addr -= size + ROUND_LARGE
        b = Block(self.next_addr, size, pool)
        self.by_addr[b.addr] = b
        self.reserved += size
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.segments += 1
        self.num_device_alloc += 1
        return b

    def _release_block(self, b):
        self._remove(b)
        del self.by_addr[b.addr]
        self.reserved -= b.size
        self.segments -= 1
        self.num_device_free += 1

    def _whole(self, b):
        return b.prev is None and b.next is None

    def _release_available(self, pool, rounded):
        if self.max_split == UNLIMITED:
            return False
        p = self._pool(pool)
        want = max(rounded, self.max_split)
        i = bisect.bisect_left(p, (want, -1))
        if i < len(p) and self._whole(self.by_addr[p[i][1]]):
            self._release_block(self.by_addr[p[i][1]])
            return True
        released = 0
        for size, addr in list(reversed(p[:i])):
            if released >= want or size < self.max_split:
                break
            b = self.by_addr[addr]
            if self._whole(b):
                released += size
                self._release_block(b)
        return released >= want

    def empty_cache(self):
        freed = 0
        for p in self.pools.values():
            for size, addr in list(p):
                b = self.by_addr[addr]
                if self._whole(b):
                    freed += size
                    self._release_block(b)
        return freed

    # ---- malloc and free
    @staticmethod
    def round_size(size):
        return MIN_BLOCK if size < MIN_BLOCK else -(-size // MIN_BLOCK) * MIN_BLOCK

    @staticmethod
    def segment_size(rounded):
        if rounded <= SMALL_SIZE:
            return SMALL_BUFFER
        if rounded < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return -(-rounded // ROUND_LARGE) * ROUND_LARGE

    def _get_free_block(self, pool, rounded):
        p = self._pool(pool)
        i = bisect.bisect_left(p, (rounded, -1))
        if i == len(p):
            return None
        size = p[i][0]
        if rounded < self.max_split and size >= self.max_split:
            return None
        if rounded >= self.max_split and size >= rounded + LARGE_BUFFER:
            return None
        b = self.by_addr[p[i][1]]
        self._remove(b)
        return b

    def _grow(self, pool, rounded):
        want = self.segment_size(rounded)
        b = self._alloc_block(want, pool)
        if b is None:
            self.num_alloc_retries += 1
            if self._release_available(pool, rounded):
                b = self._alloc_block(want, pool)
        if b is None:
            self.empty_cache()
            b = self._alloc_block(want, pool)
        return b

    def malloc(self, size, stream=0):
        rounded = self.round_size(size)
        small = rounded <= SMALL_SIZE
        pool = (stream, small)
        b = self._get_free_block(pool, rounded)
        if b is None:
            b = self._grow(pool, rounded)
        if b is None:
            self.ooms += 1
            return None
        remaining = b.size - rounded
        if remaining >= MIN_BLOCK if small else (rounded < self.max_split and remaining > SMALL_SIZE):
            r = Block(b.addr + rounded, remaining, pool)
            r.prev, r.next = b, b.next
            if b.next is not None:
                b.next.prev = r
            b.next, b.size = r, rounded
            self.by_addr[r.addr] = r
            self._insert(r)
        b.free = False
        self.allocated += b.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return b.addr

    def free(self, addr):
        b = self.by_addr[addr]
        assert not b.free
        self.allocated -= b.size
        b.free = True
        for nb in (b.prev, b.next):
            if nb is not None and nb.free:
                self._remove(nb)
                del self.by_addr[nb.addr]
                if nb is b.prev:
                    nb.size += b.size
                    nb.next = b.next
                    if b.next is not None:
                        b.next.prev = nb
                    del self.by_addr[b.addr]
                    b = nb
                    self.by_addr[b.addr] = b
                else:
                    b.size += nb.size
                    b.next = nb.next
                    if nb.next is not None:
                        nb.next.prev = b
        self._insert(b)

    def blocks(self):
        """Every block as NativeModel.blocks() lists it, in address order."""
        out = []
        for b in self.by_addr.values():
            if b.prev is None:
                seg, c = b.addr, b
                while c is not None:
                    out.append((seg, c.addr, c.size, c.pool[0], c.pool[1], c.free))
                    c = c.next
        return sorted(out, key=lambda t: t[1])

    COUNTERS = (
        "reserved peak_reserved allocated peak_allocated segments num_device_alloc num_device_free "
        "num_alloc_retries ooms"
    ).split()

    def counters(self):
        return {k: getattr(self, k) for k in self.COUNTERS}
