"""Lining recordings up event by event, and fitting each allocation's size
against the knob (the model gpumem.forecast synthesises traces from).

Recordings line up when they make the same allocations and frees in the same
order on the same streams, only of other sizes.  Programs add noise to that:
a reduction that needs a staging buffer only past some size, a library's
workspace at some shapes, another algorithm's temporaries past some size, a
block only the first step allocates.  Each recording is aligned with the next
larger one, and so with the one at the largest knob value, the template the
forecast follows, by a sequence alignment (gpumem.forecast.pairing): what both
make is paired, what only one makes is set aside.  The template's set-aside
allocations are kept, sized from the recordings that have them (a constant
where only it does); those only smaller values make are left out.  Recordings
that pair only after setting aside more than three quarters of their events,
or that differ in ways the alignment finds no way past (a stretch longer than
it sets aside in one piece), do not line up: that is reported with where they
first differ.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Dict, List, Optional, Sequence, Tuple

from .pairing import _Events, _Pairing
from .._units import format_size
from ..trace import R_ALLOC, Trace, TraceError, _Builder

# Sizes recorded by gpumem's history are its blocks' sizes, rounded up to this.
GPUMEM_GRANULARITY = 512
# The coarsest rounding a header may state: an allocator's 2 MiB segments.  A
# coarser one would pass every size change off as rounding (no fit at all).
MAX_GRANULARITY = 2 << 20
_MAX_SET_ASIDE = 0.75  # more than this share of a recording's events set aside: they do not line up


class ForecastError(ValueError):
    """Input a forecast cannot be made from (knob values, recordings); one line."""


@dataclass
class Recording:
    """One recorded step: the knob value it ran at and its allocation trace."""

    knob: int
    trace: Trace
    granularity: int = 1  # the recorded sizes are rounded up to a multiple of this
    seconds: float = 0.0  # how long recording it took
    # per event, the call site of the allocation it makes (0 for frees and where none is known), or None:
    # allocations at known, different sites are never paired
    sites: Optional[List[int]] = None
    # the event at which each recorded step begins (the first: after the blocks live before them)
    step_starts: Optional[List[int]] = None
    # recorded under torch's own allocator: the segments that held the blocks live before the step,
    # free blocks and all (gpumem.forecast.native_model.with_start), or None
    native_start: Optional[list] = None

    @staticmethod
    def granularity_of(trace: Trace) -> int:
        """What the trace's sizes are rounded to: gpumem's and torch's histories
        record their blocks' sizes, multiples of 512 bytes."""
        meta = trace.meta or {}
        g = meta.get("size_granularity")
        if g is not None:
            whole = isinstance(g, int) and not isinstance(g, bool)
            if not whole or not 1 <= g <= MAX_GRANULARITY:
                raise TraceError(
                    trace.path, 1, f"size_granularity must be a whole number of bytes from 1 to 2 MiB, not {g!r}"
                )
            return g
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
    events: int  # events of the template (the recording at the largest knob value)
    allocs: int
    message: str  # one line: what lines up, or where it stops
    # where two neighbouring recordings that do not line up first differ: an event of the larger (-1: none)
    first_difference: int = -1
    template: int = -1  # index of the template among the recordings (sorted by knob)
    # per recording: template allocation ordinal -> that recording's allocation ordinal (-1: it has none)
    maps: List[Optional[List[int]]] = field(default_factory=list, repr=False)
    set_aside: Dict[int, int] = field(default_factory=dict)  # knob -> its events set aside
    set_aside_bytes: Dict[int, int] = field(default_factory=dict)  # knob -> bytes its set-aside blocks held
    set_aside_allocs: Dict[int, int] = field(default_factory=dict)  # knob -> its allocations set aside
    # knob -> places where it and the template both set allocations aside (a code path that switches)
    switches: Dict[int, int] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        """Lined up event for event, nothing set aside."""
        return self.aligned and not any(self.set_aside.values())


def _exactly_alike(a: Trace, b: Trace) -> bool:
    """The same ops, slots (which block each free frees) and streams."""
    return a.n_events == b.n_events and a.words[0::3] == b.words[0::3] and a.words[2::3] == b.words[2::3]


