"""torch.cuda.memory_stats(), key by key: torch's meaning, gpumem's value and the native allocator's,
after one small real workload run once under each allocator.

    python benchmarks/torch_stats.py [--json FILE] [--doc FILE] [--steps N]
    python benchmarks/torch_stats.py --doc-only     # the doc's table from the JSON already written

The workload (each allocator in a fresh process): a few training steps of a small transformer at
varying batch sizes, far from the device's limit; then a cap (set_per_process_memory_fraction) just
above what is live plus one request, while more than that request is cached: the request meets the
cap, so the allocator releases its cache and tries again (torch's num_alloc_retries); then one request
over the cap (an out-of-memory error, num_ooms).  The figures are read after each phase.  Writes
benchmarks/results/torch_stats.json and the table between the markers in docs/torch.md.  Needs a CUDA
GPU; well under 2 minutes on one.
"""

import argparse
import json
import os
import sys

from common import markdown_head, markdown_row, run_child, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
JSON = os.path.join(HERE, "results", "torch_stats.json")
DOC = os.path.normpath(os.path.join(HERE, "..", "docs", "torch.md"))
BEGIN, END = "<!-- torch_stats: begin (benchmarks/torch_stats.py writes this table) -->", "<!-- torch_stats: end -->"
MiB = 1 << 20

# key -> (torch's meaning: torch/cuda/memory.py and c10's DeviceStats; what gpumem counts, where it differs)
POOLED = {
    "allocation": ("live allocations", "the same"),
    "segment": ("segments from cudaMalloc (or expandable segments)", "2 MiB pages held (under large_pool)"),
    "active": ("active blocks: live, or freed and waiting for a stream's event", "the same"),
    "inactive_split": (
        "free blocks that cannot be released: they share a segment with others",
        "free blocks in mapped memory",
    ),
    "allocated_bytes": ("bytes of live blocks (rounded sizes)", "the same (512-byte rounding)"),
    "reserved_bytes": ("bytes of device memory held", "bytes of pages held"),
    "active_bytes": ("bytes of active blocks", "the same"),
    "inactive_split_bytes": ("bytes of those free blocks", "bytes of free blocks in mapped memory"),
    "requested_bytes": ("bytes requested by client code, before rounding", "the same"),
}
COUNTERS = {
    "num_alloc_retries": (
        "failed device allocations that flushed the cache and retried",
        "allocations that met the cap or the device and released cached memory (a device wait, then unmapping); "
        "a request over the cap fails at once",
    ),
    "num_ooms": ("out-of-memory errors raised", "the same"),
    "num_sync_all_streams": (
        "synchronize_and_free_events calls (cache flushes)",
        "device waits (empty_cache, defragmenting)",
    ),
    "num_device_alloc": ("device allocation calls (cudaMalloc, cuMemMap)", "physical allocations (cuMemCreate)"),
    "num_device_free": ("device free calls (cudaFree, cuMemUnmap)", "physical releases (cuMemRelease)"),
    "num_oom_rejections": ("allocations refused by the OOM preemption policy (newer torch)", "0: no such policy"),
    "max_split_size": ("blocks above it are not split (-1: no limit)", "-1"),
    "oversize_allocations": ("allocations above max_split_size", "0: no max_split_size"),
    "oversize_segments": ("segments above max_split_size", "0: no max_split_size"),
    "num_slow_allocs": ("(gpumem's own)", "allocations no free block served"),
    "num_maps": ("(gpumem's own)", "page map calls"),
    "num_unmaps": ("(gpumem's own)", "page unmap calls"),
    "num_remaps": ("(gpumem's own)", "defragmentations: pages moved behind a new address"),
    "num_pages_remapped": ("(gpumem's own)", "pages those moved"),
    "num_device_errors": ("(gpumem's own)", "failed device calls"),
}
FIELDS = ("current", "peak", "allocated", "freed")


