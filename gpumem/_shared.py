"""One heap per GPU for every framework in the process: where CuPy's and
Numba's allocations go (gpumem.cupy, gpumem.numba), and how a block says which
framework made it.

By default allocations go to the per-device heaps that gpumem serves torch with
(the registry of csrc/python/torch_alloc.h, reached through gpumem._C's
_shared_malloc / _shared_free), so torch tensors, CuPy arrays and Numba device
arrays share one heap, one cap and one empty_cache.  A gpumem.Heap may be given
instead (a simulated one in tests).

Each block's context carries the framework in bits 55..62 (0: the heap's own
user, torch on the per-device heaps) and, when stacks are recorded, the Python
stack of the allocation in the other bits.
"""
from __future__ import annotations

import sys
import threading
from typing import Dict, Optional

from ._units import format_size

__all__ = ["FRAMEWORK_SHIFT", "FRAMEWORK_MASK", "FRAMEWORKS", "framework_tag", "framework_of", "Backend"]

FRAMEWORK_SHIFT = 55
FRAMEWORK_MASK = 0xFF << FRAMEWORK_SHIFT
FRAMEWORKS: Dict[int, str] = {1: "cupy", 2: "numba"}
_TAGS = {name: fw for fw, name in FRAMEWORKS.items()}

# Frameworks installed on the per-device heaps in this process (gpumem._resolve
# consults it so that snapshot() / explain() find those heaps without torch).
INSTALLED = set()
_lock = threading.Lock()


def framework_tag(name: str) -> int:
    """The context bits that mark a block as allocated by framework `name`."""
    return _TAGS[name] << FRAMEWORK_SHIFT


def framework_of(context: int, default: str = "") -> str:
    """Which framework allocated a block with this context: "cupy", "numba",
    or `default` for the heap's own user (torch on the per-device heaps)."""
    fw = (int(context) & FRAMEWORK_MASK) >> FRAMEWORK_SHIFT
    if not fw:
        return default
    return FRAMEWORKS.get(fw, f"framework {fw}")


def _stack_context() -> int:
    """The caller's Python stack id (0 unless record_history(stacks="python"))."""
    from . import _C

    return int(_C._stack_capture())


class Backend:
    """Where one framework's allocations go: `heap` (a gpumem.Heap), or None for
    the per-device heaps gpumem serves torch with."""

    def __init__(self, framework: str, heap=None):
        self.framework = framework
        self.tag = framework_tag(framework)
        self.heap = heap

    def __repr__(self) -> str:
        where = repr(self.heap) if self.heap is not None else "the per-device heaps"
        return f"<gpumem allocator for {self.framework} on {where}>"

    def malloc(self, size: int, device: int = 0, stream: int = 0) -> int:
        """An address of `size` bytes; raises gpumem.OutOfMemoryError, its text
        the explanation (gpumem.explain) and .info the core's report."""
        context = _stack_context() | self.tag
        if self.heap is not None:
            return self.heap.malloc(size, stream, context)
        from . import _C

        ptr = _C._shared_malloc(int(device), int(size), int(stream), context)
        if ptr is None:
            raise self._oom(size, device)
        return ptr

    def free(self, ptr: int, device: int = 0) -> None:
        if self.heap is not None:
            self.heap.free(ptr)
            return
        from . import _C

        _C._shared_free(int(device), int(ptr))

    def explain_heap(self, device: int = 0):
        """The heap explain() and snapshot() should look at for `device`."""
        if self.heap is not None:
            return self.heap
        from ._resolve import TorchHeap

        return TorchHeap(device)

    def _oom(self, size: int, device: int):
        from . import OutOfMemoryError, _C
        from .explain import format_oom

        info = _C._torch_last_oom(int(device))
        first = (f"CUDA out of memory. Tried to allocate {format_size(size)} on GPU {device} for "
                 f"{self.framework} (gpumem's heap, shared with torch).")
        text = format_oom(self.explain_heap(device), info, first) if info else first
        exc = OutOfMemoryError(text)
        exc.info = info
        return exc


def mark_installed(name: str) -> None:
    with _lock:
        INSTALLED.add(name)


def mark_uninstalled(name: str) -> None:
    with _lock:
        INSTALLED.discard(name)


def current_device() -> int:
    """The current CUDA device of whichever framework is loaded (torch first), else 0."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            return int(torch.cuda.current_device())
        except Exception:
            pass
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            return int(cupy.cuda.runtime.getDevice())
        except Exception:
            pass
    return 0


def default_framework(heap) -> Optional[str]:
    """The name untagged blocks of `heap` belong to: "torch" on the per-device heaps."""
    from ._resolve import TorchHeap

    return "torch" if isinstance(heap, TorchHeap) else None
