"""Cost of one slow-path allocation as the heap holds more blocks, on the sim device.

For each point n (live blocks): allocate 2n blocks of 4 KiB, free a random half
of them (so n stay live with holes between them), then time single 64 MiB
allocations, which no hole fits: each one takes the slow path (placement plus
growth, no remapping).  Each timed allocation is one Python call to Heap.malloc
(the call is included); the figure is the median over --reps of them, in wall
time and in the calling thread's CPU time.  The benchmark checks that every
timed allocation went through the slow path and remapped nothing.

A second table times the slow path with defragmentation: the same heap, plus
40 blocks of 5 MiB (each followed by a live 4 KiB block) freed, and the cap set
to what the heap holds, so that the 64 MiB request cannot grow and must wait
for the device and move wholly free pages behind it (one remap, checked).  Each
repetition builds a fresh heap; the figure is the median of --defrag-reps.

The freed half is chosen at random; it is freed in descending address order,
which keeps the setup fast (the free index keeps each size bin sorted by
address) and does not change the heap it leaves behind.

Usage: python benchmarks/slowpath_scaling.py [--points 1000,5000,...] [--reps 21]
       [--defrag-points 1000,10000,100000,1000000] [--defrag-reps 5]
       [--json benchmarks/results/slowpath_scaling.json]
"""

import argparse
import os
import platform
import random
import statistics
import sys
import time

import gpumem
from common import write_json

MiB = 1 << 20
DEFAULT_POINTS = [1000, 5000, 10_000, 25_000, 100_000, 1_000_000]
DEFAULT_DEFRAG_POINTS = [1000, 10_000, 100_000, 1_000_000]


def holes(h, live, block, rng):
    ptrs = [h.malloc(block) for _ in range(2 * live)]
    gone = rng.sample(range(2 * live), live)
    return ptrs, sorted((ptrs[i] for i in gone), reverse=True)


def _row(live, reps, wall, cpu):
    """A table row from the wall and CPU times (us) of the timed allocations."""
    return {
        "live_blocks": live,
        "reps": reps,
        "median_us": statistics.median(wall),
        "min_us": min(wall),
        "median_cpu_us": statistics.median(cpu),
    }


def measure(live, reps, block=4096, request=64 * MiB, seed=0):
    rng = random.Random(seed)
    with gpumem.Heap(device="sim", capacity="80GiB") as h:
        malloc, free = h.malloc, h.free
        for p in holes(h, live, block, rng)[1]:
            free(p)
        st0 = h.stats()
        wall, cpu = [], []
        for _ in range(reps):
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            malloc(request)
            t1 = time.perf_counter_ns()
            c1 = time.thread_time_ns()
            wall.append((t1 - t0) / 1e3)
            cpu.append((c1 - c0) / 1e3)
        st = h.stats()
        slow = st["num_slow_allocs"] - st0["num_slow_allocs"]
        remaps = st["num_remaps"] - st0["num_remaps"]
        if slow != reps or remaps:
            raise SystemExit(
                f"at {live} live blocks: {slow} of {reps} allocations took the slow path, "
                f"{remaps} remaps; the benchmark no longer measures what it says"
            )
        return dict(
            _row(live, reps, wall, cpu), blocks_in_heap=st["inactive_split.all.current"] + st["allocation.all.current"]
        )


def measure_defrag(live, reps, block=4096, request=64 * MiB, seed=0):
    rng = random.Random(seed)
    wall, cpu = [], []
    for _ in range(reps):
        with gpumem.Heap(device="sim", capacity="80GiB") as h:
            _, gone = holes(h, live, block, rng)
            big = []
            for _ in range(40):
                big.append(h.malloc(5 * MiB))
                h.malloc(block)
            for p in gone + big:
                h.free(p)
            h.set_cap(h.stats()["reserved_bytes.all.current"])
            st0 = h.stats()
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            h.malloc(request)
            t1 = time.perf_counter_ns()
            c1 = time.thread_time_ns()
            st = h.stats()
            if st["num_remaps"] - st0["num_remaps"] != 1:
                raise SystemExit(f"at {live} live blocks the request did not defragment once")
            wall.append((t1 - t0) / 1e3)
            cpu.append((c1 - c0) / 1e3)
    return _row(live, reps, wall, cpu)


def table(points, measure_one, what):
    """Measure and print one row per point under a header; returns the rows."""
    rows = []
    print(f"{'live blocks':>12} {'median us':>10} {'min us':>9} {'cpu us':>9}  (64 MiB request, {what})")
    for n in points:
        r = measure_one(n)
        rows.append(r)
        print(f"{n:>12,} {r['median_us']:>10.1f} {r['min_us']:>9.1f} {r['median_cpu_us']:>9.1f}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", default=",".join(map(str, DEFAULT_POINTS)))
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument(
        "--defrag-points",
        default=",".join(map(str, DEFAULT_DEFRAG_POINTS)),
        help="live-block counts for the defragmentation table ('' to skip it)",
    )
    ap.add_argument("--defrag-reps", type=int, default=5)
    ap.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results", "slowpath_scaling.json"))
    ap.add_argument("--label", default="", help="a name for this build, kept in the JSON")
    args = ap.parse_args()
    points = [int(x) for x in args.points.split(",") if x]
    rows = table(points, lambda n: measure(n, args.reps), "slow path")
    dpoints = [int(x) for x in args.defrag_points.split(",") if x]
    drows = table(dpoints, lambda n: measure_defrag(n, args.defrag_reps), "defragments") if dpoints else []
    out = {
        "benchmark": "slowpath_scaling",
        "label": args.label,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "rows": rows,
        "defrag_rows": drows,
    }
    write_json(args.json, out)


if __name__ == "__main__":
    main()
