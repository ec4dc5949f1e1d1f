"""benchmarks/gpu_compare.py without a GPU: trace packing, the searches, the results schema and
tables, and a whole --dry-run through the worker servers with a fake backend (failures injected)."""

import gzip
import json
import os
import random
import subprocess
import sys

import pytest

from helpers import REPO  # noqa: E402

ROOT = str(REPO)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from compare import report  # noqa: E402
from compare import traces as tr  # noqa: E402
from compare.contenders import parse_contenders, server_env  # noqa: E402
from compare.search import MaxPassSearch, MinPassSearch, seeds_around  # noqa: E402
from helpers import trace_file  # noqa: E402

MiB = 1 << 20
GiB = 1 << 30
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_compare.py")


# ---- traces ---------------------------------------------------------------------------------------

TEXT = """# action addr size stream  (test; {"peak_allocated": 123})
segment_alloc 1000 2097152 0
alloc 100 512 0
alloc 200 1024 7
free_requested 100 512 0
free_completed 100 512 0
alloc 300 4096 0
free_completed 200 1024 7
alloc 100 256 7
"""


def test_parse_pairs_frees_reuses_slots_and_finds_peak():
    t = tr.parse_lines(TEXT.splitlines(True), "x.trace")
    ev = t.events()
    assert [e[0] for e in ev] == [tr.OP_ALLOC, tr.OP_ALLOC, tr.OP_FREE, tr.OP_ALLOC, tr.OP_FREE, tr.OP_ALLOC]
    # the first block's slot is reused by the next alloc once freed
    assert ev[2][1] == ev[0][1] and ev[3][1] == ev[0][1]
    assert t.n_slots == 2
    assert t.streams == [0, 7]
    assert ev[1][3] == 1 and ev[5][3] == 1  # stream index, not the handle
    assert t.peak_live == 1024 + 4096 and t.peak_event == 3
    assert t.allocs == 4 and t.frees == 2
    assert t.meta == {"peak_allocated": 123}


@pytest.mark.parametrize(
    "body, msg",
    [
        ("free_completed 5 512 0\n", "unknown address"),
        ("alloc 5 512 0\nalloc 5 512 0\n", "still live"),
        ("alloc 5 512\n", "expected"),
        ("mystery 5 512 0\n", "unknown action"),
        ("alloc x 512 0\n", "integers"),
    ],
)
def test_parse_rejects_bad_traces(body, msg):
    with pytest.raises(tr.TraceFormatError, match=msg):
        tr.parse_lines(body.splitlines(True), "bad.trace")


def test_packed_roundtrip(tmp_path):
    p = tmp_path / "small.trace.gz"
    with gzip.open(p, "wt") as f:
        f.write(TEXT)
    t = tr.load_text_trace(str(p))
    assert t.name == "small"
    base = tr.save_packed(t, str(tmp_path / "cache"))
    u = tr.load_packed(base)
    assert u.events() == t.events()
    assert (u.peak_live, u.n_slots, u.streams, u.meta) == (t.peak_live, t.n_slots, t.streams, t.meta)


def test_find_traces_orders_by_size_and_filters(tmp_path):
    for name, n in (("big", 400), ("small", 10)):
        with gzip.open(tmp_path / f"{name}.trace.gz", "wt") as f:
            for i in range(n):
                f.write(f"alloc {random.getrandbits(40)} {i * 512} 0\n")
    (tmp_path / "notes.txt").write_text("x")
    assert [tr.trace_name(p) for p in tr.find_traces(str(tmp_path))] == ["small", "big"]
    assert [tr.trace_name(p) for p in tr.find_traces(str(tmp_path), ["big"])] == ["big"]
    with pytest.raises(FileNotFoundError, match="no trace named nope"):
        tr.find_traces(str(tmp_path), ["nope"])


def test_shipped_trace_peak_live_matches_readme():
    t = tr.load_text_trace(str(trace_file("seed_fragmentation")))
    assert round(t.peak_live / GiB, 3) == 1.498  # the README's table
    assert t.allocs == 401


