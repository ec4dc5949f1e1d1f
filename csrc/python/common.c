/*
 * common.c -- what the Python glue files and torch_alloc.cpp share (common.h).
 */
#include "common.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "heap_registry.h"

int gm_py_put(PyObject *d, const char *key, PyObject *value) {
    if (value == NULL) return -1;
    int rc = PyDict_SetItemString(d, key, value);
    Py_DECREF(value);
    return rc;
}

int gm_py_put_u64(PyObject *d, const char *key, uint64_t v) {
    return gm_py_put(d, key, PyLong_FromUnsignedLongLong(v));
}

int gm_py_put_i64(PyObject *d, const char *key, int64_t v) { return gm_py_put(d, key, PyLong_FromLongLong(v)); }

PyObject *gm_py_stats_dict(const gm_stats *s) {
    static const char *const pools[GM_POOL__COUNT] = {"all", "small_pool", "large_pool"};
    static const char *const fields[4] = {"current", "peak", "allocated", "freed"};
    const struct {
        const char *name;
        const gm_stat *arr;
    } groups[] = {
#define GROUP(name) {#name, s->name},
        GM_EACH_POOLED_STAT(GROUP)
#undef GROUP
    };
    const struct {
        const char *name;
        int64_t v;
    } plain[] = {
#define PLAIN(name) {#name, s->name},
        GM_EACH_COUNTER(PLAIN) GM_EACH_SETTING(PLAIN)
#undef PLAIN
    };
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    char key[96];
    for (size_t g = 0; g < sizeof groups / sizeof groups[0]; g++) {
        for (int p = 0; p < GM_POOL__COUNT; p++) {
            const gm_stat *st = &groups[g].arr[p];
            const int64_t vals[4] = {st->current, st->peak, st->allocated, st->freed};
            for (int f = 0; f < 4; f++) {
                snprintf(key, sizeof key, "%s.%s.%s", groups[g].name, pools[p], fields[f]);
                if (gm_py_put_i64(d, key, vals[f]) < 0) goto fail;
            }
        }
    }
    for (size_t i = 0; i < sizeof plain / sizeof plain[0]; i++)
        if (gm_py_put_i64(d, plain[i].name, plain[i].v) < 0) goto fail;
    return d;
fail:
    Py_DECREF(d);
    return NULL;
}

PyObject *gm_py_oom_dict(const gm_oom_info *o) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    if (gm_py_put_u64(d, "request", o->request) < 0 || gm_py_put_u64(d, "stream", o->stream) < 0 ||
        gm_py_put_u64(d, "device_total", o->device_total) < 0 || gm_py_put_u64(d, "device_free", o->device_free) < 0 ||
        gm_py_put_u64(d, "cap_bytes", o->cap_bytes) < 0 || gm_py_put_u64(d, "live_bytes", o->live_bytes) < 0 ||
        gm_py_put_u64(d, "pending_bytes", o->pending_bytes) < 0 ||
        gm_py_put_u64(d, "reserved_bytes", o->reserved_bytes) < 0 ||
        gm_py_put_u64(d, "cached_bytes", o->cached_bytes) < 0 ||
        gm_py_put_u64(d, "free_mapped_bytes", o->free_mapped_bytes) < 0 ||
        gm_py_put_u64(d, "largest_free_mapped", o->largest_free_mapped) < 0 ||
        gm_py_put_u64(d, "largest_possible", o->largest_possible) < 0 ||
        gm_py_put_u64(d, "pages_needed", o->pages_needed) < 0 ||
        gm_py_put_i64(d, "device_error", o->device_error) < 0 ||
        gm_py_put_u64(d, "pool_live_bytes", o->pool_live_bytes) < 0 ||
        gm_py_put_u64(d, "pool_free_bytes", o->pool_free_bytes) < 0 ||
        gm_py_put_u64(d, "chunk_locked_bytes", o->chunk_locked_bytes) < 0 ||
        gm_py_put_u64(d, "spilled_bytes", o->spilled_bytes) < 0 ||
        gm_py_put_u64(d, "spill_limit", o->spill_limit) < 0 || gm_py_put_i64(d, "spill_error", o->spill_error) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

PyObject *gm_py_pool_info_dict(const gm_pool_info *p) {
    return Py_BuildValue("{s:(KK),s:L,s:K,s:K,s:K,s:K,s:K,s:O,s:K,s:K,s:K}", "id", (unsigned long long)p->id.first,
                         (unsigned long long)p->id.second, "use_count", (long long)p->use_count, "live_blocks",
                         (unsigned long long)p->live_blocks, "live_bytes", (unsigned long long)p->live_bytes,
                         "free_blocks", (unsigned long long)p->free_blocks, "free_bytes",
                         (unsigned long long)p->free_bytes, "pinned_pages", (unsigned long long)p->pinned_pages,
                         "paused", p->paused ? Py_True : Py_False, "paused_pages", (unsigned long long)p->paused_pages,
                         "shared_pages", (unsigned long long)p->shared_pages, "backup_bytes",
                         (unsigned long long)p->backup_bytes);
}

PyObject *gm_py_pause_dict(gm_heap *h, const gm_pause_info *info, double seconds) {
    size_t page = gm_heap_device(h)->page_size;
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:d,s:{s:d,s:d,s:d,s:d}}", "pages", (Py_ssize_t)info->pages, "bytes",
                         (Py_ssize_t)(info->pages * page), "shared_pages", (Py_ssize_t)info->shared_pages,
                         "backup_bytes", (Py_ssize_t)info->backup_bytes, "seconds", seconds, "phases", "sync",
                         (double)info->sync_ns * 1e-9, "pages", (double)info->pages_ns * 1e-9, "copy",
                         (double)info->copy_ns * 1e-9, "map", (double)info->map_ns * 1e-9);
}

