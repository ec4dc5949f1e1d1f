/*
 * history_glue.c -- interned Python stacks for allocation sites.  See
 * history_glue.h.
 *
 * Why intern in C: stacks are taken on every allocation while capture is on,
 * so the common case -- a stack seen before -- must not build Python objects.
 * A stack is the list of (code object, instruction offset) pairs of its
 * frames; those are hashed and looked up in an open-addressing table.  Only a
 * new stack copies its pairs into a pool, taking a reference to each code
 * object: that keeps the pointer from being reused by another code object, so
 * pointer equality stays a sound test, and lets file names and line numbers be
 * worked out later, when someone asks (_stack_frames).
 *
 * Memory is bounded: at most `max_stacks` stacks of at most `max_depth`
 * frames.  Past that, new stacks get the id of a shared "overflow" record and
 * are counted.  All state is guarded by the GIL: capture runs only in threads
 * that hold it (no GIL, no stack).
 *
 * C++ frames (torch's stacks="all"): with a gatherer set (_stacks_cpp, torch's
 * own unwinder), each capture also takes the native stack as an opaque object
 * and records it beside the interned Python stack, one record per capture (C++
 * stacks are not interned: comparing them would cost what unwinding costs).
 * Those records take ids with CPP_BIT set in the index; at most `max_stacks`
 * of them, past which captures get the Python stack alone.  Symbols are looked
 * up once, when the frames are first asked for.
 */
#include "history_glue.h"

#if PY_VERSION_HEX < 0x030B0000
/* Before 3.11, Python.h does not declare PyFrame_GetBack (it lives in
 * frameobject.h).  Without this include C falls back to an implicit
 * `int PyFrame_GetBack()`, which cuts the returned pointer to 32 bits: the
 * first walk to a caller's frame then dereferences garbage (the 3.9/3.10
 * segfault).  setup.py makes implicit declarations an error so this cannot
 * come back silently. */
#include <frameobject.h>
#endif

#include <stdatomic.h>
#include <string.h>

#include "gpumem/array.h"

typedef struct {
    PyCodeObject *code; /* strong reference (pool) or borrowed (scratch) */
    int lasti;          /* byte offset of the current instruction */
} frame_key;

typedef struct {
    uint64_t hash;
    uint32_t first; /* index into pool */
    uint32_t depth;
} stack_rec;

enum {
    DEFAULT_MAX_DEPTH = 64,
    HARD_MAX_DEPTH = 1024
};

static atomic_int stacks_on;
static size_t max_stacks = 1u << 16;
static size_t max_depth = DEFAULT_MAX_DEPTH;

static frame_key *pool;
static size_t pool_len, pool_cap;
static stack_rec *stacks;
static size_t n_stacks, cap_stacks;
static uint32_t *table;  /* stack index + 1; 0 = empty slot */
static size_t table_cap; /* power of two */
static uint32_t generation = 1;

/* C++ frames: one record per capture while a gatherer is set. */
typedef struct {
    uint32_t py;      /* the interned Python stack's index */
    PyObject *native; /* the gatherer's result until symbolized, then NULL */
    PyObject *frames; /* the symbolized frames (a list of dicts), or NULL */
} cpp_rec;

#define CPP_BIT 0x80000000u
static PyObject *cpp_gather, *cpp_symbolize; /* both NULL: no C++ frames */
static cpp_rec *cpp_recs;
static size_t n_cpp, cap_cpp;
static uint64_t n_cpp_overflow;
static uint64_t n_captured, n_new, n_overflow, n_truncated;
static atomic_ullong n_no_gil;

/* Ids: tag | generation (23 bits) << 32 | stack index.  The generation changes
 * when the table is cleared, so ids handed out before resolve to nothing
 * instead of to some newer stack.  Bits 55..62 stay clear for a framework tag
 * (GM_CTX_FRAMEWORK_MASK), which lookups ignore. */
#define GEN_MASK       0x7fffffu
#define OVERFLOW_INDEX UINT32_MAX

static uint64_t make_id(uint32_t index) { return GM_PYCTX_TAG | ((uint64_t)(generation & GEN_MASK) << 32) | index; }

