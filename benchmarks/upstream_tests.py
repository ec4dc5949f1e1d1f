#!/usr/bin/env python3
"""PyTorch's own allocator tests (upstream test/test_cuda.py), natively and under gpumem, on one GPU.

    python benchmarks/upstream_tests.py UPSTREAM/test_cuda.py [--json FILE] [--logs DIR] [--only PATTERNS]
                                        [--deadline 320] [--timeout 150] [--keep]

PyTorch's test/test_cuda.py (not in torch's wheels: take it from the pytorch repository) turns years
of caching-allocator bug reports into tests.  This script picks the allocator-contract tests among
them by name (SELECT below) and runs them with pytest twice, each allocator in one process: on
torch's native allocator, and with gpumem installed by a conftest.py before CUDA starts.  Each test
that passed natively and not under gpumem runs again alone, under gpumem, in a fresh process.  It
prints a table (test, native, gpumem, alone) and the counts, and writes them as JSON, with the
pytest output in --logs (default: the JSON's folder).

The tests run from a copy of the file in a temporary folder, beside that conftest.py, which also
logs each outcome.  The copy differs only where this torch cannot import the file; the JSON lists
each edit: a name imported from torch that this torch lacks is bound to a stand-in, false as a flag,
that skips any test it decorates; a test whose definition raises on this torch is left out.  A
process that dies (a crash, or pytest-timeout stopping a hung test) marks its test "died", and a new
process runs the tests after it.  Tests not reached by --deadline are "not run".

Needs pytest and torch's test helpers, which import expecttest; uses pytest-timeout when installed.
While the native run starts, two processes with CUDA hidden build the C++ extensions that the tests
compile (torch's load_inline), one in each run's extension folder, and gpumem's own csrc/torch_ext.
"""

from __future__ import annotations

import argparse
import ast
import atexit
import fnmatch
import hashlib
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import last_json_line, markdown_head, markdown_row, run_child, with_checkout_path, write_json  # noqa: E402

# The allocator-contract tests, as "Class::test" patterns (fnmatch) over the collected tests.  Left
# out as tests of the native allocator's own settings or of other allocators: expandable segments,
# garbage collection and max_split_size (test_max_split_expandable, test_garbage_collect_expandable,
# test_allocator_settings, test_raises_oom with max_split_size, test_mempool_expandable), the
# test_graph_capture_reclaim_* tests (_set_allocator_settings), PYTORCH_CUDA_ALLOC_CONF read in a
# subprocess, the pinned host allocator (test_*pinned*, TestCachingHostAllocatorCudaGraph) and cuBLAS
# workspaces; as not about memory: streams, events, RNG, autocast, kernels, BLAS, device queries.
SELECT = [
    # statistics, out of memory, the memory fraction, record_stream and empty_cache
    "TestCuda::test_memory_allocation",
    "TestCuda::test_memory_stats",
    "TestCuda::test_matmul_memory_use",
    "TestCuda::test_cuda_memory_leak_detection_propagates_errors",
    "TestCuda::test_out_of_memory",
    "TestCuda::test_out_of_memory_retry",
    "TestCuda::test_set_per_process_memory_fraction",
    "TestCuda::test_get_per_process_memory_fraction",
    "TestCuda::test_record_stream",
    "TestCuda::test_record_stream_on_shifted_view",
    "TestCuda::test_caching_allocator_record_stream_oom",
    "TestCudaMallocAsync::test_cachingAllocator_raw_alloc",
    "TestCudaMallocAsync::test_raises_oom_max_split_size_mb_setting_False",
    "TestCudaMallocAsync::test_notifies_oom",
    "TestCudaMallocAsync::test_allocator_fuzz",
    "TestCudaMallocAsync::test_device_memory_used",
    # CUDA graphs and their memory pools
    "TestCuda::test_memory_stats_of_multiple_generators_and_graphs",
    "TestCuda::test_graph_capture_simple",
    "TestCuda::test_accelerator_graph_simple",
    "TestCuda::test_graph_capture_reset_recapture",
    "TestCuda::test_graph_capture_oom",
    "TestCuda::test_graph_two_successive",
    "TestCuda::test_graph_concurrent_replay",
    "TestCuda::test_graph_three_successive",
    "TestCuda::test_graph_memory_stats_and_use_result_after_destroy_graph",
    "TestCuda::test_graph_record_stream",
    "TestCuda::test_graph_make_graphed_callables_same_pool",
    "TestCuda::test_cuda_graph_error_options",
    "TestCuda::test_cuda_graph_allocator_propagates_stream",
    # snapshots and history, memory_viz plots, the memory profiler
    "TestCudaMallocAsync::test_memory_snapshot*",
    "TestCudaMallocAsync::test_memory_profiler_viz",
    "TestCudaMallocAsync::test_cycles",
    "TestCudaMallocAsync::test_memory_plots*",
    "TestCudaMallocAsync::test_memory_compile_regions",
    "TestCudaMallocAsync::test_cpp_memory_snapshot_pickle",
    "TestFXMemoryProfiler::test_fx_memory_profiler_augmentation",
    # cudagraph trees' checkpoints of a graph pool
    "TestBlockStateAbsorption::test_*",
    # MemPool: with and without an allocator of its own, nested, no_split, use_on_oom, threads
    "TestMemPool::test_*",
]
EXCLUDE = [
    "TestBlockStateAbsorption::test_no_triton_on_import",
    "TestMemPool::test_mempool_expandable",
    "TestMemPool::test_graph_capture_reclaim_*",
]
# pytest runs a class's tests in alphabetical order.  These run first in their class: they load
# TestMemPool's dummy allocator without its counters, the other MemPool tests with them, and each
# switch between the two compiles the allocator again (tens of seconds of C++).
RUN_FIRST = [
    "TestMemPool::test_deleted_mempool_not_used_on_oom",
    "TestMemPool::test_mempool_limited_memory_with_allocator",
]

