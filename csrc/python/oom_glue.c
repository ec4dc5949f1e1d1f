/*
 * oom_glue.c -- the one place out-of-memory messages are made (oom_glue.h):
 * gpumem.Heap's (module.c) and torch's (torch_alloc.cpp) alike, from the byte
 * counts and the first sentences (gm_oom_line) to the registered explanation,
 * and torch's C formatter that takes the GIL for it.
 *
 * Why torch's formatter may take the GIL: torch reaches the allocator from op
 * bindings that released it, or from autograd's device threads, never while
 * some other thread holds the GIL waiting on this one (backward() releases it
 * too), so PyGILState_Ensure cannot deadlock there.  While Python finalizes no
 * thread may take it: the first sentences alone are kept then.
 */
#include "oom_glue.h"

#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "convert.h"
#include "heap_registry.h"
#include "history_glue.h"
#include "torch_alloc.h"

const char GM_TORCH_OOM_TOO_LARGE[] = "CUDA out of memory. Tried to allocate more than 1EB memory.";

/* ---- the first sentences ------------------------------------------------------------ */

void gm_fmt_bytes(char *buf, size_t len, uint64_t n) {
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB"};
    if (n < 1024) {
        snprintf(buf, len, "%" PRIu64 " B", n);
        return;
    }
    double v = (double)n / 1024.0;
    size_t u = 0;
    while (v >= 1024.0 && u + 1 < sizeof units / sizeof units[0]) {
        v /= 1024.0;
        u++;
    }
    snprintf(buf, len, "%.2f %s", v, units[u]);
}

/* torch's own rule (c10's format_size): "N bytes" up to 1 KiB, then KiB up to
 * 1 MiB, MiB up to 1 GiB, and GiB above, each bound inclusive. */
void gm_fmt_torch_bytes(char *buf, size_t len, uint64_t n) {
    if (n <= 1024)
        snprintf(buf, len, "%" PRIu64 " bytes", n);
    else if (n <= ((uint64_t)1 << 20))
        snprintf(buf, len, "%.2f KiB", (double)n / 1024.0);
    else if (n <= ((uint64_t)1 << 30))
        snprintf(buf, len, "%.2f MiB", (double)n / 1048576.0);
    else
        snprintf(buf, len, "%.2f GiB", (double)n / 1073741824.0);
}

void gm_oom_sizes_format(const gm_oom_info *o, gm_oom_sizes *out) {
    gm_fmt_bytes(out->request, sizeof out->request, o->request);
    gm_fmt_bytes(out->device_total, sizeof out->device_total, o->device_total);
    gm_fmt_bytes(out->device_free, sizeof out->device_free, o->device_free);
    gm_fmt_bytes(out->live, sizeof out->live, o->live_bytes);
    gm_fmt_bytes(out->reserved, sizeof out->reserved, o->reserved_bytes);
    gm_fmt_bytes(out->cached, sizeof out->cached, o->cached_bytes);
    gm_fmt_bytes(out->pending, sizeof out->pending, o->pending_bytes);
    gm_fmt_bytes(out->largest, sizeof out->largest, o->largest_possible);
    gm_fmt_bytes(out->cap, sizeof out->cap, o->cap_bytes);
}

/* What other processes hold, from the device's process list (this process left
 * out; n_procs < 0: unknown, `why` says why): "1.00 GiB (pid 7: 1.00 GiB)". */
static void others_text(char *out, size_t len, const gm_proc_usage *procs, long n_procs, const char *why) {
    if (n_procs < 0) {
        snprintf(out, len, "unknown (%s)", why && why[0] ? why : "no process list");
        return;
    }
    uint64_t sum = 0;
    char list[256] = "";
    size_t used = 0;
    int shown = 0;
    uint32_t self = (uint32_t)getpid();
    for (long i = 0; i < n_procs; i++) {
        if (procs[i].pid == self) continue;
        sum += procs[i].bytes;
        if (shown < 4 && used < sizeof list) {
            char b[32];
            gm_fmt_bytes(b, sizeof b, procs[i].bytes);
            int w = snprintf(list + used, sizeof list - used, "%spid %u: %s", shown ? ", " : "", procs[i].pid, b);
            if (w > 0) used += (size_t)w;
            shown++;
        }
    }
    char s[32];
    gm_fmt_bytes(s, sizeof s, sum);
    if (shown)
        snprintf(out, len, "%s (%s)", s, list);
    else
        snprintf(out, len, "%s", s);
}

