"""benchmarks/common.py: the environment that makes a child process import this checkout's gpumem."""

import json
import os
import subprocess
import sys

from helpers import REPO

sys.path.insert(0, os.path.join(str(REPO), "benchmarks"))

import common  # noqa: E402


def test_the_checkout_goes_ahead_of_the_inherited_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    assert common.with_checkout_path()["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/inherited"]
    first = common.with_checkout_path(first="/other/build")["PYTHONPATH"]
    assert first.split(os.pathsep) == ["/other/build", str(REPO), "/inherited"]
    assert os.environ["PYTHONPATH"] == "/inherited"  # a copy: the caller's environment is unchanged


def test_no_empty_entry_when_nothing_is_inherited(monkeypatch):
    # An empty entry would put the child's working directory on its path.
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert common.with_checkout_path()["PYTHONPATH"] == str(REPO)
    assert common.with_checkout_path({"PYTHONPATH": ""}, first="")["PYTHONPATH"] == str(REPO)
    env = common.with_checkout_path({"A": "1"})
    assert env == {"A": "1", "PYTHONPATH": str(REPO)}


def test_a_child_started_elsewhere_has_the_checkout_ahead_of_site_packages_and_not_its_cwd(tmp_path):
    # A script run from a folder of its own (sys.path[0] is then the script's folder, not the working
    # directory), in a working directory of its own: its path holds the checkout ahead of every
    # site-packages, and not the working directory, which an empty entry would put there.
    (tmp_path / "run").mkdir()
    (tmp_path / "cwd").mkdir()
    script = tmp_path / "run" / "child.py"
    script.write_text("import json, sys\nprint(json.dumps(sys.path[1:]))\n")
    env = common.with_checkout_path({k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path / "cwd", env=env, capture_output=True, text=True, check=True
    )
    path = [os.path.realpath(p) if p else "<empty>" for p in json.loads(out.stdout)]
    assert path[0] == os.path.realpath(str(REPO))
    assert "<empty>" not in path and os.path.realpath(tmp_path / "cwd") not in path
