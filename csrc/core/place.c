/*
 * place.c -- placement: where a request needs the fewest new pages, over
 * the runs of general space the run index lists (heap.c, THE PATHS, step 2),
 * and backing the chosen range with blocks and pages.
 *
 * Calls: block.c (splitting, merging, the free indexes), page.c (mapping),
 * policy.c (whether the heap is near pressure), heap.c (the fast path's fit,
 * for a pool's own free blocks).
 */
#include <string.h>

#include "heap_internal.h"

/* ---- placement --------------------------------------------------------------------- */

/* Pages in [x, x+size) with nothing mapped, walking from `first` (a block at
 * or before x); *pooled: whether a pool's free block lies in the range. */
static size_t unmapped_in(const gm_heap *h, const gm_block *first, uintptr_t x, size_t size, int *pooled) {
    size_t pages = 0;
    uintptr_t end = x + size;
    *pooled = 0;
    for (const gm_block *b = first; b && b->addr < end; b = b->next) {
        if (b->addr + b->size <= x) continue;
        if (b->pool) *pooled = 1;
        if (b->state != GM_BLOCK_UNMAPPED) continue;
        uintptr_t lo = b->addr > x ? b->addr : x, hi = b->addr + b->size < end ? b->addr + b->size : end;
        pages += h_page_ceil(h, hi) - h_page_floor(h, lo);
    }
    return pages;
}

/* Fewest new pages first; then, for a request of whole pages near pressure
 * (h_near_pressure), the fewest pages touched: such a block placed right
 * after one that ends inside a page touches one page more than it needs, and
 * leaves two partly used pages when it goes, which no defragmentation takes
 * back (POLICY); then, for a pool's request, a range that takes the
 * pool's free memory (which serves nothing else) over one that takes only
 * general memory; then a range that leaves the space after the blocks of
 * other living pools (for the general heap: of every living pool) to them;
 * then the shortest run; then the lowest address.  One exception: a pool's
 * request takes the best range over the pool's free memory when that needs
 * at most POOL_EDGE_PAGES more new pages than the best range elsewhere.
 *
 * Why: a pool's blocks hold their pages for as long as the pool lives, so a
 * pool grows only at its edges.  A CUDA graph recorded at a larger shape
 * needs its pool's free memory extended, and one small block of anyone
 * else's just after the pool's last block would leave that free memory
 * stranded and the larger graph all-new memory; so would the pool starting a
 * second region elsewhere to save the page that a general block's leftover
 * saves.  With a pool's pages its own (claim_pool_pages), the general heap's growth
 * goes elsewhere in the address space (there is 4x the device's memory of
 * it), and each pool grows at its end as one segment of its own would. */
#define POOL_EDGE_PAGES 1

struct place_ctx {
    gm_heap *h;
    size_t size;
    gm_stream s;
    gm_pool *pool; /* the requesting pool, or NULL */
    size_t budget; /* see consider_at */
    int whole;     /* whole pages, near pressure: the fewest pages touched first (ranks_before) */
    placement best;
    placement best_pooled; /* the best that takes the pool's free memory */
};

static int ranks_before(const placement *a, const placement *b) {
    if (!b->ok || a->new_pages != b->new_pages) return !b->ok || a->new_pages < b->new_pages;
    if (a->touched != b->touched) return a->touched < b->touched;
    if (a->pooled != b->pooled) return a->pooled > b->pooled;
    if (a->beside != b->beside) return a->beside < b->beside;
    return a->run < b->run || (a->run == b->run && a->addr < b->addr);
}

/* Whether pages [q0, q1) are all the pool's already: a page that a block of
 * a living pool starts holds only that pool's blocks.  b: any block before. */
static int pools_pages(const struct place_ctx *c, gm_block *b, size_t q0, size_t q1) {
    for (size_t q = q0; q < q1; q++) {
        b = h_block_holding(b, h_page_addr(c->h, q));
        if (b->pool != c->pool) return 0;
    }
    return 1;
}

/* A pool's request takes pages of its own: [x, x+size) starts a page, and
 * what else its last page holds is the pool's or general space the stream
 * may use (claim_pool_pages makes it the pool's).  So no page holds blocks
 * of a living pool and anything else. */
