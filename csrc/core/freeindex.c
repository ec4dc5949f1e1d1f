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
    gm_fi_side *d = &fi->side[b->small != 0];
    unsigned sl, fl = fi_fl_sl(b->size / GM_ALIGN, &sl);
    gm_block **slot = &d->bins[fl][sl];
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
    fi_bin_filled(&d->fl_bitmap, d->sl_bitmap, fl, sl);
    fi->count++;
    fi->bytes += b->size;
}

void fi_remove(gm_freeindex *fi, gm_block *b) {
    gm_fi_side *d = &fi->side[b->small != 0];
    unsigned sl, fl = fi_fl_sl(b->size / GM_ALIGN, &sl);
    h_assert(fi->count > 0 && fi->bytes >= b->size && (b->lprev ? b->lprev->lnext == b : d->bins[fl][sl] == b));
    if (b->lprev)
        b->lprev->lnext = b->lnext;
    else
        d->bins[fl][sl] = b->lnext;
    if (b->lnext) b->lnext->lprev = b->lprev;
    b->lprev = b->lnext = NULL;
    if (!d->bins[fl][sl]) fi_bin_emptied(&d->fl_bitmap, d->sl_bitmap, fl, sl);
    fi->count--;
    fi->bytes -= b->size;
}

/* The head of the first non-empty bin at or after bin (fl, sl). */
static inline gm_block *first_bin_from(const gm_fi_side *d, unsigned fl, unsigned sl) {
    fl = fi_first_bin(d->fl_bitmap, d->sl_bitmap, fl, &sl);
    return fl < FI_FL ? d->bins[fl][sl] : NULL;
}

static gm_block *best_fit(const gm_fi_side *d, size_t size) {
    unsigned sl, fl = fi_fl_sl(size / GM_ALIGN, &sl);
    if (fl >= FI_FL) return NULL;
    /* Own bin: sorted, so the first block that fits is the best in it. */
    for (gm_block *b = d->bins[fl][sl]; b; b = b->lnext)
        if (b->size >= size) return b;
    /* Any block in a higher bin fits; the head of the first one is the best. */
    return first_bin_from(d, fl, sl + 1u);
}

gm_block *fi_best_fit(const gm_freeindex *fi, size_t size) { return fi->count ? best_fit(&fi->side[0], size) : NULL; }

gm_block *fi_best_fit_small(const gm_freeindex *fi, size_t size) {
    return fi->count ? best_fit(&fi->side[1], size) : NULL;
}

gm_block *fi_first_from(const gm_freeindex *fi, size_t size) {
    unsigned sl, fl = fi_fl_sl(size / GM_ALIGN, &sl);
    return first_bin_from(&fi->side[0], fl, sl);
}

gm_block *fi_next(const gm_freeindex *fi, const gm_block *b) {
    if (b->lnext) return b->lnext;
    unsigned sl, fl = fi_fl_sl(b->size / GM_ALIGN, &sl);
    return first_bin_from(&fi->side[b->small != 0], fl, sl + 1u);
}

int fi_each(const gm_freeindex *fi, int (*fn)(gm_block *b, void *arg), void *arg) {
    return fi_each_from(fi, 0, fn, arg);
}

static int each_from(const gm_fi_side *d, size_t size, int (*fn)(gm_block *b, void *arg), void *arg) {
    unsigned sl0, fl0 = fi_fl_sl(size / GM_ALIGN, &sl0);
    for (unsigned fl = fl0; fl < FI_FL; fl++) {
        if (!(d->fl_bitmap & (1ull << fl))) continue;
        for (unsigned sl = fl == fl0 ? sl0 : 0; sl < FI_SL; sl++) {
            gm_block *b = d->bins[fl][sl];
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

int fi_each_from(const gm_freeindex *fi, size_t size, int (*fn)(gm_block *b, void *arg), void *arg) {
    int rc = each_from(&fi->side[0], size, fn, arg);
    return rc ? rc : each_from(&fi->side[1], size, fn, arg);
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

static void move_all(gm_fi_side *dst, gm_fi_side *src, void (*fn)(gm_block *b, void *arg), void *arg) {
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
}

void fi_move_all(gm_freeindex *dst, gm_freeindex *src, void (*fn)(gm_block *b, void *arg), void *arg) {
    move_all(&dst->side[0], &src->side[0], fn, arg);
    move_all(&dst->side[1], &src->side[1], fn, arg);
    dst->count += src->count;
    dst->bytes += src->bytes;
    src->count = src->bytes = 0;
}

static void move_if(gm_freeindex *dst, gm_freeindex *src, int k, int (*pred)(const gm_block *b, void *arg),
                    void (*fn)(gm_block *b, void *arg), void *arg) {
    gm_fi_side *ds = &dst->side[k], *ss = &src->side[k];
    for (unsigned fl = 0; fl < FI_FL; fl++) {
        if (!(ss->fl_bitmap & (1ull << fl))) continue;
        for (unsigned sl = 0; sl < FI_SL; sl++) {
            /* Split the bin into the blocks that go and those that stay, both in order. */
            gm_block *go = NULL, **go_tail = &go, *stay = NULL, **stay_tail = &stay, *stay_prev = NULL;
            size_t n = 0, bytes = 0;
            for (gm_block *b = ss->bins[fl][sl], *next; b; b = next) {
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
            ss->bins[fl][sl] = stay;
            if (!stay) fi_bin_emptied(&ss->fl_bitmap, ss->sl_bitmap, fl, sl);
            src->count -= n;
            src->bytes -= bytes;
            merge_into(&ds->bins[fl][sl], go, fn, arg);
            fi_bin_filled(&ds->fl_bitmap, ds->sl_bitmap, fl, sl);
            dst->count += n;
            dst->bytes += bytes;
        }
    }
}

void fi_move_if(gm_freeindex *dst, gm_freeindex *src, int (*pred)(const gm_block *b, void *arg),
                void (*fn)(gm_block *b, void *arg), void *arg) {
    move_if(dst, src, 0, pred, fn, arg);
    move_if(dst, src, 1, pred, fn, arg);
}

static int check_side(const gm_fi_side *fi, int k, size_t *count_out, size_t *bytes_out, char *why, size_t whylen) {
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
                if ((b->small != 0) != k) {
                    snprintf(why, whylen, "freeindex: block %#lx sits among the blocks of the other class",
                             (unsigned long)b->addr);
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
    *count_out += count;
    *bytes_out += bytes;
    return 0;
}

int fi_check(const gm_freeindex *fi, char *why, size_t whylen) {
    size_t count = 0, bytes = 0;
    if (check_side(&fi->side[0], 0, &count, &bytes, why, whylen) ||
        check_side(&fi->side[1], 1, &count, &bytes, why, whylen))
        return 1;
    if (count != fi->count || bytes != fi->bytes) {
        snprintf(why, whylen, "freeindex: holds %zu blocks / %zu bytes but counts %zu / %zu", count, bytes, fi->count,
                 fi->bytes);
        return 1;
    }
    return 0;
}
