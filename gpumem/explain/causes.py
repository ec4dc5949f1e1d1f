"""Wording the facts: which causes stand between a request and the memory it
needs (main first: by the bytes each accounts for), each with a headline and
details, and the advice each kind of cause calls for.
"""

from __future__ import annotations

from typing import List, Tuple

from .._C import ERROR_NAMES
from .._units import format_size as _fs
from .report import Cause, Report

# The page of a heap made without page_size: a GPU's VMM granularity (2 MiB on every current GPU),
# and the simulated device's default.
DEVICE_PAGE = 2 << 20


def diagnose(r: Report) -> Tuple[List[Cause], List[str]]:
    """The causes (main first) and the advice for the facts in r."""
    short = r.shortfall if r.request else 0
    causes: List[Cause] = _too_big(r)
    if not r.request or short or r.is_oom:
        ranked = _held(r) + _kept(r, short)
        ranked.sort(key=lambda c: -c.bytes)
        causes.extend(ranked)
    if r.device_error:
        # Listed last: a failed call (e.g. a synchronize refused while streams
        # still run) is how the shortage showed, rarely why memory is short.
        causes.append(
            Cause(
                "device_error",
                0,
                f"a device call failed ({_code_name(r.device_error)}) while gpumem tried to free or get memory",
            )
        )
    # Advice follows the causes, in their order (main cause first: by the bytes
    # each accounts for), one set per kind of cause.
    advice: List[str] = []
    seen = set()
    for c in causes:
        if c.kind in seen:
            continue
        seen.add(c.kind)
        if c.kind == "live_tensors" and "too_big" in seen:
            continue  # the too_big advice already says to split the work
        advice.extend(_advice_for(c.kind, r, short))
    return causes, advice


def _too_big(r: Report) -> List[Cause]:
    """A request larger than the whole device, else than the cap: nothing can make it fit."""
    for limit, what in ((r.device_total, "the whole device"), (r.user_cap, "the cap")):
        if r.request and limit and r.request > limit:
            text = f"the request ({_fs(r.request)}) is larger than {what} ({_fs(limit)})"
            return [Cause("too_big", r.request - limit, text)]
    return []


def _live_tensors(r: Report) -> Cause:
    details = [f"{_fs(b):>11} in {n:>4} blocks  {site}" for site, b, n in r.top_sites]
    if r.top_sites and all(site.startswith("<no stack") for site, _, _ in r.top_sites):
        details = ["no allocation sites recorded: gpumem.record_history(stacks='python') keeps them"]
    if any(k in ("cupy", "numba") for k in r.by_framework):
        details.insert(
            0,
            "by framework: "
            + ", ".join(f"{k} {_fs(b)} in {n} block{'s' if n != 1 else ''}" for k, (b, n) in r.by_framework.items()),
        )
    return Cause("live_tensors", r.live_bytes, f"live tensors hold {_fs(r.live_bytes)} in {r.n_live} blocks", details)


def _held(r: Report) -> List[Cause]:
    """Who holds the memory: live tensors, other processes, this process outside the allocator."""
    ranked: List[Cause] = []
    if r.live_bytes:
        ranked.append(_live_tensors(r))
    if r.other_processes:
        tot = sum(b for _, b in r.other_processes)
        ranked.append(
            Cause(
                "other_processes",
                tot,
                f"{len(r.other_processes)} other process(es) hold {_fs(tot)} on this device",
                [f"PID {pid}: {_fs(b)}" for pid, b in r.other_processes[:8]],
            )
        )
    if r.outside_allocator:
        ranked.append(
            Cause(
                "outside_allocator",
                r.outside_allocator,
                f"this process holds {_fs(r.outside_allocator)} outside the allocator "
                f"(CUDA context, library workspaces): NVML reports {_fs(r.self_usage or 0)} for "
                f"PID {r.self_pid}, the heap reserved {_fs(r.reserved_bytes)}",
            )
        )
    if r.unattributed and r.processes is None:
        ranked.append(
            Cause(
                "other_processes",
                r.unattributed,
                f"{_fs(r.unattributed)} of the device is used outside this heap, by other "
                "processes or this process's CUDA context (NVML is not available to tell which)",
            )
        )
    return ranked


