"""The model of torch's native caching allocator (gpumem.native_model) that forecasts compare with:
rounding, segments, splitting, streams, release before failing, the fraction cap, and its agreement
with torch on recorded traces."""

import json

import pytest

from gpumem.forecast import Forecast, Recording
from gpumem.forecast.native_model import Segment, with_start
from gpumem.native_model import (
    NativeAllocator,
    allowed_bytes,
    fits_native,
    min_capacity_native,
    replay_native,
    round_size,
    segment_size,
)
from gpumem.trace import load_trace

from helpers import REPO, GiB, MiB, trace_file


# ---- the native allocator's model --------------------------------------------------------------


def test_native_rounding_and_segment_sizes():
    assert [round_size(n) for n in (0, 1, 512, 513, 1000, MiB)] == [512, 512, 512, 1024, 1024, MiB]
    assert segment_size(512) == segment_size(MiB) == 2 * MiB  # small pool
    assert segment_size(MiB + 512) == segment_size(10 * MiB - 512) == 20 * MiB  # large, under 10 MiB
    assert segment_size(10 * MiB) == 10 * MiB
    assert segment_size(11 * MiB + 512) == 12 * MiB  # rounded up to 2 MiB


def test_native_small_blocks_share_a_2mib_segment():
    a = NativeAllocator()
    x = a.malloc(1000)
    y = a.malloc(1000)
    assert y == x + 1024 and a.reserved == 2 * MiB and a.allocated == 2048
    a.free(x)
    a.free(y)
    assert a.empty_cache() == 2 * MiB and a.reserved == 0  # merged back into one free segment


def test_native_large_blocks_split_only_above_1mib():
    a = NativeAllocator()
    x = a.malloc(3 * MiB)
    y = a.malloc(3 * MiB)
    assert a.reserved == 20 * MiB and y == x + 3 * MiB  # one 20 MiB segment, split
    z = a.malloc(13 * MiB)  # the 14 MiB rest fits; 1 MiB would remain, not more than 1 MiB: kept whole
    assert z == y + 3 * MiB and a.reserved == 20 * MiB and a.allocated == 20 * MiB
    w = a.malloc(11 * MiB)  # a new 12 MiB segment, again 1 MiB left: kept whole
    assert a.reserved == 32 * MiB and a.allocated == 32 * MiB
    a.free(w)
    assert a.malloc(11 * MiB + 512) == w and a.allocated == 32 * MiB
    a.free(w)
    u = a.malloc(5 * MiB)  # 7 MiB remain: split
    assert u == w and a.allocated == 25 * MiB
    assert a.malloc(7 * MiB) == w + 5 * MiB and a.reserved == 32 * MiB


def test_native_blocks_stay_with_their_stream():
    a = NativeAllocator()
    x = a.malloc(MiB, stream=1)
    a.free(x)
    y = a.malloc(MiB, stream=0)
    assert y != x and a.reserved == 4 * MiB


def test_native_releases_cached_segments_before_failing():
    a = NativeAllocator(capacity=20 * MiB)
    a.free(a.malloc(3 * MiB))
    assert a.malloc(1000) is not None  # 2 MiB more would pass 20 MiB: the free segment goes first
    assert a.reserved == 2 * MiB and a.num_alloc_retries == 1 and a.ooms == 0
    assert a.malloc(19 * MiB) is None and a.ooms == 1


def test_native_ties_go_to_the_newest_segment():
    """Equal free blocks: torch takes the lowest address, and each new segment
    lies below the earlier ones, so the newest is reused first."""
    a = NativeAllocator()
    x = a.malloc(12 * MiB)  # 12 MiB requests: segments of exactly 12 MiB
    y = a.malloc(12 * MiB)
    assert a.reserved == 24 * MiB and y < x
    a.free(x)
    a.free(y)
    z = a.malloc(4 * MiB)  # either cached segment fits as well: the newer one, split (8 MiB remain)
    assert z == y and a.allocated == 4 * MiB
    assert a.empty_cache() == 12 * MiB  # the older one was left whole
    assert a.malloc(4 * MiB) == y + 4 * MiB  # the rest of the split segment, not a new one
    assert a.reserved == 12 * MiB


