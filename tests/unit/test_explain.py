"""explain() / last_oom(): each cause named, with its numbers, in a case built to
have that cause (sim device; other processes and NVML faked at the device)."""

import os
import sys

import pytest

import gpumem
from gpumem import _C
from gpumem.explain import explain, last_oom

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture
def heap():
    h = gpumem.Heap(device="sim", capacity=GiB)
    yield h
    gpumem.record_history(False, device=h)
    h.close()


def oom(h, size):
    with pytest.raises(gpumem.OutOfMemoryError) as e:
        h.malloc(size)
    return e.value


def test_request_bigger_than_device(heap):
    r = explain(2 * GiB, heap)
    assert r.main_cause.kind == "too_big" and not r.fits
    assert r.main_cause.bytes == GiB
    assert "larger than the whole device" in r.text() and "split the work" in r.text()


def test_request_bigger_than_the_cap(heap):
    heap.set_cap(256 * MiB)
    r = explain(300 * MiB, heap)
    assert r.main_cause.kind == "too_big" and not r.fits
    assert r.main_cause.bytes == 44 * MiB
    assert "larger than the cap (256.00 MiB)" in r.text()
    assert [c.kind for c in r.causes].count("too_big") == 1


def test_other_processes_by_pid(heap):
    heap.sim_set_external(4242, 600 * MiB)
    heap.sim_set_external(777, 100 * MiB)
    keep = [heap.malloc(50 * MiB) for _ in range(2)]
    e = oom(heap, 400 * MiB)
    r = last_oom(heap)
    assert r.main_cause.kind == "other_processes"
    assert r.main_cause.bytes == 700 * MiB
    assert r.other_processes == [(4242, 600 * MiB), (777, 100 * MiB)]
    text = str(e)
    assert "PID 4242" in text and "600.00 MiB" in text and "CUDA_VISIBLE_DEVICES" in text
    assert r.live_bytes == 100 * MiB and len(keep) == 2


def test_other_processes_without_nvml(heap):
    heap.sim_set_nvml(False)
    heap.sim_set_external(4242, 700 * MiB)
    heap.malloc(100 * MiB)
    oom(heap, 400 * MiB)
    r = last_oom(heap)
    assert r.processes is None and r.outside_allocator is None
    assert r.main_cause.kind == "other_processes"
    assert r.main_cause.bytes == r.unattributed == 700 * MiB
    assert "NVML is not available" in r.text()


def test_outside_the_allocator(heap):
    heap.sim_set_self(os.getpid(), 640 * MiB)
    heap.malloc(100 * MiB)
    oom(heap, 400 * MiB)
    r = last_oom(heap)
    assert r.main_cause.kind == "outside_allocator"
    assert r.outside_allocator == 640 * MiB
    assert r.self_usage == r.reserved_bytes + 640 * MiB
    assert "CUDA context" in r.text() and "CUBLAS_WORKSPACE_CONFIG" in r.text()


def load_weights(h):
    return [h.malloc(100 * MiB) for _ in range(7)]


def test_live_tensors_with_top_sites(heap):
    gpumem.record_history(True, device=heap, stacks="python")
    w = load_weights(heap)
    small = heap.malloc(50 * MiB)
    e = oom(heap, 400 * MiB)
    r = last_oom(heap)
    assert r.main_cause.kind == "live_tensors"
    assert r.main_cause.bytes == r.live_bytes == 750 * MiB
    site, b, n = r.top_sites[0]
    assert "load_weights" in site and b == 700 * MiB and n == 7
    assert "load_weights" in r.main_cause.details[0]
    text = str(e)
    for advice in ("gradient accumulation", "checkpoint", "no_grad", "empty_cache"):
        assert advice in text
    assert len(w) == 7 and small


def test_live_tensors_without_history_says_how_to_get_sites(heap):
    [heap.malloc(100 * MiB) for _ in range(9)]
    oom(heap, 300 * MiB)
    r = last_oom(heap)
    assert r.main_cause.kind == "live_tensors"
    assert "record_history" in r.main_cause.details[0]


def strand_every_page(h, keep):
    """32 pages, each holding a live block of `keep` bytes and the rest of the page freed."""
    big = []
    for _ in range(32):
        big.append(h.malloc(h.page_size - keep))
        h.malloc(keep)
    for p in big:
        h.free(p)


def test_fragmentation_stranded_and_what_defrag_reclaims():
    # 64 KiB live in every page, the rest of each page freed: most free memory is
    # stranded beside live data, where neither defragmentation nor empty_cache reaches.
    with gpumem.Heap(device="sim", capacity=64 * MiB) as h:
        strand_every_page(h, 64 * 1024)
        s = gpumem.snapshot(h).summary
        assert s.stranded_bytes > 50 * MiB and s.live_bytes == 2 * MiB
        oom(h, 8 * MiB)
        r = last_oom(h)
        assert r.main_cause.kind == "fragmentation"
        assert r.main_cause.bytes == r.stranded_bytes == gpumem.snapshot(h).summary.stranded_bytes
        text = r.text()
        assert "never moves live data" in text and "persistent buffers" in text
        assert "page_size" not in text  # the default page: nothing to say about it


