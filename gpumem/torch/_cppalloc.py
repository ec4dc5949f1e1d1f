"""gpumem as torch's C++ allocator object, for C++ callers (csrc/torch_ext/allocator.cpp).

torch's CUDAPluggableAllocator answers the allocator's C++ interface with "does not yet
support" (recordHistory, snapshot, getDeviceStats, ...); gpumem patches the Python functions
that reach it, which C++ callers (extensions, the profiler, torch's own C++) never pass
through.  allocator.cpp subclasses CUDAPluggableAllocator and answers them as the patched
Python functions do, through the Hooks object below.  It is built on first use; when it
cannot be (no C++ compiler, no CUDA headers), install() keeps torch's plain pluggable
allocator and says so once in a warning.
"""

from __future__ import annotations

import ctypes
import glob
import os
import re
import sys
import sysconfig
import warnings

from .. import _C
from . import _cppext, _regions, _viz

# what each macro of allocator.cpp looks for in torch's allocator headers (a regular expression)
_FEATURES = {
    "GM_HAS_SNAPSHOT_TRACES_ARG": r"bool include_traces",
    "GM_HAS_IS_HISTORY_ENABLED": r"isHistoryEnabled",
    "GM_HAS_USER_METADATA": r"setUserMetadata",
    "GM_HAS_COMPILE_CONTEXT": r"pushCompileContext",
    "GM_HAS_SKIP_ACTIONS": r"RecordContext when,\s*bool clearHistory,\s*const std::vector<std::string>& skip_actions",
    "GM_HAS_CONFIG_METADATA": r"config_metadata;",
    "GM_TRACE_HAS_MEMPOOL": r"MempoolId_t mempool,\s*approx_time_t time",
    "GM_TRACE_HAS_COMPILE_CONTEXT": r"std::string compile_context = \"\"",
    "GM_TRACE_HAS_USER_METADATA": r"std::string user_metadata = \"\"",
}
_HEADERS = (("c10", "cuda", "CUDACachingAllocator.h"), ("c10", "core", "CachingDeviceAllocator.h"))
_HOOK_KINDS = {
    "set_init_fn": 0,
    "set_reset_fn": 1,
    "set_memory_fraction_fn": 2,
    "set_record_stream_fn": 3,
    "set_begin_allocate_to_pool": 4,
    "set_end_allocate_to_pool_fn": 5,
    "set_release_pool": 6,
}
_CONTEXTS = {0: None, 1: "state", 2: "alloc", 3: "all"}  # torch's RecordContext
_state = {"lib": None, "error": None}


def build_flags(torch) -> list:
    """The -D and -I flags allocator.cpp needs against this torch."""
    from torch.utils import cpp_extension

    flags = [f"-D{macro}" for macro, pattern in _FEATURES.items() if re.search(pattern, header_text(torch))]
    flags.append(f"-I{sysconfig.get_paths()['include']}")
    cuda = _cuda_include(getattr(cpp_extension, "CUDA_HOME", None))
    if cuda:
        flags.append(f"-I{cuda}")
    return flags


def header_text(torch) -> str:
    """torch's allocator headers, those of them this torch has, as one text."""
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    text = ""
    for parts in _HEADERS:
        path = os.path.join(include, *parts)
        if os.path.isfile(path):
            with open(path) as f:
                text += f.read()
    return text