CONFTEST = '''\
"""Written by gpumem's benchmarks/upstream_tests.py: installs gpumem when asked, logs each outcome."""
import json
import os
import time

import torch

_LOG = os.environ["UPSTREAM_TESTS_LOG"]


def _write(record):
    with open(_LOG, "a") as f:
        f.write(json.dumps(record) + "\\n")


def _install():
    if os.environ.get("UPSTREAM_TESTS_ALLOCATOR") != "gpumem":
        return "native"
    if not torch.cuda.is_available():
        return "native (no CUDA device: gpumem not installed)"
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA started before the conftest could install gpumem")
    import gpumem
    gpumem.install()
    return "gpumem"


_write({"event": "session", "allocator": _install(), "torch": torch.__version__, "pid": os.getpid()})


def _message(report):
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:400]
    lines = report.longreprtext.strip().splitlines()
    errors = [ln[1:].strip() for ln in lines if ln.startswith("E ") and ln[1:].strip()]
    return " | ".join(errors[:3] or lines[-1:])[:400]


def pytest_runtest_logstart(nodeid, location):
    _write({"event": "start", "nodeid": nodeid, "t": time.time()})


def pytest_runtest_logreport(report):
    record = {"event": "report", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome}
    record["duration"] = round(report.duration, 3)
    if hasattr(report, "wasxfail"):
        record["xfail"] = True
    if report.outcome != "passed":
        record["message"] = _message(report)
    _write(record)


def pytest_sessionfinish(session, exitstatus):
    record = {"event": "finish", "exitstatus": int(exitstatus)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        record["device"] = torch.cuda.get_device_name()
    _write(record)
'''

STANDIN = '''
# -- inserted by gpumem's benchmarks/upstream_tests.py: names this torch lacks ------------------
class _AbsentName:
    """A name this torch lacks: false as a flag; a test it decorates, directly or through a call, is skipped."""

    def __init__(self, name):
        self._name = name

    def __bool__(self):
        return False

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _AbsentName):
            return unittest.skip("this torch lacks " + self._name)(args[0])
        return self


'''


def _has(module, modname: str, name: str) -> bool:
    try:
        return hasattr(module, name) or importlib.import_module(f"{modname}.{name}") is not None
    except ImportError:
        return False


