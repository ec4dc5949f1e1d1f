"""Hand-off between streams (stream.c, HAND-OFF) on the simulated device.

Memory one stream freed while its work still runs -- a block pending on a
record_stream use, or a free block of another stream whose release event has
not completed -- is handed to the requesting stream near the cap: the
requester is made to wait on the device (the simulated device then keeps its
later work behind the other stream's, `sim_stream_busy`), with no host wait
and no new pages.  A held stream stands for a kernel still running: a device
synchronisation would deadlock there, so the old path ran out of memory.
"""

import pytest

import gpumem
from helpers import MiB, assert_ok, assert_switch_option

MAIN, SIDE, THIRD = 0x1000, 0x2000, 0x3000
CAP = 64 * MiB


def full_heap(make_heap, **kw):
    """A heap whose cap holds 32 MiB kept live on stream 0 and one 32 MiB batch."""
    h = make_heap(capacity=CAP, pressure=0, **kw)
    keep = h.malloc(32 * MiB, stream=0)
    return h, keep


def pending_batch(h):
    """A batch made on SIDE, read on MAIN (record_stream), freed while MAIN still works."""
    x = h.malloc(32 * MiB, stream=SIDE)
    h.record_stream(x, MAIN)
    h.sim_hold_stream(MAIN, True)
    h.free(x)
    return x


def test_a_pending_block_goes_to_its_stream_near_the_cap(make_heap):
    h, _ = full_heap(make_heap)
    x = pending_batch(h)
    before = h.stats()
    assert not h.sim_stream_busy(SIDE)
    p = h.malloc(32 * MiB, stream=SIDE)  # the old path: a device wait, which a held stream refuses: OOM
    st = h.stats()
    assert p == x
    assert st["num_stream_handoffs"] == before["num_stream_handoffs"] + 1
    assert st["num_sync_all_streams"] == before["num_sync_all_streams"]
    assert st["reserved_bytes.all.peak"] == CAP  # no new pages
    assert_ok(h)
    # The device orders SIDE after MAIN's work: SIDE's later work waits until MAIN's is done.
    assert h.sim_stream_busy(SIDE)
    h.sim_hold_stream(MAIN, False)
    assert not h.sim_stream_busy(SIDE)
    h.free(p)
    assert_ok(h)


def test_another_streams_free_block_is_handed_over(make_heap):
    h, _ = full_heap(make_heap)
    h.history_enable(1000)
    x = h.malloc(32 * MiB, stream=MAIN)
    h.sim_hold_stream(MAIN, True)  # MAIN's kernels on x still run when it frees x
    h.free(x)
    p = h.malloc(32 * MiB, stream=SIDE)
    assert p == x and h.stats()["num_stream_handoffs"] == 1
    handed = [(e[2], e[3], e[4]) for e in h.history()[0] if e[1] == "handoff"]
    assert handed == [(x, 32 * MiB, SIDE)]
    assert h.stats()["num_sync_all_streams"] == 0
    assert h.sim_stream_busy(SIDE)
    assert_ok(h)
    h.sim_hold_stream(MAIN, False)
    assert not h.sim_stream_busy(SIDE)


def test_a_second_hand_off_waits_for_the_first_streams_work(make_heap):
    """SIDE got MAIN's block and frees it; THIRD takes it from SIDE: THIRD waits for SIDE,
    which waits for MAIN, so THIRD's work runs after MAIN's too."""
    h, _ = full_heap(make_heap)
    x = h.malloc(32 * MiB, stream=MAIN)
    h.sim_hold_stream(MAIN, True)
    h.free(x)
    p = h.malloc(32 * MiB, stream=SIDE)
    h.free(p)
    q = h.malloc(32 * MiB, stream=THIRD)
    assert q == x and h.stats()["num_stream_handoffs"] == 2
    assert h.sim_stream_busy(THIRD)
    assert_ok(h)
    h.sim_hold_stream(MAIN, False)
    assert not h.sim_stream_busy(THIRD) and not h.sim_stream_busy(SIDE)


def test_no_hand_off_during_a_capture(make_heap):
    h, _ = full_heap(make_heap)
    pending_batch(h)
    h.capture_begin()
    h.sim_set_capture(True)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(32 * MiB, stream=SIDE)
    assert h.stats()["num_stream_handoffs"] == 0
    assert h.sim_capture_violations() == 0  # no wait, no event, no synchronisation
    assert not h.sim_stream_busy(SIDE)
    h.sim_set_capture(False)
    h.capture_end()
    p = h.malloc(32 * MiB, stream=SIDE)  # after the capture, the hand-off serves it
    assert h.stats()["num_stream_handoffs"] == 1 and h.sim_stream_busy(SIDE)
    h.free(p)
    h.sim_hold_stream(MAIN, False)
    assert_ok(h)


