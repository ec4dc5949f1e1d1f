"""torch's memory history as its visualisations read it, checked without a GPU.

Each case runs in a fresh interpreter with a simulated device behind torch's heap of
device 0 (_C.registry_open_sim) and calls the entry points torch calls (allocation, free,
empty_cache) with the GIL released, as torch's ops do; gpumem.torch's hooks are
registered as install() registers them.  What is checked is what
torch.cuda.memory._snapshot() holds under each of torch's context modes (which trace
entries carry which stack), the user metadata of torch.cuda.memory._set_memory_metadata,
and what torch's profiler sees of gpumem's allocations.  tests/gpu/test_gpu_torch_features.py
checks the same through torch on a GPU.
"""

import pytest

from helpers import TORCH_BOUNDARY, needs_test_hooks, run_python

PRELUDE = (
    """
import ctypes, json
from gpumem import _C
from gpumem._heaplike import register_torch_hooks
from gpumem.torch import _viz
MiB = 1 << 20
"""
    + TORCH_BOUNDARY
    + """
_C.registry_open_sim(0, 1 << 30)
# what gpumem.install() registers: torch's allocations take Python stacks
register_torch_hooks(active=lambda: True, stack_hook=_viz.set_stack_hook)
def trace():
    return _viz.torch_snapshot_dict()["device_traces"][0]
def names(entry):
    return [f["name"] for f in entry["frames"]]
def each_context(case):
    # {context: case()} for each of torch's context modes, recording from an empty cache
    got = {}
    for context in ("alloc", "all", "state"):
        empty_cache()
        _viz.record_torch_history("all", context, "python")
        got[context] = case()
        _viz.record_torch_history(None)
    return got
def py_names(entry):
    return [f["name"] for f in entry["frames"] if f["filename"].endswith(".py") or f["filename"].startswith("<")]
"""
)


def run_py(code, **kw):
    return run_python(code, PRELUDE, timeout=300, unset=("GPUMEM_CONF", "GPUMEM_EXPLAIN_OOM"), **kw)


def test_context_none_leaves_no_stack_even_where_torchs_plot_filter_keeps_entries():
    """trace_plot(filter_freed=True) drops every alloc/free pair from the snapshot it is
    given: what stays are the segment events, which carry the stack of the allocation
    that mapped them -- and none at all once context=None."""
    pytest.importorskip("torch")
    r = run_py("""
        from torch.cuda._memory_viz import filter_alloc_free_pairs
        got = []
        for context, stacks in (("all", "all"), ("all", "python"), (None, "python")):
            empty_cache()
            _viz.record_torch_history("all", context, stacks)
            def run_the_model():
                x = alloc(128 * 128 * 4, 0, None)
                y = alloc(128 * 128 * 4, 0, None)
                free(y, 0, 0, None)
                free(x, 0, 0, None)
            run_the_model()
            ss = _viz.torch_snapshot_dict()
            full = json.dumps(ss)
            kept = filter_alloc_free_pairs(ss)["device_traces"][0]
            # the first Python frame (stacks="all" puts the C++ frames before it)
            got.append([context, "run_the_model" in full, [(e["action"], py_names(e)[:1]) for e in kept]])
            _viz.record_torch_history(None)
        out(got=got)
    """)
    (c1, full1, kept1), (c2, full2, kept2), (c3, full3, kept3) = r["got"]
    assert full1 and full2 and not full3
    for kept in (kept1, kept2):
        assert kept == [["segment_map", ["run_the_model"]]], kept
    assert kept3 == [["segment_map", []]], kept3


def test_stacks_all_puts_the_cpp_frames_before_the_python_ones():
    # torch's stacks="all": an allocation's stack starts with the native frames of the
    # thread that allocated, innermost first -- here the entry point torch calls, reached
    # through ctypes -- then its Python frames; stacks="python" has the Python ones only
    pytest.importorskip("torch")  # the unwinder is torch's
    r = run_py("""
        got = {}
        for stacks in ("all", "python"):
            empty_cache()
            _viz.record_torch_history("all", "all", stacks)
            def allocating_site():
                return alloc(4096, 0, None)
            p = allocating_site()
            (e,) = [e for e in trace() if e["action"] == "alloc"]
            got[stacks] = e["frames"]
            free(p, 0, 0, None)
            _viz.record_torch_history(None)
        out(got=got)
    """)
    frames, py = r["got"]["all"], r["got"]["python"]
    assert py[0]["name"] == "allocating_site"
    native = frames[: len(frames) - len(py)]
    assert native and frames[len(native) :] == py, "the native frames come first, then the Python ones"
    names = [f["name"] for f in native]
    assert "gpumem_torch_alloc" in names and "allocating_site" not in names
    assert not any(n.startswith("gm_py_capture_context") or n == "with_native" for n in names)


