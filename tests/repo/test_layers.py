"""The package and the C sources keep to the map in docs/architecture.md.

Python: the import graph is read from the source (ast: every import statement,
those inside functions too, but not those under `if TYPE_CHECKING:`, which never
run); every import goes to a module of the same or a lower layer of the map's
layer table, within a layer there is no circle, and every module imports in a
fresh interpreter in several orders.

C: the map's tables say which folder may include which and which files alone
may speak to Python, torch and CUDA, and which CUDA names two files may write;
the tests read them and check every file under csrc/ (test_map.py checks that
every file the map names exists, and that it names every file of code).
"""

import ast
import fnmatch
import itertools
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest

from helpers import REPO

PKG = REPO / "gpumem"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules():
    mods = {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}
    mods["gpumem._C"] = None  # the extension: a leaf
    return mods


def _resolve(current: str, is_pkg: bool, level: int, name: str) -> str:
    base = current.split(".")
    if not is_pkg:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _is_type_checking(test) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_that_run(tree):
    """The import statements of tree, those inside functions too, but not those
    under `if TYPE_CHECKING:` (only a type checker reads them)."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        todo.extend(ast.iter_child_nodes(node))


def import_graph():
    """module -> set of gpumem modules it imports (the package __init__s a
    submodule import runs implicitly are not counted)."""
    mods = _modules()
    graph = {m: set() for m in mods}
    for mod, path in mods.items():
        if path is None:
            continue
        is_pkg = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        for node in imports_that_run(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(mod, is_pkg, node.level, node.module or "") if node.level else (node.module or "")
                # "from . import x": x a submodule imports x (the package itself
                # only runs as the facade); "from .m import name" imports m
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                targets = subs if len(subs) == len(node.names) else subs + [base]
            for t in targets:
                if t in mods and t != mod:
                    graph[mod].add(t)
    return graph


def _find_cycle(graph):
    WHITE, GREY, BLACK = 0, 1, 2
    color = {m: WHITE for m in graph}
    stack = []

    def visit(m):
        color[m] = GREY
        stack.append(m)
        for n in sorted(graph[m]):
            if color[n] == GREY:
                return stack[stack.index(n) :] + [n]
            if color[n] == WHITE:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        color[m] = BLACK
        return None

    for m in sorted(graph):
        if color[m] == WHITE:
            found = visit(m)
            if found:
                return found
    return None


def test_no_import_circle():
    cycle = _find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_imports_only_a_type_checker_reads_are_not_counted():
    tree = ast.parse(
        "import a\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from .b import B\nelse:\n    import c\n"
        "if typing.TYPE_CHECKING:\n    import d\n"
        "def f():\n    import e\n    if x:\n        import g\n"
    )
    names = sorted(a.name for n in imports_that_run(tree) for a in n.names)
    assert names == ["TYPE_CHECKING", "a", "c", "e", "g"]


def test_the_cycle_finder_finds_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


# -- the map: docs/architecture.md's tables, read against the code ------------

ARCH = REPO / "docs" / "architecture.md"
CSRC = REPO / "csrc"
INCLUDE_DIRS = (CSRC / "include", CSRC / "core", CSRC / "runtime")  # setup.py's and the Makefile's -I


def _ticks(cell):
    return re.findall(r"`([^`]+)`", cell)


def doc_table(title):
    """The rows (lists of cells, header and rule lines left out) of the table
    under the (checked) heading of docs/architecture.md that contains title."""
    rows, heading = [], None
    for line in ARCH.read_text().splitlines():
        if line.startswith("#"):
            heading = line
        elif heading and title in heading and "(checked)" in heading and line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    assert len(rows) > 2, f"docs/architecture.md has no checked table '{title}'"
    return rows[2:]


def documented_layers():
    """[patterns of layer 0, of layer 1, ...] as docs/architecture.md lists them."""
    rows = doc_table("the layers")
    assert [int(r[0]) for r in rows] == list(range(len(rows))), "layers are numbered 0, 1, 2, ... in order"
    return [_ticks(r[1]) for r in rows]


def layer_of(mod, layers):
    return [i for i, pats in enumerate(layers) if any(fnmatch.fnmatchcase(mod, p) for p in pats)]


def layer_problems(graph, layers):
    """Every import that goes up a layer, every module in no layer (or in two),
    and every name the table lists that is no module."""
    problems, where = [], {}
    for mod in sorted(graph):
        hits = layer_of(mod, layers)
        if len(hits) == 1:
            where[mod] = hits[0]
        else:
            problems.append(f"{mod} is in {f'layers {hits}' if hits else 'no layer'} of docs/architecture.md")
    for mod in sorted(where):
        for dep in sorted(graph[mod]):
            if dep in where and where[dep] > where[mod]:
                problems.append(f"{mod} (layer {where[mod]}) imports {dep} (layer {where[dep]})")
    for pats in layers:
        for p in pats:
            if not any(c in p for c in "*?[") and p not in graph:
                problems.append(f"docs/architecture.md lists {p}, which is no module")
    return problems


def test_every_import_goes_to_the_same_or_a_lower_layer():
    problems = layer_problems(import_graph(), documented_layers())
    assert not problems, "\n".join(problems)


def test_the_layer_check_finds_an_upward_import_and_a_module_in_no_layer():
    layers = [["p._low", "p.data"], ["p.mid", "p.mid.*"], ["p"]]
    graph = {"p._low": set(), "p.data": {"p._low"}, "p.mid": {"p.data"}, "p.mid.x": {"p.mid"}, "p": {"p.mid.x"}}
    assert layer_problems(graph, layers) == []
    graph["p.data"] = {"p.mid.x"}
    graph["p.new"] = set()
    assert layer_problems(graph, layers) == [
        "p.new is in no layer of docs/architecture.md",
        "p.data (layer 0) imports p.mid.x (layer 1)",
    ]
    del graph["p.new"]
    graph["p.data"] = set()
    assert layer_problems(graph, layers + [["p.gone"]]) == ["docs/architecture.md lists p.gone, which is no module"]


def test_the_torch_layer_sits_above_everything_but_the_facade():
    # the visibility layer reads heaps through gpumem._heaplike's interface, never through gpumem.torch
    layers = documented_layers()
    (torch_layer,) = layer_of("gpumem.torch", layers)
    assert layer_of("gpumem.torch._install", layers) == [torch_layer]
    for mod in ("gpumem._heaplike", "gpumem._which_heap", "gpumem.history", "gpumem.snapshot", "gpumem.explain"):
        assert layer_of(mod, layers)[0] < torch_layer, mod
    assert layer_of("gpumem", layers) == [len(layers) - 1]


def _c_files():
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".c", ".h", ".cpp"))


def _rel(path):
    return path.relative_to(REPO).as_posix()


def _strip_c(text):
    """C or C++ text without its comments, string and character literals."""
    return re.sub(r"""//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'""", " ", text, flags=re.S)


