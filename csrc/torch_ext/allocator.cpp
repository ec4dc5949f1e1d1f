/*
 * allocator.cpp -- gpumem as torch's C++ allocator object, so that callers of
 * c10::cuda::CUDACachingAllocator from C++ (extensions, the profiler, torch's
 * own C++) see gpumem: statistics, history, snapshots, out-of-memory
 * observers, user metadata and compile regions.
 *
 * torch's CUDAPluggableAllocator answers those virtual functions with "does
 * not yet support"; gpumem.torch patches the Python functions that reach them,
 * which C++ callers never pass through.  This file subclasses
 * CUDAPluggableAllocator (allocation and the hooks stay the pluggable path's:
 * gpumem._C's entry points) and answers the rest: statistics from gpumem._C's
 * C functions (addresses handed in), the rest from gpumem.torch (a Python
 * object handed in, called under the GIL) -- the same answers the patched
 * Python functions give.  While a C++ caller records history with a context
 * recorder (torch::cuda::_record_memory_history), each allocation keeps the
 * context torch's recorder gathers, so C++ snapshots carry torch's own frames.
 *
 * Built on first use against torch's headers (gpumem/torch/_cppext.py, with
 * CUDA's headers), linked to c10, c10_cuda, torch_cpu and torch_cuda, and
 * called through ctypes.  The GM_HAS_* macros say which virtual functions the
 * torch it is built against declares (read from its headers at build time).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#ifndef GM_TORCH_VERSION
#error "build with -DGM_TORCH_VERSION=\"<torch.__version__>\""
#endif

namespace {

namespace cca = c10::cuda::CUDACachingAllocator;
using Pluggable = torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using Context = std::shared_ptr<c10::GatheredContext>;

/* gpumem._C's statistics functions (torch_alloc.h) */
typedef void (*stats_fn)(int device, int64_t *out);
typedef void (*reset_fn)(int device, int what);
constexpr size_t kStatsN = 9 * 3 * 4 + 6;

/* ---- calling gpumem.torch ---------------------------------------------------------------- */

/* The message of the Python error set now (cleared). */
std::string py_error() {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    std::string msg = "gpumem: a Python error";
    PyObject *s = value ? PyObject_Str(value) : nullptr;
    if (s && PyUnicode_Check(s)) msg = PyUnicode_AsUTF8(s);
    Py_XDECREF(s);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return msg;
}

/* hooks.<name>(*Py_BuildValue(fmt, args...)) under the GIL (fmt makes a
 * tuple); `use` reads the result while the GIL is held.  A Python exception
 * becomes a c10::Error with its message. */
template <typename Use, typename... Args>
void call_hook(PyObject *hooks, const char *name, Use use, const char *fmt, Args... args) {
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *a = Py_BuildValue(fmt, args...);
    PyObject *fn = a ? PyObject_GetAttrString(hooks, name) : nullptr;
    PyObject *r = fn ? PyObject_CallObject(fn, a) : nullptr;
    Py_XDECREF(fn);
    Py_XDECREF(a);
    std::string err;
    if (!r) {
        err = py_error();
    } else {
        use(r);
        if (PyErr_Occurred()) err = py_error();
        Py_DECREF(r);
    }
    PyGILState_Release(g);
    TORCH_CHECK(err.empty(), err);
}

void ignore(PyObject *) {}

/* dict[key] as an unsigned integer, 0 when absent or not a number (GIL held). */
uint64_t get_u64(PyObject *d, const char *key) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v || !PyLong_Check(v)) return 0;
    uint64_t x = PyLong_AsUnsignedLongLongMask(v);
    return x;
}

std::string get_str(PyObject *d, const char *key, const char *otherwise = "") {
    PyObject *v = PyDict_GetItemString(d, key);
    return v && PyUnicode_Check(v) ? std::string(PyUnicode_AsUTF8(v)) : std::string(otherwise);
}

bool get_bool(PyObject *d, const char *key) {
    PyObject *v = PyDict_GetItemString(d, key);
    return v && PyObject_IsTrue(v) == 1;
}

