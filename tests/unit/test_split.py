"""Splitting a chunk whose free pages are locked (Heap(split_chunks=1), csrc/core/split.c).

A chunk of several pages goes back to the device only whole.  With
split_chunks=1, when defragmentation lacks pages after the movable ones, the
slow path splits a chunk that blocks still use: the pages they keep are copied
to single pages behind one device wait, the chunk is released, the singles
take their places behind the same addresses, and the free pages go to the
request.  Off by default (it moves live data).  On the simulated device each
page holds one value (sim_write / sim_read), so the tests see that nothing
kept is lost, whatever device call fails.
"""

import pytest

import gpumem
from helpers import GiB, MiB, PAGE, assert_ok, assert_switch_option, chunk_with_a_hole


def reserved_pages(h):
    return h.stats()["reserved_bytes.all.current"] // PAGE


def hole(h):
    """chunk_with_a_hole, the kept pages 0 and 3 holding 10 and 13.  Returns
    the chunk's address."""
    a = chunk_with_a_hole(h)
    h.sim_write(a, 10)
    h.sim_write(a + 3 * PAGE, 13)
    assert reserved_pages(h) == 4
    return a


def split_case(h):
    """A hole under a cap of 6 pages, two of them left for the kept pages'
    single pages, and a request for the 4 pages the cap allows once the
    chunk's two free pages go: no free run holds it."""
    a = hole(h)
    h.set_cap(6 * PAGE)
    return a, 4 * PAGE


def test_a_request_takes_the_locked_pages_and_the_kept_ones_keep_their_contents(make_heap):
    h = make_heap(capacity=4 * GiB, chunk_pages=4, split_chunks=1)
    a, size = split_case(h)
    assert h.memory_report(size)["chunk_locked_bytes"] == 2 * PAGE
    st0, copies = h.stats(), h.sim_calls("copy_dtod")
    x = h.malloc(size)
    st = h.stats()
    assert st["num_chunk_splits"] - st0["num_chunk_splits"] == 1
    assert st["num_sync_all_streams"] - st0["num_sync_all_streams"] == 1
    assert h.sim_calls("copy_dtod") - copies == 2
    assert h.sim_read(a) == 10 and h.sim_read(a + 3 * PAGE) == 13
    assert h.sim_is_accessible(x, size) and h.sim_is_accessible(a, PAGE)
    assert reserved_pages(h) == 6
    assert h.memory_report(PAGE)["chunk_locked_bytes"] == 0
    assert_ok(h)


def test_the_report_promises_no_more_than_a_split_gives(make_heap):
    # What a split frees depends on the pages left to copy into and on where
    # the request is placed, so the report counts locked pages only in place:
    # its largest block is one the heap can always make, here the hole's free
    # block, while the split serves 4 pages.
    h = make_heap(capacity=4 * GiB, chunk_pages=4, split_chunks=1)
    hole(h)
    h.set_cap(6 * PAGE)
    info = h.memory_report(5 * PAGE)
    assert info["chunk_locked_bytes"] == 2 * PAGE
    assert info["largest_possible"] == 4 * PAGE - 2 * (MiB + 512)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(5 * PAGE)
    h.malloc(4 * PAGE)
    assert h.stats()["num_chunk_splits"] == 1
    assert_ok(h)


def test_the_kept_pages_become_single_pages_that_move(make_heap):
    # After the split the kept pages are single pages: once their blocks are
    # freed they move like any page, with no second split.
    h = make_heap(capacity=4 * GiB, chunk_pages=4, split_chunks=1)
    a, size = split_case(h)
    x = h.malloc(size)
    for b in (a, a + 4 * PAGE - (MiB + 512)):
        h.free(b)
    h.free(x)
    st0 = h.stats()
    y = h.malloc(6 * PAGE)
    st = h.stats()
    assert st["num_chunk_splits"] == st0["num_chunk_splits"]
    assert h.sim_is_accessible(y, 6 * PAGE)
    assert_ok(h)


