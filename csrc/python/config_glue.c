/*
 * config_glue.c -- heap options from Python values: the conversion every
 * binding shares (gpumem.Heap(...), the torch allocator's options) and
 * check_option(), with which gpumem.torch checks install()'s and GPUMEM_CONF's
 * options.  The ranges and their messages are the core's (core/config.c).
 */
#include "config_glue.h"

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
        count = !strcmp(v, "old") ? GM_SPILL_OLD : !strcmp(v, "new") ? GM_SPILL_NEW : (size_t)-1;
        if (count == (size_t)-1) {
            PyErr_Format(PyExc_ValueError, "spill_choice must be \"old\" or \"new\", got '%s'", v);
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

/* check_option(name, value): None if value is a valid `name` ("chunk_pages",
 * "page_size", ...), else ValueError with the core's message. */
static PyObject *check_option(PyObject *Py_UNUSED(m), PyObject *args) {
    const char *name;
    PyObject *value;
    if (!PyArg_ParseTuple(args, "sO:check_option", &name, &value)) return NULL;
    if (strcmp(name, "page_size") == 0) {
        size_t page = 0;
        char err[256];
        if (gm_py_to_size_or_str(value, name, &page) < 0) return NULL;
        if (gm_check_page_size(page, err, sizeof err) != GM_OK) return PyErr_Format(PyExc_ValueError, "%s", err);
        Py_RETURN_NONE;
    }
    int opt = gm_option_find(name);
    if (opt < 0) return PyErr_Format(PyExc_ValueError, "unknown heap option '%s'", name);
    gm_config cfg;
    gm_config_default(&cfg);
    if (gm_py_config_option(&cfg, (gm_option)opt, name, value) < 0) return NULL;
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

static PyMethodDef config_methods[] = {
    {"parse_conf", parse_conf, METH_VARARGS,
     "parse_conf(text, known, source) -> dict: 'key:value,...' text split by the core (ValueError naming the item)"},
    {"check_option", check_option, METH_VARARGS,
     "check_option(name, value): ValueError with the core's message unless value is a valid heap option"},
    {NULL, NULL, 0, NULL},
};

int gm_config_glue_add(PyObject *module) { return PyModule_AddFunctions(module, config_methods); }
