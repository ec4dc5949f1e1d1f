"""Spill on a real GPU: host pages behind the heap's own addresses, through gpumem.install().

A heap capped at 2 GiB with spill on holds 3 GiB of tensors of known values; kernels (sums, a matmul)
read them where they lie; once some are freed the spilled pages come back to the device, and every
value is intact.  A tensor larger than the cap lies on the host.  With spill off the same program runs
out of memory, as it does during a CUDA graph capture with spill on; past the host limit it runs out of
memory too, saying what is spilled.  Each case runs in a fresh interpreter; skipped without torch or a
CUDA GPU, and when this gpumem has no spill option.
"""

import json
import re

import pytest

import gpumem.torch
from test_gpu_torch import gpu_test, run_py

# The spill mechanism's names, in one place.
NAMES = {
    "option": "spill",  # install(spill="4GiB"); absent or 0: off
    "choice_option": "spill_choice",
    "choices": ["old", "new"],
    "spilled_current": "spilled_bytes.all.current",
    "spilled_peak": "spilled_bytes.all.peak",
    "spills": "num_spills",
    "returns": "num_unspills",
    "unspill": "unspill",  # gpumem.unspill(), else gpumem._C.unspill(), else the heap's method
    "location": ["location", "host"],  # a snapshot segment of host pages: segment["location"] == "host"
    "oom_spill_off": "",  # a regex the OOM text with spill off must match too ("": only torch's prefix)
    "oom_past_limit": "spill",  # a regex the OOM text past the host limit must match
}

HAS_SPILL = NAMES["option"] in gpumem.torch.OPTION_NAMES


def spill_test(f):
    """A GPU test of spill: skipped without CUDA, and without the spill option in this gpumem."""
    return pytest.mark.skipif(not HAS_SPILL, reason="this gpumem has no spill option")(gpu_test(f))


# The child's helpers: 128 MiB int64 tensors whose values are their global positions, the statistics,
# and the snapshot's host segments.
HELPERS = """
torch.backends.cuda.matmul.allow_tf32 = False
MiB, GiB = 1 << 20, 1 << 30
PER = 128 * MiB // 8  # int64 elements of one 128 MiB tensor
def make(i):
    return torch.arange(i * PER, (i + 1) * PER, dtype=torch.int64, device="cuda")
def intact(i, x):
    return torch.equal(x.cpu(), torch.arange(i * PER, (i + 1) * PER, dtype=torch.int64))
def summed(i, x):  # a kernel over all of x, wherever its pages lie
    return int(x.sum()) == PER * (2 * i * PER + PER - 1) // 2
def stat(key):
    return torch.cuda.memory_stats().get(N[key])
def host_segments():
    key, value = N["location"]
    return sum(1 for s in torch.cuda.memory_snapshot() if s.get(key) == value)
def on_host(x):  # whether any of x's bytes lie in a host segment
    key, value = N["location"]
    lo, hi = x.data_ptr(), x.data_ptr() + x.numel() * x.element_size()
    return any(s["address"] < hi and lo < s["address"] + s["total_size"]
               for s in torch.cuda.memory_snapshot() if s.get(key) == value)
def unspill():  # gpumem's public function, else the extension's, else the heap's method
    fn = getattr(gpumem, N["unspill"], None) or getattr(gpumem._C, N["unspill"], None)
    return fn() if fn else getattr(gpumem._C.registry_heap(0), N["unspill"])()
def fill(count):
    xs, oom = [], ""
    try:
        for i in range(count):
            xs.append(make(i))
        torch.cuda.synchronize()
    except torch.OutOfMemoryError as e:
        oom = str(e)
    return xs, oom
"""


def run_spill(code, **options):
    """code in a fresh interpreter, after gpumem.install(cap="2GiB", **options) and HELPERS."""
    head = f"N = json.loads({json.dumps(json.dumps(NAMES))})\ngpumem.install(cap='2GiB', **{options!r})\n"
    return run_py(head + HELPERS + code)


