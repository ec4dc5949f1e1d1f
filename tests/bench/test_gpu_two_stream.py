"""benchmarks/gpu_two_stream.py without a GPU: its prefetching loop on the CPU gives every batch as made
(the sums the main stream reads are the expected ones), the bisection finds the smallest cap that holds,
and --check runs the whole script against a fake probe."""

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from helpers import REPO  # noqa: E402

sys.path.insert(0, os.path.join(str(REPO), "benchmarks"))

import gpu_two_stream as g  # noqa: E402


def test_the_loop_reads_each_batch_as_made():
    r = g.workload(torch, "cpu", 5, g.CHECK)
    assert len(r["checks"]) == 5 and r["checks"] == r["expected"]
    assert len(set(r["expected"])) > 1  # the steps' batches differ


def test_bisection_finds_the_smallest_cap():
    calls = []

    def run(cap):
        calls.append(cap)
        return {"ok": cap >= 1003, "cap": cap}

    cap, probes, exact = g.bisect(run, 999, 1100, 1, 1e18)
    assert cap == 1003 and exact and len(probes) == len(calls) <= 7


def test_check_runs_the_script_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    p = subprocess.run(
        [sys.executable, os.path.join(str(REPO), "benchmarks", "gpu_two_stream.py"), "--check"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    assert "| gpumem hand-off on | 1008 | 1.0080 |" in p.stdout, p.stdout
