"""C++ callers of torch's allocator see gpumem (csrc/torch_ext/allocator.cpp), on a GPU.

A C++ extension (torch.utils.cpp_extension.load_inline) calls c10::cuda::CUDACachingAllocator
and torch::cuda's history functions directly, as extensions, the profiler and torch's own C++
do, with gpumem installed: history recorded and snapshots pickled from C++ (as PyTorch's own
TestCudaMallocAsync.test_cpp_memory_snapshot_pickle does), statistics, peak reset, the
out-of-memory observers attached from C++.  Then compile regions in the
snapshot's trace entries.  Each case runs in a fresh process; they skip without CUDA.
"""

import os

import pytest

from helpers import cuda_devices, run_python

N_CUDA = cuda_devices()[0]
gpu = pytest.mark.gpu(pytest.mark.skipif(N_CUDA < 1, reason="needs torch with a CUDA GPU"))

PRELUDE = """
import os, pickle
import torch
import gpumem
"""

# The extension: what a C++ caller of torch's allocator API does.
PROBE = r"""
#include <c10/cuda/CUDACachingAllocator.h>
#include <torch/csrc/cuda/memory_snapshot.h>
#include <torch/extension.h>

namespace alloc = c10::cuda::CUDACachingAllocator;
static int64_t g_oom_request = -1;

py::bytes snapshot() { return py::bytes(torch::cuda::_memory_snapshot_pickled()); }
void record(bool on, bool ctx) { torch::cuda::_record_memory_history(on, ctx, 10, ctx, ctx); }
bool history_enabled() { return alloc::get()->isHistoryEnabled(); }
std::vector<int64_t> stats() {
    auto s = alloc::getDeviceStats(0);
    return {s.allocated_bytes[0].current, s.reserved_bytes[0].current, s.allocated_bytes[0].peak, s.num_ooms,
            s.num_alloc_retries, s.max_split_size};
}
void reset_peak() { alloc::resetPeakStats(0); }
void observe() {
    alloc::attachOutOfMemoryObserver([](int64_t, size_t requested, size_t, size_t) {
        g_oom_request = (int64_t)requested;
    });
}
int64_t observed() { return g_oom_request; }
"""
FUNCTIONS = ["snapshot", "record", "history_enabled", "stats", "reset_peak", "observe", "observed"]


@pytest.fixture(scope="module")
def build_dirs(tmp_path_factory):
    """Where allocator.cpp and the probe are built, once for the module (unless set)."""
    root = tmp_path_factory.mktemp("builds")
    env = {"GPUMEM_CACHE_DIR": str(root / "gpumem"), "TORCH_EXTENSIONS_DIR": str(root / "ext")}
    return {k: os.environ.get(k, v) for k, v in env.items()}


def run_py(code, env):
    return run_python(code, PRELUDE + f"PROBE = {PROBE!r}\nFUNCTIONS = {FUNCTIONS!r}\n", env=env, timeout=600)


@gpu
def test_a_cpp_extension_sees_gpumem(build_dirs):
    r = run_py(
        """
        gpumem.install()
        from torch.utils.cpp_extension import load_inline
        m = load_inline(name="gpumem_cpp_probe", cpp_sources=[PROBE], functions=FUNCTIONS, with_cuda=True)
        status = gpumem.torch.status()
        x = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        stats = m.stats()
        py = [torch.cuda.memory_allocated(), torch.cuda.memory_reserved()]
        del x
        m.reset_peak()
        peak_after = m.stats()[2]
        found = {}
        for ctx in (False, True):
            m.record(True, ctx)
            enabled = m.history_enabled()

            # TorchScript from a string: this child runs from `python -c`, which keeps no source file
            the_script_fn = torch.jit.CompilationUnit(
                "def the_script_fn():\\n    return torch.rand(311, 411, device='cuda')\\n"
            ).the_script_fn

            def run():
                t = the_script_fn()
                return pickle.loads(m.snapshot())

            mem = run()
            blocks = [b for s in mem["segments"] for b in s["blocks"]
                      if b["state"] == "active_allocated" and b["requested_size"] == 311 * 411 * 4]
            last = mem["device_traces"][0][-1]
            found[ctx] = dict(enabled=enabled, blocks=len(blocks), frames=str(blocks[0]["frames"]) if blocks else "",
                              last=[last["action"], last["size"]])
            m.record(False, False)
        m.observe()
        try:
            torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass
        out(status=status["cpp_allocator"], error=status["cpp_allocator_error"], stats=stats, py=py,
            peak_after=peak_after, found=found, observed=m.observed(), ooms=m.stats()[3],
            torch_ooms=torch.cuda.memory_stats()["num_ooms"])
        """,
        build_dirs,
    )
    assert r["status"], r["error"]
    assert r["stats"][:2] == r["py"] and r["stats"][0] >= 3 << 20 and r["stats"][5] == -1
    assert r["peak_after"] == r["stats"][0] - (3 << 20)  # the peak reset to what is allocated now
    for ctx in ("false", "true"):
        f = r["found"][ctx]
        assert f["enabled"] and f["blocks"] == 1
        assert f["last"] == ["alloc", 311 * 411 * 4]  # the bytes asked for, as torch's trace entries carry
    frames = r["found"]["true"]["frames"]
    assert "::rand" in frames and "the_script_fn" in frames and "'name': 'run'" in frames  # C++, script, Python
    assert r["observed"] == 1 << 50 and r["ooms"] == r["torch_ooms"] == 1


@gpu
def test_compile_regions_in_the_snapshot(build_dirs):
    """PyTorch's test_memory_compile_regions: a graph break resumes in region 1/0 inside 0/0, and
    every trace entry (allocations and frees) carries the region it was recorded in."""
    r = run_py(
        """
        gpumem.install()
        class MyModel(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear1 = torch.nn.Linear(10, 10)
                self.linear2 = torch.nn.Linear(10, 10)

            def forward(self, x):
                x = self.linear1(x)
                if x.sum() > 0:
                    x = x + 1
                else:
                    x = x - 1
                return self.linear2(x)

        x = torch.randn(1, 10, device="cuda")
        model = torch.compile(MyModel().cuda())
        torch.cuda.memory._record_memory_history(context="all", compile_context=True)
        model(x)
        seq = []
        for e in torch.cuda.memory._snapshot()["device_traces"][0]:
            c = e["compile_context"]
            if c != "N/A" and (not seq or seq[-1] != c):
                seq.append(c)
        torch.cuda.memory._record_memory_history(None)
        out(seq=seq)
        """,
        build_dirs,
    )
    assert r["seq"] == ["Torch-Compiled Region: 0/0", "Torch-Compiled Region: 1/0", "Torch-Compiled Region: 0/0"]
