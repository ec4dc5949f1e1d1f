"""Unit tests of the allocator core, through the extension, on the sim device."""

import re

import pytest

import gpumem
from helpers import (
    FIELDS,
    POOLS,
    STAT_NAMES,
    MiB,
    GiB,
    PAGE,
    assert_ok,
    drain_and_assert_empty,
    live_blocks,
    pages_touched,
    pool_of,
    recount,
)

PLAIN_KEYS = (
    "num_alloc_retries",
    "num_ooms",
    "num_slow_allocs",
    "num_sync_all_streams",
    "num_device_alloc",
    "num_device_free",
    "num_maps",
    "num_unmaps",
    "num_remaps",
    "num_pages_remapped",
    "num_device_errors",
    "max_split_size",
)


def assert_stats_match_recount(h):
    st = h.stats()
    for key, want in recount(h).items():
        assert st[key] == want, f"{key}: core says {st[key]}, recount says {want}"
    info = h.sim_info()
    assert st["reserved_bytes.all.current"] == info["pages_created"] * h.page_size
    assert st["segment.all.current"] == info["pages_created"]
    for name in STAT_NAMES:
        parts = st[f"{name}.small_pool.current"] + st[f"{name}.large_pool.current"]
        assert st[f"{name}.all.current"] == parts, name


# ---- basics -----------------------------------------------------------------


def test_alloc_free_reuse(heap):
    p = heap.malloc(1000)
    assert p != 0 and p % 512 == 0
    assert heap.block_size(p) == 1024
    heap.free(p)
    assert heap.block_size(p) == 0
    # Same stream, same size: the block just freed is the best fit.
    q = heap.malloc(1000)
    assert q == p
    heap.free(q)
    assert_ok(heap)


def test_properties_of_heap(make_heap):
    h = make_heap(capacity="1GiB")
    assert h.device_kind == "sim"
    assert isinstance(h.device_name, str) and h.device_name
    assert h.page_size == PAGE
    assert h.sim_info()["capacity"] == GiB
    assert h.get_cap() == 0


@pytest.mark.parametrize(
    "size,block",
    [
        (1, 512),
        (511, 512),
        (512, 512),
        (513, 1024),
        (1000, 1024),
        (MiB, MiB),
        (MiB + 1, MiB + 512),
        (5 * MiB + 3, 5 * MiB + 512),
    ],
)
def test_rounding_to_512(heap, size, block):
    p = heap.malloc(size)
    assert p % 512 == 0
    assert heap.block_size(p) == block
    st = heap.stats()
    assert st["requested_bytes.all.current"] == size
    assert st["allocated_bytes.all.current"] == block
    assert st[f"allocated_bytes.{pool_of(block)}.current"] == block
    (blk,) = live_blocks(heap)
    assert blk[0] == p and blk[1] == block and blk[2] == size
    heap.free(p)
    st = heap.stats()
    assert st["requested_bytes.all.current"] == 0
    assert st["allocated_bytes.all.current"] == 0


def test_blocks_do_not_overlap_and_are_accessible(heap):
    sizes = [1, 700, 4096, 100_000, MiB, 3 * MiB + 5, 17 * MiB, 512, 65_536]
    ptrs = [heap.malloc(s) for s in sizes]
    spans = sorted((p, heap.block_size(p)) for p in ptrs)
    for (a, sa), (b, _) in zip(spans, spans[1:]):
        assert a + sa <= b
    for p, s in spans:
        assert heap.sim_is_accessible(p, s)
    drain_and_assert_empty(heap, ptrs)


def test_context_and_stream_recorded_in_snapshot(heap):
    p = heap.malloc(3000, stream=0x1000, context=77)
    (blk,) = live_blocks(heap)
    addr, size, req, stream, ctx, seq, state, pool = blk
    assert (addr, size, req, stream, ctx, state, pool) == (p, 3072, 3000, 0x1000, 77, "live", None)
    heap.free(p)


# ---- statistics --------------------------------------------------------------