double gm_py_monotonic_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

PyObject *gm_py_history(gm_heap *h, const char *unknown_action) {
    static const char *const names[] = {"alloc", "free_requested", "free_completed", "map",    "unmap", "remap",
                                        "oom",   "empty_cache",    "spill",          "unspill"};
    size_t cap = gm_history_len(h);
    gm_hist_entry *buf = PyMem_Malloc((cap ? cap : 1) * sizeof *buf);
    if (buf == NULL) return PyErr_NoMemory();
    uint64_t dropped = 0;
    /* A thread inside the core without the GIL may add entries between the two
     * calls; read returns how many it really copied, so use that. */
    size_t n = gm_history_read(h, buf, cap, &dropped);
    PyObject *list = PyList_New((Py_ssize_t)n);
    if (list == NULL) {
        PyMem_Free(buf);
        return NULL;
    }
    for (size_t i = 0; i < n; i++) {
        const gm_hist_entry *e = &buf[i];
        const char *act = e->action < sizeof names / sizeof names[0] ? names[e->action] : unknown_action;
        PyObject *t = Py_BuildValue("(KsKKKKK)", (unsigned long long)e->time_ns, act, (unsigned long long)e->addr,
                                    (unsigned long long)e->size, (unsigned long long)e->stream,
                                    (unsigned long long)e->context, (unsigned long long)e->requested);
        if (t == NULL) {
            Py_DECREF(list);
            PyMem_Free(buf);
            return NULL;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    PyMem_Free(buf);
    return Py_BuildValue("(NK)", list, (unsigned long long)dropped);
}

PyObject *gm_py_blocks_list(const gm_snapshot *snap, const char *unknown_state) {
    static const char *const states[] = {
        [GM_BLOCK_LIVE] = "live",
        [GM_BLOCK_FREE] = "free",
        [GM_BLOCK_PENDING] = "pending",
        [GM_BLOCK_UNMAPPED] = "unmapped",
    };
    PyObject *blocks = PyList_New((Py_ssize_t)snap->n_blocks);
    if (blocks == NULL) return NULL;
    for (size_t i = 0; i < snap->n_blocks; i++) {
        const gm_block_info *b = &snap->blocks[i];
        const char *st =
            (b->state >= 0 && (size_t)b->state < sizeof states / sizeof states[0]) ? states[b->state] : unknown_state;
        PyObject *pool = (b->pool.first || b->pool.second) ? Py_BuildValue("(KK)", (unsigned long long)b->pool.first,
                                                                           (unsigned long long)b->pool.second)
                                                           : (Py_INCREF(Py_None), Py_None);
        PyObject *t = pool ? Py_BuildValue("(KKKKKKsN)", (unsigned long long)b->addr, (unsigned long long)b->size,
                                           (unsigned long long)b->requested, (unsigned long long)b->stream,
                                           (unsigned long long)b->context, (unsigned long long)b->alloc_seq, st, pool)
                           : NULL;
        if (t == NULL) {
            Py_DECREF(blocks);
            return NULL;
        }
        PyList_SET_ITEM(blocks, (Py_ssize_t)i, t);
    }
    return blocks;
}

/* A tuple of obj's items.  A list or tuple is copied as it is now; anything
 * else is iterated item by item, so that a __len__ that lies costs nothing
 * (tuple() would allocate what it claims). */
PyObject *gm_py_tuple_of(PyObject *obj) {
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) return PySequence_Tuple(obj);
    PyObject *it = PyObject_GetIter(obj);
    if (it == NULL) return NULL;
    PyObject *list = PyList_New(0), *item;
    while (list != NULL && (item = PyIter_Next(it)) != NULL) {
        if (PyList_Append(list, item) < 0) Py_CLEAR(list);
        Py_DECREF(item);
    }
    Py_DECREF(it);
    if (list == NULL || PyErr_Occurred()) {
        Py_XDECREF(list);
        return NULL;
    }
    PyObject *t = PyList_AsTuple(list);
    Py_DECREF(list);
    return t;
}

int gm_py_check_device(long d) {
    if (d < 0 || d >= GM_HEAP_REGISTRY_MAX_DEVICES) {
        PyErr_Format(PyExc_ValueError, "device index %ld out of range [0, %d)", d, GM_HEAP_REGISTRY_MAX_DEVICES);
        return -1;
    }
    return 0;
}

int gm_py_device_index(PyObject *o, int *device) {
    long d = PyLong_AsLong(o);
    if ((d == -1 && PyErr_Occurred()) || gm_py_check_device(d) < 0) return -1;
    *device = (int)d;
    return 0;
}

PyObject *gm_py_procs_list(const gm_proc_usage *p, long n) {
    if (n < 0) Py_RETURN_NONE;
    PyObject *l = PyList_New((Py_ssize_t)n);
    for (long i = 0; l != NULL && i < n; i++) {
        PyObject *t = Py_BuildValue("(kK)", (unsigned long)p[i].pid, (unsigned long long)p[i].bytes);
        if (t == NULL)
            Py_CLEAR(l);
        else
            PyList_SET_ITEM(l, (Py_ssize_t)i, t);
    }
    return l;
}

PyObject *gm_py_fn_address(void (*fn)(void)) {
    uintptr_t a;
    memcpy(&a, &fn, sizeof a);
    return PyLong_FromUnsignedLongLong((unsigned long long)a);
}

void gm_fmt_bytes(char *buf, size_t len, uint64_t n) {
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
    if (n < 1024) {
        snprintf(buf, len, "%" PRIu64 " B", n);
        return;
    }
    double v = (double)n / 1024.0;
    size_t u = 0;
    while (v >= 1024.0 && u + 1 < sizeof units / sizeof units[0]) {
        v /= 1024.0;
        u++;
    }
    snprintf(buf, len, "%.2f %s", v, units[u]);
}

/* torch's own rule (c10's format_size): "N bytes" up to 1 KiB, then KiB up to
 * 1 MiB, MiB up to 1 GiB, and GiB above, each bound inclusive. */
void gm_fmt_torch_bytes(char *buf, size_t len, uint64_t n) {
    if (n <= 1024)
        snprintf(buf, len, "%" PRIu64 " bytes", n);
    else if (n <= ((uint64_t)1 << 20))
        snprintf(buf, len, "%.2f KiB", (double)n / 1024.0);
    else if (n <= ((uint64_t)1 << 30))
        snprintf(buf, len, "%.2f MiB", (double)n / 1048576.0);
    else
        snprintf(buf, len, "%.2f GiB", (double)n / 1073741824.0);
}

void gm_oom_sizes_format(const gm_oom_info *o, gm_oom_sizes *out) {
    gm_fmt_bytes(out->request, sizeof out->request, o->request);
    gm_fmt_bytes(out->device_total, sizeof out->device_total, o->device_total);
    gm_fmt_bytes(out->device_free, sizeof out->device_free, o->device_free);
    gm_fmt_bytes(out->live, sizeof out->live, o->live_bytes);
    gm_fmt_bytes(out->reserved, sizeof out->reserved, o->reserved_bytes);
    gm_fmt_bytes(out->cached, sizeof out->cached, o->cached_bytes);
    gm_fmt_bytes(out->pending, sizeof out->pending, o->pending_bytes);
    gm_fmt_bytes(out->largest, sizeof out->largest, o->largest_possible);
    gm_fmt_bytes(out->cap, sizeof out->cap, o->cap_bytes);
}

/* What other processes hold, from the device's process list (this process left
 * out; n_procs < 0: unknown, `why` says why): "1.00 GiB (pid 7: 1.00 GiB)". */
static void others_text(char *out, size_t len, const gm_proc_usage *procs, long n_procs, const char *why) {
    if (n_procs < 0) {
        snprintf(out, len, "unknown (%s)", why && why[0] ? why : "no process list");
        return;
    }
    uint64_t sum = 0;
    char list[256] = "";
    size_t used = 0;
    int shown = 0;
    uint32_t self = (uint32_t)getpid();
    for (long i = 0; i < n_procs; i++) {
        if (procs[i].pid == self) continue;
        sum += procs[i].bytes;
        if (shown < 4 && used < sizeof list) {
            char b[32];
            gm_fmt_bytes(b, sizeof b, procs[i].bytes);
            int w = snprintf(list + used, sizeof list - used, "%spid %u: %s", shown ? ", " : "", procs[i].pid, b);
            if (w > 0) used += (size_t)w;
            shown++;
        }
    }
    char s[32];
    gm_fmt_bytes(s, sizeof s, sum);
    if (shown)
        snprintf(out, len, "%s (%s)", s, list);
    else
        snprintf(out, len, "%s", s);
}

/* Why spill did not serve the request, after "is spilled to host memory
 * (limit ...)": empty when it says nothing more. */
static const char *spill_why(const gm_oom_info *o) {
    switch (o->spill_error) {
    case GM_OK: /* not tried: only a request larger than the cap and the limit */
        return o->request > o->spill_limit ? "; the request is larger than the cap and the spill limit" : "";
    case GM_ENOMEM:
        return o->request + o->spilled_bytes > o->spill_limit ? "; the request would pass the limit"
                                                              : "; the host refused to give more pages";
    case GM_EINVAL:
        return "; the heap's address range has no unmapped room that large for host pages";
    case GM_EDEVICE:
        return "; spilling more failed in a device call";
    default:
        return "";
    }
}

/* " 2.0 GiB is spilled to host memory (limit 2.0 GiB); the request would pass
 * the limit.": the OOM text's sentence on spill, saying why spill did not
 * serve the request; empty with spill off. */
void gm_oom_spill_text(char *buf, size_t len, const gm_oom_info *o) {
    char now[32], lim[32];
    buf[0] = '\0';
    if (!o->spill_limit) return;
    gm_fmt_bytes(now, sizeof now, o->spilled_bytes);
    gm_fmt_bytes(lim, sizeof lim, o->spill_limit);
    if (o->spill_error == GM_ECAPTURING)
        snprintf(buf, len, " %s is spilled to host memory (limit %s); spill is off during a CUDA graph capture.", now,
                 lim);
    else if (o->spill_error == GM_ENOTSUP)
        snprintf(buf, len, " Spill is on (limit %s) but this device cannot map host memory.", lim);
    else
        snprintf(buf, len, " %s is spilled to host memory (limit %s)%s.", now, lim, spill_why(o));
}

size_t gm_oom_line(char *buf, size_t len, const gm_oom_info *o, int gpu, const gm_proc_usage *procs, long n_procs,
                   const char *failed) {
    if (!len) return 0;
    gm_oom_sizes z;
    gm_oom_sizes_format(o, &z);
    char device[160];
    if (gpu >= 0) {
        /* torch's first sentence, word for word and in torch's units, so that code
         * and people matching torch's message keep working; gpumem's figures follow. */
        gm_fmt_torch_bytes(z.request, sizeof z.request, o->request);
        gm_fmt_torch_bytes(z.device_total, sizeof z.device_total, o->device_total);
        gm_fmt_torch_bytes(z.device_free, sizeof z.device_free, o->device_free);
    }
    if (!o->device_total)
        snprintf(device, sizeof device, "The device's memory is unknown.");
    else if (gpu >= 0)
        snprintf(device, sizeof device, "GPU %d has a total capacity of %s of which %s is free.", gpu, z.device_total,
                 z.device_free);
    else
        snprintf(device, sizeof device, "The device has a total capacity of %s of which %s is free.", z.device_total,
                 z.device_free);
    char others[320], other[400] = "", fail[400] = "", spill[200] = "";
    if (gpu >= 0) {
        others_text(others, sizeof others, procs, n_procs, failed);
        snprintf(other, sizeof other, " Memory held by other processes: %s.", others);
    }
    if (o->device_error != GM_OK)
        snprintf(fail, sizeof fail, " A device call failed: %s (%s: %s).", gm_strerror(o->device_error),
                 gm_py_code_name(o->device_error), failed && failed[0] ? failed : "no detail");
    gm_oom_spill_text(spill, sizeof spill, o);
    int w = snprintf(buf, len,
                     "CUDA out of memory. Tried to allocate %s. %s This process has %s allocated%s, %s reserved "
                     "by gpumem (%s cached, %s waiting for other streams), under a cap of %s. The largest block "
                     "gpumem could make now, after releasing its cache and defragmenting, is %s.%s%s%s",
                     z.request, device, z.live, gpu >= 0 ? " by PyTorch (gpumem)" : "", z.reserved, z.cached, z.pending,
                     z.cap, z.largest, spill, other, fail);
    if (w < 0) {
        buf[0] = '\0';
        return 0;
    }
    return (size_t)w < len ? (size_t)w : len - 1;
}

PyObject *gm_py_snapshot_dict(const gm_snapshot *snap, const char *unknown_state) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    if (gm_py_put_u64(d, "va_base", snap->va_base) < 0 || gm_py_put_u64(d, "va_size", snap->va_size) < 0 ||
        gm_py_put_u64(d, "page_size", snap->page_size) < 0 || gm_py_put_u64(d, "top", snap->top) < 0 ||
        gm_py_put_u64(d, "spare_pages", snap->spare_pages) < 0 || gm_py_put_u64(d, "cap_bytes", snap->cap_bytes) < 0 ||
        gm_py_put(d, "blocks", gm_py_blocks_list(snap, unknown_state)) < 0 ||
        gm_py_put(d, "pages", PyBytes_FromStringAndSize((const char *)snap->pages, (Py_ssize_t)snap->n_pages)) < 0 ||
        gm_py_put(d, "growth",
                  PyBytes_FromStringAndSize((const char *)snap->growth,
                                            (Py_ssize_t)(snap->n_pages * sizeof *snap->growth))) < 0 ||
        gm_py_put(d, "host", PyBytes_FromStringAndSize((const char *)snap->host, (Py_ssize_t)snap->n_pages)) < 0 ||
        gm_py_put(d, "stats", gm_py_stats_dict(&snap->stats)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

const char *gm_py_code_name(int code) {
    switch (code) {
#define NAME_CASE(name, value, text)                                                                                   \
    case name:                                                                                                         \
        return #name;
        GM_EACH_ERROR(NAME_CASE)
#undef NAME_CASE
    default:
        return "GM_E?";
    }
}

int gm_py_add_str_tuple(PyObject *m, const char *attr, const char *const *names, size_t n) {
    PyObject *t = PyTuple_New((Py_ssize_t)n);
    if (t == NULL) return -1;
    for (size_t i = 0; i < n; i++) {
        PyObject *v = PyUnicode_FromString(names[i]);
        if (v == NULL) {
            Py_DECREF(t);
            return -1;
        }
        PyTuple_SET_ITEM(t, (Py_ssize_t)i, v);
    }
    if (PyModule_AddObject(m, attr, t) < 0) {
        Py_DECREF(t);
        return -1;
    }
    return 0;
}

int gm_py_add_name_lists(PyObject *m) {
    PyObject *errors = PyDict_New();
    if (errors == NULL) return -1;
#define ERROR_ITEM(name, value, text)                                                                                  \
    {                                                                                                                  \
        PyObject *k = PyLong_FromLong(value);                                                                          \
        PyObject *v = PyUnicode_FromString(#name);                                                                     \
        int bad = k == NULL || v == NULL || PyDict_SetItem(errors, k, v) < 0;                                          \
        Py_XDECREF(k);                                                                                                 \
        Py_XDECREF(v);                                                                                                 \
        if (bad) {                                                                                                     \
            Py_DECREF(errors);                                                                                         \
            return -1;                                                                                                 \
        }                                                                                                              \
    }
    GM_EACH_ERROR(ERROR_ITEM)
#undef ERROR_ITEM
    if (PyModule_AddObject(m, "ERROR_NAMES", errors) < 0) {
        Py_DECREF(errors);
        return -1;
    }
#define STR_ITEM(name) #name,
    static const char *const pooled[] = {GM_EACH_POOLED_STAT(STR_ITEM)};
    static const char *const counters[] = {GM_EACH_COUNTER(STR_ITEM) GM_EACH_SETTING(STR_ITEM)};
#undef STR_ITEM
    if (gm_py_add_str_tuple(m, "POOLED_STAT_NAMES", pooled, sizeof pooled / sizeof pooled[0]) < 0 ||
        gm_py_add_str_tuple(m, "COUNTER_NAMES", counters, sizeof counters / sizeof counters[0]) < 0)
        return -1;
    return 0;
}