def test_fragmentation_on_large_pages_names_the_page_size():
    # The same layout on 8 MiB pages: 256 KiB live in each page strands the rest of it.
    with gpumem.Heap(device="sim", capacity=256 * MiB, page_size=8 * MiB) as h:
        strand_every_page(h, 256 * 1024)
        oom(h, 32 * MiB)
        r = last_oom(h)
        assert r.main_cause.kind == "fragmentation" and r.page_size == 8 * MiB
        assert any("page_size" in a and "8.00 MiB" in a for a in r.advice), r.advice


def test_cap(heap):
    heap.set_cap(256 * MiB)
    heap.malloc(200 * MiB)
    e = oom(heap, 100 * MiB)
    r = last_oom(heap)
    assert r.main_cause.kind == "cap"
    # what the cap keeps out of reach: the device beyond the cap, all of it free here
    assert r.user_cap == 256 * MiB and r.main_cause.bytes == GiB - 256 * MiB <= r.device_free
    assert "Raise or remove the cap" in str(e)


@pytest.mark.parametrize("handoff", [0, 1])
def test_pending_on_other_streams(handoff):
    """Blocks waiting for a side stream that still runs: without the hand-off between streams the
    request fails and the explanation says why; with it (the default) the request's stream waits for
    the side stream on the device and takes them."""
    heap = gpumem.Heap(device="sim", capacity=GiB, stream_handoff=handoff)
    heap.sim_hold_stream(9, True)
    try:
        ptrs = [heap.malloc(100 * MiB) for _ in range(9)]
        for p in ptrs[:6]:
            heap.record_stream(p, 9)
            heap.free(p)
        if handoff:
            heap.malloc(400 * MiB)
            assert heap.stats()["num_stream_handoffs"] == 1 and last_oom(heap) is None
            return
        oom(heap, 400 * MiB)
        r = last_oom(heap)
        assert r.main_cause.kind == "pending" and r.pending_bytes == 600 * MiB
        assert "Synchronize the side streams" in r.text()
    finally:
        heap.sim_hold_stream(9, False)
        heap.close()


def test_explain_without_request_and_fitting_request(heap):
    heap.malloc(100 * MiB)
    r = explain(device=heap)
    assert r.request == 0 and r.fits and "largest block gpumem could make" in r.text()
    r = explain("300MiB", heap)
    assert r.fits and "fits" in r.text().splitlines()[0]
    assert last_oom(heap) is None


def test_explain_takes_the_heap_first_as_snapshot_does(heap):
    heap.malloc(100 * MiB)
    assert gpumem.explain(heap).text() == explain(device=heap).text()
    r = gpumem.explain(heap, "2GiB")
    assert r.request == 2 * GiB and r.main_cause.kind == "too_big"
    with pytest.raises(TypeError, match="takes one heap"):
        gpumem.explain(heap, heap)


def test_oom_message_is_the_report(heap, monkeypatch):
    heap.sim_set_external(4242, 900 * MiB)
    e = oom(heap, 400 * MiB)
    first, _, rest = str(e).partition("\n")
    assert first.startswith("CUDA out of memory. Tried to allocate 400.00 MiB. The device has a total capacity of")
    assert rest.strip() == last_oom(heap).text().split("\n", 1)[1].strip()
    monkeypatch.setenv("GPUMEM_EXPLAIN_OOM", "0")
    assert "\n" not in str(oom(heap, 400 * MiB))


def test_broken_formatter_keeps_the_oom(heap):
    from gpumem.explain import format_oom

    def broken(h, info, text):
        raise RuntimeError("boom")

    _C._set_oom_formatter(broken)
    try:
        e = oom(heap, 2 * GiB)
    finally:
        _C._set_oom_formatter(format_oom)
    assert str(e).startswith("CUDA out of memory.") and "explain failed: boom" in str(e)
    assert e.info["request"] == 2 * GiB


