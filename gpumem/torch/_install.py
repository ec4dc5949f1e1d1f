"""gpumem as PyTorch's CUDA allocator.

    import gpumem
    gpumem.install()            # before the first CUDA tensor; options below
    ...                         # the training script, unchanged

or, with no change to the script, ``GPUMEM_CONF="cap:0.9" python -m gpumem.torch train.py ARGS``.

install() registers gpumem's entry points (exported from gpumem._C) through
torch's CUDAPluggableAllocator (a subclass of it that C++ callers see gpumem
through, _cppalloc, when it can be built), sets the allocator hooks torch offers
(empty_cache, set_per_process_memory_fraction, Tensor.record_stream, init), and
routes torch's memory API -- memory_allocated/reserved and their max_ forms,
memory_stats, memory_summary, reset_peak_memory_stats, memory_snapshot,
_snapshot, _record_memory_history, _dump_snapshot, and the pool functions CUDA
graphs, MemPool and torch.compile's cudagraph trees call -- to gpumem by replacing the
torch._C functions they call, which otherwise raise "does not yet support" under
a pluggable allocator.  One heap per device is created on the first allocation
torch makes there.

Options (keyword arguments of install(), or GPUMEM_CONF="key:value,key:value"):
    cap                 a number up to 1 is a fraction of the device, else bytes ("60GiB", 64424509440)
    growth_slack        how far reserved memory may grow above peak live, as a fraction
    growth_slack_pages  ... plus this many pages
    pressure            where the heap tightens, as a fraction of its limit (0.875; 0: always tight)
    chunk_pages         the most pages one physical allocation holds (1, the default: every page its
                        own; more makes growth and resume cheaper, but a partly used allocation stays whole)
    page_size           the heap's page ("8MiB"): a power of two, a multiple of the device's granularity
                        (2 MiB, the default); each page is one physical allocation, still movable, so
                        larger pages grow with fewer driver calls and defragment more coarsely
    va_size             virtual address space to reserve per device (default 4 x device memory)
    history             keep the last N allocator events per device (0: off)
    oom                 "torch": raise torch.OutOfMemoryError (default); "runtime": RuntimeError
    spill               host memory the heap may map behind its addresses once the device is full
                        ("24GiB"; 0 or "off", the default: out of memory as before); see docs/spill.md
    spill_choice        what goes to host memory: "old" (default), the pages of the oldest live
                        tensors, moved behind the same addresses; "lasting", those of the tensors
                        live at the loop's last low point, the most recent first (the optimizer's
                        state before the weights); "new", the request itself
    stream_handoff      1 (default): near the limit, memory one stream freed while its work still
                        runs may go to another stream, made to wait for that work on the GPU instead
                        of the host waiting for the whole device; 0: the device-wide wait
    split_chunks        1: under pressure, an allocation of several pages (chunk_pages, growth with
                        room, a resumed pool) that live tensors still use may be split, their pages
                        copied to pages of their own behind the same addresses, so its free pages go
                        back; for a process whose only thread running work on the GPU is the one
                        allocating (a kernel another thread runs on those tensors meanwhile would
                        lose its writes); 0 (default): such free pages stay until the allocation is
                        wholly free
Keyword arguments override GPUMEM_CONF.

Importing this module does not import torch; install() does.
"""

import os
import sys

from .. import _C
from .._heaplike import register_torch_hooks
from . import _cppalloc, _pools, _viz

ENV_VAR = "GPUMEM_CONF"
DISABLE_VAR = "GPUMEM_DISABLE"  # 1: install() leaves torch's own allocator in place
OPTION_NAMES = _C.OPTION_NAMES  # install()'s and GPUMEM_CONF's options (csrc/python/config_glue.c)

_POOLS = _C.STAT_POOLS  # torch's statistics: "{name}.{pool}.{field}" (csrc/python/convert.c)
_FIELDS = _C.STAT_FIELDS
_POOLED = _C.POOLED_STAT_NAMES  # the core's one list of statistics (gpumem.h)
_PLAIN = _C.COUNTER_NAMES
_UNPOOLED = ("oversize_allocations", "oversize_segments")  # native keys gpumem has no use for: always 0

