"""The results document: its schema check, markdown tables and plots.

Everything here works from the JSON alone, so `gpu_compare.py --replot FILE` rebuilds tables and
plots on a machine without a GPU from what a device run sent back.
"""

from __future__ import annotations

import json
import os
import tarfile
from typing import Dict, List, Optional

from common import markdown_head, markdown_row

SCHEMA = "gpumem-gpu-compare/1"
GiB = 1 << 30
MiB = 1 << 20

FIGURE_TITLES = {
    "1": "Smallest capacity that replays each trace (÷ peak live)",
    "2": "Peak memory reserved with no cap (÷ peak live)",
    "3": "Replay wall time: no cap, and capped at 1.05 × peak live",
    "4": "Training step time (median of steps 5..N)",
    "5": "Largest batch that trains, llama_lora_ckpt under an 8 GiB cap",
    "6": "torch.empty + del, µs per pair, by size",
}
ROW_KEYS = {
    "1": ("trace", "contender", "status"),
    "2": ("trace", "contender", "status"),
    "3": ("trace", "contender", "status"),
    "4": ("workload", "contender", "status"),
    "5": ("length", "contender", "status"),
    "6": ("size", "contender", "status"),
}
ROW_STATUSES = {"ok", "partial", "oom", "failed", "unavailable", "skipped"}
FIGURE_STATUSES = {"done", "partial", "skipped", "not run"}


# ---- schema ---------------------------------------------------------------------------------------


def validate(doc: dict) -> List[str]:
    """Problems with a results document (empty when it is well formed)."""
    problems = []

    def need(obj, key, typ, where):
        if not isinstance(obj, dict) or key not in obj:
            problems.append(f"{where}: missing {key!r}")
            return None
        if typ is not None and not isinstance(obj[key], typ):
            problems.append(f"{where}.{key}: {type(obj[key]).__name__}, expected {getattr(typ, '__name__', typ)}")
            return None
        return obj[key]

    if need(doc, "schema", str, "doc") not in (None, SCHEMA):
        problems.append(f"doc.schema: {doc['schema']!r}, expected {SCHEMA!r}")
    for key, typ in (
        ("fake", bool),
        ("command", str),
        ("started", str),
        ("options", dict),
        ("contenders", dict),
        ("traces", dict),
        ("figures", dict),
    ):
        need(doc, key, typ, "doc")
    for name, c in (doc.get("contenders") or {}).items():
        st = need(c, "status", str, f"contenders.{name}")
        if st is not None and st not in ("ok", "unavailable", "error"):
            problems.append(f"contenders.{name}.status: {st!r}")
        if st and st != "ok":
            need(c, "reason", str, f"contenders.{name}")
    for fig, f in (doc.get("figures") or {}).items():
        where = f"figures.{fig}"
        if fig not in FIGURE_TITLES:
            problems.append(f"{where}: unknown figure")
            continue
        st = need(f, "status", str, where)
        if st is not None and st not in FIGURE_STATUSES:
            problems.append(f"{where}.status: {st!r}")
        rows = need(f, "rows", list, where)
        for i, row in enumerate(rows or []):
            for k in ROW_KEYS[fig]:
                need(row, k, None, f"{where}.rows[{i}]")
            rs = row.get("status") if isinstance(row, dict) else None
            if rs is not None and rs not in ROW_STATUSES:
                problems.append(f"{where}.rows[{i}].status: {rs!r}")
            if rs is not None and rs not in ("ok",) and not row.get("reason"):
                problems.append(f"{where}.rows[{i}]: status {rs!r} without a reason")
    return problems


# ---- formatting -----------------------------------------------------------------------------------


def fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    if n >= GiB:
        return f"{n / GiB:.3f} GiB"
    return f"{n / MiB:.1f} MiB"


