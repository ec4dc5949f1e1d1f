"""Private pools (torch's graph pools and MemPool) and the capture-safe slow path.

A block freed in a living pool is reused only by that pool; the pages under
any block of a living pool stay mapped at their address whatever the heap does
(empty_cache, a lowered cap, defragmentation); a released pool gives its free
memory back.  While a capture is under way the heap makes no call that would
invalidate it: the simulated device in capture mode refuses and counts every
such call, so these tests prove there were none.
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


# ---- stream capture ------------------------------------------------------------------------


def _fragmented(h):
    """A heap of 16 pages where wholly free pages are scattered and memory is
    held by other streams and pending frees: the normal slow path would
    synchronise, query events and remap."""
    pend = h.malloc(4096, stream=S1)
    s1 = h.malloc(PAGE - 4096, stream=S1)  # page 0 is full
    ps = [h.malloc(PAGE) for _ in range(13)]
    for p in ps[1::2]:
        h.free(p)  # stream 0's
    h.record_stream(pend, S2)
    h.free(pend)  # pending on an event
    h.free(s1)  # owned by S1
    assert {(b["state"], b["stream"]) for b in blocks(h) if b["state"] in ("free", "pending")} == {
        ("free", 0),
        ("free", S1),
        ("pending", S1),
    }
    return ps


def test_capture_slow_path_makes_no_forbidden_call(make_heap):
    h = make_heap(capacity=16 * PAGE, growth_slack=0.0, growth_slack_pages=0)
    ps = _fragmented(h)
    h.capture_begin()  # may still query events: the capture starts after it
    calls = {op: h.sim_calls(op) for op in ("synchronize", "event_query", "event_record", "unmap", "release")}
    h.sim_set_capture(True)
    assert h.capturing == 1
    small = h.malloc(4096)  # fast path
    grown = h.malloc(PAGE + 4096)  # growth at the end of the range
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(4 * PAGE)  # only a remap of scattered pages could make it
    assert_ok(h)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(4096, stream=S2)  # S1's and the pending memory need events; growth is capped
    h.empty_cache()  # does nothing now
    h.set_cap(8 * PAGE)  # trimming waits for the end of the capture
    h.free(small)
    assert_ok(h)
    assert forbidden_calls(h) == 0
    assert {op: h.sim_calls(op) for op in calls} == calls
    h.sim_set_capture(False)
    h.capture_end()
    assert h.capturing == 0
    h.set_cap(0)
    big = h.malloc(4 * PAGE)
    assert h.stats()["num_remaps"] > 0
    assert_ok(h)
    for p in [big, grown] + ps[0::2]:
        h.free(p)
    h.empty_cache()
    assert h.sim_info()["pages_created"] == 0
    assert_ok(h)


def test_capture_known_only_to_the_device(make_heap):
    """No capture_begin: the device says the stream is capturing."""
    h = make_heap(capacity=16 * PAGE, growth_slack=0.0, growth_slack_pages=0)
    ps = _fragmented(h)
    h.sim_set_stream_capture(S2, True)
    assert h.capturing == 0
    ok = h.malloc(PAGE, stream=S2)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(4 * PAGE, stream=S2)
    assert_ok(h)
    assert forbidden_calls(h) == 0
    h.sim_set_stream_capture(S2, False)
    big = h.malloc(4 * PAGE, stream=S2)
    assert_ok(h)
    for p in [ok, big] + ps[0::2]:
        h.free(p)
    assert_ok(h)


def test_pool_allocations_during_capture(make_heap):
    h = make_heap(capacity=16 * PAGE, growth_slack=0.0, growth_slack_pages=0)
    ps = _fragmented(h)
    h.pool_retain(P)
    h.capture_begin()
    h.sim_set_capture(True)
    got = []
    try:
        while True:
            got.append(h.malloc(MiB, pool=P))
            assert_ok(h)
    except gpumem.OutOfMemoryError:
        pass
    assert got, "growth should have served the pool during the capture"
    for p in got[::2]:
        h.free(p)  # freed during the capture: kept for the pool
    again = h.malloc(MiB, pool=P)
    assert again in got[::2]
    assert forbidden_calls(h) == 0
    assert_ok(h)
    h.sim_set_capture(False)
    h.capture_end()
    # After the capture the general heap can defragment around the pinned pages.
    kept = pool_blocks(h, P)
    ident = page_identity(h, pages_of(kept))
    for p in ps[0::2]:
        h.free(p)
    big = h.malloc(4 * PAGE)
    assert page_identity(h, pages_of(kept)) == ident
    h.free(big)
    assert_ok(h)


def test_capture_stream_reuses_what_an_idle_stream_freed_in_its_pool(make_heap):
    """Torch waits for the device before a graph's capture begins: what another
    stream freed in the pool is then the capture stream's to reuse, though no
    event may be queried during the capture."""
    h = make_heap()
    h.pool_retain(P)
    a = h.malloc(3 * MiB, stream=S1, pool=P)
    h.free(a)
    h.capture_begin()
    h.sim_set_stream_capture(S2, True)
    assert h.malloc(3 * MiB, stream=S2, pool=P) == a
    h.capture_begin()  # nested: no query may run now
    assert forbidden_calls(h) == 0
    h.capture_end()
    h.sim_set_stream_capture(S2, False)
    h.capture_end()
    assert_ok(h)


def test_capture_begin_leaves_the_general_heaps_blocks_with_their_streams(make_heap):
    """Only pools' blocks change hands at a capture's begin: a new pool takes new pages,
    as a native capture's new pool takes new segments, not a page another stream cached."""
    h = make_heap(growth_slack=0.0, growth_slack_pages=0)
    g = h.malloc(PAGE, stream=S1)
    h.free(g)  # a wholly free cached page, S1's; S1 is idle
    h.pool_retain(P)
    h.capture_begin()
    h.sim_set_stream_capture(S2, True)
    b = h.malloc(MiB, stream=S2, pool=P)
    assert not overlaps(b, MiB, [(g, PAGE)])
    assert [(x["addr"], x["stream"]) for x in blocks(h) if x["state"] == "free" and x["pool"] is None] == [(g, S1)]
    h.sim_set_stream_capture(S2, False)
    h.capture_end()
    assert_ok(h)


