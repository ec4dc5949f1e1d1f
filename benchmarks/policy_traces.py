"""Room vs pressure on the shipped traces: the default policy against the heap tight everywhere (pressure 0).

    python3 benchmarks/policy_traces.py [--traces a,b,c] [--scale K] [--out benchmarks/results/policy_traces.json]

--traces takes shipped traces' names (gpumem.data.list_traces()), paths to trace files, e.g. the
ones `gpu_policy.py --trace DIR` records on a GPU, or folders of them (every *.trace.gz inside, e.g.
benchmarks/results/unseen): traces none of these rules was made on.

For each trace and each policy: peak reserved and device calls replayed with room (the simulated
device's 80 GiB), and the smallest capacity that fits, searched to 1 MiB -- a capacity near peak live
puts the heap under pressure for the end of the trace, with room at its start.  Ratios are to the
trace's peak live bytes, as in gpumem/data/traces/README.md.  Deterministic: the simulated device
gives the same figures on every machine.  --scale K replays every request K times as large: a trace
that fills a larger device (searched to 1 MiB too: the heap maps 2 MiB pages, and a coarser search
could report a page or two more than the trace needs).  --why adds, per trace and policy, what
the first failed request lacked one step below the smallest capacity, from its OOM report: the
request, how much it was short, and the free memory it could not have, stranded in pages live
blocks share and locked in partly used chunks.  Each row also gives the peak reserved of torch's
allocator with expandable segments on the same trace, from benchmarks/expandable_model.py (no cap):
what gpumem's peak reserved with room is held to.
"""

import argparse
import dataclasses
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import expandable_model  # noqa: E402
from gpumem import replay as R  # noqa: E402
from gpumem.data import list_traces  # noqa: E402
from gpumem.trace import load_trace  # noqa: E402

POLICIES = {"tight (pressure 0)": {"pressure": 0}, "default": {}}


def scaled(tr, k):
    """The trace with every request k times as large."""
    words = tr.words[:]
    for i in range(1, len(words), 3):
        words[i] *= k
    return dataclasses.replace(tr, words=words, peak_live_bytes=tr.peak_live_bytes * k)


def why_short(tr, capacity, kw):
    """The first failed request's OOM report when `tr` replays on `capacity` bytes: a dict of MiB."""
    from gpumem import OutOfMemoryError
    from gpumem.explain import last_oom

    heap = R._heap(capacity, kw)
    first = heap.replay(tr.events, tr.n_slots)["first_oom_event"]
    if first < 0:
        return None
    heap = R._heap(capacity, kw)  # again to just before the failure, then the failing request
    heap.replay(tr.events[: 24 * first], tr.n_slots)
    request, stream = tr.words[3 * first + 1], tr.words[3 * first + 2]
    try:
        heap.malloc(request, stream).free()
    except OutOfMemoryError:
        pass
    r = last_oom(heap)
    mib = 1 << 20
    return dict(
        event=first,
        request_mib=round(request / mib, 2),
        short_mib=round(r.shortfall / mib, 2),
        stranded_mib=round(r.stranded_bytes / mib, 2),
        chunk_locked_mib=round(r.chunk_locked_bytes / mib, 2),
    )


def trace_names(arg):
    """--traces' comma-separated entries, a folder standing for its *.trace.gz files (sorted)."""
    out = []
    for n in arg.split(","):
        if n and pathlib.Path(n).is_dir():
            out += sorted(str(p) for p in pathlib.Path(n).glob("*.trace.gz"))
        elif n:
            out.append(n)
    return out


