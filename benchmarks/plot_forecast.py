"""The forecast against the truth, drawn from gpu_forecast.py's JSON: one panel per model, one row
per allocator; each probe of the truth's search as a dot (ran) or a cross (out of memory), the
forecast's largest value as a bar, the truth's as a dashed one.

    python benchmarks/plot_forecast.py benchmarks/results/gpu_forecast.json benchmarks/results/gpu_forecast.png
"""

import json
import sys

ALLOCATORS = ("native", "gpumem")


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    models = list(results["models"])
    fig, axes = plt.subplots(len(models), 1, figsize=(7.5, 1.55 * len(models) + 0.6), squeeze=False)
    knobs = {r["model"]: r["knob"] for r in results["rows"]}
    for ax, name in zip(axes[:, 0], models):
        m = results["models"][name]
        largest = m["forecast"].get("largest") or {}
        for y, alloc in enumerate(ALLOCATORS):
            t = m.get("truth", {}).get(alloc, {})
            probes = t.get("probes", [])
            ran = [p["k"] for p in probes if p["ok"]]
            failed = [p["k"] for p in probes if not p["ok"]]
            ax.scatter(ran, [y] * len(ran), marker="o", color="tab:green", s=22, zorder=3)
            ax.scatter(failed, [y] * len(failed), marker="x", color="tab:red", s=26, zorder=3)
            if largest.get(alloc):
                ax.plot([largest[alloc]] * 2, [y - 0.32, y + 0.32], color="tab:blue", lw=2.5)
            if t.get("largest"):
                ax.plot([t["largest"]] * 2, [y - 0.42, y + 0.42], color="black", lw=1, ls="--")
        ax.set_yticks(range(len(ALLOCATORS)), ALLOCATORS)
        ax.set_ylim(-0.6, len(ALLOCATORS) - 0.4)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_title(f"{name}: {knobs.get(name, 'knob')}", fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    handles = [
        plt.Line2D([], [], marker="o", color="tab:green", ls="", label="probe ran"),
        plt.Line2D([], [], marker="x", color="tab:red", ls="", label="probe ran out of memory"),
        plt.Line2D([], [], color="tab:blue", lw=2.5, label="forecast largest"),
        plt.Line2D([], [], color="black", lw=1, ls="--", label="true largest"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=4, fontsize=8, frameon=False)
    cap = results.get("cap_bytes", 0) / (1 << 30)
    title = f"forecast from small steps vs search with real steps ({results.get('device')}, {cap:g} GiB)"
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)


def main(argv) -> int:
    if len(argv) != 2:
        print("usage: python benchmarks/plot_forecast.py RESULTS.json OUT.png", file=sys.stderr)
        return 2
    try:
        with open(argv[0]) as f:
            results = json.load(f)
    except (OSError, ValueError) as e:
        print(f"plot_forecast.py: cannot read {argv[0]}: {e}", file=sys.stderr)
        return 1
    if not isinstance(results, dict) or "models" not in results or "rows" not in results:
        print(f"plot_forecast.py: {argv[0]} is not gpu_forecast.py's JSON (no models and rows)", file=sys.stderr)
        return 1
    plot(results, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
