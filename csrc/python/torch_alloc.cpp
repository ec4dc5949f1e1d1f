/*
 * torch_alloc.cpp -- the C++ boundary between PyTorch and gpumem's C core: the
 * entry points torch calls.  Beside it (torch_boundary.h between them):
 * torch_pools.cpp (private pools and the locks across fork()), torch_oom.cpp
 * (raising torch's out-of-memory error), torch_profiler.cpp and, in a build
 * with test hooks, torch_test_hooks.cpp.
 *
 * torch.cuda.memory.CUDAPluggableAllocator calls plain C functions by address:
 *   void *alloc(size_t size, int device, cudaStream_t stream)
 *   void  free(void *ptr, size_t size, int device, cudaStream_t stream)
 * and its hook setters take void(), void(double, int), void(void *, cudaStream_t)
 * and void(int).  Those live here, with extern "C" names and default
 * visibility so ctypes can find them in gpumem._C.
 *
 * Why C++: torch stores whatever alloc returns as the tensor's address without
 * looking, so a NULL return makes the next kernel fault and poisons the CUDA
 * context for good.  The only way to refuse an allocation is to throw a C++
 * exception through torch's frames, which torch turns into a Python exception.
 *
 * Which exception: torch maps c10::OutOfMemoryError to torch.OutOfMemoryError,
 * but building that object needs libtorch's headers and libraries.  torch also
 * catches `python_error` (torch/csrc/Exceptions.h) first of all its handlers and
 * re-raises the Python exception stored in it.  C++ matches a catch clause by the
 * type's mangled name (libstdc++ compares type_info names), so an exception
 * class named python_error with the same four fields is caught there, and
 * torch raises exactly the torch.OutOfMemoryError instance we built.  Were the
 * match ever to fail, the class is still a std::exception whose what() is the
 * message, which torch turns into a RuntimeError with the same text -- so the
 * worst case is the plain RuntimeError the issue asks for.  docs/torch.md has
 * the details; oom_mode GM_TORCH_OOM_RUNTIME skips the trick.
 *
 * Private pools (CUDA graphs, MemPool): torch's pool hooks are std::function
 * objects built from plain function addresses, so the three hooks below have
 * exactly the C++ signatures torch's std::function types name, and need only
 * <functional> and <utility> -- no libtorch.  The one thing that must agree with
 * torch is the standard library ABI (_GLIBCXX_USE_CXX11_ABI); gpumem.torch
 * compares it with torch's before setting them.
 *
 * The heaps themselves, one per device, their options and caps, are the
 * process-wide heap registry's (heap_registry.h), shared with CuPy and Numba.
 *
 * Locks, and fork(): the boundary's own lock is slot.pool_mu, one per device,
 * never nested with another lock of the boundary or of the heap registry; it
 * may be held while calling into the core (which never calls back out while it
 * holds a lock of its own).  None is held while calling
 * anything that may wait for the GIL: route() calls the pools' stream filters
 * (which may be Python callables) on a copy of the list, outside pool_mu (and
 * pool_end, with the GIL released, waits for the calls in flight, so that a
 * filter is never running once its pool's end returns, as under torch's own
 * allocator, which calls them under its lock); the
 * context hook, the OOM formatter and the Python exception are all reached
 * with no lock held.  That is what lets fork() take them all: fork_lock_all
 * (handed to the core's one pthread_atfork registration, core/fork.c) takes
 * every pool_mu before the core takes its own, and a forked child (a DataLoader worker) gets them back
 * released instead of held by a thread that does not exist there.
 */
#include <Python.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <utility>

#include "convert.h"
#include "ext_pool.h"
#include "heap_registry.h"
#include "torch_alloc.h"
#include "torch_boundary.h"

using namespace gm_torch;

std::atomic<uint64_t> gm_torch::c_ooms{0}, gm_torch::c_oom_retries{0}, gm_torch::c_free_errors{0},
    gm_torch::c_empty_cache{0}, gm_torch::c_record_stream{0}, gm_torch::c_fraction{0};