def _aside_bytes(ev: _Events, aside: bytearray) -> int:
    """The most bytes the set-aside blocks held at once."""
    live = peak = 0
    for i in range(ev.n):
        o = ev.ordinal[i]
        if aside[o]:
            live += ev.size[i] if ev.is_alloc[i] else -ev.size[i]
            peak = max(peak, live)
    return peak


def _mismatch(lo: Recording, hi: Recording, p: _Pairing, fi: int, fj: int, name: str) -> Optional[str]:
    """Why two neighbouring recordings do not line up, in one line, or None if they do."""
    t_ev, r_ev = p.t, p.r
    a, b = f"{name} {lo.knob}", f"{name} {hi.knob}"
    counts = f"{r_ev.n} events at {a}, {t_ev.n} at {b}"
    if fi < 0:
        skipped_t, skipped_r = p.skipped()
        if max(skipped_r / max(r_ev.n, 1), skipped_t / max(t_ev.n, 1)) <= _MAX_SET_ASIDE:
            return None
        return (
            f"the recordings do not line up ({counts}): they pair only after setting aside "
            f"{skipped_r} events at {a} and {skipped_t} at {b}, too many to trust"
        )
    if fi >= t_ev.n or fj >= r_ev.n:
        longer = a if fj < r_ev.n else b
        where = f"they line up to event {min(fi, fj)}, then only {longer} goes on"
    elif fi == fj:
        where = f"they first differ at event {fi}: {r_ev.describe(fj)} at {a}, {t_ev.describe(fi)} at {b}"
    else:
        where = (
            f"they first differ at event {fj} at {a} ({r_ev.describe(fj)}) and event {fi} at {b} ({t_ev.describe(fi)})"
        )
    return f"the recordings do not line up ({counts}); {where}"


def _growth(lo: Recording, hi: Recording) -> float:
    """How much larger an allocation may be at hi's knob value than at lo's and
    still be taken for the same one: the square of their ratio, and a quarter
    more for sizes of a shifted knob (a convolution without padding: the square
    of 16 r - 2 at resolution r)."""
    return 1.25 * (hi.knob / lo.knob) ** 2


def align(recordings: Sequence[Recording], name: str = "knob") -> Alignment:
    """Line the recordings (sorted by knob) up, each with the next larger one,
    and so with the one at the largest value, the template: the same actions, in
    the same order, on the same streams, each free freeing the same allocation,
    up to allocations (and their frees) that only some recordings make (see the
    module docstring)."""
    n = len(recordings)
    ti = n - 1
    tmpl = recordings[ti]
    n_t, allocs = tmpl.trace.n_events, tmpl.trace.allocs
    maps: List[Optional[List[int]]] = [None] * n
    switches: Dict[int, int] = {}
    ev: List[Optional[_Events]] = [None] * n
    up: Optional[List[int]] = None  # the template's allocations -> those of the recording above x
    for x in range(n - 2, -1, -1):
        lo, hi = recordings[x], recordings[x + 1]
        if _exactly_alike(lo.trace, hi.trace):
            step = None
        else:
            ev[x + 1] = ev[x + 1] or _Events(hi.trace, hi.sites)
            ev[x] = _Events(lo.trace, lo.sites)
            p = _Pairing(ev[x + 1], ev[x], _growth(lo, hi))
            fi, fj = p.run()
            why = _mismatch(lo, hi, p, fi, fj, name)
            if why is not None:
                return Alignment(False, n_t, allocs, why, max(fi, 0), ti)
            step, switches[lo.knob] = p.t2r, p.switches
        here = list(range(allocs)) if up is None else list(up)
        if step is not None:
            here = [step[o] if o >= 0 else -1 for o in here]
        maps[x] = up = here
    aside, aside_bytes, aside_allocs = _left_out(recordings, maps, ev)
    knobs = ", ".join(str(r.knob) for r in recordings)
    msg = f"the recordings at {name} {knobs} line up: {n_t} events, {allocs} allocations"
    parts = [f"{v} at {name} {k}" for k, v in aside.items() if v]
    if parts:
        msg += f" (after setting aside events only some recordings make: {', '.join(parts)})"
    return Alignment(True, n_t, allocs, msg, -1, ti, maps, aside, aside_bytes, aside_allocs, switches)


