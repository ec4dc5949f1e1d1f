/*
 * split.c -- chunks split under pressure: a chunk of several pages goes back
 * to the device only whole, so once blocks that outlive its other pages sit
 * on part of it, its free pages are locked (page.c, h_chunk_locked).  A
 * split frees them: after the slow path's device wait, the pages of the
 * chunk that something keeps are copied to single pages, the chunk is
 * unmapped and released, and the singles take the kept pages' places behind
 * the same addresses; the free pages stay unmapped, for the request
 * (heap.c, PHYSICAL PAGES AND CHUNKS).  It costs a single page and a
 * page-sized copy per kept page, all copies behind one device wait, and it
 * runs only where defragmentation found too few movable pages, and only with
 * gm_config.split_chunks: it moves live data, which a kernel another thread
 * launched meanwhile would write to the old page.
 *
 *   chunk H at pages [c, c+4)     | kept | free | free | kept |
 *   singles s1, s2 (scratch)      copies of the kept pages
 *   after                         |  s1  |  --  |  --  |  s2  |  H released
 *
 * Calls: page.c (the page tables, releasing, cutting free blocks),
 * spill.c (the scratch range, the copy wait, mapping a chunk back), the
 * device.
 */
#include <stdint.h>
#include <stdlib.h>

#include "gpumem/array.h"
#include "heap_internal.h"

/* Wholly free pages of general free block b, in the device chunk of several
 * pages whose first page is c: [p0, p1). */
typedef struct free_run {
    gm_block *b;
    size_t c, p0, p1;
} free_run;

/* A chunk that can be split: its first page, its length, its free pages and
 * where its runs start in the run list. */
typedef struct candidate {
    size_t c, k, free, run0, n_runs;
} candidate;

/* Whether page p lies in a device chunk of several pages that a split may
 * take a page of. */
static inline int splittable(const gm_heap *h, size_t p) {
    return h->page_handle[p] && h->chunk_len[p] > 1 && !h->host[p] && !h->parked[p];
}

/* The wholly free pages of general free blocks that lie in splittable
 * chunks, as runs in address order (one chunk and one block each).  NULL
 * when there are none (or on host OOM). */
static free_run *free_runs(gm_heap *h, size_t *n) {
    free_run *runs = NULL;
    size_t cap = 0;
    *n = 0;
    for (gm_block *b = h->head; b; b = b->next) {
        if (b->state != GM_BLOCK_FREE || b->pool) continue;
        size_t p1 = h_page_floor(h, b->addr + b->size);
        for (size_t p = h_page_ceil(h, b->addr); p < p1;) {
            if (!splittable(h, p)) {
                p++;
                continue;
            }
            size_t c = h_chunk_first(h, p), z = h_chunk_end(h, p) < p1 ? h_chunk_end(h, p) : p1;
            if (*n == cap) {
                free_run *a = gm_array_grow(runs, &cap, 64, sizeof *a);
                if (!a) return runs;
                runs = a;
            }
            runs[(*n)++] = (free_run){b, c, p, z};
            p = z;
        }
    }
    return runs;
}

static int cmp_most_free(const void *x, const void *y) {
    const candidate *a = x, *b = y;
    if (a->free != b->free) return a->free < b->free ? 1 : -1;
    return a->c < b->c ? -1 : 1;
}

/* Whether a living pool keeps memory in the chunk at c (k pages), from
 * block b, which lies in it: a living pool's pages never move. */
static int pinned_chunk(const gm_heap *h, gm_block *b, size_t c, size_t k) {
    uintptr_t end = h_page_addr(h, c + k);
    for (b = h_block_holding(b, h_page_addr(h, c)); b && b->addr < end; b = b->next)
        if (b->state != GM_BLOCK_UNMAPPED && h_pinned(b)) return 1;
    return 0;
}

/* The chunks the runs fall in that no living pool keeps memory in, the most
 * free pages first. */
static candidate *candidates(const gm_heap *h, const free_run *r, size_t n_runs, size_t *n) {
    candidate *v = malloc((n_runs ? n_runs : 1) * sizeof *v);
    *n = 0;
    if (!v) return NULL;
    for (size_t i = 0, j; i < n_runs; i = j) {
        candidate c = {r[i].c, h->chunk_len[r[i].c], 0, i, 0};
        for (j = i; j < n_runs && r[j].c == c.c; j++) {
            c.free += r[j].p1 - r[j].p0;
            c.n_runs++;
        }
        if (!pinned_chunk(h, r[i].b, c.c, c.k)) v[(*n)++] = c;
    }
    qsort(v, *n, sizeof *v, cmp_most_free);
    return v;
}

