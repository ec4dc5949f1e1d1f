/*
 * module.c -- gpumem._C, the only place where gpumem talks to Python.
 *
 * One type, Heap, wraps one gm_heap (and the device it owns).  Everything
 * here is argument conversion, error mapping and object building; policy
 * lives in the core.
 *
 * Threads: calls that may take long or wait on the heap's lock (malloc, free,
 * record_stream, empty_cache, set_cap, check, replay) drop the GIL.  While a
 * thread is inside the core without the GIL, `busy` is non-zero; close() and
 * the sim_* setters (which touch the device outside the heap's lock) refuse
 * to run then instead of racing.  `busy` is only touched with the GIL held,
 * so the check itself cannot race.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem/gpumem.h"
#include "common.h"
#include "history_glue.h"

/* gpumem/trace.py packs events with struct "<IIQQ". */
_Static_assert(sizeof(gm_replay_event) == 24, "gm_replay_event must be 24 packed bytes");

/* ---- exceptions ------------------------------------------------------------ */

static PyObject *OutOfMemoryError;
static PyObject *InvalidPointerError;
static PyObject *CorruptionError;
static PyObject *DeviceError;

static const char *code_name(int code)
{
    switch (code) {
    case GM_OK: return "GM_OK";
    case GM_ENOMEM: return "GM_ENOMEM";
    case GM_EINVAL: return "GM_EINVAL";
    case GM_EUNKNOWN_PTR: return "GM_EUNKNOWN_PTR";
    case GM_EDOUBLE_FREE: return "GM_EDOUBLE_FREE";
    case GM_EDEVICE: return "GM_EDEVICE";
    case GM_ENOTREADY: return "GM_ENOTREADY";
    case GM_ENOTSUP: return "GM_ENOTSUP";
    case GM_ENODRIVER: return "GM_ENODRIVER";
    case GM_ECORRUPT: return "GM_ECORRUPT";
    default: return "GM_E?";
    }
}

/* ---- the Heap object --------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    gm_heap *heap;   /* NULL once closed */
    gm_device *dev;  /* owned by heap; valid while heap is */
    int is_sim;
    int busy;        /* threads inside the core without the GIL */
} HeapObject;

/* Every method starts here: a closed heap is a ValueError, as for a closed file. */
static int ensure_open(HeapObject *self)
{
    if (self->heap == NULL) {
        PyErr_SetString(PyExc_ValueError, "operation on a closed gpumem.Heap");
        return -1;
    }
    return 0;
}

static int ensure_sim(HeapObject *self, int changes_device)
{
    if (ensure_open(self) < 0)
        return -1;
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

/* Raise the exception that matches a core error code; `what` names the call.
 * The device's reason, if it gave one, ends the message: a GM_EINVAL from
 * set_cap may come from the device ("synchronize: would deadlock ..."), not
 * from the argument. */
static PyObject *raise_code(HeapObject *self, int code, const char *what)
{
    const char *detail = (self && self->dev && self->dev->last_error[0]) ? self->dev->last_error : NULL;
    const char *sep = detail ? ": " : "";
    if (!detail)
        detail = "";
    switch (code) {
    case GM_EINVAL:
        PyErr_Format(PyExc_ValueError, "%s: invalid argument (GM_EINVAL)%s%s", what, sep, detail);
        break;
    case GM_EUNKNOWN_PTR:
        PyErr_Format(InvalidPointerError, "%s: pointer was never handed out by this heap (GM_EUNKNOWN_PTR)", what);
        break;
    case GM_EDOUBLE_FREE:
        PyErr_Format(InvalidPointerError,
                     "%s: pointer is not live: freed twice, or not the start of an allocation (GM_EDOUBLE_FREE)",
                     what);
        break;
    case GM_EDEVICE:
    case GM_ENODRIVER:
    case GM_ENOTSUP:
        PyErr_Format(DeviceError, "%s: %s (%s)%s%s", what, gm_strerror(code), code_name(code), sep, detail);
        break;
    case GM_ECORRUPT:
        PyErr_Format(CorruptionError, "%s: heap is corrupt (GM_ECORRUPT)%s%s", what, sep, detail);
        break;
    case GM_ENOMEM:
        PyErr_Format(OutOfMemoryError, "CUDA out of memory. %s: %s (GM_ENOMEM)%s%s", what, gm_strerror(code), sep,
                     detail);
        break;
    default:
        PyErr_Format(PyExc_RuntimeError, "%s: %s (%s, code %d)%s%s", what, gm_strerror(code), code_name(code), code,
                     sep, detail);
        break;
    }
    return NULL;
}

/* ---- argument conversion ---------------------------------------------------- */

/* A non-negative integer no larger than `max`.  Sizes, pointers and streams all
 * come through here so that a negative or huge value is a ValueError, never a
 * silent wrap-around. */
static int to_u64(PyObject *obj, const char *what, uint64_t max, uint64_t *out)
{
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

static int to_size(PyObject *obj, const char *what, size_t *out)
{
    uint64_t v;
    if (to_u64(obj, what, (uint64_t)SIZE_MAX, &v) < 0)
        return -1;
    *out = (size_t)v;
    return 0;
}

/* Sizes for the constructor and set_cap may also be strings such as "24GiB";
 * their grammar lives in gpumem/_units.py so that Python and C agree. */
static int to_size_or_str(PyObject *obj, const char *what, size_t *out)
{
    if (!PyUnicode_Check(obj))
        return to_size(obj, what, out);
    PyObject *units = PyImport_ImportModule("gpumem._units");
    if (units == NULL)
        return -1;
    PyObject *n = PyObject_CallMethod(units, "parse_size", "O", obj);
    Py_DECREF(units);
    if (n == NULL)
        return -1;
    int rc = to_size(n, what, out);
    Py_DECREF(n);
    return rc;
}

static int op_from_name(PyObject *name, gm_dev_op *out)
{
    static const char *const names[GM_OP__COUNT] = {
        "reserve", "unreserve", "create", "release", "map", "unmap", "set_access", "event_create",
        "event_destroy", "event_record", "event_query", "synchronize", "mem_info", "processes",
    };
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "op must be a str, not %.100s", Py_TYPE(name)->tp_name);
        return -1;
    }
    const char *s = PyUnicode_AsUTF8(name);
    if (s == NULL)
        return -1;
    for (int i = 0; i < GM_OP__COUNT; i++) {
        if (strcmp(s, names[i]) == 0) {
            *out = (gm_dev_op)i;
            return 0;
        }
    }
    PyErr_Format(PyExc_ValueError, "unknown device op %R (expected one of reserve, unreserve, create, release, map, "
                 "unmap, set_access, event_create, event_destroy, event_record, event_query, synchronize, "
                 "mem_info, processes)", name);
    return -1;
}