c10::MempoolId_t get_pool(PyObject *d, const char *key) {
    PyObject *v = PyDict_GetItemString(d, key);
    if (!v || !PySequence_Check(v) || PySequence_Size(v) != 2) return {0, 0};
    PyObject *a = PySequence_GetItem(v, 0), *b = PySequence_GetItem(v, 1);
    c10::MempoolId_t id{a && PyLong_Check(a) ? PyLong_AsUnsignedLongLongMask(a) : 0,
                        b && PyLong_Check(b) ? PyLong_AsUnsignedLongLongMask(b) : 0};
    Py_XDECREF(a);
    Py_XDECREF(b);
    return id;
}

bool trace_action(const std::string &s, cca::TraceEntry::Action *out) {
    static const std::pair<const char *, cca::TraceEntry::Action> table[] = {
        {"alloc", cca::TraceEntry::ALLOC},
        {"free_requested", cca::TraceEntry::FREE_REQUESTED},
        {"free_completed", cca::TraceEntry::FREE_COMPLETED},
        {"segment_alloc", cca::TraceEntry::SEGMENT_ALLOC},
        {"segment_free", cca::TraceEntry::SEGMENT_FREE},
        {"segment_map", cca::TraceEntry::SEGMENT_MAP},
        {"segment_unmap", cca::TraceEntry::SEGMENT_UNMAP},
        {"snapshot", cca::TraceEntry::SNAPSHOT},
        {"oom", cca::TraceEntry::OOM},
    };
    for (const auto &[name, action] : table)
        if (s == name) {
            *out = action;
            return true;
        }
    return false;
}

/* gpumem's event times (CLOCK_MONOTONIC) as torch's approximate clock, which
 * torch's snapshot turns into Unix time with a converter of its own: a linear
 * map through now, at the rate `conv` measured since it was made. */
class Clock {
  public:
    explicit Clock(c10::ApproximateClockToUnixTimeConverter &conv) {
        auto to_unix = conv.makeConverter();
        timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        mono0_ = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
        a0_ = c10::getApproximateTime();
        double ns = (double)(to_unix(a0_ + (c10::approx_time_t)1000000000) - to_unix(a0_));
        ticks_per_ns_ = ns > 0 ? 1e9 / ns : 1.0;
    }
    c10::approx_time_t at(uint64_t mono_us) const {
        double ticks = (double)(mono0_ - (int64_t)mono_us * 1000) * ticks_per_ns_;
        return ticks > 0 && ticks < (double)a0_ ? a0_ - (c10::approx_time_t)ticks : a0_;
    }

  private:
    int64_t mono0_;
    c10::approx_time_t a0_;
    double ticks_per_ns_;
};

/* A TraceEntry, with the arguments this torch's constructor takes (GM_TRACE_*). */
template <typename Stream>
void emplace_trace(std::vector<cca::TraceEntry> &v, cca::TraceEntry::Action action, c10::DeviceIndex device,
                   size_t addr, size_t size, Stream stream, c10::approx_time_t now, Context ctx, std::string region,
                   std::string metadata) {
#if defined(GM_TRACE_HAS_MEMPOOL) && defined(GM_TRACE_HAS_COMPILE_CONTEXT) && defined(GM_TRACE_HAS_USER_METADATA)
    v.emplace_back(action, device, addr, size, stream, c10::MempoolId_t{0, 0}, now, std::move(ctx), std::move(region),
                   std::move(metadata));
#elif defined(GM_TRACE_HAS_MEMPOOL) && defined(GM_TRACE_HAS_COMPILE_CONTEXT)
    (void)metadata;
    v.emplace_back(action, device, addr, size, stream, c10::MempoolId_t{0, 0}, now, std::move(ctx), std::move(region));
#elif defined(GM_TRACE_HAS_COMPILE_CONTEXT)
    (void)metadata;
    v.emplace_back(action, device, addr, size, stream, now, std::move(ctx), std::move(region));
#else
    (void)metadata, (void)region;
    v.emplace_back(action, device, addr, size, stream, now, std::move(ctx));
#endif
}

/* ---- the allocator ------------------------------------------------------------------------- */

