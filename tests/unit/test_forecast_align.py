"""Forecasts from recordings that differ in what they allocate, not only in how
much (a library's workspace at some sizes, another algorithm past some size),
against the truth: the step run at increasing values on a simulated heap
(gpumem) and its recorded trace replayed in the native allocator's model."""

import pytest

import gpumem
from gpumem.forecast import Forecast
from gpumem.native_model import fits_native

from helpers import GiB, MiB

KiB = 1024
CAP = GiB


class Layered:
    """A layered step on a sim heap, weights made once.  Each layer's op makes a
    temporary, then its output (kept for the backward), then drops the
    temporary; the backward makes a gradient per layer and drops it with the
    output.  `workspace(k)`: bytes of a library's workspace made before the
    output and dropped after it, 0 for none.  `switch_at`: from this knob value
    on the op takes another algorithm, whose two temporaries (made before the
    output, dropped after it) differ from the one it takes below."""

    def __init__(self, heap, layers=6, workspace=lambda k: 0, switch_at=None, sites=False, weights=64 * MiB):
        self.heap = heap
        self.layers = layers
        self.workspace = workspace
        self.switch_at = switch_at
        # call sites as torch's history gives them: one per line of Python, so an op's
        # workspace, temporaries and output share theirs
        self.forward, self.backward = (11, 12) if sites else (0, 0)
        self.weights = heap.malloc(weights)

    def layer(self, k):
        h, site = self.heap, self.forward
        ws = h.malloc(self.workspace(k), 0, site) if self.workspace(k) else None
        if self.switch_at is not None and k >= self.switch_at:
            temps = [h.malloc(3 * MiB * k, 0, site), h.malloc(64 * KiB, 0, site)]
        else:
            temps = [h.malloc(MiB * k, 0, site)]
        out = h.malloc(2 * MiB * k + 512, 0, site)
        for t in temps:
            h.free(t)
        if ws is not None:
            h.free(ws)
        return out

    def step(self, k):
        h = self.heap
        keep = [self.layer(k) for _ in range(self.layers)]
        for out in reversed(keep):
            g = h.malloc(2 * MiB * k + 512, 0, self.backward)
            h.free(out)
            h.free(g)


def truth(make, allocator, cap=CAP):
    """The largest knob value whose step runs in `cap` bytes, trying 1, 2, 3, ...:
    gpumem running the step on a simulated heap of that capacity, or the native
    allocator's model replaying the step's trace recorded on a large heap."""

    def runs(k):
        if allocator == "gpumem":
            h = gpumem.Heap(device="sim", capacity=cap)
            p = make(h)
            try:
                p.step(k)
            except gpumem.OutOfMemoryError:
                return False
            return True
        h = gpumem.Heap(device="sim", capacity=16 * GiB)
        p = make(h)
        trace = gpumem.forecast(p.step, knob=[k, k + 1], heap=h, warmup=0).recordings[0].trace
        return fits_native(trace, cap)

    k = 0
    while runs(k + 1):
        k += 1
    return k


def within(forecast, true):
    """The issue's tolerance: 3%, or 1 where the value is under 33."""
    return abs(forecast - true) <= (1 if true < 33 else 0.03 * true)


def test_a_workspace_made_only_at_the_larger_value_is_modelled():
    """At batch 4 and up a library makes a small workspace before each layer's
    output and drops it after: it outlives blocks both values make."""

    def make(h):
        return Layered(h, workspace=lambda k: 16 * KiB + 4 * KiB * k if k >= 4 else 0)

    h = gpumem.Heap(device="sim", capacity=16 * GiB)
    fc = gpumem.forecast(make(h).step, knob=[2, 4], heap=h, name="batch", capacity=CAP)
    assert fc.aligned
    # the workspace is seen at batch 4 only: one more value is recorded, and its size fitted through both
    assert fc.recorded == [2, 4, 6]
    (line,) = fc.caveats()
    assert line.startswith("modelled: 6 allocations only at batch >= 4 (up to 40.00 KiB each, sized by a fit")
    for allocator in ("gpumem", "native"):
        got, true = fc.largest(allocator=allocator), truth(make, allocator)
        assert within(got, true), (allocator, got, true)
        assert got == true, (allocator, got, true)
    assert fc.model_seconds < 1


