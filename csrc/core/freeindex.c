/* freeindex.c -- see freeindex.h for the structure and its invariants. */
#include "freeindex.h"

#include <stdio.h>
#include <string.h>

#include "block.h"

void fi_init(gm_freeindex *fi) { memset(fi, 0, sizeof *fi); }

unsigned fi_bin(size_t size) {
    unsigned sl, fl = fi_fl_sl(size / GM_ALIGN, &sl);
    return fl * FI_SL + sl;
}

/* (size, addr) order: best fit first, lowest address among equals. */
static inline int before(const gm_block *a, const gm_block *b) {
    return a->size < b->size || (a->size == b->size && a->addr < b->addr);
}

void fi_insert(gm_freeindex *fi, gm_block *b) {
    h_assert(b->size && b->size % GM_ALIGN == 0);
    unsigned sl, fl = fi_fl_sl(b->size / GM_ALIGN, &sl);
    gm_block **slot = &fi->bins[fl][sl];
    gm_block *prev = NULL, *cur = *slot;
    while (cur && before(cur, b)) {
        prev = cur;
        cur = cur->lnext;
    }
    b->lprev = prev;
    b->lnext = cur;
    if (cur) cur->lprev = b;
    if (prev)
        prev->lnext = b;
    else
        *slot = b;
    fi_bin_filled(&fi->fl_bitmap, fi->sl_bitmap, fl, sl);
    fi->count++;
    fi->bytes += b->size;
}

void fi_remove(gm_freeindex *fi, gm_block *b) {
    unsigned sl, fl = fi_fl_sl(b->size / GM_ALIGN, &sl);
    h_assert(fi->count > 0 && fi->bytes >= b->size && (b->lprev ? b->lprev->lnext == b : fi->bins[fl][sl] == b));
    if (b->lprev)
        b->lprev->lnext = b->lnext;
    else
        fi->bins[fl][sl] = b->lnext;
    if (b->lnext) b->lnext->lprev = b->lprev;
    b->lprev = b->lnext = NULL;
    if (!fi->bins[fl][sl]) fi_bin_emptied(&fi->fl_bitmap, fi->sl_bitmap, fl, sl);
    fi->count--;
    fi->bytes -= b->size;
}

/* The head of the first non-empty bin at or after bin (fl, sl). */
static inline gm_block *first_bin_from(const gm_freeindex *fi, unsigned fl, unsigned sl) {
    fl = fi_first_bin(fi->fl_bitmap, fi->sl_bitmap, fl, &sl);
    return fl < FI_FL ? fi->bins[fl][sl] : NULL;
}

gm_block *fi_best_fit(const gm_freeindex *fi, size_t size) {
    if (!fi->count) return NULL;
    unsigned sl, fl = fi_fl_sl(size / GM_ALIGN, &sl);
    if (fl >= FI_FL) return NULL;
    /* Own bin: sorted, so the first block that fits is the best in it. */
    for (gm_block *b = fi->bins[fl][sl]; b; b = b->lnext)
        if (b->size >= size) return b;
    /* Any block in a higher bin fits; the head of the first one is the best. */
    return first_bin_from(fi, fl, sl + 1u);
}

gm_block *fi_first_from(const gm_freeindex *fi, size_t size) {
    unsigned sl, fl = fi_fl_sl(size / GM_ALIGN, &sl);
    return first_bin_from(fi, fl, sl);
}

gm_block *fi_next(const gm_freeindex *fi, const gm_block *b) {
    if (b->lnext) return b->lnext;
    unsigned sl, fl = fi_fl_sl(b->size / GM_ALIGN, &sl);
    return first_bin_from(fi, fl, sl + 1u);
}

int fi_each(const gm_freeindex *fi, int (*fn)(gm_block *b, void *arg), void *arg) {
    return fi_each_from(fi, 0, fn, arg);
}

int fi_each_from(const gm_freeindex *fi, size_t size, int (*fn)(gm_block *b, void *arg), void *arg) {
    unsigned sl0, fl0 = fi_fl_sl(size / GM_ALIGN, &sl0);
    for (unsigned fl = fl0; fl < FI_FL; fl++) {
        if (!(fi->fl_bitmap & (1ull << fl))) continue;
        for (unsigned sl = fl == fl0 ? sl0 : 0; sl < FI_SL; sl++) {
            gm_block *b = fi->bins[fl][sl];
            while (b) {
                gm_block *next = b->lnext; /* fn may move b elsewhere */
                int rc = fn(b, arg);
                if (rc) return rc;
                b = next;
            }
        }
    }
    return 0;
}