class GpumemAllocator final : public Pluggable {
  public:
    GpumemAllocator(void *alloc, void *free_, stats_fn stats, reset_fn reset, PyObject *hooks)
        : Pluggable(reinterpret_cast<void *(*)(size_t, int, cudaStream_t)>(alloc),
                    reinterpret_cast<void (*)(void *, size_t, int, cudaStream_t)>(free_)),
          stats_(stats), reset_(reset), hooks_(hooks) {}

    /* name() stays the pluggable allocator's: torch's C++ may tell allocators apart by it. */

    /* ---- allocation: the pluggable path, plus torch's context while a C++ caller records */
    c10::DataPtr allocate(size_t size) override {
        c10::DataPtr p = Pluggable::allocate(size);
        remember(p.get());
        return p;
    }
    void *raw_alloc(size_t nbytes) override {
        void *p = Pluggable::raw_alloc(nbytes);
        remember(p);
        return p;
    }
    void *raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
        void *p = Pluggable::raw_alloc_with_stream(nbytes, stream);
        remember(p);
        return p;
    }
    void raw_delete(void *ptr) override {
        forget(ptr);
        Pluggable::raw_delete(ptr);
    }

    /* ---- statistics */
    cca::DeviceStats getDeviceStats(c10::DeviceIndex device) override;
    void resetAccumulatedStats(c10::DeviceIndex device) override { reset_(device, 2); }
    void resetPeakStats(c10::DeviceIndex device) override { reset_(device, 1); }
    void cacheInfo(c10::DeviceIndex device, size_t *largest) override {
        size_t n = 0;
        call_hook(hooks_, "cache_info", [&](PyObject *r) { n = PyLong_AsSize_t(r); }, "(i)", (int)device);
        *largest = n;
    }
    double getMemoryFraction(c10::DeviceIndex device) override {
        double f = 1.0;
        call_hook(hooks_, "memory_fraction", [&](PyObject *r) { f = PyFloat_AsDouble(r); }, "(i)", (int)device);
        return f;
    }

    /* ---- history and snapshots */
#ifdef GM_HAS_SNAPSHOT_TRACES_ARG
    cca::SnapshotInfo snapshot(c10::MempoolId_t pool, bool include_traces) override {
        return take_snapshot(pool, include_traces);
    }
#else
    cca::SnapshotInfo snapshot(c10::MempoolId_t pool) override { return take_snapshot(pool, true); }
#endif
#ifdef GM_HAS_SKIP_ACTIONS
    void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries, cca::RecordContext when,
                       bool clear, const std::vector<std::string> &skip_actions) override {
        record_history(enabled, recorder, max_entries, when, clear, skip_actions);
    }
#else
    void recordHistory(bool enabled, cca::CreateContextFn recorder, size_t max_entries, cca::RecordContext when,
                       bool clear) override {
        record_history(enabled, recorder, max_entries, when, clear, {});
    }
#endif
#ifdef GM_HAS_IS_HISTORY_ENABLED
    bool isHistoryEnabled() override {
        bool on = false;
        call_hook(hooks_, "history_enabled", [&](PyObject *r) { on = PyObject_IsTrue(r) == 1; }, "()");
        return on;
    }
#endif
    void attachOutOfMemoryObserver(cca::OutOfMemoryObserver observer) override {
        std::lock_guard<std::mutex> lock(mu_);
        observers_.push_back(std::move(observer));
    }
    size_t n_observers() {
        std::lock_guard<std::mutex> lock(mu_);
        return observers_.size();
    }
    /* Each observer in turn; the first that throws ends it, its message in err. */
    int notify_oom(int64_t device, size_t requested, size_t allowed, size_t device_free, char *err, size_t len) {
        std::vector<cca::OutOfMemoryObserver> obs;
        {
            std::lock_guard<std::mutex> lock(mu_);
            obs = observers_;
        }
        try {
            for (auto &o : obs) o(device, requested, allowed, device_free);
        } catch (const std::exception &e) {
            snprintf(err, len, "%s", e.what());
            return -1;
        }
        return 0;
    }
