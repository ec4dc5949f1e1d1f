/*
 * faults.c -- the fault-injecting device: any device's operations, with
 * chosen calls made to fail (gpumem/faults.h says how).
 *
 * Every counted operation goes through one template (WRAP below): count the
 * call and decide its fate, then either refuse it here (a device that cannot
 * check a call without acting on it), or call the wrapped device -- marked
 * doomed if the call is to fail -- and answer with what it said or with the
 * injected failure.  Counts and the random streams live here, one per op, so a
 * schedule means the same on every device.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem/faults.h"
#include "gpumem/gpumem.h"

typedef struct fault_plan {
    uint64_t from, to; /* call numbers (1-based) that fail; from = 0: none */
    double p;          /* probability of a random failure */
    uint64_t rng;      /* splitmix64 state */
} fault_plan;

typedef struct fault_dev {
    gm_device base;          /* first: a gm_device * is a fault_dev * */
    gm_device_ops ops;       /* base.ops: inner's optional ops stay absent */
    gm_device_verify verify; /* ops.verify when inner has one */
    gm_device *inner;
    const char *origin; /* named in the message of an injected failure; may be NULL */
    uint64_t calls[GM_OP__COUNT], fired[GM_OP__COUNT];
    fault_plan plan[GM_OP__COUNT];
} fault_dev;

static void fault_destroy(gm_device *dev);

int gm_faults_is_wrapper(const gm_device *dev) { return dev && dev->ops && dev->ops->destroy == fault_destroy; }

static fault_dev *as_wrapper(const gm_device *dev) {
    return gm_faults_is_wrapper(dev) ? (fault_dev *)(uintptr_t)dev : NULL;
}

gm_device *gm_faults_inner(gm_device *dev) {
    fault_dev *w = as_wrapper(dev);
    return w ? w->inner : dev;
}

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

/* Count the call and decide, before anyone looks at its arguments, whether it
 * is to fail; mark the wrapped device accordingly. */
static int doom_call(fault_dev *w, gm_dev_op op) {
    fault_plan *f = &w->plan[op];
    uint64_t n = ++w->calls[op];
    int doom = f->from != 0 && n >= f->from && n <= f->to;
    if (f->p > 0.0) {
        /* 53 random bits -> [0, 1) */
        double u = (double)(splitmix64(&f->rng) >> 11) * (1.0 / 9007199254740992.0);
        if (u < f->p) doom = 1;
    }
    w->inner->last_error[0] = '\0';
    w->inner->doomed = doom;
    return doom;
}

static int injected(fault_dev *w, gm_dev_op op) {
    w->fired[op]++;
    if (w->origin)
        snprintf(w->base.last_error, sizeof w->base.last_error, "%s failed (injected by %s)", gm_dev_op_name(op),
                 w->origin);
    else
        snprintf(w->base.last_error, sizeof w->base.last_error, "injected fault in %s", gm_dev_op_name(op));
    return op == GM_OP_CREATE || op == GM_OP_HOST_ALLOC || op == GM_OP_CREATE_HOST ? GM_ENOMEM : GM_EDEVICE;
}

/* What the wrapped device answered: its own failure (and reason), or, for a
 * doomed call it found valid, the injected one. */
static int settle(fault_dev *w, gm_dev_op op, int doom, int rc) {
    w->inner->doomed = 0;
    if (doom && rc == GM_OK) return injected(w, op);
    if (rc != GM_OK && w->inner->last_error[0])
        memcpy(w->base.last_error, w->inner->last_error, sizeof w->base.last_error);
    return rc;
}

