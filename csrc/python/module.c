/*
 * module.c -- gpumem._C: the module, its exceptions, and the Heap type.
 *
 * csrc/python is the one place where gpumem talks to Python.  This file holds
 * the module and one type, Heap, that wraps one gm_heap: one it owns (with its
 * device), or one it borrows from the process-wide heap registry
 * (heap_registry.c; the heaps torch, CuPy and Numba allocate from, reached
 * from Python through registry_glue.c).  Heap's private-pool, replay and sim_*
 * methods live in pool_glue.c, replay_glue.c and sim_glue.c (heap_object.h is
 * what they share), torch's entry points in torch_alloc.cpp with torch_glue.c,
 * history and stacks in history_glue.c, the out-of-memory message in
 * oom_glue.c.  Everything here is argument conversion, error mapping and
 * object building; policy lives in the core.
 *
 * Every entry point keeps the boundary rule written in heap_object.h: its
 * arguments are converted before the heap is checked, and nothing Python runs
 * between that check and the core.
 *
 * Threads: calls that may take long or wait on the heap's lock (malloc, free,
 * record_stream, empty_cache, set_cap, check, replay) drop the GIL.  While a
 * thread is inside the core without the GIL, `busy` is non-zero; close() and
 * every sim_* call (which touch the device outside the heap's lock) refuse
 * to run then instead of racing.  `busy` is only touched with the GIL held,
 * so the check itself cannot race.
 */
#include "heap_object.h"

#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem/gpumem.h"
#include "gpumem/registry.h"
#include "gpumem/sim.h"
#include "convert.h"
#include "heap_registry.h"
#include "config_glue.h"
#include "history_glue.h"
#include "oom_glue.h"

/* gpumem/trace.py packs events with struct "<IIQQ". */
_Static_assert(sizeof(gm_replay_event) == 24, "gm_replay_event must be 24 packed bytes");
/* The size converters write uint64_t into size_t variables. */
_Static_assert(sizeof(size_t) == sizeof(uint64_t), "size_t must be 64 bits");

/* ---- exceptions ------------------------------------------------------------ */

PyObject *gm_py_OutOfMemoryError;
PyObject *gm_py_InvalidPointerError;
PyObject *gm_py_CorruptionError;
PyObject *gm_py_DeviceError;

/* ---- the Heap object --------------------------------------------------------- */

/* Every method starts here: a closed heap is a ValueError, as for a closed file. */
int gm_py_heap_open(HeapObject *self) {
    if (self->heap == NULL) {
        PyErr_SetString(PyExc_ValueError, "operation on a closed gpumem.Heap");
        return -1;
    }
    return 0;
}

unsigned gm_py_fork_gen;

static void fork_child(void) { gm_py_fork_gen++; }

int gm_py_heap_sim(HeapObject *self, int changes_device) {
    if (gm_py_heap_open(self) < 0) return -1;
    gm_py_fork_check(self);
    if (self->registry_device >= 0) {
        PyErr_Format(PyExc_TypeError,
                     "this call needs a sim heap of its own, not the heap registry's heap of device %d (shared)",
                     self->registry_device);
        return -1;
    }
    if (!self->is_sim) {
        PyErr_Format(PyExc_TypeError, "this call needs a sim heap, not a %s one", self->dev->kind);
        return -1;
    }
    if (changes_device && self->busy) {
        PyErr_SetString(PyExc_RuntimeError,
                        "the simulated device cannot be changed while another thread is inside this heap");
        return -1;
    }
    return 0;
}

int gm_py_ready(HeapObject *self, enum gm_py_need need) {
    if (gm_py_heap_open(self) < 0) return -1;
    gm_py_fork_check(self);
    return need == GM_PY_SIM ? gm_py_heap_sim(self, 1) : 0;
}

int gm_py_args(HeapObject *self, enum gm_py_need need, PyObject *args, PyObject *kwds, const char *fmt, char **kwlist,
               ...) {
    va_list va;
    va_start(va, kwlist);
    int ok = kwlist ? PyArg_VaParseTupleAndKeywords(args, kwds, fmt, kwlist, va) : PyArg_VaParse(args, fmt, va);
    va_end(va);
    if (!ok) return -1;
    return gm_py_ready(self, need);
}

int gm_py_arg(HeapObject *self, enum gm_py_need need, PyObject *arg, int (*conv)(PyObject *, void *), void *out) {
    if (!conv(arg, out)) return -1;
    return gm_py_ready(self, need);
}

/* Raise the exception that matches a core error code; `what` names the call.
 * The device's reason, if it gave one, ends the message: a GM_EINVAL from
 * set_cap may come from the device ("synchronize: would deadlock ..."), not
 * from the argument. */
PyObject *gm_py_raise(HeapObject *self, int code, const char *what) {
    const char *detail = (self && self->dev && self->dev->last_error[0]) ? self->dev->last_error : NULL;
    const char *sep = detail ? ": " : "";
    if (!detail) detail = "";
    switch (code) {
    case GM_EINVAL:
        PyErr_Format(PyExc_ValueError, "%s: invalid argument (GM_EINVAL)%s%s", what, sep, detail);
        break;
    case GM_EUNKNOWN_PTR:
        PyErr_Format(gm_py_InvalidPointerError, "%s: pointer was never handed out by this heap (GM_EUNKNOWN_PTR)",
                     what);
        break;
    case GM_EDOUBLE_FREE:
        PyErr_Format(gm_py_InvalidPointerError,
                     "%s: pointer is not live: freed twice, or not the start of an allocation (GM_EDOUBLE_FREE)", what);
        break;
    case GM_EDEVICE:
    case GM_ENODRIVER:
    case GM_ENOTSUP:
        PyErr_Format(gm_py_DeviceError, "%s: %s (%s)%s%s", what, gm_strerror(code), gm_py_code_name(code), sep, detail);
        break;
    case GM_ECORRUPT:
        PyErr_Format(gm_py_CorruptionError, "%s: heap is corrupt (GM_ECORRUPT)%s%s", what, sep, detail);
        break;
    case GM_ENOMEM:
        PyErr_Format(gm_py_OutOfMemoryError, "CUDA out of memory. %s: %s (GM_ENOMEM)%s%s", what, gm_strerror(code), sep,
                     detail);
        break;
    default:
        PyErr_Format(PyExc_RuntimeError, "%s: %s (%s, code %d)%s%s", what, gm_strerror(code), gm_py_code_name(code),
                     code, sep, detail);
        break;
    }
    return NULL;
}

