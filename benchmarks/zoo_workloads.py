"""The zoo's workloads, each a function registered by @workload, as benchmarks/zoo.py recorded them:
language first (decoder LLMs: training, LoRA, generation, torch.compile; mixtures of experts; encoders
and encoder-decoders), then speech and vision (Whisper, wav2vec2, ViT, Swin, CLIP, ConvNeXt,
EfficientNet, ResNet, a diffusion UNet).  The registry and the loops they share: zoo_registry.py.
"""

from __future__ import annotations

import random

from zoo_registry import (
    _bf16,
    _hf,
    autocast,
    causal_generate,
    causal_train,
    gemma_config,
    gpt_neox_config,
    llama_config,
    mistral_config,
    on,
    phi_config,
    qwen2_moe_config,
    t5_config,
    vision_train,
    workload,
)


@workload("llama", "train AdamW, bf16 autocast", "varying sequence length", "sequence length")
def wl_llama_train(S):
    m = on(S, _hf("LlamaForCausalLM")(llama_config(S)))
    causal_train(S, m, m.config.vocab_size, 10, [4], S([256, 512, 768, 1024], [8, 16]), amp=_bf16())


@workload("llama", "train AdamW, activation checkpointing", "recomputation in backward", "sequence length")
def wl_llama_ckpt(S):
    m = on(S, _hf("LlamaForCausalLM")(llama_config(S, num_hidden_layers=S(16, 2))))
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.config.use_cache = False
    causal_train(S, m, m.config.vocab_size, 10, [8], S([512, 1024, 2048], [8, 16]), amp=_bf16())


@workload("llama", "generate with a KV cache, bf16", "growing KV cache, batch and prompt drawn", "batch")
def wl_llama_generate(S):
    m = on(S, _hf("LlamaForCausalLM")(llama_config(S)), _bf16())
    causal_generate(S, m, m.config.vocab_size, 8, [1, 4, 8, 16], S([64, 256, 512], [4, 8]), S([32, 64], [3]))


@workload("llama", "torch.compile training", "compiled graph's buffers, fused kernels", "fixed shape")
def wl_llama_compile_train(S):
    import torch

    m = on(S, _hf("LlamaForCausalLM")(llama_config(S, num_hidden_layers=S(8, 2))))
    cm = torch.compile(m)
    causal_train(S, cm, m.config.vocab_size, 8, [4], S([512], [16]), amp=_bf16(), params=m.parameters())


@workload("llama", "torch.compile reduce-overhead inference", "CUDA graphs (cudagraph trees), 3 shapes", "batch")
def wl_llama_compile_graphs(S):
    import torch

    m = on(S, _hf("LlamaForCausalLM")(llama_config(S, num_hidden_layers=S(4, 2))), _bf16()).eval()
    m.config.use_cache = False
    fwd = torch.compile(lambda x: m(input_ids=x).logits, mode="reduce-overhead" if not S.tiny else "default")
    with torch.no_grad():
        for _ in range(S.steps(12)):
            B, L = random.choice(S([(1, 128), (8, 512), (32, 256)], [(1, 8), (2, 8)]))
            x = torch.randint(0, m.config.vocab_size, (B, L), device=S.dev)
            y = fwd(x)
            y = y.clone()
            del x, y


# -- decoders: grouped-query attention ---------------------------------------------------------------


@workload("mistral", "train AdamW, bf16 autocast", "grouped-query attention, sliding window", "sequence length")
def wl_mistral_train(S):
    cfg = mistral_config(S)
    m = on(S, _hf("MistralForCausalLM")(cfg))
    causal_train(S, m, cfg.vocab_size, 10, [4, 8], S([256, 512, 1024], [8, 16]), amp=_bf16())


def qwen2_config(S, **kw):
    base = dict(
        hidden_size=S(896, 64),
        intermediate_size=S(4864, 128),
        num_hidden_layers=S(12, 2),
        num_attention_heads=S(14, 4),
        num_key_value_heads=S(2, 2),
        vocab_size=S(32000, 1000),
    )
    base.update(kw)
    return _hf("Qwen2Config")(**base)


