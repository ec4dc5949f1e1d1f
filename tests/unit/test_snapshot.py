"""gpumem.snapshot(): structure, summary arithmetic, torch's format (read by torch's
own _memory_viz), the SVG/HTML map, matplotlib, and the CLI's --snapshot/--html/explain."""

import gzip
import html.parser
import json
import pickle
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

import gpumem
from gpumem.snapshot import Snapshot
from gpumem.trace import _PlainUnpickler, load_trace

from helpers import REPO, snapshot_file, trace_file

MiB = 1 << 20
SVG = "{http://www.w3.org/2000/svg}"


def fragmented_heap(capacity=256 * MiB):
    """Live blocks of mixed sizes with holes between them, one pending block
    (its stream held), and cached pages."""
    h = gpumem.Heap(device="sim", capacity=capacity)
    ptrs = [h.malloc((i % 7 + 1) * 700 * 1024) for i in range(40)]
    for p in ptrs[::3]:
        h.free(p)
    h.sim_hold_stream(7, True)
    h.record_stream(ptrs[1], 7)
    h.free(ptrs[1])
    big = h.malloc(20 * MiB)
    h.free(big)  # leaves wholly free (cached) pages
    return h


@pytest.fixture
def heap():
    h = fragmented_heap()
    yield h
    h.sim_hold_stream(7, False)
    h.close()


