"""What CUDA's virtual memory calls cost, per 2 MiB page, by how the pages are grouped.

For N pages (N = 1, 64, 512, 5120), five ways to back N * 2 MiB of reserved address space:

  pages    N handles of one page each: N cuMemCreate, N cuMemMap, one cuMemSetAccess over the range
  pages+   the same, but one cuMemSetAccess per page
  chunk    one handle of N pages: one cuMemCreate, one cuMemMap, one cuMemSetAccess
  pages/t4 as pages, with the creations, the maps and the access grants (one per quarter of the
           range) spread over 4 threads
  chunk/p  one handle of N pages mapped page by page (N cuMemMap at offsets into it), one
           cuMemSetAccess: pages that can still be unmapped one at a time, from one creation

and back again (cuMemUnmap per mapping, cuMemRelease per handle).  Each phase is timed on the host
around the driver calls (they are synchronous), median of --repeats, in microseconds per page.  This
is what bounds growth, pause/resume and remapping: a heap that maps pages one by one pays the "pages"
row, whatever its own bookkeeping costs.

Usage on a machine with a GPU: python benchmarks/gpu_vmm_calls.py [--pages 1,64,512,5120] [--json PATH]
"""

import argparse
import ctypes
import json
import statistics
import time

PAGE = 2 << 20


class Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class AllocProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", AllocFlags),
    ]


class AccessDesc(ctypes.Structure):
    _fields_ = [("location", Location), ("flags", ctypes.c_int)]