def train(torch, steps):
    """A few steps of a small transformer, batch size varying; nothing downloaded."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 4).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for i in range(steps):
        x = torch.randn(8 + 8 * (i % 3), 256 + 64 * (i % 2), 512, device="cuda")
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return model, opt


def meet_the_cap(torch):
    """Cache two 512 MiB blocks on either side of a live one, then cap the process so a 1.25 GiB
    request fits only once the cache is released; then one request over the cap.  Returns whether
    that one was refused."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    a = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    kept = torch.empty(20 * MiB, dtype=torch.uint8, device="cuda")
    b = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    del a, b  # cached now
    total = torch.cuda.get_device_properties(0).total_memory
    want = 1280 * MiB
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated() + want + 128 * MiB) / total)
    fitted = torch.empty(want, dtype=torch.uint8, device="cuda")
    fitted.fill_(1)
    try:
        torch.empty(2 * want, dtype=torch.uint8, device="cuda")
        refused = False
    except torch.OutOfMemoryError:
        refused = True
    del fitted, kept
    torch.cuda.set_per_process_memory_fraction(1.0)
    return refused


def one(allocator, steps):
    """The child: run the workload under `allocator`, print the statistics after each phase as JSON."""
    import torch

    if allocator == "gpumem":
        import gpumem

        gpumem.install()
    model, opt = train(torch, steps)  # kept alive: the cap is set above what they hold
    phases = {"train": torch.cuda.memory_stats()}
    refused = meet_the_cap(torch)
    phases["cap"] = torch.cuda.memory_stats()
    info = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "refused": refused}
    print(json.dumps({**info, "phases": phases, "params": sum(p.numel() for p in model.parameters())}))
    del model, opt


def cell(stats, key):
    """A key's figure(s) from one run's flat memory_stats: a pooled key's all-pools current / peak /
    allocated / freed, else the value; '' for a run not made yet, 'absent' for a key it lacks."""
    if stats is None:
        return ""
    if key in POOLED or key.startswith("oversize_"):
        prefix = f"{key}.all." if key in POOLED else f"{key}."
        vals = [stats.get(prefix + f) for f in FIELDS]
        return "absent" if all(v is None for v in vals) else " / ".join(str(v) for v in vals)
    return str(stats[key]) if key in stats else "absent"


def table(results):
    """The doc's Markdown table from the JSON's results (figures left empty for a run not made)."""
    runs = {a: (results or {}).get(a) for a in ("gpumem", "native")}
    lines = [markdown_head("key | torch's meaning | gpumem counts | phase | gpumem | native")]
    for key, (meaning, ours) in {**POOLED, **COUNTERS}.items():
        for phase in ("train", "cap"):
            figs = [cell(r["phases"][phase] if r else None, key) for r in runs.values()]
            first = phase == "train"
            lines.append(
                markdown_row(
                    [f"`{key}`" if first else "", meaning if first else "", ours if first else "", phase, *figs]
                )
            )
    head = [f"{a}: torch {r['torch']} on {r['device']}" for a, r in runs.items() if r]
    return "\n".join(lines), "; ".join(head) or "figures: not run yet"


def write_doc(path, results):
    text = open(path).read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{path}: the markers {BEGIN!r} and {END!r} are missing")
    body, head = table(results)
    pooled = (
        "Pooled keys show their `all` figures: current / peak / allocated / freed. Phase `train`: after "
        "the training steps; `cap`: after the request that met the cap and the one over it."
    )
    new = f"{BEGIN}\n{head}. {pooled}\n\n{body}\n{END}"
    start, end = text.index(BEGIN), text.index(END) + len(END)
    with open(path, "w") as f:
        f.write(text[:start] + new + text[end:])
    print("wrote", path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--one", choices=("native", "gpumem"), help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--json", default=JSON)
    ap.add_argument("--doc", default=DOC)
    ap.add_argument("--doc-only", action="store_true", help="only write the doc's table from --json")
    a = ap.parse_args()
    if a.one:
        return one(a.one, a.steps)
    if a.doc_only:
        results = json.load(open(a.json)) if os.path.exists(a.json) else None
        return write_doc(a.doc, results)
    results = {}
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMEM_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    for allocator in ("native", "gpumem"):
        r = run_child(__file__, ["--one", allocator, "--steps", str(a.steps)], allocator, env=env, timeout=300)
        if r is None:
            sys.exit(1)
        results[allocator] = r
    write_json(a.json, results)
    write_doc(a.doc, results)
    print(table(results)[0])


if __name__ == "__main__":
    main()
