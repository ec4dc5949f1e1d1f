/*
 * sim_glue.c -- Heap.sim_*: fault injection and introspection of the simulated device
 * (gpumem/sim.h), each a TypeError on a CUDA heap; and Heap.cuda_fault_calls, the
 * CUDA device's test-only fault injection (GPUMEM_CUDA_FAULTS), a TypeError on a
 * sim heap.
 *
 * The sim device is guarded by the heap's lock only, so every call here waits
 * until no other thread is inside the heap (GM_PY_SIM: a RuntimeError meanwhile),
 * and checks that after converting its arguments (heap_object.h's rule).
 */
#include "heap_object.h"

#include <stdio.h>
#include <string.h>

#include "gpumem/cuda.h"
#include "gpumem/sim.h"

#include "convert.h"

static int op_from_name(PyObject *name, gm_dev_op *out) {
    if (!PyUnicode_Check(name)) {
        PyErr_Format(PyExc_TypeError, "op must be a str, not %.100s", Py_TYPE(name)->tp_name);
        return -1;
    }
    const char *s = PyUnicode_AsUTF8(name);
    if (s == NULL) return -1;
    for (int i = 0; i < GM_OP__COUNT; i++) {
        if (strcmp(s, gm_dev_op_name((gm_dev_op)i)) == 0) {
            *out = (gm_dev_op)i;
            return 0;
        }
    }
    char known[256] = "";
    for (int i = 0; i < GM_OP__COUNT; i++) {
        size_t used = strlen(known);
        snprintf(known + used, sizeof known - used, "%s%s", i ? ", " : "", gm_dev_op_name((gm_dev_op)i));
    }
    PyErr_Format(PyExc_ValueError, "unknown device op %R (expected one of %s)", name, known);
    return -1;
}

static int op_arg(PyObject *name, void *out) { return op_from_name(name, out) == 0; }

/* gpumem._C.DEVICE_OPS: the device calls' names, in gm_dev_op order. */
int gm_py_add_device_ops(PyObject *m) {
    const char *names[GM_OP__COUNT];
    for (int i = 0; i < GM_OP__COUNT; i++) names[i] = gm_dev_op_name((gm_dev_op)i);
    return gm_py_add_str_tuple(m, "DEVICE_OPS", names, GM_OP__COUNT);
}

