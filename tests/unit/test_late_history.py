"""Snapshots as users make them: a history turned on after blocks were live, or a
bounded ring that wrapped.  Every reader starts from the blocks the snapshot says
are live together with its history, and counts what the history never saw."""

import json
import pickle
import random

import pytest

import gpumem
from gpumem.__main__ import main
from gpumem.forecast import Forecast
from gpumem.history import record_history
from gpumem.replay import min_capacity, replay
from gpumem.timeline import from_trace
from gpumem.trace import TraceError, load_trace
from helpers import history_heap

GiB, MiB = 1 << 30, 1 << 20


@pytest.fixture
def heap():
    yield from history_heap(16 * GiB)


def dump(h, path):
    gpumem.dump_snapshot(path, device=h)
    return path


def live_at_end(t):
    """Live bytes after the trace's last event, counted from its events."""
    return sum(size if op == 0 else -size for op, _, size, _ in t.decode())


def cli_json(capsys, *argv):
    assert main([*map(str, argv), "--json"]) == 0
    out = capsys.readouterr().out
    return json.loads(out.strip().splitlines()[-1])


# ---- gpumem's own snapshot() dumps ----------------------------------------------------


def test_history_started_after_blocks_were_live(heap, tmp_path, capsys):
    weights = heap.malloc(GiB)
    old = heap.malloc(64 * MiB + 100)  # live before the history, freed during it
    record_history(True, device=heap, stacks=None)
    tmp = [heap.malloc(30 * MiB) for _ in range(8)]
    heap.free(old)
    for p in tmp:
        heap.free(p)
    path = dump(heap, tmp_path / "late.pickle")

    t = load_trace(path)
    rounded = 64 * MiB + 512  # the history records the blocks' sizes
    assert (t.live_before, t.live_before_bytes) == (2, GiB + rounded)
    assert t.peak_live_bytes == GiB + rounded + 8 * 30 * MiB
    assert live_at_end(t) == gpumem.snapshot(heap).summary.live_bytes == GiB
    assert replay(t, 4 * GiB, timing=False).peak_live_bytes == t.peak_live_bytes
    assert min_capacity(t) >= t.peak_live_bytes

    row = cli_json(capsys, "replay", path, "--no-timing", "--capacity", "4GiB")
    assert row["peak_live_bytes"] == t.peak_live_bytes and row["live_before_blocks"] == 2
    assert row["live_before_bytes"] == GiB + rounded
    # the gpumem heap holds 1 GiB + 64 MiB + 240 MiB at the peak: 1.25 GiB is too small
    out = cli_json(capsys, "explain", path, "--capacity", "1.25GiB")
    assert not out["gpumem_fits"] and out["live_before_bytes"] == GiB + rounded
    heap.free(weights)


def test_wrapped_ring(heap, tmp_path):
    weights = heap.malloc(512 * MiB)
    record_history(True, device=heap, stacks=None, max_entries=7)
    held = []
    for i in range(40):
        held.append(heap.malloc((i % 5 + 1) * MiB))
        if len(held) > 3:
            heap.free(held.pop(0))
    assert gpumem.history.history(heap).dropped > 0
    path = dump(heap, tmp_path / "ring.pickle.gz")

    t = load_trace(path)
    live_now = 512 * MiB + sum((i % 5 + 1) * MiB for i in range(37, 40))
    assert live_at_end(t) == live_now  # every block live now, whatever the ring still holds
    # the weights and the blocks the ring's frees name are live before it: peak live counts them
    assert t.live_before_bytes >= 512 * MiB + 3 * MiB and t.peak_live_bytes >= live_now
    assert replay(t, 2 * GiB, timing=False).ooms == 0
    heap.free(weights)
    for p in held:
        heap.free(p)


