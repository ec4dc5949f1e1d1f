/*
 * cuda.c -- the CUDA driver device.
 *
 * libcuda is opened with dlopen on first use and never linked, and no CUDA
 * header is included: building and importing gpumem must work on a machine
 * without a GPU or a toolkit.  The few types below mirror cuda.h (checked
 * against CUDA 13.0's header; the layouts have not changed since the virtual
 * memory API appeared in 10.2).  NVML, used only to name other processes, is
 * opened the same way on the first processes() call.
 *
 * Every operation pushes the device's primary context and pops it after, so a
 * call works from any thread whatever context that thread has current -- the
 * heap is called from PyTorch's threads, from autograd's, and from ours.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem/config.h"
#include "gpumem/cuda.h"
#include "gpumem/faults.h"
#include "gpumem/gpumem.h"

/* ---- the slice of cuda.h we use ----------------------------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUevent_st *CUevent;
typedef struct CUstream_st *CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_READY = 600,
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102,
    CU_MEM_ALLOCATION_TYPE_PINNED = 1,
    CU_MEM_HANDLE_TYPE_NONE = 0,
    CU_MEM_LOCATION_TYPE_DEVICE = 1,
    CU_MEM_LOCATION_TYPE_HOST = 2,
    CU_MEM_LOCATION_TYPE_HOST_NUMA = 3,
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
    CU_EVENT_DISABLE_TIMING = 2,
    CU_STREAM_CAPTURE_STATUS_NONE = 0,
    /* CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED .. _WRONG_THREAD: a capture is
     * under way (e.g. the legacy stream queried while another captures). */
    CUDA_ERROR_STREAM_CAPTURE_FIRST = 900,
    CUDA_ERROR_STREAM_CAPTURE_LAST = 908,
    CU_STREAM_CAPTURE_MODE_RELAXED = 2
};

/* C enums are int-sized on every ABI CUDA supports, so they are ints here. */
typedef struct cu_mem_location {
    int type;
    int id;
} cu_mem_location;

typedef struct cu_alloc_prop {
    int type;
    int requested_handle_types;
    cu_mem_location location;
    void *win32_handle_meta_data;
    struct {
        unsigned char compression_type;
        unsigned char gpu_direct_rdma_capable;
        unsigned short usage;
        unsigned char reserved[4];
    } alloc_flags;
} cu_alloc_prop;

typedef struct cu_access_desc {
    cu_mem_location location;
    int flags;
} cu_access_desc;

_Static_assert(sizeof(cu_mem_location) == 8, "CUmemLocation layout");
_Static_assert(sizeof(cu_alloc_prop) == 32, "CUmemAllocationProp layout");
_Static_assert(sizeof(cu_access_desc) == 12, "CUmemAccessDesc layout");

typedef struct cu_api {
    CUresult (*Init)(unsigned int);
    CUresult (*GetErrorName)(CUresult, const char **);
    CUresult (*GetErrorString)(CUresult, const char **);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetAttribute)(int *, int, CUdevice);
    CUresult (*DeviceGetName)(char *, int, CUdevice);
    CUresult (*DeviceGetPCIBusId)(char *, int, CUdevice);
    CUresult (*DeviceCanAccessPeer)(int *, CUdevice, CUdevice);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*DevicePrimaryCtxRelease)(CUdevice);
    CUresult (*CtxPushCurrent)(CUcontext);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxPopCurrent)(CUcontext *);
    CUresult (*CtxSynchronize)(void);
    CUresult (*MemGetInfo)(size_t *, size_t *);
    CUresult (*MemGetAllocationGranularity)(size_t *, const cu_alloc_prop *, int);
    CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*MemAddressFree)(CUdeviceptr, size_t);
    CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const cu_alloc_prop *, unsigned long long);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle);
    CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*MemUnmap)(CUdeviceptr, size_t);
    CUresult (*MemSetAccess)(CUdeviceptr, size_t, const cu_access_desc *, size_t);
    CUresult (*EventCreate)(CUevent *, unsigned int);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventQuery)(CUevent);
    CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned int);
    CUresult (*StreamQuery)(CUstream);
    CUresult (*MemHostAlloc)(void **, size_t, unsigned int);
    CUresult (*MemFreeHost)(void *);
    CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
    CUresult (*MemcpyDtoD)(CUdeviceptr, CUdeviceptr, size_t);
} cu_api;

/* Symbol names, newest first where the driver exports versions.  A _v2 whose
 * unversioned twin has a different ABI (cuMemGetInfo took unsigned ints) has
 * no fallback. */