@workload("qwen2", "generate with a KV cache, bf16", "grouped-query attention, batch-1 fast paths", "batch")
def wl_qwen2_generate(S):
    m = on(S, _hf("Qwen2ForCausalLM")(qwen2_config(S)), _bf16())
    causal_generate(S, m, m.config.vocab_size, 8, [1, 2, 4, 8, 16], S([32, 128, 384], [4, 8]), S([32, 64], [3]))


def with_lora(base):
    """A causal LM with LoRA adapters on its attention projections, activation checkpointing on and no KV
    cache: (the model, the parameters it trains)."""
    from peft import LoraConfig, get_peft_model

    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    base.enable_input_require_grads()
    base.config.use_cache = False
    cfg = LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"
    )
    m = get_peft_model(base, cfg)
    return m, [p for p in m.parameters() if p.requires_grad]


@workload(
    "qwen2", "LoRA fine-tune, bf16 weights, activation checkpointing", "frozen base, small optimizer", "sequence length"
)
def wl_qwen2_lora(S):
    m, params = with_lora(on(S, _hf("Qwen2ForCausalLM")(qwen2_config(S, num_hidden_layers=S(16, 2))), _bf16()))
    causal_train(S, m, qwen2_config(S).vocab_size, 10, [4], S([256, 1024, 2048], [8, 16]), params=params, lr=1e-4)


@workload("gemma", "beam-search generation, bf16", "beams reorder the KV cache", "batch")
def wl_gemma_beam(S):
    cfg = gemma_config(S)
    m = on(S, _hf("GemmaForCausalLM")(cfg), _bf16())
    causal_generate(S, m, cfg.vocab_size, 6, [1, 2, 4], S([64, 256], [4, 8]), S([32], [3]), num_beams=4)


# -- decoders: mixture of experts --------------------------------------------------------------------


def mixtral_config(S):
    return _hf("MixtralConfig")(
        hidden_size=S(768, 64),
        intermediate_size=S(2048, 128),
        num_hidden_layers=S(8, 2),
        num_attention_heads=S(12, 4),
        num_key_value_heads=S(4, 2),
        num_local_experts=8,
        num_experts_per_tok=2,
        vocab_size=S(32000, 1000),
    )


@workload(
    "mixtral", "train AdamW, bf16 autocast", "mixture of experts: token counts per expert vary", "sequence length"
)
def wl_mixtral_train(S):
    m = on(S, _hf("MixtralForCausalLM")(mixtral_config(S)))
    causal_train(S, m, m.config.vocab_size, 10, [4], S([256, 512, 1024], [8, 16]), amp=_bf16())


@workload("mixtral", "generate with a KV cache, bf16", "mixture of experts at decode time", "batch")
def wl_mixtral_generate(S):
    m = on(S, _hf("MixtralForCausalLM")(mixtral_config(S)), _bf16())
    causal_generate(S, m, m.config.vocab_size, 6, [1, 4, 8], S([64, 256], [4, 8]), S([32, 48], [3]))


@workload("qwen2_moe", "train AdamW, bf16 autocast", "shared expert plus routed experts", "sequence length")
def wl_qwen2_moe_train(S):
    cfg = qwen2_moe_config(S)
    m = on(S, _hf("Qwen2MoeForCausalLM")(cfg))
    causal_train(S, m, cfg.vocab_size, 8, [4], S([256, 512, 1024], [8, 16]), amp=_bf16())


# -- older decoders: GPT-NeoX, Phi -------------------------------------------------------------------


@workload("gpt_neox", "train AdamW, fp16 autocast with a GradScaler", "fp16 loss scaling, fused QKV", "sequence length")
def wl_gpt_neox_fp16(S):
    import torch

    cfg = gpt_neox_config(S)
    m = on(S, _hf("GPTNeoXForCausalLM")(cfg))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    scaler = torch.amp.GradScaler(S.dev, enabled=not S.tiny)
    for _ in range(S.steps(10)):
        L = random.choice(S([128, 256, 512, 1024], [8, 16]))
        x = torch.randint(0, cfg.vocab_size, (4, L), device=S.dev)
        with autocast(S, torch.float16 if not S.tiny else torch.bfloat16):
            loss = m(input_ids=x, labels=x).loss
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        del loss, x


