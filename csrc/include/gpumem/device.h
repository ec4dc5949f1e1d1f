/*
 * device.h -- the one door between gpumem and a GPU.
 *
 * Everything above this interface is plain C that never names CUDA.  Two
 * implementations sit behind it:
 *
 *   device/cuda.c  the CUDA driver API, loaded with dlopen("libcuda.so.1") on
 *                  first use, so that building and importing gpumem need no GPU;
 *                  NVML is dlopen'd too, only to name other processes.
 *   device/sim.c   a deterministic simulated device: a capacity, 2 MiB pages,
 *                  no real memory, events that complete when told to, and fault
 *                  injection on every call.  Tests, replay and notebooks run here.
 *
 * The verbs are those of CUDA's virtual memory management: reserve a virtual
 * range, create physical pages, map a page behind an address, grant access,
 * unmap, release.  Physical pages are always exactly `page_size` bytes, so a
 * page can be unmapped in one place and mapped behind another address -- the
 * move that lets the allocator defragment without copying.
 *
 * A device is used by one heap, under that heap's lock; implementations need no
 * locking of their own for calls made by the heap.
 */
#ifndef GPUMEM_DEVICE_H
#define GPUMEM_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef uint64_t gm_handle; /* a physical page */
typedef uint64_t gm_event;  /* a stream event */
typedef uint64_t gm_stream; /* a cudaStream_t's value; 0 is the legacy default stream */

/* Every call a device can be asked to make, for fault injection and counts. */
typedef enum gm_dev_op {
    GM_OP_RESERVE = 0,
    GM_OP_UNRESERVE,
    GM_OP_CREATE,
    GM_OP_RELEASE,
    GM_OP_MAP,
    GM_OP_UNMAP,
    GM_OP_SET_ACCESS,
    GM_OP_EVENT_CREATE,
    GM_OP_EVENT_DESTROY,
    GM_OP_EVENT_RECORD,
    GM_OP_EVENT_QUERY,
    GM_OP_SYNCHRONIZE,
    GM_OP_MEM_INFO,
    GM_OP_PROCESSES,
    GM_OP__COUNT
} gm_dev_op;

/* Memory that one process holds on the device, as NVML reports it. */
typedef struct gm_proc_usage {
    uint32_t pid;
    uint64_t bytes;
} gm_proc_usage;

typedef struct gm_device gm_device;

/*
 * Each call returns GM_OK (0) or a GM_E* code from gpumem.h.  On failure the
 * device writes a human-readable reason into dev->last_error.
 */
typedef struct gm_device_ops {
    /* Reserve `size` bytes of virtual address space, aligned to page_size. */
    int (*reserve)(gm_device *dev, size_t size, uintptr_t *va);
    int (*unreserve)(gm_device *dev, uintptr_t va, size_t size);
    /* Create / release one physical page of page_size bytes.
     * create returns GM_ENOMEM when the device has no page to give. */
    int (*create)(gm_device *dev, gm_handle *handle);
    int (*release)(gm_device *dev, gm_handle handle);
    /* Map one page behind va (page aligned, inside a reservation). */
    int (*map)(gm_device *dev, uintptr_t va, gm_handle handle);
    /* Unmap whole pages: [va, va+size) must be exactly covered by mappings. */
    int (*unmap)(gm_device *dev, uintptr_t va, size_t size);
    /* Grant this device read/write access to mapped pages in [va, va+size). */
    int (*set_access)(gm_device *dev, uintptr_t va, size_t size);
    int (*event_create)(gm_device *dev, gm_event *ev);
    int (*event_destroy)(gm_device *dev, gm_event ev);
    int (*event_record)(gm_device *dev, gm_event ev, gm_stream stream);
    /* GM_OK when everything recorded before the event has finished,
     * GM_ENOTREADY while it is still running. */
    int (*event_query)(gm_device *dev, gm_event ev);
    /* Wait until all work on every stream of the device has finished. */
    int (*synchronize)(gm_device *dev);
    /* Free and total physical memory of the whole device (all processes). */
    int (*mem_info)(gm_device *dev, size_t *free_bytes, size_t *total_bytes);
    /* Processes holding memory on this device (this one included).
     * Writes at most `cap` entries, sets *n to the number there are.
     * GM_ENOTSUP when no source (NVML) is available. */
    int (*processes)(gm_device *dev, gm_proc_usage *out, size_t cap, size_t *n);
    /* Free the device object itself (after the heap returned everything). */
    void (*destroy)(gm_device *dev);
} gm_device_ops;