static uint64_t mix(uint64_t h, uint64_t v) {
    h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return h * 0xff51afd7ed558ccdull;
}

static uint64_t hash_frames(const frame_key *f, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull ^ n;
    for (size_t i = 0; i < n; i++) {
        h = mix(h, (uint64_t)(uintptr_t)f[i].code);
        h = mix(h, (uint64_t)(uint32_t)f[i].lasti);
    }
    return h ? h : 1;
}

static int same(const stack_rec *r, const frame_key *f, size_t n) {
    if (r->depth != n) return 0;
    const frame_key *p = pool + r->first;
    for (size_t i = 0; i < n; i++)
        if (p[i].code != f[i].code || p[i].lasti != f[i].lasti) return 0;
    return 1;
}

static int table_grow(void) {
    size_t ncap = table_cap ? 2 * table_cap : 1024;
    uint32_t *nt = calloc(ncap, sizeof *nt);
    if (!nt) return -1;
    for (size_t i = 0; i < n_stacks; i++) {
        size_t j = (size_t)stacks[i].hash & (ncap - 1);
        while (nt[j]) j = (j + 1) & (ncap - 1);
        nt[j] = (uint32_t)i + 1;
    }
    free(table);
    table = nt;
    table_cap = ncap;
    return 0;
}

/* Store a new stack; returns its index, or OVERFLOW_INDEX when full or out of memory. */
static uint32_t intern_new(uint64_t h, const frame_key *f, size_t n, size_t slot) {
    if (n_stacks >= max_stacks || n_stacks >= CPP_BIT - 1) return OVERFLOW_INDEX;
    if (pool_len + n > pool_cap) {
        size_t ncap = pool_cap ? 2 * pool_cap : 4096;
        while (ncap < pool_len + n) ncap *= 2;
        frame_key *np = realloc(pool, ncap * sizeof *np);
        if (!np) return OVERFLOW_INDEX;
        pool = np;
        pool_cap = ncap;
    }
    if (n_stacks == cap_stacks) {
        stack_rec *ns = gm_array_grow(stacks, &cap_stacks, 1024, sizeof *ns);
        if (!ns) return OVERFLOW_INDEX;
        stacks = ns;
    }
    for (size_t i = 0; i < n; i++) {
        Py_INCREF(f[i].code);
        pool[pool_len + i] = f[i];
    }
    uint32_t idx = (uint32_t)n_stacks++;
    stacks[idx] = (stack_rec){h, (uint32_t)pool_len, (uint32_t)n};
    pool_len += n;
    table[slot] = idx + 1;
    n_new++;
    /* Keep the load under one half so probes stay short. */
    if (2 * n_stacks > table_cap) table_grow(); /* on failure the table is just fuller; still correct */
    return idx;
}

static uint32_t intern(const frame_key *f, size_t n) {
    if (!table && table_grow() < 0) return OVERFLOW_INDEX;
    uint64_t h = hash_frames(f, n);
    size_t j = (size_t)h & (table_cap - 1);
    for (;;) {
        uint32_t e = table[j];
        if (!e) return intern_new(h, f, n, j);
        const stack_rec *r = &stacks[e - 1];
        if (r->hash == h && same(r, f, n)) return e - 1;
        j = (j + 1) & (table_cap - 1);
    }
}

/* The record of Python stack `py` with the caller's native stack: its index
 * with CPP_BIT, or `py` alone when the table is full or the gatherer fails, or
 * GONE when the gatherer cleared the table (py names nothing then).  The
 * gatherer is Python code that may capture (a nested allocation: another
 * record) or clear the table, so every check on the table comes after it. */
