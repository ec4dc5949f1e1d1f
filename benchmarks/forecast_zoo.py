"""Forecast specs for the zoo's members (docs/zoo.md), for benchmarks/gpu_forecast.py.

For every zoo member whose knob is batch, sequence length or resolution: its model, built from the
zoo's own config (benchmarks/zoo_registry.py, zoo_workloads.py) with random weights, run in the mode
its users run it, with the knob they turn; the other sizes are fixed at values the zoo draws from.
One step is one training step (a probe and a recording take two: the first, which makes the
optimizer's state, and a steady one), one generate call (greedy, beam search, or a diffusion sampling
of 50 denoising steps; every row makes all its tokens, so the work is the same at any batch) or one
batch of inference.  A spec is named after its member and knob (`llama_train_seq`).

ZOO_MEMBERS maps every member to its spec: four members are already run at their knob by
forecast_models.py's `--models zoo` specs.  NOT_APPLICABLE lists the members the forecast does not
apply to, with the reason.

On the CPU (`build("cpu")`) a spec builds at the zoo's toy size (`zoo.py tiny`), to check it runs.
"""

# member -> why the forecast does not apply to it
NOT_APPLICABLE = {
    "llama_compile_train": "fixed shape: a compiled training step at one shape has no knob to turn",
    "llama_compile_graphs": "CUDA graphs (torch.compile reduce-overhead): each batch is a captured graph whose "
    "memory lives in a private pool, made once per shape, not a step's allocations that grow with the batch",
}


def _scale(dev):
    from zoo_registry import Scale

    return Scale(dev == "cpu")


def _bf16():
    import torch

    return torch.bfloat16


def _half(S):
    """fp16 on the GPU; bf16 at toy size on the CPU (as `zoo.py tiny` runs the zoo's fp16 members)."""
    import torch

    return S(torch.float16, torch.bfloat16)


def _toy(S, **toy):
    """The config's defaults on the GPU (the released model's sizes, as the zoo uses them); `toy` on the CPU."""
    return toy if S.tiny else {}


_TOY_ENCODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


# ---- steps ------------------------------------------------------------------------------------------


def _train(S, m, loss_of, amp=None, params=None, lr=1e-5):
    """(step, reset): step(k) trains m one AdamW step on loss_of(k), under autocast to `amp` where
    given; reset drops the optimizer's state."""
    import torch

    opt = torch.optim.AdamW(params if params is not None else m.parameters(), lr=lr)
    m.train()

    def step(k):
        with torch.autocast(S.dev, dtype=amp or torch.bfloat16, enabled=amp is not None):
            loss = loss_of(k)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt.state.clear


def _lm(S, m, shape, amp=None, **kw):
    """A causal LM's training step on random tokens of shape(k) (labels: the inputs)."""
    import torch

    vocab = m.config.vocab_size

    def loss_of(k):
        x = torch.randint(0, vocab, shape(k), device=S.dev)
        return m(input_ids=x, labels=x).loss

    return _train(S, m, loss_of, amp, **kw)


def _vision(S, m, shape, amp):
    """An image classifier's training step on random images: shape(k) = (batch, side in pixels)."""
    import torch
    import torch.nn.functional as F

    def loss_of(k):
        b, side = shape(k)
        out = m(torch.randn(b, 3, side, side, device=S.dev))
        logits = out.logits if hasattr(out, "logits") else out
        return F.cross_entropy(logits.float(), torch.randint(0, logits.shape[-1], (b,), device=S.dev))

    return _train(S, m, loss_of, amp, lr=1e-4)


def _generate(S, m, inputs, new, **kw):
    """(step, None): step(b) is one generate call on inputs(b), every row making `new` tokens."""
    import torch

    m.eval()

    @torch.no_grad()
    def step(b):
        m.generate(**inputs(b), max_new_tokens=new, min_new_tokens=new, **kw)

    return step, None


