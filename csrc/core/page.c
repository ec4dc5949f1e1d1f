/*
 * page.c -- physical pages and chunks: creating, mapping and releasing
 * device allocations, spares, and giving pages back (unmapping wholly free
 * pages, recycling them for defragmentation); the counts of cached pages
 * the slow path and the reports use (heap.c, PHYSICAL PAGES AND CHUNKS).
 *
 * Calls: block.c (splitting and merging what is unmapped), the device.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpumem/array.h"
#include "heap_internal.h"

/* ---- physical pages -------------------------------------------------------------- */

static void count_held(gm_heap *h, int64_t pages) {
    h_stat_pool_add(h->st.segment, GM_SMALL_SIZE + 1, pages);
    h_stat_pool_add(h->st.reserved_bytes, GM_SMALL_SIZE + 1, pages * (int64_t)h->page);
}

/* One new physical allocation of k pages, counted held.  *dev_err (if given)
 * keeps a failure other than the device's GM_ENOMEM for the report. */
int h_create_chunk(gm_heap *h, size_t k, gm_handle *hd, int *dev_err) {
    int rc = h->dev->ops->create(h->dev, k, hd);
    if (rc) {
        if (rc != GM_ENOMEM) {
            h->st.num_device_errors++;
            if (dev_err) *dev_err = rc;
        }
        return rc;
    }
    count_held(h, (int64_t)k);
    h->st.num_device_alloc++;
    return GM_OK;
}

/* Give an unmapped chunk of k pages back to the device.  One whose release
 * fails, or may not be released now (during a capture), stays held: a single
 * page as a spare, a larger chunk in h->loose, for release_spares. */
void h_release_chunk(gm_heap *h, gm_handle hd, size_t k) {
    if (h->no_sync || h->dev->ops->release(h->dev, hd)) {
        h->st.num_device_errors += !h->no_sync;
        if (k == 1) {
            h_spare_push(h, hd);
            return;
        }
        h->loose[h->n_loose++] = (struct gm_loose){hd, k};
        h->loose_pages += k;
        return;
    }
    count_held(h, -(int64_t)k);
    h->st.num_device_free++;
}

/* The chunk hd of k pages is mapped at pages [p0, p0+k) now / no longer: a
 * device chunk counts in mapped_pages, a host one (spill.c) in host_pages and
 * the spilled bytes. */
void h_chunk_set(gm_heap *h, size_t p0, size_t k, gm_handle hd, int host) {
    h_assert(hd && k > 0 && p0 + k <= h->n_pages);
    for (size_t i = 0; i < k; i++) {
        h_assert(!h->page_handle[p0 + i] && !h->host[p0 + i]);
        h->page_handle[p0 + i] = hd;
        h->chunk_off[p0 + i] = (uint32_t)i;
        h->chunk_len[p0 + i] = (uint32_t)k;
    }
    if (!host) {
        h->mapped_pages += k;
        return;
    }
    memset(h->host + p0, 1, k);
    h->host_pages += k;
    h->host_kept_stale = 1;
    h_stat_pool_add(h->st.spilled_bytes, GM_SMALL_SIZE + 1, (int64_t)(k * h->page));
}
void h_chunk_clear(gm_heap *h, size_t p0, size_t k) {
    h_assert(!h->chunk_off[p0] && h->chunk_len[p0] == k);
    if (h->host[p0]) {
        h_assert(h->host_pages >= k);
        memset(h->host + p0, 0, k);
        h->host_pages -= k;
        h->host_kept_stale = 1;
        h_stat_pool_add(h->st.spilled_bytes, GM_SMALL_SIZE + 1, -(int64_t)(k * h->page));
    } else {
        h_assert(h->mapped_pages >= k);
        h->mapped_pages -= k;
    }
    memset(h->page_handle + p0, 0, k * sizeof *h->page_handle);
    memset(h->chunk_off + p0, 0, k * sizeof *h->chunk_off);
    memset(h->chunk_len + p0, 0, k * sizeof *h->chunk_len);
}

