/*
 * native_glue.c -- gpumem._C.NativeModel and gpumem._C.native_replay: the
 * model of PyTorch's native caching allocator (csrc/model/native_model.c, gpumem/native_model.h)
 * for gpumem/native_model.py, whose NativeAllocator subclasses NativeModel.
 *
 * A model is plain memory of its own: no Python code runs inside the engine,
 * and every argument is converted before the engine is called, so a
 * conversion that calls back into the same model sees it between two calls.
 */
#include "heap_object.h"

#include <string.h>

#include "convert.h"
#include "gpumem/native_model.h"

/* The model reads the events gpumem/trace.py packs for the core. */
_Static_assert(GM_NATIVE_OP_ALLOC == GM_R_ALLOC, "the model's alloc op must be the trace's");

typedef struct {
    PyObject_HEAD gm_native *m;
    PyObject *capacity;       /* as given */
    PyObject *max_split_size; /* as given, or None */
} NativeModelObject;

/* ---- arguments ---------------------------------------------------------------------------------- */

/* obj as an int, or NULL with TypeError naming `what`.  New reference. */
static PyObject *as_int(PyObject *obj, const char *what) {
    PyObject *idx = PyNumber_Index(obj);
    if (idx == NULL && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be an int, not %.100s", what, Py_TYPE(obj)->tp_name);
    }
    return idx;
}

/* An int above `floor` (ValueError otherwise, worded by `msg` with the value
 * as given), into *out; values past 2**64 read as UINT64_MAX (the engine
 * takes anything above GM_NATIVE_UNLIMITED as unlimited).  0, or -1. */
static int int_above(PyObject *obj, const char *what, uint64_t floor, const char *msg, uint64_t *out) {
    PyObject *idx = as_int(obj, what);
    if (idx == NULL) return -1;
    PyObject *floor_o = PyLong_FromUnsignedLongLong(floor);
    int ok = floor_o ? PyObject_RichCompareBool(idx, floor_o, Py_GT) : -1;
    Py_XDECREF(floor_o);
    if (ok == 0) PyErr_Format(PyExc_ValueError, msg, obj);
    if (ok == 1) {
        *out = PyLong_AsUnsignedLongLong(idx);
        if (*out == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            *out = UINT64_MAX;
        }
    }
    Py_DECREF(idx);
    return ok == 1 ? 0 : -1;
}

/* The memory limit and max_split_size (0: None) as the model takes them.  0, or -1. */
static int limits(PyObject *capacity_o, PyObject *max_split_o, uint64_t *capacity, uint64_t *max_split) {
    if (capacity_o == NULL) {
        *capacity = GM_NATIVE_UNLIMITED;
    } else if (int_above(capacity_o, "capacity", 0, "capacity must be positive, not %S", capacity) < 0) {
        return -1;
    }
    *max_split = 0;
    if (max_split_o == NULL || max_split_o == Py_None) return 0;
    return int_above(max_split_o, "max_split_size", GM_NATIVE_MIN_MAX_SPLIT,
                     "max_split_size must be more than 20 MiB, not %S", max_split);
}

/* A request's size: a non-negative int; past 2**64 it reads as UINT64_MAX, a
 * size no limit fits. */
static int size_arg(PyObject *obj, void *out) {
    PyObject *idx = as_int(obj, "size"), *zero = PyLong_FromLong(0);
    int neg = idx && zero ? PyObject_RichCompareBool(idx, zero, Py_LT) : -1;
    if (neg == 1) PyErr_Format(PyExc_ValueError, "size must not be negative, got %S", idx);
    if (neg == 0) {
        *(uint64_t *)out = PyLong_AsUnsignedLongLong(idx);
        if (*(uint64_t *)out == (uint64_t)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            *(uint64_t *)out = UINT64_MAX;
        }
    }
    Py_XDECREF(idx);
    Py_XDECREF(zero);
    return neg == 0;
}

/* An engine's error as a Python exception.  NULL. */
static PyObject *raise_rc(int rc) {
    if (rc == GM_NATIVE_NO_HOST_MEMORY) return PyErr_NoMemory();
    if (rc == GM_NATIVE_NO_ADDRESSES)
        return PyErr_Format(PyExc_OverflowError, "the model found no room for a segment among the 2**63 addresses");
    return PyErr_Format(PyExc_SystemError, "native model: unexpected result %d", rc);
}

/* ---- NativeModel -------------------------------------------------------------------------------- */

