/*
 * fuzz_ops.c -- the fuzz driver's operations (fuzz.h): each one calls the core and
 * checks what it did against the model (fuzz_model.c); then the op mix.
 */
#include "fuzz.h"

/* ---- operations ------------------------------------------------------------ */

static int any_held(const world *w) {
    for (int i = 0; i < NSTREAMS; i++)
        if (w->held[i]) return 1;
    return 0;
}

/* A gm_malloc that failed (GM_ENOMEM or GM_EDEVICE): fair, reported, and leaving *out alone. */
static void check_failed_malloc(world *w, int rc, size_t size, int pool, uintptr_t p) {
    if (rc == GM_ENOMEM)
        w->n_oom++;
    else
        w->n_devfail++;
    if (rc == GM_EDEVICE && !w->faults_on) fail("gm_malloc(%zu) returned GM_EDEVICE with no fault injected", size);
    /* Defragmentation must turn every page not touched by a live block into
     * room, so without faults, holds or pending work an OOM is only fair when
     * the request really cannot fit next to the live pages. */
    if (rc == GM_ENOMEM && !w->faults_on && !any_held(w) && w->nq == 0 && !w->capturing) {
        size_t limit = w->cap ? w->cap : w->capacity;
        size_t need = round_up(size, w->page) / w->page + 1;
        /* Pages of a physical allocation that a live block uses cannot move. */
        size_t have = kept_pages(w, 1);
        if (have + need <= limit / w->page)
            fail("gm_malloc(%zu) failed with GM_ENOMEM although live blocks keep %zu pages, the "
                 "request needs at most %zu and the limit is %zu pages",
                 size, have, need, limit / w->page);
        /* The report names the device's pages locked that way. */
        gm_oom_info lo;
        size_t locked = device_locked_pages(w);
        if (gm_last_oom(w->heap, &lo) == GM_OK && lo.chunk_locked_bytes != locked * w->page)
            fail("OOM report: %zu bytes locked in physical allocations, the model says %zu pages",
                 lo.chunk_locked_bytes, locked);
        /* Nor does it claim that a block as large as the request could be made. */
        if (pool < 0 && lo.largest_possible >= round_up(size, GM_ALIGN))
            fail("gm_malloc(%zu) failed with GM_ENOMEM, but its report says a block of %zu bytes could be made", size,
                 lo.largest_possible);
    }
    gm_oom_info oi;
    if (rc == GM_ENOMEM && gm_last_oom(w->heap, &oi) != GM_OK) fail("gm_last_oom has no report after an OOM");
    if (rc == GM_ENOMEM && oi.request < round_up(size, GM_ALIGN))
        fail("OOM report names request %zu for a %zu-byte malloc", oi.request, size);
    if (p != 0) fail("failed gm_malloc wrote %#" PRIxPTR " to *out", p);
    check_stats(w, "failed malloc");
}

