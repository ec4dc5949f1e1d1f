"""Fault injection on every device call.

For each device op and several positions of the failing call, a workload walks
the slow paths (growth, small-page packing, defragmentation under a small
capacity, empty_cache, set_cap, events for record_stream and held streams).
Whatever fails must surface as OutOfMemoryError or DeviceError, or be absorbed;
afterwards the heap must pass check(), every live block must still be mapped,
and once everything is freed nothing may be left on the device.
"""

import re

import pytest

import gpumem
from gpumem import _C
from helpers import MiB, PAGE, assert_ok, drain_and_assert_empty

OPS = _C.DEVICE_OPS  # every call a device can be asked to make (device.h)
CAPACITY = 64 * MiB
S1, S2 = 0x1000, 0x2000
EXPECTED = (gpumem.OutOfMemoryError, gpumem.DeviceError)


class Run:
    """Workload state: live pointers, what went wrong along the way, and a log
    of every step's outcome ("ok" or the error's type) with the device calls of
    `watch` made so far, to compare a faulty run with a clean one."""

    def __init__(self, h, watch=None):
        self.h = h
        self.live = []
        self.errors = []
        self.watch = watch
        self.log = []  # (step name, outcome, calls of `watch` after the step)

    def step(self, fn, *args, **kw):
        outcome = "ok"
        try:
            return fn(*args, **kw)
        except EXPECTED as exc:
            assert str(exc), "error without a message"
            if isinstance(exc, gpumem.OutOfMemoryError):
                assert str(exc).startswith("CUDA out of memory.")
            self.errors.append(exc)
            outcome = type(exc).__name__
            return None
        finally:
            # Every failure must leave the heap consistent, right away.
            assert_ok(self.h)
            name = f"{len(self.log)}:{fn.__name__}{args[:1] if args else ''}"
            self.log.append((name, outcome, self.h.sim_calls(self.watch) if self.watch else 0))

    def malloc(self, size, stream=0, pool=None):
        p = self.step(self.h.malloc, size, stream=stream, pool=pool)
        if p is not None:
            assert self.h.sim_is_accessible(p, self.h.block_size(p))
            self.live.append(p)
        return p

    def free(self, p):
        self.step(self.h.free, p)
        # A device error during a free must not leave the block half-freed: it
        # is either still live (and stays ours) or gone.
        if self.h.block_size(p) == 0:
            self.live.remove(p)


