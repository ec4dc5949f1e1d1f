"""The process-wide heap registry seen from Python: one Heap type for a heap of
one's own and for the heap torch's allocations go to.

gpumem._C.registry_heap(device) borrows the registry's heap of a device (the one
torch's entry points, CuPy and Numba allocate from) as a gpumem.Heap: the same
type and methods as Heap(...), the same error paths, but closing or dropping it
only lets go of the heap.  Each case runs in a fresh interpreter with a
simulated device behind device 0, since the registry's heaps live until the
process ends.
"""

import pytest

# run_py: a fresh interpreter, a sim device behind device 0, torch's entry points
from helpers import needs_test_hooks, run_torch_sim as run_py

import gpumem
from gpumem import _C


def public(obj):
    return sorted(n for n in dir(obj) if not n.startswith("__"))


def test_borrowed_and_owned_heaps_are_one_type_with_the_same_methods():
    r = run_py("""
        import gpumem
        own = gpumem.Heap(capacity=1 << 30)
        shared = _C.registry_heap(0)
        out(same_type=type(shared) is type(own) is gpumem.Heap,
            own=sorted(n for n in dir(own) if not n.startswith("__")),
            shared=sorted(n for n in dir(shared) if not n.startswith("__")),
            registry=[own.registry_device, shared.registry_device], kinds=[own.device_kind, shared.device_kind])
    """)
    assert r["same_type"]
    assert r["own"] == r["shared"] == public(gpumem.Heap)
    assert r["registry"] == [None, 0] and r["kinds"] == ["sim", "sim"]


def test_deleting_a_borrowed_heap_leaves_torchs_heap_working():
    r = run_py("""
        import gc
        h = _C.registry_heap(0)
        p = alloc(3 * MiB, 0, None)                 # torch's entry point
        seen = h.block_size(p)
        del h
        gc.collect()
        q = alloc(5 * MiB, 0, None)                 # still served by the same heap
        h = _C.registry_heap(0)
        live = h.stats()["allocated_bytes.all.current"]
        h.close()                                   # lets go of it only
        closed = h.closed
        try:
            h.stats()
            after_close = "no error"
        except ValueError as e:
            after_close = str(e)
        try:
            h.__init__(capacity=1 << 30)                # a closed borrowed Heap does not become one's own
            reinit = "no error"
        except RuntimeError as e:
            reinit = str(e)
        again = _C.registry_heap(0)
        sizes = [again.block_size(p), again.block_size(q)]
        free(p, 3 * MiB, 0, None)
        free(q, 5 * MiB, 0, None)
        again.check()
        out(seen=seen, live=live, closed=closed, after_close=after_close, sizes=sizes, reinit=reinit,
            end=again.stats()["allocated_bytes.all.current"], devices=_C.registry_devices())
    """)
    assert r["seen"] == 3 << 20 and r["live"] == 8 << 20 and r["sizes"] == [3 << 20, 5 << 20]
    assert r["closed"] and "closed gpumem.Heap" in r["after_close"] and "borrows" in r["reinit"]
    assert r["end"] == 0 and r["devices"] == [0]


@needs_test_hooks
def test_borrowed_heap_methods_act_on_the_registry():
    r = run_py("""
        h = _C.registry_heap(0)
        h.set_cap(64 * MiB)                         # torch's path refuses above it at once
        try:
            _C._torch_test_alloc(100 * MiB, 0)
            refused = "no error"
        except Exception as e:
            refused = type(e).__name__
        h.set_cap(0)
        h.history_enable(100)                       # one switch for every registry heap, now and later
        hist = _C.registry_options()["history_entries"]
        p = alloc(MiB, 0, None)
        events = len(h.history()[0])
        free(p, MiB, 0, None)
        try:
            h.sim_set_external(1, MiB)              # the simulated device is not this Heap's to change
            sim = "no error"
        except TypeError as e:
            sim = str(e)
        errors = []
        import gpumem
        own = gpumem.Heap(capacity=1 << 30)
        for heap in (own, h):                       # the same error paths on both
            for call in (lambda: heap.free(12345), lambda: heap.pool_info((7, 7)), lambda: heap.malloc(-1)):
                try:
                    call()
                except Exception as e:
                    errors.append(type(e).__name__ + ": " + str(e))
        out(refused=refused, hist=hist, events=events, sim=sim, errors=errors, cap=h.get_cap())
    """)
    assert r["refused"] != "no error" and r["cap"] == 0
    assert r["hist"] == 100 and r["events"] >= 1
    assert "heap registry" in r["sim"]
    own, shared = r["errors"][:3], r["errors"][3:]
    assert own == shared and own[0].startswith("InvalidPointerError") and own[1].startswith("ValueError: no pool")


def test_registry_heap_refuses_bad_devices_and_opens_nothing_when_asked_not_to():
    with pytest.raises(ValueError, match="out of range"):
        _C.registry_heap(64)
    with pytest.raises(ValueError, match="out of range"):
        _C.registry_heap(-1, open=False)
    assert _C.registry_heap(63, open=False) is None and 63 not in _C.registry_devices()


def test_cupy_and_numba_backends_allocate_from_the_registry_heap_through_heap_methods():
    r = run_py("""
        import gpumem
        from gpumem._backend import Backend
        b = Backend("cupy")
        p = b.malloc(3 * MiB, 0)
        q = alloc(2 * MiB, 0, None)                     # torch's allocation, the same heap
        h = b.explain_heap(0)
        frameworks = gpumem.snapshot(h).by_framework()   # torch's blocks are untagged: "torch" on these heaps
        try:
            b.malloc(2 << 30, 0)
            oom = "no error"
        except gpumem.OutOfMemoryError as e:
            oom = str(e)
        b.free(p, 0)
        try:
            b.free(p, 0)
            twice = "no error"
        except ValueError as e:
            twice = type(e).__name__
        free(q, 2 * MiB, 0, None)
        h.check()
        out(same=h.registry_device, frameworks=frameworks, oom=oom, twice=twice,
            live=h.stats()["allocated_bytes.all.current"])
    """)
    assert r["same"] == 0 and r["live"] == 0
    assert r["oom"].startswith("CUDA out of memory. Tried to allocate 2.00 GiB on GPU 0 for cupy (gpumem's heap")
    assert "What to do" in r["oom"] and r["twice"] == "InvalidPointerError"
    assert r["frameworks"] == {"cupy": [3 << 20, 1], "torch": [2 << 20, 1]}
