"""The zoo's language workloads: decoder LLMs (training, LoRA, generation, torch.compile), mixtures of
experts, encoders and encoder-decoders.  Each function is a workload (@workload), as benchmarks/zoo.py
recorded it.
"""

from __future__ import annotations

import random

from zoo_registry import _bf16, _hf, autocast, causal_generate, causal_train, llama_config, on, workload


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
    cfg = _hf("MistralConfig")(
        hidden_size=S(1024, 64),
        intermediate_size=S(3584, 128),
        num_hidden_layers=S(10, 2),
        num_attention_heads=S(16, 4),
        num_key_value_heads=S(4, 2),
        vocab_size=S(32000, 1000),
        sliding_window=S(512, 8),
    )
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


@workload(
    "qwen2", "LoRA fine-tune, bf16 weights, activation checkpointing", "frozen base, small optimizer", "sequence length"
)
def wl_qwen2_lora(S):
    from peft import LoraConfig, get_peft_model

    m = on(S, _hf("Qwen2ForCausalLM")(qwen2_config(S, num_hidden_layers=S(16, 2))), _bf16())
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.enable_input_require_grads()
    m.config.use_cache = False
    cfg = LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"
    )
    m = get_peft_model(m, cfg)
    params = [p for p in m.parameters() if p.requires_grad]
    causal_train(S, m, qwen2_config(S).vocab_size, 10, [4], S([256, 1024, 2048], [8, 16]), params=params, lr=1e-4)


@workload("gemma", "beam-search generation, bf16", "beams reorder the KV cache", "batch")
def wl_gemma_beam(S):
    cfg = _hf("GemmaConfig")(
        hidden_size=S(1024, 64),
        intermediate_size=S(4096, 128),
        num_hidden_layers=S(8, 2),
        num_attention_heads=S(8, 4),
        num_key_value_heads=S(1, 1),
        head_dim=S(128, 16),
        vocab_size=S(32000, 1000),
    )
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
    cfg = _hf("Qwen2MoeConfig")(
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
    m = on(S, _hf("Qwen2MoeForCausalLM")(cfg))
    causal_train(S, m, cfg.vocab_size, 8, [4], S([256, 512, 1024], [8, 16]), amp=_bf16())


# -- older decoders: GPT-NeoX, Phi -------------------------------------------------------------------


@workload("gpt_neox", "train AdamW, fp16 autocast with a GradScaler", "fp16 loss scaling, fused QKV", "sequence length")
def wl_gpt_neox_fp16(S):
    import torch

    cfg = _hf("GPTNeoXConfig")(
        hidden_size=S(1024, 64),
        intermediate_size=S(4096, 128),
        num_hidden_layers=S(12, 2),
        num_attention_heads=S(16, 4),
        vocab_size=S(50432, 1000),
    )
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

    cfg = _hf("PhiConfig")(
        hidden_size=S(1024, 64),
        intermediate_size=S(4096, 128),
        num_hidden_layers=S(12, 2),
        num_attention_heads=S(16, 4),
        vocab_size=S(51200, 1000),
    )
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

    cfg = _hf("T5Config")(
        d_model=S(512, 64),
        d_ff=S(2048, 128),
        num_layers=S(6, 2),
        num_heads=S(8, 4),
        vocab_size=S(32128, 1000),
        decoder_start_token_id=0,
    )
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