/* ---- the out-of-memory message ---------------------------------------------------
 * All byte counts in messages go through gm_fmt_bytes (common.c), and the
 * whole message is built by oom_message alone, so that a richer explanation
 * can replace it in one place. */

static PyObject *oom_message(HeapObject *self, const gm_oom_info *o)
{
    gm_oom_sizes z;
    gm_oom_sizes_format(o, &z);

    char device[96];
    if (o->device_total)
        snprintf(device, sizeof device, "device has %s total, %s free", z.device_total, z.device_free);
    else
        snprintf(device, sizeof device, "device memory unknown");

    char failed[400] = "";
    if (o->device_error != GM_OK)
        snprintf(failed, sizeof failed, "; a device call failed: %s (%s)", code_name(o->device_error),
                 self->dev->last_error[0] ? self->dev->last_error : "no detail");

    return PyUnicode_FromFormat(
        "CUDA out of memory. Tried to allocate %s; %s; this process holds %s live, %s reserved "
        "(%s cached, %s pending); the largest block defragmentation could make now is %s; cap %s%s.",
        z.request, device, z.live, z.reserved, z.cached, z.pending, z.largest, z.cap, failed);
}

/* Raise OutOfMemoryError for the last failed allocation, with .info = the report. */
static PyObject *raise_oom(HeapObject *self)
{
    gm_oom_info info;
    if (gm_last_oom(self->heap, &info) != GM_OK)
        return raise_code(self, GM_ENOMEM, "malloc");
    PyObject *d = gm_py_oom_dict(&info);
    if (d == NULL)
        return NULL;
    /* gpumem.explain words the message when it is loaded (history_glue.c). */
    PyObject *msg = gm_py_format_oom((PyObject *)self, d, oom_message(self, &info));
    if (msg == NULL) {
        Py_DECREF(d);
        return NULL;
    }
    PyObject *exc = PyObject_CallFunctionObjArgs(OutOfMemoryError, msg, NULL);
    Py_DECREF(msg);
    if (exc == NULL || PyObject_SetAttrString(exc, "info", d) < 0) {
        Py_DECREF(d);
        Py_XDECREF(exc);
        return NULL;
    }
    Py_DECREF(d);
    PyErr_SetObject(OutOfMemoryError, exc);
    Py_DECREF(exc);
    return NULL;
}

/* ---- construction and lifetime ---------------------------------------------------- */

static PyObject *Heap_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    (void)args;
    (void)kwds;
    HeapObject *self = (HeapObject *)type->tp_alloc(type, 0);
    if (self != NULL) {
        self->heap = NULL;
        self->dev = NULL;
        self->is_sim = 0;
        self->busy = 0;
    }
    return (PyObject *)self;
}

static int Heap_init(HeapObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"device", "capacity", "page_size", "ordinal", "va_size", "cap",
                             "growth_slack", "growth_slack_pages", NULL};
    const char *device = "sim";
    PyObject *capacity_o = Py_None, *page_size_o = NULL, *va_size_o = NULL, *cap_o = NULL;
    PyObject *slack_o = Py_None, *slack_pages_o = Py_None;
    int ordinal = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|sOOiOOOO:Heap", kwlist, &device, &capacity_o, &page_size_o,
                                     &ordinal, &va_size_o, &cap_o, &slack_o, &slack_pages_o))
        return -1;
    if (self->heap != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "Heap.__init__ called twice");
        return -1;
    }

    size_t capacity = (size_t)80 << 30, page_size = 0, va_size = 0, cap = 0;
    if (capacity_o != Py_None && to_size_or_str(capacity_o, "capacity", &capacity) < 0)
        return -1;
    if (page_size_o && to_size_or_str(page_size_o, "page_size", &page_size) < 0)
        return -1;
    if (va_size_o && to_size_or_str(va_size_o, "va_size", &va_size) < 0)
        return -1;
    if (cap_o && to_size_or_str(cap_o, "cap", &cap) < 0)
        return -1;

    gm_config cfg;
    gm_config_default(&cfg);
    cfg.va_size = va_size;
    cfg.cap_bytes = cap;
    if (slack_o != Py_None) {
        double g = PyFloat_AsDouble(slack_o);
        if (g == -1.0 && PyErr_Occurred())
            return -1;
        if (!(g >= 0.0)) {
            PyErr_SetString(PyExc_ValueError, "growth_slack must be a non-negative fraction");
            return -1;
        }
        cfg.growth_slack = g;
    }
    if (slack_pages_o != Py_None && to_size(slack_pages_o, "growth_slack_pages", &cfg.growth_slack_pages) < 0)
        return -1;

    gm_device *dev = NULL;
    int is_sim = 0;
    if (strcmp(device, "sim") == 0) {
        if (capacity == 0) {
            PyErr_SetString(PyExc_ValueError, "capacity of a sim device must be positive");
            return -1;
        }
        if (page_size & (page_size - 1)) {
            PyErr_Format(PyExc_ValueError, "page_size must be a power of two, got %zu", page_size);
            return -1;
        }
        dev = gm_sim_create(capacity, page_size);
        if (dev == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        is_sim = 1;
    } else if (strcmp(device, "cuda") == 0) {
        if (capacity_o != Py_None) {
            PyErr_SetString(PyExc_ValueError, "capacity applies to the sim device only; use cap= to limit a cuda heap");
            return -1;
        }
        if (page_size != 0) {
            PyErr_SetString(PyExc_ValueError, "page_size applies to the sim device only");
            return -1;
        }
        char err[256] = "";
        dev = gm_cuda_create(ordinal, err, sizeof err);
        if (dev == NULL) {
            PyErr_Format(DeviceError, "cannot open cuda:%d: %s", ordinal, err[0] ? err : "unknown reason");
            return -1;
        }
    } else {
        PyErr_Format(PyExc_ValueError, "device must be \"sim\" or \"cuda\", got \"%s\"", device);
        return -1;
    }

    gm_heap *heap = NULL;
    int rc = gm_heap_create(dev, &cfg, &heap); /* owns dev from here, also on failure */
    if (rc != GM_OK) {
        /* dev is gone; the core kept its reason. */
        const char *why = gm_create_error();
        if (rc == GM_EINVAL)
            PyErr_Format(PyExc_ValueError, "cannot create heap: %s (GM_EINVAL)", why);
        else if (rc == GM_ENOMEM)
            PyErr_Format(OutOfMemoryError, "CUDA out of memory. cannot create heap: %s (GM_ENOMEM)", why);
        else
            PyErr_Format(DeviceError, "cannot create heap: %s (%s)", why, code_name(rc));
        return -1;
    }
    self->heap = heap;
    self->dev = gm_heap_device(heap);
    self->is_sim = is_sim;
    return 0;
}