void op_malloc(world *w, rng_t *r) {
    size_t size = rnd_size(r);
    int si = (int)rnd_below(r, NSTREAMS);
    uint64_t ctx = rnd(r);
    int pool = -1;
    if (chance(r, 250000)) {
        int k = (int)rnd_below(r, NPOOLS);
        if (w->pool_uses[k]) pool = k;
        /* Half the time a little more than memory the pool keeps free: the
         * placement may extend that block (a graph recorded at a larger shape). */
        if (pool >= 0 && w->npf && chance(r, 500000)) {
            const prange *pr = &w->pf[rnd_below(r, w->npf)];
            if (pr->pool == pool) size = pr->size + 1 + (size_t)rnd_below(r, 4 * w->page);
        }
    }
    gm_pool_id pid = pool_id(pool < 0 ? 0 : pool);
    gm_stats before;
    gm_get_stats(w->heap, &before);
    uintptr_t p = 0;
    w->n_malloc++;
    w->n_pool_malloc += pool >= 0;
    int rc = gm_malloc_pool(w->heap, size, STREAMS[si], ctx, pool < 0 ? NULL : &pid, &p);
    if ((rc == GM_EPAUSED) != (pool >= 0 && w->paused[pool]))
        fail("gm_malloc_pool in pool %d (%spaused) returned %d", pool, pool >= 0 && w->paused[pool] ? "" : "not ", rc);
    if (rc == GM_EPAUSED) {
        if (p != 0) fail("refused gm_malloc wrote %#" PRIxPTR " to *out", p);
        check_stats(w, "malloc in a paused pool");
        return;
    }
    if (rc == GM_ENOMEM || rc == GM_EDEVICE) {
        check_failed_malloc(w, rc, size, pool, p);
        return;
    }
    if (rc != GM_OK) fail("gm_malloc(%zu, stream %d) returned %d (%s)", size, si, rc, gm_strerror(rc));
    if (p == 0) fail("gm_malloc(%zu) returned GM_OK and a NULL pointer", size);
    if (p % GM_ALIGN) fail("gm_malloc(%zu) returned %#" PRIxPTR ", not 512-aligned", size, p);
    size_t bs = gm_block_size(w->heap, p);
    if (bs < round_up(size, GM_ALIGN) || bs % GM_ALIGN) fail("gm_malloc(%zu) gave a block of %zu bytes", size, bs);
    if (p < w->va_base || p + bs > w->va_base + w->va_size)
        fail("block %#" PRIxPTR "+%zu lies outside the heap's range", p, bs);
    const blk *o = sh_overlap(&w->live, p, bs);
    if (o)
        fail("gm_malloc(%zu) returned %#" PRIxPTR "+%zu overlapping live block %#" PRIxPTR "+%zu", size, p, bs, o->addr,
             o->size);
    g_addr = p;
    if (!gm_sim_is_accessible(w->dev, p, bs))
        fail("gm_malloc(%zu) returned %#" PRIxPTR "+%zu that is not mapped with access", size, p, bs);
    q_check_alloc(w, p, bs, si);
    pf_take(w, p, bs, pool);
    if (pool >= 0) pf_learn_reach(w, p, bs, pool);
    sh_insert(&w->live, (blk){p, bs, size, si, 0, pool, pool < 0 ? 0 : w->pool_gen[pool]});
    w->n_malloc_ok++;
    gm_stats st;
    gm_get_stats(w->heap, &st);
    /* Growth never pushes reserved memory over the cap. */
    if (w->cap && (size_t)st.reserved_bytes[GM_POOL_ALL].current > w->cap &&
        st.reserved_bytes[GM_POOL_ALL].current > before.reserved_bytes[GM_POOL_ALL].current)
        fail("malloc grew reserved from %" PRId64 " to %" PRId64 " over the cap %zu",
             before.reserved_bytes[GM_POOL_ALL].current, st.reserved_bytes[GM_POOL_ALL].current, w->cap);
    check_stats(w, "malloc");
}

static void remember_freed(world *w, uintptr_t a) {
    w->freed[w->nfreed % FREED_RING] = a;
    w->nfreed++;
}

/* The held streams a freed block b must wait for: its own stream's (*other:
 * only another stream's allocation waits) and those of streams it was
 * recorded on (*all: every allocation waits). */
static void wait_masks(const world *w, const blk *b, unsigned *all, unsigned *other) {
    *all = *other = 0;
    for (int s = 0; s < NSTREAMS; s++) {
        if (!w->held[s]) continue;
        if (s == b->stream)
            *other |= 1u << s;
        else if (b->recorded & (1u << s))
            *all |= 1u << s;
    }
}

static void op_free(world *w, rng_t *r) {
    if (!w->live.n) return;
    size_t i = (size_t)rnd_below(r, w->live.n);
    blk b = w->live.v[i];
    /* Decide what must wait, from the holds as they are at the free. */
    unsigned all_mask, other_mask;
    wait_masks(w, &b, &all_mask, &other_mask);
    w->n_free++;
    int rc = gm_free(w->heap, b.addr);
    if (rc != GM_OK) {
        if (!w->faults_on) fail("gm_free(%#" PRIxPTR ") of a live block returned %d (%s)", b.addr, rc, gm_strerror(rc));
        /* A device failure while freeing may leave the block live or not; the
         * core must say which through gm_block_size. */
        if (gm_block_size(w->heap, b.addr) == b.size) {
            check_stats(w, "failed free");
            return;
        }
    }
    sh_remove(&w->live, i);
    if (gm_block_size(w->heap, b.addr) != 0) fail("block %#" PRIxPTR " still live after gm_free", b.addr);
    if (all_mask || other_mask) q_add(w, &b, all_mask, other_mask);
    if (b.pool >= 0 && w->pool_uses[b.pool] && b.gen == w->pool_gen[b.pool]) pf_push(w, b.addr, b.size, b.pool);
    remember_freed(w, b.addr);
    check_stats(w, "free");
}

