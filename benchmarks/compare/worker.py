"""Worker server: one per contender, runs every attempt in a fresh process.

    python worker.py --contender NAME --cache DIR --logs DIR [--fake] [--spawn]
    python worker.py --once --contender NAME --cache DIR [--fake]      (one task from stdin)

The server imports torch once (about two seconds) with the contender's PYTORCH_CUDA_ALLOC_CONF
in its environment, never touches CUDA, and forks one child per task: the child creates its own
CUDA context, imposes the cap, installs the allocator and runs the task, so every attempt starts
from an allocator that has never allocated (a fork costs tens of milliseconds; a fresh
interpreter would cost the torch import again).  If anything initialised the CUDA driver in the
server (fork would then give children a broken driver), it falls back to a fresh interpreter per
task (--spawn does that from the start).

Protocol: one JSON object per line on stdin (a task), one JSON object per line on stdout (its
result).  Every result has "status": ok | oom | error | crashed | timeout | unavailable, and
"reason" unless ok.  Children write their stdout/stderr to the contender's log file, so nothing
but results reaches the protocol stream.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from typing import Dict, Optional

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from compare import traces as tr  # noqa: E402
from compare.contenders import Unavailable, install, is_oom  # noqa: E402

MiB = 1 << 20
SAMPLE_EVERY = 64  # allocs between two cudaMemGetInfo samples of device memory in use


# ---- tasks (run in the child) ---------------------------------------------------------------------


class Context:
    """What a child inherits from its server: the contender, the trace cache, options."""

    def __init__(self, contender: str, cache: str, fake: bool):
        self.contender = contender
        self.cache = cache
        self.fake = fake
        self._traces: Dict[str, tuple] = {}

    def trace(self, name: str):
        """(PackedTrace, events list); loaded in the server so forked children share it."""
        if name not in self._traces:
            t = tr.load_packed(os.path.join(self.cache, name))
            self._traces[name] = (t, t.events())
        return self._traces[name]


def _first_line(e: BaseException, limit: int = 300) -> str:
    s = str(e).strip().splitlines()
    return f"{type(e).__name__}: {(s[0] if s else '')[:limit]}"


class Device:
    """CUDA context, cap and allocator of one child."""

    def __init__(self, ctx: Context, cap: Optional[int], options: dict, prepare=None):
        """`prepare()`, if given, makes what the task needs besides the allocator's memory (CUDA
        streams: PyTorch's first side stream creates its whole stream pool, about 70 MiB of device
        memory on an H100).  It runs after the allocator is installed and, so that the cap measures
        the allocator alone, before the cap is taken -- except for an RMM pool sized to the cap,
        which must be made under it; then prepare() runs last, inside the cap.  Its result is
        `self.prepared`."""
        from compare.cudart import CudaRT

        self.rt = CudaRT()
        self.rt.init()
        sized_by_cap = ctx.contender == "rmm" and options.get("rmm_pool", "grow") == "all"
        self.prepared = None
        self.info = {}
        if not sized_by_cap:
            self.installed = install(ctx.contender, None, options)
            if prepare:
                free0 = self.rt.mem_info()[0]
                self.prepared = prepare()
                self.info["prepare_bytes"] = free0 - self.rt.mem_info()[0]
        free, total = self.rt.stable_free()
        self.info.update({"free_at_start": free, "total": total, "cudart": self.rt.path})
        if cap:
            self.info.update(self.rt.impose_cap(cap))
        self.base_free = self.rt.mem_info()[0]  # free after the cap: the allocator's whole budget
        if sized_by_cap:
            self.installed = install(ctx.contender, self.base_free if cap else None, options)
            if prepare:
                self.prepared = prepare()
        self.info["allocator"] = self.installed.detail

    def used(self) -> int:
        """Device memory taken since the allocator was put in place (its pool, pages, segments)."""
        return self.base_free - self.rt.mem_info()[0]


def task_info(ctx: Context, task: dict) -> dict:
    import torch

    dev = Device(ctx, None, task.get("options", {}))
    p = torch.cuda.get_device_properties(0)
    drv = ctypes.c_int()
    dev.rt.lib.cudaDriverGetVersion(ctypes.byref(drv))
    x = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")  # the allocator works at all
    del x
    return {
        "status": "ok",
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "device_name": p.name,
        "total_memory": p.total_memory,
        "driver": drv.value,
        "python": sys.version.split()[0],
        "device": dev.info,
    }


def replay_pass(
    events, n_slots, streams, empty, device, set_stream, sync, free_bytes, base_free: int, sample: bool = True
) -> dict:
    """Replay `events` once: torch.empty at each alloc (on its stream), drop the tensor at each
    free.  The torch entry points come in as arguments so tests can run this on the CPU.
    `free_bytes()` is the device's free memory; it is sampled every SAMPLE_EVERY allocs."""
    import torch

    slots = [None] * n_slots
    u8 = torch.uint8
    cuda = device
    mem_info = free_bytes
    cur = 0
    set_stream(streams[0])
    n_alloc = 0
    max_used_free = None  # smallest free seen
    i = -1
    sync()
    t0 = time.perf_counter()
    try:
        for i, (op, slot, size, si) in enumerate(events):
            if op:
                slots[slot] = None
                continue
            if si != cur:
                set_stream(streams[si])
                cur = si
            slots[slot] = empty(size, dtype=u8, device=cuda)
            n_alloc += 1
            if sample and not n_alloc % SAMPLE_EVERY:
                f = mem_info()
                if max_used_free is None or f < max_used_free:
                    max_used_free = f
    except Exception as e:
        wall = time.perf_counter() - t0
        live = sum(t.numel() for t in slots if t is not None)
        set_stream(streams[0])
        out = {
            "status": "oom" if is_oom(e) else "error",
            "reason": _first_line(e),
            "event": i,
            "allocs_done": n_alloc,
            "live_at_failure": live,
            "wall_s": wall,
        }
        del slots
        return out
    sync()
    wall = time.perf_counter() - t0
    f = mem_info()
    if max_used_free is None or f < max_used_free:
        max_used_free = f
    set_stream(streams[0])
    live_end = sum(t.numel() for t in slots if t is not None)
    del slots
    return {
        "status": "ok",
        "wall_s": wall,
        "events": len(events),
        "allocs": n_alloc,
        "peak_used_sampled": base_free - max_used_free,
        "live_at_end": live_end,
    }