def probe(path: str) -> dict:
    """What the file's top-level imports find missing in this Python: {"missing": {module: [names]}}
    for torch's modules, and "fatal" for anything else (a package to install)."""
    missing, fatal = {}, []
    for node in ast.parse(open(path).read()).body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                try:
                    importlib.import_module(alias.name)
                except ImportError as e:
                    fatal.append(f"import {alias.name}: {e}")
            continue
        if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
            continue
        try:
            mod = importlib.import_module(node.module)
        except ImportError as e:
            if not node.module.startswith("torch") or (e.name and not e.name.startswith("torch")):
                fatal.append(f"from {node.module}: {e}")
                continue
            mod = None
        gone = [a.name for a in node.names if mod is None or not _has(mod, node.module, a.name)]
        if gone and node.module.startswith("torch"):
            missing[node.module] = gone
        elif gone:
            fatal.append(f"from {node.module} import {', '.join(gone)}: not found")
    try:
        import gpumem._C  # noqa: F401
    except ImportError as e:
        fatal.append(f"gpumem does not import ({e}); build it: python setup.py build_ext --inplace")
    import torch

    return {"torch": torch.__version__, "python": sys.version.split()[0], "missing": missing, "fatal": fatal}


def _snapshot_extension(path: str, load_inline) -> None:
    """Builds the extension test_cpp_memory_snapshot_pickle compiles, by its own load_inline call."""
    tree = ast.parse(open(path).read())
    fn = next(
        n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "test_cpp_memory_snapshot_pickle"
    )
    names = {"load_inline": load_inline}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            names.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "load_inline"]
    eval(compile(ast.Expression(calls[0]), path, "eval"), names)


def _gpumem_builds(built: list, errors: list) -> list:
    """Threads that build gpumem's own files against torch's headers (csrc/torch_ext, cached per
    torch), which the gpumem run would otherwise build on first use."""
    try:
        import torch
        from gpumem.torch import _checkpoint, _cppalloc, _regions
    except ImportError as e:
        return errors.append(f"gpumem: {e!r}"[:300]) or []

    def one(name, fn):
        try:
            fn()
            built.append(name)
        except Exception as e:
            errors.append(f"{name}: {e!r}"[:300])

    jobs = {
        "allocator.cpp": lambda: _cppalloc._load(torch),
        "checkpoint.cpp": _checkpoint.load,
        "regions.cpp": _regions._lib,
    }
    threads = [threading.Thread(target=one, args=item) for item in jobs.items()]
    for t in threads:
        t.start()
    return threads


def build_extensions(workdir: str) -> dict:
    """Builds, in $TORCH_EXTENSIONS_DIR and with the tests' own code, the C++ extensions the selected
    tests compile: MemPool's dummy allocator as RUN_FIRST's tests load it (unless a test has begun
    to build it: the two would write its source in turn), then the snapshot extension; for the
    gpumem run, gpumem's own files too, meanwhile."""
    sys.path.insert(0, workdir)
    built, errors = [], []
    gpumem = os.environ["UPSTREAM_TESTS_ALLOCATOR"] == "gpumem"
    threads = _gpumem_builds(built, errors) if gpumem else []
    try:
        tests = importlib.import_module("test_cuda")
        if not os.path.exists(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "dummy_allocator")):
            tests.TestMemPool.get_dummy_allocator(None, check_vars=False)
            built.append("dummy_allocator")
    except Exception as e:  # a lost head start only: the test builds it itself
        errors.append(f"dummy_allocator: {e!r}"[:300])
    try:
        from torch.utils.cpp_extension import load_inline

        _snapshot_extension(os.path.join(workdir, "test_cuda.py"), load_inline)
        built.append("snapshot")
    except Exception as e:
        errors.append(f"snapshot: {e!r}"[:300])
    for t in threads:
        t.join()
    return {"built": built, "errors": errors}


def standin_copy(text: str, missing: dict) -> tuple[str, list]:
    """text with each missing name taken out of its import and bound to a stand-in; and the edits."""
    if not any(missing.values()):
        return text, []
    lines = text.splitlines(keepends=True)
    body = ast.parse(text).body
    imports = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
    after = max(n.end_lineno for n in imports)
    gone = sorted({name for names in missing.values() for name in names})
    block = STANDIN + "".join(f'{name} = _AbsentName("{name}")\n' for name in gone) + "\n"
    lines.insert(after, block)
    edits = []
    for node in sorted(imports, key=lambda n: -n.lineno):
        if not isinstance(node, ast.ImportFrom) or not missing.get(node.module):
            continue
        keep = [a for a in node.names if a.name not in missing[node.module]]
        names = "".join(f"    {a.name}{' as ' + a.asname if a.asname else ''},\n" for a in keep)
        new = f"from {node.module} import (\n{names})\n" if keep else ""
        lines[node.lineno - 1 : node.end_lineno] = [new]
        dropped = [a.name for a in node.names if a.name in missing[node.module]]
        edits.append(f"from {node.module}: {', '.join(dropped)} absent from this torch, bound to a stand-in")
    return "".join(lines), edits[::-1]