def _left_out(recordings: Sequence[Recording], maps: List[Optional[List[int]]], ev: List[Optional[_Events]]):
    """Per knob value, the events, the most bytes at once, and the allocations
    set aside: the template's that some recording lacks (kept), the others'
    that the template lacks (left out)."""
    n = len(recordings)
    flags: List[Optional[bytearray]] = [None] * n
    partial = bytearray(recordings[-1].trace.allocs)
    for x in range(n - 1):
        if maps[x] is None:
            continue
        reached = bytearray(recordings[x].trace.allocs)
        for o, j in enumerate(maps[x]):
            if j >= 0:
                reached[j] = 1
            else:
                partial[o] = 1
        flags[x] = bytearray(1 - v for v in reached)
    flags[-1] = partial
    aside, aside_bytes, aside_allocs = {}, {}, {}
    for x, rec in enumerate(recordings):
        f = flags[x]
        k = rec.knob
        if f is None or not any(f):
            aside[k] = 0
            continue
        e = ev[x] or _Events(rec.trace)
        aside[k] = sum(1 for i in range(e.n) if f[e.ordinal[i]])
        aside_bytes[k] = _aside_bytes(e, f)
        aside_allocs[k] = sum(f)
    return aside, aside_bytes, aside_allocs


def last_step(rec: Recording) -> Optional[Recording]:
    """The recording's last step alone, the blocks earlier steps left live
    allocated first (in the order they were made); None with one step."""
    starts = rec.step_starts
    if not starts or len(starts) < 2:
        return None
    cut = starts[-1]
    ev = _Events(rec.trace)
    b = _Builder(f"{rec.trace.name} (last step)")
    old = [o for o in range(len(ev.alloc_at)) if ev.alloc_at[o] < cut and not 0 <= ev.free_at[o] < cut]
    sites = []
    for o in old:
        i = ev.alloc_at[o]
        b.alloc(o + 1, ev.size[i], ev.stream[i], f"live block {o}")
        sites.append(0)
    for i in range(cut, ev.n):
        o = ev.ordinal[i]
        if ev.is_alloc[i]:
            b.alloc(o + 1, ev.size[i], ev.stream[i], i)
        else:
            b.free(o + 1, ev.stream[i], i)
        sites.append(rec.sites[i] if rec.sites is not None and ev.is_alloc[i] else 0)
    t = b.finish("recorded", rec.trace.device, dict(rec.trace.meta or {}))
    return Recording(rec.knob, t, rec.granularity, rec.seconds, sites if any(sites) else None, [len(old)])


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


def fit_sizes(xs: Sequence[float], ys: Sequence[int], tolerance: float) -> Tuple[str, Tuple[float, float, float]]:
    """The kind ("constant", "linear", "quadratic") and coefficients of one size."""
    if all(y == ys[0] for y in ys):
        return "constant", (float(ys[0]), 0.0, 0.0)
    lin = _polyfit(xs, ys, 1)
    if len(xs) >= 3:
        worst = max(abs(lin[0] + lin[1] * x - y) for x, y in zip(xs, ys))
        if worst > tolerance:
            return "quadratic", _polyfit(xs, ys, 2)
    return "linear", lin


def evaluate(c: Tuple[float, float, float], k: float) -> int:
    v = c[0] + c[1] * k + c[2] * k * k
    return max(0, int(round(v)))


