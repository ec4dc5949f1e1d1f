/*
 * config_glue.h -- heap options from Python values (config_glue.c): converted
 * here, range-checked by the core (gpumem/config.h), whose message a
 * ValueError carries unchanged.
 */
#ifndef GPUMEM_CONFIG_GLUE_H
#define GPUMEM_CONFIG_GLUE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "gpumem/config.h"

/* Set option `opt` of cfg from a Python value given as `keyword`: NULL leaves
 * it as it is, None gives it the core's default, anything else is converted
 * (bytes may be strings such as "24GiB") and checked.  0, or -1 with an
 * exception set. */
int gm_py_config_option(gm_config *cfg, gm_option opt, const char *keyword, PyObject *value);
/* Adds check_option() to the module. */
int gm_config_glue_add(PyObject *module);

#endif /* GPUMEM_CONFIG_GLUE_H */
