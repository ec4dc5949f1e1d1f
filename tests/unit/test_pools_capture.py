"""Pools under stream capture: the capture-safe slow path makes no call that would invalidate a capture
(the simulated device in capture mode refuses and counts every such call), pool allocations during a
capture, and which stream's freed blocks a capturing stream may reuse."""

import pytest

import gpumem
from helpers import MiB, PAGE, assert_ok
from test_pools import P, S1, S2, blocks, forbidden_calls, overlaps, page_identity, pages_of, pool_blocks


# ---- stream capture ------------------------------------------------------------------------


def _fragmented(h):
    """A heap of 16 pages where wholly free pages are scattered and memory is
    held by other streams and pending frees: the normal slow path would
    synchronise, query events and remap."""
    pend = h.malloc(MiB + 4096, stream=S1)
    s1 = h.malloc(MiB - 4096, stream=S1)  # page 0 is full (s1 takes the hole under a page after pend)
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
