"""The orchestrator: starts one worker server per contender, schedules every attempt (one at a
time: they share the GPU, and a cap only means something when nothing else holds memory), keeps
each figure within its share of the time, and writes results as it goes.

Time plan (docs/benchmarks.md): the whole run has a deadline (default 540 s).  Each figure gets a
share of what is left when it starts, in proportion to its nominal budget, so an overrun early
shrinks the later figures instead of losing them.  Figure 1, the costly one, probes its searches
round-robin, one probe per search per round, so when its time runs out every (trace, contender)
has a bracket of about the same width rather than some finished and others untouched; results
say which searches converged to the resolution and which stopped at a wider bracket.
"""

from __future__ import annotations

import datetime
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

from . import report
from . import traces as tr
from .contenders import LABELS, server_env
from .search import MinPassSearch, MaxPassSearch, align_up, seeds_around  # noqa: F401

MiB = 1 << 20
GiB = 1 << 30
ALIGN = 2 * MiB

# Nominal seconds per stage ("23": the uncapped replays behind figures 2 and 3).
SHARES = {"6": 15, "23": 70, "1": 240, "5": 85, "4": 90}
STAGE_ORDER = ["6", "23", "1", "5", "4"]

# Search seeds for figure 1, not results: min capacity ÷ peak live that gpumem/data/traces/README.md
# reports for the native variants on an H100 with torch 2.11 (to 32 MiB).  RMM's pool has no
# published figure; native's is its seed.  gpumem's seed is its simulated figure.
README_PRIORS = {
    "seed_fragmentation": {"native": 1.097, "expandable": 1.116, "async": 1.217},
    "gpt2_varlen": {"native": 1.033, "expandable": 1.004, "async": 1.008},
    "bert_varlen": {"native": 1.044, "expandable": 1.010, "async": 1.039},
    "resnet50_multires": {"native": 1.039, "expandable": 1.010, "async": 1.020},
    "gpt2_generate": {"native": 1.049, "expandable": 1.020, "async": 1.034},
    "llama_lora_ckpt": {"native": 1.111, "expandable": 1.020, "async": 1.039},
}

FIG6_SIZES = [512, 4 << 10, 64 << 10, 1 << 20, 2 << 20, 16 << 20, 128 << 20, 1 << 30]


TERMINATING = False


def on_sigterm(*_) -> None:
    """`timeout` and batch schedulers stop a run with SIGTERM: leave through the finally clauses,
    which stop the worker servers (at once) and write what was measured."""
    global TERMINATING
    TERMINATING = True
    sys.exit(143)


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _skipped(key: str, value, contender: str) -> dict:
    """The row of a figure for a point the time budget left no room for."""
    return {key: value, "contender": contender, "status": "skipped", "reason": "time budget"}


class Server:
    """A worker server (worker.py) for one contender; talks JSON lines over pipes."""

    def __init__(self, contender: str, cache: str, logs: str, fake: bool, spawn: bool):
        self.contender = contender
        worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
        self.cmd = [sys.executable, worker, "--contender", contender, "--cache", cache, "--logs", logs]
        if fake:
            self.cmd.append("--fake")
        if spawn:
            self.cmd.append("--spawn")
        self.logs = logs
        self.ready: Optional[dict] = None
        self.dead: Optional[str] = None
        self._buf = b""
        self._start()

    def _start(self) -> None:
        self.err = open(os.path.join(self.logs, f"server-{self.contender}.log"), "ab")
        # Its own process group (same session), so that a wedged server goes down with the
        # attempt it forked: an orphan holding GPU memory would spoil every later cap.
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.err,
            env=server_env(self.contender),
            cwd=tempfile.gettempdir(),
            preexec_fn=os.setpgrp,
        )
        self._buf = b""

    def _readline(self, timeout: float) -> Optional[dict]:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 1.0))
            if ready:
                data = os.read(fd, 1 << 20)
                if not data:
                    self.dead = f"worker server exited (status {self.proc.poll()})"
                    return None
                self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return {"status": "error", "reason": f"unreadable reply from worker: {line[:200]!r}"}

    def wait_ready(self, timeout: float) -> dict:
        if self.ready is None and not self.dead:
            self.ready = self._readline(timeout)
            if self.ready is None:
                self.dead = self.dead or f"worker server not ready within {timeout:.0f} s"
        return self.ready or {"status": "error", "reason": self.dead}

    def send(self, task: dict) -> bool:
        if self.dead:
            return False
        try:
            self.proc.stdin.write((json.dumps(task) + "\n").encode())
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError) as e:
            self.dead = f"worker server gone: {e}"
            return False

    def receive(self, timeout: float) -> dict:
        if self.dead:
            return {"status": "crashed", "reason": self.dead}
        r = self._readline(timeout)
        if r is None:
            reason = self.dead or f"worker server did not answer within {timeout:.0f} s"
            self.restart(reason)
            return {"status": "timeout" if not self.dead else "crashed", "reason": reason}
        return r

    def call(self, task: dict, timeout: Optional[float] = None) -> dict:
        t = float(task.get("timeout_s", 120)) if timeout is None else timeout
        task.setdefault("timeout_s", t)
        if not self.send(task):
            return {"status": "crashed", "reason": self.dead}
        return self.receive(t + 30)

    def restart(self, reason: str) -> None:
        """A server that stops answering is replaced (its children are its own business: the
        kill takes them along with the process group)."""
        self.close(kill=True)
        self.dead = None
        self.ready = None
        self._start()
        if self.wait_ready(120).get("status") != "ready":
            self.dead = f"restart after '{reason}' failed: {self.dead}"

    def close(self, kill: bool = False) -> None:
        try:
            if not kill and self.proc.poll() is None:
                self.send({"task": "quit"})
                self.proc.wait(timeout=10)
        except Exception:
            pass
        if self.proc.poll() is None or kill:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=10)
            except Exception:
                pass
        try:
            self.err.close()
        except Exception:
            pass


