"""Builds gpumem._C: the C11 core, both devices, and the extension module.

C sources get -std=c11, C++ sources (the torch boundary) get -std=c++17.
GPUMEM_WERROR=1 (set by CI) turns warnings into errors; GPUMEM_TEST_HOOKS=1 (set by
CI) compiles in the hooks only the tests call.
csrc/torch_ext/*.cpp are not compiled here (they need torch's headers):
they ship inside the package, and gpumem.torch builds each on first use.
"""

import glob
import os
import shutil

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

# Implicit declarations are always errors: a function missing from one
# Python's headers would otherwise compile as returning int and truncate the
# pointer it returns.
WARN = ["-Wall", "-Wextra"] + (["-Werror"] if os.environ.get("GPUMEM_WERROR") == "1" else [])
C_FLAGS = [
    "-std=c11",
    "-O2",
    "-D_GNU_SOURCE",
    "-fvisibility=hidden",
    "-Werror=implicit-function-declaration",
    "-Werror=int-conversion",
] + WARN
# torch's pool hooks pass std::function objects across the boundary: the C++
# standard library ABI must be torch's (1 for every torch since 2.7; gpumem.torch
# checks torch._C._GLIBCXX_USE_CXX11_ABI against gpumem._C._torch_cxx11_abi()).
CXX_ABI = os.environ.get("GPUMEM_CXX11_ABI", "1")
CXX_FLAGS = ["-std=c++17", "-O2", "-fvisibility=hidden", f"-D_GLIBCXX_USE_CXX11_ABI={CXX_ABI}"] + WARN
# GPUMEM_TEST_HOOKS=1 (set by CI and the README's test command) compiles in what only the
# tests call (csrc/python/test_hooks.c: _torch_test_alloc, _test_hold_boundary_lock, ...);
# a plain `pip install .` leaves them out, and the tests that need them skip.  setuptools
# does not rebuild for a changed macro: switching it on an existing in-place build needs
# `build_ext --inplace --force`.
TEST_HOOKS = [("GM_TEST_HOOKS", "1")] if os.environ.get("GPUMEM_TEST_HOOKS") == "1" else []


class BuildExt(build_ext):
    """Give C and C++ files their own standard flag (setuptools shares one list)."""

    def build_extensions(self):
        original = self.compiler._compile

        def compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts):
            flags = CXX_FLAGS if src.endswith(".cpp") else C_FLAGS
            return original(obj, src, ext, cc_args, list(extra_postargs) + flags, pp_opts)

        self.compiler._compile = compile_one
        super().build_extensions()


class BuildPy(build_py):
    """Ship csrc/torch_ext/*.cpp as gpumem/torch/*.cpp (an editable install
    finds them in csrc/ instead)."""

    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "gpumem", "torch")
        if os.path.isdir(dest):
            for src in sorted(glob.glob(os.path.join("csrc", "torch_ext", "*.cpp"))):
                shutil.copy2(src, os.path.join(dest, os.path.basename(src)))


def sources():
    found = []
    for part in ("core", "device", "model", "runtime", "python"):
        found += sorted(glob.glob(f"csrc/{part}/*.c")) + sorted(glob.glob(f"csrc/{part}/*.cpp"))
    return found


setup(
    ext_modules=[
        Extension(
            "gpumem._C",
            sources=sources(),
            include_dirs=["csrc/include", "csrc/core", "csrc/runtime"],
            extra_link_args=["-pthread"],
            libraries=["dl"],
            define_macros=TEST_HOOKS,
        )
    ],
    cmdclass={"build_ext": BuildExt, "build_py": BuildPy},
)
