/*
 * heap_object.h -- the gpumem.Heap Python object, shared by the files that
 * make up its methods: module.c (the type, allocation, statistics, reports),
 * pool_glue.c (private pools), replay_glue.c (trace replay) and sim_glue.c
 * (the simulated device's controls).
 *
 * A Heap either owns its heap (Heap(...): close() or the garbage collector
 * destroys it) or borrows a device's heap from the process-wide heap registry
 * (heap_registry.h; _C.registry_heap(device)), the one torch's, CuPy's and
 * Numba's allocations go to: the same type and methods, but closing or
 * dropping it only lets go of the heap, which lives until the process ends.
 *
 * The boundary rule.  Any call into Python may run any Python code: an
 * argument's __index__, __len__ or __iter__, the str -> size parser, a
 * finalizer the garbage collector runs when an object is made, or another
 * thread that takes the GIL meanwhile.  That code may close this heap, empty
 * or rebind a sequence, or rewrite a buffer.  So every entry point of the glue
 * (csrc/python), by construction:
 *
 *   1. converts and validates every argument into C values first: sizes, ids
 *      and pool ids through the converters below, sequences through a tuple
 *      copy (gm_py_tuple_of) that holds its own references, into C arrays;
 *   2. then checks that the heap is open (and a sim one, and idle, where the
 *      call needs it) -- gm_py_args and gm_py_arg do 1. then 2. -- and makes
 *      no Python call between that check and its last use of self->heap or
 *      self->dev: what the core returns is read into C values before any
 *      Python object is built from it;
 *   3. holds a reference to, or a buffer export of, every object whose memory
 *      C reads, and copies a caller's buffer once before checking it, so that
 *      an alias or another thread cannot change what was checked;
 *   4. checks every size product for overflow before it allocates.
 *
 * `busy` keeps close() and the sim device's calls away while another thread
 * is inside the core without the GIL; a fork()ed child starts with none.
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
    int registry_device; /* >= 0: borrows this device's heap from the heap registry; -1: owns its heap */
    int busy;            /* threads inside the core without the GIL */
    unsigned busy_gen;   /* gm_py_fork_gen when busy was last counted */
} HeapObject;

/* Bumped in a fork()ed child: the threads `busy` counted are not there. */
extern unsigned gm_py_fork_gen;

/* In a fork()ed child, forget the parent's threads (see busy_gen). */
static inline void gm_py_fork_check(HeapObject *self) {
    if (self->busy_gen != gm_py_fork_gen) {
        self->busy = 0;
        self->busy_gen = gm_py_fork_gen;
    }
}

/* Clearing the device's last_error first makes any reason found there after a
 * failure this call's own.  Only done when no other thread is inside the core:
 * then nothing else can be writing it (we hold the GIL, they would need it to
 * enter) -- so never on a borrowed heap, which other frameworks' threads enter
 * without the GIL. */
