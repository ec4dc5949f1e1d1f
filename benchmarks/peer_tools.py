"""Other libraries' memory tools, run against gpumem and against torch's native allocator on a GPU.

    python benchmarks/peer_tools.py [--json FILE]

gpumem's own tests and PyTorch's allocator tests check gpumem against torch's contract as gpumem's
authors read it.  This is a second, independent check: the memory features of the tools people use
beside torch, each reading the allocator its own way --

  profiler        torch.profiler with profile_memory=True: per-operator device memory, and the memory
                  timeline it exports (torch.profiler's own reading of the allocator's events)
  memory_viz      torch.cuda._memory_viz drawing a snapshot taken with the history on (trace_plot,
                  segment_plot), and its command line on the dumped pickle
  accelerate      accelerate.utils.find_executable_batch_size shrinking a batch on out-of-memory until a
                  step fits under a cap, and release_memory
  lightning       Lightning's CUDAAccelerator.get_device_stats, the numbers its DeviceStatsMonitor logs

Each case runs in a fresh process twice: with gpumem installed (gpumem.install() before CUDA starts)
and with torch's native allocator.  A case that fails natively too is the environment's, not gpumem's.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import with_checkout_path  # noqa: E402

MiB = 1 << 20
CASES = {}


def case(fn):
    CASES[fn.__name__] = fn
    return fn


def _step(torch, d=2048):
    m = torch.nn.Sequential(torch.nn.Linear(d, 4 * d), torch.nn.GELU(), torch.nn.Linear(4 * d, d)).cuda()
    opt = torch.optim.AdamW(m.parameters())
    x = torch.randn(256, d, device="cuda")
    m(x).square().mean().backward()
    opt.step()
    return m, opt


@case
def profiler(torch):
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts, profile_memory=True, record_shapes=True, with_stack=True) as prof:
        m, opt = _step(torch)
        torch.cuda.synchronize()
    ops = prof.key_averages()
    used = max(getattr(e, "self_device_memory_usage", getattr(e, "self_cuda_memory_usage", 0)) for e in ops)
    assert used >= 32 * MiB, f"the profiler saw at most {used} bytes of device memory used by one operator"
    path = os.path.join(tempfile.mkdtemp(), "timeline.json")
    prof.export_memory_timeline(path, device="cuda:0")
    with open(path) as f:
        times, sizes = json.load(f)
    peak = max(sum(row) for row in sizes)
    assert len(times) > 0 and peak >= 64 * MiB, f"memory timeline peak {peak} bytes"
    return dict(largest_op_bytes=used, timeline_points=len(times), timeline_peak_bytes=peak)


@case
def memory_viz(torch):
    from torch.cuda import _memory_viz

    torch.cuda.memory._record_memory_history(max_entries=100000)
    m, opt = _step(torch)
    del m, opt
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = _memory_viz.trace_plot(snap)
    segments = _memory_viz.segment_plot(snap)
    assert len(trace) > 1000 and len(segments) > 1000
    d = tempfile.mkdtemp()
    pickle_path, html = os.path.join(d, "snap.pickle"), os.path.join(d, "trace.html")
    import pickle

    with open(pickle_path, "wb") as f:
        pickle.dump(snap, f)
    p = subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", "trace_plot", pickle_path, "-o", html],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and os.path.getsize(html) > 1000, p.stderr[-500:]
    events = len(snap["device_traces"][0])
    assert events > 10, f"{events} events in the history"
    return dict(events=events, trace_html=len(trace), segment_html=len(segments))


@case
def accelerate(torch):
    from accelerate.utils import find_executable_batch_size, release_memory

    torch.cuda.set_per_process_memory_fraction(2 * 1024**3 / torch.cuda.get_device_properties(0).total_memory)
    tried = []

    @find_executable_batch_size(starting_batch_size=4096)
    def run(batch_size):
        tried.append(batch_size)
        x = torch.empty(batch_size, MiB, dtype=torch.uint8, device="cuda")  # batch_size MiB
        return batch_size, x.numel()

    best, n = run()
    # it shrinks the batch after each out-of-memory error (by a tenth in accelerate 1.x) until one fits
    assert tried[0] == 4096 and tried[-1] == best and len(tried) > 1 and best < 2048, (best, tried)
    before = torch.cuda.memory_allocated()
    a = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    (a,) = release_memory(a)
    after = torch.cuda.memory_allocated()
    assert a is None and after == before, (before, after)
    return dict(tried=tried, fits=best, reserved_after_release=torch.cuda.memory_reserved())


@case
def lightning(torch):
    try:
        from lightning.pytorch.accelerators import CUDAAccelerator
    except ImportError:
        from pytorch_lightning.accelerators import CUDAAccelerator

    x = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
    stats = CUDAAccelerator().get_device_stats(torch.device("cuda", 0))
    cur = stats["allocated_bytes.all.current"]
    assert cur >= 300 * MiB and stats["reserved_bytes.all.current"] >= cur, stats
    del x
    return dict(keys=len(stats), allocated=cur, reserved=stats["reserved_bytes.all.current"])


def child(name, allocator):
    if allocator == "gpumem":
        import gpumem

        gpumem.install()
    import torch

    torch.cuda.init()
    try:
        out = CASES[name](torch)
        print(json.dumps(dict(ok=True, result=out), default=str), flush=True)
    except Exception as e:
        tb = traceback.format_exc(limit=3)
        print(json.dumps(dict(ok=False, error=f"{type(e).__name__}: {e}"[:400], tb=tb[-800:])), flush=True)


def run(name, allocator):
    env = with_checkout_path()
    p = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", name, allocator],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if not lines:
        return dict(ok=False, error=f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--only", help="cases, comma-separated (default all: " + ", ".join(CASES) + ")")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(*a.child)
        return 0
    names = a.only.split(",") if a.only else list(CASES)
    rows = []
    print("| tool | native | gpumem | gpumem's figures |")
    print("|---|---|---|---|")
    for name in names:
        r = {al: run(name, al) for al in ("native", "gpumem")}
        rows.append(dict(case=name, **r))
        cell = {al: "passed" if r[al]["ok"] else "failed: " + r[al]["error"][:120] for al in r}
        figures = json.dumps(r["gpumem"].get("result"), default=str)[:160] if r["gpumem"]["ok"] else ""
        print(f"| {name} | {cell['native']} | {cell['gpumem']} | {figures} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    bad = [r["case"] for r in rows if r["native"]["ok"] and not r["gpumem"]["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} agree with native" + (f"; gpumem alone fails: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
