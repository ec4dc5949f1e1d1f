#!/usr/bin/env python3
"""Two streams on a GPU: the smallest cap a prefetching loop runs in, over its peak live memory.

    python benchmarks/gpu_two_stream.py [--steps 30] [--resolution 2MiB] [--deadline 220]
                                        [--json benchmarks/results/gpu_two_stream.json]
    python benchmarks/gpu_two_stream.py --check      # a dry run on the CPU: no GPU

The loop (`workload`): a side stream prefetches the next batch -- a new tensor, an H2D copy from pinned
memory and a kernel that stamps the step into it, `record_stream` onto the main stream -- while the
main stream trains on the current one: a stack of matmuls whose activations are kept for a backward
pass that frees them one by one, then the batch is freed.  The batches' rows vary from step to step,
so the side stream's next batch wants memory the main stream freed a moment ago, while the main
stream's kernels on it still run.

For each allocator -- gpumem with the hand-off between streams (the default), gpumem with
`stream_handoff=0` (the device-wide wait instead), and torch's native caching allocator -- it runs the
loop once uncapped, then bisects the cap (`gpumem.install(cap=...)`; native:
`set_per_process_memory_fraction`), each probe in a fresh process, to the smallest cap at which the
steps run, and divides it by peak live (`torch.cuda.max_memory_allocated`, native's uncapped run). It
prints a table and writes the rows as JSON: per probe, whether it ran, peak live and reserved, device
synchronisations and hand-offs, and the time per step.
"""

import argparse
import contextlib
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from common import markdown_head, markdown_row, run_child, with_checkout_path, write_json  # noqa: E402

MiB = 1 << 20
# The loop's shape: width, layers, the batches' rows in turn (bf16 on the GPU).
GPU = {"width": 4096, "layers": 8, "rows": (8192, 5120, 6144, 3072, 7168, 4096)}
CHECK = {"width": 64, "layers": 3, "rows": (48, 32, 40, 16)}
CONFIGS = (("gpumem", 1), ("gpumem", 0), ("native", None))


def config_name(allocator: str, handoff) -> str:
    return allocator if handoff is None else f"{allocator} hand-off {'on' if handoff else 'off'}"


# ---- the loop -------------------------------------------------------------------------------


class Streams:
    """The main and the side stream on CUDA; on the CPU (the dry run) both are the host's order."""

    def __init__(self, torch, device: str):
        self.torch, self.cuda = torch, device == "cuda"
        self.main = torch.cuda.current_stream() if self.cuda else None
        self.side = torch.cuda.Stream() if self.cuda else None

    def on_side(self):
        return self.torch.cuda.stream(self.side) if self.cuda else contextlib.nullcontext()

    def side_event(self):
        return self.side.record_event() if self.cuda else None

    def main_waits(self, ev, batch) -> None:
        if self.cuda:
            self.main.wait_event(ev)
            batch.record_stream(self.main)


def host_batches(torch, cfg: dict, pin: bool) -> dict:
    """One pinned host tensor per row count: small whole numbers, so that sums are exact."""
    d = cfg["width"]
    out = {}
    for r in sorted(set(cfg["rows"])):
        t = (torch.arange(r * d, dtype=torch.float32) % 5).reshape(r, d).to(torch.bfloat16)
        out[r] = t.pin_memory() if pin else t
    return out


def expected_check(host: dict, rows: int, step: int, width: int) -> float:
    """The sum of step `step`'s batch as the side stream makes it: the host pattern plus the step."""
    return float(host[rows].double().sum()) + float(step % 7) * rows * width


def prefetch(torch, s: Streams, host: dict, rows: int, step: int, device: str):
    """The side stream's part: the next batch in a new tensor, copied in and stamped with the step."""
    with s.on_side():
        nxt = torch.empty((rows, host[rows].shape[1]), dtype=torch.bfloat16, device=device)
        nxt.copy_(host[rows], non_blocking=True)
        nxt.add_(step % 7)
        ev = s.side_event()
    return nxt, ev


def train_step(torch, weights, batch):
    """The main stream's part: forward through the layers keeping the activations, then a backward
    pass that frees them one by one.  Returns (the batch's sum, the output's) as 0-d tensors."""
    check = batch.sum(dtype=torch.float64)
    acts = [batch]
    for w in weights:
        acts.append(torch.tanh(acts[-1] @ w))
    g = acts[-1]
    for w in reversed(weights):
        a = acts.pop()
        g = (g * (1 - a * a)) @ w.t()
        del a
    return check, g.float().sum()


