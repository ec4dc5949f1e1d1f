"""Lining recordings up event by event, and fitting each allocation's size
against the knob (the model gpumem.forecast synthesises traces from).

Recordings line up when they make the same allocations and frees in the same
order on the same streams, only of other sizes.  Programs add noise to that:
a reduction that needs a staging buffer only past some size, a workspace made
once, a block only the first step allocates.  Such events come as
*self-contained stretches*: allocations that are freed within the stretch (or
never), and frees only of those.  Where a recording holds such a stretch and
another does not, the stretch is set aside and the rest paired up: the
recording at the largest knob value is the template the forecast follows, its
stretches are kept (sized from the recordings that have them: a constant where
only it does), and those only smaller values make are left out.  Anything else
(a block that outlives others in one recording only, frees in another order)
is a misalignment, reported with where it is.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Dict, List, Optional, Sequence, Tuple

from ._units import format_size
from .trace import R_ALLOC, Trace, TraceError, _Builder

# Sizes recorded by gpumem's history are its blocks' sizes, rounded up to this.
GPUMEM_GRANULARITY = 512
# The coarsest rounding a header may state: an allocator's 2 MiB segments.  A
# coarser one would pass every size change off as rounding (no fit at all).
MAX_GRANULARITY = 2 << 20
_REWIND = 48  # matched events a resync may step back over
_RUN = 96  # the longest stretch set aside in one piece
_VERIFY = 256  # events a resync must line up beyond the mismatch (or up to the next one)
_MAX_SET_ASIDE = 0.5  # more than this share of a recording's events set aside: they do not line up


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
    first_difference: int = -1  # the template's first event that could not be paired (-1: none)
    template: int = -1  # index of the template among the recordings (sorted by knob)
    # per recording: template allocation ordinal -> that recording's allocation ordinal (-1: it has none)
    maps: List[Optional[List[int]]] = field(default_factory=list, repr=False)
    set_aside: Dict[int, int] = field(default_factory=dict)  # knob -> its events set aside
    set_aside_bytes: Dict[int, int] = field(default_factory=dict)  # knob -> bytes its set-aside blocks held

    @property
    def exact(self) -> bool:
        """Lined up event for event, nothing set aside."""
        return self.aligned and not any(self.set_aside.values())


class _Events:
    """A trace's events unpacked for pairing."""

    def __init__(self, trace: Trace, sites: Optional[List[int]] = None):
        w = trace.words
        self.site = sites if sites is not None and len(sites) == trace.n_events else None
        heads = w[0::3]
        self.n = len(heads)
        self.is_alloc = [h & 0xFFFFFFFF == R_ALLOC for h in heads]
        self.stream = w[2::3]
        self.size = w[1::3]
        self.ordinal = [0] * self.n  # the allocation an event makes or frees
        self.free_at: List[int] = []  # per allocation: the event freeing it (-1: never)
        self.alloc_at: List[int] = []  # per allocation: the event making it
        by_slot: Dict[int, int] = {}
        for i, h in enumerate(heads):
            if self.is_alloc[i]:
                o = by_slot[h >> 32] = len(self.alloc_at)
                self.alloc_at.append(i)
                self.free_at.append(-1)
            else:
                o = by_slot[h >> 32]
                self.free_at[o] = i
            self.ordinal[i] = o

    def describe(self, i: int) -> str:
        if i >= self.n:
            return "the end"
        op = "an alloc" if self.is_alloc[i] else "a free"
        return f"{op} of {format_size(self.size[i])} on stream {self.stream[i]}"

    def runs(self, start: int, aside: bytearray) -> List[int]:
        """Lengths of the self-contained stretches from `start`: every block
        they allocate is freed within (or never), every free is of such a block
        (or of one already set aside)."""
        out: List[int] = []
        open_: set = set()
        for q in range(start, min(self.n, start + _RUN)):
            o = self.ordinal[q]
            if self.is_alloc[q]:
                if self.free_at[o] >= 0:
                    open_.add(o)
            elif o in open_:
                open_.discard(o)
            elif not aside[o]:
                break
            if not open_:
                out.append(q + 1 - start)
        return out


