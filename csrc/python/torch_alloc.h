/*
 * torch_alloc.h -- gpumem as PyTorch's CUDA allocator: the registry of one heap
 * per device that the exported entry points (torch_alloc.cpp) serve, and what
 * the Python glue (torch_glue.c) may read from it.
 *
 * Heaps are created on the first allocation torch makes on a device and live
 * until the process ends: torch cannot hand its allocator back once CUDA is
 * up, so nothing would ever be allowed to destroy them safely.  That is also
 * what lets readers use a heap pointer without holding a lock.
 */
#ifndef GPUMEM_TORCH_ALLOC_H
#define GPUMEM_TORCH_ALLOC_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem/gpumem.h"

#ifdef __cplusplus
extern "C" {
#endif

#define GM_TORCH_MAX_DEVICES 64

enum gm_torch_oom_mode {
    GM_TORCH_OOM_TORCH = 0,   /* raise the configured Python class (torch.OutOfMemoryError) */
    GM_TORCH_OOM_RUNTIME = 1  /* throw std::runtime_error: Python sees RuntimeError */
};

/* Options for heaps created from now on (cap_* also apply to existing heaps). */
typedef struct gm_torch_options {
    size_t va_size;            /* 0: the core's default */
    size_t cap_bytes;          /* 0: none (unless cap_fraction) */
    double cap_fraction;       /* 0: none; else a fraction of device total */
    double growth_slack;       /* < 0: the core's default */
    long growth_slack_pages;   /* < 0: the core's default */
    size_t history_entries;    /* 0: history off */
    int oom_mode;              /* gm_torch_oom_mode */
} gm_torch_options;

void gm_torch_options_default(gm_torch_options *o);
/* Replace the options; applies caps to heaps that exist (history_entries only
 * to heaps created later: gm_history_enable per heap for the others).
 * GM_EINVAL on nonsense. */
int gm_torch_configure(const gm_torch_options *o);
void gm_torch_get_options(gm_torch_options *o);

/* The heap of a device, or NULL while torch has not allocated there. */
gm_heap *gm_torch_heap(int device);
/* Create the heap of a device now.  GM_OK, or an error with a reason in err. */
int gm_torch_open(int device, char *err, size_t errlen);
/* Cap the heap of a device (0: none); GM_EINVAL if it has none yet. */
int gm_torch_set_cap(int device, size_t cap_bytes);
/* Device count torch reported through the init hook (-1 before). */
int gm_torch_device_count(void);

/* Python class raised on OOM in GM_TORCH_OOM_TORCH mode; a strong reference is
 * kept.  Call with the GIL held.  NULL forgets it (RuntimeError then). */
void gm_torch_set_oom_class(void *py_class);

/* Room for the out-of-memory message: an explained one (a formatter) runs to a
 * few KiB, with a table, causes and advice. */
#define GM_TORCH_OOM_MSG_MAX 16384

/* The processes holding memory on `device` (this one included), as the
 * device's processes() call gives them, serialized with the other device
 * calls gpumem makes outside the heap.  GM_EINVAL without a heap there. */
int gm_torch_processes(int device, gm_proc_usage *out, size_t cap, size_t *n);

/* The out-of-memory message for `device` (starts "CUDA out of memory.").
 * The one place it is built; a formatter hook, when set, may replace it. */
size_t gm_torch_format_oom(int device, const gm_oom_info *info, char *buf, size_t len);

/* Hooks for helpers that enrich allocations and messages.
 * context: called before each gm_malloc; its value is stored with the block.
 * formatter: writes a message into buf (NUL-terminated) and returns its length,
 *   or a negative number to keep the default message.  It gets the processes
 *   that hold memory on the device (n_procs < 0 when unknown). */
typedef uint64_t (*gm_torch_context_fn)(void);
typedef long (*gm_torch_oom_formatter)(const gm_oom_info *info, int device,
                                       const gm_proc_usage *procs, long n_procs,
                                       char *buf, size_t buflen);

typedef struct gm_torch_counters {
    uint64_t ooms;              /* exceptions thrown for out of memory */
    uint64_t oom_retries;       /* allocations that succeeded after empty_cache */
    uint64_t free_errors;       /* frees of pointers no heap knew */
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
GM_TORCH_EXPORT void gpumem_torch_set_oom_formatter(gm_torch_oom_formatter fn);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_TORCH_ALLOC_H */
