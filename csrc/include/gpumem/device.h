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
 *                  no real memory, events that complete when told to.  Tests,
 *                  replay and notebooks run here.
 *
 * device/faults.c wraps either and makes chosen calls fail (gpumem/faults.h);
 * device/registry.c opens a device by name (gpumem/registry.h).
 *
 * The verbs are those of CUDA's virtual memory management: reserve a virtual
 * range, create physical pages, map a page behind an address, grant access,
 * unmap, release.  A physical allocation is a whole number of `page_size`
 * pages, mapped and unmapped only as a whole (CUDA maps no part of one).  A
 * single-page allocation can be unmapped in one place and mapped behind
 * another address -- the move that lets the allocator defragment without
 * copying; a larger one costs one call where single pages cost one each.
 *
 * A device is used by one heap, under that heap's lock; implementations need no
 * locking of their own for calls made by the heap.
 *
 * This header is the contract only.  The constructors and the simulated
 * device's test controls live in gpumem/sim.h and gpumem/cuda.h.
 */
#ifndef GPUMEM_DEVICE_H
#define GPUMEM_DEVICE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef uint64_t gm_handle; /* a physical allocation of one or more pages */
typedef uint64_t gm_event;  /* a stream event */
typedef uint64_t gm_stream; /* a cudaStream_t's value; 0 is the legacy default stream */

/* Every call a device can be asked to make, for fault injection and counts:
 * the one list of them, X(ENUM_SUFFIX, name). */
#define GM_EACH_DEV_OP(X)                                                                                              \
    X(RESERVE, reserve)                                                                                                \
    X(UNRESERVE, unreserve)                                                                                            \
    X(CREATE, create)                                                                                                  \
    X(RELEASE, release)                                                                                                \
    X(MAP, map)                                                                                                        \
    X(UNMAP, unmap)                                                                                                    \
    X(SET_ACCESS, set_access)                                                                                          \
    X(EVENT_CREATE, event_create)                                                                                      \
    X(EVENT_DESTROY, event_destroy)                                                                                    \
    X(EVENT_RECORD, event_record)                                                                                      \
    X(EVENT_QUERY, event_query)                                                                                        \
    X(SYNCHRONIZE, synchronize)                                                                                        \
    X(MEM_INFO, mem_info)                                                                                              \
    X(PROCESSES, processes)                                                                                            \
    X(HOST_ALLOC, host_alloc)                                                                                          \
    X(HOST_FREE, host_free)                                                                                            \
    X(COPY_DTOH, copy_dtoh)                                                                                            \
    X(COPY_HTOD, copy_htod)                                                                                            \
    X(CREATE_HOST, create_host)                                                                                        \
    X(COPY_DTOD, copy_dtod)                                                                                            \
    X(STREAM_WAIT, stream_wait)

typedef enum gm_dev_op {
#define GM_DEV_OP_ENUM(upper, lower) GM_OP_##upper,
    GM_EACH_DEV_OP(GM_DEV_OP_ENUM)
#undef GM_DEV_OP_ENUM
    GM_OP__COUNT
} gm_dev_op;

/* "create" for GM_OP_CREATE: the names fault injection and tests use. */
static inline const char *gm_dev_op_name(gm_dev_op op) {
    static const char *const names[GM_OP__COUNT] = {
#define GM_DEV_OP_NAME(upper, lower) #lower,
        GM_EACH_DEV_OP(GM_DEV_OP_NAME)
#undef GM_DEV_OP_NAME
    };
    return (unsigned)op < GM_OP__COUNT ? names[op] : "?";
}

/* Memory that one process holds on the device, as NVML reports it. */
typedef struct gm_proc_usage {
    uint32_t pid;
    uint64_t bytes;
} gm_proc_usage;

typedef struct gm_device gm_device;
struct gm_device_verify;

/*
 * Each call returns GM_OK (0) or a GM_E* code from gpumem.h.  On failure the
 * device writes a human-readable reason into dev->last_error.
 */
