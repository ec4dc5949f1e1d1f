"""Capture allocation traces of real models (random weights, nothing downloaded) with PyTorch's own
allocator and its memory history. Usage on a machine with a GPU: python3 benchmarks/capture_trace.py WORKLOAD OUTDIR
(RECORD=0 to only print the native allocator's peak figures; set PYTORCH_CUDA_ALLOC_CONF to compare settings).

The multi-stream workloads (prefetch_loader, overlap_comm, two_stream_pipeline: compare/multistream.py)
also run without a GPU: `capture_trace.py --dry-run WORKLOAD OUTDIR` runs their small CPU versions and
writes a synthetic trace of the tensors they allocate on side streams or hand between streams (its
header says "dry_run": true; it is a test of the plumbing, not a recording)."""

import gzip
import json
import os
import random
import sys
import time
import torch

from compare import multistream, workloads

argv = sys.argv[1:]
dry_run = "--dry-run" in argv
argv = [a for a in argv if a != "--dry-run"]
if len(argv) != 2:
    sys.exit("usage: capture_trace.py [--dry-run] WORKLOAD OUTDIR")
name, outdir = argv
record = os.environ.get("RECORD", "1") == "1"
conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")
dev = "cpu" if dry_run else "cuda"
if dry_run:
    torch.set_num_threads(1)  # small models; several captures may run side by side
random.seed(1234)
torch.manual_seed(1234)


def train(workload, steps):
    # the model, optimizer, step and shape draws that figures 4 and 5 and gpu_train.py time
    w = workloads.build(workload, dev, seed=None, on_device=False)
    for _ in range(steps):
        w.step(*w.draw(random))


def wl_gpt2_varlen():
    train("gpt2_varlen", 14)


def wl_llama_lora_ckpt():
    train("llama_lora_ckpt", 12)


def wl_resnet50_multires():
    train("resnet50_multires", 15)


def wl_gpt2_generate():
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(n_layer=24, n_embd=1024, n_head=16)).to(dev).eval()
    with torch.no_grad():
        for step in range(10):
            B = random.choice([1, 4, 8, 16])
            L = random.choice([32, 128, 256, 512])
            x = torch.randint(0, 50257, (B, L), device=dev)
            m.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=random.choice([16, 48, 96]),
                do_sample=True,
                pad_token_id=0,
            )


def wl_bert_varlen():
    from transformers import BertConfig, BertForSequenceClassification

    m = BertForSequenceClassification(BertConfig()).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    for step in range(20):
        L = random.randint(16, 512)
        B = random.choice([16, 32, 48])
        x = torch.randint(0, 30522, (B, L), device=dev)
        y = torch.randint(0, 2, (B,), device=dev)
        with torch.autocast("cuda", dtype=torch.float16):
            out = m(input_ids=x, labels=y)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del out, x, y


def wl_seed_fragmentation():
    # the seeds' pattern: many varied-size alloc/free cycles, then a large request
    keep = []
    for i in range(400):
        t = torch.empty(random.choice([1, 3, 5, 9, 17, 33]) << 20, dtype=torch.uint8, device=dev)
        if i % 3 == 0:
            keep.append(t)
        if len(keep) > 40:
            keep.pop(random.randrange(len(keep)))
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    del big, keep


def multi_stream(workload):
    # side streams hand tensors over with record_stream (compare/multistream.py)
    return lambda: multistream.run(workload, dev, random, steps=3 if dry_run else None, tiny=dry_run)


def header(res):
    return "# action addr size stream  (from torch.cuda.memory._snapshot device_traces; " + json.dumps(res) + ")\n"


W = {k[3:]: v for k, v in globals().items() if k.startswith("wl_")}
W.update({w: multi_stream(w) for w in multistream.MULTISTREAM})
if name not in W:
    sys.exit(f"capture_trace.py: unknown workload {name!r} (choose from {', '.join(sorted(W))})")
if dry_run:
    if name not in multistream.MULTISTREAM:
        sys.exit(f"capture_trace.py: --dry-run runs only {', '.join(multistream.MULTISTREAM)}")
    t0 = time.time()
    streams = W[name]()
    import gc

    gc.collect()
    lines = streams.trace_lines()
    res = dict(workload=name, conf=conf, dry_run=True, seconds=round(time.time() - t0, 2), events=len(lines))
    res["streams"] = len({ln.split()[3] for ln in lines})
    print(json.dumps(res), flush=True)
    os.makedirs(outdir, exist_ok=True)
    with gzip.open(os.path.join(outdir, f"{name}.trace.gz"), "wt") as f:
        f.write(header(res).replace("from torch.cuda.memory._snapshot device_traces", "synthetic, --dry-run"))
        f.write("".join(ln + "\n" for ln in lines))
    sys.exit(0)
torch.empty(1, device=dev)
if record:
    torch.cuda.memory._record_memory_history(
        enabled="all", context=("all" if name == "seed_fragmentation" else None), stacks="python", max_entries=5_000_000
    )
torch.cuda.reset_peak_memory_stats()
t0 = time.time()
W[name]()
torch.cuda.synchronize()
dt = time.time() - t0
st = torch.cuda.memory_stats()
res = dict(
    workload=name,
    conf=conf,
    seconds=round(dt, 2),
    peak_allocated=st["allocated_bytes.all.peak"],
    peak_reserved=st["reserved_bytes.all.peak"],
    retries=st.get("num_alloc_retries"),
    ooms=st.get("num_ooms"),
    allocs=st["allocation.all.allocated"],
    segments_peak=st["segment.all.peak"],
)
res["reserved_over_allocated"] = round(res["peak_reserved"] / max(1, res["peak_allocated"]), 4)
print(json.dumps(res), flush=True)
if record:
    snap = torch.cuda.memory._snapshot()
    tr = snap["device_traces"][0]
    # each entry's stream is the cudaStream_t its block belongs to (0: the default stream); a block
    # handed to other streams with record_stream has its free_completed after its free_requested
    res["streams"] = len({int(e.get("stream", 0)) for e in tr if e["action"] == "alloc"})
    res["deferred_frees"] = sum(
        1
        for e, nxt in zip(tr, tr[1:] + [None])
        if e["action"] == "free_requested"
        and (nxt is None or nxt["action"] != "free_completed" or nxt["addr"] != e["addr"])
    )
    os.makedirs(outdir, exist_ok=True)
    with gzip.open(os.path.join(outdir, f"{name}.trace.gz"), "wt") as f:
        f.write(header(res))
        for e in tr:
            f.write(f"{e['action']} {e['addr']} {e['size']} {int(e.get('stream', 0))}\n")
    print(json.dumps({"trace_entries": len(tr), "streams": res["streams"]}), flush=True)
    if name == "seed_fragmentation":
        import pickle

        with gzip.open(os.path.join(outdir, "sample_snapshot.pickle.gz"), "wb") as f:
            pickle.dump(snap, f)
