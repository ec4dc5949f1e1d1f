/*
 * heap_internal.h -- the heap's data structures, shared by the core's files.
 * Nothing outside csrc/core includes this.  The design is drawn in heap.c.
 */
#ifndef GPUMEM_HEAP_INTERNAL_H
#define GPUMEM_HEAP_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "freeindex.h"
#include "gpumem/gpumem.h"

typedef struct gm_block gm_block;
struct gm_block {
    uintptr_t addr;
    size_t size;
    gm_block *prev, *next;   /* address-order neighbours; together they tile the range */
    gm_block *lprev, *lnext; /* bin list (free), pending list (pending) or slab free list */
    gm_block *hnext;         /* live-table chain (live) */
    size_t requested;
    /* live/pending: the allocation stream.  free: the owner, the stream that may
     * reuse it at once (GM_STREAM_ANY: every stream). */
    gm_stream stream;
    uint64_t context;
    /* live/pending: allocation number.  free: the free-sequence number of the
     * latest free merged into it (owner releases compare against it). */
    uint64_t seq;
    /* free: the stream whose free gave `seq` (the newest free merged in).  The
     * checker holds a block that every stream may reuse to the proof for that
     * free (gm_owner.safe_seq). */
    gm_stream origin;
    uint8_t state;           /* gm_block_state */
    uint8_t wait_sync;       /* pending, but an event could not be recorded: wait for a device sync */
    uint32_t n_uses, cap_uses;
    gm_stream *uses;         /* streams named by record_stream */
    gm_event *events;        /* pending: one event per use, recorded at free */
};

/* Free memory owned by one stream, and its release in flight. */
typedef struct gm_owner {
    gm_stream stream;
    gm_freeindex idx;
    int releasing;           /* an event is recorded; blocks freed up to release_seq follow it */
    gm_event release_event;
    uint64_t release_seq;
    uint64_t safe_seq;       /* frees up to here are proven done (a completed event or a device sync) */
} gm_owner;

struct gm_heap {
    pthread_mutex_t lock;
    gm_device *dev;
    size_t page;             /* page size */
    unsigned page_shift;
    uintptr_t base;          /* reserved range [base, base + va_size) */
    size_t va_size;
    size_t n_pages;
    gm_handle *page_handle;  /* per page: the physical page mapped there, 0 if none */
    size_t mapped_pages;
    gm_handle *spare;        /* physical pages held but not mapped */
    size_t n_spare, cap_spare;

    size_t device_total;
    size_t cap_pages;        /* the effective cap, in pages */
    size_t user_cap;         /* 0: none */
    double growth_slack;
    size_t growth_slack_pages;

    gm_block *head;          /* the first block in address order */

    gm_owner **owners;       /* owners[0] is GM_STREAM_ANY */
    size_t n_owners, cap_owners;
    gm_owner *last_owner;    /* one-entry cache for the common single-stream case */

    gm_block **live;         /* live table: chained hash on addr */
    size_t live_mask, n_live;

    gm_block *pending_head, *pending_tail; /* freed blocks waiting for events, FIFO */
    size_t n_pending;

    gm_event *event_pool;    /* created events not in use */
    size_t n_event_pool, cap_event_pool;

    gm_block *slab_free;     /* unused block records */
    size_t n_slab_free;
    void **slab_chunks;
    size_t n_slab_chunks, cap_slab_chunks;

    uint64_t alloc_seq, free_seq;
    gm_stats st;
    size_t live_bytes;       /* == st.allocated_bytes[ALL].current, kept unsigned */
    size_t peak_live;        /* since creation: the growth limit follows it */

    /* history ring */
    gm_hist_entry *hist;
    size_t hist_cap, hist_head, hist_len;
    uint64_t hist_dropped;

    int have_oom;
    gm_oom_info last_oom;

    /* fork.c */
    gm_heap *fork_next;      /* registry of live heaps */
    int inherited;           /* this process is a fork()ed child of the one that made the heap */
};

/* ---- shared helpers (heap.c) ---- */
static inline size_t gm_page_floor(const gm_heap *h, uintptr_t a) { return (size_t)((a - h->base) >> h->page_shift); }
static inline size_t gm_page_ceil(const gm_heap *h, uintptr_t a) { return (size_t)((a - h->base + h->page - 1) >> h->page_shift); }
static inline uintptr_t gm_page_addr(const gm_heap *h, size_t p) { return h->base + ((uintptr_t)p << h->page_shift); }

gm_owner *gm_owner_find(gm_heap *h, gm_stream s);
gm_block *gm_live_find(const gm_heap *h, uintptr_t addr);
size_t gm_used_pages(gm_heap *h);

/* ---- fork.c ---- */
void gm_fork_register(gm_heap *h);
void gm_fork_unregister(gm_heap *h);
int gm_heap_inherited(const gm_heap *h);

/* ---- stats.c ---- */
static inline void gm_stat_add(gm_stat *s, int64_t delta) {
    s->current += delta;
    if (delta > 0) {
        s->allocated += delta;
        if (s->current > s->peak) s->peak = s->current;
    } else {
        s->freed -= delta;
    }
}
static inline int gm_pool_of(size_t size) { return size <= GM_SMALL_SIZE ? GM_POOL_SMALL : GM_POOL_LARGE; }
static inline void gm_stat_pool_add(gm_stat *arr, size_t size, int64_t delta) {
    gm_stat_add(&arr[GM_POOL_ALL], delta);
    gm_stat_add(&arr[gm_pool_of(size)], delta);
}
/* The hot paths know the sign: no branch on it. */
static inline void gm_stat_up(gm_stat *arr, int pool, int64_t n) {
    gm_stat *a = &arr[GM_POOL_ALL], *p = &arr[pool];
    a->current += n, a->allocated += n, p->current += n, p->allocated += n;
    if (a->current > a->peak) a->peak = a->current;
    if (p->current > p->peak) p->peak = p->current;
}
static inline void gm_stat_down(gm_stat *arr, int pool, int64_t n) {
    gm_stat *a = &arr[GM_POOL_ALL], *p = &arr[pool];
    a->current -= n, a->freed += n, p->current -= n, p->freed += n;
}
void gm_stats_reset_peaks(gm_stats *st);
void gm_stats_reset_accumulated(gm_stats *st);

/* ---- history.c ---- */
void gm_hist_push(gm_heap *h, uint32_t action, uintptr_t addr, size_t size, gm_stream stream, uint64_t context);
static inline void gm_hist(gm_heap *h, uint32_t action, uintptr_t addr, size_t size, gm_stream stream, uint64_t context) {
    if (h->hist_cap) gm_hist_push(h, action, addr, size, stream, context);
}
void gm_hist_free(gm_heap *h);

#endif
