/*
 * policy.c -- room vs pressure: the growth limit and the room line that
 * decide whether the slow path takes new pages or recycles (POLICY below).
 *
 * Calls: page.c (growing), the device (its free memory).
 */
#include "heap_internal.h"

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
 *   the blocks placed with room lie elsewhere.  What room must not leave is
 *   partly used pages, which no defragmentation takes back.  Two rules keep
 *   them few whatever the policy: small requests keep to small pages
 *   (small.c), so the cached free memory that room leaves does not scatter
 *   them; and near pressure (h_near_pressure: below the room line but past
 *   ROOM_FAR of it, or past the line), a block of whole pages is placed
 *   where it touches the fewest pages (place.c, ranks_before), not right
 *   after a block that ends inside a page; and the fast path, carving one
 *   from a free block that starts inside a page, starts it at the free
 *   block's first page boundary (heap.c, snug_end).  Whether that pays
 *   depends on lifetimes the heap does not know when it carves: a neighbour
 *   that goes first leaves its page wholly free, but blocks allocated and
 *   freed together leave the slivers before their boundaries unused while
 *   they live.  Measured (docs/benchmarks.md, "Whole pages from a page
 *   boundary"), the real traces gained: at 1x the mean excess over peak live
 *   went from 0.392% to 0.362%, and three misses of the capacity goal to one
 *   -- resnet_infer 1.0056 to 1.0047, llama_compile_train 1.0111 to 1.0093
 *   -- with nothing reserved with room changed at 1x; a synthetic batch of
 *   3-10 MiB blocks lost (1.0065 to 1.0130 x peak live).  Far from pressure
 *   placement packs, so that growth keeps reaching ahead (room_ahead)
 *   without a device call.  The always-tight heap (pressure 0) packs too:
 *   there the rule (placement's, when it was measured alone) lowered the
 *   smallest capacities little (0.430% to 0.409% of peak live over the 39
 *   traces, mean) for more recycling (554 to 602 remaps; llama_lora_ckpt 7
 *   to 21).  Past the line it did what the tight heap
 *   cannot: smallest capacities at 1x 6 lower, 1 higher (resnet_infer 1.0066
 *   to 1.0056, roberta_infer 1.0077 to 1.0062, llama_compile_train 1.0099 to
 *   1.0111), with no change in what is reserved with room.
 *
 *   Growth edges.  With room nothing is recycled, so reserved memory is what
 *   placement made of the address space, and a request larger than every free
 *   block maps new pages.  The cheapest place for them is a free block that
 *   unmapped space follows (a growth edge): the request extends it in place.
 *   So below the room line the fast path passes over a growth edge when
 *   another free block fits (heap.c, fit_past_edge), as an expandable segment
 *   passes over the free block at its mapped end, and smaller requests do not
 *   eat the edge away.  The slow path notes whether the heap is below its line
 *   (h->with_room) each time it measures pressure; the fast path only reads
 *   it.
 *
 *   Growth far from pressure -- the heap holding at most ROOM_CHUNK_FAR of
 *   the room line, and the device ROOM_CHUNK_FREE free past it (room_far) --
 *   maps a request's new pages as chunks of up to ROOM_CHUNK_PAGES pages (one
 *   create, map and access grant each, instead of one per page) when it
 *   needs at least ROOM_CHUNK_MIN of them.  Only the pages wholly inside the
 *   request's range become chunks; its first and last pages, which
 *   neighbouring blocks may share, stay single (map_interior).  A chunk
 *   cannot move while a block still uses one of its pages: once its block is
 *   freed, the fast path may place smaller, long-lived blocks on part of it,
 *   and a heap that later fills its device then cannot move the rest
 *   (recycling releases only a wholly free chunk, and makes single pages in
 *   its place; split_chunks splits one, but not where nothing is left to copy
 *   into, and it is an option).  Hence both conditions: ROOM_CHUNK_FAR keeps chunks to the
 *   start of a heap's growth, ROOM_CHUNK_FREE to devices with room to spare
 *   past the room line.  On a device with less, every page is single, as on
 *   the tight heap.  A program that fills a larger device pays for the
 *   chunks it made early only as far as they hold long-lived blocks:
 *   ROOM_CHUNK_FAR keeps them to its first sixteenth (docs/benchmarks.md).
 *   Placement's whole-page rule and a pool's reach keep the wider ROOM_FAR,
 *   a quarter, and ROOM_SMALL_FREE: they lock nothing.
 *
 *   Smaller growths come as chunks too, under the same conditions: each
 *   growth of fewer than ROOM_CHUNK_MIN pages is one chunk, its own pages
 *   and, when it needs fewer than ROOM_AHEAD_PAGES, that many taken ahead
 *   from the unmapped space right after it (room_ahead), which the next
 *   small requests then use without a device call.  Such chunks soon hold
 *   blocks of different lifetimes, so they rarely go back whole.
 *
 *   A pool's growth reaches ahead as torch's segments do: far from
 *   pressure (ROOM_FAR) and with ROOM_SMALL_FREE past the room line, a
 *   request of a living pool over POOL_AHEAD_MIN and under
 *   POOL_AHEAD_MAX is placed and backed as POOL_AHEAD_BYTES, all of it the
 *   pool's (h_pool_reach; claim_pool_pages), so that the pool's next such
 *   requests share the segment and make no device call.  The pages stay
 *   single: a pool's pages cannot move while it lives, and once it ends its
 *   free ones can.  A pool's free memory serves only the pool, which is the
 *   cost: up to 20 MiB less the request per growth.  No_split pools take
 *   only their own pages.  A growth during a capture reaches ahead too, as a
 *   native segment made during one does: it only creates and maps pages and
 *   asks the device what is free, none of which a capture forbids.
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
 *                                capacity per trace stays within 0.2% of
 *                                peak live of the tight heap's on 37 of the
 *                                38 shipped and zoo traces
 *                                (docs/benchmarks.md).
 *     ROOM_CHUNK_MIN 64, ROOM_CHUNK_PAGES 64: 1.2-2.5x fewer
 *                                device allocations than single pages on five
 *                                of the nine shipped traces (none on the
 *                                others); chunks for smaller requests, or up
 *                                to half the room line, cost up to 8% of peak
 *                                live on seed_fragmentation, 1.4% on
 *                                llama_lora_ckpt and 0.4% on
 *                                two_stream_pipeline.
 *     ROOM_CHUNK_FAR 1/16:       the 39 traces with every request 3, 5 and 7
 *                                times as large (a program that fills a
 *                                larger device) need within 0.2% of peak live
 *                                of the tight heap's smallest capacity (all
 *                                39, searched to 1 MiB); at 1/4 the
 *                                chunks made early locked up to 2% of peak
 *                                live (llama_ckpt 5x 1.0202 against 1.0006;
 *                                two_stream_pipeline 3x 1.0130 against
 *                                1.0003), at 1/8 up to 0.3% at 3x.  The price
 *                                is device allocations while the heap grows:
 *                                the H200 Llama of gpu_policy.py made 7,315
 *                                (15 after warm-up) against 412 (1) at 1/4,
 *                                with no remap or synchronisation after
 *                                warm-up either way; its gpt2_varlen, a heap
 *                                still growing after warm-up, 494 after
 *                                warm-up, its run 1.10 of native's.  Without the
 *                                ROOM_CHUNK_FREE condition, the chunks made
 *                                on a device the trace fills raise its
 *                                smallest capacity by up to 5% of peak live
 *                                (resnet_infer 1.077 against 1.027 with single
 *                                pages, llama_ckpt 1.020 against 1.004).
 *     ROOM_FAR 1/4:              placement's whole-page rule and a pool's
 *                                reach.  With them at 1/16 as well, the
 *                                smallest capacities stay within 0.0005 of
 *                                peak live, but peak reserved with room
 *                                moves by over 1% on 4 traces at 3x
 *                                (llama_lora_ckpt 1.0217 -> 1.2092), and the
 *                                H200 Llama reserves one page more.
 *     ROOM_AHEAD_PAGES 8, ROOM_SMALL_FREE 16 GiB: on an 80 GiB device the
 *                                nine traces make 8-28x fewer device
 *                                allocations (gpt2_varlen 4701 -> 292,
 *                                resnet50_multires 2215 -> 186) for at most
 *                                0.14% of peak live more reserved; without
 *                                the 16 GiB condition the smallest capacity
 *                                rises by up to 5.3% (seed_fragmentation;
 *                                two_stream_pipeline 1.1%, bert_varlen 0.6%),
 *                                with it no trace's changes.
 *     ROOM_CHUNK_FREE 32 GiB:    a cuDNN LSTM of varying lengths (20.8 GiB
 *                                peak live, a trace none of these figures
 *                                came from) needed 1.0048x its peak live
 *                                with chunks made under 16 GiB past the line,
 *                                88 MiB locked in them at the first failure,
 *                                against 1.0006 tight; with 32 GiB, 1.0007.
 *                                No figure of the 39 traces at 1-7x got worse,
 *                                and at 80 GiB their device allocations stay
 *                                the same: a device must hold more than ~37
 *                                GiB for chunks at all.
 *   (The tunables, ROOM_*, are in heap_internal.h: placement reads one.) */

