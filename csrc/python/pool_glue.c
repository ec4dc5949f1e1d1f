/*
 * pool_glue.c -- Heap's private pools (torch's graph pools and MemPool): create
 * and release them, read what they hold, make a checkpoint's blocks live again,
 * pause and resume them.  The core's gm_pool_* calls, with the boundary rule
 * of heap_object.h; one table, gathered into Heap's methods by module.c.
 */
#include "heap_object.h"

#include "convert.h"

PyObject *gm_py_no_such_pool(const gm_pool_id *id) {
    PyErr_Format(PyExc_ValueError, "no pool (%llu, %llu) lives on this heap (retain it first)",
                 (unsigned long long)id->first, (unsigned long long)id->second);
    return NULL;
}

static PyObject *not_paused(const gm_pool_id *id) {
    PyErr_Format(PyExc_RuntimeError, "pool_resume: pool (%llu, %llu) is not paused", (unsigned long long)id->first,
                 (unsigned long long)id->second);
    return NULL;
}

static PyObject *Heap_pool_retain(HeapObject *self, PyObject *id_o) {
    gm_pool_id id;
    if (gm_py_arg(self, GM_PY_OPEN, id_o, gm_py_pool_arg, &id) < 0) return NULL;
    int rc = gm_pool_retain(self->heap, id);
    if (rc != GM_OK) return rc == GM_ENOMEM ? PyErr_NoMemory() : gm_py_raise(self, rc, "pool_retain");
    Py_RETURN_NONE;
}

static PyObject *Heap_pool_set_no_split(HeapObject *self, PyObject *args) {
    PyObject *id_o;
    int flag;
    if (gm_py_ready(self, GM_PY_OPEN) < 0 || !PyArg_ParseTuple(args, "Op:pool_set_no_split", &id_o, &flag)) return NULL;
    gm_pool_id id;
    if (gm_py_arg(self, GM_PY_OPEN, id_o, gm_py_pool_arg, &id) < 0) return NULL;
    if (gm_pool_set_no_split(self->heap, id, flag) != GM_OK) return gm_py_no_such_pool(&id);
    Py_RETURN_NONE;
}

static PyObject *Heap_pool_release(HeapObject *self, PyObject *id_o) {
    gm_pool_id id;
    if (gm_py_arg(self, GM_PY_OPEN, id_o, gm_py_pool_arg, &id) < 0) return NULL;
    int rc;
    ENTER_CORE(self);
    rc = gm_pool_release(self->heap, id);
    LEAVE_CORE(self);
    if (rc == GM_EINVAL) return gm_py_no_such_pool(&id);
    if (rc == GM_EPAUSED)
        return PyErr_Format(PyExc_RuntimeError,
                            "pool_release: pool (%llu, %llu) is paused; resume it before releasing it (GM_EPAUSED)",
                            (unsigned long long)id.first, (unsigned long long)id.second);
    Py_RETURN_NONE;
}

static PyObject *pause_error(HeapObject *self, int rc, const gm_pool_id *id, const char *what) {
    if (rc == GM_EPAUSED)
        return PyErr_Format(PyExc_RuntimeError, "%s: pool (%llu, %llu) is already paused (GM_EPAUSED)", what,
                            (unsigned long long)id->first, (unsigned long long)id->second);
    if (rc == GM_ECAPTURING)
        return PyErr_Format(PyExc_RuntimeError,
                            "%s: not allowed while a CUDA graph is being captured (GM_ECAPTURING); pause or resume "
                            "before or after the capture",
                            what);
    return gm_py_raise(self, rc, what);
}

static PyObject *Heap_pool_pause(HeapObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"id", "backup", NULL};
    int backup = 0;
    gm_pool_id id;
    if (gm_py_args(self, GM_PY_OPEN, args, kwds, "O&|p:pool_pause", kwlist, gm_py_pool_arg, &id, &backup) < 0)
        return NULL;
    gm_pool_info pi;
    if (gm_pool_info_get(self->heap, id, &pi) != GM_OK) return gm_py_no_such_pool(&id);
    gm_pause_info info;
    int rc;
    double t0 = gm_py_monotonic_s(), t1;
    ENTER_CORE(self);
    rc = gm_pool_pause(self->heap, id, backup ? GM_PAUSE_BACKUP : 0, &info);
    LEAVE_CORE(self);
    t1 = gm_py_monotonic_s();
    if (rc == GM_EINVAL) return gm_py_no_such_pool(&id);
    if (rc != GM_OK) {
        /* A device failure part way leaves the pool paused with what was released. */
        if (gm_pool_info_get(self->heap, id, &pi) == GM_OK && pi.paused && rc == GM_EDEVICE) {
            char what[128];
            snprintf(what, sizeof what,
                     "pool_pause (the pool is paused with the %llu pages released before the failure)",
                     (unsigned long long)pi.paused_pages);
            gm_py_raise(self, rc, what);
            return NULL;
        }
        return pause_error(self, rc, &id, "pool_pause");
    }
    return gm_py_pause_dict(self->heap, &info, t1 - t0);
}