static int pool_pages_ok(const struct place_ctx *c, gm_block *first, uintptr_t x) {
    uintptr_t end = x + c->size, e = h_page_addr(c->h, h_page_ceil(c->h, end));
    if ((x - c->h->base) & (c->h->page - 1)) return 0;
    /* No page of a physical allocation the policy made with room (POLICY;
     * with chunk_pages 1 every larger one is its) that the range does not
     * wholly take, unless the pool holds the rest of it already: it goes
     * back only whole, and a segment as torch counts them is one pool's. */
    size_t p0 = h_page_floor(c->h, x), p1 = h_page_ceil(c->h, end);
    for (size_t p = p0; p < p1 && c->h->chunk_pages == 1; p++) {
        if (c->h->chunk_len[p] <= 1) continue;
        size_t q0 = h_chunk_first(c->h, p), q1 = h_chunk_end(c->h, p);
        if ((q0 < p0 && !pools_pages(c, first, q0, p0)) || (q1 > p1 && !pools_pages(c, first, p1, q1))) return 0;
        p = q1 - 1;
    }
    for (size_t p = p0; p < p1 && c->h->host_pages; p++) /* a pool's pages are the device's (spill.c) */
        if (c->h->host[p]) return 0;
    for (const gm_block *b = first; b && b->addr < e; b = b->next) {
        if (b->addr + b->size <= end || b->pool == c->pool) continue;
        if (!h_general_space(b) || (b->state == GM_BLOCK_FREE && b->stream != c->s && b->stream != ANY)) return 0;
    }
    return 1;
}

/* The candidate [x, x+size) in a run of `len` bytes that starts at `first`.
 * With a `budget` (pages at hand; SIZE_MAX: none), a candidate that needs
 * more than those and the cached pages that could move to it is left out.
 * A pool's candidate inside a page moves to the page boundaries around it
 * that keep it in the run (pool_pages_ok). */
static void consider_at(struct place_ctx *c, gm_block *first, uintptr_t x, size_t len) {
    size_t off = (x - c->h->base) & (c->h->page - 1);
    if (c->pool && off) {
        if (x - off >= first->addr) consider_at(c, first, x - off, len);
        if (x - off + c->h->page + c->size <= first->addr + len) consider_at(c, first, x - off + c->h->page, len);
        return;
    }
    if (c->pool && !pool_pages_ok(c, first, x)) return;
    placement p = {1, x, 0, len, first, 0, 0, 0};
    if (c->whole) p.touched = h_page_ceil(c->h, x + c->size) - h_page_floor(c->h, x);
    p.new_pages = unmapped_in(c->h, first, x, c->size, &p.pooled);
    if (p.new_pages > c->budget && p.new_pages - c->budget > h_cached_pages_outside(c->h, p, c->size)) return;
    /* Inside the run, the block before x is general space or the pool's own. */
    p.beside = x == first->addr && first->prev && h_pinned(first->prev) && first->prev->pool != c->pool;
    if (ranks_before(&p, &c->best)) c->best = p;
    if (p.pooled && ranks_before(&p, &c->best_pooled)) c->best_pooled = p;
}

static void consider(struct place_ctx *c, gm_block *first, uintptr_t start, size_t len) {
    consider_at(c, first, start, len);
    if (len != c->size) consider_at(c, first, start + len - c->size, len);
    if (c->budget == SIZE_MAX) return;
    /* With a budget (the slow path's last placement, around pages that cannot
     * move): also from the start and to the end of each stretch of mapped
     * free blocks inside the run.  Free pages of a chunk a block still uses,
     * and free host pages, serve only where they lie, and such a stretch can
     * have unmapped space on both sides (the OOM report's largest_possible
     * counts these ranges). */
    uintptr_t end = start + len;
    for (gm_block *b = first; b && b->addr < end; b = b->next) {
        if (b->state == GM_BLOCK_UNMAPPED) continue;
        gm_block *e = b; /* b starts a stretch (the loop goes on after it), e ends it */
        while (e->next && e->next->addr < end && e->next->state != GM_BLOCK_UNMAPPED) e = e->next;
        uintptr_t lo = b->addr, hi = e->addr + e->size;
        if (lo != start && lo + c->size <= end) consider_at(c, first, lo, len);
        if (hi != end && hi >= start + c->size) consider_at(c, first, hi - c->size, len);
        b = e;
    }
}

/* The runs that stream s may use inside one run of general space: its own or
 * everyone's free blocks of the general heap (never a pool's: those are not
 * general space), and unmapped space. */
