"""Failed driver calls on a real GPU (GPUMEM_CUDA_FAULTS, csrc/device/cuda.c).

Each case makes one kind of CUDA call fail once, at its first call in one phase
of a workload -- growth, defragmentation, empty_cache, or the events of a side
stream -- and checks that the heap stays consistent (check()), that the failure
is a clear error or is absorbed, that the next allocation succeeds, and that
after everything is freed the device gets all its memory back.  A second test
has another process grab memory while gpumem grows: out of memory or success,
never a crash or a leak.

Every case runs in its own interpreter: the variable is read when a CUDA
device is opened, and a crash must fail one case, not the run.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO as _REPO

REPO = str(_REPO)

SCENARIO = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {repo!r})
    import gpumem

    MiB = 1 << 20
    OP, PHASE = sys.argv[1], sys.argv[2]
    PHASES = ["growth", "defrag", "empty_cache", "streams"]

    def side_stream():
        import torch
        return torch.cuda.Stream(), torch.cuda.current_stream()

    def workload(h, outcomes, at_phase=None):
        live = []

        def step(name, fn, *args, **kw):
            if at_phase is not None:
                at_phase(name)
            try:
                r = fn(*args, **kw)
                outcomes.append((name, "ok", ""))
                return r
            except (gpumem.OutOfMemoryError, gpumem.DeviceError) as e:
                outcomes.append((name, type(e).__name__, str(e).splitlines()[0]))
                return None
            finally:
                h.check()

        def malloc(phase, size, stream=0):
            p = step(phase, h.malloc, size, stream=stream)
            if p is not None:
                live.append(p)
            return p

        for _ in range(8):
            malloc("growth", 8 * MiB)
        # Defragmentation: free every other block, cap the heap at what it
        # holds, and ask for more than any free run: pages must be remapped.
        for p in live[::2]:
            h.free(p)
        del live[::2]
        h.set_cap(h.stats()["reserved_bytes.all.current"])
        malloc("defrag", 16 * MiB)
        h.set_cap(0)
        for p in live[1:]:
            h.free(p)
        del live[1:]
        step("empty_cache", h.empty_cache)
        s1, s0 = side_stream()
        q = malloc("streams", 4 * MiB)
        if q is not None:
            h.record_stream(q, s1.cuda_stream)
            live.remove(q)
            h.free(q)                     # an event on the side stream
            s1.synchronize()
            malloc("streams", 4 * MiB)    # the event is queried
        return live

    # 1. A clean run counts the calls of OP made before the phase starts (calls are
    # counted by the fault wrapper, there only when GPUMEM_CUDA_FAULTS is set: a
    # schedule that never comes due arms it).
    before = {{}}
    os.environ["GPUMEM_CUDA_FAULTS"] = f"{{OP}}:{{1 << 62}}"
    # pressure=0: a tight heap, whatever the device has free, so that the
    # defragmentation phase has single pages to move (with room, growth comes
    # as multi-page allocations that a live block pins in place).
    h = gpumem.Heap(device="cuda", pressure=0)
    clean = []
    def mark(name):
        before.setdefault(name, h.cuda_fault_calls(OP)[0])
    live = workload(h, clean, mark)
    for p in live:
        h.free(p)
    h.empty_cache()
    in_phase = h.cuda_fault_calls(OP)[0] - before[PHASE] if PHASE == PHASES[-1] else \\
        before[PHASES[PHASES.index(PHASE) + 1]] - before[PHASE]
    h.close()
    del os.environ["GPUMEM_CUDA_FAULTS"]
    # What the device has free after a clean run: the driver keeps some memory
    # of its own after the first heap's mappings (tens of MiB on an H100), so
    # the faulty run is compared with this, not with the very start.
    h0 = gpumem.Heap(device="cuda")
    free0 = h0.mem_info()[0]
    h0.close()
    if in_phase == 0:
        print(json.dumps({{"applicable": False}}))
        sys.exit(0)

    # 2. The same run with the first call of OP in PHASE failing.
    os.environ["GPUMEM_CUDA_FAULTS"] = f"{{OP}}:{{before[PHASE] + 1}}"
    h = gpumem.Heap(device="cuda", pressure=0)
    faulty = []
    live = workload(h, faulty)
    calls, fired = h.cuda_fault_calls(OP)
    h.check()
    # The next allocation succeeds.
    nxt = h.malloc(32 * MiB)
    h.check()
    h.free(nxt)
    for p in live:
        h.free(p)
    h.empty_cache()
    st = h.stats()
    h.close()
    del os.environ["GPUMEM_CUDA_FAULTS"]
    h2 = gpumem.Heap(device="cuda")
    free1 = h2.mem_info()[0]
    h2.close()
    print(json.dumps({{"applicable": True, "fired": fired, "calls": calls, "clean": clean, "faulty": faulty,
                      "reserved_after": st["reserved_bytes.all.current"],
                      "device_errors": st["num_device_errors"], "free_before": free0, "free_after": free1}}))
""")