_state = {"allocator": None, "installed": False, "patched": {}, "options": {}, "pool_hooks": False, "said_off": False}


class InstallError(RuntimeError):
    """gpumem cannot become torch's allocator in this process (too late, no CUDA, ...)."""


# ---- options -----------------------------------------------------------------------


class OptionError(ValueError):
    """A bad gpumem option; the message names the option and its value."""

    def __init__(self, key, value, reason, source=None):
        self.key, self.value, self.reason = key, value, reason
        where = f"{source}: " if source else ""
        super().__init__(f"{where}option {key}={value!r}: {reason}")


def parse_conf(text):
    """'cap:0.9,growth_slack:0.01' -> {'cap': '0.9', 'growth_slack': '0.01'} (values as strings).

    The core reads the text (core/config.c): ValueError naming the item for a malformed
    item, an unknown option or one given twice, or a text too long to be meant."""
    return _C.parse_conf(text or "", OPTION_NAMES, ENV_VAR)


def normalize_options(options):
    """Turn install()'s options into _configure keyword arguments: each is checked once, in C
    (csrc/python/config_glue.c), which raises ValueError for an unknown option and OptionError,
    naming the option and its value, for a bad one."""
    return _C.torch_options(options, OptionError)


def _device_list(device, torch):
    if device is None:
        return []
    if isinstance(device, (list, tuple, set)):
        return sorted({i for d in device for i in _device_list(d, torch)})
    if isinstance(device, int) and not isinstance(device, bool):
        return [device]
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"gpumem manages CUDA devices, not {d}")
    return [d.index if d.index is not None else torch.cuda.current_device()]


# ---- install / uninstall ----------------------------------------------------------------


def _prepare(options, what):
    """(torch, _configure kwargs, merged options), or InstallError."""
    from_env = parse_conf(os.environ.get(ENV_VAR, ""))
    merged = dict(from_env)
    merged.update(options)
    try:
        kw = normalize_options(merged)
    except OptionError as e:
        if e.key in from_env and e.key not in options:
            raise OptionError(e.key, e.value, e.reason, source=ENV_VAR) from None
        raise
    try:
        import torch
    except ImportError as e:
        raise InstallError(f"gpumem.{what}() needs PyTorch (pip install torch)") from e
    kw["oom_class"] = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return torch, kw, merged


def _configure(kw):
    """The heap registry's options, then how torch's out-of-memory failures are raised."""
    kw = dict(kw)
    oom = {"mode": kw.pop("oom_mode", None)}
    if "oom_class" in kw:
        oom["oom_class"] = kw.pop("oom_class")
    _C.registry_configure(**kw)
    _C._torch_set_oom(**oom)


def _make_allocator(torch, kw, what):
    """torch's CUDAPluggableAllocator over gpumem._C's entry points, every hook set."""
    if not torch.cuda.is_available():
        raise InstallError(f"gpumem.{what}(): torch sees no CUDA device (torch.cuda.is_available() is False)")
    if torch.cuda.is_initialized():
        raise InstallError(
            f"gpumem.{what}() came too late: CUDA is already initialised in this process, so torch's own "
            f"allocator is in use and cannot be replaced. Call gpumem.{what}() before anything touches "
            "CUDA (first lines of the script), or run the script with `python -m gpumem.torch script.py`."
        )
    _configure(kw)
    entry = _C._torch_entry_points()
    # gpumem's C++ allocator object (C++ callers see gpumem), else torch's plain pluggable one
    alloc = _cppalloc.allocator(torch, entry, _memory_fraction) or torch.cuda.memory.CUDAPluggableAllocator(
        _C.__file__, "gpumem_torch_alloc", "gpumem_torch_free"
    )
    hooks = alloc.hooks if isinstance(alloc, _cppalloc.Allocator) else alloc.allocator()
    if isinstance(alloc, _cppalloc.Allocator):
        _C._torch_set_oom_observer(_run_oom_observers)  # observers C++ code attaches run too
    hooks.set_init_fn(entry["init"])
    hooks.set_reset_fn(entry["empty_cache"])
    hooks.set_memory_fraction_fn(entry["memory_fraction"])
    hooks.set_record_stream_fn(entry["record_stream"])
    _state["pool_hooks"] = _pools.set_pool_hooks(torch, hooks, entry)
    return alloc