static PyObject *Heap_pool_resume(HeapObject *self, PyObject *id_o) {
    gm_pool_id id;
    if (gm_py_arg(self, GM_PY_OPEN, id_o, gm_py_pool_arg, &id) < 0) return NULL;
    gm_pool_info pi;
    if (gm_pool_info_get(self->heap, id, &pi) != GM_OK) return gm_py_no_such_pool(&id);
    if (!pi.paused) return not_paused(&id);
    gm_pause_info info;
    int rc;
    double t0 = gm_py_monotonic_s(), t1;
    ENTER_CORE(self);
    rc = gm_pool_resume(self->heap, id, &info);
    LEAVE_CORE(self);
    t1 = gm_py_monotonic_s();
    if (rc == GM_EINVAL) {
        if (gm_pool_info_get(self->heap, id, &pi) != GM_OK) return gm_py_no_such_pool(&id);
        return not_paused(&id);
    }
    if (rc != GM_OK) return pause_error(self, rc, &id, "pool_resume (the pool stays paused)");
    return gm_py_pause_dict(self->heap, &info, t1 - t0);
}

static PyObject *Heap_pool_info(HeapObject *self, PyObject *id_o) {
    gm_pool_id id;
    if (gm_py_arg(self, GM_PY_OPEN, id_o, gm_py_pool_arg, &id) < 0) return NULL;
    gm_pool_info info;
    int rc;
    ENTER_CORE(self);
    rc = gm_pool_info_get(self->heap, id, &info);
    LEAVE_CORE(self);
    if (rc != GM_OK) return gm_py_no_such_pool(&id);
    return gm_py_pool_info_dict(&info);
}

static PyObject *Heap_pools(HeapObject *self, PyObject *Py_UNUSED(ignored)) {
    if (gm_py_ready(self, GM_PY_OPEN) < 0) return NULL;
    gm_pool_info *buf = NULL;
    size_t cap = 0, n;
    /* Another thread may add pools between the sizing call and the real one. */
    for (;;) {
        ENTER_CORE(self);
        n = gm_pool_list(self->heap, buf, cap);
        LEAVE_CORE(self);
        if (n <= cap) break;
        PyMem_Free(buf);
        cap = n + 4;
        if (!(buf = PyMem_Malloc(cap * sizeof *buf))) return PyErr_NoMemory();
    }
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *d = gm_py_pool_info_dict(&buf[i]);
        if (d == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, (Py_ssize_t)i, d);
    }
    PyMem_Free(buf);
    return list;
}

static PyObject *Heap_pool_live(HeapObject *self, PyObject *id_o) {
    gm_pool_id id;
    if (gm_py_arg(self, GM_PY_OPEN, id_o, gm_py_pool_arg, &id) < 0) return NULL;
    gm_pool_info info;
    if (gm_pool_info_get(self->heap, id, &info) != GM_OK) return gm_py_no_such_pool(&id);
    uintptr_t *addrs = NULL;
    size_t *sizes = NULL, cap = info.live_blocks, n;
    for (;;) {
        PyMem_Free(addrs);
        PyMem_Free(sizes);
        addrs = PyMem_Malloc((cap ? cap : 1) * sizeof *addrs);
        sizes = PyMem_Malloc((cap ? cap : 1) * sizeof *sizes);
        if (!addrs || !sizes) {
            PyMem_Free(addrs);
            PyMem_Free(sizes);
            return PyErr_NoMemory();
        }
        ENTER_CORE(self);
        n = gm_pool_live(self->heap, id, addrs, sizes, cap);
        LEAVE_CORE(self);
        if (n <= cap) break;
        cap = n + 16;
    }
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list && i < n; i++) {
        PyObject *t = Py_BuildValue("(Kn)", (unsigned long long)addrs[i], (Py_ssize_t)sizes[i]);
        if (t == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, (Py_ssize_t)i, t);
    }
    PyMem_Free(addrs);
    PyMem_Free(sizes);
    return list;
}