static PyObject *Heap_sim_fail(HeapObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"op", "nth", "count", NULL};
    gm_dev_op op;
    uint64_t nth = 1, count = 1;
    if (gm_py_args(self, GM_PY_SIM, args, kwds, "O&|O&O&:sim_fail", kwlist, op_arg, &op, gm_py_nth_arg, &nth,
                   gm_py_count_arg, &count) < 0)
        return NULL;
    gm_sim_fail(self->dev, op, nth, count);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_fail_random(HeapObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"op", "p", "seed", NULL};
    double p;
    gm_dev_op op;
    uint64_t seed = 0;
    if (gm_py_args(self, GM_PY_SIM, args, kwds, "O&d|O&:sim_fail_random", kwlist, op_arg, &op, &p, gm_py_seed_arg,
                   &seed) < 0)
        return NULL;
    if (!(p >= 0.0 && p <= 1.0)) {
        char msg[64];
        snprintf(msg, sizeof msg, "p must lie in [0, 1], got %g", p);
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    gm_sim_fail_random(self->dev, op, p, seed);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_calls(HeapObject *self, PyObject *op_o) {
    gm_dev_op op;
    if (gm_py_arg(self, GM_PY_SIM, op_o, op_arg, &op) < 0) return NULL;
    unsigned long long calls = gm_sim_calls(self->dev, op);
    return PyLong_FromUnsignedLongLong(calls);
}

static PyObject *Heap_sim_hold_stream(HeapObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"stream", "held", NULL};
    int held = 1;
    uint64_t stream;
    if (gm_py_args(self, GM_PY_SIM, args, kwds, "O&|p:sim_hold_stream", kwlist, gm_py_stream_arg, &stream, &held) < 0)
        return NULL;
    gm_sim_hold_stream(self->dev, (gm_stream)stream, held);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_stream_busy(HeapObject *self, PyObject *stream_o) {
    uint64_t stream;
    if (gm_py_arg(self, GM_PY_SIM, stream_o, gm_py_stream_arg, &stream) < 0) return NULL;
    return PyBool_FromLong(gm_sim_stream_busy(self->dev, (gm_stream)stream));
}

static PyObject *Heap_sim_stream_waits_for(HeapObject *self, PyObject *args) {
    uint64_t stream, held;
    if (gm_py_args(self, GM_PY_SIM, args, NULL, "O&O&:sim_stream_waits_for", NULL, gm_py_stream_arg, &stream,
                   gm_py_stream_arg, &held) < 0)
        return NULL;
    return PyBool_FromLong(gm_sim_stream_waits_for(self->dev, (gm_stream)stream, (gm_stream)held));
}

static PyObject *Heap_sim_set_event_delay(HeapObject *self, PyObject *ops_o) {
    uint64_t ops;
    if (gm_py_arg(self, GM_PY_SIM, ops_o, gm_py_ops_arg, &ops) < 0) return NULL;
    gm_sim_set_event_delay(self->dev, ops);
    Py_RETURN_NONE;
}

static PyObject *sim_set_bytes(HeapObject *self, PyObject *args, int external) {
    uint64_t pid, bytes;
    if (gm_py_args(self, GM_PY_SIM, args, NULL, external ? "O&O&:sim_set_external" : "O&O&:sim_set_self", NULL,
                   gm_py_pid_arg, &pid, gm_py_bytes_arg, &bytes) < 0)
        return NULL;
    if (external)
        gm_sim_set_external(self->dev, (uint32_t)pid, bytes);
    else
        gm_sim_set_self(self->dev, (uint32_t)pid, bytes);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_set_external(HeapObject *self, PyObject *args) { return sim_set_bytes(self, args, 1); }

static PyObject *Heap_sim_set_self(HeapObject *self, PyObject *args) { return sim_set_bytes(self, args, 0); }

static PyObject *Heap_sim_set_nvml(HeapObject *self, PyObject *avail_o) {
    int avail;
    if (gm_py_arg(self, GM_PY_SIM, avail_o, gm_py_bool_arg, &avail) < 0) return NULL;
    gm_sim_set_nvml(self->dev, avail);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_info(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_SIM) < 0) return NULL;
    gm_sim_info info;
    gm_sim_info_get(self->dev, &info);
    return Py_BuildValue("{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n}", "capacity", (Py_ssize_t)info.capacity, "page_size",
                         (Py_ssize_t)info.page_size, "pages_created", (Py_ssize_t)info.pages_created, "pages_mapped",
                         (Py_ssize_t)info.pages_mapped, "events_alive", (Py_ssize_t)info.events_alive, "reservations",
                         (Py_ssize_t)info.reservations, "host_pages", (Py_ssize_t)info.host_pages, "host_mapped",
                         (Py_ssize_t)info.host_mapped);
}

static PyObject *Heap_sim_is_accessible(HeapObject *self, PyObject *args) {
    uint64_t addr;
    size_t size;
    if (gm_py_args(self, GM_PY_SIM, args, NULL, "O&O&:sim_is_accessible", NULL, gm_py_addr_arg, &addr, gm_py_size_arg,
                   &size) < 0)
        return NULL;
    int ok = gm_sim_is_accessible(self->dev, (uintptr_t)addr, size);
    return PyBool_FromLong(ok);
}

static PyObject *Heap_sim_set_capture(HeapObject *self, PyObject *on_o) {
    int on;
    if (gm_py_arg(self, GM_PY_SIM, on_o, gm_py_bool_arg, &on) < 0) return NULL;
    gm_sim_set_capture(self->dev, on);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_set_stream_capture(HeapObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"stream", "on", NULL};
    int on = 1;
    uint64_t stream;
    if (gm_py_args(self, GM_PY_SIM, args, kwds, "O&|p:sim_set_stream_capture", kwlist, gm_py_stream_arg, &stream, &on) <
        0)
        return NULL;
    gm_sim_set_stream_capture(self->dev, (gm_stream)stream, on);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_page_at(HeapObject *self, PyObject *addr_o) {
    uint64_t addr;
    if (gm_py_arg(self, GM_PY_SIM, addr_o, gm_py_addr_arg, &addr) < 0) return NULL;
    unsigned long long handle = (unsigned long long)gm_sim_handle_at(self->dev, (uintptr_t)addr);
    return PyLong_FromUnsignedLongLong(handle);
}

/* Ask the device itself to unmap [addr, addr+size): to test what it refuses
 * (a range that cuts a mapping).  One that succeeds leaves the heap's books
 * wrong: only for a heap that is thrown away. */
static PyObject *Heap_sim_unmap(HeapObject *self, PyObject *args) {
    uint64_t addr;
    size_t size;
    if (gm_py_args(self, GM_PY_SIM, args, NULL, "O&O&:sim_unmap", NULL, gm_py_addr_arg, &addr, gm_py_size_arg, &size) <
        0)
        return NULL;
    int rc = self->dev->ops->unmap(self->dev, (uintptr_t)addr, size);
    if (rc != GM_OK) return PyErr_Format(PyExc_ValueError, "sim_unmap: %s", self->dev->last_error);
    Py_RETURN_NONE;
}

/* The simulated device's contents: one value per physical page. */
static PyObject *Heap_sim_write(HeapObject *self, PyObject *args) {
    uint64_t addr, value;
    if (gm_py_args(self, GM_PY_SIM, args, NULL, "O&O&:sim_write", NULL, gm_py_addr_arg, &addr, gm_py_value_arg,
                   &value) < 0)
        return NULL;
    if (gm_sim_write(self->dev, (uintptr_t)addr, value) != GM_OK)
        return PyErr_Format(PyExc_ValueError, "sim_write: illegal address %p (no accessible page there)",
                            (void *)(uintptr_t)addr);
    Py_RETURN_NONE;
}

static PyObject *Heap_sim_read(HeapObject *self, PyObject *addr_o) {
    uint64_t addr, value = 0;
    if (gm_py_arg(self, GM_PY_SIM, addr_o, gm_py_addr_arg, &addr) < 0) return NULL;
    if (gm_sim_read(self->dev, (uintptr_t)addr, &value) != GM_OK)
        return PyErr_Format(PyExc_ValueError, "sim_read: illegal address %p (no accessible page there)",
                            (void *)(uintptr_t)addr);
    return PyLong_FromUnsignedLongLong((unsigned long long)value);
}

static PyObject *Heap_sim_host_blocks(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_SIM) < 0) return NULL;
    size_t n = gm_sim_host_blocks(self->dev);
    return PyLong_FromSize_t(n);
}

