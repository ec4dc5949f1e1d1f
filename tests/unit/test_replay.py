"""Trace loading (both formats), size parsing, and replay on the simulated device."""

import os
import pickle
import struct

import pytest

import gpumem
from gpumem import format_size, parse_size
from gpumem.trace import EVENT_SIZE, R_ALLOC, R_FREE, TraceError, load_trace

from helpers import GiB, MiB, all_traces, snapshot_file, trace_file
from helpers import raw_events, recount_peak, write_bytes, write_text

TRACES = all_traces()


def snapshot_dict(*devices):
    """A torch-shaped snapshot: device_traces[d] is a list of TraceEntry dicts."""
    traces = []
    for events in devices:
        traces.append(
            [
                {"action": a, "addr": addr, "size": size, "stream": stream, "time_us": i, "frames": []}
                for i, (a, addr, size, stream) in enumerate(events)
            ]
        )
    return {"segments": [], "device_traces": traces, "allocator_settings": {}}


def write_pickle(path, obj, compress):
    return write_bytes(path, pickle.dumps(obj), compress)


SMALL = [
    ("segment_alloc", 1000, 4 * MiB, 0),
    ("alloc", 1000, 1 * MiB, 0),
    ("alloc", 2000, 2 * MiB, 7),
    ("free_requested", 1000, 1 * MiB, 0),
    ("free_completed", 1000, 1 * MiB, 0),
    ("alloc", 3000, 512, 0),
    ("free_requested", 2000, 2 * MiB, 7),
    ("free_completed", 2000, 2 * MiB, 7),
    ("alloc", 1000, 3 * MiB, 0),  # address reused after its free completed
]


# ---- sizes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [
        ("24GiB", 24 * GiB),
        ("1.5 GB", 1_500_000_000),
        ("512MiB", 512 * MiB),
        ("100", 100),
        ("80G", 80 * GiB),
        ("2 kib", 2048),
        ("4kB", 4000),
        ("0.5GiB", GiB // 2),
        ("  7 B ", 7),
        ("1e3", 1000),
        (4096, 4096),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "junk",
    ["", "GiB", "-1", "-1GiB", "1.2.3", "12 XB", "1 2 GiB", "nan", "inf", "0x10", "١٠", None, 1.5, True, -5, [1]],
)
def test_parse_size_rejects(junk):
    with pytest.raises(ValueError):
        parse_size(junk)


def test_format_size():
    assert format_size(0) == "0 B"
    assert format_size(1023) == "1023 B"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(2 * GiB) == "2.00 GiB"
    assert format_size(80 * GiB + 10 * MiB) == "80.01 GiB"
    # the extension formats its messages the same way
    for n in (0, 1023, 1536, 3 * MiB + 1, 80 * GiB):
        assert gpumem._C.format_bytes(n) == format_size(n)


def test_package_exports():
    for name in (
        "Heap",
        "OutOfMemoryError",
        "InvalidPointerError",
        "CorruptionError",
        "DeviceError",
        "parse_size",
        "format_size",
        "__version__",
    ):
        assert hasattr(gpumem, name), name
    assert gpumem.Heap is gpumem._C.Heap
    assert issubclass(gpumem.OutOfMemoryError, RuntimeError)
    assert issubclass(gpumem.InvalidPointerError, ValueError)
    assert issubclass(gpumem.DeviceError, RuntimeError)
    assert issubclass(TraceError, ValueError)


# ---- text traces ----------------------------------------------------------------


@pytest.mark.parametrize("compress", [True, False])
def test_text_trace_pairs_frees_with_allocs(tmp_path, compress):
    path = write_text(
        tmp_path / ("t.trace.gz" if compress else "t.trace"), [" ".join(map(str, e)) for e in SMALL], compress=compress
    )
    t = load_trace(path)
    assert t.format == "text" and t.name == "t"
    assert t.meta == {"workload": "t"}
    decoded = list(t.decode())
    # segment_alloc and free_requested are dropped; 4 allocs + 2 frees remain
    assert [op for op, *_ in decoded] == [R_ALLOC, R_ALLOC, R_FREE, R_ALLOC, R_FREE, R_ALLOC]
    assert t.allocs == 4 and t.frees == 2 and t.n_events == 6
    assert len(t.events) == 6 * EVENT_SIZE
    # each free names the slot of its alloc, and carries the alloc's size
    a0, a1, f0, a2, f1, a3 = decoded
    assert f0[1] == a0[1] and f0[2] == MiB
    assert f1[1] == a1[1] and f1[3] == 7
    assert a1[3] == 7 and a1[2] == 2 * MiB
    # slots are reused, so the table is as small as the most blocks live at once
    assert t.n_slots == 2
    assert all(slot < t.n_slots for _, slot, _, _ in decoded)
    assert t.peak_live_bytes == recount_peak(SMALL) == 3 * MiB + 512