static void Heap_dealloc(HeapObject *self)
{
    /* No method can be running: each holds a reference to self. */
    if (self->heap != NULL) {
        gm_heap_destroy(self->heap);
        self->heap = NULL;
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Heap_close(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->heap == NULL)
        Py_RETURN_NONE;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "cannot close a heap while another thread is inside it");
        return NULL;
    }
    gm_heap *heap = self->heap;
    self->heap = NULL;
    self->dev = NULL;
    gm_heap_destroy(heap);
    Py_RETURN_NONE;
}

static PyObject *Heap_enter(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *Heap_exit(HeapObject *self, PyObject *args)
{
    (void)args;
    PyObject *r = Heap_close(self, NULL);
    if (r == NULL)
        return NULL;
    Py_DECREF(r);
    Py_RETURN_FALSE;
}

static PyObject *Heap_repr(HeapObject *self)
{
    if (self->heap == NULL)
        return PyUnicode_FromString("<gpumem.Heap closed>");
    return PyUnicode_FromFormat("<gpumem.Heap %s>", self->dev->name);
}

/* ---- allocation ------------------------------------------------------------------- */

/* Clearing the device's last_error first makes any reason found there after a
 * failure this call's own.  Only done when no other thread is inside the core:
 * then nothing else can be writing it (we hold the GIL, they would need it to
 * enter). */
#define ENTER_CORE(self) do { if (!(self)->busy) (self)->dev->last_error[0] = '\0'; \
    (self)->busy++; Py_BEGIN_ALLOW_THREADS
#define LEAVE_CORE(self) Py_END_ALLOW_THREADS (self)->busy--; } while (0)

static PyObject *Heap_malloc(HeapObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"size", "stream", "context", NULL};
    PyObject *size_o, *stream_o = NULL, *context_o = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OO:malloc", kwlist, &size_o, &stream_o, &context_o))
        return NULL;
    if (ensure_open(self) < 0)
        return NULL;
    size_t size;
    uint64_t stream = 0, context = 0;
    if (to_size(size_o, "size", &size) < 0)
        return NULL;
    if (stream_o && to_u64(stream_o, "stream", UINT64_MAX, &stream) < 0)
        return NULL;
    if (context_o && to_u64(context_o, "context", UINT64_MAX, &context) < 0)
        return NULL;
    if (context == 0)
        context = gm_py_capture_context(); /* 0 unless gpumem.record_history(stacks="python") */
    uintptr_t ptr = 0;
    int rc;
    ENTER_CORE(self);
    rc = gm_malloc(self->heap, size, (gm_stream)stream, context, &ptr);
    LEAVE_CORE(self);
    if (rc == GM_ENOMEM)
        return raise_oom(self);
    if (rc == GM_EINVAL && !self->dev->last_error[0]) {
        PyErr_Format(PyExc_ValueError, "malloc: size %zu is not a size this heap can serve (GM_EINVAL)", size);
        return NULL;
    }
    if (rc != GM_OK)
        return raise_code(self, rc, "malloc");
    return PyLong_FromUnsignedLongLong((unsigned long long)ptr);
}

static PyObject *Heap_free(HeapObject *self, PyObject *ptr_o)
{
    if (ensure_open(self) < 0)
        return NULL;
    uint64_t ptr;
    if (to_u64(ptr_o, "ptr", UINTPTR_MAX, &ptr) < 0)
        return NULL;
    int rc;
    ENTER_CORE(self);
    rc = gm_free(self->heap, (uintptr_t)ptr);
    LEAVE_CORE(self);
    if (rc != GM_OK) {
        char what[48];
        snprintf(what, sizeof what, "free(0x%" PRIx64 ")", ptr);
        return raise_code(self, rc, what);
    }
    Py_RETURN_NONE;
}

static PyObject *Heap_record_stream(HeapObject *self, PyObject *args)
{
    PyObject *ptr_o, *stream_o;
    if (!PyArg_ParseTuple(args, "OO:record_stream", &ptr_o, &stream_o))
        return NULL;
    if (ensure_open(self) < 0)
        return NULL;
    uint64_t ptr, stream;
    if (to_u64(ptr_o, "ptr", UINTPTR_MAX, &ptr) < 0 || to_u64(stream_o, "stream", UINT64_MAX, &stream) < 0)
        return NULL;
    int rc;
    ENTER_CORE(self);
    rc = gm_record_stream(self->heap, (uintptr_t)ptr, (gm_stream)stream);
    LEAVE_CORE(self);
    if (rc != GM_OK) {
        char what[64];
        snprintf(what, sizeof what, "record_stream(0x%" PRIx64 ")", ptr);
        return raise_code(self, rc, what);
    }
    Py_RETURN_NONE;
}

