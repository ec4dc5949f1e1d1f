/*
 * heap_internal.h -- the heap's data structures, shared by the core's files,
 * and the functions that cross from one file to another, grouped by the file
 * that defines them (heap.c, THE FILES, says which file owns what).  Nothing
 * outside csrc/core includes this.  The design is drawn in heap.c.
 */
#ifndef GPUMEM_HEAP_INTERNAL_H
#define GPUMEM_HEAP_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "block.h"
#include "freeindex.h"
#include "runindex.h"
#include "gpumem/gpumem.h"

typedef struct gm_owner gm_owner;
typedef struct gm_paused_page gm_paused_page;

/* Free memory owned by one stream (in one pool, or the general heap), and its
 * release in flight. */
struct gm_owner {
    gm_pool *pool; /* NULL: the general heap */
    gm_stream stream;
    int keep; /* scratch for owners_trim */
    gm_freeindex idx;
    int releasing; /* an event is recorded; blocks freed up to release_seq follow it */
    gm_event release_event;
    uint64_t release_seq;
    uint64_t safe_seq; /* frees up to here are proven done (a completed event or a device sync) */
};

/* A private pool.  Its free blocks sit in its own owners' indexes.  The record
 * outlives the pool's end (use_count 0) while blocks of it are live or pending. */
struct gm_pool {
    gm_pool_id id;
    int64_t use_count;              /* 0: ended */
    int no_split;                   /* a block of it is never split: a request takes a whole free block */
    size_t live_blocks, live_bytes; /* live and pending */
    size_t free_blocks, free_bytes; /* free blocks in its indexes */
    gm_owner *any;                  /* its GM_STREAM_ANY owner, made with the pool */
    /* gm_pool_pause: the pages released, in ascending order (their addresses
     * keep the pool's blocks but no physical page), the pages kept because
     * other blocks share them, and the host copy of the released pages'
     * contents (NULL: none). */
    int paused;
    gm_paused_page *paused_list;
    size_t n_paused, shared_pages;
    void *backup;
};

/* A page released by gm_pool_pause; its contents (with a backup) lie at
 * backup + slot * page_size. */
struct gm_paused_page {
    size_t page, slot;
};

