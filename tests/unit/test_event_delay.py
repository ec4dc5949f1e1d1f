"""Late events on the simulated device (Heap.sim_set_event_delay) and replays with them."""

import json
import subprocess
import sys

import pytest

from gpumem import _C

from helpers import REPO, all_traces

sys.path.insert(0, str(REPO / "benchmarks"))
from event_delay import STREAM_A, STREAM_B, two_stream_trace  # noqa: E402  (the benchmark's trace)

MiB = 1 << 20
GiB = 1 << 30
S1, S2 = STREAM_A, STREAM_B  # the two-stream trace's streams
OPS = _C.DEVICE_OPS  # every call a device can be asked to make (device.h)


def device_ops(heap):
    return sum(heap.sim_calls(op) for op in OPS)


def state(heap, addr):
    return {blk[0]: blk[6] for blk in heap.snapshot()["blocks"]}.get(addr)


def pending_after_record_stream(heap, delay, hold=False):
    """A block used on S2 and freed: the heap records an event on S2 for it."""
    spare = heap.malloc(16 * MiB)  # room for the polling mallocs below, so they need no device op
    heap.free(spare)
    heap.sim_set_event_delay(delay)
    p = heap.malloc(2 * MiB)
    heap.record_stream(p, S2)
    if hold:
        heap.sim_hold_stream(S2, True)  # before the free: the event is recorded under the hold
    records = heap.sim_calls("event_record")
    heap.free(p)
    assert heap.sim_calls("event_record") == records + 1
    assert state(heap, p) == "pending"
    return p


def poll(heap):
    """One small malloc + free on stream 0: the heap polls pending events, one query each."""
    before = {op: heap.sim_calls(op) for op in OPS}
    q = heap.malloc(512)
    heap.free(q)
    changed = {op: heap.sim_calls(op) - before[op] for op in OPS if heap.sim_calls(op) != before[op]}
    assert changed == {"event_query": 1}, changed


@pytest.mark.parametrize("delay", [1, 5, 40])
def test_event_not_ready_before_delay_ops_ready_after(heap, delay):
    p = pending_after_record_stream(heap, delay)
    recorded_at = device_ops(heap)  # the record was the free's last device call
    for _ in range(delay):
        poll(heap)
        assert state(heap, p) == "pending", f"complete after {device_ops(heap) - recorded_at - 1} ops, delay {delay}"
    poll(heap)  # the query after `delay` further operations
    assert state(heap, p) == "free"
    assert device_ops(heap) - recorded_at == delay + 1
    heap.check()


def test_other_device_operations_count(heap):
    p = pending_after_record_stream(heap, 6)
    recorded_at = device_ops(heap)
    creates = heap.sim_calls("create")
    queries = heap.sim_calls("event_query")
    # Blocks the heap must grow for: device calls that are not queries.
    others = [heap.malloc(20 * MiB) for _ in range(2)]
    assert heap.sim_calls("create") > creates
    assert device_ops(heap) - recorded_at > 6 + (heap.sim_calls("event_query") - queries)
    if state(heap, p) == "pending":
        poll(heap)
    assert state(heap, p) == "free"
    # Queries alone would have needed 7: the growth's calls counted too.
    assert heap.sim_calls("event_query") - queries < 7
    for q in others:
        heap.free(q)
    heap.check()


def test_synchronize_completes_late_events(heap):
    p = pending_after_record_stream(heap, 10**9)
    for _ in range(5):
        poll(heap)
    assert state(heap, p) == "pending"
    syncs = heap.sim_calls("synchronize")
    heap.empty_cache()  # waits for the device
    assert heap.sim_calls("synchronize") == syncs + 1
    assert state(heap, p) != "pending"
    heap.check()


def test_delay_zero_completes_at_once(heap):
    p = pending_after_record_stream(heap, 0)
    poll(heap)
    assert state(heap, p) == "free"


def test_events_on_stream_zero_are_never_late(heap):
    heap.sim_set_event_delay(10**6)
    p = heap.malloc(4 * MiB, stream=0)
    heap.free(p)
    # S2 takes stream 0's freed memory once an event on stream 0 completes: at once.
    assert heap.malloc(4 * MiB, stream=S2) == p
    heap.check()