def test_late_events_hand_off_instead_of_waiting_for_the_device(make_heap):
    """Late events (not holds): the old path waited for the whole device; the hand-off does not,
    and stream_handoff=0 keeps the device-wide wait."""
    counts = {}
    for handoff in (1, 0):
        h, _ = full_heap(make_heap, stream_handoff=handoff)
        h.sim_set_event_delay(1000)
        x = h.malloc(32 * MiB, stream=MAIN)
        h.free(x)
        p = h.malloc(32 * MiB, stream=SIDE)
        assert p == x
        st = h.stats()
        counts[handoff] = (st["num_stream_handoffs"], st["num_sync_all_streams"], h.sim_stream_busy(SIDE))
        assert_ok(h)
    assert counts == {1: (1, 0, True), 0: (0, 1, False)}


def test_a_failing_wait_falls_back_to_the_device_wait(make_heap):
    h, _ = full_heap(make_heap)
    h.sim_set_event_delay(1000)
    x = h.malloc(32 * MiB, stream=MAIN)
    h.free(x)
    h.sim_fail("stream_wait", 1)
    errors = h.stats()["num_device_errors"]
    p = h.malloc(32 * MiB, stream=SIDE)
    st = h.stats()
    assert p == x and st["num_stream_handoffs"] == 0 and st["num_sync_all_streams"] == 1
    assert st["num_device_errors"] == errors + 1 and h.sim_calls("stream_wait") == 1
    assert_ok(h)


def test_no_hand_off_while_the_heap_may_grow(make_heap):
    """With room under the cap the request takes new pages: no stream is made to wait."""
    h = make_heap(capacity=1 << 30, pressure=0)
    h.malloc(32 * MiB, stream=0)
    x = h.malloc(32 * MiB, stream=MAIN)
    h.sim_hold_stream(MAIN, True)
    h.free(x)
    h.malloc(4 * MiB, stream=SIDE)
    assert h.stats()["num_stream_handoffs"] == 0 and h.sim_calls("stream_wait") == 0
    assert not h.sim_stream_busy(SIDE)
    h.sim_hold_stream(MAIN, False)


def test_a_pools_pending_block_stays_with_its_pool(make_heap):
    h, _ = full_heap(make_heap)
    h.pool_retain((1, 1))
    x = h.malloc(32 * MiB, stream=SIDE, pool=(1, 1))
    h.record_stream(x, MAIN)
    h.sim_hold_stream(MAIN, True)
    h.free(x)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(32 * MiB, stream=SIDE)  # a general request: the pool's block is no use to it
    assert h.sim_calls("stream_wait") == 0
    p = h.malloc(32 * MiB, stream=SIDE, pool=(1, 1))  # the pool's own request takes it
    assert p == x and h.stats()["num_stream_handoffs"] == 1
    assert_ok(h)
    h.sim_hold_stream(MAIN, False)


def test_the_option_reaches_the_registry_and_is_checked():
    assert_switch_option("stream_handoff", 1)  # the core's default: on


def test_the_smallest_block_that_fits_alone_costs_one_streams_wait(make_heap):
    """Two streams freed blocks while their work runs; the request fits THIRD's smaller one: SIDE is made
    to wait for THIRD's work only, and MAIN keeps its block."""
    h = make_heap(capacity=CAP, pressure=0)
    h.malloc(16 * MiB, stream=0)
    m = h.malloc(32 * MiB, stream=MAIN)
    t = h.malloc(16 * MiB, stream=THIRD)
    h.sim_hold_stream(MAIN, True)
    h.sim_hold_stream(THIRD, True)
    h.free(m)
    h.free(t)
    p = h.malloc(16 * MiB, stream=SIDE)
    assert p == t and h.stats()["num_stream_handoffs"] == 1
    assert h.sim_calls("stream_wait") == 1
    assert h.sim_stream_busy(SIDE)
    h.sim_hold_stream(THIRD, False)
    assert not h.sim_stream_busy(SIDE)  # MAIN still runs: SIDE does not wait for it
    assert_ok(h)
    h.sim_hold_stream(MAIN, False)
