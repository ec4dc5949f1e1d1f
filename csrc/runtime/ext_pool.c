/*
 * ext_pool.c -- private pools over another allocator (ext_pool.h says what and why).
 *
 *   device ── pools ── pool (id, alloc, free, use_on_oom, alive)
 *                        └── segments ── segment (base, size, stream)
 *                                          └── blocks, in address order: used or free
 *
 * A request takes the smallest free block of the pool on its stream that fits
 * (the lowest address among equals), small requests from small segments and
 * large ones from large segments, split as torch splits: a small request's
 * (up to 1 MiB) remainder of 512 bytes or more, a large one's of more than
 * 1 MiB.  When none fits, a new segment is asked of the pool's allocator,
 * sized as torch sizes segments: 2 MiB for up to 1 MiB, 20 MiB below 10 MiB,
 * else the request rounded up to 2 MiB.  A freed block merges with its free
 * neighbours.  When the pool ends with nothing live in it, its segments go
 * back to its allocator at once, as torch's MemPool empties its cache when it
 * goes; when tensors outlive it, its segments stay until the next empty_cache
 * (or out-of-memory retry) after they are freed.
 */
#include "ext_pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "heap_registry.h"

/* ---- tunables: torch's segment and block sizes ---------------------------- */

#define EXT_ROUND     512u               /* block sizes are multiples of this */
#define EXT_SMALL     ((size_t)1 << 20)  /* a small request, up to 1 MiB */
#define EXT_SMALL_SEG ((size_t)2 << 20)  /* a small request's segment */
#define EXT_LARGE_SEG ((size_t)20 << 20) /* a request below EXT_MIN_LARGE's segment */
#define EXT_MIN_LARGE ((size_t)10 << 20) /* from here a segment is the request, rounded */
#define EXT_SEG_ROUND ((size_t)2 << 20)

typedef struct ext_block {
    uintptr_t addr;
    size_t size;
    int used;
    struct ext_block *prev, *next;
} ext_block;

typedef struct ext_seg {
    uintptr_t base;
    size_t size;
    void *stream;
    int small;     /* serves small requests only, as torch's small pool; else large ones only */
    size_t n_used; /* used blocks */
    ext_block *head;
    struct ext_seg *next;
} ext_seg;

typedef struct ext_pool {
    gm_pool_id id;
    gm_ext_alloc_fn alloc;
    gm_ext_free_fn release;
    int use_on_oom, alive;
    ext_seg *segs;
    struct ext_pool *next;
} ext_pool;

typedef struct {
    pthread_mutex_t mu;
    ext_pool *pools;
    atomic_int n_pools; /* lets the common path skip the lock */
} ext_device;

static ext_device devices[GM_HEAP_REGISTRY_MAX_DEVICES];

static void lock_all(void) {
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES; d++) pthread_mutex_lock(&devices[d].mu);
}

static void unlock_all(void) {
    for (int d = GM_HEAP_REGISTRY_MAX_DEVICES; d-- > 0;) pthread_mutex_unlock(&devices[d].mu);
}

__attribute__((constructor)) static void ext_init(void) {
    for (int d = 0; d < GM_HEAP_REGISTRY_MAX_DEVICES; d++) pthread_mutex_init(&devices[d].mu, NULL);
    gm_fork_also(lock_all, unlock_all);
}

/* ---- small accessors ----------------------------------------------------------- */

static int same_id(gm_pool_id a, gm_pool_id b) { return a.first == b.first && a.second == b.second; }
static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
static int is_small(size_t size) { return size <= EXT_SMALL; }

static size_t segment_size(size_t size) {
    if (is_small(size)) return EXT_SMALL_SEG;
    return size < EXT_MIN_LARGE ? EXT_LARGE_SEG : round_up(size, EXT_SEG_ROUND);
}

static ext_device *device_of(int device) { return gm_heap_registry_valid(device) ? &devices[device] : NULL; }

/* Nothing goes back to an allocator (cudaFree and the like synchronise) while
 * the device's heap may be capturing a CUDA graph. */