CASES = [
    (op, phase)
    for phase, ops in (
        ("growth", ("create", "map", "set_access")),
        ("defrag", ("synchronize", "unmap", "map", "set_access")),
        ("empty_cache", ("synchronize", "unmap", "release")),
        ("streams", ("event_create", "event_record", "event_query")),
    )
    for op in ops
]


def run(code, *args, timeout=300, env=None):
    p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert p.returncode == 0, f"exit {p.returncode}\nstdout: {p.stdout[-3000:]}\nstderr: {p.stderr[-3000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("op,phase", CASES, ids=[f"{p}-{o}" for o, p in CASES])
def test_one_failed_call(op, phase):
    r = run(SCENARIO.format(repo=REPO), op, phase)
    if not r["applicable"]:
        pytest.fail(f"the workload makes no {op} call during {phase}: the case tests nothing")
    assert r["fired"] == 1, r
    assert all(o == "ok" for _, o, _ in r["clean"]), r["clean"]
    failed = [(name, kind, msg) for name, kind, msg in r["faulty"] if kind != "ok"]
    # At most the one step that met the fault fails, in its phase, with a
    # message that names the failed call.
    assert len(failed) <= 1, failed
    for name, kind, msg in failed:
        assert name == phase, failed
        if kind == "OutOfMemoryError":
            assert msg.startswith("CUDA out of memory."), msg
        else:
            assert "injected by GPUMEM_CUDA_FAULTS" in msg, msg
    if op in ("map", "set_access", "unmap", "release", "synchronize"):
        assert r["device_errors"] >= 1, r
    assert r["reserved_after"] == 0, r
    # Every page went back to the driver: as much is free after the faulty run
    # as after the clean one (the CUDA context may move by a page or two).
    assert abs(r["free_before"] - r["free_after"]) <= 4 << 20, (r["free_before"], r["free_after"])


GRABBER = textwrap.dedent("""
    import sys, time, torch
    chunk = 256 << 20
    held = []
    t_end = time.time() + float(sys.argv[1])
    while time.time() < t_end:
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            time.sleep(0.01)
            if held and len(held) % 3 == 0:
                held.pop()           # give a little back, take it again
    print(len(held), flush=True)
""")

GROWER = textwrap.dedent("""
    import json, subprocess, sys, time
    sys.path.insert(0, {repo!r})
    import gpumem
    MiB = 1 << 20
    h = gpumem.Heap(device="cuda")
    free0 = h.mem_info()[0]
    other = subprocess.Popen([sys.executable, "-c", {grabber!r}, "6"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)                       # let it start taking memory
    live, ooms, rounds = [], 0, 0
    t_end = time.time() + 5
    while time.time() < t_end:
        rounds += 1
        try:
            live.append(h.malloc(64 * MiB))
        except gpumem.OutOfMemoryError as e:
            assert str(e).startswith("CUDA out of memory."), e
            ooms += 1
            for p in live[: len(live) // 2]:
                h.free(p)
            del live[: len(live) // 2]
        h.check()
    other.wait(timeout=60)
    for p in live:
        h.free(p)
    h.empty_cache()
    h.check()
    st = h.stats()
    h.close()
    h2 = gpumem.Heap(device="cuda")
    free1 = h2.mem_info()[0]
    h2.close()
    print(json.dumps({{"rounds": rounds, "ooms": ooms, "other_rc": other.returncode,
                      "reserved_after": st["reserved_bytes.all.current"], "free_before": free0,
                      "free_after": free1}}))
""")


@pytest.mark.gpu
def test_second_process_grabs_memory_while_gpumem_grows():
    r = run(GROWER.format(repo=REPO, grabber=GRABBER))
    assert r["other_rc"] == 0, r
    assert r["rounds"] > 0 and r["reserved_after"] == 0, r
    assert abs(r["free_before"] - r["free_after"]) <= 4 << 20, r


@pytest.mark.parametrize("spec", ["bogus:1", "create:0", "map:2x", "create:1:0", "create"])
def test_malformed_fault_spec_refuses_to_open_the_device(spec):
    """No GPU needed: the variable is checked before the driver is loaded, so a
    typo can never run a test without the faults it asked for."""
    code = (
        "import gpumem\ntry:\n    gpumem.Heap(device='cuda')\nexcept gpumem.DeviceError as e:\n"
        "    print(e)\nelse:\n    print('opened')\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env=dict(os.environ, GPUMEM_CUDA_FAULTS=spec),
    )
    assert p.returncode == 0, p.stderr
    assert f"GPUMEM_CUDA_FAULTS: bad entry '{spec}'" in p.stdout, p.stdout
