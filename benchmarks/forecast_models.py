"""The models benchmarks/gpu_forecast.py forecasts and searches, built from configs with random
weights (nothing downloaded): each a Spec of its knob, the values the forecast records, the knob's
granularity, the steps a probe takes and how it is built (gpu_forecast.py's docstring describes them).
"""

from forecast_zoo import SPECS as ZOO_SPECS


class Spec:
    def __init__(self, knob, recorded, multiple, steps, build):
        self.knob = knob  # what the knob is
        self.recorded = recorded  # values the forecast records
        self.multiple = multiple  # the knob's granularity (searched in multiples of it)
        self.steps = steps  # steps per probe and per recording (training: the first and a steady one)
        self.build = build  # dev -> (step(k), reset or None)


# ---- the models ------------------------------------------------------------------------------


def _bf16_build(make, dev):
    import torch

    prev = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            return make()
    finally:
        torch.set_default_dtype(prev)


def _causal_lm_step(m, opt, vocab_size, dev, shape):
    """(step, clear) for a causal language model: step(k) trains m one step on random
    tokens of shape(k) (the labels are the inputs); clear drops the optimizer's state."""
    import torch

    def step(k):
        x = torch.randint(0, vocab_size, shape(k), device=dev)
        m(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt.state.clear


def build_llama_lora(dev):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from compare.workloads import LLAMA_CONFIG

    # the other GPU benchmarks' Llama at half the width and depth
    cfg = LlamaConfig(
        **dict(LLAMA_CONFIG, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, use_cache=False)
    )
    m = _bf16_build(lambda: LlamaForCausalLM(cfg), dev)
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m = get_peft_model(m, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    m.train()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    seq = 512
    return _causal_lm_step(m, opt, cfg.vocab_size, dev, lambda b: (b, seq))


def build_resnet50(dev):
    import torch
    import torch.nn.functional as F

    try:
        import torchvision

        m = torchvision.models.resnet50()
    except ImportError:
        import timm

        m = timm.create_model("resnet50", pretrained=False)
    m = m.to(dev).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    batch = 16

    def step(k):
        x = torch.randn(batch, 3, 32 * k, 32 * k, device=dev)
        y = torch.randint(0, 1000, (batch,), device=dev)
        F.cross_entropy(m(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt.state.clear


def build_vit(dev):
    import timm
    import torch
    import torch.nn.functional as F

    # patches of 16 px; dynamic_img_size resamples the position embedding to any grid
    m = timm.create_model("vit_base_patch16_224", pretrained=False, dynamic_img_size=True).to(dev).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    batch = 16

    def step(k):
        x = torch.randn(batch, 3, 16 * k, 16 * k, device=dev)
        y = torch.randint(0, 1000, (batch,), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):  # bf16 attention: flash, memory linear in tokens
            loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt.state.clear


def build_gpt2_seq(dev):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=4096)
    cfg._attn_implementation = "eager"  # attention scores of length x length: the quadratic term
    with torch.device(dev):
        m = GPT2LMHeadModel(cfg)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    batch = 4
    return _causal_lm_step(m, opt, cfg.vocab_size, dev, lambda n: (batch, n))


def build_llama_kv(dev):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from compare.workloads import LLAMA_CONFIG  # the 1.1B Llama of the other GPU benchmarks

    cfg = LlamaConfig(**LLAMA_CONFIG)
    m = _bf16_build(lambda: LlamaForCausalLM(cfg), dev).eval()
    m.generation_config.pad_token_id = 0
    prompt, new = 192, 64

    @torch.no_grad()
    def step(b):
        x = torch.randint(3, cfg.vocab_size, (b, prompt), device=dev)
        m.generate(
            input_ids=x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new,
            min_new_tokens=new,  # every row generates all tokens: the same work at any batch
            do_sample=False,
            use_cache=True,
        )

    return step, None


# ---- zoo families (benchmarks/zoo.py's configs), each with the knob its users turn ----------------


def _zoo():
    import zoo  # benchmarks/zoo.py, beside this file

    return zoo, zoo.Scale(False)


def _train_step(m, opt, make_batch, amp=None):
    """(step, clear): step(k) trains m one step on make_batch(k) (a dict of inputs with labels)."""
    import torch

    def step(k):
        batch = make_batch(k)
        with torch.autocast("cuda", dtype=amp, enabled=amp is not None):
            loss = m(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt.state.clear


def build_mistral_gqa(dev):
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        vocab_size=32000,
        sliding_window=4096,
    )
    m = _bf16_build(lambda: MistralForCausalLM(cfg), dev).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    return _causal_lm_step(m, opt, cfg.vocab_size, dev, lambda b: (b, 512))


def build_mixtral_moe(dev):
    import torch
    from transformers import MixtralForCausalLM

    zoo, S = _zoo()
    m = _bf16_build(lambda: MixtralForCausalLM(zoo.mixtral_config(S)), dev).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)
    return _causal_lm_step(m, opt, m.config.vocab_size, dev, lambda b: (b, 256))


def build_bert_mlm_seq(dev):
    import torch
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(max_position_embeddings=2048)
    with torch.device(dev):
        m = BertForMaskedLM(cfg).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)

    def batch(n):
        x = torch.randint(5, cfg.vocab_size, (16, n), device=dev)
        return dict(input_ids=x, attention_mask=torch.ones_like(x), labels=x)

    return _train_step(m, opt, batch, torch.float16)


def build_t5_batch(dev):
    import torch
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(d_model=512, d_ff=2048, num_layers=6, num_heads=8, vocab_size=32128, decoder_start_token_id=0)
    with torch.device(dev):
        m = T5ForConditionalGeneration(cfg).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def batch(b):
        x = torch.randint(1, cfg.vocab_size, (b, 512), device=dev)
        return dict(input_ids=x, labels=torch.randint(1, cfg.vocab_size, (b, 128), device=dev))

    return _train_step(m, opt, batch)


def build_whisper_batch(dev):
    import torch
    from transformers import WhisperForConditionalGeneration

    zoo, S = _zoo()
    cfg, _ = zoo.whisper(S)
    with torch.device(dev):
        m = WhisperForConditionalGeneration(cfg).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-5)

    def batch(b):
        return dict(
            input_features=torch.randn(b, 80, 2 * cfg.max_source_positions, device=dev),
            labels=torch.randint(0, cfg.vocab_size, (b, 96), device=dev),
        )

    return _train_step(m, opt, batch, torch.bfloat16)


