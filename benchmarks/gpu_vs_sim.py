#!/usr/bin/env python3
"""gpumem's smallest capacity on the GPU against the simulated device's, multi-stream traces included.

    python benchmarks/gpu_vs_sim.py [--out DIR] [--workloads prefetch_loader,...] [--only-traces NAME,...]
                                    [--event-delays 0,10,100] [--resolution 2MiB] [--deadline 450]
    python benchmarks/gpu_vs_sim.py --dry-run --out DIR --only-traces seed_fragmentation   # no GPU

In one process tree:
1. captures the multi-stream workloads (benchmarks/capture_trace.py, one subprocess each, PyTorch's
   own allocator, one after the other) into OUT/traces;
2. replays those traces and the shipped ones (gpumem/data/traces; a capture replaces the shipped trace
   of its name) on the simulated device,
   `python -m gpumem replay --min-capacity --event-delay N` for each delay, on the CPU beside the
   GPU work;
3. searches gpumem's smallest capacity on the GPU with benchmarks/compare (figure 1 of
   gpu_compare.py, gpumem only: one fresh process per probe, the cap taken by one raw cudaMalloc
   of the rest, seeded from the simulated figure at delay 0);
4. prints a markdown table and writes OUT/gpu_vs_sim.json and OUT/gpu_vs_sim.md (the compare
   run's own JSON, markdown and logs go to OUT/compare).

--dry-run runs the same plumbing without a GPU: the captures run the workloads' small CPU
versions (synthetic traces), the GPU replays use compare/fake.py; the simulated replays are real.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import importlib.util
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from common import markdown_head, markdown_row, with_checkout_path  # noqa: E402
from compare import multistream  # noqa: E402
from compare.report import write_json  # noqa: E402
from compare.traces import find_traces, trace_name  # noqa: E402

MiB = 1 << 20
SHIPPED_DIR = os.path.join(ROOT, "gpumem", "data", "traces")
GOAL_GPU_OVER_SIM = 1.005
GOAL_MULTISTREAM_RATIO = 1.01


def _list(text: str) -> List[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _delays(text: str) -> List[int]:
    try:
        xs = sorted({int(x) for x in _list(text)})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of whole numbers: {text!r}") from None
    if not xs or xs[0] < 0:
        raise argparse.ArgumentTypeError(f"event delays are whole numbers >= 0: {text!r}")
    return xs if xs[0] == 0 else [0] + xs  # delay 0 seeds the GPU search


def build_parser() -> argparse.ArgumentParser:
    from gpu_compare import _size

    p = argparse.ArgumentParser(
        prog="gpu_vs_sim.py", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default=os.path.join(HERE, "results", "gpu_vs_sim"), help="output directory")
    p.add_argument(
        "--workloads",
        type=_list,
        default=list(multistream.MULTISTREAM),
        metavar="NAME,...",
        help=f"multi-stream workloads to capture (default {','.join(multistream.MULTISTREAM)}; 'none' for none)",
    )
    p.add_argument(
        "--captured",
        default=None,
        metavar="DIR",
        help="take the multi-stream traces from DIR (an earlier run's OUT/traces) instead of capturing",
    )
    p.add_argument("--traces", default=SHIPPED_DIR, help="directory of the shipped traces (default gpumem/data/traces)")
    p.add_argument(
        "--only-traces",
        type=_list,
        default=None,
        metavar="NAME,...",
        help="of the shipped traces, replay only these ('none' for none; default all)",
    )
    p.add_argument(
        "--event-delays",
        type=_delays,
        default=[0, 10, 100],
        metavar="N,...",
        help="simulated event delays, in device operations (default 0,10,100; 0 is always included)",
    )
    p.add_argument("--resolution", type=_size, default=2 * MiB, help="GPU search resolution (default 2MiB)")
    p.add_argument("--deadline", type=float, default=450.0, metavar="S", help="seconds for the whole run (default 450)")
    p.add_argument("--capture-timeout", type=float, default=150.0, metavar="S", help="per capture (default 150)")
    p.add_argument("--sim-jobs", type=int, default=0, metavar="N", help="parallel simulated replays (default: cores/2)")
    p.add_argument(
        "--gpumem-options", default="{}", metavar="JSON", help="keyword options for gpumem.install(), a JSON object"
    )
    p.add_argument("--dry-run", action="store_true", help="no GPU: CPU captures, fake GPU replays (tests the plumbing)")
    return p


# ---- captures ---------------------------------------------------------------------------------------


def capture(workload: str, outdir: str, dry_run: bool, timeout: float, log_dir: str) -> dict:
    """Run capture_trace.py for `workload` in a subprocess; its JSON lines merged, and the trace's path."""
    cmd = [sys.executable, os.path.join(HERE, "capture_trace.py")] + (["--dry-run"] if dry_run else [])
    cmd += [workload, outdir]
    env = dict(os.environ)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # recorded with the native allocator's defaults
    env.pop("PYTORCH_ALLOC_CONF", None)
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env.setdefault("HF_HUB_OFFLINE", "1")
    t0 = time.monotonic()
    out = {"workload": workload, "command": " ".join(shlex.quote(c) for c in cmd)}
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=HERE)
    except subprocess.TimeoutExpired as e:
        out.update(status="timeout", reason=f"capture still running after {timeout:.0f} s", wall_s=timeout)
        _write_log(log_dir, f"capture-{workload}.log", (e.stdout or b""), (e.stderr or b""))
        return out
    out["wall_s"] = round(time.monotonic() - t0, 1)
    _write_log(log_dir, f"capture-{workload}.log", p.stdout, p.stderr)
    native = {}
    for line in p.stdout.splitlines():
        try:
            j = json.loads(line)
        except ValueError:
            continue
        if isinstance(j, dict):
            native.update(j)
    path = os.path.join(outdir, f"{workload}.trace.gz")
    if p.returncode != 0 or not os.path.exists(path):
        tail = (p.stderr or p.stdout or "").strip().splitlines()[-3:]
        out.update(status="failed", reason=f"exit status {p.returncode}: {' | '.join(tail)[-400:]}")
        return out
    out.update(status="ok", path=path, native=native)
    return out


