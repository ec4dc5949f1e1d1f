"""The pressure-aware policy on a real GPU: the driver's free memory is what gives the heap room.

The workload of tests/unit/test_policy.py (large blocks between long-lived small ones, the large ones freed,
then a larger request) on CUDA heaps: with the device's room, no remap and no device synchronisation,
a large request grown in a few allocations, and the contents of every live block intact; under a cap
near peak live, or with pressure 0, the heap defragments and fits.  Then torch through gpumem.install():
the same after warm-up, and tight with GPUMEM_CONF=pressure:0.  Each case runs in a fresh interpreter;
skipped without torch or a CUDA GPU.
"""

import inspect
import textwrap

from test_gpu_torch import gpu_test, run_py
from helpers import policy_counters, policy_workload

# unit/test_policy.py's workload and counters, defined in the child (indented as the code run after them)
WORKLOAD = textwrap.indent(
    "MiB = 1 << 20\n"
    + inspect.getsource(policy_workload)
    + inspect.getsource(policy_counters)
    + "workload, counters = policy_workload, policy_counters\n",
    " " * 8,
)


@gpu_test
def test_cuda_room_and_pressure():
    r = run_py(
        WORKLOAD
        + """
        res = {}
        for label, kw in (("room", {}), ("cap", {"cap": 700 * MiB}), ("tight", {"pressure": 0})):
            h = gpumem.Heap(device="cuda", **kw)
            keep = workload(h)
            res[label] = counters(h)
            h.check()
            for p in keep:
                h.free(p)
            h.close()
        h = gpumem.Heap(device="cuda")
        small = h.malloc(3 * MiB)
        before = h.stats()["num_device_alloc"]
        big = h.malloc(256 * MiB)
        res["big_allocs"] = h.stats()["num_device_alloc"] - before
        h.check()
        h.free(big)
        h.free(small)
        h.empty_cache()
        res["after_empty"] = h.stats()["reserved_bytes.all.current"]
        h.close()
        out(**res)
    """
    )
    assert r["room"]["num_remaps"] == 0 and r["room"]["num_sync_all_streams"] == 0, r
    for label in ("cap", "tight"):
        assert r[label]["num_remaps"] >= 3 and r[label]["num_sync_all_streams"] >= 3, r
        assert r[label]["num_ooms"] == 0, r
    assert 3 <= r["big_allocs"] <= 5, r
    assert r["after_empty"] == 0, r


TORCH_LOOP = """
        gpumem.install()
        import random
        rng = random.Random(5)
        MiB = 1 << 20
        keep = [torch.ones(MiB // 4, device="cuda") for _ in range(4)]
        held = []
        def step():
            # Large tensors of random sizes between small ones that live until the next step.
            global held
            xs, ys = [], []
            for _ in range(12):
                xs.append(torch.full((rng.randint(8, 96) * MiB // 4,), 1.0, device="cuda"))
                ys.append(torch.full((MiB // 4,), 2.0, device="cuda"))
            s = sum(float(x[-1]) for x in xs) + sum(float(y[0]) for y in held)
            del xs
            held = ys
            return s
        step()
        for _ in range(4):
            step()
        st0 = torch.cuda.memory_stats()
        bad = sum(step() != 36.0 for _ in range(30))
        st1 = torch.cuda.memory_stats()
        keys = ("num_remaps", "num_sync_all_streams", "num_device_alloc")
        out(bad=bad, after=[st1[k] - st0[k] for k in keys], whole=[st1[k] for k in keys])
"""


@gpu_test
def test_torch_with_room_makes_no_sync_after_warmup():
    room = run_py(TORCH_LOOP)
    tight = run_py(TORCH_LOOP, env={"GPUMEM_CONF": "pressure:0"})
    assert room["bad"] == 0 and tight["bad"] == 0
    assert room["whole"][0] == 0 and room["whole"][1] == 0, room  # no remap, no sync at all
    assert tight["whole"][0] >= 1 and tight["whole"][1] >= 1, tight  # the same loop defragments when tight
