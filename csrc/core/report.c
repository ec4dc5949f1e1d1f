/*
 * report.c -- reports: the OOM report and the figures the explanations
 * read (where the device's memory is, what is stranded, the largest block
 * defragmentation could make).
 *
 * Calls: page.c (cached and locked page counts); it changes nothing.
 */
#include <stdlib.h>
#include <string.h>

#include "gpumem/array.h"
#include "heap_internal.h"

/* ---- reports ------------------------------------------------------------------------- */

/* A block whose pages nothing may take: live, pending, or kept for a living pool. */
static inline int holds_pages(const gm_block *b) {
    return b->state == GM_BLOCK_LIVE || b->state == GM_BLOCK_PENDING || (b->state == GM_BLOCK_FREE && h_pinned(b));
}

/* Pages that such blocks touch.  Only reports ask (they walk every block
 * anyway); the slow path counts with the run index's page use. */
size_t h_used_pages(gm_heap *h) {
    size_t used = 0, last = SIZE_MAX; /* last page counted */
    for (gm_block *b = h->head; b; b = b->next) {
        if (!holds_pages(b)) continue;
        size_t p0 = h_page_floor(h, b->addr), p1 = h_page_ceil(h, b->addr + b->size);
        if (last != SIZE_MAX && p0 <= last) p0 = last + 1;
        if (p1 > p0) used += p1 - p0;
        if (p1 > 0) last = p1 - 1;
    }
    return used;
}

/* A run of general space as alternating segments: free (mapped) bytes, and
 * unmapped pages (fill_report). */
struct run_seg {
    size_t bytes, unmapped; /* unmapped: pages, 0 for a free segment */
};

/* Append block b to the run's segments; 1 on host OOM. */
static int run_seg_add(struct run_seg **seg, size_t *n, size_t *cap, const gm_block *b, size_t page) {
    size_t unm = b->state == GM_BLOCK_UNMAPPED ? b->size / page : 0;
    if (*n && (!unm) == (!(*seg)[*n - 1].unmapped)) {
        (*seg)[*n - 1].bytes += b->size;
        (*seg)[*n - 1].unmapped += unm;
        return 0;
    }
    if (*n == *cap) {
        struct run_seg *a = gm_array_grow(*seg, cap, 64, sizeof *a);
        if (!a) return 1;
        *seg = a;
    }
    (*seg)[(*n)++] = (struct run_seg){b->size, unm};
    return 0;
}

/* The longest range in a run whose unmapped pages number at most `fill`:
 * whole segments with at most `fill` unmapped pages between them, then what
 * is left of `fill` reaches into the unmapped segments on either side. */
static size_t run_seg_best(const struct run_seg *seg, size_t n, size_t fill, size_t page) {
    size_t best = 0, j = 0, cost = 0, bytes = 0;
    for (size_t i = 0; i < n; i++) {
        if (j < i) j = i, cost = bytes = 0;
        while (j < n && cost + seg[j].unmapped <= fill) {
            cost += seg[j].unmapped;
            bytes += seg[j].bytes;
            j++;
        }
        size_t ext = (j < n ? seg[j].unmapped : 0) + (i > 0 ? seg[i - 1].unmapped : 0), left = fill - cost;
        size_t v = bytes + (left < ext ? left : ext) * page;
        if (v > best) best = v;
        if (j > i) {
            cost -= seg[i].unmapped;
            bytes -= seg[i].bytes;
        }
    }
    return best;
}

