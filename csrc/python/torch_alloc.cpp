/*
 * torch_alloc.cpp -- the C++ boundary between PyTorch and gpumem's C core.
 *
 * torch.cuda.memory.CUDAPluggableAllocator calls plain C functions by address:
 *   void *alloc(size_t size, int device, cudaStream_t stream)
 *   void  free(void *ptr, size_t size, int device, cudaStream_t stream)
 * and its hook setters take void(), void(double, int), void(void *, cudaStream_t)
 * and void(int).  Those live here, with extern "C" names and default
 * visibility so ctypes can find them in gpumem._C.
 *
 * Why C++: torch stores whatever alloc returns as the tensor's address without
 * looking, so a NULL return makes the next kernel fault and poisons the CUDA
 * context for good.  The only way to refuse an allocation is to throw a C++
 * exception through torch's frames, which torch turns into a Python exception.
 *
 * Which exception: torch maps c10::OutOfMemoryError to torch.OutOfMemoryError,
 * but building that object needs libtorch's headers and libraries.  torch also
 * catches `python_error` (torch/csrc/Exceptions.h) first of all its handlers and
 * re-raises the Python exception stored in it.  C++ matches a catch clause by the
 * type's mangled name (libstdc++ compares type_info names), so an exception
 * class named python_error with the same four fields is caught there, and
 * torch raises exactly the torch.OutOfMemoryError instance we built.  Were the
 * match ever to fail, the class is still a std::exception whose what() is the
 * message, which torch turns into a RuntimeError with the same text -- so the
 * worst case is the plain RuntimeError the issue asks for.  docs/torch.md has
 * the details; oom_mode GM_TORCH_OOM_RUNTIME skips the trick.
 *
 * Private pools (CUDA graphs, MemPool): torch's pool hooks are std::function
 * objects built from plain function addresses, so the three hooks below have
 * exactly the C++ signatures torch's std::function types name, and need only
 * <functional> and <utility> -- no libtorch.  The one thing that must agree with
 * torch is the standard library ABI (_GLIBCXX_USE_CXX11_ABI); gpumem.torch
 * compares it with torch's before setting them.
 *
 * The heaps themselves, one per device, their options and caps, are the
 * process-wide heap registry's (heap_registry.h), shared with CuPy and Numba.
 *
 * Locks, and fork(): the boundary's own lock is slot.pool_mu, one per device,
 * never nested with another lock of the boundary or of the heap registry; it
 * may be held while calling into the core (which never calls back out while it
 * holds a lock of its own).  None is held while calling
 * anything that may wait for the GIL: route() calls the pools' stream filters
 * (which may be Python callables) on a copy of the list, outside pool_mu (and
 * pool_end, with the GIL released, waits for the calls in flight, so that a
 * filter is never running once its pool's end returns, as under torch's own
 * allocator, which calls them under its lock); the
 * context hook, the OOM formatter and the Python exception are all reached
 * with no lock held.  That is what lets fork() take them all: fork_lock_all
 * (handed to the core's one pthread_atfork registration, core/fork.c) takes
 * every pool_mu before the core takes its own, and a forked child (a DataLoader worker) gets them back
 * released instead of held by a thread that does not exist there.
 */
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <chrono>
#include <future>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <dlfcn.h>
#include <pthread.h>
#include <unistd.h>
#include <utility>
#include <vector>

#include "convert.h"
#include "ext_pool.h"
#include "heap_registry.h"
#include "torch_alloc.h"

/* ---- the exception torch re-raises as a Python exception ------------------- */

/* Field order and types mirror torch's python_error: vtable (std::exception),
 * type, value, traceback, message.  torch's handler only calls restore() on it
 * (reads the three pointers) and what() (virtual, ours). */
struct python_error : public std::exception {
    PyObject *type = nullptr;
    PyObject *value = nullptr;
    PyObject *traceback = nullptr;
    std::string message;

    python_error() = default;
    python_error(const python_error &other)
        : std::exception(other), type(other.type), value(other.value), traceback(other.traceback),
          message(other.message) {
        if (type || value || traceback) {
            PyGILState_STATE st = PyGILState_Ensure();
            Py_XINCREF(type);
            Py_XINCREF(value);
            Py_XINCREF(traceback);
            PyGILState_Release(st);
        }
    }
    python_error(python_error &&other) noexcept
        : std::exception(other), type(other.type), value(other.value), traceback(other.traceback),
          message(std::move(other.message)) {
        other.type = other.value = other.traceback = nullptr;
    }
    python_error &operator=(const python_error &) = delete;
    python_error &operator=(python_error &&) = delete;
    ~python_error() override {
        if ((type || value || traceback) && Py_IsInitialized()) {
            PyGILState_STATE st = PyGILState_Ensure();
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(traceback);
            PyGILState_Release(st);
        }
    }
    const char *what() const noexcept override { return message.c_str(); }
};

