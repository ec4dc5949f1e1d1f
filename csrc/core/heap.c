/*
 * heap.c -- gpumem's allocator: one address space per device, physical pages
 * mapped behind it on demand, and moved to defragment.
 *
 * THE PICTURE
 *
 *   One virtual range is reserved per device, four times the device's memory
 *   (address space costs nothing).  Physical memory comes in pages of 2 MiB,
 *   each a separate device allocation, so any page can be unmapped in one place
 *   and mapped behind another address.
 *
 *   base                                                          base + va_size
 *   |  page 0  |  page 1  |  page 2  |  page 3  |  page 4  |  page 5  |   ...   |
 *   |   P7     |   P2     |   P5     |    -     |    -     |   P1     |    -    |   physical page behind it
 *   [A   ][B        ][free     ][unmapped           ][C  ][free ][unmapped ...]   blocks
 *
 *   Blocks tile the whole range in address order, each 512-byte aligned:
 *     live      handed out; every page it touches is mapped;
 *     pending   freed, but a stream named by record_stream may still use it;
 *     free      reusable, every page it touches is mapped;
 *     unmapped  address space with nothing behind it, always whole pages.
 *   Neighbouring free blocks merge (when their owners allow, see STREAMS), and
 *   so do neighbouring unmapped ones.  Blocks are byte-granular, so small
 *   requests pack into pages that other blocks share: physical memory in use is
 *   the number of pages that live blocks touch, which is why placement matters.
 *
 * THE PATHS
 *
 *   Fast path (no device call): best fit among free blocks that this stream
 *   may use, from a segregated index (freeindex.h), with the lowest address
 *   among equals; split off the remainder.  Free: look the pointer up in the
 *   live table, merge with free neighbours, index.
 *
 *   Slow path, when no free block fits:
 *   1. Take back memory other streams freed, once an event says their work is
 *      done, and retry.
 *   2. Place the request where it needs the fewest new pages: over every run of
 *      free and unmapped blocks long enough, at its start or its end.  Ties go
 *      to the shortest run (best fit), then the lowest address.
 *   3. Get the pages: spare ones first; then new ones from the device, but only
 *      while the heap stays under its growth limit -- (1 + slack) x the peak of
 *      live memory -- so that it does not hoard.
 *   4. Defragment: past the growth limit, or when the device is full, wait for
 *      the device, unmap wholly free pages wherever they lie, and map them
 *      behind the chosen range.  No bytes are copied and no live block moves;
 *      only free pages change address.  Then, if still short, grow to the cap.
 *   5. Out of memory only when the pages that live blocks touch plus the pages
 *      this request needs exceed the cap.  The failure leaves a report.
 *   Each remap costs tens of microseconds, so steps 3-4 run only when the free
 *   index has nothing, and the growth limit keeps that rare in a steady loop.
 *
 * STREAMS
 *
 *   A free block has an owner: the stream that freed it, which may reuse it at
 *   once (its work is ordered after the free), or GM_STREAM_ANY.  Another stream
 *   gets an owner's blocks only after an event recorded on the owner completes;
 *   one event covers every block the owner freed before it (step 1), which keeps
 *   events off the fast path.  A free block merges with a neighbour of the same
 *   owner or of ANY, and the result keeps the stricter owner.  Blocks marked
 *   with record_stream get an event per extra stream when freed and stay pending
 *   until all complete.  Unmapping waits for the whole device, after which all
 *   free memory belongs to ANY.
 *
 * LOCKING: one mutex per heap; device calls happen under it (slow path only).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "heap_internal.h"

#define ANY GM_STREAM_ANY

static size_t held_pages(const gm_heap *h) { return h->mapped_pages + h->n_spare; }
static inline size_t align_up(size_t x, size_t a) { return (x + a - 1) & ~(a - 1); }

/* ---- block records ------------------------------------------------------- */

static int slab_grow(gm_heap *h) {
    enum { CHUNK = 512 };
    if (h->n_slab_chunks == h->cap_slab_chunks) {
        size_t cap = h->cap_slab_chunks ? 2 * h->cap_slab_chunks : 16;
        void **c = realloc(h->slab_chunks, cap * sizeof *c);
        if (!c) return GM_ENOMEM;
        h->slab_chunks = c;
        h->cap_slab_chunks = cap;
    }
    gm_block *chunk = calloc(CHUNK, sizeof *chunk);
    if (!chunk) return GM_ENOMEM;
    h->slab_chunks[h->n_slab_chunks++] = chunk;
    for (size_t i = 0; i < CHUNK; i++) {
        chunk[i].lnext = h->slab_free;
        h->slab_free = &chunk[i];
    }
    h->n_slab_free += CHUNK;
    return GM_OK;
}

/* Splits below never fail: callers make sure a few records are at hand first. */
static int slab_reserve(gm_heap *h, size_t n) {
    while (h->n_slab_free < n)
        if (slab_grow(h)) return GM_ENOMEM;
    return GM_OK;
}

static gm_block *block_new(gm_heap *h) {
    gm_block *b = h->slab_free;
    h->slab_free = b->lnext;
    h->n_slab_free--;
    memset(b, 0, sizeof *b);
    return b;
}

static void block_del(gm_heap *h, gm_block *b) {
    free(b->uses);
    free(b->events);
    b->uses = NULL;
    b->events = NULL;
    b->lnext = h->slab_free;
    h->slab_free = b;
    h->n_slab_free++;
}

/* ---- live table ---------------------------------------------------------- */

static inline size_t live_slot(const gm_heap *h, uintptr_t addr) {
    return (size_t)((((uint64_t)addr >> 9) * 0x9E3779B97F4A7C15ull) >> 32) & h->live_mask;
}

static int live_grow(gm_heap *h) {
    size_t n = (h->live_mask + 1) * 2;
    gm_block **t = calloc(n, sizeof *t);
    if (!t) return GM_ENOMEM;
    size_t old_n = h->live_mask + 1;
    gm_block **old = h->live;
    h->live = t;
    h->live_mask = n - 1;
    for (size_t i = 0; i < old_n; i++) {
        for (gm_block *b = old[i], *next; b; b = next) {
            next = b->hnext;
            size_t s = live_slot(h, b->addr);
            b->hnext = t[s];
            t[s] = b;
        }
    }
    free(old);
    return GM_OK;
}

static void live_insert(gm_heap *h, gm_block *b) {
    size_t s = live_slot(h, b->addr);
    b->hnext = h->live[s];
    h->live[s] = b;
    h->n_live++;
}

gm_block *gm_live_find(const gm_heap *h, uintptr_t addr) {
    for (gm_block *b = h->live[live_slot(h, addr)]; b; b = b->hnext)
        if (b->addr == addr) return b;
    return NULL;
}

static gm_block *live_remove(gm_heap *h, uintptr_t addr) {
    gm_block **p = &h->live[live_slot(h, addr)];
    for (; *p; p = &(*p)->hnext) {
        if ((*p)->addr == addr) {
            gm_block *b = *p;
            *p = b->hnext;
            b->hnext = NULL;
            h->n_live--;
            return b;
        }
    }
    return NULL;
}