#define GONE (OVERFLOW_INDEX - 1)
static uint32_t with_native(uint32_t py) {
    uint32_t gen = generation;
    PyObject *gather = cpp_gather;
    Py_INCREF(gather); /* the gatherer may replace itself */
    /* gather(python=False, script=False, cpp=True) */
    PyObject *native = PyObject_CallFunctionObjArgs(gather, Py_False, Py_False, Py_True, NULL);
    Py_DECREF(gather);
    if (!native) PyErr_Clear();
    if (generation != gen) {
        Py_XDECREF(native);
        return GONE;
    }
    if (native && n_cpp < max_stacks && n_cpp < CPP_BIT - 2 && n_cpp == cap_cpp) {
        cpp_rec *a = gm_array_grow(cpp_recs, &cap_cpp, 1024, sizeof *a);
        if (a) cpp_recs = a;
    }
    if (!native || n_cpp >= max_stacks || n_cpp >= CPP_BIT - 2 || n_cpp == cap_cpp) {
        n_cpp_overflow++;
        Py_XDECREF(native); /* may run Python code: nothing of the table is held here */
        return generation == gen ? py : GONE;
    }
    cpp_recs[n_cpp] = (cpp_rec){py, native, NULL};
    return (uint32_t)n_cpp++ | CPP_BIT;
}

static int frame_lasti(PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(f);
#else
    /* Before 3.11 there is no public lasti; the line number keys the frame instead. */
    return PyFrame_GetLineNumber(f);
#endif
}

uint64_t gm_py_capture_context(void) {
    if (!atomic_load_explicit(&stacks_on, memory_order_relaxed)) return 0;
    if (!Py_IsInitialized() || !PyGILState_Check()) {
        atomic_fetch_add_explicit(&n_no_gil, 1, memory_order_relaxed);
        return 0;
    }
    PyFrameObject *f = PyEval_GetFrame(); /* borrowed */
    if (!f) return 0;
    frame_key scratch[HARD_MAX_DEPTH];
    size_t n = 0;
    Py_INCREF(f);
    while (f && n < max_depth) {
        PyCodeObject *code = PyFrame_GetCode(f);
        /* The frame chain keeps the code alive until we return; the pool takes
         * its own reference if this stack is new. */
        scratch[n].code = code;
        scratch[n].lasti = frame_lasti(f);
        Py_DECREF(code);
        n++;
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    if (f) {
        n_truncated++;
        Py_DECREF(f);
    }
    n_captured++;
    uint32_t idx = intern(scratch, n);
    if (idx == OVERFLOW_INDEX)
        n_overflow++;
    else if (cpp_gather)
        idx = with_native(idx);
    return idx == GONE ? 0 : make_id(idx);
}

int gm_py_finalizing(void) {
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

uint64_t gm_py_capture_context_reacquire(void) {
    if (!atomic_load_explicit(&stacks_on, memory_order_relaxed)) return 0;
    if (!Py_IsInitialized() || gm_py_finalizing()) {
        atomic_fetch_add_explicit(&n_no_gil, 1, memory_order_relaxed);
        return 0;
    }
    if (PyGILState_Check()) return gm_py_capture_context();
    /* PyGILState_Ensure would make a thread state for a thread Python never
     * saw, only to find no frame in it: skip those without touching Python. */
    if (PyGILState_GetThisThreadState() == NULL) {
        atomic_fetch_add_explicit(&n_no_gil, 1, memory_order_relaxed);
        return 0;
    }
    PyGILState_STATE st = PyGILState_Ensure();
    uint64_t id = gm_py_capture_context();
    PyGILState_Release(st);
    return id;
}

/* ---- Python-facing functions ------------------------------------------------ */

static PyObject *py_stacks_enable(PyObject *Py_UNUSED(m), PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"enabled", "max_depth", "max_stacks", NULL};
    int enabled;
    Py_ssize_t depth = -1, nmax = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "p|nn:_stacks_enable", kwlist, &enabled, &depth, &nmax)) return NULL;
    if (depth != -1) {
        if (depth < 1 || depth > HARD_MAX_DEPTH)
            return PyErr_Format(PyExc_ValueError, "max_depth must be in 1..%d, not %zd", HARD_MAX_DEPTH, depth);
        max_depth = (size_t)depth;
    }
    if (nmax != -1) {
        if (nmax < 1 || (uint64_t)nmax >= UINT32_MAX)
            return PyErr_Format(PyExc_ValueError, "max_stacks must be in 1..2**32-2, not %zd", nmax);
        max_stacks = (size_t)nmax;
    }
    atomic_store(&stacks_on, enabled);
    Py_RETURN_NONE;
}

