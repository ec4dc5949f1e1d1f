/*
 * oom_glue.h -- the out-of-memory message, made in one place for a
 * gpumem.Heap and for torch's heaps alike: the first sentences (gm_oom_line,
 * common.c: torch's own words on torch's path), then what the one registered
 * Python formatter (gpumem.explain's format_oom, registered by gpumem when it
 * sets itself up) says of the causes.
 */
#ifndef GPUMEM_OOM_GLUE_H
#define GPUMEM_OOM_GLUE_H

#include <Python.h>

#include "gpumem/gpumem.h"

/* The whole message for the failure `info` describes.  heap: what the
 * formatter reads (a gpumem.Heap, or torch's device number as an int); gpu:
 * torch's device (-1: a Heap's own message); procs, n_procs: the processes on
 * torch's device (n_procs < 0: unknown), handed to the formatter as a list;
 * failed: the device's last reason (NULL: none), read before any Python runs.
 * A formatter that fails leaves the first sentences with a note saying so.
 * Returns a new str, and *info_out (when given) info as a dict; NULL with an
 * exception set when Python cannot build them.  Call with the GIL. */
PyObject *gm_py_oom_message(PyObject *heap, const gm_oom_info *info, int gpu, const gm_proc_usage *procs, long n_procs,
                            const char *failed, PyObject **info_out);

/* Adds _set_oom_formatter to gpumem._C.  Returns 0, or -1 with an exception set. */
int gm_oom_glue_add(PyObject *module);

#endif /* GPUMEM_OOM_GLUE_H */