typedef struct sym_entry {
    size_t offset;        /* of the function pointer in its table */
    const char *names[2]; /* tried in order; the second may be NULL */
} sym_entry;

static const sym_entry cu_symbols[] = {
#define SYM(field, ...)                                                                                                \
    {                                                                                                                  \
        offsetof(cu_api, field), { __VA_ARGS__ }                                                                       \
    }
    SYM(Init, "cuInit"),
    SYM(GetErrorName, "cuGetErrorName"),
    SYM(GetErrorString, "cuGetErrorString"),
    SYM(DeviceGetCount, "cuDeviceGetCount"),
    SYM(DeviceGet, "cuDeviceGet"),
    SYM(DeviceGetAttribute, "cuDeviceGetAttribute"),
    SYM(DeviceGetName, "cuDeviceGetName"),
    SYM(DeviceGetPCIBusId, "cuDeviceGetPCIBusId"),
    SYM(DeviceCanAccessPeer, "cuDeviceCanAccessPeer"),
    SYM(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"),
    SYM(DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", "cuDevicePrimaryCtxRelease"),
    SYM(CtxPushCurrent, "cuCtxPushCurrent_v2"),
    SYM(CtxGetCurrent, "cuCtxGetCurrent"),
    SYM(CtxPopCurrent, "cuCtxPopCurrent_v2"),
    SYM(CtxSynchronize, "cuCtxSynchronize"),
    SYM(MemGetInfo, "cuMemGetInfo_v2"),
    SYM(MemGetAllocationGranularity, "cuMemGetAllocationGranularity"),
    SYM(MemAddressReserve, "cuMemAddressReserve"),
    SYM(MemAddressFree, "cuMemAddressFree"),
    SYM(MemCreate, "cuMemCreate"),
    SYM(MemRelease, "cuMemRelease"),
    SYM(MemMap, "cuMemMap"),
    SYM(MemUnmap, "cuMemUnmap"),
    SYM(MemSetAccess, "cuMemSetAccess"),
    SYM(EventCreate, "cuEventCreate"),
    SYM(EventDestroy, "cuEventDestroy_v2"),
    SYM(EventRecord, "cuEventRecord"),
    SYM(EventQuery, "cuEventQuery"),
    SYM(StreamWaitEvent, "cuStreamWaitEvent"),
    SYM(StreamQuery, "cuStreamQuery"),
    SYM(MemHostAlloc, "cuMemHostAlloc"),
    SYM(MemFreeHost, "cuMemFreeHost"),
    SYM(MemcpyDtoH, "cuMemcpyDtoH_v2"),
    SYM(MemcpyHtoD, "cuMemcpyHtoD_v2"),
    SYM(MemcpyDtoD, "cuMemcpyDtoD_v2"),
#undef SYM
};

static cu_api cu;
/* Optional entry points (NULL when the driver lacks them): whether a stream
 * is capturing a graph, and the calling thread's capture-safety mode. */
static CUresult (*cuStreamIsCapturing_)(CUstream, int *);
static CUresult (*cuThreadExchangeStreamCaptureMode_)(int *);
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static int cu_ok;
static char cu_err[256];

/* Function pointers come back from dlsym as void *; copying the bytes is the
 * conversion ISO C leaves defined enough for -Wpedantic to stay quiet. */
static int load_symbols(void *lib, void *table, const sym_entry *syms, size_t n, const char **missing) {
    for (size_t i = 0; i < n; i++) {
        void *p = NULL;
        for (int k = 0; k < 2 && syms[i].names[k] && !p; k++) p = dlsym(lib, syms[i].names[k]);
        if (!p) {
            *missing = syms[i].names[0];
            return 0;
        }
        memcpy((char *)table + syms[i].offset, &p, sizeof p);
    }
    return 1;
}

static const char *cu_name(CUresult r) {
    const char *s = NULL;
    if (!cu.GetErrorName || cu.GetErrorName(r, &s) != CUDA_SUCCESS || !s) return "CUDA_ERROR_UNKNOWN";
    return s;
}

static const char *cu_desc(CUresult r) {
    const char *s = NULL;
    if (!cu.GetErrorString || cu.GetErrorString(r, &s) != CUDA_SUCCESS || !s) return "unrecognised error code";
    return s;
}

/* dlopen `name`; NULL with the reason in err when it is not there. */
static void *open_library(const char *name, char *err, size_t errlen) {
    void *lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(err, errlen, "%s not found: %s", name, why ? why : "dlopen failed");
    }
    return lib;
}

static void cu_load(void) {
    void *lib = open_library("libcuda.so.1", cu_err, sizeof cu_err);
    if (!lib) return;
    const char *missing = NULL;
    if (!load_symbols(lib, &cu, cu_symbols, sizeof cu_symbols / sizeof cu_symbols[0], &missing)) {
        snprintf(cu_err, sizeof cu_err, "libcuda.so.1 lacks %s: the driver is too old for virtual memory management",
                 missing);
        memset(&cu, 0, sizeof cu);
        dlclose(lib);
        return;
    }
    CUresult r = cu.Init(0);
    if (r != CUDA_SUCCESS) {
        snprintf(cu_err, sizeof cu_err, "cuInit: %s (%s)", cu_desc(r), cu_name(r));
        return; /* keep the library: cu_name / cu_desc still work */
    }
    void *p = dlsym(lib, "cuStreamIsCapturing");
    if (p) memcpy(&cuStreamIsCapturing_, &p, sizeof p);
    p = dlsym(lib, "cuThreadExchangeStreamCaptureMode");
    if (p) memcpy(&cuThreadExchangeStreamCaptureMode_, &p, sizeof p);
    cu_ok = 1;
}

/* ---- NVML ------------------------------------------------------------------ */

typedef int nvmlReturn_t;
typedef struct nvmlDevice_st *nvmlDevice_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_INSUFFICIENT_SIZE = 7
};