/* The types torch's pool hooks are declared with (c10::cuda::MempoolId_t and
 * cudaStream_t), spelled without torch's or CUDA's headers. */
struct CUstream_st;
typedef CUstream_st *gm_cuda_stream_t;
typedef std::pair<unsigned long long, unsigned long long> gm_torch_mempool_id;
typedef std::function<bool(gm_cuda_stream_t)> gm_torch_filter;

/* ---- torch's state of each device ------------------------------------------- */

namespace {

/* A pool that allocations are being routed to (between begin and end). */
struct active_pool {
    gm_pool_id id;
    gm_torch_filter filter;
};

struct active_list : std::vector<active_pool> {
    using std::vector<active_pool>::vector;
    active_list() = default;
    active_list(const active_list &o) : std::vector<active_pool>(o) {}
    /* route() calls running this list's filters now */
    mutable std::atomic<long> routing{0};
};

/* torch's state of one device (its heap is the heap registry's). */
struct slot {
    /* Pools being allocated to, in the order begun.  pool_mu guards the
     * pointer only: a list once published is never changed (begin and end
     * publish a new one), so route() copies the pointer and runs the filters
     * without the lock.  n_active lets the hot path skip the lock while no
     * pool is active. */
    std::mutex pool_mu;
    std::shared_ptr<const active_list> active;
    std::atomic<size_t> n_active{0};
    /* Lists replaced while route() calls were running their filters.  torch
     * runs filters under its allocator's lock, so once endAllocateToPool
     * returns a pool's filter -- CUDAGraph's reads the graph object, which
     * may be deleted next -- is not running: pool_end waits for these. */
    std::vector<std::shared_ptr<const active_list>> retired;
};

slot g_slots[GM_HEAP_REGISTRY_MAX_DEVICES];
std::atomic<int> g_oom_mode{GM_TORCH_OOM_TORCH};
std::atomic<int> g_device_count{-1};
std::atomic<gm_torch_context_fn> g_context_fn{nullptr};
PyObject *g_oom_class = nullptr;    /* guarded by the GIL */
PyObject *g_oom_observer = nullptr; /* guarded by the GIL */

std::atomic<uint64_t> c_ooms{0}, c_oom_retries{0}, c_free_errors{0}, c_empty_cache{0}, c_record_stream{0},
    c_fraction{0};

/* fork(): every boundary lock, in the order of the comment at the top. */
void fork_lock_all() {
    for (slot &s : g_slots) s.pool_mu.lock();
}

void fork_unlock_all() {
    for (slot &s : g_slots) s.pool_mu.unlock();
}

/* A forked child has only the forking thread: route() calls of the others
 * never finish there, and pool_end must not wait for them. */
void fork_child_routes() {
    for (slot &s : g_slots) {
        if (s.active) s.active->routing.store(0);
        for (const auto &l : s.retired) l->routing.store(0);
    }
}

/* Handed to the core when the library is loaded: before any thread can have
 * called in, and whether Python imported it or torch and ctypes opened it. */
struct fork_registration {
    fork_registration() {
        gm_fork_also(fork_lock_all, fork_unlock_all);
        pthread_atfork(nullptr, nullptr, fork_child_routes);
    }
} g_fork_registration;

[[noreturn]] void throw_oom(const std::string &msg) {
    c_ooms.fetch_add(1, std::memory_order_relaxed);
    if (g_oom_mode.load(std::memory_order_relaxed) == GM_TORCH_OOM_TORCH && Py_IsInitialized()) {
        python_error e;
        PyGILState_STATE st = PyGILState_Ensure();
        if (PyObject *cls = g_oom_class) {
            Py_INCREF(cls); /* the call may replace it */
            PyObject *value = PyObject_CallFunction(cls, "s", msg.c_str());
            Py_DECREF(cls);
            if (value) {
                e.type = (PyObject *)Py_TYPE(value);
                Py_INCREF(e.type);
                e.value = value;
            } else {
                PyErr_Clear();
            }
        }
        PyGILState_Release(st);
        if (e.type) {
            e.message = msg;
            throw e;
        }
    }
    throw std::runtime_error(msg);
}

/* route() calls on this thread now: a filter that ends a pool cannot wait for itself. */
thread_local int t_routing = 0;

/* The pool an allocation on `stream` goes to: the most recently begun active
 * pool whose filter accepts the stream (torch's allocator picks the same way),
 * or false. */
bool route(slot &s, gm_stream stream, gm_pool_id *out) {
    if (s.n_active.load(std::memory_order_acquire) == 0) return false;
    std::shared_ptr<const active_list> list;
    {
        std::lock_guard<std::mutex> g(s.pool_mu);
        list = s.active;
        if (list) list->routing.fetch_add(1, std::memory_order_relaxed);
    }
    if (!list) return false;
    struct done {
        const active_list &l;
        ~done() {
            t_routing--;
            l.routing.fetch_sub(1, std::memory_order_release);
        }
    } guard{*list};
    t_routing++;
    for (auto a = list->rbegin(); a != list->rend(); ++a) {
        if (a->filter((gm_cuda_stream_t)(uintptr_t)stream)) {
            *out = a->id;
            return true;
        }
    }
    return false;
}

/* Under pool_mu: make `next` the list route() reads.  The list it replaces is
 * kept while route() calls run its filters; lists no call runs any more go to
 * `dropped`, to be freed after the lock (they may hold a filter's last reference). */
void publish(slot &s, std::shared_ptr<const active_list> next,
             std::vector<std::shared_ptr<const active_list>> *dropped) {
    auto idle = [](const std::shared_ptr<const active_list> &l) {
        return l->routing.load(std::memory_order_acquire) <= 0;
    };
    s.n_active.store(next->size(), std::memory_order_release);
    std::shared_ptr<const active_list> old = std::move(s.active);
    s.active = std::move(next);
    auto it = std::stable_partition(s.retired.begin(), s.retired.end(), [&](const auto &l) { return !idle(l); });
    dropped->insert(dropped->end(), std::make_move_iterator(it), std::make_move_iterator(s.retired.end()));
    s.retired.erase(it, s.retired.end());
    if (old) (idle(old) ? *dropped : s.retired).push_back(std::move(old));
}

/* Wait until no route() call runs these lists' filters.  A filter may be a
 * Python callable waiting for the GIL, which this thread may hold. */
void wait_routes(const std::vector<std::shared_ptr<const active_list>> &lists) {
    bool busy = false;
    if (t_routing) return;
    for (const auto &l : lists) busy = busy || l->routing.load(std::memory_order_acquire) > 0;
    if (!busy) return;
    PyThreadState *ts = Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr;
    for (const auto &l : lists)
        while (l->routing.load(std::memory_order_acquire) > 0)
            std::this_thread::sleep_for(std::chrono::microseconds(20));
    if (ts) PyEval_RestoreThread(ts);
}

gm_heap *heap_or_throw(int device) {
    if (!gm_heap_registry_valid(device))
        throw std::runtime_error("gpumem: CUDA device index " + std::to_string(device) + " is out of range");
    gm_heap *h = gm_heap_registry_get(device);
    if (!h) {
        char why[512] = "";
        if (!(h = gm_heap_registry_open(device, why, sizeof why))) throw std::runtime_error(why);
    }
    return h;
}

std::string pool_name(gm_pool_id id) { return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")"; }

void pool_begin(int device, gm_pool_id id, gm_torch_filter filter) {
    gm_heap *h = heap_or_throw(device);
    int rc = gm_pool_retain(h, id);
    if (rc != GM_OK)
        throw std::runtime_error("gpumem: cannot begin allocating to pool " + pool_name(id) + " on GPU " +
                                 std::to_string(device) + ": " + gm_strerror(rc));
    slot &s = g_slots[device];
    {
        std::vector<std::shared_ptr<const active_list>> dropped; /* freed after the lock */
        std::lock_guard<std::mutex> g(s.pool_mu);
        auto next = s.active ? std::make_shared<active_list>(*s.active) : std::make_shared<active_list>();
        next->push_back(active_pool{id, std::move(filter)});
        publish(s, std::move(next), &dropped);
    }
    /* torch calls begin before cudaStreamBeginCapture (and for MemPool's
     * calling-thread filter, with no capture at all), so the driver cannot say
     * yet whether a capture follows: the heap is told one may, as torch's own
     * allocator counts every active pool as a capture under way. */
    gm_capture_begin(h);
}

bool pool_end(int device, gm_pool_id id) {
    gm_heap *h = gm_heap_registry_get(device);
    if (!h) return false;
    slot &s = g_slots[device];
    bool found = false;
    std::vector<std::shared_ptr<const active_list>> dropped, in_flight; /* freed after the lock */
    {
        std::lock_guard<std::mutex> g(s.pool_mu);
        if (s.active) {
            auto it = std::find_if(s.active->begin(), s.active->end(), [&](const active_pool &a) {
                return a.id.first == id.first && a.id.second == id.second;
            });
            if (it != s.active->end()) {
                auto next = std::make_shared<active_list>(s.active->begin(), it);
                next->insert(next->end(), it + 1, s.active->end());
                publish(s, std::move(next), &dropped);
                in_flight = s.retired;
                found = true;
            }
        }
    }
    wait_routes(in_flight);
    if (found) gm_capture_end(h);
    return found;
}

int pool_release(int device, gm_pool_id id) {
    gm_heap *h = gm_heap_registry_get(device);
    return h ? gm_pool_release(h, id) : GM_EINVAL;
}

std::string oom_message(int device, gm_heap *h, size_t size, gm_oom_info *info) {
    if (gm_last_oom(h, info) != GM_OK || info->request < size) gm_memory_report(h, size, info);
    std::string buf(GM_TORCH_OOM_MSG_MAX, '\0');
    size_t n = gm_torch_format_oom(device, info, &buf[0], buf.size());
    buf.resize(n);
    return buf;
}

/* torch's out-of-memory observers (torch._C._cuda_attach_out_of_memory_observer),
 * which gpumem.torch keeps in Python: called once per failed allocation, after
 * the message is built and before the exception, with the GIL and no lock held,
 * and with torch's arguments -- the device, the bytes asked for, the most this
 * process may use (the cap, else the device's total) and the device's free
 * bytes.  An observer that raises replaces the OOM with its own exception, as
 * under torch's allocator. */
void observe_oom(int device, size_t size, const gm_oom_info &info) {
    if (!Py_IsInitialized()) return;
    python_error e;
    PyGILState_STATE st = PyGILState_Ensure();
    if (PyObject *fn = g_oom_observer) {
        Py_INCREF(fn);
        unsigned long long allowed = info.cap_bytes ? info.cap_bytes : info.device_total;
        PyObject *r = PyObject_CallFunction(fn, "iKKK", device, (unsigned long long)size, allowed,
                                            (unsigned long long)info.device_free);
        Py_DECREF(fn);
        if (r)
            Py_DECREF(r);
        else
            PyErr_Fetch(&e.type, &e.value, &e.traceback);
    }
    PyGILState_Release(st);
    if (e.type) {
        e.message = "gpumem: an out-of-memory observer raised";
        throw e;
    }
}

/* torch refuses any request of 1 EiB or more before its allocator looks at it. */
constexpr size_t kOneExaByte = (size_t)1 << 60;

/* ---- where events come from (torch's context="all") ---------------------------- */

/* Set while torch records history with context="all" and Python stacks: a free
 * and an empty_cache then take the stack of their caller for the events they
 * record, as torch's allocator does. */
std::atomic<bool> g_event_stacks{false};

/* The caller's stack for the events a free or an empty_cache records, or 0. */
uint64_t caller_context() {
    if (!g_event_stacks.load(std::memory_order_relaxed)) return 0;
    gm_torch_context_fn fn = g_context_fn.load(std::memory_order_relaxed);
    return fn ? fn() : 0;
}

/* The events the core records in this scope carry `context` (none given: their
 * blocks' own); the one set before comes back at the end, exceptions included. */
struct event_context_scope {
    uint64_t previous;
    explicit event_context_scope(uint64_t context) : previous(gm_history_event_context(context)) {}
    ~event_context_scope() { gm_history_event_context(previous); }
    event_context_scope(const event_context_scope &) = delete;
    event_context_scope &operator=(const event_context_scope &) = delete;
};

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

void look_up_profiler() {
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
void report_to_profiler(gm_heap *h, int device, void *ptr, int64_t delta) {
    if (!g_profiler_looked_up.load(std::memory_order_acquire)) look_up_profiler();
    profiling_enabled_fn enabled = g_profiling_enabled.load(std::memory_order_acquire);
    if (!enabled || !enabled()) return;
    gm_stats st;
    gm_get_stats(h, &st);
    g_report_memory.load(std::memory_order_relaxed)(ptr, delta, (size_t)st.allocated_bytes[GM_POOL_ALL].current,
                                                    (size_t)st.reserved_bytes[GM_POOL_ALL].current,
                                                    c10_device{kC10DeviceCuda, (int8_t)device});
}

} // namespace

/* ---- torch's settings ----------------------------------------------------------- */

extern "C" void gm_torch_set_oom_mode(int mode) { g_oom_mode.store(mode); }

extern "C" int gm_torch_get_oom_mode(void) { return g_oom_mode.load(); }

extern "C" int gm_torch_device_count(void) { return g_device_count.load(); }

extern "C" void gm_torch_set_oom_observer(void *py_callable) {
    PyObject *old = g_oom_observer;
    g_oom_observer = (PyObject *)py_callable;
    Py_XINCREF(g_oom_observer);
    Py_XDECREF(old);
}

extern "C" void gm_torch_set_oom_class(void *py_class) {
    PyObject *old = g_oom_class;
    g_oom_class = (PyObject *)py_class;
    Py_XINCREF(g_oom_class);
    Py_XDECREF(old);
}

extern "C" void gm_torch_get_counters(gm_torch_counters *c) {
    c->ooms = c_ooms.load();
    c->oom_retries = c_oom_retries.load();
    c->free_errors = c_free_errors.load();
    c->empty_cache_calls = c_empty_cache.load();
    c->record_stream_calls = c_record_stream.load();
    c->fraction_calls = c_fraction.load();
}

/* Throws torch's out-of-memory error for a request the heap was not asked to
 * place (its own last failure is not this one): the message from a fresh
 * report, the observers called first; `why` follows the message. */
[[noreturn]] static void throw_fresh_oom(gm_heap *h, int device, size_t size, void *stream, const char *why = "") {
    gm_oom_info info;
    gm_memory_report(h, size, &info);
    std::string msg(GM_TORCH_OOM_MSG_MAX, '\0');
    msg.resize(gm_torch_format_oom(device, &info, &msg[0], msg.size()));
    observe_oom(device, size, info);
    gm_count_oom(h, size, (gm_stream)(uintptr_t)stream);
    throw_oom(msg + why);
}

/* An allocation routed to a pool over another allocator (ext_pool.h). */
static void *ext_alloc(gm_heap *h, int device, size_t size, void *stream, gm_pool_id pool) {
    uintptr_t p = 0;
    int rc = gm_ext_alloc(device, pool, size, stream, &p);
    if (rc == GM_ENOMEM && !gm_capturing(h)) { /* what ended pools and the heap cache hold, then once more */
        gm_ext_release_ended(device);
        gm_empty_cache(h);
        rc = gm_ext_alloc(device, pool, size, stream, &p);
    }
    if (rc == GM_OK) return (void *)p;
    if (rc == GM_ENOMEM)
        throw_fresh_oom(h, device, size, stream,
                        " (The allocation was for a MemPool whose memory comes from its own allocator, "
                        "which refused it or would pass the cap.)");
    throw std::runtime_error("gpumem: allocation of " + std::to_string(size) + " bytes on GPU " +
                             std::to_string(device) + " failed: its MemPool " + pool_name(pool) + " has ended");
}

/* ---- the entry points torch calls ---------------------------------------------- */

extern "C" void *gpumem_torch_alloc(size_t size, int device, void *stream) {
    gm_heap *h = heap_or_throw(device);
    gm_pool_id pool_id;
    const gm_pool_id *pool = route(g_slots[device], (gm_stream)(uintptr_t)stream, &pool_id) ? &pool_id : nullptr;
    gm_torch_context_fn ctx_fn = g_context_fn.load(std::memory_order_relaxed);
    uint64_t ctx = ctx_fn ? ctx_fn() : 0;
    /* the pages mapped for it, or its out-of-memory event, carry its stack too */
    event_context_scope events(ctx);
    uintptr_t p = 0;
    if (size >= kOneExaByte) throw_oom(GM_TORCH_OOM_TOO_LARGE);
    if (pool && gm_ext_owns(device, *pool)) return ext_alloc(h, device, size, stream, *pool);
    if (size > gm_heap_registry_limit(device) &&
        (gm_ext_release_ended(device), size > gm_heap_registry_limit(device))) {
        if (!pool && gm_ext_alloc_on_oom(device, size, stream, &p) == GM_OK) return (void *)p;
        throw_fresh_oom(h, device, size, stream);
    }
    /* The failure counts once, when it is raised (num_ooms: torch's exceptions). */
    int rc = gm_malloc_flags(h, size, (gm_stream)(uintptr_t)stream, ctx, pool, GM_MALLOC_OOM_UNCOUNTED, &p);
    if (rc == GM_OK) {
        report_to_profiler(h, device, (void *)p, (int64_t)size);
        return (void *)p;
    }
    /* During a capture nothing may synchronise: no empty_cache, no retry. */
    bool capturing = gm_capturing(h) != 0;
    if (rc == GM_ENOMEM && !capturing) {
        /* The core has already released what it could and defragmented; one
         * more try after an explicit empty_cache also catches memory that other
         * streams' events have freed since. */
        gm_ext_release_ended(device);
        gm_empty_cache(h);
        rc = gm_malloc_flags(h, size, (gm_stream)(uintptr_t)stream, ctx, pool,
                             GM_MALLOC_OOM_UNCOUNTED | GM_MALLOC_RETRY, &p);
        if (rc == GM_OK) {
            c_oom_retries.fetch_add(1, std::memory_order_relaxed);
            report_to_profiler(h, device, (void *)p, (int64_t)size);
            return (void *)p;
        }
    }
    if (rc == GM_ENOMEM && !pool && gm_ext_alloc_on_oom(device, size, stream, &p) == GM_OK) return (void *)p;
    if (rc == GM_ENOMEM || rc == GM_EINVAL) {
        gm_oom_info info;
        std::string msg = oom_message(device, h, size, &info);
        observe_oom(device, size, info);
        /* A failed attempt may have grown the heap to its cap on the way; give
         * that back, as torch's own allocator does, or memory taken outside the
         * allocator (cuBLAS handles, NCCL) fails next -- seen on an H100. */
        if (!capturing) gm_empty_cache(h);
        gm_count_oom(h, size, (gm_stream)(uintptr_t)stream);
        throw_oom(msg);
    }
    if (rc == GM_EPAUSED) /* the allocation's pool is paused (gpumem.pause): no device call was made */
        throw std::runtime_error(std::string("gpumem: allocation of ") + std::to_string(size) + " bytes on GPU " +
                                 std::to_string(device) +
                                 " failed: its pool is paused (gpumem.pause); call gpumem.resume(pool) first");
    throw std::runtime_error(std::string("gpumem: allocation of ") + std::to_string(size) + " bytes on GPU " +
                             std::to_string(device) + " failed: " + gm_strerror(rc) + " (" +
                             gm_heap_device(h)->last_error + ")");
}

/* Called from tensor destructors: throwing here would terminate the process,
 * so a pointer no heap knows is counted and reported once on stderr. */
extern "C" void gpumem_torch_free(void *ptr, size_t size, int device, void *stream) {
    (void)stream;
    gm_heap *h = gm_heap_registry_get(device);
    event_context_scope events(caller_context());
    int rc = h ? gm_free(h, (uintptr_t)ptr) : GM_EUNKNOWN_PTR;
    if (rc == GM_OK) report_to_profiler(h, device, ptr, -(int64_t)size);
    if (rc == GM_EUNKNOWN_PTR) rc = gm_ext_free(device, (uintptr_t)ptr);
    if (rc != GM_OK && c_free_errors.fetch_add(1) == 0)
        fprintf(stderr,
                "gpumem: free of %p on GPU %d failed: %s (further errors are counted "
                "in gpumem.torch.status())\n",
                ptr, device, gm_strerror(rc));
}

extern "C" void gpumem_torch_empty_cache(void) {
    c_empty_cache.fetch_add(1, std::memory_order_relaxed);
    event_context_scope events(caller_context());
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES; d++) gm_ext_release_ended(d);
    gm_heap_registry_empty_cache(); /* skips heaps capturing a graph */
}

