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
 * With C++ frames on (torch's stacks="all"), a stack starts with the native
 * return addresses of the calling thread (glibc's backtrace), innermost first,
 * as torch's own traces do; they are named when asked (dladdr, demangled by
 * the C++ runtime's __cxa_demangle where the process has one).  A native frame
 * is a frame_key with no code object.
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

#if defined(__linux__) || defined(__APPLE__)
#include <dlfcn.h>
#include <execinfo.h>
#define GM_NATIVE_STACKS 1
#endif

#include "gpumem/array.h"

typedef struct {
    PyCodeObject *code; /* strong reference (pool) or borrowed (scratch); NULL: a native frame */
    int lasti;          /* byte offset of the current instruction */
    uintptr_t pc;       /* a native frame's return address */
} frame_key;

typedef struct {
    uint64_t hash;
    uint32_t first; /* index into pool */
    uint32_t depth;
} stack_rec;

enum {
    DEFAULT_MAX_DEPTH = 64,
    HARD_MAX_DEPTH = 1024,
    MAX_NATIVE = 64 /* native frames per stack */
};

static atomic_int stacks_on;
static atomic_int native_on; /* C++ frames too */
static size_t max_stacks = 1u << 16;
static size_t max_depth = DEFAULT_MAX_DEPTH;

static frame_key *pool;
static size_t pool_len, pool_cap;
static stack_rec *stacks;
static size_t n_stacks, cap_stacks;
static uint32_t *table;  /* stack index + 1; 0 = empty slot */
static size_t table_cap; /* power of two */
static uint32_t generation = 1;
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
        h = mix(h, (uint64_t)f[i].pc);
    }
    return h ? h : 1;
}

static int same(const stack_rec *r, const frame_key *f, size_t n) {
    if (r->depth != n) return 0;
    const frame_key *p = pool + r->first;
    for (size_t i = 0; i < n; i++)
        if (p[i].code != f[i].code || p[i].lasti != f[i].lasti || p[i].pc != f[i].pc) return 0;
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
    if (n_stacks >= max_stacks || n_stacks >= UINT32_MAX - 1) return OVERFLOW_INDEX;
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
        Py_XINCREF(f[i].code);
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

static int frame_lasti(PyFrameObject *f) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFrame_GetLasti(f);
#else
    /* Before 3.11 there is no public lasti; the line number keys the frame instead. */
    return PyFrame_GetLineNumber(f);
#endif
}

/* The calling thread's native return addresses into f, innermost first,
 * without this function's own frame. */
static size_t native_frames(frame_key *f) {
#ifdef GM_NATIVE_STACKS
    void *pcs[MAX_NATIVE + 1];
    int n = backtrace(pcs, MAX_NATIVE + 1);
    for (int i = 1; i < n; i++) f[i - 1] = (frame_key){NULL, 0, (uintptr_t)pcs[i]};
    return n > 1 ? (size_t)(n - 1) : 0;
#else
    (void)f;
    return 0;
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
    frame_key scratch[MAX_NATIVE + HARD_MAX_DEPTH];
    size_t n = atomic_load_explicit(&native_on, memory_order_relaxed) ? native_frames(scratch) : 0;
    size_t depth = n + max_depth;
    Py_INCREF(f);
    while (f && n < depth) {
        PyCodeObject *code = PyFrame_GetCode(f);
        /* The frame chain keeps the code alive until we return; the pool takes
         * its own reference if this stack is new. */
        scratch[n].code = code;
        scratch[n].lasti = frame_lasti(f);
        scratch[n].pc = 0;
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
    if (idx == OVERFLOW_INDEX) n_overflow++;
    return make_id(idx);
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
    static char *kwlist[] = {"enabled", "max_depth", "max_stacks", "cpp", NULL};
    int enabled, cpp = 0;
    Py_ssize_t depth = -1, nmax = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "p|nnp:_stacks_enable", kwlist, &enabled, &depth, &nmax, &cpp))
        return NULL;
#ifndef GM_NATIVE_STACKS
    cpp = 0; /* no native frames on this platform: Python frames only (_stacks_info says so) */
#endif
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
    atomic_store(&native_on, enabled && cpp);
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

/* {"filename", "name", "line"} of the native frame at return address pc: the
 * shared object, and the symbol's demangled name ("??" where none is known).
 * *own: the frame is gpumem's capture itself (gm_py_capture_context...). */
