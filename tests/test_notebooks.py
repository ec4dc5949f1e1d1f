"""The notebooks run top to bottom on a CPU-only machine (simulated device) and
show pictures.  They are committed without outputs; this executes them with
nbclient.  GPUMEM_NOTEBOOK_OUT=DIR keeps the executed copies there."""

import os
import pathlib
import sys
import time

import pytest

from conftest import REPO, trace_file

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 2


def test_notebooks_are_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} has outputs"


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
