"""Forecasts from recordings made elsewhere, on the simulated device: trace files and the command line,
torch's allocation history (with a stand-in for torch.cuda), call sites, and alignment through noise."""

import json

import pytest

import gpumem
from gpumem.__main__ import main
from gpumem.forecast import Forecast, ForecastError, Recording
from gpumem.native_model import min_capacity_native
from gpumem.trace import load_trace

from helpers import GiB, MiB
from test_forecast import _no_forecast_left_behind, recorded, sim  # noqa: F401  (the fixture applies here too)


# ---- recordings from files and the command line ----------------------------------------------


def write_trace(path, k):
    """A text trace of the Program-like step at knob k (sizes grow linearly)."""
    lines = ["# action addr size stream"]
    addr = 0

    def alloc(size):
        nonlocal addr
        addr += 1 << 32
        lines.append(f"alloc {addr} {size} 0")
        return addr

    w = alloc(100 * MiB)
    acts = [(alloc(2 * MiB * k), 2 * MiB * k) for _ in range(10)]
    for a, s in reversed(acts):
        lines.append(f"free_completed {a} {s} 0")
    assert w
    path.write_text("\n".join(lines) + "\n")
    return path


def test_from_traces_matches_the_in_process_forecast(tmp_path):
    paths = [write_trace(tmp_path / f"b{k}.trace", k) for k in (2, 4)]
    fc = Forecast.from_traces(paths, [2, 4], name="batch", capacity=GiB)
    assert fc.aligned
    assert fc.peak_live(30) == 100 * MiB + 10 * 2 * MiB * 30
    assert fc.largest() == (GiB - 100 * MiB) // (20 * MiB)
    assert all(r.granularity == 512 for r in fc.recordings)  # every size a multiple of 512
    with pytest.raises(ForecastError, match="2 traces but 3 knob values"):
        Forecast.from_traces(paths, [2, 4, 8])