/* An unmapped device chunk of k pages: a single page becomes a spare, a larger
 * chunk goes back to the device (h_release_chunk). */
void h_chunk_unused(gm_heap *h, gm_handle hd, size_t k) {
    if (k == 1)
        h_spare_push(h, hd);
    else
        h_release_chunk(h, hd, k);
}

/* Unmap the chunk whose first page is p, with one call.  A single page
 * becomes a spare; a larger chunk goes back to the device, and with
 * `restock` as many single spares are created to stand in for it (fewer if
 * the device refuses): defragmentation promised its caller spares. */
int h_unmap_chunk(gm_heap *h, size_t p, int restock) {
    size_t k = h->chunk_len[p];
    gm_handle hd = h->page_handle[p];
    int rc = h->dev->ops->unmap(h->dev, h_page_addr(h, p), k * h->page);
    if (rc) {
        h->st.num_device_errors++;
        return rc;
    }
    int host = h->host[p];
    h_chunk_clear(h, p, k);
    h->st.num_unmaps++;
    h->multi_chunks -= k > 1;
    if (host) {
        h_host_release(h, hd, k); /* never a spare: the device's pages are spares */
        return GM_OK;
    }
    if (k == 1) {
        h_spare_push(h, hd);
        return GM_OK;
    }
    size_t loose = h->n_loose;
    h_release_chunk(h, hd, k);
    /* Only for memory given back, and as many pages as it was: what the heap
     * holds does not change, so no cap is checked (one lowered since may be
     * below it, and the caller counts on these pages). */
    for (size_t i = 0; restock && h->n_loose == loose && i < k; i++) {
        gm_handle one;
        if (h_create_chunk(h, 1, &one, NULL)) break;
        h_spare_push(h, one);
    }
    return GM_OK;
}

/* Trim the page range [*p0, *p1), all mapped, inward to whole chunks. */
static void whole_chunks(const gm_heap *h, size_t *p0, size_t *p1) {
    if (*p0 < *p1 && h->chunk_off[*p0]) *p0 = h_chunk_end(h, *p0);
    if (*p0 < *p1 && h_chunk_end(h, *p1 - 1) > *p1) *p1 = h_chunk_first(h, *p1 - 1);
    if (*p1 < *p0) *p1 = *p0;
}

/* Growth: let the heap create up to `want` more pages while it holds (with
 * *grant, the pages already promised) fewer than `limit`.  With chunks
 * (grant not NULL), the pages are promised (*grant) and made where they are
 * mapped (map_fresh), as few allocations as the placement's unmapped runs
 * allow; else single spares are created now, stopping at the first refusal.
 * *dev_err keeps a non-OOM failure for the report. */
void h_grow(gm_heap *h, size_t want, size_t limit, size_t *grant, int *dev_err) {
    size_t promised = grant ? *grant : 0;
    if (grant) {
        size_t held = h_held_pages(h) + promised, room = limit > held ? limit - held : 0;
        *grant += want < room ? want : room;
        return;
    }
    for (size_t made = 0; made < want && h_held_pages(h) + promised < limit; made++) {
        gm_handle hd;
        if (h_create_chunk(h, 1, &hd, dev_err)) break;
        h_spare_push(h, hd);
    }
}

/* Map pages [p0, p1), all unmapped: spare pages first, then, while *grant
 * allows, new chunks of up to `most` pages (a chunk the device refuses for
 * lack of memory falls back to single pages).  No access is granted.
 * Returns the end of what got mapped (whole chunks); *err the failure that
 * stopped it (GM_ENOMEM: the device had nothing left to give). */
