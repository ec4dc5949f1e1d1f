/*
 * registry.c -- devices by name: one table of constructors (gpumem/registry.h).
 * A device joins by adding a row; nothing above this file compares names.
 */
#include <stdio.h>
#include <string.h>

#include "gpumem/config.h"
#include "gpumem/cuda.h"
#include "gpumem/gpumem.h"
#include "gpumem/registry.h"
#include "gpumem/sim.h"

typedef int (*device_ctor)(const gm_device_args *args, gm_device **out, char *err, size_t errlen);

static int open_sim(const gm_device_args *args, gm_device **out, char *err, size_t errlen) {
    size_t capacity = args->has_capacity ? args->capacity : GM_SIM_DEFAULT_CAPACITY;
    if (capacity == 0) return gm_errorf(GM_EINVAL, err, errlen, "capacity of a sim device must be positive");
    size_t page = args->page_size ? args->page_size : GM_SIM_PAGE_SIZE;
    size_t pages = capacity / page + (capacity % page != 0);
    if (pages > GM_SIM_MAX_PAGES) /* the one bound on a simulated heap's host memory */
        return gm_errorf(GM_EINVAL, err, errlen,
                         "a simulated device of %zu bytes in pages of %zu bytes has %zu pages, more than the %zu "
                         "(64 TiB in 2 MiB pages) that bound its host memory: lower capacity or raise page_size",
                         capacity, page, pages, GM_SIM_MAX_PAGES);
    *out = gm_sim_create(capacity, args->page_size);
    if (*out && args->has_host_capacity) gm_sim_set_host_capacity(*out, args->host_capacity);
    return *out ? GM_OK : gm_errorf(GM_ENOMEM, err, errlen, "out of host memory");
}

static int open_cuda(const gm_device_args *args, gm_device **out, char *err, size_t errlen) {
    if (args->has_capacity)
        return gm_errorf(GM_EINVAL, err, errlen,
                         "capacity applies to the sim device only; use cap= to limit a cuda heap");
    if (args->has_host_capacity)
        return gm_errorf(GM_EINVAL, err, errlen,
                         "host_capacity applies to the sim device only; use spill= to limit what a cuda heap spills");
    return gm_cuda_create(args->ordinal, args->page_size, out, err, errlen);
}

static const struct {
    const char *name;
    device_ctor open;
} devices[] = {
    {"sim", open_sim},
    {"cuda", open_cuda},
};
#define N_DEVICES (sizeof devices / sizeof devices[0])

void gm_device_args_default(gm_device_args *args) {
    memset(args, 0, sizeof *args);
    args->capacity = GM_SIM_DEFAULT_CAPACITY;
}

const char *gm_device_names(char *buf, size_t len) {
    size_t at = 0;
    if (len) buf[0] = '\0';
    for (size_t i = 0; i < N_DEVICES && at < len; i++)
        at += (size_t)snprintf(buf + at, len - at, "%s%s", i ? ", " : "", devices[i].name);
    return buf;
}

int gm_device_open(const char *name, const gm_device_args *args, gm_device **out, char *err, size_t errlen) {
    *out = NULL;
    if (err && errlen) err[0] = '\0';
    gm_device_args defaults;
    if (!args) {
        gm_device_args_default(&defaults);
        args = &defaults;
    }
    for (size_t i = 0; name && i < N_DEVICES; i++) {
        if (strcmp(name, devices[i].name)) continue;
        if (gm_check_page_size(args->page_size, err, errlen) != GM_OK) return GM_EINVAL;
        return devices[i].open(args, out, err, errlen);
    }
    char known[64];
    return gm_errorf(GM_EINVAL, err, errlen, "unknown device \"%s\" (known: %s)", name ? name : "(none)",
                     gm_device_names(known, sizeof known));
}
