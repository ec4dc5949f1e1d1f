"""Training workloads of figures 4 and 5: the models of benchmarks/capture_trace.py (random weights,
nothing downloaded), with the same per-step shape draws, so step times compare like for like.

Models are built directly on the GPU (``with torch.device``) in their training dtype: building a
1B-parameter Llama on the CPU takes seconds of random initialisation per attempt, and building it
in fp32 before casting would put a transient 4 GiB on the device that is no part of training.
"""

from __future__ import annotations

import random
import time
from typing import Callable, List, Optional, Tuple

WORKLOADS = ["gpt2_varlen", "resnet50_multires", "llama_lora_ckpt"]

LLAMA_CONFIG = dict(
    hidden_size=2048,
    intermediate_size=5504,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=16,
    vocab_size=32000,
    max_position_embeddings=4096,
)


class Workload:
    """A model with its optimizer and a step function step(batch, length)."""

    def __init__(
        self, name: str, model, opt, step: Callable[[int, int], None], draw: Callable[[random.Random], Tuple[int, int]]
    ):
        self.name, self.model, self.opt, self._step, self.draw = name, model, opt, step, draw

    def step(self, batch: int, length: int) -> None:
        self._step(batch, length)


def _gpt2(dev):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    with torch.device(dev):
        m = GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12))
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def step(b, n):
        x = torch.randint(0, 50257, (b, n), device=dev)
        out = m(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Workload("gpt2_varlen", m, opt, step, lambda rng: (8, rng.choice([128, 192, 256, 384, 512, 640, 768, 1024])))


def _resnet(dev):
    import torch
    import torchvision

    with torch.device(dev):
        m = torchvision.models.resnet50()
    m = m.to(memory_format=torch.channels_last)
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    state = {"i": 0}

    def step(b, s):
        x = torch.randn(b, 3, s, s, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (b,), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def draw(rng):
        s = [160, 224, 288][state["i"] % 3]
        state["i"] += 1
        return rng.choice([32, 64, 96]), s

    return Workload("resnet50_multires", m, opt, step, draw)


def _llama(dev):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft import LoraConfig, get_peft_model

    cfg = LlamaConfig(**LLAMA_CONFIG)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            m = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(prev)
    m = m.to(torch.bfloat16)  # no-op when built in bf16; guards a version that ignores the default
    m.gradient_checkpointing_enable()
    m.enable_input_require_grads()
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.05))
    m.train()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)

    def step(b, n):
        x = torch.randint(0, 32000, (b, n), device=dev)
        out = m(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return Workload("llama_lora_ckpt", m, opt, step, lambda rng: (4, rng.choice([256, 512, 768, 1024, 1536, 2048])))


BUILDERS = {"gpt2_varlen": _gpt2, "resnet50_multires": _resnet, "llama_lora_ckpt": _llama}


def build(name: str, dev: str = "cuda", seed: int = 1234) -> Workload:
    import torch

    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})")
    torch.manual_seed(seed)
    return BUILDERS[name](dev)


def timed_steps(w: Workload, steps: int, seed: int = 1234, sync: Optional[Callable[[], None]] = None) -> List[dict]:
    """Run `steps` steps with the capture's shape draws; each step is timed between device syncs."""
    rng = random.Random(seed)
    out = []
    for i in range(steps):
        b, n = w.draw(rng)
        if sync:
            sync()
        t0 = time.perf_counter()
        w.step(b, n)
        if sync:
            sync()
        out.append({"step": i + 1, "batch": b, "size": n, "seconds": time.perf_counter() - t0})
    return out


def median_from(steps: List[dict], first: int) -> Optional[float]:
    """Median step time of steps first..N (1-based), the warm-up steps left out."""
    xs = sorted(s["seconds"] for s in steps if s["step"] >= first)
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