/* Merge the sorted list b (NULL-terminated, lprev not needed) into dst's bin. */
static void merge_into(gm_block **bin, gm_block *b, void (*fn)(gm_block *b, void *arg), void *arg) {
    gm_block *a = *bin, *prev = NULL, **link = bin;
    while (a || b) {
        gm_block *take;
        if (!b || (a && before(a, b))) {
            take = a;
            a = a->lnext;
        } else {
            take = b;
            b = b->lnext;
            if (fn) fn(take, arg);
        }
        take->lprev = prev;
        *link = take;
        link = &take->lnext;
        prev = take;
    }
    *link = NULL;
}

void fi_move_all(gm_freeindex *dst, gm_freeindex *src, void (*fn)(gm_block *b, void *arg), void *arg) {
    for (unsigned fl = 0; fl < FI_FL; fl++) {
        if (!(src->fl_bitmap & (1ull << fl))) continue;
        for (unsigned sl = 0; sl < FI_SL; sl++) {
            if (!src->bins[fl][sl]) continue;
            merge_into(&dst->bins[fl][sl], src->bins[fl][sl], fn, arg);
            src->bins[fl][sl] = NULL;
        }
        dst->sl_bitmap[fl] |= src->sl_bitmap[fl];
        dst->fl_bitmap |= 1ull << fl;
        src->sl_bitmap[fl] = 0;
    }
    src->fl_bitmap = 0;
    dst->count += src->count;
    dst->bytes += src->bytes;
    src->count = src->bytes = 0;
}

void fi_move_if(gm_freeindex *dst, gm_freeindex *src, int (*pred)(const gm_block *b, void *arg),
                void (*fn)(gm_block *b, void *arg), void *arg) {
    for (unsigned fl = 0; fl < FI_FL; fl++) {
        if (!(src->fl_bitmap & (1ull << fl))) continue;
        for (unsigned sl = 0; sl < FI_SL; sl++) {
            /* Split the bin into the blocks that go and those that stay, both in order. */
            gm_block *go = NULL, **go_tail = &go, *stay = NULL, **stay_tail = &stay, *stay_prev = NULL;
            size_t n = 0, bytes = 0;
            for (gm_block *b = src->bins[fl][sl], *next; b; b = next) {
                next = b->lnext;
                if (pred(b, arg)) {
                    *go_tail = b;
                    go_tail = &b->lnext;
                    n++;
                    bytes += b->size;
                } else {
                    b->lprev = stay_prev;
                    *stay_tail = b;
                    stay_tail = &b->lnext;
                    stay_prev = b;
                }
            }
            *go_tail = *stay_tail = NULL;
            if (!go) continue;
            src->bins[fl][sl] = stay;
            if (!stay) fi_bin_emptied(&src->fl_bitmap, src->sl_bitmap, fl, sl);
            src->count -= n;
            src->bytes -= bytes;
            merge_into(&dst->bins[fl][sl], go, fn, arg);
            fi_bin_filled(&dst->fl_bitmap, dst->sl_bitmap, fl, sl);
            dst->count += n;
            dst->bytes += bytes;
        }
    }
}

int fi_check(const gm_freeindex *fi, char *why, size_t whylen) {
    size_t count = 0, bytes = 0;
    for (unsigned fl = 0; fl < FI_FL; fl++) {
        int fl_set = (fi->fl_bitmap >> fl) & 1u;
        if (fl_set != (fi->sl_bitmap[fl] != 0)) {
            snprintf(why, whylen, "freeindex: first-level bit %u is %d but its bins say otherwise", fl, fl_set);
            return 1;
        }
        for (unsigned sl = 0; sl < FI_SL; sl++) {
            const gm_block *b = fi->bins[fl][sl], *prev = NULL;
            if (((fi->sl_bitmap[fl] >> sl) & 1u) != (b != NULL)) {
                snprintf(why, whylen, "freeindex: bitmap bit for bin %u/%u disagrees with the bin", fl, sl);
                return 1;
            }
            for (; b; prev = b, b = b->lnext) {
                if (fi_bin(b->size) != fl * FI_SL + sl) {
                    snprintf(why, whylen, "freeindex: block %#lx of %zu bytes sits in the wrong bin",
                             (unsigned long)b->addr, b->size);
                    return 1;
                }
                if (b->lprev != prev || (prev && before(b, prev))) {
                    snprintf(why, whylen, "freeindex: bin %u/%u is not a sorted doubly linked list", fl, sl);
                    return 1;
                }
                count++;
                bytes += b->size;
            }
        }
    }
    if (count != fi->count || bytes != fi->bytes) {
        snprintf(why, whylen, "freeindex: holds %zu blocks / %zu bytes but counts %zu / %zu", count, bytes, fi->count,
                 fi->bytes);
        return 1;
    }
    return 0;
}
