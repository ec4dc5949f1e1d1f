"""CUDA graphs, torch.cuda.MemPool and torch.compile(mode="reduce-overhead")
under gpumem, each case checked against torch's own allocator.

Every case runs twice in fresh interpreters (torch's allocator is chosen once
per process): USE = False under the native allocator, USE = True under
gpumem.  They skip cleanly without torch or CUDA.
"""

import pytest

from test_gpu_torch import DETERMINISM, N_CUDA, run_py


def both(code, deterministic=True, **kw):
    """The same code under the native allocator and under gpumem."""
    head = "USE = {use}\nif USE:\n    gpumem.install()\n" + (DETERMINISM if deterministic else "")
    native = run_py(head.format(use=False) + code, **kw)
    ours = run_py(head.format(use=True) + code, **kw)
    return native, ours


GRAPHS = """
import gc
x = torch.ones(1 << 20, device="cuda")
pool = torch.cuda.graph_pool_handle()
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):           # warm up off the capture, as torch's docs do
    for _ in range(2):
        a = x * 2; b = a + 1; del a; y = b * 3; del b
torch.cuda.current_stream().wait_stream(s)
graphs, outs = [], []
for k in range(3):
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, pool=pool):
        a = x * (2 + k); b = a + 1; del a           # the issue's case ...
        c = b * b; d = c - b; del b                  # ... with more intermediates
        e = d.sqrt(); del c
        f = e * 3 + d; del d, e
        y = f.clone(); del f
    graphs.append(g); outs.append(y)
g1 = torch.cuda.CUDAGraph()                         # a graph with its own pool
with torch.cuda.graph(g1):
    t = x + 10; u = t * t; del t; z = u - 1; del u
torch.cuda.synchronize()
pools = gpumem.status()["devices"][0]["pools"] if USE else None
fillers = [torch.full((1 << 20,), 5.0, device="cuda") for _ in range(24)]
torch.cuda.synchronize()
for g in graphs + [g1]:
    g.replay()
torch.cuda.synchronize()
intact = all(bool((f == 5.0).all()) for f in fillers)
vals = [float(o[0]) for o in outs] + [float(z[0])]
x.fill_(3.0)
for g in graphs + [g1]:
    g.replay()
torch.cuda.synchronize()
vals2 = [float(o[0]) for o in outs] + [float(z[0])]
intact2 = all(bool((f == 5.0).all()) for f in fillers)
if USE:
    gpumem._C.registry_heap(0).check()
del graphs, g, g1, outs, y, z
gc.collect()
torch.cuda.synchronize()
pools_after = len(gpumem._C.registry_heap(0).pools()) if USE else None
out(intact=intact and intact2, vals=vals, vals2=vals2, pools=pools, pools_after=pools_after)
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_graph_intermediates_are_never_handed_out_again():
    native, ours = both(GRAPHS)
    assert native["intact"], native
    assert ours["intact"], ours
    assert ours["vals"] == native["vals"] and ours["vals2"] == native["vals2"], (native, ours)
    assert ours["pools"] == 2  # the shared handle's pool and g1's own
    assert ours["pools_after"] == 0  # graphs deleted: their pools end


CAPTURE_API = """
x = torch.arange(1 << 18, device="cuda", dtype=torch.float32)
s = torch.cuda.Stream()
g = torch.cuda.CUDAGraph()
with torch.cuda.stream(s):
    g.capture_begin()
    a = x * 2
    b = a.sin(); del a
    y = b + x; del b
    g.capture_end()
