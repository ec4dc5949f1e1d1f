"""The visibility layer on the torch path, checked without a GPU.

The torch allocation path itself needs CUDA (tests/gpu/test_gpu_torch_features.py); here the
two C hooks it is given (csrc/python/oom_glue.c, history_glue.c) are called
directly through ctypes -- a CFUNCTYPE call releases the GIL, as torch's op
bindings do before they allocate -- with a sim heap standing in for the CUDA
heap, and the routing of torch's memory API is called as torch would call it.
"""

import ctypes
import importlib
import threading

import pytest

import gpumem
from helpers import TEST_HOOKS, needs_test_hooks
from gpumem import _C
from gpumem.torch import _install, _viz as _torch_viz
from gpumem import torch as gt
from gpumem._which_heap import NoHeapError, registry_heap

explain_module = importlib.import_module("gpumem.explain")

MiB = 1 << 20
GiB = 1 << 30


class OomInfo(ctypes.Structure):
    """gm_oom_info (csrc/include/gpumem/gpumem.h)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "request",
            "stream",
            "device_total",
            "device_free",
            "cap_bytes",
            "live_bytes",
            "pending_bytes",
            "reserved_bytes",
            "cached_bytes",
            "free_mapped_bytes",
            "largest_free_mapped",
            "largest_possible",
            "pages_needed",
        )
    ] + [
        ("device_error", ctypes.c_int),
        ("pool_live_bytes", ctypes.c_size_t),
        ("pool_free_bytes", ctypes.c_size_t),
        ("chunk_locked_bytes", ctypes.c_size_t),
        ("spilled_bytes", ctypes.c_size_t),
        ("spill_limit", ctypes.c_size_t),
        ("spill_error", ctypes.c_int),
    ]


class ProcUsage(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint32), ("bytes", ctypes.c_uint64)]


FORMATTER_ARGS = (
    ctypes.c_long,
    ctypes.POINTER(OomInfo),
    ctypes.c_int,
    ctypes.POINTER(ProcUsage),
    ctypes.c_long,
    ctypes.c_char_p,
    ctypes.c_size_t,
)
# The C hooks' addresses come from a test hook (a build with GPUMEM_TEST_HOOKS=1).
VIZ_HOOKS = _C._torch_viz_hooks() if TEST_HOOKS else {"oom_formatter": 0, "context": 0}
# CFUNCTYPE calls release the GIL (torch's bindings do); PYFUNCTYPE ones keep it.
no_gil_formatter = ctypes.CFUNCTYPE(*FORMATTER_ARGS)(VIZ_HOOKS["oom_formatter"])
gil_formatter = ctypes.PYFUNCTYPE(*FORMATTER_ARGS)(VIZ_HOOKS["oom_formatter"])


def call_formatter(info, procs=None, buflen=16384, fn=no_gil_formatter):
    c_info = OomInfo(**{k: int(v) for k, v in info.items() if k in dict(OomInfo._fields_)})
    if procs is None:
        arr, n = None, -1
    else:
        arr, n = (ProcUsage * max(1, len(procs)))(*[ProcUsage(p, b) for p, b in procs]), len(procs)
    buf = ctypes.create_string_buffer(buflen)
    w = fn(ctypes.byref(c_info), 0, arr, n, buf, buflen)
    assert 0 <= w < buflen and buf.value == buf.raw[:w]
    return buf.raw[:w].decode("utf-8")


@pytest.fixture
def oom_heap(monkeypatch):
    """A sim heap that has just failed an allocation, standing in for torch's heap of cuda:0."""
    h = gpumem.Heap(device="sim", capacity=GiB)
    keep = [h.malloc(200 * MiB) for _ in range(4)]
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(400 * MiB)
    seen = []

    def heap_for(device):
        seen.append(device)
        return h

    monkeypatch.setattr(explain_module, "_torch_heap", heap_for)
    monkeypatch.delenv("GPUMEM_EXPLAIN_OOM", raising=False)
    yield h, seen
    for p in keep:
        h.free(p)
    h.close()


# ---- the OOM formatter -------------------------------------------------------------------


@needs_test_hooks
def test_formatter_writes_the_core_line_then_the_report(oom_heap):
    h, seen = oom_heap
    info = h.last_oom()
    text = call_formatter(info, procs=[(4242, 300 * MiB)])
    first, _, rest = text.partition("\n")
    # The one line torch_alloc.cpp writes itself: device 0 has no torch heap here.
    assert first.startswith("CUDA out of memory. Tried to allocate 400.00 MiB. GPU 0 has a total capacity of ")
    assert "Where the device's" in rest and "[live_tensors]" in rest and "What to do:" in rest
    # The process list torch_alloc.cpp took is what the report shows, not asked again
    # (the sim heap itself lists no other process).
    assert seen == [0] and 4242 not in [pid for pid, _ in h.device_processes() or []]
    assert "PID 4242" in rest and "[other_processes]" in rest


