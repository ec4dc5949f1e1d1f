/*
 * heap_object.h -- the gpumem.Heap Python object, shared by the files that
 * make up its methods: module.c (the type, allocation, statistics, reports),
 * replay_glue.c (trace replay) and sim_glue.c (the simulated device's controls).
 */
#ifndef GPUMEM_HEAP_OBJECT_H
#define GPUMEM_HEAP_OBJECT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#include "gpumem/gpumem.h"

typedef struct {
    PyObject_HEAD gm_heap *heap; /* NULL once closed */
    gm_device *dev;              /* owned by heap; valid while heap is */
    int is_sim;
    int busy; /* threads inside the core without the GIL */
} HeapObject;

/* Clearing the device's last_error first makes any reason found there after a
 * failure this call's own.  Only done when no other thread is inside the core:
 * then nothing else can be writing it (we hold the GIL, they would need it to
 * enter). */
// clang-format off
#define ENTER_CORE(self)                                                  \
    do {                                                                  \
        if (!(self)->busy) (self)->dev->last_error[0] = '\0';             \
        (self)->busy++;                                                   \
        Py_BEGIN_ALLOW_THREADS
#define LEAVE_CORE(self)                                                  \
        Py_END_ALLOW_THREADS                                              \
        (self)->busy--;                                                   \
    } while (0)
// clang-format on

/* A C function with keywords, as a PyMethodDef wants it. */
#define KW(fn) (PyCFunction)(void (*)(void))(fn)

/* gpumem's exception classes (created by module.c). */
extern PyObject *gm_py_OutOfMemoryError, *gm_py_InvalidPointerError, *gm_py_CorruptionError, *gm_py_DeviceError;

/* Every method starts here: a closed heap is a ValueError, as for a closed file. */
int gm_py_heap_open(HeapObject *self);
/* ... and a sim-only one here too; `changes_device`: refuse while another
 * thread is inside the core. */
int gm_py_heap_sim(HeapObject *self, int changes_device);
/* Raise the exception that matches a core error code; `what` names the call. */
PyObject *gm_py_raise(HeapObject *self, int code, const char *what);
/* A non-negative integer no larger than `max` (ValueError/TypeError otherwise). */
int gm_py_to_u64(PyObject *obj, const char *what, uint64_t max, uint64_t *out);
int gm_py_to_size(PyObject *obj, const char *what, size_t *out);
/* An int, or a string such as "24GiB". */
int gm_py_to_size_or_str(PyObject *obj, const char *what, size_t *out);

/* Method tables of the other files, each ending with {NULL}. */
extern PyMethodDef gm_py_replay_methods[];
extern PyMethodDef gm_py_sim_methods[];

/* Adds DEVICE_OPS, the device calls' names (sim_glue.c). */
int gm_py_add_device_ops(PyObject *m);

#endif /* GPUMEM_HEAP_OBJECT_H */