def _member_at(tree: ast.Module, line: int):
    """(class, member or None, their lines) whose definition, decorators included, holds line."""

    def span(node):
        return min([node.lineno] + [d.lineno for d in node.decorator_list]), node.end_lineno

    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        lo, hi = span(cls)
        if not lo <= line <= hi:
            continue
        for member in cls.body:
            if isinstance(member, (ast.FunctionDef, ast.ClassDef)):
                mlo, mhi = span(member)
                if mlo <= line <= mhi:
                    return cls, member, (mlo, mhi)
        return cls, None, (lo, hi)
    return None


def drop_failing(text: str, copy_path: str, output: str) -> tuple[str, str] | None:
    """text without the test (or class) whose definition raised in output's traceback, and the edit;
    None when the traceback points at no class."""
    frames = re.findall(r'File "([^"]+)", line (\d+)', output)
    tree = ast.parse(text)
    for file, line in reversed(frames):
        if os.path.abspath(file) != os.path.abspath(copy_path):
            continue
        hit = _member_at(tree, int(line))
        if hit is None:
            continue
        cls, member, (lo, hi) = hit
        node = member or cls
        lines = text.splitlines(keepends=True)
        error = next((ln.strip() for ln in reversed(output.splitlines()) if re.match(r"^\w*(Error|Exception)", ln)), "")
        lines[lo - 1 : hi] = [" " * node.col_offset + f"pass  # {node.name} left out: its definition raised\n"]
        what = f"{cls.name}.{member.name}" if member else cls.name
        return "".join(lines), f"{what} left out: its definition raised on this torch ({error[:200]})"
    return None


def child_env(allocator: str, log: str, ext_dir: str, hide_cuda: bool = False) -> dict:
    """The environment of a child process: this checkout first on the path, and the conftest's settings."""
    env = with_checkout_path()
    env.update(UPSTREAM_TESTS_LOG=log, UPSTREAM_TESTS_ALLOCATOR=allocator, TORCH_EXTENSIONS_DIR=ext_dir)
    env.update(PYTHONUNBUFFERED="1", PYTORCH_PRINT_REPRO_ON_FAILURE="0")
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def pytest_cmd(workdir: str, args: list, timeout: float) -> list:
    cmd = [sys.executable, "-m", "pytest", "-c", os.path.join(workdir, "pytest.ini"), "-p", "no:cacheprovider"]
    cmd += ["-q", "--tb=short", "-rN"]
    if timeout and importlib.util.find_spec("pytest_timeout") is not None:
        cmd += [f"--timeout={int(timeout)}", "--timeout-method=thread"]
    return cmd + args


def run_process(cmd: list, env: dict, cwd: str, log_path: str, until: float) -> tuple[int, bool, bool]:
    """Runs cmd (its output appended to log_path) until it ends or the clock reaches until, when
    its process group is killed.  Returns (exit status, whether it was stopped, whether
    pytest-timeout stopped a test)."""
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        start = log.tell()
        code, stopped = _wait(cmd, env, cwd, log, until)
    with open(log_path) as f:
        f.seek(start)
        return code, stopped, "+ Timeout +" in f.read()


def _wait(cmd: list, env: dict, cwd: str, log, until: float) -> tuple[int, bool]:
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=max(1.0, until - time.time())), False
    except subprocess.TimeoutExpired:
        stop(proc)
        return proc.returncode, True


def stop(proc: subprocess.Popen) -> None:
    """Kills proc, its process group, and every process under it (ninja gives each compiler a
    process group of its own)."""
    try:
        import psutil

        below = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # no psutil, or proc has just ended
        below = []
    os.killpg(proc.pid, signal.SIGKILL)
    for child in below:
        try:
            child.kill()
        except Exception:  # already gone
            pass
    proc.wait()