def test_stats_keys_complete(heap):
    st = heap.stats()
    for name in STAT_NAMES:
        for pool in POOLS:
            for field in FIELDS:
                key = f"{name}.{pool}.{field}"
                assert key in st, key
                assert isinstance(st[key], int)
    for key in PLAIN_KEYS:
        assert key in st, key
    assert st["max_split_size"] == -1


def test_stats_against_recount(heap):
    ptrs = []
    sizes = [100, 4096, 8000, 700_000, MiB, MiB + 1, 2 * MiB, 9 * MiB + 77, 300]
    for i, s in enumerate(sizes * 3):
        ptrs.append(heap.malloc(s, stream=(0, 0x1000)[i % 2]))
        assert_stats_match_recount(heap)
    for p in ptrs[::3]:
        heap.free(p)
        assert_stats_match_recount(heap)
    st = heap.stats()
    n, k = len(ptrs), len(ptrs[::3])
    assert st["allocation.all.allocated"] == n
    assert st["allocation.all.freed"] == k
    assert st["allocation.all.current"] == n - k
    small = sum(1 for s in sizes * 3 if s <= MiB)
    assert st["allocation.small_pool.allocated"] == small
    assert st["allocation.large_pool.allocated"] == n - small
    assert st["allocated_bytes.all.allocated"] == sum(heap_round(s) for s in sizes * 3)
    assert st["num_device_alloc"] == heap.sim_calls("create")
    assert st["num_maps"] == heap.sim_calls("map")
    assert_ok(heap)
    drain_and_assert_empty(heap, [p for i, p in enumerate(ptrs) if i % 3])


def heap_round(n):
    return (n + 511) // 512 * 512


def test_peaks_and_reset(heap):
    a = heap.malloc(10 * MiB)
    b = heap.malloc(20 * MiB)
    c = heap.malloc(512)
    heap.free(b)
    heap.free(c)
    st = heap.stats()
    assert st["allocated_bytes.all.current"] == 10 * MiB
    assert st["allocated_bytes.all.peak"] == 30 * MiB + 512
    assert st["allocated_bytes.large_pool.peak"] == 30 * MiB
    assert st["allocated_bytes.small_pool.peak"] == 512
    assert st["allocation.all.peak"] == 3
    assert st["reserved_bytes.all.peak"] >= 30 * MiB + 512
    heap.reset_peak_stats()
    st = heap.stats()
    for name in STAT_NAMES:
        for pool in POOLS:
            assert st[f"{name}.{pool}.peak"] == st[f"{name}.{pool}.current"], (name, pool)
    # Accumulated counters survive a peak reset and go with the other reset.
    assert st["allocation.all.allocated"] == 3
    heap.reset_accumulated_stats()
    st = heap.stats()
    for name in STAT_NAMES:
        for pool in POOLS:
            assert st[f"{name}.{pool}.allocated"] == 0
            assert st[f"{name}.{pool}.freed"] == 0
    assert st["allocated_bytes.all.current"] == 10 * MiB  # current is not touched
    assert st["num_device_alloc"] == 0 and st["num_maps"] == 0
    heap.free(a)
    st = heap.stats()
    assert st["allocation.all.freed"] == 1
    assert st["allocated_bytes.all.freed"] == 10 * MiB
    assert_ok(heap)


# ---- layout ----------------------------------------------------------------


def test_coalescing_three_neighbours(heap):
    size = 3 * MiB
    a, b, c = (heap.malloc(size) for _ in range(3))
    guard = heap.malloc(size)  # keeps the run from merging into the free tail
    assert b == a + size and c == b + size, "fresh heap should place blocks side by side"
    heap.free(a)
    heap.free(c)
    heap.free(b)
    assert_ok(heap)
    free = [blk for blk in heap.snapshot()["blocks"] if blk[6] == "free"]
    merged = [blk for blk in free if blk[0] == a]
    assert merged, free
    assert merged[0][1] == 3 * size
    assert not [blk for blk in free if a < blk[0] < a + 3 * size]
    st = heap.stats()
    assert st["inactive_split.all.current"] == len(free)
    heap.free(guard)