/* ---- owners and the free index ------------------------------------------- */

gm_owner *gm_owner_find(gm_heap *h, gm_stream s) {
    if (h->last_owner && h->last_owner->stream == s) return h->last_owner;
    for (size_t i = 0; i < h->n_owners; i++) {
        if (h->owners[i]->stream == s) {
            h->last_owner = h->owners[i];
            return h->owners[i];
        }
    }
    return NULL;
}

static gm_owner *owner_get(gm_heap *h, gm_stream s) {
    gm_owner *o = gm_owner_find(h, s);
    if (o) return o;
    if (h->n_owners == h->cap_owners) {
        size_t cap = h->cap_owners ? 2 * h->cap_owners : 4;
        gm_owner **a = realloc(h->owners, cap * sizeof *a);
        if (!a) return NULL;
        h->owners = a;
        h->cap_owners = cap;
    }
    if (!(o = calloc(1, sizeof *o))) return NULL;
    o->stream = s;
    fi_init(&o->idx);
    h->owners[h->n_owners++] = o;
    return o;
}

static void index_insert(gm_heap *h, gm_block *b) {
    /* owner_get only fails on host OOM; every owner a free block names was
     * created when its stream first allocated, so this finds it. */
    fi_insert(&gm_owner_find(h, b->stream)->idx, b);
    int pool = gm_pool_of(b->size);
    gm_stat_up(h->st.inactive_split, pool, 1);
    gm_stat_up(h->st.inactive_split_bytes, pool, (int64_t)b->size);
}

static void index_remove(gm_heap *h, gm_block *b) {
    fi_remove(&gm_owner_find(h, b->stream)->idx, b);
    int pool = gm_pool_of(b->size);
    gm_stat_down(h->st.inactive_split, pool, 1);
    gm_stat_down(h->st.inactive_split_bytes, pool, (int64_t)b->size);
}

/* The stricter of two owners, or 0 if the blocks may not merge. */
static int owners_merge(gm_stream a, gm_stream b, gm_stream *out) {
    if (a == b || b == ANY) *out = a;
    else if (a == ANY) *out = b;
    else return 0;
    return 1;
}

/* ---- splitting and merging ----------------------------------------------- */

/* Cut b at `offset`; the upper part is returned with b's state and owner.
 * b must not be in any list. */
static gm_block *split(gm_heap *h, gm_block *b, size_t offset) {
    gm_block *r = block_new(h);
    r->addr = b->addr + offset;
    r->size = b->size - offset;
    r->state = b->state;
    r->stream = b->stream;
    r->seq = b->seq;
    r->origin = b->origin;
    r->prev = b;
    r->next = b->next;
    if (b->next) b->next->prev = r;
    b->next = r;
    b->size = offset;
    return r;
}

/* a absorbs its upper neighbour b; neither is in any list. */
static void absorb(gm_heap *h, gm_block *a, gm_block *b) {
    a->size += b->size;
    a->next = b->next;
    if (b->next) b->next->prev = a;
    if (b->seq > a->seq) {
        a->seq = b->seq;
        a->origin = b->origin;
    }
    block_del(h, b);
}

/* b (in no list) becomes free for `owner`, merges with its neighbours, and is indexed. */
static gm_block *make_free(gm_heap *h, gm_block *b, gm_stream owner, uint64_t seq) {
    gm_stream o;
    b->state = GM_BLOCK_FREE;
    b->stream = owner;
    b->seq = seq;
    b->origin = owner;
    b->requested = 0;
    b->context = 0;
    gm_block *p = b->prev;
    if (p && p->state == GM_BLOCK_FREE && owners_merge(p->stream, b->stream, &o)) {
        index_remove(h, p);
        absorb(h, p, b);
        p->stream = o;
        b = p;
    }
    gm_block *n = b->next;
    if (n && n->state == GM_BLOCK_FREE && owners_merge(b->stream, n->stream, &o)) {
        index_remove(h, n);
        absorb(h, b, n);
        b->stream = o;
    }
    index_insert(h, b);
    return b;
}

/* b (in no list) becomes unmapped address space and merges with unmapped neighbours. */
static void make_unmapped(gm_heap *h, gm_block *b) {
    b->state = GM_BLOCK_UNMAPPED;
    b->stream = ANY;
    b->seq = 0;
    b->origin = ANY;
    if (b->prev && b->prev->state == GM_BLOCK_UNMAPPED) {
        gm_block *p = b->prev;
        absorb(h, p, b);
        b = p;
    }
    if (b->next && b->next->state == GM_BLOCK_UNMAPPED) absorb(h, b, b->next);
}

/* Merge every pair of neighbours that may merge (after owners changed). */
static void coalesce_all(gm_heap *h) {
    gm_block *b = h->head;
    while (b && b->next) {
        gm_block *n = b->next;
        gm_stream o;
        if (b->state == GM_BLOCK_FREE && n->state == GM_BLOCK_FREE && owners_merge(b->stream, n->stream, &o)) {
            index_remove(h, b);
            index_remove(h, n);
            absorb(h, b, n);
            b->stream = o;
            index_insert(h, b);
        } else if (b->state == GM_BLOCK_UNMAPPED && n->state == GM_BLOCK_UNMAPPED) {
            absorb(h, b, n);
        } else {
            b = n;
        }
    }
}

/* ---- events ---------------------------------------------------------------- */

static int event_get(gm_heap *h, gm_event *ev) {
    *ev = 0;
    if (h->n_event_pool) {
        *ev = h->event_pool[--h->n_event_pool];
        return GM_OK;
    }
    int rc = h->dev->ops->event_create(h->dev, ev);
    if (rc) h->st.num_device_errors++;
    return rc;
}

static void event_put(gm_heap *h, gm_event ev) {
    if (h->n_event_pool == h->cap_event_pool) {
        size_t cap = h->cap_event_pool ? 2 * h->cap_event_pool : 16;
        gm_event *p = realloc(h->event_pool, cap * sizeof *p);
        if (!p) {
            h->dev->ops->event_destroy(h->dev, ev);
            return;
        }
        h->event_pool = p;
        h->cap_event_pool = cap;
    }
    h->event_pool[h->n_event_pool++] = ev;
}

/* Record an event on `s`; 0 if that failed (the caller then falls back to
 * waiting for the whole device). */
static int event_record(gm_heap *h, gm_stream s, gm_event *ev) {
    if (event_get(h, ev)) return 0;
    if (h->dev->ops->event_record(h->dev, *ev, s)) {
        h->st.num_device_errors++;
        event_put(h, *ev);
        *ev = 0; /* the pool owns it again */
        return 0;
    }
    return 1;
}

/* 1 when done.  A failing query counts as not done: the block waits for the
 * next device synchronisation instead. */
