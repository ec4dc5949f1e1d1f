"""Devices by name, the fault-injecting wrapper, and heap options checked once.

- gpumem.Heap(device=...) opens devices through one registry: an unknown name's
  error lists the known ones.
- Fault injection lives in one wrapper around the device (device/faults.c): an
  injected failure, a call refused for its arguments while doomed, the counts and
  the seeded random schedules behave on the simulated device as they always did.
- Each heap option's range error is the core's one message, the same from
  gpumem.Heap(...), gpumem.install(...) options, GPUMEM_CONF and registry_configure.
"""

import pytest

import gpumem
from gpumem import _C
from gpumem.torch import _install
from gpumem.torch._install import OptionError, normalize_options

MiB = 1 << 20
GiB = 1 << 30


# ---- the device registry ---------------------------------------------------------------


@pytest.mark.parametrize("name", ["tpu", "SIM", "cuda:0", ""])
def test_an_unknown_device_names_the_known_ones(name):
    with pytest.raises(ValueError) as e:
        gpumem.Heap(device=name, capacity=GiB)
    assert str(e.value) == f'unknown device "{name}" (known: sim, cuda)'


def test_the_registry_checks_device_arguments_before_opening_anything():
    with pytest.raises(ValueError, match="capacity of a sim device must be positive"):
        gpumem.Heap(device="sim", capacity=0)
    # No driver is loaded for these: the same answer on a machine without a GPU.
    with pytest.raises(ValueError, match="capacity applies to the sim device only"):
        gpumem.Heap(device="cuda", capacity=GiB)
    with pytest.raises(ValueError, match="page_size must be a power of two, got 3145728"):
        gpumem.Heap(device="cuda", page_size=3 * MiB)


def test_a_sim_heap_is_a_sim_heap():
    h = gpumem.Heap(device="sim", capacity=GiB)
    try:
        assert h.sim_info()["capacity"] == GiB  # sim-only calls reach the device behind the wrapper
        with pytest.raises(TypeError, match="needs a cuda heap"):
            h.cuda_fault_calls("create")
    finally:
        h.close()


# ---- the fault-injecting wrapper on the simulated device ---------------------------------


def test_an_injected_fault_fails_the_chosen_call_only(make_heap):
    h = make_heap(capacity=GiB)
    kept = h.malloc(4 * MiB)
    before = h.sim_calls("map")
    h.sim_fail("map", 2)  # the second map from now
    with pytest.raises(gpumem.DeviceError, match="injected fault in map"):
        h.malloc(4 * MiB)  # two pages: the first maps, the second fails
    assert h.sim_calls("map") == before + 2  # the failed call is counted too
    h.check()
    more = h.malloc(4 * MiB)  # the schedule is spent: the next try works
    assert h.sim_calls("map") > before + 2
    h.free(kept)
    h.free(more)
    h.check()


def test_a_doomed_call_with_bad_arguments_still_answers_for_them(make_heap):
    """Injection never hides a caller's bug: the device checks the doomed call first."""
    h = make_heap(capacity=GiB)
    p = h.malloc(2 * MiB)
    n = h.sim_calls("unmap")
    h.sim_fail("unmap", 1)
    with pytest.raises(ValueError, match="cuts|not mapped|no reservation|whole pages"):
        h.sim_unmap(p + 4 * GiB, 2 * MiB)  # nothing is mapped there
    assert h.sim_calls("unmap") == n + 1  # counted, and the schedule spent on it
    h.free(p)
    h.empty_cache()  # the unmap this makes is not failed
    h.check()


def test_capture_refusal_comes_before_injection(make_heap):
    h = make_heap(capacity=GiB)
    p = h.malloc(2 * MiB)
    h.free(p)
    h.sim_set_capture(True)
    h.sim_fail("synchronize", 1, 100)
    try:
        h.empty_cache()
    except gpumem.DeviceError as e:
        assert "stream capture" in str(e) and "injected" not in str(e), str(e)
    finally:
        h.sim_set_capture(False)
        h.sim_fail("synchronize", 0)
    assert h.sim_capture_violations() >= 1
    h.empty_cache()
    h.check()


def _random_run(seed):
    """A workload under random faults on every op: what each step said."""
    h = gpumem.Heap(device="sim", capacity=512 * MiB)
    try:
        for op in _C.DEVICE_OPS:
            h.sim_fail_random(op, 0.05, seed)
        out, live = [], []
        for i in range(300):
            size = (1 + (i * 7919) % 23) * MiB
            try:
                live.append(h.malloc(size))
                out.append(("malloc", live[-1]))
            except (gpumem.OutOfMemoryError, gpumem.DeviceError) as e:
                out.append(("error", type(e).__name__, str(e).splitlines()[0]))
            if i % 3 == 2 and live:
                h.free(live.pop(0))
            if i % 50 == 49:
                try:
                    h.empty_cache()
                except gpumem.DeviceError as e:
                    out.append(("empty_cache", str(e).splitlines()[0]))
        calls = {op: h.sim_calls(op) for op in _C.DEVICE_OPS}
        for p in live:
            h.free(p)
        for op in _C.DEVICE_OPS:
            h.sim_fail_random(op, 0.0, 0)
        h.empty_cache()
        h.check()
        return out, calls
    finally:
        h.close()