@workload("phi", "generate with a KV cache, fp16", "partial rotary, parallel attention and MLP", "batch")
def wl_phi_generate(S):
    import torch

    cfg = phi_config(S)
    m = on(S, _hf("PhiForCausalLM")(cfg), torch.float16 if not S.tiny else torch.bfloat16)
    causal_generate(S, m, cfg.vocab_size, 8, [1, 4, 8, 16], S([32, 128, 512], [4, 8]), S([32, 64], [3]))


# -- encoders ----------------------------------------------------------------------------------------


def encoder_train(S, m, vocab, steps, batches, lengths, labels_fn, amp):
    import torch

    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    m.train()
    for _ in range(S.steps(steps)):
        B, L = random.choice(batches), random.choice(lengths)
        x = torch.randint(5, vocab, (B, L), device=S.dev)
        with autocast(S, amp):
            loss = m(input_ids=x, attention_mask=torch.ones_like(x), labels=labels_fn(x)).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, loss


@workload("bert", "masked-LM pre-training, fp16 autocast", "batch and length drawn each step", "sequence length")
def wl_bert_mlm(S):
    import torch

    cfg = _hf("BertConfig")(
        **(
            {}
            if not S.tiny
            else dict(
                hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=1000
            )
        )
    )
    m = on(S, _hf("BertForMaskedLM")(cfg))

    def labels(x):
        y = x.clone()
        y[torch.rand(x.shape, device=x.device) > 0.15] = -100
        return y

    encoder_train(
        S, m, cfg.vocab_size, 12, [16, 32], S([64, 128, 256, 512], [8, 16]), labels, S(torch.float16, torch.bfloat16)
    )


@workload("roberta", "batched inference (classification), fp16", "no autograd, many shapes", "batch")
def wl_roberta_infer(S):
    import torch

    cfg = _hf("RobertaConfig")(
        num_labels=3,
        max_position_embeddings=514,  # positions start after the padding index, as in the released models
        **(
            {}
            if not S.tiny
            else dict(
                hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=1000
            )
        ),
    )
    m = on(S, _hf("RobertaForSequenceClassification")(cfg), S(torch.float16, torch.bfloat16)).eval()
    with torch.no_grad():
        for _ in range(S.steps(30)):
            B, L = random.choice([1, 8, 32, 64, 128]), random.choice(S([32, 64, 128, 256, 512], [8, 16]))
            x = torch.randint(5, cfg.vocab_size, (B, L), device=S.dev)
            m(input_ids=x, attention_mask=torch.ones_like(x)).logits.argmax(-1).cpu()
            del x


@workload("distilbert", "fine-tune for classification, bf16 autocast", "small encoder, large batches", "batch")
def wl_distilbert_train(S):
    import torch

    kw = {} if not S.tiny else dict(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=1000)
    cfg = _hf("DistilBertConfig")(num_labels=2, **kw)
    m = on(S, _hf("DistilBertForSequenceClassification")(cfg))
    encoder_train(
        S,
        m,
        cfg.vocab_size,
        12,
        [32, 64, 128],
        S([128, 256], [8]),
        lambda x: torch.randint(0, 2, (x.shape[0],), device=x.device),
        _bf16(),
    )


# -- encoder-decoders --------------------------------------------------------------------------------


