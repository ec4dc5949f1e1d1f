/*
 * spill.c -- spill: host-located pages behind the heap's own addresses when
 * the device has no room left, and their way back (heap.c, SPILL).
 *
 * Calls: page.c (chunks, spares, unmapping free pages), stream.c (the device
 * wait), block.c (the block placed on host pages), the device.
 */
#include <stdlib.h>
#include <string.h>

#include "gpumem/array.h"
#include "heap_internal.h"

/* ---- host chunks ------------------------------------------------------------------ */

/* Give an unmapped host chunk back; one kept for the next spill (host_keep),
 * or whose release fails, waits in host_loose (its pages stay counted by the
 * device). */
void h_host_release(gm_heap *h, gm_handle hd, size_t k) {
    int keep = h->host_keep || h->no_sync;
    if (!keep && h->dev->ops->release(h->dev, hd) == GM_OK) return;
    h->st.num_device_errors += !keep;
    if (h->n_host_loose == h->cap_host_loose) {
        size_t cap = h->cap_host_loose, cap2 = cap;
        gm_handle *a = gm_array_grow(h->host_loose, &cap, 8, sizeof *a);
        if (a) h->host_loose = a;
        size_t *l = a ? gm_array_grow(h->host_loose_len, &cap2, 8, sizeof *l) : NULL;
        if (l) h->host_loose_len = l;
        if (!a || !l) return; /* no host memory to remember it: it leaks */
        h->cap_host_loose = cap;
    }
    h->host_loose[h->n_host_loose] = hd;
    h->host_loose_len[h->n_host_loose++] = k;
    h->host_loose_pages += k;
}

static void host_loose_retry(gm_heap *h) {
    while (h->n_host_loose && !h->no_sync) {
        size_t i = h->n_host_loose - 1;
        if (h->dev->ops->release(h->dev, h->host_loose[i])) {
            h->st.num_device_errors++;
            return;
        }
        h->host_loose_pages -= h->host_loose_len[i];
        h->n_host_loose--;
    }
}

/* Whether the demand (the peak of what live blocks touched since the peak
 * was reset, with the growth slack) exceeds the cap: then what is spilled
 * stays spilled, and idle host chunks are kept for the next spill. */
static int demand_exceeds_cap(const gm_heap *h) { return h->live_peak_pages + h->growth_slack_pages > h->cap_pages; }

/* Take the kept host chunk i out of host_loose. */
static gm_handle kept_take(gm_heap *h, size_t i) {
    gm_handle hd = h->host_loose[i];
    h->host_loose_pages -= h->host_loose_len[i];
    h->host_loose[i] = h->host_loose[h->n_host_loose - 1];
    h->host_loose_len[i] = h->host_loose_len[h->n_host_loose - 1];
    h->n_host_loose--;
    return hd;
}

/* A host chunk of k pages, unmapped, in *hd: a kept one that long
 * (host_loose: no create_host), else a new one within the limit for mapped,
 * kept and `promised` host pages (kept ones are released to make room).
 * GM_ENOMEM past it or when the host refuses; the caller counts a device
 * error. */
static int host_chunk(gm_heap *h, size_t k, size_t promised, gm_handle *hd) {
    for (size_t i = h->n_host_loose; i > 0; i--)
        if (h->host_loose_len[i - 1] == k) {
            *hd = kept_take(h, i - 1);
            return GM_OK;
        }
    if (h->host_pages + h->host_loose_pages + promised + k > h->spill_pages) host_loose_retry(h);
    if (h->host_pages + h->host_loose_pages + promised + k > h->spill_pages) return GM_ENOMEM;
    return h->dev->ops->create_host(h->dev, k, hd);
}

/* The heap's scratch range, at least k pages long: where a chunk is mapped to
 * be copied into before it takes the place of another. */
int h_scratch_get(gm_heap *h, size_t k, uintptr_t *va) {
    if (h->scratch_pages < k) {
        uintptr_t at = 0;
        if (h->dev->ops->reserve(h->dev, k * h->page, &at)) {
            h->st.num_device_errors++;
            return GM_EDEVICE;
        }
        if (h->scratch) h->dev->ops->unreserve(h->dev, h->scratch, h->scratch_pages * h->page);
        h->scratch = at;
        h->scratch_pages = k;
    }
    *va = h->scratch;
    return GM_OK;
}

