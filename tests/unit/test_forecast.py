"""Forecasts from small recorded steps (gpumem.forecast) on the simulated device: fitting, alignment,
predictions, refinement, the OOM report's forecast.  test_forecast_native.py tests the model of torch's
native allocator they compare with; test_forecast_recordings.py forecasts from traces, the command line
and torch's history."""

import math

import pytest

import gpumem
from gpumem import explain as _explain_fn  # noqa: F401  (registers the OOM formatter)
from gpumem.forecast import Forecast, ForecastError, last_forecast

from helpers import REPO, GiB, MiB


@pytest.fixture(autouse=True)
def _no_forecast_left_behind():
    """A forecast made here must not reach other tests' OOM reports."""
    yield
    from gpumem.explain import set_forecast

    set_forecast(None)


def sim(capacity=16 * GiB):
    return gpumem.Heap(device="sim", capacity=capacity)


def recorded(step, h, k):
    """The step's own trace at knob value k (recorded at k and k + 1)."""
    return gpumem.forecast(step, knob=[k, k + 1], heap=h).recordings[0].trace


class Program:
    """A training-like step on a sim heap: weights allocated once, then per
    step `acts` activations of `per_act(k)` bytes, a temporary of `temp(k)`
    bytes made and dropped while they are live, and a small block."""

    def __init__(self, heap, per_act, temp=lambda k: 0, acts=10, weights=100 * MiB):
        self.heap = heap
        self.per_act = per_act
        self.temp = temp
        self.acts = acts
        self.weights = heap.malloc(weights)

    def step(self, k):
        h = self.heap
        live = [h.malloc(self.per_act(k)) for _ in range(self.acts)]
        t = h.malloc(self.temp(k))
        h.free(t)
        s = h.malloc(4096)
        for a in reversed(live):
            h.free(a)
        h.free(s)

    def peak(self, k, weights=100 * MiB):
        """Peak live bytes of one step, by hand (every size is a multiple of 512)."""
        return weights + self.acts * self.per_act(k) + max(self.temp(k), 4096)


# ---- fitting ------------------------------------------------------------------------------


def test_linear_sizes_are_forecast_exactly_at_a_far_value():
    h = sim()
    # a constant part and a part growing with the knob: a fit that drops either term is off
    p = Program(h, per_act=lambda k: 7 * MiB + 3 * MiB * k)
    fc = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="batch")
    assert [r.step_starts for r in fc.recordings] == [[1], [1]]  # after the weights
    two = gpumem.forecast(p.step, knob=[2, 4], heap=h, steps=2)
    assert [r.step_starts for r in two.recordings] == [[1, 25], [1, 25]]  # 24 events a step
    assert fc.aligned
    assert fc.model.kinds["linear"] == 10 and fc.model.kinds["quadratic"] == 0
    for k in (1, 3, 40, 100):
        assert fc.peak_live(k) == p.peak(k), k
        sizes = sorted({s for _, _, s, _ in fc.synthesise(k).decode()})
        assert 7 * MiB + 3 * MiB * k in sizes


def test_three_recordings_find_the_quadratic_term():
    h = sim()
    p = Program(h, per_act=lambda k: 2 * MiB * k, temp=lambda k: 3 * MiB * k * k + MiB, acts=2)
    fc = gpumem.forecast(p.step, knob=[2, 4, 8], heap=h, name="seq")
    assert fc.model.kinds["quadratic"] == 1
    assert fc.model.kinds["linear"] == 2
    for k in (16, 50):
        assert fc.peak_live(k) == p.peak(k), k
    # two recordings can only draw a line through the square: it under-forecasts, and says it might
    two = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="seq")
    assert two.model.kinds["quadratic"] == 0
    assert two.peak_live(50) < p.peak(50)
    assert "record a third value" in two.fit_summary()


def test_a_line_through_three_recordings_stays_a_line():
    h = sim()
    # 1000 * k bytes is recorded in 512-byte blocks (gpumem's history): rounding must not read as curvature
    p = Program(h, per_act=lambda k: 1000 * k + 3 * MiB, acts=3)
    fc = gpumem.forecast(p.step, knob=[2, 4, 8], heap=h)
    assert fc.model.kinds["quadratic"] == 0
    assert fc.aligned