def test_capture_stream_never_gets_what_a_busy_stream_freed(make_heap):
    h = make_heap()
    h.pool_retain(P)
    a = h.malloc(3 * MiB, stream=S1, pool=P)
    h.free(a)
    h.sim_hold_stream(S1, True)  # S1's work still runs when the capture begins
    h.capture_begin()
    h.sim_set_stream_capture(S2, True)
    b = h.malloc(3 * MiB, stream=S2, pool=P)
    assert not overlaps(b, 3 * MiB, [(a, 3 * MiB)])
    assert forbidden_calls(h) == 0
    h.sim_set_stream_capture(S2, False)
    h.capture_end()
    h.sim_hold_stream(S1, False)
    assert_ok(h)


def test_record_stream_free_during_capture_is_deferred(make_heap):
    h = make_heap()
    p = h.malloc(MiB)
    h.record_stream(p, S1)
    q = h.malloc(MiB, stream=S2)
    rec = h.sim_calls("event_record")
    h.capture_begin()
    h.capture_begin()  # nested
    h.sim_set_capture(True)
    h.free(p)
    h.free(q)  # no other stream: free at once as usual
    assert h.sim_calls("event_record") == rec and forbidden_calls(h) == 0
    assert [b["state"] for b in blocks(h) if b["addr"] == p] == ["pending"]
    assert h.malloc(MiB, stream=S2) == q  # same-stream reuse works during the capture
    r = h.malloc(MiB)
    assert r != p, "a block freed with record_stream uses during a capture was reused"
    assert_ok(h)
    h.sim_set_capture(False)
    h.capture_end()
    assert h.sim_calls("event_record") == rec, "events recorded before the outer capture ended"
    assert [b["state"] for b in blocks(h) if b["addr"] == p] == ["pending"]
    h.capture_end()
    assert h.sim_calls("event_record") == rec + 1
    assert_ok(h)
    h.malloc(512)  # looks at pending blocks: the event has completed
    assert [b["state"] for b in blocks(h) if b["addr"] == p] == ["free"]
    assert_ok(h)
    with pytest.raises(RuntimeError, match="capture_end without capture_begin"):
        h.capture_end()


