"""The core's layout (csrc/core): one file per concern, each small enough to read.

No file over 1,200 lines and no function over 80; the free and run indexes see
blocks only (block.h), never the heap's structures; every file opens with a
comment that says what it owns.
"""

import glob
import os
import re

import pytest

from helpers import REPO as _REPO

REPO = str(_REPO)
CORE = os.path.join(REPO, "csrc", "core")
SOURCES = sorted(glob.glob(os.path.join(CORE, "*.c")) + glob.glob(os.path.join(CORE, "*.h")))
MAX_FILE_LINES = 1200
MAX_FUNCTION_LINES = 80


def functions(path):
    """(name, first line, line count) of each function defined in a C file.  The
    code is clang-formatted: a definition starts at column 0 and its body ends
    with a "}" alone at column 0."""
    lines = open(path).read().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^[A-Za-z_][\w \*]*?\b(\w+)\(", lines[i])
        if m and not lines[i].startswith(("typedef", "struct", "#", "static const")):
            j = i
            while j < len(lines) and "{" not in lines[j] and not lines[j].rstrip().endswith(";"):
                j += 1
            if j < len(lines) and lines[j].rstrip().endswith("{"):
                k = j
                while k < len(lines) and lines[k] != "}":
                    k += 1
                out.append((m.group(1), i + 1, k - i + 1))
                i = k
        i += 1
    return out


def test_the_core_has_its_rooms():
    names = {os.path.basename(p) for p in SOURCES}
    for room in ("heap.c", "block.c", "stream.c", "page.c", "policy.c", "place.c", "slow.c", "report.c"):
        assert room in names
    for room in ("capture.c", "pool.c", "pause.c", "check.c", "freeindex.c", "runindex.c", "debug.h", "block.h"):
        assert room in names


@pytest.mark.parametrize("path", SOURCES, ids=os.path.basename)
def test_no_file_over_the_limit(path):
    with open(path) as fh:
        n = sum(1 for _ in fh)
    assert n <= MAX_FILE_LINES, f"{os.path.basename(path)} has {n} lines"


@pytest.mark.parametrize("path", [p for p in SOURCES if p.endswith(".c")], ids=os.path.basename)
def test_no_function_over_the_limit(path):
    found = functions(path)
    assert found, "the function finder found nothing: it no longer matches the code's layout"
    long = [f"{name} (line {line}): {n} lines" for name, line, n in found if n > MAX_FUNCTION_LINES]
    assert not long, f"{os.path.basename(path)}: " + "; ".join(long)


def test_the_function_finder_measures_whole_functions(tmp_path):
    src = tmp_path / "x.c"
    src.write_text("static int f(int a,\n          int b) {\n    return a + b;\n}\n\nvoid g(void) {}\nint h(void);\n")
    assert functions(str(src)) == [("f", 1, 4)]


@pytest.mark.parametrize("name", ["freeindex", "runindex"])
def test_indexes_see_blocks_only(name):
    for ext in (".c", ".h"):
        with open(os.path.join(CORE, name + ext)) as fh:
            text = fh.read()
        assert '#include "heap_internal.h"' not in text
        assert "gm_heap" not in re.sub(r"/\*.*?\*/", "", text, flags=re.S), f"{name}{ext} names gm_heap"


@pytest.mark.parametrize("path", SOURCES, ids=os.path.basename)
def test_every_file_says_what_it_owns(path):
    with open(path) as fh:
        head = fh.read(400)
    assert head.startswith("/*"), f"{os.path.basename(path)} opens with no comment"
    assert os.path.basename(path) in head.split("*/")[0], "the opening comment does not name its file"