def test_native_oversize_blocks_with_max_split_size():
    with pytest.raises(ValueError, match="more than 20 MiB"):
        NativeAllocator(max_split_size=20 * MiB)
    a = NativeAllocator(max_split_size=64 * MiB)
    big = a.malloc(100 * MiB)  # oversize: its own 100 MiB segment, never split
    a.free(big)
    small = a.malloc(30 * MiB)  # under max_split: the cached oversize block may not serve it
    assert small != big and a.reserved == 130 * MiB
    assert a.malloc(90 * MiB) == big and a.allocated == 130 * MiB  # 10 MiB over: whole, not split
    a.free(big)
    assert a.malloc(70 * MiB) != big  # 30 MiB over (20 MiB or more): not given
    assert a.reserved == 200 * MiB
    # the cap: a 70 MiB segment does not fit 150 MiB beside 130 MiB held; the cached oversize
    # 100 MiB segment is released first (only with max_split_size), then the retry succeeds
    b = NativeAllocator(capacity=150 * MiB, max_split_size=64 * MiB)
    b.free(b.malloc(100 * MiB))
    keep = b.malloc(30 * MiB)
    assert b.malloc(70 * MiB) is not None and b.num_device_free == 1 and b.reserved == 100 * MiB
    assert keep is not None


def test_native_fraction_cap_counts_only_segments():
    assert allowed_bytes(0.1, 80 * GiB) == 8 * GiB
    with pytest.raises(ValueError):
        allowed_bytes(1.5, 80 * GiB)
    # 8 GiB allowed: 4 GiB + 4 GiB of segments fit exactly, one byte more does not
    a = NativeAllocator(capacity=allowed_bytes(0.1, 80 * GiB))
    assert a.malloc(4 * GiB) is not None and a.malloc(4 * GiB) is not None
    assert a.malloc(1) is None and a.ooms == 1


@pytest.mark.parametrize(
    "name", ["gpt2_varlen", "bert_varlen", "llama_lora_ckpt", "seed_fragmentation", "gpt2_generate"]
)
def test_native_model_matches_torch_on_recorded_traces(name):
    """The shipped traces' headers hold what torch's allocator reserved and
    allocated at peak when they were recorded on a GPU."""
    t = load_trace(trace_file(name))
    r = replay_native(t)
    assert r.peak_allocated_bytes == t.meta["peak_allocated"]
    assert abs(r.peak_reserved_bytes - t.meta["peak_reserved"]) <= 0.002 * t.meta["peak_reserved"]
    assert r.ooms == 0


@pytest.mark.parametrize("name", ["seed_fragmentation", "llama_lora_ckpt"])
def test_native_min_capacity_lies_where_torch_ran_out_on_a_gpu(name):
    """benchmarks/results/gpu_compare.json holds torch replaying the shipped traces
    on an H100 under shrinking caps: the largest cap that ran out and the smallest
    that ran.  The model's smallest capacity must lie between them, give or take
    0.1% below: under a cap made by taking the device's memory, the driver's own
    bookkeeping for each segment uses some of it too (torch's fraction cap counts
    segments only)."""
    with open(REPO / "benchmarks" / "results" / "gpu_compare.json") as f:
        rows = json.load(f)["figures"]["1"]["rows"]
    (row,) = [r for r in rows if r["trace"] == name and r["contender"] == "native"]
    ran_out = max(p["cap_effective"] for p in row["probes"] if p["status"] == "oom")
    ran = min(p["cap_effective"] for p in row["probes"] if p["status"] == "ok")
    need = min_capacity_native(load_trace(trace_file(name)))
    assert 0.999 * ran_out < need <= ran


def test_native_min_capacity_is_tight():
    t = load_trace(trace_file("seed_fragmentation"))
    need = min_capacity_native(t)
    assert need % (2 * MiB) == 0
    assert fits_native(t, need) and not fits_native(t, need - 2 * MiB)
    assert t.peak_live_bytes <= need <= replay_native(t).peak_reserved_bytes


# ---- torch's cache when a history begins after blocks were live -------------------------------------


def _trace(tmp_path, name, lines):
    """A text trace of `lines` ("alloc ADDR MIB" or "free ADDR")."""
    path = tmp_path / f"{name}.trace"
    out = []
    for line in lines:
        action, addr, *size = line.split()
        mib = float(size[0]) if size else 0
        out.append(f"{'alloc' if action == 'alloc' else 'free_completed'} {int(addr) << 30} {int(mib * MiB)} 0")
    path.write_text("\n".join(out) + "\n")
    return load_trace(str(path))


def test_native_replays_from_the_cache_torch_held(tmp_path):
    """A weight made in fp32 and cast leaves the rest of its segment free: the step's requests take it
    where an empty cache makes segments of their own."""
    t = _trace(tmp_path, "cast", ["alloc 1 62", "alloc 2 32", "alloc 3 16", "free 2", "free 3", "alloc 4 48", "free 4"])
    start = [Segment(1 << 40, False, 0, ((62 * MiB, True), (64 * MiB, False)))]
    assert replay_native(t).peak_reserved_bytes == (62 + 32 + 16 + 48) * MiB
    r = replay_native(with_start(t, start))
    assert r.peak_reserved_bytes == 126 * MiB and r.num_device_alloc == 1


