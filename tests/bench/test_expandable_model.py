"""benchmarks/expandable_model.py: torch's allocator with expandable segments, as the policy's peak
reserved is compared with it -- growth by whole pages of each pool, the best fit passing over the
free block at the mapped end, and a shipped trace against what expandable segments reserved on a GPU."""

import json
import os
import sys

import pytest

from helpers import REPO

sys.path.insert(0, os.path.join(str(REPO), "benchmarks"))

import expandable_model as E  # noqa: E402

MiB = 1 << 20


def test_growth_maps_whole_pages_of_each_pool_and_extends_the_free_end():
    m = E.ExpandableSegments()
    a = m.malloc(MiB + 1, 0)  # rounds to 512 bytes, over 1 MiB: the large pool, 20 MiB pages
    assert a.size == MiB + 512 and m.reserved == 20 * MiB
    b = m.malloc(30 * MiB, 0)  # the free end (19 MiB - 512) extended by one page, not two
    assert b.addr == a.addr + a.size and m.reserved == 40 * MiB
    m.malloc(100, 0)  # the small pool: its own segment, 2 MiB pages
    assert m.reserved == 42 * MiB
    m.malloc(100, 1)  # another stream: a segment of its own
    assert m.reserved == 44 * MiB and m.peak == 44 * MiB


def test_the_best_fit_passes_over_the_free_block_at_the_mapped_end():
    m = E.ExpandableSegments()
    a = m.malloc(8 * MiB, 0)
    m.malloc(8 * MiB, 0)  # [8, 16) MiB; [16, 20) stays free at the mapped end
    m.free(a)  # [0, 8) free
    c = m.malloc(3 * MiB, 0)  # fits the end's 4 MiB best, but takes the 8 MiB block
    assert c.addr == a.addr
    d = m.malloc(4 * MiB, 0)  # the end's 4 MiB fits exactly; the 5 MiB block left of c is taken
    assert d.addr == a.addr + 3 * MiB
    e = m.malloc(5 * MiB, 0)  # nothing fits: the end's 4 MiB grows by one page
    assert e.addr == a.addr + 16 * MiB and m.reserved == 40 * MiB


def test_freed_neighbours_merge_and_nothing_is_unmapped():
    m = E.ExpandableSegments()
    blocks = [m.malloc(3 * MiB, 0) for _ in range(6)]  # 18 MiB of one 20 MiB page
    for b in blocks[::2] + blocks[1::2]:
        m.free(b)
    (seg,) = m.segs.values()
    assert [(s, a) for s, a, _ in seg.free] == [(20 * MiB, blocks[0].addr)]
    assert m.reserved == 20 * MiB  # freed memory stays mapped


def test_a_shipped_trace_reserves_to_the_byte_what_expandable_segments_reserved_on_a_gpu():
    results = REPO / "benchmarks" / "results" / "gpu_compare.json"
    if not results.exists():
        pytest.skip("benchmarks/results is not shipped here")
    from gpumem.trace import load_trace

    rows = json.loads(results.read_text())["figures"]["2"]["rows"]
    gpu = {r["trace"]: r["reserved"] for r in rows if r["contender"] == "expandable" and r["status"] == "ok"}
    assert E.replay(load_trace("resnet50_multires"))["peak_reserved"] == gpu["resnet50_multires"]
    assert E.replay(load_trace("seed_fragmentation"))["peak_reserved"] == gpu["seed_fragmentation"]
