/*
 * oom_glue.c -- the one Python formatter of out-of-memory messages
 * (oom_glue.h): gpumem.Heap's here, torch's through torch_viz.c.
 */
#include "oom_glue.h"

static PyObject *oom_formatter; /* callable or NULL */

PyObject *gm_py_oom_formatter(void) {
    Py_XINCREF(oom_formatter);
    return oom_formatter;
}

static PyObject *py_set_oom_formatter(PyObject *Py_UNUSED(m), PyObject *fn) {
    if (fn != Py_None && !PyCallable_Check(fn))
        return PyErr_Format(PyExc_TypeError, "OOM formatter must be callable or None, not %.80s", Py_TYPE(fn)->tp_name);
    PyObject *old = oom_formatter;
    if (fn == Py_None) {
        oom_formatter = NULL;
    } else {
        Py_INCREF(fn);
        oom_formatter = fn;
    }
    if (old) return old; /* hand back the previous one, so callers can restore it */
    Py_RETURN_NONE;
}

PyObject *gm_py_format_oom(PyObject *heap, PyObject *info, PyObject *fallback) {
    if (!fallback || !oom_formatter) return fallback;
    /* The formatter may raise or return junk; the OOM must still be reported,
     * so any failure keeps the core's own text and says the explanation broke.
     * The pending exception (none is expected here) is kept aside. */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *fn = oom_formatter;
    Py_INCREF(fn);
    PyObject *text = PyObject_CallFunctionObjArgs(fn, heap, info ? info : Py_None, fallback, NULL);
    Py_DECREF(fn);
    if (text && PyUnicode_Check(text)) {
        Py_DECREF(fallback);
        PyErr_Restore(et, ev, tb);
        return text;
    }
    PyObject *why = NULL;
    if (!text) {
        PyObject *t2, *v2, *tb2;
        PyErr_Fetch(&t2, &v2, &tb2);
        why = v2 ? PyObject_Str(v2) : NULL;
        if (!why) PyErr_Clear();
        Py_XDECREF(t2);
        Py_XDECREF(v2);
        Py_XDECREF(tb2);
    }
    Py_XDECREF(text);
    PyObject *out = PyUnicode_FromFormat("%U (gpumem.explain failed: %s)", fallback,
                                         why ? PyUnicode_AsUTF8(why) : "it did not return a str");
    Py_XDECREF(why);
    if (!out) {
        PyErr_Clear();
        out = fallback;
    } else {
        Py_DECREF(fallback);
    }
    PyErr_Restore(et, ev, tb);
    return out;
}

static PyMethodDef oom_methods[] = {
    {.ml_name = "_set_oom_formatter",
     .ml_meth = py_set_oom_formatter,
     .ml_flags = METH_O,
     .ml_doc =
         "_set_oom_formatter(fn or None) -> previous; fn(heap or device, info, text, processes=None) -> OOM message"},
    {.ml_name = NULL},
};

int gm_oom_glue_add(PyObject *module) { return PyModule_AddFunctions(module, oom_methods); }