@workload("t5", "train AdamW (fp32)", "encoder and decoder lengths drawn apart", "sequence length")
def wl_t5_train(S):
    import torch

    cfg = t5_config(S)
    m = on(S, _hf("T5ForConditionalGeneration")(cfg))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for _ in range(S.steps(10)):
        B = random.choice([8, 16])
        Le, Ld = random.choice(S([128, 256, 512], [8, 16])), random.choice(S([32, 64, 128], [4, 8]))
        x = torch.randint(1, cfg.vocab_size, (B, Le), device=S.dev)
        y = torch.randint(1, cfg.vocab_size, (B, Ld), device=S.dev)
        loss = m(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x, y, loss


@workload("bart", "summarise: beam search, fp16", "encoder outputs kept across decoding, beams", "batch")
def wl_bart_generate(S):
    import torch

    kw = (
        {}
        if not S.tiny
        else dict(
            d_model=64,
            encoder_layers=2,
            decoder_layers=2,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=128,
            decoder_ffn_dim=128,
            vocab_size=1000,
        )
    )
    cfg = _hf("BartConfig")(**kw)
    m = on(S, _hf("BartForConditionalGeneration")(cfg), S(torch.float16, torch.bfloat16)).eval()
    with torch.no_grad():
        for _ in range(S.steps(6)):
            B, L = random.choice([1, 4, 8]), random.choice(S([256, 512, 1024], [8, 16]))
            x = torch.randint(4, cfg.vocab_size, (B, L), device=S.dev)
            m.generate(
                input_ids=x, attention_mask=torch.ones_like(x), num_beams=4, max_new_tokens=S(48, 3), min_new_tokens=1
            )
            del x


# -- speech and audio --------------------------------------------------------------------------------


def whisper(S):
    import torch

    kw = dict(
        d_model=S(768, 64),
        encoder_layers=S(6, 2),
        decoder_layers=S(6, 2),
        encoder_attention_heads=S(12, 4),
        decoder_attention_heads=S(12, 4),
        encoder_ffn_dim=S(3072, 128),
        decoder_ffn_dim=S(3072, 128),
        num_mel_bins=80,
        max_source_positions=S(1500, 50),
        vocab_size=S(51865, 1000),
    )
    if S.tiny:  # the special tokens must lie inside the toy vocabulary
        kw.update(pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    cfg = _hf("WhisperConfig")(**kw)
    return cfg, torch


@workload("whisper", "train AdamW, bf16 autocast", "fixed 30 s audio windows, varying transcripts", "batch")
def wl_whisper_train(S):
    cfg, torch = whisper(S)
    m = on(S, _hf("WhisperForConditionalGeneration")(cfg))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    frames = 2 * cfg.max_source_positions
    for _ in range(S.steps(8)):
        B, Ld = random.choice([4, 8, 12]), random.choice(S([32, 96, 192], [4, 8]))
        feats = torch.randn(B, 80, frames, device=S.dev)
        labels = torch.randint(0, cfg.vocab_size, (B, Ld), device=S.dev)
        with autocast(S, _bf16()):
            loss = m(input_features=feats, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del feats, labels, loss


@workload("whisper", "transcribe: greedy generation, fp16", "encoder once, decoder with a KV cache", "batch")
def wl_whisper_generate(S):
    cfg, torch = whisper(S)
    m = on(S, _hf("WhisperForConditionalGeneration")(cfg), S(torch.float16, torch.bfloat16)).eval()
    with torch.no_grad():
        for _ in range(S.steps(6)):
            B = random.choice([1, 4, 16])
            feats = torch.randn(B, 80, 2 * cfg.max_source_positions, device=S.dev, dtype=m.dtype)
            m.generate(input_features=feats, max_new_tokens=S(64, 3), min_new_tokens=1)
            del feats


@workload(
    "wav2vec2", "CTC fine-tune, bf16 autocast", "audio length drawn each step (conv feature encoder)", "sequence length"
)
def wl_wav2vec2_ctc(S):
    import torch

    kw = (
        {}
        if not S.tiny
        else dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, conv_dim=(32,) * 7)
    )
    cfg = _hf("Wav2Vec2Config")(vocab_size=32, ctc_zero_infinity=True, **kw)
    m = on(S, _hf("Wav2Vec2ForCTC")(cfg))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    for _ in range(S.steps(10)):
        B, secs = random.choice([4, 8]), random.choice(S([4, 8, 12, 16], [1]))
        audio = torch.randn(B, 16000 * secs, device=S.dev)
        labels = torch.randint(1, 32, (B, 12 * secs), device=S.dev)
        with autocast(S, _bf16()):
            loss = m(input_values=audio, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del audio, labels, loss


# -- vision transformers -----------------------------------------------------------------------------


@workload("vit", "train AdamW, bf16 autocast", "batch drawn each step", "batch")
def wl_vit_train(S):
    kw = (
        {}
        if not S.tiny
        else dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            image_size=32,
            patch_size=8,
        )
    )
    m = on(S, _hf("ViTForImageClassification")(_hf("ViTConfig")(num_labels=1000, **kw)))
    vision_train(S, m, 10, [32, 64, 96], [S(224, 32)])


@workload("swin", "train AdamW, bf16 autocast (timm)", "windowed attention, patch merging", "batch")
def wl_swin_train(S):
    import timm

    m = on(S, timm.create_model("swin_tiny_patch4_window7_224", pretrained=False))
    vision_train(S, m, 10, [32, 64, 96], [224])


@workload("clip", "contrastive training, bf16 autocast", "two towers (image and text) in one step", "batch")
def wl_clip_train(S):
    import torch

    kw = (
        {}
        if not S.tiny
        else dict(
            text_config=dict(
                hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=1000
            ),
            vision_config=dict(
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=128,
                image_size=32,
                patch_size=8,
            ),
        )
    )
    m = on(S, _hf("CLIPModel")(_hf("CLIPConfig")(**kw)))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    size = m.config.vision_config.image_size
    for _ in range(S.steps(10)):
        B, L = random.choice([32, 64, 128]), random.choice([16, 32, 77])
        img = torch.randn(B, 3, size, size, device=S.dev)
        txt = torch.randint(0, m.config.text_config.vocab_size, (B, L), device=S.dev)
        with autocast(S, _bf16()):
            loss = m(input_ids=txt, pixel_values=img, return_loss=True).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del img, txt, loss


# -- convolutional networks --------------------------------------------------------------------------


def timm_model(S, name, **kw):
    import timm

    return on(S, timm.create_model(name, pretrained=False, **kw))


@workload(
    "convnext", "train AdamW, bf16 autocast, channels-last (timm)", "resolution and batch drawn each step", "resolution"
)
def wl_convnext_train(S):
    import torch

    m = timm_model(S, "convnext_tiny").to(memory_format=torch.channels_last)
    vision_train(S, m, 12, [16, 32, 48], [160, 192, 224, 256, 288], channels_last=True)


@workload(
    "efficientnet",
    "train AdamW, bf16 autocast (timm)",
    "depthwise convolutions, cuDNN algorithm choice by shape",
    "resolution",
)
def wl_efficientnet_train(S):
    vision_train(S, timm_model(S, "efficientnet_b0"), 12, [32, 64], [192, 224, 256, 320])


@workload(
    "resnet",
    "batched inference, fp16, channels-last (torchvision)",
    "cuDNN workspaces by shape, no autograd",
    "resolution",
)
def wl_resnet_infer(S):
    import torch
    import torchvision

    m = on(S, torchvision.models.resnet101(), torch.float16).eval().to(memory_format=torch.channels_last)
    with torch.no_grad():
        for _ in range(S.steps(30)):
            B, R = random.choice([1, 16, 64, 128]), random.choice([224, 288, 384])
            x = torch.randn(B, 3, R, R, device=S.dev, dtype=torch.float16).to(memory_format=torch.channels_last)
            m(x).argmax(-1).cpu()
            del x


# -- diffusion ---------------------------------------------------------------------------------------


def unet(S):
    """A diffusion UNet (residual blocks with time embedding, self-attention at the two lowest
    resolutions, skip connections), the architecture of DDPM / Stable Diffusion's denoiser."""
    import torch
    from torch import nn

    class Res(nn.Module):
        def __init__(self, cin, cout, tdim):
            super().__init__()
            self.n1, self.c1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
            self.t = nn.Linear(tdim, cout)
            self.n2, self.c2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
            self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

        def forward(self, x, t):
            h = self.c1(nn.functional.silu(self.n1(x))) + self.t(t)[:, :, None, None]
            return self.skip(x) + self.c2(nn.functional.silu(self.n2(h)))

    class Attn(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.n, self.a = nn.GroupNorm(8, c), nn.MultiheadAttention(c, 8, batch_first=True)

        def forward(self, x):
            B, C, H, W = x.shape
            h = self.n(x).flatten(2).transpose(1, 2)
            return x + self.a(h, h, h, need_weights=False)[0].transpose(1, 2).reshape(B, C, H, W)

    class UNet(nn.Module):
        def __init__(self, ch=(128, 256, 512, 512), tdim=512):
            super().__init__()
            self.tdim = tdim
            self.temb = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
            self.inp = nn.Conv2d(4, ch[0], 3, padding=1)
            self.down, self.up, self.attn_d, self.attn_u = (
                nn.ModuleList(),
                nn.ModuleList(),
                nn.ModuleList(),
                nn.ModuleList(),
            )
            cin = ch[0]
            for i, c in enumerate(ch):
                self.down.append(nn.ModuleList([Res(cin, c, tdim), Res(c, c, tdim)]))
                self.attn_d.append(Attn(c) if i >= len(ch) - 2 else nn.Identity())
                cin = c
            self.mid = nn.ModuleList([Res(cin, cin, tdim), Attn(cin), Res(cin, cin, tdim)])
            for i, c in reversed(list(enumerate(ch))):
                self.up.append(nn.ModuleList([Res(cin + c, c, tdim), Res(c, c, tdim)]))
                self.attn_u.append(Attn(c) if i >= len(ch) - 2 else nn.Identity())
                cin = c
            self.out = nn.Sequential(nn.GroupNorm(8, cin), nn.SiLU(), nn.Conv2d(cin, 4, 3, padding=1))

        def forward(self, x, t):
            half = self.tdim // 2
            f = torch.exp(-torch.arange(half, device=x.device) * (9.21 / half)).to(x.dtype)
            t = self.temb(torch.cat([torch.sin(t[:, None] * f), torch.cos(t[:, None] * f)], 1))
            h, skips = self.inp(x), []
            for i, (blocks, attn) in enumerate(zip(self.down, self.attn_d)):
                h = attn(blocks[1](blocks[0](h, t), t))
                skips.append(h)
                if i < len(self.down) - 1:
                    h = nn.functional.avg_pool2d(h, 2)
            h = self.mid[2](self.mid[1](self.mid[0](h, t)), t)
            for i, (blocks, attn) in enumerate(zip(self.up, self.attn_u)):
                s = skips.pop()
                if h.shape[-1] != s.shape[-1]:
                    h = nn.functional.interpolate(h, size=s.shape[-2:], mode="nearest")
                h = attn(blocks[1](blocks[0](torch.cat([h, s], 1), t), t))
            return self.out(h)

    return on(S, UNet(ch=S((128, 256, 512, 512), (16, 32, 32, 32)), tdim=S(512, 32)))


@workload(
    "unet",
    "diffusion training (noise prediction), bf16 autocast",
    "latent size and batch drawn each step",
    "resolution",
)
def wl_unet_train(S):
    import torch

    m = unet(S)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for _ in range(S.steps(10)):
        B, R = random.choice([8, 16, 32]), random.choice(S([32, 48, 64], [8, 16]))
        x0 = torch.randn(B, 4, R, R, device=S.dev)
        t = torch.rand(B, device=S.dev)
        noise = torch.randn_like(x0)
        xt = torch.sqrt(1 - t)[:, None, None, None] * x0 + torch.sqrt(t)[:, None, None, None] * noise
        with autocast(S, _bf16()):
            loss = torch.nn.functional.mse_loss(m(xt, t * 1000).float(), noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del x0, t, noise, xt, loss


@workload(
    "unet",
    "diffusion sampling (50 denoising steps, classifier-free guidance), fp16",
    "the same shapes again and again",
    "batch",
)
def wl_unet_sample(S):
    import torch

    m = unet(S).to(S(torch.float16, torch.bfloat16)).eval()
    with torch.no_grad():
        for _ in range(S.steps(3)):
            B, R = random.choice([1, 4, 8]), S(64, 8)
            x = torch.randn(B, 4, R, R, device=S.dev, dtype=m.out[2].weight.dtype)
            for k in range(S(50, 2)):
                t = torch.full((2 * B,), 1000.0 * (1 - k / 50), device=S.dev, dtype=x.dtype)
                e = m(torch.cat([x, x]), t)
                cond, uncond = e.chunk(2)
                x = x - 0.02 * (uncond + 7.5 * (cond - uncond))
                del e, cond, uncond, t
            x.float().cpu()
            del x
