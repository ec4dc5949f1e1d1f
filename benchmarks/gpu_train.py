"""Training step time, torch's caching allocator vs gpumem, on the three workloads of
benchmarks/capture_trace.py (random weights, nothing downloaded).

    python benchmarks/gpu_train.py [--json FILE] [--rounds R] [--workloads a,b,c]

Each (workload, allocator) runs in a fresh process of the same kind; rounds alternate
native and gpumem.  A step is timed from its first kernel launch to a device
synchronisation; the first WARMUP steps (cuDNN/cuBLAS set-up) are left out and the
median of the rest is reported.  Both allocators see the same shapes in the same order.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import time

WARMUP = 3


def run(name, use, steps):
    import torch

    if use == "gpumem":
        import gpumem

        gpumem.install()
    dev = "cuda"
    random.seed(1234)
    torch.manual_seed(1234)
    times = []

    def timed(step_fn):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)

    if name == "gpt2_varlen":
        from transformers import GPT2Config, GPT2LMHeadModel

        m = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12)).to(dev)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

        def step():
            L = random.choice([128, 192, 256, 384, 512, 640, 768, 1024])
            x = torch.randint(0, 50257, (8, L), device=dev)
            out = m(input_ids=x, labels=x)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif name == "llama_lora_ckpt":
        from peft import LoraConfig, get_peft_model
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            hidden_size=2048,
            intermediate_size=5504,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            vocab_size=32000,
            max_position_embeddings=4096,
        )
        m = LlamaForCausalLM(cfg).to(dev, dtype=torch.bfloat16)
        m.gradient_checkpointing_enable()
        m.enable_input_require_grads()
        m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.05))
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
        m.train()

        def step():
            L = random.choice([256, 512, 768, 1024, 1536, 2048])
            x = torch.randint(0, 32000, (4, L), device=dev)
            out = m(input_ids=x, labels=x)
            out.loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    elif name == "resnet50_multires":
        import torchvision

        m = torchvision.models.resnet50().to(dev).to(memory_format=torch.channels_last)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        k = [0]

        def step():
            s = [160, 224, 288][k[0] % 3]
            B = random.choice([32, 64, 96])
            k[0] += 1
            x = torch.randn(B, 3, s, s, device=dev).to(memory_format=torch.channels_last)
            y = torch.randint(0, 1000, (B,), device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = torch.nn.functional.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        raise SystemExit(f"unknown workload {name}")
    for _ in range(steps):
        timed(step)
    st = torch.cuda.memory_stats()
    body = times[WARMUP:]
    return dict(
        workload=name,
        allocator=use,
        median_ms=statistics.median(body) * 1e3,
        mean_ms=statistics.mean(body) * 1e3,
        steps=len(body),
        peak_allocated=st["allocated_bytes.all.peak"],
        peak_reserved=st["reserved_bytes.all.peak"],
        step_ms=[round(t * 1e3, 3) for t in times],
        num_remaps=st.get("num_remaps"),
        num_device_alloc=st.get("num_device_alloc"),
        num_sync_all_streams=st.get("num_sync_all_streams"),
        num_alloc_retries=st.get("num_alloc_retries"),
    )


STEPS = {"gpt2_varlen": 24, "resnet50_multires": 24, "llama_lora_ckpt": 16}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", nargs=2, metavar=("WORKLOAD", "ALLOCATOR"))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--workloads", default=",".join(STEPS))
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run(a.one[0], a.one[1], STEPS[a.one[0]])), flush=True)
        return
    rows = []
    for name in a.workloads.split(","):
        for _ in range(a.rounds):
            for use in ("native", "gpumem"):
                p = subprocess.run([sys.executable, __file__, "--one", name, use], capture_output=True, text=True)
                line = [l for l in p.stdout.splitlines() if l.startswith("{")]
                if p.returncode or not line:
                    print(f"{name} {use} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
                    continue
                rows.append(json.loads(line[-1]))
    print(
        "| workload | native ms (median step) | gpumem ms | gpumem / native | peak reserved native GiB | gpumem GiB |"
    )
    print("|---|---|---|---|---|---|")
    for name in a.workloads.split(","):
        n = [r for r in rows if r["workload"] == name and r["allocator"] == "native"]
        g = [r for r in rows if r["workload"] == name and r["allocator"] == "gpumem"]
        if not n or not g:
            print(f"| {name} | {'failed' if not n else ''} | {'failed' if not g else ''} | | | |")
            continue
        nm = statistics.median(r["median_ms"] for r in n)
        gm = statistics.median(r["median_ms"] for r in g)
        print(
            f"| {name} | {nm:.2f} | {gm:.2f} | {gm / nm:.3f} | {max(r['peak_reserved'] for r in n) / 2**30:.2f} | "
            f"{max(r['peak_reserved'] for r in g) / 2**30:.2f} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
