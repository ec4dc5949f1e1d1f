"""The documentation's Python examples run: every ```python block of README.md and
docs/*.md is compiled, and run on the simulated device, the blocks of one file in
order in one namespace (as a reader would type them), in a scratch folder.

A block that needs PyTorch and a GPU says so on the line before it,
``<!-- skip: needs torch and a CUDA GPU -->``; it is compiled, not run, and the
test reports it as skipped."""

import re

import pytest

from helpers import REPO

DOCS = [REPO / "README.md"] + sorted((REPO / "docs").glob("*.md"))
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
SKIP = re.compile(r"<!--\s*skip:\s*(.+?)\s*-->\s*$")


def blocks(path):
    """(first line number, code, skip reason or None) of each python block."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = [line for line in text[: m.start()].splitlines() if line.strip()]
        skip = SKIP.match(before[-1].strip()) if before else None
        out.append((text.count("\n", 0, m.start()) + 2, m.group(1), skip.group(1) if skip else None))
    return out


def test_the_docs_have_examples():
    found = {p.name: len(blocks(p)) for p in DOCS}
    assert found["README.md"] >= 3 and found["api.md"] >= 2, found


def test_the_block_finder(tmp_path):
    doc = "text\n<!-- skip: needs a GPU -->\n```python\nx = 1\n```\n\n```python\ny = 2\n```\n```sh\nz\n```\n"
    p = tmp_path / "example.md"
    p.write_text(doc)
    assert blocks(p) == [(4, "x = 1\n", "needs a GPU"), (8, "y = 2\n", None)]


def _marked():
    return [(p, line, reason) for p in DOCS for line, _, reason in blocks(p) if reason]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_examples_run(path, tmp_path, monkeypatch):
    found = blocks(path)
    if not found:
        pytest.skip("no python examples")
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__doc_example__"}
    try:
        for line, code, skip in found:
            where = f"{path.relative_to(REPO)}:{line}"
            compiled = compile(code, where, "exec")  # a block marked skip must still be Python
            if skip:
                continue  # test_marked_examples lists it
            try:
                exec(compiled, namespace)
            except Exception as e:
                pytest.fail(f"the example at {where} raised {type(e).__name__}: {e}")
    finally:
        for value in list(namespace.values()):
            if type(value).__name__ == "Heap" and not value.closed:
                value.close()


@pytest.mark.parametrize(
    "path,line,reason", _marked(), ids=[f"{p.relative_to(REPO).as_posix()}:{line}" for p, line, _ in _marked()]
)
def test_marked_examples(path, line, reason):
    """The blocks test_examples_run leaves out, each a visible skip with its reason."""
    assert re.search(r"torch|GPU|CUDA", reason), f"{path.name}:{line}: a skip must say what it needs: {reason!r}"
    pytest.skip(f"{path.relative_to(REPO)}:{line}: {reason}")


def test_the_zoo_catalog_is_the_traces_own():
    """docs/zoo.md's table is what benchmarks/zoo.py makes of the shipped traces' headers."""
    import subprocess
    import sys

    table = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "zoo.py"), "catalog", str(REPO / "gpumem" / "data" / "traces")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert table.count("\n") >= 25
    assert table in (REPO / "docs" / "zoo.md").read_text()


# A path under tests/ that the repository's docs, scripts and comments name: "tests/unit/test_core.py",
# "tests/boundary/test_boundary*.py", "tests/gpu" (never csrc/tests/..., nor a path inside another).
TEST_PATH = re.compile(r"(?<![\w./$-])tests(?:/[\w.*-]*[\w*])+")
# Records of past runs, and files that are no text.
NOT_READ = re.compile(r"^(benchmarks/results/|gpumem/data/|notebooks/)|\.(gz|png|pickle)$")


def named_test_paths(text):
    """The test paths text names, each once, in order."""
    return list(dict.fromkeys(m.group(0) for m in TEST_PATH.finditer(text)))


def test_the_test_path_finder():
    text = (
        "see tests/unit/test_core.py::test_x, tests/boundary/test_boundary*.py and `tests/gpu`.\n"
        "csrc/tests/fuzz.c, $w/run/tests/unit, tests/ alone, tests/unit/test_core.py again"
    )
    assert named_test_paths(text) == ["tests/unit/test_core.py", "tests/boundary/test_boundary*.py", "tests/gpu"]


def test_every_test_path_the_repository_names_exists():
    """When tests move, every script, doc and comment that names one follows (CI's scripts, tools/mutate.py,
    the docs' commands): each path under tests/ a tracked file names is a file or folder, or a pattern
    that matches one."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    missing = []
    for rel in tracked.stdout.splitlines():
        if NOT_READ.search(rel) or not (REPO / rel).is_file():
            continue
        for path in named_test_paths((REPO / rel).read_text(errors="replace")):
            if not list(REPO.glob(path)):
                missing.append(f"{rel} names {path}, which is not in the tree")
    assert not missing, "\n".join(missing)
