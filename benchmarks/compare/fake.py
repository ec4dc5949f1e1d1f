"""A fake backend for --dry-run and the tests: the same servers, forks, searches, tables and plots,
with no torch and no GPU.  Each contender is a model with a made-up overhead over peak live; the
replay walks the real packed events, so trace handling is exercised too.  Nothing it prints is a
measurement, and results say "fake": true.

GPU_COMPARE_FAKE_FAIL makes chosen contenders fail, to exercise the failure paths:
"rmm:unavailable,gpumem:crash@replay,async:error@train" (what@task; no @: every task).
"""

from __future__ import annotations

import os
import time

GiB = 1 << 30
# Made-up capacity overheads (min capacity / peak live) and relative speeds.
OVERHEAD = {"native": 1.06, "expandable": 1.02, "async": 1.035, "rmm": 1.08, "gpumem": 1.004}
SPEED = {"native": 1.00, "expandable": 1.01, "async": 1.02, "rmm": 0.99, "gpumem": 1.005}
STEP_S = {"gpt2_varlen": 0.11, "resnet50_multires": 0.16, "llama_lora_ckpt": 0.42}


def _injected(contender: str, task: str):
    spec = os.environ.get("GPU_COMPARE_FAKE_FAIL", "")
    for item in filter(None, (s.strip() for s in spec.split(","))):
        who, _, what = item.partition(":")
        what, _, on = what.partition("@")
        if who == contender and (not on or on == task):
            return what or "error"
    return None


def _maybe_fail(ctx, task: str):
    what = _injected(ctx.contender, task)
    if what == "unavailable":
        return {"status": "unavailable", "reason": f"fake: {ctx.contender} made unavailable"}
    if what == "crash":
        os._exit(70)
    if what == "hang":
        time.sleep(3600)
    if what:
        return {"status": "error", "reason": f"fake: injected {what} in {task}"}
    return None


def info(ctx, task):
    return _maybe_fail(ctx, "info") or {
        "status": "ok",
        "fake": True,
        "torch": "fake",
        "torch_cuda": None,
        "device_name": "fake GPU",
        "total_memory": 80 * GiB,
        "driver": 0,
        "python": "fake",
        "device": {"free_at_start": 79 * GiB, "total": 80 * GiB, "allocator": {"fake": ctx.contender}},
    }


def replay(ctx, task):
    bad = _maybe_fail(ctx, "replay")
    if bad:
        return bad
    trace, events = ctx.trace(task["trace"])
    cap = task.get("cap")
    k = OVERHEAD[ctx.contender]
    live = peak = 0
    t0 = time.perf_counter()
    passes = []
    for _ in range(max(1, int(task.get("passes", 1)))):
        live = 0
        for i, (op, slot, size, si) in enumerate(events):
            live += -size if op else size
            peak = max(peak, live)
            if cap is not None and live * k > cap:
                passes.append(
                    {
                        "status": "oom",
                        "reason": "fake: CUDA out of memory.",
                        "event": i,
                        "live_at_failure": live,
                        "wall_s": time.perf_counter() - t0,
                    }
                )
                break
        else:
            wall = (time.perf_counter() - t0) / SPEED[ctx.contender]
            reserved = int(peak * (k + 0.01))
            passes.append(
                {
                    "status": "ok",
                    "wall_s": wall,
                    "events": len(events),
                    "peak_used_sampled": reserved,
                    "allocator_stats": {"reserved_peak": reserved},
                    "live_at_end": live,
                }
            )
            continue
        break
    eff = None if cap is None else cap + 1024 * 1024
    return {
        "status": passes[0]["status"],
        "reason": passes[0].get("reason"),
        "trace": trace.name,
        "cap": cap,
        "fake": True,
        "device": {"cap_effective": eff, "allocator": {"fake": ctx.contender}},
        "passes": passes,
    }


def train(ctx, task):
    bad = _maybe_fail(ctx, "train")
    if bad:
        return bad
    base = STEP_S[task["workload"]] / SPEED[ctx.contender]
    steps = [
        {"step": i + 1, "batch": 8, "size": 512, "seconds": base * (3.0 if i == 0 else 1.0 + 0.01 * (i % 3))}
        for i in range(int(task["steps"]))
    ]
    from compare.workloads import median_from

    return {
        "status": "ok",
        "fake": True,
        "workload": task["workload"],
        "build_s": 0.5,
        "steps": steps,
        "median_s": median_from(steps, int(task.get("median_from", 5))),
        "allocator_stats": {"reserved_peak": 3 * GiB},
        "device": {},
    }


def max_batch(ctx, task):
    bad = _maybe_fail(ctx, "max_batch")
    if bad:
        return bad
    from compare.search import MaxPassSearch

    cap = task["cap"]
    k = OVERHEAD[ctx.contender]
    weights = 2 * GiB
    results = []
    for spec in task["lengths"]:
        n = int(spec["length"])
        fits = lambda b: weights + b * n * 420_000 * k <= cap  # noqa: E731
        if "only" in spec:
            b = int(spec["only"])
            ok = fits(b)
            results.append(
                {
                    "length": n,
                    "max_pass": b if ok else None,
                    "min_fail": None if ok else b,
                    "converged": True,
                    "nonmonotone": False,
                    "probes": [[b, ok]],
                    "tries": [{"batch": b, "ok": ok, "reason": None if ok else "oom: fake"}],
                    "stopped": None,
                }
            )
            continue
        s = MaxPassSearch(int(spec.get("ceiling", 256)), seeds=spec.get("seeds", ()))
        tries = []
        while True:
            b = s.next()
            if b is None:
                break
            ok = fits(b)
            tries.append({"batch": b, "ok": ok, "reason": None if ok else "oom: fake", "seconds": 0.0})
            s.record(b, ok)
        r = s.result()
        r.update(length=n, tries=tries, stopped=None)
        results.append(r)
    return {"status": "ok", "fake": True, "results": results, "device": {"cap_effective": cap}}


def microbench(ctx, task):
    bad = _maybe_fail(ctx, "microbench")
    if bad:
        return bad
    rows = []
    for size in task["sizes"]:
        us = (6.0 + (size.bit_length() - 9) * 0.05) / SPEED[ctx.contender]
        rows.append({"size": size, "us": us, "us_min": us * 0.95, "us_all": [us]})
    return {"status": "ok", "fake": True, "rows": rows, "device": {}}


TASKS = {"info": info, "replay": replay, "train": train, "max_batch": max_batch, "microbench": microbench}