class Run:
    def __init__(self, args, command: str):
        self.args = args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.deadline
        self.out = os.path.abspath(args.out)
        os.makedirs(self.out, exist_ok=True)
        self.work = tempfile.mkdtemp(prefix="gpu_compare_")
        self.cache = os.path.join(self.work, "traces")
        self.logs = os.path.join(self.work, "logs")
        os.makedirs(self.logs, exist_ok=True)
        self.log_path = os.path.join(self.logs, "orchestrator.log")
        self.servers: Dict[str, Server] = {}
        self.available: List[str] = []
        self.packed: Dict[str, tr.PackedTrace] = {}
        self.sim_proc = None
        self.doc = {
            "schema": report.SCHEMA,
            "fake": bool(args.dry_run),
            "command": command,
            "started": _now_iso(),
            "options": {
                "contenders": args.contenders,
                "figures": args.figures,
                "quick": args.quick,
                "resolution": args.resolution,
                "deadline_s": args.deadline,
                "fig5_cap": args.fig5_cap,
                "fig5_lengths": args.fig5_lengths,
                "fig4_steps": args.fig4_steps,
                "rmm_pool_fig1": "all",
                "gpumem_options": args.gpumem_options,
                "mode": "spawn" if args.spawn else "fork",
            },
            "labels": dict(LABELS),
            "contenders": {},
            "traces": {},
            "device": None,
            "figures": {},
        }

    # -- bookkeeping --------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, msg: str) -> None:
        line = f"[{self.elapsed():6.1f}s] {msg}"
        print(line, file=sys.stderr, flush=True)
        with open(self.log_path, "a") as f:
            f.write(line + "\n")

    def stage_deadline(self, stage: str, stages_left: List[str]) -> float:
        total = sum(SHARES[s] for s in stages_left) or 1
        return time.monotonic() + max(0.0, self.left()) * SHARES[stage] / total

    def checkpoint(self) -> None:
        self.doc["elapsed_s"] = round(self.elapsed(), 1)
        path = os.path.join(self.out, "gpu_compare.json")
        report.write_json(self.doc, path)
        try:
            with open(os.path.join(self.out, "gpu_compare.md"), "w") as f:
                f.write(report.markdown(self.doc))
        except Exception as e:  # a table bug must not lose the JSON
            self.log(f"markdown failed: {type(e).__name__}: {e}")
        self._copy_out(["gpu_compare.json", "gpu_compare.md"])

    def _copy_out(self, names: List[str]) -> None:
        dest = self.args.copy_to
        if not dest:
            return
        os.makedirs(dest, exist_ok=True)
        for n in names:
            src = os.path.join(self.out, n)
            if os.path.exists(src) and os.path.abspath(dest) != self.out:
                shutil.copyfile(src, os.path.join(dest, n))

    # -- setup ----------------------------------------------------------------------------------------
    def prepare_traces(self) -> None:
        paths = tr.find_traces(self.args.traces, self.args.only_traces)
        if not paths:
            raise FileNotFoundError(f"no *.trace.gz in {self.args.traces}")
        for p in paths:
            t0 = time.perf_counter()
            t = tr.load_text_trace(p)
            tr.save_packed(t, self.cache)
            self.packed[t.name] = t
            self.doc["traces"][t.name] = t.summary()
            self.log(
                f"trace {t.name}: {t.n_events} events, peak live {report.fmt_bytes(t.peak_live)} "
                f"({time.perf_counter() - t0:.1f} s to parse)"
            )

    def start_sim(self) -> None:
        """gpumem's simulated min capacity, on the CPU, beside the GPU work (figure 1 compares)."""
        if "gpumem" not in self.args.contenders or "1" not in self.args.figures:
            return
        paths = [self.packed[n].path for n in self.packed]
        cmd = [sys.executable, "-m", "gpumem", "replay", "--min-capacity", "--json", "--no-timing", "--no-progress"]
        self.sim_out = open(os.path.join(self.logs, "sim.jsonl"), "wb+")
        self.sim_err = open(os.path.join(self.logs, "sim.err"), "wb+")
        try:
            # cwd elsewhere: -m puts the cwd first on sys.path, and a source tree's gpumem/ there
            # (no built extension) would shadow the installed one.
            self.sim_proc = subprocess.Popen(
                cmd + [os.path.abspath(p) for p in paths],
                stdout=self.sim_out,
                stderr=self.sim_err,
                cwd=self.work,
                env=server_env("gpumem"),
            )
            self.log("gpumem simulated min-capacity search started on the CPU")
        except OSError as e:
            self.sim_proc = None
            self.sim_error = f"could not start: {e}"

    def sim_results(self, wait: float) -> Dict[str, dict]:
        if getattr(self, "_sim", None) is not None:
            return self._sim
        res: Dict[str, dict] = {}
        reason = getattr(self, "sim_error", None)
        if self.sim_proc is not None:
            try:
                self.sim_proc.wait(timeout=max(1.0, wait))
            except subprocess.TimeoutExpired:
                reason = f"still running after {wait:.0f} s more; not waited for"
            self.sim_out.seek(0)
            for line in self.sim_out.read().decode("utf-8", "replace").splitlines():
                try:
                    j = json.loads(line)
                except ValueError:
                    continue
                if j.get("min_capacity_bytes"):
                    res[j["name"]] = {"min_capacity": j["min_capacity_bytes"], "peak_live": j.get("peak_live_bytes")}
            if not res and reason is None:
                self.sim_err.seek(0)
                reason = "no result: " + self.sim_err.read().decode("utf-8", "replace")[-400:]
        if not res and self.args.dry_run:
            from .fake import OVERHEAD

            res = {
                n: {"min_capacity": int(t.peak_live * OVERHEAD["gpumem"]), "peak_live": t.peak_live, "fake": True}
                for n, t in self.packed.items()
            }
        self._sim = res
        self.doc["gpumem_sim"] = {"status": "ok" if res else "failed", "reason": reason, "traces": res}
        return res

    def start_servers(self) -> None:
        for c in self.args.contenders:
            self.servers[c] = Server(c, self.cache, self.logs, self.args.dry_run, self.args.spawn)
        for c, s in self.servers.items():
            r = s.wait_ready(180)
            if r.get("status") != "ready":
                self.doc["contenders"][c] = {"status": "error", "reason": f"worker server: {r.get('reason')}"}
                self.log(f"{c}: worker server failed: {r.get('reason')}")
                continue
            s.send({"task": "load_traces", "traces": list(self.packed)})
        for c, s in self.servers.items():
            if c in self.doc["contenders"]:
                continue
            r = s.receive(120)
            if r.get("status") != "ok":
                self.doc["contenders"][c] = {"status": "error", "reason": f"loading traces: {r.get('reason')}"}

    def probe_contenders(self) -> None:
        """One small attempt per contender: versions, device, and whether it works at all."""
        for c in self.args.contenders:
            if c in self.doc["contenders"]:
                continue
            r = self.servers[c].call({"task": "info", "options": self.options(c, None)}, timeout=120)
            st = r.get("status")
            entry = {
                "status": "ok" if st == "ok" else ("unavailable" if st == "unavailable" else "error"),
                "ready": self.servers[c].ready,
                "info": r,
            }
            if st != "ok":
                entry["reason"] = r.get("reason") or st
                if r.get("log_tail"):
                    entry["log_tail"] = r["log_tail"]
            else:
                self.available.append(c)
                if self.doc["device"] is None:
                    self.doc["device"] = {
                        k: r.get(k)
                        for k in ("device_name", "total_memory", "driver", "torch", "torch_cuda", "python", "fake")
                    }
            self.doc["contenders"][c] = entry
            self.log(
                f"{c}: {entry['status']}"
                + (f" ({entry.get('reason')})" if st != "ok" else f" in {r.get('elapsed_s')} s")
            )

    def options(self, contender: str, stage: Optional[str]) -> dict:
        o = {"gpumem_options": self.args.gpumem_options}
        # RMM's pool: all of the cap up front for trace replays under a cap (no kernels run there,
        # so nothing else needs memory); grown on demand elsewhere (docs/benchmarks.md).
        o["rmm_pool"] = "all" if stage == "1" else "grow"
        return o

    def _replay(self, c: str, t: str, cap: Optional[int], passes: int, stage: str, s_per_event: float) -> dict:
        """Replay trace t on contender c's server, under cap (None: uncapped), passes times; the
        time allowed grows with the trace's events.  stage: the figure the options are for."""
        request = {"task": "replay", "trace": t, "cap": cap, "passes": passes, "options": self.options(c, stage)}
        return self.servers[c].call({**request, "timeout_s": 60 + self.packed[t].n_events * s_per_event})

    def ceiling(self) -> int:
        free = None
        for c in self.available:
            d = (self.doc["contenders"][c].get("info") or {}).get("device") or {}
            if d.get("free_at_start"):
                free = d["free_at_start"] if free is None else min(free, d["free_at_start"])
        return (free or 80 * GiB) - 512 * MiB

    def unavailable_rows(self, key: str, values) -> List[dict]:
        rows = []
        for c in self.args.contenders:
            if c in self.available:
                continue
            e = self.doc["contenders"].get(c, {})
            for v in values:
                rows.append(
                    {
                        key: v,
                        "contender": c,
                        "status": "unavailable",
                        "reason": e.get("reason") or "contender not available",
                    }
                )
        return rows

    # -- figures ------------------------------------------------------------------------------------------
    def figure(self, k: str) -> dict:
        """Figure k's part of the results document, made (not run yet) on first use."""
        return self.doc["figures"].setdefault(k, {"status": "not run", "rows": [], "notes": []})

    def fig6(self, deadline: float) -> None:
        f = self.figure("6")
        sizes = FIG6_SIZES
        for c in self.available:
            if time.monotonic() > deadline:
                f["rows"] += [_skipped("size", s, c) for s in sizes]
                continue
            r = self.servers[c].call(
                {
                    "task": "microbench",
                    "sizes": sizes,
                    "iters": 300 if self.args.quick else 1000,
                    "repeats": 5,
                    "options": self.options(c, "6"),
                    "timeout_s": 60,
                }
            )
            if r.get("status") == "ok":
                f["rows"] += [
                    {"size": x["size"], "contender": c, "status": "ok", "us": x["us"], "us_min": x["us_min"]}
                    for x in r["rows"]
                ]
            else:
                f["rows"] += [
                    {"size": s, "contender": c, "status": "failed", "reason": r.get("reason") or r.get("status")}
                    for s in sizes
                ]
            self.log(f"fig6 {c}: {r.get('status')} in {r.get('elapsed_s')} s")
        f["rows"] += self.unavailable_rows("size", sizes)
        f["status"] = "done"
        f["notes"].append(
            "Each cell: median of 5 repeats of N back-to-back torch.empty(size, uint8) + del on the "
            "default stream, after 20 warm-up pairs; no cap."
        )

    def _replay_row_common(self, t: str, c: str, r: dict) -> dict:
        return {"trace": t, "contender": c}

    def fig23(self, deadline: float) -> None:
        want2, want3 = "2" in self.args.figures, "3" in self.args.figures
        f2 = self.figure("2") if want2 else None
        f3 = self.figure("3") if want3 else None
        names = list(self.packed)
        est: Dict[str, float] = {}
        for t in names:
            peak = self.packed[t].peak_live
            for c in self.available:
                if time.monotonic() + est.get(t, 3.0) > deadline:
                    for f in (f2, f3):
                        if f is not None:
                            f["rows"].append(_skipped("trace", t, c))
                    continue
                r = self._replay(c, t, None, passes=2, stage="23", s_per_event=40e-6)
                est[t] = max(est.get(t, 0), float(r.get("elapsed_s") or 0))
                ok = r.get("status") == "ok"
                p = r.get("passes") or [{}]
                if f2 is not None:
                    if ok:
                        st = p[0].get("allocator_stats") or {}
                        sampled = p[0].get("peak_used_sampled")
                        reserved, source = (
                            (st["reserved_peak"], "stats") if st.get("reserved_peak") else (sampled, "sampled")
                        )
                        f2["rows"].append(
                            {
                                "trace": t,
                                "contender": c,
                                "status": "ok",
                                "reserved": reserved,
                                "source": source,
                                "ratio": reserved / peak if reserved else None,
                                "stats_reserved_peak": st.get("reserved_peak"),
                                "sampled_peak": sampled,
                                "sampled_ratio": sampled / peak if sampled else None,
                            }
                        )
                    else:
                        f2["rows"].append(self._failed_row("trace", t, c, r))
                if f3 is not None:
                    if ok:
                        f3["rows"].append(
                            {
                                "trace": t,
                                "contender": c,
                                "status": "ok",
                                "uncapped_wall_s": p[0].get("wall_s"),
                                "uncapped_warm_wall_s": p[1].get("wall_s") if len(p) > 1 else None,
                            }
                        )
                    else:
                        f3["rows"].append(self._failed_row("trace", t, c, r))
                    if ok and "1" not in self.args.figures:
                        self._capped_probe(f3["rows"][-1], t, c, peak)
                self.log(f"fig2/3 {t} {c}: {r.get('status')} in {r.get('elapsed_s')} s")
            self.checkpoint()
        for f, key in ((f2, "2"), (f3, "3")):
            if f is not None:
                f["rows"] += self.unavailable_rows("trace", names)
                f["status"] = "partial" if any(x["status"] == "skipped" for x in f["rows"]) else "done"
        if f2 is not None:
            f2["notes"].append(
                "Peak reserved during one replay from a fresh process: the allocator's own figure "
                "(torch's reserved_bytes.all.peak; RMM: pool size) where it keeps one; * marks the "
                "allocator-neutral figure instead (device memory in use, sampled every 64 allocations "
                "with cudaMemGetInfo, minus what was in use before the allocator started)."
            )
        if f3 is not None:
            f3["notes"].append(
                "Cells: uncapped wall time / wall time capped at 1.05 × peak live (× its ratio to "
                "uncapped). Both are the first replay in a fresh process (cold: growing the pool "
                "counts); the JSON also holds a second, warm, uncapped pass."
            )

    def _capped_probe(self, row: dict, t: str, c: str, peak: int) -> None:
        """Figure 3's capped run when figure 1 (whose searches probe 1.05 × peak live) is not made."""
        cap = align_up(int(peak * 1.05), ALIGN)
        r = self._replay(c, t, cap, passes=1, stage="1", s_per_event=60e-6)
        p0 = (r.get("passes") or [{}])[0]
        row.update(
            capped_cap=cap,
            capped_cap_effective=(r.get("device") or {}).get("cap_effective"),
            capped_status=r.get("status"),
        )
        if r.get("status") == "ok" and p0.get("wall_s") is not None:
            row["capped_wall_s"] = p0["wall_s"]
            if row.get("uncapped_wall_s"):
                row["slowdown"] = p0["wall_s"] / row["uncapped_wall_s"]
        elif r.get("status") != "oom":
            row["capped_reason"] = r.get("reason")

    def _failed_row(self, key, v, c, r) -> dict:
        st = r.get("status")
        row = {
            key: v,
            "contender": c,
            "status": "oom" if st == "oom" else "failed",
            "reason": (r.get("reason") or st or "?"),
        }
        if r.get("log_tail"):
            row["log_tail"] = r["log_tail"][-600:]
        return row

    def fig1(self, deadline: float) -> None:
        f = self.figure("1")
        res = self.args.resolution
        f["resolution"] = res
        want3 = "3" in self.args.figures
        sim = (
            self.sim_results(wait=min(60.0, max(1.0, deadline - time.monotonic() - 30)))
            if "gpumem" in self.available
            else {}
        )
        ceiling = self.ceiling()
        searches = []
        for t in self.packed:
            peak = self.packed[t].peak_live
            for c in self.available:
                if c == "gpumem" and t in sim:
                    guess_ratio = sim[t]["min_capacity"] / peak
                else:
                    prior = README_PRIORS.get(t, {})
                    guess_ratio = prior.get(c, prior.get("native", 1.05))
                guess = int(peak * guess_ratio)
                margin = max(2 * res, int(guess * 0.002), 16 * MiB)
                seeds = ([align_up(int(peak * 1.05), ALIGN)] if want3 else []) + seeds_around(guess, margin)
                s = MinPassSearch(peak, ceiling, res, ALIGN, seeds=seeds, margin=margin)
                searches.append(
                    {
                        "trace": t,
                        "contender": c,
                        "search": s,
                        "probes": [],
                        "est": 3.0,
                        "c105": align_up(int(peak * 1.05), ALIGN),
                        "error": None,
                        "stopped": None,
                        "any_ok": False,
                    }
                )
        active = list(searches)
        last_ckpt = time.monotonic()
        rounds = 0
        while active:
            rounds += 1
            for e in list(active):
                s = e["search"]
                v = s.next()
                if v is None:
                    active.remove(e)
                    continue
                if time.monotonic() + e["est"] > deadline:
                    e["stopped"] = "time budget"
                    active.remove(e)
                    continue
                t, c = e["trace"], e["contender"]
                r = self._replay(c, t, v, passes=1, stage="1", s_per_event=60e-6)
                st = r.get("status")
                p0 = (r.get("passes") or [{}])[0]
                eff = (r.get("device") or {}).get("cap_effective")
                e["probes"].append(
                    {
                        "cap": v,
                        "cap_effective": eff,
                        "status": st,
                        "wall_s": p0.get("wall_s"),
                        "elapsed_s": r.get("elapsed_s"),
                        "reason": r.get("reason"),
                        "live_at_failure": p0.get("live_at_failure"),
                    }
                )
                if c == "rmm":  # the pool it got under this cap
                    e["probes"][-1]["allocator"] = (r.get("device") or {}).get("allocator")
                e["est"] = float(r.get("elapsed_s") or e["est"]) * 1.2 + 0.5
                if st == "ok":
                    e["any_ok"] = True
                    s.record(v, True)
                elif st in ("oom", "timeout") or (st == "crashed" and e["any_ok"]):
                    s.record(v, False)
                else:
                    e["error"] = r.get("reason") or st
                    if r.get("log_tail"):
                        e["log_tail"] = r["log_tail"][-600:]
                    active.remove(e)
                self.log(
                    f"fig1 {t} {c}: cap {report.fmt_bytes(v)} ({v / self.packed[t].peak_live:.4f}) -> {st}"
                    f" in {r.get('elapsed_s')} s"
                )
                if time.monotonic() - last_ckpt > 30:
                    self._fig1_rows(f, searches, sim, want3)
                    self.checkpoint()
                    last_ckpt = time.monotonic()
        f["rounds"] = rounds
        self._fig1_rows(f, searches, sim, want3)

    def _fig1_rows(self, f: dict, searches: List[dict], sim: dict, want3: bool) -> None:
        rows, rows3 = [], []
        sim_cmp = {}
        for e in searches:
            t, c, s = e["trace"], e["contender"], e["search"]
            peak = self.packed[t].peak_live
            eff = {p["cap"]: p["cap_effective"] or p["cap"] for p in e["probes"]}
            r = s.result()
            row = {
                "trace": t,
                "contender": c,
                "peak_live": peak,
                "probes": e["probes"],
                "search": {
                    k: r[k]
                    for k in ("min_pass", "max_fail", "resolution_reached", "converged", "exhausted", "nonmonotone")
                },
            }
            hi = r["min_pass"]
            if e["error"]:
                row.update(status="failed", reason=e["error"])
                if e.get("log_tail"):
                    row["log_tail"] = e["log_tail"]
            elif hi is None:
                why = (
                    "nothing up to the device's free memory passed"
                    if r["exhausted"]
                    else f"no passing cap found before the search stopped ({e['stopped'] or 'unfinished'})"
                )
                row.update(status="failed", reason=why)
            else:
                row["min_cap"] = eff.get(hi, hi)
                row["ratio"] = row["min_cap"] / peak
                if r["max_fail"] is not None:
                    row["ratio_max_fail"] = eff.get(r["max_fail"], r["max_fail"]) / peak
                if r["converged"]:
                    row["status"] = "ok"
                else:
                    row["status"] = "partial"
                    row["reason"] = (
                        f"stopped at a {report.fmt_bytes(r['resolution_reached'])} bracket "
                        f"({e['stopped'] or 'unfinished'})"
                        if r["resolution_reached"]
                        else "unfinished"
                    )
            if r["nonmonotone"]:
                row["note"] = "a probe contradicted monotonicity (passed below a failure or failed above a pass)"
            rows.append(row)
            if c == "gpumem" and t in sim:
                sc = sim[t]["min_capacity"]
                sim_cmp[t] = {
                    "sim_min_capacity": sc,
                    "sim_ratio": sc / peak,
                    "gpu_min_cap": row.get("min_cap"),
                    "gpu_status": row["status"],
                    "resolution": f.get("resolution"),
                    "fake": bool(sim[t].get("fake")),
                }
                if row.get("min_cap"):
                    sim_cmp[t].update(
                        gpu_over_sim=row["min_cap"] / sc, within_1pct=abs(row["min_cap"] / sc - 1) <= 0.01
                    )
            if want3:
                p = next((p for p in e["probes"] if p["cap"] == e["c105"]), None)
                rows3.append({"trace": t, "contender": c, "cap": e["c105"], "probe": p})
        f["rows"] = rows + self.unavailable_rows("trace", list(self.packed))
        f["gpumem_sim"] = sim_cmp
        done = all(x["status"] in ("ok", "unavailable", "failed") for x in f["rows"])
        f["status"] = "done" if done else "partial"
        f["notes"] = [
            f"Smallest cap (free memory left by one raw cudaMalloc of the rest, measured after it) in which a fresh "
            f"process replays the trace with torch.empty/del, ÷ peak live; binary search to "
            f"{report.fmt_bytes(f.get('resolution'))} unless marked ≤ (bracket not closed in the time budget; "
            f"(>x) is the largest failing cap).",
            "RMM's pool is created with all the free memory under the cap (initial_pool_size), as RMM users size pools.",  # noqa: E501
        ]
        if sim_cmp:
            f["notes"].append(
                "gpumem sim: `python -m gpumem replay --min-capacity` on the simulated device (1 MiB "
                "search); GPU ÷ sim should be within 1% (✗ marks a miss)."
            )
        if want3:
            self._capped_into_fig3(rows3)

    def _capped_into_fig3(self, rows3: List[dict]) -> None:
        f3 = self.figure("3")
        idx = {(r["trace"], r["contender"]): r for r in f3["rows"]}
        for x in rows3:
            r = idx.get((x["trace"], x["contender"]))
            if r is None:
                r = {
                    "trace": x["trace"],
                    "contender": x["contender"],
                    "status": "failed",
                    "reason": "no uncapped run (figure 2/3 stage not run)",
                }
                f3["rows"].append(r)
                idx[(x["trace"], x["contender"])] = r
            p = x["probe"]
            r["capped_cap"] = x["cap"]
            if p is None:
                r["capped_status"] = "not probed"
                continue
            r["capped_cap_effective"] = p["cap_effective"]
            r["capped_status"] = p["status"]
            if p["status"] == "ok" and p.get("wall_s") is not None:
                r["capped_wall_s"] = p["wall_s"]
                if r.get("uncapped_wall_s"):
                    r["slowdown"] = p["wall_s"] / r["uncapped_wall_s"]

    def fig5(self, deadline: float) -> None:
        f = self.figure("5")
        lengths = self.args.fig5_lengths
        cap = self.args.fig5_cap
        guess: Dict[int, int] = {}
        self._preload()
        for i, c in enumerate(self.available):
            left = deadline - time.monotonic()
            per = left / max(1, len(self.available) - i)
            if left < 10:
                f["rows"] += [_skipped("length", n, c) for n in lengths]
                continue
            specs = []
            for n in lengths:
                g = guess.get(n) or max(1, int((cap - 2.4 * GiB) / (n * 400_000)))
                specs.append({"length": n, "seeds": [g, g + 1], "ceiling": 512})
            budget = max(10.0, per - 6)  # the rest is for the fresh-process check below
            r = self.servers[c].call(
                {
                    "task": "max_batch",
                    "cap": cap,
                    "lengths": specs,
                    "steps_per_try": 2,
                    "budget_s": budget,
                    "options": self.options(c, "5"),
                    "timeout_s": budget + 120,
                }
            )
            self.log(f"fig5 {c}: {r.get('status')} in {r.get('elapsed_s')} s")
            if r.get("status") != "ok":
                f["rows"] += [self._failed_row("length", n, c, r) for n in lengths]
                continue
            for x in r["results"]:
                n = x["length"]
                row = {
                    "length": n,
                    "contender": c,
                    "max_batch": x.get("max_pass"),
                    "min_fail": x.get("min_fail"),
                    "tries": x.get("tries"),
                    "cap_effective": (r.get("device") or {}).get("cap_effective"),
                }
                if x.get("stopped") and not x.get("stopped").startswith("time"):
                    row.update(status="failed", reason=x["stopped"])
                elif x.get("converged"):
                    row["status"] = "ok"
                    if x.get("max_pass"):
                        guess[n] = x["max_pass"]
                else:
                    row.update(status="partial", reason=f"search stopped ({x.get('stopped') or 'unfinished'})")
                f["rows"].append(row)
            # The search ran in one process; check in a fresh one that the next batch up really fails
            # at the main length (the figure's headline), so in-process state cannot understate it.
            main = next((row for row in f["rows"] if row["contender"] == c and row["length"] == lengths[0]), None)
            if main and main["status"] == "ok" and main.get("max_batch") and time.monotonic() + 8 < deadline:
                b = main["max_batch"] + 1
                v = self.servers[c].call(
                    {
                        "task": "max_batch",
                        "cap": cap,
                        "steps_per_try": 2,
                        "budget_s": 60,
                        "lengths": [{"length": lengths[0], "only": b}],
                        "options": self.options(c, "5"),
                        "timeout_s": 150,
                    }
                )
                vr = (v.get("results") or [{}])[0] if v.get("status") == "ok" else {}
                if v.get("status") == "ok" and vr.get("max_pass") == b:
                    main["verified"] = False
                    main["max_batch"] = b
                    main["note"] = f"batch {b} failed in the search's process but trains in a fresh one"
                elif v.get("status") == "ok":
                    main["verified"] = True
                else:
                    main["verify_error"] = v.get("reason") or v.get("status")
        f["rows"] += self.unavailable_rows("length", lengths)
        f["status"] = "partial" if any(x["status"] in ("skipped", "partial") for x in f["rows"]) else "done"
        f["notes"] = [
            f"llama_lora_ckpt (1B Llama, bf16, LoRA r=16 on q/v, gradient checkpointing), fixed length, cap "
            f"{report.fmt_bytes(cap)} imposed like figure 1 (one raw cudaMalloc of the rest); a batch 'trains' when "
            f"2 optimizer steps complete. The search runs in one fresh process per contender (model built once; "
            f"between tries every tensor of the try is freed and the cache emptied); at length {lengths[0]} the "
            f"next batch up is re-tried in a fresh process.",
            "RMM's pool grows on demand here (kernels loaded lazily and cuBLAS need memory outside the pool).",
        ]

    def _preload(self) -> None:
        mods = ["transformers", "peft", "torchvision"] if not self.args.dry_run else []
        if getattr(self, "_preloaded", False) or not mods:
            return
        self._preloaded = True
        t0 = time.perf_counter()
        for c in self.available:
            self.servers[c].send({"task": "preload", "modules": mods})
        for c in self.available:
            r = self.servers[c].receive(180)
            if r.get("failed"):
                self.log(f"{c}: preload failed for {r['failed']}")
        self.log(f"preloaded {', '.join(mods)} in the servers in {time.perf_counter() - t0:.1f} s")

    def fig4(self, deadline: float) -> None:
        from .workloads import WORKLOADS

        f = self.figure("4")
        self._preload()
        steps = self.args.fig4_steps
        est: Dict[str, float] = {}
        for w in WORKLOADS:
            for c in self.available:
                if time.monotonic() + est.get(w, 15.0) > deadline:
                    f["rows"].append(_skipped("workload", w, c))
                    continue
                r = self.servers[c].call(
                    {
                        "task": "train",
                        "workload": w,
                        "steps": steps,
                        "median_from": 5,
                        "options": self.options(c, "4"),
                        "timeout_s": 240,
                    }
                )
                est[w] = max(est.get(w, 0.0), float(r.get("elapsed_s") or 0))
                self.log(f"fig4 {w} {c}: {r.get('status')} median {r.get('median_s')} in {r.get('elapsed_s')} s")
                if r.get("status") == "ok" and r.get("median_s"):
                    f["rows"].append(
                        {
                            "workload": w,
                            "contender": c,
                            "status": "ok",
                            "median_s": r["median_s"],
                            "steps": r["steps"],
                            "build_s": r.get("build_s"),
                            "allocator_stats": r.get("allocator_stats"),
                        }
                    )
                else:
                    f["rows"].append(self._failed_row("workload", w, c, r))
            self.checkpoint()
        base = {r["workload"]: r["median_s"] for r in f["rows"] if r["contender"] == "native" and r["status"] == "ok"}
        for r in f["rows"]:
            if r["status"] == "ok" and r["workload"] in base:
                r["rel_to_native"] = r["median_s"] / base[r["workload"]]
        f["rows"] += self.unavailable_rows("workload", WORKLOADS)
        f["status"] = "partial" if any(x["status"] == "skipped" for x in f["rows"]) else "done"
        f["notes"] = [
            f"{steps} steps from a fresh process with capture.py's shape draws (same seed for all); "
            f"median of steps 5..{steps}, each timed between torch.cuda.synchronize() calls; no cap."
        ]

    # -- the whole run -----------------------------------------------------------------------------------
    def run(self) -> int:
        try:
            self.log(f"output {self.out}; work dir {self.work}; deadline {self.args.deadline:.0f} s")
            self.prepare_traces()
            self.start_sim()
            self.start_servers()
            self.probe_contenders()
            self.checkpoint()
            if not self.available:
                self.log("no contender works here; see the JSON for the reasons")
            stages = [
                s
                for s in STAGE_ORDER
                if (s == "23" and ("2" in self.args.figures or "3" in self.args.figures)) or s in self.args.figures
            ]
            for i, stage in enumerate(stages):
                if not self.available:
                    break
                dl = self.stage_deadline(stage, stages[i:])
                self.log(f"stage {stage}: {dl - time.monotonic():.0f} s")
                try:
                    getattr(self, "fig" + stage)(dl)
                except Exception as e:  # one figure's bug must not lose the others
                    import traceback

                    key = stage[0]
                    f = self.doc["figures"].setdefault(key, {"rows": [], "notes": []})
                    f["status"] = "partial"
                    f["reason"] = f"orchestrator error: {type(e).__name__}: {e}"
                    self.log(traceback.format_exc())
                self.checkpoint()
            for fig in self.args.figures:
                self.doc["figures"].setdefault(fig, {"status": "skipped", "rows": [], "reason": "no contender ran"})
        finally:
            self.finish()
        return 0

    def finish(self) -> None:
        for s in self.servers.values():
            s.close(kill=TERMINATING)
        if self.sim_proc is not None and self.sim_proc.poll() is None:
            self.sim_proc.kill()
        if "1" in self.args.figures and "gpumem" in self.args.contenders and getattr(self, "_sim", None) is None:
            self.sim_results(wait=1)
        self.doc["finished"] = _now_iso()
        problems = report.validate(self.doc)
        if problems:
            self.doc["schema_problems"] = problems
            self.log(f"schema problems: {problems[:5]}")
        self.checkpoint()
        try:
            pngs = report.plots(self.doc, os.path.join(self.work, "plots"))
            for p in pngs:
                shutil.copyfile(p, os.path.join(self.out, os.path.basename(p)))
            if pngs:
                report.tar_files(pngs, os.path.join(self.out, "gpu_compare_plots.tar"))
        except Exception as e:
            self.log(f"plots failed: {type(e).__name__}: {e}")
        self.checkpoint()
        # Worker logs, tails only, in one file: the device returns few files.
        with open(os.path.join(self.out, "gpu_compare_logs.txt"), "w") as out:
            for name in sorted(os.listdir(self.logs)):
                p = os.path.join(self.logs, name)
                with open(p, "rb") as f:
                    f.seek(0, 2)
                    size = f.tell()
                    f.seek(max(0, size - 60_000))
                    out.write(f"===== {name} ({size} bytes{', tail' if size > 60_000 else ''})\n")
                    out.write(f.read().decode("utf-8", "replace") + "\n")
        self._copy_out(["gpu_compare_plots.tar", "gpu_compare_logs.txt"])
        self.log(f"done in {self.elapsed():.0f} s: {self.out}")