/* ---- argument conversion ---------------------------------------------------- */

/* A non-negative integer no larger than `max`.  Sizes, pointers and streams all
 * come through here so that a negative or huge value is a ValueError, never a
 * silent wrap-around. */
int gm_py_to_u64(PyObject *obj, const char *what, uint64_t max, uint64_t *out) {
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(obj)->tp_name);
        }
        return -1;
    }
    PyObject *zero = PyLong_FromLong(0);
    if (zero == NULL) {
        Py_DECREF(idx);
        return -1;
    }
    int neg = PyObject_RichCompareBool(idx, zero, Py_LT);
    Py_DECREF(zero);
    if (neg < 0) {
        Py_DECREF(idx);
        return -1;
    }
    if (neg) {
        PyErr_Format(PyExc_ValueError, "%s must not be negative, got %S", what, idx);
        Py_DECREF(idx);
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(idx);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s is too large: %S", what, idx);
        Py_DECREF(idx);
        return -1;
    }
    if ((uint64_t)v > max) {
        PyErr_Format(PyExc_ValueError, "%s is too large: %S", what, idx);
        Py_DECREF(idx);
        return -1;
    }
    Py_DECREF(idx);
    *out = (uint64_t)v;
    return 0;
}

int gm_py_to_size(PyObject *obj, const char *what, size_t *out) {
    uint64_t v;
    if (gm_py_to_u64(obj, what, (uint64_t)SIZE_MAX, &v) < 0) return -1;
    *out = (size_t)v;
    return 0;
}

/* Sizes for the constructor and set_cap may also be strings such as "24GiB";
 * their grammar lives in gpumem/_units.py so that Python and C agree. */
int gm_py_to_size_or_str(PyObject *obj, const char *what, size_t *out) {
    if (!PyUnicode_Check(obj)) return gm_py_to_size(obj, what, out);
    PyObject *units = PyImport_ImportModule("gpumem._units");
    if (units == NULL) return -1;
    PyObject *n = PyObject_CallMethod(units, "parse_size", "O", obj);
    Py_DECREF(units);
    if (n == NULL) return -1;
    int rc = gm_py_to_size(n, what, out);
    Py_DECREF(n);
    return rc;
}

#define GM_PY_DEFINE_U64_ARG(name, what, max)                                                                          \
    int gm_py_##name##_arg(PyObject *obj, void *out) { return gm_py_to_u64(obj, what, (uint64_t)(max), out) == 0; }
GM_PY_EACH_U64_ARG(GM_PY_DEFINE_U64_ARG)
#undef GM_PY_DEFINE_U64_ARG

int gm_py_cap_arg(PyObject *obj, void *out) { return gm_py_to_size_or_str(obj, "cap", out) == 0; }

int gm_py_bool_arg(PyObject *obj, void *out) {
    int v = PyObject_IsTrue(obj);
    if (v < 0) return 0;
    *(int *)out = v;
    return 1;
}

/* A private pool's id: torch's MempoolId_t, a pair of non-negative ints, not (0, 0).
 * A list is copied into a tuple first: an item's __index__ may change the list. */
static int to_pool_id(PyObject *obj, gm_pool_id *out) {
    if (!PyTuple_Check(obj) && !PyList_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "pool id must be a pair of ints (torch's MempoolId_t), not %.100s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *seq = gm_py_tuple_of(obj);
    if (seq == NULL) return -1;
    int rc = -1;
    gm_pool_id id;
    if (PyTuple_GET_SIZE(seq) != 2) {
        PyErr_Format(PyExc_ValueError, "pool id must be a pair of ints (torch's MempoolId_t), got %zd items",
                     PyTuple_GET_SIZE(seq));
    } else if (gm_py_to_u64(PyTuple_GET_ITEM(seq, 0), "pool id[0]", UINT64_MAX, &id.first) == 0 &&
               gm_py_to_u64(PyTuple_GET_ITEM(seq, 1), "pool id[1]", UINT64_MAX, &id.second) == 0) {
        if (!id.first && !id.second) {
            PyErr_SetString(PyExc_ValueError, "pool id (0, 0) names no pool");
        } else {
            *out = id;
            rc = 0;
        }
    }
    Py_DECREF(seq);
    return rc;
}

int gm_py_pool_arg(PyObject *obj, void *out) { return to_pool_id(obj, out) == 0; }

int gm_py_pool_or_none_arg(PyObject *obj, void *out) {
    if (obj == Py_None) {
        *(gm_pool_id *)out = (gm_pool_id){0, 0};
        return 1;
    }
    return to_pool_id(obj, out) == 0;
}

/* ---- the out-of-memory message ---------------------------------------------------
 * Made by gm_py_oom_message (oom_glue.c), as torch's is. */

/* Raise gm_py_OutOfMemoryError for the last failed allocation, with .info = the report. */
static PyObject *raise_oom(HeapObject *self) {
    gm_oom_info info;
    if (gm_last_oom(self->heap, &info) != GM_OK) return gm_py_raise(self, GM_ENOMEM, "malloc");
    PyObject *d = NULL;
    PyObject *msg = gm_py_oom_message((PyObject *)self, &info, -1, NULL, -1, self->dev->last_error, &d);
    if (msg == NULL) return NULL;
    PyObject *exc = PyObject_CallFunctionObjArgs(gm_py_OutOfMemoryError, msg, NULL);
    Py_DECREF(msg);
    if (exc == NULL || PyObject_SetAttrString(exc, "info", d) < 0) {
        Py_DECREF(d);
        Py_XDECREF(exc);
        return NULL;
    }
    Py_DECREF(d);
    PyErr_SetObject(gm_py_OutOfMemoryError, exc);
    Py_DECREF(exc);
    return NULL;
}

/* ---- construction and lifetime ---------------------------------------------------- */

static PyObject *Heap_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    (void)args;
    (void)kwds;
    HeapObject *self = (HeapObject *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->heap = NULL;
        self->dev = NULL;
        self->is_sim = 0;
        self->registry_device = -1;
        self->busy = 0;
    }
    return (PyObject *)self;
}

