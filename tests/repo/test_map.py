"""docs/architecture.md against the tree, the whole page and not only its checked tables.

Every file of code (csrc/, gpumem/, tests/, benchmarks/, tools/) is named by its path, in a table or
in the prose; every path the map names exists (a bare name in a table's cell is in the folder of the
path before it; any other bare name is the name of a file somewhere in the tree); the drawing's files
are in the folders its lines name, it names every header and every device, and its Python lines name
the modules of the layer table.  The tree is read as it is: a file moved, added or renamed fails here
until the map follows.
"""

import re
import subprocess

import pytest

from helpers import REPO
from test_layers import ARCH, _ticks, documented_layers

# What counts as code, and the map's rule for it.
CODE = re.compile(r"^(csrc/.*\.(c|h|cpp)|(gpumem|tests|benchmarks)/.*\.py|tools/[^/]+)$")
# A backticked name that is a path: a name with a "/" or one that ends like a file of this repository.
PATH_LIKE = re.compile(r"^[\w.*/-]+$")
EXTENSIONS = (".c", ".h", ".cpp", ".py", ".md", ".toml", ".ipynb")
# Columns whose names are not gpumem's files: the outside APIs' own headers.
OUTSIDE_COLUMNS = ("recognised by",)
# Folders whose every file the drawing names.
DRAWN_IN_FULL = ("csrc/include/gpumem", "csrc/device")
C_NAME = re.compile(r"[\w*]+\.(?:c|h|cpp)\b")


def tree_files():
    """The repository's files: tracked, and new ones git does not ignore (the sdist, which leaves .ci/
    and the recorded results out, has no git: there the map is not checked)."""
    p = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, text=True
    )
    if p.returncode != 0:
        pytest.skip("not a git checkout")
    return sorted(f for f in set(p.stdout.splitlines()) if (REPO / f).is_file())


def is_path(tok):
    return bool(PATH_LIKE.match(tok)) and ("/" in tok or tok.endswith(EXTENSIONS))


def _exists(path, files):
    """path (from the root; a folder ends in "/"; * and ? match) names a file or folder of files."""
    pat = path.rstrip("/")
    rx = re.compile(re.escape(pat).replace(r"\*", "[^/]*").replace(r"\?", "[^/]") + "(/.*)?$")
    return any(rx.match(f) for f in files)


def _bare_exists(name, files):
    rx = re.compile(re.escape(name).replace(r"\*", "[^/]*") + "$")
    return any(rx.match(f.rsplit("/", 1)[-1]) for f in files)


