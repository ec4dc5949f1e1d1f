"""The benchmark figures the README and the docs show agree with benchmarks/results: each marked
table is exactly what tools/figures.py makes from the results' JSON."""

import importlib.util
import json

import pytest

from helpers import REPO

RESULTS = REPO / "benchmarks" / "results"
WHERE = {
    "README.md": {"min_capacity"},
    "docs/guide.md": {"expandable", "costs"},
    "docs/design.md": {"traces_and_gpumem"},
    "gpumem/data/traces/README.md": {"traces"},
}


def figures():
    if not (RESULTS / "gpu_compare.json").exists():
        pytest.skip("benchmarks/results is not shipped in the sdist")
    spec = importlib.util.spec_from_file_location("figures", REPO / "tools" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_marked_table_is_made_from_the_results():
    f = figures()
    made = f.tables()
    assert set(f.DOCS) == set(WHERE)
    for doc, names in WHERE.items():
        text = (REPO / doc).read_text()
        found = {m.group(2) for m in f.MARK.finditer(text)}
        assert found == names, (doc, found)
        assert f.rewrite(text, made) == text, f"{doc} disagrees with benchmarks/results: run python3 tools/figures.py"
    assert f.main(["--check"]) == 0


def test_a_figure_that_differs_from_the_results_is_found(tmp_path):
    f = figures()
    data = json.loads((RESULTS / "gpu_compare.json").read_text())
    made = f.min_capacity(data)
    row = next(r for r in data["figures"]["1"]["rows"] if r["contender"] == "native")
    row["ratio"] += 0.05  # one native figure moves
    assert f.min_capacity(data) != made
    text = (REPO / "README.md").read_text()
    assert f.rewrite(text, dict(f.tables(), min_capacity=f.min_capacity(data))) != text


def test_the_readme_shows_the_current_run():
    """The figures once copied by hand disagreed: the README's must be the latest run's."""
    f = figures()
    data = json.loads((RESULTS / "gpu_compare.json").read_text())
    fig = {(r["trace"], r["contender"]): r["ratio"] for r in data["figures"]["1"]["rows"]}
    readme = (REPO / "README.md").read_text()
    for trace in ("gpt2_generate", "seed_fragmentation"):
        line = next(x for x in readme.splitlines() if x.startswith(f"| {trace} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[2]) == round(fig[trace, "native"], 3), line
        assert float(cells[4]) == round(fig[trace, "async"], 3), line
    assert f.main(["--check"]) == 0


def test_the_room_row_counts_the_traces_over_expandable_segments():
    f = figures()

    def row(default, expandable):
        return {"policies": {"default": {"peak_reserved": default}}, "expandable_peak_reserved": expandable}

    line = f.room_row([row(1.01, 1.02), row(1.05, 1.04), row(1.02, 1.02)])
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2:4] == ["1.020 to 1.040", "1.010 to 1.050"]
    assert "over expandable_segments' on 1," in cells[4] and cells[4].startswith("3 ")


def test_the_paired_step_row_takes_each_workloads_median_over_rounds():
    f = figures()

    def row(use, rnd, steps, ooms=0, workload="w"):
        return dict(workload=workload, allocator=use, round=rnd, step_ms=steps, warmup=1, ooms=ooms)

    rows = [row("native", r, [9.0, 10.0, 10.0]) for r in range(3)]
    rows += [row("gpumem", r, [9.0, t, t]) for r, t in enumerate((9.0, 11.0, 12.0))]
    rows += [row("expandable", r, [9.0, 10.0, 10.0]) for r in range(3)]
    # a capped workload whose native runs meet out-of-memory pairs nothing, and is not named
    rows += [row("native", r, [9.0, 10.0, 10.0], ooms=2, workload="cap") for r in range(3)]
    rows += [row("gpumem", r, [9.0, 10.0, 10.0], workload="cap") for r in range(3)]
    run = {"rows": rows, "meta": {"workloads": ["w", "cap"], "rounds": 3, "device": "GPU"}}
    cells = [c.strip() for c in f.paired_row(run).strip("|").split("|")]
    assert cells[1:4] == ["-", "+0.0%", "+10.0%"]  # gpumem's rounds read 0.9, 1.1, 1.2: the median 1.1
    assert cells[4].startswith("w, 3 rotated rounds")
