"""Capture allocation traces of real models (random weights, nothing downloaded) with PyTorch's own
allocator and its memory history. Usage on a machine with a GPU: python3 benchmarks/capture_trace.py WORKLOAD OUTDIR
(RECORD=0 to only print the native allocator's peak figures; set PYTORCH_CUDA_ALLOC_CONF to compare settings)."""

import gzip
import json
import os
import random
import sys
import time
import torch

from compare import workloads

name = sys.argv[1]
outdir = sys.argv[2]
record = os.environ.get("RECORD", "1") == "1"
conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")
dev = "cuda"
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


W = {k[3:]: v for k, v in globals().items() if k.startswith("wl_")}
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
    os.makedirs(outdir, exist_ok=True)
    with gzip.open(os.path.join(outdir, f"{name}.trace.gz"), "wt") as f:
        f.write(
            "# action addr size stream  (from torch.cuda.memory._snapshot device_traces; " + json.dumps(res) + ")\n"
        )
        for e in tr:
            f.write(f"{e['action']} {e['addr']} {e['size']} {e['stream']}\n")
    print("trace entries", len(tr), flush=True)
    if name == "seed_fragmentation":
        import pickle

        with gzip.open(os.path.join(outdir, "sample_snapshot.pickle.gz"), "wb") as f:
            pickle.dump(snap, f)
