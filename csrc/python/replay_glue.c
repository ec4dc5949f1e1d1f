/*
 * replay_glue.c -- Heap.replay: packed trace events replayed inside the core (core/replay.c),
 * so that timing measures the allocator and not Python.
 */
#include "heap_object.h"

#include <stdio.h>
#include <string.h>

#include "convert.h"

/* The caller's events (a whole number of them), copied once and then
 * checked: every op known, every slot below n_slots.  *n: how many.  NULL
 * with an exception set. */
static gm_replay_event *copy_events(const Py_buffer *ev, size_t n_slots, size_t *n) {
    *n = (size_t)ev->len / sizeof(gm_replay_event);
    /* One copy, then every check reads the copy: nothing can change it. */
    gm_replay_event *events = PyMem_Malloc(*n ? (size_t)ev->len : 1);
    if (events == NULL) return (gm_replay_event *)PyErr_NoMemory();
    memcpy(events, ev->buf, (size_t)ev->len);
    for (size_t i = 0; i < *n; i++) {
        if (events[i].op != GM_R_ALLOC && events[i].op != GM_R_FREE) {
            PyErr_Format(PyExc_ValueError, "events[%zu]: unknown op %u", i, (unsigned)events[i].op);
        } else if (events[i].slot >= n_slots) {
            PyErr_Format(PyExc_ValueError, "events[%zu]: slot %u is not below n_slots=%zu", i, (unsigned)events[i].slot,
                         n_slots);
        } else {
            continue;
        }
        PyMem_Free(events);
        return NULL;
    }
    return events;
}

/* The n_slots (not too many to count in bytes) slots the core fills: the caller's buffer (`slots_o`, exported into sl
 * until the core is done) or, for None, zeroed memory of our own (*own, to be
 * freed).  NULL with an exception set. */