/* Unmap [va, va + k pages), asking again a few times: a mapping that will not
 * go would leave a chunk nobody may release.  GM_OK or GM_EDEVICE. */
int h_unmap_retry(gm_heap *h, uintptr_t va, size_t k) {
    for (int attempt = 0; attempt < 8; attempt++) {
        if (h->dev->ops->unmap(h->dev, va, k * h->page) == GM_OK) return GM_OK;
        h->st.num_device_errors++;
    }
    return GM_EDEVICE;
}

/* Put `to` (k pages holding the contents of the chunk `from` mapped at page p)
 * in from's place: unmap from, map to, grant access.  On failure from goes
 * back (the caller releases `to`); GM_ECORRUPT if even that fails. */
static int swap_in(gm_heap *h, size_t p, size_t k, gm_handle from, gm_handle to) {
    const gm_device_ops *ops = h->dev->ops;
    uintptr_t va = h_page_addr(h, p);
    if (ops->unmap(h->dev, va, k * h->page)) {
        h->st.num_device_errors++;
        return GM_EDEVICE;
    }
    if (ops->map(h->dev, va, k, to) == GM_OK) {
        if (ops->set_access(h->dev, va, k * h->page) == GM_OK) return GM_OK;
        if (h_unmap_retry(h, va, k)) return GM_ECORRUPT;
    }
    h->st.num_device_errors++;
    return h_map_back(h, p, k, from);
}

/* Map the chunk hd (k pages) at page p again, where it was unmapped for a
 * move that failed, asking again a few times.  GM_EDEVICE (it is back,
 * accessible: the move did not happen), or GM_ECORRUPT when it will not go
 * back. */
int h_map_back(gm_heap *h, size_t p, size_t k, gm_handle hd) {
    uintptr_t va = h_page_addr(h, p);
    for (int attempt = 0; attempt < 8; attempt++)
        if (h->dev->ops->map(h->dev, va, k, hd) == GM_OK) {
            for (int again = 0; again < 8; again++)
                if (h->dev->ops->set_access(h->dev, va, k * h->page) == GM_OK) return GM_EDEVICE;
            return GM_ECORRUPT;
        }
    return GM_ECORRUPT;
}

/* One chunk's move: the chunk at page p (k pages, handle `from`) to the
 * unmapped chunk `to` of the same length, behind the same addresses. */
typedef struct {
    size_t p, k;
    gm_handle from, to;
} move;

/* Map each move's `to` in the scratch range, one after the other, and issue
 * the copy into it; the first failure stops it.  Returns how many `to`s are
 * mapped there; *copied how many of them had their copy issued. */
static size_t copies_issue(gm_heap *h, const move *m, size_t n, uintptr_t sc, size_t *copied, int *rc) {
    const gm_device_ops *ops = h->dev->ops;
    size_t i = 0;
    for (*copied = 0; i < n; i++) {
        size_t len = m[i].k * h->page;
        if (ops->map(h->dev, sc, m[i].k, m[i].to)) {
            h->st.num_device_errors++;
            *rc = GM_EDEVICE;
            return i;
        }
        if (ops->set_access(h->dev, sc, len) || ops->copy_dtod(h->dev, sc, h_page_addr(h, m[i].p), len)) {
            h->st.num_device_errors++;
            *rc = GM_EDEVICE;
            return i + 1;
        }
        *copied = i + 1;
        sc += len;
    }
    return i;
}

/* Wait for the copies, asking again a few times: a copy that may still run
 * keeps both of its ranges from being unmapped.  GM_OK or GM_ECORRUPT. */
int h_copies_wait(gm_heap *h) {
    for (int attempt = 0; attempt < 8; attempt++) {
        if (h->dev->ops->synchronize(h->dev) == GM_OK) return GM_OK;
        h->st.num_device_errors++;
    }
    return GM_ECORRUPT;
}

