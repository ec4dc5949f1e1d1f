"""The allocators compared, and how a fresh process puts each in place.

Every attempt runs in a process of its own whose CUDA state is new: the orchestrator and the
worker servers never initialise CUDA, so each child creates the context, installs the allocator
under test, makes what the task needs besides the allocator's memory (its CUDA streams), then
takes the cap with a raw cudaMalloc (cudart.py), in that order -- except an RMM pool sized to the
cap, which is made after the cap is taken (worker.Device).  The two pluggable allocators (RMM,
gpumem) must be swapped in before torch initialises its allocator, which is why torch is kept away
from the device until then.

The native variants differ only by PYTORCH_CUDA_ALLOC_CONF, which torch reads when its CUDA
library is loaded (the backend is chosen by a static initialiser), so it is set in the worker
server's environment before `import torch`, never changed afterwards.
"""

from __future__ import annotations

import os
from typing import Callable, Dict, List, Optional

CONTENDERS = ["native", "expandable", "async", "rmm", "gpumem"]

LABELS = {
    "native": "native",
    "expandable": "expandable_segments",
    "async": "cudaMallocAsync",
    "rmm": "RMM pool",
    "gpumem": "gpumem",
}

ALLOC_CONF = {
    "native": None,
    "expandable": "expandable_segments:True",
    "async": "backend:cudaMallocAsync",
    "rmm": None,
    "gpumem": None,
}

MiB = 1 << 20


class Unavailable(RuntimeError):
    """The contender cannot run here; the message says why (recorded, never fatal)."""


def parse_contenders(text: str) -> List[str]:
    names = [c.strip() for c in text.split(",") if c.strip()]
    if not names:
        raise ValueError("no contender named")
    aliases = {"expandable_segments": "expandable", "cudamallocasync": "async", "cuda_malloc_async": "async"}
    out = []
    for n in names:
        n = aliases.get(n.lower(), n.lower())
        if n not in CONTENDERS:
            raise ValueError(f"unknown contender {n!r} (choose from {', '.join(CONTENDERS)})")
        if n not in out:
            out.append(n)
    return out