def test_live_before_and_never_freed_counts_in_peak_live(heap, tmp_path, capsys):
    heap.malloc(GiB)  # weights, before the history and never freed
    record_history(True, device=heap, stacks=None)
    for _ in range(3):
        ps = [heap.malloc(80 * MiB) for _ in range(3)]
        for p in ps:
            heap.free(p)
    path = dump(heap, tmp_path / "weights.pickle")

    t = load_trace(path)
    assert t.peak_live_bytes == GiB + 240 * MiB  # not the 240 MiB the history alone holds
    row = cli_json(capsys, "replay", path, "--no-timing", "--min-capacity")
    assert row["peak_live_bytes"] == GiB + 240 * MiB and row["min_capacity_bytes"] >= GiB + 240 * MiB
    tl = gpumem.memory_over_time(str(path), capacity=4 * GiB)
    assert tl.peak_live[1] == GiB + 240 * MiB
    assert from_trace(t, 4 * GiB).live[1] >= GiB  # the first point already holds the weights


# ---- the forecast command and gpumem.forecast ------------------------------------------


def record_dumps(h, step, knobs, tmp_path):
    paths = []
    for k in knobs:
        record_history(True, device=h, stacks=None)
        step(k)
        paths.append(dump(h, tmp_path / f"k{k}.pickle"))
        record_history(False, device=h)
    return paths


def test_forecast_command_counts_memory_live_before_as_forecast_does(heap, tmp_path, capsys):
    heap.malloc(GiB)

    def step(b):
        xs = [heap.malloc(b * 8 * MiB) for _ in range(10)]
        for x in xs:
            heap.free(x)

    fc = gpumem.forecast(step, knob=[2, 4], heap=heap, capacity="8GiB")
    paths = record_dumps(heap, step, [2, 4], tmp_path)
    out = cli_json(capsys, "forecast", *paths, "--knob", "2,4", "--device-memory", "8GiB")
    assert fc.largest() == 89  # (8 GiB - 1 GiB) / 80 MiB
    assert (out["largest_gpumem"], out["largest_native"]) == (fc.largest(), fc.largest(allocator="native"))


def test_forecast_command_matches_forecast_on_a_made_up_program(tmp_path, capsys):
    h = gpumem.Heap(device="sim", capacity=16 * GiB)
    h.malloc(300 * MiB + 1000)
    h.malloc(7000)
    h.malloc(5 * MiB + 3, stream=5)  # live before, on another stream
    hole = h.malloc(40 * MiB)
    h.malloc(123 * MiB + 77)
    h.free(hole)  # a hole between the blocks live before

    def step(k):
        a = h.malloc(k * 3 * MiB + 512)
        b = h.malloc(k * k * 256 * 1024)
        c = h.malloc(4000)
        h.free(b)
        d = h.malloc(k * 5 * MiB)
        for p in (a, c, d):
            h.free(p)

    knobs = [2, 4, 8]
    fc = gpumem.forecast(step, knob=knobs, heap=h, capacity="6GiB")
    paths = record_dumps(h, step, knobs, tmp_path)
    cli = Forecast.from_traces(paths, knobs, capacity="6GiB")
    for k in (3, 16, 40):
        assert cli.peak_live(k) == fc.peak_live(k), k
    assert cli.predict(16) == fc.predict(16)
    for a in ("gpumem", "native"):
        assert cli.largest(allocator=a) == fc.largest(allocator=a), a
    out = cli_json(capsys, "forecast", *paths, "--knob", "2,4,8", "--device-memory", "6GiB")
    assert (out["largest_gpumem"], out["largest_native"]) == (fc.largest(), fc.largest(allocator="native"))
    h.close()