static PyObject *Heap_block_size(HeapObject *self, PyObject *ptr_o)
{
    if (ensure_open(self) < 0)
        return NULL;
    uint64_t ptr;
    if (to_u64(ptr_o, "ptr", UINTPTR_MAX, &ptr) < 0)
        return NULL;
    return PyLong_FromSize_t(gm_block_size(self->heap, (uintptr_t)ptr));
}

static PyObject *Heap_empty_cache(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    int rc;
    ENTER_CORE(self);
    rc = gm_empty_cache(self->heap);
    LEAVE_CORE(self);
    if (rc != GM_OK)
        return raise_code(self, rc, "empty_cache");
    Py_RETURN_NONE;
}

static PyObject *Heap_set_cap(HeapObject *self, PyObject *cap_o)
{
    if (ensure_open(self) < 0)
        return NULL;
    size_t cap;
    if (to_size_or_str(cap_o, "cap", &cap) < 0)
        return NULL;
    int rc;
    ENTER_CORE(self);
    rc = gm_set_cap(self->heap, cap);
    LEAVE_CORE(self);
    if (rc == GM_EINVAL && !self->dev->last_error[0]) {
        PyErr_Format(PyExc_ValueError, "set_cap: %zu bytes is not a valid cap (GM_EINVAL)", cap);
        return NULL;
    }
    if (rc != GM_OK)
        return raise_code(self, rc, "set_cap");
    Py_RETURN_NONE;
}

static PyObject *Heap_get_cap(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    return PyLong_FromSize_t(gm_get_cap(self->heap));
}

/* ---- statistics, checks, snapshots -------------------------------------------------- */

static PyObject *Heap_stats(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    gm_stats s;
    gm_get_stats(self->heap, &s);
    return gm_py_stats_dict(&s);
}

static PyObject *Heap_reset_peak_stats(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    gm_reset_peak_stats(self->heap);
    Py_RETURN_NONE;
}

static PyObject *Heap_reset_accumulated_stats(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    gm_reset_accumulated_stats(self->heap);
    Py_RETURN_NONE;
}

static PyObject *Heap_check(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    char why[512] = "";
    int rc;
    ENTER_CORE(self);
    rc = gm_check(self->heap, why, sizeof why);
    LEAVE_CORE(self);
    if (rc == GM_ECORRUPT) {
        PyErr_SetString(CorruptionError, why[0] ? why : "invariant broken (no reason given)");
        return NULL;
    }
    if (rc != GM_OK)
        return raise_code(self, rc, "check");
    Py_RETURN_NONE;
}

static PyObject *Heap_snapshot(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    gm_snapshot *snap = NULL;
    int rc = gm_snapshot_take(self->heap, &snap);
    if (rc != GM_OK)
        return rc == GM_ENOMEM ? PyErr_NoMemory() : raise_code(self, rc, "snapshot");
    PyObject *d = gm_py_snapshot_dict(snap, "unknown");
    gm_snapshot_free(snap);
    return d;
}

/* ---- history ---------------------------------------------------------------------- */

static PyObject *Heap_history_enable(HeapObject *self, PyObject *n_o)
{
    if (ensure_open(self) < 0)
        return NULL;
    size_t n;
    if (to_size(n_o, "max_entries", &n) < 0)
        return NULL;
    int rc = gm_history_enable(self->heap, n);
    if (rc == GM_ENOMEM)
        return PyErr_NoMemory();
    if (rc != GM_OK)
        return raise_code(self, rc, "history_enable");
    Py_RETURN_NONE;
}

static PyObject *Heap_history(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    return gm_py_history(self->heap, "unknown");
}

/* ---- out-of-memory reports ------------------------------------------------------------ */

/* mem_info() -> (free, total) of the whole device, taken under the heap's lock. */
static PyObject *Heap_mem_info(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    gm_oom_info info;
    gm_memory_report(self->heap, 0, &info);
    return Py_BuildValue("(KK)", (unsigned long long)info.device_free, (unsigned long long)info.device_total);
}

/* device_processes() -> [(pid, bytes)] holding memory on the device (this process
 * included), or None when there is no source (no NVML: GM_ENOTSUP). */
static PyObject *Heap_device_processes(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    if (self->is_sim && self->busy) {
        /* The sim device is guarded by the heap's lock only; see ensure_sim. */
        PyErr_SetString(PyExc_RuntimeError, "device_processes: another thread is inside this heap");
        return NULL;
    }
    size_t cap = 64, n = 0;
    for (;;) {
        gm_proc_usage *buf = PyMem_Calloc(cap, sizeof *buf);
        if (buf == NULL)
            return PyErr_NoMemory();
        int rc = self->dev->ops->processes(self->dev, buf, cap, &n);
        if (rc == GM_ENOTSUP) {
            PyMem_Free(buf);
            Py_RETURN_NONE;
        }
        if (rc != GM_OK) {
            PyMem_Free(buf);
            return raise_code(self, rc, "device_processes");
        }
        if (n > cap) {
            PyMem_Free(buf);
            cap = n;
            continue;
        }
        PyObject *l = PyList_New((Py_ssize_t)n);
        for (size_t i = 0; l != NULL && i < n; i++) {
            PyObject *t = Py_BuildValue("(kK)", (unsigned long)buf[i].pid, (unsigned long long)buf[i].bytes);
            if (t == NULL)
                Py_CLEAR(l);
            else
                PyList_SET_ITEM(l, (Py_ssize_t)i, t);
        }
        PyMem_Free(buf);
        return l;
    }
}

static PyObject *Heap_last_oom(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_open(self) < 0)
        return NULL;
    gm_oom_info info;
    if (gm_last_oom(self->heap, &info) != GM_OK)
        Py_RETURN_NONE;
    return gm_py_oom_dict(&info);
}