/* Why spill did not serve the request, after "is spilled to host memory
 * (limit ...)": empty when it says nothing more. */
static const char *spill_why(const gm_oom_info *o) {
    switch (o->spill_error) {
    case GM_OK: /* not tried: only a request larger than the cap and the limit */
        return o->request > o->spill_limit ? "; the request is larger than the cap and the spill limit" : "";
    case GM_ENOMEM:
        return o->request + o->spilled_bytes > o->spill_limit ? "; the request would pass the limit"
                                                              : "; the host refused to give more pages";
    case GM_EINVAL:
        return "; the heap's address range has no unmapped room that large for host pages";
    case GM_EDEVICE:
        return "; spilling more failed in a device call";
    default:
        return "";
    }
}

/* " 2.0 GiB is spilled to host memory (limit 2.0 GiB); the request would pass
 * the limit.": the OOM text's sentence on spill, saying why spill did not
 * serve the request; empty with spill off. */
static void spill_text(char *buf, size_t len, const gm_oom_info *o) {
    char now[32], lim[32];
    buf[0] = '\0';
    if (!o->spill_limit) return;
    gm_fmt_bytes(now, sizeof now, o->spilled_bytes);
    gm_fmt_bytes(lim, sizeof lim, o->spill_limit);
    if (o->spill_error == GM_ECAPTURING)
        snprintf(buf, len, " %s is spilled to host memory (limit %s); spill is off during a CUDA graph capture.", now,
                 lim);
    else if (o->spill_error == GM_ENOTSUP)
        snprintf(buf, len, " Spill is on (limit %s) but this device cannot map host memory.", lim);
    else
        snprintf(buf, len, " %s is spilled to host memory (limit %s)%s.", now, lim, spill_why(o));
}

size_t gm_oom_line(char *buf, size_t len, const gm_oom_info *o, int gpu, const gm_proc_usage *procs, long n_procs,
                   const char *failed) {
    if (!len) return 0;
    gm_oom_sizes z;
    gm_oom_sizes_format(o, &z);
    char device[160];
    if (gpu >= 0) {
        /* torch's first sentence, word for word and in torch's units, so that code
         * and people matching torch's message keep working; gpumem's figures follow. */
        gm_fmt_torch_bytes(z.request, sizeof z.request, o->request);
        gm_fmt_torch_bytes(z.device_total, sizeof z.device_total, o->device_total);
        gm_fmt_torch_bytes(z.device_free, sizeof z.device_free, o->device_free);
    }
    if (!o->device_total)
        snprintf(device, sizeof device, "The device's memory is unknown.");
    else if (gpu >= 0)
        snprintf(device, sizeof device, "GPU %d has a total capacity of %s of which %s is free.", gpu, z.device_total,
                 z.device_free);
    else
        snprintf(device, sizeof device, "The device has a total capacity of %s of which %s is free.", z.device_total,
                 z.device_free);
    char others[320], other[400] = "", fail[400] = "", spill[200];
    spill_text(spill, sizeof spill, o);
    if (gpu >= 0) {
        others_text(others, sizeof others, procs, n_procs, failed);
        snprintf(other, sizeof other, " Memory held by other processes: %s.", others);
    }
    if (o->device_error != GM_OK)
        snprintf(fail, sizeof fail, " A device call failed: %s (%s: %s).", gm_strerror(o->device_error),
                 gm_py_code_name(o->device_error), failed && failed[0] ? failed : "no detail");
    int w = snprintf(buf, len,
                     "CUDA out of memory. Tried to allocate %s. %s This process has %s allocated%s, %s reserved "
                     "by gpumem (%s cached, %s waiting for other streams), under a cap of %s. The largest block "
                     "gpumem could make now, after releasing its cache and defragmenting, is %s.%s%s%s",
                     z.request, device, z.live, gpu >= 0 ? " by PyTorch (gpumem)" : "", z.reserved, z.cached, z.pending,
                     z.cap, z.largest, spill, other, fail);
    if (w < 0) {
        buf[0] = '\0';
        return 0;
    }
    return (size_t)w < len ? (size_t)w : len - 1;
}