static PyObject *py_capture(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    return PyLong_FromUnsignedLongLong(gm_py_capture_context());
}

static PyObject *attr_or_none(PyObject *o, const char *name) {
    PyObject *v = PyObject_GetAttrString(o, name);
    if (!v) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return v;
}

static PyObject *cpp_frames(uint32_t i);
static PyObject *python_frames(uint32_t idx);

/* _stack_frames(ctx) -> list of {"filename", "name", "line"}, innermost first
 * (torch's order), or None if ctx is no id of this table. */
static PyObject *py_stack_frames(PyObject *Py_UNUSED(m), PyObject *ctx_o) {
    unsigned long long ctx = PyLong_AsUnsignedLongLong(ctx_o);
    if (ctx == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (!(ctx & GM_PYCTX_TAG) || ((ctx >> 32) & GEN_MASK) != (generation & GEN_MASK)) Py_RETURN_NONE;
    uint32_t idx = (uint32_t)ctx;
    if (idx == OVERFLOW_INDEX) {
        PyObject *l = PyList_New(1);
        PyObject *d = l ? Py_BuildValue("{s:s,s:s,s:i}", "filename", "??", "name",
                                        "<stack table full: raise max_stacks>", "line", 0)
                        : NULL;
        if (!d) {
            Py_XDECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, 0, d);
        return l;
    }
    if (idx & CPP_BIT) return cpp_frames(idx & ~CPP_BIT);
    return python_frames(idx);
}

/* How many of the innermost native frames are the capture's own: the
 * unwinder's and this file's, through the last of with_native and
 * gm_py_capture_context* among the first few (symbols may be missing).  The
 * frames are the symbolizer's: a key's __eq__ may change the list meanwhile. */
static Py_ssize_t own_frames(PyObject *frames) {
    Py_ssize_t own = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(frames) && i < 24; i++) {
        PyObject *d = PyList_GET_ITEM(frames, i);
        Py_INCREF(d);
        PyObject *name = PyDict_Check(d) ? PyDict_GetItemString(d, "name") : NULL;
        Py_XINCREF(name);
        const char *c = name && PyUnicode_Check(name) ? PyUnicode_AsUTF8(name) : NULL;
        if (!c)
            PyErr_Clear();
        else if (strcmp(c, "with_native") == 0 || strncmp(c, "gm_py_capture_context", 21) == 0)
            own = i + 1;
        Py_XDECREF(name);
        Py_DECREF(d);
    }
    return own;
}

/* The native frames of `native` (a gatherer's result), symbolized, less the
 * capture's own; a new list, or NULL.  Runs Python code: holds nothing of the table. */
static PyObject *symbolize(PyObject *native) {
    PyObject *one = PyList_New(1), *fn = cpp_symbolize, *got = NULL, *frames = NULL;
    if (!one || !fn) {
        Py_XDECREF(one);
        return one ? PyErr_Format(PyExc_RuntimeError, "no C++ frame symbolizer is set") : NULL;
    }
    Py_INCREF(native);
    PyList_SET_ITEM(one, 0, native);
    Py_INCREF(fn);
    got = PyObject_CallFunctionObjArgs(fn, one, NULL);
    Py_DECREF(fn);
    Py_DECREF(one);
    if (!got) return NULL;
    PyObject *first = PyList_Check(got) && PyList_GET_SIZE(got) == 1 ? PyList_GET_ITEM(got, 0) : NULL;
    if (first && PyList_Check(first)) {
        Py_INCREF(first);
        /* The unwinder's own frames, up to the capture here, say nothing. */
        Py_ssize_t skip = own_frames(first);
        frames = PyList_GetSlice(first, skip, PyList_GET_SIZE(first));
        Py_DECREF(first);
    } else {
        PyErr_Format(PyExc_TypeError, "the C++ frame symbolizer returned no list of frames");
    }
    Py_DECREF(got);
    return frames;
}

