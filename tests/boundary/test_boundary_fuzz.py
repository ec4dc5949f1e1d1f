"""Fuzz of the Python boundary: every Heap entry point with hostile arguments.

Each case draws an entry point (every Heap method, the constructor, and
gpumem._C.format_bytes) and arguments from a fixed list of hostile
values: ints at the edges of every range, objects whose __index__ closes the
heap, raises, returns a huge value or empties a list, sequences that lie
about their length or close the heap while iterated, strings, floats, None,
buffers that alias each other, and a second thread that closes the heap or
rewrites a buffer while a call runs.  A case passes when the call returns or
raises an ordinary exception and the heap, if still open, passes check().

The seeds are fixed (derandomised); GPUMEM_BOUNDARY_CASES sets how many cases
run (default 6000; .ci/boundary_asan runs more under ASan and UBSan with
PYTHONMALLOC=malloc, where a crash or a sanitizer report fails the run).
"""

import os
import random
import struct
import sys
import threading
import traceback

import gpumem
from gpumem import _C

EV = struct.Struct("<IIQQ")
CASES = int(os.environ.get("GPUMEM_BOUNDARY_CASES", "6000"))
SEEDS = (1, 2, 3)

EDGE_INTS = [0, 1, 7, 511, 512, 4096, 1 << 20, (1 << 21) + 3, 1 << 32, 1 << 40, 1 << 52, 1 << 62]
EDGE_INTS += [2**63 - 1, 2**63, 2**64 - 512, 2**64 - 511, 2**64 - 1, 2**64, 2**100, -1, -(2**63)]


class State:
    """One heap under fuzz, and what the hostile values act on."""

    def __init__(self, rng):
        self.rng = rng
        self.heap = gpumem.Heap(device="sim", capacity="64MiB")
        self.ptrs = []  # addresses handed out
        self.shared = []  # a list that hostile values empty
        self.tainted = False  # sim_unmap succeeded: the heap's books are wrong by design


class ActingIndex:
    """An integer whose conversion first does something hostile: act()."""

    def __init__(self, act, v):
        self.act, self.v = act, v

    def __index__(self):
        self.act()
        return self.v


class RaiseIndex:
    def __index__(self):
        raise ZeroDivisionError("hostile __index__")


class HugeIndex:
    def __index__(self):
        return 2**70


def close_from_another_thread(st):
    """Close the heap from another thread while the conversion waits."""
    t = threading.Thread(target=st.heap.close)
    t.start()
    t.join()


class LyingSeq:
    def __init__(self, st, items, n, close_in_iter):
        self.st, self.items, self.n, self.close_in_iter = st, items, n, close_in_iter

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i >= len(self.items):
            raise IndexError(i)
        return self.items[i]

    def __iter__(self):
        if self.close_in_iter:
            self.st.heap.close()
        self.st.shared.clear()
        return iter(self.items)


def an_int(st):
    r = st.rng.random()
    if r < 0.35 and st.ptrs:
        return st.rng.choice(st.ptrs) + st.rng.choice([0, 0, 0, 512, -512, 1])
    if r < 0.75:
        return st.rng.choice(EDGE_INTS)
    v = st.rng.choice([4096, 512, 0, 1 << 20])
    if st.rng.random() < 0.3 and st.ptrs:
        v = st.rng.choice(st.ptrs)
    kind = st.rng.randrange(9)
    return [
        lambda: ActingIndex(lambda: st.heap.close(), v),
        lambda: RaiseIndex(),
        lambda: HugeIndex(),
        lambda: ActingIndex(st.shared.clear, v),
        lambda: ActingIndex(lambda: close_from_another_thread(st), v),
        lambda: "1MiB",
        lambda: 1.5,
        lambda: None,
        lambda: True,
    ][kind]()


def a_pool(st):
    r = st.rng.random()
    if r < 0.5:
        return (st.rng.choice([1, 2]), 1)
    if r < 0.7:
        st.shared[:] = [an_int(st), an_int(st)]
        return st.shared
    return st.rng.choice([(0, 0), (1,), (1, 2, 3), "ab", None, [an_int(st), an_int(st)], (an_int(st), 1)])


def blocks(st):
    items = [(an_int(st), an_int(st)) for _ in range(st.rng.randrange(4))]
    if st.ptrs and st.rng.random() < 0.5:
        p = st.rng.choice(st.ptrs)
        items.append((p, st.heap.block_size(p) if not st.heap.closed else 512))
    r = st.rng.random()
    if r < 0.4:
        st.shared[:] = items
        return st.shared
    if r < 0.7:
        return LyingSeq(st, items, st.rng.choice([0, len(items) + 5, 10**9]), st.rng.random() < 0.3)
    return st.rng.choice([items, tuple(items), [1, 2], [(1,)], 5, None])