/* Move n chunks behind their own addresses with one device wait for all of
 * them: each `to` is mapped in the scratch range (grown to hold them all) and
 * the copies are issued, the device is waited for once, the `to`s are
 * unmapped there and each takes its `from`'s place.  Returns how many moved,
 * the first ones; the others' `to`s are unmapped and left to the caller
 * (unless *rc is GM_ECORRUPT: then none may go).  *rc: the first failure. */
static size_t moves_run(gm_heap *h, const move *m, size_t n, int *rc) {
    size_t total = 0, copied = 0, mapped, moved = 0;
    uintptr_t sc, at;
    for (size_t i = 0; i < n; i++) total += m[i].k;
    if (!n || (*rc = h_scratch_get(h, total, &sc))) return 0;
    mapped = copies_issue(h, m, n, sc, &copied, rc);
    if (mapped && h_copies_wait(h)) {
        *rc = GM_ECORRUPT;
        return 0;
    }
    at = sc;
    for (size_t i = 0; i < mapped; at += m[i++].k * h->page)
        if (h_unmap_retry(h, at, m[i].k)) {
            *rc = GM_ECORRUPT;
            return 0;
        }
    for (; moved < copied; moved++) {
        int e = swap_in(h, m[moved].p, m[moved].k, m[moved].from, m[moved].to);
        if (e) {
            *rc = e;
            break;
        }
    }
    return moved;
}

/* After moves_run: the page tables follow the moved chunks (to host pages,
 * or back to the device's), their old chunks go, and each move is counted
 * and recorded; the `to`s that did not move go back. */
static void moves_done(gm_heap *h, const move *m, size_t n, size_t moved, int rc, int to_host) {
    for (size_t i = 0; i < moved; i++) {
        h_chunk_clear(h, m[i].p, m[i].k);
        h_chunk_set(h, m[i].p, m[i].k, m[i].to, to_host);
        if (to_host)
            h_chunk_unused(h, m[i].from, m[i].k);
        else
            h_host_release(h, m[i].from, m[i].k);
        h->st.num_maps++;
        h->st.num_unmaps++;
        h->st.num_unspills += !to_host;
        h_hist(h, to_host ? GM_H_SPILL : GM_H_UNSPILL, h_page_addr(h, m[i].p), m[i].k * h->page, ANY, 0);
    }
    for (size_t i = moved; i < n && rc != GM_ECORRUPT; i++) {
        if (to_host)
            h_host_release(h, m[i].to, m[i].k);
        else
            h_chunk_unused(h, m[i].to, m[i].k);
    }
}

/* ---- what lies on host pages ------------------------------------------------------ */

/* A block whose pages must stay: live, pending, or kept for a living pool. */
static inline int holds(const gm_block *b) {
    return b->state == GM_BLOCK_LIVE || b->state == GM_BLOCK_PENDING || h_pinned(b);
}

/* Per page (calloc'd), 1 where a host page holds a block that must stay;
 * NULL on host OOM. */
static uint8_t *host_busy(const gm_heap *h) {
    uint8_t *busy = calloc(h->n_pages, 1);
    for (const gm_block *b = h->head; busy && b; b = b->next) {
        if (b->state == GM_BLOCK_UNMAPPED || !holds(b)) continue;
        for (size_t p = h_page_floor(h, b->addr), e = h_page_ceil(h, b->addr + b->size); p < e; p++)
            busy[p] |= h->host[p];
    }
    return busy;
}

/* Host pages that live blocks (or a living pool's) touch: what a return
 * needs.  A walk over the blocks, made again only after page use changed. */
size_t h_host_kept(gm_heap *h) {
    if (!h->host_pages) return 0;
    if (h->host_kept_stale) {
        h->host_kept = h_host_kept_count(h);
        h->host_kept_stale = 0;
    }
    return h->host_kept;
}

/* The walk itself (the checker recounts with it too). */
size_t h_host_kept_count(const gm_heap *h) {
    size_t n = 0, last = SIZE_MAX;
    for (const gm_block *b = h->head; b; b = b->next) {
        if (!h_keeps_pages(b)) continue;
        size_t p = h_page_floor(h, b->addr), e = h_page_ceil(h, b->addr + b->size);
        for (p = last != SIZE_MAX && p <= last ? last + 1 : p; p < e; p++) n += h->host[p];
        if (e > 0) last = e - 1;
    }
    return n;
}