/* The symbolized native frames of C++ record i, then its Python frames.  The
 * symbolizer may capture (growing cpp_recs) or clear the table: the record is
 * read again by index after it, and an id the table no longer holds gives None. */
static PyObject *cpp_frames(uint32_t i) {
    if (i >= n_cpp) Py_RETURN_NONE;
    uint32_t gen = generation, py = cpp_recs[i].py;
    PyObject *frames = cpp_recs[i].frames;
    if (frames) {
        Py_INCREF(frames);
    } else {
        PyObject *native = cpp_recs[i].native;
        Py_INCREF(native);
        frames = symbolize(native);
        Py_DECREF(native);
        if (!frames) return NULL;
        if (generation != gen || i >= n_cpp) {
            Py_DECREF(frames);
            Py_RETURN_NONE;
        }
        if (!cpp_recs[i].frames) { /* else a nested call symbolized it first */
            Py_INCREF(frames);
            cpp_recs[i].frames = frames;
            Py_CLEAR(cpp_recs[i].native); /* may run Python code */
        }
    }
    PyObject *pyf = generation == gen ? python_frames(py) : (Py_INCREF(Py_None), Py_None);
    PyObject *all = !pyf ? NULL : pyf == Py_None ? PySequence_List(frames) : PySequence_Concat(frames, pyf);
    Py_XDECREF(pyf);
    Py_DECREF(frames);
    return all;
}

/* The frames of interned Python stack idx, innermost first, or None.  Making
 * the frames' objects may run the garbage collector, whose callbacks may
 * capture (growing the pool) or clear the table: the stack's frames are
 * copied out first, each code object held. */
static PyObject *python_frames(uint32_t idx) {
    if (idx >= n_stacks) Py_RETURN_NONE;
    uint32_t depth = stacks[idx].depth;
    frame_key *keys = PyMem_Malloc((depth ? depth : 1) * sizeof *keys);
    if (!keys) return PyErr_NoMemory();
    memcpy(keys, pool + stacks[idx].first, depth * sizeof *keys);
    for (uint32_t i = 0; i < depth; i++) Py_INCREF(keys[i].code);
    PyObject *l = PyList_New(depth);
    for (uint32_t i = 0; l && i < depth; i++) {
#if PY_VERSION_HEX >= 0x030B0000
        int line = PyCode_Addr2Line(keys[i].code, keys[i].lasti);
#else
        int line = keys[i].lasti;
#endif
        PyObject *fn = attr_or_none((PyObject *)keys[i].code, "co_filename");
        PyObject *nm = attr_or_none((PyObject *)keys[i].code, "co_name");
        PyObject *d = Py_BuildValue("{s:N,s:N,s:i}", "filename", fn, "name", nm, "line", line);
        if (!d) Py_CLEAR(l);
        if (l) PyList_SET_ITEM(l, i, d);
    }
    for (uint32_t i = 0; i < depth; i++) Py_DECREF(keys[i].code);
    PyMem_Free(keys);
    return l;
}

/* Empty the tables, then drop what they held.  Dropping a reference may run
 * Python code (a native stack's __del__, a weak reference's callback on a
 * code object) that takes stacks or clears again: by then the tables are
 * empty and new, and the old arrays are this call's alone. */
static void clear_table(void) {
    cpp_rec *recs = cpp_recs;
    frame_key *old_pool = pool;
    size_t n_recs = n_cpp, n_frames = pool_len;
    free(stacks);
    free(table);
    cpp_recs = NULL;
    pool = NULL;
    stacks = NULL;
    table = NULL;
    n_cpp = cap_cpp = 0;
    n_cpp_overflow = 0;
    pool_len = pool_cap = n_stacks = cap_stacks = table_cap = 0;
    n_captured = n_new = n_overflow = n_truncated = 0;
    atomic_store(&n_no_gil, 0);
    generation++;
    for (size_t i = 0; i < n_recs; i++) {
        Py_XDECREF(recs[i].native);
        Py_XDECREF(recs[i].frames);
    }
    free(recs);
    for (size_t i = 0; i < n_frames; i++) Py_DECREF(old_pool[i].code);
    free(old_pool);
}

