"""The Python boundary: no call from Python can crash the process or write out of bounds.

Every Heap method converts its arguments before it looks at the heap, so Python
code that runs during a conversion (an __index__, __len__ or __iter__, the size
parser, another thread) may close the heap, mutate a sequence or rewrite a
buffer: the answer is an exception or a correct result, never a crash.  The
regressions below are the cases found by hand; test_boundary_fuzz drives every
entry point with hostile arguments for a fixed number of derandomised cases
(.ci/boundary_asan runs it under ASan and UBSan).
"""

import ctypes
import gc
import os
import random
import struct
import sys
import threading
import time

import pytest

import gpumem
from gpumem import _C
from test_boundary_fuzz import HugeIndex, RaiseIndex

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
EV = struct.Struct("<IIQQ")  # op, slot, size, stream: gpumem/trace.py's packing


def new_heap(capacity="64MiB", **kw):
    return gpumem.Heap(device="sim", capacity=capacity, **kw)


def events(*evs):
    return b"".join(EV.pack(*e) for e in evs)


class Closer:
    """An int whose conversion closes the heap first."""

    def __init__(self, heap, value=4096):
        self.heap, self.value = heap, value

    def __index__(self):
        self.heap.close()
        return self.value


# Each entry point with the argument that closes the heap while it is converted.
CLOSE_DURING_CONVERSION = {
    "malloc": lambda h, c: h.malloc(c),
    "malloc_stream": lambda h, c: h.malloc(512, stream=c),
    "malloc_context": lambda h, c: h.malloc(512, context=c),
    "malloc_pool": lambda h, c: h.malloc(512, pool=(c, 1)),
    "free": lambda h, c: h.free(c),
    "record_stream": lambda h, c: h.record_stream(c, 1),
    "record_stream_stream": lambda h, c: h.record_stream(1 << 40, c),
    "block_size": lambda h, c: h.block_size(c),
    "set_cap": lambda h, c: h.set_cap(c),
    "history_enable": lambda h, c: h.history_enable(c),
    "memory_report": lambda h, c: h.memory_report(c),
    "pool_retain": lambda h, c: h.pool_retain((c, 1)),
    "pool_release": lambda h, c: h.pool_release((1, c)),
    "pool_info": lambda h, c: h.pool_info([c, 1]),
    "pool_live": lambda h, c: h.pool_live((c, 1)),
    "pool_set_live": lambda h, c: h.pool_set_live((1, 1), [(1 << 40, c)]),
    "pool_set_live_stream": lambda h, c: h.pool_set_live((1, 1), [], stream=c),
    "pool_pause": lambda h, c: h.pool_pause((c, 1)),
    "pool_resume": lambda h, c: h.pool_resume((c, 1)),
    "replay": lambda h, c: h.replay(events((0, 0, 512, 0)), c),
    "sim_unmap": lambda h, c: h.sim_unmap(c, 4096),
    "sim_fail": lambda h, c: h.sim_fail("map", nth=c),
    "sim_fail_random": lambda h, c: h.sim_fail_random("map", 0.5, seed=c),
    "sim_hold_stream": lambda h, c: h.sim_hold_stream(c),
    "sim_set_event_delay": lambda h, c: h.sim_set_event_delay(c),
    "sim_set_external": lambda h, c: h.sim_set_external(c, 1),
    "sim_set_self": lambda h, c: h.sim_set_self(1, c),
    "sim_is_accessible": lambda h, c: h.sim_is_accessible(c, 512),
    "sim_set_stream_capture": lambda h, c: h.sim_set_stream_capture(c),
    "sim_page_at": lambda h, c: h.sim_page_at(c),
    "sim_write": lambda h, c: h.sim_write(c, 1),
    "sim_read": lambda h, c: h.sim_read(c),
}


@pytest.mark.parametrize("name", sorted(CLOSE_DURING_CONVERSION))
def test_closing_the_heap_inside_an_argument_conversion_is_a_value_error(name):
    h = new_heap()
    h.pool_retain((1, 1))
    with pytest.raises(ValueError, match="closed"):
        CLOSE_DURING_CONVERSION[name](h, Closer(h))
    assert h.closed