def test_a_knob_with_no_effect_gives_constant_sizes():
    h = sim(4 * GiB)
    p = Program(h, per_act=lambda k: 5 * MiB)
    fc = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="batch", capacity=4 * GiB)
    assert not fc.knob_has_effect
    assert fc.model.kinds == {"constant": fc.model.n_allocs, "linear": 0, "quadratic": 0}
    assert fc.peak_live(1000) == fc.peak_live(2) == p.peak(2)
    assert fc.largest() == math.inf
    assert fc.largest(capacity=100 * MiB) == 0  # not even the weights fit
    assert any("changes no allocation" in c for c in fc.caveats())


# ---- alignment ------------------------------------------------------------------------------


def test_misaligned_recordings_are_reported_not_guessed():
    h = sim()

    def step(k):
        blocks = [h.malloc(MiB * k) for _ in range(3)]
        for b in blocks:
            h.free(b)
        if k >= 4:  # another code path at the larger value, longer than any stretch set aside
            more = [h.malloc(64 * 1024) for _ in range(100)]
            for b in more:
                h.free(b)

    fc = gpumem.forecast(step, knob=[2, 4], heap=h, name="batch", capacity=GiB)
    assert not fc.aligned
    assert fc.alignment.first_difference == 6  # the seventh event: the end at 2, an alloc at 4
    msg = fc.alignment.message
    assert "do not line up" in msg and "6 events at batch 2, 206 at batch 4" in msg
    assert "they line up to event 6, then only batch 4 goes on" in msg
    with pytest.raises(ForecastError, match="do not line up"):
        fc.synthesise(8)
    p = fc.predict(8)
    assert p.estimate_only and p.gpumem_capacity_bytes is None and p.native_capacity_bytes is None
    text = fc.text()
    assert "warning: the recordings do not line up" in text and "neither allocator's capacity" in text
    assert "at most" in text and "~" in text
    assert fc.to_json()["largest_is_bound"] is True


def test_warmup_keeps_one_time_allocations_out_of_the_recordings():
    h = sim()
    state = {}

    def step(k):
        if "opt" not in state:  # the first step only: optimizer state, and a workspace it drops
            state["opt"] = h.malloc(50 * MiB)
            h.free(h.malloc(30 * MiB))
        a = h.malloc(MiB * k)
        h.free(a)

    cold = gpumem.forecast(step, knob=[2, 4], heap=h, warmup=0)
    # the first recording holds the one-time work: its dropped workspace is set aside, and said so
    assert cold.aligned and cold.alignment.set_aside == {2: 2, 4: 0}
    assert any("1 allocation only at knob 2 left out (the forecast follows knob 4)" in c for c in cold.caveats())
    h.free(state.pop("opt"))
    warm = gpumem.forecast(step, knob=[2, 4], heap=h, warmup=1)
    assert warm.aligned and warm.alignment.exact and not warm.caveats()
    # the state made during warm-up is live before each recorded step: it counts
    assert warm.peak_live(10) == 50 * MiB + 10 * MiB


def test_warmup_runs_at_the_first_value_and_where_a_value_makes_one_time_work():
    h = sim()
    ran = []
    seen = set()

    def step(k):
        ran.append(k)
        if k not in seen and k >= 8:  # a library's setup for a size it has not run before
            seen.add(k)
            h.free(h.malloc(3 * MiB))
        h.free(h.malloc(MiB * k))

    fc = gpumem.forecast(step, knob=[2, 4], heap=h)
    assert ran == [2, 2, 4]  # the first value warmed up; 4 made the same events at once
    assert fc.alignment.exact
    ran.clear()
    fc = gpumem.forecast(step, knob=[4, 8, 16], heap=h)
    # 8 and 16 first made a setup buffer 4 does not: each such recording was their warm-up
    assert ran == [4, 4, 8, 8, 16, 16]
    assert fc.alignment.exact and fc.peak_live(32) == 32 * MiB
    ran.clear()
    gpumem.forecast(step, knob=[4, 32], heap=h, warmup=0)
    # no warm-up asked for: none anywhere; the setup buffer only 32 made is sized from one more value
    assert ran == [4, 32, 60]


