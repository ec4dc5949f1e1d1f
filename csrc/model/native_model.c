/*
 * native_model.c -- a model of PyTorch's native CUDA caching allocator, to
 * replay traces on.  The rules it follows (rounding, the small and large
 * pools, best fit, splitting, oversize blocks under max_split_size, merging,
 * and what an out-of-memory releases before it fails) are stated in
 * gpumem/native_model.py's module docstring; this is the engine behind it.
 *
 *   segments, each placed below all earlier ones with a 2 MiB gap:
 *
 *     next_addr                                                     1 << 56
 *       v
 *       [ segment 3 ]  gap  [ blk | blk | free ]  gap  [ free ...... ]  gap
 *                             prev <-> next: the blocks of one segment
 *
 *   pools[2 * s + small]  the free blocks of stream s (by_stream: stream -> s)
 *                         in one pool, sorted by (size, address): the best
 *                         fit is a binary search, the lowest address among
 *                         equal sizes
 *   by_addr               address -> block, for free(addr)
 *
 * Blocks live in one array and name each other by index, so that the array
 * may grow; unused entries form a list through `next`.  Every call that may
 * need host memory gets it before it changes anything, so that a failure
 * (GM_NATIVE_NO_HOST_MEMORY) leaves the model as it was.
 */
#include "native_model.h"

#include <stdlib.h>
#include <string.h>

#define MIB             (1ull << 20)
#define MIN_BLOCK       512ull     /* every block is a multiple of this */
#define SMALL_SIZE      MIB        /* the largest request the small pool serves */
#define SMALL_BUFFER    (2 * MIB)  /* a small-pool segment */
#define LARGE_BUFFER    (20 * MIB) /* a large-pool segment for requests under MIN_LARGE_ALLOC */
#define MIN_LARGE_ALLOC (10 * MIB)
#define ROUND_LARGE     (2 * MIB)          /* larger requests get a segment of their size rounded to this */
#define TOP             (INT64_C(1) << 56) /* segments are placed downwards from here */
#define NONE            UINT32_MAX

typedef struct nm_block {
    int64_t addr;
    uint64_t size;
    uint32_t prev, next; /* neighbours in the segment (NONE at its ends); `next` links unused entries */
    uint32_t pool;
    uint8_t free, used;
} nm_block;

typedef struct nm_entry {
    uint64_t size;
    int64_t addr;
    uint32_t block;
} nm_entry;

typedef struct nm_pool {
    nm_entry *e; /* sorted by (size, addr) */
    size_t n, cap;
    uint64_t stream;
} nm_pool;

/* Open addressing with linear probing: 64-bit keys to indices (NONE: an empty slot). */
typedef struct nm_map {
    uint64_t *keys;
    uint32_t *vals;
    size_t cap, n;
    unsigned bits; /* cap == 1 << bits */
} nm_map;

struct gm_native {
    uint64_t capacity, max_split; /* max_split GM_NATIVE_UNLIMITED: none */
    int64_t next_addr;
    gm_native_stats st;
    nm_block *blocks;
    size_t n_blocks, cap_blocks, n_unused;
    uint32_t unused; /* the first unused entry of blocks, NONE if none */
    nm_pool *pools;  /* 2 * cap_streams, of which 2 * n_streams in use */
    size_t n_streams, cap_streams;
    nm_map by_addr, by_stream;
};

/* ---- sizes ------------------------------------------------------------------------------------ */

/* The block size of a request.  Beyond GM_NATIVE_UNLIMITED: a size that fits no limit. */
static uint64_t round_size(uint64_t size) {
    if (size > GM_NATIVE_UNLIMITED) return GM_NATIVE_UNLIMITED + ROUND_LARGE;
    if (size < MIN_BLOCK) return MIN_BLOCK;
    return (size + MIN_BLOCK - 1) / MIN_BLOCK * MIN_BLOCK;
}

/* The segment asked of the device when no cached block fits a request of `rounded` bytes. */
static uint64_t segment_size(uint64_t rounded) {
    if (rounded <= SMALL_SIZE) return SMALL_BUFFER;
    if (rounded < MIN_LARGE_ALLOC) return LARGE_BUFFER;
    return (rounded + ROUND_LARGE - 1) / ROUND_LARGE * ROUND_LARGE;
}