def _includes(path):
    """[(quoted, name)] of the file's #include lines."""
    found = re.findall(r"""^\s*#\s*include\s*([<"])([^>"]+)[>"]""", path.read_text(), flags=re.M)
    return [(q == '"', name) for q, name in found]


def _resolve_include(path, name):
    for d in (path.parent,) + INCLUDE_DIRS:
        if (d / name).is_file():
            return _rel((d / name).resolve())
    return None


def _matches(rel, subjects):
    """rel (a path under the repo) is one of subjects; a folder ends in "/"."""
    return any(rel.startswith(s) if s.endswith("/") else rel == s for s in subjects)


def include_rules():
    """[(subjects, allowed or None for anything)], the rows naming files first."""
    rules = []
    for cells in doc_table("which folder may include which"):
        subjects, allowed = _ticks(cells[0]), _ticks(cells[1])
        rules.append((subjects, None if allowed == ["*"] else allowed))
    return sorted(rules, key=lambda r: all(s.endswith("/") for s in r[0]))


def include_problems(files, rules, resolve=_resolve_include, includes=_includes):
    problems = []
    for path in files:
        rel = _rel(path)
        rule = next((r for r in rules if _matches(rel, r[0])), None)
        if rule is None:
            problems.append(f"{rel}: no row of docs/architecture.md says what it may include")
            continue
        for quoted, name in includes(path):
            if not quoted:
                continue
            target = resolve(path, name)
            if target is None:
                problems.append(f'{rel}: #include "{name}" names no file')
            elif rule[1] is not None and not _matches(target, rule[1]):
                problems.append(f'{rel}: #include "{name}" ({target}) is outside {", ".join(rule[1]) or "nothing"}')
    return problems


