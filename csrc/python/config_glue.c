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
    } else if (opt == GM_OPT_VA_SIZE || opt == GM_OPT_CAP_BYTES) { /* bytes: "24GiB" too */
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

static PyMethodDef config_methods[] = {
    {"check_option", check_option, METH_VARARGS,
     "check_option(name, value): ValueError with the core's message unless value is a valid heap option"},
    {NULL, NULL, 0, NULL},
};

int gm_config_glue_add(PyObject *module) { return PyModule_AddFunctions(module, config_methods); }
