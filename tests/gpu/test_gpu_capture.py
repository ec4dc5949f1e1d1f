"""The CUDA device during CUDA graph capture (core level, no torch allocator hook).

A gpumem heap over the real GPU serves allocations on a stream that torch is
capturing into a CUDA graph.  The heap is not told (no capture_begin): the
driver says the stream is capturing (cuStreamIsCapturing), so the slow path
only creates and maps pages -- in relaxed capture mode, as torch does around
cudaMalloc -- and never synchronises, queries or records an event, unmaps or
releases.  The capture must end cleanly and the graph replay correctly.

Each case runs in a fresh interpreter (an invalidated capture would poison the
CUDA context).  Skipped without torch or a CUDA GPU.
"""

import pytest
from test_gpu_torch import N_CUDA, run_py


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_cuda_heap_serves_a_capturing_stream_without_breaking_the_capture():
    r = run_py("""
        MiB = 1 << 20
        h = gpumem.Heap(device="cuda", cap="4GiB", growth_slack=0.0, growth_slack_pages=0)
        side = torch.cuda.Stream()
        # Memory freed on another stream: outside a capture the slow path would
        # record and query an event to take it over.
        p = h.malloc(8 * MiB, stream=side.cuda_stream)
        h.free(p)
        # A block freed with a record_stream use: pending on an event.
        q = h.malloc(2 * MiB, stream=side.cuda_stream)
        h.record_stream(q, torch.cuda.current_stream().cuda_stream)
        h.free(q)
        before = h.stats()
        x = torch.arange(1024, device="cuda", dtype=torch.float32)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        cap = torch.cuda.Stream()
        res = {}
        with torch.cuda.graph(g, stream=cap):      # global capture mode, torch's default
            s = torch.cuda.current_stream().cuda_stream
            a = h.malloc(64 * MiB, stream=s)       # growth: create, map, set_access
            b = h.malloc(8 * MiB, stream=s)        # must not take side's block (no event allowed)
            res["b_took_side_block"] = b == p
            res["capturing_told"] = h.capturing
            h.free(a)
            res["same_stream_reuse"] = h.malloc(64 * MiB, stream=s) == a
            h.record_stream(b, side.cuda_stream)
            h.free(b)                              # deferred: no event during the capture
            try:
                h.malloc(1 << 40, stream=s)        # beyond the cap: OOM, no sync, no release
                res["huge"] = "allocated"
            except gpumem.OutOfMemoryError:
                res["huge"] = "oom"
            y = x * 2
        g.replay()
        torch.cuda.synchronize()
        res["replay_ok"] = bool(torch.equal(y, x * 2))
        after = h.stats()
        res["syncs_during"] = after["num_sync_all_streams"] - before["num_sync_all_streams"]
        res["unmaps_during"] = after["num_unmaps"] - before["num_unmaps"]
        res["frees_during"] = after["num_device_free"] - before["num_device_free"]
        # After the capture: the deferred free gets its event, everything is reusable again.
        big = h.malloc(512 * MiB)
        h.check()
        h.free(big)
        h.empty_cache()
        h.check()
        res["pending_left"] = sum(1 for blk in h.snapshot()["blocks"] if blk[6] == "pending")
        out(**res)
    """)
    assert r["replay_ok"], r
    assert r["capturing_told"] == 0 and not r["b_took_side_block"] and r["same_stream_reuse"], r
    assert r["huge"] == "oom", r
    assert (r["syncs_during"], r["unmaps_during"], r["frees_during"]) == (0, 0, 0), r
    assert r["pending_left"] == 0, r


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_cuda_pool_memory_stays_the_pools_through_general_traffic():
    """Blocks allocated in a pool during a capture the heap was told about
    (capture_begin) and freed there stay the pool's through general traffic,
    empty_cache and a large request on the real device."""
    r = run_py("""
        import ctypes
        MiB = 1 << 20
        h = gpumem.Heap(device="cuda", cap="2GiB")
        P = (5, 1)
        h.pool_retain(P)
        n = 4 * MiB // 4
        cap = torch.cuda.Stream()
        # The graph's intermediate lives in the pool and is freed during the capture.
        g = torch.cuda.CUDAGraph()
        src = torch.ones(n, device="cuda")
        h.capture_begin()
        with torch.cuda.graph(g, stream=cap):
            s = torch.cuda.current_stream().cuda_stream
            tmp = h.malloc(4 * MiB, stream=s, pool=P)
            out_buf = h.malloc(4 * MiB, stream=s, pool=P)
            res_free_at = tmp
            h.free(tmp)                      # freed into the pool: nobody else may have it
        h.capture_end()
        torch.cuda.synchronize()
        # General traffic: frees, empty_cache, fragmentation and a large request.
        ts = [h.malloc(3 * MiB) for _ in range(64)]
        for t in ts[::2]:
            h.free(t)
        h.empty_cache()
        big = h.malloc(256 * MiB)
        general_overlap = any(t < res_free_at + 4 * MiB and res_free_at < t + 3 * MiB for t in ts[1::2])
        general_overlap |= big < res_free_at + 4 * MiB and res_free_at < big + 256 * MiB
        info = h.pool_info(P)
        h.check()
        out(general_overlap=general_overlap, pool_free=info["free_bytes"], pool_live=info["live_bytes"])
    """)
    assert not r["general_overlap"], r
    assert r["pool_free"] >= 4 * (1 << 20) and r["pool_live"] == 4 * (1 << 20), r