struct gm_heap {
    pthread_mutex_t lock;
    gm_device *dev;
    size_t page; /* page size */
    unsigned page_shift;
    uintptr_t base; /* reserved range [base, base + va_size) */
    size_t va_size;
    size_t n_pages;
    /* Physical memory comes in chunks: one device allocation of k >= 1
     * contiguous pages, mapped and unmapped only as a whole (heap.c, PHYSICAL
     * PAGES).  Per page p, for a chunk of k pages mapped at pages [c, c+k):
     *
     *   page        c      c+1    ...   c+k-1
     *   page_handle H      H      ...   H        the chunk's handle, 0: nothing mapped
     *   chunk_off   0      1      ...   k-1      p - c
     *   chunk_len   k      k      ...   k        0: nothing mapped
     *
     * so a mapped page finds its chunk in O(1) (h_chunk_first).  A chunk of
     * one page is a page as it always was: it may become a spare and move. */
    gm_handle *page_handle;
    uint32_t *chunk_off, *chunk_len;
    size_t mapped_pages;
    gm_handle *spare; /* single pages held but not mapped (never a chunk of more) */
    size_t n_spare, cap_spare;
    /* Unmapped chunks of more than one page whose release failed: retried by
     * release_spares; held meanwhile. */
    struct gm_loose {
        gm_handle handle;
        size_t pages;
    } *loose;
    size_t n_loose, loose_pages;
    /* Pages mapped during a capture whose access grant kept failing.  They
     * may not be unmapped then (that would invalidate the capture) and must
     * back nothing, so they stay mapped (and held) inside unmapped space until
     * no capture is on and unpark() unmaps them.  Per page: 1 if parked; they
     * come in whole chunks. */
    uint8_t *parked;
    size_t n_parked;
    int with_room;     /* the slow path last found the heap below its room line (POLICY, growth edges) */
    int near_pressure; /* placement last found the heap near pressure (h_near_pressure; POLICY, whole pages) */
    /* Per page: the growth that mapped it (or gave it to a pool) -- one
     * slow-path placement, numbered from 1 (growth_seq: the latest); 0: never
     * mapped.  Snapshots cut segments where it changes, and a no_split
     * pool's free blocks do not merge across such a seam (h_pool_seam). */
    uint32_t *page_growth;
    uint32_t growth_seq;
    /* Small pages (small.c): per page, 1 if it is kept for blocks of at most
     * half a page, and how many live or pending blocks it holds (never 0
     * while it is kept). */
    uint8_t *small_page;
    uint32_t *small_held;
    size_t chunk_pages;  /* the most pages one device allocation holds (gm_config.chunk_pages) */
    size_t multi_chunks; /* chunks of more than one page mapped now (host ones too) */
    /* Spill (spill.c): per page, 1 if a host-located chunk is mapped there
     * (its pages are in the page tables above like any chunk's, but count in
     * host_pages, never in mapped_pages: they are not the device's memory, do
     * not count against the cap and never become spares).  Unmapped host
     * chunks wait in host_loose: kept for the next spill while the demand
     * exceeds the cap (host_keep), or their release failed.  spill_pages:
     * the limit (0: off), for mapped and kept host pages together. */
    uint8_t *host;
    size_t host_pages, spill_pages;
    int spill_choice, host_keep;
    /* With spill on, the swing of live memory (h_swing): blocks numbered up
     * to trough_seq that are still live were live at its last low point
     * (GM_SPILL_LASTING's candidates). */
    int falling;
    size_t swing_lo, swing_hi;
    uint64_t lo_seq, trough_seq;
    gm_handle *host_loose;
    size_t n_host_loose, cap_host_loose, host_loose_pages;
    size_t *host_loose_len;
    uintptr_t scratch; /* a reservation of scratch_pages pages, to copy through (0: none yet) */
    size_t scratch_pages;
    size_t spill_whole; /* the block the slow path just placed on host pages takes this many bytes */
    int host_idle;      /* a pending block on host pages completed: the next malloc unmaps what it left idle */
    size_t host_kept;   /* h_host_kept's answer, while host_kept_stale is 0 */
    int host_kept_stale;
    size_t live_peak_pages; /* the most pages live blocks touched since the peak was reset (SPILL's return) */

    size_t device_total;
    size_t cap_pages; /* the effective cap, in pages */
    size_t user_cap;  /* 0: none */
    double growth_slack;
    size_t growth_slack_pages;
    double pressure; /* gm_config.pressure; see policy.c, POLICY */

    gm_block *head;   /* the first block in address order */
    gm_runindex runs; /* runs of general space, page use (runindex.h) */

    gm_owner **owners; /* owners[0] is the general heap's GM_STREAM_ANY */
    size_t n_owners, cap_owners;
    gm_owner *last_owner; /* one-entry cache for the common single-stream case */
    /* Owners by (pool, stream): open addressing, at most half full; and when
     * to drop the owners no block needs any more (owners_trim). */
    gm_owner **owner_tab;
    size_t owner_tab_mask, owners_trim_at;
    uint64_t retired_safe_seq; /* the highest safe_seq of an owner dropped so far */
    /* A device synchronisation hands every free block to every stream.  When
     * the blocks it hands over all belong to one stream, they stay where they
     * are instead of moving one by one: the epoch advances, and a free block
     * of that stream from an earlier epoch is everyone's (h_free_owner).
     * lazy_stream names that stream (GM_STREAM_ANY: no such block exists).
     * Only that stream can tell where the blocks sit -- it searches its own
     * index and everyone's alike -- so they move into everyone's index (and
     * lazy_stream goes back to ANY) before any other stream allocates or
     * frees, and before anything else that reads owners. */
    uint64_t epoch;
    gm_stream lazy_stream;

    gm_block **live; /* live table: chained hash on addr */
    size_t live_mask, n_live;

    gm_block *pending_head, *pending_tail; /* freed blocks waiting for events, FIFO */
    size_t n_pending;

    gm_event *event_pool; /* created events not in use */
    size_t n_event_pool, cap_event_pool;

    gm_block *slab_free; /* unused block records */
    size_t n_slab_free;
    void **slab_chunks;
    size_t n_slab_chunks, cap_slab_chunks;

    uint64_t alloc_seq, free_seq;
    gm_stats st;
    size_t live_bytes; /* == st.allocated_bytes[ALL].current, kept unsigned */
    size_t peak_live;  /* since creation: the growth limit follows it */

