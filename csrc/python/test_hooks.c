/*
 * test_hooks.c -- what only the tests call, compiled only into a build made
 * with GPUMEM_TEST_HOOKS=1 (setup.py defines GM_TEST_HOOKS): the shipped
 * module has none of these, and the tests that need one skip without it.
 *
 *   _torch_test_alloc(size, device, stream=0)  torch's allocation entry point,
 *       raising what torch would raise
 *   _test_hold_boundary_lock(lock, device, s)  a native thread holds a lock
 *   _torch_viz_hooks()                         the C hooks' addresses, for ctypes
 *
 * gpumem._C.TEST_HOOKS says whether they are there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "convert.h"

int gm_test_hooks_add(PyObject *module);

#ifdef GM_TEST_HOOKS

#include <string.h>

#include "history_glue.h"
#include "oom_glue.h"
#include "torch_alloc.h"

/* Test hook: torch's allocation entry point, its exceptions raised here as
 * torch would raise them. */
static PyObject *t_torch_alloc(PyObject *Py_UNUSED(m), PyObject *args) {
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
static PyObject *t_hold_lock(PyObject *Py_UNUSED(m), PyObject *args) {
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

/* Test hook: the addresses of the two C hooks gpumem.torch sets (torch_glue.c), for
 * tests that call them through ctypes. */
static PyObject *t_viz_hooks(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    return Py_BuildValue("{s:N,s:N}", "context", gm_py_fn_address((void (*)(void))gm_py_capture_context_reacquire),
                         "oom_formatter", gm_py_fn_address((void (*)(void))gm_py_torch_oom_formatter));
}

static PyMethodDef test_methods[] = {
    GM_PY_FN("_torch_test_alloc", t_torch_alloc, METH_VARARGS,
             "_torch_test_alloc(size, device, stream=0) -> address: torch's allocation entry point, raising as torch "
             "would (tests)"),
    GM_PY_FN("_test_hold_boundary_lock", t_hold_lock, METH_VARARGS,
             "_test_hold_boundary_lock(lock, device, seconds): test hook; a new native thread takes a lock of the heap "
             "registry ('slot' of device, or 'options') or of the torch boundary ('pools' of device) and holds it for "
             "seconds; returns once held"),
    GM_PY_FN("_torch_viz_hooks", t_viz_hooks, METH_NOARGS,
             "_torch_viz_hooks() -> {'context': address, 'oom_formatter': address} of the C hooks (tests)"),
    {.ml_name = NULL},
};

int gm_test_hooks_add(PyObject *module) {
    if (PyModule_AddFunctions(module, test_methods) < 0) return -1;
    return PyModule_AddObject(module, "TEST_HOOKS", PyBool_FromLong(1));
}

#else

int gm_test_hooks_add(PyObject *module) { return PyModule_AddObject(module, "TEST_HOOKS", PyBool_FromLong(0)); }

#endif
