/*
 * native_model.c -- a model of PyTorch's native CUDA caching allocator, to
 * replay traces on.  The rules it follows (rounding, the small and large
 * pools, best fit, splitting, oversize blocks under max_split_size, merging,
 * and what an out-of-memory releases before it fails) are stated in
 * gpumem/native_model.py's module docstring; this is the engine behind it.
 *
 *   segments, each placed below all earlier ones with a 2 MiB gap (once
 *   that reaches the bottom of the addresses, in the highest gap that fits):
 *
 *     next_addr                                                     1 << 56
 *       v
 *       [ segment 3 ]  gap  [ blk | blk | free ]  gap  [ free ...... ]  gap
 *                             prev <-> next: the blocks of one segment
 *
 *   pools[2 * s + small]  the free blocks of stream s (by_stream: stream -> s)
 *                         in one pool, in order of (size, address)
 *   by_addr               address -> block, for free(addr)
 *
 * A pool keeps its free blocks in size classes ("bins", as in TLSF): bin_of
 * grows with the size, and each power of two is cut into 16 bins, so a bin
 * spans at most 1/16 of its sizes and stays short.  Each bin is an array
 * sorted by (size, address), and a bitmap tells which bins hold any.  The
 * first block not below a request (the best fit, the lowest address among
 * equal sizes) is then a binary search in the request's own bin, or else the
 * first block of the next bin that holds any.  A pool makes only the bins it
 * uses, and a stream whose pools hold no block (nothing handed out, nothing
 * cached) gives its slot up: host memory follows the blocks, not the number
 * of streams ever seen.
 *
 * Blocks live in one array and name each other by index, so that the array
 * may grow; unused entries form a list through `next`.  Every call that may
 * need host memory gets it before it changes anything, so that a failure
 * (GM_NATIVE_NO_HOST_MEMORY) leaves the model as it was.
 */
#include "gpumem/native_model.h"

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

#define SL_BITS 4                                   /* each power of two of sizes in 16 bins */
#define N_BINS  ((64 - 9 - SL_BITS + 1) << SL_BITS) /* bin_of of any 64-bit size is below */
#define N_WORDS ((N_BINS + 63) / 64)

typedef struct nm_bin {
    nm_entry *e; /* sorted by (size, addr) */
    size_t n, cap;
} nm_bin;

/* A pool makes only the bins it uses: `bins` holds them in order of size
 * class, and bit b of `made` says whether class b has one (its place in
 * `bins` is the number of bits of `made` below b).  So a pool that caches a
 * few blocks costs a few bins, not N_BINS (about 20 KiB), whatever the number
 * of streams. */
