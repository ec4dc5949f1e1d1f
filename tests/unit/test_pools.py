"""Private pools (torch's graph pools and MemPool) and the capture-safe slow path.

A block freed in a living pool is reused only by that pool; the pages under
any block of a living pool stay mapped at their address whatever the heap does
(empty_cache, a lowered cap, defragmentation); a released pool gives its free
memory back.  While a capture is under way the heap makes no call that would
invalidate it: the simulated device in capture mode refuses and counts every
such call, so these tests prove there were none (test_pools_capture.py).  A pool's free memory grows
in place (test_pools_growth.py).
"""

import random

import pytest

import gpumem
from helpers import MiB, PAGE, assert_ok

P, Q = (1, 7), (2, 0)
S1, S2 = 0x1000, 0x2000


def blocks(h):
    return [
        dict(zip(("addr", "size", "requested", "stream", "context", "seq", "state", "pool"), b))
        for b in h.snapshot()["blocks"]
    ]


def pool_blocks(h, pid):
    return [(b["addr"], b["size"], b["state"]) for b in blocks(h) if b["pool"] == pid]


def pool_memory(h, pid):
    """pool_blocks with neighbouring free blocks joined: the pool's memory, whichever
    owners its free blocks have (a synchronisation lets free neighbours merge)."""
    out = []
    for a, n, st in pool_blocks(h, pid):
        if out and st == "free" and out[-1][2] == "free" and out[-1][0] + out[-1][1] == a:
            out[-1] = (out[-1][0], out[-1][1] + n, st)
        else:
            out.append((a, n, st))
    return out