static PyTypeObject HeapType;

int gm_py_is_heap(PyObject *o) { return PyObject_TypeCheck(o, &HeapType); }

PyObject *gm_py_heap_borrow(int device) {
    gm_heap *heap = gm_heap_registry_get(device);
    if (heap == NULL) return PyErr_Format(PyExc_ValueError, "the heap registry has no heap on device %d", device);
    HeapObject *self = (HeapObject *)HeapType.tp_alloc(&HeapType, 0);
    if (self == NULL) return NULL;
    self->heap = heap;
    self->dev = gm_heap_device(heap);
    self->is_sim = gm_sim_is(self->dev);
    self->registry_device = device;
    self->busy = 0;
    self->busy_gen = gm_py_fork_gen;
    return (PyObject *)self;
}

/* The device arguments of Heap(...): capacity (None: not given) and page_size (NULL: not given). */
static int device_args(gm_device_args *a, PyObject *capacity_o, PyObject *page_size_o, int ordinal) {
    gm_device_args_default(a);
    a->ordinal = ordinal;
    if (capacity_o != Py_None) {
        if (gm_py_to_size_or_str(capacity_o, "capacity", &a->capacity) < 0) return -1;
        a->has_capacity = 1;
    }
    if (page_size_o && gm_py_to_size_or_str(page_size_o, "page_size", &a->page_size) < 0) return -1;
    return 0;
}

/* Open the device by name (gpumem/registry.h): a caller's mistake is a ValueError. */
static gm_device *open_device(const char *name, const gm_device_args *a) {
    gm_device *dev = NULL;
    char err[256] = "";
    int rc = gm_device_open(name, a, &dev, err, sizeof err);
    if (rc == GM_OK) return dev;
    if (rc == GM_EINVAL)
        PyErr_SetString(PyExc_ValueError, err);
    else if (rc == GM_ENOMEM)
        PyErr_NoMemory();
    else
        PyErr_Format(gm_py_DeviceError, "cannot open %s:%d: %s", name, a->ordinal, err[0] ? err : "unknown reason");
    return NULL;
}

/* Raise for a failed gm_heap_create: the device is gone, the core kept its reason. */
static int raise_create_error(int rc) {
    const char *why = gm_create_error();
    if (rc == GM_EINVAL)
        PyErr_Format(PyExc_ValueError, "cannot create heap: %s (GM_EINVAL)", why);
    else if (rc == GM_ENOMEM && strncmp(why, "host memory", 11) == 0) /* this process's, not the device's */
        PyErr_Format(PyExc_MemoryError, "cannot create heap: out of %s", why);
    else if (rc == GM_ENOMEM)
        PyErr_Format(gm_py_OutOfMemoryError, "CUDA out of memory. cannot create heap: %s (GM_ENOMEM)", why);
    else
        PyErr_Format(gm_py_DeviceError, "cannot create heap: %s (%s)", why, gm_py_code_name(rc));
    return -1;
}

static int Heap_init(HeapObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"device", "capacity",     "page_size",          "ordinal",        "va_size",
                             "cap",    "growth_slack", "growth_slack_pages", "chunk_pages",    "pressure",
                             "spill",  "spill_choice", "host_capacity",      "stream_handoff", "split_chunks",
                             NULL};
    const char *device = "sim";
    PyObject *capacity_o = Py_None, *page_size_o = NULL, *va_size_o = NULL, *cap_o = NULL;
    PyObject *slack_o = Py_None, *slack_pages_o = Py_None, *chunk_o = Py_None, *pressure_o = Py_None;
    PyObject *spill_o = Py_None, *choice_o = Py_None, *host_o = Py_None, *handoff_o = Py_None, *split_o = Py_None;
    int ordinal = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|sOOiOOOOOOOOOOO:Heap", kwlist, &device, &capacity_o, &page_size_o,
                                     &ordinal, &va_size_o, &cap_o, &slack_o, &slack_pages_o, &chunk_o, &pressure_o,
                                     &spill_o, &choice_o, &host_o, &handoff_o, &split_o))
        return -1;
    gm_device_args dargs;
    gm_config cfg;
    gm_config_default(&cfg);
    if (device_args(&dargs, capacity_o, page_size_o, ordinal) < 0 ||
        (host_o != Py_None && gm_py_to_size_or_str(host_o, "host_capacity", &dargs.host_capacity) < 0) ||
        gm_py_config_option(&cfg, GM_OPT_SPILL, "spill", spill_o) < 0 ||
        gm_py_config_option(&cfg, GM_OPT_SPILL_CHOICE, "spill_choice", choice_o) < 0 ||
        gm_py_config_option(&cfg, GM_OPT_VA_SIZE, "va_size", va_size_o) < 0 ||
        gm_py_config_option(&cfg, GM_OPT_CAP_BYTES, "cap", cap_o) < 0 ||
        gm_py_config_option(&cfg, GM_OPT_GROWTH_SLACK, "growth_slack", slack_o) < 0 ||
        gm_py_config_option(&cfg, GM_OPT_GROWTH_SLACK_PAGES, "growth_slack_pages", slack_pages_o) < 0 ||
        gm_py_config_option(&cfg, GM_OPT_CHUNK_PAGES, "chunk_pages", chunk_o) < 0 ||
        gm_py_config_option(&cfg, GM_OPT_PRESSURE, "pressure", pressure_o) < 0 ||
        gm_py_config_option(&cfg, GM_OPT_STREAM_HANDOFF, "stream_handoff", handoff_o) < 0 ||
        gm_py_config_option(&cfg, GM_OPT_SPLIT_CHUNKS, "split_chunks", split_o) < 0)
        return -1;
    dargs.has_host_capacity = host_o != Py_None;
    /* After the conversions: one of them may have called __init__ again. */
    if (self->heap != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Heap.__init__ called twice");
        return -1;
    }
    gm_device *dev = open_device(device, &dargs);
    if (dev == NULL) return -1;
    int is_sim = gm_sim_is(dev);
    gm_heap *heap = NULL;
    int rc = gm_heap_create(dev, &cfg, &heap); /* owns dev from here, also on failure */
    if (rc != GM_OK) return raise_create_error(rc);
    self->heap = heap;
    self->dev = gm_heap_device(heap);
    self->is_sim = is_sim;
    self->busy = 0;
    self->busy_gen = gm_py_fork_gen;
    return 0;
}

