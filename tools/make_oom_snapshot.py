"""Make gpumem/data/snapshots/sim_oom.pickle.gz: a torch-format memory snapshot
that ends in an out-of-memory error, so that `gpumem explain sim_oom` can be
tried on a machine with no GPU.

It runs on the simulated device (1 GiB) with gpumem's history on: a loop keeps
about nine activation-sized blocks live (24 to 72 MiB, freed out of order), then
asks for 900 MiB, which cannot fit beside what is live; the snapshot is written
by gpumem's own writer (gpumem.dump_snapshot, torch's _snapshot() format) and
gzip'd.  The blocks and events are the same on every run; the recorded times are not.

    PYTHONPATH=. python3 tools/make_oom_snapshot.py [OUT]    (default: the shipped file)
"""

import gzip
import os
import random
import sys
import tempfile

import gpumem

MiB = 1 << 20
DEFAULT_OUT = os.path.join(os.path.dirname(gpumem.__file__), "data", "snapshots", "sim_oom.pickle.gz")


def make(out: str) -> str:
    rng = random.Random(7)
    with gpumem.Heap(device="sim", capacity="1GiB") as h:
        gpumem.record_history(True, device=h)
        live = []
        for _ in range(200):
            live.append(h.malloc(rng.choice([24, 40, 56, 72]) * MiB))
            if len(live) > 8:
                h.free(live.pop(rng.randrange(len(live) - 4)))
        try:
            h.malloc(900 * MiB)
        except gpumem.OutOfMemoryError:
            pass
        else:
            raise SystemExit("the 900 MiB request fitted: no OOM to snapshot")
        with tempfile.TemporaryDirectory() as tmp:
            plain = os.path.join(tmp, "oom.pickle")
            gpumem.dump_snapshot(plain, device=h)
            with open(plain, "rb") as src, open(out, "wb") as raw:
                with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
                    gz.write(src.read())
    return out


if __name__ == "__main__":
    path = make(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT)
    print(f"wrote {path} ({os.path.getsize(path)} bytes)")