def test_blocks_freed_in_another_order_are_modelled():
    """Same actions in the same order, but the frees free other blocks: the block freed out of
    order is taken as made differently at each value, the rest paired."""
    h = sim()

    def step(k):
        a = h.malloc(MiB * k)
        b = h.malloc(MiB)
        if k == 2:
            h.free(a)
            h.free(b)
        else:
            h.free(b)
            h.free(a)

    fc = gpumem.forecast(step, knob=[2, 4], heap=h)
    # the order 4 frees them in is seen at 4 only: one more value is recorded to size the block
    assert fc.recorded == [2, 4, 6] and fc.aligned and fc.alignment.set_aside == {2: 2, 4: 0, 6: 2}
    assert fc.alignment.switches[2] == 1
    assert "code paths switch at 1 place between knob 2 and 4" in fc.caveats()[0]
    assert fc.synthesise(9).words == recorded(step, h, 9).words


# ---- predictions ------------------------------------------------------------------------------


def test_largest_that_fits_a_known_program():
    h = sim()
    # every size a multiple of 2 MiB: neither allocator needs more than peak live
    p = Program(h, per_act=lambda k: 2 * MiB * k, temp=lambda k: 2 * MiB * k * k)
    fc = gpumem.forecast(p.step, knob=[2, 4, 8], heap=h, name="batch")
    by_hand = max(k for k in range(1, 200) if p.peak(k) <= 8 * GiB)
    assert p.peak(by_hand + 1) > 8 * GiB
    for allocator in ("gpumem", "native"):
        assert fc.largest(8 * GiB, allocator) == by_hand, allocator
        assert fc.largest(p.peak(by_hand) - MiB, allocator) == by_hand - 1, allocator
    assert fc.largest(p.peak(1) - MiB) == 0
    pred = fc.predict(by_hand)
    assert pred.peak_live_bytes == p.peak(by_hand)
    assert pred.gpumem_capacity_bytes == pred.native_capacity_bytes == p.peak(by_hand)
    # multiples: the largest multiple of 8 at or below the answer
    fm = Forecast(fc.recordings, name="batch", capacity=8 * GiB, multiple=8)
    assert fm.largest() == by_hand // 8 * 8


def test_largest_is_settled_below_where_fitting_stops_being_monotonic(monkeypatch):
    """Near the limit, whether a step fits torch's allocator can flip from one value to the next
    (which cached block a request splits); the answer is the largest value with no failure in the
    eighth below it, not wherever bisection lands."""
    from gpumem.forecast import _settled

    fails = {136, 138, 141, 144, 146, 149, 152}  # what the native model said of a Llama generation

    def ok(k):
        return k < 154 and k not in fails

    assert _settled(151, ok) == 135
    assert _settled(135, ok) == 135
    assert _settled(120, lambda k: k != 3) == 120  # 3 is more than an eighth below
    assert _settled(5, lambda k: k > 4) == 0  # every value below fails in turn
    # a wide window is sampled: at most SETTLE_PROBES values tried
    tried = []
    assert _settled(10_000, lambda k: tried.append(k) or True) == 10_000 and len(tried) <= 64

    h = sim()
    p = Program(h, per_act=lambda k: 2 * MiB * k, temp=lambda k: 2 * MiB * k * k)
    fc = gpumem.forecast(p.step, knob=[2, 4, 8], heap=h, name="batch", capacity=8 * GiB)
    by_hand = fc.largest()
    assert by_hand > 20
    fc2 = Forecast(fc.recordings, name="batch", capacity=8 * GiB)
    real = fc2.fits
    hole = by_hand - 2  # one value below the answer that does not fit
    monkeypatch.setattr(fc2, "fits", lambda k, cap=None, allocator="gpumem": k != hole and real(k, cap, allocator))
    assert fc2.largest() == by_hand - 3