static int event_done(gm_heap *h, gm_event ev) {
    int rc = h->dev->ops->event_query(h->dev, ev);
    if (rc == GM_OK) return 1;
    if (rc != GM_ENOTREADY) h->st.num_device_errors++;
    return 0;
}

/* ---- pending blocks ----------------------------------------------------------- */

static void pending_unlink(gm_heap *h, gm_block *b) {
    if (b->lprev) b->lprev->lnext = b->lnext;
    else h->pending_head = b->lnext;
    if (b->lnext) b->lnext->lprev = b->lprev;
    else h->pending_tail = b->lprev;
    b->lprev = b->lnext = NULL;
    h->n_pending--;
}

static void pending_append(gm_heap *h, gm_block *b) {
    b->lnext = NULL;
    b->lprev = h->pending_tail;
    if (h->pending_tail) h->pending_tail->lnext = b;
    else h->pending_head = b;
    h->pending_tail = b;
    h->n_pending++;
}

/* A pending or live block leaves "active" and becomes free for its stream. */
static void complete_free(gm_heap *h, gm_block *b) {
    int pool = gm_pool_of(b->size);
    gm_stat_down(h->st.active, pool, 1);
    gm_stat_down(h->st.active_bytes, pool, (int64_t)b->size);
    gm_hist(h, GM_H_FREE_COMPLETED, b->addr, b->size, b->stream, b->context);
    b->n_uses = 0;
    b->wait_sync = 0;
    make_free(h, b, b->stream, ++h->free_seq);
}

/* Free pending blocks whose events have completed (all of them if `synced`,
 * i.e. right after the whole device was waited for).  Returns how many. */
static size_t process_pending(gm_heap *h, int synced) {
    size_t done = 0;
    for (gm_block *b = h->pending_head, *next; b; b = next) {
        next = b->lnext;
        int all = 1;
        for (uint32_t i = 0; i < b->n_uses; i++) {
            if (!b->events[i]) continue;
            if (synced || event_done(h, b->events[i])) {
                event_put(h, b->events[i]);
                b->events[i] = 0;
            } else {
                all = 0;
            }
        }
        if (all && (synced || !b->wait_sync)) {
            pending_unlink(h, b);
            complete_free(h, b);
            done++;
        }
    }
    return done;
}

/* ---- handing owners' memory to every stream ------------------------------------ */

struct release_ctx {
    gm_heap *h;
    uint64_t threshold;
    size_t n;
};

static int release_one(gm_block *b, void *arg) {
    struct release_ctx *c = arg;
    if (b->seq > c->threshold) return 0;
    index_remove(c->h, b);
    b->stream = ANY;
    index_insert(c->h, b);
    c->n++;
    return 0;
}

static size_t release_blocks(gm_heap *h, gm_owner *o, uint64_t threshold) {
    struct release_ctx c = {h, threshold, 0};
    /* fi_each tolerates moving the visited block out of the index it walks. */
    fi_each(&o->idx, release_one, &c);
    return c.n;
}

/* Give other streams' freed memory to everyone where an event proves it safe
 * (all of it if `synced`).  Returns how many blocks changed hands. */
static size_t release_owners(gm_heap *h, gm_stream requester, int synced) {
    size_t moved = 0;
    for (size_t i = 1; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        if (synced) {
            if (o->releasing) {
                event_put(h, o->release_event);
                o->releasing = 0;
            }
            o->safe_seq = h->free_seq;
            moved += release_blocks(h, o, UINT64_MAX);
            continue;
        }
        if (o->stream == requester || !o->idx.count) continue;
        if (!o->releasing) {
            if (!event_record(h, o->stream, &o->release_event)) continue;
            o->release_seq = h->free_seq;
            o->releasing = 1;
        }
        if (event_done(h, o->release_event)) {
            event_put(h, o->release_event);
            o->releasing = 0;
            o->safe_seq = o->release_seq;
            moved += release_blocks(h, o, o->release_seq);
        }
    }
    if (moved) coalesce_all(h);
    return moved;
}

/* ---- the fast path ------------------------------------------------------------ */

static gm_block *fit(gm_heap *h, size_t size, gm_stream s) {
    gm_owner *own = s == ANY ? NULL : gm_owner_find(h, s);
    gm_block *a = own ? fi_best_fit(&own->idx, size) : NULL;
    gm_block *b = fi_best_fit(&h->owners[0]->idx, size);
    if (!a) return b;
    if (!b) return a;
    return (b->size < a->size || (b->size == a->size && b->addr < a->addr)) ? b : a;
}

/* Turn [at, at+size) of the free block b into a live block. */
static gm_block *carve(gm_heap *h, gm_block *b, uintptr_t at, size_t size) {
    index_remove(h, b);
    if (at > b->addr) {
        gm_block *r = split(h, b, at - b->addr);
        index_insert(h, b);
        b = r;
    }
    if (b->size > size) index_insert(h, split(h, b, size));
    return b;
}

/* Pages [x, x+size) touches that no live or pending block touches already,
 * counting only the pages shared with b's neighbours (the rest are b's). */
static size_t fresh_pages(const gm_heap *h, const gm_block *b, uintptr_t x, size_t size) {
    size_t p0 = gm_page_floor(h, x), p1 = gm_page_ceil(h, x + size), n = p1 - p0;
    const gm_block *pr = b->prev, *nx = b->next;
    if (x == b->addr && pr && (pr->state == GM_BLOCK_LIVE || pr->state == GM_BLOCK_PENDING) &&
        gm_page_floor(h, pr->addr + pr->size - 1) == p0)
        n--;
    if (x + size == b->addr + b->size && nx && (nx->state == GM_BLOCK_LIVE || nx->state == GM_BLOCK_PENDING) &&
        gm_page_floor(h, nx->addr) == p1 - 1 && n)
        n--;
    return n;
}

/* Which end of free block b to carve from: the one that shares a page with a
 * live neighbour, so the allocation touches the fewest pages nothing else
 * uses -- physical memory is pages touched, not bytes.  Low end on ties. */
static uintptr_t snug_end(const gm_heap *h, const gm_block *b, size_t size) {
    if (b->size == size) return b->addr;
    uintptr_t hi = b->addr + b->size - size;
    return fresh_pages(h, b, hi, size) < fresh_pages(h, b, b->addr, size) ? hi : b->addr;
}

/* ---- physical pages -------------------------------------------------------------- */

static void spare_push(gm_heap *h, gm_handle hd) {
    /* cap_spare was sized for every page the heap can hold: never reallocates. */
    h->spare[h->n_spare++] = hd;
}

static void count_held(gm_heap *h, int64_t pages) {
    gm_stat_pool_add(h->st.segment, GM_SMALL_SIZE + 1, pages);
    gm_stat_pool_add(h->st.reserved_bytes, GM_SMALL_SIZE + 1, pages * (int64_t)h->page);
}

/* Create up to `want` pages while the heap holds fewer than `limit`.  Stops at
 * the first refusal; *dev_err keeps a non-OOM failure for the report. */