def test_each_context_mode_gives_its_trace_entries_their_stacks():
    r = run_py("""
        def case():
            x = None
            def thealloc():
                nonlocal x
                x = alloc(3 * 4 * 4, 0, None)
            def thefree():
                free(x, 0, 0, None)
            def keep_one():
                return alloc(1024, 0, None)
            thealloc()
            thefree()
            kept = keep_one()
            snap = _viz.torch_snapshot_dict()
            blocks = [names(b)[:1] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
            free(kept, 0, 0, None)
            return {
                "trace": [(e["action"], names(e)[:1]) for e in snap["device_traces"][0]],
                "blocks": blocks,
                "text": json.dumps(snap),
            }
        out(got=each_context(case))
    """)
    g = r["got"]

    def entries(freed_by):
        return [
            ["segment_map", ["thealloc"]],
            ["alloc", ["thealloc"]],
            ["free_requested", [freed_by]],
            ["free_completed", [freed_by]],
            ["alloc", ["keep_one"]],
        ]

    # "all": a free carries the stack of the code that freed
    assert g["all"]["trace"][:5] == entries("thefree")
    # "alloc": every entry carries its block's allocation stack (torch's too), never the freeing one
    assert g["alloc"]["trace"][:5] == entries("thealloc")
    # "state": no trace entry carries a stack; the blocks alive still do
    assert [a for a, _ in g["state"]["trace"][:5]] == [
        "segment_map",
        "alloc",
        "free_requested",
        "free_completed",
        "alloc",
    ]
    assert all(frames == [] for _, frames in g["state"]["trace"])
    for context in ("alloc", "all", "state"):
        assert g[context]["blocks"] == [["keep_one"]]
        assert ("thefree" in g[context]["text"]) == (context == "all")
        assert ("thealloc" in g[context]["text"]) == (context != "state")


def test_empty_cache_carries_its_callers_stack_with_context_all_only():
    r = run_py("""
        def case():
            p = alloc(4 * MiB, 0, None)
            free(p, 0, 0, None)
            def release_the_cache():
                empty_cache()
            release_the_cache()
            return [names(e)[:1] for e in trace() if e["action"] == "segment_unmap"]
        out(got=each_context(case))
    """)
    assert r["got"]["all"] and all(n == ["release_the_cache"] for n in r["got"]["all"]), r["got"]
    for context in ("alloc", "state"):
        assert r["got"][context] and all(n == [] for n in r["got"][context]), r["got"]


def test_a_stack_recorded_in_one_mode_does_not_show_in_events_of_the_next():
    """A block allocated while stacks were on and freed after context=None: its free
    events carry no stack; one allocated with none and freed under "all" carries the
    freeing code's."""
    r = run_py("""
        _viz.record_torch_history("all", "all", "python")
        def allocated_with_stacks():
            return alloc(MiB, 0, None)
        a = allocated_with_stacks()
        _viz.record_torch_history("all", None, "python")
        def allocated_without():
            return alloc(MiB, 0, None)
        b = allocated_without()
        free(a, 0, 0, None)
        _viz.record_torch_history("all", "all", "python")
        def freed_with_stacks():
            free(b, 0, 0, None)
        freed_with_stacks()
        out(trace=[(e["action"], e["addr"] == a, names(e)[:1]) for e in trace()])
        _viz.record_torch_history(None)
    """)
    t = [tuple(e) for e in r["trace"] if e[0] != "segment_map"]
    assert t == [
        ("alloc", True, ["allocated_with_stacks"]),
        ("alloc", False, []),
        ("free_requested", True, []),
        ("free_completed", True, []),
        ("free_requested", False, ["freed_with_stacks"]),
        ("free_completed", False, ["freed_with_stacks"]),
    ], t