static PyObject *Heap_memory_report(HeapObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"size", NULL};
    PyObject *size_o = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|O:memory_report", kwlist, &size_o))
        return NULL;
    if (ensure_open(self) < 0)
        return NULL;
    size_t size = 0;
    if (size_o && to_size(size_o, "size", &size) < 0)
        return NULL;
    gm_oom_info info;
    gm_memory_report(self->heap, size, &info);
    return gm_py_oom_dict(&info);
}

/* ---- replay ---------------------------------------------------------------------------- */

/* replay(events, n_slots, timing=False, stop_at=-1, slots=None)
 * `slots`, when given, is a writable buffer of n_slots 8-byte words that the
 * caller keeps between calls, so that a trace can be replayed in chunks (for a
 * progress bar) with frees naming slots that an earlier chunk allocated. */
static PyObject *Heap_replay(HeapObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"events", "n_slots", "timing", "stop_at", "slots", NULL};
    Py_buffer ev = {0}, sl = {0};
    PyObject *n_slots_o, *slots_o = Py_None;
    int timing = 0;
    long long stop_at = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*O|pLO:replay", kwlist, &ev, &n_slots_o, &timing, &stop_at,
                                     &slots_o))
        return NULL;

    PyObject *result = NULL;
    gm_replay_event *copy = NULL;
    uintptr_t *own_slots = NULL;
    uint64_t *op_ns = NULL;
    size_t n_slots;

    if (ensure_open(self) < 0 || to_size(n_slots_o, "n_slots", &n_slots) < 0)
        goto done;
    if (ev.len % (Py_ssize_t)sizeof(gm_replay_event) != 0) {
        PyErr_Format(PyExc_ValueError, "events: %zd bytes is not a whole number of %zu-byte events", ev.len,
                     sizeof(gm_replay_event));
        goto done;
    }
    if (stop_at < -1) {
        PyErr_SetString(PyExc_ValueError, "stop_at must be -1 (no stop) or an event index");
        goto done;
    }
    size_t n = (size_t)ev.len / sizeof(gm_replay_event);
    const gm_replay_event *events = ev.buf;
    if ((uintptr_t)ev.buf % _Alignof(gm_replay_event) != 0) {
        copy = PyMem_Malloc(n ? (size_t)ev.len : 1);
        if (copy == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        memcpy(copy, ev.buf, (size_t)ev.len);
        events = copy;
    }
    /* The core trusts slot numbers; check them here so a bad trace is an
     * exception, not a write past the slot table. */
    for (size_t i = 0; i < n; i++) {
        if (events[i].op != GM_R_ALLOC && events[i].op != GM_R_FREE) {
            PyErr_Format(PyExc_ValueError, "events[%zu]: unknown op %u", i, (unsigned)events[i].op);
            goto done;
        }
        if (events[i].slot >= n_slots) {
            PyErr_Format(PyExc_ValueError, "events[%zu]: slot %u is not below n_slots=%zu", i,
                         (unsigned)events[i].slot, n_slots);
            goto done;
        }
    }

    uintptr_t *slots;
    if (slots_o != Py_None) {
        if (PyObject_GetBuffer(slots_o, &sl, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        if ((size_t)sl.len != n_slots * sizeof(uintptr_t) || (uintptr_t)sl.buf % _Alignof(uintptr_t) != 0) {
            PyErr_Format(PyExc_ValueError, "slots must be an aligned writable buffer of n_slots*%zu = %zu bytes",
                         sizeof(uintptr_t), n_slots * sizeof(uintptr_t));
            goto done;
        }
        slots = sl.buf;
    } else {
        own_slots = PyMem_Calloc(n_slots ? n_slots : 1, sizeof *own_slots);
        if (own_slots == NULL) {
            PyErr_NoMemory();
            goto done;
        }
        slots = own_slots;
    }
    if (timing) {
        op_ns = PyMem_Malloc((n ? n : 1) * sizeof *op_ns);
        if (op_ns == NULL) {
            PyErr_NoMemory();
            goto done;
        }
    }

    gm_replay_result res;
    memset(&res, 0, sizeof res);
    int rc;
    uint64_t stop = stop_at < 0 ? UINT64_MAX : (uint64_t)stop_at;
    ENTER_CORE(self);
    rc = gm_replay(self->heap, events, n, slots, op_ns, stop, &res);
    LEAVE_CORE(self);
    if (rc != GM_OK && rc != res.error) {
        raise_code(self, rc, "replay");
        goto done;
    }

    result = PyDict_New();
    if (result == NULL)
        goto done;
    if (gm_py_put_u64(result, "allocs", res.allocs) < 0 || gm_py_put_u64(result, "frees", res.frees) < 0 ||
        gm_py_put_u64(result, "ooms", res.ooms) < 0 || gm_py_put_u64(result, "peak_live_bytes", res.peak_live_bytes) < 0 ||
        gm_py_put_u64(result, "peak_reserved_bytes", res.peak_reserved_bytes) < 0 ||
        gm_py_put_i64(result, "first_oom_event", res.first_oom_event == UINT64_MAX ? -1 : (int64_t)res.first_oom_event) < 0 ||
        gm_py_put_u64(result, "peak_event", res.peak_event) < 0 || gm_py_put_i64(result, "error", res.error) < 0 ||
        gm_py_put(result, "error_name", PyUnicode_FromString(code_name(res.error))) < 0) {
        Py_CLEAR(result);
        goto done;
    }
    if (timing) {
        PyObject *array_mod = PyImport_ImportModule("array");
        PyObject *arr = NULL;
        if (array_mod != NULL) {
            PyObject *raw = PyBytes_FromStringAndSize((const char *)op_ns, (Py_ssize_t)(n * sizeof *op_ns));
            if (raw != NULL)
                arr = PyObject_CallMethod(array_mod, "array", "sO", "Q", raw);
            Py_XDECREF(raw);
            Py_DECREF(array_mod);
        }
        if (gm_py_put(result, "op_ns", arr) < 0)
            Py_CLEAR(result);
    }
done:
    if (sl.obj)
        PyBuffer_Release(&sl);
    PyBuffer_Release(&ev);
    PyMem_Free(copy);
    PyMem_Free(own_slots);
    PyMem_Free(op_ns);
    return result;
}

/* ---- sim-only controls ------------------------------------------------------------------ */

static PyObject *Heap_sim_fail(HeapObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"op", "nth", "count", NULL};
    PyObject *op_o, *nth_o = NULL, *count_o = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|OO:sim_fail", kwlist, &op_o, &nth_o, &count_o))
        return NULL;
    gm_dev_op op;
    uint64_t nth = 1, count = 1;
    if (ensure_sim(self, 1) < 0 || op_from_name(op_o, &op) < 0)
        return NULL;
    if ((nth_o && to_u64(nth_o, "nth", UINT64_MAX, &nth) < 0) ||
        (count_o && to_u64(count_o, "count", UINT64_MAX, &count) < 0))
        return NULL;
    gm_sim_fail(self->dev, op, nth, count);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_fail_random(HeapObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"op", "p", "seed", NULL};
    PyObject *op_o, *seed_o = NULL;
    double p;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Od|O:sim_fail_random", kwlist, &op_o, &p, &seed_o))
        return NULL;
    gm_dev_op op;
    uint64_t seed = 0;
    if (ensure_sim(self, 1) < 0 || op_from_name(op_o, &op) < 0)
        return NULL;
    if (!(p >= 0.0 && p <= 1.0)) {
        char msg[64];
        snprintf(msg, sizeof msg, "p must lie in [0, 1], got %g", p);
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    if (seed_o && to_u64(seed_o, "seed", UINT64_MAX, &seed) < 0)
        return NULL;
    gm_sim_fail_random(self->dev, op, p, seed);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_calls(HeapObject *self, PyObject *op_o)
{
    gm_dev_op op;
    if (ensure_sim(self, 0) < 0 || op_from_name(op_o, &op) < 0)
        return NULL;
    return PyLong_FromUnsignedLongLong(gm_sim_calls(self->dev, op));
}

/* Test-only: GPUMEM_CUDA_FAULTS bookkeeping of a CUDA heap. */
static PyObject *Heap_cuda_fault_calls(HeapObject *self, PyObject *op_o)
{
    gm_dev_op op;
    if (ensure_open(self) < 0 || op_from_name(op_o, &op) < 0)
        return NULL;
    if (strcmp(self->dev->kind, "cuda")) {
        PyErr_Format(PyExc_TypeError, "this call needs a cuda heap, not a %s one", self->dev->kind);
        return NULL;
    }
    uint64_t fired = 0, calls = gm_cuda_fault_calls(self->dev, op, &fired);
    return Py_BuildValue("(KK)", (unsigned long long)calls, (unsigned long long)fired);
}

static PyObject *Heap_sim_hold_stream(HeapObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"stream", "held", NULL};
    PyObject *stream_o;
    int held = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|p:sim_hold_stream", kwlist, &stream_o, &held))
        return NULL;
    uint64_t stream;
    if (ensure_sim(self, 1) < 0 || to_u64(stream_o, "stream", UINT64_MAX, &stream) < 0)
        return NULL;
    gm_sim_hold_stream(self->dev, (gm_stream)stream, held);
    Py_RETURN_NONE;
}

static PyObject *sim_set_bytes(HeapObject *self, PyObject *args, int external)
{
    PyObject *pid_o, *bytes_o;
    if (!PyArg_ParseTuple(args, external ? "OO:sim_set_external" : "OO:sim_set_self", &pid_o, &bytes_o))
        return NULL;
    uint64_t pid, bytes;
    if (ensure_sim(self, 1) < 0)
        return NULL;
    if (to_u64(pid_o, "pid", UINT32_MAX, &pid) < 0 || to_u64(bytes_o, "bytes", UINT64_MAX, &bytes) < 0)
        return NULL;
    if (external)
        gm_sim_set_external(self->dev, (uint32_t)pid, bytes);
    else
        gm_sim_set_self(self->dev, (uint32_t)pid, bytes);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_set_external(HeapObject *self, PyObject *args)
{
    return sim_set_bytes(self, args, 1);
}

static PyObject *Heap_sim_set_self(HeapObject *self, PyObject *args)
{
    return sim_set_bytes(self, args, 0);
}

static PyObject *Heap_sim_set_nvml(HeapObject *self, PyObject *avail_o)
{
    if (ensure_sim(self, 1) < 0)
        return NULL;
    int avail = PyObject_IsTrue(avail_o);
    if (avail < 0)
        return NULL;
    gm_sim_set_nvml(self->dev, avail);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_info(HeapObject *self, PyObject *Py_UNUSED(ignored))
{
    if (ensure_sim(self, 0) < 0)
        return NULL;
    gm_sim_info info;
    gm_sim_info_get(self->dev, &info);
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n}", "capacity", (Py_ssize_t)info.capacity, "page_size",
                         (Py_ssize_t)info.page_size, "pages_created", (Py_ssize_t)info.pages_created,
                         "pages_mapped", (Py_ssize_t)info.pages_mapped, "events_alive",
                         (Py_ssize_t)info.events_alive, "reservations", (Py_ssize_t)info.reservations);
}

static PyObject *Heap_sim_is_accessible(HeapObject *self, PyObject *args)
{
    PyObject *addr_o, *size_o;
    if (!PyArg_ParseTuple(args, "OO:sim_is_accessible", &addr_o, &size_o))
        return NULL;
    uint64_t addr;
    size_t size;
    if (ensure_sim(self, 0) < 0 || to_u64(addr_o, "addr", UINTPTR_MAX, &addr) < 0 ||
        to_size(size_o, "size", &size) < 0)
        return NULL;
    return PyBool_FromLong(gm_sim_is_accessible(self->dev, (uintptr_t)addr, size));
}

/* ---- properties ------------------------------------------------------------------------- */

static PyObject *Heap_get_device_kind(HeapObject *self, void *Py_UNUSED(closure))
{
    if (ensure_open(self) < 0)
        return NULL;
    return PyUnicode_FromString(self->dev->kind);
}

static PyObject *Heap_get_device_name(HeapObject *self, void *Py_UNUSED(closure))
{
    if (ensure_open(self) < 0)
        return NULL;
    return PyUnicode_FromString(self->dev->name);
}

static PyObject *Heap_get_page_size(HeapObject *self, void *Py_UNUSED(closure))
{
    if (ensure_open(self) < 0)
        return NULL;
    return PyLong_FromSize_t(self->dev->page_size);
}

static PyObject *Heap_get_closed(HeapObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->heap == NULL);
}

/* ---- type and module tables ------------------------------------------------------------- */

#define KW(fn) (PyCFunction)(void (*)(void))(fn)

static PyMethodDef Heap_methods[] = {
    {.ml_name = "malloc", .ml_meth = KW(Heap_malloc), .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "malloc(size, stream=0, context=0) -> address"},
    {.ml_name = "free", .ml_meth = (PyCFunction)Heap_free, .ml_flags = METH_O, .ml_doc = "free(ptr)"},
    {.ml_name = "record_stream", .ml_meth = (PyCFunction)Heap_record_stream, .ml_flags = METH_VARARGS,
     .ml_doc = "record_stream(ptr, stream): ptr is in use on stream too"},
    {.ml_name = "block_size", .ml_meth = (PyCFunction)Heap_block_size, .ml_flags = METH_O,
     .ml_doc = "block_size(ptr) -> bytes of the live block at ptr, 0 if not live"},
    {.ml_name = "empty_cache", .ml_meth = (PyCFunction)Heap_empty_cache, .ml_flags = METH_NOARGS,
     .ml_doc = "release every physical page that backs no live block"},
    {.ml_name = "set_cap", .ml_meth = (PyCFunction)Heap_set_cap, .ml_flags = METH_O,
     .ml_doc = "set_cap(bytes): cap physical memory (0 = the device)"},
    {.ml_name = "get_cap", .ml_meth = (PyCFunction)Heap_get_cap, .ml_flags = METH_NOARGS,
     .ml_doc = "get_cap() -> bytes (0 = no cap)"},
    {.ml_name = "stats", .ml_meth = (PyCFunction)Heap_stats, .ml_flags = METH_NOARGS,
     .ml_doc = "stats() -> dict with torch.cuda.memory_stats key names"},
    {.ml_name = "reset_peak_stats", .ml_meth = (PyCFunction)Heap_reset_peak_stats, .ml_flags = METH_NOARGS,
     .ml_doc = "set every peak to its current value"},
    {.ml_name = "reset_accumulated_stats", .ml_meth = (PyCFunction)Heap_reset_accumulated_stats,
     .ml_flags = METH_NOARGS, .ml_doc = "zero the allocated/freed and event counters"},
    {.ml_name = "check", .ml_meth = (PyCFunction)Heap_check, .ml_flags = METH_NOARGS,
     .ml_doc = "check(): raise CorruptionError if an invariant is broken"},
    {.ml_name = "snapshot", .ml_meth = (PyCFunction)Heap_snapshot, .ml_flags = METH_NOARGS,
     .ml_doc = "snapshot() -> dict of blocks, pages and stats"},
    {.ml_name = "history_enable", .ml_meth = (PyCFunction)Heap_history_enable, .ml_flags = METH_O,
     .ml_doc = "history_enable(max_entries): keep the last max_entries events (0 = off)"},
    {.ml_name = "history", .ml_meth = (PyCFunction)Heap_history, .ml_flags = METH_NOARGS,
     .ml_doc = "history() -> ([(time_ns, action, addr, size, stream, context)], dropped)"},
    {.ml_name = "mem_info", .ml_meth = (PyCFunction)Heap_mem_info, .ml_flags = METH_NOARGS,
     .ml_doc = "mem_info() -> (free, total) bytes of the whole device"},
    {.ml_name = "device_processes", .ml_meth = (PyCFunction)Heap_device_processes, .ml_flags = METH_NOARGS,
     .ml_doc = "device_processes() -> [(pid, bytes)] on the device, or None without NVML"},
    {.ml_name = "last_oom", .ml_meth = (PyCFunction)Heap_last_oom, .ml_flags = METH_NOARGS,
     .ml_doc = "last_oom() -> report of the last failed allocation, or None"},
    {.ml_name = "memory_report", .ml_meth = KW(Heap_memory_report), .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "memory_report(size=0) -> the OOM report for a request of size bytes now"},
    {.ml_name = "replay", .ml_meth = KW(Heap_replay), .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "replay(events, n_slots, timing=False, stop_at=-1, slots=None) -> dict\n"
               "events: packed struct '<IIQQ' (op, slot, size, stream); slots: optional writable\n"
               "buffer of n_slots 8-byte words kept by the caller across chunked calls."},
    {.ml_name = "sim_fail", .ml_meth = KW(Heap_sim_fail), .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "sim_fail(op, nth=1, count=1): make device calls fail"},
    {.ml_name = "sim_fail_random", .ml_meth = KW(Heap_sim_fail_random), .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "sim_fail_random(op, p, seed=0)"},
    {.ml_name = "sim_calls", .ml_meth = (PyCFunction)Heap_sim_calls, .ml_flags = METH_O,
     .ml_doc = "sim_calls(op) -> calls of op so far"},
    {.ml_name = "cuda_fault_calls", .ml_meth = (PyCFunction)Heap_cuda_fault_calls, .ml_flags = METH_O,
     .ml_doc = "cuda_fault_calls(op) -> (calls, failed by GPUMEM_CUDA_FAULTS); test-only, CUDA heaps"},
    {.ml_name = "sim_hold_stream", .ml_meth = KW(Heap_sim_hold_stream), .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "sim_hold_stream(stream, held=True)"},
    {.ml_name = "sim_set_external", .ml_meth = (PyCFunction)Heap_sim_set_external, .ml_flags = METH_VARARGS,
     .ml_doc = "sim_set_external(pid, bytes): memory held by another process"},
    {.ml_name = "sim_set_self", .ml_meth = (PyCFunction)Heap_sim_set_self, .ml_flags = METH_VARARGS,
     .ml_doc = "sim_set_self(pid, bytes): this process's memory outside the allocator"},
    {.ml_name = "sim_set_nvml", .ml_meth = (PyCFunction)Heap_sim_set_nvml, .ml_flags = METH_O,
     .ml_doc = "sim_set_nvml(available)"},
    {.ml_name = "sim_info", .ml_meth = (PyCFunction)Heap_sim_info, .ml_flags = METH_NOARGS,
     .ml_doc = "sim_info() -> dict"},
    {.ml_name = "sim_is_accessible", .ml_meth = (PyCFunction)Heap_sim_is_accessible, .ml_flags = METH_VARARGS,
     .ml_doc = "sim_is_accessible(addr, size) -> bool"},
    {.ml_name = "close", .ml_meth = (PyCFunction)Heap_close, .ml_flags = METH_NOARGS,
     .ml_doc = "destroy the heap and its device; later calls raise ValueError"},
    {.ml_name = "__enter__", .ml_meth = (PyCFunction)Heap_enter, .ml_flags = METH_NOARGS},
    {.ml_name = "__exit__", .ml_meth = (PyCFunction)Heap_exit, .ml_flags = METH_VARARGS},
    {.ml_name = NULL},
};

static PyGetSetDef Heap_getset[] = {
    {.name = "device_kind", .get = (getter)Heap_get_device_kind, .doc = "\"sim\" or \"cuda\""},
    {.name = "device_name", .get = (getter)Heap_get_device_name, .doc = "e.g. \"sim:80GiB\""},
    {.name = "page_size", .get = (getter)Heap_get_page_size, .doc = "physical page size in bytes"},
    {.name = "closed", .get = (getter)Heap_get_closed, .doc = "True once close() was called"},
    {.name = NULL},
};

static PyTypeObject HeapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gpumem.Heap",
    .tp_basicsize = sizeof(HeapObject),
    .tp_itemsize = 0,
    .tp_dealloc = (destructor)Heap_dealloc,
    .tp_repr = (reprfunc)Heap_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Heap(device=\"sim\", capacity=80 GiB, page_size=0, ordinal=0, va_size=0, cap=0,\n"
              "     growth_slack=None, growth_slack_pages=None)\n\n"
              "A gpumem heap over one device: a simulated one (\"sim\") or a CUDA GPU (\"cuda\").",
    .tp_methods = Heap_methods,
    .tp_getset = Heap_getset,
    .tp_init = (initproc)Heap_init,
    .tp_new = Heap_new,
};

static PyObject *mod_strerror(PyObject *Py_UNUSED(mod), PyObject *code_o)
{
    int code = (int)PyLong_AsLong(code_o);
    if (code == -1 && PyErr_Occurred())
        return NULL;
    return PyUnicode_FromString(gm_strerror(code));
}

static PyObject *mod_format_bytes(PyObject *Py_UNUSED(mod), PyObject *n_o)
{
    uint64_t n;
    if (to_u64(n_o, "n", UINT64_MAX, &n) < 0)
        return NULL;
    char buf[32];
    gm_fmt_bytes(buf, sizeof buf, n);
    return PyUnicode_FromString(buf);
}

static PyMethodDef module_methods[] = {
    {.ml_name = "strerror", .ml_meth = (PyCFunction)mod_strerror, .ml_flags = METH_O,
     .ml_doc = "strerror(code) -> the core's text for a GM_E* code"},
    {.ml_name = "format_bytes", .ml_meth = (PyCFunction)mod_format_bytes, .ml_flags = METH_O,
     .ml_doc = "format_bytes(n) -> the size formatting used in error messages"},
    {.ml_name = NULL},
};

int gm_torch_glue_add(PyObject *module); /* torch_glue.c */
int gm_torch_viz_add(PyObject *module);  /* torch_viz.c */

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gpumem._C",
    .m_doc = "gpumem's C core: the Heap type and its exceptions.",
    .m_size = -1,
    .m_methods = module_methods,
};

