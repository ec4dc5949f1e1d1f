/*
 * fuzz_native.c -- random-operation driver for the model of torch's native
 * caching allocator (csrc/model/native_model.c).
 *
 *   fuzz_native [--quiet] [ops=200000] [seed=1]
 *
 * The seed picks a memory limit (none, or 64 MiB to 4 GiB) and a
 * max_split_size (none, or 21 to 512 MiB, in whole MiB or not).  The run then makes random
 * gm_native_malloc calls (sizes log-uniform from 1 B to 256 MiB, now and then
 * a multiple of 2 MiB, one in 8 near max_split_size, on 3 streams), frees of live blocks, frees of addresses
 * never handed out or already freed, and gm_native_empty_cache, and after each
 * checks the model through its public interface against a shadow kept here
 * (walking every block after each op, or after every few once there are
 * thousands, and always after a failure or empty_cache):
 *
 *   - the blocks tile each segment: each starts where the one before it ends,
 *     all on one stream and in one pool; segments do not overlap;
 *   - the segments add up to `reserved` and number `segments`, which is
 *     num_device_alloc - num_device_free, and `reserved` stays under the limit;
 *   - the blocks handed out are exactly the shadow's live ones (address,
 *     stream, a multiple of 512 bytes that holds the request, small-pool blocks
 *     for requests of up to 1 MiB) and add up to `allocated`;
 *   - no free block has a free neighbour (frees merge);
 *   - the peaks never fall and are never below the current values;
 *   - a bad free is refused and changes nothing; after an out-of-memory
 *     failure, and after empty_cache, no segment is wholly free.
 *
 * A second model takes the same requests and frees (none of the empty_cache
 * calls or bad frees), and the run ends by replaying them, packed as a trace,
 * through gm_native_replay: its statistics and first failure must be the
 * second model's.
 *
 * Exit status 0 on success; on the first violation it prints the op index and
 * seed (the run is deterministic for a seed) and exits 1.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem/native_model.h"
#include "args.h"
#include "rng.h"

#define MiB       (UINT64_C(1) << 20)
#define NSTREAMS  3
#define MAX_LIVE  400 /* live blocks kept below this, so that each walk stays short */
#define SMALL_MAX MiB /* the largest request the small pool serves */

static const uint64_t STREAMS[NSTREAMS] = {0, 0x7f0000001000ull, 0x7f0000002000ull};

static uint64_t g_seed, g_op;

static void fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "fuzz_native: seed %" PRIu64 " op %" PRIu64 ": ", g_seed, g_op);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(1);
}

#define CHECK(cond, ...)                                                                                               \
    do {                                                                                                               \
        if (!(cond)) fail(__VA_ARGS__);                                                                                \
    } while (0)

/* ---- the shadow ----------------------------------------------------------------------------- */

typedef struct live {
    int64_t addr;  /* in the model under test */
    uint64_t size; /* requested */
    uint64_t stream;
    uint32_t slot; /* in the trace */
    int in_twin;   /* the second model handed it out too (it may have run out of memory) */
    int64_t twin_addr;
} live;

typedef struct world {
    gm_native *m, *twin;
    uint64_t capacity, max_split;
    live lv[MAX_LIVE];
    size_t n_live;
    int64_t freed[64]; /* addresses freed lately, for double frees */
    size_t n_freed;
    uint64_t *trace; /* 3 words an event: op | slot << 32, size, stream */
    size_t n_events, cap_events;
    uint32_t next_slot;
    int64_t twin_first_oom;
    gm_native_stats last; /* for the peaks' monotonicity */
    gm_native_block *blocks;
    int64_t (*segs)[2]; /* per segment: its start and end, as many as blocks */
    size_t cap_blocks, n_walked;
    uint64_t mallocs, ooms, frees, bad_frees, empties;
} world;

static uint64_t round512(uint64_t n) { return n < 512 ? 512 : (n + 511) / 512 * 512; }

static void trace_push(world *w, uint64_t op_slot, uint64_t size, uint64_t stream) {
    if (w->n_events == w->cap_events) {
        w->cap_events = w->cap_events ? 2 * w->cap_events : 4096;
        w->trace = realloc(w->trace, w->cap_events * 3 * sizeof *w->trace);
        CHECK(w->trace != NULL, "out of host memory for the trace");
    }
    uint64_t *e = &w->trace[3 * w->n_events++];
    e[0] = op_slot;
    e[1] = size;
    e[2] = stream;
}

/* ---- the checks ------------------------------------------------------------------------------- */

