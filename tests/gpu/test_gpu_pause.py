"""gpumem.pause / gpumem.resume on a real GPU.

Each case runs in a fresh interpreter with gpumem installed as torch's
allocator.  A pause must give back (per torch.cuda.mem_get_info) at least 99%
of the pool's pages; a backup must bring tensor contents back bit for bit;
without one the tensors are usable again after resume; a CUDA graph captured
into a pool replays correctly after a pause and resume; tensors outside the
pool are untouched throughout.  No case touches a paused tensor: on CUDA that
is an illegal-address fault that ends the process's CUDA context.
They skip cleanly without torch or CUDA.
"""

import pytest

from test_gpu_torch import N_CUDA, run_py

MEMPOOL = """
gpumem.install()
PAGE = 2 << 20
torch.manual_seed(0)
other = torch.randn(3 << 20, device="cuda")            # outside the pool
other_sum = float(other.double().sum())
pool = torch.cuda.MemPool()
with torch.cuda.use_mem_pool(pool):
    ts = [torch.randn(32 << 20, device="cuda") for _ in range(8)]  # 8 x 128 MiB
    small = torch.arange(1000, device="cuda", dtype=torch.int32)    # shares a page with others, maybe
expected = [t.cpu() for t in ts] + [small.cpu()]
info = gpumem._C.registry_heap(0).pool_info(pool.id)
torch.cuda.synchronize()
free0 = torch.cuda.mem_get_info()[0]
r = gpumem.pause(pool, backup=BACKUP)
free1 = torch.cuda.mem_get_info()[0]
errors = {}
try:
    gpumem.pause(pool)
except RuntimeError as e:
    errors["pause_twice"] = str(e)
try:
    with torch.cuda.use_mem_pool(pool):
        torch.empty(1 << 20, device="cuda")
except RuntimeError as e:
    errors["alloc_paused"] = str(e)
# the released memory serves other tensors meanwhile, and comes back with their bytes on it
hog = torch.full((int(r.bytes * 0.9) // 4,), 7.0, device="cuda")
hog_ok = bool((hog == 7.0).all())
del hog
gpumem._C.registry_heap(0).check()
torch.cuda.empty_cache()
free2 = torch.cuda.mem_get_info()[0]
r2 = gpumem.resume(pool)
free3 = torch.cuda.mem_get_info()[0]
try:
    gpumem.resume(pool)
except RuntimeError as e:
    errors["resume_twice"] = str(e)
same = [bool(torch.equal(t.cpu(), e)) for t, e in zip(ts + [small], expected)]
for t in ts:                     # usable whatever the contents
    t.fill_(2.0)
usable = all(bool((t == 2.0).all()) for t in ts)
other_ok = float(other.double().sum()) == other_sum
gpumem._C.registry_heap(0).check()
out(pages=r.pages, shared=r.shared_pages, bytes=r.bytes, backup_bytes=r.backup_bytes, pause_s=r.seconds,
    resume_pages=r2.pages, resume_s=r2.seconds, pinned_pages=info["pinned_pages"],
    returned=free1 - free0, retaken=free2 - free3, same=same, usable=usable, other_ok=other_ok,
    hog_ok=hog_ok, errors=errors)
"""


def _check_common(r):
    page = 2 << 20
    assert r["pages"] + r["shared"] == r["pinned_pages"], r
    assert r["pages"] >= 0.99 * r["pinned_pages"], r
    # torch.cuda.mem_get_info sees the memory come back: at least 99% of the pool's pages
    assert r["returned"] >= 0.99 * r["pinned_pages"] * page, r
    assert r["resume_pages"] == r["pages"], r
    assert r["usable"] and r["other_ok"] and r["hog_ok"], r
    assert "already paused" in r["errors"]["pause_twice"], r
    assert "paused" in r["errors"]["alloc_paused"], r
    assert "not paused" in r["errors"]["resume_twice"], r


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_pause_returns_the_memory_and_a_backup_restores_every_byte():
    r = run_py("BACKUP = True\n" + MEMPOOL)
    _check_common(r)
    assert r["backup_bytes"] == r["bytes"], r
    assert all(r["same"]), r


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_without_backup_tensors_are_usable_after_resume():
    r = run_py("BACKUP = False\n" + MEMPOOL)
    _check_common(r)
    assert r["backup_bytes"] == 0, r


GRAPH = """
gpumem.install()
x = torch.ones(4 << 20, device="cuda")                # static input: outside the graph's pool
keep = torch.full((1 << 20,), 3.0, device="cuda")      # unrelated tensor
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    for _ in range(2):
        y = (x * 2 + 1).sqrt() * 4
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    a = x * 2 + 1
    b = a.sqrt()
    y = b * 4                                          # output: lives in the graph's pool
    del a, b
g.replay()
torch.cuda.synchronize()
first = y.cpu()
pool = g.pool()
results = {}
for backup in (True, False):
    r = gpumem.pause(pool, backup=backup)
    fill = torch.full((max(r.bytes // 8, 1),), 9.0, device="cuda")   # reuse the released memory
    del fill
    torch.cuda.empty_cache()
    gpumem.resume(pool)
    kept = bool(torch.equal(y.cpu(), first)) if backup else None
    x.fill_(4.0)
    g.replay()
    torch.cuda.synchronize()
    replay_ok = bool(torch.allclose(y, torch.full_like(y, 3.0 * 4)))
    x.fill_(1.0)
    g.replay()
    torch.cuda.synchronize()
    replay_ok = replay_ok and bool(torch.equal(y.cpu(), first))
    results[str(backup)] = dict(pages=r.pages, kept=kept, replay_ok=replay_ok)
gpumem._C.registry_heap(0).check()
out(results=results, keep_ok=bool((keep == 3.0).all()), x_ok=bool((x == 1.0).all()))
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_a_cuda_graph_replays_after_pause_and_resume():
    r = run_py(GRAPH)
    with_backup, without = r["results"]["True"], r["results"]["False"]
    assert with_backup["pages"] > 0, r
    assert with_backup["kept"], r  # the graph's output came back with the backup
    assert with_backup["replay_ok"] and without["replay_ok"], r
    assert r["keep_ok"] and r["x_ok"], r


FAULT = """
# GPUMEM_CUDA_FAULTS is read when a device opens: a first heap, without faults,
# counts the calls of OP made before the pause (or the resume); a second one,
# opened with OP's next call set to fail, runs the same steps.
P, PAGE = (1, 1), 2 << 20

