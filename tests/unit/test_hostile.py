"""Hostile input: the trace parser, the snapshot unpickler and the explain CLI.

Whatever bytes a user hands gpumem, the answer is a result or the documented
error: TraceError from load_trace, exit status 2 and one "gpumem: error:" line
from the CLI -- never a traceback, never code run from a pickle.

Hypothesis drives structured inputs (text traces, snapshot dicts) and byte
mutations of valid files; CI runs a short, derandomized pass (tests/conftest.py).
An offline run of any length:

    GPUMEM_FUZZ_SECONDS=600 python3 -m pytest -q -s tests/unit/test_hostile.py -k offline

runs a mutation loop over the recorded traces and generated files for that
long and prints the inputs tried and the crashes found (each crashing input is
saved under $GPUMEM_FUZZ_OUT, default a temporary folder).
"""

import contextlib
import gzip
import io
import os
import pickle
import random
import tempfile
import time
import traceback

import pytest

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ModuleNotFoundError:  # a venv made with `pip install . pytest`; `pip install -e ".[test]"` has it
    pytest.skip("these property tests need hypothesis", allow_module_level=True)

import gpumem
from gpumem import __main__ as cli
from gpumem.trace import ACTIONS as TRACE_ACTIONS
from gpumem.trace import TraceError, load_trace

MiB = 1 << 20
# Every action the loader knows, then two it must refuse.
ACTIONS = [*TRACE_ACTIONS, "boom", ""]


class Crash(Exception):
    """An input got an answer other than a result or the documented error."""


def check_input(path):
    """Feed one file to the loader, a replay and the explain CLI.  Returns a
    short outcome; raises Crash with the traceback on anything undocumented."""
    try:
        tr = load_trace(path)
    except TraceError as e:
        if "\n" in str(e):
            raise Crash(f"TraceError is not one line: {e!r}")
        outcome = "rejected"
        tr = None
    except Exception:
        raise Crash(f"load_trace: {traceback.format_exc()}")
    else:
        outcome = "loaded"
    if tr is not None and tr.n_events:
        h = gpumem.Heap(device="sim", capacity=256 * MiB)
        try:
            h.replay(tr.events, tr.n_slots)
            h.check()
        except Exception:
            raise Crash(f"replay of a loaded trace: {traceback.format_exc()}")
        finally:
            h.close()
    for argv in (["explain", str(path)], ["explain", str(path), "--capacity", "64MiB", "--json"]):
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = cli.main(argv)
        except SystemExit as e:  # argparse --help paths only; not expected here
            rc = e.code
        except Exception:
            raise Crash(f"gpumem {' '.join(argv)}: {traceback.format_exc()}")
        if rc not in (0, 2):
            raise Crash(f"gpumem {' '.join(argv)}: exit {rc}: {err.getvalue()}")
        if rc == 2:
            lines = err.getvalue().splitlines()
            if len(lines) != 1 or not lines[0].startswith("gpumem: error: "):
                raise Crash(f"gpumem {' '.join(argv)}: error output is not one line: {err.getvalue()!r}")
    return outcome


# ---- generated inputs -------------------------------------------------------------------

ints = st.one_of(
    st.integers(-3, 70 * MiB),
    st.integers(-(1 << 70), 1 << 70),
    st.sampled_from([0, 1, 512, (1 << 64) - 1, 1 << 64, -1]),
)
text_line = st.one_of(
    st.tuples(st.sampled_from(ACTIONS), ints, ints, ints).map(lambda t: " ".join(map(str, t))),
    st.text(max_size=40),
    st.sampled_from(['# action addr size stream {"x": 1}', "# {", "#", "   ", "alloc 1 2", "alloc a b c"]),
)


def plain_values(leaf):
    return st.recursive(
        leaf,
        lambda kids: st.one_of(st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=8), kids, max_size=4)),
        max_leaves=12,
    )


