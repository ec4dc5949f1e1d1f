"""Cost of allocation history, with and without Python stacks, on the sim device.

Times Heap.malloc + Heap.free pairs called from Python at a given stack depth
(the stack is what gets captured), best of several rounds, in four modes:

    off          history off, stacks off
    ring         history ring on (max_entries), no stacks
    ring+stacks  ring on, Python stack captured and interned per malloc
    stacks-new   as ring+stacks, but every allocation from a new code object, so
                 each one interns a new stack (the worst case: first sight of a
                 site); its overhead is against "sites-off", the same exec() loop
                 with history off

Usage: python benchmarks/history_overhead.py [--pairs N] [--depths 1,10,30] [--json]
"""

import argparse
import json
import sys
import time

import gpumem
from gpumem import _C

MiB = 1 << 20


def at_depth(depth, fn):
    if depth <= 1:
        return fn()
    return at_depth(depth - 1, fn)


def loop(h, pairs):
    malloc, free = h.malloc, h.free
    t0 = time.perf_counter_ns()
    for _ in range(pairs):
        free(malloc(MiB))
    return (time.perf_counter_ns() - t0) / pairs


def new_sites(h, pairs):
    # exec'd code objects: every allocation comes from a code object never seen before
    codes = [compile(f"free(malloc({MiB}))  # site {i}", f"<site {i}>", "exec") for i in range(pairs)]
    env = {"malloc": h.malloc, "free": h.free}
    t0 = time.perf_counter_ns()
    for c in codes:
        exec(c, env)
    return (time.perf_counter_ns() - t0) / pairs


def measure(mode, depth, pairs, rounds):
    best = float("inf")
    for _ in range(rounds):
        _C._stacks_clear()
        with gpumem.Heap(device="sim", capacity="8GiB") as h:
            gpumem.record_history(
                mode not in ("off", "sites-off"),
                device=h,
                stacks="python" if "stacks" in mode else None,
                max_entries=100_000,
            )
            h.free(h.malloc(MiB))  # map the first page outside the timed loop
            fn = new_sites if mode in ("stacks-new", "sites-off") else loop
            best = min(best, at_depth(depth, lambda: fn(h, pairs)))
            gpumem.record_history(False, device=h)
    return best


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--depths", default="1,10,30")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = []
    measure("off", 1, min(a.pairs, 20_000), 1)  # warm up: the first heap's pages and caches
    for depth in (int(d) for d in a.depths.split(",")):
        base = {}
        for mode in ("off", "ring", "ring+stacks", "sites-off", "stacks-new"):
            pairs = a.pairs if mode not in ("stacks-new", "sites-off") else min(a.pairs, 20_000)
            ns = measure(mode, depth, pairs, a.rounds)
            ref = "sites-off" if mode in ("stacks-new", "sites-off") else "off"
            base.setdefault(ref, ns)
            rows.append(
                {"depth": depth, "mode": mode, "ns_per_pair": round(ns, 1), "overhead_ns": round(ns - base[ref], 1)}
            )
    if a.json:
        print(json.dumps({"python": sys.version.split()[0], "rows": rows}))
        return
    print(f"malloc+free pair from Python, sim device, best of {a.rounds} (Python {sys.version.split()[0]})")
    print(f"{'depth':>5}  {'mode':<12}  {'ns/pair':>8}  {'overhead':>8}")
    for r in rows:
        print(f"{r['depth']:>5}  {r['mode']:<12}  {r['ns_per_pair']:>8.0f}  {r['overhead_ns']:>+8.0f}")


if __name__ == "__main__":
    main()