extern "C" void gpumem_torch_memory_fraction(double fraction, int device) {
    c_fraction.fetch_add(1, std::memory_order_relaxed);
    gm_heap_registry_set_fraction(device, fraction);
}

extern "C" void gpumem_torch_device_stats(int device, int64_t *out) {
    gm_stats st;
    memset(&st, 0, sizeof st);
    gm_heap *h = device >= 0 ? gm_heap_registry_get(device) : nullptr;
    if (h) gm_get_stats(h, &st);
    const gm_stat *pooled[] = {st.allocation,      st.segment,        st.active,       st.inactive_split,
                               st.allocated_bytes, st.reserved_bytes, st.active_bytes, st.inactive_split_bytes,
                               st.requested_bytes};
    size_t i = 0;
    for (const gm_stat *arr : pooled)
        for (int p = 0; p < GM_POOL__COUNT; p++) {
            out[i++] = arr[p].current;
            out[i++] = arr[p].peak;
            out[i++] = arr[p].allocated;
            out[i++] = arr[p].freed;
        }
    for (int64_t v : {st.num_alloc_retries, st.num_ooms, st.num_sync_all_streams, st.num_device_alloc,
                      st.num_device_free, h ? st.max_split_size : (int64_t)-1})
        out[i++] = v;
}

