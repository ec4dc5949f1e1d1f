"""Private pools under gpumem: CUDA graphs, torch.cuda.MemPool, and
torch.compile(mode="reduce-overhead")'s cudagraph trees.

What torch expects of an allocator here is written down in docs/torch.md
("CUDA graphs and private pools").  In short:

- torch.cuda.graph / CUDAGraph.capture_begin call the allocator's
  beginAllocateToPool(device, pool, filter) before the capture starts,
  endAllocateToPool at its end and releasePool when the graph is reset or
  deleted.  gpumem._C implements those three as plain functions with the C++
  signatures of the std::function hooks of CUDAPluggableAllocator
  (csrc/python/torch_pools.cpp); set_pool_hooks() hands them to torch.
- torch.cuda.MemPool's constructor needs a C++ virtual with no hook
  (createOrIncrefPool), so gpumem's MemPool takes its place: same API, and
  use_mem_pool() reaches gpumem through the same three hooks.
- cudagraph trees call torch._C._cuda_getCheckpointState,
  _cuda_setCheckpointPoolState and _cuda_checkPoolLiveAllocations, which a
  pluggable allocator cannot answer; replacements() answers them from the
  pool's live blocks (Heap.pool_live / pool_set_live of the device's heap) and the
  small torch-header module in _checkpoint.py.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import warnings

from .. import _C
from . import _checkpoint

__all__ = ["MemPool", "set_pool_hooks", "replacements", "refuse_capture", "CheckpointState"]

_NO_HOOKS = (
    "gpumem cannot take part in CUDA graph capture in this process: the C++ standard library ABI of "
    "gpumem._C (_GLIBCXX_USE_CXX11_ABI={ours}) differs from torch's ({theirs}), so torch's graph pool "
    "hooks could not be set.  Rebuild gpumem with GPUMEM_CXX11_ABI={theirs} "
    "(GPUMEM_CXX11_ABI={theirs} pip install -e .)."
)
_hooks_error = None


def _abi_message(torch) -> str:
    return _NO_HOOKS.format(ours=_C._torch_cxx11_abi(), theirs=int(bool(torch._C._GLIBCXX_USE_CXX11_ABI)))


def set_pool_hooks(torch, hooks, entry) -> bool:
    """Give torch gpumem's begin/end/release pool hooks, if the C++ ABIs agree.
    When they do not, the hooks stay unset and graph capture and MemPool raise
    (never a silent capture whose memory is handed out again)."""
    global _hooks_error
    if int(bool(torch._C._GLIBCXX_USE_CXX11_ABI)) != _C._torch_cxx11_abi():
        _hooks_error = _abi_message(torch)
        warnings.warn(_hooks_error, RuntimeWarning, stacklevel=3)
        return False
    hooks.set_begin_allocate_to_pool(entry["begin_allocate_to_pool"])
    hooks.set_end_allocate_to_pool_fn(entry["end_allocate_to_pool"])
    hooks.set_release_pool(entry["release_pool"])
    _hooks_error = None
    return True


def refuse_capture(self, *args, **kwargs):
    """CUDAGraph.capture_begin while gpumem's pool hooks are unset."""
    raise RuntimeError(_hooks_error or "gpumem's graph pool hooks are not set")


# ---- MemPool ----------------------------------------------------------------------------

# torch numbers user pools (0, n) and graph pools (n, 0) from counters of its own;
# gpumem's MemPool ids live far above both so that they never meet.
_MEMPOOL_BASE = 1 << 62
_mempool_ids = itertools.count(1)


