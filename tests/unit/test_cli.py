"""The command line: python -m gpumem replay ..."""

import gzip
import json
import os
import pathlib
import pickle
import subprocess
import sys

import pytest

import gpumem
from gpumem.__main__ import main

from helpers import GiB, MiB, REPO, all_traces, trace_file
from helpers import raw_events, recount_peak
from helpers import write_text as _write_text

SEED = trace_file("seed_fragmentation")

JSON_KEYS = {
    "trace",
    "events",
    "peak_live_bytes",
    "peak_reserved_bytes",
    "ns_per_op",
    "ooms",
    "remaps",
    "num_maps",
    "num_unmaps",
    "allocs",
    "frees",
    "capacity_bytes",
    "first_oom_event",
}


def run_cli(*args):
    """Run `python -m gpumem` in a child, importing the very gpumem under test."""
    env = dict(os.environ)
    pkg_parent = str(pathlib.Path(gpumem.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = pkg_parent + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run(
        [sys.executable, "-m", "gpumem", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(REPO),
        timeout=600,
    )


def write_text(path, lines):
    return _write_text(path, lines, header="# action addr size stream")


def json_rows(stdout):
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


# ---- bad input: one line on stderr, exit 2, no traceback --------------------------


def bad_inputs(tmp_path):
    ok = "alloc 4096 512 0"
    corrupt = tmp_path / "corrupt.trace.gz"
    good = gzip.compress(("\n".join(f"alloc {i * 512} 512 0" for i in range(5000)) + "\n").encode())
    corrupt.write_bytes(good[: len(good) // 2])
    snap = tmp_path / "cross.pickle.gz"
    with gzip.open(snap, "wb") as f:
        pickle.dump(
            {
                "device_traces": [
                    [
                        {"action": "alloc", "addr": 1, "size": 512, "stream": 0},
                        {"action": "free_completed", "addr": 99, "size": 512, "stream": 0},
                    ],
                    [{"action": "alloc", "addr": 99, "size": 512, "stream": 0}],
                ]
            },
            f,
        )
    return [
        (tmp_path / "missing.trace.gz", "no such file"),
        (write_text(tmp_path / "unknown.trace.gz", [ok, "foo 1 2 3"]), ":3: unknown action 'foo'"),
        (write_text(tmp_path / "free.trace.gz", [ok, "free_completed 8192 512 0"]), ":3: free of unknown address"),
        (write_text(tmp_path / "neg.trace.gz", ["alloc 4096 -5 0"]), ":2: negative size -5"),
        (write_text(tmp_path / "malformed.trace.gz", [ok, "alloc 1 2"]), ":3: malformed line"),
        (corrupt, "corrupt gzip"),
        (snap, "device_traces[0][1]: free of address 0x63, which is not live on device 0"),
    ]


def test_bad_inputs_in_process(tmp_path, capsys):
    for path, fragment in bad_inputs(tmp_path):
        rc = main(["replay", str(path), "--no-timing"])
        out, err = capsys.readouterr()
        assert rc == 2, (path, err)
        assert out == ""
        lines = err.splitlines()
        assert len(lines) == 1, err
        assert lines[0].startswith(f"gpumem: error: {path}"), lines[0]
        assert fragment in lines[0], lines[0]


def test_bad_inputs_subprocess(tmp_path):
    cases = bad_inputs(tmp_path)
    for path, fragment in cases[:3]:
        p = run_cli("replay", path)
        assert p.returncode == 2
        assert "Traceback" not in p.stderr
        assert p.stderr.count("\n") == 1 and fragment in p.stderr, p.stderr


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (["replay"], "required"),
        (["replay", "x.gz", "--capacity", "12 parsecs"], "unknown size unit"),
        (["replay", "x.gz", "--capacity", "0"], "positive"),
        (["replay", "x.gz", "--capacity", "24"], "size '24' needs a unit"),
        (["replay", "x.gz", "--capacity", "1.5"], "size '1.5' needs a unit"),
        (["replay", "x.gz", "--page-size", "8"], "size '8' needs a unit"),
        (["explain", "x.gz", "--capacity", "8"], "size '8' needs a unit"),
        (["forecast", "a", "b", "--knob", "2,4", "--cap", "12"], "size '12' needs a unit"),
        (["forecast", "a", "b", "--knob", "2,4", "--device-memory", "80"], "size '80' needs a unit"),
        (["replay", "x.gz", "--bogus"], "unrecognized arguments"),
        (["replay", "x.gz", "--chunk-pages", "0"], "chunk_pages must be in [1, "),
        (["replay", "x.gz", "--page-size", "3MiB"], "page size must be a power of two"),
        (["nosuchcommand"], "invalid choice"),
        ([], "required"),
    ],
)
def test_usage_errors(argv, fragment, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("gpumem: error: ") and fragment in err, err


def test_good_and_bad_traces_together(tmp_path, capsys):
    bad = write_text(tmp_path / "bad.trace.gz", ["foo 1 2 3"])
    rc = main(["replay", str(SEED), str(bad), "--json", "--no-timing"])
    out, err = capsys.readouterr()
    assert rc == 2
    rows = json_rows(out)
    assert [r["trace"] for r in rows] == [str(SEED)]
    assert err.splitlines() == [f"gpumem: error: {bad}:2: unknown action 'foo'"]


# ---- output ----------------------------------------------------------------------


def test_json_keys_and_consistency():
    traces = all_traces()
    small = [t for t in traces if "gpt2_generate" not in t.name]
    p = run_cli("replay", *small, "--json")
    assert p.returncode == 0, p.stderr
    rows = json_rows(p.stdout)
    assert [r["trace"] for r in rows] == [str(t) for t in small]
    for r, path in zip(rows, small):
        assert JSON_KEYS <= r.keys(), JSON_KEYS - r.keys()
        assert "min_capacity_bytes" not in r
        assert r["peak_live_bytes"] == recount_peak(raw_events(path))
        assert r["capacity_bytes"] == 80 * GiB
        assert r["ooms"] == 0 and r["first_oom_event"] == -1
        assert r["events"] == r["allocs"] + r["frees"]
        assert r["peak_reserved_bytes"] >= r["peak_live_bytes"]
        assert r["ns_per_op"] > 0
        assert r["remaps"] >= 0 and r["num_maps"] >= r["remaps"]


def test_json_min_capacity(tmp_path):
    p = run_cli("replay", SEED, "--json", "--min-capacity", "--capacity", "4GiB")
    assert p.returncode == 0, p.stderr
    (r,) = json_rows(p.stdout)
    mc = r["min_capacity_bytes"]
    assert r["capacity_bytes"] == 4 * GiB
    assert mc % MiB == 0 and r["peak_live_bytes"] <= mc <= 4 * GiB
    # the answer must hold up when replayed at that capacity, and fail just below it
    ok = json_rows(run_cli("replay", SEED, "--json", "--no-timing", "--capacity", f"{mc}B").stdout)[0]
    assert ok["ooms"] == 0
    short = json_rows(run_cli("replay", SEED, "--json", "--no-timing", "--capacity", f"{mc - 2 * MiB}B").stdout)[0]
    assert short["ooms"] > 0


def test_chunk_pages_option(capsys):
    """--chunk-pages 8: fewer device allocations; the default makes one per page on a tight heap (with room,
    the policy makes chunks of its own: test_policy.py)."""
    rows = {}
    for extra in ([], ["--chunk-pages", "1"], ["--chunk-pages", "8"]):
        assert main(["replay", str(SEED), "--json", "--no-timing", "--pressure", "0", *extra]) == 0
        (rows[tuple(extra)],) = json_rows(capsys.readouterr().out)
    one, default, eight = rows[("--chunk-pages", "1")], rows[()], rows[("--chunk-pages", "8")]
    assert default["num_device_alloc"] == one["num_device_alloc"]
    assert eight["num_device_alloc"] < one["num_device_alloc"] / 2
    assert eight["peak_live_bytes"] == one["peak_live_bytes"]


def test_page_size_option(capsys):
    """--page-size 8MiB: about a quarter of the device allocations, each a whole 8 MiB page."""
    rows = {}
    for extra in ([], ["--page-size", "8MiB"]):
        assert main(["replay", str(SEED), "--json", "--no-timing", "--min-capacity", "--pressure", "0", *extra]) == 0
        (rows[tuple(extra)],) = json_rows(capsys.readouterr().out)
    two, eight = rows[()], rows[("--page-size", "8MiB")]
    assert eight["peak_live_bytes"] == two["peak_live_bytes"]
    assert eight["num_device_alloc"] <= two["num_device_alloc"] / 3
    assert eight["peak_reserved_bytes"] % (8 * MiB) == 0 and eight["min_capacity_bytes"] >= eight["peak_live_bytes"]
    assert eight["ooms"] == two["ooms"] == 0


def test_ooms_reported_not_fatal(tmp_path, capsys):
    t = write_text(tmp_path / "big.trace.gz", [f"alloc {i * 8 * MiB} {4 * MiB} 0" for i in range(8)])
    assert main(["replay", str(t), "--json", "--capacity", "16MiB", "--no-timing"]) == 0
    (r,) = json_rows(capsys.readouterr().out)
    assert r["ooms"] > 0 and r["first_oom_event"] >= 0 and r["peak_live_bytes"] <= 16 * MiB


def test_table_output(tmp_path, capsys):
    t = write_text(
        tmp_path / "tiny.trace.gz", ["alloc 4096 1048576 0", "alloc 8192 2097152 0", "free_completed 4096 0 0"]
    )
    assert main(["replay", str(t), "--min-capacity", "--no-progress"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["trace", "events", "capacity"]
    assert lines[2].startswith("tiny ")
    assert "3.00 MiB" in lines[2]  # peak live
    assert err == ""  # not a tty, short replay: no progress bar


def test_snapshot_device_option(tmp_path, capsys):
    path = tmp_path / "two.pickle"
    ev = lambda a, addr, size: {"action": a, "addr": addr, "size": size, "stream": 0}  # noqa: E731
    path.write_bytes(
        pickle.dumps({"device_traces": [[ev("alloc", 1, 512)], [ev("alloc", 1, 2 * MiB), ev("alloc", 2, MiB)]]})
    )
    assert main(["replay", str(path), "--json", "--device", "1", "--no-timing"]) == 0
    (r,) = json_rows(capsys.readouterr().out)
    assert r["device"] == 1 and r["peak_live_bytes"] == 3 * MiB and r["format"] == "snapshot"
    assert main(["replay", str(path), "--device", "4"]) == 2
    assert "no device 4" in capsys.readouterr().err


def test_progress_bar_on_a_tty(tmp_path, monkeypatch, capsys):
    import gpumem.__main__ as cli

    t = write_text(tmp_path / "t.trace.gz", [f"alloc {i * 4096} 512 0" for i in range(200)])
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: True, raising=False)
    assert main(["replay", str(t), "--no-timing"]) == 0
    err = capsys.readouterr().err
    assert "100%" in err and "\r" in err