extern "C" void gpumem_torch_reset_stats(int device, int what) {
    gm_heap *h = device >= 0 ? gm_heap_registry_get(device) : nullptr;
    if (!h) return;
    if (what == 1) gm_reset_peak_stats(h);
    if (what == 2) gm_reset_accumulated_stats(h);
}

extern "C" void gpumem_torch_record_stream(void *ptr, void *stream) {
    c_record_stream.fetch_add(1, std::memory_order_relaxed);
    int rc = GM_EUNKNOWN_PTR;
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES && rc == GM_EUNKNOWN_PTR; d++) {
        gm_heap *h = gm_heap_registry_get(d);
        if (h) rc = gm_record_stream(h, (uintptr_t)ptr, (gm_stream)(uintptr_t)stream);
    }
    if (rc != GM_OK) {
        char p[32];
        snprintf(p, sizeof p, "%p", ptr);
        for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES; d++)
            if (gm_ext_is_live(d, (uintptr_t)ptr))
                throw std::runtime_error(std::string("gpumem: record_stream on ") + p +
                                         ": memory of a MemPool with an allocator of its own is not stream-tracked "
                                         "under gpumem; synchronise the streams instead");
        throw std::runtime_error(std::string("gpumem: record_stream on ") + p + ": " + gm_strerror(rc));
    }
}

