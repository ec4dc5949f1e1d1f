"""Concurrency: Python threads share one heap.

malloc/free/empty_cache release the GIL while in the core, so these threads
really run the core at the same time; the heap's own lock must keep it whole.
"""

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import gpumem
from helpers import MiB, assert_ok, drain_and_assert_empty, recount

N_THREADS = 4
OPS_PER_THREAD = 3000


def _hammer_step(h, rng, tid, mine, shadow, lock):
    """One random free (with a record_stream now and then) or malloc of thread tid, checked against the
    shadow of every thread's live blocks."""
    if mine and (rng.random() < 0.45 or len(mine) > 200):
        p = mine.pop(rng.randrange(len(mine)))
        if rng.random() < 0.1:
            h.record_stream(p, 0x1000 * rng.randrange(1, N_THREADS + 1))
        # Out of the shadow before the core may hand it out again.
        with lock:
            del shadow[p]
        h.free(p)
        return
    size = int(2 ** rng.uniform(0, 24))  # 1 B .. 16 MiB
    try:
        p = h.malloc(size, stream=0x1000 * (tid + 1), context=tid)
    except gpumem.OutOfMemoryError:
        return
    bs = h.block_size(p)
    assert p % 512 == 0 and bs >= size
    with lock:
        for a, s in shadow.items():
            if a < p + bs and p < a + s:
                raise AssertionError(f"thread {tid}: {p:#x}+{bs} overlaps {a:#x}+{s}")
        shadow[p] = bs
    mine.append(p)


def _whole_heap_op(h, op):
    """A whole-heap operation that takes the heap's lock: empty_cache, check, stats or snapshot."""
    if op == 0:
        h.empty_cache()
    elif op == 1:
        h.check()
    elif op == 2:
        st = h.stats()
        assert st["allocated_bytes.all.current"] <= st["reserved_bytes.all.current"]
    else:
        h.snapshot()


def test_threads_hammer_one_heap(make_heap):
    h = make_heap(capacity=512 * MiB)
    shadow = {}  # addr -> size, over all threads
    lock = threading.Lock()
    failures = []
    barrier = threading.Barrier(N_THREADS + 1)  # the workers and the janitor
    stop = threading.Event()

    def worker(tid):
        rng = random.Random(tid)
        mine = []
        try:
            barrier.wait()
            for _ in range(OPS_PER_THREAD):
                _hammer_step(h, rng, tid, mine, shadow, lock)
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append((tid, repr(exc)))
            stop.set()

    def janitor():
        # Concurrent whole-heap operations: they take the same lock.
        rng = random.Random(99)
        barrier.wait()
        while not stop.is_set():
            try:
                _whole_heap_op(h, rng.randrange(4))
            except BaseException as exc:  # noqa: BLE001
                failures.append(("janitor", repr(exc)))
                return

    workers = [threading.Thread(target=worker, args=(i,)) for i in range(N_THREADS)]
    jan = threading.Thread(target=janitor)
    for t in workers:
        t.start()
    jan.start()
    for t in workers:
        t.join()
    stop.set()
    jan.join()
    assert not failures, failures

    assert_ok(h)
    st = h.stats()
    for key, want in recount(h).items():
        assert st[key] == want, key
    assert st["allocated_bytes.all.current"] == sum(shadow.values())
    assert st["allocation.all.current"] == len(shadow)
    for p, s in shadow.items():
        assert h.block_size(p) == s
        assert h.sim_is_accessible(p, s)
    assert st["allocation.all.allocated"] - st["allocation.all.freed"] == len(shadow)
    drain_and_assert_empty(h, list(shadow))


def test_threads_each_with_own_heap():
    """Heaps share no state: one per thread, all busy at once."""

    def run(seed):
        with gpumem.Heap(device="sim", capacity=256 * MiB) as h:
            rng = random.Random(seed)
            live = []
            for _ in range(2000):
                if live and rng.random() < 0.5:
                    h.free(live.pop(rng.randrange(len(live))))
                else:
                    try:
                        live.append(h.malloc(rng.randrange(1, 8 * MiB)))
                    except gpumem.OutOfMemoryError:
                        pass
            h.check()
            assert h.stats()["allocation.all.current"] == len(live)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(run, range(4)))  # raises what a thread raised
