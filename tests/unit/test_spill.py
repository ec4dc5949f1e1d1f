"""Spill: host-located pages behind the heap's own addresses when the device is full.

On the simulated device, whose pages each hold one value (sim_write / sim_read)
and which gives host pages (create_host) from a limit of their own: a request
the device cannot serve is served with host pages (spill_choice "new") or by
moving the oldest live blocks' pages to the host behind the same addresses
("old"); contents survive the way out and back; host pages that hold nothing
are unmapped at once; everything comes back when the device has room (a free,
empty_cache, unspill).  Past the limit, during a capture, or when a device call
fails, out of memory as before, and the invariant checker (C16) agrees after
every step.
"""

import pytest

import gpumem
from helpers import PAGE, assert_ok, chunk_with_a_hole

CAP = 32 * PAGE  # the simulated device: 64 MiB


def heap(spill="64MiB", choice="old", **kw):
    return gpumem.Heap(device="sim", capacity=CAP, spill=spill, spill_choice=choice, **kw)


def spilled(h):
    return h.stats()["spilled_bytes.all.current"]


def fill(h, n=8, size=4 * PAGE):
    """n blocks of `size` filling the device, page k of block i holding 1000 * i + k."""
    blocks = [h.malloc(size) for _ in range(n)]
    for i, b in enumerate(blocks):
        for k in range(size // PAGE):
            h.sim_write(b + k * PAGE, 1000 * i + k)
    return blocks


def values(h, b, size=4 * PAGE):
    return [h.sim_read(b + k * PAGE) for k in range(size // PAGE)]


def code(name):
    return {v: k for k, v in gpumem._C.ERROR_NAMES.items()}[name]


def on_host(h, addr):
    """Whether the page at addr lies in host memory, as the snapshot says."""
    snap = h.snapshot()
    return bool(snap["host"][(addr - snap["va_base"]) // PAGE])


# ---- out of memory, spill off, past the limit ------------------------------------------


def test_without_spill_the_device_is_the_end():
    with gpumem.Heap(device="sim", capacity=CAP) as h:
        fill(h)
        with pytest.raises(gpumem.OutOfMemoryError) as exc:
            h.malloc(2 * PAGE)
        assert "spilled to host memory" not in str(exc.value) and "in host memory (spilled)" not in str(exc.value)
        assert h.last_oom()["spill_limit"] == 0 and h.last_oom()["spill_error"] == 0
        assert_ok(h)


@pytest.mark.parametrize("choice", ["old", "new"])
def test_a_request_past_the_device_is_served(choice):
    with heap(choice=choice) as h:
        blocks = fill(h)
        x = h.malloc(2 * PAGE)
        h.sim_write(x, 77)
        assert h.sim_read(x) == 77
        assert spilled(h) >= 2 * PAGE
        assert h.stats()["num_spills"] == 1
        assert h.stats()["reserved_bytes.all.current"] <= CAP  # host pages are not the device's
        assert h.sim_info()["host_pages"] == spilled(h) // PAGE
        assert [values(h, b) for b in blocks] == [[1000 * i + k for k in range(4)] for i in range(8)]
        assert_ok(h)


def test_past_the_limit_out_of_memory_says_what_is_spilled():
    with heap(spill="4MiB", choice="new") as h:
        fill(h)
        h.malloc(2 * PAGE)  # the whole limit
        with pytest.raises(gpumem.OutOfMemoryError) as exc:
            h.malloc(PAGE)
        assert "4.00 MiB is spilled to host memory (limit 4.00 MiB); the request would pass the limit." in str(
            exc.value
        )
        oom = h.last_oom()
        assert oom["spilled_bytes"] == 2 * PAGE and oom["spill_limit"] == 2 * PAGE
        assert oom["spill_error"] == code("GM_ENOMEM")
        assert_ok(h)


def test_the_host_refusing_is_out_of_memory():
    with heap(choice="new", host_capacity=PAGE) as h:
        fill(h)
        with pytest.raises(gpumem.OutOfMemoryError, match="spilled to host memory .*the host refused"):
            h.malloc(2 * PAGE)
        assert spilled(h) == 0 and h.sim_info()["host_pages"] == 0
        assert_ok(h)


def test_no_room_in_the_address_range_is_out_of_memory_that_says_so():
    """Host pages go in the heap's unmapped address space: a range of 64 pages
    with 32 mapped has no room for 40 more, though the limit allows them."""
    with heap(spill="128MiB", choice="new", va_size=64 * PAGE) as h:
        fill(h)
        with pytest.raises(gpumem.OutOfMemoryError, match="address range has no unmapped room"):
            h.malloc(40 * PAGE)
        assert h.last_oom()["spill_error"] == code("GM_EINVAL") and spilled(h) == 0
        h.malloc(30 * PAGE)  # what the range has room for is served
        assert spilled(h) == 30 * PAGE
        assert_ok(h)


def test_options_are_checked():
    with pytest.raises(ValueError, match='spill_choice must be "old", "new" or "lasting"'):
        heap(choice="newest")
    with heap(spill="off") as h:
        fill(h)
        with pytest.raises(gpumem.OutOfMemoryError):
            h.malloc(PAGE)
    with pytest.raises(ValueError, match="host_capacity applies to the sim device only"):
        gpumem.Heap(device="cuda", host_capacity=PAGE)


# ---- the OOM report: the device's pages only --------------------------------------------


def test_an_oom_report_counts_only_the_devices_pages_locked_in_chunks():
    """The oldest block's chunk, with its two free pages, moves to the host;
    the request still does not fit and the limit allows no more.  Those free
    pages are host memory: no cache of the device's, and no obstacle to the 4
    pages the device has free."""
    with heap(spill="8MiB", choice="old", chunk_pages=4) as h:
        a = chunk_with_a_hole(h)
        h.malloc(28 * PAGE)  # the device is full
        with pytest.raises(gpumem.OutOfMemoryError):
            h.malloc(6 * PAGE)
        assert on_host(h, a) and spilled(h) == 4 * PAGE
        oom = h.last_oom()
        assert oom["cached_bytes"] == 0 and oom["device_free"] == 4 * PAGE
        assert oom["chunk_locked_bytes"] == 0
        assert oom["largest_possible"] == 4 * PAGE
        x = h.malloc(oom["largest_possible"])
        assert not on_host(h, x) and spilled(h) == 4 * PAGE
        assert_ok(h)


def test_a_report_takes_no_free_host_page_for_a_movable_one():
    """With device pages locked in a chunk, a free run makes its unmapped part
    from the device's movable pages; free host pages (left mapped by a free
    during a capture) are none of those.  The 3 free host pages and the 3
    pages that the device's cached ones give above them make 6."""
    with heap(choice="new", chunk_pages=4) as h:
        chunk_with_a_hole(h)
        b = h.malloc(3 * PAGE)
        h.malloc(25 * PAGE)  # the device is full
        x = h.malloc(3 * PAGE)
        assert on_host(h, x)
        h.capture_begin()
        h.free(x)
        h.free(b)
        h.capture_end()
        r = h.memory_report(16 * PAGE)
        assert r["chunk_locked_bytes"] == 2 * PAGE and r["spilled_bytes"] == 3 * PAGE
        assert r["largest_possible"] == 6 * PAGE
        y = h.malloc(r["largest_possible"])
        assert y == x and h.stats()["num_spills"] == 1  # defragmentation, no second spill
        assert_ok(h)


def test_free_host_pages_inside_a_run_serve_where_the_runs_ends_need_too_many_pages():
    """Free host pages (left mapped by a free during a capture) between unmapped
    stretches: under a cap that allows 2 new pages, a 4-page request fits only
    over them, with 2 new pages beside; either end of the run would need 4.
    The spill limit is spent, so the request is placed there or not at all."""
    with heap(spill="4MiB", choice="new", chunk_pages=4) as h:
        a = h.malloc(20 * PAGE)
        g = h.malloc(12 * PAGE)  # the device is full
        x = h.malloc(2 * PAGE)
        assert on_host(h, x) and x == a + 32 * PAGE
        h.capture_begin()
        h.free(x)
        h.capture_end()
        h.free(g)
        h.set_cap(22 * PAGE)  # g's pages go back: unmapped below x, and the top above it
        assert h.stats()["reserved_bytes.all.current"] == 20 * PAGE and spilled(h) == 2 * PAGE
        y = h.malloc(4 * PAGE)
        assert y in (x - 2 * PAGE, x)
        assert h.stats()["num_spills"] == 1 and h.stats()["reserved_bytes.all.current"] == 22 * PAGE
        assert_ok(h)


# ---- the two choices ----------------------------------------------------------------------


def test_old_moves_the_oldest_blocks_behind_the_same_addresses():
    with heap(choice="old") as h:
        blocks = fill(h)
        x = h.malloc(6 * PAGE)
        # The two oldest blocks (8 pages) went, though 6 would do: whole blocks move.
        assert [on_host(h, b) for b in blocks] == [True, True] + [False] * 6
        assert not on_host(h, x)
        assert spilled(h) == 8 * PAGE
        assert values(h, blocks[0]) == [0, 1, 2, 3] and values(h, blocks[1]) == [1000, 1001, 1002, 1003]
        assert_ok(h)


def test_new_puts_the_request_itself_on_whole_host_pages():
    with heap(choice="new") as h:
        blocks = fill(h)
        x = h.malloc(PAGE + 512)
        assert on_host(h, x) and not any(on_host(h, b) for b in blocks)
        assert h.block_size(x) == 2 * PAGE  # whole pages: no free rest on them for others
        assert spilled(h) == 2 * PAGE
        assert_ok(h)


def test_old_falls_back_to_new_for_a_request_larger_than_the_device():
    with heap(choice="old", spill="128MiB") as h:
        blocks = fill(h, n=2)
        x = h.malloc(CAP + PAGE)
        assert on_host(h, x) and not any(on_host(h, b) for b in blocks)
        assert spilled(h) == CAP + PAGE
        assert_ok(h)


# ---- return -----------------------------------------------------------------------------


def test_freeing_a_host_block_unmaps_its_pages_and_the_device_serves_next():
    with heap(choice="new") as h:
        blocks = fill(h)
        x = h.malloc(2 * PAGE)
        h.free(x)
        # unmapped, but kept for the next spill: the demand (34 pages) exceeds the cap
        assert spilled(h) == 0 and h.sim_info()["host_mapped"] == 0 and h.sim_info()["host_pages"] == 2
        h.free(blocks[3])
        y = h.malloc(2 * PAGE)  # the fast path: device pages, not the host ones
        assert not on_host(h, y)
        h.empty_cache()  # kept host chunks go
        assert h.sim_info()["host_pages"] == 0
        assert_ok(h)


def test_what_is_spilled_comes_back_once_the_demand_fits():
    """Not at a dip: the peak of what is live since the peak was reset (38
    pages here) must fit under the cap with the slack; resetting the peak once
    the demand dropped brings everything back."""
    with heap(choice="old") as h:
        blocks = fill(h)
        x = h.malloc(6 * PAGE)
        assert spilled(h) == 8 * PAGE
        h.free(x)
        h.free(blocks[7])  # 28 pages live: room now, but the peak says the loop needs more
        assert spilled(h) == 8 * PAGE and h.stats()["num_unspills"] == 0
        h.reset_peak_stats()  # the demand starts over from what is live: it fits
        assert spilled(h) == 0 and h.stats()["num_unspills"] >= 1
        assert [values(h, b) for b in blocks[:7]] == [[1000 * i + k for k in range(4)] for i in range(7)]
        assert not on_host(h, blocks[0])
        assert_ok(h)


def step(h, acts=7, size=4 * PAGE):
    """One training step's activations: allocated, then freed in reverse."""
    xs = [h.malloc(size) for _ in range(acts)]
    for x in reversed(xs):
        h.free(x)


def per_step(h, steps):
    """(spills, returns, device waits, host chunks created, copies) of each step."""
    rows = []
    for _ in range(steps):
        st0 = h.stats()
        c0 = {op: h.sim_calls(op) for op in ("synchronize", "create_host", "copy_dtod")}
        step(h)
        st = h.stats()
        rows.append(
            (st["num_spills"] - st0["num_spills"], st["num_unspills"] - st0["num_unspills"])
            + tuple(h.sim_calls(op) - c0[op] for op in c0)
        )
    return rows


def test_a_loop_past_the_cap_spills_once_and_then_moves_nothing():
    """Weights (12 pages) and a step of 28 pages of activations: 1.25x the
    device.  The first step moves the oldest blocks out; they stay out while
    the loop runs (no return at each step's dip, no spill at its next peak),
    intact, and come back after the peak reset once the demand dropped."""
    with heap(choice="old") as h:
        weights = fill(h, n=3)
        rows = per_step(h, 5)
        assert rows[0][0] >= 1 and rows[0][3] >= 1  # the first step spilled
        assert rows[1:] == [(0, 0, 0, 0, 0)] * 4  # then: no spill, no return, no device call
        assert spilled(h) > 0
        assert [values(h, b) for b in weights] == [[1000 * i + k for k in range(4)] for i in range(3)]
        h.reset_peak_stats()  # 12 pages live: the demand fits
        assert spilled(h) == 0 and h.sim_info()["host_pages"] == 0
        assert [values(h, b) for b in weights] == [[1000 * i + k for k in range(4)] for i in range(3)]
        assert_ok(h)


def test_new_keeps_its_host_chunks_across_the_steps_of_a_loop_past_the_cap():
    """With "new", each step's requests past the device get host pages; freed,
    they are unmapped but kept while the demand exceeds the cap, and the next
    step maps them again: no host chunk is created after the first step.
    Once the demand fits (the peak reset with less live), they go."""
    with heap(choice="new") as h:
        weights = fill(h, n=3)
        rows = per_step(h, 5)
        assert rows[0][3] >= 1  # the first step created host chunks
        assert [r[3] for r in rows[1:]] == [0] * 4  # the others reused them
        assert all(r[0] == rows[0][0] for r in rows)  # the same requests spilled, each step
        assert spilled(h) == 0 and h.sim_info()["host_pages"] == 8  # two requests of 4 pages, kept
        assert [values(h, b) for b in weights] == [[1000 * i + k for k in range(4)] for i in range(3)]
        h.reset_peak_stats()  # 12 pages live: the demand fits
        assert h.sim_info()["host_pages"] == 0
        assert_ok(h)


def test_a_loop_past_the_cap_returns_everything_at_empty_cache():
    with heap(choice="old") as h:
        weights = fill(h, n=3)
        per_step(h, 3)
        assert spilled(h) > 0
        h.empty_cache()
        assert spilled(h) == 0 and h.sim_info()["host_pages"] == 0
        assert [values(h, b) for b in weights] == [[1000 * i + k for k in range(4)] for i in range(3)]
        assert_ok(h)


def test_a_batch_of_moves_waits_for_the_device_once():
    """Eight chunks go out and come back with one device wait for all their
    copies (the simulated device refuses an unmap while a copy may run):
    besides it, the slow path's own waits only (its defragmentation's, and
    the idle device a move needs)."""
    with heap(choice="old") as h:
        blocks = fill(h)
        calls = lambda: (h.sim_calls("synchronize"), h.sim_calls("copy_dtod"))  # noqa: E731
        s0, c0 = calls()
        x = h.malloc(6 * PAGE)
        s1, c1 = calls()
        assert spilled(h) == 8 * PAGE and c1 - c0 == 8  # eight single pages moved
        assert s1 - s0 == 3
        h.free(x)
        h.free(blocks[7])
        assert h.unspill() is True
        s2, c2 = calls()
        assert c2 - c1 == 8 and s2 - s1 == 2  # the unspill's wait, then the copies'
        assert [values(h, b) for b in blocks[:7]] == [[1000 * i + k for k in range(4)] for i in range(7)]
        assert_ok(h)


def test_unspill_and_empty_cache_return_what_fits():
    with heap(choice="old") as h:
        blocks = fill(h)
        h.malloc(6 * PAGE)
        assert h.unspill() is False  # room for the two spare pages only: the rest stays, intact
        assert spilled(h) == 6 * PAGE and h.stats()["num_unspills"] == 2
        assert values(h, blocks[0]) == [0, 1, 2, 3] and values(h, blocks[1]) == [1000, 1001, 1002, 1003]
        assert_ok(h)


@pytest.mark.parametrize("how", ["empty_cache", "unspill"])
def test_empty_cache_and_unspill_return_what_is_spilled(how):
    with heap(choice="old") as h:
        blocks = fill(h)
        h.free(h.malloc(6 * PAGE))
        assert spilled(h) == 8 * PAGE  # the free found no room under the slack
        if how == "empty_cache":
            h.empty_cache()
        else:
            assert h.unspill() is True
        assert spilled(h) == 0 and h.sim_info()["host_pages"] == 0
        assert [values(h, b) for b in blocks] == [[1000 * i + k for k in range(4)] for i in range(8)]
        assert_ok(h)


# ---- visibility -------------------------------------------------------------------------


def test_stats_snapshot_and_history_show_it():
    with heap(choice="old") as h:
        h.history_enable(1000)
        blocks = fill(h)
        x = h.malloc(6 * PAGE)
        st = h.stats()
        assert st["spilled_bytes.all.current"] == st["spilled_bytes.all.peak"] == 8 * PAGE
        actions = [e[1] for e in h.history()[0]]
        assert actions.count("spill") == 8  # one per chunk moved: single pages here
        snap = gpumem.snapshot(h)
        where = {s["address"]: s["location"] for s in snap.to_torch()["segments"]}
        assert where[blocks[0]] == "host" and where[x] == "device"
        assert snap.location(blocks[1], PAGE) == "host" and snap.location(blocks[2], PAGE) == "device"
        h.free(x)
        h.unspill()
        st = h.stats()
        assert st["spilled_bytes.all.current"] == 0 and st["spilled_bytes.all.peak"] == 8 * PAGE
        assert "unspill" in [e[1] for e in h.history()[0]]
        assert_ok(h)


# ---- capture and device failures --------------------------------------------------------


def test_no_spill_during_a_capture():
    with heap(choice="old") as h:
        blocks = fill(h)
        h.capture_begin()
        h.sim_set_capture(True)
        with pytest.raises(gpumem.OutOfMemoryError, match="spill is off during a CUDA graph capture"):
            h.malloc(PAGE)
        assert h.sim_capture_violations() == 0 and spilled(h) == 0
        assert h.last_oom()["spill_error"] == code("GM_ECAPTURING")
        h.sim_set_capture(False)
        h.capture_end()
        h.malloc(PAGE)  # after it, spill serves
        assert spilled(h) == 4 * PAGE and values(h, blocks[0]) == [0, 1, 2, 3]
        assert_ok(h)


def test_a_free_during_a_capture_waits_to_give_host_pages_back():
    with heap(choice="new") as h:
        fill(h)
        x = h.malloc(2 * PAGE)
        h.capture_begin()
        h.sim_set_capture(True)
        h.free(x)  # no device wait, no unmap while the graph is captured
        assert h.sim_capture_violations() == 0 and spilled(h) == 2 * PAGE
        h.sim_set_capture(False)
        h.capture_end()
        assert_ok(h)
        assert h.unspill() is True and spilled(h) == 0  # nothing live was there: unmapped
        assert_ok(h)


def test_unspill_during_a_capture_is_refused():
    with heap(choice="old") as h:
        fill(h)
        h.malloc(PAGE)
        h.capture_begin()
        with pytest.raises(RuntimeError, match="GM_ECAPTURING"):
            h.unspill()
        h.capture_end()
        assert spilled(h) == 4 * PAGE
        assert_ok(h)


@pytest.mark.parametrize("op", ["create_host", "map", "set_access", "copy_dtod", "unmap"])
@pytest.mark.parametrize("choice", ["old", "new"])
def test_a_failing_device_call_while_spilling_leaves_the_heap_whole(op, choice):
    """Old falls back to new when moving fails; whatever fails, nothing is lost."""
    with heap(choice=choice) as h:
        blocks = fill(h)
        h.sim_fail(op, 1, 1 if op == "unmap" else 1000)  # an unmap is asked again
        try:
            h.malloc(PAGE)
            assert op in ("copy_dtod", "unmap")  # only what the request alone needs not
            assert choice == "new" or h.stats()["num_device_errors"] > 0
        except gpumem.OutOfMemoryError as exc:
            assert op in ("create_host", "map", "set_access")
            assert "spilled to host memory" in str(exc)
            assert h.last_oom()["spill_error"] in (code("GM_ENOMEM"), code("GM_EDEVICE"))
        assert_ok(h)
        assert [values(h, b) for b in blocks] == [[1000 * i + k for k in range(4)] for i in range(8)]
        h.sim_fail(op, 0)
        x = h.malloc(PAGE)
        h.sim_write(x, 5)
        assert spilled(h) > 0 and h.sim_read(x) == 5
        assert_ok(h)


@pytest.mark.parametrize("op", ["create", "map", "set_access", "copy_dtod", "unmap", "release"])
def test_a_failing_device_call_while_returning_leaves_the_heap_whole(op):
    with heap(choice="old") as h:
        blocks = fill(h)
        h.free(h.malloc(6 * PAGE))
        h.sim_fail(op, 1, 1)
        try:
            h.unspill()
        except gpumem.DeviceError as exc:
            assert op in str(exc) or "device call failed" in str(exc)
        assert_ok(h)
        assert [values(h, b) for b in blocks] == [[1000 * i + k for k in range(4)] for i in range(8)]
        h.sim_fail(op, 0)
        assert h.unspill() is True and spilled(h) == 0
        assert_ok(h)


# ---- options: install() and GPUMEM_CONF -------------------------------------------------


def test_install_options_reach_the_registry():
    from gpumem import _C
    from gpumem.torch._install import OptionError, normalize_options, parse_conf

    assert {"spill", "spill_choice"} <= set(parse_conf("spill:24GiB,spill_choice:new"))
    kw = normalize_options(parse_conf("spill:24GiB,spill_choice:new"))
    assert kw["spill"] == 24 << 30 and kw["spill_choice"] == "new"
    assert normalize_options({"spill": "off"})["spill"] == 0
    assert normalize_options({})["spill"] is None  # the core's default: off
    with pytest.raises(OptionError, match='spill_choice must be "old", "new" or "lasting"'):
        normalize_options({"spill_choice": "largest"})
    with pytest.raises(OptionError, match="spill"):
        normalize_options({"spill": "lots"})
    before = _C.registry_options()
    assert before["spill"] == 0 and before["spill_choice"] == "old"
    try:
        _C.registry_configure(spill=kw["spill"], spill_choice="new")
        assert _C.registry_options()["spill"] == 24 << 30 and _C.registry_options()["spill_choice"] == "new"
    finally:
        _C.registry_configure(spill=before["spill"], spill_choice=before["spill_choice"])
    assert _C.registry_options() == before


def test_a_request_past_the_cap_is_spilled_on_torchs_path():
    """torch's entry point refuses a request larger than the cap before the
    heap sees it; with spill on, the spill limit is the bound (a request
    larger than the cap goes whole to host pages)."""
    from helpers import TORCH_BOUNDARY, run_python

    prelude = "import json\nfrom gpumem import _C\nMiB = 1 << 20\n" + TORCH_BOUNDARY
    r = run_python(
        """
_C.registry_configure(cap_bytes=16 * MiB, spill=32 * MiB)
_C.registry_open_sim(0, 64 * MiB)
h = _C.registry_heap(0)
small = alloc(512, 0, None)
big = alloc(24 * MiB, 0, None)   # 1.5x the cap
st = h.stats()
h.check()
free(big, 24 * MiB, 0, None)
after = h.stats()["spilled_bytes.all.current"]
print("RESULT " + json.dumps(dict(spilled=st["spilled_bytes.all.current"], after=after)), flush=True)
""",
        prelude,
        timeout=120,
        unset=(),
    )
    assert r == {"spilled": 24 << 20, "after": 0}


# ---- what spill costs when it is not needed ---------------------------------------------


def device_calls(h):
    return {op: h.sim_calls(op) for op in gpumem._C.DEVICE_OPS}


def test_spill_on_with_room_makes_no_device_call():
    with heap(choice="old") as h:
        for _ in range(3):  # the working set's pages, once
            h.free(h.malloc(5 * PAGE))
        before = device_calls(h)
        for _ in range(100):
            blocks = [h.malloc(n * PAGE // 2) for n in (1, 3, 5)]
            for b in blocks:
                h.free(b)
        assert device_calls(h) == before
        assert h.stats()["num_spills"] == 0


def test_frees_while_spilled_ask_the_device_nothing_until_there_is_room():
    with heap(choice="old") as h:
        blocks = fill(h)
        h.malloc(6 * PAGE)
        small = [h.malloc(512) for _ in range(4)]  # on the device's last spare pages
        before = device_calls(h)
        for b in small:
            h.free(b)  # no host page, and live still needs more than the device: nothing to do
        assert device_calls(h) == before
        assert spilled(h) == 8 * PAGE
        assert values(h, blocks[0]) == [0, 1, 2, 3]
        assert_ok(h)


def test_a_pending_block_on_host_pages_goes_when_its_stream_is_done():
    with heap(choice="new") as h:
        fill(h)
        x = h.malloc(2 * PAGE)
        side = 0x5000
        h.record_stream(x, side)
        h.sim_hold_stream(side, True)
        h.free(x)  # pending: the side stream may still read it
        assert spilled(h) == 2 * PAGE
        assert_ok(h)
        h.sim_hold_stream(side, False)
        assert h.unspill() is True and spilled(h) == 0
        assert_ok(h)


def test_explain_says_what_is_spilled():
    with heap(spill="4MiB", choice="new") as h:
        fill(h)
        h.malloc(2 * PAGE)
        with pytest.raises(gpumem.OutOfMemoryError) as exc:
            h.malloc(PAGE)
        assert "of which in host memory (spilled)" in str(exc.value)
        assert "limit 4.00 MiB" in str(exc.value)


def test_history_of_a_request_placed_on_host_pages():
    with heap(choice="new") as h:
        fill(h)
        h.history_enable(1000)
        x = h.malloc(2 * PAGE)
        h.free(x)
        events = [
            (e[1], e[2], e[3]) for e in h.history()[0] if e[1] not in ("alloc", "free_requested", "free_completed")
        ]
        # host pages are not the heap's reserved memory: no map or unmap for them
        assert events == [("spill", x, 2 * PAGE), ("unspill", x, 2 * PAGE)]


def test_empty_cache_takes_no_host_page_for_a_cached_one():
    """Idle host pages (freed during a capture) are not cached device memory:
    trimming counts only the device's pages, and everything goes."""
    with heap(choice="new") as h:
        blocks = fill(h)
        x = h.malloc(2 * PAGE)
        h.capture_begin()
        for b in [*blocks, x]:
            h.free(b)
        h.capture_end()
        assert spilled(h) == 2 * PAGE  # nothing could go during the capture
        h.empty_cache()
        assert h.stats()["reserved_bytes.all.current"] == 0 and spilled(h) == 0
        assert h.sim_info()["pages_created"] == 0 and h.sim_info()["host_pages"] == 0
        assert_ok(h)


def test_a_pending_host_block_that_completes_is_not_handed_out():
    """A block on host pages freed with a record_stream use completes later; the
    next malloc unmaps its pages before the fast path looks, so it gets the
    device's free block, not the host one."""
    with heap(choice="new") as h:
        blocks = fill(h)
        x = h.malloc(2 * PAGE)
        side = 0x5000
        h.record_stream(x, side)
        h.sim_hold_stream(side, True)
        h.free(x)  # pending on host pages
        h.free(blocks[5])  # device room; the held stream keeps the device from a wait
        h.sim_hold_stream(side, False)
        y = h.malloc(2 * PAGE)  # x's pages would fit it best
        assert not on_host(h, y) and spilled(h) == 0
        assert_ok(h)


# ---- the forecast: how much a knob value would spill ------------------------------------------


def test_the_forecast_says_how_much_a_batch_would_spill():
    from test_forecast import Program, sim

    MiB = 1 << 20
    h = sim()
    p = Program(h, per_act=lambda k: 8 * MiB * k, acts=10)
    fc = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="batch")
    cap = fc.peak_live(8) + 64 * MiB  # batch 8 fits on the device; batch 16 needs more than the cap
    assert fc.spill(8, capacity=cap) == 0
    over = fc.peak_live(16) - cap
    for choice in ("old", "new"):
        spilled = fc.spill(16, capacity=cap, spill_choice=choice)
        # at least what does not fit, in whole pages; at most the step's own peak
        assert over <= spilled <= fc.peak_live(16), (choice, spilled, over)
    assert not fc.fits(16, capacity=cap)  # without spill it does not fit


# ---- the choice: what a training loop keeps ---------------------------------------------------


def train_loop(h, steps=3):
    """Weights (8 pages); each step 16 pages of activations and 8 of gradients,
    the activations freed, the optimizer's state (8 pages) made at the first
    step, the gradients freed: the device (32 pages) holds the first step, not
    the next ones (40 pages at their peak)."""
    weights = fill(h, n=2)
    state = []
    for _ in range(steps):
        acts = [h.malloc(4 * PAGE) for _ in range(4)]
        grads = [h.malloc(4 * PAGE) for _ in range(2)]
        for a in reversed(acts):
            h.free(a)
        if not state:
            state = [h.malloc(4 * PAGE) for _ in range(2)]
            for i, b in enumerate(state):
                for k in range(4):
                    h.sim_write(b + k * PAGE, 5000 + 1000 * i + k)
        for g in grads:
            h.free(g)
    return weights, state


@pytest.mark.parametrize("choice, moved", [("old", "weights"), ("lasting", "state")])
def test_lasting_moves_the_optimizers_state_and_old_the_weights(choice, moved):
    """ "lasting" takes the blocks live at the loop's last low point, the most
    recently made first: the optimizer's state (read once a step) rather than
    the weights (read in the forward and the backward), which "old" takes."""
    with heap(choice=choice) as h:
        weights, state = train_loop(h)
        assert spilled(h) == 8 * PAGE
        on = {name: [on_host(h, b) for b in blocks] for name, blocks in (("weights", weights), ("state", state))}
        assert on[moved] == [True, True] and not any(on["state" if moved == "weights" else "weights"]), on
        assert [values(h, b) for b in weights] == [[1000 * i + k for k in range(4)] for i in range(2)]
        assert [values(h, b) for b in state] == [[5000 + 1000 * i + k for k in range(4)] for i in range(2)]
        assert_ok(h)