/* The room line in pages: pressure x min(cap, held + device free).  0 when
 * the heap is always tight, or the device cannot say what is free.  It notes
 * for the fast path whether the heap holds less (h->with_room: growth
 * edges). */
static size_t room_line(gm_heap *h) {
    size_t dfree = 0, total = 0, limit = h->cap_pages;
    h->with_room = 0;
    if (!(h->pressure > 0) || h->dev->ops->mem_info(h->dev, &dfree, &total)) return 0;
    size_t device = h_held_pages(h) + dfree / h->page;
    if (device < limit) limit = device;
    size_t line = (size_t)(h->pressure * (double)limit);
    h->with_room = h_held_pages(h) < line;
    return line;
}

/* Far from pressure (POLICY): with `need` more pages the heap holds at most
 * `far` of the room line, and the device keeps `free_past` bytes past it
 * (ROOM_FAR and ROOM_SMALL_FREE; for chunks ROOM_CHUNK_FAR and
 * ROOM_CHUNK_FREE) -- room that a program which will meet its cap does not
 * have. */
static int room_far(const gm_heap *h, size_t room, size_t need, double far, size_t free_past) {
    size_t held = h_held_pages(h) + need;
    return room && held <= (size_t)(far * (double)room) && room > held + free_past / h->page;
}

