/*
 * config_glue.c -- heap options from Python values: the conversion every
 * binding shares (gpumem.Heap(...), the torch allocator's options),
 * check_option(), and torch_options(), which reads install()'s and
 * GPUMEM_CONF's options once for gpumem.torch (OPTION_NAMES, MAX_HISTORY).
 * The ranges and their messages are the core's (core/config.c).
 */
#include "config_glue.h"

#include <math.h>
#include <stdarg.h>
#include <string.h>

#include "convert.h"
#include "heap_object.h"

int gm_py_config_option(gm_config *cfg, gm_option opt, const char *keyword, PyObject *value) {
    if (value == NULL) return 0;
    gm_config defaults;
    gm_config_default(&defaults);
    size_t count = 0;
    double fraction = 0.0;
    if (value == Py_None) {
        gm_config_get(&defaults, opt, &count, &fraction);
    } else if (gm_option_is_fraction(opt)) {
        fraction = PyFloat_AsDouble(value);
        if (fraction == -1.0 && PyErr_Occurred()) return -1;
    } else if (opt == GM_OPT_SPILL_CHOICE && PyUnicode_Check(value)) { /* "old" or "new" */
        const char *v = PyUnicode_AsUTF8(value);
        if (v == NULL) return -1;
        count = !strcmp(v, "old")       ? GM_SPILL_OLD
                : !strcmp(v, "new")     ? GM_SPILL_NEW
                : !strcmp(v, "lasting") ? GM_SPILL_LASTING
                                        : (size_t)-1;
        if (count == (size_t)-1) {
            PyErr_Format(PyExc_ValueError, "spill_choice must be \"old\", \"new\" or \"lasting\", got '%s'", v);
            return -1;
        }
    } else if (opt == GM_OPT_SPILL && PyUnicode_Check(value) && PyUnicode_CompareWithASCIIString(value, "off") == 0) {
        count = 0;                                                                        /* spill off, as 0 */
    } else if (opt == GM_OPT_VA_SIZE || opt == GM_OPT_CAP_BYTES || opt == GM_OPT_SPILL) { /* bytes: "24GiB" too */
        if (gm_py_to_size_or_str(value, keyword, &count) < 0) return -1;
    } else if (gm_py_to_size(value, keyword, &count) < 0) {
        return -1;
    }
    char err[256];
    if (gm_config_set(cfg, opt, count, fraction, err, sizeof err) == GM_OK) return 0;
    PyErr_SetString(PyExc_ValueError, err);
    return -1;
}

/* 0 if value is a valid `name` ("chunk_pages", "page_size", ...), else -1 with
 * a ValueError carrying the core's message (or the conversion's error). */
static int check_one(const char *name, PyObject *value) {
    if (strcmp(name, "page_size") == 0) {
        size_t page = 0;
        char err[256];
        if (gm_py_to_size_or_str(value, name, &page) < 0) return -1;
        if (gm_check_page_size(page, err, sizeof err) == GM_OK) return 0;
        PyErr_SetString(PyExc_ValueError, err);
        return -1;
    }
    int opt = gm_option_find(name);
    if (opt < 0) {
        PyErr_Format(PyExc_ValueError, "unknown heap option '%s'", name);
        return -1;
    }
    gm_config cfg;
    gm_config_default(&cfg);
    return gm_py_config_option(&cfg, (gm_option)opt, name, value);
}

/* check_option(name, value): None if value is a valid `name`, else ValueError with the core's message. */
static PyObject *check_option(PyObject *Py_UNUSED(m), PyObject *args) {
    const char *name;
    PyObject *value;
    if (!PyArg_ParseTuple(args, "sO:check_option", &name, &value)) return NULL;
    if (check_one(name, value) < 0) return NULL;
    Py_RETURN_NONE;
}

/* gm_conf_parse's item(): into the dict; -1 when Python raised. */
static int put_item(const char *key, const char *value, void *dict) {
    PyObject *v = PyUnicode_FromString(value);
    int rc = v ? PyDict_SetItemString((PyObject *)dict, key, v) : -1;
    Py_XDECREF(v);
    return rc < 0 ? -1 : GM_OK;
}

/* parse_conf(text, known, source) -> {key: value} (strings): the core's
 * reading of GPUMEM_CONF's text; ValueError with its message. */
static PyObject *parse_conf(PyObject *Py_UNUSED(m), PyObject *args) {
    const char *text, *source;
    PyObject *known_o;
    if (!PyArg_ParseTuple(args, "sOs:parse_conf", &text, &known_o, &source)) return NULL;
    PyObject *seq = PySequence_Fast(known_o, "known must be a sequence of option names");
    if (seq == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    const char **known = PyMem_Calloc(n ? (size_t)n : 1, sizeof *known);
    PyObject *dict = known ? PyDict_New() : PyErr_NoMemory();
    for (Py_ssize_t i = 0; dict && i < n; i++)
        if (!(known[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i)))) Py_CLEAR(dict);
    if (dict) {
        char err[1024] = "";
        int rc = gm_conf_parse(text, source, known, (size_t)n, put_item, dict, err, sizeof err);
        if (rc != GM_OK) {
            Py_CLEAR(dict);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, err);
        }
    }
    PyMem_Free(known);
    Py_DECREF(seq);
    return dict;
}