def test_closing_inside_the_size_parser_is_a_value_error(monkeypatch):
    h = new_heap()
    from gpumem import _units

    real = _units.parse_size

    def closing_parse(text):
        h.close()
        return real(text)

    monkeypatch.setattr(_units, "parse_size", closing_parse)
    with pytest.raises(ValueError, match="closed"):
        h.set_cap("1MiB")


def test_closing_the_heap_from_another_thread_during_a_slow_conversion():
    h = new_heap()
    entered, closed = threading.Event(), threading.Event()

    class Slow:
        def __index__(self):
            entered.set()
            assert closed.wait(10)
            return 4096

    def closer():
        assert entered.wait(10)
        h.close()
        closed.set()

    t = threading.Thread(target=closer)
    t.start()
    with pytest.raises(ValueError, match="closed"):
        h.malloc(Slow())
    t.join()


def test_init_called_again_from_inside_its_own_conversion():
    h = gpumem.Heap.__new__(gpumem.Heap)

    class Reenter:
        def __index__(self):
            h.__init__(device="sim", capacity="16MiB")
            return 16 * MiB

    with pytest.raises(RuntimeError, match="twice"):
        h.__init__(device="sim", capacity=Reenter())
    assert h.malloc(512)
    h.close()


def heap_with_a_pool_block():
    """A heap with pool (1, 1) retained, and a 4 KiB block of the pool."""
    h = new_heap()
    h.pool_retain((1, 1))
    return h, h.malloc(4096, pool=(1, 1))


def test_pool_set_live_items_that_empty_the_list_they_are_in():
    h, p = heap_with_a_pool_block()
    blocks = []

    class Clearing:
        def __index__(self):
            blocks.clear()
            gc.collect()
            return 4096

    blocks[:] = [(p, Clearing()), (p + 8192, 512)]
    # The call sees the list as it was when it started, both blocks.
    h.pool_set_live((1, 1), blocks)
    assert blocks == []
    assert h.pool_live((1, 1)) == [(p, 4096), (p + 8192, 512)]
    h.check()


def test_pool_set_live_items_that_replace_the_items_of_their_list():
    h, p = heap_with_a_pool_block()
    blocks = []

    class Replacing:
        def __index__(self):
            blocks[:] = [(1, 1)] * 3  # the tuple being read loses its last reference
            gc.collect()
            return p

    blocks[:] = [(Replacing(), 4096), (p + 8192, 512)]
    h.pool_set_live((1, 1), blocks)
    assert h.pool_live((1, 1)) == [(p, 4096), (p + 8192, 512)]
    h.check()


def test_pool_ids_that_change_while_they_are_read():
    h = new_heap()
    pid = []

    class Growing:
        def __index__(self):
            pid.extend(range(100))
            return 7

    pid[:] = [Growing(), 1]
    h.pool_retain(pid)
    assert h.pool_info((7, 1))["use_count"] == 1

    class Shrinking:
        def __index__(self):
            pid.clear()
            gc.collect()
            return 7

    pid[:] = [Shrinking(), 1]
    h.pool_release(pid)
    assert h.pools() == []


class LyingSequence:
    """A sequence whose __len__ lies and whose __iter__ closes the heap."""

    def __init__(self, heap, items, length, close=True):
        self.heap, self.items, self.length, self.close = heap, items, length, close

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return self.items[i]

    def __iter__(self):
        if self.close:
            self.heap.close()
        return iter(self.items)


def test_sequences_that_lie_about_their_length_or_close_the_heap():
    h = new_heap()
    h.pool_retain((1, 1))
    with pytest.raises(ValueError, match="closed"):
        h.pool_set_live((1, 1), LyingSequence(h, [], 10**6))
    h = new_heap()
    h.pool_retain((1, 1))
    with pytest.raises(ValueError, match="closed"):
        h.pool_set_live((1, 1), LyingSequence(h, [(1, 2)], 0))
    # A length of 2**40 costs nothing: the items are taken as they come.
    h, p = heap_with_a_pool_block()
    h.pool_set_live((1, 1), LyingSequence(h, [(p, 4096)], 2**40, close=False))
    assert h.pool_live((1, 1)) == [(p, 4096)]
    with pytest.raises(ValueError, match="closed"):
        h.pool_set_live((1, 1), LyingSequence(h, [], 2**40))