/* Unmap the host chunks that hold nothing live or pending (the device is
 * idle), kept for the next spill with `keep` (while the demand exceeds the cap):
 * each under one free block of the general heap.  From the top down:
 * cutting a block keeps its lower part's record. */
static void drop_idle(gm_heap *h, int keep) {
    uint8_t *busy = host_busy(h);
    if (!busy) return;
    h->host_idle = 0;
    h->host_keep = keep; /* the next spill maps them again */
    gm_block *b = NULL;
    for (size_t q = h->n_pages; q > 0 && h->host_pages;) {
        size_t p = q - 1;
        if (!h->host[p]) {
            q--;
            continue;
        }
        size_t c = h_chunk_first(h, p), k = h->chunk_len[c];
        q = c;
        if (memchr(busy + c, 1, k)) continue;
        b = h_block_holding(b ? b : h->head, h_page_addr(h, c));
        if (!h_general_space(b) || b->state != GM_BLOCK_FREE || b->addr + b->size < h_page_addr(h, c + k)) continue;
        gm_block *anchor = b->prev ? b->prev : h->head; /* b may merge away: the record below stays */
        if (h_slab_reserve(h, 2) || h_unmap_pages(h, b, c, c + k, 0)) break;
        b = anchor;
    }
    h->host_keep = 0;
    free(busy);
}

/* ---- spilling --------------------------------------------------------------------- */

static int cmp_seq(const void *x, const void *y) {
    const gm_block *a = *(gm_block *const *)x, *b = *(gm_block *const *)y;
    return a->seq < b->seq ? -1 : a->seq > b->seq;
}

/* Whether a block of a living pool touches a page of [p, p+k) (b: a block
 * near it): its pages never move. */
static int pinned_pages(gm_heap *h, gm_block *b, size_t p, size_t k) {
    uintptr_t end = h_page_addr(h, p + k);
    for (b = h_block_holding(b, h_page_addr(h, p)); b && b->addr < end; b = b->next)
        if (b->state != GM_BLOCK_UNMAPPED && h_pinned(b)) return 1;
    return 0;
}

/* Live blocks of the general heap on device pages only, the oldest first
 * (malloc'd, *n of them).  GM_SPILL_LASTING: first those live at the last low
 * point of live memory, the most recently made first (in a training loop the
 * optimizer's state, made after the weights and read once a step, before
 * the weights), then the rest, the oldest first. */
static gm_block **oldest_blocks(gm_heap *h, size_t *n) {
    gm_block **v = malloc((h->n_live ? h->n_live : 1) * sizeof *v);
    *n = 0;
    for (gm_block *b = h->head; v && b; b = b->next)
        if (b->state == GM_BLOCK_LIVE && !b->pool && !h_on_host(h, b)) v[(*n)++] = b;
    if (!v) return v;
    qsort(v, *n, sizeof *v, cmp_seq);
    if (h->spill_choice != GM_SPILL_LASTING) return v;
    size_t k = 0; /* v[0, k): live at the low point, oldest first */
    while (k < *n && v[k]->seq <= h->trough_seq) k++;
    for (size_t i = 0; i < k / 2; i++) {
        gm_block *t = v[i];
        v[i] = v[k - 1 - i], v[k - 1 - i] = t;
    }
    return v;
}

/* The moves that free `want` device pages from under the oldest blocks
 * (v, n of them): each chunk once, never one a living pool's block touches,
 * each with a new host chunk of its length (create_host), within the limit.
 * Returns how many (in m, malloc'd); *rc the failure that stopped it. */