/* __init__: a borrowed Heap, even once closed, stays the registry's. */
static int Heap_init_own(HeapObject *self, PyObject *args, PyObject *kwds) {
    if (self->registry_device >= 0) {
        PyErr_SetString(PyExc_RuntimeError, "Heap.__init__ on a Heap that borrows the heap registry's heap");
        return -1;
    }
    return Heap_init(self, args, kwds);
}

static void Heap_dealloc(HeapObject *self) {
    /* No method can be running: each holds a reference to self.  A borrowed
     * heap is the registry's: it lives on. */
    if (self->heap != NULL && self->registry_device < 0) {
        gm_heap_destroy(self->heap);
        self->heap = NULL;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Heap_close(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (self->heap == NULL) Py_RETURN_NONE;
    gm_py_fork_check(self);
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "cannot close a heap while another thread is inside it");
        return NULL;
    }
    gm_heap *heap = self->heap;
    self->heap = NULL;
    self->dev = NULL;
    if (self->registry_device < 0) gm_heap_destroy(heap); /* a borrowed one is only let go of */
    Py_RETURN_NONE;
}

static PyObject *Heap_enter(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *Heap_exit(HeapObject *self, PyObject *args) {
    (void)args;
    PyObject *r = Heap_close(self, NULL);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyObject *Heap_repr(HeapObject *self) {
    if (self->heap == NULL) return PyUnicode_FromString("<gpumem.Heap closed>");
    if (self->registry_device >= 0)
        return PyUnicode_FromFormat("<gpumem.Heap %s, the heap registry's of device %d>", self->dev->name,
                                    self->registry_device);
    return PyUnicode_FromFormat("<gpumem.Heap %s>", self->dev->name);
}

/* ---- allocation ------------------------------------------------------------------- */

static PyObject *Heap_malloc(HeapObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"size", "stream", "context", "pool", NULL};
    size_t size;
    uint64_t stream = 0, context = 0;
    gm_pool_id pool = {0, 0};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|O&O&O&:malloc", kwlist, gm_py_size_arg, &size, gm_py_stream_arg,
                                     &stream, gm_py_context_arg, &context, gm_py_pool_or_none_arg, &pool))
        return NULL;
    int in_pool = pool.first || pool.second;
    /* The stack is an argument too: taking it may make frame objects (and so
     * run the garbage collector), so it comes before the heap is checked. */
    if (context == 0) context = gm_py_capture_context(); /* 0 unless gpumem.record_history(stacks="python") */
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    uintptr_t ptr = 0;
    int rc;
    ENTER_CORE(self);
    rc = gm_malloc_pool(self->heap, size, (gm_stream)stream, context, in_pool ? &pool : NULL, &ptr);
    LEAVE_CORE(self);
    if (rc == GM_ENOMEM) return raise_oom(self);
    if (rc == GM_EINVAL && in_pool) {
        gm_pool_info info;
        if (gm_pool_info_get(self->heap, pool, &info) != GM_OK) return gm_py_no_such_pool(&pool);
    }
    if (rc == GM_EINVAL && !self->dev->last_error[0]) {
        PyErr_Format(PyExc_ValueError, "malloc: size %zu is not a size this heap can serve (GM_EINVAL)", size);
        return NULL;
    }
    if (rc != GM_OK) return gm_py_raise(self, rc, "malloc");
    return PyLong_FromUnsignedLongLong((unsigned long long)ptr);
}

/* Raise for `call` failing on the block at ptr: "free(0x7f...)" names it. */
static PyObject *raise_at(HeapObject *self, int rc, const char *call, uint64_t ptr) {
    char what[64];
    snprintf(what, sizeof what, "%s(0x%" PRIx64 ")", call, ptr);
    return gm_py_raise(self, rc, what);
}

static PyObject *Heap_free(HeapObject *self, PyObject *ptr_o) {
    uint64_t ptr;
    if (gm_py_arg(self, GM_PY_OPEN, ptr_o, gm_py_ptr_arg, &ptr) < 0) return NULL;
    int rc;
    ENTER_CORE(self);
    rc = gm_free(self->heap, (uintptr_t)ptr);
    LEAVE_CORE(self);
    if (rc != GM_OK) return raise_at(self, rc, "free", ptr);
    Py_RETURN_NONE;
}

