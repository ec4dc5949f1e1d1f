"""The stack tables (csrc/python/history_glue.c) at the Python boundary: Python
code that runs while a stack is taken or its frames are made -- a garbage
collector callback, a __del__, torch's C++ gatherer and symbolizer, a dict
key's __eq__ -- may take more stacks (growing the tables) or clear them; the
answer is a stack, None or an exception, never a crash.  .ci/boundary_asan
runs this file under ASan and UBSan."""

import gc
import sys

import pytest

import gpumem
from gpumem import _C
from gpumem.history import frames_for


@pytest.fixture(autouse=True)
def stacks_off():
    threshold = gc.get_threshold()
    yield
    gc.set_threshold(*threshold)
    gc.callbacks[:] = [c for c in gc.callbacks if not getattr(c, "_gpumem_test", False)]
    _C._stacks_cpp(None, None)
    _C._stacks_enable(False, max_depth=64, max_stacks=1 << 16)  # the defaults
    _C._stacks_clear()


def new_call_sites(n, depth=30):
    """Stacks never seen before: `n` fresh code objects, each capturing `depth` frames down."""
    ids = []
    for k in range(n):
        ns = {"cap": _C._stack_capture}
        exec(f"def f{k}(d):\n    return f{k}(d - 1) if d else cap()\n", ns)
        ids.append(ns[f"f{k}"](depth))
    return ids


def in_gc(fn):
    """Call fn from the garbage collector, as often as it runs."""

    def cb(phase, info):
        if phase == "start":
            fn()

    cb._gpumem_test = True
    gc.callbacks.append(cb)
    gc.set_threshold(1)


@pytest.mark.parametrize("meddle", ["grow", "clear"])
def test_frames_for_while_a_gc_callback_grows_or_clears_the_table(meddle):
    """frames_for held a pointer into the stack table while it made the frames'
    objects; a collector callback that took new stacks (realloc) or cleared the
    table made it read freed memory."""
    h = gpumem.Heap(device="sim", capacity="64MiB")
    gpumem.record_history(True, stacks="python", device=h, max_depth=1000)
    ptrs = [h.malloc(4096) for _ in range(3)]
    ctxs = [e.context for e in gpumem.history.history(h).entries if e.context]
    assert ctxs
    # Deep stacks: their frames' dicts outnumber the interpreter's free list,
    # so making them runs the collector.
    ctxs += new_call_sites(4, depth=300)
    in_gc((lambda: new_call_sites(4, depth=300)) if meddle == "grow" else _C._stacks_clear)
    for c in ctxs:
        got = _C._stack_frames(c)
        assert got is None or all(set(f) == {"filename", "name", "line"} for f in got)
        frames_for(c)
    for p in ptrs:
        h.free(p)
    h.close()


def test_python_frames_survive_the_table_being_cleared_from_a_gc_callback():
    _C._stacks_enable(True, max_depth=1000)
    ctx = new_call_sites(1, depth=300)[0]
    calls = []

    def clear():
        if not calls:
            calls.append(1)
            _C._stacks_clear()

    in_gc(clear)
    got = _C._stack_frames(ctx)
    assert got is None or (len(got) > 300 and got[0]["name"] == "f0")


class Gatherer:
    """torch's gather_traceback, or a hostile one: `then` runs inside it."""

    def __init__(self, then=None):
        self.then, self.calls = then, 0

    def __call__(self, python, script, cpp):
        self.calls += 1
        if self.then and self.calls == 1:
            self.then()
        return ("native", self.calls)


def symbolize_plain(tbs):
    return [[{"filename": "x.cpp", "name": f"fn{i}", "line": i} for i in range(3)] for _ in tbs]


def test_a_gatherer_that_takes_stacks_fills_the_last_slot_first():
    """The room for a C++ record was made before the gatherer ran; a gatherer
    whose nested capture took the last slot made the outer capture write past
    the array."""
    _C._stacks_enable(True, max_stacks=1024)
    _C._stacks_cpp(Gatherer(), symbolize_plain)
    for _ in range(1023):
        _C._stack_capture()
    nested = []
    _C._stacks_cpp(Gatherer(lambda: nested.append(_C._stack_capture())), symbolize_plain)
    ctx = _C._stack_capture()
    assert _C._stacks_info()["native_stacks"] == 1024
    assert _C._stack_frames(ctx) is not None and _C._stack_frames(nested[0]) is not None


