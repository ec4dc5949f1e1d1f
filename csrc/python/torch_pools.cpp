/*
 * torch_pools.cpp -- torch's private pools (CUDA graphs, MemPool): which pool an allocation goes
 * to, begin, end and release, the hooks torch calls for them, and the boundary's locks across
 * fork().  torch_alloc.cpp's opening comment says why the locks are taken as they are.
 */
#include <Python.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>
#include <pthread.h>

#include "heap_registry.h"
#include "torch_boundary.h"

using namespace gm_torch;

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

} // namespace

bool gm_torch::route_to_pool(int device, gm_stream stream, gm_pool_id *out) {
    return route(g_slots[device], stream, out);
}

std::mutex &gm_torch::pool_lock(int device) { return g_slots[device].pool_mu; }

std::string gm_torch::pool_name(gm_pool_id id) {
    return "(" + std::to_string(id.first) + ", " + std::to_string(id.second) + ")";
}

static void pool_begin(int device, gm_pool_id id, gm_torch_filter filter) {
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

static bool pool_end(int device, gm_pool_id id) {
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

static int pool_release(int device, gm_pool_id id) {
    gm_heap *h = gm_heap_registry_get(device);
    return h ? gm_pool_release(h, id) : GM_EINVAL;
}

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

extern "C" size_t gm_torch_active_pools(int device, gm_pool_id *out, size_t cap) {
    if (!gm_heap_registry_valid(device)) return 0;
    slot &s = g_slots[device];
    std::lock_guard<std::mutex> g(s.pool_mu);
    if (!s.active) return 0;
    for (size_t i = 0; i < s.active->size() && i < cap; i++) out[i] = (*s.active)[i].id;
    return s.active->size();
}

extern "C" int gm_torch_cxx11_abi(void) { return _GLIBCXX_USE_CXX11_ABI; }
