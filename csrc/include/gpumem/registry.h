/*
 * registry.h -- devices by name (device/registry.c): the one table that maps
 * "sim" and "cuda" to their constructors, for every layer that lets a user
 * pick a device by name (gpumem.Heap(device=...), the torch allocator).
 */
#ifndef GPUMEM_REGISTRY_H
#define GPUMEM_REGISTRY_H

#include <stddef.h>

#include "gpumem/device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The simulated device's memory when none is given: an 80 GiB GPU. */
#define GM_SIM_DEFAULT_CAPACITY ((size_t)80 << 30)

/* What a device is opened with; gm_device_args_default gives every field its
 * default. */
typedef struct gm_device_args {
    size_t capacity;       /* bytes of memory, for a device that has no real one (sim) */
    int has_capacity;      /* 1 if capacity was given: a real device refuses it */
    size_t page_size;      /* 0: the device's own granularity; else a power of two */
    int ordinal;           /* which GPU, for a real device */
    size_t host_capacity;  /* bytes of host-located pages a sim device gives (spill) */
    int has_host_capacity; /* 1 if host_capacity was given: a real device refuses it */
} gm_device_args;

void gm_device_args_default(gm_device_args *args);

/* Open the device called `name` ("sim", "cuda").  GM_OK with *out, or with a
 * reason in err: GM_EINVAL for a caller's mistake (an unknown name, whose
 * message lists the known ones; an argument the device cannot take),
 * GM_EDEVICE when the device cannot be opened, GM_ENOMEM. */
int gm_device_open(const char *name, const gm_device_args *args, gm_device **out, char *err, size_t errlen);
/* The known names, ", "-separated ("sim, cuda"), written into buf. */
const char *gm_device_names(char *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_REGISTRY_H */