static void op_record(world *w, rng_t *r) {
    if (!w->live.n) return;
    size_t i = (size_t)rnd_below(r, w->live.n);
    int si = (int)rnd_below(r, NSTREAMS);
    w->n_record++;
    int rc = gm_record_stream(w->heap, w->live.v[i].addr, STREAMS[si]);
    if (rc != GM_OK) {
        if (!w->faults_on) fail("gm_record_stream of a live block returned %d", rc);
        return;
    }
    if (si != w->live.v[i].stream) w->live.v[i].recorded |= 1u << si;
}

/* Frees of pointers that are not live must fail with the right code and leave
 * the heap as it was. */
static void op_bad_free(world *w, rng_t *r) {
    uintptr_t p;
    int want;
    unsigned kind = (unsigned)rnd_below(r, 4);
    if (kind == 0 && w->nfreed) {
        size_t n = w->nfreed < FREED_RING ? w->nfreed : FREED_RING;
        p = w->freed[rnd_below(r, n)];
        const blk *o = sh_overlap(&w->live, p, 1);
        if (o && o->addr == p) return; /* handed out again since */
        want = GM_EDOUBLE_FREE;
    } else if (kind == 1 && w->live.n) {
        const blk *b = &w->live.v[rnd_below(r, w->live.n)];
        if (b->size <= GM_ALIGN) return;
        p = b->addr + GM_ALIGN * (1 + rnd_below(r, b->size / GM_ALIGN - 1));
        want = GM_EDOUBLE_FREE; /* inside the heap, not the start of an allocation */
    } else if (kind == 2) {
        p = w->va_base + w->va_size + GM_ALIGN * rnd_below(r, 1024);
        want = GM_EUNKNOWN_PTR;
    } else {
        if (w->va_base <= 8 * GM_ALIGN) return;
        p = w->va_base - GM_ALIGN * (1 + rnd_below(r, 8));
        want = GM_EUNKNOWN_PTR;
    }
    gm_stats before, after;
    gm_get_stats(w->heap, &before);
    w->n_bad_free++;
    int rc = gm_free(w->heap, p);
    if (rc != want)
        fail("gm_free(%#" PRIxPTR ") (bad-free kind %u) returned %d (%s), expected %d (%s)", p, kind, rc,
             gm_strerror(rc), want, gm_strerror(want));
    rc = gm_record_stream(w->heap, p, STREAMS[1]);
    if (rc == GM_OK) fail("gm_record_stream(%#" PRIxPTR ") of a non-live pointer succeeded", p);
    gm_get_stats(w->heap, &after);
    /* Memory accounting must not move; event-driven counters may (a free can
     * poll completed events first). */
    for (int pool = 0; pool < GM_POOL__COUNT; pool++) {
        if (memcmp(&before.allocation[pool], &after.allocation[pool], sizeof(gm_stat)) ||
            memcmp(&before.allocated_bytes[pool], &after.allocated_bytes[pool], sizeof(gm_stat)) ||
            memcmp(&before.requested_bytes[pool], &after.requested_bytes[pool], sizeof(gm_stat)) ||
            memcmp(&before.reserved_bytes[pool], &after.reserved_bytes[pool], sizeof(gm_stat)) ||
            memcmp(&before.segment[pool], &after.segment[pool], sizeof(gm_stat)))
            fail("rejected gm_free(%#" PRIxPTR ") changed the statistics (pool %d)", p, pool);
    }
    if (before.num_device_alloc != after.num_device_alloc || before.num_maps != after.num_maps ||
        before.num_unmaps != after.num_unmaps)
        fail("rejected gm_free(%#" PRIxPTR ") touched the device", p);
}