static PyObject *native_frame_dict(uintptr_t pc, int *own) {
    *own = 0;
    const char *file = "??", *name = NULL;
    char *demangled = NULL;
#ifdef GM_NATIVE_STACKS
    typedef char *(*demangle_fn)(const char *, char *, size_t *, int *);
    static demangle_fn demangle;
    static int looked;
    if (!looked) {
        looked = 1;
        void *sym = dlsym(RTLD_DEFAULT, "__cxa_demangle"); /* the C++ runtime's, if loaded */
        memcpy(&demangle, &sym, sizeof sym);
    }
    Dl_info info;
    /* pc - 1: the call instruction, inside the calling function even when the call is its last one */
    if (dladdr((void *)(pc - 1), &info)) {
        if (info.dli_fname) file = info.dli_fname;
        name = info.dli_sname;
        *own = name && !strncmp(name, "gm_py_capture_context", 21);
        int status = -1;
        if (name && demangle) demangled = demangle(name, NULL, NULL, &status);
        if (status != 0) {
            free(demangled);
            demangled = NULL;
        }
    }
#else
    (void)pc;
#endif
    PyObject *d = Py_BuildValue("{s:s,s:s,s:i}", "filename", file, "name",
                                demangled ? demangled
                                : name    ? name
                                          : "??",
                                "line", 0);
    free(demangled);
    return d;
}

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
    if (idx >= n_stacks) Py_RETURN_NONE;
    const stack_rec *r = &stacks[idx];
    uint32_t i = 0;
    PyObject *l = PyList_New(0);
    if (!l) return NULL;
    /* Native frames first; gpumem's own capture frames lead them and are left out. */
    for (int leading = 1; i < r->depth && !pool[r->first + i].code; i++) {
        int own;
        PyObject *d = native_frame_dict(pool[r->first + i].pc, &own);
        if (d && !(leading && own) && PyList_Append(l, d) < 0) Py_CLEAR(d);
        if (!d) {
            Py_DECREF(l);
            return NULL;
        }
        leading = leading && own;
        Py_DECREF(d);
    }
    for (; i < r->depth; i++) {
        const frame_key *k = &pool[r->first + i];
#if PY_VERSION_HEX >= 0x030B0000
        int line = PyCode_Addr2Line(k->code, k->lasti);
#else
        int line = k->lasti;
#endif
        PyObject *fn = attr_or_none((PyObject *)k->code, "co_filename");
        PyObject *nm = attr_or_none((PyObject *)k->code, "co_name");
        PyObject *d = Py_BuildValue("{s:N,s:N,s:i}", "filename", fn, "name", nm, "line", line);
        if (!d || PyList_Append(l, d) < 0) {
            Py_XDECREF(d);
            Py_DECREF(l);
            return NULL;
        }
        Py_DECREF(d);
    }
    return l;
}

static void clear_table(void) {
    for (size_t i = 0; i < pool_len; i++) Py_XDECREF(pool[i].code);
    free(pool);
    free(stacks);
    free(table);
    pool = NULL;
    stacks = NULL;
    table = NULL;
    pool_len = pool_cap = n_stacks = cap_stacks = table_cap = 0;
    n_captured = n_new = n_overflow = n_truncated = 0;
    atomic_store(&n_no_gil, 0);
    generation++;
}

static PyObject *py_stacks_clear(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    clear_table();
    Py_RETURN_NONE;
}

static PyObject *py_stacks_info(PyObject *Py_UNUSED(m), PyObject *Py_UNUSED(ignored)) {
    size_t bytes = pool_cap * sizeof *pool + cap_stacks * sizeof *stacks + table_cap * sizeof *table;
    return Py_BuildValue("{s:O,s:O,s:n,s:n,s:n,s:n,s:n,s:K,s:K,s:K,s:K,s:K}", "enabled",
                         atomic_load(&stacks_on) ? Py_True : Py_False, "cpp",
                         atomic_load(&native_on) ? Py_True : Py_False, "stacks", (Py_ssize_t)n_stacks, "frames",
                         (Py_ssize_t)pool_len, "max_stacks", (Py_ssize_t)max_stacks, "max_depth", (Py_ssize_t)max_depth,
                         "table_bytes", (Py_ssize_t)bytes, "captured", (unsigned long long)n_captured, "new",
                         (unsigned long long)n_new, "overflow", (unsigned long long)n_overflow, "truncated",
                         (unsigned long long)n_truncated, "no_gil", (unsigned long long)atomic_load(&n_no_gil));
}

static PyMethodDef glue_methods[] = {
    {.ml_name = "_stacks_enable",
     .ml_meth = (PyCFunction)(void (*)(void))py_stacks_enable,
     .ml_flags = METH_VARARGS | METH_KEYWORDS,
     .ml_doc = "_stacks_enable(enabled, max_depth=None, max_stacks=None, cpp=False): capture Python stacks per "
               "malloc (cpp: preceded by the native frames, as torch's stacks='all')"},
    {.ml_name = "_stack_capture",
     .ml_meth = py_capture,
     .ml_flags = METH_NOARGS,
     .ml_doc = "_stack_capture() -> context id of the caller's stack (0 when capture is off)"},
    {.ml_name = "_stack_frames",
     .ml_meth = py_stack_frames,
     .ml_flags = METH_O,
     .ml_doc = "_stack_frames(ctx) -> [{filename, name, line}] innermost first, or None"},
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
