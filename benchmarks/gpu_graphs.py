"""torch.compile(mode="reduce-overhead") inference of a 4-layer Llama-style model (HF transformers,
random weights, built from LlamaConfig) at three batch-size/sequence-length shapes: torch's native
allocator vs native with expandable_segments vs gpumem, each in a fresh process.  `--model bert` (a
12-layer BERT masked-LM encoder, shapes batch x sequence) and `--model convnext` (ConvNeXt-tiny image
classification, shapes batch x resolution) compile other kinds of model the same way.

Per allocator: peak reserved memory (torch.cuda.max_memory_reserved), peak live memory
(max_memory_allocated) and, per shape, the median latency of one compiled call (CUDA graph replay,
after warm-up and recording).  Goal: gpumem <= 0.75 x native's peak reserved, below
expandable_segments, median latency <= 1.00 x native.

Usage on a GPU machine: python benchmarks/gpu_graphs.py [--out benchmarks/results/gpu_graphs.json]
    [--shapes 2x256,8x512,16x1024] [--iters 30] [--also gpumem:GPUMEM_CHUNK_PAGES=1]
    [--snapshots DIR] [--model llama|bert|convnext]

--also adds variants of gpumem run with environment variables set (a gpumem option, say), each in
its own fresh process, to the table; the goals compare the plain `gpumem` row.  --snapshots writes
each gpumem run's memory snapshot at the end (torch's pickle format, `torch.cuda.memory._snapshot()`,
with the run's allocation history as its device_traces) to DIR, for `python -m gpumem explain`,
`python -m gpumem replay` or torch's memory_viz.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys

from common import with_checkout_path
from compare.contenders import variant_env

REPO = pathlib.Path(__file__).resolve().parent.parent
GiB = 1 << 30

WORKER = r"""
import json, os, pickle, statistics, sys, time
mode, shapes, iters, snap, kind = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
import torch
if mode == "gpumem":
    import gpumem
    gpumem.install()
    if snap:
        gpumem.record_history(stacks=None, max_entries=4_000_000)
torch.manual_seed(0)
if kind == "llama":
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5504, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=4096)
    model = LlamaForCausalLM(cfg)
elif kind == "bert":
    from transformers import BertConfig, BertForMaskedLM
    cfg = BertConfig(max_position_embeddings=2048)
    model = BertForMaskedLM(cfg)
else:
    from transformers import ConvNextConfig, ConvNextForImageClassification
    cfg = ConvNextConfig(depths=[3, 3, 9, 3], hidden_sizes=[96, 192, 384, 768])
    model = ConvNextForImageClassification(cfg)
model = model.to(device="cuda", dtype=torch.bfloat16).eval()
f = torch.compile(model, mode="reduce-overhead", dynamic=False)   # one graph per shape


def inputs(bs, n):
    if kind == "convnext":
        return {"pixel_values": torch.randn(bs, 3, n, n, device="cuda", dtype=torch.bfloat16)}
    ids = torch.randint(0, cfg.vocab_size, (bs, n), device="cuda")
    return {"input_ids": ids, "use_cache": False} if kind == "llama" else {"input_ids": ids}


lat = {}
t0 = time.perf_counter()
with torch.no_grad():
    for bs, seq in shapes:
        x = inputs(bs, seq)
        for _ in range(3):                    # compile, warm up, record
            f(**x).logits
        torch.cuda.synchronize()
        times = []
        for _ in range(iters):
            a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
            a.record(); f(**x); b.record(); b.synchronize()
            times.append(a.elapsed_time(b))
        lat[f"{bs}x{seq}"] = statistics.median(times)
    # all shapes again, to see that every recorded graph still replays within the same memory
    for bs, seq in shapes:
        f(**inputs(bs, seq)).logits
torch.cuda.synchronize()
res = {"mode": mode, "peak_reserved": torch.cuda.max_memory_reserved(),
       "peak_allocated": torch.cuda.max_memory_allocated(),
       "reserved_end": torch.cuda.memory_reserved(), "latency_ms": lat, "wall_s": time.perf_counter() - t0,
       "torch": torch.__version__, "device": torch.cuda.get_device_name(0)}
