/*
 * heap_registry.c -- the process-wide heap registry (heap_registry.h): one
 * heap per device ordinal, its options and caps, and the locks that guard
 * creating a heap and the device calls made outside it.
 */
#include "heap_registry.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "gpumem/config.h"
#include "gpumem/registry.h"

typedef struct slot {
    _Atomic(gm_heap *) heap;
    pthread_mutex_t mu;   /* creation, and device calls made outside the heap */
    double fraction;      /* from gm_heap_registry_set_fraction; < 0: none (guarded by mu) */
    size_t outside;       /* bytes pools over other allocators hold of the cap (guarded by mu) */
    _Atomic size_t limit; /* effective cap: SIZE_MAX for none */
} slot;

static slot slots[GM_HEAP_REGISTRY_MAX_DEVICES];
static pthread_mutex_t opts_mu = PTHREAD_MUTEX_INITIALIZER;
static gm_heap_registry_options opts;
static int opts_ready;

/* fork(): every slot lock in device order, then the options lock. */
static void lock_all(void) {
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES; d++) pthread_mutex_lock(&slots[d].mu);
    pthread_mutex_lock(&opts_mu);
}

static void unlock_all(void) {
    pthread_mutex_unlock(&opts_mu);
    for (int d = GM_HEAP_REGISTRY_MAX_DEVICES; d-- > 0;) pthread_mutex_unlock(&slots[d].mu);
}

/* When the library is loaded: before any thread can have called in, and
 * whether Python imported it or torch and ctypes opened it. */
__attribute__((constructor)) static void registry_init(void) {
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES; d++) {
        pthread_mutex_init(&slots[d].mu, NULL);
        slots[d].fraction = -1.0;
        atomic_init(&slots[d].limit, SIZE_MAX);
    }
    gm_fork_also(lock_all, unlock_all);
}

void gm_heap_registry_options_default(gm_heap_registry_options *o) {
    memset(o, 0, sizeof *o);
    gm_config_default(&o->heap);
}

static gm_heap_registry_options options_snapshot(void) {
    pthread_mutex_lock(&opts_mu);
    if (!opts_ready) {
        gm_heap_registry_options_default(&opts);
        opts_ready = 1;
    }
    gm_heap_registry_options o = opts;
    pthread_mutex_unlock(&opts_mu);
    return o;
}

void gm_heap_registry_get_options(gm_heap_registry_options *o) { *o = options_snapshot(); }

int gm_heap_registry_valid(int device) { return device >= 0 && device < GM_HEAP_REGISTRY_MAX_DEVICES; }

gm_heap *gm_heap_registry_get(int device) {
    if (!gm_heap_registry_valid(device)) return NULL;
    return atomic_load_explicit(&slots[device].heap, memory_order_acquire);
}

static size_t device_total(gm_heap *h) {
    gm_oom_info info;
    gm_memory_report(h, 0, &info);
    return info.device_total;
}

/* The largest request the heap may serve: the cap, or with spill on the
 * spill limit where that is larger (such a request goes whole to host pages). */
static void refresh_limit(slot *s, gm_heap *h) {
    gm_oom_info info;
    gm_memory_report(h, 0, &info);
    size_t limit = info.cap_bytes ? info.cap_bytes : SIZE_MAX;
    if (info.spill_limit > limit) limit = info.spill_limit;
    atomic_store_explicit(&s->limit, limit, memory_order_relaxed);
}

/* The cap a heap should have: an explicit memory fraction wins over the options. */
static size_t wanted_cap(gm_heap *h, const gm_heap_registry_options *o, double fraction) {
    if (fraction >= 0) { /* a fraction of 0 allows nothing, as under torch's allocator (a cap of 0 is none) */
        size_t f = fraction >= 1.0 ? 0 : (size_t)(fraction * (double)device_total(h));
        return fraction < 1.0 && f == 0 ? 1 : f;
    }
    size_t cap = o->heap.cap_bytes;
    if (o->cap_fraction > 0 && o->cap_fraction < 1.0) {
        size_t f = (size_t)(o->cap_fraction * (double)device_total(h));
        if (!cap || f < cap) cap = f;
    }
    return cap;
}

/* The cap of the device (wanted_cap, 0: none), and in *outside what pools
 * over other allocators hold of it. */
