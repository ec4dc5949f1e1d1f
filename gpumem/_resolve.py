"""Which heap a visibility call means: a Heap passed in, or the one gpumem
installed as PyTorch's allocator for a CUDA device."""

from __future__ import annotations

import sys

from . import _C
from ._C import Heap
from ._frameworks import INSTALLED, current_device
from ._heap import torch_hook

__all__ = ["resolve_heap", "NoHeapError", "TorchHeap", "torch_active"]


class NoHeapError(LookupError):
    """No gpumem heap answers for the device asked about."""


class TorchHeap:
    """The heap gpumem.torch serves a CUDA device with, seen through the
    gpumem._C._torch_* functions, as a HeapLike (gpumem/_heap.py): the part of
    gpumem.Heap's interface that snapshot, history and explain read.  The heap itself lives until the process
    ends (torch_alloc.h), so this handle never goes stale.

    processes: when given (a list of (pid, bytes), or None for "unknown"),
    device_processes() returns it instead of asking NVML again; the OOM
    formatter passes the list torch_alloc.cpp already took."""

    device_kind = "cuda"
    closed = False
    _ASK = object()

    def __init__(self, device: int, processes=_ASK):
        self.torch_device = int(device)
        self._processes = processes

    def __repr__(self) -> str:
        return f"<gpumem.TorchHeap cuda:{self.torch_device}>"

    def _get(self, name, *args):
        got = getattr(_C, name)(self.torch_device, *args)
        if got is None:
            raise NoHeapError(f"gpumem has no heap on cuda:{self.torch_device}: torch has not allocated there")
        return got

    @property
    def device_name(self) -> str:
        return _C._torch_device_name(self.torch_device) or f"cuda:{self.torch_device}"

    @property
    def page_size(self) -> int:
        return self._get("_torch_snapshot")["page_size"]

    def snapshot(self) -> dict:
        return self._get("_torch_snapshot")

    def stats(self) -> dict:
        return self._get("_torch_stats")

    def memory_report(self, size: int = 0) -> dict:
        return self._get("_torch_memory_report", int(size))

    def last_oom(self):
        return _C._torch_last_oom(self.torch_device)

    def history(self):
        return self._get("_torch_history")

    def history_enable(self, max_entries: int) -> None:
        """On every device's heap, now and later: torch's history switch is process-wide."""
        _C._torch_history_enable(int(max_entries))

    def get_cap(self) -> int:
        return self._get("_torch_get_cap")

    def mem_info(self):
        r = self.memory_report(0)
        return r["device_free"], r["device_total"]

    def device_processes(self):
        if self._processes is not TorchHeap._ASK:
            return self._processes
        return _C._torch_processes(self.torch_device)

    def pools(self) -> list:
        return _C._torch_pools(self.torch_device)

    def pool_live(self, pool) -> list:
        return _C._torch_pool_live(self.torch_device, tuple(pool))


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
    if index not in _C._torch_devices():
        _C._torch_open(index)
    return TorchHeap(index)


def resolve_heap(device=None):
    """A Heap for `device`: a Heap (or TorchHeap) itself, or None / an int /
    "cuda:N" / torch.device for the heap gpumem installed for that CUDA device
    (None: the current one).  Raises NoHeapError with what to do instead."""
    if isinstance(device, TorchHeap):
        return device
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
    """The name untagged blocks of `heap` belong to: "torch" on the per-device heaps."""
    return "torch" if isinstance(heap, TorchHeap) else None
