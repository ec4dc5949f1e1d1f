"""Snapshots made on a GPU as users make them: torch's (and gpumem's, installed
into torch) memory history turned on after the weights were live, and a ring
bounded by max_entries that wraps.  gpumem's readers start from the blocks the
snapshot says are live, so the trace's live memory at its end is what the
segments hold, and the forecast command agrees with gpumem.forecast.  Skipped
without a GPU."""

import pytest

from helpers import cuda_devices, run_python

N_CUDA = cuda_devices()[0]

PRELUDE = """
import json, os, pickle, tempfile
import torch
import gpumem
from gpumem.trace import load_trace
def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""

BODY = """
{setup}
weights = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (256 << 20, 3 << 20, 1000)]
old = torch.empty(40 << 20, dtype=torch.uint8, device="cuda")  # live before the history, freed during it
torch.cuda.memory._record_memory_history(max_entries={max_entries})
held = []
for i in range(64):
    held.append(torch.empty((i % 5 + 1) << 20, dtype=torch.uint8, device="cuda"))
    if len(held) > 3:
        held.pop(0)
del old
torch.cuda.synchronize()
snap = torch.cuda.memory._snapshot()
path = os.path.join(tempfile.mkdtemp(), "late.pickle")
with open(path, "wb") as f:
    pickle.dump(snap, f)
t = load_trace(path, device=torch.cuda.current_device())
live_end = sum(size if op == 0 else -size for op, _, size, _ in t.decode())
dev = torch.cuda.current_device()
ours = snap.get("allocator_settings", {{}}).get("allocator") == "gpumem"  # gpumem's history records block sizes
held_now = sum(
    b["size"] if ours else b.get("requested_size") or b["size"]
    for s in snap["segments"] if s.get("device", dev) == dev
    for b in s["blocks"] if b["state"] in ("active_allocated", "active_pending_free")
)
out(live_before=t.live_before_bytes, live_end=live_end, held_now=held_now, peak=t.peak_live_bytes)
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
@pytest.mark.parametrize("allocator", ["native", "native-expandable", "gpumem"])
@pytest.mark.parametrize("max_entries", [1 << 20, 16])
def test_late_and_wrapped_history_on_gpu(allocator, max_entries):
    setup = "gpumem.install()" if allocator == "gpumem" else ""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"} if allocator == "native-expandable" else None
    r = run_python(BODY.format(setup=setup, max_entries=max_entries), PRELUDE, env=env)
    assert r["live_before"] >= (256 << 20) + (3 << 20) + 1000, r
    assert r["live_end"] == r["held_now"], r
    assert r["peak"] >= r["live_before"], r


FORECAST = """
{setup}
from gpumem.forecast import Forecast
weights = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
def step(b):
    xs = [torch.empty(b << 23, dtype=torch.uint8, device="cuda") for _ in range(10)]
    del xs
fc = gpumem.forecast(step, knob=[2, 4], capacity=4 << 30)
folder = tempfile.mkdtemp()
paths = []
for b in (2, 4):
    torch.cuda.memory._record_memory_history(max_entries=1 << 20)
    step(b)
    torch.cuda.synchronize()
    paths.append(os.path.join(folder, f"b{{b}}.pickle"))
    torch.cuda.memory._dump_snapshot(paths[-1])
    torch.cuda.memory._record_memory_history(enabled=None)
cli = Forecast.from_traces(paths, [2, 4], capacity=4 << 30, device=torch.cuda.current_device())
both = ("gpumem", "native")
out(api=[fc.largest(allocator=a) for a in both], cli=[cli.largest(allocator=a) for a in both])
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
@pytest.mark.parametrize("allocator", ["native", "gpumem"])
def test_forecast_command_agrees_with_forecast_on_gpu(allocator):
    setup = "gpumem.install()" if allocator == "gpumem" else ""
    r = run_python(FORECAST.format(setup=setup), PRELUDE)
    assert r["api"] == r["cli"], r
