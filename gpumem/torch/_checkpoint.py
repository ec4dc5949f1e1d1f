"""The torch-header module cudagraph trees' checkpoints need
(csrc/torch_ext/checkpoint.cpp), built against the installed torch on first use.

torch._C._cuda_setCheckpointPoolState swaps the deleters of StorageImpls, which
takes torch's C++ headers; gpumem._C is built without torch, so this one file
is compiled on first use by _cppext (torch's include directories and C++ ABI),
linked to libc10 only.
"""

from __future__ import annotations

import ctypes
import pathlib

from . import _cppext

__all__ = ["load", "CheckpointBuildError", "source_path"]

_lib = None

# The checkpoint module could not be built or loaded for this torch.
CheckpointBuildError = _cppext.CppBuildError


def source_path() -> pathlib.Path:
    return _cppext.source_path("checkpoint.cpp")


def load():
    """The ctypes library (built now if needed).  Raises CheckpointBuildError
    with what went wrong and what to do."""
    global _lib
    if _lib is not None:
        return _lib
    lib = _cppext.load("checkpoint.cpp", "gm_ckpt", ["c10"], purpose="torch.compile(mode='reduce-overhead')")
    u64p = ctypes.POINTER(ctypes.c_uint64)
    lib.gm_ckpt_add_deleters.restype = ctypes.c_long
    lib.gm_ckpt_add_deleters.argtypes = [u64p, ctypes.c_size_t, u64p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int]
    lib.gm_ckpt_release_deleters.restype = None
    lib.gm_ckpt_release_deleters.argtypes = [u64p, ctypes.c_size_t, u64p, ctypes.c_size_t]
    lib.gm_ckpt_free_and_remove.restype = ctypes.c_int
    lib.gm_ckpt_free_and_remove.argtypes = [ctypes.c_uint64, ctypes.c_void_p]
    lib.gm_ckpt_has_deleter.restype = ctypes.c_int
    lib.gm_ckpt_has_deleter.argtypes = [ctypes.c_uint64, ctypes.c_void_p]
    _lib = lib
    return lib


def _array(values):
    values = [int(v) for v in values]
    return (ctypes.c_uint64 * max(1, len(values)))(*values), len(values)


def add_deleters(storages, allocd, deleter: int, device: int) -> None:
    """Storages (StorageImpl addresses) whose blocks were allocated again get
    `deleter` (gpumem's raw delete); each must point into `allocd`."""
    lib = load()
    s, n = _array(storages)
    a, na = _array(allocd)
    bad = lib.gm_ckpt_add_deleters(s, n, a, na, ctypes.c_void_p(deleter), int(device))
    if bad >= 0:
        raise RuntimeError(
            f"gpumem: storage {int(storages[bad]):#x} to add a deleter to does not point at a "
            "block the checkpoint allocated"
        )


def release_deleters(storages, freed) -> None:
    """Stale storages whose block the checkpoint freed stop owning it."""
    lib = load()
    s, n = _array(storages)
    f, nf = _array(freed)
    lib.gm_ckpt_release_deleters(s, n, f, nf)


def free_and_remove(storage: int, deleter: int) -> bool:
    """If the storage frees through `deleter`: free its block now and leave it
    with no deleter (True); else change nothing (False)."""
    return bool(load().gm_ckpt_free_and_remove(int(storage), ctypes.c_void_p(deleter)))


def has_deleter(storage: int, deleter: int) -> bool:
    return bool(load().gm_ckpt_has_deleter(int(storage), ctypes.c_void_p(deleter)))