def task_replay(ctx: Context, task: dict) -> dict:
    import torch

    trace, events = ctx.trace(task["trace"])
    cap = task.get("cap")

    def make_streams():
        made = [torch.cuda.default_stream() if s == 0 else torch.cuda.Stream() for s in trace.streams]
        return made or [torch.cuda.default_stream()]

    dev = Device(ctx, cap, task.get("options", {}), prepare=make_streams)
    streams = dev.prepared
    passes = []
    for p in range(max(1, int(task.get("passes", 1)))):
        r = replay_pass(
            events,
            trace.n_slots,
            streams,
            torch.empty,
            torch.device("cuda", 0),
            torch.cuda.set_stream,
            torch.cuda.synchronize,
            lambda: dev.rt.mem_info()[0],
            dev.base_free,
        )
        if p == 0:
            r["allocator_stats"] = dev.installed.stats()
        r["used_after"] = dev.used()
        passes.append(r)
        gc.collect()
        if r["status"] != "ok":
            break
    first = passes[0]
    return {
        "status": first["status"],
        "reason": first.get("reason"),
        "trace": trace.name,
        "cap": cap,
        "device": dev.info,
        "passes": passes,
    }


def task_train(ctx: Context, task: dict) -> dict:
    import torch
    from compare import workloads

    dev = Device(ctx, task.get("cap"), task.get("options", {}))
    t0 = time.perf_counter()
    try:
        w = workloads.build(task["workload"], "cuda", seed=task.get("seed", 1234))
        build_s = time.perf_counter() - t0
        steps = workloads.timed_steps(w, int(task["steps"]), seed=task.get("seed", 1234), sync=torch.cuda.synchronize)
    except Exception as e:
        return {
            "status": "oom" if is_oom(e) else "error",
            "reason": _first_line(e),
            "device": dev.info,
            "traceback": traceback.format_exc()[-2000:],
        }
    return {
        "status": "ok",
        "workload": task["workload"],
        "build_s": build_s,
        "steps": steps,
        "median_s": workloads.median_from(steps, int(task.get("median_from", 5))),
        "allocator_stats": dev.installed.stats(),
        "used_after": dev.used(),
        "device": dev.info,
    }


def _try_batch(w, b: int, n: int, steps: int) -> Optional[str]:
    """None if `steps` steps at batch b, length n, train; else why not.  Runs in a function so
    that every tensor of a failed step dies with its frame before the next try."""
    try:
        for _ in range(steps):
            w.step(b, n)
        import torch

        torch.cuda.synchronize()
        return None
    except Exception as e:
        return ("oom: " if is_oom(e) else "error: ") + _first_line(e)