def _finish(torch, merged, device):
    """Everything install() does once gpumem is torch's allocator."""
    _state["options"] = merged
    _patch(torch)
    _state["installed"] = True
    register_torch_hooks(active=lambda: _state["allocator"] is not None, stack_hook=_viz.set_stack_hook)
    _viz.on_install()  # explained OOM messages, Python stacks (visibility layer)
    for d in _device_list(device, torch):
        _C.registry_heap(d)
    return status()


def disabled():
    """Whether GPUMEM_DISABLE turns gpumem off in this process ("1": off; unset, "" or "0": on)."""
    value = os.environ.get(DISABLE_VAR, "").strip()
    if value not in ("", "0", "1"):
        raise OptionError(DISABLE_VAR, value, "1 leaves torch's own allocator in place; 0 or unset installs gpumem")
    return value == "1"


def install(device=None, **options):
    """Make gpumem the CUDA allocator of this process (see the module docstring).

    device: None (every device, each heap made on first use), or a device or a list of
    devices whose heaps are made now; devices not named still work.
    Must run before CUDA allocates anything; raises InstallError otherwise.
    Calling it again only changes the options (and re-applies the patches after uninstall()).
    With GPUMEM_DISABLE=1 it does nothing but say so, once, on stderr: torch keeps its
    own allocator, and the options are not read.
    """
    if _state["allocator"] is None and disabled():
        if not _state["said_off"]:
            _state["said_off"] = True
            print(f"gpumem: {DISABLE_VAR}=1: not installed; torch's own CUDA allocator is in use", file=sys.stderr)
        return status()
    torch, kw, merged = _prepare(options, "install")
    if _state["allocator"] is None:
        alloc = _make_allocator(torch, kw, "install")
        try:
            _original_change_allocator(torch)(alloc)
        except RuntimeError as e:
            raise InstallError(
                f"gpumem.install() could not replace torch's allocator ({e}); call it before anything touches CUDA"
            ) from e
        _state["allocator"] = alloc
    else:
        _configure(kw)
    return _finish(torch, merged, device)


def torch_allocator(**options):
    """gpumem as a torch.cuda.memory.CUDAPluggableAllocator, for code that picks the allocator
    itself:

        torch.cuda.memory.change_current_allocator(gpumem.torch_allocator(cap="60GiB"))

    is the same as gpumem.install(cap="60GiB"): once torch accepts the allocator, gpumem
    finishes installing (torch's memory API, CUDA graph pools, MemPool, cudagraph trees)."""
    if disabled():
        raise InstallError(
            f"gpumem.torch_allocator(): {DISABLE_VAR}=1 is set; gpumem.install() honours it, but code that "
            "hands torch an allocator itself must not call torch_allocator() then (see gpumem.torch.disabled())"
        )
    torch, kw, merged = _prepare(options, "torch_allocator")
    if _state["allocator"] is not None:
        raise InstallError("gpumem is already torch's allocator in this process")
    alloc = _make_allocator(torch, kw, "torch_allocator")

    class TorchAllocator(torch.cuda.memory._CUDAAllocator):
        """gpumem's CUDAPluggableAllocator.  torch's change_current_allocator(obj) calls
        obj.allocator() to take the C++ allocator; that call finishes gpumem's install
        (it cannot wait until after: the caller fetched change_current_allocator first)."""

        def __init__(self):
            cpp = isinstance(alloc, _cppalloc.Allocator)
            super().__init__(None if cpp else alloc.allocator())  # the C++ one becomes current when used
            self.pluggable = alloc

        def allocator(self):
            if _state["allocator"] is None:
                _state["allocator"] = alloc
                _finish(torch, merged, None)
            return alloc.allocator()

    return TorchAllocator()


def _original_change_allocator(torch):
    fn = torch.cuda.memory.change_current_allocator
    return _state["patched"].get((torch.cuda.memory, "change_current_allocator"), fn)


