/*
 * slow.c -- the slow path, when no free block fits: take back other
 * streams' memory, place, grow, defragment, spill, and out of memory last
 * (heap.c, THE PATHS, steps 1-6).
 *
 * Calls: stream.c, place.c, page.c, policy.c, report.c, capture.c, spill.c,
 * and heap.c's fit.
 */
#include "heap_internal.h"

/* ---- the slow path --------------------------------------------------------------------- */

int h_out_of_memory(gm_heap *h, size_t size, gm_stream s, size_t short_pages, int dev_err) {
    /* Pages gathered for a request that failed would only starve others (but
     * during a capture they stay: a release would invalidate it). */
    if (!h->no_sync) h->no_sync = h_capture_on(h, s) || h_other_capture(h);
    h_release_spares(h, h->mapped_pages);
    h_fill_report(h, size, s, &h->last_oom);
    h->last_oom.pages_needed = short_pages;
    h->last_oom.device_error = dev_err;
    h->have_oom = 1;
    if (!(h->alloc_flags & GM_MALLOC_OOM_UNCOUNTED)) {
        h->st.num_ooms++;
        h_hist(h, GM_H_OOM, 0, size, s, 0);
    }
    return GM_ENOMEM;
}

/* torch's num_alloc_retries: the allocation met its limit (the cap or the
 * device refused the pages it lacked) and cached memory was released for it
 * (a device wait, then pages unmapped for reuse), whether it then fitted or
 * not; once per allocation, and never for the repeat of a failed one. */
static inline int count_retry(gm_heap *h, int retried, int rc) {
    if (retried && !(h->alloc_flags & GM_MALLOC_RETRY)) h->st.num_alloc_retries++;
    return rc;
}

/* Pages placement pl lacks beyond the spares and the pages promised. */
static inline size_t lacking(const gm_heap *h, const placement *pl, size_t grant) {
    return pl->new_pages > h->n_spare + grant ? pl->new_pages - h->n_spare - grant : 0;
}

/* Unmap cached pages outside placement pl into spares for its shortfall
 * (the caller has synchronised the device), and count the remap. */
static void recycle_for(gm_heap *h, const placement *pl, size_t size, size_t grant, int *recycled) {
    size_t got = h_recycle(h, lacking(h, pl, grant), h_page_floor(h, pl->addr), h_page_ceil(h, pl->addr + size), 1);
    if (got) {
        *recycled = 1;
        h->st.num_remaps++;
        h->st.num_pages_remapped += (int64_t)got;
    }
}

/* Wait for the device, place again (every stream's free memory is usable
 * now), and unmap cached pages into spares for the placement's shortfall. */
static void defragment(gm_heap *h, placement *pl, size_t size, gm_stream s, gm_pool *pool, size_t *promised,
                       int *synced, int *recycled, int *dev_err) {
    if (h_synchronize(h, s) != GM_OK) {
        *dev_err = GM_EDEVICE;
        return;
    }
    *synced = 1;
    *pl = h_place(h, size, s, pool);
    if (pl->ok && lacking(h, pl, *promised)) recycle_for(h, pl, size, *promised, recycled);
    /* Still short: split chunks whose free pages are locked (split.c) -- any
     * chunk, the placement's own too, whose free pages it would use in place
     * -- and place again on what that freed, while splits free pages. */
    while (h->split && pl->ok && lacking(h, pl, *promised) && h->multi_chunks) {
        size_t got = h_split_chunks(h, lacking(h, pl, *promised), dev_err);
        /* A split borrows promised pages to copy into and gives them back;
         * one whose chunk would not go back keeps them: the promise shrinks. */
        size_t held = h_held_pages(h);
        if (held + *promised > h->cap_pages) *promised = h->cap_pages > held ? h->cap_pages - held : 0;
        if (!got) return;
        *recycled = 1;
        h->st.num_remaps++;
        h->st.num_pages_remapped += (int64_t)got;
        *pl = h_place(h, size, s, pool);
        if (pl->ok && lacking(h, pl, *promised)) recycle_for(h, pl, size, *promised, recycled);
    }
}

/* Pages locked in chunks serve only in place: the range that needs the
 * fewest new pages may be one whose own cached pages are the only ones that
 * could move.  Then a range the movable pages elsewhere cover (after a
 * device wait). */
static void place_around_chunks(gm_heap *h, placement *pl, size_t size, gm_stream s, gm_pool *pool, size_t grant,
                                int *recycled) {
    placement alt = h_place_within(h, size, s, pool, h->n_spare + grant);
    if (alt.ok) {
        *pl = alt;
        if (lacking(h, pl, grant)) recycle_for(h, pl, size, grant, recycled);
    }
}

/* Whether the device or the cap would refuse `need` more pages (besides
 * those promised): the allocation met its limit, where torch's cudaMalloc
 * fails. */