class Staging(Program):
    """A Program whose step, past batch 16 only, also makes and drops a buffer of 8 MiB per
    unit of batch while its activations are live (as a reduction's staging buffer appears
    only past some size): two small recordings cannot see it."""

    def step(self, k):
        h = self.heap
        live = [h.malloc(self.per_act(k)) for _ in range(self.acts)]
        if k > 16:
            h.free(h.malloc(8 * MiB * k))
        for a in reversed(live):
            h.free(a)

    def peak(self, k, weights=100 * MiB):
        return weights + self.acts * self.per_act(k) + (8 * MiB * k if k > 16 else 0)


def test_refine_records_again_nearer_the_answer_and_sees_memory_only_larger_values_take():
    h = sim()
    p = Staging(h, per_act=lambda k: 2 * MiB * k)
    by_hand = max(k for k in range(1, 1000) if p.peak(k) <= 8 * GiB)
    plain = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="batch", capacity=8 * GiB)
    assert plain.largest() > 1.3 * by_hand and plain.first is None  # blind to the buffer
    fc = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="batch", capacity=8 * GiB, refine=True)
    first = plain.largest()
    assert fc.first is not None and fc.first.largest() == first
    assert fc.recorded == [first // 4, first // 2]
    assert fc.aligned and fc.largest() == by_hand
    assert fc.predict(by_hand).peak_live_bytes == p.peak(by_hand)
    assert any(line.startswith("refined: recorded again at batch") for line in fc.summary_lines())


def test_refine_records_once_where_that_recording_confirms_the_first_forecast():
    h = sim()
    p = Program(h, per_act=lambda k: 2 * MiB * k)
    plain = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="batch", capacity=8 * GiB)
    first = plain.largest()
    fc = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="batch", capacity=8 * GiB, refine=True)
    assert fc.first is not None and fc.recorded == [2, 4, first // 2]
    assert fc.aligned and fc.largest() == first == max(k for k in range(1, 1000) if p.peak(k) <= 8 * GiB)
    line = next(x for x in fc.summary_lines() if x.startswith("refined:"))
    assert f"recorded again at batch {first // 2}," in line and "agreed" in line


def test_refine_records_twice_where_the_sizes_bend_past_the_first_recordings():
    """Same events at every value, but a size that grows faster past batch 16: the recording
    at half the answer disagrees with the first forecast, so a quarter is recorded too."""
    h = sim()
    p = Program(h, per_act=lambda k: 2 * MiB * k + (6 * MiB * (k - 16) if k > 16 else 0))
    fc = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="batch", capacity=8 * GiB, refine=True)
    first = fc.first.largest()
    assert fc.recorded == [first // 4, first // 2]
    assert fc.largest() == max(k for k in range(1, 1000) if p.peak(k) <= 8 * GiB)


def test_refine_leaves_a_forecast_near_its_recordings_alone():
    h = sim()
    p = Program(h, per_act=lambda k: 2 * MiB * k)
    near = gpumem.forecast(p.step, knob=[8, 16], heap=h, name="batch", capacity=GiB, refine=True)
    assert near.largest() <= 8 * 16 and near.first is None and near.recorded == [8, 16]


def test_refine_that_runs_out_of_memory_keeps_the_first_forecast_and_says_why():
    # the heap is smaller than the capacity the forecast is asked about: the step at half the
    # answer does not fit the heap it runs on
    h = sim(capacity=GiB)
    p = Program(h, per_act=lambda k: 2 * MiB * k)
    fc = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="batch", capacity=16 * GiB, refine=True)
    assert fc.first is None and fc.recorded == [2, 4]
    assert any("not refined" in c and "ran out of memory" in c for c in fc.caveats())


