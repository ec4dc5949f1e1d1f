"""tools/mutate.py's planted bugs still plant: each names text that stands exactly once in its file.

The core moves between files and its lines change; a mutation whose text no longer matches would stop
the whole table (mutate.py refuses it) or, worse, be re-aimed by hand at other logic.  This checks the
patterns against the tree as it is, without building anything.
"""

import importlib.util
import sys

import pytest

from helpers import REPO as ROOT


def _mutate_module():
    spec = importlib.util.spec_from_file_location("gpumem_mutate_tool", ROOT / "tools" / "mutate.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


MUTATE = _mutate_module()


def test_mutation_names_are_unique():
    names = [m.name for m in MUTATE.MUTATIONS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("m", MUTATE.MUTATIONS, ids=lambda m: m.name)
def test_each_planted_bug_applies_once_and_changes_its_file(m, tmp_path):
    src = ROOT / m.path
    assert src.is_file(), f"{m.name}: {m.path} is not in the tree"
    text = src.read_text()
    assert text.count(m.old) == 1, f"{m.name}: its text occurs {text.count(m.old)} times in {m.path} (want 1)"
    assert m.old != m.new
    # apply() is what a run does to its copy of the tree.
    (tmp_path / m.path).parent.mkdir(parents=True)
    (tmp_path / m.path).write_text(text)
    MUTATE.apply(str(tmp_path), m)
    mutated = (tmp_path / m.path).read_text()
    assert mutated == text.replace(m.old, m.new) and mutated != text