    /* history ring */
    gm_hist_entry *hist;
    size_t hist_cap, hist_head, hist_len;
    uint64_t hist_dropped;

    int have_oom;
    gm_oom_info last_oom;

    /* private pools: living ones and ended ones that still have blocks */
    gm_pool **pools;
    size_t n_pools, cap_pools;
    size_t pool_free_bytes; /* free bytes held by living pools */
    size_t paused_pages;    /* pages of paused pools: counted as used, not held */

    /* stream capture */
    int capture_count;    /* gm_capture_begin minus gm_capture_end */
    int no_sync;          /* this operation runs during a capture: no sync/event/unmap/release */
    int handoff;          /* gm_config.stream_handoff: the slow path may hand other streams' memory over (stream.c) */
    int split;            /* gm_config.split_chunks: the slow path may split chunks live blocks use (split.c) */
    unsigned alloc_flags; /* the running allocation's GM_MALLOC_* flags */
    size_t n_deferred;    /* pending blocks whose events wait for the capture to end */

    /* fork.c */
    gm_heap *fork_next; /* registry of live heaps */
    int inherited;      /* this process is a fork()ed child of the one that made the heap */
};

/* ---- shared helpers ---- */
static inline size_t h_page_floor(const gm_heap *h, uintptr_t a) { return (size_t)((a - h->base) >> h->page_shift); }
static inline size_t h_page_ceil(const gm_heap *h, uintptr_t a) {
    return (size_t)((a - h->base + h->page - 1) >> h->page_shift);
}
static inline uintptr_t h_page_addr(const gm_heap *h, size_t p) { return h->base + ((uintptr_t)p << h->page_shift); }
/* A request of whole pages: the whole-page rules near pressure apply to it (POLICY). */
static inline int h_whole_pages(const gm_heap *h, size_t size) { return !(size & (h->page - 1)); }
/* The first page of the chunk mapped at page p, and its length. */
static inline size_t h_chunk_first(const gm_heap *h, size_t p) { return p - h->chunk_off[p]; }
static inline size_t h_chunk_end(const gm_heap *h, size_t p) { return p - h->chunk_off[p] + h->chunk_len[p]; }

/* The stream that may reuse free block b at once (GM_STREAM_ANY: every
 * stream).  Its index is its pool's owner for b->stream; a block of
 * h->lazy_stream from an earlier epoch is everyone's, though it sits there. */
static inline gm_stream h_free_owner(const gm_heap *h, const gm_block *b) {
    return b->epoch < h->epoch ? GM_STREAM_ANY : b->stream;
}
/* A block that belongs to a pool that still lives: its pages are pinned. */
static inline int h_pinned(const gm_block *b) { return b->pool && b->pool->use_count > 0; }

/* General space: what placement and defragmentation may build on -- unmapped
 * space, and free blocks of the general heap (a free block's pool always
 * lives: an ending pool's free blocks turn general).  The one place that says
 * it; the run index, placement, recycling and the checker all ask here. */
static inline int h_general_space(const gm_block *b) {
    return b->state == GM_BLOCK_UNMAPPED || (b->state == GM_BLOCK_FREE && !b->pool);
}

/* Unmapped space that no pool keeps: where the general heap grows (growth
 * edges, growth ahead). */
static inline int h_growth_space(const gm_block *b) { return b->state == GM_BLOCK_UNMAPPED && !b->pool; }

/* A block whose pages no slow path may take back: live, or kept for a living
 * pool (free, or pending to return to it).  The page-use counts (runindex.h)
 * count these. */
static inline int h_keeps_pages(const gm_block *b) {
    return b->state == GM_BLOCK_LIVE || (b->state != GM_BLOCK_UNMAPPED && h_pinned(b));
}

/* Free neighbours a and b (b = a->next) of a no_split pool, split by a page
 * where the growth that gave the pool its pages changes: they stay apart, as
 * each block of such a pool is whole pages of one growth.  Other pools' free
 * neighbours merge across growths, as an expandable segment's do: a pool
 * lives by reusing its own free memory, and apart they would serve only
 * requests that fit one of them. */