struct gm_device {
    const gm_device_ops *ops;
    const char *kind;        /* "sim" or "cuda" */
    int ordinal;             /* device index */
    size_t page_size;        /* physical granularity, 2 MiB on every current GPU */
    char name[96];           /* "sim:80GiB", "cuda:0 (NVIDIA H100 80GB HBM3)" */
    char last_error[256];    /* why the last failing call failed */
};

/* ---- the simulated device ------------------------------------------------ */

/* A simulated device with `capacity` bytes of physical memory in pages of
 * `page_size` bytes (0 means 2 MiB).  Returns NULL only if malloc fails. */
gm_device *gm_sim_create(size_t capacity, size_t page_size);

/* Fault injection: make the `nth` next call of `op` (1 = the very next one)
 * fail, and the `count - 1` calls of that op after it too.  nth = 0 clears. */
void gm_sim_fail(gm_device *dev, gm_dev_op op, uint64_t nth, uint64_t count);
/* Fail each call of `op` with probability p (deterministic, seeded). */
void gm_sim_fail_random(gm_device *dev, gm_dev_op op, double p, uint64_t seed);
/* Calls of `op` made so far (failed ones included). */
uint64_t gm_sim_calls(const gm_device *dev, gm_dev_op op);

/* Events: by default a recorded event is complete at once.  A held stream
 * keeps every event recorded on it pending until the stream is released --
 * how tests stand for a kernel still running on a side stream. */
void gm_sim_hold_stream(gm_device *dev, gm_stream stream, int held);

/* Memory held by "other processes": lowers what create can hand out, and is
 * reported by mem_info and processes. */
void gm_sim_set_external(gm_device *dev, uint32_t pid, uint64_t bytes);
/* This process's own memory outside the allocator (CUDA context, cuBLAS
 * workspaces): taken from capacity and reported under `self_pid`. */
void gm_sim_set_self(gm_device *dev, uint32_t self_pid, uint64_t outside_bytes);
/* Make processes() answer GM_ENOTSUP, as a machine without NVML does. */
void gm_sim_set_nvml(gm_device *dev, int available);

/* Introspection for the invariant checker and tests. */
typedef struct gm_sim_info {
    size_t capacity, page_size;
    size_t pages_created;     /* physical pages alive */
    size_t pages_mapped;      /* pages mapped somewhere */
    size_t events_alive;
    size_t reservations;      /* reserved VA ranges alive */
} gm_sim_info;
void gm_sim_info_get(const gm_device *dev, gm_sim_info *info);
/* 1 if every page of [va, va+size) is mapped with access granted, else 0. */
int gm_sim_is_accessible(const gm_device *dev, uintptr_t va, size_t size);
/* The physical page (handle) the device has mapped at the page holding `va`,
 * or 0 if none is mapped there or va lies in no reservation. */
gm_handle gm_sim_page_at(const gm_device *dev, uintptr_t va);

/* ---- the CUDA driver device ---------------------------------------------- */

/* Open CUDA device `ordinal` through the driver API.  Loads libcuda on first
 * use; returns NULL and writes a reason into err when that is impossible
 * (no driver, no such device, no VMM support). */
gm_device *gm_cuda_create(int ordinal, char *err, size_t errlen);
/* Test-only fault injection on CUDA devices (GPUMEM_CUDA_FAULTS, see cuda.c):
 * calls of `op` made so far, and in *fired how many of them were made to fail.
 * 0 for a device that is not a CUDA device. */
uint64_t gm_cuda_fault_calls(const gm_device *dev, gm_dev_op op, uint64_t *fired);

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_DEVICE_H */