static size_t device_cap(slot *s, gm_heap *h, size_t *outside) {
    gm_heap_registry_options o = options_snapshot();
    pthread_mutex_lock(&s->mu);
    double fraction = s->fraction;
    *outside = s->outside;
    pthread_mutex_unlock(&s->mu);
    return wanted_cap(h, &o, fraction);
}

/* Gives the heap the cap it should have, less what pools over other
 * allocators hold of it (ext_pool.c), and publishes the limit. */
static void apply_cap(slot *s, gm_heap *h) {
    size_t outside, cap = device_cap(s, h, &outside);
    if (cap && outside) cap = cap > outside ? cap - outside : 1;
    gm_set_cap(h, cap);
    refresh_limit(s, h);
}

/* GM_OK, or GM_EINVAL with the reason in err: the core's for the heap's options. */
static int check_options(const gm_heap_registry_options *o, char *err, size_t errlen) {
    if (!o)
        snprintf(err, errlen, "no options");
    else if (!(o->cap_fraction >= 0 && o->cap_fraction <= 1.0))
        snprintf(err, errlen, "cap_fraction must be in [0, 1], got %g", o->cap_fraction);
    else if (o->history_entries > ((size_t)1 << 32))
        snprintf(err, errlen, "history_entries must be at most 2**32, got %zu", o->history_entries);
    else if (gm_check_page_size(o->page_size, err, errlen) == GM_OK)
        return gm_config_check(&o->heap, err, errlen);
    return GM_EINVAL;
}

int gm_heap_registry_configure(const gm_heap_registry_options *o, char *err, size_t errlen) {
    if (check_options(o, err, errlen) != GM_OK) return GM_EINVAL;
    pthread_mutex_lock(&opts_mu);
    opts = *o;
    opts_ready = 1;
    pthread_mutex_unlock(&opts_mu);
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES; d++) {
        gm_heap *h = gm_heap_registry_get(d);
        if (h) apply_cap(&slots[d], h);
    }
    return GM_OK;
}

/* sim_capacity > 0 puts a simulated device behind the slot instead of CUDA.
 * NULL with the reason in why. */
static gm_heap *open_heap(int device, char *why, size_t whylen, size_t sim_capacity) {
    slot *s = &slots[device];
    pthread_mutex_lock(&s->mu);
    gm_heap *h = atomic_load_explicit(&s->heap, memory_order_acquire);
    if (h) {
        if (sim_capacity) {
            snprintf(why, whylen, "device %d already has a heap", device);
            h = NULL;
        }
        goto out;
    }
    gm_heap_registry_options o = options_snapshot();
    gm_device_args args;
    gm_device_args_default(&args);
    args.ordinal = device;
    args.page_size = o.page_size;
    args.capacity = sim_capacity;
    args.has_capacity = sim_capacity != 0;
    char err[256] = "";
    gm_device *dev = NULL;
    if (gm_device_open(sim_capacity ? "sim" : "cuda", &args, &dev, err, sizeof err) != GM_OK) {
        snprintf(why, whylen, "gpumem cannot open %s device %d: %s", sim_capacity ? "a simulated" : "CUDA", device,
                 err);
        goto out;
    }
    gm_config cfg = o.heap;
    cfg.cap_bytes = 0; /* the cap is set below, with a fraction of the device if one was asked for */
    int rc = gm_heap_create(dev, &cfg, &h);
    if (rc != GM_OK) {
        snprintf(why, whylen, "gpumem cannot create a heap on CUDA device %d: %s", device, gm_create_error());
        h = NULL;
        goto out;
    }
    size_t cap = wanted_cap(h, &o, s->fraction);
    if (cap) gm_set_cap(h, cap);
    if (o.history_entries) gm_history_enable(h, o.history_entries);
    refresh_limit(s, h);
    atomic_store_explicit(&s->heap, h, memory_order_release);
out:
    pthread_mutex_unlock(&s->mu);
    return h;
}

gm_heap *gm_heap_registry_open(int device, char *err, size_t errlen) {
    if (!gm_heap_registry_valid(device)) {
        snprintf(err, errlen, "device index %d out of range [0, %d)", device, GM_HEAP_REGISTRY_MAX_DEVICES);
        return NULL;
    }
    gm_heap *h = gm_heap_registry_get(device);
    return h ? h : open_heap(device, err, errlen, 0);
}

