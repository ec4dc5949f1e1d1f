"""Which heap a visibility call means: a Heap passed in, or the heap of a CUDA
device in the process-wide heap registry, the one torch's (and CuPy's, Numba's)
allocations go to once gpumem serves them, borrowed as a Heap too
(gpumem._C.registry_heap)."""

from __future__ import annotations

import sys

from . import _C
from ._C import Heap
from ._frameworks import INSTALLED, current_device
from ._heaplike import torch_hook

__all__ = ["resolve_heap", "NoHeapError", "torch_active", "registry_heap"]


class NoHeapError(LookupError):
    """No gpumem heap answers for the device asked about."""


def torch_active() -> bool:
    """Whether gpumem is torch's allocator in this process (it stays so after
    uninstall(), which only gives the memory API back).  gpumem.torch registers
    the answer when it installs; before that it is False."""
    active = torch_hook("active")
    return bool(active and active())


def shared_active() -> bool:
    """Whether the per-device heaps serve anyone here: torch, or CuPy / Numba
    through gpumem.cupy / gpumem.numba."""
    return bool(INSTALLED) or torch_active()


def _device_index(device):
    """None / int / "cuda" / "cuda:N" / torch.device -> a CUDA device index, or None
    for something that names no CUDA device."""
    if isinstance(device, bool):
        return None
    if isinstance(device, int):
        return device
    torch = sys.modules.get("torch")
    if device is None:
        return current_device()
    if isinstance(device, str) and not device.startswith("cuda"):
        return None
    if torch is None:
        if isinstance(device, str) and device.startswith("cuda:") and device[5:].isdigit():
            return int(device[5:])
        if device == "cuda":
            return current_device()
        return None
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        return None
    if d.type != "cuda":
        return None
    return d.index if d.index is not None else torch.cuda.current_device()


def registry_heap(device: int):
    """The Heap borrowing the heap registry's heap of CUDA device `device`;
    NoHeapError while nothing has allocated there."""
    heap = _C.registry_heap(int(device), open=False)
    if heap is None:
        raise NoHeapError(f"gpumem has no heap on cuda:{int(device)}: torch has not allocated there")
    return heap


def _installed_heap(device):
    """The heap gpumem.torch serves `device` with (created now if torch has not
    allocated there yet), or None when gpumem is not torch's allocator.

    Only consulted once gpumem.torch installed itself (it registers the "active"
    hook) or gpumem.cupy / gpumem.numba installed, so that asking about a sim
    heap never imports torch.
    """
    if not shared_active():
        return None
    index = _device_index(device)
    if index is None:
        return None
    return _C.registry_heap(index)


def resolve_heap(device=None):
    """A Heap for `device`: a Heap itself, or None / an int / "cuda:N" /
    torch.device for the heap gpumem installed for that CUDA device (None: the
    current one).  Raises NoHeapError with what to do instead."""
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
        f"(gpumem.install(), before the first CUDA tensor), or pass a gpumem.Heap, e.g. gpumem.snapshot(heap)"
    )


def default_framework(heap) -> "str | None":
    """The name untagged blocks of `heap` belong to: "torch" on the heap registry's heaps."""
    return "torch" if getattr(heap, "registry_device", None) is not None else None
