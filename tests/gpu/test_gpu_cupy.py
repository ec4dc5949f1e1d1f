"""torch, CuPy and Numba on one gpumem heap per GPU (gpumem.cupy, gpumem.numba).

Each case runs in a fresh interpreter (torch's allocator is chosen once per
process, and a cap must not leak into the next case).  They skip only when
torch with CUDA, CuPy or Numba is missing.  The same allocator paths on the
simulated device: tests/unit/test_shared.py.
"""

import importlib.util

import pytest
from helpers import run_python

GiB = 1 << 30

pytestmark = pytest.mark.gpu

PRELUDE = """
import gc, json, os, sys
import numpy as np
import gpumem
"""


def need(module):
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed")


def run_py(code, env=None, timeout=600):
    return run_python(code, PRELUDE, env=env, timeout=timeout, unset=("GPUMEM_CONF", "NUMBA_CUDA_MEMORY_MANAGER"))


def test_torch_and_cupy_share_one_heap_under_a_cap():
    """3 GiB cap.  torch and CuPy take turns holding 2 GiB (plus a small array each
    that stays): with one cache per framework the two would hold 4 GiB, more than
    the cap; on one heap each reuses the pages the other freed.  Results are
    checked, also across DLPack after the producer's reference is gone."""
    need("cupy")
    r = run_py(
        """
        import torch, cupy
        gpumem.install()
        import gpumem.cupy
        gpumem.cupy.install()
        G = 1 << 30
        n = 2 * G // 4                                    # float32 elements in 2 GiB
        keep_t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)       # 4 MiB, kept
        keep_c = cupy.arange(1 << 20, dtype=cupy.float32)                        # 4 MiB, kept
        sums = []
        for rnd in range(3):
            t = torch.full((n,), float(rnd + 1), device="cuda")
            sums.append(float(t[:1000].sum()))
            del t
            c = cupy.full((n,), rnd + 2, dtype=cupy.float32)
            sums.append(float(c[:1000].sum()))
            del c
        mid = gpumem.snapshot()
        # DLPack both ways; the consumer keeps the memory alive after the producer is gone
        t = torch.arange(1000, device="cuda", dtype=torch.float32)
        c = cupy.from_dlpack(t)
        del t
        c *= 2
        back = torch.from_dlpack(c)
        del c
        dl_ok = bool(torch.equal(back, 2 * torch.arange(1000, device="cuda", dtype=torch.float32)))
        both = gpumem.snapshot().by_framework()
        st = torch.cuda.memory_stats()
        rep = gpumem.explain()
        out(sums=sums, cap=gpumem._C.registry_heap(0).get_cap(), peak_reserved=st["reserved_bytes.all.peak"],
            peak_live=st["allocated_bytes.all.peak"], both={k: list(v) for k, v in both.items()},
            kept=[float(keep_t[-1]), float(keep_c[-1])], dl_ok=dl_ok,
            frameworks_in_explain=dict((k, list(v)) for k, v in rep.by_framework.items()),
            mid_default=mid.default_framework)
    """,
        env={"GPUMEM_CONF": "cap:3GiB"},
    )
    assert r["sums"] == [1000.0, 2000.0, 2000.0, 3000.0, 3000.0, 4000.0], r
    assert r["dl_ok"] and r["kept"] == [float((1 << 20) - 1)] * 2, r
    assert r["cap"] == 3 * GiB
    # one framework's 2 GiB at a time: peak live ~2 GiB, reserved never past the cap,
    # where two caches (2 GiB each, plus the kept arrays) would need more than 4 GiB
    assert 2 * GiB <= r["peak_live"] < 2 * GiB + (64 << 20), r
    assert r["peak_reserved"] <= 3 * GiB, r
    assert set(r["both"]) >= {"torch", "cupy"}, r
    assert r["both"]["cupy"][0] >= 4 << 20 and r["both"]["torch"][0] >= 4 << 20, r
    assert set(r["frameworks_in_explain"]) >= {"torch", "cupy"} and r["mid_default"] == "torch", r


def test_cupy_matmul_ooms_on_a_small_cap_and_succeeds_chunked():
    """The seeds' CuPy example: C = A @ B with A, B 10000x10000 float64 (763 MiB
    each) under a 2 GiB cap fails, with cupy's OutOfMemoryError worded by gpumem;
    explain() says CuPy holds the memory, that C does not fit and a 1000-row
    chunk does; computed by chunks of rows it succeeds, and matches numpy."""
    need("cupy")
    r = run_py("""
        import cupy
        import gpumem.cupy
        gpumem.cupy.install(cap="2GiB")
        N = 10000
        rng = np.random.default_rng(0)
        A_h = rng.random((N, N)); B_h = rng.random((N, N))
        A = cupy.asarray(A_h); B = cupy.asarray(B_h)
        res = {}
        try:
            C = A @ B
            cupy.cuda.Device().synchronize()
            res["oom"] = False
        except cupy.cuda.memory.OutOfMemoryError as e:
            res["oom"] = True
            res["msg"] = str(e)
            res["is_gpumem_text"] = str(e).startswith("CUDA out of memory.")
        full = gpumem.explain(N * N * 8)
        chunk = gpumem.explain(1000 * N * 8)
        res["full_fits"] = full.fits
        res["chunk_fits"] = chunk.fits
        res["by_fw"] = {k: list(v) for k, v in full.by_framework.items()}
        C_h = np.empty((N, N))
        for i in range(0, N, 1000):
            C_h[i:i + 1000] = cupy.asnumpy(A[i:i + 1000] @ B)
        rows = [0, 4321, N - 1]
        ref = A_h[rows] @ B_h
        res["max_err"] = float(np.max(np.abs(C_h[rows] - ref)))
        res["cap"] = gpumem._C.registry_heap(0).get_cap()
        out(**res)
    """)
    assert r["oom"] and r["is_gpumem_text"], r
    assert "for cupy" in r["msg"] and "CuPy holds" in r["msg"] and "compute in chunks" in r["msg"], r["msg"]
    assert not r["full_fits"] and r["chunk_fits"], r
    assert r["by_fw"]["cupy"][0] >= 2 * 10000 * 10000 * 8, r
    assert r["max_err"] < 1e-6 and r["cap"] == 2 * GiB, r
    print("CuPy OOM message:", r["msg"])


def test_numba_device_arrays_on_the_shared_heap():
    need("numba")
    r = run_py("""
        import torch
        gpumem.install()
        import gpumem.numba
        gpumem.numba.install()
        from numba import cuda
        t = torch.ones(1 << 20, device="cuda")
        h = np.arange(1 << 22, dtype=np.float32)
        d = cuda.to_device(h)                         # 16 MiB from gpumem's heap
        tv = torch.as_tensor(d, device="cuda")        # __cuda_array_interface__: no copy
        tv.mul_(3)
        back = d.copy_to_host()
        by = gpumem.snapshot().by_framework()
        before = torch.cuda.memory_allocated()
        del tv, d
        gc.collect()
        after = torch.cuda.memory_allocated()
        info = cuda.current_context().get_memory_info()
        out(ok=bool(np.array_equal(back, 3 * h)), by={k: list(v) for k, v in by.items()},
            freed=before - after, info_total=info.total, torch_total=torch.cuda.mem_get_info()[1])
    """)
    assert r["ok"], r
    assert r["by"]["numba"][0] >= 16 << 20 and "torch" in r["by"], r
    assert r["freed"] >= 16 << 20, r
    assert r["info_total"] == r["torch_total"], r