# ---- searches -------------------------------------------------------------------------------------


def run_min(threshold, fail_below, seeds=(), res=8 * MiB, align=2 * MiB, ceiling=80 * GiB, margin=None, limit=100):
    s = MinPassSearch(fail_below, ceiling, res, align, seeds=seeds, margin=margin)
    n = 0
    while (v := s.next()) is not None:
        assert v % align == 0
        assert v <= ceiling
        s.record(v, v >= threshold)
        n += 1
        assert n < limit, "search does not terminate"
    return s, n


@pytest.mark.parametrize("ratio", [1.0, 1.0004, 1.004, 1.03, 1.2, 1.9])
@pytest.mark.parametrize("guess_ratio", [None, 1.0, 1.03, 1.5])
def test_min_pass_search_brackets_the_threshold(ratio, guess_ratio):
    peak = 5 * GiB + 12345
    threshold = int(peak * ratio)
    seeds = seeds_around(int(peak * guess_ratio), 32 * MiB) if guess_ratio else ()
    s, n = run_min(threshold, peak, seeds)
    r = s.result()
    assert r["converged"] and not r["exhausted"] and not r["nonmonotone"]
    assert r["min_pass"] >= threshold
    assert r["min_pass"] - threshold < 8 * MiB + 2 * MiB
    if r["max_fail"] is not None:
        assert r["max_fail"] < threshold
        assert r["min_pass"] - r["max_fail"] <= 8 * MiB


def test_good_seeds_save_probes():
    peak = 16 * GiB
    threshold = int(peak * 1.033)
    _, blind = run_min(threshold, peak, seeds=())
    _, seeded = run_min(threshold, peak, seeds=seeds_around(threshold + 5 * MiB, 32 * MiB))
    assert seeded <= 5 < blind


def test_min_pass_search_exhausts_when_nothing_fits():
    s, _ = run_min(threshold=10 * GiB, fail_below=1 * GiB, ceiling=4 * GiB)
    r = s.result()
    assert r["exhausted"] and r["min_pass"] is None and not r["converged"]


def test_min_pass_search_flags_contradictions():
    s = MinPassSearch(GiB, 8 * GiB, 8 * MiB, 2 * MiB)
    s.record(3 * GiB, True)
    s.record(4 * GiB, False)  # failed above a pass
    assert s.result()["nonmonotone"]
    assert s.hi == 3 * GiB


def test_min_pass_search_rejects_bad_bounds():
    with pytest.raises(ValueError):
        MinPassSearch(10, 5, 1)
    with pytest.raises(ValueError):
        MinPassSearch(1, 5, 0)


@pytest.mark.parametrize("answer", [0, 1, 2, 7, 13, 100, 256])
@pytest.mark.parametrize("seeds", [(), (13, 14), (1, 2), (300,)])
def test_max_pass_search_finds_the_largest_passing_value(answer, seeds):
    s = MaxPassSearch(256, seeds=seeds)
    n = 0
    while (b := s.next()) is not None:
        assert 1 <= b <= 256
        s.record(b, b <= answer)
        n += 1
        assert n < 40
    r = s.result()
    assert r["converged"]
    assert r["max_pass"] == (answer or None)
    assert r["min_fail"] == (answer + 1 if answer < 256 else None)


def test_max_pass_seeded_with_the_answer_takes_two_tries():
    s = MaxPassSearch(512, seeds=[13, 14])
    tries = []
    while (b := s.next()) is not None:
        tries.append(b)
        s.record(b, b <= 13)
    assert tries == [13, 14]


# ---- contenders and arguments ---------------------------------------------------------------------


def test_parse_contenders():
    assert parse_contenders("native, gpumem,native") == ["native", "gpumem"]
    assert parse_contenders("expandable_segments,cudaMallocAsync") == ["expandable", "async"]
    with pytest.raises(ValueError, match="unknown contender"):
        parse_contenders("jemalloc")


