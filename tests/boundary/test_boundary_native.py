"""The model of torch's native allocator at the Python boundary: any call, any
max_split_size (whole MiB or not), any number of streams ends in an answer or
an exception, never a signal, and its books match a plain reference of torch's
rules block by block (tests/boundary/native_reference.py).  .ci/boundary_asan runs this
file under ASan and UBSan."""

import random
import struct
import sys

import pytest

from gpumem import _C
from native_reference import Reference
from test_boundary import _malloc_in_use

MiB, GiB = 1 << 20, 1 << 30
EV = struct.Struct("<IIQQ")


def check_books(m):
    """The model's own counters agree with its blocks."""
    blocks = m.blocks()
    segs = {}
    for seg, _addr, size, *_ in blocks:
        segs[seg] = segs.get(seg, 0) + size
    assert m.segments == len(segs) == m.num_device_alloc - m.num_device_free
    assert m.reserved == sum(segs.values()) <= m.capacity
    assert m.allocated == sum(b[2] for b in blocks if not b[5])
    spans = sorted((seg, seg + size) for seg, size in segs.items())
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:])), "segments overlap"


def test_oversize_free_block_of_a_split_segment_is_not_released_as_a_segment():
    """A max_split_size that is not a whole MiB: the free block left of a split
    counts as oversize, and the out-of-memory path used to release it as a whole
    segment while its neighbour still linked to it (ASan: negative-size-param;
    release build: a crash at the next malloc)."""
    m = _C.NativeModel(22 * MiB, 21 * MiB - 512)
    a = m.malloc(20 * MiB + 512)
    c = m.malloc(2 * MiB - 1024)
    m.free(a)
    d = m.malloc(MiB + 512)
    m.free(c)
    assert m.malloc(20 * MiB + 512) is None  # the split segment cannot be released
    m.free(d)
    check_books(m)
    assert (m.segments, m.reserved, m.allocated) == (1, 22 * MiB, 0)
    assert m.malloc(20 * MiB + 512) is not None  # now it is whole again and serves it
    check_books(m)


def differential(capacity, max_split, ops):
    m, ref = _C.NativeModel(capacity, max_split), Reference(capacity, max_split)
    live = []
    for op, size, pick in ops:
        if op == "malloc":
            got = m.malloc(max(size, 0), stream=pick)
            assert got == ref.malloc(max(size, 0), stream=pick)
            if got is not None:
                live.append(got)
        elif op == "free" and live:
            addr = live.pop(size % len(live))
            m.free(addr)
            ref.free(addr)
        elif op == "empty":
            assert m.empty_cache() == ref.empty_cache()
        assert {k: getattr(m, k) for k in Reference.COUNTERS} == ref.counters()
    assert sorted(m.blocks(), key=lambda t: t[1]) == ref.blocks()
    check_books(m)


@pytest.mark.parametrize("seed", range(6))
def test_native_model_matches_the_reference_on_long_random_runs(seed):
    rng = random.Random(seed)
    max_split = rng.choice([21 * MiB - 512, 22 * MiB + 1536, 20 * MiB + 512, 33 * MiB - 7 * 512])
    ops = [
        (
            rng.choice(["malloc"] * 3 + ["free"] * 3 + ["empty"] * (rng.random() < 0.02)),
            rng.choice([rng.randrange(64 * MiB), rng.randrange(1, 44) * MiB + rng.randrange(-2, 3) * 512]),
            rng.randrange(3),
        )
        for _ in range(3000)
    ]
    differential(rng.choice([22 * MiB, 40 * MiB, 96 * MiB]), max_split, ops)


def test_native_replay_with_a_non_mib_max_split_size_keeps_its_books():
    """The same sequence as a trace through native_replay (the forecast's path)."""
    ev = struct.Struct("<IIQQ")
    seq = [(0, 0, 20 * MiB + 512), (0, 1, 2 * MiB - 1024), (1, 0, 0), (0, 2, MiB + 512), (1, 1, 0)]
    seq += [(0, 3, 20 * MiB + 512), (1, 2, 0), (0, 4, 21 * MiB), (1, 4, 0), (0, 5, 512)]
    raw = b"".join(ev.pack(op, slot, size, 0) for op, slot, size in seq)
    r = _C.native_replay(raw, capacity=22 * MiB, max_split_size=21 * MiB - 512)
    assert r["ooms"] == 1 and r["first_oom_event"] == 5
    assert r["segments"] == r["num_device_alloc"] - r["num_device_free"] == 1


def test_released_addresses_are_used_again_once_the_bottom_is_reached():
    """Each segment goes below the one before; thousands of growing PiB
    requests under a 4 PiB limit ran out of addresses ("addresses ran out")
    although the segments held never exceeded the limit."""
    peb = 1 << 50
    raw = b"".join(EV.pack(0, i, peb + i * GiB, 0) + EV.pack(1, i, 0, 0) for i in range(10_000))
    r = _C.native_replay(raw, capacity=1 << 52)
    assert r["ooms"] == 0 and r["num_device_alloc"] == 10_000
    m = _C.NativeModel(capacity=1 << 52, max_split_size=33 * MiB + 512)
    held = []
    for i in range(10_000):
        held.append(m.malloc(peb + i * GiB + (i % 7) * MiB, stream=i % 2))
        m.malloc(i % 5 * MiB + 1)  # small ones stay, in segments of their own
        if len(held) > 2:
            m.free(held.pop(0))
        if i % 2000 == 0:
            check_books(m)
    check_books(m)


@pytest.mark.skipif(_malloc_in_use() is None, reason="needs glibc's mallinfo2")
def test_host_memory_follows_the_blocks_not_the_streams_seen():
    """Each stream ever seen kept its pools and a ~20 KiB table of free-block
    bins for the model's whole life (200k streams with nothing live: 3.9 GB)."""
    m = _C.NativeModel(capacity=1 << 40)
    m.free(m.malloc(512))
    base = _malloc_in_use()
    n = 20_000
    for s in range(1, n + 1):  # each stream caches a small and a large segment
        m.free(m.malloc(512, stream=s))
        m.free(m.malloc(3 * MiB, stream=s))
    per_stream = (_malloc_in_use() - base) / n
    assert per_stream < 4096, f"{per_stream:.0f} bytes per stream that caches two segments"
    m.empty_cache()
    high = _malloc_in_use()
    for s in range(n + 1, 3 * n + 1):  # new streams take the slots of those that hold nothing
        m.free(m.malloc(512, stream=s))
        if s % n == 0:
            m.empty_cache()
    for s in range(1, 2001):  # requests that fail leave nothing behind either
        assert m.malloc(1 << 41, stream=(1 << 40) + s) is None
    assert _malloc_in_use() - high < 1 * MiB
    assert m.segments == 0 and m.empty_cache() == 0
    check_books(m)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(__import__("pytest").main([__file__, "-q"]))