/* ---- the hash map ----------------------------------------------------------------------------- */

static size_t map_home(const nm_map *h, uint64_t key) {
    return (size_t)((key * UINT64_C(0x9E3779B97F4A7C15)) >> (64 - h->bits));
}

/* The slot that holds `key`, or the empty slot where it would go. */
static size_t map_slot(const nm_map *h, uint64_t key) {
    size_t mask = h->cap - 1, i = map_home(h, key);
    while (h->vals[i] != NONE && h->keys[i] != key) i = (i + 1) & mask;
    return i;
}

static uint32_t map_get(const nm_map *h, uint64_t key) { return h->cap ? h->vals[map_slot(h, key)] : NONE; }

/* Room for `extra` more keys at a load of at most one half.  0, or -1 with the map unchanged. */
static int map_reserve(nm_map *h, size_t extra) {
    if (2 * (h->n + extra) <= h->cap) return 0;
    nm_map g = {.bits = h->bits ? h->bits : 4, .n = h->n};
    while (((size_t)1 << g.bits) < 2 * (h->n + extra)) g.bits++;
    g.cap = (size_t)1 << g.bits;
    g.keys = malloc(g.cap * sizeof *g.keys);
    g.vals = malloc(g.cap * sizeof *g.vals);
    if (g.keys == NULL || g.vals == NULL) {
        free(g.keys);
        free(g.vals);
        return -1;
    }
    memset(g.vals, 0xff, g.cap * sizeof *g.vals);
    for (size_t i = 0; i < h->cap; i++) {
        if (h->vals[i] == NONE) continue;
        size_t j = map_slot(&g, h->keys[i]);
        g.keys[j] = h->keys[i];
        g.vals[j] = h->vals[i];
    }
    free(h->keys);
    free(h->vals);
    *h = g;
    return 0;
}

/* Add a key the map lacks (room reserved). */
static void map_put(nm_map *h, uint64_t key, uint32_t val) {
    size_t i = map_slot(h, key);
    h->keys[i] = key;
    h->vals[i] = val;
    h->n++;
}

/* Remove a key the map holds, shifting back the entries probed past it. */
static void map_del(nm_map *h, uint64_t key) {
    size_t mask = h->cap - 1, i = map_slot(h, key);
    for (size_t j = (i + 1) & mask; h->vals[j] != NONE; j = (j + 1) & mask) {
        /* j's entry may move to i if i lies on its probe path: from its home up to j */
        if (((j - map_home(h, h->keys[j])) & mask) >= ((j - i) & mask)) {
            h->keys[i] = h->keys[j];
            h->vals[i] = h->vals[j];
            i = j;
        }
    }
    h->vals[i] = NONE;
    h->n--;
}

/* ---- pools: free blocks sorted by (size, address) --------------------------------------------- */

static int entry_below(const nm_entry *e, uint64_t size, int64_t addr) {
    return (e->size < size) | ((e->size == size) & (e->addr < addr));
}

/* The index of the first entry not below (size, addr).  Without branches on
 * the comparisons: a pool's order is unpredictable. */
static size_t lower_bound(const nm_pool *p, uint64_t size, int64_t addr) {
    if (p->n == 0) return 0;
    const nm_entry *base = p->e;
    for (size_t n = p->n; n > 1; n -= n / 2)
        if (entry_below(&base[n / 2], size, addr)) base += n / 2; /* everything before base stays below */
    return (size_t)(base - p->e) + (size_t)entry_below(base, size, addr);
}

/* Room for one more entry.  0, or -1 with the pool unchanged. */
static int pool_reserve(nm_pool *p) {
    if (p->n < p->cap) return 0;
    size_t cap = p->cap ? 2 * p->cap : 16;
    nm_entry *e = realloc(p->e, cap * sizeof *e);
    if (e == NULL) return -1;
    p->e = e;
    p->cap = cap;
    return 0;
}

