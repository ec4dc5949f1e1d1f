/*
 * torch_boundary.h -- what the files of the torch boundary share (C++ only):
 * torch_alloc.cpp (the entry points), torch_pools.cpp (routing to private
 * pools, fork), torch_oom.cpp (raising torch's out-of-memory error, its
 * observers and settings), torch_profiler.cpp and torch_test_hooks.cpp.
 * torch_alloc.cpp's opening comment says how they fit together.
 */
#ifndef GPUMEM_TORCH_BOUNDARY_H
#define GPUMEM_TORCH_BOUNDARY_H

#include <Python.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <utility>

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

namespace gm_torch {

/* torch_alloc.cpp: the counters gm_torch_get_counters reads, the context hook */
extern std::atomic<uint64_t> c_ooms, c_oom_retries, c_free_errors, c_empty_cache, c_record_stream, c_fraction;
extern std::atomic<gm_torch_context_fn> g_context_fn;
/* The heap of `device`, created now if need be; throws what the registry says. */
gm_heap *heap_or_throw(int device);
/* The caller's stack for the events a free or an empty_cache records, or 0. */
uint64_t caller_context();

/* The events the core records in this scope carry `context` (none given: their
 * blocks' own); the one set before comes back at the end, exceptions included. */
struct event_context_scope {
    uint64_t previous;
    explicit event_context_scope(uint64_t context) : previous(gm_history_event_context(context)) {}
    ~event_context_scope() { gm_history_event_context(previous); }
    event_context_scope(const event_context_scope &) = delete;
    event_context_scope &operator=(const event_context_scope &) = delete;
};

/* torch_pools.cpp */
std::string pool_name(gm_pool_id id);
/* The pool an allocation on `stream` goes to on `device` (see route()), or false. */
bool route_to_pool(int device, gm_stream stream, gm_pool_id *out);
/* device's pool lock (the test hook that holds it). */
std::mutex &pool_lock(int device);

/* torch_oom.cpp */
[[noreturn]] void throw_oom(const std::string &msg);
std::string oom_message(int device, gm_heap *h, size_t size, gm_oom_info *info);
void observe_oom(int device, size_t size, const gm_oom_info &info);
[[noreturn]] void throw_fresh_oom(gm_heap *h, int device, size_t size, void *stream, const char *why = "");

/* torch_profiler.cpp */
void look_up_profiler();
void report_to_profiler(gm_heap *h, int device, void *ptr, int64_t delta);

} // namespace gm_torch

#endif /* GPUMEM_TORCH_BOUNDARY_H */