def _kept(r: Report, short: int) -> List[Cause]:
    """Free memory this request cannot have: private pools', pending, stranded, in chunks, beyond the cap."""
    ranked: List[Cause] = []
    if r.pool_free_bytes:
        ranked.append(
            Cause(
                "private_pools",
                r.pool_free_bytes,
                f"{_fs(r.pool_free_bytes)} are free but kept for private pools (CUDA graphs, "
                f"MemPools), which also hold {_fs(r.pool_live_bytes)} live: no other allocation "
                "may reuse them, and their pages are never moved or released",
                [
                    "a graph's memory stays reserved for it while the graph lives: delete graphs "
                    "no longer replayed (torch._dynamo.reset() for torch.compile's), and share one "
                    "pool between graphs run in sequence (torch.cuda.graph_pool_handle())"
                ],
            )
        )
    if r.pending_bytes:
        ranked.append(
            Cause(
                "pending",
                r.pending_bytes,
                f"{_fs(r.pending_bytes)} are freed but wait for work on other streams "
                "(record_stream) before they can be reused",
            )
        )
    frag = r.stranded_bytes
    if frag and (short == 0 or frag >= r.page_size):
        ranked.append(_fragmentation(r, frag))
    if r.chunk_locked_bytes:
        ranked.append(
            Cause(
                "chunks",
                r.chunk_locked_bytes,
                f"{_fs(r.chunk_locked_bytes)} are free pages inside physical allocations of several pages "
                "(growth with chunk_pages > 1 or with room, or a resumed pool) that live blocks still use: "
                "an allocation is unmapped only as a whole, so "
                "defragmentation cannot move them",
            )
        )
    if r.user_cap and r.user_cap < r.device_total:
        beyond = max(0, min(r.device_total - r.user_cap, r.device_free))
        if beyond:
            ranked.append(
                Cause(
                    "cap",
                    beyond,
                    f"a cap of {_fs(r.user_cap)} keeps {_fs(beyond)} of free device memory out "
                    f"of reach (device {_fs(r.device_total)})",
                )
            )
    return ranked


def _fragmentation(r: Report, frag: int) -> Cause:
    return Cause(
        "fragmentation",
        frag,
        f"{_fs(frag)} are free but stranded in pages that also hold live blocks",
        [
            f"defragmentation already reuses wholly free pages ({_fs(r.cached_bytes)} cached now) by "
            f"remapping them behind a new address; it cannot reclaim the {_fs(frag)} stranded, because "
            "gpumem never moves live data",
            f"largest free range in mapped memory: {_fs(r.largest_free_mapped)}; "
            f"largest block possible after defragmenting: {_fs(r.largest_possible)}",
        ],
    )


def _framework_advice(r: Report) -> List[str]:
    """For arrays CuPy / Numba hold in the heap they share with torch."""
    out = []
    for fw in ("cupy", "numba"):
        if fw in r.by_framework:
            b, n = r.by_framework[fw]
            name = "CuPy" if fw == "cupy" else "Numba"
            out.append(
                f"{name} holds {_fs(b)} in {n} array(s) of this heap: compute in chunks (e.g. a matmul "
                f"by blocks of rows, C[i:j] = A[i:j] @ B, each copied out or reduced before the next) so "
                f"that only one chunk of the result is live at a time, and `del` arrays you are done with."
            )
    return out


