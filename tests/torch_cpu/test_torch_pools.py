"""Private pools on torch's path, without a GPU.

The C boundary torch calls (csrc/python/torch_alloc.cpp) is driven here through
ctypes, with a simulated device behind the torch heap (_C.registry_open_sim): the
allocation entry point, the C forms of the begin/end/release pool hooks (the
same code torch's std::function hooks run), and empty_cache.  Each case runs
in a fresh interpreter, since torch's heaps live until the process ends.
Then the Python side: the C++ ABI guard on the hooks, cudagraph trees'
checkpoint functions on a sim-backed heap, and the torch-header checkpoint
module built against the installed (CPU) torch.
"""

import subprocess

import pytest

from helpers import run_torch_sim as run_py


def test_filter_routes_allocations_and_pool_blocks_stay_in_the_pool():
    r = run_py("""
        f7 = stream_is(7)
        assert begin(0, 1, 0, f7) == 0
        assert _C._torch_active_pools(0) == [(1, 0)] and _C.registry_heap(0).capturing
        a = alloc(3 * MiB, 0, 7)              # stream the filter accepts: into the pool
        b = alloc(3 * MiB, 0, 3)              # another stream: the general heap
        assert live((1, 0)) == {a} and b not in live((1, 0))
        free(a, 0, 0, 7)
        check()
        assert live((1, 0)) == set() and _C.registry_heap(0).pool_info((1, 0))["free_bytes"] >= 3 * MiB
        others = [alloc(3 * MiB, 0, 3) for _ in range(4)]    # never a's block
        assert a not in others
        a2 = alloc(3 * MiB, 0, 7)             # the pool reuses its own block
        assert a2 == a and live((1, 0)) == {a}
        assert end(0, 1, 0) == 0 and end(0, 1, 0) != 0     # ended once
        assert _C._torch_active_pools(0) == [] and not _C.registry_heap(0).capturing
        outside = alloc(3 * MiB, 0, 7)        # no pool active: the general heap
        assert outside not in live((1, 0))
        free(a2, 0, 0, 7)
        more = [alloc(3 * MiB, 0, 3) for _ in range(4)]   # the pool still lives: its block is kept
        assert a not in more
        info = _C.registry_heap(0).pool_info((1, 0))
        assert info["use_count"] == 1 and info["live_blocks"] == 0
        assert release(0, 1, 0) == 0          # last use: the pool ends
        assert _C.registry_heap(0).pools() == []
        assert release(0, 1, 0) != 0
        check()
        for p in [b, outside] + others + more:
            free(p, 0, 0, 3)
        check()
        out(ok=True)
    """)
    assert r["ok"]


def test_latest_active_pool_whose_filter_accepts_wins():
    # torch searches the pools being allocated to newest first (a use_mem_pool nested
    # in another allocates to the inner pool), and so does gpumem
    r = run_py("""
        assert begin(0, 2, 0, ANY) == 0       # no filter: every stream
        assert begin(0, 0, 5, stream_is(1)) == 0
        assert _C._torch_active_pools(0) == [(2, 0), (0, 5)]
        p1 = alloc(MiB, 0, 1)
        p2 = alloc(MiB, 0, 2)
        assert live((0, 5)) == {p1} and live((2, 0)) == {p2}
        assert begin(0, 0, 7, ANY) == 0       # nested inside both: takes every stream
        p4 = alloc(MiB, 0, 1)
        assert live((0, 7)) == {p4}
        assert end(0, 0, 7) == 0 and release(0, 0, 7) == 0
        free(p4, 0, 0, 0)
        assert end(0, 0, 5) == 0
        p3 = alloc(MiB, 0, 1)                 # now only the catch-all is active
        assert p3 in live((2, 0))
        # the same pool begun twice (two threads, two captures): two uses, two ends
        assert begin(0, 2, 0, stream_is(9)) == 0
        assert _C.registry_heap(0).pool_info((2, 0))["use_count"] == 2
        assert end(0, 2, 0) == 0 and _C.registry_heap(0).capturing
        assert end(0, 2, 0) == 0 and not _C.registry_heap(0).capturing
        for p in (p1, p2, p3):
            free(p, 0, 0, 0)
        for pool in ((0, 5), (2, 0), (2, 0)):
            assert release(0, *pool) == 0
        assert _C.registry_heap(0).pools() == []
        check()
        out(ok=True)
    """)
    assert r["ok"]