@needs_test_hooks
def test_formatter_reports_what_private_pools_keep(oom_heap):
    h, _ = oom_heap
    info = dict(h.last_oom(), pool_live_bytes=5 * MiB, pool_free_bytes=96 * MiB)
    text = call_formatter(info)
    assert "[private_pools]" in text
    assert "96.00 MiB are free but kept for private pools" in text and "5.00 MiB live" in text
    assert "[private_pools]" not in call_formatter(h.last_oom())  # no pool holds anything here


@needs_test_hooks
def test_formatter_with_and_without_the_gil_agree(oom_heap):
    h, _ = oom_heap
    info = h.last_oom()
    assert call_formatter(info, fn=gil_formatter) == call_formatter(info, fn=no_gil_formatter)
    got = []
    t = threading.Thread(target=lambda: got.append(call_formatter(info)))
    t.start()
    t.join()
    assert got == [call_formatter(info)]


@needs_test_hooks
def test_formatter_keeps_the_line_when_the_report_fails(oom_heap, monkeypatch):
    h, _ = oom_heap
    info = h.last_oom()
    line = call_formatter(info).split("\n")[0]

    def broken(device):
        raise RuntimeError("no heap today")

    monkeypatch.setattr(explain_module, "_torch_heap", broken)
    assert call_formatter(info) == f"{line} (gpumem.explain failed: RuntimeError: no heap today)"
    # A formatter that breaks: the line, and a note, as a Heap's message says it.
    previous = _C._set_oom_formatter(lambda *a: 42)
    try:
        assert call_formatter(info) == f"{line} (gpumem.explain failed: it did not return a str)"
        with pytest.raises(gpumem.OutOfMemoryError, match=r"\(gpumem.explain failed: it did not return a str\)$"):
            h.malloc(1 << 40)
    finally:
        _C._set_oom_formatter(previous)


@needs_test_hooks
def test_explain_oom_0_keeps_one_line(oom_heap, monkeypatch):
    h, _ = oom_heap
    info = h.last_oom()
    full = call_formatter(info)
    monkeypatch.setenv("GPUMEM_EXPLAIN_OOM", "0")
    assert call_formatter(info) == full.split("\n")[0]


@needs_test_hooks
def test_long_report_is_cut_at_a_line_end(oom_heap):
    h, _ = oom_heap
    info = h.last_oom()
    full = call_formatter(info)
    line = full.split("\n")[0]
    buflen = len(line.encode()) + 200
    assert len(full.encode()) >= buflen  # otherwise this tests nothing
    cut = call_formatter(info, buflen=buflen)
    assert cut.endswith("\n[report truncated: gpumem.last_oom() returns all of it]")
    body = cut[: -len("\n[report truncated: gpumem.last_oom() returns all of it]")]
    assert full.startswith(body) and full[len(body)] == "\n" and body.startswith(line)


@needs_test_hooks
def test_formatter_registered_in_torch_path_does_not_recurse(oom_heap):
    """gm_torch_format_oom calls the registered formatter, which calls
    gm_torch_format_oom for the one line: the second call must write it."""
    h, _ = oom_heap
    info = h.last_oom()
    gt.set_oom_formatter(VIZ_HOOKS["oom_formatter"])
    try:
        text = call_formatter(info)
    finally:
        gt.set_oom_formatter(0)
    assert text.startswith("CUDA out of memory.") and "[live_tensors]" in text
    assert text.count("CUDA out of memory.") == 1


# ---- the stack hook ----------------------------------------------------------------------

context_hook = ctypes.CFUNCTYPE(ctypes.c_uint64)(VIZ_HOOKS["context"])


def allocation_site():
    return context_hook()  # the GIL is released around this call


@needs_test_hooks
def test_stack_hook_takes_the_gil_back_in_python_threads():
    _C._stacks_enable(True)
    try:
        ctx = allocation_site()
        got = []
        t = threading.Thread(target=lambda: got.append(allocation_site()))
        t.start()
        t.join()
    finally:
        _C._stacks_enable(False)
    for c in (ctx, got[0]):
        frames = _C._stack_frames(c)
        assert frames and frames[0]["name"] == "allocation_site" and frames[0]["filename"] == __file__
    assert _C._stack_frames(ctx)[1]["name"] == "test_stack_hook_takes_the_gil_back_in_python_threads"
    assert allocation_site() == 0  # capture off