def test_each_c_folder_includes_only_what_the_map_allows():
    rules = include_rules()
    assert (["csrc/core/"], ["csrc/core/", "csrc/include/"]) in rules
    assert (["csrc/device/"], ["csrc/device/", "csrc/include/"]) in rules
    problems = include_problems(_c_files(), rules)
    assert not problems, "\n".join(problems)


def test_the_include_check_finds_a_core_or_device_file_reaching_out():
    rules = include_rules()
    core, device = CSRC / "core" / "errors.c", CSRC / "device" / "sim.c"
    planted = {
        core: [(True, "gpumem/gpumem.h"), (True, "convert.h"), (False, "stdio.h")],
        # heap_internal.h is found through -Icsrc/core, but is not the devices' to read
        device: [(True, "gpumem/device.h"), (True, "heap_internal.h")],
    }

    def resolve(path, name):
        return {"convert.h": "csrc/python/convert.h"}.get(name) or _resolve_include(path, name)

    assert include_problems([core, device], rules, resolve, planted.get) == [
        'csrc/core/errors.c: #include "convert.h" (csrc/python/convert.h) is outside csrc/core/, csrc/include/',
        'csrc/device/sim.c: #include "heap_internal.h" (csrc/core/heap_internal.h) is outside csrc/device/, '
        "csrc/include/",
    ]
    index = CSRC / "core" / "freeindex.c"
    planted[index] = [(True, "freeindex.h"), (True, "heap_internal.h")]
    assert include_problems([index], rules, includes=planted.get) == [
        'csrc/core/freeindex.c: #include "heap_internal.h" (csrc/core/heap_internal.h) is outside '
        "csrc/core/freeindex.h, csrc/core/runindex.h, csrc/core/block.h, csrc/core/debug.h, csrc/include/"
    ]


def outside_exceptions():
    """{("CUDA", file): names it may write}: the map's table of CUDA's names outside cuda.c."""
    rows = doc_table("CUDA's names outside cuda.c")
    return {("CUDA", _ticks(r[0])[0]): set(_ticks(r[1])) for r in rows}


def outside_rules():
    """[(api, headers, name regexes, where it may be spoken)]"""
    rules = []
    for cells in doc_table("who may speak to the outside"):
        marks = _ticks(cells[1])
        regexes = [m for m in marks if "\\" in m or "[" in m]
        headers = [m for m in marks if m not in regexes]
        rules.append((cells[0], headers, regexes, _ticks(cells[2])))
    return rules


def _is_header(name, headers):
    return any(name.startswith(h) if h.endswith("/") else name == h for h in headers)


def outside_problems(files, rules, text=lambda p: p.read_text(), includes=_includes, exceptions=None):
    exceptions = outside_exceptions() if exceptions is None else exceptions
    problems = []
    for path in files:
        rel, code = _rel(path), None
        for api, headers, regexes, where in rules:
            if _matches(rel, where):
                continue
            for _, name in includes(path):
                if _is_header(name, headers):
                    problems.append(f"{rel} includes {name}: only {', '.join(where)} may speak to {api}")
            code = _strip_c(text(path)) if code is None else code
            names = {m.group(0) for rx in regexes for m in re.finditer(rx, code)}
            names -= exceptions.get((api, rel), set())
            if names:
                problems.append(f"{rel} names {api}: {sorted(names)}; only {', '.join(where)} may")
    return problems