static void op_empty(world *w) {
    w->n_empty++;
    int rc = gm_empty_cache(w->heap);
    /* Unmapping waits for the device; with a stream held the sim refuses. */
    if (rc != GM_OK && !w->faults_on && !any_held(w)) fail("gm_empty_cache returned %d (%s)", rc, gm_strerror(rc));
    check_stats(w, "empty_cache");
    if (!w->faults_on && !any_held(w) && !w->capturing) {
        /* Nothing may stay cached: every page held is touched by a live block,
         * or shares a physical allocation with one that is. */
        gm_stats st;
        gm_get_stats(w->heap, &st);
        /* Paused pages are touched but released; a physical allocation with a
         * live page keeps all its pages. */
        size_t lp = kept_pages(w, 1) - paused_pages(w) - (size_t)st.spilled_bytes[GM_POOL_ALL].current / w->page;
        if ((size_t)st.reserved_bytes[GM_POOL_ALL].current != lp * w->page) {
            gm_snapshot *snap = NULL;
            size_t used = 0, cached = 0, pending = 0;
            if (gm_snapshot_take(w->heap, &snap) == GM_OK) {
                for (size_t i = 0; i < snap->n_pages; i++) {
                    used += snap->pages[i] == GM_PAGE_USED;
                    cached += snap->pages[i] == GM_PAGE_CACHED;
                }
                for (size_t i = 0; i < snap->n_blocks; i++) pending += snap->blocks[i].state == GM_BLOCK_PENDING;
            }
            fail("after gm_empty_cache reserved is %" PRId64 " but live blocks touch %zu pages (%zu bytes); "
                 "snapshot: %zu used, %zu cached, %zu spare pages, %zu pending blocks",
                 st.reserved_bytes[GM_POOL_ALL].current, lp, lp * w->page, used, cached, snap ? snap->spare_pages : 0,
                 pending);
        }
        gm_sim_info si;
        gm_sim_info_get(w->dev, &si);
        if (si.pages_created != lp || si.pages_mapped != lp)
            fail("after gm_empty_cache the sim holds %zu created / %zu mapped pages, live blocks touch %zu",
                 si.pages_created, si.pages_mapped, lp);
    }
}

static void op_setcap(world *w, rng_t *r) {
    size_t cap = 0;
    if (!chance(r, 250000)) {
        /* Mostly caps above what is live (sometimes below, which must still work:
         * growth stops, frees page out). */
        size_t lo = 64 * MiB;
        cap = lo + (size_t)rnd_below(r, w->capacity - lo);
        cap = round_up(cap, w->page);
    }
    w->n_setcap++;
    int rc = gm_set_cap(w->heap, cap);
    if (rc == GM_OK) {
        w->cap = cap;
        if (gm_get_cap(w->heap) != cap) fail("gm_set_cap(%zu) then gm_get_cap says %zu", cap, gm_get_cap(w->heap));
    } else if (!w->faults_on && !any_held(w)) {
        fail("gm_set_cap(%zu) returned %d (%s)", cap, rc, gm_strerror(rc));
    } else {
        w->cap = gm_get_cap(w->heap);
    }
    check_stats(w, "set_cap");
}

static void op_hold(world *w, rng_t *r) {
    int si = (int)rnd_below(r, NSTREAMS);
    w->n_hold++;
    if (w->held[si]) {
        gm_sim_hold_stream(w->dev, STREAMS[si], 0);
        w->held[si] = 0;
        q_release_stream(w, si);
    } else {
        gm_sim_hold_stream(w->dev, STREAMS[si], 1);
        w->held[si] = 1;
    }
}

/* Retain or release a private pool.  At its end its kept memory joins the heap. */
static void op_pool(world *w, rng_t *r) {
    int i = (int)rnd_below(r, NPOOLS);
    w->n_pool_ops++;
    if (!w->pool_uses[i] || chance(r, 400000)) {
        int rc = gm_pool_retain(w->heap, pool_id(i));
        if (rc != GM_OK) fail("gm_pool_retain(%d) returned %d", i, rc);
        /* Pool 0 is sometimes a no_split pool (torch's MemPool(no_split=True)). */
        if (!w->pool_uses[i] && i == 0 && gm_pool_set_no_split(w->heap, pool_id(i), chance(r, 500000)) != GM_OK)
            fail("gm_pool_set_no_split(%d) failed", i);
        if (!w->pool_uses[i]++) w->pool_gen[i]++;
        return;
    }
    int rc = gm_pool_release(w->heap, pool_id(i));
    if (w->paused[i] && w->pool_uses[i] == 1) { /* a paused pool cannot end */
        if (rc != GM_EPAUSED) fail("gm_pool_release of paused pool %d's last use returned %d", i, rc);
        return;
    }
    if (rc != GM_OK) fail("gm_pool_release(%d) returned %d", i, rc);
    if (!--w->pool_uses[i]) pf_drop_pool(w, i);
}

