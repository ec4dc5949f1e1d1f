/*
 * heap.c -- gpumem's allocator: one address space per device, physical pages
 * mapped behind it on demand, and moved to defragment.
 *
 * THE PICTURE
 *
 *   One virtual range is reserved per device, four times the device's memory
 *   (address space costs nothing).  Physical memory comes in pages of 2 MiB,
 *   by default each a separate device allocation, so any page can be unmapped
 *   in one place and mapped behind another address (see PHYSICAL PAGES AND
 *   CHUNKS for allocations of several pages).
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
 *      to the shortest run (best fit), then the lowest address.  A run index
 *      (runindex.h) lists the runs by length, so only long enough ones are
 *      looked at, and page-use counters replace walks over every block.
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
 * PHYSICAL PAGES AND CHUNKS
 *
 *   A chunk is one device allocation of k >= 1 neighbouring pages.  The
 *   driver maps and unmaps an allocation only as a whole, and each call costs
 *   tens of microseconds whatever its size -- granting access to one mapping
 *   costs as much as to a hundred -- so k pages made as one chunk cost one
 *   create, one map and one set_access instead of k of each.
 *
 *   page      | 10 | 11 | 12 | 13 | 14 | 15 | 16 | 17 |
 *   handle    | H1 | H2 | H3 | H3 | H3 | H3 | -- | H4 |
 *   chunk     | 1  | 1  | 4 pages, [12, 16)  |    | 1  |   chunk_off / chunk_len
 *   blocks    [A ][free ][B          ][free  ][unmapped][C ]
 *
 *   Growth makes them: the pages a placement lacks beyond the spares are
 *   promised under the growth limit and the cap (grow's grant, counted as
 *   held), then created where they are mapped, as few chunks as cover each
 *   unmapped run of the placement, each at most chunk_pages long (map_fresh).
 *   A chunk the device refuses for lack of memory falls back to single pages;
 *   if even those are refused the request starts over with single spares
 *   made first, as with chunk_pages 1.  A resumed pool gets one chunk per run
 *   of its pages (up to GM_CHUNK_PAGES_MAX pages each) whatever chunk_pages
 *   is: a living pool's pages never move anyway, so until the pool ends its
 *   chunks lock nothing that could otherwise go.
 *
 *   The rule: a chunk's pages are unmapped together or not at all.  Every
 *   path that gives pages back -- defragmentation, empty_cache and a lowered
 *   cap, a failed set_access, pause, destroy -- takes a chunk of several pages
 *   only when all of its pages are free (cached_runs trims runs to whole
 *   chunks), with one unmap, and releases it: it never becomes a spare, never
 *   moves.  Defragmentation promised spares, so it creates single pages to
 *   stand in for it; trimming does not.  A chunk of one page is a page as it
 *   always was: spares are single pages, and defragmentation moves them.
 *   Free pages in a chunk that a block still uses are cached but cannot go:
 *   cached_pages leaves them out (chunk_locked), and an OOM report counts
 *   them.  If the range that needs the fewest new pages cannot get them --
 *   its own cached pages were the only ones that could move -- the slow path
 *   takes the best range that the movable pages elsewhere cover.  chunk_pages
 *   1 (the default) makes every page its own allocation.
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
 *   free memory belongs to ANY.  That hand-over touches no block when the free
 *   blocks it hands over all belong to the waiting stream: an epoch advances,
 *   and the blocks move into ANY's index only when another stream comes
 *   (gm_heap.lazy_stream, gm_free_owner).
 *
 * POOLS
 *
 *   A private pool (torch's graph pools and MemPool, named by a MempoolId_t)
 *   is a set of blocks tagged with it.  Its free blocks sit in owners of their
 *   own -- one per (pool, stream), plus the pool's ANY -- so the same stream
 *   rules hold inside a pool, and they merge only with free neighbours of the
 *   same pool.  A pool's pages are its own, as a native segment is: an
 *   allocation in a pool takes the pool's free blocks (fast path), else
 *   whole pages through the slow path -- a range that starts a page, over
 *   general space, and whose last page holds nothing but general space the
 *   stream may use or the pool's own blocks (pool_pages_ok); the general
 *   free memory left on that page becomes the pool's (claim_pool_pages).
 *   So no page holds a living pool's blocks and anything else, and general
 *   requests never land on a pool's pages: general space never lies there.
 *   Freed, a pool's block goes back to the pool.  Placement never uses a
 *   pool's free block for anything else -- except to grow the pool: for a
 *   request in pool P on stream s, P's free blocks that s may use count as
 *   run space too (mapped, they need no new page), so one placement may span
 *   [P free][general free][unmapped].  A graph recorded at a larger shape
 *   then extends the memory of the smaller shapes' graphs in place, instead
 *   of leaving it stranded beside wholly new memory.  For that the pool's
 *   edge stays its own: no other growth starts right after a living pool's
 *   block, and a pool's request extends the pool's free memory when that
 *   costs at most one page more than the best place elsewhere (consider_at,
 *   POOL_EDGE_PAGES).
 *
 *   Each slow-path placement is a growth, numbered per page (page_growth):
 *   the pages it maps, and for a pool the pages it takes.  A pool's free
 *   neighbours do not merge across a page where the growth changes, as a
 *   native allocator's blocks do not merge across segments, and snapshots
 *   cut segments there.  A no_split pool's request takes whole pages, or a
 *   whole free block of the pool: its blocks are never split.
 *
 *     [A   ][free][B  p1 ][free p1  ][C  p1 ][free p1][unmapped ...]
 *     |  page 0  |  page 1  |  page 2  |  page 3  |
 *       general    pages 1-3 are p1's and pinned: only its blocks lie there
 *
 *   A CUDA graph has its addresses baked in, so every page that a block of a
 *   living pool touches -- live, pending or free -- is counted as used
 *   (gm_used_pages, cached_pages, cached_runs): defragmentation, empty_cache and
 *   the cap never unmap or move it.  When the pool's last use is released its
 *   free blocks become general at once (their owners go, they merge, their
 *   pages become cacheable); its live and pending blocks become general when
 *   they are freed, and the pool's record lives until the last of them is.
 *   pool_set_live restores a checkpoint: it frees the pool's unlisted live
 *   blocks and carves the listed ones out of the pool's free memory.
 *
 * PAUSE
 *
 *   gm_pool_pause releases the physical pages that only one living pool's
 *   blocks touch, after a device wait (and, asked to, a copy to pinned host
 *   memory); the blocks stay as they are, live, pending or free, at their
 *   addresses, and the pool lists the pages it released.  Nothing needs a
 *   new block state: a paused page holds only blocks of its pool, so it holds
 *   no general space, and while the pool is paused it gets no new block --
 *   its allocations and set_live are refused, and it cannot end (release is
 *   refused), which is what would turn its free blocks general.  Placement,
 *   recycling and empty_cache look at general space only, so they never see
 *   those pages.  The page-use counts still count them (the pool's blocks
 *   keep their pages), so cached_pages and the reports take paused_pages
 *   off.  gm_pool_resume maps pages behind the listed addresses again, one
 *   set_access per contiguous run, copies the backup back, and on any
 *   failure unmaps what it mapped: the pool is then as paused as before.
 *
 * CAPTURE
 *
 *   While a CUDA graph is captured, a synchronisation, an event query or
 *   record, an unmap or a release would invalidate it.  The heap counts
 *   gm_capture_begin/end, and asks the device (capture_status) whether the
 *   requesting stream captures; either way the operation runs with h->no_sync
 *   set.  Then the fast path is unchanged; pending blocks are not polled; the
 *   slow path skips step 1 (events) and step 4 (defragmentation) and grows up to
 *   the cap; out of memory otherwise, with spares kept (releasing them is
 *   forbidden too).  Pages whose access grant keeps failing then cannot be
 *   unmapped either: they are parked (gm_heap.parked), mapped and held but in
 *   unmapped space, where no block gets them, until no capture is on.  A free with record_stream uses records no event: the block
 *   stays pending, marked deferred, until the capture count returns to zero,
 *   when its events are recorded (torch defers them the same way).  empty_cache
 *   and a lowered cap trim nothing until the capture ends.  A capture known only
 *   from the device, on another stream, shows through its deferred frees: while
 *   one waits, device-wide calls (synchronize, event query) are held back too.
 *   Other captures the heap cannot see: torch's side calls gm_capture_begin/end.
 *
 * LOCKING: one mutex per heap; device calls happen under it (slow path only).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gpumem/array.h"
#include "heap_internal.h"

#define ANY GM_STREAM_ANY

static size_t held_pages(const gm_heap *h) { return h->mapped_pages + h->n_spare + h->loose_pages; }
static inline size_t align_up(size_t x, size_t a) { return (x + a - 1) & ~(a - 1); }

/* ---- block records ------------------------------------------------------- */

