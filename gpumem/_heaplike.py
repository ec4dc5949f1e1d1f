"""The heap interface that snapshot, history and explain read, and the hooks the
torch layer hands down.

gpumem's Python package imports one way, bottom to top, in the layers that
docs/architecture.md lists (tests/repo/test_layers.py holds the code to them): this
file is in the lowest, the torch layer (gpumem.torch) near the top, and nothing
imports a module above it.  The torch layer reaches the layers below by
registering its hooks here at install (register_torch_hooks), never the other
way round.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Protocol, Sequence, Tuple, runtime_checkable

from . import _C

__all__ = ["HeapLike", "MAX_HISTORY", "register_torch_hooks", "torch_hook"]

# The history ring is allocated up front (48 B an entry), so it is bounded; torch's
# _record_memory_history defaults max_entries to sys.maxsize.  gpumem._C holds the bound
# (csrc/python/config_glue.c), which install()'s history option is checked against.
MAX_HISTORY = _C.MAX_HISTORY


@runtime_checkable
class HeapLike(Protocol):
    """What snapshot, history and explain read from a heap: gpumem.Heap provides
    it, whether it owns its heap (any device) or borrows the heap registry's one
    that torch's allocations go to (gpumem._C.registry_heap).  Dicts are those
    of gpumem._C (csrc/python/convert.c)."""

    device_kind: str  # "sim" or "cuda"
    closed: bool

    @property
    def device_name(self) -> str: ...
    @property
    def page_size(self) -> int: ...
    def snapshot(self) -> dict: ...  # va_base, page_size, blocks, pages, stats, ...
    def stats(self) -> dict: ...  # torch's memory_stats keys
    def memory_report(self, size: int = 0) -> dict: ...
    def last_oom(self) -> Optional[dict]: ...
    def history(self) -> Tuple[Sequence[tuple], int]: ...  # (entries, dropped)
    def history_enable(self, max_entries: int) -> None: ...
    def get_cap(self) -> int: ...
    def mem_info(self) -> Tuple[int, int]: ...  # (free, total)
    def device_processes(self): ...  # [(pid, bytes)] or None
    def pools(self) -> list: ...  # living private pools (dicts)
    def pool_live(self, pool) -> list: ...  # [(addr, size)] of a pool


# Hooks of the torch layer (gpumem.torch), set when it installs:
#   "active":     () -> bool, whether gpumem is torch's allocator in this process
#   "stack_hook": (enabled: bool) -> None, take Python stacks of torch's allocations
_torch_hooks: Dict[str, Callable] = {}


def register_torch_hooks(**hooks: Callable) -> None:
    """Called by gpumem.torch: the layers below reach it only through these."""
    unknown = set(hooks) - {"active", "stack_hook"}
    if unknown:
        raise ValueError(f"unknown torch hook(s) {sorted(unknown)}")
    _torch_hooks.update(hooks)


def torch_hook(name: str) -> Optional[Callable]:
    return _torch_hooks.get(name)
