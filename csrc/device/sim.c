/*
 * sim.c -- the simulated device.
 *
 * No memory is ever allocated for "device" bytes: a page is a record, a
 * reservation is a range of made-up addresses with one slot per page.  The
 * device exists to be a strict witness.  Every call the CUDA driver would
 * reject (or silently accept while corrupting something) is refused here with
 * GM_EINVAL and a precise reason, so that an allocator bug shows up as a
 * failing test instead of a wrong number.
 *
 * Trace replay drives millions of calls through this file, so no hot call
 * scans pages or handles: handles index an array directly, reservations are
 * few (and the last one hit is cached), streams sit in a hash table, and free
 * ids are kept on free lists.  The only loops are over the pages a call names
 * (unmap / set_access of a range), which is work the caller asked for.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "gpumem/array.h"
#include "gpumem/faults.h"
#include "gpumem/gpumem.h"
#include "gpumem/sim.h"

/* Where made-up reservations start: the shape of a real CUDA address on x86-64
 * Linux, far from 0 so that a zero or small integer is never mistaken for one. */
#define SIM_VA_BASE ((uintptr_t)0x7f0000000000ull)
/* Unreserved space left between reservations, so that running off the end of
 * one lands in a hole the device rejects instead of in the next range. */
#define SIM_VA_GAP  ((size_t)1 << 30)
#define SIM_NONE    UINT32_MAX
/* Content of a page nobody wrote: this tag with a counter (gm_sim_read). */
#define SIM_FRESH   ((uint64_t)0xF4E5000000000000ull)

/* One physical allocation of `npages` pages (a handle). */
typedef struct sim_page {
    uintptr_t mapped_at; /* 0 when not mapped (no reservation starts at 0) */
    uint64_t content;    /* what a one-page allocation holds: one value stands for its bytes (gm_sim_write) */
    uint64_t *contents;  /* the same per page, for npages > 1 (malloc'd) */
    size_t npages;
    uint32_t next_free; /* free-list link while !alive */
    uint8_t alive;
    uint8_t host; /* located in host memory (create_host): not the device's capacity */
} sim_page;

/* The content of page k of allocation p. */
static inline uint64_t *content_of(sim_page *p, size_t k) { return p->npages > 1 ? &p->contents[k] : &p->content; }

typedef struct sim_resv {
    uintptr_t va;
    size_t size, npages;
    size_t mapped;     /* pages mapped: unreserve checks this in O(1) */
    gm_handle *handle; /* per page: the handle mapped there, 0 if none */
    uint8_t *access;   /* per page: access granted since it was mapped */
} sim_resv;

/* What a stream's work waits for on the device (stream_wait): the work of
 * held streams recorded under a hold (a stream index and its epoch then), and
 * late work (complete once the clock reaches `due`, or at a synchronize after
 * `recorded`; due 0: none).  Two late waits fold into one that ends no
 * earlier than either. */
#define SIM_WAIT_HELD 4
typedef struct sim_after {
    uint64_t recorded, due;
    uint32_t n_held;
    struct sim_held {
        uint32_t stream_idx;
        uint64_t epoch;
    } held[SIM_WAIT_HELD];
} sim_after;

typedef struct sim_event {
    uint64_t epoch;      /* the stream's epoch when recorded */
    uint64_t recorded;   /* the device clock when recorded; 0 if never */
    uint64_t due;        /* event delay: not complete while the clock is below this; 0 for none */
    uint32_t stream_idx; /* into streams[], SIM_NONE if it recorded on no held stream */
    uint32_t next_free;
    uint8_t alive;
    sim_after after; /* what its stream waited for before it was recorded */
} sim_event;

/* Only streams that have ever been held, marked capturing or made to wait get a record: events on
 * any other stream complete at once and need none. */
typedef struct sim_stream {
    gm_stream stream;
    uint64_t epoch; /* bumped when a hold ends: completes what was recorded under it */
    uint8_t held;
    uint8_t capturing; /* marked by gm_sim_set_stream_capture */
    sim_after waits;   /* stream_wait: its later work runs after this */
} sim_stream;

typedef struct sim_ext {
    uint32_t pid;
    uint64_t bytes;
} sim_ext;

typedef struct sim_device {
    gm_device base; /* first: a gm_device * is a sim_device * */
    size_t capacity;

    sim_page *pages; /* index = handle; [0] unused so that no handle is 0 */
    uint32_t n_pages_slots, cap_pages;
    uint32_t free_head, free_tail; /* FIFO: a released id comes back as late as possible */
    size_t pages_created, pages_mapped;
    size_t host_created, host_mapped, host_capacity; /* host-located pages (in the two above too), their most */
    size_t copies_running; /* copy_dtod calls issued since the last synchronize: no unmap until it */

    sim_resv *resv;
    size_t n_resv, cap_resv, last_resv;
    uintptr_t next_va;

    sim_event *events; /* index = event id; [0] unused */
    uint32_t n_event_slots, cap_events, event_free;
    size_t events_alive;

    sim_stream *streams;
    uint32_t n_streams, cap_streams;
    uint32_t *stream_hash; /* open addressing: index+1 into streams[], 0 empty */
    uint32_t hash_cap;     /* power of two */
    size_t held_count;

    uint32_t self_pid;
    uint64_t self_outside;
    sim_ext *ext;
    size_t n_ext, cap_ext;
    uint64_t ext_total;
    int nvml;

    uint64_t clock;       /* device operations so far, all kinds */
    uint64_t event_delay; /* gm_sim_set_event_delay */
    uint64_t synced;      /* clock at the last synchronize: completes what was recorded up to it */

    uint64_t next_content; /* a fresh page's content: never written, never repeated */
    struct sim_host {
        void *ptr;
        size_t size;
    } *host; /* host_alloc'd blocks not freed yet */
    size_t host_blocks, cap_host;

    int capture_all;          /* gm_sim_set_capture */
    size_t capturing_streams; /* streams marked capturing */
    uint64_t capture_violations;
} sim_device;

static const gm_device_ops sim_ops;

/* The simulated device behind dev (gm_sim_create wraps it), or NULL. */
static sim_device *as_sim(gm_device *dev) {
    dev = gm_faults_inner(dev);
    return (dev && dev->ops == &sim_ops) ? (sim_device *)dev : NULL;
}

static const sim_device *as_sim_c(const gm_device *dev) { return as_sim((gm_device *)(uintptr_t)dev); }

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static int
fail(sim_device *s, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->base.last_error, sizeof s->base.last_error, fmt, ap);
    va_end(ap);
    return code;
}