#ifdef GM_HAS_USER_METADATA
    void setUserMetadata(const std::string &metadata) override {
        call_hook(hooks_, "set_metadata", ignore, "(s#)", metadata.data(), (Py_ssize_t)metadata.size());
    }
    std::string getUserMetadata() override {
        std::string s;
        call_hook(
            hooks_, "get_metadata",
            [&](PyObject *r) {
                if (PyUnicode_Check(r)) s = PyUnicode_AsUTF8(r);
            },
            "()");
        return s;
    }
#endif
#ifdef GM_HAS_COMPILE_CONTEXT
    void pushCompileContext(std::string &md) override { region(md.c_str(), 1); }
    void popCompileContext() override { region("", 0); }
#endif

  private:
    void record_history(bool enabled, cca::CreateContextFn recorder, size_t max_entries, cca::RecordContext when,
                        bool clear, const std::vector<std::string> &skip_actions);
    void region(const char *name, int entered) { call_hook(hooks_, "region", ignore, "(si)", name, entered); }
    void remember(void *p);
    void forget(void *p) {
        if (!p || !recording_) return;
        std::lock_guard<std::mutex> lock(mu_);
        contexts_.erase(p);
    }
    Context context_of(uint64_t addr) {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = contexts_.find(reinterpret_cast<void *>(addr));
        return it == contexts_.end() ? nullptr : it->second;
    }
    cca::SnapshotInfo take_snapshot(c10::MempoolId_t pool, bool include_traces);
    void add_segment(cca::SnapshotInfo &out, PyObject *s);
    void add_trace(cca::SnapshotInfo &out, size_t device, PyObject *e, const Clock &clock, cca::RecordContext when);

    stats_fn stats_;
    reset_fn reset_;
    PyObject *hooks_; /* a reference kept for the process's life */
    std::mutex mu_;
    std::vector<cca::OutOfMemoryObserver> observers_;
    std::atomic<bool> recording_{false};
    cca::CreateContextFn recorder_ = nullptr;
    cca::RecordContext when_ = cca::RecordContext::NEVER;
    std::unordered_map<void *, Context> contexts_;
    c10::ApproximateClockToUnixTimeConverter clock_; /* measured from the allocator's start */
};

cca::DeviceStats GpumemAllocator::getDeviceStats(c10::DeviceIndex device) {
    int64_t v[kStatsN] = {0};
    stats_(device, v);
    cca::DeviceStats st;
    decltype(st.allocation) *pooled[] = {
        &st.allocation,      &st.segment,        &st.active,       &st.inactive_split,
        &st.allocated_bytes, &st.reserved_bytes, &st.active_bytes, &st.inactive_split_bytes,
        &st.requested_bytes};
    size_t i = 0;
    for (auto *arr : pooled)
        for (auto &s : *arr) {
            s.current = v[i++];
            s.peak = v[i++];
            s.allocated = v[i++];
            s.freed = v[i++];
        }
    st.num_alloc_retries = v[i++];
    st.num_ooms = v[i++];
    st.num_sync_all_streams = v[i++];
    st.num_device_alloc = v[i++];
    st.num_device_free = v[i++];
    st.max_split_size = v[i++];
    return st;
}

void GpumemAllocator::remember(void *p) {
    if (!p || !recording_) return;
    cca::CreateContextFn rec;
    {
        std::lock_guard<std::mutex> lock(mu_);
        rec = recorder_;
    }
    Context ctx = rec ? rec() : nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    if (ctx) contexts_[p] = std::move(ctx);
}

void GpumemAllocator::record_history(bool enabled, cca::CreateContextFn recorder, size_t max_entries,
                                     cca::RecordContext when, bool clear, const std::vector<std::string> &skip) {
    {
        std::lock_guard<std::mutex> lock(mu_);
        recorder_ = enabled && when != cca::RecordContext::NEVER ? recorder : nullptr;
        when_ = when;
        if (!recorder_) contexts_.clear();
        recording_ = recorder_ != nullptr;
    }
    std::string names; /* skip_actions, comma-separated */
    for (const auto &a : skip) names += (names.empty() ? "" : ",") + a;
    call_hook(hooks_, "record_history", ignore, "(OiOKOs)", enabled ? Py_True : Py_False, (int)when,
              recorder ? Py_True : Py_False, (unsigned long long)max_entries, clear ? Py_True : Py_False,
              names.c_str());
}