static int may_release(int device) {
    gm_heap *h = gm_heap_registry_get(device);
    return !h || !gm_capturing(h);
}

static ext_pool *find_pool(ext_device *d, gm_pool_id id) {
    for (ext_pool *p = d->pools; p; p = p->next)
        if (same_id(p->id, id)) return p;
    return NULL;
}

/* ---- blocks ------------------------------------------------------------------- */

/* The pool's best free block for `size` bytes on `stream`, or NULL. */
static ext_block *best_fit(const ext_pool *p, size_t size, void *stream, ext_seg **seg) {
    ext_block *best = NULL;
    for (ext_seg *s = p->segs; s; s = s->next) {
        if (s->stream != stream || s->small != is_small(size)) continue;
        for (ext_block *b = s->head; b; b = b->next) {
            if (b->used || b->size < size) continue;
            if (!best || b->size < best->size || (b->size == best->size && b->addr < best->addr)) {
                best = b;
                *seg = s;
            }
        }
    }
    return best;
}

/* Marks b used for `size` bytes, splitting off the rest as torch would. */
static void take(ext_seg *s, ext_block *b, size_t size) {
    size_t rest = b->size - size;
    int split = is_small(size) ? rest >= EXT_ROUND : rest > EXT_SMALL;
    ext_block *r = split ? calloc(1, sizeof *r) : NULL;
    if (r) {
        r->addr = b->addr + size;
        r->size = rest;
        r->prev = b;
        r->next = b->next;
        if (b->next) b->next->prev = r;
        b->next = r;
        b->size = size;
    }
    b->used = 1;
    s->n_used++;
}

/* b takes in the block after it. */
static void absorb_next(ext_block *b) {
    ext_block *n = b->next;
    b->size += n->size;
    b->next = n->next;
    if (n->next) n->next->prev = b;
    free(n);
}

/* Merges the freed block b with its free neighbours. */
static void merge(ext_block *b) {
    if (b->next && !b->next->used) absorb_next(b);
    if (b->prev && !b->prev->used) absorb_next(b->prev);
}

static void free_blocks(ext_seg *s) {
    for (ext_block *b = s->head, *n; b; b = n) {
        n = b->next;
        free(b);
    }
}

/* ---- segments ------------------------------------------------------------------ */

/* Once the pool has ended: unlinks its wholly free segments into *gone. */
static void unlink_if_ended(ext_pool *p, ext_seg **gone) {
    for (ext_seg **at = &p->segs; *at;) {
        ext_seg *s = *at;
        if (s->n_used == 0 && !p->alive) {
            *at = s->next;
            s->next = *gone;
            *gone = s;
        } else {
            at = &s->next;
        }
    }
}

/* Gives unlinked segments back to their allocator, with no lock held. */
static void give_back(int device, gm_ext_free_fn release, ext_seg *gone) {
    for (ext_seg *s = gone, *n; s; s = n) {
        n = s->next;
        release((void *)s->base, s->size, device, s->stream);
        gm_heap_registry_give_outside(device, s->size);
        free_blocks(s);
        free(s);
    }
}

/* Removes an ended pool with no segments left.  Under d->mu. */
static void drop_if_done(ext_device *d, ext_pool *p) {
    if (p->alive || p->segs) return;
    for (ext_pool **at = &d->pools; *at; at = &(*at)->next)
        if (*at == p) {
            *at = p->next;
            free(p);
            atomic_fetch_sub(&d->n_pools, 1);
            return;
        }
}

/* A new segment of `bytes` from the pool's allocator, counted against the cap. */
static ext_seg *new_segment(int device, gm_ext_alloc_fn alloc, size_t bytes, void *stream) {
    ext_seg *s = calloc(1, sizeof *s);
    ext_block *b = calloc(1, sizeof *b);
    if (!s || !b || gm_heap_registry_take_outside(device, bytes) != GM_OK) {
        free(s);
        free(b);
        return NULL;
    }
    void *base = alloc(bytes, device, stream);
    if (!base) {
        gm_heap_registry_give_outside(device, bytes);
        free(s);
        free(b);
        return NULL;
    }
    s->base = b->addr = (uintptr_t)base;
    s->size = b->size = bytes;
    s->stream = stream;
    s->small = bytes == EXT_SMALL_SEG;
    s->head = b;
    return s;
}