def test_small_requests_share_pages(heap):
    n = 1000
    ptrs = [heap.malloc(4096) for _ in range(n)]
    total = n * 4096
    want = -(-total // PAGE)
    spans = [(p, heap.block_size(p)) for p in ptrs]
    touched = pages_touched(spans)
    st = heap.stats()
    assert touched <= want + 1, f"{n} x 4 KiB touch {touched} pages, {want} would do"
    assert st["segment.all.current"] <= want + 1
    assert heap.sim_info()["pages_created"] == st["segment.all.current"]
    drain_and_assert_empty(heap, ptrs)


def fill_with_pages(h, cap_pages):
    """Fill a fresh heap with one-page blocks until it is full."""
    ptrs = []
    for _ in range(cap_pages):
        ptrs.append(h.malloc(PAGE))
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(PAGE)
    return ptrs


def every_other_page_free(h):
    """A full heap of 64 MiB whose even pages are then freed: 16 free pages,
    none adjacent.  Returns the 16 one-page blocks kept."""
    ptrs = fill_with_pages(h, 32)
    for p in ptrs[0::2]:
        h.free(p)
    return ptrs[1::2]


def test_defragmentation_serves_a_large_request(make_heap):
    h = make_heap(capacity=64 * MiB)
    kept = every_other_page_free(h)
    # 16 free pages, none adjacent: a contiguous 32 MiB needs them remapped.
    before = h.stats()
    big = h.malloc(32 * MiB)
    st = h.stats()
    assert st["num_remaps"] > before["num_remaps"]
    assert st["num_pages_remapped"] > before["num_pages_remapped"]
    assert st["reserved_bytes.all.current"] <= 64 * MiB
    assert h.sim_is_accessible(big, 32 * MiB)
    for p in kept:
        assert h.sim_is_accessible(p, PAGE)
    assert_ok(h)
    assert_stats_match_recount(h)
    drain_and_assert_empty(h, kept + [big])


def test_defragmentation_oom_when_it_cannot_fit(make_heap):
    h = make_heap(capacity=64 * MiB)
    kept = every_other_page_free(h)
    ooms = h.stats()["num_ooms"]
    with pytest.raises(gpumem.OutOfMemoryError) as exc:
        h.malloc(34 * MiB)  # 17 pages, only 16 free
    assert str(exc.value).startswith("CUDA out of memory.")
    assert isinstance(exc.value, RuntimeError)
    assert h.stats()["num_ooms"] == ooms + 1
    oom = h.last_oom()
    assert oom is not None and oom["request"] == 34 * MiB
    assert_ok(h)
    # The failed attempt lost nothing: the 16 pages are still there to use.
    big = h.malloc(32 * MiB)
    assert_ok(h)
    drain_and_assert_empty(h, kept + [big])


def test_oom_on_an_empty_heap_larger_than_capacity(make_heap):
    h = make_heap(capacity=64 * MiB)
    with pytest.raises(gpumem.OutOfMemoryError, match=r"^CUDA out of memory\."):
        h.malloc(64 * MiB + 512)
    assert h.stats()["num_ooms"] == 1
    drain_and_assert_empty(h, [])


# ---- cap and empty_cache ------------------------------------------------------


def test_cap_limits_growth(heap):
    heap.set_cap(16 * MiB)
    assert heap.get_cap() == 16 * MiB
    a = heap.malloc(8 * MiB)
    with pytest.raises(gpumem.OutOfMemoryError):
        heap.malloc(10 * MiB)
    assert heap.stats()["reserved_bytes.all.current"] <= 16 * MiB
    b = heap.malloc(6 * MiB)
    assert heap.stats()["reserved_bytes.all.current"] <= 16 * MiB
    heap.set_cap(0)
    assert heap.get_cap() == 0
    c = heap.malloc(10 * MiB)  # no cap: fits again
    assert_ok(heap)
    drain_and_assert_empty(heap, [a, b, c])


def test_lowering_cap_releases_cached_pages(heap):
    ptrs = [heap.malloc(PAGE) for _ in range(10)]
    keep = ptrs.pop()
    for p in ptrs:
        heap.free(p)
    assert heap.stats()["reserved_bytes.all.current"] >= 10 * PAGE  # cached
    heap.set_cap(4 * MiB)
    assert heap.stats()["reserved_bytes.all.current"] <= 4 * MiB
    assert heap.sim_info()["pages_created"] <= 2
    assert heap.sim_is_accessible(keep, PAGE)
    assert_ok(heap)
    drain_and_assert_empty(heap, [keep])


def test_cap_never_exceeded_under_churn(heap):
    heap.set_cap(40 * MiB)
    live = []
    for i in range(300):
        size = (i * 7919) % (6 * MiB) + 1
        try:
            live.append(heap.malloc(size))
        except gpumem.OutOfMemoryError:
            heap.free(live.pop(0))
        assert heap.stats()["reserved_bytes.all.current"] <= 40 * MiB
    assert_ok(heap)
    drain_and_assert_empty(heap, live)


def test_empty_cache_keeps_only_live_pages(heap):
    ptrs = [heap.malloc(s) for s in (5 * MiB, 4096, 3 * MiB, 100, 7 * MiB, 2 * MiB, 60_000)]
    for p in ptrs[::2]:
        heap.free(p)
    kept = ptrs[1::2]
    heap.empty_cache()
    want = pages_touched([(p, heap.block_size(p)) for p in kept])
    st = heap.stats()
    assert st["reserved_bytes.all.current"] == want * PAGE
    info = heap.sim_info()
    assert info["pages_created"] == want
    assert info["pages_mapped"] == want
    for p in kept:
        assert heap.sim_is_accessible(p, heap.block_size(p))
    assert st["num_device_free"] > 0
    assert_ok(heap)
    drain_and_assert_empty(heap, kept)


# ---- streams ---------------------------------------------------------------


S1, S2 = 0x1000, 0x2000


def test_same_stream_reuse_is_immediate(heap):
    p = heap.malloc(3 * MiB, stream=S1)
    heap.free(p)
    assert heap.malloc(3 * MiB, stream=S1) == p


def overlaps(p, size, q, qsize):
    return p < q + qsize and q < p + size


def test_record_stream_blocks_reuse_while_held(heap):
    size = 2 * MiB
    p = heap.malloc(size, stream=0)
    heap.record_stream(p, S2)
    heap.sim_hold_stream(S2, True)  # a kernel on S2 still reads p
    heap.free(p)
    assert heap.block_size(p) == 0
    states = {blk[0]: blk[6] for blk in heap.snapshot()["blocks"]}
    assert states.get(p) == "pending"
    others = []
    for stream in (0, S1, S2, 0, S1, S2):
        q = heap.malloc(size, stream=stream)
        assert not overlaps(p, size, q, heap.block_size(q)), f"pending block reused on stream {stream:#x}"
        others.append(q)
    assert_ok(heap)
    heap.sim_hold_stream(S2, False)
    reused = []
    for _ in range(3):
        q = heap.malloc(size, stream=0)
        reused.append(q)
        if q == p:
            break
    assert p in reused, "block freed behind a released stream was not reused"
    assert_ok(heap)
    drain_and_assert_empty(heap, others + reused)


def test_held_allocation_stream_blocks_other_streams(heap):
    size = 4 * MiB
    p = heap.malloc(size, stream=S1)
    heap.sim_hold_stream(S1, True)
    heap.free(p)
    # Another stream would race with S1's queued work.
    q = heap.malloc(size, stream=S2)
    assert not overlaps(p, size, q, heap.block_size(q))
    # S1 itself is ordered after its own work: reuse is fine there.
    r = heap.malloc(size, stream=S1)
    assert r == p
    heap.sim_hold_stream(S1, False)
    drain_and_assert_empty(heap, [q, r])


def test_record_stream_released_before_free_does_not_block(heap):
    p = heap.malloc(MiB + 512, stream=0)
    heap.record_stream(p, S2)  # S2 is not held: its work is done by the free
    heap.free(p)
    assert heap.malloc(MiB + 512, stream=0) == p


def test_empty_cache_does_not_release_pending_pages(heap):
    p = heap.malloc(6 * MiB)
    spare = heap.malloc(6 * MiB)
    heap.free(spare)  # cached pages empty_cache would like to release
    heap.record_stream(p, S2)
    heap.sim_hold_stream(S2, True)
    heap.free(p)
    # empty_cache waits for the device, as torch's does; a held stream never
    # finishes, so the sim refuses to wait and nothing that needs the wait goes.
    with pytest.raises(gpumem.DeviceError, match="held"):
        heap.empty_cache()
    # The pages still back work running on S2.
    assert heap.sim_is_accessible(p, 6 * MiB)
    assert_ok(heap)
    heap.sim_hold_stream(S2, False)
    heap.empty_cache()
    assert heap.sim_info()["pages_created"] == 0
    drain_and_assert_empty(heap, [])


# ---- errors ----------------------------------------------------------------


def test_double_free(heap):
    p = heap.malloc(1000)
    heap.free(p)
    before = heap.stats()
    with pytest.raises(gpumem.InvalidPointerError) as exc:
        heap.free(p)
    assert isinstance(exc.value, ValueError)
    assert re.search(r"double|EDOUBLE_FREE", str(exc.value), re.I), str(exc.value)
    after = heap.stats()
    assert after["allocation.all.freed"] == before["allocation.all.freed"]
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert_ok(heap)


def test_interior_pointer_is_rejected(heap):
    p = heap.malloc(8192)
    with pytest.raises(gpumem.InvalidPointerError):
        heap.free(p + 512)
    assert heap.block_size(p) == 8192  # still live
    heap.free(p)


def test_unknown_pointer(heap):
    p = heap.malloc(1000)
    snap = heap.snapshot()
    outside = snap["va_base"] + snap["va_size"] + 4096
    for bad in (outside, 0x1000, snap["va_base"] - 512):
        with pytest.raises(gpumem.InvalidPointerError) as exc:
            heap.free(bad)
        msg = str(exc.value)
        assert re.search(r"unknown|EUNKNOWN_PTR|not .*heap|never", msg, re.I), msg
        assert not re.search(r"double", msg, re.I), msg
    with pytest.raises(gpumem.InvalidPointerError):
        heap.record_stream(outside, S1)
    heap.free(p)
    with pytest.raises(gpumem.InvalidPointerError):
        heap.record_stream(p, S1)
    assert heap.block_size(outside) == 0
    assert_ok(heap)


def test_closed_heap_raises(make_heap):
    h = make_heap(capacity="256MiB")
    p = h.malloc(100)
    h.close()
    for call in (
        lambda: h.malloc(1),
        lambda: h.free(p),
        h.stats,
        h.check,
        h.empty_cache,
        h.snapshot,
        lambda: h.set_cap(0),
        h.sim_info,
        h.reset_peak_stats,
        h.reset_accumulated_stats,
        h.capture_begin,
    ):
        with pytest.raises(ValueError):
            call()


def test_context_manager_closes(gpumem_mod):
    with gpumem_mod.Heap(device="sim", capacity="1GiB") as h:
        h.free(h.malloc(4096))
    with pytest.raises(ValueError):
        h.malloc(1)


def test_bad_sizes(heap):
    with pytest.raises(ValueError):
        heap.malloc(-1)
    with pytest.raises((ValueError, OverflowError)):
        heap.malloc(2**64)
    with pytest.raises((ValueError, gpumem.OutOfMemoryError)):
        heap.malloc(2**62)
    with pytest.raises(TypeError):
        heap.malloc("10")
    assert heap.stats()["allocation.all.current"] == 0
    assert_ok(heap)


def test_bad_heap_arguments(gpumem_mod):
    with pytest.raises(ValueError):
        gpumem_mod.Heap(device="nonsense")
    with pytest.raises(ValueError):
        gpumem_mod.Heap(device="sim", capacity=-1)
    with pytest.raises(ValueError):
        gpumem_mod.Heap(device="sim", capacity="lots")


def test_bad_sim_op_name(heap):
    with pytest.raises(ValueError):
        heap.sim_fail("launch_missiles")
    with pytest.raises(ValueError):
        heap.sim_calls("nope")


# ---- regressions found by the fuzz driver ------------------------------------


def test_page_shared_by_two_streams_free_blocks_is_released(heap):
    # Two streams' freed blocks share one page; neither covers it alone, and
    # they cannot merge until the device is synchronised -- which empty_cache
    # must then do rather than keep the page.
    a = heap.malloc(MiB, stream=S1)
    b = heap.malloc(MiB, stream=S2)
    assert pages_touched([(a, MiB), (b, MiB)]) == 1
    heap.free(a)
    heap.free(b)
    drain_and_assert_empty(heap, [])


def test_defragmentation_cutting_many_free_blocks(tmp_path):
    # Defragmenting from hundreds of free blocks at once needs a block record
    # for every cut; running out must not crash.  In a subprocess: a crash here
    # would otherwise take the whole test session down.
    import subprocess
    import sys

    code = f"""
import gpumem
MiB = {MiB}
with gpumem.Heap(device="sim", capacity="4GiB") as h:
    big, small = [], []
    for _ in range(600):
        try:
            big.append(h.malloc(5 * MiB))
        except gpumem.OutOfMemoryError:
            break
        small.append(h.malloc(512))   # pins the page between two big blocks
    for p in big:
        h.free(p)
    p = h.malloc(2 << 30)             # needs pages from most of the free blocks
    h.check()
    assert h.sim_is_accessible(p, 2 << 30)
    print("ok", len(big), h.stats()["num_pages_remapped"])
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, f"exit {res.returncode}\n{res.stdout}\n{res.stderr[-2000:]}"
    assert res.stdout.startswith("ok")


# A separator over half a page: small requests keep to small pages of their own.
SEP = MiB + 4096


def _holes_between_live_blocks(heap):
    """Unmapped holes of two lengths between live separators (2 MiB pages):
    [0, 4M) unmapped | sep1 | free, [6M, 12M) unmapped, free | sep2 | free, unmapped to the end."""
    x1 = heap.malloc(4 * MiB)
    heap.malloc(SEP)
    x2 = heap.malloc(8 * MiB - 4096)
    heap.malloc(SEP)
    heap.free(x1)
    heap.free(x2)
    heap.empty_cache()
    assert_ok(heap)
    return x1, x2


def test_slow_path_places_where_fewest_new_pages_are_needed(heap):
    x1, x2 = _holes_between_live_blocks(heap)
    assert x2 == x1 + 4 * MiB + SEP
    reserved = heap.stats()["reserved_bytes.all.current"]
    # 3 MiB - 8 KiB at the start of the second hole touches its mapped first
    # page and one unmapped page (so does its end, at a higher address); in the
    # first, shorter hole it needs two new pages.
    p = heap.malloc(3 * MiB - 8192)
    assert p == x2
    assert heap.stats()["reserved_bytes.all.current"] - reserved == 1 * 2 * MiB
    assert_ok(heap)


def test_slow_path_breaks_ties_by_the_shortest_run(heap):
    x1, x2 = _holes_between_live_blocks(heap)
    reserved = heap.stats()["reserved_bytes.all.current"]
    # 4 MiB needs two new pages in every run; the 4 MiB hole is the shortest.
    p = heap.malloc(4 * MiB)
    assert p == x1
    assert heap.stats()["reserved_bytes.all.current"] - reserved == 2 * 2 * MiB
    assert_ok(heap)
    # Freed again, it is a lone free block (the range's start, then a live
    # block): the next request of its size reuses it on the fast path.
    heap.free(p)
    assert heap.malloc(4 * MiB) == x1
    assert_ok(heap)


def test_name_lists_come_from_the_core():
    """Error and statistic names are defined once in gpumem.h and exported by _C."""
    from gpumem import _C

    assert _C.ERROR_NAMES[0] == "GM_OK" and _C.ERROR_NAMES[1] == "GM_ENOMEM"
    assert sorted(_C.ERROR_NAMES) == list(range(len(_C.ERROR_NAMES)))
    with gpumem.Heap(device="sim", capacity="1GiB") as h:
        stats = h.stats()
    expected = {
        f"{name}.{pool}.{field}"
        for name in _C.POOLED_STAT_NAMES
        for pool in ("all", "small_pool", "large_pool")
        for field in ("current", "peak", "allocated", "freed")
    }
    expected |= set(_C.COUNTER_NAMES)
    assert set(stats) == expected
