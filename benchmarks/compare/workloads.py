"""The training workloads of gpumem's benchmarks (random weights, nothing downloaded): one place
for their models, optimizers, steps and per-step shape draws, used by figures 4 and 5
(gpu_compare.py), benchmarks/capture_trace.py (which recorded the shipped traces of these three)
and benchmarks/gpu_train.py, so that step times and traces compare like for like.

For figures 4 and 5 models are built directly on the GPU (``with torch.device``) in their training
dtype: building a 1B-parameter Llama on the CPU takes seconds of random initialisation per attempt,
and building it in fp32 before casting would put a transient 4 GiB on the device that is no part of
training.  capture_trace.py and gpu_train.py build on the CPU and move the model (``on_device=False``),
as they always have.
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


def _place(make: Callable, dev, on_device: bool, dtype=None):
    """The model make() builds, on `dev`: built there (on_device; in `dtype` if given) or built on
    the CPU and moved (and cast)."""
    import torch

    if not on_device:
        return make().to(dev) if dtype is None else make().to(dev, dtype=dtype)
    if dtype is None:
        with torch.device(dev):
            return make()
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            m = make()
    finally:
        torch.set_default_dtype(prev)
    return m.to(dtype)  # no-op when built in dtype; guards a version that ignores the default


def _lm_step(m, opt, vocab: int, dev) -> Callable[[int, int], None]:
    """A causal language model's training step on b x n random tokens (the labels are the input)."""
    import torch

    def step(b, n):
        x = torch.randint(0, vocab, (b, n), device=dev)
        out = m(input_ids=x, labels=x)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _gpt2(dev, on_device):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    m = _place(lambda: GPT2LMHeadModel(GPT2Config(n_layer=12, n_embd=768, n_head=12)), dev, on_device)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    step = _lm_step(m, opt, 50257, dev)
    return Workload("gpt2_varlen", m, opt, step, lambda rng: (8, rng.choice([128, 192, 256, 384, 512, 640, 768, 1024])))


def _resnet(dev, on_device):
    import torch
    import torchvision

    m = _place(torchvision.models.resnet50, dev, on_device)
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


def _llama(dev, on_device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from peft import LoraConfig, get_peft_model

    cfg = LlamaConfig(**LLAMA_CONFIG)
    m = _place(lambda: LlamaForCausalLM(cfg), dev, on_device, dtype=torch.bfloat16)
    m.gradient_checkpointing_enable()
    m.enable_input_require_grads()
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.05))
    m.train()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    step = _lm_step(m, opt, 32000, dev)
    return Workload("llama_lora_ckpt", m, opt, step, lambda rng: (4, rng.choice([256, 512, 768, 1024, 1536, 2048])))


BUILDERS = {"gpt2_varlen": _gpt2, "resnet50_multires": _resnet, "llama_lora_ckpt": _llama}


def build(name: str, dev: str = "cuda", seed: Optional[int] = 1234, on_device: bool = True) -> Workload:
    """Workload `name` on `dev`, torch's generator seeded with `seed` first (None: as it is).
    on_device=False builds the model on the CPU and moves it (see the top of this file)."""
    import torch

    if name not in BUILDERS:
        raise ValueError(f"unknown workload {name!r} (choose from {', '.join(WORKLOADS)})")
    if seed is not None:
        torch.manual_seed(seed)
    return BUILDERS[name](dev, on_device)


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