def test_cli_forecast(tmp_path, capsys):
    a = write_trace(tmp_path / "b2.trace", 2)
    b = write_trace(tmp_path / "b4.trace", 4)
    rc = main(["forecast", str(a), str(b), "--knob", "2,4", "--cap", "1GiB", "--name", "batch", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    got = json.loads(out)
    assert got["aligned"] and got["largest_gpumem"] == (GiB - 100 * MiB) // (20 * MiB)
    rc = main(["forecast", str(a), str(b), "--knob", "2,4", "--device-memory", "1GiB", "--at", "64"])
    out, err = capsys.readouterr()
    assert rc == 0 and "largest knob that fits 1.00 GiB" in out
    assert any(line.split()[0] == "64" for line in out.splitlines() if line.strip())


def test_cli_forecast_says_when_recordings_do_not_line_up(capsys):
    rc = main(["forecast", "gpt2_varlen", "bert_varlen", "--knob", "2,4", "--cap", "20GiB"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert err.startswith("gpumem: warning: the recordings do not line up") and len(err.splitlines()) == 1
    assert "neither allocator's capacity is forecast" in out


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["A", "B", "--knob", "2,x"], "knob values must be whole numbers"),
        (["A", "B", "--knob", "2,-4"], "must be positive"),
        (["A", "B"], "required: --knob"),
        (["A", "--knob", "2"], "two or more traces"),
        (["A", "B", "--knob", "2,4,8"], "2 traces but 3 --knob values"),
        (["A", "B", "--knob", "2,2"], "must differ"),
        (["A", "B", "--knob", "2,4", "--cap", "1GiB", "--device-memory", "2GiB"], "not allowed with"),
        (["A", "B", "--knob", "2,4", "--cap", "lots"], "not a size"),
        (["A", "B", "--knob", "2,4", "--multiple", "x"], "multiple must be a whole number: 'x'"),
        (["A", "B", "--knob", "2,4", "--multiple", "0"], "multiple must be at least 1: '0'"),
        (["MISSING", "B", "--knob", "2,4"], "no such file"),
        (["A", "EMPTY", "--knob", "2,4"], "empty.trace: no allocations: nothing to forecast"),
        (["A", "B", "--knob", "2,4", "--html", "/nonexistent-dir/f.html"], "cannot write /nonexistent-dir/f.html"),
    ],
)
def test_cli_forecast_errors_are_one_line(tmp_path, capsys, args, fragment):
    a = write_trace(tmp_path / "a.trace", 2)
    b = write_trace(tmp_path / "b.trace", 4)
    argv = ["forecast"] + [
        str(a) if x == "A" else str(b) if x == "B" else str(tmp_path / f"{x.lower()}.trace") if x.isupper() else x
        for x in args
    ]
    (tmp_path / "empty.trace").write_text("# action addr size stream\n")  # replay refuses it too
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("gpumem: error: ") and fragment in err, err


def test_recording_granularity_of_gpumem_snapshots(tmp_path):
    h = sim()
    h.history_enable(100)
    h.free(h.malloc(1000))
    path = tmp_path / "s.pickle"
    gpumem.dump_snapshot(path, device=h)
    t = load_trace(path)
    assert Recording.granularity_of(t) == 512
    odd = tmp_path / "odd.trace"
    odd.write_text("alloc 4096 1000 0\nalloc 8192 1024 0\n")
    assert Recording.granularity_of(load_trace(odd)) == 1


def test_reset_makes_each_recording_start_like_a_fresh_run():
    h = sim()
    state = {}

    def step(k):
        a = h.malloc(MiB * k)
        if "opt" not in state:  # optimizer state appears at the end of the first step
            state["opt"] = h.malloc(50 * MiB)
        h.free(a)

    def reset():
        h.free(state.pop("opt"))

    fc = gpumem.forecast(step, knob=[2, 4], heap=h, steps=2, reset=reset)
    assert fc.aligned
    # the first recorded step makes the state while its activation is live: both count
    assert fc.peak_live(10) == 50 * MiB + 10 * MiB
    assert fc.recordings[0].trace.allocs == 3


# ---- the torch part, with a stand-in for torch.cuda -----------------------------------------------


class _FakeCuda:
    """What _TorchNativeRecorder reads of torch.cuda: a snapshot with segments
    and a device trace, recording switched on and off."""

    def __init__(self):
        self.traces = []
        self.segments = [
            {
                "device": 0,
                "address": 1 << 20,
                "stream": 0,
                "blocks": [
                    {"size": 4096, "requested_size": 4000, "state": "active_allocated"},
                    {"size": 8192, "requested_size": 0, "state": "inactive"},
                    {"size": 2048, "requested_size": 2048, "state": "active_allocated"},
                ],
            }
        ]
        self.recording = False
        self.memory = self

    def synchronize(self, device=None):
        pass

    def _record_memory_history(self, enabled="all", **kw):
        self.recording = enabled is not None
        if kw.get("clear_history"):
            self.traces = []

    def _snapshot(self):
        return {"segments": self.segments, "device_traces": [list(self.traces)]}

    def current_device(self):
        return 0


def test_native_torch_recorder_turns_torch_history_into_a_trace():
    from gpumem.forecast import _step_starts, _to_trace, _TorchNativeRecorder

    class FakeTorch:
        cuda = _FakeCuda()

    rec = _TorchNativeRecorder(FakeTorch, None)
    live = rec.live_blocks()
    # live blocks at their addresses (the inactive one between them skipped), requested sizes
    assert live == [(1 << 20, 4000, 0), ((1 << 20) + 4096 + 8192, 2048, 0)]
    rec.start()
    assert FakeTorch.cuda.recording
    FakeTorch.cuda.traces += [
        {"action": "alloc", "addr": 99 << 20, "size": 1024, "stream": 0},
        {"action": "free_requested", "addr": 1 << 20, "size": 4096, "stream": 0},
        {"action": "free_completed", "addr": 1 << 20, "size": 4096, "stream": 0},
        {"action": "segment_alloc", "addr": 99 << 20, "size": 2 << 20, "stream": 0},
        {"action": "free_completed", "addr": 99 << 20, "size": 1024, "stream": 0},
    ]
    assert rec.mark() == 5  # history events so far
    events = rec.stop()
    assert not FakeTorch.cuda.recording
    t = _to_trace("b=2", live, events, rec.granularity)
    assert t.allocs == 3 and t.frees == 2  # two live blocks first, then the step's alloc; a block live before it freed
    assert t.peak_live_bytes == 4000 + 2048 + 1024
    # a second step from the fourth history event on: two live blocks and two trace events before it
    assert _step_starts(live, events, [3]) == [4]
    with pytest.raises(ForecastError, match="inconsistent"):
        _to_trace("b=2", [], events, 512)  # a free of a block nobody allocated


def test_native_torch_recorder_reads_entries_without_an_address():
    """torch's "oom" entry carries device_free, not addr: a library that caught its own failed try (cuDNN
    asking for a large workspace) leaves one in the history of a step that ran."""
    from gpumem.forecast import _to_trace, _TorchNativeRecorder

    class FakeTorch:
        cuda = _FakeCuda()

    rec = _TorchNativeRecorder(FakeTorch, None)
    rec.start()
    FakeTorch.cuda.traces += [
        {"action": "oom", "device_free": 1 << 20, "size": 1 << 40, "stream": 0},
        {"action": "alloc", "addr": 99 << 20, "size": 1024, "stream": 0},
        {"action": "free_completed", "addr": 99 << 20, "size": 1024, "stream": 0},
    ]
    events = rec.stop()
    assert [e[0] for e in events] == ["oom", "alloc", "free_completed"]
    t = _to_trace("b=2", [], events, rec.granularity)
    assert t.allocs == 1 and t.frees == 1 and t.peak_live_bytes == 1024


def test_native_torch_recorder_without_clear_history_skips_older_events():
    from gpumem.forecast import _TorchNativeRecorder

    class OldCuda(_FakeCuda):
        def _record_memory_history(self, enabled="all", context=None, stacks=None, max_entries=None):
            self.recording = enabled is not None

    class FakeTorch:
        cuda = OldCuda()

    FakeTorch.cuda.traces = [{"action": "alloc", "addr": 5 << 20, "size": 512, "stream": 0}]  # from before
    rec = _TorchNativeRecorder(FakeTorch, None)
    rec.start()
    FakeTorch.cuda.traces.append({"action": "alloc", "addr": 6 << 20, "size": 1024, "stream": 0})
    assert rec.stop() == [("alloc", 6 << 20, 1024, 0, 0)]  # no stack: no call site


def test_recording_frees_torch_workspaces_after_the_warm_up():
    """A fresh run's first step makes cuBLAS's workspaces; a warm-up made them
    already, so each recording frees them first (after reset, before reading
    the live blocks) and its first step makes them again."""
    from gpumem.forecast import _record, _TorchNativeRecorder

    calls = []

    class FakeC:
        @staticmethod
        def _cuda_clearCublasWorkspaces():
            calls.append("clear")

    class FakeTorch:
        cuda = _FakeCuda()
        _C = FakeC

    class Logged(_TorchNativeRecorder):
        def before_step(self):
            calls.append("live")
            return super().before_step()

    def step(k):
        calls.append(f"step {k}")

    rec = Logged(FakeTorch, None)
    _record(rec, step, 4, "batch", warmup=1, steps=1, reset=lambda: calls.append("reset"))
    assert calls == ["step 4", "reset", "clear", "live", "step 4"]

    class NoWorkspaces:  # a torch without the call: nothing to free
        cuda = _FakeCuda()

    _TorchNativeRecorder(NoWorkspaces, None).drop_workspaces()


# ---- alignment through noise ----------------------------------------------------------------


def layered_step(h, extra_from=None, extra_below=None, layers=4, otherwise=False):
    """A layered step whose reductions need a staging buffer and a semaphore
    only for some knob values (as torch's reductions do once they are split
    across blocks), made and dropped between the layer's other allocations;
    `otherwise`: the other values make a different temporary there instead."""

    def step(k):
        act = h.malloc(MiB * k)
        keep = []
        for _ in range(layers):
            x = h.malloc(2 * MiB * k)
            keep.append(h.malloc(MiB * k + 512))
            if (extra_from is not None and k >= extra_from) or (extra_below is not None and k < extra_below):
                buf = h.malloc(64 * 1024 * k)
                sem = h.malloc(4096)
                h.free(sem)
                h.free(buf)
            elif otherwise:  # two blocks freed in the order they were made
                c, d = h.malloc(8192 * k), h.malloc(4096)
                h.free(c)
                h.free(d)
            z = h.malloc(3 * MiB * k)  # an allocation right after: pairing in order would pair it with buf
            h.free(x)
            h.free(z)
        for b in keep:
            h.free(b)
        h.free(act)

    return step


def test_temporaries_made_only_at_larger_values_are_set_aside_and_kept():
    h = sim()
    step = layered_step(h, extra_from=3)
    fc = gpumem.forecast(step, knob=[2, 4, 6], heap=h, name="seq")
    a = fc.alignment
    assert fc.aligned and not a.exact
    assert a.set_aside == {2: 0, 4: 0, 6: 4 * 4}  # four layers, two blocks each, made and freed
    assert fc.model.partial == 8 and fc.model.kinds["quadratic"] == 0
    assert "setting aside" in a.message
    line = "modelled: 8 allocations only at seq >= 4 (up to 384.00 KiB each, sized by a fit through those)"
    assert any(c.startswith(line) for c in fc.caveats())
    truth = recorded(step, h, 10)
    synth = fc.synthesise(10)
    # event for event the trace the program makes at 10: the staging buffer grows as recorded at 4 and 6
    assert synth.words == truth.words
    assert fc.peak_live(10) == truth.peak_live_bytes
    assert fc.predict(10).native_capacity_bytes == min_capacity_native(truth)


def test_temporaries_made_only_at_smaller_values_are_left_out():
    h = sim()
    step = layered_step(h, extra_below=3)
    fc = gpumem.forecast(step, knob=[2, 4], heap=h, name="batch")
    assert fc.aligned and fc.alignment.set_aside == {2: 16, 4: 0}
    assert fc.synthesise(9).words == recorded(step, h, 9).words
    assert any("8 allocations only at batch 2 left out" in c for c in fc.caveats())


def test_a_temporary_replaced_by_another_is_set_aside_on_both_sides():
    h = sim()
    step = layered_step(h, extra_from=3, otherwise=True)
    fc = gpumem.forecast(step, knob=[2, 4, 6], heap=h, name="seq")
    assert fc.aligned and fc.alignment.set_aside == {2: 16, 4: 0, 6: 16}
    assert fc.synthesise(11).words == recorded(step, h, 11).words


def test_call_sites_keep_different_temporaries_apart():
    """One temporary at small values, two (made elsewhere) at large ones: by
    order alone the first of the two pairs with the one; their allocations'
    call sites (the heap's context: an interned stack under torch) say they differ."""
    h = sim()

    def step(k, sites=True):
        keep = []
        for _ in range(3):
            x = h.malloc(2 * MiB * k)
            if k >= 3:
                buf = h.malloc(64 * 1024 * k, 0, 11 if sites else 0)
                h.free(h.malloc(4096, 0, 12 if sites else 0))
                h.free(buf)
            else:
                h.free(h.malloc(48 * 1024 * k, 0, 13 if sites else 0))
            keep.append(h.malloc(MiB * k))
            h.free(x)
        for b in keep:
            h.free(b)

    by_order = gpumem.forecast(lambda k: step(k, sites=False), knob=[2, 4, 6], heap=h)
    assert by_order.aligned and by_order.alignment.set_aside[6] == 6  # the 4 KiB block set aside, buf paired
    fc = gpumem.forecast(step, knob=[2, 4, 6], heap=h)
    assert fc.recordings[0].sites is not None
    assert fc.aligned and fc.alignment.set_aside == {2: 6, 4: 0, 6: 12}
    truth = gpumem.forecast(step, knob=[11, 12], heap=h).recordings[0].trace
    assert fc.synthesise(11).words == truth.words
    assert by_order.synthesise(11).words != truth.words  # buf sized from a line through the other temporary


def test_torch_call_sites_are_checksums_of_the_stack():
    from gpumem.forecast.record import _site, _sites

    a = [{"filename": "model.py", "line": 10, "name": "forward"}, {"filename": "train.py", "line": 3, "name": "step"}]
    b = [{"filename": "model.py", "line": 11, "name": "forward"}, {"filename": "train.py", "line": 3, "name": "step"}]
    assert _site(a) == _site([dict(f) for f in a]) != _site(b) and _site(a) & 1
    assert _site(None) == _site([]) == 0
    # the frames from the forecast's own call of the step outwards are not the step's: left out
    from gpumem.forecast.record import _RECORD_FILE

    record = {"filename": _RECORD_FILE, "line": 40, "name": "_record"}
    called_from = [{"filename": "notebook.py", "line": n, "name": "<module>"} for n in (1, 2)]
    assert _site(a + [record, called_from[0]]) == _site(a + [record, called_from[1]]) == _site(a)
    assert _site(b + [record, called_from[0]]) != _site(a + [record, called_from[0]])
    assert _site([record] + a) == 0
    events = [("alloc", 1, 512, 0, _site(a)), ("free_requested", 1, 512, 0, 0), ("free_completed", 1, 512, 0, 0)]
    assert _sites([(9, 512, 0)], events) == [0, _site(a), 0]  # a live block, the alloc, its free
    assert _sites([], [("alloc", 1, 512, 0, 0)]) is None


def test_torch_call_sites_are_worked_out_once_per_stack():
    from gpumem.forecast.record import _site, _Sites, _TorchNativeRecorder

    frame = [{"filename": f"layer{i}.py", "line": i, "name": "forward"} for i in range(3)]
    shared = [frame[0], frame[1]]  # torch's snapshot shares one dict per distinct frame

    class Counting(dict):
        reads = 0

        def get(self, key, default=None):
            Counting.reads += 1
            return super().get(key, default)

    counted = [Counting(f) for f in shared]
    sites = _Sites()
    assert sites(counted) == _site(shared)
    reads = Counting.reads
    assert reads > 0
    assert sites(list(counted)) == _site(shared) and Counting.reads == reads  # the same frames again: not read
    assert sites([frame[2], frame[1]]) == _site([frame[2], frame[1]]) != _site(shared)
    assert sites([dict(f) for f in shared]) == _site(shared)  # equal frames in other dicts: the same site
    assert sites([]) == sites(None) == 0

    class FakeTorch:
        cuda = _FakeCuda()

    rec = _TorchNativeRecorder(FakeTorch, None)
    rec.start()
    FakeTorch.cuda.traces += [
        {"action": "alloc", "addr": a << 20, "size": 512, "stream": 0, "frames": f}
        for a, f in ((1, shared), (2, list(shared)), (3, [frame[2]]))
    ]
    assert [e[4] for e in rec.stop()] == [_site(shared), _site(shared), _site([frame[2]])]


def test_recordings_made_from_different_places_have_the_same_call_sites():
    """The forecast records the first value, other values and refinements
    from different lines of its own code; the sites come from the step's
    frames only, so the same allocation has the same site in each."""
    import inspect

    from gpumem.forecast.record import _record, _TorchNativeRecorder

    class FakeTorch:
        cuda = _FakeCuda()

    def alloc(addr):  # what torch's history keeps: the Python stack, innermost first
        frames = [{"filename": f.filename, "line": f.lineno, "name": f.function} for f in inspect.stack()[1:]]
        FakeTorch.cuda.traces.append({"action": "alloc", "addr": addr, "size": 512, "stream": 0, "frames": frames})
        FakeTorch.cuda.traces.append({"action": "free_completed", "addr": addr, "size": 512, "stream": 0})

    def step(k):
        alloc(1 << 30)
        alloc(2 << 30)

    rec = _TorchNativeRecorder(FakeTorch, None)
    one = _record(rec, step, 2, "batch", 0, 1, None)
    two = (lambda: _record(rec, step, 4, "batch", 0, 1, None))()
    live = len(FakeTorch.cuda.segments[0]["blocks"]) - 1  # the live blocks lead each trace, no site
    assert one.sites[live:] == two.sites[live:] and one.sites[live] != one.sites[live + 2] != 0


def test_only_the_last_steps_line_up():
    """The first recorded step at the larger value holds a hundred blocks across others'
    lifetimes, more than half the recording: the whole recordings do not line up, their second
    steps do, and the forecast says it covers those."""
    h = sim()
    state = {"first": True}

    def step(k):
        a = h.malloc(MiB * k)
        extra = [h.malloc(64 * 1024) for _ in range(100)] if state["first"] and k >= 4 else []
        b = h.malloc(2 * MiB * k)
        h.free(a)
        for x in extra:
            h.free(x)
        h.free(b)
        state["first"] = False

    fc = gpumem.forecast(step, knob=[2, 4], heap=h, warmup=0, steps=2, reset=lambda: state.update(first=True))
    assert [r.step_starts for r in fc.whole[0]] == [[0, 4], [0, 204]]  # where each recorded step began
    assert [r.step_starts for r in fc.recordings] == [[0], [0]]  # the last steps, nothing left live
    assert fc.aligned and fc.whole is not None and not fc.whole[1].aligned
    assert "their last steps only" in fc.alignment.message
    assert any("their last steps do" in c for c in fc.caveats())
    assert fc.peak_live(10) == 30 * MiB
    one = gpumem.forecast(step, knob=[2, 4], heap=h, warmup=0, steps=1, reset=lambda: state.update(first=True))
    assert not one.aligned  # one step: nothing to fall back on


def test_a_block_that_outlives_others_at_one_value_is_modelled():
    """A block made only at the larger value and freed after blocks both values make: not a
    self-contained stretch, but set aside (with its free) all the same, and kept."""
    h = sim()

    def step(k):
        a = h.malloc(MiB * k)
        extra = h.malloc(MiB) if k >= 4 else None
        b = h.malloc(MiB * k)
        h.free(a)
        if extra is not None:
            h.free(extra)
        h.free(b)

    fc = gpumem.forecast(step, knob=[2, 4], heap=h)
    assert fc.recorded == [2, 4, 6] and fc.aligned and fc.alignment.set_aside == {2: 0, 4: 0, 6: 2}
    assert fc.synthesise(9).words == recorded(step, h, 9).words