def uninstall():
    """Give torch its own memory functions back.

    torch cannot swap its allocator once CUDA is up, so allocations keep going to gpumem
    until the process ends (status()["allocator_active"]); only the patched memory API is
    restored.  torch.cuda.memory_stats & co. then read gpumem's figures through its C++
    allocator object (status()["cpp_allocator"]), or, without it, raise as they do under
    any pluggable allocator.
    """
    for (owner, name), original in _state["patched"].items():
        if original is _MISSING:
            try:
                delattr(owner, name)
            except AttributeError:
                pass
        else:
            setattr(owner, name, original)
    _state["patched"] = {}
    _state["installed"] = False
    return status()


def is_installed():
    return _state["installed"]


def status():
    """What gpumem does in this process: whether it is installed, options, per-device figures."""
    out = {
        "installed": _state["installed"],
        "disabled": _state["said_off"],
        "allocator_active": _state["allocator"] is not None,
        "options": dict(_state["options"]),
        "patched": sorted(n for _, n in _state["patched"]),
        "pool_hooks": _state["pool_hooks"],
        **_cppalloc.status(),
        "devices": {},
    }
    C = _C
    out["counters"] = C._torch_counters()
    for d in C.registry_devices():
        heap = C.registry_heap(d)
        st = heap.stats()
        out["devices"][d] = {
            "allocated_bytes": st["allocated_bytes.all.current"],
            "reserved_bytes": st["reserved_bytes.all.current"],
            "peak_allocated_bytes": st["allocated_bytes.all.peak"],
            "cap_bytes": heap.get_cap(),
            "num_remaps": st["num_remaps"],
            "pools": len(heap.pools()),
        }
    return out


# ---- torch's memory API, answered by gpumem -------------------------------------------------

_MISSING = object()


def _zero_stats():
    flat = {f"{g}.{p}.{f}": 0 for g in _POOLED for p in _POOLS for f in _FIELDS}
    flat.update({k: 0 for k in _PLAIN})
    return flat


def nested_stats(device):
    """torch._C._cuda_memoryStats's shape: {"allocated_bytes": {"all": {"current": ...}}, ...}."""
    heap = _C.registry_heap(int(device), open=False)
    flat = heap.stats() if heap is not None else _zero_stats()
    nested = {}
    for key, value in flat.items():
        parts = key.split(".")
        if len(parts) == 3:
            nested.setdefault(parts[0], {}).setdefault(parts[1], {})[parts[2]] = value
        else:
            nested[key] = value
    for key in _UNPOOLED:
        nested[key] = {f: 0 for f in _FIELDS}
    nested["num_oom_rejections"] = 0  # newer torch's OOM preemption policy, which gpumem has not
    return nested


def memory_snapshot_dict(arg=None):
    """torch._C._cuda_memorySnapshot's shape: {"segments": [...], "device_traces": [[...] per device]}:
    gpumem.Snapshot.to_torch() of each device (gpumem/torch/_viz.py)."""
    return _viz.torch_snapshot_dict(arg)


def _record_history(enabled, *args, **kwargs):
    """Both _cuda_record_memory_history (enabled: None/'state'/'all', context, stacks, max_entries, ...)
    and the legacy form (enabled: bool, record_context, trace_alloc_max_entries, ...)."""
    _viz.record_torch_history(enabled, *args, **kwargs)


_fractions = {}  # device -> the fraction set_per_process_memory_fraction gave, as given
_oom_observers = []  # torch._C._cuda_attach_out_of_memory_observer's callables, in order


def _set_memory_fraction_fn(original):
    def set_memory_fraction(fraction, device):
        original(fraction, device)  # torch's hook sets the cap (csrc/python/torch_alloc.cpp)
        _fractions[int(device)] = float(fraction)

    return set_memory_fraction


def _memory_fraction(device):
    """get_per_process_memory_fraction: the fraction last set, as torch keeps it; else the
    cap gpumem was installed with, as a fraction of the device (1.0 without one)."""
    if int(device) in _fractions:
        return _fractions[int(device)]
    heap = _C.registry_heap(int(device), open=False)
    cap = heap.get_cap() if heap is not None else 0
    if not cap:
        return 1.0
    report = heap.memory_report(0)
    return min(1.0, cap / report["device_total"]) if report["device_total"] else 1.0


