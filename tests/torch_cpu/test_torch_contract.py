"""torch's allocator contract, as users of torch.cuda.memory and torch.accelerator meet it,
checked without a GPU.

Each case runs in a fresh interpreter with a simulated device behind torch's heap of
device 0 (_C.registry_open_sim), and allocates through the very entry point torch calls
(_torch_test_alloc raises what torch would raise): the out-of-memory message's first
sentence, the 1 EiB refusal, out-of-memory observers, the memory fraction, the
accelerator statistics and the history options (skip_actions, clear_history).
tests/gpu/test_gpu_torch_features.py checks the same through torch on a GPU.
"""

import pytest

from helpers import TORCH_BOUNDARY, needs_test_hooks, run_python

PRELUDE = (
    """
import ctypes, json
from gpumem import _C
from gpumem.torch import _install, _viz
MiB = 1 << 20
GiB = 1 << 30
"""
    + TORCH_BOUNDARY
    + """
_C.registry_open_sim(0, 1 << 30)
"""
)


def run_py(code):
    return run_python(code, PRELUDE, timeout=300, unset=("GPUMEM_CONF", "GPUMEM_EXPLAIN_OOM"))


@needs_test_hooks
def test_oom_first_sentence_is_torchs():
    r = run_py("""
        def oom(size):
            try:
                _C._torch_test_alloc(size, 0)
            except RuntimeError as e:
                return str(e)
        msgs = [oom(800000000 * GiB), oom(3 * GiB)]
        full = _C._torch_test_alloc(GiB, 0)     # the whole device: every request below fails
        msgs += [oom(1024), oom(1536), oom(3 * MiB)]
        out(msgs=msgs)
    """)
    big, three, b, kib, mib = r["msgs"]
    # torch's own words and units (c10's format_size: bytes, KiB, MiB, then GiB however large) ...
    assert big.startswith(
        "CUDA out of memory. Tried to allocate 800000000.00 GiB. GPU 0 has a total capacity of 1024.00 MiB of which "
    )
    assert three.startswith("CUDA out of memory. Tried to allocate 3.00 GiB. GPU 0 has a total capacity of 1024.00 MiB")
    assert b.startswith("CUDA out of memory. Tried to allocate 1024 bytes. GPU 0 has")
    assert kib.startswith("CUDA out of memory. Tried to allocate 1.50 KiB. GPU 0 has")
    assert mib.startswith("CUDA out of memory. Tried to allocate 3.00 MiB. GPU 0 has")
    # ... then gpumem's figures
    assert all("reserved by gpumem" in m and "The largest block gpumem could make now" in m for m in r["msgs"])


@needs_test_hooks
def test_one_exbibyte_or_more_is_refused_in_torchs_words():
    r = run_py("""
        got = []
        for size in (1 << 60, (1 << 64) - 1):
            try:
                _C._torch_test_alloc(size, 0)
            except RuntimeError as e:
                got.append(str(e))
        try:
            _C._torch_test_alloc((1 << 60) - (1 << 40), 0)   # just under: the usual message
        except RuntimeError as e:
            got.append(str(e))
        _C.registry_heap(0).check()
        out(got=got, reserved=_C.registry_heap(0).stats()["reserved_bytes.all.current"])
    """)
    a, b, under = r["got"]
    assert a == b == "CUDA out of memory. Tried to allocate more than 1EB memory."
    assert under.startswith("CUDA out of memory. Tried to allocate 1073740800.00 GiB. GPU 0 has a total capacity")
    assert r["reserved"] == 0