/* ---- the explanation ---------------------------------------------------------------- */

static PyObject *oom_formatter; /* callable or NULL */

static PyObject *py_set_oom_formatter(PyObject *Py_UNUSED(m), PyObject *fn) {
    if (fn != Py_None && !PyCallable_Check(fn))
        return PyErr_Format(PyExc_TypeError, "OOM formatter must be callable or None, not %.80s", Py_TYPE(fn)->tp_name);
    PyObject *old = oom_formatter;
    if (fn == Py_None) {
        oom_formatter = NULL;
    } else {
        Py_INCREF(fn);
        oom_formatter = fn;
    }
    if (old) return old; /* hand back the previous one, so callers can restore it */
    Py_RETURN_NONE;
}

/* `fallback` (a new reference, stolen), or what the registered formatter makes
 * of it: formatter(heap, info, fallback[, processes]).  A formatter that fails
 * leaves the fallback text with a note saying so. */
static PyObject *explained(PyObject *heap, PyObject *info, PyObject *fallback, PyObject *processes) {
    if (!fallback || !oom_formatter) return fallback;
    /* The formatter may raise or return junk; the OOM must still be reported,
     * so any failure keeps the core's own text and says the explanation broke.
     * The pending exception (none is expected here) is kept aside. */
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *fn = oom_formatter;
    Py_INCREF(fn);
    PyObject *text = PyObject_CallFunctionObjArgs(fn, heap, info ? info : Py_None, fallback, processes, NULL);
    Py_DECREF(fn);
    if (text && PyUnicode_Check(text)) {
        Py_DECREF(fallback);
        PyErr_Restore(et, ev, tb);
        return text;
    }
    PyObject *why = NULL;
    if (!text) {
        PyObject *t2, *v2, *tb2;
        PyErr_Fetch(&t2, &v2, &tb2);
        why = v2 ? PyObject_Str(v2) : NULL;
        if (!why) PyErr_Clear();
        Py_XDECREF(t2);
        Py_XDECREF(v2);
        Py_XDECREF(tb2);
    }
    Py_XDECREF(text);
    PyObject *out = PyUnicode_FromFormat("%U (gpumem.explain failed: %s)", fallback,
                                         why ? PyUnicode_AsUTF8(why) : "it did not return a str");
    Py_XDECREF(why);
    if (!out) {
        PyErr_Clear();
        out = fallback;
    } else {
        Py_DECREF(fallback);
    }
    PyErr_Restore(et, ev, tb);
    return out;
}

PyObject *gm_py_oom_message(PyObject *heap, const gm_oom_info *info, int gpu, const gm_proc_usage *procs, long n_procs,
                            const char *failed, PyObject **info_out) {
    /* The first sentences before any Python runs: `failed` may be the
     * device's, which Python code (a finalizer) could close. */
    char line[1024];
    size_t n = gm_oom_line(line, sizeof line, info, gpu, procs, n_procs, failed);
    PyObject *fallback = PyUnicode_DecodeUTF8(line, (Py_ssize_t)n, "replace");
    PyObject *d = fallback ? gm_py_oom_dict(info) : NULL;
    PyObject *pl = d && gpu >= 0 ? gm_py_procs_list(procs, n_procs) : NULL;
    if (d == NULL || (gpu >= 0 && pl == NULL)) {
        Py_XDECREF(fallback);
        Py_XDECREF(d);
        return NULL;
    }
    PyObject *text = explained(heap, d, fallback, pl);
    Py_XDECREF(pl);
    if (info_out)
        *info_out = d;
    else
        Py_DECREF(d);
    return text;
}

/* ---- torch's message ---------------------------------------------------------------- */

static _Atomic(gm_torch_oom_formatter) torch_formatter;