def two_holes(h):
    """Two 4-page chunks at the heap's first pages, each with a block of just
    over half a page at either end and its two middle pages free; kept page
    i holds 100 + i.  Returns the kept blocks."""
    x = h.malloc(8 * PAGE)
    h.free(x)
    kept, mids = [], []
    for _ in range(2):
        kept.append(h.malloc(MiB + 512))
        mids.append(h.malloc(4 * PAGE - 2 * (MiB + 512)))
        kept.append(h.malloc(MiB + 512))
    assert kept[-1] + MiB + 512 == x + 8 * PAGE
    for m in mids:
        h.free(m)
    for i, k in enumerate(kept):
        h.sim_write(k, 100 + i)
    return kept


def test_a_request_splits_as_many_chunks_as_it_needs(make_heap):
    # No free run holds 6 pages, and the cap allows only 2 more: the 4 free
    # pages of both chunks go to the request, the kept ones to single pages.
    h = make_heap(capacity=4 * GiB, chunk_pages=4, split_chunks=1)
    kept = two_holes(h)
    assert reserved_pages(h) == 8
    h.set_cap(10 * PAGE)  # room for two single pages at a time
    st0 = h.stats()
    y = h.malloc(6 * PAGE)
    assert h.stats()["num_chunk_splits"] - st0["num_chunk_splits"] == 2
    assert h.sim_is_accessible(y, 6 * PAGE)
    assert [h.sim_read(k) for k in kept] == [100, 101, 102, 103]
    assert reserved_pages(h) == 10
    assert_ok(h)
    for k in kept:
        h.free(k)
    h.free(y)
    assert_ok(h)


def test_nothing_is_split_during_a_capture(make_heap):
    h = make_heap(capacity=4 * GiB, chunk_pages=4, split_chunks=1)
    a, size = split_case(h)
    h.capture_begin()
    h.sim_set_capture(True)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(size)
    assert h.sim_capture_violations() == 0
    h.sim_set_capture(False)
    h.capture_end()
    assert h.stats()["num_chunk_splits"] == 0
    assert h.sim_read(a) == 10 and h.sim_read(a + 3 * PAGE) == 13
    assert_ok(h)
    h.malloc(size)  # after it, the split serves
    assert h.stats()["num_chunk_splits"] == 1
    assert_ok(h)


def test_no_page_to_copy_into_is_out_of_memory_and_changes_nothing(make_heap):
    # Under a cap of the 8 pages held nothing is left for the kept pages'
    # singles: the chunks stay whole, and the report says their free pages
    # are locked.
    h = make_heap(capacity=4 * GiB, chunk_pages=4, split_chunks=1)
    kept = two_holes(h)
    h.set_cap(8 * PAGE)
    assert h.memory_report(3 * PAGE)["largest_possible"] == 4 * PAGE - 2 * (MiB + 512)  # a hole's free block
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(3 * PAGE)
    assert h.stats()["num_chunk_splits"] == 0
    assert h.last_oom()["chunk_locked_bytes"] == 4 * PAGE
    assert [h.sim_read(k) for k in kept] == [100, 101, 102, 103]
    assert_ok(h)
    h.set_cap(9 * PAGE)  # one page to copy into: still too few for a chunk's two kept pages
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(3 * PAGE)
    assert h.stats()["num_chunk_splits"] == 0
    h.set_cap(10 * PAGE)  # two: one split, then the other with the pages the first freed
    h.free(h.malloc(6 * PAGE))
    assert h.stats()["num_chunk_splits"] == 2
    assert [h.sim_read(k) for k in kept] == [100, 101, 102, 103]
    assert_ok(h)


