"""The model of torch's native caching allocator (gpumem.native_model) as its C
engine runs it: the invariants of its books after every call on random
requests, a replay inside the engine against the same requests made one
NativeAllocator call at a time, and its refusals.  tests/unit/test_forecast_native.py pins
the rules themselves, and the model against torch's own numbers."""

from array import array

import pytest

try:
    from hypothesis import given
    from hypothesis import strategies as st
except ModuleNotFoundError:  # a venv made with `pip install . pytest`; `pip install -e ".[test]"` has it
    pytest.skip("these property tests need hypothesis", allow_module_level=True)

from gpumem.native_model import (
    MIN_BLOCK,
    ROUND_LARGE,
    SMALL_SIZE,
    UNLIMITED,
    NativeAllocator,
    NativeResult,
    min_capacity_native,
    replay_native,
    round_size,
)
from gpumem.trace import R_ALLOC, R_FREE, Trace, load_trace

from helpers import MiB, trace_file

SIZES = st.one_of(
    st.integers(0, 64 << 10),
    st.integers(0, 2 * MiB),
    st.integers(MiB, 24 * MiB),
    st.integers(10 * MiB, 300 * MiB),
    st.sampled_from([0, 1, 511, 512, 513, MiB, MiB + 1, 10 * MiB - 1, 10 * MiB, 20 * MiB, 64 * MiB, 200 * MiB]),
)
STREAMS = st.sampled_from([0, 0, 0, 1, 7, 2**64 - 1])
CAPACITIES = st.one_of(st.just(UNLIMITED), st.integers(1, 400).map(lambda k: k * MiB), st.integers(1, 1 << 34))
MAX_SPLITS = st.sampled_from([None, None, 20 * MiB + 1, 64 * MiB, 200 * MiB])


# ("malloc", size, stream), ("free", which of the live blocks), ("empty_cache",)
def op_lists(make, third, max_size):
    """Lists of (make, size, stream), ("free", which of the live blocks) and (third,)."""
    return st.lists(
        st.one_of(
            st.tuples(st.just(make), SIZES, STREAMS),
            st.tuples(st.just("free"), st.integers(0, 1 << 20)),
            st.just((third,)),
        ),
        max_size=max_size,
    )


OPS = op_lists("malloc", "empty_cache", 120)


def check_books(a, live):
    """What a.blocks() shows agrees with the counters, and with `live` ({addr:
    (rounded request, stream)} of the blocks handed out)."""
    blocks = a.blocks()
    segments = {}
    for seg, addr, size, stream, small, free in blocks:
        segments.setdefault(seg, []).append((addr, size, stream, small, free))
    assert len(segments) == a.segments == a.num_device_alloc - a.num_device_free
    spans = []
    for seg, bl in segments.items():
        assert bl[0][0] == seg
        assert len({(b[2], b[3]) for b in bl}) == 1  # one pool and stream per segment
        for b, c in zip(bl, bl[1:]):
            assert b[0] + b[1] == c[0]  # its blocks tile it: none overlap
            assert not (b[4] and c[4])  # free neighbours are merged
        size = sum(b[1] for b in bl)
        assert size % ROUND_LARGE == 0 and all(b[1] % MIN_BLOCK == 0 for b in bl)
        spans.append((seg, seg + size))
    spans.sort()
    assert all(end + ROUND_LARGE <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))  # a gap between segments
    assert a.reserved == sum(end - start for start, end in spans) <= a.capacity
    handed = {b[1]: b for b in blocks if not b[5]}
    assert handed.keys() == live.keys()
    for addr, (rounded, stream) in live.items():
        _, _, size, s, small, _ = handed[addr]
        assert size >= rounded and s == stream and small == (rounded <= SMALL_SIZE)
    assert a.allocated == sum(b[2] for b in handed.values()) >= sum(r for r, _ in live.values())
    assert a.peak_reserved >= a.reserved and a.peak_allocated >= a.allocated
    assert a.num_alloc_retries >= a.ooms


@given(capacity=CAPACITIES, max_split=MAX_SPLITS, ops=OPS)
def test_native_books_hold_after_every_call(capacity, max_split, ops):
    a = NativeAllocator(capacity, max_split)
    live, order, ooms = {}, [], 0
    for op in ops:
        if op[0] == "malloc":
            addr = a.malloc(op[1], op[2])
            if addr is None:
                ooms += 1
            else:
                live[addr] = (round_size(op[1]), op[2])
                order.append(addr)
        elif op[0] == "free" and order:
            addr = order.pop(op[1] % len(order))
            del live[addr]
            a.free(addr)
            with pytest.raises(ValueError, match="did not hand out"):
                a.free(addr)  # freed twice
        elif op[0] == "empty_cache":
            before = a.reserved
            assert a.empty_cache() == before - a.reserved
            segs = {}
            for seg, _, _, _, _, free in a.blocks():
                segs.setdefault(seg, []).append(free)
            assert [True] not in segs.values()  # no wholly free segment is left
        check_books(a, live)
    assert a.ooms == ooms