/* nvmlDeviceGetComputeRunningProcesses_v2/_v3 fill this layout
 * (nvmlProcessInfo_v2_t); the unversioned v1 stops after usedGpuMemory.  Both
 * start the same way, so one reader serves both given the stride. */
typedef struct nvml_proc_v2 {
    unsigned int pid;
    unsigned long long used_gpu_memory;
    unsigned int gpu_instance_id;
    unsigned int compute_instance_id;
} nvml_proc_v2;
typedef struct nvml_proc_v1 {
    unsigned int pid;
    unsigned long long used_gpu_memory;
} nvml_proc_v1;
#define NVML_VALUE_NOT_AVAILABLE (~0ull)

typedef struct nvml_api {
    nvmlReturn_t (*Init)(void);
    nvmlReturn_t (*Shutdown)(void);
    const char *(*ErrorString)(nvmlReturn_t);
    nvmlReturn_t (*DeviceGetHandleByPciBusId)(const char *, nvmlDevice_t *);
    nvmlReturn_t (*DeviceGetComputeRunningProcesses)(nvmlDevice_t, unsigned int *, void *);
} nvml_api;

static nvml_api nv;
static size_t nv_stride; /* sizeof the process record the chosen symbol fills */
static pthread_once_t nv_once = PTHREAD_ONCE_INIT;
static int nv_ok;
static char nv_err[200];

static void nv_load(void) {
    void *lib = open_library("libnvidia-ml.so.1", nv_err, sizeof nv_err);
    if (!lib) return;
    static const sym_entry syms[] = {
        {offsetof(nvml_api, Init), {"nvmlInit_v2", "nvmlInit"}},
        {offsetof(nvml_api, Shutdown), {"nvmlShutdown", NULL}},
        {offsetof(nvml_api, ErrorString), {"nvmlErrorString", NULL}},
        {offsetof(nvml_api, DeviceGetHandleByPciBusId),
         {"nvmlDeviceGetHandleByPciBusId_v2", "nvmlDeviceGetHandleByPciBusId"}},
    };
    const char *missing = NULL;
    if (!load_symbols(lib, &nv, syms, sizeof syms / sizeof syms[0], &missing)) {
        snprintf(nv_err, sizeof nv_err, "libnvidia-ml.so.1 lacks %s", missing);
        memset(&nv, 0, sizeof nv);
        dlclose(lib);
        return;
    }
    static const char *const procs[] = {
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetComputeRunningProcesses",
    };
    for (size_t i = 0; i < 3; i++) {
        void *p = dlsym(lib, procs[i]);
        if (p) {
            memcpy(&nv.DeviceGetComputeRunningProcesses, &p, sizeof p);
            nv_stride = i < 2 ? sizeof(nvml_proc_v2) : sizeof(nvml_proc_v1);
            break;
        }
    }
    if (!nv.DeviceGetComputeRunningProcesses) {
        snprintf(nv_err, sizeof nv_err, "libnvidia-ml.so.1 lacks nvmlDeviceGetComputeRunningProcesses");
        memset(&nv, 0, sizeof nv);
        dlclose(lib);
        return;
    }
    nv_ok = 1;
}

/* ---- the device ------------------------------------------------------------ */

