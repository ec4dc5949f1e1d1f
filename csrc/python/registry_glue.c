/*
 * registry_glue.c -- the process-wide heap registry (heap_registry.h) from
 * Python: the heaps torch's, CuPy's and Numba's allocations share, so that one
 * process has one heap per GPU, one cap, one empty_cache and one snapshot
 * whichever library asked.
 *
 *   registry_heap(device, open=True) -> a gpumem.Heap borrowing the device's
 *       heap (created now, over CUDA, when open and there is none), or None.
 *       It has every method of a Heap of its own; closing or dropping it only
 *       lets go of the heap.
 *   registry_devices(), registry_configure(**options), registry_options(),
 *   registry_open_sim(device, capacity), registry_history_enable(n),
 *   registry_empty_cache()
 *   _shared_malloc(heap, size, stream, context) -> address on a Heap (the
 *       registry's, borrowed), or None when it is out of memory (after an
 *       empty_cache and a second try, as torch's entry point does; the pages a
 *       failed try mapped are given back).  The caller words the error:
 *       gpumem.explain has the heap's last_oom.
 *
 * `context` is stored with the block; gpumem/_backend.py puts the framework's
 * tag in its bits 55..62 (GM_CTX_FRAMEWORK_MASK, history_glue.h) and the
 * caller's stack id in the rest.  The GIL is released around every call into
 * the core that may wait for the device.
 */
#include "heap_object.h"

#include <stdint.h>

#include "convert.h"
#include "config_glue.h"
#include "heap_registry.h"
#include "history_glue.h"

int gm_registry_glue_add(PyObject *module);

/* The heap of `device`, created now if need be; NULL with a RuntimeError set:
 * the registry's reason. */
static gm_heap *heap_of(int device) {
    gm_heap *h = gm_heap_registry_get(device);
    if (h) return h;
    char err[512] = "";
    Py_BEGIN_ALLOW_THREADS h = gm_heap_registry_open(device, err, sizeof err);
    Py_END_ALLOW_THREADS if (!h) {
        PyErr_Format(PyExc_RuntimeError, "%s", err[0] ? err : "unknown reason");
        return NULL;
    }
    return h;
}

static PyObject *r_heap(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kw) {
    static char *names[] = {"device", "open", NULL};
    PyObject *dev;
    int device, open = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|p:registry_heap", names, &dev, &open) ||
        gm_py_device_index(dev, &device) < 0)
        return NULL;
    if (!open && !gm_heap_registry_get(device)) Py_RETURN_NONE;
    if (!heap_of(device)) return NULL;
    return gm_py_heap_borrow(device);
}

static PyObject *r_devices(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    PyObject *l = PyList_New(0);
    for (int d = 0; l != NULL && d < GM_HEAP_REGISTRY_MAX_DEVICES; d++) {
        if (!gm_heap_registry_get(d)) continue;
        PyObject *i = PyLong_FromLong(d);
        if (i == NULL || PyList_Append(l, i) < 0) Py_CLEAR(l);
        Py_XDECREF(i);
    }
    return l;
}

static PyObject *r_configure(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kw) {
    static char *names[] = {
        "va_size",      "cap_bytes", "cap_fraction", "growth_slack", "growth_slack_pages", "history_entries",
        "chunk_pages",  "page_size", "pressure",     "spill",        "spill_choice",       "stream_handoff",
        "split_chunks", NULL};
    gm_heap_registry_options o;
    gm_heap_registry_get_options(&o);
    unsigned long long hist = o.history_entries, page = o.page_size;
    double frac = o.cap_fraction;
    PyObject *va = NULL, *cap = NULL, *slack = NULL, *slack_pages = NULL, *chunk = NULL, *pressure = NULL;
    PyObject *spill = NULL, *choice = NULL, *handoff = NULL, *split = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|$OOdOOKOKOOOOO:registry_configure", names, &va, &cap, &frac, &slack,
                                     &slack_pages, &hist, &chunk, &page, &pressure, &spill, &choice, &handoff, &split))
        return NULL;
    /* The heap's options: None gives the core's default, the core checks the rest. */
    if (gm_py_config_option(&o.heap, GM_OPT_VA_SIZE, "va_size", va) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_CAP_BYTES, "cap_bytes", cap) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_GROWTH_SLACK, "growth_slack", slack) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_GROWTH_SLACK_PAGES, "growth_slack_pages", slack_pages) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_CHUNK_PAGES, "chunk_pages", chunk) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_PRESSURE, "pressure", pressure) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_SPILL, "spill", spill) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_SPILL_CHOICE, "spill_choice", choice) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_STREAM_HANDOFF, "stream_handoff", handoff) < 0 ||
        gm_py_config_option(&o.heap, GM_OPT_SPLIT_CHUNKS, "split_chunks", split) < 0)
        return NULL;
    o.cap_fraction = frac;
    o.history_entries = (size_t)hist;
    o.page_size = (size_t)page;
    char err[256];
    if (gm_heap_registry_configure(&o, err, sizeof err) != GM_OK) return PyErr_Format(PyExc_ValueError, "%s", err);
    Py_RETURN_NONE;
}

static PyObject *r_options(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    gm_heap_registry_options o;
    gm_heap_registry_get_options(&o);
    return Py_BuildValue("{s:K,s:K,s:d,s:d,s:K,s:K,s:K,s:K,s:d,s:K,s:s,s:K,s:K}", "va_size",
                         (unsigned long long)o.heap.va_size, "cap_bytes", (unsigned long long)o.heap.cap_bytes,
                         "cap_fraction", o.cap_fraction, "growth_slack", o.heap.growth_slack, "growth_slack_pages",
                         (unsigned long long)o.heap.growth_slack_pages, "history_entries",
                         (unsigned long long)o.history_entries, "chunk_pages", (unsigned long long)o.heap.chunk_pages,
                         "page_size", (unsigned long long)o.page_size, "pressure", o.heap.pressure, "spill",
                         (unsigned long long)o.heap.spill, "spill_choice",
                         o.heap.spill_choice == GM_SPILL_NEW       ? "new"
                         : o.heap.spill_choice == GM_SPILL_LASTING ? "lasting"
                                                                   : "old",
                         "stream_handoff", (unsigned long long)o.heap.stream_handoff, "split_chunks",
                         (unsigned long long)o.heap.split_chunks);
}

