"""The files of csrc/torch_ext, built against the installed torch on first use.

gpumem._C is built without torch; the few things that need torch's C++ headers are small
files compiled here, the way inductor compiles its C++: with the compiler torch names (CXX,
else c++), torch's include directories and C++ ABI, linked to the torch libraries each needs,
cached under $GPUMEM_CACHE_DIR (default ~/.cache/gpumem) by torch version, flags and source
hash, and checked at load against the running torch (each file exports `<prefix>_torch_version`).
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

_HERE = pathlib.Path(__file__).resolve().parent


class CppBuildError(RuntimeError):
    """A file of csrc/torch_ext could not be built or loaded for this torch."""


def source_path(name: str) -> pathlib.Path:
    """csrc/torch_ext/<name>, shipped beside this module in a wheel."""
    candidates = (_HERE / name, _HERE.parent.parent / "csrc" / "torch_ext" / name)
    for p in candidates:
        if p.is_file():
            return p
    raise CppBuildError(f"gpumem: {name} not found (looked in {', '.join(map(str, candidates))})")


def cache_dir() -> pathlib.Path:
    root = os.environ.get("GPUMEM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpumem"
    )
    return pathlib.Path(root)


def _command(torch, src, out, libs, flags):
    from torch.utils import cpp_extension

    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    return [
        os.environ.get("CXX") or "c++",
        "-O2",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-fvisibility=hidden",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f'-DGM_TORCH_VERSION="{torch.__version__}"',
        *flags,
        *[f"-I{d}" for d in cpp_extension.include_paths()],
        str(src),
        "-o",
        str(out),
        f"-L{libdir}",
        *[f"-l{lib}" for lib in libs],
        f"-Wl,-rpath,{libdir}",
    ]


def build(torch, src: pathlib.Path, out: pathlib.Path, libs, flags=(), purpose: str = "") -> None:
    """Compile src into the shared library out; CppBuildError with the compiler's words if it fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=str(out.parent))
    os.close(fd)
    cmd = _command(torch, src, tmp, libs, flags)
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        os.unlink(tmp)
        raise CppBuildError(
            f"gpumem: cannot run the C++ compiler {cmd[0]!r} to build {src.name} ({e}); "
            f"{purpose + ' needs it under gpumem. ' if purpose else ''}Install a C++ compiler (g++) or set CXX."
        ) from e
    if p.returncode != 0:
        os.unlink(tmp)
        raise CppBuildError(
            f"gpumem: building {src.name} against torch {torch.__version__} failed:\n"
            f"{' '.join(cmd)}\n{p.stderr[-4000:]}"
        )
    os.replace(tmp, out)


def load(name: str, prefix: str, libs, flags=(), purpose: str = "", mode=ctypes.CDLL):
    """The ctypes library of csrc/torch_ext/<name> (built now if needed), after checking that
    it was built for the running torch."""
    import torch

    src = source_path(name)
    key = hashlib.sha256(
        src.read_bytes()
        + torch.__version__.encode()
        + sys.version.encode()
        + str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()
        + repr((list(libs), list(flags))).encode()
    ).hexdigest()[:16]
    tag = sysconfig.get_config_var("SOABI") or "py"
    out = cache_dir() / f"{pathlib.Path(name).stem}-{tag}-{key}.so"
    if not out.exists():
        build(torch, src, out, libs, flags, purpose)
    try:
        lib = mode(str(out))
    except OSError as e:
        raise CppBuildError(f"gpumem: cannot load {out} ({e}); delete it to rebuild") from e
    version = getattr(lib, f"{prefix}_torch_version")
    version.restype = ctypes.c_char_p
    built_for = version().decode()
    if built_for != torch.__version__:
        raise CppBuildError(
            f"gpumem: {out} was built for torch {built_for}, this is torch {torch.__version__}; delete it to rebuild"
        )
    return lib