def test_stack_hook_is_set_and_cleared_only_with_torch_active(monkeypatch):
    from gpumem import _heaplike as _heap

    calls = []
    monkeypatch.setattr(_C, "_torch_stack_hook", lambda on: calls.append(on))
    monkeypatch.setattr(_heap, "_torch_hooks", {})
    h = gpumem.Heap(device="sim", capacity=GiB)
    try:
        gpumem.record_history(True, device=h)
        assert calls == []  # gpumem.torch registered no hooks: not torch's allocator
        _heap.register_torch_hooks(active=lambda: False, stack_hook=_torch_viz.set_stack_hook)
        gpumem.record_history(True, device=h, stacks="python")
        assert calls == []  # registered, but not the allocator
        _heap.register_torch_hooks(active=lambda: True)
        gpumem.record_history(True, device=h, stacks="python")
        gpumem.record_history(True, device=h, stacks=None)
        gpumem.record_history(False, device=h)
    finally:
        gpumem.record_history(False, device=h)
        h.close()
    assert calls[:3] == [True, False, False]


# ---- which heap, and torch's memory API ---------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda tmp: gpumem.snapshot(),
        lambda tmp: gpumem.explain(),
        lambda tmp: gpumem.last_oom(),
        lambda tmp: gpumem.dump_snapshot(tmp / "s.pickle"),
        lambda tmp: gpumem.record_history(True),
        lambda tmp: gpumem.snapshot("cuda:0"),
    ],
)
def test_no_heap_given_and_gpumem_not_installed(call, tmp_path):
    assert not gt.status()["allocator_active"]
    with pytest.raises(NoHeapError, match=r"gpumem.install\(\).*or pass a gpumem.Heap"):
        call(tmp_path)
    assert not (tmp_path / "s.pickle").exists()


def test_torch_heap_without_a_heap_says_so():
    with pytest.raises(NoHeapError, match="no heap on cuda:3: torch has not allocated there"):
        registry_heap(3)
    assert _C.registry_heap(3, open=False) is None and 3 not in _C.registry_devices()


def test_torch_record_memory_history_routes_to_record_history(monkeypatch):
    calls = []
    monkeypatch.setattr(_C, "registry_history_enable", lambda n: calls.append(n))
    try:
        _install._record_history("all", "all", "all", 1000)  # torch's defaults: C++ + Python asked
        assert calls[-1] == 1000 and _C._stacks_info()["enabled"]
        _install._record_history("state", "alloc", "python", 5)
        assert calls[-1] == 0 and _C._stacks_info()["enabled"]
        _install._record_history("all", None, "python", 1 << 62)  # context=None: no stacks; ring bounded
        assert calls[-1] == gt.MAX_HISTORY and not _C._stacks_info()["enabled"]
        _install._record_history(True, True, 7)  # the legacy form
        assert calls[-1] == 7 and _C._stacks_info()["enabled"]
        _install._record_history(False)
        assert calls[-1] == 0 and not _C._stacks_info()["enabled"]
        with pytest.raises(ValueError, match="enabled must be None, 'state' or 'all'"):
            _install._record_history("sometimes")
    finally:
        _C._stacks_enable(False)


def test_torch_snapshot_without_heaps_is_empty():
    snap = _torch_viz.torch_snapshot_dict((0, 0, True))
    assert snap["segments"] == [] and all(t == [] for t in snap["device_traces"])


def test_torch_trace_entries_carry_the_bytes_asked_for():
    """torch's trace entries of a block's life (alloc, free_requested, free_completed) carry the bytes
    the request asked for; gpumem's history keeps both that and the block's size (512-byte rounded)."""
    import gpumem
    from gpumem.snapshot import Snapshot
    from gpumem.torch import _viz

    with gpumem.Heap(device="sim", capacity=1 << 30) as heap:
        heap.history_enable(100)
        p = heap.malloc(311 * 411 * 4)
        heap.free(p)
        sizes = [(e[1], e[3], e[6]) for e in heap.history()[0] if e[1] != "map"]
        assert sizes == [(a, 511488, 511284) for a in ("alloc", "free_requested", "free_completed")]
        as_torch = Snapshot.from_heap(heap).to_torch(0, entry_hook=_viz._entry_hook())
        own = Snapshot.from_heap(heap).to_torch(0)
    blocks = [e for e in as_torch["device_traces"][0] if e["action"] in ("alloc", "free_requested", "free_completed")]
    assert [e["size"] for e in blocks] == [311 * 411 * 4] * 3
    # gpumem's own dumps keep the blocks' sizes, which its readers replay
    assert {e["size"] for e in own["device_traces"][0] if e["action"] == "alloc"} == {511488}


def test_the_test_hooks_are_there_exactly_when_the_build_says_so():
    # a build without GPUMEM_TEST_HOOKS=1 (what `pip install .` ships) has none of them
    for name in ("_torch_test_alloc", "_test_hold_boundary_lock", "_torch_viz_hooks"):
        assert hasattr(_C, name) is _C.TEST_HOOKS, name
