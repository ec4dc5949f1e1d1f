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
2. *Align*: the recordings must make the same allocations and frees in the same
   order on the same streams, only of other sizes.  Where they do not, the
   forecast says so and at which event, and gives only an estimate of peak live
   memory, which it marks as such: it cannot then say what either allocator
   needs, nor promise that a value it finds fits does.
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
it (weights, optimizer state) as allocations made first, in their order, and
what the step allocates and frees.  Memory outside the allocator (the CUDA
context, library workspaces) is not in it: give the capacity the allocator may
use.
"""

from __future__ import annotations

import html as _html
import io
import math
import os
import sys
import time
from array import array
from dataclasses import dataclass
from itertools import accumulate
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ._units import format_size, parse_size
from .trace import MAX_ALLOC, R_ALLOC, Trace, TraceError, _Builder, load_trace

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

ALLOCATORS = ("gpumem", "native")
# Sizes recorded by gpumem's history are its blocks' sizes, rounded up to this.
GPUMEM_GRANULARITY = 512
DEFAULT_MAX_KNOB = 1 << 24
_HISTORY_ENTRIES = 1 << 20

_last: Optional["Forecast"] = None


class ForecastError(ValueError):
    """Input a forecast cannot be made from (knob values, recordings); one line."""


# ---- recordings ------------------------------------------------------------------------


@dataclass
class Recording:
    """One recorded step: the knob value it ran at and its allocation trace."""

    knob: int
    trace: Trace
    granularity: int = 1  # the recorded sizes are rounded up to a multiple of this
    seconds: float = 0.0  # how long recording it took

    @staticmethod
    def granularity_of(trace: Trace) -> int:
        """What the trace's sizes are rounded to: gpumem's and torch's histories
        record their blocks' sizes, multiples of 512 bytes."""
        meta = trace.meta or {}
        if meta.get("size_granularity"):
            return int(meta["size_granularity"])
        settings = meta.get("allocator_settings") or {}
        if isinstance(settings, dict) and settings.get("allocator") == "gpumem":
            return GPUMEM_GRANULARITY
        if all(s % GPUMEM_GRANULARITY == 0 for s in trace.words[1::3]):
            return GPUMEM_GRANULARITY
        return 1


@dataclass
class Alignment:
    """Whether the recordings make the same events, only of other sizes."""

    aligned: bool
    events: int  # events of the first recording
    allocs: int
    message: str  # one line: what lines up, or where it stops
    first_difference: int = -1  # the first event that differs (-1: none)


def _knob_label(name: str, k) -> str:
    return f"{name} {k}"


def align(recordings: Sequence[Recording], name: str = "knob") -> Alignment:
    """Line the recordings up event by event: the same actions, in the same
    order, on the same streams, each free freeing the same allocation."""
    first = recordings[0]
    w0 = first.trace.words
    n0 = first.trace.n_events
    for r in recordings[1:]:
        w = r.trace.words
        n = r.trace.n_events
        # op and slot (which allocation a free frees) share the first word, the stream is the third
        same_prefix = min(n0, n)
        if (
            w0[0 : 3 * same_prefix : 3] == w[0 : 3 * same_prefix : 3]
            and w0[2 : 3 * same_prefix : 3] == w[2 : 3 * same_prefix : 3]
        ):
            if n == n0:
                continue
            diff = same_prefix
        else:
            diff = next(i for i in range(same_prefix) if w0[3 * i] != w[3 * i] or w0[3 * i + 2] != w[3 * i + 2])
        a = _knob_label(name, first.knob)
        b = _knob_label(name, r.knob)
        counts = f"{n0} events at {a}, {n} at {b}"
        if diff >= min(n0, n):
            where = f"the first {diff} events line up, then only {a if n0 > n else b} goes on"
        else:
            where = f"they first differ at event {diff}: {_describe(w0, diff)} at {a}, {_describe(w, diff)} at {b}"
        return Alignment(
            False,
            n0,
            first.trace.allocs,
            f"the recordings do not line up ({counts}); {where}",
            diff,
        )
    knobs = ", ".join(str(r.knob) for r in recordings)
    return Alignment(
        True,
        n0,
        first.trace.allocs,
        f"the recordings at {name} {knobs} line up: {n0} events, {first.trace.allocs} allocations",
    )


