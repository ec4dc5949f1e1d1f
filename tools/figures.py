"""The benchmark figures the README, docs/guide.md, docs/design.md and the shipped traces' README
show, made from benchmarks/results.

    python3 tools/figures.py           # rewrite the marked tables from the results
    python3 tools/figures.py --check   # exit 1, naming each table that disagrees with them

Each table sits in its document between `<!-- figures: NAME -->` and `<!-- figures: end -->`;
what lies between is this script's, so a figure there has one source: the JSON a benchmark
wrote (gpu_compare.json: benchmarks/gpu_compare.py, every allocator in one run on one GPU;
gpu_growth.json: benchmarks/gpu_growth.py; replay.json: benchmarks/replay.py; policy_traces.json:
benchmarks/policy_traces.py; gpu_policy_carve.json: benchmarks/gpu_policy.py).  tests/repo/test_figures.py runs the
check.
"""

import json
import pathlib
import re
import statistics
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
DOCS = ("README.md", "docs/guide.md", "docs/design.md", "gpumem/data/traces/README.md")
MARK = re.compile(r"(<!-- figures: (\w+) -->\n)(.*?)(<!-- figures: end -->)", re.S)
# The run of benchmarks/gpu_policy.py on the current heap that the step-time row quotes.
STEP_RUN = "gpu_policy_carve.json"
LABELS = {"native": "native", "expandable": "expandable_segments", "async": "cudaMallocAsync", "gpumem": "gpumem"}


def load(name):
    with open(RESULTS / name) as f:
        return json.load(f)


def _fig(data, n):
    """Figure n's rows by (trace, workload or size; contender); ValueError for a row that did not run."""
    rows = {}
    for r in data["figures"][str(n)]["rows"]:
        key = next(r[k] for k in ("trace", "workload", "size") if k in r)
        if r["status"] != "ok":
            raise ValueError(f"gpu_compare.json figure {n}: {key} {r['contender']} is {r['status']!r}, not ok")
        rows[key, r["contender"]] = r
    return rows


def _run_line(data):
    info = data["contenders"]["native"]["info"]
    day = data["started"][:10]
    return (
        f"One run of every allocator on one {info['device_name']}, torch {info['torch']}, {day} "
        "(`benchmarks/results/gpu_compare.json`, docs/benchmarks.md)."
    )


def min_capacity(data):
    """Smallest device that replays each shipped trace with no OOM, divided by its peak live memory."""
    fig, sim = _fig(data, 1), data["figures"]["1"]["gpumem_sim"]
    head = "| trace | peak live | native | expandable_segments | cudaMallocAsync | gpumem | gpumem, simulated |"
    rows = [_run_line(data), "", head, "|---|---|---|---|---|---|---|"]
    for name, t in data["traces"].items():
        cells = [f"{fig[name, c]['ratio']:.3f}" for c in LABELS]
        cells[-1] = f"**{cells[-1]}**"
        rows.append(
            f"| {name} | {t['peak_live'] / (1 << 30):.3f} GiB | {' | '.join(cells)} | {sim[name]['sim_ratio']:.4f} |"
        )
    return rows


def traces(data, sim=None):
    """PyTorch's allocators on each shipped trace: smallest capacity (peak reserved with no cap),
    both ÷ peak live; with `sim` (replay.json), gpumem on the simulated device beside them."""
    f1, f2 = _fig(data, 1), _fig(data, 2)
    gm = {r["trace"]: r for r in sim["results"]} if sim else {}
    head = "| trace | allocs | peak live (GiB) | native | expandable_segments | cudaMallocAsync |"
    rows = [head + (" gpumem |" if sim else ""), "|---|---|---|---|---|---|" + ("---|" if sim else "")]
    for name, t in data["traces"].items():
        cells = [f"{f1[name, c]['ratio']:.3f} ({f2[name, c]['ratio']:.3f})" for c in ("native", "expandable", "async")]
        if sim:
            g = gm[name]
            cells.append(f"**{g['min_capacity_over_peak_live']:.4f}** ({g['peak_reserved_over_peak_live']:.4f})")
        rows.append(f"| {name} | {t['allocs']} | {t['peak_live'] / (1 << 30):.3f} | {' | '.join(cells)} |")
    return rows


def expandable(data):
    """What gpumem saves over expandable_segments, trace by trace, in device memory."""
    fig = _fig(data, 1)
    rows = [
        "| trace | peak live | expandable_segments needs | gpumem needs | gpumem saves |",
        "|---|---|---|---|---|",
    ]
    for name, t in data["traces"].items():
        exp, gm = fig[name, "expandable"]["min_cap"], fig[name, "gpumem"]["min_cap"]
        live = t["peak_live"]
        rows.append(
            f"| {name} | {live / (1 << 30):.3f} GiB | {exp / (1 << 30):.3f} GiB | {gm / (1 << 30):.3f} GiB | "
            f"{(exp - gm) / (1 << 20):.0f} MiB ({100 * (exp - gm) / live:.1f}% of peak live) |"
        )
    return rows


def _span(values, fmt):
    lo, hi = min(values), max(values)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)} to {fmt.format(hi)}"


