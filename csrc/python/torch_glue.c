/*
 * torch_glue.c -- what gpumem.torch (gpumem/torch/) needs from C: options for the heaps
 * torch's allocations go to, the addresses of the entry points it hands to
 * torch, and read access to the per-device heaps (stats, snapshot, history,
 * reports) in the same shapes as gpumem.Heap's methods, and its private pools
 * (_torch_pool_*: retain/release, the live blocks cudagraph trees checkpoint).
 *
 * Registered on gpumem._C by gm_torch_glue_add() (called from module.c), all
 * under names starting "_torch_".  Functions that take a device return None
 * when torch has not allocated on that device yet.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <inttypes.h>
#include <string.h>

#include "common.h"
#include "config_glue.h"
#include "torch_alloc.h"

int gm_torch_glue_add(PyObject *module);

/* ---- configuration -------------------------------------------------------------- */

static PyObject *g_configure(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kw) {
    static char *names[] = {"va_size",         "cap_bytes", "cap_fraction", "growth_slack", "growth_slack_pages",
                            "history_entries", "oom_mode",  "oom_class",    "chunk_pages",  "page_size",
                            "pressure",        NULL};
    gm_torch_options o;
    gm_torch_get_options(&o);
    unsigned long long hist = o.history_entries, page = o.page_size;
    double frac = o.cap_fraction;
    PyObject *va = NULL, *cap = NULL, *slack = NULL, *slack_pages = NULL, *chunk = NULL, *pressure = NULL;
    const char *mode = NULL;
    PyObject *cls = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOdOOKzOOKO", names, &va, &cap, &frac, &slack, &slack_pages, &hist,
                                     &mode, &cls, &chunk, &page, &pressure))
        return NULL;
    /* The heap's options: None gives the core's default, the core checks the rest. */
    if (gm_py_config_option(&o.heap, GM_OPT_VA_SIZE, "va_size", va) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_CAP_BYTES, "cap_bytes", cap) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_GROWTH_SLACK, "growth_slack", slack) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_GROWTH_SLACK_PAGES, "growth_slack_pages", slack_pages) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_CHUNK_PAGES, "chunk_pages", chunk) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_PRESSURE, "pressure", pressure) < 0)
        return NULL;
    o.page_size = (size_t)page;
    o.cap_fraction = frac;
    o.history_entries = (size_t)hist;
    if (mode) {
        if (strcmp(mode, "torch") == 0)
            o.oom_mode = GM_TORCH_OOM_TORCH;
        else if (strcmp(mode, "runtime") == 0)
            o.oom_mode = GM_TORCH_OOM_RUNTIME;
        else
            return PyErr_Format(PyExc_ValueError, "oom_mode must be 'torch' or 'runtime', not '%s'", mode);
    }
    char err[256];
    if (gm_torch_configure(&o, err, sizeof err) != GM_OK) return PyErr_Format(PyExc_ValueError, "%s", err);
    if (cls != NULL) {
        if (cls == Py_None)
            gm_torch_set_oom_class(NULL);
        else if (PyType_Check(cls) && PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_BaseException))
            gm_torch_set_oom_class(cls);
        else
            return PyErr_Format(PyExc_TypeError, "oom_class must be an exception class or None");
    }
    Py_RETURN_NONE;
}

