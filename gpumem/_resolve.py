"""Which heap a visibility call means: a Heap passed in, or the one gpumem
installed as PyTorch's allocator for a CUDA device."""
from __future__ import annotations

import sys

__all__ = ["resolve_heap", "NoHeapError"]


class NoHeapError(LookupError):
    """No gpumem heap answers for the device asked about."""


def _installed_heap(device):
    """The heap gpumem.torch serves `device` with, or None.

    Only consulted when gpumem.torch was imported (installing gpumem as torch's
    allocator imports it), so that asking about a sim heap never imports torch.
    """
    mod = sys.modules.get("gpumem.torch")
    if mod is None:
        return None
    for name in ("heap", "get_heap", "heap_for"):
        fn = getattr(mod, name, None)
        if callable(fn):
            return fn(device)
    return None


def resolve_heap(device=None):
    """A Heap for `device`: a Heap itself, or None / an int / "cuda:N" /
    torch.device for the heap gpumem installed for that CUDA device (None: the
    current one).  Raises NoHeapError with what to do instead."""
    from . import Heap

    if isinstance(device, Heap):
        if device.closed:
            raise ValueError("this gpumem.Heap is closed")
        return device
    heap = _installed_heap(device)
    if heap is not None:
        return heap
    where = "the current CUDA device" if device is None else f"device {device!r}"
    raise NoHeapError(
        f"no gpumem heap serves {where}: install gpumem as PyTorch's allocator first "
        f"(gpumem.torch.install()), or pass a gpumem.Heap, e.g. gpumem.snapshot(heap)"
    )