def read_records(path: str) -> list:
    with open(path) if os.path.exists(path) else open(os.devnull) as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def outcome(reports: list) -> dict:
    """One test's outcome from its setup, call and teardown reports."""
    by = {r["when"]: r for r in reports}
    setup, call, teardown = by.get("setup"), by.get("call"), by.get("teardown")
    if setup and setup["outcome"] == "failed":
        return {"outcome": "error", "message": setup.get("message", "")}
    if setup and setup["outcome"] == "skipped":
        return {"outcome": "skipped", "message": setup.get("message", "")}
    result = {"outcome": "passed", "duration": call["duration"] if call else 0.0}
    if call and call["outcome"] == "failed":
        result.update(outcome="failed", message=call.get("message", ""))
    elif call and call["outcome"] == "skipped":
        result.update(outcome="xfailed" if call.get("xfail") else "skipped", message=call.get("message", ""))
    elif call and call.get("xfail"):
        result["outcome"] = "xpassed"
    if teardown and teardown["outcome"] == "failed" and result["outcome"] != "failed":
        result.update(outcome="error", message="teardown: " + teardown.get("message", ""))
    return result


def run_tests(ids: list, allocator: str, ctx: dict, until: float, log_path: str) -> tuple[dict, dict]:
    """Runs ids under allocator in one pytest process; after a process dies, the tests after the one
    it died in run in a new one.  Returns ({nodeid: outcome}, facts about the run)."""
    results, facts = {}, {"processes": 0, "seconds": 0.0}
    todo, t0 = list(ids), time.time()
    while todo and time.time() < until - 3:
        records_path = os.path.join(ctx["workdir"], f"records_{allocator}_{ctx['serial']}.jsonl")
        ctx["serial"] += 1
        env = child_env(allocator, records_path, ctx["ext"][allocator])
        cmd = pytest_cmd(ctx["workdir"], todo, ctx["timeout"])
        code, stopped, timed_out = run_process(cmd, env, ctx["workdir"], log_path, until)
        facts["processes"] += 1
        records, reports = read_records(records_path), {}
        for r in records:
            if r["event"] == "report":
                reports.setdefault(r["nodeid"], []).append(r)
            elif r["event"] in ("session", "finish"):
                facts.update({k: v for k, v in r.items() if k not in ("event", "pid")})
        done = {n: outcome(rs) for n, rs in reports.items() if any(r["when"] == "teardown" for r in rs)}
        results.update(done)
        todo = [n for n in todo if n not in results]
        started = [r["nodeid"] for r in records if r["event"] == "start"]
        if started and started[-1] not in done:
            why = "stopped at the deadline" if stopped else f"the process died (exit {code})"
            why = f"timed out (pytest-timeout, {ctx['timeout']:.0f} s)" if timed_out else why
            results[started[-1]] = {"outcome": "died", "message": why}
            todo = [n for n in todo if n != started[-1]]
        elif not stopped:
            facts["exit"] = code
            break
    facts["seconds"] = round(time.time() - t0, 1)
    for n in ids:
        results.setdefault(n, {"outcome": "not run"})
    return {n: results[n] for n in ids}, facts


def collect(ctx: dict, log_path: str) -> tuple[list, str]:
    """The copy's test ids, collected with CUDA hidden; and pytest's output when collection failed."""
    records = os.path.join(ctx["workdir"], "records_collect.jsonl")
    env = child_env("native", records, ctx["ext"]["native"], hide_cuda=True)
    cmd = pytest_cmd(ctx["workdir"], ["--collect-only", "--tb=native", "test_cuda.py"], 0)
    p = subprocess.run(cmd, env=env, cwd=ctx["workdir"], capture_output=True, text=True)
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n{p.stdout}{p.stderr}")
    ids = [ln.strip() for ln in p.stdout.splitlines() if ln.startswith("test_cuda.py::")]
    return ids, ("" if p.returncode in (0, 5) else p.stdout + p.stderr)


def prepare(upstream: str, ctx: dict, log_path: str) -> tuple[list, list]:
    """Writes the copy (stand-ins for what this torch lacks, less the tests it cannot define) and
    returns (its test ids, the edits)."""
    text, edits = standin_copy(open(upstream).read(), ctx["probe"]["missing"])
    copy_path = os.path.join(ctx["workdir"], "test_cuda.py")
    for _ in range(8):
        with open(copy_path, "w") as f:
            f.write(text)
        ids, failure = collect(ctx, log_path)
        if not failure:
            return ids, edits
        dropped = drop_failing(text, copy_path, failure)
        if dropped is None:
            raise SystemExit(f"upstream_tests: the copy does not import on this torch:\n{failure[-3000:]}")
        text, edit = dropped
        edits.append(edit)
    raise SystemExit("upstream_tests: the copy still does not import after leaving out 8 definitions")


