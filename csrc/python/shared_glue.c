/*
 * shared_glue.c -- other frameworks (CuPy, Numba) allocate from the per-device
 * heaps that torch's allocations go to (the registry of torch_alloc.h), so that
 * one process has one heap per GPU, one cap, one empty_cache and one snapshot
 * whichever library asked.
 *
 *   _shared_malloc(device, size, stream, context) -> address, or None when the
 *       heap is out of memory (after an empty_cache and a second try, as torch's
 *       entry point does; the pages a failed try mapped are given back).  The
 *       caller words the error: gpumem.explain has the heap's last_oom.
 *   _shared_free(device, address)
 *
 * `context` is stored with the block; gpumem/_shared.py puts the framework's
 * tag in its bits 55..62 (GM_CTX_FRAMEWORK_MASK, history_glue.h) and the
 * caller's stack id in the rest.  The heap is created on first use, with the
 * options gpumem.torch configured (or the defaults).  The GIL is released
 * around every call into the core: a malloc may wait for the device.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "common.h"
#include "history_glue.h"
#include "torch_alloc.h"

int gm_shared_glue_add(PyObject *module);

/* The heap of `device`, created now if need be; NULL with an exception set. */
static gm_heap *heap_of(int device) {
    gm_heap *h = gm_torch_heap(device);
    if (h) return h;
    char err[512] = "";
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = gm_torch_open(device, err, sizeof err);
    Py_END_ALLOW_THREADS if (rc != GM_OK || !(h = gm_torch_heap(device))) {
        PyErr_Format(PyExc_RuntimeError, "gpumem cannot open a heap on CUDA device %d: %s", device,
                     err[0] ? err : gm_strerror(rc));
        return NULL;
    }
    return h;
}

static PyObject *s_malloc(PyObject *Py_UNUSED(m), PyObject *args) {
    int device;
    unsigned long long size, stream, context;
    if (!PyArg_ParseTuple(args, "iKKK:_shared_malloc", &device, &size, &stream, &context)) return NULL;
    if (gm_py_check_device(device) < 0) return NULL;
    gm_heap *h = heap_of(device);
    if (!h) return NULL;
    uintptr_t p = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = gm_malloc(h, (size_t)size, (gm_stream)stream, (uint64_t)context, &p);
    if (rc == GM_ENOMEM) {
        /* What other streams freed since may be reusable now. */
        gm_empty_cache(h);
        rc = gm_malloc(h, (size_t)size, (gm_stream)stream, (uint64_t)context, &p);
    }
    if (rc == GM_ENOMEM || rc == GM_EINVAL)
        gm_empty_cache(h); /* a failed try may have grown the heap: give that back */
    Py_END_ALLOW_THREADS if (rc == GM_OK) return PyLong_FromUnsignedLongLong((unsigned long long)p);
    if (rc == GM_ENOMEM || rc == GM_EINVAL) Py_RETURN_NONE;
    return PyErr_Format(PyExc_RuntimeError, "gpumem: allocation of %llu bytes on GPU %d failed: %s (%s)", size, device,
                        gm_strerror(rc), gm_heap_device(h)->last_error);
}

static PyObject *s_free(PyObject *Py_UNUSED(m), PyObject *args) {
    int device;
    unsigned long long ptr;
    if (!PyArg_ParseTuple(args, "iK:_shared_free", &device, &ptr)) return NULL;
    if (gm_py_check_device(device) < 0) return NULL;
    gm_heap *h = gm_torch_heap(device);
    int rc = GM_EUNKNOWN_PTR;
    if (h) {
        Py_BEGIN_ALLOW_THREADS rc = gm_free(h, (uintptr_t)ptr);
        Py_END_ALLOW_THREADS
    }
    if (rc != GM_OK)
        return PyErr_Format(PyExc_ValueError, "gpumem: free of %p on GPU %d failed: %s", (void *)(uintptr_t)ptr, device,
                            gm_strerror(rc));
    Py_RETURN_NONE;
}

static PyObject *s_tags(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    return Py_BuildValue("{s:i,s:K,s:i,s:i}", "shift", GM_CTX_FRAMEWORK_SHIFT, "mask",
                         (unsigned long long)GM_CTX_FRAMEWORK_MASK, "cupy", GM_FRAMEWORK_CUPY, "numba",
                         GM_FRAMEWORK_NUMBA);
}

static PyMethodDef shared_methods[] = {
    {.ml_name = "_shared_malloc",
     .ml_meth = s_malloc,
     .ml_flags = METH_VARARGS,
     .ml_doc = "_shared_malloc(device, size, stream, context) -> address, or None when out of memory"},
    {.ml_name = "_shared_free", .ml_meth = s_free, .ml_flags = METH_VARARGS, .ml_doc = "_shared_free(device, address)"},
    {.ml_name = "_framework_tags",
     .ml_meth = s_tags,
     .ml_flags = METH_NOARGS,
     .ml_doc = "_framework_tags() -> where a context keeps the framework tag, and the tags"},
    {NULL, NULL, 0, NULL},
};

int gm_shared_glue_add(PyObject *module) { return PyModule_AddFunctions(module, shared_methods); }
