"""torch.empty + del latency, torch's caching allocator vs gpumem, each in a fresh process.

    python benchmarks/gpu_alloc.py [--json FILE] [--iters N] [--repeats R]

Each size is timed as R repeats of N iterations of `torch.empty(n, dtype=uint8, device="cuda")`
whose result is dropped at once (allocate + free), after a warm-up; the median repeat is
reported in microseconds per iteration.
"""

import argparse
import json
import statistics
import sys
import time

from common import run_child, write_json

SIZES = [256, 1024, 4096, 65536, 1 << 20, 2 << 20, 8 << 20]


def measure(use, iters, repeats):
    import torch

    if use == "gpumem":
        import gpumem

        gpumem.install()
    torch.ones(1, device="cuda")
    empty, u8 = torch.empty, torch.uint8
    for n in SIZES:
        for _ in range(5000):
            empty(n, dtype=u8, device="cuda")
    # Repeats go round all sizes in turn, so that drift (clocks, the interpreter
    # warming up) spreads over every size instead of landing on the first.
    reps = {n: [] for n in SIZES}
    for _ in range(repeats):
        for n in SIZES:
            t0 = time.perf_counter()
            for _ in range(iters):
                empty(n, dtype=u8, device="cuda")
            reps[n].append((time.perf_counter() - t0) / iters * 1e6)
    return {n: statistics.median(v) for n, v in reps.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", choices=["native", "gpumem"])
    ap.add_argument("--iters", type=int, default=20000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(measure(a.one, a.iters, a.repeats)), flush=True)
        return
    res = {}
    for use in ("native", "gpumem"):
        r = run_child(__file__, ["--one", use, "--iters", str(a.iters), "--repeats", str(a.repeats)], use)
        if r is None:
            sys.exit(1)
        res[use] = {int(k): v for k, v in r.items()}
    print("| size | native us | gpumem us | gpumem / native |")
    print("|---|---|---|---|")
    for n in SIZES:
        print(
            f"| {n} B | {res['native'][n]:.2f} | {res['gpumem'][n]:.2f} | {res['gpumem'][n] / res['native'][n]:.3f} |"
        )
    doc = {
        "sizes": SIZES,
        "native_us": [res["native"][n] for n in SIZES],
        "gpumem_us": [res["gpumem"][n] for n in SIZES],
        "iters": a.iters,
        "repeats": a.repeats,
    }
    write_json(a.json, doc)


if __name__ == "__main__":
    main()