def _describe(words, i: int) -> str:
    head = words[3 * i]
    op = "an alloc" if head & 0xFFFFFFFF == R_ALLOC else "a free"
    return f"{op} of {format_size(words[3 * i + 1])} on stream {words[3 * i + 2]}"


# ---- fitting ---------------------------------------------------------------------------


def _solve(a: List[List[float]], b: List[float]) -> List[float]:
    """Gaussian elimination with partial pivoting, for the normal equations."""
    n = len(b)
    m = [row[:] + [v] for row, v in zip(a, b)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if m[c][c] == 0:
            raise ZeroDivisionError
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def _polyfit(xs: Sequence[float], ys: Sequence[float], degree: int) -> Tuple[float, float, float]:
    """Least-squares polynomial of `degree` (1 or 2) as (c0, c1, c2)."""
    d = degree + 1
    a = [[sum(x ** (i + j) for x in xs) for j in range(d)] for i in range(d)]
    b = [sum(y * x**i for x, y in zip(xs, ys)) for i in range(d)]
    c = _solve(a, b)
    return (c[0], c[1], c[2] if degree == 2 else 0.0)


def _fit_sizes(xs: Sequence[float], ys: Sequence[int], tolerance: float) -> Tuple[str, Tuple[float, float, float]]:
    """The kind ("constant", "linear", "quadratic") and coefficients of one size."""
    if all(y == ys[0] for y in ys):
        return "constant", (float(ys[0]), 0.0, 0.0)
    lin = _polyfit(xs, ys, 1)
    if len(xs) >= 3:
        worst = max(abs(lin[0] + lin[1] * x - y) for x, y in zip(xs, ys))
        if worst > tolerance:
            return "quadratic", _polyfit(xs, ys, 2)
    return "linear", lin


def _evaluate(c: Tuple[float, float, float], k: float) -> int:
    v = c[0] + c[1] * k + c[2] * k * k
    return max(0, int(round(v)))


class _Model:
    """Each allocation's size as a function of the knob, and the event skeleton
    the synthesised traces share."""

    def __init__(self, recordings: Sequence[Recording]):
        template = recordings[0].trace
        self.template = template
        w = template.words
        n = template.n_events
        ops = w[0::3]
        # per event: the ordinal of the allocation whose size it carries
        ordinal = [0] * n
        by_slot: Dict[int, int] = {}
        count = 0
        for i, head in enumerate(ops):
            slot = head >> 32
            if head & 0xFFFFFFFF == R_ALLOC:
                by_slot[slot] = count
                ordinal[i] = count
                count += 1
            else:
                ordinal[i] = by_slot[slot]
        self.ordinal = ordinal
        self.is_alloc = [head & 0xFFFFFFFF == R_ALLOC for head in ops]
        self.n_allocs = count
        alloc_idx = [i for i in range(n) if self.is_alloc[i]]
        xs = [float(r.knob) for r in recordings]
        tolerance = max(0.5, float(max(r.granularity for r in recordings)))
        columns = [[r.trace.words[3 * i + 1] for i in alloc_idx] for r in recordings]
        cache: Dict[Tuple[int, ...], Tuple[str, Tuple[float, float, float]]] = {}
        self.coefs: List[Tuple[float, float, float]] = []
        self.kinds: Dict[str, int] = {"constant": 0, "linear": 0, "quadratic": 0}
        for sizes in zip(*columns):
            got = cache.get(sizes)
            if got is None:
                got = cache[sizes] = _fit_sizes(xs, sizes, tolerance)
            self.kinds[got[0]] += 1
            self.coefs.append(got[1])
        # distinct size functions: evaluating each once per knob value is what synthesis costs
        self.distinct = sorted(set(self.coefs))
        self.index = {c: i for i, c in enumerate(self.distinct)}
        self.which = [self.index[c] for c in self.coefs]

    @property
    def knob_has_effect(self) -> bool:
        return self.kinds["linear"] + self.kinds["quadratic"] > 0

    def sizes(self, k: float) -> List[int]:
        values = [_evaluate(c, k) for c in self.distinct]
        return [values[j] for j in self.which]

    def synthesise(self, k: float, name: str) -> Trace:
        per_alloc = self.sizes(k)
        per_event = [per_alloc[o] for o in self.ordinal]
        words = array("Q", self.template.words)
        if per_event:
            words[1::3] = array("Q", per_event)
        signed = [s if a else -s for s, a in zip(per_event, self.is_alloc)]
        peak, peak_event = 0, -1
        for i, v in enumerate(accumulate(signed)):
            if v > peak:
                peak, peak_event = v, i
        t = self.template
        return Trace(
            name,
            "synthesised",
            t.device,
            words,
            t.n_slots,
            t.allocs,
            t.frees,
            peak,
            peak_event,
            {"knob": k, "largest_alloc": max(per_alloc, default=0)},
        )


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


class Forecast:
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
        t0 = time.perf_counter()
        self.alignment = align(self.recordings, name)
        self.model = _Model(self.recordings) if self.alignment.aligned else None
        if self.model is None:
            # peak live alone, fitted the same way, is all that can be said
            xs = [float(r.knob) for r in self.recordings]
            ys = [r.trace.peak_live_bytes for r in self.recordings]
            self._peak_fit = _fit_sizes(xs, ys, 0.005 * max(ys))[1]
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
            recs.append(Recording(k, t, Recording.granularity_of(t)))
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
            return _evaluate(self._peak_fit, k)
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
            from .replay import fits

            return fits(t, cap, self.heap_kwargs)
        from .native_model import fits_native

        return fits_native(t, cap)

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
            from .replay import min_capacity, replay

            t = self.synthesise(k)
            if t.meta["largest_alloc"] > MAX_ALLOC:
                p = Prediction(k, t.peak_live_bytes)
            else:
                g = replay(t, max(t.peak_live_bytes * 4, 1 << 30), timing=False, heap_kwargs=self.heap_kwargs)
                p = Prediction(
                    k,
                    t.peak_live_bytes,
                    gpumem_capacity_bytes=min_capacity(t, heap_kwargs=self.heap_kwargs),
                    native_capacity_bytes=min_capacity_native(t),
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
        bisection, assuming a larger value never needs less memory; values
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
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if ok(mid):
                    lo = mid
                else:
                    hi = mid
            ans = lo * m
        self._largest[key] = ans
        return ans

    # ---- showing ---------------------------------------------------------------------

    def values(self, extra: Sequence[int] = ()) -> List[int]:
        """The knob values a table shows: those recorded, `at`, the largest that
        fit the capacity, and any `extra`."""
        vals = set(self.recorded) | set(self.at) | {int(v) for v in extra}
        if self.capacity is not None:
            for a in ALLOCATORS if self.aligned else ("gpumem",):
                v = self.largest(allocator=a)
                if 0 < v < math.inf:
                    vals.add(int(v))
                    vals.add(int(v) + self.multiple)
        return sorted(vals)

    def rows(self, values: Optional[Sequence[int]] = None) -> List[Prediction]:
        return [self.predict(k) for k in (self.values() if values is None else values)]

    def _largest_text(self, allocator: str) -> str:
        v = self.largest(allocator=allocator)
        if v == math.inf:
            return "any (no effect)"
        if not self.aligned:
            return f"at most {v}"
        return str(v)

    def summary_lines(self) -> List[str]:
        rec = ", ".join(str(k) for k in self.recorded)
        lines = [f"forecast of {self.name} from recordings at {self.name} {rec}: {self.fit_summary()}"]
        if self.capacity is not None:
            if self.aligned:
                lines.append(
                    f"largest {self.name} that fits {format_size(self.capacity)}: "
                    f"gpumem {self._largest_text('gpumem')}, native {self._largest_text('native')}"
                )
            else:
                lines.append(
                    f"largest {self.name} that fits {format_size(self.capacity)}: "
                    f"{self._largest_text('gpumem')} (a bound from peak live memory only)"
                )
        lines.extend(f"warning: {c}" for c in self.caveats())
        return lines

    def table(self, values: Optional[Sequence[int]] = None) -> str:
        """The forecast as a text table (a row per knob value)."""
        header = [self.name, "peak live", "gpumem needs", "native needs", "gpumem/live", "native/live"]
        if self.capacity is not None:
            header += ["fits gpumem", "fits native"]
        lines = [header]
        recorded = set(self.recorded)
        for p in self.rows(values):
            live = p.peak_live_bytes
            g, n = p.gpumem_capacity_bytes, p.native_capacity_bytes
            mark = "*" if p.knob in recorded else ""
            row = [
                f"{p.knob}{mark}",
                ("~" if p.estimate_only else "") + format_size(live),
                format_size(g) if g is not None else "-",
                format_size(n) if n is not None else "-",
                f"{g / live:.3f}" if g is not None and live else "-",
                f"{n / live:.3f}" if n is not None and live else "-",
            ]
            if self.capacity is not None:
                if self.aligned:
                    row += [_yes(self.fits(p.knob, allocator="gpumem")), _yes(self.fits(p.knob, allocator="native"))]
                else:
                    row += ["-", "-"]
            lines.append(row)
        widths = [max(len(r[i]) for r in lines) for i in range(len(header))]
        out = []
        for n_row, row in enumerate(lines):
            out.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
            if n_row == 0:
                out.append("  ".join("-" * w for w in widths))
        out.append("(* recorded; needs: the smallest capacity replaying the step with no OOM, to 1 MiB / 2 MiB)")
        return "\n".join(out)

    def text(self) -> str:
        return "\n".join(self.summary_lines() + ["", self.table()])

    __str__ = text

    def __repr__(self) -> str:
        return f"<gpumem.Forecast {self.name} from {self.recorded}, aligned={self.aligned}>"

    def to_json(self) -> dict:
        out = {
            "knob": self.name,
            "recorded": self.recorded,
            "aligned": self.aligned,
            "alignment": self.alignment.message,
            "first_difference": self.alignment.first_difference,
            "fit": dict(self.model.kinds) if self.model else None,
            "caveats": self.caveats(),
            "capacity_bytes": self.capacity,
            "record_seconds": self.record_seconds,
            "rows": [p.to_json() for p in self.rows()],
        }
        if self.capacity is not None:
            for a in ALLOCATORS:
                v = self.largest(allocator=a) if (self.aligned or a == "gpumem") else None
                out[f"largest_{a}"] = None if v is None or v == math.inf else v
            out["largest_is_bound"] = not self.aligned
            out["knob_has_effect"] = self.knob_has_effect
        return out

    def plot(self, path=None, ax=None, values: Optional[Sequence[int]] = None):
        """Peak live and each allocator's capacity against the knob, the
        capacity drawn as a line; needs matplotlib.  Writes `path` if given;
        returns the axes."""
        try:
            import matplotlib

            if ax is None and path is not None:
                matplotlib.use("Agg", force=False)
            import matplotlib.pyplot as plt
        except ImportError:
            raise ImportError("Forecast.plot needs matplotlib (pip install matplotlib)") from None
        vals = list(values) if values is not None else self._plot_values()
        rows = self.rows(vals)
        fig = None
        if ax is None:
            fig, ax = plt.subplots(figsize=(7, 4.2))
        gib = float(1 << 30)
        xs = [p.knob for p in rows]
        ax.plot(xs, [p.peak_live_bytes / gib for p in rows], "o-", label="peak live", color="#444444")
        if self.aligned:
            ax.plot(xs, [(p.gpumem_capacity_bytes or 0) / gib for p in rows], "s-", label="gpumem needs")
            ax.plot(xs, [(p.native_capacity_bytes or 0) / gib for p in rows], "^-", label="native needs")
        if self.capacity is not None:
            ax.axhline(self.capacity / gib, color="red", linestyle="--", label=f"capacity {format_size(self.capacity)}")
            marks: Dict[int, List[str]] = {}
            for a in ALLOCATORS if self.aligned else ("gpumem",):
                v = self.largest(allocator=a)
                if 0 < v < math.inf:
                    marks.setdefault(int(v), []).append(a)
            for v, names in marks.items():
                ax.axvline(v, color="gray", linestyle=":", linewidth=1)
                ax.annotate(f"{', '.join(names)}: {v}", (v, self.capacity / gib), rotation=90, va="top", fontsize=8)
        ax.scatter(self.recorded, [self.peak_live(k) / gib for k in self.recorded], zorder=5, color="black")
        ax.set_xlabel(self.name)
        ax.set_ylabel("GiB")
        ax.set_title(f"memory forecast from {self.name} {', '.join(map(str, self.recorded))}")
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
        if path is not None and fig is not None:
            fig.tight_layout()
            fig.savefig(os.fspath(path), dpi=110)
            plt.close(fig)
        return ax

    def _plot_values(self) -> List[int]:
        vals = set(self.values())
        top = max(vals)
        steps = 8
        for i in range(1, steps + 1):
            v = max(1, round(top * i / steps / self.multiple) * self.multiple)
            vals.add(v)
        return sorted(vals)

    def to_html(self, path=None) -> str:
        """The summary, table and (with matplotlib) plot as an HTML fragment; writes `path` if given."""
        parts = ["<div class='gpumem-forecast'>"]
        for line in self.summary_lines():
            cls = " style='color:#b00'" if line.startswith("warning:") else ""
            parts.append(f"<p{cls}>{_html.escape(line)}</p>")
        parts.append(f"<pre>{_html.escape(self.table())}</pre>")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            pass
        else:
            import matplotlib.pyplot as plt

            buf = io.StringIO()
            fig, ax = plt.subplots(figsize=(7, 4.2))
            self.plot(ax=ax)
            fig.tight_layout()
            fig.savefig(buf, format="svg")
            plt.close(fig)
            svg = buf.getvalue()
            parts.append(svg[svg.find("<svg") :])
        parts.append("</div>")
        out = "\n".join(parts)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(f"<!doctype html><meta charset='utf-8'><title>gpumem forecast</title>\n{out}\n")
        return out

    def _repr_html_(self) -> str:
        return self.to_html()

    # ---- the OOM explanation -------------------------------------------------------

    def explain_lines(self, capacity: int) -> List[str]:
        """Lines for an OOM report on a heap of `capacity` bytes: what the values
        asked for (`at`) need, and the largest that fits."""
        largest = self.largest(capacity, "gpumem")
        if largest == math.inf:
            return [f"the {self.name} does not change memory (forecast from {self.name} {self.recorded})"]
        bound = "" if self.aligned else " at most"
        tail = f"the largest that fits {format_size(capacity)} is{bound} {largest}" + (
            "" if self.aligned else " (from peak live alone: the recordings do not line up)"
        )
        lines = []
        for k in self.at:
            p = self.predict(k)
            need = p.gpumem_capacity_bytes if p.gpumem_capacity_bytes is not None else p.peak_live_bytes
            lines.append(f"{self.name} {k} needs {format_size(need)}; {tail}")
        if not lines:
            lines.append(f"{tail[0].upper()}{tail[1:]} {self.name} (forecast from {self.name} {self.recorded})")
        return lines


def _yes(b: bool) -> str:
    return "yes" if b else "NO"


def last_forecast() -> Optional[Forecast]:
    """The last forecast gpumem.forecast made in this process, or None."""
    return _last


def _set_last(fc: Forecast) -> None:
    global _last
    _last = fc
    from .explain import set_forecast

    set_forecast(fc.explain_lines)


# ---- recording in this process ----------------------------------------------------------


class _HeapRecorder:
    """History of a gpumem.Heap (any device; the simulated one in tests)."""

    granularity = GPUMEM_GRANULARITY

    def __init__(self, heap):
        self.heap = heap

    def sync(self) -> None:
        pass

    def live_blocks(self) -> List[Tuple[int, int, int]]:
        blocks = [b for b in self.heap.snapshot()["blocks"] if b[6] in ("live", "pending")]
        blocks.sort(key=lambda b: b[5])  # allocation order
        return [(b[0], b[2], b[3]) for b in blocks]

    def start(self) -> None:
        self.heap.history_enable(0)  # drop what the ring held
        self.heap.history_enable(_HISTORY_ENTRIES)

    def stop(self) -> List[Tuple[str, int, int, int]]:
        raw, dropped = self.heap.history()
        self.heap.history_enable(0)
        if dropped:
            raise ForecastError(f"the step made more than {_HISTORY_ENTRIES} history events; record a smaller step")
        return [(e[1], e[2], e[3], e[4]) for e in raw]

    def capacity(self) -> int:
        return int(self.heap.memory_report(0)["cap_bytes"])


class _TorchGpumemRecorder(_HeapRecorder):
    """gpumem serving torch: its heap's history, synchronizing the device."""

    def __init__(self, heap, torch):
        super().__init__(heap)
        self.torch = torch

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.heap.torch_device)


class _TorchNativeRecorder:
    """torch's own caching allocator: its memory history and snapshot."""

    granularity = GPUMEM_GRANULARITY  # torch's history records its blocks' sizes too

    def __init__(self, torch, device):
        self.torch = torch
        self.device = torch.cuda.current_device() if device is None else torch.device(device).index or 0

    def sync(self) -> None:
        self.torch.cuda.synchronize(self.device)

    def _snapshot(self) -> dict:
        return self.torch.cuda.memory._snapshot()

    def live_blocks(self) -> List[Tuple[int, int, int]]:
        out = []
        for seg in self._snapshot()["segments"]:
            if seg.get("device") != self.device:
                continue
            addr = seg["address"]
            for b in seg["blocks"]:
                if b["state"] in ("active_allocated", "active_pending_free"):
                    out.append((addr, b.get("requested_size") or b["size"], seg["stream"]))
                addr += b["size"]
        return out

    def _events(self) -> list:
        traces = self._snapshot()["device_traces"]
        return traces[self.device] if self.device < len(traces) else []

    def start(self) -> None:
        m = self.torch.cuda.memory
        m._record_memory_history(enabled=None)
        kw = dict(context=None, stacks="python", max_entries=_HISTORY_ENTRIES)
        try:
            m._record_memory_history(clear_history=True, **kw)
        except TypeError:  # a torch without clear_history: skip what the history already holds
            m._record_memory_history(**kw)
        self.skip = len(self._events())

    def stop(self) -> List[Tuple[str, int, int, int]]:
        events = self._events()
        self.torch.cuda.memory._record_memory_history(enabled=None)
        if len(events) >= _HISTORY_ENTRIES:
            raise ForecastError(f"the step made more than {_HISTORY_ENTRIES} history events; record a smaller step")
        return [(e["action"], e["addr"], e["size"], e["stream"]) for e in events[self.skip :]]

    def capacity(self) -> int:
        free, total = self.torch.cuda.mem_get_info(self.device)
        fraction = getattr(self.torch.cuda, "get_per_process_memory_fraction", None)
        return int(total * (fraction(self.device) if fraction else 1.0))


def _recorder(heap, device):
    from ._C import Heap

    if heap is not None:
        if not isinstance(heap, Heap):
            raise TypeError(f"heap must be a gpumem.Heap, not {type(heap).__name__}")
        return _HeapRecorder(heap)
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        raise ForecastError(
            "no torch with CUDA in this process: pass heap=gpumem.Heap(...) for a step that drives a gpumem heap, "
            "or forecast from recorded traces (Forecast.from_traces, python -m gpumem forecast)"
        )
    from ._resolve import resolve_heap, torch_active

    if torch_active():
        return _TorchGpumemRecorder(resolve_heap(device), torch)
    return _TorchNativeRecorder(torch, device)


def _to_trace(name: str, live, events, granularity: int) -> Trace:
    """The blocks live before the step as allocations made first, then the step's events."""
    b = _Builder(name)
    for i, (addr, size, stream) in enumerate(live):
        b.alloc(addr, size, stream, f"live block {i}")
    try:
        for i, (action, addr, size, stream) in enumerate(events):
            if action == "alloc":
                b.alloc(addr, size, stream, i)
            elif action == "free_completed":
                b.free(addr, stream, i)
    except TraceError as e:
        raise ForecastError(f"the recorded history is inconsistent: {e.reason}") from None
    return b.finish("recorded", 0, {"size_granularity": granularity})


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
    warmup: unrecorded steps at each value before its recording, so that one-time
        allocations (optimizer state, library workspaces) happen outside it.
    steps: recorded steps per value (2 models the reuse between steps).
    reset: called after the warm-up, before each recording, e.g. to drop optimizer
        state (``opt.state.clear()``) so that each recording's first step makes it
        again, as the first step of a fresh run at that value does.
    multiple: the knob's granularity in the search for the largest value.
    """
    knobs = _check_knobs(knob)
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ForecastError(f"warmup must be a whole number of steps, not {warmup!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ForecastError(f"steps must be a positive whole number, not {steps!r}")
    rec = _recorder(heap, device)
    recordings = []
    for k in sorted(knobs):
        t0 = time.perf_counter()
        for _ in range(warmup):
            step(k)
        if reset is not None:
            reset()
        rec.sync()
        live = rec.live_blocks()
        rec.start()
        try:
            for _ in range(steps):
                step(k)
            rec.sync()
        finally:
            events = rec.stop()
        trace = _to_trace(f"{name}={k}", live, events, rec.granularity)
        recordings.append(Recording(k, trace, rec.granularity, time.perf_counter() - t0))
    cap = capacity if capacity is not None else rec.capacity()
    fc = Forecast(recordings, name=name, capacity=cap, at=at, multiple=multiple)
    _set_last(fc)
    return fc
