/*
 * oom_glue.c -- the one place out-of-memory messages are made (oom_glue.h):
 * gpumem.Heap's (module.c) and torch's (torch_viz.c) alike, the first
 * sentences (gm_oom_line, common.c) then the registered explanation.
 */
#include "oom_glue.h"

#include "common.h"

static PyObject *oom_formatter; /* callable or NULL */

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

/* `fallback` (a new reference, stolen), or what the registered formatter makes
 * of it: formatter(heap, info, fallback[, processes]).  A formatter that fails
 * leaves the fallback text with a note saying so. */
static PyObject *explained(PyObject *heap, PyObject *info, PyObject *fallback, PyObject *processes) {
    if (!fallback || !oom_formatter) return fallback;
    /* The formatter may raise or return junk; the OOM must still be reported,
     * so any failure keeps the core's own text and says the explanation broke.
     * The pending exception (none is expected here) is kept aside. */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *fn = oom_formatter;
    Py_INCREF(fn);
    PyObject *text = PyObject_CallFunctionObjArgs(fn, heap, info ? info : Py_None, fallback, processes, NULL);
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

PyObject *gm_py_oom_message(PyObject *heap, const gm_oom_info *info, int gpu, const gm_proc_usage *procs, long n_procs,
                            const char *failed, PyObject **info_out) {
    /* The first sentences before any Python runs: `failed` may be the
     * device's, which Python code (a finalizer) could close. */
    char line[1024];
    size_t n = gm_oom_line(line, sizeof line, info, gpu, procs, n_procs, failed);
    PyObject *fallback = PyUnicode_DecodeUTF8(line, (Py_ssize_t)n, "replace");
    PyObject *d = fallback ? gm_py_oom_dict(info) : NULL;
    PyObject *pl = d && gpu >= 0 ? gm_py_procs_list(procs, n_procs) : NULL;
    if (d == NULL || (gpu >= 0 && pl == NULL)) {
        Py_XDECREF(fallback);
        Py_XDECREF(d);
        return NULL;
    }
    PyObject *text = explained(heap, d, fallback, pl);
    Py_XDECREF(pl);
    if (info_out)
        *info_out = d;
    else
        Py_DECREF(d);
    return text;
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