static inline int h_pool_seam(const gm_heap *h, const gm_block *a, const gm_block *b) {
    if (!a->pool || !a->pool->no_split || ((b->addr - h->base) & (h->page - 1))) return 0;
    size_t p = h_page_floor(h, b->addr);
    return p && h->page_growth[p] != h->page_growth[p - 1];
}

/* A request of the general heap that small pages serve (small.c): at most
 * half a page. */
static inline int h_small_size(const gm_heap *h, size_t size) { return 2 * size <= h->page; }
/* Free blocks a and b = a->next stay apart at the edge of a small page. */
static inline int h_small_seam(const gm_heap *h, const gm_block *a, const gm_block *b) {
    (void)a;
    if ((b->addr - h->base) & (h->page - 1)) return 0;
    size_t p = h_page_floor(h, b->addr);
    return h->small_page[p] || (p && h->small_page[p - 1]);
}
/* A free block in a small page: the fast path's for small requests only. */
static inline int h_small_free(const gm_block *b) { return b->state == GM_BLOCK_FREE && b->small; }

/* ---- run index hooks (runindex.h); no-ops on blocks that are not general space ---- */
/* Measure the run headed by `head` and index it (block.c: h_run_attach's slow half). */
void h_run_index(gm_heap *h, gm_block *head);
static inline gm_block *h_run_head(gm_block *b) {
    while (b->prev && h_general_space(b->prev)) b = b->prev;
    return b;
}
static inline void h_run_detach(gm_heap *h, gm_block *b) {
    if (!h_general_space(b)) return;
    gm_block *head = h_run_head(b);
    if (head->run_len) ri_unindex(&h->runs, head);
}
static inline void h_run_attach(gm_heap *h, gm_block *b) {
    if (!h_general_space(b)) return;
    gm_block *head = h_run_head(b);
    if (head->state == GM_BLOCK_FREE && !(head->next && h_general_space(head->next))) return; /* lone */
    h_run_index(h, head);
}
static inline void h_pages_use(gm_heap *h, const gm_block *b, int d) {
    size_t p0 = h_page_floor(h, b->addr), p1 = h_page_floor(h, b->addr + b->size - 1);
    ri_ep_block(h->runs.live_ep, p0, p1, d, &h->runs.live_pages);
    h->host_kept_stale |= h->host_pages != 0; /* h_host_kept counts again */
    if (h->runs.live_pages > h->live_peak_pages) h->live_peak_pages = h->runs.live_pages;
}

/* The owner "every stream", as the core's files write it. */
#define ANY GM_STREAM_ANY

/* A low point of live memory counts once live memory rose 1/SPILL_SWING of the
 * cap above it, a high point once it fell as much below (h_swing). */
#define SPILL_SWING 16

/* The growth tunables (policy.c, POLICY). */
#define ROOM_FAR         0.25   /* placement's whole pages, a pool's reach */
#define ROOM_CHUNK_FAR   0.0625 /* chunks */
#define ROOM_CHUNK_MIN   64
#define ROOM_CHUNK_PAGES 64
#define ROOM_AHEAD_PAGES 8
#define ROOM_SMALL_PAGES (ROOM_CHUNK_MIN - 1)
#define ROOM_SMALL_FREE  ((size_t)16 << 30) /* placement, a pool's reach */
#define ROOM_CHUNK_FREE  ((size_t)32 << 30) /* chunks */
/* A pool's growth for a request over POOL_AHEAD_MIN and under POOL_AHEAD_MAX
 * bytes places POOL_AHEAD_BYTES, as torch's segments do (policy.c). */
#define POOL_AHEAD_MIN   ((size_t)1 << 20)
#define POOL_AHEAD_MAX   ((size_t)10 << 20)
#define POOL_AHEAD_BYTES ((size_t)20 << 20)

/* A place for a request, as placement finds it (place.c). */
typedef struct placement {
    int ok;
    uintptr_t addr;
    size_t new_pages;
    size_t run;
    gm_block *first; /* the run's first block, at or before addr */
    int pooled;      /* the range takes free blocks of the requesting pool */
    int beside;      /* the range starts right after another living pool's block */
    size_t touched;  /* the pages the range touches */
} placement;

/* Pages the heap holds: mapped, spare, and in loose chunks. */
static inline size_t h_held_pages(const gm_heap *h) { return h->mapped_pages + h->n_spare + h->loose_pages; }
/* Spares, a stack: cap_spare was sized for every page the heap can hold, so a
 * push never reallocates. */