def _attach_oom_observer(observer):
    """torch._C._cuda_attach_out_of_memory_observer: `observer(device, requested, allowed,
    device_free)` runs on every out-of-memory failure, before the exception (torch's
    CUDAPluggableAllocator does not forward observers, so gpumem keeps them)."""
    if not callable(observer):
        raise TypeError(f"an out-of-memory observer must be callable, not {type(observer).__name__}")
    _oom_observers.append(observer)
    _C._torch_set_oom_observer(_run_oom_observers)


def _run_oom_observers(device, requested, allowed, device_free):
    for observer in list(_oom_observers):
        observer(device, requested, allowed, device_free)
    _cppalloc.notify_oom(device, requested, allowed, device_free)  # those C++ code attached


def _accelerator_stats(device=None):
    """torch._C._accelerator_getDeviceStats: torch.accelerator.memory_stats() and the
    functions built on it read the same statistics torch.cuda.memory_stats() does."""
    import torch

    return nested_stats(torch.cuda.current_device() if device is None else int(device))


_caching = {"enabled": True}  # torch.cuda.caching_allocator_enable
_uncached = {}  # device pointer -> bytes: raw allocations made while caching was off


def _driver():
    """The CUDA driver, for the raw allocations torch makes with its caching allocator
    turned off (it calls cudaMalloc and cudaFree then; the current context is torch's)."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
    lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
    return lib


def _set_caching_enabled(value):
    """torch.cuda.caching_allocator_enable(value): with caching off, torch's raw
    allocations (caching_allocator_alloc, _cuda_cudaCachingAllocator_raw_alloc) bypass
    the allocator and its statistics and go to the driver, as under torch's allocator."""
    _caching["enabled"] = bool(value)


def _raw_alloc_fn(original):
    def raw_alloc(size, stream):
        if _caching["enabled"] or not int(size):
            return original(size, stream)
        import ctypes

        ptr = ctypes.c_uint64(0)
        rc = _driver().cuMemAlloc_v2(ctypes.byref(ptr), int(size))
        if rc != 0:
            raise RuntimeError(f"CUDA driver error {rc} allocating {int(size)} bytes with the caching allocator off")
        _uncached[ptr.value] = int(size)
        return ptr.value

    return raw_alloc


def _raw_delete_fn(original):
    def raw_delete(ptr):
        if int(ptr) in _uncached:
            del _uncached[int(ptr)]
            rc = _driver().cuMemFree_v2(int(ptr))
            if rc != 0:
                raise RuntimeError(f"CUDA driver error {rc} freeing {int(ptr):#x}")
            return None
        return original(ptr)

    raw_delete._gpumem_original = getattr(original, "_gpumem_original", original)
    return raw_delete


def _history_enabled():
    """torch._C._cuda_isHistoryEnabled (cudagraph trees' history recording asks it)."""
    return _C.registry_options()["history_entries"] > 0


def _reset_peak(device):
    heap = _C.registry_heap(int(device), open=False)
    if heap is not None:
        heap.reset_peak_stats()


def _reset_accumulated(device):
    heap = _C.registry_heap(int(device), open=False)
    if heap is not None:
        heap.reset_accumulated_stats()


def _snapshot(arg=None, *_args, **_kwargs):
    return memory_snapshot_dict(arg)


def _accelerator_replacements(torch):
    """torch.accelerator's memory functions (torch >= 2.9) on a CUDA device: its C
    functions ask the device allocator, which a pluggable allocator does not answer."""
    accelerator = {
        "_accelerator_getDeviceStats": _accelerator_stats,
        "_accelerator_resetPeakStats": lambda device=None: _reset_peak(_device_or_current(torch, device)),
        "_accelerator_resetAccumulatedStats": lambda device=None: _reset_accumulated(_device_or_current(torch, device)),
    }
    replacements = {k: v for k, v in accelerator.items() if hasattr(torch._C, k)}
    if hasattr(torch._C, "_accelerator_isAllocatorInitialized"):
        # torch asks the device allocator registry, which knows nothing of a pluggable
        # allocator: gpumem's is ready once CUDA is (when torch is on CUDA).
        original_ready = _state["patched"].get(
            (torch._C, "_accelerator_isAllocatorInitialized"), torch._C._accelerator_isAllocatorInitialized
        )

        def allocator_ready():
            acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
            if acc is not None and acc.type == "cuda":
                return torch.cuda.is_initialized()
            return original_ready()

        replacements["_accelerator_isAllocatorInitialized"] = allocator_ready
    if hasattr(torch._C, "_accelerator_emptyCache"):
        replacements["_accelerator_emptyCache"] = lambda: torch._C._cuda_emptyCache()
    return replacements