typedef struct cuda_device {
    gm_device base; /* first: a gm_device * is a cuda_device * */
    CUdevice cudev;
    CUcontext ctx;
    char pci_bus_id[32];
    int nvml_state; /* 0 not tried, 1 ready, -1 unavailable (nvml_err says why) */
    nvmlDevice_t nvdev;
    char nvml_err[200];
    /* Who may touch our pages: this GPU, then every peer that can reach it,
     * so tensor.to("cuda:1") and peer kernels read them like cudaMalloc'd
     * memory (which CUDA makes peer-accessible once peer access is on). */
    cu_access_desc access[16];
    size_t n_access;
    int host_location; /* the location type create_host found to work; 0: not tried yet */
} cuda_device;

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static void
set_error(cuda_device *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(c->base.last_error, sizeof c->base.last_error, fmt, ap);
    va_end(ap);
}

/* "cuMemCreate: out of memory (CUDA_ERROR_OUT_OF_MEMORY)" */
static int cu_fail(cuda_device *c, const char *call, CUresult r) {
    set_error(c, "%s: %s (%s)", call, cu_desc(r), cu_name(r));
    return r == CUDA_ERROR_OUT_OF_MEMORY ? GM_ENOMEM : GM_EDEVICE;
}

static int push(cuda_device *c) {
    CUresult r = cu.CtxPushCurrent(c->ctx);
    return r == CUDA_SUCCESS ? GM_OK : cu_fail(c, "cuCtxPushCurrent", r);
}

static void pop(void) {
    CUcontext ignored;
    cu.CtxPopCurrent(&ignored);
}

/* Make the device's primary context current for one call.  Under torch it
 * almost always is already, and a push/pop pair around every page's create
 * and map would double the driver calls of growing the heap. */
static int enter(cuda_device *c, int *pushed) {
    CUcontext cur = NULL;
    *pushed = 0;
    if (cu.CtxGetCurrent(&cur) == CUDA_SUCCESS && cur == c->ctx) return GM_OK;
    int rc = push(c);
    *pushed = rc == GM_OK;
    return rc;
}

static void leave(int pushed) {
    if (pushed) pop();
}

/* Run one driver call inside the device's primary context. */
#define CU_CALL(c, name, call)                                                                                         \
    do {                                                                                                               \
        int pushed_;                                                                                                   \
        int entered_ = enter(c, &pushed_);                                                                             \
        if (entered_ != GM_OK) return entered_;                                                                        \
        CUresult r_ = (call);                                                                                          \
        leave(pushed_);                                                                                                \
        if (r_ != CUDA_SUCCESS) return cu_fail(c, name, r_);                                                           \
    } while (0)

/* The same, with this thread's capture mode relaxed around the call, as torch
 * does around cudaMalloc: creating and mapping memory is legal while a graph
 * is being captured on another stream, but the default (global) mode refuses
 * "unsafe" calls from any thread then. */
#define CU_CALL_RELAXED(c, name, call)                                                                                 \
    do {                                                                                                               \
        int mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;                                                                    \
        int swapped_ =                                                                                                 \
            cuThreadExchangeStreamCaptureMode_ && cuThreadExchangeStreamCaptureMode_(&mode_) == CUDA_SUCCESS;          \
        int pushed_;                                                                                                   \
        int entered_ = enter(c, &pushed_);                                                                             \
        CUresult r_ = CUDA_SUCCESS;                                                                                    \
        if (entered_ == GM_OK) {                                                                                       \
            r_ = (call);                                                                                               \
            leave(pushed_);                                                                                            \
        }                                                                                                              \
        if (swapped_) cuThreadExchangeStreamCaptureMode_(&mode_);                                                      \
        if (entered_ != GM_OK) return entered_;                                                                        \
        if (r_ != CUDA_SUCCESS) return cu_fail(c, name, r_);                                                           \
    } while (0)

static void fill_prop(const cuda_device *c, cu_alloc_prop *prop) {
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->requested_handle_types = CU_MEM_HANDLE_TYPE_NONE;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = c->cudev;
}

static int cuda_reserve(gm_device *dev, size_t size, uintptr_t *va) {
    cuda_device *c = (cuda_device *)dev;
    CUdeviceptr p = 0;
    CU_CALL(c, "cuMemAddressReserve", cu.MemAddressReserve(&p, size, dev->page_size, 0, 0));
    *va = (uintptr_t)p;
    return GM_OK;
}

static int cuda_unreserve(gm_device *dev, uintptr_t va, size_t size) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL(c, "cuMemAddressFree", cu.MemAddressFree((CUdeviceptr)va, size));
    return GM_OK;
}