class MemPool:
    """torch.cuda.MemPool under gpumem (installed in its place): a private pool
    of one device.  Allocations made inside ``torch.cuda.use_mem_pool(pool)`` go
    to it, and blocks freed there are reused only by it while it lives.  When the
    pool object goes away its free memory returns to the heap at once, and the
    memory of tensors that outlive it when they are freed.

    allocator: another allocator's ``allocator()`` (a
    torch.cuda.memory.CUDAPluggableAllocator made after gpumem.install()): the
    pool's memory then comes from its alloc and free functions, in segments
    sized as torch sizes them, cached for the pool and counted against the
    device's cap, and given back when the pool goes with nothing live in it, or
    else at the empty_cache() after its last tensor (csrc/runtime/ext_pool.h).  no_split: a block of the pool is never
    split -- a request takes whole pages of its own, or a whole free block of
    the pool.  use_on_oom: a pool with an allocator of its own lends its free
    blocks to an allocation that would otherwise run out of memory; gpumem's
    own pools keep theirs.
    """

    def __init__(self, allocator=None, use_on_oom: bool = False, no_split: bool = False):
        import torch

        fns = None
        if allocator is not None:
            fns = _pluggable.get(id(allocator))
            if fns is None or fns[0] is not allocator:
                raise ValueError(
                    "gpumem.torch.MemPool: allocator must be the allocator() of a "
                    "torch.cuda.memory.CUDAPluggableAllocator made after gpumem.install(); gpumem cannot call "
                    "an allocator whose functions it does not know"
                )
            if fns[1] == _C._torch_entry_points()["alloc"]:
                raise ValueError("gpumem.torch.MemPool: that allocator is gpumem itself; pass no allocator")
        if _hooks_error:
            raise RuntimeError(_hooks_error)
        self._device = torch.cuda.current_device()
        self._id = (0, _MEMPOOL_BASE + next(_mempool_ids))
        self._allocator = allocator
        self.use_on_oom = bool(use_on_oom)
        self.no_split = bool(no_split)
        device_heap(self._device).pool_retain(self._id)
        self._alive = True
        if fns is not None:
            _C._torch_ext_attach(self._device, self._id, fns[1], fns[2], self.use_on_oom)
        if self.no_split:
            device_heap(self._device).pool_set_no_split(self._id, True)

    @property
    def id(self):
        """The pool's id, a pair of ints (torch's MempoolId_t)."""
        return self._id

    @property
    def allocator(self):
        """The allocator the pool's memory comes from, or None for gpumem's."""
        return self._allocator

    @property
    def device(self) -> int:
        return self._device

    def use_count(self) -> int:
        """Uses of the pool: 1 for this object, plus one per use_mem_pool() open on it."""
        try:
            return int(device_heap(self._device).pool_info(self._id)["use_count"])
        except ValueError:  # the pool has ended
            return 0

    def snapshot(self, include_traces: bool = True):
        """The segments of this pool, in torch.cuda.memory_snapshot()'s format."""
        import torch

        if self._allocator is not None:
            return _ext_snapshot(self._device, self._id)
        try:
            return torch.cuda.memory_snapshot(self._id, include_traces=include_traces)
        except TypeError:  # a torch whose memory_snapshot has no include_traces
            return torch.cuda.memory_snapshot(self._id)

    def __del__(self):
        if getattr(self, "_alive", False):
            self._alive = False
            try:
                if self._allocator is not None:
                    _C._torch_ext_detach(self._device, self._id)
                device_heap(self._device).pool_release(self._id)
            except Exception:  # noqa: BLE001 - at interpreter exit the heap may be gone
                pass

    def __repr__(self) -> str:
        return f"<gpumem.torch.MemPool id={self._id} cuda:{self._device}>"


# ---- pools over another allocator -------------------------------------------------------

# id(torch's allocator object) -> (that object, alloc address, free address), for every
# CUDAPluggableAllocator made while gpumem is installed; the object is kept, so its id
# stays its own and its functions stay loaded while a pool may call them.
_pluggable = {}


def pluggable_class(base):
    """torch.cuda.memory.CUDAPluggableAllocator that remembers the addresses of its two
    functions, which torch's allocator object does not tell, so that MemPool(allocator)
    can call them."""

    class CUDAPluggableAllocator(base):
        __doc__ = base.__doc__

        def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
            super().__init__(path_to_so_file, alloc_fn_name, free_fn_name)
            lib = ctypes.CDLL(path_to_so_file)
            fns = [ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in (alloc_fn_name, free_fn_name)]
            _pluggable[id(self._allocator)] = (self._allocator, *fns)

    CUDAPluggableAllocator.__module__ = base.__module__
    return CUDAPluggableAllocator


def _ext_snapshot(device: int, pool) -> list:
    """The segments of a pool over another allocator, in torch's snapshot format."""
    segs = []
    for base, blocks in _C._torch_ext_segments(device, pool):
        total = sum(b[1] for b in blocks)
        used = sum(b[1] for b in blocks if b[2])
        segs.append(
            {
                "device": device,
                "address": base,
                "total_size": total,
                "allocated_size": used,
                "active_size": used,
                "requested_size": used,
                "stream": 0,
                "segment_type": "small" if total <= (2 << 20) else "large",
                "segment_pool_id": tuple(pool),
                "is_expandable": False,
                "frames": [],
                "blocks": [
                    {
                        "address": a,
                        "size": n,
                        "requested_size": n if u else 0,
                        "state": "active_allocated" if u else "inactive",
                        "frames": [],
                    }
                    for a, n, u in blocks
                ],
            }
        )
    return segs


# ---- cudagraph trees --------------------------------------------------------------------


class CheckpointState:
    """torch._C._cuda_getCheckpointState's answer under gpumem: the live blocks
    of a graph pool at one moment, and the stream blocks allocated again by a
    restore are given."""

    __slots__ = ("device", "pool", "blocks", "stream")

    def __init__(self, device: int, pool, blocks, stream: int):
        self.device = int(device)
        self.pool = (int(pool[0]), int(pool[1]))
        self.blocks = [(int(a), int(s)) for a, s in blocks]
        self.stream = int(stream)

    def __repr__(self) -> str:
        return f"<gpumem CheckpointState pool={self.pool} cuda:{self.device} {len(self.blocks)} live blocks>"


def device_heap(device: int):
    """The heap torch's allocations on `device` go to: the process-wide heap
    registry's, borrowed as a gpumem.Heap (created now if torch has not
    allocated there yet)."""
    return _C.registry_heap(int(device))


