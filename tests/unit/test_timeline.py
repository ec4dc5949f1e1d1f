"""Memory over time (gpumem.timeline): live, reserved and cap over a trace's
replay or a heap's history, with the peak, the remaps and the OOMs marked; as
inline SVG in the offline HTML and through matplotlib."""

import json
import xml.etree.ElementTree as ET

import pytest

import gpumem
from gpumem.__main__ import main
from gpumem.replay import replay
from gpumem.timeline import from_history, from_trace
from gpumem.trace import load_trace

from helpers import GiB, MiB, trace_file
from helpers import live_by_event, raw_events, write_text

SVG = "{http://www.w3.org/2000/svg}"


def test_exact_timeline_of_a_small_trace_matches_the_trace():
    path = trace_file("seed_fragmentation")
    t = load_trace(path)
    tl = from_trace(t, 80 * GiB)
    assert tl.step == 1 and tl.x == list(range(t.n_events + 1))
    assert tl.live == live_by_event(raw_events(path))  # every event, exactly
    r = replay(t, 80 * GiB, timing=False)
    assert tl.peak_live == (t.peak_event + 1, r.peak_live_bytes)
    assert max(tl.reserved) == r.peak_reserved_bytes
    assert tl.n_remaps == r.remaps and tl.ooms == []
    assert all(res >= lv for lv, res in zip(tl.live, tl.reserved))
    assert tl.cap_bytes == 80 * GiB