static int cuda_create(gm_device *dev, size_t pages, gm_handle *handle) {
    cuda_device *c = (cuda_device *)dev;
    cu_alloc_prop prop;
    fill_prop(c, &prop);
    CUmemGenericAllocationHandle h = 0;
    CU_CALL_RELAXED(c, "cuMemCreate", cu.MemCreate(&h, pages * dev->page_size, &prop, 0));
    *handle = (gm_handle)h;
    return GM_OK;
}

static int cuda_release(gm_device *dev, gm_handle handle) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL(c, "cuMemRelease", cu.MemRelease((CUmemGenericAllocationHandle)handle));
    return GM_OK;
}

/* The whole allocation: the driver maps no part of one (offset 0, its size). */
static int cuda_map(gm_device *dev, uintptr_t va, size_t pages, gm_handle handle) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL_RELAXED(c, "cuMemMap",
                    cu.MemMap((CUdeviceptr)va, pages * dev->page_size, 0, (CUmemGenericAllocationHandle)handle, 0));
    return GM_OK;
}

/* One call for the whole range: the driver accepts a range made of several
 * whole mappings, and only refuses to cut one in two. */
static int cuda_unmap(gm_device *dev, uintptr_t va, size_t size) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL(c, "cuMemUnmap", cu.MemUnmap((CUdeviceptr)va, size));
    return GM_OK;
}

static int cuda_set_access(gm_device *dev, uintptr_t va, size_t size) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL_RELAXED(c, "cuMemSetAccess", cu.MemSetAccess((CUdeviceptr)va, size, c->access, c->n_access));
    return GM_OK;
}

static int cuda_event_create(gm_device *dev, gm_event *ev) {
    cuda_device *c = (cuda_device *)dev;
    CUevent e = NULL;
    CU_CALL(c, "cuEventCreate", cu.EventCreate(&e, CU_EVENT_DISABLE_TIMING));
    *ev = (gm_event)(uintptr_t)e;
    return GM_OK;
}

static int cuda_event_destroy(gm_device *dev, gm_event ev) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL(c, "cuEventDestroy", cu.EventDestroy((CUevent)(uintptr_t)ev));
    return GM_OK;
}

static int cuda_event_record(gm_device *dev, gm_event ev, gm_stream stream) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL(c, "cuEventRecord", cu.EventRecord((CUevent)(uintptr_t)ev, (CUstream)(uintptr_t)stream));
    return GM_OK;
}

/* The stream's later work waits on the device for the event's; the host goes on. */
static int cuda_stream_wait(gm_device *dev, gm_stream stream, gm_event ev) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL(c, "cuStreamWaitEvent", cu.StreamWaitEvent((CUstream)(uintptr_t)stream, (CUevent)(uintptr_t)ev, 0));
    return GM_OK;
}

/* Whether the work an event (is_event) or a stream stands for is done: GM_OK,
 * GM_ENOTREADY, or the driver's error. */
static int cuda_query(gm_device *dev, int is_event, uintptr_t handle) {
    cuda_device *c = (cuda_device *)dev;
    int pushed, rc = enter(c, &pushed);
    if (rc != GM_OK) return rc;
    CUresult r = is_event ? cu.EventQuery((CUevent)handle) : cu.StreamQuery((CUstream)handle);
    leave(pushed);
    if (r == CUDA_SUCCESS) return GM_OK;
    if (r == CUDA_ERROR_NOT_READY) return GM_ENOTREADY;
    return cu_fail(c, is_event ? "cuEventQuery" : "cuStreamQuery", r);
}

static int cuda_event_query(gm_device *dev, gm_event ev) { return cuda_query(dev, 1, (uintptr_t)ev); }

static int cuda_stream_query(gm_device *dev, gm_stream stream) { return cuda_query(dev, 0, (uintptr_t)stream); }

/* Pinned (page-locked) host memory, so that copies run at full bus speed. */
static int cuda_host_alloc(gm_device *dev, size_t size, void **out) {
    cuda_device *c = (cuda_device *)dev;
    *out = NULL;
    CU_CALL(c, "cuMemHostAlloc", cu.MemHostAlloc(out, size, 0));
    return GM_OK;
}

static int cuda_host_free(gm_device *dev, void *ptr) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL(c, "cuMemFreeHost", cu.MemFreeHost(ptr));
    return GM_OK;
}

/* Synchronous copies: done when the call returns. */
static int cuda_copy_dtoh(gm_device *dev, void *dst, uintptr_t src, size_t size) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL(c, "cuMemcpyDtoH", cu.MemcpyDtoH(dst, (CUdeviceptr)src, size));
    return GM_OK;
}

static int cuda_copy_htod(gm_device *dev, uintptr_t dst, const void *src, size_t size) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL(c, "cuMemcpyHtoD", cu.MemcpyHtoD((CUdeviceptr)dst, src, size));
    return GM_OK;
}