def variant_env(spec: str, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment of a fresh process that runs allocator variant `spec`: a contender name (an alias
    such as expandable_segments too), optionally followed by ':VAR=VALUE,...' to set (a gpumem option
    through GPUMEM_CONF, say).  The process installs gpumem itself when the name is gpumem."""
    name, _, extra = spec.partition(":")
    (contender,) = parse_contenders(name)
    env = dict(os.environ if base is None else base)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    if ALLOC_CONF[contender]:
        env["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF[contender]
    for kv in filter(None, extra.split(",")):
        k, eq, v = kv.partition("=")
        if not eq or not k:
            raise ValueError(f"{kv!r} in {spec!r} is not VAR=VALUE")
        env[k] = v
    return env


def server_env(contender: str, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """Environment of the worker server (and so of every child) for `contender`."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("PYTORCH_ALLOC_CONF", None)
    conf = ALLOC_CONF[contender]
    if conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    # Any torch.cuda.is_available() in the server must not initialise the driver (children are
    # forked from it, and CUDA does not survive a fork); the NVML check leaves it alone.
    env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Installed:
    """What a child knows about the allocator it installed: a name, versions, and how to read
    its own account of reserved memory (None where it keeps none that torch can see)."""

    def __init__(self, contender: str, detail: dict, stats: Callable[[], Optional[dict]]):
        self.contender = contender
        self.detail = detail
        self.stats = stats


def _torch_stats() -> Optional[dict]:
    import torch

    try:
        s = torch.cuda.memory_stats()
    except Exception as e:  # pluggable allocators may not keep torch's statistics
        return {"unavailable": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"}
    if not s:
        return {"unavailable": "torch.cuda.memory_stats() is empty"}
    keys = {
        "reserved_peak": "reserved_bytes.all.peak",
        "reserved_current": "reserved_bytes.all.current",
        "allocated_peak": "allocated_bytes.all.peak",
        "retries": "num_alloc_retries",
        "ooms": "num_ooms",
        "device_allocs": "num_device_alloc",
        "device_frees": "num_device_free",
    }
    return {k: s[v] for k, v in keys.items() if v in s}


def install(contender: str, cap_free: Optional[int], options: dict) -> Installed:
    """Put `contender` in place in this (child) process.  CUDA's context exists; torch has not
    touched the device yet.  `cap_free` is the free memory left under the cap, for an allocator
    sized to it (taken before; None when there is no cap or it is taken after)."""
    if contender in ("native", "expandable", "async"):
        import torch

        torch.cuda.init()
        backend = torch.cuda.memory.get_allocator_backend()
        want = "cudaMallocAsync" if contender == "async" else "native"
        if backend != want:
            raise Unavailable(
                f"torch reports allocator backend {backend!r}, expected {want!r} "
                f"(PYTORCH_CUDA_ALLOC_CONF={os.environ.get('PYTORCH_CUDA_ALLOC_CONF')!r})"
            )
        return Installed(
            contender, {"backend": backend, "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}, _torch_stats
        )
    if contender == "rmm":
        return _install_rmm(cap_free, options)
    if contender == "gpumem":
        return _install_gpumem(options)
    raise Unavailable(f"unknown contender {contender!r}")


def _install_rmm(cap_free: Optional[int], options: dict) -> Installed:
    try:
        import rmm
        import rmm.mr
    except Exception as e:
        raise Unavailable(
            f"import rmm failed: {type(e).__name__}: {e} (install rmm-cu13: docs/benchmarks.md)"
        ) from None
    try:
        from rmm.allocators.torch import rmm_torch_allocator
    except Exception as e:
        raise Unavailable(f"rmm.allocators.torch failed to import: {type(e).__name__}: {e}") from None
    if rmm_torch_allocator is None:
        raise Unavailable("rmm.allocators.torch found no usable torch CUDA (rmm_torch_allocator is None)")
    # Pool sizing (docs/benchmarks.md): under a cap with pool="all" the pool takes all it was left,
    # as RMM users size pools; otherwise it starts empty and grows on demand (RMM's growth: double
    # the pool, halving the request on failure down to what is needed), so that memory the driver
    # needs outside the pool (kernels loaded lazily, cuBLAS) is still there.
    mode = options.get("rmm_pool", "grow")
    initial = 0
    tried = []
    pool = None
    if mode == "all" and cap_free:
        size = (cap_free // (2 * MiB)) * 2 * MiB
        for _ in range(16):
            try:
                pool = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=size)
                initial = size
                break
            except Exception as e:  # the driver may keep a little of what it reports free
                tried.append(f"{size}: {str(e).splitlines()[0][:80]}")
                size -= 8 * MiB
    if pool is None:
        for initial in (0, 2 * MiB):  # an empty start, or the smallest a version insists on
            try:
                pool = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=initial)
                break
            except Exception as e:
                tried.append(f"{initial}: {str(e).splitlines()[0][:80] if str(e) else type(e).__name__}")
        if pool is None:
            raise Unavailable(f"rmm.mr.PoolMemoryResource could not be created: {'; '.join(tried)}")
    rmm.mr.set_current_device_resource(pool)
    import torch

    try:
        torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    except Exception as e:
        raise Unavailable(f"torch refused RMM's allocator: {type(e).__name__}: {e}") from None
    torch.cuda.init()

    def stats():
        # The pool never gives memory back, so its size now is its peak.
        return {"reserved_peak": pool.pool_size(), "reserved_current": pool.pool_size()}

    return Installed(
        "rmm",
        {"rmm": getattr(rmm, "__version__", "?"), "pool": mode, "initial_pool_size": initial, "pool_tries": tried[:4]},
        stats,
    )


def _install_gpumem(options: dict) -> Installed:
    try:
        import gpumem
    except Exception as e:
        raise Unavailable(
            f"import gpumem failed: {type(e).__name__}: {e} (install it on the device: "
            f"pip install --no-build-isolation --no-deps -e .)"
        ) from None
    install_fn = getattr(gpumem, "install", None)
    if install_fn is None:
        raise Unavailable(
            f"gpumem.install is missing (gpumem {getattr(gpumem, '__version__', '?')} from "
            f"{os.path.dirname(getattr(gpumem, '__file__', '?') or '?')}: the PyTorch "
            f"integration is not merged into this tree)"
        )
    opts = dict(options.get("gpumem_options") or {})
    try:
        install_fn(**opts)
    except Exception as e:
        raise Unavailable(f"gpumem.install({opts}) failed: {type(e).__name__}: {e}") from None
    import torch

    torch.cuda.init()
    return Installed("gpumem", {"gpumem": getattr(gpumem, "__version__", "?"), "options": opts}, _torch_stats)


def is_oom(exc: BaseException) -> bool:
    """Whether an exception from an allocation is an out-of-memory (each allocator says it its way:
    torch.OutOfMemoryError, rmm::out_of_memory as a std::bad_alloc, gpumem's 'CUDA out of memory.')."""
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except Exception:
        pass
    if isinstance(exc, MemoryError):
        return True
    msg = str(exc).lower()
    return any(
        k in msg
        for k in (
            "out of memory",
            "out_of_memory",
            "bad_alloc",
            "outofmemory",
            "cudaerrormemoryallocation",
            "memory allocation",
        )
    )