cca::SnapshotInfo GpumemAllocator::take_snapshot(c10::MempoolId_t pool, bool include_traces) {
    cca::SnapshotInfo out{};
#ifdef GM_HAS_CONFIG_METADATA
    out.config_metadata.max_split_size = SIZE_MAX; /* blocks of any size split, as torch's default */
#endif
    std::unique_ptr<Clock> clock;
    {
        std::lock_guard<std::mutex> lock(mu_);
        clock = std::make_unique<Clock>(clock_);
    }
    cca::RecordContext when;
    {
        std::lock_guard<std::mutex> lock(mu_);
        when = when_;
    }
    auto read = [&](PyObject *d) {
        PyObject *segs = PyDict_GetItemString(d, "segments");
        for (Py_ssize_t i = 0; segs && PyList_Check(segs) && i < PyList_Size(segs); i++)
            add_segment(out, PyList_GetItem(segs, i));
        PyObject *traces = PyDict_GetItemString(d, "device_traces");
        for (Py_ssize_t dev = 0; traces && PyList_Check(traces) && dev < PyList_Size(traces); dev++) {
            PyObject *t = PyList_GetItem(traces, dev);
            out.device_traces.emplace_back();
            for (Py_ssize_t j = 0; PyList_Check(t) && j < PyList_Size(t); j++)
                add_trace(out, (size_t)dev, PyList_GetItem(t, j), *clock, when);
        }
    };
    call_hook(hooks_, "snapshot", read, "(KKO)", (unsigned long long)pool.first, (unsigned long long)pool.second,
              include_traces ? Py_True : Py_False);
    return out;
}

void GpumemAllocator::add_segment(cca::SnapshotInfo &out, PyObject *s) {
    if (!PyDict_Check(s)) return;
    cca::SegmentInfo seg;
    seg.device = (c10::DeviceIndex)get_u64(s, "device");
    seg.address = get_u64(s, "address");
    seg.total_size = get_u64(s, "total_size");
    seg.requested_size = get_u64(s, "requested_size");
    seg.allocated_size = get_u64(s, "allocated_size");
    seg.active_size = get_u64(s, "active_size");
    seg.stream = reinterpret_cast<decltype(seg.stream)>(get_u64(s, "stream"));
    seg.is_large = get_str(s, "segment_type", "large") == "large";
    seg.is_expandable = get_bool(s, "is_expandable");
    seg.owner_private_pool_id = get_pool(s, "segment_pool_id");
    PyObject *blocks = PyDict_GetItemString(s, "blocks");
    for (Py_ssize_t i = 0; blocks && PyList_Check(blocks) && i < PyList_Size(blocks); i++) {
        PyObject *b = PyList_GetItem(blocks, i);
        if (!PyDict_Check(b)) continue;
        cca::BlockInfo bi;
        bi.size = get_u64(b, "size");
        bi.requested_size = get_u64(b, "requested_size");
        std::string state = get_str(b, "state");
        bi.allocated = state == "active_allocated";
        bi.active = state != "inactive";
        if (bi.allocated) bi.context_when_allocated = context_of(get_u64(b, "address"));
        seg.blocks.push_back(std::move(bi));
    }
    out.segments.push_back(std::move(seg));
}

void GpumemAllocator::add_trace(cca::SnapshotInfo &out, size_t device, PyObject *e, const Clock &clock,
                                cca::RecordContext when) {
    cca::TraceEntry::Action action;
    if (!PyDict_Check(e) || !trace_action(get_str(e, "action"), &action)) return;
    uint64_t addr = get_u64(e, "addr");
    Context ctx = nullptr;
    if (action == cca::TraceEntry::ALLOC && when != cca::RecordContext::STATE) ctx = context_of(addr);
    using stream_t = decltype(cca::SegmentInfo{}.stream);
    emplace_trace(out.device_traces.back(), action, (c10::DeviceIndex)device, addr, get_u64(e, "size"),
                  reinterpret_cast<stream_t>(get_u64(e, "stream")), clock.at(get_u64(e, "time_us")), std::move(ctx),
                  get_str(e, "compile_context", "N/A"), get_str(e, "user_metadata"));
}

