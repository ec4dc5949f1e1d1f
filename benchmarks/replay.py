"""Replay every shipped trace (gpumem/data/traces) on gpumem's simulated device and tabulate the results.

    python3 benchmarks/replay.py [--traces DIR] [--out DIR] [--capacity SIZE]

For each trace: events, peak live, min capacity / peak live (the smallest capacity,
to 1 MiB, that replays with no OOM), peak reserved / peak live at the default
capacity (80 GiB), the median ns per event in the core, and the number of remaps.
Writes <out>/replay.md and <out>/replay.json (default benchmarks/results/) and
prints the table.  The ratios are comparable to the native / expandable_segments /
cudaMallocAsync columns of gpumem/data/traces/README.md, which were measured the same
way on an H100 (their search was to 32 MiB; this one is to 1 MiB).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
try:
    import gpumem
except ImportError:  # not installed: use the checkout (built with build_ext --inplace)
    sys.path.insert(0, str(REPO))
    import gpumem
from gpumem._units import format_size, parse_size  # noqa: E402
from gpumem.replay import DEFAULT_CAPACITY, min_capacity, replay  # noqa: E402
from gpumem.trace import load_trace  # noqa: E402


def default_traces() -> pathlib.Path:
    """The traces shipped with gpumem; $GPUMEM_SHARED/traces instead when that is set."""
    env = os.environ.get("GPUMEM_SHARED")
    if env:
        return pathlib.Path(env) / "traces"
    from gpumem.data import TRACES_DIR

    return TRACES_DIR


def measure(path: pathlib.Path, capacity: int) -> dict:
    t0 = time.perf_counter()
    trace = load_trace(path)
    r = replay(trace, capacity, timing=True)
    mc = min_capacity(trace)
    live = r.peak_live_bytes
    return {
        "trace": trace.name,
        "events": trace.n_events,
        "peak_live_bytes": live,
        "min_capacity_bytes": mc,
        "min_capacity_over_peak_live": mc / live if live else None,
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "peak_reserved_over_peak_live": r.peak_reserved_bytes / live if live else None,
        "capacity_bytes": capacity,
        "ooms": r.ooms,
        "ns_per_op": r.ns_per_op,
        "remaps": r.remaps,
        "num_pages_remapped": r.num_pages_remapped,
        "num_maps": r.num_maps,
        "num_unmaps": r.num_unmaps,
        "seconds": round(time.perf_counter() - t0, 2),
    }


def markdown(rows) -> str:
    out = [
        "| trace | events | peak live (GiB) | min capacity / peak live | peak reserved / peak live | "
        "ns/op (median) | remaps |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['trace']} | {r['events']} | {r['peak_live_bytes'] / (1 << 30):.3f} | "
            f"{r['min_capacity_over_peak_live']:.4f} | {r['peak_reserved_over_peak_live']:.4f} | "
            f"{r['ns_per_op']:.0f} | {r['remaps']} |"
        )
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=pathlib.Path, default=default_traces(), help="folder of *.trace.gz")
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "results", help="where replay.md/.json go")
    ap.add_argument("--capacity", type=parse_size, default=DEFAULT_CAPACITY, help="default capacity (80GiB)")
    args = ap.parse_args(argv)

    paths = sorted(args.traces.glob("*.trace.gz"))
    if not paths:
        print(f"replay.py: error: no *.trace.gz in {args.traces}", file=sys.stderr)
        return 2
    rows = []
    for p in paths:
        print(f"{p.name} ...", file=sys.stderr, flush=True)
        rows.append(measure(p, args.capacity))
    table = markdown(rows)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay.md").write_text(
        f"<!-- written by benchmarks/replay.py; default capacity {format_size(args.capacity)} -->\n" + table
    )
    meta = {
        "gpumem_version": gpumem.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "capacity_bytes": args.capacity,
        "min_capacity_precision_bytes": 1 << 20,
    }
    (args.out / "replay.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