def _patch_classes(torch):
    """torch.cuda.MemPool cannot be built under a pluggable allocator (its C++
    constructor needs createOrIncrefPool): gpumem's pool class takes its place."""
    for owner in (torch.cuda, torch.cuda.memory):
        _replace(owner, "MemPool", _pools.MemPool)
    # MemPool(allocator) calls the allocator's functions, whose addresses only its maker knows.
    pluggable = _pools.pluggable_class(
        _state["patched"].get((torch.cuda.memory, "CUDAPluggableAllocator"), torch.cuda.memory.CUDAPluggableAllocator)
    )
    for owner in (torch.cuda, torch.cuda.memory):
        if hasattr(owner, "CUDAPluggableAllocator"):
            _replace(owner, "CUDAPluggableAllocator", pluggable)
    if not _state["pool_hooks"]:
        _replace(torch.cuda.graphs.CUDAGraph, "capture_begin", _pools.refuse_capture)


def _patch(torch):
    replacements = {
        "_cuda_memoryStats": nested_stats,
        "_cuda_resetPeakMemoryStats": _reset_peak,
        "_cuda_resetAccumulatedMemoryStats": _reset_accumulated,
        "_cuda_memorySnapshot": _snapshot,
        "_cuda_record_memory_history": _record_history,
        "_cuda_record_memory_history_legacy": _record_history,
        "_cuda_getMemoryFraction": _memory_fraction,
        "_cuda_isHistoryEnabled": _history_enabled,
        "_cuda_attach_out_of_memory_observer": _attach_oom_observer,
        "_cuda_setMemoryMetadata": _viz.set_memory_metadata,
        "_cuda_getMemoryMetadata": _viz.get_memory_metadata,
    }
    if hasattr(torch._C, "_cuda_setMemoryFraction"):
        original_set = _state["patched"].get((torch._C, "_cuda_setMemoryFraction"), torch._C._cuda_setMemoryFraction)
        replacements["_cuda_setMemoryFraction"] = _set_memory_fraction_fn(original_set)
    replacements.update(_accelerator_replacements(torch))
    replacements["_cuda_cudaCachingAllocator_enable"] = _set_caching_enabled
    replacements["_cuda_cudaCachingAllocator_is_enabled"] = lambda: _caching["enabled"]
    for name, wrap in (
        ("_cuda_cudaCachingAllocator_raw_alloc", _raw_alloc_fn),
        ("_cuda_cudaCachingAllocator_raw_delete", _raw_delete_fn),
    ):
        inner = replacements.get(name) or _state["patched"].get((torch._C, name), getattr(torch._C, name, None))
        if inner is not None:
            replacements[name] = wrap(inner)
    replacements.update(_pools.replacements(torch, _state["pool_hooks"]))
    for name, fn in replacements.items():
        _replace(torch._C, name, fn)
    _patch_classes(torch)


def _device_or_current(torch, device):
    return torch.cuda.current_device() if device is None else int(device)


def _replace(owner, name, fn):
    key = (owner, name)
    if key not in _state["patched"]:
        _state["patched"][key] = (
            owner.__dict__.get(name, _MISSING) if isinstance(owner, type) else getattr(owner, name, _MISSING)
        )
    if callable(fn) and not isinstance(fn, type):
        try:
            fn.__name__ = name
            fn.__qualname__ = f"gpumem.torch.{name}"
        except (AttributeError, TypeError):
            pass
    setattr(owner, name, fn)


# ---- hooks for other parts of gpumem ----------------------------------------------------------


def set_context_hook(address):
    """Install a C function uint64_t (*)(void) (by address, 0 clears) called before each
    allocation; its value is kept with the block and in the history."""
    _C._torch_set_context_hook(int(address))


def set_oom_formatter(address):
    """Install a C function (by address, 0 clears) that writes the out-of-memory message;
    see gm_torch_oom_formatter in csrc/python/torch_alloc.h."""
    _C._torch_set_oom_formatter(int(address))
