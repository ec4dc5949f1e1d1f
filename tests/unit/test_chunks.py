"""Chunks: physical allocations of several pages (Heap(chunk_pages=N)).

A chunk is mapped and unmapped only as a whole, on the simulated device as on
CUDA.  Growth backs a request's new pages with as few chunks as chunk_pages
allows; a chunk goes back to the device only when all its pages are free; the
free pages of a chunk that a block still uses cannot move (unless the heap
may split it, split_chunks=1: test_split.py), and an OOM report counts them.
The invariant checker (C14) runs after every step.
"""

import pytest

import gpumem
from helpers import GiB, MiB, PAGE, assert_ok, chunk_with_a_hole, drain_and_assert_empty
from gpumem.explain import last_oom

P = (3, 1)


def created(h):
    return h.sim_info()["pages_created"]


def reserved_pages(h):
    return h.stats()["reserved_bytes.all.current"] // PAGE


def delta(h, before, *ops):
    return tuple(h.sim_calls(op) - before[op] for op in ops)


def calls(h):
    return {op: h.sim_calls(op) for op in ("create", "map", "set_access", "unmap", "release")}


def assert_holds(h, pages):
    """h is sound and holds `pages` pages, each one it created on the device."""
    assert_ok(h)
    assert reserved_pages(h) == pages and created(h) == pages


# ---- growth ----------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_pages, allocations", [(1, 10), (4, 3), (10, 1), (16, 1)])
def test_growth_makes_as_few_allocations_as_chunk_pages_allows(make_heap, chunk_pages, allocations):
    h = make_heap(capacity=256 * MiB, chunk_pages=chunk_pages)
    before, st0 = calls(h), h.stats()
    p = h.malloc(10 * PAGE)
    assert delta(h, before, "create", "map") == (allocations, allocations)
    assert h.sim_calls("set_access") - before["set_access"] == 1  # one grant over the whole run
    assert h.stats()["num_device_alloc"] - st0["num_device_alloc"] == allocations
    handles = [h.sim_page_at(p + i * PAGE) for i in range(10)]
    assert len(set(handles)) == allocations and 0 not in handles
    assert_holds(h, 10)


def test_growth_reuses_free_pages_and_covers_only_the_rest(make_heap):
    # A request over 3 free mapped pages and 2 unmapped ones: one chunk of 2.
    h = make_heap(capacity=64 * MiB, chunk_pages=8)
    a = h.malloc(3 * PAGE)
    h.free(a)
    before = calls(h)
    b = h.malloc(5 * PAGE)
    assert b == a
    assert delta(h, before, "create", "map") == (1, 1)
    assert h.sim_page_at(b + 3 * PAGE) == h.sim_page_at(b + 4 * PAGE) != h.sim_page_at(b)
    assert_ok(h)


# ---- giving memory back ----------------------------------------------------------------


def test_empty_cache_releases_free_chunks_and_keeps_a_used_one(make_heap):
    h = make_heap(capacity=256 * MiB, chunk_pages=8)
    a = h.malloc(8 * PAGE)
    b = h.malloc(8 * PAGE)
    assert h.sim_page_at(a) != h.sim_page_at(b)
    h.free(a)
    h.free(b)
    x = h.malloc(MiB)  # carved from one of the free chunks
    h.empty_cache()
    # The chunk x lies in stays whole (8 pages); the other went back.
    assert_holds(h, 8)
    kept = h.sim_page_at(x)
    assert all(h.sim_page_at(x - x % (8 * PAGE) + i * PAGE) in (kept, 0) for i in range(8))
    drain_and_assert_empty(h, [x])


def test_single_pages_give_back_all_but_the_used_page(make_heap):
    h = make_heap(capacity=256 * MiB, chunk_pages=1)
    a = h.malloc(8 * PAGE)
    h.free(a)
    h.malloc(MiB)
    h.empty_cache()
    assert_holds(h, 1)