/* Add block bi to its pool (room reserved). */
static void pool_insert(gm_native *m, uint32_t bi) {
    const nm_block *b = &m->blocks[bi];
    nm_pool *p = &m->pools[b->pool];
    size_t i = lower_bound(p, b->size, b->addr);
    memmove(&p->e[i + 1], &p->e[i], (p->n - i) * sizeof *p->e);
    p->e[i] = (nm_entry){.size = b->size, .addr = b->addr, .block = bi};
    p->n++;
}

/* Remove the entries [i, j) of pool p. */
static void pool_cut(nm_pool *p, size_t i, size_t j) {
    memmove(&p->e[i], &p->e[j], (p->n - j) * sizeof *p->e);
    p->n -= j - i;
}

/* Remove free block bi from its pool. */
static void pool_remove(gm_native *m, uint32_t bi) {
    const nm_block *b = &m->blocks[bi];
    nm_pool *p = &m->pools[b->pool];
    size_t i = lower_bound(p, b->size, b->addr);
    pool_cut(p, i, i + 1);
}

/* The pool of (stream, small) in *out, made if new.  0, or -1 with the model unchanged. */
static int pool_of(gm_native *m, uint64_t stream, int small, uint32_t *out) {
    uint32_t s = map_get(&m->by_stream, stream);
    if (s == NONE) {
        if (m->n_streams == m->cap_streams) {
            size_t cap = m->cap_streams ? 2 * m->cap_streams : 4;
            nm_pool *pools = realloc(m->pools, 2 * cap * sizeof *pools);
            if (pools == NULL) return -1;
            memset(&pools[2 * m->cap_streams], 0, 2 * (cap - m->cap_streams) * sizeof *pools);
            m->pools = pools;
            m->cap_streams = cap;
        }
        if (m->n_streams >= NONE / 2 || map_reserve(&m->by_stream, 1) < 0) return -1;
        s = (uint32_t)m->n_streams++;
        map_put(&m->by_stream, stream, s);
        m->pools[2 * s].stream = m->pools[2 * s + 1].stream = stream;
    }
    *out = 2 * s + (small ? 1 : 0);
    return 0;
}

/* ---- blocks ----------------------------------------------------------------------------------- */

/* Room for `extra` more blocks.  0, or -1 with the model unchanged. */
static int blocks_reserve(gm_native *m, size_t extra) {
    if (m->n_unused + (m->cap_blocks - m->n_blocks) >= extra) return 0;
    size_t cap = m->cap_blocks ? 2 * m->cap_blocks : 64;
    if (cap < m->n_blocks + extra) cap = m->n_blocks + extra;
    if (cap > NONE) return -1; /* indices must stay below NONE */
    nm_block *b = realloc(m->blocks, cap * sizeof *b);
    if (b == NULL) return -1;
    m->blocks = b;
    m->cap_blocks = cap;
    return 0;
}

/* A new free block, alone in its segment until linked (room reserved in blocks and by_addr). */
static uint32_t block_new(gm_native *m, int64_t addr, uint64_t size, uint32_t pool) {
    uint32_t bi;
    if (m->unused != NONE) {
        bi = m->unused;
        m->unused = m->blocks[bi].next;
        m->n_unused--;
    } else {
        bi = (uint32_t)m->n_blocks++;
    }
    m->blocks[bi] =
        (nm_block){.addr = addr, .size = size, .prev = NONE, .next = NONE, .pool = pool, .free = 1, .used = 1};
    map_put(&m->by_addr, (uint64_t)addr, bi);
    return bi;
}

static void block_drop(gm_native *m, uint32_t bi) {
    map_del(&m->by_addr, (uint64_t)m->blocks[bi].addr);
    m->blocks[bi].used = 0;
    m->blocks[bi].next = m->unused;
    m->unused = bi;
    m->n_unused++;
}

/* Merge block ri into its left neighbour li; ri is dropped. */
static void block_join(gm_native *m, uint32_t li, uint32_t ri) {
    nm_block *l = &m->blocks[li], *r = &m->blocks[ri];
    l->size += r->size;
    l->next = r->next;
    if (r->next != NONE) m->blocks[r->next].prev = li;
    block_drop(m, ri);
}