def task_max_batch(ctx: Context, task: dict) -> dict:
    """Largest batch that trains, per length, searched in one process (see docs/benchmarks.md:
    between tries every tensor of the try is freed and the cache emptied, so each try starts from
    the model and nothing else; the orchestrator re-checks the answer's neighbour in a fresh one)."""
    import torch
    from compare import workloads
    from compare.search import MaxPassSearch

    deadline = time.monotonic() + float(task.get("budget_s", 60))
    dev = Device(ctx, task.get("cap"), task.get("options", {}))
    try:
        w = workloads.build(task.get("workload", "llama_lora_ckpt"), "cuda", seed=task.get("seed", 1234))
    except Exception as e:
        return {
            "status": "oom" if is_oom(e) else "error",
            "reason": "building the model: " + _first_line(e),
            "device": dev.info,
        }
    results = []
    for spec in task["lengths"]:
        n = int(spec["length"])
        if "only" in spec:  # a single try (fresh-process check of one batch)
            s = MaxPassSearch(int(spec["only"]), seeds=[int(spec["only"])])
            s.lo = int(spec["only"]) - 1
        else:
            s = MaxPassSearch(int(spec.get("ceiling", 256)), seeds=spec.get("seeds", ()))
        tries = []
        stopped = None
        while True:
            b = s.next()
            if b is None:
                break
            if time.monotonic() > deadline:
                stopped = "time budget"
                break
            t0 = time.perf_counter()
            why = _try_batch(w, b, n, int(task.get("steps_per_try", 2)))
            gc.collect()
            torch.cuda.empty_cache()
            tries.append({"batch": b, "ok": why is None, "reason": why, "seconds": time.perf_counter() - t0})
            if why is not None and not why.startswith("oom"):
                stopped = why
                break
            s.record(b, why is None)
        r = s.result()
        r.update(length=n, tries=tries, stopped=stopped)
        results.append(r)
    return {"status": "ok", "results": results, "allocator_stats": dev.installed.stats(), "device": dev.info}


