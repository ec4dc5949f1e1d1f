"""gpumem.forecast under torch on a GPU: recorded from torch's own history (native
allocator) and from gpumem's (gpumem installed), and checked against the largest
batch that really runs, probed with real steps on either side of the forecast's
margin, each in a fresh process (an OOM must not leak into the next).  Past some
size torch's reductions allocate buffers that steps at batch 2 and 4 do not show
(docs/forecast.md), so the forecast is refined (refine=True): recorded again at
half of its first answer, and at a quarter where that disagrees.  Skipped without a GPU;
benchmarks/gpu_forecast.py makes the same check on four real models.  Two more
models' recordings differ in what they allocate (cuDNN's algorithms by shape,
a decoder at batch 1 and 2): the forecast must line them up and answer too."""

import textwrap

import pytest

from helpers import cuda_devices, run_python

N_CUDA = cuda_devices()[0]
CAP = 1 << 30

PRELUDE = """
import json
import torch
import gpumem
def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""


def _setup(allocator):
    if allocator == "gpumem":
        return f"gpumem.install(cap={CAP})\n"
    # torch allows its segments the fraction times cudaMemGetInfo's total: exactly CAP, as the forecast assumes
    return f"torch.cuda.set_per_process_memory_fraction({CAP} / torch.cuda.mem_get_info()[1])\n"


def _trained(model, make_input, knob="b", after=""):
    """Child code: the model made, an AdamW step at knob value `knob` on the input `make_input`, and the
    device's cache emptied."""
    return f"""
torch.manual_seed(0)
{model}
opt = torch.optim.AdamW(model.parameters())


def step({knob}):
    x = {make_input}
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


torch.cuda.synchronize()
torch.cuda.empty_cache()
{after}"""


MODEL = _trained(
    "model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()",
    'torch.randn(b, 64, 1024, device="cuda")',
    after="torch.cuda.reset_peak_memory_stats()\n",
)


# Models whose recordings differ in what they allocate, not only in how much: a convolutional
# network at growing resolution with cuDNN choosing its algorithms by shape (their workspaces and
# temporaries differ), and a decoder block with grouped-query attention recorded at batch 1 and 2
# (batch-1 paths, the attention kernel's and cuBLAS's workspaces by shape).
CONV = _trained(
    """torch.backends.cudnn.benchmark = True
layers = []
for c_in, c_out in [(3, 64), (64, 128), (128, 256), (256, 256)]:
    layers += [torch.nn.Conv2d(c_in, c_out, 3, padding=1), torch.nn.BatchNorm2d(c_out), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers).cuda()""",
    'torch.randn(8, 3, 16 * r, 16 * r, device="cuda")',
    knob="r",
)

GQA = _trained(
    """F = torch.nn.functional


class Block(torch.nn.Module):
    def __init__(self, d=1024, heads=16, kv=4):
        super().__init__()
        self.heads, self.kv, self.hd = heads, kv, d // heads
        self.q, self.o = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.k, self.v = torch.nn.Linear(d, kv * self.hd), torch.nn.Linear(d, kv * self.hd)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.heads // self.kv, 1)
        v = self.v(x).view(b, t, self.kv, self.hd).transpose(1, 2).repeat_interleave(self.heads // self.kv, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.o(y.transpose(1, 2).reshape(b, t, -1))


model = torch.nn.Sequential(*[Block() for _ in range(4)]).cuda()""",
    'torch.randn(b, 512, 1024, device="cuda")',
)


def _run(allocator, body, model=MODEL):
    return run_python(_setup(allocator) + model + textwrap.dedent(body), PRELUDE, timeout=600)