def _write_log(log_dir: str, name: str, stdout, stderr) -> None:
    def text(x):
        return x.decode("utf-8", "replace") if isinstance(x, bytes) else (x or "")

    with open(os.path.join(log_dir, name), "w") as f:
        f.write("== stdout\n" + text(stdout) + "\n== stderr\n" + text(stderr)[-20000:] + "\n")


# ---- simulated replays --------------------------------------------------------------------------------


class Sims:
    """`python -m gpumem replay --min-capacity` per (trace, delay), a few at a time, in threads
    (each waits on its subprocess), so that they run while the main thread drives the GPU."""

    def __init__(self, delays: List[int], jobs: int, work: str, env: Dict[str, str], timeout: float = 300.0):
        self.delays = delays
        self.work = work
        self.env = env
        self.timeout = timeout
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
        self.futures: Dict[tuple, concurrent.futures.Future] = {}
        self.lock = threading.Lock()
        self.procs: set = set()
        self.closed = False

    def add(self, name: str, path: str) -> None:
        for d in self.delays:
            self.futures[(name, d)] = self.pool.submit(self._one, os.path.abspath(path), d)

    def _one(self, path: str, delay: int) -> dict:
        cmd = [sys.executable, "-m", "gpumem", "replay", "--min-capacity", "--json", "--no-timing", "--no-progress"]
        cmd += ["--event-delay", str(delay), path]
        t0 = time.monotonic()
        with self.lock:
            if self.closed:
                return {"status": "not run", "reason": "the run ended first"}
            # cwd elsewhere: -m puts the cwd first on sys.path (see compare/runner.py)
            p = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=self.work, env=self.env
            )
            self.procs.add(p)
        try:
            stdout, stderr = p.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            return {"status": "timeout", "reason": f"still running after {self.timeout:.0f} s"}
        finally:
            with self.lock:
                self.procs.discard(p)
        wall = round(time.monotonic() - t0, 2)
        if p.returncode < 0:
            return {"status": "killed", "reason": f"signal {-p.returncode}", "wall_s": wall}
        for line in stdout.splitlines():
            try:
                j = json.loads(line)
            except ValueError:
                continue
            if j.get("min_capacity_bytes"):
                return {
                    "status": "ok",
                    "min_capacity": j["min_capacity_bytes"],
                    "peak_live": j["peak_live_bytes"],
                    "peak_reserved_uncapped": j.get("peak_reserved_bytes"),
                    "wall_s": wall,
                }
        return {"status": "failed", "reason": (stderr or stdout).strip()[-400:], "wall_s": wall}

    def result(self, name: str, delay: int, wait: float) -> dict:
        f = self.futures.get((name, delay))
        if f is None:
            return {"status": "not run"}
        try:
            return f.result(timeout=max(0.01, wait))
        except concurrent.futures.TimeoutError:
            return {"status": "timeout", "reason": "not finished when the run ended"}

    def close(self) -> None:
        """Cancel what has not started and kill what still runs (the run is over)."""
        with self.lock:
            self.closed = True
            for p in self.procs:
                p.kill()
        self.pool.shutdown(wait=True, cancel_futures=True)