static void place_in(struct place_ctx *c, gm_block *head, uintptr_t end) {
    gm_block *first = NULL;
    size_t len = 0;
    for (gm_block *b = head;; b = b->next) {
        int in = b && b->addr < end;
        if (in && h_general_space(b) && !h_small_free(b) &&
            (b->state == GM_BLOCK_UNMAPPED || b->stream == c->s || b->stream == ANY)) {
            if (!first) {
                first = b;
                len = 0;
            }
            len += b->size;
            continue;
        }
        if (first && len >= c->size) consider(c, first, first->addr, len);
        first = NULL;
        if (!in) return;
    }
}

static int place_in_run(gm_block *head, void *arg) {
    place_in(arg, head, head->addr + head->run_len);
    return 0;
}

/* A block an allocation in c->pool on c->s may build on: general space the
 * stream may use, or a free block of that pool the stream may use. */
static int usable(const struct place_ctx *c, const gm_block *b) {
    if (b->state == GM_BLOCK_UNMAPPED) return 1;
    if (b->state != GM_BLOCK_FREE || (b->pool && b->pool != c->pool) || h_small_free(b)) return 0;
    return b->stream == c->s || b->stream == ANY;
}

/* One of the pool's free blocks that c->s may use: the run of usable blocks
 * around it (general space and the pool's free blocks together) is a place
 * to build on.  The first such pool block of each run measures the run;
 * candidates are the run's ends and, so that the pool's mapped memory is
 * extended rather than left behind, each of its pool blocks' two ends. */
static int place_pooled_one(gm_block *b, void *arg) {
    struct place_ctx *c = arg;
    gm_block *first = b;
    while (first->prev && usable(c, first->prev)) {
        first = first->prev;
        if (first->pool) return 0; /* an earlier pool block measures this run */
    }
    size_t len = 0;
    for (const gm_block *x = first; x && usable(c, x); x = x->next) len += x->size;
    if (len < c->size) return 0;
    uintptr_t lo = first->addr, hi = first->addr + len;
    consider(c, first, lo, len);
    for (gm_block *x = b; x && x->addr < hi; x = x->next) {
        if (!x->pool) continue;
        if (x->addr + c->size <= hi) consider_at(c, first, x->addr, len);
        if (x->addr + x->size >= lo + c->size) consider_at(c, first, x->addr + x->size - c->size, len);
    }
    return 0;
}

static void place_pooled(struct place_ctx *c) {
    gm_owner *own = h_owner_find(c->h, c->pool, c->s);
    if (own) fi_each(&own->idx, place_pooled_one, c);
    fi_each(&c->pool->any->idx, place_pooled_one, c);
}

/* Where [addr, addr+size) ranks first (ranks_before, and a pool's edge
 * within POOL_EDGE_PAGES), among runs of memory that stream s may use and,
 * with a `budget`, that the pages at hand can back (consider_at): a total
 * order, so the runs may be visited in any order, and only runs of general
 * space at least `size` long can hold one. */
placement h_place_within(gm_heap *h, size_t size, gm_stream s, gm_pool *pool, size_t budget) {
    struct place_ctx c = {h, size, s, pool, budget, 0, {0}, {0}};
    c.whole = !pool && h_whole_pages(h, size) && h_near_pressure(h);
    /* Lone free blocks are not in the run index; the slow path gets here when
     * none that s may use fits, except after a synchronisation.  Then the best
     * fit is the best of them if it is lone itself; if not, walk everything. */
    gm_block *f = h_fit_in(h, size, s, NULL);
    if (f && ((f->prev && h_general_space(f->prev)) || (f->next && h_general_space(f->next)))) {
        place_in(&c, h->head, h->base + h->va_size);
    } else {
        ri_each_at_least(&h->runs, size, place_in_run, &c);
        if (f) consider(&c, f, f->addr, f->size);
    }
    if (pool) place_pooled(&c);
    if (c.best_pooled.ok && c.best_pooled.new_pages <= c.best.new_pages + POOL_EDGE_PAGES) return c.best_pooled;
    return c.best;
}

placement h_place(gm_heap *h, size_t size, gm_stream s, gm_pool *pool) {
    return h_place_within(h, size, s, pool, SIZE_MAX);
}

