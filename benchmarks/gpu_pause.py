"""Pause and resume a private pool's physical memory (gpumem.pause / gpumem.resume) on a GPU.

For pools of 1, 10 and 40 GiB (sizes that do not fit in free memory are skipped), with and without
a pinned host backup: memory given back as torch.cuda.mem_get_info sees it, the share of the pool's
pages released, and the wall time of pause and of resume (median of --rounds round trips).  With a
backup, a probe written into every tensor must read back unchanged after resume.

Goals: >= 99% of the pool's pages returned; resume of 10 GiB without backup in <= 100 ms.

Usage on a GPU machine: python benchmarks/gpu_pause.py [--sizes 1,10,40] [--rounds 3]
    [--json benchmarks/results/gpu_pause.json]
Prints a markdown table; --json also writes the figures.
"""

import argparse
import json
import pathlib
import statistics
import sys
import time

from common import markdown_head, markdown_row

REPO = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

GiB = 1 << 30
PAGE = 2 << 20
CHUNK = 1 << 30  # tensors of 1 GiB fill the pool


def one_size(torch, gpumem, size, backup, rounds):
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        tensors = [torch.empty(min(CHUNK, size - k), dtype=torch.uint8, device="cuda") for k in range(0, size, CHUNK)]
    probes = []
    for i, t in enumerate(tensors):  # a probe at both ends of each tensor
        for at in (0, t.numel() - 4096):
            v = torch.full((4096,), (i * 7 + at) % 251, dtype=torch.uint8, device="cuda")
            t[at : at + 4096].copy_(v)
            probes.append((t, at, v))
    torch.cuda.synchronize()
    pinned = gpumem._C.registry_heap(torch.cuda.current_device()).pool_info(pool.id)["pinned_pages"]
    pause_s, resume_s, returned, released, shared, phases = [], [], [], [], [], []
    intact = True
    for _ in range(rounds):
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        r = gpumem.pause(pool, backup=backup)
        t1 = time.perf_counter()
        free1 = torch.cuda.mem_get_info()[0]
        t2 = time.perf_counter()
        r2 = gpumem.resume(pool)
        t3 = time.perf_counter()
        pause_s.append(t1 - t0)
        resume_s.append(t3 - t2)
        returned.append(free1 - free0)
        released.append(r.pages)
        shared.append(r.shared_pages)
        phases.append({"pause": r.phases, "resume": r2.phases})
        assert r2.pages == r.pages
        if backup:
            intact = intact and all(bool(torch.equal(t[at : at + 4096], v)) for t, at, v in probes)
    del probes, tensors
    del pool
    torch.cuda.empty_cache()
    return {
        "size_bytes": size,
        "backup": backup,
        "pool_pages": pinned,
        "pages_released": released[0],
        "shared_pages": shared[0],
        "returned_bytes": min(returned),
        "returned_pct": 100.0 * min(returned) / (pinned * PAGE) if pinned else 0.0,
        "pages_pct": 100.0 * released[0] / pinned if pinned else 0.0,
        "pause_ms": 1e3 * statistics.median(pause_s),
        "resume_ms": 1e3 * statistics.median(resume_s),
        "pause_ms_all": [1e3 * s for s in pause_s],
        "resume_ms_all": [1e3 * s for s in resume_s],
        "resume_us_per_page": 1e6 * statistics.median(resume_s) / max(released[0], 1),
        # the core's own split of each call (seconds): median over the rounds
        "pause_phases_ms": {k: 1e3 * statistics.median(p["pause"][k] for p in phases) for k in phases[0]["pause"]},
        "resume_phases_ms": {k: 1e3 * statistics.median(p["resume"][k] for p in phases) for k in phases[0]["resume"]},
        "contents_ok": intact if backup else None,
        "rounds": rounds,
    }


HEAD = (
    "pool | backup | pages | shared | returned (mem_get_info) | % of pool pages | pause ms | resume ms "
    "| resume us/page | pause: sync / copy / unmap+release ms | resume: pages / map+access / copy ms | contents"
)


def _cells(r):
    """One pool size's row of the table."""
    pp, rp = r["pause_phases_ms"], r["resume_phases_ms"]
    contents = "-" if r["contents_ok"] is None else ("ok" if r["contents_ok"] else "CHANGED")
    return [
        f"{r['size_bytes'] / GiB:g} GiB",
        "yes" if r["backup"] else "no",
        r["pages_released"],
        r["shared_pages"],
        f"{r['returned_bytes'] / GiB:.3f} GiB",
        f"{r['returned_pct']:.2f}%",
        *(f"{r[k]:.1f}" for k in ("pause_ms", "resume_ms", "resume_us_per_page")),
        " / ".join(f"{pp[k]:.1f}" for k in ("sync", "copy", "map")),
        " / ".join(f"{rp[k]:.1f}" for k in ("pages", "map", "copy")),
        contents,
    ]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,10,40", help="pool sizes in GiB, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="pause/resume round trips per case (median reported)")
    ap.add_argument("--backup-rounds", type=int, default=1, help="round trips per case with a backup")
    ap.add_argument("--json", default=None, help="also write the figures to this file")
    args = ap.parse_args(argv)

    import torch

    import gpumem

    if not torch.cuda.is_available():
        print("gpu_pause: needs a CUDA GPU")
        return 1
    gpumem.install()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    total = torch.cuda.mem_get_info()[1]
    rows, skipped = [], []
    t_start = time.perf_counter()
    for gib in (float(x) for x in args.sizes.split(",")):
        size = int(gib * GiB)
        for backup in (False, True):
            free = torch.cuda.mem_get_info()[0]
            if size + 2 * GiB > free:  # room for the probes and torch's own
                skipped.append({"size_bytes": size, "backup": backup, "why": f"{free / GiB:.1f} GiB free"})
                continue
            rows.append(one_size(torch, gpumem, size, backup, args.backup_rounds if backup else args.rounds))
    wall = time.perf_counter() - t_start

    print(f"device: {torch.cuda.get_device_name(0)} ({total / GiB:.0f} GiB), torch {torch.__version__}")
    print()
    print(markdown_head(HEAD))
    for r in rows:
        print(markdown_row(_cells(r)))
    for s in skipped:
        print(f"skipped: {s['size_bytes'] / GiB:g} GiB, backup={s['backup']}: only {s['why']}")
    goals = {}
    if rows:
        goals["pages_returned_ge_99pct"] = all(r["returned_pct"] >= 99.0 for r in rows)
    ten = [r for r in rows if r["size_bytes"] == 10 * GiB and not r["backup"]]
    if ten:
        goals["resume_10GiB_no_backup_le_100ms"] = ten[0]["resume_ms"] <= 100.0
    backups = [r for r in rows if r["backup"]]
    if backups:
        goals["backup_restores_contents"] = all(r["contents_ok"] for r in backups)
    print("goals:", ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in goals.items()) or "none measured")
    print(f"wall time: {wall:.1f} s")
    if args.json:
        out = pathlib.Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(0),
                    "device_total_bytes": total,
                    "torch": torch.__version__,
                    "rows": rows,
                    "skipped": skipped,
                    "goals": goals,
                    "wall_s": wall,
                },
                indent=2,
            )
        )
        print("wrote", out)
    return 0 if all(goals.values()) else 2


if __name__ == "__main__":
    sys.exit(main())