static size_t grow(gm_heap *h, size_t want, size_t limit, int *dev_err) {
    size_t made = 0;
    while (made < want && held_pages(h) < limit) {
        gm_handle hd;
        int rc = h->dev->ops->create(h->dev, &hd);
        if (rc) {
            if (rc != GM_ENOMEM) {
                h->st.num_device_errors++;
                *dev_err = rc;
            }
            break;
        }
        spare_push(h, hd);
        count_held(h, 1);
        h->st.num_device_alloc++;
        made++;
    }
    return made;
}

/* Release spare pages until the heap holds at most `target`. */
static int release_spares(gm_heap *h, size_t target) {
    while (h->n_spare && held_pages(h) > target) {
        gm_handle hd = h->spare[h->n_spare - 1];
        int rc = h->dev->ops->release(h->dev, hd);
        if (rc) {
            h->st.num_device_errors++;
            return rc;
        }
        h->n_spare--;
        count_held(h, -1);
        h->st.num_device_free++;
    }
    return GM_OK;
}

static size_t growth_limit(const gm_heap *h, size_t size) {
    size_t active = (size_t)h->st.active_bytes[GM_POOL_ALL].current + size;
    size_t basis = h->peak_live > active ? h->peak_live : active;
    size_t pages = (size_t)((double)basis * (1.0 + h->growth_slack) / (double)h->page) + 1 + h->growth_slack_pages;
    return pages < h->cap_pages ? pages : h->cap_pages;
}

static int synchronize(gm_heap *h) {
    if (h->dev->ops->synchronize(h->dev)) {
        h->st.num_device_errors++;
        return GM_EDEVICE;
    }
    h->st.num_sync_all_streams++;
    process_pending(h, 1);
    release_owners(h, ANY, 1);
    coalesce_all(h);
    return GM_OK;
}

/* Unmap pages [p0, p1), all inside the free block b, keeping their physical
 * pages as spares; the range becomes unmapped address space. */
static int unmap_pages(gm_heap *h, gm_block *b, size_t p0, size_t p1) {
    size_t done = p0;
    int rc = GM_OK;
    for (; done < p1; done++) {
        rc = h->dev->ops->unmap(h->dev, gm_page_addr(h, done), h->page);
        if (rc) {
            h->st.num_device_errors++;
            break;
        }
        spare_push(h, h->page_handle[done]);
        h->page_handle[done] = 0;
        h->mapped_pages--;
        h->st.num_unmaps++;
    }
    if (done == p0) return rc;
    /* Cut b into [free][unmapped p0..done)[free]. */
    uintptr_t lo = gm_page_addr(h, p0), hi = gm_page_addr(h, done);
    index_remove(h, b);
    gm_block *mid = b;
    if (lo > b->addr) {
        mid = split(h, b, lo - b->addr);
        index_insert(h, b);
    }
    if (mid->addr + mid->size > hi) index_insert(h, split(h, mid, hi - mid->addr));
    gm_hist(h, GM_H_UNMAP, lo, hi - lo, ANY, 0);
    make_unmapped(h, mid);
    return rc;
}

struct cached_run {
    gm_block *b;
    size_t p0, p1;
};

static int cmp_run(const void *x, const void *y) {
    const struct cached_run *a = x, *b = y;
    if (a->b->size != b->b->size) return a->b->size < b->b->size ? -1 : 1;
    return a->b->addr < b->b->addr ? 1 : -1;
}

/* Wholly free pages, outside the page range [ex0, ex1), that free blocks cover:
 * these back nothing and can be unmapped.  Writes them to *out (malloc'd). */
static size_t cached_runs(gm_heap *h, size_t ex0, size_t ex1, struct cached_run **out, size_t *pages) {
    size_t n = 0, cap = 0, total = 0;
    struct cached_run *runs = NULL;
    for (gm_block *b = h->head; b; b = b->next) {
        if (b->state != GM_BLOCK_FREE) continue;
        size_t p0 = gm_page_ceil(h, b->addr), p1 = gm_page_floor(h, b->addr + b->size);
        if (p0 >= p1) continue;
        size_t parts[2][2] = {{p0, p1 < ex0 ? p1 : ex0}, {p0 > ex1 ? p0 : ex1, p1}};
        for (int k = 0; k < 2; k++) {
            if (parts[k][0] >= parts[k][1]) continue;
            if (n == cap) {
                cap = cap ? 2 * cap : 64;
                struct cached_run *r = realloc(runs, cap * sizeof *r);
                if (!r) {
                    *out = runs;
                    *pages = total;
                    return n;
                }
                runs = r;
            }
            runs[n++] = (struct cached_run){b, parts[k][0], parts[k][1]};
            total += parts[k][1] - parts[k][0];
        }
    }
    *out = runs;
    *pages = total;
    return n;
}

static int cmp_run_addr(const void *x, const void *y) {
    const struct cached_run *a = x, *b = y;
    return a->p0 < b->p0 ? 1 : -1;
}

/* Unmap up to `want` cached pages outside [ex0, ex1) into spares.  The caller
 * has synchronised the device.  Pages come first from the smallest free blocks,
 * which can serve the fewest requests, and from the top of each.  The unmaps
 * then run from the highest address down: cutting a block keeps its record as
 * the lower part, so runs below (even of the same block) stay valid. */
static size_t recycle(gm_heap *h, size_t want, size_t ex0, size_t ex1) {
    struct cached_run *runs;
    size_t total, n = cached_runs(h, ex0, ex1, &runs, &total), got = 0, chosen = 0;
    /* Each cut block may need two more records. */
    if (!n || slab_reserve(h, 2 * n + 2)) {
        free(runs);
        return 0;
    }
    qsort(runs, n, sizeof *runs, cmp_run);
    for (size_t i = 0; i < n && chosen < want; i++) {
        size_t take = runs[i].p1 - runs[i].p0;
        if (take > want - chosen) take = want - chosen;
        runs[i].p0 = runs[i].p1 - take;
        chosen += take;
        runs[got++] = runs[i];
    }
    n = got;
    got = 0;
    qsort(runs, n, sizeof *runs, cmp_run_addr);
    for (size_t i = 0; i < n; i++) {
        size_t before = h->n_spare;
        int rc = unmap_pages(h, runs[i].b, runs[i].p0, runs[i].p1);
        got += h->n_spare - before;
        if (rc) break;
    }
    free(runs);
    return got;
}

/* ---- placement --------------------------------------------------------------------- */

typedef struct placement {
    int ok;
    uintptr_t addr;
    size_t new_pages;
    size_t run;
} placement;

/* Pages in [x, x+size) with nothing mapped, walking from `first` (a block at or before x). */
static size_t unmapped_in(const gm_heap *h, const gm_block *first, uintptr_t x, size_t size) {
    size_t pages = 0;
    uintptr_t end = x + size;
    for (const gm_block *b = first; b && b->addr < end; b = b->next) {
        if (b->state != GM_BLOCK_UNMAPPED || b->addr + b->size <= x) continue;
        uintptr_t lo = b->addr > x ? b->addr : x, hi = b->addr + b->size < end ? b->addr + b->size : end;
        pages += gm_page_ceil(h, hi) - gm_page_floor(h, lo);
    }
    return pages;
}