def _causal_generate(S, m, prompt, new, **kw):
    import torch

    vocab = m.config.vocab_size

    def inputs(b):
        x = torch.randint(3, vocab, (b, prompt), device=S.dev)
        return dict(input_ids=x, attention_mask=torch.ones_like(x), pad_token_id=0)

    return _generate(S, m, inputs, new, **kw)


def _make(S, cls, cfg, dtype=None):
    """transformers' `cls` from `cfg`, its random weights made on the device, cast to `dtype` where given."""
    import torch

    with torch.device(S.dev):
        m = _hf(cls)(cfg)
    # a parameter made by the legacy torch.Tensor(n) constructor (wav2vec2's masked_spec_embed) ignores
    # the device context: move what stayed behind
    m = m.to(S.dev)
    return m.to(dtype) if dtype is not None else m


def _hf(name):
    from zoo_registry import _hf as hf

    return hf(name)


# ---- decoders: training ------------------------------------------------------------------------------


def _causal_lm(S, config, cls, dtype=None, **kw):
    """transformers' causal LM `cls` from the zoo's `config` ("module.function")."""
    import importlib

    module, function = config.rsplit(".", 1)
    return _make(S, cls, getattr(importlib.import_module(module), function)(S, **kw), dtype)


# spec -> (config, model class) of a causal LM trained at batch 4 in bf16 autocast
_CAUSAL_TRAIN = {
    "llama_train_seq": ("zoo_registry.llama_config", "LlamaForCausalLM"),
    "mistral_train_seq": ("zoo_registry.mistral_config", "MistralForCausalLM"),
    "mixtral_train_seq": ("zoo_workloads.mixtral_config", "MixtralForCausalLM"),
    "qwen2_moe_train_seq": ("zoo_registry.qwen2_moe_config", "Qwen2MoeForCausalLM"),
}


def _causal_train(config, cls):
    def build(dev):
        S = _scale(dev)
        return _lm(S, _causal_lm(S, config, cls), lambda n: (4, n), _bf16())

    return build


def build_llama_ckpt_seq(dev):
    S = _scale(dev)
    m = _causal_lm(S, "zoo_registry.llama_config", "LlamaForCausalLM", num_hidden_layers=S(16, 2))
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.config.use_cache = False
    return _lm(S, m, lambda n: (8, n), _bf16())


def build_qwen2_lora_seq(dev):
    from zoo_workloads import with_lora

    S = _scale(dev)
    base = _causal_lm(S, "zoo_workloads.qwen2_config", "Qwen2ForCausalLM", _bf16(), num_hidden_layers=S(16, 2))
    m, params = with_lora(base)
    return _lm(S, m, lambda n: (4, n), params=params, lr=1e-4)


def build_gpt_neox_fp16_seq(dev):
    """fp16 autocast with a GradScaler; reset makes a fresh scaler too, so that each recording's first
    step scales (and, where its gradients overflow, skips the optimizer) as a fresh run's does."""
    import torch
    from zoo_registry import gpt_neox_config

    S = _scale(dev)
    cfg = gpt_neox_config(S)
    m = _make(S, "GPTNeoXForCausalLM", cfg).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    scaler = [torch.amp.GradScaler(S.dev, enabled=not S.tiny)]

    def step(n):
        x = torch.randint(0, cfg.vocab_size, (4, n), device=S.dev)
        with torch.autocast(S.dev, dtype=_half(S)):
            loss = m(input_ids=x, labels=x).loss
        scaler[0].scale(loss).backward()
        scaler[0].step(opt)
        scaler[0].update()
        opt.zero_grad(set_to_none=True)

    def reset():
        opt.state.clear()
        scaler[0] = torch.amp.GradScaler(S.dev, enabled=not S.tiny)

    return step, reset


# ---- decoders and encoder-decoders: generation --------------------------------------------------------


