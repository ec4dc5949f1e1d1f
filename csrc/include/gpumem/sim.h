/*
 * sim.h -- the simulated device (device/sim.c): its constructor and the controls
 * that tests, replay and notebooks use to stand for a GPU.
 */
#ifndef GPUMEM_SIM_H
#define GPUMEM_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "gpumem/device.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the simulated device ------------------------------------------------ */

/* A simulated device with `capacity` bytes of physical memory in pages of
 * `page_size` bytes (0 means 2 MiB), inside a fault-injecting wrapper
 * (gpumem/faults.h) that injects nothing until told to.  Returns NULL only if
 * malloc fails. */
gm_device *gm_sim_create(size_t capacity, size_t page_size);
/* The most pages a simulated device may hold: 64 TiB in 2 MiB pages.  A
 * simulated heap's host memory (the core's tables, sized for the device's
 * pages, and the device's own) grows with its pages, so this bounds it for
 * every simulated heap, whatever makes it; gm_device_open refuses more. */
#define GM_SIM_MAX_PAGES ((size_t)1 << 25)
#define GM_SIM_PAGE_SIZE ((size_t)2 << 20) /* the page when none is given */
/* 1 if dev is a simulated device (as gm_sim_create returns it), else 0. */
int gm_sim_is(const gm_device *dev);

/* Fault injection, gm_faults_fail and friends under the simulated device's
 * names: make the `nth` next call of `op` (1 = the very next one) fail, and
 * the `count - 1` calls of that op after it too.  nth = 0 clears. */
void gm_sim_fail(gm_device *dev, gm_dev_op op, uint64_t nth, uint64_t count);
/* Fail each call of `op` with probability p (deterministic, seeded). */
void gm_sim_fail_random(gm_device *dev, gm_dev_op op, double p, uint64_t seed);
/* Calls of `op` made so far (failed ones included). */
uint64_t gm_sim_calls(const gm_device *dev, gm_dev_op op);

/* Events: by default a recorded event is complete at once.  A held stream
 * keeps every event recorded on it pending until the stream is released --
 * how tests stand for a kernel still running on a side stream. */
void gm_sim_hold_stream(gm_device *dev, gm_stream stream, int held);
/* 1 if work issued to `stream` now would not run yet: the stream is held, or
 * it was made to wait (stream_wait) for an event whose work has not finished
 * -- a held stream's, a late one, or what that event's own stream waited
 * for.  Asking is not a device operation: the clock does not tick.  A
 * stream waits for the holds of at most 4 held streams at once: a
 * stream_wait that would add a fifth fails (GM_EDEVICE). */
int gm_sim_stream_busy(const gm_device *dev, gm_stream stream);
/* 1 if `held` is held and work issued to `stream` now waits for the work
 * `held` has queued under this hold (stream_wait, directly or through other
 * streams' events). */
int gm_sim_stream_waits_for(const gm_device *dev, gm_stream stream, gm_stream held);

/* Late events: an event recorded on any stream but the legacy default stream 0
 * completes only after `ops` further device operations (of any kind; the
 * event_query that asks is not counted, so a polling loop ends) or at the next
 * synchronize, whichever comes first.  It only ever adds to a hold.  0, the
 * default, completes events at once.  Applies to events recorded after the call. */
void gm_sim_set_event_delay(gm_device *dev, uint64_t ops);

/* Memory held by "other processes": lowers what create can hand out, and is
 * reported by mem_info and processes. */
void gm_sim_set_external(gm_device *dev, uint32_t pid, uint64_t bytes);
/* This process's own memory outside the allocator (CUDA context, cuBLAS
 * workspaces): taken from capacity and reported under `self_pid`. */
void gm_sim_set_self(gm_device *dev, uint32_t self_pid, uint64_t outside_bytes);
/* Host-located pages (create_host) are not the device's memory: they have a
 * limit of their own, GM_SIM_HOST_CAPACITY bytes unless set. */
#define GM_SIM_HOST_CAPACITY ((size_t)1 << 40)
void gm_sim_set_host_capacity(gm_device *dev, size_t bytes);
/* Make processes() answer GM_ENOTSUP, as a machine without NVML does. */
void gm_sim_set_nvml(gm_device *dev, int available);

/* Capture mode: while on (for every stream), or while any stream is marked
 * capturing, each call that would invalidate a real CUDA graph capture --
 * synchronize, event_query, event_record, unmap, release, unreserve -- fails
 * with GM_EDEVICE ("... during stream capture") and is counted, so tests can
 * prove the heap made none.  capture_status reports a stream as capturing when
 * the mode is on or the stream is marked. */
void gm_sim_set_capture(gm_device *dev, int on);
void gm_sim_set_stream_capture(gm_device *dev, gm_stream stream, int on);
/* Calls refused by capture mode so far. */
uint64_t gm_sim_capture_violations(const gm_device *dev);

/* Contents: the simulated device keeps one 64-bit value per physical page in
 * place of its bytes.  A new page holds a value no write ever used (tagged
 * 0xF4E5 in its top 16 bits); copy_dtoh / copy_htod / copy_dtod move it with
 * the page.
 * Writing or reading an address whose page is not mapped and accessible is
 * GM_EINVAL -- the simulated illegal-address fault. */
int gm_sim_write(gm_device *dev, uintptr_t va, uint64_t value);
int gm_sim_read(gm_device *dev, uintptr_t va, uint64_t *value);
/* Pinned host blocks (host_alloc) not freed yet. */
size_t gm_sim_host_blocks(const gm_device *dev);

/* Introspection for the invariant checker and tests. */
typedef struct gm_sim_info {
    size_t capacity, page_size;
    size_t pages_created; /* physical pages alive, of the device's memory */
    size_t pages_mapped;  /* of those, pages mapped somewhere */
    size_t host_pages;    /* host-located pages alive (create_host) */
    size_t host_mapped;   /* of those, pages mapped somewhere */
    size_t events_alive;
    size_t reservations; /* reserved VA ranges alive */
} gm_sim_info;
void gm_sim_info_get(const gm_device *dev, gm_sim_info *info);
/* The physical allocation mapped at va (0 if none): which allocation lies
 * behind an address (the same handle on every page of a multi-page one). */
gm_handle gm_sim_handle_at(const gm_device *dev, uintptr_t va);
/* 1 if every page of [va, va+size) is mapped with access granted, else 0. */
int gm_sim_is_accessible(const gm_device *dev, uintptr_t va, size_t size);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_SIM_H */