def driver():
    cu = ctypes.CDLL("libcuda.so.1")
    u64, sz, ptr = ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
    signatures = {
        "cuMemAddressReserve": [ptr, sz, sz, u64, u64],
        "cuMemAddressFree": [u64, sz],
        "cuMemCreate": [ptr, sz, ptr, u64],
        "cuMemRelease": [u64],
        "cuMemMap": [u64, sz, sz, u64, u64],
        "cuMemUnmap": [u64, sz],
        "cuMemSetAccess": [u64, sz, ptr, sz],
        "cuCtxGetCurrent": [ptr],
        "cuCtxSetCurrent": [ptr],
    }
    for name, args in signatures.items():
        fn = getattr(cu, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return cu


def check(rc, what):
    if rc != 0:
        raise RuntimeError(f"{what} failed with CUDA error {rc}")


def threaded(cu, n, va, handles, prop, desc, k):
    """The "pages" way with each phase split over k threads (ctypes lets go of the GIL in calls)."""
    from concurrent.futures import ThreadPoolExecutor

    parts = [range(i * n // k, (i + 1) * n // k) for i in range(k)]
    ctx = ctypes.c_void_p()
    check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "context")

    def bind():  # the driver's calls need the context current on each worker thread
        check(cu.cuCtxSetCurrent(ctx), "context")

    def create(part):
        for i in part:
            check(cu.cuMemCreate(ctypes.byref(handles[i]), PAGE, ctypes.byref(prop), 0), "create")

    def map_(part):
        for i in part:
            check(cu.cuMemMap(va.value + i * PAGE, PAGE, 0, handles[i].value, 0), "map")

    def access(part):
        if len(part):
            check(cu.cuMemSetAccess(va.value + part[0] * PAGE, len(part) * PAGE, ctypes.byref(desc), 1), "access")

    def unmap(part):
        for i in part:
            check(cu.cuMemUnmap(va.value + i * PAGE, PAGE), "unmap")

    def release(part):
        for i in part:
            check(cu.cuMemRelease(handles[i].value), "release")

    t = [time.perf_counter()]
    with ThreadPoolExecutor(k, initializer=bind) as pool:
        for phase in (create, map_, access, unmap, release):
            list(pool.map(phase, parts))
            t.append(time.perf_counter())
    check(cu.cuMemAddressFree(va.value, n * PAGE), "free")
    return [b - a for a, b in zip(t, t[1:])]


class Unsupported(RuntimeError):
    """The driver refuses this way of backing pages."""


def one(cu, n, how, ordinal=0):
    """Times (create, map, set_access, unmap, release) in seconds for n pages backed `how`."""
    prop = AllocProp()
    prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location = Location(1, ordinal)  # CU_MEM_LOCATION_TYPE_DEVICE
    desc = AccessDesc(Location(1, ordinal), 3)  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    va = ctypes.c_uint64()
    check(cu.cuMemAddressReserve(ctypes.byref(va), n * PAGE, 0, 0, 0), "reserve")
    one_handle = how in ("chunk", "chunk/p")
    size = n * PAGE if how == "chunk" else PAGE  # the size of each mapping
    count = 1 if how == "chunk" else n  # mappings
    handles = [ctypes.c_uint64() for _ in range(1 if one_handle else n)]
    if how == "pages/t4":
        return threaded(cu, n, va, handles, prop, desc, 4)
    t = [time.perf_counter()]
    for h in handles:
        check(cu.cuMemCreate(ctypes.byref(h), n * PAGE if one_handle else PAGE, ctypes.byref(prop), 0), "create")
    t.append(time.perf_counter())
    for i in range(count):
        h, offset = (handles[0], i * size) if one_handle else (handles[i], 0)
        rc = cu.cuMemMap(va.value + i * size, size, offset, h.value, 0)
        if rc and how == "chunk/p":  # part of a handle, or at an offset into one: the driver may refuse
            for j in range(i):
                check(cu.cuMemUnmap(va.value + j * size, size), "unmap")
            for x in handles:
                check(cu.cuMemRelease(x.value), "release")
            check(cu.cuMemAddressFree(va.value, n * PAGE), "free")
            raise Unsupported(f"cuMemMap of one page of a {n}-page handle failed with CUDA error {rc}")
        check(rc, "map")
    t.append(time.perf_counter())
    if how == "pages+":
        for i in range(count):
            check(cu.cuMemSetAccess(va.value + i * size, size, ctypes.byref(desc), 1), "access")
    else:
        check(cu.cuMemSetAccess(va.value, n * PAGE, ctypes.byref(desc), 1), "access")
    t.append(time.perf_counter())
    for i in range(count):
        check(cu.cuMemUnmap(va.value + i * size, size), "unmap")
    t.append(time.perf_counter())
    for h in handles:
        check(cu.cuMemRelease(h.value), "release")
    t.append(time.perf_counter())
    check(cu.cuMemAddressFree(va.value, n * PAGE), "free")
    return [b - a for a, b in zip(t, t[1:])]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", default="1,64,512,5120")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    torch.zeros(1, device="cuda")  # the primary context, current on this thread
    cu = driver()
    phases = ["create", "map", "set_access", "unmap", "release"]
    rows = []
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("| pages | how | " + " | ".join(f"{p} us/page" for p in phases) + " | total us/page |")
    print("|---|---|" + "---|" * (len(phases) + 1))
    for n in map(int, a.pages.split(",")):
        for how in ("pages", "pages+", "pages/t4", "chunk", "chunk/p"):
            if how != "pages" and how != "chunk" and n < 4:
                continue
            try:
                runs = [one(cu, n, how) for _ in range(a.repeats)]
            except Unsupported as e:
                rows.append({"pages": n, "how": how, "unsupported": str(e)})
                print(f"| {n} | {how} | " + " | ".join("-" for _ in phases) + f" | not supported: {e} |", flush=True)
                continue
            med = [statistics.median(r[i] for r in runs) * 1e6 / n for i in range(len(phases))]
            rows.append({"pages": n, "how": how, **{p + "_us_per_page": round(v, 3) for p, v in zip(phases, med)}})
            print(f"| {n} | {how} | " + " | ".join(f"{v:.2f}" for v in med) + f" | {sum(med):.2f} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
