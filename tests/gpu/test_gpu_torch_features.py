"""gpumem as PyTorch's allocator, seen through torch's features.

What torch's own tools see of gpumem's heaps on a GPU: the OOM message with its explain report,
record_history's Python stacks, the visibility calls without a heap of their own, DataLoader workers
forked while threads allocate, a MemPool over an allocator of its own, and torch's allocator contract
(OOM observers, the memory fraction, the accelerator API, history options).  Each case runs in a fresh
interpreter (tests/gpu/test_gpu_torch.py's run_py); skipped without torch or a CUDA GPU.
"""

import subprocess

import pytest

from test_gpu_torch import gpu_test, run_py


# ---- the visibility layer on torch's heaps (gpumem/torch/_viz.py, csrc/python/torch_glue.c) -----


@gpu_test
def test_oom_message_carries_the_explain_report():
    code = """
        gpumem.install()
        free, total = torch.cuda.mem_get_info()
        keep = torch.ones(1 << 28, device="cuda")          # 1 GiB live
        S = 1 << 30
        # a cap 512 MiB above what is reserved: 1 GiB more does not fit under it
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + S // 2) / total)
        res = {}
        try:
            torch.empty(S, dtype=torch.uint8, device="cuda"); res["msg"] = "no error"
        except Exception as e:
            res["is_torch_oom"] = isinstance(e, torch.OutOfMemoryError)
            res["msg"] = str(e)
        rep = gpumem.last_oom()
        res["kinds"] = rep.cause_kinds if rep is not None else None
        # the same from autograd's device thread (backward needs a second 1 GiB copy)
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + S + S // 2) / total)
        w = torch.zeros(S // 4, device="cuda", requires_grad=True)
        try:
            w.sum().backward(); res["bwd"] = "no error"
        except Exception as e:
            res["bwd"] = str(e); res["bwd_torch_oom"] = isinstance(e, torch.OutOfMemoryError)
        del w
        torch.cuda.set_per_process_memory_fraction(1.0)
        res["after"] = float(torch.ones(1 << 20, device="cuda").sum())
        out(**res)
    """
    r = run_py(code)
    msg = r["msg"]
    assert r["is_torch_oom"] and msg.startswith("CUDA out of memory. Tried to allocate"), msg
    assert "Where the device's" in msg and "Causes, main one first:" in msg, msg
    assert "[live_tensors]" in msg and "[cap]" in msg and "What to do:" in msg, msg
    assert "live_tensors" in r["kinds"] and "cap" in r["kinds"], r["kinds"]
    assert r["bwd_torch_oom"] and r["bwd"].startswith("CUDA out of memory.") and "\nCause" in r["bwd"], r["bwd"]
    assert r["after"] == float(1 << 20)
    print("explained OOM message:\n" + msg)
    plain = run_py(code, env={"GPUMEM_EXPLAIN_OOM": "0"})
    assert plain["is_torch_oom"] and plain["msg"].startswith("CUDA out of memory.") and "\n" not in plain["msg"]


@gpu_test
def test_record_history_gives_python_stacks_of_torch_allocations():
    r = run_py("""
        gpumem.install()
        res = {}
        gpumem.record_history(True, stacks="python")
        def make_tensor():
            return torch.empty(5 << 20, dtype=torch.uint8, device="cuda")
        t = make_tensor()
        snap = gpumem.snapshot()
        blk = [b for b in snap.blocks if b.addr == t.data_ptr()]
        res["frames"] = [[f.filename, f.name] for f in blk[0].frames] if blk else None
        res["site"] = blk[0].site if blk else None
        # autograd's device threads allocate too: no Python stack there, and no harm
        w = torch.randn(1024, 1024, device="cuda", requires_grad=True)
        (w @ w).sum().backward()
        res["grad"] = w.grad is not None
        gpumem.record_history(False)
        # torch's own switch reaches the same table (its default stacks="all": C++ frames first)
        torch.cuda.memory._record_memory_history(max_entries=1000)
        def make_other():
            return torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        u = make_other()
        s = torch.cuda.memory._snapshot()
        res["torch_frames"] = [[f["name"], f["filename"]] for seg in s["segments"] for b in seg["blocks"]
                               if b["address"] == u.data_ptr() for f in b["frames"]]
        dev = torch.cuda.current_device()
        res["trace_frames"] = [[f["name"], f["filename"]] for e in s["device_traces"][dev]
                               if e["action"] == "alloc" and e["addr"] == u.data_ptr() for f in e["frames"]]
        torch.cuda.memory._record_memory_history(enabled=None)
        res["stacks_on_after"] = gpumem._C._stacks_info()["enabled"]
        v = make_other()
        res["frames_after_off"] = [len(b.frames) for b in gpumem.snapshot().blocks if b.addr == v.data_ptr()]
        out(**res)
    """)
    assert r["frames"] and r["frames"][0] == ["<string>", "make_tensor"], r["frames"]
    assert ["<string>", "<module>"] in r["frames"], r["frames"]
    assert r["site"].startswith("<string>:") and r["site"].endswith(" in make_tensor"), r["site"]
    assert r["grad"]
    for frames in (r["torch_frames"], r["trace_frames"]):
        python = [i for i, (name, filename) in enumerate(frames) if filename == "<string>"]
        assert python and frames[python[0]][0] == "make_other", frames
        native = [name for name, _ in frames[: python[0]]]  # C++ frames first, then the Python ones
        assert "gpumem_torch_alloc" in native, native
        assert any("::empty" in name for name in native), native  # torch's op, demangled
    assert r["stacks_on_after"] is False and r["frames_after_off"] == [0], r