leaf = st.one_of(st.none(), st.booleans(), ints, st.floats(allow_nan=True), st.text(max_size=10), st.binary(max_size=8))
event = st.fixed_dictionaries(
    {"action": st.sampled_from(ACTIONS)},
    optional={
        "addr": ints,
        "size": st.one_of(ints, leaf),
        "stream": ints,
        "device_free": st.one_of(ints, leaf),
        "frames": plain_values(leaf),
    },
)
# Most generated snapshots end in an OOM, so that the explain CLI's own reading
# of the segment and oom events is reached, not only the loader's.
oom_event = st.fixed_dictionaries(
    {"action": st.just("oom")}, optional={"size": st.one_of(ints, leaf), "device_free": st.one_of(ints, leaf)}
)
device_trace = st.tuples(st.lists(st.one_of(event, leaf), max_size=12), st.lists(oom_event, max_size=1)).map(
    lambda t: t[0] + t[1]
)
snapshot = st.one_of(
    st.fixed_dictionaries(
        {"device_traces": st.lists(device_trace, max_size=3)},
        optional={
            "segments": st.one_of(st.lists(plain_values(leaf), max_size=3), leaf),
            "allocator_settings": plain_values(leaf),
        },
    ),
    plain_values(leaf),
)


def write(tmp, name, data, compress):
    path = os.path.join(tmp, name + (".gz" if compress else ""))
    with gzip.open(path, "wb") if compress else open(path, "wb") as f:
        f.write(data)
    return path


