"""What the test files of every folder share: the repository's root, byte units, the shipped
traces and snapshots, the heap checks, fresh interpreters that drive torch's entry points, and
traces written and read back with no gpumem code involved (so that what gpumem reports is checked
against an independent count).  Import it as `from helpers import ...` (tests/conftest.py puts
tests/ on the path); fixtures live in tests/conftest.py."""

import gzip
import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent

MiB = 1 << 20
GiB = 1 << 30
PAGE = 2 * MiB


# The traces and the snapshot shipped in gpumem/data.  Tests take them from the
# gpumem under test (a source checkout or an installed wheel); a missing one is a
# failure (gpumem.data.UnknownDataError), never a skip.
TRACE_NAMES = (
    "bert_varlen",
    "gpt2_generate",
    "gpt2_varlen",
    "llama_lora_ckpt",
    "overlap_comm",
    "prefetch_loader",
    "resnet50_multires",
    "seed_fragmentation",
    "two_stream_pipeline",
    # the zoo (docs/zoo.md)
    "bart_generate",
    "bert_mlm",
    "clip_train",
    "convnext_train",
    "distilbert_train",
    "efficientnet_train",
    "gemma_beam",
    "gpt_neox_fp16",
    "llama_ckpt",
    "llama_compile_graphs",
    "llama_compile_train",
    "llama_generate",
    "llama_train",
    "mistral_train",
    "mixtral_generate",
    "mixtral_train",
    "phi_generate",
    "qwen2_generate",
    "qwen2_lora",
    "qwen2_moe_train",
    "resnet_infer",
    "roberta_infer",
    "swin_train",
    "t5_train",
    "unet_sample",
    "unet_train",
    "vit_train",
    "wav2vec2_ctc",
    "whisper_generate",
    "whisper_train",
)


def trace_file(name):
    """The shipped trace `name` (raises when it is missing)."""
    from gpumem.data import trace_path

    return trace_path(name)


def snapshot_file(name="sample_snapshot"):
    """The shipped torch snapshot `name` (raises when it is missing)."""
    from gpumem.data import snapshot_path

    return snapshot_path(name)


def extra_traces_dir():
    """$GPUMEM_SHARED/traces: an optional folder of more *.trace.gz that the
    trace-wide tests replay as well; None when unset."""
    env = os.environ.get("GPUMEM_SHARED")
    if not env:
        return None
    path = pathlib.Path(env) / "traces"
    if not path.is_dir():
        raise FileNotFoundError(f"GPUMEM_SHARED={env} has no traces/ folder")
    return path


def all_traces():
    """Every shipped trace (each must exist), then those of $GPUMEM_SHARED/traces
    whose names the shipped ones do not already have."""
    shipped = [trace_file(n) for n in TRACE_NAMES]
    extra_dir = extra_traces_dir()
    extra = []
    if extra_dir is not None:
        extra = [p for p in sorted(extra_dir.glob("*.trace.gz")) if p.name[: -len(".trace.gz")] not in TRACE_NAMES]
    return shipped + extra


REPO_TRACES = REPO / "gpumem" / "data" / "traces"


def traces_dir():
    """The folder of the shipped traces (gpumem/data/traces); it must exist."""
    if not REPO_TRACES.is_dir():
        raise FileNotFoundError(f"{REPO_TRACES} is missing: the shipped traces are part of the repository")
    return REPO_TRACES


def cuda_devices():
    """(number of CUDA devices, why none).  Zero only when there is really no
    GPU to test: torch missing, a CPU-only torch build, or no NVIDIA device on
    the machine.  Anything else -- torch failing to import for another reason,
    CUDA detection raising, or a CUDA build of torch on a machine with NVIDIA
    device files that still reports no GPU (a broken driver install) -- raises,
    so that a broken setup fails instead of skipping every GPU test."""
    try:
        import torch
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        return 0, "torch is not installed"
    if not torch.version.cuda:
        return 0, "torch is a CPU-only build"
    if torch.cuda.is_available():
        return torch.cuda.device_count(), ""
    if os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0"):
        raise RuntimeError(
            "this machine has NVIDIA device files and torch is a CUDA build, but "
            "torch.cuda.is_available() is False: the CUDA install is broken"
        )
    return 0, "no CUDA GPU on this machine"


def assert_ok(h):
    """h.check() must pass; on failure show the core's reason."""
    import gpumem

    try:
        h.check()
    except gpumem.CorruptionError as exc:  # pragma: no cover - only on a core bug
        pytest.fail(f"heap invariant broken: {exc}")


def chunk_with_a_hole(h):
    """A 4-page chunk (the heap's chunk_pages=4) at the heap's first pages,
    with a block of just over half a page at each end (a smaller one would
    keep to a small page): pages 1-2 are free, but the chunk goes only as a
    whole.  Returns the chunk's address."""
    a = h.malloc(4 * PAGE)
    h.free(a)
    h.malloc(MiB + 512)
    mid = h.malloc(4 * PAGE - 2 * (MiB + 512))
    top = h.malloc(MiB + 512)
    assert top + MiB + 512 == a + 4 * PAGE
    h.free(mid)
    return a