@needs_test_hooks
def test_oom_observers_run_in_order_before_the_exception_with_torchs_arguments():
    r = run_py("""
        calls = []
        def first(device, requested, allowed, free):
            # the heap's state at the failure is there to be snapshotted
            allocated = _C.registry_heap(0).stats()["allocated_bytes.all.current"]
            calls.append(("first", device, requested, allowed, free, allocated))
        _install._attach_oom_observer(first)
        _install._attach_oom_observer(lambda *a: calls.append(("second",) + a))
        keep = _C._torch_test_alloc(600 * MiB, 0)
        try:
            _C._torch_test_alloc(700 * MiB, 0)
            raised = None
        except RuntimeError as e:
            raised = str(e)
        ok = _C._torch_test_alloc(100 * MiB, 0)      # a success calls no observer
        n_after_success = len(calls)
        try:
            _install._attach_oom_observer(42)
            bad_type = None
        except TypeError as e:
            bad_type = str(e)
        def broken(*a):
            raise KeyError("the observer broke")
        _install._attach_oom_observer(broken)
        try:
            _C._torch_test_alloc(700 * MiB, 0)
            replaced = None
        except KeyError as e:
            replaced = repr(e)
        _C.registry_heap(0).check()
        out(calls=calls, raised=raised, n_after_success=n_after_success, bad_type=bad_type, replaced=replaced)
    """)
    (first, second), rest = r["calls"][:2], r["calls"][2:]
    assert first[:4] == ["first", 0, 700 << 20, 1 << 30] and first[5] == 600 << 20
    assert second[:4] == ["second", 0, 700 << 20, 1 << 30] and second[4] == first[4]
    assert 0 <= first[4] <= 1 << 30
    assert r["raised"].startswith("CUDA out of memory. Tried to allocate 700.00 MiB.")
    assert r["n_after_success"] == 2
    assert "must be callable" in r["bad_type"]
    # the second failure ran every observer again; the raising one's exception replaced the OOM
    assert [c[0] for c in rest] == ["first", "second"]
    assert r["replaced"] == "KeyError('the observer broke')"


@needs_test_hooks
def test_memory_fraction_round_trips_and_zero_allows_nothing():
    r = run_py("""
        set_fraction = _install._set_memory_fraction_fn(lambda f, d: memory_fraction(f, d))
        before = _install._memory_fraction(0)
        got = []
        for f in (1.0, 0.0, 0.123456789, 0.75):
            set_fraction(f, 0)
            got.append(_install._memory_fraction(0))
        set_fraction(0.0, 0)
        try:
            _C._torch_test_alloc(512, 0)
            zero = None
        except RuntimeError as e:
            zero = str(e)
        set_fraction(1.0, 0)
        p = _C._torch_test_alloc(512, 0)
        out(before=before, got=got, zero=zero, cap_after=_C.registry_heap(0).get_cap(), p=p)
    """)
    assert r["before"] == 1.0
    assert r["got"] == [1.0, 0.0, 0.123456789, 0.75]
    assert r["zero"].startswith("CUDA out of memory. Tried to allocate 512 bytes.")
    assert r["cap_after"] == 0 and r["p"]


@needs_test_hooks
def test_accelerator_stats_are_torch_cuda_stats():
    pytest.importorskip("torch")  # torch.accelerator's hook is only ever called by torch
    r = run_py("""
        p = _C._torch_test_alloc(1024, 0)
        nested = _install._accelerator_stats(0)
        flat = {}
        def flatten(prefix, v):
            if isinstance(v, dict):
                for k, x in v.items():
                    flatten(f"{prefix}.{k}" if prefix else k, x)
            else:
                flat[prefix] = v
        flatten("", nested)
        free(p, 0, 0, None)
        after = _install._accelerator_stats(0)["active_bytes"]["all"]
        out(flat=flat, after=after)
    """)
    flat = r["flat"]
    assert flat["active_bytes.all.current"] == 1024 and flat["allocated_bytes.all.current"] == 1024
    assert flat["allocation.all.current"] == 1 and flat["reserved_bytes.all.current"] >= 2 << 20
    assert r["after"]["current"] == 0 and r["after"]["freed"] == 1024