@gpu_test
def test_visibility_calls_without_a_heap_use_the_installed_one(tmp_path):
    dump = tmp_path / "snap.pickle"
    r = run_py(f"""
        import pickle
        gpumem.install()
        x = torch.empty(7 << 20, dtype=torch.uint8, device="cuda")
        s = gpumem.snapshot()
        res = {{"name": s.device_name, "kind": s.device_kind}}
        res["x"] = [[b.size, b.state] for b in s.blocks if b.addr == x.data_ptr()]
        res["live"] = s.summary.live_bytes
        res["same_by_index"] = gpumem.snapshot("cuda:0").summary.live_bytes == gpumem.snapshot(0).summary.live_bytes
        res["explain"] = gpumem.explain("1GiB").text()
        res["no_oom"] = gpumem.last_oom() is None
        gpumem.dump_snapshot({str(dump)!r})
        with open({str(dump)!r}, "rb") as f:
            d = pickle.load(f)
        ts = torch.cuda.memory._snapshot()
        mine = s.to_torch(0)
        res["dump_segments"] = [[g["address"], g["total_size"]] for g in d["segments"]]
        res["torch_segments"] = [[g["address"], g["total_size"]] for g in ts["segments"]]
        res["mine_segments"] = [[g["address"], g["total_size"]] for g in mine["segments"]]
        res["torch_blocks"] = [[b["address"], b["size"], b["state"]] for g in ts["segments"] for b in g["blocks"]]
        res["mine_blocks"] = [[b["address"], b["size"], b["state"]] for g in mine["segments"] for b in g["blocks"]]
        res["allocator"] = ts["allocator_settings"]["allocator"]
        res["memory_snapshot"] = len(torch.cuda.memory_snapshot())
        out(**res)
    """)
    assert r["name"].startswith("cuda:0") and r["kind"] == "cuda", r
    assert r["x"] == [[7 << 20, "live"]] and r["live"] >= 7 << 20, r
    assert r["same_by_index"]
    assert "fits" in r["explain"] and "Where the device's" in r["explain"], r["explain"]
    assert r["no_oom"]
    assert r["dump_segments"] == r["torch_segments"] == r["mine_segments"] and r["mine_segments"], r
    assert r["torch_blocks"] == r["mine_blocks"], r
    assert r["allocator"] == "gpumem" and r["memory_snapshot"] == len(r["mine_segments"])


