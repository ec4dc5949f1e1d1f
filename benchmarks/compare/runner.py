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
from .figures import Figures
from .search import MinPassSearch, MaxPassSearch, align_up, seeds_around  # noqa: F401

MiB = 1 << 20
GiB = 1 << 30
# Nominal seconds per stage ("23": the uncapped replays behind figures 2 and 3).
SHARES = {"6": 15, "23": 70, "1": 240, "5": 85, "4": 90}
STAGE_ORDER = ["6", "23", "1", "5", "4"]

TERMINATING = False


def on_sigterm(*_) -> None:
    """`timeout` and batch schedulers stop a run with SIGTERM: leave through the finally clauses,
    which stop the worker servers (at once) and write what was measured."""
    global TERMINATING
    TERMINATING = True
    sys.exit(143)


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


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


class Run(Figures):
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