/* ---- gpumem.torch's options: install(**options) and GPUMEM_CONF, checked once here ---- */

static const char *const torch_option_names[] = {
    "cap", "growth_slack", "growth_slack_pages", "pressure",       "chunk_pages",  "page_size", "va_size", "history",
    "oom", "spill",        "spill_choice",       "stream_handoff", "split_chunks",
};
#define N_TORCH_OPTIONS (sizeof torch_option_names / sizeof torch_option_names[0])
#define MAX_HISTORY     (1L << 20) /* history entries a torch heap may keep */

/* What one call of torch_options works with: the options given, the keyword
 * arguments it makes, and the class its errors are raised as. */
typedef struct {
    PyObject *options, *kw, *error;
} opt_ctx;

/* Raise ctx->error(key, value, reason), reason made from fmt.  Returns NULL. */
static PyObject *opt_fail(const opt_ctx *c, const char *key, PyObject *value, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    PyObject *reason = PyUnicode_FromFormatV(fmt, ap);
    va_end(ap);
    PyObject *exc = reason ? PyObject_CallFunction(c->error, "sOO", key, value, reason) : NULL;
    if (exc) PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    Py_XDECREF(exc);
    Py_XDECREF(reason);
    return NULL;
}

/* The pending ValueError's text as ctx->error's reason; any other error is left as it is. */
static PyObject *opt_fail_with_error(const opt_ctx *c, const char *key, PyObject *value) {
    if (!PyErr_ExceptionMatches(PyExc_ValueError)) return NULL;
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyErr_NormalizeException(&type, &exc, &tb);
    PyObject *why = exc ? PyObject_Str(exc) : NULL;
    Py_XDECREF(type);
    Py_XDECREF(exc);
    Py_XDECREF(tb);
    if (why == NULL) return NULL;
    opt_fail(c, key, value, "%U", why);
    Py_DECREF(why);
    return NULL;
}

/* -1, 0 or 1 as a <op> b for an int a and the C long b; -1 with an error set. */
static int long_cmp(PyObject *a, long b, int op) {
    PyObject *bo = PyLong_FromLong(b);
    int r = bo ? PyObject_RichCompareBool(a, bo, op) : -1;
    Py_XDECREF(bo);
    return r;
}

/* A size: an int, or a string gpumem._units.parse_size reads ("8GiB"), in [0, 2**64).  New reference. */
static PyObject *opt_size(const opt_ctx *c, const char *what, PyObject *value) {
    PyObject *n = NULL;
    if (PyBool_Check(value)) return opt_fail(c, what, value, "not a size");
    if (PyLong_Check(value)) {
        Py_INCREF(value);
        n = value;
    } else if (PyUnicode_Check(value)) {
        PyObject *units = PyImport_ImportModule("gpumem._units");
        n = units ? PyObject_CallMethod(units, "parse_size", "O", value) : NULL;
        Py_XDECREF(units);
        if (n == NULL) return opt_fail_with_error(c, what, value);
    } else {
        return opt_fail(c, what, value, "not a size (an int or a string such as '8GiB')");
    }
    int neg = long_cmp(n, 0, Py_LT);
    PyObject *max = neg == 0 ? PyLong_FromUnsignedLongLong(UINT64_MAX) : NULL;
    int big = max ? PyObject_RichCompareBool(n, max, Py_GT) : -1;
    Py_XDECREF(max);
    if (neg == 1) opt_fail(c, what, value, "%s must not be negative", what);
    if (neg == 0 && big == 1) opt_fail(c, what, value, "does not fit in 64 bits");
    if (neg != 0 || big != 0) Py_CLEAR(n);
    return n;
}

/* A whole number (as_int) or a float, from an int, a float or a string.  New reference. */
static PyObject *opt_number(const opt_ctx *c, const char *key, PyObject *value, int as_int) {
    const char *what = as_int ? "not a whole number" : "not a number";
    if (PyBool_Check(value) || !(PyLong_Check(value) || PyFloat_Check(value) || PyUnicode_Check(value)))
        return opt_fail(c, key, value, what);
    if (as_int && PyFloat_Check(value)) return opt_fail(c, key, value, what);
    PyObject *v = as_int ? PyNumber_Long(value) : PyNumber_Float(value);
    if (v == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ValueError)) return NULL;
        PyErr_Clear();
        return opt_fail(c, key, value, what);
    }
    if (!as_int && isnan(PyFloat_AS_DOUBLE(v))) {
        Py_DECREF(v);
        return opt_fail(c, key, value, what);
    }
    return v;
}