def workload(torch, device: str, steps: int, cfg: dict) -> dict:
    """Run the loop; returns the batches' sums the main stream read, the ones expected, and the losses."""
    d = cfg["width"]
    gen = torch.Generator().manual_seed(0)
    weights = [(torch.randn(d, d, generator=gen) / d**0.5).to(torch.bfloat16).to(device) for _ in cfg["layers"] * [0]]
    s = Streams(torch, device)
    host = host_batches(torch, cfg, pin=device == "cuda")
    rows = [cfg["rows"][k % len(cfg["rows"])] for k in range(steps + 1)]
    checks, losses = [], []
    ahead = [prefetch(torch, s, host, rows[0], 0, device)]  # (batch, its side-stream event)
    for k in range(steps):
        if k + 1 < steps:
            ahead.append(prefetch(torch, s, host, rows[k + 1], k + 1, device))
        cur, ev = ahead.pop(0)
        s.main_waits(ev, cur)
        check, loss = train_step(torch, weights, cur)
        checks.append(check)
        losses.append(loss)
        del cur  # freed on the main stream, its kernels still queued
    want = [expected_check(host, rows[k], k, d) for k in range(steps)]
    return {"checks": [float(c) for c in checks], "expected": want, "losses": [float(x) for x in losses]}


# ---- one probe, in a process of its own ----------------------------------------------------------


def probe(allocator: str, handoff, cap: int, steps: int) -> dict:
    """Run the loop under `allocator` capped at `cap` bytes (0: no cap) on this process's GPU."""
    if allocator == "gpumem":
        import gpumem

        opts = {"stream_handoff": handoff}
        if cap:
            opts["cap"] = cap
        gpumem.install(**opts)
    import torch

    if allocator == "native" and cap:
        torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    torch.backends.cuda.matmul.allow_tf32 = False
    ok, err, r = True, "", {}
    t0 = time.perf_counter()
    try:
        r = workload(torch, "cuda", steps, GPU)
        torch.cuda.synchronize()
    except RuntimeError as e:  # out of memory, or a library's allocation failing under the cap (its text kept)
        ok, err = False, (str(e).splitlines() or [type(e).__name__])[0][:200]
    seconds = time.perf_counter() - t0
    st = torch.cuda.memory_stats()
    correct = ok and r["checks"] == r["expected"]
    return {
        "allocator": allocator,
        "handoff": handoff,
        "cap": cap,
        "ok": ok,
        "correct": correct,
        "error": err,
        "peak_live": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "syncs": st.get("num_sync_all_streams"),
        "handoffs": st.get("num_stream_handoffs"),
        "alloc_retries": st.get("num_alloc_retries"),
        "ms_per_step": 1e3 * seconds / steps,
        "losses": r.get("losses", [])[:3],
    }


# ---- the search ---------------------------------------------------------------------------------


def bisect(run, lo: int, hi: int, res: int, deadline: float):
    """Smallest multiple of `res` in (lo, hi] at which run(cap) holds; `run(hi)` must hold.  Stops at
    the deadline (time.monotonic()) with the bracket it has.  Returns (cap, the probes, whether the
    bracket closed)."""
    lo, hi = lo // res, -(-hi // res)
    probes = []
    while hi - lo > 1 and time.monotonic() < deadline:
        mid = (lo + hi) // 2
        r = run(mid * res)
        probes.append(r)
        if r["ok"]:
            hi = mid
        else:
            lo = mid
    return hi * res, probes, hi - lo == 1


def search(allocator: str, handoff, steps: int, res: int, deadline: float, runner) -> dict:
    """The uncapped run, then the smallest cap found by bisection between peak live and enough."""
    free = runner(allocator, handoff, 0, steps)
    if free is None or not free["ok"]:
        return {"name": config_name(allocator, handoff), "uncapped": free, "min_cap": None, "probes": []}
    lo = free["peak_live"] - 1  # below peak live nothing runs
    hi = min(free["peak_reserved"] + 2 * res, int(1.1 * free["peak_live"]))
    top = runner(allocator, handoff, hi, steps)
    probes = [top] if top else []
    while top is not None and not top["ok"] and hi < 4 * free["peak_reserved"]:
        lo, hi = hi, int(hi * 1.25)
        top = runner(allocator, handoff, hi, steps)
        probes.append(top)
    if top is None or not top["ok"]:
        return {"name": config_name(allocator, handoff), "uncapped": free, "min_cap": None, "probes": probes}

    def run(cap):
        r = runner(allocator, handoff, cap, steps)
        return r if r is not None else {"ok": False, "cap": cap, "error": "the probe failed"}

    cap, more, exact = bisect(run, lo, hi, res, deadline)
    at = [p for p in probes + more if p.get("cap") == cap and p["ok"]]
    return {
        "name": config_name(allocator, handoff),
        "uncapped": free,
        "min_cap": cap,
        "exact": exact,
        "at_min_cap": at[-1] if at else top,
        "probes": probes + more,
    }