static int slab_grow(gm_heap *h) {
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

gm_owner *gm_owner_find(gm_heap *h, const gm_pool *pool, gm_stream s) {
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

static gm_owner *owner_get(gm_heap *h, gm_pool *pool, gm_stream s) {
    gm_owner *o = gm_owner_find(h, pool, s);
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
static void owners_removed(gm_heap *h) {
    h->last_owner = NULL;
    if (owner_tab_build(h, h->n_owners)) {
        memset(h->owner_tab, 0, (h->owner_tab_mask + 1) * sizeof *h->owner_tab);
        for (size_t i = 0; i < h->n_owners; i++) owner_tab_put(h, h->owners[i]);
    }
}

static void owner_keep(gm_heap *h, const gm_pool *pool, gm_stream s) {
    gm_owner *o = gm_owner_find(h, pool, s);
    if (o) o->keep = 1;
}

/* Drop the owners no block needs: those of a stream other than ANY with no
 * free block in their index, no release in flight, and no live or pending
 * block of their stream that would become free into them (in their pool, or
 * in the general heap when the pool ends first).  What they proved stays
 * known to the checker as retired_safe_seq.  Only between operations on
 * owners: no owner pointer may be held across it. */
static void owners_trim(gm_heap *h) {
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
        owners_removed(h);
    }
    h->owners_trim_at = 2 * h->n_owners + 64;
}

/* Everyone's owner in `pool` (NULL: the general heap). */
static inline gm_owner *everyones(const gm_heap *h, const gm_pool *pool) { return pool ? pool->any : h->owners[0]; }

static void pool_free_add(gm_heap *h, gm_pool *p, int64_t blocks, int64_t bytes) {
    p->free_blocks += (size_t)blocks;
    p->free_bytes += (size_t)bytes;
    h->pool_free_bytes += (size_t)bytes;
}

static void index_insert(gm_heap *h, gm_block *b) {
    /* owner_get only fails on host OOM; every owner a free block names was
     * created when its stream first allocated (in the block's pool), so this
     * finds it. */
    fi_insert(&gm_owner_find(h, b->pool, b->stream)->idx, b);
    if (b->pool) pool_free_add(h, b->pool, 1, (int64_t)b->size);
    int pool = gm_pool_of(b->size);
    gm_stat_up(h->st.inactive_split, pool, 1);
    gm_stat_up(h->st.inactive_split_bytes, pool, (int64_t)b->size);
}

static void index_remove(gm_heap *h, gm_block *b) {
    fi_remove(&gm_owner_find(h, b->pool, b->stream)->idx, b);
    if (b->pool) pool_free_add(h, b->pool, -1, -(int64_t)b->size);
    int pool = gm_pool_of(b->size);
    gm_stat_down(h->st.inactive_split, pool, 1);
    gm_stat_down(h->st.inactive_split_bytes, pool, (int64_t)b->size);
}

/* A block of h->lazy_stream that became everyone's at a synchronisation
 * (gm_free_owner) but still sits in its stream's index. */
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
static void settle_release(gm_heap *h) {
    for (size_t i = 1; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        if (o->stream == ANY || !o->idx.count) continue;
        fi_move_if(&everyones(h, o->pool)->idx, &o->idx, handed_over, to_everyone, h);
    }
    h->lazy_stream = ANY;
}

/* The stricter of two owners, or 0 if the blocks may not merge.  (Blocks of
 * different pools never merge either: callers check that first.) */
static int owners_merge(gm_stream a, gm_stream b, gm_stream *out) {
    if (a == b || b == ANY)
        *out = a;
    else if (a == ANY)
        *out = b;
    else
        return 0;
    return 1;
}

/* ---- splitting and merging ----------------------------------------------- */

/* Cut b at `offset`; the upper part is returned with b's state and owner.
 * b must not be in any list.  A block that keeps its pages (a pool's free
 * block) is counted as two afterwards. */
static gm_block *split(gm_heap *h, gm_block *b, size_t offset) {
    int keeps = gm_keeps_pages(b);
    if (keeps) gm_pages_use(h, b, -1);
    gm_block *r = block_new(h);
    r->addr = b->addr + offset;
    r->size = b->size - offset;
    r->state = b->state;
    r->stream = b->stream;
    r->seq = b->seq;
    r->pool = b->pool;
    r->origin = b->origin;
    r->epoch = b->epoch;
    r->prev = b;
    r->next = b->next;
    if (b->next) b->next->prev = r;
    b->next = r;
    b->size = offset;
    if (keeps) {
        gm_pages_use(h, b, 1);
        gm_pages_use(h, r, 1);
    }
    return r;
}

/* a absorbs its upper neighbour b; neither is in any list.  Both keep their
 * pages (free blocks of one living pool) or neither does.  Free blocks: the
 * caller gives a the owner owners_merge() picks from the two; it is a
 * stream's (not everyone's) when either part was that stream's, so the
 * newer epoch of such a part goes with it. */
static void absorb(gm_heap *h, gm_block *a, gm_block *b) {
    uint64_t ea = gm_free_owner(h, a) == ANY ? 0 : a->epoch, eb = gm_free_owner(h, b) == ANY ? 0 : b->epoch;
    a->epoch = ea > eb ? ea : eb;
    int keeps = gm_keeps_pages(a);
    if (keeps) {
        gm_pages_use(h, a, -1);
        gm_pages_use(h, b, -1);
    }
    a->size += b->size;
    a->next = b->next;
    if (b->next) b->next->prev = a;
    if (b->seq > a->seq) {
        a->seq = b->seq;
        a->origin = b->origin;
    }
    block_del(h, b);
    if (keeps) gm_pages_use(h, a, 1);
}

/* Free neighbours b and n, which may merge into one block of owner o, do. */
static void merge_free(gm_heap *h, gm_block *b, gm_block *n, gm_stream o) {
    index_remove(h, b);
    index_remove(h, n);
    absorb(h, b, n);
    b->stream = o;
    index_insert(h, b);
}

/* b (in no list) becomes free for `owner`, merges with its neighbours, and is indexed. */
static gm_block *make_free(gm_heap *h, gm_block *b, gm_stream owner, uint64_t seq) {
    gm_stream o;
    if (owner != ANY && h->lazy_stream != ANY && owner != h->lazy_stream) settle_release(h);
    /* Free in a living pool, it stays out of general space and keeps its pages. */
    int was_general = gm_general_space(b), general = !b->pool, attach = general && !was_general;
    int kept = gm_keeps_pages(b), keeps = gm_pinned(b);
    if (attach) {
        /* It joins the runs on either side: out of the index until merged --
         * or, in front of an indexed run, it just becomes that run's head. */
        int joins_prev = b->prev && gm_general_space(b->prev), joins_next = b->next && gm_general_space(b->next);
        if (!joins_prev && joins_next && b->next->run_len) {
            ri_move_head(&h->runs, b->next, b, b->size + b->next->run_len);
            attach = 0;
        } else {
            if (joins_prev) gm_run_detach(h, b->prev);
            if (joins_next) gm_run_detach(h, b->next);
        }
    }
    b->state = GM_BLOCK_FREE;
    if (kept != keeps) gm_pages_use(h, b, keeps ? 1 : -1);
    b->stream = owner;
    b->seq = seq;
    b->origin = owner;
    b->epoch = h->epoch;
    b->requested = 0;
    b->context = 0;
    gm_block *p = b->prev;
    if (p && p->state == GM_BLOCK_FREE && p->pool == b->pool && !gm_pool_seam(h, p, b) &&
        owners_merge(p->stream, b->stream, &o)) {
        index_remove(h, p);
        absorb(h, p, b);
        p->stream = o;
        b = p;
    }
    gm_block *n = b->next;
    if (n && n->state == GM_BLOCK_FREE && n->pool == b->pool && !gm_pool_seam(h, b, n) &&
        owners_merge(b->stream, n->stream, &o)) {
        index_remove(h, n);
        absorb(h, b, n);
        b->stream = o;
    }
    index_insert(h, b);
    if (attach) gm_run_attach(h, b);
    return b;
}

/* b (in no list) becomes unmapped address space and merges with unmapped
 * neighbours.  Returns the block it ended up in. */
static gm_block *make_unmapped(gm_heap *h, gm_block *b) {
    b->state = GM_BLOCK_UNMAPPED;
    b->stream = ANY;
    b->seq = 0;
    b->pool = NULL;
    b->origin = ANY;
    if (b->prev && b->prev->state == GM_BLOCK_UNMAPPED) {
        gm_block *p = b->prev;
        absorb(h, p, b);
        b = p;
    }
    if (b->next && b->next->state == GM_BLOCK_UNMAPPED) absorb(h, b, b->next);
    return b;
}

/* Merge every pair of neighbours that may merge (after owners changed). */
static void coalesce_all(gm_heap *h) {
    gm_block *b = h->head;
    while (b && b->next) {
        gm_block *n = b->next;
        gm_stream o;
        if (b->state == GM_BLOCK_FREE && n->state == GM_BLOCK_FREE && b->pool == n->pool && !gm_pool_seam(h, b, n) &&
            owners_merge(b->stream, n->stream, &o)) {
            gm_run_detach(h, b);
            merge_free(h, b, n, o);
            gm_run_attach(h, b);
        } else if (b->state == GM_BLOCK_UNMAPPED && n->state == GM_BLOCK_UNMAPPED) {
            gm_run_detach(h, b);
            absorb(h, b, n);
            gm_run_attach(h, b);
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
        gm_event *p = gm_array_grow(h->event_pool, &h->cap_event_pool, 16, sizeof *p);
        if (!p) {
            h->dev->ops->event_destroy(h->dev, ev);
            return;
        }
        h->event_pool = p;
    }
    h->event_pool[h->n_event_pool++] = ev;
}

/* Record an event on `s`; 0 if that failed (the caller then falls back to
 * waiting for the whole device). */
static int event_record(gm_heap *h, gm_stream s, gm_event *ev) {
    *ev = 0;
    if (h->no_sync || event_get(h, ev)) return 0;
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
    if (h->no_sync) return 0;
    int rc = h->dev->ops->event_query(h->dev, ev);
    if (rc == GM_OK) return 1;
    if (rc != GM_ENOTREADY) h->st.num_device_errors++;
    return 0;
}

/* ---- pending blocks ----------------------------------------------------------- */

static void pending_unlink(gm_heap *h, gm_block *b) {
    if (b->lprev)
        b->lprev->lnext = b->lnext;
    else
        h->pending_head = b->lnext;
    if (b->lnext)
        b->lnext->lprev = b->lprev;
    else
        h->pending_tail = b->lprev;
    b->lprev = b->lnext = NULL;
    h->n_pending--;
}

static void pending_append(gm_heap *h, gm_block *b) {
    b->lnext = NULL;
    b->lprev = h->pending_tail;
    if (h->pending_tail)
        h->pending_tail->lnext = b;
    else
        h->pending_head = b;
    h->pending_tail = b;
    h->n_pending++;
}

static void pool_delete(gm_heap *h, gm_pool *p);

/* A pending or live block leaves "active" and becomes free for its stream, in
 * its pool if that still lives, else in the general heap. */
static void complete_free(gm_heap *h, gm_block *b) {
    gm_pool *pl = b->pool;
    if (pl) {
        pl->live_blocks--;
        pl->live_bytes -= b->size;
        if (!pl->use_count) {
            b->pool = NULL;
            if (!pl->live_blocks) pool_delete(h, pl);
        }
    }
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
        if (b->deferred) {
            if (!synced) continue;
            b->deferred = 0;
            h->n_deferred--;
        }
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

/* A device synchronisation proved every free on o's stream done: a proof in
 * flight is moot. */
static void owner_synced(gm_heap *h, gm_owner *o) {
    if (o->releasing) {
        event_put(h, o->release_event);
        o->releasing = 0;
    }
    o->safe_seq = h->free_seq;
}

struct release_ctx {
    gm_heap *h;
    uint64_t threshold;
    size_t n;
    gm_block **chains; /* first blocks of the runs of free blocks that changed, each marked */
    size_t n_chains, cap_chains;
    int all; /* no memory to list them: coalesce the whole heap */
};

/* b now belongs to everyone: a free neighbour may merge with it, so remember
 * the run of free blocks it is in (coalesced once every owner is done).  The
 * blocks walked to find the run's first are marked (2), so a later block of
 * the same run stops there: a run of n blocks of n streams costs O(n), not
 * O(n^2); coalesce_chain (or, with `all`, coalesce_released) clears them. */
static void released(struct release_ctx *c, gm_block *b) {
    c->n++;
    if (!(b->prev && b->prev->state == GM_BLOCK_FREE) && !(b->next && b->next->state == GM_BLOCK_FREE)) return;
    gm_block *first = b;
    while (!first->mark && first->prev && first->prev->state == GM_BLOCK_FREE) {
        first->mark = 2;
        first = first->prev;
    }
    if (first->mark || c->all) return;
    if (c->n_chains == c->cap_chains) {
        gm_block **a = gm_array_grow(c->chains, &c->cap_chains, 16, sizeof *a);
        if (!a) {
            c->all = 1;
            return;
        }
        c->chains = a;
    }
    first->mark = 1;
    c->chains[c->n_chains++] = first;
}

static int release_one(gm_block *b, void *arg) {
    struct release_ctx *c = arg;
    if (b->seq > c->threshold) return 0;
    index_remove(c->h, b);
    b->stream = ANY;
    index_insert(c->h, b);
    released(c, b);
    return 0;
}

/* The same for a block that fi_move_all has moved already; the statistics
 * count it out of one index and into the other, as index_remove and
 * index_insert would. */
static void release_moved(gm_block *b, void *arg) {
    struct release_ctx *c = arg;
    int pool = gm_pool_of(b->size);
    gm_stat_down(c->h->st.inactive_split, pool, 1);
    gm_stat_down(c->h->st.inactive_split_bytes, pool, (int64_t)b->size);
    gm_stat_up(c->h->st.inactive_split, pool, 1);
    gm_stat_up(c->h->st.inactive_split_bytes, pool, (int64_t)b->size);
    b->stream = ANY;
    released(c, b);
}

static size_t release_blocks(struct release_ctx *c, gm_owner *o, uint64_t threshold) {
    size_t before = c->n;
    c->threshold = threshold;
    if (threshold == UINT64_MAX) {
        /* Everything goes: merge the sorted bins instead of inserting one by one. */
        fi_move_all(&everyones(c->h, o->pool)->idx, &o->idx, release_moved, c);
    } else {
        /* fi_each tolerates moving the visited block out of the index it walks. */
        fi_each(&o->idx, release_one, c);
    }
    return c->n - before;
}

/* Merge what may merge in the run of free blocks that starts at b, left to
 * right, as coalesce_all does: merges keep the lower record, so b stays.
 * Blocks of different pools (or of a pool and the general heap) never merge;
 * a run of general space that changes is out of the run index meanwhile
 * (`out`: a block of it, whose record survives the merges). */
static void coalesce_chain(gm_heap *h, gm_block *b) {
    gm_block *out = NULL;
    while (b->next && b->next->state == GM_BLOCK_FREE) {
        gm_block *n = b->next;
        gm_stream o;
        n->mark = 0; /* released() may have walked it */
        if (b->pool == n->pool && !gm_pool_seam(h, b, n) && owners_merge(b->stream, n->stream, &o)) {
            if (!b->pool && !out) gm_run_detach(h, out = b);
            merge_free(h, b, n, o);
        } else {
            if (out && n->pool) {
                gm_run_attach(h, out);
                out = NULL;
            }
            b = n;
        }
    }
    if (out) gm_run_attach(h, out);
}

/* After owners changed: the runs of free blocks that hold a changed block are
 * the only places where neighbours may now merge. */
static void coalesce_released(gm_heap *h, struct release_ctx *c) {
    for (size_t i = 0; i < c->n_chains; i++) {
        c->chains[i]->mark = 0;
        if (!c->all) coalesce_chain(h, c->chains[i]);
    }
    if (c->all) {
        for (gm_block *b = h->head; b; b = b->next) b->mark = 0; /* released()'s walks */
        coalesce_all(h);
    }
    free(c->chains);
}

/* Give other streams' freed memory to everyone where an event proves it safe
 * (all of it if `synced`).  Returns how many blocks changed hands. */
static size_t release_owners(gm_heap *h, gm_stream requester, int synced) {
    size_t moved = 0;
    struct release_ctx c = {h, 0, 0, NULL, 0, 0, 0};
    for (size_t i = 1; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        if (o->stream == ANY) continue; /* a pool's: everyone's already */
        if (synced) {
            owner_synced(h, o);
            moved += release_blocks(&c, o, UINT64_MAX);
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
            moved += release_blocks(&c, o, o->release_seq);
        }
    }
    coalesce_released(h, &c);
    return moved;
}

/* ---- the fast path ------------------------------------------------------------ */

/* Best fit for stream s among the free blocks of `pool` (NULL: the general
 * heap) that s may use: its own and everyone's. */
static gm_block *fit_in(gm_heap *h, size_t size, gm_stream s, gm_pool *pool) {
    gm_owner *own = s == ANY ? NULL : gm_owner_find(h, pool, s);
    gm_block *a = own ? fi_best_fit(&own->idx, size) : NULL;
    gm_block *b = fi_best_fit(&everyones(h, pool)->idx, size);
    if (!a) return b;
    if (!b) return a;
    return (b->size < a->size || (b->size == a->size && b->addr < a->addr)) ? b : a;
}

/* An allocation in a pool takes only the pool's free memory here: general
 * free memory it may take only as whole pages of its own (placement). */
static gm_block *fit(gm_heap *h, size_t size, gm_stream s, gm_pool *pool) { return fit_in(h, size, s, pool); }

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

/* One new physical allocation of k pages, counted held.  *dev_err (if given)
 * keeps a failure other than the device's GM_ENOMEM for the report. */
static int create_chunk(gm_heap *h, size_t k, gm_handle *hd, int *dev_err) {
    int rc = h->dev->ops->create(h->dev, k, hd);
    if (rc) {
        if (rc != GM_ENOMEM) {
            h->st.num_device_errors++;
            if (dev_err) *dev_err = rc;
        }
        return rc;
    }
    count_held(h, (int64_t)k);
    h->st.num_device_alloc++;
    return GM_OK;
}

/* Give an unmapped chunk of k pages back to the device.  One whose release
 * fails, or may not be released now (during a capture), stays held: a single
 * page as a spare, a larger chunk in h->loose, for release_spares. */
static void release_chunk(gm_heap *h, gm_handle hd, size_t k) {
    if (h->no_sync || h->dev->ops->release(h->dev, hd)) {
        h->st.num_device_errors += !h->no_sync;
        if (k == 1) {
            spare_push(h, hd);
            return;
        }
        h->loose[h->n_loose++] = (struct gm_loose){hd, k};
        h->loose_pages += k;
        return;
    }
    count_held(h, -(int64_t)k);
    h->st.num_device_free++;
}

/* The chunk hd of k pages is mapped at pages [p0, p0+k) now / no longer. */
static void chunk_set(gm_heap *h, size_t p0, size_t k, gm_handle hd) {
    for (size_t i = 0; i < k; i++) {
        h->page_handle[p0 + i] = hd;
        h->chunk_off[p0 + i] = (uint32_t)i;
        h->chunk_len[p0 + i] = (uint32_t)k;
    }
    h->mapped_pages += k;
}
static void chunk_clear(gm_heap *h, size_t p0, size_t k) {
    memset(h->page_handle + p0, 0, k * sizeof *h->page_handle);
    memset(h->chunk_off + p0, 0, k * sizeof *h->chunk_off);
    memset(h->chunk_len + p0, 0, k * sizeof *h->chunk_len);
    h->mapped_pages -= k;
}

/* Unmap the chunk whose first page is p, with one call.  A single page
 * becomes a spare; a larger chunk goes back to the device, and with
 * `restock` as many single spares are created to stand in for it (fewer if
 * the device refuses): defragmentation promised its caller spares. */
static int unmap_chunk(gm_heap *h, size_t p, int restock) {
    size_t k = h->chunk_len[p];
    gm_handle hd = h->page_handle[p];
    int rc = h->dev->ops->unmap(h->dev, gm_page_addr(h, p), k * h->page);
    if (rc) {
        h->st.num_device_errors++;
        return rc;
    }
    chunk_clear(h, p, k);
    h->st.num_unmaps++;
    if (k == 1) {
        spare_push(h, hd);
        return GM_OK;
    }
    h->multi_chunks--;
    size_t loose = h->n_loose;
    release_chunk(h, hd, k);
    for (size_t i = 0; restock && h->n_loose == loose && i < k; i++) { /* only for memory given back */
        gm_handle one;
        if (create_chunk(h, 1, &one, NULL)) break;
        spare_push(h, one);
    }
    return GM_OK;
}

/* Trim the page range [*p0, *p1), all mapped, inward to whole chunks. */
static void whole_chunks(const gm_heap *h, size_t *p0, size_t *p1) {
    if (*p0 < *p1 && h->chunk_off[*p0]) *p0 = gm_chunk_end(h, *p0);
    if (*p0 < *p1 && gm_chunk_end(h, *p1 - 1) > *p1) *p1 = gm_chunk_first(h, *p1 - 1);
    if (*p1 < *p0) *p1 = *p0;
}

/* Growth: let the heap create up to `want` more pages while it holds (with
 * *grant, the pages already promised) fewer than `limit`.  With chunks
 * (grant not NULL), the pages are promised (*grant) and made where they are
 * mapped (map_fresh), as few allocations as the placement's unmapped runs
 * allow; else single spares are created now, stopping at the first refusal.
 * *dev_err keeps a non-OOM failure for the report. */
static void grow(gm_heap *h, size_t want, size_t limit, size_t *grant, int *dev_err) {
    size_t promised = grant ? *grant : 0;
    if (grant) {
        size_t held = held_pages(h) + promised, room = limit > held ? limit - held : 0;
        *grant += want < room ? want : room;
        return;
    }
    for (size_t made = 0; made < want && held_pages(h) + promised < limit; made++) {
        gm_handle hd;
        if (create_chunk(h, 1, &hd, dev_err)) break;
        spare_push(h, hd);
    }
}

/* Map pages [p0, p1), all unmapped: spare pages first, then, while *grant
 * allows, new chunks of up to `most` pages (a chunk the device refuses for
 * lack of memory falls back to single pages).  No access is granted.
 * Returns the end of what got mapped (whole chunks); *err the failure that
 * stopped it (GM_ENOMEM: the device had nothing left to give). */
static size_t map_fresh(gm_heap *h, size_t p0, size_t p1, size_t most, size_t *grant, int *err) {
    size_t p = p0, none = 0;
    if (!grant) grant = &none;
    while (p < p1) {
        size_t k = 1;
        gm_handle hd;
        int rc, spare = h->n_spare > 0;
        if (h->parked[p]) {
            snprintf(h->dev->last_error, sizeof h->dev->last_error,
                     "the page at %#lx is still mapped: access to it could not be granted during a capture, and it "
                     "is unmapped once no capture is on",
                     (unsigned long)gm_page_addr(h, p));
            *err = GM_EDEVICE;
            break;
        }
        if (spare) {
            hd = h->spare[h->n_spare - 1];
        } else if (!*grant) {
            *err = GM_ENOMEM;
            break;
        } else {
            k = p1 - p < most ? p1 - p : most;
            if (k > *grant) k = *grant;
            rc = create_chunk(h, k, &hd, NULL);
            if (rc == GM_ENOMEM && k > 1) {
                most = k = 1; /* near the device's end: single pages, as many as there are */
                rc = create_chunk(h, 1, &hd, NULL);
            }
            if (rc) {
                *err = rc;
                break;
            }
            *grant -= k;
        }
        if ((rc = h->dev->ops->map(h->dev, gm_page_addr(h, p), k, hd))) {
            h->st.num_device_errors++;
            *err = rc;
            if (spare) break; /* it stays a spare */
            if (k == 1)
                spare_push(h, hd);
            else
                release_chunk(h, hd, k);
            break;
        }
        if (spare) h->n_spare--;
        chunk_set(h, p, k, hd);
        h->multi_chunks += k > 1;
        h->st.num_maps++;
        p += k;
    }
    return p;
}

/* map_fresh for growth with room (POLICY): pages [p0, p1) of a range whose
 * pages are [r0, r1).  The range's first and last pages, which neighbouring
 * blocks may share, come as single pages; only pages wholly inside the range
 * come as chunks of up to `most`, so that a chunk goes back whole once the
 * block over it is freed. */
static size_t map_interior(gm_heap *h, size_t p0, size_t p1, size_t r0, size_t r1, size_t most, size_t *grant,
                           int *err) {
    size_t a = p0 == r0 && p0 < p1 ? p0 + 1 : p0, z = p1 == r1 && p1 > a ? p1 - 1 : p1;
    size_t p = map_fresh(h, p0, a, 1, grant, err);
    if (p == a) p = map_fresh(h, a, z, most, grant, err);
    if (p == z) p = map_fresh(h, z, p1, 1, grant, err);
    return p;
}

/* Release spare pages (and chunks whose release failed before) until the heap
 * holds at most `target` (not during a capture: a release would invalidate
 * it; the spares wait for later). */
static int release_spares(gm_heap *h, size_t target) {
    if (h->no_sync) return GM_OK;
    while (h->n_loose && held_pages(h) > target) {
        struct gm_loose c = h->loose[h->n_loose - 1];
        if (h->dev->ops->release(h->dev, c.handle)) {
            h->st.num_device_errors++;
            return GM_EDEVICE;
        }
        h->n_loose--;
        h->loose_pages -= c.pages;
        count_held(h, -(int64_t)c.pages);
        h->st.num_device_free++;
    }
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

/* ---- policy: room vs pressure --------------------------------------------------------- */

/* POLICY
 *
 *   The growth limit (1% over the peak of live memory) keeps reserved memory
 *   near live memory, at a price: growth past it recycles -- a device-wide
 *   synchronisation, then free pages unmapped and mapped again -- where a
 *   caching allocator would simply take new pages.  On a full device that is
 *   what lets a workload fit; on a device with room it only costs time.  So
 *   the slow path first measures pressure:
 *
 *     limit     = min(cap, held + what the device reports free)
 *                 (the device's free memory counts other processes' use)
 *     room line = pressure x limit                 (gm_config.pressure)
 *
 *   With room -- the heap's pages plus the request's stay under the room line
 *   -- growth takes new pages past the growth limit, freed pages stay cached,
 *   and the slow path neither recycles nor synchronises.  Past the line the
 *   heap is tight exactly as before: the growth limit, recycling and
 *   defragmentation, then growth to the cap.  Crossing the line therefore
 *   costs one round of defragmentation of what the room left scattered;
 *   defragmentation moves any wholly free page, so the smallest capacity a
 *   workload fits in stays near the tight heap's (pressure 0) -- not equal:
 *   the blocks placed with room lie elsewhere.
 *
 *   Growth with room far from pressure -- the heap holding at most ROOM_FAR
 *   of the room line -- maps a request's new pages as chunks of up to
 *   ROOM_CHUNK_PAGES pages (one create, map and access grant each, instead
 *   of one per page) when it needs at least ROOM_CHUNK_MIN of them.  Only the
 *   pages wholly inside the request's range become chunks; its first and
 *   last pages, which neighbouring blocks may share, stay single
 *   (map_interior).  A chunk cannot move while a block still uses one of its
 *   pages, which is why they are made only for large requests and only far
 *   from pressure: such a block usually goes whole, and its chunk with it
 *   (recycling releases a wholly free chunk and makes single pages in its
 *   place), long before defragmentation needs every page to move.
 *
 *   Smaller growths come as chunks too, but only while the device also has
 *   ROOM_SMALL_FREE free past the room line: each growth of fewer than
 *   ROOM_CHUNK_MIN pages is one chunk, its own pages and, when it needs fewer
 *   than ROOM_AHEAD_PAGES, that many taken ahead from the unmapped space right
 *   after it (room_ahead), which the next small requests then use without a
 *   device call.  Such chunks soon hold blocks of different lifetimes, so
 *   they rarely go back whole: on a heap that later fills its device they
 *   lock pages that defragmentation could otherwise move.  ROOM_SMALL_FREE
 *   keeps them to devices that have that much to spare.
 *
 *   Tunables, measured by replaying the shipped traces (docs/benchmarks.md,
 *   "Policy: room vs pressure"):
 *     GM_PRESSURE_DEFAULT 0.875  a headroom of 1/8 of the limit.  Unrecycled,
 *                                the traces' workloads reserve 0.4-3.6% over
 *                                peak live (overlap_comm 9.7%, the synthetic
 *                                seed_fragmentation 15%), so a workload whose peak
 *                                live stays under ~85% of the limit keeps room
 *                                to the end; past the line the heap tightens
 *                                while the device still has 1/8 left, room for
 *                                what allocates outside the heap (CUDA's
 *                                context, cuBLAS and NCCL workspaces, other
 *                                processes) and for the defragmentation that
 *                                follows to find free pages.  The smallest
 *                                capacity per trace stays within 0.27% of
 *                                peak live of the tight heap's.
 *     ROOM_FAR 0.25, ROOM_CHUNK_MIN 64, ROOM_CHUNK_PAGES 64: 1.2-2.5x fewer
 *                                device allocations than single pages on five
 *                                of the nine traces (none on the others), the
 *                                smallest capacity of every trace the same as
 *                                with single pages; chunks
 *                                for smaller requests, or up to half the room
 *                                line, cost up to 8% of peak live on
 *                                seed_fragmentation, 1.4% on llama_lora_ckpt
 *                                and 0.4% on two_stream_pipeline.
 *     ROOM_AHEAD_PAGES 8, ROOM_SMALL_FREE 16 GiB: on an 80 GiB device the
 *                                nine traces make 8-28x fewer device
 *                                allocations (gpt2_varlen 4701 -> 292,
 *                                resnet50_multires 2215 -> 186) for at most
 *                                0.14% of peak live more reserved; without
 *                                the 16 GiB condition the smallest capacity
 *                                rises by up to 5.3% (seed_fragmentation;
 *                                two_stream_pipeline 1.1%, bert_varlen 0.6%),
 *                                with it no trace's changes. */
#define ROOM_FAR         0.25
#define ROOM_CHUNK_MIN   64
#define ROOM_CHUNK_PAGES 64
#define ROOM_AHEAD_PAGES 8
#define ROOM_SMALL_PAGES (ROOM_CHUNK_MIN - 1)
#define ROOM_SMALL_FREE  ((size_t)16 << 30)

/* Pages that must stay free past the room line for small growths to come as
 * chunks (POLICY). */
static size_t room_small_free(const gm_heap *h) { return ROOM_SMALL_FREE / h->page; }

/* The room line in pages: pressure x min(cap, held + device free).  0 when
 * the heap is always tight, or the device cannot say what is free. */
static size_t room_line(gm_heap *h) {
    if (!(h->pressure > 0)) return 0;
    size_t dfree = 0, total = 0, limit = h->cap_pages;
    if (h->dev->ops->mem_info(h->dev, &dfree, &total)) return 0;
    size_t device = held_pages(h) + dfree / h->page;
    if (device < limit) limit = device;
    return (size_t)(h->pressure * (double)limit);
}

static size_t growth_limit(const gm_heap *h, size_t size) {
    size_t active = (size_t)h->st.active_bytes[GM_POOL_ALL].current + size;
    size_t basis = h->peak_live > active ? h->peak_live : active;
    /* Free memory kept for living pools serves nothing else. */
    basis += h->pool_free_bytes;
    size_t pages = (size_t)((double)basis * (1.0 + h->growth_slack) / (double)h->page) + 1 + h->growth_slack_pages;
    return pages < h->cap_pages ? pages : h->cap_pages;
}

/* After a device synchronisation every free block is everyone's.  When all
 * that are not everyone's already belong to one stream (in any pools), that
 * hands nothing new to the stream itself, and no neighbours can merge that
 * have not (owners_merge lets a stream's blocks merge with everyone's): the
 * blocks stay in their indexes, and a new epoch makes them everyone's
 * (gm_heap.lazy_stream).  The proofs and releases in flight are settled
 * here, as release_owners does.  0 when more than one stream owns blocks, or
 * when one does but `requester` (ANY: none) is another: it goes on to look
 * for memory, and would not see them. */
static int release_lazily(gm_heap *h, gm_stream requester) {
    gm_stream s = ANY;
    for (size_t i = 1; i < h->n_owners; i++) {
        const gm_owner *o = h->owners[i];
        if (o->stream == ANY || !o->idx.count) continue;
        if (s != ANY && o->stream != s) return 0;
        s = o->stream;
    }
    if (s != ANY && ((requester != ANY && s != requester) || (h->lazy_stream != ANY && s != h->lazy_stream))) return 0;
    for (size_t i = 1; i < h->n_owners; i++)
        if (h->owners[i]->stream != ANY) owner_synced(h, h->owners[i]);
    if (s != ANY) h->epoch++;
    h->lazy_stream = s;
    return 1;
}

/* Wait for the device: every free block becomes everyone's.  `requester`:
 * the stream whose allocation goes on after it, or ANY. */
static int synchronize(gm_heap *h, gm_stream requester) {
    if (h->no_sync) return GM_EDEVICE; /* callers never get here during a capture */
    if (h->dev->ops->synchronize(h->dev)) {
        h->st.num_device_errors++;
        return GM_EDEVICE;
    }
    h->st.num_sync_all_streams++;
    process_pending(h, 1);
    if (!release_lazily(h, requester)) {
        release_owners(h, ANY, 1); /* merges what the new owners allow; frees merged as they completed */
        h->lazy_stream = ANY;      /* it moved every block */
    }
    return GM_OK;
}

/* Unmap pages [p0, p1), all inside the free block b and made of whole chunks,
 * one call per chunk: single pages become spares, larger chunks go back to
 * the device (unmap_chunk; `restock`: replaced by single spares).  The range
 * becomes unmapped address space. */
static int unmap_pages(gm_heap *h, gm_block *b, size_t p0, size_t p1, int restock) {
    size_t done = p0;
    int rc = GM_OK;
    if (h->no_sync) return GM_EDEVICE;
    while (done < p1) {
        size_t next = gm_chunk_end(h, done);
        if ((rc = unmap_chunk(h, done, restock))) break;
        done = next;
    }
    if (done == p0) return rc;
    /* Cut b into [free][unmapped p0..done)[free]. */
    uintptr_t lo = gm_page_addr(h, p0), hi = gm_page_addr(h, done);
    gm_run_detach(h, b);
    index_remove(h, b);
    gm_block *mid = b;
    if (lo > b->addr) {
        mid = split(h, b, lo - b->addr);
        index_insert(h, b);
    }
    if (mid->addr + mid->size > hi) index_insert(h, split(h, mid, hi - mid->addr));
    gm_hist(h, GM_H_UNMAP, lo, hi - lo, ANY, 0);
    gm_run_attach(h, make_unmapped(h, mid));
    return rc;
}

struct cached_run {
    gm_block *b;
    size_t p0, p1;
};

/* Blocks in recycling order: the smallest first and, among equal sizes, the
 * highest address first.  One cursor per index of the general heap walks it
 * in index order (sizes ascending, addresses ascending among equals, see
 * freeindex.h); the blocks of the next size from every cursor are gathered
 * and reversed by address.  Only blocks of at least a page can hold a whole
 * one, so the walk starts at the bin of a page, and it stops where the caller
 * has what it wants: it costs the blocks it hands out (and the rest of their
 * size), not every free block. */
struct recycle_order {
    const gm_freeindex **idx;
    gm_block **cur; /* per index: the next block in index order, NULL at the end */
    size_t n_idx;
    gm_block **same; /* the blocks of the current size, highest address first */
    size_t n_same, cap_same, next;
};

static int cmp_addr_desc(const void *x, const void *y) {
    const gm_block *a = *(gm_block *const *)x, *b = *(gm_block *const *)y;
    return a->addr < b->addr ? 1 : -1;
}

/* The next block in recycling order, NULL at the end (or on host OOM: the
 * caller then recycles what it has). */
static gm_block *recycle_next(struct recycle_order *r) {
    if (r->next < r->n_same) return r->same[r->next++];
    size_t size = SIZE_MAX;
    for (size_t i = 0; i < r->n_idx; i++)
        if (r->cur[i] && r->cur[i]->size < size) size = r->cur[i]->size;
    if (size == SIZE_MAX) return NULL;
    r->n_same = r->next = 0;
    for (size_t i = 0; i < r->n_idx; i++) {
        /* Equal sizes share a bin, so they are neighbours in the walk. */
        for (; r->cur[i] && r->cur[i]->size == size; r->cur[i] = fi_next(r->idx[i], r->cur[i])) {
            if (r->n_same == r->cap_same) {
                gm_block **a = gm_array_grow(r->same, &r->cap_same, 64, sizeof *a);
                if (!a) return NULL;
                r->same = a;
            }
            r->same[r->n_same++] = r->cur[i];
        }
    }
    qsort(r->same, r->n_same, sizeof *r->same, cmp_addr_desc);
    return r->same[r->next++];
}

/* Wholly free pages, outside the page range [ex0, ex1), that free blocks of
 * the general heap cover, back nothing and can be unmapped: up to `want` of
 * them, in the order recycle() takes them, go to *out (malloc'd; the number
 * of runs is returned, *pages the pages in them). */
static size_t cached_runs(gm_heap *h, size_t want, size_t ex0, size_t ex1, struct cached_run **out, size_t *pages) {
    struct recycle_order r = {0};
    struct cached_run *runs = NULL;
    size_t n = 0, cap = 0, chosen = 0;
    r.idx = malloc(h->n_owners * sizeof *r.idx);
    r.cur = malloc(h->n_owners * sizeof *r.cur);
    if (r.idx && r.cur) {
        for (size_t i = 0; i < h->n_owners; i++) {
            if (h->owners[i]->pool || !h->owners[i]->idx.count) continue;
            r.idx[r.n_idx] = &h->owners[i]->idx;
            r.cur[r.n_idx++] = fi_first_from(&h->owners[i]->idx, h->page);
        }
    }
    for (gm_block *b; chosen < want && r.n_idx && (b = recycle_next(&r));) {
        if (!gm_general_space(b)) continue; /* only general free space is recycled */
        size_t p0 = gm_page_ceil(h, b->addr), p1 = gm_page_floor(h, b->addr + b->size);
        if (p0 >= p1) continue;
        /* Two parts when the range splits the block: the lower first.  Only
         * whole chunks can go: a chunk that other blocks (or the range) share
         * a page of stays. */
        size_t parts[2][2] = {{p0, p1 < ex0 ? p1 : ex0}, {p0 > ex1 ? p0 : ex1, p1}};
        for (int k = 0; k < 2 && chosen < want; k++) {
            if (parts[k][0] >= parts[k][1]) continue;
            whole_chunks(h, &parts[k][0], &parts[k][1]);
            if (parts[k][0] >= parts[k][1]) continue;
            if (n == cap) {
                struct cached_run *a = gm_array_grow(runs, &cap, 64, sizeof *a);
                if (!a) goto done; /* keep what there is */
                runs = a;
            }
            /* From the top of each, down to a chunk's start. */
            size_t take = parts[k][1] - parts[k][0];
            if (take > want - chosen) take = want - chosen;
            size_t from = gm_chunk_first(h, parts[k][1] - take);
            runs[n++] = (struct cached_run){b, from, parts[k][1]};
            chosen += parts[k][1] - from;
        }
    }
done:
    free(r.idx);
    free(r.cur);
    free(r.same);
    *out = runs;
    *pages = chosen;
    return n;
}

static int cmp_run_addr(const void *x, const void *y) {
    const struct cached_run *a = x, *b = y;
    return a->p0 < b->p0 ? 1 : -1;
}

/* Unmap at least `want` cached pages outside [ex0, ex1) (or all there are)
 * into spares (`restock`: a chunk of several pages is replaced by as many
 * single spares; else it is only released).  Returns the pages unmapped.  The
 * caller has synchronised the device.  Pages come first from the smallest
 * free blocks, which can serve the fewest requests, and from the top of each
 * (cached_runs picks them).  The unmaps then run from the highest address
 * down: cutting a block keeps its record as the lower part, so runs below
 * (even of the same block) stay valid. */
static size_t recycle(gm_heap *h, size_t want, size_t ex0, size_t ex1, int restock) {
    struct cached_run *runs;
    size_t total, n = cached_runs(h, want, ex0, ex1, &runs, &total), got = 0;
    /* Each cut block may need two more records. */
    if (!n || slab_reserve(h, 2 * n + 2)) {
        free(runs);
        return 0;
    }
    qsort(runs, n, sizeof *runs, cmp_run_addr);
    for (size_t i = 0; i < n; i++) {
        size_t before = h->mapped_pages;
        int rc = unmap_pages(h, runs[i].b, runs[i].p0, runs[i].p1, restock);
        got += before - h->mapped_pages;
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
    gm_block *first; /* the run's first block, at or before addr */
    int pooled;      /* the range takes free blocks of the requesting pool */
    int beside;      /* the range starts right after another living pool's block */
} placement;

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
        pages += gm_page_ceil(h, hi) - gm_page_floor(h, lo);
    }
    return pages;
}

/* Fewest new pages first; then, for a pool's request, a range that takes the
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

static size_t cached_pages_outside(const gm_heap *h, placement pl, size_t size);

struct place_ctx {
    gm_heap *h;
    size_t size;
    gm_stream s;
    gm_pool *pool; /* the requesting pool, or NULL */
    size_t budget; /* see consider_at */
    placement best;
    placement best_pooled; /* the best that takes the pool's free memory */
};

static int ranks_before(const placement *a, const placement *b) {
    if (!b->ok || a->new_pages != b->new_pages) return !b->ok || a->new_pages < b->new_pages;
    if (a->pooled != b->pooled) return a->pooled > b->pooled;
    if (a->beside != b->beside) return a->beside < b->beside;
    return a->run < b->run || (a->run == b->run && a->addr < b->addr);
}

/* A pool's request takes pages of its own: [x, x+size) starts a page, and
 * what else its last page holds is the pool's or general space the stream
 * may use (claim_pool_pages makes it the pool's).  So no page holds blocks
 * of a living pool and anything else. */
static int pool_pages_ok(const struct place_ctx *c, const gm_block *first, uintptr_t x) {
    uintptr_t end = x + c->size, e = gm_page_addr(c->h, gm_page_ceil(c->h, end));
    if ((x - c->h->base) & (c->h->page - 1)) return 0;
    /* No page of a physical allocation the policy made with room (POLICY;
     * with chunk_pages 1 every larger one is its) that the range does not
     * wholly take: it goes back only whole, and a segment as torch counts
     * them is one pool's. */
    size_t p0 = gm_page_floor(c->h, x), p1 = gm_page_ceil(c->h, end);
    for (size_t p = p0; p < p1 && c->h->chunk_pages == 1; p++)
        if (c->h->chunk_len[p] > 1 && (gm_chunk_first(c->h, p) < p0 || gm_chunk_end(c->h, p) > p1)) return 0;
    for (const gm_block *b = first; b && b->addr < e; b = b->next) {
        if (b->addr + b->size <= end || b->pool == c->pool) continue;
        if (!gm_general_space(b) || (b->state == GM_BLOCK_FREE && b->stream != c->s && b->stream != ANY)) return 0;
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
    placement p = {1, x, 0, len, first, 0, 0};
    p.new_pages = unmapped_in(c->h, first, x, c->size, &p.pooled);
    if (p.new_pages > c->budget && p.new_pages - c->budget > cached_pages_outside(c->h, p, c->size)) return;
    /* Inside the run, the block before x is general space or the pool's own. */
    p.beside = x == first->addr && first->prev && gm_pinned(first->prev) && first->prev->pool != c->pool;
    if (ranks_before(&p, &c->best)) c->best = p;
    if (p.pooled && ranks_before(&p, &c->best_pooled)) c->best_pooled = p;
}

static void consider(struct place_ctx *c, gm_block *first, uintptr_t start, size_t len) {
    consider_at(c, first, start, len);
    if (len != c->size) consider_at(c, first, start + len - c->size, len);
}

/* The runs that stream s may use inside one run of general space: its own or
 * everyone's free blocks of the general heap (never a pool's: those are not
 * general space), and unmapped space. */
static void place_in(struct place_ctx *c, gm_block *head, uintptr_t end) {
    gm_block *first = NULL;
    size_t len = 0;
    for (gm_block *b = head;; b = b->next) {
        int in = b && b->addr < end;
        if (in && gm_general_space(b) && (b->state == GM_BLOCK_UNMAPPED || b->stream == c->s || b->stream == ANY)) {
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
    if (b->state != GM_BLOCK_FREE || (b->pool && b->pool != c->pool)) return 0;
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
    gm_owner *own = gm_owner_find(c->h, c->pool, c->s);
    if (own) fi_each(&own->idx, place_pooled_one, c);
    fi_each(&c->pool->any->idx, place_pooled_one, c);
}

/* Where [addr, addr+size) ranks first (ranks_before, and a pool's edge
 * within POOL_EDGE_PAGES), among runs of memory that stream s may use and,
 * with a `budget`, that the pages at hand can back (consider_at): a total
 * order, so the runs may be visited in any order, and only runs of general
 * space at least `size` long can hold one. */
static placement place_within(gm_heap *h, size_t size, gm_stream s, gm_pool *pool, size_t budget) {
    struct place_ctx c = {h, size, s, pool, budget, {0, 0, 0, 0, NULL, 0, 0}, {0, 0, 0, 0, NULL, 0, 0}};
    /* Lone free blocks are not in the run index; the slow path gets here when
     * none that s may use fits, except after a synchronisation.  Then the best
     * fit is the best of them if it is lone itself; if not, walk everything. */
    gm_block *f = fit_in(h, size, s, NULL);
    if (f && ((f->prev && gm_general_space(f->prev)) || (f->next && gm_general_space(f->next)))) {
        place_in(&c, h->head, h->base + h->va_size);
    } else {
        ri_each_at_least(&h->runs, size, place_in_run, &c);
        if (f) consider(&c, f, f->addr, f->size);
    }
    if (pool) place_pooled(&c);
    if (c.best_pooled.ok && c.best_pooled.new_pages <= c.best.new_pages + POOL_EDGE_PAGES) return c.best_pooled;
    return c.best;
}

static placement place(gm_heap *h, size_t size, gm_stream s, gm_pool *pool) {
    return place_within(h, size, s, pool, SIZE_MAX);
}

/* Grant access to freshly mapped pages [p0, *p1), whole chunks.  If that
 * fails, unmap them again chunk by chunk from the top (single pages become
 * spares, larger chunks are released) and lower *p1 to what is left:
 * a page that is mapped but inaccessible must never back a block.  Failing
 * calls are retried a few times, so that only a device that keeps failing can
 * leave pages behind, and then they are mapped and accessible. */
static int grant_or_take_back(gm_heap *h, size_t p0, size_t *p1) {
    int rc = h->dev->ops->set_access(h->dev, gm_page_addr(h, p0), (*p1 - p0) * h->page);
    if (!rc) return GM_OK;
    h->st.num_device_errors++;
    int granted = 0;
    for (int attempt = 0; attempt < 8 && *p1 > p0 && !granted; attempt++) {
        /* During a capture nothing may be unmapped: only ask again. */
        while (*p1 > p0 && !h->no_sync) {
            size_t q = gm_chunk_first(h, *p1 - 1); /* a whole chunk: all mapped here, after p0 */
            if (unmap_chunk(h, q, 0)) break;
            *p1 = q;
        }
        granted = *p1 > p0 && h->dev->ops->set_access(h->dev, gm_page_addr(h, p0), (*p1 - p0) * h->page) == GM_OK;
    }
    if (!granted && *p1 > p0) {
        /* Still mapped, still inaccessible, and they could not go (a capture,
         * or a device that refuses the unmap too): park them, out of every
         * block's reach, until unpark() can unmap them. */
        memset(h->parked + p0, 1, *p1 - p0);
        h->n_parked += *p1 - p0;
        *p1 = p0;
    }
    return rc;
}

/* Unmap the parked pages (see gm_heap.parked), whole chunks at a time, when
 * no capture is on.  A chunk that will not unmap stays parked. */
static void unpark(gm_heap *h) {
    for (size_t p = 0; p < h->n_pages && h->n_parked; p++) {
        if (!h->parked[p] || h->chunk_off[p]) continue;
        size_t k = h->chunk_len[p];
        if (unmap_chunk(h, p, 0)) continue;
        memset(h->parked + p, 0, k);
        h->n_parked -= k;
    }
}

/* The block that holds address x (inside the reserved range), walking from b. */
static gm_block *block_holding(gm_block *b, uintptr_t x) {
    while (b->addr > x) b = b->prev;
    while (b->addr + b->size <= x) b = b->next;
    return b;
}

/* A pool's placement pl gets a growth of its own: the pages under it that
 * are not the pool's yet (a pool's free block starts each page of the pool's
 * it takes) are numbered with the new growth, as the pages mapped for it are. */
static void stamp_pool_growth(gm_heap *h, const placement *pl, size_t size, gm_pool *pool) {
    gm_block *b = pl->first;
    for (size_t p = gm_page_floor(h, pl->addr); p < gm_page_ceil(h, pl->addr + size); p++) {
        b = block_holding(b, gm_page_addr(h, p));
        if (b->pool != pool) h->page_growth[p] = h->growth_seq;
    }
}

/* The free blocks of a pool under [x, end) become general free space, same
 * owner (the parts outside the range stay the pool's): they stop keeping
 * their pages, which the block carved from the range keeps again.  b is a
 * block at or before x.  The caller keeps the runs out of the run index. */
static void pool_blocks_to_general(gm_heap *h, gm_block *b, uintptr_t x, uintptr_t end) {
    for (b = block_holding(b, x); b && b->addr < end; b = b->next) {
        if (b->state != GM_BLOCK_FREE || !b->pool) continue;
        index_remove(h, b);
        if (b->addr < x) {
            gm_block *r = split(h, b, x - b->addr);
            index_insert(h, b);
            b = r;
        }
        if (b->addr + b->size > end) index_insert(h, split(h, b, end - b->addr));
        gm_pages_use(h, b, -1);
        b->pool = NULL;
        index_insert(h, b);
    }
}

/* Map every unmapped page under [x, x+size) with spare pages, then new chunks
 * *grant allows (map_fresh), and make the range one free block owned by s:
 * general space, after the free blocks of `pool` (if any) under it join it.
 * Returns that block, or NULL on a device error (pages mapped so far stay
 * mapped and free, the pool's blocks stay the pool's: nothing is lost). */
static gm_block *back_range_in_run(gm_heap *h, gm_block *from, uintptr_t x, size_t size, gm_stream s, gm_pool *pool,
                                   int remap, size_t most, size_t *grant, int *err) {
    gm_block *b = block_holding(from, x);
    uintptr_t end = x + size;
    size_t cuts = 4;
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
        size_t p0 = gm_page_floor(h, lo), p1 = gm_page_ceil(h, hi);
        int rc = GM_OK;
        size_t p = most > h->chunk_pages && most >= ROOM_CHUNK_MIN
                       ? map_interior(h, p0, p1, gm_page_floor(h, x), gm_page_ceil(h, end), most, grant, &rc)
                       : map_fresh(h, p0, p1, most, grant, &rc);
        if (p > p0) {
            int arc = grant_or_take_back(h, p0, &p);
            if (!rc) rc = arc;
            for (size_t q = p0; q < p; q++) h->page_growth[q] = h->growth_seq;
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
    /* The range is now free; merge what ownership kept apart (s and ANY only).
     * `from` is still a block: it starts a run that s may use, so it never
     * merges into the block before it, and merges keep the lower record. */
    if (pool) pool_blocks_to_general(h, from, x, end);
    b = block_holding(from, x);
    while (b->addr + b->size < end) {
        gm_block *n = b->next;
        gm_stream o;
        if (b->state != GM_BLOCK_FREE || n->state != GM_BLOCK_FREE || !owners_merge(b->stream, n->stream, &o))
            return NULL; /* cannot happen: place() only chose usable runs */
        merge_free(h, b, n, o);
    }
    return b->state == GM_BLOCK_FREE ? b : NULL;
}

/* Back placement pl.  A range in one run of general space: that run is out of
 * the run index while it changes (`from` survives every change, see above).
 * A range that takes free blocks of `pool` joins runs on either side of them:
 * every run the range and its two neighbours are in is out meanwhile (`lo`,
 * the block before the range's first, survives: merges keep lower records). */
static gm_block *back_range(gm_heap *h, const placement *pl, size_t size, gm_stream s, gm_pool *pool, int remap,
                            size_t most, size_t *grant, int *err) {
    gm_block *from = pl->first;
    if (!pl->pooled) {
        if (from->pool) {
            /* A run with pool blocks, but none under the range: start from the
             * general block after the last pool block before it. */
            gm_block *b = block_holding(from, pl->addr);
            while (!b->prev->pool) b = b->prev;
            from = b;
        }
        gm_run_detach(h, from);
        gm_block *b = back_range_in_run(h, from, pl->addr, size, s, NULL, remap, most, grant, err);
        gm_run_attach(h, from);
        return b;
    }
    uintptr_t end = pl->addr + size;
    gm_block *lo = block_holding(from, pl->addr);
    if (lo->prev) lo = lo->prev;
    for (gm_block *b = lo; b && b->addr <= end; b = b->next) gm_run_detach(h, b);
    gm_block *r = back_range_in_run(h, from, pl->addr, size, s, pool, remap, most, grant, err);
    for (gm_block *b = lo; b && b->addr <= end; b = b->next)
        if (gm_general_space(b) && !gm_run_head(b)->run_len) gm_run_attach(h, b);
    return r;
}

/* ---- reports ------------------------------------------------------------------------- */

/* A block whose pages nothing may take: live, pending, or kept for a living pool. */
static inline int holds_pages(const gm_block *b) {
    return b->state == GM_BLOCK_LIVE || b->state == GM_BLOCK_PENDING || (b->state == GM_BLOCK_FREE && gm_pinned(b));
}

/* Pages that such blocks touch.  Only reports ask (they walk every block
 * anyway); the slow path counts with the run index's page use. */
size_t gm_used_pages(gm_heap *h) {
    size_t used = 0, last = SIZE_MAX; /* last page counted */
    for (gm_block *b = h->head; b; b = b->next) {
        if (!holds_pages(b)) continue;
        size_t p0 = gm_page_floor(h, b->addr), p1 = gm_page_ceil(h, b->addr + b->size);
        if (last != SIZE_MAX && p0 <= last) p0 = last + 1;
        if (p1 > p0) used += p1 - p0;
        if (p1 > 0) last = p1 - 1;
    }
    return used;
}

static size_t chunk_locked(const gm_heap *h, size_t ex0, size_t ex1);
static size_t gap_locked(const gm_heap *h, size_t g0, size_t g1);

/* A run of general space as alternating segments: free (mapped) bytes, and
 * unmapped pages (fill_report). */
struct run_seg {
    size_t bytes, unmapped; /* unmapped: pages, 0 for a free segment */
};

/* Append block b to the run's segments; 1 on host OOM. */
static int run_seg_add(struct run_seg **seg, size_t *n, size_t *cap, const gm_block *b, size_t page) {
    size_t unm = b->state == GM_BLOCK_UNMAPPED ? b->size / page : 0;
    if (*n && (!unm) == (!(*seg)[*n - 1].unmapped)) {
        (*seg)[*n - 1].bytes += b->size;
        (*seg)[*n - 1].unmapped += unm;
        return 0;
    }
    if (*n == *cap) {
        struct run_seg *a = gm_array_grow(*seg, cap, 64, sizeof *a);
        if (!a) return 1;
        *seg = a;
    }
    (*seg)[(*n)++] = (struct run_seg){b->size, unm};
    return 0;
}

/* The longest range in a run whose unmapped pages number at most `fill`:
 * whole segments with at most `fill` unmapped pages between them, then what
 * is left of `fill` reaches into the unmapped segments on either side. */
static size_t run_seg_best(const struct run_seg *seg, size_t n, size_t fill, size_t page) {
    size_t best = 0, j = 0, cost = 0, bytes = 0;
    for (size_t i = 0; i < n; i++) {
        if (j < i) j = i, cost = bytes = 0;
        while (j < n && cost + seg[j].unmapped <= fill) {
            cost += seg[j].unmapped;
            bytes += seg[j].bytes;
            j++;
        }
        size_t ext = (j < n ? seg[j].unmapped : 0) + (i > 0 ? seg[i - 1].unmapped : 0), left = fill - cost;
        size_t v = bytes + (left < ext ? left : ext) * page;
        if (v > best) best = v;
        if (j > i) {
            cost -= seg[i].unmapped;
            bytes -= seg[i].bytes;
        }
    }
    return best;
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
    size_t used = gm_used_pages(h) - h->paused_pages; /* paused pages are used but not held */
    o->cached_bytes = (held_pages(h) - used) * h->page;
    o->chunk_locked_bytes = chunk_locked(h, 0, 0) * h->page;
    /* Pages a request could end up with: everything the heap holds that backs
     * no live block, plus what the device and the cap still allow. */
    size_t obtainable = held_pages(h) + dfree / h->page;
    if (obtainable > h->cap_pages) obtainable = h->cap_pages;
    size_t avail = obtainable > used ? obtainable - used : 0;
    size_t locked = o->chunk_locked_bytes / h->page, movable = avail > locked ? avail - locked : 0;
    size_t run = 0, best_run = 0, in_place = 0, n_seg = 0, cap_seg = 0;
    uintptr_t run_start = 0;
    struct run_seg *seg = NULL;
    int seg_oom = 0;
    /* Free memory kept for living pools serves no other request: it is
     * reported apart and counts as used here. */
    for (size_t i = 0; i < h->n_pools; i++)
        if (h->pools[i]->use_count > 0) o->pool_live_bytes += h->pools[i]->live_bytes;
    o->pool_free_bytes = h->pool_free_bytes;
    for (gm_block *b = h->head;; b = b->next) {
        int pinned = b && gm_pinned(b);
        if (b && b->state == GM_BLOCK_FREE && !pinned) {
            o->free_mapped_bytes += b->size;
            if (b->size > o->largest_free_mapped) o->largest_free_mapped = b->size;
        }
        if (b && ((b->state == GM_BLOCK_FREE && !pinned) || b->state == GM_BLOCK_UNMAPPED)) {
            if (!run) run_start = b->addr;
            run += b->size;
            if (run > best_run) best_run = run;
            if (locked && !seg_oom) seg_oom = run_seg_add(&seg, &n_seg, &cap_seg, b, h->page);
            continue;
        }
        if (run && locked && !seg_oom) {
            /* With pages locked in chunks a run's free bytes serve only in
             * place; its unmapped parts get pages that can move (elsewhere: the
             * run's own movable pages are in place already) or new ones. */
            size_t g0 = gm_page_ceil(h, run_start), g1 = gm_page_floor(h, run_start + run), here = 0;
            for (size_t q = g0; q < g1; q++) here += h->page_handle[q] != 0;
            if (g0 < g1) here -= gap_locked(h, g0, g1);
            size_t can = run_seg_best(seg, n_seg, movable > here ? movable - here : 0, h->page);
            if (can > in_place) in_place = can;
        }
        run = n_seg = 0;
        if (!b) break;
    }
    free(seg);
    /* Without the segments (host memory): only what lies free in one place. */
    size_t possible = !locked ? avail * h->page : seg_oom ? o->largest_free_mapped : in_place;
    o->largest_possible = possible < best_run ? possible : best_run;
    if (o->largest_free_mapped > o->largest_possible) o->largest_possible = o->largest_free_mapped;
    /* A request larger than the cap is refused whatever lies free. */
    if (o->largest_possible > o->cap_bytes) o->largest_possible = o->cap_bytes;
}

void gm_memory_report(gm_heap *h, size_t size, gm_oom_info *out) {
    pthread_mutex_lock(&h->lock);
    /* A size within 511 bytes of SIZE_MAX has no rounded value: it stays as given. */
    fill_report(h, size > SIZE_MAX - (GM_ALIGN - 1) ? size : align_up(size, GM_ALIGN), ANY, out);
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

static int capture_on(gm_heap *h, gm_stream s);
static int other_capture(gm_heap *h);

static int out_of_memory(gm_heap *h, size_t size, gm_stream s, size_t short_pages, int dev_err) {
    /* Pages gathered for a request that failed would only starve others (but
     * during a capture they stay: a release would invalidate it). */
    if (!h->no_sync) h->no_sync = capture_on(h, s) || other_capture(h);
    release_spares(h, h->mapped_pages);
    fill_report(h, size, s, &h->last_oom);
    h->last_oom.pages_needed = short_pages;
    h->last_oom.device_error = dev_err;
    h->have_oom = 1;
    h->st.num_ooms++;
    gm_hist(h, GM_H_OOM, 0, size, s, 0);
    return GM_ENOMEM;
}

/* Of the pages [g0, g1) that no block keeping its pages touches, those in a
 * chunk that reaches past either end: a chunk goes only as a whole. */
static size_t gap_locked(const gm_heap *h, size_t g0, size_t g1) {
    size_t a = g0, b = g1;
    if (h->chunk_len[a] && h->chunk_off[a]) a = gm_chunk_end(h, a) < g1 ? gm_chunk_end(h, a) : g1;
    if (a < b && h->chunk_len[b - 1] && gm_chunk_end(h, b - 1) > g1)
        b = gm_chunk_first(h, b - 1) > a ? gm_chunk_first(h, b - 1) : a;
    return (a - g0) + (g1 - b);
}

/* Pages that no block keeping its pages touches, outside the page range
 * [ex0, ex1), but that share a chunk of several pages with one that such a
 * block touches (or with the range): cached, yet they cannot be unmapped.
 * A walk over the blocks, made only while chunks of several pages are
 * mapped: each gap between the page ranges those blocks keep (and the
 * range) loses the ends that chunks reaching past it cover. */
static size_t chunk_locked(const gm_heap *h, size_t ex0, size_t ex1) {
    if (!h->multi_chunks) return 0;
    size_t locked = 0, g0 = 0; /* the gap being measured starts at page g0 */
    for (const gm_block *b = h->head;; b = b->next) {
        if (b && !gm_keeps_pages(b)) continue;
        size_t f = b ? gm_page_floor(h, b->addr) : h->n_pages;
        size_t e = b ? gm_page_floor(h, b->addr + b->size - 1) + 1 : h->n_pages;
        if (ex0 < ex1 && ex0 <= f) {
            if (ex0 > g0) locked += gap_locked(h, g0, ex0);
            if (ex1 > g0) g0 = ex1;
            ex0 = ex1;
        }
        if (f > g0) locked += gap_locked(h, g0, f);
        if (e > g0) g0 = e;
        if (!b) break;
    }
    return locked;
}

/* Mapped pages that no block keeping its pages touches (gm_keeps_pages: live,
 * or kept for a living pool), outside the page range [ex0, ex1): pages wholly
 * under general free or pending blocks, whatever their owners.  After a
 * synchronisation they are wholly free and can go.  [ex0, ex1) is a
 * placement's range, which lies in general space: a block that keeps its
 * pages touches a page of it only by starting or ending there, so live_ep
 * says which.  Pages locked in a chunk that something else uses do not count
 * (chunk_locked). */
static size_t cached_pages(const gm_heap *h, size_t ex0, size_t ex1) {
    /* Paused pages are counted in live_pages but are not mapped. */
    size_t pages = h->mapped_pages + h->paused_pages - h->runs.live_pages;
    if (ex1 > h->n_pages) ex1 = h->n_pages;
    for (size_t p = ex0; p < ex1; p++) pages -= h->page_handle[p] && !h->runs.live_ep[p];
    return pages - chunk_locked(h, ex0, ex1);
}

/* Cached pages a defragmentation could move behind placement pl.  A range
 * that takes a pool's free blocks holds pages those keep that no block starts
 * or ends in (cached_pages cannot tell them from cached ones): counted back. */
static size_t cached_pages_outside(const gm_heap *h, placement pl, size_t size) {
    size_t ex0 = gm_page_floor(h, pl.addr), ex1 = gm_page_ceil(h, pl.addr + size);
    size_t pages = cached_pages(h, ex0, ex1);
    for (const gm_block *b = pl.first; pl.pooled && b && b->addr < pl.addr + size; b = b->next) {
        if (!gm_keeps_pages(b)) continue;
        size_t p0 = gm_page_floor(h, b->addr) + 1, p1 = gm_page_floor(h, b->addr + b->size - 1);
        if (p0 < ex0) p0 = ex0;
        if (p1 > ex1) p1 = ex1;
        if (p1 > p0) pages += p1 - p0;
    }
    return pages;
}

/* Pages placement pl lacks beyond the spares and the pages promised. */
static inline size_t lacking(const gm_heap *h, const placement *pl, size_t grant) {
    return pl->new_pages > h->n_spare + grant ? pl->new_pages - h->n_spare - grant : 0;
}

/* Unmap cached pages outside placement pl into spares for its shortfall
 * (the caller has synchronised the device), and count the remap. */
static void recycle_for(gm_heap *h, const placement *pl, size_t size, size_t grant, int *recycled) {
    size_t got = recycle(h, lacking(h, pl, grant), gm_page_floor(h, pl->addr), gm_page_ceil(h, pl->addr + size), 1);
    if (got) {
        *recycled = 1;
        h->st.num_remaps++;
        h->st.num_pages_remapped += (int64_t)got;
    }
}

/* Wait for the device, place again (every stream's free memory is usable
 * now), and unmap cached pages into spares for the placement's shortfall. */
static void defragment(gm_heap *h, placement *pl, size_t size, gm_stream s, gm_pool *pool, size_t grant, int *synced,
                       int *recycled, int *dev_err) {
    if (synchronize(h, s) != GM_OK) {
        *dev_err = GM_EDEVICE;
        return;
    }
    *synced = 1;
    *pl = place(h, size, s, pool);
    if (pl->ok && lacking(h, pl, grant)) recycle_for(h, pl, size, grant, recycled);
}

/* Growth ahead (POLICY): far from pressure, a growth of fewer than
 * ROOM_AHEAD_PAGES pages takes that many as one chunk, the rest from the
 * unmapped general space right after the range (none when the range ends
 * at a block or a pool's space), and under `limit`.  Returns the pages it
 * adds past the range's last page. */
static size_t room_ahead(gm_heap *h, const placement *pl, size_t size, size_t need, size_t limit) {
    size_t p1 = gm_page_ceil(h, pl->addr + size), held = held_pages(h) + need;
    if (pl->pooled || need >= ROOM_AHEAD_PAGES || p1 >= h->n_pages || held >= limit) return 0;
    const gm_block *c = block_holding(pl->first, gm_page_addr(h, p1));
    if (c->state != GM_BLOCK_UNMAPPED || c->pool) return 0;
    size_t avail = gm_page_floor(h, c->addr + c->size) - p1, want = ROOM_AHEAD_PAGES - need;
    if (want > avail) want = avail;
    return want < limit - held ? want : limit - held;
}

/* During a capture (h->no_sync) only steps 2, 3 (to the cap) and 5 run: no
 * event, no synchronisation, no unmap or release.  New pages are promised
 * (grow's *grant) and created as chunks where back_range maps them; if the
 * device then has too little for them even as single pages, the request
 * starts over with single spares made up front, as with chunk_pages 1 (the
 * pages mapped meanwhile stay, free). */
static int alloc_slow(gm_heap *h, size_t size, gm_stream s, gm_pool *pool, gm_block **out, uintptr_t *at) {
    h->st.num_alloc_retries++;
    size_t grant = 0, *g = h->chunk_pages > 1 ? &grant : NULL, most = h->chunk_pages;
    int single = 0; /* the device refused a chunk: single pages from then on */
again:;
    gm_block *b;
    int dev_err = GM_OK, recycled = 0, synced = 0;
    placement pl;
    size_t ahead = 0; /* pages mapped past the range (room_ahead) */
    grant = 0;
    if (h->no_sync) {
        pl = place(h, size, s, pool);
        if (pl.ok && lacking(h, &pl, grant)) grow(h, lacking(h, &pl, grant), h->cap_pages, g, &dev_err);
        synced = 1; /* as if: no defragmentation below */
        goto placed;
    }
    if (h->n_parked) unpark(h); /* no capture is on */
    /* 1. Memory other streams (or record_stream users) have finished with. */
    size_t moved = h->n_pending ? process_pending(h, 0) : 0;
    if (h->n_owners > 2 || (h->n_owners == 2 && h->owners[1]->stream != s)) moved += release_owners(h, s, 0);
    b = moved ? fit(h, size, s, pool) : NULL;
    if (b) {
        *out = b;
        *at = b->addr;
        return GM_OK;
    }
    /* 2-3. Place, and back it with spare or new pages under the growth limit,
     * or, with room, under the room line (POLICY). */
    pl = place(h, size, s, pool);
    if (pl.ok && lacking(h, &pl, grant)) {
        size_t limit = growth_limit(h, size), need = lacking(h, &pl, grant);
        /* The device is asked what is free only when room would change something. */
        size_t room = room_line(h);
        if (room > limit) limit = room;
        if (room && g == NULL && !single && held_pages(h) + need <= (size_t)(ROOM_FAR * (double)room)) {
            /* far from pressure: the new pages as chunks */
            if (need >= ROOM_CHUNK_MIN) {
                g = &grant;
                most = ROOM_CHUNK_PAGES;
            } else if (!pool && room > held_pages(h) + need + room_small_free(h)) {
                ahead = room_ahead(h, &pl, size, need, limit);
                g = &grant;
                most = ROOM_SMALL_PAGES;
            }
        }
        grow(h, need + ahead, limit, g, &dev_err);
    }
    /* 4. Defragment when cached pages can cover the shortfall (a device wait
     * buys nothing otherwise); else grow to the cap, and defragment with what
     * there is only if the device or the cap refused. */
    if (!pl.ok || (lacking(h, &pl, grant) && cached_pages_outside(h, pl, size) >= lacking(h, &pl, grant)))
        defragment(h, &pl, size, s, pool, grant, &synced, &recycled, &dev_err);
    if (pl.ok && lacking(h, &pl, grant)) grow(h, lacking(h, &pl, grant), h->cap_pages, g, &dev_err);
    if ((!pl.ok || lacking(h, &pl, grant)) && !synced) {
        defragment(h, &pl, size, s, pool, grant, &synced, &recycled, &dev_err);
        if (pl.ok && lacking(h, &pl, grant)) grow(h, lacking(h, &pl, grant), h->cap_pages, g, &dev_err);
    }
    /* Pages locked in chunks serve only in place: the range that needs the
     * fewest new pages may be one whose own cached pages are the only ones
     * that could move.  Then a range the movable pages elsewhere cover. */
    if (pl.ok && lacking(h, &pl, grant) && synced && h->multi_chunks) {
        placement alt = place_within(h, size, s, pool, h->n_spare + grant);
        if (alt.ok) {
            pl = alt;
            if (lacking(h, &pl, grant)) recycle_for(h, &pl, size, grant, &recycled);
        }
    }
placed:
    if (!pl.ok) return out_of_memory(h, size, s, (size + h->page - 1) / h->page, dev_err);
    if (lacking(h, &pl, grant)) return out_of_memory(h, size, s, lacking(h, &pl, grant), dev_err);
    int err = GM_OK;
    h->growth_seq++;
    if (pool) stamp_pool_growth(h, &pl, size, pool);
    size_t span = ahead ? gm_page_addr(h, gm_page_ceil(h, pl.addr + size) + ahead) - pl.addr : size;
    b = back_range(h, &pl, span, s, pool, recycled, most, g, &err);
    if (!b && err == GM_ENOMEM && g) {
        g = NULL; /* the device is nearly full: single pages, gathered first */
        single = 1;
        most = h->chunk_pages;
        goto again;
    }
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
    cfg->chunk_pages = GM_CHUNK_PAGES_DEFAULT;
    cfg->pressure = GM_PRESSURE_DEFAULT;
}

static _Thread_local char create_error[320];

const char *gm_create_error(void) { return create_error; }

/* Keep the reason before the device (and its last_error) goes away. */
static int create_failed(gm_device *dev, int rc, const char *what) {
    if (dev && dev->last_error[0])
        snprintf(create_error, sizeof create_error, "%s: %s", what, dev->last_error);
    else
        snprintf(create_error, sizeof create_error, "%s: %s", what, gm_strerror(rc));
    return rc;
}

int gm_heap_create(gm_device *dev, const gm_config *cfg_in, gm_heap **out) {
    *out = NULL;
    create_error[0] = 0;
    if (!dev) return create_failed(NULL, GM_EINVAL, "no device");
    gm_config cfg;
    if (cfg_in)
        cfg = *cfg_in;
    else
        gm_config_default(&cfg);
    size_t page = dev->page_size;
    char bad[200] = "device page size is not a power of two >= 512";
    if (gm_config_check(&cfg, bad, sizeof bad) != GM_OK || page < GM_ALIGN || (page & (page - 1))) {
        dev->last_error[0] = 0;
        create_failed(dev, GM_EINVAL, bad);
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
    /* GM_PAGE_SIZE_MAX: what the page tables can index.  A page larger than
     * the device could never be mapped. */
    if (page > GM_PAGE_SIZE_MAX || (total && page > total)) {
        dev->last_error[0] = 0;
        create_failed(dev, GM_EINVAL,
                      page > GM_PAGE_SIZE_MAX ? "page size exceeds 4 TiB, the largest the heap can index"
                                              : "page size exceeds the device's memory");
        dev->ops->destroy(dev);
        return GM_EINVAL;
    }
    gm_heap *h = calloc(1, sizeof *h);
    if (!h) {
        create_failed(dev, GM_ENOMEM, "host memory");
        dev->ops->destroy(dev);
        return GM_ENOMEM;
    }
    h->lazy_stream = ANY;
    h->dev = dev;
    h->page = page;
    h->page_shift = (unsigned)__builtin_ctzll((unsigned long long)page);
    h->device_total = total;
    h->growth_slack = cfg.growth_slack;
    h->growth_slack_pages = cfg.growth_slack_pages;
    h->chunk_pages = cfg.chunk_pages;
    h->pressure = cfg.pressure;
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
    h->chunk_off = calloc(h->n_pages, sizeof *h->chunk_off);
    h->chunk_len = calloc(h->n_pages, sizeof *h->chunk_len);
    h->page_growth = calloc(h->n_pages, sizeof *h->page_growth);
    h->parked = calloc(h->n_pages, 1);
    h->loose = calloc(h->cap_spare / 2 + 1, sizeof *h->loose); /* chunks of two pages or more */
    h->spare = calloc(h->cap_spare, sizeof *h->spare);
    h->live = calloc(h->live_mask + 1, sizeof *h->live);
    rc = (!h->page_handle || !h->chunk_off || !h->chunk_len || !h->page_growth || !h->parked || !h->loose ||
          !h->spare || !h->live || ri_init(&h->runs, h->n_pages) || !owner_get(h, NULL, ANY) || slab_grow(h))
             ? GM_ENOMEM
             : GM_OK;
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
    gm_run_attach(h, h->head);
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
        h->n_pages = h->n_spare = h->n_loose = h->n_event_pool = 0;
        h->va_size = 0;
    }
    if (h->page_handle && h->chunk_len) {
        for (size_t p = 0; p < h->n_pages; p++) {
            if (!h->page_handle[p] || h->chunk_off[p]) continue; /* a chunk at its first page */
            dev->ops->unmap(dev, gm_page_addr(h, p), h->chunk_len[p] * h->page);
            dev->ops->release(dev, h->page_handle[p]);
        }
    }
    for (size_t i = 0; i < h->n_spare; i++) dev->ops->release(dev, h->spare[i]);
    for (size_t i = 0; i < h->n_loose; i++) dev->ops->release(dev, h->loose[i].handle);
    for (gm_block *b = h->pending_head; b; b = b->lnext)
        for (uint32_t i = 0; i < b->n_uses; i++)
            if (b->events[i]) dev->ops->event_destroy(dev, b->events[i]);
    for (size_t i = 0; i < h->n_owners; i++) {
        if (h->owners[i]->releasing) dev->ops->event_destroy(dev, h->owners[i]->release_event);
        free(h->owners[i]);
    }
    for (size_t i = 0; i < h->n_event_pool; i++) dev->ops->event_destroy(dev, h->event_pool[i]);
    for (size_t i = 0; i < h->n_pools; i++) {
        gm_pool *p = h->pools[i];
        if (p->backup && dev->ops->host_free && !host_only) dev->ops->host_free(dev, p->backup);
        free(p->paused_list);
        free(p);
    }
    free(h->pools);
    if (h->va_size && h->base) dev->ops->unreserve(dev, h->base, h->va_size);
    for (gm_block *b = h->head; b; b = b->next) {
        free(b->uses);
        free(b->events);
    }
    for (size_t i = 0; i < h->n_slab_chunks; i++) free(h->slab_chunks[i]);
    free(h->slab_chunks);
    free(h->owners);
    free(h->owner_tab);
    free(h->event_pool);
    free(h->live);
    free(h->spare);
    free(h->loose);
    free(h->chunk_off);
    free(h->chunk_len);
    free(h->page_growth);
    free(h->parked);
    free(h->page_handle);
    ri_free(&h->runs);
    gm_hist_free(h);
    pthread_mutex_destroy(&h->lock);
    if (!host_only) dev->ops->destroy(dev);
    free(h);
}

gm_device *gm_heap_device(gm_heap *h) { return h->dev; }

/* ---- stream capture -------------------------------------------------------------------- */

/* Whether stream s is capturing by the device's word; `if_unknown` when the
 * device cannot say (a stream destroyed since, a failing driver). */
static int device_capturing(gm_heap *h, gm_stream s, int if_unknown) {
    int (*status)(gm_device *, gm_stream, int *) = h->dev->ops->capture_status;
    if (!status || s == ANY) return 0;
    int c = 0;
    return status(h->dev, s, &c) != GM_OK ? if_unknown : c;
}

/* Whether a call on behalf of stream s now could invalidate a capture: the
 * heap was told so, or the device says s is capturing (or cannot say). */
static int capture_on(gm_heap *h, gm_stream s) { return h->capture_count > 0 || device_capturing(h, s, 1); }

/* Record the events of a pending block, one per record_stream use; if one
 * cannot be recorded, the block waits for the next device synchronisation. */
static void record_uses(gm_heap *h, gm_block *b) {
    b->wait_sync = 0;
    for (uint32_t i = 0; i < b->n_uses; i++) {
        b->events[i] = 0;
        if (!b->wait_sync && !event_record(h, b->uses[i], &b->events[i])) b->wait_sync = 1;
    }
}

/* Record the events of blocks freed during a capture, once no stream they
 * name is capturing (torch: "events deferred until no capture"). */
static void record_deferred(gm_heap *h) {
    for (gm_block *b = h->pending_head; b && h->n_deferred; b = b->lnext) {
        if (!b->deferred) continue;
        /* A stream that cannot answer is taken as done capturing: its event
         * record may fail, and then the block waits for a device sync. */
        int busy = h->capture_count > 0 || device_capturing(h, b->stream, 0);
        for (uint32_t i = 0; i < b->n_uses && !busy; i++) busy = device_capturing(h, b->uses[i], 0);
        if (busy) continue;
        b->deferred = 0;
        h->n_deferred--;
        record_uses(h, b);
    }
}

/* A capture the heap only knows from the device, on a stream other than the
 * requester's, still under way: a block freed during it is still deferred
 * once those whose captures ended have their events.  Then a device-wide call
 * (synchronize, unmap) would invalidate that capture too. */
static int other_capture(gm_heap *h) {
    if (!h->n_deferred) return 0;
    record_deferred(h);
    return h->n_deferred > 0;
}

void gm_capture_begin(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    h->capture_count++;
    pthread_mutex_unlock(&h->lock);
}

void gm_capture_end(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    if (h->capture_count > 0 && --h->capture_count == 0) {
        if (h->n_deferred) record_deferred(h);
        if (h->n_parked && !other_capture(h)) unpark(h);
    }
    pthread_mutex_unlock(&h->lock);
}

int gm_capturing(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    int c = h->capture_count;
    pthread_mutex_unlock(&h->lock);
    return c;
}

/* ---- allocation and free --------------------------------------------------------------- */

static gm_pool *pool_find(const gm_heap *h, const gm_pool_id *id) {
    for (size_t i = 0; i < h->n_pools; i++) {
        gm_pool *p = h->pools[i];
        if (p->use_count > 0 && p->id.first == id->first && p->id.second == id->second) return p;
    }
    return NULL;
}

/* Before pending blocks are looked at: not during a capture, and blocks freed
 * during one get their events first. */
static void pending_step(gm_heap *h, gm_stream s) {
    if (!h->n_pending) return;
    if ((h->no_sync = capture_on(h, s) || other_capture(h))) return;
    process_pending(h, 0);
}

/* b (free, carved) becomes live for s, in pool p. */
static void make_live(gm_heap *h, gm_block *b, size_t size, size_t requested, gm_stream s, uint64_t context,
                      gm_pool *p) {
    int kept = gm_keeps_pages(b);
    if (!gm_general_space(b)) {
        b->state = GM_BLOCK_LIVE; /* a pool's free block: no run changes */
    } else if (b->run_len && b->next && gm_general_space(b->next) &&
               !(b->next->state == GM_BLOCK_FREE && b->run_len - b->size == b->next->size)) {
        /* Carved from the front of an indexed run: the rest stays one indexed
         * run (not a lone free block). */
        ri_move_head(&h->runs, b, b->next, b->run_len - b->size);
        b->state = GM_BLOCK_LIVE;
    } else {
        gm_run_detach(h, b);
        b->state = GM_BLOCK_LIVE;
        if (b->prev && gm_general_space(b->prev)) gm_run_attach(h, b->prev);
        if (b->next && gm_general_space(b->next)) gm_run_attach(h, b->next);
    }
    if (!kept) gm_pages_use(h, b, 1);
    b->stream = s;
    b->requested = requested;
    b->context = context;
    b->seq = ++h->alloc_seq;
    b->pool = p;
    if (p) {
        p->live_blocks++;
        p->live_bytes += size;
    }
    live_insert(h, b);
    h->live_bytes += size;
    int pool = gm_pool_of(size);
    gm_stat_up(h->st.allocation, pool, 1);
    gm_stat_up(h->st.allocated_bytes, pool, (int64_t)size);
    gm_stat_up(h->st.requested_bytes, pool, (int64_t)requested);
    gm_stat_up(h->st.active, pool, 1);
    gm_stat_up(h->st.active_bytes, pool, (int64_t)size);
    if ((size_t)h->st.active_bytes[GM_POOL_ALL].current > h->peak_live)
        h->peak_live = (size_t)h->st.active_bytes[GM_POOL_ALL].current;
    gm_hist(h, GM_H_ALLOC, b->addr, size, s, context);
}

/* b, just made live in pool p from pages of its own (pool_pages_ok): the
 * general free memory on its last page becomes p's free memory, so that the
 * page holds p's blocks only for as long as p lives. */
static void claim_pool_pages(gm_heap *h, gm_block *b, gm_pool *p) {
    uintptr_t e = gm_page_addr(h, gm_page_ceil(h, b->addr + b->size));
    for (gm_block *r = b->next; r && r->addr < e; r = r->next) {
        if (r->state != GM_BLOCK_FREE || r->pool) continue;
        gm_run_detach(h, r);
        index_remove(h, r);
        if (r->addr + r->size > e) index_insert(h, split(h, r, e - r->addr));
        r->pool = p;
        gm_pages_use(h, r, 1);
        gm_stream o;
        gm_block *q = r->prev, *n = r->next;
        if (q->state == GM_BLOCK_FREE && q->pool == p && !gm_pool_seam(h, q, r) &&
            owners_merge(q->stream, r->stream, &o)) {
            index_remove(h, q);
            absorb(h, q, r);
            q->stream = o;
            r = q;
        }
        if (n && n->state == GM_BLOCK_FREE && n->pool == p && !gm_pool_seam(h, r, n) &&
            owners_merge(r->stream, n->stream, &o)) {
            index_remove(h, n);
            absorb(h, r, n);
            r->stream = o;
        }
        index_insert(h, r);
        if (r->next && gm_general_space(r->next)) gm_run_attach(h, r->next);
    }
}

int gm_malloc_pool(gm_heap *h, size_t size, gm_stream s, uint64_t context, const gm_pool_id *pool_id, uintptr_t *out) {
    if (!out) return GM_EINVAL;
    *out = 0;
    if (s == ANY) return GM_EINVAL;
    if (size > ((size_t)1 << 52)) return GM_EINVAL;
    size_t rsize = align_up(size ? size : 1, GM_ALIGN);
    pthread_mutex_lock(&h->lock);
    int rc = GM_OK;
    gm_pool *pool = NULL;
    if (pool_id && !(pool = pool_find(h, pool_id))) {
        rc = GM_EINVAL;
        goto done;
    }
    if (pool && pool->paused) {
        rc = GM_EPAUSED;
        goto done;
    }
    h->no_sync = h->capture_count > 0;
    if (rsize > h->va_size || rsize > h->cap_pages * h->page) {
        rc = out_of_memory(h, rsize, s, (rsize + h->page - 1) / h->page, GM_OK);
        goto done;
    }
    if (pool && pool->no_split) rsize = align_up(rsize, h->page); /* whole pages, never split */
    if ((rc = slab_reserve(h, 6)) || (h->n_live >= h->live_mask && (rc = live_grow(h)))) goto done;
    if (h->n_owners >= h->owners_trim_at && (!gm_owner_find(h, NULL, s) || (pool && !gm_owner_find(h, pool, s))))
        owners_trim(h);
    if ((!gm_owner_find(h, NULL, s) && !owner_get(h, NULL, s)) ||
        (pool && !gm_owner_find(h, pool, s) && !owner_get(h, pool, s))) {
        rc = GM_ENOMEM;
        goto done;
    }
    /* Another stream looks only at its own and everyone's indexes. */
    if (h->lazy_stream != ANY && s != h->lazy_stream) settle_release(h);
    if (h->n_pending) pending_step(h, s);
    gm_block *b = fit(h, rsize, s, pool);
    uintptr_t at = b ? snug_end(h, b, rsize) : 0;
    if (!b) {
        if (!h->no_sync) h->no_sync = capture_on(h, s) || other_capture(h);
        if ((rc = alloc_slow(h, rsize, s, pool, &b, &at))) goto done;
    }
    if (pool && pool->no_split && b->pool == pool) at = b->addr, rsize = b->size; /* the whole free block */
    b = carve(h, b, at, rsize);
    make_live(h, b, rsize, size, s, context, pool);
    if (pool && b->next && b->next->state == GM_BLOCK_FREE && !b->next->pool) claim_pool_pages(h, b, pool);
    *out = b->addr;
done:
    h->no_sync = 0;
    pthread_mutex_unlock(&h->lock);
    return rc;
}

int gm_malloc(gm_heap *h, size_t size, gm_stream s, uint64_t context, uintptr_t *out) {
    return gm_malloc_pool(h, size, s, context, NULL, out);
}

static int not_live(const gm_heap *h, uintptr_t ptr) {
    return (ptr >= h->base && ptr < h->base + h->va_size) ? GM_EDOUBLE_FREE : GM_EUNKNOWN_PTR;
}

/* Free the live block b, already out of the live table. */
static void free_block(gm_heap *h, gm_block *b) {
    h->live_bytes -= b->size;
    int pool = gm_pool_of(b->size);
    gm_stat_down(h->st.allocation, pool, 1);
    gm_stat_down(h->st.allocated_bytes, pool, (int64_t)b->size);
    gm_stat_down(h->st.requested_bytes, pool, (int64_t)b->requested);
    gm_hist(h, GM_H_FREE_REQUESTED, b->addr, b->size, b->stream, b->context);
    if (!b->n_uses) {
        complete_free(h, b);
        return;
    }
    /* Other streams may still touch it: one event per stream, and the block
     * waits.  If an event cannot be recorded, it waits for the next device
     * synchronisation instead.  During a capture no event may be recorded:
     * the block waits with none until the capture ends. */
    int capt = capture_on(h, b->stream) || other_capture(h);
    for (uint32_t i = 0; i < b->n_uses && !capt; i++) capt = capture_on(h, b->uses[i]);
    b->state = GM_BLOCK_PENDING;
    if (!gm_pinned(b)) gm_pages_use(h, b, -1); /* a living pool's keeps its pages */
    pending_append(h, b);
    if (capt) {
        b->wait_sync = 0;
        for (uint32_t i = 0; i < b->n_uses; i++) b->events[i] = 0;
        b->deferred = 1;
        h->n_deferred++;
    } else {
        record_uses(h, b);
    }
}

int gm_free(gm_heap *h, uintptr_t ptr) {
    pthread_mutex_lock(&h->lock);
    gm_block *b = live_remove(h, ptr);
    if (!b) {
        int rc = not_live(h, ptr);
        pthread_mutex_unlock(&h->lock);
        return rc;
    }
    free_block(h, b);
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
        /* uses and events share cap_uses: it grows once both arrays have grown. */
        size_t cap_u = b->cap_uses, cap_e = b->cap_uses;
        gm_stream *u = b->cap_uses <= UINT32_MAX / 2 ? gm_array_grow(b->uses, &cap_u, 2, sizeof *u) : NULL;
        if (u) b->uses = u;
        gm_event *e = u ? gm_array_grow(b->events, &cap_e, 2, sizeof *e) : NULL;
        if (e) b->events = e;
        if (!u || !e) {
            rc = GM_ENOMEM;
            goto done;
        }
        b->cap_uses = (uint32_t)cap_u;
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
    /* During a capture nothing may be unmapped or released: later. */
    if (h->capture_count > 0 || other_capture(h)) return GM_OK;
    if (h->n_parked) unpark(h);
    int rc = release_spares(h, target);
    if (rc || held_pages(h) <= target) return rc;
    /* Pending blocks count as free here: the synchronisation completes them. */
    if (!cached_pages(h, 0, 0)) return GM_OK;
    if ((rc = synchronize(h, ANY))) return rc; /* spares are gone already; nothing else is safe */
    size_t want = held_pages(h) - target, got = recycle(h, want, 0, 0, 0);
    if (got) gm_hist(h, GM_H_EMPTY_CACHE, 0, got * h->page, ANY, 0);
    /* What cannot go backs live blocks (or an unmap failed). */
    return release_spares(h, target);
}

int gm_empty_cache(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    int rc = trim(h, 0);
    owners_trim(h); /* the streams whose memory went */
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

/* ---- private pools ----------------------------------------------------------------------- */

static void pool_delete(gm_heap *h, gm_pool *p) {
    for (size_t i = 0; i < h->n_pools; i++) {
        if (h->pools[i] != p) continue;
        h->pools[i] = h->pools[--h->n_pools];
        break;
    }
    free(p);
}

static int valid_id(const gm_pool_id *id) { return id->first || id->second; }

int gm_pool_retain(gm_heap *h, gm_pool_id id) {
    if (!valid_id(&id)) return GM_EINVAL;
    pthread_mutex_lock(&h->lock);
    int rc = GM_OK;
    gm_pool *p = pool_find(h, &id);
    if (p) {
        p->use_count++;
        goto done;
    }
    if (h->n_pools == h->cap_pools) {
        gm_pool **a = gm_array_grow(h->pools, &h->cap_pools, 8, sizeof *a);
        if (!a) {
            rc = GM_ENOMEM;
            goto done;
        }
        h->pools = a;
    }
    if (!(p = calloc(1, sizeof *p))) {
        rc = GM_ENOMEM;
        goto done;
    }
    p->id = id;
    p->use_count = 1;
    if (!(p->any = owner_get(h, p, ANY))) {
        free(p);
        rc = GM_ENOMEM;
        goto done;
    }
    h->pools[h->n_pools++] = p;
done:
    pthread_mutex_unlock(&h->lock);
    return rc;
}

int gm_pool_set_no_split(gm_heap *h, gm_pool_id id, int no_split) {
    pthread_mutex_lock(&h->lock);
    gm_pool *p = valid_id(&id) ? pool_find(h, &id) : NULL;
    if (p) p->no_split = no_split != 0;
    pthread_mutex_unlock(&h->lock);
    return p ? GM_OK : GM_EINVAL;
}

struct to_general_ctx {
    gm_heap *h;
    gm_owner *from;
};

/* A free block of an ending pool joins the general heap, same owner: it stops
 * keeping its pages and joins the runs of general space beside it. */
static int to_general(gm_block *b, void *arg) {
    struct to_general_ctx *c = arg;
    gm_heap *h = c->h;
    index_remove(h, b);
    gm_pages_use(h, b, -1);
    if (b->prev) gm_run_detach(h, b->prev);
    if (b->next) gm_run_detach(h, b->next);
    b->pool = NULL;
    index_insert(h, b);
    gm_run_attach(h, b);
    return 0;
}

/* The pool's last use is gone: its free blocks join the general heap now (and
 * merge with their neighbours), its owners go, and the record stays only while
 * blocks of it are live or pending. */
static void pool_end(gm_heap *h, gm_pool *p) {
    if (h->lazy_stream != ANY) settle_release(h); /* owners change below: settle who owns what first */
    p->use_count = 0;
    /* Its pending blocks will complete into the general heap. */
    for (gm_block *b = h->head; b; b = b->next)
        if (b->pool == p && b->state == GM_BLOCK_PENDING) gm_pages_use(h, b, -1);
    for (size_t i = 0; i < h->n_owners; i++) {
        gm_owner *o = h->owners[i];
        if (o->pool != p) continue;
        if (o->releasing) {
            event_put(h, o->release_event);
            o->releasing = 0;
        }
        /* What was proven done on this stream stays proven: the general
         * owner of the stream inherits the proof with the blocks. */
        gm_owner *g = o->stream == ANY ? NULL : owner_get(h, NULL, o->stream);
        if (g && g->safe_seq < o->safe_seq) g->safe_seq = o->safe_seq;
        /* A release in flight on g then covers at least what is proven. */
        if (g && g->releasing && g->release_seq < g->safe_seq) g->release_seq = g->safe_seq;
        struct to_general_ctx c = {h, o};
        fi_each(&o->idx, to_general, &c);
    }
    size_t k = 0;
    for (size_t i = 0; i < h->n_owners; i++) {
        if (h->owners[i]->pool == p)
            free(h->owners[i]);
        else
            h->owners[k++] = h->owners[i];
    }
    h->n_owners = k;
    owners_removed(h);
    p->any = NULL;
    coalesce_all(h);
    if (!p->live_blocks) pool_delete(h, p);
}

int gm_pool_release(gm_heap *h, gm_pool_id id) {
    pthread_mutex_lock(&h->lock);
    gm_pool *p = valid_id(&id) ? pool_find(h, &id) : NULL;
    /* A paused pool cannot end: its blocks' pages are gone, and ending would
     * hand its free memory to the general heap.  Resume it first.  Other uses
     * (a use_mem_pool around a refused allocation) come and go. */
    int rc = !p ? GM_EINVAL : (p->paused && p->use_count == 1) ? GM_EPAUSED : GM_OK;
    if (!rc && --p->use_count == 0) pool_end(h, p);
    pthread_mutex_unlock(&h->lock);
    return rc;
}

/* Pages any block of p touches, each counted once. */
static size_t pool_pages(gm_heap *h, const gm_pool *p) {
    size_t n = 0, last = SIZE_MAX;
    for (gm_block *b = h->head; b; b = b->next) {
        if (b->pool != p) continue;
        size_t p0 = gm_page_floor(h, b->addr), p1 = gm_page_ceil(h, b->addr + b->size);
        if (last != SIZE_MAX && p0 <= last) p0 = last + 1;
        if (p1 > p0) n += p1 - p0;
        if (p1 > 0) last = p1 - 1;
    }
    return n;
}

static void pool_fill(gm_heap *h, const gm_pool *p, gm_pool_info *out) {
    memset(out, 0, sizeof *out);
    out->id = p->id;
    out->use_count = p->use_count;
    out->live_blocks = p->live_blocks;
    out->live_bytes = p->live_bytes;
    out->free_blocks = p->free_blocks;
    out->free_bytes = p->free_bytes;
    out->pinned_pages = pool_pages(h, p);
    out->paused = p->paused;
    out->paused_pages = p->n_paused;
    out->shared_pages = p->shared_pages;
    out->backup_bytes = p->backup ? p->n_paused * h->page : 0;
}

int gm_pool_info_get(gm_heap *h, gm_pool_id id, gm_pool_info *out) {
    pthread_mutex_lock(&h->lock);
    gm_pool *p = valid_id(&id) ? pool_find(h, &id) : NULL;
    if (p) pool_fill(h, p, out);
    pthread_mutex_unlock(&h->lock);
    return p ? GM_OK : GM_EINVAL;
}

size_t gm_pool_list(gm_heap *h, gm_pool_info *out, size_t cap) {
    pthread_mutex_lock(&h->lock);
    size_t n = 0;
    for (size_t i = 0; i < h->n_pools; i++) {
        if (h->pools[i]->use_count <= 0) continue;
        if (n < cap) pool_fill(h, h->pools[i], &out[n]);
        n++;
    }
    pthread_mutex_unlock(&h->lock);
    return n;
}

size_t gm_pool_live(gm_heap *h, gm_pool_id id, uintptr_t *addrs, size_t *sizes, size_t cap) {
    pthread_mutex_lock(&h->lock);
    size_t n = 0;
    gm_pool *p = valid_id(&id) ? pool_find(h, &id) : NULL;
    for (gm_block *b = p ? h->head : NULL; b; b = b->next) {
        if (b->pool != p || b->state != GM_BLOCK_LIVE) continue;
        if (n < cap) {
            if (addrs) addrs[n] = b->addr;
            if (sizes) sizes[n] = b->size;
        }
        n++;
    }
    pthread_mutex_unlock(&h->lock);
    return n;
}

typedef struct listed {
    uintptr_t addr;
    size_t size;
} listed;

static int cmp_listed(const void *x, const void *y) {
    uintptr_t u = ((const listed *)x)->addr, v = ((const listed *)y)->addr;
    return u < v ? -1 : u > v;
}

/* The block that holds address a (a inside the reserved range). */
static gm_block *block_at(gm_heap *h, uintptr_t a) {
    gm_block *b = h->head;
    while (b && b->addr + b->size <= a) b = b->next;
    return b;
}

/* Free memory of p for the listed range [a, a+size) once the live blocks of p
 * marked for freeing are free: every block under it is a free block of p or
 * a live one of p that is to be freed and has no other stream's use. */
static int range_in_pool(gm_heap *h, const gm_pool *p, uintptr_t a, size_t size) {
    uintptr_t end = a + size;
    for (gm_block *b = block_at(h, a); b && b->addr < end; b = b->next) {
        if (b->pool != p) return 0;
        if (b->state == GM_BLOCK_FREE) continue;
        if (b->state == GM_BLOCK_LIVE && b->mark == 2 && !b->n_uses) continue;
        return 0;
    }
    return 1;
}

int gm_pool_set_live(gm_heap *h, gm_pool_id id, const uintptr_t *addrs, const size_t *sizes, size_t n,
                     gm_stream stream) {
    if (stream == ANY || (n && (!addrs || !sizes))) return GM_EINVAL;
    listed *l = malloc((n ? n : 1) * sizeof *l);
    if (!l) return GM_ENOMEM;
    for (size_t i = 0; i < n; i++) l[i] = (listed){addrs[i], sizes[i]};
    qsort(l, n, sizeof *l, cmp_listed);
    pthread_mutex_lock(&h->lock);
    int rc = GM_EINVAL;
    gm_pool *p = valid_id(&id) ? pool_find(h, &id) : NULL;
    if (!p) goto out;
    if (p->paused) {
        rc = GM_EPAUSED;
        goto out;
    }
    if (h->lazy_stream != ANY) settle_release(h); /* blocks change owners below */
    /* 1. Validate, changing nothing: the list is disjoint, inside the range,
     * 512-aligned; the pool's live blocks are marked kept (1) or to free (2);
     * every other listed range lies in free memory of the pool once the blocks
     * to free are free. */
    for (size_t k = 0; k < n; k++) {
        uintptr_t a = l[k].addr;
        size_t sz = l[k].size;
        if (!sz || a % GM_ALIGN || sz % GM_ALIGN || a < h->base || sz > h->va_size || a - h->base > h->va_size - sz)
            goto out;
        if (k && l[k - 1].addr + l[k - 1].size > a) goto out;
    }
    for (gm_block *b = h->head; b; b = b->next) b->mark = (b->pool == p && b->state == GM_BLOCK_LIVE) ? 2 : 0;
    size_t to_alloc = 0;
    for (size_t k = 0; k < n; k++) {
        gm_block *b = gm_live_find(h, l[k].addr);
        if (b && b->pool == p && b->size == l[k].size)
            b->mark = 1;
        else
            to_alloc++;
    }
    for (size_t k = 0; k < n; k++) {
        gm_block *b = gm_live_find(h, l[k].addr);
        if (b && b->mark == 1 && b->size == l[k].size) continue;
        if (!range_in_pool(h, p, l[k].addr, l[k].size)) goto out;
    }
    rc = GM_ENOMEM;
    if (slab_reserve(h, 2 * to_alloc + 4) || !owner_get(h, NULL, stream) || !owner_get(h, p, stream)) goto out;
    while (h->n_live + to_alloc >= h->live_mask)
        if (live_grow(h)) goto out;
    /* 2. Free the pool's live blocks that are not listed (into the pool). */
    h->no_sync = h->capture_count > 0;
    for (gm_block *b = h->head, *next; b; b = next) {
        next = b->next;
        if (b->mark != 2) continue;
        b->mark = 0;
        /* Freeing merges b with its free neighbours: go on after the result. */
        gm_block *prev = b->prev;
        live_remove(h, b->addr);
        free_block(h, b);
        next = prev ? prev->next : h->head;
    }
    /* 3. Allocate the listed blocks that are not live out of the pool's free
     * blocks: those under each range become one for `stream` (the caller
     * orders their earlier uses before it, as torch does); what lies outside
     * the range keeps its owner. */
    for (size_t k = 0; k < n; k++) {
        uintptr_t a = l[k].addr;
        size_t sz = l[k].size;
        gm_block *b = gm_live_find(h, a);
        if (b && b->mark == 1) continue;
        b = block_at(h, a);
        index_remove(h, b);
        if (b->addr < a) {
            gm_block *r = split(h, b, a - b->addr);
            index_insert(h, b);
            b = r;
        }
        gm_stream last = b->stream;
        uint64_t last_seq = b->seq, last_epoch = b->epoch;
        while (b->addr + b->size < a + sz) {
            gm_block *nx = b->next;
            index_remove(h, nx);
            last = nx->stream;
            last_seq = nx->seq;
            last_epoch = nx->epoch;
            absorb(h, b, nx);
        }
        if (b->addr + b->size > a + sz) {
            gm_block *r = split(h, b, sz);
            r->stream = last;
            r->seq = last_seq;
            r->epoch = last_epoch;
            index_insert(h, r);
        }
        make_live(h, b, sz, sz, stream, 0, p);
    }
    coalesce_all(h); /* what the new owners let merge */
    rc = GM_OK;
out:
    h->no_sync = 0;
    for (gm_block *b = h->head; b; b = b->next) b->mark = 0;
    pthread_mutex_unlock(&h->lock);
    free(l);
    return rc;
}

/* ---- pausing a pool ------------------------------------------------------------------------ */

/* The end of the run of list entries that starts at i: consecutive pages with
 * consecutive backup slots, which one device call covers. */
static size_t run_end(const gm_paused_page *l, size_t i, size_t n) {
    size_t j = i + 1;
    while (j < n && l[j].page == l[j - 1].page + 1 && l[j].slot == l[j - 1].slot + 1) j++;
    return j;
}

/* The pages that only blocks of p touch, ascending (*out, malloc'd), and how
 * many pages p's blocks share with other blocks. */
static int pool_own_pages(gm_heap *h, const gm_pool *p, gm_paused_page **out, size_t *n, size_t *shared) {
    size_t top = 0;
    *out = NULL;
    *n = *shared = 0;
    for (const gm_block *b = h->head; b; b = b->next)
        if (b->pool == p) top = gm_page_ceil(h, b->addr + b->size);
    if (!top) return GM_OK;
    uint8_t *m = calloc(top, 1);
    gm_paused_page *l = malloc(top * sizeof *l);
    if (!m || !l) {
        free(m);
        free(l);
        return GM_ENOMEM;
    }
    uintptr_t end = gm_page_addr(h, top);
    for (const gm_block *b = h->head; b && b->addr < end; b = b->next) {
        if (b->state == GM_BLOCK_UNMAPPED) continue; /* whole pages: never shares one */
        size_t p1 = gm_page_ceil(h, b->addr + b->size);
        for (size_t q = gm_page_floor(h, b->addr); q < p1 && q < top; q++) m[q] |= b->pool == p ? 1 : 2;
    }
    for (size_t q = 0; q < top; q++) {
        if (m[q] == 1) {
            l[*n] = (gm_paused_page){q, *n};
            (*n)++;
        }
        *shared += m[q] == 3;
    }
    free(m);
    *out = l;
    return GM_OK;
}

/* Keep of the pages list l (ascending, n entries) those whose chunk lies
 * wholly in it: a chunk that also backs other blocks stays, all of it, and
 * its listed pages count as shared.  Slots are renumbered; returns the count. */
static size_t whole_chunks_only(const gm_heap *h, gm_paused_page *l, size_t n, size_t *shared) {
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        size_t q = l[i].page, c = gm_chunk_first(h, q), e = gm_chunk_end(h, q), len = e - c;
        if (c == q && i + len <= n && l[i + len - 1].page == e - 1) {
            for (size_t t = 0; t < len; t++, k++) l[k] = (gm_paused_page){l[i + t].page, k};
            i += len;
            continue;
        }
        for (; i < n && l[i].page < e; i++) (*shared)++;
    }
    return k;
}

static int pause_refused(gm_heap *h) { return capture_on(h, 0) || other_capture(h); }

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int gm_pool_pause(gm_heap *h, gm_pool_id id, unsigned flags, gm_pause_info *out) {
    gm_pause_info info = {0};
    uint64_t t0 = mono_ns(), t1 = t0, t2 = t0;
    const gm_device_ops *ops = h->dev->ops;
    if (flags & ~(unsigned)GM_PAUSE_BACKUP) return GM_EINVAL;
    pthread_mutex_lock(&h->lock);
    int rc = GM_OK;
    gm_pool *p = valid_id(&id) ? pool_find(h, &id) : NULL;
    gm_paused_page *l = NULL;
    void *backup = NULL;
    size_t n = 0, shared = 0, done = 0;
    if (!p)
        rc = GM_EINVAL;
    else if (p->paused)
        rc = GM_EPAUSED;
    else if (pause_refused(h))
        rc = GM_ECAPTURING;
    else if ((flags & GM_PAUSE_BACKUP) && (!ops->host_alloc || !ops->host_free || !ops->copy_dtoh || !ops->copy_htod))
        rc = GM_ENOTSUP;
    if (rc) goto out;
    /* Nothing may still be running on the pages, and pending frees complete. */
    if ((rc = synchronize(h, ANY)) || (rc = pool_own_pages(h, p, &l, &n, &shared))) goto out;
    n = whole_chunks_only(h, l, n, &shared);
    t1 = t2 = mono_ns();
    if (n && (flags & GM_PAUSE_BACKUP)) {
        if ((rc = ops->host_alloc(h->dev, n * h->page, &backup))) {
            h->st.num_device_errors++;
            goto out;
        }
        for (size_t i = 0, j; i < n && !rc; i = j) {
            j = run_end(l, i, n);
            rc = ops->copy_dtoh(h->dev, (char *)backup + i * h->page, gm_page_addr(h, l[i].page), (j - i) * h->page);
        }
        if (rc) {
            h->st.num_device_errors++;
            ops->host_free(h->dev, backup);
            backup = NULL;
            rc = GM_EDEVICE;
            goto out;
        }
    }
    t2 = mono_ns();
    /* Unmap run by run (whole chunks, one call a run), releasing each chunk
     * (a single page that will not go is kept as a spare, a larger chunk
     * waits in h->loose).  A failed unmap stops here: the pool is paused with
     * the pages released so far. */
    for (size_t i = 0, j; i < n; i = j) {
        j = run_end(l, i, n);
        uintptr_t a = gm_page_addr(h, l[i].page);
        if (ops->unmap(h->dev, a, (j - i) * h->page)) {
            h->st.num_device_errors++;
            rc = GM_EDEVICE;
            break;
        }
        h->st.num_unmaps++; /* calls, as everywhere */
        for (size_t q = l[i].page, end = l[j - 1].page + 1; q < end;) {
            size_t k = h->chunk_len[q];
            gm_handle hd = h->page_handle[q];
            chunk_clear(h, q, k);
            h->paused_pages += k;
            q += k;
            h->multi_chunks -= k > 1;
            release_chunk(h, hd, k);
        }
        gm_hist(h, GM_H_UNMAP, a, (j - i) * h->page, ANY, 0);
        done = j;
    }
    if (!done && n) goto out; /* nothing changed */
    p->paused = 1;
    p->paused_list = l;
    p->n_paused = done;
    p->shared_pages = shared;
    p->backup = backup;
    l = NULL;
    backup = NULL;
    info = (gm_pause_info){done, shared, p->backup ? done * h->page : 0, t1 - t0, 0, t2 - t1, mono_ns() - t2};
out:
    if (backup) ops->host_free(h->dev, backup);
    free(l);
    pthread_mutex_unlock(&h->lock);
    if (out) *out = info;
    return rc;
}

/* Unmap the first `n` entries of p's list again (a resume that failed), a
 * whole chunk a call: single pages become spares, larger chunks are
 * released.  A chunk that will not unmap stays mapped and its pages leave
 * the list (their contents are then undefined). */
static void unresume(gm_heap *h, gm_pool *p, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < p->n_paused;) {
        gm_paused_page e = p->paused_list[i];
        if (i >= n) {
            p->paused_list[k++] = e;
            i++;
            continue;
        }
        size_t c = h->chunk_len[e.page]; /* mapped from this entry on: its pages are the next c entries */
        uintptr_t a = gm_page_addr(h, e.page);
        int rc = GM_EDEVICE;
        for (int attempt = 0; attempt < 8 && rc; attempt++) rc = unmap_chunk(h, e.page, 0);
        if (rc) {
            for (int attempt = 0; attempt < 8; attempt++)
                if (h->dev->ops->set_access(h->dev, a, c * h->page) == GM_OK) break;
            i += c;
            continue;
        }
        h->paused_pages += c;
        for (size_t t = 0; t < c; t++) p->paused_list[k++] = p->paused_list[i + t];
        i += c;
    }
    p->n_paused = k;
}

int gm_pool_resume(gm_heap *h, gm_pool_id id, gm_pause_info *out) {
    gm_pause_info info = {0};
    uint64_t t0 = mono_ns(), t1 = t0, t2 = t0;
    const gm_device_ops *ops = h->dev->ops;
    pthread_mutex_lock(&h->lock);
    int rc = GM_OK, dev_err = GM_OK;
    gm_pool *p = valid_id(&id) ? pool_find(h, &id) : NULL;
    if (!p || !p->paused)
        rc = GM_EINVAL;
    else if (pause_refused(h))
        rc = GM_ECAPTURING;
    if (rc) goto out;
    size_t n = p->n_paused, mapped = 0, grant = 0, *g = &grant;
    gm_paused_page *l = p->paused_list;
again:
    /* 1. The pages: spares, new ones up to the cap (with chunks: promised,
     * made run by run below), then cached ones taken back. */
    grant = 0;
    n = p->n_paused;
    if (n > h->n_spare) grow(h, n - h->n_spare, h->cap_pages, g, &dev_err);
    if (n > h->n_spare + grant && cached_pages(h, 0, 0) && synchronize(h, ANY) == GM_OK)
        recycle(h, n - h->n_spare - grant, 0, 0, 1);
    if (n > h->n_spare + grant) {
        rc = dev_err ? GM_EDEVICE : GM_ENOMEM;
        goto fail;
    }
    t1 = mono_ns();
    /* 2. Map each run at its addresses: spares, then chunks as large as
     * GM_CHUNK_PAGES_MAX allows, whatever chunk_pages says -- a living pool's
     * pages never move, so chunks cost nothing until the pool ends -- and
     * grant access once per run. */
    for (size_t i = 0, j; i < n; i = j) {
        j = run_end(l, i, n);
        size_t p0 = l[i].page, p1 = l[j - 1].page + 1, got;
        int err = GM_OK;
        got = map_fresh(h, p0, p1, GM_CHUNK_PAGES_MAX, g, &err) - p0;
        h->paused_pages -= got;
        mapped = i + got;
        if (got < p1 - p0 && err == GM_ENOMEM && g) {
            /* The device is nearly full: start over with single pages. */
            unresume(h, p, mapped);
            mapped = 0;
            g = NULL;
            goto again;
        }
        if (got < p1 - p0) {
            rc = err == GM_ENOMEM ? GM_ENOMEM : GM_EDEVICE;
            goto fail;
        }
        if (ops->set_access(h->dev, gm_page_addr(h, l[i].page), (j - i) * h->page)) {
            h->st.num_device_errors++;
            rc = GM_EDEVICE;
            goto fail;
        }
    }
    t2 = mono_ns();
    /* 3. The contents. */
    for (size_t i = 0, j; p->backup && i < n; i = j) {
        j = run_end(l, i, n);
        if (ops->copy_htod(h->dev, gm_page_addr(h, l[i].page), (const char *)p->backup + l[i].slot * h->page,
                           (j - i) * h->page)) {
            h->st.num_device_errors++;
            rc = GM_EDEVICE;
            goto fail;
        }
    }
    for (size_t i = 0, j; i < n; i = j) {
        j = run_end(l, i, n);
        gm_hist(h, GM_H_MAP, gm_page_addr(h, l[i].page), (j - i) * h->page, ANY, 0);
    }
    info = (gm_pause_info){n, p->shared_pages, p->backup ? n * h->page : 0, 0, t1 - t0, 0, t2 - t1};
    if (p->backup && ops->host_free(h->dev, p->backup)) h->st.num_device_errors++;
    info.copy_ns = mono_ns() - t2;
    free(p->paused_list);
    p->paused_list = NULL;
    p->backup = NULL;
    p->n_paused = p->shared_pages = 0;
    p->paused = 0;
    goto out;
fail:
    /* Back to fully paused; the pages gathered go back to the device. */
    unresume(h, p, mapped);
    release_spares(h, h->mapped_pages);
out:
    pthread_mutex_unlock(&h->lock);
    if (out) *out = info;
    return rc;
}
