"""Allocation traces and a snapshot of real PyTorch workloads, shipped with gpumem.

The traces (``traces/*.trace.gz``) were recorded with PyTorch's own caching
allocator on an H100; ``traces/README.md`` beside them says how, gives their
format and the figures PyTorch's allocators reached on them.
``snapshots/sample_snapshot.pickle.gz`` is the torch memory snapshot of the
``seed_fragmentation`` run; ``snapshots/sim_oom.pickle.gz`` one that ends in an
out-of-memory error (made on the simulated device by tools/make_oom_snapshot.py).

    >>> from gpumem.data import trace_path, list_traces
    >>> list_traces()[:3]
    ['bert_varlen', 'gpt2_generate', 'gpt2_varlen']

``python -m gpumem replay gpt2_varlen`` takes these short names too.

The zoo (``zoo()``) is the traces whose header names a model family: real workloads of many families
(decoders, mixture of experts, encoders, encoder-decoders, speech, vision transformers, convolutional
networks, a diffusion UNet), each recorded in the mode its users run it by ``benchmarks/zoo.py``;
``docs/zoo.md`` is their catalog.
"""

from __future__ import annotations

import os
import pathlib
from typing import List

__all__ = [
    "DATA_DIR",
    "TRACES_DIR",
    "SNAPSHOTS_DIR",
    "UnknownDataError",
    "list_traces",
    "trace_path",
    "list_snapshots",
    "snapshot_path",
    "is_short_name",
    "trace_info",
    "zoo",
]

DATA_DIR = pathlib.Path(__file__).resolve().parent
TRACES_DIR = DATA_DIR / "traces"
SNAPSHOTS_DIR = DATA_DIR / "snapshots"

_TRACE_SUFFIX = ".trace.gz"
_SNAPSHOT_SUFFIX = ".pickle.gz"


class UnknownDataError(LookupError):
    """A short name that names no shipped trace or snapshot; str() is one line listing the known names."""


def _names(folder: pathlib.Path, suffix: str) -> List[str]:
    if not folder.is_dir():
        return []
    return sorted(p.name[: -len(suffix)] for p in folder.iterdir() if p.name.endswith(suffix))


def list_traces() -> List[str]:
    """Short names of the traces shipped with gpumem, sorted."""
    return _names(TRACES_DIR, _TRACE_SUFFIX)


def list_snapshots() -> List[str]:
    """Short names of the torch snapshots shipped with gpumem, sorted."""
    return _names(SNAPSHOTS_DIR, _SNAPSHOT_SUFFIX)


def _path(folder: pathlib.Path, suffix: str, name: str, kind: str, known: List[str]) -> pathlib.Path:
    name = os.fspath(name)
    for candidate in (name, name + suffix):
        p = folder / candidate
        if os.sep not in name and p.is_file():
            return p
    listed = ", ".join(known) if known else f"none: {folder} is missing"
    raise UnknownDataError(f"no {kind} named {name!r}; known {kind}s: {listed}")


def trace_path(name: str) -> pathlib.Path:
    """The file of the shipped trace `name` (e.g. "gpt2_varlen"); raises UnknownDataError."""
    return _path(TRACES_DIR, _TRACE_SUFFIX, name, "trace", list_traces())


def snapshot_path(name: str = "sample_snapshot") -> pathlib.Path:
    """The file of the shipped torch snapshot `name`; raises UnknownDataError."""
    return _path(SNAPSHOTS_DIR, _SNAPSHOT_SUFFIX, name, "snapshot", list_snapshots())


def is_short_name(arg) -> bool:
    """Whether a command-line argument reads as a short name rather than a path:
    no directory part and no file suffix."""
    s = os.fspath(arg)
    return bool(s) and os.sep not in s and "/" not in s and "." not in s


def trace_info(name: str) -> dict:
    """The JSON of the shipped trace `name`'s first line: what the recording run reported (peak
    allocated and reserved, allocations, streams) and, for the zoo, its family, mode, knob and what it
    exercises.  Reads only that line; raises UnknownDataError for an unknown name."""
    import gzip
    import json

    with gzip.open(trace_path(name), "rt") as f:
        first = f.readline()
    start, end = first.find("{"), first.rfind("}")
    info = json.loads(first[start : end + 1]) if 0 <= start < end else {}
    return info if isinstance(info, dict) else {}


def zoo() -> List[dict]:
    """The zoo: for each shipped trace recorded from a model family, its trace_info() with its short
    name under "name", sorted by family, then name."""
    rows = [dict(trace_info(n), name=n) for n in list_traces()]
    return sorted((r for r in rows if "family" in r), key=lambda r: (r["family"], r["name"]))