static void consider(const gm_heap *h, placement *best, const gm_block *first, uintptr_t start, size_t len,
                     size_t size) {
    uintptr_t cand[2] = {start, start + len - size};
    for (int k = 0; k < 2; k++) {
        size_t need = unmapped_in(h, first, cand[k], size);
        if (!best->ok || need < best->new_pages || (need == best->new_pages && len < best->run) ||
            (need == best->new_pages && len == best->run && cand[k] < best->addr))
            *best = (placement){1, cand[k], need, len};
        if (len == size) break;
    }
}

/* Where [addr, addr+size) needs the fewest new pages, among runs of memory
 * that stream s may use: its own or everyone's free blocks, and unmapped space. */
static placement place(const gm_heap *h, size_t size, gm_stream s) {
    placement best = {0, 0, 0, 0};
    const gm_block *first = NULL;
    size_t len = 0;
    for (const gm_block *b = h->head;; b = b->next) {
        int usable = b && (b->state == GM_BLOCK_UNMAPPED ||
                           (b->state == GM_BLOCK_FREE && (b->stream == s || b->stream == ANY)));
        if (usable) {
            if (!first) {
                first = b;
                len = 0;
            }
            len += b->size;
            continue;
        }
        if (first && len >= size) consider(h, &best, first, first->addr, len, size);
        first = NULL;
        if (!b) break;
    }
    return best;
}

/* Grant access to freshly mapped pages [p0, *p1).  If that fails, unmap them
 * again (their physical pages become spares) and lower *p1 to what is left:
 * a page that is mapped but inaccessible must never back a block.  Failing
 * calls are retried a few times, so that only a device that keeps failing can
 * leave pages behind, and then they are mapped and accessible. */
static int grant_or_take_back(gm_heap *h, size_t p0, size_t *p1) {
    int rc = h->dev->ops->set_access(h->dev, gm_page_addr(h, p0), (*p1 - p0) * h->page);
    if (!rc) return GM_OK;
    h->st.num_device_errors++;
    for (int attempt = 0; attempt < 8 && *p1 > p0; attempt++) {
        while (*p1 > p0) {
            size_t q = *p1 - 1;
            if (h->dev->ops->unmap(h->dev, gm_page_addr(h, q), h->page)) {
                h->st.num_device_errors++;
                break;
            }
            spare_push(h, h->page_handle[q]);
            h->page_handle[q] = 0;
            h->mapped_pages--;
            h->st.num_unmaps++;
            *p1 = q;
        }
        if (*p1 > p0 && h->dev->ops->set_access(h->dev, gm_page_addr(h, p0), (*p1 - p0) * h->page) == GM_OK) break;
    }
    return rc;
}

/* Map every unmapped page under [x, x+size) with spare pages, and make the
 * range one free block owned by s.  Returns that block, or NULL on a device
 * error (pages mapped so far stay mapped and free: nothing is lost). */
static gm_block *back_range(gm_heap *h, uintptr_t x, size_t size, gm_stream s, int remap, int *err) {
    gm_block *b = h->head;
    while (b->addr + b->size <= x) b = b->next;
    uintptr_t end = x + size;
    size_t cuts = 2;
    for (gm_block *c = b; c && c->addr < end; c = c->next) cuts += 2 * (c->state == GM_BLOCK_UNMAPPED);
    if (slab_reserve(h, cuts)) {
        *err = GM_ENOMEM;
        return NULL;
    }
    while (b && b->addr < end) {
        if (b->state != GM_BLOCK_UNMAPPED) {
            b = b->next;
            continue;
        }
        uintptr_t lo = b->addr > x ? b->addr : x, hi = b->addr + b->size < end ? b->addr + b->size : end;
        size_t p0 = gm_page_floor(h, lo), p1 = gm_page_ceil(h, hi), p = p0;
        int rc = GM_OK;
        for (; p < p1; p++) {
            gm_handle hd = h->spare[h->n_spare - 1];
            rc = h->dev->ops->map(h->dev, gm_page_addr(h, p), hd);
            if (rc) {
                h->st.num_device_errors++;
                break;
            }
            h->n_spare--;
            h->page_handle[p] = hd;
            h->mapped_pages++;
            h->st.num_maps++;
        }
        if (p > p0) {
            int arc = grant_or_take_back(h, p0, &p);
            if (!rc) rc = arc;
        }
        if (rc) *err = rc;
        if (p > p0) {
            /* Cut b into [unmapped][free p0..p)[unmapped]. */
            uintptr_t a0 = gm_page_addr(h, p0), a1 = gm_page_addr(h, p);
            gm_block *mid = b;
            if (a0 > b->addr) mid = split(h, b, a0 - b->addr);
            gm_block *rest = NULL;
            if (mid->addr + mid->size > a1) rest = split(h, mid, a1 - mid->addr);
            gm_hist(h, remap ? GM_H_REMAP : GM_H_MAP, a0, a1 - a0, s, 0);
            mid = make_free(h, mid, s, 0);
            b = rest ? rest : mid->next;
        } else {
            b = b->next;
        }
        if (rc) return NULL;
    }
    /* The range is now free; merge what ownership kept apart (s and ANY only). */
    b = h->head;
    while (b->addr + b->size <= x) b = b->next;
    while (b->addr + b->size < end) {
        gm_block *n = b->next;
        gm_stream o;
        if (b->state != GM_BLOCK_FREE || n->state != GM_BLOCK_FREE || !owners_merge(b->stream, n->stream, &o))
            return NULL; /* cannot happen: place() only chose usable runs */
        index_remove(h, b);
        index_remove(h, n);
        absorb(h, b, n);
        b->stream = o;
        index_insert(h, b);
    }
    return b->state == GM_BLOCK_FREE ? b : NULL;
}

/* ---- reports ------------------------------------------------------------------------- */

size_t gm_used_pages(gm_heap *h) {
    size_t used = 0, last = SIZE_MAX; /* last page counted */
    for (gm_block *b = h->head; b; b = b->next) {
        if (b->state != GM_BLOCK_LIVE && b->state != GM_BLOCK_PENDING) continue;
        size_t p0 = gm_page_floor(h, b->addr), p1 = gm_page_ceil(h, b->addr + b->size);
        if (last != SIZE_MAX && p0 <= last) p0 = last + 1;
        if (p1 > p0) used += p1 - p0;
        if (p1 > 0) last = p1 - 1;
    }
    return used;
}

