"""Allocation history: the core's ring wraps, Python stacks are interned per
allocation site, allocations without the GIL get none, and the table is bounded."""

import ctypes
import sys
import threading

import pytest

import gpumem
from gpumem import _C
from gpumem.history import frames_for, history, record_history, stack_table_info
from helpers import history_heap

MiB = 1 << 20


@pytest.fixture
def heap():
    yield from history_heap(256 * MiB)
    _C._stacks_clear()


def test_ring_wraps_keeping_the_newest(heap):
    record_history(True, device=heap, stacks=None, max_entries=8)
    ptrs = [heap.malloc(MiB + 512 * i) for i in range(30)]
    h = history(heap)
    allocs = [e for e in h.entries if e.action == "alloc"]
    assert len(h) == 8
    # the ring holds the last 8 events, oldest first, and counts what it overwrote
    assert [e.addr for e in allocs] == ptrs[-len(allocs) :]
    assert [e.size for e in allocs] == [MiB + 512 * i for i in range(30)][-len(allocs) :]
    assert all(a.time_ns <= b.time_ns for a, b in zip(h.entries, h.entries[1:]))
    total = h.dropped + len(h)
    assert total >= 30 and h.dropped == total - 8
    for p in ptrs:
        heap.free(p)
    h2 = history(heap)
    assert [e.action for e in h2.entries][-2:] == ["free_requested", "free_completed"]
    assert h2.entries[-1].addr == ptrs[-1]
    assert h2.dropped == total + 2 * 30 - 8


def test_ring_exactly_full_and_resized(heap):
    record_history(True, device=heap, stacks=None, max_entries=4)
    heap.free(heap.malloc(MiB))  # map, alloc, free_requested, free_completed
    h = history(heap)
    assert [e.action for e in h.entries] == ["map", "alloc", "free_requested", "free_completed"] and h.dropped == 0
    record_history(True, device=heap, stacks=None, max_entries=2)  # resizing keeps the newest that fit
    h = history(heap)
    assert [e.action for e in h.entries] == ["free_requested", "free_completed"] and h.dropped == 2
    record_history(True, device=heap, stacks=None, max_entries=8)  # growing keeps them all
    heap.free(heap.malloc(MiB))
    assert [e.action for e in history(heap).entries][:2] == ["free_requested", "free_completed"]
    assert len(history(heap)) == 5 and history(heap).dropped == 2
    record_history(False, device=heap)
    heap.free(heap.malloc(MiB))
    assert len(history(heap)) == 0


def allocate_here(h, n):
    return [h.malloc(MiB) for _ in range(n)]


def test_python_stacks_are_interned_per_site(heap):
    record_history(True, device=heap, stacks="python", max_entries=1000)
    before = stack_table_info()["stacks"]
    ptrs = allocate_here(heap, 50)
    info = stack_table_info()
    assert info["stacks"] == before + 1  # 50 allocations, one stack record
    snap = gpumem.snapshot(heap)
    live = [b for b in snap.blocks if b.state == "live"]
    assert len({b.context for b in live}) == 1
    frames = live[0].frames
    # Before 3.12 a list comprehension is a frame of its own (PEP 709 inlined it).
    innermost = "<listcomp>" if sys.version_info < (3, 12) else "allocate_here"
    assert frames[0].name == innermost
    names = [f.name for f in frames]
    assert "allocate_here" in names and "test_python_stacks_are_interned_per_site" in names
    assert frames[names.index("allocate_here")].filename == __file__
    # the site names the innermost named function, skipping <listcomp>
    line = allocate_here.__code__.co_firstlineno + 1
    assert live[0].site == f"{__file__}:{line} in allocate_here"
    alloc_entries = [e for e in history(heap).entries if e.action == "alloc"]
    assert alloc_entries and all(e.frames == frames for e in alloc_entries)
    # a caller's own context id is kept, not replaced by a stack
    p = heap.malloc(MiB, context=1234)
    assert [b.context for b in gpumem.snapshot(heap).blocks if b.addr == p] == [1234]
    assert frames_for(1234) == ()
    # the torch-format trace carries the frames
    t = snap.to_torch()
    assert any(e["frames"] and e["frames"][0]["filename"] == __file__ for e in t["device_traces"][0])
    for q in ptrs:
        heap.free(q)


def test_stacks_off_gives_no_context(heap):
    record_history(True, device=heap, stacks=None, max_entries=100)
    p = heap.malloc(MiB)
    assert [b.context for b in gpumem.snapshot(heap).blocks if b.addr == p] == [0]


