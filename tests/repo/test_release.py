"""What a release ships: the distribution's name and licence, and an sdist that
holds everything its tests read (tests/, notebooks/, docs/, the shipped data)."""

import re
import shutil
import subprocess
import sys
import tarfile

import pytest

from helpers import REPO

# Left out of the sdist on purpose: CI's script, recorded benchmark results, dotfiles.
NOT_SHIPPED = re.compile(r"^(\.ci/|benchmarks/results/|\.)")


def pyproject():
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        pytest.skip("tomllib needs Python 3.11")
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]


def test_distribution_name_license_and_urls():
    project = pyproject()
    # "gpumem" on the package index is an unrelated project; the import name stays gpumem.
    assert project["name"] == "gpumem-allocator"
    assert project["license"] == "Apache-2.0" and "LICENSE" in project["license-files"]
    text = (REPO / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert {"Homepage", "Source", "Issues"} <= project["urls"].keys()
    assert all(u.startswith("https://") for u in project["urls"].values())
    readme = (REPO / "README.md").read_text()
    assert "pip install gpumem-allocator" in readme


def test_sdist_holds_every_tracked_file(tmp_path):
    """The sdist is what `python -m build` makes the wheel from and what a user's tests run in."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout (this is the sdist itself)")
    # Building needs the build backend, which a venv made with `pip install . pytest` lacks
    # (pip builds in an isolated environment of its own); `pip install -e .[test]` brings it.
    pytest.importorskip("setuptools", minversion="77")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    want = {f for f in tracked.splitlines() if not NOT_SHIPPED.match(f)}
    p = subprocess.run(
        [sys.executable, "setup.py", "-q", "egg_info", "--egg-base", str(tmp_path), "sdist", "-d", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (sdist,) = tmp_path.glob("gpumem_allocator-*.tar.gz")
    with tarfile.open(sdist) as tar:
        have = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert not want - have, f"missing from the sdist: {sorted(want - have)}"
    assert not {n for n in have if n.endswith((".so", ".o"))}, "build outputs in the sdist"