def test_blocks_tile_and_segments_are_mapped_runs(heap):
    s = gpumem.snapshot(heap)
    addr = s.va_base
    for b in s.blocks:
        assert b.addr == addr
        addr = b.end
    assert addr == s.va_base + s.top
    states = {b.state for b in s.blocks}
    assert {"live", "free", "pending"} <= states
    segs = s.segments
    assert segs
    for seg in segs:
        assert sum(b.size for b in seg.blocks) == seg.size
        assert seg.addr == seg.blocks[0].addr
        first = (seg.addr - s.va_base) // s.page_size
        assert all(s.pages[p] != 0 for p in range(first, first + seg.size // s.page_size))
    mapped_pages = sum(1 for p in s.pages if p)
    assert sum(seg.size for seg in segs) == mapped_pages * s.page_size


def test_a_free_block_reports_the_request_last_freed_into_it():
    """As torch's snapshot does for an inactive block: its requested_size is
    that of the allocation freed into it last (memory_viz and tests read it
    after the trace's alloc/free pairs are filtered out); memory mapped and
    never allocated from reports 0."""
    with gpumem.Heap(device="sim", capacity=256 * MiB) as h:
        a = h.malloc(65536)
        b = h.malloc(3000)
        h.free(a)
        h.free(b)  # merges with a's block: the newer request is reported
        blocks = [blk for seg in gpumem.snapshot(h).to_torch()["segments"] for blk in seg["blocks"]]
        assert [blk["state"] for blk in blocks] == ["inactive"]
        assert blocks[0]["requested_size"] == 3000
        c = h.malloc(65536)
        seg = gpumem.snapshot(h).to_torch()["segments"][0]
        assert [(blk["state"], blk["requested_size"]) for blk in seg["blocks"]] == [
            ("active_allocated", 65536),
            ("inactive", 0),
        ]
        h.free(c)
        assert gpumem.snapshot(h).to_torch()["segments"][0]["blocks"][0]["requested_size"] == 65536
        h.empty_cache()
        assert gpumem.snapshot(h).to_torch()["segments"] == []


def test_summary_arithmetic(heap):
    s = gpumem.snapshot(heap)
    m = s.summary
    st = heap.stats()
    assert m.live_bytes == st["allocated_bytes.all.current"]
    assert m.reserved_bytes == st["reserved_bytes.all.current"]
    assert m.pending_bytes == sum(b.size for b in s.blocks if b.state == "pending") > 0
    # free mapped bytes are either in wholly free pages or stranded beside live data
    cached_pages = sum(1 for p in s.pages if p == 2)
    assert m.free_mapped_bytes == m.stranded_bytes + cached_pages * s.page_size
    assert m.defrag_reclaimable == (cached_pages + s.spare_pages) * s.page_size
    # used pages hold every live and pending byte
    assert m.used_page_bytes >= m.live_bytes + m.pending_bytes
    assert m.mapped_bytes == m.used_page_bytes + cached_pages * s.page_size
    # fragmentation = 1 - largest free range / free mapped, recomputed independently
    runs, cur, prev = [], 0, None
    for b in s.blocks:
        if b.state == "free":
            cur = cur + b.size if prev == b.addr else b.size
            prev = b.end
            runs.append(cur)
        else:
            prev = None
    assert m.largest_free_range == max(runs)
    assert m.fragmentation == pytest.approx(1 - max(runs) / m.free_mapped_bytes)
    assert 0 < m.fragmentation < 1
    assert m.largest_possible == heap.memory_report(0)["largest_possible"]
    text = str(s)
    assert "fragmentation" in text and "defrag could reclaim" in text


def test_empty_heap_summary():
    with gpumem.Heap(device="sim", capacity=64 * MiB) as h:
        s = gpumem.snapshot(h)
        assert s.summary.live_bytes == 0 and s.summary.fragmentation == 0.0
        assert s.segments == [] and s.to_torch()["segments"] == []
        ET.fromstring(s.to_svg())


def _sample():
    with gzip.open(snapshot_file()) as f:
        return pickle.load(f)


def test_torch_format_matches_the_sample_field_by_field(heap):
    gpumem.record_history(True, device=heap, stacks=None, max_entries=1000)
    p = heap.malloc(3 * MiB)
    heap.free(p)
    heap.malloc(64 * MiB)  # more than the cached pages: new pages get mapped
    ours = gpumem.snapshot(heap).to_torch()
    ref = _sample()
    assert set(ref) <= set(ours)
    assert set(ref["allocator_settings"]) <= set(ours["allocator_settings"])
    rseg, oseg = ref["segments"][0], ours["segments"][0]
    assert set(oseg) - set(rseg) == {"location"}  # gpumem's one key more: device or host (spill)
    assert set(rseg) <= set(oseg) and oseg["location"] == "device"
    for k in rseg:
        if k != "blocks":
            assert type(oseg[k]) is type(rseg[k]), k
    assert set(rseg["blocks"][0]) == set(oseg["blocks"][0])
    ref_states = {"active_allocated", "active_pending_free", "inactive"}
    assert {b["state"] for s in ours["segments"] for b in s["blocks"]} == ref_states
    rtrace = {e["action"]: e for e in ref["device_traces"][0]}
    otrace = {e["action"]: e for e in ours["device_traces"][0]}
    for action in ("alloc", "free_requested", "free_completed"):
        assert set(rtrace[action]) == set(otrace[action]), action
    assert "segment_map" in otrace
    for seg in ours["segments"]:
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
        assert seg["total_size"] == sum(b["size"] for b in seg["blocks"])


def test_dump_is_plain_pickle_protocol_4_and_replays(heap, tmp_path):
    before = [b for b in gpumem.snapshot(heap).blocks if b.state in ("live", "pending")]
    gpumem.record_history(True, device=heap, stacks=None, max_entries=10000)
    ptrs = [heap.malloc(i * MiB + 4096) for i in range(1, 6)]
    heap.free(ptrs[2])
    out = tmp_path / "snap.pickle"
    gpumem.dump_snapshot(out, device=heap)
    raw = out.read_bytes()
    assert raw[:2] == b"\x80\x04"
    data = _PlainUnpickler(open(out, "rb")).load()  # refuses any global: plain data only
    assert data["segments"]
    t = load_trace(out)  # gpumem's own loader reads it back as a trace
    # the blocks live before the history come first, then its 5 allocations and a free
    assert t.live_before == len(before) > 0 and t.live_before_bytes == sum(b.size for b in before)
    assert t.allocs == len(before) + 5 and t.frees == 1
    Snapshot.dump(gpumem.snapshot(heap), tmp_path / "snap.pickle.gz")
    with gzip.open(tmp_path / "snap.pickle.gz") as f:
        assert pickle.load(f)["segments"] == data["segments"]


def test_torch_memory_viz_reads_our_pickle(heap, tmp_path):
    torch = pytest.importorskip("torch")
    from torch.cuda import _memory_viz as mv

    gpumem.record_history(True, device=heap, stacks="python", max_entries=10000)
    keep = [heap.malloc(5 * MiB) for _ in range(3)]
    heap.free(keep[0])
    out = tmp_path / "s.pickle"
    gpumem.dump_snapshot(out, device=heap)
    with open(out, "rb") as f:
        data = pickle.load(f)
    s = gpumem.snapshot(heap).summary
    text = mv.segsum(data)  # asserts its own accounting: blocks must add up to segments
    assert f"segments: {s.n_segments}" in text
    assert f"total_reserved: {mv.Bytes(s.mapped_bytes)}" in text
    assert f"total_allocated: {mv.Bytes(s.requested_bytes)}" in text
    tr = mv.trace(data)
    assert "Device 0" in tr and "del " in tr
    n_allocs = sum(1 for e in data["device_traces"][0] if e["action"] == "alloc")
    assert tr.count(" = seg_") + tr.count(" = MEM[") >= n_allocs
    for fn in (mv.trace_plot, mv.segment_plot):
        page = fn(data)
        assert "snapshot.pickle" in page and len(page) > 1000
    # the flame-graph text lines: one per block, every byte accounted for
    import io

    f = io.StringIO()
    for seg in data["segments"]:
        mv._write_blocks(f, f"seg_{seg['address']}", seg["blocks"])
    total = sum(int(line.rsplit(" ", 1)[1]) for line in f.getvalue().splitlines())
    assert total == s.mapped_bytes
    assert mv.calc_active(data["segments"][0]) >= 0
    del torch


def _svg_blocks(root):
    return [g for g in root.iter(f"{SVG}g") if "block" in (g.get("class") or "").split()]


def test_svg_is_well_formed_with_one_group_per_block(heap):
    s = gpumem.snapshot(heap)
    root = ET.fromstring(s.to_svg())
    assert root.tag == f"{SVG}svg"
    groups = _svg_blocks(root)
    assert len(groups) == len(s.blocks)
    for state in ("live", "pending", "free", "unmapped"):
        assert sum(g.get("data-state") == state for g in groups) == sum(b.state == state for b in s.blocks)
    # every block has hover text with its size; live blocks are drawn to scale
    row_bytes = None
    for g, b in zip(groups, s.blocks):
        title = g.find(f"{SVG}title").text
        assert gpumem.format_size(b.size) in title
        assert int(g.get("data-size")) == b.size
        widths = sum(float(r.get("width")) for r in g.findall(f"{SVG}rect"))
        if b.state == "live" and b.size >= MiB:
            ratio = widths / b.size
            row_bytes = row_bytes or ratio
            assert ratio == pytest.approx(row_bytes, rel=0.02)
    pages = [r for r in root.iter(f"{SVG}rect") if "page" in (r.get("class") or "")]
    assert {r.get("class").split()[1] for r in pages} == {"used", "cached"} | ({"unmapped"} if 0 in s.pages else set())


def test_svg_hover_names_allocation_site():
    with gpumem.Heap(device="sim", capacity=64 * MiB) as h:
        gpumem.record_history(True, device=h, stacks="python")
        try:

            def allocate_weights():
                return h.malloc(3 * MiB)

            allocate_weights()
            svg = gpumem.snapshot(h).to_svg()
        finally:
            gpumem.record_history(False, device=h)
    root = ET.fromstring(svg)
    live = [g for g in _svg_blocks(root) if g.get("data-state") == "live"]
    assert len(live) == 1
    assert "in allocate_weights" in live[0].find(f"{SVG}title").text


class _Checker(html.parser.HTMLParser):
    VOID = {"meta", "br", "img", "input", "link", "hr"}

    def __init__(self):
        super().__init__()
        self.stack, self.external = [], []

    def handle_starttag(self, tag, attrs):
        for k, v in attrs:
            if k in ("src", "href") and v and not v.startswith("#"):
                self.external.append(v)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        pass

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (self.stack[-5:], tag)
        self.stack.pop()


def test_html_is_self_contained_and_balanced(heap, tmp_path):
    s = gpumem.snapshot(heap)
    path = tmp_path / "map.html"
    page = s.to_html(path)
    assert path.read_text() == page
    c = _Checker()
    c.feed(page)
    c.close()
    assert c.stack == [] and c.external == []
    assert "http://" not in page.replace("http://www.w3.org/2000/svg", "") and "https://" not in page
    svg = page[page.index("<svg") : page.index("</svg>") + 6]
    assert len(_svg_blocks(ET.fromstring(svg))) == len(s.blocks)
    frag = s._repr_html_()
    assert "<svg" in frag and "fragmentation" in frag


def test_plot_draws_every_block(heap):
    mpl = pytest.importorskip("matplotlib")
    mpl.use("Agg")
    s = gpumem.snapshot(heap)
    ax = s.plot()
    bars = sum(len(c.get_paths()) for c in ax.collections)
    assert bars >= len(s.blocks) + len(s.pages)
    import matplotlib.pyplot as plt

    plt.close(ax.figure)


def test_snapshot_without_installed_heap_says_what_to_do():
    # A fresh interpreter: in this one another test may have installed gpumem.
    code = (
        "import gpumem\n"
        "from gpumem._which_heap import NoHeapError\n"
        "try:\n"
        "    gpumem.snapshot()\n"
        "except NoHeapError as e:\n"
        "    print('NoHeapError:', e)\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("NoHeapError:"), (p.stdout, p.stderr)
    assert "gpumem.snapshot(heap)" in p.stdout, p.stdout


# ---- CLI --------------------------------------------------------------------------


def run_cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "gpumem", *map(str, args)], capture_output=True, text=True, cwd=cwd or REPO, timeout=300
    )


def trace_path(name):
    return trace_file(name)


def test_cli_replay_snapshot_and_html_at_peak(tmp_path):
    tr = trace_path("seed_fragmentation")
    out, page = tmp_path / "peak.pickle", tmp_path / "peak.html"
    r = run_cli("replay", tr, "--capacity", "2GiB", "--snapshot", out, "--html", page, "--no-timing", "--json")
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    data = pickle.load(open(out, "rb"))
    live = sum(b["size"] for s in data["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    trace = load_trace(tr)
    # the picture is taken at the event where live memory peaks
    assert row["peak_event"] == trace.peak_event
    assert live == row["snapshot_live_bytes"]
    assert live >= trace.peak_live_bytes and live - trace.peak_live_bytes < 512 * trace.allocs
    assert page.read_text().count('class="block live"') == sum(
        1 for s in data["segments"] for b in s["blocks"] if b["state"] == "active_allocated"
    )
    r2 = run_cli("replay", tr, tr, "--snapshot", out)
    assert r2.returncode == 2 and "one TRACE" in r2.stderr


def make_oom_snapshot(path, device_free=64 * MiB):
    """The sample snapshot (the seed_fragmentation workload) cut at its 1 GiB request,
    ending in an 'oom' event as torch writes one (device_free as given)."""
    d = _sample()
    tr = d["device_traces"][0]
    i = max(k for k, e in enumerate(tr) if e["action"] == "alloc" and e["size"] >= 1 << 30)
    oom = dict(tr[i], action="oom", addr=0, device_free=device_free)
    d["device_traces"][0] = tr[:i] + [oom]
    with open(path, "wb") as f:
        pickle.dump(d, f, protocol=4)
    reserved = sum(e["size"] for e in tr[:i] if e["action"] == "segment_alloc")
    return tr[i]["size"], reserved


def test_cli_explain_torch_oom(tmp_path):
    path = tmp_path / "oom.pickle"
    size, reserved = make_oom_snapshot(path)
    r = run_cli("explain", path, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["torch_oom"]["request_bytes"] == size
    assert out["torch_oom"]["reserved_bytes"] == reserved
    assert out["capacity_bytes"] == reserved + 64 * MiB
    assert out["gpumem_fits"] is True
    assert out["gpumem_min_capacity_bytes"] <= out["capacity_bytes"]
    # the verdict agrees with a replay at the minimum and just below it
    low = run_cli("explain", path, "--capacity", f"{out['gpumem_min_capacity_bytes'] - MiB}B", "--json")
    assert json.loads(low.stdout)["gpumem_fits"] is False
    text = run_cli("explain", path)
    assert "torch ran out of memory" in text.stdout and "FITS" in text.stdout


def test_cli_explain_needs_capacity_without_oom(tmp_path):
    path = tmp_path / "plain.pickle"
    with open(path, "wb") as f:
        pickle.dump(_sample(), f, protocol=4)
    r = run_cli("explain", path)
    assert r.returncode == 2 and "--capacity" in r.stderr
    r = run_cli("explain", path, "--capacity", "1GiB")
    assert r.returncode == 0 and "does NOT fit" in r.stdout


# ---- segments as torch counts them: one per growth ---------------------------------------------

POOL = (1, 7)


def _pool_segments(h, pool):
    return [
        (s["address"], s["total_size"], [(b["address"], b["size"], b["state"]) for b in s["blocks"]])
        for s in gpumem.snapshot(h).to_torch()["segments"]
        if s["segment_pool_id"] == pool
    ]


def test_each_growth_of_a_pool_is_a_segment_of_its_own():
    """Two pool requests its free memory cannot serve map pages twice: torch's format shows
    two segments, as two cudaMallocs would, though the pages are neighbours.  Freed, the
    blocks stay apart, one free block per segment."""
    h = gpumem.Heap(device="sim", capacity=256 * MiB)
    h.pool_retain(POOL)
    a = h.malloc(4 * MiB, pool=POOL)
    b = h.malloc(4 * MiB, pool=POOL)
    assert b == a + 4 * MiB, "the test needs neighbouring growths"
    assert len(gpumem.snapshot(h).segments) == 1  # one mapped run
    assert _pool_segments(h, POOL) == [
        (a, 4 * MiB, [(a, 4 * MiB, "active_allocated")]),
        (b, 4 * MiB, [(b, 4 * MiB, "active_allocated")]),
    ]
    h.free(a)
    h.free(b)
    assert _pool_segments(h, POOL) == [
        (a, 4 * MiB, [(a, 4 * MiB, "inactive")]),
        (b, 4 * MiB, [(b, 4 * MiB, "inactive")]),
    ]
    assert h.check() is None
    h.pool_release(POOL)
    h.close()


def test_a_block_that_extends_its_pools_memory_keeps_one_segment():
    """A pool request over the pool's free block and new pages after it (a larger graph
    growing the smaller one's memory in place): the block lies in two growths, which
    stay one segment -- a live block never straddles two."""
    h = gpumem.Heap(device="sim", capacity=256 * MiB)
    h.pool_retain(POOL)
    a = h.malloc(4 * MiB, pool=POOL)
    h.free(a)
    b = h.malloc(10 * MiB, pool=POOL)
    assert b == a
    assert _pool_segments(h, POOL) == [(a, 10 * MiB, [(a, 10 * MiB, "active_allocated")])]
    h.free(b)
    h.pool_release(POOL)
    h.close()


def test_general_growths_are_segments_and_a_free_block_across_two_is_cut():
    h = gpumem.Heap(device="sim", capacity=256 * MiB)
    x = h.malloc(4 * MiB)
    y = h.malloc(4 * MiB)
    assert y == x + 4 * MiB
    assert [(s["address"], s["total_size"]) for s in gpumem.snapshot(h).to_torch()["segments"]] == [
        (x, 4 * MiB),
        (y, 4 * MiB),
    ]
    h.free(x)
    h.free(y)  # one free block over both growths
    segs = gpumem.snapshot(h).to_torch()["segments"]
    assert [(s["address"], s["total_size"], len(s["blocks"])) for s in segs] == [(x, 4 * MiB, 1), (y, 4 * MiB, 1)]
    h.close()
