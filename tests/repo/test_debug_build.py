"""The core's debug build: h_assert (csrc/core/debug.h) is compiled in only when
GM_DEBUG is defined -- the sanitizer and fuzz builds define it, the extension does
not -- and a failing assertion names its file, line and condition, and aborts.

These compile small C programs, so they need a C compiler (CI has one); without
one they skip.
"""

import os
import shutil
import signal
import subprocess
import textwrap

import pytest

from helpers import REPO as _REPO

REPO = str(_REPO)
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")

needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")

PROGRAM = textwrap.dedent("""\
    #include <stdio.h>
    #include "debug.h"

    static int evaluated;
    static int touch(int v) { evaluated++; return v; }

    int main(void) {
        h_assert(touch(1) == 1);
        printf("evaluated %d\\n", evaluated);
        fflush(stdout);
        h_assert(touch(2) == 3);
        printf("after\\n");
        return 0;
    }
""")


def build_and_run(tmp_path, *flags):
    src = tmp_path / "prog.c"
    src.write_text(PROGRAM)
    exe = tmp_path / "prog"
    cmd = [CC, "-std=c11", "-Wall", "-Wextra", "-Werror", *flags, "-I", os.path.join(REPO, "csrc/core")]
    subprocess.run(cmd + ["-o", str(exe), str(src)], check=True, capture_output=True, text=True)
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)


@needs_cc
def test_failing_assertion_names_file_line_and_condition_and_aborts(tmp_path):
    r = build_and_run(tmp_path, "-DGM_DEBUG")
    assert r.returncode == -signal.SIGABRT
    assert r.stdout == "evaluated 1\n"  # the passing assertion ran, nothing after the failing one
    line = PROGRAM.splitlines().index("    h_assert(touch(2) == 3);") + 1
    assert f"prog.c:{line}: gpumem assertion failed: touch(2) == 3" in r.stderr


@needs_cc
def test_release_build_compiles_assertions_out(tmp_path):
    r = build_and_run(tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "evaluated 0\nafter\n"  # conditions are not even evaluated
    assert r.stderr == ""


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_sanitizer_and_fuzz_builds_define_gm_debug():
    for target in ("csrc/tests/fuzz", "csrc/tests/fuzz_asan", "csrc/tests/fuzz_tsan"):
        r = subprocess.run(["make", "-n", "-B", target], cwd=REPO, capture_output=True, text=True, check=True)
        assert "-DGM_DEBUG" in r.stdout.split(), target
    with open(os.path.join(REPO, ".ci", "boundary_asan")) as fh:
        assert "-DGM_DEBUG" in fh.read()


def test_extension_build_leaves_assertions_out():
    with open(os.path.join(REPO, "setup.py")) as fh:
        assert "GM_DEBUG" not in fh.read()
