"""Replays and simulated heaps at the Python boundary: a trace replayed in
chunks counts live bytes across them, and no simulated heap -- whatever made
it -- grows host memory without bound.  .ci/boundary_asan runs this file
under ASan and UBSan."""

import struct
import os
import sys
from array import array

import pytest

import gpumem

KiB, MiB = 1 << 10, 1 << 20
EV = struct.Struct("<IIQQ")


def events(*evs):
    return b"".join(EV.pack(op, slot, size, 0) for op, slot, size in evs)


def test_chunks_sharing_a_slot_table_carry_the_live_bytes_over():
    """Each call restarted its live-bytes counter at 0, so a chunk freeing what
    an earlier one allocated wrapped it: peak_live_bytes 2**64 - 1044480."""
    h = gpumem.Heap(device="sim", capacity="64MiB")
    slots = array("Q", bytes(8 * 4))
    r1 = h.replay(events((0, 0, MiB), (0, 1, 4 * KiB)), 4, slots=slots)
    assert (r1["peak_live_bytes"], r1["live_bytes"]) == (MiB + 4 * KiB, MiB + 4 * KiB)
    r2 = h.replay(events((1, 0, 0), (0, 2, 4 * KiB)), 4, slots=slots)  # live_bytes left None: summed
    assert (r2["peak_live_bytes"], r2["live_bytes"]) == (MiB + 4 * KiB, 8 * KiB)
    r3 = h.replay(events((1, 1, 0), (1, 2, 0)), 4, slots=slots, live_bytes=r2["live_bytes"])
    assert (r3["peak_live_bytes"], r3["live_bytes"]) == (8 * KiB, 0)
    # A wrong live_bytes never wraps the counter.
    h.replay(events((0, 3, 4 * KiB)), 4, slots=slots)
    r4 = h.replay(events((1, 3, 0)), 4, slots=slots, live_bytes=0)
    assert r4["live_bytes"] == 0 and r4["peak_live_bytes"] == 0
    with pytest.raises(ValueError):
        h.replay(events(), 4, slots=slots, live_bytes=-1)
    h.close()


def test_replay_in_chunks_gives_the_peak_of_one_call():
    from gpumem.replay import replay_trace
    from gpumem.trace import Trace

    evs = [(0, i, (i % 7 + 1) * 64 * KiB) for i in range(200)] + [(1, i, 0) for i in range(200)]
    evs += [(0, 200 + i, 3 * MiB) for i in range(5)] + [(1, 200 + i, 0) for i in range(5)]
    words = array("Q", [w for op, slot, size in evs for w in (op | slot << 32, size, 0)])
    trace = Trace("chunks", "text", 0, words, 205, 205, 205, 0, -1)
    whole = gpumem.Heap(device="sim", capacity="256MiB").replay(trace.events, trace.n_slots)
    h = gpumem.Heap(device="sim", capacity="256MiB")
    slots, live, peak = array("Q", bytes(8 * trace.n_slots)), 0, 0
    for _start, chunk in trace.chunks(7):
        r = h.replay(chunk, trace.n_slots, slots=slots, live_bytes=live)
        live, peak = r["live_bytes"], max(peak, r["peak_live_bytes"])
    assert peak == whole["peak_live_bytes"] and live == 0
    assert replay_trace(gpumem.Heap(device="sim", capacity="256MiB"), trace, progress=lambda *a: None, chunk=5)


# ---- one bound on every simulated heap's host memory ----------------------------------------------


def two_traces(tmp_path):
    """Two small text traces of one step at knob values 2 and 4."""
    paths = []
    for k in (2, 4):
        p = tmp_path / f"k{k}.trace"
        p.write_text(
            "".join(f"alloc {4096 * (i + 1)} {k * MiB} 0\n" for i in range(3)) + f"free_completed 4096 {k * MiB} 0\n"
        )
        paths.append(str(p))
    return paths


@pytest.mark.parametrize(
    "kw",
    [
        dict(capacity="1TiB", page_size=4096),  # malloc(1 << 40) grew host memory until OOM-killed at 24 GB
        dict(capacity="1PB"),
        dict(capacity=1 << 63),
        dict(capacity="64TiB", page_size=MiB),
    ],
)
def test_a_simulated_device_with_too_many_pages_is_refused(kw):
    with pytest.raises(ValueError, match="lower capacity or raise page_size"):
        gpumem.Heap(device="sim", **kw)