@needs_test_hooks
def test_history_skip_actions_and_clear_history():
    r = run_py("""
        _viz.record_torch_history("all", "all", "python", 1000, False, False, False, ["free_requested"])
        a = _C._torch_test_alloc(4 * MiB, 0)
        free(a, 0, 0, None)
        kinds = [e["action"] for e in _viz.torch_snapshot_dict()["device_traces"][0]]
        _viz.record_torch_history("all", "all", "python", 1000, False, False, False, [])
        kinds_all = [e["action"] for e in _viz.torch_snapshot_dict()["device_traces"][0]]
        _viz.record_torch_history("all", "all", "python", 1000, True, False, False, [])   # clear_history
        cleared = [e["action"] for e in _viz.torch_snapshot_dict()["device_traces"][0]]
        b = _C._torch_test_alloc(4 * MiB, 0)
        after_clear = [e["action"] for e in _viz.torch_snapshot_dict()["device_traces"][0]]
        try:
            _viz.record_torch_history("all", "all", "python", 1000, False, False, False, ["frees"])
            unknown = None
        except ValueError as e:
            unknown = str(e)
        _viz.record_torch_history(None)
        out(kinds=kinds, kinds_all=kinds_all, cleared=cleared, after_clear=after_clear, unknown=unknown)
    """)
    assert "alloc" in r["kinds"] and "free_completed" in r["kinds"] and "free_requested" not in r["kinds"]
    assert "free_requested" in r["kinds_all"]  # still recorded: skip_actions only hides what it names
    assert r["cleared"] == []
    assert r["after_clear"][-1] == "alloc" and "free_requested" not in r["after_clear"]
    assert "unknown trace action" in r["unknown"] and "frees" in r["unknown"]


def test_torch_segments_serve_one_pool_and_one_stream():
    # torch serves each stream from segments of its own: adjacent blocks of two streams
    # in one run of pages show as two segments, each naming its stream.
    import gpumem

    with gpumem.Heap(device="sim", capacity="1GiB") as h:
        a = h.malloc(1 << 20, stream=1)
        b = h.malloc(1 << 20, stream=2)
        c = h.malloc(1 << 20, stream=2)
        segs = gpumem.Snapshot.from_heap(h).to_torch()["segments"]
        mine = [s for s in segs if any(bl["state"] == "active_allocated" for bl in s["blocks"])]

        def on(stream):
            return [bl["address"] for s in mine if s["stream"] == stream for bl in s["blocks"]]

        # b shares a's page (growth), c has a page of its own: a segment each, one stream each
        assert sorted({s["stream"] for s in mine}) == [1, 2] and len(mine) == 3
        assert on(1) == [a] and [x for x in on(2) if x in (a, b, c)] == [b, c]
        # every byte of the mapped run is in exactly one segment
        assert sum(s["total_size"] for s in segs) == h.stats()["reserved_bytes.all.current"]
        for p in (a, b, c):
            h.free(p)


def test_a_pools_free_blocks_stay_in_their_streams_segments():
    # a pool block freed on another stream is that stream's free memory in the pool: a
    # segment of its own, as torch keeps a stream's blocks in its own segments
    import gpumem

    with gpumem.Heap(device="sim", capacity="1GiB") as h:
        h.pool_retain((1, 0))
        z = h.malloc(3 << 20, stream=7, pool=(1, 0))
        t = h.malloc(5 << 20, stream=9, pool=(1, 0))
        h.free(t)
        segs = [s for s in gpumem.Snapshot.from_heap(h).to_torch()["segments"] if s["segment_pool_id"] == (1, 0)]
        assert sorted(s["stream"] for s in segs) == [7, 9]
        (on9,) = [s for s in segs if s["stream"] == 9]
        assert any(b["address"] == t and b["state"] == "inactive" for b in on9["blocks"])
        h.free(z)
        h.pool_release((1, 0))


def test_restoring_a_pools_checkpoint_gives_back_its_segments_as_they_were():
    # cudagraph trees' checkpoints: a second graph's block on another stream, in the free
    # rest of the first graph's page, is dropped by restoring the pool's live set; the
    # segment then reads as before (one growth, one segment), not cut at the freed block
    import gpumem

    pool = (1, 7)
    with gpumem.Heap(device="sim", capacity="1GiB") as h:
        h.pool_retain(pool)

        def segments():
            segs = gpumem.Snapshot.from_heap(h).to_torch()["segments"]
            keys = ("address", "total_size", "allocated_size", "active_size", "segment_pool_id")
            return [tuple(s[k] for k in keys) for s in segs if s["segment_pool_id"] == pool]

        a = h.malloc(512, stream=1, pool=pool)
        before, state = segments(), h.pool_live(pool)
        b = h.malloc(512, stream=2, pool=pool)
        assert a < b < a + (2 << 20)  # in the same page
        h.pool_set_live(pool, state)
        assert segments() == before
        h.free(a)
        h.pool_release(pool)