def _chunk_with_a_hole(h):
    """One 15-page chunk, its pages 0-6 and 8-14 free, a 1 MiB block at page 7."""
    a = h.malloc(15 * PAGE)
    h.free(a)
    low = h.malloc(7 * PAGE)
    x = h.malloc(MiB)
    h.free(low)
    assert low == a and x == a + 7 * PAGE
    return a, x


def test_defragmentation_moves_single_pages(make_heap):
    h = make_heap(capacity=16 * PAGE, chunk_pages=1)
    a, x = _chunk_with_a_hole(h)
    # 10 contiguous pages exist only if pages 0-6 move behind the top run.
    st0 = h.stats()
    p = h.malloc(10 * PAGE)
    assert h.stats()["num_pages_remapped"] - st0["num_pages_remapped"] >= 2
    assert p == x + PAGE  # x's page is a small page: only blocks of at most half a page share it
    assert_ok(h)


def test_oom_counts_free_pages_locked_in_a_partly_used_chunk(make_heap):
    h = make_heap(capacity=16 * PAGE, chunk_pages=16)
    a, x = _chunk_with_a_hole(h)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(10 * PAGE)
    assert_ok(h)
    info = h.last_oom()
    assert info["chunk_locked_bytes"] == 14 * PAGE
    # What could be made: the 7 free pages above x's page (the rest of that
    # page is a small page's, for blocks of at most half a page) and the
    # device's last page.
    assert info["largest_possible"] == 16 * MiB
    r = last_oom(h)
    assert r.chunk_locked_bytes == 14 * PAGE
    assert "chunks" in r.cause_kinds
    text = r.text()
    assert "partly used chunks" in text and "chunk_pages=1" in text
    # With x gone the chunk is wholly free: the same request fits.
    h.free(x)
    h.malloc(10 * PAGE)
    assert_ok(h)


def test_oom_names_a_resumed_pools_allocation_with_chunk_pages_1(make_heap):
    # A resume makes each run one allocation even at chunk_pages=1; once the
    # pool ends, a tensor left in it keeps the whole allocation.
    h = make_heap(capacity=16 * PAGE, chunk_pages=1)
    P = (3, 1)
    h.pool_retain(P)
    g = h.malloc(8 * PAGE)
    h.malloc(MiB)  # general, on the page after g: the pool's pages will serve no larger run
    h.free(g)
    a = h.malloc(8 * PAGE, pool=P)  # the pool takes g's free pages
    assert a == g
    h.pool_pause(P)
    h.pool_resume(P)
    h.free(a)
    x = h.malloc(MiB, pool=P)  # carved from the pool's free memory, inside the resumed allocation
    h.pool_release(P)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(12 * PAGE)
    assert_ok(h)
    r = last_oom(h)
    assert r.chunk_locked_bytes == 7 * PAGE
    assert "chunks" in r.cause_kinds
    assert "resumed pool" in r.text()
    h.free(x)
    h.malloc(12 * PAGE)
    assert_ok(h)


def test_oom_largest_possible_is_one_place_not_two_added(make_heap):
    # A 4-page chunk holds a block of just over half a page at each end:
    # pages 1-2 are free but locked, so the free 3 pages between the blocks
    # serve only in place.  Under a cap of 10 pages the unmapped space above
    # gets 6 new pages.  The largest block is 6 pages: the free middle and
    # the new pages are not neighbours, so they do not add up.
    h = make_heap(capacity=4 * GiB, chunk_pages=4)
    chunk_with_a_hole(h)
    h.set_cap(10 * PAGE)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(7 * PAGE)
    info = h.last_oom()
    assert info["chunk_locked_bytes"] == 2 * PAGE
    assert info["largest_possible"] == 6 * PAGE
    h.free(h.malloc(info["largest_possible"]))
    assert_ok(h)


