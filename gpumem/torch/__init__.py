"""gpumem as PyTorch's CUDA allocator: the top layer of the package.

    import gpumem
    gpumem.install()            # before the first CUDA tensor
    ...                         # the training script, unchanged

or ``GPUMEM_CONF="cap:0.9" python -m gpumem.torch train.py ARGS``.

    _install   install()/uninstall()/status(), options, torch's memory API answered by gpumem
    _viz       snapshots, history and explained OOMs for the heaps torch allocates from
    _pools     private pools: CUDA graphs, torch.cuda.MemPool, torch.compile's cudagraph trees
    _pause     pause()/resume()/paused(): release a pool's physical memory, keeping its addresses
    _checkpoint  the small torch-header module cudagraph trees' checkpoints need, built on first use
    _regions   torch.compile's regions in snapshots' trace entries (compile_context=True)
    _cppext    builds the files of csrc/torch_ext against the installed torch, on first use

Nothing else in gpumem imports this package; it hands its hooks down
(gpumem._heaplike.register_torch_hooks).  Importing it does not import torch.
"""

from .._heaplike import MAX_HISTORY
from ._install import (
    ENV_VAR,
    OPTION_NAMES,
    InstallError,
    OptionError,
    disabled,
    install,
    is_installed,
    memory_snapshot_dict,
    nested_stats,
    normalize_options,
    parse_conf,
    set_context_hook,
    set_oom_formatter,
    status,
    torch_allocator,
    uninstall,
)
from ._pause import PauseResult, pause, paused, resume
from ._pools import MemPool

InstallError.__module__ = OptionError.__module__ = "gpumem"  # where users catch them
MemPool.__module__ = __name__
PauseResult.__module__ = __name__

__all__ = [
    "disabled",
    "install",
    "torch_allocator",
    "uninstall",
    "is_installed",
    "status",
    "InstallError",
    "OptionError",
    "MemPool",
    "pause",
    "resume",
    "paused",
    "PauseResult",
    "parse_conf",
    "normalize_options",
    "nested_stats",
    "memory_snapshot_dict",
    "set_context_hook",
    "set_oom_formatter",
    "ENV_VAR",
    "OPTION_NAMES",
    "MAX_HISTORY",
]