def test_random_faults_are_a_function_of_the_seed():
    first, again, other = _random_run(11), _random_run(11), _random_run(12)
    assert first == again
    assert any(step[0] == "error" for step in first[0])  # faults did fire
    assert first != other


# ---- each option checked once, one message -------------------------------------------------

BAD = [
    ("chunk_pages", 0),
    ("chunk_pages", _C.CHUNK_PAGES_MAX + 1),
    ("pressure", 1.5),
    ("pressure", -0.25),
    ("growth_slack", 101.0),
    ("growth_slack", -1.0),
    ("growth_slack_pages", -1),
    ("va_size", 1 << 50),
    ("page_size", 3 * MiB),
]


def _message(fn):
    with pytest.raises(ValueError) as e:
        fn()
    return str(e.value)


@pytest.mark.parametrize("key,value", BAD, ids=[f"{k}={v}" for k, v in BAD])
def test_an_option_has_one_message_everywhere(monkeypatch, key, value):
    core = _message(lambda: _C.check_option(key, value))
    assert _message(lambda: gpumem.Heap(device="sim", capacity=GiB, **{key: value})) == core
    assert _message(lambda: normalize_options({key: value})) == f"option {key}={value!r}: {core}"
    with pytest.raises(OptionError):
        normalize_options({key: value})
    monkeypatch.setenv("GPUMEM_CONF", f"{key}:{value}")
    assert _message(lambda: _install._prepare({}, "install")) == f"GPUMEM_CONF: option {key}='{value}': {core}"
    if key != "page_size":  # registry_configure takes the page size as a plain int (a registry heap's option)
        assert _message(lambda: _C.registry_configure(**{key: value})) == core
    assert core.startswith(key)


def test_messages_are_built_from_the_limits():
    assert f"[1, {_C.CHUNK_PAGES_MAX}]" in _message(lambda: _C.check_option("chunk_pages", 0))
    assert "[0, 1]" in _message(lambda: _C.check_option("pressure", 2.0))
    with pytest.raises(ValueError, match="unknown heap option 'colour'"):
        _C.check_option("colour", 1)


def test_unset_options_take_the_cores_defaults():
    kw = normalize_options({})
    assert all(kw[k] is None for k in ("va_size", "growth_slack", "growth_slack_pages", "pressure", "chunk_pages"))
    before = _C.registry_options()
    try:
        _C.registry_configure(chunk_pages=8, pressure=0.5)
        assert (_C.registry_options()["chunk_pages"], _C.registry_options()["pressure"]) == (8, 0.5)
        _C.registry_configure(chunk_pages=None, pressure=None)
        opts = _C.registry_options()
        assert (opts["chunk_pages"], opts["pressure"]) == (_C.CHUNK_PAGES_DEFAULT, _C.PRESSURE_DEFAULT)
    finally:
        _C.registry_configure(**{k: before[k] for k in ("chunk_pages", "pressure")})
    assert _C.registry_options() == before


def test_the_core_reads_the_conf_text():
    assert _C.parse_conf(" a:1 ,, b : 2MiB ,", ("a", "b"), "SRC") == {"a": "1", "b": "2MiB"}
    for text, message in [
        ("a", "SRC: expected key:value, got 'a'"),
        ("a: ", "SRC: expected key:value, got 'a:'"),
        ("c:1", "SRC: unknown option 'c' in 'c:1' (known: a, b)"),
        ("a:1,a:2", "SRC: option a given twice (a:1 and a:2)"),
        ("a:1," * 2000, "SRC: 8000 characters, more than the 4096 gpumem reads"),
    ]:
        with pytest.raises(ValueError) as e:
            _C.parse_conf(text, ("a", "b"), "SRC")
        assert str(e.value) == message


def test_option_and_statistic_names_have_one_home_in_c():
    from gpumem import _heaplike as _heap

    assert _install.OPTION_NAMES is _C.OPTION_NAMES and "cap" in _C.OPTION_NAMES and "oom" in _C.OPTION_NAMES
    with pytest.raises(ValueError, match=r"unknown gpumem option\(s\) colour \(known: " + ", ".join(_C.OPTION_NAMES)):
        normalize_options({"colour": 1})
    # torch's "{name}.{pool}.{field}" statistics: a heap's keys are made from the names C exports
    h = gpumem.Heap(device="sim", capacity=GiB)
    try:
        pooled = {k for k in h.stats() if k.count(".") == 2}
    finally:
        h.close()
    names = _C.POOLED_STAT_NAMES
    assert pooled == {f"{n}.{p}.{f}" for n in names for p in _C.STAT_POOLS for f in _C.STAT_FIELDS}
    assert set(_install._zero_stats()) == pooled | set(_C.COUNTER_NAMES)
    # the history bound install() checks is the one the Python layers read
    assert _heap.MAX_HISTORY == _C.MAX_HISTORY
    with pytest.raises(OptionError, match=rf"history must lie in \[0, {_C.MAX_HISTORY}\]"):
        normalize_options({"history": _C.MAX_HISTORY + 1})