/* ---- the device: segments --------------------------------------------------------------------- */

/* A new segment of `size` bytes for pool p, below every earlier one: GM_NATIVE_OK
 * with its one block in *out, or GM_NATIVE_OOM if the limit forbids it. */
static int segment_new(gm_native *m, uint64_t size, uint32_t p, uint32_t *out) {
    if (m->st.reserved + size > m->capacity) return GM_NATIVE_OOM;
    /* size <= capacity <= 2**62: the step fits, and so does the check */
    int64_t step = (int64_t)(size + ROUND_LARGE);
    if (m->next_addr < INT64_MIN + step) return GM_NATIVE_NO_ADDRESSES;
    m->next_addr -= step; /* a gap below the one before: segments never touch */
    *out = block_new(m, m->next_addr, size, p);
    m->st.reserved += size;
    m->st.segments++;
    m->st.num_device_alloc++;
    if (m->st.reserved > m->st.peak_reserved) m->st.peak_reserved = m->st.reserved;
    return GM_NATIVE_OK;
}

/* Give back the segment that free block bi is the whole of (its pool entry is the caller's). */
static void segment_release(gm_native *m, uint32_t bi) {
    m->st.reserved -= m->blocks[bi].size;
    m->st.segments--;
    m->st.num_device_free++;
    block_drop(m, bi);
}

uint64_t gm_native_empty_cache(gm_native *m) {
    uint64_t released = 0;
    for (size_t pi = 0; pi < 2 * m->n_streams; pi++) {
        nm_pool *p = &m->pools[pi];
        size_t kept = 0;
        for (size_t i = 0; i < p->n; i++) {
            const nm_block *b = &m->blocks[p->e[i].block];
            if (b->prev == NONE && b->next == NONE) {
                released += b->size;
                segment_release(m, p->e[i].block);
            } else {
                p->e[kept++] = p->e[i];
            }
        }
        p->n = kept;
    }
    return released;
}

/* With a max_split_size: release a cached oversize block (never split, so a
 * whole segment) large enough for the request, or else oversize ones from the
 * largest down until as many bytes are freed.  0 if that cannot free enough. */
static int release_oversize(gm_native *m, uint32_t pi, uint64_t rounded) {
    if (m->max_split == GM_NATIVE_UNLIMITED) return 0;
    nm_pool *p = &m->pools[pi];
    uint64_t want = rounded > m->max_split ? rounded : m->max_split;
    size_t first = lower_bound(p, want, -1), last = first + 1;
    if (first == p->n) {
        uint64_t total = 0;
        for (last = p->n; total < want && first > 0 && p->e[first - 1].size >= m->max_split; first--)
            total += p->e[first - 1].size;
        if (total < want) return 0;
    }
    for (size_t i = first; i < last; i++) segment_release(m, p->e[i].block);
    pool_cut(p, first, last);
    return 1;
}

/* ---- malloc and free -------------------------------------------------------------------------- */

/* Take the best-fitting cached block of pool pi, if one may serve the request (NONE if not). */
static uint32_t best_fit(gm_native *m, uint32_t pi, uint64_t rounded) {
    nm_pool *p = &m->pools[pi];
    size_t i = lower_bound(p, rounded, -1);
    if (i == p->n) return NONE;
    uint64_t size = p->e[i].size;
    if (rounded < m->max_split && size >= m->max_split) return NONE; /* oversize: not for a smaller request */
    if (rounded >= m->max_split && size >= rounded + LARGE_BUFFER) return NONE; /* nor one 20 MiB smaller */
    uint32_t bi = p->e[i].block;
    pool_cut(p, i, i + 1);
    return bi;
}