int blk_paused(const world *w, const blk *b) {
    return b->pool >= 0 && w->paused[b->pool] && b->gen == w->pool_gen[b->pool];
}

static void sync_paused(world *w, int i, const char *what, int rc) {
    gm_pool_info pi;
    if (gm_pool_info_get(w->heap, pool_id(i), &pi) != GM_OK) fail("%s: pool %d vanished (rc %d)", what, i, rc);
    w->paused[i] = pi.paused;
}

/* Pause a living pool (with a backup half the time), or resume a paused one. */

/* Before a pause with a backup: a random value written into each page under
 * pool i's live blocks (64 at most), to be found there after the resume. */
static void save_pages(world *w, rng_t *r, int i) {
    for (size_t k = 0; k < w->live.n && w->nsaved[i] < 64; k++) {
        const blk *b = &w->live.v[k];
        if (b->pool != i || b->gen != w->pool_gen[i]) continue;
        for (uintptr_t a = b->addr / w->page * w->page; a < b->addr + b->size && w->nsaved[i] < 64; a += w->page) {
            /* One value per page: two blocks may share one, also with a
             * block of another pool whose saved values must stay. */
            int dup = 0;
            for (int j = 0; j < NPOOLS && !dup; j++)
                for (size_t k2 = 0; k2 < w->nsaved[j] && !dup; k2++) dup = w->saved[j][k2].addr == a;
            if (dup) continue;
            uint64_t v = rnd(r);
            if (gm_sim_write(w->dev, a, v) != GM_OK)
                fail("live block %#" PRIxPTR " has no page at %#" PRIxPTR, b->addr, a);
            w->saved[i][w->nsaved[i]].addr = a;
            w->saved[i][w->nsaved[i]++].value = v;
        }
    }
}

/* After pool i resumed from a backup: the pages still under its live blocks hold what was saved. */
static void check_restored(world *w, int i) {
    for (size_t k = 0; k < w->nsaved[i]; k++) {
        uintptr_t a = w->saved[i][k].addr;
        int still = 0; /* the page still lies under a live block of the pool */
        for (size_t j = 0; j < w->live.n && !still; j++) {
            const blk *b = &w->live.v[j];
            still = b->pool == i && b->gen == w->pool_gen[i] && b->addr < a + w->page && a < b->addr + b->size;
        }
        if (!still) continue;
        uint64_t v = 0;
        if (gm_sim_read(w->dev, a, &v) != GM_OK) fail("resumed pool %d has no page at %#" PRIxPTR, i, a);
        if (v != w->saved[i][k].value)
            fail("pool %d resumed from a backup: page %#" PRIxPTR " holds %#" PRIx64 ", not %#" PRIx64, i, a, v,
                 w->saved[i][k].value);
        w->n_restored++;
    }
}