/* Every counted call ticks the device clock (late events count it).  Counts
 * and fault injection belong to the wrapper that gm_sim_create puts around the
 * device (device/faults.c): it calls a doomed op here so the arguments are
 * still checked -- an invalid call answers GM_EINVAL, so injection never hides
 * an allocator bug -- and the op then returns GM_OK having changed nothing. */
static void sim_enter(sim_device *s) { s->clock++; }

/* A call a real capture would not survive: refused and counted while one is on. */
static int capture_forbids(sim_device *s, const char *op) {
    if (!s->capture_all && !s->capturing_streams) return 0;
    s->capture_violations++;
    fail(s, GM_EDEVICE, "%s: not permitted during stream capture (it would invalidate the graph)", op);
    return 1;
}

/* Whether `id` names a live record (a handle, an event): if not, last_error
 * says it is unknown (id 0, or never made) or was `gone` ("released"). */
static int live(sim_device *s, const char *op, const char *what, const char *gone, uint64_t id, int known, int alive) {
    if (alive) return 1;
    if (id == 0 || !known)
        fail(s, GM_EINVAL, "%s: unknown %s %llu", op, what, (unsigned long long)id);
    else
        fail(s, GM_EINVAL, "%s: %s %llu was %s", op, what, (unsigned long long)id, gone);
    return 0;
}

/* sim_enter for a call that a real capture would not survive: 1 if refused. */
static int sim_enter_uncapturable(sim_device *s, gm_dev_op op) {
    sim_enter(s);
    return capture_forbids(s, gm_dev_op_name(op));
}

static uint64_t sat_add(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

/* ---- reservations ------------------------------------------------------- */

static sim_resv *find_resv(sim_device *s, uintptr_t va) {
    if (s->last_resv < s->n_resv) {
        sim_resv *r = &s->resv[s->last_resv];
        if (va >= r->va && va - r->va < r->size) return r;
    }
    for (size_t i = 0; i < s->n_resv; i++) {
        sim_resv *r = &s->resv[i];
        if (va >= r->va && va - r->va < r->size) {
            s->last_resv = i;
            return r;
        }
    }
    return NULL;
}

/* The reservation holding all of [va, va+size), which must be whole pages;
 * NULL with last_error set otherwise. */
static sim_resv *range_resv(sim_device *s, const char *op, uintptr_t va, size_t size, size_t *first) {
    size_t ps = s->base.page_size;
    if (size == 0 || size % ps != 0 || va % ps != 0) {
        fail(s, GM_EINVAL, "%s: range 0x%" PRIxPTR "+%zu is not whole pages of %zu bytes", op, va, size, ps);
        return NULL;
    }
    sim_resv *r = find_resv(s, va);
    if (!r) {
        fail(s, GM_EINVAL, "%s: 0x%" PRIxPTR " lies in no reservation", op, va);
        return NULL;
    }
    if (size > r->size - (va - r->va)) {
        fail(s, GM_EINVAL, "%s: range 0x%" PRIxPTR "+%zu runs past the end of reservation 0x%" PRIxPTR "+%zu", op, va,
             size, r->va, r->size);
        return NULL;
    }
    *first = (va - r->va) / ps;
    return r;
}

static int sim_reserve(gm_device *dev, size_t size, uintptr_t *va) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    size_t ps = dev->page_size;
    if (!va) return fail(s, GM_EINVAL, "reserve: NULL output pointer");
    if (size == 0 || size % ps != 0)
        return fail(s, GM_EINVAL, "reserve: size %zu is not a positive multiple of the page size %zu", size, ps);
    if (dev->doomed) return GM_OK;
    uintptr_t at = s->next_va;
    if (size > UINTPTR_MAX - at || SIM_VA_GAP > UINTPTR_MAX - at - size)
        return fail(s, GM_ENOMEM, "reserve: out of virtual address space for %zu bytes", size);
    if (s->n_resv == s->cap_resv) {
        sim_resv *nr = gm_array_grow(s->resv, &s->cap_resv, 4, sizeof *nr);
        if (!nr) return fail(s, GM_ENOMEM, "reserve: out of host memory");
        s->resv = nr;
    }
    size_t np = size / ps;
    gm_handle *h = calloc(np, sizeof *h);
    uint8_t *acc = calloc(np, 1);
    if (!h || !acc) {
        free(h);
        free(acc);
        return fail(s, GM_ENOMEM, "reserve: out of host memory to track %zu pages", np);
    }
    sim_resv *r = &s->resv[s->n_resv++];
    r->va = at;
    r->size = size;
    r->npages = np;
    r->mapped = 0;
    r->handle = h;
    r->access = acc;
    /* Addresses are never handed out twice: a stale pointer into a released
     * reservation stays invalid for the life of the device. */
    uintptr_t next = at + size + SIM_VA_GAP;
    s->next_va = next + (ps - next % ps) % ps;
    *va = at;
    return GM_OK;
}

static int sim_unreserve(gm_device *dev, uintptr_t va, size_t size) {
    sim_device *s = (sim_device *)dev;
    if (sim_enter_uncapturable(s, GM_OP_UNRESERVE)) return GM_EDEVICE;
    sim_resv *r = find_resv(s, va);
    if (!r || r->va != va || r->size != size)
        return fail(s, GM_EINVAL, "unreserve: 0x%" PRIxPTR "+%zu is not exactly a reservation", va, size);
    if (r->mapped)
        return fail(s, GM_EINVAL, "unreserve: reservation 0x%" PRIxPTR "+%zu still has %zu pages mapped", va, size,
                    r->mapped);
    if (dev->doomed) return GM_OK;
    free(r->handle);
    free(r->access);
    size_t i = (size_t)(r - s->resv);
    memmove(r, r + 1, (s->n_resv - i - 1) * sizeof *r); /* keep address order */
    s->n_resv--;
    s->last_resv = 0;
    return GM_OK;
}

/* ---- physical pages ------------------------------------------------------ */

static uint64_t used_bytes(const sim_device *s) {
    uint64_t pages = (uint64_t)(s->pages_created - s->host_created) * s->base.page_size;
    return sat_add(sat_add(pages, s->ext_total), s->self_outside);
}