extern "C" void gpumem_torch_init(int device_count) {
    g_device_count.store(device_count);
    look_up_profiler(); /* torch is loaded by now */
}

extern "C" void gpumem_torch_set_context_hook(gm_torch_context_fn fn) { g_context_fn.store(fn); }

extern "C" void gpumem_torch_set_event_stacks(int on) { g_event_stacks.store(on != 0); }

/* ---- private pools ------------------------------------------------------------- */

/* torch's hooks: exactly the C++ types of the std::function torch builds from
 * the address (CUDAPluggableAllocator's begin/end/release setters).  Errors
 * are thrown, and torch turns them into Python exceptions. */
void gpumem_torch_begin_allocate_to_pool(int device, gm_torch_mempool_id pool, gm_torch_filter filter) {
    if (!filter) throw std::runtime_error("gpumem: begin_allocate_to_pool without a stream filter");
    pool_begin(device, gm_pool_id{pool.first, pool.second}, std::move(filter));
}

void gpumem_torch_end_allocate_to_pool(int device, gm_torch_mempool_id pool) {
    pool_end(device, gm_pool_id{pool.first, pool.second});
}

void gpumem_torch_release_pool(int device, gm_torch_mempool_id pool) {
    int rc = pool_release(device, gm_pool_id{pool.first, pool.second});
    /* torch calls this from CUDAGraph::reset(), which ~CUDAGraph calls: an
     * exception there ends the process.  A paused pool keeps its last use
     * (it stays paused, its memory returned), as when a MemPool goes away. */
    if (rc == GM_EPAUSED) return;
    if (rc != GM_OK)
        throw std::runtime_error("gpumem: cannot release pool (" + std::to_string(pool.first) + ", " +
                                 std::to_string(pool.second) + ") on GPU " + std::to_string(device) + ": " +
                                 gm_strerror(rc));
}