def test_the_largest_simulated_devices_are_made():
    from gpumem import _C

    for kw in (dict(capacity=_C.SIM_MAX_PAGES * _C.SIM_PAGE_SIZE), dict(capacity="128GiB", page_size=4096)):
        gpumem.Heap(device="sim", **kw).close()


def test_replay_and_forecast_keep_to_the_same_bound(tmp_path):
    from gpumem.forecast import Forecast
    from gpumem.replay import replay

    a, b = two_traces(tmp_path)
    with pytest.raises(ValueError, match="lower capacity or raise page_size"):
        replay(a, capacity=1 << 50)
    fc = Forecast.from_traces([a, b], [2, 4])
    with pytest.raises(ValueError, match="lower capacity or raise page_size"):
        fc.fits(2, capacity=1 << 50)


@pytest.mark.parametrize("option", ["--device-memory", "--cap"])
def test_forecast_names_the_option_that_asks_too_much(tmp_path, option):
    import subprocess

    cmd = [sys.executable, "-m", "gpumem", "forecast", *two_traces(tmp_path), "--knob", "2,4", option, "1PB"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and f"argument {option}: capacity '1PB' is more than" in p.stderr


def test_a_heap_without_host_memory_for_its_tables_says_so():
    """It said "CUDA out of memory. cannot create heap: host memory", for a
    simulated heap whose host ran short."""
    import subprocess

    if "asan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("under AddressSanitizer an address-space limit starves the sanitizer's own mappings")

    code = (
        "import resource, gpumem\n"
        "resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))\n"
        "try:\n"
        "    gpumem.Heap(device='sim', capacity='64TiB')\n"
        "except MemoryError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if "MemoryError" not in p.stdout:
        pytest.skip("the address-space limit did not take (a sanitizer reserves more)")
    assert p.stdout.startswith("MemoryError cannot create heap: out of host memory") and "CUDA" not in p.stdout


# ---- traces whose header or frames claim too much ------------------------------------------------


@pytest.mark.parametrize("value", ["Infinity", "-Infinity", "NaN", "1e300", "0.5", "true", "-512", "4194304", '"512"'])
def test_a_size_granularity_out_of_range_is_a_trace_error(tmp_path, value):
    """Infinity gave a bare OverflowError; a large value silently turned every
    size change into rounding (no quadratic fit)."""
    from gpumem.forecast.align import Recording
    from gpumem.trace import TraceError, load_trace

    p = tmp_path / "g.trace"
    p.write_text('# {"size_granularity": %s}\nalloc 4096 1024 0\n' % value)
    with pytest.raises(TraceError, match="size_granularity must be a whole number of bytes from 1 to 2 MiB"):
        Recording.granularity_of(load_trace(str(p)))


@pytest.mark.parametrize("value", [1, 512, 2 * MiB])
def test_a_size_granularity_in_range_is_taken(tmp_path, value):
    from gpumem.forecast.align import Recording
    from gpumem.trace import load_trace

    p = tmp_path / "g.trace"
    p.write_text('# {"size_granularity": %d}\nalloc 4096 1024 0\n' % value)
    assert Recording.granularity_of(load_trace(str(p))) == value


def test_a_pickle_frame_longer_than_memory_says_why(tmp_path):
    """A frame length of 2**62 made the unpickler raise MemoryError(), and the
    message read "not a readable pickle: " with nothing after it."""
    if "asan" in os.environ.get("LD_PRELOAD", ""):
        pytest.skip("AddressSanitizer reports the 2**62-byte allocation it refuses; the wording needs no sanitizer")
    from gpumem.trace import TraceError, load_trace

    p = tmp_path / "huge.pickle"
    p.write_bytes(b"\x80\x04\x95" + struct.pack("<Q", 1 << 62) + b"}.")
    with pytest.raises(TraceError, match="not a readable pickle: it claims more memory than this host has"):
        load_trace(str(p))
    p.write_bytes(b"\x80\x04\x95" + struct.pack("<Q", 1 << 20) + b"}.")  # a frame cut short
    with pytest.raises(TraceError, match=r"not a readable pickle: \S"):
        load_trace(str(p))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