static void fill_report(gm_heap *h, size_t size, gm_stream s, gm_oom_info *o) {
    memset(o, 0, sizeof *o);
    o->request = size;
    o->stream = s;
    size_t dfree = 0, dtotal = 0;
    if (h->dev->ops->mem_info(h->dev, &dfree, &dtotal) == GM_OK) {
        o->device_free = dfree;
        o->device_total = dtotal;
    }
    o->cap_bytes = h->cap_pages * h->page;
    o->live_bytes = h->live_bytes;
    o->pending_bytes = (size_t)h->st.active_bytes[GM_POOL_ALL].current - h->live_bytes;
    o->reserved_bytes = held_pages(h) * h->page;
    size_t used = gm_used_pages(h);
    o->cached_bytes = (held_pages(h) - used) * h->page;
    size_t run = 0, best_run = 0;
    for (gm_block *b = h->head; b; b = b->next) {
        if (b->state == GM_BLOCK_FREE) {
            o->free_mapped_bytes += b->size;
            if (b->size > o->largest_free_mapped) o->largest_free_mapped = b->size;
        }
        if (b->state == GM_BLOCK_FREE || b->state == GM_BLOCK_UNMAPPED) {
            run += b->size;
            if (run > best_run) best_run = run;
        } else {
            run = 0;
        }
    }
    /* Pages a request could end up with: everything the heap holds that backs
     * no live block, plus what the device and the cap still allow. */
    size_t obtainable = held_pages(h) + dfree / h->page;
    if (obtainable > h->cap_pages) obtainable = h->cap_pages;
    size_t avail = obtainable > used ? obtainable - used : 0;
    size_t possible = avail * h->page;
    o->largest_possible = possible < best_run ? possible : best_run;
    if (o->largest_free_mapped > o->largest_possible) o->largest_possible = o->largest_free_mapped;
}

void gm_memory_report(gm_heap *h, size_t size, gm_oom_info *out) {
    pthread_mutex_lock(&h->lock);
    fill_report(h, align_up(size, GM_ALIGN), ANY, out);
    pthread_mutex_unlock(&h->lock);
}

int gm_last_oom(gm_heap *h, gm_oom_info *out) {
    pthread_mutex_lock(&h->lock);
    int have = h->have_oom;
    if (have) *out = h->last_oom;
    pthread_mutex_unlock(&h->lock);
    return have ? GM_OK : GM_EINVAL;
}

/* ---- the slow path --------------------------------------------------------------------- */

static int out_of_memory(gm_heap *h, size_t size, gm_stream s, size_t short_pages, int dev_err) {
    /* Pages gathered for a request that failed would only starve others. */
    release_spares(h, h->mapped_pages);
    fill_report(h, size, s, &h->last_oom);
    h->last_oom.pages_needed = short_pages;
    h->last_oom.device_error = dev_err;
    h->have_oom = 1;
    h->st.num_ooms++;
    gm_hist(h, GM_H_OOM, 0, size, s, 0);
    return GM_ENOMEM;
}

/* Wholly free pages outside the page range [ex0, ex1), counted over runs of
 * neighbouring free blocks whatever their owners: after a synchronisation the
 * run merges into one block and its pages can go. */
static size_t cached_pages(const gm_heap *h, size_t ex0, size_t ex1) {
    size_t pages = 0;
    for (const gm_block *b = h->head; b;) {
        if (b->state != GM_BLOCK_FREE && b->state != GM_BLOCK_PENDING) {
            b = b->next;
            continue;
        }
        uintptr_t lo = b->addr;
        while (b && (b->state == GM_BLOCK_FREE || b->state == GM_BLOCK_PENDING)) b = b->next;
        uintptr_t hi = b ? b->addr : h->base + h->va_size;
        size_t p0 = gm_page_ceil(h, lo), p1 = gm_page_floor(h, hi);
        for (size_t k = 0; k < 2; k++) {
            size_t a = k ? (p0 > ex1 ? p0 : ex1) : p0, z = k ? p1 : (p1 < ex0 ? p1 : ex0);
            if (a < z) pages += z - a;
        }
    }
    return pages;
}

/* Cached pages a defragmentation could move behind placement pl. */
static size_t cached_pages_outside(gm_heap *h, placement pl, size_t size) {
    return cached_pages(h, gm_page_floor(h, pl.addr), gm_page_ceil(h, pl.addr + size));
}

/* Wait for the device, place again (every stream's free memory is usable
 * now), and unmap cached pages into spares for the placement's shortfall. */
static void defragment(gm_heap *h, placement *pl, size_t size, gm_stream s, int *synced, int *recycled,
                       int *dev_err) {
    if (synchronize(h) != GM_OK) {
        *dev_err = GM_EDEVICE;
        return;
    }
    *synced = 1;
    *pl = place(h, size, s);
    if (!pl->ok || pl->new_pages <= h->n_spare) return;
    size_t got = recycle(h, pl->new_pages - h->n_spare, gm_page_floor(h, pl->addr), gm_page_ceil(h, pl->addr + size));
    if (got) {
        *recycled = 1;
        h->st.num_remaps++;
        h->st.num_pages_remapped += (int64_t)got;
    }
}

static int alloc_slow(gm_heap *h, size_t size, gm_stream s, gm_block **out, uintptr_t *at) {
    h->st.num_alloc_retries++;
    /* 1. Memory other streams (or record_stream users) have finished with. */
    size_t moved = h->n_pending ? process_pending(h, 0) : 0;
    if (h->n_owners > 2 || (h->n_owners == 2 && h->owners[1]->stream != s)) moved += release_owners(h, s, 0);
    gm_block *b = moved ? fit(h, size, s) : NULL;
    if (b) {
        *out = b;
        *at = b->addr;
        return GM_OK;
    }
    /* 2-3. Place, and back it with spare or new pages under the growth limit. */
    int dev_err = GM_OK, recycled = 0, synced = 0;
    placement pl = place(h, size, s);
    if (pl.ok && pl.new_pages > h->n_spare) grow(h, pl.new_pages - h->n_spare, growth_limit(h, size), &dev_err);
    /* 4. Defragment when cached pages can cover the shortfall (a device wait
     * buys nothing otherwise); else grow to the cap, and defragment with what
     * there is only if the device or the cap refused. */
    if (!pl.ok || (pl.new_pages > h->n_spare && cached_pages_outside(h, pl, size) >= pl.new_pages - h->n_spare))
        defragment(h, &pl, size, s, &synced, &recycled, &dev_err);
    if (pl.ok && pl.new_pages > h->n_spare) grow(h, pl.new_pages - h->n_spare, h->cap_pages, &dev_err);
    if ((!pl.ok || pl.new_pages > h->n_spare) && !synced) {
        defragment(h, &pl, size, s, &synced, &recycled, &dev_err);
        if (pl.ok && pl.new_pages > h->n_spare) grow(h, pl.new_pages - h->n_spare, h->cap_pages, &dev_err);
    }
    if (!pl.ok) return out_of_memory(h, size, s, (size + h->page - 1) / h->page, dev_err);
    if (pl.new_pages > h->n_spare) return out_of_memory(h, size, s, pl.new_pages - h->n_spare, dev_err);
    int err = GM_OK;
    b = back_range(h, pl.addr, size, s, recycled, &err);
    if (!b) {
        release_spares(h, h->mapped_pages);
        return err ? GM_EDEVICE : GM_ECORRUPT;
    }
    *out = b;
    *at = pl.addr;
    return GM_OK;
}

