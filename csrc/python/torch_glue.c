/*
 * torch_glue.c -- what gpumem.torch (gpumem/torch/) needs from C that is
 * torch's alone: how an out-of-memory failure is raised, the addresses of the
 * entry points and hooks it hands to torch, torch's counters and the pools
 * its allocations are routed to now, and the visibility layer's switches on
 * the torch path: torch's OutOfMemoryError explained by gpumem.explain
 * (gm_py_torch_oom_formatter, oom_glue.c) and allocations, frees and
 * empty_cache taking their caller's Python stack (history_glue.c).
 *
 * Everything a heap answers (stats, snapshot, history, reports, caps, checks,
 * private pools) is a method of the gpumem.Heap that borrows the device's heap
 * from the process-wide heap registry (_C.registry_heap, registry_glue.c): torch,
 * CuPy, Numba and a Heap of one's own answer through the same methods.
 *
 * Registered on gpumem._C by gm_torch_glue_add() (called from module.c), all
 * under names starting "_torch_".
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <inttypes.h>
#include <string.h>

#include "convert.h"
#include "ext_pool.h"
#include "heap_registry.h"
#include "history_glue.h"
#include "oom_glue.h"
#include "torch_alloc.h"

int gm_torch_glue_add(PyObject *module);

/* ---- configuration -------------------------------------------------------------- */

/* _torch_set_oom(mode=None, oom_class=<unchanged>) -> the mode now. */
static PyObject *g_set_oom(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kw) {
    static char *names[] = {"mode", "oom_class", NULL};
    const char *mode = NULL;
    PyObject *cls = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|zO:_torch_set_oom", names, &mode, &cls)) return NULL;
    int m = -1;
    if (mode && strcmp(mode, "torch") == 0)
        m = GM_TORCH_OOM_TORCH;
    else if (mode && strcmp(mode, "runtime") == 0)
        m = GM_TORCH_OOM_RUNTIME;
    else if (mode)
        return PyErr_Format(PyExc_ValueError, "oom_mode must be 'torch' or 'runtime', not '%s'", mode);
    if (cls != NULL && cls != Py_None &&
        !(PyType_Check(cls) && PyType_IsSubtype((PyTypeObject *)cls, (PyTypeObject *)PyExc_BaseException)))
        return PyErr_Format(PyExc_TypeError, "oom_class must be an exception class or None");
    if (m >= 0) gm_torch_set_oom_mode(m);
    if (cls != NULL) gm_torch_set_oom_class(cls == Py_None ? NULL : cls);
    return PyUnicode_FromString(gm_torch_get_oom_mode() == GM_TORCH_OOM_TORCH ? "torch" : "runtime");
}