/* A new allocation of npages pages, on the device or (host) in host memory. */
static int create_pages(sim_device *s, size_t npages, int host, gm_handle *handle) {
    uint64_t *contents = NULL;
    if (npages > 1 && !(contents = malloc(npages * sizeof *contents)))
        return fail(s, GM_ENOMEM, "create: out of host memory");
    uint32_t id = s->free_head;
    if (id != SIM_NONE) {
        s->free_head = s->pages[id].next_free;
        if (s->free_head == SIM_NONE) s->free_tail = SIM_NONE;
    } else {
        if (s->n_pages_slots == s->cap_pages) {
            size_t nc = s->cap_pages;
            sim_page *np = s->cap_pages >= UINT32_MAX / 2 ? NULL : gm_array_grow(s->pages, &nc, 64, sizeof *np);
            if (!np) {
                free(contents);
                return fail(s, GM_ENOMEM, "create: too many allocations");
            }
            s->pages = np;
            s->cap_pages = (uint32_t)nc;
        }
        id = s->n_pages_slots++;
    }
    s->pages[id].alive = 1;
    s->pages[id].host = (uint8_t)host;
    s->host_created += host ? npages : 0;
    s->pages[id].mapped_at = 0;
    s->pages[id].npages = npages;
    s->pages[id].contents = contents;
    for (size_t k = 0; k < npages; k++) *content_of(&s->pages[id], k) = SIM_FRESH | ++s->next_content;
    s->pages[id].next_free = SIM_NONE;
    s->pages_created += npages;
    *handle = id;
    return GM_OK;
}

static int sim_create(gm_device *dev, size_t npages, gm_handle *handle) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    if (!handle) return fail(s, GM_EINVAL, "create: NULL output pointer");
    if (npages == 0 || npages > (size_t)1 << 32) return fail(s, GM_EINVAL, "create: %zu pages", npages);
    if (dev->doomed) return GM_OK;
    uint64_t used = used_bytes(s);
    if (used > s->capacity || (s->capacity - used) / dev->page_size < npages)
        return fail(s, GM_ENOMEM,
                    "create: out of memory for %zu pages (%zu pages of %zu bytes created, %llu bytes held by "
                    "other processes, %llu outside the allocator, capacity %zu)",
                    npages, s->pages_created - s->host_created, dev->page_size, (unsigned long long)s->ext_total,
                    (unsigned long long)s->self_outside, s->capacity);
    return create_pages(s, npages, 0, handle);
}

/* Host-located pages: their own limit (gm_sim_set_host_capacity), none of the device's. */
static int sim_create_host(gm_device *dev, size_t npages, gm_handle *handle) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    if (!handle) return fail(s, GM_EINVAL, "create_host: NULL output pointer");
    if (npages == 0 || npages > (size_t)1 << 32) return fail(s, GM_EINVAL, "create_host: %zu pages", npages);
    if (dev->doomed) return GM_OK;
    size_t most = s->host_capacity / dev->page_size;
    if (s->host_created > most || most - s->host_created < npages)
        return fail(s, GM_ENOMEM,
                    "create_host: out of host memory for %zu pages (%zu of %zu bytes created, %zu allowed)", npages,
                    s->host_created, dev->page_size, s->host_capacity);
    return create_pages(s, npages, 1, handle);
}

/* The live page record for a handle, or NULL with last_error set. */
static sim_page *live_page(sim_device *s, const char *op, gm_handle handle) {
    int alive = handle > 0 && handle < s->n_pages_slots && s->pages[handle].alive;
    return live(s, op, "handle", "released", handle, handle < s->n_pages_slots, alive) ? &s->pages[handle] : NULL;
}

static int sim_release(gm_device *dev, gm_handle handle) {
    sim_device *s = (sim_device *)dev;
    if (sim_enter_uncapturable(s, GM_OP_RELEASE)) return GM_EDEVICE;
    sim_page *p = live_page(s, "release", handle);
    if (!p) return GM_EINVAL;
    if (p->mapped_at)
        return fail(s, GM_EINVAL, "release: handle %llu is still mapped at 0x%" PRIxPTR "", (unsigned long long)handle,
                    p->mapped_at);
    if (dev->doomed) return GM_OK;
    p->alive = 0;
    s->pages_created -= p->npages;
    if (p->host) s->host_created -= p->npages;
    free(p->contents);
    p->contents = NULL;
    p->next_free = SIM_NONE;
    if (s->free_tail == SIM_NONE)
        s->free_head = (uint32_t)handle;
    else
        s->pages[s->free_tail].next_free = (uint32_t)handle;
    s->free_tail = (uint32_t)handle;
    return GM_OK;
}

/* ---- mapping ------------------------------------------------------------- */

static int sim_map(gm_device *dev, uintptr_t va, size_t npages, gm_handle handle) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    size_t first;
    if (npages == 0 || npages > SIZE_MAX / dev->page_size) return fail(s, GM_EINVAL, "map: %zu pages", npages);
    sim_resv *r = range_resv(s, "map", va, npages * dev->page_size, &first);
    if (!r) return GM_EINVAL;
    sim_page *p = live_page(s, "map", handle);
    if (!p) return GM_EINVAL;
    if (p->npages != npages)
        return fail(s, GM_EINVAL, "map: handle %llu has %zu pages, not %zu (only a whole allocation maps)",
                    (unsigned long long)handle, p->npages, npages);
    for (size_t i = 0; i < npages; i++)
        if (r->handle[first + i])
            return fail(s, GM_EINVAL, "map: page at 0x%" PRIxPTR " is already mapped (handle %llu)",
                        va + i * dev->page_size, (unsigned long long)r->handle[first + i]);
    if (p->mapped_at)
        return fail(s, GM_EINVAL, "map: handle %llu is already mapped at 0x%" PRIxPTR "", (unsigned long long)handle,
                    p->mapped_at);
    if (dev->doomed) return GM_OK;
    for (size_t i = 0; i < npages; i++) {
        r->handle[first + i] = handle;
        r->access[first + i] = 0; /* CUDA grants nothing to a fresh mapping */
    }
    r->mapped += npages;
    p->mapped_at = va;
    s->pages_mapped += npages;
    s->host_mapped += p->host ? npages : 0;
    return GM_OK;
}