def test_empty_cache_waits_for_the_capture_to_end():
    r = run_py("""
        blocks = [alloc(8 * MiB, 0, 0) for _ in range(8)]
        for p in blocks:
            free(p, 0, 0, 0)
        held = _C.registry_heap(0).stats()["reserved_bytes.all.current"]
        assert begin(0, 3, 0, stream_is(4)) == 0
        empty_cache()                         # during a capture: nothing unmapped
        during = _C.registry_heap(0).stats()["reserved_bytes.all.current"]
        unmaps = _C.registry_heap(0).stats()["num_unmaps"]
        assert end(0, 3, 0) == 0
        empty_cache()
        after = _C.registry_heap(0).stats()["reserved_bytes.all.current"]
        assert release(0, 3, 0) == 0
        check()
        out(held=held, during=during, after=after, unmaps=unmaps)
    """)
    assert r["held"] >= 64 << 20 and r["during"] == r["held"] and r["unmaps"] == 0
    assert r["after"] < r["held"]


def test_pool_hooks_need_a_heap_and_torch_types():
    C = pytest.importorskip("gpumem._C")
    ep = C._torch_entry_points()
    hooks = {ep["begin_allocate_to_pool"], ep["end_allocate_to_pool"], ep["release_pool"]}
    assert len(hooks) == 3 and 0 not in hooks
    assert C._torch_cxx11_abi() in (0, 1)
    with pytest.raises(ValueError, match="pair of ints"):
        C.Heap(capacity=1 << 30).pool_live((1, 2, 3))


class _Hooks:
    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda addr: self.calls.append((name, addr))


class _FakeTorch:
    class _C:
        _GLIBCXX_USE_CXX11_ABI = None


def test_pool_hooks_are_set_only_when_the_cxx_abi_matches():
    from gpumem import _C
    from gpumem.torch import _pools

    entry = _C._torch_entry_points()
    same, other = _FakeTorch(), _FakeTorch()
    same._C = type("C", (), {"_GLIBCXX_USE_CXX11_ABI": bool(_C._torch_cxx11_abi())})
    other._C = type("C", (), {"_GLIBCXX_USE_CXX11_ABI": not _C._torch_cxx11_abi()})
    h = _Hooks()
    try:
        with pytest.warns(RuntimeWarning, match="C\\+\\+ standard library ABI"):
            assert _pools.set_pool_hooks(other, h, entry) is False
        assert h.calls == []
        with pytest.raises(RuntimeError, match="GPUMEM_CXX11_ABI"):
            _pools.refuse_capture(None)
        assert _pools.set_pool_hooks(same, h, entry) is True
        assert h.calls == [
            ("set_begin_allocate_to_pool", entry["begin_allocate_to_pool"]),
            ("set_end_allocate_to_pool_fn", entry["end_allocate_to_pool"]),
            ("set_release_pool", entry["release_pool"]),
        ]
    finally:
        _pools._hooks_error = None


def test_cudagraph_tree_checkpoint_functions_on_a_sim_heap(tmp_path):
    pytest.importorskip("torch")
    r = run_py(f"""
        import os
        os.environ["GPUMEM_CACHE_DIR"] = {str(tmp_path)!r}
        from gpumem.torch import _pools
        assert begin(0, 6, 0, ANY) == 0
        a, b, c = (alloc(MiB, 0, 5) for _ in range(3))
        assert end(0, 6, 0) == 0
        assert _pools.check_pool_live_allocations(0, (6, 0), [a, b, c])
        assert not _pools.check_pool_live_allocations(0, (6, 0), [a, b])
        state = _pools.CheckpointState(0, (6, 0), _C.registry_heap(0).pool_live((6, 0)), 5)
        free(b, 0, 0, 5); free(c, 0, 0, 5)
        assert live((6, 0)) == {{a}}
        _pools.set_checkpoint_pool_state(0, state, [], [])   # b and c live again, at their addresses
        assert live((6, 0)) == {{a, b, c}}
        check()
        # blocks live now that the state does not hold need their stale storages
        state2 = _pools.CheckpointState(0, (6, 0), [(a, MiB)], 5)
        try:
            _pools.set_checkpoint_pool_state(0, state2, [], [])
            raise AssertionError("no error")
        except RuntimeError as e:
            assert "stale tensors" in str(e)
        assert live((6, 0)) == {{a, b, c}}   # nothing changed
        import torch
        # storages over b and c (sim addresses: never touched), as the stale tensors would be
        stale = [torch._C._construct_storage_from_data_pointer(p, torch.device("cpu"), MiB) for p in (b, c)]
        _pools.set_checkpoint_pool_state(0, state2, [s._cdata for s in stale], [])
        assert live((6, 0)) == {{a}}
        del stale
        _pools._gpumem_raw_delete(a)        # the deleter restored storages get
        assert live((6, 0)) == set()
        check()
        out(ok=True)
    """)
    assert r["ok"]