static PyObject *NativeModel_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"capacity", "max_split_size", NULL};
    PyObject *capacity_o = NULL, *max_split_o = Py_None;
    uint64_t capacity, max_split;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|OO:NativeModel", kwlist, &capacity_o, &max_split_o) ||
        limits(capacity_o, max_split_o, &capacity, &max_split) < 0)
        return NULL;
    NativeModelObject *self = (NativeModelObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->m = gm_native_new(capacity, max_split);
    if (self->m == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    self->capacity = capacity_o ? capacity_o : PyLong_FromUnsignedLongLong(GM_NATIVE_UNLIMITED);
    if (capacity_o) Py_INCREF(capacity_o);
    Py_INCREF(max_split_o);
    self->max_split_size = max_split_o;
    if (self->capacity == NULL) Py_CLEAR(self);
    return (PyObject *)self;
}

static void NativeModel_dealloc(NativeModelObject *self) {
    gm_native_destroy(self->m);
    Py_XDECREF(self->capacity);
    Py_XDECREF(self->max_split_size);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *NativeModel_malloc(NativeModelObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"size", "stream", NULL};
    uint64_t size, stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&|O&:malloc", kwlist, size_arg, &size, gm_py_stream_arg, &stream))
        return NULL;
    int64_t addr;
    int rc = gm_native_malloc(self->m, size, stream, &addr);
    if (rc == GM_NATIVE_OOM) Py_RETURN_NONE;
    return rc == GM_NATIVE_OK ? PyLong_FromLongLong(addr) : raise_rc(rc);
}

static PyObject *NativeModel_free(NativeModelObject *self, PyObject *addr_o) {
    PyObject *idx = as_int(addr_o, "addr");
    if (idx == NULL) return NULL;
    int overflow;
    long long addr = PyLong_AsLongLongAndOverflow(idx, &overflow);
    int rc = GM_NATIVE_NOT_HANDED_OUT;
    if (!(addr == -1 && PyErr_Occurred()) && !overflow) rc = gm_native_free(self->m, addr);
    if (rc == GM_NATIVE_NOT_HANDED_OUT && !PyErr_Occurred()) {
        PyObject *hex = PyNumber_ToBase(idx, 16);
        if (hex) PyErr_Format(PyExc_ValueError, "free of an address the model did not hand out: %U", hex);
        Py_XDECREF(hex);
    }
    Py_DECREF(idx);
    if (PyErr_Occurred()) return NULL;
    if (rc != GM_NATIVE_OK) return raise_rc(rc);
    Py_RETURN_NONE;
}

static PyObject *NativeModel_empty_cache(NativeModelObject *self, PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong(gm_native_empty_cache(self->m));
}

static PyObject *NativeModel_blocks(NativeModelObject *self, PyObject *Py_UNUSED(ignored)) {
    size_t n = gm_native_blocks(self->m, NULL, 0);
    gm_native_block *b = PyMem_Malloc((n ? n : 1) * sizeof *b);
    if (b == NULL) return PyErr_NoMemory();
    gm_native_blocks(self->m, b, n);
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *t = Py_BuildValue("(LLKKOO)", (long long)b[i].segment, (long long)b[i].addr,
                                    (unsigned long long)b[i].size, (unsigned long long)b[i].stream,
                                    b[i].small ? Py_True : Py_False, b[i].free ? Py_True : Py_False);
        if (t == NULL) Py_CLEAR(list);
        if (list) PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    PyMem_Free(b);
    return list;
}

static PyObject *NativeModel_get_stat(NativeModelObject *self, void *offset) {
    const char *st = (const char *)gm_native_stats_of(self->m);
    return PyLong_FromUnsignedLongLong(*(const uint64_t *)(st + (size_t)offset));
}

static PyObject *NativeModel_get_capacity(NativeModelObject *self, void *Py_UNUSED(closure)) {
    Py_INCREF(self->capacity);
    return self->capacity;
}

static PyObject *NativeModel_get_max_split_size(NativeModelObject *self, void *Py_UNUSED(closure)) {
    Py_INCREF(self->max_split_size);
    return self->max_split_size;
}

static PyMethodDef NativeModel_methods[] = {
    {.ml_name = "malloc",
     .ml_meth = KW(NativeModel_malloc),
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "malloc(size, stream=0) -> the address of a block for size bytes on stream, or None (out of memory)"},
    {.ml_name = "free",
     .ml_meth = (PyCFunction)NativeModel_free,
     .ml_flags = METH_O,
     .ml_doc = "free(addr): give back a block malloc handed out (ValueError for any other address)"},
    {.ml_name = "empty_cache",
     .ml_meth = (PyCFunction)NativeModel_empty_cache,
     .ml_flags = METH_NOARGS,
     .ml_doc = "empty_cache() -> bytes released: release every wholly free segment (torch.cuda.empty_cache())"},
    {.ml_name = "blocks",
     .ml_meth = (PyCFunction)NativeModel_blocks,
     .ml_flags = METH_NOARGS,
     .ml_doc = "blocks() -> [(segment, addr, size, stream, small, free)]: every block, segment by segment,\n"
               "each segment's from its lowest address up (segment: the address of the segment)"},
    {.ml_name = NULL},
};

#define STAT(field, text)                                                                                              \
    {.name = #field,                                                                                                   \
     .get = (getter)NativeModel_get_stat,                                                                              \
     .doc = text,                                                                                                      \
     .closure = (void *)offsetof(gm_native_stats, field)}
static PyGetSetDef NativeModel_getset[] = {
    STAT(reserved, "bytes of segments held"),
    STAT(peak_reserved, "the most bytes of segments ever held"),
    STAT(allocated, "bytes of the blocks handed out, whole blocks (torch's allocated_bytes)"),
    STAT(peak_allocated, "the most bytes ever allocated (torch's max_memory_allocated)"),
    STAT(segments, "segments held"),
    STAT(num_device_alloc, "segments asked of the device"),
    STAT(num_device_free, "segments given back to the device"),
    STAT(num_alloc_retries, "requests that found the memory limit in the way and released cached memory"),
    STAT(ooms, "requests that failed"),
    {.name = "capacity", .get = (getter)NativeModel_get_capacity, .doc = "the memory limit, as given"},
    {.name = "max_split_size",
     .get = (getter)NativeModel_get_max_split_size,
     .doc = "max_split_size as given, or None"},
    {.name = NULL},
};
#undef STAT

static PyTypeObject NativeModelType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpumem._C.NativeModel",
    .tp_basicsize = sizeof(NativeModelObject),
    .tp_dealloc = (destructor)NativeModel_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "NativeModel(capacity=2**62, max_split_size=None)\n\n"
              "A model of PyTorch's native CUDA caching allocator (gpumem.native_model.NativeAllocator).",
    .tp_methods = NativeModel_methods,
    .tp_getset = NativeModel_getset,
    .tp_new = NativeModel_new,
};