void gpumem_torch_set_oom_formatter(gm_torch_oom_formatter fn) { atomic_store(&torch_formatter, fn); }

size_t gm_torch_format_oom(int device, const gm_oom_info *o, char *buf, size_t len) {
    if (!len) return 0;
    gm_heap *h = gm_heap_registry_get(device);
    gm_proc_usage procs[64] = {0};
    long n_procs = -1;
    size_t n = 0;
    if (h && gm_heap_registry_processes(device, procs, 64, &n) == GM_OK) n_procs = (long)(n < 64 ? n : 64);
    /* the explaining formatter (gm_py_torch_oom_formatter below) writes the whole
     * message, the explanation after these first sentences; without it, they alone. */
    gm_torch_oom_formatter f = atomic_load(&torch_formatter);
    if (f) {
        long w = f(o, device, procs, n_procs, buf, len);
        if (w >= 0) {
            buf[len - 1] = '\0';
            return (size_t)w < len ? (size_t)w : len - 1;
        }
    }
    return gm_oom_line(buf, len, o, device, procs, n_procs, h ? gm_heap_device(h)->last_error : NULL);
}

static const char TRUNCATED[] = "\n[report truncated: gpumem.last_oom() returns all of it]";

/* Copy `text` into buf; a report too long for it is cut at a line end and says so. */
static size_t copy_text(const char *text, size_t len, char *buf, size_t buflen) {
    if (len < buflen) {
        memcpy(buf, text, len + 1);
        return len;
    }
    size_t room = buflen > sizeof TRUNCATED ? buflen - sizeof TRUNCATED : 0;
    size_t cut = room;
    while (cut > 0 && text[cut] != '\n') cut--;
    if (cut == 0) /* no line end to cut at: back up to a UTF-8 character start */
        for (cut = room; cut > 0 && ((unsigned char)text[cut] & 0xC0) == 0x80; cut--);
    memcpy(buf, text, cut);
    size_t tail = sizeof TRUNCATED - 1;
    if (cut + tail >= buflen) tail = buflen - 1 - cut;
    memcpy(buf + cut, TRUNCATED, tail);
    buf[cut + tail] = '\0';
    return cut + tail;
}

long gm_py_torch_oom_formatter(const gm_oom_info *info, int device, const gm_proc_usage *procs, long n_procs, char *buf,
                               size_t buflen) {
    if (!info || !buf || buflen < 2) return -1;
    gm_heap *h = gm_heap_registry_get(device);
    const char *failed = h ? gm_heap_device(h)->last_error : NULL;
    if (!Py_IsInitialized() || gm_py_finalizing()) /* no thread may take the GIL: the first sentences alone */
        return (long)gm_oom_line(buf, buflen, info, device, procs, n_procs, failed);
    PyGILState_STATE st = PyGILState_Ensure();
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    PyObject *dev = PyLong_FromLong(device);
    PyObject *text = dev ? gm_py_oom_message(dev, info, device, procs, n_procs, failed, NULL) : NULL;
    Py_ssize_t n = 0;
    const char *s = text ? PyUnicode_AsUTF8AndSize(text, &n) : NULL;
    size_t out;
    if (s) {
        out = copy_text(s, (size_t)n, buf, buflen);
    } else {
        /* Python itself failed (no memory, a broken install): say so on stderr,
         * the exception still carries the first sentences. */
        PyErr_WriteUnraisable(NULL);
        out = gm_oom_line(buf, buflen, info, device, procs, n_procs, failed);
    }
    Py_XDECREF(text);
    Py_XDECREF(dev);
    PyErr_Restore(et, ev, tb);
    PyGILState_Release(st);
    return (long)out;
}

static PyMethodDef oom_methods[] = {
    {.ml_name = "_set_oom_formatter",
     .ml_meth = py_set_oom_formatter,
     .ml_flags = METH_O,
     .ml_doc =
         "_set_oom_formatter(fn or None) -> previous; fn(heap or device, info, text, processes=None) -> OOM message"},
    {.ml_name = NULL},
};

int gm_oom_glue_add(PyObject *module) { return PyModule_AddFunctions(module, oom_methods); }
