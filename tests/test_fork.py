"""fork() and process exit with heaps in use.

A DataLoader worker is a fork()ed child of a training process whose other
threads may be inside the allocator at that moment.  The child never touches
CUDA, but it may free tensors it inherited and it exits through the
interpreter's finalization: neither may hang on a lock held by a thread that
does not exist in the child.  Each scenario runs in its own interpreter, so a
hang is a timeout of that process and never of the test run.
"""

import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PRELUDE = textwrap.dedent("""
    import os, sys, threading, time
    sys.path.insert(0, {repo!r})
    import gpumem
    from gpumem.trace import load_trace

    MiB = 1 << 20

    def busy_trace(path, n=20000):
        # alloc/free pairs of assorted sizes: a replay of it runs in C with the
        # GIL released, taking and dropping the heap lock all the time
        with open(path, "w") as f:
            for i in range(n):
                addr = 4096 * (i % 64 + 1)
                f.write(f"alloc {{addr}} {{(i * 7919) % (3 * MiB) + 1}} 0\\n")
                if i % 64 == 63:
                    for k in range(64):
                        f.write(f"free_completed {{4096 * (k + 1)}} 0 0\\n")
            for k in range(n % 64):  # the last window too: a replay leaves nothing live
                f.write(f"free_completed {{4096 * (k + 1)}} 0 0\\n")
        return load_trace(path)
""")


def run_script(body, tmp_path, timeout=120):
    script = tmp_path / "scenario.py"
    script.write_text(PRELUDE.format(repo=REPO) + textwrap.dedent(body))
    try:
        return subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path)
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the scenario hung (killed after {timeout}s); output so far: {exc.stdout!r} {exc.stderr!r}")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_fork_while_another_thread_is_in_the_heap(tmp_path):
    r = run_script(
        """
        h = gpumem.Heap(device="sim", capacity=1 << 30)
        gpumem.record_history(True, device=h, stacks="python", max_entries=10000)
        inherited = [h.malloc(MiB) for _ in range(4)]
        tr = busy_trace("busy.trace")
        stop = threading.Event()
        replays = [0]

        def hammer():
            while not stop.is_set():
                h.replay(tr.events, tr.n_slots)
                replays[0] += 1

        t = threading.Thread(target=hammer)
        t.start()
        while replays[0] == 0:
            time.sleep(0.001)
        hung = 0
        for i in range(25):
            time.sleep(0.003 * (i % 5))
            pid = os.fork()
            if pid == 0:
                # The child: frees what it inherited, reads stats, checks, and
                # exits through finalization -- never touching a device.
                # (faulthandler's alarm turns a hang into exit 86, so that
                # the parent can tell a deadlock from a crash.)
                import faulthandler
                faulthandler.dump_traceback_later(10, exit=True)
                try:
                    for p in inherited:
                        h.free(p)
                    st = h.stats()
                    assert st["allocation.all.current"] >= 0
                    q = h.malloc(3 * MiB)
                    h.free(q)
                    h.check()
                except BaseException as e:
                    print("child failed:", repr(e), flush=True)
                    os._exit(3)
                sys.exit(0)
            deadline = time.monotonic() + 15
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    status = -1
                    break
                time.sleep(0.005)
            if status != 0:
                print(f"fork {i}: child status {status}", flush=True)
                hung += 1
                break  # one is enough; the rest would only wait as long
        stop.set()
        t.join()
        for p in inherited:
            h.free(p)
        h.check()
        print(f"forks ok: {i + 1 - hung} of 25, parent replays {replays[0]}", flush=True)
        sys.exit(1 if hung else 0)
    """,
        tmp_path,
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "forks ok: 25 of 25" in r.stdout, r.stdout


def test_exit_with_live_blocks_history_and_busy_threads(tmp_path):
    """The interpreter exits while heaps hold live blocks, history with Python
    stacks is on, and daemon threads are still inside the allocator."""
    r = run_script(
        """
        heaps = [gpumem.Heap(device="sim", capacity=1 << 30) for _ in range(2)]
        for h in heaps:
            gpumem.record_history(True, device=h, stacks="python", max_entries=1000)
        live = [h.malloc(5 * MiB) for h in heaps for _ in range(8)]
        tr = busy_trace("busy.trace", 5000)

        def hammer(h):
            while True:
                h.replay(tr.events, tr.n_slots)
                p = h.malloc(MiB)
                h.free(p)

        for h in heaps:
            for _ in range(2):
                threading.Thread(target=hammer, args=(h,), daemon=True).start()
        time.sleep(0.3)
        print("exiting", flush=True)
        sys.exit(0)
    """,
        tmp_path,
        timeout=60,
    )
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "exiting" and r.stderr == "", (r.stdout, r.stderr)