def _split_row(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def named_in_text(text, files):
    """(paths the map names, from the root; problems): every backticked path of the page's prose and
    tables, the drawing left out (drawing_problems reads it)."""
    named, problems, header, in_drawing = [], [], None, False
    for line in text.splitlines():
        if line.startswith("```"):
            in_drawing = not in_drawing
            continue
        if in_drawing:
            continue
        if not line.startswith("|"):
            header = None
            cells = [line]
        elif header is None:
            header = _split_row(line)
            continue
        elif set(line) <= set("|- "):
            continue
        else:
            cells = [c for h, c in zip(header, _split_row(line)) if h not in OUTSIDE_COLUMNS]
        for cell in cells:
            _read_cell(cell, header is not None, files, named, problems)
    return named, problems


def _read_cell(cell, in_table, files, named, problems):
    folder = None
    for tok in _ticks(cell):
        if not is_path(tok):
            continue
        if "/" in tok:
            folder = tok.rstrip("/").rsplit("/", 1)[0] if not tok.endswith("/") else tok.rstrip("/")
            path = tok
        elif in_table and folder is not None:
            path = f"{folder}/{tok}"
        else:
            if not _bare_exists(tok, files):
                problems.append(f"docs/architecture.md names {tok}, which is no file of the tree")
            continue
        named.append(path.rstrip("/"))
        if not _exists(path, files):
            problems.append(f"docs/architecture.md names {path}, which is not in the tree")


def drawing(text):
    """The lines of the page's drawing (its first fenced block)."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("```"))
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    return lines[start + 1 : end]


def drawn_files(text, files):
    """(folder, name) of each file the drawing names: a line that starts with a folder, or a rule
    that names one, sets the folder of the lines below it; a rule that names anything else clears it."""
    out, folder = [], None
    dirs = {f.rsplit("/", 1)[0] for f in files}
    for line in drawing(text):
        if "──" in line:
            label = line.strip(" ─")
            folder = label if label in dirs else None
        else:
            m = re.match(r"^ (csrc/[\w/]+)\s", line)
            folder = m.group(1) if m else folder
        out += [(folder, name) for name in C_NAME.findall(line)]
    return out


def drawing_problems(text, files):
    problems, drawn = [], {}
    for folder, name in drawn_files(text, files):
        drawn.setdefault(folder, set()).add(name)
        ok = _exists(f"{folder}/{name}", files) if folder else _bare_exists(name, files)
        if not ok:
            problems.append(f"the drawing names {name} in {folder or 'the tree'}, which is not there")
    for folder in DRAWN_IN_FULL:
        have = {f.rsplit("/", 1)[1] for f in files if f.rsplit("/", 1)[0] == folder}
        for name in sorted(have - drawn.get(folder, set())):
            problems.append(f"the drawing does not name {folder}/{name}")
    return problems


def drawn_layers(text):
    """{layer: sorted names} of the drawing's Python lines ("..., ... (what)   layer N")."""
    out = {}
    for line in drawing(text):
        m = re.match(r"^\s*(?:Python\s+)?(.*?)\s+layer (\d+)\s*$", line)
        if m:
            names = re.sub(r"\([^)]*\)", "", m.group(1)).split(",")
            out[int(m.group(2))] = sorted(n.strip() for n in names if n.strip())
    return out


def layer_drawing_problems(text, layers):
    problems = []
    drawn = drawn_layers(text)
    for n, pats in enumerate(layers):
        want = sorted(p if p == "gpumem" else p.removeprefix("gpumem.") for p in pats)
        if drawn.get(n) != want:
            problems.append(f"the drawing's layer {n} names {drawn.get(n)}, the layer table {want}")
    return problems


def map_problems(text, files, layers):
    named, problems = named_in_text(text, files)
    problems += drawing_problems(text, files)
    problems += layer_drawing_problems(text, layers)
    named = set(named)
    for f in files:
        if CODE.match(f) and f not in named:
            problems.append(f"{f} is not named in docs/architecture.md")
    return list(dict.fromkeys(problems))


def test_the_map_names_every_file_of_code_and_only_files_that_exist():
    problems = map_problems(ARCH.read_text(), tree_files(), documented_layers())
    assert not problems, "\n".join(problems)


def test_the_boundary_paragraph_names_every_boundary_test():
    """The paragraph on .ci/boundary_asan names each file of tests/boundary/."""
    text = ARCH.read_text()
    para = next(p for p in text.split("\n\n") if "`.ci/boundary_asan` runs" in p)
    named = {t for t in _ticks(para) if t.startswith("tests/boundary/") and t.endswith(".py")}
    have = {f for f in tree_files() if f.startswith("tests/boundary/") and f.endswith(".py")}
    assert named == have, f"named but missing: {sorted(named - have)}; not named: {sorted(have - named)}"


def _real():
    return ARCH.read_text(), tree_files(), documented_layers()


def test_the_map_check_finds_a_file_left_out_and_a_file_that_is_gone():
    text, files, layers = _real()
    assert map_problems(text, files + ["csrc/core/swap.c", "gpumem/swap.py", "tools/swap.sh"], layers) == [
        "csrc/core/swap.c is not named in docs/architecture.md",
        "gpumem/swap.py is not named in docs/architecture.md",
        "tools/swap.sh is not named in docs/architecture.md",
    ]
    gone = [f for f in files if f not in ("csrc/python/oom_glue.c", "csrc/core/runindex.h", "tools/mutate.py")]
    assert map_problems(text, gone, layers) == [
        "docs/architecture.md names csrc/core/runindex.h, which is not in the tree",
        "docs/architecture.md names csrc/python/oom_glue.c, which is not in the tree",
        "docs/architecture.md names oom_glue.c, which is no file of the tree",
        "docs/architecture.md names tools/mutate.py, which is not in the tree",
        "the drawing names oom_glue.c in csrc/python, which is not there",
    ]


def test_a_bare_name_in_a_cell_is_in_the_folder_of_the_path_before_it():
    files = ["csrc/core/block.c", "csrc/core/block.h", "csrc/python/common.h"]
    named, problems = named_in_text("| room | what |\n| --- | --- |\n| `csrc/core/block.c`, `block.h` | x |\n", files)
    assert named == ["csrc/core/block.c", "csrc/core/block.h"] and problems == []
    named, problems = named_in_text(
        "| room | what |\n| --- | --- |\n| `csrc/python/common.h`, `block.h` | x |\n", files
    )
    assert problems == ["docs/architecture.md names csrc/python/block.h, which is not in the tree"]
    # in prose a bare name is any file's name; the outside APIs' headers are not gpumem's files
    assert named_in_text("reads `block.h`, not `blocks.h`", files)[1] == [
        "docs/architecture.md names blocks.h, which is no file of the tree"
    ]
    table = "| API | recognised by | only in |\n| --- | --- | --- |\n| Python | `Python.h` | `csrc/python/` |\n"
    assert named_in_text(table, files + ["csrc/python/module.c"]) == (["csrc/python"], [])


def test_the_drawing_check_finds_a_header_left_out_a_moved_file_and_a_layer_that_differs():
    text, files, layers = _real()
    assert drawing_problems(text.replace(", array.h;", ";"), files) == [
        "the drawing does not name csrc/include/gpumem/array.h"
    ]
    moved = text.replace(" csrc/model    native_model.c", " csrc/core     native_model.c")
    assert drawing_problems(moved, files) == ["the drawing names native_model.c in csrc/core, which is not there"]
    assert layer_drawing_problems(text.replace("_backend, cupy, numba", "cupy, numba"), layers) == [
        "the drawing's layer 4 names ['cupy', 'numba'], the layer table ['_backend', 'cupy', 'numba']"
    ]