typedef struct gm_device_ops {
    /* Reserve `size` bytes of virtual address space, aligned to page_size. */
    int (*reserve)(gm_device *dev, size_t size, uintptr_t *va);
    int (*unreserve)(gm_device *dev, uintptr_t va, size_t size);
    /* Create / release one physical allocation of `pages` pages (>= 1).
     * create returns GM_ENOMEM when the device has not that much to give. */
    int (*create)(gm_device *dev, size_t pages, gm_handle *handle);
    int (*release)(gm_device *dev, gm_handle handle);
    /* Map a whole allocation of `pages` pages behind [va, va + pages *
     * page_size) (page aligned, inside a reservation, nothing mapped there).
     * `pages` must be the allocation's size: GM_EINVAL otherwise. */
    int (*map)(gm_device *dev, uintptr_t va, size_t pages, gm_handle handle);
    /* Unmap whole mappings: [va, va+size) must be exactly covered by them;
     * a range that cuts a mapping in two is refused (GM_EINVAL). */
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
    /* Optional (NULL where the device has none; pausing with a backup then
     * answers GM_ENOTSUP).  Pinned host memory of `size` bytes, and its free. */
    int (*host_alloc)(gm_device *dev, size_t size, void **out);
    int (*host_free)(gm_device *dev, void *ptr);
    /* Copy whole mapped, accessible pages to and from host memory, finished
     * when the call returns (the caller has synchronised the device). */
    int (*copy_dtoh)(gm_device *dev, void *dst, uintptr_t src, size_t size);
    int (*copy_htod)(gm_device *dev, uintptr_t dst, const void *src, size_t size);
    /* Optional (NULL where the device has none; spilling then answers
     * GM_ENOTSUP).  A physical allocation of `pages` pages located in host
     * memory, which the device reads and writes through its mappings: mapped,
     * unmapped, granted access and released with the ops above.  It is not
     * the device's memory: mem_info does not count it.  GM_ENOMEM when the
     * host has not that much to give. */
    int (*create_host)(gm_device *dev, size_t pages, gm_handle *handle);
    /* Copy whole mapped, accessible pages from src to dst, both in this
     * device's address space (the caller has synchronised the device).  The
     * copy may still run when the call returns: the caller calls synchronize
     * before it unmaps either range (one wait for a batch of copies). */
    int (*copy_dtod)(gm_device *dev, uintptr_t dst, uintptr_t src, size_t size);
    /* Make the work issued to `stream` from now on wait, on the device, until
     * the work recorded before `ev` has finished (the host does not wait).
     * Waiting for an event that is complete, or was never recorded, changes
     * nothing.  Optional (NULL where the device has none: no stream then
     * takes memory another stream freed before its work is proven done). */
    int (*stream_wait)(gm_device *dev, gm_stream stream, gm_event ev);
    /* Free the device object itself (after the heap returned everything). */
    void (*destroy)(gm_device *dev);
    /* Whether `stream` is being captured into a graph now (*capturing 1 or
     * 0; 1 also when asking is refused because another stream captures).
     * NULL when the device cannot tell; then only the heap's own
     * gm_capture_begin/end count.  An error means "cannot tell": the heap then
     * takes the requesting stream as capturing. */
    int (*capture_status)(gm_device *dev, gm_stream stream, int *capturing);
    /* GM_OK when every piece of work issued to `stream` has finished,
     * GM_ENOTREADY while some still runs.  Not during a capture (it would
     * invalidate it).  NULL when the device cannot tell. */
    int (*stream_query)(gm_device *dev, gm_stream stream);
    /* What the device itself knows, for the heap's invariant checker; NULL
     * where the device cannot tell (a real GPU). */
    const struct gm_device_verify *verify;
    /* 1 if the device honours gm_device.doomed (see there); the fault wrapper
     * (gpumem/faults.h) does not call a device without it for a call it fails. */
    int checks_doomed;
} gm_device_ops;

/* A device's own view of its pages, to check the heap's bookkeeping against. */
typedef struct gm_device_verify {
    /* 1 if every page of [va, va+size) is mapped with access granted, else 0. */
    int (*accessible)(const gm_device *dev, uintptr_t va, size_t size);
    /* Physical pages alive (all allocations' pages), and how many of them are
     * mapped. */
    void (*pages)(const gm_device *dev, size_t *created, size_t *mapped);
    /* The allocation mapped behind the page-aligned address va, 0 if none
     * (the same handle for every page of a multi-page allocation). */
    gm_handle (*handle_at)(const gm_device *dev, uintptr_t va);
    /* 1 if the allocation mapped behind va lies in host memory (create_host),
     * else 0. */
    int (*host_at)(const gm_device *dev, uintptr_t va);
} gm_device_verify;

struct gm_device {
    const gm_device_ops *ops;
    const char *kind;     /* "sim" or "cuda" */
    int ordinal;          /* device index */
    size_t page_size;     /* physical granularity, 2 MiB on every current GPU */
    char name[96];        /* "sim:80GiB", "cuda:0 (NVIDIA H100 80GB HBM3)" */
    char last_error[256]; /* why the last failing call failed */
    /* Set by the fault wrapper around a call it has decided to fail: a device
     * whose ops->checks_doomed is 1 then checks the call as usual (GM_EINVAL
     * and the reason for an invalid one) and returns GM_OK having changed
     * nothing, and the wrapper answers with the injected failure. */
    int doomed;
};

#ifdef __cplusplus
}
#endif
#endif /* GPUMEM_DEVICE_H */