def build_convnext_res(dev):
    import timm
    import torch
    import torch.nn.functional as F

    m = timm.create_model("convnext_tiny", pretrained=False).to(dev).to(memory_format=torch.channels_last).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def step(k):
        x = torch.randn(16, 3, 32 * k, 32 * k, device=dev).to(memory_format=torch.channels_last)
        y = torch.randint(0, 1000, (16,), device=dev)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(m(x).float(), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt.state.clear


def build_unet_res(dev):
    import torch
    import torch.nn.functional as F

    zoo, S = _zoo()
    m = zoo.unet(S).to(dev).train()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)

    def step(k):
        x0 = torch.randn(8, 4, 8 * k, 8 * k, device=dev)
        t = torch.rand(8, device=dev)
        noise = torch.randn_like(x0)
        xt = torch.sqrt(1 - t)[:, None, None, None] * x0 + torch.sqrt(t)[:, None, None, None] * noise
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.mse_loss(m(xt, t * 1000).float(), noise)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, opt.state.clear


MODELS = {
    "llama_lora": Spec("batch", [2, 4], 1, 2, build_llama_lora),
    "vit": Spec("patches/side", [4, 6, 8], 1, 2, build_vit),
    "gpt2_seq": Spec("seq", [128, 256, 384], 16, 2, build_gpt2_seq),
    "llama_kv": Spec("batch", [2, 4], 1, 1, build_llama_kv),
    # not run by default: cuDNN picks algorithms (and workspaces) per shape, which can make the
    # recordings at different resolutions differ in what they allocate
    "resnet50": Spec("resolution/32", [2, 3, 4], 1, 2, build_resnet50),
    # zoo families (--models zoo runs these)
    "mistral_gqa": Spec("batch", [1, 2], 1, 2, build_mistral_gqa),
    "mixtral_moe": Spec("batch", [2, 4], 1, 2, build_mixtral_moe),
    "bert_mlm_seq": Spec("seq", [64, 128, 192], 16, 2, build_bert_mlm_seq),
    "t5_batch": Spec("batch", [2, 4], 1, 2, build_t5_batch),
    "whisper_batch": Spec("batch", [1, 2], 1, 2, build_whisper_batch),
    "convnext_res": Spec("resolution/32", [2, 3, 4], 1, 2, build_convnext_res),
    "unet_res": Spec("latent side/8", [2, 3, 4], 1, 2, build_unet_res),
}
ZOO_MODELS = ["mistral_gqa", "mixtral_moe", "bert_mlm_seq", "t5_batch", "whisper_batch", "convnext_res", "unet_res"]
DEFAULT_MODELS = ["llama_lora", "vit", "gpt2_seq", "llama_kv"]

# every zoo member the forecast applies to, at the knob its users turn (benchmarks/forecast_zoo.py), and
# the seven above: --models zoo-all
MODELS.update({name: Spec(*args) for name, args in ZOO_SPECS.items()})
ZOO_ALL = list(ZOO_SPECS) + ZOO_MODELS