/* Grant access to freshly mapped pages [p0, *p1), whole chunks.  If that
 * fails, unmap them again chunk by chunk from the top (single pages become
 * spares, larger chunks are released) and lower *p1 to what is left:
 * a page that is mapped but inaccessible must never back a block.  Failing
 * calls are retried a few times, so that only a device that keeps failing can
 * leave pages behind, and then they are mapped and accessible. */
static int grant_or_take_back(gm_heap *h, size_t p0, size_t *p1) {
    int rc = h->dev->ops->set_access(h->dev, h_page_addr(h, p0), (*p1 - p0) * h->page);
    if (!rc) return GM_OK;
    h->st.num_device_errors++;
    int granted = 0;
    for (int attempt = 0; attempt < 8 && *p1 > p0 && !granted; attempt++) {
        /* During a capture nothing may be unmapped: only ask again. */
        while (*p1 > p0 && !h->no_sync) {
            size_t q = h_chunk_first(h, *p1 - 1); /* a whole chunk: all mapped here, after p0 */
            if (h_unmap_chunk(h, q, 0)) break;
            *p1 = q;
        }
        granted = *p1 > p0 && h->dev->ops->set_access(h->dev, h_page_addr(h, p0), (*p1 - p0) * h->page) == GM_OK;
    }
    if (!granted && *p1 > p0) {
        /* Still mapped, still inaccessible, and they could not go (a capture,
         * or a device that refuses the unmap too): park them, out of every
         * block's reach, until h_unpark() can unmap them. */
        memset(h->parked + p0, 1, *p1 - p0);
        h->n_parked += *p1 - p0;
        *p1 = p0;
    }
    return rc;
}

/* Unmap the parked pages (see gm_heap.parked), whole chunks at a time, when
 * no capture is on.  A chunk that will not unmap stays parked. */
void h_unpark(gm_heap *h) {
    for (size_t p = 0; p < h->n_pages && h->n_parked; p++) {
        if (!h->parked[p] || h->chunk_off[p]) continue;
        size_t k = h->chunk_len[p];
        if (h_unmap_chunk(h, p, 0)) continue;
        memset(h->parked + p, 0, k);
        h->n_parked -= k;
    }
}

/* The block that holds address x (inside the reserved range), walking from b. */
gm_block *h_block_holding(gm_block *b, uintptr_t x) {
    while (b->addr > x) b = b->prev;
    while (b->addr + b->size <= x) b = b->next;
    return b;
}

/* A pool's placement pl gets a growth of its own: the pages under it that
 * are not the pool's yet (a pool's free block starts each page of the pool's
 * it takes) are numbered with the new growth, as the pages mapped for it are. */
void h_stamp_pool_growth(gm_heap *h, const placement *pl, size_t size, gm_pool *pool) {
    gm_block *b = pl->first;
    for (size_t p = h_page_floor(h, pl->addr); p < h_page_ceil(h, pl->addr + size); p++) {
        b = h_block_holding(b, h_page_addr(h, p));
        if (b->pool != pool) h->page_growth[p] = h->growth_seq;
    }
}

/* The free blocks of a pool under [x, end) become general free space, same
 * owner (the parts outside the range stay the pool's): they stop keeping
 * their pages, which the block carved from the range keeps again.  b is a
 * block at or before x.  The caller keeps the runs out of the run index. */
static void pool_blocks_to_general(gm_heap *h, gm_block *b, uintptr_t x, uintptr_t end) {
    for (b = h_block_holding(b, x); b && b->addr < end; b = b->next) {
        if (b->state != GM_BLOCK_FREE || !b->pool) continue;
        h_index_remove(h, b);
        if (b->addr < x) {
            gm_block *r = h_split(h, b, x - b->addr);
            h_index_insert(h, b);
            b = r;
        }
        if (b->addr + b->size > end) h_index_insert(h, h_split(h, b, end - b->addr));
        h_pages_use(h, b, -1);
        b->pool = NULL;
        h_index_insert(h, b);
    }
}

/* Map every unmapped page under [x, x+size) with spare pages, then new chunks
 * *grant allows (map_fresh), and make the range one free block owned by s:
 * general space, after the free blocks of `pool` (if any) under it join it.
 * Returns that block, or NULL on a device error (pages mapped so far stay
 * mapped and free, the pool's blocks stay the pool's: nothing is lost). */
