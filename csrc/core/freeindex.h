/*
 * freeindex.h -- a two-level segregated index of free blocks, after TLSF.
 *
 * Sizes are counted in 512-byte units.  The first level is the unit count's
 * power of two, the second level splits each power of two into 32 bins (so a
 * bin spans at most 1/32 of its sizes; sizes below 32 units get a bin each).
 * Two bitmaps say which bins are non-empty, so finding the first non-empty bin
 * at or above a size is two find-first-set instructions.
 *
 * Unlike TLSF, which settles for a "good fit" by skipping the request's own
 * bin, each bin is kept sorted by (size, address).  The search looks in the
 * request's own bin first and takes the first block that fits; failing that,
 * the head of the next non-empty bin.  The result is the exact best fit with
 * the lowest address among equals: address-ordered best fit, the policy that
 * fragments least in Wilson et al.'s and Johnstone's studies, at TLSF speed
 * whenever bins are short -- which they are, because neighbours coalesce.
 *
 * Two classes of blocks keep two sets of bins (fi_side): a block's `small`
 * flag, set by the heap before it is inserted, says which.  fi_best_fit
 * searches the blocks that are not small, fi_best_fit_small the small ones;
 * everything else -- counts, walks, moves -- covers both.
 *
 * Invariants (checked by gm_check), per side:
 *   I1  a block is in the bin that fi_bin() computes from its size;
 *   I2  each bin list is sorted by (size, addr), doubly linked, with NULL ends;
 *   I3  bit (fl) of fl_bitmap is set  <=>  sl_bitmap[fl] != 0;
 *       bit (sl) of sl_bitmap[fl] is set  <=>  bins[fl][sl] != NULL;
 *   I4  count and bytes equal the number and total size of the listed blocks.
 */
#ifndef GPUMEM_FREEINDEX_H
#define GPUMEM_FREEINDEX_H

#include <stddef.h>
#include <stdint.h>

#define FI_SL_BITS 5u
#define FI_SL      (1u << FI_SL_BITS)
#define FI_FL      44u /* 2^48 units of 512 B: far beyond any device */

struct gm_block;

typedef struct gm_fi_side {
    uint64_t fl_bitmap;
    uint32_t sl_bitmap[FI_FL];
    struct gm_block *bins[FI_FL][FI_SL];
} gm_fi_side;

typedef struct gm_freeindex {
    gm_fi_side side[2]; /* [0]: blocks whose `small` flag is clear, [1]: set */
    size_t count;
    size_t bytes;
} gm_freeindex;

/* The bin of a size of `units` 512-byte units: its first level, and *sl its
 * second (the run index, runindex.h, bins the same way). */
static inline unsigned fi_fl_sl(size_t units, unsigned *sl) {
    if (units < FI_SL) {
        *sl = (unsigned)units;
        return 0;
    }
    unsigned f = 63u - (unsigned)__builtin_clzll((unsigned long long)units);
    *sl = (unsigned)(units >> (f - FI_SL_BITS)) & (FI_SL - 1u);
    return f - FI_SL_BITS + 1u;
}

/* Bin (fl, sl) of an index with these bitmaps holds blocks now. */
static inline void fi_bin_filled(uint64_t *fl_bitmap, uint32_t *sl_bitmap, unsigned fl, unsigned sl) {
    sl_bitmap[fl] |= 1u << sl;
    *fl_bitmap |= 1ull << fl;
}

/* Bin (fl, sl) of an index with these bitmaps is empty now. */
static inline void fi_bin_emptied(uint64_t *fl_bitmap, uint32_t *sl_bitmap, unsigned fl, unsigned sl) {
    sl_bitmap[fl] &= ~(1u << sl);
    if (!sl_bitmap[fl]) *fl_bitmap &= ~(1ull << fl);
}

/* The first non-empty bin at or after bin (fl, *sl) of an index with these
 * bitmaps: its first level, and *sl its second; FI_FL if there is none. */
static inline unsigned fi_first_bin(uint64_t fl_bitmap, const uint32_t *sl_bitmap, unsigned fl, unsigned *sl) {
    if (fl >= FI_FL) return FI_FL;
    uint32_t sl_map = *sl < FI_SL ? sl_bitmap[fl] & (~0u << *sl) : 0u;
    if (!sl_map) {
        uint64_t fl_map = fl + 1u < 64u ? fl_bitmap & (~0ull << (fl + 1u)) : 0ull;
        if (!fl_map) return FI_FL;
        fl = (unsigned)__builtin_ctzll(fl_map);
        sl_map = sl_bitmap[fl];
    }
    *sl = (unsigned)__builtin_ctz(sl_map);
    return fl;
}

void fi_init(gm_freeindex *fi);
unsigned fi_bin(size_t size);
void fi_insert(gm_freeindex *fi, struct gm_block *b);
void fi_remove(gm_freeindex *fi, struct gm_block *b);
/* Smallest block with size >= size (lowest address among equals), or NULL:
 * among the blocks that are not small, and among the small ones. */
struct gm_block *fi_best_fit(const gm_freeindex *fi, size_t size);
struct gm_block *fi_best_fit_small(const gm_freeindex *fi, size_t size);
/* Visit every block (any order); stop early if fn returns non-zero. */
int fi_each(const gm_freeindex *fi, int (*fn)(struct gm_block *b, void *arg), void *arg);
/* The same, over the blocks of at least `size` bytes only (and some a little
 * smaller: those that share the bin of `size`). */
int fi_each_from(const gm_freeindex *fi, size_t size, int (*fn)(struct gm_block *b, void *arg), void *arg);
/* Walk the blocks that are not small in index order -- by bin, then (size,
 * addr) within one: sizes never decrease -- from the first block of the bin
 * of `size` (smaller blocks that share that bin included); NULL at the end. */
struct gm_block *fi_first_from(const gm_freeindex *fi, size_t size);
struct gm_block *fi_next(const gm_freeindex *fi, const struct gm_block *b);
/* Move every block of src into dst, in O(blocks of both) (a merge of sorted
 * bins, not one insertion at a time); fn, if given, sees each block that
 * moves, and must change neither index.  src is left empty. */
void fi_move_all(gm_freeindex *dst, gm_freeindex *src, void (*fn)(struct gm_block *b, void *arg), void *arg);
/* Move the blocks of src for which pred holds into dst, the same way, in
 * O(blocks of both in the bins src uses); fn, if given, sees each block that
 * moves, and must change neither index. */
void fi_move_if(gm_freeindex *dst, gm_freeindex *src, int (*pred)(const struct gm_block *b, void *arg),
                void (*fn)(struct gm_block *b, void *arg), void *arg);
/* Check I1-I4; returns 0 or writes a reason. */
int fi_check(const gm_freeindex *fi, char *why, size_t whylen);

#endif
