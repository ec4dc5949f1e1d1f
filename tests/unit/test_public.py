"""What a notebook user meets first: every public exception is at gpumem.*, and
every public object has a short repr (typing its name never floods the output)."""

import ast
import pathlib

import pytest

import gpumem
from gpumem.history import history
from gpumem.replay import replay
from gpumem.trace import load_trace

MiB = 1 << 20
PKG = pathlib.Path(gpumem.__file__).resolve().parent
SHORT = 300  # characters


def test_everything_in_all_is_there():
    for name in gpumem.__all__:
        assert getattr(gpumem, name) is not None, name


def test_every_exception_class_is_at_the_top():
    """Each exception class the Python package defines (a class deriving from an
    *Error or Exception) can be caught as gpumem.<Name>."""
    defined = {}
    for path in PKG.rglob("*.py"):
        if path.parent.name == "cli":  # the command line's own UsageError never leaves main()
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                bases = [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
                if any(b.endswith(("Error", "Exception")) for b in bases):
                    defined[node.name] = path.relative_to(PKG.parent)
    # CppBuildError (CheckpointBuildError) is internal to the torch layer: its C++ parts built on first use.
    defined.pop("CppBuildError", None)
    assert {"TraceError", "NoHeapError", "InstallError", "OptionError", "UnknownDataError"} <= defined.keys()
    for name in sorted(defined):
        cls = getattr(gpumem, name, None)
        assert isinstance(cls, type) and issubclass(cls, Exception), f"gpumem.{name} ({defined[name]})"
        assert name in gpumem.__all__, name
    for name in ("OutOfMemoryError", "InvalidPointerError", "CorruptionError", "DeviceError"):
        assert issubclass(getattr(gpumem, name), Exception)


def test_exceptions_print_public_names():
    """A traceback names each exception where users catch it, never a private module."""
    import importlib
    import os
    import subprocess
    import sys

    for name in gpumem.__all__:
        cls = getattr(gpumem, name)
        if isinstance(cls, type) and issubclass(cls, Exception):
            assert not any(part.startswith("_") for part in cls.__module__.split(".")), (name, cls.__module__)
            assert getattr(importlib.import_module(cls.__module__), cls.__qualname__) is cls, name
    env = dict(os.environ, PYTHONPATH=str(PKG.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run(
        [sys.executable, "-c", "import gpumem; gpumem.snapshot()"], env=env, capture_output=True, text=True
    )
    assert "gpumem.NoHeapError: no gpumem heap" in p.stderr, p.stderr


def test_exceptions_are_the_ones_raised():
    with pytest.raises(gpumem.TraceError):
        load_trace("no_such_trace_anywhere")
    with pytest.raises(gpumem.NoHeapError):
        gpumem.snapshot()
    with pytest.raises(gpumem.UnknownDataError):
        gpumem.data.trace_path("no_such_trace_anywhere")
    from gpumem.torch import normalize_options

    with pytest.raises(gpumem.OptionError):
        normalize_options({"cap": "1.5"})


def short(obj):
    text = repr(obj)
    assert len(text) <= SHORT and "\n" not in text, f"{type(obj).__name__}: {len(text)} characters: {text[:200]}"
    return text


def test_short_reprs():
    t = load_trace("gpt2_generate")  # 729172 events: its words alone repr to millions of characters
    assert "gpt2_generate" in short(t) and "729172 events" in short(t)
    r = replay(load_trace("seed_fragmentation"), 80 << 30)
    assert "seed_fragmentation" in short(r)
    with gpumem.Heap(device="sim", capacity="4GiB") as h:
        short(h)
        gpumem.record_history(True, device=h)
        ptrs = [h.malloc(MiB) for _ in range(3000)]
        for p in ptrs[::2]:
            h.free(p)
        snap = gpumem.snapshot(h)
        for obj in (snap, snap.summary, snap.blocks[0], snap.segments[0]):
            short(obj)
        hist = history(h)
        assert len(hist) > 1000 and "entries" in short(hist)
        short(hist.entries[0])
        report = gpumem.explain("8GiB", h)
        assert "does not fit" in short(report)
        assert len(str(report)) > SHORT  # the whole report is print()'s
        short(gpumem.memory_over_time(h))
        with pytest.raises(gpumem.OutOfMemoryError):
            h.malloc(1 << 40)
        short(gpumem.last_oom(h))


def test_a_heap_passed_first_is_understood_or_refused_in_one_line(tmp_path):
    """snapshot(heap) is the natural call; its neighbours take the heap the same way or say how."""
    h = gpumem.Heap(device="sim", capacity="1GiB")
    try:
        h.malloc(1 << 20)
        gpumem.dump_snapshot(h, tmp_path / "a.pickle")  # the heap first, as in snapshot(heap)
        gpumem.dump_snapshot(tmp_path / "b.pickle", device=h)
        assert (tmp_path / "a.pickle").read_bytes() == (tmp_path / "b.pickle").read_bytes()
        with pytest.raises(TypeError, match=r"record_history\(True, device=heap\)"):
            gpumem.record_history(h)
    finally:
        h.close()