static PyObject *Heap_record_stream(HeapObject *self, PyObject *args) {
    uint64_t ptr, stream;
    if (gm_py_args(self, GM_PY_OPEN, args, NULL, "O&O&:record_stream", NULL, gm_py_ptr_arg, &ptr, gm_py_stream_arg,
                   &stream) < 0)
        return NULL;
    int rc;
    ENTER_CORE(self);
    rc = gm_record_stream(self->heap, (uintptr_t)ptr, (gm_stream)stream);
    LEAVE_CORE(self);
    if (rc != GM_OK) return raise_at(self, rc, "record_stream", ptr);
    Py_RETURN_NONE;
}

static PyObject *Heap_block_size(HeapObject *self, PyObject *ptr_o) {
    uint64_t ptr;
    if (gm_py_arg(self, GM_PY_OPEN, ptr_o, gm_py_ptr_arg, &ptr) < 0) return NULL;
    size_t n = gm_block_size(self->heap, (uintptr_t)ptr);
    return PyLong_FromSize_t(n);
}

/* fn(heap) on an open heap, without the GIL: its result, or HEAP_NOT_READY with the error set. */
#define HEAP_NOT_READY INT_MIN
static int heap_call(HeapObject *self, int (*fn)(gm_heap *)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return HEAP_NOT_READY;
    int rc;
    ENTER_CORE(self);
    rc = fn(self->heap);
    LEAVE_CORE(self);
    return rc;
}

static PyObject *Heap_empty_cache(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    int rc = heap_call(self, gm_empty_cache);
    if (rc == HEAP_NOT_READY) return NULL;
    if (rc != GM_OK) return gm_py_raise(self, rc, "empty_cache");
    Py_RETURN_NONE;
}

/* unspill() -> True when nothing is left in host memory, False when the device
 * had no room for some of it (it stays where it is, intact). */
static PyObject *Heap_unspill(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    int rc = heap_call(self, gm_unspill);
    if (rc == HEAP_NOT_READY) return NULL;
    if (rc == GM_ENOMEM) Py_RETURN_FALSE;
    if (rc != GM_OK) return gm_py_raise(self, rc, "unspill");
    Py_RETURN_TRUE;
}

static PyObject *Heap_set_cap(HeapObject *self, PyObject *cap_o) {
    size_t cap;
    if (gm_py_arg(self, GM_PY_OPEN, cap_o, gm_py_cap_arg, &cap) < 0) return NULL;
    int rc;
    ENTER_CORE(self);
    /* The registry keeps a borrowed heap's cap as its limit too. */
    rc =
        self->registry_device >= 0 ? gm_heap_registry_set_cap(self->registry_device, cap) : gm_set_cap(self->heap, cap);
    LEAVE_CORE(self);
    if (rc == GM_EINVAL && !self->dev->last_error[0]) {
        PyErr_Format(PyExc_ValueError, "set_cap: %zu bytes is not a valid cap (GM_EINVAL)", cap);
        return NULL;
    }
    if (rc != GM_OK) return gm_py_raise(self, rc, "set_cap");
    Py_RETURN_NONE;
}

static PyObject *Heap_get_cap(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    size_t cap = gm_get_cap(self->heap);
    return PyLong_FromSize_t(cap);
}

/* ---- statistics, checks, snapshots -------------------------------------------------- */

static PyObject *Heap_stats(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    gm_stats s;
    gm_get_stats(self->heap, &s);
    return gm_py_stats_dict(&s);
}

/* A method without arguments that only calls the core's void fn(heap) on an open heap. */
static PyObject *heap_do(HeapObject *self, void (*fn)(gm_heap *)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    fn(self->heap);
    Py_RETURN_NONE;
}

static PyObject *Heap_reset_peak_stats(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    return heap_do(self, gm_reset_peak_stats);
}

static PyObject *Heap_reset_accumulated_stats(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    return heap_do(self, gm_reset_accumulated_stats);
}

static PyObject *Heap_check(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    char why[512] = "";
    int rc;
    ENTER_CORE(self);
    rc = gm_check(self->heap, why, sizeof why);
    LEAVE_CORE(self);
    if (rc == GM_ECORRUPT) {
        PyErr_SetString(gm_py_CorruptionError, why[0] ? why : "invariant broken (no reason given)");
        return NULL;
    }
    if (rc != GM_OK) return gm_py_raise(self, rc, "check");
    Py_RETURN_NONE;
}

static PyObject *Heap_snapshot(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    gm_snapshot *snap = NULL;
    int rc = gm_snapshot_take(self->heap, &snap);
    if (rc != GM_OK) return rc == GM_ENOMEM ? PyErr_NoMemory() : gm_py_raise(self, rc, "snapshot");
    PyObject *d = gm_py_snapshot_dict(snap, "unknown");
    gm_snapshot_free(snap);
    return d;
}

/* ---- history ---------------------------------------------------------------------- */

static PyObject *Heap_history_enable(HeapObject *self, PyObject *n_o) {
    size_t n;
    if (gm_py_arg(self, GM_PY_OPEN, n_o, gm_py_max_entries_arg, &n) < 0) return NULL;
    /* The registry's heaps share one history switch, as torch's does: every
     * heap, now and later. */
    int rc = self->registry_device >= 0 ? gm_heap_registry_history_enable(n) : gm_history_enable(self->heap, n);
    if (rc == GM_ENOMEM) return PyErr_NoMemory();
    if (rc != GM_OK) return gm_py_raise(self, rc, "history_enable");
    Py_RETURN_NONE;
}

static PyObject *Heap_history(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    return gm_py_history(self->heap, "unknown");
}

/* ---- out-of-memory reports ------------------------------------------------------------ */

/* mem_info() -> (free, total) of the whole device, taken under the heap's lock. */
static PyObject *Heap_mem_info(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    gm_oom_info info;
    gm_memory_report(self->heap, 0, &info);
    return Py_BuildValue("(KK)", (unsigned long long)info.device_free, (unsigned long long)info.device_total);
}

