"""Raw CUDA runtime calls through ctypes, outside every allocator under test.

The fair cap: before an attempt, one cudaMalloc takes all but `cap` bytes of the device's free
memory, so whatever the allocator does (its own pool, the driver's stream-ordered pool, virtual
memory pages) it has exactly `cap` bytes of physical memory.  A per-process memory fraction would
not do: under backend:cudaMallocAsync it limits live bytes, not what the driver's pool holds.

The library is the libcudart that torch itself loaded when one is (so both share the runtime's
state); otherwise it is looked for inside the torch install (nvidia/cu13/lib with CUDA 13 wheels,
nvidia/cuda_runtime/lib with CUDA 12 ones, torch/lib for builds that bundle it) and then on the
system path.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import time
from typing import List, Optional, Tuple

MiB = 1 << 20
HOG_GRANULE = 2 * MiB  # cudaMalloc hands out 2 MiB pages for large requests


class CudaError(RuntimeError):
    pass


def candidate_paths() -> List[str]:
    """Where libcudart may be, most specific first."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    out: List[str] = list(names)  # already loaded by torch, or on the loader's path
    roots = []
    for p in sys.path:
        if p and (os.path.isdir(os.path.join(p, "nvidia")) or os.path.isdir(os.path.join(p, "torch"))):
            roots.append(p)
    for root in roots:
        for pattern in (
            "nvidia/cu13/lib/libcudart.so*",
            "nvidia/cuda_runtime/lib/libcudart.so*",
            "nvidia/*/lib/libcudart.so*",
            "torch/lib/libcudart*.so*",
        ):
            out.extend(sorted(glob.glob(os.path.join(root, pattern)), reverse=True))
    for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
        out.extend(sorted(glob.glob(os.path.join(d, "libcudart.so*")), reverse=True))
    seen, uniq = set(), []
    for p in out:
        if p not in seen:
            seen.add(p)
            uniq.append(p)
    return uniq


class CudaRT:
    def __init__(self, path: Optional[str] = None):
        tried = []
        self.lib = None
        for p in [path] if path else candidate_paths():
            try:
                self.lib = ctypes.CDLL(p)
                self.path = p
                break
            except OSError as e:
                tried.append(f"{p}: {e}")
        if self.lib is None:
            raise CudaError("libcudart not found; tried " + "; ".join(tried[:8]))
        L = self.lib
        L.cudaMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        L.cudaFree.argtypes = [ctypes.c_void_p]
        L.cudaMemGetInfo.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.POINTER(ctypes.c_size_t)]
        L.cudaSetDevice.argtypes = [ctypes.c_int]
        L.cudaGetErrorString.restype = ctypes.c_char_p
        L.cudaGetErrorString.argtypes = [ctypes.c_int]
        L.cudaDeviceSynchronize.argtypes = []
        self.hog_ptr: Optional[int] = None
        self.hog_bytes = 0

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            msg = self.lib.cudaGetErrorString(rc)
            raise CudaError(f"{what} failed: error {rc} ({msg.decode() if msg else '?'})")

    def init(self, device: int = 0) -> None:
        self._check(self.lib.cudaSetDevice(device), "cudaSetDevice")
        self._check(self.lib.cudaFree(None), "cudaFree(0) (context creation)")

    def mem_info(self) -> Tuple[int, int]:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._check(self.lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
        return free.value, total.value

    def stable_free(self, settle_s: float = 1.0) -> Tuple[int, int]:
        """Free memory once it stops changing: a previous attempt's process may still be handing
        its memory back to the driver, and taking the cap before that would let the allocator
        under test use memory freed after the cap was set."""
        free, total = self.mem_info()
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            time.sleep(0.02)
            again, _ = self.mem_info()
            if abs(again - free) < HOG_GRANULE:
                return again, total
            free = again
        return free, total

    def malloc(self, nbytes: int) -> int:
        p = ctypes.c_void_p()
        self._check(self.lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(nbytes)), f"cudaMalloc({nbytes})")
        return p.value or 0

    def free(self, ptr: int) -> None:
        self._check(self.lib.cudaFree(ctypes.c_void_p(ptr)), "cudaFree")

    def impose_cap(self, cap: int) -> dict:
        """Leave `cap` bytes free with one raw allocation.  Returns what happened, with the free
        memory actually left (`cap_effective`), which is what results report."""
        free, total = self.stable_free()
        info = {"free_before": free, "total": total, "cap_requested": cap}
        if cap >= free:
            raise CudaError(f"cap {cap} is not below the free memory {free}: nothing to take")
        hog = (free - cap) // HOG_GRANULE * HOG_GRANULE
        if hog > 0:
            self.hog_ptr = self.malloc(hog)
            self.hog_bytes = hog
        after, _ = self.mem_info()
        info.update(hog_bytes=hog, cap_effective=after)
        return info