static int sim_unmap(gm_device *dev, uintptr_t va, size_t size) {
    sim_device *s = (sim_device *)dev;
    if (sim_enter_uncapturable(s, GM_OP_UNMAP)) return GM_EDEVICE;
    if (s->copies_running)
        return fail(s, GM_EINVAL, "unmap: 0x%" PRIxPTR "+%zu while %zu copies may still run (synchronize first)", va,
                    size, s->copies_running);
    size_t first;
    sim_resv *r = range_resv(s, "unmap", va, size, &first);
    if (!r) return GM_EINVAL;
    size_t n = size / dev->page_size;
    /* Whole mappings only: each starts where the last ended, the last ends at va+size. */
    for (size_t i = 0; i < n;) {
        uintptr_t at = va + i * dev->page_size;
        if (!r->handle[first + i])
            return fail(s, GM_EINVAL, "unmap: page at 0x%" PRIxPTR " in 0x%" PRIxPTR "+%zu is not mapped", at, va,
                        size);
        const sim_page *p = &s->pages[r->handle[first + i]];
        if (p->mapped_at != at || n - i < p->npages)
            return fail(s, GM_EINVAL,
                        "unmap: 0x%" PRIxPTR "+%zu cuts the %zu-page mapping of handle %llu at 0x%" PRIxPTR
                        " (only whole mappings unmap)",
                        va, size, p->npages, (unsigned long long)r->handle[first + i], p->mapped_at);
        i += p->npages;
    }
    if (dev->doomed) return GM_OK;
    for (size_t i = 0; i < n; i++) {
        s->host_mapped -= s->pages[r->handle[first + i]].host;
        s->pages[r->handle[first + i]].mapped_at = 0;
        r->handle[first + i] = 0;
        r->access[first + i] = 0;
    }
    r->mapped -= n;
    s->pages_mapped -= n;
    return GM_OK;
}

static int sim_set_access(gm_device *dev, uintptr_t va, size_t size) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    size_t first;
    sim_resv *r = range_resv(s, "set_access", va, size, &first);
    if (!r) return GM_EINVAL;
    size_t n = size / dev->page_size;
    for (size_t i = 0; i < n; i++)
        if (!r->handle[first + i])
            return fail(s, GM_EINVAL, "set_access: page at 0x%" PRIxPTR " in 0x%" PRIxPTR "+%zu is not mapped",
                        (va + i * dev->page_size), va, size);
    if (dev->doomed) return GM_OK;
    memset(r->access + first, 1, n);
    return GM_OK;
}

/* ---- host memory and copies ---------------------------------------------- */

/* Host memory is real, mapped anonymous and untouched (a backup of gigabytes
 * costs what the copies write); a copy moves one 8-byte value per page, the
 * page's content, to or from the start of that page's slice of the buffer. */
static int sim_host_alloc(gm_device *dev, size_t size, void **out) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    if (!out || !size) return fail(s, GM_EINVAL, "host_alloc: NULL output pointer or size 0");
    if (dev->doomed) return GM_OK;
    if (s->host_blocks == s->cap_host) {
        struct sim_host *nh = gm_array_grow(s->host, &s->cap_host, 4, sizeof *nh);
        if (!nh) return fail(s, GM_ENOMEM, "host_alloc: out of host memory");
        s->host = nh;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return fail(s, GM_ENOMEM, "host_alloc: out of host memory for %zu bytes", size);
    s->host[s->host_blocks++] = (struct sim_host){p, size};
    *out = p;
    return GM_OK;
}

static int sim_host_free(gm_device *dev, void *ptr) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    size_t k = 0;
    while (k < s->host_blocks && s->host[k].ptr != ptr) k++;
    if (k == s->host_blocks) return fail(s, GM_EINVAL, "host_free: %p is not a host block of this device", ptr);
    /* Freed even when the call is doomed: a failing free must not leak in tests. */
    munmap(ptr, s->host[k].size);
    s->host[k] = s->host[--s->host_blocks];
    return GM_OK;
}

/* Whether [p, p+size) lies inside one host block. */
static int in_host(const sim_device *s, const void *p, size_t size) {
    for (size_t k = 0; k < s->host_blocks; k++) {
        const char *b = s->host[k].ptr;
        if ((const char *)p >= b && size <= s->host[k].size && (size_t)((const char *)p - b) <= s->host[k].size - size)
            return 1;
    }
    return 0;
}

/* The content of page k of reservation r, which is mapped. */
static uint64_t *page_content(sim_device *s, const sim_resv *r, size_t k) {
    sim_page *p = &s->pages[r->handle[k]];
    return content_of(p, (r->va + k * s->base.page_size - p->mapped_at) / s->base.page_size);
}

/* The reservation slice of [va, va+size): whole pages, mapped, accessible. */
static sim_resv *copy_range(sim_device *s, const char *op, uintptr_t va, size_t size, size_t *first) {
    sim_resv *r = range_resv(s, op, va, size, first);
    if (!r) return NULL;
    for (size_t i = 0; i < size / s->base.page_size; i++) {
        if (!r->handle[*first + i] || !r->access[*first + i]) {
            fail(s, GM_EINVAL, "%s: page at 0x%" PRIxPTR " is not mapped and accessible", op,
                 va + i * s->base.page_size);
            return NULL;
        }
    }
    return r;
}

/* Copy whole pages between the device range at va and the host block at
 * host, one stored value per page: to the host for GM_OP_COPY_DTOH, from it
 * for GM_OP_COPY_HTOD. */
static int sim_copy(gm_device *dev, gm_dev_op op, uintptr_t va, void *host, size_t size) {
    sim_device *s = (sim_device *)dev;
    const char *name = gm_dev_op_name(op);
    if (sim_enter_uncapturable(s, op)) return GM_EDEVICE;
    size_t first;
    sim_resv *r = copy_range(s, name, va, size, &first);
    if (!r) return GM_EINVAL;
    if (!in_host(s, host, size)) return fail(s, GM_EINVAL, "%s: %p+%zu is not inside a host block", name, host, size);
    if (dev->doomed) return GM_OK;
    for (size_t i = 0; i < size / dev->page_size; i++) {
        char *h = (char *)host + i * dev->page_size;
        void *d = page_content(s, r, first + i);
        if (op == GM_OP_COPY_DTOH)
            memcpy(h, d, sizeof(uint64_t));
        else
            memcpy(d, h, sizeof(uint64_t));
    }
    return GM_OK;
}

static int sim_copy_dtoh(gm_device *dev, void *dst, uintptr_t src, size_t size) {
    return sim_copy(dev, GM_OP_COPY_DTOH, src, dst, size);
}

static int sim_copy_htod(gm_device *dev, uintptr_t dst, const void *src, size_t size) {
    return sim_copy(dev, GM_OP_COPY_HTOD, dst, (void *)(uintptr_t)src, size);
}

