"""Shared fixtures and collection hooks for the gpumem test suite, one for every folder of tests/.

Everything here runs on the simulated device; tests that need a real GPU take
the `gpu` marker and are skipped when torch or CUDA is missing.  What the test
files import (units, traces, heap checks, fresh interpreters) is in tests/helpers.py.
"""

import os
import pathlib
import sys

import pytest

# tests/ on the path, so that every folder's test files import helpers (and pytest's
# rootdir-relative import mode is not needed for it).
_HERE = str(pathlib.Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from helpers import GiB, assert_ok, cuda_devices, traces_dir, REPO  # noqa: E402

# Hypothesis: under CI (the CI variable set, as .ci/run does) the property
# tests run derandomized -- the same examples on every run, so a bug they can
# find is found every time, not in some runs -- with more examples and no
# example database.  GPUMEM_HYPOTHESIS_PROFILE picks a profile by name.
try:
    from hypothesis import HealthCheck, settings as _hsettings

    _hsettings.register_profile("dev", deadline=None)
    _hsettings.register_profile(
        "ci",
        derandomize=True,
        database=None,
        max_examples=400,
        deadline=None,
        print_blob=True,
        suppress_health_check=[HealthCheck.too_slow],
    )
    # tools/mutate.py: the CI examples, without shrinking (a planted bug only
    # needs to be caught, and shrinking it would dominate the run).
    from hypothesis import Phase

    _hsettings.register_profile(
        "mutate", parent=_hsettings.get_profile("ci"), phases=[Phase.explicit, Phase.reuse, Phase.generate]
    )
    _hsettings.load_profile(os.environ.get("GPUMEM_HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))
except ImportError:  # hypothesis is only needed by the tests that import it
    pass


@pytest.fixture(scope="session")
def traces():
    """traces_dir(): a missing folder fails the test that wants it, never skips it."""
    return traces_dir()


@pytest.fixture(scope="session")
def repo_root():
    return REPO


def _cuda_available():
    n, why = cuda_devices()
    return n > 0, why


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs torch and a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    ok, why = _cuda_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"gpu test: {why}")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def gpumem_mod():
    import gpumem

    return gpumem


@pytest.fixture
def make_heap():
    """Factory for sim heaps; every heap it made is closed at teardown, so a
    failing test cannot leak a heap into the next one."""
    import gpumem

    made = []

    def make(capacity=4 * GiB, **kw):
        h = gpumem.Heap(device="sim", capacity=capacity, **kw)
        made.append(h)
        return h

    yield make
    for h in made:
        try:
            h.close()
        except Exception:
            pass


@pytest.fixture
def heap(make_heap):
    return make_heap()


@pytest.fixture
def check():
    return assert_ok
