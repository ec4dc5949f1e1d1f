"""python -m gpumem forecast TRACE_A TRACE_B [TRACE_C] --knob 2,4[,8] --device-memory 80GiB ...

Forecast, from traces of one step recorded at two or three values of a knob
(batch size, sequence length), the memory at other values and the largest value
that fits a device: see gpumem/forecast/.  Registered by gpumem/cli/__init__.py.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..forecast import Forecast, ForecastError
from ..trace import TraceError
from .args import EXIT_OK, _usage_failure, _whole_arg, add_capacity_arg, add_device_arg, add_traces_arg

HELP = "forecast the memory at any batch or sequence length, and the largest that fits, from 2-3 recorded steps"


def _knob_list(text: str):
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p, 10) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"knob values must be whole numbers separated by commas: {text!r}") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"knob values must be positive: {text!r}")
    return values


def _multiple_arg(text: str) -> int:
    return _whole_arg(text, "multiple", 1)


def add_forecast_args(p: argparse.ArgumentParser) -> None:
    add_traces_arg(
        p,
        "two or three traces of the same step (gpumem text traces or torch snapshot pickles), "
        "one per --knob value, in the same order",
    )
    p.add_argument(
        "--knob",
        type=_knob_list,
        required=True,
        metavar="K1,K2[,K3]",
        help="the knob value each TRACE was recorded at, e.g. 2,4 (batch sizes) or 128,256,512 (sequence lengths)",
    )
    cap = p.add_mutually_exclusive_group()
    add_capacity_arg(
        cap,
        "--device-memory",
        "the device's memory the allocator may use, e.g. 80GiB: also find the largest knob value that fits",
    )
    add_capacity_arg(cap, "--cap", "the same, as a cap, e.g. 12GiB")
    p.add_argument("--at", type=_knob_list, default=[], metavar="K,...", help="also forecast these knob values")
    p.add_argument(
        "--name", default="knob", metavar="NAME", help="what the knob is, e.g. batch or seq (for the report)"
    )
    p.add_argument(
        "--multiple", type=_multiple_arg, default=1, metavar="N", help="search only multiples of N (default 1)"
    )
    add_device_arg(p, "which device of a torch snapshot (default 0)")
    p.add_argument("--plot", metavar="OUT.png", default=None, help="write a plot of the forecast (needs matplotlib)")
    p.add_argument("--html", metavar="OUT.html", default=None, help="write the forecast as an HTML page")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_forecast(args) -> int:
    if len(args.traces) < 2:
        return _usage_failure("forecast needs two or more traces, one per --knob value")
    if len(args.traces) != len(args.knob):
        return _usage_failure(f"{len(args.traces)} traces but {len(args.knob)} --knob values: give one value per trace")
    capacity = args.device_memory or args.cap
    try:
        fc = Forecast.from_traces(
            args.traces,
            args.knob,
            device=args.device,
            name=args.name,
            capacity=capacity,
            at=args.at,
            multiple=args.multiple,
        )
        if args.plot:
            fc.plot(args.plot)
        if args.html:
            fc.to_html(args.html)
    except (TraceError, ForecastError, ImportError) as e:
        return _usage_failure(str(e))
    except OSError as e:
        return _usage_failure(f"cannot write {e.filename}: {e.strerror or e}")
    if not fc.aligned:
        print(f"gpumem: warning: {fc.alignment.message}; only peak live is estimated", file=sys.stderr)
    if args.json:
        print(json.dumps(fc.to_json()))
    else:
        print(fc.text())
    return EXIT_OK