class _Pairing:
    """Pairs the events of a recording R with the template T."""

    def __init__(self, t: _Events, r: _Events):
        self.t, self.r = t, r
        self.t2r = [-1] * len(t.alloc_at)
        self.r2t = [-1] * len(r.alloc_at)
        self.aside_t = bytearray(len(t.alloc_at))
        self.aside_r = bytearray(len(r.alloc_at))
        self.skipped_t = self.skipped_r = 0

    def _lockstep(self, i: int, j: int, limit: int, record: Optional[list]) -> Tuple[int, int, int, int]:
        """Pair events from (i, j) until a mismatch, both ends, or `limit` pairs;
        (i, j, pairs, sizes that shrink as the knob grows).  With `record`, the
        pairs are made (and appended to it); otherwise only tried."""
        t, r = self.t, self.r
        t2r = self.t2r
        tried: Dict[int, int] = {}
        pairs = shrinking = 0
        while pairs < limit:
            if i < t.n and not t.is_alloc[i] and self.aside_t[t.ordinal[i]]:
                i += 1
                continue
            if j < r.n and not r.is_alloc[j] and self.aside_r[r.ordinal[j]]:
                j += 1
                continue
            if i >= t.n or j >= r.n or t.is_alloc[i] != r.is_alloc[j] or t.stream[i] != r.stream[j]:
                break
            ot, orr = t.ordinal[i], r.ordinal[j]
            if t.is_alloc[i]:
                if t.site is not None and r.site is not None and t.site[i] and r.site[j] and t.site[i] != r.site[j]:
                    break  # made at different places in the program
                if t.size[i] < r.size[j]:
                    shrinking += 1
                if record is None:
                    tried[ot] = orr
                else:
                    t2r[ot] = orr
                    self.r2t[orr] = ot
                    record.append((i, j))
            elif (tried.get(ot, t2r[ot]) if record is None else t2r[ot]) != orr:
                break
            elif record is not None:
                record.append((i, j))
            i += 1
            j += 1
            pairs += 1
        return i, j, pairs, shrinking

    def _resync(self, i: int, j: int, trail: list) -> Optional[tuple]:
        """The best way past a mismatch at (i, j): step back over up to _REWIND
        paired events and set aside a stretch of T, of R, or one of each (a
        code path that differs) there."""
        t, r = self.t, self.r
        best = None
        points = [(i, j)] + [trail[-k] for k in range(1, min(_REWIND, len(trail)) + 1)]
        for back, (ti, rj) in enumerate(points):
            runs_t = [0] + (t.runs(ti, self.aside_t) if ti < t.n and t.is_alloc[ti] else [])
            runs_r = [0] + (r.runs(rj, self.aside_r) if rj < r.n and r.is_alloc[rj] else [])
            for lt in runs_t:
                for lr in runs_r:
                    if not lt and not lr:
                        continue
                    ei, ej, pairs, shrinking = self._lockstep(ti + lt, rj + lr, _VERIFY, None)
                    both_end = ei >= t.n and ej >= r.n
                    if (pairs == 0 and (lt and lr or not both_end)) or (not both_end and (ei <= i or ej <= j)):
                        continue  # lines nothing up past the mismatch (setting both sides aside must pair some)
                    key = (pairs, both_end, -shrinking, -(lt + lr), -back)
                    if best is None or key > best[0]:
                        best = (key, back, ti, rj, lt, lr)
        return best

    def run(self) -> Tuple[int, int]:
        """Pair everything; (-1, -1) when done, else where it got stuck."""
        i = j = 0
        trail: List[Tuple[int, int]] = []
        while True:
            i, j, _, _ = self._lockstep(i, j, 1 << 62, trail)
            if i >= self.t.n and j >= self.r.n:
                return -1, -1
            got = self._resync(i, j, trail)
            if got is None:
                return i, j
            _, back, ti, rj, lt, lr = got
            for _ in range(back):  # undo the pairs stepped back over
                q, _ = trail.pop()
                if self.t.is_alloc[q]:
                    o = self.t.ordinal[q]
                    self.r2t[self.t2r[o]] = -1
                    self.t2r[o] = -1
            for ev, aside, start, length in ((self.t, self.aside_t, ti, lt), (self.r, self.aside_r, rj, lr)):
                for q in range(start, start + length):
                    if ev.is_alloc[q]:
                        aside[ev.ordinal[q]] = 1
            self.skipped_t += lt
            self.skipped_r += lr
            i, j = ti + lt, rj + lr
            trail.clear()  # a resync never steps back over another


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


