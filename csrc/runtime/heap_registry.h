/*
 * heap_registry.h -- the process-wide heap registry: one heap per device
 * ordinal, shared by every framework in the process.  torch's allocations
 * (torch_alloc.cpp), CuPy's and Numba's (registry_glue.c) and the Heap objects
 * that borrow a device's heap (module.c, _C.registry_heap) all reach the same
 * heap through here.
 *
 * A device's heap is created on first use, with the options configured here
 * (gm_heap_registry_configure), and lives until the process ends: torch cannot
 * hand its allocator back once CUDA is up, so nothing would ever be allowed to
 * destroy it safely.  That is also what lets readers use a heap pointer
 * without holding a lock.
 *
 * Caps: a heap's cap is the smaller of the configured cap_bytes and
 * cap_fraction of the device, unless a per-device memory fraction was set
 * (torch.cuda.set_per_process_memory_fraction), which wins.  The effective cap
 * is also kept as the device's `limit`, read without a lock on the hot path.
 *
 * Locks: each device has a slot lock (creation, and device calls made outside
 * the heap), and the options have one; a slot lock may be held while taking
 * the options lock, never the other way round.  Both are handed to the core's
 * fork handling (gm_fork_also), so a fork()ed child gets them released.
 */
#ifndef GPUMEM_HEAP_REGISTRY_H
#define GPUMEM_HEAP_REGISTRY_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem/gpumem.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GM_HEAP_REGISTRY_MAX_DEVICES 64

/* Options for heaps created from now on (cap_* also apply to existing heaps).
 * gm_heap_registry_options_default gives every field its default; none has an
 * "unset" value. */
typedef struct gm_heap_registry_options {
    gm_config heap;         /* the core's options, its defaults (gm_config_default) unless
                               given; heap.cap_bytes (0: none) is applied with cap_fraction */
    double cap_fraction;    /* 0: none; else a fraction of device total */
    size_t page_size;       /* 0: the device's granularity; else a power of two, a multiple of it */
    size_t history_entries; /* 0: history off */
} gm_heap_registry_options;

void gm_heap_registry_options_default(gm_heap_registry_options *o);
/* Replace the options; applies caps to heaps that exist (history_entries only
 * to heaps created later: gm_heap_registry_history_enable for all of them).
 * GM_EINVAL with the reason in err (the core's message for a heap option). */
int gm_heap_registry_configure(const gm_heap_registry_options *o, char *err, size_t errlen);
void gm_heap_registry_get_options(gm_heap_registry_options *o);

/* Whether d is a device ordinal the registry can hold. */
int gm_heap_registry_valid(int device);
/* The heap of a device, or NULL while none was created there. */
gm_heap *gm_heap_registry_get(int device);
/* The heap of a device, created now (over CUDA) if need be; NULL with a reason
 * in err. */
gm_heap *gm_heap_registry_open(int device, char *err, size_t errlen);
/* Serve `device` with a heap over the simulated device (capacity bytes)
 * instead of CUDA: every framework's path on a machine with no GPU (tests).
 * GM_EINVAL, with a reason in err, when the device already has a heap. */
int gm_heap_registry_open_sim(int device, size_t capacity, char *err, size_t errlen);

/* Cap the heap of a device (0: none); GM_EINVAL if it has none yet. */
int gm_heap_registry_set_cap(int device, size_t cap_bytes);
/* A per-device fraction of the device's memory (< 0: none), which wins over
 * the configured caps; applied now if the device has a heap. */
void gm_heap_registry_set_fraction(int device, double fraction);
/* Memory a private pool took from another allocator (ext_pool.h) counts
 * against the device's cap: take_outside GM_OK, or GM_ENOMEM when the heap
 * and the pools together would pass it, even after the heap's empty_cache;
 * give_outside when it goes back.  The heap's own cap is lowered by it. */
int gm_heap_registry_take_outside(int device, size_t bytes);
void gm_heap_registry_give_outside(int device, size_t bytes);
/* The effective cap of a device's heap (SIZE_MAX: none). */
size_t gm_heap_registry_limit(int device);
/* Keep the last n events on every heap, now and later (0: off).  GM_EINVAL
 * for n > 2**32, GM_ENOMEM when a heap's ring cannot be allocated. */
int gm_heap_registry_history_enable(size_t n);
/* empty_cache on every heap not capturing a CUDA graph now (unmapping then
 * would invalidate the capture). */
void gm_heap_registry_empty_cache(void);

/* The processes holding memory on `device` (this one included), as the
 * device's processes() call gives them, serialized with the other device
 * calls made outside the heap.  GM_EINVAL without a heap there. */
int gm_heap_registry_processes(int device, gm_proc_usage *out, size_t cap, size_t *n);

/* Test hook (tests/unit/test_fork.py; built with GM_TEST_HOOKS only): take (take != 0)
 * or release one of the registry's locks, `which` below (device: whose slot).
 * GM_EINVAL for a bad argument. */
enum {
    GM_HEAP_REGISTRY_LOCK_SLOT = 0,
    GM_HEAP_REGISTRY_LOCK_OPTIONS = 1
};
int gm_heap_registry_test_lock(int which, int device, int take);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_HEAP_REGISTRY_H */
