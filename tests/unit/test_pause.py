"""Pausing a private pool's physical memory (gm_pool_pause / gm_pool_resume).

On the simulated device, whose pages each hold one value (sim_write /
sim_read) and whose free memory is what other processes could take: a pause
gives back exactly the pages only the pool's blocks use, keeps every block at
its address, and nothing else is ever placed on a paused page; a resume maps
pages at the same addresses, restoring the contents from a backup, or fresh
pages without one.  Device failures leave the pool fully paused or not paused,
never half, and the invariant checker (C12) agrees after every step.
"""

import pytest

import gpumem
from helpers import GiB, MiB, PAGE, assert_ok

P, Q = (1, 7), (2, 0)
S1 = 0x1000
FRESH = 0xF4E5 << 48  # the simulated device's tag on a page nobody wrote


def is_fresh(v):
    return v >> 48 == 0xF4E5


def pages_of(addr, size):
    return list(range(addr // PAGE, (addr + size - 1) // PAGE + 1))


def dev_free(h):
    return h.mem_info()[0]


def reserved(h):
    return h.stats()["reserved_bytes.all.current"]


def setup_pool(h, sizes=(3 * PAGE, PAGE, 5 * MiB), pool=P):
    h.pool_retain(pool)
    return [h.malloc(n, pool=pool) for n in sizes]


# ---- what a pause gives back ------------------------------------------------------------


def paused_with_values(h, pages, first):
    """Pool P gets one block of `pages` pages, page k holding first + k; then it
    is paused with a backup.  Returns (block, pause result, the values)."""
    h.pool_retain(P)
    a = h.malloc(pages * PAGE, pool=P)
    values = [first + k for k in range(pages)]
    for k, v in enumerate(values):
        h.sim_write(a + k * PAGE, v)
    return a, h.pool_pause(P, backup=True), values


def read_pages(h, a, pages):
    return [h.sim_read(a + k * PAGE) for k in range(pages)]


def test_pause_releases_the_pool_pages_and_keeps_addresses(make_heap):
    h = make_heap(capacity=256 * MiB)
    blocks = setup_pool(h)
    free0, res0 = dev_free(h), reserved(h)
    info = h.pool_info(P)
    unmaps = h.stats()["num_unmaps"]
    r = h.pool_pause(P)
    assert h.stats()["num_unmaps"] - unmaps == 1, "one run of pages: one unmap call"
    # 5 MiB ends mid-page, before unmapped space: the rest of that page became the pool's
    assert r["pages"] == 7 and r["shared_pages"] == 0 and r["backup_bytes"] == 0
    assert r["pages"] + r["shared_pages"] == info["pinned_pages"]
    assert r["bytes"] == r["pages"] * PAGE
    assert dev_free(h) - free0 == r["bytes"]  # other processes see it come back
    assert res0 - reserved(h) == r["bytes"]
    after = h.pool_info(P)
    assert after["paused"] and after["paused_pages"] == r["pages"] and after["live_blocks"] == 3
    for b in blocks:
        assert h.block_size(b) > 0  # still live, same address
        assert not h.sim_is_accessible(b, 512)
        with pytest.raises(ValueError, match=f"illegal address {b:#x} "):
            h.sim_read(b)
    assert_ok(h)
    r2 = h.pool_resume(P)
    assert r2["pages"] == r["pages"]
    assert dev_free(h) == free0 and reserved(h) == res0
    for b in blocks:
        assert h.sim_is_accessible(b, h.block_size(b))
    assert not h.pool_info(P)["paused"]
    assert_ok(h)


def test_a_pools_pages_are_its_own_so_pause_releases_every_one(make_heap):
    h = make_heap(capacity=256 * MiB)
    h.pool_retain(P)
    a = h.malloc(4 * PAGE, pool=P)
    other = h.malloc(8192)  # general, on a page of its own
    small = h.malloc(4096, pool=P)  # a page of the pool's own, not the rest of other's
    assert not set(pages_of(small, 4096)) & set(pages_of(other, 8192))
    r = h.pool_pause(P)
    assert r["shared_pages"] == 0
    assert r["pages"] == len(set(pages_of(a, 4 * PAGE)) | set(pages_of(small, 4096)))
    assert h.sim_is_accessible(other, 8192)
    assert not h.sim_is_accessible(small, 4096) and not h.sim_is_accessible(a, PAGE)
    assert h.pool_info(P)["shared_pages"] == 0
    assert_ok(h)
    h.pool_resume(P)
    assert h.sim_is_accessible(small, 4096) and h.sim_is_accessible(a, 4 * PAGE)
    assert_ok(h)


def test_an_empty_pool_pauses_with_nothing_to_release(make_heap):
    h = make_heap(capacity=64 * MiB)
    h.pool_retain(P)
    r = h.pool_pause(P)
    assert r["pages"] == 0 and r["shared_pages"] == 0
    with pytest.raises(RuntimeError, match="GM_EPAUSED"):
        h.malloc(512, pool=P)
    assert h.pool_resume(P)["pages"] == 0
    h.malloc(512, pool=P)
    assert_ok(h)


# ---- contents ---------------------------------------------------------------------------


@pytest.mark.parametrize("backup", [True, False])
def test_backup_restores_contents_and_no_backup_gives_fresh_pages(make_heap, backup):
    h = make_heap(capacity=256 * MiB)
    h.pool_retain(P)
    a = h.malloc(6 * PAGE, pool=P)
    b = h.malloc(3 * PAGE, pool=P)
    h.free(h.malloc(PAGE, pool=P))  # a free block of the pool: its page is released too
    addrs = [a + k * PAGE for k in range(6)] + [b + k * PAGE for k in range(3)]
    for i, x in enumerate(addrs):
        h.sim_write(x, 1000 + i)
    r = h.pool_pause(P, backup=backup)
    assert r["backup_bytes"] == (r["bytes"] if backup else 0)
    assert h.sim_host_blocks() == (1 if backup else 0)
    # the memory goes to someone else meanwhile, and comes back with their data on it
    hog = h.malloc(r["bytes"])
    for k in range(r["pages"]):
        h.sim_write(hog + k * PAGE, 0xBAD)
    h.free(hog)
    h.empty_cache()
    r2 = h.pool_resume(P)
    assert r2["backup_bytes"] == r["backup_bytes"]
    assert h.sim_host_blocks() == 0
    got = [h.sim_read(x) for x in addrs]
    if backup:
        assert got == [1000 + i for i in range(len(addrs))]
    else:
        assert all(is_fresh(v) for v in got), [hex(v) for v in got]
    assert_ok(h)


def test_backup_survives_a_failed_resume(make_heap):
    h = make_heap(capacity=256 * MiB)
    a, _, values = paused_with_values(h, 4, 77)
    h.sim_fail("copy_htod")
    with pytest.raises(gpumem.DeviceError):
        h.pool_resume(P)
    info = h.pool_info(P)
    assert info["paused"] and info["paused_pages"] == 4 and info["backup_bytes"] == 4 * PAGE
    assert h.sim_host_blocks() == 1
    assert_ok(h)
    h.pool_resume(P)
    assert read_pages(h, a, 4) == values == [77, 78, 79, 80]
    assert_ok(h)


# ---- nothing else touches a paused page -------------------------------------------------


def test_paused_pages_are_never_placed_on_or_trimmed(make_heap):
    h = make_heap(capacity=96 * MiB)
    blocks = setup_pool(h, sizes=(5 * PAGE, 700_000, 3 * MiB))
    h.pool_retain(Q)
    q = h.malloc(2 * PAGE, pool=Q)
    r = h.pool_pause(P, backup=True)
    paused = set()
    for b in blocks:
        paused |= set(pages_of(b, h.block_size(b)))
    # fill the device from every side: general requests, another pool, a lower cap
    got = []
    for n in (512, 3 * PAGE, 100_000, 7 * MiB, PAGE, 4096):
        for _ in range(6):
            try:
                got.append(h.malloc(n, stream=S1 if n % 2 else 0))
            except gpumem.OutOfMemoryError:
                break
            assert_ok(h)
    for x in got[::2]:
        h.free(x)
    for _ in range(3):
        h.free(h.malloc(PAGE, pool=Q))
    h.empty_cache()
    assert_ok(h)
    h.set_cap(48 * MiB)
    assert_ok(h)
    h.set_cap(0)
    more = []
    for _ in range(3):
        try:
            more.append(h.malloc(5 * MiB))
        except gpumem.OutOfMemoryError:
            break
    for x in got[1::2] + more:
        assert not any(p in paused for p in pages_of(x, h.block_size(x)))
    # the pool's released pages still have no physical page behind them; its shared ones do
    unmapped = [pg for pg in paused if h.sim_page_at(pg * PAGE) == 0]
    assert len(unmapped) == r["pages"] > 0
    assert len(paused) - len(unmapped) == r["shared_pages"]
    assert h.pool_info(P)["paused_pages"] == r["pages"]
    assert_ok(h)
    for x in got[1::2] + more + [q]:
        h.free(x)
    h.pool_resume(P)
    assert_ok(h)


def test_resume_needs_the_memory_back_and_stays_paused_until_then(make_heap):
    h = make_heap(capacity=64 * MiB)
    h.pool_retain(P)
    a = h.malloc(16 * PAGE, pool=P)
    h.sim_write(a, 5)
    h.pool_pause(P, backup=True)
    hog = h.malloc(40 * MiB)  # another user takes what the pause gave back
    with pytest.raises(gpumem.OutOfMemoryError):
        h.pool_resume(P)
    assert h.pool_info(P)["paused"] and h.pool_info(P)["paused_pages"] == 16
    assert_ok(h)
    h.free(hog)  # cached, not released: resume takes those pages back itself
    assert h.stats()["reserved_bytes.all.current"] >= 40 * MiB
    h.pool_resume(P)
    assert h.sim_read(a) == 5
    assert_ok(h)


def test_resume_respects_the_cap(make_heap):
    h = make_heap(capacity=256 * MiB)
    h.pool_retain(P)
    h.malloc(10 * PAGE, pool=P)
    h.pool_pause(P)
    h.set_cap(8 * PAGE)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.pool_resume(P)
    assert h.pool_info(P)["paused"]
    h.set_cap(0)
    h.pool_resume(P)
    assert_ok(h)


# ---- while paused -----------------------------------------------------------------------


def test_freeing_in_a_paused_pool_is_bookkeeping_and_the_pool_reuses_it_after(make_heap):
    h = make_heap(capacity=128 * MiB)
    a, b, c = setup_pool(h)
    h.pool_pause(P)
    calls = {op: h.sim_calls(op) for op in gpumem._C.DEVICE_OPS}
    h.free(b)
    h.record_stream(a, S1)
    h.free(a)  # pending on S1: an event, but no memory call
    assert_ok(h)
    for op in ("create", "map", "unmap", "release", "set_access", "copy_htod", "copy_dtoh"):
        assert h.sim_calls(op) == calls[op], op
    info = h.pool_info(P)
    assert info["live_blocks"] + info["free_blocks"] >= 2
    h.pool_resume(P)
    again = h.malloc(PAGE, pool=P)
    assert h.pool_info(P)["pinned_pages"] <= 5 + 3 + 1  # served from the pool's own memory
    assert h.sim_is_accessible(again, PAGE)
    assert_ok(h)


def test_what_a_paused_pool_refuses(make_heap):
    h = make_heap(capacity=64 * MiB)
    (a,) = setup_pool(h, sizes=(PAGE,))
    h.pool_pause(P)
    with pytest.raises(RuntimeError, match="already paused"):
        h.pool_pause(P)
    with pytest.raises(RuntimeError, match="GM_EPAUSED"):
        h.malloc(512, pool=P)
    with pytest.raises(RuntimeError, match="paused; resume it"):
        h.pool_release(P)
    assert h.pool_info(P)["use_count"] == 1
    h.pool_retain(P)  # a use_mem_pool around a refused allocation: uses come and go
    h.pool_release(P)
    assert h.pool_info(P)["use_count"] == 1 and h.pool_info(P)["paused"]
    with pytest.raises(RuntimeError, match="GM_EPAUSED"):
        h.pool_set_live(P, [])
    assert h.block_size(a) == PAGE
    h.pool_resume(P)
    with pytest.raises(RuntimeError, match="not paused"):
        h.pool_resume(P)
    h.pool_release(P)
    assert_ok(h)


def test_bad_arguments(make_heap):
    h = make_heap(capacity=64 * MiB)
    with pytest.raises(ValueError, match="no pool"):
        h.pool_pause(Q)
    with pytest.raises(ValueError, match="no pool"):
        h.pool_resume(Q)
    with pytest.raises((TypeError, ValueError)):
        h.pool_pause(5)
    with pytest.raises(ValueError):
        h.pool_pause((0, 0))


def test_no_pause_or_resume_during_a_capture(make_heap):
    h = make_heap(capacity=64 * MiB)
    setup_pool(h, sizes=(2 * PAGE,))
    h.capture_begin()
    with pytest.raises(RuntimeError, match="GM_ECAPTURING"):
        h.pool_pause(P)
    h.capture_end()
    h.sim_set_capture(True)
    with pytest.raises(RuntimeError, match="GM_ECAPTURING"):
        h.pool_pause(P)
    h.sim_set_capture(False)
    h.pool_pause(P)
    h.sim_set_stream_capture(0, True)
    with pytest.raises(RuntimeError, match="GM_ECAPTURING"):
        h.pool_resume(P)
    h.sim_set_stream_capture(0, False)
    assert h.sim_capture_violations() == 0
    h.pool_resume(P)
    assert_ok(h)


def test_closing_a_heap_with_a_paused_pool(make_heap):
    h = make_heap(capacity=64 * MiB)
    setup_pool(h)
    h.pool_pause(P, backup=True)
    h.close()  # frees the backup and everything else; ASan runs of the suite would see a leak


def test_stats_and_snapshot_while_paused(make_heap):
    h = make_heap(capacity=128 * MiB)
    blocks = setup_pool(h)
    before = h.stats()
    r = h.pool_pause(P)
    st = h.stats()
    assert st["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert st["reserved_bytes.all.current"] == before["reserved_bytes.all.current"] - r["bytes"]
    assert st["num_device_free"] - before["num_device_free"] == r["pages"]
    snap = h.snapshot()
    base = snap["va_base"]
    states = [snap["pages"][p] for b in blocks for p in pages_of(b - base, h.block_size(b))]
    assert states.count(3) == r["pages"]  # GM_PAGE_PAUSED
    paused = sorted({p for p, state in enumerate(snap["pages"]) if state == 3})
    assert states.count(1) == r["shared_pages"]
    view = gpumem.Snapshot.from_heap(h)
    assert sum(s == "paused" for s in map(view.page_state, range(len(view.pages)))) == r["pages"]
    assert view.segments  # the pool's blocks still lie in whole runs
    assert view.summary.mapped_bytes == st["reserved_bytes.all.current"] - h.snapshot()["spare_pages"] * PAGE
    rep = h.memory_report()
    assert rep["reserved_bytes"] == st["reserved_bytes.all.current"]
    assert rep["cached_bytes"] <= rep["reserved_bytes"]
    h.pool_resume(P)
    st = h.stats()
    assert st["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    # one device allocation per contiguous run of the pool's released pages
    runs = sum(1 for i, p in enumerate(paused) if i == 0 or paused[i - 1] != p - 1)
    assert st["num_device_alloc"] - before["num_device_alloc"] == runs


# ---- device failures --------------------------------------------------------------------


@pytest.mark.parametrize("op", ["synchronize", "host_alloc", "copy_dtoh", "unmap"])
def test_a_failed_pause_changes_nothing(make_heap, op):
    h = make_heap(capacity=64 * MiB)
    (a,) = setup_pool(h, sizes=(4 * PAGE,))
    h.sim_write(a, 9)
    free0 = dev_free(h)
    h.sim_fail(op)
    with pytest.raises((gpumem.DeviceError, gpumem.OutOfMemoryError)):
        h.pool_pause(P, backup=True)
    assert not h.pool_info(P)["paused"]
    assert dev_free(h) == free0 and h.sim_read(a) == 9
    assert h.sim_host_blocks() == 0
    assert_ok(h)
    h.pool_pause(P, backup=True)
    h.pool_resume(P)
    assert h.sim_read(a) == 9
    assert_ok(h)


def test_a_failed_release_keeps_the_page_as_a_spare(make_heap):
    h = make_heap(capacity=64 * MiB)
    setup_pool(h, sizes=(4 * PAGE,))
    free0 = dev_free(h)
    h.sim_fail("release", 2)
    r = h.pool_pause(P)
    assert r["pages"] == 4
    assert dev_free(h) - free0 == 3 * PAGE  # one page stayed with the heap
    assert_ok(h)
    h.empty_cache()
    assert dev_free(h) - free0 == 4 * PAGE
    h.pool_resume(P)
    assert_ok(h)


def test_a_pause_that_fails_part_way_leaves_the_pool_paused(make_heap):
    h = make_heap(capacity=64 * MiB)
    h.pool_retain(P)
    w = h.malloc(2 * PAGE)
    h.malloc(4096)  # general: separates the pool's two runs of pages
    h.free(w)
    a = h.malloc(2 * PAGE, pool=P)  # w's pages
    b = h.malloc(2 * PAGE, pool=P)  # after the general block
    h.sim_fail("unmap", 2)  # the second run will not unmap
    with pytest.raises(gpumem.DeviceError, match="paused with the 2 pages released before the failure"):
        h.pool_pause(P)
    info = h.pool_info(P)
    assert info["paused"] and info["paused_pages"] == 2  # a's pages
    assert not h.sim_is_accessible(a, PAGE)
    assert h.sim_is_accessible(b, 2 * PAGE)
    assert_ok(h)
    h.pool_resume(P)
    assert not h.pool_info(P)["paused"]
    assert_ok(h)


def test_a_refused_chunk_resumes_with_single_pages(make_heap):
    h = make_heap(capacity=128 * MiB)
    a, _, values = paused_with_values(h, 6, 40)
    st = h.stats()
    h.sim_fail("create", 1)  # the one 6-page allocation: the device says it is full
    h.pool_resume(P)
    assert h.stats()["num_device_alloc"] - st["num_device_alloc"] == 6
    assert read_pages(h, a, 6) == values
    assert_ok(h)


@pytest.mark.parametrize("op,nth,count", [("create", 1, 100), ("map", 1, 1), ("set_access", 1, 1), ("copy_htod", 1, 1)])
def test_a_failed_resume_unwinds_to_fully_paused(make_heap, op, nth, count):
    h = make_heap(capacity=128 * MiB)
    a, r, values = paused_with_values(h, 6, 40)
    free_paused = dev_free(h)
    h.sim_fail(op, nth, count)
    with pytest.raises((gpumem.DeviceError, gpumem.OutOfMemoryError)):
        h.pool_resume(P)
    h.sim_fail(op, 0)  # the device works again
    info = h.pool_info(P)
    assert info["paused"] and info["paused_pages"] == r["pages"]
    assert not h.sim_is_accessible(a, PAGE)
    assert dev_free(h) == free_paused  # the pages gathered went back
    assert_ok(h)
    h.pool_resume(P)
    assert read_pages(h, a, 6) == values
    assert_ok(h)


def test_random_faults_on_every_op_keep_the_heap_consistent(make_heap):
    h = make_heap(capacity=160 * MiB)
    for i, op in enumerate(gpumem._C.DEVICE_OPS):
        if op in ("reserve", "unreserve", "mem_info", "processes"):
            continue
        h.sim_fail_random(op, 0.15, seed=i + 1)
    h.pool_retain(P)
    h.pool_retain(Q)
    live = []
    for step in range(300):
        k = step % 7
        try:
            if k in (0, 1):
                live.append(h.malloc((step * 7919) % (5 * MiB) + 512, pool=P if k == 0 else None))
            elif k == 2 and live:
                h.free(live.pop((step * 31) % len(live)))
            elif k == 3:
                h.pool_pause(P, backup=bool(step % 2))
            elif k == 4:
                h.pool_resume(P)
            elif k == 5:
                live.append(h.malloc(PAGE, pool=Q))
            else:
                h.empty_cache()
        except (gpumem.DeviceError, gpumem.OutOfMemoryError, RuntimeError):
            pass
        assert_ok(h)
    for op in gpumem._C.DEVICE_OPS:
        h.sim_fail(op, 0)
        h.sim_fail_random(op, 0.0)
    if h.pool_info(P)["paused"]:
        h.pool_resume(P)
    assert_ok(h)


def test_sizes(make_heap):
    """A pool of many pages pauses and resumes in runs, not page by page."""
    h = make_heap(capacity=8 * GiB)
    h.pool_retain(P)
    blocks = [h.malloc(64 * MiB, pool=P) for _ in range(40)]
    h.malloc(512)
    maps0, access0, unmaps0 = h.sim_calls("map"), h.sim_calls("set_access"), h.sim_calls("unmap")
    r = h.pool_pause(P, backup=True)
    assert r["pages"] == 40 * 32
    runs = h.sim_calls("unmap") - unmaps0
    assert runs <= 2  # one call per contiguous run
    maps0 = h.sim_calls("map")
    h.pool_resume(P)
    # one device allocation per 1024 pages (GM_CHUNK_PAGES_MAX) of each run, not one per page
    maps = h.sim_calls("map") - maps0
    assert maps == 2 if runs == 1 else 2 <= maps <= 3
    assert h.sim_calls("set_access") - access0 <= 2
    assert all(h.sim_is_accessible(b, 64 * MiB) for b in blocks)
    assert_ok(h)


# ---- the torch layer, without a GPU -----------------------------------------------------


def test_torch_layer_refuses_without_install_and_bad_pools():
    import gpumem.torch as gt

    with pytest.raises(RuntimeError, match="not torch's allocator"):
        gpumem.pause((0, 5))
    with pytest.raises(RuntimeError, match="not torch's allocator"):
        gpumem.resume((0, 5))
    with pytest.raises(TypeError, match="MemPool or a pool id"):
        gt._pause._pool_and_device("pool", 0)
    with pytest.raises(TypeError, match="MemPool or a pool id"):
        gt._pause._pool_and_device((1, -2), 0)
    with pytest.raises(ValueError, match="names no pool"):
        gt._pause._pool_and_device((0, 0), 0)

    class Pool:  # what torch.cuda.MemPool / gpumem's MemPool look like
        id = (0, 9)
        device = 1

    assert gt._pause._pool_and_device(Pool(), None) == ((0, 9), 1)
    assert gt._pause._pool_and_device((3, 4), 2) == ((3, 4), 2)


def test_torch_heap_pause_and_resume_on_a_simulated_device():
    """The Heap that borrows torch's heap pauses and resumes its pools, on a sim-backed torch heap."""
    from helpers import run_torch_sim as run_py

    r = run_py(
        """
        _C.registry_heap(0).pool_retain((0, 5))
        begin(0, 0, 5, ANY)
        p = alloc(10 * MiB, 0, None)
        try:  # an open begin counts as a capture
            _C.registry_heap(0).pool_pause((0, 5))
            capturing = "no error"
        except RuntimeError as e:
            capturing = str(e)
        end(0, 0, 5)
        a = _C.registry_heap(0).pool_pause((0, 5), True)
        info = _C.registry_heap(0).pool_info((0, 5))
        errs = []
        _C.registry_heap(0).pool_release((0, 5))  # begin's use: uses may come and go while paused
        for fn in (lambda: _C.registry_heap(0).pool_pause((0, 5)), lambda: _C.registry_heap(0).pool_release((0, 5)),
                   lambda: _C.registry_heap(0).pool_resume((0, 6)), lambda: _C.registry_heap(0).pool_pause((0, 6))):
            try:
                fn()
            except (RuntimeError, ValueError) as e:
                errs.append(type(e).__name__ + ": " + str(e))
        check()
        b = _C.registry_heap(0).pool_resume((0, 5))
        try:
            _C.registry_heap(0).pool_resume((0, 5))
        except RuntimeError as e:
            errs.append(str(e))
        check()
        out(a=a, b=b, capturing=capturing, paused=info["paused"], paused_pages=info["paused_pages"], errs=errs,
            after=_C.registry_heap(0).pool_info((0, 5))["paused"])
        """
    )
    assert "GM_ECAPTURING" in r["capturing"], r["capturing"]
    assert r["a"]["pages"] == 5 and r["a"]["backup_bytes"] == 10 * MiB
    assert r["b"]["pages"] == 5 and r["b"]["backup_bytes"] == 10 * MiB
    assert r["paused"] and r["paused_pages"] == 5 and not r["after"]
    e = r["errs"]
    assert "already paused (GM_EPAUSED)" in e[0] and "paused" in e[1]
    assert e[2].startswith("ValueError") and e[3].startswith("ValueError")
    assert "not paused" in e[4]


# torch calls its releasePool hook from CUDAGraph::reset(), which ~CUDAGraph
# calls: an exception escaping it ends the process (std::terminate).  A graph
# deleted while its pool is paused must leave the pool paused, not abort.
GRAPH_DTOR = r"""
#include <cstdint>
#include <functional>
#include <utility>
using Pool = std::pair<unsigned long long, unsigned long long>;
using Release = void(int, Pool);
struct Graph {  /* ~CUDAGraph -> reset() -> releasePool(device, id) */
    std::function<Release> release;
    int device;
    Pool id;
    ~Graph() { release(device, id); }
};
extern "C" void delete_graph(uint64_t addr, int device, uint64_t a, uint64_t b) {
    Graph g{reinterpret_cast<Release *>(addr), device, Pool{a, b}};
}
"""


def test_a_graph_deleted_while_its_pool_is_paused_leaves_it_paused(tmp_path):
    import shutil
    import subprocess

    from helpers import run_torch_sim as run_py

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src, lib = tmp_path / "graph.cpp", tmp_path / "graph.so"
    src.write_text(GRAPH_DTOR)
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={gpumem._C._torch_cxx11_abi()}"
    subprocess.run([cxx, "-std=c++17", "-shared", "-fPIC", abi, str(src), "-o", str(lib)], check=True, timeout=300)
    r = run_py(f"""
        graph = ctypes.CDLL({str(lib)!r})
        graph.delete_graph.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]
        ep = _C._torch_entry_points()
        _C.registry_heap(0).pool_retain((9, 0))  # the graph's use (begin's use is released at its end)
        begin(0, 9, 0, ANY)
        p = alloc(6 * MiB, 0, None)
        end(0, 9, 0)
        release(0, 9, 0)
        _C.registry_heap(0).pool_pause((9, 0))
        graph.delete_graph(ep["release_pool"], 0, 9, 0)  # aborted the process before the fix
        info = _C.registry_heap(0).pool_info((9, 0))
        check()
        _C.registry_heap(0).pool_resume((9, 0))  # the id still names it: it can be resumed and ended
        free(p, 0, 0, 0)
        _C.registry_heap(0).pool_release((9, 0))
        check()
        out(paused=info["paused"], use_count=info["use_count"], after=_C.registry_heap(0).pools())
    """)
    assert r["paused"] and r["use_count"] == 1 and r["after"] == []


def test_torch_layer_takes_the_device_as_torch_spells_it():
    torch = pytest.importorskip("torch")
    import gpumem.torch as gt

    pd = gt._pause._pool_and_device
    assert pd((1, 2), "cuda:1") == ((1, 2), 1)  # was taken for the current device
    assert pd((1, 2), torch.device("cuda", 3)) == ((1, 2), 3)
    assert pd((1, 2), 2) == ((1, 2), 2)
    for bad in (True, -1, "cpu", 1.0):
        with pytest.raises((TypeError, ValueError), match="device"):
            pd((1, 2), bad)
