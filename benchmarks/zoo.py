"""The zoo: real workloads, recorded as allocation traces with PyTorch's own allocator.

Every model is built from its config with random weights (transformers, peft, timm, or plain torch for
the UNet); nothing is downloaded.  Each runs in the mode its users run it -- training with AdamW, LoRA,
activation checkpointing, mixed precision; generation with a KV cache; torch.compile -- with the shapes
varying as they do in practice (sequence lengths, batch sizes, resolutions).

    python3 benchmarks/zoo.py list                       # the catalog
    python3 benchmarks/zoo.py record OUTDIR [--jobs 4] [--only a,b]   # on a GPU: OUTDIR/NAME.trace.gz
    python3 benchmarks/zoo.py snapshots OUTDIR           # on a GPU: torch snapshots as users make them
    python3 benchmarks/zoo.py tiny [--only a,b]          # each workload at toy size on the CPU
    python3 benchmarks/zoo.py catalog TRACES_DIR         # the Markdown table of docs/zoo.md

Each workload runs in a process of its own (a clean allocator and a clean history), several at a time.
A trace's first line is a comment holding JSON: the workload's family, mode, what it exercises, and what
torch's allocator reported for the run (peak allocated and reserved, segments, retries); the format is
the one gpumem/data/traces/README.md describes.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys
import time

# The workloads (zoo_workloads.py) register themselves in ZOO (zoo_registry.py, with the loops they
# share) as they are imported.  mixtral_config, whisper and unet are here for benchmarks/forecast_models.py.
from common import start_torch_history, stop_torch_history, write_torch_trace
from zoo_registry import ZOO, Scale
from zoo_workloads import mixtral_config, unet, whisper  # noqa: F401


# -- running -----------------------------------------------------------------------------------------


def record_one(name, outdir):
    """Run workload `name` once on the GPU with torch's allocator recording its history; write the trace."""
    import torch

    w = ZOO[name]
    random.seed(1234)
    torch.manual_seed(1234)
    torch.empty(1, device="cuda")
    start_torch_history(torch)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    w["fn"](Scale(False))
    torch.cuda.synchronize()
    seconds = time.time() - t0
    st = torch.cuda.memory_stats()
    snap = stop_torch_history(torch)
    tr = snap["device_traces"][0]
    head = {k: w[k] for k in ("family", "mode", "exercises", "knob")}
    head.update(
        workload=name,
        seconds=round(seconds, 2),
        torch=torch.__version__,
        gpu=torch.cuda.get_device_name(),
        peak_allocated=st["allocated_bytes.all.peak"],
        peak_reserved=st["reserved_bytes.all.peak"],
        retries=st.get("num_alloc_retries"),
        allocs=st["allocation.all.allocated"],
        segments_peak=st["segment.all.peak"],
        streams=len({int(e.get("stream", 0)) for e in tr if e["action"] == "alloc"}),
        graphs_pools=len({s.get("segment_pool_id", (0, 0))[1] for s in snap["segments"]} - {0}),
        trace_entries=len(tr),
    )
    os.makedirs(outdir, exist_ok=True)
    note = "from torch.cuda.memory._snapshot device_traces; " + json.dumps(head)
    write_torch_trace(os.path.join(outdir, f"{name}.trace.gz"), tr, note)
    print(json.dumps(head), flush=True)


def snapshot_one(name, outdir, how):
    """A torch snapshot as users make them: `late` starts the history after the model and optimizer are
    built and a step has run; `ring` keeps a bounded ring (max_entries) that wraps."""
    import pickle
    import torch

    random.seed(1234)
    torch.manual_seed(1234)
    if how == "late":
        # the usual place: once the model is built and has taken its first optimizer step
        first_step = torch.optim.AdamW.step

        def step(self, *a, **k):
            out = first_step(self, *a, **k)
            torch.optim.AdamW.step = first_step
            torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=100_000)
            return out

        torch.optim.AdamW.step = step
    else:
        torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=3000)
    fn = ZOO[name]["fn"]
    fn(Scale(False))
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    os.makedirs(outdir, exist_ok=True)
    path = os.path.join(outdir, f"{name}_{how}.pickle.gz")
    with gzip.open(path, "wb", compresslevel=9) as f:
        pickle.dump(snap, f)
    print(
        json.dumps(
            dict(snapshot=os.path.basename(path), entries=len(snap["device_traces"][0]), bytes=os.path.getsize(path))
        ),
        flush=True,
    )


SNAPSHOTS = (("bert_mlm", "late"), ("llama_train", "ring"))


