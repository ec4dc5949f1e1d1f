"""What growing the heap costs on a real GPU, per 2 MiB page, by how many pages one request maps.

Each row: a fresh heap on cuda:0; one malloc that needs N new pages, its free, then empty_cache.
With chunk_pages=1 every page is its own device allocation (cuMemCreate + cuMemMap per page, one
cuMemSetAccess per run); with chunk_pages=K the N pages come as ceil(N/K) allocations, one create,
map and set_access each.  The values compared (--compare, default "1,<default>" or "1,16" when
gpumem's default is 1) run in fresh processes, alternated round by round so that drift in the
driver or the clocks hits both alike; each cell is the median over the rounds.  chunk_pages=1 rows
also time a remap: N pages moved behind a new address by defragmentation.

Usage on a machine with a GPU:
    python benchmarks/gpu_growth.py [--compare 1,16] [--rounds 5] [--json benchmarks/results/gpu_growth.json]
Prints a markdown table; skips (exit 0) only when torch or a CUDA GPU is missing.
"""

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

PAGES = (1, 8, 64, 512)


def grow_once(gpumem, n_pages, chunk_pages):
    """One fresh heap: µs per page to grow by n_pages, to give them back, and the device calls made."""
    with gpumem.Heap(device="cuda", ordinal=0, chunk_pages=chunk_pages) as h:
        page = h.page_size
        t0 = time.perf_counter()
        p = h.malloc(n_pages * page)
        t1 = time.perf_counter()
        h.free(p)
        t2 = time.perf_counter()
        h.empty_cache()
        t3 = time.perf_counter()
        st = h.stats()
        want = -(-n_pages // chunk_pages)
        assert st["num_device_alloc"] == want, (st["num_device_alloc"], want)
        return {
            "grow_us_per_page": (t1 - t0) / n_pages * 1e6,
            "empty_cache_us_per_page": (t3 - t2) / n_pages * 1e6,
            "creates": st["num_device_alloc"],
            "maps": st["num_maps"],
        }


def remap_once(gpumem, n_pages):
    """Fill a capped heap with single-page blocks, free every other one, then ask for n_pages contiguous."""
    with gpumem.Heap(device="cuda", ordinal=0, cap=2 * n_pages * (2 << 20), chunk_pages=1) as h:
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
    return {"remap_us_per_page": dt / max(moved, 1) * 1e6, "moved": moved}


def child(chunk_pages):
    """One process, one round: every size at one chunk_pages; JSON on stdout."""
    import gpumem

    out = []
    for n in PAGES:
        r = dict(pages=n, chunk_pages=chunk_pages, **grow_once(gpumem, n, chunk_pages))
        if chunk_pages == 1 and n <= 64:
            r.update(remap_once(gpumem, n))
        out.append(r)
    print(json.dumps(out))


def have_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compare", default=None, help="chunk_pages values, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child is not None:
        child(args.child)
        return 0
    if not have_gpu():
        print("gpu_growth: no CUDA GPU (or no torch): skipped")
        return 0
    import gpumem._C

    default = gpumem._C.CHUNK_PAGES_DEFAULT
    values = [int(v) for v in args.compare.split(",")] if args.compare else [1, default if default > 1 else 16]
    runs = {v: [] for v in values}
    for r in range(args.rounds):
        order = values if r % 2 == 0 else values[::-1]
        for v in order:
            p = subprocess.run(
                [sys.executable, __file__, "--child", str(v)], capture_output=True, text=True, check=False
            )
            if p.returncode != 0:
                sys.stderr.write(p.stdout + p.stderr)
                raise SystemExit(f"gpu_growth: the chunk_pages={v} run failed")
            runs[v].append(json.loads(p.stdout.strip().splitlines()[-1]))
    rows = []
    for v in values:
        for i, n in enumerate(PAGES):
            cells = [run[i] for run in runs[v]]
            row = {"chunk_pages": v, "pages": n, "creates": cells[0]["creates"], "maps": cells[0]["maps"]}
            for key in ("grow_us_per_page", "empty_cache_us_per_page", "remap_us_per_page"):
                if key in cells[0]:
                    row[key] = statistics.median(c[key] for c in cells)
            if "moved" in cells[0]:
                row["moved"] = cells[0]["moved"]
            rows.append(row)
    print(f"gpumem default chunk_pages: {default}; {args.rounds} rounds, processes alternated")
    print("| chunk_pages | pages per request | creates | grow µs/page | empty_cache µs/page | remap µs/page (moved) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        remap = f"{r['remap_us_per_page']:.1f} ({r['moved']})" if "remap_us_per_page" in r else "-"
        print(
            f"| {r['chunk_pages']} | {r['pages']} | {r['creates']} | {r['grow_us_per_page']:.2f} | "
            f"{r['empty_cache_us_per_page']:.2f} | {remap} |"
        )
    if args.json:
        out = {"default_chunk_pages": default, "rounds": args.rounds, "rows": rows}
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