static gm_block *back_range_in_run(gm_heap *h, gm_block *from, uintptr_t x, size_t size, gm_stream s, gm_pool *pool,
                                   int remap, size_t most, size_t *grant, int *err) {
    gm_block *b = h_block_holding(from, x);
    uintptr_t end = x + size;
    size_t cuts = 4;
    for (gm_block *c = b; c && c->addr < end; c = c->next) cuts += 2 * (c->state == GM_BLOCK_UNMAPPED);
    if (h_slab_reserve(h, cuts)) {
        *err = GM_ENOMEM;
        return NULL;
    }
    while (b && b->addr < end) {
        if (b->state != GM_BLOCK_UNMAPPED) {
            b = b->next;
            continue;
        }
        uintptr_t lo = b->addr > x ? b->addr : x, hi = b->addr + b->size < end ? b->addr + b->size : end;
        size_t p0 = h_page_floor(h, lo), p1 = h_page_ceil(h, hi);
        int rc = GM_OK;
        size_t p = most > h->chunk_pages && most >= ROOM_CHUNK_MIN
                       ? h_map_interior(h, p0, p1, h_page_floor(h, x), h_page_ceil(h, end), most, grant, &rc)
                       : h_map_fresh(h, p0, p1, most, grant, &rc);
        if (p > p0) {
            int arc = grant_or_take_back(h, p0, &p);
            if (!rc) rc = arc;
            for (size_t q = p0; q < p; q++) h->page_growth[q] = h->growth_seq;
        }
        if (rc) *err = rc;
        if (p > p0) {
            /* Cut b into [unmapped][free p0..p)[unmapped]. */
            uintptr_t a0 = h_page_addr(h, p0), a1 = h_page_addr(h, p);
            gm_block *mid = b;
            if (a0 > b->addr) mid = h_split(h, b, a0 - b->addr);
            gm_block *rest = NULL;
            if (mid->addr + mid->size > a1) rest = h_split(h, mid, a1 - mid->addr);
            h_hist(h, remap ? GM_H_REMAP : GM_H_MAP, a0, a1 - a0, s, 0);
            mid = h_make_free(h, mid, s, 0);
            b = rest ? rest : mid->next;
        } else {
            b = b->next;
        }
        if (rc) return NULL;
    }
    /* The range is now free; merge what ownership kept apart (s and ANY only).
     * `from` is still a block: it starts a run that s may use, so it never
     * merges into the block before it, and merges keep the lower record. */
    if (pool) pool_blocks_to_general(h, from, x, end);
    b = h_block_holding(from, x);
    while (b->addr + b->size < end) {
        gm_block *n = b->next;
        gm_stream o;
        if (b->state != GM_BLOCK_FREE || n->state != GM_BLOCK_FREE || !h_owners_merge(b->stream, n->stream, &o))
            return NULL; /* cannot happen: h_place() only chose usable runs */
        h_merge_free(h, b, n, o);
    }
    return b->state == GM_BLOCK_FREE ? b : NULL;
}

/* Back placement pl.  A range in one run of general space: that run is out of
 * the run index while it changes (`from` survives every change, see above).
 * A range that takes free blocks of `pool` joins runs on either side of them:
 * every run the range and its two neighbours are in is out meanwhile (`lo`,
 * the block before the range's first, survives: merges keep lower records). */
gm_block *h_back_range(gm_heap *h, const placement *pl, size_t size, gm_stream s, gm_pool *pool, int remap, size_t most,
                       size_t *grant, int *err) {
    gm_block *from = pl->first;
    if (!pl->pooled) {
        if (from->pool) {
            /* A run with pool blocks, but none under the range: start from the
             * general block after the last pool block before it. */
            gm_block *b = h_block_holding(from, pl->addr);
            while (!b->prev->pool) b = b->prev;
            from = b;
        }
        h_run_detach(h, from);
        gm_block *b = back_range_in_run(h, from, pl->addr, size, s, NULL, remap, most, grant, err);
        h_run_attach(h, from);
        return b;
    }
    uintptr_t end = pl->addr + size;
    gm_block *lo = h_block_holding(from, pl->addr);
    if (lo->prev) lo = lo->prev;
    for (gm_block *b = lo; b && b->addr <= end; b = b->next) h_run_detach(h, b);
    gm_block *r = back_range_in_run(h, from, pl->addr, size, s, pool, remap, most, grant, err);
    for (gm_block *b = lo; b && b->addr <= end; b = b->next)
        if (h_general_space(b) && !h_run_head(b)->run_len) h_run_attach(h, b);
    return r;
}
