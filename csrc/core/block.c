/*
 * block.c -- block records and the structures that find them: the slab of
 * records, the live table (address -> live block), owners and their free
 * indexes (freeindex.h), and splitting and merging blocks (the run index's
 * hooks, runindex.h, follow every change).  The heap's drawing is in heap.c.
 *
 * Calls: the free index, the run index; nothing else in the heap.
 */
#include <stdlib.h>
#include <string.h>

#include "gpumem/array.h"
#include "heap_internal.h"

/* ---- block records ------------------------------------------------------- */

int h_slab_grow(gm_heap *h) {
    enum {
        CHUNK = 512
    };
    if (h->n_slab_chunks == h->cap_slab_chunks) {
        void **c = gm_array_grow(h->slab_chunks, &h->cap_slab_chunks, 16, sizeof *c);
        if (!c) return GM_ENOMEM;
        h->slab_chunks = c;
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
int h_slab_reserve(gm_heap *h, size_t n) {
    while (h->n_slab_free < n)
        if (h_slab_grow(h)) return GM_ENOMEM;
    return GM_OK;
}

gm_block *h_block_new(gm_heap *h) {
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

/* ---- the run index's hooks ------------------------------------------------ */

void h_run_index(gm_heap *h, gm_block *head) {
    size_t len = 0;
    for (const gm_block *c = head; c && h_general_space(c); c = c->next) len += c->size;
    ri_index(&h->runs, head, len);
}

/* ---- live table ---------------------------------------------------------- */

static inline size_t live_slot(const gm_heap *h, uintptr_t addr) {
    return (size_t)((((uint64_t)addr >> 9) * 0x9E3779B97F4A7C15ull) >> 32) & h->live_mask;
}

int h_live_grow(gm_heap *h) {
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

void h_live_insert(gm_heap *h, gm_block *b) {
    h_assert(b->state == GM_BLOCK_LIVE && !h_live_find(h, b->addr));
    size_t s = live_slot(h, b->addr);
    b->hnext = h->live[s];
    h->live[s] = b;
    h->n_live++;
}

gm_block *h_live_find(const gm_heap *h, uintptr_t addr) {
    for (gm_block *b = h->live[live_slot(h, addr)]; b; b = b->hnext)
        if (b->addr == addr) return b;
    return NULL;
}

gm_block *h_live_remove(gm_heap *h, uintptr_t addr) {
    gm_block **p = &h->live[live_slot(h, addr)];
    for (; *p; p = &(*p)->hnext) {
        if ((*p)->addr == addr) {
            gm_block *b = *p;
            h_assert(b->state == GM_BLOCK_LIVE && h->n_live > 0);
            *p = b->hnext;
            b->hnext = NULL;
            h->n_live--;
            return b;
        }
    }
    return NULL;
}

/* ---- owners and the free index -------------------------------------------
 * An owner (a stream's free memory in one pool) is found through a hash table
 * on (pool, stream), and dropped once no block needs it: owners_trim runs
 * before a malloc makes owners when their number has doubled since the last
 * trim, so a program that uses many streams one after another keeps only the
 * owners of streams that still have blocks, at O(1) amortised per owner. */

static size_t owner_slot(const gm_heap *h, const gm_pool *pool, gm_stream s) {
    uint64_t x = (uint64_t)s * 0x9e3779b97f4a7c15ull ^ (uint64_t)(uintptr_t)pool * 0xc2b2ae3d27d4eb4full;
    x ^= x >> 29;
    return (size_t)x & h->owner_tab_mask;
}

gm_owner *h_owner_find(gm_heap *h, const gm_pool *pool, gm_stream s) {
    if (h->last_owner && h->last_owner->stream == s && h->last_owner->pool == pool) return h->last_owner;
    if (!h->owner_tab) return NULL;
    for (size_t j = owner_slot(h, pool, s);; j = (j + 1) & h->owner_tab_mask) {
        gm_owner *o = h->owner_tab[j];
        if (!o) return NULL;
        if (o->stream == s && o->pool == pool) {
            h->last_owner = o;
            return o;
        }
    }
}

static void owner_tab_put(gm_heap *h, gm_owner *o) {
    size_t j = owner_slot(h, o->pool, o->stream);
    while (h->owner_tab[j]) j = (j + 1) & h->owner_tab_mask;
    h->owner_tab[j] = o;
}

/* Rebuild the table for h->owners, `need` owners at most: sized so that it
 * stays at most half full.  0, or -1 on host OOM (the old table stays). */
static int owner_tab_build(gm_heap *h, size_t need) {
    size_t cap = 16;
    while (cap < 2 * need) cap *= 2;
    gm_owner **t = calloc(cap, sizeof *t);
    if (!t) return -1;
    free(h->owner_tab);
    h->owner_tab = t;
    h->owner_tab_mask = cap - 1;
    for (size_t i = 0; i < h->n_owners; i++) owner_tab_put(h, h->owners[i]);
    return 0;
}

gm_owner *h_owner_get(gm_heap *h, gm_pool *pool, gm_stream s) {
    gm_owner *o = h_owner_find(h, pool, s);
    if (o) return o;
    if (h->n_owners == h->cap_owners) {
        gm_owner **a = gm_array_grow(h->owners, &h->cap_owners, 4, sizeof *a);
        if (!a) return NULL;
        h->owners = a;
    }
    if (!h->owner_tab || 2 * (h->n_owners + 1) > h->owner_tab_mask + 1) {
        if (owner_tab_build(h, h->n_owners + 1)) return NULL;
    }
    if (!(o = calloc(1, sizeof *o))) return NULL;
    o->pool = pool;
    o->stream = s;
    fi_init(&o->idx);
    h->owners[h->n_owners++] = o;
    owner_tab_put(h, o);
    return o;
}

/* Owners[] lost some entries (a pool ended, a trim): the table follows.  A
 * smaller table needs no memory it lacks; on host OOM keep the old size. */
void h_owners_removed(gm_heap *h) {
    h->last_owner = NULL;
    if (owner_tab_build(h, h->n_owners)) {
        memset(h->owner_tab, 0, (h->owner_tab_mask + 1) * sizeof *h->owner_tab);
        for (size_t i = 0; i < h->n_owners; i++) owner_tab_put(h, h->owners[i]);
    }
}

static void owner_keep(gm_heap *h, const gm_pool *pool, gm_stream s) {
    gm_owner *o = h_owner_find(h, pool, s);
    if (o) o->keep = 1;
}

/* Drop the owners no block needs: those of a stream other than ANY with no
 * free block in their index, no release in flight, and no live or pending
 * block of their stream that would become free into them (in their pool, or
 * in the general heap when the pool ends first).  What they proved stays
 * known to the checker as retired_safe_seq.  Only between operations on
 * owners: no owner pointer may be held across it. */
void h_owners_trim(gm_heap *h) {
    for (size_t i = 0; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        o->keep = i == 0 || o->stream == ANY || o->idx.count || o->releasing || o->stream == h->lazy_stream;
    }
    for (gm_block *b = h->head; b; b = b->next) {
        if (b->state != GM_BLOCK_LIVE && b->state != GM_BLOCK_PENDING) continue;
        owner_keep(h, b->pool, b->stream);
        if (b->pool) owner_keep(h, NULL, b->stream);
    }
    size_t k = 0;
    for (size_t i = 0; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        if (o->keep) {
            h->owners[k++] = o;
            continue;
        }
        if (o->safe_seq > h->retired_safe_seq) h->retired_safe_seq = o->safe_seq;
        free(o);
    }
    if (k < h->n_owners) {
        h->n_owners = k;
        h_owners_removed(h);
    }
    h->owners_trim_at = 2 * h->n_owners + 64;
}

static void pool_free_add(gm_heap *h, gm_pool *p, int64_t blocks, int64_t bytes) {
    h_assert(blocks >= 0 || (p->free_blocks >= (size_t)-blocks && p->free_bytes >= (size_t)-bytes &&
                             h->pool_free_bytes >= (size_t)-bytes));
    p->free_blocks += (size_t)blocks;
    p->free_bytes += (size_t)bytes;
    h->pool_free_bytes += (size_t)bytes;
}

void h_index_insert(gm_heap *h, gm_block *b) {
    /* owner_get only fails on host OOM; every owner a free block names was
     * created when its stream first allocated (in the block's pool), so this
     * finds it. */
    gm_owner *o = h_owner_find(h, b->pool, b->stream);
    h_assert(o && b->state == GM_BLOCK_FREE && (!b->pool || b->pool->use_count > 0));
    b->small = !b->pool && h->small_page[h_page_floor(h, b->addr)];
    h_assert(b->pool || (h->small_page[h_page_floor(h, b->addr + b->size - 1)] == b->small &&
                         (!b->small || h_page_floor(h, b->addr) == h_page_floor(h, b->addr + b->size - 1))));
    fi_insert(&o->idx, b);
    if (b->pool) pool_free_add(h, b->pool, 1, (int64_t)b->size);
    int pool = h_pool_of(b->size);
    h_stat_up(h->st.inactive_split, pool, 1);
    h_stat_up(h->st.inactive_split_bytes, pool, (int64_t)b->size);
}

void h_index_remove(gm_heap *h, gm_block *b) {
    gm_owner *o = h_owner_find(h, b->pool, b->stream);
    h_assert(o && b->state == GM_BLOCK_FREE);
    fi_remove(&o->idx, b);
    if (b->pool) pool_free_add(h, b->pool, -1, -(int64_t)b->size);
    int pool = h_pool_of(b->size);
    h_stat_down(h->st.inactive_split, pool, 1);
    h_stat_down(h->st.inactive_split_bytes, pool, (int64_t)b->size);
}

/* A block of h->lazy_stream that became everyone's at a synchronisation
 * (h_free_owner) but still sits in its stream's index. */
static int handed_over(const gm_block *b, void *arg) { return b->epoch < ((const gm_heap *)arg)->epoch; }

static void to_everyone(gm_block *b, void *arg) {
    (void)arg;
    b->stream = ANY;
}

/* Move the blocks that a synchronisation handed to every stream, but left in
 * lazy_stream's indexes, into everyone's (gm_heap.lazy_stream says why they
 * may wait).  Nothing merges: every free block is lazy_stream's or
 * everyone's, and such neighbours have merged already.  The statistics count
 * free blocks, whoever owns them: they stay. */
void h_settle_release(gm_heap *h) {
    for (size_t i = 1; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        if (o->stream == ANY || !o->idx.count) continue;
        fi_move_if(&h_everyones(h, o->pool)->idx, &o->idx, handed_over, to_everyone, h);
    }
    h->lazy_stream = ANY;
}

/* The stricter of two owners, or 0 if the blocks may not merge.  (Blocks of
 * different pools never merge either: callers check that first.) */
int h_owners_merge(gm_stream a, gm_stream b, gm_stream *out) {
    if (a == b || b == ANY)
        *out = a;
    else if (a == ANY)
        *out = b;
    else
        return 0;
    return 1;
}

/* Whether a and its upper neighbour b are free blocks that may merge, and if
 * so, *o: the owner of the merged block. */
int h_may_merge_free(const gm_heap *h, const gm_block *a, const gm_block *b, gm_stream *o) {
    return a->state == GM_BLOCK_FREE && b->state == GM_BLOCK_FREE && a->pool == b->pool && !h_pool_seam(h, a, b) &&
           !h_small_seam(h, a, b) && h_owners_merge(a->stream, b->stream, o);
}

/* ---- splitting and merging ----------------------------------------------- */

/* Cut b at `offset`; the upper part is returned with b's state and owner.
 * b must not be in any list.  A block that keeps its pages (a pool's free
 * block) is counted as two afterwards. */
gm_block *h_split(gm_heap *h, gm_block *b, size_t offset) {
    h_assert(offset > 0 && offset < b->size && offset % GM_ALIGN == 0);
    int keeps = h_keeps_pages(b);
    if (keeps) h_pages_use(h, b, -1);
    gm_block *r = h_block_new(h);
    r->addr = b->addr + offset;
    r->size = b->size - offset;
    r->state = b->state;
    r->stream = b->stream;
    r->seq = b->seq;
    r->pool = b->pool;
    r->origin = b->origin;
    r->epoch = b->epoch;
    r->small = b->small;
    r->prev = b;
    r->next = b->next;
    if (b->next) b->next->prev = r;
    b->next = r;
    b->size = offset;
    h_assert(b->next == r && r->prev == b && b->addr + b->size == r->addr && (!r->next || r->next->prev == r));
    if (keeps) {
        h_pages_use(h, b, 1);
        h_pages_use(h, r, 1);
    }
    return r;
}

/* a absorbs its upper neighbour b; neither is in any list.  Both keep their
 * pages (free blocks of one living pool) or neither does.  Free blocks: the
 * caller gives a the owner h_owners_merge() picks from the two; it is a
 * stream's (not everyone's) when either part was that stream's, so the
 * newer epoch of such a part goes with it. */
void h_absorb(gm_heap *h, gm_block *a, gm_block *b) {
    h_assert(a->next == b && b->prev == a && a->addr + a->size == b->addr);
    h_assert(a->state == b->state && a->pool == b->pool && h_keeps_pages(a) == h_keeps_pages(b));
    uint64_t ea = h_free_owner(h, a) == ANY ? 0 : a->epoch, eb = h_free_owner(h, b) == ANY ? 0 : b->epoch;
    a->epoch = ea > eb ? ea : eb;
    int keeps = h_keeps_pages(a);
    if (keeps) {
        h_pages_use(h, a, -1);
        h_pages_use(h, b, -1);
    }
    a->size += b->size;
    a->next = b->next;
    if (b->next) b->next->prev = a;
    if (b->seq > a->seq) {
        a->seq = b->seq;
        a->origin = b->origin;
        a->requested = b->requested;
    }
    block_del(h, b);
    h_assert(!a->next || (a->next->prev == a && a->addr + a->size == a->next->addr));
    if (keeps) h_pages_use(h, a, 1);
}

/* Free neighbours a and b, out of the index, become one block a of owner o. */
static gm_block *absorb_free(gm_heap *h, gm_block *a, gm_block *b, gm_stream o) {
    h_absorb(h, a, b);
    a->stream = o;
    return a;
}

/* Free neighbours b and n, which may merge into one block of owner o, do. */
void h_merge_free(gm_heap *h, gm_block *b, gm_block *n, gm_stream o) {
    h_index_remove(h, b);
    h_index_remove(h, n);
    h_index_insert(h, absorb_free(h, b, n, o));
}

/* b, free and out of the index, merges with each free neighbour it may merge
 * with (which leaves the index).  Returns the block it ended up in, out of
 * the index. */
gm_block *h_merge_neighbours(gm_heap *h, gm_block *b) {
    gm_stream o;
    gm_block *p = b->prev;
    if (p && h_may_merge_free(h, p, b, &o)) {
        h_index_remove(h, p);
        b = absorb_free(h, p, b, o);
    }
    gm_block *n = b->next;
    if (n && h_may_merge_free(h, b, n, &o)) {
        h_index_remove(h, n);
        absorb_free(h, b, n, o);
    }
    return b;
}

/* b (in no list) becomes free for `owner`, merges with its neighbours, and is indexed. */
gm_block *h_make_free(gm_heap *h, gm_block *b, gm_stream owner, uint64_t seq) {
    h_assert(b->state != GM_BLOCK_FREE);
    if (owner != ANY && h->lazy_stream != ANY && owner != h->lazy_stream) h_settle_release(h);
    /* Free in a living pool, it stays out of general space and keeps its pages. */
    int was_general = h_general_space(b), general = !b->pool, attach = general && !was_general;
    int kept = h_keeps_pages(b), keeps = h_pinned(b);
    int small = b->small && !b->pool && b->state != GM_BLOCK_UNMAPPED; /* a small page's live or pending block */
    uintptr_t x = b->addr;
    if (attach) {
        /* It joins the runs on either side: out of the index until merged --
         * or, in front of an indexed run, it just becomes that run's head. */
        int joins_prev = b->prev && h_general_space(b->prev), joins_next = b->next && h_general_space(b->next);
        if (!joins_prev && joins_next && b->next->run_len) {
            ri_move_head(&h->runs, b->next, b, b->size + b->next->run_len);
            attach = 0;
        } else {
            if (joins_prev) h_run_detach(h, b->prev);
            if (joins_next) h_run_detach(h, b->next);
        }
    }
    b->state = GM_BLOCK_FREE;
    if (kept != keeps) h_pages_use(h, b, keeps ? 1 : -1);
    b->stream = owner;
    b->seq = seq;
    b->origin = owner;
    b->epoch = h->epoch;
    b->context = 0; /* requested stays: the request last freed here (snapshots report it, as torch does) */
    b = h_merge_neighbours(h, b);
    h_index_insert(h, b);
    if (attach) h_run_attach(h, b);
    return small ? h_small_freed(h, b, x) : b;
}

/* b (in no list) becomes unmapped address space and merges with unmapped
 * neighbours.  Returns the block it ended up in. */
gm_block *h_make_unmapped(gm_heap *h, gm_block *b) {
    h_assert(b->state == GM_BLOCK_FREE && !h_keeps_pages(b));
    b->state = GM_BLOCK_UNMAPPED;
    b->stream = ANY;
    b->seq = 0;
    b->pool = NULL;
    b->origin = ANY;
    b->requested = 0;
    if (b->prev && b->prev->state == GM_BLOCK_UNMAPPED) {
        gm_block *p = b->prev;
        h_absorb(h, p, b);
        b = p;
    }
    if (b->next && b->next->state == GM_BLOCK_UNMAPPED) h_absorb(h, b, b->next);
    return b;
}

/* Merge every pair of neighbours that may merge (after owners changed). */
void h_coalesce_all(gm_heap *h) {
    gm_block *b = h->head;
    while (b && b->next) {
        gm_block *n = b->next;
        gm_stream o;
        if (h_may_merge_free(h, b, n, &o)) {
            h_run_detach(h, b);
            h_merge_free(h, b, n, o);
            h_run_attach(h, b);
        } else if (b->state == GM_BLOCK_UNMAPPED && n->state == GM_BLOCK_UNMAPPED) {
            h_run_detach(h, b);
            h_absorb(h, b, n);
            h_run_attach(h, b);
        } else {
            b = n;
        }
    }
}