size_t h_map_fresh(gm_heap *h, size_t p0, size_t p1, size_t most, size_t *grant, int *err) {
    size_t p = p0, none = 0;
    if (!grant) grant = &none;
    while (p < p1) {
        size_t k = 1;
        gm_handle hd;
        int rc, spare = h->n_spare > 0;
        if (h->parked[p]) {
            snprintf(h->dev->last_error, sizeof h->dev->last_error,
                     "the page at %#lx is still mapped: access to it could not be granted during a capture, and it "
                     "is unmapped once no capture is on",
                     (unsigned long)h_page_addr(h, p));
            *err = GM_EDEVICE;
            break;
        }
        if (spare) {
            hd = h->spare[h->n_spare - 1];
        } else if (!*grant) {
            *err = GM_ENOMEM;
            break;
        } else {
            k = p1 - p < most ? p1 - p : most;
            if (k > *grant) k = *grant;
            rc = h_create_chunk(h, k, &hd, NULL);
            if (rc == GM_ENOMEM && k > 1) {
                most = k = 1; /* near the device's end: single pages, as many as there are */
                rc = h_create_chunk(h, 1, &hd, NULL);
            }
            if (rc) {
                *err = rc;
                break;
            }
            *grant -= k;
        }
        if ((rc = h->dev->ops->map(h->dev, h_page_addr(h, p), k, hd))) {
            h->st.num_device_errors++;
            *err = rc;
            if (spare) break; /* it stays a spare */
            if (k == 1)
                h_spare_push(h, hd);
            else
                h_release_chunk(h, hd, k);
            break;
        }
        if (spare) h->n_spare--;
        h_chunk_set(h, p, k, hd, 0);
        h->multi_chunks += k > 1;
        h->st.num_maps++;
        p += k;
    }
    return p;
}

/* map_fresh for growth with room (POLICY): pages [p0, p1) of a range whose
 * pages are [r0, r1).  The range's first and last pages, which neighbouring
 * blocks may share, come as single pages; only pages wholly inside the range
 * come as chunks of up to `most`, so that a chunk goes back whole once the
 * block over it is freed. */
size_t h_map_interior(gm_heap *h, size_t p0, size_t p1, size_t r0, size_t r1, size_t most, size_t *grant, int *err) {
    size_t a = p0 == r0 && p0 < p1 ? p0 + 1 : p0, z = p1 == r1 && p1 > a ? p1 - 1 : p1;
    size_t p = h_map_fresh(h, p0, a, 1, grant, err);
    if (p == a) p = h_map_fresh(h, a, z, most, grant, err);
    if (p == z) p = h_map_fresh(h, z, p1, 1, grant, err);
    return p;
}

/* Release spare pages (and chunks whose release failed before) until the heap
 * holds at most `target` (not during a capture: a release would invalidate
 * it; the spares wait for later). */
int h_release_spares(gm_heap *h, size_t target) {
    if (h->no_sync) return GM_OK;
    while (h->n_loose && h_held_pages(h) > target) {
        struct gm_loose c = h->loose[h->n_loose - 1];
        if (h->dev->ops->release(h->dev, c.handle)) {
            h->st.num_device_errors++;
            return GM_EDEVICE;
        }
        h->n_loose--;
        h->loose_pages -= c.pages;
        count_held(h, -(int64_t)c.pages);
        h->st.num_device_free++;
    }
    while (h->n_spare && h_held_pages(h) > target) {
        gm_handle hd = h->spare[h->n_spare - 1];
        int rc = h->dev->ops->release(h->dev, hd);
        if (rc) {
            h->st.num_device_errors++;
            return rc;
        }
        h->n_spare--;
        count_held(h, -1);
        h->st.num_device_free++;
    }
    return GM_OK;
}

int h_unmap_pages(gm_heap *h, gm_block *b, size_t p0, size_t p1, int restock) {
    size_t done = p0;
    int rc = GM_OK, host = h->host[p0]; /* host pages were never the heap's reserved memory */
    if (h->no_sync) return GM_EDEVICE;
    while (done < p1) {
        size_t next = h_chunk_end(h, done);
        if ((rc = h_unmap_chunk(h, done, restock))) break;
        done = next;
    }
    if (done > p0) h_cut_unmapped(h, b, p0, done, host);
    return rc;
}

/* The free block b lost its pages [p0, p1), now unmapped: cut it into
 * [free][unmapped][free] (its record stays the lower part) and record the
 * unmap. */
