"""gpumem as PyTorch's allocator.

GPU tests (marker `gpu`) run each case in a fresh Python process: torch's
allocator can be chosen once per process, before CUDA starts, and an OOM or a
cap must not leak into the next case.  They skip cleanly without torch or CUDA.
The CPU tests at the end check what needs no GPU: options, GPUMEM_CONF, import
without torch, the shape of the routed memory API.
"""

import json
import os
import subprocess
import sys

import pytest

from helpers import OUT, REPO, cuda_devices, run_python

# Zero only without a GPU; a broken CUDA install raises here (see conftest).
N_CUDA = cuda_devices()[0]


def gpu_test(f=None, *, devices=1):
    """A test that needs torch with a CUDA GPU (`devices` of them): marked `gpu`, skipped without."""
    reason = "needs torch with a CUDA GPU" if devices == 1 else f"needs {devices} CUDA devices"

    def mark(f):
        return pytest.mark.gpu(pytest.mark.skipif(N_CUDA < devices, reason=reason)(f))

    return mark(f) if f else mark


PRELUDE = """
import json, os, sys
import torch
import gpumem
"""

DETERMINISM = """
torch.manual_seed(0)
torch.use_deterministic_algorithms(True)
torch.backends.cudnn.benchmark = False
torch.backends.cudnn.deterministic = True
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
"""


def run_py(code, env=None, timeout=900):
    """Run code in a fresh interpreter; return the dict it printed with out(...)."""
    env = {"CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG", ":4096:8"), **(env or {})}
    return run_python(code, PRELUDE, env=env, timeout=timeout)


# ---- GPU ---------------------------------------------------------------------------------


@gpu_test
def test_gpumem_disable_leaves_torchs_allocator_serving():
    """GPUMEM_DISABLE=1: install() changes nothing, and torch's own caching allocator serves CUDA."""
    r = run_py(
        """
        st = gpumem.install(cap="1GiB")
        x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        stats = torch.cuda.memory_stats()  # raises under a pluggable allocator without gpumem's routing
        out(installed=st["installed"], disabled=st["disabled"], active=gpumem.status()["allocator_active"],
            backend=torch.cuda.memory.get_allocator_backend(), allocated=stats["allocated_bytes.all.current"],
            heaps=len(gpumem._C.registry_devices()))
        """,
        env={"GPUMEM_DISABLE": "1"},
    )
    assert r == {
        "installed": False,
        "disabled": True,
        "active": False,
        "backend": "native",
        "allocated": 64 << 20,
        "heaps": 0,
    }, r


@gpu_test
def test_many_sizes_and_kernels():
    r = run_py("""
        gpumem.install()
        import random
        random.seed(1)
        sizes = [1, 3, 511, 512, 513, 4095, 65536, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, (2 << 20) - 7,
                 (2 << 20) + 9, (10 << 20) + 3, (100 << 20) + 7, (1 << 30) + 5]
        sizes += [random.choice([1, 7, 100, 5000]) * random.randint(1, 4096) for _ in range(300)]
        live, bad = [], 0
        for i, n in enumerate(sizes):
            t = torch.full((n,), i % 251, dtype=torch.uint8, device="cuda")
            t2 = (t.to(torch.int32) * 3 + 1)
            if int(t2.sum()) != n * ((i % 251) * 3 + 1):
                bad += 1
            live.append((i, t))
            if random.random() < 0.5 and live:
                live.pop(random.randrange(len(live)))
        # every surviving tensor still holds its own value: no two overlapped
        for i, t in live:
            if int(t.to(torch.int64).sum()) != t.numel() * (i % 251):
                bad += 1
        ptrs = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for _, t in live)
        overlap = sum(1 for a, b in zip(ptrs, ptrs[1:]) if a[1] > b[0])
        torch.cuda.synchronize()
        gpumem._C.registry_heap(0).check()
        snap = gpumem._C.registry_heap(0).snapshot()
        inside = all(snap["va_base"] <= t.data_ptr() < snap["va_base"] + snap["va_size"] for _, t in live)
        out(bad=bad, overlap=overlap, inside=inside, n=len(sizes), live=len(live))
    """)
    assert r["bad"] == 0 and r["overlap"] == 0 and r["inside"], r