# Calls that fail before the chunk is unmapped: the first (and the second)
# such call and every one after.  An unmap failing that long would leave
# single pages in the scratch range, and a set_access failing in place would
# leave the chunk without access; those are asked again (below).
@pytest.mark.parametrize(
    "op,nth",
    [
        ("create", 1),
        ("create", 2),
        ("map", 1),
        ("map", 2),
        ("set_access", 1),
        ("copy_dtod", 1),
        ("copy_dtod", 2),
        ("unmap", 1),
    ],
)
def test_a_failing_device_call_leaves_the_kept_pages_whole(make_heap, op, nth):
    # Whatever fails, the request is out of memory or served, and the kept
    # pages hold what they held; once the device works the split runs.
    h = make_heap(capacity=4 * GiB, chunk_pages=4, split_chunks=1)
    a, size = split_case(h)
    h.sim_fail(op, nth=nth, count=1 if op == "unmap" else 1000)
    try:
        h.free(h.malloc(size))
    except (gpumem.OutOfMemoryError, gpumem.DeviceError):
        pass
    h.sim_fail(op, nth=0)
    assert_ok(h)
    assert h.sim_read(a) == 10 and h.sim_read(a + 3 * PAGE) == 13
    x = h.malloc(size)
    assert h.sim_is_accessible(x, size)
    assert h.sim_read(a) == 10 and h.sim_read(a + 3 * PAGE) == 13
    assert_ok(h)


@pytest.mark.parametrize("nth", [1, 2, 3, 4])
@pytest.mark.parametrize("op", ["map", "set_access", "copy_dtod", "unmap"])
def test_a_single_failure_anywhere_is_retried_or_undone(make_heap, op, nth):
    # One failure of the nth such call in the split: the retries or the undo
    # keep every kept page mapped, with its contents.
    h = make_heap(capacity=4 * GiB, chunk_pages=4, split_chunks=1)
    a, size = split_case(h)
    h.sim_fail(op, nth=nth, count=1)
    try:
        h.malloc(size)
    except (gpumem.OutOfMemoryError, gpumem.DeviceError):
        pass
    assert_ok(h)
    assert h.sim_read(a) == 10 and h.sim_read(a + 3 * PAGE) == 13
    assert h.sim_is_accessible(a, PAGE) and h.sim_is_accessible(a + 3 * PAGE, PAGE)


def test_a_resumed_pools_allocation_splits_at_chunk_pages_1(make_heap):
    # A resume makes each run of a pool's pages one allocation whatever
    # chunk_pages is (here 8 pages, at chunk_pages=1).  Once the pool ends
    # with one block left on it, a request that needs its 7 free pages
    # splits it: one page copied, 7 freed.
    h = make_heap(capacity=4 * GiB, chunk_pages=1, split_chunks=1)
    P = (3, 1)
    h.pool_retain(P)
    g = h.malloc(8 * PAGE)
    h.malloc(MiB)  # general, on the page after g
    h.free(g)
    a = h.malloc(8 * PAGE, pool=P)
    assert a == g
    h.pool_pause(P)
    h.pool_resume(P)
    h.free(a)
    x = h.malloc(MiB + 512, pool=P)  # on the resumed allocation's first page
    assert x == a
    h.sim_write(x, 77)
    h.pool_release(P)
    held = reserved_pages(h)
    h.set_cap((held + 1) * PAGE)  # one page to copy x's into
    st0 = h.stats()
    y = h.malloc(8 * PAGE)  # no free run holds it: 1 new page and the 7 freed
    assert h.stats()["num_chunk_splits"] - st0["num_chunk_splits"] == 1
    assert h.sim_is_accessible(y, 8 * PAGE) and h.sim_read(x) == 77
    assert reserved_pages(h) == held + 1
    assert_ok(h)


def test_off_by_default_the_free_pages_stay_locked(make_heap):
    h = make_heap(capacity=4 * GiB, chunk_pages=4)
    a = hole(h)
    h.set_cap(6 * PAGE)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(4 * PAGE)
    assert h.stats()["num_chunk_splits"] == 0
    assert h.last_oom()["chunk_locked_bytes"] == 2 * PAGE
    assert h.sim_read(a) == 10 and h.sim_read(a + 3 * PAGE) == 13
    assert_ok(h)


def test_the_option_is_checked_and_reaches_torchs_heaps():
    assert_switch_option("split_chunks", 0)  # the core's default: off
