"""The traces and snapshot shipped with gpumem (gpumem/data) and their short names.

These tests need no source tree: they run against an installed wheel too."""

import gzip
import json
import os
import pathlib
import subprocess
import sys

import pytest

import gpumem
from gpumem import data
from gpumem.__main__ import main
from gpumem.trace import TraceError, load_trace

from helpers import TRACE_NAMES


def test_every_trace_is_shipped():
    assert data.list_traces() == sorted(TRACE_NAMES)
    assert data.list_snapshots() == ["bert_mlm_late", "llama_train_ring", "sample_snapshot", "sim_oom"]
    for name in TRACE_NAMES:
        p = data.trace_path(name)
        assert p.is_file() and p.name == f"{name}.trace.gz" and p.parent == data.TRACES_DIR
        with gzip.open(p, "rt") as f:
            head = f.readline()
        # the first line is the comment that carries the native allocator's figures
        assert head.startswith("# action addr size stream"), head
        meta = json.loads(head[head.index("{") : head.rindex("}") + 1])
        assert meta["peak_allocated"] > 0


def test_provenance_travels_with_the_data():
    readme = (data.TRACES_DIR / "README.md").read_text()
    assert "## Format" in readme and "H100" in readme and "_record_memory_history" in readme
    zoo = {r["name"]: r for r in data.zoo()}
    assert "## The zoo" in readme
    for name in TRACE_NAMES:
        if name in zoo:  # a zoo trace carries its provenance in its header
            assert zoo[name]["workload"] == name and zoo[name]["gpu"] and zoo[name]["torch"], name
            assert all(zoo[name][k] for k in ("family", "mode", "knob", "exercises")), name
        else:
            assert f"| {name} |" in readme, name
    assert "sample_snapshot.pickle.gz" in (data.SNAPSHOTS_DIR / "README.md").read_text()


def test_the_zoo_is_broad():
    zoo = data.zoo()
    assert len(zoo) >= 24 and len({r["family"] for r in zoo}) >= 8
    assert {r["knob"] for r in zoo} >= {"batch", "sequence length", "resolution"}
    assert any(r["streams"] > 1 for r in zoo)  # a graph's capture stream, at least
    assert all(data.trace_info(r["name"]) == {k: v for k, v in r.items() if k != "name"} for r in zoo)
    with pytest.raises(data.UnknownDataError):
        data.trace_info("no_such_trace")


def test_data_lives_in_the_imported_package():
    assert data.DATA_DIR == pathlib.Path(gpumem.__file__).resolve().parent / "data"


def test_short_name_and_path_load_the_same_trace():
    by_name = load_trace("seed_fragmentation")
    by_path = load_trace(data.trace_path("seed_fragmentation"))
    assert by_name.path == str(data.trace_path("seed_fragmentation"))
    assert bytes(by_name.events) == bytes(by_path.events) and by_name.allocs == 401
    assert load_trace("sample_snapshot").format == "snapshot"


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(data.UnknownDataError) as e:
        data.trace_path("gpt3_varlen")
    msg = str(e.value)
    assert "gpt3_varlen" in msg and all(n in msg for n in TRACE_NAMES) and "\n" not in msg
    with pytest.raises(TraceError, match="no such file; no trace named 'gpt3_varlen'"):
        load_trace("gpt3_varlen")
    # a name with a directory part is never looked up in the shipped data
    with pytest.raises(data.UnknownDataError):
        data.trace_path("../traces/gpt2_varlen")


def test_a_file_in_the_working_directory_wins_over_a_shipped_name(tmp_path, monkeypatch):
    (tmp_path / "gpt2_varlen").write_text("alloc 0 512 0\nfree_completed 0 512 0\n")
    monkeypatch.chdir(tmp_path)
    assert load_trace("gpt2_varlen").allocs == 1


def test_cli_replays_by_short_name(capsys):
    assert main(["replay", "seed_fragmentation", "--json", "--no-timing", "--capacity", "2GiB"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["trace"] == "seed_fragmentation" and row["name"] == "seed_fragmentation"
    assert row["allocs"] == 401 and row["ooms"] == 0


def test_cli_unknown_name_is_one_line_and_exit_2(capsys):
    assert main(["replay", "gpt2_varlenn", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("gpumem: error: gpt2_varlenn: ")
    assert all(n in err for n in TRACE_NAMES)


def test_python_dash_m_from_another_directory(tmp_path):
    """`python -m gpumem replay NAME` finds the data from any working directory."""
    env = dict(os.environ)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.abspath(gpumem.__file__)))
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run(
        [sys.executable, "-m", "gpumem", "replay", "seed_fragmentation", "--json", "--no-timing"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["peak_live_bytes"] == 1608515584


def test_the_shipped_oom_snapshot_can_be_explained(capsys):
    """sim_oom ends in an OOM, so `gpumem explain sim_oom` works with no GPU and no --capacity."""
    assert main(["explain", "sim_oom", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    oom = out["torch_oom"]
    assert oom["request_bytes"] == 900 << 20 and oom["live_bytes"] + oom["request_bytes"] > 1 << 30
    assert out["capacity_bytes"] == 1 << 30 and out["gpumem_fits"] is False
    assert out["gpumem_min_capacity_bytes"] >= oom["live_bytes"] + oom["request_bytes"]
    readme = (data.SNAPSHOTS_DIR / "README.md").read_text()
    assert "sim_oom" in readme and "tools/make_oom_snapshot.py" in readme


def test_explain_counts_events_one_way(capsys):
    """The first line's count and the OOM's place are the same count: allocations and frees."""
    assert main(["explain", "sim_oom"]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    n = int(first.split(": ", 1)[1].split()[0])
    assert first.startswith(f"sim_oom: {n} allocations and frees (device 0)"), first
    assert second.startswith(f"torch ran out of memory at the {n}rd of them (the snapshot's device_traces[0]["), second
