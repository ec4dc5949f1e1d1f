"""Frameworks sharing one heap (gpumem._backend, gpumem.cupy, gpumem.numba) on the
simulated device: blocks say which framework allocated them, snapshot and
explain count by framework, and an OOM carries the explanation.  The same code
on a GPU, over the per-device heaps torch uses: tests/gpu/test_gpu_cupy.py."""

import gc

import pytest

import gpumem
from gpumem import _C
from gpumem._frameworks import FRAMEWORK_MASK, FRAMEWORK_SHIFT, framework_of, framework_tag
from gpumem._backend import Backend
from gpumem.explain import explain, last_oom
from gpumem.history import frames_for, site_of

MiB = 1 << 20
GiB = 1 << 30


def test_tags_match_the_extension():
    t = _C._framework_tags()
    assert t["shift"] == FRAMEWORK_SHIFT and t["mask"] == FRAMEWORK_MASK
    assert framework_tag("cupy") == t["cupy"] << FRAMEWORK_SHIFT
    assert framework_tag("numba") == t["numba"] << FRAMEWORK_SHIFT
    assert framework_of(0) == "" and framework_of(0, "torch") == "torch"
    assert framework_of(framework_tag("cupy") | 12345) == "cupy"
    # stack ids never use the framework bits
    assert not _C._stack_capture() & FRAMEWORK_MASK


def allocate_arrays(backend, n, size):
    return [backend.malloc(size, 0, 0) for _ in range(n)]


def test_blocks_say_which_framework_and_keep_their_stacks(make_heap):
    h = make_heap(capacity=GiB)
    gpumem.record_history(True, device=h, stacks="python")
    try:
        cupy_like = Backend("cupy", h)
        numba_like = Backend("numba", h)
        a = allocate_arrays(cupy_like, 3, 10 * MiB)
        b = allocate_arrays(numba_like, 2, 4 * MiB)
        own = h.malloc(7 * MiB)
        snap = gpumem.snapshot(h)
        by = {blk.addr: blk for blk in snap.blocks if blk.state == "live"}
        assert {by[p].framework for p in a} == {"cupy"} and {by[p].framework for p in b} == {"numba"}
        assert by[own].framework == ""
        # the framework bits do not hide the allocation site
        assert "allocate_arrays" in by[a[0]].site and "allocate_arrays" in site_of(frames_for(by[b[0]].context))
        assert snap.by_framework() == {"cupy": (30 * MiB, 3), "untagged": (7 * MiB, 1), "numba": (8 * MiB, 2)}
        history_tags = {framework_of(e[5]) for e in h.history()[0] if e[1] == "alloc"}
        assert history_tags == {"cupy", "numba", ""}
        for p in a:
            cupy_like.free(p, 0)
        assert gpumem.snapshot(h).by_framework() == {"numba": (8 * MiB, 2), "untagged": (7 * MiB, 1)}
    finally:
        gpumem.record_history(False, device=h)


def test_oom_of_a_framework_is_explained_with_the_framework(make_heap):
    """The seeds' CuPy example on the sim device: A and B of 10000x10000 float64
    (763 MiB each) live under a 2 GiB cap, C = A @ B (another 763 MiB) does not fit;
    explain says CuPy holds the memory and to compute in chunks, and a chunk fits."""
    h = make_heap(capacity=2 * GiB)
    cp = Backend("cupy", h)
    n = 10000 * 10000 * 8
    a, b = cp.malloc(n, 0, 0), cp.malloc(n, 0, 0)
    with pytest.raises(gpumem.OutOfMemoryError) as e:
        cp.malloc(n, 0, 0)
    text = str(e.value)
    assert text.startswith("CUDA out of memory.")
    assert "by framework: cupy 1.49 GiB in 2 blocks" in text
    assert "CuPy holds 1.49 GiB in 2 array(s)" in text and "compute in chunks" in text
    r = last_oom(h)
    assert r.main_cause.kind == "live_tensors" and r.by_framework == {"cupy": (2 * n, 2)}  # n % 512 == 0
    assert not explain(n, h).fits
    assert explain(n // 10, h).fits  # a chunk of 1000 rows
    chunk = cp.malloc(n // 10, 0, 0)
    cp.free(chunk, 0)
    cp.free(a, 0)
    cp.free(b, 0)


def test_numba_memory_manager_on_a_sim_heap(make_heap):
    pytest.importorskip("numba.cuda")
    import gpumem.numba as gnumba

    h = make_heap(capacity=GiB)
    cls = gnumba.memory_manager(h)

    class Dev:
        id = 0

    class Ctx:
        device = Dev()

    m = cls(context=Ctx())
    m.initialize()
    assert m.interface_version == 1
    mp = m.memalloc(10 * MiB)
    assert mp.size == 10 * MiB and h.block_size(int(mp.device_pointer)) == 10 * MiB
    assert gpumem.snapshot(h).by_framework() == {"numba": (10 * MiB, 1)}
    info = m.get_memory_info()
    assert info.total == GiB and info.free == h.mem_info()[0]
    del mp
    gc.collect()
    assert h.stats()["allocated_bytes.all.current"] == 0  # the finalizer gave it back
    with pytest.raises(gpumem.OutOfMemoryError, match="CUDA out of memory"):
        m.memalloc(2 * GiB)
    with pytest.raises(NotImplementedError):
        m.get_ipc_handle(None)


def test_cupy_out_of_memory_error_is_cupys(make_heap):
    cupy = pytest.importorskip("cupy")
    import gpumem.cupy as gcupy

    E = gcupy._oom_class()
    e = E(100, -1, "CUDA out of memory. Tried to allocate 100 B\nCauses...")
    assert isinstance(e, cupy.cuda.memory.OutOfMemoryError) and isinstance(e, MemoryError)
    assert str(e).startswith("CUDA out of memory.") and "Causes" in str(e)