static PyObject *Heap_sim_capture_violations(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_SIM) < 0) return NULL;
    unsigned long long n = gm_sim_capture_violations(self->dev);
    return PyLong_FromUnsignedLongLong(n);
}

/* Test-only: GPUMEM_CUDA_FAULTS bookkeeping of a CUDA heap. */
static PyObject *Heap_cuda_fault_calls(HeapObject *self, PyObject *op_o) {
    gm_dev_op op;
    if (gm_py_arg(self, GM_PY_OPEN, op_o, op_arg, &op) < 0) return NULL;
    if (strcmp(self->dev->kind, "cuda")) {
        PyErr_Format(PyExc_TypeError, "this call needs a cuda heap, not a %s one", self->dev->kind);
        return NULL;
    }
    uint64_t fired = 0, calls = gm_cuda_fault_calls(self->dev, op, &fired);
    return Py_BuildValue("(KK)", (unsigned long long)calls, (unsigned long long)fired);
}

PyMethodDef gm_py_sim_methods[] = {
    {.ml_name = "sim_unmap",
     .ml_meth = (PyCFunction)Heap_sim_unmap,
     .ml_flags = METH_VARARGS,
     .ml_doc = "sim_unmap(addr, size): the device unmaps [addr, addr+size) itself (ValueError with its reason if it\n"
               "refuses); for tests of its refusals only -- one that succeeds leaves the heap's books wrong"},
    {.ml_name = "sim_fail",
     .ml_meth = KW(Heap_sim_fail),
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "sim_fail(op, nth=1, count=1): make device calls fail"},
    {.ml_name = "sim_fail_random",
     .ml_meth = KW(Heap_sim_fail_random),
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "sim_fail_random(op, p, seed=0)"},
    {.ml_name = "sim_calls",
     .ml_meth = (PyCFunction)Heap_sim_calls,
     .ml_flags = METH_O,
     .ml_doc = "sim_calls(op) -> calls of op so far"},
    {.ml_name = "sim_hold_stream",
     .ml_meth = KW(Heap_sim_hold_stream),
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "sim_hold_stream(stream, held=True)"},
    {.ml_name = "sim_stream_busy",
     .ml_meth = (PyCFunction)Heap_sim_stream_busy,
     .ml_flags = METH_O,
     .ml_doc = "sim_stream_busy(stream): True if work issued to the stream now would wait: it is held, or it\n"
               "was made to wait on the device for work that has not finished"},
    {.ml_name = "sim_stream_waits_for",
     .ml_meth = (PyCFunction)Heap_sim_stream_waits_for,
     .ml_flags = METH_VARARGS,
     .ml_doc = "sim_stream_waits_for(stream, held): True if `held` is held and work issued to `stream` now\n"
               "waits on the device for the work `held` queued under this hold"},
    {.ml_name = "sim_set_event_delay",
     .ml_meth = (PyCFunction)Heap_sim_set_event_delay,
     .ml_flags = METH_O,
     .ml_doc = "sim_set_event_delay(ops): an event recorded on a stream other than 0 completes only after ops\n"
               "further device operations (a query does not count itself) or at a synchronize; 0 = at once"},
    {.ml_name = "sim_set_external",
     .ml_meth = (PyCFunction)Heap_sim_set_external,
     .ml_flags = METH_VARARGS,
     .ml_doc = "sim_set_external(pid, bytes): memory held by another process"},
    {.ml_name = "sim_set_self",
     .ml_meth = (PyCFunction)Heap_sim_set_self,
     .ml_flags = METH_VARARGS,
     .ml_doc = "sim_set_self(pid, bytes): this process's memory outside the allocator"},
    {.ml_name = "sim_set_nvml",
     .ml_meth = (PyCFunction)Heap_sim_set_nvml,
     .ml_flags = METH_O,
     .ml_doc = "sim_set_nvml(available)"},
    {.ml_name = "sim_info",
     .ml_meth = (PyCFunction)Heap_sim_info,
     .ml_flags = METH_NOARGS,
     .ml_doc = "sim_info() -> dict"},
    {.ml_name = "sim_is_accessible",
     .ml_meth = (PyCFunction)Heap_sim_is_accessible,
     .ml_flags = METH_VARARGS,
     .ml_doc = "sim_is_accessible(addr, size) -> bool"},
    {.ml_name = "sim_set_capture",
     .ml_meth = (PyCFunction)Heap_sim_set_capture,
     .ml_flags = METH_O,
     .ml_doc = "sim_set_capture(on): the device refuses and counts calls a capture forbids"},
    {.ml_name = "sim_set_stream_capture",
     .ml_meth = KW(Heap_sim_set_stream_capture),
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "sim_set_stream_capture(stream, on=True): the device reports stream as capturing"},
    {.ml_name = "sim_capture_violations",
     .ml_meth = (PyCFunction)Heap_sim_capture_violations,
     .ml_flags = METH_NOARGS,
     .ml_doc = "sim_capture_violations() -> calls refused by capture mode"},
    {.ml_name = "sim_page_at",
     .ml_meth = (PyCFunction)Heap_sim_page_at,
     .ml_flags = METH_O,
     .ml_doc = "sim_page_at(addr) -> id of the physical page mapped there (0: none)"},
    {.ml_name = "sim_write",
     .ml_meth = (PyCFunction)Heap_sim_write,
     .ml_flags = METH_VARARGS,
     .ml_doc = "sim_write(addr, value): the page mapped at addr now holds value (ValueError: illegal address)"},
    {.ml_name = "sim_read",
     .ml_meth = (PyCFunction)Heap_sim_read,
     .ml_flags = METH_O,
     .ml_doc = "sim_read(addr) -> the value the page mapped at addr holds; a fresh page's has 0xF4E5 in its top "
               "16 bits (ValueError: illegal address)"},
    {.ml_name = "sim_host_blocks",
     .ml_meth = (PyCFunction)Heap_sim_host_blocks,
     .ml_flags = METH_NOARGS,
     .ml_doc = "sim_host_blocks() -> pinned host blocks allocated and not freed"},
    {.ml_name = "cuda_fault_calls",
     .ml_meth = (PyCFunction)Heap_cuda_fault_calls,
     .ml_flags = METH_O,
     .ml_doc = "cuda_fault_calls(op) -> (calls, failed by GPUMEM_CUDA_FAULTS); test-only, CUDA heaps opened "
               "with GPUMEM_CUDA_FAULTS set (else (0, 0))"},
    {.ml_name = NULL},
};