def test_sim_capture_mode_refuses_and_counts(heap):
    heap.sim_set_capture(True)
    p = heap.malloc(MiB)  # growth: create/map/set_access are allowed
    heap.free(p)
    with pytest.raises(gpumem.DeviceError, match="during stream capture"):
        heap.empty_cache()  # no capture_begin: the heap does not know, the device refuses
    assert heap.sim_capture_violations() == 1
    assert_ok(heap)
    heap.sim_set_capture(False)
    heap.empty_cache()
    assert heap.sim_info()["pages_created"] == 0
    assert_ok(heap)


def test_set_live_leaves_the_rest_of_a_free_block_with_its_owner(make_heap):
    h = make_heap()
    h.pool_retain(P)
    x = h.malloc(4 * MiB, stream=S2, pool=P)
    h.sim_hold_stream(S2, True)  # S2's kernels still run on x
    h.free(x)
    h.pool_set_live(P, [(x + MiB, MiB)], stream=S1)
    assert h.pool_live(P) == [(x + MiB, MiB)]
    owners = {(b["addr"], b["size"]): b["stream"] for b in blocks(h) if b["pool"] == P and b["state"] == "free"}
    assert owners == {(x, MiB): S2, (x + 2 * MiB, 2 * MiB): S2}
    y = h.malloc(MiB, stream=S1, pool=P)
    assert not overlaps(y, MiB, [(x, 4 * MiB)]), "S1 got memory S2 may still be using"
    assert h.sim_capture_violations() == 0
    h.sim_hold_stream(S2, False)
    assert_ok(h)


def test_capture_on_another_stream_known_from_a_deferred_free(make_heap):
    """The heap was not told; S2 captures.  A block freed there with a
    record_stream use waits, and while it does the heap knows a capture is
    under way: an allocation on stream 0 that would defragment (a device-wide
    synchronisation) grows or fails instead, and empty_cache waits."""
    h = make_heap(capacity=16 * PAGE, growth_slack=0.0, growth_slack_pages=0)
    ps = _fragmented(h)
    h.sim_set_stream_capture(S2, True)
    x = h.malloc(PAGE, stream=S2)  # growth
    h.record_stream(x, S1)
    h.free(x)  # deferred
    assert [b["state"] for b in blocks(h) if b["addr"] == x] == ["pending"]
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(4 * PAGE)  # stream 0 is not capturing, but S2 is
    h.empty_cache()
    assert_ok(h)
    assert forbidden_calls(h) == 0
    h.sim_set_stream_capture(S2, False)
    big = h.malloc(4 * PAGE)  # the deferred free gets its event, defragmentation runs
    assert h.stats()["num_remaps"] > 0
    assert_ok(h)
    for p in [big] + ps[0::2]:
        h.free(p)
    h.empty_cache()
    assert h.sim_info()["pages_created"] == 0
    assert_ok(h)


# ---- a pool's free memory grows in place ----------------------------------------------------


def _reserved(h):
    return h.stats()["reserved_bytes.all.current"]


