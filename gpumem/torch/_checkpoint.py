"""The torch-header module cudagraph trees' checkpoints need
(csrc/torch_ext/checkpoint.cpp), built against the installed torch on first use.

torch._C._cuda_setCheckpointPoolState swaps the deleters of StorageImpls, which
takes torch's C++ headers; gpumem._C is built without torch, so this one file
is compiled here, the way inductor compiles its C++: with the compiler torch
names (CXX, else c++), torch's include directories and C++ ABI, linked to
libc10 only, cached under $GPUMEM_CACHE_DIR (default ~/.cache/gpumem) by torch
version and source hash, and checked at load against the running torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import subprocess
import sys
import sysconfig
import tempfile

__all__ = ["load", "CheckpointBuildError", "source_path"]

_HERE = pathlib.Path(__file__).resolve().parent
_CANDIDATES = (_HERE / "checkpoint.cpp", _HERE.parent.parent / "csrc" / "torch_ext" / "checkpoint.cpp")
_lib = None


class CheckpointBuildError(RuntimeError):
    """The checkpoint module could not be built or loaded for this torch."""


def source_path() -> pathlib.Path:
    for p in _CANDIDATES:
        if p.is_file():
            return p
    raise CheckpointBuildError(f"gpumem: checkpoint.cpp not found (looked in {', '.join(map(str, _CANDIDATES))})")


def _cache_dir() -> pathlib.Path:
    root = os.environ.get("GPUMEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpumem"
    )
    return pathlib.Path(root)


def _build(torch, src: pathlib.Path, out: pathlib.Path) -> None:
    from torch.utils import cpp_extension

    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    cxx = os.environ.get("CXX") or "c++"
    includes = [f"-I{d}" for d in cpp_extension.include_paths()]
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=str(out.parent))
    os.close(fd)
    cmd = [
        cxx,
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f'-DGM_TORCH_VERSION="{torch.__version__}"',
        *includes,
        str(src),
        "-o",
        tmp,
        f"-L{libdir}",
        "-lc10",
        f"-Wl,-rpath,{libdir}",
    ]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise CheckpointBuildError(
            f"gpumem: cannot run the C++ compiler {cxx!r} to build {src.name} ({e}); "
            "torch.compile(mode='reduce-overhead') needs it under gpumem. Install a C++ "
            "compiler (g++) or set CXX."
        ) from e
    if p.returncode != 0:
        os.unlink(tmp)
        raise CheckpointBuildError(
            f"gpumem: building {src.name} against torch {torch.__version__} failed:\n"
            f"{' '.join(cmd)}\n{p.stderr[-4000:]}"
        )
    os.replace(tmp, out)


def load():
    """The ctypes library (built now if needed).  Raises CheckpointBuildError
    with what went wrong and what to do."""
    global _lib
    if _lib is not None:
        return _lib
    import torch

    src = source_path()
    key = hashlib.sha256(
        src.read_bytes()
        + torch.__version__.encode()
        + sys.version.encode()
        + str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()
    ).hexdigest()[:16]
    tag = sysconfig.get_config_var("SOABI") or "py"
    out = _cache_dir() / f"checkpoint-{tag}-{key}.so"
    if not out.exists():
        _build(torch, src, out)
    try:
        lib = ctypes.CDLL(str(out))
    except OSError as e:
        raise CheckpointBuildError(f"gpumem: cannot load {out} ({e}); delete it to rebuild") from e
    lib.gm_ckpt_torch_version.restype = ctypes.c_char_p
    built_for = lib.gm_ckpt_torch_version().decode()
    if built_for != torch.__version__:
        raise CheckpointBuildError(
            f"gpumem: {out} was built for torch {built_for}, this is torch {torch.__version__}; delete it to rebuild"
        )
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