@gpu_test
def test_dataloader_workers_forked_while_threads_allocate():
    """DataLoader workers fork()ed while two threads allocate on side streams
    through gpumem (history with stacks on): each worker takes the boundary's
    and the heap's locks (no CUDA), every epoch delivers every item, and the
    parent's allocator still works after."""
    r = run_py(
        """
        import threading, time
        from torch.utils.data import DataLoader, Dataset
        gpumem.install()
        gpumem.record_history(True, stacks="python")
        keep = [torch.empty(4 << 20, dtype=torch.uint8, device="cuda") for _ in range(4)]
        stop = threading.Event()
        counts = [0, 0]

        def hammer(i):
            with torch.cuda.stream(torch.cuda.Stream()):
                while not stop.is_set():
                    t = torch.empty((1 + counts[i] % 7) << 20, dtype=torch.uint8, device="cuda")
                    t.fill_(1)
                    del t
                    counts[i] += 1

        threads = [threading.Thread(target=hammer, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        while min(counts) == 0:
            time.sleep(0.001)

        class Squares(Dataset):
            def __len__(self):
                return 64

            def __getitem__(self, i):
                # in a fork()ed worker: the options and pool locks, the heap's lock
                gpumem._C.registry_options()
                gpumem._C._torch_active_pools(0)
                gpumem._C.registry_heap(0).stats()
                return torch.tensor([i * i])

        epochs = []
        for _ in range(3):
            dl = DataLoader(Squares(), batch_size=8, num_workers=2, multiprocessing_context="fork", timeout=60)
            epochs.append(sorted(int(x) for b in dl for x in b.flatten()) == [i * i for i in range(64)])
        stop.set()
        for t in threads:
            t.join()
        x = torch.randn(512, 512, device="cuda")
        ok = bool(torch.isfinite(x @ x).all().item())
        torch.cuda.synchronize()
        gpumem._C.registry_heap(torch.cuda.current_device()).check()
        out(epochs=epochs, allocated=min(counts), ok=ok, live=len(keep))
    """,
        timeout=600,
    )
    assert r["epochs"] == [True, True, True] and r["ok"], r
    assert r["allocated"] > 0 and r["live"] == 4, r


# A pluggable allocator over the CUDA driver, with no CUDA headers: counts its calls.
DRIVER_ALLOCATOR = r"""
#include <dlfcn.h>
#include <stddef.h>
int n_alloc = 0, n_free = 0;
static int (*mem_alloc)(unsigned long long *, size_t);
static int (*mem_free)(unsigned long long);
static void bind(void) {
    if (mem_alloc) return;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    mem_alloc = (int (*)(unsigned long long *, size_t))dlsym(cuda, "cuMemAlloc_v2");
    mem_free = (int (*)(unsigned long long))dlsym(cuda, "cuMemFree_v2");
}
void *drv_alloc(size_t size, int device, void *stream) {
    unsigned long long p = 0;
    (void)device; (void)stream;
    bind();
    n_alloc++;
    return mem_alloc(&p, size) == 0 ? (void *)p : NULL;
}
void drv_free(void *ptr, size_t size, int device, void *stream) {
    (void)size; (void)device; (void)stream;
    bind();
    n_free++;
    mem_free((unsigned long long)ptr);
}
"""


@gpu_test
def test_mempool_with_an_allocator_of_its_own(tmp_path):
    """torch.cuda.MemPool(allocator) under gpumem: the pool's tensors live in the other allocator's
    memory (correct values), its segments are reused by the pool, and go back to that allocator at
    the empty_cache after the pool and its tensors are gone."""
    src = tmp_path / "drv.c"
    src.write_text(DRIVER_ALLOCATOR)
    so = tmp_path / "drv.so"
    try:
        subprocess.run(["cc", "-shared", "-fPIC", "-O1", str(src), "-o", str(so), "-ldl"], check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"no C compiler to build the allocator: {e}")
    r = run_py(
        f"""
        import ctypes
        gpumem.install()
        lib = ctypes.CDLL({str(so)!r})
        n_alloc = ctypes.c_int.in_dll(lib, "n_alloc")
        n_free = ctypes.c_int.in_dll(lib, "n_free")
        other = torch.cuda.memory.CUDAPluggableAllocator({str(so)!r}, "drv_alloc", "drv_free")
        pool = torch.cuda.MemPool(other.allocator())
        with torch.cuda.use_mem_pool(pool):
            x = torch.ones(1 << 20, device="cuda")      # 4 MiB: one 20 MiB segment of the other allocator
            y = x * 2                                    # the same segment
        z = torch.ones(1 << 20, device="cuda")           # gpumem's own
        heap_addrs = {{b[0] for b in gpumem._C.registry_heap(0).snapshot()["blocks"]}}
        res = dict(sums=[x.sum().item(), y.sum().item()], allocs=n_alloc.value,
                   in_heap=[t.data_ptr() in heap_addrs for t in (x, y, z)],
                   segments=[(s["total_size"], len(s["blocks"])) for s in pool.snapshot()])
        del pool
        res["freed_while_live"] = n_free.value
        del x, y
        res["freed_before_empty_cache"] = n_free.value
        torch.cuda.empty_cache()
        res["freed"] = n_free.value
        res["z"] = z.sum().item()
        out(**res)
        """
    )
    assert r["sums"] == [float(1 << 20), float(2 << 20)] and r["z"] == float(1 << 20)
    # x and y share one 20 MiB segment (torch may add a small one of its own in the pool)
    assert [20 << 20, 3] in r["segments"] and r["allocs"] == len(r["segments"])
    assert r["in_heap"] == [False, False, True]
    assert r["freed_while_live"] == 0 and r["freed_before_empty_cache"] == 0 and r["freed"] == r["allocs"]