# ---- the GPU search: compare/runner.py's figure 1, gpumem only, seeded by these sims -------------


def gpu_search(args, traces_dir: str, sims: Sims, names: List[str], deadline_s: float):
    """Figure 1 of gpu_compare.py for gpumem on the traces in `traces_dir`; returns the run's doc."""
    import gpu_compare
    from compare import runner

    class SimSeededRun(runner.Run):
        # the simulated figures come from `sims` (delay 0), not from the runner's own sim process
        def start_sim(self) -> None:
            pass

        def sim_results(self, wait: float) -> Dict[str, dict]:
            if getattr(self, "_sim", None) is not None:
                return self._sim
            end = time.monotonic() + wait
            res = {}
            for n in self.packed:
                r = sims.result(n, 0, end - time.monotonic())
                if r.get("status") == "ok":
                    res[n] = {"min_capacity": r["min_capacity"], "peak_live": r["peak_live"]}
            self._sim = res
            self.doc["gpumem_sim"] = {"status": "ok" if res else "failed", "reason": None, "traces": res}
            return res

    argv = ["--traces", traces_dir, "--figures", "1", "--contenders", "gpumem"]
    argv += ["--resolution", str(args.resolution), "--deadline", f"{max(30.0, deadline_s):.0f}"]
    argv += ["--out", os.path.join(args.out, "compare"), "--gpumem-options", args.gpumem_options]
    argv += ["--only-traces", ",".join(names)]
    if args.dry_run:
        argv.append("--dry-run")
    cargs = gpu_compare.build_parser().parse_args(argv)
    gpu_compare.finish_args(cargs)
    signal.signal(signal.SIGTERM, runner.on_sigterm)
    run = SimSeededRun(cargs, "python benchmarks/gpu_compare.py " + " ".join(shlex.quote(a) for a in argv))
    run.run()
    return run.doc


# ---- the table --------------------------------------------------------------------------------------------


