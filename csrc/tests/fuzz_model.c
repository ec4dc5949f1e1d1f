/*
 * fuzz_model.c -- the fuzz driver's model of the heap (fuzz.h): reporting a failure, the
 * shadow of live blocks, the quarantine of blocks freed on held streams, what pools
 * keep, and the checks of the heap against them.
 */
#include "fuzz.h"

/* ---- reporting ------------------------------------------------------------ */

uint64_t g_seed;
size_t g_chunk_pages; /* --chunk-pages; 0: chosen per run (see the top) */
size_t g_page_size;   /* --page-size; 0: the simulated device's default */
gm_heap *g_heap;      /* for the history dump on failure */
uintptr_t g_addr;     /* address the failure is about (0 if none) */
size_t g_history;     /* --history N: entries to keep */
uint64_t g_op;        /* op index, for messages (single-thread mode) */
const char *g_phase = "setup";

void fail(const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "FUZZ FAILURE at op %" PRIu64 " (seed %" PRIu64 ", phase %s): ", g_op, g_seed, g_phase);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    if (g_heap && g_history && g_addr) {
        /* What happened at this address lately: usually the whole story. */
        static const char *names[] = {"alloc", "free_requested", "free_completed", "map", "unmap", "remap",
                                      "oom",   "empty_cache"};
        gm_hist_entry *e = calloc(g_history, sizeof *e);
        size_t n = e ? gm_history_read(g_heap, e, g_history, NULL) : 0;
        fprintf(stderr, "history touching %#" PRIxPTR " (oldest first):\n", g_addr);
        for (size_t i = 0; i < n; i++)
            if (e[i].action == 6 || e[i].action == 7 ||
                (e[i].addr <= g_addr && g_addr < e[i].addr + (e[i].size ? e[i].size : 1)))
                fprintf(stderr, "  %-14s %#" PRIx64 "+%" PRIu64 " stream %#" PRIx64 "\n",
                        e[i].action < 8 ? names[e[i].action] : "?", e[i].addr, e[i].size, e[i].stream);
        free(e);
    } else if (g_addr) {
        fprintf(stderr, "(rerun with --history 100000 for the history of that address)\n");
    }
    fflush(stderr);
    exit(1);
}

/* v, an array of n elements of `size` bytes with room for *cap, with room
 * for one more: the capacity doubles (from `first`); out of memory exits. */
void *room_for_one(void *v, size_t n, size_t *cap, size_t size, size_t first) {
    if (n < *cap) return v;
    *cap = *cap ? 2 * *cap : first;
    v = realloc(v, *cap * size);
    if (!v) {
        perror("realloc");
        exit(2);
    }
    return v;
}

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* ---- shadow of live blocks: sorted by address ----------------------------- */