static size_t oldest_moves(gm_heap *h, gm_block **v, size_t n, size_t want, move **out, int *rc) {
    size_t cap = 16, c = 0, pages = 0;
    move *m = malloc(cap * sizeof *m);
    uint8_t *taken = calloc(h->n_pages, 1);
    for (size_t i = 0; m && taken && i < n && pages < want && !*rc; i++) {
        size_t p = h_page_floor(h, v[i]->addr), e = h_page_ceil(h, v[i]->addr + v[i]->size);
        for (p = h_chunk_first(h, p); p < e && !*rc; p += h->chunk_len[p]) { /* whole blocks */
            size_t k = h->chunk_len[p];
            if (h->host[p] || taken[p] || pinned_pages(h, v[i], p, k)) continue;
            gm_handle hd;
            move *m2 = c == cap ? gm_array_grow(m, &cap, 16, sizeof *m) : m;
            if (m2) m = m2;
            if (!m2 || h->host_pages + pages + k > h->spill_pages) {
                *rc = GM_ENOMEM;
                break;
            }
            if ((*rc = host_chunk(h, k, pages, &hd))) {
                h->st.num_device_errors += *rc != GM_ENOMEM;
                break;
            }
            m[c++] = (move){p, k, h->page_handle[p], hd};
            taken[p] = 1;
            pages += k;
        }
    }
    if (!m || !taken) *rc = GM_ENOMEM;
    free(taken);
    *out = m;
    return m ? c : 0;
}

/* GM_SPILL_OLD: move the chunks under the oldest live blocks to new host
 * chunks until `want` device pages came free (the device is idle), with one
 * device wait for all the copies.  Returns the pages moved; *rc the failure
 * that stopped it (GM_OK when some moved: the request tries again). */
static size_t spill_oldest(gm_heap *h, size_t want, int *rc) {
    size_t n, pages = 0;
    gm_block **v = oldest_blocks(h, &n);
    move *m = NULL;
    if (!v) {
        *rc = GM_ENOMEM;
        return 0;
    }
    size_t c = oldest_moves(h, v, n, want, &m, rc), moved = 0;
    free(v);
    if (c) {
        int mrc = GM_OK;
        moved = moves_run(h, m, c, &mrc);
        moves_done(h, m, c, moved, mrc, 1);
        if (mrc == GM_ECORRUPT || !moved) *rc = mrc ? mrc : *rc;
    }
    h->growth_seq += moved > 0;
    for (size_t i = 0; i < moved; i++) {
        for (size_t q = m[i].p; q < m[i].p + m[i].k; q++) h->page_growth[q] = h->growth_seq;
        pages += m[i].k;
    }
    free(m);
    return pages;
}

/* The highest unmapped block with room for k whole pages, or NULL. */
static gm_block *unmapped_room(gm_heap *h, size_t k) {
    gm_block *best = NULL;
    for (gm_block *b = h->head; b; b = b->next)
        if (b->state == GM_BLOCK_UNMAPPED && b->size / h->page >= k) best = b;
    return best;
}

/* Map k pages of new host chunks at page p0, granted access; on failure none. */
static int map_host_pages(gm_heap *h, size_t p0, size_t k) {
    const gm_device_ops *ops = h->dev->ops;
    size_t p = p0;
    int rc = GM_OK;
    while (p < p0 + k && !rc) {
        size_t n = p0 + k - p < GM_CHUNK_PAGES_MAX ? p0 + k - p : GM_CHUNK_PAGES_MAX;
        gm_handle hd;
        if ((rc = host_chunk(h, n, 0, &hd))) break;
        uintptr_t va = h_page_addr(h, p);
        if ((rc = ops->map(h->dev, va, n, hd)) == GM_OK && (rc = ops->set_access(h->dev, va, n * h->page)) &&
            h_unmap_retry(h, va, n))
            return GM_ECORRUPT; /* mapped, inaccessible, and it will not go */
        if (rc) {
            h_host_release(h, hd, n);
            break;
        }
        h_chunk_set(h, p, n, hd, 1);
        h->multi_chunks += n > 1;
        h->st.num_maps++;
        p += n;
    }
    if (rc && rc != GM_ENOMEM) h->st.num_device_errors++;
    while (rc && p > p0) { /* take back what was mapped, asking again a few times */
        size_t c = h_chunk_first(h, p - 1);
        int attempt = 0;
        while (h_unmap_chunk(h, c, 0))
            if (++attempt == 8) return GM_ECORRUPT;
        p = c;
    }
    return rc;
}

/* GM_SPILL_NEW: `size` bytes on whole host pages in unmapped space, as one
 * free block of the general heap owned by s (*out), its first page at *at. */