def test_an_algorithm_switch_is_modelled():
    """From batch 6 on each layer's op takes another algorithm with other
    temporaries: recorded at 2, 4 and 8, the forecast follows 8's."""

    def make(h):
        return Layered(h, switch_at=6)

    h = gpumem.Heap(device="sim", capacity=16 * GiB)
    fc = gpumem.forecast(make(h).step, knob=[2, 4, 8], heap=h, name="batch", capacity=CAP)
    assert fc.aligned and fc.recorded == [2, 4, 8, 12]
    (line,) = fc.caveats()
    assert "12 allocations only at batch >= 8" in line and "sized by a fit through those" in line
    assert "6 allocations only at batch 2 left out" in line and "6 allocations only at batch 4 left out" in line
    assert "code paths switch at 6 places between batch 4 and 8" in line
    for allocator in ("gpumem", "native"):
        got, true = fc.largest(allocator=allocator), truth(make, allocator)
        assert within(got, true), (allocator, got, true)
        assert got == true, (allocator, got, true)


@pytest.mark.parametrize(
    "knob,sites,workspace_from,switch_at", [([2, 4, 8], True, 3, 5), ([2, 4], False, 4, 4), ([3, 5], True, 4, 5)]
)
def test_a_workspace_and_a_switch_together(knob, sites, workspace_from, switch_at):
    """Both at once, at one value or at two; with call sites that do not tell the workspace from
    the output (torch's Python stack is the op's line for both), or with none."""

    def make(h):
        return Layered(h, workspace=lambda k: 32 * KiB if k >= workspace_from else 0, switch_at=switch_at, sites=sites)

    h = gpumem.Heap(device="sim", capacity=16 * GiB)
    fc = gpumem.forecast(make(h).step, knob=knob, heap=h, name="batch", capacity=CAP)
    assert fc.aligned and (fc.recordings[0].sites is not None) == sites
    assert fc.caveats()[0].startswith("modelled: ")
    for allocator in ("gpumem", "native"):
        got, true = fc.largest(allocator=allocator), truth(make, allocator)
        assert within(got, true), (allocator, got, true)
        assert got == true, (allocator, got, true)


@pytest.mark.parametrize("knob", [[2, 4], [3, 6, 9]])
def test_alike_recordings_are_still_exact(knob):
    def make(h):
        return Layered(h)

    h = gpumem.Heap(device="sim", capacity=16 * GiB)
    fc = gpumem.forecast(make(h).step, knob=knob, heap=h, name="batch", capacity=CAP)
    assert fc.alignment.exact and fc.recorded == knob and not fc.caveats()
    assert fc.largest() == truth(make, "gpumem")


def test_from_traces_a_workspace_seen_at_one_value_is_held_at_its_size():
    """Without the step (traces recorded elsewhere, the command line), nothing more can be
    recorded: what only the largest value makes is held at its size there, and said so."""

    def make(h):
        return Layered(h, workspace=lambda k: 32 * KiB if k >= 4 else 0)

    def recording(k):
        h = gpumem.Heap(device="sim", capacity=16 * GiB)
        return gpumem.forecast(make(h).step, knob=[k, k + 1], heap=h, warmup=0).recordings[0]

    fc = Forecast([recording(2), recording(4)], name="batch", capacity=CAP)
    assert fc.aligned and fc.recorded == [2, 4]
    (line,) = fc.caveats()
    assert "6 allocations only at batch >= 4 (up to 32.00 KiB each, held at batch 4's size" in line
    for allocator in ("gpumem", "native"):
        assert fc.largest(allocator=allocator) == truth(make, allocator), allocator