def test_gpumem_record_history_gives_torchs_view_the_allocation_stacks():
    """gpumem.record_history's stacks are torch's context="alloc", whatever torch's
    _record_memory_history last set."""
    r = run_py("""
        import gpumem
        _viz.record_torch_history("all", None, "python")
        _viz.record_torch_history(None)
        gpumem.record_history(True)
        def allocated_here():
            return alloc(MiB, 0, None)
        p = allocated_here()
        def freed_here():
            free(p, 0, 0, None)
        freed_here()
        with_stacks = [(e["action"], names(e)[:1]) for e in trace() if e["action"] != "segment_map"]
        gpumem.record_history(True, stacks=None)
        q = allocated_here()
        without = [(e["action"], names(e)[:1]) for e in trace()][-1]
        gpumem.record_history(False)
        out(with_stacks=with_stacks, without=without)
    """)
    assert r["with_stacks"] == [
        ["alloc", ["allocated_here"]],
        ["free_requested", ["allocated_here"]],
        ["free_completed", ["allocated_here"]],
    ], r
    assert r["without"] == ["alloc", []], r


def test_trace_entries_carry_the_metadata_in_force_when_recorded():
    r = run_py("""
        before = _viz.get_memory_metadata()
        _viz.record_torch_history("all", "state", "python")
        p = alloc(MiB, 0, None)
        _viz.set_memory_metadata("metadata test")
        got = _viz.get_memory_metadata()
        q = alloc(MiB, 0, None)
        free(q, 0, 0, None)
        free(p, 0, 0, None)
        empty_cache()
        _viz.set_memory_metadata("")
        r = alloc(MiB, 0, None)
        try:
            _viz.set_memory_metadata(7)
            bad = None
        except TypeError as e:
            bad = str(e)
        out(before=before, got=got, bad=bad, trace=[(e["action"], e["user_metadata"]) for e in trace()])
        _viz.record_torch_history(None)
    """)
    assert r["before"] == "" and r["got"] == "metadata test"
    assert "must be a str" in r["bad"]
    t = r["trace"]
    first_alloc, last_alloc = t.index(["alloc", ""]), len(t) - 1
    assert t[last_alloc] == ["alloc", ""]
    middle = t[first_alloc + 1 : last_alloc]
    middle = [e for e in middle if e[0] != "segment_map" or e[1]]  # the last alloc maps its page after the reset
    assert [a for a, _ in middle] == [
        "alloc",
        "free_requested",
        "free_completed",
        "free_requested",
        "free_completed",
        "segment_unmap",
    ], t
    assert all(m == "metadata test" for _, m in middle), t


def test_timeline_is_bounded_and_answers_for_times_before_its_window():
    from gpumem.torch._viz import _Timeline
    import time

    tl = _Timeline("start", limit=8)
    t0 = time.monotonic_ns()
    assert tl.at(t0) == "start" and tl.current() == "start"
    stamps = []
    for i in range(20):
        tl.set(i)
        stamps.append(time.monotonic_ns())
    assert len(tl) <= 8 and tl.current() == 19
    assert tl.at(stamps[-1]) == 19 and tl.at(stamps[-2]) == 18
    # times before the kept changes get the newest value dropped, not a made-up one
    oldest_kept = 20 - len(tl)
    assert tl.at(t0) == oldest_kept - 1


@needs_test_hooks
def test_torch_profiler_sees_allocations_and_frees():
    torch = pytest.importorskip("torch")
    if torch.version.cuda:
        # Seen on an H100 with torch 2.11+cu130: this sim-heap check finds no memory events on a CUDA
        # build, while the real path works there (test_memory_views_through_torch_on_a_gpu and torch's
        # own test_memory_profiler_viz pass under gpumem).  Not yet explained.
        pytest.skip("the sim-heap profiler check runs on CPU builds of torch")
    r = run_py("""
        import torch
        def make_some():
            a = _C._torch_test_alloc(MiB, 0)
            b = _C._torch_test_alloc(3 * MiB, 0)
            free(a, MiB, 0, None)
            return b
        outside = _C._torch_test_alloc(MiB, 0)   # no profiler listens: nothing to report
        cpu = [torch.profiler.ProfilerActivity.CPU]   # the host-side memory events, on any torch build
        with torch.profiler.profile(activities=cpu, profile_memory=True, with_stack=True, record_shapes=True) as prof:
            b = make_some()
        def usage(e):
            return getattr(e, "device_memory_usage", None) or getattr(e, "cuda_memory_usage", 0) or 0
        events = [(e.name, usage(e)) for e in prof.events()]
        out(allocs=[u for n, u in events if "_torch_test_alloc" in n],
            caller=[u for n, u in events if "make_some" in n])
    """)
    # each allocation as the profiler saw it, and the caller's net: 1 + 3 - 1 MiB
    assert sorted(r["allocs"]) == [1 << 20, 3 << 20], r
    assert r["caller"] == [3 << 20], r