def test_events_match_struct_layout(tmp_path):
    path = write_text(tmp_path / "t.trace.gz", ["alloc 4096 1536 99", "free_completed 4096 1536 99"])
    t = load_trace(path)
    assert struct.unpack("<IIQQ", bytes(t.events[:EVENT_SIZE])) == (R_ALLOC, 0, 1536, 99)
    assert struct.unpack("<IIQQ", bytes(t.events[EVENT_SIZE:])) == (R_FREE, 0, 1536, 99)


def test_chunks_cover_all_events(tmp_path):
    lines = []
    for i in range(50):
        lines += [f"alloc {i * 4096} 512 0"]
    lines += [f"free_completed {i * 4096} 512 0" for i in range(50)]
    t = load_trace(write_text(tmp_path / "t.trace.gz", lines))
    parts = list(t.chunks(7))
    assert [start for start, _ in parts] == list(range(0, 100, 7))
    assert b"".join(bytes(mv) for _, mv in parts) == bytes(t.events)


def expect_error(path, fragment, where=None, **kw):
    with pytest.raises(TraceError) as info:
        load_trace(path, **kw)
    msg = str(info.value)
    assert "\n" not in msg
    assert fragment in msg, msg
    prefix = f"{path}:{where}:" if where is not None else f"{path}:"
    assert msg.startswith(prefix), msg
    return msg


def test_text_errors(tmp_path):
    ok = ["alloc 4096 512 0"]
    expect_error(tmp_path / "missing.trace.gz", "no such file")
    expect_error(write_text(tmp_path / "a.gz", ok + ["frobnicate 1 2 3"]), "unknown action 'frobnicate'", 3)
    expect_error(write_text(tmp_path / "b.gz", ok + ["free_completed 8192 512 0"]), "free of unknown address 0x2000", 3)
    expect_error(write_text(tmp_path / "c.gz", ["alloc 4096 -512 0"]), "negative size -512", 2)
    expect_error(write_text(tmp_path / "d.gz", ok + ["alloc 4096 512"]), "malformed line", 3)
    expect_error(write_text(tmp_path / "e.gz", ok + ["alloc 0x10 512 0"]), "malformed line", 3)
    expect_error(write_text(tmp_path / "f.gz", ok + ["alloc 4096 512 0"]), "still live", 3)
    expect_error(
        write_text(tmp_path / "g.gz", ok + ["free_completed 4096 512 0", "free_completed 4096 512 0"]),
        "free of unknown address",
        4,
    )
    expect_error(write_text(tmp_path / "h.gz", ok), "one device", None, device=1)
    expect_error(tmp_path, "directory")