/* Whether page p of candidate c is free (in one of its runs). */
static int is_free(const free_run *r, const candidate *c, size_t p) {
    for (size_t i = c->run0; i < c->run0 + c->n_runs; i++)
        if (p >= r[i].p0 && p < r[i].p1) return 1;
    return 0;
}

/* Map singles[0..n) at pages kept[0..n), granting access; on failure, unmap
 * the ones mapped.  GM_OK, or the device's error. */
static int singles_in_place(gm_heap *h, const size_t *kept, const gm_handle *singles, size_t n) {
    const gm_device_ops *ops = h->dev->ops;
    size_t i = 0;
    int rc = GM_OK;
    for (; i < n; i++) {
        uintptr_t va = h_page_addr(h, kept[i]);
        if ((rc = ops->map(h->dev, va, 1, singles[i]))) break;
        if ((rc = ops->set_access(h->dev, va, h->page))) {
            i++;
            break;
        }
    }
    if (rc == GM_OK) return GM_OK;
    h->st.num_device_errors++;
    while (i-- > 0) h_unmap_retry(h, h_page_addr(h, kept[i]), 1);
    return rc;
}

/* The chunk at c (k pages) is gone from behind its addresses and singles[i]
 * is mapped at kept[i]: the page tables and the counts follow. */
static void split_done(gm_heap *h, size_t c, size_t k, const size_t *kept, const gm_handle *singles, size_t n) {
    h_chunk_clear(h, c, k);
    h->multi_chunks--;
    for (size_t i = 0; i < n; i++) h_chunk_set(h, kept[i], 1, singles[i], 0);
    h->st.num_maps += (int64_t)n;
    h->st.num_unmaps++;
    h->st.num_chunk_splits++;
}

/* Copy the kept pages of the chunk at c (k pages, handle hd) into singles
 * mapped in the scratch range, with one device wait, then put the singles in
 * their places and release the chunk.  GM_OK; GM_EDEVICE when nothing
 * changed (the singles are the caller's again); GM_ECORRUPT when the chunk
 * could not be mapped again after a failure. */
static int split_one(gm_heap *h, size_t c, size_t k, const size_t *kept, const gm_handle *singles, size_t n) {
    const gm_device_ops *ops = h->dev->ops;
    gm_handle hd = h->page_handle[c];
    uintptr_t sc = 0;
    size_t mapped = 0;
    int rc = n ? h_scratch_get(h, n, &sc) : GM_OK;
    for (; rc == GM_OK && mapped < n; mapped++)
        if ((rc = ops->map(h->dev, sc + mapped * h->page, 1, singles[mapped]))) {
            h->st.num_device_errors++;
            break;
        }
    if (rc == GM_OK && n && (rc = ops->set_access(h->dev, sc, n * h->page))) h->st.num_device_errors++;
    for (size_t i = 0; rc == GM_OK && i < n; i++)
        if ((rc = ops->copy_dtod(h->dev, sc + i * h->page, h_page_addr(h, kept[i]), h->page)))
            h->st.num_device_errors++;
    if (n && h_copies_wait(h)) return GM_ECORRUPT; /* a copy may still run: nothing may be unmapped */
    for (size_t i = 0; i < mapped; i++)
        if (h_unmap_retry(h, sc + i * h->page, 1)) return GM_ECORRUPT;
    if (rc) return GM_EDEVICE;
    uintptr_t va = h_page_addr(h, c);
    if (ops->unmap(h->dev, va, k * h->page)) {
        h->st.num_device_errors++;
        return GM_EDEVICE;
    }
    if (singles_in_place(h, kept, singles, n) == GM_OK) {
        split_done(h, c, k, kept, singles, n);
        h_release_chunk(h, hd, k);
        return GM_OK;
    }
    return h_map_back(h, c, k, hd);
}

/* The n singles taken for a split that did not happen: the last
 * `from_spares` were spares and are again; the others were made for it and
 * go back to the device (a page promised to the caller may have served). */