@gpu_test
def test_torch_contract_oom_observers_fraction_accelerator_and_history_options():
    r = run_py("""
        gpumem.install()
        res = {}
        x = torch.zeros(1024, device="cuda")
        seen = []
        torch._C._cuda_attach_out_of_memory_observer(lambda *a: seen.append(a))
        try:
            torch.empty(1024 * 1024 * 1024 * 800000000, dtype=torch.int8, device="cuda")
        except torch.OutOfMemoryError as e:
            res["msg"] = str(e)
        try:
            torch.empty(1024 * 1024 * 1024 * 8000000000, dtype=torch.int8, device="cuda")
        except RuntimeError as e:
            res["eb"] = str(e)
        res["seen"] = seen
        res["total"] = torch.cuda.mem_get_info()[1]  # what the driver reports, as torch's observers get
        got = []
        for f in (1.0, 0.0, 0.3, 1.0):
            torch.cuda.set_per_process_memory_fraction(f)
            got.append(torch.cuda.get_per_process_memory_fraction())
        res["fractions"] = got
        before = torch.accelerator.memory_stats()["active_bytes.all.current"]
        t = torch.randn(256, device="cuda")
        res["acc_delta"] = torch.accelerator.memory_stats()["active_bytes.all.current"] - before
        res["acc_alloc"] = torch.accelerator.memory_allocated() == torch.cuda.memory_allocated()
        del t
        torch.accelerator.reset_peak_memory_stats()
        res["acc_peak"] = torch.accelerator.max_memory_allocated() == torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(skip_actions=["free_requested"])
        y = torch.empty(1 << 20, device="cuda")
        del y
        actions = {e["action"] for e in torch.cuda.memory._snapshot()["device_traces"][0]}
        torch.cuda.memory._record_memory_history(None)
        res["actions"] = sorted(actions)
        stream = torch.cuda.current_stream().cuda_stream
        def requested_delta():
            start = torch.cuda.memory_stats()["requested_bytes.all.allocated"]
            p = torch._C._cuda_cudaCachingAllocator_raw_alloc(1 << 20, stream)
            delta = torch.cuda.memory_stats()["requested_bytes.all.allocated"] - start
            torch._C._cuda_cudaCachingAllocator_raw_delete(p)
            return delta
        torch.cuda.caching_allocator_enable(False)
        res["uncached"] = (requested_delta(), torch._C._cuda_cudaCachingAllocator_is_enabled())
        torch.cuda.caching_allocator_enable(True)
        res["cached"] = (requested_delta(), torch._C._cuda_cudaCachingAllocator_is_enabled())
        z = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        del z
        before = torch.cuda.memory_reserved()
        torch.accelerator.empty_cache()
        res["acc_empty"] = (before, torch.cuda.memory_reserved())
        x.fill_(1)
        res["healthy"] = bool((x == 1).all())
        out(**res)
    """)
    assert r["uncached"] == [0, False] and r["cached"] == [1 << 20, True], (r["uncached"], r["cached"])
    assert r["acc_empty"][1] < r["acc_empty"][0], r["acc_empty"]
    assert r["msg"].startswith("CUDA out of memory. Tried to allocate 800000000.00 GiB. GPU 0 has a total capacity of")
    assert r["eb"] == "CUDA out of memory. Tried to allocate more than 1EB memory."
    # allowed: the device's total as gpumem counts it, in whole 2 MiB pages (no cap set)
    (seen,) = r["seen"]
    assert seen[:2] == [0, 800000000 << 30] and 0 <= r["total"] - seen[2] < 2 << 20, (seen, r["total"])
    assert r["fractions"] == [1.0, 0.0, 0.3, 1.0]
    assert r["acc_delta"] == 1024 and r["acc_alloc"] and r["acc_peak"]
    assert "alloc" in r["actions"] and "free_requested" not in r["actions"], r["actions"]
    assert r["healthy"]
