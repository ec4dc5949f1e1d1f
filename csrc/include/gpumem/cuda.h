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
 * (no driver, no such device, no VMM support, a page size it cannot use).
 * `page_size` is the heap's page: 0 for the device's granularity (2 MiB on
 * every current GPU), else a power of two that is a multiple of it -- each
 * page one physical allocation, so larger pages mean fewer driver calls per
 * byte grown, and coarser defragmentation.  A refusal because of page_size
 * writes a reason that starts with "page_size". */
gm_device *gm_cuda_create(int ordinal, size_t page_size, char *err, size_t errlen);
/* Test-only fault injection on CUDA devices (GPUMEM_CUDA_FAULTS, see cuda.c):
 * calls of `op` made so far, and in *fired how many of them were made to fail.
 * 0 for a device that is not a CUDA device. */
uint64_t gm_cuda_fault_calls(const gm_device *dev, gm_dev_op op, uint64_t *fired);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_CUDA_H */