/* device_processes() -> [(pid, bytes)] holding memory on the device (this process
 * included), or None when there is no source (no NVML: GM_ENOTSUP). */
static PyObject *Heap_device_processes(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    if (self->is_sim && self->busy) {
        /* The sim device is guarded by the heap's lock only; see gm_py_heap_sim. */
        PyErr_SetString(PyExc_RuntimeError, "device_processes: another thread is inside this heap");
        return NULL;
    }
    size_t cap = 64, n = 0;
    for (;;) {
        gm_proc_usage *buf = PyMem_Calloc(cap, sizeof *buf);
        if (buf == NULL) return PyErr_NoMemory();
        int rc;
        if (self->registry_device >= 0) { /* serialized with the registry's other device calls */
            Py_BEGIN_ALLOW_THREADS rc = gm_heap_registry_processes(self->registry_device, buf, cap, &n);
            Py_END_ALLOW_THREADS
        } else {
            rc = self->dev->ops->processes(self->dev, buf, cap, &n);
        }
        if (rc == GM_ENOTSUP) {
            PyMem_Free(buf);
            Py_RETURN_NONE;
        }
        if (rc != GM_OK) {
            PyMem_Free(buf);
            return gm_py_raise(self, rc, "device_processes");
        }
        if (n > cap) {
            PyMem_Free(buf);
            cap = n;
            continue;
        }
        PyObject *l = gm_py_procs_list(buf, (long)n);
        PyMem_Free(buf);
        return l;
    }
}

static PyObject *Heap_last_oom(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    gm_oom_info info;
    if (gm_last_oom(self->heap, &info) != GM_OK) Py_RETURN_NONE;
    return gm_py_oom_dict(&info);
}

static PyObject *Heap_memory_report(HeapObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"size", NULL};
    size_t size = 0;
    if (gm_py_args(self, GM_PY_OPEN, args, kwds, "|O&:memory_report", kwlist, gm_py_size_arg, &size) < 0) return NULL;
    gm_oom_info info;
    gm_memory_report(self->heap, size, &info);
    return gm_py_oom_dict(&info);
}

/* ---- stream capture (the private pools' methods are pool_glue.c's) ---------------------- */

static PyObject *Heap_capture_begin(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    return heap_do(self, gm_capture_begin);
}

static PyObject *Heap_capture_end(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    if (!gm_capturing(self->heap)) {
        PyErr_SetString(PyExc_RuntimeError, "capture_end without capture_begin");
        return NULL;
    }
    ENTER_CORE(self);
    gm_capture_end(self->heap);
    LEAVE_CORE(self);
    Py_RETURN_NONE;
}

static PyObject *Heap_get_capturing(HeapObject *self, void *Py_UNUSED(closure)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    return PyLong_FromLong(gm_capturing(self->heap));
}

/* ---- properties ------------------------------------------------------------------------- */

static PyObject *Heap_get_device_kind(HeapObject *self, void *Py_UNUSED(closure)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    return PyUnicode_FromString(self->dev->kind);
}

static PyObject *Heap_get_device_name(HeapObject *self, void *Py_UNUSED(closure)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    return PyUnicode_FromString(self->dev->name);
}

static PyObject *Heap_get_page_size(HeapObject *self, void *Py_UNUSED(closure)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    return PyLong_FromSize_t(self->dev->page_size);
}

static PyObject *Heap_get_closed(HeapObject *self, void *Py_UNUSED(closure)) {
    return PyBool_FromLong(self->heap == NULL);
}

static PyObject *Heap_get_registry_device(HeapObject *self, void *Py_UNUSED(closure)) {
    if (self->registry_device < 0) Py_RETURN_NONE;
    return PyLong_FromLong(self->registry_device);
}

/* ---- type and module tables ------------------------------------------------------------- */

/* Heap's methods: this file's, then pool_glue.c's, replay_glue.c's and
 * sim_glue.c's (gathered at import). */
static PyMethodDef Heap_methods[64];

