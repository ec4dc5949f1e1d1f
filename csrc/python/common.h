/*
 * common.h -- pieces the Python glue files share: dict building, the
 * torch-style stats dict, the out-of-memory report as a dict, history and
 * snapshot blocks as lists, and the byte formatting used in error messages.
 *
 * Plain C (common.c); C++ callers (torch_alloc.cpp) get the declarations with
 * C linkage through the extern "C" block below.
 */
#ifndef GPUMEM_PY_COMMON_H
#define GPUMEM_PY_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#include "gpumem/gpumem.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A module function's PyMethodDef: name, C function (any signature), METH_*
 * flags, doc string. */
#define GM_PY_FN(name, fn, flags, doc)                                                                                 \
    {.ml_name = name, .ml_meth = (PyCFunction)(void (*)(void))fn, .ml_flags = flags, .ml_doc = doc}

/* Set d[key] = value and drop the reference to value; value may be NULL (error). */
int gm_py_put(PyObject *d, const char *key, PyObject *value);
int gm_py_put_u64(PyObject *d, const char *key, uint64_t v);
int gm_py_put_i64(PyObject *d, const char *key, int64_t v);

/* torch.cuda.memory_stats()-shaped dict: "{name}.{pool}.{field}" keys, then
 * the plain counters.  New reference, or NULL with an exception set. */
PyObject *gm_py_stats_dict(const gm_stats *s);
/* "GM_ENOMEM" for GM_ENOMEM, from the one list (GM_EACH_ERROR). */
const char *gm_py_code_name(int code);
/* Export the name lists to Python: ERROR_NAMES {code: name}, POOLED_STAT_NAMES
 * and COUNTER_NAMES (tuples, in the order of gpumem.h's lists). */
int gm_py_add_name_lists(PyObject *m);
/* Add m.attr = a tuple of the n strings in names.  0, or -1 with an exception set. */
int gm_py_add_str_tuple(PyObject *m, const char *attr, const char *const *names, size_t n);

/* gm_oom_info as a dict (OutOfMemoryError.info).  New reference or NULL. */
PyObject *gm_py_oom_dict(const gm_oom_info *o);
/* A private pool's gm_pool_info as a dict (Heap.pool_info, gpumem.torch's
 * pool status): id (first, second), use_count, live_blocks, ...  New reference
 * or NULL. */
PyObject *gm_py_pool_info_dict(const gm_pool_info *p);
/* What pausing or resuming a pool did (Heap.pool_pause/pool_resume, gpumem.torch's
 * pause/resume): {pages, bytes, shared_pages, backup_bytes, seconds, phases}.
 * New reference or NULL. */
PyObject *gm_py_pause_dict(gm_heap *h, const gm_pause_info *info, double seconds);
/* CLOCK_MONOTONIC in seconds: what `seconds` above is measured with. */
double gm_py_monotonic_s(void);

/* history as (entries, dropped): entries are (time_ns, action, addr, size,
 * stream, context) tuples; an action with no name reads `unknown_action`.
 * New reference or NULL. */
PyObject *gm_py_history(gm_heap *h, const char *unknown_action);

/* A snapshot's blocks as (addr, size, requested, stream, context, alloc_seq,
 * state, pool) tuples (pool: the private pool's (first, second), or None); a state with no name reads `unknown_state`.  New reference or
 * NULL. */
PyObject *gm_py_blocks_list(const gm_snapshot *snap, const char *unknown_state);
/* The snapshot as a dict (va_base, va_size, page_size, top, spare_pages, cap_bytes, blocks, pages,
 * stats); consumes nothing, frees nothing.  NULL with an exception set on failure. */
PyObject *gm_py_snapshot_dict(const gm_snapshot *snap, const char *unknown_state);

/* A device index of the process-wide heap registry (heap_registry.h):
 * gm_py_check_device checks d lies in [0, GM_HEAP_REGISTRY_MAX_DEVICES),
 * gm_py_device_index reads a Python int and checks it.
 * 0, or -1 with ValueError (or the int conversion's error) set. */
int gm_py_check_device(long d);
int gm_py_device_index(PyObject *o, int *device);

/* A new tuple of a sequence's items, for a C array made from them: it holds
 * their references, so Python code run while an item is converted cannot free
 * or move them, and a __len__ that lies makes it no larger.  NULL with an
 * exception set. */
PyObject *gm_py_tuple_of(PyObject *obj);

/* The processes on a device as [(pid, bytes)]; n < 0 (unknown): None.  New
 * reference or NULL. */
PyObject *gm_py_procs_list(const gm_proc_usage *p, long n);

/* A function's address as a Python int: what torch's hook setters take.  New
 * reference or NULL. */
PyObject *gm_py_fn_address(void (*fn)(void));

/* n bytes as "512 B", "1.50 KiB", ... "2.00 PiB": all byte counts in
 * messages go through here. */
void gm_fmt_bytes(char *buf, size_t len, uint64_t n);

/* n bytes as torch's messages write them: "1024 bytes", "1.50 KiB", "2.00 MiB",
 * then GiB however large ("800000000.00 GiB"). */
void gm_fmt_torch_bytes(char *buf, size_t len, uint64_t n);

/* The byte counts an out-of-memory message names, formatted by gm_fmt_bytes. */
typedef struct gm_oom_sizes {
    char request[32], device_total[32], device_free[32], live[32], reserved[32], cached[32], pending[32], largest[32],
        cap[32];
} gm_oom_sizes;

void gm_oom_sizes_format(const gm_oom_info *o, gm_oom_sizes *out);

/* The first sentences of every out-of-memory message (the one-line message;
 * gm_py_oom_message, oom_glue.h, adds gpumem's explanation after them):
 *   "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ... "
 * `gpu` >= 0 names torch's device (allocations then count as PyTorch's, the
 * first two sentences are torch's own, sizes in torch's units, and the memory
 * other processes hold follows, from the device's process list: n_procs < 0
 * when unknown); -1 is a gpumem.Heap ("The device has a total capacity of
 * ...").  `failed`: the device's last reason (NULL: none given), said when a
 * device call failed, or why the process list is unknown.  Writes at most len
 * bytes (NUL-terminated); returns the length. */
size_t gm_oom_line(char *buf, size_t len, const gm_oom_info *o, int gpu, const gm_proc_usage *procs, long n_procs,
                   const char *failed);
/* The OOM text's sentence on spill (what is spilled, the limit, why no more),
 * with a leading space; empty when spill is off. */
void gm_oom_spill_text(char *buf, size_t len, const gm_oom_info *o);

#ifdef __cplusplus
}
#endif

#endif