std::atomic<gm_torch_context_fn> gm_torch::g_context_fn{nullptr};

namespace {

std::atomic<int> g_device_count{-1};

/* torch refuses any request of 1 EiB or more before its allocator looks at it. */
constexpr size_t kOneExaByte = (size_t)1 << 60;

/* ---- where events come from (torch's context="all") ---------------------------- */

/* Set while torch records history with context="all" and Python stacks: a free
 * and an empty_cache then take the stack of their caller for the events they
 * record, as torch's allocator does. */
std::atomic<bool> g_event_stacks{false};

/* The caller's stack for the events a free or an empty_cache records, or 0. */
} // namespace

uint64_t gm_torch::caller_context() {
    if (!g_event_stacks.load(std::memory_order_relaxed)) return 0;
    gm_torch_context_fn fn = g_context_fn.load(std::memory_order_relaxed);
    return fn ? fn() : 0;
}

gm_heap *gm_torch::heap_or_throw(int device) {
    if (!gm_heap_registry_valid(device))
        throw std::runtime_error("gpumem: CUDA device index " + std::to_string(device) + " is out of range");
    gm_heap *h = gm_heap_registry_get(device);
    if (!h) {
        char why[512] = "";
        if (!(h = gm_heap_registry_open(device, why, sizeof why))) throw std::runtime_error(why);
    }
    return h;
}

/* ---- torch's settings ----------------------------------------------------------- */

extern "C" int gm_torch_device_count(void) { return g_device_count.load(); }

extern "C" void gm_torch_get_counters(gm_torch_counters *c) {
    c->ooms = c_ooms.load();
    c->oom_retries = c_oom_retries.load();
    c->free_errors = c_free_errors.load();
    c->empty_cache_calls = c_empty_cache.load();
    c->record_stream_calls = c_record_stream.load();
    c->fraction_calls = c_fraction.load();
}

/* An allocation routed to a pool over another allocator (ext_pool.h). */
static void *ext_alloc(gm_heap *h, int device, size_t size, void *stream, gm_pool_id pool) {
    uintptr_t p = 0;
    int rc = gm_ext_alloc(device, pool, size, stream, &p);
    if (rc == GM_ENOMEM && !gm_capturing(h)) { /* what ended pools and the heap cache hold, then once more */
        gm_ext_release_ended(device);
        gm_empty_cache(h);
        rc = gm_ext_alloc(device, pool, size, stream, &p);
    }
    if (rc == GM_OK) return (void *)p;
    if (rc == GM_ENOMEM)
        throw_fresh_oom(h, device, size, stream,
                        " (The allocation was for a MemPool whose memory comes from its own allocator, "
                        "which refused it or would pass the cap.)");
    throw std::runtime_error("gpumem: allocation of " + std::to_string(size) + " bytes on GPU " +
                             std::to_string(device) + " failed: its MemPool " + pool_name(pool) + " has ended");
}

/* ---- the entry points torch calls ---------------------------------------------- */

