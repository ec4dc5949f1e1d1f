"""gpumem as torch's C++ allocator object (csrc/torch_ext/allocator.cpp), checked without a GPU:
the file compiles against the installed torch's headers, the features it needs are read from
them, install() falls back to torch's plain pluggable allocator with one warning when it cannot
be built, and the Python side that the C++ object calls answers as torch would.
tests/gpu/test_gpu_torch_cpp.py checks the C++ callers' view on a GPU.
"""

import os
import pathlib
import re
import shutil
import subprocess
import warnings

import pytest

from helpers import TORCH_BOUNDARY, needs_test_hooks, run_python

torch = pytest.importorskip("torch")

from gpumem.torch import _cppalloc, _cppext  # noqa: E402
from helpers import REPO  # noqa: E402


def test_the_features_allocator_cpp_needs_are_read_from_torchs_headers():
    flags = _cppalloc.build_flags(torch)
    text = _cppalloc.header_text(torch)
    for macro, pattern in _cppalloc._FEATURES.items():
        assert (f"-D{macro}" in flags) == bool(re.search(pattern, text)), macro
    if torch.__version__.startswith("2.13"):  # every one of them, in the torch these tests were written with
        assert all(f"-D{macro}" in flags for macro in _cppalloc._FEATURES)


def _cuda_include(flags):
    for f in flags:
        if f.startswith("-I") and (pathlib.Path(f[2:]) / "cuda_runtime_api.h").is_file():
            return f[2:]
    return None


def test_allocator_cpp_compiles_against_the_installed_torch(tmp_path):
    """A syntax and type check (no link: a CPU-only torch has no libtorch_cuda).  A CPU-only
    torch also lacks c10's generated cuda_cmake_macros.h, which the check stands in for."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or "c++"
    flags = _cppalloc.build_flags(torch)
    if shutil.which(cxx) is None or _cuda_include(flags) is None:
        pytest.skip("needs a C++ compiler and CUDA's headers")
    stub = tmp_path / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    (stub / "cuda_cmake_macros.h").write_text("#pragma once\n")
    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd += ['-DGM_TORCH_VERSION="x"', *flags, *[f"-I{d}" for d in cpp_extension.include_paths()], f"-I{tmp_path}"]
    p = subprocess.run([*cmd, str(REPO / "csrc" / "torch_ext" / "allocator.cpp")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-4000:]


def test_without_the_cpp_allocator_install_keeps_the_pluggable_one_and_warns_once(monkeypatch):
    def refuse(*a, **k):
        raise _cppext.CppBuildError("gpumem: cannot run the C++ compiler 'c++'")

    monkeypatch.setattr(_cppext, "load", refuse)
    monkeypatch.setitem(_cppalloc._state, "lib", None)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = _cppalloc.allocator(torch, {}, lambda d: 1.0)
    assert got is None
    assert len(w) == 1 and "plain pluggable allocator" in str(w[0].message) and "C++ compiler" in str(w[0].message)
    assert _cppalloc.status() == {
        "cpp_allocator": False,
        "cpp_allocator_error": "gpumem: cannot run the C++ compiler 'c++'",
    }
    monkeypatch.setenv("GPUMEM_CPP_ALLOCATOR", "0")  # asked for none: no build, no warning
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert _cppalloc.allocator(torch, {}, lambda d: 1.0) is None
    assert not w


@needs_test_hooks
def test_the_hooks_the_cpp_allocator_calls_answer_as_torch_would():
    """What allocator.cpp's recordHistory, isHistoryEnabled, snapshot, setUserMetadata and
    pushCompileContext reach, on a simulated device behind torch's heap of device 0."""
    r = run_python(
        """
        from gpumem import _C
        from gpumem.torch import _cppalloc
        MiB = 1 << 20
        _C.registry_open_sim(0, 1 << 30)
        hooks = _cppalloc.Hooks(lambda d: 0.5)
        off = hooks.history_enabled()
        hooks.record_history(True, 2, True, 100, False, "free_requested")       # RecordContext::ALLOC, a recorder
        on = hooks.history_enabled()
        hooks.set_metadata("step 1")
        hooks.region("Torch-Compiled Region: 0/0", True)
        a = _C._torch_test_alloc(3 * MiB, 0)
        hooks.region("", False)
        b = _C._torch_test_alloc(5 * MiB, 0)
        free(_C._torch_test_alloc(MiB, 0), MiB, 0, None)
        largest = hooks.cache_info(0)  # torch's cacheInfo: the freed block and the rest of its pages
        report = _C.registry_heap(0).memory_report(0)
        snap = hooks.snapshot(0, 0, True)
        allocs = [(e["size"], e["compile_context"], e["user_metadata"]) for e in snap["device_traces"][0]
                  if e["action"] == "alloc"]
        actions = sorted({e["action"] for e in snap["device_traces"][0]})
        blocks = [b["requested_size"] for s in snap["segments"] for b in s["blocks"]
                  if b["state"] == "active_allocated"]
        meta = hooks.get_metadata()
        no_traces = hooks.snapshot(0, 0, False)["device_traces"][0]
        hooks.record_history(False, 0, False, 0, False, "")
        out(off=off, on=on, after=hooks.history_enabled(), allocs=allocs, blocks=sorted(blocks), meta=meta,
            no_traces=no_traces, fraction=hooks.memory_fraction(0), actions=actions, largest=largest,
            report_largest=report["largest_free_mapped"])
        """,
        TORCH_BOUNDARY.replace("import ctypes", "import ctypes\nfrom gpumem import _C", 1),
        timeout=300,
    )
    MiB = 1 << 20
    assert (r["off"], r["on"], r["after"]) == (False, True, False)
    assert r["allocs"] == [
        [3 * MiB, "Torch-Compiled Region: 0/0", "step 1"],
        [5 * MiB, "N/A", "step 1"],
        [MiB, "N/A", "step 1"],
    ]
    assert r["blocks"] == [3 * MiB, 5 * MiB] and r["meta"] == "step 1"
    assert r["no_traces"] == [] and r["fraction"] == 0.5
    assert MiB <= r["largest"] == r["report_largest"]
    assert "free_completed" in r["actions"] and "free_requested" not in r["actions"]  # skip_actions