static int add_exception(PyObject *m, PyObject **slot, const char *name, PyObject *base, const char *doc)
{
    char full[64];
    snprintf(full, sizeof full, "gpumem.%s", name);
    *slot = PyErr_NewExceptionWithDoc(full, doc, base, NULL);
    if (*slot == NULL)
        return -1;
    Py_INCREF(*slot);
    if (PyModule_AddObject(m, name, *slot) < 0) {
        Py_DECREF(*slot);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__C(void)
{
    if (PyType_Ready(&HeapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module_def);
    if (m == NULL)
        return NULL;
    if (add_exception(m, &OutOfMemoryError, "OutOfMemoryError", PyExc_RuntimeError,
                      "An allocation failed even after releasing the cache and defragmenting.") < 0 ||
        add_exception(m, &InvalidPointerError, "InvalidPointerError", PyExc_ValueError,
                      "free/record_stream of a pointer that is not live in this heap.") < 0 ||
        add_exception(m, &CorruptionError, "CorruptionError", PyExc_RuntimeError,
                      "The invariant checker found a broken invariant.") < 0 ||
        add_exception(m, &DeviceError, "DeviceError", PyExc_RuntimeError,
                      "A device call failed, or no CUDA driver could be loaded.") < 0)
        goto fail;
    Py_INCREF(&HeapType);
    if (PyModule_AddObject(m, "Heap", (PyObject *)&HeapType) < 0) {
        Py_DECREF(&HeapType);
        goto fail;
    }
    if (gm_history_glue_add(m) < 0)
        goto fail;
    if (PyModule_AddIntConstant(m, "EVENT_SIZE", (long)sizeof(gm_replay_event)) < 0 ||
        PyModule_AddIntConstant(m, "R_ALLOC", GM_R_ALLOC) < 0 || PyModule_AddIntConstant(m, "R_FREE", GM_R_FREE) < 0)
        goto fail;
    if (gm_torch_glue_add(m) < 0) /* _torch_* functions for gpumem.torch (torch_glue.c) */
        goto fail;
    if (gm_torch_viz_add(m) < 0) /* explain/stacks hooks for the torch path (torch_viz.c) */
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
