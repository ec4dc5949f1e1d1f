"""The truth for benchmarks/gpu_forecast.py: the largest knob value that runs, found by a search with
real steps, and the scheduler that shares one GPU between many searches.

A search is independent of the forecast: it doubles from twice the largest recorded value until a
value does not run, then bisects (halving down first where even the start does not run).  Each probe
is a fresh process; a search's time is the sum of its probes' wall times, what a user searching one
crash at a time waits.  Many searches run at once, `Slots` probes at a time: a free slot goes first to
a forecast, then to the search that has used the least probe time so far, so that every search
progresses.  No probe starts after the budget's deadline; one running then may finish.  Probes that
an earlier run made (same model, allocator, device and cap) answer their values without a run.

Near the limit, whether a step fits torch's allocator can change from one value to the next (bert at
sequence 544 runs, 560 does not, 576 does).  So the truth is settled as the forecast settles its answer
(gpumem.forecast.Forecast.largest): the bisection's value counts only when the values from an eighth
below it up to it run too (at most SETTLE_PROBES of them, evenly spread, probed at once); past the
first that does not, the truth drops below it and is settled again.  A search's time ("search_s") is
the doubling and bisection's, what a user searching waits; the settling's probes are counted apart
("settle_s").
"""

import heapq
import itertools
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

GiB = 1 << 30
FORECAST_FIRST = -1.0  # a forecast's priority: before any probe
SETTLE_BELOW = 0.125  # as gpumem.forecast's: the values from an eighth below the answer must run too
SETTLE_PROBES = 8  # at most this many of them probed (evenly spread), at once


class OutOfBudget(Exception):
    pass