def _pool_live(device: int, pool) -> list:
    """[(addr, size)] of the pool's live blocks; none for a pool that has ended."""
    try:
        return device_heap(device).pool_live(tuple(pool))
    except ValueError:
        return []


def _live_addrs(device: int, pool) -> set:
    return {a for a, _ in _pool_live(device, pool)}


def check_pool_live_allocations(device, pool, expected_live_allocations) -> bool:
    """Whether the pool's live blocks are exactly these addresses."""
    return _live_addrs(device, pool) == {int(p) for p in expected_live_allocations}


def get_checkpoint_state(device, pool) -> CheckpointState:
    import torch

    device = int(device)
    stream = torch.cuda.current_stream(device).cuda_stream
    return CheckpointState(device, pool, _pool_live(device, pool), stream)


def set_checkpoint_pool_state(device, state, stale_storages=(), storages_to_add_deleters_to=()) -> None:
    """Make the pool's live blocks those of `state`.  Blocks live now and not in
    the state are freed (their `stale_storages` stop owning them); blocks of the
    state not live now are allocated again at their addresses, and
    `storages_to_add_deleters_to` (which point at them) get gpumem's deleter."""
    if not isinstance(state, CheckpointState):
        raise TypeError(f"expected a gpumem CheckpointState, got {type(state).__name__}")
    device = int(device)
    lib_ready = _checkpoint.load()  # fail before changing anything when it cannot be built
    del lib_ready
    live_now = _live_addrs(device, state.pool)
    wanted = {a for a, _ in state.blocks}
    freed = live_now - wanted
    allocd = wanted - live_now
    stale = list(dict.fromkeys(int(s) for s in stale_storages))
    if len(stale) < len(freed):
        raise RuntimeError("Any stale tensors which are being manually freed must be passed to set checkpoint")
    device_heap(device).pool_set_live(state.pool, state.blocks, state.stream)
    _checkpoint.release_deleters(stale, freed)
    _checkpoint.add_deleters([int(s) for s in storages_to_add_deleters_to], allocd, _raw_delete_address(), device)


_raw_delete_c = None


@functools.lru_cache(maxsize=None)
def _raw_delete_address() -> int:
    """The address of the extension's raw_delete, fixed for the life of the process."""
    return _C._torch_entry_points()["raw_delete"]


def _gpumem_raw_delete(ptr: int) -> None:
    global _raw_delete_c
    if _raw_delete_c is None:
        _raw_delete_c = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(_raw_delete_address())
    _raw_delete_c(ctypes.c_void_p(int(ptr)))


def replacements(torch, pool_hooks: bool) -> dict:
    """torch._C functions gpumem answers for pools: name -> replacement."""
    original_raw_delete = getattr(torch._C, "_cuda_cudaCachingAllocator_raw_delete", None)
    original_raw_delete = getattr(original_raw_delete, "_gpumem_original", original_raw_delete)

    def raw_delete(ptr):
        # A block a checkpoint restore allocated again never went through the
        # pluggable allocator's malloc, which then does not know it.
        if original_raw_delete is not None:
            try:
                return original_raw_delete(ptr)
            except RuntimeError as e:
                if "not allocated here" not in str(e):
                    raise
        _gpumem_raw_delete(ptr)

    raw_delete._gpumem_original = original_raw_delete

    def _original(name):
        fn = getattr(torch._C, name, None)
        return getattr(fn, "_gpumem_original", fn)

    original_free_remove = _original("_free_And_Remove_DeleterFn")
    original_standard = _original("_has_Standard_Deleter")

    def free_and_remove_deleter(storage_impl_ptr):
        # Storages a checkpoint restore gave gpumem's deleter are not the
        # pluggable allocator's: free those here, hand the others to torch.
        if _checkpoint._lib is not None and _checkpoint.free_and_remove(storage_impl_ptr, _raw_delete_address()):
            return None
        return original_free_remove(storage_impl_ptr)

    def has_standard_deleter(storage_impl_ptr):
        if _checkpoint._lib is not None and _checkpoint.has_deleter(storage_impl_ptr, _raw_delete_address()):
            return True
        return original_standard(storage_impl_ptr)

    free_and_remove_deleter._gpumem_original = original_free_remove
    has_standard_deleter._gpumem_original = original_standard
    out = {
        "_cuda_checkPoolLiveAllocations": check_pool_live_allocations,
        "_cuda_getCheckpointState": get_checkpoint_state,
        "_cuda_setCheckpointPoolState": set_checkpoint_pool_state,
        "_cuda_cudaCachingAllocator_raw_delete": raw_delete,
    }
    if original_free_remove is not None:
        out["_free_And_Remove_DeleterFn"] = free_and_remove_deleter
    if original_standard is not None:
        out["_has_Standard_Deleter"] = has_standard_deleter
    if not pool_hooks:

        def refuse(*args, **kwargs):
            raise RuntimeError(_hooks_error or "gpumem's graph pool hooks are not set")

        for name in ("_cuda_beginAllocateCurrentThreadToPool", "_cuda_beginAllocateToPool"):
            out[name] = refuse
    return out