def test_only_the_rooms_the_map_names_speak_to_python_torch_and_cuda():
    rules = outside_rules()
    assert [r[0] for r in rules] == ["Python", "torch", "CUDA"]
    problems = outside_problems(_c_files(), rules)
    assert not problems, "\n".join(problems)


def test_the_outside_check_finds_cuda_python_and_torch_out_of_their_rooms():
    rules = outside_rules()
    page = CSRC / "core" / "page.c"
    src = (
        "/* cuMemMap, named in a comment only */\n"
        'static const char *s = "cuMemCreate";\n'
        "int f(void) { CUdeviceptr p = 0; return cuMemUnmap(p, 1) == CUDA_SUCCESS; }\n"
    )
    incs = [(False, "Python.h"), (False, "c10/core/Device.h"), (False, "stdio.h")]
    assert outside_problems([page], rules, lambda p: src, lambda p: incs) == [
        "csrc/core/page.c includes Python.h: only csrc/python/, csrc/torch_ext/allocator.cpp may speak to Python",
        "csrc/core/page.c includes c10/core/Device.h: only csrc/python/torch_alloc.cpp, csrc/torch_ext/ may speak "
        "to torch",
        "csrc/core/page.c names CUDA: ['CUDA_SUCCESS', 'CUdeviceptr', 'cuMemUnmap']; only csrc/device/cuda.c may",
    ]
    # the one exception is torch_boundary.h's opaque stream handle, and only that name
    boundary = CSRC / "python" / "torch_boundary.h"
    src = "struct CUstream_st; typedef CUstream_st *s_t; int g() { return cuStreamQuery(0); }"
    assert outside_problems([boundary], rules, lambda p: src, lambda p: []) == [
        "csrc/python/torch_boundary.h names CUDA: ['cuStreamQuery']; only csrc/device/cuda.c may"
    ]
    alloc = CSRC / "python" / "torch_alloc.cpp"
    assert outside_problems([alloc], rules, lambda p: src, lambda p: []) == [
        "csrc/python/torch_alloc.cpp names CUDA: ['CUstream_st', 'cuStreamQuery']; only csrc/device/cuda.c may"
    ]
    # the exception is the map's table: without its row, the handle is a CUDA name like any other
    assert outside_problems([alloc], rules, lambda p: src, lambda p: [], exceptions={}) == [
        "csrc/python/torch_alloc.cpp names CUDA: ['CUstream_st', 'cuStreamQuery']; only csrc/device/cuda.c may"
    ]


def _importable():
    names = [m for m in _modules() if not m.endswith("__main__") and m != "gpumem._C"]
    return sorted(names)


def _run(order):
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint('ok')"
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code, *order], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", f"order {order}:\n{p.stderr[-3000:]}"


@pytest.mark.parametrize("which", ["forward", "backward", "shuffled-1", "shuffled-2", "each-first"])
def test_every_module_imports_in_any_order(which):
    names = _importable()
    if which == "forward":
        orders = [names]
    elif which == "backward":
        orders = [names[::-1]]
    elif which.startswith("shuffled"):
        rng = random.Random(int(which[-1]))
        order = list(names)
        rng.shuffle(order)
        orders = [order]
    else:
        # each module alone, first thing in a fresh interpreter (then the rest)
        orders = [[m] + [n for n in names if n != m] for m in names]
    for order in orders:
        _run(order)


def test_pairs_of_layers_import_both_ways():
    for a, b in itertools.permutations(
        [
            "gpumem.torch",
            "gpumem.snapshot",
            "gpumem.history",
            "gpumem.explain",
            "gpumem._which_heap",
            "gpumem.torch._viz",
            "gpumem.torch._pools",
        ],
        2,
    ):
        if a < b:
            _run([a, b])
            _run([b, a])


def test_import_gpumem_and_its_torch_layer_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import gpumem, gpumem.torch, gpumem.replay, gpumem.torch._viz, gpumem.torch._pools\n"
        "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None and m == 'torch']\n"
        "print('ok')"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
