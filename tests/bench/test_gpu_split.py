"""benchmarks/gpu_split.py without a GPU: the simulated columns alone.  At the smallest capacity found
for chunks with splits, chunks with splits and single pages replay the trace whole, chunks without
splits fail, and the heap's checker passes after each."""

import json
import subprocess
import sys

from helpers import REPO


def test_without_a_gpu_the_simulated_rows_say_what_splits_buy(tmp_path):
    out = tmp_path / "split.json"
    subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "gpu_split.py"),
            "--traces",
            "seed_fragmentation",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    d = json.loads(out.read_text())
    rows = {r["way"]: r for r in d["rows"]}
    assert set(rows) == {"chunks, split", "chunks", "single pages"}
    assert rows["chunks, split"]["sim"]["first_oom"] == -1 and rows["chunks, split"]["sim"]["splits"] > 0
    assert rows["single pages"]["sim"]["first_oom"] == -1 and rows["single pages"]["sim"]["splits"] == 0
    assert rows["chunks"]["sim"]["first_oom"] >= 0
    assert all(r["sim"]["check"] for r in d["rows"])
    assert d["cuda"] or all(r["gpu"] is None for r in d["rows"])