FAST = settings(
    max_examples=max(60, settings.default.max_examples // 4),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


@FAST
@given(lines=st.lists(text_line, max_size=30), compress=st.booleans())
def test_text_traces(lines, compress):
    with tempfile.TemporaryDirectory() as tmp:
        check_input(write(tmp, "t.trace", "\n".join(lines).encode("utf-8", "surrogatepass"), compress))


@FAST
@given(obj=snapshot, compress=st.booleans(), protocol=st.integers(0, pickle.HIGHEST_PROTOCOL))
def test_snapshot_pickles(obj, compress, protocol):
    with tempfile.TemporaryDirectory() as tmp:
        check_input(write(tmp, "s.pickle", pickle.dumps(obj, protocol=protocol), compress))


def _seed_files():
    alloc = [{"action": "alloc", "addr": 4096 * i, "size": 1000 * (i + 1), "stream": 0} for i in range(6)]
    frees = [{"action": "free_completed", "addr": 4096 * i, "size": 1000 * (i + 1), "stream": 0} for i in range(3)]
    oom = [{"action": "oom", "size": 3 * MiB, "device_free": MiB}]
    snap = {"device_traces": [alloc + frees + oom], "segments": []}
    text = (
        "# action addr size stream {}\n"
        + "".join(f"alloc {4096 * i} {1000 * (i + 1)} 0\n" for i in range(6))
        + "".join(f"free_completed {4096 * i} {1000 * (i + 1)} 0\n" for i in range(3))
    )
    return [("s.pickle", pickle.dumps(snap, protocol=4)), ("t.trace", text.encode())]


SEEDS = _seed_files()


@FAST
@given(
    seed=st.sampled_from(range(len(SEEDS))),
    compress=st.booleans(),
    edits=st.lists(
        st.tuples(st.sampled_from(["flip", "cut", "dup", "ins"]), st.integers(0, 1 << 16), st.integers(0, 255)),
        min_size=1,
        max_size=6,
    ),
)
def test_mutated_files(seed, compress, edits):
    name, data = SEEDS[seed]
    with tempfile.TemporaryDirectory() as tmp:
        check_input(write(tmp, name, mutate(bytearray(data), edits), compress))


def mutate(data, edits):
    for op, pos, byte in edits:
        if not data:
            data = bytearray([byte])
        i = pos % len(data)
        if op == "flip":
            data[i] ^= byte or 1
        elif op == "cut":
            del data[i:]
        elif op == "dup":
            data[i:i] = data[i : i + 1 + byte % 16]
        else:
            data.insert(i, byte)
    return bytes(data)


# Found by this file's fuzzing; each crashed the explain CLI with a traceback.
FOUND = [
    ({"device_traces": [[{"action": "segment_alloc", "size": "x"}, {"action": "oom", "size": 5}]]}, "size is str"),
    ({"device_traces": [[{"action": "segment_alloc"}, {"action": "oom", "size": 5}]]}, "size is NoneType"),
    ({"device_traces": [[{"action": "oom"}]]}, "size is NoneType"),
    ({"device_traces": [[{"action": "oom", "size": 5, "device_free": "a"}]]}, "device_free is str"),
    ({"device_traces": [[{"action": "oom", "size": 5}]], "segments": 3}, "segments is not a list of dicts"),
    ({"device_traces": [[{"action": "oom", "size": 5}]], "segments": [1]}, "segments is not a list of dicts"),
    ({"device_traces": [[{"action": "oom", "size": 1 << 80}]]}, "not a 64-bit unsigned value"),
    ({"device_traces": [[{"action": "oom", "size": 1 << 60}]]}, "larger than any allocation"),
    ({"device_traces": [[{"action": "oom", "size": 5}]]}, "leaves no capacity to judge against"),
    ({"device_traces": [[{"action": "alloc", "addr": 1, "size": 1 << 62, "stream": 0}]]}, "larger than any allocation"),
]


@pytest.mark.parametrize("action", TRACE_ACTIONS)
def test_every_trace_action_loads_and_only_alloc_and_free_replay(tmp_path, action):
    """Each action gpumem.trace lists is read, in text and in a snapshot; only
    alloc and free_completed become replay events; an unknown action is refused."""
    addr = 8192 if action == "alloc" else 4096  # a second alloc needs its own address
    text = tmp_path / "one.trace"
    text.write_text(f"alloc 4096 512 0\n{action} {addr} 512 0\n")
    snap = tmp_path / "one.pickle"
    events = [dict(action="alloc", addr=4096, size=512, stream=0), dict(action=action, addr=addr, size=512, stream=0)]
    snap.write_bytes(pickle.dumps({"device_traces": [events]}))
    for path in (text, snap):
        tr = load_trace(path)
        assert (tr.allocs, tr.frees) == (1 + (action == "alloc"), int(action == "free_completed")), (path, action)
        assert tr.n_events == tr.allocs + tr.frees
    text.write_text("alloc 4096 512 0\nboom 4096 512 0\n")
    with pytest.raises(TraceError, match="boom"):
        load_trace(text)


def test_pickle_error_messages_stay_on_one_line(tmp_path):
    """Found by the offline run: pickle's persistent-id error spans two lines."""
    path = tmp_path / "pid.pickle"
    path.write_bytes(b"\x80\x04P0\n.")  # PERSID opcode, no persistent_load
    with pytest.raises(TraceError) as exc:
        load_trace(path)
    assert "\n" not in str(exc.value) and "persistent" in str(exc.value)
    assert check_input(path) == "rejected"


@pytest.mark.parametrize("obj,message", FOUND)
def test_found_inputs_get_one_error_line(tmp_path, obj, message):
    path = tmp_path / "found.pickle"
    path.write_bytes(pickle.dumps(obj))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["explain", str(path)]) == 2
    (line,) = err.getvalue().splitlines()
    assert line.startswith(f"gpumem: error: {path}") and message in line, line


def test_pickle_that_would_run_code_is_refused(tmp_path):
    """A pickle whose loading would call os.system is refused before anything
    runs, by the loader and by the explain CLI."""
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    for name in ("evil.pickle", "evil.pickle.gz"):
        path = tmp_path / name
        data = pickle.dumps({"device_traces": [[Evil()]]})
        path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
        with pytest.raises(TraceError, match="only plain data is accepted"):
            load_trace(path)
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert cli.main(["explain", str(path)]) == 2
        assert "only plain data is accepted" in err.getvalue()
        assert not marker.exists(), "the pickle ran code"


# ---- the offline run ----------------------------------------------------------------------


def test_offline_fuzz(traces_or_none, capsys):
    """A mutation loop over real and generated files; a couple of seconds in
    the suite, GPUMEM_FUZZ_SECONDS long offline."""
    budget = float(os.environ.get("GPUMEM_FUZZ_SECONDS", "2"))
    out_dir = os.environ.get("GPUMEM_FUZZ_OUT") or tempfile.mkdtemp(prefix="gpumem-fuzz-")
    rng = random.Random(int(os.environ.get("GPUMEM_FUZZ_SEED", "1")))
    seeds = list(SEEDS)
    if traces_or_none is not None:
        # The small recorded traces, cut to their first 200 lines so that each
        # input replays in milliseconds.
        for p in sorted(traces_or_none.glob("*.trace.gz")):
            with gzip.open(p, "rb") as f:
                head = b"".join(f.readline() for _ in range(200))
            seeds.append((p.name[:-3], head))
    tried, crashes, outcomes = 0, [], {"loaded": 0, "rejected": 0}
    t_end = time.monotonic() + budget
    with tempfile.TemporaryDirectory() as tmp:
        while time.monotonic() < t_end:
            name, data = rng.choice(seeds)
            edits = [
                (rng.choice(["flip", "cut", "dup", "ins"]), rng.randrange(1 << 16), rng.randrange(256))
                for _ in range(rng.randint(1, 8))
            ]
            blob = mutate(bytearray(data), edits)
            path = write(tmp, name, blob, rng.random() < 0.3)
            tried += 1
            try:
                outcomes[check_input(path)] += 1
            except Crash as e:
                keep = os.path.join(out_dir, f"crash-{len(crashes):03d}-{os.path.basename(path)}")
                with open(keep, "wb") as f, open(path, "rb") as src:
                    f.write(src.read())
                crashes.append((keep, str(e).splitlines()[-1]))
    with capsys.disabled():
        print(
            f"\nhostile-input fuzz: {tried} inputs in {budget:.0f}s ({outcomes['loaded']} loaded, "
            f"{outcomes['rejected']} rejected with TraceError), {len(crashes)} crashes"
            + (f"; saved under {out_dir}" if crashes else "")
        )
    assert tried > 0
    assert not crashes, crashes[:5]


@pytest.fixture
def traces_or_none():
    from helpers import traces_dir

    d = traces_dir()
    return d if d.is_dir() else None


# ---- names users control, in the offline HTML ---------------------------------------------

EVIL = '<script>alert("x")</script>'


def _evil_allocator():
    """A function whose file name and function name both hold a script tag,
    as a user's own code may (any string can be a code object's name)."""
    src = "def f(h, n):\n    return h.malloc(n)\n"
    ns = {}
    exec(compile(src, f"/tmp/{EVIL}.py", "exec"), ns)
    f = ns["f"]
    f.__code__ = f.__code__.replace(co_name=f"alloc{EVIL}")
    return f


def _assert_escaped(page, must_show):
    assert "<script" not in page.lower(), "a user-controlled name reached the HTML unescaped"
    for text in must_show:
        assert html_escape(text) in page, f"{text!r} is missing from the page (escaped)"


def html_escape(s):
    import html

    return html.escape(s, quote=True)


def test_html_escapes_file_and_function_names(make_heap, tmp_path):
    h = make_heap(capacity=256 * MiB)
    gpumem.record_history(True, device=h, stacks="python", max_entries=100)
    try:
        alloc = _evil_allocator()
        keep = [alloc(h, 3 * MiB), alloc(h, 5000)]
        snap = gpumem.snapshot(h)
        assert any(EVIL in b.site for b in snap.blocks if b.state == "live")
        page = snap.to_html(tmp_path / "s.html", title=f"run {EVIL}")
        _assert_escaped(page, [f"/tmp/{EVIL}.py", f"alloc{EVIL}", f"run {EVIL}"])
        assert (tmp_path / "s.html").read_text() == page
        _assert_escaped(snap._repr_html_(), [f"alloc{EVIL}"])
        _assert_escaped(snap.to_svg(), [f"alloc{EVIL}"])
        for p in keep:
            h.free(p)
    finally:
        gpumem.record_history(False, device=h)


def test_html_escapes_the_trace_name(tmp_path):
    """`gpumem replay TRACE --html` labels the page with the trace's name."""
    d = tmp_path / EVIL.replace("/", "_")
    d.mkdir()
    trace = d / f"{EVIL.replace('/', '_')}.trace"
    trace.write_text("alloc 4096 3000000 0\nalloc 8388608 5000 0\nfree_completed 4096 3000000 0\n")
    out = tmp_path / "o.html"
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["replay", str(trace), "--html", str(out), "--capacity", "64MiB"]) == 0
    page = out.read_text()
    _assert_escaped(page, [EVIL.replace("/", "_")])