def test_long_trace_in_steps_keeps_the_peaks():
    t = load_trace(trace_file("gpt2_varlen"))
    tl = from_trace(t, 80 * GiB, points=300)
    assert tl.step == -(-t.n_events // 300) and len(tl.x) == 1 + -(-t.n_events // tl.step)
    r = replay(t, 80 * GiB, timing=False)
    assert max(tl.live) == r.peak_live_bytes == t.peak_live_bytes
    assert max(tl.reserved) == r.peak_reserved_bytes
    assert tl.n_remaps == r.remaps


def test_oom_marked_at_its_event_with_its_request(tmp_path):
    lines = [f"alloc {i * 8 * MiB} {6 * MiB} 0" for i in range(3)] + ["alloc 999999999 " + str(40 * MiB) + " 0"]
    t = load_trace(write_text(tmp_path / "t.trace.gz", lines, header=""))
    tl = from_trace(t, 32 * MiB)
    assert tl.ooms == [(3, 40 * MiB)]
    r = replay(t, 32 * MiB, timing=False)
    assert r.first_oom_event == 3
    svg = ET.fromstring(tl.to_svg())
    ooms = [e for e in svg.iter() if e.get("class") == "tl-oom"]
    assert len(ooms) == 1 and "40.00 MiB" in ooms[0].find(SVG + "title").text
    caps = [e for e in svg.iter() if e.get("class") == "tl-cap"]
    assert caps and "cap 32.00 MiB" in "".join(caps[0].itertext())


def test_history_timeline_of_a_heap(make_heap):
    h = make_heap(capacity=64 * MiB)
    gpumem.record_history(True, device=h, stacks=None)
    a = h.malloc(10 * MiB)
    b = h.malloc(3 * MiB)
    h.free(a)
    with pytest.raises(gpumem.OutOfMemoryError):
        h.malloc(100 * MiB)
    h.empty_cache()
    c = h.malloc(30 * MiB)
    tl = gpumem.memory_over_time(h)
    s = h.stats()
    assert tl.source == "history"
    assert tl.live[-1] == s["allocated_bytes.all.current"] == 33 * MiB
    assert tl.reserved[-1] == s["reserved_bytes.all.current"]
    assert tl.peak_live[1] == 33 * MiB
    assert [size for _, size in tl.ooms] == [100 * MiB]
    assert tl.cap_bytes == 64 * MiB
    assert b and c
    gpumem.record_history(False, device=h)


def test_history_that_lost_its_start_is_anchored_at_the_heap(make_heap):
    h = make_heap(capacity=GiB)
    keep = [h.malloc(20 * MiB) for _ in range(5)]  # before recording: not in the history
    gpumem.record_history(True, device=h, stacks=None)
    more = h.malloc(7 * MiB)
    snap = gpumem.snapshot(h)
    tl = snap.memory_over_time()
    assert tl.live[0] == 100 * MiB and tl.live[-1] == 107 * MiB
    assert tl.reserved[-1] == snap.summary.reserved_bytes
    assert keep and more
    gpumem.record_history(False, device=h)


def test_from_history_counts_maps_remaps_and_unmaps():
    entries = [
        (0, "map", 0, 8 * MiB, 0, 0),
        (1, "alloc", 0, 6 * MiB, 0, 0),
        (2, "free_requested", 0, 6 * MiB, 0, 0),
        (3, "free_completed", 0, 6 * MiB, 0, 0),
        (4, "unmap", 0, 4 * MiB, 0, 0),
        (5, "remap", 0, 4 * MiB, 0, 0),
        (6, "alloc", 0, 8 * MiB, 0, 0),
        (7, "oom", 0, 64 * MiB, 0, 0),
    ]
    tl = from_history(entries, cap_bytes=16 * MiB, label="<b>&x")
    assert tl.live == [0, 0, 6 * MiB, 0, 0, 0, 8 * MiB, 8 * MiB]
    assert tl.reserved == [0, 8 * MiB, 8 * MiB, 8 * MiB, 4 * MiB, 8 * MiB, 8 * MiB, 8 * MiB]
    assert tl.remaps == [(6, 1)] and tl.ooms == [(8, 64 * MiB)]
    # names are escaped in the SVG
    svg = tl.to_svg()
    assert "<b>&x" not in svg and "&lt;b&gt;&amp;x" in svg
    ET.fromstring(svg)


def test_snapshot_html_has_the_timeline_and_escapes_names(make_heap, tmp_path):
    h = make_heap(capacity=GiB)
    gpumem.record_history(True, device=h, stacks=None)
    ptrs = [h.malloc((i % 4 + 1) * MiB) for i in range(20)]
    for p in ptrs[::2]:
        h.free(p)
    snap = gpumem.snapshot(h)
    snap.label = "run <script>alert(1)</script>"
    page = snap.to_html(tmp_path / "s.html")
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "gpumem-timeline" in page and "Memory over time" in page
    assert "gpumem-timeline" in snap._repr_html_()
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
    gpumem.record_history(False, device=h)


def test_snapshot_without_history_has_no_timeline(make_heap):
    h = make_heap(capacity=GiB)
    h.malloc(MiB)
    snap = gpumem.snapshot(h, history=False)
    assert snap.memory_over_time() is None and "gpumem-timeline" not in snap.to_html()
    with pytest.raises(ValueError, match="record_history"):
        gpumem.memory_over_time(h)


def test_replay_html_shows_the_whole_trace_over_time(tmp_path, capsys):
    out = tmp_path / "r.html"
    assert (
        main(["replay", "seed_fragmentation", "--html", str(out), "--json", "--no-timing", "--capacity", "1.5GiB"]) == 0
    )
    row = json.loads(capsys.readouterr().out)
    page = out.read_text()
    assert "gpumem-timeline" in page and "gpumem-map" in page
    # the timeline is of the whole trace, not only up to the peak the map shows
    svgs = [s for s in page.split("<svg")[1:] if "gpumem-timeline" in s.split(">")[0]]
    tl_svg = ET.fromstring("<svg" + svgs[0].split("</svg>")[0] + "</svg>")
    assert len([e for e in tl_svg.iter() if e.get("class") == "tl-oom"]) == row["ooms"] >= 1
    ticks = [int(e.text) for e in tl_svg.iter(SVG + "text") if (e.text or "").isdigit()]
    assert max(ticks) == 800 and row["events"] == 802  # the x axis runs to the trace's end
    assert len([e for e in tl_svg.iter() if e.get("class") == "tl-remap"]) >= 1
    assert [e for e in tl_svg.iter() if e.get("class") == "tl-peak"]


def test_matplotlib(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    tl = from_trace(load_trace(trace_file("seed_fragmentation")), int(1.5 * GiB))
    ax = tl.plot()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "live" in labels and "reserved" in labels
    assert any(lb.startswith("cap 1.50 GiB") for lb in labels)
    assert any(lb.startswith("OOM (") for lb in labels) and any(lb.startswith("remaps (") for lb in labels)
    assert any("peak live" in t.get_text() for t in ax.texts)
    ax.figure.savefig(tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 5000
