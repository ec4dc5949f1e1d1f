"""Chunks on a real GPU: physical allocations of several pages (Heap(chunk_pages=N)).

One request backed by one allocation of N pages; empty_cache gives back a wholly free chunk and keeps one a live block
uses; a pool paused (with a backup) and resumed comes back one allocation per
16 pages; the heap's checker and the driver agree throughout.  Each
case runs in a fresh interpreter.  Skipped without torch or a CUDA GPU.
"""

import pytest
from test_gpu_torch import N_CUDA, run_py


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_cuda_chunks_grow_give_back_pause_and_resume():
    r = run_py("""
        MiB = 1 << 20
        h = gpumem.Heap(device="cuda", cap="8GiB", chunk_pages=16)
        page = h.page_size
        st0 = h.stats()
        p = h.malloc(16 * page)
        grown = h.stats()["num_device_alloc"] - st0["num_device_alloc"]
        h.check()
        h.free(p)
        h.empty_cache()
        after_free = h.stats()["reserved_bytes.all.current"]
        q = h.malloc(16 * page)
        h.free(q)
        y = h.malloc(MiB)  # inside a 16-page chunk: it stays whole
        h.empty_cache()
        kept = h.stats()["reserved_bytes.all.current"]
        h.check()
        h.free(y)
        h.empty_cache()
        h.check()
        # Pause and resume a pool of 32 pages with a backup.
        P = (5, 1)
        h.pool_retain(P)
        blk = h.malloc(32 * page, pool=P)
        h.check()
        pr = h.pool_pause(P, backup=True)
        before = h.stats()["num_device_alloc"]
        h.pool_resume(P)
        resumed = h.stats()["num_device_alloc"] - before
        h.check()
        h.free(blk)
        h.pool_release(P)
        h.empty_cache()
        out(grown=grown, after_free=after_free, kept=kept // page, paused=pr["pages"], resumed=resumed,
            final=h.stats()["reserved_bytes.all.current"])
    """)
    assert r["grown"] == 1
    assert r["after_free"] == 0
    assert r["kept"] == 16
    assert r["paused"] == 32 and r["resumed"] == 1  # a resume makes each run one allocation
    assert r["final"] == 0