if mode == "gpumem":
    pools = gpumem._C.registry_heap(0).pools()
    res["pools"] = len(pools)
    res["pool_live_bytes"] = sum(p["live_bytes"] for p in pools)
    res["pool_free_bytes"] = sum(p["free_bytes"] for p in pools)
    res["pool_pinned_pages"] = sum(p["pinned_pages"] for p in pools)
    res["num_remaps"] = torch.cuda.memory_stats()["num_remaps"]
    res["num_device_alloc"] = torch.cuda.memory_stats()["num_device_alloc"]
    if snap:
        with open(snap, "wb") as fh:
            pickle.dump(torch.cuda.memory._snapshot(), fh)
print("RESULT " + json.dumps(res), flush=True)
"""

MODES = ("native", "expandable_segments", "gpumem")
MODELS = {"llama": "4-layer Llama", "bert": "BERT-base masked LM", "convnext": "ConvNeXt-tiny"}


def run(mode, shapes, iters, snapshots=None, kind="llama"):
    name, _, extra = mode.partition(":")
    if extra and name != "gpumem":
        raise SystemExit(f"gpu_graphs.py: bad variant {mode!r} (want gpumem:VAR=VALUE[,VAR=VALUE])")
    base = {k: v for k, v in os.environ.items() if k != "GPUMEM_CONF"}
    try:
        env = variant_env(mode, base)
    except ValueError as e:
        raise SystemExit(f"gpu_graphs.py: bad variant {mode!r}: {e}") from None
    env = with_checkout_path(env)
    snap = ""
    if snapshots and name == "gpumem":
        os.makedirs(snapshots, exist_ok=True)
        snap = os.path.join(snapshots, f"gpu_graphs-{kind}-" + mode.replace(":", "-").replace("=", "-") + ".pickle")
    p = subprocess.run(
        [sys.executable, "-c", WORKER, "gpumem" if name == "gpumem" else "native"]
        + [json.dumps(shapes), str(iters), snap, kind],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    if p.returncode != 0 or not lines:
        raise SystemExit(f"{mode} failed (rc={p.returncode}):\n{p.stderr[-4000:]}")
    r = json.loads(lines[-1][len("RESULT ") :])
    r["mode"] = mode
    return r


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "gpu_graphs.json"))
    ap.add_argument("--shapes", default="2x256,8x512,16x1024", help="batch x seq, comma separated")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--also", default="", help="gpumem variants, ';' separated: gpumem:VAR=VALUE[,VAR=VALUE]")
    ap.add_argument("--snapshots", metavar="DIR", help="write each gpumem run's final snapshot here")
    ap.add_argument("--model", choices=("llama", "bert", "convnext"), default="llama", help="what to compile")
    args = ap.parse_args(argv)
    shapes = [[int(v) for v in s.split("x")] for s in args.shapes.split(",")]
    modes = MODES + tuple(filter(None, args.also.split(";")))
    results = {m: run(m, shapes, args.iters, args.snapshots, args.model) for m in modes}
    nat = results["native"]
    keys = [f"{b}x{s}" for b, s in shapes]
    print(
        f"torch.compile(mode='reduce-overhead'), {MODELS[args.model]} (bf16), shapes {', '.join(keys)}; "
        f"{nat['device']}, torch {nat['torch']}"
    )
    head = (
        "| allocator | peak reserved GiB | x native | peak live GiB | "
        + " | ".join(f"{k} ms (x native)" for k in keys)
        + " |"
    )
    print(head)
    print("|" + "---|" * (4 + len(keys)))
    for m in modes:
        r = results[m]
        cells = [f"{r['latency_ms'][k]:.3f} ({r['latency_ms'][k] / nat['latency_ms'][k]:.2f})" for k in keys]
        print(
            f"| {m} | {r['peak_reserved'] / GiB:.2f} | {r['peak_reserved'] / nat['peak_reserved']:.2f} | "
            f"{r['peak_allocated'] / GiB:.2f} | " + " | ".join(cells) + " |"
        )
    g, e = results["gpumem"], results["expandable_segments"]
    goals = {
        "reserved_le_0.75_native": g["peak_reserved"] <= 0.75 * nat["peak_reserved"],
        "reserved_below_expandable": g["peak_reserved"] < e["peak_reserved"],
        "median_latency_le_native": all(g["latency_ms"][k] <= nat["latency_ms"][k] for k in keys),
    }
    print("goals:", ", ".join(f"{k}={'met' if v else 'MISSED'}" for k, v in goals.items()))
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "shapes": keys, "results": results, "goals": goals}, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