def fmt_ratio(x: Optional[float], digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _short(reason: Optional[str], limit: int = 40) -> str:
    r = (reason or "").replace("|", "/").replace("\n", " ").strip()
    return r if len(r) <= limit else r[: limit - 1] + "…"


def status_cell(row: dict) -> Optional[str]:
    """The cell for a row that has no number to show, else None."""
    st = row.get("status")
    if st in ("ok", "partial"):
        return None
    if st == "oom":
        return "OOM"
    return f"{st}: {_short(row.get('reason'))}" if st != "skipped" else f"skipped ({_short(row.get('reason'), 24)})"


def md_table(header: List[str], rows: List[List[str]]) -> str:
    return "\n".join([markdown_head(" | ".join(header)), *(markdown_row(r) for r in rows)])


def _index(rows: List[dict], key: str) -> Dict[tuple, dict]:
    return {(r[key], r["contender"]): r for r in rows}


def _order(rows: List[dict], key: str) -> List:
    seen = []
    for r in rows:
        if r[key] not in seen:
            seen.append(r[key])
    return seen


def _table(fig: dict, contenders, labels, key: str, lead: List[str], lead_cells, cell, *, order=_order, tail=None):
    """A markdown table with one line per distinct `key` of the figure's rows, taken in `order`:
    `lead_cells(k)` under the `lead` headers, then a cell per contender ("-" where it has no row,
    status_cell where that row has no number, else `cell(row, contender)`), then `tail` (a pair of
    headers and a function of k giving their cells) when given."""
    rows = fig.get("rows", [])
    idx = _index(rows, key)
    header = lead + [labels.get(c, c) for c in contenders] + (tail[0] if tail else [])
    body = []
    for k in order(rows, key):
        line = lead_cells(k)
        for c in contenders:
            r = idx.get((k, c))
            line.append("-" if r is None else status_cell(r) or cell(r, c))
        if tail:
            line += tail[1](k)
        body.append(line)
    return md_table(header, body)


def _trace_lead(traces: dict):
    return lambda t: [t, fmt_bytes((traces.get(t) or {}).get("peak_live"))]


def cell_fig1(r: dict) -> str:
    s = status_cell(r)
    if s:
        return s
    ratio = r.get("ratio")
    if r["status"] == "partial":
        lo = r.get("ratio_max_fail")
        return f"≤{fmt_ratio(ratio)}" + (f" (>{fmt_ratio(lo)})" if lo else "")
    return fmt_ratio(ratio)


def table_fig1(fig: dict, contenders: List[str], labels: Dict[str, str], traces: dict) -> str:
    sim = fig.get("gpumem_sim") or {}

    def sim_cells(t):
        s = sim.get(t) or {}
        within = "" if s.get("within_1pct") in (None, True) else " ✗"
        return [fmt_ratio(s.get("sim_ratio")), fmt_ratio(s.get("gpu_over_sim"), 4) + within]

    tail = (["gpumem sim", "GPU ÷ sim"], sim_cells) if sim else None
    return _table(
        fig,
        contenders,
        labels,
        "trace",
        ["trace", "peak live"],
        _trace_lead(traces),
        lambda r, c: cell_fig1(r),
        tail=tail,
    )


def table_ratio(fig: dict, contenders, labels, traces, value_key="ratio") -> str:
    def cell(r, c):
        return fmt_ratio(r.get(value_key)) + ("*" if r.get("source") == "sampled" else "")

    return _table(fig, contenders, labels, "trace", ["trace", "peak live"], _trace_lead(traces), cell)


def table_fig3(fig: dict, contenders, labels) -> str:
    def cell(r, c):
        un = r.get("uncapped_wall_s")
        if r.get("capped_status") == "oom":
            cap_cell = "OOM"
        elif r.get("capped_wall_s") is not None:
            cap_cell = f"{r['capped_wall_s']:.3f} s (×{r['slowdown']:.2f})"
        else:
            cap_cell = _short(r.get("capped_status") or "-", 20)
        return f"{un:.3f} s / {cap_cell}" if un is not None else f"- / {cap_cell}"

    return _table(fig, contenders, labels, "trace", ["trace"], lambda t: [t], cell)


def table_fig4(fig: dict, contenders, labels) -> str:
    def cell(r, c):
        rel = r.get("rel_to_native")
        return f"{r['median_s'] * 1e3:.1f} ms" + (f" ({(rel - 1) * 100:+.1f}%)" if rel and c != "native" else "")

    return _table(fig, contenders, labels, "workload", ["workload"], lambda w: [w], cell)


def table_fig5(fig: dict, contenders, labels) -> str:
    def cell(r, c):
        b = r.get("max_batch")
        txt = "none" if not b else str(b)
        if r["status"] == "partial":
            txt = f"≥{txt}"
        if r.get("verified") is False:
            txt += " (fresh check differs)"
        return txt

    return _table(fig, contenders, labels, "length", ["sequence length"], lambda n: [str(n)], cell)


def table_fig6(fig: dict, contenders, labels) -> str:
    return _table(
        fig,
        contenders,
        labels,
        "size",
        ["size"],
        lambda size: [fmt_size_short(size)],
        lambda r, c: f"{r['us']:.2f}",
        order=lambda rows, key: sorted(_order(rows, key)),
    )


def fmt_size_short(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def markdown(doc: dict) -> str:
    contenders = doc.get("options", {}).get("contenders") or list(doc.get("contenders", {}))
    labels = doc.get("labels", {})
    traces = doc.get("traces", {})
    dev = doc.get("device") or {}
    out = [f"# gpumem vs other allocators on {dev.get('device_name', 'the GPU')}", ""]
    if doc.get("fake"):
        out += ["**FAKE BACKEND (--dry-run): these numbers are made up and measure nothing.**", ""]
    out += [
        f"- command: `{doc.get('command')}`",
        f"- started {doc.get('started')}, took {doc.get('elapsed_s', 0):.0f} s",
        f"- torch {dev.get('torch', '?')} (CUDA {dev.get('torch_cuda', '?')}), driver {dev.get('driver', '?')}, "
        f"{fmt_bytes(dev.get('total_memory'))}",
    ]
    for c, info in doc.get("contenders", {}).items():
        if info.get("status") != "ok":
            out.append(f"- {labels.get(c, c)}: **{info.get('status')}**: {info.get('reason')}")
    out.append("")
    figs = doc.get("figures", {})
    for k in sorted(figs):
        f = figs[k]
        out += [f"## Figure {k}. {FIGURE_TITLES[k]}", ""]
        if f.get("status") != "done":
            out += [f"Status: **{f.get('status')}**" + (f" ({f['reason']})" if f.get("reason") else ""), ""]
        if not f.get("rows"):
            out += ["(no results)", ""]
            continue
        if k == "1":
            out.append(table_fig1(f, contenders, labels, traces))
        elif k == "2":
            out.append(table_ratio(f, contenders, labels, traces))
        elif k == "3":
            out.append(table_fig3(f, contenders, labels))
        elif k == "4":
            out.append(table_fig4(f, contenders, labels))
        elif k == "5":
            out.append(table_fig5(f, contenders, labels))
        elif k == "6":
            out.append(table_fig6(f, contenders, labels))
        out.append("")
        for note in f.get("notes", []):
            out.append(f"- {note}")
        if f.get("notes"):
            out.append("")
    return "\n".join(out) + "\n"


# ---- plots ----------------------------------------------------------------------------------------


def _bars(ax, groups, contenders, labels, value, ylabel, baseline=None):
    import numpy as np

    x = np.arange(len(groups))
    width = 0.8 / max(1, len(contenders))
    for i, c in enumerate(contenders):
        ys = [value(g, c) for g in groups]
        ax.bar(x + i * width - 0.4 + width / 2, [y if y is not None else 0 for y in ys], width, label=labels.get(c, c))
        for xi, y in zip(x, ys):
            if y is None:
                ax.text(xi + i * width - 0.4 + width / 2, baseline or 0, "×", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(x)
    ax.set_xticklabels(groups, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    if baseline is not None:
        ax.axhline(baseline, color="black", linewidth=0.8)
    ax.legend(fontsize=7)


def _values(rows: List[dict], key: str, field: str, statuses=None):
    """The distinct `key`s of the rows, and value(k, contender): the row's `field`, None where there
    is no such row, no such field, or (with `statuses`) the row's status is not among them."""
    idx = _index(rows, key)

    def value(k, c):
        r = idx.get((k, c))
        return r.get(field) if r and (statuses is None or r.get("status") in statuses) else None

    return _order(rows, key), value


def plots(doc: dict, directory: str) -> List[str]:
    """One PNG per figure present; a figure whose plot fails is reported and skipped."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    contenders = doc.get("options", {}).get("contenders") or list(doc.get("contenders", {}))
    labels = doc.get("labels", {})
    made = []
    fake = " (FAKE)" if doc.get("fake") else ""
    for k, f in sorted(doc.get("figures", {}).items()):
        rows = f.get("rows") or []
        if not rows:
            continue
        try:
            fig, ax = plt.subplots(figsize=(9, 4.5))
            if k in ("1", "2"):
                groups, val = _values(rows, "trace", "ratio", ("ok", "partial"))
                ys = [v for g in groups for c in contenders if (v := val(g, c)) is not None]
                _bars(ax, groups, contenders, labels, val, "÷ peak live", baseline=1.0)
                if ys:
                    ax.set_ylim(0.98, max(ys) * 1.02)
            elif k == "3":
                groups, val = _values(rows, "trace", "slowdown")
                _bars(
                    ax, groups, contenders, labels, val, "capped (1.05 × peak live) ÷ uncapped wall time", baseline=1.0
                )
            elif k == "4":
                groups, val = _values(rows, "workload", "rel_to_native", ("ok",))
                _bars(ax, groups, contenders, labels, val, "median step time ÷ native", baseline=1.0)
            elif k == "5":
                groups, val = _values(rows, "length", "max_batch", ("ok", "partial"))
                _bars(
                    ax,
                    [str(g) for g in groups],
                    contenders,
                    labels,
                    lambda g, c: val(int(g), c),
                    "largest batch (8 GiB cap)",
                )
                ax.set_xlabel("sequence length")
            elif k == "6":
                idx = _index(rows, "size")
                sizes = sorted(_order(rows, "size"))
                for c in contenders:
                    pts = [(s, idx[(s, c)]["us"]) for s in sizes if (s, c) in idx and idx[(s, c)]["status"] == "ok"]
                    if pts:
                        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=labels.get(c, c))
                ax.set_xscale("log", base=2)
                ax.set_xlabel("bytes")
                ax.set_ylabel("µs per torch.empty + del")
                ax.legend(fontsize=7)
            ax.set_title(f"Figure {k}. {FIGURE_TITLES[k]}{fake}", fontsize=10)
            fig.tight_layout()
            path = os.path.join(directory, f"gpu_compare_fig{k}.png")
            fig.savefig(path, dpi=110)
            plt.close(fig)
            made.append(path)
        except Exception as e:  # a broken plot must not lose the numbers
            plt.close("all")
            doc.setdefault("plot_errors", {})[k] = f"{type(e).__name__}: {e}"
    return made


def tar_files(paths: List[str], dest: str) -> str:
    with tarfile.open(dest, "w") as t:
        for p in paths:
            t.add(p, arcname=os.path.basename(p))
    return dest


def write_json(doc: dict, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=False, default=str)
    os.replace(tmp, path)
