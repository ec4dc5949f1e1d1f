"""What growing the heap costs on a real GPU, per 2 MiB page, by how many pages one request maps.

Each row: a fresh heap on cuda:0; one malloc that needs N new pages (cuMemCreate + cuMemMap per page,
one cuMemSetAccess per run), its free, then empty_cache (cuMemUnmap + cuMemRelease per page).  Median
of 5.  Also times a remap: N pages moved behind a new address by defragmentation.
Usage on a machine with a GPU: python benchmarks/gpu_growth.py [--json PATH]"""

import json
import statistics
import sys
import time

import gpumem

MiB = 1 << 20


def one(n_pages, repeats=5):
    grow, shrink = [], []
    for _ in range(repeats):
        with gpumem.Heap(device="cuda", ordinal=0) as h:
            page = h.page_size
            t0 = time.perf_counter()
            p = h.malloc(n_pages * page)
            t1 = time.perf_counter()
            h.free(p)
            t2 = time.perf_counter()
            h.empty_cache()
            t3 = time.perf_counter()
            assert h.stats()["num_device_alloc"] == n_pages
        grow.append((t1 - t0) / n_pages * 1e6)
        shrink.append((t3 - t2) / n_pages * 1e6)
    return statistics.median(grow), statistics.median(shrink)


def remap(n_pages, repeats=5):
    """Fill a capped heap with 2 MiB blocks, free every other one, then ask for n_pages contiguous."""
    out = []
    for _ in range(repeats):
        with gpumem.Heap(device="cuda", ordinal=0, cap=2 * n_pages * 2 * MiB) as h:
            page = h.page_size
            blocks = [h.malloc(page) for _ in range(2 * n_pages)]
            for b in blocks[::2]:
                h.free(b)
            before = h.stats()["num_pages_remapped"]
            t0 = time.perf_counter()
            p = h.malloc(n_pages * page)
            dt = time.perf_counter() - t0
            moved = h.stats()["num_pages_remapped"] - before
            h.free(p)
            for b in blocks[1::2]:
                h.free(b)
        out.append((dt / max(moved, 1) * 1e6, moved))
    return statistics.median(x for x, _ in out), out[0][1]


def main():
    rows = []
    print("| pages per request | grow us/page | empty_cache us/page | remap us/page (pages moved) |")
    print("|---|---|---|---|")
    for n in (1, 8, 64, 512):
        g, s = one(n)
        r, moved = remap(n) if n <= 64 else (float("nan"), 0)
        rows.append(dict(pages=n, grow_us_per_page=g, empty_cache_us_per_page=s, remap_us_per_page=r, moved=moved))
        print(f"| {n} | {g:.1f} | {s:.1f} | {r:.1f} ({moved}) |")
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