def test_oom_largest_possible_stays_under_the_cap(make_heap):
    # A cap lowered below a chunk that a small block keeps: the chunk's free
    # pages stay mapped, but no request larger than the cap is served.
    h = make_heap(capacity=4 * GiB, chunk_pages=16)
    h.free(h.malloc(10 * PAGE))
    h.malloc(512)
    h.set_cap(4 * PAGE)
    assert reserved_pages(h) == 10
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(6 * PAGE)
    info = h.last_oom()
    assert info["largest_possible"] == 4 * PAGE
    h.free(h.malloc(info["largest_possible"]))
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(info["largest_possible"] + 512)
    assert_ok(h)


def test_no_chunk_no_locked_line(make_heap):
    h = make_heap(capacity=16 * PAGE, chunk_pages=1)
    h.malloc(15 * PAGE)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(4 * PAGE)
    assert h.last_oom()["chunk_locked_bytes"] == 0
    r = last_oom(h)
    assert "chunks" not in r.cause_kinds and "partly used chunks" not in r.text()


# ---- pause and resume -------------------------------------------------------------------


@pytest.mark.parametrize("backup", [False, True])
def test_pause_and_resume_one_allocation_per_run(make_heap, backup):
    h = make_heap(capacity=256 * MiB, chunk_pages=16)
    h.pool_retain(P)
    blk = h.malloc(6 * PAGE, pool=P)
    values = {blk + i * PAGE: 1000 + i for i in range(6)}
    for a, v in values.items():
        h.sim_write(a, v)
    free0, st0, before = h.mem_info()[0], h.stats(), calls(h)
    r = h.pool_pause(P, backup=backup)
    assert r["pages"] == 6 and r["shared_pages"] == 0
    assert delta(h, before, "unmap", "release") == (1, 1)
    assert h.mem_info()[0] - free0 == 6 * PAGE and created(h) == 0
    assert h.stats()["num_device_free"] - st0["num_device_free"] == 1
    assert_ok(h)
    before, st1 = calls(h), h.stats()
    h.pool_resume(P)
    assert delta(h, before, "create", "map", "set_access") == (1, 1, 1)
    assert h.stats()["num_device_alloc"] - st1["num_device_alloc"] == 1
    assert created(h) == 6 and h.sim_is_accessible(blk, 6 * PAGE)
    for a, v in values.items():
        got = h.sim_read(a)
        assert got == v if backup else got >> 48 == 0xF4E5
    assert_ok(h)


def test_resume_chunks_whatever_chunk_pages_says(make_heap):
    # A living pool's pages never move, so resume makes each run as few device
    # allocations as it can (at most 1024 pages each), even where growth makes
    # single pages.  The pool's memory still goes back when the pool ends.
    h = make_heap(capacity=4 * GiB, chunk_pages=1)
    h.pool_retain(P)
    a = h.malloc(6 * PAGE, pool=P)
    h.pool_pause(P)
    before = calls(h)
    h.pool_resume(P)
    assert delta(h, before, "create", "map", "set_access") == (1, 1, 1)
    assert_ok(h)
    b = h.malloc(1030 * PAGE, pool=P)  # grows as 1030 single pages (chunk_pages=1)
    h.pool_pause(P)
    before = calls(h)
    h.pool_resume(P)
    # two runs (the 6 pages, then the 1030 right after them: one run of 1036):
    # 1024 + 12 pages
    assert delta(h, before, "create", "map", "set_access") == (2, 2, 1)
    assert_ok(h)
    h.free(a)
    h.free(b)
    h.pool_release(P)
    h.empty_cache()
    assert reserved_pages(h) == 0
    assert_ok(h)


