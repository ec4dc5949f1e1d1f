/*
 * torch_viz.c -- the visibility layer (gpumem/explain.py, history stacks) wired
 * into the torch allocation path (torch_alloc.cpp), set from C:
 *
 *   _torch_explain_oom(on)     torch's OutOfMemoryError worded by
 *       gm_py_torch_oom_formatter (oom_glue.c): torch's first sentences then
 *       gpumem.explain's table, causes and advice; off: the first sentences.
 *   _torch_stack_hook(on)      each allocation takes its caller's stack
 *       (gm_py_capture_context_reacquire, history_glue.c), and frees and
 *       empty_cache too with _torch_set_event_stacks.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "convert.h"
#include "history_glue.h"
#include "oom_glue.h"
#include "torch_alloc.h"

int gm_torch_viz_add(PyObject *module);

/* ---- Python-facing ------------------------------------------------------------------ */

/* _torch_explain_oom(on): torch's out-of-memory message explained, or its first sentences alone. */
static PyObject *v_explain_oom(PyObject *Py_UNUSED(m), PyObject *a) {
    int on = PyObject_IsTrue(a);
    if (on < 0) return NULL;
    gpumem_torch_set_oom_formatter(on ? gm_py_torch_oom_formatter : NULL);
    Py_RETURN_NONE;
}

/* _torch_stack_hook(on): each allocation torch makes takes its caller's stack, or none. */
static PyObject *v_stack_hook(PyObject *Py_UNUSED(m), PyObject *a) {
    int on = PyObject_IsTrue(a);
    if (on < 0) return NULL;
    gpumem_torch_set_context_hook(on ? gm_py_capture_context_reacquire : NULL);
    Py_RETURN_NONE;
}

/* _torch_set_event_stacks(on): frees and empty_cache take their caller's stack for their events. */
static PyObject *v_set_event_stacks(PyObject *Py_UNUSED(m), PyObject *a) {
    int on = PyObject_IsTrue(a);
    if (on < 0) return NULL;
    gpumem_torch_set_event_stacks(on);
    Py_RETURN_NONE;
}

static PyMethodDef viz_methods[] = {
    {.ml_name = "_torch_explain_oom",
     .ml_meth = v_explain_oom,
     .ml_flags = METH_O,
     .ml_doc = "_torch_explain_oom(on): torch's OutOfMemoryError explained by gpumem.explain, or its first sentences"},
    {.ml_name = "_torch_stack_hook",
     .ml_meth = v_stack_hook,
     .ml_flags = METH_O,
     .ml_doc = "_torch_stack_hook(on): each allocation torch makes records its caller's Python stack, or none"},
    {.ml_name = "_torch_set_event_stacks",
     .ml_meth = v_set_event_stacks,
     .ml_flags = METH_O,
     .ml_doc =
         "_torch_set_event_stacks(on): torch's frees and empty_cache record their caller's stack (context='all')"},
    {.ml_name = NULL},
};

int gm_torch_viz_add(PyObject *module) { return PyModule_AddFunctions(module, viz_methods); }