def test_pool_request_extends_the_pools_free_block_into_unmapped_space(make_heap):
    """A pool request larger than the pool's last free block, next to unmapped
    space, is placed over that block and needs only the missing pages."""
    h = make_heap()
    h.pool_retain(P)
    a = h.malloc(4 * MiB, pool=P)  # pages 0-1, unmapped space after
    h.free(a)
    before = _reserved(h)
    b = h.malloc(10 * MiB, pool=P)
    assert b == a, "the pool's free block was not extended"
    assert _reserved(h) - before == 3 * PAGE  # pages 2-4 only
    info = h.pool_info(P)
    assert (info["live_bytes"], info["free_bytes"], info["free_blocks"]) == (10 * MiB, 0, 0)
    assert pool_blocks(h, P) == [(a, 10 * MiB, "live")]
    assert_ok(h)
    h.free(b)
    assert pool_blocks(h, P) == [(a, 10 * MiB, "free")]
    h.empty_cache()
    assert _reserved(h) == 5 * PAGE, "the extended block's pages are the pool's, kept"
    h.pool_release(P)
    assert_ok(h)


def test_pool_extension_spans_pool_general_and_unmapped_space(make_heap):
    """[pool free][general free][unmapped]: one placement over all three."""
    h = make_heap()
    h.pool_retain(P)
    w = h.malloc(2 * MiB)  # general, page 0
    s = h.malloc(2 * MiB)  # general, page 1
    h.free(w)
    a = h.malloc(MiB, pool=P)  # the pool takes w's page, all of it
    h.free(s)
    h.free(a)
    assert [(b["addr"], b["size"], b["pool"]) for b in blocks(h) if b["state"] == "free"] == [
        (a, 2 * MiB, P),
        (a + 2 * MiB, 2 * MiB, None),
    ]
    before = _reserved(h)
    b = h.malloc(7 * MiB, pool=P)
    assert b == a
    assert _reserved(h) - before == 2 * PAGE  # pages 2-3
    assert pool_blocks(h, P) == [(a, 7 * MiB, "live"), (a + 7 * MiB, MiB, "free")]  # the rest of page 3 too
    assert_ok(h)
    h.free(b)
    h.pool_release(P)
    assert_ok(h)


def test_pool_extension_keeps_to_its_pool_and_stream_rules(make_heap):
    """Another pool's free block, and a free block of the pool that the
    requesting stream may not use yet, are never extended."""
    h = make_heap()
    h.pool_retain(P)
    h.pool_retain(Q)
    q = h.malloc(4 * MiB, stream=S1, pool=Q)  # pages 0-1
    h.free(q)
    before = _reserved(h)
    x = h.malloc(10 * MiB, stream=S1, pool=P)
    assert not overlaps(x, 10 * MiB, [(q, 4 * MiB)]), "a pool request took another pool's free memory"
    assert _reserved(h) - before == 5 * PAGE
    h.free(x)  # P's, owned by S1, unmapped space beside it
    before = _reserved(h)
    z = h.malloc(12 * MiB, stream=S1, pool=P)  # S1 may use it: its block grows by one page
    assert z <= x and x + 10 * MiB <= z + 12 * MiB and _reserved(h) - before == PAGE
    h.free(z)
    h.sim_hold_stream(S1, True)  # S1's work still runs: S2 may not use z's memory
    y = h.malloc(20 * MiB, stream=S2, pool=P)
    assert not overlaps(y, 20 * MiB, [(z, 12 * MiB)])
    assert h.sim_capture_violations() == 0
    h.sim_hold_stream(S1, False)
    assert_ok(h)
    h.free(y)
    h.pool_release(P)
    h.pool_release(Q)
    assert_ok(h)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_pools_growing_among_general_traffic_keep_every_invariant(make_heap, seed):
    """Pool requests a little larger than a free block of their pool, among
    general traffic, streams, empty_cache and a cap: invariants hold after
    every step, no pool gets another's memory, and extensions do happen."""
    rng = random.Random(seed)
    h = make_heap(capacity=256 * MiB)
    pools = (P, Q)
    for pid in pools:
        h.pool_retain(pid)
    live = {P: [], Q: [], None: []}
    extended = 0

    def step(i, r):
        nonlocal extended
        if r < 0.5:
            pid = rng.choice((P, Q, None))
            frees = [(a, n) for a, n, st in pool_blocks(h, pid) if st == "free"] if pid else []
            if frees and rng.random() < 0.7:
                size = rng.choice(frees)[1] + rng.randrange(1, 3 * PAGE)
            else:
                size = rng.randrange(512, 6 * MiB)
            others = [(a, n) for q in pools if q != pid for a, n, st in pool_blocks(h, q) if st == "free"]
            p = h.malloc(size, stream=rng.choice((S1, S2)), pool=pid)
            n = h.block_size(p)
            assert not overlaps(p, n, others), f"step {i}: a block of {pid} took another pool's memory"
            extended += any(p <= a and a + m <= p + n and m < n for a, m in frees)
            live[pid].append(p)
        else:
            lst = live[rng.choice((P, Q, None))]
            if lst:
                h.free(lst.pop(rng.randrange(len(lst))))

    random_traffic(h, rng, 500, step, caps=(128 * MiB, 192 * MiB, 0))
    assert extended > 0, "no pool request extended a free block of its pool"
    for lst in live.values():
        for p in lst:
            h.free(p)
    for pid in pools:
        h.pool_release(pid)
    h.empty_cache()
    assert_ok(h)
    assert h.stats()["reserved_bytes.all.current"] == 0