/* A new segment for the request, releasing cached memory when the limit is in the way. */
static int grow(gm_native *m, uint32_t pi, uint64_t rounded, uint32_t *out) {
    uint64_t want = segment_size(rounded);
    int rc = segment_new(m, want, pi, out);
    if (rc != GM_NATIVE_OOM) return rc;
    m->st.num_alloc_retries++;
    if (release_oversize(m, pi, rounded)) {
        rc = segment_new(m, want, pi, out);
        if (rc != GM_NATIVE_OOM) return rc;
    }
    gm_native_empty_cache(m);
    rc = segment_new(m, want, pi, out);
    if (rc == GM_NATIVE_OOM) m->st.ooms++;
    return rc;
}

/* Hand out free block bi (out of its pool) for `rounded` bytes, split if what remains may stand alone. */
static void hand_out(gm_native *m, uint32_t bi, uint64_t rounded, int small) {
    nm_block *b = &m->blocks[bi];
    uint64_t remaining = b->size - rounded;
    int split = small ? remaining >= MIN_BLOCK : rounded < m->max_split && remaining > SMALL_SIZE;
    if (split) {
        uint32_t ri = block_new(m, b->addr + (int64_t)rounded, remaining, b->pool); /* room reserved: b stays */
        nm_block *r = &m->blocks[ri];
        r->prev = bi;
        r->next = b->next;
        if (b->next != NONE) m->blocks[b->next].prev = ri;
        b->next = ri;
        b->size = rounded;
        pool_insert(m, ri);
    }
    b->free = 0;
    m->st.allocated += b->size;
    if (m->st.allocated > m->st.peak_allocated) m->st.peak_allocated = m->st.allocated;
}

/* malloc, naming the block handed out by its index. */
static int model_malloc(gm_native *m, uint64_t size, uint64_t stream, uint32_t *out) {
    uint64_t rounded = round_size(size);
    int small = rounded <= SMALL_SIZE;
    uint32_t pi;
    /* what this call may add: a segment's block and a split's rest, and the rest's pool entry */
    if (pool_of(m, stream, small, &pi) < 0 || pool_reserve(&m->pools[pi]) < 0 || blocks_reserve(m, 2) < 0 ||
        map_reserve(&m->by_addr, 2) < 0)
        return GM_NATIVE_NO_HOST_MEMORY;
    uint32_t bi = best_fit(m, pi, rounded);
    if (bi == NONE) {
        int rc = grow(m, pi, rounded, &bi);
        if (rc != GM_NATIVE_OK) return rc;
    }
    hand_out(m, bi, rounded, small);
    *out = bi;
    return GM_NATIVE_OK;
}

/* Free handed-out block bi, merging it with free neighbours. */
static int model_free(gm_native *m, uint32_t bi) {
    if (pool_reserve(&m->pools[m->blocks[bi].pool]) < 0) return GM_NATIVE_NO_HOST_MEMORY;
    m->st.allocated -= m->blocks[bi].size;
    m->blocks[bi].free = 1;
    uint32_t prev = m->blocks[bi].prev;
    if (prev != NONE && m->blocks[prev].free) {
        pool_remove(m, prev);
        block_join(m, prev, bi);
        bi = prev;
    }
    uint32_t next = m->blocks[bi].next;
    if (next != NONE && m->blocks[next].free) {
        pool_remove(m, next);
        block_join(m, bi, next);
    }
    pool_insert(m, bi);
    return GM_NATIVE_OK;
}

int gm_native_malloc(gm_native *m, uint64_t size, uint64_t stream, int64_t *addr) {
    uint32_t bi;
    int rc = model_malloc(m, size, stream, &bi);
    if (rc == GM_NATIVE_OK) *addr = m->blocks[bi].addr;
    return rc;
}

int gm_native_free(gm_native *m, int64_t addr) {
    uint32_t bi = map_get(&m->by_addr, (uint64_t)addr);
    if (bi == NONE || m->blocks[bi].free) return GM_NATIVE_NOT_HANDED_OUT;
    return model_free(m, bi);
}

/* ---- the model -------------------------------------------------------------------------------- */

gm_native *gm_native_new(uint64_t capacity, uint64_t max_split) {
    gm_native *m = calloc(1, sizeof *m);
    if (m == NULL) return NULL;
    m->capacity = capacity < GM_NATIVE_UNLIMITED ? capacity : GM_NATIVE_UNLIMITED;
    m->max_split = max_split && max_split < GM_NATIVE_UNLIMITED ? max_split : GM_NATIVE_UNLIMITED;
    m->next_addr = TOP;
    m->unused = NONE;
    return m;
}