def test_checkpoint_module_swaps_storage_deleters(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    import ctypes

    from gpumem.torch import _checkpoint

    monkeypatch.setenv("GPUMEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(_checkpoint, "_lib", None)
    buf = ctypes.create_string_buffer(4096)
    ptr = ctypes.addressof(buf)
    # a storage with no deleter, as cudagraph trees make for a replay's outputs
    storage = torch._C._construct_storage_from_data_pointer(ptr, torch.device("cpu"), 4096)
    freed = []
    deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(lambda p: freed.append(p))
    with pytest.raises(RuntimeError, match="does not point at a block"):
        _checkpoint.add_deleters([storage._cdata], [ptr + 512], ctypes.cast(deleter, ctypes.c_void_p).value, 0)
    d = ctypes.cast(deleter, ctypes.c_void_p).value
    _checkpoint.add_deleters([storage._cdata], [ptr], d, 0)
    assert freed == [] and _checkpoint.has_deleter(storage._cdata, d)
    del storage
    assert freed == [ptr]
    # torch's _free_And_Remove_DeleterFn for such a storage: freed now, never again
    storage = torch._C._construct_storage_from_data_pointer(ptr, torch.device("cpu"), 4096)
    assert not _checkpoint.free_and_remove(storage._cdata, d)  # not ours: untouched
    _checkpoint.add_deleters([storage._cdata], [ptr], d, 0)
    assert _checkpoint.free_and_remove(storage._cdata, d) and freed == [ptr, ptr]
    assert not _checkpoint.has_deleter(storage._cdata, d)
    del storage
    assert freed == [ptr, ptr]
    freed.clear()
    freed.append(ptr)
    # a stale storage whose block was freed stops owning it
    storage = torch._C._construct_storage_from_data_pointer(ptr, torch.device("cpu"), 4096)
    _checkpoint.add_deleters([storage._cdata], [ptr], ctypes.cast(deleter, ctypes.c_void_p).value, 0)
    _checkpoint.release_deleters([storage._cdata], [ptr])
    del storage
    assert freed == [ptr]
    assert list(tmp_path.glob("checkpoint-*.so"))


# torch's own way of calling the pool hooks: a std::function built from the
# address (CUDAPluggableAllocator's Python binding), called with a std::function
# filter (CUDAGraph::capture_begin).  Built here with the same ABI flag.
HOOK_CALLER = r"""
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <utility>
struct CUstream_st;
using Pool = std::pair<unsigned long long, unsigned long long>;
using Filter = std::function<bool(CUstream_st *)>;
using Begin = void(int, Pool, Filter);
using EndOrRelease = void(int, Pool);
extern "C" int call_begin(uint64_t addr, int device, uint64_t a, uint64_t b, uint64_t accept) {
    std::function<Begin> fn = reinterpret_cast<Begin *>(addr);
    try {
        fn(device, Pool{a, b}, [accept](CUstream_st *s) { return (uint64_t)(uintptr_t)s == accept; });
    } catch (const std::exception &) {
        return -1;
    }
    return 0;
}
extern "C" int call_end_or_release(uint64_t addr, int device, uint64_t a, uint64_t b) {
    std::function<EndOrRelease> fn = reinterpret_cast<EndOrRelease *>(addr);
    try {
        fn(device, Pool{a, b});
    } catch (const std::exception &) {
        return -1;
    }
    return 0;
}
"""


def test_std_function_hooks_called_the_way_torch_calls_them(tmp_path):
    import shutil

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    from gpumem import _C

    src = tmp_path / "caller.cpp"
    src.write_text(HOOK_CALLER)
    lib = tmp_path / "caller.so"
    subprocess.run(
        [
            cxx,
            "-std=c++17",
            "-shared",
            "-fPIC",
            f"-D_GLIBCXX_USE_CXX11_ABI={_C._torch_cxx11_abi()}",
            str(src),
            "-o",
            str(lib),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    r = run_py(f"""
        caller = ctypes.CDLL({str(lib)!r})
        u64 = ctypes.c_uint64
        caller.call_begin.argtypes = [u64, ctypes.c_int, u64, u64, u64]
        caller.call_end_or_release.argtypes = [u64, ctypes.c_int, u64, u64]
        ep = _C._torch_entry_points()
        assert caller.call_begin(ep["begin_allocate_to_pool"], 0, 8, 0, 11) == 0
        assert _C._torch_active_pools(0) == [(8, 0)] and _C.registry_heap(0).capturing
        a = alloc(MiB, 0, 11)                  # the filter (a C++ lambda held by gpumem) accepts
        b = alloc(MiB, 0, 12)                  # and refuses
        assert live((8, 0)) == {{a}}
        assert caller.call_end_or_release(ep["end_allocate_to_pool"], 0, 8, 0) == 0
        assert _C._torch_active_pools(0) == [] and not _C.registry_heap(0).capturing
        free(a, 0, 0, 11); free(b, 0, 0, 12)
        assert caller.call_end_or_release(ep["release_pool"], 0, 8, 0) == 0
        assert _C.registry_heap(0).pools() == []
        assert caller.call_end_or_release(ep["release_pool"], 0, 8, 0) == -1   # unknown pool: a C++ exception
        assert caller.call_begin(ep["begin_allocate_to_pool"], 70, 1, 0, 0) == -1  # bad device
        check()
        out(ok=True)
    """)
    assert r["ok"]


# torch's allocator runs a pool's stream filter under its lock, so once
# endAllocateToPool returns the filter is never running or called again -- and
# CUDAGraph's filter reads the graph object, which may then be deleted.  gpumem
# runs filters outside its lock: ending a pool must wait for the filters in flight.
def test_ending_a_pool_waits_for_its_filter_in_flight():
    r = run_py("""
        import threading, time
        entered, log = threading.Event(), []
        def slow(s):
            entered.set()
            time.sleep(0.3)
            log.append("filter returned")
            return 0
        f = FILTER(slow)
        assert begin(0, 0, 5, f) == 0
        t = threading.Thread(target=lambda: log.append("allocated" if alloc(MiB, 0, 3) else "failed"))
        t.start()
        entered.wait()
        assert end(0, 0, 5) == 0
        log.append("end returned")
        t.join()
        check()
        out(log=log)
    """)
    log = r["log"]
    assert sorted(log) == ["allocated", "end returned", "filter returned"], r
    assert log.index("filter returned") < log.index("end returned"), r


def test_a_forked_child_ends_a_pool_whose_filter_ran_in_a_vanished_thread():
    r = run_py("""
        import os, signal, threading, time
        entered = threading.Event()
        def slow(s):
            entered.set()
            time.sleep(0.5)
            return 0
        f = FILTER(slow)
        assert begin(0, 0, 5, f) == 0
        t = threading.Thread(target=lambda: alloc(MiB, 0, 3))
        t.start()
        entered.wait()
        pid = os.fork()
        if pid == 0:  # the thread in the filter does not exist here
            signal.alarm(20)
            os._exit(0 if end(0, 0, 5) == 0 else 3)
        _, status = os.waitpid(pid, 0)
        t.join()
        assert end(0, 0, 5) == 0
        check()
        out(status=status)
    """)
    assert r["status"] == 0, r


def test_a_small_graph_reserves_a_page_of_its_own_and_sharing_a_pool_saves_it():
    # A graph pool's blocks never share a page with eager memory: capturing a small graph
    # beside an eager tensor grows reserved memory by one page, as a native small segment
    # does; two graphs sharing one pool reserve one page less than two pools; once the
    # graphs are gone, only the page of the output still alive stays.
    r = run_py("""
        f5 = stream_is(5)
        def reserved():
            return _C.registry_heap(0).stats()["reserved_bytes.all.current"]
        def capture(pool):
            assert begin(0, pool, 0, f5) == 0
            temps = [alloc(4096, 0, 5) for _ in range(3)]
            for t in temps[:2]:
                free(t, 0, 0, 5)
            assert end(0, pool, 0) == 0
            return temps[2]                    # the graph's output
        first = alloc(4096, 0, 5)              # eager, on the capture stream
        before = reserved()
        y = capture(1)
        delta = reserved() - before
        z = capture(2)                         # a second graph, a pool of its own
        two_pools = reserved() - before
        for p, pool in ((z, 2), (y, 1)):
            free(p, 0, 0, 5)
            assert release(0, pool, 0) == 0
        empty_cache()
        after_release = reserved() - before
        y = capture(3)
        z = capture(3)                         # the same pool again: its free memory serves
        one_pool = reserved() - before
        free(y, 0, 0, 5)
        assert release(0, 3, 0) == 0           # the graph is gone, z (its output) lives on
        empty_cache()
        kept = reserved() - before
        check()
        free(z, 0, 0, 5)
        free(first, 0, 0, 5)
        check()
        out(delta=delta, two_pools=two_pools, one_pool=one_pool, after_release=after_release, kept=kept)
    """)
    page = 2 << 20
    assert r["delta"] == page and r["two_pools"] == 2 * page
    assert r["after_release"] == 0
    assert r["one_pool"] == page, "two graphs sharing a pool should reserve one page less than two pools"
    assert r["kept"] == page
