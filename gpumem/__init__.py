"""gpumem: a defragmenting GPU memory allocator with a C11 core and a simulated device.

Importing gpumem needs neither torch nor a GPU: the CUDA driver is loaded only
when a Heap(device="cuda") is created.
"""

from ._units import format_size, parse_size

__version__ = "0.1.0"

try:
    from . import _C  # noqa: F401
except ImportError:
    # Run from a source checkout after a plain `pip install .`, the checkout's
    # gpumem/ (no compiled _C) shadows the installed one.  Let the package span
    # both directories, as pkgutil.extend_path is meant for, so that _C is found
    # in the installed copy.
    import pkgutil as _pkgutil

    __path__ = _pkgutil.extend_path(__path__, __name__)

try:
    from ._C import (  # noqa: F401  (re-exported)
        CorruptionError,
        DeviceError,
        Heap,
        InvalidPointerError,
        OutOfMemoryError,
    )
except ImportError as _e:  # pragma: no cover - only without a built extension
    _import_error = _e

    def __getattr__(name):
        if name in ("Heap", "OutOfMemoryError", "InvalidPointerError", "CorruptionError", "DeviceError"):
            raise ImportError(
                f"gpumem.{name} needs the compiled extension gpumem._C, which failed to import "
                f"({_import_error}); build it with `python3 -m pip install -e .`"
            ) from _import_error
        raise AttributeError(f"module 'gpumem' has no attribute {name!r}")


# gpumem as PyTorch's CUDA allocator (the gpumem/torch/ package); imported on first use so
# that `import gpumem` never imports torch.
def install(device=None, **options):
    """Make gpumem the CUDA allocator of this PyTorch process; see gpumem.torch."""
    from . import torch as _torch

    return _torch.install(device, **options)


def torch_allocator(**options):
    """gpumem as a CUDAPluggableAllocator for torch.cuda.memory.change_current_allocator(...),
    the same as install(); see gpumem.torch."""
    from . import torch as _torch

    return _torch.torch_allocator(**options)


def uninstall():
    """Give torch its memory API back (the allocator stays gpumem); see gpumem.torch."""
    from . import torch as _torch

    return _torch.uninstall()


def status():
    """Whether gpumem serves torch in this process, and per-device figures; see gpumem.torch."""
    from . import torch as _torch

    return _torch.status()


def pause(pool, backup=False, device=None):
    """Release a private pool's physical memory, keeping its addresses; see gpumem.torch.pause."""
    from . import torch as _torch

    return _torch.pause(pool, backup=backup, device=device)


def resume(pool, device=None):
    """Map memory behind a paused pool again (restoring its backup); see gpumem.torch.resume."""
    from . import torch as _torch

    return _torch.resume(pool, device=device)


def paused(pool, backup=False, device=None):
    """Context manager: pause(pool) on entry, resume(pool) on exit; see gpumem.torch.paused."""
    from . import torch as _torch

    return _torch.paused(pool, backup=backup, device=device)


# Every exception gpumem raises on purpose is importable from here: the core's
# (above), bad traces, no heap to look at, an unknown shipped file; and the torch
# layer's, loaded on first use so that `import gpumem` never imports gpumem.torch.
from .data import UnknownDataError  # noqa: E402,F401
from .trace import TraceError  # noqa: E402,F401

_TORCH_ERRORS = ("InstallError", "OptionError")

if "_import_error" not in globals():
    from ._which_heap import NoHeapError  # noqa: E402,F401

    def __getattr__(name):
        if name in _TORCH_ERRORS:
            from .torch import _install

            return getattr(_install, name)
        raise AttributeError(f"module 'gpumem' has no attribute {name!r}")


# Visibility: snapshots, history, memory over time, OOM explanations; the
# explanation words every OutOfMemoryError message from here on.
if "_import_error" not in globals():
    from .explain import explain, last_oom, register_oom_formatter  # noqa: E402,F401
    from .forecast import Forecast, ForecastError, forecast  # noqa: E402,F401
    from .history import record_history  # noqa: E402,F401
    from .snapshot import Snapshot, dump_snapshot, memory_over_time, snapshot  # noqa: E402,F401
    from .timeline import Timeline  # noqa: E402,F401

    register_oom_formatter()
    del register_oom_formatter

    # A traceback names an exception by its module: the public one, where it is caught.
    for _cls in (TraceError, NoHeapError, UnknownDataError, ForecastError):
        _cls.__module__ = __name__
    del _cls

__all__ = [
    "install",
    "torch_allocator",
    "uninstall",
    "status",
    "pause",
    "resume",
    "paused",
    "snapshot",
    "dump_snapshot",
    "Snapshot",
    "Timeline",
    "memory_over_time",
    "record_history",
    "explain",
    "last_oom",
    "forecast",
    "Forecast",
    "ForecastError",
    "Heap",
    "OutOfMemoryError",
    "InvalidPointerError",
    "CorruptionError",
    "DeviceError",
    "TraceError",
    "NoHeapError",
    "UnknownDataError",
    "InstallError",
    "OptionError",
    "parse_size",
    "format_size",
    "__version__",
]
