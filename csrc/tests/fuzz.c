/*
 * fuzz.c -- random-operation stress driver for the gpumem core on the sim device.
 *
 *   fuzz [--threads N] [--capacity BYTES] [--history N] [--chunk-pages N] [--page-size BYTES] [--quiet]
 *        [ops=1000000] [seed=1]
 *
 * Single-threaded mode drives one heap with a random mix of gm_malloc (sizes
 * log-uniform from 1 B to 256 MiB on 3 streams), gm_free, gm_record_stream,
 * stream holds, gm_empty_cache, gm_set_cap, private pools (retain/release,
 * allocations in a pool, checkpoint and restore with gm_pool_live/set_live,
 * pause and resume with and without a backup, whose contents are checked),
 * stream captures (gm_capture_begin/end with the sim in capture mode, which
 * refuses and counts every call a capture forbids) and phases of random fault
 * injection, and checks every result against a shadow model kept here,
 * independently of the core.  Threaded mode hammers one heap from N pthreads (each on its own
 * stream) and checks overlap through a shared shadow; each thread keeps a
 * private pool for part of its blocks, and pauses and resumes it now and then.
 * Both first check gm_array_grow (doubling, and refusing sizes past size_t) and
 * fork() with a lock handed to the core by gm_fork_also (the order fork takes
 * the locks in, and a forked child's heap).
 *
 * Physical allocations: without --chunk-pages, a single-threaded run does its
 * first half of the ops on a heap with chunk_pages 1 and the second half on a
 * fresh one with chunk_pages 2..16 (from the seed); a threaded run uses 1 for
 * even seeds, 16 for odd ones.  --page-size runs the heap on pages of that
 * size (a power of two; default the simulated device's 2 MiB), as
 * Heap(page_size=...) does.
 *
 * Exit status 0 on success; on the first violation it prints the op index and
 * seed (enough to reproduce: the run is deterministic for a given seed in
 * single-threaded mode) and exits 1.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "gpumem/array.h"
#include "gpumem/gpumem.h"
#include "gpumem/sim.h"
#include "rng.h"

#define MiB        ((size_t)1 << 20)
#define GiB        ((size_t)1 << 30)
#define NSTREAMS   3
#define FREED_RING 64
#define NPOOLS     3

/* Streams are arbitrary handle values; 0 is the legacy default stream. */
static const gm_stream STREAMS[NSTREAMS] = {0, 0x7f0000001000ull, 0x7f0000002000ull};

/* ---- reporting ------------------------------------------------------------ */

static uint64_t g_seed;
static size_t g_chunk_pages; /* --chunk-pages; 0: chosen per run (see the top) */
static size_t g_page_size;   /* --page-size; 0: the simulated device's default */
static gm_heap *g_heap;      /* for the history dump on failure */
static uintptr_t g_addr;     /* address the failure is about (0 if none) */
static size_t g_history;     /* --history N: entries to keep */
static uint64_t g_op;        /* op index, for messages (single-thread mode) */
static const char *g_phase = "setup";

