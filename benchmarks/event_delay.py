"""Peak memory of trace replays when events complete late, on the sim device.

By default the simulated device completes an event at once, so memory that one
stream freed is handed to another stream the first time it asks.  On a GPU the
freeing stream's queued work is still running then.  `replay(..., event_delay=N)`
makes events recorded on any stream but 0 complete only after N further device
operations (or at a synchronize).  This benchmark replays:

* every shipped trace (gpumem/data/traces): all record on stream 0 only, so the
  delay must change nothing;
* a synthetic two-stream trace (`two_stream_trace`): each step, stream A
  allocates and frees a batch of blocks, then stream B asks for the same amount.
  With events at once B reuses A's memory; with late events B grows first.

at each delay and prints peak live, peak reserved, reserved / live and the
heap's device synchronisations; the synthetic trace also with a wide growth
limit (growth_slack=1.0), where the default one does not cap what a delay adds.

Then, near the limit, where late events matter: for the synthetic trace and the
shipped multi-stream traces (MULTISTREAM), the smallest capacity each replays
in at each delay, with the hand-off between streams (the default) and with
`stream_handoff=0`, and the device synchronisations and hand-offs of a replay
at that capacity.

Usage: python benchmarks/event_delay.py [--delays 0,10,100] [--json benchmarks/results/event_delay.json]
"""

import argparse
import json
import os
import sys
import tempfile

try:
    import gpumem
except ImportError:  # not installed: use the checkout (built with build_ext --inplace)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import gpumem
from gpumem.replay import DEFAULT_CAPACITY, min_capacity, replay, replay_trace  # noqa: E402
from gpumem.data import list_traces  # noqa: E402
from gpumem.trace import load_trace  # noqa: E402

MiB = 1 << 20
MULTISTREAM = ("prefetch_loader", "two_stream_pipeline", "overlap_comm")
STREAM_A = 0x7F0000001000
STREAM_B = 0x7F0000002000


def two_stream_trace(path: str, steps: int = 20, blocks: int = 8) -> str:
    """Write the synthetic two-stream text trace to `path` and return it.

    First 256 MiB stay live on stream 0 throughout (weights).  Each step: stream A
    allocates `blocks` blocks of 3..10 MiB and frees them; then stream B allocates
    blocks of the same sizes and frees them.  Peak live is the weights plus one
    batch; a heap that hands A's memory to B at once needs no more than that.
    """
    addr = 1 << 32
    lines = [f"alloc {addr} {256 * MiB} 0"]
    addr += 256 * MiB
    for step in range(steps):
        sizes = [(3 + (step * 7 + i * 5) % 8) * MiB for i in range(blocks)]
        for stream in (STREAM_A, STREAM_B):
            addrs = []
            for size in sizes:
                lines.append(f"alloc {addr} {size} {stream}")
                addrs.append((addr, size))
                addr += size
            for a, size in addrs:
                lines.append(f"free_completed {a} {size} {stream}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def measure(trace, delay: int, heap_kwargs: dict) -> dict:
    r = replay(trace, timing=False, event_delay=delay, heap_kwargs=heap_kwargs)
    # A second pass for the device synchronisations, which ReplayResult does not carry.
    heap = gpumem.Heap(device="sim", capacity=DEFAULT_CAPACITY, **heap_kwargs)
    try:
        heap.sim_set_event_delay(delay)
        replay_trace(heap, trace)
        syncs = heap.stats()["num_sync_all_streams"]
    finally:
        heap.close()
    return {
        "trace": trace.name,
        "heap_kwargs": heap_kwargs,
        "event_delay": delay,
        "peak_live_bytes": r.peak_live_bytes,
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "ooms": r.ooms,
        "num_sync_all_streams": syncs,
    }


def near_the_limit(trace, delay: int, handoff: int) -> dict:
    """The smallest capacity (1 MiB steps) and a replay at it: device syncs and hand-offs."""
    kw = {"stream_handoff": handoff}
    cap = min_capacity(trace, precision=MiB, heap_kwargs=kw, event_delay=delay)
    heap = gpumem.Heap(device="sim", capacity=cap, **kw)
    try:
        heap.sim_set_event_delay(delay)
        replay_trace(heap, trace)
        st = heap.stats()
    finally:
        heap.close()
    return {
        "trace": trace.name,
        "event_delay": delay,
        "stream_handoff": handoff,
        "peak_live_bytes": trace.peak_live_bytes,
        "min_capacity_bytes": cap,
        "num_sync_all_streams": st["num_sync_all_streams"],
        "num_stream_handoffs": st["num_stream_handoffs"],
    }


def print_near(rows) -> None:
    head = f"{'min capacity MiB':>17} {'÷ live':>8} {'syncs':>6} {'hand-offs':>9}"
    print(f"\n{'trace':<20} {'delay':>6} {'hand-off':>9} {head}")
    for r in rows:
        cap = r["min_capacity_bytes"]
        print(
            f"{r['trace']:<20} {r['event_delay']:>6} {'on' if r['stream_handoff'] else 'off':>9} {cap / MiB:>17.0f} "
            f"{cap / r['peak_live_bytes']:>8.4f} {r['num_sync_all_streams']:>6} {r['num_stream_handoffs']:>9}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--delays", default="0,10,100", help="comma-separated event delays (default 0,10,100)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = ap.parse_args(argv)
    delays = [int(d) for d in args.delays.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        traces = [load_trace(name) for name in list_traces()]
        synth = load_trace(two_stream_trace(os.path.join(tmp, "two_stream.trace")))
        for trace in traces + [synth]:
            for d in delays:
                rows.append(measure(trace, d, {}))
        # The default growth limit (1% of peak live + 4 pages) caps what late
        # events can add: past it the heap waits for the device instead.  With a
        # wide limit the delay shows in full.
        for d in delays:
            rows.append(measure(synth, d, {"growth_slack": 1.0}))
        near = [
            near_the_limit(trace, d, handoff)
            for trace in [synth] + [load_trace(name) for name in MULTISTREAM]
            for d in delays
            for handoff in (1, 0)
        ]
    print(
        f"{'trace':<20} {'heap':<18} {'delay':>6} {'peak live MiB':>14} {'peak reserved MiB':>18} "
        f"{'reserved/live':>14} {'syncs':>6} {'OOMs':>5}"
    )
    for r in rows:
        live, resv = r["peak_live_bytes"], r["peak_reserved_bytes"]
        kw = ",".join(f"{k}={v}" for k, v in r["heap_kwargs"].items()) or "default"
        print(
            f"{r['trace']:<20} {kw:<18} {r['event_delay']:>6} {live / MiB:>14.1f} {resv / MiB:>18.1f} "
            f"{resv / live:>14.3f} {r['num_sync_all_streams']:>6} {r['ooms']:>5}"
        )
    print_near(near)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "near_the_limit": near}, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