def test_corrupt_gzip(tmp_path):
    good = write_text(tmp_path / "good.trace.gz", [f"alloc {i * 512} 512 0" for i in range(20000)])
    data = good.read_bytes()
    truncated = tmp_path / "trunc.trace.gz"
    truncated.write_bytes(data[: len(data) // 2])
    expect_error(truncated, "corrupt gzip")
    garbage = tmp_path / "garbage.trace.gz"
    garbage.write_bytes(b"\x1f\x8b" + bytes(range(256)) * 4)
    expect_error(garbage, "corrupt gzip")
    flipped = bytearray(data)
    flipped[len(flipped) // 2] ^= 0xFF
    bad = tmp_path / "flipped.trace.gz"
    bad.write_bytes(bytes(flipped))
    with pytest.raises(TraceError):
        load_trace(bad)


def test_binary_junk_is_not_a_trace(tmp_path):
    p = tmp_path / "junk.trace"
    p.write_bytes(b"alloc 1 2 3\n\xff\xfe\xfa\n")
    expect_error(p, "not UTF-8")


# ---- torch snapshots ------------------------------------------------------------


@pytest.mark.parametrize("compress", [True, False])
def test_snapshot_pickle(tmp_path, compress):
    name = "snap.pickle.gz" if compress else "snap.pickle"
    path = write_pickle(
        tmp_path / name, snapshot_dict(SMALL + [("oom", 0, 1 << 40, 0), ("snapshot", 0, 0, 0)]), compress
    )
    t = load_trace(path)
    text = load_trace(write_text(tmp_path / "same.trace.gz", [" ".join(map(str, e)) for e in SMALL]))
    assert t.format == "snapshot" and t.device == 0
    assert bytes(t.events) == bytes(text.events)
    assert (t.n_slots, t.peak_live_bytes) == (text.n_slots, text.peak_live_bytes)


def test_snapshot_device_choice(tmp_path):
    dev0 = [("alloc", 4096, 512, 0), ("free_completed", 4096, 512, 0)]
    dev1 = [("alloc", 4096, 3 * MiB, 5), ("alloc", 8192, MiB, 5)]
    path = write_pickle(tmp_path / "two.pickle", snapshot_dict(dev0, dev1), False)
    assert load_trace(path).peak_live_bytes == 512
    t1 = load_trace(path, device=1)
    assert t1.device == 1 and t1.peak_live_bytes == 4 * MiB and t1.allocs == 2 and t1.frees == 0
    expect_error(path, "no device 2", None, device=2)


def test_snapshot_free_of_address_live_on_other_device(tmp_path):
    dev0 = [("alloc", 4096, 512, 0), ("free_completed", 1 << 20, 512, 0)]
    dev1 = [("alloc", 1 << 20, 512, 0)]
    path = write_pickle(tmp_path / "cross.pickle.gz", snapshot_dict(dev0, dev1), True)
    msg = expect_error(path, "allocated on device 1", "device_traces[0][1]")
    assert "0x100000" in msg


def test_snapshot_errors(tmp_path):
    def snap(events, name):
        return write_pickle(tmp_path / name, snapshot_dict(events), True)

    expect_error(
        snap([("alloc", 1, 512, 0), ("boom", 1, 512, 0)], "a.pickle.gz"), "unknown action 'boom'", "device_traces[0][1]"
    )
    # a free the history never saw allocated is a block live before it; a second one of that address is a double free
    twice = [("free_completed", 1, 512, 0), ("free_completed", 1, 512, 0)]
    expect_error(snap(twice, "b.pickle.gz"), "already freed at device_traces[0][0]", "device_traces[0][1]")
    expect_error(snap([("alloc", 1, -1, 0)], "c.pickle.gz"), "negative size", "device_traces[0][0]")
    bad = snapshot_dict([("alloc", 1, 512, 0)])
    del bad["device_traces"][0][0]["size"]
    expect_error(write_pickle(tmp_path / "d.pickle", bad, False), "no 'size'", "device_traces[0][0]")
    expect_error(write_pickle(tmp_path / "e.pickle", {"segments": []}, False), "no 'device_traces'")
    expect_error(write_pickle(tmp_path / "f.pickle", [1, 2, 3], False), "no 'device_traces'")
    trunc = tmp_path / "g.pickle"
    trunc.write_bytes(pickle.dumps(snapshot_dict(SMALL))[:40])
    expect_error(trunc, "not a readable pickle")


class Sneaky:
    def __reduce__(self):
        return (os.getcwd, ())


def test_snapshot_pickle_with_code_is_refused(tmp_path):
    evil = snapshot_dict([("alloc", 1, 512, 0)])
    evil["extra"] = Sneaky()
    expect_error(write_pickle(tmp_path / "evil.pickle", evil, False), "only plain data")


def test_sample_snapshot_matches_its_text_trace():
    """The shipped sample snapshot is the torch pickle of the seed_fragmentation run:
    both loaders must produce the very same events."""
    snap = load_trace(snapshot_file())
    text = load_trace(trace_file("seed_fragmentation"))
    assert snap.format == "snapshot" and snap.allocs == 401
    assert bytes(snap.events) == bytes(text.events)
    assert snap.peak_live_bytes == text.peak_live_bytes


# ---- replay ---------------------------------------------------------------------

from gpumem.replay import _narrow, fits, min_capacity, replay, replay_trace  # noqa: E402


def test_narrow_finds_the_edge_in_few_probes():
    # min_capacity and Forecast.largest bisect with it: the last value that holds
    # and the first that does not, each probe inside (lo, hi), about log2(hi - lo) of them
    for lo, hi in [(0, 1), (0, 2), (3, 100), (1, 1 << 40)]:
        for edge in {lo + 1, (lo + hi) // 2, hi - 1, hi} - {lo}:
            probes = []

            def holds(x, edge=edge, probes=probes):
                probes.append(x)
                return x < edge

            assert _narrow(lo, hi, holds) == (edge - 1, edge)
            assert all(lo < x < hi for x in probes) and len(probes) <= (hi - lo).bit_length()


@pytest.mark.parametrize("path", TRACES, ids=lambda p: p.name.split(".")[0])
def test_shipped_trace_replays_at_default_capacity(path):
    t = load_trace(path)
    assert t.peak_live_bytes == recount_peak(raw_events(path))
    r = replay(t, timing=True)
    assert r.ooms == 0 and r.first_oom_event == -1
    assert r.allocs == t.allocs and r.frees == t.frees
    assert r.peak_live_bytes == t.peak_live_bytes
    assert r.peak_reserved_bytes >= r.peak_live_bytes
    assert r.ns_per_op is not None and r.ns_per_op > 0


def test_chunked_replay_equals_one_call():
    t = load_trace(trace_file("seed_fragmentation"))
    seen = []
    cap = 2 * GiB  # tight enough that chunk boundaries matter if slots were lost
    whole = replay(t, cap, timing=False)
    chunked = replay(t, cap, timing=False, progress=lambda done, total: seen.append((done, total)), chunk=100)
    assert seen[0] == (0, t.n_events) and seen[-1] == (t.n_events, t.n_events)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen) and len(seen) == 1 + -(-t.n_events // 100)
    assert whole == chunked


def test_chunked_replay_small_chunks(tmp_path):
    lines = [f"alloc {i * 4096} {(i % 5 + 1) * 512} 0" for i in range(300)]
    lines += [f"free_completed {i * 4096} {(i % 5 + 1) * 512} 0" for i in range(0, 300, 2)]
    lines += [f"alloc {i * 4096} 1024 0" for i in range(0, 300, 2)]
    lines += [f"free_completed {i * 4096} 0 0" for i in range(300)]
    t = load_trace(write_text(tmp_path / "t.trace.gz", lines))
    h = gpumem.Heap(capacity=GiB)
    try:
        out = replay_trace(h, t, progress=lambda *_: None, chunk=13)
        s = h.stats()
        assert out["allocs"] == 450 and out["frees"] == 450 and out["ooms"] == 0
        # every block was freed, in chunks other than the one that allocated it
        assert s["allocated_bytes.all.current"] == 0
        assert s["allocated_bytes.all.peak"] == t.peak_live_bytes
        h.check()
    finally:
        h.close()


def test_replay_rejects_bad_events():
    h = gpumem.Heap(capacity=GiB)
    try:
        good = struct.pack("<IIQQ", 0, 0, 512, 0)
        with pytest.raises(ValueError, match="slot"):
            h.replay(struct.pack("<IIQQ", 0, 5, 512, 0), 1)
        with pytest.raises(ValueError, match="op"):
            h.replay(struct.pack("<IIQQ", 9, 0, 512, 0), 1)
        with pytest.raises(ValueError, match="whole number"):
            h.replay(good[:-1], 1)
        with pytest.raises(ValueError, match="slots"):
            h.replay(good, 1, slots=bytearray(4))
        # an unaligned view is copied, not rejected
        buf = bytearray(1) + bytearray(good)
        r = h.replay(memoryview(buf)[1:], 1, timing=True)
        assert r["allocs"] == 1 and len(r["op_ns"]) == 1
    finally:
        h.close()
    with pytest.raises(ValueError, match="closed"):
        h.replay(good, 1)


def test_oom_message(tmp_path):
    h = gpumem.Heap(capacity=64 * MiB)
    try:
        with pytest.raises(gpumem.OutOfMemoryError) as info:
            h.malloc(GiB)
        msg = str(info.value)
        assert msg.startswith("CUDA out of memory. Tried to allocate 1.00 GiB. "), msg
        first, _, rest = msg.partition("\n")
        assert "a total capacity of 64.00 MiB" in first
        # gpumem.explain's report follows the one-line summary (see tests/unit/test_explain.py)
        assert "[too_big]" in rest
        assert info.value.info["request"] == GiB
        assert h.last_oom()["request"] == GiB
    finally:
        h.close()


def test_replay_counts_ooms_when_capacity_is_short(tmp_path):
    lines = [f"alloc {i * 8 * MiB} {4 * MiB} 0" for i in range(10)]
    t = load_trace(write_text(tmp_path / "t.trace.gz", lines))
    r = replay(t, 16 * MiB, timing=False)
    assert r.ooms > 0 and r.first_oom_event >= 3
    assert r.peak_live_bytes <= 16 * MiB
    assert not fits(t, 16 * MiB) and fits(t, 64 * MiB)


def test_min_capacity_synthetic(tmp_path):
    lines = [f"alloc {i * 8 * MiB} {3 * MiB} 0" for i in range(10)]
    t = load_trace(write_text(tmp_path / "t.trace.gz", lines))
    mc = min_capacity(t)
    assert mc % MiB == 0 and mc >= t.peak_live_bytes
    assert fits(t, mc) and not fits(t, mc - MiB)


@pytest.mark.parametrize(
    "path",
    [p for p in TRACES if "gpt2_generate" not in p.name]
    + [pytest.param(p, marks=pytest.mark.slow) for p in TRACES if "gpt2_generate" in p.name],
    ids=lambda p: p.name.split(".")[0],
)
def test_min_capacity_shipped(path):
    t = load_trace(path)
    mc = min_capacity(t)
    assert mc % MiB == 0 and mc >= t.peak_live_bytes
    assert fits(t, mc)
    assert not fits(t, mc - 2 * MiB)