static void op_pause(world *w, rng_t *r) {
    int i = (int)rnd_below(r, NPOOLS);
    if (!w->pool_uses[i]) return;
    /* Holds and captures last long: end them most of the time, so that pauses
     * succeed often enough to matter. */
    if (w->capturing && rnd_below(r, 4)) op_capture(w);
    for (int s = 0; s < NSTREAMS; s++)
        if (w->held[s] && rnd_below(r, 4)) {
            gm_sim_hold_stream(w->dev, STREAMS[s], 0);
            w->held[s] = 0;
            q_release_stream(w, s);
        }
    if (!w->paused[i]) {
        int backup = (int)rnd_below(r, 2);
        w->nsaved[i] = 0;
        w->backed[i] = 0;
        if (backup) save_pages(w, r, i);
        gm_pause_info info;
        int rc = gm_pool_pause(w->heap, pool_id(i), backup ? GM_PAUSE_BACKUP : 0, &info);
        w->n_pauses++;
        if (w->capturing) {
            if (rc != GM_ECAPTURING) fail("gm_pool_pause during a capture returned %d", rc);
            return;
        }
        if (rc != GM_OK && !w->faults_on && !any_held(w)) /* a held stream never finishes: no sync */
            fail("gm_pool_pause(%d) returned %d (%s) with no fault injected", i, rc, gm_strerror(rc));
        sync_paused(w, i, "pause", rc);
        if (rc == GM_OK && !w->paused[i]) fail("gm_pool_pause(%d) succeeded but the pool is not paused", i);
        w->backed[i] = backup;
        return;
    }
    gm_pause_info info;
    int rc = gm_pool_resume(w->heap, pool_id(i), &info);
    w->n_resumes++;
    if (w->capturing) {
        if (rc != GM_ECAPTURING) fail("gm_pool_resume during a capture returned %d", rc);
        return;
    }
    /* Without faults only a lack of memory may stop a resume. */
    if (rc != GM_OK && rc != GM_ENOMEM && !w->faults_on)
        fail("gm_pool_resume(%d) returned %d (%s) with no fault injected", i, rc, gm_strerror(rc));
    sync_paused(w, i, "resume", rc);
    if ((rc == GM_OK) == w->paused[i])
        fail("gm_pool_resume(%d) returned %d and the pool is %spaused", i, rc, w->paused[i] ? "" : "not ");
    if (rc != GM_OK) return;
    /* New pages behind the pool's kept memory. */
    for (size_t k = 0; k < w->npf; k++) {
        prange *pr = &w->pf[k];
        if (pr->pool != i) continue;
        pr->h0 = gm_sim_handle_at(w->dev, pr->addr);
        pr->h1 = gm_sim_handle_at(w->dev, pr->addr + pr->size - 1);
    }
    if (w->backed[i]) check_restored(w, i);
    check_stats(w, "resume");
}

/* Checkpoint a pool (gm_pool_live), drop some of its live blocks with
 * gm_pool_set_live, and sometimes restore the checkpoint. */
static void op_set_live(world *w, rng_t *r) {
    int i = (int)rnd_below(r, NPOOLS);
    if (!w->pool_uses[i]) return;
    if (w->paused[i]) {
        if (gm_pool_set_live(w->heap, pool_id(i), NULL, NULL, 0, STREAMS[0]) != GM_EPAUSED)
            fail("gm_pool_set_live on paused pool %d did not answer GM_EPAUSED", i);
        return;
    }
    w->n_set_live++;
    size_t n = gm_pool_live(w->heap, pool_id(i), NULL, NULL, 0);
    uintptr_t *addrs = malloc((n + 1) * sizeof *addrs);
    size_t *sizes = malloc((n + 1) * sizeof *sizes), *keep_sizes = malloc((n + 1) * sizeof *sizes);
    uintptr_t *keep = malloc((n + 1) * sizeof *keep);
    if (!addrs || !sizes || !keep || !keep_sizes) {
        perror("malloc");
        exit(2);
    }
    if (gm_pool_live(w->heap, pool_id(i), addrs, sizes, n) != n) fail("gm_pool_live changed under us");
    size_t nk = 0;
    int restorable = 1;
    for (size_t k = 0; k < n; k++) {
        long j = sh_find(&w->live, addrs[k]);
        if (j < 0 || w->live.v[j].pool != i || w->live.v[j].size != sizes[k])
            fail("gm_pool_live lists %#" PRIxPTR "+%zu, not a live block of pool %d", addrs[k], sizes[k], i);
        if (k && addrs[k] <= addrs[k - 1]) fail("gm_pool_live is not in address order");
        if (rnd_below(r, 3)) {
            keep[nk] = addrs[k];
            keep_sizes[nk++] = sizes[k];
        } else if (w->live.v[j].recorded) {
            restorable = 0; /* freeing it leaves it pending, not free */
        }
    }
    int rc = gm_pool_set_live(w->heap, pool_id(i), keep, keep_sizes, nk, STREAMS[0]);
    if (rc != GM_OK) fail("gm_pool_set_live with a subset of the live blocks returned %d", rc);
    for (size_t k = 0, m = 0; k < n; k++) {
        if (m < nk && keep[m] == addrs[k]) {
            m++;
            continue;
        }
        long j = sh_find(&w->live, addrs[k]);
        blk b = sh_remove(&w->live, (size_t)j);
        unsigned all_mask, other_mask;
        wait_masks(w, &b, &all_mask, &other_mask);
        if (all_mask || other_mask) q_add(w, &b, all_mask, other_mask);
        pf_push(w, b.addr, b.size, i);
        remember_freed(w, b.addr);
    }
    check_stats(w, "set_live");
    if (rnd_below(r, 2)) {
        rc = gm_pool_set_live(w->heap, pool_id(i), addrs, sizes, n, STREAMS[0]);
        if ((rc == GM_OK) != restorable)
            fail("restoring pool %d's checkpoint returned %d; the shadow says it %s", i, rc,
                 restorable ? "can be restored" : "cannot (a dropped block is pending)");
        if (rc == GM_OK) {
            for (size_t k = 0, m = 0; k < n; k++) {
                if (m < nk && keep[m] == addrs[k]) {
                    m++;
                    continue;
                }
                /* Restored: the caller vouches for its stream order, so what
                 * the quarantine said about the range no longer applies. */
                size_t qj = 0;
                for (size_t q = 0; q < w->nq; q++)
                    if (!(w->q[q].addr < addrs[k] + sizes[k] && addrs[k] < w->q[q].addr + w->q[q].size))
                        w->q[qj++] = w->q[q];
                w->nq = qj;
                pf_take(w, addrs[k], sizes[k], i);
                if (sh_overlap(&w->live, addrs[k], sizes[k])) fail("restored block overlaps a live one");
                sh_insert(&w->live, (blk){addrs[k], sizes[k], sizes[k], 0, 0, i, w->pool_gen[i]});
            }
            check_stats(w, "set_live restore");
        }
    }
    free(addrs), free(sizes), free(keep), free(keep_sizes);
}

