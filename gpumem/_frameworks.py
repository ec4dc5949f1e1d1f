"""Which framework made a block, and which frameworks use the per-device heaps.

Each block's context carries the framework in bits 55..62 (0: the heap's own
user, torch on the per-device heaps) and, when stacks are recorded, the Python
stack of the allocation in the other bits.  This module sits at the bottom of
the package (gpumem/_heaplike.py draws the layers): snapshot and _which_heap read it;
the allocators themselves live in gpumem/_backend.py, above explain.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Dict

__all__ = [
    "FRAMEWORK_SHIFT",
    "FRAMEWORK_MASK",
    "FRAMEWORKS",
    "INSTALLED",
    "framework_tag",
    "framework_of",
    "mark_installed",
    "mark_uninstalled",
    "current_device",
]

FRAMEWORK_SHIFT = 55
FRAMEWORK_MASK = 0xFF << FRAMEWORK_SHIFT
FRAMEWORKS: Dict[int, str] = {1: "cupy", 2: "numba"}
_TAGS = {name: fw for fw, name in FRAMEWORKS.items()}

# Frameworks installed on the per-device heaps in this process (gpumem._which_heap
# consults it so that snapshot() / explain() find those heaps without torch).
INSTALLED = set()
_lock = threading.Lock()


def _new_lock_in_child() -> None:
    # A fork()ed child (a DataLoader worker) has only the forking thread: a
    # lock another thread held at the fork would stay held there for good.
    # The set itself is never half updated (the GIL covers add/discard).
    global _lock
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_lock_in_child)


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
