"""Forecast the memory of a program at any batch size or sequence length from a
few small recorded steps, and the largest value that fits a device.

    fc = gpumem.forecast(step, knob=[2, 4], name="batch", capacity="80GiB")
    print(fc)                     # a table: peak live and the capacity each allocator needs
    fc.largest()                  # the largest batch that fits under gpumem
    fc.largest(allocator="native")
    fc.plot("forecast.png")

How it works:

1. *Record*: the program's step runs at two (or three) small values of one knob
   with allocation history on: gpumem's own history when gpumem is torch's
   allocator, torch's memory history otherwise, or a gpumem.Heap's on the
   simulated device.  Traces recorded elsewhere (gpumem text traces, torch
   ``_snapshot()`` pickles) serve as well: ``Forecast.from_traces``.
2. *Align*: a sequence alignment pairs what the recordings make alike (the
   same allocations and frees in the same order on the same streams, of other
   sizes) and sets aside what only some make (a workspace at some sizes,
   another algorithm's temporaries): the largest value's is kept and sized from
   the recordings that have it, one more value recorded where only the largest
   has it; the caveats say what was modelled (gpumem.forecast.align).  Where
   they still do not line up, the forecast says so and at which event,
   and gives only an estimate of peak live memory, which it marks as such: it
   cannot then say what either allocator needs, nor promise that a value it
   finds fits does.
3. *Fit*: each allocation's size is fitted against the knob: a constant when the
   knob does not change it, a line through two recordings, and a parabola where
   three recordings show curvature (attention scores grow with the square of the
   sequence length).  With two recordings a size that grows faster than linearly
   is taken as a line; record a third value to see it.
4. *Predict*: the trace at any knob value is synthesised and replayed on the
   simulated device: peak live bytes, the smallest capacity gpumem needs, and the
   smallest a model of torch's native caching allocator needs
   (gpumem.native_model); the largest knob value that fits a capacity is found
   by bisection on the knob, assuming a larger value never needs less memory.

The forecast models the recorded step as it was recorded: memory live before
it (weights, optimizer state) as allocations made first, in address order, and
what the step allocates and frees; under torch, the cuBLAS workspaces are
allocated in the first recorded step, as in a fresh run.  Memory outside the
allocator (the CUDA context) is not in it: give the capacity the allocator may
use.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .align import (
    Alignment,
    ForecastError,
    Model,
    Recording,
    align,
    evaluate,
    fit_sizes,
    last_step,
    modelled,
)
from .record import _record, _recorder, _sites, _step_starts, _to_trace, _TorchNativeRecorder  # noqa: F401
from .show import ALLOCATORS, FAR_FACTOR, _Showing
from .._units import parse_size
from ..replay import _narrow
from ..trace import MAX_ALLOC, Trace, TraceError, load_trace

__all__ = [
    "forecast",
    "Forecast",
    "ForecastError",
    "Recording",
    "Alignment",
    "Prediction",
    "align",
    "last_forecast",
    "ALLOCATORS",
]

DEFAULT_MAX_KNOB = 1 << 24
# The largest value that fits must also have every value down to this fraction
# below it fit (at most SETTLE_PROBES of them tried): under torch's allocator a
# step's fate near the limit turns on which cached block each request happens
# to split, so "fits" is not monotonic there (a Llama generation: batch 135
# fits, 136 does not, 137 does).
SETTLE_BELOW = 0.125
SETTLE_PROBES = 64
# refine=True: a recording at half the answer confirms the first forecast when it makes the
# same events and its peak live memory is within this fraction of the forecast's
CONFIRM_WITHIN = 0.01

_last: Optional["Forecast"] = None


# ---- predictions -----------------------------------------------------------------------


@dataclass
class Prediction:
    """What the forecast says about one knob value."""

    knob: int
    peak_live_bytes: int
    estimate_only: bool = False  # the recordings did not line up: peak live is a fit of peaks alone
    gpumem_capacity_bytes: Optional[int] = None  # smallest capacity gpumem replays it in
    native_capacity_bytes: Optional[int] = None  # the same under the native allocator's model
    gpumem_peak_allocated_bytes: Optional[int] = None  # live in gpumem's 512-byte-rounded blocks
    native_peak_allocated_bytes: Optional[int] = None  # torch's max_memory_allocated, as the model counts it

    def capacity(self, allocator: str) -> Optional[int]:
        return self.gpumem_capacity_bytes if allocator == "gpumem" else self.native_capacity_bytes

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _check_allocator(allocator: str) -> str:
    if allocator not in ALLOCATORS:
        raise ValueError(f"allocator must be one of {', '.join(ALLOCATORS)}, not {allocator!r}")
    return allocator


def _check_knobs(knobs) -> List[int]:
    try:
        values = [k for k in knobs]
    except TypeError:
        raise ForecastError(f"knob must be a list of two or more values, not {knobs!r}") from None
    for k in values:
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ForecastError(f"knob values must be positive whole numbers, not {k!r}")
    if len(values) < 2:
        raise ForecastError(f"a forecast needs recordings at two or more knob values, got {len(values)}")
    if len(set(values)) != len(values):
        raise ForecastError(f"knob values must differ: {values}")
    return values


class Forecast(_Showing):
    """A forecast from recordings at several values of one knob (see the module)."""

    def __init__(
        self,
        recordings: Sequence[Recording],
        name: str = "knob",
        capacity=None,
        at: Sequence[int] = (),
        multiple: int = 1,
        heap_kwargs: Optional[dict] = None,
    ):
        _check_knobs([r.knob for r in recordings])
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple <= 0:
            raise ForecastError(f"multiple must be a positive whole number, not {multiple!r}")
        self.recordings = sorted(recordings, key=lambda r: r.knob)
        self.name = name
        self.capacity = None if capacity is None else parse_size(capacity)
        if self.capacity is not None and self.capacity <= 0:
            raise ForecastError(f"capacity must be positive, not {capacity!r}")
        self.at = sorted({int(k) for k in at})
        for k in self.at:
            if k <= 0:
                raise ForecastError(f"knob values to forecast must be positive, not {k}")
        self.multiple = multiple
        self.heap_kwargs = heap_kwargs
        self.first: Optional["Forecast"] = None  # refine=True: the forecast from the first recordings
        self.refine_note: Optional[str] = None  # refine=True: why the first forecast stands
        self.one_more: Optional[int] = None  # the value recorded to size what only the largest one made
        t0 = time.perf_counter()
        self.alignment = align(self.recordings, name)
        self.whole = None  # the whole recordings, where only their last steps line up
        if not self.alignment.aligned:
            last = [last_step(r) for r in self.recordings]
            if all(x is not None for x in last):
                got = align(last, name)
                if got.aligned:
                    self.whole, self.recordings = (self.recordings, self.alignment), last
                    got.message += f" (their last steps only: {self.alignment.message})"
                    self.alignment = got
        self.model = Model(self.recordings, self.alignment) if self.alignment.aligned else None
        if self.model is None:
            # peak live alone, fitted the same way, is all that can be said
            xs = [float(r.knob) for r in self.recordings]
            ys = [r.trace.peak_live_bytes for r in self.recordings]
            self._peak_fit = fit_sizes(xs, ys, 0.005 * max(ys))[1]
        self._traces: Dict[int, Trace] = {}
        self._fits: Dict[Tuple[str, int, int], bool] = {}
        self._predictions: Dict[int, Prediction] = {}
        self._largest: Dict[Tuple[str, int], float] = {}
        self.model_seconds = time.perf_counter() - t0

    # ---- construction --------------------------------------------------------------

    @classmethod
    def from_traces(cls, paths: Sequence, knob: Sequence[int], device: Optional[int] = None, **kw) -> "Forecast":
        """A forecast from trace files (gpumem text traces or torch snapshot
        pickles), one per knob value, in the same order.  Raises TraceError for a
        file that cannot be read, ForecastError for the rest."""
        knobs = _check_knobs(knob)
        if len(paths) != len(knobs):
            raise ForecastError(f"{len(paths)} traces but {len(knobs)} knob values: give one knob value per trace")
        recs = []
        for path, k in zip(paths, knobs):
            t = load_trace(path, device=device)
            if not t.n_events:  # as replay refuses it
                raise TraceError(str(path), None, "no allocations: nothing to forecast")
            # a snapshot's blocks live before its history lead the trace, as gpumem.forecast's live blocks do
            recs.append(Recording(k, t, Recording.granularity_of(t), step_starts=[t.live_before]))
        return cls(recs, **kw)

    # ---- the model -------------------------------------------------------------------

    @property
    def aligned(self) -> bool:
        return self.alignment.aligned

    @property
    def knob_has_effect(self) -> bool:
        if self.model is not None:
            return self.model.knob_has_effect
        return len({r.trace.peak_live_bytes for r in self.recordings}) > 1

    @property
    def recorded(self) -> List[int]:
        return [r.knob for r in self.recordings]

    @property
    def record_seconds(self) -> float:
        return sum(r.seconds for r in self.recordings)

    def fit_summary(self) -> str:
        """One line on what the fit found (or why there is none)."""
        if self.model is None:
            return self.alignment.message
        k = self.model.kinds
        s = (
            f"{self.model.n_allocs} allocations: {k['constant']} constant, {k['linear']} linear, "
            f"{k['quadratic']} quadratic in {self.name}"
        )
        if len(self.recordings) == 2 and self.knob_has_effect:
            s += " (two recordings fit lines: record a third value to see sizes that grow faster)"
        return s

    def caveats(self) -> List[str]:
        """What the forecast cannot promise, in words."""
        out = []
        if not self.aligned:
            out.append(
                f"{self.alignment.message}. The recordings differ in what the program allocates, not only in how "
                "much, so no trace can be synthesised: the peak live figures are a fit of each recording's peak "
                "alone, neither allocator's capacity is forecast, and a value said to fit may not. Record steps "
                "that allocate alike (warm up first, the same code path at every value)."
            )
        elif not self.knob_has_effect:
            out.append(f"the {self.name} changes no allocation's size: memory is the same at every value")
        if self.whole is not None:
            n = len(self.whole[0][0].step_starts)
            out.append(
                f"the {n} recorded steps do not line up as a whole ({self.whole[1].message}); their last steps do, "
                "and the forecast covers the last step, with what the steps before it left live. A first step "
                "that allocates more than later ones (optimizer state, lazily made buffers) is not in it."
            )
        if self.aligned and not self.alignment.exact:
            out.append(
                modelled(self.model, self.alignment, self.recorded, self.name)
                + (f" ({self.name} {self.one_more} recorded to size them)" if self.one_more else "")
                + ". Between the recorded values the forecast follows the larger one's code."
            )
        if self.refine_note:
            out.append(f"not refined: {self.refine_note}")
        return out

    def synthesise(self, k: int) -> Trace:
        """The trace the program would make at knob value `k`."""
        if self.model is None:
            raise ForecastError(self.alignment.message + ": no trace can be synthesised")
        t = self._traces.get(k)
        if t is None:
            if len(self._traces) > 64:
                self._traces.clear()
            t = self._traces[k] = self.model.synthesise(k, f"{self.name}={k}")
        return t

    def peak_live(self, k: int) -> int:
        if self.model is None:
            return evaluate(self._peak_fit, k)
        return self.synthesise(k).peak_live_bytes

    # ---- replays ---------------------------------------------------------------------

    def fits(self, k: int, capacity=None, allocator: str = "gpumem") -> bool:
        """Whether the step at knob value `k` replays with no OOM in `capacity` bytes."""
        _check_allocator(allocator)
        cap = self._capacity(capacity)
        key = (allocator, cap, k)
        got = self._fits.get(key)
        if got is None:
            if self.model is None:
                got = self.peak_live(k) <= cap
            else:
                got = self._replay_fits(self.synthesise(k), cap, allocator)
            self._fits[key] = got
        return got

    def _replay_fits(self, t: Trace, cap: int, allocator: str) -> bool:
        if t.peak_live_bytes > cap or t.meta.get("largest_alloc", 0) > min(cap, MAX_ALLOC):
            return False
        if allocator == "gpumem":
            from ..replay import fits

            return fits(t, cap, self.heap_kwargs)
        from .native_model import fits_native

        return fits_native(self._from_start(t), cap)

    def _from_start(self, t: Trace) -> Trace:
        """A synthesised trace as torch's allocator would serve it: from the cache it held when the
        template was recorded (under torch's own allocator), or from nothing."""
        from .native_model import with_start

        start = getattr(self.recordings[self.alignment.template], "native_start", None)
        return with_start(t, start)

    def spill(self, k: int, capacity=None, spill_choice: str = "old") -> Optional[int]:
        """Bytes of host memory a step at knob value `k` would spill at its peak under gpumem in
        `capacity` bytes with spill on (install(spill=...), docs/spill.md): 0 when it fits on the
        device.  Replays the synthesised step on a simulated device with that capacity and spill
        unlimited.  None when the recordings do not line up (no step to replay)."""
        if self.model is None:
            return None
        cap = self._capacity(capacity)
        from ..replay import replay

        kw = dict(self.heap_kwargs or {}, spill=max(4 * self.peak_live(k), 1 << 30), spill_choice=spill_choice)
        r = replay(self.synthesise(int(k)), cap, timing=False, heap_kwargs=kw)
        if r.ooms:
            raise ValueError(f"the step at {self.name}={k} does not run in {cap} bytes even with spill on")
        return r.spilled_peak_bytes

    def predict(self, k: int) -> Prediction:
        """Peak live memory at `k`, and the smallest capacity each allocator needs."""
        k = int(k)
        if k <= 0:
            raise ValueError(f"knob values must be positive, not {k}")
        p = self._predictions.get(k)
        if p is not None:
            return p
        if self.model is None:
            p = Prediction(k, self.peak_live(k), estimate_only=True)
        else:
            from .native_model import min_capacity_native, replay_native
            from ..replay import min_capacity, replay

            t = self.synthesise(k)
            if t.meta["largest_alloc"] > MAX_ALLOC:
                p = Prediction(k, t.peak_live_bytes)
            else:
                g = replay(t, max(t.peak_live_bytes * 4, 1 << 30), timing=False, heap_kwargs=self.heap_kwargs)
                p = Prediction(
                    k,
                    t.peak_live_bytes,
                    gpumem_capacity_bytes=min_capacity(t, heap_kwargs=self.heap_kwargs),
                    native_capacity_bytes=min_capacity_native(self._from_start(t)),
                    gpumem_peak_allocated_bytes=g.peak_allocated_bytes,
                    native_peak_allocated_bytes=replay_native(t).peak_allocated_bytes,
                )
        self._predictions[k] = p
        return p

    def _capacity(self, capacity) -> int:
        if capacity is None:
            if self.capacity is None:
                raise ValueError("give a capacity (the memory the allocator may use), e.g. capacity='80GiB'")
            return self.capacity
        cap = parse_size(capacity)
        if cap <= 0:
            raise ValueError(f"capacity must be positive, not {capacity!r}")
        return cap

    def largest(self, capacity=None, allocator: str = "gpumem", max_knob: int = DEFAULT_MAX_KNOB) -> float:
        """The largest knob value (a multiple of `multiple`) whose step fits in
        `capacity` bytes under `allocator` ("gpumem" or "native"): 0 if none
        does, math.inf if the knob changes nothing and the step fits.  Found by
        bisection, assuming a larger value never needs less memory, then
        settled: the values from an eighth below the answer up to it must fit
        too, or the answer drops below the first that does not (near the limit,
        whether a step fits torch's allocator turns on which cached blocks its
        requests split, and can change from one value to the next); values
        beyond `max_knob` are not tried (the answer is then max_knob).  When the
        recordings do not line up it is only a bound from peak live memory:
        nothing larger fits, and it may not fit itself."""
        _check_allocator(allocator)
        cap = self._capacity(capacity)
        key = (allocator, cap)
        if key in self._largest:
            return self._largest[key]
        m = self.multiple
        top = max(1, max_knob // m)

        def ok(j: int) -> bool:
            return self.fits(j * m, cap, allocator)

        if not self.knob_has_effect:
            ans = math.inf if ok(max(1, self.recorded[0] // m)) else 0
        elif not ok(1):
            ans = 0
        else:
            lo, hi = 1, max(2, -(-self.recorded[-1] // m))
            while True:
                if hi >= top:
                    if ok(top):
                        lo = top
                    hi = top
                    break
                if not ok(hi):
                    break
                lo, hi = hi, hi * 2
            ans = _settled(_narrow(lo, hi, ok)[0], ok) * m
        self._largest[key] = ans
        return ans


def _settled(j: int, ok: Callable[[int], bool]) -> int:
    """The largest i <= j such that i and the values from SETTLE_BELOW below it
    up to it all fit (where many, SETTLE_PROBES of them, evenly spread): past
    the first value below j that does not fit, nothing is promised."""
    while j >= 1:
        lo = max(1, int(j * (1 - SETTLE_BELOW)))
        stride = max(1, -(-(j - lo) // SETTLE_PROBES))
        bad = next((i for i in [*range(lo, j, stride), j] if not ok(i)), None)
        if bad is None:
            return j
        j = bad - 1
    return 0


def last_forecast() -> Optional[Forecast]:
    """The last forecast gpumem.forecast made in this process, or None."""
    return _last


def _set_last(fc: Forecast) -> None:
    global _last
    _last = fc
    from ..explain import set_forecast

    set_forecast(fc.explain_lines)


def forecast(
    step: Callable[[int], object],
    knob: Sequence[int] = (2, 4),
    *,
    name: str = "knob",
    capacity=None,
    at: Sequence[int] = (),
    heap=None,
    device=None,
    warmup: int = 1,
    steps: int = 1,
    reset: Optional[Callable[[], object]] = None,
    multiple: int = 1,
    refine: bool = False,
) -> Forecast:
    """Run `step(k)` at each knob value `k` with allocation history on, and
    forecast the memory at any other value (see the module docstring).

    step: one step of the program (a training step, a generation) at knob value k.
    knob: two or more small values of the knob (three to see quadratic growth).
    name: what the knob is ("batch", "seq"), for the report.
    capacity: the memory the allocator may use (default: the heap's cap or the
        device's memory, times torch's memory fraction under the native allocator).
    at: knob values you mean to run; their forecast shows in OOM explanations.
    heap: a gpumem.Heap the step drives (the simulated device); default: torch's
        allocator on `device` (gpumem's history when gpumem is installed, torch's
        memory history otherwise).  Recording replaces any history already on.
    warmup: unrecorded steps before the first value's recording, so that one-time
        allocations (compiled kernels' buffers, caches) happen outside it.  Every
        other value is recorded at once; where that recording does not make the
        same events as the value recorded before it (one-time work at a new size,
        such as a library's setup for a new shape), it counts as that value's
        warm-up and the value is recorded again.  Under torch, the cuBLAS
        workspaces are freed before each recording, so that its first step makes
        them again where the first step of a fresh run does.
    steps: recorded steps per value (2 models the reuse between steps).
    reset: called after the warm-up, before each recording, e.g. to drop optimizer
        state (``opt.state.clear()``) so that each recording's first step makes it
        again, as the first step of a fresh run at that value does.
    multiple: the knob's granularity in the search for the largest value.
    refine: where the largest value that fits lies more than 8 times past the
        largest recorded, record again at half of it (at most half the answer's
        memory).  Where that recording makes the same events as the largest one
        before it and the peak live memory they forecast for it (within 1%), the
        forecast is made from all the recordings; otherwise it records at a
        quarter of the answer too and forecasts from those two: memory a step
        takes only past some size then shows.  The first forecast stays as
        ``.first``.
    """
    knobs = _check_knobs(knob)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ForecastError(f"warmup must be a whole number of steps, not {warmup!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ForecastError(f"steps must be a positive whole number, not {steps!r}")
    rec = _recorder(heap, device)
    made: List[Recording] = []  # the recordings so far, each value's last

    def record(k: int) -> Recording:
        if not made:
            made.append(_record(rec, step, k, name, warmup, steps, reset))
            return made[0]
        r = _record(rec, step, k, name, 0, steps, reset)
        if warmup and not _alike(made[-1], r, name):
            # one-time work at k (a library's setup for a new shape): what ran was k's warm-up
            again = _record(rec, step, k, name, max(0, warmup - steps), steps, reset)
            again.seconds += r.seconds
            r = again
        made.append(r)
        return r

    cap = capacity if capacity is not None else rec.capacity()
    fc = Forecast([record(k) for k in sorted(knobs)], name=name, capacity=cap, at=at, multiple=multiple)
    fc = _one_more(fc, record)
    if refine:
        fc = _refined(fc, record)
    _set_last(fc)
    return fc


def _one_more(fc: "Forecast", record: Callable[[int], Recording]) -> "Forecast":
    """Where the largest recorded value makes allocations no other does, their
    sizes are known at one value only (held there): record one value more, as
    far past it as it lies past the one before, so that they are fitted through
    two.  The forecast stays as it was, with a note, where that recording runs
    out of memory or does not line up."""
    if fc.model is None or fc.whole is not None or not any(len(at) == 1 for at in fc.model.only):
        return fc
    top, m = fc.recorded[-1], fc.multiple
    k = -(-(2 * top - fc.recorded[-2]) // m) * m
    kw = _settings_of(fc)
    new = _with_more(
        fc,
        lambda: Forecast([*fc.recordings, record(k)], **kw),
        f"recording {fc.name} {k} too ran out of memory",
        f"the recording at {fc.name} {k} does not line up with the others",
    )
    if new is None:
        return fc
    new.one_more = k
    return new


def _with_more(fc: "Forecast", make: Callable[[], "Forecast"], oom: str, apart: str) -> Optional["Forecast"]:
    """make()'s forecast from more recordings; None, with fc.refine_note saying
    why, where a recording runs out of memory (`oom`) or they do not line up (`apart`)."""
    try:
        new = make()
    except Exception as e:  # noqa: BLE001 - only an out-of-memory error is expected here
        if "OutOfMemory" not in type(e).__name__:
            raise
        fc.refine_note = f"{oom}: {str(e).splitlines()[0]}"
        return None
    if not new.aligned:
        fc.refine_note = f"{apart} ({new.alignment.message})"
        return None
    return new


def _settings_of(fc: "Forecast") -> dict:
    """What a forecast made from more recordings keeps of `fc`: its name, capacity, point and multiple."""
    return dict(name=fc.name, capacity=fc.capacity, at=fc.at, multiple=fc.multiple, heap_kwargs=fc.heap_kwargs)


def _alike(a: Recording, b: Recording, name: str) -> bool:
    """Whether two recordings make the same events (sizes aside), nothing set aside."""
    return align(sorted([a, b], key=lambda r: r.knob), name).exact


def _refined(fc: "Forecast", record: Callable[[int], Recording]) -> "Forecast":
    """refine=True: where the largest value that fits lies more than FAR_FACTOR
    times past the largest recorded one, record again at half of it (the smaller
    of the two allocators' answers).  If that recording confirms the first
    forecast (_confirms), the forecast is made from every recording; if not, it
    records at a quarter of the answer too and forecasts from those two: a
    step's memory that only larger values allocate (a reduction's staging
    buffer, a library's workspace) then shows in both recordings.  The first
    forecast is kept as `.first`; it is the answer where the new recordings do
    not line up or a step runs out of memory."""
    if not fc.aligned or not fc.knob_has_effect or fc.capacity is None:
        return fc
    answers = [v for v in (fc.largest(allocator=a) for a in ALLOCATORS) if v != math.inf]
    top, m = fc.recorded[-1], fc.multiple
    if not answers or min(answers) <= FAR_FACTOR * top:
        return fc
    target = min(answers)
    lo, hi = max(m, int(target // 4) // m * m), max(m, int(target // 2) // m * m)
    if lo <= top or lo >= hi:
        return fc
    kw = _settings_of(fc)

    def make() -> "Forecast":
        far = record(hi)
        new = Forecast([*fc.recordings, far], **kw)
        return new if _confirms(fc, new, far) else Forecast([record(lo), far], **kw)

    new = _with_more(
        fc,
        make,
        f"recording again at {fc.name} {lo} and {hi} ran out of memory",
        f"the recordings at {fc.name} {lo} and {hi} do not line up",
    )
    if new is None:
        return fc
    new.first = fc
    return new


def _confirms(fc: "Forecast", joined: "Forecast", far: Recording) -> bool:
    """Whether the recording `far` agrees with the forecast `fc`: it lines up
    event for event with fc's largest recording (what smaller ones lack aside),
    and its peak live memory is within CONFIRM_WITHIN of what fc forecast for it."""
    a = joined.alignment
    if not joined.aligned or joined.recorded[-1] != far.knob:
        return False
    below = joined.recorded[-2]
    if a.set_aside.get(below, 0) or a.switches.get(below, 0) or -1 in a.maps[-2]:
        return False
    real = far.trace.peak_live_bytes
    return abs(fc.peak_live(far.knob) - real) <= CONFIRM_WITHIN * real
