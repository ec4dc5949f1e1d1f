"""Careless input at the command line: every failure of `python -m gpumem ...` and
`python -m gpumem.torch ...` is one line, "gpumem: error: ...", exit status 2, in
bounded memory; a traceback only when asked for (--debug, GPUMEM_DEBUG=1).
GPUMEM_CONF errors name the option and the value."""

import gzip
import os
import pathlib
import pickle
import subprocess
import sys

import pytest

import gpumem
from gpumem.__main__ import main
from gpumem.torch._install import normalize_options, parse_conf

from helpers import REPO

PKG_PARENT = str(pathlib.Path(gpumem.__file__).resolve().parent.parent)


def run(module, *args, env_extra=None, cwd=None, python_args=()):
    """Run `python -m MODULE ARGS` in a child, importing the very gpumem under test."""
    env = {k: v for k, v in os.environ.items() if k not in ("GPUMEM_CONF", "GPUMEM_DEBUG")}
    env["PYTHONPATH"] = PKG_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, *python_args, "-m", module, *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=str(cwd or REPO),
        timeout=300,
    )


def assert_one_line(p, fragment):
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr, p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpumem: error: "), p.stderr
    assert fragment in lines[0], lines[0]


def snapshot_file(path, events):
    path.write_bytes(pickle.dumps({"device_traces": [events]}))
    return path


def bad_files(tmp_path):
    """(path, fragment of the one error line) for inputs that once crashed, hung or replayed as nothing."""
    empty = tmp_path / "empty.trace"
    empty.write_bytes(b"")
    empty_pickle = tmp_path / "empty.pickle"
    empty_pickle.write_bytes(b"")
    empty_gz = tmp_path / "empty.trace.gz"
    empty_gz.write_bytes(gzip.compress(b""))
    comments = tmp_path / "comments.trace"
    comments.write_text("# action addr size stream\n\n")
    long_line = tmp_path / "long.trace.gz"
    long_line.write_bytes(gzip.compress(b"alloc" + b" " * (3 << 20)))
    unhashable = snapshot_file(tmp_path / "unhashable.pickle", [{"action": ["alloc"], "addr": 1, "size": 1}])
    any_stream = tmp_path / "any_stream.trace"
    any_stream.write_text(f"alloc 4096 512 {(1 << 64) - 1}\n")
    return [
        (empty, "empty file"),
        (empty_pickle, "empty file"),
        (empty_gz, "empty file"),
        (comments, "no allocations"),
        (long_line, ":1: not a trace: a line longer than"),
        (unhashable, "action is list, not str"),
        (any_stream, "is not a stream id"),
    ]


def test_bad_files_are_one_line(tmp_path, capsys):
    for path, fragment in bad_files(tmp_path):
        assert main(["replay", str(path), "--no-timing"]) == 2, path
        out, err = capsys.readouterr()
        assert out == ""
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"gpumem: error: {path}"), err
        assert fragment in lines[0], lines[0]


def test_a_deeply_nested_header_is_ignored(tmp_path):
    """The header's JSON is optional metadata: nesting too deep for json is no metadata."""
    path = tmp_path / "nested.trace"
    header = '# action addr size stream {"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path.write_text(header + "\nalloc 4096 512 0\nfree_completed 4096 512 0\n")
    from gpumem.trace import load_trace

    t = load_trace(path)
    assert (t.allocs, t.frees, t.meta) == (1, 1, {})


def test_an_unreadable_file_is_one_line():
    if not os.path.exists("/proc/self/mem"):
        pytest.skip("no /proc/self/mem here")
    assert_one_line(run("gpumem", "replay", "/proc/self/mem"), "/proc/self/mem: cannot read")


def replay_measuring_memory(path):
    """`gpumem replay PATH` in a child; (CompletedProcess, the child's peak RSS in KiB).  The peak is
    the child's own VmHWM (ru_maxrss would carry over the parent's peak from before the exec)."""
    if not os.path.exists("/proc/self/status"):
        pytest.skip("no /proc/self/status here")
    code = (
        "import sys\n"
        "from gpumem.__main__ import main\n"
        "rc = main(['replay', sys.argv[1], '--no-timing'])\n"
        "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')][0])\n"
        "sys.exit(rc)\n"
    )
    env = dict(os.environ, PYTHONPATH=PKG_PARENT)
    p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env, timeout=300)
    return p, int(p.stdout)