torch.cuda.current_stream().wait_stream(s)
fill = [torch.full((1 << 18,), 7.0, device="cuda") for _ in range(16)]
g.replay(); torch.cuda.synchronize()
v1 = float(y.sum())
x.mul_(0.5)
g.replay(); torch.cuda.synchronize()
v2 = float(y.sum())
intact = all(bool((f == 7.0).all()) for f in fill)
live_pool = len(gpumem._C.registry_heap(0).pools()) if USE else None
g.reset()
del y
torch.cuda.synchronize()
pools_after_reset = len(gpumem._C.registry_heap(0).pools()) if USE else None
reserved_before = torch.cuda.memory_reserved()
torch.cuda.empty_cache()
out(v1=v1, v2=v2, intact=intact, live_pool=live_pool, pools_after_reset=pools_after_reset,
    released=torch.cuda.memory_reserved() <= reserved_before)
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_capture_begin_end_replay_reset():
    native, ours = both(CAPTURE_API)
    assert ours["intact"] and native["intact"]
    assert abs(ours["v1"] - native["v1"]) <= 1e-6 * abs(native["v1"]) + 1e-3, (native, ours)
    assert abs(ours["v2"] - native["v2"]) <= 1e-6 * abs(native["v2"]) + 1e-3, (native, ours)
    assert ours["live_pool"] == 1 and ours["pools_after_reset"] == 0 and ours["released"]


GRAPHED = """
import torch.nn.functional as F
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                            torch.nn.Linear(256, 10)).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
gen = torch.Generator(device="cpu").manual_seed(1)
sample = torch.randn(32, 64, device="cuda", requires_grad=True)
graphed = torch.cuda.make_graphed_callables(model, (sample,))
losses, held = [], []
for step in range(20):
    xi = torch.randn(32, 64, generator=gen).cuda(); yi = torch.randint(0, 10, (32,), generator=gen).cuda()
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(graphed(xi), yi)
    loss.backward()
    opt.step()
    losses.append(loss.item())
    held.append(torch.full((4096,), float(step), device="cuda"))   # allocated between replays
torch.cuda.synchronize()
intact = all(bool((h == float(i)).all()) for i, h in enumerate(held))
out(losses=losses, intact=intact)
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_make_graphed_callables_training_losses_equal_native():
    native, ours = both(GRAPHED)
    assert ours["intact"] and native["intact"]
    assert ours["losses"] == native["losses"], (native["losses"], ours["losses"])


MEMPOOL = """
import gc
pool = torch.cuda.MemPool()
kind = type(pool).__module__
pid = tuple(pool.id)
uc0 = pool.use_count()
with torch.cuda.use_mem_pool(pool):
    uc_in = pool.use_count()
    t1 = torch.randn(1 << 20, device="cuda")
    t2 = torch.randn(3 << 20, device="cuda")
    t3 = torch.randn(1 << 18, device="cuda"); del t3      # freed inside: stays the pool's
outside = torch.randn(1 << 20, device="cuda")
uc_after = pool.use_count()
snap = pool.snapshot()
seg_pools = sorted({tuple(s["segment_pool_id"]) for s in snap})
pool_alloc = sum(s["allocated_size"] for s in snap)
whole = torch.cuda.memory_snapshot()
outside_in_pool = any(b["address"] == outside.data_ptr() for s in snap for b in s["blocks"]
                      if b["state"] == "active_allocated")
keep1, keep2 = t1.clone(), t2.clone()
del pool
gc.collect()
fill = [torch.full((1 << 20,), 9.0, device="cuda") for _ in range(16)]   # must not land on t1/t2
torch.cuda.synchronize()
intact = bool(torch.equal(t1, keep1)) and bool(torch.equal(t2, keep2))
pools_left = len(gpumem._C.registry_heap(0).pools()) if USE else None
del t1, t2
torch.cuda.synchronize()
if USE:
    gpumem._C.registry_heap(0).check()
out(kind=kind, uc0=uc0, uc_in=uc_in, uc_after=uc_after, seg_pools=[list(p) for p in seg_pools], pid=list(pid),
    pool_alloc=pool_alloc, outside_in_pool=outside_in_pool, intact=intact, pools_left=pools_left,
    whole_has_pool=any(tuple(s["segment_pool_id"]) == pid for s in whole))
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_mempool_tensors_outlive_the_pool():
    native, ours = both(MEMPOOL)
    assert ours["kind"].startswith("gpumem") and not native["kind"].startswith("gpumem")
    for k in ("uc0", "uc_in", "uc_after", "intact", "outside_in_pool", "whole_has_pool"):
        assert ours[k] == native[k], (k, native, ours)
    assert ours["intact"] and not ours["outside_in_pool"]
    assert ours["seg_pools"] == [ours["pid"]]
    assert ours["pool_alloc"] >= (4 << 20) * 4
    assert ours["pools_left"] == 0