def test_a_gatherer_that_clears_the_table_gets_no_stack():
    _C._stacks_enable(True)
    _C._stacks_cpp(Gatherer(_C._stacks_clear), symbolize_plain)
    assert _C._stack_capture() == 0
    assert _C._stack_frames(_C._stack_capture()) is not None  # the next capture works


def test_a_gatherer_that_replaces_itself():
    _C._stacks_enable(True)
    _C._stacks_cpp(Gatherer(lambda: _C._stacks_cpp(None, None)), symbolize_plain)
    ctx = _C._stack_capture()
    assert ctx != 0


@pytest.mark.parametrize("meddle", ["capture", "clear", "unset"])
def test_a_symbolizer_that_takes_stacks_or_clears_the_table(meddle):
    """cpp_frames kept a pointer to its record across the symbolizer: one that
    took stacks (growing the records) or cleared the table made it write freed
    memory."""
    _C._stacks_enable(True)
    _C._stacks_cpp(Gatherer(), symbolize_plain)
    ctxs = [_C._stack_capture() for _ in range(3)]

    def symbolize(tbs):
        if meddle == "capture":
            for _ in range(3000):
                _C._stack_capture()
        elif meddle == "clear":
            _C._stacks_clear()
        else:
            _C._stacks_cpp(None, None)
        return symbolize_plain(tbs)

    _C._stacks_cpp(Gatherer(), symbolize)
    for c in ctxs:
        try:
            got = _C._stack_frames(c)
        except RuntimeError as e:  # the symbolizer unset itself: the later records cannot be read
            assert meddle == "unset" and "no C++ frame symbolizer" in str(e)
            continue
        assert got is None or got[0]["filename"] == "x.cpp"
    if meddle == "capture":
        assert len(_C._stack_frames(ctxs[0])) >= 3


class EvilKey(str):
    """A key equal to "name" whose __eq__ empties the list of frames it is in."""

    victim = None

    def __hash__(self):
        return hash("name")

    def __eq__(self, other):
        if EvilKey.victim is not None:
            EvilKey.victim.clear()
        return str.__eq__(self, other)


def test_a_symbolizer_whose_frames_change_while_they_are_read():
    _C._stacks_enable(True)

    def symbolize(tbs):
        frames = [{EvilKey("x"): 1, "name": "with_native"} for _ in range(5)]
        EvilKey.victim = frames
        return [frames]

    _C._stacks_cpp(Gatherer(), symbolize)
    ctx = _C._stack_capture()
    got = _C._stack_frames(ctx)
    EvilKey.victim = None
    assert isinstance(got, list)


def test_a_symbolizer_that_returns_junk_is_a_type_error():
    _C._stacks_enable(True)
    _C._stacks_cpp(Gatherer(), lambda tbs: 42)
    with pytest.raises(TypeError, match="no list of frames"):
        _C._stack_frames(_C._stack_capture())


class Native:
    """A gatherer's result whose __del__ runs `then`."""

    then = None

    def __del__(self):
        if Native.then:
            Native.then()


def test_clearing_the_table_while_what_it_drops_takes_stacks():
    """Clearing dropped each native stack while walking the table: one whose
    __del__ took stacks wrote into (or grew) the table being freed."""
    _C._stacks_enable(True)
    _C._stacks_cpp(lambda *a: Native(), symbolize_plain)
    for _ in range(1500):
        _C._stack_capture()
    taken = []
    Native.then = lambda: len(taken) < 1500 and taken.append(_C._stack_capture())
    try:
        _C._stacks_clear()
    finally:
        Native.then = None
    assert len(taken) == 1500 and _C._stacks_info()["native_stacks"] >= 1
    assert all(_C._stack_frames(c) is not None for c in taken[-3:] if c)
    Native.then = _C._stacks_clear  # and clearing again from inside
    try:
        _C._stacks_clear()
    finally:
        Native.then = None
    assert _C._stack_frames(_C._stack_capture()) is not None


def test_a_gatherer_whose_release_sets_another():
    class Gather:
        def __call__(self, *a):
            return ("native",)

        def __del__(self):
            _C._stacks_cpp(Gatherer(), symbolize_plain)

    _C._stacks_enable(True)
    _C._stacks_cpp(Gather(), symbolize_plain)
    _C._stacks_cpp(None, None)  # dropping Gather sets a new pair, which stays
    assert _C._stacks_info()["cpp"] is True
    assert _C._stack_frames(_C._stack_capture())[0]["filename"] == "x.cpp"  # both halves of the pair set
    _C._stacks_cpp(None, None)
    assert _C._stacks_info()["cpp"] is False


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