static inline void h_spare_push(gm_heap *h, gm_handle hd) {
    h_assert(h->n_spare < h->cap_spare);
    h->spare[h->n_spare++] = hd;
}
static inline gm_handle h_spare_pop(gm_heap *h) {
    h_assert(h->n_spare > 0);
    return h->spare[--h->n_spare];
}
static inline size_t h_align_up(size_t x, size_t a) { return (x + a - 1) & ~(a - 1); }
/* Everyone's owner in `pool` (NULL: the general heap). */
static inline gm_owner *h_everyones(const gm_heap *h, const gm_pool *pool) { return pool ? pool->any : h->owners[0]; }
/* A size_t of the heap (one of its fields), read under the heap's lock. */
static inline size_t h_locked_read(gm_heap *h, const size_t *field) {
    pthread_mutex_lock(&h->lock);
    size_t v = *field;
    pthread_mutex_unlock(&h->lock);
    return v;
}

/* Follow live memory's swing after it changed (spill on): while it falls,
 * the lowest point and the allocation number then; once it rises a swing above
 * that point, the point is the last low point (trough_seq). */
static inline void h_swing(gm_heap *h) {
    size_t live = h->live_bytes, t = h->cap_pages * h->page / SPILL_SWING;
    if (h->falling) {
        if (live < h->swing_lo) h->swing_lo = live, h->lo_seq = h->alloc_seq;
        if (live > h->swing_lo + t) h->falling = 0, h->trough_seq = h->lo_seq, h->swing_hi = live;
    } else {
        if (live > h->swing_hi) h->swing_hi = live;
        if (live + t < h->swing_hi) h->falling = 1, h->swing_lo = live, h->lo_seq = h->alloc_seq;
    }
}

/* ---- heap.c ---- */
gm_block *h_fit_in(gm_heap *h, size_t size, gm_stream s, gm_pool *pool);
gm_block *h_fit(gm_heap *h, size_t size, gm_stream s, gm_pool *pool, uintptr_t *at);
void h_make_live(gm_heap *h, gm_block *b, size_t size, size_t requested, gm_stream s, uint64_t context, gm_pool *p);
void h_free_block(gm_heap *h, gm_block *b);

/* ---- block.c ---- */
gm_block *h_live_find(const gm_heap *h, uintptr_t addr);
gm_owner *h_owner_find(gm_heap *h, const gm_pool *pool, gm_stream s);
int h_slab_grow(gm_heap *h);
int h_slab_reserve(gm_heap *h, size_t n);
gm_block *h_block_new(gm_heap *h);
int h_live_grow(gm_heap *h);
void h_live_insert(gm_heap *h, gm_block *b);
gm_block *h_live_remove(gm_heap *h, uintptr_t addr);
gm_owner *h_owner_get(gm_heap *h, gm_pool *pool, gm_stream s);
void h_owners_removed(gm_heap *h);
void h_owners_trim(gm_heap *h);
void h_index_insert(gm_heap *h, gm_block *b);
void h_index_remove(gm_heap *h, gm_block *b);
void h_settle_release(gm_heap *h);
int h_owners_merge(gm_stream a, gm_stream b, gm_stream *out);
int h_may_merge_free(const gm_heap *h, const gm_block *a, const gm_block *b, gm_stream *o);
gm_block *h_split(gm_heap *h, gm_block *b, size_t offset);
void h_absorb(gm_heap *h, gm_block *a, gm_block *b);
void h_merge_free(gm_heap *h, gm_block *b, gm_block *n, gm_stream o);
gm_block *h_merge_neighbours(gm_heap *h, gm_block *b);
gm_block *h_make_free(gm_heap *h, gm_block *b, gm_stream owner, uint64_t seq);
gm_block *h_make_unmapped(gm_heap *h, gm_block *b);
void h_coalesce_all(gm_heap *h);

/* ---- stream.c ---- */
void h_event_put(gm_heap *h, gm_event ev);
int h_event_record(gm_heap *h, gm_stream s, gm_event *ev);
void h_pending_append(gm_heap *h, gm_block *b);
void h_complete_free(gm_heap *h, gm_block *b);
size_t h_process_pending(gm_heap *h, int synced);
size_t h_release_owners(gm_heap *h, gm_stream requester, int synced);
size_t h_release_idle(gm_heap *h);
size_t h_stream_handoff(gm_heap *h, gm_stream s, gm_pool *pool, size_t size);
int h_synchronize(gm_heap *h, gm_stream requester);

