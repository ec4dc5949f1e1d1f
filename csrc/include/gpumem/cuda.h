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

/* Open CUDA device `ordinal` through the driver API into *out.  Loads libcuda
 * on first use.  `page_size` is the heap's page: 0 for the device's
 * granularity (2 MiB on every current GPU), else a power of two that is a
 * multiple of it -- each page one physical allocation, so larger pages mean
 * fewer driver calls per byte grown, and coarser defragmentation.  GM_OK, or
 * with a reason in err: GM_EINVAL for a page_size the device cannot use,
 * GM_EDEVICE when the device cannot be opened (no driver, no such device, no
 * VMM support), GM_ENOMEM.
 *
 * Test-only: GPUMEM_CUDA_FAULTS="op:nth[:count],..." (gpumem/faults.h) puts the
 * device inside a fault-injecting wrapper with that schedule, each injected
 * failure's message ending "(injected by GPUMEM_CUDA_FAULTS)".  Unset -- the
 * default -- nothing is wrapped or counted.  A malformed value refuses to open
 * the device (GM_EDEVICE), before any driver is loaded. */
int gm_cuda_create(int ordinal, size_t page_size, gm_device **out, char *err, size_t errlen);
/* Calls of `op` a CUDA device opened under GPUMEM_CUDA_FAULTS made so far, and
 * in *fired how many of them were made to fail.  0 for any other device. */
uint64_t gm_cuda_fault_calls(const gm_device *dev, gm_dev_op op, uint64_t *fired);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_CUDA_H */