def task_microbench(ctx: Context, task: dict) -> dict:
    import torch

    dev = Device(ctx, None, task.get("options", {}))
    empty, u8, cuda = torch.empty, torch.uint8, torch.device("cuda", 0)
    rows = []
    for size in task["sizes"]:
        iters = int(task.get("iters", 1000))
        for _ in range(20):
            t = empty(size, dtype=u8, device=cuda)
            del t
        reps = []
        for _ in range(int(task.get("repeats", 5))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(iters):
                t = empty(size, dtype=u8, device=cuda)
                del t
            torch.cuda.synchronize()
            reps.append((time.perf_counter() - t0) / iters * 1e6)
        reps.sort()
        rows.append({"size": size, "us": reps[len(reps) // 2], "us_min": reps[0], "us_all": reps})
    return {"status": "ok", "rows": rows, "device": dev.info}


TASKS = {
    "info": task_info,
    "replay": task_replay,
    "train": task_train,
    "max_batch": task_max_batch,
    "microbench": task_microbench,
}


def execute(ctx: Context, task: dict) -> dict:
    kind = task.get("task")
    if ctx.fake:
        from compare import fake

        fn = fake.TASKS.get(kind)
    else:
        fn = TASKS.get(kind)
    if fn is None:
        return {"status": "error", "reason": f"unknown task {kind!r}"}
    try:
        return fn(ctx, task)
    except Unavailable as e:
        return {"status": "unavailable", "reason": str(e)}
    except Exception as e:
        return {
            "status": "oom" if is_oom(e) else "error",
            "reason": _first_line(e),
            "traceback": traceback.format_exc()[-3000:],
        }


# ---- the server --------------------------------------------------------------------------------


def driver_initialized() -> Optional[bool]:
    """Whether this process has initialised the CUDA driver (then forked children cannot use
    it).  cuDeviceGetCount answers CUDA_ERROR_NOT_INITIALIZED (3) before cuInit and does not
    initialise anything itself.  None where there is no driver library."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    n = ctypes.c_int()
    return lib.cuDeviceGetCount(ctypes.byref(n)) != 3


def _log_tail(path: str, start: int, limit: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
    except OSError:
        return ""
    return data[-limit:].decode("utf-8", "replace")


def run_forked(ctx: Context, task: dict, log_path: str) -> dict:
    timeout = float(task.get("timeout_s", 120))
    start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(r)
            fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.close(fd)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            print(f"--- {ctx.contender} pid {os.getpid()} task {json.dumps(task)[:300]}", flush=True)
            res = execute(ctx, task)
            data = json.dumps(res).encode()
            with os.fdopen(w, "wb") as out:
                out.write(data)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout
    timed_out = False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([r], [], [], min(left, 1.0))
        if ready:
            data = os.read(r, 1 << 20)
            if not data:
                break
            chunks.append(data)
    os.close(r)
    if timed_out:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _, status = os.waitpid(pid, 0)
    if timed_out:
        return {
            "status": "timeout",
            "reason": f"no result within {timeout:.0f} s; killed",
            "log_tail": _log_tail(log_path, start),
        }
    raw = b"".join(chunks)
    if raw:
        try:
            return json.loads(raw)
        except ValueError:
            pass
    how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}"
    return {
        "status": "crashed",
        "reason": f"the attempt's process died ({how}) without a result",
        "log_tail": _log_tail(log_path, start),
    }


def run_spawned(args, task: dict, log_path: str) -> dict:
    timeout = float(task.get("timeout_s", 120))
    cmd = [sys.executable, os.path.abspath(__file__), "--once", "--contender", args.contender, "--cache", args.cache]
    if args.fake:
        cmd.append("--fake")
    start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
    with open(log_path, "ab") as log:
        try:
            p = subprocess.run(
                cmd, input=json.dumps(task).encode(), stdout=subprocess.PIPE, stderr=log, timeout=timeout + 10
            )  # + the interpreter's start
        except subprocess.TimeoutExpired:
            return {
                "status": "timeout",
                "reason": f"no result within {timeout:.0f} s; killed",
                "log_tail": _log_tail(log_path, start),
            }
    lines = p.stdout.decode("utf-8", "replace").strip().splitlines()
    if lines:
        try:
            return json.loads(lines[-1])
        except ValueError:
            pass
    return {
        "status": "crashed",
        "reason": f"the attempt's process died (exit status {p.returncode}) without a result",
        "log_tail": _log_tail(log_path, start),
    }


def preload(ctx: Context, modules) -> dict:
    """Import modules in the server so forked children share them (transformers alone takes
    seconds to import).  Import errors are reported, not fatal: the tasks needing them fail."""
    done, failed = [], {}
    for m in modules:
        try:
            __import__(m)
            done.append(m)
        except Exception as e:
            failed[m] = _first_line(e)
    return {"status": "ok", "imported": done, "failed": failed}


def serve(args) -> int:
    ctx = Context(args.contender, args.cache, args.fake)
    os.makedirs(args.logs, exist_ok=True)
    log_path = os.path.join(args.logs, f"worker-{args.contender}.log")
    versions = {"python": sys.version.split()[0]}
    if not args.fake:
        t0 = time.perf_counter()
        import torch

        versions["torch"] = torch.__version__
        versions["import_s"] = round(time.perf_counter() - t0, 2)
    mode = "spawn" if args.spawn else "fork"
    out = sys.stdout
    out.write(json.dumps({"status": "ready", "contender": args.contender, "mode": mode, "versions": versions}) + "\n")
    out.flush()
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            task = json.loads(line)
        except ValueError as e:
            res = {"status": "error", "reason": f"bad task line: {e}"}
        else:
            t0 = time.perf_counter()
            if task.get("task") == "preload":
                res = preload(ctx, task.get("modules", []))
            elif task.get("task") == "load_traces":
                for name in task.get("traces", []):
                    ctx.trace(name)
                res = {"status": "ok"}
            elif task.get("task") == "quit":
                break
            else:
                if mode == "fork" and not args.fake and driver_initialized():
                    mode = "spawn"  # something in this server initialised CUDA: forks would be broken
                    print(
                        f"{args.contender}: CUDA driver initialised in the server; spawning per task",
                        file=sys.stderr,
                        flush=True,
                    )
                res = run_forked(ctx, task, log_path) if mode == "fork" else run_spawned(args, task, log_path)
            res.setdefault("elapsed_s", round(time.perf_counter() - t0, 3))
            res["mode"] = mode
        out.write(json.dumps(res) + "\n")
        out.flush()
    return 0


def once(args) -> int:
    ctx = Context(args.contender, args.cache, args.fake)
    task = json.loads(sys.stdin.read())
    real_stdout = os.dup(1)
    os.dup2(2, 1)  # whatever the task prints goes to the log, not the result line
    res = execute(ctx, task)
    os.write(real_stdout, (json.dumps(res) + "\n").encode())
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contender", required=True)
    p.add_argument("--cache", required=True, help="directory of packed traces (traces.save_packed)")
    p.add_argument("--logs", default=".", help="directory for worker-CONTENDER.log")
    p.add_argument("--fake", action="store_true", help="fake backend: no torch, no GPU (tests, --dry-run)")
    p.add_argument("--spawn", action="store_true", help="a fresh interpreter per task instead of a fork")
    p.add_argument("--once", action="store_true", help="run one task read from stdin and exit")
    args = p.parse_args(argv)
    return once(args) if args.once else serve(args)


if __name__ == "__main__":
    sys.exit(main())