static PyMethodDef Heap_core_methods[] = {
    {.ml_name = "malloc",
     .ml_meth = KW(Heap_malloc),
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "malloc(size, stream=0, context=0, pool=None) -> address\n"
               "pool: a private pool's id, a pair of ints (torch's MempoolId_t)"},
    {.ml_name = "capture_begin",
     .ml_meth = (PyCFunction)Heap_capture_begin,
     .ml_flags = METH_NOARGS,
     .ml_doc = "capture_begin(): a graph capture starts (nests): no sync, event or unmap until it ends"},
    {.ml_name = "capture_end",
     .ml_meth = (PyCFunction)Heap_capture_end,
     .ml_flags = METH_NOARGS,
     .ml_doc = "capture_end(): the capture ends; frees it deferred get their events"},
    {.ml_name = "free", .ml_meth = (PyCFunction)Heap_free, .ml_flags = METH_O, .ml_doc = "free(ptr)"},
    {.ml_name = "record_stream",
     .ml_meth = (PyCFunction)Heap_record_stream,
     .ml_flags = METH_VARARGS,
     .ml_doc = "record_stream(ptr, stream): ptr is in use on stream too"},
    {.ml_name = "block_size",
     .ml_meth = (PyCFunction)Heap_block_size,
     .ml_flags = METH_O,
     .ml_doc = "block_size(ptr) -> bytes of the live block at ptr, 0 if not live"},
    {.ml_name = "empty_cache",
     .ml_meth = (PyCFunction)Heap_empty_cache,
     .ml_flags = METH_NOARGS,
     .ml_doc = "release every physical page that backs no live block"},
    {.ml_name = "unspill",
     .ml_meth = (PyCFunction)Heap_unspill,
     .ml_flags = METH_NOARGS,
     .ml_doc = "unspill() -> bool: move every spilled page back to the device (False: no room for some)"},
    {.ml_name = "set_cap",
     .ml_meth = (PyCFunction)Heap_set_cap,
     .ml_flags = METH_O,
     .ml_doc = "set_cap(bytes): cap physical memory (0 = the device)"},
    {.ml_name = "get_cap",
     .ml_meth = (PyCFunction)Heap_get_cap,
     .ml_flags = METH_NOARGS,
     .ml_doc = "get_cap() -> bytes (0 = no cap)"},
    {.ml_name = "stats",
     .ml_meth = (PyCFunction)Heap_stats,
     .ml_flags = METH_NOARGS,
     .ml_doc = "stats() -> dict with torch.cuda.memory_stats key names"},
    {.ml_name = "reset_peak_stats",
     .ml_meth = (PyCFunction)Heap_reset_peak_stats,
     .ml_flags = METH_NOARGS,
     .ml_doc = "set every peak to its current value"},
    {.ml_name = "reset_accumulated_stats",
     .ml_meth = (PyCFunction)Heap_reset_accumulated_stats,
     .ml_flags = METH_NOARGS,
     .ml_doc = "zero the allocated/freed and event counters"},
    {.ml_name = "check",
     .ml_meth = (PyCFunction)Heap_check,
     .ml_flags = METH_NOARGS,
     .ml_doc = "check(): raise gm_py_CorruptionError if an invariant is broken"},
    {.ml_name = "snapshot",
     .ml_meth = (PyCFunction)Heap_snapshot,
     .ml_flags = METH_NOARGS,
     .ml_doc = "snapshot() -> dict of blocks, pages and stats"},
    {.ml_name = "history_enable",
     .ml_meth = (PyCFunction)Heap_history_enable,
     .ml_flags = METH_O,
     .ml_doc = "history_enable(max_entries): keep the last max_entries events (0 = off)"},
    {.ml_name = "history",
     .ml_meth = (PyCFunction)Heap_history,
     .ml_flags = METH_NOARGS,
     .ml_doc = "history() -> ([(time_ns, action, addr, size, stream, context)], dropped)"},
    {.ml_name = "mem_info",
     .ml_meth = (PyCFunction)Heap_mem_info,
     .ml_flags = METH_NOARGS,
     .ml_doc = "mem_info() -> (free, total) bytes of the whole device"},
    {.ml_name = "device_processes",
     .ml_meth = (PyCFunction)Heap_device_processes,
     .ml_flags = METH_NOARGS,
     .ml_doc = "device_processes() -> [(pid, bytes)] on the device, or None without NVML"},
    {.ml_name = "last_oom",
     .ml_meth = (PyCFunction)Heap_last_oom,
     .ml_flags = METH_NOARGS,
     .ml_doc = "last_oom() -> report of the last failed allocation, or None"},
    {.ml_name = "memory_report",
     .ml_meth = KW(Heap_memory_report),
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "memory_report(size=0) -> the OOM report for a request of size bytes now"},
    {.ml_name = "close",
     .ml_meth = (PyCFunction)Heap_close,
     .ml_flags = METH_NOARGS,
     .ml_doc = "destroy the heap and its device (a borrowed heap is only let go of); later calls raise ValueError"},
    {.ml_name = "__enter__", .ml_meth = (PyCFunction)Heap_enter, .ml_flags = METH_NOARGS},
    {.ml_name = "__exit__", .ml_meth = (PyCFunction)Heap_exit, .ml_flags = METH_VARARGS},
    {.ml_name = NULL},
};

static PyGetSetDef Heap_getset[] = {
    {.name = "device_kind", .get = (getter)Heap_get_device_kind, .doc = "\"sim\" or \"cuda\""},
    {.name = "device_name", .get = (getter)Heap_get_device_name, .doc = "e.g. \"sim:80GiB\""},
    {.name = "page_size", .get = (getter)Heap_get_page_size, .doc = "physical page size in bytes"},
    {.name = "closed", .get = (getter)Heap_get_closed, .doc = "True once close() was called"},
    {.name = "registry_device",
     .get = (getter)Heap_get_registry_device,
     .doc = "the device whose heap this Heap borrows from the process-wide heap registry (the heap torch, CuPy "
            "and Numba allocate from), or None for a heap of its own"},
    {.name = "capturing",
     .get = (getter)Heap_get_capturing,
     .doc = "capture_begin() calls not yet ended (0: no capture)"},
    {.name = NULL},
};

static PyTypeObject HeapType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpumem.Heap",
    .tp_basicsize = sizeof(HeapObject),
    .tp_itemsize = 0,
    .tp_dealloc = (destructor)Heap_dealloc,
    .tp_repr = (reprfunc)Heap_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Heap(device=\"sim\", capacity=80 GiB, page_size=0, ordinal=0, va_size=0, cap=0,\n"
              "     growth_slack=None, growth_slack_pages=None, chunk_pages=None, pressure=None,\n"
              "     spill=0, spill_choice=\"old\", host_capacity=None, stream_handoff=1, split_chunks=0)\n\n"
              "A gpumem heap over one device: a simulated one (\"sim\") or a CUDA GPU (\"cuda\").",
    .tp_methods = Heap_methods,
    .tp_getset = Heap_getset,
    .tp_init = (initproc)Heap_init_own,
    .tp_new = Heap_new,
};

static PyObject *mod_strerror(PyObject *Py_UNUSED(mod), PyObject *code_o) {
    int code = (int)PyLong_AsLong(code_o);
    if (code == -1 && PyErr_Occurred()) return NULL;
    return PyUnicode_FromString(gm_strerror(code));
}

static PyObject *mod_format_bytes(PyObject *Py_UNUSED(mod), PyObject *n_o) {
    uint64_t n;
    if (gm_py_to_u64(n_o, "n", UINT64_MAX, &n) < 0) return NULL;
    char buf[32];
    gm_fmt_bytes(buf, sizeof buf, n);
    return PyUnicode_FromString(buf);
}