def test_pause_keeps_a_chunk_another_block_shares(make_heap):
    h = make_heap(capacity=256 * MiB, chunk_pages=16)
    g = h.malloc(4 * PAGE)  # one chunk of 4 pages
    h.free(g)
    h.pool_retain(P)
    pb = h.malloc(2 * PAGE, pool=P)  # pages 0-1 of it, the pool's alone
    o = h.malloc(MiB)  # page 2: general
    assert pb == g and o == g + 2 * PAGE
    res0 = reserved_pages(h)
    r = h.pool_pause(P)
    assert r["pages"] == 0 and r["shared_pages"] == 2
    assert reserved_pages(h) == res0 and h.sim_is_accessible(pb, 2 * PAGE)
    assert_ok(h)
    h.pool_resume(P)
    assert_ok(h)


# ---- faults -----------------------------------------------------------------------------


def test_chunk_refused_falls_back_to_single_pages(make_heap):
    h = make_heap(capacity=256 * MiB, chunk_pages=8)
    st0, before = h.stats(), calls(h)
    h.sim_fail("create", nth=1, count=1)  # the device refuses the 6-page chunk (GM_ENOMEM)
    p = h.malloc(6 * PAGE)
    h.sim_fail("create", nth=0)
    assert h.sim_calls("create") - before["create"] == 7
    assert h.stats()["num_device_alloc"] - st0["num_device_alloc"] == 6
    assert len({h.sim_page_at(p + i * PAGE) for i in range(6)}) == 6
    assert_ok(h)


def test_device_nearly_full_uses_single_pages_and_defragments(make_heap):
    # Another process leaves room for 6 pages only: the 8-page chunk is refused,
    # single pages too after 6, and the request starts over with the pages it
    # has, which suffice once cached pages move.
    h = make_heap(capacity=32 * PAGE, chunk_pages=8)
    a = h.malloc(4 * PAGE)
    b = h.malloc(MiB)
    h.free(a)
    h.sim_set_external(4242, 32 * PAGE - created(h) * PAGE - 6 * PAGE)
    p = h.malloc(8 * PAGE)
    assert h.sim_is_accessible(p, 8 * PAGE)
    assert_ok(h)
    h.free(p)
    h.free(b)
    h.sim_set_external(4242, 0)
    h.empty_cache()
    assert created(h) == 0
    assert_ok(h)


@pytest.mark.parametrize("op", ["map", "set_access"])
def test_map_or_access_failure_leaves_the_heap_sound(make_heap, op):
    h = make_heap(capacity=256 * MiB, chunk_pages=8)
    h.malloc(PAGE)
    h.sim_fail(op, nth=1, count=1)
    with pytest.raises(gpumem.DeviceError):
        h.malloc(6 * PAGE)
    h.sim_fail(op, nth=0)
    assert_ok(h)
    p = h.malloc(6 * PAGE)
    assert h.sim_is_accessible(p, 6 * PAGE)
    assert_ok(h)


def test_the_device_refuses_to_cut_a_chunk(make_heap):
    h = make_heap(capacity=256 * MiB, chunk_pages=4)
    p = h.malloc(4 * PAGE)
    for addr, size in ((p + PAGE, PAGE), (p, 2 * PAGE), (p + 2 * PAGE, 4 * PAGE)):
        with pytest.raises(ValueError, match="cuts the 4-page mapping|not mapped"):
            h.sim_unmap(addr, size)
    assert h.sim_is_accessible(p, 4 * PAGE)
    assert_ok(h)


# ---- the option --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, gpumem._C.CHUNK_PAGES_MAX + 1])
def test_chunk_pages_is_checked(bad):
    with pytest.raises(ValueError, match="chunk_pages must be in"):
        gpumem.Heap(device="sim", capacity=64 * MiB, chunk_pages=bad)


def test_torch_option_is_checked():
    from gpumem.torch._install import normalize_options, parse_conf

    assert normalize_options(parse_conf("chunk_pages:16"))["chunk_pages"] == 16
    assert normalize_options({})["chunk_pages"] is None  # the core's default
    with pytest.raises(ValueError, match="chunk_pages must be in"):
        normalize_options({"chunk_pages": 0})


# ---- resumed chunks after the pool ends, and failures around them ----------------------


