/*
 * torch_profiler.cpp -- torch's profiler (torch.profiler.profile(profile_memory=True)) told of
 * every allocation and free, as torch's allocator tells it.
 */
#include <Python.h>

#include <dlfcn.h>

#include "torch_boundary.h"

using namespace gm_torch;

namespace {

/* ---- torch's profiler (torch.profiler.profile(profile_memory=True)) ---------------
 *
 * torch's allocator tells the profiler of every allocation and free through
 * c10::reportMemoryUsageToProfiler.  gpumem does the same without libtorch's
 * headers: both functions are looked up by their mangled names in the process
 * (torch's libc10 is loaded before torch calls an allocator), and c10::Device,
 * two int8_t fields (DeviceType, DeviceIndex) passed by value, is spelled below.
 * Nothing is done unless c10::memoryProfilingEnabled() says a profiler listens. */
struct c10_device {
    int8_t type; /* c10::DeviceType::CUDA */
    int8_t index;
};
constexpr int8_t kC10DeviceCuda = 1;
typedef bool (*profiling_enabled_fn)();
typedef void (*report_memory_fn)(void *ptr, int64_t alloc_size, size_t total_allocated, size_t total_reserved,
                                 c10_device device);
std::atomic<profiling_enabled_fn> g_profiling_enabled{nullptr};
std::atomic<report_memory_fn> g_report_memory{nullptr};
std::atomic<bool> g_profiler_looked_up{false};

} // namespace

void gm_torch::look_up_profiler() {
    static const char kEnabled[] = "_ZN3c1022memoryProfilingEnabledEv";
    static const char kReport[] = "_ZN3c1027reportMemoryUsageToProfilerEPvlmmNS_6DeviceE";
    void *enabled = dlsym(RTLD_DEFAULT, kEnabled);
    void *report = dlsym(RTLD_DEFAULT, kReport);
    if (!enabled || !report) {
        /* torch loads libc10 with local symbols: ask the library itself, if loaded
         * (RTLD_NOLOAD never loads it; the handle is kept for the process's life) */
        if (void *c10 = dlopen("libc10.so", RTLD_LAZY | RTLD_NOLOAD)) {
            enabled = dlsym(c10, kEnabled);
            report = dlsym(c10, kReport);
        }
    }
    if (enabled && report) {
        g_report_memory.store((report_memory_fn)report, std::memory_order_relaxed);
        g_profiling_enabled.store((profiling_enabled_fn)enabled, std::memory_order_release);
    }
    g_profiler_looked_up.store(true, std::memory_order_release);
}

/* `delta` bytes at ptr were allocated (> 0) or freed (< 0) on device. */
void gm_torch::report_to_profiler(gm_heap *h, int device, void *ptr, int64_t delta) {
    if (!g_profiler_looked_up.load(std::memory_order_acquire)) look_up_profiler();
    profiling_enabled_fn enabled = g_profiling_enabled.load(std::memory_order_acquire);
    if (!enabled || !enabled()) return;
    gm_stats st;
    gm_get_stats(h, &st);
    g_report_memory.load(std::memory_order_relaxed)(ptr, delta, (size_t)st.allocated_bytes[GM_POOL_ALL].current,
                                                    (size_t)st.reserved_bytes[GM_POOL_ALL].current,
                                                    c10_device{kC10DeviceCuda, (int8_t)device});
}
