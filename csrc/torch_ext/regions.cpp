/*
 * regions.cpp -- torch.compile's regions, for snapshots' trace entries
 * (torch.cuda.memory._record_memory_history(..., compile_context=True)).
 *
 * Dynamo runs each compiled frame inside a RecordFunction named
 * "Torch-Compiled Region: <frame>/<recompile>"; torch's own allocator keeps a
 * stack of the regions entered, and each trace entry carries the innermost
 * ("N/A" outside any).  A RecordFunction callback is C++ only, so this file
 * (built on first use against torch's headers, linked to libc10 and
 * libtorch_cpu, called through ctypes) registers one global callback that
 * hands each region's entry and exit to gpumem.torch, which keeps the stack
 * as a timeline the snapshot reads.  It needs no CUDA.
 */
#include <ATen/record_function.h>

#include <atomic>
#include <cstring>
#include <mutex>

#ifndef GM_TORCH_VERSION
#error "build with -DGM_TORCH_VERSION=\"<torch.__version__>\""
#endif

namespace {

constexpr const char kPrefix[] = "Torch-Compiled Region";

typedef void (*region_fn)(const char *name, int entered);

std::mutex g_mu;
at::CallbackHandle g_handle = 0;
std::atomic<region_fn> g_fn{nullptr};

bool is_region(const at::RecordFunction &fn) {
    const char *name = fn.name();
    return name && std::strncmp(name, kPrefix, sizeof kPrefix - 1) == 0;
}

std::unique_ptr<at::ObserverContext> on_enter(const at::RecordFunction &fn) {
    region_fn f = g_fn.load(std::memory_order_acquire);
    if (f && is_region(fn)) f(fn.name(), 1);
    return nullptr;
}

void on_exit(const at::RecordFunction &fn, at::ObserverContext *) {
    region_fn f = g_fn.load(std::memory_order_acquire);
    if (f && is_region(fn)) f(fn.name(), 0);
}

} // namespace

extern "C" {

/* The torch this file was built against (torch.__version__). */
__attribute__((visibility("default"))) const char *gm_regions_torch_version(void) { return GM_TORCH_VERSION; }

/* Call fn(name, 1) as each compiled region is entered and fn(name, 0) as it is
 * left, on the thread that runs it, until gm_regions_stop.  Once is enough:
 * a second call only changes fn. */
__attribute__((visibility("default"))) void gm_regions_start(region_fn fn) {
    std::lock_guard<std::mutex> lock(g_mu);
    g_fn.store(fn, std::memory_order_release);
    if (!g_handle) g_handle = at::addGlobalCallback(at::RecordFunctionCallback(on_enter, on_exit));
}

__attribute__((visibility("default"))) void gm_regions_stop(void) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (g_handle) at::removeCallback(g_handle);
    g_handle = 0;
    g_fn.store(nullptr, std::memory_order_release);
}

} // extern "C"