/* Host-located pages: NUMA node 0, else plain host memory (drivers that take
 * no NUMA id); the one that worked is kept for the next call. */
static int cuda_create_host(gm_device *dev, size_t pages, gm_handle *handle) {
    cuda_device *c = (cuda_device *)dev;
    cu_alloc_prop prop;
    fill_prop(c, &prop);
    prop.location.type = c->host_location ? c->host_location : CU_MEM_LOCATION_TYPE_HOST_NUMA;
    prop.location.id = 0;
    CUmemGenericAllocationHandle h = 0;
    int pushed, rc = enter(c, &pushed);
    if (rc != GM_OK) return rc;
    CUresult r = cu.MemCreate(&h, pages * dev->page_size, &prop, 0);
    if (r != CUDA_SUCCESS && r != CUDA_ERROR_OUT_OF_MEMORY && !c->host_location) {
        prop.location.type = CU_MEM_LOCATION_TYPE_HOST;
        r = cu.MemCreate(&h, pages * dev->page_size, &prop, 0);
    }
    leave(pushed);
    if (r != CUDA_SUCCESS) return cu_fail(c, "cuMemCreate (host)", r);
    c->host_location = prop.location.type;
    *handle = (gm_handle)h;
    return GM_OK;
}

/* Finished when the call returns: a copy between device addresses does not
 * wait by itself. */
static int cuda_copy_dtod(gm_device *dev, uintptr_t dst, uintptr_t src, size_t size) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL(c, "cuMemcpyDtoD", cu.MemcpyDtoD((CUdeviceptr)dst, (CUdeviceptr)src, size)); /* the caller waits */
    return GM_OK;
}

static int cuda_synchronize(gm_device *dev) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL(c, "cuCtxSynchronize", cu.CtxSynchronize());
    return GM_OK;
}

static int cuda_mem_info(gm_device *dev, size_t *free_bytes, size_t *total_bytes) {
    cuda_device *c = (cuda_device *)dev;
    CU_CALL_RELAXED(c, "cuMemGetInfo", cu.MemGetInfo(free_bytes, total_bytes)); /* the slow path asks */
    return GM_OK;
}

/* NVML is brought up for this device on first use and its failure remembered,
 * so a machine without it pays for the attempt once. */
static int nvml_ready(cuda_device *c) {
    if (c->nvml_state == 0) {
        pthread_once(&nv_once, nv_load);
        nvmlReturn_t r;
        if (!nv_ok) {
            snprintf(c->nvml_err, sizeof c->nvml_err, "%s", nv_err);
        } else if ((r = nv.Init()) != NVML_SUCCESS) {
            snprintf(c->nvml_err, sizeof c->nvml_err, "nvmlInit: %s", nv.ErrorString(r));
        } else if ((r = nv.DeviceGetHandleByPciBusId(c->pci_bus_id, &c->nvdev)) != NVML_SUCCESS) {
            snprintf(c->nvml_err, sizeof c->nvml_err, "nvmlDeviceGetHandleByPciBusId(%s): %s", c->pci_bus_id,
                     nv.ErrorString(r));
            nv.Shutdown();
        } else {
            c->nvml_state = 1;
            return 1;
        }
        c->nvml_state = -1;
    }
    return c->nvml_state == 1;
}

static int cuda_processes(gm_device *dev, gm_proc_usage *out, size_t cap, size_t *n) {
    cuda_device *c = (cuda_device *)dev;
    if (!nvml_ready(c)) {
        set_error(c, "processes: %s", c->nvml_err);
        return GM_ENOTSUP;
    }
    /* The list can grow between the sizing call and the real one; retry a few
     * times with room to spare. */
    unsigned char stack_buf[64 * sizeof(nvml_proc_v2)];
    unsigned char *buf = stack_buf;
    unsigned int room = (unsigned int)(sizeof stack_buf / nv_stride);
    nvmlReturn_t r = NVML_SUCCESS;
    unsigned int count = 0;
    for (int attempt = 0; attempt < 4; attempt++) {
        count = room;
        r = nv.DeviceGetComputeRunningProcesses(c->nvdev, &count, buf);
        if (r != NVML_ERROR_INSUFFICIENT_SIZE) break;
        if (buf != stack_buf) free(buf);
        room = count + 16;
        buf = malloc((size_t)room * nv_stride);
        if (!buf) {
            set_error(c, "processes: out of host memory for %u entries", room);
            return GM_EDEVICE;
        }
    }
    if (r != NVML_SUCCESS) {
        set_error(c, "nvmlDeviceGetComputeRunningProcesses: %s", nv.ErrorString(r));
        if (buf != stack_buf) free(buf);
        return GM_EDEVICE;
    }
    for (unsigned int i = 0; i < count && i < cap; i++) {
        nvml_proc_v1 rec; /* the common prefix of both layouts */
        memcpy(&rec, buf + (size_t)i * nv_stride, sizeof rec);
        out[i].pid = rec.pid;
        /* Without the right to see it (containers, MIG, Windows) NVML says
         * "not available"; report nothing rather than 16 EiB. */
        out[i].bytes = rec.used_gpu_memory == NVML_VALUE_NOT_AVAILABLE ? 0 : rec.used_gpu_memory;
    }
    *n = count;
    if (buf != stack_buf) free(buf);
    return GM_OK;
}

