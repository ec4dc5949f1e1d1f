/*
 * torch_alloc.h -- gpumem as PyTorch's CUDA allocator: the exported entry
 * points (torch_alloc.cpp) and what the Python glue (torch_glue.c)
 * sets and reads of them.  The heaps they serve are the process-wide heap
 * registry's (heap_registry.h): created on the first allocation torch makes on
 * a device, they live until the process ends.
 */
#ifndef GPUMEM_TORCH_ALLOC_H
#define GPUMEM_TORCH_ALLOC_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem/gpumem.h"

#ifdef __cplusplus
extern "C" {
#endif

enum gm_torch_oom_mode {
    GM_TORCH_OOM_TORCH = 0,  /* raise the configured Python class (torch.OutOfMemoryError) */
    GM_TORCH_OOM_RUNTIME = 1 /* throw std::runtime_error: Python sees RuntimeError */
};

/* How an out-of-memory failure is thrown (gm_torch_oom_mode). */
void gm_torch_set_oom_mode(int mode);
int gm_torch_get_oom_mode(void);

/* Device count torch reported through the init hook (-1 before). */
int gm_torch_device_count(void);

/* Python class raised on OOM in GM_TORCH_OOM_TORCH mode; a strong reference is
 * kept.  Call with the GIL held.  NULL forgets it (RuntimeError then). */
void gm_torch_set_oom_class(void *py_class);

/* Python callable run on every out-of-memory failure of torch's heaps, before
 * the exception: fn(device, requested, allowed, device_free), torch's OOM
 * observer arguments; a strong reference is kept.  Call with the GIL held.
 * NULL: none. */
void gm_torch_set_oom_observer(void *py_callable);

/* Room for the out-of-memory message: an explained one (a formatter) runs to a
 * few KiB, with a table, causes and advice. */
#define GM_TORCH_OOM_MSG_MAX 16384

/* The out-of-memory message for `device` (starts "CUDA out of memory.");
 * a formatter hook, when set, may replace it.  Made in oom_glue.c, as every
 * out-of-memory message is, and so is the message for a request of 1 EiB or
 * more, which no heap is asked to place. */
size_t gm_torch_format_oom(int device, const gm_oom_info *info, char *buf, size_t len);
extern const char GM_TORCH_OOM_TOO_LARGE[];

/* Hooks for helpers that enrich allocations and messages.
 * context: called before each gm_malloc; its value is stored with the block.
 * formatter: writes a message into buf (NUL-terminated) and returns its length,
 *   or a negative number to keep the default message.  It gets the processes
 *   that hold memory on the device (n_procs < 0 when unknown). */
typedef uint64_t (*gm_torch_context_fn)(void);
typedef long (*gm_torch_oom_formatter)(const gm_oom_info *info, int device, const gm_proc_usage *procs, long n_procs,
                                       char *buf, size_t buflen);

typedef struct gm_torch_counters {
    uint64_t ooms;        /* exceptions thrown for out of memory */
    uint64_t oom_retries; /* allocations that succeeded after empty_cache */
    uint64_t free_errors; /* frees of pointers no heap knew */
    uint64_t empty_cache_calls;
    uint64_t record_stream_calls;
    uint64_t fraction_calls;
} gm_torch_counters;
void gm_torch_get_counters(gm_torch_counters *c);

/* ---- the exported entry points (what torch's CUDAPluggableAllocator and its
 * hook setters are given; names must stay stable) ------------------------- */
#if defined(__GNUC__)
#define GM_TORCH_EXPORT __attribute__((visibility("default")))
#else
#define GM_TORCH_EXPORT
#endif
GM_TORCH_EXPORT void *gpumem_torch_alloc(size_t size, int device, void *stream);
GM_TORCH_EXPORT void gpumem_torch_free(void *ptr, size_t size, int device, void *stream);
GM_TORCH_EXPORT void gpumem_torch_empty_cache(void);
GM_TORCH_EXPORT void gpumem_torch_memory_fraction(double fraction, int device);
GM_TORCH_EXPORT void gpumem_torch_record_stream(void *ptr, void *stream);
GM_TORCH_EXPORT void gpumem_torch_init(int device_count);
GM_TORCH_EXPORT void gpumem_torch_set_context_hook(gm_torch_context_fn fn);
/* Whether a free or an empty_cache takes its caller's stack (the context hook's)
 * for the history events it records (torch's context="all"). */
GM_TORCH_EXPORT void gpumem_torch_set_event_stacks(int on);
GM_TORCH_EXPORT void gpumem_torch_set_oom_formatter(gm_torch_oom_formatter fn);

/* ---- private pools: torch's graph pools and MemPool ---------------------------
 * torch's hook setters set_begin_allocate_to_pool, set_end_allocate_to_pool_fn
 * and set_release_pool take these (C++ linkage types, declared for C++ only):
 *   void begin(int device, std::pair<unsigned long long, unsigned long long> pool,
 *              std::function<bool(cudaStream_t)> filter)
 *   void end(int device, std::pair<unsigned long long, unsigned long long> pool)
 *   void release(int device, std::pair<unsigned long long, unsigned long long> pool)
 * While a pool is active on a device, an allocation whose stream the pool's
 * filter accepts goes into it; of several active pools the first begun whose
 * filter accepts wins (torch's own allocator picks the same way).
 * begin adds a use to the pool and tells the heap a capture may be under way;
 * end stops routing and ends that; release drops the use begin added.
 * The C forms take the filter as a plain function (NULL accepts every stream)
 * for callers that are not torch; the addresses come from gm_torch_pool_hook. */
typedef int (*gm_torch_stream_filter_fn)(void *stream);
GM_TORCH_EXPORT int gpumem_torch_pool_begin(int device, uint64_t first, uint64_t second,
                                            gm_torch_stream_filter_fn filter);
GM_TORCH_EXPORT int gpumem_torch_pool_end(int device, uint64_t first, uint64_t second);
GM_TORCH_EXPORT int gpumem_torch_pool_release(int device, uint64_t first, uint64_t second);
/* torch's DeviceStats of a device's heap, for torch's C++ callers
 * (csrc/torch_ext/allocator.cpp): `out` gets GM_TORCH_STATS_N values, first
 * allocation, segment, active, inactive_split, allocated_bytes,
 * reserved_bytes, active_bytes, inactive_split_bytes, requested_bytes (in
 * that order), each for the pools all, small, large, each current, peak,
 * allocated, freed; then num_alloc_retries, num_ooms, num_sync_all_streams,
 * num_device_alloc, num_device_free, max_split_size.  Zeros for a device
 * with no heap.  reset: 1 the peaks, 2 the accumulated figures. */
enum {
    GM_TORCH_STATS_N = 9 * 3 * 4 + 6
};
GM_TORCH_EXPORT void gpumem_torch_device_stats(int device, int64_t *out);
GM_TORCH_EXPORT void gpumem_torch_reset_stats(int device, int what);
/* Free a block by address on whichever heap holds it: the deleter of storages
 * whose blocks a checkpoint restored (gpumem.torch._checkpoint). */
GM_TORCH_EXPORT void gpumem_torch_raw_delete(void *ptr);
enum {
    GM_TORCH_HOOK_BEGIN = 0,
    GM_TORCH_HOOK_END = 1,
    GM_TORCH_HOOK_RELEASE = 2
};
/* Address of torch's std::function-taking pool hook `which` (GM_TORCH_HOOK_*). */
uintptr_t gm_torch_pool_hook(int which);
/* Pools active on a device now (routing allocations), for status and tests. */
size_t gm_torch_active_pools(int device, gm_pool_id *out, size_t cap);
/* The _GLIBCXX_USE_CXX11_ABI value torch_alloc.cpp was built with: torch's
 * std::function hooks are only set when torch was built with the same. */
int gm_torch_cxx11_abi(void);

/* Test hooks (test_hooks.c; built with GM_TEST_HOOKS only).
 * tests/unit/test_fork.py: a new thread takes one of the boundary's
 * locks -- device's slot lock, the options lock, or device's pool lock -- and
 * holds it for `seconds`; returns once that thread holds it.  GM_EINVAL for a
 * bad argument. */
enum {
    GM_TORCH_TEST_LOCK_SLOT = 0,
    GM_TORCH_TEST_LOCK_OPTIONS = 1,
    GM_TORCH_TEST_LOCK_POOLS = 2
};
int gm_torch_test_hold_lock(int which, int device, double seconds);

/* Test hook: gpumem_torch_alloc with its exceptions caught (torch_alloc.cpp);
 * call without the GIL. */
int gm_torch_test_alloc(size_t size, int device, void *stream, uintptr_t *out, void *exc[3], char *msg, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_TORCH_ALLOC_H */