static int beyond_limit(gm_heap *h, size_t need, size_t grant) {
    size_t held = h_held_pages(h) + grant, dfree = 0, total = 0;
    if (held + need > h->cap_pages) return 1;
    return h->dev->ops->mem_info(h->dev, &dfree, &total) == GM_OK && need > dfree / h->page;
}

/* Pages a defragmentation can give placement pl: cached ones, and those
 * locked in chunks that splits free (split.c), with the cached ones, the
 * spares and the pages under the cap to copy into. */
static size_t movable_pages(gm_heap *h, const placement *pl, size_t size) {
    size_t pages = h_cached_pages_outside(h, *pl, size), held = h_held_pages(h);
    if (h->multi_chunks) pages += h_split_gain(h, pages + h->n_spare + (h->cap_pages > held ? h->cap_pages - held : 0));
    return pages;
}

typedef struct step4 {
    placement *pl;
    size_t want;
    gm_stream s;
    gm_pool *pool;
    size_t *grant; /* the pages promised so far */
    size_t *g;     /* h_grow's promise, or NULL */
    int *synced, *recycled, *dev_err;
} step4;

/* Step 4: defragment when cached pages can cover the shortfall (a device
 * wait buys nothing otherwise); else grow to the cap, and defragment with
 * what there is only if the device or the cap refused.  Returns whether the
 * allocation met its limit (beyond_limit, or the device or the cap refused):
 * with *synced, torch's retry after a cache flush. */
static int defragment_or_grow(gm_heap *h, step4 *a) {
    placement *pl = a->pl;
    int met = 0;
    size_t short_pages = pl->ok ? lacking(h, pl, *a->grant) : 0;
    if (!pl->ok || (short_pages && movable_pages(h, pl, a->want) >= short_pages)) {
        met = !pl->ok || beyond_limit(h, short_pages, *a->grant);
        defragment(h, pl, a->want, a->s, a->pool, a->grant, a->synced, a->recycled, a->dev_err);
    }
    if (pl->ok && lacking(h, pl, *a->grant)) h_grow(h, lacking(h, pl, *a->grant), h->cap_pages, a->g, a->dev_err);
    if (pl->ok && !lacking(h, pl, *a->grant)) return met;
    if (!*a->synced) {
        defragment(h, pl, a->want, a->s, a->pool, a->grant, a->synced, a->recycled, a->dev_err);
        if (pl->ok && lacking(h, pl, *a->grant)) h_grow(h, lacking(h, pl, *a->grant), h->cap_pages, a->g, a->dev_err);
    }
    return 1;
}

/* Whether streams other than s own free memory in the general heap (owners[0]
 * is the general heap's GM_STREAM_ANY, owners[1] a first stream's). */
static inline int others_own(const gm_heap *h, gm_stream s) {
    return h->n_owners > 2 || (h->n_owners == 2 && h->owners[1]->stream != s);
}

/* Step 3b, under pressure (growth under the limit did not cover the
 * request), before a device wait or growth past the limit: hand s what other
 * streams freed while their work still runs, s made to wait for that work on
 * the device (stream.c, HAND-OFF).  1 with *out (and *at, where to carve) when a
 * free block now fits the request; else, if memory changed hands, *pl placed again (*want as step 2). */
static int handoff(gm_heap *h, size_t size, gm_stream s, gm_pool *pool, placement *pl, size_t *want, gm_block **out,
                   uintptr_t *at) {
    if (!h->handoff || (!h->n_pending && !others_own(h, s))) return 0;
    if (!h_stream_handoff(h, s, pool, size)) return 0;
    h->st.num_stream_handoffs++;
    if ((*out = h_fit(h, size, s, pool, at))) return 1;
    *pl = h_place(h, *want, s, pool);
    if (!pl->ok && *want > size) *pl = h_place(h, *want = size, s, pool);
    return 0;
}

/* Step 6, then 5: with spill on (not during a capture, not for a pool), serve
 * the request from host pages (spill.c) -- GM_OK with *out, or with *out NULL
 * when the oldest blocks moved there and the request is to try again; else out
 * of memory, whose report says why spill did not serve it. */
static int spill_or_oom(gm_heap *h, size_t size, gm_stream s, gm_pool *pool, size_t short_pages, int dev_err,
                        int *spilled, gm_block **out, uintptr_t *at) {
    int spill_rc = h->spill_pages ? GM_ENOMEM : GM_OK;
    *out = NULL;
    if (h->spill_pages && !pool) {
        if (h->no_sync)
            spill_rc = GM_ECAPTURING;
        else if ((spill_rc = h_spill(h, size, s, short_pages, spilled, out, at)) == GM_OK)
            return GM_OK;
        if (spill_rc == GM_ECORRUPT) return GM_ECORRUPT;
    }
    int rc = h_out_of_memory(h, size, s, short_pages, dev_err);
    h->last_oom.spill_error = spill_rc;
    return rc;
}

