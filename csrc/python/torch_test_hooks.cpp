/*
 * torch_test_hooks.cpp -- what only the tests call of the torch boundary (test_hooks.c hands it to
 * Python), compiled only with GM_TEST_HOOKS (setup.py's GPUMEM_TEST_HOOKS=1).
 */
#include <Python.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <thread>

#include "heap_registry.h"
#include "torch_boundary.h"

using namespace gm_torch;

/* ---- test hooks (built with GPUMEM_TEST_HOOKS=1 only) --------------------------- */

#ifdef GM_TEST_HOOKS

extern "C" int gm_torch_test_hold_lock(int which, int device, double seconds) {
    if (!gm_heap_registry_valid(device) || !(seconds >= 0 && seconds <= 60)) return GM_EINVAL;
    std::function<void(bool)> lock; /* take (true) or release (false) the lock */
    if (which == GM_TORCH_TEST_LOCK_SLOT || which == GM_TORCH_TEST_LOCK_OPTIONS) {
        int reg = which == GM_TORCH_TEST_LOCK_SLOT ? GM_HEAP_REGISTRY_LOCK_SLOT : GM_HEAP_REGISTRY_LOCK_OPTIONS;
        lock = [reg, device](bool take) { gm_heap_registry_test_lock(reg, device, take); };
    } else if (which == GM_TORCH_TEST_LOCK_POOLS) {
        std::mutex *mu = &pool_lock(device);
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