def select(ids: list, only: list) -> tuple[list, list]:
    """The collected ids that SELECT names (less EXCLUDE, and within only when given), in pytest's
    order but for RUN_FIRST; and the patterns that named none."""
    short = {n: n.split("::", 1)[1] for n in ids}

    def chosen(name, patterns):
        return any(fnmatch.fnmatchcase(name, p) for p in patterns)

    picked = [n for n in ids if chosen(short[n], SELECT) and not chosen(short[n], EXCLUDE)]
    picked = [n for n in picked if not only or chosen(short[n], only)]
    classes = list(dict.fromkeys(short[n].split("::")[0] for n in picked))
    picked.sort(key=lambda n: (classes.index(short[n].split("::")[0]), short[n] not in RUN_FIRST))
    unmatched = [p for p in SELECT if not any(fnmatch.fnmatchcase(short[n], p) for n in picked)]
    return picked, unmatched


def start_warmups(ctx: dict) -> list:
    """One process per run's extension folder, CUDA hidden, that builds the tests' extensions."""
    procs = []
    for allocator, ext in ctx["ext"].items():
        env = child_env(allocator, os.devnull, ext, hide_cuda=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--build", ctx["workdir"]]
        log = open(os.path.join(ctx["workdir"], f"warmup_{allocator}.log"), "w")
        procs.append(
            (allocator, subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        )
    return procs


def finish_warmups(procs: list, workdir: str) -> dict:
    """What each warm-up built; one still going (slower than the tests, which built for themselves)
    is stopped."""
    out = {}
    for allocator, proc in procs:
        if proc.poll() is None:
            stop(proc)
            out[allocator] = {"stopped": True}
            continue
        with open(os.path.join(workdir, f"warmup_{allocator}.log")) as f:
            out[allocator] = last_json_line(f.read()) or {"exit": proc.returncode}
    return out


def rerun_alone(ctx: dict, native: dict, gpumem: dict, until: float, log_path: str) -> dict:
    """Each test that passed natively and neither passed nor went unrun under gpumem, alone under
    gpumem in a fresh process."""
    alone = {}
    for n in native:
        if native[n]["outcome"] != "passed" or gpumem[n]["outcome"] in ("passed", "not run"):
            continue
        late = time.time() > until - 10
        alone[n] = {"outcome": "not run"} if late else run_tests([n], "gpumem", ctx, until, log_path)[0][n]
    return alone


def counts(results: dict) -> dict:
    return dict(sorted(Counter(r["outcome"] for r in results.values()).items()))


def summary(native: dict, gpumem: dict, alone: dict) -> dict:
    lost = [n for n in native if native[n]["outcome"] == "passed" and gpumem[n]["outcome"] not in ("passed", "not run")]
    return {
        "selected": len(native),
        "native": counts(native),
        "gpumem": counts(gpumem),
        "passed_natively_not_under_gpumem": len(lost),
        "of_those_passed_alone": sum(alone.get(n, {}).get("outcome") == "passed" for n in lost),
        "failing_alone": [n.split("::", 1)[1] for n in lost if alone.get(n, {}).get("outcome") != "passed"],
    }


def print_report(native: dict, gpumem: dict, alone: dict, totals: dict) -> None:
    print(markdown_head("test | native | gpumem | alone"))
    for n in native:
        cells = [native[n]["outcome"], gpumem[n]["outcome"], alone.get(n, {}).get("outcome", "")]
        print(markdown_row([n.split("::", 1)[1], *cells]))
    print()
    for run in ("native", "gpumem"):
        print(f"{run}: " + ", ".join(f"{v} {k}" for k, v in totals[run].items()))
    print(
        f"{totals['selected']} selected; {totals['passed_natively_not_under_gpumem']} passed natively and not under "
        f"gpumem, {totals['of_those_passed_alone']} of them passed alone"
    )
    why = [n for n in native if gpumem[n]["outcome"] not in ("passed", "skipped", "xfailed", "not run")]
    if why:
        print("\n" + markdown_head("not passing under gpumem | native | why (gpumem)"))
        for n in why:
            print(markdown_row([n.split("::", 1)[1], native[n]["outcome"], gpumem[n].get("message", "")[:200]]))


def make_context(args) -> dict:
    workdir = tempfile.mkdtemp(prefix="gpumem_upstream_")
    if not args.keep:
        atexit.register(shutil.rmtree, workdir, True)
    with open(os.path.join(workdir, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")
    with open(os.path.join(workdir, "conftest.py"), "w") as f:
        f.write(CONFTEST)
    ext = {a: os.path.join(workdir, f"extensions_{a}") for a in ("native", "gpumem")}
    return {"workdir": workdir, "ext": ext, "timeout": args.timeout, "serial": 0}


def child_probe(upstream: str) -> dict:
    env = child_env("native", os.devnull, "", hide_cuda=True)
    found = run_child(os.path.abspath(__file__), ["--probe", upstream], "probing the imports", env=env)
    if found is None:
        raise SystemExit("upstream_tests: the import probe failed (its error is above)")
    if found["fatal"]:
        raise SystemExit("upstream_tests: missing here: " + "; ".join(found["fatal"]))
    return found


def run(args) -> dict:
    t0, until = time.time(), time.time() + args.deadline
    logs = args.logs or (os.path.dirname(os.path.abspath(args.json)) if args.json else os.getcwd())
    os.makedirs(logs, exist_ok=True)
    log = {k: os.path.join(logs, f"upstream_tests_{k}.log") for k in ("prepare", "native", "gpumem", "alone")}
    for path in log.values():
        open(path, "w").close()
    ctx = make_context(args)
    data = open(args.upstream, "rb").read()
    ctx["probe"] = child_probe(args.upstream)
    ids, edits = prepare(args.upstream, ctx, log["prepare"])
    picked, unmatched = select(ids, [p for p in (args.only or "").split(",") if p])
    print(f"{len(picked)} of {len(ids)} tests selected; torch {ctx['probe']['torch']}; edits: {len(edits)}", flush=True)
    warmups = start_warmups(ctx)
    steps = {"prepare": round(time.time() - t0, 1)}
    reserve = min(60.0, (until - time.time()) / 6)
    native, facts_native = run_tests(
        picked, "native", ctx, time.time() + (until - time.time() - reserve) / 2, log["native"]
    )
    gpumem, facts_gpumem = run_tests(picked, "gpumem", ctx, until - reserve, log["gpumem"])
    alone = rerun_alone(ctx, native, gpumem, until, log["alone"])
    warm = finish_warmups(warmups, ctx["workdir"])
    steps["total"] = round(time.time() - t0, 1)
    totals = summary(native, gpumem, alone)
    print_report(native, gpumem, alone, totals)
    secs = (steps["prepare"], facts_native["seconds"], facts_gpumem["seconds"], steps["total"])
    print("seconds: prepare %s, native %s, gpumem %s, all %s" % secs)
    tests = {n.split("::", 1)[1]: {"native": native[n], "gpumem": gpumem[n], "alone": alone.get(n)} for n in picked}
    upstream = {"path": args.upstream, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    return (
        dict(upstream=upstream, torch=ctx["probe"]["torch"], python=ctx["probe"]["python"], edits=edits)
        | dict(select=SELECT, exclude=EXCLUDE, only=args.only, patterns_matching_nothing=unmatched, summary=totals)
        | dict(runs={"native": facts_native, "gpumem": facts_gpumem}, warmup=warm, seconds=steps, tests=tests)
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("upstream", help="upstream test/test_cuda.py")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--logs", help="folder for the pytest logs (default: the JSON's folder)")
    ap.add_argument("--only", help="comma-separated Class::test patterns: run only these of the selection")
    ap.add_argument("--deadline", type=float, default=320.0, help="seconds for the whole run (default 320)")
    ap.add_argument("--timeout", type=float, default=150.0, help="pytest-timeout's limit per test (default 150)")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folder with the copy")
    if len(sys.argv) == 3 and sys.argv[1] in ("--probe", "--build"):
        mode, path = sys.argv[1:]
        del sys.argv[1:]  # torch's test helpers read the command line
        found = probe(path) if mode == "--probe" else build_extensions(path)
        print(json.dumps(found))
        return
    args = ap.parse_args()
    write_json(args.json, run(args))


if __name__ == "__main__":
    main()
