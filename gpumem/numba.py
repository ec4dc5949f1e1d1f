"""Numba on gpumem's heap: an External Memory Management plugin.

    import gpumem.numba
    gpumem.numba.install()        # before Numba's first CUDA allocation
    # or: NUMBA_CUDA_MEMORY_MANAGER=gpumem.numba (Numba imports it and uses _numba_memory_manager)

Device arrays Numba allocates (cuda.device_array, cuda.to_device, ...) then live in
the per-device heap that torch's tensors and CuPy's arrays use through gpumem, on
the legacy default stream, under one cap, one empty_cache and one snapshot() /
explain(), where Numba's blocks say "numba".  Pinned and mapped host memory stay
Numba's own (HostOnlyCUDAMemoryManager).
"""

from __future__ import annotations

import ctypes
import functools

from . import _C
from ._frameworks import mark_installed
from ._backend import Backend

__all__ = ["install", "GpumemMemoryManager", "memory_manager"]


def memory_manager(heap=None):
    """The EMM plugin class (a numba.cuda.HostOnlyCUDAMemoryManager subclass) over
    the per-device heaps, or over `heap` (a gpumem.Heap)."""
    from numba import cuda

    backend = Backend("numba", heap)

    def _free(device, ptr):
        backend.free(ptr, device)

    class GpumemMemoryManager(cuda.HostOnlyCUDAMemoryManager):
        """Numba's device memory from gpumem's heap."""

        gpumem_backend = backend

        def initialize(self):
            if backend.heap is None:
                _C.registry_heap(self._device())

        def _device(self) -> int:
            return int(self.context.device.id)

        def memalloc(self, size):
            device = self._device()
            # gpumem.OutOfMemoryError (a RuntimeError) carries the explanation
            ptr = backend.malloc(max(int(size), 1), device, 0)
            # The finalizer must not refer to the MemoryPointer, or it would never run.
            return cuda.MemoryPointer(
                self.context, ctypes.c_void_p(ptr), size, finalizer=functools.partial(_free, device, ptr)
            )

        def get_memory_info(self):
            free, total = backend.explain_heap(self._device()).mem_info()
            return cuda.MemoryInfo(free=free, total=total)

        def get_ipc_handle(self, memory):
            raise NotImplementedError(
                "gpumem's Numba memory manager does not export CUDA IPC handles: "
                "gpumem's pages are not cuMemAlloc allocations"
            )

        def reset(self):
            super().reset()
            if backend.heap is not None:
                backend.heap.empty_cache()
            else:
                _C.registry_empty_cache()

        @property
        def interface_version(self):
            return 1

    return GpumemMemoryManager


GpumemMemoryManager = None


def __getattr__(name):
    # NUMBA_CUDA_MEMORY_MANAGER=gpumem.numba makes Numba look up _numba_memory_manager.
    global GpumemMemoryManager
    if name == "_numba_memory_manager":
        if GpumemMemoryManager is None:
            GpumemMemoryManager = memory_manager()
            mark_installed("numba")
        return GpumemMemoryManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def install(heap=None) -> None:
    """numba.cuda.set_memory_manager(gpumem's plugin); call it before Numba
    allocates on the GPU.  heap: a gpumem.Heap instead of the per-device heaps."""
    global GpumemMemoryManager
    from numba import cuda

    cls = memory_manager(heap)
    if heap is None:
        GpumemMemoryManager = cls
        mark_installed("numba")
    cuda.set_memory_manager(cls)