def modelled(model: "Model", alignment: Alignment, knobs: Sequence[int], name: str) -> str:
    """One line on what only some recordings make and how the forecast takes it."""
    top = knobs[alignment.template]
    parts = []
    for where, (n, size) in sorted(model.only.items()):
        if list(where) == [k for k in knobs if k >= where[0]]:
            at = f"{name} >= {where[0]}"
        else:
            at = f"{name} {', '.join(map(str, where))}"
        if len(where) == 1:
            how = f"held at {name} {top}'s size: record a larger {name} to fit it"
        else:
            how = "sized by a fit through those"
        parts.append(f"{_count(n, 'allocation')} only at {at} (up to {format_size(size)} each, {how})")
    for k in knobs:
        n = alignment.set_aside_allocs.get(k, 0)
        if k != top and n:
            parts.append(f"{_count(n, 'allocation')} only at {name} {k} left out (the forecast follows {name} {top})")
    switched = [k for k in knobs if alignment.switches.get(k)]
    if switched:
        k = switched[-1]
        above = min(v for v in knobs if v > k)
        parts.append(f"code paths switch at {_count(alignment.switches[k], 'place')} between {name} {k} and {above}")
    return "modelled: " + "; ".join(parts)


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


class Model:
    """Each allocation's size as a function of the knob, and the event skeleton
    (the template's) the synthesised traces share."""

    def __init__(self, recordings: Sequence[Recording], alignment: Alignment):
        tmpl = recordings[alignment.template]
        template = tmpl.trace
        self.template = template
        ev = _Events(template)
        self.ordinal = ev.ordinal
        self.is_alloc = ev.is_alloc
        self.n_allocs = len(ev.alloc_at)
        tolerance = max(0.5, float(max(r.granularity for r in recordings)))
        columns = []  # per recording: (knob, map, its allocation sizes)
        for x, r in enumerate(recordings):
            w = r.trace.words
            sizes = [w[3 * i + 1] for i in range(r.trace.n_events) if w[3 * i] & 0xFFFFFFFF == R_ALLOC]
            columns.append((float(r.knob), alignment.maps[x] if x != alignment.template else None, sizes))
        cache: Dict[tuple, Tuple[str, Tuple[float, float, float]]] = {}
        self.coefs: List[Tuple[float, float, float]] = []
        self.kinds: Dict[str, int] = {"constant": 0, "linear": 0, "quadratic": 0}
        self.partial = 0  # allocations not every recording makes
        # the knob values at which only some recordings make an allocation -> [how many, largest size]
        self.only: Dict[Tuple[int, ...], List[int]] = {}
        for o in range(self.n_allocs):
            pts = []
            for k, m, sizes in columns:
                j = o if m is None else m[o]
                if j >= 0:
                    pts.append((k, sizes[j]))
            if len(pts) < len(columns):
                self.partial += 1
                group = self.only.setdefault(tuple(int(p[0]) for p in pts), [0, 0])
                group[0] += 1
                group[1] = max(group[1], pts[-1][1])
            key = tuple(pts)
            got = cache.get(key)
            if got is None:
                got = cache[key] = fit_sizes([p[0] for p in pts], [p[1] for p in pts], tolerance)
            self.kinds[got[0]] += 1
            self.coefs.append(got[1])
        # distinct size functions: evaluating each once per knob value is what synthesis costs
        self.distinct = sorted(set(self.coefs))
        self.index = {c: i for i, c in enumerate(self.distinct)}
        self.which = [self.index[c] for c in self.coefs]
        # per event, where its signed size sits in sizes + their negations (frees count down)
        n = self.n_allocs
        self.signed_at = [o if a else o + n for o, a in zip(self.ordinal, self.is_alloc)]

    @property
    def knob_has_effect(self) -> bool:
        return self.kinds["linear"] + self.kinds["quadratic"] > 0

    def sizes(self, k: float) -> List[int]:
        values = [evaluate(c, k) for c in self.distinct]
        return list(map(values.__getitem__, self.which))

    def synthesise(self, k: float, name: str) -> Trace:
        per_alloc = self.sizes(k)
        words = array("Q", self.template.words)
        if self.ordinal:
            words[1::3] = array("Q", map(per_alloc.__getitem__, self.ordinal))
        signed = per_alloc + [-s for s in per_alloc]
        live = list(accumulate(map(signed.__getitem__, self.signed_at)))
        peak = max(live, default=0)
        peak, peak_event = (peak, live.index(peak)) if peak > 0 else (0, -1)
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