static PyObject *r_open_sim(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *dev;
    unsigned long long capacity;
    int device;
    if (!PyArg_ParseTuple(args, "OK:registry_open_sim", &dev, &capacity) || gm_py_device_index(dev, &device) < 0)
        return NULL;
    char err[512] = "";
    if (gm_heap_registry_open_sim(device, (size_t)capacity, err, sizeof err) != GM_OK)
        return PyErr_Format(PyExc_ValueError, "%s", err);
    Py_RETURN_NONE;
}

static PyObject *r_history_enable(PyObject *Py_UNUSED(m), PyObject *a) {
    uint64_t n;
    if (gm_py_to_u64(a, "max_entries", UINT64_MAX, &n) < 0) return NULL;
    int rc = gm_heap_registry_history_enable((size_t)n);
    if (rc == GM_EINVAL)
        return PyErr_Format(PyExc_ValueError, "history of %llu entries is too long", (unsigned long long)n);
    if (rc != GM_OK) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *r_empty_cache(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    Py_BEGIN_ALLOW_THREADS gm_heap_registry_empty_cache();
    Py_END_ALLOW_THREADS Py_RETURN_NONE;
}

static PyObject *s_malloc(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *heap_o;
    size_t size;
    uint64_t stream, context;
    if (!PyArg_ParseTuple(args, "OO&O&O&:_shared_malloc", &heap_o, gm_py_size_arg, &size, gm_py_stream_arg, &stream,
                          gm_py_context_arg, &context))
        return NULL;
    if (!gm_py_is_heap(heap_o))
        return PyErr_Format(PyExc_TypeError, "_shared_malloc: heap must be a gpumem.Heap, not %.100s",
                            Py_TYPE(heap_o)->tp_name);
    HeapObject *self = (HeapObject *)heap_o;
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    gm_heap *h = self->heap;
    uintptr_t p = 0;
    int rc;
    ENTER_CORE(self);
    rc = gm_malloc(h, size, (gm_stream)stream, context, &p);
    if (rc == GM_ENOMEM) {
        /* What other streams freed since may be reusable now. */
        gm_empty_cache(h);
        rc = gm_malloc(h, size, (gm_stream)stream, context, &p);
    }
    if (rc == GM_ENOMEM || rc == GM_EINVAL)
        gm_empty_cache(h); /* a failed try may have grown the heap: give that back */
    LEAVE_CORE(self);
    if (rc == GM_OK) return PyLong_FromUnsignedLongLong((unsigned long long)p);
    if (rc == GM_ENOMEM || rc == GM_EINVAL) Py_RETURN_NONE;
    return PyErr_Format(PyExc_RuntimeError, "gpumem: allocation of %zu bytes on %s failed: %s (%s)", size,
                        self->dev->name, gm_strerror(rc), self->dev->last_error);
}

static PyObject *s_tags(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    return Py_BuildValue("{s:i,s:K,s:i,s:i}", "shift", GM_CTX_FRAMEWORK_SHIFT, "mask",
                         (unsigned long long)GM_CTX_FRAMEWORK_MASK, "cupy", GM_FRAMEWORK_CUPY, "numba",
                         GM_FRAMEWORK_NUMBA);
}

static PyMethodDef shared_methods[] = {
    GM_PY_FN(
        "registry_heap", r_heap, METH_VARARGS | METH_KEYWORDS,
        "registry_heap(device, open=True) -> a Heap borrowing the process-wide heap of device (the one torch, CuPy and "
        "Numba allocate from), or None when it has none and open is false"),
    GM_PY_FN("registry_devices", r_devices, METH_NOARGS,
             "registry_devices() -> the devices that have a heap in the registry"),
    GM_PY_FN(
        "registry_configure", r_configure, METH_VARARGS | METH_KEYWORDS,
        "registry_configure(*, va_size, cap_bytes, cap_fraction, growth_slack, growth_slack_pages, history_entries, "
        "chunk_pages, page_size, pressure): options of the registry's heaps (caps apply to existing heaps too)"),
    GM_PY_FN("registry_options", r_options, METH_NOARGS, "registry_options() -> dict of the registry's heap options"),
    GM_PY_FN("registry_open_sim", r_open_sim, METH_VARARGS,
             "registry_open_sim(device, capacity): serve device with a heap over a simulated device (tests)"),
    GM_PY_FN(
        "registry_history_enable", r_history_enable, METH_O,
        "registry_history_enable(max_entries): keep the last max_entries events on every registry heap, now and later "
        "(0: off)"),
    GM_PY_FN("registry_empty_cache", r_empty_cache, METH_NOARGS,
             "registry_empty_cache(): empty_cache on every registry heap not capturing a CUDA graph"),
    GM_PY_FN("_shared_malloc", s_malloc, METH_VARARGS,
             "_shared_malloc(heap, size, stream, context) -> address, or None when out of memory (after an "
             "empty_cache and a second try)"),
    GM_PY_FN("_framework_tags", s_tags, METH_NOARGS,
             "_framework_tags() -> where a context keeps the framework tag, and the tags"),
    {.ml_name = NULL},
};

int gm_registry_glue_add(PyObject *module) { return PyModule_AddFunctions(module, shared_methods); }