/* Whole pages between two mapped, accessible ranges: each page's content. */
static int sim_copy_dtod(gm_device *dev, uintptr_t dst, uintptr_t src, size_t size) {
    sim_device *s = (sim_device *)dev;
    if (sim_enter_uncapturable(s, GM_OP_COPY_DTOD)) return GM_EDEVICE;
    size_t fs, fd;
    sim_resv *rs = copy_range(s, "copy_dtod", src, size, &fs);
    if (!rs) return GM_EINVAL;
    sim_resv *rd = copy_range(s, "copy_dtod", dst, size, &fd);
    if (!rd) return GM_EINVAL;
    if (dst < src + size && src < dst + size)
        return fail(s, GM_EINVAL, "copy_dtod: 0x%" PRIxPTR " and 0x%" PRIxPTR " overlap (+%zu)", dst, src, size);
    if (dev->doomed) return GM_OK;
    for (size_t i = 0; i < size / dev->page_size; i++) *page_content(s, rd, fd + i) = *page_content(s, rs, fs + i);
    s->copies_running++; /* copied at once here, but a GPU's copy runs until a synchronize */
    return GM_OK;
}

/* ---- streams and events -------------------------------------------------- */

static uint32_t stream_slot(const sim_device *s, gm_stream stream) {
    uint64_t x = stream;
    x = (x ^ (x >> 33)) * 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return (uint32_t)x & (s->hash_cap - 1);
}

/* Index of the stream's record, or SIM_NONE if it was never held. */
static uint32_t stream_find(const sim_device *s, gm_stream stream) {
    if (!s->hash_cap) return SIM_NONE;
    for (uint32_t i = stream_slot(s, stream);; i = (i + 1) & (s->hash_cap - 1)) {
        uint32_t e = s->stream_hash[i];
        if (!e) return SIM_NONE;
        if (s->streams[e - 1].stream == stream) return e - 1;
    }
}

static uint32_t stream_add(sim_device *s, gm_stream stream) {
    if (s->n_streams == s->cap_streams) {
        size_t nc = s->cap_streams;
        sim_stream *ns = s->cap_streams <= UINT32_MAX / 2 ? gm_array_grow(s->streams, &nc, 8, sizeof *ns) : NULL;
        if (!ns) return SIM_NONE;
        s->streams = ns;
        s->cap_streams = (uint32_t)nc;
    }
    if ((s->n_streams + 1) * 2 > s->hash_cap) {
        uint32_t nc = s->hash_cap ? 2 * s->hash_cap : 16;
        uint32_t *nh = calloc(nc, sizeof *nh);
        if (!nh) return SIM_NONE;
        free(s->stream_hash);
        s->stream_hash = nh;
        s->hash_cap = nc;
        for (uint32_t k = 0; k < s->n_streams; k++) {
            uint32_t i = stream_slot(s, s->streams[k].stream);
            while (nh[i]) i = (i + 1) & (nc - 1);
            nh[i] = k + 1;
        }
    }
    uint32_t k = s->n_streams++;
    s->streams[k].stream = stream;
    s->streams[k].epoch = 0;
    s->streams[k].held = 0;
    s->streams[k].capturing = 0;
    memset(&s->streams[k].waits, 0, sizeof s->streams[k].waits);
    uint32_t i = stream_slot(s, stream);
    while (s->stream_hash[i]) i = (i + 1) & (s->hash_cap - 1);
    s->stream_hash[i] = k + 1;
    return k;
}

/* The stream's record, made if `make` (NULL if there is none, or no host memory to make it). */
static sim_stream *stream_record(sim_device *s, gm_stream stream, int make) {
    uint32_t k = stream_find(s, stream);
    if (k == SIM_NONE && make) k = stream_add(s, stream);
    return k == SIM_NONE ? NULL : &s->streams[k];
}

/* Set *flag to `on`, keeping *count the number of flags set: 1 if it changed. */
static int switch_flag(uint8_t *flag, int on, size_t *count) {
    if (!*flag == !on) return 0;
    *flag = on != 0;
    if (on)
        (*count)++;
    else
        (*count)--;
    return 1;
}

static sim_event *live_event(sim_device *s, const char *op, gm_event ev) {
    int alive = ev > 0 && ev < s->n_event_slots && s->events[ev].alive;
    return live(s, op, "event", "destroyed", ev, ev < s->n_event_slots, alive) ? &s->events[ev] : NULL;
}

static int sim_event_create(gm_device *dev, gm_event *ev) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    if (!ev) return fail(s, GM_EINVAL, "event_create: NULL output pointer");
    if (dev->doomed) return GM_OK;
    uint32_t id = s->event_free;
    if (id != SIM_NONE) {
        s->event_free = s->events[id].next_free;
    } else {
        if (s->n_event_slots == s->cap_events) {
            if (s->cap_events >= UINT32_MAX / 2) return fail(s, GM_EDEVICE, "event_create: too many events");
            size_t nc = s->cap_events;
            sim_event *ne = gm_array_grow(s->events, &nc, 64, sizeof *ne);
            if (!ne) return fail(s, GM_EDEVICE, "event_create: out of host memory");
            s->events = ne;
            s->cap_events = (uint32_t)nc;
        }
        id = s->n_event_slots++;
    }
    s->events[id].alive = 1;
    s->events[id].stream_idx = SIM_NONE; /* never recorded: complete, as in CUDA */
    s->events[id].epoch = 0;
    s->events[id].recorded = 0;
    s->events[id].due = 0;
    s->events[id].next_free = SIM_NONE;
    s->events_alive++;
    *ev = id;
    return GM_OK;
}

static int sim_event_destroy(gm_device *dev, gm_event ev) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    sim_event *e = live_event(s, "event_destroy", ev);
    if (!e) return GM_EINVAL;
    if (dev->doomed) return GM_OK;
    e->alive = 0;
    e->next_free = s->event_free;
    s->event_free = (uint32_t)ev;
    s->events_alive--;
    return GM_OK;
}