def test_the_explanation_is_registered_at_setup_not_by_importing_explain():
    from helpers import run_python

    r = run_python(
        """
        import importlib, sys
        import gpumem
        from gpumem import _C
        from gpumem._backend import Backend

        def message():
            h = gpumem.Heap(capacity=1 << 30)
            try:
                h.malloc(2 << 30)
            except gpumem.OutOfMemoryError as e:
                return str(e)

        at_setup = message()                       # the package registered it
        _C._set_oom_formatter(None)
        importlib.reload(sys.modules["gpumem.explain"])   # importing explain registers nothing
        after_import = message()
        sys.modules["gpumem.explain"].register_oom_formatter()
        registered = message()
        _C._set_oom_formatter(None)
        Backend("cupy")                            # CuPy's and Numba's install register it
        shared = message()
        out(at_setup=at_setup, after_import=after_import, registered=registered, shared=shared)
        """,
        "import json\ndef out(**kw):\n    print('RESULT ' + json.dumps(kw), flush=True)\n",
    )
    assert "\n" not in r["after_import"] and r["after_import"] == r["at_setup"].split("\n")[0]
    assert r["registered"] == r["shared"] == r["at_setup"] and "What to do" in r["at_setup"]


def test_notebook_references():
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    try:
        shell.user_ns["Out"] = {3: "a result"}
        try:
            raise ValueError("x")
        except ValueError:
            sys.last_traceback = sys.exc_info()[2]
        with gpumem.Heap(device="sim", capacity=GiB) as h:
            h.malloc(900 * MiB)
            oom(h, 400 * MiB)
            r = last_oom(h)
        refs = " ".join(r.notebook_refs)
        assert "Out[3]" in refs and "sys.last_traceback" in refs
        assert "References this notebook keeps alive" in r.text()
    finally:
        sys.last_traceback = None
        InteractiveShell.clear_instance()


# ---- advice follows the causes, by the bytes each accounts for -----------------------


def _advice_kind(line):
    """Which cause an advice line answers (by its wording)."""
    for kind, words in (
        ("live_tensors", "smaller batch"),
        ("outside_allocator", "outside the allocator"),
        ("other_processes", "Free the GPU from other processes"),
        ("cap", "Raise or remove the cap"),
        ("pending", "Synchronize the side streams"),
        ("fragmentation", "Stranded memory"),
    ):
        if words in line:
            return kind
    return None


def _advice_kinds(r):
    return [k for k in map(_advice_kind, r.advice) if k is not None]


def test_batch_too_big_advice_is_about_the_batch_first():
    """Live tensors fill 95% of the device and 700 MiB sit outside the allocator
    (CUDA context, cuBLAS): the batch is the cause, so the batch comes first."""
    with gpumem.Heap(device="sim", capacity=16 * GiB) as h:
        h.sim_set_self(os.getpid(), 700 * MiB)
        live = int(0.95 * 16 * GiB) // (64 * MiB)
        keep = [h.malloc(64 * MiB) for _ in range(live)]
        e = oom(h, GiB)
        r = last_oom(h)
        assert r.live_bytes == live * 64 * MiB >= 0.94 * r.device_total
        assert r.outside_allocator == 700 * MiB
        assert r.cause_kinds[:2] == ["live_tensors", "outside_allocator"]
        assert _advice_kinds(r) == ["live_tensors", "outside_allocator"]
        assert "smaller batch" in r.advice[0] and "95% of the 16.00 GiB device" in r.advice[0]
        text = str(e)
        assert text.index("smaller batch") < text.index("Leave room for the 700.00 MiB")
        assert len(keep) == live


def test_memory_outside_the_allocator_first_when_it_holds_more():
    """The same two causes the other way round: 3 GiB outside, 500 MiB live."""
    with gpumem.Heap(device="sim", capacity=4 * GiB) as h:
        h.sim_set_self(os.getpid(), 3 * GiB)
        keep = h.malloc(500 * MiB)
        oom(h, GiB)
        r = last_oom(h)
        assert r.cause_kinds[:2] == ["outside_allocator", "live_tensors"]
        assert _advice_kinds(r)[:2] == ["outside_allocator", "live_tensors"]
        assert r.advice[0].startswith("Leave room for the 3.00 GiB")
        assert keep


def test_advice_order_is_the_cause_order_with_three_causes():
    """Other processes 1.5 GiB > live 1 GiB > outside 300 MiB: three causes, and
    the advice in the same order as the causes, each once."""
    with gpumem.Heap(device="sim", capacity=4 * GiB) as h:
        h.sim_set_external(4242, 1536 * MiB)
        h.sim_set_self(os.getpid(), 300 * MiB)
        keep = [h.malloc(100 * MiB) for _ in range(10)]
        oom(h, 2 * GiB)
        r = last_oom(h)
        by_bytes = sorted(r.causes, key=lambda c: -c.bytes)
        assert [c.kind for c in r.causes] == [c.kind for c in by_bytes]
        assert r.cause_kinds[:3] == ["other_processes", "live_tensors", "outside_allocator"]
        assert _advice_kinds(r)[:3] == ["other_processes", "live_tensors", "outside_allocator"]
        assert len(set(r.advice)) == len(r.advice)
        assert len(keep) == 10