def _r(x: Optional[float], nd: int = 4) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(doc: dict) -> str:
    delays = doc["options"]["event_delays"]
    head = ["trace", "streams", "peak live (GiB)", "GPU min cap / peak live"]
    head += [f"sim d={d} / peak live" for d in delays] + [f"GPU / sim d={d}" for d in delays]
    lines = [markdown_head(" | ".join(head))]
    for name, t in doc["traces"].items():
        g = t["gpu"]
        gpu_cell = _r(g.get("ratio"))
        if g.get("status") == "partial":
            gpu_cell = "≤" + gpu_cell
        elif g.get("status") not in ("ok", "partial"):
            gpu_cell = f"{g.get('status')}"
        if t.get("multi_stream") and g.get("ratio") and g["ratio"] > GOAL_MULTISTREAM_RATIO:
            gpu_cell += " ✗"
        row = [name + (" (multi-stream)" if t.get("multi_stream") else ""), str(t.get("streams", "-"))]
        row += [_r(t["peak_live"] / (1 << 30), 3) if t.get("peak_live") else "-", gpu_cell]
        for d in delays:
            s = t["sim"].get(str(d), {})
            row.append(_r(s.get("ratio")) if s.get("status") == "ok" else s.get("status", "-"))
        for d in delays:
            x = t["gpu_over_sim"].get(str(d))
            row.append("-" if x is None else _r(x) + (" ✗" if x > GOAL_GPU_OVER_SIM else ""))
        lines.append(markdown_row(row))
    notes = [
        "",
        f"GPU: smallest cap in which a fresh process replays the trace under gpumem with torch.empty/del "
        f"(allocations on the trace's streams), binary search to {doc['options']['resolution'] // MiB} MiB "
        f"(≤: bracket not closed in the time budget); sim: `python -m gpumem replay --min-capacity --event-delay d` "
        f"(1 MiB search). ✗: GPU / sim above {GOAL_GPU_OVER_SIM}, or a multi-stream trace above "
        f"{GOAL_MULTISTREAM_RATIO} × peak live on the GPU.",
    ]
    if doc.get("fake"):
        notes.append("DRY RUN: synthetic traces and a fake GPU; nothing here is a measurement.")
    caps = doc.get("captures") or {}
    for w, c in caps.items():
        if c.get("status") != "ok":
            notes.append(f"capture {w}: {c.get('status')}: {c.get('reason')}")
    return "\n".join(lines + notes) + "\n"


def assemble(doc: dict, cdoc: Optional[dict], sims: Sims, names: List[str], multi: set, wait_until: float) -> None:
    rows = {}
    f1 = ((cdoc or {}).get("figures") or {}).get("1") or {}
    for r in f1.get("rows", []):
        if r.get("contender") == "gpumem":
            rows[r["trace"]] = r
    ctraces = (cdoc or {}).get("traces") or {}
    for n in names:
        g = rows.get(n, {"status": "not run", "reason": (f1.get("reason") or "no GPU result")})
        streams = (ctraces.get(n) or {}).get("streams")
        t = {
            # captured in this run as a multi-stream workload, or a trace whose allocations use several streams
            "multi_stream": n in multi or (streams or 1) > 1,
            "streams": streams,
            "peak_live": (ctraces.get(n) or {}).get("peak_live") or g.get("peak_live"),
            "gpu": {
                k: g.get(k) for k in ("status", "reason", "min_cap", "ratio", "ratio_max_fail", "search", "probes")
            },
            "sim": {},
            "gpu_over_sim": {},
        }
        for d in doc["options"]["event_delays"]:
            s = sims.result(n, d, wait_until - time.monotonic())
            if s.get("status") == "ok":
                t["peak_live"] = t["peak_live"] or s["peak_live"]
                s["ratio"] = s["min_capacity"] / s["peak_live"]
                if g.get("min_cap"):
                    t["gpu_over_sim"][str(d)] = g["min_cap"] / s["min_capacity"]
            t["sim"][str(d)] = s
        doc["traces"][n] = t


def _captures(args, doc, workloads, end, logs, log):
    """doc["captures"]: each workload's trace, from --captured or captured now (into OUT/traces)."""
    cap_dir = os.path.join(args.out, "traces")
    if args.captured:
        for w in workloads:
            p = os.path.join(args.captured, w + ".trace.gz")
            doc["captures"][w] = (
                {"status": "ok", "path": p, "from": args.captured}
                if os.path.exists(p)
                else {"status": "failed", "reason": f"{p} does not exist"}
            )
        return
    os.makedirs(cap_dir, exist_ok=True)
    # one after the other on a GPU (each must have the device to itself); in parallel without one
    par = 3 if args.dry_run else 1
    reserve = min(180.0, args.deadline / 3)  # kept for the GPU search whatever the captures take

    def one(w):
        left = end - time.monotonic() - reserve
        return capture(w, cap_dir, args.dry_run, min(args.capture_timeout, max(30.0, left)), logs)

    with concurrent.futures.ThreadPoolExecutor(max_workers=par) as ex:
        futs = {w: ex.submit(one, w) for w in workloads}
        for w, f in futs.items():
            doc["captures"][w] = f.result()
            c = doc["captures"][w]
            log(
                f"capture {w}: {c['status']} in {c.get('wall_s')} s"
                + (f" ({c.get('reason')})" if c.get("reason") else "")
            )


