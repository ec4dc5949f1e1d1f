"""How big a physical allocation should be: replay every shipped trace at several chunk_pages.

    python3 benchmarks/chunk_pages.py [--traces DIR] [--out DIR] [--values 1,4,8,16,32,64]

A chunk is one device allocation of up to `chunk_pages` 2 MiB pages, mapped and
unmapped only as a whole: growth needs fewer device calls (each costs tens of
microseconds on a GPU), but a chunk that other blocks still use cannot be given
back or moved.  For each trace (gpumem/data/traces) and value this prints the
smallest capacity that replays with no OOM (to 1 MiB), the peak reserved at the
default capacity (80 GiB), and the device allocations (creates) and maps the
replay made; it writes <out>/chunk_pages.json (default benchmarks/results/).

The default's rule: the largest value whose min capacity and peak reserved stay
within 0.5% of peak live of chunk_pages=1's, on every trace (printed at the end).
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import platform
import sys

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent
try:
    import gpumem
except ImportError:  # not installed: use the checkout (built with build_ext --inplace)
    sys.path.insert(0, str(REPO))
    import gpumem
import gpumem._C  # noqa: E402
from gpumem._units import format_size  # noqa: E402
from gpumem.replay import DEFAULT_CAPACITY, min_capacity, replay  # noqa: E402
from gpumem.trace import load_trace  # noqa: E402

sys.path.insert(0, str(HERE))
from replay import default_traces  # noqa: E402

TOLERANCE = 0.005  # of peak live


def measure(trace, value: int) -> dict:
    kw = {"chunk_pages": value}
    r = replay(trace, DEFAULT_CAPACITY, timing=False, heap_kwargs=kw)
    return {
        "chunk_pages": value,
        "peak_live_bytes": r.peak_live_bytes,
        "min_capacity_bytes": min_capacity(trace, heap_kwargs=kw),
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "creates": r.num_device_alloc,
        "maps": r.num_maps,
        "ooms": r.ooms,
    }


def qualifies(rows: dict, value: int) -> bool:
    """Within TOLERANCE of peak live of chunk_pages=1 on min capacity and peak reserved, every trace."""
    for by_value in rows.values():
        base, r = by_value[1], by_value[value]
        slack = TOLERANCE * base["peak_live_bytes"]
        if r["min_capacity_bytes"] > base["min_capacity_bytes"] + slack:
            return False
        if r["peak_reserved_bytes"] > base["peak_reserved_bytes"] + slack:
            return False
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=pathlib.Path, default=None, help="directory of traces (default: the shipped ones)")
    ap.add_argument("--out", type=pathlib.Path, default=HERE / "results")
    ap.add_argument("--values", default="1,4,8,16,32,64", help="chunk_pages values, comma-separated (1 is added)")
    args = ap.parse_args(argv)
    values = sorted({1, *(int(v) for v in args.values.split(","))})
    tdir = args.traces or default_traces()
    paths = sorted(p for p in tdir.iterdir() if p.name.endswith((".trace", ".trace.gz")))
    rows: dict = {}
    lines = [
        ["trace", "chunk_pages", "min capacity", "Δmin/live", "peak reserved", "Δreserved/live", "creates", "maps"]
    ]
    for path in paths:
        trace = load_trace(path)
        rows[trace.name] = {}
        for v in values:
            r = measure(trace, v)
            rows[trace.name][v] = r
            base = rows[trace.name][1]
            live = r["peak_live_bytes"] or 1
            lines.append(
                [
                    trace.name,
                    str(v),
                    format_size(r["min_capacity_bytes"]),
                    f"{(r['min_capacity_bytes'] - base['min_capacity_bytes']) / live:+.2%}",
                    format_size(r["peak_reserved_bytes"]),
                    f"{(r['peak_reserved_bytes'] - base['peak_reserved_bytes']) / live:+.2%}",
                    str(r["creates"]),
                    str(r["maps"]),
                ]
            )
            print("  ".join(lines[-1]), file=sys.stderr, flush=True)
    ok = [v for v in values if qualifies(rows, v)]
    best = max(ok)
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    for row in lines:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print(
        f"\nwithin {TOLERANCE:.1%} of peak live of chunk_pages=1 on every trace: {ok}; "
        f"largest: {best} (gpumem's default: {gpumem._C.CHUNK_PAGES_DEFAULT})"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    out = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "tolerance_of_peak_live": TOLERANCE,
        "qualifying": ok,
        "largest_qualifying": best,
        "traces": {name: [by_value[v] for v in values] for name, by_value in rows.items()},
    }
    (args.out / "chunk_pages.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out / 'chunk_pages.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