/* Index of the first block with addr > a. */
static size_t sh_upper(const shadow *s, uintptr_t a) {
    size_t lo = 0, hi = s->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (s->v[mid].addr <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

/* Returns the block that [a, a+size) overlaps, or NULL. */
const blk *sh_overlap(const shadow *s, uintptr_t a, size_t size) {
    size_t i = sh_upper(s, a);
    if (i > 0 && s->v[i - 1].addr + s->v[i - 1].size > a) return &s->v[i - 1];
    if (i < s->n && s->v[i].addr < a + size) return &s->v[i];
    return NULL;
}

long sh_find(const shadow *s, uintptr_t a) {
    size_t i = sh_upper(s, a);
    if (i > 0 && s->v[i - 1].addr == a) return (long)(i - 1);
    return -1;
}

void sh_insert(shadow *s, blk b) {
    s->v = room_for_one(s->v, s->n, &s->cap, sizeof *s->v, 1024);
    size_t i = sh_upper(s, b.addr);
    memmove(&s->v[i + 1], &s->v[i], (s->n - i) * sizeof *s->v);
    s->v[i] = b;
    s->n++;
    s->bytes += b.size;
    s->req_bytes += b.req;
}

blk sh_remove(shadow *s, size_t i) {
    blk b = s->v[i];
    memmove(&s->v[i], &s->v[i + 1], (s->n - i - 1) * sizeof *s->v);
    s->n--;
    s->bytes -= b.size;
    s->req_bytes -= b.req;
    return b;
}

/* ---- quarantine: freed blocks that must not be handed out yet ------------- *
 * A block freed while a stream that used it is held (a kernel "still running")
 * must not come back until that stream is released.  (The sim refuses a
 * device-wide synchronize while a stream is held -- it would never return -- so
 * nothing but the release completes such work.)  all_mask: held streams
 * named by record_stream -- no allocation on any stream may reuse the range.
 * other_mask: the allocation stream itself was held -- reuse on that same
 * stream is allowed (stream order protects it), on other streams it is not.
 * Either is allowed on a stream the heap made wait on the device for the
 * held streams' work (a hand-off: gm_sim_stream_waits_for). */

gm_pool_id pool_id(int i) { return (gm_pool_id){0x100u + (uint64_t)i, 7}; }

/* Whether block b's pool is paused now (a block of an earlier life of the pool
 * is general memory). */

void pf_push(world *w, uintptr_t a, size_t size, int pool) {
    if (!size) return;
    w->pf = room_for_one(w->pf, w->npf, &w->pfcap, sizeof *w->pf, 64);
    w->pf[w->npf++] = (prange){a, size, pool, gm_sim_handle_at(w->dev, a), gm_sim_handle_at(w->dev, a + size - 1)};
}

/* A block of `pool` (-1: general) was handed out at [a, a+size): it must not
 * overlap memory kept for another pool; what it takes of its own pool's
 * memory leaves the kept set. */
void pf_take(world *w, uintptr_t a, size_t size, int pool) {
    size_t n = w->npf;
    for (size_t i = 0; i < n; i++) {
        prange r = w->pf[i];
        if (!(a < r.addr + r.size && r.addr < a + size)) continue;
        g_addr = r.addr;
        if (r.pool != pool)
            fail("block %#" PRIxPTR "+%zu (pool %d) reuses %#" PRIxPTR "+%zu kept for pool %d", a, size, pool, r.addr,
                 r.size, r.pool);
        /* Cut [a, a+size) out of r: up to two pieces stay. */
        w->pf[i] = w->pf[--w->npf];
        if (i < w->npf) {
            i--;
            n--;
        } else {
            n = w->npf;
        }
        if (r.addr < a) pf_push(w, r.addr, a - r.addr, r.pool);
        if (a + size < r.addr + r.size) pf_push(w, a + size, r.addr + r.size - (a + size), r.pool);
    }
}

/* A pool's growth may take more than its block (far from pressure, torch's
 * segment: the core's POLICY): the pool's free block right after block
 * [a, a+size), not yet kept, is kept for the pool too. */
void pf_learn_reach(world *w, uintptr_t a, size_t size, int pool) {
    gm_snapshot *snap = NULL;
    if (gm_snapshot_take(w->heap, &snap) != GM_OK) return;
    gm_pool_id id = pool_id(pool);
    for (size_t i = 0; i < snap->n_blocks; i++) {
        const gm_block_info *b = &snap->blocks[i];
        if (b->addr != a + size) continue;
        int kept = 0;
        for (size_t k = 0; k < w->npf && !kept; k++)
            kept = w->pf[k].addr <= b->addr && b->addr < w->pf[k].addr + w->pf[k].size;
        if (b->state == GM_BLOCK_FREE && b->pool.first == id.first && b->pool.second == id.second && !kept)
            pf_push(w, b->addr, b->size, pool);
        break;
    }
    gm_snapshot_free(snap);
}

void pf_drop_pool(world *w, int pool) {
    size_t j = 0;
    for (size_t i = 0; i < w->npf; i++)
        if (w->pf[i].pool != pool) w->pf[j++] = w->pf[i];
    w->npf = j;
}

void q_add(world *w, const blk *b, unsigned all_mask, unsigned other_mask) {
    w->q = room_for_one(w->q, w->nq, &w->qcap, sizeof *w->q, 64);
    w->q[w->nq++] = (quar){b->addr, b->size, b->stream, all_mask, other_mask, g_op};
}

void q_release_stream(world *w, int si) {
    size_t j = 0;
    for (size_t i = 0; i < w->nq; i++) {
        w->q[i].all_mask &= ~(1u << si);
        w->q[i].other_mask &= ~(1u << si);
        if (w->q[i].all_mask || w->q[i].other_mask) w->q[j++] = w->q[i];
    }
    w->nq = j;
}

void q_check_alloc(world *w, uintptr_t a, size_t size, int si) {
    for (size_t i = 0; i < w->nq; i++) {
        const quar *q = &w->q[i];
        if (a < q->addr + q->size && q->addr < a + size) {
            g_addr = q->addr;
            /* Held streams whose work must end first (si's own comes before
             * its new work by stream order); the heap may have made si wait
             * for it on the device (a hand-off), which the sim tells. */
            unsigned must = (q->all_mask | (si != q->stream ? q->other_mask : 0)) & ~(1u << si);
            for (int s = 0; s < NSTREAMS; s++)
                if ((must & (1u << s)) && gm_sim_stream_waits_for(w->dev, STREAMS[si], STREAMS[s])) {
                    must &= ~(1u << s);
                    w->n_handed++;
                }
            int bad = must != 0;
            if (bad)
                fail("block %#" PRIxPTR "+%zu on stream %d reuses %#" PRIxPTR "+%zu freed at op %" PRIu64
                     " on stream %d while held streams (record mask %#x, own mask %#x) have not "
                     "finished",
                     a, size, si, q->addr, q->size, q->freed_at, q->stream, q->all_mask, q->other_mask);
            w->n_quar_checked++;
        }
    }
}

/* ---- checks ---------------------------------------------------------------- */

/* Pages the heap's paused pools released: their blocks stay, their memory is
 * neither reserved nor on the device. */
size_t paused_pages(world *w) {
    size_t n = 0;
    for (int i = 0; i < NPOOLS; i++) {
        gm_pool_info pi;
        if (gm_pool_info_get(w->heap, pool_id(i), &pi) == GM_OK) n += pi.paused_pages;
    }
    return n;
}

void check_stats(world *w, const char *after) {
    gm_stats st;
    gm_get_stats(w->heap, &st);
    if ((uint64_t)st.allocated_bytes[GM_POOL_ALL].current != w->live.bytes)
        fail("after %s: allocated_bytes.all.current = %" PRId64 " but the live blocks sum to %" PRIu64, after,
             st.allocated_bytes[GM_POOL_ALL].current, w->live.bytes);
    if ((uint64_t)st.allocation[GM_POOL_ALL].current != w->live.n)
        fail("after %s: allocation.all.current = %" PRId64 " but %zu blocks are live", after,
             st.allocation[GM_POOL_ALL].current, w->live.n);
    if ((uint64_t)st.requested_bytes[GM_POOL_ALL].current != w->live.req_bytes)
        fail("after %s: requested_bytes.all.current = %" PRId64 " but live requests sum to %" PRIu64, after,
             st.requested_bytes[GM_POOL_ALL].current, w->live.req_bytes);
    /* Spilled pages hold live blocks too, in host memory. */
    int64_t paused = (int64_t)(paused_pages(w) * w->page) + st.spilled_bytes[GM_POOL_ALL].current;
    if (st.reserved_bytes[GM_POOL_ALL].current + paused < st.allocated_bytes[GM_POOL_ALL].current)
        fail("after %s: reserved %" PRId64 " + paused/spilled %" PRId64 " < allocated %" PRId64, after,
             st.reserved_bytes[GM_POOL_ALL].current, paused, st.allocated_bytes[GM_POOL_ALL].current);
    if ((size_t)st.reserved_bytes[GM_POOL_ALL].current > w->capacity)
        fail("after %s: reserved %" PRId64 " exceeds the device capacity %zu", after,
             st.reserved_bytes[GM_POOL_ALL].current, w->capacity);
}

void run_check(world *w, const char *where) {
    char why[512] = "";
    int rc = gm_check(w->heap, why, sizeof why);
    w->n_check++;
    if (rc != GM_OK) fail("gm_check (%s) returned %d: %s", where, rc, why);

    /* Cross-check the shadow against a snapshot: the core's idea of which blocks
     * are live must be exactly ours, with the same sizes. */
    gm_snapshot *snap = NULL;
    rc = gm_snapshot_take(w->heap, &snap);
    if (rc != GM_OK) fail("gm_snapshot_take returned %d", rc);
    size_t nl = 0;
    for (size_t i = 0; i < snap->n_blocks; i++) {
        const gm_block_info *bi = &snap->blocks[i];
        if (bi->state != GM_BLOCK_LIVE) continue;
        long k = sh_find(&w->live, bi->addr);
        if (k < 0) fail("snapshot has live block %#" PRIxPTR "+%zu the shadow does not know", bi->addr, bi->size);
        if (w->live.v[k].size != bi->size || w->live.v[k].req != bi->requested)
            fail("snapshot block %#" PRIxPTR ": size %zu req %zu, shadow says %zu / %zu", bi->addr, bi->size,
                 bi->requested, w->live.v[k].size, w->live.v[k].req);
        if (bi->stream != STREAMS[w->live.v[k].stream])
            fail("snapshot block %#" PRIxPTR ": stream %#" PRIx64 ", allocated on %#" PRIx64, bi->addr, bi->stream,
                 STREAMS[w->live.v[k].stream]);
        nl++;
    }
    if (nl != w->live.n) fail("snapshot has %zu live blocks, shadow %zu", nl, w->live.n);
    gm_snapshot_free(snap);

    for (size_t i = 0; i < w->live.n; i++)
        if (!blk_paused(w, &w->live.v[i]) && !gm_sim_is_accessible(w->dev, w->live.v[i].addr, w->live.v[i].size))
            fail("live block %#" PRIxPTR "+%zu is no longer accessible", w->live.v[i].addr, w->live.v[i].size);
    /* Memory kept for a living pool stays mapped, behind the same pages (a
     * paused pool's is checked by gm_check's C12, and gets new pages at resume). */
    for (size_t i = 0; i < w->npf; i++) {
        const prange *r = &w->pf[i];
        if (w->paused[r->pool]) continue;
        g_addr = r->addr;
        if (!gm_sim_is_accessible(w->dev, r->addr, r->size) || gm_sim_handle_at(w->dev, r->addr) != r->h0 ||
            gm_sim_handle_at(w->dev, r->addr + r->size - 1) != r->h1)
            fail("%#" PRIxPTR "+%zu kept for pool %d was unmapped or moved", r->addr, r->size, r->pool);
    }
    for (int i = 0; i < NPOOLS; i++) {
        gm_pool_info pi;
        int rc2 = gm_pool_info_get(w->heap, pool_id(i), &pi);
        if (rc2 == GM_OK && pi.paused != w->paused[i])
            fail("pool %d: the heap says %spaused, the shadow %d", i, pi.paused ? "" : "not ", w->paused[i]);
        if ((rc2 == GM_OK) != (w->pool_uses[i] > 0) || (rc2 == GM_OK && pi.use_count != w->pool_uses[i]))
            fail("pool %d: the heap says %s (use count %lld), the shadow %d uses", i, rc2 ? "unknown" : "living",
                 rc2 ? 0LL : (long long)pi.use_count, w->pool_uses[i]);
        if (rc2 != GM_OK) continue;
        size_t n = 0;
        for (size_t k = 0; k < w->live.n; k++) n += w->live.v[k].pool == i && w->live.v[k].gen == w->pool_gen[i];
        if (gm_pool_live(w->heap, pool_id(i), NULL, NULL, 0) != n)
            fail("pool %d has %zu live blocks, the shadow %zu", i, gm_pool_live(w->heap, pool_id(i), NULL, NULL, 0), n);
    }
    if (gm_sim_capture_violations(w->dev))
        fail("the heap made %" PRIu64 " calls that a stream capture forbids", gm_sim_capture_violations(w->dev));
    check_stats(w, where);
}

/* Pages touched by live blocks: physical memory that no defragmentation can
 * take back.  Used to tell a legitimate OOM from a missed one. */
static int cmp_prange(const void *x, const void *y) {
    uintptr_t a = ((const prange *)x)->addr, b = ((const prange *)y)->addr;
    return a < b ? -1 : a > b;
}

/* ... and memory kept for living pools pins its pages too. */
/* The physical allocation behind page index q (an address / page size), by the device's word. */
static gm_handle handle_of(const world *w, uintptr_t q) { return gm_sim_handle_at(w->dev, q * w->page); }

/* Pages that live blocks and pools' free blocks touch; with `whole`, every
 * page of a physical allocation (one handle on neighbouring pages) that one
 * of those pages lies in: what empty_cache cannot give back.  With a
 * snapshot, only the device's pages (those it marks host are not). */
static size_t count_kept(const world *w, int whole, const gm_snapshot *snap) {
    size_t n = w->live.n + w->npf, pages = 0;
    prange *all = malloc((n ? n : 1) * sizeof *all);
    if (!all) {
        perror("malloc");
        exit(2);
    }
    for (size_t i = 0; i < w->live.n; i++) all[i] = (prange){w->live.v[i].addr, w->live.v[i].size, 0, 0, 0};
    for (size_t i = 0; i < w->npf; i++) all[w->live.n + i] = w->pf[i];
    qsort(all, n, sizeof *all, cmp_prange);
    uintptr_t counted_to = 0; /* pages below this index are counted */
    for (size_t i = 0; i < n; i++) {
        uintptr_t first = all[i].addr / w->page;
        uintptr_t end = (all[i].addr + all[i].size - 1) / w->page + 1;
        if (whole) {
            gm_handle h0 = handle_of(w, first), h1 = handle_of(w, end - 1);
            while (h0 && handle_of(w, first - 1) == h0) first--;
            while (h1 && handle_of(w, end) == h1) end++;
        }
        if (first < counted_to) first = counted_to;
        if (end > first) {
            pages += end - first;
            counted_to = end;
        }
        for (uintptr_t q = first, base = snap ? snap->va_base / w->page : 0; snap && q < end; q++)
            pages -= q - base < snap->n_pages && snap->host[q - base];
    }
    free(all);
    return pages;
}

size_t kept_pages(const world *w, int whole) { return count_kept(w, whole, NULL); }

/* The device's pages that share a physical allocation with a page that live
 * blocks or pools' free blocks touch, untouched themselves: what an OOM
 * report counts locked in chunks (host pages are not the device's). */
size_t device_locked_pages(const world *w) {
    gm_snapshot *snap = NULL;
    if (gm_snapshot_take(w->heap, &snap) != GM_OK) fail("gm_snapshot_take failed");
    size_t locked = count_kept(w, 1, snap) - count_kept(w, 0, snap);
    gm_snapshot_free(snap);
    return locked;
}