# In the child: the C types of torch's pluggable allocator functions, and a fake allocator of that kind
# (addresses never touched: the simulated device reads nothing) that records what it made and freed,
# refuses while `refuse` is not empty, and whose functions' addresses are A and F.
ALLOCATOR_TYPES = """
        ALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
        FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)
"""
FAKE_ALLOCATOR = (
    ALLOCATOR_TYPES
    + """
        made, gone, refuse = [], [], []
        def fake_alloc(size, device, stream):
            if refuse:
                return None
            made.append(size)
            return (1 << 44) + len(made) * (1 << 30)   # never touched: the simulated device reads nothing
        def fake_free(ptr, size, device, stream):
            gone.append((ptr, size))
        a_fn, f_fn = ALLOC(fake_alloc), FREE(fake_free)
        A = ctypes.cast(a_fn, ctypes.c_void_p).value
        F = ctypes.cast(f_fn, ctypes.c_void_p).value
"""
)


def _assert_ext_pool_cached_counted_lent_and_given_back(r):
    MiB = 1 << 20
    assert r["made"] == [20 * MiB, 2 * MiB] and r["xy"] == 3 * MiB
    assert [s[1] for s in r["segs"]] == [
        [[3 * MiB, True], [3 * MiB, True], [14 * MiB, False]],
        [[512, True], [2 * MiB - 512, False]],
    ]
    assert r["over"] and not r["under"]
    assert r["lent"]
    assert "CUDA out of memory" in r["refused"] and "its own allocator" in r["refused"]
    assert r["detached"] and r["gone_while_live"] == [] and r["gone_before_empty_cache"] == []
    assert sorted(r["gone"]) == [2 * MiB, 20 * MiB] and r["big_from_heap"]
    assert r["all_gone"] == [2 * MiB, 20 * MiB, 30 * MiB]
    assert r["errors"] == 0


@needs_test_hooks
def test_a_pool_over_another_allocator_caches_its_segments_and_counts_them_against_the_cap():
    # torch.cuda.MemPool(allocator): the pool's memory comes from the allocator's two functions, in
    # segments sized as torch's (20 MiB for 1 to 10 MiB, 2 MiB for a small request), reused by the
    # pool, counted against the memory fraction, lent on OOM by a use_on_oom pool, and given back
    # at the empty_cache after the pool has ended and its blocks are freed.
    r = run_py(
        FAKE_ALLOCATOR
        + """
        P, Q = (0, 1 << 62 | 1), (0, 1 << 62 | 2)
        _C._torch_ext_attach(0, P, A, F, False)
        _C._torch_ext_attach(0, Q, A, F, True)
        begin(0, *P, ANY)
        x = _C._torch_test_alloc(3 * MiB, 0)
        y = _C._torch_test_alloc(3 * MiB, 0)
        z = _C._torch_test_alloc(100, 0)
        end(0, *P)
        segs = [(b, [(n, u) for _, n, u in bl]) for b, bl in _C._torch_ext_segments(0, P)]
        res = dict(made=list(made), xy=y - x, segs=sorted(segs, key=lambda s: s[0]))
        memory_fraction(64 * MiB / GiB, 0)          # 64 MiB: the pool's segments hold 22 of them
        def fails(size):
            try:
                free(_C._torch_test_alloc(size, 0), size, 0, None)
                return False
            except RuntimeError as e:
                return "CUDA out of memory" in str(e)
        res["over"], res["under"] = fails(50 * MiB), fails(40 * MiB)
        empty_cache()                               # routed to a pool, the heap may not release its cache
        begin(0, *Q, ANY)
        q = _C._torch_test_alloc(30 * MiB, 0)
        end(0, *Q)
        free(q, 30 * MiB, 0, None)                  # cached in Q: 52 MiB held outside the heap now
        lent = _C._torch_test_alloc(16 * MiB, 0)    # the heap may grow by 12 MiB at most: Q lends its block
        res["lent"] = lent == q
        free(lent, 16 * MiB, 0, None)
        refuse.append(1)
        begin(0, *P, ANY)
        try:
            _C._torch_test_alloc(30 * MiB, 0)
        except RuntimeError as e:
            res["refused"] = str(e)
        end(0, *P)
        res["detached"] = _C._torch_ext_detach(0, P)
        res["gone_while_live"] = list(gone)
        for p, n in ((x, 3 * MiB), (y, 3 * MiB), (z, 100)):
            free(p, n, 0, None)
        res["gone_before_empty_cache"] = list(gone)
        # 52 MiB of the 64 are held outside the heap (P's 22, ended and free, Q's 30): a 16 MiB request
        # first has the ended pool's segments given back, as torch frees an unused pool's on OOM
        big = _C._torch_test_alloc(16 * MiB, 0)
        res["gone"] = [n for _, n in gone]
        res["big_from_heap"] = big != q
        free(big, 16 * MiB, 0, None)
        _C._torch_ext_detach(0, Q)                  # nothing lives in Q: its segment goes back at once
        res["all_gone"] = sorted(n for _, n in gone)
        memory_fraction(1.0, 0)
        res["errors"] = _C._torch_counters()["free_errors"]
        _C.registry_heap(0).check()
        out(**res)
    """
    )
    _assert_ext_pool_cached_counted_lent_and_given_back(r)


