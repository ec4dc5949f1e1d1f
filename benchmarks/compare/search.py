"""Searches that decide which probe to run next; they run nothing themselves.

Each probe on the GPU costs a fresh process (one to a few seconds), so the searches spend
probes carefully: they start from seeds (a guess taken from earlier measurements, bracketed by
a margin on each side), gallop away from the known bound when a seed lands on the wrong side,
and bisect once both sides are known.  They assume pass/fail is monotone in the probed value
and say so in the result when a probe contradicts that.

MinPassSearch: smallest capacity in which a replay passes (figure 1).
MaxPassSearch: largest batch that trains (figure 5).
"""

from __future__ import annotations

from typing import Iterable, List, Optional, Tuple


def align_down(x: int, a: int) -> int:
    return x - x % a


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


class MinPassSearch:
    """Smallest multiple of `align` in (fail_below, ceiling] that passes, to within `resolution`.

    `fail_below`: every value below it is known to fail (peak live: no allocator replays a trace
    in less than the bytes it holds at once).  `ceiling`: the largest value that can be probed;
    if it fails, there is no answer.  Seeds are probed first, in order, where they still tell
    something; `margin` is the first gallop step when a seed lands on the wrong side.
    """

    def __init__(
        self,
        fail_below: int,
        ceiling: int,
        resolution: int,
        align: int = 1,
        seeds: Iterable[int] = (),
        margin: Optional[int] = None,
    ):
        if align <= 0 or resolution <= 0:
            raise ValueError("align and resolution must be positive")
        if ceiling < fail_below:
            raise ValueError(f"ceiling {ceiling} is below the known failure bound {fail_below}")
        self.align = align
        self.resolution = max(resolution, align)
        self.ceiling = align_down(ceiling, align)
        # lo: largest value known (or proven) to fail; hi: smallest value seen to pass.
        self.lo = align_up(fail_below, align) - align
        self.lo_proven = False  # True once a probe failed (not just the theoretical bound)
        self.hi: Optional[int] = None
        self.seeds = [align_up(int(s), align) for s in seeds]
        self.margin = max(self.resolution, align_up(margin or self.resolution, align))
        self.up_step = self.margin
        self.down_step = self.margin
        self.probes: List[Tuple[int, bool]] = []
        self.nonmonotone = False
        self.exhausted = False  # the ceiling failed: no value passes

    # -- state ------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self.exhausted or (self.hi is not None and self.hi - self.lo <= self.resolution)

    def _open(self, v: int) -> bool:
        """v would tell something new."""
        return v > self.lo and (self.hi is None or v < self.hi) and v <= self.ceiling

    def next(self) -> Optional[int]:
        if self.done:
            return None
        while self.seeds:
            s = self.seeds.pop(0)
            if self._open(s):
                return s
        if self.hi is None:
            if self.lo >= self.ceiling:
                self.exhausted = True
                return None
            v = min(self.ceiling, align_up(self.lo + self.up_step, self.align))
            self.up_step *= 2
            return v
        if not self.lo_proven:
            # Only the theoretical bound below: walk down from the pass, doubling the step,
            # which costs few probes when the pass was close to the answer (a good seed).
            v = align_down(self.hi - self.down_step, self.align)
            self.down_step *= 2
            if self._open(v) and self.hi - v < (self.hi - self.lo) // 2:
                return v
        v = align_down((self.lo + self.hi) // 2, self.align)
        if not self._open(v):
            v = self.lo + self.align
            if not self._open(v):
                self.resolution = self.hi - self.lo  # nothing left between the bounds
                return None
        return v

    def record(self, value: int, ok: bool) -> None:
        self.probes.append((value, ok))
        if ok:
            if self.hi is not None and value > self.hi:
                return
            if value <= self.lo:
                self.nonmonotone = True  # passed below a proven failure: keep the smaller pass
                self.lo = align_down(value - 1, self.align) if value > self.align else 0
            self.hi = value
        else:
            if value >= self.ceiling:
                self.exhausted = self.hi is None
            if self.hi is not None and value >= self.hi:
                self.nonmonotone = True  # failed above a pass: the pass stands, note it
                return
            if value > self.lo:
                self.lo = value
                self.lo_proven = True

    def result(self) -> dict:
        return {
            "min_pass": self.hi,
            "max_fail": self.lo if self.lo_proven else None,
            "resolution_reached": (self.hi - self.lo) if self.hi is not None else None,
            "converged": self.done and not self.exhausted,
            "exhausted": self.exhausted,
            "nonmonotone": self.nonmonotone,
            "probes": [[v, ok] for v, ok in self.probes],
        }


class MaxPassSearch:
    """Largest integer in [1, ceiling] that passes (values above the answer fail)."""

    def __init__(self, ceiling: int, seeds: Iterable[int] = ()):
        if ceiling < 1:
            raise ValueError("ceiling must be at least 1")
        self.ceiling = ceiling
        self.lo = 0  # largest known pass (0: none yet)
        self.hi = ceiling + 1  # smallest known fail
        self.seeds = [int(s) for s in seeds]
        self.probes: List[Tuple[int, bool]] = []
        self.nonmonotone = False

    @property
    def done(self) -> bool:
        return self.hi - self.lo <= 1

    def next(self) -> Optional[int]:
        if self.done:
            return None
        while self.seeds:
            s = self.seeds.pop(0)
            if self.lo < s < self.hi:
                return s
        if self.hi == self.ceiling + 1 and self.lo > 0:
            return min(self.ceiling, self.lo * 2)  # gallop up while nothing failed
        return (self.lo + self.hi) // 2

    def record(self, value: int, ok: bool) -> None:
        self.probes.append((value, ok))
        if ok:
            if value >= self.hi:
                self.nonmonotone = True
                return
            self.lo = max(self.lo, value)
        else:
            if value <= self.lo:
                self.nonmonotone = True
                return
            self.hi = min(self.hi, value)

    def result(self) -> dict:
        return {
            "max_pass": self.lo or None,
            "min_fail": self.hi if self.hi <= self.ceiling else None,
            "converged": self.done,
            "nonmonotone": self.nonmonotone,
            "probes": [[v, ok] for v, ok in self.probes],
        }


def seeds_around(guess: int, margin: int) -> List[int]:
    """A pass candidate just above the guess, then a fail candidate just below it: when the guess
    is good, those two probes bracket the answer and bisection finishes it."""
    return [guess + margin, guess - margin]