static int sim_event_record(gm_device *dev, gm_event ev, gm_stream stream) {
    sim_device *s = (sim_device *)dev;
    if (sim_enter_uncapturable(s, GM_OP_EVENT_RECORD)) return GM_EDEVICE;
    sim_event *e = live_event(s, "event_record", ev);
    if (!e) return GM_EINVAL;
    if (dev->doomed) return GM_OK;
    uint32_t k = stream_find(s, stream);
    if (k != SIM_NONE && s->streams[k].held) {
        e->stream_idx = k;
        e->epoch = s->streams[k].epoch;
    } else {
        e->stream_idx = SIM_NONE;
    }
    if (k != SIM_NONE)
        e->after = s->streams[k].waits;
    else
        memset(&e->after, 0, sizeof e->after);
    /* With an event delay, work on any stream but the legacy default one is
     * still running: the event completes once `event_delay` further operations
     * have run (the query that asks is not one of them) or at a synchronize. */
    e->recorded = s->clock;
    e->due = (s->event_delay && stream != 0) ? sat_add(sat_add(s->clock, s->event_delay), 1) : 0;
    return GM_OK;
}

/* Whether work recorded on held stream k under its epoch `epoch` has finished. */
static int held_done(const sim_device *s, uint32_t k, uint64_t epoch) {
    return k == SIM_NONE || !s->streams[k].held || s->streams[k].epoch != epoch;
}

/* Whether late work recorded at `recorded`, due at `due`, has finished. */
static int late_done(const sim_device *s, uint64_t recorded, uint64_t due) {
    return !due || s->clock >= due || recorded <= s->synced;
}

static int after_done(const sim_device *s, const sim_after *a) {
    for (uint32_t i = 0; i < a->n_held; i++)
        if (!held_done(s, a->held[i].stream_idx, a->held[i].epoch)) return 0;
    return late_done(s, a->recorded, a->due);
}

static int event_done(const sim_device *s, const sim_event *e) {
    return held_done(s, e->stream_idx, e->epoch) && late_done(s, e->recorded, e->due) && after_done(s, &e->after);
}

static int sim_event_query(gm_device *dev, gm_event ev) {
    sim_device *s = (sim_device *)dev;
    if (sim_enter_uncapturable(s, GM_OP_EVENT_QUERY)) return GM_EDEVICE;
    sim_event *e = live_event(s, "event_query", ev);
    if (!e) return GM_EINVAL;
    if (dev->doomed) return GM_OK;
    return event_done(s, e) ? GM_OK : GM_ENOTREADY;
}

/* a also waits for held stream k's work under `epoch`: 0 if a has no room left. */
static int after_add_held(const sim_device *s, sim_after *a, uint32_t k, uint64_t epoch) {
    if (held_done(s, k, epoch)) return 1;
    for (uint32_t i = 0; i < a->n_held; i++)
        if (a->held[i].stream_idx == k && a->held[i].epoch == epoch) return 1;
    if (a->n_held == SIM_WAIT_HELD) return 0;
    a->held[a->n_held].stream_idx = k;
    a->held[a->n_held++].epoch = epoch;
    return 1;
}

/* a also waits for late work (recorded, due): one late wait that ends no earlier than both. */
static void after_add_late(const sim_device *s, sim_after *a, uint64_t recorded, uint64_t due) {
    if (late_done(s, recorded, due)) return;
    if (late_done(s, a->recorded, a->due)) {
        a->recorded = recorded, a->due = due;
        return;
    }
    if (recorded > a->recorded) a->recorded = recorded;
    if (due > a->due) a->due = due;
}

/* The stream's later work runs after the event's: what the event waits for
 * joins what the stream waits for (held streams' work, late work, and what
 * the event's own stream waited for). */
static int sim_stream_wait(gm_device *dev, gm_stream stream, gm_event ev) {
    sim_device *s = (sim_device *)dev;
    if (sim_enter_uncapturable(s, GM_OP_STREAM_WAIT)) return GM_EDEVICE;
    sim_event *e = live_event(s, "stream_wait", ev);
    if (!e) return GM_EINVAL;
    if (dev->doomed) return GM_OK;
    if (event_done(s, e)) return GM_OK;
    sim_stream *st = stream_record(s, stream, 1);
    if (!st) return fail(s, GM_EDEVICE, "stream_wait: out of host memory");
    /* Drop what has finished, so that the held list keeps only what still runs. */
    sim_after a = {0};
    const sim_after *w = &st->waits;
    int ok = 1;
    for (uint32_t i = 0; i < w->n_held; i++) ok &= after_add_held(s, &a, w->held[i].stream_idx, w->held[i].epoch);
    after_add_late(s, &a, w->recorded, w->due);
    ok &= after_add_held(s, &a, e->stream_idx, e->epoch);
    for (uint32_t i = 0; i < e->after.n_held; i++)
        ok &= after_add_held(s, &a, e->after.held[i].stream_idx, e->after.held[i].epoch);
    after_add_late(s, &a, e->recorded, e->due);
    after_add_late(s, &a, e->after.recorded, e->after.due);
    if (!ok)
        return fail(s, GM_EDEVICE, "stream_wait: stream %llu would wait for more than %d held streams",
                    (unsigned long long)stream, SIM_WAIT_HELD);
    st->waits = a;
    return GM_OK;
}

/* A held stream is busy.  With an event delay, work on a stream other than the
 * legacy default one runs until a synchronize, unless no operation came since
 * the last one. */
static int sim_stream_query(gm_device *dev, gm_stream stream) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    if (capture_forbids(s, "stream_query")) return GM_EDEVICE;
    uint32_t k = stream_find(s, stream);
    if (k != SIM_NONE && (s->streams[k].held || !after_done(s, &s->streams[k].waits))) return GM_ENOTREADY;
    if (s->event_delay && stream != 0 && s->synced + 1 < s->clock) return GM_ENOTREADY;
    return GM_OK;
}

static int sim_synchronize(gm_device *dev) {
    sim_device *s = (sim_device *)dev;
    if (sim_enter_uncapturable(s, GM_OP_SYNCHRONIZE)) return GM_EDEVICE;
    if (s->held_count) {
        for (uint32_t k = 0; k < s->n_streams; k++)
            if (s->streams[k].held)
                return fail(s, GM_EINVAL, "synchronize: would deadlock: stream %llu is held",
                            (unsigned long long)s->streams[k].stream);
    }
    if (dev->doomed) return GM_OK;
    /* Nothing is held, so every recorded event is complete, late ones too,
     * and every copy. */
    s->synced = s->clock;
    s->copies_running = 0;
    return GM_OK;
}

/* ---- memory accounting --------------------------------------------------- */