static void give_back(gm_heap *h, const gm_handle *singles, size_t n, size_t from_spares) {
    for (size_t i = n; i-- > n - from_spares;) h_spare_push(h, singles[i]);
    for (size_t i = 0; i < n - from_spares; i++) h_release_chunk(h, singles[i], 1);
}

/* Single pages for n kept pages: new ones first, under the cap (the caller
 * may count on the spares; pages it was promised may serve for the moment,
 * as the split gives back at least as many), then spares.  Returns how many
 * came from the spares, or SIZE_MAX when there were not n (those taken are
 * given back). */
static size_t take_singles(gm_heap *h, gm_handle *out, size_t n) {
    size_t made = 0, i = 0;
    while (made < n && h_held_pages(h) + made < h->cap_pages && h_create_chunk(h, 1, &out[made], NULL) == GM_OK) made++;
    for (i = made; i < n && h->n_spare; i++) out[i] = h_spare_pop(h);
    if (i == n) return n - made;
    give_back(h, out, i, i - made);
    return SIZE_MAX;
}

static int cmp_run_desc(const void *x, const void *y) {
    const free_run *a = x, *b = y;
    return a->p0 < b->p0 ? 1 : -1;
}

size_t h_split_chunks(gm_heap *h, size_t want, int *rc) {
    size_t n_runs = 0, n_cand = 0, gained = 0, n_cut = 0;
    if (!h->split || !h->multi_chunks || h->no_sync || !h->dev->ops->copy_dtod) return 0;
    free_run *runs = free_runs(h, &n_runs);
    candidate *cand = runs ? candidates(h, runs, n_runs, &n_cand) : NULL;
    free_run *cut = malloc((n_runs ? n_runs : 1) * sizeof *cut);
    size_t most = 1; /* the longest chunk: policy growth and a resume make them longer than chunk_pages */
    for (size_t i = 0; i < n_cand; i++)
        if (cand[i].k > most) most = cand[i].k;
    size_t *kept = malloc(most * sizeof *kept);
    gm_handle *singles = malloc(most * sizeof *singles);
    /* Each cut block may need two more records. */
    if (!cand || !cut || !kept || !singles || h_slab_reserve(h, 2 * n_runs + 2)) n_cand = 0;
    for (size_t i = 0; i < n_cand && gained < want; i++) {
        const candidate *c = &cand[i];
        size_t n = 0;
        for (size_t p = c->c; p < c->c + c->k; p++)
            if (!is_free(runs, c, p)) kept[n++] = p;
        size_t from_spares = take_singles(h, singles, n);
        if (from_spares == SIZE_MAX) continue; /* no page to copy into: one with fewer kept pages may fit */
        size_t loose = h->n_loose;
        int e = split_one(h, c->c, c->k, kept, singles, n);
        if (e) {
            if (e != GM_ECORRUPT) give_back(h, singles, n, from_spares);
            *rc = e;
            break;
        }
        for (size_t j = c->run0; j < c->run0 + c->n_runs; j++) cut[n_cut++] = runs[j];
        gained += c->free;
        /* The spares the copies took, and the free pages, as single spares --
         * if the chunk went back (else it waits in h->loose, held). */
        if (h->n_loose == loose) h_grow(h, from_spares + c->free, h->cap_pages, NULL, NULL);
    }
    /* The free runs become unmapped space, the highest first: cutting a block
     * keeps its record as the lower part, so the runs below stay valid. */
    if (n_cut) qsort(cut, n_cut, sizeof *cut, cmp_run_desc);
    for (size_t j = 0; j < n_cut; j++) h_cut_unmapped(h, cut[j].b, cut[j].p0, cut[j].p1, 0);
    free(kept);
    free(singles);
    free(cut);
    free(cand);
    free(runs);
    return gained;
}

size_t h_split_gain(gm_heap *h, size_t room) {
    size_t n_runs = 0, n_cand = 0, gain = 0;
    if (!h->split || !h->multi_chunks || !h->dev->ops->copy_dtod) return 0;
    free_run *runs = free_runs(h, &n_runs);
    candidate *cand = runs ? candidates(h, runs, n_runs, &n_cand) : NULL;
    /* As h_split_chunks goes: each split takes a page per kept page and
     * leaves its free ones besides. */
    for (size_t i = 0; i < n_cand; i++)
        if (cand[i].k - cand[i].free <= room) {
            room += cand[i].free;
            gain += cand[i].free;
        }
    free(cand);
    free(runs);
    return gain;
}