def _advice_for(kind: str, r: Report, short: int) -> List[str]:
    """What to do about one kind of cause."""
    if kind == "too_big":
        if r.user_cap and r.request <= r.device_total:
            return [f"The request is larger than the cap: raise the cap ({_fs(r.user_cap)}), or split the work."]
        return [
            "No setting makes one tensor larger than the GPU fit: split the work (smaller batch, chunk "
            "the computation), use a smaller dtype (bf16/fp16, 8-bit optimizers), or shard it over devices."
        ]
    if kind == "live_tensors":
        limit = r.user_cap if r.user_cap else r.device_total
        share = (
            f" ({100.0 * r.live_bytes / limit:.0f}% of the {_fs(limit)} {'cap' if r.user_cap else 'device'})"
            if limit
            else ""
        )
        return [
            f"Live tensors hold {_fs(r.live_bytes)}{share}: the work is too big for this memory. Use a "
            "smaller batch (or shorter sequences / smaller images) and gradient accumulation (e.g. half the "
            "batch, two backward() per optimizer.step()) to keep the effective batch; activation "
            "checkpointing (torch.utils.checkpoint) trades compute for activation memory.",
            "Inference: run under torch.no_grad() / torch.inference_mode() so no activations are "
            "kept for backward; split a large batch into chunks.",
            "`del` tensors you no longer need (losses kept for logging: keep loss.item(), not loss), "
            "then gpumem/torch.cuda.empty_cache() to give the pages back to other processes.",
        ] + _framework_advice(r)
    if kind == "other_processes":
        pids = ", ".join(str(p) for p, _ in r.other_processes[:5]) or "see nvidia-smi"
        return [
            f"Free the GPU from other processes (PIDs {pids}): stop them, or give them another GPU "
            "with CUDA_VISIBLE_DEVICES."
        ]
    if kind == "outside_allocator":
        return [
            f"Leave room for the {_fs(r.outside_allocator or 0)} this process holds outside the allocator: "
            "cap gpumem lower, or shrink library workspaces (CUBLAS_WORKSPACE_CONFIG=:4096:8, "
            "torch.backends.cudnn.benchmark=False)."
        ]
    if kind == "pending":
        return [
            "Synchronize the side streams (or avoid record_stream on short-lived tensors) so that "
            "pending blocks become reusable."
        ]
    if kind == "fragmentation" and (r.is_oom or short):
        advice = [
            "Stranded memory comes from small long-lived tensors sharing pages with freed ones: "
            "allocate persistent buffers (weights, optimizer state, caches) before the loop, and free "
            "the small tensors the top sites list."
        ]
        if r.page_size > DEVICE_PAGE:
            advice.append(
                f"This heap's pages are {_fs(r.page_size)} (page_size): a block keeps whole pages, so the "
                f"larger the page the more a small tensor strands. The default page ({_fs(DEVICE_PAGE)}, "
                "GPUMEM_CONF without page_size for torch) strands less."
            )
        return advice
    if kind == "chunks" and (r.is_oom or short):
        return [
            "Memory near its limit defragments best page by page: with chunk_pages > 1, create the heap "
            "with chunk_pages=1 (GPUMEM_CONF=chunk_pages:1 for torch), which makes every page it grows "
            "by its own allocation. A resumed pool's allocations stay whole until all their pages are free, "
            "even after the pool ends: free its tensors. While far from its limit the heap also grows large "
            "requests by such allocations; pressure=0 (GPUMEM_CONF=pressure:0 for torch) makes it grow page "
            "by page everywhere. Where only the allocating thread runs work on the GPU, split_chunks=1 "
            "(GPUMEM_CONF=split_chunks:1) lets defragmentation split such an allocation: the pages live "
            "tensors use are copied to pages of their own behind the same addresses, and its free pages go."
        ]
    if kind == "private_pools":
        return [
            "Release CUDA graphs and MemPools you no longer replay (del the graph / pool, or "
            "graph.reset()): their pools' memory then returns to the heap."
        ]
    if kind == "cap":
        return [
            f"Raise or remove the cap (heap.set_cap / torch.cuda.set_per_process_memory_fraction): "
            f"the device has {_fs(r.device_free)} free beyond it."
        ]
    return []


def _code_name(code: int) -> str:
    return ERROR_NAMES.get(code, f"error {code}")
