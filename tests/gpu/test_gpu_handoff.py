"""The hand-off between streams on a GPU: the two-stream prefetching loop of benchmarks/gpu_two_stream.py
under gpumem.install(), capped near its peak live memory, where the side stream's next batch wants memory
the main stream freed while its kernels still run.  The blocks change hands on the device (the statistic
counts them) and every value is right: the main stream reads each batch as the side stream wrote it, and
the losses are those of the uncapped run.  In a fresh interpreter; skipped without torch or a CUDA GPU."""

import os

from test_gpu_torch import gpu_test, run_py
from helpers import REPO

BENCH = os.path.join(str(REPO), "benchmarks")


@gpu_test
def test_two_streams_hand_blocks_off_and_read_what_was_written():
    r = run_py(
        f"""
        sys.path.insert(0, {BENCH!r})
        import gpu_two_stream as g
        gpumem.install()
        torch.backends.cuda.matmul.allow_tf32 = False
        ref = g.workload(torch, "cuda", 12, g.GPU)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(1.05 * peak / total)
        torch.cuda.reset_peak_memory_stats()
        s0 = torch.cuda.memory_stats()
        got = g.workload(torch, "cuda", 12, g.GPU)
        torch.cuda.synchronize()
        s1 = torch.cuda.memory_stats()
        out(ref_ok=ref["checks"] == ref["expected"], ok=got["checks"] == got["expected"],
            ref_losses=ref["losses"], losses=got["losses"], peak=peak,
            reserved=torch.cuda.max_memory_reserved(),
            handoffs=s1["num_stream_handoffs"] - s0["num_stream_handoffs"],
            syncs=s1["num_sync_all_streams"] - s0["num_sync_all_streams"])
        """
    )
    assert r["ref_ok"] and r["ok"], r  # the main stream read every batch as the side stream wrote it
    assert r["handoffs"] > 0, r
    assert r["reserved"] <= 1.05 * r["peak"] + (2 << 20), r
    for a, b in zip(r["losses"], r["ref_losses"]):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(b)), r