@needs_test_hooks
def test_a_pool_over_another_allocator_gives_nothing_back_while_a_capture_may_run():
    # the other allocator's free may synchronise (cudaFree): while any pool is routed to (torch counts
    # each as a possible CUDA graph capture) an ended pool's segments stay, and go at the next chance
    r = run_py(
        ALLOCATOR_TYPES
        + """
        made, gone = [], []
        a_fn = ALLOC(lambda size, d, s: (made.append(size), (1 << 44) + len(made) * (1 << 30))[1])
        f_fn = FREE(lambda ptr, size, d, s: gone.append(size))
        A, F = (ctypes.cast(f, ctypes.c_void_p).value for f in (a_fn, f_fn))
        P, G = (0, 1 << 62 | 1), (7, 0)
        _C._torch_ext_attach(0, P, A, F, False)
        begin(0, *P, ANY)
        x = _C._torch_test_alloc(3 * MiB, 0)
        y = _C._torch_test_alloc(3 * MiB, 0)
        end(0, *P)
        free(y, 3 * MiB, 0, None)
        begin(0, *G, ANY)                        # a graph's pool: a capture may run from here on
        _C._torch_ext_detach(0, P)               # P ends with x live ...
        free(x, 3 * MiB, 0, None)                # ... and x goes: P's segment is wholly free
        empty_cache()
        during = list(gone)
        end(0, *G)
        release(0, *G)
        empty_cache()
        out(during=during, after=list(gone))
    """
    )
    assert r["during"] == [] and r["after"] == [20 << 20]


def test_a_mempool_takes_only_an_allocator_it_can_call_and_never_gpumem_itself():
    # both refusals come before CUDA is touched
    pytest.importorskip("torch")
    from gpumem import _C
    from gpumem.torch import _pools

    stranger = object()
    with pytest.raises(ValueError, match="functions it does not know"):
        _pools.MemPool(allocator=stranger)
    entry = _C._torch_entry_points()
    _pools._pluggable[id(stranger)] = (stranger, entry["alloc"], entry["free"])
    try:
        with pytest.raises(ValueError, match="gpumem itself"):  # it would route back into itself
            _pools.MemPool(allocator=stranger)
    finally:
        del _pools._pluggable[id(stranger)]