COMPILE = """
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
model = LlamaForCausalLM(cfg).cuda().eval()
calls = {"set": 0, "get": 0, "check": 0}
if USE:
    for name, key in (("_cuda_setCheckpointPoolState", "set"), ("_cuda_getCheckpointState", "get"),
                      ("_cuda_checkPoolLiveAllocations", "check")):
        fn = getattr(torch._C, name)
        def counted(*a, _fn=fn, _k=key):
            calls[_k] += 1
            return _fn(*a)
        setattr(torch._C, name, counted)
f = torch.compile(model, mode="reduce-overhead")
gen = torch.Generator(device="cpu").manual_seed(2)
infer, held, max_err = [], [], 0.0
with torch.no_grad():
    for bs in (1, 4, 8):
        ids = torch.randint(0, 1000, (bs, 32), generator=gen).cuda()
        ref = model(ids, use_cache=False).logits
        for rep in range(3):
            got = f(ids, use_cache=False).logits.clone()
            held.append((torch.full((1 << 16,), float(len(held)), device="cuda"), len(held)))
            max_err = max(max_err, float((got - ref).abs().max()))
        infer.append(float(got.double().sum()))
# training: compiled and eager copies from the same weights
torch.manual_seed(3)
tm = LlamaForCausalLM(cfg).cuda().train()
em = LlamaForCausalLM(cfg).cuda().train()
em.load_state_dict(tm.state_dict())
topt = torch.optim.SGD(tm.parameters(), lr=0.01)
eopt = torch.optim.SGD(em.parameters(), lr=0.01)
step = torch.compile(tm, mode="reduce-overhead")
losses, elosses = [], []
for i in range(6):
    ids = torch.randint(0, 1000, (4, 32), generator=gen).cuda()
    loss = step(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward(); topt.step(); topt.zero_grad(set_to_none=True)
    losses.append(loss.item())
    eloss = em(input_ids=ids, labels=ids, use_cache=False).loss
    eloss.backward(); eopt.step(); eopt.zero_grad(set_to_none=True)
    elosses.append(eloss.item())
    held.append((torch.full((1 << 16,), float(len(held)), device="cuda"), len(held)))
torch.cuda.synchronize()
intact = all(bool((t == float(v)).all()) for t, v in held)
if USE:
    gpumem._C.registry_heap(0).check()
out(infer=infer, max_err=max_err, losses=losses, elosses=elosses, intact=intact, calls=calls,
    pools=len(gpumem._C.registry_heap(0).pools()) if USE else None)
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_torch_compile_reduce_overhead_hf_model():
    pytest.importorskip("transformers")
    native, ours = both(COMPILE, deterministic=False, timeout=900)
    assert ours["intact"] and native["intact"]
    assert ours["max_err"] < 1e-3 and native["max_err"] < 1e-3, (native["max_err"], ours["max_err"])
    for a, b in zip(ours["infer"], native["infer"]):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (native["infer"], ours["infer"])
    for a, b in zip(ours["losses"], ours["elosses"]):
        assert abs(a - b) < 1e-3, (ours["losses"], ours["elosses"])
    for a, b in zip(ours["losses"], native["losses"]):
        assert abs(a - b) < 1e-4, (native["losses"], ours["losses"])
    assert ours["calls"]["get"] > 0 and ours["pools"] >= 1, ours
    print("checkpoint calls under gpumem", ours["calls"])


OOM_CAPTURE = """
cap = 1 << 30
if not USE:
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
else:
    gpumem.install(cap=cap)