static size_t walk(world *w) {
    size_t n = gm_native_blocks(w->m, NULL, 0);
    if (n > w->cap_blocks) {
        w->cap_blocks = 2 * n;
        free(w->blocks);
        free(w->segs);
        w->blocks = malloc(w->cap_blocks * sizeof *w->blocks);
        w->segs = malloc(w->cap_blocks * sizeof *w->segs);
        CHECK(w->blocks != NULL && w->segs != NULL, "out of host memory for the walk");
    }
    CHECK(gm_native_blocks(w->m, w->blocks, w->cap_blocks) == n, "the block count changed between two walks");
    return n;
}

static const live *find_live(const world *w, int64_t addr) {
    for (size_t i = 0; i < w->n_live; i++)
        if (w->lv[i].addr == addr) return &w->lv[i];
    return NULL;
}

static int live_by_addr(const void *a, const void *b) {
    int64_t x = (*(const live *const *)a)->addr, y = (*(const live *const *)b)->addr;
    return (x > y) - (x < y);
}

/* The live block at addr by binary search in `sorted` (the live blocks by address). */
static const live *lookup(const live *const *sorted, size_t n, int64_t addr) {
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (sorted[mid]->addr < addr)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < n && sorted[lo]->addr == addr ? sorted[lo] : NULL;
}

