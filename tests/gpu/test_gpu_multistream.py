"""The multi-stream workloads of benchmarks/capture_trace.py on a GPU, in their small versions: PyTorch's
memory history must show allocations on several streams and frees completed after they were requested
(record_stream), which is what their traces give the replays.  Skipped without torch or a CUDA GPU."""

import os
import random
import sys

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from helpers import REPO  # noqa: E402

ROOT = str(REPO)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from compare import multistream as ms  # noqa: E402


@pytest.mark.parametrize("name", ms.MULTISTREAM)
def test_history_has_several_streams_and_late_frees(name):
    torch.manual_seed(0)
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=1_000_000)
    try:
        s = ms.run(name, "cuda", random.Random(0), steps=3, tiny=True)
        del s
        torch.cuda.synchronize()
        tr = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    allocs = [e for e in tr if e["action"] == "alloc"]
    assert allocs
    assert len({int(e["stream"]) for e in allocs}) >= (3 if name == "two_stream_pipeline" else 2)
    late = sum(
        1
        for e, nxt in zip(tr, tr[1:] + [None])
        if e["action"] == "free_requested"
        and (nxt is None or nxt["action"] != "free_completed" or nxt["addr"] != e["addr"])
    )
    assert late > 0
