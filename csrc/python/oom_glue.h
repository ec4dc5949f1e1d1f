/*
 * oom_glue.h -- how out-of-memory errors are worded: the one-line text
 * (gm_oom_line, common.c), or what the one registered Python formatter
 * (gpumem.explain's) makes of the report, for a gpumem.Heap and for torch's
 * heaps alike.
 */
#ifndef GPUMEM_OOM_GLUE_H
#define GPUMEM_OOM_GLUE_H

#include <Python.h>

/* The OOM message: `fallback` (a new reference, stolen) unless a formatter was
 * registered with _set_oom_formatter, in which case formatter(heap, info,
 * fallback) words it.  Returns a new reference; NULL only if fallback was NULL.
 * A formatter that fails leaves the fallback text with a note saying so. */
PyObject *gm_py_format_oom(PyObject *heap, PyObject *info, PyObject *fallback);

/* The registered formatter (a new reference), or NULL when none is.  torch's
 * path (torch_viz.c) calls it too, as formatter(device, info, fallback,
 * processes): one formatter words every OOM message.  Call with the GIL. */
PyObject *gm_py_oom_formatter(void);

/* Adds _set_oom_formatter to gpumem._C.  Returns 0, or -1 with an exception set. */
int gm_oom_glue_add(PyObject *module);

#endif /* GPUMEM_OOM_GLUE_H */