static PyMethodDef module_methods[] = {
    {.ml_name = "strerror",
     .ml_meth = (PyCFunction)mod_strerror,
     .ml_flags = METH_O,
     .ml_doc = "strerror(code) -> the core's text for a GM_E* code"},
    {.ml_name = "format_bytes",
     .ml_meth = (PyCFunction)mod_format_bytes,
     .ml_flags = METH_O,
     .ml_doc = "format_bytes(n) -> the size formatting used in error messages"},
    {.ml_name = NULL},
};

int gm_torch_glue_add(PyObject *module);    /* torch_glue.c */
int gm_registry_glue_add(PyObject *module); /* registry_glue.c */
int gm_native_glue_add(PyObject *module);   /* native_glue.c */
int gm_test_hooks_add(PyObject *module);    /* test_hooks.c */

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, .m_name = "gpumem._C",       .m_doc = "gpumem's C core: the Heap type and its exceptions.",
    .m_size = -1,          .m_methods = module_methods,
};

static int add_exception(PyObject *m, PyObject **slot, const char *name, PyObject *base, const char *doc) {
    char full[64];
    snprintf(full, sizeof full, "gpumem.%s", name);
    *slot = PyErr_NewExceptionWithDoc(full, doc, base, NULL);
    if (*slot == NULL) return -1;
    Py_INCREF(*slot);
    if (PyModule_AddObject(m, name, *slot) < 0) {
        Py_DECREF(*slot);
        return -1;
    }
    return 0;
}

static int gather_methods(void) {
    const PyMethodDef *tables[] = {Heap_core_methods, gm_py_pool_methods, gm_py_replay_methods, gm_py_sim_methods};
    size_t n = 0;
    for (size_t t = 0; t < sizeof tables / sizeof tables[0]; t++)
        for (const PyMethodDef *d = tables[t]; d->ml_name; d++) {
            if (n + 1 >= sizeof Heap_methods / sizeof Heap_methods[0]) {
                PyErr_SetString(PyExc_SystemError, "gpumem._C: too many Heap methods for the table");
                return -1;
            }
            Heap_methods[n++] = *d;
        }
    return 0;
}

PyMODINIT_FUNC PyInit__C(void) {
    if (gather_methods() < 0 || PyType_Ready(&HeapType) < 0) return NULL;
    static int fork_handler;
    if (!fork_handler && pthread_atfork(NULL, NULL, fork_child) == 0) fork_handler = 1;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL) return NULL;
    if (add_exception(m, &gm_py_OutOfMemoryError, "OutOfMemoryError", PyExc_RuntimeError,
                      "An allocation failed even after releasing the cache and defragmenting.") < 0 ||
        add_exception(m, &gm_py_InvalidPointerError, "InvalidPointerError", PyExc_ValueError,
                      "free/record_stream of a pointer that is not live in this heap.") < 0 ||
        add_exception(m, &gm_py_CorruptionError, "CorruptionError", PyExc_RuntimeError,
                      "The invariant checker found a broken invariant.") < 0 ||
        add_exception(m, &gm_py_DeviceError, "DeviceError", PyExc_RuntimeError,
                      "A device call failed, or no CUDA driver could be loaded.") < 0)
        goto fail;
    Py_INCREF(&HeapType);
    if (PyModule_AddObject(m, "Heap", (PyObject *)&HeapType) < 0) {
        Py_DECREF(&HeapType);
        goto fail;
    }
    if (gm_history_glue_add(m) < 0 || gm_oom_glue_add(m) < 0 || gm_config_glue_add(m) < 0) goto fail;
    /* ERROR_NAMES, POOLED_STAT_NAMES, COUNTER_NAMES (convert.c); DEVICE_OPS (sim_glue.c) */
    if (gm_py_add_name_lists(m) < 0 || gm_py_add_device_ops(m) < 0) goto fail;
    if (PyModule_AddIntConstant(m, "CHUNK_PAGES_DEFAULT", GM_CHUNK_PAGES_DEFAULT) < 0 ||
        PyModule_AddIntConstant(m, "CHUNK_PAGES_MAX", GM_CHUNK_PAGES_MAX) < 0 ||
        PyModule_AddObject(m, "PRESSURE_DEFAULT", PyFloat_FromDouble(GM_PRESSURE_DEFAULT)) < 0 ||
        PyModule_AddIntConstant(m, "EVENT_SIZE", (long)sizeof(gm_replay_event)) < 0 ||
        PyModule_AddObject(m, "PAGE_SIZE_MAX", PyLong_FromSize_t(GM_PAGE_SIZE_MAX)) < 0 ||
        PyModule_AddObject(m, "SIM_MAX_PAGES", PyLong_FromSize_t(GM_SIM_MAX_PAGES)) < 0 ||
        PyModule_AddObject(m, "SIM_PAGE_SIZE", PyLong_FromSize_t(GM_SIM_PAGE_SIZE)) < 0 ||
        PyModule_AddIntConstant(m, "R_ALLOC", GM_R_ALLOC) < 0 || PyModule_AddIntConstant(m, "R_FREE", GM_R_FREE) < 0)
        goto fail;
    if (gm_torch_glue_add(m) < 0) /* _torch_* functions for gpumem.torch (torch_glue.c) */
        goto fail;
    if (gm_registry_glue_add(m) < 0) /* CuPy and Numba on torch's heaps (registry_glue.c) */
        goto fail;
    if (gm_native_glue_add(m) < 0) /* the model of torch's native allocator (native_glue.c) */
        goto fail;
    if (gm_test_hooks_add(m) < 0) /* TEST_HOOKS, and the hooks when built with them (test_hooks.c) */
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