void h_cut_unmapped(gm_heap *h, gm_block *b, size_t p0, size_t p1, int host) {
    uintptr_t lo = h_page_addr(h, p0), hi = h_page_addr(h, p1);
    h_assert(b->state == GM_BLOCK_FREE && b->addr <= lo && hi <= b->addr + b->size);
    h_run_detach(h, b);
    h_index_remove(h, b);
    gm_block *mid = b;
    if (lo > b->addr) {
        mid = h_split(h, b, lo - b->addr);
        h_index_insert(h, b);
    }
    if (mid->addr + mid->size > hi) h_index_insert(h, h_split(h, mid, hi - mid->addr));
    h_hist(h, host ? GM_H_UNSPILL : GM_H_UNMAP, lo, hi - lo, ANY, 0);
    h_run_attach(h, h_make_unmapped(h, mid));
}

struct cached_run {
    gm_block *b;
    size_t p0, p1;
};

/* Blocks in recycling order: the smallest first and, among equal sizes, the
 * highest address first.  One cursor per index of the general heap walks it
 * in index order (sizes ascending, addresses ascending among equals, see
 * freeindex.h); the blocks of the next size from every cursor are gathered
 * and reversed by address.  Only blocks of at least a page can hold a whole
 * one, so the walk starts at the bin of a page, and it stops where the caller
 * has what it wants: it costs the blocks it hands out (and the rest of their
 * size), not every free block. */
struct recycle_order {
    const gm_freeindex **idx;
    gm_block **cur; /* per index: the next block in index order, NULL at the end */
    size_t n_idx;
    gm_block **same; /* the blocks of the current size, highest address first */
    size_t n_same, cap_same, next;
};

static int cmp_addr_desc(const void *x, const void *y) {
    const gm_block *a = *(gm_block *const *)x, *b = *(gm_block *const *)y;
    return a->addr < b->addr ? 1 : -1;
}

/* The next block in recycling order, NULL at the end (or on host OOM: the
 * caller then recycles what it has). */
static gm_block *recycle_next(struct recycle_order *r) {
    if (r->next < r->n_same) return r->same[r->next++];
    size_t size = SIZE_MAX;
    for (size_t i = 0; i < r->n_idx; i++)
        if (r->cur[i] && r->cur[i]->size < size) size = r->cur[i]->size;
    if (size == SIZE_MAX) return NULL;
    r->n_same = r->next = 0;
    for (size_t i = 0; i < r->n_idx; i++) {
        /* Equal sizes share a bin, so they are neighbours in the walk. */
        for (; r->cur[i] && r->cur[i]->size == size; r->cur[i] = fi_next(r->idx[i], r->cur[i])) {
            if (r->n_same == r->cap_same) {
                gm_block **a = gm_array_grow(r->same, &r->cap_same, 64, sizeof *a);
                if (!a) return NULL;
                r->same = a;
            }
            r->same[r->n_same++] = r->cur[i];
        }
    }
    qsort(r->same, r->n_same, sizeof *r->same, cmp_addr_desc);
    return r->same[r->next++];
}

/* Trim [*p0, *p1), whole chunks, to its topmost run of device pages: host
 * pages (spill.c) are no cached memory, and unmapping them gives no spare. */
static void device_top(const gm_heap *h, size_t *p0, size_t *p1) {
    while (*p1 > *p0 && h->host[*p1 - 1]) *p1 = h_chunk_first(h, *p1 - 1);
    for (size_t p = *p1; p > *p0; p--)
        if (h->host[p - 1]) {
            *p0 = p;
            break;
        }
}

/* Wholly free pages, outside the page range [ex0, ex1), that free blocks of
 * the general heap cover, back nothing and can be unmapped: up to `want` of
 * them, in the order h_recycle() takes them, go to *out (malloc'd; the number
 * of runs is returned, *pages the pages in them). */