std::shared_ptr<GpumemAllocator> g_allocator;

} // namespace

extern "C" {

/* The torch this file was built against (torch.__version__). */
__attribute__((visibility("default"))) const char *gm_cppalloc_torch_version(void) { return GM_TORCH_VERSION; }

/* Make the allocator over gpumem._C's entry points (alloc, free) and
 * statistics (stats, reset); `hooks` answers the rest (gpumem.torch._cppalloc).
 * Called with the GIL held.  Returns 0, or -1 when one was made already. */
__attribute__((visibility("default"))) int gm_cppalloc_create(uint64_t alloc, uint64_t free_, uint64_t stats,
                                                              uint64_t reset, PyObject *hooks) {
    if (g_allocator) return -1;
    Py_INCREF(hooks);
    g_allocator =
        std::make_shared<GpumemAllocator>(reinterpret_cast<void *>(alloc), reinterpret_cast<void *>(free_),
                                          reinterpret_cast<stats_fn>(stats), reinterpret_cast<reset_fn>(reset), hooks);
    return 0;
}

/* torch's hook setters, by kind: 0 init, 1 reset (empty_cache), 2 memory
 * fraction, 3 record_stream, 4 begin, 5 end, 6 release a pool; `fn` is a
 * function address of the type torch's setter takes. */
__attribute__((visibility("default"))) int gm_cppalloc_set_hook(int kind, uint64_t fn) {
    if (!g_allocator) return -1;
    void *f = reinterpret_cast<void *>(fn);
    using begin_t = void(int, c10::MempoolId_t, std::function<bool(cudaStream_t)>);
    using pool_t = void(int, c10::MempoolId_t);
    switch (kind) {
    case 0:
        g_allocator->set_init_fn(reinterpret_cast<void (*)(int)>(f));
        break;
    case 1:
        g_allocator->set_reset_fn(reinterpret_cast<void (*)()>(f));
        break;
    case 2:
        g_allocator->set_memory_fraction_fn(reinterpret_cast<void (*)(double, int)>(f));
        break;
    case 3:
        g_allocator->set_record_stream_fn(reinterpret_cast<void (*)(void *, cudaStream_t)>(f));
        break;
    case 4:
        g_allocator->set_begin_allocate_to_pool(std::function<begin_t>(reinterpret_cast<begin_t *>(f)));
        break;
    case 5:
        g_allocator->set_end_allocate_to_pool_fn(std::function<pool_t>(reinterpret_cast<pool_t *>(f)));
        break;
    case 6:
        g_allocator->set_release_pool(std::function<pool_t>(reinterpret_cast<pool_t *>(f)));
        break;
    default:
        return -2;
    }
    return 0;
}

/* torch's changeCurrentAllocator(the allocator): 0, or -1 with `err` filled
 * (torch refuses once CUDA has allocated). */
__attribute__((visibility("default"))) int gm_cppalloc_make_current(char *err, size_t len) {
    if (!g_allocator) return -1;
    try {
        torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(g_allocator);
    } catch (const std::exception &e) {
        snprintf(err, len, "%s", e.what());
        return -1;
    }
    return 0;
}

/* The out-of-memory observers C++ attached, called with torch's arguments:
 * 0, or -1 with the message of the one that threw in `err`. */
__attribute__((visibility("default"))) int gm_cppalloc_notify_oom(int64_t device, uint64_t requested, uint64_t allowed,
                                                                  uint64_t device_free, char *err, size_t len) {
    return g_allocator ? g_allocator->notify_oom(device, requested, allowed, device_free, err, len) : 0;
}

/* How many out-of-memory observers C++ attached. */
__attribute__((visibility("default"))) size_t gm_cppalloc_observers(void) {
    return g_allocator ? g_allocator->n_observers() : 0;
}

} // extern "C"