/* ---- page.c ---- */
int h_create_chunk(gm_heap *h, size_t k, gm_handle *hd, int *dev_err);
void h_release_chunk(gm_heap *h, gm_handle hd, size_t k);
void h_chunk_set(gm_heap *h, size_t p0, size_t k, gm_handle hd, int host);
void h_chunk_clear(gm_heap *h, size_t p0, size_t k);
void h_chunk_unused(gm_heap *h, gm_handle hd, size_t k);
int h_unmap_pages(gm_heap *h, gm_block *b, size_t p0, size_t p1, int restock);
void h_cut_unmapped(gm_heap *h, gm_block *b, size_t p0, size_t p1, int host);
int h_unmap_chunk(gm_heap *h, size_t p, int restock);
void h_grow(gm_heap *h, size_t want, size_t limit, size_t *grant, int *dev_err);
size_t h_map_fresh(gm_heap *h, size_t p0, size_t p1, size_t most, size_t *grant, int *err);
size_t h_map_interior(gm_heap *h, size_t p0, size_t p1, size_t r0, size_t r1, size_t most, size_t *grant, int *err);
int h_release_spares(gm_heap *h, size_t target);
size_t h_recycle(gm_heap *h, size_t want, size_t ex0, size_t ex1, int restock);
size_t h_gap_locked(const gm_heap *h, size_t g0, size_t g1, int device);
size_t h_chunk_locked(const gm_heap *h, size_t ex0, size_t ex1, int device);
size_t h_cached_pages(gm_heap *h, size_t ex0, size_t ex1);
size_t h_cached_pages_outside(gm_heap *h, placement pl, size_t size);

/* ---- policy.c ---- */
int h_near_pressure(gm_heap *h);
size_t h_pool_reach(gm_heap *h, const gm_pool *pool, size_t size);
size_t h_grow_by_policy(gm_heap *h, const placement *pl, size_t size, gm_pool *pool, size_t need, size_t *grant,
                        size_t **g, size_t *most, int single, int *dev_err);

/* ---- place.c ---- */
gm_block *h_block_holding(gm_block *b, uintptr_t x);
void h_stamp_pool_growth(gm_heap *h, const placement *pl, size_t size, gm_pool *pool);
placement h_place_within(gm_heap *h, size_t size, gm_stream s, gm_pool *pool, size_t budget);
placement h_place(gm_heap *h, size_t size, gm_stream s, gm_pool *pool);
void h_unpark(gm_heap *h);
gm_block *h_back_range(gm_heap *h, const placement *pl, size_t size, gm_stream s, gm_pool *pool, int remap, size_t most,
                       size_t *grant, int *err);

/* ---- slow.c ---- */
int h_out_of_memory(gm_heap *h, size_t size, gm_stream s, size_t short_pages, int dev_err);
int h_alloc_slow(gm_heap *h, size_t size, gm_stream s, gm_pool *pool, gm_block **out, uintptr_t *at, uintptr_t *reach);

/* ---- small.c ---- */
gm_block *h_small_fit(gm_heap *h, size_t size, gm_stream s);
gm_block *h_small_after_slow(gm_heap *h, gm_block *b, uintptr_t at, size_t size);
void h_small_live(gm_heap *h, const gm_block *b);
gm_block *h_small_freed(gm_heap *h, gm_block *b, uintptr_t x);

/* ---- spill.c ---- */
void h_host_release(gm_heap *h, gm_handle hd, size_t k);
int h_spill(gm_heap *h, size_t size, gm_stream s, size_t short_pages, int *moved, gm_block **out, uintptr_t *at);
int h_unspill(gm_heap *h);
void h_spill_after_free(gm_heap *h, gm_stream s, int touched_host);
size_t h_host_kept(gm_heap *h);
void h_spill_demand_reset(gm_heap *h);
size_t h_host_kept_count(const gm_heap *h);
void h_spill_free(gm_heap *h);
void h_spill_idle(gm_heap *h, gm_stream s);
/* The scratch range, an unmap asked again, the wait for copies, and a chunk
 * mapped back after a failed move: spill's, which split.c shares. */
