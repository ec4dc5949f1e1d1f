"""The notebooks run top to bottom on a CPU-only machine (simulated device) and
show pictures.  They are committed with their outputs, so that they read well
unopened, and use gpumem's public API only; this executes them again with
nbclient.  GPUMEM_NOTEBOOK_OUT=DIR keeps the executed copies there; to refresh
the committed outputs, execute them in place (jupyter nbconvert --execute
--inplace notebooks/*.ipynb)."""

import os
import pathlib
import re
import sys
import time

import pytest

from helpers import REPO, trace_file

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


def test_notebooks_are_committed_with_their_outputs():
    """Every code cell ran, in order, top to bottom, in one kernel, without an error."""
    nbformat = pytest.importorskip("nbformat")
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        code = [cell for cell in nb.cells if cell.cell_type == "code"]
        assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1)), f"{path.name} not run in order"
        for cell in code:
            assert all(out.get("output_type") != "error" for out in cell.outputs), f"{path.name}: an error output"
        shown = [out for cell in code for out in cell.outputs]
        assert any("image/png" in out.get("data", {}) for out in shown), f"{path.name} shows no picture"


# gpumem's private modules and names: gpumem._C, gpumem._cli_viz, from gpumem.x import _y, ...
PRIVATE = re.compile(r"\bgpumem(\.\w+)*\._\w|from\s+gpumem(\.\w+)*\s+import\s+[^\n]*\b_\w")


def test_notebooks_use_the_public_api_only():
    nbformat = pytest.importorskip("nbformat")
    assert PRIVATE.search("from gpumem._cli_viz import peak_snapshot")  # the check finds what it must
    assert PRIVATE.search("from gpumem.trace import _Builder") and not PRIVATE.search("import gpumem.trace")
    for path in NOTEBOOKS:
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                hit = PRIVATE.search(cell.source)
                assert hit is None, f"{path.name} uses a private name: {hit.group(0)!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_and_shows_pictures(path, monkeypatch, tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("matplotlib")
    pytest.importorskip("ipykernel")
    trace_file("seed_fragmentation")  # the notebooks read the shipped traces: fail, not skip, without them
    # The kernel is a child process: it must import this checkout's gpumem.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    t0 = time.monotonic()
    client.execute()  # raises CellExecutionError on the first failing cell
    took = time.monotonic() - t0
    keep = os.environ.get("GPUMEM_NOTEBOOK_OUT")
    if keep:
        pathlib.Path(keep).mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, pathlib.Path(keep) / path.name)
    pngs = svgs = 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            pngs += "image/png" in data
            svgs += "<svg" in data.get("text/html", "")
            assert out.get("output_type") != "error", out
    assert pngs >= 1 and svgs >= 1, f"{path.name}: {pngs} PNG and {svgs} SVG outputs"
    assert took < 120, f"{path.name} took {took:.0f}s"
    print(f"{path.name}: {took:.1f}s, {pngs} PNG, {svgs} SVG", file=sys.stderr)
