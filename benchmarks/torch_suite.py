"""PyTorch's allocator contract, run under gpumem on a GPU.

    python benchmarks/torch_suite.py [--only NAME,...] [--json FILE]

PyTorch's test/test_cuda.py turns years of allocator bug reports into tests.
This harness re-states, in its own code, the behaviours there that any
correct allocator behind torch must have -- memory stats, OOM messages and
recovery, the per-process memory fraction, record_stream and multi-stream
reuse, empty_cache, caching_allocator_alloc, snapshots and history -- and runs
each case in a fresh process twice: with gpumem installed and with torch's
native allocator.  A case that fails on native too is an environment problem,
not gpumem's, and is reported as such.

Left out, because they test the native allocator's internals rather than
what torch promises: expandable-segment and garbage-collection settings
(_set_allocator_settings), the cudaMallocAsync backend, the pinned host
allocator and its stats (not the CUDA device allocator gpumem replaces),
segment sizes and segment_alloc/segment_free events in snapshots (gpumem maps
pages, it has no cudaMalloc segments), and the cuBLAS workspace sizes.
"""

import argparse
import json
import subprocess
import sys
import time
import traceback

from common import last_json_line, write_json

MiB = 1 << 20
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


class Skip(Exception):
    pass


def sleep_ms(torch, ms):
    """Keep the current stream busy for about `ms` milliseconds."""
    torch.cuda._sleep(int(ms * 2e6))  # cycles: at least `ms` on GPUs clocked up to 2 GHz


@case
def caching_allocator_alloc_and_delete(torch):
    before = torch.cuda.memory_allocated()
    p = torch.cuda.caching_allocator_alloc(1)
    assert torch.cuda.memory_allocated() > before
    torch.cuda.caching_allocator_delete(p)
    assert torch.cuda.memory_allocated() == before
    s = torch.cuda.Stream()
    p = torch.cuda.caching_allocator_alloc(3 * MiB, stream=s)
    assert torch.cuda.memory_allocated() >= before + 3 * MiB
    torch.cuda.caching_allocator_delete(p)
    assert torch.cuda.memory_allocated() == before


@case
def active_bytes_are_exact(torch):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    st = torch.cuda.memory_stats()
    assert st["active_bytes.all.freed"] == 0
    base = st["active_bytes.all.current"]
    t = torch.randn(256, device="cuda")  # 1 KiB
    assert torch.cuda.memory_stats()["active_bytes.all.current"] == base + 1024
    del t
    st = torch.cuda.memory_stats()
    assert st["active_bytes.all.current"] == base and st["active_bytes.all.freed"] == 1024, st
    assert torch.cuda.max_memory_allocated() >= base + 1024
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()


@case
def oom_message_and_recovery(torch):
    t = torch.zeros(1024, device="cuda")
    try:
        torch.empty(1 << 60, dtype=torch.int8, device="cuda")
    except torch.OutOfMemoryError as e:
        assert "Tried to allocate" in str(e) and str(e).startswith("CUDA out of memory."), str(e)[:200]
    else:
        raise AssertionError("no OOM for 1 EiB")
    t.fill_(1)
    assert bool((t == 1).all())


