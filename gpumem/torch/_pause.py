"""Pause and resume a private pool's physical memory under torch.

    pool = torch.cuda.MemPool()            # gpumem's MemPool once gpumem is installed
    with torch.cuda.use_mem_pool(pool):
        weights = load()                   # or: capture a CUDA graph into the pool
    ...
    gpumem.pause(pool, backup=True)        # pages released; addresses and pointers kept
    ...                                    # another engine uses the GPU memory
    gpumem.resume(pool)                    # same addresses, contents restored

The work is the core's (gm_pool_pause / gm_pool_resume, csrc/core/heap.c); this
module names the pool, checks the arguments and times the calls.  What touching
a paused tensor does, and the rest of the contract, is in docs/torch.md
("Pausing a pool").
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from . import _install, _pools

__all__ = ["PauseResult", "pause", "resume", "paused"]


@dataclass(frozen=True)
class PauseResult:
    """What one pause or resume did.

    pages / bytes: pages released by a pause, or mapped again by a resume.
    shared_pages: pages of the pool kept mapped because blocks outside the pool
    share them (a page is 2 MiB by default; a pool's small blocks can share one with
    other tensors).  backup_bytes: bytes copied to pinned host memory (pause)
    or back (resume); 0 without a backup.  seconds: time the call took.
    phases: where that time went, in seconds -- "sync" (the device wait
    before a pause), "pages" (getting physical pages for a resume), "copy"
    (the backup's host memory and copies), "map" (unmap and release, or map
    and set access).
    """

    pool: tuple
    device: int
    pages: int
    bytes: int
    shared_pages: int
    backup_bytes: int
    seconds: float
    phases: dict


def _pool_and_device(pool, device):
    """(id, device) for a gpumem/torch MemPool, a graph pool id (a pair of ints,
    as CUDAGraph.pool() gives), or anything with an ``id`` pair."""
    pid = getattr(pool, "id", pool)
    if callable(pid):  # torch's own MemPool exposes id as a property; be lenient with methods too
        pid = pid()
    if (
        not isinstance(pid, (tuple, list))
        or len(pid) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pid)
    ):
        raise TypeError(
            f"gpumem.pause/resume: expected a MemPool or a pool id (a pair of non-negative ints), got {pool!r}"
        )
    pid = (int(pid[0]), int(pid[1]))
    if pid == (0, 0):
        raise ValueError("gpumem.pause/resume: pool id (0, 0) names no pool")
    if device is None:
        device = getattr(pool, "device", None)
    if device is None or isinstance(device, str) or type(device).__name__ == "device":
        import torch

        if device is not None:  # "cuda", "cuda:1", torch.device("cuda", 1)
            try:
                device = torch.device(device)
            except (RuntimeError, TypeError) as e:
                raise ValueError(f"gpumem.pause/resume: not a CUDA device: {device!r}") from e
            if device.type != "cuda":
                raise ValueError(f"gpumem.pause/resume: not a CUDA device: {device!r}")
            device = device.index
        if device is None:
            device = torch.cuda.current_device()
    if not isinstance(device, int) or isinstance(device, bool) or device < 0:
        raise TypeError(
            f"gpumem.pause/resume: device must be a CUDA device index, name or torch.device, got {device!r}"
        )
    return pid, int(device)


def _require_installed():
    if not _install.is_installed():
        raise RuntimeError(
            "gpumem.pause/resume: gpumem is not torch's allocator in this process; call gpumem.install() "
            "before the first CUDA tensor"
        )


def _result(pid, device, d) -> PauseResult:
    return PauseResult(
        pid,
        device,
        int(d["pages"]),
        int(d["bytes"]),
        int(d["shared_pages"]),
        int(d["backup_bytes"]),
        d["seconds"],
        dict(d["phases"]),
    )


def pause(pool, backup: bool = False, device=None) -> PauseResult:
    """Release the physical memory of every page that only `pool`'s blocks use.

    The pool's tensors keep their addresses (CUDA graphs and raw pointers stay
    valid) but have no memory behind them until resume(): touching one is an
    illegal-address fault on the GPU, which ends the CUDA context -- never a
    silent wrong answer.  Waits for the device first.  backup=True copies the
    released pages to pinned host memory, and resume() copies them back.

    While paused, allocating in the pool, and releasing it, raise; freeing its
    tensors works.  Raises RuntimeError when the pool is already paused or a
    CUDA graph is being captured, ValueError for an unknown pool.
    """
    _require_installed()
    pid, dev = _pool_and_device(pool, device)
    return _result(pid, dev, _pools.device_heap(dev).pool_pause(pid, backup=bool(backup)))


def resume(pool, device=None) -> PauseResult:
    """Map fresh physical pages behind a paused pool's addresses, and copy its
    backup back if it was paused with one (else the contents are undefined).
    Raises RuntimeError when the pool is not paused, during a capture, or when
    the memory cannot be had (then the pool stays paused, backup kept)."""
    _require_installed()
    pid, dev = _pool_and_device(pool, device)
    return _result(pid, dev, _pools.device_heap(dev).pool_resume(pid))


@contextlib.contextmanager
def paused(pool, backup: bool = False, device=None):
    """``with gpumem.paused(pool): ...`` -- pause on entry, resume on exit
    (also when the body raises).  Yields pause()'s PauseResult."""
    result = pause(pool, backup=backup, device=device)
    try:
        yield result
    finally:
        resume(pool, device=result.device)
