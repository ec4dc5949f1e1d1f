"""One heap per GPU for every framework in the process: where CuPy's and
Numba's allocations go (gpumem.cupy, gpumem.numba), and how a block says which
framework made it.

By default allocations go to the per-device heaps that gpumem serves torch with
(the process-wide heap registry, csrc/runtime/heap_registry.h, reached through
gpumem._C's _shared_malloc and the Heap that _C.registry_heap borrows), so torch tensors, CuPy arrays and Numba device
arrays share one heap, one cap and one empty_cache.  A gpumem.Heap may be given
instead (a simulated one in tests).

Each block's context carries the framework (gpumem/_frameworks.py) and, when
stacks are recorded, the Python stack of the allocation.
"""

from __future__ import annotations

from . import _C
from ._frameworks import framework_tag
from ._which_heap import registry_heap
from .explain import format_oom, register_oom_formatter
from ._units import format_size

__all__ = ["Backend"]


def _stack_context() -> int:
    """The caller's Python stack id (0 unless record_history(stacks="python"))."""
    return int(_C._stack_capture())


class Backend:
    """Where one framework's allocations go: `heap` (a gpumem.Heap), or None for
    the per-device heaps gpumem serves torch with."""

    def __init__(self, framework: str, heap=None):
        self.framework = framework
        self.tag = framework_tag(framework)
        self.heap = heap
        register_oom_formatter()  # a Heap's OutOfMemoryError is explained too

    def __repr__(self) -> str:
        where = repr(self.heap) if self.heap is not None else "the per-device heaps"
        return f"<gpumem allocator for {self.framework} on {where}>"

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        """An address of `size` bytes; raises gpumem.OutOfMemoryError, its text
        the explanation (gpumem.explain) and .info the core's report."""
        context = _stack_context() | self.tag
        if self.heap is not None:
            return self.heap.malloc(size, stream, context)
        ptr = _C._shared_malloc(_C.registry_heap(int(device)), int(size), int(stream), context)
        if ptr is None:
            raise self._oom(size, device)
        return ptr

    def free(self, ptr: int, device: int = 0) -> None:
        (self.heap if self.heap is not None else registry_heap(device)).free(ptr)

    def explain_heap(self, device: int = 0):
        """The heap explain() and snapshot() should look at for `device`."""
        if self.heap is not None:
            return self.heap
        return registry_heap(device)

    def _oom(self, size: int, device: int):
        info = registry_heap(device).last_oom()
        first = (
            f"CUDA out of memory. Tried to allocate {format_size(size)} on GPU {device} for "
            f"{self.framework} (gpumem's heap, shared with torch)."
        )
        text = format_oom(self.explain_heap(device), info, first) if info else first
        exc = _C.OutOfMemoryError(text)
        exc.info = info
        return exc