typedef struct nm_pool {
    nm_bin *bins;
    uint32_t n_bins, cap_bins;
    uint64_t made[N_WORDS];     /* bit b: size class b has a bin in `bins` */
    uint16_t below[N_WORDS];    /* bits of `made` in the words before each */
    uint64_t nonempty[N_WORDS]; /* bit b: that bin holds any */
    uint64_t stream;
    uint32_t n_blocks; /* the blocks (free or handed out) in the pool */
    uint32_t n_free;   /* of which free: the entries of its bins */
    uint32_t next;     /* of pools[2 * s]: the next unused stream slot after s, or NONE */
    uint8_t in_use;    /* of pools[2 * s]: stream slot s is taken */
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
    nm_pool *pools;  /* 2 * cap_streams, of which 2 * n_streams made (some unused) */
    size_t n_streams, cap_streams;
    uint32_t unused_streams; /* the first unused stream slot below n_streams, NONE if none */
    nm_map by_addr, by_stream;
    int addressed; /* by_addr kept: not in a replay, which names blocks by index */
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

/* ---- pools: free blocks in order of (size, address) ------------------------------------------ */

/* The bin of a size: never smaller for a larger size. */
static unsigned bin_of(uint64_t size) {
    uint64_t units = size >> 9;
    if (units < (1u << SL_BITS)) return (unsigned)units;
    unsigned fl = 63u - (unsigned)__builtin_clzll(units);
    unsigned sl = (unsigned)(units >> (fl - SL_BITS)) & ((1u << SL_BITS) - 1);
    return ((fl - SL_BITS + 1) << SL_BITS) | sl;
}

/* The bits set in x (inline: the builds target no CPU with a popcount instruction). */
static inline unsigned bits_in(uint64_t x) {
    x -= (x >> 1) & 0x5555555555555555ull;
    x = (x & 0x3333333333333333ull) + ((x >> 2) & 0x3333333333333333ull);
    x = (x + (x >> 4)) & 0x0f0f0f0f0f0f0f0full;
    return (unsigned)((x * 0x0101010101010101ull) >> 56);
}

/* The bin of size class b in pool p, which has one. */
static inline nm_bin *bin_at(const nm_pool *p, unsigned b) {
    unsigned w = b / 64;
    return &p->bins[p->below[w] + bits_in(p->made[w] & ((1ull << (b % 64)) - 1))];
}

static int bin_made(const nm_pool *p, unsigned b) { return (int)(p->made[b / 64] >> (b % 64) & 1); }

/* The first bin from b up (down, with `down` set) that holds any block, or -1. */
static int bin_next(const nm_pool *p, int b, int down) {
    if (b < 0 || b >= (int)N_BINS) return -1;
    int w = b / 64;
    uint64_t word = p->nonempty[w] & (down ? ~0ull >> (63 - b % 64) : ~0ull << (b % 64));
    while (word == 0) {
        w += down ? -1 : 1;
        if (w < 0 || w >= N_WORDS) return -1;
        word = p->nonempty[w];
    }
    return w * 64 + (down ? 63 - __builtin_clzll(word) : __builtin_ctzll(word));
}

static int entry_below(const nm_entry *e, uint64_t size, int64_t addr) {
    return (e->size < size) | ((e->size == size) & (e->addr < addr));
}

/* The index of bin b's first entry not below (size, addr).  Without branches
 * on the comparisons: the order in a pool is unpredictable. */
static size_t lower_bound(const nm_bin *b, uint64_t size, int64_t addr) {
    if (b->n == 0) return 0;
    const nm_entry *base = b->e;
    for (size_t n = b->n; n > 1; n -= n / 2)
        if (entry_below(&base[n / 2], size, addr)) base += n / 2; /* everything before base stays below */
    return (size_t)(base - b->e) + (size_t)entry_below(base, size, addr);
}

/* The pool's first entry not below (size, addr): 1 with its bin and index, or 0 if none. */
static int pool_find(const nm_pool *p, uint64_t size, int64_t addr, int *bin, size_t *i) {
    *bin = (int)bin_of(size);
    if (bin_made(p, (unsigned)*bin)) {
        const nm_bin *b = bin_at(p, (unsigned)*bin);
        if ((*i = lower_bound(b, size, addr)) < b->n) return 1;
    }
    *bin = bin_next(p, *bin + 1, 0);
    *i = 0;
    return *bin >= 0;
}

/* Room in pool p for one more block of `size` bytes.  0, or -1 with the pool unchanged. */
static int pool_reserve(nm_pool *p, uint64_t size) {
    unsigned c = bin_of(size);
    if (!bin_made(p, c)) { /* a new bin, in its place among the others (empty: the pool is unchanged) */
        if (p->n_bins == p->cap_bins) {
            uint32_t cap = p->cap_bins ? 2 * p->cap_bins : 2;
            nm_bin *bins = realloc(p->bins, cap * sizeof *bins);
            if (bins == NULL) return -1;
            p->bins = bins;
            p->cap_bins = cap;
        }
        p->made[c / 64] |= 1ull << (c % 64);
        for (unsigned w = c / 64 + 1; w < N_WORDS; w++) p->below[w]++;
        nm_bin *at = bin_at(p, c);
        memmove(at + 1, at, (size_t)(p->bins + p->n_bins - at) * sizeof *at);
        *at = (nm_bin){0};
        p->n_bins++;
    }
    nm_bin *b = bin_at(p, c);
    if (b->n < b->cap) return 0;
    size_t cap = b->cap ? 2 * b->cap : 4;
    nm_entry *e = realloc(b->e, cap * sizeof *e);
    if (e == NULL) return -1;
    b->e = e;
    b->cap = cap;
    return 0;
}

/* Add free block bi to its pool (room reserved). */
static void pool_insert(gm_native *m, uint32_t bi) {
    const nm_block *blk = &m->blocks[bi];
    nm_pool *p = &m->pools[blk->pool];
    unsigned bin = bin_of(blk->size);
    nm_bin *b = bin_at(p, bin);
    size_t i = lower_bound(b, blk->size, blk->addr);
    memmove(&b->e[i + 1], &b->e[i], (b->n - i) * sizeof *b->e);
    b->e[i] = (nm_entry){.size = blk->size, .addr = blk->addr, .block = bi};
    b->n++;
    p->n_free++;
    p->nonempty[bin / 64] |= 1ull << (bin % 64);
}

/* Remove the entries [i, j) of bin `bin` of pool p. */
static void pool_cut(nm_pool *p, int bin, size_t i, size_t j) {
    nm_bin *b = bin_at(p, (unsigned)bin);
    memmove(&b->e[i], &b->e[j], (b->n - j) * sizeof *b->e);
    b->n -= j - i;
    p->n_free -= (uint32_t)(j - i);
    if (b->n == 0) p->nonempty[bin / 64] &= ~(1ull << (bin % 64));
}

/* Remove free block bi from its pool. */
static void pool_remove(gm_native *m, uint32_t bi) {
    const nm_block *blk = &m->blocks[bi];
    nm_pool *p = &m->pools[blk->pool];
    int bin = (int)bin_of(blk->size);
    size_t i = lower_bound(bin_at(p, (unsigned)bin), blk->size, blk->addr);
    pool_cut(p, bin, i, i + 1);
}

/* The pool of (stream, small) in *out, made if new (in an unused stream slot
 * if there is one).  0, or -1 with the model unchanged. */
static int pool_of(gm_native *m, uint64_t stream, int small, uint32_t *out) {
    uint32_t s = map_get(&m->by_stream, stream);
    if (s == NONE) {
        if (m->unused_streams == NONE && m->n_streams == m->cap_streams) {
            size_t cap = m->cap_streams ? 2 * m->cap_streams : 4;
            nm_pool *pools = realloc(m->pools, 2 * cap * sizeof *pools);
            if (pools == NULL) return -1;
            memset(&pools[2 * m->cap_streams], 0, 2 * (cap - m->cap_streams) * sizeof *pools);
            m->pools = pools;
            m->cap_streams = cap;
        }
        if (m->n_streams >= NONE / 2 || map_reserve(&m->by_stream, 1) < 0) return -1;
        if (m->unused_streams != NONE) {
            s = m->unused_streams;
            m->unused_streams = m->pools[2 * s].next;
        } else {
            s = (uint32_t)m->n_streams++;
        }
        map_put(&m->by_stream, stream, s);
        m->pools[2 * s].stream = m->pools[2 * s + 1].stream = stream;
        m->pools[2 * s].in_use = 1;
    }
    *out = 2 * s + (small ? 1 : 0);
    return 0;
}

/* Free pool p's bins if it holds no free block. */
static void pool_trim(nm_pool *p) {
    for (int w = 0; w < N_WORDS; w++)
        if (p->nonempty[w]) return;
    for (uint32_t b = 0; b < p->n_bins; b++) free(p->bins[b].e);
    free(p->bins);
    p->bins = NULL;
    p->n_bins = p->cap_bins = 0;
    memset(p->made, 0, sizeof p->made);
    memset(p->below, 0, sizeof p->below);
}

/* Give stream slot s up if its pools hold no block at all (nothing handed
 * out, nothing cached): a model's host memory then follows its blocks, not
 * the number of streams it has seen. */
static void stream_settle(gm_native *m, uint32_t s) {
    nm_pool *p = &m->pools[2 * s];
    if (!p->in_use || p->n_blocks || p[1].n_blocks) return;
    pool_trim(p);
    pool_trim(p + 1);
    map_del(&m->by_stream, p->stream);
    memset(p, 0, 2 * sizeof *p);
    p->next = m->unused_streams;
    m->unused_streams = s;
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
    m->pools[pool].n_blocks++;
    if (m->addressed) map_put(&m->by_addr, (uint64_t)addr, bi);
    return bi;
}

static void block_drop(gm_native *m, uint32_t bi) {
    if (m->addressed) map_del(&m->by_addr, (uint64_t)m->blocks[bi].addr);
    m->pools[m->blocks[bi].pool].n_blocks--;
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

typedef struct nm_span {
    int64_t lo, hi; /* a segment's [lo, hi) */
} nm_span;

static int span_order(const void *a, const void *b) {
    int64_t x = ((const nm_span *)a)->lo, y = ((const nm_span *)b)->lo;
    return (x > y) - (x < y);
}

/* Once placing each segment below the one before has run down to the bottom
 * of the addresses: the top of the highest gap among the segments held (2 MiB
 * clear on each side) that fits `size` bytes, in *addr.  Released segments'
 * addresses are used again so; the segments held, a gap each, take at most
 * 2**63 bytes, which the addresses hold.  GM_NATIVE_OK, or an error. */
static int place_in_gap(const gm_native *m, uint64_t size, int64_t *addr) {
    nm_span *sp = malloc((m->st.segments + 1) * sizeof *sp);
    size_t n = 0;
    if (sp == NULL) return GM_NATIVE_NO_HOST_MEMORY;
    for (size_t s = 0; s < m->n_blocks; s++) {
        if (!m->blocks[s].used || m->blocks[s].prev != NONE) continue;
        uint64_t total = 0;
        for (uint32_t bi = (uint32_t)s; bi != NONE; bi = m->blocks[bi].next) total += m->blocks[bi].size;
        sp[n++] = (nm_span){m->blocks[s].addr, m->blocks[s].addr + (int64_t)total};
    }
    qsort(sp, n, sizeof *sp, span_order);
    int64_t top = TOP;
    int rc = GM_NATIVE_NO_ADDRESSES;
    for (size_t i = n + 1; i-- > 0;) { /* the gap below segment i (below TOP for i == n) */
        int64_t floor = i ? sp[i - 1].hi : INT64_MIN;
        /* top - floor may pass INT64_MAX: compare as unsigned */
        if ((uint64_t)top - (uint64_t)floor >= size + 2 * ROUND_LARGE) {
            *addr = top - (int64_t)(size + ROUND_LARGE);
            rc = GM_NATIVE_OK;
            break;
        }
        if (i) top = sp[i - 1].lo;
    }
    free(sp);
    return rc;
}

/* A new segment of `size` bytes for pool p, below every earlier one (in a
 * gap, once there is no room below): GM_NATIVE_OK with its one block in *out,
 * or GM_NATIVE_OOM if the limit forbids it, or an error. */
static int segment_new(gm_native *m, uint64_t size, uint32_t p, uint32_t *out) {
    if (m->st.reserved + size > m->capacity) return GM_NATIVE_OOM;
    /* size <= capacity <= 2**62: the step fits, and so does the check */
    int64_t step = (int64_t)(size + ROUND_LARGE), addr;
    if (m->next_addr >= INT64_MIN + step) {
        addr = m->next_addr -= step; /* a gap below the one before: segments never touch */
    } else {
        int rc = place_in_gap(m, size, &addr);
        if (rc != GM_NATIVE_OK) return rc;
    }
    *out = block_new(m, addr, size, p);
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

/* Release every wholly free segment; then settle every stream but `keep`'s
 * (NONE: every one), whose pool a malloc under way holds room in. */
static uint64_t empty_cache(gm_native *m, uint32_t keep) {
    uint64_t released = 0;
    for (size_t pi = 0; pi < 2 * m->n_streams; pi++) {
        nm_pool *p = &m->pools[pi];
        if (p->n_free == 0) continue;
        for (int bin = bin_next(p, 0, 0); bin >= 0; bin = bin_next(p, bin + 1, 0)) {
            nm_bin *b = bin_at(p, (unsigned)bin);
            size_t kept = 0;
            for (size_t i = 0; i < b->n; i++) {
                const nm_block *blk = &m->blocks[b->e[i].block];
                if (blk->prev == NONE && blk->next == NONE) {
                    released += blk->size;
                    segment_release(m, b->e[i].block);
                } else {
                    b->e[kept++] = b->e[i];
                }
            }
            pool_cut(p, bin, kept, b->n);
        }
    }
    for (size_t s = 0; s < m->n_streams; s++)
        if (s != keep) stream_settle(m, (uint32_t)s);
    return released;
}

uint64_t gm_native_empty_cache(gm_native *m) { return empty_cache(m, NONE); }

/* Whether block bi is the whole of its segment (only such a block can be released). */
static int whole_segment(const gm_native *m, uint32_t bi) {
    return m->blocks[bi].prev == NONE && m->blocks[bi].next == NONE;
}

/* Release entry i of bin `bin` of pool p, a whole free segment. */
static void release_entry(gm_native *m, nm_pool *p, int bin, size_t i) {
    segment_release(m, bin_at(p, (unsigned)bin)->e[i].block);
    pool_cut(p, bin, i, i + 1);
}

/* With a max_split_size, torch's release_available_cached_blocks: release the
 * first cached block not below the request (and not below max_split_size),
 * or else the oversize blocks below it from the largest down until as many
 * bytes are released.  Only whole free segments are released: a free block
 * that is part of a split segment is passed over, as torch passes over the
 * blocks of expandable segments (with a max_split_size that is not a whole
 * MiB, such a block can be oversize).  1 if enough was released. */
static int release_oversize(gm_native *m, uint32_t pi, uint64_t rounded) {
    if (m->max_split == GM_NATIVE_UNLIMITED) return 0;
    nm_pool *p = &m->pools[pi];
    uint64_t want = rounded > m->max_split ? rounded : m->max_split, total = 0;
    int bin;
    size_t i;
    if (pool_find(p, want, -1, &bin, &i)) {
        if (whole_segment(m, bin_at(p, (unsigned)bin)->e[i].block)) {
            release_entry(m, p, bin, i);
            return 1;
        }
    } else {
        bin = bin_next(p, N_BINS - 1, 1);
        i = bin >= 0 ? bin_at(p, (unsigned)bin)->n : 0;
    }
    while (total < want && bin >= 0) { /* entry i - 1 of `bin` is the next one down */
        if (i == 0) {
            if ((bin = bin_next(p, bin - 1, 1)) >= 0) i = bin_at(p, (unsigned)bin)->n;
            continue;
        }
        const nm_entry e = bin_at(p, (unsigned)bin)->e[--i];
        if (e.size < m->max_split) break;
        if (!whole_segment(m, e.block)) continue;
        total += e.size;
        release_entry(m, p, bin, i);
    }
    return total >= want;
}

/* ---- malloc and free -------------------------------------------------------------------------- */

/* Whether a block of `size` bytes given to a request of `rounded` is split:
 * when what remains may stand alone. */
static int splits(const gm_native *m, int small, uint64_t rounded, uint64_t size) {
    uint64_t remaining = size - rounded;
    return small ? remaining >= MIN_BLOCK : rounded < m->max_split && remaining > SMALL_SIZE;
}

/* The best-fitting cached block of pool p, if one may serve the request: 1
 * with its bin and index, or 0. */
static int best_fit(const gm_native *m, const nm_pool *p, uint64_t rounded, int *bin, size_t *i) {
    if (!pool_find(p, rounded, -1, bin, i)) return 0;
    uint64_t size = bin_at(p, (unsigned)*bin)->e[*i].size;
    if (rounded < m->max_split && size >= m->max_split) return 0;            /* oversize: not for a smaller request */
    if (rounded >= m->max_split && size >= rounded + LARGE_BUFFER) return 0; /* nor one 20 MiB smaller */
    return 1;
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
    empty_cache(m, pi / 2);
    rc = segment_new(m, want, pi, out);
    if (rc == GM_NATIVE_OOM) m->st.ooms++;
    return rc;
}

/* Hand out free block bi (out of its pool) for `rounded` bytes, split if what remains may stand alone. */
static void hand_out(gm_native *m, uint32_t bi, uint64_t rounded, int small) {
    nm_block *b = &m->blocks[bi];
    if (splits(m, small, rounded, b->size)) {
        uint32_t ri = block_new(m, b->addr + (int64_t)rounded, b->size - rounded, b->pool); /* room reserved */
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

/* malloc from pool pi, naming the block handed out by its index. */
static int malloc_in(gm_native *m, uint32_t pi, uint64_t rounded, int small, uint32_t *out) {
    int bin;
    uint32_t bi;
    size_t i;
    /* room first for what this call may add: a segment's block and a split's rest */
    if (blocks_reserve(m, 2) < 0 || (m->addressed && map_reserve(&m->by_addr, 2) < 0)) return GM_NATIVE_NO_HOST_MEMORY;
    nm_pool *p = &m->pools[pi];
    int cached = best_fit(m, p, rounded, &bin, &i);
    uint64_t got = cached ? bin_at(p, (unsigned)bin)->e[i].size : segment_size(rounded); /* the block it will get */
    if (splits(m, small, rounded, got) && pool_reserve(p, got - rounded) < 0) return GM_NATIVE_NO_HOST_MEMORY;
    if (cached) {
        bi = bin_at(p, (unsigned)bin)->e[i].block;
        pool_cut(p, bin, i, i + 1);
    } else {
        int rc = grow(m, pi, rounded, &bi);
        if (rc != GM_NATIVE_OK) return rc;
    }
    hand_out(m, bi, rounded, small);
    *out = bi;
    return GM_NATIVE_OK;
}

/* malloc, naming the block handed out by its index.  A stream that is new
 * and gets nothing is given up again at once. */
static int model_malloc(gm_native *m, uint64_t size, uint64_t stream, uint32_t *out) {
    uint64_t rounded = round_size(size);
    int small = rounded <= SMALL_SIZE;
    uint32_t pi;
    if (pool_of(m, stream, small, &pi) < 0) return GM_NATIVE_NO_HOST_MEMORY;
    int rc = malloc_in(m, pi, rounded, small, out);
    if (rc != GM_NATIVE_OK && m->pools[pi & ~1u].n_blocks + m->pools[pi | 1u].n_blocks == 0) stream_settle(m, pi / 2);
    return rc;
}

/* Free handed-out block bi, merging it with free neighbours. */
static int model_free(gm_native *m, uint32_t bi) {
    const nm_block *b = &m->blocks[bi];
    uint32_t prev = b->prev, next = b->next;
    int join_prev = prev != NONE && m->blocks[prev].free, join_next = next != NONE && m->blocks[next].free;
    uint64_t merged = b->size + (join_prev ? m->blocks[prev].size : 0) + (join_next ? m->blocks[next].size : 0);
    if (pool_reserve(&m->pools[b->pool], merged) < 0) return GM_NATIVE_NO_HOST_MEMORY;
    m->st.allocated -= b->size;
    m->blocks[bi].free = 1;
    if (join_prev) {
        pool_remove(m, prev);
        block_join(m, prev, bi);
        bi = prev;
    }
    if (join_next) {
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

static gm_native *model_new(uint64_t capacity, uint64_t max_split, int addressed) {
    gm_native *m = calloc(1, sizeof *m);
    if (m == NULL) return NULL;
    m->addressed = addressed;
    m->capacity = capacity < GM_NATIVE_UNLIMITED ? capacity : GM_NATIVE_UNLIMITED;
    m->max_split = max_split && max_split < GM_NATIVE_UNLIMITED ? max_split : GM_NATIVE_UNLIMITED;
    m->next_addr = TOP;
    m->unused = NONE;
    m->unused_streams = NONE;
    return m;
}

gm_native *gm_native_new(uint64_t capacity, uint64_t max_split) { return model_new(capacity, max_split, 1); }

void gm_native_destroy(gm_native *m) {
    if (m == NULL) return;
    for (size_t i = 0; i < 2 * m->n_streams; i++) {
        for (size_t b = 0; b < m->pools[i].n_bins; b++) free(m->pools[i].bins[b].e);
        free(m->pools[i].bins);
    }
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

/* Room in the slot table (block index + 1 per slot, 0: nothing) for `slot`.
 * Grown into fresh zeroed memory rather than by realloc and memset: a slot
 * far beyond the others then touches only the pages it uses.  0, or -1. */
static int slots_reserve(uint32_t **slots, size_t *n, uint32_t slot) {
    if (slot < *n) return 0;
    size_t cap = *n ? 2 * *n : 1024;
    if (cap <= slot) cap = (size_t)slot + 1;
    uint32_t *s = calloc(cap, sizeof *s);
    if (s == NULL) return -1;
    if (*n) memcpy(s, *slots, *n * sizeof *s);
    free(*slots);
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
    gm_native *m = model_new(capacity, max_split, 0);
    if (m == NULL) return GM_NATIVE_NO_HOST_MEMORY;
    int rc = replay_events(m, words, n_events, stop_at_oom, res);
    res->stats = m->st;
    gm_native_destroy(m);
    return rc;
}