static int spill_new(gm_heap *h, size_t size, gm_stream s, gm_block **out, uintptr_t *at) {
    size_t k = (size + h->page - 1) / h->page;
    if (h->host_pages + k > h->spill_pages) return GM_ENOMEM;
    gm_block *u = unmapped_room(h, k);
    if (!u) return GM_EINVAL; /* the OOM text says: no room in the address range */
    if (h_slab_reserve(h, 4)) return GM_ENOMEM;
    size_t p0 = h_page_floor(h, u->addr);
    h_assert(u->state == GM_BLOCK_UNMAPPED && !h->page_handle[p0] && !h->parked[p0]);
    int rc = map_host_pages(h, p0, k);
    if (rc) return rc;
    h->growth_seq++;
    for (size_t p = p0; p < p0 + k; p++) h->page_growth[p] = h->growth_seq;
    gm_block *head = h_run_head(u);
    h_run_detach(h, u);
    if (u->size > k * h->page) h_split(h, u, k * h->page);
    gm_block *b = h_make_free(h, u, s, 0);
    h_run_attach(h, head);
    h_hist(h, GM_H_SPILL, h_page_addr(h, p0), k * h->page, s, 0);
    *out = b;
    *at = h_page_addr(h, p0);
    h->spill_whole = k * h->page;
    return GM_OK;
}

/* The slow path's last rung: serve `size` bytes for s with host pages, or (with
 * GM_SPILL_OLD, once: *moved) move the oldest blocks to the host so that the
 * caller's next try fits on the device (GM_OK with *out NULL).  GM_ENOMEM past
 * the limit or when the host refuses, GM_EINVAL when the heap's address range
 * has no unmapped room that large, GM_ENOTSUP when the device has no host
 * pages. */
int h_spill(gm_heap *h, size_t size, gm_stream s, size_t short_pages, int *moved, gm_block **out, uintptr_t *at) {
    *out = NULL;
    if (!h->dev->ops->create_host || !h->dev->ops->copy_dtod) return GM_ENOTSUP;
    if (!demand_exceeds_cap(h)) host_loose_retry(h); /* else kept host chunks serve */
    int rc = GM_OK;
    /* Moving blocks makes room only for what the device could hold at all;
     * their pages are copied and unmapped, so the device must be idle. */
    if (h->spill_choice != GM_SPILL_NEW && !*moved && (size + h->page - 1) / h->page <= h->cap_pages) {
        *moved = 1;
        if (h_synchronize(h, s)) return GM_EDEVICE;
        if (spill_oldest(h, short_pages, &rc)) {
            h->st.num_spills++;
            return GM_OK;
        }
        if (rc == GM_ECORRUPT) return rc;
    }
    rc = spill_new(h, size, s, out, at);
    if (!rc) h->st.num_spills++;
    return rc;
}

/* ---- return ----------------------------------------------------------------------- */

/* A device chunk of k pages for a host chunk to come back to (a spare for a
 * single page, else a new chunk under the cap, cached pages released first
 * to make room), `promised` pages already taken for others (not yet mapped,
 * so not counted held).  GM_ENOMEM when the device or the cap has no room. */
static int device_chunk(gm_heap *h, size_t k, size_t promised, gm_handle *hd) {
    if (k + promised > h->cap_pages) return GM_ENOMEM;
    if (k == 1 && h->n_spare > 0) {
        *hd = h_spare_pop(h);
        return GM_OK;
    }
    size_t room = h->cap_pages - k - promised; /* what the heap may hold besides */
    if (h_held_pages(h) > room) {              /* cached pages make room */
        h_release_spares(h, room);
        if (h_held_pages(h) > room) h_recycle(h, h_held_pages(h) - room, 0, 0, 0);
        h_release_spares(h, room);
    }
    if (h_held_pages(h) > room) return GM_ENOMEM;
    return h_create_chunk(h, k, hd, NULL);
}

/* Move every host chunk back (the device is idle), from the top down, with
 * one device wait for all the copies; the first chunk the device has no room
 * for stops it (those above it still come back). */