TRAIN = (
    """
import sys
which, steps, use = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if use == "gpumem":
    gpumem.install()
"""
    + DETERMINISM
    + """
if which == "gpt2":
    from transformers import GPT2Config, GPT2LMHeadModel
    m = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12)).cuda()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    g = torch.Generator(device="cpu").manual_seed(1)
    losses = []
    for step in range(steps):
        x = torch.randint(0, 50257, (4, 128 + 64 * (step % 3)), generator=g).cuda()
        loss = m(input_ids=x, labels=x).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
else:
    import torchvision
    m = torchvision.models.resnet50().cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator(device="cpu").manual_seed(1)
    losses = []
    for step in range(steps):
        s = [160, 224][step % 2]
        x = torch.randn(16, 3, s, s, generator=g).cuda(); y = torch.randint(0, 1000, (16,), generator=g).cuda()
        loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
st = torch.cuda.memory_stats()
out(losses=losses, peak=st["allocated_bytes.all.peak"], backend=gpumem.status()["allocator_active"])
"""
)


@gpu_test
@pytest.mark.parametrize("model,steps", [("gpt2", 6), ("resnet50", 4)])
def test_training_losses_equal_native(model, steps, tmp_path):
    pytest.importorskip("transformers" if model == "gpt2" else "torchvision")
    script = tmp_path / "train.py"
    script.write_text(OUT + PRELUDE + TRAIN)

    def go(use):
        e = dict(os.environ, PYTHONPATH=str(REPO), CUBLAS_WORKSPACE_CONFIG=":4096:8")
        e.pop("GPUMEM_CONF", None)
        p = subprocess.run(
            [sys.executable, str(script), model, str(steps), use], env=e, capture_output=True, text=True, timeout=900
        )
        lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
        assert p.returncode == 0 and lines, p.stderr[-4000:]
        return json.loads(lines[-1][7:])

    native, ours = go("native"), go("gpumem")
    assert ours["backend"] and not native["backend"]
    assert len(ours["losses"]) == steps
    assert ours["losses"] == native["losses"], (native["losses"], ours["losses"])
    print(model, "losses", ours["losses"], "peak native", native["peak"], "gpumem", ours["peak"])


@gpu_test
def test_record_stream_keeps_block_until_side_stream_is_done():
    r = run_py("""
        gpumem.install()
        n = 8 << 20
        side = torch.cuda.Stream()
        # control: without record_stream the freed block is reused at once on the same stream
        a = torch.empty(n, dtype=torch.uint8, device="cuda"); pa = a.data_ptr(); del a
        b = torch.empty(n, dtype=torch.uint8, device="cuda"); control_reused = b.data_ptr() == pa; del b
        torch.cuda.synchronize()

        x = torch.zeros(n, dtype=torch.uint8, device="cuda")
        torch.cuda.current_stream().synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(300_000_000)      # keep the side stream busy, then write x
            x.fill_(7)
        x.record_stream(side)
        px = x.data_ptr()
        del x
        y = torch.full((n,), 3, dtype=torch.uint8, device="cuda")   # default stream, same size
        reused_while_busy = y.data_ptr() == px
        side_busy = not side.query()
        side.synchronize()
        y_intact = int((y == 3).all())
        torch.cuda.synchronize()
        # once the side stream is done, the block may serve new allocations again
        z = [torch.empty(n, dtype=torch.uint8, device="cuda") for _ in range(3)]
        reused_after = any(t.data_ptr() == px for t in z)
        out(control_reused=control_reused, reused_while_busy=reused_while_busy, side_busy=side_busy,
            y_intact=y_intact, reused_after=reused_after,
            record_calls=gpumem._C._torch_counters()["record_stream_calls"])
    """)
    assert r["control_reused"], "the control must show reuse, else this test proves nothing"
    assert r["side_busy"], "the side stream finished too early for the test to mean anything"
    assert not r["reused_while_busy"] and r["y_intact"] == 1, r
    assert r["reused_after"], r
    assert r["record_calls"] >= 1


@gpu_test
def test_empty_cache_lowers_device_usage():
    r = run_py("""
        gpumem.install()
        torch.ones(1, device="cuda")
        ts = [torch.empty(256 << 20, dtype=torch.uint8, device="cuda") for _ in range(16)]   # 4 GiB
        del ts
        free_held, total = torch.cuda.mem_get_info()
        reserved_held = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()
        free_after, _ = torch.cuda.mem_get_info()
        out(gained=free_after - free_held, reserved_held=reserved_held, reserved_after=torch.cuda.memory_reserved(),
            calls=gpumem._C._torch_counters()["empty_cache_calls"])
    """)
    assert r["reserved_held"] >= 4 << 30
    assert r["gained"] >= (4 << 30) - (64 << 20), r
    assert r["reserved_after"] <= 4 << 20, r
    assert r["calls"] == 1