/* ---- public entry points --------------------------------------------------------------- */

void gm_config_default(gm_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->growth_slack = 0.01;
    cfg->growth_slack_pages = 4;
}

static _Thread_local char create_error[320];

const char *gm_create_error(void) { return create_error; }

/* Keep the reason before the device (and its last_error) goes away. */
static int create_failed(gm_device *dev, int rc, const char *what) {
    if (dev && dev->last_error[0]) snprintf(create_error, sizeof create_error, "%s: %s", what, dev->last_error);
    else snprintf(create_error, sizeof create_error, "%s: %s", what, gm_strerror(rc));
    return rc;
}

int gm_heap_create(gm_device *dev, const gm_config *cfg_in, gm_heap **out) {
    *out = NULL;
    create_error[0] = 0;
    if (!dev) return create_failed(NULL, GM_EINVAL, "no device");
    gm_config cfg;
    if (cfg_in) cfg = *cfg_in;
    else gm_config_default(&cfg);
    size_t page = dev->page_size;
    if (page < GM_ALIGN || (page & (page - 1)) || cfg.growth_slack < 0 || cfg.growth_slack > 100) {
        dev->last_error[0] = 0;
        create_failed(dev, GM_EINVAL,
                      cfg.growth_slack < 0 || cfg.growth_slack > 100 ? "growth_slack must be in [0, 100]"
                                                                      : "device page size is not a power of two >= 512");
        dev->ops->destroy(dev);
        return GM_EINVAL;
    }
    size_t dfree = 0, total = 0;
    int rc = dev->ops->mem_info(dev, &dfree, &total);
    if (rc) {
        create_failed(dev, rc, "reading the device's memory size");
        dev->ops->destroy(dev);
        return rc;
    }
    gm_heap *h = calloc(1, sizeof *h);
    if (!h) {
        create_failed(dev, GM_ENOMEM, "host memory");
        dev->ops->destroy(dev);
        return GM_ENOMEM;
    }
    h->dev = dev;
    h->page = page;
    h->page_shift = (unsigned)__builtin_ctzll((unsigned long long)page);
    h->device_total = total;
    h->growth_slack = cfg.growth_slack;
    h->growth_slack_pages = cfg.growth_slack_pages;
    if (cfg.va_size > ((size_t)1 << 48)) {
        dev->last_error[0] = 0;
        create_failed(dev, GM_EINVAL, "va_size exceeds the 256 TiB of address space a GPU has");
        dev->ops->destroy(dev);
        free(h);
        return GM_EINVAL;
    }
    size_t va = cfg.va_size ? align_up(cfg.va_size, page) : align_up(4 * total, page);
    if (va < 64 * page) va = 64 * page;
    h->va_size = va;
    h->n_pages = va / page;
    pthread_mutex_init(&h->lock, NULL);
    gm_fork_register(h);
    h->live_mask = 1023;
    size_t max_pages = total / page + 1;
    h->cap_spare = h->n_pages > max_pages ? h->n_pages : max_pages;
    h->page_handle = calloc(h->n_pages, sizeof *h->page_handle);
    h->spare = calloc(h->cap_spare, sizeof *h->spare);
    h->live = calloc(h->live_mask + 1, sizeof *h->live);
    rc = (!h->page_handle || !h->spare || !h->live || !owner_get(h, ANY) || slab_grow(h)) ? GM_ENOMEM : GM_OK;
    if (rc) {
        create_failed(dev, rc, "host memory for the heap's tables");
    } else if ((rc = dev->ops->reserve(dev, va, &h->base))) {
        h->va_size = 0;
        char what[96];
        snprintf(what, sizeof what, "reserving %zu GiB of address space", va >> 30);
        create_failed(dev, rc, what);
    }
    if (rc) {
        gm_heap_destroy(h);
        return rc;
    }
    h->head = block_new(h);
    h->head->addr = h->base;
    h->head->size = va;
    h->head->state = GM_BLOCK_UNMAPPED;
    h->head->stream = ANY;
    h->st.max_split_size = -1;
    gm_set_cap(h, cfg.cap_bytes);
    *out = h;
    return GM_OK;
}

void gm_heap_destroy(gm_heap *h) {
    if (!h) return;
    gm_device *dev = h->dev;
    gm_fork_unregister(h);
    /* A fork()ed child: the GPU's memory, events and context are the parent's,
     * and CUDA cannot be called here.  Free host memory only. */
    int host_only = h->inherited && strcmp(dev->kind, "sim");
    if (host_only) {
        for (size_t i = 0; i < h->n_owners; i++) h->owners[i]->releasing = 0;
        for (gm_block *b = h->pending_head; b; b = b->lnext) b->n_uses = 0;
        h->n_pages = h->n_spare = h->n_event_pool = 0;
        h->va_size = 0;
    }
    if (h->page_handle) {
        for (size_t p = 0; p < h->n_pages; p++) {
            if (!h->page_handle[p]) continue;
            dev->ops->unmap(dev, gm_page_addr(h, p), h->page);
            dev->ops->release(dev, h->page_handle[p]);
        }
    }
    for (size_t i = 0; i < h->n_spare; i++) dev->ops->release(dev, h->spare[i]);
    for (gm_block *b = h->pending_head; b; b = b->lnext)
        for (uint32_t i = 0; i < b->n_uses; i++)
            if (b->events[i]) dev->ops->event_destroy(dev, b->events[i]);
    for (size_t i = 0; i < h->n_owners; i++) {
        if (h->owners[i]->releasing) dev->ops->event_destroy(dev, h->owners[i]->release_event);
        free(h->owners[i]);
    }
    for (size_t i = 0; i < h->n_event_pool; i++) dev->ops->event_destroy(dev, h->event_pool[i]);
    if (h->va_size && h->base) dev->ops->unreserve(dev, h->base, h->va_size);
    for (gm_block *b = h->head; b; b = b->next) {
        free(b->uses);
        free(b->events);
    }
    for (size_t i = 0; i < h->n_slab_chunks; i++) free(h->slab_chunks[i]);
    free(h->slab_chunks);
    free(h->owners);
    free(h->event_pool);
    free(h->live);
    free(h->spare);
    free(h->page_handle);
    gm_hist_free(h);
    pthread_mutex_destroy(&h->lock);
    if (!host_only) dev->ops->destroy(dev);
    free(h);
}

gm_device *gm_heap_device(gm_heap *h) { return h->dev; }

