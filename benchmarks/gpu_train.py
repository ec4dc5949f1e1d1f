"""Training step time, torch's caching allocator vs gpumem, on the three training workloads of
benchmarks/compare/workloads.py, those benchmarks/capture_trace.py records (random weights, nothing
downloaded).

    python benchmarks/gpu_train.py [--json FILE] [--rounds R] [--workloads a,b,c]

Each (workload, allocator) runs in a fresh process of the same kind; rounds alternate
native and gpumem.  A step is timed from its first kernel launch to a device
synchronisation; the first WARMUP steps (cuDNN/cuBLAS set-up) are left out and the
median of the rest is reported.  Both allocators see the same shapes in the same order.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

from compare import workloads

WARMUP = 3


def run(name, use, steps):
    import torch

    if use == "gpumem":
        import gpumem

        gpumem.install()
    dev = "cuda"
    random.seed(1234)
    torch.manual_seed(1234)
    times = []

    def timed(step_fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)

    if name not in workloads.BUILDERS:
        raise SystemExit(f"unknown workload {name}")
    w = workloads.build(name, dev, seed=None, on_device=False)

    def step():
        w.step(*w.draw(random))

    for _ in range(steps):
        timed(step)
    st = torch.cuda.memory_stats()
    body = times[WARMUP:]
    return dict(
        workload=name,
        allocator=use,
        median_ms=statistics.median(body) * 1e3,
        mean_ms=statistics.mean(body) * 1e3,
        steps=len(body),
        peak_allocated=st["allocated_bytes.all.peak"],
        peak_reserved=st["reserved_bytes.all.peak"],
        step_ms=[round(t * 1e3, 3) for t in times],
        num_remaps=st.get("num_remaps"),
        num_device_alloc=st.get("num_device_alloc"),
        num_sync_all_streams=st.get("num_sync_all_streams"),
        num_alloc_retries=st.get("num_alloc_retries"),
    )


STEPS = {"gpt2_varlen": 24, "resnet50_multires": 24, "llama_lora_ckpt": 16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2, metavar=("WORKLOAD", "ALLOCATOR"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workloads", default=",".join(STEPS))
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run(a.one[0], a.one[1], STEPS[a.one[0]])), flush=True)
        return
    rows = []
    for name in a.workloads.split(","):
        for _ in range(a.rounds):
            for use in ("native", "gpumem"):
                p = subprocess.run([sys.executable, __file__, "--one", name, use], capture_output=True, text=True)
                line = [l for l in p.stdout.splitlines() if l.startswith("{")]
                if p.returncode or not line:
                    print(f"{name} {use} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                    continue
                rows.append(json.loads(line[-1]))
    print(
        "| workload | native ms (median step) | gpumem ms | gpumem / native | peak reserved native GiB | gpumem GiB |"
    )
    print("|---|---|---|---|---|---|")
    for name in a.workloads.split(","):
        n = [r for r in rows if r["workload"] == name and r["allocator"] == "native"]
        g = [r for r in rows if r["workload"] == name and r["allocator"] == "gpumem"]
        if not n or not g:
            print(f"| {name} | {'failed' if not n else ''} | {'failed' if not g else ''} | | | |")
            continue
        nm = statistics.median(r["median_ms"] for r in n)
        gm = statistics.median(r["median_ms"] for r in g)
        print(
            f"| {name} | {nm:.2f} | {gm:.2f} | {gm / nm:.3f} | {max(r['peak_reserved'] for r in n) / 2**30:.2f} | "
            f"{max(r['peak_reserved'] for r in g) / 2**30:.2f} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