void gm_native_destroy(gm_native *m) {
    if (m == NULL) return;
    for (size_t i = 0; i < 2 * m->cap_streams; i++) free(m->pools[i].e);
    free(m->pools);
    free(m->blocks);
    free(m->by_addr.keys);
    free(m->by_addr.vals);
    free(m->by_stream.keys);
    free(m->by_stream.vals);
    free(m);
}

const gm_native_stats *gm_native_stats_of(const gm_native *m) { return &m->st; }

size_t gm_native_blocks(const gm_native *m, gm_native_block *out, size_t max) {
    size_t n = 0;
    for (size_t s = 0; s < m->n_blocks; s++) {
        if (!m->blocks[s].used || m->blocks[s].prev != NONE) continue; /* from each segment's first block */
        for (uint32_t bi = (uint32_t)s; bi != NONE; bi = m->blocks[bi].next, n++) {
            const nm_block *b = &m->blocks[bi];
            if (n < max)
                out[n] = (gm_native_block){.segment = m->blocks[s].addr,
                                           .addr = b->addr,
                                           .size = b->size,
                                           .stream = m->pools[b->pool].stream,
                                           .small = (int)(b->pool & 1),
                                           .free = b->free};
        }
    }
    return n;
}

/* ---- replay ----------------------------------------------------------------------------------- */

/* Room in the slot table (block index + 1 per slot, 0: nothing) for `slot`.  0, or -1. */
static int slots_reserve(uint32_t **slots, size_t *n, uint32_t slot) {
    if (slot < *n) return 0;
    size_t cap = *n ? 2 * *n : 1024;
    if (cap <= slot) cap = (size_t)slot + 1;
    uint32_t *s = realloc(*slots, cap * sizeof *s);
    if (s == NULL) return -1;
    memset(&s[*n], 0, (cap - *n) * sizeof *s);
    *slots = s;
    *n = cap;
    return 0;
}

/* The events through model m; res->first_oom_event set.  GM_NATIVE_OK or an error. */
static int replay_events(gm_native *m, const uint64_t *w, size_t n_events, int stop_at_oom,
                         gm_native_replay_result *res) {
    uint32_t *slots = NULL;
    size_t n_slots = 0;
    int rc = GM_NATIVE_OK;
    res->first_oom_event = -1;
    for (size_t i = 0; i < n_events && rc == GM_NATIVE_OK; i++, w += 3) {
        uint32_t slot = (uint32_t)(w[0] >> 32), bi;
        if ((uint32_t)w[0] == GM_NATIVE_OP_ALLOC) {
            if (slots_reserve(&slots, &n_slots, slot) < 0) {
                rc = GM_NATIVE_NO_HOST_MEMORY;
                break;
            }
            rc = model_malloc(m, w[1], w[2], &bi);
            if (rc == GM_NATIVE_OK) {
                slots[slot] = bi + 1;
            } else if (rc == GM_NATIVE_OOM) {
                if (res->first_oom_event < 0) res->first_oom_event = (int64_t)i;
                if (stop_at_oom) break;
                rc = GM_NATIVE_OK;
            }
        } else if (slot < n_slots && slots[slot]) {
            bi = slots[slot] - 1;
            slots[slot] = 0;
            rc = model_free(m, bi);
        }
    }
    free(slots);
    return rc == GM_NATIVE_OOM ? GM_NATIVE_OK : rc;
}

int gm_native_replay(const uint64_t *words, size_t n_events, uint64_t capacity, uint64_t max_split, int stop_at_oom,
                     gm_native_replay_result *res) {
    gm_native *m = gm_native_new(capacity, max_split);
    if (m == NULL) return GM_NATIVE_NO_HOST_MEMORY;
    int rc = replay_events(m, words, n_events, stop_at_oom, res);
    res->stats = m->st;
    gm_native_destroy(m);
    return rc;
}
