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

from helpers import REPO as _REPO, TORCH_BOUNDARY, needs_test_hooks

REPO = str(_REPO)

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

    def keep_busy(work):
        # Run work() over and over in another thread; returns, once it has run
        # once, a function that stops the thread and gives how often it ran.
        stop, runs = threading.Event(), [0]

        def loop():
            while not stop.is_set():
                work()
                runs[0] += 1

        t = threading.Thread(target=loop)
        t.start()
        while runs[0] == 0:
            time.sleep(0.001)

        def finish():
            stop.set()
            t.join()
            return runs[0]

        return finish

    def fork_child(body, wait=15):
        # Run body() in a fork()ed child that then exits through finalization;
        # return its exit status (-1: still running after `wait` s, killed).
        # faulthandler's alarm ends a child stuck in C (exit status 1), so
        # that even a deadlock there is reported rather than waited for.
        pid = os.fork()
        if pid == 0:
            import faulthandler
            faulthandler.dump_traceback_later(10, exit=True)
            try:
                body()
            except BaseException as e:
                print("child failed:", repr(e), flush=True)
                os._exit(3)
            sys.exit(0)
        deadline = time.monotonic() + wait
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                return -1
            time.sleep(0.005)
""")


def run_script(body, tmp_path, timeout=120, prelude=""):
    script = tmp_path / "scenario.py"
    script.write_text(PRELUDE.format(repo=REPO) + prelude + textwrap.dedent(body))
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
        finish = keep_busy(lambda: h.replay(tr.events, tr.n_slots))

        def child():
            # frees what it inherited, reads stats, checks, and exits through
            # finalization -- never touching a device
            for p in inherited:
                h.free(p)
            st = h.stats()
            assert st["allocation.all.current"] >= 0
            q = h.malloc(3 * MiB)
            h.free(q)
            h.check()

        hung = 0
        for i in range(25):
            time.sleep(0.003 * (i % 5))
            status = fork_child(child)
            if status != 0:
                print(f"fork {i}: child status {status}", flush=True)
                hung += 1
                break  # one is enough; the rest would only wait as long
        replays = finish()
        for p in inherited:
            h.free(p)
        h.check()
        print(f"forks ok: {i + 1 - hung} of 25, parent replays {replays}", flush=True)
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


# ---- the torch boundary (csrc/python/torch_alloc.cpp) ------------------------------------
# Driven through ctypes as torch drives it, over a simulated device on device 0.

BOUNDARY = (
    "from gpumem import _C\n"
    + TORCH_BOUNDARY
    + textwrap.dedent("""
    _C.registry_open_sim(0, 1 << 30)

    def use_the_boundary():
        # every path through one of the boundary's locks, and then the checker
        p = alloc(3 * MiB, 0, None)
        free(p, 3 * MiB, 0, None)
        # the device's slot lock: the OOM text, a memory fraction, a second open
        assert _C._torch_format_oom(0, 1 << 40).startswith("CUDA out of memory.")
        memory_fraction(0.9, 0)
        try:
            _C.registry_open_sim(0, 1 << 30)
            raise AssertionError("a second heap on device 0")
        except ValueError:
            pass
        # the options lock
        _C.registry_configure(cap_bytes=_C.registry_options()["cap_bytes"])
        # the device's pool lock: begin, a routed allocation, end
        assert begin(0, 5, 0, ANY) == 0
        q = alloc(MiB, 0, None)
        assert live((5, 0)) == {q} and _C._torch_active_pools(0) == [(5, 0)]
        free(q, MiB, 0, None)
        assert end(0, 5, 0) == 0 and release(0, 5, 0) == 0
        assert _C._torch_active_pools(0) == []
        _C.registry_heap(0).check()