/* Start or end a capture: the heap is told, and the sim refuses every call a
 * real capture would not survive. */
void op_capture(world *w) {
    if (!w->capturing) {
        gm_capture_begin(w->heap);
        gm_sim_set_capture(w->dev, 1);
        w->capturing = 1;
        w->n_captures++;
    } else {
        gm_sim_set_capture(w->dev, 0);
        gm_capture_end(w->heap);
        w->capturing = 0;
    }
    if (gm_capturing(w->heap) != w->capturing) fail("gm_capturing says %d", gm_capturing(w->heap));
}

void set_faults(world *w, rng_t *r, int on) {
    for (int op = 0; op < GM_OP__COUNT; op++) {
        double p = 0;
        if (on) {
            static const double ps[] = {0, 0.0005, 0.005, 0.02, 0.1};
            p = ps[rnd_below(r, 5)];
        }
        gm_sim_fail_random(w->dev, (gm_dev_op)op, p, on ? rnd(r) : 0);
        if (!on) gm_sim_fail(w->dev, (gm_dev_op)op, 0, 0);
    }
    w->faults_on = on;
}

/* ---- the op mix ---------------------------------------------------------- */

static void op_empty_any(world *w, rng_t *r) {
    (void)r;
    op_empty(w);
}

static void op_capture_any(world *w, rng_t *r) {
    (void)r;
    op_capture(w);
}

/* A burst of frees: drains the heap now and then so that the empty/regrow
 * paths run too. */
static void op_burst(world *w, rng_t *r) {
    uint64_t n = rnd_below(r, w->live.n + 1);
    for (uint64_t k = 0; k < n; k++) op_free(w, r);
}

/* Past the mallocs (the first 40-52% of a draw below a million), each op
 * takes the draws up to its bound. */
static const struct {
    unsigned below;
    void (*op)(world *, rng_t *);
} OPS[] = {
    {938500, op_free},        {940000, op_pause},     {970000, op_record}, {985000, op_bad_free},
    {992000, op_hold},        {996000, op_empty_any}, {997000, op_setcap}, {998000, op_pool},
    {998600, op_capture_any}, {999000, op_set_live},  {999800, op_record}, {1000000, op_burst},
};

/* Runs the op a draw x past the mallocs' share picks. */
void op_drawn(world *w, rng_t *r, unsigned x) {
    size_t i = 0;
    while (x >= OPS[i].below) i++;
    OPS[i].op(w, r);
}