static size_t cached_runs(gm_heap *h, size_t want, size_t ex0, size_t ex1, struct cached_run **out, size_t *pages) {
    struct recycle_order r = {0};
    struct cached_run *runs = NULL;
    size_t n = 0, cap = 0, chosen = 0;
    r.idx = malloc(h->n_owners * sizeof *r.idx);
    r.cur = malloc(h->n_owners * sizeof *r.cur);
    if (r.idx && r.cur) {
        for (size_t i = 0; i < h->n_owners; i++) {
            if (h->owners[i]->pool || !h->owners[i]->idx.count) continue;
            r.idx[r.n_idx] = &h->owners[i]->idx;
            r.cur[r.n_idx++] = fi_first_from(&h->owners[i]->idx, h->page);
        }
    }
    for (gm_block *b; chosen < want && r.n_idx && (b = recycle_next(&r));) {
        if (!h_general_space(b)) continue; /* only general free space is recycled */
        size_t p0 = h_page_ceil(h, b->addr), p1 = h_page_floor(h, b->addr + b->size);
        if (p0 >= p1) continue;
        /* Two parts when the range splits the block: the lower first.  Only
         * whole chunks can go: a chunk that other blocks (or the range) share
         * a page of stays. */
        size_t parts[2][2] = {{p0, p1 < ex0 ? p1 : ex0}, {p0 > ex1 ? p0 : ex1, p1}};
        for (int k = 0; k < 2 && chosen < want; k++) {
            if (parts[k][0] >= parts[k][1]) continue;
            whole_chunks(h, &parts[k][0], &parts[k][1]);
            if (h->host_pages) device_top(h, &parts[k][0], &parts[k][1]);
            if (parts[k][0] >= parts[k][1]) continue;
            if (n == cap) {
                struct cached_run *a = gm_array_grow(runs, &cap, 64, sizeof *a);
                if (!a) goto done; /* keep what there is */
                runs = a;
            }
            /* From the top of each, down to a chunk's start. */
            size_t take = parts[k][1] - parts[k][0];
            if (take > want - chosen) take = want - chosen;
            size_t from = h_chunk_first(h, parts[k][1] - take);
            runs[n++] = (struct cached_run){b, from, parts[k][1]};
            chosen += parts[k][1] - from;
        }
    }
done:
    free(r.idx);
    free(r.cur);
    free(r.same);
    *out = runs;
    *pages = chosen;
    return n;
}

static int cmp_run_addr(const void *x, const void *y) {
    const struct cached_run *a = x, *b = y;
    return a->p0 < b->p0 ? 1 : -1;
}

/* Unmap at least `want` cached pages outside [ex0, ex1) (or all there are)
 * into spares (`restock`: a chunk of several pages is replaced by as many
 * single spares; else it is only released).  Returns the pages unmapped.  The
 * caller has synchronised the device.  Pages come first from the smallest
 * free blocks, which can serve the fewest requests, and from the top of each
 * (cached_runs picks them).  The unmaps then run from the highest address
 * down: cutting a block keeps its record as the lower part, so runs below
 * (even of the same block) stay valid. */
size_t h_recycle(gm_heap *h, size_t want, size_t ex0, size_t ex1, int restock) {
    struct cached_run *runs;
    size_t total, n = cached_runs(h, want, ex0, ex1, &runs, &total), got = 0;
    /* Each cut block may need two more records. */
    if (!n || h_slab_reserve(h, 2 * n + 2)) {
        free(runs);
        return 0;
    }
    qsort(runs, n, sizeof *runs, cmp_run_addr);
    for (size_t i = 0; i < n; i++) {
        size_t before = h->mapped_pages;
        int rc = h_unmap_pages(h, runs[i].b, runs[i].p0, runs[i].p1, restock);
        got += before - h->mapped_pages;
        if (rc) break;
    }
    free(runs);
    return got;
}

/* Of the pages [g0, g1) that no block keeping its pages touches, those in a
 * chunk that reaches past either end: a chunk goes only as a whole.  With
 * `device`, only the device's pages (a chunk is all host pages or none). */