def test_cross_stream_reuse_waits_for_the_delay(make_heap):
    def second_stream_gets_first_block(delay):
        heap = make_heap()
        heap.sim_set_event_delay(delay)
        p = heap.malloc(4 * MiB, stream=S1)
        heap.free(p)
        q = heap.malloc(4 * MiB, stream=S2)
        heap.check()
        return q == p

    assert second_stream_gets_first_block(0)
    assert not second_stream_gets_first_block(50)


def test_delay_with_held_stream_needs_both(heap):
    p = pending_after_record_stream(heap, 3, hold=True)
    for _ in range(5):
        poll(heap)
    assert state(heap, p) == "pending"  # the delay has passed, the hold has not
    heap.sim_hold_stream(S2, False)
    poll(heap)
    assert state(heap, p) == "free"
    heap.check()


def test_bad_delay(heap):
    with pytest.raises(ValueError):
        heap.sim_set_event_delay(-1)
    with pytest.raises(TypeError):
        heap.sim_set_event_delay(1.5)
    with pytest.raises(ValueError):
        heap.sim_set_event_delay(1 << 64)
    heap.sim_set_event_delay((1 << 64) - 1)


# ---- replay ----------------------------------------------------------------------------


def test_two_stream_trace_grows_with_late_events(tmp_path):
    from gpumem.replay import min_capacity, replay
    from gpumem.trace import load_trace

    trace = load_trace(two_stream_trace(tmp_path / "two.trace", steps=12))
    # A device with room, but not the 32 GiB to spare that makes small growths reach ahead (POLICY):
    # reserved memory then follows what the heap needs, page by page.
    cap = 8 * GiB
    at_once = replay(trace, cap, timing=False)
    assert at_once.event_delay == 0
    # Events at once: B reuses A's batch, nothing beyond peak live (the tight heap).  The default policy
    # starts each block of whole pages at a page boundary (POLICY, place.c and heap.c's snug_end), which
    # leaves a sliver under a page before it: a batch of 8 blocks, of which at most 4 are whole pages,
    # then spans at most 4 slivers more, each under a page.
    pages = -(-at_once.peak_live_bytes // (2 * MiB)) * 2 * MiB
    assert replay(trace, cap, timing=False, heap_kwargs={"pressure": 0}).peak_reserved_bytes == pages
    assert pages <= at_once.peak_reserved_bytes <= pages + 4 * 2 * MiB
    for delay in (1, 10, 100):
        late = replay(trace, cap, timing=False, event_delay=delay)
        assert late.event_delay == delay and late.ooms == 0
        assert late.peak_live_bytes == at_once.peak_live_bytes
        assert late.peak_reserved_bytes > at_once.peak_reserved_bytes, delay
        wide = replay(trace, cap, timing=False, event_delay=delay, heap_kwargs={"growth_slack": 1.0})
        assert wide.peak_reserved_bytes > at_once.peak_reserved_bytes, delay
    # Late events fit in the same memory: the heap waits for the device rather than fail.
    assert min_capacity(trace, event_delay=100) == min_capacity(trace)


def test_late_events_keep_the_heap_consistent(tmp_path, make_heap):
    from gpumem.replay import replay_trace
    from gpumem.trace import load_trace

    trace = load_trace(two_stream_trace(tmp_path / "two.trace", steps=6))
    for delay in (0, 1, 10, 100):
        heap = make_heap(growth_slack=1.0)
        heap.sim_set_event_delay(delay)
        r = replay_trace(heap, trace, progress=lambda done, total: heap.check(), chunk=16)
        assert r["ooms"] == 0
        heap.check()


def _streams(path):
    """How many streams allocated in a trace file (the header says, for the multi-stream ones)."""
    from gpumem.trace import load_trace

    return load_trace(str(path)).meta.get("streams", 1)


@pytest.mark.parametrize("path", [p for p in all_traces() if _streams(p) == 1], ids=lambda p: p.name)
def test_single_stream_traces_ignore_the_delay(path):
    from gpumem.replay import replay
    from gpumem.trace import load_trace

    trace = load_trace(str(path))
    base = replay(trace, timing=False).to_json()
    zero = replay(trace, timing=False, event_delay=0).to_json()
    late = replay(trace, timing=False, event_delay=100).to_json()
    assert zero == base
    assert late.pop("event_delay") == 100
    base.pop("event_delay")
    assert late == base


def test_replay_rejects_bad_delay(tmp_path):
    from gpumem.replay import min_capacity, replay
    from gpumem.trace import load_trace

    trace = load_trace(two_stream_trace(tmp_path / "two.trace", steps=1))
    with pytest.raises(ValueError):
        replay(trace, timing=False, event_delay=-1)
    with pytest.raises(TypeError):
        replay(trace, timing=False, event_delay=2.0)
    with pytest.raises(ValueError):
        min_capacity(trace, event_delay=-5)


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "gpumem", *args], capture_output=True, text=True)


