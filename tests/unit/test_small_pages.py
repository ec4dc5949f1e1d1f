"""Small pages (csrc/core/small.c) and whole-page placement near pressure (csrc/core/place.c).

Blocks of at most half a page keep to pages of their own, so that the large blocks they would
otherwise sit beside leave whole pages when they go; a block of whole pages placed near pressure
(with room, but not far from pressure, or past the room line) takes the place that touches the
fewest pages.
"""

import pytest

import gpumem
from helpers import GiB, MiB, PAGE, assert_ok, pages_touched


def test_small_blocks_leave_the_pages_of_freed_large_ones_whole(make_heap):
    # Long-lived 64 KiB blocks allocated between 4 MiB ones, as weights
    # between activations: with each small block beside a large one, freeing
    # the large ones would leave every page a small block touches partly used,
    # and no defragmentation of whole pages could take them back.
    h = make_heap(capacity=34 * PAGE, pressure=0)
    big, small = [], []
    for _ in range(16):
        big.append(h.malloc(4 * MiB))
        small.append(h.malloc(64 * 1024))
    assert_ok(h)
    assert pages_touched([(p, 64 * 1024) for p in small]) == 1
    for p in big:
        h.free(p)
    # 32 pages besides the small blocks' one: only whole free pages make them.
    p = h.malloc(32 * PAGE)
    assert h.sim_is_accessible(p, 32 * PAGE)
    assert_ok(h)


def test_a_hole_under_a_page_still_takes_a_small_block(make_heap):
    # A small request with no small page free takes a hole under a page left
    # beside a large block before a wholly free page: here, the end of a 3 MiB
    # block's last page.
    h = make_heap(capacity=GiB, pressure=0)
    a = h.malloc(3 * MiB)
    assert h.malloc(64 * 1024) == a + 3 * MiB
    assert_ok(h)


def test_a_small_page_goes_back_when_its_last_block_goes(make_heap):
    h = make_heap(capacity=8 * PAGE, pressure=0)
    ps = [h.malloc(100_000) for _ in range(10)]
    assert pages_touched([(p, 100_000) for p in ps]) == 1
    for p in ps:
        h.free(p)
    assert_ok(h)
    # The page is general again: a request of every page the device has fits.
    h.malloc(8 * PAGE)
    assert_ok(h)


def test_a_large_request_never_takes_a_small_pages_free_space(make_heap):
    h = make_heap(capacity=GiB, pressure=0)
    s = h.malloc(4096)
    big = h.malloc(PAGE - 8192)  # would fit beside s
    assert pages_touched([(s, 4096), (big, PAGE - 8192)]) == 2
    h.free(big)
    assert h.malloc(MiB) == s + 4096  # a small one does take it
    assert_ok(h)


def test_blocks_of_whole_pages_touch_no_extra_page_near_pressure(make_heap):
    # With room but not far from pressure (a 4 GiB device keeps less than 16
    # GiB free past the room line), a chain of 8 MiB blocks after a block that
    # ends inside a page: each one placed right after the last would touch 5
    # pages, and leave two partly used pages when it goes.
    h = make_heap(capacity=4 * GiB)
    h.malloc(MiB + 512)
    chain = [h.malloc(8 * MiB) for _ in range(6)]
    for p in chain:
        assert pages_touched([(p, 8 * MiB)]) == 4
    assert_ok(h)
    assert h.stats()["num_remaps"] == 0


@pytest.mark.parametrize("pressure", [None, 0])
def test_past_the_room_line_blocks_of_whole_pages_touch_no_extra_page(make_heap, pressure):
    # Capped at 48 pages, the room line is at 42: a heap holding 43 is past
    # it, where the tight heap it has become keeps the whole-page rule.  The
    # always-tight heap (pressure 0) packs: the block follows the first one.
    kw = {} if pressure is None else {"pressure": pressure}
    h = make_heap(capacity=80 * GiB, cap=48 * PAGE, **kw)
    h.malloc(43 * PAGE)
    a = h.malloc(MiB + 512)
    b = h.malloc(8 * MiB)
    if pressure is None:
        assert pages_touched([(b, 8 * MiB)]) == 4
    else:
        assert b == a + MiB + 512
    assert_ok(h)


@pytest.mark.parametrize("capacity, pressure", [(4 * GiB, None), (80 * GiB, None), (4 * GiB, 0)])
def test_near_pressure_the_fast_path_carves_whole_pages_from_a_page_boundary(make_heap, capacity, pressure):
    # A free block of 19 MiB between two live blocks, starting and ending
    # inside a page: an 8 MiB request fits it (the fast path).  Carved at
    # either end it touches 5 pages, one of them shared with a neighbour; from
    # the block's first page boundary it touches only the 4 it needs.  That is
    # the rule near pressure (a 4 GiB device), as placement last found it for
    # a block of whole pages (the first one); far from pressure (80 GiB) and
    # on the always-tight heap (pressure 0) the low end, as before.
    kw = {} if pressure is None else {"pressure": pressure}
    h = make_heap(capacity=capacity, **kw)
    h.malloc(PAGE)
    a = h.malloc(MiB + 512)
    gap = h.malloc(19 * MiB)
    h.malloc(MiB)
    assert gap == a + MiB + 512  # not whole pages: packed after a
    h.free(gap)
    allocs = h.stats()["num_device_alloc"]
    b = h.malloc(8 * MiB)
    assert h.stats()["num_device_alloc"] == allocs  # the free block served it
    if capacity == 4 * GiB and pressure is None:
        assert b == -(-gap // PAGE) * PAGE and pages_touched([(b, 8 * MiB)]) == 4
    else:
        assert b == gap and pages_touched([(b, 8 * MiB)]) == 5
    assert_ok(h)


def test_far_from_pressure_placement_packs_as_before(make_heap):
    # 80 GiB: far from pressure, the chain follows the first block, where
    # growth may reach ahead without a device call.
    h = make_heap(capacity=80 * GiB)
    a = h.malloc(MiB + 512)
    b = h.malloc(8 * MiB)
    assert b == a + MiB + 512
    assert_ok(h)


def test_replays_agree_with_the_checker(make_heap):
    # Small and large blocks over two streams, freed in another order: the
    # checker's small-page rule (C17) holds after each step.
    h = make_heap(capacity=64 * PAGE, pressure=0)
    live = []
    for i in range(200):
        size = (i * 7919) % (3 * MiB) + 1
        try:
            live.append(h.malloc(size, stream=1 + i % 2))
        except gpumem.OutOfMemoryError:
            h.free(live.pop(0))
        if i % 3 == 0 and live:
            h.free(live.pop(len(live) // 2))
        if i % 25 == 0:
            assert_ok(h)
    for p in live:
        h.free(p)
    assert_ok(h)