def default_jobs(free_bytes, cap_bytes, cpus):
    """Processes at once: as many as the device's free memory holds at the cap each (1.5 GiB more each
    for CUDA's context and what lies outside the allocator, 2 GiB kept free), at most two fewer than
    the CPUs (a probe's start is mostly Python importing), at least one."""
    fit = int((free_bytes - 2 * GiB) // (cap_bytes + 1.5 * GiB))
    return max(1, min(fit, max(1, cpus - 2)))


class Slots:
    """At most `n` holders at once; a free slot goes to the waiter with the lowest priority value
    (first come first among equals)."""

    def __init__(self, n):
        self.n = n
        self.busy = 0
        self.most = 0  # the most holders there were at once
        self._cv = threading.Condition()
        self._waiting = []
        self._order = itertools.count()

    @contextmanager
    def slot(self, priority):
        with self._cv:
            me = (priority, next(self._order))
            heapq.heappush(self._waiting, me)
            while self.busy >= self.n or self._waiting[0] != me:
                self._cv.wait()
            heapq.heappop(self._waiting)
            self.busy += 1
            self.most = max(self.most, self.busy)
            self._cv.notify_all()  # the next waiter may take another free slot
        try:
            yield
        finally:
            with self._cv:
                self.busy -= 1
                self._cv.notify_all()


def _answered(k, known):
    """An earlier run's probe at k, marked as reused (its wall time still counts in the search's)."""
    p = (known or {}).get(k)
    return None if p is None else dict(p, reused=True)


class _Prober:
    """One search's probes: each in a slot at the search's priority (the probe time it used so far),
    none started after the deadline, a probe that found the device itself full (not the cap) run again."""

    def __init__(self, run_probe, slots, deadline, known, log, retries=2):
        self.run_probe, self.slots, self.deadline = run_probe, slots, deadline
        self.known, self.log, self.retries = known, log, retries
        self.probes = []
        self.used = 0.0  # this run's probe seconds
        self._lock = threading.Lock()

    def __call__(self, k):
        r = _answered(k, self.known)
        for _ in range(self.retries + 1):
            if r is not None and not r.get("device_full"):
                break
            with self.slots.slot(self.used):
                if time.monotonic() >= self.deadline:
                    raise OutOfBudget
                t0 = time.monotonic()
                r = self.run_probe(k)
                with self._lock:
                    self.used += time.monotonic() - t0
        with self._lock:
            self.probes.append(r)
        what = "fits" if r["ok"] else ("CRASHED" if r.get("crashed") else "OOM")
        self.log(f"{k}: {what} ({r['wall_s']:.1f} s{', an earlier run' if r.get('reused') else ''})")
        return r["ok"]


def search(recorded, multiple, run_probe, slots, deadline, log=print, known=None):
    """The largest value that runs (see the module's docstring).  run_probe(k) runs one probe and returns
    its dict ("k", "ok", "wall_s"; "crashed" or "device_full" where so), or raises OutOfBudget where it
    ran out of time; known: {k: probe} from an earlier run."""
    m = multiple
    probe = _Prober(run_probe, slots, deadline, known, log)
    lo = hi = None
    complete = True
    try:
        k = 2 * max(recorded)
        while True:
            if probe(k):
                lo, k = k, 2 * k
            else:
                hi = k
                break
        if lo is None:  # even the start failed: halve down
            k = hi // 2 // m * m
            while k >= m:
                if probe(k):
                    lo = k
                    break
                hi, k = k, k // 2 // m * m
            lo = lo or 0
        while hi - lo > m:
            mid = (lo + hi) // 2 // m * m
            if mid <= lo:
                break
            if probe(mid):
                lo = mid
            else:
                hi = mid
    except OutOfBudget:
        complete = False
    bisected, searched = lo, len(probe.probes)
    if complete and lo:
        try:
            lo = settle(lo, m, probe)
        except OutOfBudget:  # settled only in part: below the lowest value found not to run
            complete = False
            lo = min([lo] + [p["k"] - m for p in probe.probes if not p["ok"] and p["k"] < lo])
    probes = probe.probes
    at_truth = next((p for p in probes if p["ok"] and p["k"] == lo), None)
    return {
        "largest": lo,
        "bisected": bisected,
        "first_oom": hi,
        "complete": complete,
        "search_s": sum(p["wall_s"] for p in probes[:searched]),
        "settle_s": sum(p["wall_s"] for p in probes[searched:]),
        "run_s": probe.used,
        "reused_probes": sum(1 for p in probes if p.get("reused")),
        "probes": probes,
        "measured_peak_allocated": at_truth.get("peak_allocated") if at_truth else None,
        "measured_peak_reserved": at_truth.get("peak_reserved") if at_truth else None,
    }


def settle(k, m, probe):
    """The largest j <= k (a multiple of m) such that j and the values from SETTLE_BELOW below it up to
    it run (at most SETTLE_PROBES of them, evenly spread, probed at once; a value already probed answers
    from its probe)."""
    seen = {p["k"]: p["ok"] for p in probe.probes}
    j = k // m
    while j >= 1:
        lo = max(1, int(j * (1 - SETTLE_BELOW)))
        stride = max(1, -(-(j - lo) // SETTLE_PROBES))
        ks = [i * m for i in [*range(lo, j, stride), j]]
        todo = [v for v in ks if v not in seen]
        if todo:
            with ThreadPoolExecutor(len(todo)) as ex:
                seen.update(zip(todo, ex.map(probe, todo)))
        bad = next((v for v in ks if not seen[v]), None)
        if bad is None:
            return j * m
        j = bad // m - 1
    return 0


def known_probes(earlier, name, allocator, device, cap):
    """{k: probe} of an earlier run's JSON (gpu_forecast.py --out) for one search; an earlier run on
    another device or at another cap answers nothing (ValueError)."""
    if earlier.get("device") != device or earlier.get("cap_bytes") != cap:
        raise ValueError(
            f"the earlier run was on {earlier.get('device')!r} at a cap of {earlier.get('cap_bytes')} bytes, "
            f"not {device!r} at {cap}"
        )
    t = earlier.get("models", {}).get(name, {}).get("truth", {}).get(allocator, {})
    return {p["k"]: p for p in t.get("probes", []) if not p.get("crashed") and not p.get("device_full")}


def load_earlier(path):
    """An earlier run's JSON (gpu_forecast.py --out), checked; ValueError with one line where it is not."""
    try:
        with open(path) as f:
            earlier = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--resume {path}: {e}") from None
    if not isinstance(earlier, dict) or not isinstance(earlier.get("models"), dict):
        raise ValueError(f"--resume {path}: not gpu_forecast.py's JSON (no models)")
    return earlier