@gpu_test
def test_cap_from_fraction_and_from_conf():
    r = run_py("""
        gpumem.install()
        free, total = torch.cuda.mem_get_info()
        torch.cuda.set_per_process_memory_fraction(0.10)
        ok = torch.empty(int(total * 0.08), dtype=torch.uint8, device="cuda")
        try:
            torch.empty(int(total * 0.05), dtype=torch.uint8, device="cuda")
            refused = False
        except torch.OutOfMemoryError as e:
            refused = str(e).startswith("CUDA out of memory.")
        reserved = torch.cuda.memory_reserved()
        frac = torch.cuda.get_per_process_memory_fraction()
        del ok
        torch.cuda.set_per_process_memory_fraction(1.0)
        big = torch.empty(int(total * 0.3), dtype=torch.uint8, device="cuda")
        out(refused=refused, reserved=reserved, total=total, frac=frac, lifted=big.numel() > 0)
    """)
    assert r["refused"] and r["lifted"], r
    assert r["reserved"] <= 0.10 * r["total"] + (2 << 20)
    assert abs(r["frac"] - 0.10) < 0.01
    r = run_py(
        """
        gpumem.install()
        try:
            torch.empty(3 << 30, dtype=torch.uint8, device="cuda"); refused = False
        except RuntimeError as e:
            refused = "CUDA out of memory." in str(e)
        a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
        out(refused=refused, cap=gpumem._C.registry_heap(0).get_cap(), oom_type=gpumem._C._torch_set_oom())
    """,
        env={"GPUMEM_CONF": "cap:2GiB,oom:runtime"},
    )
    assert r["refused"] and r["cap"] == 2 << 30 and r["oom_type"] == "runtime", r


@gpu_test
def test_oom_raises_then_context_stays_healthy():
    r = run_py("""
        gpumem.install()
        free, total = torch.cuda.mem_get_info()
        keep = torch.ones(1 << 28, device="cuda")          # 1 GiB live
        res = {}
        try:
            torch.empty(total, dtype=torch.uint8, device="cuda")
        except Exception as e:
            res["type"] = type(e).__name__
            res["is_torch_oom"] = isinstance(e, torch.OutOfMemoryError)
            res["msg"] = str(e)
        # the autograd thread: backward needs a second copy that the cap refuses
        S = 1 << 30
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + S + S // 2) / total)
        w = torch.zeros(S // 4, device="cuda", requires_grad=True)
        try:
            w.sum().backward(); res["bwd"] = "no error"
        except Exception as e:
            res["bwd"] = type(e).__name__; res["bwd_torch_oom"] = isinstance(e, torch.OutOfMemoryError)
            res["bwd_msg"] = str(e)[:60]
        del w
        torch.cuda.set_per_process_memory_fraction(1.0)
        y = torch.randn(2048, 2048, device="cuda")
        res["after"] = float((y @ y.t()).diagonal().min()) > 0
        torch.cuda.synchronize()
        res["keep_ok"] = float(keep.sum()) == float(1 << 28)
        res["ooms"] = gpumem._C._torch_counters()["ooms"]
        res["stats_ooms"] = torch.cuda.memory_stats()["num_ooms"]
        out(**res)
    """)
    assert r["msg"].startswith("CUDA out of memory."), r["msg"]
    for word in (
        "Tried to allocate",
        "total capacity",
        "is free",
        "allocated by PyTorch",
        "reserved by gpumem",
        "largest block",
        "other processes",
    ):
        assert word in r["msg"], (word, r["msg"])
    assert r["is_torch_oom"], r["type"]
    assert r["bwd"] != "no error" and r["bwd_msg"].startswith("CUDA out of memory."), r
    assert r["bwd_torch_oom"], r
    assert r["after"] and r["keep_ok"] and r["ooms"] == 2, r
    print("OOM message:", r["msg"])