extern "C" void *gpumem_torch_alloc(size_t size, int device, void *stream) {
    gm_heap *h = heap_or_throw(device);
    gm_pool_id pool_id;
    const gm_pool_id *pool = route_to_pool(device, (gm_stream)(uintptr_t)stream, &pool_id) ? &pool_id : nullptr;
    gm_torch_context_fn ctx_fn = g_context_fn.load(std::memory_order_relaxed);
    uint64_t ctx = ctx_fn ? ctx_fn() : 0;
    /* the pages mapped for it, or its out-of-memory event, carry its stack too */
    event_context_scope events(ctx);
    uintptr_t p = 0;
    if (size >= kOneExaByte) throw_oom(GM_TORCH_OOM_TOO_LARGE);
    if (pool && gm_ext_owns(device, *pool)) return ext_alloc(h, device, size, stream, *pool);
    if (size > gm_heap_registry_limit(device) &&
        (gm_ext_release_ended(device), size > gm_heap_registry_limit(device))) {
        if (!pool && gm_ext_alloc_on_oom(device, size, stream, &p) == GM_OK) return (void *)p;
        throw_fresh_oom(h, device, size, stream);
    }
    /* The failure counts once, when it is raised (num_ooms: torch's exceptions). */
    int rc = gm_malloc_flags(h, size, (gm_stream)(uintptr_t)stream, ctx, pool, GM_MALLOC_OOM_UNCOUNTED, &p);
    if (rc == GM_OK) {
        report_to_profiler(h, device, (void *)p, (int64_t)size);
        return (void *)p;
    }
    /* During a capture nothing may synchronise: no empty_cache, no retry. */
    bool capturing = gm_capturing(h) != 0;
    if (rc == GM_ENOMEM && !capturing) {
        /* The core has already released what it could and defragmented; one
         * more try after an explicit empty_cache also catches memory that other
         * streams' events have freed since. */
        gm_ext_release_ended(device);
        gm_empty_cache(h);
        rc = gm_malloc_flags(h, size, (gm_stream)(uintptr_t)stream, ctx, pool,
                             GM_MALLOC_OOM_UNCOUNTED | GM_MALLOC_RETRY, &p);
        if (rc == GM_OK) {
            c_oom_retries.fetch_add(1, std::memory_order_relaxed);
            report_to_profiler(h, device, (void *)p, (int64_t)size);
            return (void *)p;
        }
    }
    if (rc == GM_ENOMEM && !pool && gm_ext_alloc_on_oom(device, size, stream, &p) == GM_OK) return (void *)p;
    if (rc == GM_ENOMEM || rc == GM_EINVAL) {
        gm_oom_info info;
        std::string msg = oom_message(device, h, size, &info);
        observe_oom(device, size, info);
        /* A failed attempt may have grown the heap to its cap on the way; give
         * that back, as torch's own allocator does, or memory taken outside the
         * allocator (cuBLAS handles, NCCL) fails next -- seen on an H100. */
        if (!capturing) gm_empty_cache(h);
        gm_count_oom(h, size, (gm_stream)(uintptr_t)stream);
        throw_oom(msg);
    }
    if (rc == GM_EPAUSED) /* the allocation's pool is paused (gpumem.pause): no device call was made */
        throw std::runtime_error(std::string("gpumem: allocation of ") + std::to_string(size) + " bytes on GPU " +
                                 std::to_string(device) +
                                 " failed: its pool is paused (gpumem.pause); call gpumem.resume(pool) first");
    throw std::runtime_error(std::string("gpumem: allocation of ") + std::to_string(size) + " bytes on GPU " +
                             std::to_string(device) + " failed: " + gm_strerror(rc) + " (" +
                             gm_heap_device(h)->last_error + ")");
}

/* Called from tensor destructors: throwing here would terminate the process,
 * so a pointer no heap knows is counted and reported once on stderr. */
extern "C" void gpumem_torch_free(void *ptr, size_t size, int device, void *stream) {
    (void)stream;
    gm_heap *h = gm_heap_registry_get(device);
    event_context_scope events(caller_context());
    int rc = h ? gm_free(h, (uintptr_t)ptr) : GM_EUNKNOWN_PTR;
    if (rc == GM_OK) report_to_profiler(h, device, ptr, -(int64_t)size);
    if (rc == GM_EUNKNOWN_PTR) rc = gm_ext_free(device, (uintptr_t)ptr);
    if (rc != GM_OK && c_free_errors.fetch_add(1) == 0)
        fprintf(stderr,
                "gpumem: free of %p on GPU %d failed: %s (further errors are counted "
                "in gpumem.torch.status())\n",
                ptr, device, gm_strerror(rc));
}