void h_fill_report(gm_heap *h, size_t size, gm_stream s, gm_oom_info *o) {
    memset(o, 0, sizeof *o);
    o->request = size;
    o->stream = s;
    size_t dfree = 0, dtotal = 0;
    if (h->dev->ops->mem_info(h->dev, &dfree, &dtotal) == GM_OK) {
        o->device_free = dfree;
        o->device_total = dtotal;
    }
    o->cap_bytes = h->cap_pages * h->page;
    o->live_bytes = h->live_bytes;
    o->pending_bytes = (size_t)h->st.active_bytes[GM_POOL_ALL].current - h->live_bytes;
    o->reserved_bytes = h_held_pages(h) * h->page;
    /* Paused pages are used but not held; host pages are used but not the device's. */
    size_t used = h_used_pages(h) - h->paused_pages, host = h_host_kept(h);
    used = used > host ? used - host : 0;
    o->spilled_bytes = h->host_pages * h->page;
    o->spill_limit = h->spill_pages * h->page;
    o->cached_bytes = (h_held_pages(h) - used) * h->page;
    /* The device's pages only, as cached_bytes and avail count them (a host
     * chunk's free pages are no cache of the device's). */
    o->chunk_locked_bytes = h_chunk_locked(h, 0, 0, 1) * h->page;
    /* Pages a request could end up with: everything the heap holds that backs
     * no live block, plus what the device and the cap still allow. */
    size_t obtainable = h_held_pages(h) + dfree / h->page;
    if (obtainable > h->cap_pages) obtainable = h->cap_pages;
    size_t avail = obtainable > used ? obtainable - used : 0;
    /* Pages locked in chunks count as serving only in place, though a split
     * (split.c) may free them: what it frees depends on the pages left to
     * copy into and on the placement, so the figure stays one the slow path
     * can always reach. */
    size_t locked = o->chunk_locked_bytes / h->page, movable = avail > locked ? avail - locked : 0;
    size_t run = 0, best_run = 0, in_place = 0, n_seg = 0, cap_seg = 0;
    uintptr_t run_start = 0;
    struct run_seg *seg = NULL;
    int seg_oom = 0;
    /* Free memory kept for living pools serves no other request: it is
     * reported apart and counts as used here. */
    for (size_t i = 0; i < h->n_pools; i++)
        if (h->pools[i]->use_count > 0) o->pool_live_bytes += h->pools[i]->live_bytes;
    o->pool_free_bytes = h->pool_free_bytes;
    for (gm_block *b = h->head;; b = b->next) {
        /* A small page's free space serves small requests only (small.c). */
        int pinned = b && h_pinned(b), small = b && h_small_free(b);
        if (b && b->state == GM_BLOCK_FREE && !pinned) {
            o->free_mapped_bytes += b->size;
            if (!small && b->size > o->largest_free_mapped) o->largest_free_mapped = b->size;
        }
        if (b && ((b->state == GM_BLOCK_FREE && !pinned && !small) || b->state == GM_BLOCK_UNMAPPED)) {
            if (!run) run_start = b->addr;
            run += b->size;
            if (run > best_run) best_run = run;
            if (locked && !seg_oom) seg_oom = run_seg_add(&seg, &n_seg, &cap_seg, b, h->page);
            continue;
        }
        if (run && locked && !seg_oom) {
            /* With pages locked in chunks a run's free bytes serve only in
             * place; its unmapped parts get pages that can move (elsewhere: the
             * run's own movable pages are in place already) or new ones. */
            size_t g0 = h_page_ceil(h, run_start), g1 = h_page_floor(h, run_start + run), here = 0;
            for (size_t q = g0; q < g1; q++) here += h->page_handle[q] && !h->host[q]; /* movable counts no host page */
            if (g0 < g1) here -= h_gap_locked(h, g0, g1, 1);
            size_t can = run_seg_best(seg, n_seg, movable > here ? movable - here : 0, h->page);
            if (can > in_place) in_place = can;
        }
        run = n_seg = 0;
        if (!b) break;
    }
    free(seg);
    /* Without the segments (host memory): only what lies free in one place. */
    size_t possible = !locked ? avail * h->page : seg_oom ? o->largest_free_mapped : in_place;
    o->largest_possible = possible < best_run ? possible : best_run;
    if (o->largest_free_mapped > o->largest_possible) o->largest_possible = o->largest_free_mapped;
    /* A request larger than the cap is refused whatever lies free. */
    if (o->largest_possible > o->cap_bytes) o->largest_possible = o->cap_bytes;
}

void gm_memory_report(gm_heap *h, size_t size, gm_oom_info *out) {
    pthread_mutex_lock(&h->lock);
    /* A size within 511 bytes of SIZE_MAX has no rounded value: it stays as given. */
    h_fill_report(h, size > SIZE_MAX - (GM_ALIGN - 1) ? size : h_align_up(size, GM_ALIGN), ANY, out);
    pthread_mutex_unlock(&h->lock);
}

int gm_last_oom(gm_heap *h, gm_oom_info *out) {
    pthread_mutex_lock(&h->lock);
    int have = h->have_oom;
    if (have) *out = h->last_oom;
    pthread_mutex_unlock(&h->lock);
    return have ? GM_OK : GM_EINVAL;
}