static int sim_mem_info(gm_device *dev, size_t *free_bytes, size_t *total_bytes) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    if (!free_bytes || !total_bytes) return fail(s, GM_EINVAL, "mem_info: NULL output pointer");
    if (dev->doomed) return GM_OK;
    uint64_t used = used_bytes(s);
    *total_bytes = s->capacity;
    *free_bytes = used >= s->capacity ? 0 : (size_t)(s->capacity - used);
    return GM_OK;
}

static int sim_processes(gm_device *dev, gm_proc_usage *out, size_t cap, size_t *n) {
    sim_device *s = (sim_device *)dev;
    sim_enter(s);
    if (!n || (cap && !out)) return fail(s, GM_EINVAL, "processes: NULL output pointer");
    if (!s->nvml) return fail(s, GM_ENOTSUP, "processes: NVML is not available");
    if (dev->doomed) return GM_OK;
    *n = 1 + s->n_ext;
    if (cap > 0) {
        out[0].pid = s->self_pid ? s->self_pid : (uint32_t)getpid();
        out[0].bytes = sat_add((uint64_t)(s->pages_created - s->host_created) * dev->page_size, s->self_outside);
    }
    for (size_t i = 0; i < s->n_ext && i + 1 < cap; i++) {
        out[i + 1].pid = s->ext[i].pid;
        out[i + 1].bytes = s->ext[i].bytes;
    }
    return GM_OK;
}

static int sim_capture_status(gm_device *dev, gm_stream stream, int *capturing) {
    sim_device *s = (sim_device *)dev;
    if (!capturing) return fail(s, GM_EINVAL, "capture_status: NULL output pointer");
    uint32_t k = s->capturing_streams ? stream_find(s, stream) : SIM_NONE;
    *capturing = s->capture_all || (k != SIM_NONE && s->streams[k].capturing);
    return GM_OK;
}

static void sim_destroy(gm_device *dev) {
    sim_device *s = as_sim(dev);
    if (!s) return;
    for (size_t i = 0; i < s->n_resv; i++) {
        free(s->resv[i].handle);
        free(s->resv[i].access);
    }
    for (size_t k = 0; k < s->host_blocks; k++) munmap(s->host[k].ptr, s->host[k].size);
    free(s->host);
    free(s->resv);
    for (uint32_t i = 1; i < s->n_pages_slots; i++) free(s->pages[i].contents);
    free(s->pages);
    free(s->events);
    free(s->streams);
    free(s->stream_hash);
    free(s->ext);
    free(s);
}

static int sim_verify_accessible(const gm_device *dev, uintptr_t va, size_t size) {
    return gm_sim_is_accessible(dev, va, size);
}

static void sim_verify_pages(const gm_device *dev, size_t *created, size_t *mapped) {
    gm_sim_info si;
    gm_sim_info_get(dev, &si);
    *created = si.pages_created + si.host_pages;
    *mapped = si.pages_mapped + si.host_mapped;
}

static gm_handle sim_verify_handle_at(const gm_device *dev, uintptr_t va) { return gm_sim_handle_at(dev, va); }

static int sim_verify_host_at(const gm_device *dev, uintptr_t va) {
    const sim_device *s = as_sim_c(dev);
    gm_handle hd = gm_sim_handle_at(dev, va);
    return s && hd && s->pages[hd].host;
}

static const gm_device_verify sim_verify = {
    .accessible = sim_verify_accessible,
    .pages = sim_verify_pages,
    .handle_at = sim_verify_handle_at,
    .host_at = sim_verify_host_at,
};

/* .reserve = sim_reserve, and so on for every counted op (GM_EACH_DEV_OP) */
#define SIM_OP(upper, lower) .lower = sim_##lower,
/* clang-format off */
static const gm_device_ops sim_ops = {
    GM_EACH_DEV_OP(SIM_OP)
    .destroy = sim_destroy,
    .capture_status = sim_capture_status,
    .stream_query = sim_stream_query,
    .verify = &sim_verify,
    .checks_doomed = 1,
};
/* clang-format on */
#undef SIM_OP

/* ---- public -------------------------------------------------------------- */

static void format_capacity(char *buf, size_t len, size_t bytes) {
    static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
    int u = 0;
    size_t v = bytes;
    while (u < 5 && v >= 1024 && v % 1024 == 0) {
        v /= 1024;
        u++;
    }
    snprintf(buf, len, "sim:%zu%s", v, unit[u]);
}

gm_device *gm_sim_create(size_t capacity, size_t page_size) {
    sim_device *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->cap_pages = 64;
    s->cap_events = 64;
    s->pages = malloc(s->cap_pages * sizeof *s->pages);
    s->events = malloc(s->cap_events * sizeof *s->events);
    if (!s->pages || !s->events) {
        free(s->pages);
        free(s->events);
        free(s);
        return NULL;
    }
    s->base.ops = &sim_ops;
    s->base.kind = "sim";
    s->base.ordinal = 0;
    s->base.page_size = page_size ? page_size : GM_SIM_PAGE_SIZE;
    format_capacity(s->base.name, sizeof s->base.name, capacity);
    s->capacity = capacity;
    s->n_pages_slots = 1; /* id 0 is never a handle */
    s->free_head = s->free_tail = SIM_NONE;
    s->n_event_slots = 1;
    s->event_free = SIM_NONE;
    s->next_va = SIM_VA_BASE + (s->base.page_size - SIM_VA_BASE % s->base.page_size) % s->base.page_size;
    s->nvml = 1;
    s->host_capacity = GM_SIM_HOST_CAPACITY;
    gm_device *wrapped = gm_faults_wrap(&s->base, NULL);
    if (!wrapped) sim_destroy(&s->base);
    return wrapped;
}

int gm_sim_is(const gm_device *dev) { return as_sim_c(dev) != NULL; }

void gm_sim_fail(gm_device *dev, gm_dev_op op, uint64_t nth, uint64_t count) { gm_faults_fail(dev, op, nth, count); }

void gm_sim_fail_random(gm_device *dev, gm_dev_op op, double p, uint64_t seed) {
    gm_faults_fail_random(dev, op, p, seed);
}

uint64_t gm_sim_calls(const gm_device *dev, gm_dev_op op) { return gm_faults_calls(dev, op, NULL); }

void gm_sim_hold_stream(gm_device *dev, gm_stream stream, int held) {
    sim_device *s = as_sim(dev);
    /* A stream never held has nothing pending; out of host memory, it simply stays unheld. */
    sim_stream *st = s ? stream_record(s, stream, held) : NULL;
    if (st && switch_flag(&st->held, held, &s->held_count) && !held)
        st->epoch++; /* completes every event recorded during the hold */
}