def test_server_env_sets_only_the_contenders_alloc_conf():
    base = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PATH": "/bin"}
    assert "PYTORCH_CUDA_ALLOC_CONF" not in server_env("native", base)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in server_env("gpumem", base)
    assert server_env("async", base)["PYTORCH_CUDA_ALLOC_CONF"] == "backend:cudaMallocAsync"
    assert server_env("expandable", {})["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert server_env("native", base)["PYTORCH_NVML_BASED_CUDA_CHECK"] == "1"


@pytest.mark.parametrize(
    "argv, msg",
    [
        (["--figures", "7"], "figures are among"),
        (["--contenders", "foo"], "unknown contender"),
        (["--fig5-cap", "lots"], "not a size"),
        (["--gpumem-options", "[1]"], "JSON object"),
    ],
)
def test_cli_rejects_bad_arguments(argv, msg):
    p = subprocess.run([sys.executable, SCRIPT, "--dry-run"] + argv, capture_output=True, text=True)
    assert p.returncode == 2
    assert msg in p.stderr


# ---- report ---------------------------------------------------------------------------------------


def minimal_doc():
    return {
        "schema": report.SCHEMA,
        "fake": True,
        "command": "x",
        "started": "now",
        "options": {"contenders": ["native", "gpumem"]},
        "contenders": {"native": {"status": "ok"}, "gpumem": {"status": "unavailable", "reason": "not built"}},
        "traces": {"t": {"peak_live": GiB}},
        "labels": {"native": "native", "gpumem": "gpumem"},
        "figures": {
            "1": {
                "status": "done",
                "rows": [
                    {
                        "trace": "t",
                        "contender": "native",
                        "status": "ok",
                        "ratio": 1.0421,
                        "min_cap": int(1.0421 * GiB),
                    },
                    {"trace": "t", "contender": "gpumem", "status": "unavailable", "reason": "not built"},
                ],
            }
        },
    }


def test_validate_accepts_a_good_doc_and_names_problems():
    assert report.validate(minimal_doc()) == []
    d = minimal_doc()
    d["figures"]["1"]["rows"][1].pop("reason")
    d["figures"]["9"] = {"status": "done", "rows": []}
    d["contenders"]["native"]["status"] = "great"
    del d["traces"]
    problems = "\n".join(report.validate(d))
    assert "without a reason" in problems
    assert "figures.9: unknown figure" in problems
    assert "'great'" in problems
    assert "missing 'traces'" in problems


def test_markdown_table_cells():
    md = report.markdown(minimal_doc())
    assert "| t | 1.000 GiB | 1.042 | unavailable: not built |" in md
    assert "FAKE BACKEND" in md
    d = minimal_doc()
    d["figures"]["1"]["rows"][0].update(status="partial", ratio=1.05, ratio_max_fail=1.01, reason="time")
    assert "≤1.050 (>1.010)" in report.markdown(d)


def test_format_helpers():
    assert report.fmt_bytes(3 * GiB // 2) == "1.500 GiB"
    assert report.fmt_bytes(12 * MiB) == "12.0 MiB"
    assert report.fmt_size_short(4096) == "4 KiB" and report.fmt_size_short(1000) == "1000 B"


# ---- the whole pipeline on the fake backend --------------------------------------------------------


def write_trace(path, n, seed):
    rng = random.Random(seed)
    live = []
    with gzip.open(path, "wt") as f:
        f.write('# action addr size stream ({"peak_allocated": 0})\n')
        addr = 1 << 20
        for _ in range(n):
            if live and rng.random() < 0.45:
                a, s = live.pop(rng.randrange(len(live)))
                f.write(f"free_requested {a} {s} 0\nfree_completed {a} {s} 0\n")
            else:
                s = rng.choice([1, 3, 17, 64]) * MiB
                addr += s + 4096
                live.append((addr, s))
                f.write(f"alloc {addr} {s} 0\n")


def test_dry_run_end_to_end_with_injected_failures(tmp_path):
    tdir = tmp_path / "traces"
    tdir.mkdir()
    write_trace(tdir / "alpha.trace.gz", 300, 1)
    write_trace(tdir / "beta.trace.gz", 900, 2)
    out, copy = tmp_path / "out", tmp_path / "copy"
    env = dict(os.environ, GPU_COMPARE_FAKE_FAIL="rmm:unavailable,async:crash@replay")
    p = subprocess.run(
        [
            sys.executable,
            SCRIPT,
            "--dry-run",
            "--traces",
            str(tdir),
            "--out",
            str(out),
            "--copy-to",
            str(copy),
            "--deadline",
            "120",
            "--figures",
            "1,2,3,5,6",
            "--contenders",
            "native,async,rmm,gpumem",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads((out / "gpu_compare.json").read_text())
    assert report.validate(doc) == []
    assert doc["fake"] is True
    assert doc["contenders"]["rmm"]["status"] == "unavailable"
    assert set(doc["figures"]) == {"1", "2", "3", "5", "6"}
    f1 = {(r["trace"], r["contender"]): r for r in doc["figures"]["1"]["rows"]}
    # the fake overheads (fake.OVERHEAD) are what the searches must find, to the resolution
    from compare.fake import OVERHEAD

    for t in ("alpha", "beta"):
        for c in ("native", "gpumem"):
            r = f1[(t, c)]
            assert r["status"] == "ok", r
            assert OVERHEAD[c] <= r["ratio"] <= OVERHEAD[c] + (10 * MiB) / doc["traces"][t]["peak_live"]
        assert f1[(t, "rmm")]["status"] == "unavailable"
        # async's replay child dies: recorded, not fatal
        assert f1[(t, "async")]["status"] == "failed" and "died" in f1[(t, "async")]["reason"]
    f3 = {(r["trace"], r["contender"]): r for r in doc["figures"]["3"]["rows"]}
    assert f3[("alpha", "native")]["capped_status"] == "oom"  # 1.05 < native's fake 1.06
    assert f3[("alpha", "gpumem")]["capped_status"] == "ok" and f3[("alpha", "gpumem")]["slowdown"] > 0
    f5 = {(r["length"], r["contender"]): r for r in doc["figures"]["5"]["rows"]}
    assert f5[(1024, "gpumem")]["max_batch"] >= f5[(1024, "native")]["max_batch"] > 0
    assert f5[(1024, "native")].get("verified") is True
    md = (out / "gpu_compare.md").read_text()
    assert "FAKE BACKEND" in md and "## Figure 6." in md
    for name in ("gpu_compare.json", "gpu_compare.md", "gpu_compare_logs.txt"):
        assert (copy / name).exists()
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "gpu_compare_fig1.png").exists() and (copy / "gpu_compare_plots.tar").exists()
    # --replot rebuilds the same tables from the JSON alone
    rp = subprocess.run(
        [sys.executable, SCRIPT, "--replot", str(out / "gpu_compare.json"), "--out", str(tmp_path / "re")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rp.returncode == 0, rp.stderr
    assert (tmp_path / "re" / "gpu_compare.md").read_text() == md


# ---- the replay loop itself, on the CPU (needs torch) ----------------------------------------------


def test_replay_pass_on_cpu_counts_and_reports_oom():
    torch = pytest.importorskip("torch")
    from compare.worker import replay_pass

    t = tr.parse_lines(TEXT.splitlines(True), "x.trace")
    dev = torch.device("cpu")
    r = replay_pass(
        t.events(), t.n_slots, [None, None], torch.empty, dev, lambda s: None, lambda: None, lambda: 1000, 1000
    )
    assert r["status"] == "ok" and r["allocs"] == 4 and r["live_at_end"] == 4096 + 256

    budget = {"left": 1024 + 512 + 100}

    def tight_empty(n, dtype, device):
        if n > budget["left"]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate")
        budget["left"] -= n
        return torch.empty(n, dtype=dtype, device=device)

    r = replay_pass(
        t.events(), t.n_slots, [None, None], tight_empty, dev, lambda s: None, lambda: None, lambda: 1000, 1000
    )
    assert r["status"] == "oom" and r["event"] == 3 and r["live_at_failure"] == 1024