extern "C" uintptr_t gm_torch_pool_hook(int which) {
    void (*begin)(int, gm_torch_mempool_id, gm_torch_filter) = gpumem_torch_begin_allocate_to_pool;
    void (*end)(int, gm_torch_mempool_id) = gpumem_torch_end_allocate_to_pool;
    void (*release)(int, gm_torch_mempool_id) = gpumem_torch_release_pool;
    switch (which) {
    case GM_TORCH_HOOK_BEGIN:
        return (uintptr_t)begin;
    case GM_TORCH_HOOK_END:
        return (uintptr_t)end;
    case GM_TORCH_HOOK_RELEASE:
        return (uintptr_t)release;
    default:
        return 0;
    }
}

extern "C" int gpumem_torch_pool_begin(int device, uint64_t first, uint64_t second, gm_torch_stream_filter_fn filter) {
    gm_torch_filter f;
    if (filter)
        f = [filter](gm_cuda_stream_t s) { return filter((void *)s) != 0; };
    else
        f = [](gm_cuda_stream_t) { return true; };
    try {
        pool_begin(device, gm_pool_id{first, second}, std::move(f));
    } catch (const std::exception &) {
        return gm_heap_registry_get(device) ? GM_EINVAL : GM_EDEVICE;
    }
    return GM_OK;
}

