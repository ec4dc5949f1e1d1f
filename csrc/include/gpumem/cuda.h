/*
 * cuda.h -- the CUDA driver device (device/cuda.c): its constructor.
 */
#ifndef GPUMEM_CUDA_H
#define GPUMEM_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem/device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the CUDA driver device ---------------------------------------------- */

/* Open CUDA device `ordinal` through the driver API.  Loads libcuda on first
 * use; returns NULL and writes a reason into err when that is impossible
 * (no driver, no such device, no VMM support). */
gm_device *gm_cuda_create(int ordinal, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_CUDA_H */