size_t h_gap_locked(const gm_heap *h, size_t g0, size_t g1, int device) {
    size_t a = g0, b = g1;
    if (h->chunk_len[a] && h->chunk_off[a]) a = h_chunk_end(h, a) < g1 ? h_chunk_end(h, a) : g1;
    if (a < b && h->chunk_len[b - 1] && h_chunk_end(h, b - 1) > g1)
        b = h_chunk_first(h, b - 1) > a ? h_chunk_first(h, b - 1) : a;
    size_t lo = a - g0, hi = g1 - b;
    if (device && lo && h->host[g0]) lo = 0;
    if (device && hi && h->host[g1 - 1]) hi = 0;
    return lo + hi;
}

/* Pages that no block keeping its pages touches, outside the page range
 * [ex0, ex1), but that share a chunk of several pages with one that such a
 * block touches (or with the range): cached, yet they cannot be unmapped.
 * A walk over the blocks, made only while chunks of several pages are
 * mapped: each gap between the page ranges those blocks keep (and the
 * range) loses the ends that chunks reaching past it cover.  With
 * `device`, only the device's pages (h_gap_locked). */
size_t h_chunk_locked(const gm_heap *h, size_t ex0, size_t ex1, int device) {
    if (!h->multi_chunks) return 0;
    size_t locked = 0, g0 = 0; /* the gap being measured starts at page g0 */
    for (const gm_block *b = h->head;; b = b->next) {
        if (b && !h_keeps_pages(b)) continue;
        size_t f = b ? h_page_floor(h, b->addr) : h->n_pages;
        size_t e = b ? h_page_floor(h, b->addr + b->size - 1) + 1 : h->n_pages;
        if (ex0 < ex1 && ex0 <= f) {
            if (ex0 > g0) locked += h_gap_locked(h, g0, ex0, device);
            if (ex1 > g0) g0 = ex1;
            ex0 = ex1;
        }
        if (f > g0) locked += h_gap_locked(h, g0, f, device);
        if (e > g0) g0 = e;
        if (!b) break;
    }
    return locked;
}

/* Mapped pages that no block keeping its pages touches (h_keeps_pages: live,
 * or kept for a living pool), outside the page range [ex0, ex1): pages wholly
 * under general free or pending blocks, whatever their owners.  After a
 * synchronisation they are wholly free and can go.  [ex0, ex1) is a
 * placement's range, which lies in general space: a block that keeps its
 * pages touches a page of it only by starting or ending there, so live_ep
 * says which.  Pages locked in a chunk that something else uses do not count
 * (chunk_locked). */
size_t h_cached_pages(gm_heap *h, size_t ex0, size_t ex1) {
    /* Paused pages are counted in live_pages but are not mapped. */
    /* Host pages that such blocks touch are counted in live_pages too (spill). */
    size_t pages = h->mapped_pages + h->paused_pages + h_host_kept(h) - h->runs.live_pages;
    if (ex1 > h->n_pages) ex1 = h->n_pages;
    for (size_t p = ex0; p < ex1; p++) pages -= h->page_handle[p] && !h->host[p] && !h->runs.live_ep[p];
    pages -= h_chunk_locked(h, ex0, ex1, 1);
    /* A range that takes a pool's free blocks may take more than this (cached_pages_outside). */
    h_assert(ex0 < ex1 || pages <= h->mapped_pages);
    return pages;
}

/* Cached pages a defragmentation could move behind placement pl.  A range
 * that takes a pool's free blocks holds pages those keep that no block starts
 * or ends in (cached_pages cannot tell them from cached ones): counted back. */
size_t h_cached_pages_outside(gm_heap *h, placement pl, size_t size) {
    size_t ex0 = h_page_floor(h, pl.addr), ex1 = h_page_ceil(h, pl.addr + size);
    size_t pages = h_cached_pages(h, ex0, ex1);
    for (const gm_block *b = pl.first; pl.pooled && b && b->addr < pl.addr + size; b = b->next) {
        if (!h_keeps_pages(b)) continue;
        size_t p0 = h_page_floor(h, b->addr) + 1, p1 = h_page_floor(h, b->addr + b->size - 1);
        if (p0 < ex0) p0 = ex0;
        if (p1 > ex1) p1 = ex1;
        if (p1 > p0) pages += p1 - p0;
    }
    h_assert(pages <= h->mapped_pages);
    return pages;
}
