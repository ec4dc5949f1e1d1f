"""benchmarks/gpu_forecast.py over the zoo, without a GPU: every zoo member is forecast by a spec or
listed with the reason it is not; every zoo spec builds and takes a step at the zoo's toy size on the
CPU; --check prints the plan; the search (doubling, bisection, the budget, an earlier run's probes, a
device found full) and its scheduler on fake probes; --forecast-only's pool and table on fake
forecasts."""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from helpers import REPO

sys.path.insert(0, os.path.join(str(REPO), "benchmarks"))

import forecast_only  # noqa: E402
import forecast_search as fs  # noqa: E402
from forecast_models import MODELS, ZOO_ALL, ZOO_MODELS  # noqa: E402
from forecast_zoo import NOT_APPLICABLE, SPECS, ZOO_MEMBERS  # noqa: E402

SCRIPT = os.path.join(str(REPO), "benchmarks", "gpu_forecast.py")
GiB = 1 << 30
KNOB_WORDS = {"batch": ("batch",), "sequence length": ("seq", "audio s"), "resolution": ("resolution", "latent side")}


def test_every_zoo_member_has_a_spec_or_a_reason():
    from gpumem import data

    zoo = {r["name"]: r for r in data.zoo()}
    assert set(ZOO_MEMBERS) | set(NOT_APPLICABLE) == set(zoo)
    assert not set(ZOO_MEMBERS) & set(NOT_APPLICABLE)
    assert all(len(why) > 20 for why in NOT_APPLICABLE.values())
    for member, spec in ZOO_MEMBERS.items():
        assert spec in MODELS and spec in ZOO_ALL, member
        words = KNOB_WORDS[zoo[member]["knob"]]  # its knob is batch, sequence length or resolution
        assert any(w in MODELS[spec].knob for w in words), (member, MODELS[spec].knob)
    # the members that are not forecast have no such knob, or are CUDA graphs
    assert all(zoo[m]["knob"] not in KNOB_WORDS or "CUDA graphs" in zoo[m]["exercises"] for m in NOT_APPLICABLE)
    assert ZOO_ALL == list(SPECS) + ZOO_MODELS and len(set(ZOO_ALL)) == len(ZOO_ALL)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_spec_names_a_knob_recorded_values_and_a_builder(name):
    s = MODELS[name]
    assert isinstance(s.knob, str) and s.knob
    assert len(s.recorded) >= 2 and s.recorded == sorted(set(s.recorded)) and s.recorded[0] > 0
    assert all(k % s.multiple == 0 for k in s.recorded)
    assert s.steps in (1, 2) and callable(s.build)
    if "generate" in name or "sample" in name or "beam" in name:
        assert s.steps == 1  # one generate call a step


def _stand_ins(monkeypatch):
    """timm and torchvision where they are not installed (they are on the GPU machine): a small
    convolutional classifier for any of their models, so that the spec's own step still runs."""
    import importlib.util
    import types

    from torch import nn

    def classifier(*args, **kw):
        return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    if importlib.util.find_spec("timm") is None:
        monkeypatch.setitem(sys.modules, "timm", types.SimpleNamespace(create_model=classifier))
    if importlib.util.find_spec("torchvision") is None:
        tv = types.SimpleNamespace(models=types.SimpleNamespace(resnet101=classifier))
        monkeypatch.setitem(sys.modules, "torchvision", tv)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_zoo_spec_takes_a_step_at_toy_size_on_the_cpu(name, monkeypatch):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    spec = MODELS[name]
    try:
        step, reset = spec.build("cpu")
    except ImportError as e:
        if e.name in ("transformers", "peft", "diffusers"):  # the models' own libraries: not in every environment
            pytest.skip(f"{e.name} is not installed")
        assert e.name in ("timm", "torchvision"), e
        _stand_ins(monkeypatch)  # in sys.modules only here: transformers looks for torchvision's there
        step, reset = spec.build("cpu")
    k = spec.recorded[0]
    for _ in range(spec.steps):
        step(k)
    if reset is not None:  # training: the optimizer's state made by the step, dropped by reset
        reset()
        step(k)


def test_check_prints_the_plan_for_every_spec():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    for extra in ([], ["--forecast-only"]):
        r = subprocess.run(
            [sys.executable, SCRIPT, "--check", "--models", "zoo-all", *extra], capture_output=True, text=True, env=env
        )
        assert r.returncode == 0, r.stderr
        for name in ZOO_ALL:
            assert f"{name}: " in r.stdout
        for member, spec in ZOO_MEMBERS.items():
            assert f"{spec}: zoo member {member};" in r.stdout
        for member in NOT_APPLICABLE:
            assert f"{member}: not forecast (" in r.stdout
    assert "at most 8 processes at once" in r.stdout
    r = subprocess.run([sys.executable, SCRIPT, "--check", "--models", "nope"], capture_output=True, text=True, env=env)
    assert r.returncode == 2 and "unknown model(s) nope" in r.stderr