/* Everything the header above lists; `after_oom`: the last call failed for memory. */
static int by_start(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static void check(world *w, int after_oom) {
    const gm_native_stats *st = gm_native_stats_of(w->m);
    CHECK(st->peak_reserved >= st->reserved && st->peak_allocated >= st->allocated, "a peak below its value");
    CHECK(st->peak_reserved >= w->last.peak_reserved && st->peak_allocated >= w->last.peak_allocated, "a peak fell");
    CHECK(st->ooms >= w->last.ooms && st->num_alloc_retries >= w->last.num_alloc_retries, "a counter fell");
    CHECK(st->reserved <= w->capacity, "reserved %" PRIu64 " over the limit %" PRIu64, st->reserved, w->capacity);
    w->last = *st;
    /* the walk: after every op while the model holds few blocks, then about every thousandth block's worth */
    if (!after_oom && g_op % (1 + w->n_walked / 1024) != 0) return;
    size_t n = w->n_walked = walk(w);
    uint64_t reserved = 0, allocated = 0, segments = 0, handed_out = 0;
    const live *sorted[MAX_LIVE];
    for (size_t i = 0; i < w->n_live; i++) sorted[i] = &w->lv[i];
    if (w->n_live > 1) qsort(sorted, w->n_live, sizeof sorted[0], live_by_addr);
    for (size_t i = 0; i < n; i++) {
        const gm_native_block *b = &w->blocks[i];
        if (b->addr == b->segment) { /* a segment's first block: the segment's range */
            uint64_t total = 0;
            size_t j = i;
            for (; j < n && w->blocks[j].segment == b->segment; j++) total += w->blocks[j].size;
            if (b->small)
                CHECK(total == 2 * MiB, "a small-pool segment of %" PRIu64 " bytes", total);
            else
                CHECK(total == 20 * MiB || (total >= 10 * MiB && total % (2 * MiB) == 0),
                      "a large-pool segment of %" PRIu64 " bytes", total);
            CHECK(!(after_oom && b->free && j == i + 1), "a wholly free segment left after an out-of-memory failure");
            w->segs[segments][0] = b->segment;
            w->segs[segments++][1] = b->segment + (int64_t)total;
        } else {
            const gm_native_block *p = &w->blocks[i - 1];
            CHECK(i > 0 && p->segment == b->segment && p->addr + (int64_t)p->size == b->addr,
                  "block at %" PRId64 " does not start where the one before it ends", b->addr);
            CHECK(p->stream == b->stream && p->small == b->small, "one segment's blocks on two streams or pools");
            CHECK(!(p->free && b->free), "two free neighbours at %" PRId64 " and %" PRId64, p->addr, b->addr);
        }
        CHECK(b->size > 0 && b->size % 512 == 0, "a block of %" PRIu64 " bytes", b->size);
        reserved += b->size;
        if (!b->free) {
            const live *l = lookup(sorted, w->n_live, b->addr);
            CHECK(l != NULL, "block at %" PRId64 " handed out but not live", b->addr);
            CHECK(l->stream == b->stream, "block at %" PRId64 " on the wrong stream", b->addr);
            CHECK(b->size >= round512(l->size), "block at %" PRId64 " smaller than its request", b->addr);
            CHECK(b->small == (round512(l->size) <= SMALL_MAX), "a request of %" PRIu64 " in the wrong pool", l->size);
            allocated += b->size;
            handed_out++;
        }
    }
    if (segments > 1) qsort(w->segs, (size_t)segments, sizeof w->segs[0], by_start);
    for (uint64_t i = 1; i < segments; i++)
        CHECK(w->segs[i - 1][1] <= w->segs[i][0], "segments at %" PRId64 " and %" PRId64 " overlap", w->segs[i - 1][0],
              w->segs[i][0]);
    CHECK(handed_out == w->n_live, "%" PRIu64 " blocks handed out, %zu live", handed_out, w->n_live);
    CHECK(reserved == st->reserved, "blocks add up to %" PRIu64 ", reserved says %" PRIu64, reserved, st->reserved);
    CHECK(allocated == st->allocated, "handed out %" PRIu64 ", allocated says %" PRIu64, allocated, st->allocated);
    CHECK(segments == st->segments, "%" PRIu64 " segments, the count says %" PRIu64, segments, st->segments);
    CHECK(st->num_device_alloc - st->num_device_free == st->segments, "segments made and given back do not add up");
}

/* ---- the ops ---------------------------------------------------------------------------------- */

static uint64_t request_size(const world *w, rng_t *r) {
    uint64_t size = rnd_size(r);
    if (chance(r, 100000)) size = (size + 2 * MiB - 1) / (2 * MiB) * (2 * MiB); /* a segment's size exactly */
    /* near max_split_size, where blocks turn oversize: 3 MiB under it to 1 MiB over, in steps of 512 B */
    if (w->max_split && rnd_below(r, 8) == 0) size = w->max_split - 3 * MiB + 512 * rnd_below(r, 8192);
    return size;
}

static void op_malloc(world *w, rng_t *r) {
    uint64_t size = request_size(w, r), stream = STREAMS[rnd_below(r, NSTREAMS)];
    uint32_t slot = w->next_slot++;
    live l = {.size = size, .stream = stream, .slot = slot};
    int64_t addr = -1;
    int rc = gm_native_malloc(w->m, size, stream, &addr);
    w->mallocs++;
    trace_push(w, GM_NATIVE_OP_ALLOC | (uint64_t)slot << 32, size, stream);
    int twin = gm_native_malloc(w->twin, size, stream, &l.twin_addr);
    CHECK(twin == GM_NATIVE_OK || twin == GM_NATIVE_OOM, "the second model failed with %d", twin);
    l.in_twin = twin == GM_NATIVE_OK;
    if (!l.in_twin && w->twin_first_oom < 0) w->twin_first_oom = (int64_t)(w->n_events - 1);
    if (rc == GM_NATIVE_OOM) {
        w->ooms++;
        CHECK(gm_native_stats_of(w->m)->ooms == w->last.ooms + 1, "an out-of-memory failure not counted");
        if (l.in_twin) { /* the shadow keeps the twin's block to free it in the trace's order */
            CHECK(gm_native_free(w->twin, l.twin_addr) == GM_NATIVE_OK, "the second model refused a free");
            trace_push(w, 1u | (uint64_t)slot << 32, size, stream);
        }
        check(w, 1);
        return;
    }
    CHECK(rc == GM_NATIVE_OK, "malloc of %" PRIu64 " failed with %d", size, rc);
    CHECK(find_live(w, addr) == NULL, "address %" PRId64 " handed out twice", addr);
    l.addr = addr;
    w->lv[w->n_live++] = l;
    check(w, 0);
}

static void op_free(world *w, rng_t *r) {
    if (w->n_live == 0) return;
    size_t i = (size_t)rnd_below(r, w->n_live);
    live l = w->lv[i];
    w->lv[i] = w->lv[--w->n_live];
    CHECK(gm_native_free(w->m, l.addr) == GM_NATIVE_OK, "free of live block %" PRId64 " refused", l.addr);
    w->frees++;
    w->freed[w->n_freed++ % 64] = l.addr;
    trace_push(w, 1u | (uint64_t)l.slot << 32, l.size, l.stream);
    if (l.in_twin) CHECK(gm_native_free(w->twin, l.twin_addr) == GM_NATIVE_OK, "the second model refused a free");
    check(w, 0);
}

static void op_bad_free(world *w, rng_t *r) {
    int64_t addr;
    if (w->n_freed && rnd_below(r, 2)) {
        addr = w->freed[rnd_below(r, w->n_freed < 64 ? w->n_freed : 64)];
        if (find_live(w, addr) != NULL) return; /* handed out again since */
    } else {
        addr = (int64_t)rnd(r) | 1; /* odd: no block starts there */
    }
    gm_native_stats before = *gm_native_stats_of(w->m);
    CHECK(gm_native_free(w->m, addr) == GM_NATIVE_NOT_HANDED_OUT, "a free of %" PRId64 " not refused", addr);
    CHECK(!memcmp(&before, gm_native_stats_of(w->m), sizeof before), "a refused free changed the model");
    w->bad_frees++;
}

static void op_empty_cache(world *w) {
    uint64_t before = gm_native_stats_of(w->m)->reserved;
    uint64_t released = gm_native_empty_cache(w->m);
    CHECK(released == before - gm_native_stats_of(w->m)->reserved, "empty_cache released %" PRIu64, released);
    w->empties++;
    check(w, 1); /* no wholly free segment is left, as after a failure */
}

/* ---- the run ---------------------------------------------------------------------------------- */

static void replay_matches_twin(world *w) {
    gm_native_replay_result res;
    int rc = gm_native_replay(w->trace, w->n_events, w->capacity, w->max_split, 0, &res);
    CHECK(rc == GM_NATIVE_OK, "the replay failed with %d", rc);
    CHECK(!memcmp(&res.stats, gm_native_stats_of(w->twin), sizeof res.stats), "the replay's statistics differ");
    CHECK(res.first_oom_event == w->twin_first_oom,
          "the replay's first failure at %" PRId64 ", the model's at %" PRId64, res.first_oom_event, w->twin_first_oom);
}

static uint64_t parse_u64(const char *s, const char *what) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (*s == '\0' || *end != '\0' || *s == '-') {
        fprintf(stderr, "fuzz_native: %s must be a whole number, not '%s'\n", what, s);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv) {
    uint64_t ops = 200000, seed = 1;
    int quiet = 0, npos = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quiet")) {
            quiet = 1;
        } else if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            printf("usage: %s [--quiet] [ops=200000] [seed=1]\n", argv[0]);
            return 0;
        } else if (!take_ops_or_seed(argv[i], &npos, &ops, &seed, parse_u64,
                                     (const char *const[]){"the op count", "the seed"})) {
            fprintf(stderr, "fuzz_native: unknown argument '%s' (try --help)\n", argv[i]);
            return 2;
        }
    }
    g_seed = seed;
    rng_t r = {seed};
    world w = {.twin_first_oom = -1};
    w.capacity = rnd_below(&r, 4) ? (64 * MiB) << rnd_below(&r, 7) : GM_NATIVE_UNLIMITED;
    w.max_split = rnd_below(&r, 2) ? (21 + rnd_below(&r, 492)) * MiB : 0;
    if (w.max_split && rnd_below(&r, 2)) w.max_split -= 512 * (1 + rnd_below(&r, 2047)); /* not a whole MiB */
    w.m = gm_native_new(w.capacity, w.max_split);
    w.twin = gm_native_new(w.capacity, w.max_split);
    CHECK(w.m && w.twin, "out of host memory for the models");
    for (g_op = 0; g_op < ops; g_op++) {
        uint64_t dice = rnd_below(&r, 1000);
        if (w.n_live >= MAX_LIVE || (dice < 450 && w.n_live > 0))
            op_free(&w, &r);
        else if (dice < 470)
            op_bad_free(&w, &r);
        else if (dice < 473)
            op_empty_cache(&w);
        else
            op_malloc(&w, &r);
    }
    replay_matches_twin(&w);
    const gm_native_stats *st = gm_native_stats_of(w.m);
    if (!quiet) {
        char limit[32] = "none", split[32] = "none";
        if (w.capacity != GM_NATIVE_UNLIMITED) snprintf(limit, sizeof limit, "%" PRIu64 " MiB", w.capacity / MiB);
        if (w.max_split % MiB)
            snprintf(split, sizeof split, "%" PRIu64 " B", w.max_split);
        else if (w.max_split)
            snprintf(split, sizeof split, "%" PRIu64 " MiB", w.max_split / MiB);
        printf("fuzz_native: OK %" PRIu64 " ops seed %" PRIu64 " limit %s max_split %s: %" PRIu64 " mallocs (%" PRIu64
               " out of memory), %" PRIu64 " frees, %" PRIu64 " bad frees, %" PRIu64 " empty_cache; %" PRIu64
               " segments made, %" PRIu64 " retries, peak reserved %" PRIu64 " MiB; %zu trace events replayed\n",
               ops, seed, limit, split, w.mallocs, w.ooms, w.frees, w.bad_frees, w.empties, st->num_device_alloc,
               st->num_alloc_retries, st->peak_reserved / MiB, w.n_events);
    }
    gm_native_destroy(w.m);
    gm_native_destroy(w.twin);
    free(w.trace);
    free(w.blocks);
    free(w.segs);
    return 0;
}
