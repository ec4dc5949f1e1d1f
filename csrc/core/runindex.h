/*
 * runindex.h -- what the slow path needs to know without walking every block.
 *
 * RUNS.  General space is a block that placement may build on: unmapped, or
 * free in the general heap (h_general_space() in heap_internal.h says which;
 * owners do not matter here; a living pool's free blocks are not general).  A run is a maximal sequence of neighbouring general-space
 * blocks.  The first block of each run, its head, carries the run's length in
 * bytes (run_len) and sits in a bin of a two-level segregated index keyed by
 * that length, like freeindex.h but with unsorted bins: placement wants every
 * run at least as long as the request, in no particular order, and visits no
 * other.
 *
 * Except lone free blocks: a run that is one free block (a hole between
 * blocks that are not general space) is not indexed (run_len 0).  They are
 * most runs, and the fast path makes and consumes them, so leaving them out
 * keeps the index off the fast path.  Placement does not miss them: the slow
 * path places only after the free indexes found no block that fits, so a lone
 * free block that stream may use is shorter than the request; where that is
 * not known (after a synchronisation), h_place() asks the free indexes (place.c).
 *
 * The heap detaches a run from the index (h_run_detach) before it changes the
 * run's blocks -- a state, a split, a merge -- and attaches it again after
 * (h_run_attach, which measures it by walking its blocks).  Both walk from a
 * block to its run's head, across the run's blocks: usually none or one.
 *
 * PAGE USE.  The blocks that keep their pages (h_keeps_pages: live ones, and
 * a living pool's free and pending ones, whose addresses a CUDA graph may
 * hold) are counted per page: live_ep[p] is the number of them whose first or
 * last page p is (once for a block within one page).  A page strictly inside
 * a block is touched by that block alone, so
 *     pages kept = #{p : live_ep[p] > 0} + inner pages of the blocks counted
 * a counter kept in O(1) per allocation and free.  The slow path's count of
 * cached pages (mapped pages no such block touches) is then a subtraction
 * instead of a walk over every block.  Splits and merges of a pool's free
 * blocks update the counts as they go (h_split and h_absorb in block.c).
 *
 * Invariants (gm_check recounts them):
 *   R1  b->run_len != 0  <=>  b is general space, b->prev is not (or is NULL),
 *       and b is not a lone free block (free, with b->next not general space
 *       either); then run_len is the total size of b and of the general-space
 *       blocks that follow it up to the first one that is not.
 *   R2  every head of R1 is in the bin ri_bin(run_len) computes, nothing else is;
 *       bins are doubly linked (rprev, rnext) with NULL ends; bit (fl) of
 *       fl_bitmap is set <=> sl_bitmap[fl] != 0, and bit (sl) of sl_bitmap[fl]
 *       <=> bins[fl][sl] != NULL; count and bytes are the heads' number and
 *       total run_len.
 *   P1  live_ep[p] is as defined above.
 *   P2  live_pages equals the sum above.
 */
#ifndef GPUMEM_RUNINDEX_H
#define GPUMEM_RUNINDEX_H

#include <stddef.h>
#include <stdint.h>

#include "debug.h"
#include "freeindex.h" /* the bins: FI_FL x FI_SL, fi_fl_sl, fi_first_bin */

struct gm_block;

typedef struct gm_runindex {
    uint64_t fl_bitmap;
    uint32_t sl_bitmap[FI_FL];
    struct gm_block *bins[FI_FL][FI_SL];
    size_t count;      /* runs */
    size_t bytes;      /* their total length */
    uint32_t *live_ep; /* per page: blocks keeping pages that start or end in it */
    size_t live_pages; /* pages those blocks touch */
} gm_runindex;

int ri_init(gm_runindex *ri, size_t n_pages);
void ri_free(gm_runindex *ri);
unsigned ri_bin(size_t len);
/* Index a head whose run_len is set; take one out (its run_len stays). */
void ri_insert(gm_runindex *ri, struct gm_block *head);
void ri_remove(gm_runindex *ri, struct gm_block *head);
/* The indexed run headed by `old` is now headed by `head` and `len` long
 * (cheap when the bin stays the same: the common change at the edge of a long run). */
void ri_move_head(gm_runindex *ri, struct gm_block *old, struct gm_block *head, size_t len);
/* Visit every head whose run is at least `len` long (any order); stop early
 * if fn returns non-zero.  fn must not change the index. */
int ri_each_at_least(const gm_runindex *ri, size_t len, int (*fn)(struct gm_block *head, void *arg), void *arg);

/* Index a head, its run `len` long; take one out (its run_len becomes 0). */
void ri_index(gm_runindex *ri, struct gm_block *head, size_t len);
void ri_unindex(gm_runindex *ri, struct gm_block *head);

/* The heap's hooks (heap_internal.h and block.c, where what general space is
 * is known):
 *   h_run_detach(h, b)  take the run that general-space block b is in out of
 *                        the index (if it is there);
 *   h_run_attach(h, b)  measure the run that general-space block b is in and
 *                        index it, unless it is a lone free block; it must not
 *                        be in the index;
 *   h_run_head(b)       the head of b's run;
 *   h_pages_use(h, b, d)  block b starts (+1) or stops (-1) keeping its pages. */

/* Page p gains (d > 0) or loses a block that starts or ends in it; *pages
 * counts the pages whose count is not zero. */
static inline void ri_ep_add(uint32_t *ep, size_t p, int d, size_t *pages) {
    h_assert(d > 0 ? ep[p] < UINT32_MAX : ep[p] > 0);
    if (d > 0) {
        if (ep[p]++ == 0) (*pages)++;
    } else if (--ep[p] == 0) {
        (*pages)--;
    }
}

/* A block over pages [p0, p1] (first and last) comes (d > 0) or goes. */
static inline void ri_ep_block(uint32_t *ep, size_t p0, size_t p1, int d, size_t *pages) {
    ri_ep_add(ep, p0, d, pages);
    if (p1 != p0) ri_ep_add(ep, p1, d, pages);
    if (p1 > p0 + 1) *pages += d > 0 ? p1 - p0 - 1 : (size_t)0 - (p1 - p0 - 1);
}

/* The index's half of the checks (the heap's checker, check.c, recounts from
 * the blocks and says which blocks head runs): R2 but for what the heads are
 * -- bins, links, bitmaps, each head in the bin of its run_len, count and
 * bytes the listed heads' -- and P1, P2 against a recount of page use (ep[p]
 * per page, `pages` the pages touched).  0, or GM_ECORRUPT with a reason. */
int ri_check(const gm_runindex *ri, char *why, size_t whylen);
int ri_check_pages(const gm_runindex *ri, const uint32_t *ep, size_t n_pages, size_t pages, char *why, size_t whylen);

#endif