/* During a capture (h->no_sync) only steps 2, 3 (to the cap) and 5 run: no
 * event, no synchronisation, no unmap or release.  New pages are promised
 * (grow's *grant) and created as chunks where back_range maps them; if the
 * device then has too little for them even as single pages, the request
 * starts over with single spares made up front, as with chunk_pages 1 (the
 * pages mapped meanwhile stay, free).  *reach: where the pages a pool's
 * growth took ahead end (the caller makes them the pool's); untouched when
 * there are none. */
int h_alloc_slow(gm_heap *h, size_t size, gm_stream s, gm_pool *pool, gm_block **out, uintptr_t *at, uintptr_t *reach) {
    h->st.num_slow_allocs++;
    size_t grant = 0, *g = h->chunk_pages > 1 ? &grant : NULL, most = h->chunk_pages;
    int single = 0;  /* the device refused a chunk: single pages from then on */
    int retried = 0; /* met the limit and released cached memory (count_retry) */
    int spilled = 0; /* the oldest blocks were moved to the host once (h_spill) */
    /* What the growth places: a pool's, far from pressure, torch's segment
     * (POLICY), during a capture too, as torch's segments are. */
    size_t want = pool ? h_pool_reach(h, pool, size) : size;
again:;
    gm_block *b;
    int dev_err = GM_OK, recycled = 0, synced = 0;
    placement pl;
    size_t ahead = 0; /* pages mapped past the range (room_ahead) */
    grant = 0;
    if (h->no_sync) {
        pl = h_place(h, want, s, pool);
        if (pl.ok && lacking(h, &pl, grant)) h_grow(h, lacking(h, &pl, grant), h->cap_pages, g, &dev_err);
        synced = 1; /* as if: no defragmentation below */
        goto placed;
    }
    if (h->n_parked) h_unpark(h); /* no capture is on */
    /* 1. Memory other streams (or record_stream users) have finished with. */
    size_t moved = h->n_pending ? h_process_pending(h, 0) : 0;
    if (others_own(h, s)) moved += h_release_owners(h, s, 0);
    b = moved ? h_fit(h, size, s, pool, at) : NULL;
    if (b) {
        *out = b;
        return GM_OK;
    }
    /* 2-3. Place, and back it with spare or new pages under the growth limit,
     * or, with room, under the room line (POLICY). */
    pl = h_place(h, want, s, pool);
    if (!pl.ok && want > size) pl = h_place(h, want = size, s, pool);
    if (pl.ok && lacking(h, &pl, grant))
        ahead = h_grow_by_policy(h, &pl, want, pool, lacking(h, &pl, grant), &grant, &g, &most, single, &dev_err);
    /* 3b. Still short: other streams' memory, with a wait on the device. */
    if ((!pl.ok || lacking(h, &pl, grant)) && handoff(h, size, s, pool, &pl, &want, &b, at)) {
        *out = b;
        return GM_OK;
    }
    /* 4. Defragment, or grow to the cap (defragment_or_grow). */
    step4 st4 = {&pl, want, s, pool, &grant, g, &synced, &recycled, &dev_err};
    retried |= defragment_or_grow(h, &st4) && synced;
    if (pl.ok && lacking(h, &pl, grant) && synced && h->multi_chunks)
        place_around_chunks(h, &pl, want, s, pool, grant, &recycled);
    if (dev_err == GM_ECORRUPT) return count_retry(h, retried, GM_ECORRUPT); /* a split lost a chunk's mapping */
placed:
    if ((!pl.ok || lacking(h, &pl, grant)) && want > size) {
        want = size; /* a pool's segment did not fit: its request alone */
        goto again;
    }
    if (!pl.ok || lacking(h, &pl, grant)) {
        size_t short_pages = pl.ok ? lacking(h, &pl, grant) : (size + h->page - 1) / h->page;
        int rc = spill_or_oom(h, size, s, pool, short_pages, dev_err, &spilled, &b, at);
        if (rc == GM_OK && !b) goto again; /* blocks moved to the host: the device has room now */
        if (rc == GM_OK) *out = b;
        return count_retry(h, retried, rc);
    }
    int err = GM_OK;
    h->growth_seq++;
    if (pool) h_stamp_pool_growth(h, &pl, want, pool);
    size_t span = ahead ? h_page_addr(h, h_page_ceil(h, pl.addr + want) + ahead) - pl.addr : want;
    b = h_back_range(h, &pl, span, s, pool, recycled, most, g, &err);
    if (!b && err == GM_ENOMEM && g) {
        g = NULL; /* the device is nearly full: single pages, gathered first */
        single = 1;
        most = h->chunk_pages;
        goto again;
    }
    if (!b) {
        h_release_spares(h, h->mapped_pages);
        return count_retry(h, retried, err ? GM_EDEVICE : GM_ECORRUPT);
    }
    *out = b;
    *at = pl.addr;
    if (want > size) *reach = pl.addr + want; /* the pool's pages placed ahead are the pool's too */
    return count_retry(h, retried, GM_OK);
}