@gpu_test
def test_torch_memory_api_routed(tmp_path):
    native = run_py("""
        torch.ones(1, device="cuda")
        out(keys=sorted(torch.cuda.memory_stats()))
    """)
    dump = tmp_path / "snap.pickle"
    r = run_py(f"""
        import pickle
        gpumem.install()
        res = {{}}
        res["before_cuda"] = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=1000)
        a = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        b = torch.empty(1000, dtype=torch.uint8, device="cuda")
        res["allocated"] = torch.cuda.memory_allocated()
        res["reserved"] = torch.cuda.memory_reserved()
        res["keys"] = sorted(torch.cuda.memory_stats())
        del a
        res["max_allocated"] = torch.cuda.max_memory_allocated()
        res["max_reserved"] = torch.cuda.max_memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        res["max_after_reset"] = torch.cuda.max_memory_allocated()
        res["now"] = torch.cuda.memory_allocated()
        res["summary"] = torch.cuda.memory_summary()
        segs = torch.cuda.memory_snapshot()
        res["seg_blocks"] = [(blk["address"], blk["state"]) for s in segs for blk in s["blocks"]]
        res["b"] = b.data_ptr()
        snap = torch.cuda.memory._snapshot()
        res["traces"] = [(e["action"], e["addr"]) for e in snap["device_traces"][0]]
        torch.cuda.memory._dump_snapshot({str(dump)!r})
        res["dumped_segments"] = len(pickle.load(open({str(dump)!r}, "rb"))["segments"])
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.reset_accumulated_memory_stats()
        res["acc"] = torch.cuda.memory_stats()["allocation.all.allocated"]
        res["cpp"] = gpumem.status()["cpp_allocator"]
        gpumem.uninstall()
        try:
            res["after_uninstall"] = torch.cuda.memory_allocated()
        except RuntimeError as e:
            res["after_uninstall"] = str(e)[:80]
        gpumem.install()
        res["reinstalled"] = torch.cuda.memory_allocated()
        out(**res)
    """)
    assert r["before_cuda"] == 0
    assert r["allocated"] == (3 << 20) + 1024, r["allocated"]
    assert r["reserved"] >= r["allocated"] and r["reserved"] % (2 << 20) == 0
    missing = set(native["keys"]) - set(r["keys"])
    assert not missing, missing
    assert r["max_allocated"] == (3 << 20) + 1024 and r["max_reserved"] >= r["reserved"]
    assert r["max_after_reset"] == r["now"] == 1024
    assert "PyTorch CUDA memory summary" in r["summary"]
    assert (r["b"], "active_allocated") in [tuple(x) for x in r["seg_blocks"]]
    acts = [tuple(t) for t in r["traces"]]
    assert ("alloc", r["b"]) in acts and any(a == "free_requested" for a, _ in acts), acts[:10]
    assert r["dumped_segments"] >= 1
    assert r["acc"] == 0
    # uninstall leaves torch's pluggable allocator in place (it cannot be swapped back):
    # torch's own stats call then reaches gpumem's C++ allocator object, which still
    # serves every allocation, or, without that object, refuses as docs/torch.md says.
    if r["cpp"]:
        assert r["after_uninstall"] == r["now"], r["after_uninstall"]
    else:
        assert "does not yet support" in r["after_uninstall"], r["after_uninstall"]
    assert r["reinstalled"] == 1024


@gpu_test
def test_install_too_late_is_a_clear_error():
    r = run_py("""
        torch.ones(1, device="cuda")
        try:
            gpumem.install(); msg = "no error"
        except RuntimeError as e:
            msg = str(e)
        out(msg=msg)
    """)
    assert "too late" in r["msg"], r


@gpu_test
def test_fragmentation_scenario_native_fails_gpumem_succeeds():
    code = (REPO / "benchmarks" / "gpu_frag.py").read_text()
    assert "def scenario" in code
    res = {}
    for use in ("native", "gpumem"):
        p = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / "gpu_frag.py"), "--one", use],
            env=dict(os.environ, PYTHONPATH=str(REPO)),
            capture_output=True,
            text=True,
            timeout=900,
        )
        lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
        assert p.returncode == 0 and lines, p.stderr[-3000:]
        res[use] = json.loads(lines[-1])
    assert res["native"]["fill_fraction"] >= 0.95 and res["gpumem"]["fill_fraction"] >= 0.95, res
    assert not res["native"]["big_ok"] and res["gpumem"]["big_ok"], res
    assert res["gpumem"]["request"] <= res["gpumem"]["free_in_holes"]


@gpu_test(devices=2)
def test_two_devices_each_get_a_heap():
    r = run_py("""
        gpumem.install()
        a = torch.ones(1 << 20, device="cuda:0"); b = torch.ones(1 << 20, device="cuda:1") * 2
        out(devices=gpumem._C.registry_devices(), a=float(a.sum()), b=float(b.sum()),
            m0=torch.cuda.memory_allocated(0), m1=torch.cuda.memory_allocated(1))
    """)
    assert r["devices"] == [0, 1] and r["a"] == 1 << 20 and r["b"] == 2 * (1 << 20), r
    assert r["m0"] == 4 << 20 and r["m1"] >= 4 << 20, r