SPILL_AND_RETURN = """
xs, oom = fill(24)  # 3 GiB under a 2 GiB cap
a = (torch.arange(2048 * 2048, device="cuda", dtype=torch.float32) % 7).reshape(2048, 2048)
b = (torch.arange(2048 * 2048, device="cuda", dtype=torch.float32) % 5).reshape(2048, 2048)
c = a @ b  # integers whose sums stay below 2**24: exact in any order
res = dict(oom=oom, spilled=stat("spilled_current"), spills=stat("spills"), host_segments=host_segments())
res["matmul"] = torch.equal(c.cpu(), a.cpu() @ b.cpu())
res["sums"] = sum(summed(i, x) for i, x in enumerate(xs))
res["intact"] = sum(intact(i, x) for i, x in enumerate(xs))
# 1.5 GiB freed, all of it tensors on the device: the spilled ones stay, and the device has room for
# every spilled page again (which tensors spilled depends on the choice and on placement)
kept = [(i, x) for i, x in enumerate(xs) if on_host(x)]
kept += [(i, x) for i, x in enumerate(xs) if not on_host(x)][: 12 - len(kept)]
res["kept_spilled"] = sum(1 for i, x in kept if on_host(x))
del xs
torch.cuda.empty_cache()
unspill()
res.update(after=stat("spilled_current"), peak=stat("spilled_peak"), returns=stat("returns"))
res["host_segments_after"] = host_segments()
res["kept"] = len(kept)
res["sums_after"] = sum(summed(i, x) for i, x in kept)
res["intact_after"] = sum(intact(i, x) for i, x in kept)
res["matmul_after"] = torch.equal((a @ b).cpu(), c.cpu()) and torch.equal(c.cpu(), a.cpu() @ b.cpu())
gpumem._C.registry_heap(0).check()
out(**res)
"""


@spill_test
@pytest.mark.parametrize("choice", NAMES["choices"])
def test_spilled_tensors_compute_and_come_back_intact(choice):
    r = run_spill(SPILL_AND_RETURN, **{NAMES["option"]: "4GiB", NAMES["choice_option"]: choice})
    assert r["oom"] == "", r
    assert r["spilled"] >= 1 << 30 and r["spills"] >= 1 and r["host_segments"] >= 1, r  # 3 GiB live, 2 on the device
    assert r["matmul"] and r["sums"] == 24 and r["intact"] == 24, r
    # the tensors kept include every spilled one (8 to 12 of 128 MiB), which must all come back
    assert r["kept"] == 12 and r["kept_spilled"] >= 8, r
    assert r["after"] == 0 and r["host_segments_after"] == 0 and r["returns"] >= 1, r
    assert 1 << 30 <= r["peak"] <= 4 << 30, r
    assert r["matmul_after"] and r["sums_after"] == 12 and r["intact_after"] == 12, r


LARGER_THAN_THE_CAP = """
n = 3 * GiB // 8
x = torch.arange(n, dtype=torch.int64, device="cuda")  # one 3 GiB tensor under a 2 GiB cap
res = dict(spilled=stat("spilled_current"), sum=int(x.sum()) == n * (n - 1) // 2)
res["intact"] = torch.equal(x.cpu(), torch.arange(n, dtype=torch.int64))
del x
torch.cuda.synchronize()
out(after=stat("spilled_current"), **res)
"""


@spill_test
def test_a_tensor_larger_than_the_cap_lies_on_the_host():
    r = run_spill(LARGER_THAN_THE_CAP, **{NAMES["option"]: "4GiB"})
    assert r["spilled"] >= 1 << 30 and r["sum"] and r["intact"], r
    assert r["after"] == 0, r  # freed: the host holds only what is live


OUT_OF_MEMORY = """
xs, oom = fill(24)
out(count=len(xs), oom=oom, intact=sum(intact(i, x) for i, x in enumerate(xs)), spilled=stat("spilled_peak"))
"""