def workload(run):
    h = run.h
    # Growth and small-page packing.
    for size in (3 * MiB, 700, 4096, 5 * MiB, 100_000, PAGE, 1):
        run.malloc(size)
    # Events: blocks used on a side stream, freed while it runs and after.
    p = run.malloc(MiB + 512)
    if p is not None:
        run.step(h.record_stream, p, S2)
        h.sim_hold_stream(S2, True)
        run.free(p)
    for size in (PAGE, 3000, 5 * MiB):
        q = run.malloc(size, stream=S1)
        if q is not None:
            run.step(h.record_stream, q, S2)
            run.step(h.record_stream, q, 0)
            run.free(q)
    for _ in range(2):
        run.malloc(MiB + 512, stream=S1)  # must not take p's range while S2 is held
    h.sim_hold_stream(S2, False)
    run.malloc(MiB + 512)
    # Give everything back, so that the pages below start on page boundaries:
    # freeing every other one then leaves wholly free pages to remap.
    for p in list(run.live):
        run.free(p)
    run.step(h.empty_cache)
    # Fill the small device with pages, punch holes, ask for a large block:
    # defragmentation remaps pages (and an over-large request OOMs, which reads
    # mem_info/processes for the report).
    pages = [run.malloc(PAGE) for _ in range(CAPACITY // PAGE)]
    for p in pages[::2]:
        if p is not None:
            run.free(p)
    run.malloc(12 * MiB)
    run.malloc(CAPACITY)
    run.step(h.empty_cache)
    # Cap below what is held releases pages; then growth under the cap.
    run.step(h.set_cap, 24 * MiB)
    run.malloc(4 * MiB)
    run.step(h.set_cap, 0)
    for p in list(run.live)[::3]:
        run.free(p)
    run.malloc(16 * MiB)
    run.step(h.empty_cache)


def finish(run):
    for p in run.live:
        assert run.h.sim_is_accessible(p, run.h.block_size(p)), f"live block {p:#x} lost its pages"
    drain_and_assert_empty(run.h, run.live)


POOL = (4, 2)


def pool_workload(run):
    """Allocations in a private pool around general pressure, a checkpoint and
    its restore, and a capture; the pool's pages must stay put throughout."""
    h = run.h
    h.pool_retain(POOL)
    for size in (3 * MiB, 700, 4096, PAGE, 5 * MiB):
        run.malloc(size, pool=POOL)
    for p in list(run.live)[::2]:
        run.free(p)
    for size in (3 * MiB, 4096, 6 * MiB):
        run.malloc(size, stream=S1, pool=POOL)
    pinned = {
        pg: h.sim_page_at(pg)
        for b in h.snapshot()["blocks"]
        if b[7] == POOL
        for pg in range(b[0] // PAGE * PAGE, b[0] + b[1], PAGE)
    }  # every page under the pool's blocks
    pages = [run.malloc(PAGE) for _ in range(CAPACITY // PAGE)]
    for p in pages[::2]:
        if p is not None:
            run.free(p)
    run.malloc(12 * MiB)
    run.step(h.empty_cache)
    assert {a: h.sim_page_at(a) for a in pinned} == pinned, "a pool's page moved"
    ckpt = h.pool_live(POOL)
    dropped = {a for a, _ in ckpt[::2]}
    run.step(h.pool_set_live, POOL, [b for b in ckpt if b[0] not in dropped])
    run.live = [p for p in run.live if h.block_size(p)]
    run.step(h.pool_set_live, POOL, ckpt)
    run.live += [a for a in dropped if h.block_size(a)]
    assert sorted(h.pool_live(POOL)) == ckpt
    h.capture_begin()
    h.sim_set_capture(True)
    for size in (MiB, 3 * MiB, 9 * MiB):
        run.malloc(size, pool=POOL)
    q = run.malloc(MiB)
    if q is not None:
        run.step(h.record_stream, q, S2)
        run.free(q)
    run.step(h.empty_cache)
    h.sim_set_capture(False)
    h.capture_end()
    assert h.sim_capture_violations() == 0
    h.pool_release(POOL)
    run.malloc(16 * MiB)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("nth", [1, 3, 9])
def test_single_fault_in_pools(make_heap, op, nth):
    h = make_heap(capacity=CAPACITY)
    h.sim_fail(op, nth=nth, count=1)
    run = Run(h)
    pool_workload(run)
    h.sim_fail(op, nth=0)
    finish(run)


def random_faults(make_heap, seed, work, rounds):
    """Every device operation fails at random (15%, seeded) while work runs
    rounds times; then the faults stop and the heap must be whole and usable."""
    h = make_heap(capacity=CAPACITY)
    for i, op in enumerate(OPS):
        h.sim_fail_random(op, 0.15, seed=seed * 100 + i)
    run = Run(h)
    for _ in range(rounds):
        work(run)
    for op in OPS:
        h.sim_fail_random(op, 0.0)
    finish(run)


@pytest.mark.parametrize("seed", range(4))
def test_random_faults_in_pools(make_heap, seed):
    random_faults(make_heap, seed, pool_workload, rounds=2)


_BASELINE = {}


def baseline(op):
    """The workload on a healthy device: its step log (watching `op`'s calls)
    and how many calls of `op` it makes.  Deterministic, so computed once."""
    if op not in _BASELINE:
        h = gpumem.Heap(device="sim", capacity=CAPACITY)
        try:
            before = h.sim_calls(op)
            run = Run(h, watch=op)
            workload(run)
            stats = h.stats()
            finish(run)
        finally:
            h.close()
        log = [(name, outcome, calls - before) for name, outcome, calls in run.log]
        _BASELINE[op] = (log, log[-1][2] if log else 0, stats)
    return _BASELINE[op]


# The workload calls these ops (the others -- reserve, unreserve,
# event_destroy -- only at heap creation and destruction, tested below).
CALLED = (
    "create",
    "release",
    "map",
    "unmap",
    "set_access",
    "event_create",
    "event_record",
    "event_query",
    "synchronize",
    "mem_info",
    "processes",
)
# Which call fails, as a fraction of the calls the clean workload makes: the
# first, the second, a quarter, half way, three quarters, the last.
POSITIONS = ("first", "second", "quarter", "half", "three_quarters", "last")


def nth_call(total, where):
    return {
        "first": 1,
        "second": 2,
        "quarter": max(1, total // 4),
        "half": max(1, total // 2),
        "three_quarters": max(1, 3 * total // 4),
        "last": total,
    }[where]


def test_clean_workload_walks_the_slow_paths():
    """The baseline itself: the workload grows, defragments (remaps pages),
    empties the cache and hits exactly the OOMs it was written to hit."""
    log, _, stats = baseline("create")
    assert stats["num_remaps"] >= 1 and stats["num_pages_remapped"] >= 1, stats
    assert stats["num_unmaps"] >= 1 and stats["num_device_free"] >= 1
    assert stats["num_sync_all_streams"] >= 1
    ooms = [name for name, outcome, _ in log if outcome != "ok"]
    # The request for the whole capacity cannot fit, and 4 MiB under a 24 MiB
    # cap with 44 MiB live cannot either; nothing else fails.
    assert all(o == "OutOfMemoryError" for _, o, _ in log if o != "ok")
    assert [n.split(":", 1)[1] for n in ooms] == ["malloc(67108864,)", "malloc(4194304,)"], ooms


@pytest.mark.parametrize("op", CALLED)
@pytest.mark.parametrize("where", POSITIONS)
def test_single_fault(make_heap, op, where):
    """One call of `op` fails.  The fault must fire; every step before it
    must go exactly as in the clean run; the step it hits fails cleanly or
    absorbs it; and afterwards at most a couple of steps may fail that the
    clean run passed (a request refused because a page went missing)."""
    base_log, total, _ = baseline(op)
    assert total >= 1, f"the workload makes no {op} call"
    nth = nth_call(total, where)
    h = make_heap(capacity=CAPACITY)
    before = h.sim_calls(op)
    h.sim_fail(op, nth=nth, count=1)
    run = Run(h, watch=op)
    workload(run)
    h.sim_fail(op, nth=0)
    made = h.sim_calls(op) - before
    assert made >= nth, f"the fault never fired: {made} {op} calls, the {nth}th should fail"
    log = [(name, outcome, calls - before) for name, outcome, calls in run.log]
    hit = next(i for i, (_, _, calls) in enumerate(log) if calls >= nth)
    # Deterministic up to the fault: same steps, same outcomes, same calls.
    assert log[:hit] == base_log[:hit]
    assert log[hit][0] == base_log[hit][0]
    if op in ("map", "set_access", "unmap", "release", "synchronize"):
        # The core keeps count of what the device refused.  (A refused create
        # is the device being full -- GM_ENOMEM -- not an error; a refused
        # event call falls back to waiting for the device.)
        assert h.stats()["num_device_errors"] >= 1
    newly_failed = [a[0] for a, b in zip(log, base_log) if a[1] != "ok" and b[1] == "ok" and a[0] == b[0]]
    assert len(newly_failed) <= 2, f"one failed {op} call broke {newly_failed}"
    for name in newly_failed:
        assert int(name.split(":")[0]) >= hit, f"{name} failed before the fault fired"
    if op.startswith("event") or op in ("mem_info", "processes", "create"):
        # These faults are absorbed (a device wait instead of an event, a
        # report without the process list, ...) or turn into an OOM of the step
        # they hit; they never raise DeviceError.
        assert all(o in ("ok", "OutOfMemoryError") for _, o, _ in log)
    finish(run)


@pytest.mark.parametrize("op", OPS)
def test_persistent_fault(make_heap, op):
    """The op fails every time for a while: errors surface cleanly, and the
    heap recovers once the device does."""
    h = make_heap(capacity=CAPACITY)
    h.sim_fail(op, nth=1, count=10**9)
    run = Run(h)
    workload(run)
    h.sim_fail(op, nth=0)
    # Healthy again: the heap works normally.
    p = run.malloc(3 * MiB)
    assert p is not None, run.errors[-1:] or "malloc failed after the fault cleared"
    finish(run)


@pytest.mark.parametrize("seed", range(6))
def test_random_faults_everywhere(make_heap, seed):
    random_faults(make_heap, seed, workload, rounds=3)


def test_create_failure_is_an_oom_with_a_reason(make_heap):
    h = make_heap(capacity=CAPACITY)
    h.sim_fail("create", nth=1, count=10**9)
    with pytest.raises(EXPECTED) as exc:
        h.malloc(4 * MiB)
    assert str(exc.value)
    assert h.stats()["allocation.all.current"] == 0
    h.sim_fail("create", nth=0)
    h.free(h.malloc(4 * MiB))
    drain_and_assert_empty(h, [])


def test_map_failure_returns_the_page(make_heap):
    """A page created for a request whose map then fails must not leak."""
    h = make_heap(capacity=CAPACITY)
    h.sim_fail("map", nth=1, count=10**9)
    with pytest.raises(EXPECTED):
        h.malloc(6 * MiB)
    h.sim_fail("map", nth=0)
    h.empty_cache()
    assert h.sim_info()["pages_mapped"] == 0
    assert h.sim_info()["pages_created"] == 0
    assert h.stats()["num_device_errors"] >= 1
    drain_and_assert_empty(h, [])


def test_heap_creation_fails_cleanly_when_reserve_fails():
    # Far more address space than the sim (or any machine) could reserve.
    with pytest.raises((RuntimeError, ValueError, MemoryError)) as exc:
        gpumem.Heap(device="sim", capacity=CAPACITY, va_size=1 << 62)
    msg = str(exc.value)
    # The reason must survive: which step failed, not just an error code.
    assert re.search(r"reserve|address space", msg, re.I), msg


@pytest.mark.parametrize("op", ["release", "unmap", "unreserve", "event_destroy", "synchronize"])
def test_close_survives_failing_teardown_calls(make_heap, op):
    """Destroying a heap while the device refuses to give things back must not
    crash or hang (the process may be exiting); close() may report a
    DeviceError, but the heap is closed either way."""
    h = make_heap(capacity=CAPACITY)
    p = h.malloc(5 * MiB)
    h.record_stream(p, S2)
    h.free(p)
    h.malloc(700)
    h.sim_fail(op, nth=1, count=10**9)
    try:
        h.close()
    except gpumem.DeviceError:
        pass
    with pytest.raises(ValueError):
        h.malloc(1)


# ---- regressions found by the fuzz driver ------------------------------------


def test_map_failing_part_way_leaves_no_inaccessible_free_memory(make_heap):
    # The first page of a 2-page request maps, the second does not: the first
    # never gets access granted, so it must not turn up in a later block.
    h = make_heap(capacity=CAPACITY)
    h.sim_fail("map", nth=2)
    with pytest.raises(EXPECTED):
        h.malloc(4 * MiB)
    p = h.malloc(MiB)
    assert h.sim_is_accessible(p, MiB)
    assert_ok(h)
    drain_and_assert_empty(h, [p])


def test_set_access_and_rollback_failing(make_heap):
    # set_access fails (and its retry), and so does the unmap that would undo
    # the mapping: the pages may stay mapped, but must not be handed out
    # without access.
    h = make_heap(capacity=CAPACITY)
    h.sim_fail("set_access", nth=1, count=2)
    h.sim_fail("unmap", nth=1, count=1)
    with pytest.raises(EXPECTED):
        h.malloc(4 * MiB)
    p = h.malloc(4 * MiB)
    assert h.sim_is_accessible(p, 4 * MiB)
    assert_ok(h)
    drain_and_assert_empty(h, [p])


def test_failed_event_record_does_not_share_an_event(make_heap):
    # A failed event_record must not leave the pooled event in the block: put
    # back twice, one event would serve two waits, and a block whose side
    # stream is still running would come back early.
    h = make_heap(capacity=CAPACITY)
    S3 = 0x3000
    p = h.malloc(4 * MiB)
    h.record_stream(p, S1)
    h.sim_fail("event_record", nth=1)
    h.free(p)  # the record fails: p waits for a device sync instead
    h.empty_cache()  # that sync
    x = h.malloc(4 * MiB, stream=S2)
    y = h.malloc(4 * MiB)
    h.record_stream(x, S1)
    h.record_stream(y, S3)
    h.sim_hold_stream(S1, True)  # a kernel on S1 still reads x
    h.free(x)
    h.free(y)
    z = h.malloc(4 * MiB, stream=S2)
    assert z != x, "x was reused while the stream named by record_stream is still running"
    h.sim_hold_stream(S1, False)
    drain_and_assert_empty(h, [z])


def test_failed_unmap_in_defragmentation_still_grows_to_the_cap(make_heap):
    """A defragmentation whose unmap fails recycles nothing; the request must
    then grow to the cap, every page of it: here 13 pages hold the 3 live,
    the 2 cached that could not be unmapped and the 8 requested."""
    h = make_heap(capacity=64 * MiB, growth_slack=0.0, growth_slack_pages=0)
    xs = [h.malloc(PAGE) for _ in range(6)]
    for x in xs[1::2]:
        h.free(x)  # three wholly free pages between live ones
    h.set_cap(13 * PAGE)
    h.sim_fail("unmap", nth=1)
    p = h.malloc(8 * PAGE)  # past the growth limit: defragment, whose unmap fails
    st = h.stats()
    assert st["num_device_errors"] == 1 and h.sim_calls("unmap") >= 1
    assert st["reserved_bytes.all.current"] == 13 * PAGE
    assert h.sim_is_accessible(p, 8 * PAGE)
    assert_ok(h)
    h.sim_fail("unmap", nth=0)
    drain_and_assert_empty(h, [p] + xs[::2])
