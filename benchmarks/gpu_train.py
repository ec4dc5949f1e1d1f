"""Training step time, torch's caching allocator vs gpumem, on the three training workloads of
benchmarks/compare/workloads.py, those benchmarks/capture_trace.py records (random weights, nothing
downloaded).

    python benchmarks/gpu_train.py [--json FILE] [--rounds R] [--workloads a,b,c]
                                   [--allocators native,expandable,gpumem,gpumem:GPUMEM_CHUNK_PAGES=1]

Each (workload, allocator) runs in a fresh process of the same kind; each round runs every
allocator once, in the order given, so fresh processes alternate.  `expandable` is the native
allocator with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; `NAME:VAR=VALUE,...` runs NAME
with those environment variables set (a gpumem option, say).  A step is timed from its first
kernel launch to a device synchronisation.  Two figures per run: the median step after the first
WARMUP steps (cuDNN/cuBLAS set-up; steady state), and the whole run, every step summed, the
first ones included (where new shapes make the heap grow).  All allocators see the same shapes in
the same order.  Then the process empties its caches (torch.cuda.empty_cache()) and runs the same
steps again: the "again" figure, the sum of those steps, repeats the growth without CUDA's one-time
set-up (kernels loaded, cuBLAS and cuDNN initialised), which moves the first step of a fresh process
by hundreds of milliseconds from run to run.
"""

import argparse
import json
import random
import statistics
import time

from common import run_child, write_json
from compare import workloads
from compare.contenders import variant_env

WARMUP = 3


def run(name, use, steps):
    import torch

    if use.split(":")[0] == "gpumem":
        import gpumem

        gpumem.install()
    dev = "cuda"
    random.seed(1234)
    torch.manual_seed(1234)
    times, again = [], []

    def timed(step_fn, into):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_fn()
        torch.cuda.synchronize()
        into.append(time.perf_counter() - t0)

    if name not in workloads.BUILDERS:
        raise SystemExit(f"unknown workload {name}")
    w = workloads.build(name, dev, seed=None, on_device=False)

    def step():
        w.step(*w.draw(random))

    for _ in range(steps):
        timed(step, times)
    st = torch.cuda.memory_stats()
    body = times[WARMUP:]
    # The same shapes again after empty_cache(): the caches are cold again but CUDA's one-time set-up
    # (kernels loaded, cuBLAS and cuDNN ready) is done, so what differs is the allocator's growth.
    random.seed(1234)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    for _ in range(steps):
        timed(step, again)
    return dict(
        workload=name,
        allocator=use,
        median_ms=statistics.median(body) * 1e3,
        mean_ms=statistics.mean(body) * 1e3,
        total_ms=sum(times) * 1e3,
        steps=len(body),
        peak_allocated=st["allocated_bytes.all.peak"],
        peak_reserved=st["reserved_bytes.all.peak"],
        step_ms=[round(t * 1e3, 3) for t in times],
        again_total_ms=sum(again) * 1e3,
        again_step_ms=[round(t * 1e3, 3) for t in again],
        num_remaps=st.get("num_remaps"),
        num_device_alloc=st.get("num_device_alloc"),
        num_sync_all_streams=st.get("num_sync_all_streams"),
        num_alloc_retries=st.get("num_alloc_retries"),
    )


STEPS = {"gpt2_varlen": 24, "resnet50_multires": 24, "llama_lora_ckpt": 16}


def allocator_env(use):
    """The environment that runs allocator `use` (see the module docstring)."""
    if use.partition(":")[0] not in ("native", "expandable", "gpumem"):
        raise SystemExit(f"gpu_train.py: unknown allocator {use!r} (native, expandable, gpumem[:VAR=VALUE,...])")
    try:
        return variant_env(use)
    except ValueError as e:
        raise SystemExit(f"gpu_train.py: {e}") from None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2, metavar=("WORKLOAD", "ALLOCATOR"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workloads", default=",".join(STEPS))
    ap.add_argument(
        "--allocators",
        default="native,gpumem",
        help="allocators, native first, separated by ',' (or ';' when one carries several VAR=VALUE)",
    )
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run(a.one[0], a.one[1], STEPS[a.one[0]])), flush=True)
        return
    # ';' separates allocators when one carries several VAR=VALUE pairs
    allocators = a.allocators.split(";") if ";" in a.allocators else a.allocators.split(",")
    envs = {use: allocator_env(use) for use in allocators}
    if allocators[0] != "native":
        raise SystemExit("gpu_train.py: the first allocator is the baseline and must be native")
    rows = []
    for name in a.workloads.split(","):
        for _ in range(a.rounds):
            for use in allocators:
                r = run_child(__file__, ["--one", name, use], f"{name} {use}", env=envs[use])
                if r is not None:
                    rows.append(r)
    print("| workload | allocator | median step ms | ÷ native | whole run ms | ÷ native | again ms | ÷ native", end="")
    print(" | peak reserved GiB | peak live GiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in a.workloads.split(","):
        base = None
        for use in allocators:
            g = [r for r in rows if r["workload"] == name and r["allocator"] == use]
            if not g:
                print(f"| {name} | {use} | failed | | | | | | | |")
                continue
            med = statistics.median(r["median_ms"] for r in g)
            tot = statistics.median(r["total_ms"] for r in g)
            again = statistics.median(r["again_total_ms"] for r in g)
            if use == "native":
                base = (med, tot, again)
            res = max(r["peak_reserved"] for r in g) / 2**30
            live = max(r["peak_allocated"] for r in g) / 2**30
            r_med = f"{med / base[0]:.3f}" if base else ""
            r_tot = f"{tot / base[1]:.3f}" if base else ""
            r_again = f"{again / base[2]:.3f}" if base else ""
            print(
                f"| {name} | {use} | {med:.2f} | {r_med} | {tot:.1f} | {r_tot} | {again:.1f} | {r_again} "
                f"| {res:.2f} | {live:.2f} |"
            )
    write_json(a.json, rows)


if __name__ == "__main__":
    main()