def test_pool_request_prefers_the_pools_free_memory_on_a_tie(make_heap):
    """Two places need the same new pages: a short run of general memory, and
    the pool's free block before unmapped space.  The pool's request takes the
    pool's memory, which serves nothing else, and leaves the general memory."""
    h = make_heap()
    h.pool_retain(P)
    g = h.malloc(4 * MiB)  # pages 0-1
    h1 = h.malloc(4 * MiB)  # pages 2-3
    h.malloc(2 * MiB)  # page 4, stays live
    a = h.malloc(4 * MiB, pool=P)  # pages 5-6
    h.free(h1)
    h.empty_cache()  # pages 2-3 unmapped
    h.free(g)  # [0, 4) MiB general free, mapped
    h.free(a)  # the pool's, unmapped space after it
    before = _reserved(h)
    b = h.malloc(8 * MiB, pool=P)  # here or at g: two new pages either way
    assert b == a
    assert _reserved(h) - before == 2 * PAGE
    assert [(x["addr"], x["size"]) for x in blocks(h) if x["state"] == "free" and x["pool"] is None][0] == (g, 4 * MiB)
    assert_ok(h)


def test_a_general_block_never_lands_in_a_pools_last_page(make_heap):
    """The rest of the last page of a pool's new block, before unmapped space,
    becomes the pool's: a small general tensor allocated between two
    recordings goes elsewhere, and the next, larger recording extends the
    pool's free memory instead of leaving it stranded behind that tensor."""
    h = make_heap()
    h.pool_retain(P)
    h.malloc(3 * MiB)  # general, pages 0-1
    a = h.malloc(10 * PAGE - MiB, pool=P)  # [4, 23) MiB: pages 2-11, page 11 the pool's last
    assert pool_blocks(h, P) == [(a, 10 * PAGE - MiB, "live"), (a + 10 * PAGE - MiB, MiB, "free")]
    h.free(a)
    g = h.malloc(128 << 10)  # general, between recordings
    assert not (a <= g < a + 11 * PAGE)
    before = _reserved(h)
    b = h.malloc(20 * PAGE, pool=P)
    assert b == a, "the pool's free memory was left behind"
    assert _reserved(h) - before == 10 * PAGE
    assert_ok(h)
    h.free(b)
    h.pool_release(P)
    assert_ok(h)