/* value once the core has checked it as option `key` (the core's message names `given`). */
static PyObject *opt_checked(const opt_ctx *c, const char *key, PyObject *given, PyObject *value) {
    if (value == NULL) return NULL;
    if (check_one(key, value) == 0) return value;
    Py_DECREF(value);
    return opt_fail_with_error(c, key, given);
}

/* kw[name] = value, the reference stolen.  0, or -1 with an error set. */
static int opt_put(const opt_ctx *c, const char *name, PyObject *value) {
    return value ? gm_py_put(c->kw, name, value) : -1;
}

/* options[key] when given and not None (borrowed), else NULL. */
static PyObject *opt_get(const opt_ctx *c, const char *key) {
    PyObject *v = PyDict_GetItemString(c->options, key);
    return v == Py_None ? NULL : v;
}

/* cap: a fraction of the device (a number up to 1), or bytes (an int, or a size with a unit). */
static int opt_cap(const opt_ctx *c) {
    PyObject *cap = opt_get(c, "cap");
    if (cap == NULL) return 0;
    PyObject *none = Py_BuildValue("(Oisss)", Py_None, 0, "0", "none", "");
    int off = none ? PySequence_Contains(none, cap) : -1;
    Py_XDECREF(none);
    if (off != 0) return off < 0 ? -1 : 0;
    int is_frac = PyFloat_Check(cap);
    if (!is_frac && PyLong_Check(cap) && !PyBool_Check(cap) && (is_frac = long_cmp(cap, 1, Py_LE)) < 0) return -1;
    double frac = 0.0;
    if (is_frac) {
        frac = PyFloat_AsDouble(cap);
        if (frac == -1.0 && PyErr_Occurred()) return -1;
        if (frac > 1)
            return opt_fail(c, "cap", cap, "a fraction of the device must lie in (0, 1]; bytes need a unit"), -1;
    } else if (PyUnicode_Check(cap)) { /* a bare number: a fraction, or ambiguous */
        PyObject *f = PyFloat_FromString(cap);
        if (f == NULL && !PyErr_ExceptionMatches(PyExc_ValueError)) return -1;
        PyErr_Clear();
        if (f) {
            is_frac = 1;
            frac = PyFloat_AS_DOUBLE(f);
            Py_DECREF(f);
            if (frac > 1)
                return opt_fail(c, "cap", cap,
                                "ambiguous: a number above 1 needs a unit (e.g. '60GiB' or '64424509440B'); "
                                "a fraction of the device lies in (0, 1]"),
                       -1;
        }
    }
    if (!is_frac) return opt_put(c, "cap_bytes", opt_size(c, "cap", cap));
    if (!(frac > 0.0 && frac <= 1.0)) return opt_fail(c, "cap", cap, "a fraction of the device must lie in (0, 1]"), -1;
    return opt_put(c, "cap_fraction", PyFloat_FromDouble(frac));
}

/* The heap's own options, each checked by the core. */
static int opt_heap(const opt_ctx *c) {
    static const struct {
        const char *key;
        int kind; /* 0: a size, 1: a whole number, 2: a number, 3: a word the core reads, 4: a size or "off" */
    } heap_opts[] = {
        {"va_size", 0},   {"growth_slack", 2}, {"growth_slack_pages", 1}, {"pressure", 2},       {"chunk_pages", 1},
        {"page_size", 0}, {"spill", 4},        {"spill_choice", 3},       {"stream_handoff", 1}, {"split_chunks", 1}};
    for (size_t i = 0; i < sizeof heap_opts / sizeof heap_opts[0]; i++) {
        const char *key = heap_opts[i].key;
        int kind = heap_opts[i].kind;
        PyObject *v = opt_get(c, key);
        if (v == NULL) continue;
        int off = kind == 4 && PyUnicode_Check(v) && PyUnicode_CompareWithASCIIString(v, "off") == 0;
        if (kind == 3) Py_INCREF(v);
        PyObject *n = off                      ? PyLong_FromLong(0)
                      : kind == 3              ? v
                      : kind == 1 || kind == 2 ? opt_number(c, key, v, kind == 1)
                                               : opt_size(c, key, v);
        if (opt_put(c, key, opt_checked(c, key, v, n)) < 0) return -1;
    }
    return 0;
}