def test_native_needs_more_than_gpumem_where_segments_strand_memory():
    h = sim()
    # 3 MiB blocks come from 20 MiB native segments; growing blocks outgrow what was cached
    p = Program(h, per_act=lambda k: 3 * MiB * k + 512, acts=12)
    fc = gpumem.forecast(p.step, knob=[1, 2], heap=h, name="batch", capacity=2 * GiB, at=[3])
    pred = fc.predict(3)
    assert pred.native_capacity_bytes > pred.gpumem_capacity_bytes >= pred.peak_live_bytes
    assert fc.largest(allocator="native") <= fc.largest(allocator="gpumem")
    assert fc.fits(fc.largest(), allocator="gpumem") and not fc.fits(fc.largest() + 1, allocator="gpumem")


def test_table_plot_and_html(tmp_path):
    h = sim()
    p = Program(h, per_act=lambda k: 2 * MiB * k)
    fc = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="batch", capacity=GiB, at=[16])
    assert last_forecast() is fc
    table = fc.table()
    assert "batch" in table.splitlines()[0] and "2*" in table and "16" in table
    largest = fc.largest()
    lines = fc.summary_lines()
    assert str(largest) in lines[1]
    # far past what was recorded: the summary says how far, and what it cannot see
    assert largest > 8 * 4 and lines[2].startswith(f"note: batch {largest} is {largest / 4:.0f}x the largest recorded")
    near = Forecast(fc.recordings, name="batch", capacity=80 * MiB)
    assert near.largest() <= 8 * 4 and not any(line.startswith("note:") for line in near.summary_lines())
    html = fc._repr_html_()
    assert "<pre>" in html and "gpumem-forecast" in html
    pytest.importorskip("matplotlib")
    fc.plot(tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 1000
    assert "<svg" in fc.to_html(tmp_path / "f.html")


def test_bad_arguments():
    h = sim()
    with pytest.raises(ForecastError, match="two or more"):
        gpumem.forecast(lambda k: None, knob=[2], heap=h)
    with pytest.raises(ForecastError, match="positive whole numbers"):
        gpumem.forecast(lambda k: None, knob=[2, 0], heap=h)
    with pytest.raises(ForecastError, match="must differ"):
        gpumem.forecast(lambda k: None, knob=[2, 2], heap=h)
    with pytest.raises(ForecastError, match="steps"):
        gpumem.forecast(lambda k: None, knob=[2, 4], heap=h, steps=0)
    fc = gpumem.forecast(lambda k: h.free(h.malloc(k * MiB)), knob=[2, 4], heap=h, capacity=GiB)
    with pytest.raises(ValueError, match="allocator"):
        fc.largest(allocator="cudaMallocAsync")


# ---- the OOM explanation ----------------------------------------------------------------------


def test_oom_report_carries_the_forecast():
    h = sim(2 * GiB)
    p = Program(h, per_act=lambda k: 2 * MiB * k)
    fc = gpumem.forecast(p.step, knob=[2, 4], heap=h, name="batch", at=[200])
    largest = fc.largest()
    assert p.peak(largest) <= 2 * GiB < p.peak(largest + 1)
    with pytest.raises(gpumem.OutOfMemoryError) as e:
        p.step(200)
    need = fc.predict(200).gpumem_capacity_bytes
    line = f"batch 200 needs {gpumem.format_size(need)}; the largest that fits 2.00 GiB is {largest}"
    assert line in str(e.value)
    assert line in gpumem.explain(device=h).text()


def test_forecast_truth_plot_from_the_benchmark_results(tmp_path):
    """benchmarks/plot_forecast.py draws the committed GPU results, and refuses a file that is not them."""
    pytest.importorskip("matplotlib")
    import subprocess
    import sys

    script = REPO / "benchmarks" / "plot_forecast.py"
    out = tmp_path / "truth.png"
    results = REPO / "benchmarks" / "results" / "gpu_forecast.json"
    r = subprocess.run([sys.executable, str(script), str(results), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert out.stat().st_size > 10_000
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": []}')
    r = subprocess.run([sys.executable, str(script), str(bad), str(out)], capture_output=True, text=True)
    assert r.returncode == 1 and "not gpu_forecast.py's JSON" in r.stderr and "Traceback" not in r.stderr