static PyObject *g_entry_points(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    if (gm_py_put(d, "alloc", gm_py_fn_address((void (*)(void))gpumem_torch_alloc)) < 0 ||
        gm_py_put(d, "free", gm_py_fn_address((void (*)(void))gpumem_torch_free)) < 0 ||
        gm_py_put(d, "empty_cache", gm_py_fn_address((void (*)(void))gpumem_torch_empty_cache)) < 0 ||
        gm_py_put(d, "memory_fraction", gm_py_fn_address((void (*)(void))gpumem_torch_memory_fraction)) < 0 ||
        gm_py_put(d, "record_stream", gm_py_fn_address((void (*)(void))gpumem_torch_record_stream)) < 0 ||
        gm_py_put(d, "init", gm_py_fn_address((void (*)(void))gpumem_torch_init)) < 0 ||
        gm_py_put(d, "begin_allocate_to_pool", PyLong_FromUnsignedLongLong(gm_torch_pool_hook(GM_TORCH_HOOK_BEGIN))) <
            0 ||
        gm_py_put(d, "end_allocate_to_pool", PyLong_FromUnsignedLongLong(gm_torch_pool_hook(GM_TORCH_HOOK_END))) < 0 ||
        gm_py_put(d, "release_pool", PyLong_FromUnsignedLongLong(gm_torch_pool_hook(GM_TORCH_HOOK_RELEASE))) < 0 ||
        gm_py_put(d, "pool_begin", gm_py_fn_address((void (*)(void))gpumem_torch_pool_begin)) < 0 ||
        gm_py_put(d, "pool_end", gm_py_fn_address((void (*)(void))gpumem_torch_pool_end)) < 0 ||
        gm_py_put(d, "pool_release", gm_py_fn_address((void (*)(void))gpumem_torch_pool_release)) < 0 ||
        gm_py_put(d, "raw_delete", gm_py_fn_address((void (*)(void))gpumem_torch_raw_delete)) < 0 ||
        gm_py_put(d, "device_stats", gm_py_fn_address((void (*)(void))gpumem_torch_device_stats)) < 0 ||
        gm_py_put(d, "reset_stats", gm_py_fn_address((void (*)(void))gpumem_torch_reset_stats)) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* An address from Python (0: none) into the function pointer *fn of `size`
 * bytes: the other way round from gm_py_fn_address.  0, or -1 with an
 * exception set. */
static int get_fn(PyObject *a, void *fn, size_t size) {
    unsigned long long v = PyLong_AsUnsignedLongLong(a);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    uintptr_t u = (uintptr_t)v;
    memcpy(fn, &u, size);
    return 0;
}

static PyObject *g_set_context_hook(PyObject *Py_UNUSED(m), PyObject *a) {
    gm_torch_context_fn fn = NULL;
    if (get_fn(a, &fn, sizeof fn) < 0) return NULL;
    gpumem_torch_set_context_hook(fn);
    Py_RETURN_NONE;
}

static PyObject *g_set_oom_formatter(PyObject *Py_UNUSED(m), PyObject *a) {
    gm_torch_oom_formatter fn = NULL;
    if (get_fn(a, &fn, sizeof fn) < 0) return NULL;
    gpumem_torch_set_oom_formatter(fn);
    Py_RETURN_NONE;
}

/* ---- torch's view of the heaps ----------------------------------------------------- */

static PyObject *g_device_count(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    return PyLong_FromLong(gm_torch_device_count());
}

/* The message an allocation of `size` bytes on torch's heap of `device` would fail with now. */
static PyObject *g_format_oom(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *dev_o;
    unsigned long long size = 0;
    int device;
    if (!PyArg_ParseTuple(args, "O|K", &dev_o, &size) || gm_py_device_index(dev_o, &device) < 0) return NULL;
    gm_heap *h = gm_heap_registry_get(device);
    if (h == NULL) Py_RETURN_NONE;
    gm_oom_info info;
    char buf[GM_TORCH_OOM_MSG_MAX];
    Py_BEGIN_ALLOW_THREADS gm_memory_report(h, (size_t)size, &info);
    gm_torch_format_oom(device, &info, buf, sizeof buf);
    Py_END_ALLOW_THREADS return PyUnicode_FromString(buf);
}

static PyObject *g_counters(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    gm_torch_counters c;
    gm_torch_get_counters(&c);
    PyObject *d = PyDict_New();
    if (d == NULL) return NULL;
    if (gm_py_put_u64(d, "ooms", c.ooms) < 0 || gm_py_put_u64(d, "oom_retries", c.oom_retries) < 0 ||
        gm_py_put_u64(d, "free_errors", c.free_errors) < 0 ||
        gm_py_put_u64(d, "empty_cache_calls", c.empty_cache_calls) < 0 ||
        gm_py_put_u64(d, "record_stream_calls", c.record_stream_calls) < 0 ||
        gm_py_put_u64(d, "fraction_calls", c.fraction_calls) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

/* ---- private pools ------------------------------------------------------------------ */

static PyObject *pool_id_tuple(gm_pool_id id) {
    return Py_BuildValue("(KK)", (unsigned long long)id.first, (unsigned long long)id.second);
}

static PyObject *g_active_pools(PyObject *Py_UNUSED(m), PyObject *a) {
    int device;
    if (gm_py_device_index(a, &device) < 0) return NULL;
    gm_pool_id ids[64];
    size_t n = gm_torch_active_pools(device, ids, 64);
    if (n > 64) n = 64;
    PyObject *out = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; out != NULL && i < n; i++) {
        PyObject *t = pool_id_tuple(ids[i]);
        if (t == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, (Py_ssize_t)i, t);
    }
    return out;
}

/* ---- pools over another allocator (ext_pool.h) ---------------------------------- */

/* _torch_ext_attach(device, (a, b), alloc_address, free_address, use_on_oom) */
static PyObject *g_ext_attach(PyObject *Py_UNUSED(m), PyObject *args) {
    int device, use_on_oom;
    gm_pool_id id;
    unsigned long long fa, ff;
    if (!PyArg_ParseTuple(args, "i(KK)KKp:_torch_ext_attach", &device, &id.first, &id.second, &fa, &ff, &use_on_oom))
        return NULL;
    if (!fa || !ff) return PyErr_Format(PyExc_ValueError, "_torch_ext_attach: a function address of 0");
    if (gm_ext_attach(device, id, (gm_ext_alloc_fn)(uintptr_t)fa, (gm_ext_free_fn)(uintptr_t)ff, use_on_oom) != GM_OK)
        return PyErr_Format(PyExc_ValueError,
                            "pool (%llu, %llu) of device %d already has an allocator, or no such device",
                            (unsigned long long)id.first, (unsigned long long)id.second, device);
    Py_RETURN_NONE;
}

/* _torch_ext_detach(device, (a, b)) -> whether the pool had an allocator */
static PyObject *g_ext_detach(PyObject *Py_UNUSED(m), PyObject *args) {
    int device;
    gm_pool_id id;
    if (!PyArg_ParseTuple(args, "i(KK):_torch_ext_detach", &device, &id.first, &id.second)) return NULL;
    return PyBool_FromLong(gm_ext_detach(device, id) == GM_OK);
}

/* _torch_ext_segments(device, (a, b)) -> [(base, [(addr, size, used)])] */
static PyObject *g_ext_segments(PyObject *Py_UNUSED(m), PyObject *args) {
    int device;
    gm_pool_id id;
    if (!PyArg_ParseTuple(args, "i(KK):_torch_ext_segments", &device, &id.first, &id.second)) return NULL;
    enum {
        MAX_BLOCKS = 4096,
        MAX_SEGS = 1024
    };
    gm_ext_block_info *blocks = PyMem_Malloc(MAX_BLOCKS * sizeof *blocks);
    size_t *per = PyMem_Malloc(MAX_SEGS * sizeof *per);
    PyObject *out = blocks && per ? PyList_New(0) : PyErr_NoMemory();
    size_t n = out ? gm_ext_segments(device, id, blocks, MAX_BLOCKS, per, MAX_SEGS) : 0, at = 0;
    for (size_t i = 0; out && i < n && i < MAX_SEGS; i++) {
        PyObject *bl = PyList_New(0);
        for (size_t k = 0; bl && k < per[i] && at < MAX_BLOCKS; k++, at++) {
            PyObject *t = Py_BuildValue("(KKO)", (unsigned long long)blocks[at].addr,
                                        (unsigned long long)blocks[at].size, blocks[at].used ? Py_True : Py_False);
            if (!t || PyList_Append(bl, t) < 0) Py_CLEAR(bl);
            Py_XDECREF(t);
        }
        PyObject *seg =
            bl ? Py_BuildValue("(KN)", (unsigned long long)(per[i] ? blocks[at - per[i]].addr : 0), bl) : NULL;
        if (!seg || PyList_Append(out, seg) < 0) Py_CLEAR(out);
        Py_XDECREF(seg);
    }
    PyMem_Free(blocks);
    PyMem_Free(per);
    return out;
}

static PyObject *g_cxx11_abi(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(a)) {
    return PyLong_FromLong(gm_torch_cxx11_abi());
}

static PyObject *g_set_oom_observer(PyObject *Py_UNUSED(m), PyObject *fn) {
    if (fn != Py_None && !PyCallable_Check(fn))
        return PyErr_Format(PyExc_TypeError, "an OOM observer must be callable or None, not %.80s",
                            Py_TYPE(fn)->tp_name);
    gm_torch_set_oom_observer(fn == Py_None ? NULL : fn);
    Py_RETURN_NONE;
}

/* ---- the visibility layer's switches ------------------------------------------------ */

static void set_explain_oom(int on) { gpumem_torch_set_oom_formatter(on ? gm_py_torch_oom_formatter : NULL); }

static void set_stack_hook(int on) { gpumem_torch_set_context_hook(on ? gm_py_capture_context_reacquire : NULL); }

/* Turn a switch on or off: a's truth value to set(). */
static PyObject *switch_to(PyObject *a, void (*set)(int)) {
    int on = PyObject_IsTrue(a);
    if (on < 0) return NULL;
    set(on);
    Py_RETURN_NONE;
}

static PyObject *g_explain_oom(PyObject *Py_UNUSED(m), PyObject *a) { return switch_to(a, set_explain_oom); }

static PyObject *g_stack_hook(PyObject *Py_UNUSED(m), PyObject *a) { return switch_to(a, set_stack_hook); }

static PyObject *g_set_event_stacks(PyObject *Py_UNUSED(m), PyObject *a) {
    return switch_to(a, gpumem_torch_set_event_stacks);
}

static PyMethodDef glue_methods[] = {
    GM_PY_FN("_torch_set_oom", g_set_oom, METH_VARARGS | METH_KEYWORDS,
             "_torch_set_oom(mode=None, oom_class=<unchanged>) -> mode: how torch's out-of-memory failures are raised "
             "('torch': oom_class, 'runtime': RuntimeError)"),
    GM_PY_FN("_torch_entry_points", g_entry_points, METH_NOARGS,
             "_torch_entry_points() -> {name: address} of the functions torch calls"),
    GM_PY_FN("_torch_set_context_hook", g_set_context_hook, METH_O,
             "_torch_set_context_hook(address): uint64_t (*)(void) called before each allocation (0 clears)"),
    GM_PY_FN("_torch_set_oom_formatter", g_set_oom_formatter, METH_O,
             "_torch_set_oom_formatter(address): replaces the out-of-memory message (0 clears)"),
    GM_PY_FN("_torch_device_count", g_device_count, METH_NOARGS,
             "_torch_device_count() -> count torch reported (-1 before CUDA init)"),
    GM_PY_FN("_torch_format_oom", g_format_oom, METH_VARARGS,
             "_torch_format_oom(device, size=0) -> the message such a request would fail with"),
    GM_PY_FN("_torch_counters", g_counters, METH_NOARGS, "_torch_counters() -> dict"),
    GM_PY_FN("_torch_active_pools", g_active_pools, METH_O,
             "_torch_active_pools(device) -> [(a, b)] pools allocations are routed to now, in order"),
    GM_PY_FN("_torch_ext_attach", g_ext_attach, METH_VARARGS,
             "_torch_ext_attach(device, pool, alloc_address, free_address, use_on_oom): the pool takes its memory "
             "from another allocator's alloc/free functions"),
    GM_PY_FN("_torch_ext_detach", g_ext_detach, METH_VARARGS,
             "_torch_ext_detach(device, pool) -> bool: the pool has ended; its memory goes back to its allocator"),
    GM_PY_FN("_torch_ext_segments", g_ext_segments, METH_VARARGS,
             "_torch_ext_segments(device, pool) -> [(base, [(addr, size, used)])] of a pool over another allocator"),
    GM_PY_FN("_torch_cxx11_abi", g_cxx11_abi, METH_NOARGS,
             "_torch_cxx11_abi() -> the _GLIBCXX_USE_CXX11_ABI the torch boundary was built with"),
    GM_PY_FN("_torch_set_oom_observer", g_set_oom_observer, METH_O,
             "_torch_set_oom_observer(fn or None): fn(device, requested, allowed, device_free) runs before each OOM"),
    GM_PY_FN("_torch_explain_oom", g_explain_oom, METH_O,
             "_torch_explain_oom(on): torch's OutOfMemoryError explained by gpumem.explain, or its first sentences"),
    GM_PY_FN("_torch_stack_hook", g_stack_hook, METH_O,
             "_torch_stack_hook(on): each allocation torch makes records its caller's Python stack, or none"),
    GM_PY_FN("_torch_set_event_stacks", g_set_event_stacks, METH_O,
             "_torch_set_event_stacks(on): torch's frees and empty_cache record their caller's stack (context='all')"),
    {.ml_name = NULL},
};

int gm_torch_glue_add(PyObject *module) { return PyModule_AddFunctions(module, glue_methods); }