""")
)


@needs_test_hooks
@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
@pytest.mark.parametrize("lock", ["slot", "options", "pools"])
def test_fork_while_another_thread_holds_a_torch_boundary_lock(tmp_path, lock):
    """A native thread holds one of the boundary's locks when the process
    forks: the child must still allocate, free, open, configure and route to
    pools (each takes one of those locks), and exit 0."""
    r = run_script(
        f"""
        inherited = [alloc(MiB, 0, None) for _ in range(4)]

        def child():
            for p in inherited:
                free(p, MiB, 0, None)
            use_the_boundary()

        statuses = []
        for i in range(3):
            _C._test_hold_boundary_lock({lock!r}, 0, 0.2)   # returns once the other thread holds it
            statuses.append(fork_child(child))
        use_the_boundary()   # and the parent got them all back
        for p in inherited:
            free(p, MiB, 0, None)
        _C.registry_heap(0).check()
        print("child statuses", statuses, flush=True)
        sys.exit(0 if statuses == [0, 0, 0] else 1)
    """,
        tmp_path,
        timeout=90,
        prelude=BOUNDARY,
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "child statuses [0, 0, 0]" in r.stdout, r.stdout


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_fork_while_a_pool_filter_waits_for_the_gil(tmp_path):
    """A pool's stream filter may be Python (a ctypes callback) that needs the
    GIL, which the thread calling os.fork() holds while fork runs: fork must
    not wait for a lock held around that filter (the parent would hang), and
    the child must not inherit that lock held (the child would hang)."""
    r = run_script(
        """
        def slow_filter(stream):
            time.sleep(0.002)   # drops the GIL inside the filter, letting the main thread fork
            return 1

        f = FILTER(slow_filter)
        assert begin(0, 1, 0, f) == 0

        def routed_alloc_free():
            p = alloc(MiB, 0, 7)
            free(p, MiB, 0, 7)

        finish = keep_busy(routed_alloc_free)

        def child():
            p = alloc(MiB, 0, 7)          # routed through the same filter, here in the child
            # the parent's thread may have been between its alloc and free at the fork
            assert p in live((1, 0)) and len(live((1, 0)) - {p}) <= 1
            free(p, MiB, 0, 7)
            assert _C._torch_active_pools(0) == [(1, 0)]
            _C.registry_heap(0).check()

        statuses = [fork_child(child) for _ in range(10)]
        routed = finish()
        assert end(0, 1, 0) == 0 and release(0, 1, 0) == 0
        use_the_boundary()
        print("child statuses", statuses, "routed", routed > 0, flush=True)
        sys.exit(0 if statuses == [0] * 10 else 1)
    """,
        tmp_path,
        timeout=90,
        prelude=BOUNDARY,
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert f"child statuses {[0] * 10} routed True" in r.stdout, r.stdout


def test_exit_with_live_torch_blocks_history_and_busy_threads(tmp_path):
    """The interpreter exits while the torch boundary's heap holds live blocks
    with history (and Python stacks) on, a pool is active and daemon threads
    are inside the boundary."""
    r = run_script(
        """
        _C.registry_history_enable(1000)
        _C._stacks_enable(True)
        _C._torch_stack_hook(True)   # as gpumem.torch does
        live_blocks = [alloc(5 * MiB, 0, None) for _ in range(8)]
        assert begin(0, 3, 0, ANY) == 0

        def hammer(stream):
            while True:
                p = alloc(MiB, 0, stream)
                free(p, MiB, 0, stream)
                _C._torch_format_oom(0, 1 << 40)

        for s in (0, 7, 9):
            threading.Thread(target=hammer, args=(s,), daemon=True).start()
        time.sleep(0.3)
        assert _C.registry_heap(0).history()[0], "history recorded nothing"
        print("exiting", flush=True)
        sys.exit(0)
    """,
        tmp_path,
        timeout=60,
        prelude=BOUNDARY,
    )
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.strip() == "exiting" and r.stderr == "", (r.stdout, r.stderr)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_fork_while_another_thread_holds_the_frameworks_lock(tmp_path):
    """gpumem._frameworks keeps which frameworks share the per-device heaps
    under a Python lock: a child forked while another thread holds it must
    still mark a framework installed."""
    r = run_script(
        """
        from gpumem import _frameworks
        held, done = threading.Event(), threading.Event()

        def holder():
            with _frameworks._lock:
                held.set()
                done.wait()

        t = threading.Thread(target=holder)
        t.start()
        held.wait()

        def child():
            _frameworks.mark_installed("cupy")
            assert "cupy" in _frameworks.INSTALLED
            _frameworks.mark_uninstalled("cupy")

        status = fork_child(child)
        done.set()
        t.join()
        child()
        print("child status", status, flush=True)
        sys.exit(0 if status == 0 else 1)
    """,
        tmp_path,
        timeout=60,
    )
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "child status 0" in r.stdout, r.stdout