/* ---- the interface ------------------------------------------------------------- */

int gm_ext_attach(int device, gm_pool_id id, gm_ext_alloc_fn alloc, gm_ext_free_fn release, int use_on_oom) {
    ext_device *d = device_of(device);
    if (!d || !alloc || !release) return GM_EINVAL;
    ext_pool *p = calloc(1, sizeof *p);
    if (!p) return GM_ENOMEM;
    *p = (ext_pool){.id = id, .alloc = alloc, .release = release, .use_on_oom = use_on_oom != 0, .alive = 1};
    pthread_mutex_lock(&d->mu);
    ext_pool *old = find_pool(d, id);
    if (!old) {
        p->next = d->pools;
        d->pools = p;
        atomic_fetch_add(&d->n_pools, 1);
    }
    pthread_mutex_unlock(&d->mu);
    if (old) free(p);
    return old ? GM_EINVAL : GM_OK;
}

/* Whether any block of the pool is in use.  Under d->mu. */
static int has_live(const ext_pool *p) {
    for (const ext_seg *s = p->segs; s; s = s->next)
        if (s->n_used) return 1;
    return 0;
}

int gm_ext_detach(int device, gm_pool_id id) {
    ext_device *d = device_of(device);
    if (!d) return GM_EINVAL;
    ext_seg *gone = NULL;
    gm_ext_free_fn release = NULL;
    pthread_mutex_lock(&d->mu);
    ext_pool *p = find_pool(d, id);
    int was = p && p->alive;
    if (was) {
        p->alive = 0;
        release = p->release;
        if (!has_live(p) && may_release(device)) unlink_if_ended(p, &gone); /* as torch's MemPool empties its cache */
        drop_if_done(d, p);
    }
    pthread_mutex_unlock(&d->mu);
    if (gone) give_back(device, release, gone);
    return was ? GM_OK : GM_EINVAL;
}

void gm_ext_release_ended(int device) {
    ext_device *d = device_of(device);
    if (!d || atomic_load(&d->n_pools) == 0 || !may_release(device)) return;
    for (;;) { /* one pool at a time: each gives back with no lock held */
        ext_seg *gone = NULL;
        gm_ext_free_fn release = NULL;
        pthread_mutex_lock(&d->mu);
        for (ext_pool *p = d->pools, *n; p && !gone; p = n) {
            n = p->next;
            release = p->release;
            unlink_if_ended(p, &gone);
            drop_if_done(d, p);
        }
        pthread_mutex_unlock(&d->mu);
        if (!gone) return;
        give_back(device, release, gone);
    }
}

int gm_ext_owns(int device, gm_pool_id id) {
    ext_device *d = device_of(device);
    if (!d || atomic_load(&d->n_pools) == 0) return 0;
    pthread_mutex_lock(&d->mu);
    ext_pool *p = find_pool(d, id);
    int owns = p && p->alive;
    pthread_mutex_unlock(&d->mu);
    return owns;
}

