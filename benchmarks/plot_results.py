"""Plots of the benchmark results that docs/benchmarks.md shows, from their JSON files.

    python benchmarks/plot_results.py [--results benchmarks/results] [--out benchmarks/results]

Writes, for each JSON file that exists (a missing one is skipped with a line saying so):
  slowpath_scaling.png  CPU time of one slow-path allocation against live blocks, before and after
                        (slowpath_scaling.json, slowpath_scaling_before.json,
                        slowpath_scaling_defrag_before.json)
  gpu_vs_sim.png        smallest capacity ÷ peak live per trace, GPU against the simulated device
                        (gpu_vs_sim.json)
  gpu_train_chunks.png  training step time ÷ native's, median step and whole run, per workload and
                        allocator (gpu_train_chunks.json, written by gpu_train.py --json)
  gpu_train_pages.png   the same, and the run repeated after empty_cache(), for 2 and 8 MiB pages
                        (gpu_train_pages.json)
Needs matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Optional

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(results: str, name: str) -> Optional[object]:
    path = os.path.join(results, name)
    if not os.path.exists(path):
        print(f"skipped: {path} does not exist", file=sys.stderr)
        return None
    with open(path) as f:
        return json.load(f)


def plot_slowpath(plt, results: str, out: str) -> Optional[str]:
    after = _load(results, "slowpath_scaling.json")
    if after is None:
        return None
    before = _load(results, "slowpath_scaling_before.json") or {}
    defrag_before = _load(results, "slowpath_scaling_defrag_before.json") or {}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    series = [
        ("placement + growth, before", before.get("rows", []), "--", "tab:red"),
        ("placement + growth, now", after.get("rows", []), "-", "tab:red"),
        ("defragmenting, before", defrag_before.get("defrag_rows", []), "--", "tab:blue"),
        ("defragmenting, now", after.get("defrag_rows", []), "-", "tab:blue"),
    ]
    for label, rows, style, color in series:
        rows = [r for r in rows if r.get("median_cpu_us") is not None]
        if rows:
            ax.plot(
                [r["live_blocks"] for r in rows],
                [r["median_cpu_us"] for r in rows],
                style,
                marker="o",
                color=color,
                label=label,
            )
    ax.axhline(50, color="gray", linewidth=0.8, linestyle=":", label="goal: 50 µs at 100,000 blocks")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("live blocks in the heap")
    ax.set_ylabel("CPU µs per slow-path allocation (median)")
    ax.set_title("One 64 MiB slow-path allocation, simulated device")
    ax.legend(fontsize=8)
    return _save(fig, out, "slowpath_scaling.png")


def plot_gpu_vs_sim(plt, results: str, out: str) -> Optional[str]:
    doc = _load(results, "gpu_vs_sim.json")
    if doc is None:
        return None
    names, gpu, sim = [], [], []
    for name, t in doc.get("traces", {}).items():
        g = (t.get("gpu") or {}).get("ratio")
        s = ((t.get("sim") or {}).get("0") or {}).get("ratio")
        if g is None or s is None:
            continue
        names.append(name + (f"\n({t['streams']} streams)" if (t.get("streams") or 1) > 1 else ""))
        gpu.append(g)
        sim.append(s)
    if not names:
        print("skipped: gpu_vs_sim.json holds no trace with both figures", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(9, 4.2))
    xs = range(len(names))
    device = doc.get("device") if isinstance(doc.get("device"), dict) else {}
    gpu_label = f"GPU ({device['device_name']})" if device.get("device_name") else "GPU"
    ax.bar([x - 0.2 for x in xs], gpu, width=0.4, label=gpu_label, color="tab:green")
    ax.bar([x + 0.2 for x in xs], sim, width=0.4, label="simulated device", color="tab:gray")
    ax.axhline(1.01, color="tab:red", linewidth=0.8, linestyle=":", label="multi-stream goal: 1.01")
    ax.set_ylim(0.995, max(max(gpu), max(sim), 1.01) + 0.004)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("smallest capacity ÷ peak live")
    ax.set_title("gpumem's smallest capacity: GPU against the simulated replay")
    ax.legend(fontsize=8)
    return _save(fig, out, "gpu_vs_sim.png")


PANELS = (
    ("median_ms", "median step"),
    ("total_ms", "whole run, first steps included"),
    ("again_total_ms", "whole run again, after empty_cache()"),
)


def _plot_train(plt, results: str, out: str, source: str, target: str) -> Optional[str]:
    rows = _load(results, source)
    if not rows:
        return None
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    allocators = list(dict.fromkeys(r["allocator"] for r in rows))
    if "native" not in allocators:
        print(f"skipped: {source} has no native runs to compare with", file=sys.stderr)
        return None
    others = [a for a in allocators if a != "native"]
    panels = [(k, t) for k, t in PANELS if any(k in r for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4.2), sharey=True)
    width = 0.8 / max(1, len(others))
    for ax, (key, title) in zip(axes, panels):
        for i, a in enumerate(others):
            ratios = []
            for w in workloads:
                nat = [r[key] for r in rows if r["workload"] == w and r["allocator"] == "native" and key in r]
                mine = [r[key] for r in rows if r["workload"] == w and r["allocator"] == a and key in r]
                ratios.append(statistics.median(mine) / statistics.median(nat) if nat and mine else float("nan"))
            ax.bar([x + (i - (len(others) - 1) / 2) * width for x in range(len(workloads))], ratios, width, label=a)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(workloads)))
        ax.set_xticklabels(workloads, fontsize=8)
        ax.set_title(title)
    axes[0].set_ylabel("time ÷ native's")
    axes[0].set_ylim(0.6, None)
    axes[-1].legend(fontsize=7)
    fig.suptitle("Training step time against PyTorch's native allocator")
    return _save(fig, out, target)


def plot_gpu_train(plt, results: str, out: str) -> Optional[str]:
    return _plot_train(plt, results, out, "gpu_train_chunks.json", "gpu_train_chunks.png")


def plot_gpu_train_pages(plt, results: str, out: str) -> Optional[str]:
    return _plot_train(plt, results, out, "gpu_train_pages.json", "gpu_train_pages.png")


def _save(fig, out: str, name: str) -> str:
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, name)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=os.path.join(HERE, "results"), help="where the JSON files are")
    ap.add_argument("--out", default=None, help="where the PNGs go (default: --results)")
    a = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_results.py needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return 2
    out = a.out or a.results
    for plot in (plot_slowpath, plot_gpu_vs_sim, plot_gpu_train, plot_gpu_train_pages):
        path = plot(plt, a.results, out)
        if path:
            print("wrote", path)
        plt.close("all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
