"""CuPy on gpumem's heap: CuPy arrays and torch tensors in one heap per GPU.

    import gpumem.cupy
    gpumem.cupy.install()            # cupy.cuda.set_allocator(gpumem's allocator)
    x = cupy.ones((1000, 1000))      # lives in the heap torch's tensors use (gpumem.install())

A process that uses torch and CuPy otherwise runs two caching allocators, each
keeping memory the other needs.  After install() CuPy allocates from the same
per-device heap as torch (gpumem.install() / change_current_allocator), on
CuPy's current stream, under one cap (gpumem's, see install(cap=...)), one
empty_cache and one snapshot() / explain(), where CuPy's blocks say "cupy".
Arrays handed between the two through DLPack stay valid: the memory belongs to
whichever object owns it, and is freed when that object goes.

An allocation that does not fit raises cupy.cuda.memory.OutOfMemoryError (a
subclass of it whose text is gpumem's explanation; .report has it structured).
"""

from __future__ import annotations

from typing import Optional

from . import _C
from ._frameworks import mark_installed, mark_uninstalled
from .explain import last_oom
from ._backend import Backend
from ._units import parse_size

__all__ = ["install", "uninstall", "allocator", "installed", "empty_cache", "OutOfMemoryError"]

_state = {"backend": None, "previous": None, "allocator": None}
OutOfMemoryError = None  # the subclass of cupy's, made on first use


def _oom_class():
    global OutOfMemoryError
    if OutOfMemoryError is None:
        import cupy

        base = cupy.cuda.memory.OutOfMemoryError

        class GpumemOutOfMemoryError(base):
            """cupy.cuda.memory.OutOfMemoryError with gpumem's explanation as its text."""

            def __init__(self, size, total, message="", report=None, info=None):
                super().__init__(size, total)
                self.args = (message or self.args[0],)
                self.report = report
                self.info = info

            def __str__(self):
                return self.args[0]

            def __reduce__(self):
                return (type(self), (self._size, self._total, self.args[0], None, self.info))

        GpumemOutOfMemoryError.__name__ = "OutOfMemoryError"
        GpumemOutOfMemoryError.__qualname__ = "OutOfMemoryError"
        GpumemOutOfMemoryError.__module__ = __name__
        OutOfMemoryError = GpumemOutOfMemoryError
    return OutOfMemoryError


def allocator(heap=None):
    """(malloc, backend): malloc is a CuPy allocator (for cupy.cuda.set_allocator
    or cupy.cuda.using_allocator) over gpumem, the per-device heaps torch uses or
    `heap` (a gpumem.Heap)."""
    import cupy

    backend = Backend("cupy", heap)
    oom = _oom_class()

    def malloc(size, device_id):
        stream = cupy.cuda.get_current_stream().ptr
        try:
            return backend.malloc(size, device_id, stream)
        except _C.OutOfMemoryError as e:
            report = None
            try:
                report = last_oom(backend.explain_heap(device_id))
            except Exception:
                pass
            raise oom(size, -1, str(e), report, getattr(e, "info", None)) from None

    def free(ptr, device_id):
        backend.free(ptr, device_id)

    # set_allocator keeps the bound method, and with it the allocator object
    alloc = cupy.cuda.memory.PythonFunctionAllocator(malloc, free)
    return alloc.malloc, backend


def install(device=None, *, cap=None, heap=None) -> None:
    """Make gpumem CuPy's allocator in this process (every device).

    cap: a cap on the per-device heaps (bytes or "20GiB"), as
    gpumem.install(cap=...) sets it for torch; None leaves it as it is.
    heap: a gpumem.Heap to allocate from instead of the per-device heaps.
    `device` is accepted for symmetry with gpumem.install and ignored: CuPy
    passes the device of each allocation."""
    import cupy

    if cap is not None:
        _C.registry_configure(cap_bytes=parse_size(cap))
    malloc, backend = allocator(heap)
    if _state["backend"] is None:
        _state["previous"] = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(malloc)
    _state["backend"] = backend
    _state["allocator"] = malloc
    if heap is None:
        mark_installed("cupy")


def uninstall() -> None:
    """Give CuPy its previous allocator back (arrays made through gpumem stay
    valid and return to gpumem's heap when freed)."""
    import cupy

    if _state["backend"] is None:
        return
    cupy.cuda.set_allocator(_state["previous"])
    _state.update(backend=None, previous=None, allocator=None)
    mark_uninstalled("cupy")


def installed() -> bool:
    return _state["backend"] is not None


def empty_cache() -> None:
    """Give every wholly free page of the per-device heaps back to the device
    (the same call as torch.cuda.empty_cache() with gpumem installed)."""
    backend: Optional[Backend] = _state["backend"]
    if backend is not None and backend.heap is not None:
        backend.heap.empty_cache()
    else:
        _C.registry_empty_cache()