int gm_heap_registry_open_sim(int device, size_t capacity, char *err, size_t errlen) {
    if (!gm_heap_registry_valid(device) || !capacity) {
        snprintf(err, errlen, "bad device %d or capacity %zu", device, capacity);
        return GM_EINVAL;
    }
    return open_heap(device, err, errlen, capacity) ? GM_OK : GM_EINVAL;
}

int gm_heap_registry_set_cap(int device, size_t cap_bytes) {
    gm_heap *h = gm_heap_registry_get(device);
    if (!h) return GM_EINVAL;
    int rc = gm_set_cap(h, cap_bytes);
    refresh_limit(&slots[device], h);
    return rc;
}

void gm_heap_registry_set_fraction(int device, double fraction) {
    if (!gm_heap_registry_valid(device)) return;
    slot *s = &slots[device];
    pthread_mutex_lock(&s->mu);
    s->fraction = fraction;
    gm_heap *h = atomic_load_explicit(&s->heap, memory_order_acquire);
    pthread_mutex_unlock(&s->mu);
    if (h) apply_cap(s, h);
}

/* Whether the heap's reserved memory and `outside` bytes fit under `cap`. */
static int fits(gm_heap *h, size_t cap, size_t outside) {
    gm_oom_info info;
    gm_memory_report(h, 0, &info);
    return info.reserved_bytes + outside <= cap;
}

int gm_heap_registry_take_outside(int device, size_t bytes) {
    if (!gm_heap_registry_valid(device)) return GM_EINVAL;
    slot *s = &slots[device];
    gm_heap *h = gm_heap_registry_get(device);
    if (h) {
        size_t outside, cap = device_cap(s, h, &outside);
        outside += bytes;
        if (cap && !fits(h, cap, outside) && (gm_capturing(h) || gm_empty_cache(h) != GM_OK || !fits(h, cap, outside)))
            return GM_ENOMEM;
    }
    pthread_mutex_lock(&s->mu);
    s->outside += bytes;
    pthread_mutex_unlock(&s->mu);
    if (h) apply_cap(s, h);
    return GM_OK;
}

void gm_heap_registry_give_outside(int device, size_t bytes) {
    if (!gm_heap_registry_valid(device)) return;
    slot *s = &slots[device];
    pthread_mutex_lock(&s->mu);
    s->outside -= bytes < s->outside ? bytes : s->outside;
    pthread_mutex_unlock(&s->mu);
    gm_heap *h = gm_heap_registry_get(device);
    if (h) apply_cap(s, h);
}

size_t gm_heap_registry_limit(int device) {
    if (!gm_heap_registry_valid(device)) return SIZE_MAX;
    return atomic_load_explicit(&slots[device].limit, memory_order_relaxed);
}

int gm_heap_registry_history_enable(size_t n) {
    if (n > ((size_t)1 << 32)) return GM_EINVAL;
    pthread_mutex_lock(&opts_mu);
    if (!opts_ready) {
        gm_heap_registry_options_default(&opts);
        opts_ready = 1;
    }
    opts.history_entries = n;
    pthread_mutex_unlock(&opts_mu);
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES; d++) {
        gm_heap *h = gm_heap_registry_get(d);
        if (h && gm_history_enable(h, n) != GM_OK) return GM_ENOMEM;
    }
    return GM_OK;
}

void gm_heap_registry_empty_cache(void) {
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES; d++) {
        gm_heap *h = gm_heap_registry_get(d);
        if (h && !gm_capturing(h)) gm_empty_cache(h);
    }
}

int gm_heap_registry_processes(int device, gm_proc_usage *out, size_t cap, size_t *n) {
    gm_heap *h = gm_heap_registry_get(device);
    if (!h) return GM_EINVAL;
    gm_device *dev = gm_heap_device(h);
    pthread_mutex_lock(&slots[device].mu);
    int rc = dev->ops->processes(dev, out, cap, n);
    pthread_mutex_unlock(&slots[device].mu);
    return rc;
}

#ifdef GM_TEST_HOOKS
int gm_heap_registry_test_lock(int which, int device, int take) {
    pthread_mutex_t *mu = which == GM_HEAP_REGISTRY_LOCK_OPTIONS                                  ? &opts_mu
                          : which == GM_HEAP_REGISTRY_LOCK_SLOT && gm_heap_registry_valid(device) ? &slots[device].mu
                                                                                                  : NULL;
    if (!mu) return GM_EINVAL;
    if (take)
        pthread_mutex_lock(mu);
    else
        pthread_mutex_unlock(mu);
    return GM_OK;
}
#endif