int h_scratch_get(gm_heap *h, size_t k, uintptr_t *va);
int h_unmap_retry(gm_heap *h, uintptr_t va, size_t k);
int h_copies_wait(gm_heap *h);
int h_map_back(gm_heap *h, size_t p, size_t k, gm_handle hd);
/* Whether block b touches a host page (spill.c): its first or last page. */
static inline int h_on_host(const gm_heap *h, const gm_block *b) {
    return h->host[h_page_floor(h, b->addr)] || h->host[h_page_floor(h, b->addr + b->size - 1)];
}

/* ---- split.c ---- */
/* After a device wait: split chunks of several pages whose free pages are
 * locked, the most free first, until `want` pages are freed (as single
 * spares).  Returns the pages freed; *rc the failure that stopped it
 * (GM_ECORRUPT: a chunk could not be mapped again). */
size_t h_split_chunks(gm_heap *h, size_t want, int *rc);
/* The locked pages splits could free, with `room` pages to copy into (new
 * ones under the cap, spares and cached pages). */
size_t h_split_gain(gm_heap *h, size_t room);

/* ---- report.c ---- */
size_t h_used_pages(gm_heap *h);
void h_fill_report(gm_heap *h, size_t size, gm_stream s, gm_oom_info *o);

/* ---- capture.c ---- */
int h_capture_on(gm_heap *h, gm_stream s);
void h_record_uses(gm_heap *h, gm_block *b);
int h_other_capture(gm_heap *h);

/* ---- pool.c ---- */
gm_pool *h_pool_find(const gm_heap *h, const gm_pool_id *id);
void h_pool_delete(gm_heap *h, gm_pool *p);
int h_valid_id(const gm_pool_id *id);

/* ---- fork.c ---- */
void h_fork_register(gm_heap *h);
void h_fork_unregister(gm_heap *h);
int h_heap_inherited(const gm_heap *h);

/* ---- stats.c ---- */
static inline void h_stat_add(gm_stat *s, int64_t delta) {
    s->current += delta;
    if (delta > 0) {
        s->allocated += delta;
        if (s->current > s->peak) s->peak = s->current;
    } else {
        s->freed -= delta;
    }
}
static inline int h_pool_of(size_t size) { return size <= GM_SMALL_SIZE ? GM_POOL_SMALL : GM_POOL_LARGE; }
static inline void h_stat_pool_add(gm_stat *arr, size_t size, int64_t delta) {
    h_stat_add(&arr[GM_POOL_ALL], delta);
    h_stat_add(&arr[h_pool_of(size)], delta);
}
/* The hot paths know the sign: no branch on it. */
static inline void h_stat_up(gm_stat *arr, int pool, int64_t n) {
    gm_stat *a = &arr[GM_POOL_ALL], *p = &arr[pool];
    a->current += n, a->allocated += n, p->current += n, p->allocated += n;
    if (a->current > a->peak) a->peak = a->current;
    if (p->current > p->peak) p->peak = p->current;
}
static inline void h_stat_down(gm_stat *arr, int pool, int64_t n) {
    gm_stat *a = &arr[GM_POOL_ALL], *p = &arr[pool];
    a->current -= n, a->freed += n, p->current -= n, p->freed += n;
}
void h_stats_reset_peaks(gm_stats *st);
void h_stats_reset_accumulated(gm_stats *st);

/* ---- history.c ---- */
void h_hist_push(gm_heap *h, uint32_t action, uintptr_t addr, size_t size, size_t requested, gm_stream stream,
                 uint64_t context);
static inline void h_hist(gm_heap *h, uint32_t action, uintptr_t addr, size_t size, gm_stream stream,
                          uint64_t context) {
    if (h->hist_cap) h_hist_push(h, action, addr, size, size, stream, context);
}
/* A block's event: its size and the bytes its request asked for (torch's history records those). */
static inline void h_hist_block(gm_heap *h, uint32_t action, uintptr_t addr, size_t size, size_t requested,
                                gm_stream stream, uint64_t context) {
    if (h->hist_cap) h_hist_push(h, action, addr, size, requested, stream, context);
}
void h_hist_free(gm_heap *h);

#endif
