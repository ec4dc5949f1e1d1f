"""The seeds' "OOM although memory is free" scenario, at >= 95% of the GPU's memory.

Fill the GPU with 1 GiB tensors to >= 95% of its memory and free them (both allocators
keep that memory); allocate the seeds' mixed sizes (1-33 MiB) into it, keep every third
and free the rest; then ask for one tensor of half the memory that is free in the holes.
torch's caching allocator cannot move a kept tensor, and every segment holds one, so it
raises OutOfMemoryError although more than twice the request is free; gpumem maps the
free pages behind a new address range and succeeds.

    python benchmarks/gpu_frag.py [--json FILE]      # both, each in a fresh process
    python benchmarks/gpu_frag.py --one native|gpumem
"""

import argparse
import json
import os
import random
import sys
import time

from common import markdown_head, markdown_row, run_child, write_json

GiB, MiB = 1 << 30, 1 << 20


def scenario(use):
    import torch

    if use == "gpumem":
        import gpumem

        gpumem.install()
    torch.ones(1, device="cuda")
    random.seed(1234)
    _, total = torch.cuda.mem_get_info()
    chunks = []
    while torch.cuda.mem_get_info()[0] > 0.035 * total + GiB:
        chunks.append(torch.empty(GiB, dtype=torch.uint8, device="cuda"))
    free_dev, _ = torch.cuda.mem_get_info()
    fill_fraction = 1 - free_dev / total
    del chunks
    reserved = torch.cuda.memory_reserved()
    made, live = [], 0
    while live < 0.9 * reserved:
        size = random.choice([1, 3, 5, 9, 17, 33]) * MiB
        made.append(torch.empty(size, dtype=torch.uint8, device="cuda"))
        live += size
    n = len(made)
    kept = made[::3]  # every third stays; the rest are freed together, leaving holes between them
    del made
    st = torch.cuda.memory_stats()
    allocated, reserved = st["allocated_bytes.all.current"], st["reserved_bytes.all.current"]
    free_in_holes = reserved - allocated
    request = (free_in_holes // 2) // (2 * MiB) * (2 * MiB)
    t0 = time.perf_counter()
    try:
        big = torch.empty(request, dtype=torch.uint8, device="cuda")
        big.fill_(1)
        torch.cuda.synchronize()
        ok, err = True, ""
        del big
    except torch.OutOfMemoryError as e:
        ok, err = False, str(e).split(". ")[0] + ". " + str(e).split(". ")[1]
    dt = time.perf_counter() - t0
    segs = torch.cuda.memory_snapshot()
    return dict(
        segments=len(segs),
        expandable=any(sg.get("is_expandable") for sg in segs),
        alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        allocator=use,
        total=total,
        fill_fraction=round(fill_fraction, 4),
        tensors=n,
        kept=len(kept),
        allocated=allocated,
        reserved=reserved,
        free_in_holes=free_in_holes,
        request=request,
        big_ok=ok,
        error=err,
        seconds=round(dt, 3),
        device_free_before_request=torch.cuda.mem_get_info()[0],
    )


HEAD = "allocator | filled | kept / made | allocated GiB | reserved GiB | free in holes GiB | request GiB | result"


def _cells(r):
    """One allocator's row of the table."""
    g = lambda b: f"{b / GiB:.2f}"
    res = f"ok ({r['seconds']} s)" if r["big_ok"] else "OutOfMemoryError: " + r["error"][:90]
    kept = f"{r['kept']} / {r['tensors']}"
    sizes = [g(r[k]) for k in ("allocated", "reserved", "free_in_holes", "request")]
    return [r["allocator"], f"{r['fill_fraction']:.1%}", kept, *sizes, res]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", choices=["native", "gpumem"])
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(scenario(a.one)), flush=True)
        return
    rows = [run_child(__file__, ["--one", use], use) for use in ("native", "gpumem")]
    if None in rows:
        sys.exit(1)
    print(markdown_head(HEAD))
    for r in rows:
        print(markdown_row(_cells(r)))
    write_json(a.json, rows)


if __name__ == "__main__":
    main()
