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


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_cuda_pages_larger_than_the_granularity():
    # Heap(page_size=8MiB): one driver allocation per 8 MiB page; free pages
    # still move one at a time under a cap; a page size the device cannot use
    # is a ValueError; torch installed with page_size keeps every tensor's
    # contents through 300 allocations and frees.
    r = run_py("""
        MiB = 1 << 20
        h = gpumem.Heap(device="cuda", page_size="8MiB", cap=128 * MiB, growth_slack=0.0, growth_slack_pages=0)
        blocks = [h.malloc(8 * MiB) for _ in range(16)]
        grown = h.stats()["num_device_alloc"]
        for b in blocks[::2]:
            h.free(b)
        big = h.malloc(16 * MiB)  # no hole fits and the cap allows no growth: free pages move
        st = h.stats()
        h.check()
        h.free(big)
        for b in blocks[1::2]:
            h.free(b)
        h.close()
        try:
            gpumem.Heap(device="cuda", page_size=MiB)
            small = "accepted"
        except ValueError as e:
            small = str(e)
        gpumem.install(page_size="8MiB")
        g = torch.Generator(device="cpu").manual_seed(3)
        live, bad = [], 0
        for i in range(300):
            n = int(torch.randint(1, 3 << 20, (1,), generator=g))  # int32: up to 12 MiB
            live.append((i, torch.full((n,), i % 97, device="cuda", dtype=torch.int32)))
            if len(live) > 40:
                del live[int(torch.randint(0, len(live), (1,), generator=g))]
        for i, t in live:
            bad += int(int(t.sum()) != (i % 97) * t.numel())
        snap = gpumem._C.registry_heap(0).snapshot()
        gpumem._C.registry_heap(0).check()
        out(grown=grown, remapped=st["num_pages_remapped"], reserved=st["reserved_bytes.all.current"], small=small,
            page=snap["page_size"], bad=bad, torch_reserved=torch.cuda.memory_reserved())
    """)
    assert r["grown"] == 16
    assert r["remapped"] >= 1 and r["reserved"] == 128 << 20, r
    assert "multiple" in r["small"] and "granularity" in r["small"], r["small"]
    assert r["page"] == 8 << 20
    assert r["bad"] == 0, r
    assert r["torch_reserved"] % (8 << 20) == 0


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_cuda_a_chunk_whose_free_pages_a_request_needs_is_split():
    # split_chunks=1.  A 4-page chunk with a block at each end and its middle free; under a cap
    # of 6 pages a 4-page request needs the 2 free ones: the kept pages are
    # copied to single pages (copy_dtod through the scratch range, one device
    # wait), the chunk goes back, and the kept blocks keep their bytes.
    r = run_py("""
        import ctypes
        MiB = 1 << 20
        torch.zeros(1, device="cuda")  # the primary context, current on this thread
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuMemsetD32_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t]
        cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]

        def fill(addr, nbytes, v):
            assert cu.cuMemsetD32_v2(addr, v, nbytes // 4) == 0

        def words(addr, nbytes):
            buf = (ctypes.c_uint * (nbytes // 4))()
            assert cu.cuMemcpyDtoH_v2(buf, addr, nbytes) == 0
            return set(buf)

        h = gpumem.Heap(device="cuda", cap="1GiB", chunk_pages=4, split_chunks=1)
        page = h.page_size
        a = h.malloc(4 * page)
        h.free(a)
        k0 = h.malloc(MiB + 512)
        mid = h.malloc(4 * page - 2 * (MiB + 512))
        k1 = h.malloc(MiB + 512)
        shape = (k0 == a, k1 + MiB + 512 == a + 4 * page)
        h.free(mid)
        fill(k0, MiB, 0x1234)
        fill(k1, MiB, 0x5678)
        h.set_cap(6 * page)
        st0 = h.stats()
        y = h.malloc(4 * page)
        fill(y, 4 * page, 7)
        st = h.stats()
        h.check()
        out(shape=shape, splits=st["num_chunk_splits"] - st0["num_chunk_splits"], k0=sorted(words(k0, MiB)),
            k1=sorted(words(k1, MiB)), y=sorted(words(y, 4 * page)), reserved=st["reserved_bytes.all.current"] // page,
            errors=st["num_device_errors"])
    """)
    assert r["shape"] == [True, True], r
    assert r["splits"] == 1, r
    assert r["k0"] == [0x1234] and r["k1"] == [0x5678] and r["y"] == [7], r
    assert r["reserved"] == 6 and r["errors"] == 0, r


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_cuda_splits_keep_every_live_blocks_bytes_through_a_trace():
    # Three shipped traces replayed block by block on the GPU under the cap the
    # simulated device found smallest for chunks of 16 pages with splits.  Each
    # block gets its own value written through the driver at its first word and
    # at every page boundary inside it, and is read back when freed and at the
    # end: the splits (as many as the simulated device makes) move kept pages
    # meanwhile, and no word changes.
    r = run_py("""
        import ctypes
        from gpumem import replay as R
        from gpumem.trace import load_trace
        torch.zeros(1, device="cuda")
        cu = ctypes.CDLL("libcuda.so.1")
        cu.cuMemsetD32_v2.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t]
        cu.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        kw = {"chunk_pages": 16, "split_chunks": 1}
        rows = {}
        for name in ("seed_fragmentation", "resnet_infer", "roberta_infer"):
            tr = load_trace(name)
            cap = R.min_capacity(tr, precision=R.MiB, heap_kwargs=kw)
            sim = R._heap(cap, kw)
            sim.replay(tr.events, tr.n_slots)
            sim_splits = sim.stats()["num_chunk_splits"]
            sim.close()
            h = gpumem.Heap(device="cuda", cap=cap, **kw)
            page, w, live, bad, ooms = h.page_size, tr.words, {}, [0], 0

            def spots(p, size):
                first = (p + page - 1) // page * page
                return sorted({p, *range(first, p + size - 3, page)})

            def check(slot):
                p, size = live.pop(slot)
                for x in spots(p, size):
                    v = ctypes.c_uint()
                    assert cu.cuMemcpyDtoH_v2(ctypes.byref(v), x, 4) == 0
                    bad[0] += v.value != slot + 1
                h.free(p)

            for i in range(len(w) // 3):
                op, slot, size = w[3 * i] & 0xFFFFFFFF, w[3 * i] >> 32, w[3 * i + 1]
                if op == 0:
                    try:
                        p = h.malloc(size)
                    except gpumem.OutOfMemoryError:
                        ooms += 1
                        continue
                    live[slot] = (int(p), size)
                    for x in spots(int(p), size):
                        assert cu.cuMemsetD32_v2(x, slot + 1, 1) == 0
                elif slot in live:
                    check(slot)
            for slot in list(live):
                check(slot)
            h.check()
            rows[name] = dict(splits=h.stats()["num_chunk_splits"], sim_splits=sim_splits, bad=bad[0], ooms=ooms)
            h.close()
        out(rows=rows)
    """)
    for name, row in r["rows"].items():
        assert row["ooms"] == 0 and row["bad"] == 0, (name, row)
        assert row["splits"] == row["sim_splits"] > 0, (name, row)