def room_row(policy):
    """Peak reserved with room under the default policy, beside expandable segments' (modelled), on
    every trace of policy_traces.json (benchmarks/policy_traces.py, the simulated device)."""
    exp = [r["expandable_peak_reserved"] for r in policy]
    mine = [r["policies"]["default"]["peak_reserved"] for r in policy]
    over = sum(m > e for m, e in zip(mine, exp))
    return (
        f"| peak reserved with room (80 GiB), the default policy, ÷ peak live | - | {_span(exp, '{:.3f}')} "
        f"| {_span(mine, '{:.3f}')} | {len(policy)} shipped and zoo traces, simulated; over expandable_segments' "
        f"on {over}, `policy_traces.json` |"
    )


def paired_row(run):
    """Steady step against native's, paired step by step within each round and the median taken over
    the rounds, per workload (benchmarks/gpu_policy.py's paired figure), from a run of gpu_policy.py."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from gpu_policy import _paired

    rows, meta = run["rows"], run["meta"]
    others = ("expandable", "gpumem")
    # each workload's per-round pairs; _paired leaves out a round with OOMs (the capped workload's)
    pairs = {
        (n, u): [x for x in _paired(rows, n, u, "native") if x is not None] for n in meta["workloads"] for u in others
    }
    names = [n for n in meta["workloads"] if any(pairs[n, u] for u in others)]

    def span(use):
        if use == "native":
            return "-"
        per = [statistics.median(pairs[n, use]) for n in names if pairs[n, use]]
        return _span([100 * (x - 1) for x in per], "{:+.1f}%") if per else "-"

    return (
        "| training step time against native (steady step paired with native's, median of rounds) | "
        + " | ".join(span(c) for c in ("native", "expandable", "gpumem"))
        + f" | {', '.join(names)}, {meta['rounds']} rotated rounds on one {meta['device']}, "
        f"`{STEP_RUN}` |"
    )


def costs(data, growth, policy, run):
    """What gpumem costs, beside native and expandable_segments, in one table."""
    f1, f2, f4, f6 = _fig(data, 1), _fig(data, 2), _fig(data, 4), _fig(data, 6)
    traces, workloads = list(data["traces"]), sorted({w for w, _ in f4})
    sizes = sorted({s for s, _ in f6})
    who = ("native", "expandable", "gpumem")

    def ratio_row(fig, key):
        return [_span([fig[t, c][key] for t in traces], "{:.3f}") for c in who]

    def step(c):
        rel = [100 * (f4[w, c]["median_s"] / f4[w, "native"]["median_s"] - 1) for w in workloads]
        return "-" if c == "native" else _span(rel, "{:+.1f}%")

    page = {(r["chunk_pages"], r["pages"]): r for r in growth["rows"]}
    grow, moved = page[1, 512]["grow_us_per_page"], page[1, 64]["remap_us_per_page"]
    rows = [
        "| cost | native | expandable_segments | gpumem | measured by |",
        "|---|---|---|---|---|",
        "| smallest device that runs a trace, ÷ its peak live | "
        + " | ".join(ratio_row(f1, "ratio"))
        + f" | {len(traces)} shipped traces, figure 1 |",
        "| peak reserved with no cap, ÷ peak live | "
        + " | ".join(ratio_row(f2, "ratio"))
        + f" | {len(traces)} shipped traces, figure 2 (gpumem before the room policy) |",
        room_row(policy),
        "| training step time against native (median step) | "
        + " | ".join(step(c) for c in who)
        + f" | {', '.join(workloads)}, figure 4 (gpumem before the room policy) |",
        paired_row(run),
        "| `torch.empty` + `del`, µs a pair | "
        + " | ".join(_span([f6[s, c]["us"] for s in sizes], "{:.2f}") for c in who)
        + " | 512 B to 1 GiB, figure 6 |",
        f"| growing the heap, µs per 2 MiB page | - | - | {grow:.1f} | 512 pages at once, `gpu_growth.json` |",
        f"| defragmenting, µs per page moved | - | - | {moved:.1f} | 64 pages, `gpu_growth.json` |",
    ]
    return rows


def tables():
    data, growth = load("gpu_compare.json"), load("gpu_growth.json")
    return {
        "traces": traces(data),
        "traces_and_gpumem": traces(data, load("replay.json")),
        "min_capacity": min_capacity(data),
        "expandable": expandable(data),
        "costs": costs(data, growth, load("policy_traces.json"), load(STEP_RUN)),
    }


def rewrite(text, made):
    """text with each marked table replaced by its made lines; KeyError for an unknown name."""
    return MARK.sub(lambda m: m.group(1) + "\n".join(made[m.group(2)]) + "\n" + m.group(4), text)


def main(argv):
    made = tables()
    stale = []
    for doc in DOCS:
        path = REPO / doc
        text = path.read_text()
        new = rewrite(text, made)
        if new != text:
            stale.append(doc)
            if "--check" not in argv:
                path.write_text(new)
    if "--check" in argv and stale:
        print(f"figures: {', '.join(stale)} disagree with benchmarks/results (python3 tools/figures.py)")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