static PyObject *Heap_pool_set_live(HeapObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"id", "blocks", "stream", NULL};
    PyObject *blocks_o, *stream_o = NULL;
    gm_pool_id id;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O|O:pool_set_live", kwlist, gm_py_pool_arg, &id, &blocks_o,
                                     &stream_o))
        return NULL;
    uint64_t stream = 0;
    if (stream_o && gm_py_to_u64(stream_o, "stream", UINT64_MAX - 1, &stream) < 0) return NULL;
    if (!PySequence_Check(blocks_o)) {
        PyErr_SetString(PyExc_TypeError, "pool_set_live: blocks must be a sequence of (addr, size) pairs");
        return NULL;
    }
    /* A tuple copy: its items stay alive and in place whatever an item's
     * __index__ does to the caller's list; each item is a tuple, which cannot
     * change either. */
    PyObject *seq = gm_py_tuple_of(blocks_o);
    if (seq == NULL) return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(seq);
    uintptr_t *addrs = PyMem_Calloc((size_t)(n ? n : 1), sizeof *addrs);
    size_t *sizes = PyMem_Calloc((size_t)(n ? n : 1), sizeof *sizes);
    PyObject *result = NULL;
    if (!addrs || !sizes) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(seq, i);
        uint64_t a;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_Format(PyExc_TypeError, "pool_set_live: blocks[%zd] must be an (addr, size) tuple", i);
            goto out;
        }
        if (gm_py_to_u64(PyTuple_GET_ITEM(item, 0), "addr", UINTPTR_MAX, &a) < 0 ||
            gm_py_to_size(PyTuple_GET_ITEM(item, 1), "size", &sizes[i]) < 0)
            goto out;
        addrs[i] = (uintptr_t)a;
    }
    if (gm_py_ready(self, GM_PY_OPEN) < 0) goto out;
    gm_pool_info info;
    if (gm_pool_info_get(self->heap, id, &info) != GM_OK) {
        gm_py_no_such_pool(&id);
        goto out;
    }
    int rc;
    ENTER_CORE(self);
    rc = gm_pool_set_live(self->heap, id, addrs, sizes, (size_t)n, (gm_stream)stream);
    LEAVE_CORE(self);
    if (rc == GM_EINVAL)
        PyErr_Format(PyExc_ValueError,
                     "pool_set_live: the blocks are not the pool's live blocks or 512-aligned, disjoint ranges "
                     "inside its free memory; nothing was changed");
    else if (rc == GM_ENOMEM)
        PyErr_NoMemory();
    else if (rc != GM_OK)
        gm_py_raise(self, rc, "pool_set_live");
    else {
        Py_INCREF(Py_None);
        result = Py_None;
    }
out:
    PyMem_Free(addrs);
    PyMem_Free(sizes);
    Py_DECREF(seq);
    return result;
}

PyMethodDef gm_py_pool_methods[] = {
    {.ml_name = "pool_retain",
     .ml_meth = (PyCFunction)Heap_pool_retain,
     .ml_flags = METH_O,
     .ml_doc = "pool_retain(id): create the private pool id (a pair of ints), or add a use to it"},
    {.ml_name = "pool_set_no_split",
     .ml_meth = (PyCFunction)Heap_pool_set_no_split,
     .ml_flags = METH_VARARGS,
     .ml_doc = "pool_set_no_split(id, flag): a living pool whose blocks are never split (torch's "
               "MemPool(no_split=True)): a request takes whole pages, or a whole free block of the pool"},
    {.ml_name = "pool_release",
     .ml_meth = (PyCFunction)Heap_pool_release,
     .ml_flags = METH_O,
     .ml_doc = "pool_release(id): drop a use; at zero the pool ends and its free blocks join the heap"},
    {.ml_name = "pool_info",
     .ml_meth = (PyCFunction)Heap_pool_info,
     .ml_flags = METH_O,
     .ml_doc = "pool_info(id) -> dict (id, use_count, live_blocks, live_bytes, free_blocks, free_bytes, "
               "pinned_pages, paused, paused_pages, shared_pages, backup_bytes)"},
    {.ml_name = "pools",
     .ml_meth = (PyCFunction)Heap_pools,
     .ml_flags = METH_NOARGS,
     .ml_doc = "pools() -> [pool_info dict] of the living pools"},
    {.ml_name = "pool_live",
     .ml_meth = (PyCFunction)Heap_pool_live,
     .ml_flags = METH_O,
     .ml_doc = "pool_live(id) -> [(addr, size)] of the pool's live blocks, in address order"},
    {.ml_name = "pool_set_live",
     .ml_meth = KW(Heap_pool_set_live),
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "pool_set_live(id, blocks, stream=0): make exactly blocks [(addr, size)] the pool's live blocks"},
    {.ml_name = "pool_pause",
     .ml_meth = KW(Heap_pool_pause),
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "pool_pause(id, backup=False) -> dict (pages, bytes, shared_pages, backup_bytes, seconds): release "
               "the physical pages only the pool's blocks use, keeping their addresses; backup: copy their contents "
               "to pinned host memory first"},
    {.ml_name = "pool_resume",
     .ml_meth = (PyCFunction)Heap_pool_resume,
     .ml_flags = METH_O,
     .ml_doc = "pool_resume(id) -> dict (pages, bytes, shared_pages, backup_bytes, seconds): map fresh pages "
               "behind the paused addresses and restore the backup, if any"},
    {.ml_name = NULL},
};