def history_heap(capacity):
    """A fixture's body: a sim heap, its history turned off and the heap closed after the test."""
    import gpumem
    from gpumem.history import record_history

    h = gpumem.Heap(device="sim", capacity=capacity)
    yield h
    record_history(False, device=h)
    h.close()


def live_blocks(h):
    return [b for b in h.snapshot()["blocks"] if b[6] == "live"]


# Streams the tests use (arbitrary handle values; 0 is the legacy default stream).
STREAMS = (0, 0x1000, 0x2000, 0x3000)


def drain_and_assert_empty(h, ptrs):
    """Release every stream, free every pointer in `ptrs` that is still live,
    empty the cache, and check that the simulated device holds nothing."""
    for s in STREAMS:
        h.sim_hold_stream(s, False)
    for p in list(ptrs):
        if h.block_size(p):
            h.free(p)
    h.empty_cache()
    assert_ok(h)
    info = h.sim_info()
    assert info["pages_created"] == 0, info
    assert info["pages_mapped"] == 0, info
    st = h.stats()
    assert st["reserved_bytes.all.current"] == 0
    assert st["allocated_bytes.all.current"] == 0
    assert st["active_bytes.all.current"] == 0


def pool_of(size):
    """torch's pools: blocks of at most 1 MiB come from the small pool."""
    return "small_pool" if size <= MiB else "large_pool"


def recount(h):
    """Recount the live-memory statistics from a snapshot, independently of
    the core's counters: {stat key: value} for the keys it can derive."""
    snap = h.snapshot()
    out = {}
    for pool in ("all", "small_pool", "large_pool"):
        for name in ("allocation", "allocated_bytes", "requested_bytes"):
            out[f"{name}.{pool}.current"] = 0
    for addr, size, requested, stream, context, seq, state, pool in snap["blocks"]:
        if state != "live":
            continue
        for pool in ("all", pool_of(size)):
            out[f"allocation.{pool}.current"] += 1
            out[f"allocated_bytes.{pool}.current"] += size
            out[f"requested_bytes.{pool}.current"] += requested
    return out


def pages_touched(blocks, page=PAGE):
    """Number of distinct pages that the (addr, size) ranges touch."""
    pages = set()
    for addr, size in blocks:
        pages.update(range(addr // page, (addr + size - 1) // page + 1))
    return len(pages)


# Python source that binds the C entry points torch's CUDAPluggableAllocator
# calls (csrc/python/torch_alloc.cpp) through ctypes, for scripts that drive
# the torch boundary without torch: a ctypes call drops the GIL, as torch's
# ops do.  Needs `_C` (gpumem._C) imported.
TORCH_BOUNDARY = """
import ctypes
lib = ctypes.CDLL(_C.__file__)
alloc = lib.gpumem_torch_alloc
alloc.restype = ctypes.c_void_p
alloc.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
free = lib.gpumem_torch_free
free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
FILTER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
begin = lib.gpumem_torch_pool_begin
begin.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, FILTER]
end = lib.gpumem_torch_pool_end
end.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]
release = lib.gpumem_torch_pool_release
release.argtypes = [ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64]
empty_cache = lib.gpumem_torch_empty_cache
memory_fraction = lib.gpumem_torch_memory_fraction
memory_fraction.argtypes = [ctypes.c_double, ctypes.c_int]
ANY = ctypes.cast(None, FILTER)   # a pool that takes every stream
def live(pool):
    return {a for a, _ in _C.registry_heap(0).pool_live(pool)}
"""


# What the child of run_python reports with: out(key=value, ...) prints one line "RESULT <json>".
OUT = """
import json
def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
"""


def run_python(code, prelude, env=None, timeout=600, unset=("GPUMEM_CONF",)):
    """Run prelude + code in a fresh interpreter that imports this checkout's
    gpumem; return the dict the code printed with out(...) (a line "RESULT
    <json>", see OUT).  `unset` names environment variables the child must not inherit."""
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    for name in unset:
        e.pop(name, None)
    if env:
        e.update(env)
    p = subprocess.run(
        [sys.executable, "-c", OUT + prelude + textwrap.dedent(code)],
        env=e,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"rc={p.returncode}\nstdout:\n{p.stdout[-3000:]}\nstderr:\n{p.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT ") :])


# A fresh interpreter whose device 0 is a simulated device behind torch's heap: TORCH_BOUNDARY's
# entry points, stream_is(...) filters for the pool hooks, and check() of that heap.
TORCH_SIM = (
    """
import ctypes, json
from gpumem import _C
MiB = 1 << 20
"""
    + TORCH_BOUNDARY
    + """
_keep = []   # the C side keeps the function pointer: the ctypes thunk must outlive it
def stream_is(*ok):
    f = FILTER(lambda s: int((s or 0) in ok))
    _keep.append(f)
    return f
def check():
    _C.registry_heap(0).check()
def out(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
_C.registry_open_sim(0, 1 << 30)
"""
)