/* ---- native_replay ------------------------------------------------------------------------------ */

static PyObject *replay_dict(const gm_native_replay_result *r) {
    const gm_native_stats *s = &r->stats;
    return Py_BuildValue("{s:K,s:L,s:K,s:K,s:K,s:K,s:K,s:K}", "ooms", (unsigned long long)s->ooms, "first_oom_event",
                         (long long)r->first_oom_event, "peak_reserved_bytes", (unsigned long long)s->peak_reserved,
                         "peak_allocated_bytes", (unsigned long long)s->peak_allocated, "segments",
                         (unsigned long long)s->segments, "num_device_alloc", (unsigned long long)s->num_device_alloc,
                         "num_device_free", (unsigned long long)s->num_device_free, "num_alloc_retries",
                         (unsigned long long)s->num_alloc_retries);
}

/* native_replay(words, capacity=2**62, stop_at_oom=False, max_split_size=None).
 * The GIL stays held: the engine reads the caller's buffer, which nothing
 * may rewrite meanwhile. */
static PyObject *mod_native_replay(PyObject *Py_UNUSED(mod), PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"words", "capacity", "stop_at_oom", "max_split_size", NULL};
    Py_buffer w = {0};
    PyObject *capacity_o = NULL, *max_split_o = Py_None, *result = NULL;
    int stop_at_oom = 0;
    uint64_t capacity, max_split, *copy = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|OpO:native_replay", kwlist, &w, &capacity_o, &stop_at_oom,
                                     &max_split_o))
        return NULL;
    const size_t event = 3 * sizeof(uint64_t);
    if (limits(capacity_o, max_split_o, &capacity, &max_split) < 0) goto done;
    if ((size_t)w.len % event != 0) {
        PyErr_Format(PyExc_ValueError, "words: %zd bytes is not a whole number of %zu-byte events", w.len, event);
        goto done;
    }
    const uint64_t *words = w.buf;
    if ((uintptr_t)w.buf % _Alignof(uint64_t) != 0) {
        if ((copy = PyMem_Malloc(w.len ? (size_t)w.len : 1)) == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(copy, w.buf, (size_t)w.len);
        words = copy;
    }
    gm_native_replay_result r;
    int rc = gm_native_replay(words, (size_t)w.len / event, capacity, max_split, stop_at_oom, &r);
    result = rc == GM_NATIVE_OK ? replay_dict(&r) : raise_rc(rc);
done:
    PyMem_Free(copy);
    PyBuffer_Release(&w);
    return result;
}

static PyMethodDef native_functions[] = {
    GM_PY_FN("native_replay", mod_native_replay, METH_VARARGS | METH_KEYWORDS,
             "native_replay(words, capacity=2**62, stop_at_oom=False, max_split_size=None) -> dict\n"
             "words: packed trace events, 3 64-bit words each (op | slot << 32, size, stream)."),
    {.ml_name = NULL},
};

int gm_native_glue_add(PyObject *m) {
    if (PyType_Ready(&NativeModelType) < 0 || PyModule_AddFunctions(m, native_functions) < 0) return -1;
    Py_INCREF(&NativeModelType);
    if (PyModule_AddObject(m, "NativeModel", (PyObject *)&NativeModelType) < 0) {
        Py_DECREF(&NativeModelType);
        return -1;
    }
    return PyModule_AddObject(m, "NATIVE_UNLIMITED", PyLong_FromUnsignedLongLong(GM_NATIVE_UNLIMITED));
}