@needs_test_hooks
def test_counters_mean_what_torchs_mean():
    """num_ooms counts each out-of-memory exception once (torch's path tries twice before it
    raises), a request over the cap included; num_alloc_retries counts only allocations that
    met the limit; far from it, the slow path is gpumem's own num_slow_allocs."""
    r = run_py("""
        h = _C.registry_heap(0)
        ps = [_C._torch_test_alloc(n * MiB, 0) for n in (1, 3, 24, 100, 7)]
        room = h.stats()
        full = _C._torch_test_alloc(800 * MiB, 0)
        try:
            _C._torch_test_alloc(200 * MiB, 0)
        except RuntimeError:
            pass
        one = h.stats()
        set_fraction = _install._set_memory_fraction_fn(lambda f, d: memory_fraction(f, d))
        set_fraction(0.5, 0)
        try:
            _C._torch_test_alloc(600 * MiB, 0)   # over the cap: refused at once
        except RuntimeError:
            pass
        two = h.stats()
        h.check()
        keys = ("num_alloc_retries", "num_ooms", "num_slow_allocs")
        out(room={k: room[k] for k in keys}, one={k: one[k] for k in keys}, two={k: two[k] for k in keys})
    """)
    assert r["room"]["num_alloc_retries"] == 0 and r["room"]["num_ooms"] == 0 and r["room"]["num_slow_allocs"] >= 1
    assert r["one"]["num_ooms"] == 1 and r["one"]["num_alloc_retries"] == 1
    assert r["two"]["num_ooms"] == 2 and r["two"]["num_alloc_retries"] == 1


@needs_test_hooks
def test_trace_entries_carry_the_compiled_region_they_were_recorded_in(tmp_path):
    """_record_memory_history(..., compile_context=True): each trace entry's compile_context is
    the innermost "Torch-Compiled Region" running (a stack, as torch's allocator keeps it), "N/A"
    outside; a frame torch.compile runs is one (backend="eager": no compiler needed for it)."""
    pytest.importorskip("torch")
    r = run_python(
        """
        import torch
        from torch.autograd.profiler import record_function
        _viz.record_torch_history("all", "all", "python", 1000, False, True)
        def region(name):
            return record_function("Torch-Compiled Region: " + name)
        ps = [_C._torch_test_alloc(1 * MiB, 0)]
        with region("0/0"):
            ps.append(_C._torch_test_alloc(2 * MiB, 0))
            with region("1/0"):
                ps.append(_C._torch_test_alloc(3 * MiB, 0))
            ps.append(_C._torch_test_alloc(4 * MiB, 0))
        with record_function("not a region"):
            ps.append(_C._torch_test_alloc(5 * MiB, 0))
        def f(x):
            ps.append(_C._torch_test_alloc(6 * MiB, 0))   # dynamo runs this call in the frame's region
            return x + 1
        torch.compile(f, backend="eager")(torch.ones(2))
        _viz.record_torch_history("all", "all", "python", 1000, False, False)   # compile_context off
        with region("2/0"):
            ps.append(_C._torch_test_alloc(7 * MiB, 0))
        trace = _viz.torch_snapshot_dict()["device_traces"][0]
        _viz.record_torch_history(None)
        out(allocs=[(e["size"] // MiB, e["compile_context"]) for e in trace if e["action"] == "alloc"])
        """,
        PRELUDE,
        env={"GPUMEM_CACHE_DIR": str(tmp_path)},
        timeout=300,
    )
    regions = dict(r["allocs"])
    assert regions == {
        1: "N/A",
        2: "Torch-Compiled Region: 0/0",
        3: "Torch-Compiled Region: 1/0",
        4: "Torch-Compiled Region: 0/0",
        5: "N/A",
        6: "Torch-Compiled Region: 0/0",
        7: "N/A",
    }


def test_the_explanation_is_switched_on_and_off_in_c():
    r = run_py("""
        plain = _C._torch_format_oom(0, 1 << 40)
        _C._torch_explain_oom(True)
        explained = _C._torch_format_oom(0, 1 << 40)
        _C._torch_explain_oom(False)
        out(plain=plain, explained=explained, again=_C._torch_format_oom(0, 1 << 40))
    """)
    line = r["plain"]
    assert line.startswith("CUDA out of memory. Tried to allocate 1024.00 GiB. GPU 0 has") and "\n" not in line
    assert r["explained"].startswith(line + "\n") and "What to do:" in r["explained"]
    assert r["again"] == line