x = torch.ones(1 << 20, device="cuda")
s = torch.cuda.Stream()
g = torch.cuda.CUDAGraph()
oom, msg = False, ""
try:
    with torch.cuda.graph(g, stream=s):
        y = x * 2
        big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
except torch.OutOfMemoryError as e:
    oom, msg = True, str(e)
del g
torch.cuda.synchronize()
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2, stream=s):
    z = x * 2 + 1
x.fill_(2.0)
g2.replay()
torch.cuda.synchronize()
if USE:
    gpumem._C.registry_heap(0).check()
out(oom=oom, prefix=msg.startswith("CUDA out of memory."), val=float(z[0]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_oom_during_capture_then_a_good_capture():
    native, ours = both(OOM_CAPTURE)
    assert native["oom"] and ours["oom"], (native, ours)
    assert ours["prefix"], ours
    assert ours["val"] == native["val"] == 5.0


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_torch_allocator_with_change_current_allocator_equals_install():
    native = run_py("USE = False\n" + DETERMINISM + GRAPHS)
    head = (
        "USE = True\ntorch.cuda.memory.change_current_allocator(gpumem.torch_allocator())\n"
        "assert gpumem.status()['installed'] and gpumem.status()['pool_hooks']\n"
        "torch.zeros(1, device='cuda')  # torch.cuda.memory_stats() is {} until CUDA is initialised\n"
        "assert torch.cuda.memory_stats()['num_remaps'] == 0\n" + DETERMINISM
    )
    ours = run_py(head + GRAPHS)
    assert ours["intact"] and ours["vals"] == native["vals"] and ours["pools"] == 2, (native, ours)


POOL_PAGES = """
import gc
torch.cuda.empty_cache()
split, whole = torch.cuda.MemPool(), torch.cuda.MemPool(no_split=True)
with torch.cuda.use_mem_pool(split):
    a = torch.randn(1 << 20, device="cuda")                 # 4 MiB
with torch.cuda.use_mem_pool(whole):
    b = torch.randn(1 << 20, device="cuda")
    c = torch.randn(1 << 18, device="cuda")                 # 1 MiB: a block it holds whole
blocks_per_segment = [len(s["blocks"]) for s in whole.snapshot()]
# a small graph beside an eager tensor: its pool's memory is its own
s = torch.cuda.Stream()
x = torch.ones(1000, device="cuda")
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    y = x * 2
    before = torch.cuda.memory_stats()["reserved_bytes.all.current"]
    g = torch.cuda.CUDAGraph()
    g.capture_begin()
    z = y.clone()
    for _ in range(3):
        z = z * 2 + 1
    g.capture_end()
torch.cuda.current_stream().wait_stream(s)
grew = torch.cuda.memory_stats()["reserved_bytes.all.current"] - before
eager = {x.data_ptr() >> 21, y.data_ptr() >> 21}
graph_segs = [seg for seg in torch.cuda.memory_snapshot() if tuple(seg["segment_pool_id"]) == g.pool()]
graph_pages = set()
for seg in graph_segs:
    graph_pages.update(range(seg["address"] >> 21, (seg["address"] + seg["total_size"] - 1 >> 21) + 1))
shares = bool(eager & graph_pages)
g.replay()
torch.cuda.synchronize()
ok = bool(torch.equal(z, (x * 2) * 8 + 7))
del g, a, b, c
gc.collect()
if USE:
    gpumem._C.registry_heap(0).check()
out(blocks_per_segment=blocks_per_segment, grew=grew, shares=shares, ok=ok)
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_no_split_pools_and_a_graphs_own_pages():
    native, ours = both(POOL_PAGES)
    assert native["ok"] and ours["ok"]
    assert native["blocks_per_segment"] and set(native["blocks_per_segment"]) == {1}, native
    assert ours["blocks_per_segment"] and set(ours["blocks_per_segment"]) == {1}, ours
    assert native["grew"] > 0 and ours["grew"] == 2 << 20, (native, ours)  # one page of its own
    assert not ours["shares"]
