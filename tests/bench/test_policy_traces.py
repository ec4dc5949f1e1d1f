"""benchmarks/policy_traces.py --why on the simulated device: one step below the smallest capacity the
first failed request is short, and its OOM report says where the free memory it could not have lies:
in partly used chunks where growth comes as chunks of many pages (chunk_pages), never for the tight
heap, and no longer for the default policy on a trace at 3x (chunks only early in the heap's growth).
Each row also holds the trace's peak reserved under expandable segments, beside the policies'."""

import os
import sys

import pytest

from helpers import REPO

sys.path.insert(0, os.path.join(str(REPO), "benchmarks"))

import policy_traces as pt  # noqa: E402

from gpumem import replay as R  # noqa: E402
from gpumem.data import trace_path  # noqa: E402
from gpumem.trace import load_trace  # noqa: E402


def test_why_finds_the_pages_locked_in_chunks():
    r = pt.measure("llama_ckpt", scale=3, why=True)
    tight, default = r["policies"]["tight (pressure 0)"], r["policies"]["default"]
    for p in (tight, default):
        w = p["short_below"]
        assert w is not None and w["short_mib"] > 0 and w["request_mib"] > w["short_mib"]
    assert tight["short_below"]["chunk_locked_mib"] == 0
    # The chunks the default made while far from pressure lock no page the request lacked (they
    # locked 374 MiB when chunks came up to a quarter of the room line), and it fits as tightly.
    assert default["short_below"]["chunk_locked_mib"] == 0
    assert default["min_capacity"] <= tight["min_capacity"] + 0.002
    # Every growth as chunks of 16 pages: their free pages are what the request could not have.
    tr = pt.scaled(load_trace("llama_ckpt"), 3)
    kw = {"chunk_pages": 16}
    w = pt.why_short(tr, R.min_capacity(tr, precision=3 * R.MiB, heap_kwargs=kw) - 3 * R.MiB, kw)
    assert w is not None and w["chunk_locked_mib"] > w["short_mib"] > 0


def test_the_smallest_capacity_is_searched_to_the_page_at_every_scale():
    # The heap maps 2 MiB pages: one page below the capacity reported must fail, at 3x as at 1x
    # (a search to 3 MiB at 3x reported 858 MiB for unet_sample, where 856 fits).
    tr = pt.scaled(load_trace("unet_sample"), 3)
    r = pt.measure("unet_sample", scale=3)
    for label, kw in pt.POLICIES.items():
        mc = r["policies"][label]["min_capacity_bytes"]
        assert R.fits(tr, mc, kw) and not R.fits(tr, mc - 2 * R.MiB, kw), label


def test_why_is_none_where_nothing_fails():
    tr = load_trace(str(trace_path("gemma_beam")))
    assert pt.why_short(tr, 4 * tr.peak_live_bytes, {}) is None


def test_a_trace_file_measures_as_its_shipped_name():
    """--traces takes a path to a trace file (gpu_policy.py --trace records them) as well as a name."""
    path = str(trace_path("bart_generate"))
    by_path, by_name = pt.measure(path), pt.measure("bart_generate")
    assert by_path["trace"] == "bart_generate" and by_path == by_name
    assert by_path["policies"]["default"]["min_capacity"] >= 1.0


def test_a_device_the_program_fills_makes_no_chunk_early():
    """A cuDNN LSTM of drawn lengths (a trace recorded outside the zoo) fills a 21 GiB device: a chunk
    made early, while the room line kept 16 GiB past the heap, later locked 88 MiB the last request
    lacked (1.0048x peak live against the tight heap's 1.0006x).  Chunks need 32 GiB past the line."""
    path = REPO / "benchmarks" / "results" / "unseen" / "lstm_varlen.trace.gz"
    if not path.exists():
        pytest.skip("benchmarks/results is not shipped in the sdist")
    r = pt.measure(str(path), why=True)
    tight, default = r["policies"]["tight (pressure 0)"], r["policies"]["default"]
    assert default["short_below"]["chunk_locked_mib"] == 0
    assert default["min_capacity"] <= tight["min_capacity"] + 0.002


def test_a_folder_stands_for_its_traces(tmp_path):
    for name in ("b.trace.gz", "a.trace.gz", "notes.md"):
        (tmp_path / name).write_text("")
    assert pt.trace_names(f"gemma_beam,{tmp_path},") == [
        "gemma_beam",
        str(tmp_path / "a.trace.gz"),
        str(tmp_path / "b.trace.gz"),
    ]


def test_each_row_gives_expandable_segments_peak_reserved_beside_the_policies():
    """Room reserves no more than expandable segments on the traces whose GPU runs showed it: the
    rows compare both on the same trace (benchmarks/expandable_model.py)."""
    for name in ("gpt2_varlen", "llama_lora_ckpt"):
        r = pt.measure(name)
        assert r["expandable_peak_reserved_bytes"] > load_trace(name).peak_live_bytes
        assert r["policies"]["default"]["peak_reserved"] <= r["expandable_peak_reserved"]


def _row(name, default_cap, tight_cap, default_res=1.01, expandable_res=1.02):
    p = lambda cap, res: dict(min_capacity=cap, peak_reserved=res)  # noqa: E731
    return dict(
        trace=name,
        policies={"default": p(default_cap, default_res), "tight (pressure 0)": p(tight_cap, 1.0)},
        expandable_peak_reserved=expandable_res,
    )


def test_goals_name_the_traces_that_miss():
    rows = [
        _row("ok", 1.0040, 1.0030),
        _row("past_the_tight_heap", 1.0070, 1.0040),  # 0.3% over the tight heap's
        _row("past_1.005", 1.0060, 1.0045),  # within 0.2%, but the tight heap gets under 1.005
        _row("past_1.01", 1.0120, 1.0110),  # the tight heap misses 1.01 too: 1.01 is the goal
        _row("over_expandable", 1.0010, 1.0010, default_res=1.05, expandable_res=1.04),
    ]
    cap, res = pt.goals(rows)
    assert "met on 2 of 5" in cap
    for name in ("past_the_tight_heap", "past_1.005", "past_1.01"):
        assert name in cap
    assert "over_expandable" not in cap and "ok" not in cap.split("missed:")[1]
    assert "met on 4 of 5" in res and "over_expandable 1.0500 (1.0400)" in res