def test_no_gil_no_stack(heap):
    """A thread that does not hold the GIL (autograd workers, C++ threads) gets 0."""
    record_history(True, device=heap, stacks="python")
    lib = ctypes.CDLL(_C.__file__)  # CDLL calls release the GIL
    fn = lib.gm_py_capture_context
    fn.restype = ctypes.c_uint64
    before = stack_table_info()["no_gil"]
    assert fn() == 0
    assert stack_table_info()["no_gil"] == before + 1
    with_gil = ctypes.PyDLL(_C.__file__).gm_py_capture_context
    with_gil.restype = ctypes.c_uint64
    ctx = with_gil()
    assert ctx >> 63 == 1 and frames_for(ctx)[0].name == "test_no_gil_no_stack"
    # other Python threads hold the GIL when they call malloc, so they do get stacks
    out = []
    t = threading.Thread(target=lambda: out.append(heap.malloc(MiB)))
    t.start()
    t.join()
    b = [b for b in gpumem.snapshot(heap).blocks if b.addr == out[0]][0]
    assert b.frames and b.frames[0].name == "<lambda>"


def test_stack_table_is_bounded(heap):
    _C._stacks_clear()
    record_history(True, device=heap, stacks="python", max_stacks=2, max_depth=3)
    try:
        a = heap.malloc(MiB)
        _b = heap.malloc(MiB)
        c = heap.malloc(MiB)
        info = stack_table_info()
        assert info["stacks"] == 2 and info["overflow"] == 1 and info["frames"] <= 6
        blocks = {x.addr: x for x in gpumem.snapshot(heap).blocks}
        assert len(blocks[a].frames) <= 3
        assert "stack table full" in blocks[c].frames[0].name
        old = blocks[a].context
        _C._stacks_clear()
        assert _C._stack_frames(old) is None  # ids from before a clear resolve to nothing
    finally:
        record_history(True, device=heap, stacks=None, max_stacks=1 << 16, max_depth=64)


def test_stacks_all_takes_the_native_frames_before_the_python_ones(heap):
    """stacks="all" takes the C++ frames too (torch's unwinder, symbolized when asked for): the Python frames
    stay, outermost, with the native ones before them; stacks="python" gives the Python frames alone."""
    pytest.importorskip("torch")

    def allocating_site():
        return heap.malloc(MiB)

    try:
        got = {}
        for stacks in ("all", "python"):
            record_history(True, device=heap, stacks=stacks)
            assert _C._stacks_info()["cpp"] == (stacks == "all")
            p = allocating_site()
            got[stacks] = [b.frames for b in gpumem.snapshot(heap).blocks if b.addr == p][0]
            heap.free(p)
        py, frames = got["python"], got["all"]
        assert py[0].name == "allocating_site"
        native = frames[: len(frames) - len(py)]
        assert native and frames[len(native) :] == py, "the native frames come first, then the Python ones"
        assert any(f.name != "??" for f in native), native  # named from the symbols
        assert not any(f.name.startswith("gm_py_capture_context") or f.name == "with_native" for f in native)
    finally:
        record_history(True, device=heap, stacks=None)


def test_record_history_rejects_bad_arguments(heap):
    with pytest.raises(ValueError, match="python"):
        record_history(True, device=heap, stacks="cpp")
    with pytest.raises(ValueError):
        record_history(True, device=heap, max_entries=0)
    with pytest.raises(ValueError):
        record_history("sometimes", device=heap)
    record_history("state", device=heap)  # stacks for blocks, no event ring
    p = heap.malloc(MiB)
    assert len(history(heap)) == 0
    assert [b.frames for b in gpumem.snapshot(heap).blocks if b.addr == p][0]


def test_stacks_all_without_torch_takes_the_python_frames(heap, monkeypatch):
    """Where torch (and so its unwinder) cannot be imported, stacks="all" records the Python frames alone."""
    import builtins

    real_import = builtins.__import__

    def no_torch(name, *args, **kw):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("no torch here")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    try:
        record_history(True, device=heap, stacks="all")
        assert _C._stacks_info()["enabled"] and not _C._stacks_info()["cpp"]

        def allocating_site():
            return heap.malloc(MiB)

        p = allocating_site()
        frames = [b.frames for b in gpumem.snapshot(heap).blocks if b.addr == p][0]
        assert frames[0].name == "allocating_site"
        heap.free(p)
    finally:
        monkeypatch.undo()
        record_history(True, device=heap, stacks=None)
