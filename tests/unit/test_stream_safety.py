"""Stream safety as an invariant of the checker (check.c, C11).

Memory a stream freed goes to other streams only once an event recorded on
that stream has completed, and only the frees made before the event was
recorded.  These cases walk the release protocol step by step on the
simulated device (a held stream keeps its events pending) and call check()
after each step, so a release that runs ahead of its event fails here
deterministically, not only in the randomized tests.
"""

import gpumem
from helpers import MiB, assert_ok

S1, S2 = 0x1000, 0x2000


def test_frees_after_the_release_event_stay_with_their_stream(make_heap):
    h = make_heap(capacity=256 * MiB)
    a = h.malloc(8 * MiB, stream=S1)
    keep = h.malloc(512, stream=S1)  # keeps a and b apart
    b = h.malloc(8 * MiB, stream=S1)
    pad = h.malloc(512, stream=S1)
    h.free(a)  # free #1 on S1
    h.sim_hold_stream(S1, True)  # S1 has work in flight
    big = h.malloc(200 * MiB, stream=S2)  # S2 runs short: an event is recorded on S1 (covers free #1)
    assert_ok(h)
    h.free(b)  # free #2 on S1, after the event
    assert_ok(h)
    h.sim_hold_stream(S1, False)  # the event completes: free #1 may go to every stream
    p = h.malloc(4 * MiB, stream=S2)  # another short request processes the release
    assert_ok(h)
    # b's range (freed after the event was recorded) must not have been handed
    # to S2 by that release.
    assert not (b <= p < b + 8 * MiB), "S2 got memory S1 freed after the release event"
    for q in (keep, pad, big, p):
        h.free(q)
    assert_ok(h)


def test_a_pools_proof_of_a_stream_survives_the_pools_end():
    """A block freed on a side stream inside a pool, handed to every stream of
    the pool once its event completed, stays proven when the pool ends and the
    block joins the general heap (found by the state machine on Python 3.9)."""
    h = gpumem.Heap(device="sim", capacity=4 << 30)
    try:
        h.pool_retain((1, 1))
        side = h.malloc(1, stream=4096, pool=(1, 1))
        h.malloc(1, stream=0, pool=(1, 1))
        h.free(side)
        h.malloc(2096129, stream=0, pool=(1, 1))  # the slow path hands the side stream's block to everyone
        h.check()
        h.pool_release((1, 1))
        h.check()
        assert any(b[0] == side and b[6] == "free" and b[7] is None for b in h.snapshot()["blocks"])  # free, general
    finally:
        h.close()


def test_a_proof_made_in_a_pool_covers_the_stream_everywhere():
    """A pool's request builds on the pool's free block that a side stream freed
    (handed to every stream of the pool once its event completed); what is left
    of that range afterwards is general memory, and the side stream's proof,
    kept by the pool's owner of that stream, covers it (found by the state
    machine)."""
    h = gpumem.Heap(device="sim", capacity=4 << 30)
    try:
        h.pool_retain((2, 5))
        a = h.malloc(1, stream=0, pool=(2, 5))
        h.pool_retain((1, 1))
        b = h.malloc(1, stream=4096, pool=(1, 1))
        h.free(a)
        h.free(b)
        h.malloc(2096641, stream=0, pool=(1, 1))  # extends over b's block
        h.check()
        h.malloc(1, stream=4096)
        h.check()
    finally:
        h.close()


ANY = (1 << 64) - 1


def _one_stream_heap(make_heap):
    """S1 frees a 1 MiB block (a, within pages that live blocks share) and a
    3 MiB one (whole free pages, so that empty_cache waits for the device)."""
    h = make_heap(capacity=256 * MiB)
    h.malloc(512, stream=S1)
    a = h.malloc(1 * MiB, stream=S1)
    d = h.malloc(512, stream=S1)  # a's upper neighbour
    big = h.malloc(3 * MiB, stream=S1)
    h.malloc(512, stream=S1)
    h.free(a)
    h.free(big)
    return h, a, d


def _owner(h, addr):
    (blk,) = [b for b in h.snapshot()["blocks"] if b[0] == addr]
    return blk[3]


def test_a_synchronisation_hands_one_streams_free_memory_to_every_stream(make_heap):
    h, a, _ = _one_stream_heap(make_heap)
    assert _owner(h, a) == S1
    syncs = h.stats()["num_sync_all_streams"]
    h.empty_cache()  # waits for the device: every free block is everyone's now
    assert h.stats()["num_sync_all_streams"] == syncs + 1
    assert_ok(h)
    assert _owner(h, a) == ANY
    slow = h.stats()["num_slow_allocs"]
    p = h.malloc(1 * MiB, stream=S2)  # S2 takes it at once: no event, no slow path
    assert p == a
    assert h.stats()["num_slow_allocs"] == slow
    assert_ok(h)


def test_a_free_after_the_synchronisation_stays_with_its_stream(make_heap):
    """After the device wait, S1 frees a's neighbour: the merged block holds a
    free no event has proven done, so it is S1's again, not everyone's."""
    h, a, d = _one_stream_heap(make_heap)
    h.empty_cache()
    assert_ok(h)
    h.sim_hold_stream(S1, True)  # S1 has work in flight from here on
    h.free(d)  # merges with a (everyone's)
    assert_ok(h)
    assert _owner(h, a) == S1
    p = h.malloc(1 * MiB, stream=S2)
    assert_ok(h)
    assert not (a <= p < a + MiB + 512), "S2 got memory S1 freed after the device wait"
    h.sim_hold_stream(S1, False)
    h.free(p)
    assert_ok(h)
