"""torch.compile's regions in snapshots: `_record_memory_history(..., compile_context=True)`.

Each trace entry of torch's snapshot carries `compile_context`: the innermost
"Torch-Compiled Region: <frame>/<recompile>" running when it was recorded, "N/A" outside
any.  Dynamo marks a region with a RecordFunction, which only C++ can observe, so
csrc/torch_ext/regions.cpp (built on first use, see _cppext) hands each region's entry and
exit here; the stack of regions entered becomes a timeline the snapshot reads.
"""

from __future__ import annotations

import ctypes
import threading
import warnings

from . import _cppext

OUTSIDE = "N/A"  # torch's compile_context outside any region

_REGION_FN = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_int)
_state = {"lib": None, "on": False, "warned": False, "sink": None}
_lock = threading.Lock()
_stack: list = []  # the regions entered, innermost last (one stack, as torch's allocator keeps)


def region(name: str, entered: bool, sink) -> None:
    """A region entered (or left, name unused): sink(the innermost region now running)."""
    with _lock:
        if entered:
            _stack.append(name)
        elif _stack:
            _stack.pop()
        top = _stack[-1] if _stack else OUTSIDE
    if sink is not None:
        sink(top)


def _on_region(name: bytes, entered: int) -> None:
    region(name.decode(errors="replace"), bool(entered), _state["sink"])


_callback = _REGION_FN(_on_region)  # kept alive: the library calls it from any thread


def _lib():
    if _state["lib"] is None:
        lib = _cppext.load("regions.cpp", "gm_regions", ["c10", "torch_cpu"], purpose="compile_context=True")
        lib.gm_regions_start.argtypes = [_REGION_FN]
        lib.gm_regions_start.restype = None
        lib.gm_regions_stop.argtypes = []
        lib.gm_regions_stop.restype = None
        _state["lib"] = lib
    return _state["lib"]


def start(sink) -> bool:
    """Follow compiled regions from now on: sink(region) at each entry and exit, with the
    innermost region then running (OUTSIDE when none).  False, with one warning, when the C++
    part cannot be built (no compiler): entries then say "N/A"."""
    _state["sink"] = sink
    if _state["on"]:
        return True
    try:
        lib = _lib()
    except _cppext.CppBuildError as e:
        if not _state["warned"]:
            _state["warned"] = True
            warnings.warn(f"gpumem: compile regions are not recorded: {e}", RuntimeWarning, stacklevel=3)
        return False
    lib.gm_regions_start(_callback)
    _state["on"] = True
    return True


def stop() -> None:
    if _state["on"]:
        _state["lib"].gm_regions_stop()
        _state["on"] = False
    with _lock:
        _stack.clear()


def active() -> bool:
    return _state["on"]