def _cuda_include(cuda_home):
    """A folder with CUDA's runtime headers: the toolkit torch found, $CUDA_HOME, /usr/local/cuda,
    or the headers pip's nvidia packages put beside torch."""
    roots = [cuda_home, os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    candidates = [os.path.join(r, "include") for r in roots if r]
    for p in sys.path:
        candidates += sorted(glob.glob(os.path.join(p or ".", "nvidia", "*", "include")))
    return next((d for d in candidates if os.path.isfile(os.path.join(d, "cuda_runtime_api.h"))), None)


class Hooks:
    """What allocator.cpp asks gpumem.torch, under the GIL: the answers the patched Python
    functions give."""

    def __init__(self, memory_fraction):
        self.memory_fraction = memory_fraction

    def record_history(self, enabled, when, stacks, max_entries, clear, skip):
        """skip: torch's skip_actions, comma-separated."""
        skip = [a for a in skip.split(",") if a] if isinstance(skip, str) else list(skip)
        context = _CONTEXTS.get(int(when)) if stacks else None
        _viz.record_torch_history("all" if enabled else None, context, "python", max_entries, clear, False, False, skip)

    def cache_info(self, device):
        """torch's cacheInfo (cuDNN sizes its benchmark workspaces by it): the largest free block that
        needs no new pages."""
        heap = _C.registry_heap(int(device), open=False)
        return int(heap.memory_report(0)["largest_free_mapped"]) if heap is not None else 0

    def history_enabled(self):
        return _C.registry_options()["history_entries"] > 0

    def snapshot(self, first, second, include_traces):
        return _viz.torch_snapshot_dict((first, second, include_traces))

    def set_metadata(self, metadata):
        _viz.set_memory_metadata(metadata)

    def get_metadata(self):
        return _viz.get_memory_metadata()

    def region(self, name, entered):
        _regions.region(name, bool(entered), _viz.set_compile_context)


class HookSetters:
    """torch's pluggable hook setters (set_init_fn(address), ...), for allocator.cpp."""

    def __init__(self, lib):
        self._lib = lib

    def __getattr__(self, name):
        if name not in _HOOK_KINDS:
            raise AttributeError(name)
        kind = _HOOK_KINDS[name]
        return lambda address: self._lib.gm_cppalloc_set_hook(kind, int(address))


class Allocator:
    """gpumem's C++ allocator, as torch.cuda.memory.CUDAPluggableAllocator is used:
    allocator() gives torch's allocator object (making it torch's current allocator, which
    torch's change_current_allocator then sets again); `hooks` takes the entry points."""

    def __init__(self, torch, lib):
        self._torch = torch
        self._lib = lib
        self.hooks = HookSetters(lib)
        self._current = None

    def allocator(self):
        if self._current is None:
            err = ctypes.create_string_buffer(512)
            if self._lib.gm_cppalloc_make_current(err, len(err)) != 0:
                raise RuntimeError(err.value.decode(errors="replace") or "gpumem: the C++ allocator was not made")
            self._current = self._torch._C._cuda_getAllocator()
        return self._current


def _load(torch):
    libs = ["c10", "c10_cuda", "torch_cpu", "torch_cuda"]
    lib = _cppext.load("allocator.cpp", "gm_cppalloc", libs, build_flags(torch), "C++ callers' view of gpumem")
    u64 = ctypes.c_uint64
    lib.gm_cppalloc_create.argtypes = [u64, u64, u64, u64, ctypes.py_object]
    lib.gm_cppalloc_create.restype = ctypes.c_int
    lib.gm_cppalloc_set_hook.argtypes = [ctypes.c_int, u64]
    lib.gm_cppalloc_set_hook.restype = ctypes.c_int
    lib.gm_cppalloc_make_current.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.gm_cppalloc_make_current.restype = ctypes.c_int
    lib.gm_cppalloc_notify_oom.argtypes = [ctypes.c_int64, u64, u64, u64, ctypes.c_char_p, ctypes.c_size_t]
    lib.gm_cppalloc_notify_oom.restype = ctypes.c_int
    lib.gm_cppalloc_observers.argtypes = []
    lib.gm_cppalloc_observers.restype = ctypes.c_size_t
    return lib


def allocator(torch, entry, memory_fraction):
    """gpumem's C++ allocator over gpumem._C's entry points, or None (with one warning) when
    allocator.cpp cannot be built or loaded: torch's plain pluggable allocator then serves."""
    if os.environ.get("GPUMEM_CPP_ALLOCATOR", "1") == "0":
        return None
    try:
        lib = _load(torch)
    except _cppext.CppBuildError as e:
        _state["error"] = str(e)
        warnings.warn(
            "gpumem: torch's C++ callers (extensions, the profiler) will meet the plain pluggable allocator's "
            f"gaps: {str(e).splitlines()[0]}",
            RuntimeWarning,
            stacklevel=4,
        )
        return None
    hooks = Hooks(memory_fraction)
    # PyDLL: the GIL stays held while the library keeps its reference to hooks
    create = ctypes.PyDLL(lib._name).gm_cppalloc_create
    create.argtypes, create.restype = lib.gm_cppalloc_create.argtypes, ctypes.c_int
    if create(entry["alloc"], entry["free"], entry["device_stats"], entry["reset_stats"], hooks) != 0:
        return None
    _state["lib"] = lib
    return Allocator(torch, lib)


def notify_oom(device, requested, allowed, device_free) -> None:
    """The out-of-memory observers C++ code attached (attachOutOfMemoryObserver); an
    observer's exception becomes a RuntimeError with its message."""
    lib = _state["lib"]
    if lib is None or not lib.gm_cppalloc_observers():
        return
    err = ctypes.create_string_buffer(1024)
    if lib.gm_cppalloc_notify_oom(int(device), int(requested), int(allowed), int(device_free), err, len(err)):
        raise RuntimeError(err.value.decode(errors="replace"))


def status() -> dict:
    """Whether torch's C++ callers see gpumem, and why not."""
    return {"cpp_allocator": _state["lib"] is not None, "cpp_allocator_error": _state["error"]}