/* Near pressure (POLICY, whole pages): below the room line but past
 * ROOM_FAR of it, or past the line.  Placement asks for a block of whole
 * pages, and what it found is what the fast path goes by for such blocks
 * until placement asks again (h->near_pressure). */
int h_near_pressure(gm_heap *h) {
    size_t room = room_line(h);
    return h->near_pressure = room && !room_far(h, room, 0, ROOM_FAR, ROOM_SMALL_FREE);
}

static size_t growth_limit(const gm_heap *h, size_t size) {
    size_t active = (size_t)h->st.active_bytes[GM_POOL_ALL].current + size;
    size_t basis = h->peak_live > active ? h->peak_live : active;
    /* Free memory kept for living pools serves nothing else. */
    basis += h->pool_free_bytes;
    size_t pages = (size_t)((double)basis * (1.0 + h->growth_slack) / (double)h->page) + 1 + h->growth_slack_pages;
    return pages < h->cap_pages ? pages : h->cap_pages;
}

/* The bytes a growth of `pool` for a request of `size` bytes places and
 * backs: torch's segment for it far from pressure, else `size` (POLICY). */
size_t h_pool_reach(gm_heap *h, const gm_pool *pool, size_t size) {
    if (pool->no_split || size <= POOL_AHEAD_MIN || size >= POOL_AHEAD_MAX) return size;
    size_t want = (POOL_AHEAD_BYTES + h->page - 1) / h->page, room = room_line(h);
    if (!room_far(h, room, want, ROOM_FAR, ROOM_SMALL_FREE)) return size;
    return want * h->page;
}

/* Growth ahead (POLICY): far from pressure, a growth of fewer than
 * ROOM_AHEAD_PAGES pages takes that many as one chunk, the rest from the
 * unmapped general space right after the range, and under `limit`: none
 * when the range ends at a block or a pool's space, or inside a mapped page
 * (the rest of that page may hold a block, which the pages ahead would
 * swallow).  Returns the pages it adds past the range's last page. */
static size_t room_ahead(gm_heap *h, const placement *pl, size_t size, size_t need, size_t limit) {
    size_t p1 = h_page_ceil(h, pl->addr + size), held = h_held_pages(h) + need;
    if (pl->pooled || need >= ROOM_AHEAD_PAGES || p1 >= h->n_pages || held >= limit) return 0;
    const gm_block *c = h_block_holding(pl->first, pl->addr + size);
    if (!h_growth_space(c)) return 0;
    size_t avail = h_page_floor(h, c->addr + c->size) - p1, want = ROOM_AHEAD_PAGES - need;
    if (want > avail) want = avail;
    return want < limit - held ? want : limit - held;
}

/* Steps 2-3's growth: `need` more pages for placement pl of a request of
 * `size` bytes (in `pool`, or NULL), under the growth limit or, with room,
 * under the room line.  Far from pressure the pages come as chunks: *g
 * becomes `grant` (the pages are promised, then made where they are mapped)
 * and *most the chunks' length; `single`: the device refused a chunk
 * already, single pages only.  Returns the pages taken ahead past the range
 * (room_ahead), which the caller maps with it. */
size_t h_grow_by_policy(gm_heap *h, const placement *pl, size_t size, gm_pool *pool, size_t need, size_t *grant,
                        size_t **g, size_t *most, int single, int *dev_err) {
    size_t limit = growth_limit(h, size);
    size_t ahead = 0;
    /* The device is asked what is free only when room would change something. */
    size_t room = room_line(h);
    if (room > limit) limit = room;
    if (*g == NULL && !single && room_far(h, room, need, ROOM_CHUNK_FAR, ROOM_CHUNK_FREE)) {
        /* far from pressure: the new pages as chunks */
        if (need >= ROOM_CHUNK_MIN) {
            *g = grant;
            *most = ROOM_CHUNK_PAGES;
        } else if (!pool) {
            ahead = room_ahead(h, pl, size, need, limit);
            *g = grant;
            *most = ROOM_SMALL_PAGES;
        }
    }
    h_grow(h, need + ahead, limit, *g, dev_err);
    return ahead;
}
