/*
 * small.c -- small pages: the general heap's blocks of at most half a page
 * kept together, in pages that hold nothing else.
 *
 * Calls: block.c (splitting, merging, the free indexes), place.c (the block
 * holding an address), heap.c's fit.
 *
 * SMALL PAGES
 *
 *   Physical memory in use is the pages live blocks touch, and only a wholly
 *   free page can move.  A small block placed in the free end of a large
 *   block's page keeps that page once the large block goes, and the hole
 *   beside it serves only what fits there: a heap that fills its device then
 *   holds many partly used pages that no defragmentation takes back.  So, as
 *   a caching allocator keeps a small pool, small requests of the general heap
 *   (h_small_size: at most half a page) take their blocks from small pages:
 *
 *     page      |    p-1     |     p      |    p+1     |
 *     blocks    [A        ][f][s][s][f ][s][B                ]
 *                            small page p: small blocks and their free space
 *
 *   A page becomes small when a small request finds no small free block that
 *   fits and takes a wholly free mapped page instead (keep_page; the free
 *   block around it is split at the page's edges), or when the slow path gave
 *   it a range whose page is wholly free.  Free blocks in a small page are
 *   flagged `small` and sit on their index's small side (freeindex.h): only
 *   small requests find them, placement never builds on them, and they never
 *   merge across the page's edges (h_small_seam).  The page counts its live
 *   and pending blocks (small_held); when the last one is freed the page is
 *   general again and its free space merges with its neighbours', so that it
 *   can be recycled like any free page.  With no wholly free page at hand a
 *   small request takes the best fit among the other free blocks, as before.
 */
#include "heap_internal.h"

/* The first page wholly inside free block f, or SIZE_MAX. */
static size_t whole_page_in(const gm_heap *h, const gm_block *f) {
    size_t p = h_page_ceil(h, f->addr);
    return h_page_addr(h, p) + h->page <= f->addr + f->size ? p : SIZE_MAX;
}

/* Free block f of the general heap, not small, covers page p: p becomes a
 * small page.  Returns its free block, on its index's small side. */
static gm_block *keep_page(gm_heap *h, gm_block *f, size_t p) {
    uintptr_t a = h_page_addr(h, p);
    gm_block *head = f;
    h_run_detach(h, f);
    h_index_remove(h, f);
    if (a > f->addr) {
        gm_block *r = h_split(h, f, a - f->addr);
        h_index_insert(h, f);
        f = r;
    }
    if (f->size > h->page) h_index_insert(h, h_split(h, f, h->page));
    h->small_page[p] = 1;
    h_index_insert(h, f);
    h_run_attach(h, head);
    return f;
}

/* The best small free block for a small request on stream s, else a wholly
 * free page made small, else NULL. */
gm_block *h_small_fit(gm_heap *h, size_t size, gm_stream s) {
    gm_owner *own = h_owner_find(h, NULL, s);
    gm_block *a = own ? fi_best_fit_small(&own->idx, size) : NULL;
    gm_block *b = fi_best_fit_small(&h->owners[0]->idx, size);
    if (a && (!b || a->size < b->size || (a->size == b->size && a->addr < b->addr))) b = a;
    if (b) return b;
    b = h_fit_in(h, size, s, NULL); /* a hole under a page beside other blocks */
    if (b && b->size < h->page) return b;
    gm_block *f = h_fit_in(h, h->page, s, NULL);
    if (f && whole_page_in(h, f) == SIZE_MAX) f = h_fit_in(h, 2 * h->page - GM_ALIGN, s, NULL);
    return f ? keep_page(h, f, whole_page_in(h, f)) : NULL;
}

/* The slow path gave a small request of `size` bytes free block b to carve
 * at `at`: the page of that range, if b covers it whole, becomes small.
 * Returns the block to carve. */
gm_block *h_small_after_slow(gm_heap *h, gm_block *b, uintptr_t at, size_t size) {
    size_t p = h_page_floor(h, at);
    if (b->small || b->pool || p != h_page_floor(h, at + size - 1) || b->addr > h_page_addr(h, p) ||
        h_page_addr(h, p + 1) > b->addr + b->size)
        return b;
    return keep_page(h, b, p);
}

/* Live block b was carved from a small page's free space. */
void h_small_live(gm_heap *h, const gm_block *b) { h->small_held[h_page_floor(h, b->addr)]++; }

/* Small page p holds no live or pending block: it becomes general, its free
 * blocks go to their indexes' other side and merge with their neighbours.
 * Returns the block that now holds address x. */
static gm_block *release_page(gm_heap *h, gm_block *b, size_t p, uintptr_t x) {
    uintptr_t a = h_page_addr(h, p), e = a + h->page;
    gm_block *first = h_block_holding(b, a);
    h_run_detach(h, first);
    for (gm_block *c = first; c && c->addr < e; c = c->next) h_index_remove(h, c);
    h->small_page[p] = 0;
    for (gm_block *c = first; c && c->addr < e; c = c->next) h_index_insert(h, c);
    gm_block *c = first->prev && first->prev->state == GM_BLOCK_FREE ? first->prev : first;
    while (c->next && c->next->addr <= e) {
        gm_stream o;
        if (h_may_merge_free(h, c, c->next, &o))
            h_merge_free(h, c, c->next, o);
        else
            c = c->next;
    }
    h_run_attach(h, h_block_holding(c, a));
    return h_block_holding(c, x);
}

/* b, a small page's block that was live or pending, is free now (and
 * indexed, maybe merged): the page holds one block fewer, and none gives it
 * back.  Returns the block that holds b's address. */
gm_block *h_small_freed(gm_heap *h, gm_block *b, uintptr_t x) {
    size_t p = h_page_floor(h, x);
    h_assert(h->small_page[p] && h->small_held[p] > 0);
    if (--h->small_held[p]) return b;
    return release_page(h, b, p, x);
}