# spec -> (config, model class, dtype, prompt, new tokens, generate's options; prompt and new
# tokens at the zoo's scale and at toy size) of a causal LM's generation
_CAUSAL_GENERATE = {
    "llama_generate_batch": ("zoo_registry.llama_config", "LlamaForCausalLM", "bf16", (512, 8), (64, 3), {}),
    "qwen2_generate_batch": ("zoo_workloads.qwen2_config", "Qwen2ForCausalLM", "bf16", (384, 8), (64, 3), {}),
    "phi_generate_batch": ("zoo_registry.phi_config", "PhiForCausalLM", "half", (512, 8), (64, 3), {}),
    "mixtral_generate_batch": ("zoo_workloads.mixtral_config", "MixtralForCausalLM", "bf16", (256, 8), (48, 3), {}),
    "gemma_beam_batch": ("zoo_registry.gemma_config", "GemmaForCausalLM", "bf16", (256, 8), (32, 3), {"num_beams": 4}),
}


def _causal_gen(config, cls, dtype, prompt, new, kw):
    def build(dev):
        S = _scale(dev)
        m = _causal_lm(S, config, cls, _bf16() if dtype == "bf16" else _half(S))
        return _causal_generate(S, m, S(*prompt), S(*new), **kw)

    return build


def build_bart_generate_batch(dev):
    import torch

    S = _scale(dev)
    toy = _toy(S, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4)
    toy.update(_toy(S, decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=1000))
    cfg = _hf("BartConfig")(**toy)
    m = _make(S, "BartForConditionalGeneration", cfg, _half(S))
    length = S(512, 16)

    def inputs(b):
        x = torch.randint(4, cfg.vocab_size, (b, length), device=S.dev)
        return dict(input_ids=x, attention_mask=torch.ones_like(x))

    return _generate(S, m, inputs, S(48, 3), num_beams=4)


def build_whisper_generate_batch(dev):
    import torch
    from zoo_workloads import whisper

    S = _scale(dev)
    cfg, _ = whisper(S)
    m = _make(S, "WhisperForConditionalGeneration", cfg, _half(S))

    def inputs(b):
        feats = torch.randn(b, 80, 2 * cfg.max_source_positions, device=S.dev, dtype=m.dtype)
        return dict(input_features=feats)

    return _generate(S, m, inputs, S(64, 3))


# ---- encoders, encoder-decoders, speech ---------------------------------------------------------------


def build_distilbert_train_batch(dev):
    import torch

    S = _scale(dev)
    toy = _toy(S, dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=1000)
    cfg = _hf("DistilBertConfig")(num_labels=2, **toy)
    m = _make(S, "DistilBertForSequenceClassification", cfg)
    length = S(256, 8)

    def loss_of(b):
        x = torch.randint(5, cfg.vocab_size, (b, length), device=S.dev)
        y = torch.randint(0, 2, (b,), device=S.dev)
        return m(input_ids=x, attention_mask=torch.ones_like(x), labels=y).loss

    return _train(S, m, loss_of, _bf16())


def build_roberta_infer_batch(dev):
    import torch

    S = _scale(dev)
    toy = _toy(S, vocab_size=1000, **_TOY_ENCODER)
    cfg = _hf("RobertaConfig")(num_labels=3, max_position_embeddings=514, **toy)
    m = _make(S, "RobertaForSequenceClassification", cfg, _half(S)).eval()
    length = S(512, 16)

    @torch.no_grad()
    def step(b):
        x = torch.randint(5, cfg.vocab_size, (b, length), device=S.dev)
        m(input_ids=x, attention_mask=torch.ones_like(x)).logits.argmax(-1).cpu()

    return step, None