def _new_doc(args, argv, workloads, shipped):
    return {
        "schema": "gpumem.gpu_vs_sim/1",
        "fake": bool(args.dry_run),
        "command": "python benchmarks/gpu_vs_sim.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
        "options": {
            "event_delays": args.event_delays,
            "resolution": args.resolution,
            "deadline_s": args.deadline,
            "workloads": workloads,
            "shipped": shipped,
        },
        "goals": {"gpu_over_sim_max": GOAL_GPU_OVER_SIM, "multi_stream_gpu_ratio_max": GOAL_MULTISTREAM_RATIO},
        "captures": {},
        "traces": {},
    }


def _finish(args, doc, cdoc, sims, names, multi, end, t0, work, log):
    """Whatever happened: the results assembled and written (JSON and markdown), the sims stopped."""
    assemble(doc, cdoc, sims, names, multi, min(end, time.monotonic() + 60))
    sims.close()
    doc["device"] = (cdoc or {}).get("device")
    doc["elapsed_s"] = round(time.monotonic() - t0, 1)
    write_json(doc, os.path.join(args.out, "gpu_vs_sim.json"))
    md = markdown(doc)
    with open(os.path.join(args.out, "gpu_vs_sim.md"), "w") as f:
        f.write(md)
    print(md, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    log(f"done in {doc['elapsed_s']} s: {args.out}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    end = t0 + args.deadline
    args.out = os.path.abspath(args.out)
    os.makedirs(args.out, exist_ok=True)
    logs = os.path.join(args.out, "logs")
    os.makedirs(logs, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_vs_sim_")

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    workloads = [] if args.workloads == ["none"] else args.workloads
    bad = [w for w in workloads if w not in multistream.MULTISTREAM]
    if bad:
        raise SystemExit(
            f"gpu_vs_sim.py: unknown workload {', '.join(bad)} (from {', '.join(multistream.MULTISTREAM)})"
        )
    shipped_paths = [] if args.only_traces == ["none"] else find_traces(args.traces, args.only_traces)
    # a workload captured (or taken from --captured) in this run stands for the shipped trace of its name
    shipped_paths = [p for p in shipped_paths if trace_name(p) not in workloads]
    shipped = [trace_name(p) for p in shipped_paths]

    # gpumem for the sims and the GPU worker: this checkout's when it is built in place (whatever else
    # is installed), else the installed one
    env = dict(os.environ)
    if glob.glob(os.path.join(ROOT, "gpumem", "_C*")) or importlib.util.find_spec("gpumem") is None:
        env = with_checkout_path(env)
        os.environ["PYTHONPATH"] = env["PYTHONPATH"]  # the compare run's worker servers inherit it
    jobs = args.sim_jobs or max(1, min(8, (os.cpu_count() or 2) // 2))
    sims = Sims(args.event_delays, jobs, work, env)

    doc = _new_doc(args, argv, workloads, shipped)
    # the replay set: links to the shipped traces and the captured ones, in one directory
    tdir = os.path.join(work, "traces")
    os.makedirs(tdir)
    for n, src in zip(shipped, shipped_paths):
        os.symlink(os.path.abspath(src), os.path.join(tdir, os.path.basename(src)))
        sims.add(n, src)
    log(f"simulated replays of {len(shipped)} shipped traces started ({jobs} at a time)")

    multi = set()
    _captures(args, doc, workloads, end, logs, log)
    for w in workloads:
        c = doc["captures"][w]
        if c["status"] == "ok":
            os.symlink(os.path.abspath(c["path"]), os.path.join(tdir, w + ".trace.gz"))
            sims.add(w, c["path"])
            multi.add(w)
    names = [trace_name(p) for p in find_traces(tdir)]
    cdoc = None
    try:
        if names:
            left = end - time.monotonic() - 20
            log(f"GPU search on {len(names)} traces, {left:.0f} s left")
            cdoc = gpu_search(args, tdir, sims, names, left)
    finally:
        _finish(args, doc, cdoc, sims, names, multi, end, t0, work, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