def test_native_start_keeps_torchs_address_order(tmp_path):
    """Of two equal free blocks torch takes the one at the lower address.  With X (the trace's first
    block) up high and Y low, the 40 MiB request goes beside Y: once Y is freed neither segment is
    wholly free, and a 64 MiB request cannot be served under the cap."""
    t = _trace(tmp_path, "order", ["alloc 1 24", "alloc 2 24", "alloc 3 40", "free 2", "alloc 4 64"])
    high = Segment(2 << 40, False, 0, ((24 * MiB, True), (40 * MiB, False)))  # a live block, 40 MiB free
    low = Segment(1 << 40, False, 0, ((24 * MiB, True), (40 * MiB, False)))
    assert not fits_native(with_start(t, [high, low]), 128 * MiB)
    assert fits_native(with_start(t, [low, high]), 128 * MiB)  # X low and Y high: Y's segment comes free


def test_native_start_leaves_out_segments_the_trace_does_not_match(tmp_path):
    t = _trace(tmp_path, "other", ["alloc 1 20", "alloc 2 8", "free 2", "alloc 3 30"])
    grown = Segment(1 << 40, False, 0, ((8 * MiB, True), (12 * MiB, False)))  # the block grew since: 20 MiB now
    assert with_start(t, [grown]) is t and with_start(t, []) is t and with_start(t, None) is t
    kept = Segment(3 << 40, False, 0, ((12 * MiB, True), (30 * MiB, False)))
    t2 = _trace(tmp_path, "other2", ["alloc 1 20", "alloc 2 12", "alloc 3 30"])
    r = replay_native(with_start(t2, [grown, kept]))
    assert r.peak_reserved_bytes == (20 + 42) * MiB  # the 20 MiB block its own segment, the 30 in the cache


def test_forecast_replays_the_native_model_from_the_recorded_cache(tmp_path):
    """The template's recorded cache is where the native model starts, at every value."""
    recs = []
    for k in (1, 2):
        step = ["alloc 1 62", f"alloc 2 {16 * k}", f"alloc 3 {20 * k}", "free 2", "free 3"]
        recs.append(Recording(k, _trace(tmp_path, f"k{k}", step), 512, step_starts=[1]))
    assert Forecast(recs).predict(3).native_capacity_bytes == (62 + 48 + 60) * MiB
    for r in recs:
        r.native_start = [Segment(1 << 40, False, 0, ((62 * MiB, True), (64 * MiB, False)))]
    # the 48 MiB block in the cache (16 MiB remain), the 60 MiB one a segment of its own
    assert Forecast(recs).predict(3).native_capacity_bytes == (126 + 60) * MiB


def test_recording_under_torch_keeps_the_segments_of_the_live_blocks():
    """The cache kept from torch's snapshot: the segments of this device that hold a live block, in
    the order the live blocks are recorded, free blocks and all; none under expandable segments."""
    from types import SimpleNamespace

    from gpumem.forecast.record import _TorchNativeRecorder

    def seg(addr, device, kind, blocks, **kw):
        blocks = [{"size": s * MiB, "state": st} for s, st in blocks]
        return dict(address=addr, device=device, stream=0, segment_type=kind, blocks=blocks, **kw)

    segments = [
        seg(5 << 30, 0, "large", [(62, "active_allocated"), (64, "inactive")]),
        seg(6 << 30, 1, "large", [(20, "active_allocated")]),  # another device
        seg(7 << 30, 0, "large", [(20, "inactive")]),  # wholly free: a warm-up's
        seg(8 << 30, 0, "small", [(1, "active_pending_free"), (1, "inactive")]),
    ]
    memory = SimpleNamespace(_snapshot=lambda: {"segments": segments})
    torch = SimpleNamespace(cuda=SimpleNamespace(memory=memory), device=lambda d: SimpleNamespace(index=d))
    rec = _TorchNativeRecorder(torch, 0)
    assert rec.native_start() == [
        Segment(5 << 30, False, 0, ((62 * MiB, True), (64 * MiB, False))),
        Segment(8 << 30, True, 0, ((MiB, True), (MiB, False))),
    ]
    assert [(a, s) for a, s, _ in rec.live_blocks()] == [(5 << 30, 62 * MiB), (8 << 30, MiB)]
    # a recording reads both from one snapshot
    snapshots = []
    memory._snapshot = lambda: snapshots.append(1) or {"segments": segments}
    live, start = rec.before_step()
    assert len(snapshots) == 1 and live == rec.live_blocks() and start == rec.native_start()
    segments.append(seg(9 << 30, 0, "large", [(20, "active_allocated")], is_expandable=True))
    assert rec.native_start() is None and len(rec.live_blocks()) == 3