def trace(st):
    n = st.rng.randrange(6)
    raw = b"".join(
        EV.pack(st.rng.choice([0, 1, 2]), st.rng.randrange(8), st.rng.choice([0, 512, 4096, 1 << 40]), 0)
        for _ in range(n)
    )
    buf = bytearray(raw + bytes(st.rng.choice([0, 0, 0, 5])))
    return buf


def replay_case(st):
    buf = trace(st)
    n_slots = st.rng.choice([8, 8, 4, 0, an_int(st)])
    kw = {}
    r = st.rng.random()
    if r < 0.3:
        kw["slots"] = memoryview(buf)[: 8 * (len(buf) // 8)][:64]  # aliases the events
    elif r < 0.6:
        kw["slots"] = bytearray(8 * 8)
    elif r < 0.7:
        kw["slots"] = st.rng.choice([b"x" * 64, bytearray(), memoryview(bytearray(65))[1:], 5])
    if st.rng.random() < 0.3:
        kw["timing"] = True
    if st.rng.random() < 0.3:
        kw["stop_at"] = st.rng.choice([-2, -1, 0, 1, 2**63 - 1])
    scribble = st.rng.random() < 0.2
    stop = threading.Event()

    def scribbler():
        rng = random.Random(st.rng.random())
        while not stop.is_set():
            if buf:
                buf[rng.randrange(len(buf))] = rng.randrange(256)

    t = threading.Thread(target=scribbler) if scribble else None
    if t:
        t.start()
    try:
        return st.heap.replay(buf, n_slots, **kw)
    finally:
        stop.set()
        if t:
            t.join()


def op_name(st):
    return st.rng.choice([*_C.DEVICE_OPS, "nope", 5, None])


def entry_points(st):
    h = st.heap
    return {
        "malloc": lambda: st.ptrs.append(
            h.malloc(an_int(st), **st.rng.choice([{}, {"stream": an_int(st)}, {"pool": a_pool(st)}]))
        ),
        "malloc small": lambda: st.ptrs.append(
            h.malloc(st.rng.choice([512, 4096, 1 << 20]), stream=st.rng.randrange(4))
        ),
        "free": lambda: h.free(an_int(st)),
        "record_stream": lambda: h.record_stream(an_int(st), an_int(st)),
        "block_size": lambda: h.block_size(an_int(st)),
        "empty_cache": h.empty_cache,
        "set_cap": lambda: h.set_cap(an_int(st)),
        "get_cap": h.get_cap,
        "stats": h.stats,
        "check": h.check,
        "snapshot": h.snapshot,
        "history_enable": lambda: h.history_enable(st.rng.choice([0, 16, an_int(st)])),
        "history": h.history,
        "mem_info": h.mem_info,
        "device_processes": h.device_processes,
        "last_oom": h.last_oom,
        "memory_report": lambda: h.memory_report(an_int(st)),
        "pool_retain": lambda: h.pool_retain(a_pool(st)),
        "pool_release": lambda: h.pool_release(a_pool(st)),
        "pool_info": lambda: h.pool_info(a_pool(st)),
        "pools": h.pools,
        "pool_live": lambda: h.pool_live(a_pool(st)),
        "pool_set_live": lambda: h.pool_set_live(a_pool(st), blocks(st), **st.rng.choice([{}, {"stream": an_int(st)}])),
        "pool_pause": lambda: h.pool_pause(a_pool(st), backup=st.rng.random() < 0.5),
        "pool_resume": lambda: h.pool_resume(a_pool(st)),
        "capture": lambda: (h.capture_begin(), h.capture_end()),
        "replay": lambda: replay_case(st),
        "sim_fail": lambda: h.sim_fail(op_name(st), nth=an_int(st), count=st.rng.choice([1, 2, an_int(st)])),
        "sim_fail_random": lambda: h.sim_fail_random(
            op_name(st), st.rng.choice([0.0, 0.1, 2.0, float("nan")]), seed=an_int(st)
        ),
        "sim_calls": lambda: h.sim_calls(op_name(st)),
        "sim_hold_stream": lambda: h.sim_hold_stream(an_int(st), held=st.rng.random() < 0.5),
        "sim_set_event_delay": lambda: h.sim_set_event_delay(st.rng.choice([0, 1, 3, an_int(st)])),
        "sim_set_external": lambda: h.sim_set_external(an_int(st), an_int(st)),
        "sim_set_self": lambda: h.sim_set_self(an_int(st), an_int(st)),
        "sim_set_nvml": lambda: h.sim_set_nvml(st.rng.random() < 0.5),
        "sim_info": h.sim_info,
        "sim_is_accessible": lambda: h.sim_is_accessible(an_int(st), an_int(st)),
        "sim_set_capture": lambda: (h.sim_set_capture(True), h.sim_set_capture(False)),
        "sim_set_stream_capture": lambda: h.sim_set_stream_capture(an_int(st), on=st.rng.random() < 0.3),
        "sim_page_at": lambda: h.sim_page_at(an_int(st)),
        "sim_write": lambda: h.sim_write(an_int(st), an_int(st)),
        "sim_read": lambda: h.sim_read(an_int(st)),
        "sim_host_blocks": h.sim_host_blocks,
        "sim_capture_violations": h.sim_capture_violations,
        "cuda_fault_calls": lambda: h.cuda_fault_calls(op_name(st)),
        "format_bytes": lambda: _C.format_bytes(an_int(st)),
        "repr": lambda: repr(h),
        "page_size": lambda: h.page_size,
    }


def construct(st):
    """Heap(...) with hostile options; sizes stay small enough that a heap that is
    made has page tables of a few MB (huge address ranges are the core's tests)."""
    rng = st.rng

    def pick(values):
        v = rng.choice(values)
        return an_int(st) if v is any else v

    kw = {
        "capacity": pick([1, 511, 4096, 1 << 20, 64 << 20, "64MiB", "junk", any]),
        "page_size": pick([0, 1, 512, 4096, 1 << 21, 1 << 30, 1 << 42, 1 << 43, 2**63, 2**64, -1, "2MiB", any]),
        "va_size": pick([0, 1, 1 << 30, 2**64 - 1, 2**64, -1, "1GiB"]),
        "cap": pick([0, 1, 2**64 - 1, "1MiB", "junk", any]),
        "chunk_pages": pick([None, 0, 1, 1024, 1025, 2**64]),
        "growth_slack": pick([None, -1.0, float("nan"), 0.5, 101.0, "x"]),
        "growth_slack_pages": pick([None, 0, 2**64 - 1, any]),
    }
    for k in list(kw):
        if rng.random() < 0.4:
            del kw[k]
    h = gpumem.Heap(device=rng.choice(["sim", "sim", "sim", "nope"]), **kw)
    if h.closed:
        return
    try:
        h.free(h.malloc(rng.choice([512, 4096, 1 << 20])))
    except Exception:
        pass
    if not h.closed:
        h.check()
        h.close()


def run_case(st, name):
    """One call; returns None, or the text of a failure."""
    try:
        if name == "Heap()":
            construct(st)
        elif name == "sim_unmap":
            st.heap.sim_unmap(an_int(st), an_int(st))
            st.tainted = True  # it succeeded: the device unmapped behind the heap's back
        else:
            entry_points(st)[name]()
    except Exception as e:  # an ordinary exception is a pass: only a crash or corruption fails
        if isinstance(e, gpumem.CorruptionError):
            return f"{name}: {e!r}"
    if not st.heap.closed and not st.tainted:
        try:
            st.heap.check()
        except Exception:
            return f"{name}: check() after it failed:\n{traceback.format_exc()}"
    return None


def fuzz(seed, cases):
    rng = random.Random(seed)
    st = State(rng)
    names = sorted(entry_points(st)) + ["sim_unmap", "Heap()"]
    failures = []
    for i in range(cases):
        if st.heap.closed or st.tainted or rng.random() < 0.02:
            st.heap.close() if not st.tainted else None
            st = State(rng)
        st.ptrs = st.ptrs[-64:]
        name = rng.choice(names)
        f = run_case(st, name)
        if f:
            failures.append(f"seed {seed} case {i}: {f}")
    if not st.heap.closed:
        st.heap.close()
    return failures


def test_boundary_fuzz():
    per_seed = max(1, CASES // len(SEEDS))
    failures = []
    for seed in SEEDS:
        failures += fuzz(seed, per_seed)
    print(f"boundary fuzz: {per_seed * len(SEEDS)} cases, {len(failures)} failures", file=sys.stderr)
    assert not failures, "\n".join(failures[:5])


if __name__ == "__main__":  # pragma: no cover
    n = int(sys.argv[1]) if len(sys.argv) > 1 else CASES
    fails = []
    for s in SEEDS:
        fails += fuzz(s, max(1, n // len(SEEDS)))
    print(f"boundary fuzz: {max(1, n // len(SEEDS)) * len(SEEDS)} cases, {len(fails)} failures")
    for f in fails[:10]:
        print(f)
    sys.exit(1 if fails else 0)