def test_ended_pools_chunk_goes_only_whole_under_a_lower_cap(make_heap):
    # A resume makes one 20-page chunk; the pool ends and a small general block
    # lands in it: neither empty_cache nor a cap below it may cut the chunk.
    h = make_heap(capacity=4 * GiB, chunk_pages=1)
    h.pool_retain(P)
    a = h.malloc(20 * PAGE, pool=P)
    h.pool_pause(P)
    h.pool_resume(P)
    h.free(a)
    h.pool_release(P)
    g = h.malloc(PAGE // 2)
    assert g == a
    h.set_cap(4 * PAGE)
    h.empty_cache()
    assert_holds(h, 20)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(30 * PAGE)
    assert last_oom(h).chunk_locked_bytes == 19 * PAGE
    assert_ok(h)
    h.set_cap(0)
    y = h.malloc(30 * PAGE)
    assert h.sim_is_accessible(y, 30 * PAGE)
    drain_and_assert_empty(h, [y, g])


@pytest.mark.parametrize("op, nth", [("map", 1), ("map", 2), ("set_access", 1)])
def test_resume_failing_midway_leaves_the_pool_paused_and_sound(make_heap, op, nth):
    # 1030 pages: chunks of 1024 and 6; a failure on either returns them all.
    h = make_heap(capacity=4 * GiB, chunk_pages=1)
    h.pool_retain(P)
    a = h.malloc(1030 * PAGE, pool=P)
    h.pool_pause(P)
    h.sim_fail(op, nth=nth, count=1)
    with pytest.raises(gpumem.DeviceError):
        h.pool_resume(P)
    h.sim_fail(op, nth=0)
    assert_ok(h)
    assert h.pool_info(P)["paused"] and created(h) == 0 and reserved_pages(h) == 0
    h.pool_resume(P)
    assert h.sim_is_accessible(a, 1030 * PAGE)
    assert_ok(h)


@pytest.mark.parametrize("op", ["unmap", "release"])
def test_resume_whose_undo_fails_keeps_the_books(make_heap, op):
    # set_access fails, and giving the new chunks back fails too: what stays
    # is counted and the next resume or empty_cache finishes the work.
    h = make_heap(capacity=4 * GiB, chunk_pages=4)
    h.pool_retain(P)
    a = h.malloc(10 * PAGE, pool=P)
    h.pool_pause(P)
    h.sim_fail("set_access", nth=1, count=1)
    h.sim_fail(op, nth=1, count=100)
    with pytest.raises(gpumem.DeviceError):
        h.pool_resume(P)
    h.sim_fail("set_access", nth=0)
    h.sim_fail(op, nth=0)
    assert_ok(h)
    if h.pool_info(P)["paused"]:
        h.pool_resume(P)
    assert h.sim_is_accessible(a, 10 * PAGE)
    assert_ok(h)
    h.free(a)
    h.pool_release(P)
    h.empty_cache()
    assert_holds(h, 0)


def test_a_chunk_whose_release_fails_waits_and_goes_later(make_heap):
    h = make_heap(capacity=4 * GiB, chunk_pages=8)
    h.free(h.malloc(8 * PAGE))
    errors = h.stats()["num_device_errors"]
    h.sim_fail("release", nth=1, count=2)  # the release and its retry
    with pytest.raises(gpumem.DeviceError):
        h.empty_cache()
    h.sim_fail("release", nth=0)
    assert_holds(h, 8)  # held, unmapped, loose
    assert h.sim_info()["pages_mapped"] == 0
    assert h.stats()["num_device_errors"] == errors + 2
    h.empty_cache()
    assert_holds(h, 0)


def test_capture_map_failure_keeps_the_chunk_until_the_capture_ends(make_heap):
    h = make_heap(capacity=4 * GiB, chunk_pages=8)
    h.capture_begin()
    h.sim_fail("map", nth=1, count=1)
    with pytest.raises(gpumem.DeviceError):
        h.malloc(8 * PAGE)
    h.sim_fail("map", nth=0)
    assert_holds(h, 8)  # not released during the capture
    p = h.malloc(8 * PAGE)
    assert h.sim_is_accessible(p, 8 * PAGE)
    assert_ok(h)
    h.capture_end()
    assert h.sim_capture_violations() == 0
    drain_and_assert_empty(h, [p])


@pytest.mark.parametrize("chunk_pages", [1, 8])
def test_capture_access_failing_every_time_leaves_no_inaccessible_free_page(make_heap, chunk_pages):
    # During a capture nothing may be unmapped, so pages whose access grant
    # keeps failing are parked: held and mapped, but in unmapped space, where
    # no block can get them; they are unmapped once the capture ends.
    h = make_heap(capacity=4 * GiB, chunk_pages=chunk_pages)
    h.capture_begin()
    h.sim_fail("set_access", nth=1, count=100)
    with pytest.raises(gpumem.DeviceError):
        h.malloc(8 * PAGE)
    h.sim_fail("set_access", nth=0)
    assert_ok(h)  # no free block holds an inaccessible page
    assert reserved_pages(h) == 8  # still held: nothing may be unmapped yet
    unmaps = h.sim_calls("unmap")
    with pytest.raises(gpumem.DeviceError, match="could not be granted during a capture"):
        h.malloc(8 * PAGE)  # the same range again: refused, not mapped twice
    assert h.sim_calls("unmap") == unmaps
    h.capture_end()  # now they go
    assert h.sim_calls("unmap") > unmaps
    assert_ok(h)
    p = h.malloc(8 * PAGE)
    assert h.sim_is_accessible(p, 8 * PAGE)
    drain_and_assert_empty(h, [p])


@pytest.mark.parametrize("chunk_pages", [1, 8])
def test_pages_that_neither_grant_nor_unmap_are_parked_until_they_unmap(make_heap, chunk_pages):
    h = make_heap(capacity=4 * GiB, chunk_pages=chunk_pages)
    h.sim_fail("set_access", nth=1, count=1000)
    h.sim_fail("unmap", nth=1, count=1000)
    with pytest.raises(gpumem.DeviceError):
        h.malloc(8 * PAGE)
    assert_ok(h)  # mapped, inaccessible, and no block's
    h.sim_fail("set_access", nth=0)
    h.sim_fail("unmap", nth=0)
    h.empty_cache()
    assert_holds(h, 0)


def test_placement_that_needs_pages_only_its_own_run_holds(make_heap):
    # [block of just over half a page + 3 free pages of chunk C1 (locked)][2 unmapped][x]
    # [C3: 4 free pages][unmapped ...]
    # Under a cap equal to the 10 pages held, 5 pages fit after the first
    # block once C3 moves there (2 pages needed).  The range needing the
    # fewest new pages is in C3's run (1), whose only movable pages are its
    # own: the request must not fail for that.  At the cap, a block of whole
    # pages starts at the page boundary after the first block (touching 5
    # pages, not 6).
    h = make_heap(capacity=4 * GiB, chunk_pages=4)
    a = h.malloc(4 * PAGE)
    g = h.malloc(2 * PAGE)
    h.malloc(2 * PAGE)
    h.free(g)
    h.empty_cache()
    c = h.malloc(4 * PAGE)
    assert c == a + 8 * PAGE
    h.free(a)
    assert h.malloc(MiB + 512) == a
    h.free(c)
    assert reserved_pages(h) == 10
    h.set_cap(10 * PAGE)
    st0 = h.stats()
    p = h.malloc(5 * PAGE)
    assert p == a + PAGE
    assert h.sim_is_accessible(p, 5 * PAGE)
    assert h.stats()["num_pages_remapped"] - st0["num_pages_remapped"] == 4
    assert reserved_pages(h) <= 10
    assert_ok(h)