@needs_test_hooks
def test_the_statistics_the_cpp_allocator_reads_are_memory_stats_in_torchs_order():
    """gpumem_torch_device_stats fills torch's DeviceStats order (csrc/python/torch_alloc.h);
    gpumem_torch_reset_stats resets peaks (1) and accumulated figures (2)."""
    r = run_python(
        """
        from gpumem import _C
        from gpumem.torch import _install
        MiB = 1 << 20
        _C.registry_open_sim(0, 1 << 30)
        ep = _C._torch_entry_points()
        read = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_int64))(ep["device_stats"])
        reset = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_int)(ep["reset_stats"])
        def flat(device=0):
            v = (ctypes.c_int64 * 114)()
            read(device, v)
            return list(v)
        a = _C._torch_test_alloc(3 * MiB, 0)
        free(_C._torch_test_alloc(5 * MiB, 0), 5 * MiB, 0, None)
        got, nested = flat(), _install.nested_stats(0)
        reset(0, 1)
        peak = flat()
        reset(0, 2)
        acc = flat()
        out(got=got, nested=nested, peak=peak, acc=acc, none=flat(5))
        """,
        TORCH_BOUNDARY.replace("import ctypes", "import ctypes\nfrom gpumem import _C", 1),
        timeout=300,
    )
    names = ["allocation", "segment", "active", "inactive_split", "allocated_bytes", "reserved_bytes"]
    names += ["active_bytes", "inactive_split_bytes", "requested_bytes"]
    n = r["nested"]
    want = [n[k][p][f] for k in names for p in ("all", "small_pool", "large_pool") for f in _FIELDS]
    want += [n[k] for k in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc")]
    want += [n["num_device_free"], n["max_split_size"]]
    assert r["got"] == want and r["got"][4 * 12 + 1] == 8 << 20  # allocated_bytes.all.peak
    assert r["peak"][4 * 12 + 1] == 3 << 20 and r["acc"][4 * 12 + 2] == 0  # peak reset; allocated reset
    assert r["none"] == [0] * 113 + [-1]


_FIELDS = ("current", "peak", "allocated", "freed")
