/*
 * convert.c -- the core's values as Python objects, what the glue files and torch_alloc.cpp share (convert.h).
 */
#include "convert.h"

#include <inttypes.h>
#include <stddef.h>
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

/* torch's statistics are "{name}.{pool}.{field}": these pools and fields (STAT_POOLS, STAT_FIELDS). */
static const char *const pools[GM_POOL__COUNT] = {"all", "small_pool", "large_pool"};
static const char *const fields[4] = {"current", "peak", "allocated", "freed"};

PyObject *gm_py_stats_dict(const gm_stats *s) {
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

/* gm_oom_info's fields in the dict's order: each a size_t, but the stream (uint64_t) and the two
 * error codes (int). */
enum {
    OOM_SIZE,
    OOM_STREAM,
    OOM_INT
};
#define OOM_FIELD(name, kind) {#name, offsetof(gm_oom_info, name), kind}
static const struct {
    const char *key;
    size_t offset;
    int kind;
} oom_fields[] = {
    OOM_FIELD(request, OOM_SIZE),
    OOM_FIELD(stream, OOM_STREAM),
    OOM_FIELD(device_total, OOM_SIZE),
    OOM_FIELD(device_free, OOM_SIZE),
    OOM_FIELD(cap_bytes, OOM_SIZE),
    OOM_FIELD(live_bytes, OOM_SIZE),
    OOM_FIELD(pending_bytes, OOM_SIZE),
    OOM_FIELD(reserved_bytes, OOM_SIZE),
    OOM_FIELD(cached_bytes, OOM_SIZE),
    OOM_FIELD(free_mapped_bytes, OOM_SIZE),
    OOM_FIELD(largest_free_mapped, OOM_SIZE),
    OOM_FIELD(largest_possible, OOM_SIZE),
    OOM_FIELD(pages_needed, OOM_SIZE),
    OOM_FIELD(device_error, OOM_INT),
    OOM_FIELD(pool_live_bytes, OOM_SIZE),
    OOM_FIELD(pool_free_bytes, OOM_SIZE),
    OOM_FIELD(chunk_locked_bytes, OOM_SIZE),
    OOM_FIELD(spilled_bytes, OOM_SIZE),
    OOM_FIELD(spill_limit, OOM_SIZE),
    OOM_FIELD(spill_error, OOM_INT),
};
#undef OOM_FIELD

static int put_oom_field(PyObject *d, const gm_oom_info *o, size_t i) {
    const char *at = (const char *)o + oom_fields[i].offset;
    size_t size;
    gm_stream stream;
    int code;
    switch (oom_fields[i].kind) {
    case OOM_SIZE:
        memcpy(&size, at, sizeof size);
        return gm_py_put_u64(d, oom_fields[i].key, size);
    case OOM_STREAM:
        memcpy(&stream, at, sizeof stream);
        return gm_py_put_u64(d, oom_fields[i].key, stream);
    default:
        memcpy(&code, at, sizeof code);
        return gm_py_put_i64(d, oom_fields[i].key, code);
    }
}

PyObject *gm_py_oom_dict(const gm_oom_info *o) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    for (size_t i = 0; i < sizeof oom_fields / sizeof oom_fields[0]; i++) {
        if (put_oom_field(d, o, i) < 0) {
            Py_DECREF(d);
            return NULL;
        }
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
    static const char *const names[] = {"alloc", "free_requested", "free_completed", "map",     "unmap",  "remap",
                                        "oom",   "empty_cache",    "spill",          "unspill", "handoff"};
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
        gm_py_add_str_tuple(m, "COUNTER_NAMES", counters, sizeof counters / sizeof counters[0]) < 0 ||
        gm_py_add_str_tuple(m, "STAT_POOLS", pools, GM_POOL__COUNT) < 0 ||
        gm_py_add_str_tuple(m, "STAT_FIELDS", fields, sizeof fields / sizeof fields[0]) < 0)
        return -1;
    return 0;
}
