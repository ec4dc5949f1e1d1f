"""What several benchmarks do alike: run one measurement in a fresh interpreter, write the results, and
print them as Markdown tables.

A benchmark that compares allocators measures each in a process of its own (an allocator is chosen once
a process): it runs itself with its own `--one ...` arguments, and the child prints its result as one
line of JSON, the last such line of its output.  The benchmarks import this module as `common`: the
folder of a script run as `python benchmarks/x.py` is first on sys.path.
"""

import gzip
import json
import os
import subprocess
import sys
from typing import Iterable, Optional, Sequence

# This checkout: what a child process imports gpumem from (with_checkout_path).
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The entries of torch's allocation history (torch.cuda.memory._snapshot()["device_traces"]) that a
# text trace keeps: what gpumem.trace reads.
TRACE_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc")


def last_json_line(text: str) -> Optional[dict]:
    """The last line of text that is a JSON object, decoded; None if there is none."""
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else None


def run_child(script: str, args: Sequence[str], what: str = "", **kw) -> Optional[dict]:
    """Run `python script *args` in a fresh interpreter and return the JSON object it printed last.

    A child that fails or prints none gives None, and its error output goes to stderr, headed by what
    (e.g. the workload and the allocator) when given.  kw goes to subprocess.run (env, timeout)."""
    p = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, **kw)
    result = last_json_line(p.stdout)
    if p.returncode or result is None:
        print(f"{what} failed (exit {p.returncode}):\n" if what else "", p.stderr[-3000:], sep="", file=sys.stderr)
        return None
    return result


def with_checkout_path(env=None, first: Optional[str] = None) -> dict:
    """A copy of `env` (default: os.environ) for a child process that imports this checkout's gpumem (built
    in place): PYTHONPATH is `first` (another build, say), this checkout, then what `env` held.  Empty
    entries are left out: one would put the child's working directory on its path."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [first, REPO, env.get("PYTHONPATH")]))
    return env


def write_json(path: Optional[str], obj) -> None:
    """Write obj to path as indented JSON (its folder made if need be) and say so; nothing if path is empty."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    print("wrote", path)


def start_torch_history(torch) -> None:
    """Turn on torch's allocation history as the traces here record it: every event, no context."""
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=20_000_000)


def stop_torch_history(torch) -> dict:
    """torch's snapshot, with the history since start_torch_history in its device_traces; the history off."""
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snap


def write_torch_trace(path: str, entries: Iterable[dict], note: str) -> int:
    """Write one device's entries of torch's allocation history as a gpumem text trace (gzip, as
    gpumem.trace reads it), headed by a comment that says where it comes from; how many it wrote."""
    n = 0
    with gzip.open(path, "wt", compresslevel=9) as f:
        f.write(f"# action addr size stream  ({note})\n")
        for e in entries:
            if e["action"] in TRACE_ACTIONS:
                f.write(f"{e['action']} {e['addr']} {e['size']} {int(e.get('stream', 0))}\n")
                n += 1
    return n


def markdown_row(cells: Iterable) -> str:
    """One row of a Markdown table: the cells, each as str() gives it, between bars."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def markdown_head(names: str) -> str:
    """A Markdown table's first two lines: the column names (separated by " | ", as the table shows
    them) between bars, and the rule under them."""
    return f"| {names} |\n|" + "---|" * (names.count(" | ") + 1)