int gm_malloc(gm_heap *h, size_t size, gm_stream s, uint64_t context, uintptr_t *out) {
    if (!out) return GM_EINVAL;
    *out = 0;
    if (s == ANY) return GM_EINVAL;
    if (size > ((size_t)1 << 52)) return GM_EINVAL;
    size_t rsize = align_up(size ? size : 1, GM_ALIGN);
    pthread_mutex_lock(&h->lock);
    int rc = GM_OK;
    if (rsize > h->va_size || rsize > h->cap_pages * h->page) {
        rc = out_of_memory(h, rsize, s, (rsize + h->page - 1) / h->page, GM_OK);
        goto done;
    }
    if ((rc = slab_reserve(h, 4)) || (h->n_live >= h->live_mask && (rc = live_grow(h)))) goto done;
    gm_owner *own = gm_owner_find(h, s);
    if (!own && !(own = owner_get(h, s))) {
        rc = GM_ENOMEM;
        goto done;
    }
    if (h->n_pending) process_pending(h, 0);
    gm_block *b = fit(h, rsize, s);
    uintptr_t at = b ? snug_end(h, b, rsize) : 0;
    if (!b && (rc = alloc_slow(h, rsize, s, &b, &at))) goto done;
    b = carve(h, b, at, rsize);
    b->state = GM_BLOCK_LIVE;
    b->stream = s;
    b->requested = size;
    b->context = context;
    b->seq = ++h->alloc_seq;
    live_insert(h, b);
    h->live_bytes += rsize;
    int pool = gm_pool_of(rsize);
    gm_stat_up(h->st.allocation, pool, 1);
    gm_stat_up(h->st.allocated_bytes, pool, (int64_t)rsize);
    gm_stat_up(h->st.requested_bytes, pool, (int64_t)size);
    gm_stat_up(h->st.active, pool, 1);
    gm_stat_up(h->st.active_bytes, pool, (int64_t)rsize);
    if ((size_t)h->st.active_bytes[GM_POOL_ALL].current > h->peak_live)
        h->peak_live = (size_t)h->st.active_bytes[GM_POOL_ALL].current;
    gm_hist(h, GM_H_ALLOC, b->addr, rsize, s, context);
    *out = b->addr;
done:
    pthread_mutex_unlock(&h->lock);
    return rc;
}

static int not_live(const gm_heap *h, uintptr_t ptr) {
    return (ptr >= h->base && ptr < h->base + h->va_size) ? GM_EDOUBLE_FREE : GM_EUNKNOWN_PTR;
}

int gm_free(gm_heap *h, uintptr_t ptr) {
    pthread_mutex_lock(&h->lock);
    gm_block *b = live_remove(h, ptr);
    if (!b) {
        int rc = not_live(h, ptr);
        pthread_mutex_unlock(&h->lock);
        return rc;
    }
    h->live_bytes -= b->size;
    int pool = gm_pool_of(b->size);
    gm_stat_down(h->st.allocation, pool, 1);
    gm_stat_down(h->st.allocated_bytes, pool, (int64_t)b->size);
    gm_stat_down(h->st.requested_bytes, pool, (int64_t)b->requested);
    gm_hist(h, GM_H_FREE_REQUESTED, b->addr, b->size, b->stream, b->context);
    if (!b->n_uses) {
        complete_free(h, b);
    } else {
        /* Other streams may still touch it: one event per stream, and the block
         * waits.  If an event cannot be recorded, it waits for the next device
         * synchronisation instead. */
        b->wait_sync = 0;
        for (uint32_t i = 0; i < b->n_uses; i++) {
            b->events[i] = 0;
            if (!b->wait_sync && !event_record(h, b->uses[i], &b->events[i])) b->wait_sync = 1;
        }
        b->state = GM_BLOCK_PENDING;
        pending_append(h, b);
    }
    pthread_mutex_unlock(&h->lock);
    return GM_OK;
}

int gm_record_stream(gm_heap *h, uintptr_t ptr, gm_stream s) {
    if (s == ANY) return GM_EINVAL;
    pthread_mutex_lock(&h->lock);
    int rc = GM_OK;
    gm_block *b = gm_live_find(h, ptr);
    if (!b) {
        rc = not_live(h, ptr);
        goto done;
    }
    if (s == b->stream) goto done;
    for (uint32_t i = 0; i < b->n_uses; i++)
        if (b->uses[i] == s) goto done;
    if (b->n_uses == b->cap_uses) {
        uint32_t cap = b->cap_uses ? 2 * b->cap_uses : 2;
        gm_stream *u = realloc(b->uses, cap * sizeof *u);
        if (u) b->uses = u;
        gm_event *e = u ? realloc(b->events, cap * sizeof *e) : NULL;
        if (e) b->events = e;
        if (!u || !e) {
            rc = GM_ENOMEM;
            goto done;
        }
        b->cap_uses = cap;
    }
    b->uses[b->n_uses++] = s;
done:
    pthread_mutex_unlock(&h->lock);
    return rc;
}

size_t gm_block_size(gm_heap *h, uintptr_t ptr) {
    pthread_mutex_lock(&h->lock);
    gm_block *b = gm_live_find(h, ptr);
    size_t n = b ? b->size : 0;
    pthread_mutex_unlock(&h->lock);
    return n;
}

/* Unmap cached pages and release spares until the heap holds at most `target`. */
static int trim(gm_heap *h, size_t target) {
    int rc = release_spares(h, target);
    if (rc || held_pages(h) <= target) return rc;
    /* Pending blocks count as free here: the synchronisation completes them. */
    if (!cached_pages(h, 0, 0)) return GM_OK;
    if ((rc = synchronize(h))) return rc; /* spares are gone already; nothing else is safe */
    size_t want = held_pages(h) - target, got = recycle(h, want, 0, 0);
    if (got) gm_hist(h, GM_H_EMPTY_CACHE, 0, got * h->page, ANY, 0);
    /* What cannot go backs live blocks (or an unmap failed). */
    return release_spares(h, target);
}

int gm_empty_cache(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    int rc = trim(h, 0);
    pthread_mutex_unlock(&h->lock);
    return rc;
}

int gm_set_cap(gm_heap *h, size_t cap_bytes) {
    pthread_mutex_lock(&h->lock);
    size_t limit = (cap_bytes && cap_bytes < h->device_total) ? cap_bytes : h->device_total;
    h->user_cap = cap_bytes;
    h->cap_pages = limit / h->page;
    int rc = held_pages(h) > h->cap_pages ? trim(h, h->cap_pages) : GM_OK;
    pthread_mutex_unlock(&h->lock);
    return rc;
}

size_t gm_get_cap(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    size_t c = h->user_cap;
    pthread_mutex_unlock(&h->lock);
    return c;
}

void gm_get_stats(gm_heap *h, gm_stats *out) {
    pthread_mutex_lock(&h->lock);
    *out = h->st;
    pthread_mutex_unlock(&h->lock);
}

void gm_reset_peak_stats(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    gm_stats_reset_peaks(&h->st);
    pthread_mutex_unlock(&h->lock);
}

void gm_reset_accumulated_stats(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    gm_stats_reset_accumulated(&h->st);
    pthread_mutex_unlock(&h->lock);
}