/* history (entries, [0, MAX_HISTORY]) and oom ('torch' or 'runtime'). */
static int opt_torch(const opt_ctx *c) {
    PyObject *h = opt_get(c, "history"), *oom = opt_get(c, "oom");
    if (h) {
        PyObject *v = opt_number(c, "history", h, 1);
        int ok = v ? long_cmp(v, 0, Py_GE) : -1;
        if (ok == 1) ok = long_cmp(v, MAX_HISTORY, Py_LE);
        if (ok == 0) opt_fail(c, "history", h, "history must lie in [0, %ld]", MAX_HISTORY);
        if (ok != 1) {
            Py_XDECREF(v);
            return -1;
        }
        if (opt_put(c, "history_entries", v) < 0) return -1;
    }
    if (oom) {
        PyObject *modes = Py_BuildValue("(ss)", "torch", "runtime");
        int ok = modes ? PySequence_Contains(modes, oom) : -1;
        Py_XDECREF(modes);
        if (ok == 0) opt_fail(c, "oom", oom, "oom must be 'torch' or 'runtime'");
        if (ok != 1 || PyDict_SetItemString(c->kw, "oom_mode", oom) < 0) return -1;
    }
    return 0;
}

/* ValueError naming the options no one knows, sorted; 0 when there are none. */
static int opt_unknown(const opt_ctx *c) {
    PyObject *unknown = PyList_New(0), *key, *value;
    Py_ssize_t pos = 0;
    while (unknown && PyDict_Next(c->options, &pos, &key, &value)) {
        int known = 0;
        for (size_t i = 0; i < N_TORCH_OPTIONS && !known; i++)
            known = PyUnicode_Check(key) && PyUnicode_CompareWithASCIIString(key, torch_option_names[i]) == 0;
        if (!known && PyList_Append(unknown, key) < 0) Py_CLEAR(unknown);
    }
    if (unknown == NULL) return -1;
    Py_ssize_t n = PyList_GET_SIZE(unknown);
    PyObject *sep = n ? PyUnicode_FromString(", ") : NULL;
    PyObject *names = sep && PyList_Sort(unknown) == 0 ? PyUnicode_Join(sep, unknown) : NULL;
    Py_XDECREF(sep);
    Py_DECREF(unknown);
    if (n == 0) return 0;
    if (names) {
        char known[256] = "";
        for (size_t i = 0, used = 0; i < N_TORCH_OPTIONS; i++)
            used += (size_t)snprintf(known + used, sizeof known - used, "%s%s", i ? ", " : "", torch_option_names[i]);
        PyErr_Format(PyExc_ValueError, "unknown gpumem option(s) %U (known: %s)", names, known);
        Py_DECREF(names);
    }
    return -1;
}

/* torch_options(options, error) -> the heap registry's and torch's keyword
 * arguments (gpumem.torch's _configure), every option checked once here. */
static PyObject *torch_options(PyObject *Py_UNUSED(m), PyObject *args) {
    PyObject *given, *error;
    if (!PyArg_ParseTuple(args, "OO:torch_options", &given, &error)) return NULL;
    opt_ctx c = {.options = PyDict_New(), .kw = NULL, .error = error};
    if (c.options == NULL || PyDict_Update(c.options, given) < 0) goto fail;
    c.kw = Py_BuildValue("{s:i,s:d,s:O,s:O,s:O,s:O,s:O,s:i,s:i,s:s,s:O,s:O,s:O,s:O}", "cap_bytes", 0, "cap_fraction",
                         0.0, "va_size", Py_None, "growth_slack", Py_None, "growth_slack_pages", Py_None, "pressure",
                         Py_None, "chunk_pages", Py_None, "page_size", 0, "history_entries", 0, "oom_mode", "torch",
                         "spill", Py_None, "spill_choice", Py_None, "stream_handoff", Py_None, "split_chunks", Py_None);
    if (c.kw == NULL || opt_unknown(&c) < 0 || opt_cap(&c) < 0 || opt_heap(&c) < 0 || opt_torch(&c) < 0) goto fail;
    Py_DECREF(c.options);
    return c.kw;
fail:
    Py_XDECREF(c.options);
    Py_XDECREF(c.kw);
    return NULL;
}

static PyMethodDef config_methods[] = {
    {"parse_conf", parse_conf, METH_VARARGS,
     "parse_conf(text, known, source) -> dict: 'key:value,...' text split by the core (ValueError naming the item)"},
    {"check_option", check_option, METH_VARARGS,
     "check_option(name, value): ValueError with the core's message unless value is a valid heap option"},
    {"torch_options", torch_options, METH_VARARGS,
     "torch_options(options, error) -> keyword arguments for registry_configure and _torch_set_oom; "
     "error(key, value, reason) is raised for a bad option"},
    {NULL, NULL, 0, NULL},
};

int gm_config_glue_add(PyObject *module) {
    if (PyModule_AddFunctions(module, config_methods) < 0) return -1;
    if (gm_py_add_str_tuple(module, "OPTION_NAMES", torch_option_names, N_TORCH_OPTIONS) < 0) return -1;
    return PyModule_AddIntConstant(module, "MAX_HISTORY", MAX_HISTORY);
}