def test_endless_input_is_refused_in_bounded_memory():
    """/dev/zero has no line end: refused at the line cap, not read until memory runs out."""
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    p, peak = replay_measuring_memory("/dev/zero")
    assert p.returncode == 2 and "line longer than" in p.stderr, p.stderr
    assert peak < 200 << 10, f"peak RSS {peak} KiB"


def test_a_gzip_bomb_line_is_refused_in_bounded_memory(tmp_path):
    """A few hundred KB of gzip that is one 100 MB line."""
    path = tmp_path / "bomb.trace.gz"
    with gzip.open(path, "wb", compresslevel=9) as f:
        f.write(b"alloc 1 ")
        for _ in range(100):
            f.write(b"9" * (1 << 20))
    assert path.stat().st_size < 1 << 20
    p, peak = replay_measuring_memory(path)
    assert p.returncode == 2 and "line longer than" in p.stderr, p.stderr
    assert peak < 200 << 10, f"peak RSS {peak} KiB"


@pytest.mark.parametrize(
    "args,fragment",
    [
        (["replay", "seed_fragmentation", "--capacity", "1e30"], "does not fit in 64 bits"),
        (["replay", "seed_fragmentation", "--capacity", "16000000TB"], "more than the simulated device holds"),
        (["explain", "sample_snapshot", "--capacity", "1e30"], "does not fit in 64 bits"),
        (["replay", "seed_fragmentation", "--snapshot", "no/such/folder/out.pickle"], "no such folder"),
        (["replay", "seed_fragmentation", "--html", "."], "is a directory"),
        (["replay", "seed_fragmentation", "--page-size", "2PiB"], "larger than the device"),
        (["replay", "seed_fragmentation", "--page-size", "2GiB", "--capacity", "1GiB"], "larger than the device"),
    ],
)
def test_bad_arguments_are_one_line(args, fragment, capsys):
    assert main(args) == 2
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == "" and len(lines) == 1 and lines[0].startswith("gpumem: error: ") and fragment in lines[0], err