def pages_of(ranges):
    return sorted({p for a, n, *_ in ranges for p in range(a // PAGE, (a + n - 1) // PAGE + 1)})


def page_identity(h, pages):
    """{page index: id of the physical page mapped there} -- which memory lies behind each address."""
    return {p: h.sim_page_at(p * PAGE) for p in pages}


def overlaps(a, n, ranges):
    return any(a < b + m and b < a + n for b, m, *_ in ranges)


def forbidden_calls(h):
    return h.sim_capture_violations()


def _reserved(h):
    return h.stats()["reserved_bytes.all.current"]


def random_traffic(h, rng, steps, step, caps):
    """steps random steps: below 0.9, step(i, r) (it returns False when it had
    nothing to do); else, or then, empty_cache (below 0.95) or a cap from caps.
    A request the cap refuses is fine; every invariant holds after every step."""
    for i in range(steps):
        r = rng.random()
        try:
            if r >= 0.9 or step(i, r) is False:
                if r < 0.95:
                    h.empty_cache()
                else:
                    h.set_cap(rng.choice(caps))
        except gpumem.OutOfMemoryError:
            pass
        assert_ok(h)


# ---- pools keep their memory ----------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_block_freed_in_pool_never_serves_anything_else(make_heap, seed):
    rng = random.Random(seed)
    h = make_heap(capacity=96 * MiB)
    h.pool_retain(P)
    h.pool_retain(Q)
    sizes = [512, 4096, 100_000, MiB, 3 * MiB // 2, 2 * MiB, 5 * MiB]
    mine = [h.malloc(rng.choice(sizes), stream=rng.choice((0, S1, S2)), pool=P) for _ in range(24)]
    for p in mine[::2]:
        h.free(p)
    assert_ok(h)
    kept = pool_memory(h, P)
    assert any(st == "free" for _, _, st in kept), "the pool should hold free blocks"
    identity = page_identity(h, pages_of(kept))
    live, other = [], []

    def step(i, r):
        if r < 0.45:
            size = rng.choice(sizes)
            p = h.malloc(size, stream=rng.choice((0, S1, S2)))
            assert not overlaps(p, h.block_size(p), kept), f"step {i}: general block inside pool {P}"
            live.append(p)
        elif r < 0.6:
            p = h.malloc(rng.choice(sizes), stream=rng.choice((0, S1, S2)), pool=Q)
            assert not overlaps(p, h.block_size(p), kept), f"step {i}: pool {Q} got pool {P}'s block"
            other.append(p)
        elif not (live or other):
            return False
        else:
            lst = live if (live and (not other or rng.random() < 0.7)) else other
            h.free(lst.pop(rng.randrange(len(lst))))

    random_traffic(h, rng, 400, step, caps=(48 * MiB, 64 * MiB, 0))
    h.set_cap(0)
    # Nothing of the pool moved: same blocks, same pages behind them.
    assert pool_memory(h, P) == kept
    assert page_identity(h, pages_of(kept)) == identity
    assert h.stats()["num_remaps"] + h.stats()["num_unmaps"] > 0, "the workload never reclaimed a page"


def test_pool_reuses_its_own_block_per_stream_rules(make_heap):
    h = make_heap()
    h.pool_retain(P)
    a = h.malloc(3 * MiB, stream=S1, pool=P)
    h.free(a)
    assert h.malloc(3 * MiB, stream=S1, pool=P) == a  # same stream: at once
    h.free(a)
    h.sim_hold_stream(S1, True)  # S1's work still runs: S2 must not get a
    b = h.malloc(3 * MiB, stream=S2, pool=P)
    assert b != a and not overlaps(b, 3 * MiB, [(a, 3 * MiB)])
    assert h.sim_capture_violations() == 0
    h.sim_hold_stream(S1, False)
    c = h.malloc(3 * MiB, stream=S2, pool=P)  # an event on S1 completed: now S2 may
    assert c == a
    assert_ok(h)
    # A general allocation of the same size never gets the pool's memory.
    h.free(b)
    g = h.malloc(3 * MiB, stream=S2)
    assert not overlaps(g, 3 * MiB, [(b, 3 * MiB)])
    assert_ok(h)


def test_release_returns_free_blocks_and_their_pages(make_heap):
    h = make_heap()
    h.pool_retain(P)
    h.pool_retain(P)
    a = h.malloc(5 * MiB, pool=P)
    h.free(a)
    h.empty_cache()
    assert h.sim_info()["pages_created"] == 3, "a pool's free pages must survive empty_cache"
    info = h.pool_info(P)
    # the rest of page 2 is the pool's too: only unmapped space follows it
    assert (info["use_count"], info["free_bytes"], info["live_bytes"], info["pinned_pages"]) == (2, 6 * MiB, 0, 3)
    h.pool_release(P)
    assert h.pool_info(P)["use_count"] == 1
    h.empty_cache()
    assert h.sim_info()["pages_created"] == 3
    h.pool_release(P)  # the last use: the pool ends
    assert h.pools() == []
    with pytest.raises(ValueError, match="no pool"):
        h.pool_info(P)
    assert_ok(h)
    assert all(b["pool"] is None for b in blocks(h))
    g = h.malloc(5 * MiB)
    assert g == a  # the general heap has the memory back at once
    h.free(g)
    h.empty_cache()
    assert h.sim_info()["pages_created"] == 0
    assert_ok(h)


def test_ended_pool_free_block_joins_the_run_beside_it(make_heap):
    """While the pool lives, placement builds on nothing of its free block; once
    the pool ends, that block is general space and one run with its neighbours,
    so a larger request is placed over it and needs only the missing page."""
    h = make_heap()
    h.pool_retain(P)
    a = h.malloc(5 * MiB, pool=P)  # pages 0-2, the rest of page 2 the pool's too
    h.free(a)
    g = h.malloc(8 * MiB)  # the slow path: never over the pool's free block
    assert not overlaps(g, 8 * MiB, [(a, 6 * MiB)]), "placement must not build on a living pool's free block"
    assert _reserved(h) == 7 * PAGE
    assert_ok(h)
    h.free(g)
    h.empty_cache()  # g's pages go; the pool's stay
    assert _reserved(h) == 3 * PAGE
    h.pool_release(P)
    assert_ok(h)
    b = h.malloc(16 * MiB)  # slow path again: at a, pages 0-7, of which pages 3-7 are new
    assert b == a
    assert _reserved(h) == 8 * PAGE
    assert_ok(h)


def test_live_block_of_ended_pool_joins_heap_when_freed(make_heap):
    h = make_heap()
    h.pool_retain(P)
    a = h.malloc(MiB, pool=P)
    b = h.malloc(MiB, pool=P)
    h.free(b)
    h.pool_release(P)
    assert_ok(h)
    assert [blk["pool"] for blk in blocks(h) if blk["addr"] == a] == [P]  # still live, still the old pool's
    h.pool_retain(P)  # a fresh pool under the same id
    assert h.pool_info(P)["live_blocks"] == 0 and h.pool_live(P) == []
    h.free(a)
    assert_ok(h)
    assert h.pool_info(P)["free_blocks"] == 0, "the old pool's block must not land in the new pool"
    assert h.malloc(2 * MiB) == a  # general again, merged with b's memory
    h.pool_release(P)
    assert_ok(h)


def test_pinned_pages_survive_empty_cache_set_cap_and_defragmentation(make_heap):
    h = make_heap(capacity=40 * MiB, growth_slack=0.0, growth_slack_pages=0)
    h.pool_retain(P)
    ps = [h.malloc(MiB, pool=P) for k in range(6)]  # pages 0-2
    for p in ps[1::2]:
        h.free(p)
    kept = pool_blocks(h, P)
    pages = pages_of(kept)
    identity = page_identity(h, pages)
    assert all(identity.values())
    h.empty_cache()
    assert page_identity(h, pages) == identity
    h.set_cap(len(pages) * PAGE)
    assert page_identity(h, pages) == identity
    h.set_cap(0)
    # Scatter wholly free pages, then ask for a range only a remap can back.
    general = [h.malloc(PAGE) for _ in range((40 * MiB) // PAGE - len(pages) - 1)]
    for p in general[::2]:
        h.free(p)
    before = h.stats()["num_remaps"]
    big = h.malloc(4 * PAGE)
    assert h.stats()["num_remaps"] > before, "the workload did not force a defragmentation"
    assert_ok(h)
    assert pool_blocks(h, P) == kept
    assert page_identity(h, pages) == identity
    h.free(big)
    for p in general[1::2]:
        h.free(p)
    h.empty_cache()
    assert page_identity(h, pages) == identity
    assert h.sim_info()["pages_created"] == len(pages)
    h.pool_release(P)
    h.empty_cache()
    pages_left = pages_of([(a, n) for a, n, st in kept if st == "live"])
    assert h.sim_info()["pages_created"] == len(pages_left)
    assert_ok(h)


def test_stats_and_reports_count_pool_memory(make_heap):
    h = make_heap()
    h.pool_retain(P)
    a = h.malloc(3 * MiB, pool=P)
    b = h.malloc(1000, pool=P)
    h.free(a)
    st = h.stats()
    assert st["allocated_bytes.all.current"] == 1024
    assert st["active_bytes.all.current"] == 1024
    assert st["inactive_split_bytes.all.current"] >= 3 * MiB
    rep = h.memory_report(0)
    # b took the rest of page 1, which a's allocation made the pool's
    assert rep["pool_live_bytes"] == 1024 and rep["pool_free_bytes"] == 4 * MiB - 1024
    assert rep["free_mapped_bytes"] == 0, "a pool's free blocks are not free for others"
    assert rep["cached_bytes"] == 0
    snap = gpumem.Snapshot.from_heap(h)
    assert snap.summary.pool_free_bytes == 4 * MiB - 1024 and snap.summary.pool_live_bytes == 1024
    segs = snap.to_torch()["segments"]
    assert [s["segment_pool_id"] for s in segs] == [P]
    text = str(gpumem.explain(device=h))
    assert "kept for private pools" in text and "4.00 MiB" in text
    h.free(b)
    h.pool_release(P)
    assert gpumem.Snapshot.from_heap(h).to_torch()["segments"][0]["segment_pool_id"] == (0, 0)
    assert "private pools" not in str(gpumem.explain(device=h))


# ---- checkpoints: pool_live / pool_set_live -------------------------------------------------


def test_pool_live_and_set_live_round_trip(make_heap):
    h = make_heap()
    h.pool_retain(P)
    a, b, c = (h.malloc(n, pool=P) for n in (MiB, 3 * MiB, 4096))
    ckpt = h.pool_live(P)
    assert ckpt == sorted([(a, MiB), (b, 3 * MiB), (c, 4096)])
    h.free(b)
    d = h.malloc(MiB, pool=P)
    e = h.malloc(2 * MiB, pool=P)
    g = h.malloc(MiB)  # general: untouched by the pool's restore
    assert d != b or e != b
    h.pool_set_live(P, ckpt)
    assert_ok(h)
    assert h.pool_live(P) == ckpt
    assert h.block_size(b) == 3 * MiB and h.block_size(g) == MiB
    assert all(h.block_size(x) == 0 or x in (a, b, c) for x in (d, e))
    # and back: the other state again
    h.pool_set_live(P, [(a, MiB), (c, 4096)], stream=S1)
    assert h.pool_live(P) == sorted([(a, MiB), (c, 4096)])
    h.pool_set_live(P, ckpt, stream=S1)
    assert h.pool_live(P) == ckpt
    assert [blk["stream"] for blk in blocks(h) if blk["addr"] == b] == [S1]
    assert_ok(h)
    h.pool_set_live(P, [])
    assert h.pool_live(P) == [] and h.block_size(g) == MiB
    assert_ok(h)


def test_set_live_rejects_and_changes_nothing(make_heap):
    h = make_heap()
    h.pool_retain(P)
    h.pool_retain(Q)
    a = h.malloc(MiB, pool=P)
    f = h.malloc(MiB, pool=P)
    r = h.malloc(MiB, pool=P)
    h.record_stream(r, S2)  # freeing it would leave it pending, not free
    h.free(f)
    g = h.malloc(MiB)
    q = h.malloc(MiB, pool=Q)
    assert (f, r) == (a + MiB, a + 2 * MiB)
    before = h.snapshot()["blocks"]
    bad = [
        [(g, MiB)],  # a general block
        [(q, MiB)],  # another pool's block
        [(f + 100, 4096)],  # not 512-aligned
        [(a, MiB), (f, MiB + 512)],  # runs into r, which stays live or pending
        [(a, MiB), (a + 512, 512)],  # overlapping
        [(f, 0)],  # empty
        [(r, 512)],  # r would be pending, not free
        [(h.snapshot()["va_base"] + (1 << 40), 512)],  # free address space, not the pool's
    ]
    for listed in bad:
        with pytest.raises(ValueError, match="nothing was changed"):
            h.pool_set_live(P, listed)
        assert h.snapshot()["blocks"] == before, listed
    with pytest.raises(ValueError, match="no pool"):
        h.pool_set_live((9, 9), [])
    with pytest.raises(TypeError):
        h.pool_set_live(P, [a])
    assert_ok(h)
    h.pool_set_live(P, [(f, MiB)])  # the valid one: a and r go, f comes back
    assert h.pool_live(P) == [(f, MiB)]
    assert [blk["state"] for blk in blocks(h) if blk["addr"] == r] == ["pending"]
    assert_ok(h)


def test_pool_ids_are_checked(heap):
    for bad, exc in [
        ("x", TypeError),
        ((1,), ValueError),
        ((1, 2, 3), ValueError),
        ((-1, 2), ValueError),
        ((0, 0), ValueError),
        ((1, "a"), TypeError),
        (None, TypeError),
    ]:
        with pytest.raises(exc):
            heap.pool_retain(bad)
    with pytest.raises(ValueError, match="no pool"):
        heap.malloc(512, pool=P)
    with pytest.raises(ValueError, match="no pool"):
        heap.pool_release(P)
    with pytest.raises(ValueError, match="no pool"):
        heap.pool_live(P)
    with pytest.raises(ValueError, match=r"\(0, 0\)"):
        heap.malloc(512, pool=(0, 0))
    heap.pool_retain([3, 4])  # a list works like torch's tuple
    assert heap.pools()[0]["id"] == (3, 4)
    assert heap.malloc(512, pool=None) and heap.malloc(512, pool=(3, 4))
    assert_ok(heap)


# ---- no_split ----------------------------------------------------------------------------------


def test_a_no_split_pool_never_splits_a_block(make_heap):
    """torch's MemPool(no_split=True): a request takes whole pages of its own or a
    whole free block of the pool, which it then holds entirely; an ordinary pool
    beside it splits as usual."""
    h = make_heap()
    h.pool_retain(P)
    h.pool_set_no_split(P, True)
    h.pool_retain(Q)
    a = h.malloc(4 * MiB, pool=P)
    b = h.malloc(MiB, pool=P)  # a page of its own, all of it
    assert h.block_size(b) == PAGE
    assert pool_blocks(h, P) == [(a, 4 * MiB, "live"), (b, PAGE, "live")]
    h.free(a)
    c = h.malloc(512, pool=P)  # a's free block, whole
    assert c == a and h.block_size(c) == 4 * MiB
    assert [st for _, _, st in pool_blocks(h, P)] == ["live", "live"], "a block of the pool was split"
    q = h.malloc(MiB, pool=Q)
    assert h.block_size(q) == MiB and [st for _, _, st in pool_blocks(h, Q)] == ["live", "free"]
    assert h.stats()["allocated_bytes.all.current"] == 4 * MiB + PAGE + MiB
    assert_ok(h)
    for p in (b, c, q):
        h.free(p)
    h.pool_release(P)
    h.pool_release(Q)
    assert_ok(h)
    with pytest.raises(ValueError):
        h.pool_set_no_split(P, True)  # ended: no such pool


def test_a_pool_takes_no_page_of_a_physical_allocation_made_ahead_for_general_memory():
    """With room a small general growth maps eight pages as one physical allocation; a pool's request then
    takes pages of its own elsewhere, so that a segment (one growth of one pool) is never cut by another
    pool's pages, and the allocation can go back whole."""
    with gpumem.Heap(capacity=80 << 30) as h:
        a = h.malloc(MiB)  # eight pages made, one used
        assert h.stats()["reserved_bytes.all.current"] == 8 * PAGE
        h.pool_retain(P)
        pb = h.malloc(MiB, pool=P)
        assert not a <= pb < a + 8 * PAGE
        h.free(pb)
        o = h.malloc(MiB)  # general: the rest of the first page
        assert o == a + MiB
        segs = gpumem.Snapshot.from_heap(h).to_torch()["segments"]
        assert sorted(s["segment_pool_id"] for s in segs) == [(0, 0), P]
        assert_ok(h)
        h.free(a)
        h.free(o)
        h.pool_release(P)