def test_sizes_of_a_shifted_knob_still_pair():
    """A convolution without padding at resolution r makes blocks of (16 r - 2) squared: from r = 2
    to 3 they grow a little more than the square of the knob's ratio, and are still one block
    (a workspace from r = 3 on makes the recordings differ, so that they are paired one by one)."""

    class Valid(Layered):
        def layer(self, r):
            h = self.heap
            ws = h.malloc(32 * KiB) if r >= 3 else None
            t = h.malloc(4096 * (16 * r - 2) ** 2)
            out = h.malloc(8192 * (16 * r - 2) ** 2)
            h.free(t)
            if ws is not None:
                h.free(ws)
            return out

    def make(h):
        return Valid(h, layers=4)

    h = gpumem.Heap(device="sim", capacity=16 * GiB)
    fc = gpumem.forecast(make(h).step, knob=[2, 3, 4], heap=h, name="resolution", capacity=CAP)
    assert fc.aligned and fc.alignment.set_aside == {2: 0, 3: 0, 4: 8} and fc.model.kinds["quadratic"] > 0
    for allocator in ("gpumem", "native"):
        assert fc.largest(allocator=allocator) == truth(make, allocator), allocator


def test_layered_steps_drawn_at_random_are_forecast_exactly():
    """Layered steps of 2 to 8 layers, with a workspace from some batch on, an algorithm switch
    from some batch on, both or neither, with call sites or none, recorded at values that show
    them: each forecast equals the truth under both allocators."""
    import random

    ran = 0
    for seed in range(80):
        rng = random.Random(seed)
        layers = rng.randint(2, 8)
        ws_from, ws_size = rng.choice([None, 2, 3, 4, 5, 8]), rng.choice([16 * KiB, 32 * KiB, 256 * KiB])
        switch_at, sites = rng.choice([None, 3, 4, 5, 6, 8]), rng.random() < 0.5
        knob = rng.choice([[2, 4], [1, 2], [2, 4, 8], [2, 3, 4], [4, 6, 8]])
        if (ws_from or 0) > knob[-1] or (switch_at or 0) > knob[-1]:
            continue  # past the recordings: what they cannot show (refine=True is for that)

        def make(h):
            ws = lambda k: ws_size if ws_from and k >= ws_from else 0  # noqa: E731
            return Layered(h, layers=layers, workspace=ws, switch_at=switch_at, sites=sites)

        h = gpumem.Heap(device="sim", capacity=16 * GiB)
        fc = gpumem.forecast(make(h).step, knob=knob, heap=h, name="batch", capacity=CAP)
        assert fc.aligned, (seed, fc.alignment.message)
        for allocator in ("gpumem", "native"):
            got, true = fc.largest(allocator=allocator), truth(make, allocator)
            assert got == true, (seed, allocator, got, true, fc.caveats())
        ran += 1
    assert ran >= 30


def test_refine_confirms_past_what_only_some_values_make():
    """refine=True records at half the answer: that recording lines up event for event with the
    largest before it (the workspace both make), so it confirms the forecast alone; a value is
    recorded twice only where it first differs from the value recorded before it."""
    ran = []

    def make(h):
        p = Layered(h, workspace=lambda k: 16 * KiB + 4 * KiB * k if k >= 4 else 0)
        step = p.step
        p.step = lambda k: (ran.append(k), step(k))
        return p

    h = gpumem.Heap(device="sim", capacity=16 * GiB)
    fc = gpumem.forecast(make(h).step, knob=[2, 4], heap=h, name="batch", capacity=CAP, refine=True)
    half = min(fc.first.largest(allocator=a) for a in ("gpumem", "native")) // 2
    assert fc.recorded == [2, 4, 6, half] and ran == [2, 2, 4, 4, 6, half]
    assert any("the new recording agreed with that forecast" in line for line in fc.summary_lines())
    for allocator in ("gpumem", "native"):
        assert fc.largest(allocator=allocator) == truth(make, allocator), allocator
