"""The zoo's registry (ZOO, filled by @workload) and what its workloads share: the toy or full Scale,
autocast, the training and generation loops, the models' configs (benchmarks/forecast_zoo.py builds
from them too), model building on the device (benchmarks/zoo.py runs them; zoo_workloads.py holds the
workloads).
"""

from __future__ import annotations

import random

ZOO = {}


def workload(family, mode, exercises, knob):
    """Register a workload: family (model family), mode (how it runs), exercises (what it stresses),
    knob (what varies between its steps)."""

    def add(fn):
        ZOO[fn.__name__[3:]] = dict(fn=fn, family=family, mode=mode, exercises=exercises, knob=knob)
        return fn

    return add


class Scale:
    """Full size on a GPU; toy size on the CPU (`tiny`), to check a workload runs before spending GPU time."""

    def __init__(self, tiny):
        self.tiny = tiny
        self.dev = "cpu" if tiny else "cuda"

    def __call__(self, full, toy):
        return toy if self.tiny else full

    def steps(self, n):
        return 2 if self.tiny else n


def autocast(S, dtype):
    import torch

    return torch.autocast(S.dev, dtype=dtype)


# -- shared loops ------------------------------------------------------------------------------------


def causal_train(S, model, vocab, steps, batches, lengths, amp=None, lr=1e-5, params=None):
    import torch

    opt = torch.optim.AdamW(params if params is not None else model.parameters(), lr=lr)
    model.train()
    for _ in range(S.steps(steps)):
        B, L = random.choice(batches), random.choice(lengths)
        x = torch.randint(0, vocab, (B, L), device=S.dev)
        if amp is None:
            loss = model(input_ids=x, labels=x).loss
        else:
            with autocast(S, amp):
                loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss, x


def causal_generate(S, model, vocab, calls, batches, prompts, new_tokens, **kw):
    import torch

    model.eval()
    with torch.no_grad():
        for _ in range(S.steps(calls)):
            B, L = random.choice(batches), random.choice(prompts)
            x = torch.randint(3, vocab, (B, L), device=S.dev)
            model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=random.choice(new_tokens),
                min_new_tokens=1,
                pad_token_id=0,
                **kw,
            )
            del x


def vision_train(S, model, steps, batches, sizes, amp=None, classes=1000, channels_last=False, shape=None):
    """Classifier training with AdamW under autocast: each step a batch of B inputs of size R, both drawn;
    an input is 3 x R x R, or shape(B, R) for the whole batch (a video clip of R frames, say)."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model.train()
    for _ in range(S.steps(steps)):
        B, R = random.choice(batches), random.choice(sizes)
        x = torch.randn(*(shape(B, R) if shape else (B, 3, R, R)), device=S.dev)
        if channels_last:
            x = x.to(memory_format=torch.channels_last)
        y = torch.randint(0, classes, (B,), device=S.dev)
        with autocast(S, amp or torch.bfloat16):
            out = model(x)
            logits = out.logits if hasattr(out, "logits") else out
            loss = torch.nn.functional.cross_entropy(logits.float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y, out, logits, loss


def _hf(name):
    import transformers

    return getattr(transformers, name)


def llama_config(S, **kw):
    base = dict(
        hidden_size=S(1024, 64),
        intermediate_size=S(2816, 128),
        num_hidden_layers=S(12, 2),
        num_attention_heads=S(16, 4),
        num_key_value_heads=S(16, 4),
        vocab_size=S(32000, 1000),
        max_position_embeddings=4096,
    )
    base.update(kw)
    return _hf("LlamaConfig")(**base)


def mistral_config(S):
    return _hf("MistralConfig")(
        hidden_size=S(1024, 64),
        intermediate_size=S(3584, 128),
        num_hidden_layers=S(10, 2),
        num_attention_heads=S(16, 4),
        num_key_value_heads=S(4, 2),
        vocab_size=S(32000, 1000),
        sliding_window=S(512, 8),
    )


def gemma_config(S):
    return _hf("GemmaConfig")(
        hidden_size=S(1024, 64),
        intermediate_size=S(4096, 128),
        num_hidden_layers=S(8, 2),
        num_attention_heads=S(8, 4),
        num_key_value_heads=S(1, 1),
        head_dim=S(128, 16),
        vocab_size=S(32000, 1000),
    )


def qwen2_moe_config(S):
    return _hf("Qwen2MoeConfig")(
        hidden_size=S(768, 64),
        intermediate_size=S(2048, 128),
        moe_intermediate_size=S(512, 32),
        shared_expert_intermediate_size=S(1024, 64),
        num_experts=S(16, 4),
        num_experts_per_tok=S(4, 2),
        num_hidden_layers=S(6, 2),
        num_attention_heads=S(12, 4),
        num_key_value_heads=S(4, 2),
        vocab_size=S(32000, 1000),
    )


def gpt_neox_config(S):
    return _hf("GPTNeoXConfig")(
        hidden_size=S(1024, 64),
        intermediate_size=S(4096, 128),
        num_hidden_layers=S(12, 2),
        num_attention_heads=S(16, 4),
        vocab_size=S(50432, 1000),
    )


def phi_config(S):
    return _hf("PhiConfig")(
        hidden_size=S(1024, 64),
        intermediate_size=S(4096, 128),
        num_hidden_layers=S(12, 2),
        num_attention_heads=S(16, 4),
        vocab_size=S(51200, 1000),
    )


def t5_config(S):
    return _hf("T5Config")(
        d_model=S(512, 64),
        d_ff=S(2048, 128),
        num_layers=S(6, 2),
        num_heads=S(8, 4),
        vocab_size=S(32128, 1000),
        decoder_start_token_id=0,
    )


def on(S, model, dtype=None):

    model = model.to(S.dev)
    return model.to(dtype) if dtype is not None else model


# -- decoders: dense ---------------------------------------------------------------------------------


def _bf16():
    import torch

    return torch.bfloat16
