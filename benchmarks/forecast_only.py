"""The forecasts of benchmarks/gpu_forecast.py without the searches (`--forecast-only`): one process per
model, several at once, each with a time limit, the results written as each one ends (a crash or a
timeout loses that model's row, not the run), then a table: the zoo member, the knob, the values
recorded, whether the recordings lined up, the largest value each allocator's forecast answers, the
forecast's time, its caveats and any error.
"""

import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from common import markdown_head, markdown_row

ALLOCATORS = ("native", "gpumem")
HEAD = "member | model | knob | recorded | aligned | native | gpumem | forecast s | caveats | error"


def run_forecasts(models, run_one, jobs, timeout, results, save=None, log=print):
    """Run run_one(name, timeout) -> the forecast child's dict for every model, `jobs` at a time, into
    results["models"][name]["forecast"]; save(results) after each.  A child that times out or fails
    gives {"error": ...}."""
    lock = threading.Lock()

    def one(name):
        t0 = time.monotonic()
        try:
            f = run_one(name, timeout)
        except subprocess.TimeoutExpired:
            f = {"error": f"timed out after {timeout:.0f} s"}
        except Exception as e:  # noqa: BLE001 - one model's failure is its row's, not the run's
            f = {"error": str(e)[-2000:]}
        f.setdefault("wall_s", time.monotonic() - t0)
        with lock:
            results.setdefault("models", {})[name] = {"forecast": f}
            if save:
                save(results)
        if "error" in f:
            log(f"{name}: forecast failed: {f['error'].splitlines()[0] if f['error'] else '?'}")
        else:
            log(f"{name}: forecast {f.get('largest')} in {f.get('forecast_s', 0):.1f} s; {f.get('alignment')}")

    with ThreadPoolExecutor(max(1, jobs)) as ex:
        list(ex.map(one, models))
    return results


def row(name, spec, member, f):
    """One model's row (a dict) from its forecast child's dict."""
    largest = f.get("largest") or {}
    return {
        "member": member,
        "model": name,
        "knob": spec.knob,
        "recorded": f.get("recorded") or spec.recorded,
        "aligned": f.get("aligned"),
        "native": largest.get("native"),
        "gpumem": largest.get("gpumem"),
        "both": "error" not in f and all(largest.get(a) is not None for a in ALLOCATORS),
        "forecast_s": f.get("forecast_s"),
        "caveats": " ".join(f.get("caveats") or []),
        "error": f.get("error"),
    }


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def cells(r):
    fs = "-" if r["forecast_s"] is None else f"{r['forecast_s']:.1f}"
    aligned = {True: "yes", False: "no", None: "-"}[r["aligned"]]
    err = (r["error"] or "").strip().splitlines()
    answers = ["-" if r[a] is None else r[a] for a in ALLOCATORS]
    head = [r["member"], r["model"], r["knob"], ",".join(map(str, r["recorded"])), aligned]
    return [*head, *answers, fs, _cell(r["caveats"] or "-"), _cell(err[-1][:300] if err else "-")]


def summary(rows):
    """The line under the table: on how many zoo members the forecast answers for both allocators."""
    zoo = [r for r in rows if r["member"] != "-"]
    both = sum(1 for r in zoo if r["both"])
    pct = 100.0 * both / len(zoo) if zoo else 0.0
    failed = sum(1 for r in rows if r["error"])
    return (
        f"answers for both allocators on {both} of {len(zoo)} zoo members ({pct:.0f}%); "
        f"{len(rows)} models, {failed} failed"
    )


def print_table(rows, out=print):
    out(markdown_head(HEAD))
    for r in rows:
        out(markdown_row(cells(r)))
    out(summary(rows))


def saver(path):
    """save(results): the JSON written whole to `path` (through a temporary file) each time."""
    if not path:
        return None

    def save(results):
        tmp = f"{path}.part"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, path)

    return save