static int cuda_capture_status(gm_device *dev, gm_stream stream, int *capturing) {
    cuda_device *c = (cuda_device *)dev;
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    *capturing = 0;
    if (!cuStreamIsCapturing_) return GM_OK; /* a driver without graphs captures nothing */
    int pushed, rc = enter(c, &pushed);
    if (rc != GM_OK) return rc;
    CUresult r = cuStreamIsCapturing_((CUstream)(uintptr_t)stream, &status);
    leave(pushed);
    if (r >= CUDA_ERROR_STREAM_CAPTURE_FIRST && r <= CUDA_ERROR_STREAM_CAPTURE_LAST) {
        *capturing = 1;
        return GM_OK;
    }
    if (r != CUDA_SUCCESS) return cu_fail(c, "cuStreamIsCapturing", r);
    *capturing = status != CU_STREAM_CAPTURE_STATUS_NONE;
    return GM_OK;
}

static void cuda_destroy(gm_device *dev) {
    cuda_device *c = (cuda_device *)dev;
    if (!c) return;
    if (c->nvml_state == 1) nv.Shutdown();
    cu.DevicePrimaryCtxRelease(c->cudev);
    free(c);
}

/* .reserve = cuda_reserve, and so on for every counted op (GM_EACH_DEV_OP) */
#define CUDA_OP(upper, lower) .lower = cuda_##lower,
/* clang-format off */
static const gm_device_ops cuda_ops = {
    GM_EACH_DEV_OP(CUDA_OP)
    .destroy = cuda_destroy,
    .capture_status = cuda_capture_status,
    .stream_query = cuda_stream_query,
};
/* clang-format on */
#undef CUDA_OP

/* The driver's handle of device `ordinal`, its name, and how many there are;
 * only once the device is known to map virtual memory. */
static int find_device(int ordinal, CUdevice *cudev, char *gpu, size_t gpulen, int *count, char *err, size_t errlen) {
    CUresult r;
    if ((r = cu.DeviceGetCount(count)) != CUDA_SUCCESS)
        return gm_errorf(GM_EDEVICE, err, errlen, "cuDeviceGetCount: %s (%s)", cu_desc(r), cu_name(r));
    if (ordinal < 0 || ordinal >= *count)
        return gm_errorf(GM_EDEVICE, err, errlen, "device %d does not exist (%d device%s)", ordinal, *count,
                         *count == 1 ? "" : "s");
    if ((r = cu.DeviceGet(cudev, ordinal)) != CUDA_SUCCESS)
        return gm_errorf(GM_EDEVICE, err, errlen, "cuDeviceGet(%d): %s (%s)", ordinal, cu_desc(r), cu_name(r));
    if (cu.DeviceGetName(gpu, (int)gpulen, *cudev) != CUDA_SUCCESS) snprintf(gpu, gpulen, "unknown GPU");
    gpu[gpulen - 1] = '\0';
    int vmm = 0;
    if ((r = cu.DeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, *cudev)) !=
        CUDA_SUCCESS)
        return gm_errorf(GM_EDEVICE, err, errlen, "cuDeviceGetAttribute: %s (%s)", cu_desc(r), cu_name(r));
    if (!vmm)
        return gm_errorf(GM_EDEVICE, err, errlen, "device %d (%s) does not support virtual memory management", ordinal,
                         gpu);
    return GM_OK;
}

/* Who may touch the pages: this GPU, then each of the `count` devices that can
 * reach it as a peer. */
static void fill_access(cuda_device *c, int count) {
    for (int o = -1; o < count && c->n_access < sizeof c->access / sizeof c->access[0]; o++) {
        CUdevice peer = c->cudev;
        int can = 1;
        if (o >= 0 && (o == c->base.ordinal || cu.DeviceGet(&peer, o) != CUDA_SUCCESS ||
                       cu.DeviceCanAccessPeer(&can, peer, c->cudev) != CUDA_SUCCESS || !can))
            continue;
        cu_access_desc *d = &c->access[c->n_access++];
        memset(d, 0, sizeof *d);
        d->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        d->location.id = peer;
        d->flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    }
}

