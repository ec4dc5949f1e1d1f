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
 *   among equals -- with room, one at a growth edge only when nothing else
 *   fits (policy.c, POLICY) -- and split off the remainder.  A request of at
 *   most half a page looks among the free space of small pages instead
 *   (small.c, SMALL PAGES), a larger one never does.  Free: look the
 *   pointer up in the live table, merge with free neighbours, index.
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
 *      Still short: memory other streams freed while their work still runs
 *      becomes this stream's, the stream made to wait for that work on the
 *      device, not the host (stream.c, HAND-OFF).
 *   4. Defragment: past the growth limit, or when the device is full, wait for
 *      the device, unmap wholly free pages wherever they lie, and map them
 *      behind the chosen range.  No bytes are copied and no live block moves;
 *      only free pages change address.  Then, if still short, grow to the cap.
 *   5. Out of memory only when the pages that live blocks touch plus the pages
 *      this request needs exceed the cap -- or, with spill on (SPILL), once
 *      step 6 cannot serve it either.  The failure leaves a report.
 *   6. Spill (opt-in): host-located pages behind the heap's own addresses.
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
 *   Free pages in a chunk that a block still uses are cached but locked:
 *   cached_pages leaves them out (chunk_locked), and an OOM report counts
 *   them.  (The driver maps no part of an allocation -- a map at an offset,
 *   or of fewer pages, is refused on an H200 -- so a chunk's pages cannot be
 *   mapped one by one to move alone.)  With gm_config.split_chunks, when
 *   defragmentation lacks pages after the movable ones, it splits chunks, the
 *   most free pages first (split.c): the kept pages are copied to single
 *   pages behind one device wait, the chunk is released and the singles take
 *   the kept pages' places behind the same addresses, so the free ones go.
 *   That moves live data, hence an option.  Otherwise (or with no page to
 *   copy into) the slow path takes the best range that the movable pages
 *   elsewhere cover.  chunk_pages 1 (the default) makes every page its own
 *   allocation.
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
 *   (gm_heap.lazy_stream, h_free_owner).  Under pressure, before such a wait,
 *   the requesting stream may instead wait on the device for the other
 *   streams' work and take what they freed (stream.c, HAND-OFF).
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
 *   POOL_EDGE_PAGES).  And the pool's free memory at its edge stays in one
 *   piece, as an expandable segment's free tail does: a request that a free
 *   block at the pool's lower edge (unmapped space below it) serves takes
 *   that block's top (snug_end; a pool placed at the top of the address
 *   space grows downwards), and a placement may take part of a chunk whose
 *   other pages the pool holds already (pool_pages_ok).
 *
 *   Each slow-path placement is a growth, numbered per page (page_growth):
 *   the pages it maps, and for a pool the pages it takes.  Snapshots cut
 *   segments where the growth changes, as a native allocator's segments
 *   are; a pool's free neighbours still merge across it, as an expandable
 *   segment's do (apart they would serve only requests that fit one of
 *   them).  A no_split pool's request takes whole pages, or a whole free
 *   block of the pool: its blocks are never split, and its free neighbours
 *   do not merge across a growth (h_pool_seam).
 *
 *     [A   ][free][B  p1 ][free p1  ][C  p1 ][free p1][unmapped ...]
 *     |  page 0  |  page 1  |  page 2  |  page 3  |
 *       general    pages 1-3 are p1's and pinned: only its blocks lie there
 *
 *   A CUDA graph has its addresses baked in, so every page that a block of a
 *   living pool touches -- live, pending or free -- is counted as used
 *   (h_used_pages, cached_pages, cached_runs): defragmentation, empty_cache and
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
 *   slow path skips step 1 (events), step 4 (defragmentation) and step 6
 *   (spill: it copies) and grows up to the cap; out of memory otherwise, with spares kept (releasing them is
 *   forbidden too).  Pages whose access grant keeps failing then cannot be
 *   unmapped either: they are parked (gm_heap.parked), mapped and held but in
 *   unmapped space, where no block gets them, until no capture is on.  A free with record_stream uses records no event: the block
 *   stays pending, marked deferred, until the capture count returns to zero,
 *   when its events are recorded (torch defers them the same way).  empty_cache
 *   and a lowered cap trim nothing until the capture ends.  A capture known only
 *   from the device, on another stream, shows through its deferred frees: while
 *   one waits, device-wide calls (synchronize, event query) are held back too.
 *   Other captures the heap cannot see: torch's side calls gm_capture_begin/end.
 *   The first gm_capture_begin asks the device which streams have finished
 *   their work (stream_query) and hands what they freed in private pools to
 *   every stream: a graph's capture stream may then reuse what others freed
 *   in its pool.
 *
 * SPILL
 *
 *   With gm_config.spill, the device's end is not the heap's: host memory
 *   that the device reads and writes through its own mappings (create_host)
 *   is mapped behind the heap's addresses, up to the limit.  Host pages are
 *   chunks like any other in the page tables (page_handle, chunk_off,
 *   chunk_len) with a per-page flag (host) beside them; they count in
 *   host_pages and spilled_bytes, never in mapped_pages, the held pages or
 *   the cap, and never become spares.
 *
 *   page      | 10 | 11 | 12 | 13 | 14 | 15 | 16 | 17 |
 *   handle    | H1 | H2 | X1 | X1 | H5 | -- | X2 | X2 |   X: host chunks
 *   host      | 0  | 0  | 1  | 1  | 0  | 0  | 1  | 1  |
 *   blocks    [A      ][B (old)  ][C ][unm][D (new)  ]
 *
 *   When steps 1-5 leave a request short (not during a capture: no copy or
 *   device wait may run then, and the OOM says spill is off; never for a
 *   private pool), spill_choice says what goes to the host.  "old" (B): after
 *   a device wait, the chunks under the oldest live blocks (lowest alloc
 *   sequence), whole blocks until the request's shortfall is covered, are
 *   copied to new host chunks and take their place behind the same
 *   addresses; the device's pages become spares and the request tries again.
 *   A move of several chunks is one batch (moves_run, the return's too):
 *   each new chunk is mapped in the scratch range (grown to hold them all)
 *   and its copy issued, then one device wait for all the copies, then the
 *   scratch mappings go and each new chunk takes its old one's place.
 *   Pages a neighbour shares move with it (the address does not change); a
 *   chunk a living pool's block touches never moves.  "new" (D), and "old"
 *   when moving freed nothing: the request itself gets whole host pages in
 *   unmapped space.  Past the limit: out of memory, whose report says what
 *   is spilled.
 *
 *   Return: host pages that hold nothing live or pending are unmapped as soon
 *   as a free leaves them so (after a device wait; a pending block that
 *   completes later leaves them to the next malloc, before its fast path), so
 *   that no later request gets host memory while the device has room.  While
 *   the demand (below) exceeds the cap their chunks are kept, unmapped, in
 *   host_loose, and the next spill that needs a chunk that long maps one of
 *   them again instead of creating it (create_host is slow: pinned host
 *   memory); mapped and kept host pages together stay within the limit.  gm_unspill
 *   moves every live host chunk back (a device chunk, the copy through the
 *   scratch range, the mappings swapped); empty_cache calls it, and so do
 *   gm_free and gm_reset_peak_stats once the demand fits: the peak of the pages
 *   live blocks touched (host pages too, live_peak_pages) since the peak was
 *   last reset, plus the growth slack, under the cap, and what is live now in
 *   what the heap holds and the device has free.  The peak, not what is live:
 *   a loop whose step needs more than the cap keeps what it spilled across
 *   steps -- no return at each step's dip, no spill again at its next peak --
 *   until the user resets the peak (resetting it every step makes each step
 *   move the blocks back and out again) or empties the cache; then the kept
 *   host chunks are released too.  A heap with
 *   nothing spilled pays one integer test per free for all this.
 *
 * THE FILES
 *
 *   heap.c      this drawing; create and destroy; malloc and free as a ladder
 *               of fallbacks (the fast path, then slow.c); the other entry points
 *   block.c     block records, the live table, owners and their free indexes,
 *               splitting and merging
 *   stream.c    events, pending blocks, handing owners' memory to every stream
 *   page.c      physical pages and chunks: creating, mapping, spares, giving back
 *   policy.c    room vs pressure: the growth limit and the room line
 *   place.c     placement: the run search, and backing the range it picks
 *   small.c     small pages: small requests' blocks kept in pages of their own
 *   slow.c      the slow path and defragmentation, spill last
 *   split.c     splitting a chunk whose free pages are locked
 *   report.c    the OOM report and the explanations' figures
 *   capture.c   stream capture
 *   pool.c      private pools
 *   pause.c     pausing and resuming a pool
 *   spill.c     host pages behind the heap's addresses, and their return
 *   heap_internal.h declares what crosses files, grouped by the file that
 *   defines it; everything else is static to its file.  The free index
 *   (freeindex.h) and the run index (runindex.h) are the layer below.
 *
 * LOCKING: one mutex per heap; device calls happen under it (slow path only).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem/array.h"
#include "heap_internal.h"

/* ---- the fast path ------------------------------------------------------------ */

/* A growth edge: a free block of the general heap that unmapped general
 * space follows, where a request larger than any free block grows in place. */
static int at_edge(const gm_block *b) { return !b->pool && b->next && h_growth_space(b->next); }

/* Best fit in fi; with room (POLICY, growth edges), the next fit in index
 * order that is no growth edge, if there is one.  Edges are the ends of
 * mapped regions, so the walk passes over few blocks. */
static gm_block *fit_past_edge(const gm_heap *h, const gm_freeindex *fi, size_t size) {
    gm_block *b = fi_best_fit(fi, size);
    if (!b || !h->with_room || !at_edge(b)) return b;
    for (gm_block *c = fi_next(fi, b); c; c = fi_next(fi, c))
        if (c->size >= size && !at_edge(c)) return c;
    return b;
}

/* Best fit for stream s among the free blocks of `pool` (NULL: the general
 * heap) that s may use: its own and everyone's; with room, a growth edge
 * last (fit_past_edge). */
gm_block *h_fit_in(gm_heap *h, size_t size, gm_stream s, gm_pool *pool) {
    gm_owner *own = s == ANY ? NULL : h_owner_find(h, pool, s);
    gm_block *a = own ? fit_past_edge(h, &own->idx, size) : NULL;
    gm_block *b = fit_past_edge(h, &h_everyones(h, pool)->idx, size);
    if (!a) return b;
    if (b && h->with_room && at_edge(a) != at_edge(b)) return at_edge(a) ? b : a;
    if (!b) return a;
    return (b->size < a->size || (b->size == a->size && b->addr < a->addr)) ? b : a;
}

/* Turn [at, at+size) of the free block b into a live block. */
static gm_block *carve(gm_heap *h, gm_block *b, uintptr_t at, size_t size) {
    h_index_remove(h, b);
    if (at > b->addr) {
        gm_block *r = h_split(h, b, at - b->addr);
        h_index_insert(h, b);
        b = r;
    }
    if (b->size > size) h_index_insert(h, h_split(h, b, size));
    return b;
}

/* Pages [x, x+size) touches that no live or pending block touches already,
 * counting only the pages shared with b's neighbours (the rest are b's). */
static size_t fresh_pages(const gm_heap *h, const gm_block *b, uintptr_t x, size_t size) {
    size_t p0 = h_page_floor(h, x), p1 = h_page_ceil(h, x + size), n = p1 - p0;
    const gm_block *pr = b->prev, *nx = b->next;
    if (x == b->addr && pr && (pr->state == GM_BLOCK_LIVE || pr->state == GM_BLOCK_PENDING) &&
        h_page_floor(h, pr->addr + pr->size - 1) == p0)
        n--;
    if (x + size == b->addr + b->size && nx && (nx->state == GM_BLOCK_LIVE || nx->state == GM_BLOCK_PENDING) &&
        h_page_floor(h, nx->addr) == p1 - 1 && n)
        n--;
    return n;
}

/* Whether b is a pool's free block at the pool's lower edge: unmapped space
 * (where the pool grows) just below it, no general space just above. */
static int pool_edge_below(const gm_block *b) {
    return b->pool && b->prev && b->prev->state == GM_BLOCK_UNMAPPED && !(b->next && h_general_space(b->next));
}

/* Which end of free block b to carve from: the one that shares a page with a
 * live neighbour, so the allocation touches the fewest pages nothing else
 * uses -- physical memory is pages touched, not bytes.  On ties the low end,
 * except at a pool's lower edge: there the high end, so that the free rest
 * stays at the edge, where a larger request extends it in place (place.c),
 * as an expandable segment keeps its free tail at its growing end.  Near
 * pressure (POLICY, whole pages) a request of whole pages starts at b's first
 * page boundary instead, below its high end, if that needs no more fresh
 * pages: it touches no page more than it needs. */
static uintptr_t snug_end(const gm_heap *h, const gm_block *b, size_t size) {
    if (b->size == size) return b->addr;
    uintptr_t hi = b->addr + b->size - size;
    size_t f_hi = fresh_pages(h, b, hi, size), f_lo = fresh_pages(h, b, b->addr, size);
    if (h->near_pressure && !b->pool && h_whole_pages(h, size)) {
        uintptr_t a = h_page_addr(h, h_page_ceil(h, b->addr)); /* the block's first page boundary */
        if (a != b->addr && a < hi && fresh_pages(h, b, a, size) <= (f_lo < f_hi ? f_lo : f_hi)) return a;
    }
    if (f_hi != f_lo) return f_hi < f_lo ? hi : b->addr;
    return pool_edge_below(b) ? hi : b->addr;
}

/* The fast path's choice: the best fit for s (an allocation in a pool takes
 * only the pool's free memory here: general free memory it may take only as
 * whole pages of its own, placement), and where in it to carve (*at). */
gm_block *h_fit(gm_heap *h, size_t size, gm_stream s, gm_pool *pool, uintptr_t *at) {
    gm_block *b = !pool && h_small_size(h, size) ? h_small_fit(h, size, s) : NULL;
    if (!b) b = h_fit_in(h, size, s, pool);
    if (b) *at = snug_end(h, b, size);
    return b;
}

/* ---- public entry points --------------------------------------------------------------- */

void gm_config_default(gm_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->growth_slack = 0.01;
    cfg->growth_slack_pages = 4;
    cfg->chunk_pages = GM_CHUNK_PAGES_DEFAULT;
    cfg->pressure = GM_PRESSURE_DEFAULT;
    cfg->stream_handoff = 1;
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

/* The heap's lock, its tables sized for n_pages, and its address range.  On
 * failure gm_heap_destroy takes back what was made. */
static int heap_tables(gm_heap *h, size_t total) {
    gm_device *dev = h->dev;
    size_t page = h->page, va = h->va_size;
    pthread_mutex_init(&h->lock, NULL);
    h_fork_register(h);
    h->live_mask = 1023;
    size_t max_pages = total / page + 1;
    h->cap_spare = h->n_pages > max_pages ? h->n_pages : max_pages;
    h->page_handle = calloc(h->n_pages, sizeof *h->page_handle);
    h->chunk_off = calloc(h->n_pages, sizeof *h->chunk_off);
    h->chunk_len = calloc(h->n_pages, sizeof *h->chunk_len);
    h->page_growth = calloc(h->n_pages, sizeof *h->page_growth);
    h->parked = calloc(h->n_pages, 1);
    h->small_page = calloc(h->n_pages, 1);
    h->small_held = calloc(h->n_pages, sizeof *h->small_held);
    h->host = calloc(h->n_pages, 1);
    h->loose = calloc(h->cap_spare / 2 + 1, sizeof *h->loose); /* chunks of two pages or more */
    h->spare = calloc(h->cap_spare, sizeof *h->spare);
    h->live = calloc(h->live_mask + 1, sizeof *h->live);
    int rc = (!h->page_handle || !h->chunk_off || !h->chunk_len || !h->page_growth || !h->parked || !h->host ||
              !h->loose || !h->small_page || !h->small_held || !h->spare || !h->live || ri_init(&h->runs, h->n_pages) ||
              !h_owner_get(h, NULL, ANY) || h_slab_grow(h))
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
    return rc;
}

/* The first block: the whole range, unmapped. */
static void first_block(gm_heap *h) {
    h->head = h_block_new(h);
    h->head->addr = h->base;
    h->head->size = h->va_size;
    h->head->state = GM_BLOCK_UNMAPPED;
    h->head->stream = ANY;
    h_run_attach(h, h->head);
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
    h->spill_pages = cfg.spill / page;
    h->spill_choice = (int)cfg.spill_choice;
    h->handoff = cfg.stream_handoff != 0;
    h->split = cfg.split_chunks != 0;
    size_t va = cfg.va_size ? h_align_up(cfg.va_size, page) : h_align_up(4 * total, page);
    if (va < 64 * page) va = 64 * page;
    h->va_size = va;
    h->n_pages = va / page;
    rc = heap_tables(h, total);
    if (rc) {
        gm_heap_destroy(h);
        return rc;
    }
    first_block(h);
    h->st.max_split_size = -1;
    gm_set_cap(h, cfg.cap_bytes);
    *out = h;
    return GM_OK;
}

void gm_heap_destroy(gm_heap *h) {
    if (!h) return;
    gm_device *dev = h->dev;
    h_fork_unregister(h);
    /* A fork()ed child: the GPU's memory, events and context are the parent's,
     * and CUDA cannot be called here.  Free host memory only. */
    int host_only = h->inherited && strcmp(dev->kind, "sim");
    if (host_only) {
        for (size_t i = 0; i < h->n_owners; i++) h->owners[i]->releasing = 0;
        for (gm_block *b = h->pending_head; b; b = b->lnext) b->n_uses = 0;
        h->n_pages = h->n_spare = h->n_loose = h->n_event_pool = h->n_host_loose = 0;
        h->scratch = 0;
        h->va_size = 0;
    }
    if (h->page_handle && h->chunk_len) {
        for (size_t p = 0; p < h->n_pages; p++) {
            if (!h->page_handle[p] || h->chunk_off[p]) continue; /* a chunk at its first page */
            dev->ops->unmap(dev, h_page_addr(h, p), h->chunk_len[p] * h->page);
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
    h_spill_free(h);
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
    free(h->small_page);
    free(h->small_held);
    free(h->page_handle);
    ri_free(&h->runs);
    h_hist_free(h);
    pthread_mutex_destroy(&h->lock);
    if (!host_only) dev->ops->destroy(dev);
    free(h);
}

gm_device *gm_heap_device(gm_heap *h) { return h->dev; }

/* ---- allocation and free --------------------------------------------------------------- */

/* Before pending blocks are looked at: not during a capture, and blocks freed
 * during one get their events first. */
static void pending_step(gm_heap *h, gm_stream s) {
    if (!h->n_pending) return;
    if ((h->no_sync = h_capture_on(h, s) || h_other_capture(h))) return;
    h_process_pending(h, 0);
}

/* b (free, carved) becomes live for s, in pool p. */
void h_make_live(gm_heap *h, gm_block *b, size_t size, size_t requested, gm_stream s, uint64_t context, gm_pool *p) {
    h_assert(b->state == GM_BLOCK_FREE && b->size == size && requested <= size);
    int kept = h_keeps_pages(b);
    if (!h_general_space(b)) {
        b->state = GM_BLOCK_LIVE; /* a pool's free block: no run changes */
    } else if (b->run_len && b->next && h_general_space(b->next) &&
               !(b->next->state == GM_BLOCK_FREE && b->run_len - b->size == b->next->size)) {
        /* Carved from the front of an indexed run: the rest stays one indexed
         * run (not a lone free block). */
        ri_move_head(&h->runs, b, b->next, b->run_len - b->size);
        b->state = GM_BLOCK_LIVE;
    } else {
        h_run_detach(h, b);
        b->state = GM_BLOCK_LIVE;
        if (b->prev && h_general_space(b->prev)) h_run_attach(h, b->prev);
        if (b->next && h_general_space(b->next)) h_run_attach(h, b->next);
    }
    if (!kept) h_pages_use(h, b, 1);
    if (b->small) h_small_live(h, b);
    h_assert(b->small || p ||
             (!h->small_page[h_page_floor(h, b->addr)] && !h->small_page[h_page_floor(h, b->addr + b->size - 1)]));
    b->stream = s;
    b->requested = requested;
    b->context = context;
    b->seq = ++h->alloc_seq;
    b->pool = p;
    if (p) {
        p->live_blocks++;
        p->live_bytes += size;
    }
    h_live_insert(h, b);
    h->live_bytes += size;
    if (h->spill_pages) h_swing(h);
    int pool = h_pool_of(size);
    h_stat_up(h->st.allocation, pool, 1);
    h_stat_up(h->st.allocated_bytes, pool, (int64_t)size);
    h_stat_up(h->st.requested_bytes, pool, (int64_t)requested);
    h_stat_up(h->st.active, pool, 1);
    h_stat_up(h->st.active_bytes, pool, (int64_t)size);
    if ((size_t)h->st.active_bytes[GM_POOL_ALL].current > h->peak_live)
        h->peak_live = (size_t)h->st.active_bytes[GM_POOL_ALL].current;
    h_hist_block(h, GM_H_ALLOC, b->addr, size, requested, s, context);
}

/* b, just made live in pool p from pages of its own (pool_pages_ok): the
 * general free memory on its last page, and up to `reach` (the pages its
 * growth took ahead for p, or 0), becomes p's free memory, so that those
 * pages hold p's blocks only for as long as p lives. */
static void claim_pool_pages(gm_heap *h, gm_block *b, gm_pool *p, uintptr_t reach) {
    uintptr_t e = h_page_addr(h, h_page_ceil(h, b->addr + b->size));
    if (reach > e) e = reach;
    for (gm_block *r = b->next; r && r->addr < e; r = r->next) {
        if (r->state != GM_BLOCK_FREE || r->pool) continue;
        h_run_detach(h, r);
        h_index_remove(h, r);
        if (r->addr + r->size > e) h_index_insert(h, h_split(h, r, e - r->addr));
        gm_block *rest = r->next; /* general space after r: a run of its own now */
        int rejoin = rest && h_general_space(rest);
        r->pool = p;
        h_pages_use(h, r, 1);
        r = h_merge_neighbours(h, r); /* a pool block after r, already out of the runs, may join it */
        h_index_insert(h, r);
        if (rejoin) h_run_attach(h, rest);
    }
}

int gm_malloc_flags(gm_heap *h, size_t size, gm_stream s, uint64_t context, const gm_pool_id *pool_id, unsigned flags,
                    uintptr_t *out) {
    if (!out) return GM_EINVAL;
    *out = 0;
    if (s == ANY) return GM_EINVAL;
    if (size > ((size_t)1 << 52)) return GM_EINVAL;
    size_t rsize = h_align_up(size ? size : 1, GM_ALIGN);
    pthread_mutex_lock(&h->lock);
    int rc = GM_OK;
    gm_pool *pool = NULL;
    if (pool_id && !(pool = h_pool_find(h, pool_id))) {
        rc = GM_EINVAL;
        goto done;
    }
    if (pool && pool->paused) {
        rc = GM_EPAUSED;
        goto done;
    }
    h->no_sync = h->capture_count > 0;
    h->alloc_flags = flags;
    if (rsize > h->va_size || (rsize > h->cap_pages * h->page && !h->spill_pages)) {
        rc = h_out_of_memory(h, rsize, s, (rsize + h->page - 1) / h->page, GM_OK);
        goto done;
    }
    if (pool && pool->no_split) rsize = h_align_up(rsize, h->page); /* whole pages, never split */
    if ((rc = h_slab_reserve(h, 6)) || (h->n_live >= h->live_mask && (rc = h_live_grow(h)))) goto done;
    if (h->n_owners >= h->owners_trim_at && (!h_owner_find(h, NULL, s) || (pool && !h_owner_find(h, pool, s))))
        h_owners_trim(h);
    if ((!h_owner_find(h, NULL, s) && !h_owner_get(h, NULL, s)) ||
        (pool && !h_owner_find(h, pool, s) && !h_owner_get(h, pool, s))) {
        rc = GM_ENOMEM;
        goto done;
    }
    /* Another stream looks only at its own and everyone's indexes. */
    if (h->lazy_stream != ANY && s != h->lazy_stream) h_settle_release(h);
    if (h->n_pending) pending_step(h, s);
    if (h->host_idle) h_spill_idle(h, s); /* no free block on host pages for the fast path */
    uintptr_t at = 0, reach = 0;
    gm_block *b = h_fit(h, rsize, s, pool, &at);
    if (!b) {
        if (!h->no_sync) h->no_sync = h_capture_on(h, s) || h_other_capture(h);
        if ((rc = h_alloc_slow(h, rsize, s, pool, &b, &at, &reach))) goto done;
        if (h->spill_whole) rsize = h->spill_whole, h->spill_whole = 0; /* host pages: whole ones */
        if (!pool && h_small_size(h, rsize)) b = h_small_after_slow(h, b, at, rsize);
    }
    if (pool && pool->no_split && b->pool == pool) at = b->addr, rsize = b->size; /* the whole free block */
    b = carve(h, b, at, rsize);
    h_make_live(h, b, rsize, size, s, context, pool);
    if (pool && b->next && b->next->state == GM_BLOCK_FREE && !b->next->pool) claim_pool_pages(h, b, pool, reach);
    *out = b->addr;
done:
    h->no_sync = 0;
    h->alloc_flags = 0;
    pthread_mutex_unlock(&h->lock);
    return rc;
}

int gm_malloc_pool(gm_heap *h, size_t size, gm_stream s, uint64_t context, const gm_pool_id *pool_id, uintptr_t *out) {
    return gm_malloc_flags(h, size, s, context, pool_id, 0, out);
}

int gm_malloc(gm_heap *h, size_t size, gm_stream s, uint64_t context, uintptr_t *out) {
    return gm_malloc_pool(h, size, s, context, NULL, out);
}

void gm_count_oom(gm_heap *h, size_t size, gm_stream s) {
    pthread_mutex_lock(&h->lock);
    h->st.num_ooms++;
    h_hist(h, GM_H_OOM, 0, size, s, 0);
    pthread_mutex_unlock(&h->lock);
}

static int not_live(const gm_heap *h, uintptr_t ptr) {
    return (ptr >= h->base && ptr < h->base + h->va_size) ? GM_EDOUBLE_FREE : GM_EUNKNOWN_PTR;
}

/* Free the live block b, already out of the live table. */
void h_free_block(gm_heap *h, gm_block *b) {
    h->live_bytes -= b->size;
    if (h->spill_pages) h_swing(h);
    int pool = h_pool_of(b->size);
    h_stat_down(h->st.allocation, pool, 1);
    h_stat_down(h->st.allocated_bytes, pool, (int64_t)b->size);
    h_stat_down(h->st.requested_bytes, pool, (int64_t)b->requested);
    h_hist_block(h, GM_H_FREE_REQUESTED, b->addr, b->size, b->requested, b->stream, b->context);
    if (!b->n_uses) {
        h_complete_free(h, b);
        return;
    }
    /* Other streams may still touch it: one event per stream, and the block
     * waits.  If an event cannot be recorded, it waits for the next device
     * synchronisation instead.  During a capture no event may be recorded:
     * the block waits with none until the capture ends. */
    int capt = h_capture_on(h, b->stream) || h_other_capture(h);
    for (uint32_t i = 0; i < b->n_uses && !capt; i++) capt = h_capture_on(h, b->uses[i]);
    b->state = GM_BLOCK_PENDING;
    if (!h_pinned(b)) h_pages_use(h, b, -1); /* a living pool's keeps its pages */
    h_pending_append(h, b);
    if (capt) {
        b->wait_sync = 0;
        for (uint32_t i = 0; i < b->n_uses; i++) b->events[i] = 0;
        b->deferred = 1;
        h->n_deferred++;
    } else {
        h_record_uses(h, b);
    }
}

int gm_free(gm_heap *h, uintptr_t ptr) {
    pthread_mutex_lock(&h->lock);
    gm_block *b = h_live_remove(h, ptr);
    if (!b) {
        int rc = not_live(h, ptr);
        pthread_mutex_unlock(&h->lock);
        return rc;
    }
    if (h->host_pages) { /* spilled: return what the device has room for (spill.c) */
        int on_host = h_on_host(h, b);
        gm_stream s = b->stream;
        h_free_block(h, b);
        h_spill_after_free(h, s, on_host);
    } else {
        h_free_block(h, b);
    }
    pthread_mutex_unlock(&h->lock);
    return GM_OK;
}

int gm_record_stream(gm_heap *h, uintptr_t ptr, gm_stream s) {
    if (s == ANY) return GM_EINVAL;
    pthread_mutex_lock(&h->lock);
    int rc = GM_OK;
    gm_block *b = h_live_find(h, ptr);
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
    gm_block *b = h_live_find(h, ptr);
    size_t n = b ? b->size : 0;
    pthread_mutex_unlock(&h->lock);
    return n;
}

/* Unmap cached pages and release spares until the heap holds at most `target`. */
static int trim(gm_heap *h, size_t target) {
    /* During a capture nothing may be unmapped or released: later. */
    if (h->capture_count > 0 || h_other_capture(h)) return GM_OK;
    if (h->n_parked) h_unpark(h);
    int rc = h_release_spares(h, target);
    if (rc || h_held_pages(h) <= target) return rc;
    /* Pending blocks count as free here: the synchronisation completes them. */
    if (!h_cached_pages(h, 0, 0)) return GM_OK;
    if ((rc = h_synchronize(h, ANY))) return rc; /* spares are gone already; nothing else is safe */
    size_t want = h_held_pages(h) - target, got = h_recycle(h, want, 0, 0, 0);
    if (got) h_hist(h, GM_H_EMPTY_CACHE, 0, got * h->page, ANY, 0);
    /* What cannot go backs live blocks (or an unmap failed). */
    return h_release_spares(h, target);
}

int gm_empty_cache(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    int rc = trim(h, 0);
    /* What is spilled comes back if it can (gm_unspill tells why not); what
     * that leaves cached goes too. */
    if ((h->host_pages || h->n_host_loose) && h_unspill(h) != GM_ECAPTURING && !rc) rc = trim(h, 0);
    h_owners_trim(h); /* the streams whose memory went */
    pthread_mutex_unlock(&h->lock);
    return rc;
}

int gm_set_cap(gm_heap *h, size_t cap_bytes) {
    pthread_mutex_lock(&h->lock);
    size_t limit = (cap_bytes && cap_bytes < h->device_total) ? cap_bytes : h->device_total;
    h->user_cap = cap_bytes;
    h->cap_pages = limit / h->page;
    int rc = h_held_pages(h) > h->cap_pages ? trim(h, h->cap_pages) : GM_OK;
    pthread_mutex_unlock(&h->lock);
    return rc;
}

size_t gm_get_cap(gm_heap *h) { return h_locked_read(h, &h->user_cap); }

void gm_get_stats(gm_heap *h, gm_stats *out) {
    pthread_mutex_lock(&h->lock);
    *out = h->st;
    pthread_mutex_unlock(&h->lock);
}

void gm_reset_peak_stats(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    h_stats_reset_peaks(&h->st);
    h_spill_demand_reset(h); /* the demand that kept pages spilled starts over (SPILL) */
    pthread_mutex_unlock(&h->lock);
}

void gm_reset_accumulated_stats(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    h_stats_reset_accumulated(&h->st);
    pthread_mutex_unlock(&h->lock);
}