/* _stacks_cpp(gather, symbolize): take the native stack too, through torch's
 * gather_traceback and symbolize_tracebacks; _stacks_cpp(None, None) stops. */
static PyObject *py_stacks_cpp(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *gather, *symbolize;
    if (!PyArg_ParseTuple(args, "OO:_stacks_cpp", &gather, &symbolize)) return NULL;
    if ((gather == Py_None) != (symbolize == Py_None))
        return PyErr_Format(PyExc_TypeError, "_stacks_cpp takes two callables, or None twice");
    if (gather != Py_None && (!PyCallable_Check(gather) || !PyCallable_Check(symbolize)))
        return PyErr_Format(PyExc_TypeError, "_stacks_cpp takes two callables, or None twice");
    /* The new pair first, the old one dropped after: its __del__ may set another. */
    PyObject *old_gather = cpp_gather, *old_symbolize = cpp_symbolize;
    cpp_gather = cpp_symbolize = NULL;
    if (gather != Py_None) {
        Py_INCREF(gather);
        Py_INCREF(symbolize);
        cpp_gather = gather;
        cpp_symbolize = symbolize;
    }
    Py_XDECREF(old_gather);
    Py_XDECREF(old_symbolize);
    Py_RETURN_NONE;
}

static PyObject *py_stacks_clear(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    clear_table();
    Py_RETURN_NONE;
}

static PyObject *py_stacks_info(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    size_t bytes = pool_cap * sizeof *pool + cap_stacks * sizeof *stacks + table_cap * sizeof *table;
    bytes += cap_cpp * sizeof *cpp_recs;
    return Py_BuildValue("{s:O,s:n,s:O,s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:K,s:K,s:K,s:K}", "cpp",
                         cpp_gather ? Py_True : Py_False, "native_stacks", (Py_ssize_t)n_cpp, "enabled",
                         atomic_load(&stacks_on) ? Py_True : Py_False, "stacks", (Py_ssize_t)n_stacks, "frames",
                         (Py_ssize_t)pool_len, "max_stacks", (Py_ssize_t)max_stacks, "max_depth", (Py_ssize_t)max_depth,
                         "table_bytes", (Py_ssize_t)bytes, "captured", (unsigned long long)n_captured, "new",
                         (unsigned long long)n_new, "overflow", (unsigned long long)n_overflow, "truncated",
                         (unsigned long long)n_truncated, "no_gil", (unsigned long long)atomic_load(&n_no_gil),
                         "native_overflow", (unsigned long long)n_cpp_overflow);
}

static PyMethodDef glue_methods[] = {
    {.ml_name = "_stacks_enable",
     .ml_meth = (PyCFunction)(void (*)(void))py_stacks_enable,
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "_stacks_enable(enabled, max_depth=None, max_stacks=None): capture Python stacks per malloc"},
    {.ml_name = "_stack_capture",
     .ml_meth = py_capture,
     .ml_flags = METH_NOARGS,
     .ml_doc = "_stack_capture() -> context id of the caller's stack (0 when capture is off)"},
    {.ml_name = "_stack_frames",
     .ml_meth = py_stack_frames,
     .ml_flags = METH_O,
     .ml_doc = "_stack_frames(ctx) -> [{filename, name, line}] innermost first, or None"},
    {.ml_name = "_stacks_cpp",
     .ml_meth = py_stacks_cpp,
     .ml_flags = METH_VARARGS,
     .ml_doc = "_stacks_cpp(gather, symbolize): also take each capture's C++ frames (None, None: stop)"},
    {.ml_name = "_stacks_clear",
     .ml_meth = py_stacks_clear,
     .ml_flags = METH_NOARGS,
     .ml_doc = "drop every interned stack; ids handed out before resolve to None"},
    {.ml_name = "_stacks_info",
     .ml_meth = py_stacks_info,
     .ml_flags = METH_NOARGS,
     .ml_doc = "_stacks_info() -> dict of the stack table's size and counters"},
    {.ml_name = NULL},
};

int gm_history_glue_add(PyObject *module) { return PyModule_AddFunctions(module, glue_methods); }