extern "C" int gpumem_torch_pool_end(int device, uint64_t first, uint64_t second) {
    return pool_end(device, gm_pool_id{first, second}) ? GM_OK : GM_EINVAL;
}

extern "C" int gpumem_torch_pool_release(int device, uint64_t first, uint64_t second) {
    return pool_release(device, gm_pool_id{first, second});
}

extern "C" void gpumem_torch_raw_delete(void *ptr) {
    event_context_scope events(caller_context());
    int rc = GM_EUNKNOWN_PTR;
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES && rc == GM_EUNKNOWN_PTR; d++) {
        gm_heap *h = gm_heap_registry_get(d);
        if (h) rc = gm_free(h, (uintptr_t)ptr);
    }
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES && rc == GM_EUNKNOWN_PTR; d++) rc = gm_ext_free(d, (uintptr_t)ptr);
    if (rc != GM_OK && c_free_errors.fetch_add(1) == 0)
        fprintf(stderr,
                "gpumem: free of %p failed: %s (further errors are counted in "
                "gpumem.torch.status())\n",
                ptr, gm_strerror(rc));
}

extern "C" size_t gm_torch_active_pools(int device, gm_pool_id *out, size_t cap) {
    if (!gm_heap_registry_valid(device)) return 0;
    slot &s = g_slots[device];
    std::lock_guard<std::mutex> g(s.pool_mu);
    if (!s.active) return 0;
    for (size_t i = 0; i < s.active->size() && i < cap; i++) out[i] = (*s.active)[i].id;
    return s.active->size();
}

