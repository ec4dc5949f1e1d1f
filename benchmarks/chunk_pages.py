"""How big a physical allocation should be: replay every shipped trace at several chunk_pages and page sizes.

    python3 benchmarks/chunk_pages.py [--traces DIR] [--out DIR] [--values 1,4,8,16,32,64]
                                      [--page-sizes 4,8,16] [--split]

Two ways to grow with fewer device calls (each costs tens of microseconds on a GPU):

  chunk_pages=N   one device allocation of up to N 2 MiB pages, mapped and unmapped only as a
                  whole: a chunk that other blocks still use cannot be given back or moved;
  split_chunks=1  (--split) with chunk_pages=N: under pressure a chunk that blocks still use is
                  split, their pages copied to single pages, so its free ones go back;
  page_size=M     pages of M MiB, each its own allocation: every page still moves on its own,
                  but a block keeps whole M MiB pages, so small blocks keep more memory.

For each trace (gpumem/data/traces) and layout this prints the smallest capacity that
replays with no OOM (to 1 MiB), the peak reserved at the default capacity (80 GiB), and the
device allocations (creates) and maps the replay made; it writes <out>/chunk_pages.json
(default benchmarks/results/).

The default's rule: a layout qualifies when its min capacity and peak reserved stay within
0.5% of peak live of the default layout's (2 MiB pages, chunk_pages=1), on every trace; the
qualifying layouts are printed at the end.
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


MiB = 1 << 20


def layouts(values: str, page_sizes: str, split: bool = False) -> list:
    """(label, heap keyword arguments): the default first, then each chunk_pages (with `split`, each
    also with split_chunks=1), then each page size."""
    out = [("chunk_pages=1", {"chunk_pages": 1})]
    for v in sorted({int(v) for v in values.split(",") if v.strip()} - {1}):
        out.append((f"chunk_pages={v}", {"chunk_pages": v}))
        if split:
            out.append((f"chunk_pages={v} split", {"chunk_pages": v, "split_chunks": 1}))
    for m in sorted({int(m) for m in page_sizes.split(",") if m.strip()} - {2}):
        out.append((f"page_size={m}MiB", {"page_size": m * MiB}))
    return out


def measure(trace, kw: dict) -> dict:
    r = replay(trace, DEFAULT_CAPACITY, timing=False, heap_kwargs=kw)
    return {
        "chunk_pages": kw.get("chunk_pages", 1),
        "page_size": kw.get("page_size", 2 * MiB),
        "peak_live_bytes": r.peak_live_bytes,
        "min_capacity_bytes": min_capacity(trace, heap_kwargs=kw),
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "creates": r.num_device_alloc,
        "maps": r.num_maps,
        "ooms": r.ooms,
    }


def qualifies(rows: dict, label: str) -> bool:
    """Within TOLERANCE of peak live of the default layout on min capacity and peak reserved, every trace."""
    for by_label in rows.values():
        base, r = by_label["chunk_pages=1"], by_label[label]
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
    ap.add_argument("--page-sizes", default="4,8,16", help="page sizes in MiB (chunk_pages 1), comma-separated")
    ap.add_argument("--split", action="store_true", help="each chunk_pages value also with split_chunks=1")
    args = ap.parse_args(argv)
    todo = layouts(args.values, args.page_sizes, args.split)
    tdir = args.traces or default_traces()
    paths = sorted(p for p in tdir.iterdir() if p.name.endswith((".trace", ".trace.gz")))
    rows: dict = {}
    lines = [["trace", "layout", "min capacity", "Δmin/live", "peak reserved", "Δreserved/live", "creates", "maps"]]
    for path in paths:
        trace = load_trace(path)
        rows[trace.name] = {}
        for label, kw in todo:
            r = measure(trace, kw)
            rows[trace.name][label] = r
            base = rows[trace.name]["chunk_pages=1"]
            live = r["peak_live_bytes"] or 1
            lines.append(
                [
                    trace.name,
                    label,
                    format_size(r["min_capacity_bytes"]),
                    f"{(r['min_capacity_bytes'] - base['min_capacity_bytes']) / live:+.2%}",
                    format_size(r["peak_reserved_bytes"]),
                    f"{(r['peak_reserved_bytes'] - base['peak_reserved_bytes']) / live:+.2%}",
                    str(r["creates"]),
                    str(r["maps"]),
                ]
            )
            print("  ".join(lines[-1]), file=sys.stderr, flush=True)
    ok = [label for label, _ in todo if qualifies(rows, label)]
    widths = [max(len(row[i]) for row in lines) for i in range(len(lines[0]))]
    for row in lines:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    print(
        f"\nwithin {TOLERANCE:.1%} of peak live of 2 MiB pages, chunk_pages=1 on every trace: {', '.join(ok)} "
        f"(gpumem's default: chunk_pages={gpumem._C.CHUNK_PAGES_DEFAULT}, the device's page)"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    out = {
        "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "tolerance_of_peak_live": TOLERANCE,
        "qualifying": ok,
        "traces": {
            name: [dict(layout=label, **by_label[label]) for label, _ in todo] for name, by_label in rows.items()
        },
    }
    (args.out / "chunk_pages.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out / 'chunk_pages.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
