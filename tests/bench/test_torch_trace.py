"""benchmarks/common.py write_torch_trace: torch's allocation history written as a text trace that
gpumem.trace reads back with the same requests, frees and peak (zoo.py and gpu_policy.py --trace write
their traces with it)."""

import gzip
import os
import sys

from helpers import REPO

sys.path.insert(0, os.path.join(str(REPO), "benchmarks"))

from common import write_torch_trace  # noqa: E402

from gpumem.replay import replay  # noqa: E402
from gpumem.trace import load_trace  # noqa: E402

MiB = 1 << 20


def _history():
    """Entries as torch.cuda.memory._snapshot()["device_traces"][0] lists them: a 20 MiB segment,
    two blocks on stream 0, one freed, a third on another stream, and entries a trace leaves out."""
    a, b, c = 0x7F0000000000, 0x7F0000400000, 0x7F0001000000
    return [
        {"action": "segment_alloc", "addr": a, "size": 20 * MiB, "stream": 0},
        {"action": "alloc", "addr": a, "size": 4 * MiB, "stream": 0, "frames": []},
        {"action": "alloc", "addr": b, "size": 6 * MiB, "stream": 0},
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
        {"action": "free_requested", "addr": a, "size": 4 * MiB, "stream": 0},
        {"action": "free_completed", "addr": a, "size": 4 * MiB, "stream": 0},
        {"action": "alloc", "addr": c, "size": 8 * MiB, "stream": 7},
        {"action": "oom", "addr": 0, "size": 64 * MiB, "stream": 0, "device_free": 0},
        {"action": "segment_free", "addr": a, "size": 20 * MiB, "stream": 0},
    ]


def test_written_history_reads_back(tmp_path):
    path = str(tmp_path / "w.trace.gz")
    assert write_torch_trace(path, _history(), "a test's history") == 6
    with gzip.open(path, "rt") as f:
        assert f.readline().startswith("# action addr size stream  (a test's history)")
    t = load_trace(path)
    assert (t.allocs, t.frees) == (3, 1)
    assert t.peak_live_bytes == 14 * MiB  # 6 MiB and 8 MiB live once the 4 MiB block is freed
    r = replay(t, capacity=1 << 30, timing=False)
    assert r.ooms == 0 and r.peak_live_bytes == 14 * MiB


def test_entries_of_another_kind_are_left_out(tmp_path):
    path = str(tmp_path / "x.trace.gz")
    history = [e for e in _history() if e["action"] in ("oom", "snapshot", "segment_free")]
    assert write_torch_trace(path, history, "nothing to keep") == 0
    with gzip.open(path, "rt") as f:
        assert len(f.read().splitlines()) == 1