def replay_by_calls(words, capacity=UNLIMITED, stop_at_oom=False, max_split_size=None):
    """replay_native's loop made of NativeAllocator calls, one per event."""
    a = NativeAllocator(capacity, max_split_size)
    slots, first_oom = {}, -1
    for i in range(0, len(words), 3):
        slot = words[i] >> 32
        if words[i] & 0xFFFFFFFF == R_ALLOC:
            addr = a.malloc(words[i + 1], words[i + 2])
            if addr is None:
                first_oom = i // 3 if first_oom < 0 else first_oom
                if stop_at_oom:
                    break
            else:
                slots[slot] = addr
        elif slot in slots:
            a.free(slots.pop(slot))
    counters = ("peak_reserved", "peak_allocated", "segments", "num_device_alloc", "num_device_free")
    return NativeResult(capacity, a.ooms, first_oom, *(getattr(a, c) for c in counters), a.num_alloc_retries)


def trace_of(words):
    return Trace("made", "text", 0, array("Q", words), 1 << 20, 0, 0, 0, -1)


# A trace's events: ("alloc", size, stream), ("free", which live slot), or a
# free of a slot that holds nothing (skipped, as for an allocation that failed).
EVENTS = op_lists("alloc", "free_nothing", 150)


@given(capacity=CAPACITIES, max_split=MAX_SPLITS, stop_at_oom=st.booleans(), events=EVENTS)
def test_native_replay_matches_the_same_events_called_one_by_one(capacity, max_split, stop_at_oom, events):
    words, live, spare, n_slots = [], [], [], 0
    for ev in events:
        if ev[0] == "alloc":
            slot = spare.pop() if spare else n_slots
            n_slots = max(n_slots, slot + 1)
            live.append(slot)
            words += [R_ALLOC | slot << 32, ev[1], ev[2]]
        elif ev[0] == "free" and live:
            slot = live.pop(ev[1] % len(live))
            spare.append(slot)
            words += [R_FREE | slot << 32, 0, 0]
        else:
            words += [R_FREE | (n_slots + 5) << 32, 0, 0]
    got = replay_native(trace_of(words), capacity, stop_at_oom, max_split)
    assert got == replay_by_calls(words, capacity, stop_at_oom, max_split)


@pytest.mark.parametrize("name", ["seed_fragmentation", "two_stream_pipeline", "llama_lora_ckpt"])
def test_native_replay_matches_calls_on_shipped_traces(name):
    """Both entry points, on recorded traces, at no limit, at the smallest
    limit that fits and 2 MiB under it (where requests fail), with and without
    a max_split_size."""
    t = load_trace(trace_file(name))
    need = min_capacity_native(t)
    for max_split in (None, 64 * MiB):
        for capacity in (UNLIMITED, need, need - 2 * MiB):
            got = replay_native(t, capacity, max_split_size=max_split)
            assert got == replay_by_calls(t.words, capacity, max_split_size=max_split)
            if max_split is None:
                assert (got.ooms > 0) == (capacity < need)


def test_native_model_refuses_bad_arguments():
    with pytest.raises(ValueError, match="capacity must be positive, not 0"):
        NativeAllocator(0)
    with pytest.raises(ValueError, match="capacity must be positive, not -5"):
        NativeAllocator(capacity=-5)
    with pytest.raises(TypeError, match="capacity must be an int, not float"):
        NativeAllocator(1.5)
    with pytest.raises(ValueError, match="max_split_size must be more than 20 MiB, not 20971520"):
        NativeAllocator(max_split_size=20 * MiB)
    with pytest.raises(TypeError, match="max_split_size must be an int, not str"):
        NativeAllocator(max_split_size="64MiB")
    a = NativeAllocator()
    with pytest.raises(ValueError, match="size must not be negative, got -1"):
        a.malloc(-1)
    with pytest.raises(TypeError, match="size must be an int, not float"):
        a.malloc(1.0)
    with pytest.raises(ValueError, match="stream"):
        a.malloc(1, stream=-1)
    with pytest.raises(ValueError, match="did not hand out: 0x1234$"):
        a.free(0x1234)
    with pytest.raises(ValueError, match="did not hand out: -0x1$"):
        a.free(-1)
    with pytest.raises(TypeError, match="addr must be an int"):
        a.free(None)
    with pytest.raises(AttributeError):
        a.reserved = 0
    assert (a.reserved, a.ooms, a.segments) == (0, 0, 0)  # the refused calls changed nothing
    t = trace_of([R_ALLOC, 512, 0])
    with pytest.raises(ValueError, match="capacity must be positive, not 0"):
        replay_native(t, 0)
    with pytest.raises(ValueError, match="max_split_size must be more than 20 MiB"):
        replay_native(t, max_split_size=MiB)
    with pytest.raises(ValueError, match="not a whole number of 24-byte events"):
        replay_native(trace_of([R_ALLOC, 512]))


def test_native_limits_and_sizes_beyond_any_device():
    a = NativeAllocator(capacity=1 << 70)  # counts as no limit
    assert a.capacity == 1 << 70 and a.max_split_size is None
    a.free(a.malloc(MiB))
    # no limit fits 2**70 bytes: the request still releases the cache, as any failing one does
    assert a.malloc(1 << 70) is None and a.malloc(2**64 + 1) is None
    assert (a.ooms, a.num_alloc_retries, a.reserved, a.num_device_free) == (2, 2, 0, 1)
    assert a.malloc(512, stream=2**64 - 1) is not None
    r = replay_native(trace_of([R_ALLOC, 2**64 - 1, 0, R_ALLOC | 1 << 32, 512, 0]), stop_at_oom=True)
    assert (r.ooms, r.first_oom_event, r.num_device_alloc) == (1, 0, 0)
