"""The Python package imports one way (gpumem/_heap.py draws the layers).

The import graph is read from the source (ast: every import statement, those
inside functions too) and must have no circle; the torch layer (gpumem.torch)
is a leaf nothing below imports; and every module imports in a fresh
interpreter in several orders.
"""

import ast
import itertools
import os
import pathlib
import random
import subprocess
import sys

import pytest

from conftest import REPO

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
        for node in ast.walk(tree):
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


def test_the_cycle_finder_finds_one():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_nothing_below_imports_the_torch_layer():
    graph = import_graph()
    for mod, deps in graph.items():
        if mod.startswith("gpumem.torch") or mod == "gpumem":
            continue
        upward = {d for d in deps if d.startswith("gpumem.torch")}
        assert not upward, f"{mod} imports the torch layer: {sorted(upward)}"


def test_bottom_layers_import_only_the_bottom():
    graph = import_graph()
    allowed = {
        "gpumem._units": set(),
        "gpumem._heap": set(),
        "gpumem._frameworks": set(),
        "gpumem._resolve": {"gpumem._C", "gpumem._heap", "gpumem._frameworks"},
    }
    for mod, ok in allowed.items():
        assert graph[mod] <= ok, f"{mod} imports {sorted(graph[mod] - ok)}"
    # the visibility layer reads heaps through the interface, never through gpumem.torch
    for mod in ("gpumem.history", "gpumem.snapshot", "gpumem.explain"):
        assert not {d for d in graph[mod] if d.startswith("gpumem.torch")}


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
            "gpumem._resolve",
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
