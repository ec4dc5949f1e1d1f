"""Pages larger than the device's granularity (Heap(page_size=...), GPUMEM_CONF page_size).

Each page is one physical allocation, so a heap of 8 MiB pages grows by a quarter of the
driver calls of one of 2 MiB pages, and every page still moves on its own when the heap
defragments.  These run on the simulated device and on the option parsing, with no GPU;
tests/gpu/test_gpu_chunks.py checks the same on CUDA.
"""

import pytest

import gpumem
from helpers import TORCH_BOUNDARY, run_python
from gpumem.torch._install import normalize_options, parse_conf

MiB = 1 << 20


def test_growth_makes_one_allocation_per_page_of_the_heaps_size(make_heap):
    h = make_heap(capacity=1 << 30, page_size=8 * MiB)
    assert h.page_size == 8 * MiB
    p = h.malloc(64 * MiB)
    st = h.stats()
    assert st["num_device_alloc"] == 8
    assert st["reserved_bytes.all.current"] == 64 * MiB
    q = h.malloc(1 * MiB)  # a small block keeps a whole (larger) page
    assert h.stats()["reserved_bytes.all.current"] == 72 * MiB
    h.free(p)
    h.free(q)
    h.check()
    h.empty_cache()
    assert h.stats()["reserved_bytes.all.current"] == 0


def test_large_pages_still_move_one_at_a_time(make_heap):
    # Every other 8 MiB block freed: no hole fits 16 MiB, so the heap remaps
    # free pages behind a new address (under a cap it cannot grow past).
    h = make_heap(capacity=1 << 30, page_size=8 * MiB, cap=128 * MiB, growth_slack=0.0, growth_slack_pages=0)
    blocks = [h.malloc(8 * MiB) for _ in range(16)]
    for b in blocks[::2]:
        h.free(b)
    big = h.malloc(16 * MiB)
    st = h.stats()
    assert st["num_remaps"] >= 1 and st["num_pages_remapped"] == 2
    assert st["reserved_bytes.all.current"] == 128 * MiB
    h.free(big)
    h.check()


@pytest.mark.parametrize("bad", [3 * MiB, 6 * MiB, 2 * MiB + 512])
def test_a_page_size_that_is_not_a_power_of_two_is_refused(bad):
    for device in ("sim", "cuda"):  # checked before any driver is loaded
        kw = {"capacity": 1 << 30} if device == "sim" else {}
        with pytest.raises(ValueError, match="page_size must be a power of two"):
            gpumem.Heap(device=device, page_size=bad, **kw)


def test_install_options_take_a_page_size():
    assert parse_conf("page_size:8MiB,chunk_pages:1") == {"page_size": "8MiB", "chunk_pages": "1"}
    assert normalize_options({"page_size": "8MiB"})["page_size"] == 8 * MiB
    assert normalize_options({"page_size": 16 * MiB})["page_size"] == 16 * MiB
    assert normalize_options({})["page_size"] == 0
    with pytest.raises(ValueError, match="power of two"):
        normalize_options({"page_size": "3MiB"})
    with pytest.raises(ValueError, match="page_size"):
        normalize_options({"page_size": "lots"})


def test_torch_heaps_are_made_with_the_configured_page_size():
    r = run_python(
        """
        try:
            _C.registry_configure(page_size=3 * MiB)
            refused = False
        except ValueError:
            refused = True
        _C.registry_configure(page_size=8 * MiB)
        opts = _C.registry_options()
        _C.registry_open_sim(0, 1 << 30)
        p = alloc(20 * MiB, 0, None)
        st = _C.registry_heap(0).stats()
        out(refused=refused, option=opts["page_size"], page=_C.registry_heap(0).snapshot()["page_size"],
            allocs=st["num_device_alloc"], reserved=st["reserved_bytes.all.current"])
        """,
        "import json\nfrom gpumem import _C\nMiB = 1 << 20\n"
        + TORCH_BOUNDARY
        + "def out(**kw):\n    print('RESULT ' + json.dumps(kw), flush=True)\n",
    )
    assert r == {"refused": True, "option": 8 * MiB, "page": 8 * MiB, "allocs": 3, "reserved": 24 * MiB}
