/*
 * torch_oom.cpp -- torch's out-of-memory error: raised as torch raises it (torch.OutOfMemoryError,
 * or RuntimeError), its message (oom_glue.c makes it), the observers called before it, and
 * the settings that say how.
 */
#include <Python.h>

#include <stdexcept>

#include "heap_registry.h"
#include "torch_boundary.h"

using namespace gm_torch;

namespace {

std::atomic<int> g_oom_mode{GM_TORCH_OOM_TORCH};
PyObject *g_oom_class = nullptr;    /* guarded by the GIL */
PyObject *g_oom_observer = nullptr; /* guarded by the GIL */

} // namespace

[[noreturn]] void gm_torch::throw_oom(const std::string &msg) {
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

std::string gm_torch::oom_message(int device, gm_heap *h, size_t size, gm_oom_info *info) {
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
void gm_torch::observe_oom(int device, size_t size, const gm_oom_info &info) {
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

/* Throws torch's out-of-memory error for a request the heap was not asked to
 * place (its own last failure is not this one): the message from a fresh
 * report, the observers called first; `why` follows the message. */
[[noreturn]] void gm_torch::throw_fresh_oom(gm_heap *h, int device, size_t size, void *stream, const char *why) {
    gm_oom_info info;
    gm_memory_report(h, size, &info);
    std::string msg(GM_TORCH_OOM_MSG_MAX, '\0');
    msg.resize(gm_torch_format_oom(device, &info, &msg[0], msg.size()));
    observe_oom(device, size, info);
    gm_count_oom(h, size, (gm_stream)(uintptr_t)stream);
    throw_oom(msg + why);
}

extern "C" void gm_torch_set_oom_mode(int mode) { g_oom_mode.store(mode); }

extern "C" int gm_torch_get_oom_mode(void) { return g_oom_mode.load(); }

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
