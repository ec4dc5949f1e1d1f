"""Pairing the events of two recordings of one step: a sequence alignment
over (allocation or free, stream, call site) with sizes free to differ.

The recording at the larger knob value is the template T, the other R.  Both
are walked in step, event against event.  An allocation of R pairs with one
of T made on the same stream, at the same call site where both know theirs, no
smaller and at most `growth` times larger (other sizes are taken as another
block), living through a like number of other allocations (_LIFE); a free
pairs with the free of the allocation it was paired with.  Where they stop
pairing, the alignment weighs the ways on: set aside a stretch of T's
allocations (made only at the larger value: a library's workspace, another
algorithm's temporaries), a stretch of R's (made only at the smaller value),
one of each (a code path that switches between the two values), or, where
both free blocks they share in another order, the pairing of one of them.  A
set-aside allocation takes its free with it wherever that comes, so a block
may outlive blocks both recordings make.  A way may also step back over up to
_REWIND pairs made since the last such choice.

Each way is judged by the pairs it makes in the next _VERIFY events of T, less
_PAIRS per unit of its cost: an edit distance over a window, which keeps a
dense run of differences from being read as one long shifted match.  Each
allocation set aside costs one, a long-lived one two, a self-contained stretch
(whose blocks are freed within it) less, and a way that sets aside what a way
taken before did (the same layer again) one.  Where differences come so densely
that even the best way pairs few events before the next, the best few are
judged with the best way past that one added.  Walking in step makes
recordings that are mostly alike cost one pass; ways are only weighed where
they differ, the cheapest first, and dearer ones not at all once they cannot
win.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

from .._units import format_size
from ..trace import R_ALLOC, Trace

_REWIND = 24  # matched events a resync may step back over
_RUN = 96  # the longest stretch of one recording set aside in one piece
_BOTH = 12  # stretches of each recording tried together at one place (a switch of code path)
_VERIFY = 64  # events of T past a mismatch whose pairs a way past it is judged by
_PAIRS = 8  # pairs past a difference that setting one allocation aside must buy
_CLOSED = 3  # allocations a self-contained stretch set aside in one piece costs less (down to one)
_UNPAIR = 2 * _BOTH  # what unpairing a block both make costs, in allocations set aside
_LIFE = 4  # allocations made while a block lives that may differ between two it pairs (or a third of them)
_SLACK = 64 * 1024  # bytes by which a small allocation may grow past the growth allowed
_NONE = (0, 0, 0, 0)  # two empty ranges of allocations
_DENSE = 16  # where the best way pairs fewer events than this before the next difference ...
_AHEAD = 6  # ... the best this many are judged with the best way past that difference added


def _cost(t: "_Events", xt: tuple, r: "_Events", xr: tuple, closed: bool) -> int:
    """What setting aside the allocations of the ranges xt (of T) and xr (of
    R; of each, the first of its two) costs: one per allocation, two where it outlives _LIFE allocations (a
    block that lives long, an activation, is more likely one both make than a
    workspace or a temporary is); a self-contained stretch _CLOSED less, down
    to one."""
    n = t.weight[xt[1]] - t.weight[xt[0]] + r.weight[xr[1]] - r.weight[xr[0]]
    return max(1, n - _CLOSED) if closed else n


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
        self.allocs_before = [0] * (self.n + 1)  # per event: the allocations made before it
        by_slot: Dict[int, int] = {}
        for i, h in enumerate(heads):
            self.allocs_before[i] = len(self.alloc_at)
            if self.is_alloc[i]:
                o = by_slot[h >> 32] = len(self.alloc_at)
                self.alloc_at.append(i)
                self.free_at.append(-1)
            else:
                o = by_slot[h >> 32]
                self.free_at[o] = i
            self.ordinal[i] = o
        self.allocs_before[self.n] = len(self.alloc_at)
        # per allocation: how many allocations are made while it lives (to the end where never freed)
        ab, end = self.allocs_before, len(self.alloc_at)
        self.life = [(ab[f] if f >= 0 else end) - ab[a] - 1 for a, f in zip(self.alloc_at, self.free_at)]
        self.weight = [0]  # per allocation ordinal: what setting aside those before it costs (_cost)
        for n in self.life:
            self.weight.append(self.weight[-1] + (2 if n > _LIFE else 1))

    def describe(self, i: int) -> str:
        if i >= self.n:
            return "the end"
        op = "an alloc" if self.is_alloc[i] else "a free"
        return f"{op} of {format_size(self.size[i])} on stream {self.stream[i]}"

    def stretches(self, start: int, aside: bytearray, longest: int = _RUN) -> List[int]:
        """Lengths of the stretches from `start` that can be set aside, each
        ending at an allocation: allocations, and frees only of blocks made
        within the stretch (or already set aside).  A block made within may be
        freed past its end: its free is set aside with it."""
        out: List[int] = []
        first = self.allocs_before[start] if start < self.n else 0
        for q in range(start, min(self.n, start + longest)):
            o = self.ordinal[q]
            if self.is_alloc[q]:
                out.append(q + 1 - start)
            elif o < first and not aside[o]:
                break
        return out

    def closed(self, start: int, aside: bytearray) -> set:
        """Where the self-contained stretches from `start` end, as allocation
        ordinals: every block they make is freed within (or never), every free
        is of such a block (or of one already set aside)."""
        out = set()
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
                out.add(self.allocs_before[q + 1])
        return out

    def allocs_in(self, start: int, length: int) -> tuple:
        """The allocations made by events [start, start + length): a range of
        ordinals, and an empty second one (ways are tried with two)."""
        return self.allocs_before[start], self.allocs_before[start + length], 0, 0


class _Pairing:
    """Pairs the events of a recording R with the template T (see the module)."""

    def __init__(self, t: _Events, r: _Events, growth: float = math.inf):
        self.t, self.r = t, r
        self.growth = growth  # how many times larger an allocation of T may be than the one of R it pairs with
        self.t2r = [-1] * len(t.alloc_at)
        self.r2t = [-1] * len(r.alloc_at)
        self.aside_t = bytearray(len(t.alloc_at))
        self.aside_r = bytearray(len(r.alloc_at))
        self.switches = 0  # places where both recordings set allocations aside
        self.seen: set = set()  # the sizes of what each way taken set aside (_signature)
        self.shapes: set = set()  # how many allocations of T and of R each way taken set aside

    def _lockstep(self, i, j, until, record: Optional[list], xt=_NONE, xr=_NONE, past=0, tried=None):
        """Pair events from (i, j) until a mismatch, both ends, or T's event
        `until`; (i, j, pairs made from T's event `past` on, the pairs tried).
        With `record`, the pairs are made (and appended to it); otherwise only
        tried (beside those of `tried`), with the allocations of the two ranges
        each of `xt` (of T) and `xr` (of R) taken as set aside."""
        t, r = self.t, self.r
        t2r, aside_t, aside_r = self.t2r, self.aside_t, self.aside_r
        tried = {} if tried is None else tried
        pairs = 0
        growth = self.growth
        both_sites = t.site is not None and r.site is not None
        while i < until:
            if i < t.n and not t.is_alloc[i]:
                o = t.ordinal[i]
                if aside_t[o] or xt[0] <= o < xt[1] or xt[2] <= o < xt[3]:
                    i += 1
                    continue
            if j < r.n and not r.is_alloc[j]:
                o = r.ordinal[j]
                if aside_r[o] or xr[0] <= o < xr[1] or xr[2] <= o < xr[3]:
                    j += 1
                    continue
            if i >= t.n or j >= r.n or t.is_alloc[i] != r.is_alloc[j] or t.stream[i] != r.stream[j]:
                break
            ot, orr = t.ordinal[i], r.ordinal[j]
            if t.is_alloc[i]:
                if both_sites and t.site[i] and r.site[j] and t.site[i] != r.site[j]:
                    break  # made at different places in the program
                if not r.size[j] <= t.size[i] <= r.size[j] * growth + _SLACK:
                    break  # smaller at the larger value, or far larger: taken as another block
                a, b = t.life[ot], r.life[orr]
                if abs(a - b) > max(_LIFE, (a + b) >> 1):
                    break  # lives through far more (or fewer) allocations: taken as another block
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
            pairs += i >= past
            i += 1
            j += 1
        return i, j, pairs, tried

    def _ways(self, i: int, j: int, trail: list) -> list:
        """The ways past a mismatch at (i, j) to try, cheapest first: (cost,
        back, ti, rj, lt, lr, T's allocations set aside, R's), the last two as
        ranges of ordinals.  Each allocation set aside costs one (a
        self-contained stretch, a made-and-dropped temporary or another
        algorithm's, goes as one: _CLOSED less, down to one); unpairing a block
        both make, a last resort, costs _UNPAIR."""
        t, r = self.t, self.r
        out = []
        for back in range(min(_REWIND, len(trail)) + 1):
            ti, rj = (i, j) if back == 0 else trail[-back]
            st = [(lt, t.allocs_in(ti, lt)) for lt in t.stretches(ti, self.aside_t)]
            sr = [(lr, r.allocs_in(rj, lr)) for lr in r.stretches(rj, self.aside_r)]
            ct, cr = t.closed(ti, self.aside_t), r.closed(rj, self.aside_r)
            for lt, xt in st:
                out.append((_cost(t, xt, r, _NONE, xt[1] in ct), back, ti, rj, lt, 0, xt, _NONE))
            for lr, xr in sr:
                out.append((_cost(t, _NONE, r, xr, xr[1] in cr), back, ti, rj, 0, lr, _NONE, xr))
            for lt, xt in st[:_BOTH]:
                for lr, xr in sr[:_BOTH]:
                    out.append((_cost(t, xt, r, xr, xt[1] in ct and xr[1] in cr), back, ti, rj, lt, lr, xt, xr))
        # frees of blocks both made, in another order: unpair the block freed on either side
        for side, ev, at in ((0, t, i), (1, r, j)):
            if at < ev.n and not ev.is_alloc[at]:
                o = ev.ordinal[at]
                ot, orr = (o, self.t2r[o]) if side == 0 else (self.r2t[o], o)
                if ot >= 0 and orr >= 0:
                    out.append((_UNPAIR, 0, i, j, 0, 0, (ot, ot + 1, 0, 0), (orr, orr + 1, 0, 0)))
        if self.seen:  # a way like one taken before (the same layer again) costs one
            shapes = self.shapes
            for n, w in enumerate(out):
                xt, xr = w[6], w[7]
                if w[0] > 1 and (xt[1] - xt[0], xr[1] - xr[0]) in shapes and self._signature(xt, xr) in self.seen:
                    out[n] = (1, *w[1:])
        out.sort(key=lambda w: w[0])
        return out

    def _resync(self, i: int, j: int, trail: list) -> Optional[tuple]:
        """The best way past a mismatch at (i, j): the most pairs past it in
        the _VERIFY events of T after what it sets aside, less _PAIRS per unit
        of cost; where even the best pairs few (differences come densely), the
        best _AHEAD judged with the best way past the next difference added; or
        None."""
        t, r = self.t, self.r
        got = []
        best = None  # the best score so far
        for cost, back, ti, rj, lt, lr, xt, xr in self._ways(i, j, trail):
            if best is not None and _VERIFY - _PAIRS * cost < best:
                break  # dearer ways cannot do better
            ei, ej, pairs, tried = self._lockstep(ti + lt, rj + lr, max(i, ti + lt) + _VERIFY, None, xt, xr, i)
            both_end = ei >= t.n and ej >= r.n
            if not (both_end or pairs and ei > i and ej > j) or (lt and lr and not pairs):
                continue  # lines nothing up past the mismatch (setting both sides aside must pair some)
            score = pairs - _PAIRS * cost
            best = score if best is None else max(best, score)
            got.append(((score, both_end, -back), (back, ti, rj, lt, lr, xt, xr), (ei, ej, tried), pairs))
        if not got:
            return None
        got.sort(key=lambda g: g[0], reverse=True)  # stable: of equal ways, the cheapest
        (_, both_end, _), way, _, pairs = got[0]
        if both_end or pairs >= _DENSE:
            return way
        ahead = [(g[0][0] + self._next(*g[1][5:], *g[2]), -n) for n, g in enumerate(got[:_AHEAD])]
        return got[-max(ahead)[1]][1]

    def _next(self, xt, xr, i: int, j: int, tried: dict) -> int:
        """The best score (_resync's, first level) of a way past the difference
        at (i, j) that a way setting aside xt and xr leads to."""
        t, r = self.t, self.r
        if i >= t.n and j >= r.n:
            return 0
        best = -_PAIRS * _UNPAIR
        st = [(lt, t.allocs_in(i, lt)) for lt in t.stretches(i, self.aside_t, _BOTH)][:_BOTH]
        sr = [(lr, r.allocs_in(j, lr)) for lr in r.stretches(j, self.aside_r, _BOTH)][:_BOTH]
        ways = [(lt, 0, a, _NONE) for lt, a in st] + [(0, lr, _NONE, b) for lr, b in sr]
        ways += [(lt, lr, a, b) for lt, a in st[: _BOTH // 2] for lr, b in sr[: _BOTH // 2]]
        for lt, lr, a, b in ways:
            cost = _cost(t, a, r, b, False)
            if _VERIFY - _PAIRS * cost <= best:
                continue
            ei, ej, pairs, _ = self._lockstep(
                i + lt, j + lr, i + lt + _VERIFY, None, (*xt[:2], *a[:2]), (*xr[:2], *b[:2]), i, dict(tried)
            )
            if ei >= t.n and ej >= r.n or pairs and ei > i and ej > j:
                best = max(best, pairs - _PAIRS * cost)
        return best

    def _signature(self, xt, xr) -> Optional[tuple]:
        """The sizes of the allocations a way sets aside, in T and in R (None: too many)."""
        if xt[1] - xt[0] + xr[1] - xr[0] > 2 * _BOTH:
            return None
        t, r = self.t, self.r
        return (
            tuple(t.size[t.alloc_at[o]] for o in range(xt[0], xt[1])),
            tuple(r.size[r.alloc_at[o]] for o in range(xr[0], xr[1])),
        )

    def _undo(self, trail: list, back: int) -> None:
        """Undo the last `back` pairs made."""
        for _ in range(back):
            q, _ = trail.pop()
            if self.t.is_alloc[q]:
                o = self.t.ordinal[q]
                self.r2t[self.t2r[o]] = -1
                self.t2r[o] = -1

    def run(self) -> Tuple[int, int]:
        """Pair everything; (-1, -1) when done, else where they first differ
        (in T, in R) where no way past a difference was found."""
        i = j = 0
        trail: List[Tuple[int, int]] = []
        first = None
        while True:
            i, j, _, _ = self._lockstep(i, j, 1 << 62, trail)
            if i >= self.t.n and j >= self.r.n:
                return -1, -1
            first = first or (i, j)
            got = self._resync(i, j, trail)
            if got is None:
                return first
            back, ti, rj, lt, lr, xt, xr = got
            self._undo(trail, back)
            for o in range(xt[0], xt[1]):
                if self.t2r[o] >= 0:
                    self.r2t[self.t2r[o]] = -1
                    self.t2r[o] = -1
                self.aside_t[o] = 1
            for o in range(xr[0], xr[1]):
                if self.r2t[o] >= 0:
                    self.t2r[self.r2t[o]] = -1
                    self.r2t[o] = -1
                self.aside_r[o] = 1
            if xt[1] > xt[0] and xr[1] > xr[0]:
                self.switches += 1
            sig = self._signature(xt, xr)
            if sig is not None:
                self.seen.add(sig)
                self.shapes.add((xt[1] - xt[0], xr[1] - xr[0]))
            i, j = ti + lt, rj + lr
            trail.clear()  # a resync never steps back over another

    def skipped(self) -> Tuple[int, int]:
        """Events set aside: (in T, in R)."""
        t, r = self.t, self.r
        return (
            sum(1 for i in range(t.n) if self.aside_t[t.ordinal[i]]),
            sum(1 for i in range(r.n) if self.aside_r[r.ordinal[i]]),
        )