def run_torch_sim(code):
    """run_python with the TORCH_SIM prelude (GPUMEM_CONF is inherited)."""
    return run_python(code, TORCH_SIM, timeout=300, unset=())


# The pressure-aware policy's workload, on a simulated heap (unit/test_policy.py) and on CUDA
# (gpu/test_gpu_policy.py, which defines both in its child from their source).
def policy_workload(h, rounds=3, keep=None):
    """Large blocks between long-lived 1 MiB ones; the large ones freed, then a larger one.  Returns the kept ones."""
    keep = [] if keep is None else keep
    for r in range(rounds):
        big = []
        for _ in range(8):
            big.append(h.malloc((64 + 8 * r) * MiB))
            keep.append(h.malloc(MiB))
        for p in big:
            h.free(p)
        h.free(h.malloc((256 + 32 * r) * MiB))
    return keep


def policy_counters(h):
    s = h.stats()
    keys = (
        "num_remaps",
        "num_pages_remapped",
        "num_sync_all_streams",
        "num_device_alloc",
        "num_device_free",
        "num_ooms",
    )
    return {k: s[k] for k in keys}


# torch's statistic names: the pooled ones, their pools and fields (torch.cuda.memory_stats).
STAT_NAMES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
POOLS = ("all", "small_pool", "large_pool")
FIELDS = ("current", "peak", "allocated", "freed")


HEADER = '# action addr size stream  (test; {"workload": "t"})'


def write_bytes(path, data: bytes, compress=True):
    """data to path, gzipped when compress; returns path."""
    if compress:
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)
    return path


def write_text(path, lines, compress=True, header=HEADER):
    """A text trace: the header line (none if empty), then lines."""
    body = "\n".join(([header] if header else []) + list(lines)) + "\n"
    return write_bytes(path, body.encode(), compress)


def raw_events(path):
    """(action, addr, size, stream) of a gzipped text trace, read line by line."""
    out = []
    with gzip.open(path, "rt") as f:
        for line in f:
            if not line.startswith("#"):
                a, addr, size, stream = line.split()
                out.append((a, int(addr), int(size), int(stream)))
    return out


def live_by_event(events):
    """Live bytes before the first event and after each alloc or free_completed of
    (action, addr, size, stream) tuples; the other actions leave no entry."""
    live, out, sizes = 0, [0], {}
    for action, addr, size, _ in events:
        if action == "alloc":
            live += size
            sizes[addr] = size
        elif action == "free_completed":
            live -= sizes.pop(addr)
        else:
            continue
        out.append(live)
    return out


def recount_peak(events):
    """Peak of live bytes of (action, addr, size, stream) tuples."""
    return max(live_by_event(events))


# What only the tests call (_torch_test_alloc, _test_hold_boundary_lock, _torch_viz_hooks) is
# compiled into gpumem._C only when it is built with GPUMEM_TEST_HOOKS=1 (CI and the README's
# test command do); a plain `pip install .` leaves it out, and the tests that need it skip.
def _built_with_test_hooks():
    try:
        from gpumem import _C
    except ImportError:  # not built: the tests that import it say so themselves
        return False
    return bool(getattr(_C, "TEST_HOOKS", False))


TEST_HOOKS = _built_with_test_hooks()
needs_test_hooks = pytest.mark.skipif(
    not TEST_HOOKS, reason="gpumem._C was built without its test hooks (build it with GPUMEM_TEST_HOOKS=1)"
)


def assert_switch_option(name, default):
    """A 0-or-1 heap option `name` (core default `default`): GPUMEM_CONF parses it, None keeps the
    core's default, 2 and 7 are refused with the core's message (torch's options, gpumem.Heap), and
    the registry takes it and gives it back."""
    import pytest

    import gpumem
    from gpumem import _C
    from gpumem.torch._install import OptionError, normalize_options, parse_conf

    assert normalize_options(parse_conf(f"{name}:{1 - default}"))[name] == 1 - default
    assert normalize_options({})[name] is None
    with pytest.raises(OptionError, match=f"{name} must be 0 or 1, got 2"):
        normalize_options({name: 2})
    with pytest.raises(ValueError, match=f"{name} must be 0 or 1, got 7"):
        gpumem.Heap(device="sim", capacity=1 << 30, **{name: 7})
    before = _C.registry_options()
    assert before[name] == default
    try:
        _C.registry_configure(**{name: 1 - default})
        assert _C.registry_options()[name] == 1 - default
    finally:
        _C.registry_configure(**{name: before[name]})
    assert _C.registry_options() == before