static void fail(const char *fmt, ...) {
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
static void *room_for_one(void *v, size_t n, size_t *cap, size_t size, size_t first) {
    if (n < *cap) return v;
    *cap = *cap ? 2 * *cap : first;
    v = realloc(v, *cap * size);
    if (!v) {
        perror("realloc");
        exit(2);
    }
    return v;
}

static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

/* ---- shadow of live blocks: sorted by address ----------------------------- */

typedef struct blk {
    uintptr_t addr;
    size_t size;       /* gm_block_size at allocation */
    size_t req;        /* bytes asked for */
    int stream;        /* index into STREAMS */
    unsigned recorded; /* bitmask of streams named with gm_record_stream */
    int pool;          /* index of the private pool, -1: the general heap */
    uint32_t gen;      /* which life of that pool */
} blk;

typedef struct shadow {
    blk *v;
    size_t n, cap;
    uint64_t bytes, req_bytes;
} shadow;

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
static const blk *sh_overlap(const shadow *s, uintptr_t a, size_t size) {
    size_t i = sh_upper(s, a);
    if (i > 0 && s->v[i - 1].addr + s->v[i - 1].size > a) return &s->v[i - 1];
    if (i < s->n && s->v[i].addr < a + size) return &s->v[i];
    return NULL;
}

static long sh_find(const shadow *s, uintptr_t a) {
    size_t i = sh_upper(s, a);
    if (i > 0 && s->v[i - 1].addr == a) return (long)(i - 1);
    return -1;
}

static void sh_insert(shadow *s, blk b) {
    s->v = room_for_one(s->v, s->n, &s->cap, sizeof *s->v, 1024);
    size_t i = sh_upper(s, b.addr);
    memmove(&s->v[i + 1], &s->v[i], (s->n - i) * sizeof *s->v);
    s->v[i] = b;
    s->n++;
    s->bytes += b.size;
    s->req_bytes += b.req;
}

static blk sh_remove(shadow *s, size_t i) {
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
 * stream is allowed (stream order protects it), on other streams it is not. */
typedef struct quar {
    uintptr_t addr;
    size_t size;
    int stream;
    unsigned all_mask, other_mask;
    uint64_t freed_at;
} quar;

/* Memory freed into a living pool: no one but that pool may get it, and the
 * pages behind it never change (h0/h1: the physical pages at its two ends). */
typedef struct prange {
    uintptr_t addr;
    size_t size;
    int pool;
    gm_handle h0, h1;
} prange;

typedef struct world {
    gm_heap *heap;
    gm_device *dev;
    size_t capacity, page;
    uintptr_t va_base;
    size_t va_size;
    shadow live;
    uintptr_t freed[FREED_RING];
    size_t nfreed;
    quar *q;
    size_t nq, qcap;
    int held[NSTREAMS];
    int faults_on;
    size_t cap;            /* what we last set */
    int pool_uses[NPOOLS]; /* 0: not living */
    uint32_t pool_gen[NPOOLS];
    prange *pf; /* freed into living pools */
    size_t npf, pfcap;
    int capturing;
    int paused[NPOOLS]; /* gm_pool_pause'd (as the heap says after each call) */
    /* With a backup: the content of each page under the pool's live blocks at
     * the pause, which a resume must give back. */
    struct {
        uintptr_t addr;
        uint64_t value;
    } saved[NPOOLS][64];
    size_t nsaved[NPOOLS];
    int backed[NPOOLS];
    uint64_t n_pauses, n_resumes, n_restored;
    /* counters for the summary */
    uint64_t n_malloc, n_malloc_ok, n_oom, n_devfail, n_free, n_bad_free, n_record, n_empty, n_setcap, n_hold, n_check,
        n_fault_phases, n_quar_checked, n_pool_malloc, n_pool_ops, n_set_live, n_captures;
} world;

static gm_pool_id pool_id(int i) { return (gm_pool_id){0x100u + (uint64_t)i, 7}; }

/* Whether block b's pool is paused now (a block of an earlier life of the pool
 * is general memory). */
static int blk_paused(const world *w, const blk *b);

static void pf_push(world *w, uintptr_t a, size_t size, int pool) {
    if (!size) return;
    w->pf = room_for_one(w->pf, w->npf, &w->pfcap, sizeof *w->pf, 64);
    w->pf[w->npf++] = (prange){a, size, pool, gm_sim_handle_at(w->dev, a), gm_sim_handle_at(w->dev, a + size - 1)};
}

/* A block of `pool` (-1: general) was handed out at [a, a+size): it must not
 * overlap memory kept for another pool; what it takes of its own pool's
 * memory leaves the kept set. */
static void pf_take(world *w, uintptr_t a, size_t size, int pool) {
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
static void pf_learn_reach(world *w, uintptr_t a, size_t size, int pool) {
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

static void pf_drop_pool(world *w, int pool) {
    size_t j = 0;
    for (size_t i = 0; i < w->npf; i++)
        if (w->pf[i].pool != pool) w->pf[j++] = w->pf[i];
    w->npf = j;
}

static void q_add(world *w, const blk *b, unsigned all_mask, unsigned other_mask) {
    w->q = room_for_one(w->q, w->nq, &w->qcap, sizeof *w->q, 64);
    w->q[w->nq++] = (quar){b->addr, b->size, b->stream, all_mask, other_mask, g_op};
}

static void q_release_stream(world *w, int si) {
    size_t j = 0;
    for (size_t i = 0; i < w->nq; i++) {
        w->q[i].all_mask &= ~(1u << si);
        w->q[i].other_mask &= ~(1u << si);
        if (w->q[i].all_mask || w->q[i].other_mask) w->q[j++] = w->q[i];
    }
    w->nq = j;
}

static void q_check_alloc(world *w, uintptr_t a, size_t size, int si) {
    for (size_t i = 0; i < w->nq; i++) {
        const quar *q = &w->q[i];
        if (a < q->addr + q->size && q->addr < a + size) {
            g_addr = q->addr;
            int bad = q->all_mask != 0 || (q->other_mask != 0 && si != q->stream);
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
static size_t paused_pages(world *w) {
    size_t n = 0;
    for (int i = 0; i < NPOOLS; i++) {
        gm_pool_info pi;
        if (gm_pool_info_get(w->heap, pool_id(i), &pi) == GM_OK) n += pi.paused_pages;
    }
    return n;
}

static void check_stats(world *w, const char *after) {
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

static void run_check(world *w, const char *where) {
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
 * of those pages lies in: what empty_cache cannot give back. */
static size_t kept_pages(const world *w, int whole) {
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
    }
    free(all);
    return pages;
}

static size_t live_pages(const world *w) { return kept_pages(w, 0); }

/* ---- operations ------------------------------------------------------------ */

static int any_held(const world *w) {
    for (int i = 0; i < NSTREAMS; i++)
        if (w->held[i]) return 1;
    return 0;
}

static void op_malloc(world *w, rng_t *r) {
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
            size_t have = kept_pages(w, 1), touched = live_pages(w);
            if (have + need <= limit / w->page)
                fail("gm_malloc(%zu) failed with GM_ENOMEM although live blocks keep %zu pages, the "
                     "request needs at most %zu and the limit is %zu pages",
                     size, have, need, limit / w->page);
            /* The report names the pages locked that way. */
            gm_oom_info lo;
            if (gm_last_oom(w->heap, &lo) == GM_OK && lo.chunk_locked_bytes != (have - touched) * w->page)
                fail("OOM report: %zu bytes locked in physical allocations, the model says %zu pages",
                     lo.chunk_locked_bytes, have - touched);
            /* Nor does it claim that a block as large as the request could be made. */
            if (pool < 0 && lo.largest_possible >= round_up(size, GM_ALIGN))
                fail("gm_malloc(%zu) failed with GM_ENOMEM, but its report says a block of %zu bytes could be made",
                     size, lo.largest_possible);
        }
        gm_oom_info oi;
        if (rc == GM_ENOMEM && gm_last_oom(w->heap, &oi) != GM_OK) fail("gm_last_oom has no report after an OOM");
        if (rc == GM_ENOMEM && oi.request < round_up(size, GM_ALIGN))
            fail("OOM report names request %zu for a %zu-byte malloc", oi.request, size);
        if (p != 0) fail("failed gm_malloc wrote %#" PRIxPTR " to *out", p);
        check_stats(w, "failed malloc");
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

static int blk_paused(const world *w, const blk *b) {
    return b->pool >= 0 && w->paused[b->pool] && b->gen == w->pool_gen[b->pool];
}

static void sync_paused(world *w, int i, const char *what, int rc) {
    gm_pool_info pi;
    if (gm_pool_info_get(w->heap, pool_id(i), &pi) != GM_OK) fail("%s: pool %d vanished (rc %d)", what, i, rc);
    w->paused[i] = pi.paused;
}

/* Pause a living pool (with a backup half the time), or resume a paused one. */
static void op_capture(world *w);

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
        for (size_t k = 0; backup && k < w->live.n && w->nsaved[i] < 64; k++) {
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
    for (size_t k = 0; w->backed[i] && k < w->nsaved[i]; k++) {
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
static void op_capture(world *w) {
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

static void set_faults(world *w, rng_t *r, int on) {
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

/* ---- single-threaded run ----------------------------------------------------- */

static void open_world(world *w, size_t capacity, size_t chunk_pages) {
    memset(w, 0, sizeof *w);
    w->capacity = capacity;
    w->dev = gm_sim_create(capacity, g_page_size);
    if (!w->dev) fail("gm_sim_create failed");
    w->page = w->dev->page_size;
    gm_config cfg;
    gm_config_default(&cfg);
    cfg.chunk_pages = chunk_pages;
    cfg.spill = g_seed % 3 ? 0 : capacity / 4; /* every third seed spills, "old" and "new" in turn */
    cfg.spill_choice = g_seed / 3 % 2;
    int rc = gm_heap_create(w->dev, &cfg, &w->heap);
    if (rc != GM_OK) fail("gm_heap_create returned %d (%s)", rc, gm_strerror(rc));
    gm_snapshot *snap;
    if (gm_snapshot_take(w->heap, &snap) != GM_OK) fail("gm_snapshot_take failed");
    w->va_base = snap->va_base;
    w->va_size = snap->va_size;
    gm_snapshot_free(snap);
    g_heap = w->heap;
    if (g_history) gm_history_enable(w->heap, g_history);
    if (w->va_size < capacity) fail("heap reserved only %zu bytes of VA for %zu of memory", w->va_size, capacity);
}

/* Release every use the fuzzer holds of pool i (the pool ends). */
static void release_pool_uses(world *w, int i) {
    while (w->pool_uses[i]) {
        if (gm_pool_release(w->heap, pool_id(i)) != GM_OK) fail("teardown gm_pool_release(%d) failed", i);
        if (!--w->pool_uses[i]) pf_drop_pool(w, i);
    }
}

/* Let go of the streams the fuzzer holds, completing what waits on them. */
static void unhold_streams(world *w) {
    for (int s = 0; s < NSTREAMS; s++)
        if (w->held[s]) {
            gm_sim_hold_stream(w->dev, STREAMS[s], 0);
            w->held[s] = 0;
            q_release_stream(w, s);
        }
}

/* Free everything, release everything, and check that nothing is left. */
static void close_world(world *w) {
    g_phase = "teardown";
    set_faults(w, NULL, 0);
    if (w->capturing) op_capture(w);
    /* Everything freed (in a paused pool that is bookkeeping), then the paused
     * pools can come back: their memory may have gone to others meanwhile. */
    unhold_streams(w);
    while (w->live.n) {
        blk b = sh_remove(&w->live, w->live.n - 1);
        if (gm_free(w->heap, b.addr) != GM_OK) fail("teardown gm_free(%#" PRIxPTR ") failed", b.addr);
    }
    /* Other pools' free memory is theirs until they end. */
    for (int i = 0; i < NPOOLS; i++)
        if (!w->paused[i]) release_pool_uses(w, i);
    gm_set_cap(w->heap, 0); /* a cap below the paused pages would refuse them */
    w->cap = 0;
    /* Paused pools may together need more than the device has: one at a
     * time.  The free pages of a chunk of several pages (growth's, or an
     * earlier resume's) that another paused pool's kept pages share cannot go
     * until that pool ends, so a resume refused for lack of memory is tried
     * again after the others; only a round in which none comes back fails. */
    for (int progress = 1, left = 1; left && progress;) {
        progress = left = 0;
        for (int i = 0; i < NPOOLS; i++) {
            if (!w->paused[i]) continue;
            int rc = gm_pool_resume(w->heap, pool_id(i), NULL);
            if (rc == GM_ENOMEM) {
                left = 1;
                continue;
            }
            if (rc != GM_OK) fail("teardown gm_pool_resume(%d) returned %d (%s)", i, rc, gm_strerror(rc));
            w->paused[i] = 0;
            progress = 1;
            /* Its memory turns general for the next: a chunk it shares with
             * another pool's blocks could not go otherwise. */
            release_pool_uses(w, i);
        }
        if (left && !progress) fail("teardown: no paused pool could be resumed");
    }
    for (int i = 0; i < NPOOLS; i++) release_pool_uses(w, i);
    unhold_streams(w);
    while (w->live.n) {
        blk b = sh_remove(&w->live, w->live.n - 1);
        int rc = gm_free(w->heap, b.addr);
        if (rc != GM_OK) fail("teardown gm_free(%#" PRIxPTR ") returned %d", b.addr, rc);
    }
    int rc = gm_empty_cache(w->heap);
    if (rc != GM_OK) fail("teardown gm_empty_cache returned %d", rc);
    run_check(w, "teardown");
    gm_stats st;
    gm_get_stats(w->heap, &st);
    if (st.reserved_bytes[GM_POOL_ALL].current || st.segment[GM_POOL_ALL].current || st.active[GM_POOL_ALL].current ||
        st.active_bytes[GM_POOL_ALL].current)
        fail("teardown: reserved %" PRId64 ", segments %" PRId64 ", active %" PRId64 "/%" PRId64 " bytes left",
             st.reserved_bytes[GM_POOL_ALL].current, st.segment[GM_POOL_ALL].current, st.active[GM_POOL_ALL].current,
             st.active_bytes[GM_POOL_ALL].current);
    gm_sim_info si;
    gm_sim_info_get(w->dev, &si);
    if (si.pages_created || si.pages_mapped)
        fail("teardown: the sim still holds %zu created and %zu mapped pages", si.pages_created, si.pages_mapped);
    g_heap = NULL;
    gm_heap_destroy(w->heap);
    free(w->live.v);
    free(w->q);
    free(w->pf);
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

static int run_single(uint64_t ops, uint64_t seed, size_t capacity, int quiet) {
    rng_t r = {seed};
    rng_t delay_rng = {seed ^ 0x5eed0fde1a7ull}; /* its own stream: the op sequence is the same */
    world w;
    size_t chunks = g_chunk_pages ? g_chunk_pages : 1, later = 2 + seed % 15;
    open_world(&w, capacity, chunks);
    uint64_t phase_end = 0;
    g_phase = "normal";
    for (g_op = 0; g_op < ops; g_op++) {
        if (!g_chunk_pages && g_op == ops / 2 && g_op) {
            /* The second half on a heap that makes chunks of several pages. */
            run_check(&w, "half");
            close_world(&w);
            open_world(&w, capacity, chunks = later);
            phase_end = g_op;
        }
        if (g_op == phase_end) {
            /* Phases of a few thousand ops: a third with faults injected. */
            int faults = chance(&r, 330000);
            set_faults(&w, &r, faults);
            g_phase = faults ? "faults" : "normal";
            w.n_fault_phases += faults;
            phase_end = g_op + 2000 + rnd_below(&r, 8000);
            /* Events that complete late in half of the phases. */
            static const uint64_t delays[] = {0, 0, 0, 0, 1, 3, 20, 200};
            gm_sim_set_event_delay(w.dev, delays[rnd_below(&delay_rng, 8)]);
            if (faults) {
                /* Faults leave the heap in states a clean run never reaches;
                 * check it before and after each such phase. */
                run_check(&w, "phase start");
            }
        }
        unsigned x = (unsigned)rnd_below(&r, 1000000);
        /* Keep the live set bounded: with a full device, lean to frees. */
        unsigned p_malloc = w.live.n > 3000 ? 400000 : 520000;
        if (x < p_malloc) {
            op_malloc(&w, &r);
        } else {
            size_t i = 0;
            while (x >= OPS[i].below) i++;
            OPS[i].op(&w, &r);
        }
        if (g_op % 4096 == 4095) run_check(&w, "periodic");
    }
    run_check(&w, "end");
    gm_stats st;
    gm_get_stats(w.heap, &st);
    close_world(&w);
    if (!quiet)
        printf("fuzz: OK %" PRIu64 " ops seed %" PRIu64 " cap %zu MiB page %zu KiB chunk_pages %zu%s: %" PRIu64
               " mallocs (%" PRIu64 " ok, %" PRIu64 " oom, %" PRIu64 " device errors), %" PRIu64 " frees, %" PRIu64
               " bad frees, %" PRIu64 " record_stream, %" PRIu64 " holds, %" PRIu64 " empty_cache, %" PRIu64
               " set_cap, %" PRIu64 " in pools, %" PRIu64 " pool retain/release, %" PRIu64 " set_live, %" PRIu64
               " pauses, %" PRIu64 " resumes (%" PRIu64 " pages restored), %" PRIu64 " captures, %" PRIu64
               " fault phases, %" PRIu64 " checks, %" PRIu64 " quarantine hits; core: %" PRId64 " remaps, %" PRId64
               " pages created, %" PRId64 " retries, %" PRId64 " syncs, %" PRId64 " spills, %" PRId64 " unspills\n",
               ops, seed, capacity >> 20, w.page >> 10, chunks,
               g_chunk_pages ? "" : " (1 in the first half; counts: the second)", w.n_malloc, w.n_malloc_ok, w.n_oom,
               w.n_devfail, w.n_free, w.n_bad_free, w.n_record, w.n_hold, w.n_empty, w.n_setcap, w.n_pool_malloc,
               w.n_pool_ops, w.n_set_live, w.n_pauses, w.n_resumes, w.n_restored, w.n_captures, w.n_fault_phases,
               w.n_check, w.n_quar_checked, st.num_remaps, st.num_device_alloc, st.num_alloc_retries,
               st.num_sync_all_streams, st.num_spills, st.num_unspills);
    return 0;
}

/* ---- multi-threaded run -------------------------------------------------------
 * N threads share one heap.  The shared shadow is updated so that it never
 * claims less than the core: a block enters it right after gm_malloc returns and
 * leaves it right before gm_free is called, so an overlap found at insertion is
 * a real double hand-out. */

typedef struct tworld {
    gm_heap *heap;
    gm_device *dev;
    pthread_mutex_t mu;
    shadow live;
    uint64_t ops_per_thread;
    size_t capacity;
    uint64_t seed;
    int nthreads;
    uint64_t freed_for_resume; /* blocks run_threads freed to resume pools left paused */
} tworld;

typedef struct targ {
    tworld *tw;
    int id;
    int paused; /* its pool is still paused at the end (run_threads resumes it) */
    uint64_t mallocs, ooms, frees;
    uintptr_t *mine;
    size_t nmine, capmine;
} targ;

static void tfail(targ *a, uint64_t op, const char *msg, uintptr_t p, size_t size) {
    fprintf(stderr, "FUZZ FAILURE thread %d op %" PRIu64 " (seed %" PRIu64 "): %s (%#" PRIxPTR "+%zu)\n", a->id, op,
            a->tw->seed, msg, p, size);
    exit(1);
}

static void *thread_main(void *arg) {
    targ *a = arg;
    tworld *tw = a->tw;
    rng_t r = {tw->seed * 1000003u + (uint64_t)a->id};
    gm_stream stream = 0x1000u * (gm_stream)(a->id + 1);
    gm_pool_id pid = {0x200u + (uint64_t)a->id, 1};
    if (gm_pool_retain(tw->heap, pid) != GM_OK) tfail(a, 0, "gm_pool_retain failed", 0, 0);
    int paused = 0;
    for (uint64_t op = 0; op < tw->ops_per_thread; op++) {
        unsigned x = (unsigned)rnd_below(&r, 1000);
        if (x < 500 && a->nmine < 4096) {
            /* Smaller sizes than single mode: threads should contend on the lock,
             * not wait on one another's OOMs. */
            size_t size = rnd_size(&r) >> (rnd_below(&r, 2) ? 0 : 6);
            if (!size) size = 1;
            uintptr_t p = 0;
            int in_pool = !rnd_below(&r, 4);
            int rc = gm_malloc_pool(tw->heap, size, stream, (uint64_t)a->id, in_pool ? &pid : NULL, &p);
            a->mallocs++;
            if ((rc == GM_EPAUSED) != (in_pool && paused))
                tfail(a, op, "gm_malloc_pool: paused pool mismatch", 0, size);
            if (rc == GM_EPAUSED) continue;
            if (rc == GM_ENOMEM) {
                a->ooms++;
                continue;
            }
            if (rc != GM_OK) tfail(a, op, "gm_malloc failed", 0, size);
            size_t bs = gm_block_size(tw->heap, p);
            if (p % GM_ALIGN || bs < round_up(size, GM_ALIGN)) tfail(a, op, "bad block", p, bs);
            pthread_mutex_lock(&tw->mu);
            const blk *o = sh_overlap(&tw->live, p, bs);
            if (o) tfail(a, op, "new block overlaps a live block of another thread", p, bs);
            sh_insert(&tw->live, (blk){p, bs, size, a->id, 0, -1, 0});
            pthread_mutex_unlock(&tw->mu);
            a->mine = room_for_one(a->mine, a->nmine, &a->capmine, sizeof *a->mine, 256);
            a->mine[a->nmine++] = p;
        } else if (x < 960 && a->nmine) {
            size_t i = (size_t)rnd_below(&r, a->nmine);
            uintptr_t p = a->mine[i];
            a->mine[i] = a->mine[--a->nmine];
            if (rnd_below(&r, 8) == 0) {
                /* Hand the block to another thread's stream before freeing. */
                gm_stream other = 0x1000u * (gm_stream)(1 + rnd_below(&r, (uint64_t)tw->nthreads));
                if (gm_record_stream(tw->heap, p, other) != GM_OK) tfail(a, op, "record_stream failed", p, 0);
            }
            pthread_mutex_lock(&tw->mu);
            long k = sh_find(&tw->live, p);
            if (k < 0) tfail(a, op, "own block missing from shadow", p, 0);
            sh_remove(&tw->live, (size_t)k);
            pthread_mutex_unlock(&tw->mu);
            int rc = gm_free(tw->heap, p);
            a->frees++;
            if (rc != GM_OK) tfail(a, op, "gm_free of own live block failed", p, 0);
        } else if (x < 975) {
            if (gm_empty_cache(tw->heap) != GM_OK) tfail(a, op, "gm_empty_cache failed", 0, 0);
        } else if (x < 980) {
            size_t cap = rnd_below(&r, 3) ? 0 : round_up(tw->capacity / 2 + rnd_below(&r, tw->capacity / 2), 2 * MiB);
            if (gm_set_cap(tw->heap, cap) != GM_OK) tfail(a, op, "gm_set_cap failed", 0, cap);
        } else if (x < 982) {
            char why[256] = "";
            if (gm_check(tw->heap, why, sizeof why) != GM_OK) {
                fprintf(stderr, "gm_check: %s\n", why);
                tfail(a, op, "gm_check failed under concurrency", 0, 0);
            }
        } else if (x < 985) {
            /* Readers run beside the writers: what the Python side and the
             * OOM report call from other threads. */
            gm_snapshot *snap = NULL;
            if (gm_snapshot_take(tw->heap, &snap) != GM_OK) tfail(a, op, "gm_snapshot_take failed", 0, 0);
            gm_snapshot_free(snap);
        } else if (x < 988) {
            gm_hist_entry e[16];
            uint64_t dropped = 0;
            if (gm_history_read(tw->heap, e, 16, &dropped) > 16) tfail(a, op, "history read past its buffer", 0, 0);
        } else if (x < 990) {
            gm_oom_info info;
            gm_memory_report(tw->heap, 4 * MiB, &info);
            (void)gm_last_oom(tw->heap, &info);
        } else if (x < 993) {
            /* Pause or resume this thread's pool while the others work. */
            int rc = paused ? gm_pool_resume(tw->heap, pid, NULL)
                            : gm_pool_pause(tw->heap, pid, rnd_below(&r, 2) ? GM_PAUSE_BACKUP : 0, NULL);
            if (rc == GM_OK)
                paused = !paused;
            else if (!(paused && rc == GM_ENOMEM))
                tfail(a, op, paused ? "gm_pool_resume failed" : "gm_pool_pause failed", 0, (size_t)rc);
        } else {
            gm_stats st;
            gm_get_stats(tw->heap, &st);
            if (st.allocated_bytes[GM_POOL_ALL].current < 0 || st.reserved_bytes[GM_POOL_ALL].current < 0)
                tfail(a, op, "negative statistic", 0, 0);
        }
    }
    /* A paused pool cannot end: bring it back if the memory is there now.  It
     * may not be, for as long as anyone likes: every thread keeps its blocks to
     * the end, so once the others have finished nothing frees memory any more.
     * Then run_threads, alone on the heap, frees blocks until it fits. */
    if (paused && gm_pool_resume(tw->heap, pid, NULL) == GM_OK) paused = 0;
    a->paused = paused;
    /* The pool ends; its live blocks join the heap when freed at teardown. */
    if (!paused && gm_pool_release(tw->heap, pid) != GM_OK) tfail(a, 0, "gm_pool_release failed", 0, 0);
    return NULL;
}

/* After the threads: resume thread `a`'s pool, freeing live blocks (highest
 * address first) while the device is too full for it.  With nothing live and no cap
 * the pool's own pages must fit: failing then is the core's fault. */
static void resume_left_paused(tworld *tw, targ *a) {
    gm_pool_id pid = {0x200u + (uint64_t)a->id, 1};
    for (;;) {
        int rc = gm_pool_resume(tw->heap, pid, NULL);
        if (rc == GM_OK) break;
        if (rc != GM_ENOMEM) tfail(a, 0, "gm_pool_resume after the threads failed", 0, (size_t)rc);
        if (tw->live.n) {
            size_t k = tw->live.n - 1;
            uintptr_t p = tw->live.v[k].addr;
            sh_remove(&tw->live, k);
            if (gm_free(tw->heap, p) != GM_OK) tfail(a, 0, "gm_free after the threads failed", p, 0);
            tw->freed_for_resume++;
        } else if (gm_get_cap(tw->heap)) {
            if (gm_set_cap(tw->heap, 0) != GM_OK) tfail(a, 0, "gm_set_cap(0) failed", 0, 0);
        } else {
            tfail(a, 0, "gm_pool_resume is out of memory with nothing live and no cap", 0, 0);
        }
    }
    a->paused = 0;
    if (gm_pool_release(tw->heap, pid) != GM_OK) tfail(a, 0, "gm_pool_release failed", 0, 0);
}

static int run_threads(int nthreads, uint64_t ops, uint64_t seed, size_t capacity, int quiet) {
    tworld tw;
    memset(&tw, 0, sizeof tw);
    pthread_mutex_init(&tw.mu, NULL);
    tw.capacity = capacity;
    tw.seed = seed;
    tw.nthreads = nthreads;
    tw.ops_per_thread = ops / (uint64_t)nthreads;
    tw.dev = gm_sim_create(capacity, g_page_size);
    if (!tw.dev) fail("gm_sim_create failed");
    gm_config cfg;
    gm_config_default(&cfg);
    cfg.chunk_pages = g_chunk_pages ? g_chunk_pages : seed % 2 ? 16 : 1;
    int rc = gm_heap_create(tw.dev, &cfg, &tw.heap);
    if (rc != GM_OK) fail("gm_heap_create returned %d", rc);
    if (g_history) gm_history_enable(tw.heap, g_history); /* history writes under the threads too */
    targ *args = calloc((size_t)nthreads, sizeof *args);
    pthread_t *th = calloc((size_t)nthreads, sizeof *th);
    if (!args || !th) {
        perror("calloc");
        exit(2);
    }
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    g_phase = "threads";
    for (int i = 0; i < nthreads; i++) {
        args[i].tw = &tw;
        args[i].id = i;
        if (pthread_create(&th[i], NULL, thread_main, &args[i]) != 0) {
            perror("pthread_create");
            exit(2);
        }
    }
    for (int i = 0; i < nthreads; i++) pthread_join(th[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    int left_paused = 0;
    for (int i = 0; i < nthreads; i++)
        if (args[i].paused) {
            left_paused++;
            resume_left_paused(&tw, &args[i]);
        }
    g_op = ops;

    /* Quiescent again: the whole-heap checks hold exactly now. */
    world w;
    memset(&w, 0, sizeof w);
    w.heap = tw.heap;
    w.dev = tw.dev;
    w.capacity = capacity;
    w.page = tw.dev->page_size;
    w.live = tw.live;
    for (size_t i = 0; i < w.live.n; i++) w.live.v[i].stream = 0; /* thread ids are not stream indices */
    char why[512] = "";
    if (gm_check(w.heap, why, sizeof why) != GM_OK) fail("gm_check after threads: %s", why);
    for (size_t i = 0; i < w.live.n; i++)
        if (!gm_sim_is_accessible(w.dev, w.live.v[i].addr, w.live.v[i].size))
            fail("live block %#" PRIxPTR " not accessible after threads", w.live.v[i].addr);
    check_stats(&w, "threads");
    uint64_t mallocs = 0, ooms = 0, frees = 0;
    for (int i = 0; i < nthreads; i++) {
        mallocs += args[i].mallocs;
        ooms += args[i].ooms;
        frees += args[i].frees;
        free(args[i].mine);
    }
    gm_stats st;
    gm_get_stats(w.heap, &st);
    close_world(&w); /* frees w.live.v (== tw.live.v) */
    if (!quiet)
        printf("fuzz: OK %d threads x %" PRIu64 " ops seed %" PRIu64 " cap %zu MiB in %.2f s: %" PRIu64
               " mallocs (%" PRIu64 " oom), %" PRIu64 " frees, %d pool(s) resumed after the threads (%" PRIu64
               " blocks freed for them); core: %" PRId64 " remaps, %" PRId64 " pages created\n",
               nthreads, tw.ops_per_thread, seed, capacity >> 20,
               (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9, mallocs, ooms, frees,
               left_paused, tw.freed_for_resume, st.num_remaps, st.num_device_alloc);
    free(args);
    free(th);
    pthread_mutex_destroy(&tw.mu);
    return 0;
}

/* ---- main ------------------------------------------------------------------- */

/* ---- fork(): locks handed to the core with gm_fork_also -------------------------
 * As the torch boundary does, a lock of our own is held while calling into the
 * core.  fork() must take it before any heap lock (or the call below, made
 * from inside the prepare step, would wait for a heap lock fork already holds:
 * SIGALRM then ends the run), release it in the parent and in the child, and
 * leave the heaps usable in the child. */
static pthread_mutex_t also_mu = PTHREAD_MUTEX_INITIALIZER;
static gm_heap *also_heap; /* the heap the lock's holder calls into; NULL after the check */
static int also_locks, also_unlocks;

static void also_lock(void) {
    pthread_mutex_lock(&also_mu);
    if (also_heap) {
        gm_oom_info info;
        gm_memory_report(also_heap, 0, &info);
    }
    also_locks++;
}

static void also_unlock(void) {
    also_unlocks++;
    pthread_mutex_unlock(&also_mu);
}

/* gm_array_grow: starts at `first`, doubles, keeps the contents; a size past
 * size_t fails with the array and its capacity untouched. */
static void check_array_grow(void) {
    g_phase = "array_grow";
    size_t cap = 0;
    uint64_t *a = gm_array_grow(NULL, &cap, 3, sizeof *a);
    if (!a || cap != 3) fail("gm_array_grow from empty: %p, capacity %zu (want 3)", (void *)a, cap);
    for (size_t i = 0; i < cap; i++) a[i] = i + 7;
    uint64_t *b = gm_array_grow(a, &cap, 3, sizeof *b);
    if (!b || cap != 6) fail("gm_array_grow doubling: %p, capacity %zu (want 6)", (void *)b, cap);
    for (size_t i = 0; i < 3; i++)
        if (b[i] != i + 7) fail("gm_array_grow lost element %zu", i);
    size_t huge[] = {SIZE_MAX / 2 + 1, SIZE_MAX / (2 * sizeof *b) + 1, SIZE_MAX};
    for (size_t k = 0; k < sizeof huge / sizeof *huge; k++) {
        size_t c = huge[k];
        if (gm_array_grow(b, &c, 3, sizeof *b) || c != huge[k])
            fail("gm_array_grow accepted capacity %zu * 2 elements of %zu bytes", huge[k], sizeof *b);
    }
    if (b[2] != 9) fail("gm_array_grow changed the array it refused to grow");
    free(b);
}

static void check_fork_also(void) {
    g_phase = "fork";
    if (gm_fork_also(also_lock, NULL) != GM_EINVAL) fail("gm_fork_also accepted a NULL unlock");
    if (gm_fork_also(also_lock, also_unlock) != GM_OK || gm_fork_also(also_lock, also_unlock) != GM_OK)
        fail("gm_fork_also refused a pair");
    gm_device *dev = gm_sim_create(256 * MiB, 0);
    gm_config cfg;
    gm_config_default(&cfg);
    if (!dev || gm_heap_create(dev, &cfg, &also_heap) != GM_OK) fail("gm_heap_create failed");
    uintptr_t p;
    if (gm_malloc(also_heap, 3 * MiB, 0, 0, &p) != GM_OK) fail("gm_malloc failed");
    alarm(60);
    pid_t pid = fork();
    if (pid < 0) fail("fork: %s", strerror(errno));
    if (pid == 0) {
        /* One pair counted once; our lock free again; the heap still works. */
        uintptr_t q;
        char why[256];
        int ok = also_locks == 1 && also_unlocks == 1 && pthread_mutex_trylock(&also_mu) == 0 &&
                 gm_free(also_heap, p) == GM_OK && gm_malloc(also_heap, MiB, 0, 0, &q) == GM_OK &&
                 gm_free(also_heap, q) == GM_OK && gm_check(also_heap, why, sizeof why) == GM_OK;
        _exit(ok ? 0 : 1);
    }
    int status;
    if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fail("forked child: status %#x (locks %d, unlocks %d in the parent)", status, also_locks, also_unlocks);
    alarm(0);
    if (also_locks != 1 || also_unlocks != 1 || pthread_mutex_trylock(&also_mu) != 0)
        fail("parent after fork: locks %d, unlocks %d, or our lock still held", also_locks, also_unlocks);
    pthread_mutex_unlock(&also_mu);
    if (gm_free(also_heap, p) != GM_OK) fail("gm_free after fork failed");
    gm_heap *h = also_heap;
    also_heap = NULL;
    gm_heap_destroy(h);
    g_phase = "setup";
}

static uint64_t parse_u64(const char *s, const char *what) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 0);
    if (errno || end == s) {
        fprintf(stderr, "fuzz: bad %s '%s'\n", what, s);
        exit(2);
    }
    /* Allow a size suffix for --capacity. */
    if (*end == 'G')
        v <<= 30;
    else if (*end == 'M')
        v <<= 20;
    else if (*end) {
        fprintf(stderr, "fuzz: bad %s '%s'\n", what, s);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv) {
    uint64_t ops = 1000000, seed = 1;
    int threads = 0, quiet = 0, npos = 0;
    size_t capacity = 4 * GiB;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = (int)parse_u64(argv[++i], "thread count");
        else if (!strcmp(argv[i], "--capacity") && i + 1 < argc)
            capacity = parse_u64(argv[++i], "capacity");
        else if (!strcmp(argv[i], "--quiet"))
            quiet = 1;
        else if (!strcmp(argv[i], "--history") && i + 1 < argc)
            g_history = (size_t)parse_u64(argv[++i], "history size");
        else if (!strcmp(argv[i], "--chunk-pages") && i + 1 < argc)
            g_chunk_pages = (size_t)parse_u64(argv[++i], "chunk pages");
        else if (!strcmp(argv[i], "--page-size") && i + 1 < argc)
            g_page_size = (size_t)parse_u64(argv[++i], "page size");
        else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: %s [--threads N] [--capacity BYTES|NG|NM] [--history N] [--chunk-pages N] "
                   "[--page-size BYTES|NM] [--quiet] [ops=1000000] [seed=1]\n",
                   argv[0]);
            return 0;
        } else if (argv[i][0] != '-' && npos == 0) {
            ops = parse_u64(argv[i], "op count");
            npos++;
        } else if (argv[i][0] != '-' && npos == 1) {
            seed = parse_u64(argv[i], "seed");
            npos++;
        } else {
            fprintf(stderr, "fuzz: unknown argument '%s' (try --help)\n", argv[i]);
            return 2;
        }
    }
    if (capacity < 256 * MiB) {
        fprintf(stderr, "fuzz: capacity must be at least 256 MiB\n");
        return 2;
    }
    if (g_page_size & (g_page_size - 1) || (g_page_size && (g_page_size < 4096 || g_page_size > 64 * MiB))) {
        fprintf(stderr, "fuzz: page size must be a power of two from 4 KiB to 64 MiB\n");
        return 2;
    }
    g_seed = seed;
    check_array_grow();
    check_fork_also();
    if (threads > 0) return run_threads(threads, ops, seed, capacity, quiet);
    return run_single(ops, seed, capacity, quiet);
}
