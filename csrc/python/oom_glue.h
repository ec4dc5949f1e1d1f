/*
 * oom_glue.h -- the out-of-memory message, made in one place for a
 * gpumem.Heap and for torch's heaps alike: the first sentences (gm_oom_line:
 * torch's own words on torch's path), then what the one registered
 * Python formatter (gpumem.explain's format_oom, registered by gpumem when it
 * sets itself up) says of the causes.
 */
#ifndef GPUMEM_OOM_GLUE_H
#define GPUMEM_OOM_GLUE_H

#include <Python.h>

#include "gpumem/gpumem.h"

/* n bytes as "512 B", "1.50 KiB", ... "2.00 PiB": all byte counts in
 * messages go through here. */
void gm_fmt_bytes(char *buf, size_t len, uint64_t n);

/* n bytes as torch's messages write them: "1024 bytes", "1.50 KiB", "2.00 MiB",
 * then GiB however large ("800000000.00 GiB"). */
void gm_fmt_torch_bytes(char *buf, size_t len, uint64_t n);

/* The byte counts an out-of-memory message names, formatted by gm_fmt_bytes. */
typedef struct gm_oom_sizes {
    char request[32], device_total[32], device_free[32], live[32], reserved[32], cached[32], pending[32], largest[32],
        cap[32];
} gm_oom_sizes;

void gm_oom_sizes_format(const gm_oom_info *o, gm_oom_sizes *out);

/* The first sentences of every out-of-memory message (the one-line message;
 * gm_py_oom_message, oom_glue.h, adds gpumem's explanation after them):
 *   "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ... "
 * `gpu` >= 0 names torch's device (allocations then count as PyTorch's, the
 * first two sentences are torch's own, sizes in torch's units, and the memory
 * other processes hold follows, from the device's process list: n_procs < 0
 * when unknown); -1 is a gpumem.Heap ("The device has a total capacity of
 * ...").  `failed`: the device's last reason (NULL: none given), said when a
 * device call failed, or why the process list is unknown.  Writes at most len
 * bytes (NUL-terminated); returns the length. */
size_t gm_oom_line(char *buf, size_t len, const gm_oom_info *o, int gpu, const gm_proc_usage *procs, long n_procs,
                   const char *failed);

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

/* torch's formatter (gm_torch_oom_formatter, torch_alloc.h) that explains: the
 * message gm_py_oom_message makes, under the GIL, cut at a line end to fit buf;
 * the first sentences alone while Python finalizes or when Python fails. */
long gm_py_torch_oom_formatter(const gm_oom_info *info, int device, const gm_proc_usage *procs, long n_procs, char *buf,
                               size_t buflen);

/* Adds _set_oom_formatter to gpumem._C.  Returns 0, or -1 with an exception set. */
int gm_oom_glue_add(PyObject *module);

#endif /* GPUMEM_OOM_GLUE_H */
