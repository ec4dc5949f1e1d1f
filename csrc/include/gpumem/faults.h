/*
 * faults.h -- the fault-injecting device (device/faults.c): a device that
 * wraps any other and makes chosen calls of it fail, for tests.
 *
 * The wrapper counts every call of each op and decides, before the wrapped
 * device looks at the call's arguments, whether it is to fail -- so the fault
 * schedule depends only on the sequence of calls.  A device that can check a
 * call without acting on it (ops->checks_doomed, the simulated device) is
 * still called, marked doomed: an invalid call then answers GM_EINVAL as it
 * would have, so injection never hides a caller's bug, and the device keeps
 * its own accounting (its clock, capture refusals).  Any other device (CUDA)
 * is not called at all, as if the driver had refused.
 *
 * An injected failure of create or host_alloc is GM_ENOMEM (someone else took
 * the memory), of any other op GM_EDEVICE; last_error says it was injected.
 */
#ifndef GPUMEM_FAULTS_H
#define GPUMEM_FAULTS_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem/device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Wrap `inner`: the result is a device with inner's kind, name and page size
 * whose destroy destroys inner too.  `origin`, if not NULL, names what asked
 * for the faults (a static string, e.g. "GPUMEM_CUDA_FAULTS") in each injected
 * failure's message.  NULL (inner left alone) if malloc fails. */
gm_device *gm_faults_wrap(gm_device *inner, const char *origin);
/* The device a wrapper wraps; `dev` itself for any other device. */
gm_device *gm_faults_inner(gm_device *dev);
/* 1 if dev is a fault-injecting wrapper. */
int gm_faults_is_wrapper(const gm_device *dev);

/* Make the `nth` next call of `op` (1 = the very next one) fail, and the
 * `count - 1` calls of that op after it too.  nth = 0 or count = 0 clears. */
void gm_faults_fail(gm_device *dev, gm_dev_op op, uint64_t nth, uint64_t count);
/* Fail each call of `op` with probability p (deterministic, seeded with
 * splitmix64); p <= 0 (or NaN) turns it off. */
void gm_faults_fail_random(gm_device *dev, gm_dev_op op, double p, uint64_t seed);
/* Calls of `op` made so far (failed ones included), and in *fired (if not
 * NULL) how many of them were made to fail.  0 for a device not wrapped. */
uint64_t gm_faults_calls(const gm_device *dev, gm_dev_op op, uint64_t *fired);

/* A schedule as text, "op:nth[:count],..." (e.g. "create:3,map:5:2"), ops
 * named as gm_dev_op_name names them: the nth call of op from now, and the
 * count - 1 after it, fail.  With dev NULL only checks the text.  GM_OK, or
 * GM_EINVAL with a message naming the bad entry (prefixed by `what`) in err. */
int gm_faults_schedule(gm_device *dev, const char *spec, const char *what, char *err, size_t errlen);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_FAULTS_H */