def test_resume_refuses_what_is_not_an_earlier_run(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    bad = tmp_path / "bad.json"
    for text, says in (("{", "Expecting"), ('{"rows": []}', "not gpu_forecast.py's JSON")):
        bad.write_text(text)
        r = subprocess.run(
            [sys.executable, SCRIPT, "--check", "--resume", str(bad)], capture_output=True, text=True, env=env
        )
        assert r.returncode == 2 and says in r.stderr and "Traceback" not in r.stderr


# ---- the search on fake probes -------------------------------------------------------------------------


def fake(limit, calls, wall=2.0, full=()):
    """run_probe(k): fits up to `limit`; the values in `full` find the device full once."""
    full = set(full)

    def run_probe(k):
        calls.append(k)
        if k in full:
            full.discard(k)
            return {"k": k, "ok": False, "wall_s": wall, "device_full": True}
        return {"k": k, "ok": k <= limit, "wall_s": wall, "peak_allocated": k}

    return run_probe


def far():
    return time.monotonic() + 600


def test_search_doubles_from_twice_the_largest_recorded_then_bisects():
    calls = []
    r = fs.search([2, 4], 1, fake(37, calls), fs.Slots(1), far(), log=lambda m: None)
    assert calls[:9] == [8, 16, 32, 64, 48, 40, 36, 38, 37]
    # then settled: the values from an eighth below 37 not yet probed, at once
    assert sorted(calls[9:]) == [33, 34, 35]
    assert r["largest"] == r["bisected"] == 37 and r["first_oom"] == 38 and r["complete"]
    assert r["search_s"] == 2.0 * 9 and r["settle_s"] == 2.0 * 3 and r["measured_peak_allocated"] == 37
    calls = []
    r = fs.search([64, 128], 16, fake(40, calls), fs.Slots(1), far(), log=lambda m: None)
    assert calls == [256, 128, 64, 32, 48, 16] and r["largest"] == 32 and r["first_oom"] == 48


def test_search_settles_where_a_value_below_the_bisections_does_not_run():
    """torch's allocator near the limit: 544 runs, 560 does not, 576 does (bert at 8 GiB on an H200)."""
    calls = []

    def run_probe(k):
        calls.append(k)
        return {"k": k, "ok": k <= 544 or k == 576, "wall_s": 1.0, "peak_allocated": k}

    r = fs.search([64, 128, 192], 16, run_probe, fs.Slots(4), far(), log=lambda m: None)
    assert calls[:6] == [384, 768, 576, 672, 624, 592] and r["bisected"] == 576
    assert r["largest"] == 544 and r["complete"] and r["measured_peak_allocated"] == 544
    assert set(calls[6:]) == {496, 512, 528, 544, 560, 464, 480} and len(calls) == len(set(calls))
    assert r["search_s"] == 6.0 and r["settle_s"] == len(calls) - 6.0


def test_a_settling_cut_short_keeps_what_it_found(monkeypatch):
    """The budget ends during the settling, after 560 was found not to run: the truth is below it."""
    now = [0.0]
    monkeypatch.setattr(fs.time, "monotonic", lambda: now[0])
    calls = []

    def run_probe(k):
        calls.append(k)
        if k == 560:
            now[0] = 100.0  # past the deadline: no probe starts after this one
        return {"k": k, "ok": k <= 544 or k == 576, "wall_s": 1.0}

    r = fs.search([64, 128, 192], 16, run_probe, fs.Slots(1), 50.0, log=lambda m: None)
    assert 560 in calls and r["bisected"] == 576
    assert r["largest"] == 544 and not r["complete"]


def test_search_starts_no_probe_after_the_deadline():
    calls = []
    deadline = time.monotonic() + 0.3

    def slow(k):
        time.sleep(0.2)
        return fake(37, calls)(k)

    r = fs.search([2, 4], 1, slow, fs.Slots(1), deadline, log=lambda m: None)
    # the probe running at the deadline finished; none started after it
    assert calls == [8, 16] and r["largest"] == 16 and not r["complete"] and r["first_oom"] is None


def test_search_runs_a_probe_again_where_the_device_itself_was_full():
    calls = []
    r = fs.search([2, 4], 1, fake(37, calls, full={16}), fs.Slots(1), far(), log=lambda m: None)
    assert calls[:3] == [8, 16, 16] and r["largest"] == 37


def test_search_takes_an_earlier_runs_probes_without_running_them():
    first = []
    dl = time.monotonic() + 0.5
    earlier_search = fs.search(
        [2, 4], 1, lambda k: (time.sleep(0.1), fake(37, first)(k))[1], fs.Slots(1), dl, log=lambda m: None
    )
    assert not earlier_search["complete"]
    earlier = {"device": "H", "cap_bytes": 8, "models": {"m": {"truth": {"native": earlier_search}}}}
    known = fs.known_probes(earlier, "m", "native", "H", 8)
    assert set(known) == set(first)
    again = []
    r = fs.search([2, 4], 1, fake(37, again), fs.Slots(1), far(), log=lambda m: None, known=known)
    assert r["largest"] == 37 and r["complete"]
    assert not set(again) & set(first)  # nothing probed twice
    assert r["reused_probes"] == len(first)
    assert r["search_s"] + r["settle_s"] == 2.0 * (len(first) + len(again))
    with pytest.raises(ValueError, match="another|not"):
        fs.known_probes(earlier, "m", "native", "H", 16)


def test_slots_go_to_the_lowest_priority_waiting():
    slots = fs.Slots(1)
    order = []
    hold = threading.Event()

    def holder():
        with slots.slot(0):
            hold.wait()

    def waiter(p):
        with slots.slot(p):
            order.append(p)

    threads = [threading.Thread(target=holder)]
    threads[0].start()
    while slots.busy == 0:
        time.sleep(0.01)
    for p in (5.0, 1.0, 3.0, -1.0):
        threads.append(threading.Thread(target=waiter, args=(p,)))
        threads[-1].start()
        while len(slots._waiting) < len(threads) - 1:
            time.sleep(0.01)
    hold.set()
    for t in threads:
        t.join()
    assert order == [-1.0, 1.0, 3.0, 5.0] and slots.most == 1


def test_searches_share_the_slots_and_all_progress():
    slots = fs.Slots(3)
    calls = {i: [] for i in range(6)}

    def run(i):
        def slow(k):
            time.sleep(0.02)
            return fake(37, calls[i])(k)

        return fs.search([2, 4], 1, slow, slots, far(), log=lambda m: None)

    out = []
    threads = [threading.Thread(target=lambda i=i: out.append(run(i))) for i in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert slots.most == 3 and all(r["largest"] == 37 for r in out) and len(out) == 6


def test_more_processes_at_once_where_the_cap_is_lower():
    free = 139 * GiB
    assert fs.default_jobs(free, 16 * GiB, 16) == 7
    assert fs.default_jobs(free, 8 * GiB, 16) == 14  # memory: 8 GiB and 1.5 more each
    assert fs.default_jobs(free, 4 * GiB, 16) == 14  # the CPUs: two fewer than there are
    assert fs.default_jobs(free, 4 * GiB, 64) == 24
    assert fs.default_jobs(GiB, 8 * GiB, 16) == 1


# ---- --forecast-only on fake forecasts ---------------------------------------------------------------


def test_forecast_only_runs_a_pool_and_writes_each_result_as_it_ends(tmp_path):
    names = ["a", "b", "c", "d", "e"]
    running, most, lock = [0], [0], threading.Lock()

    def run_one(name, timeout):
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            time.sleep(0.05)
            if name == "b":
                raise subprocess.TimeoutExpired("child", timeout)
            if name == "c":
                raise RuntimeError("child forecast c failed (rc 1):\nTraceback ...\nValueError: bad shape")
            aligned = name != "d"
            largest = {"native": 30, "gpumem": 33} if aligned else {"gpumem": 33}
            caveats = ["12 allocations only at batch >= 4 | modelled"]
            return dict(aligned=aligned, largest=largest, recorded=[2, 4], forecast_s=1.5, caveats=caveats)
        finally:
            with lock:
                running[0] -= 1

    out = tmp_path / "fo.json"
    saves = []
    save = forecast_only.saver(str(out))

    def counting(results):
        save(results)
        saves.append(len(json.loads(out.read_text())["models"]))

    results = forecast_only.run_forecasts(names, run_one, 2, 7.0, {"models": {}}, counting, log=lambda m: None)
    assert most[0] == 2 and saves == [1, 2, 3, 4, 5]
    assert json.loads(out.read_text())["models"]["b"]["forecast"]["error"] == "timed out after 7 s"
    spec = MODELS["llama_train_seq"]
    members = {"a": "m1", "b": "m2", "c": "m3", "d": "m4", "e": "-"}
    rows = [forecast_only.row(n, spec, members[n], results["models"][n]["forecast"]) for n in names]
    assert [r["both"] for r in rows] == [True, False, False, False, True]
    lines = []
    forecast_only.print_table(rows, out=lines.append)
    assert lines[0].startswith("| member | model | knob | recorded | aligned | native | gpumem |")
    assert "| m1 | a | seq | 2,4 | yes | 30 | 33 | 1.5 | 12 allocations only at batch >= 4 \\| modelled | - |" in lines
    assert any("| m4 | d |" in ln and "| no | - | 33 |" in ln for ln in lines)
    assert any("ValueError: bad shape" in ln for ln in lines)
    assert lines[-1] == "answers for both allocators on 1 of 4 zoo members (25%); 5 models, 2 failed"


# ---- gpu_forecast.py's parent end to end, its children and the device faked ---------------------------


@pytest.fixture
def fake_gpu(monkeypatch):
    """gpu_forecast imported with a fake device and fake children: forecasts answer 30 (native) and 33
    (gpumem); probes fit up to 30 (native) and 33 (gpumem).  Yields (module, the children's args)."""
    torch = pytest.importorskip("torch")
    import gpu_forecast as gf

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (139 * GiB, 140 * GiB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(gf.os, "cpu_count", lambda: 16)  # an H200 machine's
    calls, lock = [], threading.Lock()

    def run_child(args, timeout, threads=None):
        with lock:
            calls.append(list(args))
        if args[0] == "forecast":
            spec = MODELS[args[1]]
            largest = {"native": 30, "gpumem": 33}
            return dict(aligned=True, largest=largest, recorded=spec.recorded, forecast_s=1.0, caveats=["c"])
        k, limit = int(args[3]), {"native": 30, "gpumem": 33}[args[2]]
        return {"k": k, "ok": k <= limit, "wall_s": 1.0, "peak_allocated": k, "peak_reserved": k}

    monkeypatch.setattr(gf, "_run_child", run_child)
    return gf, calls


def run_main(gf, monkeypatch, capsys, *argv):
    monkeypatch.setattr(sys, "argv", ["gpu_forecast.py", *argv])
    gf.main()
    return capsys.readouterr().out


def test_forecast_only_end_to_end_on_fake_children(fake_gpu, monkeypatch, capsys, tmp_path):
    gf, calls = fake_gpu
    out = tmp_path / "fo.json"
    text = run_main(gf, monkeypatch, capsys, "--forecast-only", "--models", "zoo-all", "--out", str(out))
    assert sorted(c[1] for c in calls) == sorted(ZOO_ALL) and all(c[0] == "forecast" for c in calls)
    r = json.loads(out.read_text())
    assert r["mode"] == "forecast-only" and r["forecast_jobs"] == 8 and len(r["rows"]) == len(ZOO_ALL)
    assert r["not_applicable"] == NOT_APPLICABLE
    assert "| llama_train | llama_train_seq | seq | 64,128,192 | yes | 30 | 33 |" in text
    assert f"answers for both allocators on {len(ZOO_MEMBERS)} of {len(ZOO_MEMBERS)} zoo members (100%)" in text


def test_search_end_to_end_on_fake_children_and_resumed(fake_gpu, monkeypatch, capsys, tmp_path):
    gf, calls = fake_gpu
    out = tmp_path / "run.json"
    text = run_main(gf, monkeypatch, capsys, "--models", "t5_batch,efficientnet_train_res", "--out", str(out))
    r = json.loads(out.read_text())
    assert r["jobs"] == 14 and 1 <= r["most_probes_at_once"] <= 4
    truth = {(w["model"], w["allocator"]): (w["truth"], w["truth_complete"], w["within"]) for w in r["rows"]}
    assert truth[("t5_batch", "native")] == (30, True, True) and truth[("t5_batch", "gpumem")] == (33, True, True)
    assert truth[("efficientnet_train_res", "gpumem")] == (33, True, True)
    assert "| t5_batch | batch | native | 30 | 30 | yes |" in text
    probes = sum(1 for c in calls if c[0] == "probe")
    calls.clear()
    run_main(gf, monkeypatch, capsys, "--models", "t5_batch,efficientnet_train_res", "--resume", str(out))
    assert [c[0] for c in calls] == ["forecast", "forecast"]  # every probe answered by the earlier run
    assert probes > 8
    monkeypatch.setattr(sys.modules["torch"].cuda, "get_device_name", lambda *a: "Another GPU")
    with pytest.raises(SystemExit, match="--resume: the earlier run was on 'Fake GPU'"):
        run_main(gf, monkeypatch, capsys, "--models", "t5_batch", "--resume", str(out))
