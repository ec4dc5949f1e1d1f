"""Does a second thread's page mapping slow the thread that launches the work?

gpumem could move page creation off the allocating thread, to a background thread.  That only
pays if the driver lets the two run side by side.  This measures it:

  launch   the main thread launches many small kernels (torch elementwise ops on 256 KiB), then
           waits for the device: CPU-bound, the case a training step's launches are
  matmul   the main thread runs bf16 8192^3 matrix products: GPU-bound
  vmm      the main thread itself creates, maps, grants and unmaps pages (what growth costs)

each alone, then with a background thread that creates, maps, grants access to, unmaps and releases
single 2 MiB pages in a loop (ctypes lets go of the GIL in each driver call).  Reported: the main
work's time alone and beside the mapper (ratio), and the mapper's microseconds per page alone and
beside each main work.  Median of --repeats.

Usage on a machine with a GPU: python benchmarks/gpu_bg_vmm.py [--repeats 5] [--json PATH]
"""

import argparse
import ctypes
import json
import statistics
import threading
import time

from gpu_vmm_calls import PAGE, AccessDesc, AllocProp, Location, check, driver


class Mapper(threading.Thread):
    """Creates, maps, grants, unmaps and releases one page at a time until stopped."""

    def __init__(self, cu, ctx, ordinal=0):
        super().__init__(daemon=True)
        self.cu, self.ctx = cu, ctx
        self.prop = AllocProp()
        self.prop.type = 1
        self.prop.location = Location(1, ordinal)
        self.desc = AccessDesc(Location(1, ordinal), 3)
        self.stop = threading.Event()
        self.pages = 0
        self.seconds = 0.0

    def run(self):
        cu = self.cu
        check(cu.cuCtxSetCurrent(self.ctx), "context")
        va = ctypes.c_uint64()
        check(cu.cuMemAddressReserve(ctypes.byref(va), PAGE, 0, 0, 0), "reserve")
        h = ctypes.c_uint64()
        t0 = time.perf_counter()
        while not self.stop.is_set():
            check(cu.cuMemCreate(ctypes.byref(h), PAGE, ctypes.byref(self.prop), 0), "create")
            check(cu.cuMemMap(va.value, PAGE, 0, h.value, 0), "map")
            check(cu.cuMemSetAccess(va.value, PAGE, ctypes.byref(self.desc), 1), "access")
            check(cu.cuMemUnmap(va.value, PAGE), "unmap")
            check(cu.cuMemRelease(h.value), "release")
            self.pages += 1
        self.seconds = time.perf_counter() - t0
        check(cu.cuMemAddressFree(va.value, PAGE), "free")


def work_launch(torch):
    x = torch.ones(1 << 16, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(4000):
        x = x * 1.0001 + 1.0
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def work_matmul(torch):
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(40):
        a @ a
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def work_vmm(cu, ordinal=0, n=256):
    prop = AllocProp()
    prop.type = 1
    prop.location = Location(1, ordinal)
    desc = AccessDesc(Location(1, ordinal), 3)
    va = ctypes.c_uint64()
    check(cu.cuMemAddressReserve(ctypes.byref(va), n * PAGE, 0, 0, 0), "reserve")
    hs = [ctypes.c_uint64() for _ in range(n)]
    t0 = time.perf_counter()
    for i, h in enumerate(hs):
        check(cu.cuMemCreate(ctypes.byref(h), PAGE, ctypes.byref(prop), 0), "create")
        check(cu.cuMemMap(va.value + i * PAGE, PAGE, 0, h.value, 0), "map")
        check(cu.cuMemSetAccess(va.value + i * PAGE, PAGE, ctypes.byref(desc), 1), "access")
    t = time.perf_counter() - t0
    for i, h in enumerate(hs):
        check(cu.cuMemUnmap(va.value + i * PAGE, PAGE), "unmap")
        check(cu.cuMemRelease(h.value), "release")
    check(cu.cuMemAddressFree(va.value, n * PAGE), "free")
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    torch.zeros(1, device="cuda")
    cu = driver()
    ctx = ctypes.c_void_p()
    check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "context")
    works = {"launch": lambda: work_launch(torch), "matmul": lambda: work_matmul(torch), "vmm": lambda: work_vmm(cu)}
    for w in works.values():  # warm up: kernels loaded, cuBLAS set up
        w()

    def mapper_alone(seconds=0.5):
        m = Mapper(cu, ctx)
        m.start()
        time.sleep(seconds)
        m.stop.set()
        m.join()
        return m.seconds / max(m.pages, 1)

    rows = []
    alone_us = statistics.median(mapper_alone() for _ in range(a.repeats)) * 1e6
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print(f"background mapper alone: {alone_us:.2f} us per page (create+map+access+unmap+release)")
    print("| main work | alone ms | beside the mapper ms | ratio | mapper us/page beside it |")
    print("|---|---|---|---|---|")
    for name, w in works.items():
        alone, beside, per_page = [], [], []
        for _ in range(a.repeats):
            alone.append(w())
            m = Mapper(cu, ctx)
            m.start()
            time.sleep(0.02)
            beside.append(w())
            m.stop.set()
            m.join()
            per_page.append(m.seconds / max(m.pages, 1))
        row = {
            "work": name,
            "alone_ms": statistics.median(alone) * 1e3,
            "beside_ms": statistics.median(beside) * 1e3,
            "mapper_us_per_page": statistics.median(per_page) * 1e6,
        }
        row["ratio"] = row["beside_ms"] / row["alone_ms"]
        rows.append(row)
        print(
            f"| {name} | {row['alone_ms']:.2f} | {row['beside_ms']:.2f} | {row['ratio']:.3f} "
            f"| {row['mapper_us_per_page']:.2f} |",
            flush=True,
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"device": torch.cuda.get_device_name(0), "mapper_alone_us_per_page": alone_us, "rows": rows},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