# ---- through torch on a GPU ----------------------------------------------------------------

GPU_PRELUDE = """
import json
import torch
import gpumem
"""


def _cuda_count():
    from helpers import cuda_devices

    return cuda_devices()[0]


@pytest.mark.gpu
@pytest.mark.skipif(_cuda_count() == 0, reason="needs torch with a CUDA GPU")
def test_memory_views_through_torch_on_a_gpu():
    r = run_python(
        """
        gpumem.install()
        from torch.cuda._memory_viz import trace_plot, segment_plot, profile_plot, _profile_to_snapshot
        mem = torch.cuda.memory
        res = {"plots": [], "free": {}, "segment": {}, "metadata": {}}
        for context, stacks in (("all", "all"), ("all", "python"), (None, "python")):
            mem.empty_cache()
            mem._record_memory_history("all", context=context, stacks=stacks)
            def make_and_drop():
                x = torch.rand(128, 128, device="cuda")
                x * x + x * x
            make_and_drop()
            ss = mem._snapshot()
            trace_plot(ss)
            trace_plot(ss, filter_freed=True)   # drops the alloc/free pairs from ss itself
            segment_plot(ss)
            text = json.dumps(ss)
            res["plots"].append([context, "make_and_drop" in text])
            mem._record_memory_history(None)
        for context in ("alloc", "all", "state"):
            mem.empty_cache()
            mem._record_memory_history(context=context)
            x = None
            def thealloc():
                global x
                x = torch.rand(3, 4, device="cuda")
            def thefree():
                global x
                del x
            thealloc()
            thefree()
            text = json.dumps(mem._snapshot())
            res["free"][context] = ["thealloc" in text, "thefree" in text]
            mem._record_memory_history(None)
        for context in ("alloc", "all", "state"):
            mem.empty_cache()
            mem._record_memory_history(context=context)
            y = torch.rand(3, 4, device="cuda")
            del y
            mem.empty_cache()
            res["segment"][context] = "empty_cache" in json.dumps(mem._snapshot())
            mem._record_memory_history(None)
        for context in ("alloc", "all", "state"):
            mem.empty_cache()
            mem._set_memory_metadata("metadata test")
            mem._record_memory_history(context=context)
            z = torch.rand(3, 4, device="cuda")
            del z
            mem.empty_cache()
            mem._set_memory_metadata("")
            events = mem._snapshot()["device_traces"][0]
            res["metadata"][context] = [len(events), sorted({e["user_metadata"] for e in events})]
            mem._record_memory_history(None)
        res["metadata_now"] = mem._get_memory_metadata()
        def profiled_work():
            w = torch.rand(128, 128, device="cuda")
            return w * w + w * w
        with torch.profiler.profile(with_stack=True, profile_memory=True, record_shapes=True) as prof:
            profiled_work()
        profile_plot(prof)
        plot = json.dumps(_profile_to_snapshot(prof))
        res["profile"] = ["profiled_work" in plot, "category" in plot]
        out(**res)
        """,
        GPU_PRELUDE,
        timeout=600,
    )
    assert r["plots"] == [["all", True], ["all", True], [None, False]], r["plots"]
    assert r["free"] == {"alloc": [True, False], "all": [True, True], "state": [False, False]}, r["free"]
    assert r["segment"] == {"alloc": False, "all": True, "state": False}, r["segment"]
    for context, (n, values) in r["metadata"].items():
        assert n >= 3 and values == ["metadata test"], (context, n, values)
    assert r["metadata_now"] == ""
    assert r["profile"] == [True, True], r["profile"]