@spill_test
def test_spill_off_runs_out_of_memory_as_before():
    r = run_spill(OUT_OF_MEMORY)
    assert r["oom"].startswith("CUDA out of memory."), r
    assert re.search(NAMES["oom_spill_off"], r["oom"], re.I), r
    assert r["count"] <= 16 and r["intact"] == r["count"] and not r["spilled"], r


@spill_test
def test_past_the_host_limit_out_of_memory_says_what_is_spilled():
    r = run_spill(OUT_OF_MEMORY, **{NAMES["option"]: "512MiB"})
    assert r["oom"].startswith("CUDA out of memory."), r
    assert re.search(NAMES["oom_past_limit"], r["oom"], re.I), r
    # Past the 2 GiB cap by at least one tensor, never past the 512 MiB host limit; what was made is intact.
    assert 17 <= r["count"] <= 20 and r["intact"] == r["count"], r
    assert 0 < r["spilled"] <= 512 << 20, r


CAPTURE = """
x = torch.ones(1 << 20, device="cuda")
keep, _ = fill(12)  # 1.5 GiB of the 2 GiB cap
s = torch.cuda.Stream()
g = torch.cuda.CUDAGraph()
oom = ""
try:
    with torch.cuda.graph(g, stream=s):
        y = x * 2
        big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError as e:
    oom = str(e)
del g
torch.cuda.synchronize()
during = stat("spilled_peak")
big = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # the same request, no capture: spilled
big.fill_(7)
torch.cuda.synchronize()
out(oom=oom, during=during, after=stat("spilled_current"), big=int(big[-1]),
    intact=sum(intact(i, k) for i, k in enumerate(keep)))
"""


@spill_test
def test_no_spill_during_a_graph_capture():
    r = run_spill(CAPTURE, **{NAMES["option"]: "4GiB"})
    assert r["oom"].startswith("CUDA out of memory."), r
    assert not r["during"], r
    assert r["after"] > 0 and r["big"] == 7 and r["intact"] == 12, r


# ---- through the heap torch uses, as the core counts it -------------------------------------


@gpu_test
def test_gpu_a_request_larger_than_the_cap_is_spilled():
    r = run_py(
        """
        gpumem.install(cap="2GiB", spill="4GiB")
        small = torch.empty(512, dtype=torch.uint8, device="cuda")
        x = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
        x[-1] = 7
        torch.cuda.synchronize()
        out(value=int(x[-1]), spilled=gpumem._C.registry_heap(0).stats()["spilled_bytes.all.current"])
        """
    )
    assert r == {"value": 7, "spilled": 3 << 30}


@gpu_test
def test_gpu_a_loop_past_the_cap_moves_nothing_after_its_first_steps():
    """Weights of 1 GiB and 1.6 GiB of activations per step under a 2 GiB cap
    (1.3x): after the first steps no spill, no return; contents intact."""
    r = run_py(
        """
        gpumem.install(cap="2GiB", spill="4GiB")
        h = gpumem._C.registry_heap(0)
        w = [torch.full((64 << 20,), float(i), device="cuda") for i in range(4)]  # 4 x 256 MiB
        rows = []
        for step in range(6):
            s0 = h.stats()
            acts = [torch.ones(32 << 20, device="cuda") for _ in range(13)]  # 13 x 128 MiB
            total = sum(float(a[0]) for a in acts)
            del acts
            torch.cuda.synchronize()
            s1 = h.stats()
            rows.append([s1["num_spills"] - s0["num_spills"], s1["num_unspills"] - s0["num_unspills"]])
        ok = all(float(t.min()) == float(t.max()) == float(i) for i, t in enumerate(w))
        spilled = h.stats()["spilled_bytes.all.current"]
        torch.cuda.empty_cache()
        out(rows=rows, ok=ok, spilled=spilled, after=h.stats()["spilled_bytes.all.current"])
        """
    )
    assert r["ok"] and r["spilled"] > 0 and r["after"] == 0
    assert r["rows"][2:] == [[0, 0]] * 4