def test_general_growth_leaves_the_space_after_a_pool_to_it(make_heap):
    """A pool whose last block ends on a page boundary: the general heap's
    next new page goes elsewhere than right after it, so the pool extends in
    place; once the pool ends, that space is everyone's again."""
    h = make_heap()
    h.pool_retain(P)
    w = h.malloc(2 * PAGE)  # general, pages 0-1 whole: no general space left on them
    a = h.malloc(10 * PAGE, pool=P)  # pages 2-11: ends at page 12's start
    h.free(a)
    g = h.malloc(128 << 10)  # needs a new page
    assert g != a + 10 * PAGE, "general growth started right after the pool"
    b = h.malloc(20 * PAGE, pool=P)
    assert b == a
    assert_ok(h)
    h.free(b)
    h.pool_release(P)
    h.free(g)
    h.free(w)
    h.empty_cache()
    assert _reserved(h) == 0
    x = h.malloc(MiB)
    assert x == w, "with no pool living, growth starts at the lowest address again"
    assert_ok(h)


def test_a_pool_grows_at_its_edge_rather_than_take_cached_pages_elsewhere(make_heap):
    """A pool's request that one new page at the pool's free edge serves, and
    cached general pages elsewhere would serve with none, still extends the
    pool's own free memory: the pool stays one region, as its later, larger
    graphs need."""
    h = make_heap()
    h.pool_retain(P)
    h.malloc(2 * PAGE)  # general, pages 0-1
    a = h.malloc(2 * PAGE, pool=P)  # pages 2-3
    top = h.malloc(PAGE, pool=P)  # page 4, the pool's edge
    g = h.malloc(2 * PAGE)  # general, away from the pool
    assert g > top + 2 * PAGE
    h.free(g)  # two cached general pages
    h.free(top)
    before = _reserved(h)
    b = h.malloc(2 * PAGE, pool=P)
    assert b == top, "the pool started a second region"
    assert _reserved(h) - before == PAGE
    assert_ok(h)
    h.free(b)
    h.free(a)
    h.pool_release(P)
    assert_ok(h)


def test_a_pool_request_never_takes_the_rest_of_a_general_page(make_heap):
    """A pool's block never shares a page with general memory, even where that
    would save a page: the pool's pages are its own while it lives, as a
    native segment is, and the page a general block holds stays general."""
    h = make_heap()
    h.pool_retain(P)
    g = h.malloc(3 * MiB)  # general, pages 0-1: 1 MiB of page 1 free
    before = _reserved(h)
    a = h.malloc(512, pool=P)
    assert a == g + 2 * PAGE, "the pool's block landed on a page general memory uses"
    assert _reserved(h) - before == PAGE
    assert pool_blocks(h, P) == [(a, 512, "live"), (a + 512, PAGE - 512, "free")]  # the rest of its page
    x = h.malloc(MiB)  # general: the rest of page 1, never the pool's page
    assert x == g + 3 * MiB
    b = h.malloc(8 * MiB, pool=P)  # neither the general page's rest: pages of its own
    assert b % PAGE == a % PAGE and not (g <= b < g + 2 * PAGE)
    assert_ok(h)
    h.free(b)
    h.free(a)
    h.pool_release(P)
    assert_ok(h)


def test_a_page_with_another_streams_free_block_is_not_the_pools(make_heap):
    """A pool takes a page whole, the rest of it included, only if the requesting
    stream may use that rest: a page where another stream's free block waits
    for that stream's work stays general, and the pool takes a page of its own."""
    h = make_heap()
    h.pool_retain(P)
    u = h.malloc(MiB, stream=S1)  # [0, 1) MiB; the rest of page 0 is S1's
    v = h.malloc(MiB, stream=S2)  # S1's rest handed over: [1, 2) MiB
    assert v == u + MiB
    h.sim_hold_stream(S2, True)
    h.free(v)  # S2's, while S2's work runs
    h.free(u)
    b = h.malloc(MiB, stream=S1, pool=P)
    assert b == u + PAGE, "the pool took a page whose rest another stream's work may still use"
    free = [(x["addr"], x["size"], x["stream"], x["pool"]) for x in blocks(h) if x["state"] == "free"]
    assert free == [(u, MiB, S1, None), (v, MiB, S2, None), (b + MiB, MiB, S1, P)]
    assert_ok(h)
    h.sim_hold_stream(S2, False)
    h.free(b)
    h.pool_release(P)
    assert_ok(h)


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