@pytest.mark.parametrize("seed", range(8))
def test_forecast_command_matches_forecast_on_random_programs(tmp_path, seed):
    """Blocks of any size live before on two streams (some freed again), a step of
    sizes linear and quadratic in the knob: the recordings' dumps forecast what
    gpumem.forecast does, at every value and under both allocators."""
    rng = random.Random(seed)
    h = gpumem.Heap(device="sim", capacity=32 * GiB)
    before = [h.malloc(rng.randrange(1, 400 * MiB), stream=rng.choice([0, 0, 3])) for _ in range(rng.randrange(1, 8))]
    for p in rng.sample(before, len(before) // 3):
        h.free(p)
    plan = [
        (rng.randrange(1, 8 * MiB), rng.randrange(0, 2 * MiB), rng.random() < 0.3, rng.choice([0, 0, 3]))
        for _ in range(rng.randrange(3, 12))
    ]

    def step(k):
        live = []
        for a, b, square, stream in plan:
            live.append(h.malloc(a * k + b + (k * k * 4096 if square else 0), stream=stream))
            if len(live) > 3:
                h.free(live.pop(0))
        for p in live:
            h.free(p)

    knobs, cap = [2, 4, 8], rng.randrange(2, 12) * GiB
    fc = gpumem.forecast(step, knob=knobs, heap=h, capacity=cap)
    cli = Forecast.from_traces(record_dumps(h, step, knobs, tmp_path), knobs, capacity=cap)
    assert cli.predict(20) == fc.predict(20)
    for a in ("gpumem", "native"):
        assert cli.largest(allocator=a) == fc.largest(allocator=a), a
    h.close()


# ---- torch's format, built by hand -------------------------------------------------------


def entry(action, addr, size, stream=0, **kw):
    return {"action": action, "addr": addr, "size": size, "stream": stream, "frames": [], **kw}


def block(size, state, requested=None, frames=()):
    return {
        "size": size,
        "requested_size": size if requested is None else requested,
        "state": state,
        "frames": list(frames),
    }


def segment(addr, blocks, device=0, stream=0, expandable=False):
    return {
        "device": device,
        "address": addr,
        "total_size": sum(b["size"] for b in blocks),
        "stream": stream,
        "segment_type": "large",
        "is_expandable": expandable,
        "blocks": blocks,
    }


def write(tmp_path, name, snap):
    path = tmp_path / name
    path.write_bytes(pickle.dumps(snap))
    return path


FRAME = {"filename": "/home/u/train.py", "line": 12, "name": "build_model"}


def test_torch_snapshot_late_history(tmp_path):
    base = 0x7F0000000000
    # weights (requested 1000 MiB + 1, in a 1000 MiB + 512 block), one block freed during the history,
    # a pending free on stream 7; the history allocates and frees within the free space
    blocks = [
        block(1000 * MiB + 512, "active_allocated", 1000 * MiB + 1, [FRAME]),
        block(24 * MiB, "inactive"),
        block(2 * MiB, "active_pending_free", 2 * MiB - 100),
        block(22 * MiB, "inactive"),
    ]
    snap = {
        "segments": [segment(base, blocks, stream=7)],
        "device_traces": [
            [
                entry("alloc", base + 1000 * MiB + 512, 20 * MiB),
                entry("free_requested", base + 1024 * MiB + 512 + 2 * MiB, 8 * MiB, 7),
                entry("free_completed", base + 1024 * MiB + 512 + 2 * MiB, 8 * MiB, 7),  # live before, freed
                entry("free_completed", base + 1000 * MiB + 512, 20 * MiB),
            ]
        ],
    }
    t = load_trace(write(tmp_path, "t.pickle", snap))
    assert t.live_before == 3
    assert t.live_before_bytes == 1000 * MiB + 1 + 2 * MiB - 100 + 8 * MiB
    assert t.peak_live_bytes == t.live_before_bytes + 20 * MiB
    assert t.live_before_sites[0] == ("/home/u/train.py:12 in build_model", 1000 * MiB + 1, 1)
    streams = [s for op, _, _, s in t.decode()][:3]
    assert sorted(streams) == [7, 7, 7]


def test_torch_expandable_segments_and_two_devices(tmp_path, capsys):
    base0, base1 = 0x7E0000000000, 0x7F0000000000
    segs = [
        segment(base0, [block(600 * MiB, "active_allocated"), block(20 * MiB, "inactive")], 0, expandable=True),
        segment(base1, [block(100 * MiB, "inactive"), block(300 * MiB, "active_allocated")], 1, expandable=True),
        segment(base1 + 400 * MiB, [block(2 * MiB, "active_allocated", 1000)], 1, expandable=True),
    ]
    traces = [
        [entry("alloc", base0 + 600 * MiB, 10 * MiB), entry("free_completed", base0 + 600 * MiB, 10 * MiB)],
        [
            entry("segment_map", base1, 100 * MiB),
            entry("alloc", base1, 50 * MiB),
            entry("free_completed", base1, 50 * MiB),
        ],
    ]
    path = write(tmp_path, "two.pickle", {"segments": segs, "device_traces": traces})
    t0, t1 = load_trace(path), load_trace(path, device=1)
    assert (t0.live_before_bytes, t0.peak_live_bytes) == (600 * MiB, 610 * MiB)
    # device 1's trace against device 1's segments: its 300 MiB and 1000 bytes, not device 0's
    assert (t1.live_before, t1.live_before_bytes) == (2, 300 * MiB + 1000)
    assert t1.peak_live_bytes == 350 * MiB + 1000
    row = cli_json(capsys, "replay", path, "--device", "1", "--no-timing")
    assert row["peak_live_bytes"] == 350 * MiB + 1000
    # a free on device 0 of an address that device 1's segments hold is a mixed-up file
    traces[0].append(entry("free_completed", base1 + 100 * MiB, 300 * MiB))
    bad = write(tmp_path, "mixed.pickle", {"segments": segs, "device_traces": traces})
    with pytest.raises(TraceError, match="segments place it on device 1"):
        load_trace(bad)


def test_explain_counts_memory_live_before_at_torch_oom(tmp_path, capsys):
    base = 0x7F0000000000
    blocks = [block(GiB, "active_allocated"), block(GiB, "inactive")]
    snap = {
        "segments": [segment(base, blocks)],
        "device_traces": [
            [
                entry("alloc", base + GiB, 512 * MiB),
                entry("free_completed", base + GiB, 512 * MiB),
                entry("oom", 0, 1536 * MiB, device_free=0),
            ]
        ],
    }
    out = cli_json(capsys, "explain", write(tmp_path, "oom.pickle", snap))
    # torch had 1 GiB of weights live and 2 GiB reserved: 1.5 GiB more does not fit
    assert out["torch_oom"]["live_bytes"] == GiB and out["torch_oom"]["reserved_bytes"] == 2 * GiB
    assert out["peak_live_bytes"] == GiB + 1536 * MiB and not out["gpumem_fits"]


@pytest.mark.parametrize(
    "change, fragment",
    [
        (lambda s: s.update(segments={"a": 1}), "segments is not a list"),
        (lambda s: s["segments"][0]["blocks"].append("x"), "not a dict with a 'state'"),
        (lambda s: s["segments"][0].pop("address"), "address is missing"),
        (lambda s: s["segments"][0]["blocks"][0].update(size=-5), "size is -5"),
        (lambda s: s["device_traces"][0].append(entry("free_completed", 1 << 40, 512)), "already freed"),
        (lambda s: s["segments"][0]["blocks"].insert(0, block(512, "active_allocated")), "which the history frees"),
    ],
)
def test_malformed_segments_are_one_line_and_status_2(tmp_path, capsys, change, fragment):
    snap = {
        "segments": [segment(1 << 40, [block(4 * MiB, "inactive")])],
        "device_traces": [[entry("free_completed", 1 << 40, 512)]],
    }
    assert load_trace(write(tmp_path, "ok.pickle", snap)).live_before == 1
    change(snap)
    path = write(tmp_path, "bad.pickle", snap)
    for cmd in (["replay", path], ["explain", path, "--capacity", "1GiB"]):
        assert main([str(a) for a in cmd]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and fragment in err, err


def test_a_real_late_snapshot_has_the_whole_runs_peak_live():
    """bert_mlm_late is torch's own snapshot of the zoo's bert_mlm workload with the history started after
    the first optimizer step: with what was live before the history counted, its peak live is the full
    recording's, to the byte."""
    from gpumem.trace import load_trace

    late, whole = load_trace("bert_mlm_late"), load_trace("bert_mlm")
    assert late.allocs < whole.allocs
    assert late.peak_live_bytes == whole.peak_live_bytes


def test_a_real_wrapped_ring_replays_and_explains(capsys):
    """llama_train_ring kept the last 3000 events of the zoo's llama_train (its ring wrapped): replay
    starts from the blocks its segments hold, so what the ring lost still counts."""
    from gpumem.__main__ import main
    from gpumem.trace import load_trace

    ring, whole = load_trace("llama_train_ring"), load_trace("llama_train")
    assert ring.n_events <= 3000 * 2
    assert main(["replay", "llama_train_ring", "--json", "--no-timing"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["ooms"] == 0
    assert 2 * GiB < row["peak_live_bytes"] == ring.peak_live_bytes <= whole.peak_live_bytes
    assert main(["explain", "llama_train_ring", "--capacity", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "before the history" in out