def test_cli_event_delay(tmp_path):
    path = two_stream_trace(tmp_path / "two.trace", steps=4)
    rows = {}
    for delay in ("0", "100"):
        r = run_cli("replay", path, "--event-delay", delay, "--json", "--no-timing", "--no-progress")
        assert r.returncode == 0, r.stderr
        rows[delay] = json.loads(r.stdout)
        assert rows[delay]["event_delay"] == int(delay)
    assert rows["100"]["peak_reserved_bytes"] > rows["0"]["peak_reserved_bytes"]
    r = run_cli("replay", path, "--no-timing", "--no-progress", "--json")
    assert json.loads(r.stdout)["event_delay"] == 0


@pytest.mark.parametrize("bad", ["-1", "x", "1.5", str(1 << 64)])
def test_cli_bad_event_delay(tmp_path, bad):
    path = two_stream_trace(tmp_path / "two.trace", steps=1)
    r = run_cli("replay", path, f"--event-delay={bad}", "--no-timing", "--no-progress")
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "event delay" in lines[0], r.stderr


@pytest.mark.parametrize("handoff", [1, 0])
def test_no_oom_while_pending_memory_would_fit(make_heap, handoff):
    """Before an out-of-memory error memory that only waits for another stream's
    event is reclaimed, not reported missing: the allocating stream waits for
    that event on the device (the hand-off), or, with stream_handoff=0, the
    heap waits for the whole device."""
    heap = make_heap(capacity=64 * MiB, stream_handoff=handoff)
    heap.sim_set_event_delay(10**9)  # the event never completes on its own
    big = heap.malloc(48 * MiB)
    heap.record_stream(big, S2)
    heap.free(big)
    assert state(heap, big) == "pending"
    syncs = heap.sim_calls("synchronize")
    again = heap.malloc(40 * MiB)  # fits only in the pending block's pages
    assert heap.sim_calls("synchronize") == syncs + 1 - handoff
    assert heap.stats()["num_stream_handoffs"] == handoff
    assert heap.stats()["reserved_bytes.all.peak"] <= 64 * MiB
    assert state(heap, big) in ("free", "live")
    heap.check()
    heap.free(again)


def test_cli_pictures_follow_the_event_delay(tmp_path):
    """--snapshot and --html show the heap the table's replay had: with late events, too."""
    import pickle

    from gpumem.cli.replay import peak_snapshot
    from gpumem.timeline import from_trace
    from gpumem.trace import load_trace

    # The two-stream trace, then a last batch that stays live: the peak comes
    # after the steps in which late events made the heap grow.
    path = tmp_path / "late.trace"
    two_stream_trace(path, steps=12)
    end = 1 << 40
    last = [f"alloc {end + i * 12 * MiB} {12 * MiB} {S1}" for i in range(10)]
    path.write_text(path.read_text() + "\n".join(last) + "\n")
    trace = load_trace(str(path))

    def history(torch_snapshot):
        return [(e["action"], e["addr"], e["size"]) for e in torch_snapshot["device_traces"][0]]

    late = history(peak_snapshot(trace, 80 << 30, event_delay=100)[0].to_torch())
    # the heaps' histories differ: late events made it map one more segment
    assert late != history(peak_snapshot(trace, 80 << 30)[0].to_torch())
    snap = tmp_path / "peak.pickle"
    r = run_cli("replay", str(path), "--event-delay", "100", "--no-timing", "--no-progress", "--snapshot", str(snap))
    assert r.returncode == 0, r.stderr
    with open(snap, "rb") as f:
        assert history(pickle.load(f)) == late
    assert from_trace(trace, event_delay=100).reserved != from_trace(trace).reserved