def build_t5_train_seq(dev):
    """The encoder's length is the knob; the decoder's is a quarter of it (the zoo draws 128-512 and 32-128)."""
    import torch
    from zoo_registry import t5_config

    S = _scale(dev)
    cfg = t5_config(S)
    m = _make(S, "T5ForConditionalGeneration", cfg)

    def loss_of(n):
        x = torch.randint(1, cfg.vocab_size, (16, n), device=S.dev)
        y = torch.randint(1, cfg.vocab_size, (16, n // 4), device=S.dev)
        return m(input_ids=x, labels=y).loss

    return _train(S, m, loss_of, lr=1e-4)


def build_wav2vec2_ctc_seq(dev):
    """The knob is the audio's length in seconds (16 kHz), at batch 4, 12 labels a second."""
    import torch

    S = _scale(dev)
    toy = _toy(S, conv_dim=(32,) * 7, **_TOY_ENCODER)
    cfg = _hf("Wav2Vec2Config")(vocab_size=32, ctc_zero_infinity=True, **toy)
    m = _make(S, "Wav2Vec2ForCTC", cfg)

    def loss_of(secs):
        audio = torch.randn(4, 16000 * secs, device=S.dev)
        labels = torch.randint(1, 32, (4, 12 * secs), device=S.dev)
        return m(input_values=audio, labels=labels).loss

    return _train(S, m, loss_of, _bf16())


# ---- vision ------------------------------------------------------------------------------------------


def build_vit_train_batch(dev):
    S = _scale(dev)
    toy = _toy(S, image_size=32, patch_size=8, **_TOY_ENCODER)
    m = _make(S, "ViTForImageClassification", _hf("ViTConfig")(num_labels=1000, **toy))
    side = S(224, 32)
    return _vision(S, m, lambda b: (b, side), _bf16())


def build_swin_train_batch(dev):
    from zoo_workloads import timm_model

    S = _scale(dev)
    m = timm_model(S, "swin_tiny_patch4_window7_224")
    return _vision(S, m, lambda b: (b, 224), _bf16())


def build_clip_train_batch(dev):
    import torch

    S = _scale(dev)
    toy = _toy(
        S,
        text_config=dict(vocab_size=1000, **_TOY_ENCODER),
        vision_config=dict(image_size=32, patch_size=8, **_TOY_ENCODER),
    )
    m = _make(S, "CLIPModel", _hf("CLIPConfig")(**toy))
    side, length = m.config.vision_config.image_size, S(77, 16)
    vocab = m.config.text_config.vocab_size

    def loss_of(b):
        img = torch.randn(b, 3, side, side, device=S.dev)
        txt = torch.randint(0, vocab, (b, length), device=S.dev)
        return m(input_ids=txt, pixel_values=img, return_loss=True).loss

    return _train(S, m, loss_of, _bf16())


def build_efficientnet_train_res(dev):
    from zoo_workloads import timm_model

    S = _scale(dev)
    m = timm_model(S, "efficientnet_b0")
    return _vision(S, m, lambda k: (S(32, 2), 32 * k), _bf16())


def build_resnet_infer_res(dev):
    import torch
    import torchvision
    from zoo_registry import on

    S = _scale(dev)
    m = on(S, torchvision.models.resnet101(), _half(S)).eval().to(memory_format=torch.channels_last)
    batch = S(128, 2)

    @torch.no_grad()
    def step(k):
        x = torch.randn(batch, 3, 32 * k, 32 * k, device=S.dev, dtype=_half(S))
        m(x.to(memory_format=torch.channels_last)).argmax(-1).cpu()

    return step, None


def build_unet_sample_batch(dev):
    """One step is one sampling: 50 denoising steps with classifier-free guidance (a batch of 2b)."""
    import torch
    from zoo_workloads import unet

    S = _scale(dev)
    m = unet(S).to(_half(S)).eval()
    side, denoise = S(64, 8), S(50, 2)

    @torch.no_grad()
    def step(b):
        x = torch.randn(b, 4, side, side, device=S.dev, dtype=_half(S))
        for k in range(denoise):
            t = torch.full((2 * b,), 1000.0 * (1 - k / 50), device=S.dev, dtype=x.dtype)
            cond, uncond = m(torch.cat([x, x]), t).chunk(2)
            x = x - 0.02 * (uncond + 7.5 * (cond - uncond))
        x.float().cpu()

    return step, None


# ---- the specs ---------------------------------------------------------------------------------------

_SEQ = ("seq", [64, 128, 192], 16, 2)  # training at growing sequence length, in multiples of 16
_GEN = ("batch", [2, 4], 1, 1)  # one generate call at growing batch
_BATCH = ("batch", [4, 8], 1, 2)  # training at growing batch
_RES = ("resolution/32", [2, 3, 4], 1, 2)  # training at growing resolution, in steps of 32 px

# name -> (knob, recorded values, multiple, steps, build): forecast_models.Spec's arguments; the
# generations first, whose forecasts take longest, so that a pool of forecasts ends sooner
SPECS = {
    "llama_generate_batch": (*_GEN, _causal_gen(*_CAUSAL_GENERATE["llama_generate_batch"])),
    "qwen2_generate_batch": (*_GEN, _causal_gen(*_CAUSAL_GENERATE["qwen2_generate_batch"])),
    "phi_generate_batch": (*_GEN, _causal_gen(*_CAUSAL_GENERATE["phi_generate_batch"])),
    "mixtral_generate_batch": (*_GEN, _causal_gen(*_CAUSAL_GENERATE["mixtral_generate_batch"])),
    "gemma_beam_batch": (*_GEN, _causal_gen(*_CAUSAL_GENERATE["gemma_beam_batch"])),
    "bart_generate_batch": (*_GEN, build_bart_generate_batch),
    "whisper_generate_batch": (*_GEN, build_whisper_generate_batch),
    "unet_sample_batch": (*_GEN, build_unet_sample_batch),
    "llama_train_seq": (*_SEQ, _causal_train(*_CAUSAL_TRAIN["llama_train_seq"])),
    "llama_ckpt_seq": (*_SEQ, build_llama_ckpt_seq),
    "mistral_train_seq": (*_SEQ, _causal_train(*_CAUSAL_TRAIN["mistral_train_seq"])),
    "mixtral_train_seq": (*_SEQ, _causal_train(*_CAUSAL_TRAIN["mixtral_train_seq"])),
    "qwen2_moe_train_seq": (*_SEQ, _causal_train(*_CAUSAL_TRAIN["qwen2_moe_train_seq"])),
    "qwen2_lora_seq": (*_SEQ, build_qwen2_lora_seq),
    "gpt_neox_fp16_seq": (*_SEQ, build_gpt_neox_fp16_seq),
    "t5_train_seq": ("encoder seq", [64, 128, 192], 16, 2, build_t5_train_seq),
    "wav2vec2_ctc_seq": ("audio s", [1, 2, 3], 1, 2, build_wav2vec2_ctc_seq),
    "roberta_infer_batch": ("batch", [4, 8], 1, 1, build_roberta_infer_batch),
    "distilbert_train_batch": (*_BATCH, build_distilbert_train_batch),
    "vit_train_batch": (*_BATCH, build_vit_train_batch),
    "swin_train_batch": (*_BATCH, build_swin_train_batch),
    "clip_train_batch": ("batch", [4, 8, 12], 1, 2, build_clip_train_batch),
    "efficientnet_train_res": (*_RES, build_efficientnet_train_res),
    "resnet_infer_res": ("resolution/32", [2, 3, 4], 1, 1, build_resnet_infer_res),
}

# zoo member -> the spec that runs it at its knob (the specs above, and four of forecast_models.py's)
ZOO_MEMBERS = {name.rsplit("_", 1)[0]: name for name in SPECS}
ZOO_MEMBERS.update(
    bert_mlm="bert_mlm_seq", whisper_train="whisper_batch", convnext_train="convnext_res", unet_train="unet_res"
)