int gm_sim_stream_busy(const gm_device *dev, gm_stream stream) {
    const sim_device *s = as_sim_c(dev);
    uint32_t k = s ? stream_find(s, stream) : SIM_NONE;
    return k != SIM_NONE && (s->streams[k].held || !after_done(s, &s->streams[k].waits));
}

int gm_sim_stream_waits_for(const gm_device *dev, gm_stream stream, gm_stream held) {
    const sim_device *s = as_sim_c(dev);
    uint32_t k = s ? stream_find(s, stream) : SIM_NONE, j = s ? stream_find(s, held) : SIM_NONE;
    if (k == SIM_NONE || j == SIM_NONE || !s->streams[j].held) return 0;
    const sim_after *a = &s->streams[k].waits;
    for (uint32_t i = 0; i < a->n_held; i++)
        if (a->held[i].stream_idx == j && a->held[i].epoch == s->streams[j].epoch) return 1;
    return 0;
}

void gm_sim_set_event_delay(gm_device *dev, uint64_t ops) {
    sim_device *s = as_sim(dev);
    if (s) s->event_delay = ops;
}

void gm_sim_set_external(gm_device *dev, uint32_t pid, uint64_t bytes) {
    sim_device *s = as_sim(dev);
    if (!s) return;
    size_t i = 0;
    while (i < s->n_ext && s->ext[i].pid != pid) i++;
    if (i < s->n_ext) {
        s->ext_total -= s->ext[i].bytes;
        if (bytes == 0) {
            memmove(&s->ext[i], &s->ext[i + 1], (s->n_ext - i - 1) * sizeof *s->ext);
            s->n_ext--;
            return;
        }
    } else {
        if (bytes == 0) return;
        if (s->n_ext == s->cap_ext) {
            sim_ext *ne = gm_array_grow(s->ext, &s->cap_ext, 4, sizeof *ne);
            if (!ne) return;
            s->ext = ne;
        }
        s->ext[s->n_ext].pid = pid;
        s->n_ext++;
    }
    s->ext[i].bytes = bytes;
    s->ext_total = sat_add(s->ext_total, bytes);
}

void gm_sim_set_self(gm_device *dev, uint32_t self_pid, uint64_t outside_bytes) {
    sim_device *s = as_sim(dev);
    if (!s) return;
    s->self_pid = self_pid; /* 0: report getpid() */
    s->self_outside = outside_bytes;
}

void gm_sim_set_host_capacity(gm_device *dev, size_t bytes) {
    sim_device *s = as_sim(dev);
    if (s) s->host_capacity = bytes;
}

void gm_sim_set_nvml(gm_device *dev, int available) {
    sim_device *s = as_sim(dev);
    if (s) s->nvml = available != 0;
}

void gm_sim_info_get(const gm_device *dev, gm_sim_info *info) {
    const sim_device *s = as_sim_c(dev);
    if (!info) return;
    memset(info, 0, sizeof *info);
    if (!s) return;
    info->capacity = s->capacity;
    info->page_size = s->base.page_size;
    info->pages_created = s->pages_created - s->host_created;
    info->pages_mapped = s->pages_mapped - s->host_mapped;
    info->host_pages = s->host_created;
    info->host_mapped = s->host_mapped;
    info->events_alive = s->events_alive;
    info->reservations = s->n_resv;
}

int gm_sim_is_accessible(const gm_device *dev, uintptr_t va, size_t size) {
    const sim_device *s = as_sim_c(dev);
    if (!s) return 0;
    if (size == 0) return 1;
    if (size - 1 > UINTPTR_MAX - va) return 0;
    size_t ps = s->base.page_size;
    const sim_resv *r = NULL;
    for (size_t i = 0; i < s->n_resv && !r; i++)
        if (va >= s->resv[i].va && va - s->resv[i].va < s->resv[i].size) r = &s->resv[i];
    if (!r) return 0;
    uintptr_t last = va + (size - 1);
    if (last - r->va >= r->size) return 0;
    for (size_t p = (va - r->va) / ps; p <= (last - r->va) / ps; p++)
        if (!r->handle[p] || !r->access[p]) return 0;
    return 1;
}

void gm_sim_set_capture(gm_device *dev, int on) {
    sim_device *s = as_sim(dev);
    if (s) s->capture_all = on != 0;
}

void gm_sim_set_stream_capture(gm_device *dev, gm_stream stream, int on) {
    sim_device *s = as_sim(dev);
    /* Out of host memory, the stream simply is not marked. */
    sim_stream *st = s ? stream_record(s, stream, on) : NULL;
    if (st) switch_flag(&st->capturing, on, &s->capturing_streams);
}

uint64_t gm_sim_capture_violations(const gm_device *dev) {
    const sim_device *s = as_sim_c(dev);
    return s ? s->capture_violations : 0;
}

gm_handle gm_sim_handle_at(const gm_device *dev, uintptr_t va) {
    const sim_device *s = as_sim_c(dev);
    if (!s) return 0;
    for (size_t i = 0; i < s->n_resv; i++) {
        const sim_resv *r = &s->resv[i];
        if (va >= r->va && va - r->va < r->size) return r->handle[(va - r->va) / s->base.page_size];
    }
    return 0;
}

/* The content of the page mapped (and accessible) at va: NULL if none. */
static uint64_t *page_at(sim_device *s, uintptr_t va) {
    sim_resv *r = find_resv(s, va);
    if (!r) return NULL;
    size_t k = (va - r->va) / s->base.page_size;
    return r->handle[k] && r->access[k] ? page_content(s, r, k) : NULL;
}

int gm_sim_write(gm_device *dev, uintptr_t va, uint64_t value) {
    sim_device *s = as_sim(dev);
    uint64_t *p = s ? page_at(s, va) : NULL;
    if (!p) return GM_EINVAL;
    *p = value;
    return GM_OK;
}

int gm_sim_read(gm_device *dev, uintptr_t va, uint64_t *value) {
    sim_device *s = as_sim(dev);
    uint64_t *p = s ? page_at(s, va) : NULL;
    if (!p) return GM_EINVAL;
    *value = *p;
    return GM_OK;
}

size_t gm_sim_host_blocks(const gm_device *dev) {
    const sim_device *s = as_sim_c(dev);
    return s ? s->host_blocks : 0;
}