@case
def oom_then_retry_after_free(torch):
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    size = int(total * 0.5)
    a = torch.empty(size, dtype=torch.int8, device="cuda")
    try:
        torch.empty(size, dtype=torch.int8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    else:
        raise AssertionError("two halves of the device fitted next to a CUDA context")
    del a
    b = torch.empty(size, dtype=torch.int8, device="cuda")
    del b
    torch.cuda.empty_cache()


@case
def per_process_memory_fraction(torch):
    for bad, exc in ((1, TypeError), (-0.1, ValueError), (2.0, ValueError)):
        try:
            torch.cuda.set_per_process_memory_fraction(bad)
        except exc:
            pass
        else:
            raise AssertionError(f"fraction {bad!r} accepted")
    t = torch.zeros(1024, device="cuda")
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(0.5, 0)
    try:
        x = torch.empty(int(total * 0.49) - torch.cuda.memory_reserved(), dtype=torch.int8, device="cuda")
        del x
        torch.cuda.empty_cache()
        try:
            torch.empty(int(total * 0.5), dtype=torch.int8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        else:
            raise AssertionError("half the device fitted under a fraction of 0.5 with a tensor live")
        t.fill_(1)
        assert bool((t == 1).all())
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, 0)
    if hasattr(torch.cuda, "get_per_process_memory_fraction"):
        for v in (1.0, 0.25, 0.75):
            torch.cuda.set_per_process_memory_fraction(v)
            assert torch.cuda.get_per_process_memory_fraction() == v
        torch.cuda.set_per_process_memory_fraction(1.0)


@case
def record_stream_keeps_memory_from_reuse(torch):
    side = torch.cuda.Stream()
    host = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    with torch.cuda.stream(side):
        sleep_ms(torch, 50)  # the side stream is busy...
        tmp = host.cuda(non_blocking=True)  # ...and then copies into tmp
    ptr = tmp.data_ptr()
    tmp.record_stream(side)
    del tmp  # freed while the side stream may still write it
    again = torch.empty(1 << 20, dtype=torch.float32, device="cuda")
    assert again.data_ptr() != ptr, "memory in use by a side stream was handed out again"
    side.synchronize()
    del again


@case
def record_stream_on_a_view_protects_the_storage(torch):
    side = torch.cuda.Stream()
    base = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    view = base[1 << 20 :]
    base_ptr = base.data_ptr()
    with torch.cuda.stream(side):
        sleep_ms(torch, 50)
        view.add_(1)
    view.record_stream(side)
    del view, base
    again = torch.empty(4 << 20, dtype=torch.uint8, device="cuda")
    assert again.data_ptr() != base_ptr, "the storage under a recorded view was reused too early"
    side.synchronize()


@case
def freed_on_one_stream_not_reused_by_a_busy_other(torch):
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        a = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        sleep_ms(torch, 50)
        a.fill_(7)
        pa = a.data_ptr()
        del a  # s1 may still be filling it
    with torch.cuda.stream(s2):
        b = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
        assert b.data_ptr() != pa, "a block another stream is still writing was given to s2"
        b.zero_()
    torch.cuda.synchronize()


@case
def empty_cache_gives_memory_back(torch):
    x = [torch.empty(64 * MiB, dtype=torch.uint8, device="cuda") for _ in range(4)]
    del x
    reserved = torch.cuda.memory_reserved()
    live = torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_reserved()
    assert after < reserved and after - live < 64 * MiB, (reserved, after, live)
    free, _ = torch.cuda.mem_get_info()
    y = torch.empty(int(free * 0.9), dtype=torch.uint8, device="cuda")
    del y
    torch.cuda.empty_cache()


@case
def memory_snapshot_lists_a_live_tensor(torch):
    t = torch.empty(5 * MiB, dtype=torch.uint8, device="cuda")
    blocks = [b for s in torch.cuda.memory_snapshot() for b in s["blocks"]]
    mine = [b for b in blocks if b["address"] == t.data_ptr()]
    assert mine and mine[0]["state"] == "active_allocated" and mine[0]["size"] >= 5 * MiB, mine


@case
def history_records_alloc_and_free_with_frames(torch):
    torch.cuda.memory._record_memory_history(max_entries=1000)
    try:
        t = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")
        p = t.data_ptr()
        del t
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    ev = [e for e in snap["device_traces"][0] if e["addr"] == p]
    acts = [e["action"] for e in ev]
    assert "alloc" in acts and ("free_completed" in acts or "free_requested" in acts), acts
    alloc = next(e for e in ev if e["action"] == "alloc")
    assert alloc["size"] >= 3 * MiB and any("history_records" in f.get("name", "") for f in alloc["frames"]), alloc


@case
def many_threads_allocate(torch):
    import threading

    errors = []

    def work(seed):
        try:
            g = torch.Generator(device="cuda").manual_seed(seed)
            for _ in range(200):
                x = torch.randn(1 << (seed % 12 + 8), device="cuda", generator=g)
                assert torch.isfinite(x).all()
        except Exception as e:  # reported below
            errors.append(repr(e))

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors[:3]


@case
def backward_on_a_side_stream(torch):
    s = torch.cuda.Stream()
    w = torch.randn(512, 512, device="cuda", requires_grad=True)
    with torch.cuda.stream(s):
        loss = (w @ w).sum()
        loss.backward()
    torch.cuda.current_stream().wait_stream(s)
    ref = (w.detach() @ w.detach()).sum()
    assert torch.isfinite(w.grad).all() and torch.isfinite(ref)


@case
def cuda_graph_capture_and_replay(torch):
    x = torch.ones(1024, device="cuda")
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x * 2  # warm up
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        y = x * 2 + 1
    x.fill_(3)
    g.replay()
    torch.cuda.synchronize()
    assert bool((y == 7).all())


def run_one(name, allocator):
    import torch

    if allocator == "gpumem":
        import gpumem

        gpumem.install()
    torch.cuda.init()
    # Load the kernels the cases time against each other before any case runs:
    # with lazy module loading, a kernel's first launch may wait for the work
    # already queued, which would complete events that a case needs pending.
    base = torch.ones(1 << 20, dtype=torch.uint8, device="cuda")
    sleep_ms(torch, 1)
    base.add_(1)
    base[1:].add_(1)
    base.fill_(7)
    base.float().sum()
    torch.cuda.synchronize()
    del base
    try:
        CASES[name](torch)
        torch.cuda.synchronize()
        return {"status": "pass"}
    except Skip as e:
        return {"status": "skip", "why": str(e)}
    except Exception as e:
        return {"status": "fail", "why": f"{type(e).__name__}: {str(e)[:300]}", "trace": traceback.format_exc()[-1500:]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only")
    ap.add_argument("--json")
    ap.add_argument("--one", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_one(*a.one)), flush=True)
        return
    names = a.only.split(",") if a.only else list(CASES)
    rows = []
    for name in names:
        row = {"case": name}
        for alloc in ("gpumem", "native"):
            t0 = time.time()
            p = subprocess.run(
                [sys.executable, __file__, "--one", name, alloc], capture_output=True, text=True, timeout=600
            )
            r = last_json_line(p.stdout) or {
                "status": "fail",
                "why": f"process died (exit {p.returncode}): {p.stderr[-500:]}",
            }
            r["seconds"] = round(time.time() - t0, 1)
            row[alloc] = r
        rows.append(row)
        g, n = row["gpumem"]["status"], row["native"]["status"]
        print(f"{name:52s} gpumem {g:5s} native {n:5s} {row['gpumem'].get('why', '')[:100]}", flush=True)
    applicable = [r for r in rows if r["native"]["status"] == "pass"]
    passed = sum(r["gpumem"]["status"] == "pass" for r in applicable)
    print(
        f"\n{passed} of {len(applicable)} applicable cases pass under gpumem "
        f"({len(rows) - len(applicable)} fail natively too and are not counted)"
    )
    write_json(a.json, rows)


if __name__ == "__main__":
    main()
