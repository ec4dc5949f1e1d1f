"""Stateful property test: random operation sequences against a shadow model.

Hypothesis drives malloc/free/record_stream/empty_cache/set_cap, stream
holds, private pools (retain, release, allocations in a pool, pause and resume
with the contents of a backup checked) and stream
captures (the sim refusing every call a capture forbids) on a small sim device
(so that OOM, defragmentation and the cap all come into play), with every page
its own physical allocation or with chunks of up to 4 pages, and after every
step compares the heap with a model kept here.
"""

import re

import pytest

try:
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
except ModuleNotFoundError:  # a venv made with `pip install . pytest`; `pip install -e ".[test]"` has it
    pytest.skip("these property tests need hypothesis", allow_module_level=True)

import gpumem
from helpers import MiB, PAGE, STREAMS, pool_of

CAPACITY = 96 * MiB

# Sizes spread over small-pool, page-sized and multi-page requests.
sizes = st.one_of(
    st.integers(1, 4096),
    st.integers(4097, MiB),
    st.integers(MiB + 1, 4 * PAGE),
    st.sampled_from([PAGE, 2 * PAGE, 8 * PAGE, 512, MiB]),
    st.integers(4 * PAGE, 24 * MiB),
)


POOLS = [(1, 1), (2, 5)]


def _round(n):
    return (n + 511) // 512 * 512


def _overlap(a, n, b, m):
    return a < b + m and b < a + n


class HeapMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.h = None
        self.live = {}  # addr -> dict(size, req, stream, recorded)
        # (addr, size, stream, all_mask, own_mask): freed blocks that must not
        # come back (all_mask: held record_stream streams block every stream;
        # own_mask: the held allocation stream blocks other streams).
        self.quarantine = []
        self.held = set()
        self.cap = 0
        self.pools = {}  # living pool id -> use count
        self.gen = {pid: 0 for pid in POOLS}  # which life of each pool id
        self.kept = []  # (addr, size, pool id): freed into a living pool, only it may reuse
        self.capturing = False
        self.paused = {}  # paused pool id -> whether with a backup
        self.saved = {}  # pool id -> {page address: value written before its pause}

    @initialize(chunk_pages=st.sampled_from([1, 4]))
    def open_heap(self, chunk_pages):
        self.chunks = chunk_pages
        self.h = gpumem.Heap(device="sim", capacity=CAPACITY, chunk_pages=chunk_pages)

    def teardown(self):
        if self.h is None:
            return
        try:
            if self.capturing:
                self.h.sim_set_capture(False)
                self.h.capture_end()
            for s in STREAMS:
                self.h.sim_hold_stream(s, False)
            for p in list(self.live):
                self.h.free(p)
            self.live.clear()
            self.h.set_cap(0)
            # Paused pools last, one at a time: together they may need more than the device has.
            for pid in sorted(self.pools, key=lambda q: q in self.paused):
                if pid in self.paused:
                    self.h.pool_resume(pid)
                for _ in range(self.pools.pop(pid)):
                    self.h.pool_release(pid)
            self.h.empty_cache()
            self.h.check()
            info = self.h.sim_info()
            assert info["pages_created"] == 0 and info["pages_mapped"] == 0, info
        finally:
            self.h.close()

    # -- helpers --

    def _live_pages(self):
        """Pages nothing may take: under live blocks and memory kept for living pools, and
        every page of a physical allocation (the device's handle) one of them is in -- with
        chunk_pages > 1, and at any chunk_pages after a resume, which maps a pool's pages as
        one allocation per run."""
        blocks = [(a, b["size"]) for a, b in self.live.items()] + [(a, n) for a, n, _ in self.kept]
        pages = set()
        for a, n in blocks:
            pages.update(range(a // PAGE, (a + n - 1) // PAGE + 1))
        for q in list(pages):
            h = self.h.sim_page_at(q * PAGE)
            for step in (-1, 1):
                r = q + step
                while h and self.h.sim_page_at(r * PAGE) == h:
                    pages.add(r)
                    r += step
        return len(pages)

    def _take_kept(self, p, n, pool):
        """A block of `pool` (None: general) was handed out at [p, p+n)."""
        rest = []
        for a, m, pid in self.kept:
            if not _overlap(p, n, a, m):
                rest.append((a, m, pid))
                continue
            assert pid == pool, f"{p:#x}+{n} (pool {pool}) reuses {a:#x}+{m} kept for pool {pid}"
            if a < p:
                rest.append((a, p - a, pid))
            if p + n < a + m:
                rest.append((p + n, a + m - p - n, pid))
        self.kept = rest

    # -- rules --

    @rule(size=sizes, stream=st.sampled_from(STREAMS))
    def malloc(self, size, stream):
        self._malloc(size, stream, None)

    @precondition(lambda self: self.pools)
    @rule(size=sizes, stream=st.sampled_from(STREAMS), data=st.data())
    def malloc_in_pool(self, size, stream, data):
        pid = data.draw(st.sampled_from(sorted(self.pools)))
        if pid in self.paused:
            with pytest.raises(RuntimeError, match="GM_EPAUSED"):
                self.h.malloc(size, stream=stream, pool=pid)
            return
        self._malloc(size, stream, pid)

    def _mine(self, pid):
        return [(a, b["size"]) for a, b in self.live.items() if b["pool"] == pid and b["gen"] == self.gen[pid]]

    @precondition(lambda self: set(self.pools) - set(self.paused))
    @rule(data=st.data(), backup=st.booleans())
    def pause(self, data, backup):
        self._pause(data.draw(st.sampled_from(sorted(set(self.pools) - set(self.paused)))), backup, data)

    def _pause(self, pid, backup, data):
        """Pause pid; whether it paused."""
        taken = {a for vals in self.saved.values() for a in vals}  # one value per page
        saved = {}
        for a, n in self._mine(pid):
            for page in range(a // PAGE, (a + n - 1) // PAGE + 1):
                if page * PAGE not in taken and page * PAGE not in saved:
                    saved[page * PAGE] = data.draw(st.integers(0, 2**48))
                    self.h.sim_write(page * PAGE, saved[page * PAGE])
        before = self.h.stats()["reserved_bytes.all.current"]
        if self.capturing:
            with pytest.raises(RuntimeError, match="GM_ECAPTURING"):
                self.h.pool_pause(pid, backup=backup)
            return False
        try:
            r = self.h.pool_pause(pid, backup=backup)
        except gpumem.DeviceError as exc:  # a held stream never finishes: no device wait
            assert self.held and "would deadlock" in str(exc), str(exc)
            assert not self.h.pool_info(pid)["paused"]
            return False
        self.paused[pid] = backup
        self.saved[pid] = saved if backup else {}
        assert before - self.h.stats()["reserved_bytes.all.current"] == r["bytes"]
        for a, n in self._mine(pid):
            assert self.h.block_size(a) == n
        return True

    @precondition(lambda self: self.paused)
    @rule(data=st.data())
    def resume(self, data):
        self._resume(data.draw(st.sampled_from(sorted(self.paused))))

    @precondition(lambda self: set(self.pools) - set(self.paused) and not self.capturing and not self.held)
    @rule(data=st.data())
    def pause_and_resume_at_once(self, data):
        """A round trip with a backup while the pool's blocks are all still there."""
        pid = data.draw(st.sampled_from(sorted(set(self.pools) - set(self.paused))))
        assert self._pause(pid, True, data)
        self._resume(pid)

    def _resume(self, pid):
        if self.capturing:
            with pytest.raises(RuntimeError, match="GM_ECAPTURING"):
                self.h.pool_resume(pid)
            return
        try:
            self.h.pool_resume(pid)
        except gpumem.OutOfMemoryError:  # its memory went to others meanwhile
            assert self.h.pool_info(pid)["paused"]
            return
        del self.paused[pid]
        mine = self._mine(pid)
        for page, value in self.saved.pop(pid, {}).items():
            if any(a < page + PAGE and page < a + n for a, n in mine):
                assert self.h.sim_read(page) == value, f"page {page:#x} lost its contents over a pause"
        for a, n in mine:
            assert self.h.sim_is_accessible(a, n)

    @rule(pid=st.sampled_from(POOLS))
    def pool_retain(self, pid):
        self.h.pool_retain(pid)
        if pid not in self.pools:
            self.gen[pid] += 1
        self.pools[pid] = self.pools.get(pid, 0) + 1

    @precondition(lambda self: self.pools)
    @rule(data=st.data())
    def pool_release(self, data):
        pid = data.draw(st.sampled_from(sorted(self.pools)))
        if pid in self.paused and self.pools[pid] == 1:  # a paused pool cannot end
            with pytest.raises(RuntimeError, match="paused"):
                self.h.pool_release(pid)
            return
        self.h.pool_release(pid)
        self.pools[pid] -= 1
        if not self.pools[pid]:
            del self.pools[pid]
            self.kept = [k for k in self.kept if k[2] != pid]  # back to the general heap
            with pytest.raises(ValueError):
                self.h.pool_info(pid)

    @rule()
    def toggle_capture(self):
        if self.capturing:
            self.h.sim_set_capture(False)
            self.h.capture_end()
        else:
            self.h.capture_begin()
            self.h.sim_set_capture(True)
        self.capturing = not self.capturing

    def _malloc(self, size, stream, pool):
        reserved_before = self.h.stats()["reserved_bytes.all.current"]
        try:
            p = self.h.malloc(size, stream=stream, pool=pool)
        except gpumem.OutOfMemoryError as exc:
            assert str(exc).startswith("CUDA out of memory.")
            if not self.held and not self.quarantine and not self.capturing:
                # Defragmentation makes every page not touched by a live block
                # usable, so only a request that really cannot fit may fail.
                limit = (self.cap or CAPACITY) // PAGE
                need = -(-size // PAGE) + 1
                assert self._live_pages() + need > limit, (
                    f"OOM for {size} with {self._live_pages()} live pages of {limit}"
                )
            return
        bs = self.h.block_size(p)
        assert p % 512 == 0 and bs >= _round(size) and bs % 512 == 0
        for a, b in self.live.items():
            assert p + bs <= a or a + b["size"] <= p, f"{p:#x}+{bs} overlaps live {a:#x}+{b['size']}"
        for a, sz, s, all_mask, own_mask in self.quarantine:
            if p < a + sz and a < p + bs:
                # Held streams whose work must end first (the stream's own comes before its new work),
                # but for those the heap made it wait for on the device (a hand-off).
                must = (all_mask | (own_mask if stream != s else frozenset())) - {stream}
                must = {w for w in must if not self.h.sim_stream_waits_for(stream, w)}
                assert not must, f"{p:#x} reuses a block freed behind held streams {must}"
        assert self.h.sim_is_accessible(p, bs)
        self._take_kept(p, bs, pool)
        self.live[p] = dict(
            size=bs, req=size, stream=stream, recorded=set(), pool=pool, gen=self.gen[pool] if pool else 0
        )
        reserved = self.h.stats()["reserved_bytes.all.current"]
        if self.cap and reserved > self.cap:
            # Above the cap only because set_cap lowered it under what is in
            # use; growth must not add to that.
            assert reserved <= reserved_before, f"grew to {reserved} over cap {self.cap}"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        p = data.draw(st.sampled_from(sorted(self.live)))
        b = self.live.pop(p)
        all_mask = frozenset(s for s in b["recorded"] if s in self.held and s != b["stream"])
        own_mask = frozenset({b["stream"]} & self.held)
        self.h.free(p)
        if all_mask or own_mask:
            self.quarantine.append((p, b["size"], b["stream"], all_mask, own_mask))
        if b["pool"] in self.pools and b["gen"] == self.gen[b["pool"]]:
            self.kept.append((p, b["size"], b["pool"]))
        with pytest.raises(gpumem.InvalidPointerError):
            self.h.free(p)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), stream=st.sampled_from(STREAMS))
    def record_stream(self, data, stream):
        p = data.draw(st.sampled_from(sorted(self.live)))
        self.h.record_stream(p, stream)
        self.live[p]["recorded"].add(stream)

    def _may_refuse(self, fn, *args):
        """Unmapping waits for the whole device; the sim refuses that while a
        stream is held (it would never return).  Anything else must succeed."""
        try:
            fn(*args)
        except (ValueError, gpumem.DeviceError) as exc:
            assert self.held, f"{fn.__name__} failed with no stream held: {exc}"
            assert re.search(r"would deadlock: stream \d+ is held", str(exc)), str(exc)
            return False
        return True

    @rule()
    def empty_cache(self):
        self._may_refuse(self.h.empty_cache)
        if not self.held and not self.capturing:
            held = self._live_pages() - sum(p["paused_pages"] for p in self.h.pools())  # paused: released
            assert self.h.stats()["reserved_bytes.all.current"] == held * PAGE
            assert self.h.sim_info()["pages_created"] == held

    @rule(cap=st.sampled_from([0, 8 * MiB, 32 * MiB, 64 * MiB, CAPACITY]))
    def set_cap(self, cap):
        self._may_refuse(self.h.set_cap, cap)
        self.cap = cap
        assert self.h.get_cap() == cap

    @rule(stream=st.sampled_from(STREAMS[1:]))
    def toggle_hold(self, stream):
        if stream in self.held:
            self.h.sim_hold_stream(stream, False)
            self.held.discard(stream)
            self.quarantine = [
                (a, sz, s, all_mask - {stream}, own_mask - {stream})
                for a, sz, s, all_mask, own_mask in self.quarantine
                if (all_mask - {stream}) or (own_mask - {stream})
            ]
        else:
            self.h.sim_hold_stream(stream, True)
            self.held.add(stream)

    # -- invariants --

    @invariant()
    def consistent(self):
        if self.h is None:
            return
        self.h.check()
        stats = self.h.stats()
        assert stats["allocation.all.current"] == len(self.live)
        assert stats["allocated_bytes.all.current"] == sum(b["size"] for b in self.live.values())
        assert stats["requested_bytes.all.current"] == sum(b["req"] for b in self.live.values())
        for pool in ("small_pool", "large_pool"):
            assert stats[f"allocated_bytes.{pool}.current"] == sum(
                b["size"] for b in self.live.values() if pool_of(b["size"]) == pool
            )
        assert stats["reserved_bytes.all.current"] <= CAPACITY
        assert stats["reserved_bytes.all.current"] == self.h.sim_info()["pages_created"] * PAGE
        for p, b in self.live.items():
            assert self.h.block_size(p) == b["size"]
            paused = b["pool"] in self.paused and b["gen"] == self.gen[b["pool"]]
            assert paused or self.h.sim_is_accessible(p, b["size"])
        snap_live = {blk[0]: blk[1] for blk in self.h.snapshot()["blocks"] if blk[6] == "live"}
        assert snap_live == {p: b["size"] for p, b in self.live.items()}
        assert self.h.sim_capture_violations() == 0
        assert self.h.capturing == int(self.capturing)
        assert {p["id"]: p["use_count"] for p in self.h.pools()} == self.pools
        for pid in self.pools:
            mine = sorted(
                (a, b["size"]) for a, b in self.live.items() if b["pool"] == pid and b["gen"] == self.gen[pid]
            )
            assert self.h.pool_live(pid) == mine
        for a, n, pid in self.kept:
            assert pid in self.paused or self.h.sim_is_accessible(a, n), f"kept {a:#x}+{n} lost its pages"
        assert {p["id"] for p in self.h.pools() if p["paused"]} == set(self.paused)


# The loaded profile (tests/conftest.py) decides derandomization; at least
# 150 examples, more under CI.
HeapMachine.TestCase.settings = settings(
    max_examples=max(150, settings.default.max_examples),
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestHeapMachine = HeapMachine.TestCase