def child_runner(allocator: str, handoff, cap: int, steps: int):
    args = ["--one", json.dumps({"allocator": allocator, "handoff": handoff, "cap": cap, "steps": steps})]
    # The child imports the gpumem of this checkout (built in place), as the other GPU benchmarks' do.
    return run_child(
        __file__, args, what=f"{config_name(allocator, handoff)} cap {cap}", timeout=300, env=with_checkout_path()
    )


def table(rows: list, live: int) -> str:
    lines = [markdown_head("allocator | smallest cap MiB | ÷ peak live | syncs | hand-offs | ms/step | data")]
    for r in rows:
        at = r.get("at_min_cap") or {}
        cap = r["min_cap"]
        lines.append(
            markdown_row(
                [
                    r["name"],
                    f"{cap / MiB:.0f}" if cap else "-",
                    f"{cap / live:.4f}" if cap else "-",
                    at.get("syncs", "-"),
                    at.get("handoffs", "-"),
                    f"{at['ms_per_step']:.1f}" if "ms_per_step" in at else "-",
                    "ok" if at.get("correct") else "WRONG" if at else "-",
                ]
            )
        )
    return "\n".join(lines)


def fake_runner(peak_live: int):
    """The dry run's stand-in for a GPU probe: fits from 1.007 x peak live (hand-off on), 1.012 (off),
    1.12 (native: past the first guess, 1.1)."""
    need = {("gpumem", 1): 1.007, ("gpumem", 0): 1.012, ("native", None): 1.12}

    def run(allocator, handoff, cap, steps):
        ok = not cap or cap >= need[(allocator, handoff)] * peak_live
        reserved = int(peak_live * 1.02) if not cap else min(cap, int(peak_live * 1.02))
        return {
            "allocator": allocator,
            "handoff": handoff,
            "cap": cap,
            "ok": ok,
            "correct": ok,
            "error": "",
            "peak_live": peak_live,
            "peak_reserved": reserved,
            "syncs": 0,
            "handoffs": 0,
            "ms_per_step": 1.0,
        }

    return run


def dry_run() -> int:
    """The loop on the CPU (its sums checked), then the search against the fake probe."""
    import torch

    r = workload(torch, "cpu", 6, CHECK)
    if r["checks"] != r["expected"]:
        print("the loop's batches are wrong:", r["checks"], r["expected"], file=sys.stderr)
        return 1
    print("loop on the CPU: 6 steps, batch sums as expected; losses", [round(x, 3) for x in r["losses"]])
    live = 1000 * MiB
    rows = [search(a, h, 3, 2 * MiB, time.monotonic() + 60, fake_runner(live)) for a, h in CONFIGS]
    print(table(rows, live))
    return 0 if all(x["min_cap"] for x in rows) else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--resolution", type=int, default=2 * MiB, help="the search's step in bytes (2 MiB)")
    ap.add_argument("--deadline", type=float, default=220.0, help="seconds for the whole search")
    ap.add_argument("--json", default=None, metavar="PATH")
    ap.add_argument("--check", action="store_true", help="a dry run on the CPU")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        o = json.loads(args.one)
        print(json.dumps(probe(o["allocator"], o["handoff"], o["cap"], o["steps"])))
        return 0
    if args.check:
        return dry_run()
    t0 = time.monotonic()
    end = t0 + args.deadline
    rows = []
    for i, (a, h) in enumerate(CONFIGS):
        share = t0 + (i + 1) * (end - t0) / len(CONFIGS)  # each configuration gets its share of the time
        rows.append(search(a, h, args.steps, args.resolution, max(share, time.monotonic() + 1), child_runner))
        print(rows[-1]["name"], "done", f"{time.monotonic() - t0:.0f}s", flush=True)
    native = next((r for r in rows if r["name"] == "native"), None)
    live = (native or rows[0])["uncapped"]["peak_live"] if (native or rows[0])["uncapped"] else 1
    print(table(rows, live))
    write_json(args.json, {"steps": args.steps, "shape": GPU, "peak_live": live, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