extern "C" int gm_torch_cxx11_abi(void) { return _GLIBCXX_USE_CXX11_ABI; }

/* ---- test hooks (built with GPUMEM_TEST_HOOKS=1 only) --------------------------- */

#ifdef GM_TEST_HOOKS

extern "C" int gm_torch_test_hold_lock(int which, int device, double seconds) {
    if (!gm_heap_registry_valid(device) || !(seconds >= 0 && seconds <= 60)) return GM_EINVAL;
    std::function<void(bool)> lock; /* take (true) or release (false) the lock */
    if (which == GM_TORCH_TEST_LOCK_SLOT || which == GM_TORCH_TEST_LOCK_OPTIONS) {
        int reg = which == GM_TORCH_TEST_LOCK_SLOT ? GM_HEAP_REGISTRY_LOCK_SLOT : GM_HEAP_REGISTRY_LOCK_OPTIONS;
        lock = [reg, device](bool take) { gm_heap_registry_test_lock(reg, device, take); };
    } else if (which == GM_TORCH_TEST_LOCK_POOLS) {
        std::mutex *mu = &g_slots[device].pool_mu;
        lock = [mu](bool take) { take ? mu->lock() : mu->unlock(); };
    } else {
        return GM_EINVAL;
    }
    std::promise<void> held;
    std::future<void> taken = held.get_future();
    try {
        std::thread([lock, seconds, held = std::move(held)]() mutable {
            lock(true);
            held.set_value();
            std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
            lock(false);
        }).detach();
    } catch (const std::exception &) {
        return GM_ENOMEM;
    }
    taken.wait();
    return GM_OK;
}

/* The allocation entry point as torch calls it, with what it throws caught:
 * 0 and *out on success; 1 with *exc (type, value, traceback: new references)
 * when it threw a Python exception (torch re-raises those); 2 with msg for any
 * other C++ exception (torch raises a RuntimeError with its text). */
extern "C" int gm_torch_test_alloc(size_t size, int device, void *stream, uintptr_t *out, void *exc[3], char *msg,
                                   size_t len) {
    try {
        *out = (uintptr_t)gpumem_torch_alloc(size, device, stream);
        return 0;
    } catch (python_error &e) {
        exc[0] = e.type;
        exc[1] = e.value;
        exc[2] = e.traceback;
        e.type = e.value = e.traceback = nullptr;
        return 1;
    } catch (const std::exception &e) {
        snprintf(msg, len, "%s", e.what());
        return 2;
    }
}

#endif /* GM_TEST_HOOKS */