def align(recordings: Sequence[Recording], name: str = "knob") -> Alignment:
    """Line the recordings (sorted by knob) up against the one at the largest
    knob value: the same actions, in the same order, on the same streams, each
    free freeing the same allocation, up to self-contained stretches that only
    some recordings make (see the module docstring)."""
    ti = max(range(len(recordings)), key=lambda x: recordings[x].knob)
    tmpl = recordings[ti]
    n_t, allocs = tmpl.trace.n_events, tmpl.trace.allocs
    maps: List[Optional[List[int]]] = [None] * len(recordings)
    aside: Dict[int, int] = {}
    aside_bytes: Dict[int, int] = {}
    t_ev: Optional[_Events] = None
    t_aside = bytearray(allocs)
    for x, rec in enumerate(recordings):
        if x == ti:
            continue
        if _exactly_alike(rec.trace, tmpl.trace):
            maps[x] = list(range(allocs))
            aside[rec.knob] = 0
            continue
        t_ev = t_ev or _Events(tmpl.trace, tmpl.sites)
        r_ev = _Events(rec.trace, rec.sites)
        p = _Pairing(t_ev, r_ev)
        fi, fj = p.run()
        a, b = f"{name} {rec.knob}", f"{name} {tmpl.knob}"
        counts = f"{r_ev.n} events at {a}, {n_t} at {b}"
        if fi < 0 and max(p.skipped_r / max(r_ev.n, 1), p.skipped_t / max(n_t, 1)) > _MAX_SET_ASIDE:
            msg = (
                f"the recordings do not line up ({counts}): they pair only after setting aside "
                f"{p.skipped_r} events at {a} and {p.skipped_t} at {b}, too many to trust"
            )
            return Alignment(False, n_t, allocs, msg, 0, ti)
        if fi >= 0:
            if fi >= n_t or fj >= r_ev.n:
                longer = a if fj < r_ev.n else b
                where = f"they line up to event {min(fi, fj)}, then only {longer} goes on"
            elif fi == fj:
                where = f"they first differ at event {fi}: {r_ev.describe(fj)} at {a}, {t_ev.describe(fi)} at {b}"
            else:
                where = (
                    f"they first differ at event {fj} at {a} ({r_ev.describe(fj)}) and event {fi} at {b} "
                    f"({t_ev.describe(fi)})"
                )
            return Alignment(False, n_t, allocs, f"the recordings do not line up ({counts}); {where}", fi, ti)
        maps[x] = p.t2r
        aside[rec.knob] = p.skipped_r
        aside_bytes[rec.knob] = _aside_bytes(r_ev, p.aside_r)
        for o, v in enumerate(p.aside_t):
            t_aside[o] |= v
    aside[tmpl.knob] = 0
    if t_ev is not None and any(t_aside):
        aside[tmpl.knob] = sum(1 for i in range(t_ev.n) if t_aside[t_ev.ordinal[i]])
        aside_bytes[tmpl.knob] = _aside_bytes(t_ev, t_aside)
    knobs = ", ".join(str(r.knob) for r in recordings)
    msg = f"the recordings at {name} {knobs} line up: {n_t} events, {allocs} allocations"
    parts = [f"{v} at {name} {k}" for k, v in aside.items() if v]
    if parts:
        msg += f" (after setting aside events only some recordings make: {', '.join(parts)})"
    return Alignment(True, n_t, allocs, msg, -1, ti, maps, aside, aside_bytes)


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
        for o in range(self.n_allocs):
            pts = []
            for k, m, sizes in columns:
                j = o if m is None else m[o]
                if j >= 0:
                    pts.append((k, sizes[j]))
            if len(pts) < len(columns):
                self.partial += 1
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