int gm_ext_alloc(int device, gm_pool_id id, size_t size, void *stream, uintptr_t *out) {
    ext_device *d = device_of(device);
    if (!d) return GM_EINVAL;
    size_t want = round_up(size ? size : 1, EXT_ROUND);
    pthread_mutex_lock(&d->mu);
    ext_pool *p = find_pool(d, id);
    ext_seg *s = NULL;
    ext_block *b = p && p->alive ? best_fit(p, want, stream, &s) : NULL;
    gm_ext_alloc_fn alloc = p && p->alive ? p->alloc : NULL;
    gm_ext_free_fn release = p ? p->release : NULL;
    if (b) {
        take(s, b, want);
        *out = b->addr;
    }
    pthread_mutex_unlock(&d->mu);
    if (b || !alloc) return b ? GM_OK : GM_EINVAL;
    if (!(s = new_segment(device, alloc, segment_size(want), stream))) return GM_ENOMEM;
    pthread_mutex_lock(&d->mu);
    int kept = (p = find_pool(d, id)) && p->alive; /* the pool may have ended meanwhile */
    if (kept) {
        s->next = p->segs;
        p->segs = s;
        take(s, s->head, want);
        *out = s->base;
    }
    pthread_mutex_unlock(&d->mu);
    if (!kept) give_back(device, release, s);
    return kept ? GM_OK : GM_EINVAL;
}

int gm_ext_alloc_on_oom(int device, size_t size, void *stream, uintptr_t *out) {
    ext_device *d = device_of(device);
    if (!d || atomic_load(&d->n_pools) == 0) return GM_ENOMEM;
    size_t want = round_up(size ? size : 1, EXT_ROUND);
    int rc = GM_ENOMEM;
    pthread_mutex_lock(&d->mu);
    for (ext_pool *p = d->pools; p && rc != GM_OK; p = p->next) {
        ext_seg *s = NULL;
        ext_block *b = p->alive && p->use_on_oom ? best_fit(p, want, stream, &s) : NULL;
        if (b) {
            take(s, b, want);
            *out = b->addr;
            rc = GM_OK;
        }
    }
    pthread_mutex_unlock(&d->mu);
    return rc;
}

/* The block at ptr, its segment and pool, or NULL.  Under d->mu. */
static ext_block *find_block(ext_device *d, uintptr_t ptr, ext_seg **seg, ext_pool **pool) {
    for (ext_pool *p = d->pools; p; p = p->next)
        for (ext_seg *s = p->segs; s; s = s->next) {
            if (ptr < s->base || ptr >= s->base + s->size) continue;
            for (ext_block *b = s->head; b; b = b->next)
                if (b->addr == ptr && b->used) {
                    *seg = s;
                    *pool = p;
                    return b;
                }
            return NULL;
        }
    return NULL;
}

int gm_ext_free(int device, uintptr_t ptr) {
    ext_device *d = device_of(device);
    if (!d || atomic_load(&d->n_pools) == 0) return GM_EUNKNOWN_PTR;
    ext_seg *s = NULL;
    ext_pool *p = NULL;
    pthread_mutex_lock(&d->mu);
    ext_block *b = find_block(d, ptr, &s, &p);
    if (b) {
        b->used = 0;
        s->n_used--;
        merge(b);
    }
    pthread_mutex_unlock(&d->mu);
    return b ? GM_OK : GM_EUNKNOWN_PTR;
}

int gm_ext_is_live(int device, uintptr_t ptr) {
    ext_device *d = device_of(device);
    if (!d || atomic_load(&d->n_pools) == 0) return 0;
    ext_seg *s;
    ext_pool *p;
    pthread_mutex_lock(&d->mu);
    int live = find_block(d, ptr, &s, &p) != NULL;
    pthread_mutex_unlock(&d->mu);
    return live;
}

size_t gm_ext_segments(int device, gm_pool_id id, gm_ext_block_info *blocks, size_t cap_blocks, size_t *seg_blocks,
                       size_t cap_segs) {
    ext_device *d = device_of(device);
    if (!d) return 0;
    size_t n_segs = 0, n = 0;
    pthread_mutex_lock(&d->mu);
    ext_pool *p = find_pool(d, id);
    for (ext_seg *s = p ? p->segs : NULL; s; s = s->next, n_segs++) {
        size_t k = 0;
        for (ext_block *b = s->head; b; b = b->next, k++)
            if (n < cap_blocks) blocks[n++] = (gm_ext_block_info){b->addr, b->size, b->used};
        if (n_segs < cap_segs) seg_blocks[n_segs] = k;
    }
    pthread_mutex_unlock(&d->mu);
    return n_segs;
}
