/*
 * torch_viz.c -- the visibility layer (gpumem/explain.py, history stacks) wired
 * into the torch allocation path (torch_alloc.cpp).
 *
 * Two C hooks torch_alloc.cpp calls by address, and the Python functions that
 * hand those addresses out:
 *
 *   gm_py_torch_oom_formatter  words torch's OutOfMemoryError: the message
 *       gm_py_oom_message (oom_glue.c) makes, torch's first sentences then
 *       gpumem.explain's table, causes and advice.
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
#include "heap_registry.h"
#include "history_glue.h"
#include "oom_glue.h"
#include "torch_alloc.h"

int gm_torch_viz_add(PyObject *module);

#if defined(__GNUC__)
__attribute__((visibility("default")))
#endif
long gm_py_torch_oom_formatter(const gm_oom_info *info, int device, const gm_proc_usage *procs,
                               long n_procs, char *buf, size_t buflen);

static const char TRUNCATED[] = "\n[report truncated: gpumem.last_oom() returns all of it]";

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

long gm_py_torch_oom_formatter(const gm_oom_info *info, int device, const gm_proc_usage *procs, long n_procs, char *buf,
                               size_t buflen) {
    if (!info || !buf || buflen < 2) return -1;
    gm_heap *h = gm_heap_registry_get(device);
    const char *failed = h ? gm_heap_device(h)->last_error : NULL;
    if (!Py_IsInitialized() || gm_py_finalizing()) /* no thread may take the GIL: the first sentences alone */
        return (long)gm_oom_line(buf, buflen, info, device, procs, n_procs, failed);
    PyGILState_STATE st = PyGILState_Ensure();
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *dev = PyLong_FromLong(device);
    PyObject *text = dev ? gm_py_oom_message(dev, info, device, procs, n_procs, failed, NULL) : NULL;
    Py_ssize_t n = 0;
    const char *s = text ? PyUnicode_AsUTF8AndSize(text, &n) : NULL;
    size_t out;
    if (s) {
        out = copy_text(s, (size_t)n, buf, buflen);
    } else {
        /* Python itself failed (no memory, a broken install): say so on stderr,
         * the exception still carries the first sentences. */
        PyErr_WriteUnraisable(NULL);
        out = gm_oom_line(buf, buflen, info, device, procs, n_procs, failed);
    }
    Py_XDECREF(text);
    Py_XDECREF(dev);
    PyErr_Restore(et, ev, tb);
    PyGILState_Release(st);
    return (long)out;
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