static int return_all(gm_heap *h) {
    int rc = GM_OK;
    size_t cap = 16, c = 0, promised = 0;
    move *m = malloc(cap * sizeof *m);
    if (!m) return GM_ENOMEM;
    for (size_t q = h->n_pages; q > 0 && !rc;) {
        size_t p = q - 1;
        if (!h->host[p]) {
            q--;
            continue;
        }
        q = h_chunk_first(h, p);
        move *m2 = c == cap ? gm_array_grow(m, &cap, 16, sizeof *m) : m;
        gm_handle hd;
        if (m2) m = m2;
        if (!m2 || (rc = device_chunk(h, h->chunk_len[q], promised, &hd))) {
            rc = rc ? rc : GM_ENOMEM;
            break;
        }
        m[c++] = (move){q, h->chunk_len[q], h->page_handle[q], hd};
        promised += h->chunk_len[q];
    }
    int mrc = GM_OK;
    size_t moved = moves_run(h, m, c, &mrc);
    moves_done(h, m, c, moved, mrc, 0);
    free(m);
    return mrc ? mrc : rc;
}

int h_unspill(gm_heap *h) {
    if (!h->host_pages && !h->n_host_loose) return GM_OK;
    if (h->no_sync || h->capture_count > 0 || h_other_capture(h)) return GM_ECAPTURING;
    if (h_synchronize(h, ANY)) return GM_EDEVICE;
    host_loose_retry(h);
    drop_idle(h, 0);
    return return_all(h);
}

int gm_unspill(gm_heap *h) {
    pthread_mutex_lock(&h->lock);
    int rc = h_unspill(h);
    pthread_mutex_unlock(&h->lock);
    return rc;
}

/* After a free while pages are spilled: a block that touched host pages may
 * have left some holding nothing (unmapped at once, so that no request gets
 * them while the device has room), and once the demand fits, everything comes
 * back.  The demand is the peak of what live blocks touched (host pages too)
 * since the peak was reset, not what is live now: a loop whose step needs
 * more than the cap keeps what it spilled across its steps instead of moving
 * it back at every dip and out again at the next peak.  Not during a capture:
 * then at a later free, gm_unspill or empty_cache. */
void h_spill_after_free(gm_heap *h, gm_stream s, int touched_host) {
    /* Room: the demand fits under the cap, and what is live in what the heap
     * holds and the device has free.  The cheap half first: most frees stop
     * here, with no device call. */
    size_t kept = h->runs.live_pages, dfree = 0, total = 0;
    int room = h->live_peak_pages + h->growth_slack_pages <= h->cap_pages;
    if (!touched_host && !room) return;
    if (h_capture_on(h, s) || h_other_capture(h)) return;
    room = room && h->dev->ops->mem_info(h->dev, &dfree, &total) == GM_OK && dfree / h->page + h_held_pages(h) >= kept;
    if (!touched_host && !room) return;
    if (h_synchronize(h, ANY)) return;
    drop_idle(h, demand_exceeds_cap(h));
    if (room && h->host_pages) return_all(h);
    if (room) host_loose_retry(h); /* the kept host chunks go too */
}

/* The peak was reset: the demand starts over from what is live now, and what
 * is spilled comes back if that fits (as after a free). */
void h_spill_demand_reset(gm_heap *h) {
    h->live_peak_pages = h->runs.live_pages;
    if ((h->host_pages || h->n_host_loose) && !h->no_sync) h_spill_after_free(h, ANY, 0);
}

/* Before the fast path, once pending blocks on host pages completed: unmap
 * the host pages they left holding nothing (not during a capture: later). */
void h_spill_idle(gm_heap *h, gm_stream s) {
    if (h->no_sync || h_capture_on(h, s) || h_other_capture(h)) return;
    if (h_synchronize(h, s)) return;
    drop_idle(h, demand_exceeds_cap(h));
}

/* At destroy: the scratch range and the host chunks whose release failed. */
void h_spill_free(gm_heap *h) {
    for (size_t i = 0; i < h->n_host_loose; i++) h->dev->ops->release(h->dev, h->host_loose[i]);
    if (h->scratch) h->dev->ops->unreserve(h->dev, h->scratch, h->scratch_pages * h->page);
    free(h->host_loose);
    free(h->host_loose_len);
    free(h->host);
}