# Pages are mapped with an access descriptor for every GPU that can reach this one
# (cuMemSetAccess in csrc/device/cuda.c): cudaDeviceEnablePeerAccess does not reach
# virtual-memory mappings, so without them a.to("cuda:1") failed with "invalid argument".
@gpu_test(devices=2)
def test_two_devices_peer_copy():
    r = run_py("""
        gpumem.install()
        a = torch.ones(1 << 20, device="cuda:0"); b = torch.ones(1 << 20, device="cuda:1") * 2
        c = a.to("cuda:1") + b
        d = torch.empty(1 << 20, device="cuda:1"); d.copy_(a)   # peer copy into gpumem pages
        out(c=float(c.sum()), d=float(d.sum()))
    """)
    assert r["c"] == 3 * (1 << 20) and r["d"] == 1 << 20, r


# ---- CPU: no GPU needed ----------------------------------------------------------------------


def test_import_without_torch():
    code = "import sys; sys.modules['torch'] = None\nimport gpumem, gpumem.torch\nprint(gpumem.status()['installed'])"
    p = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True
    )
    assert p.returncode == 0 and p.stdout.strip() == "False", p.stderr
    code = "import sys; sys.modules['torch'] = None\nimport gpumem\ntry:\n gpumem.install()\nexcept RuntimeError as e: print(e)"  # noqa: E501
    p = subprocess.run(
        [sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True
    )
    assert "needs PyTorch" in p.stdout, (p.stdout, p.stderr)


def test_conf_parsing_and_options():
    from gpumem import torch as gt

    assert gt.parse_conf("cap:0.9, growth_slack:0.01") == {"cap": "0.9", "growth_slack": "0.01"}
    kw = gt.normalize_options(gt.parse_conf("cap:0.9,growth_slack:0.01,history:1000,oom:runtime"))
    assert kw["cap_fraction"] == 0.9 and kw["cap_bytes"] == 0 and kw["growth_slack"] == 0.01
    assert kw["history_entries"] == 1000 and kw["oom_mode"] == "runtime"
    assert gt.normalize_options({"cap": "60GiB"})["cap_bytes"] == 60 << 30
    assert gt.normalize_options({"cap": 1 << 30})["cap_bytes"] == 1 << 30
    assert gt.normalize_options({"cap": 1})["cap_fraction"] == 1.0
    for bad in ("cap", "cap:", "nosuch:1", ":3"):
        with pytest.raises(ValueError):
            gt.parse_conf(bad)
    for bad in ({"cap": 1.5}, {"cap": "-1GiB"}, {"growth_slack": -1}, {"history": -2}, {"oom": "x"}, {"bogus": 1}):
        with pytest.raises(ValueError):
            gt.normalize_options(bad)


def test_configure_rejects_bad_values_in_c():
    C = pytest.importorskip("gpumem._C")
    before, mode = C.registry_options(), C._torch_set_oom()
    with pytest.raises(ValueError):
        C.registry_configure(cap_fraction=2.0)
    with pytest.raises(ValueError):
        C._torch_set_oom(mode="sometimes")
    with pytest.raises(TypeError):
        C._torch_set_oom(oom_class=3)
    assert C.registry_options() == before and C._torch_set_oom() == mode
    assert C.registry_heap(0, open=False) is None  # no heap without torch allocating
    with pytest.raises(ValueError):
        C.registry_heap(-1)
    ep = C._torch_entry_points()
    assert set(ep) == {
        "alloc",
        "free",
        "empty_cache",
        "memory_fraction",
        "record_stream",
        "init",
        "begin_allocate_to_pool",
        "end_allocate_to_pool",
        "release_pool",
        "pool_begin",
        "pool_end",
        "pool_release",
        "raw_delete",
        "device_stats",
        "reset_stats",
    }
    assert len(set(ep.values())) == len(ep) and all(v > 0 for v in ep.values())


def test_exported_symbols_for_ctypes():
    import ctypes

    C = pytest.importorskip("gpumem._C")
    lib = ctypes.CDLL(C.__file__)
    ep = C._torch_entry_points()
    for name, key in (
        ("gpumem_torch_alloc", "alloc"),
        ("gpumem_torch_free", "free"),
        ("gpumem_torch_record_stream", "record_stream"),
    ):
        assert ctypes.cast(getattr(lib, name), ctypes.c_void_p).value == ep[key]


def test_nested_stats_have_native_shape():
    from helpers import FIELDS, POOLS, STAT_NAMES  # torch's names, as unit/test_core.py checks them

    from gpumem import torch as gt

    n = gt.nested_stats(0)
    for g in STAT_NAMES:
        for p in POOLS:
            assert set(n[g][p]) == set(FIELDS)
    for k in ("oversize_allocations", "oversize_segments"):
        assert set(n[k]) == set(FIELDS)
    assert n["num_oom_rejections"] == 0  # torch 2.13's key: no preemption policy, none rejected
    for k in (
        "num_alloc_retries",
        "num_ooms",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "max_split_size",
    ):
        assert k in n


def test_one_segments_conversion_in_torch_format():
    """gpumem.torch answers memory_snapshot with Snapshot.to_torch (the one
    conversion): block states as torch's memory_viz reads them, one segment per
    mapped run cut at pool boundaries, and a block crossing a mapped run is an
    error, not clipped."""
    from gpumem.snapshot import Block, Snapshot

    P = 2 << 20
    base = 1 << 40

    def snap(blocks, pages):
        return Snapshot(
            device_name="cuda:0",
            device_kind="cuda",
            va_base=base,
            top=len(pages) * P,
            page_size=P,
            blocks=blocks,
            pages=bytes(pages),
            spare_pages=0,
            cap_bytes=0,
            stats={},
        )

    s = snap(
        [
            Block(base, 1024, 1000, 7, 0, 1, "live"),
            Block(base + 1024, 1024, 900, 7, 0, 2, "pending"),
            Block(base + 2048, 2 * P - 2048, 0, 7, 0, 0, "free"),
            Block(base + 2 * P, P, 0, 0, 0, 0, "unmapped"),
            Block(base + 3 * P, 512, 512, 3, 0, 3, "live", (0, 5)),
            Block(base + 3 * P + 512, P - 512, 0, 3, 0, 0, "free", (0, 5)),
        ],
        [1, 1, 0, 1],
    )
    t = s.to_torch(0)
    segs = t["segments"]
    assert [(g["address"], g["total_size"], g["segment_pool_id"]) for g in segs] == [
        (base, 2 * P, (0, 0)),
        (base + 3 * P, P, (0, 5)),
    ]
    assert [b["state"] for b in segs[0]["blocks"]] == ["active_allocated", "active_pending_free", "inactive"]
    assert segs[0]["allocated_size"] == 1024 and segs[0]["active_size"] == 2048
    assert segs[0]["requested_size"] == 1900 and segs[0]["stream"] == 7
    # a general block then a pool block in one mapped run: two segments that tile it
    s2 = snap(
        [
            Block(base, P, P, 0, 0, 1, "live"),
            Block(base + P, P // 2, P, 0, 0, 2, "live", (4, 0)),
            Block(base + P + P // 2, P // 2, 0, 0, 0, 0, "free", (4, 0)),
        ],
        [1, 1],
    )
    assert [(g["address"], g["total_size"], g["segment_pool_id"]) for g in s2.to_torch(0)["segments"]] == [
        (base, P, (0, 0)),
        (base + P, P, (4, 0)),
    ]
    bad = snap([Block(base, 2 * P, 0, 0, 0, 0, "free")], [1, 0])
    with pytest.raises(ValueError, match="crosses the mapped run"):
        bad.to_torch(0)
    import gpumem.torch._install as inst

    assert not hasattr(inst, "_segments") and not hasattr(inst, "_BLOCK_STATES")


def test_patch_and_restore_torch_functions():
    torch = pytest.importorskip("torch")
    from gpumem import torch as gt
    from gpumem.torch import _install

    names = ["_cuda_memoryStats", "_cuda_resetPeakMemoryStats", "_cuda_memorySnapshot", "_cuda_record_memory_history"]
    before = {n: getattr(torch._C, n, None) for n in names}
    _install._patch(torch)
    try:
        assert torch._C._cuda_memoryStats(0)["allocated_bytes"]["all"]["current"] == 0
        assert torch._C._cuda_memorySnapshot(None) == {"segments": [], "device_traces": [[]]}
    finally:
        gt.uninstall()
    assert {n: getattr(torch._C, n, None) for n in names} == before