def _fits(allocator, k, steps, model=MODEL):
    """Whether `steps` real steps at knob value k run, in a fresh process."""
    r = _run(
        allocator,
        f"""
        try:
            for _ in range({steps}):
                step({k})
            torch.cuda.synchronize()
            ok = True
        except torch.OutOfMemoryError:
            ok = False
        out(ok=ok, free=torch.cuda.mem_get_info()[0])
        """,
        model,
    )
    # an OOM with less than the cap free on the device is another process's doing, not the cap's
    assert r["ok"] or r["free"] >= CAP, f"knob {k}: the device had {r['free']} bytes free; another process holds it"
    return r["ok"]


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
@pytest.mark.parametrize("allocator", ["native", "gpumem"])
def test_forecast_against_real_steps(allocator):
    fc = _run(
        allocator,
        f"""
        fc = gpumem.forecast(step, knob=[2, 4], name="batch", capacity={CAP}, steps=2, reset=opt.state.clear,
                             refine=True)
        largest = fc.largest(allocator="{allocator}") if fc.aligned else None
        first = fc.first.largest(allocator="{allocator}") if fc.first else None
        out(aligned=fc.aligned, message=fc.alignment.message, largest=largest, recorded=fc.recorded, first=first,
            caveats=fc.caveats())
        """,
    )
    assert fc["aligned"], fc["message"]
    largest = fc["largest"]
    print(f"forecast {largest} from {fc['recorded']} (first: {fc['first']}); caveats: {fc['caveats']}")
    assert largest and largest > 4

    def fits(k):
        return _fits(allocator, k, 2)

    # The target of docs/forecast.md: within 3% of the truth (within 1 below
    # 33), the truth being the largest batch that runs two real steps.  With
    # memory monotonic in the batch, that is: the forecast less its margin runs
    # and the forecast plus its margin and one does not.
    tol = max(1, int(0.03 * largest))
    assert fits(largest - tol), f"batch {largest - tol} runs out of memory: the forecast's {largest} is too high"
    assert not fits(largest + tol + 1), f"batch {largest + tol + 1} runs: the forecast's {largest} is too low"


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
@pytest.mark.parametrize("allocator", ["native", "gpumem"])
@pytest.mark.parametrize("name,knob", [("conv", [2, 3, 4]), ("gqa", [1, 2])])
def test_forecast_answers_where_recordings_differ(name, knob, allocator):
    """Recordings that differ in what they allocate are lined up and what only some make is
    modelled: the forecast answers for both allocators, within 3% (1 below 33) of real steps."""
    model = {"conv": CONV, "gqa": GQA}[name]
    fc = _run(
        allocator,
        f"""
        fc = gpumem.forecast(step, knob={knob}, name="knob", capacity={CAP}, reset=opt.state.clear, refine=True)
        answers = {{a: fc.largest(allocator=a) for a in ("gpumem", "native")}} if fc.aligned else None
        out(aligned=fc.aligned, message=fc.alignment.message, answers=answers, recorded=fc.recorded,
            caveats=fc.caveats())
        """,
        model,
    )
    assert fc["aligned"], fc["message"]
    print(f"{name}: forecast {fc['answers']} from {fc['recorded']}; caveats: {fc['caveats']}")
    largest = fc["answers"][allocator]
    assert largest and fc["answers"]["gpumem"] and fc["answers"]["native"]

    def fits(k):
        return _fits(allocator, k, 1, model)

    tol = max(1, int(0.03 * largest))
    assert fits(largest - tol), f"{name} {largest - tol} runs out of memory: the forecast's {largest} is too high"
    assert not fits(largest + tol + 1), f"{name} {largest + tol + 1} runs: the forecast's {largest} is too low"


# Weights made in fp32 and cast to fp16: each cast copy lands where an earlier fp32 weight was freed,
# and the rest of that segment stays cached (empty_cache cannot release a segment with a live block).
CAST = """
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 4096)).cuda().half()


def step(b):
    with torch.no_grad():
        model(torch.randn(b, 256, 4096, device="cuda", dtype=torch.half)).float().sum().item()


torch.cuda.synchronize()
torch.cuda.empty_cache()
torch.cuda.reset_peak_memory_stats()
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_forecast_native_model_starts_from_torchs_cache():
    """Recorded under torch's allocator, the forecast keeps the free blocks of the segments that hold
    the weights, and the native model replaying a step from them reserves what a fresh run does."""
    fc = _run(
        "native",
        """
        from gpumem.forecast.native_model import replay_native
        fc = gpumem.forecast(step, knob=[2, 4], name="batch", capacity=1 << 34)
        start = fc.recordings[-1].native_start
        t = fc.synthesise(16)
        out(free=sum(s for seg in start for s, live in seg.blocks if not live),
            model=replay_native(fc._from_start(t)).peak_reserved_bytes, empty=replay_native(t).peak_reserved_bytes)
        """,
        CAST,
    )
    torch_reserved = _run("native", "step(16)\nout(reserved=torch.cuda.max_memory_reserved())\n", CAST)["reserved"]
    print(
        f"cached free {fc['free']}; peak reserved at 16: torch {torch_reserved}, model {fc['model']} "
        f"(from an empty cache {fc['empty']})"
    )
    assert fc["free"] > 0
    assert abs(fc["model"] - torch_reserved) <= 0.01 * torch_reserved
