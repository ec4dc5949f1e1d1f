/*
 * torch_viz.c -- the visibility layer (gpumem/explain.py, history stacks) wired
 * into the torch allocation path (torch_alloc.cpp).
 *
 * Two C hooks torch_alloc.cpp calls by address, and the Python functions that
 * hand those addresses out:
 *
 *   gm_py_torch_oom_formatter  words torch's OutOfMemoryError with the report
 *       of gpumem.explain (the core's one line first, then the table, causes
 *       and advice), falling back to that one line on any failure.
 *   context hook                gm_py_capture_context_reacquire (history_glue.c), taken
 *       for allocations, and for frees and empty_cache with _torch_set_event_stacks
 *
 * Why the formatter may take the GIL: torch reaches the allocator from op
 * bindings that released it, or from autograd's device threads, never while
 * some other thread holds the GIL waiting on this one (backward() releases it
 * too), so PyGILState_Ensure cannot deadlock there.  While Python finalizes no
 * thread may take it: the core's text is kept then.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#include "common.h"
#include "history_glue.h"
#include "oom_glue.h"
#include "torch_alloc.h"

int gm_torch_viz_add(PyObject *module);

#if defined(__GNUC__)
__attribute__((visibility("default")))
#endif
long gm_py_torch_oom_formatter(const gm_oom_info *info, int device, const gm_proc_usage *procs,
                               long n_procs, char *buf, size_t buflen);

/* Set while this thread builds the fallback text: gm_torch_format_oom calls
 * the formatter, which must then let it write its own message. */
static _Thread_local int formatting;

static const char TRUNCATED[] = "\n[report truncated: gpumem.last_oom() returns all of it]";

static PyObject *procs_list(const gm_proc_usage *p, size_t n) {
    PyObject *l = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; l != NULL && i < n; i++) {
        PyObject *t = Py_BuildValue("(kK)", (unsigned long)p[i].pid, (unsigned long long)p[i].bytes);
        if (t == NULL)
            Py_CLEAR(l);
        else
            PyList_SET_ITEM(l, (Py_ssize_t)i, t);
    }
    return l;
}

/* Copy `text` into buf; a report too long for it is cut at a line end and says so. */
static size_t copy_text(const char *text, size_t len, char *buf, size_t buflen) {
    if (len < buflen) {
        memcpy(buf, text, len + 1);
        return len;
    }
    size_t room = buflen > sizeof TRUNCATED ? buflen - sizeof TRUNCATED : 0;
    size_t cut = room;
    while (cut > 0 && text[cut] != '\n') cut--;
    if (cut == 0) /* no line end to cut at: back up to a UTF-8 character start */
        for (cut = room; cut > 0 && ((unsigned char)text[cut] & 0xC0) == 0x80; cut--);
    memcpy(buf, text, cut);
    size_t tail = sizeof TRUNCATED - 1;
    if (cut + tail >= buflen) tail = buflen - 1 - cut;
    memcpy(buf + cut, TRUNCATED, tail);
    buf[cut + tail] = '\0';
    return cut + tail;
}

/* Returns the length written, or (size_t)-1 to keep the fallback in buf. */
static size_t render(const gm_oom_info *info, int device, const gm_proc_usage *procs, long n_procs, char *buf,
                     size_t buflen, size_t flen) {
    size_t out = (size_t)-1;
    PyObject *args = NULL, *text = NULL;
    /* The formatter every OOM goes through (oom_glue.c; gpumem.explain's),
     * given the device, so that nothing here names a layer above. */
    PyObject *renderer = gm_py_oom_formatter();
    if (renderer == NULL) return out;
    PyObject *fallback = PyUnicode_DecodeUTF8(buf, (Py_ssize_t)flen, "replace");
    PyObject *pl = n_procs < 0 ? (Py_INCREF(Py_None), Py_None) : procs_list(procs, (size_t)n_procs);
    PyObject *di = gm_py_oom_dict(info);
    if (!fallback || !pl || !di) goto done;
    args = Py_BuildValue("(iOOO)", device, di, fallback, pl);
    if (!args) goto done;
    text = PyObject_Call(renderer, args, NULL);
    if (text && PyUnicode_Check(text)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(text, &n);
        if (s) out = copy_text(s, (size_t)n, buf, buflen);
    }
done:
    if (PyErr_Occurred()) {
        /* gpumem.explain.format_oom catches its own failures; reaching here
         * means Python itself failed (no memory, a broken install).  Say so on
         * stderr once per failure, the exception still carries the core's text. */
        PyErr_WriteUnraisable(NULL);
    }
    Py_XDECREF(text);
    Py_XDECREF(args);
    Py_DECREF(renderer);
    Py_XDECREF(di);
    Py_XDECREF(pl);
    Py_XDECREF(fallback);
    return out;
}

long gm_py_torch_oom_formatter(const gm_oom_info *info, int device, const gm_proc_usage *procs, long n_procs, char *buf,
                               size_t buflen) {
    if (formatting || !info || !buf || buflen < 2) return -1;
    formatting = 1;
    size_t flen = gm_torch_format_oom(device, info, buf, buflen);
    formatting = 0;
    if (!Py_IsInitialized() || gm_py_finalizing()) return (long)flen;
    PyGILState_STATE st = PyGILState_Ensure();
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    size_t n = render(info, device, procs, n_procs, buf, buflen, flen);
    PyErr_Restore(et, ev, tb);
    PyGILState_Release(st);
    return (long)(n == (size_t)-1 ? flen : n);
}

/* ---- Python-facing ------------------------------------------------------------------ */

static PyObject *v_hooks(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    return Py_BuildValue("{s:N,s:N}", "context", gm_py_fn_address((void (*)(void))gm_py_capture_context_reacquire),
                         "oom_formatter", gm_py_fn_address((void (*)(void))gm_py_torch_oom_formatter));
}

/* _torch_set_event_stacks(on): frees and empty_cache take their caller's stack for their events. */
static PyObject *v_set_event_stacks(PyObject *Py_UNUSED(m), PyObject *a) {
    int on = PyObject_IsTrue(a);
    if (on < 0) return NULL;
    gpumem_torch_set_event_stacks(on);
    Py_RETURN_NONE;
}

static PyMethodDef viz_methods[] = {
    {.ml_name = "_torch_viz_hooks",
     .ml_meth = v_hooks,
     .ml_flags = METH_NOARGS,
     .ml_doc = "_torch_viz_hooks() -> {'context': address, 'oom_formatter': address} for gpumem.torch's setters"},
    {.ml_name = "_torch_set_event_stacks",
     .ml_meth = v_set_event_stacks,
     .ml_flags = METH_O,
     .ml_doc =
         "_torch_set_event_stacks(on): torch's frees and empty_cache record their caller's stack (context='all')"},
    {.ml_name = NULL},
};

int gm_torch_viz_add(PyObject *module) { return PyModule_AddFunctions(module, viz_methods); }