def setup():
    h = gpumem.Heap(device="cuda")
    h.pool_retain(P)
    blocks = [h.malloc(64 * PAGE, pool=P) for _ in range(4)]
    h.malloc(4096)                                   # general, after the pool's run of pages
    return h, blocks

os.environ["GPUMEM_CUDA_FAULTS"] = "processes:1000000000"  # counts every call, fails none here
h, blocks = setup()
before_pause = h.cuda_fault_calls(OP)[0]
h.pool_pause(P, backup=True)
before_resume = h.cuda_fault_calls(OP)[0]
h.pool_resume(P)
h.close()
os.environ["GPUMEM_CUDA_FAULTS"] = f"{OP}:{(before_pause if WHEN == 'pause' else before_resume) + 1}"
h, blocks = setup()
res = {}
def attempt(name, fn):
    try:
        fn()
        res[name] = "ok"
    except (gpumem.DeviceError, gpumem.OutOfMemoryError, RuntimeError) as e:
        res[name] = type(e).__name__ + ": " + str(e).splitlines()[0]
    h.check()
    res[name + "_paused"] = h.pool_info(P)["paused"]
attempt("pause", lambda: h.pool_pause(P, backup=True))
if not res["pause_paused"]:
    attempt("pause_again", lambda: h.pool_pause(P, backup=True))
attempt("resume", lambda: h.pool_resume(P))
if res["resume_paused"]:
    attempt("resume_again", lambda: h.pool_resume(P))
res["back"] = all(h.block_size(b) == 64 * PAGE for b in blocks)
for b in blocks:
    h.free(b)
h.pool_release(P)
h.empty_cache()
h.check()
res["fault_calls"] = h.cuda_fault_calls(OP)
out(**res)
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
@pytest.mark.parametrize(
    "op,fails",
    [
        ("host_alloc", "pause"),
        ("copy_dtoh", "pause"),
        ("unmap", "pause"),
        ("release", None),  # absorbed: the page stays with the heap as a spare
        ("create", None),  # absorbed: the device refused a run's one allocation; single pages stand in
        ("map", "resume"),
        ("set_access", "resume"),
        ("copy_htod", "resume"),
    ],
)
def test_a_failed_driver_call_leaves_the_pool_paused_or_not_never_half(op, fails):
    when = "resume" if fails == "resume" else "pause"
    r = run_py(f"OP, WHEN = {op!r}, {when!r}\n" + FAULT)
    assert r["fault_calls"][1] == 1, r  # the fault fired once
    if fails == "pause":
        assert r["pause"] != "ok" and not r["pause_paused"], r  # nothing changed
        assert r["pause_again"] == "ok", r
    elif fails == "resume":
        assert r["pause"] == "ok" and r["resume"] != "ok" and r["resume_paused"], r  # unwound to paused
        assert r["resume_again"] == "ok" and not r["resume_again_paused"], r
    else:
        assert r["pause"] == "ok" and r["resume"] == "ok", r
    assert r["back"], r


PARTIAL = """
gpumem.install(pressure=0)                        # tight: the pages below are exactly these
pool = torch.cuda.MemPool()
w = torch.empty(2 << 20, device="cuda")           # 8 MiB, general: 4 pages
between = torch.empty(1 << 20, device="cuda")     # 4 MiB after them: the pool's pages will be two runs
del w
with torch.cuda.use_mem_pool(pool):
    a = torch.empty(2 << 20, device="cuda")       # w's 4 pages, now the pool's
    b = torch.empty(2 << 20, device="cuda")       # after `between`
try:
    gpumem.pause(pool)                            # the second run's cuMemUnmap fails
    msg = "no error"
except RuntimeError as e:
    msg = str(e)
info = gpumem._C.registry_heap(0).pool_info(pool.id)
gpumem._C.registry_heap(0).check()
gpumem.resume(pool)
a.fill_(1.0); b.fill_(2.0); between.fill_(3.0)
ok = bool((a == 1.0).all()) and bool((b == 2.0).all()) and bool((between == 3.0).all())
gpumem._C.registry_heap(0).check()
out(msg=msg, paused=info["paused"], paused_pages=info["paused_pages"], ok=ok)
"""


@pytest.mark.gpu
@pytest.mark.skipif(N_CUDA == 0, reason="needs torch with a CUDA GPU")
def test_a_pause_that_fails_part_way_says_the_pool_is_paused():
    """docs/torch.md: a device failure part way through a pause leaves the pool
    paused with the pages released so far, and the error says so."""
    r = run_py(PARTIAL, env={"GPUMEM_CUDA_FAULTS": "unmap:2"})
    assert r["paused"] and r["paused_pages"] == 4, r
    assert "the pool is paused with the 4 pages released before the failure" in r["msg"], r
    assert r["ok"], r