#define WRAP(name, OP, params, args)                                                                                   \
    static int fault_##name params {                                                                                   \
        fault_dev *w = (fault_dev *)dev;                                                                               \
        int doom = doom_call(w, GM_OP_##OP);                                                                           \
        if (doom && !w->inner->ops->checks_doomed) {                                                                   \
            w->inner->doomed = 0;                                                                                      \
            return injected(w, GM_OP_##OP);                                                                            \
        }                                                                                                              \
        return settle(w, GM_OP_##OP, doom, w->inner->ops->name args);                                                  \
    }

WRAP(reserve, RESERVE, (gm_device * dev, size_t size, uintptr_t *va), (w->inner, size, va))
WRAP(unreserve, UNRESERVE, (gm_device * dev, uintptr_t va, size_t size), (w->inner, va, size))
WRAP(create, CREATE, (gm_device * dev, size_t pages, gm_handle *handle), (w->inner, pages, handle))
WRAP(release, RELEASE, (gm_device * dev, gm_handle handle), (w->inner, handle))
WRAP(map, MAP, (gm_device * dev, uintptr_t va, size_t pages, gm_handle handle), (w->inner, va, pages, handle))
WRAP(unmap, UNMAP, (gm_device * dev, uintptr_t va, size_t size), (w->inner, va, size))
WRAP(set_access, SET_ACCESS, (gm_device * dev, uintptr_t va, size_t size), (w->inner, va, size))
WRAP(event_create, EVENT_CREATE, (gm_device * dev, gm_event *ev), (w->inner, ev))
WRAP(event_destroy, EVENT_DESTROY, (gm_device * dev, gm_event ev), (w->inner, ev))
WRAP(event_record, EVENT_RECORD, (gm_device * dev, gm_event ev, gm_stream stream), (w->inner, ev, stream))
WRAP(event_query, EVENT_QUERY, (gm_device * dev, gm_event ev), (w->inner, ev))
WRAP(synchronize, SYNCHRONIZE, (gm_device * dev), (w->inner))
WRAP(mem_info, MEM_INFO, (gm_device * dev, size_t *free_bytes, size_t *total_bytes),
     (w->inner, free_bytes, total_bytes))
WRAP(processes, PROCESSES, (gm_device * dev, gm_proc_usage *out, size_t cap, size_t *n), (w->inner, out, cap, n))
WRAP(host_alloc, HOST_ALLOC, (gm_device * dev, size_t size, void **out), (w->inner, size, out))
WRAP(host_free, HOST_FREE, (gm_device * dev, void *ptr), (w->inner, ptr))
WRAP(copy_dtoh, COPY_DTOH, (gm_device * dev, void *dst, uintptr_t src, size_t size), (w->inner, dst, src, size))
WRAP(copy_htod, COPY_HTOD, (gm_device * dev, uintptr_t dst, const void *src, size_t size), (w->inner, dst, src, size))
WRAP(create_host, CREATE_HOST, (gm_device * dev, size_t pages, gm_handle *handle), (w->inner, pages, handle))
WRAP(copy_dtod, COPY_DTOD, (gm_device * dev, uintptr_t dst, uintptr_t src, size_t size), (w->inner, dst, src, size))
WRAP(stream_wait, STREAM_WAIT, (gm_device * dev, gm_stream stream, gm_event ev), (w->inner, stream, ev))
#undef WRAP

/* Not a counted op: only passed through. */
static int fault_capture_status(gm_device *dev, gm_stream stream, int *capturing) {
    fault_dev *w = (fault_dev *)dev;
    w->inner->last_error[0] = '\0';
    return settle(w, GM_OP__COUNT, 0, w->inner->ops->capture_status(w->inner, stream, capturing));
}

static int fault_stream_query(gm_device *dev, gm_stream stream) {
    fault_dev *w = (fault_dev *)dev;
    w->inner->last_error[0] = '\0';
    return settle(w, GM_OP__COUNT, 0, w->inner->ops->stream_query(w->inner, stream));
}

static void fault_destroy(gm_device *dev) {
    fault_dev *w = as_wrapper(dev);
    if (!w) return;
    w->inner->ops->destroy(w->inner);
    free(w);
}

static int verify_accessible(const gm_device *dev, uintptr_t va, size_t size) {
    const gm_device *in = as_wrapper(dev)->inner;
    return in->ops->verify->accessible(in, va, size);
}

static void verify_pages(const gm_device *dev, size_t *created, size_t *mapped) {
    const gm_device *in = as_wrapper(dev)->inner;
    in->ops->verify->pages(in, created, mapped);
}

static gm_handle verify_handle_at(const gm_device *dev, uintptr_t va) {
    const gm_device *in = as_wrapper(dev)->inner;
    return in->ops->verify->handle_at(in, va);
}
static int verify_host_at(const gm_device *dev, uintptr_t va) {
    const gm_device *in = as_wrapper(dev)->inner;
    return in->ops->verify->host_at ? in->ops->verify->host_at(in, va) : 0;
}

/* The wrapper's table: every op inner has, none it lacks. */
static void fill_ops(fault_dev *w) {
    const gm_device_ops *in = w->inner->ops;
    gm_device_ops *o = &w->ops;
    *o = (gm_device_ops){
        .reserve = fault_reserve,
        .unreserve = fault_unreserve,
        .create = fault_create,
        .release = fault_release,
        .map = fault_map,
        .unmap = fault_unmap,
        .set_access = fault_set_access,
        .event_create = fault_event_create,
        .event_destroy = fault_event_destroy,
        .event_record = fault_event_record,
        .event_query = fault_event_query,
        .synchronize = fault_synchronize,
        .mem_info = fault_mem_info,
        .processes = fault_processes,
        .host_alloc = in->host_alloc ? fault_host_alloc : NULL,
        .host_free = in->host_free ? fault_host_free : NULL,
        .copy_dtoh = in->copy_dtoh ? fault_copy_dtoh : NULL,
        .copy_htod = in->copy_htod ? fault_copy_htod : NULL,
        .create_host = in->create_host ? fault_create_host : NULL,
        .copy_dtod = in->copy_dtod ? fault_copy_dtod : NULL,
        .stream_wait = in->stream_wait ? fault_stream_wait : NULL,
        .destroy = fault_destroy,
        .capture_status = in->capture_status ? fault_capture_status : NULL,
        .stream_query = in->stream_query ? fault_stream_query : NULL,
        .verify = in->verify ? &w->verify : NULL,
        .checks_doomed = 0,
    };
    w->verify = (gm_device_verify){
        .accessible = verify_accessible,
        .pages = verify_pages,
        .handle_at = verify_handle_at,
        .host_at = verify_host_at,
    };
}

gm_device *gm_faults_wrap(gm_device *inner, const char *origin) {
    if (!inner) return NULL;
    fault_dev *w = calloc(1, sizeof *w);
    if (!w) return NULL;
    w->inner = inner;
    w->origin = origin;
    fill_ops(w);
    w->base.ops = &w->ops;
    w->base.kind = inner->kind;
    w->base.ordinal = inner->ordinal;
    w->base.page_size = inner->page_size;
    memcpy(w->base.name, inner->name, sizeof w->base.name);
    return &w->base;
}

void gm_faults_fail(gm_device *dev, gm_dev_op op, uint64_t nth, uint64_t count) {
    fault_dev *w = as_wrapper(dev);
    if (!w || (unsigned)op >= GM_OP__COUNT) return;
    fault_plan *f = &w->plan[op];
    if (nth == 0 || count == 0) {
        f->from = f->to = 0;
        return;
    }
    f->from = sat_add(w->calls[op], nth);
    f->to = sat_add(f->from, count - 1);
}

void gm_faults_fail_random(gm_device *dev, gm_dev_op op, double p, uint64_t seed) {
    fault_dev *w = as_wrapper(dev);
    if (!w || (unsigned)op >= GM_OP__COUNT) return;
    w->plan[op].p = p > 0.0 ? p : 0.0; /* NaN and negatives turn it off */
    w->plan[op].rng = seed;
}

uint64_t gm_faults_calls(const gm_device *dev, gm_dev_op op, uint64_t *fired) {
    const fault_dev *w = as_wrapper(dev);
    if (fired) *fired = 0;
    if (!w || (unsigned)op >= GM_OP__COUNT) return 0;
    if (fired) *fired = w->fired[op];
    return w->calls[op];
}

/* One "op:nth[:count]" entry; GM_OK with its parts, else GM_EINVAL. */
static int parse_entry(const char *tok, int *op, unsigned long long *nth, unsigned long long *count) {
    char name[32] = "";
    int used = 0;
    *nth = 0;
    *count = 1;
    int got = sscanf(tok, " %31[a-z_]:%llu%n:%llu%n", name, nth, &used, count, &used);
    *op = -1;
    for (int i = 0; i < GM_OP__COUNT; i++)
        if (!strcmp(name, gm_dev_op_name((gm_dev_op)i))) *op = i;
    return got < 2 || *op < 0 || *nth == 0 || *count == 0 || tok[used] != '\0' ? GM_EINVAL : GM_OK;
}

int gm_faults_schedule(gm_device *dev, const char *spec, const char *what, char *err, size_t errlen) {
    char buf[512];
    if (!spec || strlen(spec) >= sizeof buf) {
        snprintf(err, errlen, "%s is too long", what);
        return GM_EINVAL;
    }
    strcpy(buf, spec);
    uint64_t nth[GM_OP__COUNT] = {0}, count[GM_OP__COUNT] = {0};
    char *save = NULL;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        int op;
        unsigned long long n, c;
        if (parse_entry(tok, &op, &n, &c) != GM_OK) {
            snprintf(err, errlen, "%s: bad entry '%s' (want op:nth[:count], e.g. create:3,map:5:2)", what, tok);
            return GM_EINVAL;
        }
        nth[op] = n;
        count[op] = c;
    }
    for (int op = 0; op < GM_OP__COUNT && dev; op++)
        if (nth[op]) gm_faults_fail(dev, (gm_dev_op)op, nth[op], count[op]);
    return GM_OK;
}
