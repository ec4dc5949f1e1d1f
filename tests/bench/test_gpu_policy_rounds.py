"""benchmarks/gpu_policy.py without a GPU: rounds rotate which allocator runs first, and the paired
figure compares each step with native's same step of the same round."""

import os
import subprocess
import sys
import types

from helpers import REPO

sys.path.insert(0, os.path.join(str(REPO), "benchmarks"))

import gpu_policy as g  # noqa: E402


def _row(use, rnd, steps, warmup=2, ooms=0):
    return dict(workload="w", allocator=use, round=rnd, step_ms=steps, warmup=warmup, ooms=ooms)


def test_rounds_rotate_the_allocator_that_runs_first(monkeypatch):
    order = []

    def run(cmd, **kw):
        use = cmd[cmd.index("--child") + 1]
        order.append(use)
        line = '{"workload": "gpt2_varlen", "allocator": "%s"}' % use
        return types.SimpleNamespace(stdout=line + "\n", stderr="", returncode=0)

    monkeypatch.setattr(subprocess, "run", run)
    a = types.SimpleNamespace(rounds=3, budget=1e9, timeout=1.0, allocators="native,expandable,gpumem")
    envs = {use: {} for use in ("native", "expandable", "gpumem")}
    rows, done = g._rounds(a, ["gpt2_varlen"], ["native", "expandable", "gpumem"], envs, 0.0)
    assert done == 3 and len(rows) == 9
    assert [order[i * 3] for i in range(3)] == ["native", "expandable", "gpumem"]
    for i in range(3):  # every allocator once a round
        assert sorted(order[i * 3 : i * 3 + 3]) == ["expandable", "gpumem", "native"]
    assert [r["round"] for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_paired_takes_the_median_of_step_over_native_step_in_the_same_round():
    rows = [
        _row("native", 0, [9.0, 9.0, 10.0, 20.0, 40.0]),
        _row("gpumem", 0, [1.0, 1.0, 11.0, 20.0, 20.0]),  # steady steps over native's: 1.1, 1.0, 0.5
        _row("native", 1, [9.0, 9.0, 10.0, 10.0, 10.0]),
        _row("gpumem", 1, [1.0, 1.0, 12.0, 13.0, 14.0]),  # 1.2, 1.3, 1.4
    ]
    assert g._paired(rows, "w", "gpumem", "native") == [1.0, 1.3]
    # The plain medians would read 20 against 20 in round 0: steps of different shapes mixed.


def test_paired_leaves_out_a_round_with_ooms_or_no_native_run():
    rows = [
        _row("native", 0, [1.0, 1.0, 10.0], ooms=2),
        _row("gpumem", 0, [1.0, 1.0, 10.0]),
        _row("gpumem", 1, [1.0, 1.0, 10.0]),
    ]
    assert g._paired(rows, "w", "gpumem", "native") == [None, None]


def test_the_table_shows_the_paired_figure_per_round():
    rows = []
    for rnd, (n, m) in enumerate([(10.0, 11.0), (10.0, 9.0), (10.0, 10.0)]):
        for use, t in (("native", n), ("gpumem", m)):
            r = _row(use, rnd, [t] * 6)
            r.update(median_ms=t, total_ms=6 * t, peak_reserved=2**30, peak_live=2**30)
            r.update(calls_after_warmup={k: 0 for k in g.CALLS})
            rows.append(r)
    table = g._table(rows, ["w"], ["native", "gpumem"])
    line = next(x for x in table.splitlines() if "| gpumem |" in x)
    assert "1.000 (1.100, 0.900, 1.000)" in line


def test_an_allocator_that_names_its_own_pythonpath_imports_that_build_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/inherited")
    from compare.contenders import variant_env

    plain = g._child_env("gpumem", variant_env("gpumem"))
    other = g._child_env("gpumem:PYTHONPATH=/old/build", variant_env("gpumem:PYTHONPATH=/old/build"))
    assert plain["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/inherited"]
    assert other["PYTHONPATH"].split(os.pathsep) == ["/old/build", str(REPO), "/inherited"]