// clang-format off
#define ENTER_CORE(self)                                                  \
    do {                                                                  \
        gm_py_fork_check(self);                                           \
        if (!(self)->busy && (self)->registry_device < 0)                 \
            (self)->dev->last_error[0] = '\0';                            \
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

/* A closed heap is a ValueError, as for a closed file. */
int gm_py_heap_open(HeapObject *self);
/* ... and a sim-only one here too; `changes_device`: refuse while another
 * thread is inside the core. */
int gm_py_heap_sim(HeapObject *self, int changes_device);

/* What a call needs of the heap, checked after its arguments (rule 2). */
enum gm_py_need {
    GM_PY_OPEN, /* open */
    GM_PY_SIM   /* open, on the simulated device, no other thread inside (the
                 * sim device is guarded by the heap's lock only) */
};
/* 0 when the heap is as `need` says, else -1 with the exception set.  No
 * Python code runs in it. */
int gm_py_ready(HeapObject *self, enum gm_py_need need);
/* PyArg_ParseTupleAndKeywords(args, kwds, fmt, kwlist, ...) (kwlist NULL:
 * PyArg_ParseTuple), then gm_py_ready(self, need): rules 1 and 2 in one
 * call.  0, or -1 with an exception set. */
int gm_py_args(HeapObject *self, enum gm_py_need need, PyObject *args, PyObject *kwds, const char *fmt, char **kwlist,
               ...);
/* A METH_O method's argument: conv(arg, out) (an O& converter), then
 * gm_py_ready(self, need). */
int gm_py_arg(HeapObject *self, enum gm_py_need need, PyObject *arg, int (*conv)(PyObject *, void *), void *out);

/* O& converters into uint64_t: a non-negative int no larger than the bound,
 * named in the error as the parameter is.  size_t is uint64_t here. */
#define GM_PY_EACH_U64_ARG(X)                                                                                          \
    X(size, "size", SIZE_MAX)                                                                                          \
    X(ptr, "ptr", UINTPTR_MAX)                                                                                         \
    X(addr, "addr", UINTPTR_MAX)                                                                                       \
    X(stream, "stream", UINT64_MAX)                                                                                    \
    X(context, "context", UINT64_MAX)                                                                                  \
    X(max_entries, "max_entries", SIZE_MAX)                                                                            \
    X(n_slots, "n_slots", SIZE_MAX)                                                                                    \
    X(nth, "nth", UINT64_MAX)                                                                                          \
    X(count, "count", UINT64_MAX)                                                                                      \
    X(seed, "seed", UINT64_MAX)                                                                                        \
    X(ops, "ops", UINT64_MAX)                                                                                          \
    X(pid, "pid", UINT32_MAX)                                                                                          \
    X(bytes, "bytes", UINT64_MAX)                                                                                      \
    X(value, "value", UINT64_MAX)                                                                                      \
    X(live_bytes, "live_bytes", UINT64_MAX)
#define GM_PY_DECLARE_U64_ARG(name, what, max) int gm_py_##name##_arg(PyObject *obj, void *out);
GM_PY_EACH_U64_ARG(GM_PY_DECLARE_U64_ARG)
#undef GM_PY_DECLARE_U64_ARG
/* A size that may also be a string such as "24GiB" (set_cap's "cap"). */
int gm_py_cap_arg(PyObject *obj, void *out);
/* A private pool's id (gm_pool_id *): a pair of non-negative ints, not (0, 0). */
int gm_py_pool_arg(PyObject *obj, void *out);
/* The same, or None: no pool, {0, 0}. */
int gm_py_pool_or_none_arg(PyObject *obj, void *out);
/* A truth value (int *), as "p" takes it. */
int gm_py_bool_arg(PyObject *obj, void *out);
/* Raise the exception that matches a core error code; `what` names the call. */
PyObject *gm_py_raise(HeapObject *self, int code, const char *what);
/* A non-negative integer no larger than `max` (ValueError/TypeError otherwise). */
int gm_py_to_u64(PyObject *obj, const char *what, uint64_t max, uint64_t *out);
int gm_py_to_size(PyObject *obj, const char *what, size_t *out);
/* An int, or a string such as "24GiB". */
int gm_py_to_size_or_str(PyObject *obj, const char *what, size_t *out);

/* ValueError: no pool `id` lives on this heap.  Returns NULL. */
PyObject *gm_py_no_such_pool(const gm_pool_id *id);

/* Method tables of the other files, each ending with {NULL}. */
extern PyMethodDef gm_py_pool_methods[];
extern PyMethodDef gm_py_replay_methods[];
extern PyMethodDef gm_py_sim_methods[];

/* Adds DEVICE_OPS, the device calls' names (sim_glue.c). */
int gm_py_add_device_ops(PyObject *m);

/* Whether o is a gpumem.Heap (module.c). */
int gm_py_is_heap(PyObject *o);

/* A new Heap borrowing the heap registry's heap of `device` (which must have
 * one), or NULL with an exception set (module.c). */
PyObject *gm_py_heap_borrow(int device);

#endif /* GPUMEM_HEAP_OBJECT_H */