def test_explain_segments_past_64_bits(tmp_path, capsys):
    huge = (1 << 64) - 1
    path = snapshot_file(
        tmp_path / "segs.pickle",
        [
            {"action": "segment_alloc", "addr": 0, "size": huge},
            {"action": "segment_alloc", "addr": 1, "size": huge},
            {"action": "alloc", "addr": 4096, "size": 512, "stream": 0},
            {"action": "oom", "size": 512, "device_free": 0},
        ],
    )
    assert main(["explain", str(path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "more than the simulated device holds" in line and "give --capacity" in line, line


def test_an_unexpected_failure_is_one_line_and_debug_shows_the_traceback():
    """A failure no check foresaw (here: a subcommand whose run is not callable) is still one
    line, naming the exception; --debug and GPUMEM_DEBUG=1 show where it came from."""
    code = "import gpumem.cli as m; m.COMMANDS['replay'] = ('', m.replay.add_replay_args, 1)"
    env = {"PYTHONPATH": PKG_PARENT}
    cases = (({}, [], []), ({"GPUMEM_DEBUG": "1"}, [], []), ({}, ["--debug"], []), ({}, [], ["--debug"]))
    for debug_env, flags, after in cases:
        argv = flags + ["replay", "x"] + after
        p = subprocess.run(
            [sys.executable, "-c", code + f"; import sys; sys.exit(m.main({argv!r}))"],
            capture_output=True,
            text=True,
            env=dict(os.environ, **env, **debug_env),
            timeout=300,
        )
        if debug_env or flags or after:
            assert p.returncode == 1 and "Traceback" in p.stderr and "TypeError" in p.stderr, p.stderr
        else:
            assert_one_line(p, "TypeError")
            assert "GPUMEM_DEBUG=1" in p.stderr


# ---- GPUMEM_CONF -------------------------------------------------------------------


@pytest.mark.parametrize(
    "conf,fragments",
    [
        ("growth_slack:abc", ["growth_slack='abc'", "not a number"]),
        ("history:1e3", ["history='1e3'", "not a whole number"]),
        ("chunk_pages:many", ["chunk_pages='many'", "not a whole number"]),
        ("cap:1.5", ["cap='1.5'", "ambiguous"]),
        ("cap:100", ["cap='100'", "ambiguous"]),
        ("cap:16385PiB", ["cap='16385PiB'", "does not fit in 64 bits"]),
        ("va_size:1e40", ["va_size='1e40'"]),
        ("page_size:3MiB", ["page_size='3MiB'", "power of two"]),
        ("cap:1GiB,cap:2GiB", ["cap given twice", "cap:1GiB", "cap:2GiB"]),
        ("cap", ["expected key:value", "'cap'"]),
        ("colour:blue", ["unknown option 'colour'", "colour:blue"]),
    ],
)
def test_conf_errors_name_the_option_and_value(conf, fragments):
    with pytest.raises(ValueError) as e:
        normalize_options(parse_conf(conf))
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)


def test_conf_sizes_and_fractions():
    assert normalize_options(parse_conf("cap:0.5"))["cap_fraction"] == 0.5
    assert normalize_options(parse_conf("cap:1"))["cap_fraction"] == 1.0
    assert normalize_options(parse_conf("cap:3GiB"))["cap_bytes"] == 3 << 30
    assert normalize_options(parse_conf("cap:3221225472B"))["cap_bytes"] == 3 << 30
    assert normalize_options({"cap": 3 << 30})["cap_bytes"] == 3 << 30  # an int keyword is bytes
    assert normalize_options(parse_conf("cap:16383PiB"))["cap_bytes"] == 16383 << 50
    with pytest.raises(ValueError, match="64 bits"):
        normalize_options({"cap": 1 << 64})
    with pytest.raises(ValueError, match="too long|more than"):
        parse_conf("cap:1GiB," * 1000)


@pytest.mark.parametrize(
    "conf,fragment",
    [
        ("growth_slack:abc", "GPUMEM_CONF: option growth_slack='abc': not a number"),
        ("cap:1.5", "GPUMEM_CONF: option cap='1.5': ambiguous"),
        ("history:1,history:2", "GPUMEM_CONF: option history given twice"),
    ],
)
def test_torch_runner_conf_errors_are_one_line(tmp_path, conf, fragment):
    """GPUMEM_CONF is read before torch is imported: the same line with or without torch and a GPU."""
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    p = run("gpumem.torch", script, env_extra={"GPUMEM_CONF": conf})
    assert_one_line(p, fragment)
    assert "ran" not in p.stdout


def test_gpumem_disable_leaves_torchs_allocator_alone_and_says_so_once(tmp_path):
    """GPUMEM_DISABLE=1 turns gpumem off without editing the script: install() (here twice, and
    once more by the runner) neither reads the options nor touches torch, and says so on one line."""
    script = tmp_path / "train.py"
    script.write_text(
        "import sys, gpumem\n"
        "st = [gpumem.install(cap='1.5'), gpumem.install()][-1]\n"
        "print('ran', st['installed'], st['disabled'], st['patched'], 'torch' in sys.modules)\n"
        "try:\n"
        "    gpumem.torch_allocator()\n"
        "except gpumem.InstallError as e:\n"
        "    print('refused:', e)\n"
    )
    off = {"GPUMEM_DISABLE": "1", "GPUMEM_CONF": "cap:1.5"}
    for argv in ((script,), ("gpumem.torch", script)):
        p = subprocess.run(
            [sys.executable, *(["-m"] if len(argv) == 2 else []), *map(str, argv)],
            capture_output=True,
            text=True,
            env=dict(os.environ, PYTHONPATH=PKG_PARENT, **off),
            timeout=300,
        )
        assert p.returncode == 0, p.stderr
        assert p.stderr == "gpumem: GPUMEM_DISABLE=1: not installed; torch's own CUDA allocator is in use\n"
        assert "ran False True [] False" in p.stdout, p.stdout
        assert "refused: gpumem.torch_allocator(): GPUMEM_DISABLE=1 is set" in p.stdout, p.stdout
    assert_one_line(run("gpumem.torch", script, env_extra={"GPUMEM_DISABLE": "yes"}), "GPUMEM_DISABLE='yes'")


def test_torch_runner_missing_script_is_one_line(tmp_path):
    assert_one_line(run("gpumem.torch", tmp_path / "nope.py"), "nope.py: no such script")
    assert_one_line(run("gpumem.torch", tmp_path), "is a directory, not a script")


def test_torch_runner_without_a_gpu_is_one_line(tmp_path):
    """No torch, or torch and no CUDA device: either way one line, and the script does not run."""
    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    p = run("gpumem.torch", script)
    try:
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is present: install() succeeds here")
        fragment = "no CUDA device"
    except ImportError:
        fragment = "needs PyTorch"
    assert_one_line(p, fragment)
    assert "ran" not in p.stdout
    p = run("gpumem.torch", "--debug", script)
    assert p.returncode == 1 and "Traceback" in p.stderr and "InstallError" in p.stderr, p.stderr
