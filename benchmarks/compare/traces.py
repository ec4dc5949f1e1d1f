"""Shared traces, packed for a tight torch.empty/del replay loop.

The text format is described in gpumem/data/traces/README.md: ``action addr size stream`` per line.
Only ``alloc`` and ``free_completed`` change which blocks are live (a block is reusable once
its free has completed; ``segment_*`` is what the native allocator asked of the driver and an
allocator under test must not copy).  Frees are paired with their alloc by address and each
alloc gets a slot, reused once freed, so the replay keeps tensors in a list as small as the
most blocks ever live at once.

Parsing a 700k-line trace takes about a second of Python, so the orchestrator parses each
trace once and writes a binary cache that workers load in milliseconds.
"""

from __future__ import annotations

import gzip
import json
import os
import sys
from array import array
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

OP_ALLOC = 0
OP_FREE = 1
WORDS_PER_EVENT = 4  # op, slot, size, stream index

try:
    from gpumem.trace import IGNORED_ACTIONS, _parse_meta
except ImportError:  # gpumem not installed: this checkout's (gpumem.trace needs no compiled part)
    sys.path.append(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from gpumem.trace import IGNORED_ACTIONS, _parse_meta

_IGNORED = frozenset(IGNORED_ACTIONS)


class TraceFormatError(ValueError):
    """A trace that cannot be replayed; the message names the file and line."""


@dataclass
class PackedTrace:
    name: str
    path: str
    words: array  # 'q', WORDS_PER_EVENT per event
    n_slots: int
    allocs: int
    frees: int
    peak_live: int  # largest sum of live sizes: no allocator can do with less
    peak_event: int  # index of the event at which live first reached peak_live
    streams: List[int]  # trace stream handle for each stream index (index 0 is the first seen)
    meta: dict = field(default_factory=dict)

    @property
    def n_events(self) -> int:
        return len(self.words) // WORDS_PER_EVENT

    def events(self) -> List[Tuple[int, int, int, int]]:
        """(op, slot, size, stream index) tuples; a list, because the replay loop iterates it
        many times and tuple unpacking of a list is the cheapest loop Python has."""
        w = self.words
        return [tuple(w[i : i + WORDS_PER_EVENT]) for i in range(0, len(w), WORDS_PER_EVENT)]

    def summary(self) -> dict:
        return {
            "name": self.name,
            "events": self.n_events,
            "allocs": self.allocs,
            "frees": self.frees,
            "n_slots": self.n_slots,
            "peak_live": self.peak_live,
            "peak_event": self.peak_event,
            "streams": len(self.streams),
            "native": {k: self.meta[k] for k in ("peak_allocated", "peak_reserved") if k in self.meta},
        }


def trace_name(path: str) -> str:
    base = os.path.basename(path)
    for suffix in (".gz", ".trace"):
        if base.endswith(suffix):
            base = base[: -len(suffix)]
    return base


def parse_lines(lines, path: str = "<trace>") -> PackedTrace:
    words = array("q")
    live: Dict[int, Tuple[int, int]] = {}  # addr -> (slot, size)
    spare: List[int] = []
    n_slots = allocs = frees = 0
    live_bytes = peak = 0
    peak_event = -1
    stream_index: Dict[int, int] = {}
    meta: dict = {}
    n = 0
    for lineno, line in enumerate(lines, 1):
        parts = line.split()
        if not parts:
            continue
        if parts[0].startswith("#"):
            if lineno == 1:
                meta = _parse_meta(line)
            continue
        if len(parts) != 4:
            raise TraceFormatError(f"{path}:{lineno}: expected 'action addr size stream', got {line.strip()[:60]!r}")
        action = parts[0]
        if action in _IGNORED:
            continue
        try:
            addr, size, stream = int(parts[1]), int(parts[2]), int(parts[3])
        except ValueError:
            raise TraceFormatError(f"{path}:{lineno}: addr, size and stream must be integers") from None
        if size < 0 or stream < 0:
            raise TraceFormatError(f"{path}:{lineno}: negative size or stream")
        if action == "alloc":
            if addr in live:
                raise TraceFormatError(f"{path}:{lineno}: alloc at {addr:#x}, which is still live")
            slot = spare.pop() if spare else n_slots
            if slot == n_slots:
                n_slots += 1
            si = stream_index.setdefault(stream, len(stream_index))
            live[addr] = (slot, size)
            words.extend((OP_ALLOC, slot, size, si))
            allocs += 1
            live_bytes += size
            if live_bytes > peak:
                peak, peak_event = live_bytes, n
        elif action == "free_completed":
            entry = live.pop(addr, None)
            if entry is None:
                raise TraceFormatError(f"{path}:{lineno}: free of unknown address {addr:#x}")
            slot, size = entry
            spare.append(slot)
            words.extend((OP_FREE, slot, size, 0))
            frees += 1
            live_bytes -= size
        else:
            raise TraceFormatError(f"{path}:{lineno}: unknown action {action!r}")
        n += 1
    streams = [s for s, _ in sorted(stream_index.items(), key=lambda kv: kv[1])]
    return PackedTrace(trace_name(path), path, words, n_slots, allocs, frees, peak, peak_event, streams, meta)


def load_text_trace(path: str) -> PackedTrace:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            return parse_lines(f, path)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{path}: cannot read: {e}") from None


def find_traces(directory: str, only: Optional[List[str]] = None) -> List[str]:
    """The *.trace[.gz] files of `directory`, smallest first (cheap ones give early results),
    optionally restricted to the names in `only` (unknown names are an error)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"traces directory {directory!r} does not exist")
    paths = [os.path.join(directory, f) for f in os.listdir(directory) if f.endswith((".trace.gz", ".trace"))]
    if only:
        names = {trace_name(p): p for p in paths}
        missing = [n for n in only if n not in names]
        if missing:
            raise FileNotFoundError(
                f"no trace named {', '.join(missing)} in {directory} (have: {', '.join(sorted(names))})"
            )
        paths = [names[n] for n in only]
    return sorted(paths, key=lambda p: (os.path.getsize(p), p))


# ---- binary cache (orchestrator writes, workers read) ------------------------------------------


def save_packed(trace: PackedTrace, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, trace.name)
    words = trace.words
    if sys.byteorder != "little":
        words = array("q", words)
        words.byteswap()
    with open(base + ".bin.tmp", "wb") as f:
        words.tofile(f)
    os.replace(base + ".bin.tmp", base + ".bin")
    header = {
        "name": trace.name,
        "path": trace.path,
        "n_slots": trace.n_slots,
        "allocs": trace.allocs,
        "frees": trace.frees,
        "peak_live": trace.peak_live,
        "peak_event": trace.peak_event,
        "streams": trace.streams,
        "meta": trace.meta,
        "words": len(trace.words),
    }
    with open(base + ".json", "w") as f:
        json.dump(header, f)
    return base


def load_packed(base: str) -> PackedTrace:
    with open(base + ".json") as f:
        h = json.load(f)
    words = array("q")
    with open(base + ".bin", "rb") as f:
        words.fromfile(f, h["words"])
    if sys.byteorder != "little":
        words.byteswap()
    return PackedTrace(
        h["name"],
        h["path"],
        words,
        h["n_slots"],
        h["allocs"],
        h["frees"],
        h["peak_live"],
        h["peak_event"],
        h["streams"],
        h.get("meta", {}),
    )
