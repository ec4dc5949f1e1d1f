#!/usr/bin/env python3
"""Chunks split under pressure on a GPU, against the simulated device (split_chunks).

    python benchmarks/gpu_split.py [--traces llama_ckpt,...] [--chunk-pages 16] [--json OUT]

For each shipped single-stream trace: the smallest capacity (to 1 MiB) at which it replays on the
simulated device with chunks of --chunk-pages pages and split_chunks=1; then, at that capacity as the
heap's cap, the trace replays on the GPU (gpumem.Heap(device="cuda"), allocations and frees only, no
kernels) and on the simulated device, three ways: chunks with splits, chunks without, single pages.
Each row gives the first request that failed (-1: none), the splits, the device allocations and
synchronisations, the GPU replay's wall time, and whether the heap's checker passed after it.
Without a CUDA GPU only the simulated columns are filled.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
try:
    import gpumem
except ImportError:  # not installed: the checkout (built with build_ext --inplace)
    sys.path.insert(0, str(HERE.parent))
    import gpumem
from gpumem import replay as R  # noqa: E402
from gpumem.trace import load_trace  # noqa: E402

TRACES = "llama_ckpt,seed_fragmentation,roberta_infer,gpt_neox_fp16,qwen2_lora,resnet_infer"


def has_cuda() -> bool:
    try:
        h = gpumem.Heap(device="cuda", cap="64MiB")
    except Exception:
        return False
    h.close()
    return True


def run(heap, tr) -> dict:
    t0 = time.perf_counter()
    r = heap.replay(tr.events, tr.n_slots)
    wall = time.perf_counter() - t0
    st = heap.stats()
    try:
        heap.check()
        ok = True
    except gpumem.CorruptionError:
        ok = False
    heap.close()
    return dict(
        first_oom=r["first_oom_event"],
        splits=st["num_chunk_splits"],
        device_allocs=st["num_device_alloc"],
        syncs=st["num_sync_all_streams"],
        wall_s=round(wall, 3),
        check=ok,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=TRACES)
    ap.add_argument("--chunk-pages", type=int, default=16)
    ap.add_argument("--json", default=None, help="write the rows here")
    a = ap.parse_args()
    cuda = has_cuda()
    ways = {
        "chunks, split": {"chunk_pages": a.chunk_pages, "split_chunks": 1},
        "chunks": {"chunk_pages": a.chunk_pages},
        "single pages": {"chunk_pages": 1},
    }
    rows = []
    for name in a.traces.split(","):
        tr = load_trace(name)
        if any(tr.words[i] for i in range(2, len(tr.words), 3)):
            print(f"{name}: more than one stream, skipped (the GPU replay uses the default stream)")
            continue
        cap = R.min_capacity(tr, precision=R.MiB, heap_kwargs=ways["chunks, split"])
        for label, kw in ways.items():
            row = dict(trace=name, way=label, cap_bytes=cap, cap_over_peak_live=round(cap / tr.peak_live_bytes, 4))
            row["sim"] = run(R._heap(cap, kw), tr)
            row["gpu"] = run(gpumem.Heap(device="cuda", cap=cap, **kw), tr) if cuda else None
            rows.append(row)
    print(
        "| trace | cap ÷ peak live | way | first failed request: sim / GPU | splits | device allocations | syncs "
        "| GPU replay s | checker |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        s, g = r["sim"], r["gpu"] or {}
        print(
            f"| {r['trace']} | {r['cap_over_peak_live']} | {r['way']} | {s['first_oom']} / {g.get('first_oom', '-')} "
            f"| {s['splits']} / {g.get('splits', '-')} | {s['device_allocs']} / {g.get('device_allocs', '-')} "
            f"| {s['syncs']} / {g.get('syncs', '-')} | {g.get('wall_s', '-')} | {g.get('check', '-')} |"
        )
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"cuda": cuda, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