static PyObject *g_options(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    gm_torch_options o;
    gm_torch_get_options(&o);
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    if (gm_py_put_u64(d, "va_size", o.heap.va_size) < 0 || gm_py_put_u64(d, "cap_bytes", o.heap.cap_bytes) < 0 ||
        gm_py_put(d, "cap_fraction", PyFloat_FromDouble(o.cap_fraction)) < 0 ||
        gm_py_put(d, "growth_slack", PyFloat_FromDouble(o.heap.growth_slack)) < 0 ||
        gm_py_put_u64(d, "growth_slack_pages", o.heap.growth_slack_pages) < 0 ||
        gm_py_put_u64(d, "history_entries", o.history_entries) < 0 ||
        gm_py_put_u64(d, "chunk_pages", o.heap.chunk_pages) < 0 || gm_py_put_u64(d, "page_size", o.page_size) < 0 ||
        gm_py_put(d, "pressure", PyFloat_FromDouble(o.heap.pressure)) < 0 ||
        gm_py_put(d, "oom_mode", PyUnicode_FromString(o.oom_mode == GM_TORCH_OOM_TORCH ? "torch" : "runtime")) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *g_entry_points(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    if (gm_py_put(d, "alloc", gm_py_fn_address((void (*)(void))gpumem_torch_alloc)) < 0 ||
        gm_py_put(d, "free", gm_py_fn_address((void (*)(void))gpumem_torch_free)) < 0 ||
        gm_py_put(d, "empty_cache", gm_py_fn_address((void (*)(void))gpumem_torch_empty_cache)) < 0 ||
        gm_py_put(d, "memory_fraction", gm_py_fn_address((void (*)(void))gpumem_torch_memory_fraction)) < 0 ||
        gm_py_put(d, "record_stream", gm_py_fn_address((void (*)(void))gpumem_torch_record_stream)) < 0 ||
        gm_py_put(d, "init", gm_py_fn_address((void (*)(void))gpumem_torch_init)) < 0 ||
        gm_py_put(d, "begin_allocate_to_pool", PyLong_FromUnsignedLongLong(gm_torch_pool_hook(GM_TORCH_HOOK_BEGIN))) <
            0 ||
        gm_py_put(d, "end_allocate_to_pool", PyLong_FromUnsignedLongLong(gm_torch_pool_hook(GM_TORCH_HOOK_END))) < 0 ||
        gm_py_put(d, "release_pool", PyLong_FromUnsignedLongLong(gm_torch_pool_hook(GM_TORCH_HOOK_RELEASE))) < 0 ||
        gm_py_put(d, "pool_begin", gm_py_fn_address((void (*)(void))gpumem_torch_pool_begin)) < 0 ||
        gm_py_put(d, "pool_end", gm_py_fn_address((void (*)(void))gpumem_torch_pool_end)) < 0 ||
        gm_py_put(d, "pool_release", gm_py_fn_address((void (*)(void))gpumem_torch_pool_release)) < 0 ||
        gm_py_put(d, "raw_delete", gm_py_fn_address((void (*)(void))gpumem_torch_raw_delete)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* An address from Python (0: none) into the function pointer *fn of `size`
 * bytes: the other way round from gm_py_fn_address.  0, or -1 with an
 * exception set. */
static int get_fn(PyObject *a, void *fn, size_t size) {
    unsigned long long v = PyLong_AsUnsignedLongLong(a);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    uintptr_t u = (uintptr_t)v;
    memcpy(fn, &u, size);
    return 0;
}

static PyObject *g_set_context_hook(PyObject *Py_UNUSED(m), PyObject *a) {
    gm_torch_context_fn fn = NULL;
    if (get_fn(a, &fn, sizeof fn) < 0) return NULL;
    gpumem_torch_set_context_hook(fn);
    Py_RETURN_NONE;
}

static PyObject *g_set_oom_formatter(PyObject *Py_UNUSED(m), PyObject *a) {
    gm_torch_oom_formatter fn = NULL;
    if (get_fn(a, &fn, sizeof fn) < 0) return NULL;
    gpumem_torch_set_oom_formatter(fn);
    Py_RETURN_NONE;
}

/* ---- the registry ---------------------------------------------------------------- */

static PyObject *g_devices(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    PyObject *l = PyList_New(0);
    if (l == NULL) return NULL;
    for (int d = 0; d < GM_TORCH_MAX_DEVICES; d++) {
        if (!gm_torch_heap(d)) continue;
        PyObject *i = PyLong_FromLong(d);
        if (i == NULL || PyList_Append(l, i) < 0) {
            Py_XDECREF(i);
            Py_DECREF(l);
            return NULL;
        }
        Py_DECREF(i);
    }
    return l;
}

static PyObject *g_device_count(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    return PyLong_FromLong(gm_torch_device_count());
}

static PyObject *g_open(PyObject *Py_UNUSED(m), PyObject *a) {
    int device;
    if (gm_py_device_index(a, &device) < 0) return NULL;
    char err[300] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = gm_torch_open(device, err, sizeof err);
    Py_END_ALLOW_THREADS if (rc != GM_OK) return PyErr_Format(PyExc_RuntimeError, "%s", err);
    Py_RETURN_NONE;
}

#define HEAP_OR_NONE(arg, h)                                                                                           \
    int device_;                                                                                                       \
    if (gm_py_device_index((arg), &device_) < 0) return NULL;                                                          \
    gm_heap *h = gm_torch_heap(device_);                                                                               \
    if (h == NULL) Py_RETURN_NONE;

static PyObject *g_stats(PyObject *Py_UNUSED(m), PyObject *a) {
    HEAP_OR_NONE(a, h)
    gm_stats s;
    gm_get_stats(h, &s);
    return gm_py_stats_dict(&s);
}

static PyObject *g_reset_peak(PyObject *Py_UNUSED(m), PyObject *a) {
    HEAP_OR_NONE(a, h)
    gm_reset_peak_stats(h);
    Py_RETURN_TRUE;
}

static PyObject *g_reset_accumulated(PyObject *Py_UNUSED(m), PyObject *a) {
    HEAP_OR_NONE(a, h)
    gm_reset_accumulated_stats(h);
    Py_RETURN_TRUE;
}

static PyObject *g_snapshot(PyObject *Py_UNUSED(m), PyObject *a) {
    HEAP_OR_NONE(a, h)
    gm_snapshot *snap = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = gm_snapshot_take(h, &snap);
    Py_END_ALLOW_THREADS if (rc != GM_OK) return PyErr_Format(PyExc_RuntimeError, "gpumem snapshot failed: %s",
                                                              gm_strerror(rc));
    PyObject *d = gm_py_snapshot_dict(snap, "?");
    gm_snapshot_free(snap);
    return d;
}

static PyObject *g_history_enable(PyObject *Py_UNUSED(m), PyObject *a) {
    unsigned long long n = PyLong_AsUnsignedLongLong(a);
    if (n == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (n > (1ull << 32)) return PyErr_Format(PyExc_ValueError, "history of %llu entries is too long", n);
    gm_torch_options o;
    gm_torch_get_options(&o);
    o.history_entries = (size_t)n;
    char err[256];
    if (gm_torch_configure(&o, err, sizeof err) != GM_OK) return PyErr_Format(PyExc_ValueError, "%s", err);
    for (int d = 0; d < GM_TORCH_MAX_DEVICES; d++) {
        gm_heap *h = gm_torch_heap(d);
        if (h && gm_history_enable(h, (size_t)n) != GM_OK) return PyErr_NoMemory();
    }
    Py_RETURN_NONE;
}

static PyObject *g_history(PyObject *Py_UNUSED(m), PyObject *a) {
    HEAP_OR_NONE(a, h)
    return gm_py_history(h, "?");
}

static PyObject *g_memory_report(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *dev_o;
    unsigned long long size = 0;
    if (!PyArg_ParseTuple(args, "O|K", &dev_o, &size)) return NULL;
    HEAP_OR_NONE(dev_o, h)
    gm_oom_info info;
    Py_BEGIN_ALLOW_THREADS gm_memory_report(h, (size_t)size, &info);
    Py_END_ALLOW_THREADS return gm_py_oom_dict(&info);
}

static PyObject *g_last_oom(PyObject *Py_UNUSED(m), PyObject *a) {
    HEAP_OR_NONE(a, h)
    gm_oom_info info;
    if (gm_last_oom(h, &info) != GM_OK) Py_RETURN_NONE;
    return gm_py_oom_dict(&info);
}

/* The message an allocation of `size` bytes would fail with now. */
static PyObject *g_format_oom(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *dev_o;
    unsigned long long size = 0;
    if (!PyArg_ParseTuple(args, "O|K", &dev_o, &size)) return NULL;
    HEAP_OR_NONE(dev_o, h)
    gm_oom_info info;
    char buf[GM_TORCH_OOM_MSG_MAX];
    Py_BEGIN_ALLOW_THREADS gm_memory_report(h, (size_t)size, &info);
    gm_torch_format_oom(device_, &info, buf, sizeof buf);
    Py_END_ALLOW_THREADS return PyUnicode_FromString(buf);
}

static PyObject *g_empty_cache(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    Py_BEGIN_ALLOW_THREADS gpumem_torch_empty_cache();
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *g_set_cap(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *dev_o;
    unsigned long long cap;
    if (!PyArg_ParseTuple(args, "OK", &dev_o, &cap)) return NULL;
    HEAP_OR_NONE(dev_o, h)
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = gm_torch_set_cap(device_, (size_t)cap);
    Py_END_ALLOW_THREADS if (rc != GM_OK) return PyErr_Format(PyExc_RuntimeError, "gpumem set_cap: %s",
                                                              gm_strerror(rc));
    Py_RETURN_TRUE;
}

static PyObject *g_get_cap(PyObject *Py_UNUSED(m), PyObject *a) {
    HEAP_OR_NONE(a, h)
    return PyLong_FromUnsignedLongLong(gm_get_cap(h));
}

static PyObject *g_check(PyObject *Py_UNUSED(m), PyObject *a) {
    HEAP_OR_NONE(a, h)
    char why[512] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = gm_check(h, why, sizeof why);
    Py_END_ALLOW_THREADS if (rc != GM_OK) return PyErr_Format(PyExc_RuntimeError,
                                                              "gpumem heap of device %d is corrupt: %s", device_, why);
    Py_RETURN_TRUE;
}

static PyObject *g_counters(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    gm_torch_counters c;
    gm_torch_get_counters(&c);
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    if (gm_py_put_u64(d, "ooms", c.ooms) < 0 || gm_py_put_u64(d, "oom_retries", c.oom_retries) < 0 ||
        gm_py_put_u64(d, "free_errors", c.free_errors) < 0 ||
        gm_py_put_u64(d, "empty_cache_calls", c.empty_cache_calls) < 0 ||
        gm_py_put_u64(d, "record_stream_calls", c.record_stream_calls) < 0 ||
        gm_py_put_u64(d, "fraction_calls", c.fraction_calls) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* ---- private pools ------------------------------------------------------------------ */

/* A pool id: torch's MempoolId_t as a pair of non-negative ints. */
static int get_pool_id(PyObject *o, gm_pool_id *id) {
    unsigned long long a, b;
    if (!PyArg_ParseTuple(o, "KK;a pool id is a pair of ints", &a, &b)) return -1;
    id->first = a;
    id->second = b;
    return 0;
}

static PyObject *pool_id_tuple(gm_pool_id id) {
    return Py_BuildValue("(KK)", (unsigned long long)id.first, (unsigned long long)id.second);
}

/* (device, (first, second)) -> the heap and the id; NULL heap (no error) when
 * torch has not allocated on the device. */
static int device_pool_args(PyObject *args, int *device, gm_pool_id *id, gm_heap **h) {
    PyObject *dev, *pool;
    if (!PyArg_ParseTuple(args, "OO", &dev, &pool) || gm_py_device_index(dev, device) < 0 || get_pool_id(pool, id) < 0)
        return -1;
    *h = gm_torch_heap(*device);
    return 0;
}

static PyObject *pool_error(int rc, const char *what, gm_pool_id id) {
    return PyErr_Format(rc == GM_EINVAL ? PyExc_ValueError : PyExc_RuntimeError, "gpumem: %s pool (%llu, %llu): %s",
                        what, (unsigned long long)id.first, (unsigned long long)id.second, gm_strerror(rc));
}

static PyObject *g_pool_retain(PyObject *Py_UNUSED(m), PyObject *args) {
    int device;
    gm_pool_id id;
    gm_heap *h;
    if (device_pool_args(args, &device, &id, &h) < 0) return NULL;
    if (h == NULL) {
        char err[512] = "";
        if (gm_torch_open(device, err, sizeof err) != GM_OK) return PyErr_Format(PyExc_RuntimeError, "%s", err);
        h = gm_torch_heap(device);
    }
    int rc = gm_pool_retain(h, id);
    if (rc != GM_OK) return pool_error(rc, "cannot retain", id);
    Py_RETURN_NONE;
}

static PyObject *g_pool_release(PyObject *Py_UNUSED(m), PyObject *args) {
    int device;
    gm_pool_id id;
    gm_heap *h;
    if (device_pool_args(args, &device, &id, &h) < 0) return NULL;
    int rc = h ? gm_pool_release(h, id) : GM_EINVAL;
    if (rc != GM_OK) return pool_error(rc, "cannot release", id);
    Py_RETURN_NONE;
}

static PyObject *g_pool_info(PyObject *Py_UNUSED(m), PyObject *args) {
    int device;
    gm_pool_id id;
    gm_heap *h;
    gm_pool_info info;
    if (device_pool_args(args, &device, &id, &h) < 0) return NULL;
    if (h == NULL || gm_pool_info_get(h, id, &info) != GM_OK) Py_RETURN_NONE;
    return gm_py_pool_info_dict(&info);
}

/* _torch_pool_pause(device, pool, backup) / _torch_pool_resume(device, pool):
 * {pages, bytes, shared_pages, backup_bytes, seconds}.  Errors: ValueError for
 * an unknown pool; RuntimeError naming the reason otherwise. */
static PyObject *pause_fail(gm_heap *h, int rc, const char *what, gm_pool_id id) {
    const char *why = gm_heap_device(h)->last_error;
    if (rc == GM_EINVAL) return pool_error(rc, what, id);
    if (rc == GM_EPAUSED)
        return PyErr_Format(PyExc_RuntimeError, "gpumem: %s pool (%llu, %llu): it is already paused (GM_EPAUSED)", what,
                            (unsigned long long)id.first, (unsigned long long)id.second);
    if (rc == GM_ECAPTURING)
        return PyErr_Format(PyExc_RuntimeError,
                            "gpumem: %s pool (%llu, %llu): not allowed while a CUDA graph is being captured "
                            "(or a use_mem_pool block is open) (GM_ECAPTURING)",
                            what, (unsigned long long)id.first, (unsigned long long)id.second);
    return PyErr_Format(PyExc_RuntimeError, "gpumem: %s pool (%llu, %llu): %s (%s)%s%s", what,
                        (unsigned long long)id.first, (unsigned long long)id.second, gm_strerror(rc),
                        gm_py_code_name(rc), (rc == GM_EDEVICE || rc == GM_ENOMEM) && why[0] ? ": " : "",
                        (rc == GM_EDEVICE || rc == GM_ENOMEM) ? why : "");
}

static PyObject *g_pool_pause(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *dev, *pool;
    int device, backup = 0;
    gm_pool_id id;
    if (!PyArg_ParseTuple(args, "OO|p", &dev, &pool, &backup) || gm_py_device_index(dev, &device) < 0 ||
        get_pool_id(pool, &id) < 0)
        return NULL;
    gm_heap *h = gm_torch_heap(device);
    if (h == NULL) return pool_error(GM_EINVAL, "cannot pause", id);
    gm_pause_info info;
    int rc;
    double t0 = gm_py_monotonic_s(), t1;
    Py_BEGIN_ALLOW_THREADS rc = gm_pool_pause(h, id, backup ? GM_PAUSE_BACKUP : 0, &info);
    Py_END_ALLOW_THREADS t1 = gm_py_monotonic_s();
    gm_pool_info pi;
    /* A device failure part way leaves the pool paused with what was released. */
    if (rc == GM_EDEVICE && gm_pool_info_get(h, id, &pi) == GM_OK && pi.paused)
        return PyErr_Format(PyExc_RuntimeError,
                            "gpumem: cannot pause pool (%llu, %llu) fully: %s (%s): %s; the pool is paused with the "
                            "%zu pages released before the failure (resume it to map them back)",
                            (unsigned long long)id.first, (unsigned long long)id.second, gm_strerror(rc),
                            gm_py_code_name(rc), gm_heap_device(h)->last_error, pi.paused_pages);
    if (rc != GM_OK) return pause_fail(h, rc, "cannot pause", id);
    return gm_py_pause_dict(h, &info, t1 - t0);
}

static PyObject *g_pool_resume(PyObject *Py_UNUSED(m), PyObject *args) {
    int device;
    gm_pool_id id;
    gm_heap *h;
    if (device_pool_args(args, &device, &id, &h) < 0) return NULL;
    if (h == NULL) return pool_error(GM_EINVAL, "cannot resume", id);
    gm_pause_info info;
    int rc;
    double t0 = gm_py_monotonic_s(), t1;
    Py_BEGIN_ALLOW_THREADS rc = gm_pool_resume(h, id, &info);
    Py_END_ALLOW_THREADS t1 = gm_py_monotonic_s();
    gm_pool_info pi;
    if (rc == GM_EINVAL && gm_pool_info_get(h, id, &pi) == GM_OK)
        return PyErr_Format(PyExc_RuntimeError, "gpumem: cannot resume pool (%llu, %llu): it is not paused",
                            (unsigned long long)id.first, (unsigned long long)id.second);
    if (rc != GM_OK) return pause_fail(h, rc, "cannot resume", id);
    return gm_py_pause_dict(h, &info, t1 - t0);
}

static PyObject *g_pools(PyObject *Py_UNUSED(m), PyObject *a) {
    int device;
    if (gm_py_device_index(a, &device) < 0) return NULL;
    gm_heap *h = gm_torch_heap(device);
    PyObject *out = PyList_New(0);
    if (out == NULL || h == NULL) return out;
    size_t cap = 16, n;
    gm_pool_info *buf = NULL;
    for (;;) {
        PyMem_Free(buf);
        buf = PyMem_Calloc(cap, sizeof *buf);
        if (buf == NULL) {
            Py_DECREF(out);
            return PyErr_NoMemory();
        }
        n = gm_pool_list(h, buf, cap);
        if (n <= cap) break;
        cap = n + 16;
    }
    for (size_t i = 0; i < n; i++) {
        PyObject *d = gm_py_pool_info_dict(&buf[i]);
        if (d == NULL || PyList_Append(out, d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(out);
            PyMem_Free(buf);
            return NULL;
        }
        Py_DECREF(d);
    }
    PyMem_Free(buf);
    return out;
}

/* [(addr, size), ...] of the pool's live blocks, address order. */
static PyObject *g_pool_live(PyObject *Py_UNUSED(m), PyObject *args) {
    int device;
    gm_pool_id id;
    gm_heap *h;
    if (device_pool_args(args, &device, &id, &h) < 0) return NULL;
    if (h == NULL) return PyList_New(0);
    size_t cap = 64, n;
    uintptr_t *addrs = NULL;
    size_t *sizes = NULL;
    for (;;) {
        PyMem_Free(addrs);
        PyMem_Free(sizes);
        addrs = PyMem_Calloc(cap, sizeof *addrs);
        sizes = PyMem_Calloc(cap, sizeof *sizes);
        if (addrs == NULL || sizes == NULL) {
            PyMem_Free(addrs);
            PyMem_Free(sizes);
            return PyErr_NoMemory();
        }
        n = gm_pool_live(h, id, addrs, sizes, cap);
        if (n <= cap) break;
        cap = n + 64;
    }
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *t = Py_BuildValue("(KK)", (unsigned long long)addrs[i], (unsigned long long)sizes[i]);
        if (t == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    PyMem_Free(addrs);
    PyMem_Free(sizes);
    return out;
}

/* _torch_pool_set_live(device, pool, [(addr, size), ...], stream) */
static PyObject *g_pool_set_live(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *dev, *pool, *blocks;
    unsigned long long stream;
    int device;
    gm_pool_id id;
    if (!PyArg_ParseTuple(args, "OOOK", &dev, &pool, &blocks, &stream) || gm_py_device_index(dev, &device) < 0 ||
        get_pool_id(pool, &id) < 0)
        return NULL;
    gm_heap *h = gm_torch_heap(device);
    if (h == NULL) return PyErr_Format(PyExc_ValueError, "gpumem has no heap on cuda:%d", device);
    /* A tuple copy: an item's conversion may run Python code that changes the list. */
    PyObject *seq = gm_py_tuple_of(blocks);
    if (seq == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    uintptr_t *addrs = PyMem_Calloc((size_t)n + 1, sizeof *addrs);
    size_t *sizes = PyMem_Calloc((size_t)n + 1, sizeof *sizes);
    PyObject *ret = NULL;
    if (addrs == NULL || sizes == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long a, b;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(seq, i), "KK;a block is (addr, size)", &a, &b)) goto done;
        addrs[i] = (uintptr_t)a;
        sizes[i] = (size_t)b;
    }
    int rc = gm_pool_set_live(h, id, addrs, sizes, (size_t)n, (gm_stream)stream);
    if (rc != GM_OK) {
        pool_error(rc, "cannot restore the live blocks of", id);
        goto done;
    }
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyMem_Free(addrs);
    PyMem_Free(sizes);
    Py_DECREF(seq);
    return ret;
}

static PyObject *g_active_pools(PyObject *Py_UNUSED(m), PyObject *a) {
    int device;
    if (gm_py_device_index(a, &device) < 0) return NULL;
    gm_pool_id ids[64];
    size_t n = gm_torch_active_pools(device, ids, 64);
    if (n > 64) n = 64;
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *t = pool_id_tuple(ids[i]);
        if (t == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    return out;
}

static PyObject *g_capturing(PyObject *Py_UNUSED(m), PyObject *a) {
    HEAP_OR_NONE(a, h)
    return PyBool_FromLong(gm_capturing(h));
}

static PyObject *g_cxx11_abi(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    return PyLong_FromLong(gm_torch_cxx11_abi());
}

static PyObject *g_open_sim(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *dev;
    unsigned long long capacity;
    int device;
    if (!PyArg_ParseTuple(args, "OK", &dev, &capacity) || gm_py_device_index(dev, &device) < 0) return NULL;
    char err[512] = "";
    if (gm_torch_open_sim(device, (size_t)capacity, err, sizeof err) != GM_OK)
        return PyErr_Format(PyExc_ValueError, "%s", err);
    Py_RETURN_NONE;
}

static PyObject *g_set_oom_observer(PyObject *Py_UNUSED(m), PyObject *fn) {
    if (fn != Py_None && !PyCallable_Check(fn))
        return PyErr_Format(PyExc_TypeError, "an OOM observer must be callable or None, not %.80s",
                            Py_TYPE(fn)->tp_name);
    gm_torch_set_oom_observer(fn == Py_None ? NULL : fn);
    Py_RETURN_NONE;
}

/* Test hook: torch's allocation entry point, its exceptions raised here as
 * torch would raise them. */
static PyObject *g_test_alloc(PyObject *Py_UNUSED(m), PyObject *args) {
    unsigned long long size, stream = 0;
    PyObject *dev;
    int device;
    if (!PyArg_ParseTuple(args, "KO|K", &size, &dev, &stream) || gm_py_device_index(dev, &device) < 0) return NULL;
    uintptr_t p = 0;
    void *exc[3] = {NULL, NULL, NULL};
    char msg[GM_TORCH_OOM_MSG_MAX] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS rc =
        gm_torch_test_alloc((size_t)size, device, (void *)(uintptr_t)stream, &p, exc, msg, sizeof msg);
    Py_END_ALLOW_THREADS if (rc == 1) {
        PyErr_Restore((PyObject *)exc[0], (PyObject *)exc[1], (PyObject *)exc[2]);
        return NULL;
    }
    if (rc == 2) return PyErr_Format(PyExc_RuntimeError, "%s", msg);
    return PyLong_FromUnsignedLongLong((unsigned long long)p);
}

/* Test hook: see gm_torch_test_hold_lock (torch_alloc.h). */
static PyObject *g_test_hold_lock(PyObject *Py_UNUSED(m), PyObject *args) {
    const char *which_s;
    PyObject *dev;
    double seconds;
    int device, which;
    if (!PyArg_ParseTuple(args, "sOd", &which_s, &dev, &seconds) || gm_py_device_index(dev, &device) < 0) return NULL;
    if (!strcmp(which_s, "slot"))
        which = GM_TORCH_TEST_LOCK_SLOT;
    else if (!strcmp(which_s, "options"))
        which = GM_TORCH_TEST_LOCK_OPTIONS;
    else if (!strcmp(which_s, "pools"))
        which = GM_TORCH_TEST_LOCK_POOLS;
    else
        return PyErr_Format(PyExc_ValueError, "lock must be 'slot', 'options' or 'pools', not %R",
                            PyTuple_GET_ITEM(args, 0));
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = gm_torch_test_hold_lock(which, device, seconds);
    Py_END_ALLOW_THREADS if (rc != GM_OK) return PyErr_Format(PyExc_ValueError, "cannot hold the lock: %s",
                                                              gm_strerror(rc));
    Py_RETURN_NONE;
}

#define M(name, fn, flags, doc)                                                                                        \
    {.ml_name = name, .ml_meth = (PyCFunction)(void (*)(void))fn, .ml_flags = flags, .ml_doc = doc}

static PyMethodDef glue_methods[] = {
    M("_torch_configure", g_configure, METH_VARARGS | METH_KEYWORDS,
      "_torch_configure(*, va_size, cap_bytes, cap_fraction, growth_slack, growth_slack_pages, "
      "history_entries, oom_mode, oom_class, chunk_pages, page_size, pressure): options for torch's heaps"),
    M("_torch_options", g_options, METH_NOARGS, "_torch_options() -> dict"),
    M("_torch_entry_points", g_entry_points, METH_NOARGS,
      "_torch_entry_points() -> {name: address} of the functions torch calls"),
    M("_torch_set_context_hook", g_set_context_hook, METH_O,
      "_torch_set_context_hook(address): uint64_t (*)(void) called before each allocation (0 clears)"),
    M("_torch_set_oom_formatter", g_set_oom_formatter, METH_O,
      "_torch_set_oom_formatter(address): replaces the out-of-memory message (0 clears)"),
    M("_torch_devices", g_devices, METH_NOARGS, "_torch_devices() -> devices that have a heap"),
    M("_torch_device_count", g_device_count, METH_NOARGS,
      "_torch_device_count() -> count torch reported (-1 before CUDA init)"),
    M("_torch_open", g_open, METH_O, "_torch_open(device): create the heap of a device now"),
    M("_torch_stats", g_stats, METH_O, "_torch_stats(device) -> dict or None"),
    M("_torch_reset_peak", g_reset_peak, METH_O, "_torch_reset_peak(device)"),
    M("_torch_reset_accumulated", g_reset_accumulated, METH_O, "_torch_reset_accumulated(device)"),
    M("_torch_snapshot", g_snapshot, METH_O, "_torch_snapshot(device) -> dict or None"),
    M("_torch_history_enable", g_history_enable, METH_O,
      "_torch_history_enable(max_entries): on every heap, now and later (0 turns it off)"),
    M("_torch_history", g_history, METH_O, "_torch_history(device) -> (entries, dropped) or None"),
    M("_torch_memory_report", g_memory_report, METH_VARARGS, "_torch_memory_report(device, size=0) -> dict or None"),
    M("_torch_last_oom", g_last_oom, METH_O, "_torch_last_oom(device) -> dict or None"),
    M("_torch_format_oom", g_format_oom, METH_VARARGS,
      "_torch_format_oom(device, size=0) -> the message such a request would fail with"),
    M("_torch_empty_cache", g_empty_cache, METH_NOARGS, "_torch_empty_cache(): every device"),
    M("_torch_set_cap", g_set_cap, METH_VARARGS, "_torch_set_cap(device, bytes)"),
    M("_torch_get_cap", g_get_cap, METH_O, "_torch_get_cap(device) -> int or None"),
    M("_torch_check", g_check, METH_O, "_torch_check(device): run the invariant checker"),
    M("_torch_counters", g_counters, METH_NOARGS, "_torch_counters() -> dict"),
    M("_torch_pool_retain", g_pool_retain, METH_VARARGS,
      "_torch_pool_retain(device, (a, b)): create the pool or add a use to it"),
    M("_torch_pool_release", g_pool_release, METH_VARARGS,
      "_torch_pool_release(device, (a, b)): drop one use; at zero the pool ends"),
    M("_torch_pool_info", g_pool_info, METH_VARARGS, "_torch_pool_info(device, (a, b)) -> dict or None"),
    M("_torch_pool_pause", g_pool_pause, METH_VARARGS,
      "_torch_pool_pause(device, (a, b), backup=False) -> dict: release the pool's own pages, keeping addresses"),
    M("_torch_pool_resume", g_pool_resume, METH_VARARGS,
      "_torch_pool_resume(device, (a, b)) -> dict: map pages behind a paused pool again (restoring a backup)"),
    M("_torch_pools", g_pools, METH_O, "_torch_pools(device) -> [dict] of the living pools"),
    M("_torch_pool_live", g_pool_live, METH_VARARGS,
      "_torch_pool_live(device, (a, b)) -> [(addr, size)] of the pool's live blocks"),
    M("_torch_pool_set_live", g_pool_set_live, METH_VARARGS,
      "_torch_pool_set_live(device, (a, b), [(addr, size)], stream): make these the live blocks"),
    M("_torch_active_pools", g_active_pools, METH_O,
      "_torch_active_pools(device) -> [(a, b)] pools allocations are routed to now, in order"),
    M("_torch_capturing", g_capturing, METH_O, "_torch_capturing(device) -> bool or None"),
    M("_torch_cxx11_abi", g_cxx11_abi, METH_NOARGS,
      "_torch_cxx11_abi() -> the _GLIBCXX_USE_CXX11_ABI the torch boundary was built with"),
    M("_torch_set_oom_observer", g_set_oom_observer, METH_O,
      "_torch_set_oom_observer(fn or None): fn(device, requested, allowed, device_free) runs before each OOM"),
    M("_torch_test_alloc", g_test_alloc, METH_VARARGS,
      "_torch_test_alloc(size, device, stream=0) -> address: torch's allocation entry point, raising as torch "
      "would (tests)"),
    M("_torch_open_sim", g_open_sim, METH_VARARGS,
      "_torch_open_sim(device, capacity): serve device with a simulated heap (tests)"),
    M("_test_hold_boundary_lock", g_test_hold_lock, METH_VARARGS,
      "_test_hold_boundary_lock(lock, device, seconds): test hook; a new native thread takes the torch "
      "boundary's lock ('slot' or 'pools' of device, or 'options') and holds it for seconds; returns once held"),
    {.ml_name = NULL},
};

int gm_torch_glue_add(PyObject *module) { return PyModule_AddFunctions(module, glue_methods); }
