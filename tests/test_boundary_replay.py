"""Replays and simulated heaps at the Python boundary: a trace replayed in
chunks counts live bytes across them, and no simulated heap -- whatever made
it -- grows host memory without bound.  .ci/boundary_asan runs this file
under ASan and UBSan."""

import struct
import sys
from array import array

import pytest

import gpumem

KiB, MiB = 1 << 10, 1 << 20
EV = struct.Struct("<IIQQ")


def events(*evs):
    return b"".join(EV.pack(op, slot, size, 0) for op, slot, size in evs)


def test_chunks_sharing_a_slot_table_carry_the_live_bytes_over():
    """Each call restarted its live-bytes counter at 0, so a chunk freeing what
    an earlier one allocated wrapped it: peak_live_bytes 2**64 - 1044480."""
    h = gpumem.Heap(device="sim", capacity="64MiB")
    slots = array("Q", bytes(8 * 4))
    r1 = h.replay(events((0, 0, MiB), (0, 1, 4 * KiB)), 4, slots=slots)
    assert (r1["peak_live_bytes"], r1["live_bytes"]) == (MiB + 4 * KiB, MiB + 4 * KiB)
    r2 = h.replay(events((1, 0, 0), (0, 2, 4 * KiB)), 4, slots=slots)  # live_bytes left None: summed
    assert (r2["peak_live_bytes"], r2["live_bytes"]) == (MiB + 4 * KiB, 8 * KiB)
    r3 = h.replay(events((1, 1, 0), (1, 2, 0)), 4, slots=slots, live_bytes=r2["live_bytes"])
    assert (r3["peak_live_bytes"], r3["live_bytes"]) == (8 * KiB, 0)
    # A wrong live_bytes never wraps the counter.
    h.replay(events((0, 3, 4 * KiB)), 4, slots=slots)
    r4 = h.replay(events((1, 3, 0)), 4, slots=slots, live_bytes=0)
    assert r4["live_bytes"] == 0 and r4["peak_live_bytes"] == 0
    with pytest.raises(ValueError):
        h.replay(events(), 4, slots=slots, live_bytes=-1)
    h.close()


def test_replay_in_chunks_gives_the_peak_of_one_call():
    from gpumem.replay import replay_trace
    from gpumem.trace import Trace

    evs = [(0, i, (i % 7 + 1) * 64 * KiB) for i in range(200)] + [(1, i, 0) for i in range(200)]
    evs += [(0, 200 + i, 3 * MiB) for i in range(5)] + [(1, 200 + i, 0) for i in range(5)]
    words = array("Q", [w for op, slot, size in evs for w in (op | slot << 32, size, 0)])
    trace = Trace("chunks", "text", 0, words, 205, 205, 205, 0, -1)
    whole = gpumem.Heap(device="sim", capacity="256MiB").replay(trace.events, trace.n_slots)
    h = gpumem.Heap(device="sim", capacity="256MiB")
    slots, live, peak = array("Q", bytes(8 * trace.n_slots)), 0, 0
    for _start, chunk in trace.chunks(7):
        r = h.replay(chunk, trace.n_slots, slots=slots, live_bytes=live)
        live, peak = r["live_bytes"], max(peak, r["peak_live_bytes"])
    assert peak == whole["peak_live_bytes"] and live == 0
    assert replay_trace(gpumem.Heap(device="sim", capacity="256MiB"), trace, progress=lambda *a: None, chunk=5)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