def test_replay_with_slots_aliasing_the_event_buffer():
    h = new_heap()
    buf = bytearray(events((0, 3, 512, 0), (0, 0, 512, 0)))
    slots = memoryview(buf)[:32]
    r = h.replay(buf, 4, slots=slots)
    assert (r["allocs"], r["frees"], r["error"]) == (2, 0, 0)
    # Slots 3 and 0 hold the two blocks it allocated (slots 1 and 2 are still
    # the first event's bytes): the events were read before the slots changed.
    got = struct.unpack("<4Q", bytes(slots))
    assert got[0] != got[3] and h.block_size(got[0]) == 512 and h.block_size(got[3]) == 512
    h.check()


def test_replay_while_another_thread_rewrites_the_buffers():
    h = new_heap()
    n = 20000
    evs = [(0, i % 64, 512 * (1 + i % 7), i % 3) if (i // 64) % 2 == 0 else (1, i % 64, 0, 0) for i in range(n)]
    buf = bytearray(events(*evs))
    slots = bytearray(64 * 8)
    stop = threading.Event()

    def scribble():
        rng = random.Random(1)
        while not stop.is_set():
            i = rng.randrange(len(buf))
            buf[i] = rng.randrange(256)
            j = rng.randrange(len(slots))
            slots[j] = rng.randrange(256)

    t = threading.Thread(target=scribble)
    t.start()
    try:
        for _ in range(5):
            try:
                h.replay(buf, 64, slots=slots)
            except ValueError:
                pass  # a scribbled op or slot number, checked on the copy
    finally:
        stop.set()
        t.join()
    h.check()


def test_replay_n_slots_whose_byte_size_overflows():
    h = new_heap()
    with pytest.raises(ValueError, match="n_slots is too large"):
        h.replay(events((0, 1000000, 512, 0)), 2**61, slots=bytearray())
    # Slot numbers are 32-bit: more than 2^32 slots is refused before anything is allocated
    # (an allocation that large only fails, and under ASan says so on stderr).
    for n_slots in (2**61 - 1, 2**40, 2**32 + 1):
        with pytest.raises(ValueError, match="n_slots is too large"):
            h.replay(events((0, 0, 512, 0)), n_slots)


def test_replay_timing_covers_only_the_events_that_ran():
    h = new_heap()
    ev = events((0, 0, 512, 0), (0, 1, 512, 0), (1, 0, 0, 0), (1, 1, 0, 0))
    r = h.replay(ev, 2, timing=True, stop_at=1)
    assert len(r["op_ns"]) == 2 and all(t > 0 for t in r["op_ns"])
    r = h.replay(ev, 2, timing=True)
    assert len(r["op_ns"]) == 4


@pytest.mark.parametrize("page_size", [1 << 51, 1 << 52, 1 << 43, 1 << 62])
def test_page_sizes_the_heap_cannot_index_are_refused(page_size):
    assert page_size > _C.PAGE_SIZE_MAX == 4 << 40
    with pytest.raises(ValueError, match="page size exceeds 4 TiB"):
        new_heap(capacity=1 << 63, page_size=page_size)


def test_a_page_larger_than_the_device_is_refused():
    with pytest.raises(ValueError, match="page size exceeds the device's memory"):
        new_heap(capacity="1GiB", page_size=2 * GiB)
    h = new_heap(capacity="1GiB", page_size=1 * GiB)  # exactly the device: one page
    h.free(h.malloc(512))


@pytest.mark.parametrize("size", [2**64 - 1, 2**64 - 511])
def test_memory_report_keeps_requests_near_the_top_of_the_range(size):
    h = new_heap()
    rep = h.memory_report(size)
    assert rep["request"] == size  # it has no 512-byte multiple to round to
    r = gpumem.explain(size, device=h)
    assert r.request == size and not r.fits


def test_sim_calls_wait_for_other_threads_inside_the_heap():
    h = new_heap(capacity="256MiB")
    addr = h.malloc(4096)
    h.sim_write(addr, 7)
    ev = events(
        *[(0, i % 256, 4096 * (1 + i % 5), 0) if (i // 256) % 2 == 0 else (1, i % 256, 0, 0) for i in range(40000)]
    )
    done = threading.Event()

    def replayer():
        for _ in range(5):
            h.replay(ev, 256)
        done.set()

    t = threading.Thread(target=replayer)
    t.start()
    answers = set()
    while not done.is_set():
        for call in (lambda: h.sim_read(addr), lambda: h.sim_page_at(addr), lambda: h.sim_write(addr, 7), h.sim_info):
            try:
                call()
                answers.add("ok")
            except RuntimeError as e:
                assert "another thread is inside this heap" in str(e)
                answers.add("refused")
    t.join()
    assert h.sim_read(addr) == 7
    h.check()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_can_close_a_heap_another_thread_was_inside():
    h = new_heap(capacity="256MiB")
    ev = events(*[(0, i % 64, 4096, 0) if (i // 64) % 2 == 0 else (1, i % 64, 0, 0) for i in range(20000)])
    inside = threading.Event()
    stop = threading.Event()

    def replayer():
        while not stop.is_set():
            inside.set()
            h.replay(ev, 64)

    t = threading.Thread(target=replayer)
    t.start()
    try:
        assert inside.wait(10)
        time.sleep(0.01)  # let it go back into the core
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            code = 1
            try:
                h.check()
                h.free(h.malloc(512))
                h.close()
                code = 0 if h.closed else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    finally:
        stop.set()
        t.join()
    h.close()


def _malloc_in_use():
    """Bytes the C allocator has handed out and not taken back (glibc)."""
    try:
        libc = ctypes.CDLL(None)
        info = libc.mallinfo2
    except (OSError, AttributeError):
        return None

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (n, ctypes.c_size_t)
            for n in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
        ]

    info.restype = MallInfo2
    i = info()
    return i.uordblks + i.hblkhd


@pytest.mark.skipif(_malloc_in_use() is None, reason="needs glibc's mallinfo2")
def test_many_distinct_streams_leave_no_state_behind():
    h = new_heap()
    h.free(h.malloc(4096))
    h.empty_cache()
    before = _malloc_in_use()
    for s in range(1, 100_001):
        h.free(h.malloc(4096, stream=s))
    h.empty_cache()
    grown = _malloc_in_use() - before
    # Each stream used to keep an owner of about 11 KB: 100k of them, 1.1 GB.
    assert grown < 8 * MiB, f"{grown} bytes still held after 100k streams came and went"
    h.check()
    # Streams with live blocks keep their state; it goes with their blocks.
    ptrs = [h.malloc(4096, stream=s) for s in range(1, 2001)]
    h.check()
    for p in ptrs:
        h.free(p)
    h.empty_cache()
    assert _malloc_in_use() - before < 8 * MiB
    h.check()


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_streams_coming_and_going_keep_every_invariant(seed):
    """Hundreds of streams with pools, record_stream, held streams and delayed
    events: the per-stream state dropped as streams empty never breaks check()."""
    rng = random.Random(seed)
    h = new_heap(capacity="256MiB")
    h.sim_set_event_delay(rng.choice([0, 3, 20]))
    live, pools = [], set()
    for step in range(3000):
        r = rng.random()
        try:
            if r < 0.45:
                s = rng.randrange(1, 400) if rng.random() < 0.8 else rng.randrange(1, 5)
                pool = rng.choice(sorted(pools)) if pools and rng.random() < 0.3 else None
                live.append(h.malloc(rng.choice([512, 4096, 100_000, 2 * MiB]), stream=s, pool=pool))
            elif r < 0.8 and live:
                p = live.pop(rng.randrange(len(live)))
                if rng.random() < 0.3:
                    h.record_stream(p, rng.randrange(1, 400))
                h.free(p)
            elif r < 0.85:
                pid = (rng.randrange(1, 4), 1)
                h.pool_retain(pid)
                pools.add(pid)
            elif r < 0.88 and pools:
                pid = rng.choice(sorted(pools))
                h.pool_release(pid)
                if not any(i["id"] == pid for i in h.pools()):
                    pools.discard(pid)
            elif r < 0.9:
                h.empty_cache()
            elif r < 0.92:
                h.sim_hold_stream(rng.randrange(1, 400), held=rng.random() < 0.5)
        except (gpumem.OutOfMemoryError, gpumem.DeviceError):
            pass  # a full heap, or a sync that would wait for a held stream
        if step % 50 == 0:
            h.check()
    for s in range(400):
        h.sim_hold_stream(s, held=False)
    for p in live:
        h.free(p)
    h.empty_cache()
    h.check()


# ---- the model of torch's native allocator (gpumem.native_model, csrc/model) ----------------------

NATIVE_SIZES = [0, 1, 511, 512, MiB, 1 << 32, 1 << 56, 1 << 62, 2**63 - 1, 2**63, 2**64 - 1]
NATIVE_EDGES = NATIVE_SIZES + [2**64, 2**100, -1, -(2**63)]


def test_native_model_arguments_that_call_back_into_the_model():
    """NativeModel converts its arguments before the engine runs: an __index__
    that allocates, frees or empties the cache of the same model meanwhile
    leaves its books sound; edge values get an answer or an ordinary error."""
    from gpumem.native_model import NativeAllocator

    m = NativeAllocator(capacity=64 * MiB, max_split_size=21 * MiB)
    held = []

    class Meddle:
        def __init__(self, v):
            self.v = v

        def __index__(self):
            if held:
                m.free(held.pop())
            x = m.malloc(5 * MiB)
            if x is not None:
                held.append(x)
            m.empty_cache()
            return self.v

    for i in range(60):
        x = m.malloc(Meddle(i * 700_001 % (30 * MiB)), stream=Meddle(i % 3))
        if x is not None:
            m.free(Meddle(x))
    for v in NATIVE_EDGES + [Meddle(MiB), RaiseIndex(), HugeIndex(), 1.5, None, "1"]:
        for call in (lambda: m.malloc(v), lambda: m.malloc(512, stream=v), lambda: m.free(v)):
            try:
                x = call()
            except (ValueError, TypeError, OverflowError, ZeroDivisionError):
                continue
            if isinstance(x, int):
                held.append(x)
    for x in held:
        m.free(x)
    assert m.empty_cache() >= 0 and (m.reserved, m.allocated, m.segments) == (0, 0, 0)


def test_native_replay_reads_any_buffer_of_whole_events():
    """Random ops, slots and sizes from bytes, an unaligned view or an array:
    the same answer from each, and an error for a partial event."""
    rng = random.Random(7)
    for _ in range(300):
        words = []
        for _ in range(rng.randrange(0, 60)):
            op = rng.choice([0, 0, 1, rng.randrange(2**32)])
            size = rng.choice(NATIVE_SIZES + [rng.randrange(1 << 30)])
            words += [op | rng.randrange(1 << 12) << 32, size, rng.choice([0, 1, 2**64 - 1])]
        raw = struct.pack(f"<{len(words)}Q", *words)
        kw = dict(capacity=rng.choice([64 * MiB, 1 << 62]), max_split_size=rng.choice([None, 21 * MiB]))
        got = _C.native_replay(raw, **kw)
        assert _C.native_replay(memoryview(b"x" + raw)[1:], **kw) == got
        assert _C.native_replay(bytearray(raw), stop_at_oom=True, **kw)["ooms"] <= 1
    with pytest.raises(ValueError, match="whole number"):
        _C.native_replay(b"x" * 23)
    with pytest.raises(TypeError):
        _C.native_replay([0, 512, 0])


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
