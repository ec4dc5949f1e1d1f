/*
 * oom_glue.h -- how a gpumem.Heap words its out-of-memory error: the core's
 * one-line text, or what a registered Python formatter (gpumem.explain's)
 * makes of the report.
 */
#ifndef GPUMEM_OOM_GLUE_H
#define GPUMEM_OOM_GLUE_H

#include <Python.h>

/* The OOM message: `fallback` (a new reference, stolen) unless a formatter was
 * registered with _set_oom_formatter, in which case formatter(heap, info,
 * fallback) words it.  Returns a new reference; NULL only if fallback was NULL.
 * A formatter that fails leaves the fallback text with a note saying so. */
PyObject *gm_py_format_oom(PyObject *heap, PyObject *info, PyObject *fallback);

/* Adds _set_oom_formatter to gpumem._C.  Returns 0, or -1 with an exception set. */
int gm_oom_glue_add(PyObject *module);

#endif /* GPUMEM_OOM_GLUE_H */
