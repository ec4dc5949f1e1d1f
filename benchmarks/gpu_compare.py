#!/usr/bin/env python3
"""gpumem vs native, expandable_segments, cudaMallocAsync and RMM, side by side on one GPU.

    python benchmarks/gpu_compare.py [--traces DIR] [--figures 1,2,3,4,5,6] [--contenders native,...]
                                     [--quick] [--deadline 540] [--out benchmarks/results]
    python benchmarks/gpu_compare.py --dry-run --traces DIR      # fake backend, no GPU: tests the plumbing
    python benchmarks/gpu_compare.py --replot results.json       # tables and plots from a run's JSON

Writes gpu_compare.json, gpu_compare.md, gpu_compare_fig*.png (and gpu_compare_plots.tar with
them), gpu_compare_logs.txt into --out, and copies the JSON, markdown, tar and logs into
--copy-to DIR when given.  Every attempt runs in a fresh process; a contender or
figure that fails is recorded with its reason and the run goes on.  docs/benchmarks.md explains
the figures, the fair cap and the time plan.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare import report  # noqa: E402
from compare.contenders import CONTENDERS, parse_contenders  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
ALL_FIGURES = ["1", "2", "3", "4", "5", "6"]


def _figures(text: str):
    figs = [f.strip() for f in text.split(",") if f.strip()]
    bad = [f for f in figs if f not in ALL_FIGURES]
    if bad or not figs:
        raise argparse.ArgumentTypeError(f"figures are among {','.join(ALL_FIGURES)}; got {text!r}")
    return [f for f in ALL_FIGURES if f in figs]


def _contenders(text: str):
    try:
        return parse_contenders(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(text: str) -> int:
    t = text.strip().lower().replace(" ", "")
    for suffix, mult in (("gib", GiB), ("mib", MiB), ("kib", 1024), ("g", GiB), ("m", MiB), ("k", 1024), ("b", 1)):
        if t.endswith(suffix):
            try:
                v = float(t[: -len(suffix)]) * mult
            except ValueError:
                break
            if v <= 0:
                break
            return int(v)
    try:
        v = int(t)
        if v > 0:
            return v
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 8GiB, 32MiB)")


def _ints(text: str):
    try:
        xs = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not xs or any(x <= 0 for x in xs):
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return xs


def _json_obj(text: str) -> dict:
    try:
        v = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def build_parser() -> argparse.ArgumentParser:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(
        prog="gpu_compare.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--traces",
        default=os.path.join(here, "..", "gpumem", "data", "traces"),
        help="directory of *.trace.gz (default: the traces shipped in gpumem/data/traces)",
    )
    p.add_argument(
        "--only-traces",
        type=lambda s: [x for x in s.split(",") if x],
        default=None,
        metavar="NAME,...",
        help="replay only these traces",
    )
    p.add_argument(
        "--figures", type=_figures, default=list(ALL_FIGURES), metavar="1,2,...", help="figures to make (default all)"
    )
    p.add_argument(
        "--contenders",
        type=_contenders,
        default=list(CONTENDERS),
        metavar="NAME,...",
        help=f"allocators (default {','.join(CONTENDERS)})",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="coarser and shorter: 32 MiB resolution, 8 training steps, one fig-5 length",
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=540.0,
        metavar="S",
        help="seconds for the whole run; figures share it (default 540)",
    )
    p.add_argument("--resolution", type=_size, default=None, help="figure 1 search resolution (default 8MiB)")
    p.add_argument("--fig4-steps", type=int, default=None, help="training steps per run (default 12)")
    p.add_argument("--fig5-cap", type=_size, default=8 * GiB, help="figure 5 cap (default 8GiB)")
    p.add_argument(
        "--fig5-lengths",
        type=_ints,
        default=None,
        help="figure 5 sequence lengths, headline first (default 1024,512,2048)",
    )
    p.add_argument(
        "--gpumem-options",
        type=_json_obj,
        default={},
        metavar="JSON",
        help="keyword options for gpumem.install(), as a JSON object",
    )
    p.add_argument("--out", default=os.path.join(here, "results"), help="output directory")
    p.add_argument(
        "--copy-to", default=None, metavar="DIR", help="also copy the JSON, markdown, plots tar and logs here"
    )
    p.add_argument(
        "--spawn", action="store_true", help="a fresh interpreter per attempt instead of a fork of the worker server"
    )
    p.add_argument("--dry-run", action="store_true", help="fake backend: no torch, no GPU (tests the plumbing)")
    p.add_argument("--replot", metavar="JSON", help="only rebuild the markdown and plots from a results file")
    return p


def finish_args(args) -> None:
    if args.resolution is None:
        args.resolution = 32 * MiB if args.quick else 8 * MiB
    if args.fig4_steps is None:
        args.fig4_steps = 8 if args.quick else 12
    if args.fig4_steps < 5:
        raise SystemExit("gpu_compare.py: error: --fig4-steps must be at least 5 (median of steps 5..N)")
    if args.fig5_lengths is None:
        args.fig5_lengths = [1024] if args.quick else [1024, 512, 2048]
    if args.deadline < 30:
        raise SystemExit("gpu_compare.py: error: --deadline below 30 s leaves no time for any figure")


def replot(path: str, out: str) -> int:
    with open(path) as f:
        doc = json.load(f)
    problems = report.validate(doc)
    for pr in problems:
        print(f"schema: {pr}", file=sys.stderr)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_compare.md"), "w") as f:
        f.write(report.markdown(doc))
    made = report.plots(doc, out)
    print("\n".join([os.path.join(out, "gpu_compare.md")] + made))
    return 1 if problems else 0


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.replot:
        return replot(args.replot, args.out)
    finish_args(args)
    if not os.path.isdir(args.traces):
        parser.error(f"--traces {args.traces!r} is not a directory")
    from compare.runner import Run, on_sigterm

    signal.signal(signal.SIGTERM, on_sigterm)
    command = "python benchmarks/gpu_compare.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    return Run(args, command).run()


if __name__ == "__main__":
    sys.exit(main())