static uintptr_t *get_slots(PyObject *slots_o, size_t n_slots, Py_buffer *sl, uintptr_t **own) {
    if (slots_o == Py_None) {
        *own = PyMem_Calloc(n_slots ? n_slots : 1, sizeof **own);
        return *own ? *own : (uintptr_t *)PyErr_NoMemory();
    }
    if (PyObject_GetBuffer(slots_o, sl, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if ((size_t)sl->len != n_slots * sizeof(uintptr_t) || (uintptr_t)sl->buf % _Alignof(uintptr_t) != 0) {
        PyErr_Format(PyExc_ValueError, "slots must be an aligned writable buffer of n_slots*%zu = %zu bytes",
                     sizeof(uintptr_t), n_slots * sizeof(uintptr_t));
        return NULL;
    }
    return sl->buf;
}

/* The bytes the blocks of a caller's slot table hold: what an earlier chunk
 * left live (a pointer the heap does not know counts nothing).  In the core. */
static uint64_t slots_live(gm_heap *h, const uintptr_t *slots, size_t n_slots) {
    uint64_t live = 0;
    for (size_t i = 0; i < n_slots; i++)
        if (slots[i]) live += gm_block_size(h, slots[i]);
    return live;
}

/* replay()'s answer: the core's result, and op_ns (when timed) of the `ran`
 * events that ran as an array('Q').  New reference or NULL. */
static PyObject *result_dict(const gm_replay_result *res, const uint64_t *op_ns, size_t ran) {
    PyObject *result = PyDict_New();
    if (result == NULL) return NULL;
    if (gm_py_put_u64(result, "allocs", res->allocs) < 0 || gm_py_put_u64(result, "frees", res->frees) < 0 ||
        gm_py_put_u64(result, "ooms", res->ooms) < 0 ||
        gm_py_put_u64(result, "peak_live_bytes", res->peak_live_bytes) < 0 ||
        gm_py_put_u64(result, "live_bytes", res->live_bytes) < 0 ||
        gm_py_put_u64(result, "peak_reserved_bytes", res->peak_reserved_bytes) < 0 ||
        gm_py_put_i64(result, "first_oom_event",
                      res->first_oom_event == UINT64_MAX ? -1 : (int64_t)res->first_oom_event) < 0 ||
        gm_py_put_u64(result, "peak_event", res->peak_event) < 0 || gm_py_put_i64(result, "error", res->error) < 0 ||
        gm_py_put(result, "error_name", PyUnicode_FromString(gm_py_code_name(res->error))) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    if (op_ns) {
        PyObject *array_mod = PyImport_ImportModule("array");
        PyObject *arr = NULL;
        if (array_mod != NULL) {
            PyObject *raw = PyBytes_FromStringAndSize((const char *)op_ns, (Py_ssize_t)(ran * sizeof *op_ns));
            if (raw != NULL) arr = PyObject_CallMethod(array_mod, "array", "sO", "Q", raw);
            Py_XDECREF(raw);
            Py_DECREF(array_mod);
        }
        if (gm_py_put(result, "op_ns", arr) < 0) Py_CLEAR(result);
    }
    return result;
}

/* replay(events, n_slots, timing=False, stop_at=-1, slots=None, live_bytes=None)
 * `slots`, when given, is a writable buffer of n_slots 8-byte words that the
 * caller keeps between calls, so that a trace can be replayed in chunks (for a
 * progress bar) with frees naming slots that an earlier chunk allocated.  The
 * live bytes carry over: `live_bytes` is what the previous chunk's result said
 * (its "live_bytes"), or, left None, the slots' blocks are summed.
 *
 * The events are copied once, before they are checked: the core trusts the
 * slot numbers it is given, and the caller's buffer may be rewritten by
 * another thread while the core runs without the GIL, or alias `slots`.  The
 * slots buffer stays exported (so it cannot be resized) until the core is
 * done; what the caller writes into it meanwhile is at most a pointer the heap
 * does not know, which the core refuses.  op_ns holds the events that ran. */
static PyObject *Heap_replay(HeapObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"events", "n_slots", "timing", "stop_at", "slots", "live_bytes", NULL};
    Py_buffer ev = {0}, sl = {0};
    PyObject *slots_o = Py_None, *live_o = Py_None;
    size_t n_slots;
    int timing = 0;
    long long stop_at = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*O&|pLOO:replay", kwlist, &ev, gm_py_n_slots_arg, &n_slots, &timing,
                                     &stop_at, &slots_o, &live_o)) {
        if (ev.obj) PyBuffer_Release(&ev);
        return NULL;
    }
    PyObject *result = NULL;
    gm_replay_event *events = NULL;
    uintptr_t *slots, *own_slots = NULL;
    uint64_t *op_ns = NULL;
    size_t n = 0;
    if (ev.len % (Py_ssize_t)sizeof(gm_replay_event) != 0) {
        PyErr_Format(PyExc_ValueError, "events: %zd bytes is not a whole number of %zu-byte events", ev.len,
                     sizeof(gm_replay_event));
        goto done;
    }
    if (stop_at < -1) {
        PyErr_SetString(PyExc_ValueError, "stop_at must be -1 (no stop) or an event index");
        goto done;
    }
    /* Slot numbers are 32-bit, so no trace needs more than 2^32 slots: more would only
     * ask the allocator for more memory than it can serve. */
    if (n_slots > (size_t)UINT32_MAX + 1) {
        PyErr_Format(PyExc_ValueError,
                     "n_slots is too large: %zu slots, more than the 2^32 that 32-bit slot numbers name", n_slots);
        goto done;
    }
    gm_replay_result res;
    memset(&res, 0, sizeof res);
    if (live_o != Py_None && gm_py_live_bytes_arg(live_o, &res.live_bytes) == 0) goto done;
    events = copy_events(&ev, n_slots, &n);
    PyBuffer_Release(&ev);
    if (events == NULL || !(slots = get_slots(slots_o, n_slots, &sl, &own_slots))) goto done;
    if (timing && !(op_ns = PyMem_Calloc(n ? n : 1, sizeof *op_ns))) {
        PyErr_NoMemory();
        goto done;
    }
    /* The last Python call was the slots export: now the heap. */
    if (gm_py_ready(self, GM_PY_OPEN) < 0) goto done;
    int rc;
    uint64_t stop = stop_at < 0 ? UINT64_MAX : (uint64_t)stop_at;
    ENTER_CORE(self);
    if (slots_o != Py_None && live_o == Py_None) res.live_bytes = slots_live(self->heap, slots, n_slots);
    rc = gm_replay(self->heap, events, n, slots, op_ns, stop, &res);
    LEAVE_CORE(self);
    if (rc != GM_OK && rc != res.error)
        gm_py_raise(self, rc, "replay");
    else
        result = result_dict(&res, op_ns, res.events <= n ? (size_t)res.events : n);
done:
    if (sl.obj) PyBuffer_Release(&sl);
    if (ev.obj) PyBuffer_Release(&ev);
    PyMem_Free(events);
    PyMem_Free(own_slots);
    PyMem_Free(op_ns);
    return result;
}

PyMethodDef gm_py_replay_methods[] = {
    {.ml_name = "replay",
     .ml_meth = KW(Heap_replay),
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "replay(events, n_slots, timing=False, stop_at=-1, slots=None, live_bytes=None) -> dict\n"
               "events: packed struct '<IIQQ' (op, slot, size, stream); slots: optional writable\n"
               "buffer of n_slots 8-byte words kept by the caller across chunked calls; live_bytes:\n"
               "the previous chunk's result's live_bytes (None: the slots' blocks are summed)."},
    {.ml_name = NULL},
};