extern "C" void gpumem_torch_empty_cache(void) {
    c_empty_cache.fetch_add(1, std::memory_order_relaxed);
    event_context_scope events(caller_context());
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES; d++) gm_ext_release_ended(d);
    gm_heap_registry_empty_cache(); /* skips heaps capturing a graph */
}

extern "C" void gpumem_torch_memory_fraction(double fraction, int device) {
    c_fraction.fetch_add(1, std::memory_order_relaxed);
    gm_heap_registry_set_fraction(device, fraction);
}

extern "C" void gpumem_torch_device_stats(int device, int64_t *out) {
    gm_stats st;
    memset(&st, 0, sizeof st);
    gm_heap *h = device >= 0 ? gm_heap_registry_get(device) : nullptr;
    if (h) gm_get_stats(h, &st);
    const gm_stat *pooled[] = {st.allocation,      st.segment,        st.active,       st.inactive_split,
                               st.allocated_bytes, st.reserved_bytes, st.active_bytes, st.inactive_split_bytes,
                               st.requested_bytes};
    size_t i = 0;
    for (const gm_stat *arr : pooled)
        for (int p = 0; p < GM_POOL__COUNT; p++) {
            out[i++] = arr[p].current;
            out[i++] = arr[p].peak;
            out[i++] = arr[p].allocated;
            out[i++] = arr[p].freed;
        }
    for (int64_t v : {st.num_alloc_retries, st.num_ooms, st.num_sync_all_streams, st.num_device_alloc,
                      st.num_device_free, h ? st.max_split_size : (int64_t)-1})
        out[i++] = v;
}

extern "C" void gpumem_torch_reset_stats(int device, int what) {
    gm_heap *h = device >= 0 ? gm_heap_registry_get(device) : nullptr;
    if (!h) return;
    if (what == 1) gm_reset_peak_stats(h);
    if (what == 2) gm_reset_accumulated_stats(h);
}

extern "C" void gpumem_torch_record_stream(void *ptr, void *stream) {
    c_record_stream.fetch_add(1, std::memory_order_relaxed);
    int rc = GM_EUNKNOWN_PTR;
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES && rc == GM_EUNKNOWN_PTR; d++) {
        gm_heap *h = gm_heap_registry_get(d);
        if (h) rc = gm_record_stream(h, (uintptr_t)ptr, (gm_stream)(uintptr_t)stream);
    }
    if (rc != GM_OK) {
        char p[32];
        snprintf(p, sizeof p, "%p", ptr);
        for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES; d++)
            if (gm_ext_is_live(d, (uintptr_t)ptr))
                throw std::runtime_error(std::string("gpumem: record_stream on ") + p +
                                         ": memory of a MemPool with an allocator of its own is not stream-tracked "
                                         "under gpumem; synchronise the streams instead");
        throw std::runtime_error(std::string("gpumem: record_stream on ") + p + ": " + gm_strerror(rc));
    }
}

extern "C" void gpumem_torch_init(int device_count) {
    g_device_count.store(device_count);
    look_up_profiler(); /* torch is loaded by now */
}

extern "C" void gpumem_torch_set_context_hook(gm_torch_context_fn fn) { g_context_fn.store(fn); }

extern "C" void gpumem_torch_set_event_stacks(int on) { g_event_stacks.store(on != 0); }

extern "C" void gpumem_torch_raw_delete(void *ptr) {
    event_context_scope events(caller_context());
    int rc = GM_EUNKNOWN_PTR;
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES && rc == GM_EUNKNOWN_PTR; d++) {
        gm_heap *h = gm_heap_registry_get(d);
        if (h) rc = gm_free(h, (uintptr_t)ptr);
    }
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES && rc == GM_EUNKNOWN_PTR; d++) rc = gm_ext_free(d, (uintptr_t)ptr);
    if (rc != GM_OK && c_free_errors.fetch_add(1) == 0)
        fprintf(stderr,
                "gpumem: free of %p failed: %s (further errors are counted in "
                "gpumem.torch.status())\n",
                ptr, gm_strerror(rc));
}