def measure(name, scale=1, why=False):
    tr = load_trace(name)  # a shipped trace's name, or a trace file (named in the tables by its file's name)
    name = tr.name
    if scale > 1:
        tr = scaled(tr, scale)
    peak = tr.peak_live_bytes
    out = {}
    for label, kw in POLICIES.items():
        r = R.replay(tr, timing=False, heap_kwargs=kw)
        mc = R.min_capacity(tr, precision=R.MiB, heap_kwargs=kw)
        out[label] = dict(
            peak_reserved=round(r.peak_reserved_bytes / peak, 4),
            remaps=r.remaps,
            pages_remapped=r.num_pages_remapped,
            device_allocs=r.num_device_alloc,
            maps=r.num_maps,
            min_capacity=round(mc / peak, 4),
            min_capacity_bytes=mc,
        )
        if why:
            out[label]["short_below"] = why_short(tr, mc - R.MiB, kw)
    exp = expandable_model.replay(tr)["peak_reserved"]
    return dict(
        trace=name,
        peak_live_gib=round(peak / 2**30, 3),
        policies=out,
        expandable_peak_reserved=round(exp / peak, 4),
        expandable_peak_reserved_bytes=exp,
    )


def goals(rows):
    """The default policy against its goals, one line each, naming the traces that miss: a smallest
    capacity within 0.2% of peak live of the tight heap's and at most 1.01x peak live (1.005x where the
    tight heap gets there); a peak reserved with room at or below expandable segments'."""
    tight_miss, reserved_miss = [], []
    for r in rows:
        d, t = r["policies"]["default"], r["policies"]["tight (pressure 0)"]
        most = 1.005 if t["min_capacity"] <= 1.005 else 1.01
        if d["min_capacity"] > t["min_capacity"] + 0.002 or d["min_capacity"] > most:
            tight_miss.append(f"{r['trace']} {d['min_capacity']:.4f} (tight {t['min_capacity']:.4f})")
        if d["peak_reserved"] > r["expandable_peak_reserved"]:
            reserved_miss.append(f"{r['trace']} {d['peak_reserved']:.4f} ({r['expandable_peak_reserved']:.4f})")
    n = len(rows)
    return [
        f"smallest capacity, within 0.2% of the tight heap's and at most 1.01x (1.005x where it gets there): "
        f"met on {n - len(tight_miss)} of {n}; missed: {', '.join(tight_miss) or '-'}",
        f"peak reserved with room at or below expandable segments': met on {n - len(reserved_miss)} of {n}; "
        f"missed: {', '.join(reserved_miss) or '-'}",
    ]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=",".join(list_traces()))
    ap.add_argument("--scale", type=int, default=1, help="every request K times as large")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "policy_traces.json"))
    ap.add_argument("--why", action="store_true", help="what the first failed request lacked below min capacity")
    ap.add_argument("--split-chunks", action="store_true", help="both policies with split_chunks=1")
    a = ap.parse_args()
    if a.split_chunks:
        for kw in POLICIES.values():
            kw["split_chunks"] = 1
    if a.scale < 1:
        ap.error(f"--scale must be at least 1, got {a.scale}")
    rows = [measure(n, a.scale, a.why) for n in trace_names(a.traces)]
    print("| trace | peak live GiB | policy | peak reserved (80 GiB) | remaps (pages) ", end="")
    print("| device allocations | min capacity |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for label, p in r["policies"].items():
            print(
                f"| {r['trace']} | {r['peak_live_gib']} | {label} | {p['peak_reserved']:.4f} "
                f"| {p['remaps']} ({p['pages_remapped']}) | {p['device_allocs']} | {p['min_capacity']:.4f} |"
            )
    print("\n| trace | peak reserved with room: expandable segments (model) | default | tight (pressure 0) |")
    print("|---|---|---|---|")
    for r in rows:
        d, t = r["policies"]["default"]["peak_reserved"], r["policies"]["tight (pressure 0)"]["peak_reserved"]
        e = r["expandable_peak_reserved"]
        print(f"| {r['trace']} | {e:.4f} | {d:.4f}{' (over)' if d > e else ''} | {t:.4f} |")
    print()
    for line in goals(rows):
        print(line)
    if a.why:
        print("\n| trace | policy | request MiB | short MiB | stranded MiB | locked in chunks MiB |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            for label, p in r["policies"].items():
                w = p["short_below"]
                if w:
                    print(
                        f"| {r['trace']} | {label} | {w['request_mib']} | {w['short_mib']} | {w['stranded_mib']} "
                        f"| {w['chunk_locked_mib']} |"
                    )
    pathlib.Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