def run_many(jobs, cmds, timeout):
    """Run the child commands `jobs` at a time; returns {label: exit status} (None: timed out)."""
    pending, running, status = list(cmds), [], {}
    while pending or running:
        while pending and len(running) < jobs:
            label, argv = pending.pop(0)
            running.append((label, subprocess.Popen(argv), time.time()))
        time.sleep(0.5)
        for item in list(running):
            label, p, t0 = item
            if p.poll() is not None:
                status[label] = p.returncode
                running.remove(item)
            elif time.time() - t0 > timeout:
                p.kill()
                p.wait()
                status[label] = None
                running.remove(item)
    return status


# the architecture each family belongs to, for the catalog
ARCHITECTURE = {
    "llama": "decoder",
    "gpt_neox": "decoder",
    "phi": "decoder",
    "mistral": "decoder, grouped-query attention",
    "qwen2": "decoder, grouped-query attention",
    "gemma": "decoder, multi-query attention",
    "mixtral": "decoder, mixture of experts",
    "qwen2_moe": "decoder, mixture of experts",
    "bert": "encoder",
    "roberta": "encoder",
    "distilbert": "encoder",
    "t5": "encoder-decoder",
    "bart": "encoder-decoder",
    "whisper": "speech (encoder-decoder)",
    "wav2vec2": "speech (encoder, CTC)",
    "vit": "vision transformer",
    "swin": "vision transformer",
    "clip": "vision and text (two towers)",
    "convnext": "convolutional network",
    "efficientnet": "convolutional network",
    "resnet": "convolutional network",
    "unet": "diffusion UNet",
}


def catalog(folder):
    """The Markdown table of the zoo traces in `folder`, from their headers."""
    rows = [
        "| trace | architecture | family | mode | knob | exercises | allocs | peak allocated (GiB) "
        "| torch reserved ÷ allocated |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fn in sorted(os.listdir(folder)):
        if not fn.endswith(".trace.gz"):
            continue
        with gzip.open(os.path.join(folder, fn), "rt") as f:
            first = f.readline()
        h = json.loads(first[first.index("{") : first.rindex("}") + 1]) if "{" in first else {}
        if "family" not in h:
            continue
        rows.append(
            f"| {fn[:-9]} | {ARCHITECTURE.get(h['family'], '?')} | {h['family']} | {h['mode']} | {h['knob']} | "
            f"{h['exercises']} | {h['allocs']} | {h['peak_allocated'] / 2**30:.3f} | "
            f"{h['peak_reserved'] / max(1, h['peak_allocated']):.3f} |"
        )
    return "\n".join(rows)


def main(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    cmd, rest = argv[0], argv[1:]
    only = None
    if "--only" in rest:
        i = rest.index("--only")
        only = rest[i + 1].split(",")
        del rest[i : i + 2]
    jobs = 4
    if "--jobs" in rest:
        i = rest.index("--jobs")
        jobs = int(rest[i + 1])
        del rest[i : i + 2]
    names = [n for n in ZOO if only is None or n in only]
    unknown = sorted(set(only or ()) - set(ZOO))
    if unknown:
        print(f"zoo.py: unknown workload(s) {', '.join(unknown)}; known: {', '.join(ZOO)}", file=sys.stderr)
        return 2
    me = os.path.abspath(__file__)
    if cmd == "list":
        for n in ZOO:
            print(f"{n:22s} {ZOO[n]['family']:12s} {ZOO[n]['mode']}")
        return 0
    if cmd == "catalog" and rest:
        print(catalog(rest[0]))
        return 0
    if cmd == "_one":
        record_one(rest[0], rest[1])
        return 0
    if cmd == "_snap":
        snapshot_one(rest[0], rest[1], rest[2])
        return 0
    if cmd == "_tiny":
        import torch

        torch.set_num_threads(1)
        random.seed(1)
        torch.manual_seed(1)
        ZOO[rest[0]]["fn"](Scale(True))
        return 0
    if cmd == "record" and rest:
        cmds = [(n, [sys.executable, me, "_one", n, rest[0]]) for n in names]
    elif cmd == "snapshots" and rest:
        cmds = [(f"{n}_{how}", [sys.executable, me, "_snap", n, rest[0], how]) for n, how in SNAPSHOTS]
    elif cmd == "tiny":
        cmds = [(n, [sys.executable, me, "_tiny", n]) for n in names]
    else:
        print(
            "usage: zoo.py list | record OUTDIR | snapshots OUTDIR | tiny | catalog DIR  [--only a,b] [--jobs N]",
            file=sys.stderr,
        )
        return 2
    t0 = time.time()
    status = run_many(jobs, cmds, timeout=float(os.environ.get("ZOO_TIMEOUT", 420)))
    failed = {k: v for k, v in status.items() if v != 0}
    print(
        f"zoo.py {cmd}: {len(status) - len(failed)} of {len(status)} ran in {time.time() - t0:.0f} s"
        + (f"; failed: {', '.join(f'{k} ({v})' for k, v in failed.items())}" if failed else ""),
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