/* Retain the primary context and settle the page size: the granularity, or
 * page_size when that is a multiple of it.  On failure the context is let go. */
static int open_context(cuda_device *c, size_t page_size, char *err, size_t errlen) {
    int ordinal = c->base.ordinal;
    CUresult r;
    if ((r = cu.DevicePrimaryCtxRetain(&c->ctx, c->cudev)) != CUDA_SUCCESS)
        return gm_errorf(GM_EDEVICE, err, errlen, "cuDevicePrimaryCtxRetain(%d): %s (%s)", ordinal, cu_desc(r),
                         cu_name(r));
    cu_alloc_prop prop;
    fill_prop(c, &prop);
    size_t gran = 0;
    if ((r = cu.CtxPushCurrent(c->ctx)) == CUDA_SUCCESS) {
        r = cu.MemGetAllocationGranularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        pop();
    }
    int rc = GM_OK;
    if (r != CUDA_SUCCESS)
        rc = gm_errorf(GM_EDEVICE, err, errlen, "cuMemGetAllocationGranularity: %s (%s)", cu_desc(r), cu_name(r));
    else if (gran == 0)
        rc = gm_errorf(GM_EDEVICE, err, errlen, "cuMemGetAllocationGranularity returned 0");
    else if (page_size && page_size % gran)
        rc = gm_errorf(GM_EINVAL, err, errlen, "page_size %zu is not a multiple of device %d's granularity (%zu bytes)",
                       page_size, ordinal, gran);
    if (rc != GM_OK) {
        cu.DevicePrimaryCtxRelease(c->cudev);
        return rc;
    }
    c->base.page_size = page_size ? page_size : gran;
    return GM_OK;
}

int gm_cuda_create(int ordinal, size_t page_size, gm_device **out, char *err, size_t errlen) {
    *out = NULL;
    const char *faults = getenv("GPUMEM_CUDA_FAULTS");
    faults = faults && *faults ? faults : NULL;
    /* Checked before anything else, so a bad value fails on any machine. */
    if (faults && gm_faults_schedule(NULL, faults, "GPUMEM_CUDA_FAULTS", err, errlen) != GM_OK) return GM_EDEVICE;
    if (gm_check_page_size(page_size, err, errlen) != GM_OK) return GM_EINVAL;
    pthread_once(&cu_once, cu_load);
    if (!cu_ok) return gm_errorf(GM_EDEVICE, err, errlen, "%s", cu_err);

    CUdevice cudev;
    int count = 0;
    char gpu[64] = "unknown GPU";
    int rc = find_device(ordinal, &cudev, gpu, sizeof gpu, &count, err, errlen);
    if (rc != GM_OK) return rc;
    cuda_device *c = calloc(1, sizeof *c);
    if (!c) return gm_errorf(GM_ENOMEM, err, errlen, "out of host memory");
    c->base.ops = &cuda_ops;
    c->base.kind = "cuda";
    c->base.ordinal = ordinal;
    c->cudev = cudev;
    fill_access(c, count);
    snprintf(c->base.name, sizeof c->base.name, "cuda:%d (%s)", ordinal, gpu);
    if (cu.DeviceGetPCIBusId(c->pci_bus_id, (int)sizeof c->pci_bus_id, cudev) != CUDA_SUCCESS)
        c->pci_bus_id[0] = '\0'; /* processes() will then report NVML unusable */
    if ((rc = open_context(c, page_size, err, errlen)) != GM_OK) {
        free(c);
        return rc;
    }
    if (!faults) {
        *out = &c->base;
        return GM_OK;
    }
    /* Test-only fault injection: the schedule in GPUMEM_CUDA_FAULTS, on a wrapper. */
    gm_device *w = gm_faults_wrap(&c->base, "GPUMEM_CUDA_FAULTS");
    if (!w) {
        cuda_destroy(&c->base);
        return gm_errorf(GM_ENOMEM, err, errlen, "out of host memory");
    }
    gm_faults_schedule(w, faults, "GPUMEM_CUDA_FAULTS", err, errlen);
    *out = w;
    return GM_OK;
}

uint64_t gm_cuda_fault_calls(const gm_device *dev, gm_dev_op op, uint64_t *fired) {
    if (fired) *fired = 0;
    if (!dev || strcmp(dev->kind, "cuda")) return 0;
    return gm_faults_calls(dev, op, fired);
}
